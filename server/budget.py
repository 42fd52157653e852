"""The memory budget a server starts with: the GPU's free memory when none is given, and each job's peak estimate."""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

log = logging.getLogger("logitserve.server")

DEVICE_BUDGET_FRACTION = 0.9   # of the GPU memory free after loading, when --memory-budget is not given


def device_budget(config, device, free_bytes: Optional[int] = None):
    """On a GPU without --memory-budget: a budget of 90% of the device memory free after loading, so a request
    too big for the device is refused up front instead of failing mid-batch. Unchanged on CPU or when given."""
    if config.scheduler.memory_budget_bytes is not None or getattr(device, "type", "cpu") != "cuda":
        return config
    if free_bytes is None:
        import torch

        free_bytes = torch.cuda.mem_get_info(device)[0]
    budget = int(free_bytes * DEVICE_BUDGET_FRACTION)
    log.info("--memory-budget %.1f GiB: %.0f%% of the GPU memory free after loading", budget / 2**30,
             100 * DEVICE_BUDGET_FRACTION)
    return dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, memory_budget_bytes=budget))


def memory_estimator(loaded, config, vocab_local: int, tp: int = 1, cp: int = 1,
                     pack_tokens: int = 0, pp: int = 1):
    """job -> estimated peak bytes; refuses to start when no request could ever fit the --memory-budget."""
    import numpy as np

    from logitserve.memory import ModelDims, estimate_peak_bytes
    from logitserve.spec import Job

    from .servicer import STREAM_WINDOW

    # activations are in the serving dtype, whatever the weights are stored in (FP8 weights: one byte, logitserve.memory)
    dims = ModelDims.of(loaded.model.config, vocab_local, loaded.dtype.itemsize, tp, cp)
    window = STREAM_WINDOW * config.max_message_bytes   # encoded messages a stream may hold

    # --pp: a stage holds the micro-batches it has sent ahead (pp - 1 at most) and the one it received, [tokens, H]
    stage_bytes = pp * pack_tokens * dims.hidden * max(dims.dtype_bytes, 4) if pp > 1 else 0

    def estimate(job: Job) -> int:   # pack_tokens: a packed body's tokens (Engine.pack_tokens), 0 in exact mode
        return estimate_peak_bytes(job, dims, config.engine.chunk_size, 0, window,   # buffers: Scheduler._hold
                                   pack_tokens, config.engine.min_shared_prefix > 0) + stage_bytes

    budget = config.scheduler.memory_budget_bytes
    smallest = estimate(Job(sequences=(np.zeros(1, np.int32),), scores=True))
    if budget is not None and pack_tokens and smallest > budget:
        raise ValueError(f"--memory-budget {budget / 2**20:.0f} MiB is under a packed body of {pack_tokens} tokens "
                         f"(~{smallest / 2**20:.0f} MiB; at most --max-batch-tokens): lower --max-batch-tokens "
                         f"or use --batching exact")
    return estimate
