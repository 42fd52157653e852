"""Builds this rank's part of a model: a skeleton on the meta device, then only its own slices from disk.

The skeleton comes from transformers (`from_config` with parameters on meta and real
buffers, so rotary tables are computed as usual). Each parameter is then read from the
checkpoint already split by the TP plan (`tp_plan.expand`), in the serving dtype, and
put on the device one at a time; the lm_head is read as this rank's padded vocab shard.
A rank's peak host memory is therefore its shards plus one tensor, never the checkpoint.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path

import torch
from torch import nn

from .checkpoint import Checkpoint
from .hostmem import peak_rss_mib
from .loading import DTYPES, LoadedModel, _kind_of, attention_kwargs, describe, find_head, model_class
from .spec import ModelKind
from .tp_forward import install, install_vocab_embedding, shardable_embedding
from .tp_plan import Plan, check_layout, expand, resolve_plan
from .vocab_parallel import VocabShard

log = logging.getLogger("logitserve.shard_load")


def _skeleton(config, dtype: torch.dtype) -> nn.Module:
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = model_class(config).from_config(config, dtype=dtype, **attention_kwargs(config))
    return model.eval().requires_grad_(False)


def _set(model: nn.Module, name: str, value: torch.Tensor, is_param: bool) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    if is_param:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


def _vocab_rows(ckpt: Checkpoint, key: str, vocab: int, hidden: int, dtype, device, rank: int,
                tp: int) -> tuple[torch.Tensor, int, int]:
    """Rows [r*ceil(V/tp), ...) of a [V, H] tensor, zero-padded to ceil(V/tp): (weight, start, real rows)."""
    local = math.ceil(vocab / tp)
    start = rank * local
    real = max(0, min(vocab, start + local) - start)
    weight = torch.zeros(local, hidden, dtype=dtype, device=device)
    if real:
        weight[:real] = ckpt.read_rows(key, start, start + real).to(device=device, dtype=dtype)
    return weight, start, real


def _vocab_head(ckpt: Checkpoint, key: str, vocab: int, hidden: int, dtype, device, rank: int,
                tp: int, group) -> tuple[nn.Linear, VocabShard]:
    """The lm_head's vocab shard, zero-padded past V: logits stay vocab-sharded [N, V/tp]."""
    weight, start, _ = _vocab_rows(ckpt, key, vocab, hidden, dtype, device, rank, tp)
    local = weight.shape[0]
    head = nn.Linear(hidden, local, bias=False, device="meta")
    head.weight = nn.Parameter(weight, requires_grad=False)
    return head, VocabShard(start=start, size=local, vocab_size=vocab, group=group)


