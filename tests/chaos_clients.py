"""Hostile clients for the chaos test, run as their own process: `python chaos_clients.py ADDRESS SECONDS TOKEN...`.

Each behaviour runs in its own thread with its own bearer token (its own client identity) until SECONDS pass:
stalled readers, stream hoarders, oversized texts, oversized candidate arrays, k = V requests, cancel storms
and hang-ups, group parts whose prompt another client's requests share, a pool with a hung replica; with
CHAOS_HTTP_PORT set, on the HTTP port too: whole-vocabulary answers read slowly, the same never read, hundreds of
idle connections, made-up bearers, chat bodies of 200,000 messages. Prints one JSON line of what each saw (status code
names and counts)."""
from __future__ import annotations

import collections
import json
import os
import socket
import sys
import threading
import time

import grpc
import numpy as np

from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

V = 32000
OPTS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
seen: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


def ids(n: int, seed: int) -> pb.Tensor:
    return pb.Tensor(dtype=pb.INT32, shape=[n], data=np.random.default_rng(seed).integers(3, V, n).astype("<i4").tobytes())


def meta(token: str):
    return (("authorization", f"Bearer {token}"),)


def record(kind: str, responses) -> None:
    try:
        for m in responses:
            if m.HasField("error"):
                seen[kind][next(c.name for c in grpc.StatusCode if c.value[0] == m.error.code)] += 1
            elif m.HasField("done"):
                seen[kind]["OK"] += 1
    except grpc.RpcError as e:
        seen[kind][e.code().name] += 1


def stall(address: str, token: str, until: float) -> None:
    """Ask for 1024 tokens of full logits (131 MB), read nothing for 4 s, then read what is left."""
    k = 0
    while time.monotonic() < until:
        req = pb.ForwardRequest(request_id=f"stall{k}", sequences=[ids(1024, k)])
        req.full_logits.SetInParent()
        with grpc.insecure_channel(address, options=OPTS) as ch:
            responses = pb_grpc.LogitServeStub(ch).Forward(iter([req]), metadata=meta(token))
            time.sleep(4.0)
            record("stall", responses)
        k += 1


def hoard(address: str, token: str, until: float) -> None:
    """Open as many empty streams as allowed and keep reopening them."""
    with grpc.insecure_channel(address, options=OPTS) as ch:
        stub = pb_grpc.LogitServeStub(ch)
        blocker = threading.Event()

        def nothing():
            blocker.wait()
            return
            yield

        while time.monotonic() < until:
            calls = [stub.Forward(nothing(), metadata=meta(token)) for _ in range(8)]
            time.sleep(2.0)
            for c in calls:
                if c.done():
                    seen["hoard"][c.code().name] += 1
                else:
                    c.cancel()
                    seen["hoard"]["held"] += 1
        blocker.set()


def oversized(address: str, token: str, until: float) -> None:
    """9 MiB texts, 8192 x 1950 candidate arrays and k = V on 8192 tokens, in turn, every 1.5 s. Each message is
    serialized once: the test measures the server, not this process's protobuf encoder on a shared CPU."""
    cands = np.random.default_rng(1).integers(0, V, (8192, 1950)).astype("<i4")
    text = pb.ForwardRequest(request_id="text", texts=[" ".join(["t7"] * (3 << 20))])
    text.logprobs.SetInParent()
    cand = pb.ForwardRequest(request_id="candidates", sequences=[ids(8192, 1)])
    cand.candidates.ids.append(pb.Tensor(dtype=pb.INT32, shape=[8192, 1950], data=cands.tobytes()))
    kv = pb.ForwardRequest(request_id="k=V", sequences=[ids(8192, 2)])
    kv.topk.k = V
    wire = [(r.request_id, r.SerializeToString()) for r in (text, cand, kv)]
    k = 0
    with grpc.insecure_channel(address, options=OPTS) as ch:
        forward = ch.stream_stream("/logitserve.v1.LogitServe/Forward", request_serializer=lambda b: b,
                                   response_deserializer=pb.ForwardResponse.FromString)
        while time.monotonic() < until:
            which, body = wire[k % 3]
            record(which, forward(iter([body]), metadata=meta(token)))
            k += 1
            time.sleep(1.5)


