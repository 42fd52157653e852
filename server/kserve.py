"""KServe v2 / Open Inference Protocol on the same port: what tritonclient's InferenceServerClient calls.

Inputs: `input_ids` INT32/INT64 [B, L] (rows past `sequence_lengths` [B], when given, are padding),
optional `candidate_ids` INT32 [B, L, c], optional `prompt_lengths` [B] (token outputs then have
max(L - P) rows, row j predicting token P + j; candidates are then given for those rows). Request parameters pick the outputs' options:
`temperature`, `top_k` / `top_p` (filters of the token logprobs), `k` (top-k size, also accepted on
the requested `topk_values` output), `topk_as_logprobs`, `topk_dtype` ("BF16", "FP16", "FP32"),
`seq_start`/`seq_end`/`vocab_start`/`vocab_end` (the full-logits rectangle), `timeout_s`; each has one
type (REQUEST_PARAMETERS: a whole-number double is accepted for an integer, nothing else is coerced) and an
unknown parameter is refused. INT64 ids that do not fit int32 are refused, never wrapped.
Outputs, by name: `token_logprobs` FP32 [B, L], `topk_values` [B, L, k], `topk_ids` INT32 [B, L, k],
`topk_tail` FP32 [B, L], `candidate_logprobs` FP32 [B, L, c], `full_logits` FP32 [B, s1-s0, v1-v0],
`scores` FP32 [B, num_labels]; none asked: token_logprobs (causal LM) or scores (sequence or token classifier).
Rows past a sequence's length are 0. Tensors travel raw (BF16 as its 2-byte bits). No math here.
"""
from __future__ import annotations

import math
from typing import Optional

import grpc
import numpy as np
import torch

from logitserve.cost import WIRE_BYTES
from logitserve.errors import InvalidRequest, TooLarge
from logitserve.kserve import grpc_predict_v2_pb2 as kpb
from logitserve.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc
from logitserve.spec import Job, LogprobsOpts, ModelKind, OutputKind, SliceOpts, TopKOpts, WireDType

from . import codec
from .params import Param, ParamTable
from .dense import Dense
from .requests import Decoded, Failed, Pipeline

OUTPUTS = {"token_logprobs": OutputKind.TOKEN_LOGPROBS, "topk_values": OutputKind.TOPK_VALUES,
           "topk_ids": OutputKind.TOPK_IDS, "topk_tail": OutputKind.TOPK_TAIL,
           "candidate_logprobs": OutputKind.CANDIDATE_LOGPROBS, "full_logits": OutputKind.FULL_LOGITS,
           "scores": OutputKind.SCORES}
_WIRE = {"FP32": WireDType.FP32, "BF16": WireDType.BF16, "FP16": WireDType.FP16}
_KS_DTYPE = {torch.float32: "FP32", torch.bfloat16: "BF16", torch.float16: "FP16", torch.int32: "INT32"}
_NP_IN = {"INT32": "<i4", "INT64": "<i8"}
_CONFIG_TYPE = {"INT32": kpb.TYPE_INT32, "FP32": kpb.TYPE_FP32}
_INT32 = np.iinfo(np.int32)
# A tensor holds at most this many elements (2^31: int32 indexing everywhere downstream).
MAX_ELEMENTS = 1 << 31

REQUEST_PARAMETERS = ParamTable(
    Param("k", int, "top-k size (1 <= k <= V); also accepted on the requested topk_* outputs", lo=1),
    Param("temperature", float, "T in [1e-6, 1e6]: every output but scores uses z/T"),
    Param("top_k", int, "token_logprobs filter: keep the k largest logits", lo=1),
    Param("top_p", float, "token_logprobs filter: keep the top set reaching probability p, 0 < p <= 1"),
    Param("topk_as_logprobs", bool, "topk_values as full-vocab logprobs instead of z/T"),
    Param("topk_dtype", str, "topk_values on the wire", choices=("FP32", "BF16", "FP16")),
    Param("seq_start", int, "full_logits rows from here", lo=0),
    Param("seq_end", int, "full_logits rows up to here", lo=0),
    Param("vocab_start", int, "full_logits columns from here", lo=0),
    Param("vocab_end", int, "full_logits columns up to here", lo=0),
    Param("timeout_s", float, "server-side deadline in seconds (> 0)"),
    Param("timeout", int, "Triton's server-side deadline, in microseconds (> 0)", lo=1),
    Param("priority", int, "Triton's priority: accepted, no effect (one queue, first come first served)", lo=0),
)
OUTPUT_PARAMETERS = ParamTable(Param("k", int, "top-k size (1 <= k <= V)", lo=1))


