"""Mixed DDTree: exact top-B under best-mode / mixture scores, prefix-closed, unique siblings, K=1 == DDTree."""
import math

import pytest
import torch

from graft_block.tree import TreeError, validate
from graft_block.tree.ddtree import ddtree, topk_logprobs
from graft_block.tree.mixed import brute_force_mixed, mixed_ddtree, path_score, tree_paths


def random_modes(M, L, K, V, seed, shared_vocab=True):
    g = torch.Generator().manual_seed(seed)
    # A small vocabulary makes modes share tokens, so the trie must de-duplicate paths across modes.
    logits = torch.randn(M, L, V, generator=g) * 2.0
    ids, lps = zip(*(topk_logprobs(logits[m], K) for m in range(M)))
    return torch.stack(ids), torch.stack(lps)


@pytest.mark.parametrize("seed", range(12))
def test_k1_equals_ddtree_node_for_node(seed):
    g = torch.Generator().manual_seed(100 + seed)
    L, K, V = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g)), 20
    ids, lps = topk_logprobs(torch.randn(L, V, generator=g) * 3, K)
    for budget in (1, 3, 7, 16, 40):
        ref = ddtree(5, ids, lps, budget)
        got = mixed_ddtree(5, ids[None], lps[None], budget)
        assert torch.equal(got.tokens, ref.tokens)
        assert torch.equal(got.parents, ref.parents)
        assert torch.equal(got.depths, ref.depths)
        assert torch.equal(got.scores, ref.scores)
        assert got.modes.tolist() == [1] * got.size


def test_k1_equals_ddtree_with_ties():
    # Equal log-probs everywhere: order is decided only by the rank-tuple tie-break, which must match DDTree's.
    ids = torch.arange(12).view(3, 4)
    lps = torch.full((3, 4), math.log(0.25))
    ref = ddtree(0, ids, lps, 30)
    got = mixed_ddtree(0, ids[None], lps[None], 30)
    assert got.tokens.tolist() == ref.tokens.tolist() and got.parents.tolist() == ref.parents.tolist()


@pytest.mark.parametrize("score", ["best_mode", "mixture_uniform", "mixture_gated"])
@pytest.mark.parametrize("seed", range(10))
def test_matches_brute_force(score, seed):
    M, L, K, V = 3, 3, 3, 6
    ids, lps = random_modes(M, L, K, V, seed)
    w = (torch.softmax(torch.randn(M, generator=torch.Generator().manual_seed(seed)), 0)
         if score == "mixture_gated" else None)
    for budget in (1, 5, 12, 25):
        tree = mixed_ddtree(9, ids, lps, budget, score=score, mode_weights=w)
        validate(tree, budget=budget, root_token=9)  # prefix-closed, unique siblings, topological, budget
        ref = brute_force_mixed(ids, lps, budget, score=score, mode_weights=w)
        got = tree_paths(tree)
        assert set(got) == set(ref), (budget, set(got) ^ set(ref))
        for path, node in got.items():
            assert float(tree.scores[node]) == pytest.approx(ref[path], abs=1e-5)
        # mode bits: mode m proposes p iff s_m(p) >= the weakest best-mode score in the tree
        floor = min(path_score(p, ids, lps) for p in got)
        for path, node in got.items():
            want = sum(1 << m for m in range(M) if path_score(path, ids[m:m + 1], lps[m:m + 1]) >= floor - 1e-9)
            assert int(tree.modes[node]) == want, (path, int(tree.modes[node]), want)


def test_dedup_across_modes_and_unique_siblings():
    # Two identical modes: the tree must equal the single-mode DDTree (no duplicate sibling tokens), both bits set.
    ids, lps = random_modes(1, 4, 4, 30, 3)
    two = mixed_ddtree(1, ids.repeat(2, 1, 1), lps.repeat(2, 1, 1), 20)
    one = ddtree(1, ids[0], lps[0], 20)
    assert two.tokens.tolist() == one.tokens.tolist() and two.parents.tolist() == one.parents.tolist()
    assert two.modes[1:].tolist() == [3] * 20


def test_two_disjoint_modes_split_budget_by_score():
    # Mode 0 is confident on path A, mode 1 on path B: best-mode keeps both coherent chains, tagged by their mode.
    L, _K = 4, 2
    ids = torch.tensor([[[10, 90], [11, 91], [12, 92], [13, 93]], [[20, 90], [21, 91], [22, 92], [23, 93]]])
    lps = torch.log(torch.tensor([[0.9, 0.1]] * L).repeat(2, 1, 1))
    tree = mixed_ddtree(0, ids, lps, 8)
    paths = tree_paths(tree)
    assert (10, 11, 12, 13) in paths and (20, 21, 22, 23) in paths
    assert tree.modes[paths[(10, 11, 12, 13)]] == 1 and tree.modes[paths[(20, 21, 22, 23)]] == 2
    # Bits shrink along a path.
    m, par = tree.modes.tolist(), tree.parents.tolist()
    assert all(m[i] & m[par[i]] == m[i] for i in range(1, tree.size))


