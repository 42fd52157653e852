"""Every token output of one job from a block of its logits rows: logprobs, filters, top-k, candidates, slices.

A block is `[n, V/tp]` rows of z/T in fp32 (a view into the engine's reused
buffer) made of consecutive segments, each a run of rows of one sequence, so a
head chunk may hold the ends of several short sequences of the same job. Row-wise
reductions run once over the whole block; the results are cut into per-sequence
`Piece`s. Everything that reads the raw logits runs first; the log-sum-exp runs
last and in place, consuming the block, so a block allocates nothing of size [n, V].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .filters import apply_filters
from .spec import Job, OutputKind, WireDType
from .vocab_parallel import VocabShard, vp_count_above, vp_gather, vp_logsumexp, vp_topk

TORCH_WIRE = {WireDType.FP32: torch.float32, WireDType.BF16: torch.bfloat16, WireDType.FP16: torch.float16}


@dataclass(frozen=True)
class Piece:
    """One rectangle of one output of one sequence."""

    output: OutputKind
    sequence: int
    full_shape: tuple[int, ...]
    offset: tuple[int, ...]
    tensor: torch.Tensor    # contiguous, CPU, wire dtype; shape = extent of the rectangle


@dataclass(frozen=True)
class Segment:
    """Global rows [s0, s1) of sequence `sequence` (ids: [L]) sit at block rows [row, row + s1 - s0)."""

    sequence: int
    ids: torch.Tensor
    s0: int
    s1: int
    row: int
    span: Optional[tuple[int, int]] = None   # with prompt_lengths: the rows [P-1, L-1) token outputs cover

    @property
    def rows(self) -> slice:
        return slice(self.row, self.row + self.s1 - self.s0)

    def token_cut(self) -> tuple[slice, int, int]:
        """(block rows, output offset, output length) of this segment's token outputs. Without a span row t is
        output row t (of L); with one, logits row P-1+j is output row j (of L-P). The block rows may be empty."""
        if self.span is None:
            return self.rows, self.s0, len(self.ids)
        a, b = max(self.s0, self.span[0]), min(self.s1, self.span[1])
        b = max(a, b)
        return slice(self.row + a - self.s0, self.row + b - self.s0), a - self.span[0], self.span[1] - self.span[0]

    def targets(self) -> torch.Tensor:
        """Row t's target ids[t + 1]; a sequence's last row has none and takes 0 (its value is never sent). [s1-s0]"""
        t = self.ids[self.s0 + 1 : self.s1 + 1]
        missing = (self.s1 - self.s0) - len(t)
        return torch.cat([t, t.new_zeros(missing)]) if missing else t


@dataclass(frozen=True)
class HeadShard:
    """What the reductions need to know of this rank's vocab columns."""

    shard: VocabShard
    pad_from: int           # local columns from here on are padding
    emits_replicated: bool  # TP rank 0: emits the outputs every TP rank holds alike


