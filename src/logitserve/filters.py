"""The sampler's top-k / top-p filters of SPEC.md on (possibly vocab-sharded) logits."""
from __future__ import annotations

from typing import Optional

import torch

from .vocab_parallel import VocabShard, vp_logsumexp, vp_topk

_NEG_INF = float("-inf")
# top-p looks at the largest K of each row, growing K until the kept mass reaches p.
_TOP_P_FIRST_K = 256
_TOP_P_GROWTH = 8


def top_k_threshold(z: torch.Tensor, k: int, shard: VocabShard) -> torch.Tensor:
    """The k-th largest value of each row. z: [N, V/tp] -> [N, 1]."""
    vals, _ = vp_topk(z, k, shard)
    return vals[:, k - 1 : k]


def top_p_threshold(z: torch.Tensor, p: float, shard: VocabShard) -> torch.Tensor:
    """Smallest value kept by top-p: the sorted prefix whose probability first reaches p. z: [N, V/tp] -> [N, 1].

    Exact like a full sort: the prefix is read from a global top-K (merged across
    TP ranks) that grows until every row's prefix is inside it; the cumulative
    sum runs in float64 so membership at the boundary is decided precisely.
    """
    lse = vp_logsumexp(z, shard)[:, None]                            # [N, 1]
    V = shard.vocab_size
    K = min(V, _TOP_P_FIRST_K)
    while True:
        vals, _ = vp_topk(z, K, shard)                               # [N, K]
        cums = torch.exp((vals - lse).double()).cumsum(dim=-1)       # [N, K]
        if K >= V or bool((cums[:, -1] >= p).all()):
            break
        K = min(V, K * _TOP_P_GROWTH)
    n_finite = torch.isfinite(vals).sum(dim=-1, keepdim=True)        # [N, 1]
    before = (cums < p).sum(dim=-1, keepdim=True)                    # entries before the one reaching p
    idx = torch.minimum(before, n_finite - 1).clamp(min=0)
    return vals.gather(-1, idx)


def apply_filters(z: torch.Tensor, shard: VocabShard, top_k: Optional[int], top_p: Optional[float]) -> torch.Tensor:
    """z with entries outside the kept set set to -inf (ties at a threshold are kept). [N, V/tp] -> same."""
    if top_k is not None and top_k < shard.vocab_size:
        z = z.masked_fill(z < top_k_threshold(z, top_k, shard), _NEG_INF)
    if top_p is not None and top_p < 1.0:
        z = z.masked_fill(z < top_p_threshold(z, top_p, shard), _NEG_INF)
    return z
