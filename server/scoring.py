"""Prompt scoring as the HTTP shapes ask for it: one Job from their options, and its results per predicted token.

vLLM's prompt_logprobs, SGLang's input_token_logprobs and TRL's sequence logprobs all want, for
each prompt token t after some start, the logprob and rank of x_t and the top-k of the distribution
that predicts it, and sometimes the greedy next token. `score_job` asks the engine for exactly
those rows (an output span from the start, so the head never runs on rows nobody reads) and
`rows_of` hands them back indexed by token. No math here: the engine computes, this only indexes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from logitserve.spec import Job, LogprobsOpts, OutputKind, TopKOpts

from .dense import Dense


@dataclass(frozen=True)
class ScoreSpec:
    """What one request asks of every prompt in it."""

    temperature: float = 1.0
    logprobs: bool = True                 # each scored token's logprob and rank
    k: int = 0                            # top-k of each scored row (0: none), as logprobs
    generate: bool = False                # the greedy next token after the prompt (and its top-k)
    starts: Optional[tuple[int, ...]] = None   # per prompt: score tokens start+1.. only (None: from token 1)
    candidates: Optional[tuple[np.ndarray, ...]] = None   # per prompt [rows, c] ids scored at each row


def score_job(seqs: tuple[np.ndarray, ...], spec: ScoreSpec) -> Job:
    """The Job that computes `spec` on `seqs`. With a start, token outputs cover tokens start+1..L-1 (an output
    span: rows nobody reads never reach the head); generating then appends one placeholder token, whose row
    is the distribution after the prompt (its own logprob is never read)."""
    prompt_lengths, cands = None, spec.candidates
    if spec.starts is not None:
        prompt_lengths = tuple(min(s + 1, len(x)) for s, x in zip(spec.starts, seqs))
        if spec.generate:
            seqs = tuple(np.append(x, np.int32(0)).astype(np.int32) for x in seqs)
            if cands is not None:      # the placeholder's row scores nothing anyone reads
                cands = tuple(np.concatenate([c, np.zeros((1, c.shape[1]), np.int32)]) for c in cands)
    k = max(spec.k, 1 if spec.generate else 0)
    return Job(sequences=seqs, temperature=spec.temperature,
               logprobs=LogprobsOpts(ranks=True) if spec.logprobs else None,
               topk=TopKOpts(k=k, as_logprobs=True) if k else None,
               candidates=cands, prompt_lengths=prompt_lengths)


@dataclass(frozen=True)
class Rows:
    """One prompt's results, row j being prompt token `first + j` (of the prompt's L tokens)."""

    first: int
    logprobs: Optional[np.ndarray]        # [L - first] fp32
    ranks: Optional[np.ndarray]           # [L - first] int32
    top_values: Optional[np.ndarray]      # [L - first, k] fp32 logprobs, sorted descending
    top_ids: Optional[np.ndarray]         # [L - first, k] int32
    candidates: Optional[np.ndarray]      # [L - first, c] fp32
    next_values: Optional[np.ndarray]     # [k] the distribution after the prompt (generate)
    next_ids: Optional[np.ndarray]        # [k]


def rows_of(job: Job, spec: ScoreSpec, out: Dense, i: int, L: int) -> Rows:
    """Prompt i's results (L: its length as sent, without the placeholder)."""
    lp, rk = out.of(OutputKind.TOKEN_LOGPROBS, i), out.of(OutputKind.TOKEN_RANKS, i)
    tv, ti, cand = (out.of(k, i) for k in (OutputKind.TOPK_VALUES, OutputKind.TOPK_IDS, OutputKind.CANDIDATE_LOGPROBS))
    # Without a span the rows are positions 0..L-1: distribution row t-1 predicts token t, and the per-token
    # outputs (lp[0] = 0) sit one row later. With one, row j predicts token P + j for both. Either way the
    # distribution row after the n scored ones is "next" (the last position, or the placeholder's row).
    first = 1 if job.prompt_lengths is None else job.prompt_lengths[i]
    n, lo = L - first, 1 if job.prompt_lengths is None else 0
    nv = ni = None
    if spec.generate:
        nv, ni = tv[n], ti[n]
    lp = lp[lo : lo + n] if lp is not None else None
    rk = rk[lo : lo + n] if rk is not None else None
    if tv is not None:
        tv, ti = tv[:n], ti[:n]
    if cand is not None:
        cand = cand[:n]
    if spec.k == 0:
        tv = ti = None
    elif tv is not None and tv.shape[1] > spec.k:
        tv, ti = tv[:, : spec.k], ti[:, : spec.k]
    return Rows(first, lp, rk, tv, ti, cand, nv, ni)


def json_entries(seqs: tuple[np.ndarray, ...], spec: ScoreSpec, candidates: int = 0) -> int:
    """How many logprob entries a JSON answer to `spec` holds at most (checked before it runs); `candidates`: ids
    per position when spec.candidates is not built yet (checked before the front-end expands them)."""
    starts = spec.starts or (0,) * len(seqs)
    per_row = spec.k + 1 + (spec.candidates[0].shape[1] if spec.candidates else candidates)
    return sum(max(len(x) - 1 - s, 0) * per_row for x, s in zip(seqs, starts)) + len(seqs) * (spec.k + 1)
