#!/usr/bin/env bash
# The accelerator checks of docs/performance.md ("On a GPU"), in one run on one GPU machine:
# how long a save blocks and what it leaves cached (bench/blocking.py), and what saving every
# 50 steps costs training (bench/train_cost.py), at the default and a larger batch. The tests
# never need this; run it where a GPU is at hand:
#
#     bash bench/gpu.sh                       # results under $OUT (default /tmp/fnckpt-gpu)
#     GIB=0.25 SIZE=tiny PLATFORM=cpu bash bench/gpu.sh   # a quick dry run on CPU
set -u -o pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export JAX_PLATFORMS="${PLATFORM:-cuda}" XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT="${OUT:-/tmp/fnckpt-gpu}"; DIR="${DIR:-/tmp/fnckpt-gpu-data}"
GIB="${GIB:-2}"; SIZE="${SIZE:-100m}"; BATCH="${BATCH:-256}"; PY="${PY:-python3}"
mkdir -p "$OUT" "$DIR"

{ nvidia-smi -L 2>/dev/null; nproc; free -g | head -2; df -h "$DIR" | tail -1
  "$PY" -c "import sys, jax, numpy, tensorstore, xxhash, msgpack; d = jax.devices()[0]; \
print(sys.version.split()[0], 'jax', jax.__version__, 'numpy', numpy.__version__, d, \
d.device_kind, [m.kind for m in d.addressable_memories()])"
} 2>&1 | tee "$OUT/machine.txt"

"$PY" bench/blocking.py --gib "$GIB" --runs 3 --dir "$DIR" 2>&1 | tee "$OUT/blocking.txt"
"$PY" bench/blocking.py --gib "$GIB" --runs 3 --budget-mib 512 --dir "$DIR" 2>&1 \
  | tee "$OUT/blocking-budget.txt"
for batch in "" "$BATCH"; do
  "$PY" bench/train_cost.py --sizes "$SIZE" --devices 1 --mesh 1,1 --every 50 --phase-saves 2 \
    --rounds 2 --warmup 5 ${batch:+--batch $batch} --dir "$DIR/train_cost" \
    --json "$OUT/train_cost${batch:+-b$batch}.json" 2>&1 | tee "$OUT/train_cost${batch:+-b$batch}.txt"
done
