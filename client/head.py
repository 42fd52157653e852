"""The teacher's lm_head over the Head RPC: downloaded once, checked against its hash, cached on disk; numpy only."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import grpc
import numpy as np

from logitserve.v1 import logitserve_pb2 as pb

from .errors import LogitServeError
from .wire import DTYPES

_NAMES = {v: k for k, v in DTYPES.items()}                 # pb dtype -> "fp32" | "bf16" | "fp16"
# bytes as stored: bf16 stays its raw 16 bits (numpy has no bfloat16)
_STORED = {"fp32": np.dtype("<f4"), "bf16": np.dtype("<u2"), "fp16": np.dtype("<f2")}


@dataclass(frozen=True)
class HeadSpec:
    """HeadInfo: what turns a hidden state h into the served z/T besides the weight (SPEC.md, Head)."""

    content_hash: str
    vocab_size: int
    hidden_size: int
    dtype: str               # the weight's: fp32 | bf16 | fp16
    has_bias: bool
    logits_dtype: str        # fp32: the server's logits never narrower than fp32; else rounded to this first
    multiply: float          # z *= multiply (Cohere's logit_scale)
    divide: float            # z /= divide (Granite's logits_scaling)
    softcap: float           # z = softcap * tanh(z / softcap) when > 0 (Gemma's final_logit_softcapping)
    head_hash: str           # blake2b of the weight's bytes, then the bias's
    tied: bool = False


@dataclass(frozen=True)
class HeadWeights:
    """The head as downloaded (or read from the cache) and verified."""

    spec: HeadSpec
    weight: np.ndarray               # [V, H] in `_STORED[spec.dtype]` (bf16 as its raw uint16 bits)
    bias: Optional[np.ndarray]       # [V] likewise, or None


def spec_of(info: pb.HeadInfo) -> HeadSpec:
    return HeadSpec(info.content_hash, int(info.vocab_size), int(info.hidden_size), _NAMES[info.dtype],
                    bool(info.has_bias), _NAMES[info.logits_dtype], float(info.logit_multiply),
                    float(info.logit_divide), float(info.softcap), info.head_hash, bool(info.tied))


def default_cache() -> Path:
    """heads/ under logitserve's cache (demo.cache_root: $LOGITSERVE_CACHE, else .../logitserve in $XDG_CACHE_HOME
    or ~/.cache)."""
    from logitserve.demo import cache_root

    return cache_root() / "heads"


def _lost(message: str) -> LogitServeError:
    return LogitServeError(grpc.StatusCode.DATA_LOSS, message)


def digest(weight: np.ndarray, bias: Optional[np.ndarray]) -> str:
    h = hashlib.blake2b(digest_size=16)
    flat = weight.reshape(-1).view(np.uint8)
    step = 64 << 20
    for a in range(0, len(flat), step):
        h.update(flat[a : a + step])
    if bias is not None:
        h.update(bias.view(np.uint8))
    return "blake2b:" + h.hexdigest()


def _folder(cache: Path, spec: HeadSpec) -> Path:
    """One folder per model content and served dtype."""
    return cache / f"{spec.content_hash.replace(':', '-')}-{spec.dtype}"


def read_cached(cache: Path, spec: HeadSpec) -> Optional[HeadWeights]:
    """The cached head when it is there and its bytes hash to spec.head_hash; None otherwise (a stale or
    damaged copy is removed)."""
    folder = _folder(cache, spec)
    try:
        stored = HeadSpec(**json.loads((folder / "head.json").read_text()))
        V, H, kind = spec.vocab_size, spec.hidden_size, _STORED[spec.dtype]
        weight = np.fromfile(folder / "weight.bin", dtype=kind).reshape(V, H)
        bias = np.fromfile(folder / "bias.bin", dtype=kind) if spec.has_bias else None
    except (OSError, ValueError, TypeError):
        return None
    if stored != spec or digest(weight, bias) != spec.head_hash:
        shutil.rmtree(folder, ignore_errors=True)
        return None
    return HeadWeights(spec, weight, bias)


def write_cache(cache: Path, head: HeadWeights) -> None:
    """Atomically: a complete folder appears, or none."""
    cache.mkdir(parents=True, exist_ok=True)
    folder = _folder(cache, head.spec)
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".partial-"))
    head.weight.tofile(tmp / "weight.bin")
    if head.bias is not None:
        head.bias.tofile(tmp / "bias.bin")
    (tmp / "head.json").write_text(json.dumps(asdict(head.spec)))
    shutil.rmtree(folder, ignore_errors=True)
    try:
        os.replace(tmp, folder)
    except OSError:            # another process put it there first
        shutil.rmtree(tmp, ignore_errors=True)


class HeadAssembly:
    """Collects the Head RPC's messages; `finish` checks coverage, count and hash."""

    def __init__(self, spec: HeadSpec):
        self.spec = spec
        kind = _STORED[spec.dtype]
        self.weight = np.empty((spec.vocab_size, spec.hidden_size), dtype=kind)
        self.bias = np.empty(spec.vocab_size, dtype=kind) if spec.has_bias else None
        self._rows = np.zeros(spec.vocab_size, dtype=np.int32)   # times each weight row arrived
        self._bias_rows = np.zeros(spec.vocab_size if spec.has_bias else 0, dtype=np.int32)
        self.chunks = 0

    def add(self, chunk: pb.HeadChunk) -> None:
        self.chunks += 1
        t, a = chunk.tensor, int(chunk.row)
        if _NAMES.get(t.dtype) != self.spec.dtype:
            raise _lost(f"head {chunk.name}: dtype {t.dtype} is not the announced {self.spec.dtype}")
        data = np.frombuffer(t.data, dtype=_STORED[self.spec.dtype])
        if chunk.name == "weight":
            n = len(data) // max(self.spec.hidden_size, 1)
            if list(t.shape) != [n, self.spec.hidden_size] or n * self.spec.hidden_size != len(data) or \
                    not 0 <= a <= a + n <= self.spec.vocab_size:
                raise _lost(f"head weight: band {list(t.shape)} at row {a} does not fit "
                            f"[{self.spec.vocab_size}, {self.spec.hidden_size}]")
            self.weight[a : a + n] = data.reshape(n, -1)
            self._rows[a : a + n] += 1
        elif chunk.name == "bias" and self.bias is not None and 0 <= a <= a + len(data) <= len(self.bias):
            self.bias[a : a + len(data)] = data
            self._bias_rows[a : a + len(data)] += 1
        else:
            raise _lost(f"head: unexpected chunk {chunk.name!r} at {a}")

    def finish(self, num_chunks: int) -> HeadWeights:
        if num_chunks != self.chunks:
            raise _lost(f"head: the server sent {num_chunks} chunks, {self.chunks} arrived")
        if not (self._rows == 1).all() or not (self._bias_rows == 1).all():
            raise _lost("head: rows missing or sent twice")
        if digest(self.weight, self.bias) != self.spec.head_hash:
            raise _lost(f"head: the bytes received do not hash to {self.spec.head_hash}")
        return HeadWeights(self.spec, self.weight, self.bias)


