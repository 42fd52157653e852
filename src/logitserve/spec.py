"""What a request asks for: typed, frozen, independent of the wire format."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import numpy as np


class WireDType(enum.Enum):
    """Element type in which a floating output travels."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class OutputKind(enum.IntEnum):
    """The outputs of SPEC.md; numbers equal the proto's Output enum."""

    TOKEN_LOGPROBS = 1      # [L] fp32
    TOPK_VALUES = 2         # [L, k]
    TOPK_IDS = 3            # [L, k] int32
    CANDIDATE_LOGPROBS = 4  # [L, c] fp32
    FULL_LOGITS = 5         # [s1 - s0, v1 - v0]
    SCORES = 6              # [num_labels] fp32
    INPUT_IDS = 7           # [L] int32: a text's ids as the server tokenized it
    TOPK_TAIL = 8           # [L] fp32: log of the probability outside the top-k ids
    TOKEN_RANKS = 9         # [L] int32: 1 + #ids with z/T above the target's (row 0: 0), as TOKEN_LOGPROBS
    HIDDEN_STATES = 10      # [L, H]: the lm_head's input, over the token outputs' rows
    INPUT_OFFSETS = 11      # [L, 2] int32: a text's tokens' UTF-8 byte spans
    TOKEN_SCORES = 12       # [L, num_labels] fp32: a token-classification head at every position
    STEP_SCORES = 13        # [num_steps, num_labels] fp32: that head at each step separator
    REWARD_TOKENS = 14      # [num_positions, num_token_ids] fp32: a causal LM's logprobs (or logits) of chosen ids


class ModelKind(enum.Enum):
    CAUSAL_LM = "causal_lm"
    REWARD = "reward"                # *ForSequenceClassification: a score at the last token
    TOKEN_REWARD = "token_reward"    # *ForTokenClassification (process reward models): a score row per token


@dataclass(frozen=True)
class LogprobsOpts:
    """Token logprobs, optionally under the sampler's filters (top_k first, then top_p)."""

    top_k: Optional[int] = None    # keep logits >= the k-th largest
    top_p: Optional[float] = None  # keep the smallest top set whose probability reaches p
    ranks: bool = False            # also TOKEN_RANKS: the target's rank in the unfiltered distribution


@dataclass(frozen=True)
class TopKOpts:
    k: int
    as_logprobs: bool = False      # values as full-vocab log_softmax instead of logits
    dtype: WireDType = WireDType.FP32
    tail_mass: bool = False        # also the log of the probability outside the top-k (TOPK_TAIL)


@dataclass(frozen=True)
class SliceOpts:
    """A rectangle of z/T; None means the whole sequence / vocabulary."""

    seq_start: Optional[int] = None
    seq_end: Optional[int] = None
    vocab_start: Optional[int] = None
    vocab_end: Optional[int] = None
    dtype: WireDType = WireDType.FP32

    def bounds(self, length: int, vocab: int) -> tuple[int, int, int, int]:
        """(s0, s1, v0, v1) for a sequence of this length, after validation."""
        s0 = 0 if self.seq_start is None else self.seq_start
        s1 = length if self.seq_end is None else self.seq_end
        v0 = 0 if self.vocab_start is None else self.vocab_start
        v1 = vocab if self.vocab_end is None else self.vocab_end
        return s0, s1, v0, v1


@dataclass(frozen=True)
class HiddenOpts:
    """The final hidden states (the lm_head's input) over the token outputs' rows."""

    dtype: WireDType = WireDType.FP32


@dataclass(frozen=True)
class StepOpts:
    """Step scores: a token-classification head at every position whose token is a step separator."""

    separators: tuple[int, ...] = ()   # token ids that end a step; () until resolved: the server's --step-separator

    def positions(self, seq: np.ndarray) -> np.ndarray:
        """The positions of sequence `seq` holding a separator, ascending: row k of STEP_SCORES is read at [k]. [S]"""
        return np.flatnonzero(np.isin(seq, np.asarray(self.separators, dtype=seq.dtype)))


@dataclass(frozen=True)
class RewardTokensOpts:
    """A causal LM as a reward model: logprobs (or logits) of chosen token ids at chosen positions."""

    token_ids: tuple[int, ...]         # n ids in [0, V)
    logits: bool = False               # z_p/T instead of log_softmax(z_p/T)
    positions: tuple[int, ...] = (-1,)  # logits rows; negative counts from the end (-1: the last)

    def rows(self, length: int) -> tuple[int, ...]:
        """The positions as rows of a sequence of this length (validated to lie in [-L, L))."""
        return tuple(p if p >= 0 else length + p for p in self.positions)


