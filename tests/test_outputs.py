"""Every output over real gRPC on ragged batches, against plain transformers in float64."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import VOCAB, assert_close, check_ranks, random_seqs, ref_rank_bounds, ref_token_logprobs, separated
from logitserve.client import TeacherClient

pytestmark = pytest.mark.live_server

LENGTHS = [1, 2, 17, 40, 33]   # ragged, crossing the server's 16-row chunks


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_token_logprobs_match_reference(causal, temperature):
    arch, server, ref = causal
    seqs = random_seqs(np.random.default_rng(1), LENGTHS)
    with TeacherClient(server.address) as c:
        got = c.logprobs(seqs, temperature=temperature)
    for seq, lp in zip(seqs, got):
        assert lp.dtype == np.float32 and lp[0] == 0.0
        assert_close(lp, ref_token_logprobs(ref.logits(seq, temperature), seq))


@pytest.mark.parametrize("temperature,top_p", [(1.0, None), (0.7, 0.5)])
def test_token_ranks_match_reference(causal, temperature, top_p):
    """Each target's 1-based rank in the unfiltered distribution, beside its (filtered) logprob; with and
    without an output span."""
    arch, server, ref = causal
    seqs = random_seqs(np.random.default_rng(11), LENGTHS)
    with TeacherClient(server.address) as c:
        r = c.forward(seqs, temperature=temperature, logprobs=True, top_p=top_p, token_ranks=True)
        spans = [max(1, len(s) - 5) for s in seqs]
        s = c.forward(seqs, temperature=temperature, logprobs=True, token_ranks=True, prompt_lengths=spans)
    for j, seq in enumerate(seqs):
        z = ref.logits(seq, temperature)
        check_ranks(r.token_ranks[j], z, seq)
        assert_close(r.logprobs[j], ref_token_logprobs(z, seq, top_p=top_p))
        lo, hi = ref_rank_bounds(z, seq)
        P = spans[j]
        assert s.token_ranks[j].shape == (len(seq) - P,)
        assert np.all((s.token_ranks[j] >= lo[P:]) & (s.token_ranks[j] <= hi[P:]))


@pytest.mark.parametrize("k,as_logprobs", [(1, False), (7, False), (7, True), (VOCAB, False)])
def test_topk_values_and_ids_match_reference(causal, k, as_logprobs):
    arch, server, ref = causal
    seqs = random_seqs(np.random.default_rng(2), LENGTHS)
    with TeacherClient(server.address) as c:
        values, ids = c.topk(seqs, k, as_logprobs=as_logprobs, temperature=0.8)
    for seq, v, i in zip(seqs, values, ids):
        z = ref.logits(seq, 0.8)
        if as_logprobs:
            z = torch.log_softmax(z, -1)
        sorted_v, sorted_i = torch.sort(z, dim=-1, descending=True)
        want_v, want_i = sorted_v[:, :k].numpy(), sorted_i[:, :k].numpy()
        assert v.shape == (len(seq), k) and i.dtype == np.int32
        assert_close(v, want_v)
        assert np.all(np.diff(v, axis=-1) <= 0), "top-k values must be sorted descending"
        sep = separated(sorted_v.numpy(), k)
        assert sep.mean() > 0.5
        assert np.array_equal(i[sep], want_i[sep])


def test_candidate_logprobs_match_reference(causal):
    arch, server, ref = causal
    rng = np.random.default_rng(3)
    seqs = random_seqs(rng, LENGTHS)
    cands = [rng.integers(0, VOCAB, (len(s), 1 + j)) for j, s in enumerate(seqs)]   # c differs per sequence
    with TeacherClient(server.address) as c:
        got = c.candidate_logprobs(seqs, cands, temperature=1.3)
    for seq, cand, lp in zip(seqs, cands, got):
        want = torch.log_softmax(ref.logits(seq, 1.3), -1).gather(-1, torch.as_tensor(cand))
        assert_close(lp, want.numpy())


def test_full_logits_slices_match_reference(causal):
    arch, server, ref = causal
    seqs = random_seqs(np.random.default_rng(4), [20, 35])
    with TeacherClient(server.address) as c:
        whole = c.full_logits(seqs, temperature=0.9)
        part = c.full_logits(seqs, seq_range=(3, 19), vocab_range=(100, 777), temperature=0.9)
    for seq, w, p in zip(seqs, whole, part):
        z = ref.logits(seq, 0.9).numpy()
        assert w.shape == (len(seq), VOCAB) and w.dtype == np.float32
        assert_close(w, z)
        assert_close(p, z[3:19, 100:777])


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_half_slices_equal_fp32_reference_rounded(causal, dtype, torch_dtype):
    arch, server, ref = causal
    seqs = random_seqs(np.random.default_rng(5), [30, 9])
    # One sequence a request: its body then has the reference's [1, L] shape, so its fp32 logits are bitwise
    # the reference's in either batching mode, and rounding them must give exactly the wire's values.
    with TeacherClient(server.address) as c:
        got = [c.full_logits([s], dtype=dtype, temperature=0.9)[0] for s in seqs]
        as_torch = [c.full_logits([s], dtype="bf16", bf16_as_torch=True)[0] for s in seqs] if dtype == "bf16" else None
    for j, (seq, g) in enumerate(zip(seqs, got)):
        want = ref.logits(seq, 0.9, fp32=True).to(torch_dtype).float().numpy()
        assert np.array_equal(np.asarray(g, dtype=np.float32), want)
        if as_torch is not None:
            t = as_torch[j]
            assert t.dtype == torch.bfloat16
            assert torch.equal(t, ref.logits(seq, 1.0, fp32=True).to(torch.bfloat16))


@pytest.mark.parametrize("top_k,top_p", [(5, None), (None, 0.9), (None, 0.3), (50, 0.8), (VOCAB, 1.0)])
def test_filtered_logprobs_match_reference_rule(causal, top_k, top_p):
    arch, server, ref = causal
    seqs = random_seqs(np.random.default_rng(6), LENGTHS)
    with TeacherClient(server.address) as c:
        r = c.forward(seqs, logprobs=True, top_k=top_k, top_p=top_p, temperature=0.75)
    assert r.applied.temperature == 0.75 and r.applied.top_k == top_k
    assert (r.applied.top_p is None) == (top_p is None)
    outside = 0
    for seq, lp in zip(seqs, r.logprobs):
        want = ref_token_logprobs(ref.logits(seq, 0.75), seq, top_k, top_p)
        assert_close(lp, want)
        outside += int(np.isneginf(want).sum())
    if top_k == 5 or top_p == 0.3:
        assert outside > 0, "the filter should have put some targets outside the kept set"


def test_one_pass_gives_every_output_with_model_identity(causal):
    arch, server, ref = causal
    rng = np.random.default_rng(7)
    seqs = random_seqs(rng, [12, 3])
    cands = [rng.integers(0, VOCAB, (len(s), 4)) for s in seqs]
    with TeacherClient(server.address) as c:
        info = c.model_info()
        r = c.forward(seqs, temperature=1.0, logprobs=True, topk=3, candidates=cands, full_logits=True,
                      vocab_range=(0, 10))
    assert r.model.content_hash == info.content_hash and r.model.vocab_size == VOCAB == info.vocab_size
    assert info.architecture.lower().startswith(arch[:4]) and info.kind == "causal_lm"
    for seq, lp, tv, cl, fl in zip(seqs, r.logprobs, r.topk_values, r.candidate_logprobs, r.full_logits):
        z = ref.logits(seq)
        assert_close(lp, ref_token_logprobs(z, seq))
        assert_close(tv, torch.sort(z, -1, descending=True).values[:, :3].numpy())
        assert_close(cl, torch.log_softmax(z, -1).gather(-1, torch.as_tensor(cands[0 if len(seq) == 12 else 1])).numpy())
        assert_close(fl, z[:, :10].numpy())


def test_blocking_clients_share_one_loop_and_closing_one_leaves_the_others_exact(llama_server, llama_ref, caplog):
    """Every TeacherClient of a process runs on one event-loop thread that is never closed: a client closed with
    requests in flight leaves no grpc event bound for a closed loop ("Event loop is closed", logged from the
    other clients' loop when each client had its own), and a blocking call on that thread is refused, not hung."""
    import asyncio
    import concurrent.futures
    import logging

    from logitserve.client import TeacherClient, Wanted

    seq = random_seqs(np.random.default_rng(3), [40])[0]
    want = ref_token_logprobs(llama_ref.logits(seq), seq)
    a, b = TeacherClient(llama_server.address), TeacherClient(llama_server.address)
    try:
        assert a._loop is b._loop
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            for _ in range(3):
                pending = [a.submit([seq], Wanted(logprobs=True)) for _ in range(4)]
                a.close()                                    # its streams cancelled with requests in flight
                assert not concurrent.futures.wait(pending, timeout=30).not_done      # none left hanging
                for f in pending:                            # each answered exactly, or ended "client closed"
                    if f.exception() is None:
                        assert_close(f.result().logprobs[0], want)
                    else:
                        assert "CANCELLED: client closed" in str(f.exception()), f.exception()
                for _ in range(3):
                    assert_close(b.logprobs([seq])[0], want)
                a = TeacherClient(llama_server.address)
        assert not [r for r in caplog.records if "closed" in r.getMessage() + str(r.exc_info)], caplog.records

        async def on_the_loop():
            with pytest.raises(RuntimeError, match="event-loop thread"):
                b.logprobs([seq])
        asyncio.run_coroutine_threadsafe(on_the_loop(), b._loop).result(timeout=30)
        assert_close(b.logprobs([seq])[0], want)
    finally:
        a.close()
        b.close()


def test_many_requests_in_flight_on_one_stream(client, llama_ref):
    from logitserve.client import Wanted

    rng = np.random.default_rng(8)
    batches = [random_seqs(rng, [int(n)]) for n in rng.integers(1, 60, 12)]
    futures = [client.submit(b, Wanted(logprobs=True)) for b in batches]
    for b, f in zip(batches, futures):
        assert_close(f.result(timeout=60).logprobs[0], ref_token_logprobs(llama_ref.logits(b[0]), b[0]))


def test_async_client_gathers_concurrent_requests(llama_server, llama_ref):
    import asyncio

    from logitserve.client import AsyncTeacherClient

    seqs = random_seqs(np.random.default_rng(9), [5, 25, 50, 8])

    async def main():
        async with AsyncTeacherClient(llama_server.address) as c:
            return await asyncio.gather(*(c.logprobs([s]) for s in seqs))

    for s, got in zip(seqs, asyncio.run(main())):
        assert_close(got[0], ref_token_logprobs(llama_ref.logits(s), s))
