#!/usr/bin/env bash
# The README's main command: set up .venv, then run the main job on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
mkdir -p out
.venv/bin/megatron-dualpipe schedule --schedule dualpipe --pp 8 --microbatches 20
.venv/bin/megatron-dualpipe simulate --schedule dualpipe --pp 8 --microbatches 20 --png out/dualpipe_pp8_m20.png --svg out/dualpipe_pp8_m20.svg
echo "timeline written to out/dualpipe_pp8_m20.png and out/dualpipe_pp8_m20.svg"
