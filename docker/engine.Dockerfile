# syntax=docker/dockerfile:1
# mmgate engine image: the engine process (vision encoder, encoder scheduler, hand-off backends) with torch.
#
# CPU (default): python:3.11-slim-bookworm and the CPU torch build.
#   docker build -f docker/engine.Dockerfile -t mmgate-engine .
# CUDA: a CUDA runtime base (Ubuntu 24.04: its python3 is 3.12; 22.04's 3.10 is too old for mmgate) and the CUDA
# torch build. The torch wheels bring their own CUDA libraries; the base supplies the NVIDIA container runtime
# environment (NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES) and the CUDA user-space conventions.
#   docker build -f docker/engine.Dockerfile -t mmgate-engine:cuda \
#       --build-arg BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   docker run --gpus all -p 8100:8100 -v "$PWD/configs/engine.yaml:/etc/mmgate/engine.yaml:ro" mmgate-engine:cuda
#
# Configuration: /etc/mmgate/engine.yaml (configs/engine.yaml baked in; mount your own over it). A local Hugging Face
# checkpoint directory for the vision tower can be mounted read-only (e.g. at /models) and named in model.* there.
# Pinned installs: docker/requirements-engine.txt (docker/lock.sh) with --no-deps, then torch==TORCH_VERSION from
# TORCH_INDEX_URL, constrained to the same pins (its own CUDA libraries are pinned exactly by the torch release).

ARG BASE=python:3.11-slim-bookworm

# The base plus a Python >= 3.11 (already there on python:* images; apt's python3 on a CUDA/Ubuntu base). Both later
# stages start here, so the venv built in one runs on exactly the same interpreter in the other.
FROM ${BASE} AS python
RUN if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
 && python3 -c 'import sys; assert sys.version_info >= (3, 11), f"mmgate needs Python >= 3.11, the base has {sys.version}"'

FROM python AS build
# TORCH_VERSION: keep equal to the `engine` extra's pin in pyproject.toml (tests/deploy checks it).
# TORCH_INDEX_URL: .../whl/cpu for the CPU build, .../whl/cuXYZ for a CUDA build.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
COPY docker/requirements-engine.txt docker/requirements-build.txt docker/
RUN python3 -m venv /opt/mmgate \
 && /opt/mmgate/bin/pip install --no-deps --only-binary=:all: -r docker/requirements-engine.txt \
 && /opt/mmgate/bin/pip install --only-binary=:all: --index-url "${TORCH_INDEX_URL}" \
        --constraint docker/requirements-engine.txt "torch==${TORCH_VERSION}" \
 && python3 -m venv /opt/build \
 && /opt/build/bin/pip install --no-deps --only-binary=:all: -r docker/requirements-build.txt
COPY pyproject.toml README.md ./
COPY gateway gateway
COPY engine_adapter engine_adapter
COPY encoder_scheduler encoder_scheduler
COPY serving serving
COPY processor_geometry processor_geometry
RUN /opt/build/bin/pip wheel --no-deps --no-build-isolation --wheel-dir /wheels . \
 && /opt/mmgate/bin/pip install --no-deps /wheels/*.whl \
 && /opt/mmgate/bin/pip check \
 && /opt/mmgate/bin/python -c "import torch, encoder_scheduler, engine_adapter.__main__; print('torch', torch.__version__)"

FROM python
RUN groupadd --system --gid 10001 mmgate \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin mmgate
COPY --from=build /opt/mmgate /opt/mmgate
COPY docker/healthcheck.py /opt/mmgate/healthcheck.py
COPY configs/engine.yaml /etc/mmgate/engine.yaml
# MMGATE_ENGINE_SERVER__HOST: in a container the engine listens on every interface so that the gateway reaches it over
# the container network (configs/engine.yaml says 127.0.0.1). An environment variable rather than --host, so that
# `-e MMGATE_ENGINE_SERVER__HOST=...` still overrides it. Keep the port off public networks: the API is internal
# (set server.auth_token, i.e. MMGATE_ENGINE_SERVER__AUTH_TOKEN, and the gateway's MMGATE_ENGINE__AUTH_TOKEN, when
# anything but the gateway can reach it).
ENV PATH=/opt/mmgate/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    MMGATE_ENGINE_SERVER__HOST=0.0.0.0
USER 10001:10001
# server.port (8100 by default): the internal API, /healthz and /metrics. Publish it only to the gateway's network.
EXPOSE 8100
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "/opt/mmgate/healthcheck.py", "--config", "/etc/mmgate/engine.yaml", "--env-prefix", "MMGATE_ENGINE_", \
         "--default-port", "8100", "--path", "/healthz"]
STOPSIGNAL SIGTERM
CMD ["mmgate", "engine", "--config", "/etc/mmgate/engine.yaml"]
