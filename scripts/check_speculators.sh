#!/usr/bin/env bash
# Exports the bundled DFlash, DSpark and EAGLE-3 drafters to vLLM speculators folders and has speculators' own model
# classes draft from them (scripts/check_speculators.py): each must reproduce graft-block's logits.
# speculators 0.9.0 pins transformers <= 5.19 (graft-block wants >= 5.24), so it lives in a side venv
# (GRAFT_BLOCK_SPECULATORS_VENV, default .venv-speculators) that reuses .venv's torch through a .pth file: no second
# torch is downloaded. First run ~30 s of installs; usage: bash scripts/check_speculators.sh [OUT_FOLDER]
set -euo pipefail
OUT=$(realpath -m "${1:-$(dirname "$0")/../runs/speculators-check}")  # relative to where it was called from
cd "$(dirname "$0")/.."
SIDE=${GRAFT_BLOCK_SPECULATORS_VENV:-.venv-speculators}
[ -x .venv/bin/python ] || { echo "no .venv: run bash scripts/install.sh first" >&2; exit 2; }
READY="import speculators, transformers; assert transformers.__version__ == '5.19.0', transformers.__version__"
if ! "$SIDE/bin/python" -c "$READY" 2>/dev/null; then
    .venv/bin/python -m venv "$SIDE"  # the same interpreter, so .venv's compiled packages load in it
    main_site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    side_site=$("$SIDE/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "$main_site" > "$side_site/graft_block_venv.pth"  # after the side venv's own packages: its transformers wins
    PIP="$SIDE/bin/pip install -q --disable-pip-version-check"
    # speculators' requirements without torch / torchvision / torchaudio (it imports none of the last two)
    $PIP aiohttp click "datasets>=4.0.0,<=5.1.0" httpx huggingface-hub "loguru>=0.7.2,<=0.7.3" openai protobuf \
        psutil pydantic pydantic-settings rich typer hs-connectors==0.9.0 transformers==5.19.0 2>&1 \
        | sed "/dependency resolver\|requires transformers\|requires uvicorn\|^WARNING: Location/d"
    $PIP --no-deps speculators==0.9.0
    "$SIDE/bin/python" -c "$READY"  # a failed install stops here, with speculators' own error
fi
mkdir -p "$OUT"
verifier=$(.venv/bin/python -c "from graft_block.target import embedded_folder; print(embedded_folder('smollm2-135m'))")
DRAFTERS=(dflash-smollm2 dspark-smollm2 eagle3-smollm2)
folders=() refs=()
for drafter in "${DRAFTERS[@]}"; do
    echo "== $drafter"
    rm -rf "$OUT/$drafter" "$OUT/$drafter.pt"  # a failed export must not leave the last run's folder to check
    .venv/bin/graft-block export "$drafter" --to speculators --out "$OUT/$drafter" --verifier "$verifier" \
        | sed -n "/^wrote\|^  lost/p"
    folders+=("$OUT/$drafter") refs+=("$OUT/$drafter.pt")
done
# each half in one process for all three: the target loads once, speculators imports once (8 s)
.venv/bin/python scripts/check_speculators.py reference "${DRAFTERS[@]}" --out "${refs[@]}"
"$SIDE/bin/python" scripts/check_speculators.py compare "${folders[@]}" --ref "${refs[@]}" 2>&1 \
    | sed "/| INFO \|| WARNING \|Warning:/d"
