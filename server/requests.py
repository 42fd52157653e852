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
from typing import AsyncGenerator, AsyncIterator, Callable, Iterator, Optional

import grpc

from logitserve.cost import Cost
from logitserve.engine import Piece, SharedTokens
from logitserve.errors import InvalidRequest, NotSupported, OverLimit, TooLarge, Unavailable
from logitserve.spec import Job
from logitserve.validate import resolve_job

from . import codec
from .admission import ClientLimits, Clients
from .config import StreamLimits
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


class Failed(Exception):
    """A request ended without an answer: its Outcome (status, message, the field it names)."""

    def __init__(self, outcome: Outcome):
        super().__init__(outcome.message)
        self.outcome = outcome


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
    def open_stream(self, open_streams: int, client: str) -> None:
        """A new stream of `client` (close it with clients.close_stream); Unavailable while draining, OverLimit
        past --max-streams or --max-streams-per-client."""
        if self._draining:
            raise Unavailable(SHUTTING_DOWN)
        limit = self.stream_limits.max_streams
        if open_streams >= limit:
            raise OverLimit(f"streams: {open_streams} open, the server's --max-streams is {limit}; retry later or "
                            f"share a stream")
        mine = self.clients.open_stream(client)
        if mine is not None:
            raise OverLimit(mine)

    def check_request(self, in_flight_on_stream: int) -> None:
        """A new request on a stream, before it is decoded: Unavailable while draining, OverLimit past
        --max-in-flight-per-stream."""
        if self._draining:
            raise Unavailable(SHUTTING_DOWN)
        limit = self.stream_limits.max_in_flight
        if in_flight_on_stream >= limit:
            raise OverLimit(f"requests in flight: {in_flight_on_stream} on this stream, the server's "
                            f"--max-in-flight-per-stream is {limit}")

    @contextlib.contextmanager
    def admitted(self, client: str) -> Iterator[None]:
        """The current task counts as a request in flight of `client` (drained and ended on shutdown);
        Unavailable while draining, OverLimit past --max-in-flight-per-client or --max-in-flight."""
        if self._draining:
            raise Unavailable(SHUTTING_DOWN)
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

    def _check_cost(self, cost: Optional[Cost]) -> None:
        """TooLarge when the validated request's answer is over --max-response-bytes."""
        limit = self.stream_limits.max_response_bytes
        if cost is not None and cost.output_bytes > limit:
            raise TooLarge(f"outputs: this request's answer would be {cost.output_bytes / 2**20:.0f} MiB, over the "
                           f"server's --max-response-bytes {limit / 2**20:.0f} MiB; ask for fewer sequences, a "
                           f"smaller k or a smaller full-logits slice per request")

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

    @contextlib.asynccontextmanager
    async def request(self, rid: str, client: str) -> AsyncIterator["Request"]:
        """One request of `client`: admitted, tracked and logged. The block either ends with `r.outcome` OK or
        raises Failed with the Outcome of whatever went wrong in it (a refusal skips the block). Cancellation
        propagates (after its access-log line) unless the grace period ended it: Failed with UNAVAILABLE."""
        r = Request(self, rid, client)
        started = time.monotonic()
        try:
            with self.admitted(client):
                async with asyncio.timeout(None) as r.deadline, contextlib.aclosing(r):
                    yield r
            r.outcome = Outcome(grpc.StatusCode.OK, job=r.job, shared=r.shared)
        except asyncio.CancelledError:
            if not self._ending:
                raise
            r.outcome = Outcome(grpc.StatusCode.UNAVAILABLE, ENDED_BY_SHUTDOWN, r.job)   # the grace period is over
        except Exception as e:      # noqa: BLE001 (every error becomes its status, in one place)
            r.fail(e)
        finally:
            account(self.metrics, rid, r.job, r.outcome.status if r.outcome else grpc.StatusCode.CANCELLED,
                    time.monotonic() - started)
        if not r.outcome.ok:
            raise Failed(r.outcome)


class Request:
    """One admitted request: `run(decoded)` yields its pieces (once); `outcome` says how it ended (set on leaving
    Pipeline.request)."""

    def __init__(self, pipeline: Pipeline, rid: str, client: str):
        self._pipeline = pipeline
        self.rid = rid
        self.client = client
        self.job: Optional[Job] = None
        self.shared = 0                    # prompt tokens computed once for several sequences
        self.outcome: Optional[Outcome] = None
        self.deadline: Optional[asyncio.Timeout] = None   # armed by run() with the request's timeout
        self._decoded: Optional[Decoded] = None
        self._stream: Optional[AsyncGenerator] = None     # the scheduler's stream of the job, once it is admitted

    async def run(self, decoded: Decoded) -> AsyncIterator[Piece]:
        """Check `decoded` (size, validation, cost, deadline), then yield its pieces under its deadline: INPUT_IDS
        first for texts, then the scheduler's (SharedTokens counted here, not yielded)."""
        assert self._stream is None, "one run per request"
        pipeline, self.job, self._decoded = self._pipeline, decoded.job, decoded
        pipeline._check_size(decoded.job)
        self.job = job = pipeline._validate(decoded)     # the job with the server's defaults filled in
        cost = pipeline.scheduler.cost(job)
        pipeline._check_cost(cost)
        t = decoded.timeout
        if t is not None:
            if not (t > 0 and t < float("inf")):
                raise InvalidRequest(decoded.timeout_field, f"{t} must be > 0 and finite")
            self.deadline.reschedule(asyncio.get_running_loop().time() + t)
        for piece in codec.input_id_pieces(decoded.text_ids, decoded.text_offsets):
            yield piece
        self._stream = pipeline.scheduler.stream(job, self.client, decoded.hold, cost)
        async for piece in self._stream:
            if isinstance(piece, SharedTokens):
                self.shared += piece.tokens
                pipeline.count_shared(piece.tokens)
                continue
            yield piece
        self.deadline.reschedule(None)     # done: what the front-end does next is not under the deadline

    def fail(self, e: Exception) -> None:
        """The outcome of an exception raised in the request's block; a TimeoutError of its deadline names the
        request's timeout field."""
        if isinstance(e, TimeoutError) and self.deadline is not None and self.deadline.expired():
            d = self._decoded
            self.outcome = Outcome(grpc.StatusCode.DEADLINE_EXCEEDED, f"{d.timeout_field}: request {self.rid!r} did "
                                   f"not finish within {d.timeout:g} s", self.job)
        else:
            status, message = to_status(e)
            self.outcome = Outcome(status, message, self.job, field=getattr(e, "field", None),
                                   too_large=isinstance(e, TooLarge))

    async def aclose(self) -> None:
        """The block is left: the scheduler lets go of the job now (it is dropped if it never ended), not when a
        generator left suspended is collected."""
        if self._stream is not None:
            await self._stream.aclose()
