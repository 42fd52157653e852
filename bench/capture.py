"""Offline capture throughput against served top-k throughput, same server, same run.

`python bench/capture.py` serves the demo teacher, writes a jsonl of --samples x --length
token ids, then times (interleaved, median of --repeats): the same requests through the
client with nothing written ("served"), `capture` into safetensors shards at fp32 and
bf16 (top-64 + tail + ids + offsets), and `capture --format axolotl | distillkit | hf`
(parquet). Reports tokens/s, the ratio to served and to the fp32 safetensors capture of
the same run, and bytes per token on disk.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from run import start_server, write_result  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from logitserve.client import TeacherClient, Wanted
    from logitserve.client.capture import CaptureConfig, _batches, capture

    work = Path(tempfile.mkdtemp(prefix="bench-capture-"))
    rng = np.random.default_rng(0)
    data = work / "data.jsonl"
    samples = [rng.integers(3, 32000, args.length) for _ in range(args.samples)]
    data.write_text("".join(json.dumps({"ids": s.tolist()}) + "\n" for s in samples))
    tokens = args.samples * args.length
    paths = {"fp32": ("safetensors", "fp32"), "bf16": ("safetensors", "bf16"), "axolotl": ("axolotl", "fp32"),
             "distillkit": ("distillkit", "fp32"), "hf": ("hf", "fp32")}
    cfg = {name: CaptureConfig(topk=args.topk, dtype=d, format=f, shard_samples=64, batch_samples=16, in_flight=4)
           for name, (f, d) in paths.items()}
    proc, address = start_server("--logprob-chunk-size", "512")
    times: dict[str, list] = {"served": [], **{f"capture {name}": [] for name in paths}}
    sizes = {}
    try:
        with TeacherClient(address) as c:
            wanted = Wanted(topk=args.topk, topk_as_logprobs=True, topk_tail=True)

            def served():
                pending = []
                for b, _ in _batches(samples, [None] * len(samples), 16):
                    pending.append(c.submit(b, wanted))
                    if len(pending) >= 4:
                        pending.pop(0).result()
                [f.result() for f in pending]

            served()                                                    # warm-up
            for _ in range(args.repeats):
                t = time.perf_counter()
                served()
                times["served"].append(time.perf_counter() - t)
                for name in paths:
                    out = work / name
                    shutil.rmtree(out, ignore_errors=True)
                    t = time.perf_counter()
                    capture(c, data, out, cfg[name], progress=False)
                    times[f"capture {name}"].append(time.perf_counter() - t)
                    sizes[name] = sum(f.stat().st_size for f in out.glob("shard-*"))
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)
    served_tps = tokens / statistics.median(times["served"])
    print(f"demo teacher, {args.samples} x {args.length} tokens, top-{args.topk} + tail, 16 samples per request, "
          f"4 in flight; median of {args.repeats}\n")
    base_tps = tokens / statistics.median(times["capture fp32"])
    print("| path | tokens/s | × served | × safetensors fp32 | bytes per token on disk |\n|---|---:|---:|---:|---:|")
    result = {"tokens": tokens, "paths": {}}
    for name, ts in times.items():
        tps = tokens / statistics.median(ts)
        per_token = sizes[name.split()[-1]] / tokens if name != "served" else None
        result["paths"][name] = {"tokens_per_s": tps, "ratio_to_served": tps / served_tps,
                                 "ratio_to_safetensors_fp32": tps / base_tps, "bytes_per_token": per_token, "runs_s": ts}
        print(f"| {name} | {tps:,.0f} | {tps / served_tps:.2f} | {tps / base_tps:.2f} | "
              f"{'' if per_token is None else f'{per_token:.0f}'} |")
    print(f"\nwrote {write_result(result, 'capture')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
