"""Reads one rank's slices of a safetensors checkpoint, a tensor at a time, through transformers' key conversions.

Each read opens the file, copies out only the rows or columns this rank holds and
closes it again, so a rank's resident memory while loading is its shards plus the
pages of one tensor (a file mapped for the whole load would keep every touched page).
Checkpoint keys are mapped to the model's parameters by transformers' own renamings and
converters (`conversion_mapping`), e.g. Mixtral's per-expert `w1/w3/w2` into the fused
`experts.gate_up_proj [E, 2I, H]`; a converter other than stack-experts-then-concatenate
is refused by name. An FP8 weight (logitserve.quant) is read with the scales that cover the
rank's slice and comes out dequantized (fp32, then the serving dtype), a piece at a time, or
as stored with its scales for a layer that runs FP8 GEMMs (`read_fp8`); every tensor's dtype
is known from the headers before anything is read.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from .fp8 import aligned, concrete, dequantize, scale_index
from .quant import FLOAT_DTYPES, SERVED, QuantError, QuantScheme, check_tensors
from .tp_plan import ParamShard

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}   # safetensors' names
READ_BLOCK_BYTES = 8 << 20     # whole tensors are copied in blocks of rows of at most this size (read_whole)


@dataclass
class Source:
    """Where one model parameter comes from: one key, or a converter's per-expert keys."""

    keys: list[tuple[int, int, str]] = field(default_factory=list)   # (expert or -1, part, checkpoint key)
    merge: bool = False             # stack the experts on a new dim 0 (MergeModulelist(dim=0))
    concat_dim: Optional[int] = None   # then concatenate the parts on this dim of the result


def _chunk(n: int, rank: int, tp: int, what: str) -> slice:
    if n % tp:
        raise ValueError(f"{what}: size {n} does not divide by tp={tp}")
    size = n // tp
    return slice(rank * size, (rank + 1) * size)


