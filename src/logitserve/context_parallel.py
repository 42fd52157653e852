"""Context parallelism: SPEC.md's head-tail sequence layout and causal attention across CP ranks.

A sequence is padded to a multiple of 2*cp and cut into 2*cp chunks of S rows;
rank r holds chunks r and 2*cp-1-r. RoPE sees global positions. The attention
function, registered through transformers' AttentionInterface, all-gathers K/V
(and the positions each rank holds) over the CP group and masks by global
position, so padding at the end is never attended by a real token.
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
    _state.group = group
    _state.mask = everyone[None, :] <= positions[:, None]             # [2S, cp * 2S] key visible to query
    try:
        yield
    finally:
        _state.group = _state.mask = None


def cp_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                         scaling: Optional[float] = None, **kwargs):
    """query: [B, H, 2S, D], key/value: [B, Hkv, 2S, D] local -> [B, 2S, H, D] over every rank's keys."""
    group = getattr(_state, "group", None)
    if group is None:
        raise RuntimeError("CP attention called outside cp_forward()")
    k_all = _all_gather_cat(key, group, dim=2)                          # [B, Hkv, cp*2S, D]
    v_all = _all_gather_cat(value, group, dim=2)
    out = F.scaled_dot_product_attention(query, k_all, v_all, attn_mask=_state.mask, dropout_p=0.0,
                                         scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register_cp_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, cp_attention_forward)
