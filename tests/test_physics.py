"""The physics report on a tiny target: every field, sane numbers, the FLOP count, the engine label in the cache key,
the standalone command's and run_block's arguments."""
import json
import math

import pytest

from graft_block.errors import ConfigError
from graft_block.eval import cli, measure, physics, run_block
from graft_block.testing import tiny_target

TINY = dict(sizes=(1, 2, 4), reps=1, copy_mb=8, peak_n=128, context=16, verify_reps=1, probe_s=0.05)


# tiny_target("llama"): hidden 64, intermediate 128, 4 heads of 16, 2 kv heads, 4 layers, vocab 128, untied head
TINY_PARAMS = 4 * (64 * 64 + 2 * (64 * 32) + 64 * 64 + 3 * (64 * 128)) + 64 * 128  # every nn.Linear, float32


@pytest.fixture(scope="module")
def phys(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRAFT_BLOCK_CACHE", str(tmp_path_factory.mktemp("cache")))
        return physics.measure_physics(tiny_target("llama", gemm="openblas"), **TINY)


def check_consistent(p: dict) -> None:
    """Relations between the report's fields that hold whatever the timings (speed is benchmarks' business)."""
    lin, rows = p["linear"], {r["n"]: r for r in p["rows"]}
    assert lin["count"] == 4 * 7 + 1 and lin["params"] == TINY_PARAMS and lin["bytes"] == 4 * TINY_PARAMS
    assert lin["streamed_bytes"] == lin["bytes"]  # no packs on OpenBLAS: a forward reads the weights as stored
    # units: ms x GB/s = 1e6 bytes; GFLOP/s x ms = 1e3 GFLOP
    assert lin["mem_floor_ms"] * p["bandwidth_gbs"] * 1e6 == pytest.approx(lin["streamed_bytes"])
    assert lin["mem_floor_ms"] == pytest.approx(rows[1]["mem_floor_ms"])  # a decode step's floor
    for n, r in rows.items():
        assert r["gflop"] == pytest.approx(2 * n * TINY_PARAMS / 1e9)
        assert r["gflops"] * r["linear_ms"] == pytest.approx(1e3 * r["gflop"])
        assert r["pct_peak"] == pytest.approx(100 * r["gflops"] / p["peak_gflops"])
        assert r["mem_floor_ms"] * p["bandwidth_gbs"] * 1e6 == pytest.approx(lin["streamed_bytes"])
        assert r["floor_ms"] == pytest.approx(max(r["mem_floor_ms"], 1e3 * r["gflop"] / p["peak_gflops"]))
        assert r["verify_ratio"] == pytest.approx(r["verify_ms"] / rows[1]["verify_ms"])
        assert r["linear_share"] == pytest.approx(r["linear_ms"] / r["verify_ms"])
    one = rows[1]  # non-GEMM shares: from the interleaved timing of each engine
    assert p["non_gemm_share"] == pytest.approx((one["paired_ms"] - one["linear_ms"]) / one["paired_ms"])
    assert p["eager_non_gemm_share"] == pytest.approx((one["eager_ms"] - one["linear_ms"]) / one["eager_ms"])


def test_report_has_every_field_and_sane_numbers(phys):
    for k in ("target", "device", "device_name", "dtype", "threads", "engine", "bandwidth_gbs", "peak_gflops",
              "linear", "rows", "non_gemm_share", "verify_source", "busy", "load", "wall_s"):
        assert k in phys, k
    for v in (phys["bandwidth_gbs"], phys["peak_gflops"], phys["linear"]["mem_floor_ms"]):
        assert math.isfinite(v) and v > 0
    assert [r["n"] for r in phys["rows"]] == [1, 2, 4]
    for r in phys["rows"]:
        for k in ("linear_ms", "gflop", "gflops", "pct_peak", "floor_ms", "verify_ms", "verify_ratio", "linear_share"):
            assert r[k] is not None and math.isfinite(r[k]) and r[k] > 0, (r["n"], k)
    assert phys["rows"][0]["verify_ratio"] == pytest.approx(1.0) and math.isfinite(phys["non_gemm_share"])
    text = physics.format_report(phys)
    for s in ("memory copy bandwidth", "matrix-product peak", "memory-bound floor", "non-GEMM share",
              "| rows | linear ms (openblas)", "lean-openblas-float32", "- products: openblas",
              "interleaved: lean-openblas-float32 ms | hf-sdpa-float32 ms | engine gain"):
        assert s in text, s
    # an automatic kernel choice prints what it measured, so the report says which kernel won where
    times = {"mkl": {1: 50.0, 8: 70.0}, "mkl_packed": {8: 94.0}, "openblas": {1: 26.0, 8: 51.0}}
    chosen = physics.format_report({**phys, "gemm_times": times})
    assert "- products: openblas, chosen by measuring the weights a forward streams (first layers up to 4x the " \
           "last-level cache, >= 128 MB, + the LM head) at rows 1/8 (ms): mkl 50.0/70.0; mkl_packed -/94.0; " \
           "openblas 26.0/51.0" in chosen
    assert "- decoder layers: C" not in chosen  # OpenBLAS runs the torch layers
    assert "- decoder layers: C (graft_block/skinny.py" in physics.format_report({**phys, "layers": "C"})
    tile = physics.format_report({**phys, "skinny_tile": "avx2 (2 x 8-float vectors, 6-row tiles)"})
    assert "- skinny tile on this CPU: avx2 (2 x 8-float vectors, 6-row tiles)" in tile
    # the lean engine is compared with HF's eager forward in the same run, row by row (how fast each is: benchmarks)
    for r in phys["rows"]:
        for k in ("eager_ms", "paired_ms", "engine_gain"):
            assert math.isfinite(r[k]) and r[k] > 0, (r["n"], k)
    check_consistent(phys)
    assert len([ln for ln in text.splitlines() if ln.startswith("| ")]) == 1 + 3  # header + one row per size
    json.dumps(phys)  # goes into results.json as is


def test_report_figures_from_fixed_timings(monkeypatch):
    """Every derived figure from timings fixed by hand (a memory-bound and a compute-bound row, and the 17.8x engine
    gain a loaded machine once gave): exact values, so a wrong formula or unit fails here whatever the load."""
    monkeypatch.setattr(physics, "copy_bandwidth", lambda dev, mb: 15.0)  # GB/s
    monkeypatch.setattr(physics, "matmul_peak", lambda *a, **k: 10.0)  # GFLOP/s
    monkeypatch.setattr(physics, "linear_sweep", lambda *a, **k: {1: 0.002, 2: 0.003})  # s
    eager = {"a_s": {1: 0.0045, 2: 0.0065}, "b_s": {1: 0.08, 2: 0.1}, "gain": {1: 17.8, 2: 15.0}}
    monkeypatch.setattr(physics, "paired_verify", lambda *a, **k: eager)
    curve = {"median_s": {"1": 0.004, "2": 0.006}, "source": "given"}
    p = physics.measure_physics(tiny_target("llama", gemm="openblas"), curve=curve, **{**TINY, "sizes": None})
    check_consistent(p)
    nbytes, flops = 4 * TINY_PARAMS, 2 * TINY_PARAMS  # per one-row forward
    assert (p["bandwidth_gbs"], p["peak_gflops"]) == (15.0, 10.0) and [r["n"] for r in p["rows"]] == [1, 2]
    r1, r2 = p["rows"]
    assert r1["mem_floor_ms"] == r2["mem_floor_ms"] == pytest.approx(1e3 * nbytes / 15e9)
    assert r1["floor_ms"] == pytest.approx(1e3 * nbytes / 15e9)  # 41.5 us of bytes > 31.1 us of FLOPs
    assert r2["floor_ms"] == pytest.approx(1e3 * 2 * flops / 10e9)  # 62.3 us of FLOPs > 41.5 us of bytes
    assert (r1["linear_ms"], r2["linear_ms"]) == pytest.approx((2.0, 3.0))
    assert (r1["gflops"], r2["gflops"]) == pytest.approx((flops / 0.002 / 1e9, 2 * flops / 0.003 / 1e9))
    assert r1["pct_peak"] == pytest.approx(100 * flops / 0.002 / 1e9 / 10.0)
    assert (r1["verify_ms"], r2["verify_ms"], r2["verify_ratio"]) == pytest.approx((4.0, 6.0, 1.5))
    assert (r1["linear_share"], r2["linear_share"]) == pytest.approx((0.5, 0.5))
    assert (r1["paired_ms"], r1["eager_ms"], r1["engine_gain"]) == pytest.approx((4.5, 80.0, 17.8))
    assert p["non_gemm_share"] == pytest.approx(2.5 / 4.5) and p["eager_non_gemm_share"] == pytest.approx(78 / 80)
    text = physics.format_report(p)
    assert "| 1 | 2.00 | 0.00 | 0.2 | 2% | 0.04 | 4.00 | 1.00 | 50% | 4.50 | 80.0 | 17.80x |" in text
    assert "non-GEMM share of a decode step: 56% (verify(1) 4.50 ms, linear layers alone 2.00 ms); 98% on " \
           "hf-sdpa-float32 (80.0 ms)" in text


def test_linear_flops_match_a_hand_count():
    t = tiny_target("llama")  # hidden 64, intermediate 128, 4 heads of 16, 2 kv heads, 4 layers, vocab 128
    per_layer = 64 * 64 + 2 * (64 * 32) + 64 * 64 + 3 * (64 * 128)  # q, k+v, o, gate+up+down
    total = 4 * per_layer + 64 * 128  # + the LM head
    w = physics.linear_weights(t.model)
    assert len(w) == 4 * 7 + 1
    assert physics.linear_flops(w, 1) == 2 * total and physics.linear_flops(w, 16) == 2 * 16 * total
    t.model.lm_head.weight = t.model.model.embed_tokens.weight  # tied: the embedding is no nn.Linear
    t.model.model.layers[1].self_attn.q_proj = t.model.model.layers[0].self_attn.q_proj  # one module used twice
    assert len(physics.linear_weights(t.model)) == 4 * 7  # counted once


def test_engine_label_keys_the_cost_cache():
    t = tiny_target("llama", gemm="mkl")
    assert measure.engine_label(t) == "lean-mkl-float32"  # Llama family runs the lean forward by default
    hf = tiny_target("llama", engine="hf")
    assert measure.cost_key(hf, (1, 2), 32, 2)["engine_path"] == "hf-sdpa-float32"
    eager = tiny_target("llama", attn_implementation="eager", engine="hf")
    assert measure.cost_key(eager, (1, 2), 32, 2)["engine_path"] == "hf-eager-float32"
    # each engine's curves are cached apart, and the lean forward's own source is part of the key
    assert measure.cost_key(t, (1, 2), 32, 2)["engine"] != measure.cost_key(hf, (1, 2), 32, 2)["engine"]
    blas = tiny_target("llama", gemm="openblas")  # so is its product kernel
    assert measure.cost_key(blas, (1, 2), 32, 2)["engine_path"] == "lean-openblas-float32"

    class Custom:  # an adapter on another path names it itself
        engine_label = "compiled-cpp-gemm"
    assert measure.engine_label(Custom()) == "compiled-cpp-gemm"


def test_busy_machine_is_loud(phys, monkeypatch):
    busy = {**phys, "busy": True, "load": {**phys["load"], "busy": True, "reasons": ["during: other processes"]}}
    assert "!!! BUSY MACHINE" in physics.format_report(busy)
    curve = {"median_s": {"1": 0.01}, "busy": True, "load": {"reasons": ["hogs"]}, "source": "measured now"}
    out = physics.measure_physics(tiny_target("llama"), curve=curve, **{**TINY, "sizes": (1,)})
    assert out["busy"] is True and "verify curve: hogs" in out["load"]["reasons"]


def test_standalone_command_arguments(tmp_path, monkeypatch, capsys):
    a = physics.parse_args(["--target", "x", "--device", "cpu", "--dtype", "float32", "--threads", "1",
                            "--sizes", "1,8", "--fresh-cost", "--json", "o.json"])
    assert (a.target, a.threads, a.fresh_cost, a.json) == ("x", 1, True, "o.json")
    assert physics.sizes_of(a.sizes) == [1, 8] and physics.parse_args([]).sizes == "1,2,4,8,16,32,64"
    with pytest.raises(ConfigError, match="--sizes"):
        physics.sizes_of("1,0")
    assert "physics" in cli.COMMANDS and "physics" in cli.usage()
    assert cli.main(["physics", "--sizes", "a,b"]) == 2  # a one-line error before any model loads
    assert "--sizes takes" in capsys.readouterr().err
    assert cli.main(["physics", "--reps", "0"]) == 2  # was a StatisticsError from an empty median
    assert "--reps must be >= 1" in capsys.readouterr().err
    monkeypatch.setenv("GRAFT_BLOCK_CACHE", str(tmp_path / "cache"))
    real, small = physics.measure_physics, {k: v for k, v in TINY.items() if k not in ("sizes", "reps")}
    monkeypatch.setattr(physics, "measure_physics", lambda t, s, **kw: real(t, s, **kw, **small))
    out = physics.main(["--sizes", "1,2", "--reps", "1", "--no-cost-cache", "--json", str(tmp_path / "p.json")],
                       target=tiny_target("llama", gemm="mkl"))
    assert json.loads((tmp_path / "p.json").read_text())["engine"] == out["engine"] == "lean-mkl-float32"
    assert out["eager_engine"] == "hf-sdpa-float32"
    assert "## physics: target=tiny-llama" in capsys.readouterr().out


def test_run_block_accepts_no_physics():
    assert run_block.parse_args(["--no-physics"]).no_physics is True
    assert run_block.parse_args([]).no_physics is False


def test_run_block_prints_physics_and_reuses_its_verify_curve(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "tiny"
    tiny_target("llama").model.save_pretrained(folder)
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "p0", "turns": [[1, 2, 3, 4, 5, 6] * 2]}) + "\n")
    monkeypatch.setenv("GRAFT_BLOCK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("GRAFT_BLOCK_GEMM", "mkl")  # pinned: the automatic choice depends on the machine
    calls, real_curve, real_phys = [], measure.verify_cost_curve, physics.measure_physics
    monkeypatch.setattr(measure, "verify_cost_curve",
                        lambda *a, **k: calls.append(measure.engine_label(a[0])) or real_curve(*a, **k))
    monkeypatch.setattr(physics, "measure_physics", lambda t, **kw: real_phys(t, **kw, copy_mb=8, peak_n=128))
    rep = run_block.main(["--target", str(folder), "--methods", "ar", "--prompts", str(tmp_path / "p.jsonl"),
                          "--limit", "1", "--max-new-tokens", "4", "--threads", "1", "--no-progress", "--no-plots",
                          "--out", str(tmp_path / "run")])
    text = capsys.readouterr().out
    # the physics report reused run_block's verify curve (HF's eager forward is timed beside it, interleaved)
    assert calls == ["lean-mkl-float32"]
    assert text.index("| method |") < text.index("## physics") and "non-GEMM share" in text
    data = json.loads((tmp_path / "run" / "results.json").read_text())
    assert data["physics"]["engine"] == "lean-mkl-float32" == rep["verify_cost_curve"]["key"]["engine_path"]
    assert [r["n"] for r in data["physics"]["rows"]] == [1, 2, 4, 8, 16, 32, 64]


# ---- the kernel A/B (eval/bench_skinny.py) ------------------------------------------------------------------
def test_kernel_ab_reports_times_and_catches_a_kernel_that_moves_bits(tmp_path, monkeypatch):
    from graft_block import skinny
    from graft_block.eval import bench_skinny

    if not skinny.available():
        pytest.skip(f"the C kernel does not run here: {skinny.why_not()}")
    monkeypatch.setenv("GRAFT_BLOCK_CACHE", str(tmp_path))
    shapes, rows = [(40, 32), (70, 48)], [1, 3, 9]
    same = bench_skinny.ab({"ref": skinny.SOURCE, "copy": skinny.SOURCE + "\n/* a comment */\n"}, shapes, rows, 1)
    assert [r["rows"] for r in same] == rows and all(r["same_bits"] for r in same)
    assert all(t > 0 for r in same for t in r["ms"].values())
    # one multiply-add reordered: the same law, other bits, and the A/B must say so
    product = "a[g][v] += w[v] * xg;"
    assert product in skinny.SOURCE
    moved = skinny.SOURCE.replace(product, "a[g][v] = w[v] * xg + a[g][v] * 1.0000001f;")
    assert not any(r["same_bits"] for r in bench_skinny.ab({"ref": skinny.SOURCE, "moved": moved}, shapes, rows, 1))
    assert "| 9 |" in bench_skinny.format_rows("fp32", same)
    with pytest.raises(ConfigError, match="--against"):
        bench_skinny.source_at("no-such-revision")
    # the packing A/B (--exact-quant): float32 packs against exact quantised ones of the same weights, same bits,
    # whatever the engine's switch says (the A/B asks for the quantised packs itself)
    if skinny._lib.quant_weights():
        monkeypatch.setenv(skinny.QUANT_ENV, "0")
        packing = bench_skinny.ab_packing([(40, 64), (70, 96)], rows, 1)
        assert all(r["same_bits"] and list(r["ms"]) == ["float32", "exact q4_1/q8_0"] for r in packing)


def test_the_floor_counts_the_bytes_the_engine_streams(phys, monkeypatch):
    """The memory-bound floor divides the bytes a forward reads: the engine's skinny packs, so a target whose
    float32 weights stream as exact Q4_1 / Q8_0 packs (GRAFT_BLOCK_EXACT_QUANT=1) gets a floor ~6x lower, and the
    report names the packing; without packs it is the weights as stored."""
    from graft_block import skinny
    from graft_block.target import Target
    from graft_block.testing import gguf_like

    if not (skinny.available() and skinny._lib.quant_weights()):
        pytest.skip("no skinny kernel with quantised loads here")
    t = tiny_target("llama", engine="hf")
    gguf_like(t.model)
    weights = physics.linear_weights(t.model)
    stored = sum(w.numel() * 4 for w, _ in weights)
    assert physics.streamed_bytes(None, weights) is None
    monkeypatch.setenv(skinny.QUANT_ENV, "1")
    quant = Target(t.model, None, engine="lean", gemm="skinny")
    monkeypatch.setenv(skinny.QUANT_ENV, "0")
    full = Target(t.model, None, engine="lean", gemm="skinny")
    assert stored <= physics.streamed_bytes(full.lean, weights) <= 1.05 * stored
    assert physics.streamed_bytes(quant.lean, weights) < stored / 4
    lin = {**phys["linear"], "packing": quant.lean.exact_quant,
           "streamed_bytes": physics.streamed_bytes(quant.lean, weights)}
    assert "streamed as q4_1/q8_0 packs" in physics.format_report({**phys, "linear": lin})
    assert "streamed as" not in physics.format_report(phys)


def test_the_floor_of_each_row_count_counts_its_own_kernels_bytes(monkeypatch, tmp_path):
    """With skinny for few-row forwards only (mkl+skinny) or for all but one-row ones (skinny+mkl), a forward on
    the other kernel reads the weights as stored, not the exact Q4_1 / Q8_0 packs: each row's memory floor counts
    its own kernel's bytes (the packs' were the floor of every row, ~6x too low on MKL's rows)."""
    from graft_block import skinny
    from graft_block.target import Target
    from graft_block.testing import gguf_like

    if not (skinny.available() and skinny._lib.quant_weights()):
        pytest.skip("no skinny kernel with quantised loads here")
    monkeypatch.setenv("GRAFT_BLOCK_CACHE", str(tmp_path))
    t = tiny_target("llama", engine="hf")
    gguf_like(t.model)
    weights = physics.linear_weights(t.model)
    stored = sum(w.numel() * 4 for w, _ in weights)
    monkeypatch.setenv(skinny.QUANT_ENV, "1")
    few = Target(t.model, None, engine="lean", gemm="mkl+skinny")
    most = Target(t.model, None, engine="lean", gemm="skinny+mkl")
    packs = physics.streamed_bytes(few.lean, weights)
    assert packs < stored / 4
    assert physics.streamed_bytes(few.lean, weights, 17) == packs
    assert physics.streamed_bytes(few.lean, weights, 18) is None
    assert physics.streamed_bytes(most.lean, weights, 1) is None
    assert physics.streamed_bytes(most.lean, weights, 2) == packs
    out = physics.measure_physics(few, **{**TINY, "sizes": (1, 32), "compare": False})
    bw = out["bandwidth_gbs"] * 1e9
    assert [r["mem_floor_ms"] for r in out["rows"]] == pytest.approx([1e3 * packs / bw, 1e3 * stored / bw])
    assert out["linear"]["mem_floor_ms"] == pytest.approx(1e3 * packs / bw)  # a decode step's
