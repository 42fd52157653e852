"""Token-logprob throughput of tp x cp x pp layouts on this machine, as ratios to tp = cp = pp = 1 in the same run.

`python bench/parallel.py` starts `logitserve serve --tp T --cp C --pp P` for each layout (`TxC` or `TxCxP`) on the
body-heavy demo (`--model-shape body`: 8 layers, hidden 768), sends each request shape (8 x 512 and 64 x 64 tokens)
for token logprobs --repeats times and reports the median tokens/s. The machine's cores are shared out: every
rank gets cores / world threads (1x1 gets them all). Under --pp the server logs each batch's bubble fraction
(1 - the stages' busy seconds / their wall seconds, measured by the ranks); the table shows its median.
On a 2-core CPU the TP and CP layouts cannot be faster; a pipeline keeps both cores busy with one thread each.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from run import start_server, write_result  # noqa: E402

from logitserve.client import TeacherClient  # noqa: E402

BUBBLE = re.compile(r"pipeline batch: bubble ([\d.]+)")


def measure(layout: str, shape: str, workloads: list[tuple[int, int]], repeats: int) -> list[dict]:
    dims = [int(x) for x in layout.split("x")] + [1]
    tp, cp, pp = dims[0], dims[1], dims[2]
    world = tp * cp * pp
    threads = max(1, (os.cpu_count() or 1) // world)
    proc, address = start_server("--demo-shape", shape, "--tp", str(tp), "--cp", str(cp), "--pp", str(pp),
                                 "--threads", str(threads))
    rows = []
    try:
        with TeacherClient(address) as c:
            for n, length in workloads:
                rng = np.random.default_rng(0)
                seqs = [rng.integers(3, 32000, length) for _ in range(n)]
                c.logprobs(seqs)   # warm-up
                runs = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    c.logprobs(seqs)
                    runs.append(time.perf_counter() - t0)
                med = statistics.median(runs)
                rows.append({"layout": layout, "workload": f"{n}x{length}", "threads_per_rank": threads,
                             "median_s": med, "tokens_per_s": n * length / med, "runs_s": runs})
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    bubbles = [float(b) for b in BUBBLE.findall(out or "")]
    if pp > 1:       # the log holds warm-up and timed batches of every workload in order: (1 + repeats) each
        per = 1 + repeats
        for k, row in enumerate(rows):
            mine = bubbles[k * per + 1 : (k + 1) * per]
            row["bubble"] = statistics.median(mine) if mine else None
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="1x1,2x1,1x2,1x1x2,2x1x2")
    p.add_argument("--model-shape", default="body", choices=["demo", "body"])
    p.add_argument("--workloads", default="8x512,64x64")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    workloads = [tuple(int(x) for x in w.split("x")) for w in args.workloads.split(",")]
    rows = []
    for layout in args.layouts.split(","):
        rows += measure(layout, args.model_shape, workloads, args.repeats)
    out = write_result({"model_shape": args.model_shape, "repeats": args.repeats, "rows": rows}, "parallel")
    print(f"token logprobs, demo shape {args.model_shape}, median of {args.repeats}; cores / world threads per rank\n")
    print("| tp x cp x pp | workload | threads/rank | median s | tokens/s | × 1x1 | bubble |\n"
          "|---|---|---:|---:|---:|---:|---:|")
    base = {r["workload"]: r["tokens_per_s"] for r in rows if r["layout"] == args.layouts.split(",")[0]}
    for r in rows:
        bubble = f"{r['bubble']:.2f}" if r.get("bubble") is not None else ""
        print(f"| {r['layout']} | {r['workload']} | {r['threads_per_rank']} | {r['median_s']:.3f} | "
              f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base[r['workload']]:.2f} | {bubble} |")
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
