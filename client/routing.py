"""Which replica serves a sequence: its group's key hashed (rendezvous) under a load bound, kept while the group lasts."""
from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

import numpy as np

# What a server shares by default (`logitserve serve --min-shared-prefix`): the key's length when neither the
# server's ModelInfo nor the caller says.
DEFAULT_PREFIX_TOKENS = 64


@dataclass(frozen=True)
class Routing:
    """How a TeacherPool picks a replica (see docs/clients.md, "Several replicas")."""

    # Leading tokens that make a sequence's group key. None: the server's --min-shared-prefix from ModelInfo
    # (DEFAULT_PREFIX_TOKENS where it reports 0, as under --batching exact). A sequence shorter than this
    # shares no prefix the server would reuse, so it goes to the least-loaded replica.
    prefix_tokens: Optional[int] = None
    # A text's key: its first prefix_tokens * chars_per_token characters (the client cannot tokenize).
    chars_per_token: int = 4
    # A key's replica is passed over for the least-loaded one only when its in-flight sequences exceed the
    # least-loaded's by more than balance_abs AND by a factor over balance_rel: SGLang's and vLLM's routers'
    # cache-aware defaults (64, 1.5), so affinity holds through the imbalance that hashing whole groups makes.
    balance_abs: int = 64
    balance_rel: float = 1.5
    # A key new to the pool goes to the first replica of its rendezvous ranking whose in-flight sequences are
    # under ceil(balance_factor * (all in flight + 1) / replicas): consistent hashing with bounded loads (as
    # Envoy's and HAProxy's hash balance factor), so that a burst of a few large groups lands evenly rather than
    # where the hash falls (4 groups on 2 replicas: 3 + 1 or 4 + 0 five times in eight). The loads are this pool's
    # own, so pools in other processes may place a new key elsewhere. None: the hashed replica, in every process.
    balance_factor: Optional[float] = 1.25
    # A key keeps its replica for sticky_s after its last sequence was routed, so a group's later sequences
    # follow its first ones however the loads moved meanwhile (at most max_keys keys are kept, oldest dropped).
    sticky_s: float = 60.0
    max_keys: int = 65536

    def __post_init__(self):
        if self.prefix_tokens is not None and self.prefix_tokens < 1:
            raise ValueError(f"prefix_tokens={self.prefix_tokens} must be >= 1 (or None: the server's)")
        if self.chars_per_token < 1 or self.balance_abs < 0 or self.balance_rel < 1.0:
            raise ValueError(f"chars_per_token={self.chars_per_token} must be >= 1, balance_abs={self.balance_abs} "
                             f">= 0 and balance_rel={self.balance_rel} >= 1.0")
        if (self.balance_factor is not None and self.balance_factor < 1.0) or self.sticky_s < 0 or self.max_keys < 1:
            raise ValueError(f"balance_factor={self.balance_factor} must be >= 1.0 (or None), sticky_s="
                             f"{self.sticky_s} >= 0 and max_keys={self.max_keys} >= 1")


Key = Optional[bytes]


def group_key(group: Union[str, bytes, int]) -> bytes:
    """An explicit group key (a prompt id, a uid) as the bytes that are hashed."""
    if isinstance(group, bytes):
        return b"g" + group
    if isinstance(group, (str, int)):
        return b"g" + str(group).encode()
    raise TypeError(f"group={group!r}: give a str, bytes or int key")


def prefix_key(seq, prefix_tokens: int, chars_per_token: int = 4) -> Key:
    """The key of a sequence's first `prefix_tokens` tokens (a text's first prefix_tokens * chars_per_token
    characters); None when it is shorter: nothing of it would be shared."""
    if isinstance(seq, str):
        n = prefix_tokens * chars_per_token
        return b"s" + seq[:n].encode() if len(seq) >= n else None
    ids = np.asarray(seq)
    if ids.ndim != 1 or len(ids) < prefix_tokens:
        return None
    # int64 little-endian whatever the caller's dtype: the same tokens give the same key in every process
    return b"t" + np.ascontiguousarray(ids[:prefix_tokens], dtype="<i8").tobytes()


