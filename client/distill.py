"""Distillation losses between a student's logits and a teacher's served top-k, candidates or full distribution (torch).

Semantics follow NeMo-RL's DistillationLossFn: the student's log-probs are gathered at
the teacher's ids; `kl` is forward KL(teacher || student), reverse KL(student || teacher)
or mixed (`w * forward + (1 - w) * reverse`); `tail` says what happens outside the ids:

- "renormalize": both distributions restricted to the k ids and renormalised over them
  (NeMo-RL's `zero_outside_topk=False`);
- "zero": full-vocabulary log-probs, the teacher has no mass outside its ids; the reverse
  term outside them is the student's own `sum p log p` minus `log_infinitesimal * P_rest`
  (NeMo-RL's `zero_outside_topk=True`);
- "bucket": the k ids plus one bucket for the rest: the teacher's served tail mass
  (`topk_tail=True`) against the student's mass outside the ids.

Teacher values must be full-vocabulary log-probs (`topk_as_logprobs=True`, or candidate
log-probs, i.e. the student's own top-k scored by the teacher) for "zero" and "bucket";
"renormalize" also takes plain logits. Rows align as served: row t describes token t+1.

`full_kd_loss` compares whole distributions: forward KL, reverse KL or TRL GKD's
generalized JSD, on teacher logits rebuilt from served hidden states (`TeacherHead`)
chunk by chunk, or on served full logits.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import torch.utils.checkpoint

KL_KINDS = ("forward", "reverse", "mixed")
TAILS = ("renormalize", "zero", "bucket")
REDUCTIONS = ("token", "sequence", "sum", "none")


@dataclass(frozen=True)
class TeacherBatch:
    """A request's served top-k padded into a batch: values/ids [B, L, k], tail and mask [B, L]."""

    values: torch.Tensor
    ids: torch.Tensor
    mask: torch.Tensor
    tail: Optional[torch.Tensor] = None

    @classmethod
    def from_result(cls, result, length: Optional[int] = None, device=None) -> "TeacherBatch":
        """From a ForwardResult with top-k (and `topk_tail` if asked), padded to `length` rows."""
        return cls.from_arrays(result.topk_values, result.topk_ids, result.topk_tail, length, device)

    @classmethod
    def from_arrays(cls, values: Sequence, ids: Sequence, tail: Optional[Sequence] = None,
                    length: Optional[int] = None, device=None) -> "TeacherBatch":
        B, k = len(values), values[0].shape[-1]
        L = length or max(len(v) for v in values)
        v = np.zeros((B, L, k), np.float32)
        i = np.zeros((B, L, k), np.int64)
        m = np.zeros((B, L), bool)
        t = np.zeros((B, L), np.float32) if tail is not None else None
        for b in range(B):
            n = min(L, len(values[b]))
            v[b, :n], i[b, :n], m[b, :n] = values[b][:n], ids[b][:n], True
            if t is not None:
                t[b, :n] = tail[b][:n]
        as_t = lambda a: torch.from_numpy(a).to(device) if device is not None else torch.from_numpy(a)   # noqa: E731
        return cls(as_t(v), as_t(i), as_t(m), as_t(t) if t is not None else None)


