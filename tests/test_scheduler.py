"""Batching across streams: bitwise batch invariance, backpressure, memory refusal, cancellation, deadlines."""
from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

from helpers import FIELDS, VOCAB, random_request, random_seqs, serve_dir, within_packed_bound
from logitserve.client import AsyncTeacherClient, LogitServeError, TeacherClient
from logitserve.server.config import SchedulerConfig
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc


def _same(a, b) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        for u, v in zip(x or [], y or []):
            assert u.dtype == v.dtype and np.array_equal(u, v, equal_nan=True), name


@pytest.fixture(scope="module")
def batching_server(model_dirs):
    server = serve_dir(model_dirs["llama"], chunk_size=16, batching="exact",
                       scheduler=SchedulerConfig(max_batch_tokens=2000, batch_delay_s=0.02))
    yield server
    server.stop()


def _concurrently(server, requests: list[dict]) -> list:
    """The requests from 8 streams at once, so that the scheduler batches them across streams."""
    async def run():
        clients = [AsyncTeacherClient(server.address) for _ in range(8)]
        try:
            return await asyncio.gather(*(clients[i % 8].forward(**r) for i, r in enumerate(requests)))
        finally:
            for c in clients:
                await c.close()
    return asyncio.run(run())


@pytest.mark.live_server
def test_exact_mode_results_are_bitwise_identical_alone_and_batched(batching_server):
    rng = np.random.default_rng(31)
    requests = [random_request(rng) for _ in range(40)]
    before = batching_server.running.scheduler.batches_run
    batched = _concurrently(batching_server, requests)
    batches = batching_server.running.scheduler.batches_run - before
    assert batches < len(requests), "requests from several streams should have shared batches"
    with TeacherClient(batching_server.address) as c:
        for r, got in zip(requests, batched):
            _same(got, c.forward(**r))


@pytest.mark.live_server
def test_packed_mode_batched_results_equal_alone_within_the_bound(model_dirs):
    server = serve_dir(model_dirs["llama"], chunk_size=16, batching="packed",
                       scheduler=SchedulerConfig(max_batch_tokens=2000, batch_delay_s=0.02))
    rng = np.random.default_rng(35)
    requests = [random_request(rng) for _ in range(24)]
    try:
        before = server.running.scheduler.batches_run
        batched = _concurrently(server, requests)
        assert server.running.scheduler.batches_run - before < len(requests)
        with TeacherClient(server.address) as c:
            for r, got in zip(requests, batched):
                assert got.batching == "packed"
                within_packed_bound(got, c.forward(**r))
    finally:
        server.stop()


@pytest.mark.live_server
def test_queue_over_its_token_limit_answers_resource_exhausted(model_dirs):
    """Full logits rows count double in the queue (logitserve.cost): 800 tokens are 1600 work tokens."""
    server = serve_dir(model_dirs["llama"], scheduler=SchedulerConfig(max_queued_tokens=2000,
                                                                      max_queued_tokens_per_client=2000))
    long = random_seqs(np.random.default_rng(32), [400, 400])
    try:
        async def flood():
            async with AsyncTeacherClient(server.address) as c:
                return await asyncio.gather(*(c.full_logits(long) for _ in range(6)), return_exceptions=True)
        results = asyncio.run(flood())
        with TeacherClient(server.address) as c:
            assert c.logprobs([[1, 2, 3]])[0].shape == (3,)
            with pytest.raises(LogitServeError) as too_big:
                c.logprobs(random_seqs(np.random.default_rng(1), [501, 500, 500, 500]))
    finally:
        server.stop()
    refused = [r for r in results if isinstance(r, LogitServeError)]
    served = [r for r in results if not isinstance(r, Exception)]
    assert refused and served and len(refused) + len(served) == 6
    for e in refused + [too_big.value]:
        assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-queued-tokens 2000" in e.details


