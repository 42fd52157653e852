"""Reward models beyond sequence classifiers, one process: token classifiers (process reward models: token and step
scores) and causal LMs as reward models (reward tokens), against plain transformers in float64; bad requests."""
from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from helpers import Reference, assert_close, build_model, random_seqs, ref_token_logprobs, serve_dir
from logitserve.client import LogitServeError, TeacherClient

pytestmark = pytest.mark.live_server

V = 1003
SEP, SEP2 = 7, 9                # the server's --step-separator, and another a request may name
LENGTHS = [1, 5, 40, 23, 130]   # crossing the 16-row head chunks


@pytest.fixture(scope="module")
def prm(tmp_path_factory):
    """(a token-classification model's directory, its server with --step-separator 7, its float64 reference)."""
    directory = build_model(tmp_path_factory.mktemp("prm") / "llama", "llama", kind="token", num_labels=2, seed=3)
    server = serve_dir(directory, step_separator=str(SEP))
    yield directory, server, Reference(directory)
    server.stop()


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    """(a causal LM's server, its float64 reference): a generative judge."""
    directory = build_model(tmp_path_factory.mktemp("judge") / "llama", "llama", seed=4)
    server = serve_dir(directory)
    yield server, Reference(directory)
    server.stop()


def _with_steps(rng, lengths) -> list[np.ndarray]:
    """Random sequences (ids from 10: no separator by chance) with separators at a few places, always one."""
    seqs = [s + 10 for s in random_seqs(rng, lengths, vocab=V - 10)]
    for s in seqs:
        s[rng.choice(len(s), size=max(1, len(s) // 9), replace=False)] = SEP
        s[-1] = SEP
    return seqs


@torch.no_grad()
def _ref_token_scores(ref: Reference, seq) -> np.ndarray:
    """[L, num_labels] float64: the token classifier's logits at every position."""
    return ref.model(torch.as_tensor(np.asarray(seq), dtype=torch.long)[None]).logits[0].numpy()


def test_token_and_step_scores_match_reference(prm):
    _, server, ref = prm
    rng = np.random.default_rng(31)
    seqs = _with_steps(rng, LENGTHS)
    seqs[2][[3, 17]] = SEP2
    with TeacherClient(server.address) as c:
        info = c.model_info()
        r = c.forward(seqs, token_scores=True, step_scores=True, scores=True)
        named = c.step_scores(seqs[2:3], separators=[SEP2, SEP])[0]
        only = c.step_scores(seqs[2:3], separators=[SEP2])[0]
    assert info.kind == "token_reward" and info.num_labels == 2
    for i, seq in enumerate(seqs):
        want = _ref_token_scores(ref, seq)
        steps = np.flatnonzero(seq == SEP)                              # the server's separator
        assert r.token_scores[i].shape == (len(seq), 2) and r.token_scores[i].dtype == np.float32
        assert_close(r.token_scores[i], want)
        assert r.step_scores[i].shape == (len(steps), 2)
        assert_close(r.step_scores[i], want[steps])
        assert_close(r.scores[i], want[-1])
    want = _ref_token_scores(ref, seqs[2])
    assert_close(named, want[np.flatnonzero(np.isin(seqs[2], [SEP, SEP2]))])
    assert_close(only, want[[3, 17]])


def test_step_scores_of_a_group_sharing_a_prompt_equal_the_reference(prm):
    """RL groups: G responses to one prompt share its body, each step read after it; a separator inside the prompt
    caps the shared part before it; token scores read every row, so nothing is shared."""
    _, server, ref = prm
    rng = np.random.default_rng(32)
    prompt = rng.integers(10, V, 90)
    seqs = [np.concatenate([prompt, s]) for s in _with_steps(rng, [12, 30, 7])]
    marked = [s.copy() for s in seqs]
    for s in marked:
        s[70] = SEP                   # a separator inside the prompt they share: the shared part stops before it
    with TeacherClient(server.address) as c:
        r = c.forward(seqs, step_scores=True)
        mixed = c.forward(marked, step_scores=True)
        tokens = c.forward(seqs, token_scores=True)                   # every row read: nothing to share
    assert r.shared_prefix_tokens >= 2 * 90 and 0 < mixed.shared_prefix_tokens <= 2 * 70
    assert tokens.shared_prefix_tokens == 0
    for seq, got in zip(seqs, r.step_scores):
        assert_close(got, _ref_token_scores(ref, seq)[np.flatnonzero(seq == SEP)])
    for seq, got in zip(marked, mixed.step_scores):
        assert_close(got, _ref_token_scores(ref, seq)[np.flatnonzero(seq == SEP)])
    for seq, got in zip(seqs, tokens.token_scores):
        assert_close(got, _ref_token_scores(ref, seq))


def test_reward_tokens_match_reference(judge):
    """Logprobs (default: at the last position) and logits of chosen ids at chosen positions, beside other outputs."""
    server, ref = judge
    rng = np.random.default_rng(33)
    seqs = random_seqs(rng, LENGTHS, vocab=V)
    yes_no = [17, 900, 17]                               # repeats allowed
    positions = [-1, 0, 4, 0, -2]
    with TeacherClient(server.address) as c:
        last = c.reward_tokens(seqs, yes_no)
        r = c.forward(seqs[1:], temperature=0.8, logprobs=True, reward_token_ids=yes_no, reward_logits=True,
                      reward_positions=positions, prompt_lengths=[2, 30, 20, 100])
    for seq, got in zip(seqs, last):
        z = ref.logits(seq)
        assert got.shape == (1, 3) and got.dtype == np.float32
        assert_close(got, torch.log_softmax(z, -1)[-1:, yes_no].numpy())
    for seq, got, lp, P in zip(seqs[1:], r.reward_tokens, r.logprobs, [2, 30, 20, 100]):
        z = ref.logits(seq, 0.8)
        rows = [p % len(seq) for p in positions]
        assert_close(got, z[rows][:, yes_no].numpy())
        assert_close(lp, ref_token_logprobs(z, seq)[P:])      # prompt_lengths moves token outputs, not positions


def test_bad_reward_requests_name_the_field_and_the_server_keeps_serving(prm, judge, reward_dirs):
    directory, server, _ = prm
    judge_server, _ = judge
    cases = [   # (server, call, field and bound the message names)
        (server, lambda c: c.step_scores([[1, 2, SEP], [3, 4, 5]]), ["step_scores.separator_ids", "sequences[1]"]),
        (server, lambda c: c.step_scores([[1, 2]], separators=[V]), ["step_scores.separator_ids[0]", f"[0, {V})"]),
        (server, lambda c: c.logprobs([[1, 2]]), ["outputs", "token_scores"]),
        (server, lambda c: c.reward_tokens([[1, 2]], [3]), ["reward_tokens", "reward model"]),
        (judge_server, lambda c: c.token_scores([[1, 2]]), ["token_scores", "causal LM"]),
        (judge_server, lambda c: c.step_scores([[1, 2]], separators=[2]), ["step_scores", "causal LM"]),
        (judge_server, lambda c: c.reward_tokens([[1, 2]], [3, V]), ["reward_tokens.token_ids[1]", f"[0, {V})"]),
        (judge_server, lambda c: c.reward_tokens([[1, 2, 3], [1]], [3], positions=[-1, 1]),
         ["reward_tokens.positions[1]", "[-1, 1)", "sequences[1]"]),
        (judge_server, lambda c: c.reward_tokens([[1, 2]], []), ["reward_tokens.token_ids", "at least one"]),
    ]
    for target, call, words in cases:
        with TeacherClient(target.address) as c:
            with pytest.raises(LogitServeError) as e:
                call(c)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, (words, e.value)
        assert all(w in e.value.details for w in words), (words, e.value.details)
    plain = serve_dir(reward_dirs["llama"])              # a sequence classifier: neither token nor step scores
    try:
        with TeacherClient(plain.address) as c:
            for call, field in ((lambda: c.token_scores([[1, 2]]), "token_scores"),
                                (lambda: c.step_scores([[1, 2]], separators=[2]), "step_scores")):
                with pytest.raises(LogitServeError) as e:
                    call()
                assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details
                assert "token-classification" in e.value.details
    finally:
        plain.stop()
    bare = serve_dir(directory)                          # no --step-separator, and the request names none
    try:
        with TeacherClient(bare.address) as c, pytest.raises(LogitServeError) as e:
            c.step_scores([[1, SEP]])
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "step_scores.separator_ids" in e.value.details and "--step-separator" in e.value.details
    finally:
        bare.stop()
    with TeacherClient(server.address) as c, TeacherClient(judge_server.address) as j:
        assert c.step_scores([[1, SEP, 2, SEP]])[0].shape == (2, 2)
        assert j.reward_tokens([[1, 2, 3]], [5])[0].shape == (1, 1)


def test_demo_prm_serves_step_scores_at_a_separator_named_by_its_token(tmp_path):
    """`--demo prm` with `--step-separator t3` (the demo tokenizer's entry for id 3); a separator that is no entry, or
    one given to a causal LM, stops the start naming the flag."""
    from logitserve.demo import export_demo
    from logitserve.loaded import with_step_separator
    from logitserve.loading import load_model

    directory = export_demo(tmp_path / "prm", "prm")
    loaded = load_model(directory)
    with pytest.raises(ValueError, match=r"--step-separator 'no-such-token' is no entry"):
        with_step_separator(loaded, "no-such-token")
    with pytest.raises(ValueError, match=r"--step-separator '3': .* is not a token-classification model"):
        with_step_separator(load_model(export_demo(tmp_path / "causal", "causal")), "3")
    assert with_step_separator(loaded, "t3").step_separator == (3,)
    # the docs' separator (Qwen2.5-Math-PRM's) is the demo PRM's last id, split out of a text without spaces
    assert with_step_separator(loaded, "<extra_0>").step_separator == (31999,)
    assert loaded.text.tokenizer("t5<extra_0>t6")["input_ids"] == [1, 5, 31999, 6]
    server = serve_dir(directory, step_separator="t3")
    try:
        with TeacherClient(server.address) as c:
            info = c.model_info()
            got = c.forward(["t9 t3 t17 t40 t3"], step_scores=True)
    finally:
        server.stop()
    assert info.kind == "token_reward" and info.num_labels == 2
    ids = got.input_ids[0]                                  # BOS, then one token a word
    assert ids.tolist() == [1, 9, 3, 17, 40, 3]
    assert_close(got.step_scores[0], _ref_token_scores(Reference(directory), ids)[[2, 5]])
