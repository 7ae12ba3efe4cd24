# vllm-hybrid image. CPU by default; for GPUs build with a CUDA base and the cuda extra:
#   docker build -t vllm-hybrid .                                  (CPU, runs the demo)
#   docker build -t vllm-hybrid:cuda --build-arg BASE=nvidia/cuda:13.0.0-devel-ubuntu24.04 \
#       --build-arg EXTRA=cuda --build-arg TORCH_INDEX= .
#   docker run --rm vllm-hybrid                                   (the README demo)
#   docker run --rm -p 8000:8000 -v $PWD/models:/models vllm-hybrid \
#       .venv/bin/vllm-hybrid serve /models/MODEL --host 0.0.0.0 --enable-prefix-caching
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

# torch==2.13.0+cpu lives on PyTorch's CPU wheel index (the default PyPI torch is a CUDA build).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRA=cpu
ENV PIP_EXTRA_INDEX_URL=${TORCH_INDEX} \
    VLLM_HYBRID_EXTRA=${EXTRA} \
    VLLM_CPU_KVCACHE_SPACE=1 \
    HF_HUB_OFFLINE=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ python3-venv python3-dev libnuma1 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/vllm-hybrid
COPY . .
RUN PYTHON=python3 bash scripts/install.sh && rm -rf /root/.cache/pip
EXPOSE 8000
CMD [".venv/bin/vllm-hybrid", "demo", "--port", "8000"]
