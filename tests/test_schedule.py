"""Confidence-scheduled verification: the scheduler (prefix-closed, best and first-drop stops, min_nodes, cost
curve), the calibration of confidences (offline, and online from earlier rounds), the decoder/harness wiring, and
the exact law of decoding with a schedule (with a peeking schedule as the negative control the test must
reject)."""
import math
import re
from collections import Counter

import pytest
import torch

from graft_block import ConfigError, Drafter, SpeculativeDecoder
from graft_block.eval import measure
from graft_block.eval.methods import make_method
from graft_block.sampling import SamplingConfig, choose
from graft_block.schedule import ConfidenceSchedule
from graft_block.testing import chi_square_test, exact_sequence_probs, hf_greedy, null_tv_quantile, tiny_target
from graft_block.tree import SOURCE_DRAFT, SOURCE_RETRIEVED, SOURCE_ROOT, chain, make_tree, merge, walk
from graft_block.tree.schedule import (apply_temperatures, calibrate_temperatures, calibration_keys,
                                       conditional_survival, convex_cost_curve, curve_cost, expected_calibration_error,
                                       path_survival, prefix_ece, rescaled_survival, schedule_tree,
                                       survival_from_scores)


def _random_tree(gen, n):
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    return make_tree(list(range(n)), parents)  # distinct tokens: no duplicate siblings


def _closed(tree_parents, kept):
    kept = set(kept)
    return all(i == 0 or tree_parents[i] in kept for i in kept)


# ---- the scheduler ------------------------------------------------------------------------------------------
def test_kept_set_is_prefix_closed_and_the_top_by_path_survival(one_thread):
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        n = int(torch.randint(2, 30, (1,), generator=gen))
        tree = _random_tree(gen, n)
        surv = torch.rand(n, generator=gen, dtype=torch.float64)  # children often above their parent
        out, info = schedule_tree(tree, surv, lambda m: 1.0 + 0.05 * m)
        kept = sorted(out.tokens.tolist())  # token i == node i
        assert kept[0] == 0 and out.size == info["kept"] + 1 <= tree.size
        assert _closed(tree.parents.tolist(), kept), kept
        eff = path_survival(tree, surv)
        cut = [i for i in range(1, n) if i not in kept]
        if cut and len(kept) > 1:  # every kept node is at least as likely as every dropped one
            assert min(eff[kept[1:]]) >= max(eff[cut])


def test_child_above_its_parent_waits_for_the_parent():
    tree = make_tree([0, 1, 2, 3], [-1, 0, 1, 0])
    # raw survival: node 2 (under node 1) looks best, but it cannot outrank its parent 1
    out, _ = schedule_tree(tree, torch.tensor([1.0, 0.3, 0.9, 0.5]), lambda m: 1.0 + 0.45 * (m - 1))
    assert out.tokens.tolist() == [0, 3]  # node 3 (0.5) first; node 1 (0.3) no longer pays for itself
    assert path_survival(tree, torch.tensor([1.0, 0.3, 0.9, 0.5])).tolist() == pytest.approx([1.0, 0.3, 0.3, 0.5])


def test_first_drop_stops_at_a_stair_and_best_climbs_it():
    # cost: 1 for 1-2 positions, 2 from 3 on (a stair); five nodes of survival 0.9 in a chain
    curve = {"median_s": {"1": 1.0, "2": 1.0, "3": 2.0, "10": 2.0}}
    tree = chain(0, [1, 2, 3, 4, 5])
    surv = torch.tensor([1.0, 0.9, 0.9, 0.9, 0.9, 0.9])
    # objectives for k kept nodes: 1.0, 1.9, 1.4 (drop), 1.85, 2.3, 2.75: the global best keeps all 5
    objective = [(1 + 0.9 * k) / curve_cost(curve, 1 + k) for k in range(6)]
    assert objective[2] < objective[1] < objective[4] and max(objective) == objective[5]
    out, info = schedule_tree(tree, surv, curve, stop="first_drop")
    assert out.size == 2 and info["kept"] == 1
    assert info["objective"] == pytest.approx(1.9) and info["expected_tokens"] == pytest.approx(1.9)
    out, info = schedule_tree(tree, surv, curve)  # stop="best"
    assert out.size == 6 and info["objective"] == pytest.approx(2.75) and info["expected_tokens"] == pytest.approx(5.5)
    # a stair the survivals do not pay for: best stops below it, at the first stair's end (ties: fewer nodes)
    low = torch.tensor([1.0, 0.9, 0.1, 0.1, 0.1, 0.1])  # 1.9 / 1 at k = 1 beats (1.9 + 0.1 j) / 2 for every j
    assert schedule_tree(tree, low, curve)[1]["kept"] == 1
    assert schedule_tree(tree, low, curve, min_nodes=3)[1]["kept"] == 5  # past the floor, best still climbs
    with pytest.raises(ValueError, match="stop must be"):
        schedule_tree(tree, surv, curve, stop="first")


