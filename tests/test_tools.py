"""The tools around the benchmark: the side benchmarks' entry points, the figures run_block writes, the load
guard's CPU facts and the optional Triton gather's input checks."""
import json
import math
import os

import pytest
import torch

from graft_block.errors import ConfigError
from graft_block.tree import TreeError
from graft_block.tree.templates import TR80_TEMPLATE, gather_template


@pytest.fixture
def loads(monkeypatch):
    """Every target load is recorded (its keyword arguments and the exact-quant switch then) and stopped."""
    from graft_block import skinny
    from graft_block import target as target_module

    calls = []

    class Loaded(Exception):
        pass

    def load(*a, **k):
        calls.append({**k, "exact_quant_env": os.environ.get(skinny.QUANT_ENV)})
        raise Loaded

    monkeypatch.setattr(target_module, "load_target", load)
    monkeypatch.delenv(skinny.QUANT_ENV, raising=False)  # restored after the test: the bench sets it
    return calls, Loaded


# ---- eval/bench_eagle3.py --------------------------------------------------------------------------------------
def test_eagle3_bench_loads_its_target_with_run_blocks_options(loads):
    """It loaded the target itself with only --target/--device/--dtype: --engine hf, --compile and --exact-quant were
    dropped without a word (the header said engine=lean), and HF's weights stayed beside the engine's copy."""
    from graft_block.eval import bench_eagle3

    calls, Loaded = loads
    with pytest.raises(Loaded):
        bench_eagle3.main(["--engine", "hf", "--compile", "--exact-quant", "--sample-grid", ""])
    assert len(calls) == 1
    k = calls[0]
    assert k["engine"] == "hf" and k["compile"] is True and k["release_hf"] is True and k["exact_quant_env"] == "1"


def test_eagle3_bench_lists_without_a_model_and_checks_snapshots_first(loads, capsys):
    """--list-methods loaded SmolLM2 (1.6 GB) and printed two tables; a --snapshot without MINUTES=FOLDER, or with
    MINUTES not a number, failed with a traceback (the latter after every timed run)."""
    from graft_block.eval import bench_eagle3

    calls, _ = loads
    rep = bench_eagle3.main(["--list-methods", "--grid", "8:4:4", "--sample-grid", "16:5:6",
                             "--snapshot", "6=some/folder"])
    names = {r["name"] for r in rep["methods"]}
    assert {"eagle3_tt8_d4_k4", "eagle3_tt16_d5_k6", "snapshot_6min_tt16_d5_k6"} <= names and not calls
    for bad in ("x=some/folder", "6", "6="):
        with pytest.raises(ConfigError, match="MINUTES=FOLDER"):
            bench_eagle3.main(["--snapshot", bad])
    with pytest.raises(ConfigError, match="same MINUTES"):
        bench_eagle3.main(["--snapshot", "6=a", "--snapshot", "6=b"])
    with pytest.raises(ConfigError, match="three ints"):
        bench_eagle3.main(["--grid", "8:4"])
    assert not calls


# ---- eval/bench_dflash.py --------------------------------------------------------------------------------------
def test_dflash_greedy_replay_runs_and_matches_the_decoder(tiny_llama):
    """The replay handed propose() a hand-made slice of DecodeState that lacked ``draft_nodes``: every default
    bench_dflash run (--sim on) died with an AttributeError after its timed part. Its tau is the decoder's."""
    from graft_block.decoder import SpeculativeDecoder
    from graft_block.drafters import dflash as D
    from graft_block.eval import bench_dflash

    torch.set_num_threads(1)
    model = D.new_model(tiny_llama, 1, 8, [1], 127)
    prompt = [5, 9, 2, 7, 11, 3, 8, 1]
    cfg = {"proposal": "ddtree", "budget": 6}
    res = SpeculativeDecoder(tiny_llama, D.DFlashDrafter(tiny_llama, model, **cfg)).generate(prompt,
                                                                                             max_new_tokens=40)
    sim = bench_dflash.greedy_tau_simulation(tiny_llama, model, prompt, res.tokens, {"dd": cfg})
    assert res.stats.tau > 1 and sim["dd"] == pytest.approx(res.stats.tau)  # a round accepted a draft token


def test_dflash_replay_without_greedy_ar_output_is_a_note(tiny_llama, tmp_path, capsys):
    """A run at --temperature 1 only has no greedy AR output to replay: statistics.mean of nothing crashed it."""
    from graft_block.drafters import dflash as D
    from graft_block.eval import bench_dflash

    D.save_checkpoint(D.new_model(tiny_llama, 1, 8, [1], 127), tmp_path / "ck", dtype=torch.float32,
                      extra={"type": "dflash"})
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "turns": [[1, 2, 3]]}) + "\n")
    rep = {"args": {"prompts": str(tmp_path / "p.jsonl")}, "suite": "quick", "limit": 0,
           "records": [{"method": "ar", "temperature": 1.0, "turn": 0, "prompt_id": "p/a", "set": "p",
                        "tokens": [4, 5, 6]}]}
    assert bench_dflash.simulate(rep, tiny_llama, str(tmp_path / "ck"), ["chain"]) == {}
    assert "no greedy AR output" in capsys.readouterr().err


