#!/usr/bin/env bash
# Launch Megatron-LM's pretrain_gpt.py with a DualPipe schedule on one or more nodes (torchrun).
#
# Run the same command on every node, with its own NODE_RANK (the tokenizer arguments are
# pretrain_gpt.py's; prepare-data prints them for its data):
#   MEGATRON_LM_PATH=/path/Megatron-LM DATA_PATH=/data/my_text_document CONFIG=gpt_8b \
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=6000 GPUS_PER_NODE=8 \
#   bash scripts/pretrain_gpt_dualpipe.sh --tokenizer-type HuggingFaceTokenizer --tokenizer-model /data/tokenizer \
#     [more pretrain_gpt.py arguments...]
# SLURM and containers: scripts/slurm_dualpipe.sbatch, docs/multi-node.md.
#
# Variables: MEGATRON_LM_PATH (a Megatron-LM checkout at core_v0.16.1 or core_v0.19.0), CONFIG (a name in
# configs/ or a path), DATA_PATH (unless the config or the command has --mock-data), SCHEDULE (dualpipe,
# dualpipev, zb-h1, executor-1f1b or 1f1b -- Megatron's own, interleaved with --num-layers-per-virtual-pipeline-stage N
# appended; default dualpipe), NNODES (1), NODE_RANK (0), MASTER_ADDR (localhost, required
# when NNODES > 1), MASTER_PORT (6000), GPUS_PER_NODE (8), TORCHRUN (torchrun where it is on PATH,
# else "PYTHON -m torch.distributed.run"), PYTHON (the interpreter TORCHRUN runs, read from its
# first line; without torchrun: this checkout's .venv, else python3), DRY_RUN=1 to only print the command,
# then the stages each rank holds and `megatron-dualpipe advise`'s estimate per schedule on GPU (H100
# unless set: A100, H800, H200, B200). Before torchrun a schedule advise says does not fit the GPU's
# memory is refused, naming one that fits (MEMORY_CHECK=0 launches anyway); a schedule that fits
# but is not advise's pick gets one note naming the pick and its gain. PP, TP, EP, CP, ETP (expert
# tensor parallel, default TP), MICRO_BATCH, GLOBAL_BATCH override the config's values. PAIR_PLACEMENT=1
# (dualpipe): put pipeline ranks i and pp-1-i on the same node, so that the bd sums stay inside a node
# (the launcher's --pair-placement; refused with the fix when the node size does not allow it, e.g. TP
# filling a node).
#
# Everything torchrun or Megatron would refuse is refused here first, with the fix: numbers that are
# not positive integers, a world size that is not a multiple of TP*PP*CP and of ETP*EP*PP (the
# message names the nearest valid GPU count on these nodes, with its NNODES, and PP/TP/EP for the
# GPUs given; each config states its minimum), the batch split (naming the nearest valid GLOBAL_BATCH),
# DualPipe's rules, a missing DATA_PATH, and (through `python -m megatron_dualpipe.launch --check`
# with the arguments about to be passed, run by the Python that torchrun will run: one check,
# megatron_dualpipe/launch/checks.py) a checkout at neither core_v0.16.1 nor core_v0.19.0, missing training
# dependencies, torch or torchrun missing from that Python, a missing or unloadable tokenizer,
# data prefixes without .bin/.idx, and data whose token ids exceed the tokenizer's vocabulary.
# Ctrl-C or SIGTERM stops torchrun and every rank (megatron_dualpipe/launch/interrupts.py) in one line.
# CUDA_DEVICE_MAX_CONNECTIONS: 1 unless set (32 with --overlap-moe-expert-parallel-comm and TP=CP=1).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
die() { echo "pretrain_gpt_dualpipe.sh: error: $*" >&2; exit 2; }
trap 'echo "pretrain_gpt_dualpipe.sh: interrupted" >&2; exit 130' INT TERM HUP
# A positive integer of at most 9 digits (bash arithmetic then neither fails nor overflows).
is_count() { [[ "$1" =~ ^[1-9][0-9]{0,8}$ ]]; }