def test_threshold_stop_keeps_the_nodes_whose_conditional_acceptance_reaches_it():
    """DeepSpec's decoder cut: on a chain, every position up to the first whose estimated acceptance given the one
    before falls below the threshold (whatever the cost and the later positions); on a tree, the nodes whose
    conditional and every ancestor's reach it; ``min_nodes`` adds the likeliest others; a bad threshold is refused."""
    cost = lambda m: 1.0  # noqa: E731 (free nodes: "best" would keep all)
    line = chain(0, [1, 2, 3, 4])
    path = torch.tensor([1.0, 0.9, 0.72, 0.144, 0.13])  # conditionals 0.9, 0.8, 0.2, 0.9
    out, info = schedule_tree(line, path, cost, stop="threshold", threshold=0.5)
    assert out.tokens.tolist() == [0, 1, 2] and info["kept"] == 2
    assert info["expected_tokens"] == pytest.approx(1 + 0.9 + 0.72)
    assert schedule_tree(line, path, cost, stop="threshold", threshold=0.19)[0].size == 5
    assert schedule_tree(line, path, cost, stop="threshold", threshold=0.95)[0].size == 1
    assert schedule_tree(line, path, cost, stop="threshold", threshold=0.95, min_nodes=1)[0].tokens.tolist() == [0, 1]
    assert schedule_tree(line, path, cost)[0].size == 5
    # root with children a (0.6) and b (0.3); a's child c (conditional 0.5), b's child d (conditional 1.0)
    tree = make_tree([0, 1, 2, 3, 4], [-1, 0, 0, 1, 2])
    out, _ = schedule_tree(tree, torch.tensor([1.0, 0.6, 0.3, 0.3, 0.3]), cost, stop="threshold", threshold=0.4)
    assert out.tokens.tolist() == [0, 1, 3]  # d's own conditional is 1, but b's falls short
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="threshold must be a probability"):
            schedule_tree(line, path, cost, stop="threshold", threshold=bad)
        with pytest.raises(ConfigError, match="threshold must be a probability"):
            ConfidenceSchedule(cost, stop="threshold", threshold=bad)
    sched = ConfidenceSchedule({"median_s": {"1": 1.0, "8": 1.0}}, stop="threshold", threshold=0.5, adapt=0)
    assert sched.apply(chain(0, [1, 2, 3, 4], scores=torch.log(path[1:]))).size == 3  # the same cut in the decoder


def test_a_measured_curve_is_read_raw_for_best_and_through_its_envelope_for_first_drop():
    """The same stair handed to the decoder's schedule as a measured curve: "best" reads it as measured and keeps
    the whole chain; "first_drop" reads its convex envelope, on which the first drop is the global best."""
    curve = {"median_s": {"1": 1.0, "2": 1.0, "3": 2.0, "10": 2.0}}
    assert convex_cost_curve(curve)["median_s"] == pytest.approx({"1": 1.0, "2": 1.0, "3": 1.125, "10": 2.0})
    tree = chain(0, [1, 2, 3, 4, 5], scores=torch.log(torch.full((5,), 0.9)).cumsum(0))  # survival 0.9^depth
    assert schedule_tree(tree, survival_from_scores(tree), curve, stop="first_drop")[0].size == 2  # the raw stair
    assert ConfidenceSchedule(curve, stop="first_drop").apply(tree).size == 6  # on the envelope every node pays
    assert ConfidenceSchedule(curve).apply(tree).size == 6
    # on a staircase that the envelope would smooth, "best" cuts at a stair's end: nodes 2-3 here cost nothing extra
    stairs = {"median_s": {"1": 1.0, "2": 1.0, "3": 1.0, "4": 1.5, "5": 1.5, "6": 2.0}}
    weak = chain(0, [1, 2, 3, 4], scores=torch.log(torch.tensor([0.5, 0.2, 0.1, 0.05])).cumsum(0))
    kept = ConfidenceSchedule(stairs).apply(weak)
    assert kept.size == 3  # 1 + 0.5 + 0.1 = 1.6 at cost 1 beats (1.6 + 0.01 + 0.0005) / 1.5
    with pytest.raises(ConfigError, match="stop must be"):
        ConfidenceSchedule(stairs, stop="never")
    # a 12-04 sample: the envelope never lies above a median, and its per-node slope never falls
    sizes = [1, 2, 3, 4, 6, 8, 16]
    noisy = {"median_s": dict(zip(map(str, sizes), [17.4, 17.4, 19.2, 20.4, 22.1, 22.1, 31.1]))}
    env = [convex_cost_curve(noisy)["median_s"][str(n)] for n in sizes]
    assert all(e <= noisy["median_s"][str(n)] + 1e-12 for e, n in zip(env, sizes))
    slopes = [(b - a) / (m - n) for a, b, n, m in zip(env, env[1:], sizes, sizes[1:])]
    assert all(s2 >= s1 - 1e-12 for s1, s2 in zip(slopes, slopes[1:])), slopes
    assert env[0] == 17.4 and env[-1] == 31.1  # the ends are measured points


def test_any_mapping_curve_gets_the_envelope_and_odd_digit_keys_are_refused():
    """A curve that was a Mapping but not a dict (a read-only view) skipped first_drop's convex envelope and stopped
    at the raw stair; a key like "²" passed str.isdigit() and int() raised a bare ValueError naming nothing."""
    from types import MappingProxyType

    curve = MappingProxyType({"median_s": MappingProxyType({"1": 1.0, "2": 1.0, "3": 2.0, "10": 2.0})})
    tree = chain(0, [1, 2, 3, 4, 5], scores=torch.log(torch.full((5,), 0.9)).cumsum(0))
    assert ConfidenceSchedule(curve, stop="first_drop").apply(tree).size == 6  # as for the same dict curve
    for key in ("²", "+-5"):
        with pytest.raises(ConfigError, match=f"verify-cost curve entry {re.escape(repr(key))}.*integers >= 1"):
            ConfidenceSchedule({"median_s": {"1": 1.0, key: 2.0}})
    assert curve_cost({"median_s": {" +2 ": 1.0, 4: 2.0}}, 3) == pytest.approx(1.5)  # signed, spaced keys still read


def test_min_nodes_is_kept_and_never_more_than_the_tree():
    tree = chain(0, [1, 2, 3, 4])
    surv = torch.tensor([1.0, 0.5, 0.4, 0.3, 0.2])
    steep = lambda m: float(m) ** 3  # noqa: E731 - every node costs more than it brings
    assert schedule_tree(tree, surv, steep)[0].size == 1
    out, info = schedule_tree(tree, surv, steep, min_nodes=3)
    assert out.tokens.tolist() == [0, 1, 2, 3] and info["kept"] == 3
    assert schedule_tree(tree, surv, steep, min_nodes=10)[0].size == tree.size
    with pytest.raises(ValueError, match="min_nodes"):
        schedule_tree(tree, surv, steep, min_nodes=-1)


