#!/usr/bin/env bash
# Block-drafter training on a CUDA machine: by default DFlash's committed recipe (online target features over the
# greedy answers, gamma-2 row weights, 24 anchors, evaluated on the clean held-out set) with a GPU-sized batch,
# from INIT, for at most MINUTES. GRAFT_BLOCK_TRAIN_TYPE / _CONFIG / _KINDS / _SEED pick another drafter, recipe,
# shard kinds or seed (e.g. TYPE=mfd, KINDS=t0.7-p0.8-k20-x4 and CONFIG with num_modes; TYPE=dspark). The
# target runs in fp32, so the features are those the CPU runs and benchmarks see. The
# checkpoint lands in OUT_DIR/ckpt, the best held-out one in OUT_DIR/ckpt-best, the run (log.jsonl) in OUT_DIR/run.
#
#   bash scripts/gpu_train.sh OUT_DIR INIT [MINUTES=4] [DATA=drafters/data/smollm2-sharegpt]
#
# GRAFT_BLOCK_TRAIN_BATCH / _STEPS / _LR / _EVAL_EVERY override 32 / 1600 / 3e-4 / 200 (the schedule's length is
# STEPS; MINUTES only stops early). On CUDA each step's forwards run under bfloat16 autocast (the target's weights
# stay fp32; GRAFT_BLOCK_TRAIN_AUTOCAST= turns it off); a run that fails before its first checkpoint under autocast
# reruns once without it, so an untried autocast path cannot cost a lease its training. GRAFT_BLOCK_DEVICE=cpu
# with small sizes is the smoke run (tests/test_gpu_check.py). Through the device tool: scripts/device_session.sh's
# "train" and "pairs" steps (scripts/device_prepare.sh lays out what must travel).
set -euo pipefail
OUT=${1:?usage: gpu_train.sh OUT_DIR INIT [MINUTES] [DATA]}
INIT=${2:?usage: gpu_train.sh OUT_DIR INIT [MINUTES] [DATA]}
MINUTES=${3:-4}
DATA=${4:-drafters/data/smollm2-sharegpt}
# paths relative to the caller's folder; INIT and DATA that are not there stay relative to the repo root
abs() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
OUT=$(abs "$OUT")
if [ -e "$INIT" ]; then INIT=$(abs "$INIT"); fi
if [ -e "$DATA" ]; then DATA=$(abs "$DATA"); fi
cd "$(dirname "$0")/.."
DEVICE=${GRAFT_BLOCK_DEVICE:-cuda}
PY=${PYTHON:-python3}
CONFIG=${GRAFT_BLOCK_TRAIN_CONFIG:-'{"num_anchors": 24, "gamma": 2}'}
HELDOUT=${GRAFT_BLOCK_HELDOUT:-drafters/data/smollm2-sharegpt-heldout}
mkdir -p "$OUT"
# the held-out features: one teacher-forced forward over the answers to the reserved (held-out) prompts
"$PY" -m graft_block.drafters.train --device "$DEVICE" --dtype float32 --generate --from-onpolicy "$HELDOUT" \
    --kinds greedy --data heldout-greedy
AUTOCAST=${GRAFT_BLOCK_TRAIN_AUTOCAST-$([ "$DEVICE" = cuda ] && echo bfloat16 || true)}
train() {
"$PY" -m graft_block.drafters.train --device "$DEVICE" --dtype float32 --type "${GRAFT_BLOCK_TRAIN_TYPE:-dflash}" \
    --online --data "$DATA" --kinds "${GRAFT_BLOCK_TRAIN_KINDS:-greedy}" --eval-data heldout-greedy --init "$INIT" \
    --config "$CONFIG" \
    --steps "${GRAFT_BLOCK_TRAIN_STEPS:-1600}" --warmup 0.03 --lr "${GRAFT_BLOCK_TRAIN_LR:-3e-4}" \
    --batch-size "${GRAFT_BLOCK_TRAIN_BATCH:-32}" --eval-every "${GRAFT_BLOCK_TRAIN_EVAL_EVERY:-200}" \
    --minutes "$MINUTES" --seed "${GRAFT_BLOCK_TRAIN_SEED:-5}" --keep-best --out "$OUT/ckpt" --run "$OUT/run" "$@"
}
if ! train ${AUTOCAST:+--autocast "$AUTOCAST"}; then
    [ -n "$AUTOCAST" ] && [ ! -e "$OUT/run/state.pt" ] || exit 1
    echo "gpu_train.sh: training under autocast $AUTOCAST failed before its first checkpoint; rerunning without" >&2
    rm -rf "$OUT/run" "$OUT/ckpt" "$OUT/ckpt-best"
    train
fi
ls -la "$OUT/ckpt"
