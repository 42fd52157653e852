"""HIDDEN_STATES and the Head RPC: a student rebuilds exactly the served logits from H values per row.

Llama (untied head), Gemma 2 (final-logit softcapping) and Qwen 2 with its head tied to
the embedding, at tp 1 in process and at tp 2 as `logitserve serve --tp 2` (where rank 0
reads the head rows from the checkpoint). References: the served full logits (what a
student would otherwise download) and float64 transformers.
"""
from __future__ import annotations


import grpc
import numpy as np
import pytest
import torch

from helpers import CliServer, Reference, build_transformed_head, random_seqs, serve_dir
from logitserve.client import LogitServeError, TeacherClient

V = 1003
LENGTHS = [1, 7, 40, 19]


def _tied(directory):
    import transformers as tf

    cfg = tf.Qwen2Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1, pad_token_id=0,
                         tie_word_embeddings=True)
    torch.manual_seed(3)
    model = tf.Qwen2ForCausalLM(cfg).float().eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, model_dirs):
    root = tmp_path_factory.mktemp("hidden")
    return {"llama": model_dirs["llama"], "tied": _tied(root / "tied"), "gemma2": build_transformed_head(root / "gemma2", "gemma2")}


def _rebuild_matches(address, ref: Reference, cache, tied: bool, softcap: float):
    seqs = random_seqs(np.random.default_rng(5), LENGTHS, vocab=V)
    with TeacherClient(address) as c:
        r = c.forward(seqs, temperature=0.7, hidden_states=True, full_logits=True)
        head = c.head(cache=cache)
        bf16 = c.hidden_states(seqs, dtype="bf16")
    assert head.spec.tied is tied and head.spec.softcap == softcap and head.spec.vocab_size == V
    for j, seq in enumerate(seqs):
        h = torch.from_numpy(r.hidden_states[j])                                          # [L, H] fp32
        assert h.shape == (len(seq), head.spec.hidden_size)
        z = head(h, temperature=0.7)                                                      # [L, V] fp32
        served = torch.from_numpy(r.full_logits[j])
        assert (z - served).abs().max() <= 1e-5, "rebuilt logits differ from the served ones"
        truth = ref.logits(seq, 0.7)                                                      # float64 transformers
        assert torch.allclose(z.double(), truth, atol=2e-4, rtol=1e-4)
        with torch.no_grad():
            ids = torch.as_tensor(seq, dtype=torch.long)[None]
            h_ref = ref.model.base_model(ids).last_hidden_state[0]                       # [L, H] float64
        assert torch.allclose(h.double(), h_ref, atol=1e-4, rtol=1e-4)
        # bf16 on the wire: h rounds by at most u = 2^-8 relative, so |dz| <= u * sum|h||W| / T (softcap: 1-Lipschitz)
        hb = torch.from_numpy(bf16[j])
        assert torch.equal(hb, h.to(torch.bfloat16).float()), "bf16 hidden states are the fp32 ones rounded"
        w = torch.cat([p.float() for p in head.weights], 0)                                # [V, H]
        scale = head.spec.multiply / head.spec.divide
        bound = (2.0 ** -8) * (h.abs() @ w.abs().t()) * abs(scale) / 0.7 + 1e-5
        assert ((head(hb, temperature=0.7) - served).abs() <= bound).all()


@pytest.mark.live_server
@pytest.mark.parametrize("arch", ["llama", "gemma2", "tied"])
def test_rebuilt_logits_equal_served_tp1(dirs, arch, tmp_path):
    server = serve_dir(dirs[arch], chunk_size=16)
    try:
        _rebuild_matches(server.address, Reference(dirs[arch]), tmp_path, arch == "tied",
                         3.0 if arch == "gemma2" else 0.0)
    finally:
        server.stop()


@pytest.mark.multi_process
@pytest.mark.parametrize("arch", ["llama", "gemma2", "tied"])
def test_rebuilt_logits_equal_served_tp2(dirs, arch, tmp_path):
    server = CliServer("--model", str(dirs[arch]), "--tp", "2", "--logprob-chunk-size", "16")
    try:
        _rebuild_matches(server.address, Reference(dirs[arch]), tmp_path, arch == "tied",
                         3.0 if arch == "gemma2" else 0.0)
    finally:
        assert server.stop() == 0


