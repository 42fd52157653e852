"""Causal LMs whose logits are more than a linear head (softcapping, logit scale), and a check of every output."""
from __future__ import annotations

import numpy as np
import torch

from .checks import assert_close, separated
from .models import VOCAB, ref_token_logprobs

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, pad_token_id=0,
              tie_word_embeddings=False)


def build_transformed_head(directory, arch: str):
    """Save a small gemma2 (final softcap 3), cohere (logit_scale 0.5) or granite (logits_scaling 4) model."""
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


def check_every_output(address, ref, seqs, k=8):
    """Logprobs, top-k, candidates, a full-logits slice and filtered logprobs from `address` against `ref`."""
    from logitserve.client import TeacherClient

    rng = np.random.default_rng(81)
    cands = [rng.integers(0, VOCAB, (len(s), 4)) for s in seqs]
    with TeacherClient(address) as c:
        r = c.forward(seqs, temperature=0.7, logprobs=True, topk=k, candidates=cands, full_logits=True,
                      vocab_range=(480, 530))
        filtered = c.logprobs(seqs, top_k=50)
    for j, seq in enumerate(seqs):
        z = ref.logits(seq, 0.7)                                               # [L, V] float64, transform applied
        assert_close(r.logprobs[j], ref_token_logprobs(z, seq))
        sorted_v, sorted_i = torch.sort(z, -1, descending=True)
        assert_close(r.topk_values[j], sorted_v[:, :k].numpy())
        sep = separated(sorted_v.numpy(), k)
        assert np.array_equal(r.topk_ids[j][sep], sorted_i[:, :k].numpy()[sep])
        assert_close(r.candidate_logprobs[j], torch.log_softmax(z, -1).gather(-1, torch.as_tensor(cands[j])).numpy())
        assert_close(r.full_logits[j], z[:, 480:530].numpy())
        assert_close(filtered[j], ref_token_logprobs(ref.logits(seq), seq, top_k=50))
