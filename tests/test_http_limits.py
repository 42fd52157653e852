"""HTTP front-end hardening: sizes checked before anything is expanded, bounded ids, 413 for permanent refusals.

Each declared array (prompt ids, SGLang candidates, ids to detokenize) is refused on its declared size
before it is converted or expanded: the refusal costs the server no more time or memory than parsing the
same body does (the baseline: the same body refused for a reason found right after parsing), and gRPC
still answers right after. A server in its own process, so that its memory is its own.
"""
from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest

from helpers import VOCAB, CliServer, build_model

pytestmark = pytest.mark.live_server

MiB = 1 << 20


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(HTTP base URL, CliServer, model dir): a llama with the demo tokenizer, default limits, glibc's default
    malloc (so freed memory leaves the process and its peak measures each request's own allocations)."""
    from logitserve.demo import demo_tokenizer

    directory = build_model(tmp_path_factory.mktemp("limits") / "llama", "llama")
    demo_tokenizer(VOCAB).save_pretrained(directory)
    server = CliServer("--model", str(directory), "--http-port", "0", "--no-malloc-tuning",
                       "--served-model-name", "teacher")
    yield server.http, server, directory
    server.stop()


def post(base: str, path: str, body, headers=None) -> tuple[int, dict, float]:
    """(status, JSON answer, seconds from sending to the answer)."""
    data = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else None, time.perf_counter() - t0
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, json.loads(raw), time.perf_counter() - t0


def _status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def peak_growth(pid: int, send) -> tuple[float, object]:
    """(MiB the process's resident set peaked above where it stood before `send()`, send's result); the peak is
    the kernel's high-water mark, reset first (clear_refs 5)."""
    import psutil

    before = psutil.Process(pid).memory_info().rss
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    out = send()
    return (_status_kib(pid, "VmHWM") * 1024 - before) / MiB, out


def grpc_serving(address: str) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    return status == health_pb2.HealthCheckResponse.SERVING


def refused_like_parsing(server, path: str, body: dict, baseline: dict, status: int) -> dict:
    """Send `body` (refused with `status`) and `baseline` (the same bytes, refused right after parsing) three times
    each; the refusal may take at most 3x the baseline's time and peak at most 24 MiB above the baseline's peak
    and 100 MiB above where the server stood. Its error, and gRPC still serving after."""
    base, pid = server.http, server.proc.pid
    times, peaks, err = {"body": [], "baseline": []}, {"body": [], "baseline": []}, None
    for _ in range(3):
        for name, b in (("baseline", baseline), ("body", body)):
            grow, (got, out, seconds) = peak_growth(pid, lambda b=b: post(base, path, b))
            assert got == (status if name == "body" else out["error"]["code"]), (name, out)
            times[name].append(seconds)
            peaks[name].append(grow)
            if name == "body":
                err = out["error"]
    t, t0 = min(times["body"]), min(times["baseline"])
    p, p0 = min(peaks["body"]), min(peaks["baseline"])
    assert t <= 3 * t0, f"refused in {t:.3f} s, the same bytes parsed and refused in {t0:.3f} s"
    assert p <= p0 + 24 and p <= 100, f"peak +{p:.0f} MiB refusing, +{p0:.0f} MiB parsing the same bytes"
    assert grpc_serving(server.address)
    return err


def test_sglang_candidates_are_counted_before_they_are_expanded(served):
    """slime's call with token_ids_logprob: inputs x positions x candidates over the JSON answer limit is 413
    before np.tile builds [positions, candidates] per input (here 8 x 8000 x 1000 int32 would be 256 MiB)."""
    base, server, _ = served
    inputs = [[7] * 8000 for _ in range(8)]
    body = {"input_ids": inputs, "return_logprob": True, "logprob_start_len": 0,
            "token_ids_logprob": list(range(1000)), "sampling_params": {"max_new_tokens": 0}}
    baseline = {**body, "sampling_params": {"max_new_tokens": 5}}   # refused after input_ids are converted
    err = refused_like_parsing(server, "/generate", body, baseline, 413)
    assert "input_token_logprobs" in err["message"] and "--max-response-bytes" in err["message"], err
    assert err["type"] == "RequestTooLargeError" and err["code"] == 413
    # more candidates per position than the vocabulary: the shared bound (gRPC's too), before any conversion
    got, out, _ = post(base, "/generate", {**body, "input_ids": [1, 2, 3], "token_ids_logprob": [5] * (VOCAB + 1)})
    assert got == 400 and out["error"]["param"] == "token_ids_logprob" and str(VOCAB) in out["error"]["message"]
    got, out, _ = post(base, "/generate", {**body, "input_ids": [1, 2, 3], "token_ids_logprob": {"a": 1}})
    assert got == 400 and out["error"]["param"] == "token_ids_logprob", out
    got, out, _ = post(base, "/generate", {**body, "input_ids": [1, 2, 3], "token_ids_logprob": [5, 9]})
    assert got == 200 and len(out["meta_info"]["input_token_ids_logprobs"]) == 3, out


def test_detokenize_has_grpcs_cap_checked_before_conversion(served):
    """/detokenize takes at most 65,536 ids, as gRPC Detokenize; 1.5 million are refused 413 at parsing's cost."""
    from logitserve.tokenizing import MAX_DETOKENIZE

    base, server, _ = served
    body = {"tokens": [7] * 1_500_000}
    err = refused_like_parsing(server, "/detokenize", body, {**body, "model": "other"}, 413)
    assert err["param"] is None and "tokens" in err["message"] and str(MAX_DETOKENIZE) in err["message"], err
    got, out, _ = post(base, "/detokenize", {"tokens": [7] * MAX_DETOKENIZE})
    assert got == 200 and out["prompt"].split() == ["t7"] * MAX_DETOKENIZE
    assert post(base, "/detokenize", {"tokens": [7] * (MAX_DETOKENIZE + 1)})[0] == 413


def test_grpc_detokenize_shares_the_cap_and_says_it_is_permanent(served):
    from logitserve.tokenizing import MAX_DETOKENIZE
    from logitserve.v1 import logitserve_pb2 as pb
    from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

    _, server, _ = served
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.LogitServeStub(ch)
        assert len(stub.Detokenize(pb.DetokenizeRequest(ids=[7] * MAX_DETOKENIZE), timeout=60).texts) == MAX_DETOKENIZE
        with pytest.raises(grpc.RpcError) as e:
            stub.Detokenize(pb.DetokenizeRequest(ids=[7] * (MAX_DETOKENIZE + 1)), timeout=60)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(MAX_DETOKENIZE) in e.value.details() and "permanent" in e.value.details()


@pytest.mark.parametrize("shape", ["one list", "lists"])
def test_prompt_ids_are_counted_before_numpy(served, shape):
    """2 million ids as a /v1/completions prompt (one list, or two of a million) are over --max-request-tokens
    (2^20): 413 naming the flag, at the cost of parsing them."""
    _, server, _ = served
    prompt = [7] * 2_000_000 if shape == "one list" else [[7] * 1_000_000 for _ in range(2)]
    body = {"prompt": prompt, "prompt_logprobs": 1, "max_tokens": 0}
    err = refused_like_parsing(server, "/v1/completions", body, {**body, "model": "other"}, 413)
    assert "prompt" in err["message"] and "--max-request-tokens" in err["message"] and "2000000" in err["message"]


def test_request_ids_and_model_names_are_bounded_and_never_logged_whole(served):
    """A 16 MiB request_id or model name is refused 400 naming the field and gRPC's 256-byte bound; the log
    holds at most a bounded prefix of it."""
    base, server, _ = served
    huge = "r" * (16 * MiB)
    logged = len("".join(server.log))
    cases = [("/inference/v1/generate", {"token_ids": [1, 5, 9], "request_id": huge,
                                          "sampling_params": {"prompt_logprobs": 1, "max_tokens": 0}}, "request_id"),
             ("/inference/v1/generate", {"token_ids": [1, 5, 9], "model": huge,
                                          "sampling_params": {"prompt_logprobs": 1, "max_tokens": 0}}, "model"),
             ("/v1/completions", {"prompt": [1, 5, 9], "model": huge, "prompt_logprobs": 1}, "model"),
             ("/generate", {"input_ids": [1, 5, 9], "rid": huge, "return_logprob": True}, "rid"),
             ("/tokenize", {"prompt": "t5 t9", "model": huge}, "model")]
    for path, body, field in cases:
        got, out, _ = post(base, path, body)
        err = out["error"]
        assert got == 400 and err["param"] == field and "256 bytes" in err["message"], (path, field, err)
        assert str(16 * MiB) in err["message"] and huge[:300] not in err["message"]
    time.sleep(0.2)
    assert len("".join(server.log)) - logged < 64 << 10          # the access lines, not the ids
    got, out, _ = post(base, "/inference/v1/generate", {"token_ids": [1, 5, 9], "request_id": "r" * 256,
                                                        "sampling_params": {"prompt_logprobs": 1, "max_tokens": 0}})
    assert got == 200 and out["request_id"] == "r" * 256                     # at the bound: served, echoed


SEPARATORS = "\u2028\u2029\u0085\u009b\r\n\x0b\x0c\x1b\x00\u202e"


def test_line_and_control_separators_are_escaped_in_text_logs(served):
    """A request id carrying every kind of line break and control character is one access-log line, escaped."""
    base, server, _ = served
    rid = "sep" + SEPARATORS + "end"
    got, out, _ = post(base, "/inference/v1/generate", {"token_ids": [1, 5, 9], "request_id": rid,
                                                        "sampling_params": {"prompt_logprobs": 1, "max_tokens": 0}})
    assert got == 200 and out["request_id"] == rid
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any("request sep" in line for line in server.log):
        time.sleep(0.05)
    (line,) = [line for line in server.log if "request sep" in line]
    assert line.endswith("\n") and line.count("\n") == 1 and "end OK" in line, repr(line)
    assert not any(c in line[:-1] for c in SEPARATORS), repr(line)
    assert r"sep\u2028\u2029\x85\x9b\r\n\x0b\x0c\x1b\x00\u202eend" in line, repr(line)


def test_json_logs_stay_one_valid_line():
    from logitserve.server.logs import JsonFormatter, TextFormatter

    rid = "sep" + SEPARATORS + "end"
    record = logging.LogRecord("logitserve.access", logging.INFO, __file__, 1, "request %s OK", (rid,), None)
    record.request_id = rid
    out = JsonFormatter().format(record)
    assert len(out.splitlines()) == 1 and not any(c in out for c in SEPARATORS)
    parsed = json.loads(out)
    assert parsed["request_id"] == rid and parsed["msg"] == f"request {rid} OK"
    text = TextFormatter("%(message)s").format(record)
    assert len(text.splitlines()) == 1 and text == r"request sep\u2028\u2029\x85\x9b\r\n\x0b\x0c\x1b\x00\u202eend OK"


def _access_lines(server, status: str) -> int:
    return sum(1 for line in server.log if " request cmpl-" in line and f" {status}:" in line)


def test_permanent_refusals_are_413_and_the_openai_sdk_does_not_retry_them(served):
    """An answer over --max-response-bytes is 413: the openai package raises at once; before, its 429 was sent 3
    times. (24 prompts of 500 tokens, every position's whole vocabulary: ~1.1 GiB of JSON over the 1 GiB default.)"""
    import openai

    base, server, _ = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=2)
    before = _access_lines(server, "RESOURCE_EXHAUSTED")
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="teacher", prompt=[[7] * 500] * 24, max_tokens=0,
                                  extra_body={"prompt_logprobs": -1})
    assert e.value.status_code == 413 and not isinstance(e.value, openai.RateLimitError)
    assert "--max-response-bytes" in e.value.message and "permanent" in e.value.message
    time.sleep(0.3)
    assert _access_lines(server, "RESOURCE_EXHAUSTED") - before == 1      # one request reached the server
    # a body over --max-request-bytes: 413 from its Content-Length, the body never sent
    import http.client

    conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(65 * MiB))
    conn.endheaders()
    resp = conn.getresponse()
    err = json.loads(resp.read())["error"]
    conn.close()
    assert resp.status == 413 and err["code"] == 413 and "--max-request-bytes" in err["message"], err


