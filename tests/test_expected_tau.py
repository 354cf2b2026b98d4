"""The exact expected accepted length of a tree (tree.expected_accept_length) and `graft-block expect`."""
from __future__ import annotations

import pytest
import torch

from graft_block import Drafter
from graft_block.errors import ConfigError
from graft_block.eval.expected_tau import (cut_values, decay_by_first_draft, decay_rows, evaluate, format_headroom,
                                          format_sizes, format_table, headroom, sample_contexts, summary_rows,
                                          tree_spec)
from graft_block.sampling import SamplingConfig
from graft_block.testing import hf_greedy, prefilled_state, tiny_target
from graft_block.tree import accept_at_least, accept_length, expected_accept_length, from_paths, walk


def test_expected_accept_length_is_the_mean_of_the_walk():
    """Draw the target's choice at every node from its own law, walk, count: the mean is the formula's value
    (within 4 standard errors of 20,000 walks); one-hot laws give the greedy walk's count exactly."""
    g = torch.Generator().manual_seed(0)
    tree = from_paths(0, [[1, 2, 3], [1, 4], [2, 1, 1], [3], [1, 2, 4]])
    V = 5
    par = tree.parents.clamp(min=0)
    logits = torch.randn(tree.size, V, generator=g)
    logits[par[1:], tree.tokens[1:]] += 2.5  # the tree's children are likely: deep nodes get reached
    law = torch.softmax(logits, -1)  # row i: the law of the target's choice at node i
    q = law[par, tree.tokens]
    exact = expected_accept_length(tree, q)
    n = 20000
    choices = torch.multinomial(law, n, replacement=True, generator=g).T  # [n, nodes]
    counts = torch.tensor([float(walk(tree, c)[0].numel() - 1) for c in choices])
    assert abs(counts.mean() - exact) < 4 * counts.std() / n ** 0.5
    at_least = accept_at_least(tree, q)  # P(>= d accepted), d = 1..3, against the walks' own shares
    assert len(at_least) == 3 and at_least == sorted(at_least, reverse=True)
    for d, p in enumerate(at_least, 1):
        share = float((counts >= d).double().mean())
        assert abs(share - p) < 4 * (p * (1 - p) / n) ** 0.5 + 1e-9
    assert exact > 1.0  # the walk goes past depth 1: paths, not only children, are tested
    hard = law.argmax(-1)
    assert expected_accept_length(tree, (hard[par] == tree.tokens).double()) == accept_length(tree, hard)
    with pytest.raises(ValueError, match="one conditional per node"):
        expected_accept_length(tree, q[:-1])


class Oracle(Drafter):
    """The target's greedy continuation to ``depth``, with a wrong sibling beside it at every depth."""

    def __init__(self, target, depth: int = 3):
        self.target, self.depth, self.budget = target, depth, 2 * depth

    def propose(self, state):
        true = hf_greedy(self.target, state.tokens[:-1], self.depth + 1)[1:]  # [0] is the root
        wrong = [true[:d] + [(true[d] + 1) % self.target.vocab_size] for d in range(self.depth)]
        return from_paths(state.root_token, [true] + wrong)


