"""Translates between the proto messages and the core's Job / Piece types; no math."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional

import grpc
import numpy as np
import torch
from google.protobuf.message import DecodeError

from logitserve.engine import Piece
from logitserve.head_export import tensor_bytes
from logitserve.errors import InvalidRequest
from logitserve.spec import (HiddenOpts, Job, LogprobsOpts, OutputKind, RewardTokensOpts, SliceOpts, StepOpts,
                             TopKOpts, WireDType)
from logitserve.validate import check_listed
from logitserve.v1 import logitserve_pb2 as pb

MAX_REQUEST_ID = 256   # bytes of UTF-8 of a request id or a model name (every front-end); checked before one is logged
# Room left in each message for everything but the tensor bytes (ids, shapes, offsets, framing).
HEADER_ROOM = 4096

_WIRE_OF_PB = {pb.DTYPE_UNSPECIFIED: WireDType.FP32, pb.FLOAT32: WireDType.FP32,
               pb.BFLOAT16: WireDType.BF16, pb.FLOAT16: WireDType.FP16}
_PB_OF_TORCH = {torch.float32: pb.FLOAT32, torch.bfloat16: pb.BFLOAT16, torch.float16: pb.FLOAT16,
                torch.int32: pb.INT32}


def _wire_dtype(field: str, value: int) -> WireDType:
    if value not in _WIRE_OF_PB:
        raise InvalidRequest(field, f"unknown wire dtype {value}; use FLOAT32, BFLOAT16 or FLOAT16")
    return _WIRE_OF_PB[value]


def _int32_tensor(field: str, t: pb.Tensor, ndim: int) -> np.ndarray:
    if t.dtype not in (pb.INT32, pb.DTYPE_UNSPECIFIED):
        raise InvalidRequest(field, f"token ids must be INT32, got {pb.DType.Name(t.dtype) if t.dtype in pb.DType.values() else t.dtype}")
    shape = tuple(int(d) for d in t.shape)
    if len(shape) != ndim or any(not 0 <= d <= 1 << 31 for d in shape):
        raise InvalidRequest(field, f"shape {list(shape)[:8]} must have {ndim} dimensions in [0, 2^31]")
    count = math.prod(shape)      # Python ints: a shape that overflows int64 cannot wrap to a small count
    if len(t.data) != 4 * count:
        raise InvalidRequest(field, f"{len(t.data)} bytes do not hold int32 shape {list(shape)} ({4 * count} bytes)")
    return np.frombuffer(t.data, dtype="<i4").reshape(shape)


@dataclass(frozen=True)
class Undecodable:
    """A request message whose bytes are no ForwardRequest (what the lenient deserializer returns)."""

    size: int
    error: str


def decode_forward_request(raw: bytes):
    """pb.ForwardRequest, or Undecodable: gRPC would otherwise end the stream quietly with status OK."""
    try:
        return pb.ForwardRequest.FromString(raw)
    except DecodeError as e:
        return Undecodable(len(raw), str(e)[:200])


def _over(name: str) -> Optional[int]:
    """The UTF-8 size of a client's name for something when it is over MAX_REQUEST_ID bytes, else None."""
    if len(name) <= MAX_REQUEST_ID // 4:     # at most 4 UTF-8 bytes a character
        return None
    n = len(name.encode("utf-8", "surrogatepass"))
    return n if n > MAX_REQUEST_ID else None


def check_name(name: str, field: str) -> None:
    """InvalidRequest naming `field` and the bound for a request id or model name over MAX_REQUEST_ID bytes
    (the message never repeats the name)."""
    n = _over(name)
    if n is not None:
        raise InvalidRequest(field, f"{n} bytes is over the limit of {MAX_REQUEST_ID} bytes")


def request_id_error(rid: str) -> Optional[str]:
    """Why a request id cannot be used (too long), or None; the message never repeats the id."""
    n = _over(rid)
    return None if n is None else f"request_id: {n} bytes is over the limit of {MAX_REQUEST_ID} bytes"


