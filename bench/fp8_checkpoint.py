"""An FP8 checkpoint of a float model directory, as DeepSeek-V3 / Qwen3-FP8 or compressed-tensors ship one, for benches.

`python bench/fp8_checkpoint.py SRC OUT [--format block|channel]` quantizes every decoder linear weight
(amax / 448 per 128 x 128 block, or per output channel) to float8_e4m3fn beside its scale
(`weight_scale_inv` per block, `weight_scale` per channel) and writes config.json's quantization_config;
the embedding, the norms, MoE routers and the lm_head stay as they are, as in those checkpoints.
Tensors are read and quantized one at a time (on `--device`), so a big model never sits in memory twice.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

E4M3 = torch.float8_e4m3fn
MAX = 448.0


def quantize(w: torch.Tensor, fmt: str, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, its scale) of w [N, K]: fp32 scales [ceil(N/R), ceil(K/C)] per block or [N, 1] per channel."""
    w = w.float()
    n, k = w.shape
    if fmt == "channel":
        scale = (w.abs().amax(-1, keepdim=True) / MAX).clamp(min=1e-12)                   # [N, 1]
        return (w / scale).clamp(-MAX, MAX).to(E4M3), scale
    r, c = block
    padded = F.pad(w, (0, -k % c, 0, -n % r))
    tiles = padded.view(padded.shape[0] // r, r, padded.shape[1] // c, c)                 # [N/R, R, K/C, C]
    scale = (tiles.abs().amax((1, 3)) / MAX).clamp(min=1e-12)                              # [N/R, K/C]
    q = (tiles / scale[:, None, :, None]).clamp(-MAX, MAX).view_as(padded)[:n, :k]
    return q.to(E4M3).contiguous(), scale


def quantized_key(key: str, shape) -> bool:
    return (len(shape) == 2 and key.endswith(".weight") and ".layers." in key and "norm" not in key
            and not key.endswith("mlp.gate.weight"))


def quant_config(fmt: str, block=(128, 128)) -> dict:
    if fmt == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                                          "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                                "dynamic": True}}}}


def fp8_checkpoint(src: Path, out: Path, fmt: str = "block", device: str = "cpu") -> Path:
    """Write (once: an existing OUT/config.json is kept) the FP8 checkpoint of `src` to `out`; returns `out`."""
    src, out = Path(src), Path(out)
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, tmp / f.name)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            for key in h.keys():
                value = h.get_tensor(key)
                if not quantized_key(key, value.shape):
                    tensors[key] = value
                    continue
                q, scale = quantize(value.to(device), fmt)
                tensors[key] = q.cpu()
                tensors[key[: -len("weight")] + ("weight_scale_inv" if fmt == "block" else "weight_scale")] = scale.cpu()
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp / "config.json").read_text())
    config["quantization_config"] = quant_config(fmt)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    tmp.rename(out)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("src", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--format", choices=["block", "channel"], default="block")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    print(fp8_checkpoint(args.src, args.out, args.format, args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
