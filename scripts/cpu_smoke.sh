#!/usr/bin/env bash
# CPU smoke run of Megatron-LM's pretrain_gpt.py with DualPipe: one machine, 4 processes, gloo,
# mock data, the tiny config. Needs MEGATRON_LM_PATH (a checkout at core_v0.16.1) and the
# Megatron-LM training dependencies (pip install -e ".[megatron-lm]"; the launcher checks them first).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
export CONFIG=${CONFIG:-gpt_tiny_cpu} NNODES=1 NODE_RANK=0 GPUS_PER_NODE=${GPUS_PER_NODE:-4}
export MASTER_ADDR=127.0.0.1 MASTER_PORT=${MASTER_PORT:-29531}
if [ -z "${TORCHRUN:-}" ] && [ -x "$here/.venv/bin/torchrun" ]; then export TORCHRUN="$here/.venv/bin/torchrun"; fi
exec bash "$here/scripts/pretrain_gpt_dualpipe.sh" "$@"