def test_429_stays_for_retry_later_and_413_is_only_for_too_large():
    from logitserve.errors import OverLimit, TooLarge
    from logitserve.server.status import to_http, to_status

    code, message = to_status(OverLimit("queue full; retry later"))
    assert to_http(code) == (429, "RateLimitError") and "permanent" not in message
    code, message = to_status(TooLarge("body: over --max-request-bytes"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "permanent" in message
    assert to_http(code, too_large=True) == (413, "RequestTooLargeError")
    assert to_http(grpc.StatusCode.INVALID_ARGUMENT, too_large=True)[0] == 400


def test_unknown_routes_and_wrong_methods_get_openai_errors(served):
    import openai

    base, _, _ = served
    got, out, _ = post(base, "/v1/chat/completions", {"model": "teacher", "messages": []})
    assert got == 404 and out == {"error": {"message": out["error"]["message"], "type": "NotFoundError",
                                            "param": None, "code": 404}}
    assert "/v1/chat/completions" in out["error"]["message"]
    req = urllib.request.Request(base + "/v1/completions", method="GET")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    err = json.loads(e.value.read())["error"]
    assert e.value.code == 405 and err["type"] == "MethodNotAllowedError" and err["code"] == 405
    assert e.value.headers["Allow"] == "POST" and "GET" in err["message"]
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="teacher", messages=[{"role": "user", "content": "hi"}])
    assert "no such route" in e.value.message


def _busy_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


def test_a_busy_http_port_is_refused_before_the_model_loads(model_dirs):
    """`logitserve serve --http-port <busy>` exits 1 naming --http-port and the port, before any loading line."""
    with _busy_port() as busy:
        port = busy.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "logitserve.server.cli", "serve", "--host", "127.0.0.1",
                              "--port", "0", "--http-port", str(port), "--model", str(model_dirs["llama"]),
                              "--device", "cpu"], capture_output=True, text=True, timeout=180)
    out = run.stdout + run.stderr
    assert run.returncode == 1 and "Traceback" not in out, out
    assert f"--http-port {port}" in run.stderr and "in use" in run.stderr, out
    assert "loading" not in out and "serving" not in out, out


