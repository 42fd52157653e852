"""A checkpoint's quantization: config.json's `quantization_config` as one typed scheme, or a refusal naming it.

Served: FP8 e4m3 weights with their scales, as DeepSeek-V3/R1 and the Qwen3 `-FP8` releases ship them
(`quant_method: fp8`, `weight_block_size` [rows, cols], `weight_scale_inv` per block) and as
compressed-tensors writes them (`quant_method: compressed-tensors`, format float-quantized, `weight_scale`
per output channel, per tensor or per block). In both the stored scale multiplies: weight = fp8 * scale,
block (i, j) covering rows [i*R, (i+1)*R) and columns [j*C, (j+1)*C), the last block of a dimension partial.
Everything else (AWQ, GPTQ, bitsandbytes, INT4/INT8 compressed-tensors, an unknown method or fmt) is refused
at start-up in one line, as is a tensor of the wrong dtype or a missing or misshapen scale: never weights cast
without their scales. `check_tensors` reads only the safetensors headers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

SERVED = ("served: FP8 e4m3 checkpoints (quant_method 'fp8' with weight_block_size and weight_scale_inv, "
          "DeepSeek-V3 / Qwen3-FP8 style; 'compressed-tensors' float-quantized FP8 weights per channel, per tensor "
          "or per block) and unquantized fp32/bf16/fp16 weights")
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")        # safetensors' names of the weights read as they are
FP8_DTYPE = "F8_E4M3"
_SCALE_DTYPES = ("F32", "BF16", "F16")
_IGNORED_SUFFIXES = ("input_scale", "activation_scale", "k_scale", "v_scale", "output_scale")


class QuantError(ValueError):
    """A checkpoint logitserve does not serve as it is: the message names the field or tensor and what is served."""


@dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint's FP8 weights are scaled."""

    method: str                              # "fp8" | "compressed-tensors" (config.json's quant_method)
    strategy: str                            # "block" | "channel" | "tensor": what one scale covers
    block: Optional[tuple[int, int]]         # (rows, cols) of a weight block, for "block"
    scale_name: str                          # "weight_scale_inv" (fp8) | "weight_scale" (compressed-tensors)
    activations: str = "dynamic"             # "dynamic" | "static": how the checkpoint quantizes activations
    scale_fmt: str = "float"                 # "float" | "ue8m0" (scales stored as power-of-two bytes)

    @property
    def name(self) -> str:
        """"fp8-block-128x128", "fp8-channel" or "fp8-tensor" (ModelInfo.quantization's first word)."""
        return f"fp8-block-{self.block[0]}x{self.block[1]}" if self.strategy == "block" else f"fp8-{self.strategy}"

    def scale_key(self, weight_key: str) -> str:
        return weight_key[: -len("weight")] + self.scale_name

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale's shape for a weight of `shape` [..., N, K] (leading dims: fused experts)."""
        *lead, n, k = shape
        if self.strategy == "block":
            return (*lead, math.ceil(n / self.block[0]), math.ceil(k / self.block[1]))
        if self.strategy == "channel":
            return (*lead, n, 1)
        return tuple(lead)


