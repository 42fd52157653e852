"""Distil a byte-level student from a served teacher with another tokenizer: GOLD/ULD on aligned full distributions.

    make serve                                         # the demo teacher (word-level tokenizer) on 127.0.0.1:50051
    python examples/distill_cross_tokenizer.py         # 200 steps, writes distill_cross_tokenizer.png in the temp dir (--plot PATH)

The teacher tokenizes each text itself and sends its final hidden states (H values per
token, not V) and its tokens' UTF-8 byte offsets; the student rebuilds the teacher's full
distribution with the teacher's head (fetched once, cached and verified), groups both
tokenizations into spans that end at a common byte (`logitserve.client.align`), merges each
span's probabilities and minimises the ULD distance (`logitserve.client.gold`). The student
reads bytes (vocabulary 256 + BOS), the teacher words ("t17"): no token is shared.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from curve import save_curve   # examples/curve.py, beside this script

BOS = 256


def student_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=BOS + 1, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024))


def texts(steps: int, batch: int, words: int, vocab: int = 16):
    """Sentences of the teacher's words over a 16-word slice of its vocabulary ("t3 t41 t17 ...")."""
    rng = np.random.default_rng(0)
    for _ in range(steps):
        yield [" ".join(f"t{i}" for i in rng.integers(3, 3 + vocab, words)) for _ in range(batch)]


def student_side(text: str) -> tuple[np.ndarray, np.ndarray]:
    """Byte-level tokens with a BOS, and their byte spans: (ids [n + 1], offsets [n + 1, 2])."""
    raw = np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64)
    ids = np.concatenate([[BOS], raw])
    at = np.arange(len(raw) + 1)
    offsets = np.concatenate([[[0, 0]], np.stack([at[:-1], at[1:]], 1)])
    return ids, offsets


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", default="127.0.0.1:50051")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--words", type=int, default=24)
    ap.add_argument("--merge", choices=["bayesian", "observed"], default="bayesian")
    ap.add_argument("--plot", type=Path, default=Path(tempfile.gettempdir()) / "distill_cross_tokenizer.png",
                    help="where the loss plot goes (docs/img/distill_cross_tokenizer.png is the committed one)")
    ap.add_argument("--losses", type=Path, help="also write the loss curve as json")
    args = ap.parse_args()

    from logitserve.client import TeacherClient, Wanted
    from logitserve.client.align import align_by_byte_offsets
    from logitserve.client.gold import gold_loss
    from logitserve.client.prefetch import PrefetchingTeacher

    student = student_model()
    opt = torch.optim.AdamW(student.parameters(), lr=3e-3)
    # rows for tokens 1..L-1 (the BOS has no distribution): row j is the teacher's distribution of token 1 + j
    wanted = Wanted(hidden_states=True, input_offsets=True, prompt_lengths=[1] * args.batch)
    with TeacherClient(args.teacher) as teacher:
        info = teacher.model_info()
        head = teacher.head()                                       # [V, H] once; then from the cache
        losses, t0 = [], time.perf_counter()
        for batch, r in PrefetchingTeacher(teacher, texts(args.steps, args.batch, args.words), wanted, depth=2):
            sides = [student_side(t) for t in batch]
            n = max(len(ids) for ids, _ in sides)
            ids = torch.full((len(batch), n), BOS, dtype=torch.long)
            for b, (x, _) in enumerate(sides):
                ids[b, : len(x)] = torch.from_numpy(x)
            logits = student(ids).logits                            # [B, n, 257]: row k is token k + 1's
            per_seq = []
            for b, (s_ids, s_off) in enumerate(sides):
                t_z = head(torch.from_numpy(r.hidden_states[b]))    # [Lt - 1, V] fp32: exactly the served logits
                pairs = align_by_byte_offsets(s_off[1:], r.input_offsets[b][1:])
                per_seq.append(gold_loss(logits[b, : len(s_ids) - 1], t_z, s_ids[1:], r.input_ids[b][1:], pairs,
                                         merge=args.merge))
            loss = torch.stack(per_seq).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if len(losses) % 20 == 0:
                print(f"step {len(losses):4d}  ULD {np.mean(losses[-20:]):.4f}", flush=True)
    took = time.perf_counter() - t0
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    print(f"{len(losses)} steps in {took:.1f} s; ULD {first:.4f} -> {last:.4f} (first / last 10 steps)")
    save_curve(losses, args.plot, f"ULD distance ({args.merge} spans)",
               f"byte-level student from {info.name} (word-level)", "#36c", args.losses)
    return 0 if last < first else 1


if __name__ == "__main__":
    sys.exit(main())