@pytest.mark.live_server
def test_request_over_the_memory_budget_is_refused_not_run(model_dirs):
    server = serve_dir(model_dirs["llama"], chunk_size=64, batching="exact",
                       scheduler=SchedulerConfig(memory_budget_bytes=4 << 20))
    try:
        with TeacherClient(server.address) as c:
            with pytest.raises(LogitServeError) as e:
                c.topk(random_seqs(np.random.default_rng(33), [500]), VOCAB)
            ok = c.topk(random_seqs(np.random.default_rng(33), [50]), 5)
    finally:
        server.stop()
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--memory-budget 4 MiB" in e.value.details and "500 tokens" in e.value.details
    assert ok[0][0].shape == (50, 5)


def _long_job(n: int = 30) -> list:
    return random_seqs(np.random.default_rng(34), [500] * n)


@pytest.mark.live_server
def test_cancelled_request_is_dropped_and_the_server_moves_on(model_dirs):
    server = serve_dir(model_dirs["llama"], chunk_size=16)
    scheduler = server.running.scheduler
    try:
        async def scenario():
            async with AsyncTeacherClient(server.address) as c:
                t0 = time.perf_counter()
                await c.full_logits(_long_job())
                whole = time.perf_counter() - t0
                task = asyncio.ensure_future(c.full_logits(_long_job()))
                queued = asyncio.ensure_future(c.full_logits(_long_job()))
                await asyncio.sleep(0.05 * whole)
                task.cancel()
                queued.cancel()
                t1 = time.perf_counter()
                small = await c.logprobs([[1, 2, 3]])
                after = time.perf_counter() - t1
                return whole, after, small, task, queued
        whole, after, small, task, queued = asyncio.run(scenario())
        deadline = time.monotonic() + 10
        while scheduler.queued_tokens() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert scheduler.queued_tokens() == 0
    finally:
        server.stop()
    assert task.cancelled() and queued.cancelled() and small[0].shape == (3,)
    # both long jobs stopped: the small request did not wait for them (ratio within one run)
    assert after < 0.5 * whole, (after, whole)


@pytest.mark.live_server
def test_request_timeout_and_stream_deadline_end_with_deadline_exceeded(model_dirs):
    server = serve_dir(model_dirs["llama"], chunk_size=16)
    try:
        with TeacherClient(server.address) as c:
            with pytest.raises(LogitServeError) as e:
                c.forward(_long_job(), full_logits=True, timeout_s=0.05)
            assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "timeout_s" in e.value.details
            with pytest.raises(LogitServeError) as bad:
                c.forward([[1, 2]], logprobs=True, timeout_s=-1)
            assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
        req = pb.ForwardRequest(request_id="x", sequences=[pb.Tensor(dtype=pb.INT32, shape=[500], data=s.astype("<i4").tobytes()) for s in _long_job()])
        req.full_logits.SetInParent()
        with grpc.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.RpcError) as rpc:
                list(pb_grpc.LogitServeStub(channel).Forward(iter([req]), timeout=0.2))
        assert rpc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 10
        while server.running.scheduler.queued_tokens() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.running.scheduler.queued_tokens() == 0
        with TeacherClient(server.address) as c:
            assert c.logprobs([[4, 5, 6]])[0].shape == (3,)
    finally:
        server.stop()


