"""Careless and hostile clients against the running CLI server (issue 14): every malformed KServe parameter or
tensor gets INVALID_ARGUMENT naming it (or the right answer for a lossless coercion) at TP 1 and TP 2 and the
server then answers exactly; request ids and undecodable messages; a second server on a served port."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import numpy as np
import pytest

from helpers import CliServer, Reference, build_model, kserve_request, kserve_tensor, ref_token_logprobs
from logitserve.kserve import grpc_predict_v2_pb2 as kpb
from logitserve.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

V = 1003
SEQS = [[1, 5, 9, 200, 31, 7], [3, 4]]
_PARAM_FIELD = {bool: "bool_param", int: "int64_param", float: "double_param", str: "string_param"}


def _with(req, **params):
    for k, v in params.items():
        setattr(req.parameters[k], _PARAM_FIELD[type(v)], v)
    return req


def _ids_input(req, name, datatype, shape, raw):
    req.inputs.add(name=name, datatype=datatype, shape=shape)
    req.raw_input_contents.append(raw)
    return req


def _overflowing_ids():
    req = kpb.ModelInferRequest(model_name="")
    return _ids_input(req, "input_ids", "INT32", [1 << 32, 1 << 32], b"")      # 2^64 elements: wraps to 0 in int64


def _wrapped_candidates():
    req = kserve_request(SEQS[:1], ["candidate_logprobs"])
    cand = np.full((1, len(SEQS[0]), 2), 3, np.int64)
    cand[0, 2, 1] = (1 << 32) + 5                                             # would wrap to token 5 as int32
    return _ids_input(req, "candidate_ids", "INT64", list(cand.shape), cand.tobytes())


# (name, request, the field its message must name); every one must be INVALID_ARGUMENT
REFUSED = [
    ("top_k half", lambda: _with(kserve_request(SEQS, ["token_logprobs"]), top_k=2.5), "parameters[top_k]"),
    ("top_k string", lambda: _with(kserve_request(SEQS, ["token_logprobs"]), top_k="3"), "parameters[top_k]"),
    ("top_p string", lambda: _with(kserve_request(SEQS, ["token_logprobs"]), top_p="0.9"), "parameters[top_p]"),
    ("top_p nan", lambda: _with(kserve_request(SEQS, ["token_logprobs"]), top_p=float("nan")), "parameters[top_p]"),
    ("k string", lambda: _with(kserve_request(SEQS, ["topk_values"]), k="5"), "parameters[k]"),
    ("k nan", lambda: _with(kserve_request(SEQS, ["topk_values"]), k=float("nan")), "parameters[k]"),
    ("k half", lambda: _with(kserve_request(SEQS, ["topk_values"]), k=2.5), "parameters[k]"),
    ("k over V", lambda: _with(kserve_request(SEQS, ["topk_values"]), k=V + 1), "topk.k"),
    ("seq_start float", lambda: _with(kserve_request(SEQS, ["full_logits"]), seq_start=1.5), "parameters[seq_start]"),
    ("seq_start string", lambda: _with(kserve_request(SEQS, ["full_logits"]), seq_start="1"), "parameters[seq_start]"),
    ("vocab_end float", lambda: _with(kserve_request(SEQS, ["full_logits"]), vocab_end=9.5), "parameters[vocab_end]"),
    ("vocab_end string", lambda: _with(kserve_request(SEQS, ["full_logits"]), vocab_end="10"), "parameters[vocab_end]"),
    ("temperature string", lambda: _with(kserve_request(SEQS, ["token_logprobs"]), temperature="1.0"),
     "parameters[temperature]"),
    ("temperature inf", lambda: _with(kserve_request(SEQS, ["token_logprobs"]), temperature=float("inf")),
     "parameters[temperature]"),
    ("timeout_s string", lambda: _with(kserve_request(SEQS, ["token_logprobs"]), timeout_s="5"), "parameters[timeout_s]"),
    ("topk_as_logprobs string", lambda: _with(kserve_request(SEQS, ["topk_values"]), k=3, topk_as_logprobs="false"),
     "parameters[topk_as_logprobs]"),
    ("topk_dtype int", lambda: _with(kserve_request(SEQS, ["topk_values"]), k=3, topk_dtype=16), "parameters[topk_dtype]"),
    ("unknown parameter", lambda: _with(kserve_request(SEQS, ["topk_values"]), k=3, topk=3), "parameters[topk]"),
    ("output k string", lambda: _output_k(kserve_request(SEQS, ["topk_values"]), "4"), "outputs[topk_values].parameters[k]"),
    ("wrapped candidate", _wrapped_candidates, "inputs[candidate_ids][0][2][1]"),
    ("overflowing input shape", _overflowing_ids, "inputs[input_ids].shape"),
    ("long id", lambda: kpb.ModelInferRequest(model_name="", id="x" * 5000), "id"),
]


@pytest.mark.live_server
def test_a_tensor_of_many_empty_rows_is_refused_before_any_row_is_built(llama_server):
    """[2^31, 0] input_ids hold no bytes but 2^31 rows (the 10,000-case fuzz found [2^32, 0]: a MemoryError, then
    INTERNAL), and dimensions numpy cannot hold together are refused too."""
    req = _ids_input(kpb.ModelInferRequest(model_name=""), "input_ids", "INT32", [1 << 31, 0], b"")
    with grpc.insecure_channel(llama_server.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            kpb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    assert "--max-sequences-per-request" in e.value.details()
    for name, shape in (("input_ids", [1 << 32, 1 << 32, 0]), ("candidate_ids", [1, 1 << 32, 1 << 32, 0])):
        req = kserve_request(SEQS[:1], ["candidate_logprobs"]) if name == "candidate_ids" else kpb.ModelInferRequest()
        req = _ids_input(req, name, "INT32", shape, b"")         # no bytes, but dims numpy cannot hold together
        with grpc.insecure_channel(llama_server.address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                kpb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"inputs[{name}].shape" in e.value.details()


def _output_k(req, value):
    setattr(req.outputs[0].parameters["k"], _PARAM_FIELD[type(value)], value)
    return req


@pytest.fixture(scope="module")
def v_ref(model_dirs):
    return Reference(model_dirs["llama"])


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def cli(request, model_dirs):
    server = CliServer("--model", str(model_dirs["llama"]), "--tp", str(request.param), "--logprob-chunk-size", "16")
    yield server
    assert server.stop() == 0, "".join(server.log[-20:])


def _check_next_is_exact(stub, ref):
    resp = stub.ModelInfer(_with(kserve_request(SEQS, ["token_logprobs"]), top_k=3))
    lp = kserve_tensor(resp, "token_logprobs")
    for b, s in enumerate(SEQS):
        want = ref_token_logprobs(ref.logits(s), s, top_k=3)
        np.testing.assert_allclose(lp[b, :len(s)], want, atol=1e-5)


@pytest.mark.multi_process
def test_every_malformed_kserve_parameter_is_refused_and_the_server_goes_on(cli, v_ref):
    with grpc.insecure_channel(cli.address) as ch:
        stub = kpb_grpc.GRPCInferenceServiceStub(ch)
        for name, make, field in REFUSED:
            with pytest.raises(grpc.RpcError) as e:
                stub.ModelInfer(make())
            code, details = e.value.code(), e.value.details()
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)
            assert field in details, (name, details)
            assert "Traceback" not in details and "Error:" not in details, (name, details)
            assert len(details) < 400, (name, len(details))
        _check_next_is_exact(stub, v_ref)
        # lossless coercions are answered, exactly: whole-number doubles for integers
        resp = stub.ModelInfer(_with(kserve_request(SEQS, ["token_logprobs", "topk_values", "topk_ids"]), top_k=3.0,
                                     k=4.0, temperature=2))
        lp, vals = kserve_tensor(resp, "token_logprobs"), kserve_tensor(resp, "topk_values")
        for b, s in enumerate(SEQS):
            z = v_ref.logits(s, temperature=2.0)
            np.testing.assert_allclose(lp[b, :len(s)], ref_token_logprobs(z, s, top_k=3), atol=1e-5)
            np.testing.assert_allclose(vals[b, :len(s)], np.sort(z.numpy(), axis=-1)[:, ::-1][:, :4], atol=1e-5)
    assert cli.proc.poll() is None


@pytest.mark.live_server
def test_native_overflowing_candidate_shape_is_refused(llama_server):
    seq = np.array(SEQS[0], np.int32)
    req = pb.ForwardRequest(request_id="c", sequences=[pb.Tensor(dtype=pb.INT32, shape=[len(seq)], data=seq.tobytes())])
    req.candidates.ids.add(dtype=pb.INT32, shape=[1 << 32, 1 << 32], data=b"")
    with grpc.insecure_channel(llama_server.address) as ch:
        out = list(pb_grpc.LogitServeStub(ch).Forward(iter([req])))
    assert out[0].WhichOneof("body") == "error"
    assert grpc.StatusCode.INVALID_ARGUMENT.value[0] == out[0].error.code
    assert "candidates.ids[0]" in out[0].error.message


def _good(rid: str) -> pb.ForwardRequest:
    seq = np.array(SEQS[0], np.int32)
    req = pb.ForwardRequest(request_id=rid, sequences=[pb.Tensor(dtype=pb.INT32, shape=[len(seq)],
                                                                  data=seq.tobytes())])
    req.logprobs.SetInParent()
    return req


@pytest.fixture(scope="module")
def json_server(model_dirs):
    server = CliServer("--model", str(model_dirs["llama"]), "--log-format", "json")
    yield server
    assert server.stop() == 0


@pytest.mark.live_server
def test_request_ids_are_bounded_and_never_forge_log_lines(json_server, demo_cli_server):
    huge = "y" * (30 << 20)
    forged = "a\n2026-01-01 00:00:00,000 logitserve.requests INFO request forged OK: 1 tokens in 0.001 s"
    for server in (json_server, demo_cli_server):
        before = len(server.log)
        with grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
            out = list(pb_grpc.LogitServeStub(ch).Forward(iter([_good("first"), _good(huge), _good(forged),
                                                                 _good("last")]), timeout=60))
        bodies = {(m.request_id[:10], m.WhichOneof("body")) for m in out}
        assert ("first", "done") in bodies and ("last", "done") in bodies and (forged[:10], "done") in bodies
        errors = [m for m in out if m.WhichOneof("body") == "error"]
        assert len(errors) == 1 and errors[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "request_id" in errors[0].error.message and len(errors[0].error.message) < 200
        assert len(errors[0].request_id) <= 256
        import time
        time.sleep(0.5)
        lines = server.log[before:]
        assert all(len(line) < 4096 for line in lines), max(len(x) for x in lines)
        assert not any(line.startswith("2026-01-01") for line in lines)       # no forged line
        if server is json_server:
            for line in lines:
                if line.startswith("{"):
                    json.loads(line)


@pytest.mark.live_server
def test_an_undecodable_message_ends_the_stream_with_invalid_argument(llama_server):
    with grpc.insecure_channel(llama_server.address) as ch:
        call = ch.stream_stream("/logitserve.v1.LogitServe/Forward", request_serializer=None,
                                response_deserializer=pb.ForwardResponse.FromString)
        it = call(iter([_good("a").SerializeToString(), b"\xff\xff\xff\xff"]), timeout=30)
        got = []
        with pytest.raises(grpc.RpcError) as e:
            for msg in it:
                got.append((msg.request_id, msg.WhichOneof("body")))
    assert ("a", "done") in got                    # the request in flight was answered first
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "could not be decoded" in e.value.details()


@pytest.mark.multi_process
def test_a_second_server_on_a_served_port_exits_naming_the_port(demo_cli_server):
    port = demo_cli_server.address.rsplit(":", 1)[1]
    for extra in ([], ["--tp", "2"]):
        r = subprocess.run([sys.executable, "-m", "logitserve.server.cli", "serve", "--host", "127.0.0.1", "--port",
                            port, "--device", "cpu", *extra], capture_output=True, text=True, timeout=120)
        assert r.returncode != 0
        assert f"127.0.0.1:{port}" in r.stderr and "in use" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr     # one line, no traceback
    from logitserve.client import TeacherClient
    with TeacherClient(demo_cli_server.address) as c:              # the first server still answers alone
        assert c.model_info().name == "logitserve-demo-causal"


@pytest.mark.live_server
def test_defaults_listen_on_loopback_and_warn_about_tokens_without_tls(tmp_path, model_dirs):
    from logitserve.server.cli import _serve_parser
    import argparse

    p = argparse.ArgumentParser()
    _serve_parser(p.add_subparsers(dest="c"), argparse.HelpFormatter)
    args = p.parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.metrics_host == "127.0.0.1"
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret\n")
    server = CliServer("--model", str(model_dirs["llama"]), "--auth-token-file", str(tokens))
    try:
        assert any("no TLS" in line for line in server.log), "".join(server.log)
    finally:
        assert server.stop() == 0


@pytest.mark.live_server
def test_reflection_answers_v1_and_v1alpha(llama_server):
    from grpc_reflection.v1alpha import reflection_pb2 as rpb

    with grpc.insecure_channel(llama_server.address) as ch:
        for version in ("v1", "v1alpha"):
            call = ch.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                    request_serializer=rpb.ServerReflectionRequest.SerializeToString,
                                    response_deserializer=rpb.ServerReflectionResponse.FromString)
            resp = next(iter(call(iter([rpb.ServerReflectionRequest(list_services="")]), timeout=10)))
            names = {s.name for s in resp.list_services_response.service}
            assert {"logitserve.v1.LogitServe", "inference.GRPCInferenceService"} <= names, (version, names)
            described = next(iter(call(iter([rpb.ServerReflectionRequest(
                file_containing_symbol="logitserve.v1.LogitServe")]), timeout=10)))
            assert described.file_descriptor_response.file_descriptor_proto, version
