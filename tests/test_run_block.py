"""The benchmark harness: JSON + table end to end, the lossless alarm, MT-Bench turn 2, sharding."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "eval"))

import run_block  # noqa: E402
from graft_block.testing import tiny_target  # noqa: E402


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-target")
    t = tiny_target("llama")
    t.model.save_pretrained(folder)
    prompts = folder / "prompts.jsonl"
    with open(prompts, "w") as fh:
        for i in range(4):
            fh.write(json.dumps({"id": f"p{i}", "turns": [[(3 * i + j) % 100 + 1 for j in range(6)] * 2]}) + "\n")
    return folder, prompts


def _run(args, env_cache):
    os.environ["GRAFT_BLOCK_CACHE"] = str(env_cache)
    return run_block.main(args)


def test_tiny_end_to_end_json_and_table(tiny_folder, tmp_path, capsys):
    folder, prompts = tiny_folder
    out = tmp_path / "run"
    rep = _run(["--target", str(folder), "--methods", "ar,pld", "--prompts", str(prompts), "--limit", "2",
                "--max-new-tokens", "24", "--no-progress", "--no-plots", "--out", str(out)], tmp_path / "cache")
    text = capsys.readouterr().out
    assert "| method |" in text and "| pld |" in text and "| ar |" in text
    data = json.loads((out / "results.json").read_text())
    assert {r["method"] for r in data["records"]} == {"ar", "pld"}
    assert len(data["records"]) == 4 and data["environment"]["torch"] == torch.__version__
    assert all(r["matches_ar"] for r in data["records"] if r["method"] == "pld")
    row = {r["method"]: r for r in data["summary"]}["pld"]
    assert row["tau"] >= 1.0 and row["speedup"] is not None and not row["mismatches"]
    assert "LOSSLESS CHECK FAILED" not in text
    assert rep["verify_cost_curve"]["median_s"]


def test_lossless_flag_trips_on_broken_method(tiny_folder, capsys):
    target = tiny_target("llama")
    ar = run_block.make_method("ar", run_block.PRESETS["ar"], target, None)
    good = ar.run

    def broken_run(ids, n, temp, seed):
        r = good(ids, n, temp, seed)
        r["tokens"] = r["tokens"][:-1] + [(r["tokens"][-1] + 1) % 128]  # one wrong token at the end
        return r

    broken = run_block.Method("broken", broken_run)
    prompts = [{"id": "x", "turns": [[1, 2, 3, 4]]}, {"id": "y", "turns": [[5, 6, 7]]}]
    recs = run_block.run_benchmark(target, [ar, broken], prompts, 16, [0.0], progress=False)
    run_block.add_comparisons(recs)
    rows = run_block.summarize(recs)
    alarm = run_block.lossless_alarm(rows)
    assert alarm is not None and "broken" in alarm and "x#0" in alarm
    assert "MISMATCH x2" in run_block.markdown_table(rows)


def test_mtbench_second_turn_uses_own_answer(smollm2):
    seen = []

    def fake(answer):
        ids = smollm2.tokenizer(answer, add_special_tokens=False)["input_ids"]

        def run(prompt_ids, n, temp, seed):
            seen.append((answer, smollm2.tokenizer.decode(prompt_ids.tolist())))
            return {"tokens": ids, "decode_tok_s": 1.0, "tau": 1.0}

        return run

    methods = [run_block.Method("ar", fake("ALPHA ANSWER")), run_block.Method("other", fake("BETA REPLY"))]
    prompts = [{"id": "mt", "turns": ["First question?", "Second question?"]}]
    run_block.run_benchmark(smollm2, methods, prompts, 8, [0.0], progress=False)
    turn2 = {a: p for a, p in seen if "Second question?" in p}
    assert "ALPHA ANSWER" in turn2["ALPHA ANSWER"] and "BETA REPLY" not in turn2["ALPHA ANSWER"]
    assert "BETA REPLY" in turn2["BETA REPLY"] and "ALPHA ANSWER" not in turn2["BETA REPLY"]


def test_sharded_equals_unsharded(tiny_folder, tmp_path):
    folder, prompts = tiny_folder
    common = ["--target", str(folder), "--methods", "ar,pld", "--prompts", str(prompts), "--limit", "4",
              "--max-new-tokens", "16", "--no-progress", "--no-plots"]
    env = {**os.environ, "GRAFT_BLOCK_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    script = str(ROOT / "eval" / "run_block.py")
    subprocess.run([sys.executable, script, *common, "--out", str(tmp_path / "one")], check=True, env=env,
                   capture_output=True)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                    "29533", script, *common, "--out", str(tmp_path / "two")], check=True, env=env,
                   capture_output=True)
    one = json.loads((tmp_path / "one" / "results.json").read_text())
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert two["world_size"] == 2
    key = lambda r: (r["prompt_id"], r["method"], r["turn"])  # noqa: E731
    a = {key(r): r["tokens"] for r in one["records"]}
    b = {key(r): r["tokens"] for r in two["records"]}
    assert a == b and len(a) == 8