def test_expect_scores_each_tree_against_the_targets_own_continuation(one_thread):
    """At T = 0 a context's value is how far the tree follows the target's greedy continuation (recomputed here
    from HF greedy decoding; the oracle's is its depth); at T > 0 it is an expectation between 0 and the depth;
    the summary pairs every method with the first."""
    target = tiny_target("qwen3")
    cfg = {"type": "dspark", "num_layers": 1, "target_layer_ids": [0, 2], "block_size": 6, "seed": 1,
           "markov_rank": 4, "proposal": "ddtree", "budget": 10}
    drafters = {"tree": Drafter.from_config(cfg, target=target), "oracle": Oracle(target)}
    g = torch.Generator().manual_seed(3)
    contexts = [torch.randint(3, 120, (9,), generator=g).tolist() for _ in range(3)]
    res = evaluate(target, drafters, contexts, [SamplingConfig(), SamplingConfig(temperature=0.8)])
    assert res["values"]["oracle"][0.0] == [3.0] * 3
    assert res["at_least"]["oracle"][0.0] == [1.0, 1.0, 1.0]  # every context reaches depth 3
    decay = {(r["method"], r["temperature"]): r["suffix_decay"] for r in decay_rows(res)}
    assert decay[("oracle", 0.0)] == [1.0, 1.0, 1.0]
    at = res["at_least"]["oracle"][0.8]
    assert decay[("oracle", 0.8)] == pytest.approx([at[0], at[1] / at[0], at[2] / at[1]])
    assert sum(res["at_least"]["tree"][0.8]) == pytest.approx(sum(res["values"]["tree"][0.8]) / 3)
    assert all(0.0 < v < 3.0 for v in res["values"]["oracle"][0.8])
    d = drafters["tree"]
    for t in (0.0, 0.8):  # the per-context rows are what the means were taken over
        per = res["per_context"]["tree"][t]
        depth = max(map(len, per))  # trees of one method may differ in depth from context to context
        assert [sum(c[k] for c in per if k < len(c)) / 3 for k in range(depth)] == pytest.approx(
            res["at_least"]["tree"][t])
    for i, (ids, value) in enumerate(zip(contexts, res["values"]["tree"][0.0])):
        tree = d.propose(prefilled_state(target, ids, d))
        assert res["first_draft"]["tree"][0.0][i] == pytest.approx(float(tree.scores[tree.depths == 1].max()))
        cont = hf_greedy(target, ids, 12)  # cont[0] is the tree's root
        toks, par = tree.tokens.tolist(), tree.parents.tolist()
        depth, node = 0, 0
        while True:
            kids = [i for i in range(1, len(toks)) if par[i] == node and toks[i] == cont[depth + 1]]
            if not kids:
                break
            node, depth = kids[0], depth + 1
        assert value == depth
    rows = summary_rows(res)
    assert [(r["method"], r["temperature"]) for r in rows] == [("tree", 0.0), ("tree", 0.8), ("oracle", 0.0),
                                                               ("oracle", 0.8)]
    assert rows[0]["diff"] == 0.0 and rows[2]["tau"] == 4.0
    assert rows[2]["diff"] == pytest.approx(3.0 - sum(res["values"]["tree"][0.0]) / 3)
    one = summary_rows(res, [1])  # a prompt set's table: the same rows over its contexts only
    assert one[0]["contexts"] == 1 and one[0]["tau"] == 1.0 + res["values"]["tree"][0.0][1]
    assert one[2]["diff"] == pytest.approx(3.0 - res["values"]["tree"][0.0][1])


