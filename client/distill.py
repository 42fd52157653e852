"""Distillation losses between a student's logits and a teacher's served top-k or candidate log-probs (torch only here).

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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

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
