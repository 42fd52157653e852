"""Loads a local Hugging Face model directory offline: this rank's part of it, for every layout (tp = 1 included).

The skeleton comes from transformers (`from_config` with parameters on the meta device
and real buffers, so rotary tables are computed as usual). Each parameter is then read
from the checkpoint already split by the TP plan (`tp_plan.expand`; nothing is split at
tp = 1), in the serving dtype, and put on the device one at a time; the lm_head is read
as this rank's padded vocab shard (the whole head at tp = 1). Under PP only this stage's
layers are read. A rank's peak host memory is its part plus one tensor, never the
checkpoint; one process serving the whole model is the layout with trivial groups.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from .checkpoint import Checkpoint, Source
from .hostmem import peak_rss_mib
from .memory import weight_bytes
from .loaded import DTYPE_NAMES, DTYPES, HeadTransform, LoadedModel, attention_kwargs, content_hash, describe  # noqa: F401
from .loaded import find_head, head_attr, kind_of, model_class
from .pipeline import install_stage, split_stages
from .quant import scheme_of
from .quant_load import QuantLoad
from .spec import ModelKind
from .tp_forward import install, install_vocab_embedding, shardable_embedding
from .tp_plan import Expanded, Plan, check_layout, expand, resolve_plan
from .vocab_parallel import VocabShard

log = logging.getLogger("logitserve.loading")


@dataclass(frozen=True)
class Place:
    """Which part of the model this rank holds: its TP shard (of `tp`, collectives on `group`) and PP stage."""

    rank: int = 0                       # TP rank
    tp: int = 1
    group: Optional[object] = None      # the TP process group; None when tp = 1
    pp: int = 1
    stage: int = 0
    balance: str = "compute"            # how stages split the layers (pipeline.split_stages)


def load_model(directory: str | os.PathLike, dtype: str = "fp32", max_seq_len: int | None = None,
               name: str | None = None, device: str | None = None, fp8_compute: str = "auto") -> LoadedModel:
    """The whole model in this process (the layout of one rank): weights straight onto `device` ("cuda", "cuda:1";
    default CPU), one tensor at a time, never the whole checkpoint in host memory first."""
    loaded, _ = load_sharded(directory, dtype, torch.device(device or "cpu"), 0, 1, None, max_seq_len, name,
                             fp8_compute=fp8_compute)
    return loaded


def load_sharded(directory, dtype: str, device: torch.device, rank: int, tp: int, group,
                 max_seq_len: int | None = None, name: str | None = None,
                 content: str | None = None, pp: int = 1, stage: int = 0,
                 balance: str = "compute", fp8_compute: str = "auto") -> tuple[LoadedModel, VocabShard]:
    """This rank's model: body shards with their collectives on `group`, and its lm_head vocab shard; under
    PP only its stage's layers (the embedding on the first stage, the final norm and the head on the last).
    `content`: the checkpoint's hash when the caller computes it (else it is computed here). An FP8 checkpoint
    (logitserve.quant) is dequantized to `dtype` as it is read, but for the linear layers that run FP8 GEMMs
    (`fp8_compute`: auto, dequantize or fp8; logitserve.fp8_linear.choose)."""
    from transformers import AutoConfig

    t0 = time.perf_counter()
    place = Place(rank, tp, group, pp, stage, balance)
    path = Path(directory)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {sorted(DTYPES)}")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    check_layout(config, tp)
    plan = resolve_plan(config) if tp > 1 else Plan((), "")
    qc = getattr(config, "quantization_config", None) or getattr(config.get_text_config(), "quantization_config", None)
    quant = QuantLoad.of(scheme_of(qc), fp8_compute, device, DTYPES[dtype])
    reader = _Reader.of(path, config, DTYPES[dtype], device, place, plan, quant)
    reader.read_body()
    shard_head, vshard, head_key = reader.read_head()
    stage_input = None
    if reader.layers is not None:         # this stage's layers only; the others stay meta and go
        stage_input = install_stage(reader.body, reader.layers, stage, pp,
                                    int(config.get_text_config().hidden_size), DTYPES[dtype])
    reader.model.to(device)               # the buffers built on the host (rotary tables)
    loaded = describe(reader.model, config, path, dtype, max_seq_len, name, head=shard_head, content=content,
                      vocab=vshard.vocab_size if reader.kind is ModelKind.CAUSAL_LM else None)
    if reader.kind is not ModelKind.CAUSAL_LM:
        vshard = VocabShard(0, loaded.vocab_size, loaded.vocab_size, None)
    log.info("rank %d loaded its shards (tp=%d, plan from %s) in %.1f s; peak RSS %.0f MiB; weights %.1f MiB%s",
             rank, tp, plan.source or "-", time.perf_counter() - t0, peak_rss_mib(),
             weight_bytes(reader.model) / 2**20, f"; {quant.describe()}" if quant.scheme else "")
    return dataclasses.replace(loaded, plan_source=plan.source, stage_input=stage_input, quantization=quant.describe(),
                               head_checkpoint=(str(path), head_key) if head_key else None), vshard


@dataclass
class _Reader:
    """One load in progress: the skeleton, the checkpoint, and which parameters this rank reads how."""

    model: nn.Module
    body: nn.Module
    prefix: str                          # the body's parameter names' prefix in the model
    kind: ModelKind
    ckpt: Checkpoint
    sources: dict[str, Source]
    expanded: Expanded
    dtype: torch.dtype
    device: torch.device
    place: Place
    layers: Optional[tuple[int, int]]    # --pp: this stage's decoder layers
    skip: Callable[[str, nn.Parameter], bool]   # parameters other stages hold
    tied: bool                           # the lm_head is the input embedding (read once; reading unties them)
    quant: QuantLoad                     # FP8 weights: which layers keep them for FP8 GEMMs

    @classmethod
    def of(cls, path: Path, config, dtype: torch.dtype, device: torch.device, place: Place, plan: Plan,
           quant: QuantLoad) -> "_Reader":
        kind = kind_of(config)
        model = _skeleton(config, dtype)
        body = model.base_model
        prefix = next(n for n, m in model.named_modules() if m is body)
        prefix = prefix + "." if prefix else ""
        expanded = expand(plan, body)
        if expanded.unused and place.rank == 0:
            log.info("TP plan rules matching nothing in this model: %s", ", ".join(expanded.unused))
        ckpt = Checkpoint(path, quant.scheme)
        sources = ckpt.sources(model)
        layers, skip = None, (lambda n, p: False)
        if place.pp > 1:
            layers, skip = _stage_layers(model, body, prefix, kind, place, _held_bytes(ckpt, sources, quant, dtype))
        return cls(model, body, prefix, kind, ckpt, sources, expanded, dtype, device, place, layers, skip,
                   _tied(model, config, kind), quant)

    def _head(self) -> Optional[nn.Module]:
        return find_head(self.model, self.kind) if self.kind is ModelKind.CAUSAL_LM else None

    def read_body(self) -> None:
        """Every parameter and saved buffer this rank holds, but the lm_head and a vocab-split embedding."""
        model, place = self.model, self.place
        head = self._head()
        embedding = model.get_input_embeddings()
        split_embedding = place.tp > 1 and shardable_embedding(embedding) and place.stage == 0
        later = set() if head is None else {id(head.bias)} | (set() if head.weight is embedding.weight
                                                              else {id(head.weight)})
        fp32_keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
        missing = []
        for pname, p in list(model.named_parameters()):
            if id(p) in later or (split_embedding and p is embedding.weight) or self.skip(pname, p):
                continue                      # read below as this rank's vocab shard, or another stage's
            if pname not in self.sources:
                missing.append(pname)
                continue
            shard = self.expanded.params.get(pname[len(self.prefix):]) if pname.startswith(self.prefix) else None
            self._check(pname)
            if self.quant.linear(model, pname, self.sources[pname], shard, self.ckpt, place.rank, place.tp):
                continue                      # an Fp8Linear holds this rank's FP8 shard and its scales
            want = torch.float32 if any(k in pname for k in fp32_keep) else self.dtype
            _set(model, pname, self._read(pname, shard, want), True)
        if missing:
            raise ValueError(f"{self.ckpt.directory}: no checkpoint tensor for {len(missing)} parameters, "
                             f"e.g. {missing[:4]}")
        for bname, b in list(model.named_buffers()):
            if bname in self.sources:         # persistent buffers saved with the weights
                value = self.ckpt.read(bname, self.sources[bname], None, place.rank, place.tp)
                _set(model, bname, value.to(device=self.device, dtype=b.dtype), False)
        for mname, style in self.expanded.modules.items():
            install(self.body.get_submodule(mname), style, place.group, place.rank, place.tp)
        if split_embedding:                   # vocab-parallel input embedding, like the head
            self._split_embedding(embedding)

    def _check(self, pname: str, why: str = "fused experts: no FP8 grouped GEMM here") -> None:
        """Every checkpoint tensor of a parameter is a float or a served FP8 weight (else refused naming it)."""
        for _, _, key in self.sources[pname].keys:
            self.ckpt.require_float(key, pname)
            if self.sources[pname].merge:
                self.quant.note(pname, key, self.ckpt, why)

    def _read(self, name: str, shard, dtype: torch.dtype) -> torch.Tensor:
        """This rank's part of a parameter, a fresh tensor in `dtype` on the device."""
        src = self.sources[name]
        if shard is None and not src.merge and len(src.keys) == 1:
            return self.ckpt.read_whole(src.keys[0][2], dtype, self.device)
        value = self.ckpt.read(name, src, shard, self.place.rank, self.place.tp)
        fresh = all(k in self.ckpt.scales for _, _, k in src.keys)    # dequantized: a tensor of its own already
        return value.to(device=self.device, dtype=dtype, copy=not fresh)

    def _split_embedding(self, embedding: nn.Embedding) -> None:
        ename = next(n for n, p in self.model.named_parameters() if p is embedding.weight)
        if ename not in self.sources:
            raise ValueError(f"{self.ckpt.directory}: no checkpoint tensor for {ename}")
        self._check(ename, "the input embedding is read dequantized")
        weight, start, real = _vocab_rows(self.ckpt, self.sources[ename].keys[0][2], embedding.num_embeddings,
                                          self.dtype, self.device, self.place, embedding.embedding_dim)
        embedding.weight = nn.Parameter(weight, requires_grad=False)
        install_vocab_embedding(embedding, start, real, self.place.group)

    def read_head(self) -> tuple[Optional[nn.Linear], VocabShard, Optional[str]]:
        """(this rank's lm_head, its VocabShard, the checkpoint key it came from); (None, empty, None) for a reward
        model, whose score head was read with the body."""
        model, place = self.model, self.place
        if self.kind is not ModelKind.CAUSAL_LM:
            if place.stage == place.pp - 1:
                return None, VocabShard(0, 0, 0, None), None
            head = find_head(model, self.kind)      # an earlier pipeline stage: an empty one keeps dtype and H
            empty = nn.Linear(head.in_features, 0, bias=False, device=self.device, dtype=self.dtype)
            setattr(model, head_attr(model, self.kind), empty)
            return empty, VocabShard(0, 0, 0, None), None
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        emb = model.get_input_embeddings().weight                  # loaded above (stage 0): [V, H]
        head = find_head(model, self.kind)
        tied = self.tied
        attr = head_attr(model, self.kind)
        key_name = f"{attr}.weight" if f"{attr}.weight" in self.sources and not tied else names[id(emb)]
        vocab, hidden, key = int(head.out_features), int(head.in_features), self.sources[key_name].keys[0][2]
        self._check(key_name, "the lm_head stays in the serving dtype (fp32 logits)")
        if place.stage != place.pp - 1:    # an earlier pipeline stage has no head: an empty one keeps dtype and H
            shard_head = nn.Linear(hidden, 0, bias=False, device=self.device, dtype=self.dtype)
            vshard = VocabShard(0, 0, vocab, None)
        elif place.tp == 1 and tied and emb.device.type != "meta":   # tied at tp = 1: the embedding's own tensor
            shard_head = nn.Linear(hidden, vocab, bias=False, device="meta")
            shard_head.weight = emb
            vshard = VocabShard(0, vocab, vocab, None)
        else:
            shard_head, vshard = self._vocab_head(key, vocab, hidden, head.bias is not None and not tied, attr)
        setattr(model, attr, shard_head)
        return shard_head, vshard, key

    def _vocab_head(self, key: str, vocab: int, hidden: int, bias: bool, attr: str) -> tuple[nn.Linear, VocabShard]:
        """The lm_head's vocab shard, zero-padded past V: logits stay vocab-sharded [N, V/tp]."""
        weight, start, real = _vocab_rows(self.ckpt, key, vocab, self.dtype, self.device, self.place, hidden)
        head = nn.Linear(hidden, weight.shape[0], bias=bias, device="meta")
        head.weight = nn.Parameter(weight, requires_grad=False)
        if bias:
            bias_key = self.sources[f"{attr}.bias"].keys[0][2]
            head.bias = nn.Parameter(_vocab_rows(self.ckpt, bias_key, vocab, self.dtype, self.device,
                                                 self.place)[0], requires_grad=False)
        group = self.place.group if self.place.tp > 1 else None
        return head, VocabShard(start=start, size=weight.shape[0], vocab_size=vocab, group=group)