def test_flat_cost_keeps_every_node_with_positive_survival():
    tree = make_tree([0, 1, 2, 3, 4, 5, 6], [-1, 0, 0, 1, 1, 2, 3])
    surv = torch.tensor([1.0, 0.6, 0.0, 0.2, 0.01, 0.0, 1e-4])  # node 5 sits under a zero-survival parent
    out, info = schedule_tree(tree, surv, lambda m: 0.01)
    assert sorted(out.tokens.tolist()) == [0, 1, 3, 4, 6]
    assert info["expected_tokens"] == pytest.approx(1 + 0.6 + 0.2 + 0.01 + 1e-4)
    # survival 1 everywhere and a flat cost: the whole tree
    assert schedule_tree(tree, torch.ones(7), lambda m: 0.01)[0].size == 7


def test_curve_interpolation_is_cost_at():
    curve = {"median_s": {"16": 0.03, "1": 0.010, "2": 0.012, "4": 0.013, "8": 0.020}}
    expect = {1: 0.010, 2: 0.012, 3: 0.0125, 4: 0.013, 6: 0.0165, 8: 0.020, 12: 0.025, 16: 0.03, 32: 0.05, 0: 0.010}
    for n, want in expect.items():
        assert curve_cost(curve, n) == pytest.approx(want)
        assert measure.cost_at(curve, n) == pytest.approx(want)
    assert curve_cost({"median_s": {"4": 0.5}}, 9) == 0.5  # one measured size: flat
    with pytest.raises(ValueError, match="median_s"):
        curve_cost({}, 3)


def test_score_survival_is_path_probability():
    tree = make_tree([0, 1, 2, 3], [-1, 0, 1, 0], scores=[0.0, -0.5, -1.5, 0.2])
    s = survival_from_scores(tree)
    assert s[:3].tolist() == pytest.approx([1.0, 0.60653066, 0.22313016])
    assert float(s[3]) == 1.0  # a positive score (not a log-prob) is clamped


def test_sibling_conditionals_never_sum_past_one():
    """Only one child of a node can be the target's token: estimates that sum past 1 (a head rating each child
    alone, or retrieved children beside drafted ones) are scaled down together; sums below 1 stay."""
    tree = make_tree([0, 1, 2, 3, 4], [-1, 0, 0, 1, 1])
    cond = conditional_survival(tree, [1.0, 0.8, 0.6, 0.4, 0.2])
    assert cond == pytest.approx([1.0, 0.8 / 1.4, 0.6 / 1.4, 0.5, 0.25])
    sched = ConfidenceSchedule(lambda m: 1.0, adapt=0)  # flat cost: keeps all, expected = sum of survivals
    sched.apply(tree, None, _Head(torch.tensor([1.0, 0.8, 0.6, 0.4, 0.2])))
    assert sched.stats["expected_tokens"] == pytest.approx(1 + 1.0 + 0.8 / 1.4 * 0.75)


def test_recalibrated_siblings_never_sum_past_one():
    """The online factors scale a parent's top child and its other children apart, so two factors above 1 pushed
    siblings past 1 again: a root with two children expected 2.32 tokens a round, where at most 2 can come."""
    from graft_block.decoder import Verified

    D = SOURCE_DRAFT
    tree = make_tree([0, 1, 2], [-1, 0, 0])
    keys = calibration_keys(tree, [1.0, 0.6, 0.4])
    surv = rescaled_survival(tree, [1.0, 0.6, 0.4], {(1, True, D): 1.5, (1, False, D): 1.5}, keys)
    assert surv.tolist() == pytest.approx([1.0, 0.6, 0.4])  # 0.9 and 0.6 scaled down together
    sched = ConfidenceSchedule(lambda m: 1.0, adapt=1.0)  # flat cost: keeps all, expected = sum of survivals
    state = type("S", (), {"round": 0})()
    for r, (pa, pb, took) in enumerate([(0.3, 0.2, 1), (0.3, 0.2, 2)]):  # the top child, then the other, accepted
        state.round = r
        out = sched.apply(make_tree([0, 1, 2], [-1, 0, 0], scores=[0.0, math.log(pa), math.log(pb)]), state)
        sched.observe(Verified(out, None, None, torch.tensor([0, took]), 7, None))
    assert all(f > 1 for f in sched.factors().values())
    state.round, before = 2, sched.stats["expected_tokens"]
    sched.apply(make_tree([0, 1, 2], [-1, 0, 0], scores=[0.0, math.log(0.6), math.log(0.4)]), state)
    assert sched.stats["expected_tokens"] - before == pytest.approx(2.0)


def test_a_retrieved_subtree_continues_its_attach_nodes_path_score():
    """A graft's retrieved subtree (its template's prior, counted from its own root) merged under a draft node
    continues that node's path score, so its survival is the draft node's times exp(prior), never the prior's
    ratio to a draft log-prob (which read a retrieved child of a weak draft node as certain); the recalibration
    counts retrieved nodes apart."""
    # root -> draft a (0.5) -> draft b (0.25 path); retrieved r1 (prior -0.3) -> r2 (-0.9 cumulative) under b
    draft = make_tree([0, 1, 2], [-1, 0, 1], scores=[0.0, math.log(0.5), math.log(0.25)])
    retrieved = make_tree([2, 3, 4], [-1, 0, 1], scores=[0.0, -0.3, -0.9], sources=SOURCE_RETRIEVED)
    tree = merge(draft, retrieved, attach=2)
    assert tree.sources.tolist() == [SOURCE_ROOT, SOURCE_DRAFT, SOURCE_DRAFT, SOURCE_RETRIEVED, SOURCE_RETRIEVED]
    s = survival_from_scores(tree).tolist()
    assert s == pytest.approx([1.0, 0.5, 0.25, 0.25 * math.exp(-0.3), 0.25 * math.exp(-0.9)])
    keys = calibration_keys(tree, conditional_survival(tree, s))
    assert [k[2] for k in keys] == tree.sources.tolist()
    assert keys[3] == (3, True, SOURCE_RETRIEVED)


