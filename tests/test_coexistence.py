"""logitserve beside a student's ecosystem: with tritonclient[grpc] 2.73 (protobuf < 7) in one fresh environment,
client and server import, serve and answer, and docs/clients.md's tritonclient block runs as written (about a
minute: a copy of the session's torch venv, tests/helpers/venvs.py);
beside vLLM 0.33, ray 2.60 and tritonclient, pip resolves logitserve[server] without moving their versions."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import CliServer, copy_venv, pip_install, python_of
from helpers.docs import STARTS, Servers, blocks, run_page

pytestmark = pytest.mark.fresh_venv

ROOT = Path(__file__).parent.parent

# tritonclient's own InferenceServerClient against the KServe v2 endpoint, checked against the native API
# (itself checked against float64 transformers elsewhere), in the environment that holds both.
TRITON = """
import numpy as np, tritonclient.grpc as tg
from logitserve.client import TeacherClient
c = tg.InferenceServerClient("ADDR")
assert c.is_server_live() and c.is_server_ready()
name = c.get_model_metadata("").name
assert c.is_model_ready(name) and c.get_server_metadata().name == "logitserve"
ids = np.array([[1, 5, 9, 200, 7, 7], [1, 3, 4, 5, 0, 0]], np.int32)
lens = np.array([6, 4], np.int32)
inputs = [tg.InferInput("input_ids", list(ids.shape), "INT32"), tg.InferInput("sequence_lengths", [2], "INT32")]
inputs[0].set_data_from_numpy(ids)
inputs[1].set_data_from_numpy(lens)
outs = [tg.InferRequestedOutput(n) for n in ("token_logprobs", "topk_values", "topk_ids", "topk_tail")]
r = c.infer(name, inputs, outputs=outs, parameters={"k": 5, "topk_as_logprobs": True, "temperature": 0.7})
half = c.infer(name, inputs, outputs=[tg.InferRequestedOutput("topk_values")],
               parameters={"k": 5, "topk_as_logprobs": True, "temperature": 0.7, "topk_dtype": "BF16"})
with TeacherClient("ADDR") as t:
    n = t.forward([ids[0, :6], ids[1, :4]], logprobs=True, topk=5, topk_as_logprobs=True, topk_tail=True,
                  temperature=0.7)
for b, L in enumerate(lens):
    assert np.abs(r.as_numpy("token_logprobs")[b, :L] - n.logprobs[b]).max() <= 1e-5
    assert np.abs(r.as_numpy("topk_values")[b, :L] - n.topk_values[b]).max() <= 1e-5
    assert np.abs(r.as_numpy("topk_tail")[b, :L] - n.topk_tail[b]).max() <= 1e-5
    assert (r.as_numpy("topk_ids")[b, :L] == n.topk_ids[b]).mean() > 0.95
    bf = half.as_numpy("topk_values")[b, :L].astype(np.float32)
    assert np.abs(bf - n.topk_values[b]).max() <= np.abs(n.topk_values[b]).max() * 2 ** -8 + 1e-5
try:
    c.infer(name, inputs, outputs=[tg.InferRequestedOutput("topk_ids")])
    raise SystemExit("no error for a top-k without k")
except tg.InferenceServerException as e:
    assert "parameters[k]" in e.message(), e.message()
