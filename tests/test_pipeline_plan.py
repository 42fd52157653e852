"""Pipeline stage plans and the bubble fraction: pure functions against brute force."""
from __future__ import annotations

import itertools

import pytest

from logitserve.pipeline import StageTime, bubble_fraction, split_stages

pytestmark = pytest.mark.unit


def _brute(sizes, first, last, pp):
    """The smallest largest stage over every split into pp non-empty contiguous runs."""
    n, best = len(sizes), None
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = list(zip((0,) + cuts, cuts + (n,)))
        load = [sum(sizes[a:b]) + (first if k == 0 else 0) + (last if k == pp - 1 else 0)
                for k, (a, b) in enumerate(bounds)]
        best = max(load) if best is None else min(best, max(load))
    return best


@pytest.mark.parametrize("sizes,first,last,pp", [([7] * 8, 0, 25, 2), ([7] * 8, 25, 25, 2), ([1, 9, 1, 9, 5], 3, 4, 3),
                                                 ([5] * 12, 0, 30, 4), ([2, 2], 0, 0, 2), ([4, 1, 1, 1, 8, 2], 6, 0, 3)])
def test_split_stages_is_optimal_contiguous_and_complete(sizes, first, last, pp):
    bounds = split_stages(sizes, first, last, pp)
    assert len(bounds) == pp and bounds[0][0] == 0 and bounds[-1][1] == len(sizes)
    assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))
    load = [sum(sizes[a:b]) + (first if k == 0 else 0) + (last if k == pp - 1 else 0) for k, (a, b) in enumerate(bounds)]
    assert max(load) == _brute(sizes, first, last, pp)


def test_compute_balance_moves_layers_off_the_head_stage():
    """The body demo's shape: 8 layers of ~7.1M parameters, a 24.6M head. Counting the embedding (memory) splits
    4 / 4; counting compute (the embedding is a lookup) gives the head's stage fewer layers."""
    assert split_stages([71] * 8, 246, 246, 2) == [(0, 4), (4, 8)]
    assert split_stages([71] * 8, 0, 246, 2) == [(0, 6), (6, 8)]
    with pytest.raises(ValueError, match="at most 2 stages"):
        split_stages([1, 1], 0, 0, 3)


def test_bubble_fraction():
    assert bubble_fraction([StageTime(0, 3.0, 4.0), StageTime(1, 4.0, 4.0)]) == pytest.approx(1 / 8)
    assert bubble_fraction([]) == 0.0