# ---- calibration --------------------------------------------------------------------------------------------
def _synthetic(temps, n=20000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = len(temps)
    logits = 1.0 + 2.5 * torch.randn(n, k, generator=gen, dtype=torch.float64)
    p_true = torch.sigmoid(logits / torch.tensor(temps, dtype=torch.float64))
    accepted = torch.rand(n, k, generator=gen, dtype=torch.float64) < p_true
    reached = torch.ones(n, k, dtype=torch.bool)
    reached[:, 1:] = torch.cumprod(accepted.long(), 1)[:, :-1].bool()
    return logits, accepted, reached


def test_calibration_recovers_known_temperatures_and_lowers_ece(one_thread):
    true = [0.5, 1.0, 2.0, 3.0]
    logits, accepted, valid = _synthetic(true)
    assert int(valid[:, -1].sum()) > 1000  # enough rows reach the last position
    temps = calibrate_temperatures(logits, accepted, valid)
    assert temps.shape == (4,)
    for fit, want in zip(temps.tolist(), true):
        assert abs(fit - want) / want < 0.1, (temps, true)
    before = expected_calibration_error(torch.sigmoid(logits), accepted, valid=valid)
    after = expected_calibration_error(apply_temperatures(logits, temps), accepted, valid=valid)
    assert after < 0.01 and after < before / 3, (before, after)
    p_before = prefix_ece(torch.sigmoid(logits), accepted)
    p_after = prefix_ece(apply_temperatures(logits, temps), accepted)
    assert p_after < p_before, (p_before, p_after)


def test_calibration_without_rows_is_one_and_ece_by_hand(one_thread):
    logits = torch.zeros(3, 2)
    valid = torch.tensor([[True, False]] * 3)
    temps = calibrate_temperatures(logits, torch.ones(3, 2, dtype=torch.bool), valid)
    assert temps[1] == temps[0] != 1.0  # no rows at position 1: the previous position's temperature carries on
    assert calibrate_temperatures(logits, torch.ones(3, 2, dtype=torch.bool), ~valid)[0] == 1.0  # none at the first
    few = calibrate_temperatures(logits, torch.ones(3, 2, dtype=torch.bool), torch.ones(3, 2, dtype=torch.bool),
                                 min_rows=4)
    assert few.tolist() == [1.0, 1.0]  # 3 rows < min_rows: no fit anywhere
    # bins 10: probabilities 0.05, 0.05 (outcomes 1, 0) -> gap 0.1 - 1 over two entries; 0.95 (outcome 1) -> -0.05
    ece = expected_calibration_error(torch.tensor([0.05, 0.05, 0.95]), torch.tensor([1.0, 0.0, 1.0]), bins=10)
    assert ece == pytest.approx((abs(0.1 - 1.0) + 0.05) / 3)
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        calibrate_temperatures(torch.zeros(3), torch.zeros(3), torch.zeros(3))


# ---- the decoder's schedule object --------------------------------------------------------------------------
class _Head:
    def __init__(self, values):
        self.values = values

    def node_survival(self, tree):
        return self.values


def test_confidence_schedule_prefers_the_drafter_head_and_counts():
    tree = make_tree([0, 1, 2], [-1, 0, 0], scores=[0.0, -5.0, -0.01])  # scores favour node 2
    sched = ConfidenceSchedule(lambda m: 1.0 + 0.3 * (m - 1))
    assert sched.apply(tree, None, _Head(torch.tensor([1.0, 0.9, 0.05]))).tokens.tolist() == [0, 1]
    assert sched.apply(tree, None, _Head(None)).tokens.tolist() == [0, 2]  # head declines: scores
    assert sched.apply(tree, None).tokens.tolist() == [0, 2]
    by_scores = ConfidenceSchedule(lambda m: 1.0 + 0.3 * (m - 1), survival="scores")  # the head is not asked
    assert by_scores.apply(tree, None, _Head(torch.tensor([1.0, 0.9, 0.05]))).tokens.tolist() == [0, 2]
    assert by_scores.summary()["survival_source"] == {"scores": 1}
    with pytest.raises(ConfigError, match="survival must be 'drafter'"):
        ConfidenceSchedule(lambda m: 1.0, survival="head")
    s = sched.summary()
    assert s["rounds"] == 3 and s["mean_nodes_in"] == 2 and s["mean_nodes_kept"] == 1
    assert s["survival_source"] == {"drafter": 1, "scores": 2}
    sched.reset_stats()
    assert sched.summary()["rounds"] == 0
    with pytest.raises(ConfigError, match="one probability per node"):
        sched.apply(tree, None, _Head(torch.ones(5)))
    with pytest.raises(ConfigError, match="median_s"):
        ConfidenceSchedule({"nodes": 1})
    with pytest.raises(ConfigError, match="min_nodes"):
        ConfidenceSchedule(lambda m: 1.0, min_nodes=-2)


def test_online_recalibration_counts_tested_nodes_and_rescales_later_rounds():
    from graft_block.decoder import Verified

    # root -> a (0.8) -> c (0.5 of a); root -> b (0.1): conditionals 0.8, 0.1, 0.5
    tree = make_tree([0, 1, 2, 3], [-1, 0, 0, 1], scores=torch.log(torch.tensor([1.0, 0.8, 0.1, 0.4])).tolist())
    sched = ConfidenceSchedule(lambda m: 1.0, adapt=2.0)  # a flat cost keeps every node
    state = type("S", (), {"round": 0})()
    D = SOURCE_DRAFT
    out = sched.apply(tree, state)
    assert out is tree and sched.factors() == {}
    # the target took a, then not c: depth 1 tested a and b (predicted 0.9, 1 accepted), depth 2 tested c (0.5, 0)
    sched.observe(Verified(out, None, None, torch.tensor([0, 1]), 7, None))
    # counted apart: a parent's likeliest child (a, c) and the others (b)
    assert sched._counts == {(1, True, D): [pytest.approx(0.8), 1.0], (1, False, D): [pytest.approx(0.1), 0.0],
                             (2, True, D): [pytest.approx(0.5), 0.0]}
    f = sched.factors()
    assert f == {(1, True, D): pytest.approx(3 / 2.8), (1, False, D): pytest.approx(2 / 2.1),
                 (2, True, D): pytest.approx(0.8)}
    state.round = 1  # the next round of the same call reads them: a -> min(1, 0.8 * 1.07), c -> 0.5 * 0.8
    sched.apply(tree, state)
    a = min(1.0, 0.8 * 3 / 2.8)
    assert sched.stats["expected_tokens"] - 2.3 == pytest.approx(1 + a + 0.1 * 2 / 2.1 + a * 0.4)
    assert sched.stats["expected_raw"] == pytest.approx(2 * 2.3)
    sched.observe(Verified(make_tree([0], [-1]), None, None, torch.tensor([0]), 7, None))  # not its tree: ignored
    assert sched._counts[(1, True, D)] == [pytest.approx(0.8), 1.0]
    state.round = 0  # a new generate call starts from the prior again
    sched.apply(tree, state)
    assert sched._counts == {} and sched.factors() == {}
    assert ConfidenceSchedule(lambda m: 1.0, adapt=0).factors() == {}
    with pytest.raises(ConfigError, match="adapt must be a number >= 0"):
        ConfidenceSchedule(lambda m: 1.0, adapt=-1)


def test_the_next_draft_is_sized_from_the_recent_cuts():
    """The schedule asks the next draft for SIZE_MARGIN more nodes than the most of its last SIZE_WINDOW cuts kept;
    a new generate call starts unsized; size_draft=False never asks."""
    sched = ConfidenceSchedule(lambda m: 1.0)  # a flat cost keeps every node
    state = type("S", (), {"round": 0, "draft_nodes": None})()
    deep = chain(0, torch.tensor([1, 2, 3]), torch.log(torch.tensor([0.9, 0.8, 0.7])))
    short = chain(0, torch.tensor([1]), torch.log(torch.tensor([0.9])))
    sched.apply(deep, state)
    assert state.draft_nodes == 5
    for r in range(1, ConfidenceSchedule.SIZE_WINDOW):
        state.round = r
        sched.apply(short, state)
        assert state.draft_nodes == 5  # the 3-node cut is still in the window
    state.round += 1
    sched.apply(short, state)
    assert state.draft_nodes == 3
    assert sched.summary()["mean_draft_nodes"] == pytest.approx((5 * 16 + 3) / 17)
    state.round = 0  # a new call: only its own cuts count
    sched.apply(short, state)
    assert state.draft_nodes == 3 and len(sched._cuts) == 1
    off = ConfidenceSchedule(lambda m: 1.0, size_draft=False)
    state = type("S", (), {"round": 0, "draft_nodes": None})()
    off.apply(deep, state)
    assert state.draft_nodes is None and off.summary()["mean_draft_nodes"] is None
    with pytest.raises(ConfigError, match="size_draft must be true or false"):
        ConfidenceSchedule(lambda m: 1.0, size_draft="yes")


def test_the_cost_curve_is_refitted_to_the_calls_verify_times():
    from graft_block.decoder import PhaseTimer, Verified

    curve = {"median_s": {"1": 0.010, "17": 0.026}}  # timed in a fast spell: 10 ms + 1 ms a position
    sched = ConfidenceSchedule(curve)
    timer = PhaseTimer()
    state = type("S", (), {"round": 0, "timer": timer})()
    slow = lambda n: 0.015 + 0.0005 * (n - 1)  # noqa: E731 - what the rounds take now
    for r, size in enumerate([2, 9, 2, 9, 5, 9, 2, 9]):
        state.round = r
        tree = chain(0, list(range(1, size)))  # survival 1 everywhere: every node pays, the whole chain is kept
        out = sched.apply(tree, state)
        assert out.size == size
        timer.totals["verify"] += slow(size)
        sched.observe(Verified(out, None, None, torch.tensor([0]), 7, None), state)
    fitted = sched.fitted_cost(9)
    for n in (1, 5, 9, 17):  # 8 rounds against two pseudo-rounds on the curve: close to the rounds' own times
        assert fitted(n) == pytest.approx(slow(n), rel=0.12), n
    a, b = sched.summary()["last_cost_fit"]
    assert 0.3 < b < 0.7 and a > 0
    state.round = 0  # a new call starts from the curve
    sched.apply(chain(0, [1]), state)
    assert sched.fitted_cost(9) is sched.cost
    assert ConfidenceSchedule(curve, fit_cost=False).fitted_cost(9) is not None
    with pytest.raises(ConfigError, match="fit_cost must be true or false"):
        ConfidenceSchedule(curve, fit_cost=1)


def test_round_overhead_is_the_mean_of_each_phase_over_the_rounds_it_has_timed(monkeypatch):
    """At the schedule's call the decoder has timed this round's draft but not its tree or commit, so the
    overhead divides the drafts by one round more than the rest: with every draft 1 s and nothing else timed, each
    round (the first included) reads 1 s, not 2 s at the second round."""
    import types

    import graft_block.decoder as decoder

    clock = [0.0]
    monkeypatch.setattr(decoder, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    target = tiny_target("llama")

    class OneSecondDrafts(Drafter):
        budget = 2

        def propose(self, state):
            clock[0] += 1.0  # the only time that passes
            return chain(state.root_token, torch.tensor([3, 4]))

    seen = []

    class Recording(ConfidenceSchedule):
        def apply(self, tree, state=None, drafter=None):
            seen.append(self.overhead(state))
            return super().apply(tree, state, drafter)

    SpeculativeDecoder(target, OneSecondDrafts(), schedule=Recording(lambda m: 1.0)).generate([5, 17, 9, 33],
                                                                                             max_new_tokens=10)
    assert len(seen) >= 3 and seen == pytest.approx([1.0] * len(seen))


def test_a_round_cut_after_the_schedule_still_closes_its_verify_time():
    """The decoder may cut the scheduled tree to the context window before verifying it; that round's verify time
    belongs to that round (at the size verified), not to the next round's refit point."""
    from graft_block.decoder import PhaseTimer, Verified

    sched = ConfidenceSchedule({"median_s": {"1": 0.010, "17": 0.026}})
    timer = PhaseTimer()
    state = type("S", (), {"round": 0, "timer": timer})()
    out = sched.apply(chain(0, [1, 2, 3, 4]), state)
    timer.totals["verify"] += 0.5
    sched.observe(Verified(out.subset(torch.arange(2)), None, None, torch.tensor([0]), 7, None), state)
    state.round = 1
    out = sched.apply(chain(0, [1, 2, 3, 4]), state)
    timer.totals["verify"] += 0.02
    sched.observe(Verified(out, None, None, torch.tensor([0]), 7, None), state)
    c2, c5 = sched.cost(2), sched.cost(5)
    assert sched._timed == pytest.approx([2.0, c2 + c5, 0.52, c2 * c2 + c5 * c5, c2 * 0.5 + c5 * 0.02])


class FullTreeDrafter(Drafter):
    """Every token at every node down to ``depth``, with random sibling log-probs (its own generator): a tree
    that never depends on the target. A schedule's ``state.draft_nodes`` keeps its first nodes (breadth first)."""

    def __init__(self, vocab: int, depth: int = 2, seed: int = 0, head: bool = False):
        self.vocab, self.depth, self.head = vocab, depth, head
        self.budget = sum(vocab ** d for d in range(1, depth + 1))
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, state):
        tokens, parents, scores = [state.root_token], [-1], [0.0]
        frontier = [0]
        for _ in range(self.depth):
            nxt = []
            for p in frontier:
                logp = torch.log_softmax(1.5 * torch.randn(self.vocab, generator=self.gen), 0).tolist()
                for tok in range(self.vocab):
                    tokens.append(tok)
                    parents.append(p)
                    scores.append(scores[p] + logp[tok])
                    nxt.append(len(tokens) - 1)
            frontier = nxt
        n = 1 + (state.draft_nodes if state.draft_nodes is not None else self.budget)
        return make_tree(tokens[:n], parents[:n], scores[:n])

    def node_survival(self, tree):
        return torch.rand(tree.size, generator=self.gen) if self.head else None


class PeekingSchedule:
    """Deliberately wrong: runs the round's verify in advance on a copy of the generator and, when the round would
    emit ``bad`` after its first token, verifies the root alone instead. The kept set depends on the target's own
    draws, so the law changes."""

    def __init__(self, bad: int):
        self.bad = bad

    def apply(self, tree, state, drafter=None):
        target = state.target
        logits, _ = target.verify(tree)
        target.compact(tree.size, torch.arange(0))  # drop the peek's cache entries again
        twin = torch.Generator(device=state.generator.device)
        twin.set_state(state.generator.get_state())
        path, bonus = walk(tree, choose(logits, state.sampling, twin).cpu())
        emitted = tree.tokens[path[1:]].tolist() + [bonus]
        return tree.subset(torch.tensor([0])) if self.bad in emitted[1:] else tree


def _law_counts(dec, prompt, n, length, seed):
    gen = torch.Generator().manual_seed(seed)
    counts, accepted = Counter(), 0
    for _ in range(n):
        r = dec.generate(prompt, max_new_tokens=length, temperature=1.0, generator=gen)
        counts[tuple(r.tokens)] += 1
        accepted += sum(k * c for k, c in r.stats.accept_hist.items())
    return counts, accepted


def test_schedule_keeps_the_exact_law(one_thread):
    """T=1, 4-token vocabulary: the joint law of the first 3 new tokens with a confidence schedule that cuts a
    full 4-ary depth-2 tree every round equals the target's exact law (chi-square p > 1e-3, TV below the 99.9%
    quantile under exact sampling). Negative control: a schedule that peeks at the target's draws (same tree,
    same drafter) changes the law and the same test rejects it."""
    V, length, n = 4, 3, 800
    target = tiny_target("llama", vocab_size=V, hidden_size=32, num_layers=2)
    prompt = [1, 3, 2]
    exact = exact_sequence_probs(target, prompt, length, SamplingConfig(1.0))
    sched = ConfidenceSchedule(lambda m: 1.0 + 0.25 * (m - 1))
    dec = SpeculativeDecoder(target, FullTreeDrafter(V, seed=1), schedule=sched)
    counts, accepted = _law_counts(dec, prompt, n, length, 123)
    s = sched.summary()
    assert 1.0 <= s["mean_nodes_kept"] < s["mean_nodes_in"] < 20  # trees were cut, and not to the root
    assert s["mean_draft_nodes"] < 20  # and later drafts were sized from the cuts
    assert accepted > n // 5  # drafted nodes on the kept path were accepted
    assert s["recalibrated_rounds"] > n // 4 and s["refit_rounds"] > n // 4  # online recalibration and cost refit
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in exact.items())
    stat, dof, p = chi_square_test(counts, exact)
    assert tv < null_tv_quantile(exact, n) and p > 1e-3, (tv, stat, dof, p)
    # the same tree with a peeking schedule that suppresses the likeliest last token after a round's first token
    last = [sum(p for k, p in exact.items() if k[-1] == tok) for tok in range(V)]
    cheat = SpeculativeDecoder(target, FullTreeDrafter(V, seed=1), schedule=PeekingSchedule(bad=last.index(max(last))))
    bad_counts, _ = _law_counts(cheat, prompt, n, length, 123)
    assert chi_square_test(bad_counts, exact)[2] < 1e-3


