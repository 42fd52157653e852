"""A hung server (SIGSTOP: the port open, nothing answering) never hangs a client: its deadline ends the request
DEADLINE_EXCEEDED, keepalive pings end the connection UNAVAILABLE, and a TeacherPool takes the replica out and
sends its requests to another (issue 43); replicas are checked for one model before any request is routed."""
from __future__ import annotations

import signal
import time

import grpc
import numpy as np
import pytest

from helpers import PACKED_ATOL, VOCAB, CliServer, build_model, ref_token_logprobs, serve_dir
from logitserve.client import LogitServeError, ReplicasDisagree, TeacherClient, TeacherPool, Teachers, Wanted
DEADLINE_GRACE_S = 2.0     # logitserve.client.aio.DEADLINE_GRACE_S (a constant here: the test runs on the old client too)

pytestmark = pytest.mark.live_server


@pytest.fixture(scope="module")
def hung(model_dirs):
    """`logitserve serve` as a process, stopped (SIGSTOP) by the test that needs it and resumed after it."""
    server = CliServer("--model", str(model_dirs["llama"]), "--threads", "1")
    yield server
    server.proc.send_signal(signal.SIGCONT)
    server.stop()


@pytest.fixture
def stopped(hung):
    """The hung server, stopped for one test: answered once first (its connection is up), then SIGSTOPped."""
    with TeacherClient(hung.address, wait_ready=60) as c:
        c.logprobs([[1, 2, 3]])
    hung.proc.send_signal(signal.SIGSTOP)
    yield hung
    hung.proc.send_signal(signal.SIGCONT)


def _ends_within(future, bound_s: float) -> tuple[BaseException, float]:
    """The error `future` ends with and when; a test failure (not a hang) when it is still pending after bound_s."""
    t0 = time.monotonic()
    try:
        future.result(bound_s)
    except TimeoutError:
        future.cancel()
        pytest.fail(f"still pending after {bound_s} s")
    except LogitServeError as e:
        return e, time.monotonic() - t0
    pytest.fail("answered OK by a stopped server")


def test_a_request_to_a_stopped_server_ends_deadline_exceeded_at_its_deadline(stopped):
    with TeacherClient(stopped.address, default_timeout_s=3) as c:
        error, took = _ends_within(c.submit([[1, 2, 3, 4]], Wanted(logprobs=True)), 3 + 5)
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED and "timeout_s 3 s" in error.details, error
    assert 3 <= took <= 3 + DEADLINE_GRACE_S + 1, took


def test_without_a_deadline_keepalive_ends_the_request_unavailable(stopped):
    with TeacherClient(stopped.address, keepalive_s=1) as c:
        error, took = _ends_within(c.submit([[1, 2, 3, 4]], Wanted(logprobs=True)), 2 * 1 + 5)
    assert error.code == grpc.StatusCode.UNAVAILABLE, error
    assert took <= 2 * 1 + 3, took


def test_a_pool_takes_a_stopped_replica_out_and_sends_its_requests_elsewhere(model_dirs, hung, llama_ref):
    """TeacherPool([stopped, live], default_timeout_s=5): 4 of 8 requests hung forever on the stopped one and new
    keys kept going to it, shown SERVING. Now every request is answered (exact) within its deadline + 5 s, the
    stopped replica is shown UNREACHABLE, and later requests all go to the live one."""
    live = serve_dir(model_dirs["llama"])
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, VOCAB, 80) for _ in range(8)]         # 8 prefixes: both replicas get some
    try:
        with TeacherPool([hung.address, live.address], wait_ready=60, default_timeout_s=5) as pool:
            pool.logprobs(seqs)                                     # connections up, both replicas routed to
            hung.proc.send_signal(signal.SIGSTOP)
            futures = [pool.submit([s], Wanted(logprobs=True)) for s in seqs]
            t0 = time.monotonic()
            for f, s in zip(futures, seqs):
                got = f.result(max(0.1, t0 + 5 + 5 - time.monotonic())).logprobs[0]
                np.testing.assert_allclose(got, ref_token_logprobs(llama_ref.logits(s), s), atol=PACKED_ATOL)
            state = {r.address: r for r in pool.replicas()}
            assert state[hung.address].status == "UNREACHABLE", state
            sent = state[hung.address].sent
            more = [rng.integers(0, VOCAB, 80) for _ in range(8)]
            pool.logprobs(more)
            assert {r.address: r for r in pool.replicas()}[hung.address].sent == sent      # none routed there
    finally:
        hung.proc.send_signal(signal.SIGCONT)
        live.stop()


def test_replicas_on_two_models_are_refused_before_any_request_without_wait_ready(model_dirs, tmp_path):
    """Without wait_ready a pool served whichever replica answered first (3 of 6 runs one model, 3 the other, no
    error). The first request checks every replica's model first: ReplicasDisagree naming both, every time."""
    a, b = serve_dir(model_dirs["llama"]), serve_dir(build_model(tmp_path / "other", "llama", seed=1))
    try:
        for _ in range(3):
            with TeacherPool([a.address, b.address], ready_timeout_s=10) as pool:
                with pytest.raises(ReplicasDisagree) as e:
                    pool.logprobs([[1, 2, 3]])
                assert a.address in str(e.value) and b.address in str(e.value)
    finally:
        a.stop()
        b.stop()


def test_teachers_check_per_sequence_argument_lengths(llama_server):
    """Teachers accepted 5 prompt_lengths for 4 sequences (the other clients raise)."""
    with TeacherClient(llama_server.address) as c:
        teachers = Teachers({"t": c})
        seqs = [[1, 2, 3, 4]] * 4
        with pytest.raises(ValueError, match="prompt_lengths: 5 given for 4 sequences"):
            teachers.logprobs(seqs, ["t"] * 4, prompt_lengths=[1] * 5)
        with pytest.raises(ValueError, match="prompt_lengths: 5 given for 4 sequences"):
            c.logprobs(seqs, prompt_lengths=[1] * 5)
