"""The native gRPC servicer: Forward streams decoded into the request pipeline, pieces encoded as chunks. No math."""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Optional

import grpc

from logitserve.errors import InvalidRequest, LogitServeError, NotSupported
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

from . import codec
from .head_rpc import HeadLimits, HeadRpc
from .metrics import account
from .requests import Decoded, Failed, Pipeline
from .status import to_status

_FINISHED = object()
# Response messages a stream may have queued ahead of the network: bounds memory per slow client.
STREAM_WINDOW = 8


def add_to(servicer: "LogitServeServicer", gate) -> None:
    """Register the native service on the gate; Forward's messages are decoded leniently (codec.Undecodable)
    so that an undecodable one ends its stream with INVALID_ARGUMENT, not with a silent OK."""
    pb_grpc.add_LogitServeServicer_to_server(servicer, gate)
    gate.override("logitserve.v1.LogitServe", "Forward", grpc.stream_stream_rpc_method_handler(
        servicer.Forward, request_deserializer=codec.decode_forward_request,
        response_serializer=pb.ForwardResponse.SerializeToString))


class LogitServeServicer(pb_grpc.LogitServeServicer):
    """Forward streams: each request through the shared pipeline, its pieces encoded as chunk messages."""

    def __init__(self, pipeline: Pipeline, info: pb.ModelInfoResponse, max_message_bytes: int, head=None,
                 head_limits: HeadLimits = HeadLimits()):
        """`head`: the logitserve.head_export.HeadSource the Head RPC sends; None for reward models."""
        self._pipeline = pipeline
        self._head = HeadRpc(head, info.content_hash, max_message_bytes, head_limits)
        self._streams: set[asyncio.Queue] = set()     # each open stream's outbox
        self._info = info
        self._identity = codec.identity_of(info)
        self._max_message_bytes = max_message_bytes
        pipeline.on_drain(self._end_streams)

    def _end_streams(self) -> None:
        """Draining: each stream ends once its in-flight requests are done."""
        for out in self._streams:
            out.put_nowait(_FINISHED)

    async def ModelInfo(self, request, context):
        info = pb.ModelInfoResponse()
        info.CopyFrom(self._info)
        info.shared_prefix_tokens = self._pipeline.shared_total
        return info

    async def Detokenize(self, request, context):
        from logitserve.tokenizing import detokenize

        try:
            if self._pipeline.text is None:
                raise NotSupported("ids", "this model directory ships no tokenizer")
            tokens, texts, unk = detokenize(self._pipeline.text, request.ids, self._info.vocab_size)   # len() first
        except Exception as e:   # noqa: BLE001 (its status, in one place)
            await context.abort(*to_status(e))
        return pb.DetokenizeResponse(tokens=tokens, texts=texts, unk_token_id=unk)

    async def Head(self, request, context):
        """The lm_head in bands, admitted as Forward's requests are (draining, in flight per client), then under
        download slots and a stall bound (server/head_rpc.py)."""
        await self._head.serve(request, context, self._pipeline.clients.of_grpc(context), self._pipeline.admitted)

    async def Forward(self, request_iterator, context):
        client = self._pipeline.clients.of_grpc(context)
        try:
            self._pipeline.open_stream(len(self._streams), client)
        except LogitServeError as e:   # a generator RPC ends with a status this way (abort() here gives INTERNAL)
            code, message = to_status(e)
            context.set_code(code)
            context.set_details(message)
        else:
            try:
                async with contextlib.aclosing(self._stream(request_iterator, context, client)) as items:
                    async for item in items:
                        yield item
            finally:
                self._pipeline.clients.close_stream(client)

    async def _stream(self, request_iterator, context, client: str):
        """The stream's messages as its requests produce them; its status set when it ends early."""
        s = _Stream(self._pipeline, client)
        reader = asyncio.create_task(self._read(request_iterator, s))
        reader.add_done_callback(s.finished)     # after the task is done: each _FINISHED sees what it announces
        self._streams.add(s.out)
        try:
            async with contextlib.aclosing(s.messages(reader)) as messages:
                async for msg in messages:
                    yield msg
            if s.broken is not None:
                context.set_code(s.broken[0])
                context.set_details(s.broken[1])
        finally:
            self._streams.discard(s.out)
            reader.cancel()
            for t in list(s.tasks):
                t.cancel()

    async def _read(self, request_iterator, s: "_Stream") -> None:
        """Each request message taken as it arrives, until the client half-closes or one cannot be decoded."""
        async for req in request_iterator:
            s.last_seen = time.monotonic()
            if isinstance(req, codec.Undecodable):   # framing is intact, but no request id to answer under
                s.broken = (grpc.StatusCode.INVALID_ARGUMENT, f"a ForwardRequest message of {req.size} bytes could "
                            f"not be decoded ({req.error}); the stream ends after the requests already in flight")
                break
            await self._take(req, s)

    async def _take(self, req: pb.ForwardRequest, s: "_Stream") -> None:
        """One request message: a cancel, a refusal answered at once, or a request started on its own task."""
        rid = req.request_id
        too_long = codec.request_id_error(rid)
        refusal = None
        if too_long is not None:        # refused before anything else; logged by its first bytes only
            if not req.cancel:
                await s.emit(codec.encode_error(codec.echoed_id(rid), grpc.StatusCode.INVALID_ARGUMENT, too_long))
                account(self._pipeline.metrics, codec.shown_id(rid), None, grpc.StatusCode.INVALID_ARGUMENT, 0.0)
        elif req.cancel:
            s.cancel(rid)
        elif rid in s.in_flight:
            refusal = to_status(InvalidRequest("request_id", f"{rid!r} is already in flight on this stream"))
        else:
            try:
                self._pipeline.check_request(len(s.in_flight))
                s.start(rid, self._serve_one(req, s))
            except LogitServeError as e:
                refusal = to_status(e)
        if refusal is not None:
            await s.emit(codec.encode_error(rid, *refusal))

    async def _decode(self, req: pb.ForwardRequest, client: str) -> Decoded:
        ids = offsets = None
        self._pipeline.check_rows(len(req.texts) or len(req.sequences), "texts" if req.texts else "sequences")
        if req.texts:
            if req.sequences:
                raise InvalidRequest("texts", "set either sequences (token ids) or texts, not both")
            special = req.add_special_tokens if req.HasField("add_special_tokens") else True
            ids = await self._pipeline.tokenize(list(req.texts), special, client, offsets=req.input_offsets)
            if req.input_offsets:
                ids, offsets = ids
        return Decoded(codec.decode_job(req, ids), req.timeout_s if req.HasField("timeout_s") else None,
                       text_ids=ids, text_offsets=offsets)

    async def _serve_one(self, req: pb.ForwardRequest, s: "_Stream") -> None:
        """One request: decoded, run through the pipeline, each piece sent as chunk messages, then its done or
        error message."""
        rid, n = req.request_id, 0
        try:
            async with self._pipeline.request(rid, s.client) as r:
                decoded = await self._decode(req, s.client)
                async for piece in r.run(decoded):
                    for msg in codec.encode_piece(rid, piece, self._max_message_bytes):
                        await s.send(msg)
                        n += 1
            await s.send(codec.encode_done(rid, r.outcome.job, self._identity, n, self._info.batching, r.shared))
        except Failed as f:
            await s.send(codec.encode_error(rid, f.outcome.status, f.outcome.message))
        except asyncio.CancelledError:
            if not s.cancelled_by_client(rid):   # the stream closing, or the server stopping: no message
                raise
            await s.send(codec.encode_error(rid, grpc.StatusCode.CANCELLED, f"request {rid!r} cancelled by the client"))
        finally:
            s.in_flight.pop(rid, None)


