"""Teacher replicas launched as Ray actors on a local two-node Ray cluster: placed by placement group, addresses
reported when serving, a replica's server killed mid-run with no request lost, Ray restarting it on a new port."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from helpers import Reference, assert_close, build_model, random_seqs, ref_token_logprobs
from logitserve.client import TeacherClient, Wanted
from logitserve.ray import RayTeacherConfig


@pytest.fixture(scope="module")
def ray_cluster():
    """A head and a second node (raylet) on this machine, one CPU each: one replica fits on each."""
    import ray          # the ray extra, in the test install
    from ray.cluster_utils import Cluster

    t0 = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, include_dashboard=False))
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    print(f"ray: two nodes up in {time.monotonic() - t0:.1f} s")
    yield ray
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.unit
def test_config_bundles_one_per_rank_and_refuses_what_the_launcher_sets():
    c = RayTeacherConfig(("--model", "m", "--tp", "2", "--cp=2"), gpus_per_rank=1, resources_per_rank={"teacher": 1})
    assert c.ranks == 4 and c.bundles() == [{"CPU": 1.0, "GPU": 1, "teacher": 1}] * 4
    assert RayTeacherConfig(("--pp", "3")).bundles() == [{"CPU": 1.0}] * 3
    with pytest.raises(ValueError, match="serve_args: --port is set by the launcher"):
        RayTeacherConfig(("--port", "50051"))
    with pytest.raises(ValueError, match=r"--tp 0 --cp 1 --pp 1 must each be >= 1"):
        RayTeacherConfig(("--tp", "0"))
    with pytest.raises(ValueError, match="strategy='PACKED'"):
        RayTeacherConfig(strategy="PACKED")


@pytest.mark.multi_process
def test_two_replicas_survive_one_killed_and_ray_restarts_it(ray_cluster, tmp_path):
    from logitserve.ray import RayTeachers

    ray = ray_cluster
    directory = build_model(tmp_path / "llama", "llama", hidden=32, layers=1)
    config = RayTeacherConfig(("--model", str(directory), "--device", "cpu", "--threads", "1", "--grace-s", "1"),
                              replicas=2, max_restarts=2, ready_timeout_s=120, stop_grace_s=5)
    t0 = time.monotonic()
    teachers = RayTeachers(config)                                    # placed; the servers start meanwhile
    try:
        ref = Reference(directory)
        seqs = random_seqs(np.random.default_rng(7), [6, 19, 33])
        want = [ref_token_logprobs(ref.logits(s), s) for s in seqs]
        first = teachers.addresses()
        started = time.monotonic() - t0
        nodes = [ray.util.placement_group_table(g)["bundles_to_node_id"][0] for g in teachers.groups]
        assert len(set(first)) == 2 and len(set(nodes)) == 2          # one replica per node (one CPU each)
        with TeacherClient(f"ipv4:{first[0]},{first[1]}", streams=4, retries=8) as c:
            futures = [c.submit(seqs, Wanted(logprobs=True)) for _ in range(6)]
            victim = ray.get(teachers.actors[0].server_pid.remote())
            os.kill(victim, signal.SIGKILL)                            # replica 0's server dies mid-run
            futures += [c.submit(seqs, Wanted(logprobs=True)) for _ in range(10)]
            for f in futures:                                          # every request answered, exactly
                for got, w in zip(f.result(60).logprobs, want):
                    assert_close(got, w)
        again = teachers.addresses(timeout_s=90)                      # replica 0 restarted by Ray: a new port
        assert again[1] == first[1] and again[0] != first[0]
        assert ray.get(teachers.actors[0].server_pid.remote()) != victim
        with TeacherClient(again[0]) as c:
            for got, w in zip(c.logprobs(seqs), want):
                assert_close(got, w)
    finally:
        teachers.stop()
    print(f"ray: 2 replicas serving in {started:.1f} s")