[ -n "${MEGATRON_LM_PATH:-}" ] || die "set MEGATRON_LM_PATH to a Megatron-LM checkout at tag core_v0.16.1 or core_v0.19.0"
[ -f "$MEGATRON_LM_PATH/pretrain_gpt.py" ] || die "no pretrain_gpt.py in MEGATRON_LM_PATH=$MEGATRON_LM_PATH"
[ -n "${CONFIG:-}" ] || die "set CONFIG to one of: $(cd "$here/configs" && ls *.sh | sed 's/\.sh$//' | tr '\n' ' ')(or a path)"
config_file="$CONFIG"
[ -f "$config_file" ] || config_file="$here/configs/${CONFIG%.sh}.sh"
[ -f "$config_file" ] || die "no config $CONFIG (looked for $CONFIG and $config_file)"
# shellcheck source=/dev/null
source "$config_file"

SCHEDULE=${SCHEDULE:-dualpipe}
PAIR_PLACEMENT=${PAIR_PLACEMENT:-0}
case "$PAIR_PLACEMENT" in 0|1) ;; *) die "PAIR_PLACEMENT=$PAIR_PLACEMENT: use 1 (bd pairs on one node) or 0";; esac
launcher_opts=()
[ "$PAIR_PLACEMENT" = 1 ] && launcher_opts=(--pair-placement)
NNODES=${NNODES:-1}; NODE_RANK=${NODE_RANK:-0}; GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_PORT=${MASTER_PORT:-6000}; CP=${CP:-1}; etp_set=${ETP:+1}; ETP=${ETP:-$TP}
for v in PP TP EP CP ETP MICRO_BATCH GLOBAL_BATCH NUM_LAYERS NNODES GPUS_PER_NODE MASTER_PORT; do
  is_count "${!v:-}" || die "$v=${!v:-} must be a positive integer"
done
[[ "$NODE_RANK" =~ ^(0|[1-9][0-9]{0,8})$ ]] || die "NODE_RANK=$NODE_RANK must be an integer >= 0"
[ "$MASTER_PORT" -le 65535 ] || die "MASTER_PORT=$MASTER_PORT must be at most 65535"
if [ "$NNODES" -gt 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
  die "NNODES=$NNODES: set MASTER_ADDR to the address of the node with NODE_RANK=0"
fi
MASTER_ADDR=${MASTER_ADDR:-localhost}
[ "$NODE_RANK" -lt "$NNODES" ] || die "NODE_RANK=$NODE_RANK must be below NNODES=$NNODES"

case "$SCHEDULE" in dualpipe|dualpipev|zb-h1|executor-1f1b|1f1b) ;; *) die "SCHEDULE=$SCHEDULE: use dualpipe, dualpipev, zb-h1, executor-1f1b or 1f1b (interleaved 1F1B: SCHEDULE=1f1b with --num-layers-per-virtual-pipeline-stage N)";; esac
# The schedule's own rules first: they name the fix for PP itself, the world size only a GPU count.
# An uneven split (the config's or appended) is checked by Megatron-LM's own validation and the
# plugin's rules below (dualpipe: pp stages; dualpipev: a layout of 2*PP V-stages or the embedding /
# loss counted as layers).
uneven=0
for arg in "${MODEL_ARGS[@]}" "$@"; do
  case "$arg" in --decoder-first-pipeline-num-layers|--decoder-last-pipeline-num-layers|--pipeline-model-parallel-layout|--account-for-*-in-pipeline-split) uneven=1;; esac
done
if [ "$SCHEDULE" = dualpipe ]; then
  [ $((PP % 2)) -eq 0 ] && [ "$PP" -ge 2 ] || die "dualpipe needs an even PP >= 2, got PP=$PP (or use SCHEDULE=dualpipev)"
  [ "$uneven" = 1 ] || [ $((NUM_LAYERS % PP)) -eq 0 ] || die "dualpipe needs NUM_LAYERS ($NUM_LAYERS) divisible by PP=$PP (or an uneven split: --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers)"
fi
if [ "$SCHEDULE" = dualpipev ]; then
  [ "$uneven" = 1 ] || [ $((NUM_LAYERS % (2 * PP))) -eq 0 ] || die "dualpipev needs NUM_LAYERS ($NUM_LAYERS) divisible by 2*PP=$((2 * PP)) (or a --pipeline-model-parallel-layout of $((2 * PP)) V-stages)"
