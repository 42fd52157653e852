"""Offline capture of a teacher's top-k for a whole dataset into safetensors shards, resumable, and their reader.

Input: jsonl, one sample per line, `{"ids": [...]}` (or `input_ids`) or `{"text": "..."}` for
the server to tokenize. Samples [i*S, (i+1)*S) make shard i: `shard-00000.safetensors` with
`input_ids` [N] int32, `topk_values` [N, k] (fp32, or bf16 stored as its uint16 bits),
`topk_ids` [N, k] int32, `topk_tail` [N] fp32, `logprobs` [N] fp32 (with --logprobs),
`offsets` [n + 1] int64 (sample j is rows offsets[j]:offsets[j+1]) and `sample_index` [n].
A shard is written to a temporary name and renamed, so it exists whole or not at all; a
rerun skips the shards present (after checking the manifest names the same teacher, input
and request). Against a teacher serving `--batching exact` a resumed capture equals an
uninterrupted one byte for byte; under `packed`, values agree within the packed bound.
Needs numpy, safetensors and tqdm (`pip install logitserve[capture]`); no torch.
"""
from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from .wire import Wanted

FORMAT = "logitserve-capture-v1"


@dataclass(frozen=True)
class CaptureConfig:
    topk: int = 64
    logprobs: bool = False
    dtype: str = "fp32"            # topk values on disk: fp32 | bf16
    temperature: float = 1.0
    shard_samples: int = 256       # samples per shard
    batch_samples: int = 16        # samples per request
    in_flight: int = 4             # requests on the stream at once


def _samples(path: Path) -> list:
    out = []
    with open(path) as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            row = json.loads(line)
            if "text" in row:
                out.append(str(row["text"]))
            elif "ids" in row or "input_ids" in row:
                out.append(np.asarray(row.get("ids", row.get("input_ids")), dtype=np.int64))
            else:
                raise ValueError(f"{path}:{n + 1}: a sample needs 'ids', 'input_ids' or 'text'")
    return out


