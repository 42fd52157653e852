"""TP plans as data: transformers' `base_model_tp_plan` where a model ships one, ours where it has none or wastes.

A plan maps module (or parameter) patterns of the base model, `layers.*.self_attn.q_proj`,
to transformers' style names. `expand` turns it into what the loader and the TP pass
need: for every parameter, the dimension it is split on (and into how many packed
parts), and for every module, the communication its forward needs. Layouts that
cannot work are refused at start-up, naming the config dimension.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Style:
    """What one of transformers' TP style names means for inference on local shards."""

    split: str                 # "out": output features (dim -2 of a weight), "in": input features (dim -1), "": none
    comm: str = ""             # module forward: "gather" output, "reduce" output, "split" input then reduce, ""
    packed: int = 1            # the output dim holds `packed` equal parts (fused gate|up): split each alike


# transformers' names (transformers/distributed/tensor_parallel.py) -> our reading for inference.
STYLES = {
    "colwise": Style("out"),
    "colwise_rep": Style("out", "gather"),
    "colwise_gather_output": Style("out", "gather"),
    "rowwise": Style("in", "reduce"),
    "rowwise_rep": Style("in", "split"),
    "rowwise_split_input": Style("in", "split"),
    "packed_colwise": Style("out", packed=2),
    "moe_tp_experts": Style("", "reduce"),            # each rank ran its slice of every expert: sum
    "replicated_with_grad_allreduce": Style(""),      # a gradient concern only: replicated at inference
    "mla_kv_a_proj": Style(""),       # DeepSeek's MLA latent projection: replicated, its grad all-reduce aside
    "replicate": Style(""),
    # The input embedding, split by vocabulary rows with a masked lookup and an all-reduce: the loader does
    # that for every model's input embedding (shard_load, tp_forward.install_vocab_embedding), so the plan
    # entry adds nothing. transformers >= 5.20 adds it for tied embeddings; GPT-NeoX and others declare it.
    "embedding_rowwise": Style(""),
}

# Where transformers has no plan, or one that costs more than it must for inference.
# phi3: transformers all-gathers gate_up's output and splits it again for down_proj, an
# all-gather of [N, 2I] per layer; split as a packed column then a row layer, it needs none.
OUR_PLANS: dict[str, dict[str, str]] = {}
OUR_OVERRIDES: dict[str, dict[str, str]] = {
    "phi3": {"layers.*.mlp.gate_up_proj": "packed_colwise", "layers.*.mlp.down_proj": "rowwise"},
}


@dataclass(frozen=True)
class Plan:
    rules: tuple[tuple[str, str], ...]     # (pattern relative to the base model, style name)
    source: str                            # "transformers", "logitserve" or "transformers+logitserve"


@dataclass(frozen=True)
class ParamShard:
    dim: int                # dimension split across TP ranks
    parts: int = 1          # packed parts along `dim`, each split alike


def _text_config(config):
    return getattr(config, "text_config", None) or config


def resolve_plan(config) -> Plan:
    """The TP plan for this config; ValueError when neither transformers nor we have one."""
    text = _text_config(config)
    model_type = getattr(text, "model_type", None) or config.model_type
    theirs = dict(getattr(text, "base_model_tp_plan", None) or {})
    ours = OUR_PLANS.get(model_type) or {}
    override = OUR_OVERRIDES.get(model_type) or {}
    if not theirs and not ours:
        raise ValueError(f"model_type {model_type!r} has no TP plan (transformers ships no base_model_tp_plan "
                         f"for it and logitserve has none): serve it with --tp 1")
    ours = {**_tp_experts(text, theirs), **ours}
    rules = {**theirs, **ours, **override}
    unknown = sorted({s for s in rules.values() if s not in STYLES})
    if unknown:
        raise ValueError(f"model_type {model_type!r}: TP styles {unknown} are not supported for serving "
                         f"(supported: {sorted(STYLES)}); serve it with --tp 1")
    source = "transformers" if theirs and not (ours or override) else "logitserve" if not theirs \
        else "transformers+logitserve"
    return Plan(tuple(rules.items()), source)


def _tp_experts(text, theirs: dict) -> dict[str, str]:
    """Fused MoE experts that transformers (>= 5.2x) plans for expert parallelism only (token dispatch): served here as
    transformers 5.20 planned them for TP, each rank holding its slice of every expert's intermediate dimension and
    one all-reduce of the experts' output, so each rank reads only its slice of the experts."""
    ep = dict(getattr(text, "base_model_ep_plan", None) or {})
    out = {}
    for module, style in ep.items():
        if style == "ep_dispatch_experts" and module not in theirs and f"{module}.gate_up_proj" in ep \
                and f"{module}.down_proj" in ep:
            out.update({f"{module}.gate_up_proj": "packed_colwise", f"{module}.down_proj": "rowwise",
                        module: "moe_tp_experts"})
    return out


def check_layout(config, tp: int) -> None:
    """Refuse, before loading anything, a split that cannot work: each named dimension must divide by tp."""
    if tp == 1:
        return
    text = _text_config(config)
    heads = getattr(text, "num_attention_heads", None)
    dims = {"num_attention_heads": heads,
            "num_key_value_heads": getattr(text, "num_key_value_heads", None) or heads,
            "intermediate_size": getattr(text, "intermediate_size", None),
            "moe_intermediate_size": getattr(text, "moe_intermediate_size", None)}
    if getattr(text, "num_local_experts", None) and not dims["moe_intermediate_size"]:
        dims["intermediate_size (each expert's)"] = dims.pop("intermediate_size")
    for name, value in dims.items():
        if value is not None and value % tp:
            raise ValueError(f"config.{name.split(' ')[0]}={value} does not divide by --tp {tp}: "
                             f"choose a tp that divides it")


def _wildcard(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


@dataclass(frozen=True)
class Expanded:
    params: dict[str, ParamShard]          # base-model parameter name -> its split
    modules: dict[str, Style]              # base-model module name -> its forward's communication
    unused: tuple[str, ...]                # patterns that named nothing in this model


def expand(plan: Plan, body) -> Expanded:
    """Apply a plan's patterns to a (meta) base model: each parameter's split and each module's communication."""
    rules = dict(plan.rules)
    used: set[str] = set()
    params: dict[str, ParamShard] = {}
    modules: dict[str, Style] = {}
    for mname, module in body.named_modules():
        pattern = _wildcard(mname)
        style = STYLES[rules[pattern]] if pattern in rules else None
        if style is not None:
            used.add(pattern)
            if style.comm:
                modules[mname] = style
        for pname, p in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            own = rules.get(_wildcard(full))
            if own is not None:                  # a rule naming the parameter itself (fused MoE experts)
                used.add(_wildcard(full))
                shard = _param_shard(STYLES[own], p.ndim, pname)
            elif style is not None:
                shard = _param_shard(style, p.ndim, pname)
            else:
                continue
            if shard is not None:
                params[full] = shard
    return Expanded(params, modules, tuple(sorted(set(rules) - used)))


def _param_shard(style: Style, ndim: int, pname: str) -> Optional[ParamShard]:
    if style.split == "out":
        return ParamShard(dim=max(0, ndim - 2) if ndim > 1 else 0, parts=style.packed)
    if style.split == "in":
        return ParamShard(dim=ndim - 1) if ndim > 1 else None    # a row layer's bias is added once, whole
    return None
