#!/usr/bin/env bash
# GPU checks for sharded serving, in one command:  bash bench/gpu_check.sh
#  1. the CPU suite's equality checks (fp32, against one-process float64 transformers) with CUDA + NCCL,
#     on every (tp, cp) layout the GPUs fit: 1 GPU -> 1x1; 2 -> 1x1 2x1 1x2; 4+ -> also 2x2;
#  2. bf16 on CUDA: every layout against tp = cp = 1 bf16 on the demo model (bench/gpu_check.py).
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
echo "== bf16 consistency, layouts $layouts"
$PY bench/gpu_check.py --device cuda --layouts "$layouts"
