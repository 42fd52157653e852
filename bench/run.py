"""The benchmark: logitserve against the in-process floor, a raw gRPC stream and vLLM, on the demo model.

`make bench` (python bench/run.py) writes bench/results/bench-<time>.json and prints a markdown
table. Workload: 8 sequences x 512 tokens; every figure is the median of --repeats runs, all from
the same run, with the cases of a group interleaved run by run, so ratios are the signal.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))


def start_server(*extra: str) -> tuple[subprocess.Popen, str]:
    """`logitserve serve` on a free loopback port, as a user starts it; returns (process, address)."""
    cmd = [sys.executable, "-m", "logitserve.server.cli", "serve", "--host", "127.0.0.1", "--port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        m = re.search(r"logitserve: serving \S+ on [\d.]+:(\d+)", line)
        if m:
            return proc, f"127.0.0.1:{m.group(1)}"
    raise RuntimeError("server did not start")


def vm_hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(x for x in f if x.startswith("VmHWM")).split()[1]) * 1024


def write_result(result: dict, prefix: str) -> Path:
    """bench/results/<prefix>-<time>.json"""
    out = Path(__file__).parent / "results" / f"{prefix}-{datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return out


def interleaved(cases: dict, repeats: int) -> dict[str, list[float]]:
    """Run every case once to warm up, then `repeats` rounds of all cases; seconds per run."""
    for fn in cases.values():
        fn()
    times = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return times


def wire_bytes(address: str, request) -> int:
    """Bytes of every response message of one request, as serialized on the wire."""
    import grpc

    from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as ch:
        return sum(r.ByteSize() for r in pb_grpc.LogitServeStub(ch).Forward(iter([request]), timeout=600))


def latencies(address: str, seq, clients: int, per_client: int) -> list[float]:
    import asyncio

    from logitserve.client import AsyncTeacherClient

    async def one(c, out):
        for _ in range(per_client):
            t = time.perf_counter()
            await c.topk([seq], 20, dtype="bf16")
            out.append(time.perf_counter() - t)

    async def main():
        cs = [AsyncTeacherClient(address) for _ in range(clients)]
        out: list[float] = []
        await asyncio.gather(*(one(c, out) for c in cs))
        for c in cs:
            await c.close()
        return out
    return asyncio.run(main())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM peer")
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from cases import in_process_cases, served_cases
    from logitserve.client.wire import build_request
    from logitserve.demo import demo_dir

    hf_logging.disable_progress_bar()
    model_dir = demo_dir("causal")
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 32000, args.len) for _ in range(args.seqs)]
    tokens = args.seqs * args.len
    rows: list[dict] = []

    def add(group, name, runs, note="", **extra):
        med = statistics.median(runs)
        rows.append({"group": group, "case": name, "median_s": med, "tokens_per_s": tokens / med, "runs_s": runs,
                     "note": note, **extra})

    # 1. in-process: forward only, the floor (transformers forward + the same post-processing), our engine
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for name, runs in interleaved(in_process_cases(model, model_dir, seqs), args.repeats).items():
        add("in-process", name, runs)
    del model

    # 2. served over loopback gRPC (default server), with wire bytes per token
    proc, address = start_server()
    try:
        from logitserve.client import TeacherClient

        with TeacherClient(address) as client:
            cases, wanted = served_cases(client, seqs)
            for name, runs in interleaved(cases, args.repeats).items():
                req = build_request("w", seqs, wanted[name])
                add("logitserve gRPC", name, runs, wire_bytes_per_token=wire_bytes(address, req) / tokens)
        lat = {n: latencies(address, seqs[0], n, max(2, 24 // n)) for n in (1, 8, 32)}
        server_peak = vm_hwm(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)

    # 3. overlap off: each piece is sent before the next chunk is computed
    proc, address = start_server("--no-overlap")
    try:
        with TeacherClient(address) as client:
            cases, _ = served_cases(client, seqs, only=("topk k=20 bf16", "full logits bf16"))
            for name, runs in interleaved(cases, args.repeats).items():
                add("logitserve gRPC, --no-overlap", name, runs)
    finally:
        proc.terminate()
        proc.wait(30)

    # 4. the loopback ceiling: raw bytes in 4 MiB messages, as many bytes as full logits bf16
    from raw_stream import ceiling

    raw = subprocess.Popen([sys.executable, str(Path(__file__).parent / "raw_stream.py"), "--serve", "8733"],
                           stdout=subprocess.PIPE, text=True)
    raw.stdout.readline()
    full_bytes = tokens * 32000 * 2
    try:
        raw_runs = [ceiling("127.0.0.1:8733", full_bytes, 4 << 20) for _ in range(args.repeats + 1)][1:]
    finally:
        raw.terminate()
        raw.wait(30)
    add("raw gRPC stream", "raw bytes, 4 MiB messages (same bytes as full logits bf16)", raw_runs)

    # 5. vLLM's CPU build on the same weights and tokens
    vllm_note = ""
    if not args.no_vllm:
        try:
            import vllm_peer

            py = vllm_peer.ensure_venv()
            ids = [s.tolist() for s in seqs]
            for k, runs in vllm_peer.offline(py, str(model_dir), ids, [1, 20, 100], args.repeats).items():
                add("vLLM offline", f"prompt_logprobs k={k}", runs)
            for k, r in vllm_peer.server(py, str(model_dir), ids, [1, 20, 100], args.repeats).items():
                add("vLLM server", f"prompt_logprobs k={k}", r["times"], wire_bytes_per_token=r["bytes"] / tokens)
        except Exception as e:   # report logitserve alone, and say why
            vllm_note = f"vLLM peer not measured: {e}"
            print(vllm_note, flush=True)

    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "workload": f"demo model, {args.seqs} x {args.len} tokens, median of {args.repeats}",
        "server_peak_rss_gib": server_peak / 2**30,
        "latency_topk20_bf16_1x512": {str(n): {"p50_ms": 1e3 * float(np.percentile(v, 50)),
                                               "p99_ms": 1e3 * float(np.percentile(v, 99)), "n": len(v)}
                                      for n, v in lat.items()},
        "raw_stream_gb_s": full_bytes / statistics.median(raw_runs) / 1e9,
        "vllm_note": vllm_note,
        "rows": rows,
    }
    out = write_result(result, "bench")
    from report import markdown

    print(markdown(result))
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
