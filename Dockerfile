# logitserve server image.
#   CPU (default):  docker build -t logitserve .
#   GPU (CUDA):     docker build -t logitserve:cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#     The same slim base: torch's CUDA wheels bring the CUDA runtime, cuBLAS, cuDNN and NCCL as pip packages
#     (nvidia-*), matched to that torch, so a CUDA base image would only duplicate them; the host needs the
#     NVIDIA driver and container toolkit (docker run --gpus all).
#   No internet at build time: fill deploy/wheelhouse/ on a machine that has it, then build offline:
#     pip download -d deploy/wheelhouse torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
#     pip download -d deploy/wheelhouse ".[server]" setuptools wheel grpcio-tools==1.71.0
#     docker build -t logitserve:cuda --build-arg OFFLINE=1 .
#   Any base with python3 (3.11+) and its venv module: --build-arg BASE=... (CI builds on a Debian bookworm root
#     filesystem made by mmdebstrap, no registry needed: deploy/container_check.sh builds, runs and stops this image).
#   Run:            docker run -p 50051:50051 logitserve                      (embedded demo model)
#                   docker run --gpus all -p 50051:50051 -p 8000:8000 -v /models/teacher:/model:ro logitserve:cuda \
#                     serve --host 0.0.0.0 --model /model --dtype bf16 --http-port 8000
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG OFFLINE=0

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    LOGITSERVE_CACHE=/home/logitserve/.cache/logitserve

# OFFLINE=1: every package from deploy/wheelhouse, no index (see above). Mounted, not copied: no wheel stays in a layer.
RUN --mount=type=bind,source=deploy/wheelhouse,target=/wheelhouse \
    python3 -m venv /opt/venv \
 && if [ "$OFFLINE" = 1 ]; then \
      pip install --no-index --find-links /wheelhouse "torch==${TORCH_VERSION}"; \
    else \
      pip install --upgrade pip && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"; \
    fi

WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY proto ./proto
COPY src ./src
COPY server ./server
COPY client ./client
RUN --mount=type=bind,source=deploy/wheelhouse,target=/wheelhouse \
    if [ "$OFFLINE" = 1 ]; then pip install --no-index --find-links /wheelhouse ".[server]"; \
    else pip install ".[server]"; fi && rm -rf /src/build

RUN useradd --create-home --uid 10001 logitserve
USER logitserve
WORKDIR /home/logitserve
# Bake the embedded demo models into the image so the container starts without building them.
RUN python -c "from logitserve.demo import demo_dir; demo_dir('causal'); demo_dir('reward')"

EXPOSE 50051 8000
# grpc.health.v1 on the serving port: SERVING once the model is loaded, NOT_SERVING while draining.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["logitserve", "health", "127.0.0.1:50051"]
# SIGTERM: NOT_SERVING at once, in-flight requests get --grace-s (5 s), then exit 0: inside `docker stop`'s 10 s.
STOPSIGNAL SIGTERM
ENTRYPOINT ["logitserve"]
CMD ["serve", "--host", "0.0.0.0", "--port", "50051"]
