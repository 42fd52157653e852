"""TeacherPool over replicas: a group on one replica, results in order and exact, a killed or draining replica
costs no request, a replica on other weights refused."""
from __future__ import annotations

import asyncio
import signal
import time

import numpy as np
import pytest

from helpers import PACKED_ATOL, VOCAB, CliServer, ServerThread, build_model, ref_token_logprobs, serve_dir
from logitserve.client import ReplicasDisagree, Routing, TeacherPool, Wanted
from logitserve.client.health import NOT_SERVING, SERVING, decode_status, encode_request
from logitserve.client.routing import Affinity, choose, group_key, plan, prefix_key, rendezvous

PREFIX = 64          # the servers' --min-shared-prefix (serve_dir's and the CLI's default)


@pytest.fixture(scope="module")
def pair(model_dirs):
    a, b = serve_dir(model_dirs["llama"]), serve_dir(model_dirs["llama"])
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture(scope="module")
def victim(model_dirs):
    """`logitserve serve` as a process, to SIGKILL. A long batch delay keeps requests queued there (nothing
    sent back yet) when the signal comes."""
    server = CliServer("--model", str(model_dirs["llama"]), "--threads", "1", "--batch-delay-ms", "400")
    yield server
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()


def held_server(directory, port: int = 0, delay_s: float = 0.4) -> ServerThread:
    """An in-process server whose batches wait `delay_s` for company: a request stays in flight that long."""
    from logitserve.engine import Batching, EngineConfig
    from logitserve.loading import load_model
    from logitserve.server.config import SchedulerConfig, ServerConfig

    engine = EngineConfig(chunk_size=16, batching=Batching("packed"), min_shared_prefix=PREFIX)
    return ServerThread(load_model(directory), ServerConfig(port=port, engine=engine, grace_s=5.0,
                                                            scheduler=SchedulerConfig(batch_delay_s=delay_s)))


def tokens_served(server) -> float:
    return server.running.metrics.registry.get_sample_value("logitserve_tokens_total") or 0.0


def group_seqs(rng, groups: int, size: int, prefix: int = PREFIX + 16, suffix: int = 12) -> list[list[np.ndarray]]:
    out = []
    for _ in range(groups):
        p = rng.integers(0, VOCAB, prefix)
        out.append([np.concatenate([p, rng.integers(0, VOCAB, int(rng.integers(1, suffix)))]) for _ in range(size)])
    return out


def check_exact(results, seqs, ref) -> None:
    assert len(results) == len(seqs)
    for got, seq in zip(results, seqs):
        np.testing.assert_allclose(got, ref_token_logprobs(ref.logits(seq), seq), atol=PACKED_ATOL)


def key_on(address: str, addresses: list[str], start: int = 0) -> str:
    """A group key that the pool's hashing sends to `address`."""
    return next(f"g{i}" for i in range(start, start + 1000) if rendezvous(group_key(f"g{i}"), addresses) == address)


# ---- routing, without a server


@pytest.mark.unit
def test_rendezvous_spreads_keys_and_moves_only_a_leaving_replicas_keys():
    names = ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]
    keys = [prefix_key(np.arange(i, i + 8), 8) for i in range(3000)]
    before = [rendezvous(k, names) for k in keys]
    shares = [before.count(n) / len(keys) for n in names]
    assert all(0.28 < s < 0.39 for s in shares), shares
    after = [rendezvous(k, names[:2]) for k in keys]
    assert all(a == b for b, a in zip(before, after) if b != names[2])     # only the leaver's keys moved
    assert prefix_key(np.arange(7), 8) is None                            # too short to share: no key
    assert prefix_key(np.arange(20), 8) == prefix_key(np.arange(8).astype(np.int32), 8)


@pytest.mark.unit
def test_load_fallback_only_past_both_bounds_and_a_group_stays_together():
    rule = Routing(balance_abs=64, balance_rel=1.5)
    key = group_key("prompt-1")
    names = ["a:1", "b:1"]
    hashed = rendezvous(key, names)
    other = names[1 - names.index(hashed)]
    assert choose(key, {hashed: 100, other: 50}, rule) == hashed      # 50 over: within the absolute bound
    assert choose(key, {hashed: 300, other: 210}, rule) == hashed     # 90 over but 1.43x: within the relative one
    assert choose(key, {hashed: 300, other: 150}, rule) == other      # past both
    assert choose(None, {hashed: 3, other: 2}, rule) == other         # no key: least loaded
    parts = plan([key] * 5 + [None, None], {hashed: 0, other: 0}, Routing(balance_abs=2, balance_rel=1.0))
    assert parts[hashed][:5] == [0, 1, 2, 3, 4]          # the group is not split when it alone makes the gap
    assert parts[other] == [5, 6]
    with pytest.raises(ValueError, match="balance_rel=0.5"):
        Routing(balance_rel=0.5)


