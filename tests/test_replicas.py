"""The client over several replicas: streams spread by round_robin, a stopped replica's requests retried on the
others, default deadlines."""
from __future__ import annotations

import grpc
import numpy as np
import pytest

from conftest import serve_dir
from helpers import VOCAB, random_seqs
from logitserve.client import LogitServeError, TeacherClient, Wanted


def test_requests_spread_over_replicas_and_survive_one_stopping(model_dirs):
    a, b = serve_dir(model_dirs["llama"]), serve_dir(model_dirs["llama"])
    address = f"ipv4:{a.address},{b.address}"
    seqs = random_seqs(np.random.default_rng(3), [5, 17, 40], vocab=VOCAB)
    try:
        with TeacherClient(address, streams=4, retries=5) as c:
            want = c.logprobs(seqs)
            futures = [c.submit(seqs, Wanted(logprobs=True)) for _ in range(12)]
            assert all(np.allclose(x, y, atol=1e-5) for f in futures for x, y in zip(f.result(60).logprobs, want))
            assert a.running.scheduler.batches_run > 0 and b.running.scheduler.batches_run > 0
            a.stop()                                                    # one replica goes away
            a = None
            for _ in range(3):
                futures = [c.submit(seqs, Wanted(logprobs=True)) for _ in range(8)]
                assert all(np.allclose(x, y, atol=1e-5) for f in futures for x, y in zip(f.result(60).logprobs, want))
    finally:
        for s in (a, b):
            if s is not None:
                s.stop()


def test_default_deadline_and_argument_checks(llama_server):
    big = [np.random.default_rng(0).integers(0, VOCAB, 500) for _ in range(64)]
    with TeacherClient(llama_server.address, default_timeout_s=1e-4) as c:
        with pytest.raises(LogitServeError) as e:
            c.full_logits(big)
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with TeacherClient(llama_server.address, default_timeout_s=30) as c:
        assert c.logprobs([[1, 2, 3]])[0].shape == (3,)                   # a generous default changes nothing
    with pytest.raises(ValueError, match="streams=0"):
        TeacherClient(llama_server.address, streams=0)
