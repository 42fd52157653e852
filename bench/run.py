"""Benchmark: logitserve over loopback gRPC against the same computation in-process, on the demo model.

One command (`make bench`) writes bench/results/<date>.json and prints a markdown table.
Every figure is a median of --repeats runs taken in the same run, alternating cases, so
the ratios are the signal and the absolute numbers only context.
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


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch
    from transformers.utils import logging as hf_logging

    from logitserve.client import TeacherClient
    from logitserve.demo import demo_dir
    from logitserve.engine import Engine, EngineConfig
    from logitserve.loading import load_model
    from logitserve.spec import Job, LogprobsOpts, TopKOpts

    hf_logging.disable_progress_bar()
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 32000, args.len).astype(np.int32) for _ in range(args.seqs)]
    tokens = args.seqs * args.len
    engine = Engine(load_model(demo_dir("causal")), EngineConfig(chunk_size=args.chunk))
    proc, address = start_server("--logprob-chunk-size", str(args.chunk))

    cases = {
        "logprobs": (lambda c: c.logprobs(seqs), Job(sequences=tuple(seqs), logprobs=LogprobsOpts())),
        "topk k=20": (lambda c: c.topk(seqs, 20), Job(sequences=tuple(seqs), topk=TopKOpts(20))),
    }
    times: dict[str, list[float]] = {f"{n} {w}": [] for n in cases for w in ("in-process", "grpc")}
    try:
        with TeacherClient(address) as client:
            for name, (call, job) in cases.items():     # warm-up
                call(client)
                list(engine.run(job))
            for _ in range(args.repeats):
                for name, (call, job) in cases.items():
                    times[f"{name} in-process"].append(timed(lambda: list(engine.run(job))))
                    times[f"{name} grpc"].append(timed(lambda: call(client)))
        server_peak = vm_hwm(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)

    rows = []
    for name in cases:
        base = statistics.median(times[f"{name} in-process"])
        for where in ("in-process", "grpc"):
            med = statistics.median(times[f"{name} {where}"])
            rows.append({"case": f"{name} ({where})", "median_s": med, "tokens_per_s": tokens / med,
                         "ratio_vs_in_process": base / med, "runs_s": times[f"{name} {where}"]})
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
                   f"{torch.get_num_threads()} threads",
        "workload": f"demo model, {args.seqs} x {args.len} tokens, chunk {args.chunk}, median of {args.repeats}",
        "server_peak_rss_gib": server_peak / 2**30,
        "rows": rows,
    }
    out = Path(args.out or Path(__file__).parent / "results" / f"bench-{datetime.now():%Y%m%d-%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"{result['date']} | {result['machine']} | {result['workload']}\n")
    print("| case | median s | tokens/s | × in-process |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['median_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['ratio_vs_in_process']:.2f} |")
    print(f"\nserver peak RSS {result['server_peak_rss_gib']:.2f} GiB; JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
