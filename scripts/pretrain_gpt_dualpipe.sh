#!/usr/bin/env bash
# Launch Megatron-LM's pretrain_gpt.py with a DualPipe schedule on one or more nodes (torchrun).
#
# Run the same command on every node, with its own NODE_RANK:
#   MEGATRON_LM_PATH=/path/Megatron-LM DATA_PATH=/data/my_text_document CONFIG=gpt_8b \
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=6000 GPUS_PER_NODE=8 \
#   bash scripts/pretrain_gpt_dualpipe.sh [extra pretrain_gpt.py arguments...]
#
# Variables: MEGATRON_LM_PATH (a Megatron-LM checkout at core_v0.16.1), CONFIG (a name in
# configs/ or a path), DATA_PATH (unless the config uses --mock-data), SCHEDULE (dualpipe,
# dualpipev or 1f1b; default dualpipe), NNODES (1), NODE_RANK (0), MASTER_ADDR (localhost, required
# when NNODES > 1), MASTER_PORT (6000), GPUS_PER_NODE (8), TORCHRUN (torchrun), DRY_RUN=1 to only
# print the command. PP, TP, EP, MICRO_BATCH, GLOBAL_BATCH override the config's values.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
die() { echo "pretrain_gpt_dualpipe.sh: error: $*" >&2; exit 2; }

: "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM checkout at tag core_v0.16.1}"
[ -f "$MEGATRON_LM_PATH/pretrain_gpt.py" ] || die "no pretrain_gpt.py in MEGATRON_LM_PATH=$MEGATRON_LM_PATH"
: "${CONFIG:?set CONFIG to one of: $(cd "$here/configs" && ls *.sh | sed 's/\.sh$//' | tr '\n' ' ')}"
config_file="$CONFIG"
[ -f "$config_file" ] || config_file="$here/configs/${CONFIG%.sh}.sh"
[ -f "$config_file" ] || die "no config $CONFIG (looked for $CONFIG and $config_file)"
# shellcheck source=/dev/null
source "$config_file"

SCHEDULE=${SCHEDULE:-dualpipe}
NNODES=${NNODES:-1}; NODE_RANK=${NODE_RANK:-0}; GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_PORT=${MASTER_PORT:-6000}
if [ "$NNODES" -gt 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
  die "NNODES=$NNODES: set MASTER_ADDR to the address of the node with NODE_RANK=0"
fi
MASTER_ADDR=${MASTER_ADDR:-localhost}
[ "$NODE_RANK" -lt "$NNODES" ] || die "NODE_RANK=$NODE_RANK must be below NNODES=$NNODES"

case "$SCHEDULE" in dualpipe|dualpipev|1f1b) ;; *) die "SCHEDULE=$SCHEDULE: use dualpipe, dualpipev or 1f1b";; esac
world=$((NNODES * GPUS_PER_NODE))
[ $((world % (PP * TP))) -eq 0 ] || die "$world GPUs are not a multiple of PP*TP=$((PP * TP)): change PP, TP or GPUS_PER_NODE"
dp=$((world / (PP * TP)))
[ $((GLOBAL_BATCH % (MICRO_BATCH * dp))) -eq 0 ] || die "GLOBAL_BATCH=$GLOBAL_BATCH is not a multiple of MICRO_BATCH*DP=$((MICRO_BATCH * dp))"
m=$((GLOBAL_BATCH / (MICRO_BATCH * dp)))
if [ "$SCHEDULE" = dualpipe ]; then
  [ $((PP % 2)) -eq 0 ] && [ "$PP" -ge 2 ] || die "dualpipe needs an even PP >= 2, got PP=$PP (or use SCHEDULE=dualpipev)"
  [ $((NUM_LAYERS % PP)) -eq 0 ] || die "dualpipe needs NUM_LAYERS ($NUM_LAYERS) divisible by PP=$PP"
fi
if [ "$SCHEDULE" = dualpipev ]; then
  [ $((NUM_LAYERS % (2 * PP))) -eq 0 ] || die "dualpipev needs NUM_LAYERS ($NUM_LAYERS) divisible by 2*PP=$((2 * PP))"
fi
if [ "$SCHEDULE" != 1f1b ] && [ "$m" -lt "$PP" ]; then
  die "$SCHEDULE needs at least PP=$PP micro-batches per iteration, got GLOBAL_BATCH/(MICRO_BATCH*DP)=$m: raise GLOBAL_BATCH to $((PP * MICRO_BATCH * dp))"
fi

data_args=()
if [[ " ${MODEL_ARGS[*]} " != *" --mock-data "* ]]; then
  : "${DATA_PATH:?set DATA_PATH to the Megatron-preprocessed data prefix (or use a config with --mock-data)}"
  data_args=(--data-path "$DATA_PATH")
fi

cmd=(
  "${TORCHRUN:-torchrun}" --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE"
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
  -m megatron_dualpipe.launch "$MEGATRON_LM_PATH/pretrain_gpt.py"
  "${MODEL_ARGS[@]}" "${data_args[@]}"
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --expert-model-parallel-size "$EP"
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
  --pipeline-schedule "$SCHEDULE"
  "$@"
)
echo "# $SCHEDULE: $world processes, PP=$PP TP=$TP EP=$EP DP=$dp, $m micro-batches per iteration"
printf '%q ' "${cmd[@]}"; echo
[ "${DRY_RUN:-0}" = 1 ] && exit 0
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
exec "${cmd[@]}"
