#!/usr/bin/env bash
# One call on a GPU machine of the `device` tool, after scripts/device_prepare.sh's first call left .gpu/a in
# $WORK/stash (WORK defaults to ~/graft-device; everything this call writes outside the checkout goes there):
# install the carried wheels, then the STEPS asked for (default "lossless gen train"):
#   lossless  scripts/gpu_check.sh's step 1: the engine and lean-forward tests on CUDA with tiny targets
#   gen       scripts/gpu_generate.sh for GEN_MINUTES (2), merged into a copy of the committed data
#   train     scripts/gpu_train.sh from INIT (drafters/checkpoints/dflash-smollm2) for TRAIN_MINUTES (3)
#   pairs     the recipe pairs from INIT, PAIR_MINUTES (1.5) each: MFD K = 4 and its K = 1 control on the sampled
#             multi-future answers, DSpark (Markov + confidence heads, jointly with the backbone; the heads as the
#             bundled dspark-rnn-smollm2's: DeepSpec's RNN head, the best tree head on CPU, embedding basis, draft 0
#             unbiased, greedy label) and its no-head control on the greedy ones
#   headroom  `graft-block expect --headroom` on this GPU's verify curve: DFlash's DDTree and DSpark's scheduled tree at
#             budgets 16 and 64 on 200 calibration contexts (about 1 min; docs/measuring.md); OVERHEAD_MS: that
#             GPU's draft + tree + commit per round from a bench run there (2.5 = the 2-core CPU's)
# Everything that comes back is under $OUT: the logs and res.part.* (a tar of gen/ and train/, split to the
# tool's 16 MiB per file). Budget as measured 2026-12-04: 20 s install, 20 s lossless, ~40 s per greedy shard of
# 3,000 answers, 3 min training + 1 min of target loads; "pairs" (about 9 min) needs a call of its own, and the
# DSpark pair's confidence heads are calibrated afterwards here (python -m graft_block.drafters.dspark.calibrate).
set -uo pipefail
W=${WORK:-$HOME/graft-device}
S=$W/stash; mkdir -p $S; cp .gpu/b/* $S/ 2>/dev/null || true
STEPS=${STEPS:-lossless gen train}
cat $S/smol.part.00 $S/smol.part.01 > "$S/$(cut -d' ' -f3 $S/smol.sha256)" && (cd $S && sha256sum -c smol.sha256) || exit 3
python3 -m pip install -q --upgrade --no-index --no-deps --target $W/site $S/*.whl || exit 4
# the project's own metadata: Drafter.from_config finds drafter types through its entry points
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target $W/gb . > $W/gb.log 2>&1 \
    || { tail -5 $W/gb.log; exit 5; }
cp -r $W/gb/*.dist-info $W/site/
# USE_HUB_KERNELS=0: transformers >= 5.2x otherwise asks for the `kernels` package on CUDA and stops
export USE_HUB_KERNELS=0 PYTHONPATH=$W/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHON=python3 \
    GRAFT_BLOCK_DATA=$W/traindata
python3 -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__, '|', torch.cuda.get_device_name(0))"
T0=$(date +%s); el() { echo "[session] $1 done at $(( $(date +%s) - T0 )) s"; }
DATA=drafters/data/smollm2-sharegpt
for step in $STEPS; do case $step in
  lossless)
    GRAFT_BLOCK_CHECK_QUICK=0 timeout 120 bash scripts/gpu_check.sh $OUT/check > /dev/null 2>&1
    echo "lossless rc=$?"; tail -2 $OUT/check/lossless.log ;;
  gen)
    GRAFT_BLOCK_PROMPTS=$S/prompts.npz timeout $(( ${GEN_MINUTES:-2} * 60 + 60 )) bash scripts/gpu_generate.sh $W/gen \
        "${GEN_MINUTES:-2}" > $OUT/gen.log 2>&1; echo "gen rc=$?"
    rm -rf $W/data; cp -r $DATA $W/data && python3 -m graft_block.onpolicy --out $W/data --merge $W/gen \
        >> $OUT/gen.log 2>&1; echo "merge rc=$?"; DATA=$W/data ;;
  train)
    timeout $(( ${TRAIN_MINUTES:-3} * 60 + 120 )) bash scripts/gpu_train.sh $W/train \
        "${INIT:-drafters/checkpoints/dflash-smollm2}" "${TRAIN_MINUTES:-3}" "$DATA" > $OUT/train.log 2>&1
    echo "train rc=$?"; grep "\[eval\]\|time limit\|Error" $OUT/train.log | tail -12 ;;
  pairs)
    MFD='"num_anchors": 16, "mode_init_scale": 0.6, "mix_loss": "wta", "ce_weight": 0.1, "l1_weight": 0.9, "soft_weight": 0.0, "gamma": 4.0, "unique_anchors": true'
    for arm in "mfd-k4|mfd|t0.7-p0.8-k20-x4|{\"num_modes\": 4, $MFD}" "mfd-k1|mfd|t0.7-p0.8-k20-x4|{\"num_modes\": 1, $MFD}" \
               'dspark|dspark|greedy|{"num_anchors": 64, "markov_rank": 64, "markov_head_type": "rnn", "markov_basis": "embedding", "markov_first_draft": false, "confidence_label": "greedy"}' \
               'dspark-control|dspark|greedy|{"num_anchors": 64, "markov_rank": 0, "confidence_head": false}'; do
        IFS='|' read -r name type kinds config <<< "$arm"
        GRAFT_BLOCK_TRAIN_TYPE=$type GRAFT_BLOCK_TRAIN_KINDS=$kinds GRAFT_BLOCK_TRAIN_CONFIG=$config \
            timeout 200 bash scripts/gpu_train.sh $W/pairs/$name "${INIT:-drafters/checkpoints/dflash-smollm2}" \
            "${PAIR_MINUTES:-1.5}" "$DATA" > $OUT/pair-$name.log 2>&1; echo "$name rc=$?"
    done ;;
  headroom)
    timeout 300 python3 -m graft_block.eval.expected_tau --methods dflash_ddtree,dspark_sched --budget 16,64 \
        --contexts 200 --headroom --overhead-ms "${OVERHEAD_MS:-2.5}" --out $OUT/headroom.json > $OUT/headroom.log 2>&1
    echo "headroom rc=$?"; grep -A7 "Per-round" $OUT/headroom.log ;;
  *) echo "unknown step $step"; exit 2 ;;
esac; el "$step"; done
( cd $W && tar -cf $W/res.tar $(ls -d gen train/ckpt train/ckpt-best train/run/log.jsonl pairs/*/ckpt \
    pairs/*/run/log.jsonl 2>/dev/null) ) \
    && split -b 15000000 $W/res.tar $OUT/res.part.; ls -la $OUT
