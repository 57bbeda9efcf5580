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
# Workers (TEST_WORKERS): one per core, as many as the memory holds (~6 GiB each at the most: a 4-rank
# pretrain_gpt.py run beside its preloaded server), 2 to 8. One more than the cores (3 on 2 cores) left
# the cores 2.6% idle instead of 4.7%, but the newest CI tier took 1082 s, and 1018 s with 2 workers
# an hour later: 12 ranks and 3 servers on 2 cores cost more than the idle time they filled.
mem_gib=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo 2>/dev/null || echo 12582912) / 1048576 ))
workers=$(nproc); [ "$workers" -le $(( mem_gib / 6 )) ] || workers=$(( mem_gib / 6 ))
[ "$workers" -le 8 ] || workers=8
[ "$workers" -ge 2 ] || workers=2
# --no-loadscope-reorder: the files run in tests/conftest.py's order (longest first), not xdist's
# (most tests first, which left the few long pretrain_gpt.py files for the end).
exec "$VENV/bin/python" -m pytest -q -n "${TEST_WORKERS:-$workers}" --dist loadfile --no-loadscope-reorder "$@" tests
