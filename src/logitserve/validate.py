"""Checks a Job against SPEC.md's bounds; every failure names the field and the bound."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from .errors import InvalidRequest
from .spec import Job, ModelKind, ModelLimits, StepOpts, WireDType

# The temperatures served: logits are divided by T in float32. Below MIN_TEMPERATURE, z/T overflows to inf for
# logits of ordinary size (T = 1e-40, a float32 subnormal, makes every logprob nan); MIN keeps z/T finite for
# |z| < 3.4e32. Above MAX_TEMPERATURE, z/T heads for float32's subnormals and then 0 (T over 3.4e38 is inf in
# float32), where the logits' order, and with it every rank and top-k id, is lost; MAX keeps z/T normal for
# |z| > 1.2e-32. One rule for every front-end: all of them build a Job that is checked here.
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 1e6
# Ids or positions listed in a request's repeated int32 fields (step separators, reward tokens): checked on the
# declared count before anything is converted; a reward token list longer than this wants candidates or full logits.
MAX_LISTED = 1 << 16


def _check_ids(field: str, ids: np.ndarray, vocab: int) -> None:
    if ids.size == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        bad = int(np.flatnonzero((ids.reshape(-1) < 0) | (ids.reshape(-1) >= vocab))[0])
        where = np.unravel_index(bad, ids.shape)
        index = "".join(f"[{int(i)}]" for i in where)
        raise InvalidRequest(f"{field}{index}", f"token id {int(ids.reshape(-1)[bad])} is outside [0, {vocab})")


def _check_int_range(field: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise InvalidRequest(field, f"{value} is outside [{lo}, {hi}]")


def check_candidates_per_row(field: str, count: int, vocab: int) -> None:
    """At most V candidate ids per position (more can only repeat ids: ask for full logits); every front-end checks
    this before it builds the candidates' arrays."""
    if count > vocab:
        raise InvalidRequest(field, f"{count} candidate ids per position is over the vocabulary size {vocab}; "
                                    f"ask for full logits instead")


def _check_kind(job: Job, kind: ModelKind) -> None:
    """Each model kind answers its own outputs: a causal LM token outputs (reward tokens among them), a sequence
    classifier scores, a token classifier scores, token scores and step scores."""
    if not job.wants_token_outputs and not job.wants_classifier_outputs:
        raise InvalidRequest("outputs", "no output requested: set logprobs, topk, candidates, full_logits, "
                                        "hidden_states, reward_tokens, scores, token_scores or step_scores")
    if kind is ModelKind.CAUSAL_LM:
        for name, on in (("scores", job.scores), ("token_scores", job.token_scores),
                         ("step_scores", job.step_scores is not None)):
            if on:
                raise InvalidRequest(name, f"this server holds a causal LM; {name} need a reward model "
                                           f"(sequence- or token-classification); a causal LM as a reward model "
                                           f"answers reward_tokens")
        return
    if job.wants_token_outputs:
        what = ("scores only" if kind is ModelKind.REWARD
                else "scores, token_scores and step_scores only")
        raise InvalidRequest("reward_tokens" if job.reward_tokens is not None else "outputs",
                             f"this server holds a reward model; it answers {what}")
    if kind is ModelKind.REWARD:
        for name, on in (("token_scores", job.token_scores), ("step_scores", job.step_scores is not None)):
            if on:
                raise InvalidRequest(name, f"this server holds a sequence-classification reward model; {name} "
                                           f"need a token-classification (process reward) model")


def resolve_job(job: Job, limits: ModelLimits) -> Job:
    """The job with the server's defaults filled in (step scores' separators: --step-separator), validated."""
    if job.step_scores is not None and not job.step_scores.separators and limits.step_separator:
        job = dataclasses.replace(job, step_scores=StepOpts(tuple(limits.step_separator)))
    validate_job(job, limits)
    return job


def validate_job(job: Job, limits: ModelLimits) -> None:
    """Raise InvalidRequest for the first thing in `job` outside its bound."""
    V = limits.vocab_size
    _check_sequences(job, limits)
    T = job.temperature
    if not (math.isfinite(T) and MIN_TEMPERATURE <= T <= MAX_TEMPERATURE):
        raise InvalidRequest("temperature", f"{T!r} must be a finite number > 0, within [{MIN_TEMPERATURE:g}, "
                                            f"{MAX_TEMPERATURE:g}]: outside it z/T over- or underflows float32")
    _check_outputs(job, limits.kind, V)
    if job.prompt_lengths is not None:
        _check_prompt_lengths(job)
    if job.candidates is not None:
        _check_candidates(job, V)
    if job.full_logits is not None:
        _check_full_logits(job, V)
    if job.step_scores is not None:
        _check_steps(job, V)
    if job.reward_tokens is not None:
        _check_reward_tokens(job, V)


def _check_sequences(job: Job, limits: ModelLimits) -> None:
    if not job.sequences:
        raise InvalidRequest("sequences", "at least one sequence is needed")
    for i, seq in enumerate(job.sequences):
        if seq.ndim != 1:
            raise InvalidRequest(f"sequences[{i}]", f"must be 1-D token ids, got shape {list(seq.shape)}")
        if len(seq) == 0:
            raise InvalidRequest(f"sequences[{i}]", "empty sequence; length must be >= 1")
        if len(seq) > limits.max_seq_len:
            raise InvalidRequest(f"sequences[{i}]",
                                 f"length {len(seq)} is over the server's max_sequence_length {limits.max_seq_len}")
        _check_ids(f"sequences[{i}]", seq, limits.vocab_size)