@pytest.mark.unit
def test_cancelled_queued_job_frees_its_queue_tokens_at_once():
    """Scheduler alone, with a runner held by a gate: a job cancelled while queued leaves the queue at once."""
    import threading

    import torch

    from logitserve.events import JobPiece, Piece
    from logitserve.server.scheduler import Scheduler
    from logitserve.spec import Job, LogprobsOpts, OutputKind

    gate = threading.Event()

    def run_batch(jobs, skip, between=None, short=False):
        for i, _ in enumerate(jobs):
            gate.wait(30)
            yield JobPiece(i, Piece(OutputKind.TOKEN_LOGPROBS, 0, (1,), (0,), torch.zeros(1)))

    scheduler = Scheduler(run_batch, SchedulerConfig(max_batch_tokens=100, batch_delay_s=0))
    job = lambda n: Job(sequences=(np.zeros(n, np.int32),), logprobs=LogprobsOpts())

    async def scenario():
        async def drain(j):
            return [p async for p in scheduler.stream(j)]
        running = asyncio.ensure_future(drain(job(60)))       # the runner holds this one at the gate
        await asyncio.sleep(0.2)
        queued = asyncio.ensure_future(drain(job(70)))        # does not fit the batch: waits in the queue
        await asyncio.sleep(0.1)
        assert scheduler.queued_tokens() == 130
        queued.cancel()
        await asyncio.sleep(0.05)
        assert scheduler.queued_tokens() == 60                # freed before the running job ends
        gate.set()
        return await running

    try:
        assert len(asyncio.run(scenario())) == 1
        deadline = time.monotonic() + 5     # the compute thread settles its batch after the last piece
        while scheduler.queued_tokens() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert scheduler.queued_tokens() == 0
    finally:
        gate.set()
        scheduler.shutdown()


@pytest.mark.unit
def test_a_runner_that_raises_when_called_fails_its_batch_and_the_next_batch_runs():
    """A runner that raises before yielding anything (a fake with the wrong signature once did: TypeError): the
    batch's request gets the error and the compute thread goes on (it once died there and every request hung)."""
    from logitserve.server.batch_runner import engine_batch_runner
    from logitserve.server.scheduler import Scheduler
    from logitserve.spec import Job, LogprobsOpts
    from helpers import assert_same_signature

    calls = []

    def run_batch(jobs, skip, between=None, short=False):
        calls.append(len(jobs))
        if len(calls) == 1:
            raise TypeError("the runner failed before its first step")
        return iter(())

    assert_same_signature(run_batch, engine_batch_runner(lambda jobs, skip, short=False: iter(())))
    scheduler = Scheduler(run_batch, SchedulerConfig(batch_delay_s=0))
    job = Job(sequences=(np.zeros(4, np.int32),), logprobs=LogprobsOpts())

    async def drain():
        return [p async for p in scheduler.stream(job)]

    try:
        with pytest.raises(TypeError, match="before its first step"):
            asyncio.run(asyncio.wait_for(drain(), 10))
        assert asyncio.run(asyncio.wait_for(drain(), 10)) == []
        assert calls == [1, 1]
    finally:
        scheduler.shutdown()


def _stalled_full_logits(address: str):
    """A stream that asks for 32 MB of full logits and reads nothing (for now): (channel, response iterator)."""
    big = pb.ForwardRequest(request_id="big")
    for s in random_seqs(np.random.default_rng(9), [500] * 16, vocab=VOCAB):
        big.sequences.add(dtype=pb.INT32, shape=[len(s)], data=np.asarray(s, "<i4").tobytes())
    big.full_logits.SetInParent()
    ch = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)])
    return ch, pb_grpc.LogitServeStub(ch).Forward(iter([big]))


@pytest.mark.live_server
def test_a_stalled_reader_alone_is_waited_on_for_the_stall_timeout_then_dropped(model_dirs):
    """Nobody else waiting: the compute thread waits on the full buffer for --stall-timeout, then drops it."""
    server = serve_dir(model_dirs["llama"], max_message_bytes=64 << 10,
                       scheduler=SchedulerConfig(stall_timeout_s=1.0, max_buffered_bytes=1 << 20, batch_delay_s=0.0))
    try:
        ch, stalled = _stalled_full_logits(server.address)
        with ch:
            time.sleep(3.0)                                                   # past the stall timeout
            ends = [m.error for m in stalled if m.HasField("error")]         # now read what it left
        assert len(ends) == 1 and ends[0].code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "stall_timeout_s=1" in ends[0].message
        assert server.running.scheduler.queued_tokens() == 0 and server.running.scheduler.held_bytes() == 0
    finally:
        server.stop()


