"""The native gRPC servicer: Forward streams decoded into the request pipeline, pieces encoded as chunks. No math."""
from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from logitserve.errors import InvalidRequest, NotSupported
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

from . import codec
from .head_rpc import HeadLimits, HeadRpc
from .metrics import account
from .requests import Decoded, Pipeline
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
        """The lm_head in bands, under download slots and a stall bound (server/head_rpc.py)."""
        await self._head.serve(request, context, self._pipeline.clients.of_grpc(context), self._pipeline.draining)

    async def Forward(self, request_iterator, context):
        client = self._pipeline.clients.of_grpc(context)
        refusal = self._pipeline.stream_refusal(len(self._streams), client)
        if refusal is not None:       # a generator RPC ends with a status this way (abort() here gives INTERNAL)
            context.set_code(refusal[0])
            context.set_details(refusal[1])
            return
        try:
            async with contextlib.aclosing(self._stream(request_iterator, context, client)) as items:
                async for item in items:
                    yield item
        finally:
            self._pipeline.clients.close_stream(client)

    async def _stream(self, request_iterator, context, client: str):
        out: asyncio.Queue = asyncio.Queue()
        window = asyncio.Semaphore(STREAM_WINDOW)
        in_flight: dict[str, asyncio.Task] = {}
        cancel_requested: set[str] = set()
        tasks: set[asyncio.Task] = set()
        pipeline = self._pipeline

        async def emit(msg) -> None:
            await window.acquire()
            out.put_nowait(msg)

        broken: list[tuple] = []    # (code, why) the stream ends early: an undecodable message, idle too long
        last_seen = [time.monotonic()]   # when the last request message arrived

        async def read() -> None:
            async for req in request_iterator:
                last_seen[0] = time.monotonic()
                if isinstance(req, codec.Undecodable):   # framing is intact, but no request id to answer under
                    broken.append((grpc.StatusCode.INVALID_ARGUMENT, f"a ForwardRequest message of {req.size} bytes "
                                   f"could not be decoded ({req.error}); the stream ends after the requests "
                                   f"already in flight"))
                    return
                rid = req.request_id
                too_long = codec.request_id_error(rid)
                if too_long is not None:   # refused before anything else; logged by its first bytes only
                    if not req.cancel:
                        await emit(codec.encode_error(codec.echoed_id(rid), grpc.StatusCode.INVALID_ARGUMENT,
                                                      too_long))
                        account(pipeline.metrics, codec.shown_id(rid), None, grpc.StatusCode.INVALID_ARGUMENT, 0.0)
                    continue
                if req.cancel:
                    if rid in in_flight:
                        cancel_requested.add(rid)
                        in_flight[rid].cancel()
                    continue
                if rid in in_flight:
                    code, message = to_status(InvalidRequest("request_id", f"{rid!r} is already in flight on this stream"))
                    await emit(codec.encode_error(rid, code, message))
                    continue
                refusal = pipeline.request_refusal(len(in_flight))
                if refusal is not None:
                    await emit(codec.encode_error(rid, *refusal))
                    continue
                task = asyncio.create_task(self._serve_one(req, emit, in_flight, cancel_requested, client))
                in_flight[rid] = task
                tasks.add(task)
                pipeline.add_task(task)      # now, not when it starts: a drain beginning meanwhile sees it
                task.add_done_callback(lambda t: (tasks.discard(t), out.put_nowait(_FINISHED)))

        # Done-callbacks run after a task is done, so each _FINISHED sees the state it announces.
        reader = asyncio.create_task(read())
        reader.add_done_callback(lambda _: out.put_nowait(_FINISHED))
        self._streams.add(out)
        idle_s = pipeline.clients.limits.stream_idle_s
        try:
            while True:
                if tasks or not out.empty():
                    item = await out.get()
                else:          # nothing in flight: the stream may sit idle this long, then it is closed
                    try:
                        item = await asyncio.wait_for(out.get(), idle_s)
                    except TimeoutError:
                        if tasks or time.monotonic() - last_seen[0] < idle_s:   # a request came meanwhile
                            continue
                        broken.append((grpc.StatusCode.UNAVAILABLE, f"stream idle: no request in flight for "
                                       f"{idle_s:g} s (the server's --stream-idle-s); open a new stream"))
                        break
                if item is _FINISHED:
                    if (reader.done() or pipeline.draining) and not tasks and out.empty():
                        break
                    continue
                window.release()
                yield item
            if broken:
                context.set_code(broken[0][0])
                context.set_details(broken[0][1])
        finally:
            self._streams.discard(out)
            reader.cancel()
            for t in list(tasks):
                t.cancel()

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

    async def _serve_one(self, req: pb.ForwardRequest, emit, in_flight: dict, cancel_requested: set,
                         client: str) -> None:
        rid = req.request_id
        n = 0
        metrics = self._pipeline.metrics

        async def send(msg) -> None:
            if metrics is not None:
                metrics.bytes_sent.inc(msg.ByteSize())
            await emit(msg)

        async def sink(piece) -> None:
            nonlocal n
            for msg in codec.encode_piece(rid, piece, self._max_message_bytes):
                await send(msg)
                n += 1

        try:
            outcome = await self._pipeline.run(rid, client, lambda: self._decode(req, client), sink)
            if outcome.ok:
                await send(codec.encode_done(rid, outcome.job, self._identity, n, self._info.batching, outcome.shared))
            else:
                await send(codec.encode_error(rid, outcome.status, outcome.message))
        except asyncio.CancelledError:
            if rid in cancel_requested:   # a cancel message, not the stream closing: say so, then end quietly
                cancel_requested.discard(rid)
                await send(codec.encode_error(rid, grpc.StatusCode.CANCELLED, f"request {rid!r} cancelled by the client"))
                return
            raise
        finally:
            in_flight.pop(rid, None)
