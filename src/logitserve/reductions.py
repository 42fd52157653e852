"""Reduce, then cut: every row-wise result the outputs need from one block of logits rows, computed once.

A block is `[R, V/tp]` rows of z/T in fp32 (a view into the engine's reused buffer, or
a gathered copy) of one job, made of consecutive segments, each a run of rows of one
sequence. `reduce_block` reads the block for everything that needs the logits themselves
(full-logits rectangles, targets, ranks, filters, top-k, candidates, reward tokens) and only then takes
the log-sum-exp in place, consuming the block, so it allocates nothing of size [R, V]
beyond what a filter needs. What it returns is all the outputs need: `outputs.cut` turns
it into pieces without the logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .filters import apply_filters
from .spec import Job, WireDType
from .vocab_parallel import VocabShard, vp_count_above, vp_gather, vp_logsumexp, vp_topk

TORCH_WIRE = {WireDType.FP32: torch.float32, WireDType.BF16: torch.bfloat16, WireDType.FP16: torch.float16}


@dataclass(frozen=True)
class Segment:
    """Global rows [s0, s1) of sequence `sequence` (ids: [L]) sit at block rows [row, row + s1 - s0). A segment of no
    rows (s0 == s1) stands for a sequence with nothing to predict (prompt_lengths P = L): its outputs arrive empty."""

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


@dataclass(frozen=True)
class SliceBounds:
    """The part of a job's full-logits rectangle inside one segment's rows and this rank's columns."""

    rows: tuple[int, int]          # global rows [a, b)
    cols: tuple[int, int]          # global vocab columns [c0, c1)
    full_shape: tuple[int, int]    # the rectangle's (r1 - r0, v1 - v0)
    offset: tuple[int, int]        # (a - r0, c0 - v0)


def slice_bounds(job: Job, g: Segment, hs: HeadShard) -> Optional[SliceBounds]:
    if job.full_logits is None:
        return None
    start = hs.shard.start
    r0, r1, v0, v1 = job.full_logits.bounds(len(g.ids), hs.shard.vocab_size)
    a, b = max(r0, g.s0), min(r1, g.s1)
    c0, c1 = max(v0, start), min(v1, start + hs.pad_from)
    if a >= b or c0 >= c1:
        return None
    return SliceBounds((a, b), (c0, c1), (r1 - r0, v1 - v0), (a - r0, c0 - v0))


@dataclass(frozen=True)
class BlockReductions:
    """One block's results, final (logprobs already normalised): all the outputs need, the logits no longer."""

    rows: int                                        # R, the block's rows
    lse: Optional[torch.Tensor] = None               # [R] fp32 log-sum-exp of z/T over the full vocabulary
    target_logprobs: Optional[torch.Tensor] = None   # [R] fp32 row t: log p(ids[t+1]), under the job's filters
    ranks: Optional[torch.Tensor] = None             # [R] int32 1 + #ids whose z/T is above the target's
    top_values: Optional[torch.Tensor] = None        # [R, k] fp32 z/T, or logprobs (TopKOpts.as_logprobs)
    top_ids: Optional[torch.Tensor] = None           # [R, k] int64 global ids, by descending value
    tail: Optional[torch.Tensor] = None              # [R] fp32 log of the probability outside the top-k ids
    candidates: tuple[Optional[torch.Tensor], ...] = ()   # per segment: [n, c] fp32 logprobs, its token rows
    slices: tuple[Optional[torch.Tensor], ...] = ()  # per segment: [b-a, c1-c0] its full-logits part, wire dtype, CPU
    hidden: Optional[torch.Tensor] = None            # [R, H] the block's hidden states (the lm_head's input)
    reward: tuple[tuple[tuple[int, ...], torch.Tensor], ...] = ()   # per segment: (its REWARD_TOKENS output rows
                                                     # [n], their values [n, num_token_ids] fp32), in row order


