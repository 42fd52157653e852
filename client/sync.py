"""TeacherClient: the blocking client, an AsyncTeacherClient driven on a private event-loop thread."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Sequence

from .aio import AsyncTeacherClient
from .api import ModelInfo, OutputsMixin
from .wire import Wanted


class TeacherClient(OutputsMixin):
    """`with TeacherClient("host:port") as c: lp = c.logprobs([[1, 2, 3]])`; thread-safe."""

    _async_class = AsyncTeacherClient     # what this class drives (TeacherPool: an AsyncTeacherPool)

    def __init__(self, address: str, wait_ready: float | None = None, **options):
        """`options` as AsyncTeacherClient's; `wait_ready`: wait up to this many seconds for the server to finish
        starting (see `wait_ready()`) before returning."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="logitserve-client", daemon=True)
        self._thread.start()

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
        """Block until the server answers (its port open and its model loaded); its ModelInfo."""
        return self._run(self._aio.wait_ready(timeout_s))

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> "TeacherClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._close_all())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _close_all(self) -> None:
        """Close the client, then let grpc's own tasks finish so none dies pending with the loop."""
        await self._aio.close()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)

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
        return pick(self.submit(seqs, wanted, bf16_as_torch).result())