class Checkpoint:
    """A directory's safetensors files: key -> file, and sliced reads."""

    def __init__(self, directory: Path, scheme: Optional[QuantScheme] = None):
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {k: self.directory / f for k, f in weight_map.items()}
        else:
            self.files = {}
            for f in sorted(self.directory.glob("*.safetensors")):
                with safe_open(f, framework="pt") as h:
                    self.files.update({k: f for k in h.keys()})
        if not self.files:
            raise ValueError(f"{self.directory}: no safetensors weights (sharded loading reads safetensors only)")
        self.meta = headers(self.files)          # key -> (safetensors dtype, shape): the headers only
        self.scheme = scheme
        self.scales = check_tensors(self.meta, scheme, str(self.directory))   # FP8 weight key -> its scale key

    def sources(self, model) -> dict[str, Source]:
        """Model parameter or buffer name -> its Source, through transformers' conversions where it has them."""
        renamings, converters = _conversions(model)
        meta = dict(model.state_dict(keep_vars=True))
        out: dict[str, Source] = {}
        for key in sorted(self.files):
            target, pattern = _rename(key, renamings, converters, model.base_model_prefix, meta)
            if target not in meta:
                continue                               # unexpected key (e.g. a rotary buffer saved by old code)
            src = out.setdefault(target, Source())
            if pattern is None:
                src.keys.append((-1, 0, key))
                continue
            conv = converters[pattern]
            ops = [type(op).__name__ for op in conv.operations]
            if ops not in (["MergeModulelist"], ["MergeModulelist", "Concatenate"]) \
                    or conv.operations[0].dim != 0:
                raise ValueError(f"{target}: checkpoint conversion {ops} is not supported by sharded loading")
            expert = int(re.search(pattern.replace(".", r"\.").replace("*", r"(\d+)"), key).group(1))
            src.merge = True
            src.concat_dim = conv.operations[1].dim if len(ops) == 2 else None
            src.keys.append((expert, conv.source_patterns.index(pattern), key))
        return out

    def _pieces(self, shape: list[int], key: str, shard: Optional[ParamShard], rank: int, tp: int,
                dim_shift: int = 0, rows: Optional[slice] = None) -> tuple[list[tuple[slice, ...]], int]:
        """The index of each piece of `key` this rank reads (fused gate|up: one per part) and the dim they join on."""
        index = [slice(None)] * len(shape)
        if rows is not None:
            index[0] = rows
        if shard is None:
            return [concrete(tuple(index), tuple(shape))], 0
        dim = shard.dim - dim_shift
        part = shape[dim] // shard.parts
        pieces = []
        for p in range(shard.parts):                # fused gate|up: this rank's rows of each part
            local = _chunk(part, rank, tp, f"{key} dim {dim}")
            index[dim] = slice(p * part + local.start, p * part + local.stop)
            pieces.append(concrete(tuple(index), tuple(shape)))
        return pieces, dim

    def _read(self, key: str, shard: Optional[ParamShard], rank: int, tp: int, dim_shift: int = 0,
              rows: Optional[slice] = None) -> torch.Tensor:
        """This rank's part of checkpoint tensor `key`; an FP8 weight comes dequantized (fp32) with its scales."""
        with safe_open(self.files[key], framework="pt") as h:
            sl = h.get_slice(key)
            pieces, dim = self._pieces(sl.get_shape(), key, shard, rank, tp, dim_shift, rows)
            out = [self._dequantized(key, sl[i], i) if key in self.scales else sl[i] for i in pieces]
        return out[0] if len(out) == 1 else torch.cat(out, dim)

    def _scale(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The scales covering the piece `index` of FP8 weight `key` (fp32)."""
        skey = self.scales[key]
        with safe_open(self.files[skey], framework="pt") as h:
            sl = h.get_slice(skey)
            shape = tuple(sl.get_shape())
            value = sl[scale_index(self.scheme, index, shape)] if shape else h.get_tensor(skey)
        return value.to(torch.float32)

    def _dequantized(self, key: str, q: torch.Tensor, index: tuple[slice, ...]) -> torch.Tensor:
        return dequantize(q, self._scale(key, index), self.scheme, index)

    def unaligned(self, name: str, src: Source, shard: Optional[ParamShard], rank: int, tp: int) -> Optional[str]:
        """None when this rank's pieces of FP8 weight `name` hold whole scale blocks of their own; else why not,
        naming the dimension and the bound (from the header: nothing is read)."""
        key = src.keys[0][2]
        shape = self.meta[key][1]
        pieces, _ = self._pieces(list(shape), key, shard, rank, tp)
        if self.scheme.strategy == "tensor" and len(pieces) > 1:
            return f"{name}: packed parts under one per-tensor scale"
        for i in pieces:
            why = aligned(self.scheme, i, shape)
            if why is not None:
                return f"{name}: {why}"
        return None

    def read_fp8(self, src: Source, shard: Optional[ParamShard], rank: int, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's FP8 weight of a linear layer as stored, e4m3 [N/tp or N, K or K/tp], and the scales of that
        shard: [n, 1] per channel, [] per tensor, whole blocks [ceil(n/R), ceil(k/C)] (`unaligned` said None)."""
        key = src.keys[0][2]
        with safe_open(self.files[key], framework="pt") as h:
            sl = h.get_slice(key)
            pieces, dim = self._pieces(sl.get_shape(), key, shard, rank, tp)
            q = [sl[i] for i in pieces]
        s = [self._scale(key, i) for i in pieces]
        weight = q[0] if len(q) == 1 else torch.cat(q, dim)
        if self.scheme.strategy == "tensor":
            return weight, s[0].reshape(())
        return weight, s[0] if len(s) == 1 else torch.cat(s, dim)

    def stored(self, key: str) -> str:
        """The safetensors dtype name `key` is stored in ("BF16", "F8_E4M3", ...)."""
        return self.meta[key][0]

    def require_float(self, key: str, name: str) -> None:
        """A parameter's tensor must be a float or a served FP8 weight: anything else is refused naming it."""
        dtype = self.stored(key)
        if dtype not in FLOAT_DTYPES and key not in self.scales:
            raise QuantError(f"{self.directory}: parameter {name} (checkpoint tensor {key}) is stored as {dtype}; "
                             f"{SERVED}")

    def read(self, name: str, src: Source, shard: Optional[ParamShard], rank: int, tp: int) -> torch.Tensor:
        """This rank's part of parameter `name` (the whole of it when `shard` is None)."""
        if not src.merge:
            if len(src.keys) != 1:
                raise ValueError(f"{name}: {len(src.keys)} checkpoint keys map to it")
            return self._read(src.keys[0][2], shard, rank, tp)
        experts = sorted({e for e, _, _ in src.keys})
        by = {(e, p): k for e, p, k in src.keys}
        parts = sorted({p for _, p, _ in src.keys})
        stacked = []
        for e in experts:
            if src.concat_dim is None:
                stacked.append(self._read(by[e, 0], shard, rank, tp, dim_shift=1))
                continue
            # the packed dim is the concatenation: each part gives this rank's chunk of itself
            each = None if shard is None else ParamShard(shard.dim, 1)
            if shard is not None and shard.dim == src.concat_dim and shard.parts not in (1, len(parts)):
                raise ValueError(f"{name}: {shard.parts} packed parts but the checkpoint has {len(parts)}")
            if shard is not None and shard.dim != src.concat_dim and shard.parts != 1:
                raise ValueError(f"{name}: packed split on dim {shard.dim}, parts concatenated on {src.concat_dim}")
            stacked.append(torch.cat([self._read(by[e, p], each, rank, tp, dim_shift=1) for p in parts],
                                     src.concat_dim - 1))
        return torch.stack(stacked, 0)

    def read_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a 2-D tensor (the lm_head's vocab shard)."""
        return self._read(key, None, 0, 1, rows=slice(start, stop))

    def read_whole(self, key: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A whole tensor in `dtype` on `device`. On the host in the file's dtype: the file's pages themselves, read
        when first touched (as transformers' from_pretrained keeps them). Otherwise a fresh copy, made a block of
        rows at a time, each block's pages unmapped before the next: a big tensor costs its copy, not twice."""
        with safe_open(self.files[key], framework="pt") as h:
            sl = h.get_slice(key)
            shape, stored = sl.get_shape(), _DTYPES.get(sl.get_dtype())
            if device.type == "cpu" and stored == dtype and key not in self.scales:
                return h.get_tensor(key)
        row_bytes = max(1, math.prod(shape[1:]) * 4)      # at most 4 bytes an element, in the file or the copy
        block = max(1, READ_BLOCK_BYTES // row_bytes)
        if not shape or shape[0] <= block:
            return self._read(key, None, 0, 1).to(device=device, dtype=dtype, copy=key not in self.scales)
        out = torch.empty(shape, dtype=dtype, device=device)
        for a in range(0, shape[0], block):
            out[a : a + block] = self.read_rows(key, a, min(a + block, shape[0]))
        return out


def headers(files: dict[str, Path]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """key -> (dtype, shape) from each file's safetensors header, without reading any tensor."""
    out = {}
    by_file: dict[Path, list[str]] = {}
    for key, f in files.items():
        by_file.setdefault(f, []).append(key)
    for f, keys in by_file.items():
        with safe_open(f, framework="pt") as h:
            for key in keys:
                sl = h.get_slice(key)
                out[key] = (sl.get_dtype(), tuple(sl.get_shape()))
    return out


def _conversions(model):
    """transformers' renamings and converters for this model ({} on versions without them)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:
        return [], {}
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if not isinstance(m, WeightConverter)]
    converters = {p: m for m in mapping if isinstance(m, WeightConverter) for p in m.source_patterns}
    return renamings, converters


def _rename(key: str, renamings, converters, prefix: str, meta: dict) -> tuple[str, Optional[str]]:
    try:
        from transformers.core_model_loading import rename_source_key
    except ImportError:
        return key, None
    unique = list({id(c): c for c in converters.values()}.values())
    return rename_source_key(key, renamings, unique, prefix, meta)
