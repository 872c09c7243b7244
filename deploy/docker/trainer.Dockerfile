# syntax=docker/dockerfile:1
# Trainer base image: PyTorch with CUDA plus refit-plane's trainer agent and nccl4py.
# Build your training code FROM it; each trainer rank imports `refitplane.trainer`.
#
#   docker build -f deploy/docker/trainer.Dockerfile -t refit-trainer:0.1.0 .
#   docker build -f deploy/docker/trainer.Dockerfile --build-arg REFIT_EXTRAS=nccl,megatron .
#
ARG TORCH_IMAGE=docker.io/pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime

FROM ${TORCH_IMAGE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG REFIT_EXTRAS=nccl
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/refit-src
COPY pyproject.toml README.md LICENSE MANIFEST.in ./
COPY refitplane ./refitplane
COPY services/trainer ./services/trainer
# Keep the base image's CUDA torch: pinned as a constraint, a conflict fails the build.
RUN python -m pip freeze | grep -iE '^(torch|numpy|triton)==' > /tmp/keep.txt \
    && python -m pip install --no-cache-dir --constraint /tmp/keep.txt . "./services/trainer[${REFIT_EXTRAS}]" \
    && rm -rf /opt/refit-src /tmp/keep.txt \
    && python -c "import refitplane.trainer" \
    && command -v refitctl

RUN groupadd --system --gid 10001 refit \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/refit \
       --shell /usr/sbin/nologin refit
ENV HOME=/home/refit \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /workspace
CMD ["refitctl", "--help"]
