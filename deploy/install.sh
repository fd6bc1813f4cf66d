#!/usr/bin/env bash
# Installs laya-fleet through constraints.txt (the tested versions); what `make setup` and deploy/Dockerfile run.
#
#   deploy/install.sh [VENV] [PIP ARGS...]     e.g. deploy/install.sh .venv        (default: -e ".[dev]")
#                                                   deploy/install.sh /home/ray/anaconda3 ".[fast]"
#
# VENV (argument, else $VENV, else .venv; relative to the repository root) is created when it has no bin/python;
# an existing environment (a venv, or the Ray image's conda) is used as it is.
# With no torch and no CUDA (no nvidia-smi), $TORCH_CPU (default torch==2.13.0, the CPU build this machine's
# index serves) goes in first, so nothing pulls a multi-GB CUDA build; TORCH_CPU= (empty) skips that step where
# the host has no GPU but the CUDA build is wanted (an image build). $PY makes the venv (default python3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv="${1:-${VENV:-.venv}}"
[ $# -gt 0 ] && shift
[ $# -gt 0 ] || set -- -e ".[dev]"
TORCH_CPU="${TORCH_CPU-torch==2.13.0}"

test -x "$venv/bin/python" || "${PY:-python3}" -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
if [ -n "$TORCH_CPU" ] && ! command -v nvidia-smi >/dev/null 2>&1 && ! "$py" -c "import torch" 2>/dev/null; then
    "$py" -m pip install -q "$TORCH_CPU"
fi
"$py" -m pip install -q -c constraints.txt "$@"