def test_threshold_schedule_keeps_the_exact_law(one_thread):
    """The exact-law test with DeepSpec's threshold cut (on the drafter's random survivals, recalibrated online):
    trees were cut, drafted nodes accepted, and the first 3 tokens follow the target's law."""
    V, length, n = 4, 3, 800
    target = tiny_target("llama", vocab_size=V, hidden_size=32, num_layers=2)
    prompt = [1, 3, 2]
    exact = exact_sequence_probs(target, prompt, length, SamplingConfig(1.0))
    sched = ConfidenceSchedule(lambda m: 1.0 + 0.25 * (m - 1), stop="threshold", threshold=0.3)
    dec = SpeculativeDecoder(target, FullTreeDrafter(V, seed=1, head=True), schedule=sched)
    counts, accepted = _law_counts(dec, prompt, n, length, 123)
    s = sched.summary()
    assert 1.0 <= s["mean_nodes_kept"] < s["mean_nodes_in"] and s["threshold"] == 0.3
    assert accepted > n // 5
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in exact.items())
    stat, dof, p = chi_square_test(counts, exact)
    assert tv < null_tv_quantile(exact, n) and p > 1e-3, (tv, stat, dof, p)


def test_graft_then_schedule_keeps_the_exact_law(one_thread):
    """The same law test with a graft before the schedule: retrieved nodes spliced on the drafted tree, then the
    cut by survivals where the retrieved nodes' path scores and their own recalibration counts enter. The kept
    set still reads only the tree and earlier rounds, so the law is the target's."""
    from graft_block.adjacency import AdjacencyMatrix
    from graft_block.graft import Graft

    V, length, n = 4, 3, 800
    target = tiny_target("llama", vocab_size=V, hidden_size=32, num_layers=2)
    prompt = [1, 3, 2]
    exact = exact_sequence_probs(target, prompt, length, SamplingConfig(1.0))
    drafter = FullTreeDrafter(V, depth=1, seed=3)
    graft = Graft(budget=8, matrix=AdjacencyMatrix(V, 2, "int32", "cpu"), mode="fixed", fixed_draft_fraction=0.25)
    sched = ConfidenceSchedule(lambda m: 1.0 + 0.1 * (m - 1))
    dec = SpeculativeDecoder(target, drafter, graft=graft, schedule=sched)
    counts, accepted = _law_counts(dec, prompt, n, length, 321)
    assert graft.summary()["mean_retrieved_nodes"] > 0 and graft.stats["retrieved_accepted"] > 0
    assert any(key[2] == SOURCE_RETRIEVED for key in sched._counts)  # retrieved nodes were tested and counted apart
    assert sched.summary()["mean_nodes_kept"] < sched.summary()["mean_nodes_in"]
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in exact.items())
    stat, dof, p = chi_square_test(counts, exact)
    assert tv < null_tv_quantile(exact, n) and p > 1e-3, (tv, stat, dof, p)
    # negative control: the same graft with a schedule that peeks at the round's draws is caught
    last = [sum(p for k, p in exact.items() if k[-1] == tok) for tok in range(V)]
    graft = Graft(budget=8, matrix=AdjacencyMatrix(V, 2, "int32", "cpu"), mode="fixed", fixed_draft_fraction=0.25)
    cheat = SpeculativeDecoder(target, FullTreeDrafter(V, depth=1, seed=3), graft=graft,
                               schedule=PeekingSchedule(bad=last.index(max(last))))
    assert chi_square_test(_law_counts(cheat, prompt, n, length, 321)[0], exact)[2] < 1e-3


