"""Reassembles a request's chunks into preallocated arrays and proves every element came exactly once."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import grpc
import numpy as np

from logitserve.v1 import logitserve_pb2 as pb

from .api import batching_name
from .errors import LogitServeError
from .wire import DECODE


@dataclass(frozen=True)
class Applied:
    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]


@dataclass(frozen=True)
class ModelIdentity:
    name: str
    content_hash: str
    vocab_size: int


@dataclass
class ForwardResult:
    """One array per sequence for each output asked for; None for the others."""

    logprobs: Optional[list] = None            # [L] fp32
    topk_values: Optional[list] = None         # [L, k] fp32 (bf16/fp16 values on request)
    topk_ids: Optional[list] = None            # [L, k] int32
    topk_tail: Optional[list] = None           # [L] fp32: log of the probability outside the top-k ids
    token_ranks: Optional[list] = None         # [L] int32: each target's 1-based rank (0 at row 0), with logprobs
    candidate_logprobs: Optional[list] = None  # [L, c] fp32
    full_logits: Optional[list] = None         # [s1 - s0, v1 - v0]
    scores: Optional[list] = None              # [num_labels] fp32
    input_ids: Optional[list] = None           # [L] int32: texts as the server tokenized them (text requests)
    input_offsets: Optional[list] = None       # [L, 2] int32: each token's UTF-8 byte span in its text
    hidden_states: Optional[list] = None       # [L, H] (or [L - P, H]): the lm_head's input; see TeacherHead
    token_scores: Optional[list] = None        # [L, num_labels] fp32: a token classifier at every position
    step_scores: Optional[list] = None         # [num_steps, num_labels] fp32: it at each step separator
    reward_tokens: Optional[list] = None       # [num_positions, num_token_ids] fp32: logprobs (or logits)
    applied: Optional[Applied] = None
    model: Optional[ModelIdentity] = None
    batching: Optional[str] = None             # "exact" | "packed": the mode the server's body ran in
    shared_prefix_tokens: int = 0              # tokens not computed for these sequences: a prefix shared in a batch


_FIELD = {pb.TOKEN_LOGPROBS: "logprobs", pb.TOPK_VALUES: "topk_values", pb.TOPK_IDS: "topk_ids",
          pb.CANDIDATE_LOGPROBS: "candidate_logprobs", pb.FULL_LOGITS: "full_logits", pb.SCORES: "scores",
          pb.INPUT_IDS: "input_ids", pb.TOPK_TAIL: "topk_tail", pb.TOKEN_RANKS: "token_ranks",
          pb.HIDDEN_STATES: "hidden_states", pb.INPUT_OFFSETS: "input_offsets", pb.TOKEN_SCORES: "token_scores",
          pb.STEP_SCORES: "step_scores", pb.REWARD_TOKENS: "reward_tokens"}


def _lost(message: str) -> LogitServeError:
    return LogitServeError(grpc.StatusCode.DATA_LOSS, message)


@dataclass
class _Target:
    array: np.ndarray
    wire_dtype: int
    rects: list = field(default_factory=list)   # (r0, r1, c0, c1) written so far


def _check_exact_cover(rects: list, shape: tuple, what: str) -> None:
    """Rectangles cover `shape` exactly once: total area matches and no two overlap."""
    total = sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in rects)
    expected = int(np.prod(shape))
    rects = sorted(rects)
    active: list = []
    for r in rects:
        active = [a for a in active if a[1] > r[0]]
        for a in active:
            if a[2] < r[3] and r[2] < a[3]:
                raise _lost(f"{what}: elements written twice (rows {max(a[0], r[0])}.., cols {max(a[2], r[2])}..)")
        active.append(r)
    if total != expected:
        raise _lost(f"{what}: {expected - total} of {expected} elements missing")


class Assembly:
    """Collects one request's chunks; `finish` returns its ForwardResult or raises DATA_LOSS."""

    def __init__(self, num_sequences: int, wanted: tuple[str, ...], bf16_as_torch: bool = False):
        self._n = num_sequences
        self._wanted = wanted
        self._bf16_as_torch = bf16_as_torch
        self._targets: dict[tuple[int, int], _Target] = {}
        self._chunks = 0

    @property
    def received(self) -> int:
        """Chunks arrived so far."""
        return self._chunks

    def add(self, chunk: pb.TensorChunk) -> None:
        self._chunks += 1
        key = (chunk.output, chunk.sequence)
        what = f"{_FIELD.get(chunk.output, chunk.output)}[{chunk.sequence}]"
        if chunk.output not in _FIELD or chunk.sequence >= self._n:
            raise _lost(f"{what}: chunk for an output or sequence this request did not ask for")
        t = chunk.tensor
        if t.dtype not in DECODE:
            raise _lost(f"{what}: unknown dtype {t.dtype}")
        full = tuple(chunk.full_shape)
        shape, offset = tuple(t.shape), tuple(chunk.offset)
        if not (len(full) == len(shape) == len(offset) and all(
                0 <= o and o + s <= f for o, s, f in zip(offset, shape, full))):
            raise _lost(f"{what}: chunk {list(shape)} at {list(offset)} lies outside {list(full)}")
        target = self._targets.get(key)
        if target is None:
            byte_dtype, out_dtype = DECODE[t.dtype]
            if t.dtype == pb.BFLOAT16 and self._bf16_as_torch:
                out_dtype = byte_dtype
            target = self._targets[key] = _Target(np.empty(full, dtype=out_dtype), t.dtype)
        elif target.array.shape != full or target.wire_dtype != t.dtype:
            raise _lost(f"{what}: chunks disagree on shape or dtype")
        byte_dtype, _ = DECODE[t.dtype]
        data = np.frombuffer(t.data, dtype=byte_dtype)
        if data.size != int(np.prod(shape)):
            raise _lost(f"{what}: {len(t.data)} bytes do not hold {list(shape)}")
        data = data.reshape(shape)
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
        if t.dtype == pb.BFLOAT16 and not self._bf16_as_torch:
            # bf16 -> fp32 is the bits moved up 16: one pass, written straight into the float32 array
            np.left_shift(data, 16, out=target.array.view(np.uint32)[index], dtype=np.uint32, casting="unsafe")
        else:
            target.array[index] = data
        if len(shape) == 1:
            target.rects.append((offset[0], offset[0] + shape[0], 0, 1))
        else:
            target.rects.append((offset[0], offset[0] + shape[0], offset[1], offset[1] + shape[1]))

    def finish(self, done: pb.RequestDone) -> ForwardResult:
        if done.num_chunks != self._chunks:
            raise _lost(f"server sent {done.num_chunks} chunks, {self._chunks} arrived")
        result = ForwardResult(
            applied=Applied(done.applied.temperature,
                            done.applied.top_k if done.applied.HasField("top_k") else None,
                            done.applied.top_p if done.applied.HasField("top_p") else None),
            model=ModelIdentity(done.model.name, done.model.content_hash, done.model.vocab_size),
            batching=batching_name(done.batching), shared_prefix_tokens=done.shared_prefix_tokens)
        outputs = {name: [None] * self._n for name in self._wanted}
        for (output, seq), target in self._targets.items():
            name = _FIELD[output]
            if name not in outputs:
                raise _lost(f"{name}[{seq}]: output not asked for")
            shape = target.array.shape if target.array.ndim == 2 else (target.array.shape[0], 1)
            _check_exact_cover(target.rects, shape, f"{name}[{seq}]")
            array = target.array
            if target.wire_dtype == pb.BFLOAT16 and self._bf16_as_torch:
                import torch  # only when the caller asked for torch tensors
                array = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
            outputs[name][seq] = array
        for name, arrays in outputs.items():
            missing = [i for i, a in enumerate(arrays) if a is None]
            if missing:
                raise _lost(f"{name}: no data for sequences {missing}")
            setattr(result, name, arrays)
        return result


def wanted_fields(req: pb.ForwardRequest) -> tuple[str, ...]:
    """Names of the ForwardResult fields a request will fill."""
    names = ["input_ids"] if req.texts else []
    if req.input_offsets:
        names.append("input_offsets")
    if req.HasField("hidden_states"):
        names.append("hidden_states")
    if req.HasField("logprobs"):
        names.append("logprobs")
        if req.logprobs.ranks:
            names.append("token_ranks")
    if req.HasField("topk"):
        names += ["topk_values", "topk_ids"] + (["topk_tail"] if req.topk.tail_mass else [])
    if req.HasField("candidates"):
        names.append("candidate_logprobs")
    if req.HasField("full_logits"):
        names.append("full_logits")
    if req.HasField("scores"):
        names.append("scores")
    names += [n for n in ("token_scores", "step_scores", "reward_tokens") if req.HasField(n)]
    return tuple(names)
