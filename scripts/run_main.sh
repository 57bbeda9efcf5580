#!/usr/bin/env bash
# The README's main command: set up .venv, then train a small GPT with DualPipe on this machine
# (torchrun, 4 processes, pp=4; gloo and the CPU mode without a GPU) and compare with 1F1B.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
mkdir -p out
.venv/bin/megatron-dualpipe simulate --schedule dualpipe --pp 4 --microbatches 16 --png out/dualpipe_pp4_m16.png
.venv/bin/torchrun --nproc-per-node "${NPROC:-4}" --master-port "${MASTER_PORT:-29517}" -m megatron_dualpipe.demo "$@"