def _check_outputs(job: Job, kind: ModelKind, V: int) -> None:
    """Something is asked, what the model kind can give, with its options in their bounds."""
    _check_kind(job, kind)
    if job.logprobs is not None:
        if job.logprobs.top_k is not None:
            _check_int_range("logprobs.top_k", job.logprobs.top_k, 1, V)
        p = job.logprobs.top_p
        if p is not None and not (0.0 < p <= 1.0):
            raise InvalidRequest("logprobs.top_p", f"{p} is outside (0, 1]")
    if job.topk is not None:
        _check_int_range("topk.k", job.topk.k, 1, V)
    if job.hidden_states is not None and job.hidden_states.dtype not in (WireDType.FP32, WireDType.BF16):
        raise InvalidRequest("hidden_states.dtype", f"{job.hidden_states.dtype.name}: hidden states travel as "
                                                    f"FLOAT32 or BFLOAT16")


def _check_prompt_lengths(job: Job) -> None:
    if len(job.prompt_lengths) != len(job.sequences):
        raise InvalidRequest("prompt_lengths", f"{len(job.prompt_lengths)} given; one per sequence "
                                               f"({len(job.sequences)}) needed, or none")
    for i, (P, seq) in enumerate(zip(job.prompt_lengths, job.sequences)):
        if not 1 <= P <= len(seq):
            raise InvalidRequest(f"prompt_lengths[{i}]", f"{P} is outside [1, {len(seq)}] (the length of "
                                                         f"sequences[{i}])")


def _check_candidates(job: Job, V: int) -> None:
    if len(job.candidates) != len(job.sequences):
        raise InvalidRequest("candidates.ids",
                             f"{len(job.candidates)} tensors given; one per sequence ({len(job.sequences)}) needed")
    for i, (cand, seq) in enumerate(zip(job.candidates, job.sequences)):
        a, b = job.token_rows(i)
        rows, what = (len(seq), "L") if job.prompt_lengths is None else (b - a, "L - P")
        if cand.ndim != 2 or cand.shape[0] != rows or cand.shape[1] < 1:
            raise InvalidRequest(f"candidates.ids[{i}]",
                                 f"shape {list(cand.shape)} must be [{what}={rows}, c] with c >= 1")
        check_candidates_per_row(f"candidates.ids[{i}]", cand.shape[1], V)
        _check_ids(f"candidates.ids[{i}]", cand, V)


def _check_full_logits(job: Job, V: int) -> None:
    sl = job.full_logits
    for i, seq in enumerate(job.sequences):
        s0, s1, v0, v1 = sl.bounds(len(seq), V)
        if not (0 <= s0 < s1 <= len(seq)):
            raise InvalidRequest("full_logits.seq_start/seq_end",
                                 f"[{s0}, {s1}) is not a non-empty range inside [0, {len(seq)}) of sequences[{i}]")
        if not (0 <= v0 < v1 <= V):
            raise InvalidRequest("full_logits.vocab_start/vocab_end",
                                 f"[{v0}, {v1}) is not a non-empty range inside [0, {V})")


def check_listed(field: str, count: int) -> None:
    """At most MAX_LISTED ids or positions in a request's list; every front-end checks the count it declares."""
    if count > MAX_LISTED:
        raise InvalidRequest(field, f"{count} entries is over the limit of {MAX_LISTED}")


def _check_steps(job: Job, V: int) -> None:
    seps = job.step_scores.separators
    if not seps:
        raise InvalidRequest("step_scores.separator_ids", "no separator id given and the server has no "
                                                          "--step-separator: name the token that ends a step")
    check_listed("step_scores.separator_ids", len(seps))
    for j, x in enumerate(seps):
        if not 0 <= x < V:
            raise InvalidRequest(f"step_scores.separator_ids[{j}]", f"token id {x} is outside [0, {V})")
    for i, seq in enumerate(job.sequences):
        if not job.step_scores.positions(seq).size:
            raise InvalidRequest("step_scores.separator_ids", f"sequences[{i}] holds none of the separator ids "
                                                              f"{list(seps[:8])}: it has no step to score")


def _check_reward_tokens(job: Job, V: int) -> None:
    rt = job.reward_tokens
    check_listed("reward_tokens.token_ids", len(rt.token_ids))
    check_listed("reward_tokens.positions", len(rt.positions))
    if not rt.token_ids:
        raise InvalidRequest("reward_tokens.token_ids", "at least one token id is needed")
    if not rt.positions:
        raise InvalidRequest("reward_tokens.positions", "at least one position is needed (none given: the last)")
    if len(rt.token_ids) > V:
        raise InvalidRequest("reward_tokens.token_ids", f"{len(rt.token_ids)} ids is over the vocabulary size {V}")
    for j, x in enumerate(rt.token_ids):
        if not 0 <= x < V:
            raise InvalidRequest(f"reward_tokens.token_ids[{j}]", f"token id {x} is outside [0, {V})")
    shortest = min(len(s) for s in job.sequences)
    for j, p in enumerate(rt.positions):
        if not -shortest <= p < shortest:
            i = next(i for i, s in enumerate(job.sequences) if not -len(s) <= p < len(s))
            raise InvalidRequest(f"reward_tokens.positions[{j}]", f"{p} is outside [-{len(job.sequences[i])}, "
                                                                  f"{len(job.sequences[i])}) for sequences[{i}]")