ECHO_ID_BYTES = 64 << 10   # an over-long id up to this size is echoed whole (the client can match it), never logged


def echoed_id(rid: str) -> str:
    """The id an error answers under: whole while it fits comfortably in a message, else its first bytes."""
    return rid if len(rid) <= ECHO_ID_BYTES // 4 or len(rid.encode("utf-8", "surrogatepass")) <= ECHO_ID_BYTES \
        else shown_id(rid)


def shown_id(rid: str) -> str:
    """A request id as it may be logged or echoed: at most MAX_REQUEST_ID bytes."""
    return rid if len(rid) <= MAX_REQUEST_ID // 4 or request_id_error(rid) is None else \
        rid.encode("utf-8", "surrogatepass")[:MAX_REQUEST_ID].decode("utf-8", "ignore")


def decode_job(req: pb.ForwardRequest, texts_ids: Optional[tuple] = None) -> Job:
    """A Job from a ForwardRequest; malformed fields raise InvalidRequest naming the field.

    `texts_ids`: the ids of req.texts, tokenized by the caller (the servicer, which refuses a request that
    sets both texts and sequences before tokenizing), used as the sequences.
    """
    if texts_ids is not None:
        seqs = texts_ids
    else:
        seqs = tuple(_int32_tensor(f"sequences[{i}]", t, 1) for i, t in enumerate(req.sequences))
    logprobs = topk = cands = sl = None
    if req.HasField("logprobs"):
        lp = req.logprobs
        logprobs = LogprobsOpts(top_k=lp.top_k if lp.HasField("top_k") else None,
                                top_p=lp.top_p if lp.HasField("top_p") else None, ranks=lp.ranks)
    if req.HasField("topk"):
        topk = TopKOpts(k=req.topk.k, as_logprobs=req.topk.as_logprobs,
                        dtype=_wire_dtype("topk.dtype", req.topk.dtype), tail_mass=req.topk.tail_mass)
    if req.HasField("candidates"):
        cands = tuple(_int32_tensor(f"candidates.ids[{i}]", t, 2) for i, t in enumerate(req.candidates.ids))
    if req.HasField("full_logits"):
        f = req.full_logits
        sl = SliceOpts(*(getattr(f, n) if f.HasField(n) else None
                         for n in ("seq_start", "seq_end", "vocab_start", "vocab_end")),
                       dtype=_wire_dtype("full_logits.dtype", f.dtype))
    hidden = None
    if req.HasField("hidden_states"):
        hidden = HiddenOpts(_wire_dtype("hidden_states.dtype", req.hidden_states.dtype))
    if req.input_offsets and not req.texts:
        raise InvalidRequest("input_offsets", "byte offsets come with texts; this request sends token ids")
    return Job(sequences=seqs, temperature=req.temperature if req.HasField("temperature") else 1.0,
               logprobs=logprobs, topk=topk, candidates=cands, full_logits=sl, scores=req.HasField("scores"),
               prompt_lengths=tuple(int(p) for p in req.prompt_lengths) if req.prompt_lengths else None,
               hidden_states=hidden, token_scores=req.HasField("token_scores"), step_scores=_steps(req),
               reward_tokens=_reward_tokens(req))


def _listed(field: str, values) -> tuple[int, ...]:
    """A repeated int32 field as a tuple, its declared count checked before it is converted."""
    check_listed(field, len(values))
    return tuple(int(x) for x in values)


def _steps(req: pb.ForwardRequest) -> Optional[StepOpts]:
    if not req.HasField("step_scores"):
        return None
    return StepOpts(_listed("step_scores.separator_ids", req.step_scores.separator_ids))