def cancel_storm(address: str, token: str, until: float) -> None:
    """Send 128-token requests and cancel each at once, on one stream; then hang up mid-request."""
    k = 0
    while time.monotonic() < until:
        with grpc.insecure_channel(address, options=OPTS) as ch:
            stub = pb_grpc.LogitServeStub(ch)

            def reqs():
                for j in range(20):
                    r = pb.ForwardRequest(request_id=f"c{j}", sequences=[ids(128, j)])
                    r.logprobs.SetInParent()
                    yield r
                    yield pb.ForwardRequest(request_id=f"c{j}", cancel=True)
                time.sleep(0.2)

            record("cancel", stub.Forward(reqs(), metadata=meta(token)))
            hang = stub.Forward(iter([pb.ForwardRequest(request_id="h", sequences=[ids(256, k)])]),
                                metadata=meta(token))
            time.sleep(0.05)
            hang.cancel()                      # hang up with the request in flight
            seen["hang-up"]["sent"] += 1
        k += 1
        time.sleep(0.2)


def _post(port: int, body: dict, token: str, rcvbuf: int = 0, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nauthorization: "
              f"Bearer {token}\r\nconnection: close\r\ncontent-length: {len(data)}\r\n\r\n".encode() + data)
    return s


def _status(s: socket.socket) -> str:
    head = s.recv(64)
    return head.split(b" ")[1].decode() if head.startswith(b"HTTP/1.1") else "cut"


BIG = {"prompt": list(range(3, 200)), "max_tokens": 0, "prompt_logprobs": -1}     # ~460 MiB of JSON


def http_big(port: int, token: str, until: float) -> None:
    """Whole-vocabulary prompt_logprobs answers, read to the end (slowly). Each HTTP behaviour connects from a
    loopback address of its own: hosts are clients for HTTP connections, as on a real network."""
    while time.monotonic() < until:
        s = _post(port, BIG, token, source="127.0.0.2")
        try:
            code = _status(s)
            while s.recv(1 << 16):
                time.sleep(0.001)
        except OSError:
            code = "cut"
        seen["http-big"][code] += 1
        s.close()
        if code == "429":          # retry later, as the openai package and trainers' loops do (with backoff)
            time.sleep(1.0)


def http_nonreader(port: int, token: str, until: float) -> None:
    """The same answers into a 4 KiB receive buffer, never read; closed after 6 s."""
    while time.monotonic() < until:
        s = _post(port, BIG, token, rcvbuf=4096, source="127.0.0.3")
        time.sleep(6.0)
        seen["http-nonreader"]["held"] += 1
        s.close()


def http_idle(port: int, token: str, until: float) -> None:
    """Hundreds of connections that never finish their headers, reopened as the server cuts them."""
    held: list = []
    while time.monotonic() < until:
        for c in [c for c in held if c.fileno() < 0]:
            held.remove(c)
        while len(held) < 600:
            c = socket.socket()
            c.bind(("127.0.0.4", 0))
            c.setblocking(False)
            try:
                c.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
            held.append(c)
        time.sleep(1.0)
        for c in list(held):
            try:
                if c.recv(1, socket.MSG_PEEK) == b"":
                    c.close()
                    held.remove(c)
            except BlockingIOError:
                pass
            except OSError:
                c.close()
                held.remove(c)
        seen["http-idle"]["held"] += 1
    for c in held:
        c.close()


def http_forged(port: int, token: str, until: float) -> None:
    """Made-up bearers, one per request: refused (401/403), never a client of their own."""
    k = 0
    while time.monotonic() < until:
        s = _post(port, {"prompt": [5, 6, 7], "max_tokens": 0, "prompt_logprobs": 1}, f"forged-{k}",
                  source="127.0.0.5")
        try:
            seen["http-forged"][_status(s)] += 1
        except OSError:
            seen["http-forged"]["cut"] += 1
        s.close()
        k += 1
        time.sleep(0.05)