def test_paired_standard_error_counts_answers_not_their_cuts():
    """Cuts of one answer move together: with 4 cuts of each of 3 answers whose paired differences agree within
    an answer, the standard error is that of the 3 answers' differences (as if one cut each), not of 12 draws.
    Without groups every context is its own answer, as sample_contexts cuts them."""
    import math

    per_answer = [0.1, 0.5, -0.2]
    ref = [1.0, 2.0, 0.5, 1.5] * 3
    res = {"values": {"ref": {0.0: ref}, "new": {0.0: [r + per_answer[i // 4] for i, r in enumerate(ref)]}},
           "nodes": {"ref": 4.0, "new": 4.0}}
    groups = [i // 4 for i in range(12)]
    mean = sum(per_answer) / 3
    by_answer = math.sqrt(sum((x - mean) ** 2 for x in per_answer) / 2) / math.sqrt(3)
    row = summary_rows(res, groups=groups)[1]
    assert row["diff"] == pytest.approx(mean) and row["se"] == pytest.approx(by_answer) and row["answers"] == 3
    one = summary_rows(res, [0, 1, 4, 5], groups=groups)[1]  # a subset keeps each context's answer
    assert one["answers"] == 2 and one["se"] == pytest.approx(0.2)  # differences 0.1, 0.1, 0.5, 0.5
    loose = summary_rows(res)[1]
    diffs = [per_answer[i // 4] for i in range(12)]
    sd = math.sqrt(sum((x - mean) ** 2 for x in diffs) / 11)
    assert loose["se"] == pytest.approx(sd / math.sqrt(12)) and loose["answers"] == 12
    assert "(3 answers)" in format_table(summary_rows(res, groups=groups))
    plain = format_table(summary_rows(res)).splitlines()  # every context its own answer: no count of answers
    assert plain[2:] == ["| ref | 0 | 4.0 | 2.250 | - | 12 |",
                         f"| new | 0 | 4.0 | 2.383 | +0.133 +- {sd / math.sqrt(12):.3f} | 12 |"]


def test_expect_refuses_what_depends_on_earlier_rounds():
    target = tiny_target("qwen3")
    tree = {"drafter": {"type": "pld", "budget": "{budget}"}, "default_budget": 4}

    def drafter(name, spec, budget, schedule_ok=False):
        return Drafter.from_config(tree_spec(name, spec, budget, schedule_ok)["drafter"], target=target)

    with pytest.raises(ConfigError, match="has a graft.*graft-block bench"):
        tree_spec("g", {**tree, "graft": {"mode": "prune"}}, None)
    with pytest.raises(ConfigError, match="has a schedule.*--headroom"):
        tree_spec("s", {**tree, "schedule": {"cost": "curve"}}, None)
    assert drafter("s", {**tree, "schedule": {"cost": "curve"}}, 3, schedule_ok=True).budget == 3
    with pytest.raises(ConfigError, match="prices the schedule's default cut"):
        tree_spec("s", {**tree, "schedule": {"cost": "curve", "stop": "first_drop"}}, 3, schedule_ok=True)
    with pytest.raises(ConfigError, match="prices the schedule's default cut"):
        tree_spec("s", {**tree, "schedule": {"cost": "curve", "min_nodes": 2}}, 3, schedule_ok=True)
    with pytest.raises(ConfigError, match="has a graft"):  # a graft's tree is not the drafter's: never priced
        tree_spec("g", {**tree, "graft": {"mode": "prune"}}, None, schedule_ok=True)
    with pytest.raises(ConfigError, match="drafts no tree"):
        tree_spec("ar", {"drafter": None}, None)
    assert drafter("p", tree, 3).budget == 3
    from graft_block.eval.expected_tau import main

    for bad, words in ((["--budget", "0"], "must be >= 1"), (["--budget", "4,x"], "comma-separated ints"),
                       (["--contexts", "0"], "--contexts must be"), (["--temperature", "hot"], "--temperature"),
                       (["--overhead-ms", "-1"], "--overhead-ms must be"), (["--cuts", "0"], "--cuts must be"),
                       (["--answer-tokens", "4"], "--answer-tokens >= 5"), (["--top-p", "0"], "top_p must be in"),
                       (["--walk"], "--walk needs --prompts"),
                       (["--walk", "--prompts", "none.jsonl", "--temperature", "1"], "--walk needs .*--temperature 0")):
        with pytest.raises(ConfigError, match=words):  # before any model loads
            main(bad)


def test_contexts_are_cut_inside_distinct_answers(tmp_path):
    from graft_block.eval.expected_tau import CALIBRATION
    from graft_block.onpolicy import read

    answers = {tuple(r["ids"].tolist()): r["prompt_len"] for r in read(CALIBRATION)}
    ctxs = sample_contexts(CALIBRATION, 25, seed=1)
    assert len(ctxs) == 25 and ctxs == sample_contexts(CALIBRATION, 25, seed=1)
    owners = set()
    for c in ctxs:
        owner = [a for a in answers if list(a[: len(c)]) == c and answers[a] < len(c) <= len(a) - 4]
        assert owner
        owners.add(owner[0])
    assert len(owners) == 25
    with pytest.raises(ConfigError, match="no answer of"):
        sample_contexts(CALIBRATION, 3, min_answer=10 ** 6)


def test_answer_contexts_cut_the_targets_own_answers(tmp_path, one_thread):
    """--prompts: each context is a prompt followed by the start of the target's greedy answer to it."""
    import json

    from graft_block.eval.expected_tau import answer_contexts

    target = tiny_target("qwen3")
    prompts = [[5, 17, 33, 2], [9, 9, 40, 71, 3]]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": i, "turns": [p]}) + "\n" for i, p in enumerate(prompts)))
    ctxs, sets, answers = answer_contexts(target, [str(path)], 0, cuts=3, answer_tokens=12, seed=2)
    assert len(ctxs) == 6 and sets == ["p"] * 6  # the set is named by its file
    assert answers == [0, 0, 0, 1, 1, 1]  # the answer each was cut from: the paired se's unit
    for k, c in enumerate(ctxs):
        p = prompts[k // 3]
        answer = hf_greedy(target, p, 12)
        assert c[: len(p)] == p and len(p) < len(c) <= len(p) + 8 and c[len(p):] == answer[: len(c) - len(p)]
    assert len({tuple(c) for c in ctxs}) == 6  # distinct cuts


def test_headroom_prices_fixed_sizes_the_schedules_cut_and_the_best_size_per_context():
    """A chain of 4 the target accepts whole in one context and rejects at once in the other, on a linear verify
    cost (1 + 0.1 per extra position, no overhead): a fixed size N earns (2 + N) tokens in 2 (1 + 0.1 N) seconds;
    the best size per context (all 4, then none) earns 6 in 2.4; a schedule that knows the outcome cuts the same,
    and one whose estimate says nothing about the context cuts both alike, no better than the best fixed size."""
    chain = from_paths(0, [[1, 2, 3, 4]], path_scores=[[-0.1, -0.2, -0.3, -0.4]])

    def cost(n):
        return 1.0 + 0.1 * (n - 1)

    accepted, rejected = [1.0] * 5, [1.0, 0.0, 0.0, 0.0, 0.0]
    flat = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6], dtype=torch.float64)
    knows = headroom([cut_values(chain, r, torch.tensor(r, dtype=torch.float64), cost, 0.0)
                      for r in (accepted, rejected)], cost, 0.0)
    blind = headroom([cut_values(chain, r, flat, cost, 0.0) for r in (accepted, rejected)], cost, 0.0)
    for N in range(5):
        assert knows["fixed"][N]["tau"] == pytest.approx((2 + N) / 2)
        assert knows["fixed"][N]["speedup"] == pytest.approx((2 + N) / (2 * cost(1 + N)))
    assert knows["best_fixed"] == 4
    assert knows["oracle"] == pytest.approx({"tau": 3.0, "nodes": 2.0, "speedup": 6 / 2.4})
    assert knows["cut"] == pytest.approx(knows["oracle"])
    assert knows["estimated_over_realised"] == pytest.approx(1.0)
    assert blind["cut"]["speedup"] <= blind["fixed"][blind["best_fixed"]]["speedup"] + 1e-12
    assert blind["cut"]["nodes"] in (0.0, 1.0, 2.0, 3.0, 4.0)  # the same cut in both contexts
    assert blind["estimated_over_realised"] == pytest.approx((1 + 0.9 + 0.8 + 0.7 + 0.6) / 3.0)
    short = from_paths(0, [[1, 2]], path_scores=[[-0.1, -0.2]])  # a context whose tree is smaller: sizes cap at 2
    mixed = headroom([cut_values(chain, accepted, flat, cost, 0.0), cut_values(short, [1.0] * 3, flat[:3], cost, 0.0)],
                     cost, 0.0)
    assert mixed["fixed"][4] == pytest.approx({"tau": (5 + 3) / 2, "speedup": 8 / (cost(5) + cost(3))})
    # the cut follows its estimate's order, not the path's: node 3 (path score -0.2) is the one the target takes
    fork = from_paths(0, [[1, 2], [3]], path_scores=[[-0.1, -0.5], [-0.2]])
    one = headroom([cut_values(fork, [1.0, 0.0, 0.0, 1.0], torch.tensor([1.0, 0.1, 0.05, 0.9]), cost, 0.0)], cost, 0.0)
    assert one["fixed"][1]["tau"] == 1.0 and one["cut"] == pytest.approx({"tau": 2.0, "nodes": 1.0,
                                                                           "speedup": 2.0 / cost(2)})
    assert one["fixed"][2]["tau"] == 2.0  # a DDTree-2 holds the two likeliest nodes, 1 and 3 (not nodes 1 and 2)
    res = {"headroom": {"chain": {0.0: knows}}, "nodes": {"chain": 4.0}}
    row = format_headroom(res).splitlines()[-1]
    assert row.startswith("| chain | 0 | 4.0 | 3.000 / 2.143 | 4 / 3.000 / 2.143 | 2.00 / 3.000 / 2.500 |")
    assert format_sizes(res).splitlines()[-1] == "| chain | 0 | 1.000 | 1.364 | 1.667 | 1.923 | 2.143 |"


def test_expect_headroom_on_a_real_tree_agrees_with_its_expected_tau(one_thread):
    """Through ``evaluate`` at T > 0: the whole tree's fixed-size row is the method's expected tau (a smoke test of
    the plumbing; the arithmetic is the test above)."""
    target = tiny_target("qwen3")
    drafters = {"oracle": Oracle(target)}
    g = torch.Generator().manual_seed(5)
    contexts = [torch.randint(3, 120, (9,), generator=g).tolist() for _ in range(3)]
    res = evaluate(target, drafters, contexts, [SamplingConfig(temperature=0.8)], cuts=(lambda n: 1.0 + 0.05 * n,
                                                                                         0.1))
    h = res["headroom"]["oracle"][0.8]
    assert h["fixed"][max(h["fixed"])]["tau"] == pytest.approx(1 + sum(res["values"]["oracle"][0.8]) / 3)
    taus = [h["fixed"][n]["tau"] for n in sorted(h["fixed"])]
    assert taus == sorted(taus) and taus[0] == 1.0
    assert h["oracle"]["speedup"] >= h["fixed"][h["best_fixed"]]["speedup"] - 1e-12


def test_walk_over_every_position_is_the_decoded_tau(tmp_path, one_thread):
    """--walk: scored at every position of the target's greedy answers, the decode's own path (c -> c + value + 1)
    gives the tokens per round that decoding those turns gives, round for round; the mean over positions differs.
    The drafter is a function of the context (as every bundled tree is): the next 4 answer tokens, with a wrong one
    at every answer position divisible by 5, so rounds accept 0-4 drafts."""
    import json

    from graft_block import SpeculativeDecoder
    from graft_block.eval.expected_tau import answer_contexts, walk_taus
    from graft_block.tree import chain

    target = tiny_target("llama")
    prompts = [[5, 17, 33, 2, 5, 17], [9, 9, 40, 71, 3]]
    answers = [hf_greedy(target, p, 40) for p in prompts]

    class NextFour(Drafter):
        budget = 4

        def propose(self, state):
            p, ref = next((p, a) for p, a in zip(prompts, answers) if state.tokens[: len(p)] == p)
            n = len(state.tokens) - len(p)  # answer tokens known, the root included
            nxt = [t if (n + i) % 5 else (t + 1) % target.vocab_size for i, t in enumerate(ref[n: n + 4])]
            return chain(state.root_token, torch.tensor(nxt, dtype=torch.long))

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": i, "turns": [p]}) + "\n" for i, p in enumerate(prompts)))
    ctxs, _, answer_of = answer_contexts(target, [str(path)], 0, cuts=None, answer_tokens=40)
    walk = walk_taus(evaluate(target, {"next4": NextFour()}, ctxs, [SamplingConfig()]), answer_of)[0]
    tokens = rounds = 0
    for p in prompts:
        out = SpeculativeDecoder(target, NextFour()).generate(p, max_new_tokens=40)
        assert out.tokens == answers[prompts.index(p)]
        tokens, rounds = tokens + len(out.tokens) - 1, rounds + out.stats.rounds  # the first token is the prefill's
    assert walk["positions"] == len(ctxs) == 2 * 39 and walk["rounds"] == rounds
    assert walk["walk_tau"] == pytest.approx(tokens / rounds) and walk["walk_tau"] > 2  # drafts were accepted
    assert abs(walk["mean_tau"] - walk["walk_tau"]) > 0.05


def test_contexts_are_cut_at_every_allowed_point_of_a_seeded_sample_of_answers(monkeypatch):
    """On answers of exactly ``min_answer`` (8) tokens after a 3-token prompt, a cut keeps one answer token or more
    before it and four or more after, and the points between are all drawn; shorter answers are never cut; which
    answers are cut is a seeded sample of the whole set, not the first ones of the file."""
    import graft_block.eval.expected_tau as E

    recs = [{"ids": torch.arange(100 * n, 100 * n + 3 + (8 if n % 3 else 7)), "prompt_len": 3} for n in range(60)]
    monkeypatch.setattr(E, "read", lambda dataset: recs)
    ctxs = sample_contexts("data", 40, seed=0)
    assert len(ctxs) == 40 and {4, 5, 6} <= {len(c) for c in ctxs} <= {4, 5, 6, 7}
    assert all(c[0] % 3 for c in ctxs)  # c[0] = 100 * n: answers of 8, never those of 7
    picked = [{c[0] for c in sample_contexts("data", 5, seed=s)} for s in (1, 2)]
    assert picked[0] != picked[1]


def test_answer_contexts_take_every_point_of_an_answer_shorter_than_its_cuts(tmp_path, one_thread):
    """An answer with room for fewer cuts than asked (8 points in a 12-token answer, 20 cuts asked) gives each of
    its points once rather than failing."""
    import json

    from graft_block.eval.expected_tau import answer_contexts

    target = tiny_target("qwen3")
    prompt = [5, 17, 33, 2]
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": 0, "turns": [prompt]}) + "\n")
    ctxs, _, answers = answer_contexts(target, [str(path)], 0, cuts=20, answer_tokens=12)
    assert sorted(len(c) - len(prompt) for c in ctxs) == list(range(1, 9)) and answers == [0] * 8


class Confident(Oracle):
    """The oracle's tree with a confidence head that gives every node P(accepted) 0.1."""

    def node_survival(self, tree):
        return torch.full((tree.size,), 0.1, dtype=torch.float64)


def test_expect_reads_each_methods_survival_where_its_schedule_would(one_thread):
    """``--headroom`` prices a method's cut from where its schedule reads survival (``estimate_source``): the
    drafter's head by default, path probabilities with ``survival: scores``; never the outcome. On the oracle's tree
    (a greedy chain of 3, a wrong sibling at each depth, no path scores) that the target takes whole at T = 0 (4
    tokens with the bonus): a head of 0.1 per node expects 1 + 0.2 + 0.1 + 0.05, flat path probabilities (siblings
    halved) 1 + 1 + 0.5 + 0.25."""
    from graft_block.eval.expected_tau import estimate_source

    assert estimate_source({"drafter": {}}) == estimate_source({"schedule": {"cost": "curve"}}) == "drafter"
    assert estimate_source({"schedule": {"cost": "curve", "survival": "scores"}}) == "scores"
    target = tiny_target("qwen3")
    g = torch.Generator().manual_seed(3)
    contexts = [torch.randint(3, 120, (9,), generator=g).tolist() for _ in range(2)]
    specs = {"head": {}, "scores": {"schedule": {"survival": "scores"}}}
    res = evaluate(target, {"head": Confident(target), "scores": Confident(target)}, contexts, [SamplingConfig()],
                   cuts=(lambda n: 1.0 + 0.1 * n, 0.0), estimates={m: estimate_source(s) for m, s in specs.items()})
    assert res["values"]["head"][0.0] == [3.0, 3.0]
    assert res["headroom"]["head"][0.0]["estimated_over_realised"] == pytest.approx(1.35 / 4)
    assert res["headroom"]["scores"][0.0]["estimated_over_realised"] == pytest.approx(2.75 / 4)


def test_a_cold_target_scores_trees_as_the_greedy_one_does(one_thread):
    """At T -> 0 the target's law at each node is its greedy choice, so the expectation tends to the greedy count:
    the oracle's 3 at T = 0.01 (each node's probability is read at its parent's row). Tree size counts drafted
    nodes only (6 here: the root is not one)."""
    target = tiny_target("qwen3")
    g = torch.Generator().manual_seed(3)
    contexts = [torch.randint(3, 120, (9,), generator=g).tolist() for _ in range(2)]
    res = evaluate(target, {"oracle": Oracle(target)}, contexts, [SamplingConfig(), SamplingConfig(temperature=0.01)])
    assert res["values"]["oracle"][0.0] == [3.0, 3.0]
    assert res["values"]["oracle"][0.01] == pytest.approx([3.0, 3.0], abs=0.01)
    assert res["nodes"]["oracle"] == 6.0


def test_the_oracle_is_the_best_size_per_context_and_ties_go_to_the_smaller_tree():
    """The oracle's rate is the best over every choice of a size per context (checked against all of them; on
    these prefix tokens one Dinkelbach step is not enough). Where the verify cost is flat (over a stair of the
    curve), sizes that earn the same tokens in the same time tie and the smaller tree is taken, by the best fixed
    size and by the oracle's size per context alike."""
    import itertools
    import random

    def values(prefixes):
        return [{"prefix": p, "cut_tokens": 1.0, "cut_nodes": 0, "estimated": 1.0, "realised": p[-1]} for p in prefixes]

    def cost(n):
        return 1.0 + 0.5 * (n - 1)

    h = headroom(values([[1.0, 2.0, 2.1], [1.0, 1.1, 2.1]]), cost, 0.0)
    assert h["best_fixed"] == 2 and h["oracle"] == pytest.approx({"tau": 1.5, "nodes": 0.5, "speedup": 3 / 2.5})
    rng = random.Random(0)
    for _ in range(30):
        prefixes = [[1.0] for _ in range(3)]
        for p in prefixes:
            for _ in range(rng.randint(1, 4)):
                p.append(p[-1] + rng.choice([0.0, 0.1, 0.5, 0.9, 1.0]))
        best = max(sum(p[n] for p, n in zip(prefixes, ns)) / sum(cost(1 + n) for n in ns)
                   for ns in itertools.product(*[range(len(p)) for p in prefixes]))
        assert headroom(values(prefixes), cost, 0.0)["oracle"]["speedup"] == pytest.approx(best)
    flat = headroom(values([[1.0, 2.0, 2.0, 2.0, 2.0], [1.0] * 5]), lambda n: 1.0, 0.0)
    assert flat["best_fixed"] == 1 and flat["fixed"][1]["speedup"] == flat["fixed"][4]["speedup"] == 1.5
    # the oracle's smallest trees at the same rate: the second context's node earns nothing (it started from 1 each)
    assert flat["oracle"] == pytest.approx({"tau": 1.5, "nodes": 0.5, "speedup": 1.5})
    # a verify cost in stairs (the root and one node cost what the root alone does): the first context's node
    # earns nothing on its stair, so the oracle leaves it out there and takes the second context's 3
    stairs = headroom(values([[1.0, 1.0, 1.0], [1.0, 1.0, 1.5, 2.5]]), lambda n: 1.0 if n <= 2 else 2.0, 0.0)
    assert stairs["oracle"] == pytest.approx({"tau": 1.75, "nodes": 1.5, "speedup": 3.5 / 3})


def test_suffix_decay_within_groups_of_the_first_methods_first_draft_confidence():
    """Contexts are ordered by the first method's first-draft probability and cut into equal groups; every method's
    decay is taken over the same contexts of a group."""
    res = {"first_draft": {"a": {0.0: [-0.1, -2.0, -0.5, -3.0]}, "b": {0.0: [-9.0, -0.1, -0.1, -0.1]}},
           "per_context": {"a": {0.0: [[1, 1], [0, 0], [1, 0], [1, 0]]},
                           "b": {0.0: [[1, 0], [0, 0], [1, 1], [0, 0]]}}}
    rows = decay_by_first_draft(res, 2)
    got = {(r["group"], r["method"].split(",")[0]): r["suffix_decay"] for r in rows}
    assert got == {(1, "a"): [0.5, 0.0], (1, "b"): [0.0, None],  # contexts 3 and 1: a's least sure
                   (2, "a"): [1.0, 0.5], (2, "b"): [1.0, 0.5]}
    assert rows[0]["p_first"] == pytest.approx((2.718281828 ** -3, 2.718281828 ** -2))
    assert rows[0]["method"] == "a, a p1 0.05-0.14" and {r["contexts"] for r in rows} == {2}
    assert len(decay_by_first_draft(res, 3)) == 6  # 4 contexts in 3 groups: 1, 1, 2
    # a tree without a depth-1 node (-inf) is the least sure; a shallower tree counts 0 at the depths it lacks
    res["first_draft"]["a"][0.0].append(float("-inf"))
    res["per_context"]["a"][0.0].append([])
    res["per_context"]["b"][0.0].append([1])
    rows = decay_by_first_draft(res, 5)
    first = [r for r in rows if r["group"] == 1]
    assert [r["suffix_decay"] for r in first] == [[], [1.0]] and first[0]["p_first"] == (0.0, 0.0)
    pooled = decay_by_first_draft(res, 1)
    assert [r["contexts"] for r in pooled] == [5, 5]
    assert pooled[1]["suffix_decay"] == pytest.approx([3 / 5, 1 / 3])  # b: [1,0], [0,0], [1,1], [0,0], [1]


def test_suffix_decay_is_none_where_the_depth_before_is_barely_reached():
    """A ratio of two rounding-sized numbers is no rate: below P = 1e-6 at depth k - 1 the decay at k is None."""
    rows = decay_rows({"at_least": {"m": {0.0: [0.5, 1e-7, 0.0]}}})
    assert rows == [{"method": "m", "temperature": 0.0, "suffix_decay": [0.5, pytest.approx(2e-7), None]}]


def test_expect_takes_the_smallest_valid_settings_and_cuts_with_its_seed(monkeypatch):
    """--cuts 1, --answer-tokens 5 and --overhead-ms 0 are valid (the refusals start below them), and --seed picks
    the contexts; the run gets as far as cutting them."""
    import types

    import graft_block.eval.expected_tau as E

    class Cut(Exception):
        pass

    def sample(dataset, count, seed=0, min_answer=8):
        raise Cut(count, seed)

    monkeypatch.setattr(E, "load_target", lambda *a, **k: None)
    monkeypatch.setattr(E, "Drafter", types.SimpleNamespace(from_config=lambda cfg, target=None: None))
    monkeypatch.setattr(E, "sample_contexts", sample)
    with pytest.raises(Cut) as got:
        E.main(["--cuts", "1", "--answer-tokens", "5", "--overhead-ms", "0", "--contexts", "2", "--seed", "3"])
    assert got.value.args == (2, 3)
