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


@pytest.mark.parametrize("name", [
    "gpu_generate.sh", "gpu_train.sh", "device_prepare.sh", "device_session.sh", "device_steps.sh"])
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


# ---- the device tool's session: scripts/device_prepare.sh lays out .gpu/1..N, scripts/device_session.sh is each call

@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the real check would run")
def test_gpu_check_out_dir_is_relative_to_the_caller(tmp_path):
    """A relative OUT_DIR lands under the caller's folder (it landed under the repo root: the script cd'd first).
    The check then stops at the missing CUDA device, after making OUT_DIR."""
    env = {**os.environ, "PYTHON": sys.executable, "GRAFT_BLOCK_DEVICE": "cuda"}
    name = f"gpu-check-out-{os.getpid()}"
    res = subprocess.run(["bash", str(SCRIPT), name], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    stray = SCRIPT.parents[1] / name
    if stray.is_dir():
        stray.rmdir()
        pytest.fail(f"{name} was made under the repo root, not the caller's folder")
    assert (tmp_path / name).is_dir() and "no CUDA device visible" in res.stderr, res.stderr[-2000:]


def _pack(work, out, *patterns, **limits):
    env = {**os.environ, **{f"GRAFT_BLOCK_PACK_{k.upper()}": str(v) for k, v in limits.items()}}
    return subprocess.run([sys.executable, str(SCRIPT.with_name("device_pack.py")), str(work), str(out), *patterns],
                          env=env, capture_output=True, text=True, timeout=60)


def test_device_pack_takes_the_most_wanted_results_within_the_return_limits(tmp_path):
    import tarfile

    work, out = tmp_path / "w", tmp_path / "out"
    for rel, size in {"logs/train.log": 300, "gen/a.npz": 2000, "train/run/log.jsonl": 100,
                      "train/ckpt-best/model.safetensors": 9000, "train/ckpt/model.safetensors": 9000,
                      "pairs/x/ckpt/model.safetensors": 9000}.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_bytes(os.urandom(size))
    out.mkdir()
    (out / "res.part.07").write_bytes(b"stale")  # an earlier pack's part is replaced, not counted
    res = _pack(work, out, "gen", "train/run/log.jsonl", "train/ckpt-best", "train/ckpt", "pairs/*/ckpt",
                part_bytes=8192, total_bytes=30000, files=5)
    assert res.returncode == 0, res.stderr
    parts = sorted(out.glob("res.part.*"))
    files = [p for p in out.iterdir()]
    assert len(files) <= 5 and sum(p.stat().st_size for p in files) <= 30000
    assert all(p.stat().st_size <= 8192 for p in parts) and not (out / "res.part.07").exists()
    (tmp_path / "res.tar").write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(tmp_path / "res.tar") as tf:
        names = set(tf.getnames())
        got = tf.extractfile("train/ckpt-best/model.safetensors").read()
    assert got == (work / "train/ckpt-best/model.safetensors").read_bytes()
    assert {"gen/a.npz", "train/run/log.jsonl"} <= names and "train/ckpt/model.safetensors" not in names
    assert "left behind (over the tool's return limits): train/ckpt pairs/x/ckpt" in res.stdout
    with tarfile.open(out / "logs.tgz") as tf:
        assert "logs/train.log" in tf.getnames()


def _fake_device_tree(tmp_path, parts: int = 2):
    """A copy of the scripts as the device sees them, and a payload (one .tar.xz, as device_prepare.sh writes it)
    split over .gpu/1..N with its manifest."""
    import hashlib
    import io
    import shutil
    import tarfile

    root = tmp_path / "tree"
    (root / "scripts").mkdir(parents=True)
    for f in SCRIPT.parent.iterdir():
        if f.suffix in (".sh", ".py"):
            shutil.copy(f, root / "scripts" / f.name)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tf:
        for name, data in (("prompts.npz", os.urandom(3000)), ("checkpoints/c/config.json", b"{}")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    blob = buf.getvalue()
    sha = hashlib.sha256(blob).hexdigest()
    step = -(-len(blob) // parts)
    folders = []
    for i in range(1, parts + 1):
        d = tmp_path / f"part{i}"
        d.mkdir()
        (d / f"payload.{sha[:12]}.part.{i}").write_bytes(blob[(i - 1) * step: i * step])
        (d / "payload.manifest").write_text(f"{parts} {sha}\n")
        folders.append(d)
    return root, folders


def _session(root, carried, work, out, **env):
    import shutil

    shutil.rmtree(root / ".gpu", ignore_errors=True)
    for d in carried:  # what this call's carry brings
        shutil.copytree(d, root / ".gpu" / d.name.replace("part", ""))
    full = {**os.environ, "OUT": str(out), "WORK": str(work), "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(root / "scripts" / "device_session.sh")], cwd=root, env=full,
                          capture_output=True, text=True, timeout=60)


def test_device_session_stashes_each_part_and_names_the_next_or_the_missing(tmp_path):
    root, (p1, p2) = _fake_device_tree(tmp_path)
    work, out = tmp_path / "home", tmp_path / "out"
    res = _session(root, [p1], work, out)
    assert res.returncode == 0 and 'carry=[".gpu/2"]' in res.stdout, res.stderr
    # a fresh machine (the last one went back between calls) gets part 2 alone
    res = _session(root, [p2], tmp_path / "fresh", out)
    assert res.returncode == 3 and "1 missing" in res.stderr and "carrying .gpu/1" in res.stderr
    # a damaged part is refused before anything runs
    bad = tmp_path / "bad"
    res = _session(root, [p1], bad, out)
    part = next((bad / "stash").glob("payload.*.part.1"))
    part.write_bytes(b"x" + part.read_bytes()[1:])
    res = _session(root, [p2], bad, out)
    assert res.returncode == 3 and "sha256" in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_session_stops_at_a_machine_without_cuda(tmp_path):
    root, (p1, p2) = _fake_device_tree(tmp_path)
    work, out = tmp_path / "home", tmp_path / "out"
    assert _session(root, [p1], work, out).returncode == 0
    res = _session(root, [p2], work, out)
    assert res.returncode == 6 and "no CUDA device visible" in res.stderr
    assert (work / "payload" / "checkpoints" / "c" / "config.json").exists()  # unpacked and verified first


def test_device_session_unknown_step_fails_before_anything(tmp_path):
    root, (p1, _) = _fake_device_tree(tmp_path)
    res = _session(root, [p1], tmp_path / "home", tmp_path / "out", STEPS="lossless tarin")
    assert res.returncode == 2 and "unknown step 'tarin'" in res.stderr
    assert not (tmp_path / "home").exists()


def test_device_session_keeps_its_deadline_and_returns_what_finished(tmp_path):
    """Steps that would run on (a stub python whose tests and models never end) are cut at the session's deadline,
    the rest skipped, and $OUT still holds the logs: the call ends inside the tool's limit with its results."""
    import time

    root, parts = _fake_device_tree(tmp_path, parts=1)
    stub = tmp_path / "python3"
    stub.write_text(f"""#!/usr/bin/env bash
case "$1" in
  scripts/device_visible.py) echo "device: stub" ;;
  -c) case "$2" in *tarfile*) exec {sys.executable} "$@" ;; *) echo stub ;; esac ;;
  scripts/device_pack.py) exec {sys.executable} "$@" ;;
  -m) case "$2" in
        pip) while [ $# -gt 0 ]; do [ "$1" = --target ] && mkdir -p "$2/graft_block-0.dist-info"; shift; done ;;
        pytest) echo "stub pytest started"; exec sleep 300 ;;
        *) exec sleep 300 ;;
      esac ;;
esac
""")
    stub.chmod(0o755)
    out = tmp_path / "out"
    t0 = time.time()
    res = _session(root, parts, tmp_path / "home", out, PYTHON=str(stub), STEPS="lossless gen train",
                   INIT="drafters/checkpoints/c", SESSION_SECONDS="8", SESSION_RESERVE="1", SESSION_MIN_STEP="2")
    assert time.time() - t0 < 30, "the session ran past its deadline"
    assert res.returncode == 1, res.stdout + res.stderr  # lossless was cut: a failed step
    assert "lossless rc=124" in res.stdout and "gen skipped" in res.stdout and "train skipped" in res.stdout
    import tarfile

    with tarfile.open(out / "logs.tgz") as tf:
        log = tf.extractfile("logs/check/lossless.log").read().decode()
    assert "stub pytest started" in log


def test_device_session_refuses_steps_whose_checkpoints_did_not_travel(tmp_path):
    """The payload holds checkpoint "c" only; "train" needs INIT (dflash-smollm2): refused before any step."""
    root, parts = _fake_device_tree(tmp_path, parts=1)
    res = _session(root, parts, tmp_path / "home", tmp_path / "out", STEPS="train", GRAFT_BLOCK_DEVICE="cpu")
    assert res.returncode == 8 and "needs the checkpoint drafters/checkpoints/dflash-smollm2" in res.stderr
