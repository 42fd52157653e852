"""The host's cost: a model whose compute is negligible, served through gRPC, against the same forward in process.

`python bench/host_overhead.py` starts `logitserve serve --demo-shape tiny` (1 layer, hidden 64, vocabulary
1024: the forward costs next to nothing) and times, for each workload (256x16, 64x64, 8x512) and output
(top-k 20, token logprobs), the in-process floor (one batched transformers forward of the [B, L] batch, its
reductions, the arrays on the host) and the same request served and reassembled by `TeacherClient`, cases
interleaved run by run. What the served path adds over the floor is the host's cost: reported per token and
per sequence. Every figure is the median of --repeats; the ratio served / floor is the signal.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from batching import floor_cases  # noqa: E402
from run import interleaved, start_server, write_result  # noqa: E402

WORKLOADS = ("256x16", "64x64", "8x512")


def shape_of(name: str) -> tuple[int, int]:
    n, _, length = name.partition("x")
    return int(n), int(length)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--device", default="cpu")
    p.add_argument("--server-args", default="", help="more `logitserve serve` flags")
    p.add_argument("--min-ratio", type=float, default=None, help="exit 1 when a served / floor ratio is below this")
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from logitserve.client import TeacherClient, Wanted
    from logitserve.demo import demo_dir

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(demo_dir("causal", "tiny"), dtype=torch.float32).eval()
    model.to(args.device)
    proc, address = start_server("--demo-shape", "tiny", "--device", args.device, *args.server_args.split())
    rows = []
    try:
        with TeacherClient(address, wait_ready=120) as client:
            for w in args.workloads.split(","):
                n, length = shape_of(w)
                rng = np.random.default_rng(0)
                seqs = [rng.integers(3, 1024, length) for _ in range(n)]
                floors = floor_cases(model, seqs, args.device)
                cases = {"floor topk20": floors["floor topk20"], "floor logprobs": floors["floor logprobs"],
                         "served topk20": lambda: client.submit(seqs, Wanted(topk=20)).result(),
                         "served logprobs": lambda: client.submit(seqs, Wanted(logprobs=True)).result()}
                times = interleaved(cases, args.repeats)
                for output in ("topk20", "logprobs"):
                    floor = statistics.median(times[f"floor {output}"])
                    served = statistics.median(times[f"served {output}"])
                    extra = served - floor
                    rows.append({"workload": w, "output": output, "floor_s": floor, "served_s": served,
                                 "ratio": floor / served, "host_us_per_token": 1e6 * extra / (n * length),
                                 "host_us_per_sequence": 1e6 * extra / n,
                                 "floor_runs_s": times[f"floor {output}"], "served_runs_s": times[f"served {output}"]})
                    r = rows[-1]
                    print(f"{w:>7} {output:<9} floor {floor * 1e3:8.2f} ms  served {served * 1e3:8.2f} ms  "
                          f"served/floor {r['ratio']:.2f}x  host {r['host_us_per_sequence']:7.1f} us/seq "
                          f"{r['host_us_per_token']:6.2f} us/tok", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
              "note": f"{args.device}, tiny demo model, median of {args.repeats}", "rows": rows}
    out = write_result(result, "host_overhead")
    print("\n| workload | output | floor ms | served ms | served / floor | host us / seq | host us / tok |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workload']} | {r['output']} | {r['floor_s'] * 1e3:.2f} | {r['served_s'] * 1e3:.2f} | "
              f"{r['ratio']:.2f} | {r['host_us_per_sequence']:.1f} | {r['host_us_per_token']:.2f} |")
    print(f"\nJSON: {out}")
    if args.min_ratio is not None and any(r["ratio"] < args.min_ratio for r in rows):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
