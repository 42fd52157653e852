"""Full-vocabulary distillation's teacher side: hidden states + the head vs full logits, bytes and tokens/s.

`python bench/full_vocab.py` starts `logitserve serve` on the demo model (V 32000, H 256) and on the `wide` demo
(V 151936, H 1024: Qwen's vocabulary) and times one student step's teacher side end to end, per path:
request, assembly, the full distribution (rebuilt from hidden states with `teacher.head()`, or as served), and
a full-vocab forward KL against random student logits (`full_kd_loss`, chunked). Bytes per token are the tensor
payload received (framing adds < 0.1 %); the head's one-time download is reported apart. Medians of
--repeats interleaved runs, ratios against full logits in bf16 from the same run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from run import interleaved, start_server, write_result  # noqa: E402

from logitserve.client import TeacherClient  # noqa: E402
from logitserve.client.distill import full_kd_loss  # noqa: E402

SHAPES = {"demo": (32000, 4, 512), "wide": (151936, 2, 256)}    # shape -> (V, sequences, tokens each)


def _padded(arrays: list, width: int) -> torch.Tensor:
    """Per-sequence [L, width] arrays as one [B, L, width] fp32 tensor."""
    return torch.from_numpy(np.stack([np.asarray(a, dtype=np.float32) for a in arrays]))


def measure(shape: str, repeats: int, tmp: Path) -> dict:
    V, B, L = SHAPES[shape]
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, V, L) for _ in range(B)]
    student = torch.randn(B, L, V) * 2                                         # [B, L, V] random student logits
    proc, address = start_server("--demo-shape", shape, "--logprob-chunk-size", "256")
    try:
        with TeacherClient(address) as c:
            t0 = time.perf_counter()
            weights = c.head_weights(cache=tmp)
            head_s = time.perf_counter() - t0
            head = c.head(cache=tmp)
            payload: dict[str, int] = {}

            def hidden(dtype: str):
                def run():
                    r = c.forward(seqs, hidden_states=True, hidden_dtype=dtype)
                    payload[f"hidden {dtype}"] = sum(a.size for a in r.hidden_states) * (4 if dtype == "fp32" else 2)
                    return full_kd_loss(student, _padded(r.hidden_states, head.spec.hidden_size), head=head).item()
                return run

            def logits(dtype: str):
                def run():
                    r = c.forward(seqs, full_logits=True, logits_dtype=dtype)
                    payload[f"logits {dtype}"] = sum(a.size for a in r.full_logits) * (4 if dtype == "fp32" else 2)
                    return full_kd_loss(student, _padded(r.full_logits, V)).item()
                return run

            cases = {"hidden fp32": hidden("fp32"), "hidden bf16": hidden("bf16"),
                     "logits bf16": logits("bf16"), "logits fp32": logits("fp32")}
            losses = {name: fn() for name, fn in cases.items()}   # the paths agree on the loss
            times = interleaved(cases, repeats)
    finally:
        proc.terminate()
        proc.wait(60)
    tokens = B * L
    rows = []
    for name, runs in times.items():
        med = statistics.median(runs)
        rows.append({"path": name, "bytes_per_token": payload[name] / tokens, "median_s": med,
                     "tokens_per_s": tokens / med, "runs_s": runs, "loss": losses[name]})
    return {"shape": shape, "vocab": V, "hidden": head.spec.hidden_size, "sequences": B, "tokens_each": L,
            "head_bytes": int(weights.weight.nbytes), "head_download_s": head_s, "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="demo,wide")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    import tempfile

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            results.append(measure(shape, args.repeats, Path(tmp)))
    out = write_result({"results": results, "repeats": args.repeats}, "full_vocab")
    for res in results:
        base = next(r for r in res["rows"] if r["path"] == "logits bf16")
        print(f"\n{res['shape']}: V {res['vocab']}, H {res['hidden']}, {res['sequences']} x {res['tokens_each']} tokens, "
              f"median of {args.repeats}; head {res['head_bytes'] / 2**20:.0f} MiB fetched once in "
              f"{res['head_download_s']:.2f} s\n")
        print("| path | bytes/token | × fewer than logits bf16 | tokens/s | × logits bf16 | loss |\n"
              "|---|---:|---:|---:|---:|---:|")
        for r in res["rows"]:
            print(f"| {r['path']} | {r['bytes_per_token']:,.0f} | {base['bytes_per_token'] / r['bytes_per_token']:.1f} "
                  f"| {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f} | {r['loss']:.6f} |")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
