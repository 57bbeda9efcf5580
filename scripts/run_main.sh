#!/usr/bin/env bash
# The README's main command: set up .venv, then train a small GPT on text with DualPipe on this
# machine and compare with 1F1B (python -m megatron_dualpipe.demo: it checks the arguments,
# prepares the data on the first run, starts torchrun with 4 processes -- pp=4, gloo and the CPU
# mode without a GPU -- and lists the files it wrote). Arguments go to the demo (--help lists them);
# NPROC and MASTER_PORT set --nproc and --master-port. MEGATRON_CORE=0.19.2 runs it on that
# megatron-core release (the newest supported) in its own environment .venv-mcore0.19.2 (setup_venv.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv${MEGATRON_CORE:+-mcore${MEGATRON_CORE:-}}}
VENV=$VENV bash scripts/setup_venv.sh
export MEGATRON_DUALPIPE_PROG="bash scripts/run_main.sh"
exec "$VENV/bin/python" -m megatron_dualpipe.demo ${NPROC:+--nproc "$NPROC"} ${MASTER_PORT:+--master-port "$MASTER_PORT"} "$@"
