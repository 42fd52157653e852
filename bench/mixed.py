"""Small requests beside bulk ones: what --short-step-ms buys a small request's latency and costs bulk throughput.

`python bench/mixed.py` starts `logitserve serve --demo-shape demo` for each layout (`TxC` or `TxCxP`) twice, with
short steps (--short-step-ms, default 10) and without (0), alternating --repeats times. In each run a bulk client
sends 4 x 512-token logprobs requests back to back while a small client sends 16-token ones back to back (the
chaos test's well-behaved client); after --seconds it reports the small requests' p50 and p99 latency and the bulk
client's tokens/s. Before the bulk client starts, the small client runs alone for a third of that (unloaded p50).
The table shows medians over the repeats and the ratios short / full steps, measured in the same run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from run import start_server, write_result  # noqa: E402

from logitserve.client import TeacherClient  # noqa: E402


def _small(address: str, until: float, out: list) -> None:
    rng = np.random.default_rng(1)
    seqs = [rng.integers(3, 32000, 16) for _ in range(8)]
    with TeacherClient(address) as c:
        k = 0
        while time.monotonic() < until:
            t0 = time.monotonic()
            c.logprobs([seqs[k % len(seqs)]])
            out.append(time.monotonic() - t0)
            k += 1


def _bulk(address: str, until: float, out: list) -> None:
    rng = np.random.default_rng(2)
    seqs = [rng.integers(3, 32000, 512) for _ in range(4)]
    with TeacherClient(address) as c:
        while time.monotonic() < until:
            c.logprobs(seqs)
            out.append((time.monotonic(), 4 * 512))


def run_once(layout: str, short_ms: float, seconds: float) -> dict:
    tp, cp, pp = ([int(x) for x in layout.split("x")] + [1, 1])[:3]
    proc, address = start_server("--demo-shape", "demo", "--tp", str(tp), "--cp", str(cp), "--pp", str(pp),
                                 "--short-step-ms", str(short_ms))
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()   # drain the log
    try:
        alone: list = []
        _small(address, time.monotonic() + seconds / 3, alone)
        small, bulk = [], []
        start = time.monotonic()
        until = start + seconds
        t = threading.Thread(target=_bulk, args=(address, until, bulk))
        t.start()
        time.sleep(1.0)
        _small(address, until, small)
        t.join()
    finally:
        proc.terminate()
        proc.wait(60)
    small.sort()
    return {"layout": layout, "short_step_ms": short_ms, "unloaded_p50_s": statistics.median(alone),
            "p50_s": statistics.median(small), "p99_s": small[min(len(small) - 1, int(0.99 * len(small)))],
            "bulk_tokens_per_s": sum(n for _, n in bulk) / (until - start), "small_requests": len(small)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="1x1,2x1,1x1x2")
    p.add_argument("--short-step-ms", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    rows = []
    for layout in args.layouts.split(","):
        for _ in range(args.repeats):
            for short in (args.short_step_ms, 0.0):
                rows.append(run_once(layout, short, args.seconds))
    out = write_result({"seconds": args.seconds, "repeats": args.repeats, "rows": rows}, "mixed")
    print(f"16-token requests beside 4 x 512-token ones, demo shape, {args.seconds:g} s runs, median of "
          f"{args.repeats}\n")
    print("| layout | steps | unloaded p50 ms | p50 ms | p99 ms | bulk tokens/s | p50 short/full | bulk short/full |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|")
    for layout in args.layouts.split(","):
        med = {s: {k: statistics.median(r[k] for r in rows if r["layout"] == layout and r["short_step_ms"] == s)
                   for k in ("unloaded_p50_s", "p50_s", "p99_s", "bulk_tokens_per_s")}
               for s in (args.short_step_ms, 0.0)}
        for s, name in ((args.short_step_ms, f"short ({args.short_step_ms:g} ms)"), (0.0, "full")):
            m = med[s]
            ratios = (f"{m['p50_s'] / med[0.0]['p50_s']:.2f} | "
                      f"{m['bulk_tokens_per_s'] / med[0.0]['bulk_tokens_per_s']:.2f}") if s else " | "
            print(f"| {layout} | {name} | {m['unloaded_p50_s'] * 1e3:.1f} | {m['p50_s'] * 1e3:.1f} | "
                  f"{m['p99_s'] * 1e3:.1f} | {m['bulk_tokens_per_s']:,.0f} | {ratios} |")
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
