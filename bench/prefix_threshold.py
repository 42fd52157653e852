"""How long a shared prefix must be to pay: the body-heavy demo, G = 8 responses of R = 256 tokens to a prompt of
S tokens, asked with prompt_lengths = S, engine in process with sharing on (min_shared_prefix 1) and off, medians.

`python bench/prefix_threshold.py` prints one row per S; the server's --min-shared-prefix default (64) comes
from where sharing stops losing."""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np


def main() -> int:
    from logitserve.demo import demo_dir
    from logitserve.engine import Engine, EngineConfig
    from logitserve.loading import load_model
    from logitserve.spec import Job, LogprobsOpts

    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    loaded = load_model(demo_dir("causal", "body"))
    engines = {name: Engine(loaded, EngineConfig(min_shared_prefix=m)) for name, m in (("off", 0), ("on", 1))}
    rng = np.random.default_rng(0)
    print("| S | G x R | off s | on s | off / on |\n|---:|---|---:|---:|---:|")
    for S in (8, 16, 32, 64, 128, 256):
        prompt = rng.integers(3, 32000, S)
        seqs = tuple(np.concatenate([prompt, rng.integers(3, 32000, 256)]).astype(np.int32) for _ in range(8))
        job = Job(sequences=seqs, logprobs=LogprobsOpts(), prompt_lengths=(S,) * 8)
        times = {name: [] for name in engines}
        for _ in range(repeats + 1):          # the first round warms up
            for name, eng in engines.items():
                t = time.perf_counter()
                list(eng.batch_steps([job]))
                times[name].append(time.perf_counter() - t)
        off, on = (statistics.median(times[n][1:]) for n in ("off", "on"))
        print(f"| {S} | 8 x 256 | {off:.3f} | {on:.3f} | {off / on:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
