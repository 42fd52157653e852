"""Packed batching: packed results equal per-sequence results within the documented bound and the float64
reference, no sequence sees another's tokens, failures and cancellations stay with their job."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import (PACKED_ATOL, CliServer, Reference, assert_close, assert_same_signature, build_model,
                     filter_rows_decided, random_seqs, ref_token_logprobs, separated, serve_dir)
from logitserve.client import TeacherClient

V = 1003
MAX_POS = 1024


def _mix(rng, n: int) -> list[np.ndarray]:
    """n sequences with lengths drawn in 1..1000, plus the edge lengths 1 and 2."""
    return random_seqs(rng, [1, 2, *rng.integers(1, 1001, n)], vocab=V)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing")
    out = {arch: build_model(root / arch, arch, vocab=V, max_pos=MAX_POS, seed=5) for arch in ("llama", "qwen2", "gpt2")}
    out["reward"] = build_model(root / "reward", "llama", kind="reward", vocab=V, max_pos=MAX_POS, num_labels=2, seed=6)
    return out


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2"])
def pair(request, dirs):
    """(packed server, exact server, float64 reference) on one architecture; 64-row head chunks."""
    packed = serve_dir(dirs[request.param], chunk_size=64, batching="packed")
    exact = serve_dir(dirs[request.param], chunk_size=64, batching="exact")
    yield packed, exact, Reference(dirs[request.param])
    packed.stop()
    exact.stop()


def _forward(server, seqs, **kw):
    with TeacherClient(server.address) as c:
        return c.forward(seqs, **kw)


@pytest.mark.live_server
def test_packed_equals_exact_and_reference_on_random_mixes(pair):
    packed, exact, ref = pair
    rng = np.random.default_rng(71)
    seqs = _mix(rng, 8)
    cands = [rng.integers(0, V, (len(s), 5)) for s in seqs]
    kw = dict(temperature=0.8, logprobs=True, topk=12, candidates=cands, full_logits=True, vocab_range=(100, 180))
    got, want = _forward(packed, seqs, **kw), _forward(exact, seqs, **kw)
    assert (got.batching, want.batching) == ("packed", "exact")
    for j, seq in enumerate(seqs):
        for name in ("logprobs", "topk_values", "candidate_logprobs", "full_logits"):   # the documented bound
            np.testing.assert_allclose(getattr(got, name)[j], getattr(want, name)[j], atol=PACKED_ATOL, rtol=0)
        z = ref.logits(seq, 0.8)                                                            # [L, V] float64
        assert_close(got.logprobs[j], ref_token_logprobs(z, seq))
        sorted_v, sorted_i = torch.sort(z, -1, descending=True)
        assert_close(got.topk_values[j], sorted_v[:, :12].numpy())
        sep = separated(sorted_v.numpy(), 12)
        assert np.array_equal(got.topk_ids[j][sep], sorted_i[:, :12].numpy()[sep])
        assert np.array_equal(got.topk_ids[j][sep], want.topk_ids[j][sep])
        assert_close(got.candidate_logprobs[j], torch.log_softmax(z, -1).gather(-1, torch.as_tensor(cands[j])).numpy())
        assert_close(got.full_logits[j], z[:, 100:180].numpy())


@pytest.mark.live_server
@pytest.mark.parametrize("top_k,top_p,temperature", [(20, None, 1.0), (None, 0.7, 1.3), (64, 0.9, 0.6)])
def test_packed_filtered_logprobs_equal_reference(pair, top_k, top_p, temperature):
    packed, exact, ref = pair
    seqs = _mix(np.random.default_rng(72), 5)
    got = _forward(packed, seqs, logprobs=True, top_k=top_k, top_p=top_p, temperature=temperature)
    want = _forward(exact, seqs, logprobs=True, top_k=top_k, top_p=top_p, temperature=temperature)
    decided = 0
    for j, seq in enumerate(seqs):
        z = ref.logits(seq, temperature)
        # lp[t] reads row t-1: compare where that row's kept set is decided beyond fp32 rounding
        rows = np.concatenate([[True], filter_rows_decided(z, top_k, top_p)[:-1]])
        decided += rows.sum()
        assert_close(got.logprobs[j][rows], ref_token_logprobs(z, seq, top_k=top_k, top_p=top_p)[rows])
        np.testing.assert_allclose(got.logprobs[j][rows], want.logprobs[j][rows], atol=PACKED_ATOL, rtol=0)
    assert decided >= 0.95 * sum(len(s) for s in seqs)


@pytest.mark.live_server
def test_no_sequence_sees_another(pair):
    """Changing one sequence's tokens leaves every other sequence's outputs bitwise unchanged, and each
    sequence's outputs match it run alone within the bound: no mask lets sequences attend across."""
    packed, _, ref = pair
    rng = np.random.default_rng(73)
    seqs = _mix(rng, 6)
    other = [s.copy() for s in seqs]
    victim = 4
    other[victim] = rng.integers(0, V, len(seqs[victim]))
    kw = dict(logprobs=True, topk=8, full_logits=True, vocab_range=(0, 50))
    a, b = _forward(packed, seqs, **kw), _forward(packed, other, **kw)
    for j in range(len(seqs)):
        same = all(np.array_equal(getattr(a, n)[j], getattr(b, n)[j]) for n in ("logprobs", "topk_values", "full_logits"))
        assert same == (j != victim), j
    alone = _forward(packed, [seqs[3]], **kw)
    np.testing.assert_allclose(a.full_logits[3], alone.full_logits[0], atol=PACKED_ATOL, rtol=0)
    assert_close(a.full_logits[3], ref.logits(seqs[3])[:, :50].numpy())


