#!/usr/bin/env bash
# A second, shorter accelerator run (after batched staging copies): bench/blocking.py, then
# train_cost at 100m, batch 256 (default staging), and batch 8 with the old asarray staging
# (is the +44% slowdown of the steps beside a write at batch 8 the owned copies' doing?).
# XLA compiles lm.py's init for ~140 s on a GPU: the persistent cache spares the second run.
set -u -o pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export JAX_PLATFORMS="${PLATFORM:-cuda}" XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_COMPILATION_CACHE_DIR=/tmp/fnckpt-jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
OUT="${OUT:-/tmp/fnckpt-gpu}"; DIR="${DIR:-/tmp/fnckpt-gpu-data}"
GIB="${GIB:-2}"; SIZE="${SIZE:-100m}"; PY="${PY:-python3}"
mkdir -p "$OUT" "$DIR"
"$PY" bench/blocking.py --gib "$GIB" --runs 3 --dir "$DIR" 2>&1 | tee "$OUT/blocking2.txt"
run() {  # name, args...
  local name=$1; shift
  "$PY" bench/train_cost.py --sizes "$SIZE" --devices 1 --mesh 1,1 --every 50 --phase-saves 2 \
    --rounds 2 --warmup 5 --dir "$DIR/train_cost" --json "$OUT/$name.json" "$@" 2>&1 \
    | tee "$OUT/$name.txt"
}
run train_cost2-b256 --batch 256
run train_cost2-b8-asarray --staging asarray
