"""KD losses of logitserve.client.distill against dense full-vocabulary float64 references written out here."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from logitserve.client.distill import TeacherBatch, kd_loss

pytestmark = pytest.mark.unit

B, L, V, K = 3, 7, 50, 6
LOG_INF = -100.0


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    zt = torch.randn(B, L, V, generator=g, dtype=torch.float64) * 2                  # teacher logits
    zs = torch.randn(B, L, V, generator=g, dtype=torch.float64) * 2                  # student logits
    t_full = torch.log_softmax(zt, -1)
    t_top, ids = torch.topk(t_full, K, -1)                                            # served top-k as logprobs
    in_top = torch.zeros(B, L, V, dtype=torch.bool).scatter(-1, ids, True)
    tail = torch.log(torch.where(in_top, 0.0, t_full.exp()).sum(-1))                  # served tail mass
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, 5:] = False
    mask[2, :] = False
    mask[1, 0] = False
    return zt, zs, t_full, t_top, ids, in_top, tail, mask


def _kl_dense(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sum_V p (log p - log q) over dense rows, 0 where p = 0."""
    terms = p * (torch.log(p) - torch.log(q))
    return torch.where(p > 0, terms, torch.zeros_like(terms)).sum(-1)


def _reference(kind, tail, zs, t_full, in_top, w=0.3):
    q_full = torch.softmax(zs, -1)                                                    # [B, L, V]
    p_full = t_full.exp()
    if tail == "renormalize":
        p = torch.where(in_top, p_full, 0.0)
        p = p / p.sum(-1, keepdim=True)
        q = torch.where(in_top, q_full, 0.0)
        q = q / q.sum(-1, keepdim=True)
        fwd, rev = _kl_dense(p, q), _kl_dense(q, p)
    elif tail == "zero":
        p = torch.where(in_top, p_full, 0.0)                                           # not renormalised
        fwd = _kl_dense(p, q_full)
        log_p_tilde = torch.where(in_top, t_full, torch.full_like(t_full, LOG_INF))
        rev = (q_full * (torch.log(q_full) - log_p_tilde)).sum(-1)
    else:                                                                              # k ids + one bucket
        p = torch.cat([torch.where(in_top, p_full, 0.0), torch.where(in_top, 0.0, p_full).sum(-1, keepdim=True)], -1)
        q = torch.cat([torch.where(in_top, q_full, 0.0), torch.where(in_top, 0.0, q_full).sum(-1, keepdim=True)], -1)
        fwd, rev = _kl_dense(p, q), _kl_dense(q, p)
    return {"forward": fwd, "reverse": rev, "mixed": w * fwd + (1 - w) * rev}[kind]


@pytest.mark.parametrize("tail", ["renormalize", "zero", "bucket"])
@pytest.mark.parametrize("kind", ["forward", "reverse", "mixed"])
def test_kd_losses_equal_dense_float64_reference(kind, tail):
    zt, zs, t_full, t_top, ids, in_top, t_tail, mask = _data()
    want = _reference(kind, tail, zs, t_full, in_top)                                 # [B, L]
    got = kd_loss(zs, t_top, ids, kl=kind, mixed_weight=0.3, tail=tail, teacher_tail=t_tail, reduction="none")
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    m = mask.double()
    token = (want * m).sum() / m.sum()
    per_seq = (want * m).sum(-1) / m.sum(-1).clamp(min=1)
    kw = dict(kl=kind, mixed_weight=0.3, tail=tail, teacher_tail=t_tail, mask=mask)
    torch.testing.assert_close(kd_loss(zs, t_top, ids, reduction="token", **kw), token, atol=1e-6, rtol=0)
    torch.testing.assert_close(kd_loss(zs, t_top, ids, reduction="sequence", **kw), per_seq[:2].mean(),
                               atol=1e-6, rtol=0)                                      # sequence 2 is all masked
    torch.testing.assert_close(kd_loss(zs, t_top, ids, reduction="sum", **kw), (want * m).sum(), atol=1e-6, rtol=0)


def test_renormalize_takes_logits_and_identical_distributions_give_zero():
    zt, zs, t_full, t_top, ids, in_top, t_tail, mask = _data(1)
    z_top = zt.gather(-1, ids)                                                        # raw logits, not logprobs
    a = kd_loss(zs, z_top, ids, reduction="none")
    b = kd_loss(zs, t_top, ids, reduction="none")
    torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    for tail in ("renormalize", "zero", "bucket"):
        same = kd_loss(zt, t_top, ids, kl="mixed", tail=tail, teacher_tail=t_tail, reduction="none")
        if tail != "zero":        # "zero" charges the student's mass outside the ids: not 0 unless it has none
            torch.testing.assert_close(same, torch.zeros_like(same), atol=1e-12, rtol=0)


def test_candidate_logprobs_score_the_students_own_topk():
    zt, zs, t_full, *_ = _data(2)
    s_ids = torch.topk(zs, K, -1).indices                                             # the student's own top-k
    cand = t_full.gather(-1, s_ids)                                                   # what the teacher serves
    in_s = torch.zeros(B, L, V, dtype=torch.bool).scatter(-1, s_ids, True)
    got = kd_loss(zs, cand, s_ids, kl="reverse", reduction="none")
    torch.testing.assert_close(got, _reference("reverse", "renormalize", zs, t_full, in_s), atol=1e-6, rtol=0)


def test_fp32_student_logits_and_a_padded_teacher_batch():
    zt, zs, t_full, t_top, ids, in_top, t_tail, mask = _data(3)
    lengths = [7, 4, 2]
    batch = TeacherBatch.from_arrays([t_top[b, :n].float().numpy() for b, n in enumerate(lengths)],
                                     [ids[b, :n].int().numpy() for b, n in enumerate(lengths)],
                                     [t_tail[b, :n].float().numpy() for b, n in enumerate(lengths)], length=L)
    assert batch.values.shape == (B, L, K) and batch.mask.sum(-1).tolist() == lengths
    got = kd_loss(zs.float(), batch.values, batch.ids, tail="bucket", teacher_tail=batch.tail, mask=batch.mask)
    m = batch.mask.double()
    want = (_reference("forward", "bucket", zs, t_full, in_top) * m).sum() / m.sum()
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.item(), want.item(), atol=1e-5)