@pytest.mark.live_server
def test_packed_reward_scores_equal_reference_and_exact(dirs):
    ref = Reference(dirs["reward"])
    seqs = [np.minimum(s + 1, V - 1) for s in _mix(np.random.default_rng(74), 10)]   # no pad id (0) inside
    packed = serve_dir(dirs["reward"], batching="packed")
    exact = serve_dir(dirs["reward"], batching="exact")
    try:
        got, want = _forward(packed, seqs, scores=True), _forward(exact, seqs, scores=True)
    finally:
        packed.stop()
        exact.stop()
    for j, seq in enumerate(seqs):
        with torch.no_grad():
            ref_score = ref.model(torch.as_tensor(seq)[None]).logits[0].numpy()
        np.testing.assert_allclose(got.scores[j], ref_score, atol=1e-5, rtol=0)
        np.testing.assert_allclose(got.scores[j], want.scores[j], atol=PACKED_ATOL, rtol=0)


@pytest.mark.multi_process
def test_packed_under_tp2_equals_reference_and_isolates_sequences(dirs):
    ref = Reference(dirs["llama"])
    rng = np.random.default_rng(75)
    seqs = _mix(rng, 5)
    other = [s.copy() for s in seqs]
    other[2] = rng.integers(0, V, len(seqs[2]))
    server = CliServer("--model", str(dirs["llama"]), "--tp", "2", "--batching", "packed", "--logprob-chunk-size", "64")
    try:
        with TeacherClient(server.address) as c:
            info = c.model_info()
            kw = dict(logprobs=True, topk=6, full_logits=True, vocab_range=(490, 520), temperature=0.9)
            a, b = c.forward(seqs, **kw), c.forward(other, **kw)
    finally:
        assert server.stop() == 0
    assert info.tp_size == 2 and info.batching == "packed" and a.batching == "packed"
    for j, seq in enumerate(seqs):
        z = ref.logits(seq, 0.9)
        assert_close(a.logprobs[j], ref_token_logprobs(z, seq))
        assert_close(a.full_logits[j], z[:, 490:520].numpy())
        sorted_v, sorted_i = torch.sort(z, -1, descending=True)
        sep = separated(sorted_v.numpy(), 6)
        assert np.array_equal(a.topk_ids[j][sep], sorted_i[:, :6].numpy()[sep])
        same = np.array_equal(a.logprobs[j], b.logprobs[j]) and np.array_equal(a.full_logits[j], b.full_logits[j])
        assert same == (j != 2), j


