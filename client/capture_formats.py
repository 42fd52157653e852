"""Capture shards in the layouts trainers read (Axolotl KD v2 rows, DistillKit's compressed parquet, a Hugging Face
parquet dataset): one shard's served top-k, rearranged per the consumer's alignment; numpy + pyarrow, no torch.

Alignment (docs/capture.md). The server's top-k row at position t predicts token t+1 (SPEC.md); with a prompt
length P only the rows predicting tokens P..L-1 are served. A sample's *token rows* are the rows that predict a
token of the sample: tokens 1..L-1 without P (the last served row, past the end, is dropped), P..L-1 with P.
- axolotl: `logprobs` / `target_token_ids` [T][k] are the token rows, right-aligned to `input_ids` (row i is
  the distribution of token L-T+i), as Axolotl's ChatTemplateStrategyWithKDv2.transform_logprobs pads them.
- distillkit: L-1 rows left-aligned (row i predicts token i+1, vLLM's prompt logprobs less the first), as
  DistillKit's sample_logits writes them; with P the rows of tokens 1..P-1 were not asked and hold the fill
  (-inf, id 0), and `labels` is -100 on the first P tokens so that DistillKit's mask leaves them out.
- hf: every served row, as the safetensors shards hold them.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

import numpy as np


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 (round to nearest even), as uint16 bits: numpy has no bfloat16."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)

PARQUET_FORMATS = ("axolotl", "distillkit", "hf")
PASSTHROUGH = ("axolotl", "hf")               # formats that carry the input rows' other fields (e.g. messages)
DISTILLKIT_CONFIG = "compression_config.yaml"


def check_format(fmt: str, temperature: float, dtype: str) -> None:
    """ValueError naming the flag when a format cannot hold the asked capture."""
    if fmt == "safetensors":
        return
    if fmt not in PARQUET_FORMATS:
        raise ValueError(f"--format {fmt}: choose safetensors or one of {', '.join(PARQUET_FORMATS)}")
    if fmt == "distillkit" and temperature != 1.0:
        raise ValueError(f"--format distillkit: DistillKit reads offline logprobs as temperature 1 (its "
                         f"OfflineSignalSource); capture with --temperature 1, not {temperature:g}")
    if fmt in ("axolotl", "hf") and dtype != "fp32":
        raise ValueError(f"--format {fmt} stores float32 logprobs: --dtype {dtype} applies to safetensors and "
                         f"distillkit only")


def index_bits(vocab_size: int) -> int:
    """Bits per packed vocab index, as DistillKit computes them: ceil(log2(d)) in float32."""
    return int(math.ceil(float(np.log2(np.float32(vocab_size)))))


def pack_indices(ids: np.ndarray, bits: int) -> np.ndarray:
    """[n, k] ids -> [n, ceil(k*bits/8)] uint8: each id's `bits` low bits MSB first, back to back, zero-padded
    at the end of a row (DistillKit's bitpack.pack_to_bytes)."""
    n, k = ids.shape
    wide = ids.astype(">u8").view(np.uint8).reshape(n, k, 8)              # big-endian: MSB first
    b = np.unpackbits(wide, axis=-1)[..., 64 - bits:]                      # [n, k, bits]
    return np.packbits(b.reshape(n, k * bits), axis=-1)


def compress_logprobs(vals: np.ndarray, dtype: str) -> np.ndarray:
    """[n, k] descending logprobs -> [n, k * width] uint8: DistillKit's compress_monotonic_logprobs under the
    lossless config this module writes (exact_k = k, no delta encoding, no polynomial, no residual bins)."""

    exact = bf16_bits(vals) if dtype == "bf16" else vals.astype("<f4")
    return np.ascontiguousarray(exact).view(np.uint8).reshape(len(vals), -1)


def distillkit_config(vocab_size: int, k: int, dtype: str) -> str:
    """The DistributionQuantizationConfig (YAML) that decompresses these shards; DistillKit's `logprob_compressor`."""
    exact = "bfloat16" if dtype == "bf16" else "float32"
    return (f"d: {vocab_size}\nk: {k}\nexact_k: {k}\nexact_dtype: {exact}\npolynomial_terms: null\n"
            f"term_dtype: float32\nresidual_bins: []\ndelta_encoding: false\nerror_diffusion: false\n"
            f"normalize_t: false\n")


def _lists(flat: np.ndarray, counts, pa):
    """A list<...> array of len(counts) rows over `flat` (rows of `flat` are the list items)."""
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    if flat.ndim == 2:                                        # list<list<x>>: inner lists of equal width
        width = flat.shape[1]
        inner = pa.ListArray.from_arrays(np.arange(len(flat) + 1, dtype=np.int32) * width, pa.array(flat.reshape(-1)))
        return pa.ListArray.from_arrays(offsets, inner)
    return pa.ListArray.from_arrays(offsets, pa.array(flat))


def _token_rows(ro: np.ndarray, prompts: list, lengths: list) -> tuple[np.ndarray, list]:
    """Indices of every sample's token rows in the shard's row arrays, and their count per sample."""
    idx, counts = [], []
    for j, (P, L) in enumerate(zip(prompts, lengths)):
        stop = ro[j + 1] if P else ro[j] + max(L - 1, 0)        # without P the last row predicts past the end
        idx.append(np.arange(ro[j], stop))
        counts.append(int(stop - ro[j]))
    return np.concatenate(idx) if idx else np.zeros(0, np.int64), counts


def extras_schema(extras: list, path) -> dict:
    """One pyarrow type per extra input field for the whole capture, inferred from every row before anything is
    asked (a field absent or null in some rows is null there; ints beside floats are floats), so every shard of
    a capture has one schema and datasets.load_dataset reads them all; a field whose types conflict (a number in
    one row, a string in another) is a ValueError naming it and the file."""
    import pyarrow as pa

    out = {}
    for key in sorted({k for e in extras for k in e}):
        try:
            out[key] = pa.array([e.get(key) for e in extras]).type
        except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
            raise ValueError(f"{path}: input field {key!r} has conflicting types across rows ({err}); give it one "
                             f"type in every row (or leave it out) so every shard has one schema") from None
    return out


def shard_table(fmt: str, t: dict, prompts: list, extras: list, cfg, vocab_size: int, schema: Optional[dict] = None):
    """The pyarrow Table of one shard in `fmt`, from the safetensors tensors `t` of capture._shard_tensors; the
    extra input fields typed by `schema` (extras_schema: one for the whole capture)."""
    import pyarrow as pa

    o, ro = t["offsets"], t["row_offsets"]
    lengths = np.diff(o).tolist()
    vals = t["topk_values"]
    if cfg.dtype == "bf16":                                   # _shard_tensors stored the bits; widen exactly
        vals = (vals.astype(np.uint32) << 16).view(np.float32)
    cols: dict = {}
    if fmt == "hf":
        cols["sample_index"] = pa.array(t["sample_index"])
        cols["input_ids"] = _lists(t["input_ids"], lengths, pa)
        cols["prompt_length"] = pa.array([P for P in prompts], type=pa.int32())
        rows = np.diff(ro).tolist()
        cols["topk_ids"] = _lists(t["topk_ids"], rows, pa)
        cols["topk_logprobs"] = _lists(vals, rows, pa)
        cols["topk_tail"] = _lists(t["topk_tail"], rows, pa)
        if "logprobs" in t:
            cols["logprobs"] = _lists(t["logprobs"], rows, pa)
    elif fmt == "axolotl":
        idx, counts = _token_rows(ro, prompts, lengths)
        cols["input_ids"] = _lists(t["input_ids"].astype(np.int64), lengths, pa)
        cols["logprobs"] = _lists(vals[idx], counts, pa)
        cols["target_token_ids"] = _lists(t["topk_ids"][idx].astype(np.int64), counts, pa)
        cols["temperature"] = pa.array(np.full(len(lengths), cfg.temperature, np.float32))
    elif fmt == "distillkit":
        idx, counts = _token_rows(ro, prompts, lengths)
        # with P, tokens 1..P-1 have no served row: index -1, filled as DistillKit fills a missing rank
        full = np.concatenate([np.concatenate([np.full(max((P or 1) - 1, 0), -1), idx[s - n: s]])
                               for P, n, s in zip(prompts, counts, np.cumsum(counts))]) if counts else idx
        have = full >= 0
        v = np.where(have[:, None], vals[np.where(have, full, 0)], -np.inf).astype(np.float32)
        i = np.where(have[:, None], t["topk_ids"][np.where(have, full, 0)], 0)
        per = [max(L - 1, 0) for L in lengths]
        labels = t["input_ids"].astype(np.int64).copy()
        for j, P in enumerate(prompts):
            labels[o[j]: o[j] + (P or 0)] = -100
        cols["input_ids"] = _lists(t["input_ids"].astype(np.uint64), lengths, pa)
        cols["compressed_logprobs"] = _lists(compress_logprobs(v, cfg.dtype), per, pa)
        cols["bytepacked_indices"] = _lists(pack_indices(i, index_bits(vocab_size)), per, pa)
        cols["labels"] = _lists(labels, lengths, pa)
    else:
        raise AssertionError(fmt)                              # check_format refused it before any request
    if fmt in PASSTHROUGH:
        types = schema if schema is not None else {k: None for k in sorted({k for e in extras for k in e})}
        for key, kind in types.items():
            if key in cols:
                raise ValueError(f"input field {key!r} is a column --format {fmt} writes: rename it in the input")
            cols[key] = pa.array([e.get(key) for e in extras], type=kind)
    return pa.table(cols)


def write_shard(path: Path, table) -> None:
    """Write under a temporary name and rename: the shard exists whole or not at all. Pages carry CRCs.
    Dictionary pages only for byte columns: on logprobs and ids they cost ~3x the write time for ~8% of size."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def leaf(t):
        return leaf(t.value_type) if pa.types.is_list(t) else t

    tmp = path.with_suffix(".tmp")
    pq.write_table(table, str(tmp), compression="zstd", write_page_checksum=True,
                   use_dictionary=[f.name for f in table.schema if leaf(f.type) == pa.uint8()])
    os.replace(tmp, path)
