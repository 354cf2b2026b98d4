"""The benchmark harness end to end: JSON + table, the lossless alarm, MT-Bench turn 2, the HF peers, sharding."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graft_block.errors import ConfigError
from graft_block.eval import measure, report, run_block
from graft_block.eval.methods import Method, make_method
from graft_block.eval.presets import PRESETS
from graft_block.testing import tiny_target

ROOT = Path(__file__).resolve().parents[1]


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


def _run(args, cache, monkeypatch):
    monkeypatch.setenv("GRAFT_BLOCK_CACHE", str(cache))
    return run_block.main(args)


def test_tiny_end_to_end_json_and_table(tiny_folder, tmp_path, capsys, monkeypatch):
    folder, prompts = tiny_folder
    out = tmp_path / "run"
    rep = _run(["--target", str(folder), "--methods", "ar,pld", "--prompts", str(prompts), "--limit", "2",
                "--max-new-tokens", "24", "--no-progress", "--no-plots", "--out", str(out)], tmp_path / "cache",
               monkeypatch)
    text = capsys.readouterr().out
    assert "| method |" in text and "| pld |" in text and "| ar |" in text
    assert "prompts (limit 2 of 4 prompts)" in text and "max_new_tokens 24" in text
    data = json.loads((out / "results.json").read_text())
    assert {r["method"] for r in data["records"]} == {"ar", "pld"}
    assert len(data["records"]) == 4 and data["environment"]["torch"] == torch.__version__
    assert all(r["matches_ar"] for r in data["records"] if r["method"] == "pld")
    row = {r["method"]: r for r in data["summary"]}["pld"]
    assert row["tau"] >= 1.0 and row["speedup"] is not None and not row["mismatches"]
    assert row["speedup_median"] is not None  # aggregate and per-prompt speedups both in the JSON
    assert all(r["speedup"] is not None and r["decode_tokens"] == r["new_tokens"] - 1 for r in data["records"])
    assert "busy" in data and "before" in data["load"] and "LOSSLESS CHECK FAILED" not in text
    assert rep["verify_cost_curve"]["median_s"] and data["spread"]


def test_top_k_and_top_p_reach_every_method(tiny_folder, tmp_path, capsys, monkeypatch):
    """--top-k 1 at T = 1 is greedy decoding: every method's sampled tokens, ours and HF's, equal AR's greedy ones,
    which a filter dropped anywhere on the way would break (the tiny random model's T = 1 law is near uniform)."""
    folder, prompts = tiny_folder
    out = tmp_path / "run"
    _run(["--target", str(folder), "--methods", "ar,pld,hf", "--prompts", str(prompts), "--limit", "2",
          "--max-new-tokens", "12", "--temperature", "0,1", "--top-k", "1", "--top-p", "0.9", "--no-progress",
          "--no-plots", "--no-physics", "--out", str(out)], tmp_path / "cache", monkeypatch)
    assert "T 0,1, top-k 1, top-p 0.9" in capsys.readouterr().out
    data = json.loads((out / "results.json").read_text())
    greedy = {r["prompt_id"]: r["tokens"] for r in data["records"] if r["method"] == "ar" and r["temperature"] == 0}
    hot = [r for r in data["records"] if r["temperature"] == 1]
    assert {r["method"] for r in hot} == {"ar", "pld", "hf"} and (data["top_k"], data["top_p"]) == (1, 0.9)
    assert all(r["tokens"] == greedy[r["prompt_id"]] and (r["top_k"], r["top_p"]) == (1, 0.9) for r in hot)


def test_bad_options_fail_before_the_model_loads(tmp_path, monkeypatch):
    (tmp_path / "empty.json").write_text('[{"name": "x"}]')
    for bad, what in ((["--top-p", "0"], "top_p must be in"), (["--top-k", "-2"], "top_k must be"),
                      (["--temperature", "0,-1"], "temperature must be"),
                      (["--budget", "4,0"], "--budget must be >= 1"),
                      (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
                      (["--config", str(tmp_path / "none.json")], "does not exist"),
                      (["--config", str(tmp_path / "empty.json")], "'x' says nothing to run")):
        with pytest.raises(ConfigError, match=what):
            _run(["--target", str(tmp_path / "no-such-model"), "--methods", "ar", *bad, "--out", str(tmp_path / "o")],
                 tmp_path / "cache", monkeypatch)


def test_hf_peer_runs_in_a_child_process_once_the_engine_released_hfs_weights(tiny_folder, tmp_path, monkeypatch):
    """The main job releases HF's weights once the engine's C layers hold their own copy; the HF peer then runs
    its calls in one child process that reloads the model once (until the timed runs end), stays token-identical
    to AR, and reports its own memory."""
    from graft_block import skinny

    if not skinny.available():
        pytest.skip(f"the skinny kernel does not run here: {skinny.why_not()}")
    folder, prompts = tiny_folder
    monkeypatch.setenv("GRAFT_BLOCK_GEMM", "skinny")
    out = tmp_path / "run"
    _run(["--target", str(folder), "--methods", "ar,hf", "--prompts", str(prompts), "--limit", "2",
          "--max-new-tokens", "32", "--no-progress", "--no-plots", "--no-physics", "--out", str(out)],
         tmp_path / "cache", monkeypatch)
    data = json.loads((out / "results.json").read_text())
    hf = [r for r in data["records"] if r["method"] == "hf"]
    assert len(hf) == 2 and all(r["matches_ar"] and r["child_peak_rss_mb"] > 0 for r in hf)
    assert len({r["child_pid"] for r in hf}) == 1 and hf[0]["child_pid"] != os.getpid()  # one child, loaded once
    # the CPU it spends inside a call is ours, not a competitor's (uncredited, it read as others' ~0.9 cores)
    assert all(0.05 < r["load"]["own_cpu_s"] and r["load"]["others_cpu_s"] < r["load"]["own_cpu_s"] / 2
               and r["load"]["busy"] is not True for r in hf), [r["load"] for r in hf]
    with pytest.raises(ProcessLookupError):  # stopped and reaped with the timed runs
        os.kill(hf[0]["child_pid"], 0)
    assert data["child_peak_rss_mb"] == max(r["child_peak_rss_mb"] for r in hf)


def test_lossless_flag_trips_on_broken_method():
    target = tiny_target("llama")
    ar = make_method("ar", PRESETS["ar"], target, None)
    good = ar.run

    def broken_run(ids, n, temp, seed, **filters):
        r = good(ids, n, temp, seed, **filters)
        r["tokens"] = r["tokens"][:-1] + [(r["tokens"][-1] + 1) % 128]  # one wrong token at the end
        return r

    broken = Method("broken", broken_run)
    prompts = [{"id": "x", "turns": [[1, 2, 3, 4]]}, {"id": "y", "turns": [[5, 6, 7]]}]
    recs = measure.run_interleaved(target, [ar, broken], prompts, 16, [0.0], progress=False)
    measure.pair_with(recs)
    rows = report.summarize(recs)
    alarm, note = report.lossless_alarm(rows)
    assert alarm is not None and "broken" in alarm and "x#0" in alarm and note is None
    assert "MISMATCH x2" in report.markdown_table(rows)


def test_mtbench_second_turn_uses_own_answer(smollm2):
    seen = []

    def fake(answer):
        ids = smollm2.tokenizer(answer, add_special_tokens=False)["input_ids"]

        def run(prompt_ids, n, temp, seed, **filters):
            seen.append((answer, smollm2.tokenizer.decode(prompt_ids.tolist())))
            return {"tokens": ids, "decode_tokens": len(ids) - 1, "decode_s": 1.0, "tau": 1.0}

        return run

    methods = [Method("ar", fake("ALPHA ANSWER")), Method("other", fake("BETA REPLY"))]
    prompts = [{"id": "mt", "turns": ["First question?", "Second question?"]}]
    measure.run_interleaved(smollm2, methods, prompts, 8, [0.0], progress=False, warmup_tokens=0)
    turn2 = {a: p for a, p in seen if "Second question?" in p}
    assert "ALPHA ANSWER" in turn2["ALPHA ANSWER"] and "BETA REPLY" not in turn2["ALPHA ANSWER"]
    assert "BETA REPLY" in turn2["BETA REPLY"] and "ALPHA ANSWER" not in turn2["BETA REPLY"]


def test_hf_peers_are_timed_inside_one_call_on_smollm2(smollm2):
    """HF generate and HF prompt lookup on the real target: greedy-identical to our AR loop, and their decode phase
    starts after the first forward of the same call (nothing measured separately and subtracted)."""
    ids = smollm2.encode([{"role": "user", "content": "Count from 1 to 9."}])
    ar = make_method("ar", PRESETS["ar"], smollm2, None).run(ids, 12, 0.0, 0)
    for name in ("hf", "hf_pld"):
        r = make_method(name, PRESETS[name], smollm2, None).run(ids, 12, 0.0, 0)
        assert r["tokens"] == ar["tokens"], name
        assert 0 < r["decode_tokens"] < r["new_tokens"] == len(r["tokens"])
        assert r["decode_tok_s"] == pytest.approx(r["decode_tokens"] / r["decode_s"]) and r["prefill_s"] > 0


def test_sharded_equals_unsharded(tiny_folder, tmp_path):
    folder, prompts = tiny_folder
    common = ["--target", str(folder), "--methods", "ar,pld", "--prompts", str(prompts), "--limit", "4",
              "--max-new-tokens", "16", "--budget", "8", "--no-progress", "--no-plots", "--no-physics", "--threads",
              "1"]  # a fixed budget: auto's pilots cost each process seconds and test nothing here
    env = {**os.environ, "GRAFT_BLOCK_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    script = str(ROOT / "eval" / "run_block.py")

    def run(cmd):  # a failure shows the child's own error, not only its exit status
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        assert p.returncode == 0, f"{' '.join(cmd)}\nexited {p.returncode}:\n{p.stderr[-4000:]}"

    with socket.socket() as s:  # a free rendezvous port: a fixed one may still be held by an earlier run
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run([sys.executable, script, *common, "--out", str(tmp_path / "one")])
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port), script,
         *common, "--out", str(tmp_path / "two")])
    one = json.loads((tmp_path / "one" / "results.json").read_text())
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert two["world_size"] == 2
    key = lambda r: (r["prompt_id"], r["method"], r["turn"])  # noqa: E731
    a = {key(r): r["tokens"] for r in one["records"]}
    b = {key(r): r["tokens"] for r in two["records"]}
    assert a == b and len(a) == 8
    assert [r["prompt_id"] for r in two["records"]] == [r["prompt_id"] for r in one["records"]]  # prompt order kept


