"""Keeping a group's sequences in one batch when they come as separate requests: prefix keys, body tokens with a
shared prefix counted once, and the share window (how long a batch waits for more of a group).

The engine computes a prefix once only among the sequences of one batch (logitserve.prefix). RL callers
(verl, slime, prime-rl) send a group's G sequences one per request, all in flight at once; a batch that
closes between two of them computes the prompt twice. So the scheduler, for each batch it gathers:
- counts a sequence that continues a prefix the batch already holds by its own tokens only (the body
  computes the prefix once), so `max_batch_tokens` bounds the tokens the body computes;
- takes queued jobs that continue one of its prefixes (its "mates") out of turn when they fit: they
  add only their continuations, and would otherwise compute the prefix again in a later batch;
- stays open past `batch_delay_s` while more of its groups may come: until `share_wait_s` after the
  latest of its jobs that counts was admitted, and never more than `share_wait_s` past `batch_delay_s`
  (`close_time`). A mate (a job admitted while a sequence with the same first `min_shared` tokens was
  queued or in the batch being gathered) always counts. While the server is in grouped mode (within
  GROUPED_S seconds of a mate: its callers send groups in parts) every job with a shareable sequence
  counts, as it may be a group's first. A request sent again after its last answer (a benchmark's
  loop, another epoch) is no mate: only parts in flight together are. So traffic that never comes in parts (lone
  requests, whole groups per request, distinct prompts, sequences too short to share) closes its
  batches exactly as before; in grouped mode a request may wait up to `share_wait_s` longer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, Iterator, Optional

import numpy as np

from logitserve.prefix import share_cap
from logitserve.spec import Job

GROUPED_S = 10.0       # grouped mode lasts this long after the latest mate


@dataclass(frozen=True)
class Shareable:
    """One sequence of a job that may continue (or be) a shared prefix."""

    key: bytes            # its first min_shared tokens: sequences with the same key form a group
    ids: np.ndarray       # int32 [L]
    cap: int              # at most this many leading tokens may be shared (logitserve.prefix.share_cap)


def shareables(job: Job, min_shared: int, vocab: int) -> tuple[Shareable, ...]:
    """The job's sequences that could share a prefix of >= min_shared tokens (none when min_shared is 0)."""
    if min_shared < 1:
        return ()
    out = []
    for i, ids in enumerate(job.sequences):
        cap = share_cap(len(ids), job.first_read(i, vocab))
        if cap >= min_shared:
            out.append(Shareable(ids[:min_shared].tobytes(), ids, cap))
    return tuple(out)


def common_prefix(a: np.ndarray, b: np.ndarray, upto: int) -> int:
    """Length of the leading run `a` and `b` share, at most `upto`."""
    n = min(upto, len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def close_time(opened: float, last: Optional[float], batch_delay_s: float, share_wait_s: float) -> float:
    """When a batch opened at `opened`, with room left, closes: `batch_delay_s` after it opened; holding jobs that
    count (the latest admitted at `last`), `share_wait_s` after that one, and never later than `share_wait_s`
    past the first bound."""
    base = opened + batch_delay_s
    if share_wait_s <= 0 or last is None:
        return base
    return min(base + share_wait_s, max(base, last + share_wait_s))


class Gathering:
    """The prefixes of the batch being gathered: what one more job adds to its body."""

    def __init__(self):
        self._first: dict[bytes, Shareable] = {}     # key -> the batch's first sequence with it
        self.last_mate: Optional[float] = None       # the latest admission among its jobs that came as mates
        self.last_shared: Optional[float] = None     # ... among its jobs with a shareable sequence

    def last(self, grouped: bool) -> Optional[float]:
        """The admission the share window runs from (close_time): the latest mate's, or in grouped mode the latest
        shareable job's."""
        return self.last_shared if grouped else self.last_mate

    def keys(self) -> Iterable[bytes]:
        return self._first.keys()

    def holds(self, shares: tuple[Shareable, ...]) -> bool:
        """Whether one of these sequences continues a prefix of the batch."""
        return any(s.key in self._first for s in shares)

    def body_tokens(self, tokens: int, shares: tuple[Shareable, ...]) -> int:
        """Tokens a job of `tokens` adds to the body: a sequence continuing a prefix of the batch (or of the job's
        earlier sequences) adds only what follows their common run."""
        own: dict[bytes, Shareable] = {}            # prefixes this job brings
        saved = 0
        for s in shares:
            rep = self._first.get(s.key) or own.get(s.key)
            if rep is None:
                own[s.key] = s
            else:
                saved += common_prefix(s.ids, rep.ids, min(s.cap, rep.cap))
        return tokens - saved

    def add(self, job) -> None:
        """Take a job (a server.ticket.Ticket: its shares, whether it came as a mate, when it was admitted)."""
        for s in job.shares:
            self._first.setdefault(s.key, s)
        if job.mate:
            self.last_mate = max(self.last_mate or job.admitted, job.admitted)
        if job.shares:
            self.last_shared = max(self.last_shared or job.admitted, job.admitted)


class QueuedKeys:
    """Queued jobs by the keys of their shareable sequences, in admission order: mates are found without a scan."""

    def __init__(self):
        self._by: dict[bytes, dict[Hashable, None]] = {}

    def add(self, job: Hashable, shares: tuple[Shareable, ...]) -> None:
        for s in shares:
            self._by.setdefault(s.key, {})[job] = None

    def remove(self, job: Hashable, shares: tuple[Shareable, ...]) -> None:
        for s in shares:
            queued = self._by.get(s.key)
            if queued is not None:
                queued.pop(job, None)
                if not queued:
                    del self._by[s.key]

    def holds(self, shares: tuple[Shareable, ...]) -> bool:
        """Whether a queued job has a sequence with one of these keys."""
        return any(s.key in self._by for s in shares)

    def shared(self, shares: tuple[Shareable, ...]) -> bool:
        """Whether, with a queued job that has these `shares`, another queued job has a sequence under one of its keys."""
        return any(len(self._by.get(s.key, ())) > 1 for s in shares)

    def mates(self, keys: Iterable[bytes], client: Optional[str] = None) -> Iterator[Hashable]:
        """Queued jobs with a sequence under one of `keys` (each once), only `client`'s when given (a job's `client`
        attribute); a snapshot, safe to remove from."""
        seen: dict[Hashable, None] = {}
        for k in list(keys):
            for job in self._by.get(k, ()):
                if client is None or getattr(job, "client", None) == client:
                    seen[job] = None
        return iter(list(seen))

