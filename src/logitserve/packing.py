"""Pack plans: many sequences as one row of tokens for one body, their positions restarting per sequence.

A pack's members are concatenated into one row [1, N]; position_ids restart at 0 for every
sequence (a continuation of a shared prefix goes on from the prefix's length), and the
attention registered in logitserve.attention confines each to itself (varlen).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class Member:
    """One sequence inside a pack: rows [offset, offset + length) of the packed row."""

    job: int            # -1: a shared prefix (its tokens: the first `length` of the next member's sequence)
    sequence: int
    offset: int
    length: int
    start: int = 0      # global position of the first row (a continuation starts after its prefix)
    parent: int = -1    # a continuation: index in the pack of the prefix it attends to


@dataclass(frozen=True)
class Pack:
    members: tuple[Member, ...]

    @property
    def tokens(self) -> int:
        return sum(m.length for m in self.members)


# A sequence this many times longer than the pack so far starts a pack of its own: the short ones before it
# (the scheduler orders a batch cheapest first) are answered after their own small body, not after its body.
SPLIT_RATIO = 4


def plan_packs(lengths: Sequence[tuple[int, int, int]], max_tokens: int) -> list[Pack]:
    """Group (job, sequence, length) in order into packs of at most max_tokens (a longer sequence packs alone);
    a sequence over SPLIT_RATIO times the pack so far starts the next pack."""
    packs: list[Pack] = []
    members: list[Member] = []
    used = 0
    for job, seq, n in lengths:
        if members and (used + n > max_tokens or n > SPLIT_RATIO * used):
            packs.append(Pack(tuple(members)))
            members, used = [], 0
        members.append(Member(job, seq, used, n))
        used += n
    if members:
        packs.append(Pack(tuple(members)))
    return packs


def cpu_pack_tokens(hidden: int, intermediate: int, upper: int) -> int:
    """Tokens per pack on CPU: the largest power of two whose widest activation ([n, width] fp32; this rank's
    intermediate width under TP) stays within half of glibc's largest mmap threshold, so tuned malloc reuses
    it (logitserve.hostmem)."""
    from .hostmem import MMAP_THRESHOLD

    width = max(intermediate, hidden, 1)
    n = max(1, (MMAP_THRESHOLD // 2) // (4 * width))
    return max(1, min(upper, max(256, 1 << (n.bit_length() - 1))))


def packed_positions(lengths: Sequence[int], starts: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Positions from each segment's start (0, or a continuation's prefix length): [sum(lengths)] int64."""
    starts = starts or [0] * len(lengths)
    return torch.cat([torch.arange(a, a + n) for a, n in zip(starts, lengths)])
