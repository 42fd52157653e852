#!/usr/bin/env bash
# GPU checks for sharded serving, in one command:  bash bench/gpu_check.sh
#  1. the CPU suite's equality checks (fp32, against one-process float64 transformers) with CUDA + NCCL,
#     on every (tp, cp) layout the GPUs fit: 1 GPU -> 1x1; 2 -> 1x1 2x1 1x2; 4+ -> also 2x2;
#  2. bf16 on CUDA: every layout, and 1x1 in exact batching, against tp = cp = 1 bf16 on the demo model
#     (bench/gpu_check.py);
#  3. throughput by batch shape on CUDA: a ~1.1B Llama (the `1b` demo shape, built locally, bf16), 8x512,
#     64x64, a mixed batch and reward 64x128, packed and exact against the batched in-process floor
#     (bench/batching.py);
#  4. RL-shaped groups on CUDA bf16 (bench/groups.py: agentic, chat, math, reward, shared prefixes on and off).
#     The whole script is sized to finish in under 8 minutes on one GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
n=$($PY -c "import torch; print(torch.cuda.device_count())")
echo "CUDA devices: $n"; nvidia-smi -L || true
if [ "$n" -lt 1 ]; then echo "no GPU: nothing to check"; exit 1; fi
layouts="1x1"
[ "$n" -ge 2 ] && layouts="1x1,2x1,1x2"
[ "$n" -ge 4 ] && layouts="1x1,2x1,1x2,2x2"
echo "== fp32 equality with NCCL, layouts $layouts"
LOGITSERVE_TEST_DEVICE=cuda LOGITSERVE_TEST_LAYOUTS=$layouts \
  $PY -m pytest -q -ra tests/test_parallel_serving.py -k "every_output or filters"
if [ "$n" -ge 2 ]; then
  echo "== sharded loading + TP plans from transformers with NCCL: the architecture matrix at TP 2"
  LOGITSERVE_TEST_DEVICE=cuda $PY -m pytest -q -ra tests/test_architectures.py -k "tp2"
fi
echo "== bf16 consistency, layouts $layouts"
$PY bench/gpu_check.py --device cuda --layouts "$layouts,1x1:exact"
echo "== throughput by batch shape, CUDA bf16, 1b shape"
$PY bench/batching.py --device cuda --dtype bf16 --shapes 1b --workloads 8x512,64x64,mixed,64x128 --repeats 5
echo "== RL groups (prompt_lengths, shared prompts), CUDA bf16, 1b shape"
$PY bench/groups.py --device cuda --dtype bf16 --model-shape 1b --repeats 5
