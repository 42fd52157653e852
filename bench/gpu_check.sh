#!/usr/bin/env bash
# The device check, one prepared script for the lent GPU machine:   bash bench/gpu_check.sh [--dry-run]
#
# On the lent machine (device tool: carry .whl, made here by `make gpu-wheels`; nothing installs from an index
# there) it installs the carried wheels into a target directory, prints every version and what the installed
# torch offers the CUDA paths, then runs each step on its own (one failure never hides the rest):
#   versions      python, torch + CUDA, transformers, grpcio, protobuf, logitserve, GPUs, capability probes
#   equality      fp32 outputs on CUDA against one-process float64 transformers (tests/test_parallel_serving.py:
#                 every output, filters, the HTTP routes), at every (tp, cp) layout the GPUs fit
#   nccl          the same at tp 2 / cp 2 / pp 2 under NCCL (needs 2+ GPUs: printed as skipped, never as passed)
#   bf16          bf16 against fp32 on the demo model, within a stated bound (bench/gpu_check.py --against-fp32)
#   fp8           FP8 checkpoints of the 1b shape (DeepSeek-style 128x128 blocks, compressed-tensors per channel): their
#                 GEMMs ran in FP8 (torch scaled_mm), logprobs against the same weights dequantized to bf16 within the
#                 stated bounds (top-1 agreement, max and mean |logprob diff|), weights, peak GPU memory, tokens/s
#                 beside bf16 (bench/gpu_check.py --fp8)
#   flash         a bf16 packed batch ran varlen flash attention, not the sdpa fallback
#   load          load time and peak GPU memory of the 1b demo shape in bf16
#   throughput    packed and exact against a batched in-process bf16 forward, 1b shape (bench/batching.py)
#   groups        RL-shaped groups, prompt_lengths and shared prompts, 1b shape (bench/groups.py)
# It writes its log and a JSON summary to $OUT (else bench/results/gpu_check-<time>/), exits non-zero if a step
# failed, and is sized for under 8 minutes on one H200.
#
# --dry-run runs the same steps here on the CPU (fp32 where the GPU runs bf16, the demo shape, one repeat),
# with wheels for this machine's Python (.whl-dry, built by bench/gpu_wheels.sh on first use): CI runs it
# (tests/test_gpu_check.py), so the script itself cannot rot.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
PY=${PYTHON:-python3}
DIR=${OUT:-bench/results/gpu_check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$DIR"
LOG="$DIR/gpu_check.log"
STEPS="$DIR/steps.jsonl"
: > "$LOG"
: > "$STEPS"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

record() {   # name status seconds note
  "$PY" -c 'import json, sys; print(json.dumps(dict(zip(("name", "status", "seconds", "note"), sys.argv[1:]))))' \
    "$1" "$2" "$3" "${4:-}" >> "$STEPS"
}
step() {     # name timeout_s command...: runs it, records pass/fail and its seconds, never stops the script
  local name=$1 limit=$2 start end status
  shift 2
  echo "== $name"
  start=$(date +%s)
  if timeout "$limit" "$@"; then status=pass; else status=fail; fi
  end=$(date +%s)
  echo "== $name: $status in $((end - start)) s"
  record "$name" "$status" "$((end - start))"
}
skip() {     # name why
  echo "== $1: skipped ($2)"
  record "$1" skipped 0 "$2"
}

if [ "$DRY" = 1 ]; then
  # the dry run proves each step still runs, at the smallest size: one equality test (the suite runs them all),
  # the reward group shape only
  WHEELS=.whl-dry DEVICE=cpu DTYPE=fp32 SHAPE=demo REPEATS=1 WORKLOADS=4x64 EQUALITY="every_output" GROUP_SHAPES=reward
  FP8=channel     # a CPU has torch's row-wise FP8 GEMM, not the block-scaled one
  rm -rf "$WHEELS"; bash bench/gpu_wheels.sh "$WHEELS" here    # fresh: a stale logitserve wheel tests old code
else
  WHEELS=.whl DEVICE=cuda DTYPE=bf16 SHAPE=1b REPEATS=3 WORKLOADS=8x512,64x64 EQUALITY="every_output or filters or http"
  FP8=block,channel
  GROUP_SHAPES=chat,reward
fi
SITE=$(mktemp -d)/site
if ls "$WHEELS"/*.whl > /dev/null 2>&1; then
  step install 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    "$WHEELS"/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
  skip install "no wheels in $WHEELS (make gpu-wheels here, then carry .whl): using what is installed"
fi

step versions 120 "$PY" - "$DEVICE" <<'EOF'
import json, platform, subprocess, sys
import google.protobuf, grpc, numpy, torch, transformers
import logitserve
from logitserve.capabilities import probe
device = sys.argv[1]
gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(json.dumps({"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                  "transformers": transformers.__version__, "grpcio": grpc.__version__,
                  "protobuf": google.protobuf.__version__, "numpy": numpy.__version__,
                  "logitserve": logitserve.__version__, "logitserve_from": logitserve.__file__, "gpus": gpus,
                  "capabilities": probe(device).as_dict()}, indent=1))
if device == "cuda" and not gpus:
    sys.exit("no GPU visible to torch")
EOF

NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
[ "$DRY" = 1 ] && NGPU=0
LAYOUTS=1x1
[ "$NGPU" -ge 2 ] && LAYOUTS=1x1,2x1,1x2,1x1x2
[ "$NGPU" -ge 4 ] && LAYOUTS=1x1,2x1,1x2,2x2,1x1x2,2x1x2

step equality 300 env LOGITSERVE_TEST_DEVICE="$DEVICE" LOGITSERVE_TEST_LAYOUTS=1x1 \
  "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_parallel_serving.py -k "$EQUALITY"
if [ "$NGPU" -ge 2 ]; then
  step nccl 300 env LOGITSERVE_TEST_DEVICE=cuda LOGITSERVE_TEST_LAYOUTS="$LAYOUTS" \
    "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_parallel_serving.py -k "every_output and not tp1-cp1-pp1"
else
  skip nccl "tp 2 / cp 2 / pp 2 under NCCL need 2 GPUs; this machine has $NGPU"
fi

step bf16 240 "$PY" bench/gpu_check.py --device "$DEVICE" --against-fp32
step fp8 240 "$PY" bench/gpu_check.py --device "$DEVICE" --fp8 "$FP8" --shape "$SHAPE" --dtype "$DTYPE" \
  --repeats "$REPEATS"

if [ "$DEVICE" = cuda ]; then
  step flash 120 "$PY" - <<'EOF'
import numpy as np, torch
from logitserve.attention import FLASH
from logitserve.demo import demo_dir
from logitserve.engine import Engine, EngineConfig
from logitserve.loading import load_model
from logitserve.spec import Job, LogprobsOpts
loaded = load_model(demo_dir("causal"), dtype="bf16")
loaded.model.to("cuda")
engine = Engine(loaded, EngineConfig())
seqs = tuple(np.random.default_rng(0).integers(3, 32000, n).astype(np.int32) for n in (17, 300, 64))
for _ in engine.batch_steps([Job(seqs, logprobs=LogprobsOpts())]):
    pass
print(f"flash varlen calls: {FLASH.calls}, flash on: {FLASH.enabled}")
assert FLASH.calls > 0 and FLASH.enabled, "bf16 packed attention did not run on varlen flash"
EOF
else
  skip flash "the CPU has no flash varlen kernel: packed attention runs sdpa per length there"
fi

step hidden 240 "$PY" - "$DEVICE" <<'EOF'
import sys, numpy as np, torch
sys.path.insert(0, "bench")
from run import start_server
from logitserve.client import TeacherClient
device = sys.argv[1]
proc, address = start_server("--dtype", "bf16", "--device", device)   # bf16 teacher: the head's rounding matters
try:
    seqs = [np.random.default_rng(0).integers(3, 32000, n) for n in (17, 300)]
    with TeacherClient(address) as c:
        r = c.forward(seqs, hidden_states=True, full_logits=True)
        for where in dict.fromkeys([device, "cpu"]):                 # the student's head on the GPU and on the host
            head = c.head(cache=False, devices=[where])
            worst = tol = 0.0
            for h, z in zip(r.hidden_states, r.full_logits):
                diff = (head(torch.from_numpy(h)).cpu() - torch.from_numpy(z)).abs().max().item()
                # fp32 logits: accumulation order only; logits rounded to bf16: at most one bf16 step of |z|
                tol = max(tol, 1e-3 if head.spec.logits_dtype == "fp32" else 2.0 ** -7 * float(np.abs(z).max()))
                worst = max(worst, diff)
            print(f"hidden: head on {where} ({head.spec.dtype} weights, server logits {head.spec.logits_dtype}): "
                  f"max |rebuilt - served| {worst:.2e} (bound {tol:.2e})")
            assert worst <= tol, (where, worst, tol)
finally:
    proc.terminate(); proc.wait(60)
EOF

step load 240 "$PY" - "$DEVICE" "$DTYPE" "$SHAPE" <<'EOF'
import sys, time, torch
from logitserve.hostmem import peak_rss_mib
from logitserve.demo import demo_dir
from logitserve.loading import load_model
device, dtype, shape = sys.argv[1:]
directory = demo_dir("causal", shape)                             # builds the demo shape once (not timed)
if device == "cuda":
    torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
t = time.perf_counter()
loaded = load_model(directory, dtype=dtype, device=device)        # the one loader every layout uses
seconds = time.perf_counter() - t
gpu = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
params = sum(p.numel() for p in loaded.model.parameters()) / 1e9
print(f"load: {shape} ({params:.2f} B parameters, {dtype}) on {device} in {seconds:.1f} s; peak GPU memory "
      f"{gpu:.2f} GiB; peak host RSS {peak_rss_mib():.0f} MiB")
EOF

step throughput 300 "$PY" bench/batching.py --device "$DEVICE" --dtype "$DTYPE" --shapes "$SHAPE" \
  --workloads "$WORKLOADS" --repeats "$REPEATS"
step groups 300 "$PY" bench/groups.py --device "$DEVICE" --dtype "$DTYPE" --model-shape "$SHAPE" \
  --shapes "$GROUP_SHAPES" --repeats "$REPEATS"

"$PY" - "$STEPS" "$DIR/gpu_check.json" "$DRY" <<'EOF'
import json, sys
steps = [json.loads(line) for line in open(sys.argv[1])]
summary = {"dry_run": sys.argv[3] == "1", "steps": steps,
           "failed": [s["name"] for s in steps if s["status"] == "fail"],
           "skipped": [s["name"] for s in steps if s["status"] == "skipped"]}
json.dump(summary, open(sys.argv[2], "w"), indent=1)
print("summary:", json.dumps({s["name"]: s["status"] for s in steps}))
EOF
rm -f "$STEPS"
grep -q '"status": "fail"' "$DIR/gpu_check.json" && exit 1
exit 0
