"""Token-logprob throughput of tp x cp layouts on this machine, as ratios to tp = cp = 1 in the same run.

`python bench/parallel.py` starts `logitserve serve --tp T --cp C` for each layout on the demo model,
sends 8 x 512 tokens for token logprobs --repeats times and reports the median tokens/s. On a 2-core
CPU the sharded layouts cannot be faster; the ratios show what the collectives cost.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from run import start_server  # noqa: E402

from logitserve.client import TeacherClient  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layouts", default="1x1,2x1,1x2")
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 32000, args.len) for _ in range(args.seqs)]
    tokens = args.seqs * args.len
    rows = []
    for layout in args.layouts.split(","):
        tp, cp = layout.split("x")
        proc, address = start_server("--tp", tp, "--cp", cp)
        try:
            with TeacherClient(address) as c:
                c.logprobs(seqs)   # warm-up
                runs = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    c.logprobs(seqs)
                    runs.append(time.perf_counter() - t0)
        finally:
            proc.terminate()
            proc.wait(60)
        rows.append({"layout": layout, "median_s": statistics.median(runs),
                     "tokens_per_s": tokens / statistics.median(runs), "runs_s": runs})
    base = rows[0]["tokens_per_s"]
    out = Path(__file__).parent / "results" / f"parallel-{datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "rows": rows},
                              indent=2))
    print(f"token logprobs, demo model, {args.seqs} x {args.len} tokens, median of {args.repeats}\n")
    print("| tp x cp | median s | tokens/s | × 1x1 |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['layout']} | {r['median_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.2f} |")
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
