"""The vocab-parallel reductions on 2 gloo ranks (uneven, padded shards) against the full tensor on one process."""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.distributed as dist

from helpers import run_ranks

pytestmark = pytest.mark.multi_process

V, N, TP = 1003, 37, 2


def _full() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, V, generator=g, dtype=torch.float64).float() * 3      # [N, V]


def _rank(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=TP)
    from logitserve.filters import apply_filters
    from logitserve.vocab_parallel import VocabShard, vp_gather, vp_logsumexp, vp_max, vp_topk

    z = _full()
    local = math.ceil(V / TP)
    start = rank * local
    shard = VocabShard(start=start, size=local, vocab_size=V, group=dist.group.WORLD)
    zl = torch.full((N, local), float("-inf"))
    real = min(V, start + local) - start
    zl[:, :real] = z[:, start : start + real]                                      # [N, V/tp], padded
    ids = torch.randint(0, V, (N, 5), generator=torch.Generator().manual_seed(1))
    kept = apply_filters(zl, shard, top_k=40, top_p=0.7)
    res = {
        "max": vp_max(zl, shard), "lse": vp_logsumexp(zl, shard), "gather": vp_gather(zl, ids, shard),
        "topk": vp_topk(zl, 25, shard), "kept_lse": vp_logsumexp(kept, shard),
        "kept_finite": torch.isfinite(kept).sum(-1, keepdim=True),
    }
    dist.all_reduce(res["kept_finite"], group=dist.group.WORLD)
    if rank == 0:   # numpy pickles by value; a torch tensor would travel as a shared fd that dies with this process
        out.put({k: (tuple(t.numpy() for t in x) if isinstance(x, tuple) else x.numpy()) for k, x in res.items()})
    dist.destroy_process_group()


def test_vocab_parallel_reductions_match_full_tensor_under_tp2():
    got = {k: (tuple(map(torch.from_numpy, x)) if isinstance(x, tuple) else torch.from_numpy(x))
           for k, x in run_ranks(_rank, TP).items()}
    z = _full().double()
    ids = torch.randint(0, V, (N, 5), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(got["max"].double(), z.max(-1).values, atol=1e-6, rtol=0)
    torch.testing.assert_close(got["lse"].double(), torch.logsumexp(z, -1), atol=2e-6, rtol=0)
    torch.testing.assert_close(got["gather"].double(), z.gather(-1, ids), atol=0, rtol=0)
    vals, top = got["topk"]
    want_v, want_i = torch.sort(z, -1, descending=True)
    torch.testing.assert_close(vals.double(), want_v[:, :25], atol=1e-6, rtol=0)
    assert torch.equal(top, want_i[:, :25])                 # gaussian * 3: no near-ties at this size
    # filters: top_k 40 then top_p 0.7 by a sort on the full row
    kth = want_v[:, 39:40]
    zk = torch.where(z >= kth, z, torch.tensor(float("-inf"), dtype=z.dtype))
    sk = torch.sort(zk, -1, descending=True).values
    p = torch.softmax(sk, -1)
    n_keep = ((torch.cumsum(p, -1) - p) < 0.7).sum(-1, keepdim=True)
    tau = sk.gather(-1, n_keep - 1)
    zp = torch.where(zk >= tau, zk, torch.tensor(float("-inf"), dtype=z.dtype))
    assert torch.equal(got["kept_finite"], torch.isfinite(zp).sum(-1, keepdim=True))
    torch.testing.assert_close(got["kept_lse"].double(), torch.logsumexp(zp, -1), atol=2e-6, rtol=0)


if __name__ == "__main__":
    sys.exit(test_vocab_parallel_reductions_match_full_tensor_under_tp2())
