"""Packed bodies: many sequences as one row of tokens, attention confined to each sequence (varlen).

A batch's sequences are concatenated into one row [1, N]; position_ids restart
at 0 for every sequence, and the attention function registered here (through
transformers' AttentionInterface) attends only within each sequence, causally:
- CUDA, bf16/fp16: torch's flash-attention `varlen_attn` on cu_seqlens, no mask;
- otherwise: scaled_dot_product_attention(is_causal) once per run of consecutive
  sequences of equal length (a [g, H, L, D] view of the row), so no [N, N] mask
  ever exists and no token is compared with another sequence's.
transformers builds no mask for an attention implementation it does not know,
so nothing can slip an all-ones or dense block-diagonal mask in.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F

VARLEN_ATTENTION = "logitserve_varlen"
_state = threading.local()
_flash_ok = True          # cleared, with a warning, if the GPU or build has no varlen flash kernel
log = logging.getLogger("logitserve.packing")


@dataclass(frozen=True)
class Member:
    """One sequence inside a pack: rows [offset, offset + length) of the packed row."""

    job: int
    sequence: int
    offset: int
    length: int


@dataclass(frozen=True)
class Pack:
    members: tuple[Member, ...]

    @property
    def tokens(self) -> int:
        return sum(m.length for m in self.members)


def plan_packs(lengths: Sequence[tuple[int, int, int]], max_tokens: int) -> list[Pack]:
    """Group (job, sequence, length) in order into packs of at most max_tokens (a longer sequence packs alone)."""
    packs: list[Pack] = []
    members: list[Member] = []
    used = 0
    for job, seq, n in lengths:
        if members and used + n > max_tokens:
            packs.append(Pack(tuple(members)))
            members, used = [], 0
        members.append(Member(job, seq, used, n))
        used += n
    if members:
        packs.append(Pack(tuple(members)))
    return packs


def cpu_pack_tokens(hidden: int, intermediate: int, upper: int) -> int:
    """Tokens per pack on CPU: the largest power of two whose widest activation ([n, width] fp32; this rank's
    intermediate width under TP) stays within half of glibc's largest mmap threshold, so tuned malloc reuses
    it (logitserve.hostmem)."""
    from .hostmem import MMAP_THRESHOLD

    width = max(intermediate, hidden, 1)
    n = max(1, (MMAP_THRESHOLD // 2) // (4 * width))
    return max(1, min(upper, max(256, 1 << (n.bit_length() - 1))))


def packed_positions(lengths: Sequence[int]) -> torch.Tensor:
    """Positions restarting at 0 per sequence: [sum(lengths)] int64."""
    return torch.cat([torch.arange(n) for n in lengths])


@contextlib.contextmanager
def packed_forward(lengths: Sequence[int], device: torch.device) -> Iterator[None]:
    """Within this block, varlen attention knows where each packed sequence starts and ends."""
    lens = torch.tensor(list(lengths), dtype=torch.int32)
    _state.lengths = tuple(int(n) for n in lengths)
    _state.cu = F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0)).to(device)      # [n_seq + 1]
    try:
        yield
    finally:
        _state.lengths = _state.cu = None


def _runs(lengths: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(first row, length, count) of each run of consecutive sequences of equal length."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for n in lengths:
        if runs and runs[-1][1] == n:
            runs[-1] = (runs[-1][0], n, runs[-1][2] + 1)
        else:
            runs.append((start, n, 1))
        start += n
    return runs


def _window_mask(length: int, window: Optional[int], device) -> Optional[torch.Tensor]:
    """Causal mask with a sliding window (keys within `window` of the query), or None for plain causal."""
    if not window or window >= length:
        return None
    i = torch.arange(length, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window)                                        # [L, L] key visible to query


def _softcapped(q, k, v, mask, scaling, softcap) -> torch.Tensor:
    """Gemma-2-style attention with tanh-capped scores, as transformers' eager path. q: [g, H, n, D] -> same."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
    s = torch.tanh(s / softcap) * softcap                                  # [g, H, n, n]
    n = q.shape[2]
    visible = mask if mask is not None else torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32))   # upcast, never down
    return torch.matmul(p.to(q.dtype), v)


def _grouped_sdpa(query, key, value, lengths, scaling, window, softcap=None) -> torch.Tensor:
    """query [1, H, N, D], key/value [1, Hkv, N, D] -> [1, N, H, D]: one sdpa per run of equal lengths, on views."""
    out = torch.empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3],
                      dtype=query.dtype, device=query.device)              # [1, N, H, D]
    gqa = query.shape[1] != key.shape[1]
    for a, n, g in _runs(lengths):
        rows = slice(a, a + g * n)
        q = query[0, :, rows].unflatten(1, (g, n)).transpose(0, 1)          # [g, H, n, D]
        k = key[0, :, rows].unflatten(1, (g, n)).transpose(0, 1)            # [g, Hkv, n, D]
        v = value[0, :, rows].unflatten(1, (g, n)).transpose(0, 1)
        mask = _window_mask(n, window, query.device)
        if softcap:
            o = _softcapped(q, k, v, mask, scaling, softcap)                # [g, H, n, D]
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and n > 1,
                                               scale=scaling, enable_gqa=gqa)   # [g, H, n, D]
        out[0, rows] = o.transpose(1, 2).reshape(g * n, o.shape[1], o.shape[3])
    return out


def _flash_varlen(query, key, value, cu, max_len, scaling, window) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    q = query[0].transpose(0, 1).contiguous()                              # [N, H, D]
    k = key[0].transpose(0, 1).contiguous()                                # [N, Hkv, D]
    v = value[0].transpose(0, 1).contiguous()
    left = window - 1 if window else -1
    out = varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scaling, window_size=(left, 0),
                      enable_gqa=query.shape[1] != key.shape[1])          # [N, H, D]
    return out[None]


def varlen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                             softcap: Optional[float] = None, **kwargs):
    """query: [1, H, N, D], key/value: [1, Hkv, N, D] -> ([1, N, H, D], None), attending within each sequence."""
    if query.shape[0] != 1:
        raise RuntimeError(f"varlen attention takes one packed row, got batch {query.shape[0]}")
    if kwargs.get("s_aux") is not None:   # attention sinks (gpt-oss): not implemented; never silently dropped
        raise NotImplementedError("packed attention does not support attention sinks (s_aux): use --batching exact")
    lengths = _lengths(query)
    global _flash_ok   # capped scores (softcap) have no flash kernel here: they always take the sdpa-per-run path
    if not softcap and _flash_ok and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        cu = getattr(_state, "cu", None)
        if cu is None:
            cu = torch.tensor([0, query.shape[2]], dtype=torch.int32, device=query.device)
        try:
            return _flash_varlen(query, key, value, cu, max(lengths), scaling, sliding_window), None
        except (RuntimeError, ImportError, NotImplementedError) as e:   # no flash kernel for this GPU or build
            _flash_ok = False
            log.warning("varlen flash attention unavailable (%s); packed attention uses sdpa per length", e)
    return _grouped_sdpa(query, key, value, lengths, scaling, sliding_window, softcap), None


def _lengths(query) -> tuple[int, ...]:
    lengths = getattr(_state, "lengths", None) or (query.shape[2],)       # outside packed_forward: one sequence
    if sum(lengths) != query.shape[2]:
        raise RuntimeError(f"packed lengths sum to {sum(lengths)}, the row holds {query.shape[2]} tokens")
    return lengths


def register_varlen_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
