#!/usr/bin/env bash
# Every call of a GPU lease through the `device` tool, after scripts/device_prepare.sh split what the machine lacks
# (pure-Python packages, tokenised prompts, the checkpoints the STEPS need; one .tar.xz) into the ignored folders
# .gpu/1 .. .gpu/N (N = 2 today), each sized to travel with the tree under the tool's 64 MiB, and moved
# drafters/checkpoints aside. Send the SAME command N times, carrying .gpu/1, then .gpu/2, ..., each within 30 s
# of the last reply (the machine stays warm 30 s and keeps $WORK, default ~/graft-device, only while warm):
#   run(carry=[".gpu/K"], timeout_s=600, command="STEPS='lossless gen train' bash scripts/device_session.sh")
# A call that does not complete the set only stashes its part and says which comes next; the call that does
# verifies the payload's sha256, checks CUDA, unpacks the packages (on PYTHONPATH before the image's), puts the
# checkpoints back in this copy of the tree, pip-installs the project's metadata (its entry points) and runs the
# STEPS (default "lossless gen train"):
#   lossless  scripts/gpu_check.sh's step 1: the engine and lean-forward tests on CUDA with tiny targets
#   gen       scripts/gpu_generate.sh for GEN_MINUTES (2), merged into a copy of the committed data. The committed
#             greedy answers already cover every train prompt, so today this makes T=0.7 samples only (MFD's data)
#   train     scripts/gpu_train.sh from INIT (drafters/checkpoints/dflash-smollm2) for TRAIN_MINUTES (3)
#   pairs     the recipe pairs from INIT, PAIR_MINUTES (1.5) each: MFD K = 4 and its K = 1 control on the sampled
#             multi-future answers, DSpark (Markov + confidence heads, jointly with the backbone; the heads as the
#             bundled dspark-rnn-smollm2's: DeepSpec's RNN head, the best tree head on CPU, embedding basis, draft 0
#             unbiased, greedy label) and its no-head control on the greedy ones
#   headroom  `graft-block expect --headroom` on this GPU's verify curve: DFlash's DDTree and DSpark's scheduled tree at
#             budgets 16 and 64 on 200 calibration contexts (about 1 min; docs/measuring.md); OVERHEAD_MS: that
#             GPU's draft + tree + commit per round from a bench run there (2.5 = the 2-core CPU's)
# The steps share one deadline, SESSION_SECONDS (540) after the call began, so the call ends inside the tool's
# 600 s: each step's timeout (and the minutes gen, train and pairs are given) shrinks to what is left, and a step
# with under a minute left is skipped. After every step scripts/device_pack.py rewrites $OUT: logs.tgz (every
# log, headroom.json) and res.part.* (a tar of gen/, train/ and pairs/, most wanted first, within the tool's
# 8 files / 64 MiB; what does not fit is named). Back here: cat res.part.* > res.tar && tar -xf res.tar.
# Budget as measured 2026-12-04 (H200): 20 s install, 20 s lossless, ~40 s per greedy shard of 3,000 answers,
# 3 min training + 1 min of target loads. "pairs" takes about 9 min: a lease of its own. The DSpark pair's
# confidence heads are calibrated afterwards here (python -m graft_block.drafters.dspark.calibrate).
# GRAFT_BLOCK_DEVICE=cpu skips the CUDA check (the steps then run on the CPU at GPU sizes: a smoke run only with
# small GEN_MINUTES / TRAIN_MINUTES and GRAFT_BLOCK_TRAIN_* overrides).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 3
: "${OUT:?device_session.sh: OUT is unset (the device tool sets it; elsewhere name a folder for the results)}"
T0=$(date +%s)
DEADLINE=$(( T0 + ${SESSION_SECONDS:-540} ))
W=${WORK:-$HOME/graft-device}
S=$W/stash
PY=${PYTHON:-python3}
DEVICE=${GRAFT_BLOCK_DEVICE:-cuda}
. scripts/device_steps.sh || exit 3
check_steps device_session.sh
mkdir -p "$S" "$OUT" || exit 3

# 1. stash this call's part; go on only once every part is here
for d in .gpu/[0-9]*/; do
    [ -d "$d" ] && { cp "$d"payload.* "$S"/ || exit 3; }
done
if [ ! -f "$S/payload.manifest" ]; then
    echo "device_session.sh: no payload: no .gpu/K travelled and $S holds none. Lay it out here with" \
         "'bash scripts/device_prepare.sh', then carry .gpu/1 first" >&2
    exit 3
fi
read -r N SHA < "$S/payload.manifest"
have=(); missing=()
for i in $(seq 1 "$N"); do
    if [ -f "$S/payload.${SHA:0:12}.part.$i" ]; then have+=("$i"); else missing+=("$i"); fi
