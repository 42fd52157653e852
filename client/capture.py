"""Offline capture of a teacher's top-k for a whole dataset into shards, resumable, and the safetensors reader.

Input: jsonl, one sample per line, `{"ids": [...]}` (or `input_ids`) or `{"text": "..."}` for
the server to tokenize; an ids sample may carry `"prompt_length": P` (TRL's meaning: the first P
tokens are context), and then only the predictions of tokens P..L-1 are captured (L - P rows, row j
predicting token P + j). Samples [i*S, (i+1)*S) make shard i: `shard-00000.safetensors` with
`input_ids` [N] int32, `topk_values` [M, k] (fp32, or bf16 stored as its uint16 bits),
`topk_ids` [M, k] int32, `topk_tail` [M] fp32, `logprobs` [M] fp32 (with --logprobs),
`offsets` [n + 1] int64 (sample j's ids are offsets[j]:offsets[j+1]), `row_offsets` [n + 1] (its
output rows; equal to offsets when no sample has a prompt length), `prompt_lengths` [n] (0: none)
and `sample_index` [n].
A shard is written to a temporary name and renamed, so it exists whole or not at all; a
rerun skips the shards present (after checking the manifest names the same teacher, input
and request). Against a teacher serving `--batching exact` a resumed capture equals an
uninterrupted one byte for byte; under `packed`, values agree within the packed bound.
With `format` axolotl, distillkit or hf the shards are `shard-00000.parquet` in that trainer's layout
(capture_formats.py, docs/capture.md), written, skipped on a rerun and checked against the manifest the same way.
Needs numpy, safetensors, pyarrow and tqdm (`pip install logitserve[capture]`); no torch.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from . import capture_formats as formats
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
    format: str = "safetensors"    # shards on disk: safetensors | axolotl | distillkit | hf (parquet)


def _samples(path: Path, keep_extras: bool = False) -> tuple[list, list, list]:
    """(samples, prompt lengths, extras): ids arrays or texts, each one's prompt_length or None, and with
    `keep_extras` each row's other fields (e.g. `messages`, which the axolotl and hf formats carry over)."""
    out, prompts, extras = [], [], []
    with open(path) as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            row = json.loads(line)
            if "text" in row:
                if "prompt_length" in row:
                    raise ValueError(f"{path}:{n + 1}: prompt_length counts tokens: give 'ids' with it, not 'text'")
                out.append(str(row["text"]))
            elif "ids" in row or "input_ids" in row:
                out.append(np.asarray(row.get("ids", row.get("input_ids")), dtype=np.int64))
            else:
                raise ValueError(f"{path}:{n + 1}: a sample needs 'ids', 'input_ids' or 'text'")
            P = row.get("prompt_length")
            if P is not None and (not isinstance(P, int) or not 1 <= P <= len(out[-1])):
                raise ValueError(f"{path}:{n + 1}: prompt_length {P!r} must be an integer in [1, {len(out[-1])}]")
            prompts.append(P)
            extras.append({k: v for k, v in row.items() if k not in ("ids", "input_ids", "text", "prompt_length")}
                          if keep_extras else {})
    return out, prompts, extras


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
    old.get("request", {}).setdefault("format", "safetensors")       # captures from before --format
    for key in ("format", "input", "teacher", "request"):
        if old.get(key) != manifest[key]:
            raise ValueError(f"{out} holds a capture of another {key} ({old.get(key)} != {manifest[key]}): "
                             f"use another --out or remove it")