def _values(params) -> dict:
    """InferParameter map -> {name: python value}; a parameter with no value set is refused."""
    out = {}
    for name, p in params.items():
        which = p.WhichOneof("parameter_choice")
        if which is None:
            raise InvalidRequest(f"parameters[{name[:64]}]", "no value set in the InferParameter")
        out[name] = getattr(p, which)
    return out


def read_parameters(req: kpb.ModelInferRequest) -> dict:
    """The request's parameters, typed (REQUEST_PARAMETERS), with `k` from a requested output when given there."""
    params = REQUEST_PARAMETERS.read(_values(req.parameters))
    for o in req.outputs:
        k = OUTPUT_PARAMETERS.read(_values(o.parameters), f"outputs[{o.name[:64]}].parameters").get("k")
        if k is not None:
            if params.get("k", k) != k:
                raise InvalidRequest(f"outputs[{o.name[:64]}].parameters[k]",
                                     f"{k} differs from the k ({params['k']}) given elsewhere in the request")
            params["k"] = k
    return params


def timeout_of(params: dict) -> Optional[float]:
    """The request's deadline in seconds (timeout_s, or Triton's timeout in µs), or None."""
    if "timeout_s" in params and "timeout" in params:
        raise InvalidRequest("parameters[timeout_s]", "set timeout_s or Triton's timeout (µs), not both")
    if "timeout" in params:
        return params["timeout"] / 1e6
    return params.get("timeout_s")     # > 0: checked by the pipeline


def _input(req: kpb.ModelInferRequest, name: str) -> Optional[np.ndarray]:
    """An INT32/INT64 input as an int32 array of its declared shape; every value must fit int32."""
    for i, t in enumerate(req.inputs):
        if t.name != name:
            continue
        field = f"inputs[{name}]"
        if t.datatype not in _NP_IN:
            raise InvalidRequest(f"{field}.datatype", f"{t.datatype[:32]!r}: send INT32 or INT64")
        shape = tuple(int(d) for d in t.shape)
        count = math.prod(shape)   # Python ints: no overflow
        if any(not 0 <= d <= MAX_ELEMENTS for d in shape) or count > MAX_ELEMENTS:   # each dim too: numpy
            raise InvalidRequest(f"{field}.shape", f"{list(shape)[:8]} must be dimensions in [0, 2^31] holding "
                                                   f"at most 2^31 elements")         # refuses [2^32, 2^32, 0]
        if i < len(req.raw_input_contents):
            raw = req.raw_input_contents[i]
            width = np.dtype(_NP_IN[t.datatype]).itemsize
            if len(raw) != width * count:
                raise InvalidRequest(field, f"{len(raw)} raw bytes do not hold {t.datatype} {list(shape)} "
                                            f"({width * count} bytes)")
            arr = np.frombuffer(raw, dtype=_NP_IN[t.datatype]).reshape(shape)
        else:
            values = t.contents.int_contents if t.datatype == "INT32" else t.contents.int64_contents
            if len(values) != count:
                raise InvalidRequest(field, f"{len(values)} values do not fill {list(shape)}")
            arr = np.asarray(values, dtype=_NP_IN[t.datatype]).reshape(shape)
        if arr.dtype != np.int32 and arr.size:
            bad = (arr < _INT32.min) | (arr > _INT32.max)
            if bad.any():    # a cast would wrap 2^32 + 5 to 5: refuse instead
                where = "".join(f"[{int(x)}]" for x in np.unravel_index(int(np.flatnonzero(bad)[0]), arr.shape))
                raise InvalidRequest(f"{field}{where}", f"{int(arr[bad][0])} does not fit int32 (token ids are < V)")
        return arr.astype(np.int32, copy=False)
    return None