def burst(keys: list[bytes], size: int, affinity: Affinity, names: list[str]) -> dict[bytes, set[str]]:
    """Each key's `size` sequences routed one request at a time, none finishing: key -> the replicas it went to."""
    loads = dict.fromkeys(names, 0)
    went: dict[bytes, set[str]] = {}
    for key in keys:
        for _ in range(size):
            (name, _), = plan([key], loads, Routing(), affinity).items()
            loads[name] += 1
            went.setdefault(key, set()).add(name)
    return went


@pytest.mark.unit
def test_a_burst_of_few_groups_lands_evenly_each_group_on_one_replica():
    names = ["a:1", "b:1"]
    # four groups whose keys all hash to a:1: pure hashing sends all 32 sequences there
    keys = [group_key(k) for k in (f"p{i}" for i in range(200)) if rendezvous(group_key(k), names) == "a:1"][:4]
    hashed = burst(keys, 8, Affinity(Routing(balance_factor=None)), names)
    assert all(went == {"a:1"} for went in hashed.values())
    went = burst(keys, 8, Affinity(Routing()), names)
    assert all(len(replicas) == 1 for replicas in went.values()), went      # no group split
    per_replica = [sum(1 for r in went.values() if r == {n}) for n in names]
    assert per_replica == [2, 2], went
    with pytest.raises(ValueError, match="balance_factor=0.5"):
        Routing(balance_factor=0.5)


@pytest.mark.unit
def test_a_key_keeps_its_replica_while_sticky_and_moves_when_it_leaves():
    now = [0.0]
    affinity = Affinity(Routing(sticky_s=10.0, max_keys=3), clock=lambda: now[0])
    names = ["a:1", "b:1"]
    key = next(group_key(f"k{i}") for i in range(100) if rendezvous(group_key(f"k{i}"), names) == "a:1")
    assert affinity.choose(key, {"a:1": 0, "b:1": 0}) == "a:1"
    now[0] = 9.0                       # a:1 now over the bound for a new key (cap 7), kept: the group's replica
    assert affinity.choose(key, {"a:1": 10, "b:1": 0}) == "a:1"
    now[0] = 19.5                      # 10.5 s since it was last routed: forgotten, chosen anew under the bound
    assert affinity.choose(key, {"a:1": 10, "b:1": 0}) == "b:1"
    assert affinity.choose(key, {"a:1": 0, "b:1": 5}) == "b:1"           # kept again
    assert affinity.choose(key, {"a:1": 0}) == "a:1"                      # b:1 left: moved, and kept there
    assert affinity.choose(key, {"a:1": 5, "b:1": 0}) == "a:1"
    assert affinity.choose(key, {"a:1": 300, "b:1": 100}) == "b:1"       # overloaded past both bounds: this one spills
    assert affinity.choose(key, {"a:1": 6, "b:1": 0}) == "a:1"           # ... and the key stays
    for i in range(5):
        affinity.choose(group_key(f"other{i}"), {"a:1": 0, "b:1": 0})
    assert len(affinity) == 3                                             # at most max_keys kept


@pytest.mark.unit
def test_health_messages_match_grpc_health_checking():
    from grpc_health.v1 import health_pb2

    assert encode_request("logitserve.v1.LogitServe") == \
        health_pb2.HealthCheckRequest(service="logitserve.v1.LogitServe").SerializeToString()
    for status in (SERVING, NOT_SERVING):
        assert decode_status(health_pb2.HealthCheckResponse(status=status).SerializeToString()) == status
    assert decode_status(b"") == 0


# ---- live replicas