def test_best_mode_differs_from_mixture_when_modes_disagree():
    # A path both modes like scores higher under the mixture; best-mode ignores agreement. Check the scores.
    ids, lps = random_modes(2, 3, 3, 5, 7)
    tree = mixed_ddtree(0, ids, lps, 10, score="mixture_uniform")
    for path, node in tree_paths(tree).items():
        bm = path_score(path, ids, lps, "best_mode")
        mix = float(tree.scores[node])
        assert bm - math.log(2) - 1e-5 <= mix <= bm + 1e-5  # logmeanexp is within log M of the max


def test_bad_inputs_raise_clear_errors():
    ids, lps = random_modes(2, 3, 3, 5, 0)
    with pytest.raises(TreeError, match="M, L, K"):
        mixed_ddtree(0, ids[0], lps[0], 4)
    with pytest.raises(TreeError, match="unknown score"):
        mixed_ddtree(0, ids, lps, 4, score="product")
    with pytest.raises(TreeError, match="needs mode_weights"):
        mixed_ddtree(0, ids, lps, 4, score="mixture_gated")
    with pytest.raises(TreeError, match="mode_weights"):
        mixed_ddtree(0, ids, lps, 4, score="mixture_gated", mode_weights=[1.0])
    with pytest.raises(TreeError, match="budget"):
        mixed_ddtree(0, ids, lps, -1)


def test_budget_larger_than_support_and_zero():
    ids, lps = random_modes(2, 2, 2, 50, 1)
    tree = mixed_ddtree(0, ids, lps, 1000)
    assert tree.size - 1 == len(brute_force_mixed(ids, lps, 1000))
    assert mixed_ddtree(0, ids, lps, 0).size == 1


# ---- conditional (Markov-corrected) modes ------------------------------------------------------------------
def _conditional_table(M, L, V, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(M, L, V, V, generator=g) * 2, -1)  # [mode, depth, parent token, child]


def _table_expand(table, K):
    def expand(m, depth, token):
        vals, ids = table[m, depth - 1, token].sort(descending=True)
        return ids[:K].tolist(), vals[:K].tolist()
    return expand


@pytest.mark.parametrize("seed", range(4))
def test_conditional_mixed_is_the_top_budget_paths_by_best_mode_conditional_score(seed):
    """Children that depend on the parent token, per mode: the tree is exactly the top-B token paths by max over
    modes of the mode's summed conditional log-probs (brute force over every path in some mode's top-K)."""
    from graft_block.tree.mixed import conditional_mixed_ddtree

    M, L, V, K = 3, 3, 5, 3
    table = _conditional_table(M, L, V, seed)
    best: dict[tuple, float] = {}

    def rec(m, path, prev, score):
        if len(path) == L:
            return
        vals, ids = table[m, len(path), prev].sort(descending=True)
        for t, v in zip(ids[:K].tolist(), vals[:K].tolist()):
            p = path + (t,)
            best[p] = max(best.get(p, -math.inf), score + v)
            rec(m, p, t, score + v)

    for m in range(M):
        rec(m, (), 0, 0.0)
    ranked = sorted(best.items(), key=lambda kv: -kv[1])
    for budget in (1, 4, 10, 25):
        tree = conditional_mixed_ddtree(0, _table_expand(table, K), budget, L, M)
        validate(tree, budget=budget, root_token=0)
        paths = tree_paths(tree)
        assert set(paths) == {p for p, _ in ranked[:budget]}
        for p, i in paths.items():  # a node's score is its path's best-mode score; some mode reaches it
            assert float(tree.scores[i]) == pytest.approx(best[p])
            assert int(tree.modes[i]) != 0


@pytest.mark.parametrize("seed", range(3))
def test_conditional_mixed_with_one_mode_is_conditional_ddtree(seed):
    from graft_block.tree.ddtree import conditional_ddtree
    from graft_block.tree.mixed import conditional_mixed_ddtree

    table = _conditional_table(1, 4, 6, 50 + seed)
    expand = _table_expand(table, 4)
    for budget in (1, 5, 12):
        ref, _ = conditional_ddtree(0, lambda d, prevs, _: [(*expand(0, d, prevs[0]), None)], budget, 4)
        got = conditional_mixed_ddtree(0, expand, budget, 4, 1)
        assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.parents, ref.parents)


