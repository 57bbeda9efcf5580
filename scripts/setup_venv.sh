#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install the package.
# torch==2.13.0 is installed first so that pip takes the CPU build; megatron-core is pinned by setup.py.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  "$VENV/bin/python" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
"$VENV/bin/python" -m pip install -q -e ".[test,megatron-lm]"
