"""The wheel works on its own: built from this checkout, installed into a fresh venv (offline, --no-deps, the
dependencies borrowed from the running environment), then used from a directory outside the checkout."""
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(cmd, cwd, env=None):
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{cmd} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    # Build from a copy: setuptools leaves build/ in the source tree, and a stale one could leak into the wheel.
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                            "runs", ".cache", ".pytest_cache"))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(tmp / "dist"), str(src)], cwd=tmp)
    wheels = list((tmp / "dist").glob("graft_block-*.whl"))
    assert len(wheels) == 1, wheels
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp)
    py = venv / "bin" / "python"
    site = Path(run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp).strip())
    # Borrow torch, transformers, pip ... from this environment: a .pth line, which (unlike a site dir) does not
    # run that environment's own .pth files, so the editable install of the checkout stays invisible.
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheels[0])], cwd=tmp)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    outside = tmp / "elsewhere"
    outside.mkdir()
    return py, venv, outside, env


def test_wheel_installs_only_graft_block(wheel_env):
    py, venv, outside, env = wheel_env
    site = Path(run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], outside, env).strip())
    record = next(site.glob("graft_block-*.dist-info")) / "RECORD"
    top = {line.split("/")[0] for line in record.read_text().splitlines() if line}
    assert {t for t in top if not t.endswith(".dist-info") and t != ".."} == {"graft_block"}, top  # .. = bin/
    for name in ("tree", "drafters", "eval"):
        res = subprocess.run([str(py), "-c", f"import {name}"], cwd=outside, env=env, capture_output=True, text=True)
        assert res.returncode != 0 and "No module named" in res.stderr, (name, res.stderr)


def test_wheel_decodes_outside_the_checkout(wheel_env):
    py, venv, outside, env = wheel_env
    script = textwrap.dedent(f"""
        import graft_block, torch
        from pathlib import Path
        assert Path({str(ROOT)!r}) not in Path(graft_block.__file__).resolve().parents, graft_block.__file__
        from graft_block import Drafter, SpeculativeDecoder
        from graft_block.drafter import bundled_checkpoint, registered_types
        from graft_block.drafters.dflash import load_checkpoint
        from graft_block.testing import tiny_target
        assert {{"dflash", "eagle3", "mfd", "pld"}} <= set(registered_types())
        folder = bundled_checkpoint("dflash-smollm2")  # package data, inside the installed package
        assert folder is not None and Path(graft_block.__file__).parent in folder.parents, folder
        load_checkpoint(folder)
        target = tiny_target("llama")
        ids = torch.tensor([5, 6, 7, 5, 6, 7, 5, 6])
        ref = SpeculativeDecoder(target, None).generate(ids, max_new_tokens=12).tokens
        out = SpeculativeDecoder(target, Drafter.from_config({{"type": "pld", "budget": 4}})).generate(
            ids, max_new_tokens=12).tokens
        assert out == ref, (out, ref)
        print("ok", len(out))
    """)
    assert run([str(py), "-c", script], outside, env).strip().startswith("ok")
    help_text = run([str(venv / "bin" / "graft-block"), "bench", "--list-methods"], outside, env)
    assert "dflash_ddtree" in help_text and "missing" not in help_text
