"""The suffix-decay curve: conditional acceptance per draft depth from the summed acceptance histograms."""
import pytest

from graft_block.eval import report


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


def test_suffix_decay_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from graft_block.eval.plots import plots

    rows = report.summarize([_rec("ar", {0: 3}, {0: 3}), _rec("tree", {0: 1, 2: 2}, {2: 3})])
    assert "suffix_decay.png" in plots(tmp_path, rows) and (tmp_path / "suffix_decay.png").stat().st_size
    (tmp_path / "none").mkdir()
    assert "suffix_decay.png" not in plots(tmp_path / "none", [r for r in rows if r["method"] == "ar"])
