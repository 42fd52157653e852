"""The client over several replicas: streams spread by round_robin, a stopped replica's requests retried on the
others, default deadlines."""
from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from helpers import VOCAB, random_seqs, serve_dir
from logitserve.client import LogitServeError, TeacherClient, Wanted

pytestmark = pytest.mark.live_server


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


class _EndedCall:
    """A Forward call that gRPC core has already ended when the request is written: grpc.aio then sets the
    call's status to INTERNAL "Internal error from Core" and raises it from write() and read()."""

    def __init__(self):
        self.error = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                          details="Internal error from Core")
        self.ended = asyncio.Event()

    async def write(self, _request):
        self.ended.set()
        raise self.error

    async def read(self):
        await self.ended.wait()
        raise self.error

    def done(self) -> bool:
        return self.ended.is_set()

    def cancel(self) -> bool:
        self.ended.set()
        return True


class _FirstCallsEnded:
    """The real stub, except that its first `n` Forward calls are `_EndedCall`s."""

    def __init__(self, stub, n: int):
        self.stub, self.n, self.calls = stub, n, []

    def __getattr__(self, name):
        return getattr(self.stub, name)

    def Forward(self, **kwargs):
        if len(self.calls) < self.n:
            self.calls.append(_EndedCall())
            return self.calls[-1]
        return self.stub.Forward(**kwargs)


def test_a_write_onto_an_ended_stream_is_unavailable_and_retried(llama_server):
    """The lost-rank race: the server ends the stream while the client writes a request onto it. The request
    never arrived, so it is sent again on a fresh stream; with no retries left it fails UNAVAILABLE, never
    INTERNAL."""
    seqs = random_seqs(np.random.default_rng(5), [7, 30], vocab=VOCAB)
    with TeacherClient(llama_server.address) as c:
        want = c.logprobs(seqs)
    with TeacherClient(llama_server.address, retries=2) as c:
        c._aio._stub = stub = _FirstCallsEnded(c._aio._stub, 2)
        got = c.logprobs(seqs)
        assert len(stub.calls) == 2 and all(np.array_equal(x, y) for x, y in zip(got, want))
    with TeacherClient(llama_server.address, retries=0) as c:
        c._aio._stub = _FirstCallsEnded(c._aio._stub, 1)
        with pytest.raises(LogitServeError) as e:
            c.logprobs(seqs)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and "Internal error from Core" in e.value.details
        assert all(np.array_equal(x, y) for x, y in zip(c.logprobs(seqs), want))   # the next stream is real
