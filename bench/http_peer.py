"""The HTTP routes against vLLM's server on the same request: /v1/completions prompt_logprobs k=20 and k=100.

`python bench/http_peer.py` (make bench-http) starts `logitserve serve --http-port` on the demo model,
times the very body vLLM gets (8 prompts x 512 token ids, max_tokens 1, prompt_logprobs k,
temperature 1), then the same outputs over logitserve's gRPC (logprobs, ranks, top-k as
logprobs: the information in the JSON, as raw tensors), then vLLM's CPU server on the same
weights and body. Each HTTP time runs to the answer's last byte (the client's JSON parsing, the same
for both servers, is not the server's work; each answer is parsed and checked once). Medians of
--repeats, all in one run; ratios are the signal. It also times
the JSON encoding alone (orjson vs the standard library) on logitserve's k=100 answer.
Writes bench/results/http-<time>.json and prints a markdown table.
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
from run import write_result  # noqa: E402


def _start(*extra: str) -> tuple[subprocess.Popen, str, str]:
    """`logitserve serve --http-port 0` as a user starts it; (process, gRPC address, HTTP base URL)."""
    cmd = [sys.executable, "-m", "logitserve.server.cli", "serve", "--host", "127.0.0.1", "--port", "0",
           "--http-port", "8741", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        m = re.search(r"logitserve: serving \S+ on [\d.]+:(\d+)", line)
        if m:
            return proc, f"127.0.0.1:{m.group(1)}", "http://127.0.0.1:8741"
    raise RuntimeError("server did not start")


def _timed(fn, repeats: int) -> list[float]:
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ks", type=int, nargs="+", default=[20, 100])
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--shape", default="demo", help="the demo shape: demo, or body (a body-heavy model)")
    args = p.parse_args()

    import orjson

    from logitserve.client import TeacherClient
    from logitserve.demo import demo_dir
    from vllm_peer import _post, post_raw

    model_dir = demo_dir("causal", args.shape)
    rng = np.random.default_rng(0)
    ids = [rng.integers(3, 32000, args.len).tolist() for _ in range(args.seqs)]
    tokens = args.seqs * args.len
    rows: list[dict] = []

    def add(group, case, runs, **extra):
        med = statistics.median(runs)
        rows.append({"group": group, "case": case, "median_s": med, "tokens_per_s": tokens / med, "runs_s": runs,
                     **extra})
        print(f"{group:28s} {case:32s} {med * 1e3:9.1f} ms  {tokens / med:9.0f} tok/s", flush=True)

    def body(k):
        return {"prompt": ids, "max_tokens": 1, "prompt_logprobs": k, "temperature": 1.0}

    proc, address, base = _start("--demo-shape", args.shape)
    encode = {}
    try:
        for k in args.ks:
            resp, size = _post(base + "/v1/completions", body(k))
            assert len(resp["choices"]) == args.seqs and resp["choices"][0]["prompt_logprobs"][1]
            add("logitserve HTTP", f"/v1/completions k={k}",
                _timed(lambda: post_raw(base + "/v1/completions", body(k)), args.repeats), response_bytes=size)
            if k == max(args.ks):
                encode["orjson"] = _timed(lambda: orjson.dumps(resp), args.repeats)
                encode["json"] = _timed(lambda: json.dumps(resp, separators=(",", ":")).encode(), args.repeats)
        with TeacherClient(address) as c:
            seqs = [np.asarray(s) for s in ids]
            for k in args.ks:
                add("logitserve gRPC", f"logprobs+ranks+top-k k={k}",
                    _timed(lambda: c.forward(seqs, logprobs=True, token_ranks=True, topk=k, topk_as_logprobs=True),
                           args.repeats))
    finally:
        proc.terminate()
        proc.wait(30)
    note = ""
    if not args.no_vllm:
        try:
            import vllm_peer

            py = vllm_peer.ensure_venv()
            for k, r in vllm_peer.server(py, str(model_dir), ids, args.ks, args.repeats).items():
                add("vLLM server", f"/v1/completions k={k}", r["times"], response_bytes=r["bytes"])
        except Exception as e:   # report logitserve alone, and say why
            note = f"vLLM peer not measured: {e}"
            print(note, flush=True)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "workload": f"{args.shape} model, {args.seqs} x {args.len} token ids, max_tokens 1, median of {args.repeats}",
              "json_encode_s": {n: statistics.median(v) for n, v in encode.items()}, "vllm_note": note, "rows": rows}
    out = write_result(result, "http")
    by = {(r["group"], r["case"].split("k=")[-1]): r["median_s"] for r in rows}
    print("\n| k | logitserve HTTP | logitserve gRPC | vLLM server | HTTP vs vLLM | gRPC vs vLLM |\n|---|---|---|---|---|---|")
    for k in map(str, args.ks):
        h, g, v = by.get(("logitserve HTTP", k)), by.get(("logitserve gRPC", k)), by.get(("vLLM server", k))
        ratio = (lambda a: f"{v / a:.1f}x" if v and a else "-")
        print(f"| {k} | {h * 1e3:.0f} ms | {g * 1e3:.0f} ms | {v * 1e3 if v else float('nan'):.0f} ms | "
              f"{ratio(h)} | {ratio(g)} |")
    enc = result["json_encode_s"]
    if enc:
        print(f"\nJSON encoding of the k={max(args.ks)} answer: orjson {enc['orjson'] * 1e3:.0f} ms, "
              f"json {enc['json'] * 1e3:.0f} ms ({enc['json'] / enc['orjson']:.1f}x)")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