def _skeleton(config, dtype: torch.dtype) -> nn.Module:
    """The model with its parameters on the meta device, its buffers real; no weight initialisation (every
    parameter is read from the checkpoint next)."""
    import contextlib

    from accelerate import init_empty_weights
    try:
        from transformers.initialization import no_init_weights
    except ImportError:                   # transformers without it: meta tensors' initialisation is only slower
        no_init_weights = contextlib.nullcontext
    with init_empty_weights(include_buffers=False), no_init_weights():
        model = model_class(config).from_config(config, dtype=dtype, **attention_kwargs(config))
    return model.eval().requires_grad_(False)


def _set(model: nn.Module, name: str, value: torch.Tensor, is_param: bool) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    if is_param:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


def _vocab_rows(ckpt: Checkpoint, key: str, vocab: int, dtype, device, place: Place,
                hidden: Optional[int] = None) -> tuple[torch.Tensor, int, int]:
    """Rows [r*ceil(V/tp), ...) of a [V, H] (or [V]) tensor, zero-padded to ceil(V/tp): (tensor, start, real rows)."""
    if place.tp == 1:                                   # the whole tensor: read as any other
        return ckpt.read_whole(key, dtype, device), 0, vocab
    local = math.ceil(vocab / place.tp)
    start = place.rank * local
    real = max(0, min(vocab, start + local) - start)
    rows = ckpt.read_rows(key, start, start + real) if real else None
    if rows is not None and real == local:             # no padding: one copy, as every other parameter
        return rows.to(device=device, dtype=dtype, copy=True), start, real
    width = tuple(rows.shape[1:]) if rows is not None else ((hidden,) if hidden else ())
    out = torch.zeros(local, *width, dtype=dtype, device=device)
    if rows is not None:
        out[:real] = rows.to(device=device, dtype=dtype)
    return out, start, real