fi
# The Python that will run: torchrun's own interpreter (its first line) where torchrun is found;
# without torchrun, python -m torch.distributed.run with this checkout's .venv (.venv-mcoreX with MEGATRON_CORE=X) or python3.
torchrun_cmd=()
torchrun_path=$(command -v "${TORCHRUN:-torchrun}" 2>/dev/null || true)
if [ -n "$torchrun_path" ]; then
  torchrun_cmd=("$torchrun_path")
  if [ -z "${PYTHON:-}" ]; then
    shebang=$(head -n 1 "$torchrun_path" 2>/dev/null | tr -d '\r' || true)
    PYTHON=python3
    if [[ "$shebang" == '#!'* ]] && [ -x "${shebang#\#!}" ]; then PYTHON="${shebang#\#!}"
    elif [ -x "$(dirname "$torchrun_path")/python" ]; then PYTHON="$(dirname "$torchrun_path")/python"; fi
  fi
elif [ -n "${TORCHRUN:-}" ]; then
  die "TORCHRUN=$TORCHRUN not found: set it to the torchrun of the training environment, or leave it unset to use PYTHON -m torch.distributed.run"
else
  # this checkout's environment: .venv, or with MEGATRON_CORE=X the one setup_venv.sh made for it
  venv="$here/.venv${MEGATRON_CORE:+-mcore${MEGATRON_CORE}}"
  if [ -z "${PYTHON:-}" ]; then PYTHON=python3; [ -x "$venv/bin/python" ] && PYTHON="$venv/bin/python"; fi
  torchrun_cmd=("$PYTHON" -m torch.distributed.run)
fi
command -v "$PYTHON" >/dev/null || die "PYTHON=$PYTHON not found: set PYTHON to the interpreter of the training environment"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"

world=$((NNODES * GPUS_PER_NODE))
# Megatron's rules for the world size (a multiple of TP*PP*CP and of ETP*EP*PP), the experts and the
# batch, each refusal naming values that pass (megatron_dualpipe/launch/sizes.py); it prints the
# fewest GPUs, DP and the micro-batches per iteration.
sizes=$("$PYTHON" -m megatron_dualpipe.launch.sizes --nodes "$NNODES" --gpus-per-node "$GPUS_PER_NODE" \
  --pp "$PP" --tp "$TP" --cp "$CP" --ep "$EP" ${etp_set:+--etp "$ETP"} --micro-batch "$MICRO_BATCH" \
  --global-batch "$GLOBAL_BATCH" --schedule "$SCHEDULE" -- "${MODEL_ARGS[@]}" "$@" 2>&1) || die "$sizes"
read -r min_gpus dp m <<< "$sizes"

# Megatron asserts CUDA_DEVICE_MAX_CONNECTIONS=1 with TP or CP > 1 (before Blackwell), as its own examples
# set it; the MoE all-to-all overlap of the fused F&B units wants more streams (Megatron suggests 32). A
# value already set is kept.
if [ -z "${CUDA_DEVICE_MAX_CONNECTIONS:-}" ]; then
  CUDA_DEVICE_MAX_CONNECTIONS=1
  if [ "$TP" = 1 ] && [ "$CP" = 1 ] && [[ " ${MODEL_ARGS[*]} $* " == *" --overlap-moe-expert-parallel-comm "* ]]; then
    CUDA_DEVICE_MAX_CONNECTIONS=32
  fi
fi
export CUDA_DEVICE_MAX_CONNECTIONS

# --mock-data, in the config or appended to the command, needs no data (DATA_PATH is then not passed).
data_args=()
if [[ " ${MODEL_ARGS[*]} $* " != *" --mock-data "* ]]; then
  [ -n "${DATA_PATH:-}" ] || die "set DATA_PATH to the Megatron-preprocessed data prefix (the path without .bin/.idx; megatron-dualpipe prepare-data prints one), or append --mock-data (synthetic data)"
  # DATA_PATH is a prefix, or a blend "weight prefix weight prefix ...": the preflight below checks each.
  read -r -a data_words <<< "$DATA_PATH"
  data_args=(--data-path "${data_words[@]}")
fi