@pytest.mark.live_server
def test_each_group_lands_on_one_replica_and_results_come_back_in_order_exact(pair, llama_ref):
    a, b = pair
    rng = np.random.default_rng(7)
    with TeacherPool([a.address, b.address], wait_ready=30) as pool:
        assert {r.status for r in pool.replicas()} == {"SERVING"}
        for group in group_seqs(rng, 8, 4):           # one request per sequence, the group's all in flight
            before = (tokens_served(a), tokens_served(b))
            futures = [pool.submit([s], Wanted(logprobs=True)) for s in group]
            check_exact([f.result(60).logprobs[0] for f in futures], group, llama_ref)
            grew = [tokens_served(a) - before[0], tokens_served(b) - before[1]]
            assert sorted(grew) == [0, sum(len(s) for s in group)], grew       # all on one replica
        # one request of several groups and short sequences: split over both replicas, merged in order
        addresses = [a.address, b.address]
        on_a = group_seqs(rng, 1, 3)[0]
        while rendezvous(prefix_key(on_a[0], PREFIX), addresses) != a.address:
            on_a = group_seqs(rng, 1, 3)[0]
        on_b = group_seqs(rng, 1, 3)[0]
        while rendezvous(prefix_key(on_b[0], PREFIX), addresses) != b.address:
            on_b = group_seqs(rng, 1, 3)[0]
        mixed = [on_a[0], on_b[0], rng.integers(0, VOCAB, 5), on_a[1], on_b[1], on_a[2], on_b[2]]
        before = (tokens_served(a), tokens_served(b))
        out = pool.forward(mixed, logprobs=True, prompt_lengths=[2] * len(mixed))
        assert tokens_served(a) - before[0] >= sum(map(len, on_a)) and tokens_served(b) - before[1] >= sum(map(len, on_b))
        full = [ref_token_logprobs(llama_ref.logits(s), s)[2:] for s in mixed]
        for got, want in zip(out.logprobs, full):
            np.testing.assert_allclose(got, want, atol=PACKED_ATOL)
        with pytest.raises(ValueError, match="prompt_lengths: 1 given for 2 sequences"):
            pool.forward(mixed[:2], logprobs=True, prompt_lengths=[2])
        # an explicit key overrides the tokens: unrelated sequences, one replica
        before = (tokens_served(a), tokens_served(b))
        loose = [rng.integers(0, VOCAB, 70) for _ in range(6)]
        check_exact(pool.group("prompt-42").logprobs(loose), loose, llama_ref)
        assert sorted([tokens_served(a) - before[0], tokens_served(b) - before[1]]) == [0, 70 * 6]


@pytest.mark.live_server
def test_replicas_on_different_weights_are_refused_naming_both(pair, tmp_path):
    other = serve_dir(build_model(tmp_path / "other", "llama", seed=1))
    a = pair[0]
    try:
        with pytest.raises(ReplicasDisagree) as e:
            TeacherPool([a.address, other.address], wait_ready=30)
        message = str(e.value)
        assert a.address in message and other.address in message
        assert len(set(e.value.hashes.values())) == 2 and all(h in message for h in e.value.hashes.values())
        with TeacherPool([a.address, other.address], ready_timeout_s=10) as pool:   # no wait_ready: checked before
            with pytest.raises(ReplicasDisagree):                                   # the first request is routed
                pool.logprobs([[1, 2, 3]])                                          # (test_hung_replica.py)
            with pytest.raises(ReplicasDisagree):
                pool.check_agreement()
    finally:
        other.stop()


@pytest.mark.live_server
def test_a_killed_replica_loses_no_request(pair, victim, llama_ref):
    survivor = pair[1]
    rng = np.random.default_rng(11)
    seqs = [s for g in group_seqs(rng, 12, 3) for s in g]
    with TeacherPool([victim.address, survivor.address], wait_ready=60) as pool:
        futures = [pool.submit([s], Wanted(logprobs=True)) for s in seqs]      # all in flight
        deadline = time.monotonic() + 10
        while not any(r.address == victim.address and r.in_flight for r in pool.replicas()):
            assert time.monotonic() < deadline, ("nothing was sent to the victim", pool.replicas())
            time.sleep(0.01)
        victim.proc.send_signal(signal.SIGKILL)             # its requests are queued, nothing sent back yet
        check_exact([f.result(60).logprobs[0] for f in futures], seqs, llama_ref)
        state = {r.address: r for r in pool.replicas()}
        assert state[victim.address].status == "UNREACHABLE" and state[victim.address].sent > 0
        assert state[survivor.address].in_flight == state[victim.address].in_flight == 0


