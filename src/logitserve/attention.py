"""Packed attention: many sequences in one row of tokens, each attending only within itself (varlen), causally.

The attention function registered here (through transformers' AttentionInterface) serves
packed bodies (logitserve.packing):
- CUDA, bf16/fp16: torch's flash-attention `varlen_attn` on cu_seqlens, no mask, its
  arguments as the installed torch takes them (logitserve.capabilities, probed once);
- otherwise: scaled_dot_product_attention(is_causal) once per run of consecutive
  sequences of equal length (a [g, H, L, D] view of the row), so no [N, N] mask
  ever exists and no token is compared with another sequence's; continuations of a
  shared prefix attend to it with a [R, S + R] mask per run.
transformers builds no mask for an attention implementation it does not know,
so nothing can slip an all-ones or dense block-diagonal mask in.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F

from .capabilities import Capabilities, probe

VARLEN_ATTENTION = "logitserve_varlen"
_state = threading.local()
log = logging.getLogger("logitserve.attention")


class FlashVarlen:
    """Whether packed attention runs the varlen flash kernel: decided at start-up by one tiny call (probe_flash);
    a later failure that is the kernel's (not the batch's: out of memory) turns it off for good, with one warning."""

    def __init__(self) -> None:
        self.enabled = True
        self.calls = 0            # packed attentions that ran on flash varlen (bench/gpu_check.sh asserts it ran)

    def usable(self, query: torch.Tensor, parents, softcap) -> bool:
        # capped scores (softcap) and shared prefixes have no flash kernel here: they take the sdpa path
        return (self.enabled and parents is None and not softcap and query.is_cuda
                and query.dtype in (torch.bfloat16, torch.float16))

    def off(self, e: BaseException) -> None:
        self.enabled = False
        log.warning("varlen flash attention unavailable (%s: %s); packed attention uses sdpa per length",
                    type(e).__name__, e)


FLASH = FlashVarlen()


@contextlib.contextmanager
def packed_forward(lengths: Sequence[int], device: torch.device,
                   parents: Optional[Sequence[int]] = None) -> Iterator[None]:
    """Within this block, varlen attention knows where each packed segment starts and ends, and which
    segments continue a shared prefix (parents[i]: the prefix segment's index, -1 for none)."""
    lens = torch.tensor(list(lengths), dtype=torch.int32)
    _state.lengths = tuple(int(n) for n in lengths)
    _state.cu = F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0)).to(device)      # [n_seq + 1]
    _state.parents = tuple(parents) if parents is not None and any(p >= 0 for p in parents) else None
    try:
        yield
    finally:
        _state.lengths = _state.cu = _state.parents = None


def _runs(lengths: tuple[int, ...], plain: Optional[Sequence[bool]] = None) -> list[tuple[int, int, int]]:
    """(first row, length, count) of each run of consecutive plain sequences of equal length."""
    runs: list[tuple[int, int, int]] = []
    start, joinable = 0, False
    for i, n in enumerate(lengths):
        if plain is not None and not plain[i]:
            joinable = False
        elif joinable and runs[-1][1] == n:
            runs[-1] = (runs[-1][0], n, runs[-1][2] + 1)
        else:
            runs.append((start, n, 1))
            joinable = True
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


def _grouped_sdpa(query, key, value, lengths, scaling, window, softcap=None, parents=None) -> torch.Tensor:
    """query [1, H, N, D], key/value [1, Hkv, N, D] -> [1, N, H, D]: one sdpa per run of equal lengths, on views;
    continuations of a shared prefix attend to it too (_continuations)."""
    out = torch.empty(query.shape[0], query.shape[2], query.shape[1], value.shape[3],     # Dv: MLA's differs from D
                      dtype=query.dtype, device=query.device)              # [1, N, H, Dv]
    gqa = query.shape[1] != key.shape[1]
    plain = None if parents is None else [p < 0 for p in parents]
    if parents is not None:
        _continuations(query, key, value, lengths, parents, scaling, window, softcap, out)
    for a, n, g in _runs(lengths, plain):
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


