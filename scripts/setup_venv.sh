#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install the package.
# torch==2.13.0 is installed first so that pip takes the CPU build; megatron-core is pinned by setup.py.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
fi
if ! "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
  "$VENV/bin/python" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
# Install the package when setup.py changed since the last install (the stamp holds its hash), so
# that later runs start at once and print nothing.
stamp="$VENV/.megatron-dualpipe-setup-py"
want=$(sha256sum setup.py | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$VENV/bin/python" -m pip install -q -e ".[test,megatron-lm]"
  echo "$want" > "$stamp"
fi