def test_token_id_turns_are_fed_the_methods_own_answer():
    """A later token-id turn (tokenizer-less targets) follows the earlier turns and this method's own answers, as
    a text turn does through the chat template: it was encoded alone, with no conversation before it."""
    target = tiny_target("llama")
    seen = []

    def fake(name, answer):
        def run(prompt_ids, n, temp, seed, **filters):
            seen.append((name, prompt_ids.tolist()))
            return {"tokens": list(answer), "decode_tokens": len(answer) - 1, "decode_s": 1.0, "tau": 1.0}

        return run

    methods = [Method("ar", fake("ar", [40, 41, 42])), Method("other", fake("other", [50, 51]))]
    prompts = [{"id": "ids", "turns": [[1, 2, 3], [7, 8]]}]
    recs = measure.run_interleaved(target, methods, prompts, 8, [0.0], progress=False, warmup_tokens=0)
    assert seen == [("ar", [1, 2, 3]), ("other", [1, 2, 3]),
                    ("ar", [1, 2, 3, 40, 41, 42, 7, 8]), ("other", [1, 2, 3, 50, 51, 7, 8])]
    assert [r["prompt_tokens"] for r in recs] == [3, 3, 8, 7]
    from graft_block.eval.prompts import encode_turn
    with pytest.raises(ConfigError, match="mixes text turns and token-id turns"):
        encode_turn(target, [{"role": "user", "content": [1, 2]}, {"role": "assistant", "content": [3]}], "text")
