"""The convenience methods, written once for the sync and the async client."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from .wire import Wanted


@dataclass(frozen=True)
class ModelInfo:
    name: str
    content_hash: str
    architecture: str
    kind: str                 # "causal_lm" | "reward" | "token_reward"
    vocab_size: int
    max_sequence_length: int
    dtype: str
    tp_size: int
    cp_size: int
    world_size: int
    num_labels: int
    max_message_bytes: int
    server_version: str
    ranks: tuple              # ({rank, tp_rank, cp_rank, host, device}, ...)
    batching: str = "unknown"  # "exact" | "packed": how the server runs a batch through the body
    tp_plan_source: str = ""   # "transformers" | "logitserve" | "transformers+logitserve"; "" at tp 1
    tokenizer_hash: str = ""   # "" without a tokenizer; compare with logitserve.client.tokenizer_hash(yours)
    min_shared_prefix: int = 0     # sequences sharing this many leading tokens share their prefix's compute
    shared_prefix_tokens: int = 0  # prompt tokens the server computed once instead of per sequence, in all
    pp_size: int = 1               # pipeline stages; ranks then also carry pp_rank
    quantization: str = ""         # an FP8 teacher's "<format>: <compute>" (e.g. "fp8-block-128x128: fp8 GEMMs ..."); ""


class OutputsMixin:
    """Each method asks for one output; `forward` asks for several from one pass.

    `_request(seqs, wanted, pick)` is the only thing a client class provides: the
    sync client returns the value, the async one an awaitable of it.
    """

    _request: Callable

    def forward(self, seqs: Sequence, *, temperature: float = 1.0, logprobs: bool = False,
                top_k: Optional[int] = None, top_p: Optional[float] = None, topk: Optional[int] = None,
                topk_as_logprobs: bool = False, topk_dtype: str = "fp32", topk_tail: bool = False,
                candidates: Optional[Sequence] = None,
                full_logits: bool = False, seq_range: Optional[tuple[int, int]] = None,
                vocab_range: Optional[tuple[int, int]] = None, logits_dtype: str = "fp32",
                scores: bool = False, bf16_as_torch: bool = False, timeout_s: Optional[float] = None,
                add_special_tokens: Optional[bool] = None, prompt_lengths: Optional[Sequence[int]] = None,
                token_ranks: bool = False, hidden_states: bool = False, hidden_dtype: str = "fp32",
                input_offsets: bool = False, token_scores: bool = False, step_scores: bool = False,
                step_separators: Optional[Sequence[int]] = None, reward_token_ids: Optional[Sequence[int]] = None,
                reward_logits: bool = False, reward_positions: Optional[Sequence[int]] = None):
        """Several outputs of one forward pass, as a ForwardResult.

        `seqs` holds token-id sequences, or texts (str) for the server to tokenize with the model's
        own tokenizer; the ids it used come back in `ForwardResult.input_ids`.
        `token_ranks` (with logprobs): each target's 1-based rank in the unfiltered distribution, [L] int32.
        `prompt_lengths` (P_i per sequence): token outputs cover only the predictions of tokens P_i..L_i-1,
        [L_i - P_i] rows whose row j predicts token P_i + j, lined up with a student's response tokens.
        `hidden_states`: the lm_head's input over those rows ([L, H] or [L - P, H], fp32 or bf16 on the wire);
        `teacher.head()` turns them into exactly the served logits. `input_offsets` (texts): [L, 2] UTF-8 byte
        spans of the server's tokens, for `logitserve.client.align`. Reward models: `scores`, `token_scores`,
        `step_scores` (see the methods of those names); causal LMs as reward models: `reward_token_ids` (see
        `reward_tokens`).
        """
        w = Wanted(temperature=temperature, logprobs=logprobs, top_k=top_k, top_p=top_p, topk=topk,
                   topk_as_logprobs=topk_as_logprobs, topk_dtype=topk_dtype, topk_tail=topk_tail,
                   candidates=candidates,
                   full_logits=full_logits, seq_range=seq_range, vocab_range=vocab_range,
                   logits_dtype=logits_dtype, scores=scores, timeout_s=timeout_s,
                   add_special_tokens=add_special_tokens, prompt_lengths=prompt_lengths, token_ranks=token_ranks,
                   hidden_states=hidden_states, hidden_dtype=hidden_dtype, input_offsets=input_offsets,
                   token_scores=token_scores, step_scores=step_scores, step_separators=step_separators,
                   reward_token_ids=reward_token_ids, reward_logits=reward_logits, reward_positions=reward_positions)
        return self._request(seqs, w, lambda r: r, bf16_as_torch)

    def hidden_states(self, seqs: Sequence, dtype: str = "fp32", prompt_lengths: Optional[Sequence[int]] = None):
        """The teacher's final hidden states, one [L, H] array per sequence ([L - P, H] with prompt_lengths), row t
        giving the logits of position t through `head()`: H values per row instead of V."""
        w = Wanted(hidden_states=True, hidden_dtype=dtype, prompt_lengths=prompt_lengths)
        return self._request(seqs, w, lambda r: r.hidden_states)

    def logprobs(self, seqs: Sequence, temperature: float = 1.0, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, prompt_lengths: Optional[Sequence[int]] = None):
        """Token logprobs, one [L] fp32 array per sequence (lp[0] = 0; -inf outside a filter's kept set); with
        prompt_lengths one [L - P] array of the logprobs of tokens P..L-1."""
        w = Wanted(temperature=temperature, logprobs=True, top_k=top_k, top_p=top_p, prompt_lengths=prompt_lengths)
        return self._request(seqs, w, lambda r: r.logprobs)

    def topk(self, seqs: Sequence, k: int, as_logprobs: bool = False, temperature: float = 1.0,
             dtype: str = "fp32", prompt_lengths: Optional[Sequence[int]] = None):
        """(values, ids): per sequence [L, k] values sorted descending and [L, k] int32 ids ([L - P, k], row j
        predicting token P + j, with prompt_lengths)."""
        w = Wanted(temperature=temperature, topk=k, topk_as_logprobs=as_logprobs, topk_dtype=dtype,
                   prompt_lengths=prompt_lengths)
        return self._request(seqs, w, lambda r: (r.topk_values, r.topk_ids))

    def candidate_logprobs(self, seqs: Sequence, candidates: Sequence, temperature: float = 1.0,
                           prompt_lengths: Optional[Sequence[int]] = None):
        """log_softmax(z_t/T)[cand[t, j]]: per sequence [L, c] fp32, for caller-chosen [L, c] ids ([L - P, c]
        rows from position P - 1 on, with prompt_lengths)."""
        w = Wanted(temperature=temperature, candidates=candidates, prompt_lengths=prompt_lengths)
        return self._request(seqs, w, lambda r: r.candidate_logprobs)

    def full_logits(self, seqs: Sequence, seq_range: Optional[tuple[int, int]] = None,
                    vocab_range: Optional[tuple[int, int]] = None, dtype: str = "fp32",
                    temperature: float = 1.0, bf16_as_torch: bool = False):
        """z/T over [s0, s1) x [v0, v1) per sequence (bf16 as exact float32, or torch bf16 if asked)."""
        w = Wanted(temperature=temperature, full_logits=True, seq_range=seq_range, vocab_range=vocab_range,
                   logits_dtype=dtype)
        return self._request(seqs, w, lambda r: r.full_logits, bf16_as_torch)

    def scores(self, seqs: Sequence):
        """A reward model's head at the last token: per sequence [num_labels] fp32."""
        return self._request(seqs, Wanted(scores=True), lambda r: r.scores)

    def token_scores(self, seqs: Sequence):
        """A token-classification model's head at every position: per sequence [L, num_labels] fp32 (no softmax)."""
        return self._request(seqs, Wanted(token_scores=True), lambda r: r.token_scores)

    def step_scores(self, seqs: Sequence, separators: Optional[Sequence[int]] = None):
        """A process reward model's head at each step separator (`separators`: token ids; None: the server's
        --step-separator): per sequence [num_steps, num_labels] fp32, one row per step in order (no softmax: for a
        two-class PRM, softmax each row and take column 1)."""
        w = Wanted(step_scores=True, step_separators=separators)
        return self._request(seqs, w, lambda r: r.step_scores)

    def reward_tokens(self, seqs: Sequence, token_ids: Sequence[int], positions: Optional[Sequence[int]] = None,
                      logits: bool = False, temperature: float = 1.0):
        """A causal LM as a reward model: log_softmax(z_p/T)[id] (z_p/T with `logits`) for each of `token_ids` at
        each of `positions` (logits rows; negative from the end; None: the last, the distribution after the
        sequence): per sequence [num_positions, num_token_ids] fp32."""
        w = Wanted(temperature=temperature, reward_token_ids=token_ids, reward_logits=logits,
                   reward_positions=positions)
        return self._request(seqs, w, lambda r: r.reward_tokens)


@dataclass(frozen=True)
class Detokenized:
    tokens: tuple[str, ...]          # each id's vocabulary entry
    texts: tuple[str, ...]           # each id decoded alone
    unk_token_id: Optional[int]      # the tokenizer's unknown token, None when it has none


def model_info_of(msg) -> ModelInfo:
    from logitserve.v1 import logitserve_pb2 as pb

    kind = {pb.CAUSAL_LM: "causal_lm", pb.REWARD_MODEL: "reward", pb.TOKEN_REWARD_MODEL: "token_reward"}.get(
        msg.kind, "unknown")
    ranks = tuple(dict(rank=r.rank, tp_rank=r.tp_rank, cp_rank=r.cp_rank, host=r.host, device=r.device,
                       pp_rank=r.pp_rank) for r in msg.ranks)
    return ModelInfo(msg.name, msg.content_hash, msg.architecture, kind, msg.vocab_size, msg.max_sequence_length,
                     msg.dtype, msg.tp_size, msg.cp_size, msg.world_size, msg.num_labels, msg.max_message_bytes,
                     msg.server_version, ranks, batching_name(msg.batching), msg.tp_plan_source,
                     msg.tokenizer_hash, msg.min_shared_prefix, msg.shared_prefix_tokens, max(1, msg.pp_size),
                     msg.quantization)


def batching_name(value: int) -> str:
    """The proto's Batching value as "exact" | "packed" ("unknown" from a server that does not say)."""
    from logitserve.v1 import logitserve_pb2 as pb

    return {pb.EXACT: "exact", pb.PACKED: "packed"}.get(value, "unknown")
