"""AsyncTeacherPool: one logical teacher over N replicas, each group's sequences routed to one replica."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Optional, Sequence, Union

import grpc

from .agreement import Agreement, check_agreement
from .aio import Resendable, resending
from .health import said_wait
from .api import ModelInfo, OutputsMixin
from .errors import ClientDeadline, LogitServeError
from .replica import Replica, ReplicaState, dns_target, resolve
from .routing import DEFAULT_PREFIX_TOKENS, Affinity, Routing, group_key, plan, prefix_key
from .scatter import check_per_sequence, cut, merge
from .wire import Wanted

log = logging.getLogger("logitserve.client.pool")
GroupKey = Union[str, bytes, int]
AGREE_TIMEOUT_S = 10.0     # ModelInfo's deadline when the first request checks the replicas' models


class AsyncTeacherPool(OutputsMixin):
    """`async with AsyncTeacherPool(["h1:50051", "h2:50051"]) as t: lp = await t.logprobs(seqs)`: the methods of
    AsyncTeacherClient over several replicas, results in request order whichever replica served them."""

    def __init__(self, addresses: Union[str, Sequence[str]], *, routing: Routing = Routing(), retries: int = 3,
                 ready_timeout_s: float = 60.0, resolve_every_s: float = 30.0,
                 default_timeout_s: Optional[float] = None, **client_options):
        """`addresses`: replicas as "host:port", and/or `dns:///name:port` entries re-resolved every
        `resolve_every_s` (a headless Kubernetes Service). `routing`: the group key and the load bounds.
        A request that finds its replica gone before any data came back is sent to another, up to `retries`
        times. A request waits up to `ready_timeout_s` for a routable replica (UNAVAILABLE after).
        `client_options`: AsyncTeacherClient's (tls, token, streams, max_receive_bytes, ...) for every replica."""
        entries = [addresses] if isinstance(addresses, str) else list(addresses)
        if not entries or retries < 0 or ready_timeout_s <= 0 or resolve_every_s <= 0:
            raise ValueError(f"addresses={entries!r} must name a replica, retries={retries} be >= 0, "
                             f"ready_timeout_s={ready_timeout_s} and resolve_every_s={resolve_every_s} > 0")
        if "load_balancing" in client_options:
            raise ValueError("load_balancing: the pool balances over its replicas itself (see Routing)")
        self._dns = [t for t in (dns_target(e) for e in entries) if t is not None]
        self._literal = [e for e in entries if dns_target(e) is None]
        self._options = dict(client_options, retries=0, default_timeout_s=default_timeout_s)
        self._rule, self._retries = routing, retries
        self._affinity = Affinity(routing)
        self._ready_timeout, self._resolve_every = ready_timeout_s, resolve_every_s
        self._default_timeout = default_timeout_s
        self._replicas: dict[str, Replica] = {}
        self._hash: Optional[str] = None         # the pool's model: the one its replicas agreed on
        self._agreed = False                     # every replica that answered was checked for one model
        self._agree_lock: Optional[asyncio.Lock] = None
        self._prefix = routing.prefix_tokens
        self._changed: Optional[asyncio.Event] = None
        self._tasks: list[asyncio.Task] = []
        self._started = False

    # ---- life cycle

    def _start(self) -> None:
        if self._started:
            return
        self._started, self._changed, self._agree_lock = True, asyncio.Event(), asyncio.Lock()
        self._update(set(self._literal))
        if self._dns:
            self._tasks.append(asyncio.ensure_future(self._resolve_loop()))

    async def __aenter__(self) -> "AsyncTeacherPool":
        self._start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(r.close() for r in self._replicas.values()), return_exceptions=True)

    def _update(self, addresses: set[str]) -> None:
        """Replicas for addresses new to the pool; those gone from DNS leave once their requests finish."""
        for address in sorted(addresses - self._replicas.keys()):
            r = self._replicas[address] = Replica(address, self._options, self._admit, self._notify)
            r.watcher.start()
        for address in set(self._replicas) - addresses - set(self._literal):
            r = self._replicas.pop(address)
            r.removed = True
            self._tasks.append(asyncio.ensure_future(self._retire(r)))
        self._notify()

    async def _retire(self, replica: Replica) -> None:
        while replica.in_flight:
            await asyncio.sleep(0.1)
        await replica.close()

    async def _resolve_loop(self) -> None:
        while True:
            found: set[str] = set()
            for host, port in self._dns:
                try:
                    found |= await resolve(host, port)
                except OSError as e:       # keep what resolved last time
                    log.warning("resolving %s:%d failed: %s", host, port, e)
                    found |= {a for a in self._replicas if a not in self._literal}
            self._update(found | set(self._literal))
            await asyncio.sleep(self._resolve_every)

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    def _admit(self, replica: Replica, info: ModelInfo) -> None:
        """A replica's ModelInfo as it says SERVING: refused when its model is not the one the pool agreed on
        (before that agreement no request is routed: _agree)."""
        if self._hash is not None and info.content_hash != self._hash:
            replica.refused = f"content_hash {info.content_hash}, the pool serves {self._hash}"
            log.error("replica %s refused: it serves %s (content_hash %s), the pool %s", replica.address,
                      info.name, info.content_hash, self._hash)
        if self._prefix is None:
            self._prefix = info.min_shared_prefix or DEFAULT_PREFIX_TOKENS

    # ---- what the pool tells

    def replicas(self) -> tuple[ReplicaState, ...]:
        """Every replica's status, load and model, by address."""
        return tuple(self._replicas[a].state() for a in sorted(self._replicas))

    async def wait_ready(self, timeout_s: float = 600.0) -> ModelInfo:
        """Wait until every replica answers ModelInfo (at most `timeout_s`), then check that they all serve the
        same weights (ReplicasDisagree naming them if not); the model's info."""
        self._start()
        if self._dns:
            await self._wait(lambda: bool(self._replicas), timeout_s, "no address resolved")
        deadline = time.monotonic() + timeout_s
        infos = await asyncio.gather(*(said_wait(r.client.wait_ready(timeout_s), r.address, timeout_s)
                                       for r in self._replicas.values()))
        await self.check_agreement()
        # every replica, as its Watch stream reports SERVING and its ModelInfo is admitted
        await self._wait(lambda: all(r.routable for r in self._replicas.values()),
                         max(0.1, deadline - time.monotonic()), "waiting for every replica's Watch stream")
        return infos[0]

    async def check_agreement(self, probe: Optional[Sequence[int]] = None, atol: Optional[float] = None,
                              timeout: float = 30.0) -> Agreement:
        """Every reachable replica's content hash (ReplicasDisagree where they differ); with a `probe` token
        sequence, also the largest |logprob difference| between replicas on it (LogitServeError past `atol`)."""
        self._start()
        agreement = await check_agreement(list(self._replicas.values()), probe, atol, timeout)
        if agreement.hashes:
            self._hash, self._agreed = next(iter(agreement.hashes.values())), True
            for r in self._replicas.values():
                if r.info is not None and r.info.content_hash == self._hash:
                    r.refused = None
            self._notify()
        return agreement

    async def model_info(self, timeout: Optional[float] = None) -> ModelInfo:
        return await (await self._any()).client.model_info(timeout)

    async def detokenize(self, ids: Sequence[int], timeout: Optional[float] = None):
        return await (await self._any()).client.detokenize(ids, timeout)

    async def head_weights(self, cache=True, timeout: Optional[float] = None, wait_s: Optional[float] = None):
        return await (await self._any()).client.head_weights(cache, timeout, wait_s)

    async def head(self, device=None, dtype=None, devices=None, cache=True, timeout: Optional[float] = None,
                   wait_s: Optional[float] = None):
        return await (await self._any()).client.head(device, dtype, devices, cache, timeout, wait_s)

    def group(self, key: GroupKey) -> "AsyncGroup":
        """The same methods, every request under one explicit group key (a prompt id, a uid): all its
        sequences go to one replica (the key's, as for a prefix key: docs/clients.md), whatever their tokens."""
        return AsyncGroup(self, key)

    # ---- routing

    async def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                states = "; ".join(r.describe() for r in self._replicas.values()) or "no replica"
                raise LogitServeError(grpc.StatusCode.UNAVAILABLE,
                                      f"replicas not ready after {timeout_s:g} s ({what}): {states}")
            try:
                await asyncio.wait_for(asyncio.shield(self._changed.wait()), left)
            except asyncio.TimeoutError:
                pass

    async def _agree(self) -> None:
        """Before the first request is routed (wait_ready or not): every replica that answers ModelInfo serves one
        model (ReplicasDisagree naming each otherwise); one that did not answer is checked as it comes up."""
        async with self._agree_lock:
            while not self._agreed:
                await self._wait(lambda: any(r.info is not None for r in self._replicas.values()),
                                 self._ready_timeout, "waited ready_timeout_s for a replica's ModelInfo")
                await self.check_agreement(timeout=min(AGREE_TIMEOUT_S, self._ready_timeout,
                                                       self._default_timeout or AGREE_TIMEOUT_S))

    async def _routable(self, avoid: Sequence[str] = ()) -> dict[str, Replica]:
        """The routable replicas, those in `avoid` (tried by this request) left out while others remain."""
        self._start()
        if not self._agreed:
            await self._agree()
        await self._wait(lambda: any(r.routable for r in self._replicas.values()), self._ready_timeout,
                         "waited ready_timeout_s")
        ok = {a: r for a, r in self._replicas.items() if r.routable}
        return {a: r for a, r in ok.items() if a not in avoid} or ok

    async def _any(self) -> Replica:
        ok = await self._routable()
        return min(ok.values(), key=lambda r: (r.in_flight, r.address))

    def _request(self, seqs: Sequence, wanted: Wanted, pick, bf16_as_torch: bool = False, group=None):
        async def run():
            return pick(await self.submit(seqs, wanted, bf16_as_torch, group))
        return run()

    async def submit(self, seqs: Sequence, wanted: Wanted, bf16_as_torch: bool = False,
                     group: Optional[GroupKey] = None):
        """Send one request and wait for its ForwardResult. Its sequences are split by group key (`group`, else
        each sequence's first prefix tokens), each key's sequences sent to one replica, the results merged."""
        check_per_sequence(wanted, len(seqs))
        if wanted.timeout_s is None and self._default_timeout is not None:
            wanted = dataclasses.replace(wanted, timeout_s=self._default_timeout)
        ok = await self._routable()
        prefix = self._prefix or DEFAULT_PREFIX_TOKENS
        keys = ([group_key(group)] * len(seqs) if group is not None else
                [prefix_key(s, prefix, self._rule.chars_per_token) for s in seqs])
        parts = (plan(keys, {a: r.in_flight for a, r in ok.items()}, self._rule, self._affinity) if seqs
                 else {min(ok): []})
        sends = []
        for address, index in parts.items():
            ok[address].in_flight += len(index)       # now, so that the next request's plan sees it
            sends.append(_Part(ok[address], keys[index[0]] if index else None, [seqs[i] for i in index],
                               cut(wanted, index), bf16_as_torch))
        try:
            if len(sends) == 1:
                return await self._send(sends[0])
            results = await asyncio.gather(*(self._send(p) for p in sends))
        finally:
            for p in sends:
                p.release()
        return merge(len(seqs), [(index, r) for index, r in zip(parts.values(), results)])

    async def _send(self, part: "_Part"):
        tried: list[str] = []

        async def attempt(n: int):
            if n > 0:
                ok = await self._routable(avoid=tried)
                part.move(ok[self._affinity.choose(part.key, {a: r.in_flight for a, r in ok.items()})])
            tried.append(part.replica.address)
            part.replica.sent += len(part.seqs)
            try:
                return await part.replica.client.send_once(part.seqs, part.wanted, part.bf16_as_torch)
            except Resendable:
                part.replica.lost()
                raise
            except ClientDeadline as e:      # a hung replica (not even its own DEADLINE_EXCEEDED came): out, and
                part.replica.lost()          # the part goes to another with its timeout_s afresh
                raise Resendable(e) from None
        try:
            return await resending(attempt, self._retries)
        finally:
            part.release()


