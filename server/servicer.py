"""The gRPC servicer: decode, validate, hand to the scheduler, encode. No math here."""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import grpc

from logitserve.engine import SharedTokens
from logitserve.errors import InvalidRequest, NotSupported, OverLimit
from logitserve.validate import validate_job
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

from . import codec
from .admission import ClientLimits, Clients, client_of
from .metrics import account
from .scheduler import Scheduler
from .status import to_status

_FINISHED = object()
# Response messages a stream may have queued ahead of the network: bounds memory per slow client.
STREAM_WINDOW = 8
SHUTTING_DOWN = "the server is shutting down; retry on another replica"
ENDED_BY_SHUTDOWN = ("the server shut down before this request finished (its --grace-s ran out); "
                     "retry on another replica")
# Peak bytes tokenizing holds per byte of text (fast tokenizers' offsets and encodings: ~100x measured on the demo
# tokenizer, 4 MiB of text), reserved in the memory budget while a request's texts are tokenized.
TOKENIZE_BYTES_PER_TEXT_BYTE = 128


@dataclass(frozen=True)
class StreamLimits:
    """Per-request and per-stream bounds, refused with RESOURCE_EXHAUSTED naming the flag."""

    max_sequences: int = 4096            # sequences in one request (--max-sequences-per-request)
    max_request_tokens: int = 1 << 20    # tokens in one request (--max-request-tokens)
    max_streams: int = 256               # Forward streams open at once, server-wide (--max-streams)
    max_in_flight: int = 256             # requests in flight on one stream (--max-in-flight-per-stream)
    max_text_bytes: int = 1 << 20        # UTF-8 bytes of one request's texts, checked before tokenizing (--max-text-bytes)
    max_response_bytes: int = 1 << 30    # bytes of one request's outputs, checked before it runs (--max-response-bytes)


def add_to(servicer: "LogitServeServicer", gate) -> None:
    """Register the native service on the gate; Forward's messages are decoded leniently (codec.Undecodable)
    so that an undecodable one ends its stream with INVALID_ARGUMENT, not with a silent OK."""
    pb_grpc.add_LogitServeServicer_to_server(servicer, gate)
    gate.override("logitserve.v1.LogitServe", "Forward", grpc.stream_stream_rpc_method_handler(
        servicer.Forward, request_deserializer=codec.decode_forward_request,
        response_serializer=pb.ForwardResponse.SerializeToString))


