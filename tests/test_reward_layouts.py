"""Reward models under every layout, through the real CLI: a token classifier's token and step scores under CP (TP and
PP: slow), a sequence classifier's scores under PP (TP x PP: slow) and its HTTP reward routes under TP and PP, against
plain transformers in float64."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from helpers import CliServer, Reference, assert_close, build_model, random_seqs
from logitserve.client import TeacherClient

pytestmark = pytest.mark.multi_process

V = 1003
SEP = 7
LENGTHS = [1, 6, 45, 130]        # none a multiple of 2 * cp beyond the trivial; crossing 16-row chunks
DEVICE = os.environ.get("LOGITSERVE_TEST_DEVICE", "cpu")


def _serve(directory, layout: str, *extra: str) -> CliServer:
    return CliServer("--model", str(directory), *layout.split(), "--logprob-chunk-size", "16",
                     "--pp-microbatch-tokens", "64", "--device", DEVICE, *extra)


@torch.no_grad()
def _ref(ref: Reference, seq) -> np.ndarray:
    """[L, num_labels] (token classifier) or [num_labels] (sequence classifier) float64 logits."""
    return ref.model(torch.as_tensor(np.asarray(seq), dtype=torch.long)[None]).logits[0].numpy()


@pytest.mark.parametrize("layout", ["--cp 2", pytest.param("--tp 2", marks=pytest.mark.slow),
                                    pytest.param("--pp 2", marks=pytest.mark.slow)])
def test_token_and_step_scores_under_layouts(tmp_path, layout):
    """Under CP each rank holds runs of a sequence: its rows' token scores and the steps among them arrive from
    several ranks, placed by position."""
    directory = build_model(tmp_path / "prm", "llama", kind="token", num_labels=2, seed=5)
    ref = Reference(directory)
    rng = np.random.default_rng(41)
    seqs = [s + 10 for s in random_seqs(rng, LENGTHS, vocab=V - 10)]
    for s in seqs:
        s[rng.choice(len(s), size=max(1, len(s) // 7), replace=False)] = SEP
    server = _serve(directory, layout, "--step-separator", str(SEP))
    try:
        with TeacherClient(server.address) as c:
            info = c.model_info()
            r = c.forward(seqs, token_scores=True, step_scores=True, scores=True)
    finally:
        assert server.stop() == 0, "".join(server.log[-20:])
    assert info.kind == "token_reward" and info.num_labels == 2 and info.world_size == 2
    for i, seq in enumerate(seqs):
        want = _ref(ref, seq)
        assert_close(r.token_scores[i], want)
        assert_close(r.step_scores[i], want[np.flatnonzero(seq == SEP)])
        assert_close(r.scores[i], want[-1])


@pytest.mark.parametrize("layout", ["--pp 2", pytest.param("--tp 2 --pp 2", marks=pytest.mark.slow)])
def test_sequence_scores_under_pp(reward_dirs, layout):
    """The last stage holds the final norm and the score head; micro-batches of several sequences each."""
    directory = reward_dirs["llama"]
    ref = Reference(directory)
    # ids from 1: the reference model looks for the last non-pad token and pad is 0.
    seqs = [s + 1 for s in random_seqs(np.random.default_rng(42), LENGTHS + [33, 2], vocab=1000)]
    server = _serve(directory, layout)
    try:
        with TeacherClient(server.address) as c:
            info = c.model_info()
            got = c.scores(seqs)
    finally:
        assert server.stop() == 0, "".join(server.log[-20:])
    assert info.kind == "reward" and info.num_labels == 2 and info.pp_size == 2
    for seq, score in zip(seqs, got):
        assert score.shape == (2,)
        assert_close(score, _ref(ref, seq))


@pytest.mark.parametrize("layout", ["--tp 2", "--pp 2"])
def test_reward_routes_under_layouts(tmp_path, layout):
    """OpenRLHF's /get_reward batch and verl's /classify call against a sharded sequence classifier: every reward and
    logit within 1e-5 of float64 transformers (ids from the test's own tokenizer)."""
    from helpers import VOCAB, post
    from logitserve.demo import demo_tokenizer
    from transformers import AutoTokenizer

    directory = build_model(tmp_path / "rm", "llama", kind="reward", num_labels=2, seed=8)
    demo_tokenizer(VOCAB).save_pretrained(directory)
    tok, ref = AutoTokenizer.from_pretrained(directory), Reference(directory)
    queries = ["<s> t5 t6 t7 t8", "<s> t9 t10 t11 t12 t13 t14 t15 t16 t17 t18 t19 t20 t21 t22 t23 t24 t25", "<s> t4"]
    ids = [tok(q, add_special_tokens=False)["input_ids"] for q in queries]
    want = [_ref(ref, x) for x in ids]
    server = _serve(directory, layout, "--http-port", "0")
    try:
        status, rewards = post(server.http, "/get_reward", {"query": queries, "prompts": ["p"] * 3, "labels": [""] * 3})
        status2, classified = post(server.http, "/classify", {"model": "rm", "input": queries[1][4:],
                                                              "activation": False})     # verl: BOS text stripped
        others = [post(server.http, "/get_reward", {"prompt": "<s> t5 t6", "response": " t7 t8", "label": ""}),
                  post(server.http, "/v1/embeddings", {"model": "rm", "input": queries[1][4:]}),   # verl, SGLang
                  post(server.http, "/score", {"model": "rm", "text_1": "t9 t10 t11", "text_2": ["t12 t13", "t4"],
                                               "use_activation": False})]                            # vLLM
    finally:
        assert server.stop() == 0, "".join(server.log[-20:])
    assert status == 200 and status2 == 200, (rewards, classified)
    assert_close(rewards["rewards"], [w[-1] for w in want])
    assert rewards["extra_logs"] == {}
    assert_close(classified["data"][-1]["probs"], want[1])
    (s1, slime), (s2, embedded), (s3, scored) = others
    assert (s1, s2, s3) == (200, 200, 200), others
    assert_close(slime, want[0][-1])                          # slime: prompt + response, a bare number
    assert_close(embedded["data"][-1]["embedding"], want[1])  # the BOS the tokenizer adds back
    pairs = [tok("t9 t10 t11")["input_ids"] + tok(t, add_special_tokens=False)["input_ids"] for t in ("t12 t13", "t4")]
    assert_close([d["score"] for d in scored["data"]], [_ref(ref, x)[-1] for x in pairs])