@torch.inference_mode()
def block_pieces(job: Job, z: torch.Tensor, segs: list[Segment], hs: HeadShard,
                 cands: Optional[dict[int, torch.Tensor]] = None) -> list[Piece]:
    """This rank's Pieces of `job` for a block. z: [n, V/tp] z/T (consumed), cands: sequence -> [L, c] ids."""
    shard, V = hs.shard, hs.shard.vocab_size
    pieces: list[Piece] = []
    if job.full_logits is not None:
        for g in segs:
            piece = _slice(job, g, z[g.rows], V, hs)
            if piece is not None:
                pieces.append(piece)
    opts = job.logprobs
    filtered = opts is not None and (opts.top_k is not None or opts.top_p is not None)
    lp = target_z = ranks = None
    if opts is not None:
        targets = torch.cat([g.targets() for g in segs])[:, None]                 # [n, 1]
        if opts.ranks or not filtered:
            target_z = vp_gather(z, targets, shard)[:, 0]                           # [n]
        if opts.ranks:                      # on the unfiltered z/T, before anything consumes it
            ranks = (vp_count_above(z, target_z, shard) + 1).to(torch.int32)        # [n]
        if filtered:
            kept = apply_filters(z, shard, opts.top_k, opts.top_p)                  # [n, V/tp], a copy
            lp = vp_gather(kept, targets, shard)[:, 0] - vp_logsumexp(kept, shard, inplace=True)
    top = vp_topk(z, job.topk.k, shard) if job.topk is not None else None           # [n, k] x2
    cand_z = None
    if job.candidates is not None:                                                  # per segment: c differs
        cand_z = []
        for g in segs:
            rows, o, _ = g.token_cut()
            n = rows.stop - rows.start
            cand_z.append(vp_gather(z[rows], cands[g.sequence][o : o + n], shard))   # [n, c]
    needs_lse = (opts is not None and not filtered) or (top is not None and job.topk.as_logprobs) or cand_z is not None
    tail = None
    if top is not None and job.topk.tail_mass:
        # the log-sum-exp outside the top-k ids, then the full one from its two parts: no 1 - sum(p) cancellation
        lse_top = torch.logsumexp(top[0], dim=-1)                                   # [n]
        _mask_ids_(z, top[1], shard)
        rest = vp_logsumexp(z, shard, inplace=True)                                 # [n]; z is gone now
        lse = torch.logaddexp(rest, lse_top)
        tail = rest - lse                                                           # [n], -inf when k = V
    else:
        row_max = top[0][:, 0] if top is not None else None                         # the top-1 is the row max
        lse = vp_logsumexp(z, shard, inplace=True, row_max=row_max) if needs_lse else None   # [n]; z is gone

    if opts is not None:
        if not filtered:
            lp = target_z - lse
        for kind, values in ((OutputKind.TOKEN_LOGPROBS, lp), (OutputKind.TOKEN_RANKS, ranks)):
            if values is None:
                continue
            for g in segs:
                L = len(g.ids)
                if g.span is not None:                 # every span row has a target; no lp[0]
                    rows, o, n_out = g.token_cut()
                    if rows.stop > rows.start:
                        pieces.append(Piece(kind, g.sequence, (n_out,), (o,), values[rows].cpu().contiguous()))
                elif g.s0 == 0 or g.s0 + 1 < L:                                     # rows with a target, or row 0
                    n = min(g.s1, L - 1) - g.s0
                    pieces.append(_per_target_piece(kind, g.sequence, values[g.row : g.row + n], g.s0, L))
    if top is not None:
        vals, top_ids = top
        if job.topk.as_logprobs:
            vals = vals - lse[:, None]
        k = job.topk.k
        for g in segs:
            rows, o, n_out = g.token_cut()
            if rows.stop == rows.start:
                continue
            pieces.append(Piece(OutputKind.TOPK_VALUES, g.sequence, (n_out, k), (o, 0), _wire(vals[rows], job.topk.dtype)))
            pieces.append(Piece(OutputKind.TOPK_IDS, g.sequence, (n_out, k), (o, 0),
                                top_ids[rows].to(torch.int32).cpu().contiguous()))
            if tail is not None:
                pieces.append(Piece(OutputKind.TOPK_TAIL, g.sequence, (n_out,), (o,), tail[rows].cpu().contiguous()))
    if cand_z is not None:
        for g, cz in zip(segs, cand_z):
            rows, o, _ = g.token_cut()
            if rows.stop == rows.start:
                continue
            lp_c = cz - lse[rows, None]                                             # [n, c]
            shape = tuple(cands[g.sequence].shape)
            pieces.append(Piece(OutputKind.CANDIDATE_LOGPROBS, g.sequence, shape, (o, 0), lp_c.cpu().contiguous()))
    # Under TP every rank computed the reductions; only the replicated outputs' owner emits them.
    return [p for p in pieces if hs.emits_replicated or p.output is OutputKind.FULL_LOGITS]


@torch.inference_mode()
def hidden_pieces(job: Job, h: torch.Tensor, segs: list[Segment], hs: HeadShard) -> list[Piece]:
    """HIDDEN_STATES over each segment's token rows (alike on every TP rank: TP rank 0 emits). h: [n, H] block rows."""
    if job.hidden_states is None or not hs.emits_replicated:
        return []
    pieces = []
    for g in segs:
        rows, o, n_out = g.token_cut()
        if rows.stop > rows.start:
            pieces.append(Piece(OutputKind.HIDDEN_STATES, g.sequence, (n_out, h.shape[-1]), (o, 0),
                                _wire(h[rows], job.hidden_states.dtype)))
    return pieces


