"""The suffix-decay curve (conditional acceptance per draft depth from the summed acceptance histograms) and the
schedule summary (kept nodes, expected vs realised tokens per round)."""
import copy

import pytest

from graft_block.eval import measure, report


def test_suffix_decay_by_hand():
    hist = {0: 10, 1: 6, 2: 4}  # 20 rounds: 10 accepted >= 1 node, 4 accepted >= 2
    decay, reach = report.suffix_decay(hist)
    assert decay == [pytest.approx(10 / 20), pytest.approx(4 / 10)] and reach is None
    # trees 3 deep in 15 rounds and 2 deep in 5: depth 3 was reachable but never accepted
    decay, reach = report.suffix_decay({"0": 10, "1": 6, "2": 4}, {3: 15, 2: 5})
    assert decay == [pytest.approx(0.5), pytest.approx(0.4), 0.0] and reach == [20, 20, 15]
    # trees deeper than any acceptance path got: no round accepted depth 3, so depth 4 is unknown
    assert report.suffix_decay({0: 2, 2: 2}, {4: 4})[0] == [0.5, 1.0, 0.0, None]
    assert report.suffix_decay({0: 7}, {0: 7}) == ([], [])  # root-only trees (AR): no draft depth
    assert report.suffix_decay({}) == ([], None)


def _rec(method, hist, depth=None, pid="p0"):
    r = {"method": method, "temperature": 0.0, "prompt_id": pid, "turn": 0, "decode_tokens": 10,
         "decode_s": 1.0, "rounds": sum(hist.values()), "accept_hist": {str(k): v for k, v in hist.items()}}
    if depth is not None:
        r["depth_hist"] = {str(k): v for k, v in depth.items()}
    return r


def test_summary_rows_carry_suffix_decay_and_the_table():
    records = [_rec("ar", {0: 10}, {0: 10}), _rec("ar", {0: 10}, {0: 10}, "p1"),
               _rec("tree", {0: 4, 1: 3, 3: 1}, {3: 8}), _rec("tree", {0: 2, 2: 2}, {3: 4}, "p1"),
               _rec("old", {0: 1, 1: 1}, None), _rec("old", {1: 2}, {2: 2}, "p1")]
    rows = {r["method"]: r for r in report.summarize(records)}
    # tree: summed {0: 6, 1: 3, 2: 2, 3: 1} over 12 rounds -> >= 1: 6, >= 2: 3, >= 3: 1
    assert rows["tree"]["suffix_decay"] == [pytest.approx(0.5), pytest.approx(0.5), pytest.approx(1 / 3)]
    assert rows["tree"]["suffix_reach"] == [12, 12, 12]
    assert rows["ar"]["suffix_decay"] == [] and rows["ar"]["suffix_reach"] == []
    # one record without a depth histogram: the reach is unknown, the decay runs to the deepest acceptance
    assert rows["old"]["suffix_reach"] is None and rows["old"]["suffix_decay"] == [pytest.approx(3 / 4)]
    table = report.suffix_decay_table(list(rows.values()))
    lines = table.splitlines()
    assert lines[0].startswith("| method | T | 1 | 2 |") and lines[0].endswith("| 8 |")
    assert "| tree | 0 | 0.50 | 0.50 | 0.33 | - | - | - | - | - |" in lines
    assert not any(line.startswith("| ar |") for line in lines)  # no drafted rounds, no line
    assert report.suffix_decay_table([rows["ar"]]) is None


