"""The KServe v2 endpoint on the same port, called with the raw protocol (tritonclient itself is exercised in
test_coexistence, in an environment with protobuf < 7): outputs against float64 transformers, clear errors."""
from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from helpers import (VOCAB, Reference, assert_close, kserve_request, kserve_tensor, random_seqs,
                     ref_token_logprobs, separated)
from logitserve.kserve import grpc_predict_v2_pb2 as kpb
from logitserve.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc

pytestmark = pytest.mark.live_server


def test_model_infer_outputs_equal_float64_reference(llama_server, model_dirs):
    ref = Reference(model_dirs["llama"])
    seqs = random_seqs(np.random.default_rng(41), [3, 17, 40], vocab=VOCAB)
    with grpc.insecure_channel(llama_server.address) as ch:
        stub = kpb_grpc.GRPCInferenceServiceStub(ch)
        assert stub.ServerLive(kpb.ServerLiveRequest()).live and stub.ServerReady(kpb.ServerReadyRequest()).ready
        meta = stub.ModelMetadata(kpb.ModelMetadataRequest(name=""))
        assert {t.name for t in meta.outputs} >= {"token_logprobs", "topk_values", "topk_ids", "full_logits"}
        assert stub.ModelReady(kpb.ModelReadyRequest(name=meta.name)).ready
        resp = stub.ModelInfer(kserve_request(seqs, ["token_logprobs", "topk_values", "topk_ids", "topk_tail",
                                               "full_logits"], k=6, temperature=0.8, topk_dtype="BF16",
                                        vocab_start=100, vocab_end=140))
        bad = [(dict(), ["topk_ids"], "parameters[k]"), (dict(k=5), ["nope"], "outputs")]
        for params, outs, field in bad:
            with pytest.raises(grpc.RpcError) as e:
                stub.ModelInfer(kserve_request(seqs, outs, **params))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
        streamed = list(stub.ModelStreamInfer(iter([kserve_request(seqs, ["token_logprobs"]),
                                                    kserve_request(seqs, ["topk_ids"])])))
    assert resp.id == "q1" and resp.model_name == meta.name
    lp, vals, ids = kserve_tensor(resp, "token_logprobs"), kserve_tensor(resp, "topk_values"), kserve_tensor(resp, "topk_ids")
    tail, full = kserve_tensor(resp, "topk_tail"), kserve_tensor(resp, "full_logits")
    assert lp.shape == (3, 40) and vals.shape == ids.shape == (3, 40, 6) and full.shape == (3, 40, 40)
    for j, seq in enumerate(seqs):
        n = len(seq)
        z = ref.logits(seq, 0.8)                                                  # [L, V] float64
        assert_close(lp[j, :n], ref_token_logprobs(z, seq))
        sorted_v, sorted_i = torch.sort(z, -1, descending=True)
        want = sorted_v[:, :6].float().bfloat16().float().numpy()                # BF16 on the wire
        assert np.abs(vals[j, :n] - want).max() <= np.abs(want).max() * 2 ** -8
        sep = separated(sorted_v.numpy(), 6)
        assert np.array_equal(ids[j, :n][sep], sorted_i[:, :6].numpy()[sep])
        outside = torch.log_softmax(z, -1).scatter(-1, torch.from_numpy(ids[j, :n].astype(np.int64)), float("-inf"))
        assert_close(tail[j, :n], torch.logsumexp(outside, -1).numpy())
        assert_close(full[j, :n], z[:, 100:140].numpy())
        assert not lp[j, n:].any() and not full[j, n:].any()                     # padding rows are 0
    assert streamed[0].infer_response.outputs[0].name == "token_logprobs"
    assert "INVALID_ARGUMENT" in streamed[1].error_message and "parameters[k]" in streamed[1].error_message


