"""The request pipeline as front-ends use it: `async with pipeline.request(...)`, `r.run(decoded)`, one Dense.

In-process: a real Pipeline and Scheduler whose batch runner (the engine's place) is a fake with the
real BatchRun signature, yielding pieces of known values. Checks the block's semantics (a refusal
skips it, failures raise Failed with their status, the deadline names its field, cancellation
propagates unless the grace period ended it, the scheduler lets go of a job the block gave up),
the dense collector against numpy, and the one prompt parser of the HTTP shapes.
"""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import torch

from logitserve.events import JobPiece, Piece, SharedTokens
from logitserve.server.admission import ClientLimits
from logitserve.server.dense import Dense
from logitserve.server.http_common import Ctx, TokenTexts
from logitserve.server.requests import ENDED_BY_SHUTDOWN, Decoded, Failed, Pipeline
from logitserve.server.scheduler import Scheduler
from logitserve.server.config import SchedulerConfig
from logitserve.spec import Job, LogprobsOpts, ModelKind, ModelLimits, OutputKind
from logitserve.tokenizing import TextEncoder

pytestmark = pytest.mark.unit

V = 50
LIMITS = ModelLimits(kind=ModelKind.CAUSAL_LM, vocab_size=V, max_seq_len=64)


def _values(seq: np.ndarray) -> torch.Tensor:
    """What the fake engine answers for a sequence: its ids / 100 (known, so checkable)."""
    return torch.from_numpy(seq.astype(np.float32) / 100)


class FakeEngine:
    """A BatchRun: (jobs, skip) -> events. Each job: 2 shared tokens, then one TOKEN_LOGPROBS piece per sequence;
    with `gate` set, it waits for the gate (or its job's skip) before the pieces."""

    def __init__(self):
        self.gate: threading.Event | None = None

    def __call__(self, jobs: list[Job], skip, between=None, short=False):
        for j, job in enumerate(jobs):
            yield SharedTokens(j, 2)
            while self.gate is not None and not self.gate.wait(0.01):
                if skip(j):
                    break
            for s, seq in enumerate(job.sequences):
                if not skip(j):
                    yield JobPiece(j, Piece(OutputKind.TOKEN_LOGPROBS, s, (len(seq),), (0,), _values(seq)))


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture
def pipeline(engine):
    scheduler = Scheduler(engine, SchedulerConfig(batch_delay_s=0.0))
    yield Pipeline(scheduler, LIMITS, client_limits=ClientLimits(max_in_flight=1))
    scheduler.shutdown()
    scheduler.join(5.0)


def _decoded(*lengths: int, **kw) -> Decoded:
    seqs = tuple(np.arange(1, n + 1, dtype=np.int32) % V for n in lengths)
    return Decoded(Job(sequences=seqs, logprobs=LogprobsOpts()), **kw)


def test_a_request_yields_its_pieces_and_counts_shared_tokens_apart(pipeline):
    decoded = _decoded(3, 5, text_ids=(np.array([7, 8], np.int32),))

    async def go():
        async with pipeline.request("r1", "c") as r:
            pieces = [p async for p in r.run(decoded)]
        return r, pieces

    r, pieces = asyncio.run(go())
    assert r.outcome.ok and r.outcome.job is decoded.job and r.outcome.shared == 2 and pipeline.shared_total == 2
    assert pieces[0].output is OutputKind.INPUT_IDS and pieces[0].tensor.tolist() == [7, 8]   # texts' ids first
    got = {p.sequence: p.tensor for p in pieces[1:]}
    assert all(isinstance(p, Piece) for p in pieces) and sorted(got) == [0, 1]
    for s, seq in enumerate(decoded.job.sequences):
        assert torch.equal(got[s], _values(seq))


def test_a_refused_request_skips_its_block_and_says_why(pipeline):
    ran = []

    async def go():
        async with pipeline.request("outer", "c"):
            with pytest.raises(Failed) as e:               # the client's one request in flight is this one
                async with pipeline.request("inner", "c"):
                    ran.append("inner")
        over = e.value.outcome
        pipeline.drain()
        with pytest.raises(Failed) as e:
            async with pipeline.request("late", "d"):
                ran.append("late")
        return over, e.value.outcome

    over, late = asyncio.run(go())
    assert ran == []
    assert over.status == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-in-flight-per-client is 1" in over.message
    assert late.status == grpc.StatusCode.UNAVAILABLE and "shutting down" in late.message


