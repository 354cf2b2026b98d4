#!/usr/bin/env bash
# The GPU check: the lossless tests with their tiny targets on CUDA, then the quick suite on the embedded target
# in bf16 on CUDA (CUDA-synchronised timing; the AR baseline and every method on the same engine), sized to
# finish in under 8 minutes on one GPU. Figures land in OUT_DIR (results.json, the log, the table).
#
#   bash scripts/gpu_check.sh OUT_DIR
#
# GRAFT_BLOCK_DEVICE=cpu runs the same steps on a CPU with tiny sizes (tests/test_gpu_check.py does, up to the
# first CUDA call). Through the device tool: scripts/device_session.sh's "lossless" step runs step 1 (step 2
# needs every bundled checkpoint, more than a call carries with the packages).
set -euo pipefail
OUT=${1:?usage: gpu_check.sh OUT_DIR}
case $OUT in /*) ;; *) OUT=$PWD/$OUT ;; esac  # relative to the caller's folder, not the repo root
cd "$(dirname "$0")/.."
DEVICE=${GRAFT_BLOCK_DEVICE:-cuda}
if [ "$DEVICE" = cpu ]; then DTYPE=${GRAFT_BLOCK_DTYPE:-float32}; else DTYPE=${GRAFT_BLOCK_DTYPE:-bfloat16}; fi
PY=${PYTHON:-python3}
mkdir -p "$OUT"
"$PY" scripts/device_visible.py "$DEVICE" gpu_check
# 1. lossless on the device: greedy identity on random planted trees (4 families), the lean forward against HF's,
#    sampled exactness (chi-square), KV compaction
GRAFT_BLOCK_TEST_DEVICE=$DEVICE "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_engine.py tests/test_lean.py -k "not compiled" 2>&1 | tee "$OUT/lossless.log"
# 2. the quick suite on the embedded target (every method token-identical to AR is part of its table); it needs the
#    bundled checkpoints, so GRAFT_BLOCK_CHECK_QUICK=0 stops after step 1 where they did not travel
[ "${GRAFT_BLOCK_CHECK_QUICK:-1}" = 0 ] && { echo "gpu_check: lossless only; log in $OUT"; exit 0; }
if [ "$DEVICE" = cpu ]; then
    LIMIT=(--limit 1 --max-new-tokens 8 --methods ar,pld --budget 4 --no-physics)
else
    LIMIT=()
fi
"$PY" -m graft_block.eval.run_block --device "$DEVICE" --dtype "$DTYPE" --suite quick --out "$OUT/quick" \
    --no-plots --no-progress --time-limit 360 "${LIMIT[@]}" 2>&1 | tee "$OUT/quick.log"
echo "gpu_check: done; figures in $OUT"
