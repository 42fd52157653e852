"""Shared fixtures: small models of several architectures, served over real gRPC on loopback."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from helpers import (CliServer, Reference, TorchrunServer, build_model, copy_venv, make_venv,  # noqa: E402,F401
                     pip_install, serve_dir)
from helpers.venvs import ROOT, TORCH  # noqa: E402


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


@pytest.fixture(scope="session", params=["llama", "qwen2", "gpt2"])
def causal(request, model_dirs):
    """(arch, server, reference) for each causal architecture; chunk 16 so sequences cross chunks."""
    directory = model_dirs[request.param]
    server = serve_dir(directory)
    yield request.param, server, Reference(directory)
    server.stop()


@pytest.fixture(scope="session")
def llama_server(model_dirs):
    server = serve_dir(model_dirs["llama"])
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


@pytest.fixture(scope="session")
def torch_venv(tmp_path_factory):
    """A venv holding only torch (helpers.venvs): tests copy it (copy_venv) instead of installing torch again."""
    return make_venv(tmp_path_factory.mktemp("torch-venv") / "venv", TORCH)


@pytest.fixture(scope="session")
def server_venv(torch_venv, tmp_path_factory):
    """torch_venv plus `pip install logitserve[server]` from this checkout, as a user installs the server."""
    env = copy_venv(torch_venv, tmp_path_factory.mktemp("server-venv") / "venv")
    pip_install(env, f"{ROOT}[server]")
    return env


@pytest.fixture(scope="session")
def demo_cli_server():
    server = CliServer("--logprob-chunk-size", "512")
    yield server
    server.stop()


TIERS = ("unit", "live_server", "multi_process", "fresh_venv")   # pyproject.toml describes each


def pytest_collection_modifyitems(config, items):
    """Every test names exactly one tier; slow tests run only when the -m expression names `slow`."""
    untiered = [f"{item.nodeid}: {[t for t in TIERS if item.get_closest_marker(t)] or 'none'}"
                for item in items if sum(item.get_closest_marker(t) is not None for t in TIERS) != 1]
    if untiered:
        raise pytest.UsageError("each test needs exactly one tier marker of " + ", ".join(TIERS) + ":\n  "
                                + "\n  ".join(untiered))
    if "slow" not in (config.getoption("markexpr") or ""):
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]