def test_schedule_summary_weights_records_by_rounds():
    a, b = _rec("sched", {0: 6, 1: 4}), _rec("sched", {0: 10, 2: 20}, pid="p1")
    a.update(tau=1.4, dropped=2, schedule={"rounds": 10, "mean_nodes_in": 4.0, "mean_nodes_kept": 2.0,
                                           "mean_expected_tokens": 1.6, "mean_expected_raw": 1.6,
                                           "mean_realised_tokens": 1.6, "survival_source": {"drafter": 10}})
    a_schedule = copy.deepcopy(a["schedule"])
    b.update(tau=2.0, schedule={"rounds": 30, "mean_nodes_in": 8.0, "mean_nodes_kept": 6.0,
                                "mean_expected_tokens": 2.2, "mean_expected_raw": 2.4,
                                "mean_realised_tokens": 2.0, "survival_source": {"drafter": 28, "scores": 2}})
    rows = {r["method"]: r for r in report.summarize([_rec("ar", {0: 10}), _rec("ar", {0: 10}, pid="p1"), a, b])}
    assert a["schedule"] == a_schedule  # the caller's records are read, not changed
    s = rows["sched"]["schedule"]
    assert s["rounds"] == 40 and s["nodes_in"] == pytest.approx(7.0) and s["nodes_kept"] == pytest.approx(5.0)
    # realised: the schedule's own count before the stop trim (a's tau 1.4 is after it), weighted like expected
    assert s["expected_tokens"] == pytest.approx(2.05) and s["realised_tokens"] == pytest.approx(1.9)
    assert s["expected_raw"] == pytest.approx((1.6 * 10 + 2.4 * 30) / 40)
    assert s["survival_source"] == {"drafter": 38, "scores": 2} and rows["ar"]["schedule"] is None
    table = report.schedule_table(list(rows.values())).splitlines()
    assert table[2] == "| sched | 0 | - | 7.00 | 5.00 | 2.20 | 2.05 | 1.90 | drafter 38, scores 2 |" and len(table) == 3
    assert report.schedule_table([rows["ar"]]) is None
    # a record from before the schedule counted it: emitted plus trimmed tokens a round, not the emitted tau
    old = _rec("old", {0: 2, 1: 2})
    old.update(tau=2.5, dropped=2, schedule={k: v for k, v in a["schedule"].items() if k != "mean_realised_tokens"})
    old["schedule"]["rounds"] = 4
    assert report.schedule_summary([old])["realised_tokens"] == pytest.approx((10 + 2) / 4)


def test_suffix_decay_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from graft_block.eval.plots import plots

    rows = report.summarize([_rec("ar", {0: 3}, {0: 3}), _rec("tree", {0: 1, 2: 2}, {2: 3})])
    assert "suffix_decay.png" in plots(tmp_path, rows) and (tmp_path / "suffix_decay.png").stat().st_size
    (tmp_path / "none").mkdir()
    assert "suffix_decay.png" not in plots(tmp_path / "none", [r for r in rows if r["method"] == "ar"])


def test_paper_verdicts_judge_a_budget_sweep_at_equal_budgets():
    """In a --budget sweep rows are named method@budget: each claim is judged at every budget both ran."""
    rows = [{"method": "mfd@16", "temperature": 0.0, "speedup": 0.6, "tau": 1.8},
            {"method": "mfd_k1_ddtree@16", "temperature": 0.0, "speedup": 0.7, "tau": 1.7},
            {"method": "mfd@64", "temperature": 0.0, "speedup": 0.3, "tau": 1.9},
            {"method": "mfd_k1_ddtree@64", "temperature": 0.0, "speedup": 0.2, "tau": 2.0},
            {"method": "mfd@32", "temperature": 0.0, "speedup": 0.5, "tau": 1.8},  # no control at 32
            {"method": "dflash_ddtree@64", "temperature": 0.0, "chimeric_share": 0.3},
            {"method": "dspark_chain", "temperature": 0.0, "tau": 1.3},
            {"method": "dflash_chain", "temperature": 0.0, "tau": 1.0}]
    v = {x["claim"]: x for x in report.paper_verdicts(rows)}
    fast16, fast64 = (v[f"MFD faster than DDTree at equal budget (budget {b})"] for b in (16, 64))
    assert fast16["here"] == pytest.approx(0.6 / 0.7) and fast16["holds"] is False
    assert fast64["here"] == pytest.approx(1.5) and fast64["holds"] is True
    assert v["MFD accepts more than DDTree at equal budget (budget 32)"]["here"] is None  # never against another budget
    assert v["DDTree chimeric share at 64 nodes in 27-33%"]["holds"] is True  # the sweep's 64-node row stands in
    assert v["DSpark chain accepts >= 16% more than DFlash chain"]["here"] == pytest.approx(1.3)
    assert v["Graft faster than EAGLE3 dense"]["here"] is None


