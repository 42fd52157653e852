"""Small requests do not wait out a large one: queued small jobs run between a long batch's head steps
(server.batch_runner, --interject-after-ms), in one process and across TP ranks; values stay exact."""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from helpers import CliServer, Reference, assert_close, ref_token_logprobs
from logitserve.client import TeacherClient
from logitserve.cost import head_chunk_rows
from logitserve.demo import demo_dir
from logitserve.events import JobPiece, Piece, Step
from logitserve.server.batch_runner import engine_batch_runner
from logitserve.server.scheduler import Scheduler
from logitserve.server.config import SchedulerConfig
from logitserve.spec import Job, LogprobsOpts, OutputKind, TopKOpts


def _steps_of(n_steps: dict[int, int], log: list):
    """A fake Engine.batch_steps (same signature): job j takes n_steps[len(its sequence)] steps of 10 ms each."""
    def batch_steps(jobs: list[Job], skip=None, isolate: bool = True, short: bool = False):
        for j, job in enumerate(jobs):
            for k in range(n_steps[len(job.sequences[0])]):
                if skip is not None and skip(j):
                    break
                time.sleep(0.01)
                log.append((len(job.sequences[0]), k))
                yield Step((j,), (JobPiece(j, Piece(OutputKind.TOKEN_LOGPROBS, 0, (1,), (0,), torch.zeros(1))),))
    return batch_steps


def _order(interject_after_s: float) -> tuple[list[str], list]:
    """A 64-token job of 30 steps, then a 4-token one admitted while it runs: which finishes first."""
    log: list = []
    scheduler = Scheduler(engine_batch_runner(_steps_of({64: 30, 4: 1}, log)),
                          SchedulerConfig(batch_delay_s=0.0, interject_after_s=interject_after_s))
    done: list[str] = []
    job = lambda n: Job(sequences=(np.zeros(n, np.int32),), logprobs=LogprobsOpts())   # noqa: E731

    async def one(name: str, n: int) -> None:
        async for _ in scheduler.stream(job(n), client=name):
            pass
        done.append(name)

    async def scenario() -> None:
        big = asyncio.create_task(one("big", 64))
        while not log:
            await asyncio.sleep(0.002)
        await one("small", 4)
        await big
    try:
        asyncio.run(scenario())
    finally:
        scheduler.shutdown()
        scheduler.join(5.0)
    return done, log


@pytest.mark.unit
def test_a_small_job_runs_between_a_long_batchs_steps():
    done, log = _order(0.02)
    assert done == ["small", "big"], done
    at = log.index((4, 0))
    assert 0 < at < len(log) - 1 and log[at - 1][0] == log[at + 1][0] == 64, log      # nested between two steps
    done, log = _order(0.0)     # interjection off: the small job waits for the whole batch
    assert done == ["big", "small"], done


def _lone_vs_group(share_wait_s: float, interject_tokens: int, one_client: bool = False,
                   tenants: bool = False) -> tuple[list[str], list, int]:
    """A 64-token job of 30 steps runs; two parts of a group (one prompt, sent apart) then a lone shareable job of
    another prompt arrive: the order they finish in, the fake's log (steps by length: 120 group, 110 lone), and
    the log's length when the lone job was admitted. `one_client`: all from one host (one client, one queue).
    `tenants`: two clients (two bearer tokens): the parts are one tenant's, and the lone job, another tenant's,
    starts with the same prompt (two RL trainers sharing a system prompt)."""
    from logitserve.server.grouping import shareables

    log: list = []
    scheduler = Scheduler(engine_batch_runner(_steps_of({64: 30, 120: 1, 110: 1}, log)),
                          SchedulerConfig(batch_delay_s=0.0, interject_after_s=0.02, share_wait_s=share_wait_s,
                                          interject_tokens=interject_tokens),
                          shares=lambda job: shareables(job, 64, 1000))
    done: list[str] = []
    admitted: list[int] = []
    rng = np.random.default_rng(0)
    prompt, other = rng.integers(3, 1000, 100, dtype=np.int32), rng.integers(3, 1000, 100, dtype=np.int32)

    def job(head: np.ndarray, n: int) -> Job:      # outputs on the response only: its prompt may be shared
        ids = np.concatenate([head, rng.integers(3, 1000, n - len(head), dtype=np.int32)])
        return Job(sequences=(ids,), logprobs=LogprobsOpts(), prompt_lengths=(len(head),))

    def client(name: str) -> str:
        if tenants:
            return "token:tenant-b" if name == "lone" else "token:tenant-a"
        if one_client:
            return "host"
        return "trainer" if name.startswith("part") else name      # a group's parts come from one client

    async def one(name: str, j: Job) -> None:
        async for _ in scheduler.stream(j, client=client(name)):
            pass
        done.append(name)

    async def scenario() -> None:
        big = asyncio.create_task(one("big", Job(sequences=(np.zeros(64, np.int32),), logprobs=LogprobsOpts())))
        while not log:
            await asyncio.sleep(0.002)
        parts = [asyncio.create_task(one(f"part{i}", job(prompt, 120))) for i in range(2)]
        await asyncio.sleep(0.01)
        admitted.append(len(log))
        await one("lone", job(prompt if tenants else other, 110))
        await asyncio.gather(big, *parts)
    try:
        asyncio.run(scenario())
    finally:
        scheduler.shutdown()
        scheduler.join(5.0)
    return done, log, admitted[0]


