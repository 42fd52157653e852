"""The benchmark's cases: in-process baselines (forward only, the floor, our engine) and served requests."""
from __future__ import annotations

import numpy as np
import torch


def in_process_cases(model, model_dir, seqs: list) -> dict:
    """name -> zero-argument callable, all on the same [B, L] batch and the same weights."""
    from logitserve.engine import Engine, EngineConfig
    from logitserve.loading import load_model
    from logitserve.spec import Job, LogprobsOpts, TopKOpts

    ids = torch.as_tensor(np.stack(seqs), dtype=torch.long)                 # [B, L]
    targets = ids[:, 1:, None]                                              # [B, L-1, 1]
    engine = Engine(load_model(model_dir), EngineConfig(chunk_size=512))
    job_seqs = tuple(s.astype(np.int32) for s in seqs)

    @torch.inference_mode()
    def forward_only():
        return model(ids).logits                                            # [B, L, V]

    @torch.inference_mode()
    def floor_logprobs():       # what a careful in-process user writes: no [B, L, V] log_softmax copy
        z = model(ids).logits[:, :-1].float()
        return z.gather(-1, targets)[..., 0] - torch.logsumexp(z, -1)

    @torch.inference_mode()
    def naive_logprobs():
        return torch.log_softmax(model(ids).logits[:, :-1].float(), -1).gather(-1, targets)

    def floor_topk(k):
        @torch.inference_mode()
        def run():
            return model(ids).logits.float().topk(k, dim=-1)
        return run

    return {
        "forward only (logits, nothing else)": forward_only,
        "floor: logprobs (forward + logsumexp/gather)": floor_logprobs,
        "naive: logprobs (forward + full log_softmax)": naive_logprobs,
        "floor: topk k=20 (forward + topk)": floor_topk(20),
        "floor: topk k=100 (forward + topk)": floor_topk(100),
        "logitserve engine in-process: logprobs": lambda: list(engine.run(Job(job_seqs, logprobs=LogprobsOpts()))),
        "logitserve engine in-process: topk k=20": lambda: list(engine.run(Job(job_seqs, topk=TopKOpts(20)))),
    }


def served_cases(client, seqs: list, only=None) -> tuple[dict, dict]:
    """(name -> callable, name -> Wanted) for requests through a TeacherClient."""
    from logitserve.client import Wanted

    wanted = {
        "logprobs": Wanted(logprobs=True),
        "topk k=20 fp32": Wanted(topk=20),
        "topk k=20 bf16": Wanted(topk=20, topk_dtype="bf16"),
        "topk k=100 fp32": Wanted(topk=100),
        "topk k=100 bf16": Wanted(topk=100, topk_dtype="bf16"),
        "full logits bf16": Wanted(full_logits=True, logits_dtype="bf16"),
    }
    if only is not None:
        wanted = {k: v for k, v in wanted.items() if k in only}
    cases = {name: (lambda w=w: client.submit(seqs, w).result()) for name, w in wanted.items()}
    return cases, wanted
