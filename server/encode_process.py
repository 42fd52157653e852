"""Bulk prompt-logprob JSON encoded in a process of its own, so it never holds the GIL the compute thread needs.

A whole-vocabulary vLLM `prompt_logprobs` answer is hundreds of MB of JSON made by Python code under the
GIL. On the server's encoding thread it took the GIL from the compute thread a few hundred times per
step (each torch call gives it up and must get it back), which doubled small requests' latency under
load (the chaos test at --tp 2: gRPC p50 67 ms against 43 ms with bulk encoding slowed to a crawl).
Here one worker process (started at the first bulk answer, at Linux SCHED_IDLE, else nice `NICE`) holds
the vocabulary's JSON tables and encodes each answer's rows into ~CHUNK_BYTES chunks, one ahead per
answer, sent over a socket pair. The rows go to it as raw bytes and the chunks come back as raw bytes,
so the server's encoding thread mostly waits on the socket with the GIL released.
A worker that dies or answers nothing for `REPLY_TIMEOUT_S` fails every answer it had open (EncoderLost:
their connections are cut, never ended as if complete); the next answer starts another. A worker that
cannot start leaves answers to the thread (prompt_logprobs_parts in this process), as before.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection
from typing import Iterator, Optional

import numpy as np

from .json_logprobs import VocabTables, prompt_logprobs_parts

log = logging.getLogger("logitserve.http")
NICE = 10                  # the worker's Linux nice where SCHED_IDLE is refused
CHUNK_BYTES = 1 << 20      # bytes per chunk sent back (the answer's hold covers four: server/http_answer.py)
REPLY_TIMEOUT_S = 120.0    # a chunk not encoded within this long: the worker is taken as lost


class EncoderLost(ConnectionError):
    """The encoding process went away (or stopped answering) while an answer was being encoded: it is cut."""


class EncodeProcess:
    """The server side: `parts(*rows)` yields an answer's JSON bytes, encoded by the worker."""

    def __init__(self, tables: VocabTables):
        self._tables = tables
        self._lock = threading.Lock()     # one round trip at a time on the socket
        self._proc: Optional[subprocess.Popen] = None
        self._conn: Optional[Connection] = None
        self._generation = 0              # +1 per worker started: an answer belongs to the one that opened it
        self._ids = itertools.count()
        self._closing: collections.deque[int] = collections.deque()   # abandoned answers, closed on the next trip
        self._closed = False
        atexit.register(_close, weakref.ref(self))

    def parts(self, targets, logprobs, ranks, top_ids, top_values, leading_nulls: int) -> Iterator[bytes]:
        """prompt_logprobs_parts(...)'s bytes, in chunks. targets/logprobs/ranks: [n], top_ids/top_values: [n, k]
        (or None)."""
        rows = (targets, logprobs, ranks, top_ids, top_values)
        aid = next(self._ids)
        generation = self._open(aid, rows, leading_nulls)
        if generation is None:          # no worker could start: this thread encodes it
            yield from prompt_logprobs_parts(*rows, leading_nulls, self._tables)
            return
        finished = False
        try:
            while True:
                kind, data = self._trip(("next", aid), generation)
                if kind == "end":
                    finished = True
                    return
                if kind == "error":
                    finished = True
                    raise RuntimeError(f"encoding the answer failed in the encoding process: {data}")
                yield data
        finally:
            if not finished:
                self._closing.append(aid)
                self._flush_closing()

    def close(self) -> None:
        """Stop the worker for good (it also exits on its own when this process goes: its socket reads end of
        file). Kills it first, so a round trip waiting on it ends at once."""
        self._closed = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
        with self._lock:
            self._stop()

    # -- the socket ------------------------------------------------------------------------------------------------
    def _open(self, aid: int, rows: tuple, leading_nulls: int) -> Optional[int]:
        """Send an answer's rows to the worker (starting one if none runs); its generation, or None when no worker
        can start."""
        with self._lock:
            if self._closed:
                raise EncoderLost("the HTTP front-end is stopping")
            if self._proc is not None and self._proc.poll() is not None:     # died while idle: start another
                log.warning("the HTTP encoding process had exited (code %s): starting another", self._stop())
            if self._conn is None and not self._start():
                return None
            arrays = [None if a is None else np.ascontiguousarray(a) for a in rows]
            header = [None if a is None else (a.dtype.str, a.shape) for a in arrays]
            self._guarded(lambda: self._send_open(aid, header, arrays, leading_nulls))
            return self._generation

    def _send_open(self, aid: int, header: list, arrays: list, leading_nulls: int) -> None:
        self._conn.send(("open", aid, header, leading_nulls))
        for a in arrays:
            if a is not None:
                self._conn.send_bytes(a.reshape(-1).view(np.uint8))    # raw: written with the GIL released

    def _trip(self, message, generation: int):
        with self._lock:
            if generation != self._generation or self._conn is None:
                raise EncoderLost("the encoding process that held this answer was lost")
            return self._guarded(lambda: self._round_trip(message))

    def _round_trip(self, message):
        self._send_closing()
        self._conn.send(message)
        if not self._conn.poll(REPLY_TIMEOUT_S):
            raise TimeoutError(f"no chunk within {REPLY_TIMEOUT_S:.0f} s")
        kind, data = self._conn.recv()
        if kind == "data":
            data = self._conn.recv_bytes()
        self._send_closing()
        return kind, data

    def _guarded(self, fn):
        """fn() on the socket (the lock held); any failure stops the worker and fails its open answers."""
        try:
            return fn()
        except BaseException as e:
            code = self._stop()
            log.warning("the HTTP encoding process was lost (exit code %s; %s): its open answers are cut", code,
                        type(e).__name__)
            raise EncoderLost(f"the encoding process was lost: {type(e).__name__}: {e}") from None

    def _send_closing(self) -> None:
        while self._closing:
            self._conn.send(("close", self._closing.popleft()))

    def _flush_closing(self) -> None:
        """Close abandoned answers now when the socket is free (this may run in a garbage collector's finalizer,
        so it never waits for the lock); otherwise the next round trip does."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._conn is not None:
                with contextlib.suppress(OSError):
                    self._send_closing()
        finally:
            self._lock.release()

    def _start(self) -> bool:
        ours, theirs = socket.socketpair()
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                          pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
            self._conn = Connection(ours.detach())
            self._conn.send(("tables", *self._tables.tables()))
        except OSError as e:
            ours.close()
            self._stop()
            log.warning("the HTTP encoding process could not start (%s): bulk answers are encoded on a thread", e)
            return False
        finally:
            theirs.close()
        self._generation += 1
        self._closing.clear()
        log.info("HTTP encoding process %d started (SCHED_IDLE, else nice %d)", self._proc.pid, NICE)
        return True

    def _stop(self) -> Optional[int]:
        conn, proc, self._conn, self._proc = self._conn, self._proc, None, None
        self._generation += 1             # answers of the worker stopped are lost with it
        if conn is not None:
            conn.close()
        if proc is None:
            return None
        try:
            return proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()


def _close(ref: "weakref.ref[EncodeProcess]") -> None:
    encoder = ref()
    if encoder is not None:
        encoder.close()


def joined(parts: Iterator[bytes], chunk: int, pause_s: Optional[float] = None) -> Iterator[bytes]:
    """The parts joined into chunks of at least `chunk` bytes (but for the last); `pause_s`: a sleep before each
    part (an encoding thread lets go of the GIL there)."""
    pending, size = [], 0
    for part in parts:
        if pause_s is not None:
            time.sleep(pause_s)
        pending.append(part)
        size += len(part)
        if size >= chunk:
            yield b"".join(pending)
            pending, size = [], 0
    if pending:
        yield b"".join(pending)


# -- the worker ------------------------------------------------------------------------------------------------------


def _next(answer: Iterator[bytes]) -> tuple[str, object]:
    try:
        return "data", next(answer)
    except StopIteration:
        return "end", None
    except Exception as e:    # noqa: BLE001 (the answer fails, the worker goes on)
        return "error", f"{type(e).__name__}: {e}"


def _rows(conn: Connection, header: list) -> list:
    return [None if h is None else np.frombuffer(conn.recv_bytes(), dtype=h[0]).reshape(h[1]) for h in header]


def _reply(conn: Connection, reply: tuple[str, object]) -> None:
    if reply[0] == "data":
        conn.send(("data", None))
        conn.send_bytes(reply[1])
    else:
        conn.send(reply)


def serve(conn: Connection) -> None:
    """The worker: answers "open", "next", "close" and "live" until the server's end of the socket closes."""
    _, head, tail, rank = conn.recv()
    tables = VocabTables.prebuilt(head, tail, rank)
    answers: dict[int, Iterator[bytes]] = {}
    ahead: dict[int, tuple[str, object]] = {}       # each answer's next chunk, encoded while the last is sent
    while True:
        try:
            op, aid, *rest = conn.recv()
        except (EOFError, OSError):
            return
        if op == "open":
            header, leading_nulls = rest
            answers[aid] = joined(prompt_logprobs_parts(*_rows(conn, header), leading_nulls, tables), CHUNK_BYTES)
        elif op == "close":
            answers.pop(aid, None)
            ahead.pop(aid, None)
        elif op == "live":                           # (tests) answers open here
            conn.send(("live", len(answers)))
        elif op == "next":
            reply = ahead.pop(aid, None) or (_next(answers[aid]) if aid in answers else ("error", "unknown answer"))
            _reply(conn, reply)
            if reply[0] == "data":
                ahead[aid] = _next(answers[aid])
            else:
                answers.pop(aid, None)


def _background() -> None:
    """Linux SCHED_IDLE (run only on a core nothing else wants), else nice NICE; the server's signals are its
    own (Ctrl-C reaches the whole process group): the worker ends when the server closes its socket."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):
        with contextlib.suppress(OSError):
            os.nice(NICE)


if __name__ == "__main__":
    _background()
    serve(Connection(int(sys.argv[1])))
