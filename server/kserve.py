"""KServe v2 / Open Inference Protocol on the same port: what tritonclient's InferenceServerClient calls.

Inputs: `input_ids` INT32/INT64 [B, L] (rows past `sequence_lengths` [B], when given, are padding),
optional `candidate_ids` INT32 [B, L, c]. Request parameters pick the outputs' options:
`temperature`, `top_k` / `top_p` (filters of the token logprobs), `k` (top-k size, also accepted on
the requested `topk_values` output), `topk_as_logprobs`, `topk_dtype` ("BF16", "FP16", "FP32"),
`seq_start`/`seq_end`/`vocab_start`/`vocab_end` (the full-logits rectangle), `timeout_s`.
Outputs, by name: `token_logprobs` FP32 [B, L], `topk_values` [B, L, k], `topk_ids` INT32 [B, L, k],
`topk_tail` FP32 [B, L], `candidate_logprobs` FP32 [B, L, c], `full_logits` FP32 [B, s1-s0, v1-v0],
`scores` FP32 [B, num_labels]; none asked: token_logprobs (causal LM) or scores (reward model).
Rows past a sequence's length are 0. Tensors travel raw (BF16 as its 2-byte bits). No math here.
"""
from __future__ import annotations

import asyncio
from typing import Optional

import grpc
import numpy as np
import torch

from logitserve.errors import InvalidRequest
from logitserve.kserve import grpc_predict_v2_pb2 as kpb
from logitserve.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc
from logitserve.spec import Job, LogprobsOpts, ModelKind, OutputKind, SliceOpts, TopKOpts, WireDType
from logitserve.validate import validate_job

from .status import to_status

OUTPUTS = {"token_logprobs": OutputKind.TOKEN_LOGPROBS, "topk_values": OutputKind.TOPK_VALUES,
           "topk_ids": OutputKind.TOPK_IDS, "topk_tail": OutputKind.TOPK_TAIL,
           "candidate_logprobs": OutputKind.CANDIDATE_LOGPROBS, "full_logits": OutputKind.FULL_LOGITS,
           "scores": OutputKind.SCORES}
_WIRE = {"FP32": WireDType.FP32, "BF16": WireDType.BF16, "FP16": WireDType.FP16}
_KS_DTYPE = {torch.float32: "FP32", torch.bfloat16: "BF16", torch.float16: "FP16", torch.int32: "INT32"}
_NP_IN = {"INT32": "<i4", "INT64": "<i8"}


def _param(params, name: str, default=None):
    if name not in params:
        return default
    p = params[name]
    return getattr(p, p.WhichOneof("parameter_choice")) if p.WhichOneof("parameter_choice") else default


def _input(req: kpb.ModelInferRequest, name: str) -> Optional[np.ndarray]:
    for i, t in enumerate(req.inputs):
        if t.name != name:
            continue
        if t.datatype not in _NP_IN:
            raise InvalidRequest(f"inputs[{name}].datatype", f"{t.datatype!r}: send INT32 or INT64")
        shape = tuple(int(d) for d in t.shape)
        if any(d < 0 for d in shape) or int(np.prod(shape)) > 1 << 31:
            raise InvalidRequest(f"inputs[{name}].shape", f"{list(shape)} must be non-negative and hold < 2^31")
        if i < len(req.raw_input_contents):
            raw = req.raw_input_contents[i]
            width = np.dtype(_NP_IN[t.datatype]).itemsize
            if len(raw) != width * int(np.prod(shape)):
                raise InvalidRequest(f"inputs[{name}]", f"{len(raw)} raw bytes do not hold {t.datatype} {list(shape)}")
            return np.frombuffer(raw, dtype=_NP_IN[t.datatype]).reshape(shape)
        values = t.contents.int_contents if t.datatype == "INT32" else t.contents.int64_contents
        if len(values) != int(np.prod(shape)):
            raise InvalidRequest(f"inputs[{name}]", f"{len(values)} values do not fill {list(shape)}")
        return np.asarray(values, dtype=_NP_IN[t.datatype]).reshape(shape)
    return None


