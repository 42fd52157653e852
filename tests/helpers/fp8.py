"""FP8 checkpoints made by hand from a float model directory, and the float model of their dequantized weights.

`quantize_dir` writes what DeepSeek-V3 / Qwen3-FP8 ship (`quant_method: fp8`, `weight_block_size`, F8_E4M3
weights with an fp32 `weight_scale_inv` per block) or what compressed-tensors writes (`weight_scale` per
output channel or per tensor), quantizing every decoder linear weight here (amax / 448 per block, channel
or tensor) and leaving the embedding, the norms, the MoE router and the lm_head in float, as those
checkpoints do. Beside it, the same model with each weight replaced by fp8 * scale computed in float64:
the independent reference (tests run float64 transformers on it).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E4M3 = torch.float8_e4m3fn
MAX = 448.0


def block_scales(w: torch.Tensor, block) -> torch.Tensor:
    """[ceil(N/R), ceil(K/C)] amax / 448 per block of w [N, K] (partial last blocks included), float64."""
    n, k = w.shape
    r, c = block
    padded = torch.nn.functional.pad(w.double().abs(), (0, -k % c, 0, -n % r))      # zeros never raise an amax
    return (padded.view(-(-n // r), r, -(-k // c), c).amax((1, 3)) / MAX).clamp(min=1e-12)


def expand(scale: torch.Tensor, shape, block) -> torch.Tensor:
    """Each element's scale: block (i, j) over rows [iR, (i+1)R), columns [jC, (j+1)C) (float64 [N, K])."""
    rows = torch.arange(shape[0]) // block[0]
    cols = torch.arange(shape[1]) // block[1]
    return scale.double()[rows[:, None], cols[None, :]]


def quantize(w: torch.Tensor, fmt: str, block=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, stored scale, float64 dequantized weight) of w [N, K] in `fmt`: block, channel or tensor."""
    w = w.double()
    if fmt == "block":
        stored = block_scales(w, block).float()
        full = expand(stored, w.shape, block)
    elif fmt == "channel":                                     # compressed-tensors often stores bf16 scales
        stored = (w.abs().amax(-1, keepdim=True) / MAX).clamp(min=1e-12).to(torch.bfloat16)      # [N, 1]
        full = stored.double().expand_as(w)
    else:
        stored = (w.abs().max() / MAX).float().reshape(1)
        full = stored.double().expand_as(w)
    q = (w / full).clamp(-MAX, MAX).to(E4M3)
    return q, stored, q.double() * full


def _quantized(key: str, value: torch.Tensor) -> bool:
    return (value.ndim == 2 and key.endswith(".weight") and ".layers." in key and "norm" not in key
            and not key.endswith("mlp.gate.weight"))


def quantize_dir(src: Path, out: Path, deq: Path, fmt: str = "block", block=(32, 48)) -> tuple[Path, Path]:
    """Write the FP8 checkpoint of the float model in `src` to `out` and its dequantized float model to `deq`."""
    state = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        state.update(load_file(f))
    quant, dequant = {}, {}
    for key, value in state.items():
        if not _quantized(key, value):
            quant[key] = dequant[key] = value
            continue
        q, scale, dq = quantize(value, fmt, block)
        quant[key] = q
        quant[key[: -len("weight")] + ("weight_scale_inv" if fmt == "block" else "weight_scale")] = scale
        dequant[key] = dq.to(value.dtype)
    for d in (out, deq):
        d.mkdir(parents=True, exist_ok=True)
        for f in Path(src).iterdir():
            if f.suffix != ".safetensors" and f.is_file():
                shutil.copy(f, d / f.name)
    save_file(quant, out / "model.safetensors", metadata={"format": "pt"})
    save_file(dequant, deq / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quant_config(fmt, block)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out, deq


def quant_config(fmt: str, block=(32, 48)) -> dict:
    """config.json's quantization_config as DeepSeek-V3 (fp8) or compressed-tensors write it."""
    if fmt == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block)}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": fmt, "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}


def rewrite(directory: Path, change) -> None:
    """Apply change(tensors) to the checkpoint's tensors in place (malformed checkpoints for the refusal tests)."""
    path = Path(directory) / "model.safetensors"
    tensors = dict(load_file(path))
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