def test_dflash_bench_checks_its_names_before_the_timed_run(monkeypatch):
    """An unknown --sim config was a KeyError after the whole timed run; an unknown --arm a bare SystemExit."""
    from graft_block.eval import bench_dflash, run_block

    def ran(*a, **k):
        raise AssertionError("the timed run started before --sim was checked")

    monkeypatch.setattr(run_block, "run_arms", ran)
    with pytest.raises(ConfigError, match="--sim 'chain,dd128': unknown config.*dd128"):
        bench_dflash.main(["--sim", "chain,dd128"])
    with pytest.raises(ConfigError, match="unknown arm 'dd7'"):
        bench_dflash.main(["--arms", "dd7"])


# ---- eval/plots.py ---------------------------------------------------------------------------------------------
def _row(method, temperature=0.0, budget=8, **kw):
    return {"method": method, "temperature": temperature, "budget": budget, "tau": 2.0, "speedup": 1.2,
            "accept_hist": {}, "suffix_decay": [], "chimeric_share": None, **kw}


def test_plots_show_each_rows_own_data(tmp_path, monkeypatch):
    """A speedup with no AR pair was drawn as 0; an acceptance count no round had was bridged by the line between
    its neighbours; the chimeric bars of one method at two temperatures shared one label and stacked on one bar."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from graft_block.eval.plots import plots

    figs = {}
    monkeypatch.setattr(plt, "close", lambda fig: figs.setdefault(len(figs), fig))
    rows = [_row("m@8", budget=8, speedup=None), _row("m@16", budget=16, speedup=1.3),
            _row("h", accept_hist={0: 5, 3: 5}),
            _row("c", 0.0, chimeric_share=0.1), _row("c", 1.0, chimeric_share=0.3)]
    files = plots(tmp_path, rows)
    assert files == ["budget_sweep.png", "accept_hist.png", "chimeric.png"]
    sweep, hist, chim = (figs[i] for i in range(3))
    speed = next(line for line in sweep.axes[1].lines if line.get_label() == "m T=0").get_ydata()
    assert math.isnan(speed[0]) and speed[1] == pytest.approx(1.3)
    line = hist.axes[0].lines[0]
    assert list(line.get_xdata()) == [0, 1, 2, 3] and list(line.get_ydata()) == [0.5, 0.0, 0.0, 0.5]
    bars = chim.axes[0].patches
    assert len({b.get_x() for b in bars}) == 2 and sorted(b.get_height() for b in bars) == [0.1, 0.3]


# ---- eval/machine.py -------------------------------------------------------------------------------------------
def test_load_guard_reads_the_cpus_this_process_may_use(tmp_path, monkeypatch):
    """Pinned to cpu0 (taskset, a cpuset), a job on cpu1 does not compete; the whole-machine line counted it, so
    such a run was always BUSY and its cost curve never cached. environment() says how many CPUs the run had."""
    from graft_block.eval import machine

    stat = tmp_path / "stat"
    stat.write_text("cpu  1000 0 0 5000 0 0 0 40 0 0\ncpu0 100 0 0 2500 0 0 0 10 0 0\n"
                    "cpu1 900 0 0 2500 0 0 0 30 0 0\nintr 1 2 3\n")
    monkeypatch.setattr(machine, "PROC_STAT", str(stat), raising=False)
    tick = machine._TICK
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert machine._proc_stat() == (pytest.approx(1000 / tick), pytest.approx(40 / tick))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert machine._proc_stat() == (pytest.approx(100 / tick), pytest.approx(10 / tick))
    assert machine.environment()["usable_cpus"] == 1


# ---- graft_block/kernels.py ------------------------------------------------------------------------------------
def test_fused_gather_checks_its_input_before_the_launch(monkeypatch):
    """A root token outside the table sent the kernel reading outside it (a segfault under the interpreter, an
    illegal access or garbage rows on a GPU) where the torch path names the problem; a rows function (which
    gather_template takes) crashed use_triton with an AttributeError."""
    from graft_block import kernels

    if not kernels.HAVE_TRITON:
        pytest.skip("triton not installed (optional extra)")
    launched = []

    class Launch:
        def __getitem__(self, grid):
            return lambda *a, **k: launched.append(grid)

    monkeypatch.setattr(kernels, "_template_gather_kernel", Launch())
    table = torch.randint(0, 50, (50, 8))
    for root in (50, 1050, -3):
        with pytest.raises(TreeError, match="no row in the adjacency matrix"):
            kernels.gather_template_fused(root, TR80_TEMPLATE, table, force=True)
    with pytest.raises(TreeError, match=r"must be \[vocab, k\]"):
        kernels.gather_template_fused(3, TR80_TEMPLATE, table.view(-1), force=True)
    assert not launched
    rows = lambda toks: table[toks]  # noqa: E731
    tree = kernels.expand(3, TR80_TEMPLATE, rows, budget=20)
    assert torch.equal(tree.tokens, kernels.expand(3, TR80_TEMPLATE, table, budget=20).tokens)
    assert torch.equal(gather_template(3, TR80_TEMPLATE, rows), gather_template(3, TR80_TEMPLATE, table))