def _shard_tensors(results: list, samples_ids: list, first: int, cfg: CaptureConfig, prompts: list) -> dict:
    ids = np.concatenate(samples_ids).astype(np.int32)
    rows = [len(x) - (P or 0) for x, P in zip(samples_ids, prompts)]
    vals = np.concatenate([v for r in results for v in r.topk_values]).astype(np.float32)
    tensors = {
        "input_ids": ids,
        "topk_values": formats.bf16_bits(vals) if cfg.dtype == "bf16" else vals,
        "topk_ids": np.concatenate([i for r in results for i in r.topk_ids]).astype(np.int32),
        "topk_tail": np.concatenate([t for r in results for t in r.topk_tail]).astype(np.float32),
        "offsets": np.concatenate([[0], np.cumsum([len(x) for x in samples_ids])]).astype(np.int64),
        "row_offsets": np.concatenate([[0], np.cumsum(rows)]).astype(np.int64),
        "prompt_lengths": np.asarray([P or 0 for P in prompts], dtype=np.int64),
        "sample_index": np.arange(first, first + len(samples_ids), dtype=np.int64),
    }
    if cfg.logprobs:
        tensors["logprobs"] = np.concatenate([lp for r in results for lp in r.logprobs]).astype(np.float32)
    return tensors


def _batches(chunk: list, prompts: list, size: int) -> list[tuple[list, list]]:
    """Requests of up to `size` consecutive samples, each all ids or all texts (a request carries one or the
    other) and all with or all without a prompt length: (samples, prompt lengths) each."""
    out: list[tuple[list, list]] = []
    kind = lambda x, P: (isinstance(x, str), P is None)                                      # noqa: E731
    for x, P in zip(chunk, prompts):
        if out and len(out[-1][0]) < size and kind(out[-1][0][0], out[-1][1][0]) == kind(x, P):
            out[-1][0].append(x)
            out[-1][1].append(P)
        else:
            out.append(([x], [P]))
    return out


def capture(teacher, input_path, out, cfg: CaptureConfig = CaptureConfig(), progress: bool = True) -> dict:
    """Capture every sample of `input_path` into shards under `out`; returns the manifest."""
    from tqdm import tqdm

    formats.check_format(cfg.format, cfg.temperature, cfg.dtype)
    input_path, out = Path(input_path), Path(out)
    samples, prompts, extras = _samples(input_path, keep_extras=cfg.format in formats.PASSTHROUGH)
    info = teacher.model_info()
    manifest = _manifest(info, cfg, input_path, len(samples))
    out.mkdir(parents=True, exist_ok=True)
    _check_resumable(out, manifest)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    if cfg.format == "distillkit":
        (out / formats.DISTILLKIT_CONFIG).write_text(formats.distillkit_config(info.vocab_size, cfg.topk, cfg.dtype))
    wanted = Wanted(temperature=cfg.temperature, logprobs=cfg.logprobs, topk=cfg.topk, topk_as_logprobs=True,
                    topk_tail=True)
    bar = tqdm(total=len(samples), unit="sample", disable=not progress, dynamic_ncols=True)
    with ThreadPoolExecutor(1, thread_name_prefix="capture-write") as writer:
        _shards(teacher, out, cfg, manifest, samples, prompts, extras, info, wanted, bar, writer)
    bar.close()
    return manifest


def _shards(teacher, out, cfg, manifest, samples, prompts, extras, info, wanted, bar, writer) -> None:
    """Ask for and write each missing shard; shard s is written on `writer` while shard s+1 is asked for."""
    tokens, written = 0, None
    for s in range(manifest["shards"]):
        first = s * cfg.shard_samples
        chunk = samples[first : first + cfg.shard_samples]
        chunk_prompts = prompts[first : first + cfg.shard_samples]
        path = out / f"shard-{s:05d}.{'safetensors' if cfg.format == 'safetensors' else 'parquet'}"
        if path.exists():                              # finished by an earlier run
            bar.update(len(chunk))
            continue
        batches = _batches(chunk, chunk_prompts, cfg.batch_samples)
        results: list = []
        pending: list[Future] = []
        for b, bp in batches:                          # at most in_flight requests on the stream
            w = wanted if bp[0] is None else dataclasses.replace(wanted, prompt_lengths=bp)
            pending.append(teacher.submit(b, w))
            if len(pending) >= cfg.in_flight:
                results.append(pending.pop(0).result())
        results += [f.result() for f in pending]
        ids = [r.input_ids[j] if r.input_ids is not None else np.asarray(b[j])
               for r, (b, _) in zip(results, batches) for j in range(len(b))]
        tensors = _shard_tensors(results, ids, first, cfg, chunk_prompts)
        if written is not None:
            written.result()                           # at most one shard waits to be written
        written = writer.submit(_write_shard, path, tensors, cfg, chunk_prompts,
                                extras[first : first + cfg.shard_samples], info.vocab_size)
        tokens += sum(len(x) for x in ids)
        bar.update(len(chunk))
        bar.set_postfix(tok_s=f"{tokens / max(bar.format_dict['elapsed'], 1e-9):,.0f}")
    if written is not None:
        written.result()


