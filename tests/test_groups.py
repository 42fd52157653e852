"""RL-shaped requests: prompt_lengths (outputs only on the response rows) and prompts shared by a group computed
once, every output against float64 transformers on each sequence alone, at TP 1 and TP 2."""
from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from helpers import CliServer, Reference, build_model, filter_rows_decided, ref_token_logprobs, serve_dir
from logitserve.client import LogitServeError, TeacherClient

V = 1003


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    directory = build_model(tmp_path_factory.mktemp("groups") / "llama", "llama", vocab=V, max_pos=1024)
    return directory, Reference(directory)


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def grouped_server(request, long_model):
    directory, ref = long_model
    server = CliServer("--model", str(directory), "--tp", str(request.param), "--logprob-chunk-size", "64",
                       "--min-shared-prefix", "16")
    yield server, ref
    assert server.stop() == 0, "".join(server.log[-20:])


def _batch(rng: np.random.Generator, groups: int = 3):
    """Groups of G responses to one prompt (P up to 600, R up to 300), and unrelated sequences among them."""
    seqs, prompts = [], []
    for _ in range(groups):
        P = int(rng.integers(1, 600))
        prompt = rng.integers(0, V, P)
        for _ in range(int(rng.integers(1, 13))):
            seqs.append(np.concatenate([prompt, rng.integers(0, V, int(rng.integers(1, 300)))]))
            prompts.append(P)
    for _ in range(3):
        n = int(rng.integers(2, 400))
        seqs.append(rng.integers(0, V, n))
        prompts.append(int(rng.integers(1, n + 1)))
    order = rng.permutation(len(seqs))
    return [seqs[i] for i in order], [prompts[i] for i in order]


def _check_against_reference(r, ref, seqs, prompts, cands, T, top_p):
    for i, (s, P) in enumerate(zip(seqs, prompts)):
        z = ref.logits(s, temperature=T)                                  # [L, V] float64
        rows = z[P - 1 : len(s) - 1]                                      # row j predicts token P + j
        assert r.logprobs[i].shape == (len(s) - P,)
        want = ref_token_logprobs(z, s, top_p=top_p)[P:]
        decided = filter_rows_decided(z, top_p=top_p)[P - 1 : len(s) - 1]
        np.testing.assert_array_equal(np.isfinite(r.logprobs[i])[decided], np.isfinite(want)[decided])
        ok = decided & np.isfinite(want)
        np.testing.assert_allclose(r.logprobs[i][ok], want[ok], atol=1e-5)
        vals = np.sort(rows.numpy(), -1)[:, ::-1][:, :8]
        np.testing.assert_allclose(r.topk_values[i], vals - torch.logsumexp(rows, -1).numpy()[:, None], atol=1e-5)
        lp = torch.log_softmax(rows, -1).numpy()
        np.testing.assert_allclose(r.candidate_logprobs[i], np.take_along_axis(lp, cands[i], -1), atol=1e-5)
        tail = np.log1p(-np.exp(np.sort(lp, -1)[:, ::-1][:, :8]).sum(-1))
        np.testing.assert_allclose(r.topk_tail[i], tail, atol=1e-4)


@pytest.mark.multi_process
def test_grouped_results_equal_each_sequence_alone(grouped_server):
    server, ref = grouped_server
    rng = np.random.default_rng(7)
    seqs, prompts = _batch(rng)
    cands = [rng.integers(0, V, (len(s) - P, 3)) for s, P in zip(seqs, prompts)]
    with TeacherClient(server.address) as c:
        r = c.forward(seqs, logprobs=True, top_p=0.95, topk=8, topk_as_logprobs=True, topk_tail=True,
                      candidates=cands, temperature=0.8, prompt_lengths=prompts)
        info = c.model_info()
    assert r.shared_prefix_tokens > 0 and info.shared_prefix_tokens >= r.shared_prefix_tokens
    assert info.min_shared_prefix == 16
    _check_against_reference(r, ref, seqs, prompts, cands, 0.8, 0.95)


@pytest.mark.live_server
def test_groups_split_over_small_packs_stay_exact(long_model):
    """Packs of 300 tokens: groups are split, each part with its own copy of the prefix."""
    directory, ref = long_model
    server = serve_dir(directory, max_pack_tokens=300, min_shared_prefix=16, chunk_size=64)
    try:
        rng = np.random.default_rng(9)
        seqs, prompts = _batch(rng, groups=2)
        cands = [rng.integers(0, V, (len(s) - P, 3)) for s, P in zip(seqs, prompts)]
        with TeacherClient(server.address) as c:
            r = c.forward(seqs, logprobs=True, top_p=0.95, topk=8, topk_as_logprobs=True, topk_tail=True,
                          candidates=cands, temperature=0.8, prompt_lengths=prompts)
        _check_against_reference(r, ref, seqs, prompts, cands, 0.8, 0.95)
    finally:
        server.stop()


@pytest.mark.multi_process
def test_changing_one_continuation_leaves_the_others_unchanged(grouped_server):
    server, _ = grouped_server
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, V, 200)
    seqs = [np.concatenate([prompt, rng.integers(0, V, 40)]) for _ in range(6)]
    changed = [s.copy() for s in seqs]
    changed[2][-40:] = rng.integers(0, V, 40)
    with TeacherClient(server.address) as c:
        a = c.forward(seqs, logprobs=True, topk=5, prompt_lengths=[200] * 6)
        b = c.forward(changed, logprobs=True, topk=5, prompt_lengths=[200] * 6)
    assert a.shared_prefix_tokens == b.shared_prefix_tokens == 5 * 199
    for i in (0, 1, 3, 4, 5):
        np.testing.assert_array_equal(a.logprobs[i], b.logprobs[i])
        np.testing.assert_array_equal(a.topk_ids[i], b.topk_ids[i])
    assert not np.array_equal(a.logprobs[2], b.logprobs[2])


