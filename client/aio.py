"""AsyncTeacherClient: many requests in flight on one bidirectional stream."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
from typing import Optional, Sequence

import grpc

from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

from .api import Detokenized, ModelInfo, OutputsMixin, model_info_of
from .assemble import Assembly, wanted_fields
from .errors import ClientDeadline, LogitServeError
from .wire import Wanted, build_request

def _pem(value) -> Optional[bytes]:
    """PEM bytes as given, or read from a path."""
    if value is None or isinstance(value, bytes):
        return value
    from pathlib import Path

    return Path(value).read_bytes()


# Responses are chunked under 4 MiB by default; leave room for servers configured larger.
DEFAULT_MAX_RECEIVE = 64 << 20
# A request's deadline on the client: its timeout_s plus this (the server's own DEADLINE_EXCEEDED comes first
# while the server runs at all; past it the server or the network is hung).
DEADLINE_GRACE_S = 2.0
# HTTP/2 keepalive: a ping every KEEPALIVE_S on every connection, calls or none; a ping unanswered for as long ends
# the connection, and every call on it UNAVAILABLE (a stopped or partitioned server). The server accepts pings
# this often (server.gate); KEEPALIVE_MIN_S is the least interval it accepts.
KEEPALIVE_S = 10.0
KEEPALIVE_MIN_S = 1.0


def keepalive_options(keepalive_s: Optional[float]) -> list[tuple]:
    """Channel options for a ping every `keepalive_s` seconds, a connection dropped after as long unanswered."""
    if keepalive_s is None:
        return []
    if keepalive_s < KEEPALIVE_MIN_S:
        raise ValueError(f"keepalive_s={keepalive_s} must be >= {KEEPALIVE_MIN_S} (the server refuses faster pings)")
    ms = int(keepalive_s * 1000)
    # grpc core enforces keepalive_timeout_ms only on a ping of its own, not on one already in flight (a BDP
    # probe unanswered by a stopped server): ping_timeout_ms bounds every ping
    return [("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", ms), ("grpc.http2.ping_timeout_ms", ms),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]


def service_config(load_balancing: str) -> str:
    """gRPC service config: the load-balancing policy over the address's backends (`dns:///` names several),
    and transparent retries of ModelInfo on UNAVAILABLE."""
    return json.dumps({
        "loadBalancingConfig": [{load_balancing: {}}],
        "methodConfig": [{"name": [{"service": "logitserve.v1.LogitServe", "method": "ModelInfo"}],
                          "retryPolicy": {"maxAttempts": 4, "initialBackoff": "0.1s", "maxBackoff": "2s",
                                          "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}],
    })


class _Stream:
    """One Forward call: its reader task and the requests in flight on it."""

    def __init__(self, call):
        self.call = call
        self.pending: dict[str, tuple[Assembly, asyncio.Future]] = {}
        self.write_lock = asyncio.Lock()   # grpc.aio allows one write at a time per stream
        self.reader: Optional[asyncio.Task] = None
        self.writes: set[asyncio.Task] = set()   # writes under way (one on a cancelled call may never end)

    @property
    def usable(self) -> bool:
        return not self.call.done()


class AsyncTeacherClient(OutputsMixin):
    """`async with AsyncTeacherClient("host:port") as c: lp = await c.logprobs([[1, 2, 3]])`."""

    def __init__(self, address: str, *, max_receive_bytes: int = DEFAULT_MAX_RECEIVE,
                 options: Sequence[tuple] = (), tls: bool = False, root_certificates=None,
                 certificate_chain=None, private_key=None, token: Optional[str] = None, streams: int = 1,
                 retries: int = 3, default_timeout_s: Optional[float] = None, load_balancing: str = "round_robin",
                 keepalive_s: Optional[float] = KEEPALIVE_S):
        """TLS when `tls` or any certificate is given (PEM bytes or a file path; no root_certificates: the
        system's roots); `certificate_chain` + `private_key`: a client certificate for mTLS; `token`: sent
        as `authorization: Bearer <token>` on every call.

        `address` may name several replicas (`dns:///teacher.svc:50051`, `ipv4:10.0.0.1:50051,10.0.0.2:50051`):
        requests go round-robin over `streams` streams, which the load balancer spreads over the replicas. A
        request that fails UNAVAILABLE before any of its data arrived (a replica draining or lost) is sent
        again, on a fresh stream, up to `retries` times. `default_timeout_s`: the deadline of requests that set
        none, and of model_info. A request with a deadline (its timeout_s, or this) is sent with it, and ends
        ClientDeadline (DEADLINE_EXCEEDED) here DEADLINE_GRACE_S after it whatever the server does. `keepalive_s`:
        a ping on the connection that often (None: never), so a hung or unreachable server ends its calls
        UNAVAILABLE within about twice that."""
        if streams < 1 or retries < 0:
            raise ValueError(f"streams={streams} must be >= 1 and retries={retries} >= 0")
        opts = [("grpc.max_receive_message_length", max_receive_bytes), ("grpc.max_send_message_length", -1),
                ("grpc.service_config", service_config(load_balancing)), ("grpc.enable_retries", 1),
                *keepalive_options(keepalive_s), *options]
        if tls or root_certificates or certificate_chain:
            creds = grpc.ssl_channel_credentials(_pem(root_certificates), _pem(private_key), _pem(certificate_chain))
            self._channel = grpc.aio.secure_channel(address, creds, options=opts)
        else:
            self._channel = grpc.aio.insecure_channel(address, options=opts)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._stub = pb_grpc.LogitServeStub(self._channel)
        self._streams: list[Optional[_Stream]] = [None] * streams
        self._retired: set[_Stream] = set()      # streams left for new requests, still finishing their own
        self._retries, self._default_timeout = retries, default_timeout_s
        self._ids = itertools.count()
        self._turn = itertools.count()
        self._open_lock = asyncio.Lock()
        self._closed = False

    async def __aenter__(self) -> "AsyncTeacherClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Cancel every stream (requests in flight end CANCELLED "client closed"), then close the channel."""
        self._closed = True
        live = [s for s in self._streams if s is not None] + list(self._retired)
        for s in live:
            s.call.cancel()
        await asyncio.gather(*(s.reader for s in live if s.reader is not None), return_exceptions=True)
        writes = [w for s in live for w in s.writes]
        for w in writes:
            w.cancel()
        await asyncio.gather(*writes, return_exceptions=True)
        await self._channel.close()

    async def wait_ready(self, timeout_s: float = 600.0) -> ModelInfo:
        """Wait until the server answers ModelInfo (through start-up: the port refusing connections, then the
        model loading, both UNAVAILABLE), for at most `timeout_s`; the model's info, or the last error."""
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while True:
            left = deadline - time.monotonic()
            try:
                return model_info_of(await self._stub.ModelInfo(pb.ModelInfoRequest(), timeout=max(0.1, min(left, 10.0)),
                                                                metadata=self._metadata, wait_for_ready=True))
            except grpc.RpcError as e:
                retry = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                if not retry or time.monotonic() + delay >= deadline:
                    err = LogitServeError.from_rpc(e)
                    if retry:      # still starting, or nothing listening: UNAVAILABLE either way
                        err = LogitServeError(grpc.StatusCode.UNAVAILABLE, f"the server was not ready within "
                                                                           f"{timeout_s:g} s: {e.details()}")
                    raise err from None
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)

    async def model_info(self, timeout: Optional[float] = None) -> ModelInfo:
        try:
            return model_info_of(await self._stub.ModelInfo(pb.ModelInfoRequest(),
                                                            timeout=timeout or self._default_timeout,
                                                            metadata=self._metadata))
        except grpc.RpcError as e:
            raise LogitServeError.from_rpc(e) from None

    async def detokenize(self, ids: Sequence[int], timeout: Optional[float] = None) -> Detokenized:
        """The ids as the server's tokenizer spells them (FAILED_PRECONDITION where the model has none)."""
        try:
            r = await self._stub.Detokenize(pb.DetokenizeRequest(ids=[int(x) for x in ids]),
                                            timeout=timeout or self._default_timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise LogitServeError.from_rpc(e) from None
        return Detokenized(tuple(r.tokens), tuple(r.texts), None if r.unk_token_id < 0 else int(r.unk_token_id))

    async def head_weights(self, cache=True, timeout: Optional[float] = None, wait_s: Optional[float] = None):
        """The teacher's lm_head as numpy arrays (a client.head.HeadWeights), verified against the server's hash;
        `cache`: True (~/.cache/logitserve/heads, or $LOGITSERVE_CACHE), a folder, or False. While the server's
        download slots are all taken (RESOURCE_EXHAUSTED) it waits and tries again with backoff, for at most
        `wait_s` seconds in all (default client.head.DEFAULT_WAIT_S, 120 s; 0: never); `timeout`: each try's."""
        from pathlib import Path

        from .head import DEFAULT_WAIT_S, default_cache, fetch_head

        folder = default_cache() if cache is True else (Path(cache) if cache else None)
        return await fetch_head(self._stub, self._metadata, timeout, folder,
                                DEFAULT_WAIT_S if wait_s is None else wait_s)

    async def head(self, device=None, dtype=None, devices=None, cache=True, timeout: Optional[float] = None,
                   wait_s: Optional[float] = None):
        """A torch module (client.teacher_head.TeacherHead) whose call on hidden states [..., H] returns exactly the
        server's logits [..., V] in fp32 (`temperature=` divides them); fetched once, then from the cache
        (`wait_s` as head_weights')."""
        from .teacher_head import TeacherHead

        return TeacherHead(await self.head_weights(cache, timeout, wait_s), device=device, dtype=dtype,
                           devices=devices)

    def _request(self, seqs: Sequence, wanted: Wanted, pick, bf16_as_torch: bool = False):
        async def run():
            return pick(await self.submit(seqs, wanted, bf16_as_torch))
        return run()

    async def submit(self, seqs: Sequence, wanted: Wanted, bf16_as_torch: bool = False):
        """Send one request and wait for its ForwardResult; UNAVAILABLE before any data: sent again."""
        return await resending(lambda _attempt: self.send_once(seqs, wanted, bf16_as_torch), self._retries)

    async def send_once(self, seqs: Sequence, wanted: Wanted, bf16_as_torch: bool = False):
        """One try of `submit`: its ForwardResult, or Resendable where UNAVAILABLE came before any data."""
        if wanted.timeout_s is None and self._default_timeout is not None:
            wanted = dataclasses.replace(wanted, timeout_s=self._default_timeout)
        once = self._submit_once(next(self._turn) % len(self._streams), seqs, wanted, bf16_as_torch)
        if wanted.timeout_s is None:
            return await once
        return await self._by_deadline(once, wanted.timeout_s)

    async def _by_deadline(self, once, timeout_s: float):
        """`once`'s result, or ClientDeadline DEADLINE_GRACE_S past `timeout_s` (its task is cancelled then, not
        waited for: its cancel may never be written to a hung server)."""
        task = asyncio.ensure_future(once)
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout_s + DEADLINE_GRACE_S)
        except asyncio.CancelledError:
            task.cancel()
            await asyncio.wait({task})
            raise
        if task in done:
            return task.result()
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        raise ClientDeadline(f"no answer within timeout_s {timeout_s:g} s + {DEADLINE_GRACE_S:g} s: the server or "
                             f"the network is hung")

    @property
    def channel(self) -> grpc.aio.Channel:
        """The replica's channel (a TeacherPool watches its health on it)."""
        return self._channel

    @property
    def metadata(self):
        return self._metadata

    async def _submit_once(self, slot: int, seqs: Sequence, wanted: Wanted, bf16_as_torch: bool):
        rid = f"r{next(self._ids)}"
        req = build_request(rid, seqs, wanted)
        if self._closed:
            raise _closed()
        stream = await self._stream(slot)
        fut = asyncio.get_running_loop().create_future()
        assembly = Assembly(len(req.sequences) or len(req.texts), wanted_fields(req), bf16_as_torch)
        stream.pending[rid] = (assembly, fut)
        # A write interrupted half way would break the whole stream: a cancel during it lets it finish.
        send = asyncio.ensure_future(self._write(stream, req))
        stream.writes.add(send)
        send.add_done_callback(stream.writes.discard)
        try:
            await asyncio.shield(send)
        except (grpc.RpcError, asyncio.InvalidStateError) as e:
            _drop(stream, rid)
            self._retire(slot, stream)
            if self._closed:
                raise _closed() from None
            error = _stream_error(e) if isinstance(e, grpc.RpcError) else \
                LogitServeError(grpc.StatusCode.UNAVAILABLE, "stream closed")
            raise Resendable(error) if error.code == grpc.StatusCode.UNAVAILABLE else error from None
        except asyncio.CancelledError:
            _drop(stream, rid)
            if self._closed and send.cancelled():    # close() stopped the write: the request ends "client closed"
                raise _closed() from None
            send.add_done_callback(lambda t: t.exception() is None and asyncio.ensure_future(self._cancel(stream, rid)))
            raise
        try:
            return await fut
        except asyncio.CancelledError:
            await self._cancel(stream, rid)
            raise
        except LogitServeError as e:
            if e.code == grpc.StatusCode.UNAVAILABLE and assembly.received == 0:
                self._retire(slot, stream)       # a draining or lost replica: the next try opens a new stream
                raise Resendable(e) from None
            raise
        finally:
            stream.pending.pop(rid, None)

    def _retire(self, slot: int, stream: _Stream) -> None:
        if self._streams[slot] is stream:
            self._streams[slot] = None
            if stream.usable and stream.pending:
                self._retired.add(stream)        # let its other requests finish there
            elif stream.usable:
                stream.call.cancel()

    async def _write(self, stream: _Stream, req: pb.ForwardRequest) -> None:
        async with stream.write_lock:
            await stream.call.write(req)

    async def _cancel(self, stream: _Stream, rid: str) -> None:
        """Tell the server, so the request's queued work is dropped and its memory freed."""
        if stream.usable:
            try:
                await asyncio.shield(self._write(stream, pb.ForwardRequest(request_id=rid, cancel=True)))
            except (grpc.RpcError, asyncio.InvalidStateError, asyncio.CancelledError):
                pass

    async def _stream(self, slot: int) -> _Stream:
        async with self._open_lock:
            stream = self._streams[slot]
            if stream is None or not stream.usable:
                stream = _Stream(self._stub.Forward(metadata=self._metadata))
                stream.reader = asyncio.create_task(self._read(stream))
                self._streams[slot] = stream
            return stream

    async def _read(self, stream: _Stream) -> None:
        error = LogitServeError(grpc.StatusCode.UNAVAILABLE, "the stream ended before the request completed")
        try:
            while True:
                resp = await stream.call.read()
                if resp is grpc.aio.EOF:
                    break
                self._dispatch(stream, resp)
        except grpc.RpcError as e:
            error = _stream_error(e)
        except asyncio.CancelledError:
            error = _closed()
        finally:
            self._retired.discard(stream)
            for _, fut in list(stream.pending.values()):
                if not fut.done():
                    fut.set_exception(error)

    def _dispatch(self, stream: _Stream, resp: pb.ForwardResponse) -> None:
        entry = stream.pending.get(resp.request_id)
        if entry is None or entry[1].done():
            return  # a request this client gave up on
        assembly, fut = entry
        kind = resp.WhichOneof("body")
        try:
            if kind == "chunk":
                assembly.add(resp.chunk)
            elif kind == "done":
                fut.set_result(assembly.finish(resp.done))
            elif kind == "error":
                fut.set_exception(LogitServeError.from_code(resp.error.code, resp.error.message))
        except LogitServeError as e:
            fut.set_exception(e)


