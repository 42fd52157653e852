"""Offline capture throughput against served top-k throughput, same server, same run.

`python bench/capture.py` serves the demo teacher, writes a jsonl of --samples x --length
token ids, then times (interleaved, median of --repeats): the same requests through the
client with nothing written ("served"), `capture` into safetensors shards at fp32 and
bf16 (top-64 + tail + ids + offsets), and `capture --format axolotl | distillkit | hf`
(parquet). Reports tokens/s, the ratio to served and to the fp32 safetensors capture of
the same run, and bytes per token on disk. Then, with no server, the writing alone: one shard's
tensors of the same shapes written in each format (median of --repeats), where the formats differ.
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
    result["write_only"] = write_only(args, paths, cfg)
    print(f"\nwrote {write_result(result, 'capture')}")
    return 0


def write_only(args, paths: dict, cfg: dict) -> dict:
    """Seconds to write one 64-sample shard of served-shaped tensors in each format, no server: tokens/s."""
    from logitserve.client import capture_formats as formats
    from logitserve.client.capture import _save_safetensors
    from logitserve.client.capture_formats import bf16_bits

    rng = np.random.default_rng(1)
    n, L, k = 64, args.length, args.topk
    vals = -np.sort(rng.exponential(3.0, (n * L, k)).astype(np.float32), axis=1)
    base = {"input_ids": rng.integers(3, 32000, n * L).astype(np.int32), "topk_values": vals,
            "topk_ids": rng.integers(0, 32000, (n * L, k)).astype(np.int32),
            "topk_tail": rng.uniform(-3, 0, n * L).astype(np.float32),
            "offsets": np.arange(n + 1, dtype=np.int64) * L, "row_offsets": np.arange(n + 1, dtype=np.int64) * L,
            "prompt_lengths": np.zeros(n, np.int64), "sample_index": np.arange(n, dtype=np.int64)}
    work = Path(tempfile.mkdtemp(prefix="bench-capture-write-"))
    out: dict = {}
    try:
        for name, (fmt, dtype) in paths.items():
            t = dict(base, topk_values=bf16_bits(vals) if dtype == "bf16" else vals)
            runs = []
            for r in range(args.repeats + 1):                  # the first run warms imports and caches
                start = time.perf_counter()
                path = work / f"{name}-{r}"
                if fmt == "safetensors":
                    _save_safetensors(path, t, cfg[name])
                else:
                    formats.write_shard(path, formats.shard_table(fmt, t, [None] * n, [{}] * n, cfg[name], 32000))
                runs.append(time.perf_counter() - start)
            out[name] = {"tokens_per_s": n * L / statistics.median(runs[1:]), "runs_s": runs[1:]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base_tps = out["fp32"]["tokens_per_s"]
    print(f"\nwriting alone: one shard of {n} x {L} tokens, top-{k}; median of {args.repeats}\n")
    print("| format | tokens/s written | × safetensors fp32 |\n|---|---:|---:|")
    for name, o in out.items():
        o["ratio_to_safetensors_fp32"] = o["tokens_per_s"] / base_tps
        print(f"| {name} | {o['tokens_per_s']:,.0f} | {o['ratio_to_safetensors_fp32']:.2f} |")
    return out


if __name__ == "__main__":
    sys.exit(main())