def _score(key: bytes, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + b"|" + name.encode(), digest_size=8).digest(), "little")


def ranking(key: bytes, names: Sequence[str]) -> list[str]:
    """The names in `key`'s order of preference (highest random weight first). Deterministic across processes."""
    return sorted(names, key=lambda n: (_score(key, n), n), reverse=True)


def rendezvous(key: bytes, names: Sequence[str]) -> str:
    """The name that `key` hashes to (highest random weight): when a name leaves, only its keys move; when one
    joins, it takes about 1/N of every other name's keys (those not held by an Affinity). Deterministic across
    processes."""
    return max(names, key=lambda n: (_score(key, n), n))


def bounded(key: bytes, loads: Mapping[str, int], rule: Routing) -> str:
    """The first replica of the key's ranking under the load bound (rule.balance_factor); one always is, since
    the least loaded is under the mean."""
    order = ranking(key, list(loads))
    if rule.balance_factor is None:
        return order[0]
    cap = math.ceil(rule.balance_factor * (sum(loads.values()) + 1) / len(loads))
    return next((n for n in order if loads[n] < cap), order[0])


def least_loaded(loads: Mapping[str, int]) -> str:
    return min(loads, key=lambda n: (loads[n], n))


def overloaded(chosen: int, least: int, rule: Routing) -> bool:
    """The chosen replica's load is past both bounds of the least-loaded one's."""
    return chosen - least > rule.balance_abs and chosen > rule.balance_rel * least


def choose(key: Key, loads: Mapping[str, int], rule: Routing) -> str:
    """The replica for a key: its hashed one unless overloaded (then the least-loaded); no key: least-loaded.
    `loads`: in-flight sequences of every routable replica (non-empty)."""
    least = least_loaded(loads)
    if key is None:
        return least
    hashed = rendezvous(key, sorted(loads))
    return least if overloaded(loads[hashed], loads[least], rule) else hashed


class Affinity:
    """The replica each recent key was sent to. A key keeps it while it is routable and not overloaded (past both
    bounds of `overloaded`, when this one sequence goes to the least loaded); a new key, or one whose replica
    left, takes `bounded`'s choice, and keeps that."""

    def __init__(self, rule: Routing, clock=time.monotonic):
        self._rule, self._clock = rule, clock
        self._table: OrderedDict[bytes, tuple[str, float]] = OrderedDict()     # key -> (replica, last routed)

    def __len__(self) -> int:
        return len(self._table)

    def choose(self, key: Key, loads: Mapping[str, int]) -> str:
        """The replica for one sequence of `key` (None: the least loaded). `loads`: as `choose`'s."""
        least = least_loaded(loads)
        if key is None:
            return least
        now = self._clock()
        self._forget(now)
        held = self._table.get(key)
        name = held[0] if held is not None and held[0] in loads else bounded(key, loads, self._rule)
        self._table[key] = (name, now)
        self._table.move_to_end(key)
        return least if overloaded(loads[name], loads[least], self._rule) else name

    def _forget(self, now: float) -> None:
        while self._table:
            oldest = next(iter(self._table.values()))
            if len(self._table) < self._rule.max_keys and now - oldest[1] <= self._rule.sticky_s:
                return
            self._table.popitem(last=False)


def plan(keys: Sequence[Key], loads: Mapping[str, int], rule: Routing,
         affinity: Optional[Affinity] = None) -> dict[str, list[int]]:
    """Sequence indices per replica for one request: every sequence of a key to one replica, chosen as the
    load stands with this request's earlier sequences counted (by `affinity` when given, with its own rule;
    else `choose` with `rule`)."""
    loads = dict(loads)
    by_key: dict[bytes, str] = {}
    parts: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        name = by_key.get(key) if key is not None else None
        if name is None:
            name = affinity.choose(key, loads) if affinity is not None else choose(key, loads, rule)
            if key is not None:
                by_key[key] = name
        parts.setdefault(name, []).append(i)
        loads[name] += 1
    return parts
