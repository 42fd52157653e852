"""Cross-tokenizer distillation losses (ULD, and TRL GOLD's hybrid) on aligned full distributions (torch).

Rows are token-aligned: row k of a side's logits is its model's distribution for that
side's token k (the served layout with `prompt_lengths`: row j predicts token P + j).
Each aligned pair of spans (`logitserve.client.align`) becomes one row per side by
merging the span's probabilities as GOLD does:

- "bayesian": the last token's distribution times the probabilities of the span's
  earlier actual tokens (the chain rule over the span);
- "observed" (GOLD's default): the first row times the probabilities the later rows
  give their own tokens, on rows laid out as GOLD slices them (unshifted).

Probabilities of actual tokens are floored at 1e-8, and merged rows are not
renormalised, as in GOLD. Then per sequence:

- plain ULD: rows sorted descending, the shorter vocabulary zero-padded, the L1
  distance summed and divided by the number of aligned rows;
- hybrid (`shared` given): TRL GKD's generalized JSD with `beta` on the columns both
  vocabularies spell alike (log of probabilities floored at 1e-8, summed, divided by
  the rows), plus the sorted L1 distance over the unmatched columns, weighted
  `matched_weight` / `unmatched_weight` (default: matched/V_teacher and the rest).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .distill import divergence

MERGES = ("bayesian", "observed")
FLOOR = 1e-8


def merge_span_probs(probs: torch.Tensor, groups: Sequence[range], ids, merge: str = "bayesian") -> torch.Tensor:
    """One row per group of token-aligned rows. probs [N, V], ids [N] (each row's actual token) -> [G, V]."""
    if merge not in MERGES:
        raise ValueError(f"merge={merge!r}: choose from {MERGES}")
    ids = torch.as_tensor(np.asarray(ids), dtype=torch.long, device=probs.device)
    actual = probs.gather(-1, ids[:, None])[:, 0].clamp(min=FLOOR)                        # [N]
    rows = []
    for g in groups:
        keep, rest = (g[-1], g[:-1]) if merge == "bayesian" else (g[0], g[1:])
        row = probs[keep]
        if len(rest):
            row = row * torch.prod(actual[rest.start : rest.stop])
        rows.append(row)
    return torch.stack(rows) if rows else probs.new_zeros(0, probs.shape[-1])


def sorted_l1(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """ULD's distance: each row sorted descending, the narrower zero-padded, |p - q| summed / rows. [G, a], [G, b]."""
    if p.shape[-1] == 0 or q.shape[-1] == 0:
        return p.new_zeros(())
    p = torch.sort(p, -1, descending=True).values
    q = torch.sort(q, -1, descending=True).values
    width = max(p.shape[-1], q.shape[-1])
    p, q = F.pad(p, (0, width - p.shape[-1])), F.pad(q, (0, width - q.shape[-1]))
    return (p - q).abs().sum() / p.shape[0]


def gold_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, student_ids, teacher_ids,
              pairs: Sequence[tuple[range, range]], *, shared: Optional[tuple] = None, beta: float = 0.5,
              matched_weight: Optional[float] = None, unmatched_weight: Optional[float] = None,
              student_temperature: float = 1.0, teacher_temperature: float = 1.0,
              merge: str = "bayesian") -> torch.Tensor:
    """One sequence's ULD (or, with `shared` = (teacher ids, student ids) from `shared_vocabulary`, GOLD's hybrid)
    loss. student_logits [Ns, Vs], teacher_logits [Nt, Vt] token-aligned; ids [Ns], [Nt]; pairs from
    `align_by_byte_offsets` (indices into those rows). Differentiable in the student's logits."""
    if (matched_weight is None) != (unmatched_weight is None):
        raise ValueError("give both matched_weight and unmatched_weight, or neither")
    if not pairs:
        return student_logits.sum() * 0
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    s = torch.softmax(student_logits.to(dtype) / student_temperature, -1)
    t = torch.softmax(teacher_logits.to(device=s.device, dtype=dtype) / teacher_temperature, -1)
    sm = merge_span_probs(s, [a for a, _ in pairs], student_ids, merge)                  # [G, Vs]
    tm = merge_span_probs(t, [b for _, b in pairs], teacher_ids, merge)                  # [G, Vt]
    if shared is None:
        return sorted_l1(sm, tm)
    t_ids = torch.as_tensor(np.asarray(shared[0]), dtype=torch.long, device=s.device)
    s_ids = torch.as_tensor(np.asarray(shared[1]), dtype=torch.long, device=s.device)
    G = sm.shape[0]
    matched = sm.new_zeros(())
    if len(t_ids):
        lp_s = torch.log(sm[:, s_ids].clamp(min=FLOOR))
        lp_t = torch.log(tm[:, t_ids].clamp(min=FLOOR))
        matched = divergence(lp_s, lp_t, "jsd", beta).sum() / G
    s_rest = torch.ones(sm.shape[-1], dtype=torch.bool, device=s.device)
    s_rest[s_ids] = False
    t_rest = torch.ones(tm.shape[-1], dtype=torch.bool, device=s.device)
    t_rest[t_ids] = False
    unmatched = sorted_l1(sm[:, s_rest], tm[:, t_rest])
    if matched_weight is None:
        matched_weight = len(t_ids) / max(1, tm.shape[-1])
        unmatched_weight = 1.0 - matched_weight
    return matched_weight * matched + unmatched_weight * unmatched