def _closed() -> LogitServeError:
    """What a request of a closed client ends with (a new exception each time: one raised in many tasks would
    gather their tracebacks)."""
    return LogitServeError(grpc.StatusCode.CANCELLED, "client closed")


def _drop(stream: _Stream, rid: str) -> None:
    """Forget a request whose answer no one will await; an error its stream already set on it counts as seen."""
    entry = stream.pending.pop(rid, None)
    if entry is not None and entry[1].done() and not entry[1].cancelled():
        entry[1].exception()


# What grpc.aio sets as the call's status when a write finds the call already ended in gRPC core.
_CORE_WRITE_FAILURE = "Internal error from Core"


def _stream_error(e: grpc.RpcError) -> LogitServeError:
    """A stream-level failure as the client reports it. grpc.aio turns a write onto a call that the server
    or the connection has just ended into INTERNAL "Internal error from Core", hiding the status the server
    sent; that is a lost stream, reported (and retried) as UNAVAILABLE."""
    error = LogitServeError.from_rpc(e)
    if error.code == grpc.StatusCode.INTERNAL and error.details.startswith(_CORE_WRITE_FAILURE):
        return LogitServeError(grpc.StatusCode.UNAVAILABLE, f"the stream ended while a request was being sent "
                                                           f"({error.details})")
    return error


class Resendable(Exception):
    """A request's UNAVAILABLE before any of its data arrived: safe to send again (outputs are pure)."""

    def __init__(self, error: LogitServeError):
        super().__init__(str(error))
        self.error = error


async def resending(send, retries: int):
    """`await send(attempt)` for attempt 0, 1, ... until it returns or raises anything but Resendable; after
    `retries` resends the last Resendable's error. The one resend loop: AsyncTeacherClient resends on a fresh
    stream of its channel, TeacherPool on another replica."""
    for attempt in itertools.count():
        try:
            return await send(attempt)
        except Resendable as e:
            if attempt >= retries:
                raise e.error from None
            await asyncio.sleep(min(2.0, 0.1 * 2 ** attempt))
