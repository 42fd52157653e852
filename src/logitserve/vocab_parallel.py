"""Vocab-parallel reductions over logits sharded along the vocabulary (SPEC.md, TP).

Every function takes this rank's shard `z` of the logits, `[N, V_local]` fp32,
and a `VocabShard` saying which global columns it holds. With `group=None`
(tp = 1) the collectives vanish and the same code computes on the full row.
Padded columns (when tp does not divide V) hold -inf, so they never win.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from . import collectives


@dataclass(frozen=True)
class VocabShard:
    start: int                # global id of local column 0
    size: int                 # local columns, padding included
    vocab_size: int           # the true V
    group: Optional[dist.ProcessGroup] = None  # the TP group; None when tp = 1

    @property
    def distributed(self) -> bool:
        return self.group is not None


def full_vocab(vocab_size: int) -> VocabShard:
    return VocabShard(start=0, size=vocab_size, vocab_size=vocab_size, group=None)


def _all_reduce(t: torch.Tensor, op, shard: VocabShard) -> torch.Tensor:
    if shard.distributed:
        collectives.all_reduce(t, op=op, group=shard.group)
    return t


def vp_max(z: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Row max over the full vocabulary. z: [N, V/tp] -> [N]."""
    return _all_reduce(z.amax(dim=-1), dist.ReduceOp.MAX, shard)


def _finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    """A row max to shift by: 0 where the row is all -inf, so its log-sum-exp comes out -inf, not nan."""
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _local_logsumexp_(z: torch.Tensor, row_max: Optional[torch.Tensor] = None) -> torch.Tensor:
    """torch.logsumexp's arithmetic, in place: z is overwritten, and no [N, V] temporary is allocated.
    `row_max`: each row's max when the caller has it already (a top-k's first column), saving a pass."""
    m = _finite_or_zero(z.amax(dim=-1) if row_max is None else row_max)   # [N]
    return z.sub_(m[:, None]).exp_().sum(dim=-1).log_().add_(m)


def vp_logsumexp(z: torch.Tensor, shard: VocabShard, inplace: bool = False,
                 row_max: Optional[torch.Tensor] = None) -> torch.Tensor:
    """log(sum(exp(z))) over the full vocabulary. z: [N, V/tp] -> [N]; with inplace, z is consumed.

    Each rank reduces its shard (torch's fused logsumexp, or the same arithmetic in
    place so a big chunk costs no fresh allocation); the shards' results are then
    combined stably: M = max_r lse_r, lse = M + log(sum_r exp(lse_r - M)).
    """
    if row_max is not None and shard.distributed:    # a global max is not this shard's: shift by its own
        row_max = None
    local = _local_logsumexp_(z, row_max) if inplace else torch.logsumexp(z, dim=-1)   # [N]
    if not shard.distributed:
        return local
    m = _finite_or_zero(vp_max(local[:, None], shard))               # [N]
    s = torch.exp(local - m)                                         # [N]
    _all_reduce(s, dist.ReduceOp.SUM, shard)
    return m + torch.log(s)


def vp_gather(z: torch.Tensor, ids: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """z at global columns `ids`, taken by the rank that owns each. z: [N, V/tp], ids: [N, c] -> [N, c]."""
    local = ids - shard.start                                        # [N, c]
    if not shard.distributed:
        return z.gather(-1, local)
    owned = (local >= 0) & (local < shard.size)
    vals = z.gather(-1, local.clamp(0, shard.size - 1))
    vals = torch.where(owned, vals, torch.zeros_like(vals))          # exactly one rank adds a non-zero
    return _all_reduce(vals, dist.ReduceOp.SUM, shard)


def vp_count_above(z: torch.Tensor, threshold: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """How many of each row's vocab entries are strictly above `threshold`. z: [N, V/tp], threshold: [N] -> [N] int64.
    Padding columns hold -inf and are never counted."""
    if z.device.type == "cpu":      # numpy's compare and count: ~6x torch's bool sum on CPU (measured)
        import numpy as np

        above = z.numpy() > threshold.numpy()[:, None]                 # [N, V/tp] bool, contiguous
        if above.shape[1] % 8 == 0 and hasattr(np, "bitwise_count"):   # 8 bools a word: count their set bits
            count = np.bitwise_count(above.view(np.uint64)).sum(axis=1, dtype=np.int64)
        else:
            count = above.sum(axis=1, dtype=np.int64)
        count = torch.from_numpy(count)
    else:
        count = (z > threshold[:, None]).sum(dim=-1)                 # [N]
    return _all_reduce(count, dist.ReduceOp.SUM, shard)


def vp_topk(z: torch.Tensor, k: int, shard: VocabShard) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row, sorted descending, with global int64 ids. z: [N, V/tp] -> [N, k] x2."""
    k_local = min(k, shard.size)
    if k_local == 1:                                                 # the greedy token: max is ~2.5x topk
        vals, idx = z.max(dim=-1, keepdim=True)                      # [N, 1]
    else:
        vals, idx = torch.topk(z, k_local, dim=-1, sorted=True)      # [N, k_local]
    idx = idx + shard.start
    if not shard.distributed:
        return vals, idx
    world = dist.get_world_size(shard.group)
    all_vals = [torch.empty_like(vals) for _ in range(world)]
    all_idx = [torch.empty_like(idx) for _ in range(world)]
    collectives.all_gather(all_vals, vals.contiguous(), group=shard.group)
    collectives.all_gather(all_idx, idx.contiguous(), group=shard.group)
    cat_vals = torch.cat(all_vals, dim=-1)                           # [N, tp * k_local]
    cat_idx = torch.cat(all_idx, dim=-1)
    top_vals, pos = torch.topk(cat_vals, k, dim=-1, sorted=True)     # [N, k]
    return top_vals, cat_idx.gather(-1, pos)
