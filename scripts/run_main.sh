#!/usr/bin/env bash
# The README's main command: set up .venv, then train a small GPT on text with DualPipe on this
# machine and compare with 1F1B (python -m megatron_dualpipe.demo: it checks the arguments,
# prepares the data on the first run, starts torchrun with 4 processes -- pp=4, gloo and the CPU
# mode without a GPU -- and lists the files it wrote). Arguments go to the demo (--help lists them);
# NPROC and MASTER_PORT set --nproc and --master-port.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
export MEGATRON_DUALPIPE_PROG="bash scripts/run_main.sh"
exec .venv/bin/python -m megatron_dualpipe.demo ${NPROC:+--nproc "$NPROC"} ${MASTER_PORT:+--master-port "$MASTER_PORT"} "$@"
