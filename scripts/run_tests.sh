#!/usr/bin/env bash
# The README's test command: set up .venv, then run the whole suite. Arguments go to pytest: one tier
# with `-m schedule` (markers per layer and `slow`: tests/conftest.py), the quick tiers with `-m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
# MEGATRON_CORE=0.19.2: the suite on that megatron-core release, in its own environment (setup_venv.sh).
VENV=${VENV:-.venv${MEGATRON_CORE:+-mcore${MEGATRON_CORE:-}}}
VENV=$VENV bash scripts/setup_venv.sh
# Bytecode is written for the suite (__pycache__ is git-ignored): its tests start hundreds of
# interpreters, and with PYTHONDONTWRITEBYTECODE set each one compiled the package and the Megatron-LM
# checkout (which ships no __pycache__) from source again: 0.5-1 s of CPU per Megatron-LM rank.
unset PYTHONDONTWRITEBYTECODE
# --no-loadscope-reorder: the files run in tests/conftest.py's order (longest first), not xdist's
# (most tests first, which left the few long pretrain_gpt.py files for the end).
exec "$VENV/bin/python" -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder "$@" tests
