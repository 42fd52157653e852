"""Loading a ~1 GB bf16 checkpoint and its FP8 twin: time to first SERVING and each rank's peak RSS, at TP 1 and TP 2.

`python bench/loading.py` builds the checkpoint once (a Llama of 16 layers, hidden 1536,
vocab 32000: 0.5B parameters in bf16, about 1 GB) from a fixed seed, and from it a block-FP8
checkpoint as DeepSeek-V3 ships one (bench/fp8_checkpoint.py: 128x128 blocks, about 0.6 GB; on a
CPU it is dequantized to bf16 as it is read), then starts `logitserve serve --dtype bf16 --tp N` as a
user would on each, --repeats times per layout, interleaved. Time to SERVING runs from the process start to the "serving" line; each
rank logs its own peak RSS (VmHWM) when its model is built. The import baseline (a
process that imports the server and its model classes, loading nothing) is reported beside.
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from run import vm_hwm, write_result  # noqa: E402

PEAK = re.compile(r"rank (\d+) loaded its shards .* peak RSS (\d+) MiB|loaded the whole model .* peak RSS (\d+) MiB")


def checkpoint(root: Path) -> Path:
    directory = root / "bench-load-0.5b-bf16"
    if (directory / "config.json").exists():
        return directory
    import torch
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=16,
                         num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(directory)
    return directory


def _warm_peaks(proc: subprocess.Popen, address: str) -> list[int]:
    """One request, then VmHWM (MiB) of every process of the server: what it holds once it has served."""
    import psutil

    from logitserve.client import TeacherClient

    with TeacherClient(address) as c:
        c.logprobs([list(range(1, 65))])
    procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    return [vm_hwm(p.pid) >> 20 for p in procs]


def serve_once(directory: Path, tp: int) -> tuple[float, dict[int, int], list[int]]:
    """(seconds to SERVING, each rank's peak RSS while loading, every process's peak RSS after one request)."""
    cmd = [sys.executable, "-m", "logitserve.server.cli", "serve", "--host", "127.0.0.1", "--port", "0",
           "--model", str(directory), "--dtype", "bf16", "--tp", str(tp)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, int] = {}
    try:
        for line in proc.stdout:
            m = PEAK.search(line)
            if m:
                peaks[int(m.group(1) or 0)] = int(m.group(2) or m.group(3))
            m = re.search(r"logitserve: serving \S+ on [\d.]+:(\d+)", line)
            if m:
                took = time.perf_counter() - t0
                return took, peaks, _warm_peaks(proc, f"127.0.0.1:{m.group(1)}")
        raise RuntimeError(f"tp={tp}: the server exited before serving")
    finally:
        proc.terminate()
        proc.wait(60)


def import_baseline() -> int:
    code = ("import logitserve.server.app, logitserve.loading, accelerate, transformers;"
            "from transformers import LlamaForCausalLM;"
            "from logitserve.hostmem import peak_rss_mib; print(int(peak_rss_mib()))")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "logitserve")
    args = ap.parse_args()
    from fp8_checkpoint import fp8_checkpoint

    bf16 = checkpoint(args.cache)
    dirs = {"bf16": bf16, "fp8-block-128x128": fp8_checkpoint(bf16, args.cache / "bench-load-0.5b-fp8-block")}
    sizes = {name: sum(f.stat().st_size for f in d.glob("*.safetensors")) / 2**20 for name, d in dirs.items()}
    runs: dict[tuple[str, int], list] = {(name, tp): [] for name in dirs for tp in (1, 2)}
    for _ in range(args.repeats):
        for name, tp in runs:
            runs[name, tp].append(serve_once(dirs[name], tp))
    base = import_baseline()
    result = {"checkpoint_mib": {n: round(s) for n, s in sizes.items()}, "import_baseline_mib": base, "layouts": {}}
    print(f"checkpoints {', '.join(f'{n} {s:.0f} MiB' for n, s in sizes.items())}, served --dtype bf16; import "
          f"baseline {base} MiB per process; medians of {args.repeats}\n")
    print("| checkpoint | tp | time to SERVING (s) | peak RSS per rank while loading (MiB) | above the import baseline | "
          "peak RSS after one request, per process (MiB) |")
    print("|---|---:|---:|---|---|---|")
    for (name, tp), rs in runs.items():
        t = statistics.median(r[0] for r in rs)
        peaks = {rank: statistics.median(r[1][rank] for r in rs) for rank in range(tp)}
        warm = [statistics.median(r[2][i] for r in rs) for i in range(len(rs[0][2]))]
        result["layouts"][f"{name}-tp{tp}"] = {"time_to_serving_s": t, "peak_rss_mib": peaks,
                                               "warm_peak_rss_mib": warm, "runs": rs}
        print(f"| {name} | {tp} | {t:.1f} | {', '.join(f'{p:.0f}' for p in peaks.values())} | "
              f"{', '.join(f'{p - base:.0f}' for p in peaks.values())} | {', '.join(f'{p:.0f}' for p in warm)} |")
    print(f"\nwrote {write_result(result, 'loading')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