def test_a_tie_is_not_a_win_unless_the_claim_is_inclusive():
    """Heads that tie their control (ratio 1.003) do not "beat" it; Graft's MAT >= pruning's holds at a tie."""
    rows = [{"method": "dspark_ddtree", "temperature": 0.0, "tau": 1.625},
            {"method": "dflash_ddtree", "temperature": 0.0, "tau": 1.62},
            {"method": "eagle3_graft", "temperature": 0.0, "tau": 1.6, "speedup": 1.05},
            {"method": "eagle3_prune", "temperature": 0.0, "tau": 1.6, "speedup": 1.0},
            {"method": "eagle3_fixed", "temperature": 0.0, "speedup": 1.07}]
    v = {x["claim"]: x for x in report.paper_verdicts(rows)}
    heads = v["Markov + confidence heads beat the same recipe without them"]
    assert heads["holds"] is False and heads["close"] is True
    assert v["Graft MAT >= pruning-only MAT"]["holds"] is True  # inclusive: a tie is the claim
    assert v["Graft faster than pruning only"]["holds"] is True  # 5% clears the band
    assert v["Graft faster than fixed-ratio retrieval"]["close"] is True  # 0.98: too close either way
    table = report.verdict_table(list(v.values()))
    assert "| Markov + confidence heads beat the same recipe without them | 2-layer DSpark > 5-layer DFlash | 1.00 | " \
           "too close to call (within 2% of the bar) |" in table


def _chimeric_rec(method, pid, share, rounds):
    return {"method": method, "prompt_id": pid, "turn": 0, "temperature": 0.0, "budget": 64, "tokens": [1],
            "decode_tokens": 2 * rounds, "decode_s": 1.0, "rounds": rounds,
            "chimeric": {"draft": {"rounds": rounds, "n": 64 * rounds, "chimeric": share}},
            "chimeric_share": share}


def test_chimeric_share_is_pooled_over_rounds_like_tau():
    """Two short turns without chimeric nodes and one long turn full of them: the row's share of chimeric nodes
    per round is over all 120 rounds (as tau is), not the median turn's."""
    recs = [_chimeric_rec("ar", f"p{i}", None, 10) for i in range(3)]
    recs += [_chimeric_rec("tree", "p0", 0.0, 10), _chimeric_rec("tree", "p1", 0.0, 10),
             _chimeric_rec("tree", "p2", 1.0, 100)]
    for r in recs[:3]:
        del r["chimeric"], r["chimeric_share"]
    measure.pair_with(recs)
    rows = {r["method"]: r for r in report.summarize(recs)}
    assert rows["tree"]["chimeric_share"] == pytest.approx(100 / 120)
    assert rows["ar"]["chimeric_share"] is None


def test_tau_pools_rounds_and_the_turn_mean_averages_each_turns_own():
    """A turn of 10 tokens in 5 rounds (tau 2) and one of 40 in 10 (tau 4): the row's tau pools them, 50 / 15,
    while ``tau_turn_mean`` is DFlash's per-response average, 3."""
    recs = [_chimeric_rec("ar", f"p{i}", None, 10) for i in range(2)]
    recs += [{**_chimeric_rec("tree", "p0", 0.0, 5), "decode_tokens": 10},
             {**_chimeric_rec("tree", "p1", 0.0, 10), "decode_tokens": 40}]
    measure.pair_with(recs)
    rows = {r["method"]: r for r in report.summarize(recs)}
    assert rows["tree"]["tau"] == pytest.approx(50 / 15) and rows["tree"]["tau_turn_mean"] == pytest.approx(3.0)
    assert rows["tree"]["tau_expected"] is None  # records without it (older runs, peers): unknown, not 0
    recs[2]["tau_expected"], recs[3]["tau_expected"] = 1.5, 3.0  # the expected acceptance pools rounds too
    rows = {r["method"]: r for r in report.summarize(recs)}
    assert rows["tree"]["tau_expected"] == pytest.approx((1.5 * 5 + 3.0 * 10) / 15)


def test_hf_generate_differing_from_our_ar_is_a_note_not_the_lossless_alarm():
    """HF generate's greedy tokens against our AR's differ only by the engines' arithmetic: named in the note, while
    one of our methods differing from AR still raises the alarm."""
    recs = []
    for m, toks, extra in (("ar", [1, 2], {}), ("hf", [1, 3], {"hf_peer": True}), ("tree", [1, 3], {})):
        recs.append({"method": m, "prompt_id": "p", "turn": 0, "temperature": 0.0, "budget": None, "tokens": toks,
                     "decode_tokens": 2, "decode_s": 1.0, "rounds": 2, **extra})
    measure.pair_with(recs)
    rows = report.summarize(recs)
    alarm, note = report.lossless_alarm(rows)
    assert "tree" in alarm and "hf" not in alarm
    assert "hf: differs from our AR (HF's arithmetic) on p#0" in note
    assert "HF's arithmetic" in report._lossless(next(r for r in rows if r["method"] == "hf"))
    # in half precision a verify row's rounding depends on its batch: our mismatch is a note there, the alarm in fp32
    alarm, note = report.lossless_alarm(rows, "bfloat16")
    assert alarm is None and "tree: differs from AR in bfloat16 (batch-variant kernels) on p#0" in note
    assert "tree" in report.lossless_alarm(rows, "float32")[0]