@pytest.mark.live_server
def test_hidden_rows_follow_prompt_lengths_and_logprobs(llama_server, tmp_path):
    seqs = random_seqs(np.random.default_rng(6), [12, 30, 5], vocab=V)
    P = [4, 29, 5]                                     # the last: P = L, no rows
    with TeacherClient(llama_server.address) as c:
        r = c.forward(seqs, logprobs=True, hidden_states=True, prompt_lengths=P, temperature=1.3)
        head = c.head(cache=tmp_path)
    for j, (seq, p) in enumerate(zip(seqs, P)):
        h = r.hidden_states[j]
        assert h.shape == (len(seq) - p, 64)
        if len(h):
            lp = torch.log_softmax(head(torch.from_numpy(h), temperature=1.3), -1)
            mine = lp.gather(-1, torch.as_tensor(seq[p:], dtype=torch.long)[:, None])[:, 0]
            assert np.allclose(mine.numpy(), r.logprobs[j], atol=1e-5)


@pytest.mark.live_server
def test_head_is_cached_verified_and_splits_over_devices(llama_server, tmp_path):
    seqs = random_seqs(np.random.default_rng(7), [9], vocab=V)
    with TeacherClient(llama_server.address) as c:
        first = c.head_weights(cache=tmp_path)
        [folder] = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
        assert (folder / "weight.bin").stat().st_size == V * 64 * 4
        again = c.head_weights(cache=tmp_path)           # from the cache, verified
        assert np.array_equal(first.weight, again.weight)
        raw = bytearray((folder / "weight.bin").read_bytes())
        raw[1000] ^= 0xFF                                  # a damaged copy is refused and fetched again
        (folder / "weight.bin").write_bytes(bytes(raw))
        repaired = c.head_weights(cache=tmp_path)
        assert np.array_equal(first.weight, repaired.weight)
        assert (folder / "weight.bin").read_bytes() == first.weight.tobytes()
        h = torch.from_numpy(c.hidden_states(seqs)[0])
        whole = c.head(cache=False)
        split = c.head(cache=tmp_path, devices=["cpu", "cpu", "cpu"])
    assert [b - a for a, b in split.bounds] == [334, 335, 334]
    # the same products, but each device's GEMM has its own shape: the BLAS may block the sums differently
    assert torch.allclose(whole(h), split(h), atol=1e-6, rtol=0)
    chunks = list(whole.chunks(h, rows=4))
    assert [s.start for s, _ in chunks] == [0, 4, 8]
    assert torch.allclose(torch.cat([z for _, z in chunks]), whole(h), atol=1e-6, rtol=0)   # GEMM shapes differ


@pytest.mark.live_server
def test_bad_hidden_requests_name_the_field(llama_server, reward_dirs):
    # fp16 on the wire is refused by the server (sent raw, past the client's own check)
    from logitserve.v1 import logitserve_pb2 as pb
    from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

    with grpc.insecure_channel(llama_server.address) as ch:
        stub = pb_grpc.LogitServeStub(ch)
        req = pb.ForwardRequest(request_id="a", sequences=[pb.Tensor(dtype=pb.INT32, shape=[2], data=b"\1\0\0\0\2\0\0\0")])
        req.hidden_states.dtype = pb.FLOAT16
        bad = pb.ForwardRequest(request_id="b", input_offsets=True,
                                sequences=[pb.Tensor(dtype=pb.INT32, shape=[1], data=b"\1\0\0\0")])
        bad.logprobs.SetInParent()
        errors = {m.request_id: m.error for m in stub.Forward(iter([req, bad])) if m.HasField("error")}
    assert errors["a"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "hidden_states.dtype" in errors["a"].message
    assert errors["b"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "input_offsets" in errors["b"].message
    reward = serve_dir(reward_dirs["llama"])
    try:
        with TeacherClient(reward.address) as c:
            with pytest.raises(LogitServeError) as e:
                c.head(cache=False)
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "lm_head" in e.value.details
            with pytest.raises(LogitServeError) as e:
                c.hidden_states([[1, 2]])
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        reward.stop()


@pytest.mark.multi_process
def test_hidden_states_under_cp2_assembled_by_position(dirs, llama_server):
    seqs = random_seqs(np.random.default_rng(8), [3, 37, 20], vocab=V)
    P = [1, 30, 20]
    with TeacherClient(llama_server.address) as c:
        want = c.forward(seqs, hidden_states=True, prompt_lengths=P)
        whole = c.hidden_states(seqs)
    server = CliServer("--model", str(dirs["llama"]), "--cp", "2", "--logprob-chunk-size", "8")
    try:
        with TeacherClient(server.address) as c:
            got = c.forward(seqs, hidden_states=True, prompt_lengths=P)
            got_whole = c.hidden_states(seqs, dtype="bf16")
    finally:
        assert server.stop() == 0
    for a, b in zip(want.hidden_states, got.hidden_states):
        assert a.shape == b.shape and np.allclose(a, b, atol=1e-5, rtol=0)
    for a, b in zip(whole, got_whole):                   # bf16 on the wire: the fp32 values, rounded
        assert a.shape == b.shape and np.allclose(a, b, atol=0, rtol=2.0 ** -8)
