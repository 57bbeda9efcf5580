#!/usr/bin/env bash
# The README's main command: set up .venv, then train a small GPT on text with DualPipe on this
# machine and compare with 1F1B (python -m megatron_dualpipe.apps.main_job: it checks the arguments,
# prepares the data on the first run, starts torchrun with 4 processes -- pp=4, gloo and the CPU
# mode without a GPU -- and lists the files it wrote). Arguments go to the demo (--help lists them);
# paths in them (--text, --out, --data-path, ...) are relative to the directory you run this from.
# NPROC and MASTER_PORT set --nproc and --master-port. MEGATRON_CORE=0.19.2 runs it on that
# megatron-core release (the newest supported) in its own environment .venv-mcore0.19.2 (setup_venv.sh).
#
# Ctrl-C, SIGTERM or a closed pipe stops every process of the job and prints one line
# (megatron_dualpipe/launch/interrupts.py); the set-up runs in the background so that a signal to this
# shell reaches it at once.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
setup=""
trap '[ -n "$setup" ] && kill -TERM "$setup" 2>/dev/null; [ -n "$setup" ] && wait "$setup"; exit 130' INT TERM HUP
VENV=${VENV:-$here/.venv${MEGATRON_CORE:+-mcore${MEGATRON_CORE:-}}}
VENV=$VENV bash "$here/scripts/setup_venv.sh" &
setup=$!
wait "$setup"
setup=""
trap - INT TERM HUP
export MEGATRON_DUALPIPE_PROG="bash scripts/run_main.sh"
exec "$VENV/bin/python" -m megatron_dualpipe.apps.main_job ${NPROC:+--nproc "$NPROC"} ${MASTER_PORT:+--master-port "$MASTER_PORT"} "$@"
