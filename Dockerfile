# Image for the DDP examples: the runtime group's pins (pins/runtime.txt) plus examples/, bytecode compiled.
# Default base is NVIDIA's small CUDA image (driver hooks only; the torch wheels bring the CUDA 13.0
# runtime libraries). Any Debian/Ubuntu base with python3 3.11 or 3.12 works, for example
#   docker build --build-arg BASE_IMAGE=local/ddp-base:bookworm -t ddp-examples .
# Two targets: the default one (runtime pins: torch, torchvision, accelerate), which every node of the
# torchrun jobs pulls, and `--target ray`, the same plus Ray (compose/ray.yaml):
#   docker build --target ray -t ddp-examples-ray .
ARG BASE_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04
# Packages of the pins that the image leaves out (below)
ARG LEAVE_OUT=triton

# What the image is built from, as one checksum of the build context (docker/image-inputs.sh), for the
# image's /app/.image-inputs: `make image-current` compares it with the working tree's, so an image is
# up to date or not alike for make and docker compose, whichever built it. A stage of its own, so that the
# context is not copied into the image.
FROM ${BASE_IMAGE} AS inputs
COPY . /context/
RUN sh /context/docker/image-inputs.sh /context > /image-inputs

FROM ${BASE_IMAGE} AS runtime

ARG USER_NAME=ddp

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# PYTHONDONTWRITEBYTECODE: the bytecode is compiled here, at build time; no process writes into the image.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UV_NO_CACHE=1

# Python where the base lacks it (the CUDA images), and the RDMA userspace NCCL loads for InfiniBand and
# RoCE (libibverbs, the device providers, librdmacm; ibv_devinfo to list the adapters): without it NCCL
# falls back to TCP sockets. About 5 MB; docs/docker.md says how to see what NCCL chose.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv ca-certificates libibverbs1 ibverbs-providers librdmacm1 ibverbs-utils \
    && apt-get clean && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
    && python3 -m venv "$VIRTUAL_ENV" \
    && useradd --create-home --shell /bin/bash "$USER_NAME" \
    && mkdir -p /app/runs /snapshots /data \
    && chown "$USER_NAME:$USER_NAME" /app /app/runs /snapshots /data

# Dependencies before the examples: editing an example only rebuilds the last layers.
# LEAVE_OUT: triton (0.69 GB) is torch.compile's GPU code generator, and it builds every kernel's launcher
# with a C compiler, which this image does not carry: it could not run here. Images that add a compiler
# for torch.compile build with --build-arg LEAVE_OUT= to keep it.
ARG LEAVE_OUT
COPY pins/ docker/install-pins.sh /tmp/pins/
RUN /tmp/pins/install-pins.sh runtime \
    && python -c 'import torch, torchvision, accelerate; print("torch", torch.__version__)'

WORKDIR /app
COPY examples/ /app/examples/
COPY tools/ docker/ray-node.sh /app/tools/
RUN python -m compileall -q /app/examples /app/tools
# The checksum above, and the base as a label: a rebuild without BASE_IMAGE keeps the image's base.
COPY --from=inputs /image-inputs /app/.image-inputs
ARG BASE_IMAGE
LABEL ddp.base=${BASE_IMAGE}

USER ${USER_NAME}
CMD ["python", "examples/multinode.py", "--help"]

# The Ray image: the runtime image plus the ray pins, in one more layer.
FROM runtime AS ray
ARG USER_NAME=ddp
ARG LEAVE_OUT
# hadolint ignore=DL3066
USER root
COPY pins/ docker/install-pins.sh /tmp/pins/
RUN /tmp/pins/install-pins.sh ray && python -c 'import ray.train.torch'
USER ${USER_NAME}

# The default target: the runtime image.
FROM runtime
