"""One-shot GPU check of the engine (device tool: carry .whl from `make gpu-wheels`, pip install --target them, run this):
flash varlen, exact mode bitwise independent of the batch, packed within bf16 rounding of exact and of fp32."""
import time

import numpy as np
import torch

from logitserve.attention import FLASH
from logitserve.demo import demo_dir
from logitserve.engine import Batching, Engine, EngineConfig
from logitserve.events import JobFailed, JobPiece
from logitserve.loading import load_model
from logitserve.spec import Job, LogprobsOpts, OutputKind, SliceOpts, TopKOpts

d = demo_dir("causal", "demo")
out = {}


def collect(engine, jobs):
    got = [dict() for _ in jobs]
    for step in engine.batch_steps(jobs):
        for e in step.events:
            assert not isinstance(e, JobFailed), e
            if isinstance(e, JobPiece):
                got[e.job].setdefault((e.piece.output, e.piece.sequence), []).append(e.piece)
    return got


def dense(pieces):
    full = pieces[0].full_shape
    a = np.full(full, np.nan, np.float64)
    for p in pieces:
        idx = tuple(slice(o, o + n) for o, n in zip(p.offset, p.tensor.shape))
        a[idx] = p.tensor.float().numpy()
    return a


rng = np.random.default_rng(0)
seqs = tuple(rng.integers(3, 30000, n).astype(np.int32) for n in (17, 300, 64, 5, 129))
job = Job(seqs, logprobs=LogprobsOpts(ranks=True), topk=TopKOpts(8, as_logprobs=True, tail_mass=True),
          full_logits=SliceOpts(vocab_start=0, vocab_end=256))
other = Job(tuple(rng.integers(3, 30000, n).astype(np.int32) for n in (40, 200)), temperature=0.7,
            logprobs=LogprobsOpts(top_p=0.9))
t0 = time.perf_counter()
packed = Engine(load_model(d, dtype="bf16", device="cuda"), EngineConfig(batching=Batching.PACKED))
out["load_s"] = round(time.perf_counter() - t0, 2)
torch.cuda.synchronize()
out["peak_gpu_mib"] = torch.cuda.max_memory_allocated() >> 20
p = collect(packed, [job, other])
out["flash_calls"], out["flash_on"] = FLASH.calls, FLASH.enabled
exact = Engine(load_model(d, dtype="bf16", device="cuda"), EngineConfig(batching=Batching.EXACT))
e_alone = collect(exact, [job])
e_batch = collect(exact, [other, job])
bitwise = all(torch.equal(a.tensor, b.tensor) for k in e_alone[0] for a, b in zip(e_alone[0][k], e_batch[1][k]))
out["exact_bitwise_batch_independent"] = bitwise
fp32 = Engine(load_model(d, dtype="fp32", device="cuda"), EngineConfig(batching=Batching.EXACT))
f = collect(fp32, [job])[0]
diffs = {}
for kind in (OutputKind.TOKEN_LOGPROBS, OutputKind.TOPK_TAIL, OutputKind.FULL_LOGITS):
    for i in range(len(seqs)):
        a, b, c = dense(p[0][(kind, i)]), dense(e_alone[0][(kind, i)]), dense(f[(kind, i)])
        ok = np.isfinite(c)
        diffs.setdefault(kind.name, [0.0, 0.0])
        diffs[kind.name][0] = max(diffs[kind.name][0], float(np.abs(a - b)[ok].max()))
        diffs[kind.name][1] = max(diffs[kind.name][1], float(np.abs(a - c)[ok].max()))
out["max_abs packed-vs-exact, packed-vs-fp32"] = diffs
ranks = [dense(p[0][(OutputKind.TOKEN_RANKS, i)]) for i in range(len(seqs))]
out["rank_min"] = min(float(r[1:].min()) for r in ranks)
print(out)
assert out["flash_calls"] > 0 and out["flash_on"] and bitwise
assert diffs["TOKEN_LOGPROBS"][1] < 0.5 and diffs["FULL_LOGITS"][1] < 0.5, diffs
print("ENGINE GPU CHECK OK")
