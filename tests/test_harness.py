"""The benchmark's measurement core without a real model: prompt files, method discovery, the speedup definition,
the spread verdict, the busy-machine guard and the cost-curve cache."""
import json
import os
import subprocess
import sys
import time

import pytest

from graft_block.errors import ConfigError
from graft_block.eval import cli, machine, measure, presets, report, run_block
from graft_block.eval.prompts import describe_sets, prompt_records, read_jsonl
from graft_block.testing import tiny_target


def _write(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


# ---- prompt files -----------------------------------------------------------------------------------------
def test_jsonl_shapes(tmp_path):
    f = _write(tmp_path / "mine.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
        {"id": "b", "prompt": "Explain KV caches."},
        {"text": "Plain text record.", "category": "coding"},
        "",
        {"turns": [[1, 2, 3]]},  # token ids, for tokenizer-less targets
    ])
    recs = read_jsonl(f)
    assert [r["id"] for r in recs] == ["mine/81", "mine/b", "mine/3", "mine/5"]  # default id: the line number
    assert [r["category"] for r in recs] == ["writing", None, "coding", None]
    assert recs[0]["turns"] == ["Write a poem.", "Now shorter."] and recs[1]["turns"] == ["Explain KV caches."]
    assert recs[3]["turns"] == [[1, 2, 3]]
    used, info = prompt_records([str(f)], limit=0, first_turn_only=True)
    assert len(used) == 4 and all(len(r["turns"]) == 1 for r in used) and used[0]["set"] == "mine"
    used, info = prompt_records([str(f)], limit=1)
    assert len(used) == 1 and len(used[0]["turns"]) == 2
    assert describe_sets(info, 1) == "mine (limit 1 of 4 prompts, 2 turns)"
    assert describe_sets(prompt_records([str(f)], 0)[1], 0) == "mine (all 4 prompts, 5 turns)"