def load_sharded(directory, dtype: str, device: torch.device, rank: int, tp: int, group,
                 max_seq_len: int | None = None, name: str | None = None,
                 content: str | None = None, pp: int = 1, stage: int = 0,
                 balance: str = "compute") -> tuple[LoadedModel, VocabShard]:
    """This TP rank's model: body shards with their collectives on `group`, and its lm_head vocab shard; under
    PP only its stage's layers (the embedding on the first stage, the final norm and the head on the last)."""
    from transformers import AutoConfig

    t0 = time.perf_counter()
    path = Path(directory)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {sorted(DTYPES)}")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    kind = _kind_of(config)
    check_layout(config, tp)
    plan = resolve_plan(config) if tp > 1 else Plan((), "")
    model = _skeleton(config, DTYPES[dtype])
    body = model.base_model
    prefix = next(n for n, m in model.named_modules() if m is body)
    prefix = prefix + "." if prefix else ""
    expanded = expand(plan, body)
    if expanded.unused and rank == 0:
        log.info("TP plan rules matching nothing in this model: %s", ", ".join(expanded.unused))

    ckpt = Checkpoint(path)
    sources = ckpt.sources(model)
    head_param = find_head(model, kind).weight if kind is ModelKind.CAUSAL_LM else None
    tied = head_param is not None and head_param is model.get_input_embeddings().weight
    fp32_keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    embedding = model.get_input_embeddings()
    split_embedding = tp > 1 and shardable_embedding(embedding) and stage == 0
    layers, skip = (None, lambda n, p: False)
    if pp > 1:
        layers, skip = _stage_layers(model, body, prefix, kind, pp, stage, balance)
    missing = []
    for pname, p in list(model.named_parameters()):
        if (p is head_param and not tied) or (split_embedding and p is embedding.weight) or skip(pname, p):
            continue                      # read below as this rank's vocab shard, or another stage's
        if pname not in sources:
            missing.append(pname)
            continue
        shard = expanded.params.get(pname[len(prefix):]) if pname.startswith(prefix) else None
        want = torch.float32 if any(k in pname for k in fp32_keep) else DTYPES[dtype]
        _set(model, pname, ckpt.read(pname, sources[pname], shard, rank, tp).to(device=device, dtype=want, copy=True), True)
    if missing:
        raise ValueError(f"{path}: no checkpoint tensor for {len(missing)} parameters, e.g. {missing[:4]}")
    for bname, b in list(model.named_buffers()):
        if bname in sources:              # persistent buffers saved with the weights
            _set(model, bname, ckpt.read(bname, sources[bname], None, rank, tp).to(device=device, dtype=b.dtype),
                 False)
    for mname, style in expanded.modules.items():
        install(body.get_submodule(mname), style, group, rank, tp)
    if split_embedding:                   # vocab-parallel input embedding, like the head
        ename = next(n for n, p in model.named_parameters() if p is embedding.weight)
        if ename not in sources:
            raise ValueError(f"{path}: no checkpoint tensor for {ename}")
        weight, start, real = _vocab_rows(ckpt, sources[ename].keys[0][2], embedding.num_embeddings,
                                          embedding.embedding_dim, DTYPES[dtype], device, rank, tp)
        embedding.weight = nn.Parameter(weight, requires_grad=False)
        install_vocab_embedding(embedding, start, real, group)

    vocab = shard_head = head_key = None
    vshard = VocabShard(0, 0, 0, None)
    if kind is ModelKind.CAUSAL_LM:
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        emb = model.get_input_embeddings().weight                  # loaded above: [V, H]
        head_name = f"{_head_attr(model)}.weight"
        key_name = head_name if head_name in sources and not tied else names[id(emb)]
        vocab = int(find_head(model, kind).out_features)
        head_key = sources[key_name].keys[0][2]
        hidden = emb.shape[1]
        if stage == pp - 1:
            shard_head, vshard = _vocab_head(ckpt, head_key, vocab, hidden, DTYPES[dtype],
                                             device, rank, tp, group if tp > 1 else None)
        else:                             # an earlier pipeline stage has no head: an empty one keeps dtype and H
            shard_head = nn.Linear(hidden, 0, bias=False, device=device, dtype=DTYPES[dtype])
            vshard = VocabShard(0, 0, vocab, None)
        setattr(model, _head_attr(model), shard_head)
    stage_input = None
    if layers is not None:                # this stage's layers only; the others stay meta and go
        from .pipeline import install_stage

        stage_input = install_stage(body, layers, stage, pp, int(config.get_text_config().hidden_size), DTYPES[dtype])
    model.to(device)                      # the buffers built on the host (rotary tables)
    loaded = describe(model, config, path, dtype, max_seq_len, name, head=shard_head, content=content,
                      vocab=vocab)
    if kind is not ModelKind.CAUSAL_LM:
        vshard = VocabShard(0, loaded.vocab_size, loaded.vocab_size, None)
    log.info("rank %d loaded its shards (tp=%d, plan from %s) in %.1f s; peak RSS %.0f MiB",
             rank, tp, plan.source or "-", time.perf_counter() - t0, peak_rss_mib())
    return dataclasses.replace(loaded, plan_source=plan.source, stage_input=stage_input,
                               head_checkpoint=(str(path), head_key) if head_key else None), vshard


def _stage_layers(model: nn.Module, body: nn.Module, prefix: str, kind: ModelKind, pp: int, stage: int,
                  balance: str = "compute"):
    """(this stage's layers [a, b), skip(name, param)): which parameters other stages hold. Stages balance the
    parameters that compute per token ("compute": the embedding is a lookup and counts 0; the head counts like
    any GEMM) or all parameters ("memory")."""
    from .pipeline import split_stages

    if kind is not ModelKind.CAUSAL_LM:
        raise ValueError("--pp serves causal LMs; a reward model's score head is not staged (serve it with --tp)")
    blocks = getattr(body, "layers", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"{type(body).__name__} has no `layers` list to split into --pp {pp} stages")
    sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    norm = sum(p.numel() for p in body.norm.parameters()) if hasattr(body, "norm") else 0
    bounds = split_stages(sizes, emb.numel() if balance == "memory" else 0, norm + head.numel(), pp)
    a, b = bounds[stage]
    if stage == 0:
        log.info("pipeline stages (decoder layers): %s", ", ".join(f"[{x}, {y})" for x, y in bounds))
    others = tuple(f"{prefix}layers.{i}." for i in range(len(blocks)) if not a <= i < b)
    norm_name = f"{prefix}norm."

    def skip(name: str, p) -> bool:
        return (name.startswith(others) or (stage > 0 and p is emb) or (stage < pp - 1 and p is head and p is not emb)
                or (stage < pp - 1 and name.startswith(norm_name)))
    return (a, b), skip


def _head_attr(model: nn.Module) -> str:
    head = model.get_output_embeddings()
    return next(n for n, m in model.named_children() if m is head)