def decode(req: kpb.ModelInferRequest, kind: ModelKind, max_sequences: int = 4096) -> tuple[Job, list[str], dict]:
    """The Job, the output names and the typed parameters of a ModelInferRequest (its deadline: timeout_of);
    malformed input raises InvalidRequest naming the input or parameter; more than `max_sequences` rows,
    TooLarge before anything per row is built (a [2^32, 0] tensor holds no bytes but 2^32 rows)."""
    names = [o.name for o in req.outputs] or (["token_logprobs"] if kind is ModelKind.CAUSAL_LM else ["scores"])
    unknown = sorted(set(names) - set(OUTPUTS))
    if unknown:
        raise InvalidRequest("outputs", f"{[n[:64] for n in unknown[:4]]} unknown; outputs are {sorted(OUTPUTS)}")
    p = read_parameters(req)
    ids = _input(req, "input_ids")
    if ids is None or ids.ndim != 2:
        raise InvalidRequest("inputs[input_ids]", "an INT32 or INT64 [B, L] tensor named input_ids is needed")
    if ids.shape[0] > max(max_sequences, 1 << 16):   # absurd row counts before any per-row list; the rest: check_size
        raise TooLarge(f"inputs[input_ids]: {ids.shape[0]} sequences in this request is over the server's "
                       f"--max-sequences-per-request {max_sequences}")
    lengths = _input(req, "sequence_lengths")
    lengths = [ids.shape[1]] * ids.shape[0] if lengths is None else [int(x) for x in lengths.reshape(-1)]
    if len(lengths) != ids.shape[0] or any(not 0 <= n <= ids.shape[1] for n in lengths):
        raise InvalidRequest("inputs[sequence_lengths]", f"{lengths[:8]}: one length in [0, {ids.shape[1]}] per row "
                                                         f"({ids.shape[0]} rows)")
    seqs = tuple(np.ascontiguousarray(ids[b, :n]) for b, n in enumerate(lengths))
    logprobs = topk = cands = sl = None
    if "token_logprobs" in names:
        logprobs = LogprobsOpts(top_k=p.get("top_k"), top_p=p.get("top_p"))
    if {"topk_values", "topk_ids", "topk_tail"} & set(names):
        if "k" not in p:
            raise InvalidRequest("parameters[k]", "top-k outputs need the integer parameter k (1 <= k <= V)")
        topk = TopKOpts(k=p["k"], as_logprobs=p.get("topk_as_logprobs", False),
                        dtype=_WIRE[p.get("topk_dtype", "FP32")], tail_mass="topk_tail" in names)
    if "candidate_logprobs" in names:
        c = _input(req, "candidate_ids")
        if c is None or c.ndim != 3 or c.shape[0] != ids.shape[0]:
            raise InvalidRequest("inputs[candidate_ids]", f"candidate_logprobs needs INT32 candidate_ids [B, L, c] "
                                                          f"(or [B, max(L - P), c] with prompt_lengths), B = "
                                                          f"{ids.shape[0]}")
        rows = lengths if _input(req, "prompt_lengths") is None else \
            [n - int(P) for n, P in zip(lengths, _input(req, "prompt_lengths").reshape(-1))]
        if any(not 0 <= r <= c.shape[1] for r in rows):
            raise InvalidRequest("inputs[candidate_ids]", f"shape {list(c.shape)} has fewer than the {max(rows)} "
                                                          f"rows a sequence needs")
        cands = tuple(np.ascontiguousarray(c[b, :r]) for b, r in enumerate(rows))
    if "full_logits" in names:
        sl = SliceOpts(*(p.get(n) for n in ("seq_start", "seq_end", "vocab_start", "vocab_end")))
    prompt = _input(req, "prompt_lengths")
    if prompt is not None and prompt.shape != (ids.shape[0],):
        raise InvalidRequest("inputs[prompt_lengths]", f"shape {list(prompt.shape)[:4]} must be [B={ids.shape[0]}]")
    job = Job(sequences=seqs, temperature=p.get("temperature", 1.0), logprobs=logprobs, topk=topk,
              candidates=cands, full_logits=sl, scores="scores" in names,
              prompt_lengths=None if prompt is None else tuple(int(x) for x in prompt))
    return job, names, p


def dense_bytes(job: Job, names: list[str], vocab: int, num_labels: int) -> int:
    """Bytes of the zero-padded [B, ...] answer: every output at its longest sequence's size."""
    B = len(job.sequences)
    rows = max((max(0, b - a) for a, b in (job.token_rows(i) for i in range(B))), default=0)
    per_row = {"token_logprobs": 4, "topk_tail": 4}
    if job.topk is not None:
        per_row["topk_values"] = job.topk.k * WIRE_BYTES[job.topk.dtype]
        per_row["topk_ids"] = job.topk.k * 4
    if job.candidates is not None:
        per_row["candidate_logprobs"] = max((c.shape[1] for c in job.candidates), default=0) * 4
    total = sum(B * rows * per_row.get(n, 0) for n in names)
    if job.full_logits is not None and "full_logits" in names:
        bounds = [job.full_logits.bounds(len(s), vocab) for s in job.sequences]
        total += B * max(max(0, s1 - s0) for s0, s1, _, _ in bounds) * max(max(0, v1 - v0) for _, _, v0, v1 in bounds) * 4
    if "scores" in names:
        total += B * max(num_labels, 1) * 4
    return total


