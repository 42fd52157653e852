"""The unit schedule: which units a batch runs, which rows of a unit's hidden states go through the head, in which chunks.

A unit is a `Pack` whose body runs at once: in packed mode (and under --pp, whose
micro-batches are units) several sequences, possibly continuing a shared prefix; in exact
mode (and under CP) one sequence. The body's rows are described by `RowRun`s (a member's
rows in the packed row, or the head-tail runs a CP rank holds), and the head's chunks are
planned on them:
- exact: a grid on each run from its first row, whole chunks (results bitwise those of a
  request alone, and every CP rank takes the same count of steps, empty ones included);
- packed: only the rows someone reads, gathered, in chunks of consecutive rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from .packing import Member, Pack, plan_packs
from .prefix import Wanted, find_groups, plan_shared_packs
from .reductions import Segment
from .spec import Job


@dataclass(frozen=True)
class RowRun:
    """Rows [local, local + length) of a unit's hidden states hold global positions [start, start + length) of body
    member `member` (a CP run may reach past the sequence's end: padding)."""

    member: int
    local: int
    start: int
    length: int


@dataclass(frozen=True)
class Chunk:
    """One head step of a unit: `rows` of its (selected) hidden states, and each job's segments in them (block rows
    relative to the chunk); rows None: an empty step that keeps the ranks in step."""

    rows: Optional[slice]
    segs: dict[int, list[Segment]]


def plan_units(jobs: list[Job], live: Callable[[int], bool], packed: bool, pack_tokens: int, min_shared: int,
               vocab: int) -> list[Pack]:
    """The batch's units, in job order: one per sequence (exact), or packs of up to pack_tokens tokens, sequences
    sharing at least min_shared leading tokens sharing their prefix's body (logitserve.prefix)."""
    seqs = [(j, i, s) for j, job in enumerate(jobs) if live(j) for i, s in enumerate(job.sequences)]
    if not packed:
        return [alone(j, i, len(s)) for j, i, s in seqs]
    if min_shared:
        groups, single = find_groups([Wanted(j, i, s, jobs[j].first_read(i, vocab)) for j, i, s in seqs], min_shared)
        if groups:
            return plan_shared_packs(groups, single, pack_tokens)
    return plan_packs([(j, i, len(s)) for j, i, s in seqs], pack_tokens)


def alone(job: int, sequence: int, length: int) -> Pack:
    """A unit of one whole sequence."""
    return Pack((Member(job, sequence, 0, length),))


def pack_rows(body: list[Member]) -> list[RowRun]:
    """Each member's rows in a packed body (offsets counting only the members that ran)."""
    runs, at = [], 0
    for k, m in enumerate(body):
        runs.append(RowRun(k, at, m.start, m.length))
        at += m.length
    return runs


def grid_chunks(job_index: int, job: Job, member: Member, ids: torch.Tensor, runs: list[RowRun], chunk: int,
                vocab: int) -> Iterator[Chunk]:
    """Exact: chunks on a grid from each run's first row; a chunk with a row someone reads runs whole."""
    L = len(ids)
    lo, hi = job.head_rows(member.sequence, vocab)          # only rows someone reads go through the head
    span = job.token_rows(member.sequence) if job.prompt_lengths is not None else None
    for run in runs:
        for c0 in range(0, run.length, chunk):
            s0 = run.start + c0                               # global rows [s0, s1) of this step
            s1 = min(run.start + min(c0 + chunk, run.length), L)
            if max(s0, lo) >= min(s1, hi):    # padding, or rows nobody reads: an empty step (ranks stay in step)
                yield Chunk(None, {})
                continue
            rows = slice(run.local + c0, run.local + c0 + (s1 - s0))
            yield Chunk(rows, {job_index: [Segment(member.sequence, ids, s0, s1, 0, span)]})


def gathered_rows(jobs: list[Job], body: list[Member], runs: list[RowRun],
                  vocab: int) -> tuple[Optional[torch.Tensor], list[tuple[Member, int, int, int]]]:
    """Packed: (the rows of h someone reads, in order, or None when that is all of them; per member with a job:
    (member, lo, hi, its first row among the selected)). Rows [lo, hi) are global (a continuation's start on)."""
    picked, at, total = [], 0, 0
    for r in runs:
        m = body[r.member]
        total += r.length
        if m.job < 0:
            continue
        lo, hi = jobs[m.job].head_rows(m.sequence, vocab)   # (lo >= start: no read row lies in a shared prefix)
        picked.append((m, lo, hi, at, r.local - m.start))
        at += hi - lo
    index = None
    if at != total:
        index = torch.cat([torch.arange(o + lo, o + hi) for _, lo, hi, _, o in picked])                   # [M]
    return index, [(m, lo, hi, q) for m, lo, hi, q, _ in picked]


def gathered_chunks(jobs: list[Job], picked: list[tuple[Member, int, int, int]], ids: dict, chunk: int,
                    live: Callable[[int], bool]) -> Iterator[Chunk]:
    """Packed: consecutive chunks of the selected rows, each with the live jobs' segments in it."""
    total = sum(hi - lo for _, lo, hi, _ in picked)
    for c0 in range(0, total, chunk):
        c1 = min(c0 + chunk, total)
        segs: dict[int, list[Segment]] = {}           # job -> its segments in this chunk, rows relative to c0
        for m, lo, hi, q in picked:
            a, b = max(q, c0), min(q + hi - lo, c1)
            if a < b and live(m.job):
                job = jobs[m.job]
                span = job.token_rows(m.sequence) if job.prompt_lengths is not None else None
                segs.setdefault(m.job, []).append(Segment(m.sequence, ids[(m.job, m.sequence)], lo + a - q,
                                                          lo + b - q, a - c0, span))
        if segs:               # every member dropped (cancelled, too slow): no head for these rows
            yield Chunk(slice(c0, c1), segs)


def rows_end(picked: list[tuple[Member, int, int, int]], jobs: frozenset) -> dict[int, int]:
    """Packed: for each of these jobs, the end of its rows among the selected ones (the head step holding row
    end - 1 completes it); a job with no row read there is complete at the first step."""
    ends: dict[int, int] = {}
    for m, lo, hi, q in picked:
        if m.job in jobs:
            ends[m.job] = max(ends.get(m.job, 1), q + hi - lo)
    return ends