def http_messages(port: int, token: str, until: float) -> None:
    """Chat bodies of 200,000 empty messages to /classify: refused 413 on their count, never rendered (issue 43)."""
    body = json.dumps({"messages": [[{"role": "user", "content": ""}] * 200_000]}).encode()
    while time.monotonic() < until:
        s = socket.socket()
        s.bind(("127.0.0.6", 0))
        s.connect(("127.0.0.1", port))
        s.sendall(f"POST /classify HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nauthorization: "
                  f"Bearer {token}\r\nconnection: close\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
        try:
            seen["http-messages"][_status(s)] += 1
        except OSError:
            seen["http-messages"]["cut"] += 1
        s.close()
        time.sleep(0.5)


HTTP_BEHAVIOURS = (http_big, http_nonreader, http_idle, http_forged, http_messages)


def mates(address: str, token: str, until: float) -> None:
    """Issue 43's cross-client mates: 16 requests sharing a 64-token system prompt (their prompt_lengths make the
    answers small) queued beside a longer request, every 2 s, from one client: the server stays in grouped
    mode."""
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, V, 64)
    k = 0
    with grpc.insecure_channel(address, options=OPTS) as ch:
        stub = pb_grpc.LogitServeStub(ch)
        while time.monotonic() < until:
            def reqs():
                for j in range(16):
                    seq = np.concatenate([prompt, rng.integers(3, V, 8)]).astype("<i4")
                    r = pb.ForwardRequest(request_id=f"m{k}-{j}", prompt_lengths=[len(seq) - 1],
                                          sequences=[pb.Tensor(dtype=pb.INT32, shape=[len(seq)], data=seq.tobytes())])
                    r.logprobs.SetInParent()
                    yield r
                big = pb.ForwardRequest(request_id=f"long{k}", sequences=[ids(256, k)])
                big.logprobs.SetInParent()
                yield big
            record("mates", stub.Forward(reqs(), metadata=meta(token)))
            k += 1
            time.sleep(2.0)


def hung_replica(address: str, token: str, until: float) -> None:
    """A TeacherPool over the server and a replica that hangs (a listening socket never read: what a SIGSTOPped
    process looks like): every request ends within its deadline + 5 s (else "late"), served by the live one."""
    from logitserve.client import LogitServeError, TeacherPool

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    with TeacherPool([address, f"127.0.0.1:{hung.getsockname()[1]}"], token=token, default_timeout_s=3,
                     keepalive_s=1) as pool:
        k = 0
        while time.monotonic() < until:
            t0 = time.monotonic()
            try:
                pool.logprobs([np.random.default_rng(k).integers(3, V, 80)])
                code = "OK"
            except LogitServeError as e:
                code = e.code.name
            seen["hung-replica"][code if time.monotonic() - t0 <= 3 + 5 else "late"] += 1
            k += 1
            time.sleep(0.2)
    hung.close()


def main() -> None:
    address, seconds, *tokens = sys.argv[1:]
    until = time.monotonic() + float(seconds)
    http = os.environ.get("CHAOS_HTTP_PORT")      # the HTTP port: its hostile clients too
    behaviours = [(b.__name__, b, address) for b in (stall, hoard, oversized, cancel_storm, mates, hung_replica)]
    behaviours += [(b.__name__, b, int(http)) for b in HTTP_BEHAVIOURS] if http else []
    only = os.environ.get("CHAOS_ONLY")           # behaviours by name (comma-separated), to find what costs what
    if only:
        behaviours = [b for b in behaviours if b[0] in only.split(",")]
    threads = [threading.Thread(target=fn, args=(where, tokens[i % len(tokens)], until), daemon=True)
               for i, (_, fn, where) in enumerate(behaviours)]
    [t.start() for t in threads]
    [t.join(float(seconds) + 60) for t in threads]
    print(json.dumps({k: dict(v) for k, v in seen.items()}), flush=True)


if __name__ == "__main__":
    main()
