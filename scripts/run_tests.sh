#!/usr/bin/env bash
# The README's test command: set up .venv, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@" tests