script=(
  "$MEGATRON_LM_PATH/pretrain_gpt.py"
  "${MODEL_ARGS[@]}" "${data_args[@]}"
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --expert-model-parallel-size "$EP"
  --context-parallel-size "$CP" ${etp_set:+--expert-tensor-parallel-size "$ETP"}
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
  --pipeline-schedule "$SCHEDULE"
  "$@"
)
# The launcher's preflight with the Python torchrun will run and the arguments it will get (one
# line per problem, each naming the fix). Its output is kept until it ends, so that a Ctrl-C here
# prints only the trap's line.
# With PAIR_PLACEMENT=1 the check gets the world and node sizes torchrun will give the ranks. It runs
# Megatron-LM's own argument validation and the plugin's on this final list (the config's values and
# whatever was appended), and says the layout that list gives ("layout: ..."; the header below).
if ! checked=$(WORLD_SIZE=$world LOCAL_WORLD_SIZE=$GPUS_PER_NODE GROUP_WORLD_SIZE=$NNODES \
    "$PYTHON" -m megatron_dualpipe.launch --check "${launcher_opts[@]}" "${script[@]}" 2>&1); then
  printf '%s\n' "$checked" | sed 's/^megatron_dualpipe.launch: error: /pretrain_gpt_dualpipe.sh: error: /' >&2
  exit 2
fi
layout=$(printf '%s\n' "$checked" | sed -n 's/^layout: //p')
printf '%s\n' "$checked" | sed -n 's/^megatron_dualpipe.launch: note: /pretrain_gpt_dualpipe.sh: note: /p' >&2

# advise's memory gate (GPU runs, every node alike): a schedule advise says does not fit the GPU's
# memory (GPU: H100 unless set) is refused here, naming one that fits; MEMORY_CHECK=0 skips it.
advise_args=(--gpu "${GPU:-H100}" --nodes "$NNODES" --gpus-per-node "$GPUS_PER_NODE" --)
[ -n "${VOCAB_SIZE:-}" ] && advise_args+=(--vocab-size "$VOCAB_SIZE")
advise_args+=("${script[@]:1}")
gloo=0
for arg in "${script[@]}"; do [ "$arg" = gloo ] && gloo=1; done
if [ "${MEMORY_CHECK:-1}" != 0 ] && [ "$gloo" = 0 ]; then
  case "${GPU:-H100}" in A100|H100|H800|H200|B200) ;; *) die "GPU=$GPU: use A100, H100, H800, H200 or B200 (advise's memory estimate), or MEMORY_CHECK=0";; esac
  fit_status=0
  fit=$("$PYTHON" -m megatron_dualpipe advise --launch-check "${advise_args[@]}" 2>&1) || fit_status=$?
  fit_line=$(printf '%s\n' "$fit" | grep '^advise: ' | tail -n 1 || true)
  if [ "$fit_status" = 3 ]; then die "${fit_line#advise: error: }"; fi
  if [ "$fit_status" = 0 ]; then echo "pretrain_gpt_dualpipe.sh: note: ${fit_line#advise: }" >&2
  else echo "pretrain_gpt_dualpipe.sh: note: no memory estimate ($(printf '%s\n' "$fit" | tail -n 1))" >&2; fi
fi

cmd=(
  "${torchrun_cmd[@]}" --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE"
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
  -m megatron_dualpipe.launch "${launcher_opts[@]}" "${script[@]}"
)
if [ "${DRY_RUN:-0}" = 1 ] && [ "$NODE_RANK" = 0 ]; then
  # what this launch would do, before any GPU is held: the stages each rank holds and advise's
  # estimate per schedule for this model on GPU (H100 unless set: A100, H800, H200, B200), once per job
  # (the first node); then, as the last two lines, the header and the command
  "$PYTHON" -m megatron_dualpipe advise "${advise_args[@]}" 2>&1 | sed 's/^/# advise: /' || true
fi
echo "# ${layout:-$SCHEDULE: $world processes (minimum $min_gpus), PP=$PP TP=$TP EP=$EP CP=$CP DP=$dp, $m micro-batches per iteration}${launcher_opts:+, bd pairs on one node}, CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS"
printf '%q ' "${cmd[@]}"; echo
[ "${DRY_RUN:-0}" = 1 ] && exit 0
# torchrun and every rank in a process group of their own: Ctrl-C / SIGTERM stops them all, one line.
exec "$PYTHON" -m megatron_dualpipe.launch.interrupts --prog pretrain_gpt_dualpipe.sh -- "${cmd[@]}"
