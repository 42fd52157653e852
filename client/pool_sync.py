"""TeacherPool: the blocking twin of AsyncTeacherPool, driven on the process's client event-loop thread as TeacherClient."""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Optional, Sequence, Union

from .agreement import Agreement
from .api import OutputsMixin
from .pool import AsyncTeacherPool, GroupKey
from .replica import ReplicaState
from .sync import TeacherClient, result_off_loop
from .wire import Wanted


class TeacherPool(TeacherClient):
    """`with TeacherPool(["h1:50051", "h2:50051"], wait_ready=600) as t: lp = t.logprobs(seqs)`: TeacherClient's
    methods over several replicas (see AsyncTeacherPool); thread-safe."""

    _async_class = AsyncTeacherPool

    def __init__(self, addresses: Union[str, Sequence[str]], wait_ready: Optional[float] = None, **options):
        """`options` as AsyncTeacherPool's; `wait_ready`: wait up to this many seconds for every replica, and
        check that they serve the same model (ReplicasDisagree), before returning."""
        super().__init__(addresses, wait_ready, **options)

    def wait_ready(self, timeout_s: float = 600.0):
        """Block until every replica answers, then check that they agree; the model's ModelInfo."""
        return self._run(self._aio.wait_ready(timeout_s))

    def check_agreement(self, probe: Optional[Sequence[int]] = None, atol: Optional[float] = None,
                        timeout: float = 30.0) -> Agreement:
        """Every replica's content hash (ReplicasDisagree naming them where they differ); with a probe token
        sequence, the largest |logprob difference| between replicas (an error past `atol`)."""
        return self._run(self._aio.check_agreement(probe, atol, timeout))

    def replicas(self) -> tuple[ReplicaState, ...]:
        """Every replica's status, load and model."""
        return self._run(_call(self._aio.replicas))

    def group(self, key: GroupKey) -> "Group":
        """The same methods under one explicit group key: all its sequences go to one replica."""
        return Group(self, key)

    def submit(self, seqs: Sequence, wanted: Wanted, bf16_as_torch: bool = False,
               group: Optional[GroupKey] = None) -> concurrent.futures.Future:
        """Send a request without waiting (see AsyncTeacherPool.submit); cancel() reaches the server."""
        return asyncio.run_coroutine_threadsafe(self._aio.submit(seqs, wanted, bf16_as_torch, group), self._loop)


async def _call(f):
    return f()


class Group(OutputsMixin):
    """TeacherPool's methods under one group key (`pool.group(key)`)."""

    def __init__(self, pool: TeacherPool, key: GroupKey):
        self._pool, self._key = pool, key

    def submit(self, seqs: Sequence, wanted: Wanted, bf16_as_torch: bool = False) -> concurrent.futures.Future:
        return self._pool.submit(seqs, wanted, bf16_as_torch, self._key)

    def _request(self, seqs: Sequence, wanted: Wanted, pick, bf16_as_torch: bool = False):
        return pick(result_off_loop(self.submit(seqs, wanted, bf16_as_torch)))
