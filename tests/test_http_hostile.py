"""The HTTP port under hostile and careless clients: big answers inside the memory budget and off the event loop,
readers that never read, thousands of idle connections, forged bearers, per-client shares derived from the
server-wide limits. Each test reproduces one of issue 27's findings against `logitserve serve` in its own process
and times gRPC health from this process meanwhile (the event loop is shared)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers import OVERHEAD, CliServer, Rss
from logitserve.server.http_app import ACCEPT_BACKLOG

pytestmark = pytest.mark.live_server

MiB = 2 ** 20
BIG = {"prompt": list(range(3, 352)), "max_tokens": 0, "prompt_logprobs": -1}   # 349 ids x the whole vocabulary


class HealthProbe:
    """gRPC health from this process every 50 ms while a test runs: the worst latency seen."""

    def __init__(self, address: str):
        self._channel = grpc.insecure_channel(address)
        self._stub = health_pb2_grpc.HealthStub(self._channel)
        self.times: list[float] = []
        self._stop = threading.Event()

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            t0 = time.monotonic()
            status = self._stub.Check(health_pb2.HealthCheckRequest(), timeout=60).status
            self.times.append(time.monotonic() - t0)
            assert status == health_pb2.HealthCheckResponse.SERVING
            time.sleep(0.05)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._channel.close()

    @property
    def worst(self) -> float:
        return max(self.times)


def _metric(server: CliServer, name: str) -> float:
    port = next(m.group(1) for line in server.log for m in [re.search(r"metrics on http://[\d.]+:(\d+)", line)] if m)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def _raw_post(port: int, path: str, body: dict, source: str = "127.0.0.1", rcvbuf: int = 0,
              headers: str = "") -> socket.socket:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: "
              f"{len(data)}\r\n{headers}\r\n".encode() + data)
    return s


def _read_all(s: socket.socket) -> bytes:
    chunks = []
    while True:
        b = s.recv(1 << 20)
        if not b:
            return b"".join(chunks)
        chunks.append(b)


def test_a_whole_vocabulary_answer_is_held_in_the_budget_and_built_off_the_event_loop():
    server = CliServer("--http-port", "0", "--memory-budget", "1GiB", "--metrics-port", "0")
    port = int(server.http.rsplit(":", 1)[1])
    try:
        with Rss(server.proc.pid) as rss, HealthProbe(server.address) as health:
            s = _raw_post(port, "/v1/completions", {**BIG}, headers="connection: close\r\n")
            time.sleep(1.0)
            held = _metric(server, "logitserve_held_bytes")     # while it is computed, encoded and sent
            raw = _read_all(s)
            s.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
        assert len(body) > 700 * MiB, len(body)        # ~813 MiB of JSON, sent in chunks
        assert held > 64 * MiB, held                    # its arrays and a JSON window are held while it runs
        assert _metric(server, "logitserve_held_bytes") == 0
        print(f"\nbig answer: {len(body) / MiB:.0f} MiB; held {held / MiB:.0f} MiB; RSS +{rss.growth / MiB:.0f} MiB; "
              f"worst gRPC health {health.worst * 1e3:.0f} ms over {len(health.times)} calls")
        # before: RSS +4 GiB and a 21 s stall of gRPC health (the JSON was built whole on the event loop)
        assert rss.growth < 1024 * MiB + OVERHEAD, rss.growth / MiB
        assert health.worst < 5.0, health.worst     # before: stalls of 21 s and 37 s
    finally:
        assert server.stop() == 0


def test_readers_that_never_read_lose_their_answers_and_bytes():
    server = CliServer("--http-port", "0", "--memory-budget", "2GiB", "--metrics-port", "0",
                       "--http-send-timeout-s", "2")
    port = int(server.http.rsplit(":", 1)[1])
    try:
        with Rss(server.proc.pid) as rss, HealthProbe(server.address) as health:
            stuck = [_raw_post(port, "/v1/completions", BIG, source=f"127.0.0.{2 + i}", rcvbuf=4096)
                     for i in range(4)]
            time.sleep(1.0)
            assert _metric(server, "logitserve_held_bytes") > 0
            deadline = time.monotonic() + 60
            while _metric(server, "logitserve_held_bytes") > 0 and time.monotonic() < deadline:
                time.sleep(0.5)
            freed = time.monotonic() - (deadline - 60)
            assert _metric(server, "logitserve_held_bytes") == 0, "a stalled reader still holds its answer"
        for s in stuck:                                # each was cut: its answer ends short of its last chunk
            s.settimeout(10)
            try:
                got = _read_all(s)
            except (ConnectionResetError, socket.timeout):
                got = b""
            assert not got.endswith(b"0\r\n\r\n")
            s.close()
        print(f"\nnon-readers: freed after {freed:.1f} s; RSS +{rss.growth / MiB:.0f} MiB; worst gRPC health "
              f"{health.worst * 1e3:.0f} ms")
        assert rss.growth < 2048 * MiB + OVERHEAD, rss.growth / MiB
        assert health.worst < 5.0, health.worst     # before: stalls of 21 s and 37 s
        assert any("took no bytes of its answer" in line for line in server.log)
    finally:
        assert server.stop() == 0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_thousands_of_idle_connections_starve_neither_grpc_nor_other_http_clients():
    server = CliServer("--http-port", "0", "--http-max-connections", "1024", "--http-header-timeout-s", "2")
    port = int(server.http.rsplit(":", 1)[1])
    base, peak, idle = _fds(server.proc.pid), 0, []
    try:
        with HealthProbe(server.address) as health:
            for i in range(3000):                          # headers never finished, from one host
                c = socket.socket()
                c.setblocking(False)
                try:
                    c.connect(("127.0.0.1", port))
                except BlockingIOError:
                    pass
                idle.append(c)
                if i % 100 == 0:
                    peak = max(peak, _fds(server.proc.pid))
            slow = socket.socket()                          # another host, sending its headers a byte at a time
            slow.bind(("127.0.0.3", 0))
            slow.connect(("127.0.0.1", port))
            other = socket.socket()                         # and another, served meanwhile
            other.bind(("127.0.0.2", 0))
            other.connect(("127.0.0.1", port))
            other.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            assert _read_all(other).startswith(b"HTTP/1.1 200")
            t0, cut = time.monotonic(), None
            try:                                            # cut at the header deadline, bytes or not
                for b in b"GET /v1/models HTTP/1.1\r\nhost: " + b"x" * 100:
                    slow.sendall(bytes([b]))
                    peak = max(peak, _fds(server.proc.pid))
                    time.sleep(0.1)
            except OSError:
                cut = time.monotonic() - t0
            time.sleep(1.0)
            after = _fds(server.proc.pid)
        print(f"\nidle flood: worst gRPC health {health.worst * 1e3:.0f} ms; slow headers cut after {cut}; "
              f"server fds {base} -> peak {peak} -> {after} after the header deadline")
        assert cut is not None and 1.5 < cut < 5.0, cut
        assert peak <= base + 1024 + ACCEPT_BACKLOG + 64 and after <= base + 16, (base, peak, after)   # before: all fds
        assert health.worst < 5.0, health.worst     # before: timeouts
        refusals = [line for line in server.log if "refusing HTTP connections" in line]
        assert 1 <= len(refusals) <= 3, refusals                       # logged once per 10 s, with a count
        assert not any("out of system resource" in line for line in server.log)
    finally:
        for c in idle:
            c.close()
        assert server.stop() == 0


def test_the_last_answer_a_connection_may_carry_says_connection_close():
    """Before: the connection was closed after its 1000th answer with no header saying so, and a keep-alive client
    (http.client, the chaos test's polite one) wrote its next request into the closed socket: a broken pipe."""
    import http.client

    server = CliServer("--http-port", "0", "--http-max-requests-per-connection", "3")
    port = int(server.http.rsplit(":", 1)[1])
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        said, peers = [], []
        for _ in range(7):
            conn.request("GET", "/v1/models")
            r = conn.getresponse()
            assert r.status == 200 and json.loads(r.read())["data"]
            said.append((r.getheader("connection") or "").lower())
            peers.append(conn.sock.getsockname() if conn.sock is not None else None)
        conn.close()
        assert said == ["", "", "close", "", "", "close", ""], said
        assert peers[2] is None and peers[5] is None      # http.client closed the socket it was told to close
    finally:
        assert server.stop() == 0


def test_without_tokens_a_made_up_bearer_is_no_identity(tmp_path):
    from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

    server = CliServer("--http-port", "0", "--max-streams-per-client", "2", "--max-in-flight-per-client", "1")
    try:
        async def streams() -> int:
            async with grpc.aio.insecure_channel(server.address) as ch:
                stub = pb_grpc.LogitServeStub(ch)
                calls = [stub.Forward(metadata=(("authorization", f"Bearer made-up-{i}"),)) for i in range(4)]
                await asyncio.sleep(1.0)
                open_ = sum(not c.done() for c in calls)
                for c in calls:
                    c.cancel()
                return open_
        assert asyncio.run(streams()) == 2                  # before: 4 (each fake bearer was a client)

        codes, messages = [], []

        def one(i: int) -> None:
            req = urllib.request.Request(server.http + "/v1/completions", data=json.dumps(
                {"prompt": list(range(3, 300)), "max_tokens": 0, "prompt_logprobs": 200}).encode(),
                headers={"content-type": "application/json", "authorization": f"Bearer fake-{i}"})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    r.read()
                    codes.append(r.status)
            except urllib.error.HTTPError as e:
                codes.append(e.code)
                messages.append(json.loads(e.read())["error"]["message"])
        threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert codes.count(429) >= 8 and set(codes) <= {200, 429}, codes   # before: all 16 passed
        assert all("--max-in-flight-per-client is 1" in m for m in messages), messages
    finally:
        assert server.stop() == 0


def test_per_client_shares_derive_from_the_server_wide_limits(tmp_path):
    from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

    (tmp_path / "tokens").write_text("alice\nbob\n")
    server = CliServer("--max-streams", "4", "--auth-token-file", str(tmp_path / "tokens"))
    try:
        limits = next(line for line in server.log if "limits in effect" in line)
        assert "--max-streams 4 (per client 2)" in limits and "--max-in-flight 2048 (per client 1024)" in limits

        async def run() -> tuple[int, int]:
            async with grpc.aio.insecure_channel(server.address) as ch:
                stub = pb_grpc.LogitServeStub(ch)
                alice = [stub.Forward(metadata=(("authorization", "Bearer alice"),)) for _ in range(6)]
                await asyncio.sleep(1.0)
                bob = [stub.Forward(metadata=(("authorization", "Bearer bob"),)) for _ in range(2)]
                await asyncio.sleep(1.0)
                counts = sum(not c.done() for c in alice), sum(not c.done() for c in bob)
                for c in alice + bob:
                    c.cancel()
                return counts
        assert asyncio.run(run()) == (2, 2)     # before: alice took all 4 and bob was locked out
    finally:
        assert server.stop() == 0


def test_a_per_client_limit_above_its_server_wide_one_is_capped():
    from logitserve.server.admission import ClientLimits

    lim = ClientLimits(max_streams=500, max_in_flight=None, max_in_flight_total=10).resolved(max_streams_total=8)
    assert (lim.max_streams, lim.max_in_flight) == (8, 5)
    with pytest.raises(ValueError):
        ClientLimits(max_streams=0)
    assert np.isfinite(lim.stream_idle_s)
