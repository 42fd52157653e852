"""Full-vocabulary KD losses on teacher logits rebuilt from served hidden states, against dense float64 references."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import random_seqs
from logitserve.client import TeacherClient
from logitserve.client.distill import full_kd_loss

V = 1003


@pytest.fixture(scope="module")
def served(llama_server, tmp_path_factory):
    """Hidden states [B, L, H] padded, their mask, and the head, from the live server."""
    seqs = random_seqs(np.random.default_rng(11), [13, 29, 6], vocab=V)
    with TeacherClient(llama_server.address) as c:
        hidden = c.hidden_states(seqs)
        head = c.head(cache=tmp_path_factory.mktemp("head"))
    L = max(len(s) for s in seqs)
    h = torch.zeros(len(seqs), L, 64)
    mask = torch.zeros(len(seqs), L, dtype=torch.bool)
    for b, x in enumerate(hidden):
        h[b, : len(x)], mask[b, : len(x)] = torch.from_numpy(x), True
    mask[0, 3] = False                             # a hole inside a sequence too
    return h, mask, head


def _reference(student: torch.Tensor, teacher_z: torch.Tensor, kind: str, beta: float, T: float) -> torch.Tensor:
    """Per-token divergence, dense float64, written from the definitions (TRL GKD's via F.kl_div)."""
    s = F.log_softmax(student.double() / T, -1)
    t = F.log_softmax(teacher_z.double(), -1)
    if kind == "forward":
        return (t.exp() * (t - s)).sum(-1)
    if kind == "reverse":
        return (s.exp() * (s - t)).sum(-1)
    m = torch.log((1 - beta) * s.exp() + beta * t.exp())
    return beta * F.kl_div(m, t, reduction="none", log_target=True).sum(-1) + \
        (1 - beta) * F.kl_div(m, s, reduction="none", log_target=True).sum(-1)


@pytest.mark.live_server
@pytest.mark.parametrize("kind,beta", [("forward", 0.5), ("reverse", 0.5), ("jsd", 0.5), ("jsd", 0.1), ("jsd", 0.0),
                                       ("jsd", 1.0)])
@pytest.mark.parametrize("reduction", ["token", "sequence", "sum"])
def test_full_kd_matches_dense_float64(served, kind, beta, reduction):
    h, mask, head = served
    T = 0.8
    torch.manual_seed(0)
    student = (torch.randn(*mask.shape, V, dtype=torch.float64) * 2).requires_grad_(True)
    loss = full_kd_loss(student, h, head=head, kind=kind, beta=beta, temperature=T, mask=mask, reduction=reduction,
                        chunk_rows=7)
    loss.backward()
    mine = student.grad.clone()
    student.grad = None
    z = head(h, temperature=T)                                       # [B, L, V]: dense, for the reference only
    if kind == "jsd" and beta in (0.0, 1.0):
        kind, beta = ("forward" if beta == 0.0 else "reverse"), beta
    per = _reference(student, z, kind, beta, T) * mask
    m = mask.double()
    ref = {"token": per.sum() / m.sum(), "sum": per.sum(),
           "sequence": ((per.sum(-1) / m.sum(-1)).mean())}[reduction]
    ref.backward()
    # The teacher's logits are fp32, as served: the dense reference's one GEMM and the loss's 7-row chunks may
    # accumulate them in different orders (seen: the BLAS blocks by shape), ~1e-7 of |z|; all else is float64.
    assert torch.allclose(loss, ref, rtol=1e-6, atol=1e-9), (loss.item(), ref.item())
    assert torch.allclose(mine, student.grad, rtol=1e-5, atol=1e-6 * student.grad.abs().max().item())


@pytest.mark.live_server
def test_full_kd_on_served_logits_and_bad_arguments(served, llama_server):
    h, mask, head = served
    z = head(h)                                                      # teacher logits given directly
    student = torch.randn(*mask.shape, V)
    a = full_kd_loss(student, h, head=head, mask=mask)
    b = full_kd_loss(student, z, mask=mask)
    assert torch.allclose(a, b, rtol=1e-6)
    with pytest.raises(ValueError, match="vocab_size"):
        full_kd_loss(torch.randn(*mask.shape, V + 5), h, head=head)
    padded = torch.cat([student, torch.randn(*mask.shape, 5)], -1)   # a student padded past the teacher's V
    assert torch.allclose(full_kd_loss(padded, h, head=head, mask=mask, vocab_size=V), a, rtol=1e-6)
    with pytest.raises(ValueError):
        full_kd_loss(student, h, head=head, kind="tvd")
    with pytest.raises(ValueError):
        full_kd_loss(student, h, head=head, kind="jsd", beta=1.5)


@pytest.mark.unit
def test_kl_from_logits_with_masked_columns():
    """-inf logits (a masked vocabulary) carry no mass: their terms are 0, not nan; KL to a -inf the other side
    gives mass to is inf."""
    from logitserve.client.distill import kl_from_logits

    torch.manual_seed(1)
    za, zb = torch.randn(5, 40, dtype=torch.float64), torch.randn(5, 40, dtype=torch.float64)
    za[:, :7] = float("-inf")
    pa, la, lb = za.softmax(-1), za.log_softmax(-1), zb.log_softmax(-1)
    ref = torch.where(pa > 0, pa * (la - lb), torch.zeros_like(pa)).sum(-1)
    assert torch.allclose(kl_from_logits(za, zb), ref, rtol=1e-12, atol=1e-14)
    zb[0, 20] = float("-inf")
    assert torch.isinf(kl_from_logits(za, zb)[0]) and torch.isfinite(kl_from_logits(za, zb)[1:]).all()