# -- the engine alone: failures and cancellations stay with their job --------------------------------------
@pytest.fixture(scope="module")
def engine(dirs):
    from logitserve.engine import Engine, EngineConfig
    from logitserve.loading import load_model

    return Engine(load_model(dirs["llama"]), EngineConfig(chunk_size=64))


def _jobs(rng):
    from logitserve.spec import Job, LogprobsOpts, TopKOpts

    return [Job(tuple(s.astype(np.int32) for s in random_seqs(rng, lens, vocab=V)), temperature=t,
                logprobs=LogprobsOpts(), topk=TopKOpts(4))
            for lens, t in (([30, 90], 1.0), ([13, 40], 0.77), ([25], 1.2))]


def _collect(steps, n):
    from logitserve.events import JobFailed, JobPiece

    out = {j: [] for j in range(n)}
    errors = {}
    for step in steps:
        for e in step.events:
            if isinstance(e, JobFailed):
                errors[e.job] = e.error
            elif isinstance(e, JobPiece):
                out[e.job].append(e.piece)
    return out, errors


def _assemble(pieces, job):
    """Token logprobs per sequence from pieces, checking every row came once."""
    from logitserve.spec import OutputKind

    out = [np.full(len(s), np.nan, np.float32) for s in job.sequences]
    for p in pieces:
        if p.output is OutputKind.TOKEN_LOGPROBS:
            seg = out[p.sequence][p.offset[0] : p.offset[0] + len(p.tensor)]
            assert np.isnan(seg).all()
            seg[:] = p.tensor.numpy()
    assert not any(np.isnan(x).any() for x in out)
    return out


@pytest.mark.unit
def test_a_failing_job_fails_alone_in_a_shared_pack_and_head_chunk(engine, monkeypatch):
    import logitserve.head as head

    jobs = _jobs(np.random.default_rng(76))
    alone = [_assemble(list(engine.run(job)), job) for job in jobs]
    real = head.reduce_block

    def flaky(job, z, h, segs, hs, cands):   # the head fails for job 1 only
        if job.temperature == 0.77:
            raise RuntimeError("injected head failure")
        return real(job, z, h, segs, hs, cands)
    monkeypatch.setattr(head, "reduce_block", flaky)
    _only_job_1_fails(engine, jobs, alone, "injected head failure")
    monkeypatch.setattr(head, "reduce_block", real)

    real_packed, real_hidden = engine.packed_hidden, engine.hidden
    packs, redone = [], []

    def packed_hidden(ids, lengths, starts=None, parents=None):   # a pack holding job 1's 13-token sequence fails
        packs.append(list(lengths))                                 # as a whole...
        if 13 in lengths:
            raise RuntimeError("injected body failure")
        return real_packed(ids, lengths, starts, parents)

    def hidden(ids, positions):            # ...and so does that sequence alone, when the pack is redone
        redone.append(len(ids))
        if len(ids) == 13:
            raise RuntimeError("injected body failure")
        return real_hidden(ids, positions)
    assert_same_signature(packed_hidden, real_packed)
    assert_same_signature(hidden, real_hidden)
    monkeypatch.setattr(engine, "packed_hidden", packed_hidden)
    _only_job_1_fails(engine, jobs, alone, "injected body failure")
    failed = [i for i, p in enumerate(packs) if 13 in p and len(p) > 1]
    assert failed, f"no pack held the 13-token sequence (packs {packs}): the pack path never ran"
    # a shared pack: it held other jobs' sequences too; it, and it alone, is redone per sequence (as packs of one,
    # or through `hidden`), each of its members once (job 1's 40-token one at most once: the redo may reach it
    # before or after the 13 fails)
    members = sorted(packs[failed[0]])
    assert len(failed) == 1 and len(members) > 2, packs
    redone += [p[0] for p in packs[failed[0] + 1 :] if len(p) == 1]
    assert sorted(n for n in redone if n != 40) == [n for n in members if n != 40] and redone.count(40) <= 1, (packs, redone)


def _only_job_1_fails(engine, jobs, alone, message: str) -> None:
    out, errors = _collect(engine.batch_steps(jobs), len(jobs))
    assert set(errors) == {1} and message in str(errors[1])
    for j in (0, 2):
        for got, want in zip(_assemble(out[j], jobs[j]), alone[j]):
            np.testing.assert_allclose(got, want, atol=PACKED_ATOL, rtol=0)