@pytest.mark.live_server
def test_a_stalled_reader_never_holds_up_another_request(model_dirs):
    """Another request waiting: the stalled one, its buffer full, is dropped at once (not after the 30 s stall
    timeout) naming --max-buffered-bytes, and the other is served without waiting on it."""
    server = serve_dir(model_dirs["llama"], max_message_bytes=64 << 10,
                       scheduler=SchedulerConfig(stall_timeout_s=30.0, max_buffered_bytes=1 << 20, batch_delay_s=0.0))
    try:
        ch, stalled = _stalled_full_logits(server.address)
        with ch:
            time.sleep(1.0)
            t0 = time.monotonic()
            with TeacherClient(server.address) as c:
                lp = c.logprobs([[1, 2, 3]])
            waited = time.monotonic() - t0
            assert lp[0].shape == (3,) and waited < 10
            ends = [m.error for m in stalled if m.HasField("error")]
        assert len(ends) == 1 and ends[0].code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "--max-buffered-bytes is 1 MiB" in ends[0].message
        assert server.running.scheduler.queued_tokens() == 0 and server.running.scheduler.held_bytes() == 0
    finally:
        server.stop()


@pytest.mark.live_server
def test_one_clients_hundred_queued_requests_do_not_put_anothers_one_behind_them(model_dirs, tmp_path):
    """Fair order: each client (bearer token) has its own queue and batches take the clients in turn. Client A
    queues 100 requests, two per batch; client B's one request, sent after them, is served in the next batch
    or so, not after A's hundred (FIFO would put it 50 batches back)."""
    from logitserve.server.security import SecurityConfig

    (tmp_path / "tokens").write_text("client-a\nclient-b\n")
    server = serve_dir(model_dirs["llama"], security=SecurityConfig(auth_token_file=str(tmp_path / "tokens")),
                       scheduler=SchedulerConfig(max_batch_tokens=512, batch_delay_s=0.0,
                                                 max_queued_tokens_per_client=1 << 20))
    seqs = random_seqs(np.random.default_rng(5), [256])
    done: list = []
    try:
        async def run():
            async with AsyncTeacherClient(server.address, token="client-a") as a, \
                    AsyncTeacherClient(server.address, token="client-b") as b:
                async def one(c, name):
                    await c.logprobs(seqs)
                    done.append(name)
                flood = [asyncio.create_task(one(a, "a")) for _ in range(100)]
                while server.running.scheduler.queue_length() < 50:    # A's requests are queued
                    await asyncio.sleep(0.005)
                await one(b, "b")
                await asyncio.gather(*flood)
        asyncio.run(run())
    finally:
        server.stop()
    assert len(done) == 101
    assert done.index("b") < 20, done.index("b")     # FIFO: ~100


@pytest.mark.live_server
def test_per_client_in_flight_and_response_size_limits_answer_resource_exhausted(model_dirs):
    """--max-in-flight-per-client counts one client's requests on every stream; --max-response-bytes refuses an
    answer before it is computed. Both are RESOURCE_EXHAUSTED naming the flag, and the stream goes on."""
    from logitserve.server.admission import ClientLimits
    from logitserve.server.config import StreamLimits

    server = serve_dir(model_dirs["llama"], clients=ClientLimits(max_in_flight=2),
                       limits=StreamLimits(max_response_bytes=1 << 20))
    seqs = random_seqs(np.random.default_rng(8), [300])
    try:
        async def flood():
            async with AsyncTeacherClient(server.address, streams=2) as c:
                return await asyncio.gather(*(c.full_logits(seqs, vocab_range=(0, 500)) for _ in range(8)),
                                            return_exceptions=True)
        results = asyncio.run(flood())
        with TeacherClient(server.address) as c:
            with pytest.raises(LogitServeError) as big:
                c.full_logits(seqs)                      # 300 x 1003 fp32: 1.2 MB > 1 MiB
            assert c.full_logits(seqs, vocab_range=(0, 500))[0].shape == (300, 500)
    finally:
        server.stop()
    refused = [r for r in results if isinstance(r, LogitServeError)]
    assert refused and len(refused) < 8
    for e in refused:
        assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-in-flight-per-client is 2" in e.details
    assert big.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-response-bytes 1 MiB" in big.value.details
