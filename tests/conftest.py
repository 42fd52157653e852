"""Shared fixtures: small models of several architectures, served over real gRPC on loopback."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from helpers import Reference, ServerThread, build_model  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """Demo models built by tests go to a private cache unless the caller chose one."""
    if "LOGITSERVE_CACHE" not in os.environ:
        os.environ["LOGITSERVE_CACHE"] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: build_model(root / arch, arch) for arch in ("llama", "qwen2", "gpt2")}


@pytest.fixture(scope="session")
def reward_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward")
    return {arch: build_model(root / arch, arch, kind="reward", num_labels=2, seed=1)
            for arch in ("llama", "qwen2")}


def _serve(directory, chunk_size=16, batching="packed", max_pack_tokens=16384, min_shared_prefix=64, **server_kw):
    from logitserve.engine import Batching, EngineConfig
    from logitserve.loading import load_model
    from logitserve.server.app import ServerConfig

    loaded = load_model(directory)
    engine = EngineConfig(chunk_size=chunk_size, batching=Batching(batching), max_pack_tokens=max_pack_tokens,
                          min_shared_prefix=min_shared_prefix)
    return ServerThread(loaded, ServerConfig(port=0, engine=engine, **server_kw))


@pytest.fixture(scope="session", params=["llama", "qwen2", "gpt2"])
def causal(request, model_dirs):
    """(arch, server, reference) for each causal architecture; chunk 16 so sequences cross chunks."""
    directory = model_dirs[request.param]
    server = _serve(directory)
    yield request.param, server, Reference(directory)
    server.stop()


@pytest.fixture(scope="session")
def llama_server(model_dirs):
    server = _serve(model_dirs["llama"])
    yield server
    server.stop()


@pytest.fixture(scope="session")
def llama_ref(model_dirs):
    return Reference(model_dirs["llama"])


@pytest.fixture
def client(llama_server):
    from logitserve.client import TeacherClient

    with TeacherClient(llama_server.address) as c:
        yield c


serve_dir = _serve


class CliServer:
    """`logitserve serve` in its own process, as a user starts it."""

    def __init__(self, *args: str, python: str = sys.executable):
        if "--device" not in args:   # CPU unless asked (bench/gpu_check.sh sets LOGITSERVE_TEST_DEVICE=cuda)
            args = (*args, "--device", os.environ.get("LOGITSERVE_TEST_DEVICE", "cpu"))
        self.proc = subprocess.Popen([python, "-m", "logitserve.server.cli", "serve", "--host", "127.0.0.1",
                                      "--port", "0", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        deadline = time.monotonic() + 180
        self.log = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.log.append(line)
            m = re.search(r"logitserve: serving \S+ on [\d.]+:(\d+)", line)
            if m:
                self.address = f"127.0.0.1:{m.group(1)}"
                http = re.search(r"\(HTTP on port (\d+)\)", line)
                self.http = f"http://127.0.0.1:{http.group(1)}" if http else None
                threading.Thread(target=lambda: [self.log.append(x) for x in self.proc.stdout], daemon=True).start()
                return
        self.proc.kill()
        raise RuntimeError("server did not start:\n" + "".join(self.log))

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


@pytest.fixture(scope="session")
def demo_cli_server():
    server = CliServer("--logprob-chunk-size", "512")
    yield server
    server.stop()