def test_verdict_bars_the_close_band_on_both_sides_and_a_range_includes_its_ends():
    """Within 2% of the bar on either side is too close to call; 2% or more above holds, below does not; a range
    claim ("27-33%") holds at its ends, and a ratio claim divides the method's metric by the baseline's."""
    def verdict(graft_speedup, share=0.3):
        rows = [{"method": "eagle3_graft", "temperature": 0.0, "speedup": graft_speedup},
                {"method": "eagle3", "temperature": 0.0, "speedup": 2.0},
                {"method": "dflash_ddtree64", "temperature": 0.0, "chimeric_share": share}]
        v = {x["claim"]: x for x in report.paper_verdicts(rows)}
        return v["Graft faster than EAGLE3 dense"], v["DDTree chimeric share at 64 nodes in 27-33%"]

    above, _ = verdict(2.03)  # 1.015: within 2% above
    below, _ = verdict(1.97)  # 0.985: within 2% below
    assert above["close"] is True and above["holds"] is False and above["here"] == pytest.approx(1.015)
    assert below["close"] is True and below["holds"] is False
    clear, _ = verdict(2.1)
    assert clear["close"] is False and clear["holds"] is True and clear["here"] == pytest.approx(1.05)
    short, _ = verdict(1.9)
    assert short["close"] is False and short["holds"] is False
    for share in (0.27, 0.33):
        assert verdict(2.1, share)[1]["holds"] is True and verdict(2.1, share)[1]["here"] == share
    assert verdict(2.1, 0.34)[1]["holds"] is False


def test_time_split_and_overhead_share_are_over_all_phases():
    recs = [_rec("ar", {0: 10}), _rec("tree", {0: 4, 1: 6})]
    recs[1]["phase_s"] = {"draft": 0.2, "tree": 0.1, "verify": 0.5, "commit": 0.1, "overhead": 0.1}
    rows = {r["method"]: r for r in report.summarize(recs)}
    split = rows["tree"]["time_split"]
    assert split == pytest.approx({"draft": 0.2, "tree": 0.1, "verify": 0.5, "commit": 0.1, "overhead": 0.1})
    assert rows["tree"]["overhead_share"] == pytest.approx(0.1)


def test_the_lossless_check_is_at_t0_only_and_needs_a_baseline_to_fail():
    """At T > 0 a method's tokens differ from AR's by design: no mismatch, no alarm. A record without an AR
    partner is not a mismatch either."""
    recs = []
    for temp in (0.0, 0.7):
        for m, toks in (("ar", [1, 2]), ("tree", [1, 2] if temp == 0 else [1, 3])):
            recs.append({"method": m, "prompt_id": "p", "turn": 0, "temperature": temp, "budget": None,
                         "tokens": toks, "decode_tokens": 2, "decode_s": 1.0, "rounds": 2})
    recs.append({**recs[1], "prompt_id": "alone"})
    measure.pair_with(recs)
    assert "matches_ar" not in recs[3] and recs[1]["matches_ar"] is True
    rows = report.summarize(recs)
    assert all(r["mismatches"] == [] for r in rows)
    assert report.lossless_alarm(rows) == (None, None)


def test_speedup_vs_hf_generate_is_the_method_over_the_peer():
    recs = []
    for m, secs in (("ar", 1.0), ("hf", 2.0), ("tree", 0.5)):
        recs.append({"method": m, "prompt_id": "p", "turn": 0, "temperature": 0.0, "budget": None, "tokens": [1],
                     "decode_tokens": 100, "decode_s": secs, "rounds": 50, **({"hf_peer": True} if m == "hf" else {})})
    measure.pair_with(recs)
    rows = {r["method"]: r for r in report.summarize(recs)}
    assert rows["tree"]["speedup_vs_hf"] == pytest.approx(4.0) and rows["tree"]["speedup"] == pytest.approx(2.0)
    assert rows["ar"]["speedup_vs_hf"] == pytest.approx(2.0)
