#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install the package.
# torch==2.13.0 is installed first so that pip takes the CPU build; megatron-core is pinned by setup.py
# (the supported range, megatron_dualpipe/versions.py).
#
# Variables:
#   MEGATRON_CORE=0.19.2  another megatron-core release of the supported range, in its own environment
#                         .venv-mcore0.19.2 (VENV overrides the name). megatron-core >= 0.17 declares
#                         Requires-Python >= 3.12 but its code runs on 3.11: on an older Python it is installed
#                         with --ignore-requires-python (see docs/versions.md). Its import needs triton
#                         (megatron/core/transformer/moe/ops/paged_stash.py), which CUDA builds of torch bring and
#                         the CPU build does not: installed when missing.
#   BRIDGE=0.3.1          also Megatron-Bridge at that release (megatron-core 0.16.1's), --no-deps: its wheel
#                         declares CUDA builds (transformer-engine, nvidia-resiliency-ext's extensions); the pure
#                         Python packages it imports are installed, the CPU mode stands in for the rest
#                         (docs/megatron-bridge.md). CI's oldest tier runs tests/bridge with it.
#   BRIDGE=0.6.2          the same for Bridge 0.6.x, which needs Python 3.12 (PYTHON=) and megatron-core 0.19
#                         (MEGATRON_CORE defaults to 0.19.2 then): torch 2.13 for 3.12 is the CUDA build (it runs
#                         on CPU), transformers within Bridge's range, megatron-energon; no nvidia-resiliency-ext
#                         (megatron-core 0.19 asserts >= 0.6.0 at import once it is there; PyPI here has 0.4.1):
#                         bridge/cpu.py stands in for the one name Bridge's pretrain.py imports from it.
#                         Its VENV defaults to .venv-bridge0.6-py312:
#                           PYTHON=~/.pyenv/versions/3.12.1/bin/python BRIDGE=0.6.2 bash scripts/setup_venv.sh
#   VENV, PYTHON, TORCH_VERSION  where, with which interpreter, which torch.
#
# Each step that has work to do prints one line with the time it takes on a 2-core machine (the
# lower end from issue 20's report, set-up 2 min 44 s in all; the upper measured on a fresh clone
# under a load average of 25 from other jobs, 2026-11-23); pip's own output -- its warnings,
# setuptools' BuildBackendWarning box about the editable install -- goes to $VENV/setup.log
# (steps timed there) and shows only when a step fails.
# A set-up venv prints nothing. Ctrl-C / SIGTERM stops pip and its build processes
# (megatron_dualpipe/launch/interrupts.py), prints one line and exits 130.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
case "${BRIDGE:-}" in  # Bridge 0.6 imports megatron.training from megatron-core 0.19's wheel, and needs Python 3.12
  0.6.*) MEGATRON_CORE=${MEGATRON_CORE:-0.19.2}; VENV=${VENV:-.venv-bridge0.6-py312};;
esac
MEGATRON_CORE=${MEGATRON_CORE:-}
VENV=${VENV:-.venv${MEGATRON_CORE:+-mcore$MEGATRON_CORE}}
PYTHON=${PYTHON:-python3}
log="$VENV/setup.log"
prog="setup_venv.sh"
child=""

interrupted() {
  trap '' INT TERM HUP
  if [ -n "$child" ]; then kill -TERM "$child" 2>/dev/null || true; wait "$child" 2>/dev/null || true; fi
  echo "$prog: interrupted" >&2
  exit 130
}
trap interrupted INT TERM HUP

# step N TEXT TIME CMD...: one progress line, then CMD through the interrupt helper (its own
# process group, stopped on an interruption) in the background, so that a signal to this shell
# is handled at once rather than when CMD ends.
step() {
  local n=$1 text=$2 took=$3; shift 3
  echo "setup $n/3: $text (about $took)" >&2
  installed=1
  echo "### $(date -u +%T) $text: $*" >>"$log"
  PYTHONPATH="$here" "$PYTHON" -m megatron_dualpipe.launch.interrupts --prog "$prog" -- "$@" >>"$log" 2>&1 &
  child=$!
  local status=0
  wait "$child" || status=$?
  child=""
  echo "### $(date -u +%T) exit status $status" >>"$log"
  case "$status" in 130|143) interrupted;; esac  # the helper was interrupted along with this shell
  if [ "$status" -ne 0 ]; then
    tail -n 20 "$log" >&2
    echo "$prog: error: '$text' failed (exit status $status); the whole output is in $log" >&2
    exit 1
  fi
}

