"""RL groups sent one sequence per request, all in flight (verl's, slime's, prime-rl's per-sample callers): how much
of the possible shared-prefix work one server saves, and its tokens/s, with the share window on and off.

`python bench/fleet.py` writes bench/results/fleet-<time>.json and prints a markdown table. For each shape
(bench/groups.py: agentic G=8 P=2048 R=256, chat G=8 P=512 R=512; `--scale` shrinks P and R, e.g. 0.25 on a
CPU) it builds `--groups` groups of G sequences sharing a prompt, then for each `--share-wait-ms` value starts
`logitserve serve` (the body-heavy causal demo) and, `--repeats` times:
- sends the whole burst as one request: its `shared_prefix_tokens` is the possible (sharing at its best);
- sends it one sequence per request, every request in flight at once over `--streams` streams, response
  logprobs asked (prompt_lengths = P), and sums the requests' `shared_prefix_tokens`.
It reports the fraction of the possible shared and the burst's tokens (all of every sequence) per second, and the
latency of a lone small request (another client, its own prompt, 96 tokens) sent 0.2 s into each burst, beside
its latency on the idle server before any burst: what a request that is part of no group pays for the groups'
gathering (a burst that ends within 0.2 s, as at a small --scale, gives an idle figure there too).
Over two replicas through TeacherPool (group affinity against round-robin): bench/fleet_pool.py.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from groups import DTYPES, SHAPES  # noqa: E402
from run import start_server, write_result  # noqa: E402

FLEET_SHAPES = ("agentic", "chat")


@dataclass(frozen=True)
class Burst:
    """One training step's worth of groups, in the order a per-sample caller sends them."""

    shape: str
    G: int
    P: int
    R: int
    seqs: tuple[np.ndarray, ...]     # int32 [P + R] each; group g is seqs[g * G : (g + 1) * G] (order "grouped")


def workload(shape: str, groups: int, scale: float, seed: int, order: str = "grouped") -> Burst:
    """`groups` groups of the shape's G sequences (P and R scaled), prompts and responses random ids."""
    _, G, P, R = SHAPES[shape]
    P, R = max(2, int(P * scale)), max(1, int(R * scale))
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 32000, P) for _ in range(groups)]
    seqs = [np.concatenate([prompts[g], rng.integers(3, 32000, R)]).astype(np.int32)
            for g in range(groups) for _ in range(G)]
    if order == "interleaved":                     # g0 g1 g2 ... g0 g1 g2 ...: the sampler's order, not the prompt's
        seqs = [seqs[g * G + i] for i in range(G) for g in range(groups)]
    return Burst(shape, G, P, R, tuple(seqs))


# A lone small request (another client, its own prompt, shareable: LONE_P tokens before the rows it reads) sent
# LONE_AFTER_S into the burst: what a request that is no part of any group pays for the groups' gathering.
LONE_L, LONE_P, LONE_AFTER_S = 96, 80, 0.2


def lone_sequence() -> np.ndarray:
    return np.random.default_rng(99).integers(3, 32000, LONE_L).astype(np.int32)


async def lone_seconds(client, delay_s: float) -> float:
    """Seconds one lone request takes, sent after delay_s."""
    await asyncio.sleep(delay_s)
    t = time.perf_counter()
    await client.forward([lone_sequence()], logprobs=True, prompt_lengths=[LONE_P])
    return time.perf_counter() - t


async def send_per_sequence(addresses: list[str], burst: Burst, streams: int) -> tuple[int, float, float]:
    """Every sequence as its own request, all in flight, over `streams` streams spread on `addresses` in turn,
    and a lone request during them: (the shared_prefix_tokens the requests report, seconds from the first send to
    the last answer, the lone request's seconds)."""
    from logitserve.client import AsyncTeacherClient

    clients = [AsyncTeacherClient(addresses[i % len(addresses)]) for i in range(streams)]
    lone = AsyncTeacherClient(addresses[0])
    try:
        await asyncio.gather(lone.model_info(), *(c.model_info() for c in clients))   # connected before the clock
        t = time.perf_counter()
        probe = asyncio.ensure_future(lone_seconds(lone, LONE_AFTER_S))
        results = await asyncio.gather(*(clients[i % streams].forward([s], logprobs=True, prompt_lengths=[burst.P])
                                         for i, s in enumerate(burst.seqs)))
        seconds = time.perf_counter() - t
        return sum(r.shared_prefix_tokens for r in results), seconds, await probe
    finally:
        for c in (*clients, lone):
            await c.close()


async def idle_lone(address: str, repeats: int = 5) -> float:
    """Median seconds of the lone request on the idle server."""
    from logitserve.client import AsyncTeacherClient

    async with AsyncTeacherClient(address) as c:
        await lone_seconds(c, 0.0)
        return statistics.median([await lone_seconds(c, 0.0) for _ in range(repeats)])


