"""A classification head's outputs from a unit's hidden states: sequence scores, token scores, step scores.

Reward models have no logits to reduce: their head is a [num_labels, H] linear map read at
chosen positions. A sequence classifier is read at the last token (SCORES); a token
classifier (a process reward model) at every position (TOKEN_SCORES), at the positions of
the step separators (STEP_SCORES, one row per step, in order), or at the last token. Each
rank reads the positions its rows hold (a CP rank holds runs of the sequence, a pipeline's
last stage a micro-batch), so a sequence's rows may arrive from several ranks, each piece
at its offset. Everything is read with one matmul per unit: the head is tiny beside the body.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .events import JobPiece, Piece
from .packing import Member
from .schedule import RowRun
from .spec import Job, OutputKind


@dataclass(frozen=True)
class Reads:
    """The positions one output of one sequence reads, in output order (ascending)."""

    kind: OutputKind
    positions: np.ndarray        # [n] int64 global positions; output row k is read at positions[k]
    one_row: bool = False        # SCORES: a [num_labels] vector rather than [n, num_labels] rows


def reads_of(job: Job, i: int) -> list[Reads]:
    """What sequence i of the job reads of the classification head."""
    seq = job.sequences[i]
    L = len(seq)
    out = []
    if job.scores:
        out.append(Reads(OutputKind.SCORES, np.array([L - 1]), one_row=True))
    if job.token_scores:
        out.append(Reads(OutputKind.TOKEN_SCORES, np.arange(L)))
    if job.step_scores is not None:
        out.append(Reads(OutputKind.STEP_SCORES, job.step_scores.positions(seq)))
    return out


@dataclass(frozen=True)
class _Part:
    """Output rows [a, b) of one output of one sequence, read at rows `rows` of the unit's hidden states."""

    job: int
    sequence: int
    reads: Reads
    a: int
    b: int
    rows: np.ndarray             # [b - a] rows of h


def _parts(jobs: list[Job], body: list[Member], runs: list[RowRun]) -> list[_Part]:
    """Every output row these runs hold: a run holds global positions [start, start + length) of its member."""
    parts = []
    for r in runs:
        m = body[r.member]
        if m.job < 0:                        # a shared prefix: no row of it is read (Job.first_read)
            continue
        L = len(jobs[m.job].sequences[m.sequence])
        lo, hi = r.start, min(r.start + r.length, L)         # a CP run may reach past the end: padding
        for reads in reads_of(jobs[m.job], m.sequence):
            a, b = (int(x) for x in np.searchsorted(reads.positions, [lo, hi]))
            if a < b:
                parts.append(_Part(m.job, m.sequence, reads, a, b, r.local + reads.positions[a:b] - r.start))
    return parts


@torch.inference_mode()
def classifier_pieces(jobs: list[Job], body: list[Member], h: torch.Tensor, runs: list[RowRun],
                      head: nn.Linear) -> list[JobPiece]:
    """A JobPiece for every classifier output row these runs hold. h: [N, H], the unit's hidden states."""
    parts = _parts(jobs, body, runs)
    if not parts:
        return []
    index = torch.from_numpy(np.concatenate([p.rows for p in parts])).to(h.device)               # [n]
    values = F.linear(h.index_select(0, index), head.weight, head.bias).float().cpu()            # [n, num_labels]
    labels = values.shape[1]
    out, at = [], 0
    for p in parts:
        rows = values[at : at + p.b - p.a]
        at += p.b - p.a
        if p.reads.one_row:
            piece = Piece(p.reads.kind, p.sequence, (labels,), (0,), rows[0].contiguous())
        else:
            piece = Piece(p.reads.kind, p.sequence, (len(p.reads.positions), labels), (p.a, 0), rows.contiguous())
        out.append(JobPiece(p.job, piece))
    return out
