#!/usr/bin/env bash
# The README's test command: set up .venv, then run the whole suite. Arguments go to pytest: one tier
# with `-m schedule` (markers per layer and `slow`: tests/conftest.py), the quick tiers with `-m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@" tests