# A refused download (the server's slots all taken) is tried again after 0.05 s, doubling to 1 s, jittered,
# until DEFAULT_WAIT_S have passed in all (head_weights' `wait_s`); then the refusal is raised.
DEFAULT_WAIT_S = 120.0
FIRST_RETRY_S, MAX_RETRY_S = 0.05, 1.0


class _Busy(Exception):
    """The server refused the download before sending anything (RESOURCE_EXHAUSTED): worth another try."""

    def __init__(self, err: grpc.RpcError):
        self.err = err


async def fetch_head(stub, metadata, timeout: Optional[float], cache: Optional[Path],
                     wait_s: float = DEFAULT_WAIT_S) -> HeadWeights:
    """The served head: from `cache` when a verified copy of exactly it is there, else downloaded (and cached).
    While the server's download slots are taken it waits and tries again (each try checks the cache first, so
    one process's finished download serves the others), for at most `wait_s` seconds in all."""
    deadline = time.monotonic() + wait_s
    delay = FIRST_RETRY_S
    while True:
        try:
            return await _fetch_once(stub, metadata, timeout, cache)
        except _Busy as busy:
            left = deadline - time.monotonic()
            if left <= 0:
                err = LogitServeError.from_rpc(busy.err)
                raise LogitServeError(err.code, f"{err.details} (gave up after waiting {wait_s:g} s for a "
                                                f"download slot: head_weights' wait_s)") from None
            await asyncio.sleep(min(left, delay * random.uniform(0.5, 1.0)))
            delay = min(MAX_RETRY_S, delay * 2)


async def _fetch_once(stub, metadata, timeout: Optional[float], cache: Optional[Path]) -> HeadWeights:
    assembly = None
    try:
        if cache is not None:
            call = stub.Head(pb.HeadRequest(info_only=True), timeout=timeout, metadata=metadata)
            async for msg in call:
                if msg.WhichOneof("body") == "info":
                    cached = read_cached(cache, spec_of(msg.info))
                    if cached is not None:
                        return cached
        async for msg in stub.Head(pb.HeadRequest(), timeout=timeout, metadata=metadata):
            kind = msg.WhichOneof("body")
            if kind == "info":
                assembly = HeadAssembly(spec_of(msg.info))
            elif kind == "chunk" and assembly is not None:
                assembly.add(msg.chunk)
            elif kind == "num_chunks" and assembly is not None:
                head = assembly.finish(msg.num_chunks)
                if cache is not None:
                    write_cache(cache, head)
                return head
            else:
                raise _lost(f"head: {kind} before the head's info")
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and assembly is None:
            raise _Busy(e) from None
        raise LogitServeError.from_rpc(e) from None
    raise _lost("head: the stream ended before the last message")
