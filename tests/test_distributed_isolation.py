"""Across 2 gloo ranks (TP 2, and CP 2): a job that every rank fails on fails alone; the ranks stay in step.

The job is built past validation (a float top_k, what an untyped front-end once let through), so the
error is raised inside the engine on every rank; the batch's other job and the next batch must come
back equal to one-process float64 transformers, and the server's runner must not count a lost rank.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from helpers import Reference, build_model, ref_token_logprobs, run_ranks

pytestmark = pytest.mark.multi_process

V = 1003


def _rank(rank: int, port: int, tp: int, cp: int, directory: str, seqs, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(tp * cp))
    torch.set_num_threads(1)
    from logitserve.distributed import DistributedRunner, follow
    from logitserve.engine import EngineConfig
    from logitserve.events import JobFailed, JobPiece
    from logitserve.parallel import ParallelConfig, init_parallel
    from logitserve.server.app import _rank_engine
    from logitserve.server.config import ModelConfig, ServerConfig
    from logitserve.spec import Job, LogprobsOpts

    ctx = init_parallel(ParallelConfig(tp=tp, cp=cp, collective_timeout_s=30, device="cpu"))
    engine, _ = _rank_engine(ModelConfig(path=directory), ServerConfig(engine=EngineConfig(chunk_size=16)), ctx)
    if rank != 0:
        follow(engine, ctx)
        _leave(ctx)
        return
    runner = DistributedRunner(engine, ctx)
    good = Job(sequences=tuple(np.asarray(s, np.int32) for s in seqs), logprobs=LogprobsOpts(top_k=7))
    bad = Job(sequences=good.sequences, logprobs=LogprobsOpts(top_k=7.0))      # past validation on purpose
    result = {"errors": [], "good": {}, "after": {}}
    for event in runner.run_batch([bad, good]):
        if isinstance(event, JobFailed):
            result["errors"].append((event.job, type(event.error).__name__))
        elif isinstance(event, JobPiece):
            key = "good" if event.job == 1 else "bad_pieces"
            piece = event.piece
            result.setdefault(key, {}).setdefault(piece.sequence, {})[piece.offset[0]] = piece.tensor.numpy()
    for event in runner.run_batch([good]):      # the ranks are still in step
        if isinstance(event, JobPiece):
            piece = event.piece
            result["after"].setdefault(piece.sequence, {})[piece.offset[0]] = piece.tensor.numpy()
    result["failed"] = runner.failed
    runner.stop()
    _leave(ctx)
    out.put(result)


def _leave(ctx) -> None:
    """Both ranks past their last message, then the process group is torn down before the interpreter exits
    (left to interpreter teardown, gloo's threads were destroyed still joinable: SIGABRT, 'terminate called
    without an active exception', one CI run in many)."""
    import torch.distributed as dist

    dist.barrier(group=ctx.control_group)
    dist.destroy_process_group()


def _assemble(parts: dict, seqs) -> list[np.ndarray]:
    return [np.concatenate([parts[i][o] for o in sorted(parts[i])]) for i in range(len(seqs))]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = build_model(tmp_path_factory.mktemp("iso") / "llama", "llama", vocab=V)
    return directory, Reference(directory)


@pytest.mark.parametrize("tp,cp", [(2, 1), (1, 2)])
def test_a_job_every_rank_fails_on_fails_alone(model, tp, cp):
    directory, ref = model
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, V, n).tolist() for n in (5, 40)]
    result = run_ranks(_rank, tp * cp, tp, cp, str(directory), seqs, timeout=240)
    assert result["failed"] is None
    assert result["errors"] and {i for i, _ in result["errors"]} == {0}, result["errors"]
    assert result["errors"][0][1] == "TypeError"
    for got in (_assemble(result["good"], seqs), _assemble(result["after"], seqs)):
        for seq, lp in zip(seqs, got):
            want = ref_token_logprobs(ref.logits(seq), seq, top_k=7)
            finite = np.isfinite(want)
            assert np.array_equal(np.isfinite(lp), finite)
            np.testing.assert_allclose(lp[finite], want[finite], atol=1e-5)
