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
import time
from typing import Optional

import grpc
import numpy as np
import torch

from logitserve.errors import InvalidRequest, Unavailable
from logitserve.kserve import grpc_predict_v2_pb2 as kpb
from logitserve.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc
from logitserve.spec import Job, LogprobsOpts, ModelKind, OutputKind, SliceOpts, TopKOpts, WireDType
from logitserve.validate import validate_job

from .metrics import account
from .servicer import SHUTTING_DOWN
from .status import to_status

OUTPUTS = {"token_logprobs": OutputKind.TOKEN_LOGPROBS, "topk_values": OutputKind.TOPK_VALUES,
           "topk_ids": OutputKind.TOPK_IDS, "topk_tail": OutputKind.TOPK_TAIL,
           "candidate_logprobs": OutputKind.CANDIDATE_LOGPROBS, "full_logits": OutputKind.FULL_LOGITS,
           "scores": OutputKind.SCORES}
_WIRE = {"FP32": WireDType.FP32, "BF16": WireDType.BF16, "FP16": WireDType.FP16}
_KS_DTYPE = {torch.float32: "FP32", torch.bfloat16: "BF16", torch.float16: "FP16", torch.int32: "INT32"}
_NP_IN = {"INT32": "<i4", "INT64": "<i8"}
_CONFIG_TYPE = {"INT32": kpb.TYPE_INT32, "FP32": kpb.TYPE_FP32}
REQUEST_PARAMETERS = ("k", "temperature", "top_k", "top_p", "topk_as_logprobs", "topk_dtype", "seq_start",
                      "seq_end", "vocab_start", "vocab_end", "timeout_s")


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

    def add(self, piece) -> None:
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
    """The KServe face of the same scheduler; `native` (the LogitServe servicer) owns draining and the
    per-request limits, `metrics` counts these requests beside the native ones."""

    def __init__(self, scheduler, loaded, version: str, native, metrics=None):
        self._scheduler, self._loaded, self._version = scheduler, loaded, version
        self._native, self._metrics = native, metrics
        self._ids = iter(range(1 << 62))

    def _ready(self) -> bool:
        return not self._native.draining

    def _serves(self, name: str) -> bool:
        """An empty name means the one model this server holds."""
        return name in ("", self._loaded.name)

    async def ServerLive(self, request, context):
        return kpb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return kpb.ServerReadyResponse(ready=self._ready())

    async def ModelReady(self, request, context):
        return kpb.ModelReadyResponse(ready=self._ready() and self._serves(request.name))

    async def ServerMetadata(self, request, context):
        return kpb.ServerMetadataResponse(name="logitserve", version=self._version, extensions=["logprobs"])

    async def _check_name(self, name: str, context) -> None:
        if not self._serves(name):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"name: model {name!r} is not served here; "
                                                           f"this server holds {self._loaded.name!r}")

    def _tensors(self) -> tuple[list, list]:
        """(inputs, outputs) as (name, datatype, shape, optional); -1: any size."""
        inputs = [("input_ids", "INT32", [-1, -1], False), ("sequence_lengths", "INT32", [-1], True),
                  ("candidate_ids", "INT32", [-1, -1, -1], True)]
        if self._loaded.kind is ModelKind.REWARD:
            return inputs, [("scores", "FP32", [-1, self._loaded.num_labels], True)]
        return inputs, [("token_logprobs", "FP32", [-1, -1], True), ("topk_values", "FP32", [-1, -1, -1], True),
                        ("topk_ids", "INT32", [-1, -1, -1], True), ("topk_tail", "FP32", [-1, -1], True),
                        ("candidate_logprobs", "FP32", [-1, -1, -1], True),
                        ("full_logits", "FP32", [-1, -1, -1], True)]

    async def ModelMetadata(self, request, context):
        await self._check_name(request.name, context)
        T = kpb.ModelMetadataResponse.TensorMetadata
        inputs, outputs = self._tensors()
        return kpb.ModelMetadataResponse(name=self._loaded.name, versions=["1"], platform="logitserve",
                                         inputs=[T(name=n, datatype=d, shape=s) for n, d, s, _ in inputs],
                                         outputs=[T(name=n, datatype=d, shape=s) for n, d, s, _ in outputs])

    async def ModelConfig(self, request, context):
        """Triton's view of the model: no server-side batching dimension (max_batch_size 0: inputs carry
        their own [B, ...]); the request parameters and the model's limits as string parameters."""
        await self._check_name(request.name, context)
        inputs, outputs = self._tensors()
        m = self._loaded
        params = {"model_kind": m.kind.name.lower(), "architecture": m.architecture, "vocab_size": str(m.vocab_size),
                  "max_sequence_length": str(m.max_seq_len), "dtype": str(m.dtype).removeprefix("torch."),
                  "content_hash": m.content_hash, "request_parameters": ",".join(REQUEST_PARAMETERS)}
        config = kpb.ModelConfig(
            name=m.name, platform="logitserve", backend="logitserve", max_batch_size=0,
            input=[kpb.ModelInput(name=n, data_type=_CONFIG_TYPE[d], dims=s, optional=o) for n, d, s, o in inputs],
            output=[kpb.ModelOutput(name=n, data_type=_CONFIG_TYPE[d], dims=s) for n, d, s, _ in outputs],
            parameters={k: kpb.ModelParameter(string_value=v) for k, v in params.items()})
        return kpb.ModelConfigResponse(config=config)

    async def ModelStatistics(self, request, context):
        """Counts and cumulative ns since start-up, native and KServe requests together."""
        await self._check_name(request.name, context)
        t = self._metrics.totals.snapshot() if self._metrics is not None else None
        stats = kpb.ModelStatistics(name=self._loaded.name, version="1")
        if t is not None:
            D = kpb.StatisticDuration
            stats.last_inference, stats.inference_count = t["last_inference_ms"], t["inference_count"]
            stats.execution_count = t["execution_count"]
            stats.inference_stats.CopyFrom(kpb.InferStatistics(
                success=D(count=t["success"][0], ns=t["success"][1]), fail=D(count=t["fail"][0], ns=t["fail"][1]),
                queue=D(count=t["queue"][0], ns=t["queue"][1]),
                compute_infer=D(count=t["compute"][0], ns=t["compute"][1])))
            stats.batch_stats.extend(kpb.InferBatchStatistics(batch_size=n, compute_infer=D(count=c, ns=ns))
                                     for n, (c, ns) in t["batches"].items())
        return kpb.ModelStatisticsResponse(model_stats=[stats])

    async def RepositoryIndex(self, request, context):
        """The one model this server holds; READY unless draining."""
        entry = kpb.RepositoryIndexResponse.ModelIndex(name=self._loaded.name, version="1",
                                                       state="READY" if self._ready() else "UNAVAILABLE",
                                                       reason="" if self._ready() else "draining")
        return kpb.RepositoryIndexResponse(models=[] if request.ready and not self._ready() else [entry])

    async def _infer(self, request: kpb.ModelInferRequest):
        """(response, None), or (None, (code, message)) for a failed request; its access-log line and metrics
        either way. Cancellation propagates."""
        started, job, status = time.monotonic(), None, grpc.StatusCode.OK
        try:
            if not self._ready():
                raise Unavailable(SHUTTING_DOWN)
            if not self._serves(request.model_name):
                raise InvalidRequest("model_name", f"{request.model_name!r} is not served here; this server "
                                                   f"holds {self._loaded.name!r}")
            job, names = decode(request, self._loaded.kind)
            self._native.check_size(job)
            validate_job(job, self._loaded.limits)
            timeout = _param(request.parameters, "timeout_s")
            if timeout is not None and not timeout > 0:
                raise InvalidRequest("parameters[timeout_s]", f"{timeout} must be > 0")
            return await self._answer(request, job, names, timeout), None
        except asyncio.CancelledError:
            status = grpc.StatusCode.CANCELLED
            raise
        except Exception as e:      # noqa: BLE001 (every error becomes its status, in one place)
            failure = (grpc.StatusCode.DEADLINE_EXCEEDED, "timeout_s: the request did not finish in time") \
                if isinstance(e, TimeoutError) else to_status(e)
            status = failure[0]
            return None, failure
        finally:
            account(self._metrics, request.id or f"kserve-{next(self._ids)}", job, status, time.monotonic() - started)

    async def _answer(self, request: kpb.ModelInferRequest, job: Job, names: list[str],
                      timeout: Optional[float]) -> kpb.ModelInferResponse:
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
        resp, failure = await self._infer(request)
        if failure is not None:
            await context.abort(*failure)
        return resp

    async def ModelStreamInfer(self, request_iterator, context):
        async for request in request_iterator:
            resp, failure = await self._infer(request)
            yield kpb.ModelStreamInferResponse(infer_response=resp) if failure is None else \
                kpb.ModelStreamInferResponse(error_message=f"{failure[0].name}: {failure[1]}")