def _reward_tokens(req: pb.ForwardRequest) -> Optional[RewardTokensOpts]:
    if not req.HasField("reward_tokens"):
        return None
    rt = req.reward_tokens
    return RewardTokensOpts(_listed("reward_tokens.token_ids", rt.token_ids), logits=rt.logits,
                            positions=_listed("reward_tokens.positions", rt.positions) or (-1,))


def outputs_of(job: Optional[Job]) -> tuple[str, ...]:
    """The outputs a job asks for, as metric labels; ("none",) for a request that never became a job."""
    if job is None:
        return ("none",)
    names = [n for n, on in (("logprobs", job.logprobs), ("topk", job.topk), ("candidates", job.candidates),
                             ("full_logits", job.full_logits), ("hidden_states", job.hidden_states),
                             ("reward_tokens", job.reward_tokens), ("step_scores", job.step_scores)) if on is not None]
    names += [n for n, on in (("scores", job.scores), ("token_scores", job.token_scores)) if on]
    return tuple(names) or ("none",)


def input_id_pieces(ids: Optional[tuple], offsets: Optional[tuple] = None) -> list[Piece]:
    """A text request's ids as INPUT_IDS pieces, one [L] int32 per text, and their byte offsets as INPUT_OFFSETS
    ([L, 2] int32) when asked for; none for a request of token ids."""
    pieces = [Piece(OutputKind.INPUT_IDS, i, (len(x),), (0,), torch.from_numpy(np.ascontiguousarray(x)))
              for i, x in enumerate(ids or ())]
    pieces += [Piece(OutputKind.INPUT_OFFSETS, i, tuple(x.shape), (0, 0), torch.from_numpy(np.ascontiguousarray(x)))
               for i, x in enumerate(offsets or ())]
    return pieces


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw little-endian bytes, as the Head RPC's hash reads them (head_export.tensor_bytes)."""
    return tensor_bytes(t.contiguous()).tobytes()


