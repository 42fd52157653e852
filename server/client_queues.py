"""The queued jobs, one queue per client in a rotation: who runs next (fairness), found without a scan.

Batches take the clients' oldest jobs in turn: a client served goes to the back of the rotation, so one
client's hundred queued requests do not put another's one behind them. Jobs continuing a prefix that a
batch holds are found by their keys (server.grouping.QueuedKeys) and taken out of turn without moving
their client; a small job taken between a long batch's steps comes with its own client's mates only. Not thread-safe: the scheduler holds its lock around every call.
"""
from __future__ import annotations

import collections
import itertools
from typing import Iterator, Optional

from .grouping import QueuedKeys, Shareable
from .ticket import Ticket

# Queued jobs of one client that take_small looks at per round: past the group parts that wait for their batch and
# the jobs over the cap at its front (every connection of a host is one client), so a small one behind them still runs.
SCAN = 64


class ClientQueues:
    def __init__(self) -> None:
        self._queues: collections.OrderedDict[str, collections.deque[Ticket]] = collections.OrderedDict()
        self._keys = QueuedKeys()                    # queued jobs by their prefix keys

    def __bool__(self) -> bool:
        return bool(self._queues)

    def __len__(self) -> int:
        """Jobs queued."""
        return sum(len(q) for q in self._queues.values())

    def append(self, ticket: Ticket) -> None:
        self._keys.add(ticket, ticket.shares)
        self._queues.setdefault(ticket.client, collections.deque()).append(ticket)

    def holds(self, shares: tuple[Shareable, ...]) -> bool:
        """Whether a queued job has a sequence under one of these prefix keys."""
        return self._keys.holds(shares)

    def mates(self, keys, client: Optional[str] = None) -> Iterator[Ticket]:
        """Queued jobs with a sequence under one of `keys`, only `client`'s when given (a snapshot: safe to take
        from)."""
        return self._keys.mates(keys, client)

    def peek(self) -> Optional[Ticket]:
        """The next job in turn: the oldest of the client at the front of the rotation."""
        for queue in self._queues.values():
            return queue[0]
        return None

    def pop(self) -> Ticket:
        """Take the next job in turn; its client goes to the back of the rotation."""
        client, queue = next(iter(self._queues.items()))
        ticket = queue.popleft()
        del self._queues[client]
        if queue:
            self._queues[client] = queue
        self._keys.remove(ticket, ticket.shares)
        return ticket

    def take_out_of_turn(self, ticket: Ticket) -> None:
        """Take a queued job that is not next in turn; its client keeps its place in the rotation."""
        queue = self._queues[ticket.client]
        queue.remove(ticket)
        if not queue:
            del self._queues[ticket.client]
        self._keys.remove(ticket, ticket.shares)

    def remove(self, ticket: Ticket) -> bool:
        """Take a job given up before it ran; False when it is not queued (a batch took it)."""
        queue = self._queues.get(ticket.client)
        if queue is None or ticket not in queue:
            return False
        self.take_out_of_turn(ticket)
        return True

    def take_small(self, cap: int, held_after: Optional[float] = None) -> list[Ticket]:
        """Queued jobs of at most `cap` work tokens, that many tokens in all: the clients' oldest in turn (one
        each per round, from the front of the rotation; a client served goes to its back; within a client, the
        first of its oldest SCAN jobs that may be taken and fits). A job with queued
        mates (its own client's jobs under one of its prefix keys) is taken with all of them or not at all, so the
        group is not taken apart (apart, its prefix is computed once more); in grouped mode a shareable job admitted
        after `held_after` (None: not grouped) may be a group's first, and waits (a lone one at most that long).
        Mates never cross clients: another client's queued jobs with the same prompt (a shared system prompt, or
        parts made to look like one) never hold a client's small job back until their long batch has run."""
        taken, tokens = [], 0
        while True:
            served = []
            for client, queue in list(self._queues.items()):
                together = self._first_small(queue, cap, cap - tokens, held_after)
                if together:
                    tokens += sum(t.tokens for t in together)
                    for t in together:
                        self.take_out_of_turn(t)
                    taken += together
                    served.append(client)
            for client in served:
                if client in self._queues:
                    self._queues.move_to_end(client)
            if not served:
                return taken

    def _first_small(self, queue, cap: int, room: int, held_after: Optional[float]) -> list[Ticket]:
        """The first of a client's oldest SCAN jobs (with its queued mates) that may be taken: each of at most `cap`
        work tokens, `room` tokens in all; none when there is no such job (a queue emptied this round has none)."""
        for ticket in itertools.islice(queue, SCAN):
            together = self._together(ticket, held_after)
            if together and all(t.work <= cap for t in together) and sum(t.tokens for t in together) <= room:
                return together
        return []

    def _together(self, ticket: Ticket, held_after: Optional[float]) -> list[Ticket]:
        """The job with its client's queued mates, in admission order; none while one of them may still be joined by
        more of its group (admitted after held_after, in grouped mode)."""
        group = list(self.mates((s.key for s in ticket.shares), ticket.client)) if ticket.shares else [ticket]
        if held_after is not None and any(t.shares and t.admitted > held_after for t in group):
            return []
        return group