@pytest.mark.unit
def test_a_cancelled_job_stops_and_the_others_finish(engine):
    jobs = _jobs(np.random.default_rng(77))
    cancelled = set()
    out = {j: [] for j in range(len(jobs))}
    for step in engine.batch_steps(jobs, skip=lambda j: j in cancelled):
        for j, pieces in _collect([step], len(jobs))[0].items():
            out[j] += pieces
        if out[0]:
            cancelled.add(0)
    full = _collect(engine.batch_steps(jobs[:1]), 1)[0][0]
    assert 0 < len(out[0]) < len(full)
    for j in (1, 2):
        _assemble(out[j], jobs[j])


@pytest.mark.unit
def test_memory_budget_under_a_packed_body_refuses_to_start(dirs):
    from logitserve.loading import load_model
    from logitserve.server.app import memory_estimator
    from logitserve.server.config import SchedulerConfig, ServerConfig

    config = ServerConfig(scheduler=SchedulerConfig(memory_budget_bytes=4 << 20))
    with pytest.raises(ValueError, match="--memory-budget 4 MiB is under a packed body of 8192 tokens"):
        memory_estimator(load_model(dirs["llama"]), config, V, pack_tokens=8192)
    assert memory_estimator(load_model(dirs["llama"]), config, V, pack_tokens=0)    # exact mode starts


# -- the attention function and the pack plan on their own ---------------------------------------------
def _reference_attention(q, k, v, lengths, window=None, softcap=None):
    """Per sequence, an explicit causal (sliding-window, capped) softmax in float64. q: [1, H, N, D], k/v: [1, Hkv, N, D]."""
    H, Hkv = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[0, :, start : start + n] for t in (q, k, v))           # [H, n, D]
        s = qs @ ks.transpose(-1, -2) / q.shape[-1] ** 0.5                     # [H, n, n]
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        d = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        visible = (d >= 0) & (d < (window or n + 1))
        s = s.masked_fill(~visible, float("-inf"))
        out.append((torch.softmax(s, -1) @ vs).transpose(0, 1))                # [n, H, D]
        start += n
    return torch.cat(out)[None]                                                # [1, N, H, D]


@pytest.mark.unit
@pytest.mark.parametrize("window,softcap", [(None, None), (4, None), (None, 0.7), (4, 0.7)])
def test_varlen_attention_equals_per_sequence_softmax(window, softcap):
    from logitserve.attention import packed_forward, varlen_attention_forward

    torch.manual_seed(0)
    lengths = [1, 5, 5, 17, 3, 5]
    N = sum(lengths)
    q = torch.randn(1, 4, N, 8, dtype=torch.float64)
    k, v = torch.randn(1, 2, N, 8, dtype=torch.float64), torch.randn(1, 2, N, 8, dtype=torch.float64)
    with packed_forward(lengths, torch.device("cpu")):
        got, _ = varlen_attention_forward(None, q, k, v, None, scaling=8 ** -0.5, sliding_window=window, softcap=softcap)
    torch.testing.assert_close(got, _reference_attention(q, k, v, lengths, window, softcap), atol=1e-12, rtol=0)
    alone, _ = varlen_attention_forward(None, q[:, :, :1], k[:, :, :1], v[:, :, :1], None, scaling=8 ** -0.5)
    torch.testing.assert_close(alone, _reference_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], [1]))


@pytest.mark.unit
def test_plan_packs_bounds_tokens_and_keeps_order():
    from logitserve.packing import plan_packs

    items = [(0, 0, 5), (0, 1, 7), (1, 0, 30), (2, 0, 3), (2, 1, 4)]
    packs = plan_packs(items, max_tokens=12)
    assert [[(m.job, m.sequence) for m in p.members] for p in packs] == [[(0, 0), (0, 1)], [(1, 0)], [(2, 0), (2, 1)]]
    assert [p.tokens for p in packs] == [12, 30, 7]          # a sequence over the bound packs alone
    assert [m.offset for m in packs[2].members] == [0, 3]
    # A sequence much longer than the pack so far starts its own: the short one is not held behind its body.
    packs = plan_packs([(0, 0, 16), (1, 0, 1024), (2, 0, 1000), (3, 0, 64)], max_tokens=4096)
    assert [[m.job for m in p.members] for p in packs] == [[0], [1, 2, 3]]
    assert [p.tokens for p in plan_packs([(j, 0, 64) for j in range(64)], max_tokens=4096)] == [4096]