def _write_shard(path: Path, tensors: dict, cfg: CaptureConfig, prompts: list, extras: list, vocab_size: int) -> None:
    if cfg.format == "safetensors":
        _save_safetensors(path, tensors, cfg)
    else:
        formats.write_shard(path, formats.shard_table(cfg.format, tensors, prompts, extras, cfg, vocab_size))


def _save_safetensors(path: Path, tensors: dict, cfg: CaptureConfig) -> None:
    from safetensors.numpy import save_file

    tmp = path.with_suffix(".tmp")
    # one metadata key: safetensors writes its metadata map in no fixed order, and shards must be byte-stable
    save_file(tensors, str(tmp), metadata={"format": f"{FORMAT}/{cfg.dtype}"})
    os.replace(tmp, path)


@dataclass
class CapturedSample:
    index: int
    input_ids: np.ndarray          # [L] int32
    topk_values: np.ndarray        # [L, k] float32 (bf16 captures widened exactly)
    topk_ids: np.ndarray           # [L, k] int32
    topk_tail: np.ndarray          # [L] float32
    logprobs: Optional[np.ndarray] = None
    prompt_length: Optional[int] = None   # with one, the outputs have L - P rows (row j predicts token P + j)


def read_capture(directory) -> Iterator[CapturedSample]:
    """The captured samples in input order, shard by shard (one shard in memory at a time)."""
    from safetensors.numpy import load_file

    directory = Path(directory)
    manifest = json.loads((directory / "manifest.json").read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{directory}: not a {FORMAT} capture")
    if manifest["request"].get("format", "safetensors") != "safetensors":
        raise ValueError(f"{directory}: a --format {manifest['request']['format']} capture (parquet): read it with "
                         f"its trainer or datasets.load_dataset (docs/capture.md)")
    bf16 = manifest["request"]["dtype"] == "bf16"
    for s in range(manifest["shards"]):
        path = directory / f"shard-{s:05d}.safetensors"
        if not path.exists():
            raise FileNotFoundError(f"{path}: capture incomplete; rerun the capture to finish it")
        t = load_file(str(path))
        vals = (t["topk_values"].astype(np.uint32) << 16).view(np.float32) if bf16 else t["topk_values"]
        o = t["offsets"]
        ro = t.get("row_offsets", o)                   # captures from before prompt lengths: rows = ids
        prompts = t.get("prompt_lengths", np.zeros(len(t["sample_index"]), np.int64))
        for j, index in enumerate(t["sample_index"]):
            r = slice(ro[j], ro[j + 1])
            yield CapturedSample(int(index), t["input_ids"][o[j] : o[j + 1]], vals[r], t["topk_ids"][r],
                                 t["topk_tail"][r], t["logprobs"][r] if "logprobs" in t else None,
                                 int(prompts[j]) or None)


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
        r = teacher.forward([c.input_ids], temperature=cfg["temperature"], topk=cfg["topk"], topk_as_logprobs=True,
                            prompt_lengths=None if c.prompt_length is None else [c.prompt_length])
        tol = atol + (np.abs(r.topk_values[0]) * 2.0 ** -8 if cfg["dtype"] == "bf16" else 0.0)
        diff = np.abs(r.topk_values[0] - c.topk_values)
        worst = max(worst, float(diff.max(initial=0.0)))
        if (diff > tol).any():
            raise ValueError(f"sample {c.index}: captured top-k differs from the live teacher by {diff.max():.3g}")
    return worst