def test_conditional_mixed_without_parent_dependence_is_the_mixed_tree():
    """Distributions that ignore the parent token: the best_mode mixed DDTree over the same marginals."""
    from graft_block.tree.mixed import conditional_mixed_ddtree

    ids, lps = random_modes(3, 4, 4, 9, seed=3)
    expand = lambda m, d, tok: (ids[m, d - 1].tolist(), lps[m, d - 1].tolist())  # noqa: E731
    for budget in (3, 9, 20):
        assert tree_paths(conditional_mixed_ddtree(0, expand, budget, 4, 3)) == \
            tree_paths(mixed_ddtree(0, ids, lps, budget))
    with pytest.raises(TreeError, match="modes"):
        conditional_mixed_ddtree(0, expand, 3, 4, 0)


# ---- -inf log-probs (tokens outside a mode's support) ---------------------------------------------------------
def test_best_mode_never_proposes_minus_inf_tokens_nor_nan_scores():
    """A mode's top-K may end in -inf (the draft gives those tokens probability 0). Best-mode used to pop them
    once the finite paths ran out, adding zero-probability nodes, and a sibling of a -inf entry scored
    -inf - (-inf) = NaN. Now, as under the mixture rules and the brute force, they are never proposed."""
    ninf = float("-inf")
    ids = torch.tensor([[[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 9, 3, 4], [5, 6, 7, 8]]])
    lps = torch.tensor([[[math.log(.7), math.log(.3), ninf, ninf]] * 2] * 2)
    for budget in (3, 12):
        for score, w in (("best_mode", None), ("mixture_uniform", None), ("mixture_gated", [0.3, 0.7])):
            tree = mixed_ddtree(0, ids, lps, budget, score=score, mode_weights=w)
            validate(tree, budget=budget, root_token=0)
            assert bool(torch.isfinite(tree.scores).all()), (score, tree.scores.tolist())
            assert set(tree_paths(tree)) == set(brute_force_mixed(ids, lps, budget, score=score, mode_weights=w))


def test_conditional_mixed_never_proposes_minus_inf_children():
    from graft_block.tree.mixed import conditional_mixed_ddtree

    ninf = float("-inf")
    expand = lambda m, d, tok: ([1, 2, 3, 4], [math.log(0.6), math.log(0.4), ninf, ninf])  # noqa: E731
    tree = conditional_mixed_ddtree(0, expand, 12, 2, 2)
    validate(tree, budget=12, root_token=0)
    assert tree.size - 1 == 2 + 4  # the finite paths: 2 at depth 1, 2 x 2 at depth 2
    assert bool(torch.isfinite(tree.scores).all()), tree.scores.tolist()
    root_inf = lambda m, d, tok: ([1, 2], [ninf, ninf])  # noqa: E731
    assert conditional_mixed_ddtree(0, root_inf, 5, 2, 1).size == 1


def test_root_only_tree_marks_every_mode_and_zero_modes_is_root_only():
    ids, lps = random_modes(3, 2, 2, 9, 0)
    # the root's bits do not depend on whether the budget was 0 or no node could be proposed
    assert mixed_ddtree(0, ids, lps, 0).modes.tolist() == [7]
    assert mixed_ddtree(0, ids, torch.full_like(lps, float("-inf")), 4).modes.tolist() == [7]
    assert mixed_ddtree(0, ids[:0], lps[:0], 4).size == 1  # no mode: was a ZeroDivisionError


def test_mixed_tree_equals_ddtree_when_float32_would_overflow():
    """finfo.min log-probs are finite, but a path of two sums past float32: the M = 1 mixed tree kept such nodes
    (-inf in Tree.scores) where ddtree leaves them out; both follow one rule now."""
    from graft_block.tree.ddtree import ddtree, topk_logprobs
    from graft_block.tree.mixed import mixed_ddtree

    lo = torch.finfo(torch.float32).min
    logits = torch.tensor([[3.0, 1.0, lo, lo], [2.0, 0.5, lo, lo], [1.0, 0.0, lo, lo]])
    ids, lps = topk_logprobs(logits, 4)
    ref, mixed = ddtree(9, ids, lps, 60), mixed_ddtree(9, ids[None], lps[None], 60)
    assert bool(torch.isfinite(mixed.scores).all()), mixed.scores.tolist()
    assert torch.equal(mixed.tokens, ref.tokens) and torch.equal(mixed.parents, ref.parents)


