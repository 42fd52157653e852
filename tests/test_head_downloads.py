"""Head downloads under load: slots per client and server-wide, stalled readers cut, clients that wait, quiet cancels.

One in-process server of the demo model (a 31 MiB head: more than any flow-control window, so
a reader that stops reading stalls its download) with --head-stall-s 2. Clients are told apart
by their bearer tokens (with --auth-token-file the server keys fair shares by token).
"""
from __future__ import annotations

import concurrent.futures
import logging
import time

import grpc
import numpy as np
import pytest

from helpers import CliServer, serve_dir
from logitserve.client import LogitServeError, TeacherClient
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.live_server

STALL_S = 2.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from logitserve.demo import demo_dir
    from logitserve.server.head_rpc import HeadLimits
    from logitserve.server.security import SecurityConfig

    tokens = tmp_path_factory.mktemp("head") / "tokens"      # each token is a client (only with tokens configured)
    tokens.write_text("a\nb\ns1\ns2\nc\nmany\ngone\n")
    s = serve_dir(demo_dir("causal"), chunk_size=64, head=HeadLimits(max_downloads=2, stall_s=STALL_S),
                  security=SecurityConfig(auth_token_file=str(tokens)))
    yield s
    s.stop()


class Stalled:
    """A raw Head call as `token`'s client that reads two messages, then stops reading."""

    def __init__(self, address: str, token: str):
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
        self.call = pb_grpc.LogitServeStub(self.channel).Head(pb.HeadRequest(),
                                                              metadata=(("authorization", f"Bearer {token}"),))
        assert next(self.call).HasField("info") and next(self.call).HasField("chunk")

    def read_rest(self) -> grpc.RpcError:
        """Read on to the end: the status the server ended the call with (never OK for a stalled one)."""
        with pytest.raises(grpc.RpcError) as e:
            for _ in self.call:
                pass
        return e.value

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()


def _head(address: str, token: str, wait_s=None):
    with TeacherClient(address, token=token) as c:
        return c.head_weights(cache=False, wait_s=wait_s)


def test_a_stalled_reader_holds_its_own_share_only(server):
    """Client A stalls one download: its second is refused naming the per-client flag, client B downloads at
    once (no waiting), and Forward requests go on."""
    a = Stalled(server.address, "a")
    try:
        with pytest.raises(LogitServeError) as e:
            _head(server.address, "a", wait_s=0)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-head-downloads-per-client is 1" in e.value.details
        b = _head(server.address, "b", wait_s=0)                      # no slot to wait for: B is not locked out
        assert b.weight.shape == (32000, 256)
        with TeacherClient(server.address, token="b") as c:
            lp = c.logprobs([[1, 5, 9, 200]], prompt_lengths=[1])
            assert lp[0].shape == (3,) and np.isfinite(lp[0]).all()
    finally:
        a.close()


def test_stalled_readers_are_cut_within_the_stall_bound(server, caplog):
    """Two clients stall both server-wide slots: a third is refused naming --max-head-downloads, then (waiting)
    gets through once the stalled ones are cut, within --head-stall-s of their stalling (2 s; generous slack
    for a loaded machine). A cut reader finds RESOURCE_EXHAUSTED naming --head-stall-s when it reads on; until
    then its client's share stays taken."""
    caplog.set_level(logging.INFO, logger="logitserve.server")
    stalled = [Stalled(server.address, t) for t in ("s1", "s2")]
    t0 = time.monotonic()
    try:
        with pytest.raises(LogitServeError) as e:
            _head(server.address, "c", wait_s=0)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-head-downloads is 2" in e.value.details
        got = _head(server.address, "c", wait_s=30)
        waited = time.monotonic() - t0
        assert got.weight.shape == (32000, 256)
        assert waited < STALL_S + 8, f"the stalled downloads held their slots {waited:.1f} s"
        cuts = [r for r in caplog.records if "cut: no message taken" in r.getMessage()]
        assert len(cuts) == 2 and all("--head-stall-s" in r.getMessage() for r in cuts)
        with pytest.raises(LogitServeError) as e:                     # the cut call is not over yet
            _head(server.address, "s1", wait_s=0)
        assert "--max-head-downloads-per-client" in e.value.details
        err = stalled[0].read_rest()
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--head-stall-s" in err.details()
        assert _head(server.address, "s1", wait_s=10).weight.shape == (32000, 256)   # over now: s1 may again
    finally:
        for s in stalled:
            s.close()


def test_concurrent_downloads_of_one_client_all_succeed_by_waiting(server):
    """12 head_weights() at once from one client: without waiting (wait_s=0) most are refused; by default they
    wait their turn and every one returns the whole, verified head."""
    with TeacherClient(server.address, token="many") as c, concurrent.futures.ThreadPoolExecutor(12) as pool:
        hurried = [pool.submit(c.head_weights, False, None, 0) for _ in range(12)]
        refused = 0
        for f in hurried:
            try:
                f.result()
            except LogitServeError as e:
                assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "wait_s" in e.details
                refused += 1
        assert refused >= 6, "the server let one client run more downloads than its share"
        results = [f.result() for f in [pool.submit(c.head_weights, False) for _ in range(12)]]
    first = results[0]
    for r in results:
        assert r.spec == first.spec and np.array_equal(r.weight, first.weight)


def test_a_cancelled_download_logs_one_line_without_traceback(server, caplog):
    """A client that cancels a stalled download: the server logs one line naming the client, no traceback
    (grpc's own ExecuteBatchError included), and the client's share is free again."""
    caplog.set_level(logging.DEBUG)
    stalled = Stalled(server.address, "gone")
    stalled.close()
    assert _head(server.address, "gone", wait_s=10).weight.shape == (32000, 256)   # its share came back
    loud = [r for r in caplog.records
            if r.exc_info or r.levelno >= logging.ERROR or "ExecuteBatchError" in r.getMessage()]
    assert not loud, [r.getMessage() for r in loud]
    ours = [r for r in caplog.records if "Head download" in r.getMessage()]
    assert len(ours) == 1 and "ended early" in ours[0].getMessage()
    assert "token:" in ours[0].getMessage() and ours[0].levelno == logging.INFO


def test_head_limits_are_flags_checked_and_logged_at_start(capsys):
    from logitserve.server.cli import main

    assert main(["serve", "--demo", "causal", "--max-head-downloads", "2", "--max-head-downloads-per-client", "3"]) == 2
    assert "--max-head-downloads-per-client 3 must be in [1, --max-head-downloads 2]" in capsys.readouterr().err
    server = CliServer("--demo", "causal", "--max-head-downloads", "5", "--head-stall-s", "7")
    try:
        line = next(x for x in server.log if "Head downloads:" in x)
        assert "5 at once server-wide, 2 per client" in line and "7 s" in line     # per client: half, rounded down
    finally:
        assert server.stop() == 0