@pytest.mark.parametrize("line,needle", [
    ("{not json", "mine.jsonl:1: not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"question": "x"}', "give 'turns' (a list of user turns), 'prompt' or 'text' (found keys: question)"),
    ('{"turns": []}', "'turns' must be a non-empty list"),
    ('{"turns": ["ok", 3]}', "turns[1] must be non-empty text"),
    ('{"turns": ["ok", [1, 2]]}', "'turns' mixes text turns and token-id turns"),
    ('{"prompt": "x", "category": 5}', "category must be a string"),
    ('{"id": 1, "prompt": "x"}\n{"id": 1, "prompt": "y"}', "mine.jsonl:2: id '1' repeats line 1"),
])
def test_jsonl_errors_name_the_line_and_the_fix(tmp_path, line, needle):
    f = tmp_path / "mine.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(ConfigError) as exc:
        read_jsonl(f)
    assert needle in str(exc.value) and "--prompt-field" not in str(exc.value)


def test_unknown_prompt_set_and_bad_limit_name_the_real_options(tmp_path):
    with pytest.raises(ConfigError, match="humaneval, mtbench, sharegpt or paths to JSONL files"):
        prompt_records(["mybench"], 1)
    with pytest.raises(ConfigError, match=r"no such file"):
        prompt_records([str(tmp_path / "missing.jsonl")], 1)
    with pytest.raises(ConfigError, match="--limit must be >= 0"):
        prompt_records(["mtbench"], -1)


# ---- method discovery (no model) --------------------------------------------------------------------------
@pytest.fixture
def no_model(monkeypatch):
    """Any attempt to load a target fails the test."""
    import graft_block.target

    def boom(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(graft_block.target, "load_target", boom)


def test_list_methods_loads_no_model(no_model, capsys):
    out = run_block.main(["--list-methods"])
    text = capsys.readouterr().out
    for name in presets.PRESETS:
        assert f"| {name} |" in text
    rows = {r["name"]: r for r in out["methods"]}
    assert rows["eagle3_graft"]["graft"] == "graft" and rows["eagle3_graft"]["budget"] == 16
    assert rows["dflash_tail"]["graft"] == "tail" and "dflash-smollm2" in rows["dflash_tail"]["checkpoint"]
    assert rows["ar"]["checkpoint"] == "-" and "quick" in rows["ar"]["suites"]
    assert cli.main(["bench", "--list-methods"]) == 0


def test_missing_checkpoint_is_listed_as_missing(no_model, tmp_path):
    extra = {"mine": {"drafter": {"type": "dflash", "checkpoint": "@no-such-drafter"}, "about": "x"}}
    rows = {r["name"]: r for r in presets.method_rows(extra)}
    assert rows["mine"]["checkpoint"] == "no-such-drafter: MISSING"


def test_unknown_method_fails_before_any_model_loads(no_model, tmp_path, capsys):
    args = ["--methods", "ar,eagle_three", "--out", str(tmp_path / "o")]
    with pytest.raises(ConfigError, match=r"unknown method 'eagle_three'; presets: ar, hf.*--list-methods"):
        run_block.main(args)
    assert cli.main(["bench", *args]) == 2
    assert "graft-block bench: error: unknown method 'eagle_three'" in capsys.readouterr().err
    assert cli.main(["nope"]) == 2


# ---- the speedup definition -------------------------------------------------------------------------------
def _rec(method, pid, tokens, secs, rounds=None):
    return {"method": method, "prompt_id": pid, "turn": 0, "temperature": 0.0, "budget": None, "tokens": [1],
            "decode_tokens": tokens, "decode_s": secs, "rounds": rounds, "set": "s", "category": None}


def test_aggregate_speedup_is_total_over_total_beside_the_median():
    """One slow method record moves the aggregate, not the median: both are reported, and the aggregate equals
    the row's tok/s over AR's tok/s (so a peer's speedup is consistent with its tok/s)."""
    recs = [_rec("ar", f"p{i}", 100, 1.0, 100) for i in range(3)]
    recs += [_rec("m", "p0", 100, 0.5, 50), _rec("m", "p1", 100, 0.5, 50), _rec("m", "p2", 100, 5.0, 50)]
    measure.pair_with(recs)
    assert [r["speedup"] for r in recs if r["method"] == "m"] == [2.0, 2.0, 0.2]
    rows = {r["method"]: r for r in report.summarize(recs)}
    m, ar = rows["m"], rows["ar"]
    assert m["speedup"] == pytest.approx(0.5)  # (300 tokens / 6 s) / (300 tokens / 3 s)
    assert m["speedup_median"] == pytest.approx(2.0)
    assert m["speedup"] == pytest.approx(m["tok_s"] / ar["tok_s"]) and ar["speedup"] == pytest.approx(1.0)
    assert m["tau"] == pytest.approx(2.0)  # 300 emitted tokens / 150 rounds
    assert measure.speedup([recs[3]], [recs[0]]) == pytest.approx(2.0)  # per prompt: the same function
    notes = report.spread_notes(report.summarize(recs))
    assert "n = 3 prompt-turns per method is too small to separate methods" in notes[0]


def test_spread_separates_methods_with_enough_prompts():
    recs = []
    for i in range(8):
        recs.append(_rec("ar", f"p{i}", 100, 1.0 + 0.05 * i))
        recs.append(_rec("fast", f"p{i}", 100, 0.5 + 0.02 * i))
        recs.append(_rec("same", f"p{i}", 100, (1.0 + 0.05 * i) * (1.1 if i % 2 else 0.9)))
    measure.pair_with(recs)
    rows = {r["method"]: r for r in report.summarize(recs)}
    lo, hi = rows["fast"]["speedup_ci"]
    assert 1.0 < lo <= rows["fast"]["speedup"] <= hi
    note = report.spread_notes(list(rows.values()))[0]
    assert "faster than AR: fast" in note and "not separable from AR: same" in note


# ---- the busy-machine guard -------------------------------------------------------------------------------
def test_judge_thresholds():
    quiet = machine.judge({"wall_s": 1.0, "own_cpu_s": 1.0, "others_cpu_s": 0.02, "runq_s": 0.01, "steal_s": 0.0})
    assert quiet["busy"] is False and quiet["reasons"] == []
    loud = machine.judge({"wall_s": 2.0, "own_cpu_s": 1.0, "others_cpu_s": 1.6, "runq_s": 0.8, "steal_s": 0.0})
    assert loud["busy"] is True and len(loud["reasons"]) == 2
    assert machine.judge({**loud, "wall_s": 0.05})["busy"] is None  # too short to judge alone
    assert machine.judge({"wall_s": 2.0, "own_cpu_s": 1.0, "others_cpu_s": 1.6, "runq_s": 0.0, "steal_s": 0.0},
                         expected_cores=1.0)["busy"] is False  # sibling torchrun ranks are expected
    pooled = machine.pool([{"wall_s": 0.1, "own_cpu_s": 0.1, "others_cpu_s": 0.1, "runq_s": 0.0, "steal_s": 0.0}] * 5)
    assert pooled["busy"] is True and pooled["wall_s"] == pytest.approx(0.5)


@pytest.fixture
def tiny_folder(tmp_path):
    folder = tmp_path / "tiny"
    tiny_target("llama").model.save_pretrained(folder)
    prompts = _write(tmp_path / "p.jsonl", [{"id": f"p{i}", "turns": [[(5 * i + j) % 100 + 1 for j in range(8)]]}
                                            for i in range(4)])
    return folder, prompts


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the load signals read Linux /proc")
def test_busy_flag_set_when_a_cpu_bound_process_competes(tiny_folder, tmp_path, capsys, monkeypatch):
    folder, prompts = tiny_folder
    monkeypatch.setenv("GRAFT_BLOCK_CACHE", str(tmp_path / "cache"))
    spin = "import time\nend = time.time() + 60\nwhile time.time() < end:\n    pass\n"  # bounded even if orphaned
    hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.3)
        rep = run_block.main(["--target", str(folder), "--methods", "ar,pld", "--prompts", str(prompts),
                              "--limit", "0", "--max-new-tokens", "256", "--threads", "1", "--no-progress",
                              "--no-plots", "--no-physics", "--out", str(tmp_path / "run")])
    finally:
        for p in hogs:
            p.kill()
            p.wait()
    text = capsys.readouterr().out
    data = json.loads((tmp_path / "run" / "results.json").read_text())
    # timed windows shorter than MIN_WINDOW_S in all are not judged (64 tokens timed 0.34 s on a quiet EPYC: too close)
    assert rep["load"]["during"]["wall_s"] >= machine.MIN_WINDOW_S, rep["load"]["during"]
    assert data["busy"] is True and rep["load"]["during"]["busy"] is True and rep["load"]["before"]["busy"] is True
    assert "!!! BUSY MACHINE" in text.split("| method |")[0]  # loud, in the table header
    assert rep["verify_cost_curve"]["busy"] is True  # and a cost curve measured then is never cached
    assert not list((tmp_path / "cache" / "cost").glob("*.json"))


def test_a_live_childs_cpu_counts_as_ours_inside_its_calls_only():
    """The HF peers' child serves many calls and is reaped only at the end: until then its CPU is not in
    os.times(), so a window in which it served a call read as another job's load. What it spends inside a call
    is credited to us; what it spends between calls is not (the guard must still see a child that spins idle), not
    even when its reaping moves all of its time into os.times()."""
    if machine.snapshot()["busy"] is None or machine.process_cpu(os.getpid()) is None:
        pytest.skip("no /proc here")
    spin = ("import sys, time\nfor line in sys.stdin:\n    end = time.process_time() + 0.8\n"
            "    while time.process_time() < end:\n        pass\n    print('done', flush=True)\n")
    child = subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    start = machine.snapshot()
    windows = []
    for credited in (True, False):  # a call, then the same work outside any call
        a, c0 = machine.snapshot(), machine.process_cpu(child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "done\n"
        if credited:
            machine.credit(child.pid, machine.process_cpu(child.pid) - c0)
        windows.append(machine.window(a, machine.snapshot()))
    assert windows[0]["others_cpu_s"] < 0.4 and windows[1]["others_cpu_s"] > 0.5, windows
    before = machine.children_cpu()
    child.communicate("")
    machine.forget(child.pid, machine.children_cpu() - before)
    end = machine.snapshot()  # reaped: the credited call stays ours, the other spin does not become ours
    assert 0.6 < end["own_cpu"] - start["own_cpu"] < 1.2, (start, end)
    assert 1.4 < machine.children_cpu() - before  # os.times() took both spins at the reap


# ---- the verify-cost cache --------------------------------------------------------------------------------
def test_cost_cache_key_holds_what_changes_the_curve(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAFT_BLOCK_CACHE", str(tmp_path / "cache"))
    t = tiny_target("llama")
    key = measure.cost_key(t, (1, 2), 32, 2)
    assert {"target", "dtype", "device", "threads", "torch", "context", "sizes", "engine", "attn"} <= set(key)
    assert measure.cost_key(t, (1, 2), 64, 2) != key and measure.cost_key(t, (1, 4), 32, 2) != key
    if getattr(t, "lean", None) is not None:  # the C kernel's source is part of the engine's code
        monkeypatch.setattr(measure.skinny, "SOURCE", measure.skinny.SOURCE + "/* changed */")
        assert measure.cost_key(t, (1, 2), 32, 2)["engine"] != key["engine"]
        monkeypatch.undo()
        monkeypatch.setenv("GRAFT_BLOCK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(machine, "judge", lambda w, e=0.0: {**w, "busy": False, "reasons": []})  # a quiet machine
    first = measure.verify_cost_curve(t, sizes=(1, 2), context=32, reps=2)
    again = measure.verify_cost_curve(t, sizes=(1, 2), context=32, reps=2)
    other = measure.verify_cost_curve(t, sizes=(1, 2), context=48, reps=2)
    assert first["source"].startswith("measured now") and again["source"].startswith("cached")
    assert again["median_s"] == first["median_s"] and other["source"].startswith("measured now")
    assert measure.verify_cost_curve(t, sizes=(1, 2), context=32, reps=2, fresh=True)["source"].startswith("measured")


def test_cost_curve_is_timed_round_robin_and_never_falls(monkeypatch):
    """The schedule and --budget auto read the curve, so a noise dip must not survive: sizes are timed in
    alternation (a slow spell hits every size) and the medians are fitted non-decreasing."""
    assert measure.monotone_fit([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert measure.monotone_fit([5.0, 1.0, 1.0]) == [7 / 3] * 3
    assert measure.monotone_fit([1.0, 2.0, 2.0]) == [1.0, 2.0, 2.0]
    order, fake = [], {1: [0.011], 2: [0.013], 4: [0.017], 8: [0.016]}  # the 12-04 sample's dip at 8

    def timed(target, tree):
        order.append(tree.size)
        return fake[tree.size][0]

    monkeypatch.setattr(measure, "timed_verify", timed)
    monkeypatch.setattr(machine, "judge", lambda w, e=0.0: {**w, "busy": False, "reasons": []})
    curve = measure.verify_cost_curve(tiny_target("llama"), sizes=(8, 1, 4, 2), context=16, reps=2, cache=False)
    assert order == [1, 2, 4, 8] * 3  # a warm-up round, then 2 timed rounds, alternating sizes
    assert curve["raw_median_s"] == {"1": 0.011, "2": 0.013, "4": 0.017, "8": 0.016}
    assert curve["median_s"] == pytest.approx({"1": 0.011, "2": 0.013, "4": 0.0165, "8": 0.0165})


def test_budget_auto_also_tries_the_budget_below_each_stair():
    # the 12-05 fast-state curve (ms): 9 positions cost 16% more than 8, 17 8% more than 16, 5 no more than 4
    ms = {1: 10.4, 2: 11.6, 3: 12.5, 4: 13.0, 5: 13.0, 6: 14.1, 7: 14.6, 8: 15.6, 9: 18.1, 12: 20.0, 16: 23.2,
          17: 25.2, 24: 30.2, 32: 37.8}
    curve = {"median_s": {str(k): v / 1e3 for k, v in ms.items()}}
    assert measure.below_stairs(curve, (4, 8, 16, 32)) == [4, 7, 8, 15, 16, 23, 32]
    assert measure.below_stairs(curve, (4,), drop=0.2) == [4]  # 3 positions are only 4% cheaper than 5
    flat = {"median_s": {"1": 1.0, "64": 1.0}}
    assert measure.below_stairs(flat, (4, 8)) == [4, 8]
    seen = []

    class Pilot:
        def __init__(self, b):
            seen.append(b)

        def run(self, ids, n, temperature, seed):
            return {"tau": 1.5, "rounds": 10, "mean_tree_nodes": float(seen[-1]), "phase_s": {"draft": 0.01}}

    auto = measure.auto_budget(Pilot, curve, [[1, 2, 3]], candidates=(4, 8))
    assert seen == [4, 7, 8] and auto["best"] == 4  # equal tau: the cheapest verify wins


def test_budget_auto_charges_the_nodes_a_schedule_keeps():
    """A scheduled tree is cut below its budget: the estimate charges the verify of the nodes kept, so a large
    budget the schedule trims to 3 nodes can win over a full 4-node tree with a lower tau."""
    curve = {"median_s": {"1": 0.020, "4": 0.021, "8": 0.025, "16": 0.050, "32": 0.060}}
    pilots = {4: {"tau": 1.6, "mean_tree_nodes": 4.0}, 16: {"tau": 1.8, "mean_tree_nodes": 3.0}}

    class Pilot:
        def __init__(self, b):
            self.b = b

        def run(self, ids, n, temperature, seed):
            return {**pilots[self.b], "rounds": 10, "phase_s": {"draft": 0.01, "verify": 0.2}}

    auto = measure.auto_budget(Pilot, curve, [[1, 2, 3]], candidates=(4, 16))
    assert auto["pilot"][16]["verify_nodes"] == 4.0 and auto["pilot"][4]["verify_nodes"] == 5.0
    assert auto["best"] == 16
    assert auto["pilot"][16]["est_speedup"] == pytest.approx(1.8 * 0.020 / (0.021 + 0.001))


def test_budget_auto_leaves_out_the_budgets_a_method_refuses():
    """A chain longer than its block is refused at build: --budget auto picks among the budgets that build (the
    quick suite's dspark_chain was skipped whole when its pilot reached 16), and raises when none does."""
    curve = {"median_s": {"1": 0.020, "64": 0.020}}

    class Pilot:
        def __init__(self, b):
            if b > 8:
                raise ConfigError(f"a chain proposal has at most 8 nodes, budget is {b}")
            self.b = b

        def run(self, ids, n, temperature, seed):
            return {"tau": 1.0 + 0.1 * self.b, "rounds": 10, "mean_tree_nodes": float(self.b), "phase_s": {}}

    auto = measure.auto_budget(Pilot, curve, [[1, 2, 3]], candidates=(4, 8, 16, 32))
    assert set(auto["pilot"]) == {4, 8} and auto["best"] == 8
    assert set(auto["refused"]) == {16, 32} and "at most 8 nodes" in auto["refused"][16]
    with pytest.raises(ConfigError, match="at most 8 nodes, budget is 16"):
        measure.auto_budget(Pilot, curve, [[1, 2, 3]], candidates=(16, 32))
    auto = measure.auto_budget(Pilot, curve, [[1, 2, 3]], candidates=(4, 16, 32), cap=8)  # a preset's max_budget
    assert set(auto["pilot"]) == {4, 8} and auto["best"] == 8 and not auto["refused"]


def test_a_budget_sweep_builds_a_capped_chain_once_at_its_cap(monkeypatch):
    """--budget 8,16,32: a tree runs at each budget, a chain at 8 and once at its cap (named @15, not @16 and @32);
    --budget auto hands the chain's cap, and the run's sampling, to the pilots."""
    from graft_block.eval.methods import Method

    built, caps = [], {}
    monkeypatch.setattr(run_block, "make_method", lambda name, spec, target, b, **kw: (built.append((name, b)),
                                                                                      Method(name, None, b))[1])
    class Target:  # the main job hands HF's weight pages back after each build
        def release_hf_weights(self):
            return 0

    methods, skipped, _ = run_block.build_methods(["pld", "dspark_chain"], {}, Target(), [8, 16, 32], {}, [], False)
    assert not skipped and built == [("pld", 8), ("pld", 16), ("pld", 32), ("dspark_chain", 8), ("dspark_chain", 15)]
    assert [m.name for m in methods] == ["pld@8", "pld@16", "pld@32", "dspark_chain@8", "dspark_chain@15"]

    def auto_budget(build, curve, pilots, after=None, cap=None, **kw):
        caps[build(4).name] = (cap, kw)
        return {"best": 4}

    monkeypatch.setattr(measure, "auto_budget", auto_budget)
    sampling = {"temperatures": [1.0], "top_k": 0, "top_p": 0.9}
    methods, _, _ = run_block.build_methods(["pld", "dspark_chain"], {}, Target(), ["auto"], {}, [], False,
                                            sampling=sampling)
    asked = {"temperature": 1.0, "top_k": 0, "top_p": 0.9}
    assert caps == {"pld": (None, asked), "dspark_chain": (15, asked)}  # the pilots sample as the run does
    assert [m.temperatures for m in methods] == [None, None]  # one temperature: each decodes at every one


def test_budget_auto_sizes_each_temperature_of_a_run_apart(monkeypatch):
    """--temperature 0,1 --budget auto: greedy and sampled decoding accept differently, so each temperature's pilots
    size an instance of the method that decodes at that temperature only (not one budget for their mix)."""
    from graft_block.eval.methods import Method

    asked = []
    monkeypatch.setattr(run_block, "make_method", lambda name, spec, target, b, **kw: Method(name, None, b))

    def auto_budget(build, curve, pilots, after=None, cap=None, temperature=0.0, **kw):
        asked.append((build(4).name, temperature, kw))
        return {"best": 16 if temperature == 0 else 4}

    class Target:
        def release_hf_weights(self):
            return 0

    monkeypatch.setattr(measure, "auto_budget", auto_budget)
    methods, _, auto = run_block.build_methods(["pld"], {}, Target(), ["auto"], {}, [], False,
                                               sampling={"temperatures": [0.0, 1.0], "top_k": 5, "top_p": 1.0})
    assert asked == [("pld", 0.0, {"top_k": 5, "top_p": 1.0}), ("pld", 1.0, {"top_k": 5, "top_p": 1.0})]
    assert [(m.name, m.budget, m.temperatures) for m in methods] == [("pld", 16, (0.0,)), ("pld", 4, (1.0,))]
    assert {k: a["best"] for k, a in auto.items()} == {"pld (T 0)": 16, "pld (T 1)": 4}


def test_a_preset_runs_at_most_at_its_max_budget():
    """A chain preset takes the run's budget as its length up to its block (max_budget): a larger budget runs it
    at the cap, and a bad cap is refused like a bad default budget."""
    spec = presets.PRESETS["dspark_chain"]
    assert presets.budget_for(spec, 32) == 15 and presets.budget_for(spec, 4) == 4
    assert presets.budget_for(spec, None) is None and presets.budget_for(presets.PRESETS["pld"], 64) == 64
    assert presets.prepare("dspark_chain", spec, 32)["drafter"]["budget"] == 15
    assert presets.prepare("dspark_chain", spec, None)["drafter"]["budget"] == 15
    assert "max_budget" not in presets.prepare("dspark_chain", spec, 4) and \
        presets.prepare("dspark_chain", spec, 4)["drafter"]["budget"] == 4
    for bad in (0, 2.5, True, "15"):
        with pytest.raises(ConfigError, match="max_budget must be an int >= 1"):
            presets.check_spec("x", {"drafter": {"type": "pld"}, "max_budget": bad})
    with pytest.raises(ConfigError, match="default_budget 20 is above its max_budget 15"):
        presets.check_spec("x", {"drafter": {"type": "pld"}, "default_budget": 20, "max_budget": 15})


def test_budget_auto_pilots_decode_at_the_runs_temperatures():
    """A sampled run accepts less than a greedy one, so its budgets come from pilots at its own temperature (and
    filters, at T > 0 only), each sampled pilot read by its expected acceptance (its realised tau here would pick 16
    again): greedy pilots pick 16, sampled ones 4."""
    seen = []

    class Pilot:
        def __init__(self, b):
            self.b = b

        def run(self, ids, n, temperature, seed, **filters):
            seen.append((self.b, temperature, seed, filters))
            greedy = temperature == 0
            expected = (2.0 if self.b == 4 else 3.0) if greedy else (1.5 if self.b == 4 else 1.55)
            # the realised tau: noise around the expectation, which a sampled pilot must not read
            return {"tau": expected if greedy else 9.0 - 2 * expected, "tau_expected": expected, "rounds": 10,
                    "mean_tree_nodes": float(self.b), "phase_s": {}}

    curve = {"median_s": {"1": 0.010, "5": 0.010, "17": 0.013}}
    assert measure.auto_budget(Pilot, curve, [[1, 2]], candidates=(4, 16))["best"] == 16
    seen.clear()
    auto = measure.auto_budget(Pilot, curve, [[1, 2]], candidates=(4, 16), temperature=1.0, top_k=20)
    assert auto["best"] == 4 and auto["pilot_temperature"] == 1.0 and auto["pilot"][4]["tau"] == 1.5
    assert seen == [(4, 1.0, 0, {"top_k": 20, "top_p": 1.0}), (16, 1.0, 0, {"top_k": 20, "top_p": 1.0})]
    seen.clear()
    auto = measure.auto_budget(Pilot, curve, [[1, 2]], candidates=(4,), temperature=0.0, top_p=0.9)
    assert seen == [(4, 0.0, 0, {})] and auto["pilot"][4]["tau"] == 2.0  # greedy: no filters, the realised tau


def test_budget_auto_pools_the_rounds_of_every_pilot_prompt():
    """--pilot-prompts N: each candidate budget decodes every pilot prompt; tau, the verified nodes and the side time
    per round are pooled over all their rounds, so a short lucky prompt weighs its rounds, not a vote."""
    seen = []
    results = {(4, 0): {"tau": 3.0, "rounds": 5, "mean_tree_nodes": 4.0, "phase_s": {"draft": 0.05}},
               (4, 1): {"tau": 1.0, "rounds": 15, "mean_tree_nodes": 2.0, "phase_s": {"draft": 0.15}}}

    class Pilot:
        def __init__(self, b):
            self.b = b

        def run(self, ids, n, temperature, seed):
            seen.append((self.b, ids[0]))
            return results[(self.b, ids[0])]

    curve = {"median_s": {"1": 0.010, "64": 0.010}}
    auto = measure.auto_budget(Pilot, curve, [[0, 9], [1, 9]], candidates=(4,))
    assert seen == [(4, 0), (4, 1)] and auto["pilot_prompts"] == 2
    row = auto["pilot"][4]
    assert row["tau"] == pytest.approx((3.0 * 5 + 1.0 * 15) / 20)  # 1.5, where the two prompts' mean reads 2.0
    assert row["verify_nodes"] == pytest.approx(1 + (4.0 * 5 + 2.0 * 15) / 20)
    assert row["draft_ms"] == pytest.approx(1e3 * 0.20 / 20)
    with pytest.raises(ConfigError, match="at least one pilot prompt"):
        measure.auto_budget(Pilot, curve, [], candidates=(4,))


def test_a_run_of_two_temperatures_decodes_each_at_its_own_auto_budget(tiny_folder, tmp_path, monkeypatch):
    """The main job at --temperature 0,1 --budget auto: each temperature's records carry the budget its own pilots
    picked, every prompt-turn is decoded once per (method, temperature), and AR pairs with both."""
    folder, prompts = tiny_folder
    monkeypatch.setenv("GRAFT_BLOCK_CACHE", str(tmp_path / "cache"))
    rep = run_block.main(["--target", str(folder), "--methods", "ar,pld", "--prompts", str(prompts), "--limit", "1",
                          "--max-new-tokens", "8", "--budget", "auto", "--no-progress", "--no-plots",
                          "--no-physics", "--temperature", "0,1", "--out", str(tmp_path / "run")])
    auto = rep["auto_budget"]
    assert set(auto) == {"pld (T 0)", "pld (T 1)"}
    assert [auto[k]["pilot_temperature"] for k in sorted(auto)] == [0.0, 1.0]
    for t in (0.0, 1.0):
        mine = [r for r in rep["records"] if r["method"] == "pld" and r["temperature"] == t]
        ar = [r for r in rep["records"] if r["method"] == "ar" and r["temperature"] == t]
        assert mine and len(mine) == len(ar) and {r["budget"] for r in mine} == {auto[f"pld (T {t:g})"]["best"]}
    rows = {(r["method"], r["temperature"]): r for r in rep["summary"]}
    assert {("pld", 0.0), ("pld", 1.0), ("ar", 0.0), ("ar", 1.0)} <= set(rows)
    assert rows[("pld", 1.0)]["budget"] == auto["pld (T 1)"]["best"]
    assert rep["methods"]["pld (T 1)"]["drafter"]["budget"] == auto["pld (T 1)"]["best"]


def test_budget_auto_picks_from_the_measured_curve(tiny_folder, tmp_path, monkeypatch, capsys):
    """--budget auto lives in the harness: pilot tau and drafting cost per candidate budget x the verify-cost curve."""
    folder, prompts = tiny_folder
    monkeypatch.setenv("GRAFT_BLOCK_CACHE", str(tmp_path / "cache"))
    rep = run_block.main(["--target", str(folder), "--methods", "ar,pld", "--prompts", str(prompts), "--limit", "1",
                          "--max-new-tokens", "8", "--budget", "auto", "--no-progress", "--no-plots",
                          "--no-physics", "--temperature", "1", "--out", str(tmp_path / "run")])
    auto = rep["auto_budget"]["pld"]
    assert auto["pilot_prompts"] == 1  # the default: the run's first prompt
    assert auto["pilot_temperature"] == 1.0  # a sampled run's pilots sample
    assert set(auto["pilot"]) == set(measure.below_stairs(rep["verify_cost_curve"], (4, 8, 16, 32)))
    assert {4, 8, 16, 32} <= set(auto["pilot"]) and auto["best"] in auto["pilot"]
    assert {r["budget"] for r in rep["records"] if r["method"] == "pld"} == {auto["best"]}
    curve = rep["verify_cost_curve"]
    for b, row in auto["pilot"].items():  # the estimate charges each round its verify and its drafting cost
        assert row["draft_ms"] > 0 and 1 < row["verify_nodes"] <= b + 1
        want = row["tau"] * measure.cost_at(curve, 1) / (measure.cost_at(curve, row["verify_nodes"])
                                                         + row["draft_ms"] / 1e3)
        assert row["est_speedup"] == pytest.approx(want)
    assert auto["best"] == max(auto["pilot"], key=lambda b: auto["pilot"][b]["est_speedup"])
    assert "auto budget for pld" in capsys.readouterr().out


def test_jsonl_lines_split_only_at_newlines(tmp_path):
    """JSON text may hold U+2028, U+0085 or a form feed raw inside a string (json.dumps(ensure_ascii=False) writes
    them so): str.splitlines broke such a record in two and refused the file; a CRLF file still reads."""
    f = tmp_path / "mine.jsonl"
    text = "para one\u2028para two\x85three\x0cfour"
    lines = [json.dumps({"id": "a", "prompt": text}, ensure_ascii=False), json.dumps({"id": "b", "prompt": "x"})]
    f.write_bytes(("\r\n".join(lines) + "\r\n").encode("utf-8"))
    recs = read_jsonl(f)
    assert [r["id"] for r in recs] == ["mine/a", "mine/b"] and recs[0]["turns"] == [text]


def test_shared_warm_matrix_has_the_drafters_own_k_and_tokens(monkeypatch):
    """The run's shared adjacency warm-up stood in for any recycling drafter's own: at k = 8 and 64 tokens whatever
    the config said, so a k = 4 arm with a warm-up read a k = 8 matrix (ranks up to 7) and its warmup_tokens did
    nothing."""
    from graft_block.adjacency import AdjacencyMatrix
    from graft_block.eval import methods

    seen = []
    monkeypatch.setattr(AdjacencyMatrix, "warmup", lambda self, target, prompts=None, rounds=5, new_tokens=64:
                        seen.append((self.k, rounds, new_tokens)) or rounds)
    t = tiny_target("llama")
    t.tokenizer = object()  # only tested for None before the (patched) warm-up
    m = methods.make_method("rec", {"drafter": {"type": "recycling", "budget": 8, "k": 4, "warmup_tokens": 32}},
                            t, None)
    assert m.name == "rec" and seen == [(4, 5, 32)]


# ---- added by mutation testing: the interval, the per-prompt spread, the guard's windows ---------------------
def test_speedup_interval_is_paired_and_reads_the_5th_and_95th_percentiles():
    """Paired: a method at exactly half of AR's seconds on every prompt, whatever AR's rate on the prompt, has the
    interval (2, 2) (resampling method and AR apart would mix fast and slow prompts). Percentiles: with 20 pairs,
    one 10x faster, the count k of picks of the fast pair is Binomial(20, 1/20): P(k <= 2) = 0.925 and
    P(k <= 3) = 0.984, so the 95th percentile is k = 3 (a 10/90 interval would read k = 2) and the 5th is k = 0."""
    recs = []
    for i in range(8):
        recs += [_rec("ar", f"p{i}", 100, 1.0 * (i + 1)), _rec("m", f"p{i}", 100, 0.5 * (i + 1))]
    pairs = [(recs[2 * i + 1], recs[2 * i]) for i in range(8)]
    assert measure.speedup_interval(pairs) == pytest.approx((2.0, 2.0))
    pairs = [(_rec("m", f"p{i}", 100, 0.1 if i == 0 else 1.0), _rec("ar", f"p{i}", 100, 1.0)) for i in range(20)]
    lo, hi = measure.speedup_interval(pairs, level=0.9, reps=1000, seed=0)
    assert lo == pytest.approx(1.0) and hi == pytest.approx(20 / (20 - 0.9 * 3))


def test_per_prompt_iqr_is_the_inclusive_quartiles_and_the_interval_starts_at_min_n():
    recs = [_rec("ar", f"p{i}", 100, 1.0) for i in range(5)]
    recs += [_rec("m", f"p{i}", 100, 1.0 / s) for i, s in enumerate((1.0, 2.0, 3.0, 4.0, 5.0))]
    measure.pair_with(recs)
    m = next(r for r in report.summarize(recs) if r["method"] == "m")
    assert m["speedup_median"] == pytest.approx(3.0) and m["speedup_iqr"] == pytest.approx((2.0, 4.0))
    assert m["n"] == report.MIN_N and m["speedup_ci"] is not None  # n = MIN_N is enough for an interval


def test_a_method_that_ties_ar_exactly_is_neither_faster_nor_slower():
    """An interval whose lower end is exactly 1.0 does not show the method faster than AR."""
    recs = []
    for i in range(6):
        recs += [_rec("ar", f"p{i}", 100, 1.0 + 0.1 * i), _rec("same", f"p{i}", 100, 1.0 + 0.1 * i)]
    measure.pair_with(recs)
    rows = report.summarize(recs)
    assert next(r for r in rows if r["method"] == "same")["speedup_ci"] == pytest.approx((1.0, 1.0))
    note = report.spread_notes(rows)[0]
    assert "faster than AR: none" in note and "slower: none" in note and "not separable from AR: same" in note


def test_group_rows_give_each_category_its_own_total_over_total_speedup():
    recs = [_rec("ar", "p0", 100, 1.0), _rec("ar", "p1", 100, 1.0), _rec("ar", "p2", 100, 2.0),
            _rec("m", "p0", 100, 0.5), _rec("m", "p1", 100, 1.0), _rec("m", "p2", 100, 0.5)]
    for r in recs:
        r["category"] = "code" if r["prompt_id"] == "p2" else "chat"
        r["rounds"] = 50 if r["method"] == "m" else 100
    g = {(x["method"], x["group"]): x for x in report.group_rows(recs)}
    assert g[("m", "chat")]["speedup"] == pytest.approx((200 / 1.5) / (200 / 2.0)) and g[("m", "chat")]["n"] == 2
    assert g[("m", "code")]["speedup"] == pytest.approx(4.0) and g[("m", "code")]["tau"] == pytest.approx(2.0)
    assert g[("ar", "code")]["speedup"] == pytest.approx(1.0)


def test_the_window_does_not_count_our_own_cpu_as_a_competitor():
    """Busy CPU time on the machine minus our own: a process using 2 cores alone for 1 s is a quiet machine."""
    a = {"wall": 0.0, "own_cpu": 0.0, "busy": 100.0, "steal": 0.0, "runq": 0.0}
    b = {"wall": 1.0, "own_cpu": 2.0, "busy": 102.05, "steal": 0.0, "runq": 0.01}
    w = machine.window(a, b)
    assert w["others_cores"] == pytest.approx(0.05) and w["busy"] is False
    assert machine.window(a, {**b, "busy": 102.5})["busy"] is True  # half a core of someone else's
    w = machine.judge({"wall_s": 1.0, "own_cpu_s": 1.0, "others_cpu_s": 0.0, "runq_s": 0.12, "steal_s": 0.0})
    assert w["busy"] is True and len(w["reasons"]) == 1  # waiting 12% of the time for a CPU


def test_load_guard_is_busy_when_any_phase_was_busy():
    guard = machine.LoadGuard()
    quiet = machine.judge({"wall_s": 1.0, "own_cpu_s": 1.0, "others_cpu_s": 0.0, "runq_s": 0.0, "steal_s": 0.0})
    loud = machine.judge({"wall_s": 1.0, "own_cpu_s": 1.0, "others_cpu_s": 0.9, "runq_s": 0.0, "steal_s": 0.0})
    guard.before_w, guard.after_w = quiet, loud
    rep = guard.report([quiet])
    assert rep["busy"] is True and rep["reasons"] and rep["reasons"][0].startswith("after: ")
    guard.after_w = quiet
    assert guard.report([quiet])["busy"] is False


def test_cost_curve_drops_the_warm_up_round_and_takes_medians(monkeypatch):
    """Round 0 (the first call of every shape) is never in the sample, and one slow round moves a median, not
    a mean."""
    calls = {}

    def timed(target, tree):
        k = calls[tree.size] = calls.get(tree.size, 0) + 1
        return {1: 1.0, 2: 0.010, 3: 0.010, 4: 0.013}[k] * tree.size  # warm-up 1 s, then one slow round

    monkeypatch.setattr(measure, "timed_verify", timed)
    monkeypatch.setattr(machine, "judge", lambda w, e=0.0: {**w, "busy": False, "reasons": []})
    curve = measure.verify_cost_curve(tiny_target("llama"), sizes=(1, 2), context=16, reps=3, cache=False)
    assert curve["raw_median_s"] == pytest.approx({"1": 0.010, "2": 0.020})


def test_neighbours_whose_intervals_overlap_are_named():
    rows = [{"method": "ar", "temperature": 0.0, "n": 8, "speedup": 1.0, "speedup_ci": None},
            {"method": "a", "temperature": 0.0, "n": 8, "speedup": 1.8, "speedup_ci": (1.5, 2.0)},
            {"method": "b", "temperature": 0.0, "n": 8, "speedup": 1.4, "speedup_ci": (1.2, 1.6)},
            {"method": "c", "temperature": 0.0, "n": 8, "speedup": 1.1, "speedup_ci": (1.05, 1.15)}]
    note = report.spread_notes(rows)[0]
    assert "faster than AR: a, b, c" in note and "neighbours whose 90% intervals overlap: a ~ b" in note
    assert "b ~ c" not in note
    rows[3] = {**rows[3], "n": 3, "speedup_ci": None}  # the smallest n decides: one method on 3 prompt-turns
    assert "n = 3 prompt-turns per method is too small" in report.spread_notes(rows)[0]


def test_pooled_tau_and_the_budget_at_half_a_stair():
    """tau is emitted tokens over rounds pooled over the prompt-turns (not a mean of per-turn taus); below_stairs
    considers b' = b / 2 itself; --budget auto's drafting cost per round is every phase but the verify and the
    overhead."""
    recs = [_rec("ar", "p0", 10, 1.0, 10), _rec("ar", "p1", 90, 1.0, 90),
            _rec("m", "p0", 10, 1.0, 10), _rec("m", "p1", 90, 1.0, 30)]
    measure.pair_with(recs)
    assert next(r for r in report.summarize(recs) if r["method"] == "m")["tau"] == pytest.approx(100 / 40)
    curve = {"median_s": {"1": 1.0, "5": 1.0, "9": 2.0}}
    assert measure.below_stairs(curve, (8,)) == [4, 8]

    class Pilot:
        def __init__(self, b):
            pass

        def run(self, ids, n, temperature, seed):
            return {"tau": 1.5, "rounds": 10, "mean_tree_nodes": 4.0,
                    "phase_s": {"draft": 0.01, "tree": 0.005, "commit": 0.005, "verify": 0.2, "overhead": 0.05}}

    auto = measure.auto_budget(Pilot, {"median_s": {"1": 0.01, "64": 0.01}}, [[1, 2]], candidates=(4,))
    assert auto["pilot"][4]["draft_ms"] == pytest.approx(2.0)
    assert auto["pilot"][4]["est_speedup"] == pytest.approx(1.5 * 0.01 / (0.01 + 0.002))