def test_open_port_binds_the_http_port_before_loading():
    """Under torchrun rank 0 opens its ports itself, before loading: open_port refuses a busy --http-port, naming
    it; a free one is bound and held until the model is served."""
    import asyncio

    from logitserve.server.config import ServerConfig
    from logitserve.server.gate import PortInUse, open_port

    async def check() -> None:
        with _busy_port() as busy:
            port = busy.getsockname()[1]
            with pytest.raises(PortInUse, match=f"--http-port {port}"):
                await open_port(ServerConfig(port=0, http_port=port))
        listening = await open_port(ServerConfig(port=0, http_port=0))
        try:
            held = listening.http_socket.getsockname()[1]
            with socket.socket() as other, pytest.raises(OSError):
                other.bind(("127.0.0.1", held))
        finally:
            await listening.close()

    asyncio.run(check())


def test_a_request_over_its_clients_queue_share_is_413_on_an_idle_server(served):
    """Issue 43: 1025 x 512 ids are under --max-request-tokens (2^20) but over one client's share of the queue (half
    of --max-queued-tokens: 2^19) even when nothing is queued: 429 "retry later" every time, before. Permanent: 413
    naming the bound."""
    base, _, _ = served
    body = {"prompt": [[7] * 512] * 1025, "prompt_logprobs": 0, "max_tokens": 0}
    for _ in range(2):                          # the same answer every time: nothing is queued
        status, answer, _ = post(base, "/v1/completions", body)
        assert status == 413, answer
        message = answer["error"]["message"]
        assert "--max-queued-tokens-per-client 524288" in message and "524800" in message, message
        assert "permanent" in message