class LogitServeServicer(pb_grpc.LogitServeServicer):
    def __init__(self, scheduler: Scheduler, info: pb.ModelInfoResponse, limits, max_message_bytes: int,
                 text=None, metrics=None, stream_limits: StreamLimits = StreamLimits(),
                 client_limits: ClientLimits = ClientLimits()):
        self._stream_limits = stream_limits
        self.clients = Clients(client_limits)
        self._streams: set[asyncio.Queue] = set()     # each open stream's outbox
        self._requests: set[asyncio.Task] = set()     # every stream's requests in flight
        self._draining = False
        self._ending = False                          # past the grace period: in-flight requests get UNAVAILABLE
        self._shared_total = 0                        # prompt tokens computed once instead of per sequence
        self._scheduler = scheduler
        self._metrics = metrics    # metrics.Metrics, or None
        self._text = text          # tokenizing.TextEncoder, or None: texts are refused
        self._info = info
        self._identity = codec.identity_of(info)
        self._limits = limits
        self._max_message_bytes = max_message_bytes

    async def ModelInfo(self, request, context):
        info = pb.ModelInfoResponse()
        info.CopyFrom(self._info)
        info.shared_prefix_tokens = self._shared_total
        return info

    async def Detokenize(self, request, context):
        from logitserve.tokenizing import detokenize

        try:
            if self._text is None:
                raise NotSupported("ids", "this model directory ships no tokenizer")
            tokens, texts, unk = detokenize(self._text, list(request.ids), self._info.vocab_size)
        except Exception as e:   # noqa: BLE001 (its status, in one place)
            await context.abort(*to_status(e))
        return pb.DetokenizeResponse(tokens=tokens, texts=texts, unk_token_id=unk)

    def count_shared(self, tokens: int) -> None:
        """Prompt tokens a request did not compute thanks to a shared prefix (ModelInfo's total, a counter)."""
        self._shared_total += tokens
        if self._metrics is not None:
            self._metrics.shared_prefix_tokens.inc(tokens)

    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self) -> None:
        """Shutting down: new requests get UNAVAILABLE; each stream ends once its in-flight requests are done."""
        self._draining = True
        for out in self._streams:
            out.put_nowait(_FINISHED)

    def in_flight(self) -> int:
        return len(self._requests)

    @property
    def ending(self) -> bool:
        return self._ending

    @property
    def max_message_bytes(self) -> int:
        return self._max_message_bytes

    @property
    def max_sequences(self) -> int:
        """--max-sequences-per-request, for front-ends that must check it before building per-sequence state."""
        return self._stream_limits.max_sequences

    @contextlib.contextmanager
    def tracking(self, client: str):
        """The current task counts as a request in flight of `client`, on either API (drained and ended on
        shutdown); OverLimit past the client's --max-in-flight-per-client."""
        refusal = self.clients.start(client)
        if refusal is not None:
            raise OverLimit(refusal)
        task = asyncio.current_task()
        self._requests.add(task)
        try:
            yield
        finally:
            self._requests.discard(task)
            self.clients.end(client)

    def end_in_flight(self) -> None:
        """Past the grace period: every request still running ends now with UNAVAILABLE (its stream then ends)."""
        self._ending = True
        for task in list(self._requests):
            task.cancel()

    async def Forward(self, request_iterator, context):
        refusal = ((grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN) if self._draining else
                   (grpc.StatusCode.RESOURCE_EXHAUSTED, f"streams: {len(self._streams)} open, the server's "
                    f"--max-streams is {self._stream_limits.max_streams}; retry later or share a stream")
                   if len(self._streams) >= self._stream_limits.max_streams else None)
        client = client_of(context)
        if refusal is None:
            mine = self.clients.open_stream(client)
            refusal = None if mine is None else (grpc.StatusCode.RESOURCE_EXHAUSTED, mine)
        if refusal is not None:       # a generator RPC ends with a status this way (abort() here gives INTERNAL)
            context.set_code(refusal[0])
            context.set_details(refusal[1])
            return
        try:
            async with contextlib.aclosing(self._stream(request_iterator, context, client)) as items:
                async for item in items:
                    yield item
        finally:
            self.clients.close_stream(client)

    async def _stream(self, request_iterator, context, client: str):
        out: asyncio.Queue = asyncio.Queue()
        window = asyncio.Semaphore(STREAM_WINDOW)
        in_flight: dict[str, asyncio.Task] = {}
        cancel_requested: set[str] = set()
        tasks: set[asyncio.Task] = set()

        async def emit(msg) -> None:
            await window.acquire()
            out.put_nowait(msg)

        broken: list[tuple] = []    # (code, why) the stream ends early: an undecodable message, idle too long

        async def read() -> None:
            async for req in request_iterator:
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
                        account(self._metrics, codec.shown_id(rid), None, grpc.StatusCode.INVALID_ARGUMENT, 0.0)
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
                refusal = self._refusal(len(in_flight))
                if refusal is not None:
                    await emit(codec.encode_error(rid, *refusal))
                    continue
                task = asyncio.create_task(self._serve_one(req, emit, in_flight, cancel_requested, client))
                in_flight[rid] = task
                tasks.add(task)
                self._requests.add(task)      # now, not when it starts: a drain beginning meanwhile sees it
                task.add_done_callback(lambda t: (tasks.discard(t), self._requests.discard(t),
                                                  out.put_nowait(_FINISHED)))

        # Done-callbacks run after a task is done, so each _FINISHED sees the state it announces.
        reader = asyncio.create_task(read())
        reader.add_done_callback(lambda _: out.put_nowait(_FINISHED))
        self._streams.add(out)
        idle_s = self.clients.limits.stream_idle_s
        try:
            while True:
                if tasks or not out.empty():
                    item = await out.get()
                else:          # nothing in flight: the stream may sit idle this long, then it is closed
                    try:
                        item = await asyncio.wait_for(out.get(), idle_s)
                    except TimeoutError:
                        broken.append((grpc.StatusCode.UNAVAILABLE, f"stream idle: no request in flight for "
                                       f"{idle_s:g} s (the server's --stream-idle-s); open a new stream"))
                        break
                if item is _FINISHED:
                    if (reader.done() or self._draining) and not tasks and out.empty():
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

    def _refusal(self, in_flight: int):
        """(code, message) when a new request on a stream must be refused before it is decoded."""
        if self._draining:
            return grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN
        if in_flight >= self._stream_limits.max_in_flight:
            return (grpc.StatusCode.RESOURCE_EXHAUSTED, f"requests in flight: {in_flight} on this stream, the "
                    f"server's --max-in-flight-per-stream is {self._stream_limits.max_in_flight}")
        return None

    def check_size(self, job) -> None:
        """OverLimit when a request is over --max-sequences-per-request or --max-request-tokens."""
        lim = self._stream_limits
        if len(job.sequences) > lim.max_sequences:
            raise OverLimit(f"sequences: {len(job.sequences)} in this request is over the server's "
                            f"--max-sequences-per-request {lim.max_sequences}")
        if job.num_tokens > lim.max_request_tokens:
            raise OverLimit(f"sequences: {job.num_tokens} tokens in this request is over the server's "
                            f"--max-request-tokens {lim.max_request_tokens}")

    def check_cost(self, job):
        """The validated request's Cost (for Scheduler.stream); OverLimit when its answer is over
        --max-response-bytes (before anything runs)."""
        cost = self._scheduler.cost(job)
        limit = self._stream_limits.max_response_bytes
        if cost is not None and cost.output_bytes > limit:
            raise OverLimit(f"outputs: this request's answer would be {cost.output_bytes / 2**20:.0f} MiB, over the "
                            f"server's --max-response-bytes {limit / 2**20:.0f} MiB; ask for fewer sequences, a "
                            f"smaller k or a smaller full-logits slice per request")
        return cost

    async def _tokenize(self, req: pb.ForwardRequest, client: str) -> tuple:
        """The texts' ids; their size is checked and their tokenizing's memory reserved before it runs."""
        if req.sequences:
            raise InvalidRequest("texts", "set either sequences (token ids) or texts, not both")
        if self._text is None:
            raise NotSupported("texts", "this model directory ships no tokenizer; send token ids in sequences")
        size = sum(len(t.encode()) for t in req.texts)
        limit = self._stream_limits.max_text_bytes
        if size > limit:
            raise OverLimit(f"texts: {size} UTF-8 bytes in this request is over the server's --max-text-bytes "
                            f"{limit}; send fewer or shorter texts per request, or token ids")
        special = req.add_special_tokens if req.HasField("add_special_tokens") else True
        with self._scheduler.holding(client, size * TOKENIZE_BYTES_PER_TEXT_BYTE, f"tokenizing {size} bytes of text"):
            return await asyncio.to_thread(self._text.encode, req.texts, special)   # Rust tokenizers free the GIL

    async def _serve_one(self, req: pb.ForwardRequest, emit, in_flight: dict, cancel_requested: set,
                         client: str) -> None:
        rid = req.request_id
        started, job, status = time.monotonic(), None, grpc.StatusCode.OK
        if self._metrics is not None:
            plain = emit

            async def emit(msg):
                self._metrics.bytes_sent.inc(msg.ByteSize())
                await plain(msg)
        try:
            with self.tracking(client):    # --max-in-flight-per-client, as KServe's calls
                ids = await self._tokenize(req, client) if req.texts else None
                job = codec.decode_job(req, ids)
                self.check_size(job)
                try:
                    validate_job(job, self._limits)
                except InvalidRequest as e:   # name the text, not the sequence it became
                    if ids is None or not e.field.startswith("sequences["):
                        raise
                    raise InvalidRequest(e.field.replace("sequences", "texts", 1) + " (tokenized)",
                                         str(e).split(": ", 1)[1]) from None
                cost = self.check_cost(job)
                timeout = req.timeout_s if req.HasField("timeout_s") else None
                if timeout is not None and not timeout > 0:
                    raise InvalidRequest("timeout_s", f"{timeout} must be > 0")
                shared = 0
                async with asyncio.timeout(timeout):
                    n = 0
                    for piece in codec.input_id_pieces(ids) if ids is not None else ():
                        for msg in codec.encode_piece(rid, piece, self._max_message_bytes):
                            await emit(msg)
                            n += 1
                    async for piece in self._scheduler.stream(job, client, cost=cost):
                        if isinstance(piece, SharedTokens):
                            shared += piece.tokens
                            self.count_shared(piece.tokens)
                            continue
                        for msg in codec.encode_piece(rid, piece, self._max_message_bytes):
                            await emit(msg)
                            n += 1
                await emit(codec.encode_done(rid, job, self._identity, n, self._info.batching, shared))
        except asyncio.CancelledError:
            status = grpc.StatusCode.CANCELLED
            if self._ending:    # the server's grace period is over: say so, then end quietly
                status = grpc.StatusCode.UNAVAILABLE
                await emit(codec.encode_error(rid, status, ENDED_BY_SHUTDOWN))
                return
            if rid in cancel_requested:   # a cancel message, not the stream closing: say so, then end quietly
                cancel_requested.discard(rid)
                await emit(codec.encode_error(rid, grpc.StatusCode.CANCELLED, f"request {rid!r} cancelled by the client"))
                return
            raise
        except TimeoutError:
            status = grpc.StatusCode.DEADLINE_EXCEEDED
            await emit(codec.encode_error(rid, grpc.StatusCode.DEADLINE_EXCEEDED,
                                          f"timeout_s: request {rid!r} did not finish within {req.timeout_s:g} s"))
        except Exception as e:
            status, message = to_status(e)
            await emit(codec.encode_error(rid, status, message))
        finally:
            in_flight.pop(rid, None)
            account(self._metrics, rid, job, status, time.monotonic() - started)
