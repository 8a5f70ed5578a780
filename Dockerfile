# tuneledger's training image: CUDA 12.1, Python 3.10 in a venv, torch 2.5.1, every package pinned
# with hashes. It stands apart from the host's Python and torch; the host needs only Docker and the
# NVIDIA container toolkit. Build with `make image` (docker compose build, settings from .env).
#
# Needs BuildKit (the default builder since Docker 23; DOCKER_BUILDKIT=1 on older engines) for the
# pip cache and the optional pip.conf secret.
#
# Mirrors are settings, never code: every download below reads a build arg (README "Mirrors").
# None of them lands in the image's environment or files. Build args do show in `docker history`,
# so a mirror that needs credentials goes in a pip.conf passed as a secret instead:
#   docker build --secret id=pip.conf,src=$HOME/.config/pip/pip.conf ...

# CUDA 12.1 with cuDNN on Ubuntu 22.04 (whose Python is 3.10). torch brings its own cuDNN 9 and
# CUDA 12.1 libraries as wheels; the base gives the CUDA runtime layout the NVIDIA toolkit expects.
# CI swaps in a local Debian base (see .ci/image-build.sh).
ARG BASE_IMAGE=nvidia/cuda:12.1.1-cudnn8-runtime-ubuntu22.04
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# ---- system packages: Python 3.10 ---------------------------------------------------------------
# APT_MIRROR replaces the host of Ubuntu's (or Debian's) archive for this step only, e.g.
# https://mirrors.tuna.tsinghua.edu.cn; the base's sources are restored afterwards
# (docker/apt-install.sh, shared with Dockerfile.quant).
# PYTHON / PYTHON_APT_PACKAGES: Ubuntu's python3.10; CI's Debian stand-in passes its own
# (compose: IMAGE_PYTHON, IMAGE_PYTHON_APT_PACKAGES).
ARG APT_MIRROR=
ARG PYTHON=python3.10
ARG PYTHON_APT_PACKAGES="python3.10 python3.10-venv"
COPY docker/apt-install.sh /tmp/apt-install.sh
RUN set -eux; \
    /tmp/apt-install.sh ca-certificates ${PYTHON_APT_PACKAGES}; \
    rm /tmp/apt-install.sh; \
    command -v setpriv; \
    "$PYTHON" -m venv /opt/venv

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

# ---- Python packages: the lock, torch, flash-attn ----------------------------------------------
# See docker/install.sh for how torch and its nvidia-* wheels are pinned, and README "The image".
# TORCH_INDEX_URL: torch 2.5.1+cu121 comes from here (PyTorch's cu121 index, a mirror of it, or a
#   flat folder of its wheels).
#   Empty: PyPI's torch 2.5.1 from the lock, a CUDA 12.4 build; then set TORCH_CUDA=12.4 too.
# FLASH_ATTN_WHEEL_URL: the upstream prebuilt wheel for torch 2.5, CUDA 12, the pre-C++11 ABI
#   (as torch 2.5.1's wheels are built) and cp310, or the same file on a mirror (same sha256).
#   Empty: no flash-attn; the trainer uses SDPA and records which backend ran.
# PIP_CERT: pip trusts the system CA store, so a CA added to the base is honoured.
ARG PIP_INDEX_URL=
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_TRUSTED_HOST=
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu121
ARG TORCH_CUDA=12.1
ARG FLASH_ATTN_WHEEL_URL=https://github.com/Dao-AILab/flash-attention/releases/download/v2.8.3/flash_attn-2.8.3%2Bcu12torch2.5cxx11abiFALSE-cp310-cp310-linux_x86_64.whl
ARG FLASH_ATTN_SHA256=c59be18fa934e132e5a405bcca6673af1d9d09a0036a9e081133bc7b7fc2992e
# The pinned versions, stated once: the labels below show them and install.sh fails the build when
# what it installed differs. Bump them with the lock.
ARG PYTHON_VERSION=3.10
ARG TORCH_VERSION=2.5.1
ARG TRANSFORMERS_VERSION=5.17.0
ARG PEFT_VERSION=0.21.0
ARG ACCELERATE_VERSION=1.15.0
ARG BITSANDBYTES_VERSION=0.50.2
ARG DATASETS_VERSION=5.2.0
ARG FLASH_ATTN_VERSION=2.8.3
COPY requirements.txt /tmp/lock/
COPY docker/install.sh docker/lockfilter.py docker/lock-hash docker/torch-cu121-wheel.txt docker/torch-cu121.txt docker/image-extras.txt /tmp/lock/docker/
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=pip.conf,target=/etc/pip.conf \
    /tmp/lock/docker/install.sh && rm -rf /tmp/lock