def test_an_invalid_request_is_failed_naming_the_front_ends_field(pipeline):
    async def go():
        async with pipeline.request("r", "c") as r:
            async for _ in r.run(_decoded(3, 0, sequences_field="prompt")):
                pass

    with pytest.raises(Failed) as e:
        asyncio.run(go())
    o = e.value.outcome
    assert o.status == grpc.StatusCode.INVALID_ARGUMENT and o.field == "prompt[1]" and "empty sequence" in o.message


@pytest.mark.parametrize("stuck", ["engine", "front_end"])
def test_the_deadline_ends_a_request_stuck_anywhere_naming_its_field(pipeline, engine, stuck):
    """Stuck in the engine (no piece comes) or in the front-end (sending a piece never finishes): either way
    DEADLINE_EXCEEDED naming the request's own timeout field, and the scheduler holds nothing after."""
    engine.gate = threading.Event() if stuck == "engine" else None

    async def go():
        try:
            async with pipeline.request("slow", "c") as r:
                async for _ in r.run(_decoded(4, timeout=0.2, timeout_field="parameters[timeout_s]", hold=1000)):
                    await asyncio.Event().wait()               # a client that never takes the piece
        except Failed as f:
            return f.outcome, pipeline.scheduler.held_bytes()

    o, held = asyncio.run(asyncio.wait_for(go(), 20))
    assert o.status == grpc.StatusCode.DEADLINE_EXCEEDED
    assert o.message.startswith("parameters[timeout_s]: request 'slow' did not finish within 0.2 s")
    assert held == 0


def test_a_block_that_gives_up_midway_frees_the_job_at_once(pipeline):
    """The front-end fails after the first piece (the run's pieces are left unread): Failed INTERNAL, and the
    scheduler's hold is free when the block is left, not whenever the generator is collected."""
    async def go():
        try:
            async with pipeline.request("r", "c") as r:
                async for _ in r.run(_decoded(3, 3, hold=1000)):
                    assert pipeline.scheduler.held_bytes() == 1000
                    raise RuntimeError("encoder broke")
        except Failed as f:
            return f.outcome, pipeline.scheduler.held_bytes()

    o, held = asyncio.run(go())
    assert o.status == grpc.StatusCode.INTERNAL and "encoder broke" in o.message
    assert held == 0


@pytest.mark.parametrize("ending", [False, True])
def test_cancellation_propagates_unless_the_grace_period_ended_it(pipeline, engine, ending):
    engine.gate = threading.Event()

    async def one():
        async with pipeline.request("r", "c") as r:
            async for _ in r.run(_decoded(3)):
                pass

    async def go():
        task = asyncio.create_task(one())
        while pipeline.in_flight() == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        pipeline.end_in_flight() if ending else task.cancel()
        return await asyncio.gather(task, return_exceptions=True)

    (result,) = asyncio.run(go())
    engine.gate.set()
    if ending:
        assert isinstance(result, Failed) and result.outcome.status == grpc.StatusCode.UNAVAILABLE
        assert result.outcome.message == ENDED_BY_SHUTDOWN
    else:
        assert isinstance(result, asyncio.CancelledError)
    assert pipeline.in_flight() == 0


def _piece(out: OutputKind, seq: int, full: np.ndarray, rows: slice, dtype=torch.float32) -> Piece:
    part = torch.from_numpy(np.ascontiguousarray(full[rows])).to(dtype)
    return Piece(out, seq, full.shape, (rows.start,) + (0,) * (full.ndim - 1), part)


