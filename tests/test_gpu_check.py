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


@pytest.mark.parametrize("name", ["gpu_generate.sh", "gpu_train.sh", "device_prepare.sh", "device_session.sh"])
def test_device_scripts_parse(name):
    assert subprocess.run(["bash", "-n", str(SCRIPT.with_name(name))]).returncode == 0


def test_gpu_train_needs_an_out_dir_and_an_init(tmp_path):
    res = subprocess.run(["bash", str(SCRIPT.with_name("gpu_train.sh")), str(tmp_path / "x")], capture_output=True,
                         text=True)
    assert res.returncode != 0 and "usage: gpu_train.sh OUT_DIR INIT" in res.stderr


@pytest.mark.slow
def test_gpu_train_script_runs_on_cpu(tmp_path):
    """scripts/gpu_train.sh shrunk to 2 steps on the CPU, evaluated on 4 of the held-out answers: it builds their
    features, continues the bundled DFlash and keeps the best held-out weights beside the last (what a GPU call
    returns). An autocast the trainer refuses (float16) fails before the first checkpoint, so the script reruns
    without it, as it would on a GPU where bfloat16 autocast broke."""
    import json

    import numpy as np

    from graft_block import onpolicy as OP

    src = SCRIPT.parents[1] / "drafters" / "data" / "smollm2-sharegpt-heldout"
    man = json.loads((src / OP.MANIFEST).read_text())
    entry, recs = man["shards"][0], OP.read(src)[:4]  # the first shard's first 4 answers
    small = tmp_path / "heldout"
    small.mkdir()
    OP.write_shard(small / entry["file"], [r["ids"].numpy() for r in recs], [r["prompt_len"] for r in recs],
                   [r["prompt_index"] for r in recs], [r["sample"] for r in recs], np.uint16)
    (small / OP.MANIFEST).write_text(json.dumps({**man, "shards": [{**entry, "sequences": len(recs)}]}))
    env = {**os.environ, "PYTHON": sys.executable, "GRAFT_BLOCK_DEVICE": "cpu", "GRAFT_BLOCK_DATA": str(tmp_path / "d"),
           "GRAFT_BLOCK_HELDOUT": str(small), "GRAFT_BLOCK_TRAIN_STEPS": "2", "GRAFT_BLOCK_TRAIN_BATCH": "2",
           "GRAFT_BLOCK_TRAIN_EVAL_EVERY": "1", "GRAFT_BLOCK_TRAIN_AUTOCAST": "float16"}
    init = SCRIPT.parents[1] / "drafters" / "checkpoints" / "dflash-smollm2"
    res = subprocess.run(["bash", str(SCRIPT.with_name("gpu_train.sh")), str(tmp_path / "out"), str(init), "2"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "invalid choice: 'float16'" in res.stderr and "rerunning without" in res.stderr
    assert (tmp_path / "out" / "ckpt" / "model.safetensors").exists()
    best = json.loads((tmp_path / "out" / "ckpt-best" / "best_step.json").read_text())
    assert best["step"] in (0, 1, 2) and best["rows"] > 50  # the 4 held-out answers were evaluated
