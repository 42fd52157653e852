"""The deployment files: the k8s example parses and hangs together, the Dockerfile keeps a non-root user and a
HEALTHCHECK that `logitserve health` answers, the TP=2 script runs torchrun with --tp 2."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.unit
def test_k8s_example_has_probes_a_gpu_and_a_headless_service():
    docs = list(yaml.safe_load_all((ROOT / "deploy/k8s/teacher.yaml").read_text()))
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    service = next(d for d in docs if d["kind"] == "Service")
    pod = deploy["spec"]["template"]
    container = pod["spec"]["containers"][0]
    grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == grpc_port
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    args = container["args"]
    assert args[0] == "serve" and args[args.index("--port") + 1] == str(grpc_port)
    assert pod["spec"]["terminationGracePeriodSeconds"] > float(args[args.index("--grace-s") + 1])
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert any(p["port"] == grpc_port for p in service["spec"]["ports"])
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


@pytest.mark.unit
def test_dockerfile_runs_as_a_user_with_a_healthcheck():
    text = (ROOT / "Dockerfile").read_text()
    assert "USER logitserve" in text and "useradd" in text
    assert 'HEALTHCHECK' in text and '"logitserve", "health", "127.0.0.1:50051"' in text
    script = (ROOT / "deploy/tp2-one-container.sh").read_text()
    assert "--nproc-per-node 2" in script and "--tp 2" in script


@pytest.mark.live_server
def test_health_command_answers_for_a_live_server_and_fails_for_none(demo_cli_server):
    run = lambda addr: subprocess.run([sys.executable, "-m", "logitserve.server.cli", "health", addr,  # noqa: E731
                                       "--timeout", "3"], capture_output=True, text=True, timeout=60)
    ok = run(demo_cli_server.address)
    assert ok.returncode == 0 and "SERVING" in ok.stdout
    down = run("127.0.0.1:1")
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr


@pytest.mark.unit
def test_k8s_multinode_example_launches_a_valid_torchrun_and_serve():
    """The LeaderWorkerSet's command parses with torchrun's own parser and logitserve's, its ranks fill tp x cp,
    node 0 (the leader, static rendezvous on its address) holds rank 0, and the Service selects leaders only."""
    import argparse
    import shlex

    from torch.distributed.run import get_args_parser

    from logitserve.server.cli import _serve_parser

    docs = list(yaml.safe_load_all((ROOT / "deploy/k8s/teacher-multinode.yaml").read_text()))
    lws = next(d for d in docs if d["kind"] == "LeaderWorkerSet")
    service = next(d for d in docs if d["kind"] == "Service")
    template = lws["spec"]["leaderWorkerTemplate"]
    size = template["size"]
    leader, worker = template["leaderTemplate"], template["workerTemplate"]
    assert leader["spec"] == worker["spec"]                      # every node runs the same command
    container = leader["spec"]["containers"][0]
    env = {"LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": "0", "LWS_LEADER_ADDRESS": "leader.svc"}
    words = shlex.split(container["args"][0])
    words = [env.get(w.strip("$"), w) for w in words]
    assert words[:2] == ["exec", "torchrun"]
    split = words.index("logitserve")
    run = get_args_parser().parse_args(words[2:split] + ["x"])
    assert run.no_python and run.nnodes == str(size) and run.node_rank == 0 and run.master_addr == "leader.svc"
    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="command"), argparse.HelpFormatter)
    serve = parser.parse_args(words[split + 1:])
    assert serve.tp * serve.cp * serve.pp == int(run.nproc_per_node) * size
    assert serve.pp == size                                      # one pipeline stage per node
    assert container["resources"]["limits"]["nvidia.com/gpu"] == int(run.nproc_per_node)
    assert serve.tp <= int(run.nproc_per_node)                  # TP stays inside a node
    grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
    assert serve.port == grpc_port and leader["spec"]["terminationGracePeriodSeconds"] > serve.grace_s
    assert service["spec"]["selector"].items() <= leader["metadata"]["labels"].items()
    assert not service["spec"]["selector"].items() <= worker["metadata"]["labels"].items()
