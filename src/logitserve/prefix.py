"""Shared prefixes: sequences of a batch that begin with the same run of tokens have that run computed once.

RL traffic is grouped: G responses to one prompt. Within a scheduled batch (across requests and
streams) the sequences whose first `min_shared` tokens agree form a group; its prefix, the longest
run all members share, capped so that every member keeps at least one token of its own and no row
that needs the head falls inside it, goes through the body once as a pack member of its own, and
each member continues from it: its rows attend to the prefix's keys and values and causally to
themselves, with positions going on from the prefix (attention.varlen_attention_forward). Sharing is
flat: one prefix per group (members that share a longer run in pairs still compute that part each).
A group larger than a pack (and one sequence) is split, each part with its own copy of the prefix.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .packing import Member, Pack


@dataclass(frozen=True)
class Wanted:
    """One sequence of the batch: its place, its tokens, and the first row anything reads (L - 1 for a score)."""

    job: int
    sequence: int
    ids: np.ndarray       # int32 [L]
    first_read: int       # rows before this never reach the head


@dataclass(frozen=True)
class Group:
    prefix: int                       # S: tokens computed once
    members: tuple[Wanted, ...]       # each continues from S


def _common_prefix(rows: list[np.ndarray], upto: int) -> int:
    """Length of the leading run all `rows` share, at most `upto`."""
    first = rows[0][:upto]
    same = np.ones(len(first), dtype=bool)
    for r in rows[1:]:
        same &= r[:upto] == first
    bad = np.flatnonzero(~same)
    return int(bad[0]) if bad.size else len(first)


def share_cap(length: int, first_read: int) -> int:
    """How many leading tokens of a sequence may be shared: it keeps one token of its own, and no row anything
    reads falls inside the prefix."""
    return min(length - 1, first_read)


def find_groups(wanted: Sequence[Wanted], min_shared: int) -> tuple[list[Group], list[Wanted]]:
    """(groups of >= 2 sequences sharing >= min_shared tokens, the sequences left alone), in first-seen order."""
    if min_shared < 1:
        return [], list(wanted)
    buckets: dict[bytes, list[Wanted]] = {}
    alone: list[Wanted] = []
    for w in wanted:
        cap = share_cap(len(w.ids), w.first_read)
        if cap < min_shared:
            alone.append(w)
            continue
        buckets.setdefault(w.ids[:min_shared].tobytes(), []).append(w)
    groups = []
    for members in buckets.values():
        if len(members) < 2:
            alone += members
            continue
        cap = min(share_cap(len(w.ids), w.first_read) for w in members)
        groups.append(Group(_common_prefix([w.ids for w in members], cap), tuple(members)))
    return groups, alone


def plan_shared_packs(groups: list[Group], alone: list[Wanted], max_tokens: int) -> list[Pack]:
    """Packs of at most max_tokens (a longer item packs alone): each group's prefix (a member with job -1,
    its tokens those of the next member) precedes its continuations in the same pack. A group part is its
    prefix plus continuations, at most max_tokens + the group's longest sequence in all (the bound the memory
    estimate allows a pack with a shared prefix: logitserve.memory), and at least two continuations (so a part
    never holds more tokens than its sequences would unshared); a larger group is split, the prefix repeated in
    each part."""
    items: list[list[Member]] = []     # each item stays whole in one pack; offsets are assigned below
    for g in groups:
        parts: list[list[Wanted]] = [[]]
        budget = max_tokens + max(len(w.ids) for w in g.members) - g.prefix    # for a part's continuations
        used = 0
        for w in g.members:
            n = len(w.ids) - g.prefix
            if len(parts[-1]) >= 2 and used + n > budget:         # two continuations always share
                parts.append([])
                used = 0
            parts[-1].append(w)
            used += n
        for part in parts:
            if len(part) == 1:        # a lone continuation gains nothing: computed whole
                items.append([Member(part[0].job, part[0].sequence, 0, len(part[0].ids))])
            else:
                items.append([Member(-1, -1, 0, g.prefix)] +
                             [Member(w.job, w.sequence, 0, len(w.ids) - g.prefix, start=g.prefix) for w in part])
    items += [[Member(w.job, w.sequence, 0, len(w.ids))] for w in alone]
    packs: list[Pack] = []
    members: list[Member] = []
    used = 0
    for item in items:
        size = sum(m.length for m in item)
        if members and used + size > max_tokens:
            packs.append(Pack(tuple(members)))
            members, used = [], 0
        parent = -1
        for m in item:
            if m.job == -1:
                parent = len(members)
            members.append(Member(m.job, m.sequence, used, m.length, start=m.start,
                                  parent=parent if m.start else -1))
            used += m.length
    if members:
        packs.append(Pack(tuple(members)))
    return packs


def live_members(pack: Pack, live: Callable[[int], bool]) -> list[Member]:
    """The pack's members still wanted, parents renumbered; a shared prefix stays while a live member continues it."""
    keep = [m.job < 0 or live(m.job) for m in pack.members]
    for k, m in enumerate(pack.members):
        if m.job < 0:
            keep[k] = any(keep[x] and c.parent == k for x, c in enumerate(pack.members))
    new_index, out = {}, []
    for k, m in enumerate(pack.members):
        if keep[k]:
            new_index[k] = len(out)
            out.append(dataclasses.replace(m, parent=new_index[m.parent]) if m.parent >= 0 else m)
    return out


def shared_by_job(body: list[Member]) -> tuple[tuple[int, int], ...]:
    """(job, tokens) its sequences skipped thanks to a shared prefix; each prefix's one computation is charged
    to its first continuation, so the counts add up to what the batch saved."""
    by_job: dict[int, int] = {}
    charged: set[int] = set()
    for m in body:
        if m.parent >= 0:
            saved = m.start if m.parent in charged else 0
            charged.add(m.parent)
            if saved:
                by_job[m.job] = by_job.get(m.job, 0) + saved
    return tuple(by_job.items())
