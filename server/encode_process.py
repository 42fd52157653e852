"""Bulk prompt-logprob JSON encoded in a process of its own, so it never holds the GIL the compute thread needs.

A whole-vocabulary vLLM `prompt_logprobs` answer is hundreds of MB of JSON made by Python code under the
GIL. On the server's encoding thread it took the GIL from the compute thread a few hundred times per
step (each torch call gives it up and must get it back), which doubled small requests' latency under
load (the chaos test at --tp 2: gRPC p50 67 ms against 43 ms with bulk encoding slowed to a crawl).
Here one worker process (started at the first bulk answer, Linux nice `NICE`) holds the vocabulary's
JSON tables and encodes each answer's rows into ~CHUNK_BYTES chunks, one ahead per answer, sent over a
socket pair; the server's encoding thread only waits on the socket (GIL released). A lost worker fails
the answers it was encoding (EncoderLost) and is started again for the next.
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import weakref
from multiprocessing.connection import Connection
from typing import Iterator, Optional

from .json_logprobs import VocabTables, prompt_logprobs_parts

log = logging.getLogger("logitserve.http")
NICE = 10                  # the worker's Linux nice: bulk JSON takes the cores compute leaves idle
CHUNK_BYTES = 1 << 20      # bytes per chunk sent back (the answer's hold covers four: server/http_answer.py)


class EncoderLost(ConnectionError):
    """The encoding process went away while an answer was being encoded: that answer is cut."""


class EncodeProcess:
    """The server side: `parts(*rows)` yields an answer's JSON bytes, encoded by the worker."""

    def __init__(self, tables: VocabTables):
        self._tables = tables
        self._lock = threading.Lock()     # one round trip at a time on the socket
        self._proc: Optional[subprocess.Popen] = None
        self._conn: Optional[Connection] = None
        self._ids = itertools.count()
        self._closing: list[int] = []     # answers abandoned while the socket was busy: closed on the next trip
        self._at_exit = False

    def parts(self, targets, logprobs, ranks, top_ids, top_values, leading_nulls: int) -> Iterator[bytes]:
        """prompt_logprobs_parts(...)'s bytes, in chunks. targets/logprobs/ranks: [n], top_ids/top_values: [n, k]
        (or None)."""
        aid = next(self._ids)
        self._trip(("open", aid, (targets, logprobs, ranks, top_ids, top_values, leading_nulls)), reply=False)
        finished = False
        try:
            while True:
                kind, data = self._trip(("next", aid))
                if kind == "end":
                    finished = True
                    return
                if kind == "error":
                    finished = True
                    raise RuntimeError(f"encoding the answer failed in the encoding process: {data}")
                yield data
        finally:
            if not finished:
                self._abandon(aid)

    def close(self) -> None:
        """Stop the worker (it also exits on its own when this process goes: its socket reads end of file)."""
        with self._lock:
            self._stop()

    def _trip(self, message, reply: bool = True):
        with self._lock:
            if self._proc is not None and self._proc.poll() is not None:     # died while idle: start another
                log.warning("the HTTP encoding process had exited (code %s): starting another", self._stop())
            if self._conn is None:
                self._start()
            try:
                closing, self._closing = self._closing, []     # (a swap: appends from other threads go on)
                for aid in closing:
                    self._conn.send(("close", aid))
                self._conn.send(message)
                return self._conn.recv() if reply else None
            except (OSError, EOFError) as e:
                code = self._stop()
                log.warning("the HTTP encoding process was lost (exit code %s): its answers are cut", code)
                raise EncoderLost(f"the encoding process was lost: {e}") from None

    def _abandon(self, aid: int) -> None:
        """Drop an answer the client no longer reads; never blocks (this may run in the garbage collector)."""
        if self._lock.acquire(blocking=False):
            try:
                if self._conn is not None:
                    self._conn.send(("close", aid))
            except OSError:
                pass
            finally:
                self._lock.release()
        else:
            self._closing.append(aid)

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                          pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send(("tables", *self._tables.tables()))
        if not self._at_exit:
            self._at_exit = True
            atexit.register(_close, weakref.ref(self))
        log.info("HTTP encoding process %d started (nice %d)", self._proc.pid, NICE)

    def _stop(self) -> Optional[int]:
        conn, proc, self._conn, self._proc = self._conn, self._proc, None, None
        self._closing = []
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


def _chunks(parts: Iterator[bytes]) -> Iterator[bytes]:
    pending, size = [], 0
    for part in parts:
        pending.append(part)
        size += len(part)
        if size >= CHUNK_BYTES:
            yield b"".join(pending)
            pending, size = [], 0
    if pending:
        yield b"".join(pending)


def _next(answer: Iterator[bytes]) -> tuple[str, object]:
    try:
        return "data", next(answer)
    except StopIteration:
        return "end", None
    except Exception as e:    # noqa: BLE001 (the answer fails, the worker goes on)
        return "error", f"{type(e).__name__}: {e}"


def serve(conn: Connection) -> None:
    """The worker: answers "open", "next" and "close" until the server's end of the socket closes."""
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
            answers[aid] = _chunks(prompt_logprobs_parts(*rest[0], tables))
        elif op == "close":
            answers.pop(aid, None)
            ahead.pop(aid, None)
        elif op == "next":
            reply = ahead.pop(aid, None) or (_next(answers[aid]) if aid in answers else ("end", None))
            conn.send(reply)
            if reply[0] == "data":
                ahead[aid] = _next(answers[aid])
            else:
                answers.pop(aid, None)


def _background() -> None:
    """Linux SCHED_IDLE (run only on a core nothing else wants), else nice NICE."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):
        with contextlib.suppress(OSError):
            os.nice(NICE)


if __name__ == "__main__":
    _background()
    serve(Connection(int(sys.argv[1])))
