#!/usr/bin/env bash
# A TP=2 teacher in one container on a machine with 2 GPUs: torchrun starts the two ranks, rank 0 serves gRPC.
#   bash deploy/tp2-one-container.sh /models/teacher [image]
set -euo pipefail
MODEL=${1:?usage: $0 MODEL_DIR [IMAGE]}
IMAGE=${2:-logitserve:cuda}
exec docker run --rm --gpus '"device=0,1"' --ipc=host -p 50051:50051 -v "$MODEL":/model:ro \
    --entrypoint torchrun "$IMAGE" \
    --nproc-per-node 2 --no-python logitserve serve --model /model --dtype bf16 --tp 2 \
    --host 0.0.0.0 --port 50051