def _continuations(query, key, value, lengths, parents, scaling, window, softcap, out) -> None:
    """Rows of segments that continue a shared prefix, written into out [1, N, H, D]: each attends to all of its
    prefix's keys/values and causally to its own (a [R, S + R] mask per run of equal-length continuations of one
    prefix: memory linear in the batch, never [N, N])."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    gqa = query.shape[1] != key.shape[1]
    i = 0
    while i < len(lengths):
        p = parents[i]
        if p < 0:
            i += 1
            continue
        j = i
        while j + 1 < len(lengths) and parents[j + 1] == p and lengths[j + 1] == lengths[i]:
            j += 1
        g, R, S = j - i + 1, lengths[i], lengths[p]
        rows = slice(offsets[i], offsets[i] + g * R)
        pre = slice(offsets[p], offsets[p] + S)
        q = query[0, :, rows].unflatten(1, (g, R)).transpose(0, 1)                      # [g, H, R, D]
        k_own = key[0, :, rows].unflatten(1, (g, R)).transpose(0, 1)                    # [g, Hkv, R, D]
        v_own = value[0, :, rows].unflatten(1, (g, R)).transpose(0, 1)
        k = torch.cat([key[0, :, pre].expand(g, -1, -1, -1), k_own], dim=2)             # [g, Hkv, S + R, D]
        v = torch.cat([value[0, :, pre].expand(g, -1, -1, -1), v_own], dim=2)
        qpos = torch.arange(S, S + R, device=query.device)
        kpos = torch.arange(S + R, device=query.device)
        d = qpos[:, None] - kpos[None, :]
        visible = (d >= 0) & (d < window) if window else d >= 0                          # [R, S + R]
        if softcap:
            o = _softcapped(q, k, v, visible, scaling, softcap)                          # [g, H, R, D]
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scaling, enable_gqa=gqa)
        out[0, rows] = o.transpose(1, 2).reshape(g * R, o.shape[1], o.shape[3])
        i = j + 1


def _flash_varlen(query, key, value, cu, max_len, scaling, window, caps: Capabilities) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    q = query[0].transpose(0, 1).contiguous()                              # [N, H, D]
    k = key[0].transpose(0, 1).contiguous()                                # [N, Hkv, D]
    v = value[0].transpose(0, 1).contiguous()
    kw = dict(scale=scaling)
    if caps.varlen_window:              # (-1, 0): causal; (W - 1, 0): causal within a sliding window
        kw["window_size"] = (window - 1 if window else -1, 0)
    elif caps.varlen_causal and not window:
        kw["is_causal"] = True
    else:                               # the sdpa path serves it: flash goes off with one warning
        raise NotImplementedError("this torch's varlen_attn takes no window_size (causal / sliding-window masks)")
    if query.shape[1] != key.shape[1]:
        if caps.varlen_gqa:
            kw["enable_gqa"] = True
        else:            # a torch whose varlen_attn takes no enable_gqa: repeat the KV heads instead
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    FLASH.calls += 1
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)[None]                      # [1, N, H, D]


def probe_flash(device: torch.device, dtype: torch.dtype) -> bool:
    """Once at start-up on a GPU: does a tiny varlen flash call run here (kernel, build, arguments)? If not, packed
    attention takes the sdpa path from the first request on, with one warning, instead of finding out mid-batch."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or not FLASH.enabled:
        return False
    caps = probe(str(device))
    if not caps.varlen_attn:
        FLASH.off(ImportError("torch.nn.attention.varlen is missing"))
        return False
    try:
        q = torch.zeros(1, 2, 4, 64, dtype=dtype, device=device)
        kv = torch.zeros(1, 1, 4, 64, dtype=dtype, device=device)
        cu = torch.tensor([0, 3, 4], dtype=torch.int32, device=device)
        _flash_varlen(q, kv, kv, cu, 3, 0.125, None, caps)
        torch.cuda.synchronize(device)
        FLASH.calls = 0        # counts requests' packed attentions only
        return True
    except Exception as e:   # noqa: BLE001 (any failure: the sdpa path serves)
        FLASH.off(e)
        return False


def varlen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                             softcap: Optional[float] = None, **kwargs):
    """query: [1, H, N, D], key/value: [1, Hkv, N, D] -> ([1, N, H, D], None), attending within each sequence."""
    if query.shape[0] != 1:
        raise RuntimeError(f"varlen attention takes one packed row, got batch {query.shape[0]}")
    if kwargs.get("s_aux") is not None:   # attention sinks (gpt-oss): not implemented; never silently dropped
        raise NotImplementedError("packed attention does not support attention sinks (s_aux): use --batching exact")
    lengths = _lengths(query)
    parents = getattr(_state, "parents", None)
    if FLASH.usable(query, parents, softcap):
        cu = getattr(_state, "cu", None)
        if cu is None:
            cu = torch.tensor([0, query.shape[2]], dtype=torch.int32, device=query.device)
        try:
            caps = probe(str(query.device))
            return _flash_varlen(query, key, value, cu, max(lengths), scaling, sliding_window, caps), None
        except torch.cuda.OutOfMemoryError:      # this batch's problem, not the kernel's: flash stays on
            raise
        except (RuntimeError, ImportError, NotImplementedError, TypeError) as e:   # no flash kernel for this GPU,
            # build or torch version (a TypeError: an argument this torch's varlen_attn does not take)
            FLASH.off(e)
    # Shared prefixes take this path on CUDA too: sdpa with a [R, S + R] mask per continuation run (the
    # memory-efficient kernel), the plain segments per run of equal lengths.
    return _grouped_sdpa(query, key, value, lengths, scaling, sliding_window, softcap, parents), None


def _lengths(query) -> tuple[int, ...]:
    lengths = getattr(_state, "lengths", None) or (query.shape[2],)       # outside packed_forward: one sequence
    if sum(lengths) != query.shape[2]:
        raise RuntimeError(f"packed lengths sum to {sum(lengths)}, the row holds {query.shape[2]} tokens")
    return lengths


def register_varlen_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
