#!/usr/bin/env bash
# MFD for SmolLM2, the whole recipe: sampled multi-future data, then K = 1, 2, 4, 8 from the DFlash default with the
# same data, steps, schedule, anchors and seed (K = 1 is the DDTree control). See
# drafters/checkpoints/mfd-smollm2/TRAINING.md for the measured log. Usage:
#   [DATA=...] [STEPS=...] [LR=...] [INIT=dflash folder] scripts/train_mfd_sweep.sh [OUT_ROOT] [K ...]
#   (default: runs/mfd-sweep, K = 1 2 4 8)
# The K = 4 and K = 1 results were the bundled mfd-smollm2 and mfd-smollm2-k1 until 2026-12-04 (now: frozen-backbone
# modes, drafters/checkpoints/mfd-smollm2/TRAINING.md).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/mfd-sweep}
shift || true
KS=${*:-1 2 4 8}
DATA=${DATA:-onpolicy-sampled-v2}
STEPS=${STEPS:-200}
LR=${LR:-3e-4}   # peak learning rate (warmup then cosine)
INIT=${INIT:-drafters/checkpoints/dflash-smollm2}   # the DFlash weights every K starts from
# 1) features of the committed multi-future data: SmolLM2's own answers to ShareGPT train prompts at the paper's
#    sampling (T=0.7, top-p 0.8, top-k 20), four per prompt, so one context carries several futures
#    (drafters/data/smollm2-sharegpt, kind t0.7-p0.8-k20-x4). One teacher-forced forward per sequence, cached under
#    the user cache dir; resumable; about 12 min on 2 cores.
python -m graft_block.drafters.train --generate --from-onpolicy drafters/data/smollm2-sharegpt --data $DATA \
    --kinds t0.7-p0.8-k20-x4 --gen-batch 16
# 2) one run per K; --steps fixes the step count, so every K sees the same sequences in the same order.
#    gamma 7 (the recipe default until 2026-12-04) is pinned; with INIT at the 2026-12-02 DFlash weights (commit
#    f00595c, see drafters/checkpoints/mfd-smollm2/TRAINING.md) this rebuilds the committed MFD pair
for K in $KS; do
    python -m graft_block.drafters.train --type mfd --data $DATA --threads 2 --init $INIT \
        --config "{\"num_modes\": $K, \"num_anchors\": 8, \"mode_init_scale\": 0.6, \"gamma\": 7}" \
        --steps $STEPS --lr $LR --batch-size 4 --holdout 16 --eval-every 40 --seed 0 --out $OUT/k$K/ckpt --run $OUT/k$K
done