@pytest.mark.live_server
def test_grouped_reward_scores_equal_each_sequence_alone(tmp_path_factory):
    directory = build_model(tmp_path_factory.mktemp("rm") / "llama", "llama", kind="reward", vocab=V, max_pos=1024,
                            num_labels=2, seed=4)
    ref = Reference(directory)
    server = serve_dir(directory, min_shared_prefix=16)
    try:
        rng = np.random.default_rng(5)
        prompt = rng.integers(1, V, 300)                # no pad id (0): transformers pools at the last non-pad
        seqs = [np.concatenate([prompt, rng.integers(1, V, int(n))]) for n in rng.integers(1, 60, 8)]
        seqs.append(rng.integers(1, V, 50))
        with TeacherClient(server.address) as c:
            r = c.forward(seqs, scores=True)
        assert r.shared_prefix_tokens == 7 * 300
        for s, got in zip(seqs, r.scores):
            with torch.no_grad():
                want = ref.model(torch.as_tensor(s)[None]).logits[0].numpy()
            np.testing.assert_allclose(got, want, atol=1e-5)
    finally:
        server.stop()


@pytest.mark.live_server
def test_prompt_lengths_in_exact_mode_share_nothing_and_stay_bitwise(long_model):
    directory, ref = long_model
    server = serve_dir(directory, batching="exact")
    try:
        rng = np.random.default_rng(2)
        prompt = rng.integers(0, V, 100)
        seqs = [np.concatenate([prompt, rng.integers(0, V, 20)]) for _ in range(3)]
        with TeacherClient(server.address) as c:
            r = c.forward(seqs, logprobs=True, prompt_lengths=[100, 100, 120])
            alone = c.forward(seqs[:1], logprobs=True, prompt_lengths=[100])
            whole = c.logprobs(seqs[:1])
            info = c.model_info()
        assert r.shared_prefix_tokens == 0 and info.min_shared_prefix == 0
        assert r.logprobs[2].shape == (0,)                               # P = L: nothing to predict
        np.testing.assert_array_equal(r.logprobs[0], alone.logprobs[0])
        np.testing.assert_array_equal(r.logprobs[0], whole[0][100:])     # the same rows as without a span
        z = ref.logits(seqs[1])
        np.testing.assert_allclose(r.logprobs[1], ref_token_logprobs(z, seqs[1])[100:], atol=1e-5)
        for j in range(20):                                              # row j is the prediction of token P + j
            want = float(torch.log_softmax(z[100 + j - 1], -1)[int(seqs[1][100 + j])])
            assert abs(r.logprobs[1][j] - want) < 1e-5
    finally:
        server.stop()


@pytest.mark.live_server
def test_prompt_lengths_out_of_range_are_refused(llama_server):
    from logitserve.v1 import logitserve_pb2 as pb
    from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

    with TeacherClient(llama_server.address) as c:
        for P in (0, 5):
            with pytest.raises(LogitServeError) as e:
                c.forward([[1, 2, 3, 4]], logprobs=True, prompt_lengths=[P])
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "prompt_lengths[0]" in e.value.details
            assert "[1, 4]" in e.value.details
        with pytest.raises(LogitServeError) as e:                         # candidates for the span rows only
            c.forward([[1, 2, 3, 4]], candidates=[np.zeros((4, 2), int)], prompt_lengths=[2])
        assert "L - P=2" in e.value.details
    seq = pb.Tensor(dtype=pb.INT32, shape=[3], data=np.arange(3, dtype="<i4").tobytes())
    req = pb.ForwardRequest(request_id="n", sequences=[seq, seq], prompt_lengths=[1])
    req.logprobs.SetInParent()
    with grpc.insecure_channel(llama_server.address) as ch:
        out = list(pb_grpc.LogitServeStub(ch).Forward(iter([req])))
    assert out[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "prompt_lengths" in out[0].error.message


@pytest.fixture(scope="module", params=["tp2", "cp2"])
def sharded_server(request, long_model):
    directory, ref = long_model
    flag = "--tp" if request.param == "tp2" else "--cp"
    server = CliServer("--model", str(directory), flag, "2", "--logprob-chunk-size", "16")
    yield server, ref
    assert server.stop() == 0, "".join(server.log[-20:])


@pytest.mark.live_server
def test_empty_spans_and_slices_keep_the_ranks_in_step(sharded_server):
    """P = L beside a full-logits slice: every rank takes the same steps (TP 2 gathers the slices, CP 2 every
    step), so the server answers, stays up and the next request is exact."""
    server, ref = sharded_server
    rng = np.random.default_rng(4)
    seqs = [rng.integers(0, V, n) for n in (8, 5, 40)]
    prompts = [8, 2, 40]
    with TeacherClient(server.address) as c:
        r = c.forward(seqs, logprobs=True, topk=3, full_logits=True, seq_range=(0, 2), vocab_range=(10, 20),
                      prompt_lengths=prompts)
        again = c.forward(seqs, logprobs=True, prompt_lengths=[1, 1, 1])
    assert r.logprobs[0].shape == (0,) and r.topk_ids[2].shape == (0, 3) and r.logprobs[1].shape == (3,)
    for i, s in enumerate(seqs):
        z = ref.logits(s)
        np.testing.assert_allclose(r.full_logits[i], z[0:2, 10:20].numpy(), atol=1e-5)
        np.testing.assert_allclose(again.logprobs[i], ref_token_logprobs(z, s)[1:], atol=1e-5)
    np.testing.assert_allclose(r.logprobs[1], ref_token_logprobs(ref.logits(seqs[1]), seqs[1])[2:], atol=1e-5)