def test_graft_summary_counts_the_nodes_the_schedule_kept(one_thread):
    """A schedule after the graft drops retrieved nodes that are never verified: the graft's node counts and its
    hit rate per retrieved node are over the verified tree, the decoder's own counts."""
    from graft_block.adjacency import AdjacencyMatrix
    from graft_block.graft import Graft

    V = 4
    target = tiny_target("llama", vocab_size=V, hidden_size=32, num_layers=2)
    graft = Graft(budget=8, matrix=AdjacencyMatrix(V, 2, "int32", "cpu"), mode="fixed", fixed_draft_fraction=0.25)
    sched = ConfidenceSchedule(lambda m: 1.0 + 0.05 * (m - 1), fit_cost=False)  # cuts a few nodes
    sched.overhead = lambda state: 0.0  # the cut reads no clock: the same every run
    dec = SpeculativeDecoder(target, FullTreeDrafter(V, depth=1, seed=3), graft=graft, schedule=sched)
    st = dec.generate([1, 3, 2], max_new_tokens=40, temperature=1.0, seed=0).stats
    assert sched.summary()["mean_nodes_kept"] < sched.summary()["mean_nodes_in"]  # the schedule did cut
    g = graft.stats
    assert g["rounds"] == st.rounds and g["retrieved_nodes"] == st.retrieved_nodes and st.retrieved_accepted > 0
    assert g["draft_nodes"] + g["retrieved_nodes"] == st.tree_nodes
    assert graft.summary()["retrieved_hit_rate_per_node"] == pytest.approx(st.retrieved_accepted / st.retrieved_nodes)


