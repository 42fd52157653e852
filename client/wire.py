"""Builds ForwardRequests from Python arguments and decodes tensor bytes; numpy only."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from logitserve.v1 import logitserve_pb2 as pb

DTYPES = {"fp32": pb.FLOAT32, "bf16": pb.BFLOAT16, "fp16": pb.FLOAT16}
_INT32 = np.iinfo(np.int32)


@dataclass(frozen=True)
class Wanted:
    """The outputs of one request; maps one to one onto ForwardRequest."""

    temperature: float = 1.0
    logprobs: bool = False
    top_k: Optional[int] = None            # filters of the token logprobs
    top_p: Optional[float] = None
    topk: Optional[int] = None             # k of the top-k output
    topk_as_logprobs: bool = False
    topk_dtype: str = "fp32"
    topk_tail: bool = False                # also the log of the probability outside the top-k, [L]
    candidates: Optional[Sequence] = None  # one [L_i, c_i] int array per sequence
    full_logits: bool = False
    seq_range: Optional[tuple[int, int]] = None
    vocab_range: Optional[tuple[int, int]] = None
    logits_dtype: str = "fp32"
    scores: bool = False
    timeout_s: Optional[float] = None      # server drops the request after this long (DEADLINE_EXCEEDED)
    add_special_tokens: Optional[bool] = None   # texts only: the server's tokenizer default (True) when None
    prompt_lengths: Optional[Sequence[int]] = None   # P_i per sequence: token outputs only for tokens P_i..L_i-1
    token_ranks: bool = False              # with logprobs: each target's rank, [L] int32
    hidden_states: bool = False            # the lm_head's input over the token rows, [L, H]
    hidden_dtype: str = "fp32"             # fp32 | bf16 on the wire
    input_offsets: bool = False            # texts only: each token's UTF-8 byte span, [L, 2] int32
    token_scores: bool = False             # token-classification models: the head at every position, [L, labels]
    step_scores: bool = False              # token-classification models: the head at each step separator
    step_separators: Optional[Sequence[int]] = None   # separator ids; None: the server's --step-separator
    reward_token_ids: Optional[Sequence[int]] = None  # causal LMs: logprobs of these ids at reward_positions
    reward_logits: bool = False            # z/T instead of logprobs for reward_token_ids
    reward_positions: Optional[Sequence[int]] = None  # logits rows (negative from the end); None: the last


def int32_tensor(values, name: str) -> pb.Tensor:
    arr = np.asarray(values)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name}: token ids must be integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < _INT32.min or arr.max() > _INT32.max):
        raise ValueError(f"{name}: token ids must fit in int32")
    arr = np.ascontiguousarray(arr, dtype="<i4")
    return pb.Tensor(dtype=pb.INT32, shape=list(arr.shape), data=arr.tobytes())


def _dtype(name: str, field: str) -> int:
    if name not in DTYPES:
        raise ValueError(f"{field}={name!r}: choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def build_request(request_id: str, seqs: Sequence, w: Wanted) -> pb.ForwardRequest:
    """`seqs`: token-id sequences, or strings that the server tokenizes (never a mix)."""
    texts = [isinstance(s, str) for s in seqs]
    if any(texts) and not all(texts):
        raise TypeError("seqs: give either token-id sequences or texts (str), not a mix")
    req = pb.ForwardRequest(request_id=request_id, temperature=float(w.temperature))
    if seqs and all(texts):
        req.texts.extend(seqs)
        if w.add_special_tokens is not None:
            req.add_special_tokens = bool(w.add_special_tokens)
    else:
        req.sequences.extend(int32_tensor(s, f"seqs[{i}]") for i, s in enumerate(seqs))
    if w.token_ranks and not w.logprobs:
        raise ValueError("token_ranks=True needs logprobs=True")
    if w.logprobs:
        req.logprobs.SetInParent()
        req.logprobs.ranks = bool(w.token_ranks)
        if w.top_k is not None:
            req.logprobs.top_k = int(w.top_k)
        if w.top_p is not None:
            req.logprobs.top_p = float(w.top_p)
    if w.topk is not None:
        req.topk.k = int(w.topk)
        req.topk.as_logprobs = bool(w.topk_as_logprobs)
        req.topk.dtype = _dtype(w.topk_dtype, "topk_dtype")
        req.topk.tail_mass = bool(w.topk_tail)
    if w.candidates is not None:
        req.candidates.ids.extend(int32_tensor(c, f"candidates[{i}]") for i, c in enumerate(w.candidates))
    if w.full_logits:
        f = req.full_logits
        f.dtype = _dtype(w.logits_dtype, "dtype")
        if w.seq_range is not None:
            f.seq_start, f.seq_end = (int(x) for x in w.seq_range)
        if w.vocab_range is not None:
            f.vocab_start, f.vocab_end = (int(x) for x in w.vocab_range)
    if w.scores:
        req.scores.SetInParent()
    _reward_fields(req, w)
    if w.hidden_states:
        if w.hidden_dtype not in ("fp32", "bf16"):
            raise ValueError(f"hidden_dtype={w.hidden_dtype!r}: choose fp32 or bf16")
        req.hidden_states.dtype = DTYPES[w.hidden_dtype]
    if w.input_offsets:
        if not req.texts:
            raise ValueError("input_offsets=True needs texts (str) as seqs: offsets are into the text")
        req.input_offsets = True
    if w.timeout_s is not None:
        req.timeout_s = float(w.timeout_s)
    if w.prompt_lengths is not None:
        if len(w.prompt_lengths) != len(seqs):
            raise ValueError(f"prompt_lengths: {len(w.prompt_lengths)} given for {len(seqs)} sequences")
        req.prompt_lengths.extend(int(p) for p in w.prompt_lengths)
    return req


def _reward_fields(req: pb.ForwardRequest, w: Wanted) -> None:
    """Token scores, step scores and reward tokens: the reward models' outputs beyond a sequence's score."""
    if w.token_scores:
        req.token_scores.SetInParent()
    if w.step_separators is not None and not w.step_scores:
        raise ValueError("step_separators needs step_scores=True")
    if w.step_scores:
        req.step_scores.SetInParent()
        req.step_scores.separator_ids.extend(int(x) for x in (w.step_separators or ()))
    if w.reward_token_ids is None:
        if w.reward_positions is not None or w.reward_logits:
            raise ValueError("reward_positions and reward_logits need reward_token_ids")
        return
    req.reward_tokens.SetInParent()
    req.reward_tokens.token_ids.extend(int(x) for x in w.reward_token_ids)
    req.reward_tokens.logits = bool(w.reward_logits)
    req.reward_tokens.positions.extend(int(x) for x in (w.reward_positions or ()))


# wire dtype -> (numpy dtype of the bytes, numpy dtype of the assembled array)
DECODE = {
    pb.FLOAT32: (np.dtype("<f4"), np.dtype(np.float32)),
    pb.BFLOAT16: (np.dtype("<u2"), np.dtype(np.float32)),
    pb.FLOAT16: (np.dtype("<f2"), np.dtype(np.float16)),
    pb.INT32: (np.dtype("<i4"), np.dtype(np.int32)),
}
