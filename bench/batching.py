"""Throughput by batch shape: served (packed and exact) against a batched in-process forward of the same shape.

`python bench/batching.py` (make bench-batching) writes bench/results/batching-<time>.json and prints a
markdown table. For each model shape (demo: lm_head-heavy; body: 8 layers, hidden 768) and each
workload (8x512, 64x64, a mixed batch with lengths drawn in 16..1024), token logprobs and top-k k=20
are timed three ways: the in-process floor (one batched transformers forward of the padded [B, Lmax]
batch + logsumexp/gather or topk), a server in `--batching exact` and one in `--batching packed`.
Reward scores of 64x128 on the body shape go against one batched sequence-classification forward.
Cases of a group run interleaved, run by run; every figure is the median of --repeats, so ratios are
the signal. --device cuda --dtype bf16 --shapes 1b runs the same table on a GPU (bench/gpu_check.sh).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from run import interleaved, start_server, write_result  # noqa: E402

WORKLOADS = {"8x512": [512] * 8, "64x64": [64] * 64}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def workload_lengths(name: str) -> list[int]:
    if name == "mixed":   # a fixed draw: 12 sequences, lengths uniform in 16..1024
        return [int(n) for n in np.random.default_rng(7).integers(16, 1025, 12)]
    if name in WORKLOADS:
        return WORKLOADS[name]
    n, _, length = name.partition("x")      # any NxL: N sequences of L tokens (64x128: the reward workload)
    return [int(length)] * int(n)


def floor_cases(model, seqs, device, reward: bool = False) -> dict:
    """The in-process floor on the padded [B, Lmax] batch: what a careful transformers user writes."""
    import torch

    B, Lmax = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(B, Lmax, dtype=torch.long)
    mask = torch.zeros(B, Lmax, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.as_tensor(s)
        mask[b, : len(s)] = 1
    ids, mask = ids.to(device), mask.to(device)
    ragged = any(len(s) != Lmax for s in seqs)
    kw = {"attention_mask": mask} if ragged else {}
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)

    @torch.inference_mode()
    def scores():
        out = model(ids, **kw).logits.float().cpu()        # [B, num_labels] at each row's last real token
        sync()
        return out

    @torch.inference_mode()
    def logprobs():
        z = model(ids, **kw).logits[:, :-1].float()         # [B, Lmax-1, V]
        lp = z.gather(-1, ids[:, 1:, None])[..., 0] - torch.logsumexp(z, -1)
        return (lp * mask[:, 1:]).cpu()

    @torch.inference_mode()
    def topk():
        v, i = model(ids, **kw).logits.float().topk(20, dim=-1)
        return v.cpu(), i.cpu()

    if reward:
        return {"floor": scores}
    return {"floor logprobs": logprobs, "floor topk20": topk}


def served_cases(clients: dict, seqs, reward: bool = False) -> dict:
    from logitserve.client import Wanted

    wanted = {"scores": Wanted(scores=True)} if reward else {
        "logprobs": Wanted(logprobs=True), "topk20": Wanted(topk=20)}
    return {f"{mode} {name}": (lambda c=c, w=w: c.submit(seqs, w).result())
            for mode, c in clients.items() for name, w in wanted.items()}


def bench_shape(shape: str, workloads: list[str], args, rows: list) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from logitserve.client import TeacherClient
    from logitserve.demo import demo_dir

    device, dtype = args.device, getattr(torch, DTYPES[args.dtype])
    groups = [(k, w) for k in ("causal",) for w in workloads if w != "64x128"]
    if "64x128" in workloads:
        groups.append(("reward", "64x128"))
    for kind in ("causal", "reward"):
        todo = [w for k, w in groups if k == kind]
        if not todo:
            continue
        model_dir = demo_dir(kind, shape)
        auto = AutoModelForCausalLM if kind == "causal" else AutoModelForSequenceClassification
        model = auto.from_pretrained(model_dir, dtype=dtype).eval().to(device)
        servers = {mode: start_server("--demo", kind, "--demo-shape", shape, "--batching", mode, "--dtype",
                                      args.dtype, "--device", device, *args.server_args.split())
                   for mode in ("exact", "packed")}
        try:
            clients = {mode: TeacherClient(address) for mode, (_, address) in servers.items()}
            for w in todo:
                lengths = workload_lengths(w)
                rng = np.random.default_rng(0)
                seqs = [rng.integers(3, 32000, n) for n in lengths]
                cases = {**floor_cases(model, seqs, device, reward=kind == "reward"),
                         **served_cases(clients, seqs, reward=kind == "reward")}
                for name, runs in interleaved(cases, args.repeats).items():
                    med = statistics.median(runs)
                    rows.append({"shape": shape, "kind": kind, "workload": w, "case": name, "median_s": med,
                                 "tokens_per_s": sum(lengths) / med, "runs_s": runs, "tokens": sum(lengths)})
                    print(f"{shape:>5} {w:>6} {name:<22} {med:8.3f} s  {sum(lengths) / med:10,.0f} tok/s", flush=True)
            for c in clients.values():
                c.close()
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(60)
        del model


def ratios(rows: list) -> list[dict]:
    """Served / floor for every (shape, workload, output), from the same run."""
    out = []
    by = {(r["shape"], r["workload"], r["case"]): r for r in rows}
    for (shape, w, case), r in by.items():
        if not case.startswith("floor"):
            mode, output = case.split(" ", 1)
            floor = by.get((shape, w, "floor" if output == "scores" else f"floor {output}"))
            if floor:
                out.append({"shape": shape, "workload": w, "output": output, "mode": mode,
                            "tokens_per_s": r["tokens_per_s"], "vs_floor": r["tokens_per_s"] / floor["tokens_per_s"]})
    return out


def markdown(result: dict) -> str:
    lines = [f"{result['date']} | {result['machine']} | {result['note']}", "",
             "| shape | workload | output | floor tok/s | exact tok/s | packed tok/s | exact / floor | packed / floor |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    by = {(r["shape"], r["workload"], r["case"]): r for r in result["rows"]}
    for shape, w, output in dict.fromkeys((r["shape"], r["workload"], r["output"]) for r in result["ratios"]):
        floor = by[(shape, w, "floor" if output == "scores" else f"floor {output}")]["tokens_per_s"]
        ex = by.get((shape, w, f"exact {output}"), {}).get("tokens_per_s")
        pk = by.get((shape, w, f"packed {output}"), {}).get("tokens_per_s")
        lines.append(f"| {shape} | {w} | {output} | {floor:,.0f} | {ex:,.0f} | {pk:,.0f} | {ex / floor:.2f} | "
                     f"{pk / floor:.2f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="demo,body")
    p.add_argument("--workloads", default="8x512,64x64,mixed,64x128",
                   help="64x128 is the reward-score workload (body-heavy reward model)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--server-args", default="", help="more `logitserve serve` flags for both servers, e.g. "
                   "--server-args=\"--step-target-ms 0\"")
    args = p.parse_args()

    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    rows: list = []
    for shape in args.shapes.split(","):
        workloads = args.workloads.split(",")
        if shape == "demo":   # the reward workload is for the body-heavy model
            workloads = [w for w in workloads if w != "64x128"]
        bench_shape(shape, workloads, args, rows)
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else ""
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} {gpu}".strip(),
        "note": f"{args.device} {args.dtype}, median of {args.repeats}, mixed = 12 lengths in 16..1024",
        "rows": rows, "ratios": ratios(rows),
    }
    out = write_result(result, "batching")
    print(markdown(result))
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
