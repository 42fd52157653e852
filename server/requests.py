"""One request pipeline for every front-end: admission, decode, validation, deadline, scheduling, status, accounting.

The native gRPC servicer, the KServe servicer and the HTTP app (vLLM, SGLang, TRL shapes) each
decode their request into a `Decoded` (a Job and its deadline) and encode the pieces; everything
between is here, once: draining, per-stream and per-client admission, size and cost limits,
tokenizing under the memory budget, validation, the deadline, the scheduler, the mapping of every
failure to its gRPC status (server/status.py) and the access log and metrics.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

import grpc

from logitserve.engine import Piece, SharedTokens
from logitserve.errors import InvalidRequest, NotSupported, OverLimit, TooLarge, Unavailable
from logitserve.spec import Job
from logitserve.validate import resolve_job

from . import codec
from .admission import ClientLimits, Clients
from .metrics import account
from .scheduler import Scheduler
from .status import to_status

SHUTTING_DOWN = "the server is shutting down; retry on another replica"
ENDED_BY_SHUTDOWN = ("the server shut down before this request finished (its --grace-s ran out); "
                     "retry on another replica")
# Peak bytes tokenizing holds per byte of text (fast tokenizers' offsets and encodings: ~100x measured on the demo
# tokenizer, 4 MiB of text), reserved in the memory budget while a request's texts are tokenized.
TOKENIZE_BYTES_PER_TEXT_BYTE = 128


@dataclass(frozen=True)
class StreamLimits:
    """Per-request and per-stream bounds, refused with RESOURCE_EXHAUSTED naming the flag (per-request sizes
    as TooLarge: permanent, HTTP 413; streams and requests in flight: retry later, HTTP 429)."""

    max_sequences: int = 4096            # sequences in one request (--max-sequences-per-request)
    max_request_tokens: int = 1 << 20    # tokens in one request (--max-request-tokens)
    max_streams: int = 256               # Forward streams open at once, server-wide (--max-streams)
    max_in_flight: int = 256             # requests in flight on one stream (--max-in-flight-per-stream)
    max_text_bytes: int = 1 << 20        # UTF-8 bytes of one request's texts, checked before tokenizing (--max-text-bytes)
    max_response_bytes: int = 1 << 30    # bytes of one request's outputs, checked before it runs (--max-response-bytes)


@dataclass(frozen=True)
class Decoded:
    """What a front-end made of a request: the Job, its deadline, and how to name its fields in errors."""

    job: Job
    timeout: Optional[float] = None      # seconds; None: no deadline
    timeout_field: str = "timeout_s"     # the request field the deadline came from
    hold: int = 0                        # bytes the front-end holds for the answer beyond the scheduler's buffer
    text_ids: Optional[tuple] = None     # ids the server tokenized the request's texts into (sent as INPUT_IDS)
    text_offsets: Optional[tuple] = None  # their UTF-8 byte spans, int32 [L, 2] each (sent as INPUT_OFFSETS)
    text_field: str = "texts"            # the request field those texts came from
    sequences_field: str = "sequences"   # the request field the token ids came from
    temperature_field: str = "temperature"   # the request field the temperature came from


@dataclass(frozen=True)
class Outcome:
    """How a request ended: OK with its job, or a status and message."""

    status: grpc.StatusCode
    message: str = ""
    job: Optional[Job] = None
    shared: int = 0                      # prompt tokens computed once for several sequences
    field: Optional[str] = None          # the request field an InvalidRequest / NotFound named
    too_large: bool = False              # refused over a fixed per-request limit (TooLarge): retrying cannot help

    @property
    def ok(self) -> bool:
        return self.status == grpc.StatusCode.OK


Sink = Callable[[Piece], Awaitable[None]]


class Pipeline:
    """Admission, validation, scheduling and status for every front-end of one server."""

    def __init__(self, scheduler: Scheduler, limits, text=None, metrics=None,
                 stream_limits: StreamLimits = StreamLimits(), client_limits: ClientLimits = ClientLimits(),
                 by_token: bool = False):
        self.scheduler = scheduler
        self.limits = limits               # the model's ModelLimits
        self.text = text                   # tokenizing.TextEncoder, or None: texts are refused
        self.metrics = metrics             # metrics.Metrics, or None
        self.stream_limits = stream_limits
        self.clients = Clients(client_limits.resolved(stream_limits.max_streams), by_token)   # by_token: --auth-token-file
        self._requests: set[asyncio.Task] = set()   # every front-end's requests in flight
        self._on_drain: list[Callable[[], None]] = []
        self._draining = False
        self._ending = False               # past the grace period: in-flight requests get UNAVAILABLE
        self.shared_total = 0              # prompt tokens computed once instead of per sequence

    # -- lifecycle ---------------------------------------------------------------------------------------------
    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def ending(self) -> bool:
        return self._ending

    def on_drain(self, callback: Callable[[], None]) -> None:
        """`callback` runs when draining starts (a front-end ends its idle streams)."""
        self._on_drain.append(callback)

    def drain(self) -> None:
        """Shutting down: new requests get UNAVAILABLE; those in flight run on for the grace period."""
        self._draining = True
        for callback in self._on_drain:
            callback()

    def in_flight(self) -> int:
        return len(self._requests)

    def end_in_flight(self) -> None:
        """Past the grace period: every request still running ends now with UNAVAILABLE."""
        self._ending = True
        for task in list(self._requests):
            task.cancel()

    def add_task(self, task: asyncio.Task) -> None:
        """A task that will run a request counts as in flight from now on (a drain beginning meanwhile sees it)."""
        self._requests.add(task)
        task.add_done_callback(self._requests.discard)

    # -- admission ---------------------------------------------------------------------------------------------
    def stream_refusal(self, open_streams: int, client: str) -> Optional[tuple[grpc.StatusCode, str]]:
        """(code, message) when a new stream must be refused, else None (the stream is then the client's:
        close it with clients.close_stream)."""
        if self._draining:
            return grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN
        limit = self.stream_limits.max_streams
        if open_streams >= limit:
            return (grpc.StatusCode.RESOURCE_EXHAUSTED, f"streams: {open_streams} open, the server's --max-streams is "
                    f"{limit}; retry later or share a stream")
        mine = self.clients.open_stream(client)
        return None if mine is None else (grpc.StatusCode.RESOURCE_EXHAUSTED, mine)

    def request_refusal(self, in_flight_on_stream: int) -> Optional[tuple[grpc.StatusCode, str]]:
        """(code, message) when a new request on a stream must be refused before it is decoded."""
        if self._draining:
            return grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN
        limit = self.stream_limits.max_in_flight
        if in_flight_on_stream >= limit:
            return (grpc.StatusCode.RESOURCE_EXHAUSTED, f"requests in flight: {in_flight_on_stream} on this stream, "
                    f"the server's --max-in-flight-per-stream is {limit}")
        return None

    @contextlib.contextmanager
    def _tracking(self, client: str):
        """The current task counts as a request in flight of `client` (drained and ended on shutdown);
        OverLimit past the client's --max-in-flight-per-client."""
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

    def check_rows(self, rows: int, field: str) -> None:
        """TooLarge for an absurd row count, before a front-end builds anything per row."""
        if rows > self.stream_limits.max_sequences:
            raise TooLarge(f"{field}: {rows} sequences in this request is over the server's "
                           f"--max-sequences-per-request {self.stream_limits.max_sequences}")

    def check_tokens(self, tokens: int, field: str = "sequences") -> None:
        """TooLarge for more tokens than --max-request-tokens; front-ends call it on the lengths a request declares,
        before they convert a list of ids."""
        limit = self.stream_limits.max_request_tokens
        if tokens > limit:
            raise TooLarge(f"{field}: {tokens} tokens in this request is over the server's --max-request-tokens "
                           f"{limit}")

    def _check_size(self, job: Job) -> None:
        self.check_rows(len(job.sequences), "sequences")
        self.check_tokens(job.num_tokens)

    def _check_cost(self, job: Job):
        """The validated request's Cost; TooLarge when its answer is over --max-response-bytes."""
        cost = self.scheduler.cost(job)
        limit = self.stream_limits.max_response_bytes
        if cost is not None and cost.output_bytes > limit:
            raise TooLarge(f"outputs: this request's answer would be {cost.output_bytes / 2**20:.0f} MiB, over the "
                           f"server's --max-response-bytes {limit / 2**20:.0f} MiB; ask for fewer sequences, a "
                           f"smaller k or a smaller full-logits slice per request")
        return cost

    async def tokenize(self, texts: list[str], add_special_tokens: bool, client: str, field: str = "texts",
                       offsets: bool = False) -> tuple:
        """The texts' ids (int32 arrays), and with `offsets` (ids, byte offsets); their size is checked and
        their tokenizing's memory reserved first."""
        if self.text is None:
            raise NotSupported(field, "this model directory ships no tokenizer; send token ids")
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        limit = self.stream_limits.max_text_bytes
        if size > limit:
            raise TooLarge(f"{field}: {size} UTF-8 bytes in this request is over the server's --max-text-bytes "
                           f"{limit}; send fewer or shorter texts per request, or token ids")
        with self.scheduler.holding(client, size * TOKENIZE_BYTES_PER_TEXT_BYTE, f"tokenizing {size} bytes of text"):
            return await asyncio.to_thread(self.text.encode, texts, add_special_tokens, offsets)   # Rust frees the GIL

    def count_shared(self, tokens: int) -> None:
        """Prompt tokens a request did not compute thanks to a shared prefix (ModelInfo's total, a counter)."""
        self.shared_total += tokens
        if self.metrics is not None:
            self.metrics.shared_prefix_tokens.inc(tokens)

    # -- the request -------------------------------------------------------------------------------------------
    def _validate(self, decoded: Decoded) -> Job:
        """The request's job, validated, with the server's defaults filled in (logitserve.validate.resolve_job)."""
        try:
            return resolve_job(decoded.job, self.limits)
        except InvalidRequest as e:   # name the request's own field: the text, not the sequence it became
            if e.field == "temperature" and decoded.temperature_field != "temperature":
                raise InvalidRequest(decoded.temperature_field, str(e).split(": ", 1)[1]) from None
            if not e.field.startswith("sequences"):
                raise
            if decoded.text_ids is not None:
                name = e.field.replace("sequences", decoded.text_field, 1) + " (tokenized)"
            elif decoded.sequences_field != "sequences":
                name = e.field.replace("sequences", decoded.sequences_field, 1)
            else:
                raise
            raise InvalidRequest(name, str(e).split(": ", 1)[1]) from None

    async def run(self, rid: str, client: str, decode: Callable[[], Awaitable[Decoded]], sink: Sink) -> Outcome:
        """Decode, admit, validate and compute one request, each piece to `sink` (INPUT_IDS first for texts).
        Every failure comes back as an Outcome; cancellation propagates (after its access-log line) unless
        the server's grace period ended it, which is an UNAVAILABLE Outcome."""
        started, job, status = time.monotonic(), None, grpc.StatusCode.OK
        try:
            with self._tracking(client):
                if self._draining:
                    raise Unavailable(SHUTTING_DOWN)
                decoded = await decode()
                job = decoded.job
                self._check_size(job)
                job = self._validate(decoded)
                cost = self._check_cost(job)
                t = decoded.timeout
                if t is not None and not (t > 0 and t < float("inf")):
                    raise InvalidRequest(decoded.timeout_field, f"{t} must be > 0 and finite")
                shared = 0
                try:
                    async with asyncio.timeout(t):
                        for piece in codec.input_id_pieces(decoded.text_ids, decoded.text_offsets):
                            await sink(piece)
                        async for piece in self.scheduler.stream(job, client, decoded.hold, cost):
                            if isinstance(piece, SharedTokens):
                                shared += piece.tokens
                                self.count_shared(piece.tokens)
                                continue
                            await sink(piece)
                except TimeoutError:
                    status = grpc.StatusCode.DEADLINE_EXCEEDED
                    return Outcome(status, f"{decoded.timeout_field}: request {rid!r} did not finish within {t:g} s",
                                   job)
                return Outcome(status, job=job, shared=shared)
        except asyncio.CancelledError:
            status = grpc.StatusCode.CANCELLED
            if self._ending:    # the grace period is over: say so
                status = grpc.StatusCode.UNAVAILABLE
                return Outcome(status, ENDED_BY_SHUTDOWN, job)
            raise
        except Exception as e:      # noqa: BLE001 (every error becomes its status, in one place)
            status, message = to_status(e)
            return Outcome(status, message, job, field=getattr(e, "field", None), too_large=isinstance(e, TooLarge))
        finally:
            account(self.metrics, rid, job, status, time.monotonic() - started)
