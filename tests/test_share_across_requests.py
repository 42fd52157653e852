"""A group's sequences sent one per request, all in flight (verl's, slime's, prime-rl's per-sample callers), still
have their prompt computed once: the scheduler's decisions (server/grouping.py) with a fake runner, and a live
server over gRPC and HTTP, every value against float64 transformers."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from helpers import VOCAB, Reference, assert_close, assert_same_signature, build_model, post, ref_token_logprobs, serve_dir
from logitserve.client import AsyncTeacherClient, TeacherClient
from logitserve.server.grouping import close_time, shareables
from logitserve.server.scheduler import Scheduler, engine_batch_runner
from logitserve.server.config import SchedulerConfig
from logitserve.spec import Job, LogprobsOpts

P, R, G, GROUPS = 200, 30, 4, 3       # prompt, response, group size, groups per burst
MIN_SHARED = 64


# -- the scheduler's decisions, with a runner that records its batches ------------------------------------------
class Recorder:
    """A batch runner that records each batch's jobs and computes nothing; `hold` keeps the first batch running
    until released (so that others queue behind it)."""

    def __init__(self, hold: bool = False):
        self.batches: list[list[Job]] = []
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def run(self, jobs, skip, between=None, short=False):
        self.batches.append(list(jobs))
        self.release.wait(30)
        yield from ()


def _scheduler(recorder: Recorder, **config) -> Scheduler:
    assert_same_signature(recorder.run, engine_batch_runner(lambda jobs, skip, short=False: iter(())))
    return Scheduler(recorder.run, SchedulerConfig(**config), shares=lambda job: shareables(job, MIN_SHARED, VOCAB))


def _job(prompt: np.ndarray, rng: np.random.Generator, n: int = R) -> Job:
    seq = np.concatenate([prompt, rng.integers(0, VOCAB, n)]).astype(np.int32)
    return Job((seq,), logprobs=LogprobsOpts(), prompt_lengths=(len(prompt),))


async def _send(scheduler: Scheduler, job: Job, client: str = "a") -> None:
    async for _ in scheduler.stream(job, client):
        pass


def _ids(batches: list[list[Job]], jobs: list[Job]) -> list[list[int]]:
    return [sorted(next(i for i, j in enumerate(jobs) if j is b) for b in batch) for batch in batches]


@pytest.mark.unit
def test_close_time_holds_a_batch_only_while_its_groups_arrive_and_never_past_the_bound():
    delay, wait = 0.002, 0.005
    assert close_time(10.0, None, delay, wait) == 10.0 + delay                       # nothing counts: as before
    assert close_time(10.0, 10.001, delay, wait) == pytest.approx(10.006)             # share_wait after the latest
    assert close_time(10.0, 10.004, delay, wait) == pytest.approx(10.0 + delay + wait)   # capped
    assert close_time(10.0, 9.0, delay, wait) == 10.0 + delay                        # long ago: as before
    assert close_time(10.0, 10.001, delay, 0.0) == 10.0 + delay                      # 0 turns it off


@pytest.mark.unit
def test_a_lone_request_is_not_held_for_the_share_window():
    """Outside grouped mode a shareable request's batch closes after batch_delay, not share_wait (30 s here): a
    request alone, the same request sent again once answered (a benchmark's loop: no mate), then another."""
    rec = Recorder()
    sched = _scheduler(rec, share_wait_s=30.0)
    rng = np.random.default_rng(0)
    again, other = _job(rng.integers(0, VOCAB, P), rng), _job(rng.integers(0, VOCAB, P), rng)

    async def run():
        for job in (again, again, other):
            await _send(sched, job)
    started = time.monotonic()
    asyncio.run(run())
    assert time.monotonic() - started < 10.0 and len(rec.batches) == 3
    sched.shutdown()


@pytest.mark.unit
def test_parts_of_a_group_sent_apart_run_in_one_batch_once_groups_come_in_parts():
    """A1 and A2 (one group's two parts) in flight together: A2 is a mate, the server enters grouped mode. Then
    B (a new group's first), C (another's first) and D (C's mate), each 0.2 s apart, share one batch: it stays
    open while shareable jobs keep coming (share_wait 1.5 s), where without the window each would run alone. A
    """
    rec = Recorder()
    sched = _scheduler(rec, share_wait_s=1.5)
    rng = np.random.default_rng(1)
    p1, p2, p3 = (rng.integers(0, VOCAB, P) for _ in range(3))
    jobs = [_job(p1, rng), _job(p1, rng), _job(p2, rng), _job(p3, rng), _job(p3, rng)]

    async def run():
        await asyncio.gather(_send(sched, jobs[0]), _send(sched, jobs[1]))
        rest = []
        for job in jobs[2:5]:
            rest.append(asyncio.ensure_future(_send(sched, job)))
            await asyncio.sleep(0.2)
        await asyncio.gather(*rest)
    asyncio.run(run())
    assert _ids(rec.batches, jobs) == [[0, 1], [2, 3, 4]]
    sched.shutdown()


@pytest.mark.unit
def test_a_shared_prefix_counts_once_against_max_batch_tokens_and_mates_join_out_of_turn():
    """Queued behind a running batch: x1 (prompt p), y (another client, unrelated), x2..x4 (p's mates). The batch
    taken next holds x1 and its mates, their continuations only counted (230 + 3 * 30 <= 400, where raw tokens
    would be 920), ahead of y, which alone does not fit beside x1; y runs next."""
    rec = Recorder(hold=True)
    sched = _scheduler(rec, max_batch_tokens=400, share_wait_s=0.0)
    rng = np.random.default_rng(2)
    p = rng.integers(0, VOCAB, P)
    blocker, x1, y = _job(rng.integers(0, VOCAB, 10), rng, 5), _job(p, rng), _job(rng.integers(0, VOCAB, P), rng)
    mates = [_job(p, rng) for _ in range(3)]
    jobs = [blocker, x1, y, *mates]

    async def run():
        tasks = [asyncio.ensure_future(_send(sched, blocker, "b"))]
        while not rec.batches:
            await asyncio.sleep(0.01)
        tasks += [asyncio.ensure_future(_send(sched, j, c)) for j, c in [(x1, "a"), (y, "b")] + [(m, "a") for m in mates]]
        await asyncio.sleep(0.1)
        rec.release.set()
        await asyncio.gather(*tasks)
    asyncio.run(run())
    assert _ids(rec.batches, jobs) == [[0], [1, 3, 4, 5], [2]]
    sched.shutdown()


async def _per_request(address: str, seqs: list[np.ndarray]) -> list:
    """Each sequence its own request, all in flight over 4 streams."""
    clients = [AsyncTeacherClient(address) for _ in range(4)]
    try:
        return await asyncio.gather(*(clients[i % 4].forward([s], logprobs=True, prompt_lengths=[P])
                                      for i, s in enumerate(seqs)))
    finally:
        for c in clients:
            await c.close()


# -- a live server: gRPC and HTTP -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    """A llama with the demo tokenizer; batches of at most 1024 tokens, so a burst's raw tokens (3 * 4 * 230)
    need three batches unless shared prefixes count once; share_wait 20 ms (the CI machine's 2 cores are busy)."""
    from logitserve.demo import demo_tokenizer

    directory = build_model(tmp_path_factory.mktemp("share") / "llama", "llama")
    demo_tokenizer(VOCAB).save_pretrained(directory)
    server = serve_dir(directory, max_pack_tokens=1024, min_shared_prefix=MIN_SHARED, http_port=0,
                       scheduler=SchedulerConfig(max_batch_tokens=1024, share_wait_s=0.02))
    # A fresh server sees groups come in parts once two parts meet in its queue (grouped mode): in a first burst
    # the interleaved firsts may each be batched before their mates arrive. The tests measure the bursts after.
    asyncio.run(_per_request(server.address, _burst(2)))
    yield server, Reference(directory)
    server.stop()


def _burst(seed: int) -> list[np.ndarray]:
    """GROUPS groups of G sequences, interleaved as a per-sample caller's requests arrive: g0 g1 g2 g0 g1 ..."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB, P) for _ in range(GROUPS)]
    return [np.concatenate([prompts[g], rng.integers(0, VOCAB, R)]) for _ in range(G) for g in range(GROUPS)]


def _possible(address: str, seqs: list[np.ndarray]) -> int:
    """Shared-prefix tokens when the whole burst comes as one request (sharing at its best)."""
    with TeacherClient(address) as c:
        return c.forward(seqs, logprobs=True, prompt_lengths=[P] * len(seqs)).shared_prefix_tokens


def _total(address: str) -> int:
    with TeacherClient(address) as c:
        return c.model_info().shared_prefix_tokens


@pytest.mark.live_server
def test_grpc_group_sent_one_sequence_per_request_computes_its_prompt_once(shared_server):
    server, ref = shared_server
    seqs = _burst(3)
    possible = _possible(server.address, seqs)
    assert possible == GROUPS * (G - 1) * (P - 1)
    before = _total(server.address)
    results = asyncio.run(_per_request(server.address, seqs))
    shared = sum(r.shared_prefix_tokens for r in results)
    assert shared >= 0.8 * possible, f"{shared} of {possible} shared-prefix tokens"
    assert _total(server.address) - before == shared
    for s, r in zip(seqs, results):
        assert_close(r.logprobs[0], ref_token_logprobs(ref.logits(s), s)[P:], tol=1e-5)


@pytest.mark.live_server
def test_http_completions_one_sequence_per_request_computes_its_prompt_once(shared_server):
    """vLLM's /v1/completions with prompt_logprobs from the response on (prompt_logprob_start = P - 1)."""
    server, ref = shared_server
    seqs = _burst(4)
    possible = _possible(server.address, seqs)
    before = _total(server.address)
    base = f"http://127.0.0.1:{server.running.http_port}"
    body = (lambda s: {"prompt": s.tolist(), "max_tokens": 0, "prompt_logprobs": 1, "prompt_logprob_start": P - 1})
    with ThreadPoolExecutor(len(seqs)) as pool:
        answers = list(pool.map(lambda s: post(base, "/v1/completions", body(s)), seqs))
    shared = _total(server.address) - before
    assert shared >= 0.8 * possible, f"{shared} of {possible} shared-prefix tokens"
    for s, (status, out) in zip(seqs, answers):
        assert status == 200, out
        plp = out["choices"][0]["prompt_logprobs"]
        assert plp[:P] == [None] * P
        assert_close([plp[t][str(s[t])]["logprob"] for t in range(P, len(s))], ref_token_logprobs(ref.logits(s), s)[P:])
