# logitserve server image.
#   CPU (default):  docker build -t logitserve .
#   GPU (CUDA):     docker build -t logitserve:cuda \
#                     --build-arg BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#                     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   Run:            docker run -p 50051:50051 logitserve                      (embedded demo model)
#                   docker run -p 50051:50051 -v /models/teacher:/model:ro logitserve serve --model /model
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    LOGITSERVE_CACHE=/home/logitserve/.cache/logitserve

# CUDA base images come without Python; the slim Python image already has it.
RUN if ! command -v python3 >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv && \
      rm -rf /var/lib/apt/lists/*; \
    fi \
 && python3 -m venv /opt/venv \
 && pip install --upgrade pip \
 && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY proto ./proto
COPY src ./src
COPY server ./server
COPY client ./client
RUN pip install ".[server]" && rm -rf /src/build

RUN useradd --create-home --uid 10001 logitserve
USER logitserve
WORKDIR /home/logitserve
# Bake the embedded demo models into the image so the container starts without building them.
RUN python -c "from logitserve.demo import demo_dir; demo_dir('causal'); demo_dir('reward')"

EXPOSE 50051
# grpc.health.v1 on the serving port: SERVING once the model is loaded, NOT_SERVING while draining.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["logitserve", "health", "127.0.0.1:50051"]
ENTRYPOINT ["logitserve"]
CMD ["serve", "--host", "0.0.0.0", "--port", "50051"]