def decode(req: kpb.ModelInferRequest, kind: ModelKind) -> tuple[Job, list[str]]:
    """The Job and the output names of a ModelInferRequest; malformed input raises InvalidRequest."""
    ids = _input(req, "input_ids")
    if ids is None or ids.ndim != 2:
        raise InvalidRequest("inputs[input_ids]", "an INT32 or INT64 [B, L] tensor named input_ids is needed")
    lengths = _input(req, "sequence_lengths")
    lengths = [ids.shape[1]] * ids.shape[0] if lengths is None else [int(x) for x in lengths.reshape(-1)]
    if len(lengths) != ids.shape[0] or any(not 0 <= n <= ids.shape[1] for n in lengths):
        raise InvalidRequest("inputs[sequence_lengths]", f"{lengths}: one length in [0, {ids.shape[1]}] per row")
    if ids.size and (ids.min() < np.iinfo(np.int32).min or ids.max() > np.iinfo(np.int32).max):
        raise InvalidRequest("inputs[input_ids]", "ids must fit in int32")
    seqs = tuple(np.ascontiguousarray(ids[b, :n], dtype=np.int32) for b, n in enumerate(lengths))
    p = req.parameters
    names = [o.name for o in req.outputs] or (["scores"] if kind is ModelKind.REWARD else ["token_logprobs"])
    unknown = sorted(set(names) - set(OUTPUTS))
    if unknown:
        raise InvalidRequest("outputs", f"{unknown} unknown; outputs are {sorted(OUTPUTS)}")
    k = _param(p, "k")
    for o in req.outputs:
        k = _param(o.parameters, "k", k)
    logprobs = topk = cands = sl = None
    if "token_logprobs" in names:
        logprobs = LogprobsOpts(top_k=_param(p, "top_k"), top_p=_param(p, "top_p"))
    if {"topk_values", "topk_ids", "topk_tail"} & set(names):
        if k is None:
            raise InvalidRequest("parameters[k]", "top-k outputs need the int64 parameter k (1 <= k <= V)")
        dtype = str(_param(p, "topk_dtype", "FP32")).upper()
        if dtype not in _WIRE:
            raise InvalidRequest("parameters[topk_dtype]", f"{dtype!r}: choose FP32, BF16 or FP16")
        topk = TopKOpts(k=int(k), as_logprobs=bool(_param(p, "topk_as_logprobs", False)), dtype=_WIRE[dtype],
                        tail_mass="topk_tail" in names)
    if "candidate_logprobs" in names:
        c = _input(req, "candidate_ids")
        if c is None or c.ndim != 3 or c.shape[:2] != ids.shape:
            raise InvalidRequest("inputs[candidate_ids]", "candidate_logprobs needs INT32 candidate_ids [B, L, c]")
        cands = tuple(np.ascontiguousarray(c[b, :n], dtype=np.int32) for b, n in enumerate(lengths))
    if "full_logits" in names:
        sl = SliceOpts(*(_param(p, n) for n in ("seq_start", "seq_end", "vocab_start", "vocab_end")))
    temperature = _param(p, "temperature", 1.0)
    job = Job(sequences=seqs, temperature=float(temperature), logprobs=logprobs, topk=topk, candidates=cands,
              full_logits=sl, scores="scores" in names)
    return job, names


class _Dense:
    """Pieces written into one zero-padded [B, ...] array per output."""

    def __init__(self, batch: int):
        self.batch = batch
        self.arrays: dict[OutputKind, torch.Tensor] = {}
        self.full: dict[OutputKind, list[tuple]] = {}

    def add(self, piece) -> None:
        self.full.setdefault(piece.output, []).append(piece.full_shape)
        arr = self.arrays.get(piece.output)
        shape = (self.batch, *piece.full_shape)
        if arr is None or any(a < s for a, s in zip(arr.shape, shape)):
            grown = torch.zeros(tuple(max(a, s) for a, s in zip(arr.shape, shape)) if arr is not None else shape,
                                dtype=piece.tensor.dtype)
            if arr is not None:
                grown[tuple(slice(0, d) for d in arr.shape)] = arr
            arr = self.arrays[piece.output] = grown
        index = (piece.sequence, *(slice(o, o + d) for o, d in zip(piece.offset, piece.tensor.shape)))
        arr[index] = piece.tensor