def test_config_statistics_and_index_count_both_apis(model_dirs):
    """ModelConfig, ModelStatistics (native and KServe requests together, failures apart) and RepositoryIndex;
    the per-request limits and the Prometheus counters cover KServe requests too."""
    import time

    from helpers import serve_dir
    from logitserve.client import LogitServeError, TeacherClient
    from logitserve.server.config import StreamLimits

    server = serve_dir(model_dirs["llama"], limits=StreamLimits(max_sequences=3))
    seqs = random_seqs(np.random.default_rng(8), [5, 9], vocab=VOCAB)
    try:
        with grpc.insecure_channel(server.address) as ch, TeacherClient(server.address) as c:
            stub = kpb_grpc.GRPCInferenceServiceStub(ch)
            config = stub.ModelConfig(kpb.ModelConfigRequest(name="")).config
            assert config.max_batch_size == 0 and config.platform == "logitserve"
            assert [(i.name, i.data_type, list(i.dims), i.optional) for i in config.input] == [
                ("input_ids", kpb.TYPE_INT32, [-1, -1], False), ("sequence_lengths", kpb.TYPE_INT32, [-1], True),
                ("candidate_ids", kpb.TYPE_INT32, [-1, -1, -1], True), ("prompt_lengths", kpb.TYPE_INT32, [-1], True)]
            assert {o.name: o.data_type for o in config.output}["topk_ids"] == kpb.TYPE_INT32
            assert config.parameters["vocab_size"].string_value == str(VOCAB)
            assert "temperature:float" in config.parameters["request_parameters"].string_value.split(",")
            with pytest.raises(grpc.RpcError) as e:
                stub.ModelConfig(kpb.ModelConfigRequest(name="other"))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND

            c.logprobs(seqs + [seqs[0]])                                          # native: 3 sequences, OK
            stub.ModelInfer(kserve_request(seqs, ["token_logprobs"]))                    # KServe: 2 sequences, OK
            with pytest.raises(grpc.RpcError) as e:                               # KServe over the limit
                stub.ModelInfer(kserve_request(seqs * 2, ["token_logprobs"]))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-sequences-per-request 3" in e.value.details()
            with pytest.raises(LogitServeError):                                 # native, invalid
                c.topk(seqs, k=VOCAB + 1)

            stats = stub.ModelStatistics(kpb.ModelStatisticsRequest(name="")).model_stats
            assert len(stats) == 1
            s, i = stats[0], stats[0].inference_stats
            assert (i.success.count, i.fail.count, s.inference_count) == (2, 2, 5)
            assert i.queue.count == i.compute_infer.count == 2 and i.success.ns >= i.compute_infer.ns > 0
            assert s.execution_count == sum(b.compute_infer.count for b in s.batch_stats) >= 1
            assert abs(s.last_inference / 1e3 - time.time()) < 60
            index = stub.RepositoryIndex(kpb.RepositoryIndexRequest()).models
            assert [(m.name, m.state) for m in index] == [(s.name, "READY")]
            with pytest.raises(grpc.RpcError) as e:
                stub.ModelStatistics(kpb.ModelStatisticsRequest(name="other"))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'other'" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:                               # counted as a failure
                stub.ModelInfer(kserve_request(seqs, ["token_logprobs"], timeout_s=0.0))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "parameters[timeout_s]" in e.value.details() and "must be > 0" in e.value.details()
            server.running.pipeline.drain()                                       # shutting down
            with pytest.raises(grpc.RpcError) as e:
                stub.ModelInfer(kserve_request(seqs, ["token_logprobs"]))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.details()
            assert not stub.ServerReady(kpb.ServerReadyRequest()).ready
            assert [m.state for m in stub.RepositoryIndex(kpb.RepositoryIndexRequest()).models] == ["UNAVAILABLE"]
            assert stub.RepositoryIndex(kpb.RepositoryIndexRequest(ready=True)).models == []
        registry = server.running.metrics.registry
        sample = lambda status, output="logprobs": registry.get_sample_value(
            "logitserve_requests_total", {"output": output, "status": status})
        assert sample("OK") == 2 and sample("RESOURCE_EXHAUSTED") == 1 and sample("INVALID_ARGUMENT") == 1
        assert sample("INVALID_ARGUMENT", "topk") == 1
        assert sample("UNAVAILABLE", "none") == 1                                 # refused before decoding
    finally:
        server.stop()


def test_token_classifier_defaults_to_scores(tmp_path):
    """A token-classification (process) reward model: no outputs asked gives scores (its last token's row, as for
    sequence classifiers), not token outputs, and its metadata lists scores only."""
    from helpers import build_model, serve_dir

    directory = build_model(tmp_path / "prm", "llama", kind="token", num_labels=2, seed=7)
    seqs = random_seqs(np.random.default_rng(43), [5, 12], vocab=VOCAB)
    server = serve_dir(directory)
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = kpb_grpc.GRPCInferenceServiceStub(ch)
            meta = stub.ModelMetadata(kpb.ModelMetadataRequest(name=""))
            resp = stub.ModelInfer(kserve_request(seqs, []))
    finally:
        server.stop()
    assert [t.name for t in meta.outputs] == ["scores"] and [o.name for o in resp.outputs] == ["scores"]
    model = Reference(directory).model
    with torch.no_grad():
        want = [model(torch.as_tensor([s.tolist()])).logits[0, -1].numpy() for s in seqs]
    assert_close(kserve_tensor(resp, "scores"), np.stack(want))