def test_dense_assembles_pieces_per_sequence_and_zero_padded():
    """Pieces in any order, per sequence of different lengths: `of` is each sequence's array, `padded` the
    [B, ...] stack zero-padded to the longest (numpy builds the reference); BF16 stays BF16."""
    rng = np.random.default_rng(0)
    lengths = [5, 2, 7]
    full = [rng.standard_normal((n, 3)).astype(np.float32) for n in lengths]
    pieces = [_piece(OutputKind.TOPK_VALUES, s, x, slice(a, min(a + 2, len(x))))
              for s, x in enumerate(full) for a in range(0, len(x), 2)]
    pieces += [_piece(OutputKind.TOPK_TAIL, 2, full[2][:, 0], slice(0, 7), torch.bfloat16)]
    rng.shuffle(pieces)

    async def feed():
        for p in pieces:
            yield p

    dense = asyncio.run(Dense.collect(feed(), len(lengths)))
    for s, x in enumerate(full):
        np.testing.assert_array_equal(dense.of(OutputKind.TOPK_VALUES, s), x)
    assert dense.of(OutputKind.TOPK_TAIL, 0) is None and dense.of(OutputKind.TOKEN_LOGPROBS, 0) is None
    reference = np.zeros((3, max(lengths), 3), np.float32)
    for s, x in enumerate(full):
        reference[s, : len(x)] = x
    np.testing.assert_array_equal(dense.padded(OutputKind.TOPK_VALUES).numpy(), reference)
    tail = dense.padded(OutputKind.TOPK_TAIL)
    assert tail.dtype == torch.bfloat16 and tail.shape == (3, 7)
    assert torch.equal(tail[2], torch.from_numpy(full[2][:, 0]).to(torch.bfloat16)) and not tail[:2].any()
    assert dense.padded(OutputKind.CANDIDATE_LOGPROBS) is None


class _CharTokenizer:
    """A tokenizer's call as TextEncoder makes it: each character's code point mod V is one id."""

    def __call__(self, texts, add_special_tokens=True, return_offsets_mapping=False):
        return {"input_ids": [[ord(c) % V for c in t] for t in texts]}


@pytest.fixture
def ctx(pipeline):
    pipeline.text = TextEncoder(_CharTokenizer(), "chars")
    return Ctx(pipeline, SimpleNamespace(vocab_size=V), ("m",), "0", 1 << 20, TokenTexts(None), tables=object())


NEED = "a route's own words"


@pytest.mark.parametrize("value, texts, ids, want", [
    ("ab", True, True, ([[97 % V, 98 % V]], ["ab"], False)),
    (["ab", "c"], True, True, ([[47, 48], [49]], ["ab", "c"], True)),
    ([3, 4.0], True, True, ([[3, 4]], None, False)),
    ([[3], [4, 5]], True, True, ([[3], [4, 5]], None, True)),
    ([[3], [4, 5]], False, True, ([[3], [4, 5]], None, True)),
    (["ab"], True, False, ([[47, 48]], ["ab"], True)),
])
def test_one_prompt_parser_reads_a_text_ids_or_a_list_of_either(ctx, value, texts, ids, want):
    got = asyncio.run(ctx.prompts(value, "prompt", "c", NEED, texts=texts, ids=ids))
    assert [x.tolist() for x in got.seqs] == want[0] and got.texts == want[1] and got.batched == want[2]
    assert all(x.dtype == np.int32 for x in got.seqs)


@pytest.mark.parametrize("value, texts, ids, field, words", [
    (None, True, True, "prompt", NEED),
    ([], True, True, "prompt", NEED),
    ({"a": 1}, True, True, "prompt", NEED),
    ("ab", False, True, "prompt", NEED),                   # ids only: a text is none of them
    ([[1]], True, False, "prompt", NEED),                  # texts only: ids are none of them
    (["a", [1]], True, True, "prompt[0]", "a list of token ids is needed, got str"),
    ([[1], [2.5]], True, True, "prompt[1][0]", "2.5 is not a whole number"),
])
def test_the_prompt_parser_names_the_field_and_says_the_routes_words(ctx, value, texts, ids, field, words):
    from logitserve.errors import InvalidRequest

    with pytest.raises(InvalidRequest) as e:
        asyncio.run(ctx.prompts(value, "prompt", "c", NEED, texts=texts, ids=ids))
    assert e.value.field == field and words in str(e.value)
