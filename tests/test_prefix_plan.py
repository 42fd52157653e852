"""The shared-prefix planner on random batches: every sequence placed once, whole or as prefix + continuation,
prefixes shared by what really is common and never covering a row that is read, packs bounded."""
from __future__ import annotations

import numpy as np
import pytest

from logitserve.prefix import Wanted, find_groups, live_members, plan_shared_packs, shared_by_job

pytestmark = pytest.mark.unit


def _batch(rng):
    wanted = []
    for g in range(int(rng.integers(1, 5))):
        prompt = rng.integers(0, 50, int(rng.integers(1, 400)))
        for i in range(int(rng.integers(1, 10))):
            ids = np.concatenate([prompt, rng.integers(0, 50, int(rng.integers(1, 200)))]).astype(np.int32)
            first = len(ids) - 1 if rng.integers(0, 3) == 0 else int(rng.integers(0, len(ids)))
            wanted.append(Wanted(len(wanted) % 3, len(wanted), ids, first))
    return wanted


@pytest.mark.parametrize("seed", range(40))
def test_plans_place_every_sequence_once_and_share_only_what_is_common(seed):
    rng = np.random.default_rng(seed)
    wanted = _batch(rng)
    max_tokens = int(rng.integers(64, 2048))
    groups, alone = find_groups(wanted, 16)
    packs = plan_shared_packs(groups, alone, max_tokens)
    by_seq = {w.sequence: w for w in wanted}
    placed = []
    for pack in packs:
        members = pack.members
        at = 0
        for k, m in enumerate(members):
            assert m.offset == at
            at += m.length
            if m.job < 0:
                continue
            w = by_seq[m.sequence]
            placed.append(m.sequence)
            if m.parent < 0:
                assert m.start == 0 and m.length == len(w.ids)
                continue
            prefix = members[m.parent]
            assert prefix.job == -1 and m.parent < k and m.start == prefix.length
            assert m.start + m.length == len(w.ids) and m.length >= 1
            assert m.start <= w.first_read                          # no row anyone reads inside a prefix
            first = by_seq[next(x for x in members[m.parent + 1:] if x.parent == m.parent).sequence]
            assert np.array_equal(w.ids[: m.start], first.ids[: m.start])      # really shared
        unshared = sum(len(by_seq[m.sequence].ids) for m in members if m.job >= 0)
        assert pack.tokens <= unshared                                  # sharing never computes more
        if len([m for m in members if m.job >= 0]) > 1:
            assert pack.tokens <= max_tokens + max(len(by_seq[m.sequence].ids) for m in members if m.job >= 0) * 2
        saved = sum(n for _, n in shared_by_job(list(members)))
        assert saved == unshared - pack.tokens
    assert sorted(placed) == sorted(by_seq)


def test_dropping_members_keeps_a_prefix_only_while_someone_continues_it():
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 50, 100)
    wanted = [Wanted(j, j, np.concatenate([prompt, rng.integers(0, 50, 10)]).astype(np.int32), 100) for j in range(3)]
    (pack,) = plan_shared_packs(*find_groups(wanted, 16), 4096)
    assert [m.job for m in pack.members] == [-1, 0, 1, 2]
    kept = live_members(pack, lambda j: j == 2)
    assert [(m.job, m.parent) for m in kept] == [(-1, -1), (2, 0)]
    assert live_members(pack, lambda j: False) == []


def test_a_group_part_fills_to_a_pack_plus_its_longest_sequence():
    """A part is its prefix plus continuations up to max_tokens + the group's longest sequence in all (what the memory
    estimate allows a pack with a shared prefix): a chat group of 8 x (512 + 512) with reads from row 511 fits one
    4096-token part, not 7 continuations and a lone 8th computed whole."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 50, 512)
    wanted = [Wanted(i, 0, np.concatenate([prompt, rng.integers(50, 99, 512)]).astype(np.int32), 511) for i in range(8)]
    groups, alone = find_groups(wanted, 16)
    assert not alone and groups[0].prefix == 511
    for max_tokens, parts in ((4096, 1), (2048, 2), (1024, 4)):
        packs = plan_shared_packs(groups, alone, max_tokens)
        assert sum(1 for p in packs for m in p.members if m.job < 0) == parts
        assert all(p.tokens <= max_tokens + 1024 for p in packs)
        assert all(m.parent >= 0 for p in packs for m in p.members if m.job >= 0)   # every member continues one