class _Stream:
    """One Forward stream's state: its outbox (at most STREAM_WINDOW messages ahead of the network), its
    requests in flight by id, and why it ended early."""

    def __init__(self, pipeline: Pipeline, client: str):
        self._pipeline = pipeline
        self.client = client
        self.out: asyncio.Queue = asyncio.Queue()
        self._window = asyncio.Semaphore(STREAM_WINDOW)
        self.in_flight: dict[str, asyncio.Task] = {}
        self.tasks: set[asyncio.Task] = set()         # the request tasks, until each is done
        self._cancel_requested: set[str] = set()
        self.broken: Optional[tuple[grpc.StatusCode, str]] = None   # the stream ends early: code and why
        self.last_seen = time.monotonic()             # when the last request message arrived

    async def emit(self, msg) -> None:
        await self._window.acquire()
        self.out.put_nowait(msg)

    async def send(self, msg) -> None:
        """A request's message, counted in the bytes-sent metric."""
        if self._pipeline.metrics is not None:
            self._pipeline.metrics.bytes_sent.inc(msg.ByteSize())
        await self.emit(msg)

    def finished(self, task: Optional[asyncio.Task] = None) -> None:
        """A task of the stream is done: the outbox loop looks whether the stream is over."""
        if task is not None:
            self.tasks.discard(task)
        self.out.put_nowait(_FINISHED)

    def start(self, rid: str, serve) -> None:
        """A request on its own task; in flight (and seen by a drain) from now, not from when it starts."""
        task = asyncio.create_task(serve)
        self.in_flight[rid] = task
        self.tasks.add(task)
        self._pipeline.add_task(task)
        task.add_done_callback(self.finished)

    def cancel(self, rid: str) -> None:
        """The client's cancel message: the request ends with CANCELLED (an unknown id is ignored)."""
        if rid in self.in_flight:
            self._cancel_requested.add(rid)
            self.in_flight[rid].cancel()

    def cancelled_by_client(self, rid: str) -> bool:
        """Whether `rid` was cancelled by the client's cancel message (asked once: the answer is then forgotten)."""
        asked = rid in self._cancel_requested
        self._cancel_requested.discard(rid)
        return asked

    async def messages(self, reader: asyncio.Task):
        """The outbox's messages until the reader and every request are done (or draining and idle), or the
        stream sat idle past --stream-idle-s."""
        while (item := await self._next()) is not None:
            if item is not _FINISHED:
                self._window.release()
                yield item
            elif (reader.done() or self._pipeline.draining) and not self.tasks and self.out.empty():
                break

    async def _next(self):
        """The next outbox item; None once nothing is in flight and no request came for --stream-idle-s."""
        idle_s = self._pipeline.clients.limits.stream_idle_s
        item, idle = None, False
        while item is None and not idle:
            if self.tasks or not self.out.empty():
                item = await self.out.get()
                continue
            with contextlib.suppress(TimeoutError):    # nothing in flight: the stream may sit idle this long
                item = await asyncio.wait_for(self.out.get(), idle_s)
            idle = item is None and not self.tasks and time.monotonic() - self.last_seen >= idle_s
        if idle and self.broken is None:
            self.broken = (grpc.StatusCode.UNAVAILABLE, f"stream idle: no request in flight for {idle_s:g} s (the "
                           f"server's --stream-idle-s); open a new stream")
        return item
