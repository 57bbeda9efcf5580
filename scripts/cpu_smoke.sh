#!/usr/bin/env bash
# CPU smoke run of Megatron-LM's pretrain_gpt.py with DualPipe: one machine, 4 processes, gloo,
# the tiny config, on real text: unless DATA_PATH is set, `megatron-dualpipe prepare-data` first
# tokenizes Python's help texts (cached after the first run) and its data, tokenizer and split
# arguments are passed on. With your own DATA_PATH, pass --tokenizer-type/--tokenizer-model/--split
# yourself. Needs MEGATRON_LM_PATH (a checkout at core_v0.16.1 or core_v0.19.0) and Megatron-LM's training
# dependencies (pip install -e ".[megatron-lm]"; the launcher checks them first).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
export CONFIG=${CONFIG:-gpt_tiny_cpu} NNODES=1 NODE_RANK=0 GPUS_PER_NODE=${GPUS_PER_NODE:-4}
export MASTER_ADDR=127.0.0.1 MASTER_PORT=${MASTER_PORT:-29531}
if [ -z "${TORCHRUN:-}" ] && [ -x "$here/.venv/bin/torchrun" ]; then export TORCHRUN="$here/.venv/bin/torchrun"; fi
python=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x "$here/.venv/bin/python" ]; then python="$here/.venv/bin/python"; fi
data_args=()
if [ -z "${DATA_PATH:-}" ]; then
  # stdout: --data-path P --tokenizer-type HuggingFaceTokenizer --tokenizer-model T --split S (shell-quoted)
  prepared=$(PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" "$python" -m megatron_dualpipe prepare-data --split "${SPLIT:-90,10,0}")
  eval "data_args=($prepared)"
  export DATA_PATH="${data_args[1]}"
  data_args=("${data_args[@]:2}")
fi
exec bash "$here/scripts/pretrain_gpt_dualpipe.sh" "${data_args[@]}" "$@"
