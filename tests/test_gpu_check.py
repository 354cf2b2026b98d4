"""scripts/gpu_check.sh, the prepared GPU check, exercised here up to its first CUDA call."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def test_script_parses_and_needs_an_out_dir():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    res = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True)
    assert res.returncode != 0 and "usage: gpu_check.sh OUT_DIR" in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the real check runs instead")
def test_without_cuda_it_stops_at_the_device_with_a_clear_message(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "GRAFT_BLOCK_DEVICE": "cuda"}
    res = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode != 0
    assert "no CUDA device visible" in res.stderr and "GRAFT_BLOCK_DEVICE=cpu" in res.stderr
    assert not (tmp_path / "out" / "lossless.log").exists()  # nothing ran past the device check


def test_tiny_targets_follow_the_test_device(monkeypatch):
    from graft_block.testing import tiny_target

    monkeypatch.setenv("GRAFT_BLOCK_TEST_DEVICE", "meta")  # any device string reaches the model
    assert tiny_target("llama", engine="hf").model.device.type == "meta"
