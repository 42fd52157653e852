"""Context parallelism: SPEC.md's head-tail sequence layout and causal attention across CP ranks.

A sequence is padded to a multiple of 2*cp and cut into 2*cp chunks of S rows;
rank r holds chunks r and 2*cp-1-r. RoPE sees global positions. The attention
function, registered through transformers' AttentionInterface, all-gathers K/V
(and the positions each rank holds) over the CP group and puts the keys in global
order. Each of the rank's two runs then attends to the keys up to its own end with
a lower-right causal mask (torch's `causal_lower_right`), which sdpa's flash and
memory-efficient kernels take: no boolean [2S, cp*2S] mask and so no fall back to
the MATH kernel's [B, H, 2S, cp*2S] scores at the lengths CP exists for. Padding
sits at the end, after every real token, so no real token attends to it.
"""
from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import collectives

CP_ATTENTION = "logitserve_cp"
_state = threading.local()


@dataclass(frozen=True)
class Run:
    """Rows [local, local + length) of this rank hold global positions [start, start + length)."""

    local: int
    start: int
    length: int


def head_tail(length: int, cp: int, rank: int) -> tuple[torch.Tensor, list[Run]]:
    """Global positions held by `rank` ([2S] int64) and the two runs they form."""
    if cp == 1:
        return torch.arange(length), [Run(0, 0, length)]
    S = math.ceil(length / (2 * cp))
    heads = (rank * S, (2 * cp - 1 - rank) * S)
    positions = torch.cat([torch.arange(h, h + S) for h in heads])
    return positions, [Run(0, heads[0], S), Run(S, heads[1], S)]


def _all_gather_cat(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    collectives.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


@contextlib.contextmanager
def cp_forward(group: Optional[dist.ProcessGroup], positions: torch.Tensor):
    """Within this block, CP attention knows the group and the causal mask by global position."""
    if group is None:
        yield
        return
    everyone = _all_gather_cat(positions, group, dim=0)               # [cp * 2S] global positions
    S = len(positions) // 2
    starts = positions[[0, S]].tolist()                               # the two runs' first positions (one sync)
    _state.group = group
    _state.order = torch.argsort(everyone)                            # gathered key rows in global order
    _state.runs = [(slice(0, S), starts[0] + S), (slice(S, 2 * S), starts[1] + S)]   # (query rows, key end)
    try:
        yield
    finally:
        _state.group = _state.order = _state.runs = None


def cp_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                         scaling: Optional[float] = None, **kwargs):
    """query: [B, H, 2S, D], key/value: [B, Hkv, 2S, D] local -> [B, 2S, H, D] over every rank's keys."""
    group = getattr(_state, "group", None)
    if group is None:
        raise RuntimeError("CP attention called outside cp_forward()")
    from torch.nn.attention.bias import causal_lower_right

    order = _state.order
    k_all = _all_gather_cat(key, group, dim=2).index_select(2, order)   # [B, Hkv, cp*2S, D], global order
    v_all = _all_gather_cat(value, group, dim=2).index_select(2, order)
    gqa = query.shape[1] != key.shape[1]
    outs = []
    for rows, end in _state.runs:                                       # each run: the keys before its end
        q = query[:, :, rows]                                           # [B, H, S, D]
        mask = causal_lower_right(q.shape[2], end)
        outs.append(F.scaled_dot_product_attention(q, k_all[:, :, :end], v_all[:, :, :end], attn_mask=mask,
                                                   dropout_p=0.0, scale=scaling, enable_gqa=gqa))
    out = torch.cat(outs, dim=2)                                        # [B, H, 2S, D]
    return out.transpose(1, 2).contiguous(), None


def register_cp_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, cp_attention_forward)