def scheme_of(qc) -> Optional[QuantScheme]:
    """The scheme of config.json's quantization_config (a dict, or transformers' config object); None if absent."""
    if qc is None:
        return None
    if hasattr(qc, "to_dict"):
        qc = qc.to_dict()
    if not isinstance(qc, dict):
        raise QuantError(f"config.json quantization_config is {type(qc).__name__}, not an object; {SERVED}")
    method = str(qc.get("quant_method") or ("bitsandbytes" if qc.get("load_in_4bit") or qc.get("load_in_8bit")
                                             else ""))
    if method == "fp8":
        return _fp8(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if not method:
        raise QuantError(f"config.json quantization_config has no quant_method; {SERVED}")
    known = _known_methods()
    kind = "is not served" if method in known else "is unknown (transformers knows " + ", ".join(known) + ")"
    raise QuantError(f"config.json quantization_config: quant_method {method!r} {kind}; {SERVED}. "
                     f"Dequantize it to bf16 first")


def _known_methods() -> list[str]:
    try:
        from transformers.utils.quantization_config import QuantizationMethod
    except ImportError:
        return []
    return sorted(m.value for m in QuantizationMethod)


def _fp8(qc: dict) -> QuantScheme:
    """DeepSeek / Qwen block FP8, validated by transformers' own FineGrainedFP8Config, then our limits."""
    from transformers import FineGrainedFP8Config

    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantError(f"config.json quantization_config: fmt {fmt!r} (quant_method 'fp8') is not served; "
                         f"served: fmt 'e4m3' (float8_e4m3fn weights)")
    try:
        cfg = FineGrainedFP8Config.from_dict({k: v for k, v in qc.items() if k != "fmt"})
    except (ValueError, TypeError) as e:
        raise QuantError(f"config.json quantization_config (quant_method 'fp8'): {e}") from None
    if getattr(cfg, "expert_dtype", "fp8") != "fp8":
        raise QuantError(f"config.json quantization_config: expert_dtype {cfg.expert_dtype!r} (FP4 experts) is not "
                         f"served; served: expert_dtype 'fp8'")
    block = tuple(int(x) for x in cfg.weight_block_size) if cfg.weight_block_size is not None else None
    return QuantScheme("fp8", "block" if block else "tensor", block, "weight_scale_inv", cfg.activation_scheme,
                       cfg.scale_fmt)


def _compressed_tensors(qc: dict) -> QuantScheme:
    """compressed-tensors' schema (the package itself is not needed to read it): FP8 float weights only."""
    fmt = qc.get("format", "")
    if qc.get("sparsity_config"):
        raise QuantError("config.json quantization_config: compressed-tensors sparsity_config (sparse weights) is "
                         f"not served; {SERVED}")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise QuantError("config.json quantization_config: compressed-tensors with no config_groups; " + SERVED)
    seen = set()
    activations = "dynamic"
    for name, group in groups.items():
        w = group.get("weights") or {}
        if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8:
            raise QuantError(f"config.json quantization_config.config_groups.{name}.weights: {w.get('type')} "
                             f"{w.get('num_bits')}-bit weights (format {fmt!r}) are not served; served: FP8 "
                             f"(type 'float', num_bits 8, format 'float-quantized')")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise QuantError(f"config.json quantization_config: compressed-tensors format {fmt!r} is not served; "
                             f"served: 'float-quantized' FP8 weights")
        strategy = w.get("strategy", "tensor")
        if strategy not in ("channel", "tensor", "block"):
            raise QuantError(f"config.json quantization_config.config_groups.{name}.weights.strategy {strategy!r} "
                             f"is not served; served: 'channel', 'tensor', 'block'")
        block = tuple(int(x) for x in w.get("block_structure") or ()) if strategy == "block" else None
        if strategy == "block" and (not block or len(block) != 2 or min(block) <= 0):
            raise QuantError(f"config.json quantization_config.config_groups.{name}.weights.block_structure "
                             f"{w.get('block_structure')!r}: need two positive sizes [rows, cols]")
        seen.add((strategy, block))
        act = group.get("input_activations") or {}
        if act and not act.get("dynamic", False):
            activations = "static"
    if len(seen) > 1:
        raise QuantError(f"config.json quantization_config: config_groups mix weight strategies {sorted(seen)}; "
                         f"served: one FP8 strategy for every group")
    (strategy, block), = seen
    return QuantScheme("compressed-tensors", strategy, block, "weight_scale", activations)


def check_tensors(meta: dict[str, tuple[str, tuple[int, ...]]], scheme: Optional[QuantScheme],
                  directory: str = "") -> dict[str, str]:
    """FP8 weight key -> its scale key, from the headers (key -> (safetensors dtype, shape)); QuantError on an FP8
    tensor without a quantization_config, a missing or misshapen scale, or a dtype no scheme here reads."""
    where = f"{directory}: " if directory else ""
    scales: dict[str, str] = {}
    for key, (dtype, shape) in sorted(meta.items()):
        if dtype in ("F8_E5M2", "F8_E8M0") and not (scheme and key.endswith(scheme.scale_name)):
            raise QuantError(f"{where}tensor {key} is stored as {dtype}; served: {FP8_DTYPE} (e4m3) weights")
        if dtype != FP8_DTYPE:
            continue
        if scheme is None:
            raise QuantError(f"{where}tensor {key} is stored as {FP8_DTYPE} but config.json has no "
                             f"quantization_config to say how it is scaled; {SERVED}")
        if not key.endswith(".weight") or len(shape) < 2:
            raise QuantError(f"{where}tensor {key} is FP8 {list(shape)} but not a weight matrix: FP8 is served "
                             f"for [..., out, in] weights only")
        skey = scheme.scale_key(key)
        if skey not in meta:
            raise QuantError(f"{where}FP8 weight {key} has no scale: {skey} is missing from the checkpoint")
        sdtype, sshape = meta[skey]
        allowed = _SCALE_DTYPES + (("F8_E8M0",) if scheme.scale_fmt == "ue8m0" else ())
        if sdtype not in allowed:
            raise QuantError(f"{where}scale {skey} is stored as {sdtype}; served: {', '.join(allowed)}")
        if not _shape_ok(scheme, tuple(shape), tuple(sshape)):
            raise QuantError(f"{where}scale {skey} has shape {list(sshape)}; weight {key} {list(shape)} with "
                             f"{_describe(scheme)} needs {list(scheme.scale_shape(tuple(shape)))}")
        scales[key] = skey
    if scheme is not None:
        owners = {s for s in scales.values()}
        for key in meta:
            if key.endswith("." + scheme.scale_name) and key not in owners:
                weight = key[: -len(scheme.scale_name)] + "weight"
                stored = meta[weight][0] if weight in meta else "missing"
                raise QuantError(f"{where}scale {key} belongs to no FP8 weight: {weight} is {stored}")
    return scales


def _shape_ok(scheme: QuantScheme, shape: tuple[int, ...], sshape: tuple[int, ...]) -> bool:
    want = scheme.scale_shape(shape)
    if sshape == want:
        return True
    if scheme.strategy == "channel":                     # [N] as well as [N, 1]
        return sshape == want[:-1]
    if scheme.strategy == "tensor":                      # [], [1] or [1, 1] (per expert: [E], [E, 1], [E, 1, 1])
        return tuple(d for d in sshape[len(want):]) in ((), (1,), (1, 1)) and tuple(sshape[: len(want)]) == want
    return False


def _describe(scheme: QuantScheme) -> str:
    if scheme.strategy == "block":
        return f"{scheme.block[0]}x{scheme.block[1]} blocks"
    return "one scale per output channel" if scheme.strategy == "channel" else "one scale per tensor"


def ignored_keys(meta: dict, scheme: Optional[QuantScheme]) -> list[str]:
    """Activation and KV-cache scales the checkpoint ships: activations are quantized dynamically or not at all
    (attention runs in the serving dtype), so these are read by nothing."""
    if scheme is None:
        return []
    return sorted(k for k in meta if k.rsplit(".", 1)[-1] in _IGNORED_SUFFIXES)