def test_realised_tokens_are_the_walks_before_the_stop_trim(one_thread):
    """Expected tokens are the walk's (accepted + bonus) before the decoder trims the last round at max_new_tokens
    or EOS; the schedule's realised tokens are counted at the same point, not from the emitted tau."""
    V = 4
    target = tiny_target("llama", vocab_size=V, hidden_size=32, num_layers=2)
    sched = ConfidenceSchedule(lambda m: 1.0)  # a flat cost keeps the full 4-ary depth-2 tree
    dec = SpeculativeDecoder(target, FullTreeDrafter(V, depth=2, seed=1), schedule=sched)
    st = dec.generate([1, 3, 2], max_new_tokens=5).stats  # greedy: each round takes 2 nodes + bonus; 2 trimmed
    assert st.rounds == 2 and st.dropped == 2 and st.tau == 2.0
    s = sched.summary()
    assert s["mean_realised_tokens"] == 3.0 and s["mean_expected_tokens"] <= 3.0


def test_schedule_with_a_confidence_head_is_greedy_identical(one_thread):
    target = tiny_target("llama")
    sched = ConfidenceSchedule(lambda m: 1.0 + 0.1 * (m - 1), min_nodes=1)
    dec = SpeculativeDecoder(target, FullTreeDrafter(8, seed=2, head=True), schedule=sched)
    prompt = [5, 17, 9, 33]
    res = dec.generate(prompt, max_new_tokens=20)
    assert res.tokens == hf_greedy(target, prompt, 20)
    assert sched.summary()["survival_source"] == {"drafter": res.stats.rounds}
    assert res.stats.tree_nodes >= res.stats.rounds  # min_nodes=1: never a root-only round
    assert sum(res.stats.depth_hist.values()) == res.stats.rounds