def _plogp_minus(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """p * (log p - log q), 0 where p = 0 (log p = -inf)."""
    out = p_log.exp() * (p_log - q_log)
    return torch.where(torch.isneginf(p_log), torch.zeros_like(out), out)


def kd_loss(student_logits: torch.Tensor, teacher_logprobs: torch.Tensor, teacher_ids: torch.Tensor, *,
            kl: str = "forward", mixed_weight: float = 0.5, tail: str = "renormalize",
            teacher_tail: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None,
            reduction: str = "token", log_infinitesimal: float = -100.0) -> torch.Tensor:
    """The KD loss. student_logits [B, L, V], teacher_logprobs / teacher_ids [B, L, k] (distinct ids per row),
    teacher_tail [B, L] for tail="bucket", mask [B, L] (true = counted). Computed in at least fp32."""
    if kl not in KL_KINDS or tail not in TAILS or reduction not in REDUCTIONS:
        raise ValueError(f"kl={kl!r} tail={tail!r} reduction={reduction!r}: choose from {KL_KINDS}, {TAILS}, "
                         f"{REDUCTIONS}")
    if not 0.0 <= mixed_weight <= 1.0:
        raise ValueError(f"mixed_weight={mixed_weight} must lie in [0, 1]")
    if tail == "bucket" and teacher_tail is None:
        raise ValueError('tail="bucket" needs teacher_tail (ask the teacher for topk_tail=True)')
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    s_full = torch.log_softmax(student_logits.to(dtype), dim=-1)                       # [B, L, V]
    ids = teacher_ids.long()
    s = s_full.gather(-1, ids)                                                          # [B, L, k]
    t = teacher_logprobs.to(dtype)
    if tail == "renormalize":
        s, t = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    fwd = _plogp_minus(t, s).sum(-1)                                                    # [B, L]
    rev = _plogp_minus(s, t).sum(-1)
    if tail == "zero" and kl != "forward":
        inside = (s.exp() * s).sum(-1)
        plogp_all = (s_full.exp() * s_full).sum(-1)                                     # sum p log p, full row
        rev = rev + (plogp_all - inside) - log_infinitesimal * (1.0 - s.exp().sum(-1))
    if tail == "bucket":
        rest = s_full.scatter(-1, ids, float("-inf"))
        s_tail = torch.logsumexp(rest, -1)                                              # student mass outside, exact
        t_tail = teacher_tail.to(dtype)
        fwd = fwd + _plogp_minus(t_tail, s_tail)
        rev = rev + _plogp_minus(s_tail, t_tail)
    per_token = {"forward": fwd, "reverse": rev}.get(kl)
    if per_token is None:
        per_token = mixed_weight * fwd + (1.0 - mixed_weight) * rev
    return _reduce(per_token, mask, reduction)


def _reduce(per_token: torch.Tensor, mask: Optional[torch.Tensor], reduction: str) -> torch.Tensor:
    m = torch.ones_like(per_token) if mask is None else mask.to(per_token.dtype)
    per_token = torch.where(m > 0, per_token, torch.zeros_like(per_token))              # masked rows never leak nan
    if reduction == "none":
        return per_token * m
    if reduction == "sum":
        return (per_token * m).sum()
    if reduction == "token":
        return (per_token * m).sum() / m.sum().clamp(min=1)
    counted = m.sum(-1)                                                                 # [B] tokens per sequence
    per_seq = (per_token * m).sum(-1) / counted.clamp(min=1)
    return per_seq[counted > 0].mean() if bool((counted > 0).any()) else per_seq.sum() * 0


FULL_KINDS = ("forward", "reverse", "jsd")


def divergence(s: torch.Tensor, t: torch.Tensor, kind: str, beta: float = 0.5) -> torch.Tensor:
    """Per-row divergence of log-probs s (student) and t (teacher), [n, V] -> [n]: forward KL(t || s), reverse
    KL(s || t), or TRL GKD's generalized JSD: beta KL(t || m) + (1 - beta) KL(s || m), m = beta t + (1 - beta) s
    (beta 0: forward KL, 1: reverse KL, as TRL's generalized_jsd_loss)."""
    kind = _plain_kind(kind, beta)
    if kind == "forward":
        return _plogp_minus(t, s).sum(-1)
    if kind == "reverse":
        return _plogp_minus(s, t).sum(-1)
    b = torch.tensor(beta, dtype=s.dtype, device=s.device)
    m = torch.logsumexp(torch.stack([s + torch.log1p(-b), t + torch.log(b)]), dim=0)     # [n, V]
    return beta * _plogp_minus(t, m).sum(-1) + (1.0 - beta) * _plogp_minus(s, m).sum(-1)


def _plain_kind(kind: str, beta: float) -> str:
    """The generalized JSD at beta 0 is forward KL and at beta 1 reverse KL (TRL computes them so)."""
    if kind == "jsd" and beta in (0.0, 1.0):
        return "forward" if beta == 0.0 else "reverse"
    return kind


def kl_from_logits(za: torch.Tensor, zb: torch.Tensor) -> torch.Tensor:
    """KL(softmax(za) || softmax(zb)) per row, [n, V] -> [n], without materialising either log-softmax:
    sum p_a (za - zb) - lse(za) + lse(zb) (a third of the passes over [n, V] of the log-prob form)."""
    lse_a = torch.logsumexp(za, -1, keepdim=True)                                       # [n, 1]
    p = torch.exp(za - lse_a)                                                           # [n, V]
    d = za - zb
    if not bool(torch.isfinite(za).all()):           # p = 0 where za = -inf: those terms are 0, not nan
        d = torch.where(p > 0, d, torch.zeros_like(d))
    return torch.linalg.vecdot(p, d) - lse_a[:, 0] + torch.logsumexp(zb, -1)


def full_kd_loss(student_logits: torch.Tensor, teacher: torch.Tensor, *, head=None, kind: str = "forward",
                 beta: float = 0.5, temperature: float = 1.0, mask: Optional[torch.Tensor] = None,
                 reduction: str = "token", chunk_rows: int = 256, vocab_size: Optional[int] = None) -> torch.Tensor:
    """Full-vocabulary KD, chunk by chunk over positions.

    student_logits [B, L, V]; teacher: the served hidden states [B, L, H] with `head` (a TeacherHead: the
    teacher's logits are rebuilt per chunk, and recomputed in the backward pass rather than kept, so
    [B, L, V] of the teacher never exists), or teacher logits [B, L, V] without. Both distributions at
    `temperature`; `kind`: "forward", "reverse" or "jsd" (with `beta`, see `divergence`); `mask` [B, L]
    (true = counted; rows it drops are never computed); reductions as `kd_loss`. `vocab_size`: compare only
    the first columns (vocabularies padded to different sizes). Computed in at least fp32.
    """
    if kind not in FULL_KINDS or reduction not in REDUCTIONS:
        raise ValueError(f"kind={kind!r} reduction={reduction!r}: choose from {FULL_KINDS}, {REDUCTIONS}")
    if not 0.0 <= beta <= 1.0 or not temperature > 0:
        raise ValueError(f"beta={beta} must lie in [0, 1] and temperature={temperature} be > 0")
    B, L, Vs = student_logits.shape
    Vt = head.vocab_size if head is not None else teacher.shape[-1]
    V = vocab_size or Vs
    if V > min(Vs, Vt) or (vocab_size is None and Vs != Vt):
        raise ValueError(f"student vocabulary {Vs} and teacher's {Vt} differ: pass vocab_size (<= both) to compare "
                         f"their first columns")
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    flat_s = student_logits.reshape(B * L, Vs)                                                # [N, Vs]
    flat_t = teacher.reshape(B * L, teacher.shape[-1])                                        # [N, H or V]
    keep = torch.ones(B * L, dtype=torch.bool, device=flat_s.device) if mask is None else \
        mask.reshape(-1).to(device=flat_s.device, dtype=torch.bool)
    rows = keep.nonzero()[:, 0]                                                               # [n]

    def part(s_rows: torch.Tensor, t_rows: torch.Tensor) -> torch.Tensor:                    # [c, Vs], [c, .] -> [c]
        z = head(t_rows, temperature=temperature) if head is not None else t_rows.to(dtype) / temperature
        zt = z[:, :V].to(device=s_rows.device, dtype=dtype)                                 # [c, V]
        zs = s_rows[:, :V].to(dtype) / temperature
        plain = _plain_kind(kind, beta)
        if plain == "forward":
            return kl_from_logits(zt, zs)
        if plain == "reverse":
            return kl_from_logits(zs, zt)
        return divergence(torch.log_softmax(zs, -1), torch.log_softmax(zt, -1), kind, beta)

    values = []
    for a in range(0, len(rows), chunk_rows):
        idx = rows[a : a + chunk_rows]
        s_rows, t_rows = flat_s.index_select(0, idx), flat_t.index_select(0, idx.to(flat_t.device))
        if s_rows.requires_grad:     # keep only the inputs: the teacher's [c, V] is rebuilt for the backward
            values.append(torch.utils.checkpoint.checkpoint(part, s_rows, t_rows, use_reentrant=False))
        else:
            values.append(part(s_rows, t_rows))
    per_token = torch.zeros(B * L, dtype=dtype, device=flat_s.device)
    if values:
        per_token = per_token.index_copy(0, rows, torch.cat(values))
    return _reduce(per_token.reshape(B, L), mask, reduction)


def _check_weights(names, weights: Mapping) -> dict:
    """Weights for exactly these teachers, finite and >= 0, not all 0; ValueError naming the teacher otherwise."""
    names, given = set(names), set(weights)
    if names != given:
        raise ValueError(f"weights: teachers {sorted(map(str, names))} need one weight each, got "
                         f"{sorted(map(str, given))}")
    for t, w in weights.items():
        if not (math.isfinite(float(w)) and float(w) >= 0.0):
            raise ValueError(f"weights[{t!r}]={w}: must be finite and >= 0")
    if not any(float(w) > 0 for w in weights.values()):
        raise ValueError("weights: at least one must be > 0")
    return {t: float(w) for t, w in weights.items()}


def mixture_loss(losses: Mapping, weights: Mapping) -> torch.Tensor:
    """sum_t w_t * loss_t over teachers (a mapping id -> scalar loss, any of kd_loss, full_kd_loss or gold_loss, so
    teachers with another vocabulary join through the cross-tokenizer alignment). With forward KL on full
    distributions and weights summing to 1 its gradient is that of KL(sum_t w_t p_t || student): the two differ
    by a constant (docs/distillation.md, "Several teachers")."""
    w = _check_weights(losses, weights)
    return torch.stack([w[t] * loss for t, loss in losses.items()]).sum()


def routed_batches(result, length: Optional[int] = None, device=None) -> dict:
    """Teacher id -> TeacherBatch [B, L, k] over all B rows of a RoutedResult (logitserve.client.Teachers'
    forward with top-k), each masked to the rows its teacher answered."""
    B = len(result.teacher)
    L = length or max(len(v) for v in result.topk_values)
    out = {}
    for t in dict.fromkeys(result.teacher):
        mine = [r == t for r in result.teacher]
        k = next(v.shape[-1] for v, m in zip(result.topk_values, mine) if m)
        empty = np.zeros((0, k), np.float32)
        pick = lambda a, i: a[i] if mine[i] else empty                                   # noqa: E731
        tail = None if result.topk_tail is None else \
            [result.topk_tail[i] if mine[i] else np.zeros(0, np.float32) for i in range(B)]
        out[t] = TeacherBatch.from_arrays([pick(result.topk_values, i) for i in range(B)],
                                          [pick(result.topk_ids, i).astype(np.int64) for i in range(B)], tail, L, device)
    return out


def mixture_kd_loss(student_logits: torch.Tensor, batches: Mapping, weights: Mapping, *, reduction: str = "token",
                    **kd) -> torch.Tensor:
    """Several same-vocabulary teachers' top-k on one student: per token sum_t w_t * m_t * kd_t over the teachers
    whose mask m_t covers it (rows routed to one teacher, or ensembles answering the same rows), then reduced
    over the tokens any teacher covers. batches: id -> TeacherBatch [B, L, k_t] (e.g. from `routed_batches`);
    `kd`: kd_loss's options (kl, tail, mixed_weight, log_infinitesimal) for every teacher."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: choose from {REDUCTIONS}")
    w = _check_weights(batches, weights)
    total, covered = None, None
    for t, b in batches.items():
        per_token = kd_loss(student_logits, b.values, b.ids, teacher_tail=b.tail, mask=b.mask, reduction="none",
                            **kd)                                                       # [B, L], 0 where unmasked
        total = w[t] * per_token if total is None else total + w[t] * per_token
        covered = b.mask.bool() if covered is None else covered | b.mask.bool()
    return _reduce(total, covered, reduction)
