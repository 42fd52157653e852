"""FP8 GEMMs for linear layers whose weights stay FP8, through torch's scaled matrix multiply, and where they run.

Two recipes, each torch's own kernel (cuBLAS on Hopper-class GPUs), never one of ours:
- "rowwise": `torch._scaled_mm` with one dynamic scale per activation row (token) and one per weight row
  (compressed-tensors FP8 per channel; a per-tensor scale is repeated per row);
- "block": `torch.nn.functional.scaled_mm` with dynamic 1 x 128 activation groups and the checkpoint's
  128 x 128 weight blocks (DeepSeek-V3 / Qwen3-FP8), the activation scales outer-dim-major, the tokens
  padded to a multiple of 4 and the weight's K blocks to a multiple of 4, as cuBLAS wants them.
Activations are quantized dynamically (amax / 448, logitserve.fp8), as these checkpoints' activation
scheme says. `choose` decides per weight, `probe` says once per device and dtype what runs there (a tiny
GEMM against its dequantized product); everything else is dequantized at load (logitserve.checkpoint).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .fp8 import E4M3, quantize_groups, quantize_rows
from .quant import QuantError, QuantScheme

log = logging.getLogger("logitserve.fp8")

BLOCK = 128                  # the block GEMM's weight block and activation group
_ROW_ALIGN = 16              # torch._scaled_mm: K and N multiples of 16
MODES = ("auto", "dequantize", "fp8")


@dataclass(frozen=True)
class Fp8Gemms:
    """Which FP8 GEMMs torch runs on a device, for an output dtype (probed)."""

    rowwise: bool
    block: bool


def prepare_scale(scale: torch.Tensor, recipe: str, n: int) -> torch.Tensor:
    """The weight scales as the GEMM is handed them. rowwise: [1, N] fp32 contiguous (from [N, 1], [N] or one
    per tensor); block: [ceil(N/128), KB] fp32 contiguous with KB = ceil(K/128) padded with ones to a multiple of
    4 (the GEMM takes its transpose, [KB, N/128])."""
    s = scale.to(torch.float32)
    if recipe == "rowwise":
        return (s.reshape(1, 1).expand(1, n) if s.numel() == 1 else s.reshape(1, n)).contiguous()
    pad = -s.shape[-1] % 4
    return F.pad(s, (0, pad), value=1.0).contiguous() if pad else s.contiguous()


class Fp8Linear(nn.Linear):
    """A linear layer holding its (local) FP8 weight [N, K] e4m3 and scales; y = x W^T (+ bias) in x's dtype.

    The weight's bytes are kept as a uint8 parameter and the scales as a buffer, so nothing that reads a model's
    floating parameters (transformers' `model.dtype`, `model.to(dtype)`) takes them for the serving dtype or casts
    them; the GEMM views the bytes as e4m3."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, recipe: str, bias: Optional[torch.Tensor] = None):
        nn.Module.__init__(self)
        assert weight.dtype == E4M3 and weight.ndim == 2 and recipe in ("rowwise", "block")
        self.out_features, self.in_features = weight.shape
        self.recipe = recipe
        self.weight = nn.Parameter(weight.contiguous().view(torch.uint8), requires_grad=False)   # [N, K] e4m3 bytes
        self.register_buffer("weight_scale", prepare_scale(scale, recipe, weight.shape[0]))
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias, requires_grad=False))
        self.calls = 0                         # GEMMs run (the GPU check reads it: FP8 ran, not a fallback)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] without the bias (row-parallel layers add it once, after their all-reduce)."""
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)                                                        # [M, K]
        if x2.shape[0] == 0:
            return x.new_zeros(*lead, self.out_features)
        self.calls += 1
        w = self.weight.view(E4M3)                                                   # [N, K]
        if self.recipe == "rowwise":
            xq, sx = quantize_rows(x2)                                               # [M, K] e4m3, [M, 1]
            y = torch._scaled_mm(xq, w.t(), sx, self.weight_scale.float(), out_dtype=x.dtype)
        else:
            m = x2.shape[0]
            xq, sx = quantize_groups(F.pad(x2, (0, 0, 0, -m % 4)), BLOCK)            # [M4, K], [M4, K/128]
            y = F.scaled_mm(xq, w.t(), sx.t().contiguous().t(), F.ScalingType.BlockWise1x128,
                            self.weight_scale.float().t(), F.ScalingType.BlockWise128x128, output_dtype=x.dtype)[:m]
        return y.reshape(*lead, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gemm(x)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 {self.recipe}"


def recipe_of(scheme: QuantScheme) -> str:
    return "block" if scheme.strategy == "block" else "rowwise"


def choose(mode: str, device: torch.device, dtype: torch.dtype, gemms: Fp8Gemms, scheme: QuantScheme,
           name: str, local: tuple[int, int], unaligned: Optional[str]) -> tuple[Optional[str], str]:
    """(recipe, "") when weight `name` (local shard [N, K]) runs FP8 GEMMs, else (None, why it is dequantized).
    mode "auto": FP8 GEMMs on a CUDA device that runs them, serving bf16; "dequantize": never; "fp8": wherever
    torch runs them on this device, and a weight that cannot is refused (QuantError, naming it and the bound)."""
    if mode not in MODES:
        raise QuantError(f"--fp8-compute {mode!r}: choose one of {', '.join(MODES)}")
    if mode == "dequantize":
        return None, "--fp8-compute dequantize"
    if mode == "auto" and device.type != "cuda":
        return None, f"no FP8 GEMMs on {device.type}"
    if mode == "auto" and dtype != torch.bfloat16:
        return None, f"serving in {str(dtype).replace('torch.', '')} (FP8 GEMMs serve bf16)"
    recipe = recipe_of(scheme)
    n, k = local
    why = None
    if scheme.activations != "dynamic":
        why = "the checkpoint's activation scales are static; the FP8 GEMMs here quantize activations dynamically"
    elif recipe == "block" and scheme.block != (BLOCK, BLOCK):
        why = f"{scheme.block[0]}x{scheme.block[1]} weight blocks (the block GEMM takes {BLOCK}x{BLOCK})"
    elif recipe == "block" and unaligned:
        why = unaligned
    elif recipe == "block" and (n % BLOCK or k % BLOCK):
        why = f"{name}: its local shape [{n}, {k}] is not a multiple of the {BLOCK}-wide blocks the block GEMM takes"
    elif recipe == "rowwise" and (n % _ROW_ALIGN or k % _ROW_ALIGN):
        why = f"{name}: its local shape [{n}, {k}] is not a multiple of {_ROW_ALIGN} (torch._scaled_mm's bound)"
    elif not getattr(gemms, recipe):
        why = f"torch {torch.__version__} runs no {recipe} FP8 GEMM on {device} for {dtype}"
    if why is None:
        return recipe, ""
    if mode == "fp8":
        raise QuantError(f"--fp8-compute fp8: {why}; use --fp8-compute auto to dequantize such weights")
    return None, why


@lru_cache(maxsize=None)
def probe(device: str, dtype: torch.dtype = torch.bfloat16) -> Fp8Gemms:
    """Which recipes run on `device` for output `dtype`: each a [8, 256] x [256, 256] GEMM within 2% of the product of
    its dequantized operands (an error or a wrong answer, e.g. a scale layout this torch reads otherwise, is
    False; 2% leaves room for a bf16 output's rounding, a wrong scale is off by far more)."""
    dev = torch.device(device)
    if dev.type == "cuda" and (not torch.cuda.is_available() or torch.cuda.get_device_capability(dev) < (8, 9)):
        return Fp8Gemms(False, False)
    return Fp8Gemms(_works("rowwise", dev, dtype), _works("block", dev, dtype))


def _works(recipe: str, device: torch.device, dtype: torch.dtype) -> bool:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=g)
    x = torch.randn(8, 256, generator=g)
    if recipe == "rowwise":
        scale = w.abs().amax(-1, keepdim=True) / 448                                  # [N, 1]
        q = (w / scale).to(E4M3)
        dq = q.float() * scale
    else:
        scale = w.view(2, BLOCK, 2, BLOCK).abs().amax((1, 3)) / 448                    # [2, 2]
        q = (w.view(2, BLOCK, 2, BLOCK) / scale[:, None, :, None]).reshape(256, 256).to(E4M3)
        dq = (q.float().view(2, BLOCK, 2, BLOCK) * scale[:, None, :, None]).reshape(256, 256)
    try:
        layer = Fp8Linear(q.to(device), scale.to(device), recipe)
        got = layer(x.to(device=device, dtype=dtype)).float().cpu()
    except (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError) as e:
        log.debug("fp8 %s GEMM on %s: %s", recipe, device, e)
        return False
    if recipe == "rowwise":                                  # the product of what the GEMM multiplies
        xq, sx = quantize_rows(x)
        want = (xq.float() * sx) @ dq.t()
    else:
        xq, sx = quantize_groups(x, BLOCK)
        want = (xq.float().view(8, 2, BLOCK) * sx[..., None]).view(8, 256) @ dq.t()
    return bool(torch.isfinite(got).all() and (got - want).abs().max() <= 0.02 * want.abs().max())
