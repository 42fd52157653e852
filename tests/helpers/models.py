"""Small real transformers models, an in-process server on loopback, plain-torch float64 references."""
from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import torch

VOCAB = 1003   # odd on purpose: does not divide by any tp


def build_model(directory: Path, arch: str, kind: str = "causal", vocab: int = VOCAB, hidden: int = 64,
                layers: int = 2, max_pos: int = 512, seed: int = 0, num_labels: int = 1) -> Path:
    """Save a small random model of `arch` as a normal HF directory; kind: causal, reward (a sequence classifier)
    or token (a token classifier: a process reward model)."""
    import transformers as tf

    common = dict(vocab_size=vocab, num_labels=num_labels, pad_token_id=0)
    if arch == "llama":
        cfg = tf.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                             initializer_range=0.1, tie_word_embeddings=False, **common)
        cls = {"causal": tf.LlamaForCausalLM, "reward": tf.LlamaForSequenceClassification,
               "token": tf.LlamaForTokenClassification}[kind]
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                             initializer_range=0.1, tie_word_embeddings=False, **common)
        cls = {"causal": tf.Qwen2ForCausalLM, "reward": tf.Qwen2ForSequenceClassification,
               "token": tf.Qwen2ForTokenClassification}[kind]
    elif arch == "gpt2":
        cfg = tf.GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=max_pos,
                            initializer_range=0.1, bos_token_id=1, eos_token_id=2, **common)
        cls = tf.GPT2LMHeadModel if kind == "causal" else tf.GPT2ForSequenceClassification
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    model.save_pretrained(directory, safe_serialization=True)
    return directory


class Reference:
    """Plain transformers on the full tensor in float64: the independent reference."""

    def __init__(self, directory: Path):
        import transformers as tf

        cfg = tf.AutoConfig.from_pretrained(directory)
        arch = cfg.architectures[0]
        auto = (tf.AutoModelForSequenceClassification if arch.endswith("ForSequenceClassification") else
                tf.AutoModelForTokenClassification if arch.endswith("ForTokenClassification") else tf.AutoModelForCausalLM)
        moe = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
        extra = dict(experts_implementation="eager") if moe else {}     # grouped_mm has no float64 kernel
        # eager attention is the definition: sdpa drops Gemma 2's score softcapping (and is transformers
        # 5.20's default for it)
        self.model = auto.from_pretrained(directory, dtype=torch.float64, attn_implementation="eager", **extra).eval()
        self.fp32 = auto.from_pretrained(directory, dtype=torch.float32).eval()

    @torch.no_grad()
    def logits(self, seq, temperature: float = 1.0, fp32: bool = False) -> torch.Tensor:
        """[L, V] logits / T (float64, or the fp32 model's own fp32 logits)."""
        model = self.fp32 if fp32 else self.model
        z = model(torch.as_tensor(np.asarray(seq), dtype=torch.long)[None]).logits[0]
        return z / temperature


def ref_token_logprobs(z: torch.Tensor, seq, top_k=None, top_p=None) -> np.ndarray:
    """SPEC.md token logprobs from full [L, V] logits, with the filter rule written out by sort."""
    z = z.double()
    if top_k is not None:
        kth = torch.sort(z, dim=-1, descending=True).values[:, top_k - 1 : top_k]
        z = torch.where(z >= kth, z, torch.full_like(z, float("-inf")))
    if top_p is not None:
        sorted_z = torch.sort(z, dim=-1, descending=True).values
        probs = torch.softmax(sorted_z, dim=-1)
        cum_before = torch.cumsum(probs, dim=-1) - probs
        keep_sorted = cum_before < top_p           # the prefix up to the entry that reaches p
        last = keep_sorted.sum(dim=-1, keepdim=True) - 1
        tau = sorted_z.gather(-1, last)
        z = torch.where(z >= tau, z, torch.full_like(z, float("-inf")))
    lp = torch.log_softmax(z, dim=-1)
    seq = torch.as_tensor(np.asarray(seq), dtype=torch.long)
    out = torch.zeros(len(seq), dtype=torch.float64)
    out[1:] = lp[:-1].gather(-1, seq[1:, None])[:, 0]
    return out.numpy()


def random_seqs(rng: np.random.Generator, lengths, vocab: int = VOCAB) -> list[np.ndarray]:
    return [rng.integers(0, vocab, n).astype(np.int64) for n in lengths]


class ServerThread:
    """A real logitserve gRPC server on 127.0.0.1, run by its own event loop on a thread."""

    def __init__(self, loaded, config=None, run_batch=None):
        from logitserve.server.app import create_server
        from logitserve.server.config import ServerConfig

        config = config or ServerConfig(port=0)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.running = asyncio.run_coroutine_threadsafe(create_server(loaded, config, run_batch=run_batch), self.loop).result()
        self.address = f"127.0.0.1:{self.running.port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.running.stop(0), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


def filter_rows_decided(z: torch.Tensor, top_k=None, top_p=None, margin: float = 1e-5) -> np.ndarray:
    """[L] bool: rows whose filtered set cannot flip under a perturbation of the logits below `margin`
    (no value within margin of the k-th largest, no cumulative probability within margin of p).
    Where a row is not decided, fp32 rounding alone may move a token in or out of the kept set."""
    z = z.double()
    ok = torch.ones(z.shape[0], dtype=torch.bool)
    sorted_z = torch.sort(z, dim=-1, descending=True).values
    if top_k is not None and top_k < z.shape[-1]:
        ok &= (sorted_z[:, top_k - 1] - sorted_z[:, top_k]) > margin
        sorted_z = torch.where(sorted_z >= sorted_z[:, top_k - 1 : top_k], sorted_z, torch.full_like(sorted_z, float("-inf")))
    if top_p is not None and top_p < 1.0:
        probs = torch.softmax(sorted_z, dim=-1)
        cum_before = torch.cumsum(probs, dim=-1) - probs
        ok &= ((cum_before - top_p).abs() > margin).all(dim=-1)
    return ok.numpy()


def ref_rank_bounds(z: torch.Tensor, seq, gap: float = 1e-5) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's rank of each target (1 + the ids whose logit is above the target's; row 0: 0), as [lo, hi] bounds
    that admit ids within `gap` of the target either way (near-ties). z: [L, V] float64 -> [L] x2."""
    seq = torch.as_tensor(np.asarray(seq, dtype=np.int64))
    rows = z[:-1]                                                              # row t-1 predicts token t
    target = rows.gather(-1, seq[1:, None])                                    # [L-1, 1]
    lo = (rows > target + gap).sum(-1) + 1
    hi = (rows > target - gap).sum(-1)                                         # the target itself counts once
    zero = torch.zeros(1, dtype=lo.dtype)
    return torch.cat([zero, lo]).numpy(), torch.cat([zero, hi]).numpy()