class KServeServicer(kpb_grpc.GRPCInferenceServiceServicer):
    """The KServe face of the shared request pipeline: decode a ModelInferRequest, encode a dense answer."""

    def __init__(self, pipeline: Pipeline, loaded, version: str, max_message_bytes: int):
        self._pipeline, self._loaded, self._version = pipeline, loaded, version
        self._metrics = pipeline.metrics
        self._max_message_bytes = max_message_bytes
        self._ids = iter(range(1 << 62))

    def _ready(self) -> bool:
        return not self._pipeline.draining

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
            await context.abort(grpc.StatusCode.NOT_FOUND, f"name: model {name[:64]!r} is not served here; "
                                                           f"this server holds {self._loaded.name!r}")

    def _tensors(self) -> tuple[list, list]:
        """(inputs, outputs) as (name, datatype, shape, optional); -1: any size."""
        inputs = [("input_ids", "INT32", [-1, -1], False), ("sequence_lengths", "INT32", [-1], True),
                  ("candidate_ids", "INT32", [-1, -1, -1], True), ("prompt_lengths", "INT32", [-1], True)]
        if self._loaded.kind is not ModelKind.CAUSAL_LM:     # sequence and token classifiers: their scores
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
                  "content_hash": m.content_hash, "request_parameters": REQUEST_PARAMETERS.describe(),
                  "output_parameters": OUTPUT_PARAMETERS.describe()}
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

    def _decode(self, request: kpb.ModelInferRequest) -> tuple[Decoded, list[str]]:
        """The request as a Decoded, and its output names; the answer must fit one message."""
        codec.check_name(request.id, "id")
        codec.check_name(request.model_name, "model_name")
        if not self._serves(request.model_name):
            raise InvalidRequest("model_name", f"{request.model_name[:64]!r} is not served here; this "
                                               f"server holds {self._loaded.name!r}")
        job, wanted, params = decode(request, self._loaded.kind, self._pipeline.stream_limits.max_sequences)
        size = dense_bytes(job, wanted, self._loaded.vocab_size, self._loaded.num_labels)
        limit = self._max_message_bytes - (64 << 10)     # headroom for names, shapes, framing
        if size > limit:
            raise TooLarge(f"outputs: the answer would be {size / 2**20:.1f} MiB, over the largest message "
                           f"this server sends (--max-message-bytes {self._max_message_bytes}, "
                           f"less 64 KiB for framing); ask for fewer sequences or a smaller slice per "
                           f"request, or use the streaming API (logitserve.v1.LogitServe/Forward), "
                           f"which chunks any answer")
        # the dense arrays and their serialized copy are held with the job
        return Decoded(job, timeout_of(params), "parameters[timeout_s]", hold=2 * size,
                       temperature_field="parameters[temperature]"), wanted

    async def _infer(self, request: kpb.ModelInferRequest, client: str):
        """(response, None), or (None, (code, message)) for a failed request, through the shared pipeline."""
        rid = codec.shown_id(request.id) or f"kserve-{next(self._ids)}"
        try:
            async with self._pipeline.request(rid, client) as r:
                decoded, names = self._decode(request)
                dense = await Dense.collect(r.run(decoded), len(decoded.job.sequences))
        except Failed as f:
            return None, (f.outcome.status, f.outcome.message)
        return self._encode(request, r.outcome.job, names, dense), None

    def _encode(self, request: kpb.ModelInferRequest, job: Job, names: list[str], dense: Dense):
        resp = kpb.ModelInferResponse(model_name=self._loaded.name, model_version="1", id=request.id)
        for name in names:
            arr = dense.padded(OUTPUTS[name])
            if arr is None:
                arr = torch.zeros((len(job.sequences), 0), dtype=torch.float32)
            resp.outputs.add(name=name, datatype=_KS_DTYPE[arr.dtype], shape=list(arr.shape))
            view = arr.view(torch.int16) if arr.dtype == torch.bfloat16 else arr
            resp.raw_output_contents.append(view.contiguous().numpy().tobytes())
        return resp

    async def ModelInfer(self, request, context):
        resp, failure = await self._infer(request, self._pipeline.clients.of_grpc(context))
        if failure is not None:
            await context.abort(*failure)
        return resp

    async def ModelStreamInfer(self, request_iterator, context):
        client = self._pipeline.clients.of_grpc(context)
        async for request in request_iterator:
            resp, failure = await self._infer(request, client)
            yield kpb.ModelStreamInferResponse(infer_response=resp) if failure is None else \
                kpb.ModelStreamInferResponse(error_message=f"{failure[0].name}: {failure[1]}")