@pytest.mark.unit
def test_a_lone_shareable_job_waits_only_the_share_window_while_a_group_waits_for_its_batch():
    """Grouped mode (a group came in parts): the lone job runs between the long job's steps once the share window
    (50 ms: 5 steps of 10 ms) has passed; the group's two parts, together over --interject-tokens, wait for a batch
    of their own; under it, they run between the steps too, together."""
    done, log, admitted = _lone_vs_group(0.05, 200)
    assert done.index("lone") < done.index("big") < done.index("part0"), done    # the group is not taken apart
    assert log.count((120, 0)) == 2 and log.index((120, 0)) > log.index((64, 29)), log
    lone_at = log.index((110, 0))
    assert lone_at < log.index((64, 29)), log                                      # the lone one ran between steps
    assert lone_at - admitted >= 3, (admitted, log)                                # after the window, not at once
    done, log, admitted = _lone_vs_group(0.05, 200, one_client=True)               # behind the parts in one queue
    assert done.index("lone") < done.index("big") < done.index("part0"), done
    done, log, _ = _lone_vs_group(0.05, 1024)
    assert done.index("part1") < done.index("big") and log.index((120, 0)) < log.index((64, 29)), (done, log)
    at = log.index((120, 0))
    assert log[at + 1] == (120, 0), log                                            # one nested batch, both parts


@pytest.mark.unit
def test_another_clients_group_parts_never_hold_a_small_job_back():
    """Issue 43: mates were collected across clients, so tenant B's small job, starting with the prompt of tenant A's
    queued group parts (together over --interject-tokens), was taken only with them: it waited out A's whole long
    batch. Mates are a client's own: B's job runs between the long batch's steps once the share window has passed,
    and A's parts still wait for a batch of their own (their prefix computed once)."""
    done, log, admitted = _lone_vs_group(0.05, 200, tenants=True)
    assert done.index("lone") < done.index("big") < done.index("part0"), done
    lone_at = log.index((110, 0))
    assert lone_at < log.index((64, 29)) and lone_at - admitted >= 3, (admitted, log)
    assert log.count((120, 0)) == 2 and log.index((120, 0)) > log.index((64, 29)), log


@pytest.mark.unit
def test_heavy_rows_get_shorter_head_steps():
    V = 32000
    plain = Job(sequences=(np.zeros(8, np.int32),), logprobs=LogprobsOpts())
    whole = Job(sequences=(np.zeros(8, np.int32),), topk=TopKOpts(k=V))
    filtered = Job(sequences=(np.zeros(8, np.int32),), logprobs=LogprobsOpts(top_p=0.9))
    assert head_chunk_rows(plain, 512, V) == 512
    assert head_chunk_rows(whole, 512, V) == 512 // 13 and head_chunk_rows(filtered, 512, V) == 512 // 7
    assert head_chunk_rows(whole, 4, V) == 1


@pytest.fixture(scope="module")
def reference():
    return Reference(demo_dir("causal", "demo"))


@pytest.mark.multi_process
@pytest.mark.parametrize("flags,small_first", [((), True), (("--tp", "2"), True), (("--pp", "2"), True),
                                               (("--interject-after-ms", "0"), False)],
                         ids=["tp1", "tp2", "pp2", "off"])