def empty_token_pieces(job: Job, i: int, hs: HeadShard, cands: Optional[dict[int, torch.Tensor]] = None,
                       hidden: int = 0) -> list[Piece]:
    """Zero-row token outputs of sequence i (prompt_lengths P = L: nothing to predict), so every output asked
    for still arrives. hidden: H, the width of an empty HIDDEN_STATES."""
    if not hs.emits_replicated:
        return []
    out: list[Piece] = []
    if job.hidden_states is not None:
        out.append(Piece(OutputKind.HIDDEN_STATES, i, (0, hidden), (0, 0),
                         torch.zeros(0, hidden, dtype=TORCH_WIRE[job.hidden_states.dtype])))
    if job.logprobs is not None:
        out.append(Piece(OutputKind.TOKEN_LOGPROBS, i, (0,), (0,), torch.zeros(0)))
        if job.logprobs.ranks:
            out.append(Piece(OutputKind.TOKEN_RANKS, i, (0,), (0,), torch.zeros(0, dtype=torch.int32)))
    if job.topk is not None:
        k = job.topk.k
        out.append(Piece(OutputKind.TOPK_VALUES, i, (0, k), (0, 0), torch.zeros(0, k, dtype=TORCH_WIRE[job.topk.dtype])))
        out.append(Piece(OutputKind.TOPK_IDS, i, (0, k), (0, 0), torch.zeros(0, k, dtype=torch.int32)))
        if job.topk.tail_mass:
            out.append(Piece(OutputKind.TOPK_TAIL, i, (0,), (0,), torch.zeros(0)))
    if job.candidates is not None:
        c = job.candidates[i].shape[1]
        out.append(Piece(OutputKind.CANDIDATE_LOGPROBS, i, (0, c), (0, 0), torch.zeros(0, c)))
    return out


def _mask_ids_(z: torch.Tensor, ids: torch.Tensor, shard: VocabShard) -> None:
    """z at global ids -> -inf, on the rank that owns each column. z: [n, V/tp], ids: [n, k]."""
    local = ids - shard.start                                                       # [n, k]
    owned = (local >= 0) & (local < shard.size)
    if not shard.distributed:                       # tp = 1: every id is this rank's
        z.scatter_(1, local, float("-inf"))
        return
    # no boolean indexing (a device sync per chunk on a GPU): mark owned columns, an id owned anywhere wins
    mask = torch.zeros(z.shape, dtype=torch.uint8, device=z.device)                 # [n, V/tp]
    mask.scatter_reduce_(1, local.clamp(0, shard.size - 1), owned.to(torch.uint8), reduce="amax")
    z.masked_fill_(mask.bool(), float("-inf"))


def _per_target_piece(kind: OutputKind, i: int, values: torch.Tensor, s0: int, L: int) -> Piece:
    """values holds v[t+1] for rows t in [s0, ...) (logprobs or ranks); v[0] = 0 joins the first chunk."""
    start = s0 + 1
    if s0 == 0:
        values = torch.cat([values.new_zeros(1), values])
        start = 0
    return Piece(kind, i, (L,), (start,), values.cpu().contiguous())


def _slice(job: Job, g: Segment, z: torch.Tensor, V: int, hs: HeadShard) -> Optional[Piece]:
    """The part of the requested rectangle inside this segment's rows and this rank's columns. z: [s1-s0, V/tp]."""
    L, start = len(g.ids), hs.shard.start
    r0, r1, v0, v1 = job.full_logits.bounds(L, V)
    a, b = max(r0, g.s0), min(r1, g.s1)
    c0, c1 = max(v0, start), min(v1, start + hs.pad_from)
    if a >= b or c0 >= c1:
        return None
    rect = z[a - g.s0 : b - g.s0, c0 - start : c1 - start]
    return Piece(OutputKind.FULL_LOGITS, g.sequence, (r1 - r0, v1 - v0), (a - r0, c0 - v0), _wire(rect, job.full_logits.dtype))


def _wire(t: torch.Tensor, dtype: WireDType) -> torch.Tensor:
    """A fresh contiguous CPU copy in the wire dtype: never a view of the reused logits buffer. On a GPU the
    dtype is converted there, so a bf16 slice crosses to the host at half the bytes, in one copy."""
    if t.is_cuda:
        return t.to(TORCH_WIRE[dtype]).cpu()
    out = torch.empty(t.shape, dtype=TORCH_WIRE[dtype])
    out.copy_(t)
    return out
