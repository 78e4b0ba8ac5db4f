#!/usr/bin/env bash
# The node daemon on a real GPU (issue 23: ≤ 60 MB in both kubelet modes, Allocate p99 ≤ 1 ms), as one prepared
# script for a session the device tool lends a GPU machine. Nothing can be fetched there, and its python3 is
# 3.12 (the image's, with PyTorch), so the wheels travel with the working tree:
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
    timeout 150 "$venv/bin/python" "$@" >"$out/$name.out" 2>&1
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
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: bash bench/gpu_check.sh prepare|run" >&2; exit 2 ;;
esac
