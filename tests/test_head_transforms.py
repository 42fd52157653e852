"""Causal LMs whose logits are more than a linear head (Gemma-2 softcapping, Cohere logit_scale, Granite
logits_scaling): every output against float64 transformers, and Granite at TP 2 (vocab-sharded logits)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import CliServer, serve_dir
from helpers import Reference, random_seqs, ref_token_logprobs
from logitserve.client import TeacherClient
from test_outputs import _close, _separated

V = 1003
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, pad_token_id=0,
              tie_word_embeddings=False)


def _build(directory, arch: str):
    import transformers as tf

    if arch == "gemma2":       # final_logit_softcapping 3: the cap binds on logits of this size
        cfg, cls = tf.Gemma2Config(head_dim=16, final_logit_softcapping=3.0, attn_logit_softcapping=None,
                                   query_pre_attn_scalar=16, **COMMON), tf.Gemma2ForCausalLM
    elif arch == "cohere":
        cfg, cls = tf.CohereConfig(logit_scale=0.5, **COMMON), tf.CohereForCausalLM
    else:
        cfg, cls = tf.GraniteConfig(logits_scaling=4.0, attention_multiplier=0.25, **COMMON), tf.GraniteForCausalLM
    torch.manual_seed(9)
    cls(cfg).float().eval().save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    return {arch: _build(root / arch, arch) for arch in ("gemma2", "cohere", "granite")}


def _check_every_output(address, ref, seqs, k=8):
    rng = np.random.default_rng(81)
    cands = [rng.integers(0, V, (len(s), 4)) for s in seqs]
    with TeacherClient(address) as c:
        r = c.forward(seqs, temperature=0.7, logprobs=True, topk=k, candidates=cands, full_logits=True,
                      vocab_range=(480, 530))
        filtered = c.logprobs(seqs, top_k=50)
    for j, seq in enumerate(seqs):
        z = ref.logits(seq, 0.7)                                               # [L, V] float64, transform applied
        _close(r.logprobs[j], ref_token_logprobs(z, seq))
        sorted_v, sorted_i = torch.sort(z, -1, descending=True)
        _close(r.topk_values[j], sorted_v[:, :k].numpy())
        sep = _separated(sorted_v.numpy(), k)
        assert np.array_equal(r.topk_ids[j][sep], sorted_i[:, :k].numpy()[sep])
        _close(r.candidate_logprobs[j], torch.log_softmax(z, -1).gather(-1, torch.as_tensor(cands[j])).numpy())
        _close(r.full_logits[j], z[:, 480:530].numpy())
        _close(filtered[j], ref_token_logprobs(ref.logits(seq), seq, top_k=50))


@pytest.mark.parametrize("arch", ["gemma2", "cohere", "granite"])
def test_transformed_heads_equal_reference(dirs, arch):
    ref = Reference(dirs[arch])
    with torch.no_grad():     # the transform changes the logits: a test that ignored it would fail
        plain = ref.model.lm_head(ref.model.model(torch.arange(1, 9)[None]).last_hidden_state)[0]
        assert not torch.allclose(plain, ref.logits(np.arange(1, 9)), atol=1e-3)
    server = serve_dir(dirs[arch], chunk_size=16)
    try:
        _check_every_output(server.address, ref, random_seqs(np.random.default_rng(82), [1, 6, 40, 19], vocab=V))
    finally:
        server.stop()


def test_granite_logits_scaling_under_tp2(dirs):
    ref = Reference(dirs["granite"])
    server = CliServer("--model", str(dirs["granite"]), "--tp", "2", "--logprob-chunk-size", "16")
    try:
        _check_every_output(server.address, ref, random_seqs(np.random.default_rng(83), [1, 6, 40, 19], vocab=V))
    finally:
        assert server.stop() == 0
