"""The architecture matrix: small models of each family served at TP 1 and TP 2 (sharded loading, the plan from
transformers' base_model_tp_plan or ours) against float64 transformers on the whole model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import CliServer, Reference, check_every_output, random_seqs, serve_dir
from logitserve.client import TeacherClient

V = 1003
BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1, pad_token_id=0,
            tie_word_embeddings=False)
MOE = dict(num_experts_per_tok=2)
# transformers 5.20 plans fused experts for TP itself; later versions for expert parallelism only, and logitserve
# adds the TP slicing (tp_plan._tp_experts)
MOE_SOURCE = "transformers" if "layers.*.mlp.experts" in __import__("transformers").Qwen3MoeConfig.base_model_tp_plan \
    else "transformers+logitserve"
# arch -> (config class, causal class, reward class, extra config, plan source at tp 2)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "LlamaForSequenceClassification", {}, "transformers"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "Qwen2ForSequenceClassification", {}, "transformers"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "Qwen3ForSequenceClassification", dict(head_dim=16),
              "transformers"),
    "mistral": ("MistralConfig", "MistralForCausalLM", None, dict(sliding_window=24), "transformers"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", None,          # softcapped logits and attention scores
               dict(head_dim=16, final_logit_softcapping=3.0, attn_logit_softcapping=20.0,
                    query_pre_attn_scalar=16, sliding_window=24), "transformers"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", None,    # scaled embedding, q/k norms, local+global
               dict(head_dim=16, final_logit_softcapping=3.0, query_pre_attn_scalar=16, sliding_window=24),
               "transformers"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", None, {}, "transformers+logitserve"),     # fused qkv and gate_up
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "MixtralForSequenceClassification",
                dict(num_local_experts=4, **MOE), MOE_SOURCE),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", None,    # per-head fused qkv, partial rotary, parallel
                 {}, "transformers"),                           # residual; its plan names embedding_rowwise
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", None,
                  dict(head_dim=16, num_experts=4, moe_intermediate_size=32, decoder_sparse_step=1, **MOE),
                  MOE_SOURCE),
}
TP2 = list(ARCHS)
REWARD = ["qwen3", "mixtral"]


def build(directory, arch: str, kind: str = "causal", tie: bool = False):
    import transformers as tf

    cfg_name, causal, reward, extra, _ = ARCHS[arch]
    cfg = getattr(tf, cfg_name)(**{**BASE, **extra, "tie_word_embeddings": tie, "num_labels": 2})
    torch.manual_seed(17)
    getattr(tf, causal if kind == "causal" else reward)(cfg).float().eval().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    out = {arch: build(root / arch, arch) for arch in ARCHS}
    out["llama-tied"] = build(root / "llama-tied", "llama", tie=True)
    out.update({f"{arch}-reward": build(root / f"{arch}-reward", arch, "reward") for arch in REWARD})
    return out


def _check(address, ref):
    """Every output against float64 (the head-transform tests' check); the server's ModelInfo."""
    check_every_output(address, ref, random_seqs(np.random.default_rng(91), [1, 5, 37, 70], vocab=V))
    with TeacherClient(address) as c:
        return c.model_info()


def _check_scores(address, ref):
    seqs = random_seqs(np.random.default_rng(93), [3, 17, 60, 9], vocab=V)
    with TeacherClient(address) as c:
        scores = c.scores(seqs)
    for j, seq in enumerate(seqs):
        with torch.no_grad():
            want = ref.model(torch.as_tensor(np.asarray(seq))[None]).logits[0]     # [num_labels] float64
        np.testing.assert_allclose(scores[j], want.numpy(), atol=1e-5, rtol=0)


@pytest.mark.live_server
@pytest.mark.parametrize("arch", list(ARCHS) + ["llama-tied"])
def test_tp1_equals_reference(dirs, arch):
    server = serve_dir(dirs[arch], chunk_size=16)
    try:
        _check(server.address, Reference(dirs[arch]))
    finally:
        server.stop()


@pytest.mark.multi_process
@pytest.mark.parametrize("tp", [1, 2])
def test_softcapped_attention_unpacked(dirs, tp):
    """Exact (unpacked) batching runs transformers' own attention: Gemma 2's capped scores must survive it
    (sdpa drops the cap, and transformers 5.20 picks sdpa for Gemma 2 unless told otherwise)."""
    server = CliServer("--model", str(dirs["gemma2"]), "--tp", str(tp), "--batching", "exact",
                       "--logprob-chunk-size", "16")
    try:
        _check(server.address, Reference(dirs["gemma2"]))
    finally:
        assert server.stop() == 0, "".join(server.log[-30:])


@pytest.mark.multi_process
@pytest.mark.parametrize("arch", TP2 + ["llama-tied"])
def test_tp2_sharded_equals_reference(dirs, arch):
    server = CliServer("--model", str(dirs[arch]), "--tp", "2", "--logprob-chunk-size", "16")
    try:
        info = _check(server.address, Reference(dirs[arch]))
        assert (info.tp_size, info.tp_plan_source) == (2, ARCHS[arch.split("-")[0]][4])
    finally:
        assert server.stop() == 0, "".join(server.log[-30:])


@pytest.mark.multi_process
@pytest.mark.parametrize("arch", REWARD)
@pytest.mark.parametrize("tp", [1, 2])
def test_reward_variants_equal_reference(dirs, arch, tp):
    directory = dirs[f"{arch}-reward"]
    server = CliServer("--model", str(directory), "--tp", str(tp), "--logprob-chunk-size", "16")
    try:
        _check_scores(server.address, Reference(directory))
    finally:
        assert server.stop() == 0, "".join(server.log[-30:])


@pytest.mark.multi_process
@pytest.mark.parametrize("arch,tp", [("llama", 1), ("qwen3_moe", 1), ("gemma2", 1), ("gemma3", 1), ("llama-tied", 1),
                                     ("qwen3_moe", 2), ("gemma2", 2)])
def test_pp2_stages_equal_reference(dirs, arch, tp):
    """Two pipeline stages (one decoder layer each), alone and with TP 2 inside each stage: every output against
    float64. Gemma's scaled embeddings and softcapping, Qwen3-MoE's experts, a tied head read on the last stage."""
    server = CliServer("--model", str(dirs[arch]), "--pp", "2", "--tp", str(tp), "--logprob-chunk-size", "16",
                       "--pp-microbatch-tokens", "48")
    try:
        info = _check(server.address, Reference(dirs[arch]))
        assert (info.pp_size, info.tp_size, info.world_size) == (2, tp, 2 * tp)
        assert sorted(r["pp_rank"] for r in info.ranks) == [0] * tp + [1] * tp
    finally:
        assert server.stop() == 0, "".join(server.log[-30:])
