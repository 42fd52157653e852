"""Cuts a block's reductions into the Pieces of each of its sequences: a pure function of the results and the job.

Every output is a run of rows of the block (`reductions.BlockReductions`) placed at its
offset in the sequence's output: token logprobs and ranks (row t holds the target t + 1,
row 0 of a sequence is 0), top-k values, ids and tail, candidates, hidden states, and each
segment's full-logits rectangle, and the reward-token rows at the positions a segment holds
(absolute rows, in the request's order). A segment of no rows (nothing to predict) gets every
token output it asks for with zero rows, through the same code.
"""
from __future__ import annotations

from typing import Optional

import torch

from .events import Piece
from .reductions import BlockReductions, HeadShard, Segment, slice_bounds, wire
from .spec import Job, OutputKind


def cut(red: BlockReductions, job: Job, segs: list[Segment], hs: HeadShard) -> list[Piece]:
    """This rank's Pieces of `job` from its block's reductions. Under TP every rank computed the reductions; only
    the replicated outputs' owner (TP rank 0) emits them; each rank emits its own full-logits columns."""
    pieces: list[Piece] = []
    if hs.emits_replicated and red.hidden is not None:
        pieces += _rows(OutputKind.HIDDEN_STATES, red.hidden, segs, job.hidden_states.dtype)
    for g, rect in zip(segs, red.slices):
        if rect is not None:
            b = slice_bounds(job, g, hs)
            pieces.append(Piece(OutputKind.FULL_LOGITS, g.sequence, b.full_shape, b.offset, rect))
    if not hs.emits_replicated:
        return pieces
    for kind, values in ((OutputKind.TOKEN_LOGPROBS, red.target_logprobs), (OutputKind.TOKEN_RANKS, red.ranks)):
        if values is not None:
            pieces += _per_target(kind, values, segs)
    if red.top_values is not None:
        pieces += _rows(OutputKind.TOPK_VALUES, red.top_values, segs, job.topk.dtype)
        pieces += _rows(OutputKind.TOPK_IDS, red.top_ids, segs, None, torch.int32)
        if red.tail is not None:
            pieces += _rows(OutputKind.TOPK_TAIL, red.tail, segs)
    for g, (js, values) in zip(segs, red.reward):
        pieces += _reward_pieces(g.sequence, js, values, len(job.reward_tokens.positions))
    for g, lp in zip(segs, red.candidates):
        rows, o, _ = g.token_cut()
        if _emits(g, rows):
            pieces.append(Piece(OutputKind.CANDIDATE_LOGPROBS, g.sequence, tuple(job.candidates[g.sequence].shape),
                                (o, 0), lp.cpu().contiguous()))
    return pieces


def _emits(g: Segment, rows: slice) -> bool:
    """Whether a segment has token output rows here, or stands for an empty output (a segment of no rows)."""
    return rows.stop > rows.start or g.s0 == g.s1


def _rows(kind: OutputKind, values: torch.Tensor, segs: list[Segment], dtype=None,
          cast: Optional[torch.dtype] = None) -> list[Piece]:
    """Each segment's token rows of `values` [R, ...] at their output offset: in a wire dtype, or cast."""
    out = []
    for g in segs:
        rows, o, n_out = g.token_cut()
        if not _emits(g, rows):
            continue
        part = values[rows]
        tensor = wire(part, dtype) if dtype is not None else part.to(cast or part.dtype).cpu().contiguous()
        out.append(Piece(kind, g.sequence, (n_out, *values.shape[1:]), (o, *(0 for _ in values.shape[1:])), tensor))
    return out


def _per_target(kind: OutputKind, values: torch.Tensor, segs: list[Segment]) -> list[Piece]:
    """Logprobs or ranks: row t's value belongs to token t + 1 (output row t + 1 of L; row 0 is 0), or with a span
    output row j is logits row P-1+j."""
    out = []
    for g in segs:
        L = len(g.ids)
        if g.span is not None:                 # every span row has a target; no lp[0]
            rows, o, n_out = g.token_cut()
            if _emits(g, rows):
                out.append(Piece(kind, g.sequence, (n_out,), (o,), values[rows].cpu().contiguous()))
        elif g.s0 == 0 or g.s0 + 1 < L:                                     # rows with a target, or row 0
            n = min(g.s1, L - 1) - g.s0
            v, start = values[g.row : g.row + n], g.s0 + 1
            if g.s0 == 0:                                                   # v[0] = 0 joins the first chunk
                v, start = torch.cat([v.new_zeros(1), v]), 0
            out.append(Piece(kind, g.sequence, (L,), (start,), v.cpu().contiguous()))
    return out


def _reward_pieces(sequence: int, js: tuple[int, ...], values: torch.Tensor, rows: int) -> list[Piece]:
    """REWARD_TOKENS rows js (ascending; each a position of the request, in its order) of one sequence: one piece
    per run of consecutive output rows. values: [len(js), n]."""
    out, start = [], 0
    for k in range(1, len(js) + 1):
        if k == len(js) or js[k] != js[k - 1] + 1:
            out.append(Piece(OutputKind.REWARD_TOKENS, sequence, (rows, values.shape[1]), (js[start], 0),
                             values[start:k].float().cpu().contiguous()))
            start = k
    return out