class KServeServicer(kpb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, scheduler, loaded, version: str, ready):
        self._scheduler, self._loaded, self._version, self._ready = scheduler, loaded, version, ready

    async def ServerLive(self, request, context):
        return kpb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return kpb.ServerReadyResponse(ready=self._ready())

    async def ModelReady(self, request, context):
        return kpb.ModelReadyResponse(ready=self._ready() and request.name in ("", self._loaded.name))

    async def ServerMetadata(self, request, context):
        return kpb.ServerMetadataResponse(name="logitserve", version=self._version, extensions=["logprobs"])

    async def ModelMetadata(self, request, context):
        if request.name not in ("", self._loaded.name):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"name: model {request.name!r} is not served here; "
                                                           f"this server holds {self._loaded.name!r}")
        T = kpb.ModelMetadataResponse.TensorMetadata
        inputs = [T(name="input_ids", datatype="INT32", shape=[-1, -1]),
                  T(name="sequence_lengths", datatype="INT32", shape=[-1]),
                  T(name="candidate_ids", datatype="INT32", shape=[-1, -1, -1])]
        outputs = ([T(name="scores", datatype="FP32", shape=[-1, self._loaded.num_labels])]
                   if self._loaded.kind is ModelKind.REWARD else
                   [T(name="token_logprobs", datatype="FP32", shape=[-1, -1]),
                    T(name="topk_values", datatype="FP32", shape=[-1, -1, -1]),
                    T(name="topk_ids", datatype="INT32", shape=[-1, -1, -1]),
                    T(name="topk_tail", datatype="FP32", shape=[-1, -1]),
                    T(name="candidate_logprobs", datatype="FP32", shape=[-1, -1, -1]),
                    T(name="full_logits", datatype="FP32", shape=[-1, -1, -1])])
        return kpb.ModelMetadataResponse(name=self._loaded.name, versions=["1"], platform="logitserve",
                                         inputs=inputs, outputs=outputs)

    async def _infer(self, request: kpb.ModelInferRequest) -> kpb.ModelInferResponse:
        if request.model_name not in ("", self._loaded.name):
            raise InvalidRequest("model_name", f"{request.model_name!r} is not served here; this server holds "
                                               f"{self._loaded.name!r}")
        job, names = decode(request, self._loaded.kind)
        validate_job(job, self._loaded.limits)
        timeout = _param(request.parameters, "timeout_s")
        dense = _Dense(len(job.sequences))
        async with asyncio.timeout(timeout):
            async for piece in self._scheduler.stream(job):
                dense.add(piece)
        resp = kpb.ModelInferResponse(model_name=self._loaded.name, model_version="1", id=request.id)
        for name in names:
            arr = dense.arrays.get(OUTPUTS[name])
            if arr is None:
                arr = torch.zeros((len(job.sequences), 0), dtype=torch.float32)
            resp.outputs.add(name=name, datatype=_KS_DTYPE[arr.dtype], shape=list(arr.shape))
            view = arr.view(torch.int16) if arr.dtype == torch.bfloat16 else arr
            resp.raw_output_contents.append(view.contiguous().numpy().tobytes())
        return resp

    async def ModelInfer(self, request, context):
        try:
            return await self._infer(request)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "timeout_s: the request did not finish in time")
        except Exception as e:      # noqa: BLE001 (every error becomes its status, in one place)
            code, message = to_status(e)
            await context.abort(code, message)

    async def ModelStreamInfer(self, request_iterator, context):
        async for request in request_iterator:
            try:
                yield kpb.ModelStreamInferResponse(infer_response=await self._infer(request))
            except Exception as e:  # noqa: BLE001
                code, message = to_status(e) if not isinstance(e, TimeoutError) else \
                    (grpc.StatusCode.DEADLINE_EXCEEDED, "timeout_s: the request did not finish in time")
                yield kpb.ModelStreamInferResponse(error_message=f"{code.name}: {message}")
