"""Turns a bench result (bench/results/*.json) into the markdown tables of the README: figures, then targets."""
from __future__ import annotations

import json
import sys


def _find(rows, group, case):
    return next((r for r in rows if r["group"] == group and r["case"] == case), None)


def _ratio(a, b):
    return None if a is None or b is None else a["tokens_per_s"] / b["tokens_per_s"]


def targets(result: dict) -> list[tuple[str, float | None, str, bool | None]]:
    rows, g = result["rows"], "logitserve gRPC"
    s = lambda case: _find(rows, g, case)
    ip = lambda case: _find(rows, "in-process", case)
    off = lambda k: _find(rows, "vLLM offline", f"prompt_logprobs k={k}")
    srv = lambda k: _find(rows, "vLLM server", f"prompt_logprobs k={k}")
    full = s("full logits bf16")
    full_gbs = None if full is None else full["tokens_per_s"] * 32000 * 2 / 1e9
    checks = [
        ("token logprobs / floor", _ratio(s("logprobs"), ip("floor: logprobs (forward + logsumexp/gather)")), ">= 0.95", 0.95),
        ("top-k k=20 / floor", _ratio(s("topk k=20 fp32"), ip("floor: topk k=20 (forward + topk)")), ">= 0.95", 0.95),
        ("top-k k=20 / vLLM offline k=20", _ratio(s("topk k=20 fp32"), off(20)), ">= 1.0", 1.0),
        ("top-k k=20 / vLLM server k=20", _ratio(s("topk k=20 fp32"), srv(20)), ">= 2", 2.0),
        ("top-k k=100 / vLLM server k=100", _ratio(s("topk k=100 fp32"), srv(100)), ">= 5", 5.0),
        ("full logits bf16 GB/s / raw gRPC GB/s", None if full_gbs is None else full_gbs / result["raw_stream_gb_s"],
         ">= 0.5", 0.5),
        ("stretch: top-k k=20 / forward only", _ratio(s("topk k=20 fp32"), ip("forward only (logits, nothing else)")), ">= 0.85", 0.85),
        ("stretch: token logprobs / forward only", _ratio(s("logprobs"), ip("forward only (logits, nothing else)")), ">= 0.85", 0.85),
    ]
    out = [(name, value, bound, None if value is None else value >= limit) for name, value, bound, limit in checks]
    wb = s("topk k=20 bf16")
    out.append(("wire bytes/token, top-k k=20 bf16", None if wb is None else wb["wire_bytes_per_token"], "<= 125",
                None if wb is None else wb["wire_bytes_per_token"] <= 125))
    return out


def markdown(result: dict) -> str:
    lines = [f"{result['date']} | {result['machine']} | {result['workload']}", "",
             "| group | case | median s | tokens/s | wire bytes/token |", "|---|---|---:|---:|---:|"]
    for r in result["rows"]:
        wb = r.get("wire_bytes_per_token")
        lines.append(f"| {r['group']} | {r['case']} | {r['median_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                     f"{'' if wb is None else f'{wb:,.1f}'} |")
    lines += ["", f"raw gRPC loopback ceiling: {result['raw_stream_gb_s']:.2f} GB/s; "
                  f"server peak RSS {result['server_peak_rss_gib']:.2f} GiB",
              "", "| concurrent clients | requests | p50 ms | p99 ms |", "|---:|---:|---:|---:|"]
    for n, v in result["latency_topk20_bf16_1x512"].items():
        lines.append(f"| {n} | {v['n']} | {v['p50_ms']:.0f} | {v['p99_ms']:.0f} |")
    lines += ["", "| target | measured | bound | met |", "|---|---:|---|---|"]
    for name, value, bound, ok in targets(result):
        lines.append(f"| {name} | {'n/a' if value is None else f'{value:.2f}'} | {bound} | "
                     f"{'n/a' if ok is None else ('yes' if ok else 'no')} |")
    if result.get("vllm_note"):
        lines += ["", result["vllm_note"]]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(json.loads(open(sys.argv[1]).read())))
