"""The prefetching teacher: results in batch order, equal to direct requests, at most `depth` in flight,
errors raised at their batch, and a loop that stops early cancels what it will not read."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import PACKED_ATOL, VOCAB, random_seqs, separated
from logitserve.client import LogitServeError, TeacherClient, Wanted
from logitserve.client.distill import TeacherBatch
from logitserve.client.prefetch import PrefetchingTeacher

pytestmark = pytest.mark.live_server


def _batches(n=7):
    rng = np.random.default_rng(5)
    return [random_seqs(rng, list(rng.integers(3, 60, size=4)), vocab=VOCAB) for _ in range(n)]


def test_prefetched_results_equal_direct_requests_in_order(llama_server):
    batches = _batches()
    wanted = Wanted(topk=8, topk_as_logprobs=True, topk_tail=True)
    with TeacherClient(llama_server.address) as c:
        direct = [c.forward(b, topk=8, topk_as_logprobs=True, topk_tail=True) for b in batches]
        pre = PrefetchingTeacher(c, batches, wanted, depth=3,
                                 attach=lambda r: TeacherBatch.from_result(r, length=64))
        got = list(pre)
    assert [b for b, _ in got] == batches
    assert 1 <= pre.max_in_flight <= 3
    for (_, tb), want in zip(got, direct):
        assert tb.values.shape == (4, 64, 8) and tb.tail.shape == (4, 64)
        for j in range(4):
            n = len(want.topk_values[j])
            assert tb.mask[j].sum() == n
            # batched with its neighbours on the server: equal within the packed bound, ids where not near-tied
            np.testing.assert_allclose(tb.values[j, :n].numpy(), want.topk_values[j], atol=PACKED_ATOL, rtol=0)
            np.testing.assert_allclose(tb.tail[j, :n].numpy(), want.topk_tail[j], atol=PACKED_ATOL, rtol=0)
            sep = separated(want.topk_values[j].astype(np.float64), 8, gap=2 * PACKED_ATOL)
            assert np.array_equal(tb.ids[j, :n].numpy()[sep], want.topk_ids[j][sep])
            assert not tb.mask[j, n:].any()


def test_a_failed_request_raises_at_its_batch_and_early_stop_cancels(llama_server):
    batches = _batches(4)
    batches[2] = [np.array([1, VOCAB + 5])]                     # an id outside the vocabulary
    with TeacherClient(llama_server.address) as c:
        it = iter(PrefetchingTeacher(c, batches, Wanted(logprobs=True), depth=2))
        assert next(it)[0] is batches[0] and next(it)[0] is batches[1]
        with pytest.raises(LogitServeError, match="outside"):
            next(it)
        loop = iter(PrefetchingTeacher(c, _batches(6), Wanted(logprobs=True), depth=3))
        next(loop)
        loop.close()                                            # the student stops: pending requests cancelled
        assert c.logprobs([[1, 2, 3]])[0].shape == (3,)         # the stream carries on
    with pytest.raises(ValueError, match="depth"):
        PrefetchingTeacher(None, [], Wanted(), depth=0)
    assert torch.is_tensor(TeacherBatch.from_arrays([np.zeros((2, 3))], [np.zeros((2, 3))]).values)