@pytest.mark.unit
def test_attention_sinks_are_refused_not_dropped():
    from logitserve.attention import varlen_attention_forward

    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(NotImplementedError, match="--batching exact"):
        varlen_attention_forward(None, q, q, q, None, s_aux=torch.zeros(2))


@pytest.mark.unit
def test_a_model_with_attention_sinks_is_refused_at_startup_in_packed_mode_and_serves_exact(tmp_path):
    import transformers as tf

    from logitserve.engine import Batching, Engine, EngineConfig
    from logitserve.loading import load_model

    cfg = tf.GptOssConfig(vocab_size=V, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                          num_experts_per_tok=2, pad_token_id=0)
    torch.manual_seed(3)
    tf.GptOssForCausalLM(cfg).float().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"attention sinks .*--batching exact"):
        Engine(load_model(tmp_path), EngineConfig(batching=Batching.PACKED))
    assert Engine(load_model(tmp_path), EngineConfig(batching=Batching.EXACT)).batching is Batching.EXACT


@pytest.mark.live_server
def test_packed_gemma2_capped_scores_and_sliding_window_equal_reference(tmp_path):
    """Gemma-2 attention: tanh-capped scores and sliding-window layers, packed, against float64 transformers."""
    import transformers as tf

    cfg = tf.Gemma2Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=MAX_POS,
                          sliding_window=8, attn_logit_softcapping=1.5, final_logit_softcapping=None,
                          query_pre_attn_scalar=16, initializer_range=0.2, pad_token_id=0)
    torch.manual_seed(8)
    tf.Gemma2ForCausalLM(cfg).float().eval().save_pretrained(tmp_path, safe_serialization=True)
    ref = Reference(tmp_path)
    seqs = random_seqs(np.random.default_rng(78), [1, 5, 9, 40, 23], vocab=V)
    server = serve_dir(tmp_path, chunk_size=16, batching="packed")
    try:
        got = _forward(server, seqs, logprobs=True, full_logits=True, vocab_range=(0, 64))
    finally:
        server.stop()
    for j, seq in enumerate(seqs):
        z = ref.logits(seq)
        assert_close(got.logprobs[j], ref_token_logprobs(z, seq))
        assert_close(got.full_logits[j], z[:, :64].numpy())


@pytest.mark.unit
def test_flash_varlen_without_enable_gqa_repeats_the_kv_heads(monkeypatch):
    """A torch whose varlen_attn takes no enable_gqa (issue 21): the GQA call is retried with repeated KV heads.
    The kernel is stood in for by a per-sequence causal sdpa on CPU that refuses the keyword, as such a torch does."""
    import torch.nn.attention.varlen as varlen
    import torch.nn.functional as F
    from logitserve.attention import _flash_varlen, _grouped_sdpa
    from logitserve.capabilities import probe

    def old_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):   # [N, H, D]
        assert q.shape[1] == k.shape[1], "heads must match without enable_gqa"
        out = torch.empty_like(q)
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            out[a:b] = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                      v[a:b].transpose(0, 1), is_causal=True,
                                                      scale=scale).transpose(0, 1)
        return out

    monkeypatch.setattr(varlen, "varlen_attn", old_varlen_attn)
    g = torch.Generator().manual_seed(0)
    lengths = (5, 9, 3)
    N = sum(lengths)
    q = torch.randn(1, 8, N, 16, generator=g)
    k, v = torch.randn(1, 2, N, 16, generator=g), torch.randn(1, 2, N, 16, generator=g)
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    got = _flash_varlen(q, k, v, cu, max(lengths), None, None, probe.__wrapped__("cpu"))   # [1, N, H, D]
    want = _grouped_sdpa(q, k, v, lengths, None, None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
