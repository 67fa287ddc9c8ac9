# Image for the DDP examples: the pinned Python environment from requirements.txt plus examples/.
# Default base is NVIDIA's small CUDA image (driver hooks only; the torch wheels bring the CUDA 13.0
# runtime libraries). Any Debian/Ubuntu base with python3 3.11 or 3.12 works, for example
#   docker build --build-arg BASE_IMAGE=local/ddp-base:bookworm -t ddp-examples .
ARG BASE_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04
FROM ${BASE_IMAGE}

ARG USER_NAME=ddp

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UV_NO_CACHE=1

# The CUDA base images ship without Python; bases that already have python3 and venv skip apt.
# hadolint ignore=DL3008
RUN if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv "$VIRTUAL_ENV" \
    && useradd --create-home --shell /bin/bash "$USER_NAME" \
    && mkdir -p /app/runs /snapshots /data \
    && chown "$USER_NAME:$USER_NAME" /app /app/runs /snapshots /data

# Dependencies before the examples: editing an example only rebuilds the last layers.
# uv comes from the same pin file, installed with the venv's pip.
COPY requirements.txt /tmp/requirements.txt
RUN pip install "$(grep '^uv==' /tmp/requirements.txt)" \
    && uv pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt \
    && python -c 'import torch, torchvision, accelerate, ray.train; print("torch", torch.__version__)'

WORKDIR /app
COPY examples/ /app/examples/
COPY tools/doctor.py tools/launch.py docker/ray-node.sh /app/tools/

USER ${USER_NAME}
CMD ["python", "examples/multinode.py", "--help"]
