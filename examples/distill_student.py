"""Distil a small student from a served teacher: forward KL on the teacher's top-64.

    make serve                                   # the demo teacher on 127.0.0.1:50051
    python examples/distill_student.py           # 300 steps, writes distill_student.png in the temp dir (--plot PATH)

The student (a 2-layer Llama sharing the demo teacher's tokenizer) never holds the teacher:
each batch's top-k comes over gRPC through PrefetchingTeacher, two batches ahead of the step.
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


def student_model(vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512))


def batches(steps: int, batch: int, length: int, words: int = 256):
    """Random sentences over a 256-word slice of the vocabulary: enough repetition to learn from in minutes."""
    rng = np.random.default_rng(0)
    for _ in range(steps):
        yield rng.integers(3, 3 + words, (batch, length))                # [B, L] token ids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", default="127.0.0.1:50051")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--tail", choices=["renormalize", "zero", "bucket"], default="renormalize",
                    help="outside the teacher's top-k (logitserve.client.distill)")
    ap.add_argument("--plot", type=Path, default=Path(tempfile.gettempdir()) / "distill_student.png",
                    help="where the loss plot goes (docs/img/distill_student.png is the committed one)")
    ap.add_argument("--losses", type=Path, help="also write the loss curve as json")
    args = ap.parse_args()

    from logitserve.client import TeacherClient, Wanted, tokenizer_hash
    from logitserve.client.distill import TeacherBatch, kd_loss
    from logitserve.client.prefetch import PrefetchingTeacher
    from logitserve.demo import demo_tokenizer

    with TeacherClient(args.teacher) as teacher:
        info = teacher.model_info()
        assert tokenizer_hash(demo_tokenizer()) == info.tokenizer_hash, "the student must share the teacher's vocab"
        student = student_model(info.vocab_size)
        opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
        wanted = Wanted(topk=args.topk, topk_as_logprobs=True, topk_tail=True)
        losses, t0 = [], time.perf_counter()
        for ids, tb in PrefetchingTeacher(teacher, batches(args.steps, args.batch, args.length),
                                          wanted, ids_of=list, depth=2, attach=TeacherBatch.from_result):
            logits = student(torch.from_numpy(ids)).logits                      # [B, L, V]
            loss = kd_loss(logits, tb.values, tb.ids, kl="forward", tail=args.tail, teacher_tail=tb.tail,
                           mask=tb.mask)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if len(losses) % 25 == 0:
                print(f"step {len(losses):4d}  forward KL {np.mean(losses[-25:]):.4f}", flush=True)
    took = time.perf_counter() - t0
    head, tail = np.mean(losses[:10]), np.mean(losses[-10:])
    print(f"{len(losses)} steps in {took:.1f} s; forward KL {head:.4f} -> {tail:.4f} (first / last 10 steps)")
    save_curve(losses, args.plot, f"forward KL (top-{args.topk}, {args.tail})", f"student distilled from {info.name}",
               "#c33", args.losses)
    return 0 if tail < head else 1


if __name__ == "__main__":
    sys.exit(main())
