#!/usr/bin/env bash
# Exports the bundled DFlash, DSpark and EAGLE-3 drafters to vLLM speculators folders and has speculators' own model
# classes draft from them (scripts/check_speculators.py): each must reproduce graft-block's logits.
# speculators 0.9.0 pins transformers <= 5.19 (graft-block wants >= 5.24), so it lives in a side venv
# (GRAFT_BLOCK_SPECULATORS_VENV, default .venv-speculators) that reuses .venv's torch through a .pth file: no second
# torch is downloaded. First run ~30 s of installs; usage: bash scripts/check_speculators.sh [OUT_FOLDER]
set -euo pipefail
cd "$(dirname "$0")/.."
SIDE=${GRAFT_BLOCK_SPECULATORS_VENV:-.venv-speculators}
OUT=${1:-runs/speculators-check}
[ -x .venv/bin/python ] || { echo "no .venv: run bash scripts/install.sh first" >&2; exit 2; }
if ! "$SIDE/bin/python" -c "import speculators" 2>/dev/null; then
    .venv/bin/python -m venv "$SIDE"  # the same interpreter, so .venv's compiled packages load in it
    main_site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    side_site=$("$SIDE/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "$main_site" > "$side_site/graft_block_venv.pth"  # after the side venv's own packages: its transformers wins
    PIP="$SIDE/bin/pip install -q --disable-pip-version-check"
    # speculators' requirements without torch / torchvision / torchaudio (it imports none of the last two)
    $PIP aiohttp click "datasets>=4.0.0,<=5.1.0" httpx huggingface-hub "loguru>=0.7.2,<=0.7.3" openai protobuf \
        psutil pydantic pydantic-settings rich typer hs-connectors==0.9.0 transformers==5.19.0 2>&1 \
        | grep -v "dependency resolver\|requires transformers\|requires uvicorn\|^WARNING: Location" || true
    $PIP --no-deps speculators==0.9.0
fi
mkdir -p "$OUT"
verifier=$(.venv/bin/python -c "from graft_block.target import embedded_folder; print(embedded_folder('smollm2-135m'))")
for drafter in dflash-smollm2 dspark-smollm2 eagle3-smollm2; do
    echo "== $drafter"
    .venv/bin/graft-block export "$drafter" --to speculators --out "$OUT/$drafter" --verifier "$verifier" --force \
        | grep -E "^(wrote|  lost)" || true
    .venv/bin/python scripts/check_speculators.py reference "$drafter" --out "$OUT/$drafter.pt" 2>&1 \
        | grep -v "^Loading weights"
    "$SIDE/bin/python" scripts/check_speculators.py compare "$OUT/$drafter" --ref "$OUT/$drafter.pt" 2>&1 \
        | grep -v "| INFO \|| WARNING \|^Loading weights\|Warning:" 
done
