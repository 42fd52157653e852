"""Overlap of the prefetching teacher with a student's step: a loop with a simulated step time, against its bound.

`python bench/prefetch.py` serves the demo teacher, measures the teacher's time per batch
(8 x 128 tokens, top-64 with tail), then runs a student loop whose step sleeps 1.5x that
long: sequentially (request, wait, step) and through PrefetchingTeacher at depth 1 and 2.
The bound is the steps alone (n x step); the ratio is bound / loop time, median of --repeats.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from run import start_server, write_result  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, default=12)
    args = ap.parse_args()
    from logitserve.client import TeacherClient, Wanted
    from logitserve.client.prefetch import PrefetchingTeacher

    proc, address = start_server("--logprob-chunk-size", "512")
    rng = np.random.default_rng(0)
    batches = [[rng.integers(3, 32000, 128) for _ in range(8)] for _ in range(args.batches)]
    wanted = Wanted(topk=64, topk_as_logprobs=True, topk_tail=True)
    try:
        with TeacherClient(address) as c:
            c.submit(batches[0], wanted).result()                              # warm-up
            t0 = time.perf_counter()
            for b in batches:
                c.submit(b, wanted).result()
            teacher = (time.perf_counter() - t0) / len(batches)
            step = 1.5 * teacher
            bound = step * len(batches)

            def sequential():
                for b in batches:
                    c.submit(b, wanted).result()
                    time.sleep(step)

            def prefetched(depth):
                def run():
                    for _ in PrefetchingTeacher(c, batches, wanted, depth=depth):
                        time.sleep(step)
                return run

            loops = {"sequential": sequential, "prefetch depth 1": prefetched(1), "prefetch depth 2": prefetched(2)}
            times = {name: [] for name in loops}
            for _ in range(args.repeats):
                for name, fn in loops.items():
                    t = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t)
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"teacher {teacher * 1e3:.0f} ms per batch (8 x 128, top-64 + tail); simulated step {step * 1e3:.0f} ms; "
          f"{len(batches)} batches, bound {bound:.2f} s; median of {args.repeats}\n")
    print("| loop | seconds | bound / loop |\n|---|---:|---:|")
    result = {"teacher_s": teacher, "step_s": step, "bound_s": bound, "loops": {}}
    for name, ts in times.items():
        m = statistics.median(ts)
        result["loops"][name] = {"median_s": m, "ratio_to_bound": bound / m, "runs": ts}
        print(f"| {name} | {m:.2f} | {bound / m:.2f} |")
    print(f"\nwrote {write_result(result, 'prefetch')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
