"""TeacherClient: the blocking client, an AsyncTeacherClient driven on the process's client event-loop thread."""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from typing import Optional, Sequence

from .aio import AsyncTeacherClient
from .api import ModelInfo, OutputsMixin
from .wire import Wanted


_LOCK = threading.Lock()
_SHARED: Optional[tuple[int, asyncio.AbstractEventLoop, threading.Thread]] = None   # (pid, loop, its thread)


def client_loop() -> asyncio.AbstractEventLoop:
    """The one event loop every blocking client of this process runs on, in a daemon thread, never closed.
    grpc.aio's poller serves every loop that ever made a channel and delivers each call's late events (a cancelled
    stream's status) to that call's loop: a loop per client, closed with it, made those land on a closed loop
    ("Event loop is closed" from another client's loop). A forked child gets a loop of its own."""
    global _SHARED
    with _LOCK:
        if _SHARED is None or _SHARED[0] != os.getpid() or not _SHARED[2].is_alive():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="logitserve-client", daemon=True)
            thread.start()
            _SHARED = (os.getpid(), loop, thread)
        return _SHARED[1]


def result_off_loop(future: concurrent.futures.Future):
    """A blocking client's wait for a future's result; refused (not a silent hang) on the client loop's own thread,
    e.g. in a callback of a submitted request, where the result could never arrive."""
    if _SHARED is not None and threading.current_thread() is _SHARED[2] and _SHARED[0] == os.getpid():
        future.cancel()
        raise RuntimeError("a blocking TeacherClient call on the clients' event-loop thread (in a callback of a "
                           "submitted request?) would wait forever: use AsyncTeacherClient there, or another thread")
    return future.result()


class TeacherClient(OutputsMixin):
    """`with TeacherClient("host:port") as c: lp = c.logprobs([[1, 2, 3]])`; thread-safe."""

    _async_class = AsyncTeacherClient     # what this class drives (TeacherPool: an AsyncTeacherPool)

    def __init__(self, address: str, wait_ready: float | None = None, **options):
        """`options` as AsyncTeacherClient's; `wait_ready`: wait up to this many seconds for the server to finish
        starting (see `wait_ready()`) before returning."""
        self._loop = client_loop()
        self._closed = False
        self._address = address

        async def make() -> AsyncTeacherClient:
            return self._async_class(address, **options)
        self._aio = self._run(make())
        if wait_ready is not None:
            try:
                self.wait_ready(wait_ready)
            except BaseException:
                self.close()
                raise

    def wait_ready(self, timeout_s: float = 600.0) -> ModelInfo:
        """Block until the server answers (its port open and its model loaded); its ModelInfo. A wait longer than a
        second is said as a logging warning (client.health.said_wait)."""
        from .health import said_wait

        return self._run(said_wait(self._aio.wait_ready(timeout_s), str(self._address), timeout_s))

    def _run(self, coro):
        return result_off_loop(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def __enter__(self) -> "TeacherClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close this client's streams and channel (the shared loop goes on serving the process's other clients)."""
        if self._closed:
            return
        self._closed = True
        self._run(self._aio.close())

    def model_info(self, timeout: float | None = None) -> ModelInfo:
        return self._run(self._aio.model_info(timeout))

    def detokenize(self, ids: Sequence[int], timeout: float | None = None):
        """The ids as the server's tokenizer spells them (a Detokenized)."""
        return self._run(self._aio.detokenize(ids, timeout))

    def head_weights(self, cache=True, timeout: float | None = None, wait_s: float | None = None):
        """The teacher's lm_head as verified numpy arrays; waits up to `wait_s` (default 120 s) while the server's
        download slots are taken (see AsyncTeacherClient.head_weights)."""
        return self._run(self._aio.head_weights(cache, timeout, wait_s))

    def head(self, device=None, dtype=None, devices=None, cache=True, timeout: float | None = None,
             wait_s: float | None = None):
        """The teacher's head as a torch module giving exactly the served logits (AsyncTeacherClient.head)."""
        return self._run(self._aio.head(device, dtype, devices, cache, timeout, wait_s))

    def submit(self, seqs: Sequence, wanted: Wanted, bf16_as_torch: bool = False) -> concurrent.futures.Future:
        """Send a request without waiting: many can be in flight on the one stream; cancel() reaches the server."""
        return asyncio.run_coroutine_threadsafe(self._aio.submit(seqs, wanted, bf16_as_torch), self._loop)

    def _request(self, seqs: Sequence, wanted: Wanted, pick, bf16_as_torch: bool = False):
        return pick(result_off_loop(self.submit(seqs, wanted, bf16_as_torch)))