@dataclass(frozen=True)
class Job:
    """One request: ragged sequences and the outputs wanted from one forward pass."""

    sequences: tuple[np.ndarray, ...]                  # int32 [L_i] each
    temperature: float = 1.0
    logprobs: Optional[LogprobsOpts] = None
    topk: Optional[TopKOpts] = None
    candidates: Optional[tuple[np.ndarray, ...]] = None  # int32 [L_i, c_i] each
    full_logits: Optional[SliceOpts] = None
    scores: bool = False
    prompt_lengths: Optional[tuple[int, ...]] = None   # P_i: token outputs only for tokens P_i..L_i-1
    hidden_states: Optional[HiddenOpts] = None
    token_scores: bool = False                         # token-classification models: the head at every position
    step_scores: Optional[StepOpts] = None             # token-classification models: the head at step separators
    reward_tokens: Optional[RewardTokensOpts] = None   # causal LMs: logprobs of chosen ids at chosen positions

    @property
    def num_tokens(self) -> int:
        return int(sum(len(s) for s in self.sequences))

    @property
    def wants_token_outputs(self) -> bool:
        return self.needs_logits or self.hidden_states is not None

    @property
    def wants_classifier_outputs(self) -> bool:
        """Whether the job asks for what a classification head gives: scores, token scores or step scores."""
        return self.scores or self.token_scores or self.step_scores is not None

    @property
    def needs_logits(self) -> bool:
        """Whether any output reads the head's logits (hidden states alone never run the head)."""
        return any(x is not None for x in (self.logprobs, self.topk, self.candidates, self.full_logits,
                                           self.reward_tokens))

    @property
    def wants_row_outputs(self) -> bool:
        """Whether any output covers the token rows (token_rows): logprobs, top-k, candidates, hidden states."""
        return any(x is not None for x in (self.logprobs, self.topk, self.candidates, self.hidden_states))

    def token_rows(self, i: int) -> tuple[int, int]:
        """Logits rows [a, b) of sequence i that token outputs (logprobs, top-k, tail, candidates) come from:
        every position, or with prompt_lengths the L - P rows that predict tokens P..L-1 (row j of the outputs
        is logits row P - 1 + j)."""
        L = len(self.sequences[i])
        if self.prompt_lengths is None:
            return 0, L
        return self.prompt_lengths[i] - 1, L - 1

    def head_rows(self, i: int, vocab: int) -> tuple[int, int]:
        """Logits rows [a, b) the head must run on for sequence i: the token rows, joined with the
        full-logits slice when one is asked (one contiguous range; empty when nothing needs the head)."""
        L = len(self.sequences[i])
        ranges = []
        if self.wants_row_outputs:
            ranges.append(self.token_rows(i))
        if self.full_logits is not None:
            s0, s1, _, _ = self.full_logits.bounds(L, vocab)
            ranges.append((s0, s1))
        if self.reward_tokens is not None:
            rows = self.reward_tokens.rows(L)
            ranges.append((min(rows), max(rows) + 1))
        ranges = [(a, b) for a, b in ranges if a < b]
        if not ranges:
            return 0, 0
        return min(a for a, _ in ranges), max(b for _, b in ranges)

    def first_read(self, i: int, vocab: int) -> int:
        """The first row of sequence i any output reads (L - 1 for a score, the first separator for step scores, L
        when none is read): rows before it may come from a shared prefix (logitserve.prefix)."""
        L = len(self.sequences[i])
        if self.wants_classifier_outputs:
            first = L - 1 if self.scores else L
            if self.token_scores:
                first = 0
            if self.step_scores is not None:
                steps = self.step_scores.positions(self.sequences[i])
                first = min(first, int(steps[0]) if steps.size else L)
            return first
        a, b = self.head_rows(i, vocab)
        return a if b > a else L


@dataclass(frozen=True)
class ModelLimits:
    """The bounds a request is validated against."""

    kind: ModelKind
    vocab_size: int        # V: lm_head.out_features (embedding rows for reward models)
    max_seq_len: int
    step_separator: tuple[int, ...] = ()   # --step-separator: step scores' separator ids when a request names none