def test_a_small_request_is_not_held_behind_a_large_one(reference, flags, small_first):
    """A top-p request of 4 x 512 tokens (a sort per row: seconds on CPU; under --pp 4 micro-batches, some in flight
    between the stages when the small batch runs) is running when a 16-token one arrives: the small one is answered
    first, exact against float64 transformers; both answers are whole."""
    rng = np.random.default_rng(3)
    big, small = [rng.integers(3, 32000, 512) for _ in range(4)], rng.integers(3, 32000, 16)
    server = CliServer("--demo", "causal", *flags)
    finished: dict[str, float] = {}
    out: dict[str, np.ndarray] = {}
    try:
        with TeacherClient(server.address) as c:
            def run_big():
                out["big"] = c.logprobs(big, top_p=0.9)
                finished["big"] = time.monotonic()
            t = threading.Thread(target=run_big)
            t.start()
            time.sleep(0.5)
            out["small"] = c.logprobs([small])[0]
            finished["small"] = time.monotonic()
            t.join(120)
    finally:
        assert server.stop() == 0
    assert (finished["small"] < finished["big"]) == small_first, finished
    assert [x.shape for x in out["big"]] == [(512,)] * 4 and all(np.isfinite(x[1:]).any() for x in out["big"])
    if "--pp" in flags:      # the small batch ran between the stages' steps: neither batch's activations met the other's
        for seq, got in zip(big, out["big"]):                       # the first 64 rows of each, against float64
            want, got = ref_token_logprobs(reference.logits(seq[:65]), seq[:65], top_p=0.9)[1:], got[1:65]
            both = np.isfinite(want) & np.isfinite(got)
            assert (np.isfinite(want) == np.isfinite(got)).mean() > 0.95 and both.sum() > 8, both.sum()
            np.testing.assert_allclose(got[both], want[both], atol=2e-4)
    want = torch.log_softmax(reference.logits(small), dim=-1)[:-1].gather(-1, torch.as_tensor(small[1:])[:, None])
    assert_close(out["small"][1:], want[:, 0].numpy())


@pytest.fixture(scope="module")
def engine():
    from logitserve.engine import Engine, EngineConfig
    from logitserve.loading import load_model

    return Engine(load_model(demo_dir("causal", "demo")), EngineConfig(chunk_size=64))


@pytest.mark.unit
def test_a_small_job_batched_with_a_large_one_ends_at_its_last_step(engine, reference):
    """Both jobs in one batch (one pack, since the short one goes first in its own): the small job's stream ends
    after its own head step (Step.done -> JobDone), while the large one still has most of its steps to go."""
    rng = np.random.default_rng(5)
    small, big = rng.integers(3, 32000, 16).astype(np.int32), rng.integers(3, 32000, 1024).astype(np.int32)
    scheduler = Scheduler(engine_batch_runner(engine.batch_steps),
                          SchedulerConfig(batch_delay_s=0.2, interject_after_s=0.0))
    got: dict[str, list] = {"small": [], "big": []}
    big_pieces_when_small_ended: list[int] = []

    async def one(name: str, ids: np.ndarray) -> None:
        async for item in scheduler.stream(Job(sequences=(ids,), logprobs=LogprobsOpts()), client=name):
            if isinstance(item, Piece):
                got[name].append(item)
        if name == "small":
            big_pieces_when_small_ended.append(len(got["big"]))

    async def scenario() -> None:
        await asyncio.gather(one("big", big), one("small", small))
    try:
        asyncio.run(scenario())
    finally:
        scheduler.shutdown()
        scheduler.join(5.0)
    assert scheduler.batches_run == 1
    assert big_pieces_when_small_ended[0] < len(got["big"]) // 2, (big_pieces_when_small_ended, len(got["big"]))
    assert sum(p.tensor.numel() for p in got["big"]) == 1024           # the large answer is whole
    lp = np.zeros(16, np.float32)
    for p in got["small"]:
        lp[p.offset[0] : p.offset[0] + p.tensor.numel()] = p.tensor.numpy()
    want = torch.log_softmax(reference.logits(small), dim=-1)[:-1].gather(-1, torch.as_tensor(small[1:], dtype=torch.long)[:, None])
    assert_close(lp[1:], want[:, 0].numpy())


@pytest.mark.unit
def test_head_steps_are_sized_to_the_time_target(engine):
    """--step-target-ms: the rows of a plain head step measured at start-up, a power of two within [16, chunk]."""
    head, H = engine.head, int(engine.loaded.head.in_features)
    assert head.rows_within(1e-9, 512, H) == 16                 # nothing fits: the least
    assert head.rows_within(60.0, 512, H) == 512                # everything fits: the chunk size
    mid = head.rows_within(0.004, 512, H)
    assert 16 <= mid <= 512 and mid & (mid - 1) == 0
    assert engine.step_rows == 64                               # no target: the chunk size
