"""The reward group as OpenRLHF sends it: one prompt, G responses, text in, over HTTP /get_reward, against the floor.

`python bench/reward_http.py [--G 8 --P 1024 --R 128 --repeats 5]` starts `logitserve serve --demo reward
--http-port 0` (sharing on, the default --min-shared-prefix, and off with 0) and times, interleaved, medians of
--repeats:
- the in-process floor: one batched transformers sequence-classification forward of the [G, P+R] ids (the
  tokenizing not counted);
- POST /get_reward with the G queries in one body (OpenRLHF's remote_rm_fn batch), text in: the server
  tokenizes, schedules and scores;
- G concurrent POST /get_reward of one query each (OpenRLHF 0.11.2's single-turn executor).
It prints floor / served for each (the target: >= 2.5x on a body-heavy model, which needs the prompt computed
once) and writes bench/results/reward_http-<time>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from run import interleaved, write_result  # noqa: E402


def start_http(*extra: str) -> tuple[subprocess.Popen, str]:
    """`logitserve serve --http-port 0` as a user starts it; (process, base URL)."""
    cmd = [sys.executable, "-m", "logitserve.server.cli", "serve", "--host", "127.0.0.1", "--port", "0",
           "--http-port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        m = re.search(r"logitserve: serving .* \(HTTP on port (\d+)\)", line)
        if m:
            return proc, f"http://127.0.0.1:{m.group(1)}"
    raise RuntimeError("server did not start")


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--P", type=int, default=1024, help="prompt words (one token each in the demo tokenizer)")
    p.add_argument("--R", type=int, default=128, help="response words")
    p.add_argument("--model-shape", default="body")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    import torch
    from transformers import AutoModelForSequenceClassification

    from logitserve.demo import demo_dir

    directory = demo_dir("reward", args.model_shape)
    model = AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 32000, args.P)
    seqs = [np.concatenate([[1], prompt, rng.integers(3, 32000, args.R)]) for _ in range(args.G)]
    queries = ["<s> " + " ".join(f"t{x}" for x in s[1:]) for s in seqs]     # decoded with the special tokens kept
    ids = torch.as_tensor(np.stack(seqs))

    @torch.inference_mode()
    def floor():
        return model(ids).logits.float()

    common = ("--demo", "reward", "--demo-shape", args.model_shape)
    servers = {"shared": start_http(*common), "unshared": start_http(*common, "--min-shared-prefix", "0")}
    pool = ThreadPoolExecutor(args.G)
    try:
        want = floor()[:, -1].double().numpy()
        cases = {"floor": floor}
        for mode, (_, base) in servers.items():
            url = base + "/get_reward"
            got = post(url, {"query": queries, "prompts": [""] * args.G, "labels": [""] * args.G})["rewards"]
            print(f"{mode}: max |reward - floor| = {np.abs(np.asarray(got) - want).max():.2e}", flush=True)
            cases[f"{mode} batch"] = lambda u=url: post(u, {"query": queries})
            cases[f"{mode} {args.G} concurrent"] = \
                lambda u=url: list(pool.map(lambda q: post(u, {"query": [q]}), queries))
        runs = interleaved(cases, args.repeats)
    finally:
        pool.shutdown()
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)
    med = {name: statistics.median(r) for name, r in runs.items()}
    rows = [{"case": name, "median_s": m, "runs_s": runs[name], "floor_over_case": med["floor"] / m}
            for name, m in med.items()]
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
              "note": f"cpu fp32, {args.model_shape} reward demo, G={args.G} P={args.P} R={args.R}, "
                      f"median of {args.repeats}", "rows": rows}
    out = write_result(result, "reward_http")
    print(f"| case | median s | floor / case |\n|---|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['median_s']:.3f} | {r['floor_over_case']:.2f} |")
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