@pytest.mark.live_server
def test_a_draining_replica_is_taken_out_by_watch_and_a_new_one_on_its_port_comes_back(pair, llama_ref, model_dirs):
    """The drain is what SIGTERM starts in `logitserve serve` (Running.stop(grace)): health NOT_SERVING at once,
    in-flight requests finish, then the port closes."""
    drainer, survivor = held_server(model_dirs["llama"]), pair[1]
    addresses = [drainer.address, survivor.address]
    key = key_on(drainer.address, addresses)
    seq = np.random.default_rng(5).integers(0, VOCAB, 90)
    with TeacherPool(addresses, wait_ready=30) as pool:
        state = lambda: {r.address: r for r in pool.replicas()}[drainer.address]   # noqa: E731
        held = pool.group(key).submit([seq], Wanted(logprobs=True))       # waits 0.4 s on the drainer
        deadline = time.monotonic() + 10
        while not state().in_flight:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        drain = asyncio.run_coroutine_threadsafe(drainer.running.stop(5.0), drainer.loop)
        while "NOT_SERVING" not in [s for _, s in state().history]:
            assert time.monotonic() < deadline, state()
            time.sleep(0.005)
        sent = state().sent
        after = [pool.group(key).logprobs([seq])[0] for _ in range(3)]     # its key, now served by the other
        assert state().sent == sent
        check_exact(after + [held.result(30).logprobs[0]], [seq] * 4, llama_ref)   # the held one drained
        drain.result(30)
        drainer.loop.call_soon_threadsafe(drainer.loop.stop)
        drainer.thread.join()
        while state().status != "UNREACHABLE":
            assert time.monotonic() < deadline, state()
            time.sleep(0.02)
        assert [s for _, s in state().history][-3:] == ["SERVING", "NOT_SERVING", "UNREACHABLE"]
        back = held_server(model_dirs["llama"], port=int(drainer.address.rsplit(":", 1)[1]), delay_s=0.002)
        try:                                                          # a new replica on the same address
            deadline = time.monotonic() + 15
            while state().status != "SERVING":
                assert time.monotonic() < deadline, state()
                time.sleep(0.05)
            before = (tokens_served(back), tokens_served(survivor))
            check_exact(pool.group(key).logprobs([seq]), [seq], llama_ref)   # a live group stays where it went
            assert (tokens_served(back) - before[0], tokens_served(survivor) - before[1]) == (0, len(seq))
            fresh = key_on(drainer.address, addresses, start=int(key[1:]) + 1)      # a new group hashed there
            check_exact(pool.group(fresh).logprobs([seq]), [seq], llama_ref)
            assert tokens_served(back) - before[0] == len(seq)
        finally:
            back.stop()


# ---- HTTP: N replicas behind SGLang's router


def _get(url: str) -> tuple[int, object]:
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None
    except OSError:
        return 0, None


def _wait_healthy(base: str, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = _get(base + "/readiness")
        if status == 200 and body.get("healthy_workers") == n:
            return
        assert time.monotonic() < deadline, (status, body)
        time.sleep(0.1)


@pytest.mark.multi_process
def test_sglang_router_in_front_of_two_http_replicas_routes_health_checks_and_drains(tmp_path):
    """sglang-router (the Rust router SGLang and vLLM fleets use) registers both replicas through their /health,
    /get_model_info and /v1/models, spreads requests over them, and takes a draining one (/health 503) out."""
    import socket
    import subprocess
    import sys

    from helpers import Reference, post
    from logitserve.demo import demo_tokenizer

    directory = build_model(tmp_path / "tok", "llama")
    demo_tokenizer(VOCAB).save_pretrained(directory)          # text prompts: the router forwards no token ids
    a, b = serve_dir(directory, http_port=0), serve_dir(directory, http_port=0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    router = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                               str(port), "--policy", "round_robin", "--health-check-interval-secs", "1",
                               "--log-level", "warn", "--worker-urls",
                               *(f"http://127.0.0.1:{x.running.http_port}" for x in (a, b))],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base, ref = f"http://127.0.0.1:{port}", Reference(directory)
    try:
        _wait_healthy(base, 2)
        assert _get(base + "/v1/models")[0] == 200 and _get(base + "/get_model_info")[1]["model_path"] == "tok"
        before = (tokens_served(a), tokens_served(b))
        for i in range(6):
            ids = [1] + [5 + i + j for j in range(20)]               # "<s> t5 t6 ...": the tokenizer's ids
            status, out = post(base, "/v1/completions", {"model": "tok", "prompt": " ".join(f"t{x}" for x in ids[1:]),
                                                         "max_tokens": 0, "prompt_logprobs": 1})
            assert status == 200, out
            plp = out["choices"][0]["prompt_logprobs"]
            want = ref_token_logprobs(ref.logits(ids), ids)
            np.testing.assert_allclose([plp[t][str(ids[t])]["logprob"] for t in range(1, len(ids))], want[1:],
                                       atol=PACKED_ATOL)
        assert tokens_served(a) > before[0] and tokens_served(b) > before[1]       # both replicas served
        drain = asyncio.run_coroutine_threadsafe(a.running.stop(2.0), a.loop)       # what SIGTERM starts
        drain.result(30)
        _wait_healthy(base, 1)
        for i in range(3):
            status, out = post(base, "/v1/completions", {"model": "tok", "prompt": "t7 t8 t9", "max_tokens": 0,
                                                         "prompt_logprobs": 1})
            assert status == 200, out
    finally:
        router.terminate()
        router.wait(10)
        if a.thread.is_alive():
            a.loop.call_soon_threadsafe(a.loop.stop)
            a.thread.join()
        b.stop()