if [ ! -x "$VENV/bin/python" ]; then
  command -v "$PYTHON" >/dev/null || { echo "$prog: error: PYTHON=$PYTHON not found: set PYTHON to a Python >= 3.10" >&2; exit 2; }
  case "${BRIDGE:-}" in 0.6.*) "$PYTHON" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))" \
    || { echo "$prog: error: Megatron-Bridge $BRIDGE needs Python 3.12: set PYTHON to one" >&2; exit 2; };; esac
  mkdir -p "$VENV"
  : >"$log"
  step 1 "creating $VENV with the newest pip" "10-20 s" \
    bash -c '"$1" -m venv "$2" && { "$2/bin/python" -m pip install -q --no-compile --upgrade pip || true; }' _ "$PYTHON" "$VENV"
fi
has() { "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }
if ! has torch; then
  step 2 "installing torch==${TORCH_VERSION:-2.13.0} (CPU build)" "1-2 min" \
    "$VENV/bin/python" -m pip install -q --no-compile "torch==${TORCH_VERSION:-2.13.0}"
fi
if [ -n "$MEGATRON_CORE" ]; then
  have=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('megatron-core'))" 2>/dev/null || true)
  if [ "$have" != "$MEGATRON_CORE" ]; then
    # --no-build-isolation: its source build (where no wheel fits) uses the torch installed above.
    step 2 "installing megatron-core==$MEGATRON_CORE (--ignore-requires-python on Python < 3.12)" "30 s" \
      bash -c '"$1" -m pip install -q --no-compile setuptools wheel pybind11 numpy && "$1" -m pip install -q --no-compile --no-build-isolation --ignore-requires-python "megatron-core==$2"' _ "$VENV/bin/python" "$MEGATRON_CORE"
  fi
  if ! has triton && grep -qs "^import triton" "$("$VENV/bin/python" -c "import importlib.util as u; \
      print(u.find_spec('megatron').submodule_search_locations[0])")/core/transformer/moe/ops/paged_stash.py"; then
    step 2 "installing triton (megatron-core $MEGATRON_CORE imports it)" "1 min" "$VENV/bin/python" -m pip install -q --no-compile triton
  fi
fi
# Install the package when setup.py changed since the last install (the stamp holds its hash), so
# that later runs start at once and print nothing.
stamp="$VENV/.megatron-dualpipe-setup-py"
want=$(sha256sum setup.py | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # One editable install at a time in this checkout (it writes megatron_dualpipe.egg-info here): .ci/run
  # builds the two tiers' environments side by side.
  lock=(); command -v flock >/dev/null && lock=(flock .venv-setup.lock)
  step 3 "installing megatron-dualpipe with megatron-core ${MEGATRON_CORE:-0.16.1} and the test tools" "1.5-4 min" \
    "${lock[@]}" "$VENV/bin/python" -m pip install -q --no-compile -e ".[test,megatron-lm]"
  echo "$want" > "$stamp"
fi
if [ -n "${BRIDGE:-}" ] && ! has megatron.bridge; then
  case "$BRIDGE" in
    0.6.*) pinned="nvidia-modelopt==0.47.0"
           imported="transformers==5.12.1 megatron-energon~=7.0 requests";;
    *)     pinned="nvidia-resiliency-ext==0.4.1 nvidia-modelopt==0.42.0"
           imported="";;
  esac
  step 3 "installing megatron-bridge==$BRIDGE (--no-deps) and the pure-Python packages it imports" "15-60 s" \
    bash -c '"$1" -m pip install -q --no-compile --no-deps "megatron-bridge==$2" $3 \
      && "$1" -m pip install -q --no-compile omegaconf einops psutil defusedxml datasets pulp scipy nvidia-ml-py ninja tensorboard $4' \
    _ "$VENV/bin/python" "$BRIDGE" "$pinned" "$imported"
fi
# pip installs with --no-compile: compiling every file it unpacks took 16 s of CPU for torch alone.
# The bytecode of what the runs import is written once here instead (scripts/warm_bytecode.py).
if [ -n "${installed:-}" ]; then
  step 3 "writing the bytecode of what the runs import" "10-20 s" \
    env -u PYTHONDONTWRITEBYTECODE PYTHONPATH="$here" "$VENV/bin/python" "$here/scripts/warm_bytecode.py" ${BRIDGE:+--bridge}
fi