def test_conditional_mixed_modes_are_every_mode_that_proposes_the_node():
    """Tree.modes of the conditional tree is the OR of the modes whose entry for the node was popped: with
    parent-independent distributions it equals mixed_ddtree's proposing modes (no ties here), including a mode that
    shadows another one slightly lower."""
    from graft_block.tree.mixed import conditional_mixed_ddtree

    ids, lps = random_modes(3, 4, 4, 9, seed=3)
    shadow = lps.clone()
    shadow[1], ids_s = lps[0] - 1e-3 * torch.arange(1, 5).view(4, 1), ids.clone()
    ids_s[1] = ids[0]
    for i, lp in ((ids, lps), (ids_s, shadow)):
        expand = lambda m, d, tok, i=i, lp=lp: (i[m, d - 1].tolist(), lp[m, d - 1].tolist())  # noqa: E731
        for budget in (3, 9, 20):
            got, ref = conditional_mixed_ddtree(0, expand, budget, 4, 3), mixed_ddtree(0, i, lp, budget)
            g, r = tree_paths(got), tree_paths(ref)
            assert {p: int(got.modes[n]) for p, n in g.items()} == {p: int(ref.modes[n]) for p, n in r.items()}
            assert budget < 20 or any(bin(m).count("1") > 1 for m in ref.modes.tolist()[1:])  # several modes


def test_mixture_gated_normalises_mode_weights():
    """mode_weights need only a positive sum: they are normalised, so scores are the mixture's prefix log-probs
    (<= 0), the same as with the normalised weights."""
    ids, lps = random_modes(2, 3, 3, 5, 4)
    raw = mixed_ddtree(0, ids, lps, 12, score="mixture_gated", mode_weights=[3.0, 1.0])
    unit = mixed_ddtree(0, ids, lps, 12, score="mixture_gated", mode_weights=[0.75, 0.25])
    assert tree_paths(raw) == tree_paths(unit) and torch.allclose(raw.scores, unit.scores)
    for path, node in tree_paths(raw).items():
        want = math.log(0.75 * math.exp(path_score(path, ids[:1], lps[:1])) +
                        0.25 * math.exp(path_score(path, ids[1:], lps[1:])))
        assert float(raw.scores[node]) == pytest.approx(want, abs=1e-5) and want <= 0


@pytest.mark.parametrize("seed", range(6))
def test_conditional_mixed_modes_follow_the_floor_rule_with_ties_at_the_budget(seed):
    """Exact ties at the budget boundary: ``Tree.modes`` is every mode whose own path score is at least the weakest
    node's, as ``mixed_ddtree`` (``proposing_modes``) sets it, not only the mode whose entry happened to fill the
    budget. Dyadic log-probs (sums exact in floating point, 0 included) make ties everywhere."""
    from graft_block.tree.mixed import conditional_mixed_ddtree, proposing_modes

    lp = [math.log(.6), math.log(.4)]
    tied = conditional_mixed_ddtree(0, lambda m, d, t: ([1, 2], lp), 3, 2, 2)
    ref = mixed_ddtree(0, torch.tensor([[[1, 2], [1, 2]]] * 2), torch.tensor([[lp, lp]] * 2), 3)
    assert tied.tokens.tolist() == ref.tokens.tolist() and tied.modes.tolist() == ref.modes.tolist() == [3] * 4
    g = torch.Generator().manual_seed(seed)
    M, L, K, V = 3, 3, 3, 4
    lps = (-0.5 * torch.randint(0, 4, (M, L, K), generator=g).double()).sort(-1, descending=True).values
    ids = torch.stack([torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(L)]) for _ in range(M)])
    expand = lambda m, d, tok: (ids[m, d - 1].tolist(), lps[m, d - 1].tolist())  # noqa: E731
    for budget in range(1, 16):
        tree = conditional_mixed_ddtree(0, expand, budget, L, M)
        validate(tree, budget=budget, root_token=0)
        rule = proposing_modes(tree.tokens.tolist(), tree.parents.tolist(), ids.tolist(), lps.tolist())
        assert tree.modes.tolist() == rule, budget
        mixed = mixed_ddtree(0, ids, lps, budget)
        if tree_paths(mixed) == tree_paths(tree):  # the same nodes (ties may pick others): the same bits
            assert sorted(zip(tree_paths(tree), tree.modes[list(tree_paths(tree).values())].tolist())) == \
                sorted(zip(tree_paths(mixed), mixed.modes[list(tree_paths(mixed).values())].tolist()))
