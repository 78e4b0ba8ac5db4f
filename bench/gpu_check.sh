#!/usr/bin/env bash
# The node daemon on a real GPU (targets: ≤ 60 MB in both kubelet modes, Allocate p99 ≤ 1 ms) and the
# share enforcement escapes, as one prepared script for a session the device tool lends a GPU machine.
# Nothing can be fetched there, and its python3 is 3.12 (the image's, with PyTorch), so the wheels travel with the working tree:
#
#   here:        bash bench/gpu_check.sh prepare     # kubegpu and its runtime + demo wheels for CPython 3.12
#                                                    # into .gpuwheels/ (git-ignored; ~43 MB of the 64 MiB
#                                                    # that may travel)
#   the device:  run(command="bash bench/gpu_check.sh run", carry=[".gpuwheels"], timeout_s=480)
#
# `run` installs the wheels into a fresh venv, byte-compiles it (as the image is), and leaves under $OUT one
# JSON object per benchmark, as printed: node-standalone.json (`bench/node.py --nvml --n 3000`),
# node-cluster.json (`--nvml --cluster`, the default DaemonSet), dra.json (`bench/dra.py --nvml --claims 100`),
# nvml-memory.json (`bench/nvml_memory.py`: nvmlInit, and its NO_ATTACH variant), with nvidia-smi.txt and
# run.log (every step's whole output). A step that fails is said in run.log and the others still run.
# enforcement.json (`bench/enforcement.py`: limits, the tenant escapes per enforcement mode, Allocate p99 with
# enforcement off and on) runs last, in a venv that also sees the image's PyTorch, as root: its strict mode sets
# GPU 0 to EXCLUSIVE_PROCESS and back; the script checks the mode after it and puts back the one it found.
# Keep what it printed under docs/measured/ (README there) and in docs/performance.md.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpuwheels

prepare() {
  local py=${PYTHON:-python3}
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  "$py" -m pip wheel -q --no-deps -w "$WHEELS" . || return 1
  # The runtime dependencies and the demo extra (the stand-in kubelets and API server the benchmarks drive).
  "$py" - >"$WHEELS/requirements.txt" <<'EOF' || return 1
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["demo"]))
EOF
  "$py" -m pip download -q -d "$WHEELS" --only-binary=:all: --implementation cp --python-version 3.12 \
    --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform linux_x86_64 --platform any \
    -c constraints.txt -r "$WHEELS/requirements.txt" || return 1
  du -sh "$WHEELS"
}

run() {
  local out=${OUT:-/tmp/kubegpu-gpu-check} venv=/tmp/kubegpu-gpu-venv py=${PYTHON:-python3}
  mkdir -p "$out"
  exec > >(tee -a "$out/run.log") 2>&1
  nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed"
  "$py" --version
  rm -rf "$venv"
  "$py" -m venv "$venv" || return 1
  "$venv/bin/pip" install -q --no-index --find-links "$WHEELS" "$(ls "$WHEELS"/kubegpu-*.whl)[demo]" || return 1
  "$venv/bin/python" -m compileall -q "$venv/lib" >/dev/null
  step() {  # name, then the benchmark and its arguments
    local name=$1
    shift
    echo "== $name: $*"
    local started=$SECONDS
    timeout "${STEP_TIMEOUT:-150}" "${STEP_PYTHON:-$venv/bin/python}" "$@" >"$out/$name.out" 2>&1
    local rc=$?
    tail -n 40 "$out/$name.out"
    tail -n 1 "$out/$name.out" >"$out/$name.json"
    rm -f "$out/$name.out"
    echo "== $name: exit $rc after $((SECONDS - started)) s"
  }
  step node-standalone bench/node.py --nvml --n 3000
  step node-cluster bench/node.py --nvml --cluster
  step dra bench/dra.py --nvml --claims 100
  step nvml-memory bench/nvml_memory.py
  enforcement "$out" "$py"
}

enforcement() {  # out dir, python: CUDA clients need the image's PyTorch, so this venv sees system packages
  local out=$1 py=$2 venv=/tmp/kubegpu-gpu-venv-torch found
  "$py" -m venv --system-site-packages "$venv" &&
    "$venv/bin/pip" install -q --no-index --find-links "$WHEELS" "$(ls "$WHEELS"/kubegpu-*.whl)[demo]" ||
    { echo "== enforcement: venv failed"; return 1; }
  found=$(nvidia-smi -i 0 --query-gpu=compute_mode --format=csv,noheader)
  STEP_TIMEOUT=290 STEP_PYTHON="$venv/bin/python" step enforcement bench/enforcement.py
  local now
  now=$(nvidia-smi -i 0 --query-gpu=compute_mode --format=csv,noheader)
  echo "== enforcement: compute mode before $found, after $now"
  case "$found" in  # nvidia-smi prints the mode's name and takes its number
    Default) found=0 ;; Prohibited) found=2 ;; Exclusive_Process) found=3 ;; *) return 0 ;;
  esac
  case "$now" in Default) now=0 ;; Prohibited) now=2 ;; Exclusive_Process) now=3 ;; esac
  [ "$now" = "$found" ] || nvidia-smi -i 0 -c "$found"
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: bash bench/gpu_check.sh prepare|run" >&2; exit 2 ;;
esac