def _tied(model: nn.Module, config, kind: ModelKind) -> bool:
    """Whether the lm_head is the input embedding, as transformers ties them (the skeleton is not tied yet)."""
    if kind is not ModelKind.CAUSAL_LM:
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return (find_head(model, kind).weight is model.get_input_embeddings().weight
            or bool(getattr(text, "tie_word_embeddings", False)))


def _held_bytes(ckpt: Checkpoint, sources: dict, quant: QuantLoad, dtype: torch.dtype):
    """(name, param) -> the bytes it will hold: an FP8 weight that may stay FP8 (FP8 GEMMs on for this load) at one
    byte an element, every other parameter in the serving dtype (logitserve.memory.weight_bytes, once loaded)."""
    def held(name: str, p) -> int:
        keys = sources[name].keys if name in sources else []
        fp8 = quant.may_keep() and bool(keys) and all(k in ckpt.scales for _, _, k in keys) \
            and not sources[name].merge
        return p.numel() * (1 if fp8 else dtype.itemsize)
    return held


def _stage_layers(model: nn.Module, body: nn.Module, prefix: str, kind: ModelKind, place: Place, held):
    """(this stage's layers [a, b), skip(name, param)): which parameters other stages hold. Stages balance the
    parameters that compute per token ("compute": the embedding is a lookup and counts 0; the head counts like
    any GEMM) or the bytes all parameters hold ("memory": held(name, param), FP8 weights at one byte)."""
    pp, stage = place.pp, place.stage
    blocks = getattr(body, "layers", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"{type(body).__name__} has no `layers` list to split into --pp {pp} stages")
    memory = place.balance == "memory"
    size = (lambda n, p: held(prefix + n, p)) if memory else (lambda n, p: p.numel())
    sizes = [sum(size(f"layers.{i}.{n}", p) for n, p in b.named_parameters()) for i, b in enumerate(blocks)]
    emb = model.get_input_embeddings().weight
    head = find_head(model, kind)                   # the lm_head or a reward model's score head: the last stage's
    last_only = {id(p) for p in head.parameters() if p is not emb}
    norm = sum(p.numel() for p in body.norm.parameters()) if hasattr(body, "norm") else 0
    scale = model.dtype.itemsize if memory else 1    # the embedding, the norm and the head stay in the serving dtype
    bounds = split_stages(sizes, emb.numel() * scale if memory else 0, (norm + head.weight.numel()) * scale, pp)
    a, b = bounds[stage]
    if stage == 0:
        log.info("pipeline stages (decoder layers): %s", ", ".join(f"[{x}, {y})" for x, y in bounds))
    others = tuple(f"{prefix}layers.{i}." for i in range(len(blocks)) if not a <= i < b)
    norm_name = f"{prefix}norm."

    def skip(name: str, p) -> bool:
        return (name.startswith(others) or (stage > 0 and p is emb) or (stage < pp - 1 and id(p) in last_only)
                or (stage < pp - 1 and name.startswith(norm_name)))
    return (a, b), skip