cfg = c.get_model_config(name).config                                 # Triton's own ModelConfig parses it
assert cfg.name == name and cfg.max_batch_size == 0 and [i.name for i in cfg.input][0] == "input_ids"
assert cfg.input[0].data_type == 8 and cfg.parameters["vocab_size"].string_value.isdigit()    # TYPE_INT32
st = c.get_inference_statistics(name).model_stats[0]
assert st.inference_stats.success.count >= 3 and st.inference_stats.fail.count >= 1 and st.execution_count >= 1
assert [(m.name, m.state) for m in c.get_model_repository_index().models] == [(name, "READY")]
print("tritonclient ok")
"""


def test_client_and_server_work_beside_tritonclient(torch_venv, tmp_path):
    env = copy_venv(torch_venv, tmp_path / "venv")
    # one resolve, as a user adds logitserve to an environment that pins tritonclient
    pip_install(env, "tritonclient[grpc]==2.73.0", f"{ROOT}[server]")
    python = python_of(env)
    server = CliServer("--logprob-chunk-size", "64", python=python)
    try:
        code = ("import google.protobuf as g, tritonclient.grpc, numpy as np\n"
                "from logitserve.client import TeacherClient\n"
                f"c = TeacherClient('{server.address}')\n"
                "lp = c.logprobs([[1, 5, 9, 200]])[0]\n"
                "assert lp.shape == (4,) and lp[0] == 0 and (lp[1:] < 0).all()\n"
                "print(g.__version__)\n")
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().startswith("6."), out.stdout          # tritonclient kept its protobuf
        triton = subprocess.run([python, "-c", TRITON.replace("ADDR", server.address)], capture_output=True,
                                text=True, timeout=120)
        assert triton.returncode == 0, triton.stdout[-2000:] + triton.stderr[-2000:]
        assert "tritonclient ok" in triton.stdout
    finally:
        assert server.stop() == 0
    # docs/clients.md's tritonclient block as written, against the page's own server command, in this environment
    page = ROOT / "docs" / "clients.md"
    first = next(b for b in blocks(page) if b.note.startswith(STARTS))
    servers = Servers()
    try:
        done = run_page(page, servers, tmp_path / "page", python=python,
                        select=lambda b: b == first or "tritonclient" in b.note)
    finally:
        servers.stop()
    assert done.ran == 1 and done.started == 1


# A student's environment: vLLM (which pins torch exactly), ray and tritonclient, at the versions a trainer
# pins. Installing them for real is gigabytes of CUDA wheels, so this is pip's own resolver on their metadata.
ECOSYSTEM = ("vllm==0.33.0", "ray[default]==2.60.0", "tritonclient[grpc]==2.73.0")
SHARED = ("torch", "protobuf", "grpcio", "transformers", "numpy")


def _resolve(tmp_path, **sets: tuple[str, ...]) -> dict[str, dict]:
    """pip's resolution of each named set of requirements (the sets resolved at once, each its own process):
    name -> {package: version}."""
    runs = {name: subprocess.Popen([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
                                    "--report", str(tmp_path / f"{name}.json"), *reqs], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True) for name, reqs in sets.items()}
    out = {}
    for name, run in runs.items():
        _, err = run.communicate(timeout=900)
        assert run.returncode == 0, err[-3000:]
        out[name] = {i["metadata"]["name"].lower(): i["metadata"]["version"]
                     for i in json.loads((tmp_path / f"{name}.json").read_text())["install"]}
    return out


def test_server_resolves_beside_vllm_ray_and_tritonclient_without_moving_them(tmp_path):
    got = _resolve(tmp_path, alone=ECOSYSTEM, both=(*ECOSYSTEM, f"logitserve[server] @ {ROOT.as_uri()}"))
    alone, both = got["alone"], got["both"]
    assert both["logitserve"] and both["vllm"] == "0.33.0" and both["ray"] == "2.60.0"
    moved = {p: (alone.get(p), both.get(p)) for p in SHARED if alone.get(p) != both.get(p)}
    assert not moved, f"adding logitserve[server] moved the environment's own pins: {moved}"


def test_tritonclient_added_after_the_server_leaves_a_server_or_one_line_saying_what_to_pin(server_venv, tmp_path):
    """The common order: logitserve[server] first, tritonclient later (it moves protobuf under 7). Then serve
    either serves or says in one line which package to pin; after that pin it serves."""
    env = copy_venv(server_venv, tmp_path / "venv")
    python = python_of(env)
    pip_install(env, "tritonclient[grpc]==2.73.0")
    probe = subprocess.run([python, "-c", "from logitserve.server.cli import _broken_extras as b; print(repr(b()))"],
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    broken = eval(probe.stdout.strip())
    print("\nafter tritonclient:", broken or "every extra loads")
    if broken:
        run = subprocess.run([python, "-m", "logitserve.server.cli", "serve", "--port", "0"], capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
        assert len(run.stderr.strip().splitlines()) == len(broken) and "Pin it: pip install" in run.stderr
        pins = [line.split("Pin it: pip install ", 1)[1].strip("'") for line in broken]
        pip_install(env, *pins)
    server = CliServer("--logprob-chunk-size", "64", python=python)
    try:
        out = subprocess.run([python, "-m", "logitserve.server.cli", "query", server.address, "--ids", "1 5 9"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
    finally:
        assert server.stop() == 0