# ---- the project --------------------------------------------------------------------------------
# Installed editable from /workspace, the working directory: relative paths in configs (configs/,
# src/tuneledger/data/demo.jsonl, models/, runs/, .cache/) mean the same here as in a checkout.
# docker-compose.yml mounts models/, data/, runs/, .cache/ and configs/ over it.
ARG USER_UID=1000
ARG USER_GID=1000
COPY docker/entrypoint.sh /usr/local/bin/tuneledger-entrypoint
COPY docker/monitor-health /usr/local/bin/monitor-health
COPY docker/add-user.sh /usr/local/sbin/tuneledger-add-user
COPY docker/fetch-model /usr/local/bin/fetch-model
COPY pyproject.toml README.md /workspace/
COPY src /workspace/src
COPY configs /workspace/configs
RUN set -eux; \
    tuneledger-add-user "$USER_UID" "$USER_GID"; \
    python -m pip install --disable-pip-version-check --no-cache-dir --no-index --no-deps --no-build-isolation -e /workspace; \
    mkdir -p /workspace/models /workspace/data /workspace/runs /workspace/.cache; \
    chown -R "$USER_UID:$USER_GID" /workspace; \
    tuneledger --version

# Caches go under /workspace/.cache (a volume), so any UID the container runs as can write them.
# HF_ENDPOINT (a hub mirror) and USE_MODELSCOPE_HUB=1 (ModelScope for weights, docker/fetch-model)
# are read at run time; compose passes them from .env. No endpoint, proxy or token is set here.
# TOKENIZERS_PARALLELISM is a switch, not a secret (DL3064 matches "TOKEN"):
# hadolint ignore=DL3064
ENV HF_HOME=/workspace/.cache/huggingface \
    MODELSCOPE_CACHE=/workspace/.cache/modelscope \
    XDG_CACHE_HOME=/workspace/.cache \
    TRITON_CACHE_DIR=/workspace/.cache/triton \
    MPLCONFIGDIR=/workspace/.cache/matplotlib \
    TOKENIZERS_PARALLELISM=false \
    NCCL_DEBUG=WARN

ARG BASE_IMAGE
# Which commit, when, from where: `make image` (docker/build) fills these from git and the clock,
# the GitHub workflow from its run. Declared here, after every RUN, so a new value rebuilds nothing.
ARG IMAGE_REVISION=
ARG IMAGE_CREATED=
ARG IMAGE_SOURCE=
# The lock files' hash (docker/lock-hash trainer): two images with the same one hold the same pins.
ARG IMAGE_LOCKS_SHA256=
LABEL org.opencontainers.image.title="tuneledger" \
      org.opencontainers.image.description="Measure, then fine-tune: distributed LoRA/QLoRA of ~7B chat models" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.revision="${IMAGE_REVISION}" \
      org.opencontainers.image.created="${IMAGE_CREATED}" \
      org.opencontainers.image.source="${IMAGE_SOURCE}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      io.tuneledger.python="${PYTHON_VERSION}" \
      io.tuneledger.cuda="${TORCH_CUDA}" \
      io.tuneledger.torch="${TORCH_VERSION}" \
      io.tuneledger.transformers="${TRANSFORMERS_VERSION}" \
      io.tuneledger.peft="${PEFT_VERSION}" \
      io.tuneledger.accelerate="${ACCELERATE_VERSION}" \
      io.tuneledger.bitsandbytes="${BITSANDBYTES_VERSION}" \
      io.tuneledger.datasets="${DATASETS_VERSION}" \
      io.tuneledger.flash-attn="${FLASH_ATTN_VERSION}" \
      io.tuneledger.locks="requirements.txt docker/torch-cu121-wheel.txt docker/torch-cu121.txt docker/image-extras.txt" \
      io.tuneledger.locks.sha256="${IMAGE_LOCKS_SHA256}"

USER ${USER_UID}:${USER_GID}
WORKDIR /workspace
# The CLI answers without importing torch: a cheap check that the venv and the package are whole.
HEALTHCHECK --interval=60s --timeout=20s --start-period=20s --retries=3 CMD ["tuneledger", "--version"]
ENTRYPOINT ["/usr/local/bin/tuneledger-entrypoint"]
CMD ["tuneledger", "--help"]
