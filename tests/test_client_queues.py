"""The scheduler's two books on their own: the clients' fair rotation (ClientQueues) and the bytes held (HeldBytes)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from logitserve.errors import OverLimit, TooLarge
from logitserve.server.client_queues import ClientQueues
from logitserve.server.held_bytes import HeldBytes
from logitserve.server.ticket import Ticket
from logitserve.spec import Job, LogprobsOpts

pytestmark = pytest.mark.unit


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _ticket(loop, client: str, tokens: int, work: int = 0) -> Ticket:
    job = Job(sequences=(np.arange(tokens, dtype=np.int32),), logprobs=LogprobsOpts())
    return Ticket(job, client, work or tokens, 0, loop, 1 << 20, ())


def test_clients_take_turns_whatever_their_queue_lengths(loop):
    q = ClientQueues()
    a = [_ticket(loop, "a", 10) for _ in range(5)]
    b = [_ticket(loop, "b", 10) for _ in range(2)]
    for t in a[:3] + b + a[3:]:
        q.append(t)
    assert len(q) == 7 and q.peek() is a[0]
    order = [q.pop() for _ in range(7)]
    assert order == [a[0], b[0], a[1], b[1], a[2], a[3], a[4]]
    assert not q and q.peek() is None


def test_a_job_given_up_leaves_only_if_queued_and_its_client_keeps_its_turn(loop):
    q = ClientQueues()
    a1, a2, b1 = _ticket(loop, "a", 4), _ticket(loop, "a", 4), _ticket(loop, "b", 4)
    for t in (a1, a2, b1):
        q.append(t)
    assert q.remove(a2) and not q.remove(a2)
    taken = q.pop()
    assert taken is a1 and not q.remove(taken)         # a batch took it: not the queue's to give back
    assert q.pop() is b1 and not q


def test_small_jobs_for_interjection_are_taken_in_turn_up_to_the_cap(loop):
    q = ClientQueues()
    big, s1, s2, s3 = _ticket(loop, "a", 2000), _ticket(loop, "b", 300), _ticket(loop, "b", 300), _ticket(loop, "c", 500)
    heavy = _ticket(loop, "d", 100, work=5000)         # few tokens, much head work (a whole-vocabulary top-k)
    for t in (big, s1, s2, s3, heavy):
        q.append(t)
    taken = q.take_small(1024)
    assert taken == [s1, s3], taken                    # one per client per round; s2 would pass the cap
    assert [q.pop() for _ in range(3)] == [big, heavy, s2] and not q


def _member(loop, client: str, prompt: np.ndarray, mate: bool = False) -> Ticket:
    """One sequence of a group sent one per request: the prompt then a response of its own."""
    from logitserve.server.grouping import shareables

    ids = np.concatenate([prompt, np.arange(100, 140, dtype=np.int32)])
    job = Job(sequences=(ids,), logprobs=LogprobsOpts(), prompt_lengths=(len(prompt),))   # the response's rows read
    ticket = Ticket(job, client, len(ids), 0, loop, 1 << 20, shareables(job, 64, 1000))
    assert ticket.shares
    ticket.mate = mate
    return ticket


def test_a_group_arriving_in_parts_is_not_taken_apart_for_interjection(loop):
    prompt = np.arange(200, dtype=np.int32)
    q = ClientQueues()
    first = _member(loop, "a", prompt)
    lone = _member(loop, "b", np.arange(300, 500, dtype=np.int32))      # shareable, but no other part queued
    q.append(first)
    q.append(lone)
    assert q.take_small(1024) == [first, lone]          # no mate queued: each may run between another's steps
    q.append(first)
    second = _member(loop, "a", prompt, mate=True)     # its group's next part arrives (from the same client)
    q.append(second)
    plain = _ticket(loop, "d", 16)                       # too short to share: a polite small request
    q.append(plain)
    assert q.take_small(400) == [plain]                  # one part fits 400 tokens, the two do not: they wait
    assert q.take_small(1024) == [first, second] and not q   # both fit: taken together (one prefix in their batch)
    q.append(lone)
    assert q.take_small(1024, held_after=lone.admitted - 0.005) == []   # grouped mode: a shareable job may be a
    assert q.take_small(1024, held_after=lone.admitted) == [lone]        # group's first until the window has passed
    q.append(first)
    q.append(second)
    assert q.take_small(1024, held_after=second.admitted - 0.005) == []  # a part still in the window holds its
    assert len(q) == 2                                                    # queued mates back too


def test_another_clients_queued_mates_never_hold_a_small_job(loop):
    """Issue 43: client b's small job starting with the prompt of client a's queued group parts was taken only
    together with them (over the cap: never between steps). Mates are a client's own."""
    prompt = np.arange(200, dtype=np.int32)
    q = ClientQueues()
    parts = [_member(loop, "a", prompt), _member(loop, "a", prompt, mate=True)]     # 480 tokens together
    other = _member(loop, "b", prompt, mate=True)                                    # 240 tokens
    for t in (*parts, other):
        q.append(t)
    assert q.take_small(400) == [other]
    assert q.take_small(400) == [] and len(q) == 2


def test_a_clients_small_job_is_taken_past_its_group_parts_and_large_jobs(loop):
    """Every connection of a host is one client: a small job behind that client's waiting group parts and a large
    job still runs between steps (only the front of each queue was looked at: it waited for the whole batch)."""
    prompt = np.arange(200, dtype=np.int32)
    q = ClientQueues()
    parts = [_member(loop, "host", prompt), _member(loop, "host", prompt, mate=True)]   # 480 tokens together
    big, small = _ticket(loop, "host", 2000), _ticket(loop, "host", 16)
    for t in (*parts, big, small):
        q.append(t)
    assert q.take_small(400) == [small]
    assert q.take_small(400) == [] and len(q) == 3


def test_held_bytes_refuse_past_the_budget_and_past_a_clients_share():
    held = HeldBytes(1000, 500)
    held.add("a", 400)
    held.check("b", 500, 0)
    with pytest.raises(OverLimit, match="over its share"):
        held.check("a", 200, 0)
    with pytest.raises(OverLimit, match="over --memory-budget 0 MiB"):
        held.check("b", 400, 300)
    with pytest.raises(TooLarge, match="even alone"):
        held.check_alone(700, 400)
    with pytest.raises(TooLarge, match="at peak .longest sequence 10 tokens"):
        held.check_peak(1001, 10)
    with pytest.raises(TooLarge, match="over half of --memory-budget"):
        held.check_outside(600, "a text")
    held.remove("a", 400)
    assert held.held == 0
    held.check("a", 500, 500)
    unbounded = HeldBytes(None, None)
    unbounded.check("a", 1 << 40, 1 << 40)
    unbounded.check_alone(1 << 40, 1 << 40)
    unbounded.check_peak(1 << 40, 10)