# ---- the harness --------------------------------------------------------------------------------------------
def test_make_method_builds_the_schedule_on_the_run_curve(one_thread):
    target = tiny_target("llama")
    spec = {"drafter": {"type": "pld", "budget": "{budget}"}, "schedule": {"cost": "curve", "min_nodes": 0}}
    with pytest.raises(ConfigError, match="verify-cost curve"):
        make_method("pld_sched", spec, target, 8)
    with pytest.raises(ConfigError, match="unknown schedule keys"):
        make_method("pld_sched", {**spec, "schedule": {"cost": "curve", "k": 1}}, target, 8, curve={})
    curve = {"median_s": {"1": 0.01, "2": 0.011, "4": 0.012, "8": 0.016, "16": 0.024}}
    m = make_method("pld_sched", spec, target, 8, curve=curve)
    ids = torch.tensor([3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5])
    rec = m.run(ids, 12, 0.0, 0)
    assert rec["schedule"]["rounds"] == rec["rounds"] and rec["schedule"]["survival_source"]["scores"] > 0
    assert rec["tokens"] == hf_greedy(target, ids.tolist(), 12)
    assert m.run(ids, 4, 0.0, 0)["schedule"]["rounds"] < rec["rounds"]  # counters reset per run
    # verify cost proportional to the nodes: in the first round (no overhead measured yet) a node of survival 1
    # never raises tokens per second; once the round's own drafting/commit time counts, such nodes pay
    fixed = {**spec, "schedule": {"cost": "curve", "fit_cost": False}}  # the curve as given, not refitted
    flat = make_method("pld_sched", fixed, target, 8, curve={"median_s": {"1": 0.01, "2": 0.02, "16": 0.16}})
    s = flat.run(ids, 12, 0.0, 0)["schedule"]
    assert 0 < s["mean_nodes_kept"] <= s["mean_nodes_in"]
    tree = make_tree([3, 4, 5], [-1, 0, 1], [0.0, 0.0, 0.0])
    assert schedule_tree(tree, torch.ones(3), lambda k: 0.01 * k)[1]["kept"] == 0
    assert schedule_tree(tree, torch.ones(3), lambda k: 0.01 * k, overhead=0.005)[1]["kept"] == 2


def test_each_position_is_fitted_on_the_rows_that_reached_it(one_thread):
    """Position k's temperature fits only the chains that accepted every earlier draft: rows that stopped before
    k (still scored teacher-forced, here always wrong) must not flatten it."""
    n = 200
    first = torch.arange(n) % 2 == 0  # half the chains accept draft 0
    logits = torch.stack([torch.zeros(n), torch.ones(n)], 1).double()
    accepted = torch.stack([first, first], 1)  # draft 1 is right exactly on the chains that reached it
    valid = torch.stack([torch.ones(n, dtype=torch.bool), first], 1)
    temps = calibrate_temperatures(logits, accepted, valid)
    assert float(temps[1]) < 1.0  # all reached rows accepted at logit 1: sharpen (flattening would fit all rows)


def test_ece_bins_are_tenths_and_gaps_do_not_cancel_across_bins():
    """Bin b holds probabilities in [b/10, (b+1)/10) (1.0 in the last); ECE sums each bin's |sum(p - y)| / n."""
    ece = expected_calibration_error(torch.tensor([0.05, 0.15]), torch.tensor([0.0, 1.0]))
    assert ece == pytest.approx((0.05 + 0.85) / 2)  # two bins, not one (|0.2 - 1| / 2)
    ece = expected_calibration_error(torch.tensor([0.3, 0.7, 1.0]), torch.tensor([1.0, 0.0, 1.0]))
    assert ece == pytest.approx((0.7 + 0.7 + 0.0) / 3)  # over- and under-confidence add up
    # prefix ECE reads the survival product: 0.5 * 0.5 = 0.25 against a realised prefix of 1
    assert prefix_ece(torch.tensor([[0.5, 0.5]]), torch.tensor([[True, True]])) == pytest.approx((0.5 + 0.75) / 2)
