"""Requests on the wire without the project's client: KServe v2 messages and HTTP JSON posts."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np


def kserve_request(seqs, outputs, **params):
    """A KServe v2 ModelInferRequest: padded input_ids [B, L] and sequence_lengths, these outputs, typed parameters."""
    from logitserve.kserve import grpc_predict_v2_pb2 as kpb

    L = max(len(s) for s in seqs)
    ids = np.zeros((len(seqs), L), np.int32)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = s
    req = kpb.ModelInferRequest(model_name="", id="q1")
    req.inputs.add(name="input_ids", datatype="INT32", shape=list(ids.shape))
    req.raw_input_contents.append(ids.tobytes())
    req.inputs.add(name="sequence_lengths", datatype="INT32", shape=[len(seqs)])
    req.raw_input_contents.append(np.asarray([len(s) for s in seqs], np.int32).tobytes())
    for name in outputs:
        req.outputs.add(name=name)
    for k, v in params.items():
        field = {bool: "bool_param", int: "int64_param", float: "double_param", str: "string_param"}[type(v)]
        setattr(req.parameters[k], field, v)
    return req


def kserve_tensor(resp, name):
    """The output `name` of a ModelInferResponse as a numpy array (BF16 read through torch)."""
    import torch

    i = next(i for i, o in enumerate(resp.outputs) if o.name == name)
    o = resp.outputs[i]
    raw = resp.raw_output_contents[i]
    if o.datatype == "BF16":
        return torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).float().numpy().reshape(tuple(o.shape))
    return np.frombuffer(raw, dtype={"FP32": np.float32, "INT32": np.int32}[o.datatype]).reshape(tuple(o.shape))


def post(base: str, path: str, body, headers=None) -> tuple[int, object]:
    """POST `body` (JSON, or raw bytes) to base + path: (HTTP status, the decoded JSON answer)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json",
                                                                 **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
