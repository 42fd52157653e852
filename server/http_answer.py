"""An HTTP answer inside the memory budget and off the event loop: its reservation, its encoding, its bytes sent.

gRPC requests hold their buffers in --memory-budget; an HTTP answer is built whole (dense arrays,
then JSON), so it holds, from admission until its last byte is sent:
- the dense arrays the pieces are collected into (the request's output bytes), and
- its JSON, estimated from the logprob entries it will list (`JSON_ENTRY_BYTES` each, times
  `BUILD_COPIES` for the Python objects a route builds them from).
The JSON is encoded on a worker thread (the event loop, which gRPC shares, never runs it) and goes
to the socket in `CHUNK_BYTES` slices, each written only when the transport has taken the last
(a reader that takes nothing loses its connection after --http-send-timeout-s: server/http_conn.py).
Large lists (vLLM's prompt_logprobs) are `Streamed`: produced in blocks of rows while the answer is
being sent, so the whole JSON never exists at once; bulk ones by a process of their own
(server/encode_process.py), so their Python never holds the GIL the compute thread needs.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import orjson

from logitserve.errors import TooLarge

from .encode_process import joined

# Bytes one JSON logprob entry takes at most, about: `"12345":{"logprob":-12.345678901234567,"rank":12345,
# "decoded_token":"..."}` with a token text of up to ~20 bytes. Checked against --max-response-bytes.
JSON_ENTRY_BYTES = 96
# Peak bytes per JSON byte while a route that builds Python lists (SGLang's triples, TRL's lists) encodes
# them: the lists' floats and ints (~32 B per ~20 B of JSON), then orjson's output beside them.
BUILD_COPIES = 3
CHUNK_BYTES = 1 << 20                # bytes written to the socket at a time
# A Streamed list's rows copied to the encoding process (server/encode_process.py): an int64 id and an fp32
# value per entry (and an int64 rank per row), held there while the list is encoded.
STREAMED_ROW_BYTES = 12
# The encoding thread lets go of the GIL after each block of a Streamed list (a sleep of this long): encoding
# is Python under the GIL, and a waiting event loop or compute thread takes it then, so a stream of
# whole-vocabulary answers costs other clients' requests little latency.
PAUSE_S = 0.0
# While compute runs or waits, each slice of an answer is followed by a wait of this many times the CPU time
# its encoding took: bulk JSON takes at most a quarter of the GIL from the compute thread.
BULK_YIELD = 3.0


class AnswerHold:
    """Bytes one HTTP request holds in the memory budget until its answer is sent (or it fails)."""

    def __init__(self, scheduler, client: str):
        self._scheduler, self._client = scheduler, client
        self.nbytes = 0

    def reserve(self, nbytes: int, what: str) -> None:
        """Hold `nbytes` more, or OverLimit (the budget is full: retry later; or over the client's share)."""
        if nbytes <= 0:
            return
        self._scheduler.reserve(self._client, nbytes, what)
        self.nbytes += nbytes

    @property
    def quick(self) -> bool:
        """A small answer (QUICK_BYTES held at most): encoded apart from the bulk ones."""
        return self.nbytes <= QUICK_BYTES

    def compute_busy(self) -> bool:
        """Whether the scheduler has a batch running or jobs queued (bulk encoding yields to them)."""
        return self._scheduler.busy

    def release(self) -> None:
        if self.nbytes:
            self._scheduler.release(self._client, self.nbytes)
            self.nbytes = 0


_current: contextvars.ContextVar[Optional[AnswerHold]] = contextvars.ContextVar("logitserve_answer", default=None)


def hold_for_answer(nbytes: int, what: str) -> None:
    """Reserve `nbytes` for the answer of the HTTP request being decoded (the front-end releases it once sent)."""
    hold = _current.get()
    if hold is not None:
        hold.reserve(nbytes, what)


def begin(hold: AnswerHold) -> None:
    """The current request's answer holds its bytes in `hold` (set by the front-end before decoding)."""
    _current.set(hold)


def check_json_entries(entries: int, where: str, max_response_bytes: int, streamed: bool = False) -> None:
    """Refuse a JSON answer of `entries` logprob entries over --max-response-bytes; reserve what building it
    holds (one copy when the entries are `Streamed`, BUILD_COPIES when a route builds them as lists)."""
    size = entries * JSON_ENTRY_BYTES
    if size > max_response_bytes:
        raise TooLarge(f"{where}: the JSON answer would be ~{size / 2**20:.0f} MiB ({entries} logprob entries), "
                        f"over the server's --max-response-bytes {max_response_bytes / 2**20:.0f} MiB; ask "
                        f"for a smaller k or fewer prompts per request, or use the gRPC API, which streams "
                        f"raw tensors")
    apart = entries * STREAMED_ROW_BYTES if encoded_apart(entries) else 0     # rows copied to the encoding process
    held = min(size, CHUNK_BYTES * 4) + apart if streamed else size * BUILD_COPIES
    hold_for_answer(held, f"{where}: the JSON answer")


def encoded_apart(entries: int) -> bool:
    """Whether a Streamed list of `entries` logprob entries is bulk, encoded by the encoding process (an answer
    under QUICK_BYTES of JSON stays on a thread of this process)."""
    return entries * JSON_ENTRY_BYTES > QUICK_BYTES


@dataclass
class Streamed:
    """A JSON value produced in pieces on the worker thread while the answer is sent: `parts()` yields the
    value's JSON bytes in order (their concatenation is the value)."""

    parts: Callable[[], Iterator[bytes]]


@dataclass(frozen=True)
class Deferred:
    """A route's answer, to be built on a worker thread: `build()` returns the JSON-able content (which may
    hold `Streamed` values)."""

    build: Callable[[], Any]
    status: int = 200


def _skeleton(content: Any) -> tuple[list[bytes], list[Streamed]]:
    """The content's JSON cut around its Streamed values: parts[i] comes before streamed[i]."""
    found: list[Streamed] = []
    tag = secrets.token_hex(8)

    def default(value):
        if isinstance(value, Streamed):
            found.append(value)
            return f"\x00{tag}:{len(found) - 1}\x00"
        raise TypeError(f"{type(value).__name__} is not JSON serializable")

    text = orjson.dumps(content, default=default, option=orjson.OPT_PASSTHROUGH_DATACLASS)
    parts = [text]
    for i in range(len(found)):
        head, _, rest = parts[-1].partition(orjson.dumps(f"\x00{tag}:{i}\x00"))
        parts[-1:] = [head, rest]
    return parts, found


def pieces(content: Any) -> Iterator[bytes]:
    """The answer's JSON bytes in slices of at most about CHUNK_BYTES (run on a worker thread, a slice at a time)."""
    parts, streamed = _skeleton(content)
    for i, part in enumerate(parts):
        yield from _slices(part)
        if i < len(streamed):
            for chunk in joined(streamed[i].parts(), CHUNK_BYTES, PAUSE_S):
                yield from _slices(chunk)


def _slices(data: bytes) -> Iterator[bytes]:
    view = memoryview(data)
    for at in range(0, len(data), CHUNK_BYTES):
        yield view[at : at + CHUNK_BYTES]


# One thread encodes every HTTP answer, a slice at a time in turn: encoding is Python under the GIL, so more
# threads would not be faster, only take more turns from the event loop that gRPC shares.
ENCODER_NICE = 10          # Linux nice of the encoding thread: bulk JSON yields the cores to compute and the loop


def _background() -> None:
    """Runs on the encoding thread: lower its CPU priority (Linux nice values are per thread)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), ENCODER_NICE)


_ENCODER = ThreadPoolExecutor(1, thread_name_prefix="logitserve-http-encode", initializer=_background)
# Answers holding at most QUICK_BYTES are encoded on a thread of their own, never queued behind a slice of a
# bulk answer (a whole-vocabulary slice takes tens of milliseconds): a small answer's latency stays its own.
QUICK_BYTES = 1 << 20
_QUICK = ThreadPoolExecutor(1, thread_name_prefix="logitserve-http-quick")


async def off_loop(fn: Callable, *args, quick: bool = False):
    """fn(*args) on the encoding thread (`quick`: the small answers' one)."""
    return await asyncio.get_running_loop().run_in_executor(_QUICK if quick else _ENCODER, fn, *args)


def _timed_next(it: Iterator[bytes]) -> tuple[Optional[bytes], float]:
    t0 = time.thread_time()
    return next(it, None), time.thread_time() - t0


async def next_piece(it: Iterator[bytes], hold: Optional[AnswerHold] = None) -> Optional[bytes]:
    """The iterator's next slice, computed on the encoding thread; None at the end. While `hold`'s scheduler has
    compute running or queued, the next slice waits BULK_YIELD times the CPU time this one took (so encoding
    takes at most 1 / (1 + BULK_YIELD) of a core and of the GIL from the compute thread)."""
    piece, took = await off_loop(_timed_next, it, quick=hold is not None and hold.quick)
    if hold is not None and hold.compute_busy():
        await asyncio.sleep(took * BULK_YIELD)
    return piece
