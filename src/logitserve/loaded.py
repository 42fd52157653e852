"""What a loaded model is: its body, its head, its kind and names, the head's elementwise transform (loading builds it)."""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from .spec import ModelKind, ModelLimits
from .tokenizing import load_tokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class HeadTransform:
    """Elementwise maps transformers applies to a causal LM's logits after the lm_head, in its order.

    Gemma 2/3: z = cap * tanh(z / cap) (final_logit_softcapping); Cohere: z = z * logit_scale;
    Granite: z = z / logits_scaling. Elementwise, so exact on vocab-sharded logits.
    """

    multiply: float = 1.0                 # Cohere's logit_scale
    divide: float = 1.0                   # Granite's logits_scaling
    softcap: Optional[float] = None       # Gemma's final_logit_softcapping

    @property
    def identity(self) -> bool:
        return self.multiply == 1.0 and self.divide == 1.0 and not self.softcap

    def apply_(self, z: torch.Tensor) -> torch.Tensor:
        """In place on fp32 logits [N, V/tp]."""
        if self.multiply != 1.0:
            z.mul_(self.multiply)
        if self.divide != 1.0:
            z.div_(self.divide)
        if self.softcap:
            z.div_(self.softcap).tanh_().mul_(self.softcap)
        return z


def head_transform_of(config) -> HeadTransform:
    """The post-head map a causal LM's config asks for (Gemma 3 keeps it in text_config)."""
    text = getattr(config, "text_config", None) or config
    scale, scaling = getattr(text, "logit_scale", None), getattr(text, "logits_scaling", None)
    return HeadTransform(multiply=1.0 if scale is None else float(scale),
                         divide=1.0 if scaling is None else float(scaling),
                         softcap=getattr(text, "final_logit_softcapping", None))


@dataclass(frozen=True)
class LoadedModel:
    """A model split into the body that runs once and the head that runs chunk by chunk."""

    model: nn.Module          # the whole transformers model
    body: nn.Module           # base model: ids -> last hidden state [B, S, H]
    head: nn.Linear           # lm_head [V, H] or the reward head [num_labels, H] (empty on earlier pipeline stages)
    kind: ModelKind
    name: str
    content_hash: str
    architecture: str
    vocab_size: int           # lm_head.out_features; embedding rows for reward models
    max_seq_len: int
    dtype: torch.dtype
    num_labels: int           # reward models (both kinds); 0 for causal LMs
    transform: HeadTransform = field(default_factory=HeadTransform)   # causal LMs' post-head elementwise map
    plan_source: str = ""     # where the TP plan came from: transformers, logitserve, both; "" at tp = 1
    text: Optional[object] = None   # tokenizing.TextEncoder where the directory ships a tokenizer
    head_checkpoint: Optional[tuple[str, str]] = None   # (directory, key) a vocab-sharded head was read from
    stage_input: Optional[object] = None     # pipeline.StageInput on later pipeline stages
    step_separator: tuple[int, ...] = ()     # --step-separator: step scores' separator ids when a request names none
    quantization: str = ""    # an FP8 checkpoint's format and compute path (quant_load.QuantLoad.describe); "" if none

    @property
    def limits(self) -> ModelLimits:
        return ModelLimits(kind=self.kind, vocab_size=self.vocab_size, max_seq_len=self.max_seq_len,
                           step_separator=self.step_separator)


def content_hash(directory: Path) -> str:
    """blake2b over the weight files' bytes, in name order: equal weights, equal hash."""
    h = hashlib.blake2b(digest_size=16)
    files = sorted(directory.glob("*.safetensors")) or sorted(directory.glob("*.bin"))
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
    return "blake2b:" + h.hexdigest()


def kind_of(config) -> ModelKind:
    """The model's kind, from config.architectures: causal LM, sequence classifier, or token classifier."""
    archs = getattr(config, "architectures", None) or []
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return ModelKind.REWARD
    if any(a.endswith("ForTokenClassification") for a in archs):
        return ModelKind.TOKEN_REWARD
    if any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in archs):
        return ModelKind.CAUSAL_LM
    raise ValueError(f"config.architectures={archs}: need a *ForCausalLM, *ForSequenceClassification or "
                     f"*ForTokenClassification model")