def encode_piece(request_id: str, piece: Piece, max_message_bytes: int) -> Iterator[pb.ForwardResponse]:
    """The piece as chunk messages, each under max_message_bytes: row bands, split by columns if a row is too big."""
    t = piece.tensor
    budget = max(max_message_bytes - HEADER_ROOM, 1024)
    item = t.element_size()
    if t.dim() == 1:
        t = t[:, None]
    rows, cols = t.shape
    row_bytes = max(cols * item, 1)
    if row_bytes <= budget:
        band, width = max(budget // row_bytes, 1), cols
    else:
        band, width = 1, max(budget // item, 1)
    one_d = piece.tensor.dim() == 1
    if rows == 0:     # an output with no rows (prompt_lengths P = L) still arrives, as one empty chunk
        yield pb.ForwardResponse(request_id=request_id, chunk=pb.TensorChunk(
            output=int(piece.output), sequence=piece.sequence, full_shape=list(piece.full_shape),
            offset=list(piece.offset), tensor=pb.Tensor(dtype=_PB_OF_TORCH[t.dtype], shape=list(piece.tensor.shape))))
        return
    for r0 in range(0, rows, band):
        r1 = min(r0 + band, rows)
        for c0 in range(0, cols, width):
            c1 = min(c0 + width, cols)
            tile = t[r0:r1, c0:c1]
            shape = [r1 - r0] if one_d else [r1 - r0, c1 - c0]
            offset = [piece.offset[0] + r0] if one_d else [piece.offset[0] + r0, piece.offset[1] + c0]
            yield pb.ForwardResponse(request_id=request_id, chunk=pb.TensorChunk(
                output=int(piece.output), sequence=piece.sequence, full_shape=list(piece.full_shape),
                offset=offset,
                tensor=pb.Tensor(dtype=_PB_OF_TORCH[tile.dtype], shape=shape, data=_tensor_bytes(tile))))


def encode_done(request_id: str, job: Job, identity: pb.ModelIdentity, num_chunks: int,
                batching: int = pb.BATCHING_UNSPECIFIED, shared: int = 0) -> pb.ForwardResponse:
    applied = pb.Applied(temperature=job.temperature)
    if job.logprobs is not None:
        if job.logprobs.top_k is not None:
            applied.top_k = job.logprobs.top_k
        if job.logprobs.top_p is not None:
            applied.top_p = job.logprobs.top_p
    return pb.ForwardResponse(request_id=request_id, done=pb.RequestDone(
        applied=applied, model=identity, num_chunks=num_chunks, num_tokens=job.num_tokens, batching=batching,
        shared_prefix_tokens=shared))


def encode_error(request_id: str, code: grpc.StatusCode, message: str) -> pb.ForwardResponse:
    return pb.ForwardResponse(request_id=request_id, error=pb.RequestError(code=code.value[0], message=message))


def identity_of(info: pb.ModelInfoResponse) -> pb.ModelIdentity:
    return pb.ModelIdentity(name=info.name, content_hash=info.content_hash, vocab_size=info.vocab_size)


def encode_batching(mode) -> int:
    """logitserve.engine.Batching -> the proto's Batching value."""
    return pb.Batching.Value(mode.name)


def encode_model_info(loaded, layout, max_message_bytes: int, version: str, batching,
                      min_shared_prefix: int = 0) -> pb.ModelInfoResponse:
    """ModelInfoResponse for a LoadedModel served under a Layout (see logitserve.layout)."""
    from logitserve.loading import DTYPE_NAMES
    from logitserve.spec import ModelKind

    kind = {ModelKind.CAUSAL_LM: pb.CAUSAL_LM, ModelKind.REWARD: pb.REWARD_MODEL,
            ModelKind.TOKEN_REWARD: pb.TOKEN_REWARD_MODEL}[loaded.kind]
    return pb.ModelInfoResponse(
        name=loaded.name, content_hash=loaded.content_hash, architecture=loaded.architecture, kind=kind,
        vocab_size=loaded.vocab_size, max_sequence_length=loaded.max_seq_len, dtype=DTYPE_NAMES[loaded.dtype],
        tp_size=layout.tp, cp_size=layout.cp, world_size=layout.world_size,
        ranks=[pb.RankInfo(rank=r.rank, tp_rank=r.tp_rank, cp_rank=r.cp_rank, host=r.host, device=r.device,
                           pp_rank=r.pp_rank) for r in layout.ranks], pp_size=layout.pp,
        num_labels=loaded.num_labels, max_message_bytes=max_message_bytes, server_version=version,
        batching=encode_batching(batching), tp_plan_source=loaded.plan_source,
        tokenizer_hash=loaded.text.hash if loaded.text is not None else "",
        min_shared_prefix=min_shared_prefix if encode_batching(batching) == pb.PACKED else 0,
        quantization=loaded.quantization)


def encode_head_info(meta, content_hash: str, head_hash: str) -> pb.HeadResponse:
    """logitserve.head_export.HeadMeta as the Head RPC's first message."""
    return pb.HeadResponse(info=pb.HeadInfo(
        content_hash=content_hash, vocab_size=meta.vocab_size, hidden_size=meta.hidden_size,
        dtype=_PB_OF_TORCH[meta.dtype], has_bias=meta.has_bias,
        logits_dtype=pb.FLOAT32 if meta.logits_fp32 else _PB_OF_TORCH[meta.dtype],
        logit_multiply=meta.multiply, logit_divide=meta.divide, softcap=meta.softcap, head_hash=head_hash,
        tied=meta.tied))


def encode_head_chunk(name: str, row: int, t: torch.Tensor) -> pb.HeadResponse:
    """A band of head rows (or the bias) as raw bytes beside dtype and shape."""
    return pb.HeadResponse(chunk=pb.HeadChunk(name=name, row=row, tensor=pb.Tensor(
        dtype=_PB_OF_TORCH[t.dtype], shape=list(t.shape), data=_tensor_bytes(t))))