done
if [ ${#missing[@]} -gt 0 ]; then
    if [ ${#have[@]} -gt 0 ] && [ "${have[-1]}" -eq ${#have[@]} ]; then
        echo "[session] stashed parts 1-${#have[@]} of $N in $S. Next, within 30 s: this same command with" \
             "carry=[\".gpu/$(( ${#have[@]} + 1 ))\"]"
        exit 0
    fi
    echo "device_session.sh: parts ${have[*]:-none} of $N are here, ${missing[*]} missing: the machine went back" \
         "between calls (it stays warm 30 s) or a part was skipped. Send this command again carrying" \
         ".gpu/${missing[0]}, then each next one, within 30 s of each reply" >&2
    exit 3
fi
PAY=$W/payload
if [ "$(cat "$PAY/.sha256" 2>/dev/null)" != "$SHA" ]; then
    rm -rf "$PAY"; mkdir -p "$PAY"
    for i in $(seq 1 "$N"); do cat "$S/payload.${SHA:0:12}.part.$i"; done > "$W/payload.tar.xz" || exit 3
    if ! echo "$SHA  $W/payload.tar.xz" | sha256sum -c --status -; then
        echo "device_session.sh: the assembled payload's sha256 is not the manifest's: a part is damaged or from" \
             "another layout; lay it out again (scripts/device_prepare.sh) and resend from .gpu/1" >&2
        exit 3
    fi
    "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2], filter="data")' \
        "$W/payload.tar.xz" "$PAY" && rm -f "$W/payload.tar.xz" || exit 3
    echo "$SHA" > "$PAY/.sha256"
fi

# 2. the device, then what it lacks
LOGS=$W/logs
rm -rf "$LOGS"; mkdir -p "$LOGS"
say() { echo "[session] $*"; echo "[session] $*" >> "$LOGS/session.log"; }
if ! "$PY" scripts/device_visible.py "$DEVICE" device_session.sh > "$LOGS/device.log" 2>&1
then
    cat "$LOGS/device.log" >&2
    exit 6
fi
if [ -d "$PAY/checkpoints" ]; then  # the tree travelled without drafters/checkpoints: put back what came along
    mkdir -p drafters/checkpoints && cp -r "$PAY"/checkpoints/* drafters/checkpoints/ || exit 3
fi
INIT=${INIT:-drafters/checkpoints/dflash-smollm2}
for step in $STEPS; do
    for c in $(step_ckpts "$step"); do
        [ -f "$c/config.json" ] || { echo "device_session.sh: step $step needs the checkpoint $c, which did not" \
            "travel: lay the payload out with the same STEPS (scripts/device_prepare.sh) and resend it" >&2; exit 8; }
    done
done
# the project's own metadata: Drafter.from_config finds drafter types through its entry points
"$PY" -m pip install -q --upgrade --no-index --no-deps --no-build-isolation --target "$W/gb" . \
    > "$LOGS/gb.log" 2>&1 || { tail -5 "$LOGS/gb.log"; exit 5; }
mkdir -p "$PAY/site" && cp -r "$W"/gb/*.dist-info "$PAY/site/" || exit 5
# USE_HUB_KERNELS=0: transformers >= 5.2x otherwise asks for the `kernels` package on CUDA and stops
export USE_HUB_KERNELS=0 PYTHONPATH=$PAY/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHON=$PY \
    GRAFT_BLOCK_DATA=$W/traindata GRAFT_BLOCK_DEVICE=$DEVICE
"$PY" -c "import transformers; print('| transformers', transformers.__version__, transformers.__file__)" \
    >> "$LOGS/device.log" 2>&1 || { tail -5 "$LOGS/device.log"; exit 7; }
say "$(tr '\n' ' ' < "$LOGS/device.log")| set up in $(( $(date +%s) - T0 )) s; steps: $STEPS"

# 3. the steps, under one deadline; results packed after each
FAIL=0
RESERVE=${SESSION_RESERVE:-20}   # seconds kept for the last pack
MIN_STEP=${SESSION_MIN_STEP:-60}  # a step is not started with less left (tests shrink both)
left() { echo $(( DEADLINE - $(date +%s) - RESERVE )); }
cap() { local l; l=$(left); echo $(( $1 < l ? $1 : l )); }
secs() { awk -v m="$1" -v o="$2" 'BEGIN { printf "%d", m * 60 + o }'; }  # MINUTES (may be 1.5) + overhead
mins() { awk -v m="$1" -v s="$2" -v o="$3" 'BEGIN { x = (s - o) / 60; if (x > m) x = m; printf "%.2f", x }'; }
ran() { say "$1 rc=$2"; [ "$2" -eq 0 ] || FAIL=1; }
pack() {
    "$PY" scripts/device_pack.py "$W" "$OUT" gen train/run/log.jsonl 'pairs/*/run/log.jsonl' train/ckpt-best \
        train/ckpt pairs/mfd-k4/ckpt-best pairs/dspark/ckpt-best pairs/mfd-k1/ckpt-best \
        pairs/dspark-control/ckpt-best 'pairs/*/ckpt' >> "$LOGS/session.log" 2>&1 || say "pack failed"
}
DATA=drafters/data/smollm2-sharegpt
rm -rf "$W/gen" "$W/data" "$W/train" "$W/pairs"
for step in $STEPS; do
  t=$(left)
  if [ "$t" -lt "$MIN_STEP" ]; then say "$step skipped: ${t} s left before the deadline"; continue; fi
  case $step in
  lossless)
    GRAFT_BLOCK_CHECK_QUICK=0 timeout "$(cap 120)" bash scripts/gpu_check.sh "$LOGS/check" > "$LOGS/check.log" 2>&1
    ran lossless $?; tail -2 "$LOGS/check/lossless.log" 2>/dev/null || tail -3 "$LOGS/check.log" ;;
  gen)
    if [ "$(left)" -lt 120 ]; then
        say "gen skipped: $(left) s left, under its 90 s of loads + 30 s of answers"; continue
    fi
    t=$(cap "$(secs "${GEN_MINUTES:-2}" 90)")
    GRAFT_BLOCK_PROMPTS=$PAY/prompts.npz timeout "$t" bash scripts/gpu_generate.sh "$W/gen" \
        "$(mins "${GEN_MINUTES:-2}" "$t" 90)" > "$LOGS/gen.log" 2>&1
    ran gen $?
    if compgen -G "$W/gen/*.npz" > /dev/null; then
        cp -r "$DATA" "$W/data" && "$PY" -m graft_block.onpolicy --out "$W/data" --merge "$W/gen" \
            >> "$LOGS/gen.log" 2>&1
        rc=$?; ran merge $rc; [ $rc -eq 0 ] && DATA=$W/data
    else
        say "gen wrote no shard: $DATA stays the data"
    fi ;;
  train)
    if [ "$(left)" -lt 180 ]; then
        say "train skipped: $(left) s left, under its 150 s of loads + 30 s of training"; continue
    fi
    t=$(cap "$(secs "${TRAIN_MINUTES:-3}" 150)")
    timeout "$t" bash scripts/gpu_train.sh "$W/train" "$INIT" "$(mins "${TRAIN_MINUTES:-3}" "$t" 150)" "$DATA" \
        > "$LOGS/train.log" 2>&1
    ran train $?; grep "\[eval\]\|time limit\|Error" "$LOGS/train.log" | tail -12 ;;
  pairs)
    MFD='"num_anchors": 16, "mode_init_scale": 0.6, "mix_loss": "wta", "ce_weight": 0.1, "l1_weight": 0.9, '
    MFD+='"soft_weight": 0.0, "gamma": 4.0, "unique_anchors": true'
    DSPARK='{"num_anchors": 64, "markov_rank": 64, "markov_head_type": "rnn", "markov_basis": "embedding", '
    DSPARK+='"markov_first_draft": false, "confidence_label": "greedy"}'
    for arm in "mfd-k4|mfd|t0.7-p0.8-k20-x4|{\"num_modes\": 4, $MFD}" \
               "mfd-k1|mfd|t0.7-p0.8-k20-x4|{\"num_modes\": 1, $MFD}" \
               "dspark|dspark|greedy|$DSPARK" \
               'dspark-control|dspark|greedy|{"num_anchors": 64, "markov_rank": 0, "confidence_head": false}'; do
        IFS='|' read -r name type kinds config <<< "$arm"
        if [ "$(left)" -lt 140 ]; then say "$name skipped: $(left) s left, under 110 s of loads + 30 s"; continue; fi
        t=$(cap "$(secs "${PAIR_MINUTES:-1.5}" 110)")
        GRAFT_BLOCK_TRAIN_TYPE=$type GRAFT_BLOCK_TRAIN_KINDS=$kinds GRAFT_BLOCK_TRAIN_CONFIG=$config \
            timeout "$t" bash scripts/gpu_train.sh "$W/pairs/$name" "$INIT" \
            "$(mins "${PAIR_MINUTES:-1.5}" "$t" 110)" "$DATA" > "$LOGS/pair-$name.log" 2>&1
        ran "$name" $?; pack
    done ;;
  headroom)
    timeout "$(cap 300)" "$PY" -m graft_block.eval.expected_tau --methods dflash_ddtree,dspark_sched \
        --budget 16,64 --contexts 200 --headroom --overhead-ms "${OVERHEAD_MS:-2.5}" --out "$LOGS/headroom.json" \
        > "$LOGS/headroom.log" 2>&1
    ran headroom $?; grep -A7 "Per-round" "$LOGS/headroom.log" ;;
  esac
  say "$step done at $(( $(date +%s) - T0 )) s"; pack
done
say "session done at $(( $(date +%s) - T0 )) s, rc=$FAIL"; pack
tail -2 "$LOGS/session.log"
ls -la "$OUT"
exit $FAIL