def model_class(config):
    """The transformers auto class for this config's kind."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification

    return {ModelKind.CAUSAL_LM: AutoModelForCausalLM, ModelKind.REWARD: AutoModelForSequenceClassification,
            ModelKind.TOKEN_REWARD: AutoModelForTokenClassification}[kind_of(config)]


def find_head(model, kind: ModelKind) -> nn.Module:
    if kind is ModelKind.CAUSAL_LM:
        return model.get_output_embeddings()
    return getattr(model, "score", None) or getattr(model, "classifier", None)


def head_attr(model, kind: ModelKind) -> str:
    """The attribute of `model` that holds its head (lm_head, score, classifier)."""
    head = find_head(model, kind)
    return next(n for n, m in model.named_children() if m is head)


def describe(model, config, path: Path, dtype: str, max_seq_len: int | None, name: str | None,
             head: nn.Module | None = None, content: str | None = None, vocab: int | None = None) -> LoadedModel:
    """A LoadedModel for a built model (whole, or this rank's shards with `head` its vocab shard)."""
    kind = kind_of(config)
    head = head if head is not None else find_head(model, kind)
    if not isinstance(head, nn.Linear):
        raise ValueError(f"{type(model).__name__}: the head is {type(head).__name__}, expected a Linear layer")
    if kind is ModelKind.CAUSAL_LM:
        vocab, num_labels = vocab or model.get_output_embeddings().out_features, 0
    else:   # an earlier pipeline stage holds an empty head: the config says how many labels the last one has
        vocab, num_labels = model.get_input_embeddings().num_embeddings, head.out_features or config.num_labels
    model_max = int(getattr(config, "max_position_embeddings", 0) or 0) or 1 << 20
    if max_seq_len is not None and max_seq_len > model_max:
        raise ValueError(f"max_seq_len {max_seq_len} is over the model's max_position_embeddings {model_max}")
    return LoadedModel(
        model=model, body=model.base_model, head=head, kind=kind,
        name=name or path.resolve().name, content_hash=content if content is not None else content_hash(path),
        architecture=(config.architectures or [type(model).__name__])[0],
        vocab_size=int(vocab), max_seq_len=int(max_seq_len or model_max),
        dtype=DTYPES[dtype], num_labels=int(num_labels),
        transform=head_transform_of(config) if kind is ModelKind.CAUSAL_LM else HeadTransform(),
        text=load_tokenizer(path),
    )


def with_step_separator(loaded: LoadedModel, value: str) -> LoadedModel:
    """The model with --step-separator's ids: `value` is a token id or a vocabulary entry (e.g. "<extra_0>")."""
    if loaded.kind is not ModelKind.TOKEN_REWARD:
        raise ValueError(f"--step-separator {value!r}: {loaded.architecture} is not a token-classification model; "
                         f"step scores need a *ForTokenClassification (process reward) model")
    text = value.strip()
    if text.lstrip("-").isdigit():
        ids = [int(text)]
    elif loaded.text is None:
        raise ValueError(f"--step-separator {value!r}: the model directory ships no tokenizer to look it up in; "
                         f"give the token id")
    else:
        found = loaded.text.tokenizer.convert_tokens_to_ids([text])
        ids = [] if found[0] is None or found[0] == loaded.text.tokenizer.unk_token_id else found
        if not ids:
            raise ValueError(f"--step-separator {value!r} is no entry of the tokenizer's vocabulary; give the "
                             f"token as the vocabulary spells it, or its id")
    if not 0 <= ids[0] < loaded.vocab_size:
        raise ValueError(f"--step-separator {value!r}: id {ids[0]} is outside [0, {loaded.vocab_size})")
    return dataclasses.replace(loaded, step_separator=(int(ids[0]),))


def attention_kwargs(config) -> dict:
    """How transformers should build attention for exact (unpacked) serving. Softcapped attention scores
    (Gemma 2) exist only in the eager implementation: sdpa and flash kernels drop the cap, and
    transformers 5.20 picks sdpa for Gemma 2 by default, silently. Packed serving replaces the
    implementation with ours (attention.py), which caps."""
    text = getattr(config, "text_config", None) or config
    return {"attn_implementation": "eager"} if getattr(text, "attn_logit_softcapping", None) else {}