@dataclass(frozen=True)
class _Reads:
    """What reads the logits as they are, taken before the log-sum-exp consumes them."""

    slices: tuple[Optional[torch.Tensor], ...]
    target_z: Optional[torch.Tensor]                     # [R] z/T at each row's target
    ranks: Optional[torch.Tensor]                        # [R] int32
    filtered_lp: Optional[torch.Tensor]                  # [R] logprob under top_k / top_p
    top: Optional[tuple[torch.Tensor, torch.Tensor]]     # [R, k] values, [R, k] ids
    cand_z: Optional[list[torch.Tensor]]                 # per segment [n, c] z/T at the candidates
    reward_rows: Optional[list[tuple[tuple[int, ...], list[int]]]] = None   # per segment: (output rows, block rows)
    reward_z: Optional[torch.Tensor] = None              # [n, num_token_ids] z/T at the reward tokens, all segments


@torch.inference_mode()
def reduce_block(job: Job, z: Optional[torch.Tensor], h: Optional[torch.Tensor], segs: list[Segment],
                 hs: HeadShard, cands: dict[int, torch.Tensor]) -> BlockReductions:
    """The block's reductions. z: [R, V/tp] z/T, consumed (None: no output of the job reads logits); h: [R, H]
    its hidden rows; cands: sequence -> [L, c] candidate ids."""
    rows = sum(g.s1 - g.s0 for g in segs)
    hidden = h if job.hidden_states is not None else None
    if z is None:
        return BlockReductions(rows, hidden=hidden)
    reads = _read(job, z, segs, hs, cands)
    lse, tail = _consume(job, z, reads, hs.shard)
    return _finish(job, rows, reads, lse, tail, hidden, segs)


def _read(job: Job, z: torch.Tensor, segs: list[Segment], hs: HeadShard, cands: dict) -> _Reads:
    shard = hs.shard
    slices = tuple(_rect(job, g, z, hs) for g in segs)
    opts = job.logprobs
    filtered = opts is not None and (opts.top_k is not None or opts.top_p is not None)
    target_z = ranks = filtered_lp = None
    if opts is not None:
        targets = torch.cat([g.targets() for g in segs])[:, None]                 # [R, 1]
        if opts.ranks or not filtered:
            target_z = vp_gather(z, targets, shard)[:, 0]                           # [R]
        if opts.ranks:
            ranks = (vp_count_above(z, target_z, shard) + 1).to(torch.int32)        # [R]
        if filtered:
            kept = apply_filters(z, shard, opts.top_k, opts.top_p)                  # [R, V/tp], a copy
            filtered_lp = vp_gather(kept, targets, shard)[:, 0] - vp_logsumexp(kept, shard, inplace=True)
    top = vp_topk(z, job.topk.k, shard) if job.topk is not None else None           # [R, k] x2
    cand_z = None
    if job.candidates is not None:                                                  # per segment: c differs
        cand_z = []
        for g in segs:
            rows, o, _ = g.token_cut()
            n = rows.stop - rows.start
            cand_z.append(vp_gather(z[rows], cands[g.sequence][o : o + n], shard))   # [n, c]
    reward_rows = reward_z = None
    if job.reward_tokens is not None:                   # one gather for the block: one collective under TP
        reward_rows = [_reward_rows(job, g) for g in segs]
        block_rows = torch.tensor([b for _, bs in reward_rows for b in bs], dtype=torch.int64, device=z.device)
        ids = torch.tensor(job.reward_tokens.token_ids, dtype=torch.int64, device=z.device)
        reward_z = vp_gather(z.index_select(0, block_rows), ids.expand(len(block_rows), -1), shard)   # [n, c]
    return _Reads(slices, target_z, ranks, filtered_lp, top, cand_z, reward_rows, reward_z)


def _reward_rows(job: Job, g: Segment) -> tuple[tuple[int, ...], list[int]]:
    """(REWARD_TOKENS output rows, their block rows) of the positions that fall in segment g's rows."""
    picked = [(j, g.row + p - g.s0) for j, p in enumerate(job.reward_tokens.rows(len(g.ids))) if g.s0 <= p < g.s1]
    return tuple(j for j, _ in picked), [b for _, b in picked]


