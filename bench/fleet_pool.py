"""Two replicas (bench/fleet.py measures one server), one request per sequence, every group's sequences in flight
at once: TeacherPool's group affinity against today's client spreading streams round-robin over the replicas.

`python bench/fleet_pool.py [--groups 16 --group-size 8 --prompt 2048 --response 256 --demo-shape body]`
starts two `logitserve serve` processes (one torch thread each, --threads 1), sends the agentic shape of
bench/groups.py (G responses to one prompt, outputs on the responses: prompt_lengths) as groups x G
one-sequence requests, all in flight, through
- `TeacherPool([a, b])`: each group's requests to one replica (its prompt's key: hashed under a load bound, sticky);
- round-robin: request i to replica i % 2, what grpc's round_robin does per call (a group over both);
and reports, interleaved over --repeats, the tokens/s of each and the fraction of the prompt tokens that the
servers shared (sum of RequestDone.shared_prefix_tokens / groups * (G - 1) * P). Writes
bench/results/fleet_pool-<time>.json.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from run import start_server, write_result  # noqa: E402

from logitserve.client import TeacherClient, TeacherPool, Wanted  # noqa: E402


def make_groups(rng, groups: int, size: int, prompt: int, response: int, vocab: int) -> list[list[np.ndarray]]:
    out = []
    for _ in range(groups):
        p = rng.integers(3, vocab, prompt)
        out.append([np.concatenate([p, rng.integers(3, vocab, response)]) for _ in range(size)])
    return out


class RoundRobin:
    """Request i to replica i % N: the spread of grpc's round_robin, one call per request."""

    def __init__(self, clients):
        self.clients, self.turn = clients, itertools.count()

    def submit(self, seqs, wanted):
        return self.clients[next(self.turn) % len(self.clients)].submit(seqs, wanted)


def send_all(client, groups, prompt: int) -> tuple[float, int]:
    """(seconds, shared prompt tokens) for every sequence sent as its own request, all in flight."""
    wanted = Wanted(logprobs=True, prompt_lengths=[prompt])
    start = time.perf_counter()
    futures = [client.submit([s], wanted) for g in groups for s in g]
    shared = sum(f.result().shared_prefix_tokens for f in futures)
    return time.perf_counter() - start, shared


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--demo-shape", default="body")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-delay-ms", type=float, default=20.0,
                    help="the servers' wait for a batch's company (a group's requests arrive one by one)")
    args = ap.parse_args()
    servers = [start_server("--demo-shape", args.demo_shape, "--threads", "1", "--device", "cpu",
                            "--batch-delay-ms", str(args.batch_delay_ms)) for _ in range(2)]
    addresses = [address for _, address in servers]
    try:
        with TeacherPool(addresses, wait_ready=600) as pool, TeacherClient(addresses[0]) as c0, \
                TeacherClient(addresses[1]) as c1:
            rr = RoundRobin([c0, c1])
            vocab = pool.model_info().vocab_size
            groups = make_groups(np.random.default_rng(0), args.groups, args.group_size, args.prompt,
                                 args.response, vocab)
            tokens = sum(len(s) for g in groups for s in g)
            possible = args.groups * (args.group_size - 1) * args.prompt
            runs: dict[str, list[tuple[float, int]]] = {"pool_affinity": [], "round_robin": []}
            send_all(pool, groups[:2], args.prompt)          # warm both paths
            send_all(rr, groups[:2], args.prompt)
            for _ in range(args.repeats):
                runs["pool_affinity"].append(send_all(pool, groups, args.prompt))
                runs["round_robin"].append(send_all(rr, groups, args.prompt))
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(30)
    result = {"args": vars(args), "tokens": tokens, "possible_shared": possible, "cases": {}}
    print(f"| case | tokens/s (median of {args.repeats}) | shared prefix fraction |\n|---|---|---|")
    for name, rows in runs.items():
        secs = statistics.median(s for s, _ in rows)
        fraction = statistics.median(sh for _, sh in rows) / possible
        result["cases"][name] = {"seconds": [s for s, _ in rows], "shared": [sh for _, sh in rows],
                                 "tokens_per_s": tokens / secs, "shared_fraction": fraction}
        print(f"| {name} | {tokens / secs:,.0f} | {fraction:.2f} |")
    print(f"wrote {write_result(result, 'fleet_pool')}")


if __name__ == "__main__":
    main()
