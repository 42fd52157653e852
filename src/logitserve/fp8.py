"""FP8 arithmetic on one piece of a weight: which scales cover it, its dequantization, activations' dynamic scales.

A piece is the part of a stored weight [..., N, K] one rank reads: rows [r0, r0 + n) and columns [c0, c0 + k)
(one slice per dimension). Its scales are the blocks that overlap it, read from the scale tensor with
`scale_index`; a piece that starts or ends inside a block (a shard edge, or the partial last block of a
dimension) takes that block's scale for the rows and columns it holds. The convention is transformers' and
DeepSeek's: weight = fp8 * scale, block (i, j) covers rows [i*R, (i+1)*R) and columns [j*C, (j+1)*C).
"""
from __future__ import annotations

from typing import Optional

import torch

from .quant import QuantScheme

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)     # 448
_TINY = 1e-12                               # an all-zero row or group keeps a finite scale


def concrete(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """Each slice with its start and stop filled in for `shape` (step 1)."""
    out = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        assert step == 1, "pieces are contiguous"
        out.append(slice(start, stop))
    return tuple(out)


def scale_index(scheme: QuantScheme, index: tuple[slice, ...], sshape: tuple[int, ...]) -> tuple[slice, ...]:
    """The slice of the scale tensor (of shape `sshape`) that covers the weight piece `index` (concrete)."""
    *lead, rows, cols = index
    if scheme.strategy == "tensor":
        return tuple(lead[: len(sshape)]) + (slice(None),) * max(0, len(sshape) - len(lead))
    if scheme.strategy == "channel":
        return (*lead, rows, slice(None)) if len(sshape) == len(index) else (*lead, rows)
    bm, bk = scheme.block
    return (*lead, slice(rows.start // bm, -(-rows.stop // bm)), slice(cols.start // bk, -(-cols.stop // bk)))


def dequantize(q: torch.Tensor, scale: torch.Tensor, scheme: QuantScheme, index: tuple[slice, ...]) -> torch.Tensor:
    """fp32 values of the FP8 piece q [..., n, k] at `index` (concrete), from `scale`, the covering slice of the
    scales (scale_index)."""
    w = q.to(torch.float32)                                      # [..., n, k]
    s = scale.to(torch.float32)
    if scheme.strategy == "tensor":
        return w.mul_(s.reshape(*s.shape, *([1] * (w.ndim - s.ndim))) if s.ndim else s)
    if scheme.strategy == "channel":
        return w.mul_(s if s.ndim == w.ndim else s[..., None])  # [..., n, 1]
    bm, bk = scheme.block
    rows, cols = index[-2], index[-1]
    n, k = w.shape[-2:]
    s = s.repeat_interleave(bm, -2).narrow(-2, rows.start % bm, n)      # [..., n, kb]: rows only, never [n, k]
    a, j = 0, 0
    while a < k:                                                       # one column block at a time, in place
        b = min(k, a + bk - (cols.start + a) % bk)
        w[..., a:b].mul_(s[..., j : j + 1])
        a, j = b, j + 1
    return w


def aligned(scheme: QuantScheme, index: tuple[slice, ...], shape: tuple[int, ...]) -> Optional[str]:
    """None when the piece's scales are whole blocks of its own (an FP8 GEMM can take them as they are); else why
    not, naming the dimension and the bound."""
    if scheme.strategy != "block":
        return None
    for dim, (s, size, n) in enumerate(zip(index[-2:], scheme.block, shape[-2:])):
        what = ("rows (out features)", "columns (in features)")[dim]
        if s.start % size or ((s.stop - s.start) % size and s.stop != n):
            return (f"its {what} [{s.start}, {s.stop}) of {n} do not start and end on the {size}-wide scale blocks "
                    f"(a shard of {s.stop - s.start} is not a multiple of {size})")
    return None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scale [M, 1]): one dynamic scale per row (token), amax / 448."""
    s = x.abs().amax(-1, keepdim=True).to(torch.float32).clamp_(min=_TINY).div_(E4M3_MAX)    # [M, 1]
    return (x.to(torch.float32) / s).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3), s


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of `group`) -> (e4m3 [M, K], fp32 scale [M, K/group]): one dynamic scale per row
    and group of columns, as DeepSeek's activation scheme (1 x 128)."""
    m, k = x.shape
    g = x.to(torch.float32).view(m, k // group, group)                                       # [M, K/g, g]
    s = g.abs().amax(-1).clamp_(min=_TINY).div_(E4M3_MAX)                                    # [M, K/g]
    return (g / s[..., None]).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3).view(m, k), s