def _consume(job: Job, z: torch.Tensor, reads: _Reads,
             shard: VocabShard) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(log-sum-exp [R], top-k tail [R]) in place on z, which holds garbage after; None where nothing needs them."""
    top = reads.top
    if top is not None and job.topk.tail_mass:
        # the log-sum-exp outside the top-k ids, then the full one from its two parts: no 1 - sum(p) cancellation
        lse_top = torch.logsumexp(top[0], dim=-1)                                   # [R]
        _mask_ids_(z, top[1], shard)
        rest = vp_logsumexp(z, shard, inplace=True)                                 # [R]
        lse = torch.logaddexp(rest, lse_top)
        return lse, rest - lse                                                      # tail: -inf when k = V
    opts = job.logprobs
    needs = ((opts is not None and reads.filtered_lp is None) or (top is not None and job.topk.as_logprobs)
             or reads.cand_z is not None or (reads.reward_z is not None and not job.reward_tokens.logits))
    if not needs:
        return None, None
    row_max = top[0][:, 0] if top is not None else None                             # the top-1 is the row max
    return vp_logsumexp(z, shard, inplace=True, row_max=row_max), None


def _finish(job: Job, rows: int, reads: _Reads, lse, tail, hidden, segs: list[Segment]) -> BlockReductions:
    lp = reads.filtered_lp if reads.filtered_lp is not None else (
        reads.target_z - lse if reads.target_z is not None and job.logprobs is not None else None)
    values = ids = None
    if reads.top is not None:
        values, ids = reads.top
        if job.topk.as_logprobs:
            values = values - lse[:, None]
    cands = ()
    if reads.cand_z is not None:
        cands = tuple(cz - lse[g.token_cut()[0], None] for g, cz in zip(segs, reads.cand_z))   # [n, c] each
    return BlockReductions(rows, lse, lp, reads.ranks, values, ids, tail, cands, reads.slices, hidden,
                           _reward(job, reads, lse))


def _reward(job: Job, reads: _Reads, lse: Optional[torch.Tensor]) -> tuple:
    """Each segment's reward-token rows: z/T at the ids, less the row's log-sum-exp unless logits are asked."""
    if reads.reward_z is None:
        return ()
    values = reads.reward_z
    if not job.reward_tokens.logits:
        block_rows = torch.tensor([b for _, bs in reads.reward_rows for b in bs], dtype=torch.int64,
                                  device=values.device)
        values = values - lse.index_select(0, block_rows)[:, None]
    out, at = [], 0
    for js, _ in reads.reward_rows:
        out.append((js, values[at : at + len(js)]))
        at += len(js)
    return tuple(out)


def empty_reductions(job: Job, segs: list[Segment], hidden: int) -> BlockReductions:
    """Zero-row results for segments of no rows (nothing to predict), in every output's dtype and width."""
    k = job.topk.k if job.topk is not None else 0
    return BlockReductions(
        0,
        target_logprobs=torch.zeros(0) if job.logprobs is not None else None,
        ranks=torch.zeros(0, dtype=torch.int32) if job.logprobs is not None and job.logprobs.ranks else None,
        top_values=torch.zeros(0, k) if job.topk is not None else None,
        top_ids=torch.zeros(0, k, dtype=torch.int64) if job.topk is not None else None,
        tail=torch.zeros(0) if job.topk is not None and job.topk.tail_mass else None,
        candidates=tuple(torch.zeros(0, job.candidates[g.sequence].shape[1]) for g in segs)
        if job.candidates is not None else (),
        slices=tuple(None for _ in segs),
        hidden=torch.zeros(0, hidden) if job.hidden_states is not None else None)


def _rect(job: Job, g: Segment, z: torch.Tensor, hs: HeadShard) -> Optional[torch.Tensor]:
    b = slice_bounds(job, g, hs)
    if b is None:
        return None
    start = hs.shard.start
    rect = z[g.row + b.rows[0] - g.s0 : g.row + b.rows[1] - g.s0, b.cols[0] - start : b.cols[1] - start]
    return wire(rect, job.full_logits.dtype)


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


def wire(t: torch.Tensor, dtype: WireDType) -> torch.Tensor:
    """A fresh contiguous CPU copy in the wire dtype: never a view of the reused logits buffer. On a GPU the
    dtype is converted there, so a bf16 slice crosses to the host at half the bytes, in one copy."""
    if t.is_cuda:
        return t.to(TORCH_WIRE[dtype]).cpu()
    out = torch.empty(t.shape, dtype=TORCH_WIRE[dtype])
    out.copy_(t)
    return out