class _Part:
    """The sequences of one request that go to one replica; holds their count in that replica's load."""

    def __init__(self, replica: Replica, key, seqs: list, wanted: Wanted, bf16_as_torch: bool):
        self.replica, self.key, self.seqs, self.wanted, self.bf16_as_torch = replica, key, seqs, wanted, bf16_as_torch
        self._held: Optional[Replica] = replica

    def move(self, replica: Replica) -> None:
        self.release()
        self.replica = self._held = replica
        replica.in_flight += len(self.seqs)

    def release(self) -> None:
        if self._held is not None:
            self._held.in_flight -= len(self.seqs)
            self._held = None


class AsyncGroup(OutputsMixin):
    """AsyncTeacherPool's methods under one group key (`pool.group(key)`)."""

    def __init__(self, pool: AsyncTeacherPool, key: GroupKey):
        group_key(key)                 # a bad key fails here, not at the first request
        self._pool, self._key = pool, key

    def _request(self, seqs: Sequence, wanted: Wanted, pick, bf16_as_torch: bool = False):
        return self._pool._request(seqs, wanted, pick, bf16_as_torch, self._key)

    async def submit(self, seqs: Sequence, wanted: Wanted, bf16_as_torch: bool = False):
        return await self._pool.submit(seqs, wanted, bf16_as_torch, self._key)