@pytest.fixture(scope="module")
def served_rm(tmp_path_factory):
    """A CliServer on a scalar llama reward model with the demo tokenizer and a chat template."""
    from logitserve.demo import demo_tokenizer

    directory = build_model(tmp_path_factory.mktemp("limits_rm") / "rm", "llama", kind="reward", num_labels=1)
    tok = demo_tokenizer(VOCAB)
    tok.chat_template = "{% for m in messages %}t11 {{ m['role'] }} {{ m['content'] }} {{ eos_token }} {% endfor %}"
    tok.save_pretrained(directory)
    server = CliServer("--model", str(directory), "--http-port", "0", "--no-malloc-tuning")
    yield server
    server.stop()


def test_chat_messages_are_counted_before_they_are_rendered(served_rm):
    """Issue 43: 1.9 million empty messages were rendered by the chat template (11 s quiet, the tokenizing pool
    full) before any size was checked. 100,000 are refused on their count, at the cost of parsing them: 413 naming
    the field and --max-text-bytes."""
    body = {"messages": [[{"role": "user", "content": ""}] * 100_000]}
    err = refused_like_parsing(served_rm, "/get_reward", body, {**body, "add_special_tokens": "no"}, 413)
    assert err["param"] is None and "messages" in err["message"] and "--max-text-bytes" in err["message"], err
    assert "100000 messages" in err["message"], err
    status, out, _ = post(served_rm.http, "/get_reward", {"messages": [[{"role": "user", "content": "t5"}]] * 5000})
    assert status == 413 and "--max-sequences-per-request" in out["error"]["message"], out   # over 4096 conversations


def test_bodies_of_millions_of_values_are_refused_before_parsing_and_grpc_keeps_its_latency(served):
    """Issue 43: six concurrent 63 MB bodies, each refused 413 after orjson parsed (and freed) it on the event loop
    gRPC shares, pushed a polite gRPC client's max latency to 2.8-4.3 s. A body holding more values than any request
    within the limits can is refused on its commas before parsing: each 413 naming the bound, gRPC under 1 s."""
    import concurrent.futures
    import http.client

    from logitserve.client import TeacherClient

    base, server, _ = served
    raw = b'{"prompt": [' + b"7," * 31_000_000 + b'7], "max_tokens": 0, "prompt_logprobs": 0}'     # 62 MB

    def send() -> tuple[int, dict]:
        conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=120)
        conn.request("POST", "/v1/completions", raw, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        out = json.loads(resp.read())
        conn.close()
        return resp.status, out

    with TeacherClient(server.address) as c, concurrent.futures.ThreadPoolExecutor(6) as pool:
        c.logprobs([[1, 2, 3]])
        futures = [pool.submit(send) for _ in range(6)]
        latencies = []
        while not all(f.done() for f in futures):
            t0 = time.perf_counter()
            c.logprobs([[1, 2, 3, 4]])
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.02)
        answers = [f.result() for f in futures]
    assert latencies and max(latencies) < 1.0, sorted(latencies)[-5:]
    for status, out in answers:
        assert status == 413 and "JSON values" in out["error"]["message"], out
