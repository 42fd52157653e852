"""Short head steps while small jobs keep coming (--short-step-ms): when the scheduler asks for them, and that a
batch run in them (more, smaller steps; under TP 2 and PP 2 on every rank alike) answers exactly as in full steps,
against float64 transformers."""
from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest
import torch

from helpers import Reference, assert_same_signature, build_model, ref_token_logprobs, run_ranks
from logitserve.server.batch_runner import engine_batch_runner
from logitserve.server.scheduler import Scheduler
from logitserve.server.config import SchedulerConfig
from logitserve.spec import Job, LogprobsOpts

V = 1003


def _job(n: int) -> Job:
    return Job(sequences=(np.full(n, 5, np.int32),), logprobs=LogprobsOpts())


class Recorder:
    """A batch runner that records (tokens of each job, short) per batch; each of its jobs takes `steps` steps of
    10 ms, with the scheduler's `between` after each (as engine_batch_runner)."""

    def __init__(self, steps: int = 6):
        self.batches: list[tuple[list[int], bool]] = []
        self.steps = steps

    def run(self, jobs, skip, between=None, short=False):
        self.batches.append(([j.num_tokens for j in jobs], short))
        for _ in range(self.steps if len(jobs[0].sequences[0]) > 64 else 1):
            time.sleep(0.01)
            nested = between() if between is not None else None
            if nested is not None:
                nested(self.run)
        yield from ()


async def _send(scheduler: Scheduler, job: Job, delay: float = 0.0) -> None:
    await asyncio.sleep(delay)
    async for _ in scheduler.stream(job, f"c{id(job)}"):
        pass


@pytest.mark.unit
def test_batches_with_a_large_job_run_short_while_small_jobs_keep_coming():
    recorder = Recorder()
    assert_same_signature(recorder.run, engine_batch_runner(lambda jobs, skip, short=False: iter(())))
    scheduler = Scheduler(recorder.run, SchedulerConfig(batch_delay_s=0, interject_after_s=0.001, short_steps_s=0.5,
                                                        interject_tokens=64))

    async def scenario():
        await _send(scheduler, _job(2000))                       # alone: full steps
        await asyncio.gather(_send(scheduler, _job(2000)), _send(scheduler, _job(16), 0.02))   # 16 runs between
        await _send(scheduler, _job(2000))                       # small jobs came lately: short steps
        await _send(scheduler, _job(16))                         # small jobs alone: never short
        await asyncio.sleep(0.6)
        await _send(scheduler, _job(2000))                       # none for short_steps_s: full steps again
        await _send(scheduler, _job(16))                         # a small job arrived (ran alone, not between)
        await _send(scheduler, _job(2000))                       # ... so the next large batch runs short
    try:
        asyncio.run(scenario())
    finally:
        scheduler.shutdown()
        scheduler.join(5.0)
    assert recorder.batches == [([2000], False), ([2000], False), ([16], False), ([2000], True), ([16], False),
                                ([2000], False), ([16], False), ([2000], True)], recorder.batches


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = build_model(tmp_path_factory.mktemp("short") / "llama", "llama", vocab=V)
    return directory, Reference(directory)


def _outputs(steps) -> tuple[int, dict]:
    """(the number of steps, {(sequence, offset): logprobs}) of a batch's Steps."""
    from logitserve.events import JobPiece

    n, got = 0, {}
    for step in steps:
        n += 1
        for e in step.events:
            if isinstance(e, JobPiece):
                got[(e.piece.sequence, e.piece.offset[0])] = e.piece.tensor.numpy()
    return n, got


def _assemble(parts: dict, count: int) -> list[np.ndarray]:
    return [np.concatenate([parts[k] for k in sorted(k for k in parts if k[0] == i)]) for i in range(count)]


@pytest.mark.unit
def test_a_batch_in_short_steps_takes_more_steps_and_answers_the_same(model):
    from logitserve.engine import Engine, EngineConfig
    from logitserve.loading import load_model

    directory, ref = model
    engine = Engine(load_model(directory), EngineConfig(chunk_size=64, short_step_target_s=1e-9))
    assert (engine.step_rows, engine.short_step_rows) == (64, 16)       # nothing fits 1 ns: the least
    seqs = [np.random.default_rng(s).integers(0, V, n).astype(np.int32) for s, n in ((1, 300), (2, 200))]
    job = Job(sequences=tuple(seqs), logprobs=LogprobsOpts(top_k=7))
    full_steps, full = _outputs(engine.batch_steps([job]))
    short_steps, short = _outputs(engine.batch_steps([job], short=True))
    assert short_steps >= 3 * full_steps, (short_steps, full_steps)
    for seq, a, b in zip(seqs, _assemble(full, 2), _assemble(short, 2)):
        want = ref_token_logprobs(ref.logits(seq), seq, top_k=7)
        finite = np.isfinite(want)
        for lp in (a, b):
            assert np.array_equal(np.isfinite(lp), finite)
            np.testing.assert_allclose(lp[finite], want[finite], atol=1e-5)


def _rank(rank: int, port: int, tp: int, pp: int, directory: str, seqs, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(tp * pp))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from logitserve.distributed import DistributedRunner, follow
    from logitserve.engine import EngineConfig
    from logitserve.events import JobPiece
    from logitserve.parallel import ParallelConfig, init_parallel
    from logitserve.server.app import _rank_engine
    from logitserve.server.config import ModelConfig, ServerConfig

    ctx = init_parallel(ParallelConfig(tp=tp, pp=pp, collective_timeout_s=30, device="cpu"))
    config = EngineConfig(chunk_size=64, short_step_target_s=1e-9, pp_microbatch_tokens=128)
    engine, _ = _rank_engine(ModelConfig(path=directory), ServerConfig(engine=config), ctx)
    if rank == 0:
        runner = DistributedRunner(engine, ctx)
        job = Job(sequences=tuple(np.asarray(s, np.int32) for s in seqs), logprobs=LogprobsOpts(top_k=7))
        result = {"rows": (engine.step_rows, engine.short_step_rows)}
        for name, short in (("short", True), ("full", False), ("short again", True)):
            parts = result.setdefault(name, {})
            for event in runner.run_batch([job], short=short):
                if isinstance(event, JobPiece):
                    parts[(event.piece.sequence, event.piece.offset[0])] = event.piece.tensor.numpy()
        result["failed"] = runner.failed
        runner.stop()
        out.put(result)
    else:
        follow(engine, ctx)
    dist.barrier(group=ctx.control_group)
    dist.destroy_process_group()


@pytest.mark.multi_process
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_short_steps_keep_the_ranks_in_step_and_exact(model, tp, pp):
    directory, ref = model
    rng = np.random.default_rng(4)
    seqs = [rng.integers(0, V, n).tolist() for n in (300, 90)]
    result = run_ranks(_rank, tp * pp, tp, pp, str(directory), seqs)
    assert result["failed"] is None and result["rows"] == (64, 16)
    for name in ("short", "full", "short again"):
        for seq, lp in zip(seqs, _assemble(result[name], len(seqs))):
            want = ref_token_logprobs(ref.logits(seq), seq, top_k=7)
            finite = np.isfinite(want)
            assert np.array_equal(np.isfinite(lp), finite), name
            np.testing.assert_allclose(lp[finite], want[finite], atol=1e-5, err_msg=name)
