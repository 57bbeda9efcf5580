#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install the package.
# torch==2.13.0 is installed first so that pip takes the CPU build; megatron-core is pinned by setup.py
# (the supported range, megatron_dualpipe/versions.py).
#
# Variables:
#   MEGATRON_CORE=0.19.2  another megatron-core release of the supported range, in its own environment
#                         .venv-mcore0.19.2 (VENV overrides the name). megatron-core >= 0.17 declares
#                         Requires-Python >= 3.12 but its code runs on 3.11: on an older Python it is installed
#                         with --ignore-requires-python (see README, "Versions"). Its import needs triton
#                         (megatron/core/transformer/moe/ops/paged_stash.py), which CUDA builds of torch bring and
#                         the CPU build does not: installed when missing.
#   VENV, PYTHON, TORCH_VERSION  where, with which interpreter, which torch.
set -euo pipefail
cd "$(dirname "$0")/.."
MEGATRON_CORE=${MEGATRON_CORE:-}
VENV=${VENV:-.venv${MEGATRON_CORE:+-mcore$MEGATRON_CORE}}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
fi
has() { "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }
if ! has torch; then
  "$VENV/bin/python" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
if [ -n "$MEGATRON_CORE" ]; then
  have=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('megatron-core'))" 2>/dev/null || true)
  if [ "$have" != "$MEGATRON_CORE" ]; then
    # --no-build-isolation: its source build (where no wheel fits) uses the torch installed above.
    "$VENV/bin/python" -m pip install -q setuptools wheel pybind11 numpy
    "$VENV/bin/python" -m pip install -q --no-build-isolation --ignore-requires-python "megatron-core==$MEGATRON_CORE"
  fi
  if ! has triton && grep -qs "^import triton" "$("$VENV/bin/python" -c "import importlib.util as u; \
      print(u.find_spec('megatron').submodule_search_locations[0])")/core/transformer/moe/ops/paged_stash.py"; then
    "$VENV/bin/python" -m pip install -q triton
  fi
fi
# Install the package when setup.py changed since the last install (the stamp holds its hash), so
# that later runs start at once and print nothing.
stamp="$VENV/.megatron-dualpipe-setup-py"
want=$(sha256sum setup.py | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$VENV/bin/python" -m pip install -q -e ".[test,megatron-lm]"
  echo "$want" > "$stamp"
fi
