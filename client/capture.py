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
import re
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


@dataclass(frozen=True)
class Inputs:
    """The input file's samples, each with its prompt length (or None), its other fields, and its line."""

    samples: list                  # int64 [L] ids arrays or texts
    prompts: list
    extras: list                   # each row's other fields (kept for the axolotl and hf formats), else {}
    lines: list                    # each sample's line number in the file (1-based)


def _row_sample(row: dict, where: str):
    """A row's ids (int64 [L]) or text, checked by type: no null text, no float or boolean ids."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a JSON object per line is needed, got {type(row).__name__}")
    if "text" in row:
        if "prompt_length" in row:
            raise ValueError(f"{where}: prompt_length counts tokens: give 'ids' with it, not 'text'")
        if not isinstance(row["text"], str) or not row["text"]:
            raise ValueError(f"{where}: text must be a non-empty string, got {row['text']!r:.40}")
        return row["text"]
    if "ids" in row or "input_ids" in row:
        ids = row.get("ids", row.get("input_ids"))
        if not isinstance(ids, list) or not ids:
            raise ValueError(f"{where}: ids must be a non-empty list of token ids")
        bad = next((j for j, x in enumerate(ids) if type(x) is not int), None)
        if bad is not None:
            raise ValueError(f"{where}: ids[{bad}] = {ids[bad]!r:.40} is not an integer token id")
        return np.asarray(ids, dtype=np.int64)
    raise ValueError(f"{where}: a sample needs 'ids', 'input_ids' or 'text'")


def _samples(path: Path, keep_extras: bool = False) -> Inputs:
    """Every sample of the jsonl file, each row checked by type; a bad row's error names the file and line."""
    got = Inputs([], [], [], [])
    with open(path) as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            where = f"{path}:{n + 1}"
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
            sample = _row_sample(row, where)
            P = row.get("prompt_length")
            if P is not None and (type(P) is not int or not 1 <= P <= len(sample)):
                raise ValueError(f"{where}: prompt_length {P!r} must be an integer in [1, {len(sample)}]")
            got.samples.append(sample)
            got.prompts.append(P)
            got.lines.append(n + 1)
            got.extras.append({k: v for k, v in row.items() if k not in ("ids", "input_ids", "text", "prompt_length")}
                              if keep_extras else {})
    return got


def _check_ids(inputs: Inputs, path: Path, vocab_size: int, max_length: int) -> None:
    """Token ids inside the teacher's vocabulary, sequences within its length, before anything is asked or written
    (the file and line named)."""
    for sample, line in zip(inputs.samples, inputs.lines):
        if not isinstance(sample, str) and max_length and len(sample) > max_length:
            raise ValueError(f"{path}:{line}: {len(sample)} ids is over the teacher's max_sequence_length "
                             f"{max_length}")
        if not isinstance(sample, str) and (sample.min() < 0 or sample.max() >= vocab_size):
            bad = int(np.flatnonzero((sample < 0) | (sample >= vocab_size))[0])
            raise ValueError(f"{path}:{line}: ids[{bad}] = {int(sample[bad])} is outside the teacher's vocabulary "
                             f"[0, {vocab_size})")


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


def _check_resumable(out: Path, manifest: dict) -> dict:
    """The checksums of the shards an earlier run of the same capture wrote (ValueError for another capture's
    folder, or shards without a manifest)."""
    path = out / "manifest.json"
    if not path.exists():
        shards = sorted(p.name for p in out.glob("shard-*"))
        if shards:
            raise ValueError(f"{out} holds shards ({', '.join(shards[:3])}{', ...' if len(shards) > 3 else ''}) and no "
                             f"manifest.json: they may be another capture's; use another --out or remove them")
        return {}
    old = json.loads(path.read_text())
    old.get("request", {}).setdefault("format", "safetensors")       # captures from before --format
    for key in ("format", "input", "teacher", "request"):
        if old.get(key) != manifest[key]:
            raise ValueError(f"{out} holds a capture of another {key} ({old.get(key)} != {manifest[key]}): "
                             f"use another --out or remove it")
    return dict(old.get("checksums", {}))


def _write_manifest(out: Path, manifest: dict) -> None:
    """manifest.json under a temporary name, then renamed: whole or not at all."""
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    os.replace(tmp, out / "manifest.json")


def verify_checksums(directory) -> int:
    """Every shard the manifest lists against its checksum (ValueError naming a corrupted or missing one); the
    number checked. read_capture and `logitserve capture --verify` call it."""
    directory = Path(directory)
    manifest = json.loads((directory / "manifest.json").read_text())
    for name, digest in sorted(manifest.get("checksums", {}).items()):
        path = directory / name
        if not path.exists():
            raise ValueError(f"{path}: listed in the manifest but missing; rerun the capture to write it")
        if _file_hash(path) != digest:
            raise ValueError(f"{path}: checksum {_file_hash(path)} differs from the manifest's {digest}: the shard is "
                             f"corrupted; remove it and rerun the capture to write it again")
    return len(manifest.get("checksums", {}))


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
    """Requests of up to `size` consecutive (sample, line) pairs, each all ids or all texts (a request carries one
    or the other) and all with or all without a prompt length: (pairs, prompt lengths) each."""
    out: list[tuple[list, list]] = []
    kind = lambda x, P: (isinstance(x[0], str), P is None)                                   # noqa: E731
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
    inputs = _samples(input_path, keep_extras=cfg.format in formats.PASSTHROUGH)
    schema = formats.extras_schema(inputs.extras, input_path) if cfg.format in formats.PASSTHROUGH else None
    info = teacher.model_info()
    _check_ids(inputs, input_path, info.vocab_size, info.max_sequence_length)
    manifest = _manifest(info, cfg, input_path, len(inputs.samples))
    out.mkdir(parents=True, exist_ok=True)
    manifest["checksums"] = _check_resumable(out, manifest)
    _write_manifest(out, manifest)
    if cfg.format == "distillkit":
        (out / formats.DISTILLKIT_CONFIG).write_text(formats.distillkit_config(info.vocab_size, cfg.topk, cfg.dtype))
    wanted = Wanted(temperature=cfg.temperature, logprobs=cfg.logprobs, topk=cfg.topk, topk_as_logprobs=True,
                    topk_tail=True)
    bar = tqdm(total=len(inputs.samples), unit="sample", disable=not progress, dynamic_ncols=True)
    run = _Run(teacher, out, input_path, cfg, manifest, inputs, schema, info, wanted, bar)
    with ThreadPoolExecutor(1, thread_name_prefix="capture-write") as writer:
        run.shards(writer)
    bar.close()
    return {**manifest, "run": {"captured": run.captured, "skipped": run.skipped}}