def possible(address: str, burst: Burst) -> int:
    """Shared-prefix tokens when the whole burst comes as one request."""
    from logitserve.client import TeacherClient

    with TeacherClient(address) as c:
        return c.forward(list(burst.seqs), logprobs=True, prompt_lengths=[burst.P] * len(burst.seqs)).shared_prefix_tokens


def measure(address: str, burst: Burst, streams: int, repeats: int, idle: float, **labels) -> dict:
    """One server, one burst: the possible, then `repeats` per-sequence sends (the first one a warm-up); `idle`:
    the lone request's seconds on this server before any burst (no group seen yet: not in grouped mode)."""
    best = possible(address, burst)
    if best == 0:
        raise SystemExit(f"{burst.shape}: P = {burst.P} shares nothing even in one request (under the server's "
                         f"--min-shared-prefix, 64 by default); use a larger --scale")
    asyncio.run(send_per_sequence([address], burst, streams))
    runs = [asyncio.run(send_per_sequence([address], burst, streams)) for _ in range(repeats)]
    tokens = sum(len(s) for s in burst.seqs)
    fractions = [shared / best for shared, _, _ in runs]
    seconds = [s for _, s, _ in runs]
    return {"shape": burst.shape, "G": burst.G, "P": burst.P, "R": burst.R, "sequences": len(burst.seqs),
            **labels, "possible": best, "shared": [shared for shared, _, _ in runs], "fraction": min(fractions),
            "fraction_median": statistics.median(fractions), "seconds": seconds,
            "tokens_per_s": tokens / statistics.median(seconds), "lone_idle_ms": 1e3 * idle,
            "lone_ms": [1e3 * x for _, _, x in runs], "lone_ms_median": 1e3 * statistics.median(x for _, _, x in runs)}


def markdown(result: dict) -> str:
    lines = [f"{result['date']} | {result['machine']} | {result['note']}", "",
             "| shape | G, P, R | sequences | --share-wait-ms | shared / possible (worst, median) | tokens/s | "
             "lone request ms: idle, in the burst (median) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['shape']} | {r['G']}, {r['P']}, {r['R']} | {r['sequences']} | {r['share_wait_ms']:g} | "
                     f"{r['fraction']:.2f}, {r['fraction_median']:.2f} | {r['tokens_per_s']:.0f} | "
                     f"{r['lone_idle_ms']:.1f}, {r['lone_ms_median']:.1f} |")
    return "\n".join(lines)


def one_server(args, bursts: list[Burst]) -> list[dict]:
    """Each --share-wait-ms value on its own server, every burst through it."""
    rows = []
    for wait in [float(w) for w in args.share_wait_ms.split(",")]:
        proc, address = start_server("--demo", "causal", "--demo-shape", args.model_shape, "--dtype", args.dtype,
                                     "--device", args.device, "--share-wait-ms", f"{wait:g}", *args.server_args.split())
        try:
            idle = asyncio.run(idle_lone(address))
            for burst in bursts:
                row = measure(address, burst, args.streams, args.repeats, idle, share_wait_ms=wait)
                rows.append(row)
                print(f"{burst.shape:>8} wait {wait:g} ms: shared {row['fraction']:.2f} of the possible (worst), "
                      f"{row['tokens_per_s']:.0f} tokens/s, lone request {row['lone_idle_ms']:.1f} ms idle, "
                      f"{row['lone_ms_median']:.1f} ms in the burst", flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(FLEET_SHAPES))
    p.add_argument("--groups", type=int, default=6, help="groups per burst")
    p.add_argument("--scale", type=float, default=1.0, help="P and R times this (0.25 on a CPU)")
    p.add_argument("--order", choices=["grouped", "interleaved"], default="grouped",
                   help="requests group by group, or the groups' members interleaved")
    p.add_argument("--share-wait-ms", default="5,0", help="the server's --share-wait-ms values to compare")
    p.add_argument("--streams", type=int, default=4, help="client streams the requests are spread over")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model-shape", default="body", help="the demo's shape (body; 1b on a GPU)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--server-args", default="", help="more `logitserve serve` flags, e.g. --server-args=\"--short-step-ms 0\"")
    args = p.parse_args()

    import torch

    bursts = [workload(s, args.groups, args.scale, seed=i, order=args.order)
              for i, s in enumerate(args.shapes.split(","))]
    rows = one_server(args, bursts)
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else ""
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} {gpu}".strip(),
              "note": f"{args.device} {args.dtype}, {args.model_shape} demo, {args.groups} groups, scale "
                      f"{args.scale:g}, order {args.order}, {args.streams} streams, {args.repeats} repeats",
              "rows": rows}
    out = write_result(result, "fleet")
    print(markdown(result))
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