def _file_hash(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return "blake2b:" + h.hexdigest()


def _manifest(info, cfg: CaptureConfig, input_path: Path, n_samples: int) -> dict:
    return {"format": FORMAT, "input": {"path": input_path.name, "hash": _file_hash(input_path), "samples": n_samples},
            "teacher": {"name": info.name, "content_hash": info.content_hash, "tokenizer_hash": info.tokenizer_hash,
                        "vocab_size": info.vocab_size, "batching": info.batching},
            "request": asdict(cfg), "shards": -(-n_samples // cfg.shard_samples)}


def _check_resumable(out: Path, manifest: dict) -> None:
    path = out / "manifest.json"
    if not path.exists():
        return
    old = json.loads(path.read_text())
    for key in ("format", "input", "teacher", "request"):
        if old.get(key) != manifest[key]:
            raise ValueError(f"{out} holds a capture of another {key} ({old.get(key)} != {manifest[key]}): "
                             f"use another --out or remove it")


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 (round to nearest even), as uint16 bits: numpy has no bfloat16."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _shard_tensors(results: list, samples_ids: list, first: int, cfg: CaptureConfig) -> dict:
    ids = np.concatenate(samples_ids).astype(np.int32)
    vals = np.concatenate([v for r in results for v in r.topk_values]).astype(np.float32)
    tensors = {
        "input_ids": ids,
        "topk_values": _bf16_bits(vals) if cfg.dtype == "bf16" else vals,
        "topk_ids": np.concatenate([i for r in results for i in r.topk_ids]).astype(np.int32),
        "topk_tail": np.concatenate([t for r in results for t in r.topk_tail]).astype(np.float32),
        "offsets": np.concatenate([[0], np.cumsum([len(x) for x in samples_ids])]).astype(np.int64),
        "sample_index": np.arange(first, first + len(samples_ids), dtype=np.int64),
    }
    if cfg.logprobs:
        tensors["logprobs"] = np.concatenate([lp for r in results for lp in r.logprobs]).astype(np.float32)
    return tensors


def _batches(chunk: list, size: int) -> list[list]:
    """Requests of up to `size` samples, each all ids or all texts (a request carries one or the other)."""
    out: list[list] = []
    for x in chunk:
        if out and len(out[-1]) < size and isinstance(out[-1][0], str) == isinstance(x, str):
            out[-1].append(x)
        else:
            out.append([x])
    return out


def capture(teacher, input_path, out, cfg: CaptureConfig = CaptureConfig(), progress: bool = True) -> dict:
    """Capture every sample of `input_path` into shards under `out`; returns the manifest."""
    from safetensors.numpy import save_file
    from tqdm import tqdm

    input_path, out = Path(input_path), Path(out)
    samples = _samples(input_path)
    manifest = _manifest(teacher.model_info(), cfg, input_path, len(samples))
    out.mkdir(parents=True, exist_ok=True)
    _check_resumable(out, manifest)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    wanted = Wanted(temperature=cfg.temperature, logprobs=cfg.logprobs, topk=cfg.topk, topk_as_logprobs=True,
                    topk_tail=True)
    bar = tqdm(total=len(samples), unit="sample", disable=not progress, dynamic_ncols=True)
    tokens = 0
    for s in range(manifest["shards"]):
        first = s * cfg.shard_samples
        chunk = samples[first : first + cfg.shard_samples]
        path = out / f"shard-{s:05d}.safetensors"
        if path.exists():                              # finished by an earlier run
            bar.update(len(chunk))
            continue
        batches = _batches(chunk, cfg.batch_samples)
        results: list = []
        pending: list[Future] = []
        for b in batches:                              # at most in_flight requests on the stream
            pending.append(teacher.submit(b, wanted))
            if len(pending) >= cfg.in_flight:
                results.append(pending.pop(0).result())
        results += [f.result() for f in pending]
        ids = [r.input_ids[j] if r.input_ids is not None else np.asarray(b[j])
               for r, b in zip(results, batches) for j in range(len(b))]
        tmp = path.with_suffix(".tmp")
        # one metadata key: safetensors writes its metadata map in no fixed order, and shards must be byte-stable
        save_file(_shard_tensors(results, ids, first, cfg), str(tmp), metadata={"format": f"{FORMAT}/{cfg.dtype}"})
        os.replace(tmp, path)
        tokens += sum(len(x) for x in ids)
        bar.update(len(chunk))
        bar.set_postfix(tok_s=f"{tokens / max(bar.format_dict['elapsed'], 1e-9):,.0f}")
    bar.close()
    return manifest


@dataclass
class CapturedSample:
    index: int
    input_ids: np.ndarray          # [L] int32
    topk_values: np.ndarray        # [L, k] float32 (bf16 captures widened exactly)
    topk_ids: np.ndarray           # [L, k] int32
    topk_tail: np.ndarray          # [L] float32
    logprobs: Optional[np.ndarray] = None


def read_capture(directory) -> Iterator[CapturedSample]:
    """The captured samples in input order, shard by shard (one shard in memory at a time)."""
    from safetensors.numpy import load_file

    directory = Path(directory)
    manifest = json.loads((directory / "manifest.json").read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{directory}: not a {FORMAT} capture")
    bf16 = manifest["request"]["dtype"] == "bf16"
    for s in range(manifest["shards"]):
        path = directory / f"shard-{s:05d}.safetensors"
        if not path.exists():
            raise FileNotFoundError(f"{path}: capture incomplete; rerun the capture to finish it")
        t = load_file(str(path))
        vals = (t["topk_values"].astype(np.uint32) << 16).view(np.float32) if bf16 else t["topk_values"]
        o = t["offsets"]
        for j, index in enumerate(t["sample_index"]):
            r = slice(o[j], o[j + 1])
            yield CapturedSample(int(index), t["input_ids"][r], vals[r], t["topk_ids"][r], t["topk_tail"][r],
                                 t["logprobs"][r] if "logprobs" in t else None)


def verify(teacher, directory, samples: int = 8, seed: int = 0, atol: float = 1e-5) -> float:
    """Re-ask the live teacher for a random sample of captured sequences; the largest difference found.

    Raises ValueError when a value differs by more than `atol` (bf16 captures: plus bf16 rounding)."""
    captured = list(read_capture(directory))
    manifest = json.loads((Path(directory) / "manifest.json").read_text())
    cfg = manifest["request"]
    if teacher.model_info().content_hash != manifest["teacher"]["content_hash"]:
        raise ValueError("the live teacher's weights differ from the captured one's (content_hash)")
    pick = np.random.default_rng(seed).choice(len(captured), size=min(samples, len(captured)), replace=False)
    worst = 0.0
    for i in pick:
        c = captured[int(i)]
        r = teacher.forward([c.input_ids], temperature=cfg["temperature"], topk=cfg["topk"], topk_as_logprobs=True)
        tol = atol + (np.abs(r.topk_values[0]) * 2.0 ** -8 if cfg["dtype"] == "bf16" else 0.0)
        diff = np.abs(r.topk_values[0] - c.topk_values)
        worst = max(worst, float(diff.max(initial=0.0)))
        if (diff > tol).any():
            raise ValueError(f"sample {c.index}: captured top-k differs from the live teacher by {diff.max():.3g}")
    return worst
