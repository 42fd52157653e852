"""An FP8 checkpoint's load: which linear layers keep their FP8 weights and run FP8 GEMMs, and what was done.

The loader (logitserve.loading) asks `linear` for every linear layer's weight it reads: where the
weight is stored FP8 and `fp8_linear.choose` says its shard runs FP8 GEMMs on this device, the layer
becomes an `Fp8Linear` holding this rank's FP8 shard and the scales of that shard; every other FP8 tensor
(fused MoE experts, a shard whose edge cuts a block, any weight on a CPU) is dequantized by the checkpoint
reader to the serving dtype as it is read. `describe` is the one line ModelInfo and the start-up log carry.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from .checkpoint import Checkpoint, Source
from .fp8_linear import Fp8Gemms, Fp8Linear, choose, probe
from .loaded import DTYPE_NAMES
from .quant import QuantScheme
from .tp_plan import ParamShard



@dataclass
class QuantLoad:
    """One rank's FP8 decisions during a load (`scheme` None: an unquantized checkpoint, nothing to decide)."""

    scheme: Optional[QuantScheme]
    mode: str                          # --fp8-compute: auto | dequantize | fp8
    device: torch.device
    dtype: torch.dtype
    gemms: Fp8Gemms = Fp8Gemms(False, False)
    fp8: list[str] = field(default_factory=list)                   # weights kept FP8, run as FP8 GEMMs
    dequantized: dict[str, str] = field(default_factory=dict)      # FP8 weights dequantized -> why

    @classmethod
    def of(cls, scheme: Optional[QuantScheme], mode: str, device: torch.device, dtype: torch.dtype) -> "QuantLoad":
        wants = scheme is not None and mode != "dequantize" and (device.type == "cuda" or mode == "fp8")
        gemms = probe(str(device), dtype) if wants else Fp8Gemms(False, False)
        return cls(scheme, mode, device, dtype, gemms)

    def may_keep(self) -> bool:
        """Whether some FP8 weights may stay FP8 in this load (a device and mode with FP8 GEMMs)."""
        return self.scheme is not None and (self.gemms.rowwise or self.gemms.block) and \
            (self.mode == "fp8" or (self.device.type == "cuda" and self.dtype == torch.bfloat16))

    def linear(self, model: nn.Module, pname: str, src: Source, shard: Optional[ParamShard], ckpt: Checkpoint,
               rank: int, tp: int) -> bool:
        """Put an Fp8Linear in place of the linear layer owning weight `pname` when its weight is FP8 and its shard
        runs FP8 GEMMs here; True if it did (the weight is then read), False to read it dequantized."""
        if self.scheme is None or not pname.endswith(".weight") or src.merge or len(src.keys) != 1:
            return False
        key = src.keys[0][2]
        if key not in ckpt.scales:
            return False
        owner_name = pname[: -len(".weight")]
        owner = model.get_submodule(owner_name)
        if type(owner) is not nn.Linear:
            self.dequantized[pname] = f"{type(owner).__name__} is no plain linear layer"
            return False
        local = tuple(_local(ckpt.meta[key][1], shard, tp))
        unaligned = ckpt.unaligned(pname, src, shard, rank, tp)
        recipe, why = choose(self.mode, self.device, self.dtype, self.gemms, self.scheme, pname, local, unaligned)
        if recipe is None:
            self.dequantized[pname] = why
            return False
        weight, scale = ckpt.read_fp8(src, shard, rank, tp)               # [N/tp, K] or [N, K/tp] e4m3, scales
        parent, _, leaf = owner_name.rpartition(".")
        layer = Fp8Linear(weight.to(self.device), scale.to(self.device), recipe)
        model.get_submodule(parent)._modules[leaf] = layer
        self.fp8.append(pname)
        return True

    def note(self, pname: str, key: str, ckpt: Checkpoint, why: str) -> None:
        """An FP8 tensor read dequantized outside `linear` (the lm_head, the embedding, fused experts)."""
        if key in ckpt.scales:
            self.dequantized.setdefault(pname, why)

    def describe(self) -> str:
        """"" for an unquantized checkpoint; else "<format>: <compute>" (ModelInfo.quantization)."""
        if self.scheme is None:
            return ""
        dtype = DTYPE_NAMES[self.dtype]
        total = len(self.fp8) + len(self.dequantized)
        if not self.fp8:
            why = next(iter(self.dequantized.values()), "")
            return f"{self.scheme.name}: dequantized to {dtype} at load ({why})" if why else \
                f"{self.scheme.name}: dequantized to {dtype} at load"
        recipe = "block 1x128 x 128x128" if self.scheme.strategy == "block" else "rowwise"
        line = f"{self.scheme.name}: fp8 GEMMs (torch scaled_mm, {recipe}) for {len(self.fp8)} of {total} FP8 weights"
        if self.dequantized:
            first, why = next(iter(self.dequantized.items()))
            line += f"; {len(self.dequantized)} dequantized to {dtype} (e.g. {first}: {why})"
        return line


def _local(shape: tuple[int, ...], shard: Optional[ParamShard], tp: int) -> list[int]:
    out = list(shape)
    if shard is not None:
        out[shard.dim] //= tp
    return out