def _batch_error(e: Exception, path: Path, lines: list):
    """A server's refusal of a batch, naming the input file and line of the sequence it names (`sequences[j]`)."""
    from .errors import LogitServeError

    details = getattr(e, "details", str(e))
    m = re.match(r"(sequences|texts)\[(\d+)\]", details)
    if m and int(m.group(2)) < len(lines):     # the sample's own line, its place in the batch left out
        where, details = f"{path}:{lines[int(m.group(2))]}", details[m.end():].lstrip(" :")
    else:
        where = f"{path}:{lines[0]}-{lines[-1]}"
    if isinstance(e, LogitServeError):
        return LogitServeError(e.code, f"{where}: {details}")
    return type(e)(f"{where}: {details}")


class _Run:
    """One run of a capture: each missing shard asked for and written, the checksums kept in the manifest."""

    def __init__(self, teacher, out, input_path, cfg, manifest, inputs, schema, info, wanted, bar):
        self.teacher, self.out, self.input_path, self.cfg, self.manifest = teacher, out, input_path, cfg, manifest
        self.inputs, self.schema, self.info, self.wanted, self.bar = inputs, schema, info, wanted, bar
        self.captured = self.skipped = 0

    def _present(self, path: Path) -> bool:
        """Whether an earlier run's shard stands: its checksum checked (ValueError naming a corrupted one); a shard
        whose checksum was never recorded (a run stopped between its rename and the manifest) is written again."""
        if not path.exists():
            return False
        digest = self.manifest["checksums"].get(path.name)
        if digest is None:
            path.unlink()
            return False
        if _file_hash(path) != digest:
            raise ValueError(f"{path}: checksum differs from the manifest's ({digest}): the shard is corrupted; "
                             f"remove it and rerun the capture to write it again")
        return True

    def _ask(self, chunk: list, chunk_prompts: list, lines: list) -> tuple[list, list]:
        """(results, the batches asked): at most in_flight requests on the stream."""
        batches = _batches(list(zip(chunk, lines)), chunk_prompts, self.cfg.batch_samples)
        results: list = []
        pending: list[tuple[Future, list]] = []

        def take():
            f, ls = pending.pop(0)
            try:
                results.append(f.result())
            except Exception as e:       # noqa: BLE001 (the server's refusal, named by file and line)
                raise _batch_error(e, self.input_path, ls) from None
        for b, bp in batches:
            w = self.wanted if bp[0] is None else dataclasses.replace(self.wanted, prompt_lengths=bp)
            pending.append((self.teacher.submit([x for x, _ in b], w), [n for _, n in b]))
            if len(pending) >= self.cfg.in_flight:
                take()
        while pending:
            take()
        return results, [[x for x, _ in b] for b, _ in batches]

    def shards(self, writer) -> None:
        """Ask for and write each missing shard; shard s is written on `writer` while shard s+1 is asked for."""
        cfg, inputs, tokens, written = self.cfg, self.inputs, 0, None
        for s in range(self.manifest["shards"]):
            first = s * cfg.shard_samples
            cut = slice(first, first + cfg.shard_samples)
            chunk, chunk_prompts = inputs.samples[cut], inputs.prompts[cut]
            path = self.out / f"shard-{s:05d}.{'safetensors' if cfg.format == 'safetensors' else 'parquet'}"
            if self._present(path):                        # finished by an earlier run
                self.skipped += len(chunk)
                self.bar.update(len(chunk))
                continue
            results, batches = self._ask(chunk, chunk_prompts, inputs.lines[cut])
            ids = [r.input_ids[j] if r.input_ids is not None else np.asarray(b[j])
                   for r, b in zip(results, batches) for j in range(len(b))]
            tensors = _shard_tensors(results, ids, first, cfg, chunk_prompts)
            if written is not None:
                written.result()                           # at most one shard waits to be written
            written = writer.submit(self._write, path, tensors, chunk_prompts, inputs.extras[cut])
            tokens += sum(len(x) for x in ids)
            self.captured += len(chunk)
            self.bar.update(len(chunk))
            self.bar.set_postfix(tok_s=f"{tokens / max(self.bar.format_dict['elapsed'], 1e-9):,.0f}")
        if written is not None:
            written.result()

    def _write(self, path: Path, tensors: dict, prompts: list, extras: list) -> None:
        cfg = self.cfg
        if cfg.format == "safetensors":
            _save_safetensors(path, tensors, cfg)
        else:
            table = formats.shard_table(cfg.format, tensors, prompts, extras, cfg, self.info.vocab_size, self.schema)
            formats.write_shard(path, table)
        self.manifest["checksums"][path.name] = _file_hash(path)
        _write_manifest(self.out, self.manifest)


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
    verify_checksums(directory)
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
