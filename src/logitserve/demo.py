"""The embedded default models: Llama-style teachers and reward models (outcome, process) of a few shapes, seeded.

Shapes: `demo` (the default: 2 layers, hidden 256, its cost mostly the lm_head), `body`
(8 layers, hidden 768: a body-heavy shape for benchmarks) and `1b` (16 layers, hidden
2048, ~1.1B parameters, saved in bf16: for GPU checks), `wide` (2 layers, hidden 1024, Qwen's
151936-token vocabulary: full-vocab benchmarks) and `tiny` (1 layer, hidden 64, vocabulary 1024: compute
negligible, so a benchmark on it measures the host's cost per request, sequence and step). All are built locally, no download.
Every kind's tokenizer has a chat template (DEMO_CHAT_TEMPLATE), so `messages` routes run on the demo; the process
reward model's vocabulary has Qwen2.5-Math-PRM's step separator `<extra_0>` (its last id, DEMO_STEP_SEPARATOR).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEMO_VERSION = "v3"     # v3: a chat template in every kind, `<extra_0>` in the PRM's vocabulary
DEMO_SEED = 20261202
DEMO_KINDS = ("causal", "reward", "prm")
# kind -> architecture: a teacher, an outcome reward model (one score), a process reward model (two classes per
# token, as Qwen2.5-Math-PRM's head: [wrong, right], read at each step separator)
DEMO_ARCHS = {"causal": "LlamaForCausalLM", "reward": "LlamaForSequenceClassification",
              "prm": "LlamaForTokenClassification"}
# shape -> (hidden, intermediate, layers, heads, kv heads, saved dtype)
DEMO_SHAPES = {
    "demo": (256, 688, 2, 8, 4, "float32"),
    "body": (768, 2048, 8, 12, 4, "float32"),
    "1b": (2048, 5632, 16, 32, 8, "bfloat16"),
    "wide": (1024, 2816, 2, 16, 8, "float32"),
    "tiny": (64, 128, 1, 4, 2, "float32"),
}
# shape -> vocabulary size when not 32000: `wide` has Qwen's 151936 (full-vocab benchmarks: bench/full_vocab.py)
DEMO_VOCAB = {"wide": 151936, "tiny": 1024}
# The demo's chat template, in words its word-level vocabulary has: BOS, then per message a role word (system t11,
# user t12, assistant t13, tool t14), its content and EOS; the generation prompt is the assistant's word.
DEMO_ROLE_WORDS = {"system": "t11", "developer": "t11", "user": "t12", "assistant": "t13", "tool": "t14"}
DEMO_CHAT_TEMPLATE = (
    "{%- set roles = " + repr(DEMO_ROLE_WORDS) + " -%}{{ bos_token }}"
    "{%- for m in messages %} {{ roles[m['role']] }} {{ m['content'] }} {{ eos_token }}{%- endfor -%}"
    "{%- if add_generation_prompt %} t13{% endif %}")
# The process reward model's step separator (Qwen2.5-Math-PRM's), its vocabulary's last id in place of that word.
DEMO_STEP_SEPARATOR = "<extra_0>"


def demo_config(kind: str, shape: str = "demo"):
    from transformers import LlamaConfig

    hidden, inter, layers, heads, kv, _ = DEMO_SHAPES[shape]
    return LlamaConfig(
        vocab_size=DEMO_VOCAB.get(shape, 32000), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads, max_position_embeddings=8192,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        # Wider than the usual 0.02 so the demo's logits spread like a trained model's.
        initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        num_labels=2 if kind == "prm" else 1,
        architectures=[DEMO_ARCHS[kind]],
    )


def demo_tokenizer(vocab_size: int = 32000, chat_template: bool = False, step_separator: bool = False):
    """A word-level tokenizer with one token per id ("t5" is id 5), so ids print and peers can load the directory;
    with DEMO_CHAT_TEMPLATE when `chat_template`; with DEMO_STEP_SEPARATOR as its last id (a special token, split
    out of any text, as in Qwen2.5-Math-PRM's "step<extra_0>step") when `step_separator`."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"t{i}": i for i in range(3, vocab_size)})
    if step_separator:
        del vocab[f"t{vocab_size - 1}"]
        vocab[DEMO_STEP_SEPARATOR] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])   # BOS, as Llama
    extra = [AddedToken(DEMO_STEP_SEPARATOR, special=True, normalized=False)] if step_separator else []
    if extra:
        tok.add_special_tokens(extra)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<unk>", chat_template=DEMO_CHAT_TEMPLATE if chat_template else None,
                                   additional_special_tokens=[DEMO_STEP_SEPARATOR] if step_separator else None)


def export_demo(directory: str | os.PathLike, kind: str = "causal", shape: str = "demo") -> Path:
    """Write the demo model of `kind` and `shape` as a normal Hugging Face directory; same bytes every time."""
    import torch
    import transformers

    if kind not in DEMO_KINDS:
        raise ValueError(f"demo kind {kind!r}: choose one of {DEMO_KINDS}")
    if shape not in DEMO_SHAPES:
        raise ValueError(f"demo shape {shape!r}: choose one of {sorted(DEMO_SHAPES)}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    cls = getattr(transformers, DEMO_ARCHS[kind])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(DEMO_SEED)
        model = cls(demo_config(kind, shape)).float().eval().to(getattr(torch, DEMO_SHAPES[shape][-1]))
    model.save_pretrained(out, safe_serialization=True)
    demo_tokenizer(DEMO_VOCAB.get(shape, 32000), chat_template=True, step_separator=kind == "prm").save_pretrained(out)
    _readable(out)
    return out


def _readable(directory: Path) -> None:
    """Every file as the umask makes a new one (transformers writes the weights through a 0600 temporary file)."""
    umask = _umask()
    for f in directory.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~umask)


def cache_root() -> Path:
    base = os.environ.get("LOGITSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "logitserve")
    return Path(base)


def demo_dir(kind: str = "causal", shape: str = "demo") -> Path:
    """The cached demo directory of `kind` and `shape`, built on first use (atomically, so racing builders agree)."""
    final = cache_root() / (f"demo-{kind}-{DEMO_VERSION}" if shape == "demo" else f"demo-{kind}-{shape}-{DEMO_VERSION}")
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".demo-{kind}-", dir=final.parent))
    try:
        export_demo(tmp, kind, shape)
        if not (tmp / "config.json").exists() or not any(tmp.glob("*.safetensors")):
            # transformers' save_pretrained writes weights only on rank 0 once torch.distributed is initialized:
            # an incomplete directory must never become the cache every rank then reads
            raise RuntimeError(f"building the demo model wrote no config or weights into {tmp}; build it before "
                               f"torch.distributed is initialized (logitserve serve does)")
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _umask() -> int:
    """The process's umask, read without setting it (os.umask sets it, racing other threads' new files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022
