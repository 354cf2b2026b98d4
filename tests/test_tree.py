"""Model-free tree invariants, masks, positions, merge and the walk (including its sampling exactness)."""
import random
from collections import Counter
from dataclasses import replace

import pytest
import torch

from graft_block.testing import chi_square_test
from graft_block.tree import (
    SOURCE_RETRIEVED,
    TreeError,
    ancestor_mask,
    attention_mask,
    chain,
    from_paths,
    make_tree,
    merge,
    position_ids,
    validate,
    walk,
)


def random_tree(rng: random.Random, root: int, vocab: int, budget: int, max_width=4, max_depth=6):
    tokens, parents, kids = [root], [-1], {0: set()}
    depth = [0]
    while len(tokens) - 1 < budget:
        p = rng.randrange(len(tokens))
        if depth[p] >= max_depth or len(kids[p]) >= max_width:
            if all(depth[q] >= max_depth or len(kids[q]) >= max_width for q in range(len(tokens))):
                break
            continue
        t = rng.randrange(vocab)
        if t in kids[p]:
            continue
        kids[p].add(t)
        tokens.append(t)
        parents.append(p)
        depth.append(depth[p] + 1)
        kids[len(tokens) - 1] = set()
    return make_tree(tokens, parents)


def test_chain_and_positions():
    t = chain(7, [1, 2, 3], scores=[-0.1, -0.3, -0.6])
    assert t.tokens.tolist() == [7, 1, 2, 3]
    assert t.parents.tolist() == [-1, 0, 1, 2]
    assert position_ids(t, 10).tolist() == [[10, 11, 12, 13]]
    assert ancestor_mask(t).tolist() == torch.tril(torch.ones(4, 4, dtype=torch.bool)).tolist()


def test_ancestor_mask_matches_definition():
    rng = random.Random(0)
    for _ in range(50):
        t = random_tree(rng, 0, 20, rng.randint(1, 30))
        m = ancestor_mask(t)
        for i in range(t.size):
            anc = {i}
            c = i
            while c > 0:
                c = int(t.parents[c])
                anc.add(c)
            assert set(torch.nonzero(m[i]).flatten().tolist()) == anc


def test_attention_mask_is_additive_and_shows_prefix():
    t = from_paths(5, [[1, 2], [3]])
    m = attention_mask(t, cache_len=4, dtype=torch.float32)
    assert m.shape == (1, 1, t.size, 4 + t.size)
    assert (m[0, 0, :, :4] == 0).all()
    neg = torch.finfo(torch.float32).min
    # node "3" (index 3) must not see node "1" (index 1) or "2"
    assert m[0, 0, 3, 4 + 1] == neg and m[0, 0, 3, 4 + 2] == neg and m[0, 0, 3, 4 + 0] == 0


def test_from_paths_dedups_and_respects_budget():
    t = from_paths(9, [[1, 2, 3], [1, 2, 4], [1, 5]])
    validate(t)
    assert t.size == 1 + 5
    t2 = from_paths(9, [[1, 2, 3], [1, 2, 4], [1, 5]], budget=3)
    assert t2.size == 4 and validate(t2, budget=3)


def test_merge_dedups_siblings_and_keeps_base_first():
    a = from_paths(9, [[1, 2], [3]])
    b = from_paths(9, [[1, 7], [3, 4], [8]], source=SOURCE_RETRIEVED)
    m = merge(a, b)
    validate(m)
    assert m.tokens[: a.size].tolist() == a.tokens.tolist()
    assert m.size == a.size + 3  # 7 under 1, 4 under 3, 8 under root
    assert m.sources[a.size :].tolist() == [SOURCE_RETRIEVED] * 3
    assert merge(a, b, budget=4).size == 5
    with pytest.raises(TreeError):
        merge(a, from_paths(1, [[2]]))


@pytest.mark.parametrize(
    "tokens,parents,msg",
    [
        ([5, 1, 1], [-1, 0, 0], "duplicate sibling"),
        ([5, 1, 2], [-1, 2, 0], "topological"),
        ([5, 1], [0, 0], "root"),
    ],
)
def test_validate_rejects_broken_trees(tokens, parents, msg):
    with pytest.raises(TreeError, match=msg):
        validate(make_tree(tokens, parents))


def test_validate_budget_and_root():
    t = chain(3, [1, 2, 4])
    with pytest.raises(TreeError, match="budget"):
        validate(t, budget=2)
    with pytest.raises(TreeError, match="root token"):
        validate(t, root_token=4)


def test_validate_rejects_what_make_tree_cannot_build():
    """A drafter may build ``Tree`` directly: validate is then the only guard of the positions (depths), the
    topological order (a node its own parent) and the embedding rows (a token id == the vocabulary size)."""
    t = chain(3, [1, 2, 4])
    with pytest.raises(TreeError, match="depths"):
        validate(replace(t, depths=torch.tensor([0, 1, 1, 2])))  # node 2 verified at its parent's position
    with pytest.raises(TreeError, match="topolog"):
        validate(replace(t, parents=torch.tensor([-1, 0, 2, 2])))  # node 2 its own parent
    with pytest.raises(TreeError, match="outside the target vocabulary"):
        validate(t, vocab_size=4)  # id 4 is one past the last row
    assert validate(t, vocab_size=5) is t


def test_walk_follows_target_choices():
    t = from_paths(0, [[1, 2, 3], [1, 4], [5]])
    # node order: 0:root 1:"1" 2:"2" 3:"3" 4:"4" 5:"5"
    choices = torch.tensor([1, 4, 9, 9, 8, 9])
    path, bonus = walk(t, choices)
    assert path.tolist() == [0, 1, 4] and bonus == 8
    path, bonus = walk(t, torch.tensor([6, 0, 0, 0, 0, 0]))
    assert path.tolist() == [0] and bonus == 6


# ---- sampling exactness of the walk, in isolation --------------------------------------------------------
V = 4


def markov(prev: int) -> torch.Tensor:
    """A fixed synthetic target: next-token distribution depends on the previous token only."""
    g = torch.Generator().manual_seed(100 + prev)
    return torch.softmax(torch.randn(V, generator=g) * 1.5, dim=0)


def simulate(tree_fn, n_tokens: int, gen: torch.Generator, cheat: bool = False):
    """Decode ``n_tokens`` with walk() over trees proposed by ``tree_fn(last_token)`` from root token 0."""
    out = [0]
    while len(out) - 1 < n_tokens:
        t = tree_fn(out[-1])
        probs = torch.stack([markov(int(tok)) for tok in t.tokens])
        choices = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        if cheat:  # a broken verifier that favours drafted children: the test must catch it
            for i in range(t.size):
                kids = [j for j in range(t.size) if int(t.parents[j]) == i]
                if kids and torch.rand(1, generator=gen) < 0.3:
                    choices[i] = t.tokens[kids[0]]
        path, bonus = walk(t, choices)
        out += t.tokens[path[1:]].tolist() + [bonus]
    return tuple(out[1 : n_tokens + 1])


def exact3():
    probs = {}
    for a in range(V):
        for b in range(V):
            for c in range(V):
                probs[(a, b, c)] = float(markov(0)[a] * markov(a)[b] * markov(b)[c])
    return probs


def fixed_tree(last: int):
    # deterministic in the context: a wide-and-deep tree whose shape depends on the last token
    paths = [[(last + 1) % V, (last + 2) % V, 1], [(last + 3) % V, 0], [last % V], [(last + 1) % V, 3]]
    return from_paths(last, paths)


@pytest.mark.parametrize("cheat", [False, True])
def test_walk_sampling_is_exact_chi_square(cheat):
    gen = torch.Generator().manual_seed(1)
    n = 6000
    counts = Counter(simulate(fixed_tree, 3, gen, cheat=cheat) for _ in range(n))
    stat, dof, p = chi_square_test(counts, exact3())
    if cheat:
        assert p < 1e-3, f"the chi-square test failed to detect a biased verifier (p={p:.3g})"
    else:
        assert p > 1e-3, f"walk output distribution differs from the target's (chi2={stat:.1f}, dof={dof}, p={p:.3g})"


# ---- pruning's ranking (graft_block/pruning.py) ------------------------------------------------------------
def test_pruning_ranking_stays_ancestor_closed_with_a_nan_score():
    """A NaN score (a builder's -inf - -inf) used to leave its child's path-min finite (Python's min(x, nan) is x)
    while the NaN node sorted last: a top-n prefix held the child without its parent and subset() raised."""
    from graft_block.pruning import path_min_scores, ranked_nodes, top_nodes

    t = make_tree([9, 1, 2, 3], [-1, 0, 1, 0], scores=[0.0, float("nan"), -0.5, -1.0])
    assert path_min_scores(t).tolist()[1:] == [float("-inf"), float("-inf"), -1.0]
    assert ranked_nodes(t).tolist() == [0, 3, 1, 2]
    for n in range(t.size):
        validate(t.subset(top_nodes(t, n)), budget=n)


def test_reorder_refuses_an_order_that_does_not_start_at_the_root():
    from graft_block.errors import ConfigError
    from graft_block.pruning import ranked_nodes, reorder

    t = make_tree([9, 1, 2], [-1, 0, 0], scores=[0.0, -0.1, -0.2])
    assert reorder(t, ranked_nodes(t)).tokens.tolist() == [9, 1, 2]
    with pytest.raises(ConfigError, match="root"):  # was accepted: node 0 became token 1 with the root as child
        reorder(t, torch.tensor([1, 0, 2]))


# ---- DDTree (tree/ddtree.py) --------------------------------------------------------------------------------
NINF = float("-inf")


def _ddtree_paths(tree):
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    paths = [()]
    for i in range(1, tree.size):
        paths.append(paths[pars[i]] + (toks[i],))
    return set(paths[1:])


def test_ddtree_never_proposes_minus_inf_tokens_nor_nan_scores():
    """Rows ending in -inf (probability 0 under the drafter) used to become nodes once the finite paths ran out,
    and the sibling after a -inf entry scored -inf - (-inf) = NaN, which broke the heap order."""
    import math

    from graft_block.tree.ddtree import brute_force_top_prefixes, ddtree
    from graft_block.tree.mixed import mixed_ddtree

    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    lps = torch.tensor([[math.log(0.7), math.log(0.3), NINF, NINF]] * 2)
    for budget in (3, 6, 12):
        tree = ddtree(0, ids, lps, budget)
        validate(tree, budget=budget, root_token=0)
        assert bool(torch.isfinite(tree.scores).all()), tree.scores.tolist()
        assert tree.size - 1 == min(budget, 2 + 4)  # only the finite paths: 2 at depth 1, 2 x 2 at depth 2
        assert _ddtree_paths(tree) == brute_force_top_prefixes(ids, lps, budget)
        ref = mixed_ddtree(0, ids[None], lps[None], budget)  # M = 1 mixed tree == DDTree on such rows too
        assert ref.tokens.tolist() == tree.tokens.tolist() and ref.parents.tolist() == tree.parents.tolist()
        assert torch.equal(ref.scores, tree.scores)
    assert ddtree(0, ids, torch.full_like(lps, NINF), 5).size == 1  # nothing proposable: the root alone


def test_ddtree_scores_stay_finite_when_float32_would_overflow():
    """Log-probs of finfo.min (a logit masked with finfo.min rather than -inf) are finite, but a path of two sums
    past float32's range: stored in Tree.scores (float32) it became -inf, against the -inf-free convention."""
    from graft_block.tree.ddtree import ddtree, topk_logprobs

    lo = torch.finfo(torch.float32).min
    logits = torch.tensor([[3.0, 1.0, lo, lo], [2.0, 0.5, lo, lo], [1.0, 0.0, lo, lo]])
    ids, lps = topk_logprobs(logits, 4)
    tree = ddtree(9, ids, lps, 60)
    validate(tree, budget=60, root_token=9)
    assert bool(torch.isfinite(tree.scores).all()), tree.scores.tolist()
    assert bool((tree.scores[1:] <= 0).all())


def test_ddtree_refuses_unsorted_nan_or_mismatched_rows():
    """An unsorted row (rank r + 1 likelier than rank r) silently lost the top-B optimality, a NaN row gave NaN
    scores and a log-prob table narrower than the ids one raised an IndexError mid-build."""
    from graft_block.tree.ddtree import ddtree

    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(TreeError, match="sorted"):
        ddtree(0, ids, torch.tensor([[-2.0, -0.1, -3.0]]), 2)  # was [0, 1, 2]: missed the likelier token 2 first
    with pytest.raises(TreeError, match="NaN"):
        ddtree(0, ids, torch.tensor([[float("nan")] * 3]), 2)
    with pytest.raises(TreeError, match="shape"):
        ddtree(0, ids, torch.tensor([[-0.1, -0.2]]), 3)


def test_ddtree_is_the_brute_force_top_prefixes_in_any_float_dtype():
    from graft_block.tree.ddtree import brute_force_top_prefixes, ddtree, topk_logprobs

    g = torch.Generator().manual_seed(3)
    for trial in range(6):
        L, V = 1 + trial % 4, 7
        logits = torch.randn(L, V, generator=g) * 2
        logits[:, V - 2:] = NINF  # a restricted draft vocabulary: two ids outside it
        ids, lps = topk_logprobs(logits, 6)
        for budget in (1, 4, 9, 30):
            ref = brute_force_top_prefixes(ids, lps, budget)
            for dt in (torch.float32, torch.float64, torch.bfloat16):
                lp = lps.to(dt)
                tree = ddtree(3, ids.to(torch.int32), lp, budget)
                validate(tree, budget=budget, root_token=3)
                assert bool(torch.isfinite(tree.scores).all())
                if dt != torch.bfloat16:  # bf16 rounding may reorder near-ties
                    assert _ddtree_paths(tree) == ref, (trial, budget, dt)
                else:
                    assert tree.size - 1 == len(brute_force_top_prefixes(ids, lp.float(), budget))


def test_conditional_ddtree_never_proposes_minus_inf_children():
    """Its root, sibling and child pushes took -inf log-probs as they came (nodes with -inf scores, and -inf
    siblings were handed to ``expand`` to precompute); an empty child list raised an IndexError."""
    import math

    from graft_block.tree.ddtree import conditional_ddtree

    seen = []

    def expand(depth, prevs, prefix):
        seen.append(list(prevs))
        return [([1, 2, 3, 4], [math.log(0.6), math.log(0.4), NINF, NINF], None)]

    tree, acc = conditional_ddtree(0, expand, 12, 2)
    validate(tree, budget=12, root_token=0)
    assert tree.size - 1 == 2 + 4 and acc is None
    assert bool(torch.isfinite(tree.scores).all()), tree.scores.tolist()
    assert all(set(p) <= {1, 2} for p in seen[1:]), seen  # -inf siblings are no expansion candidates
    root_inf = lambda d, p, _: [([1, 2], [NINF, NINF], None)]  # noqa: E731
    assert conditional_ddtree(0, root_inf, 5, 2)[0].size == 1
    leafy = lambda d, p, _: [([5, 6], [-0.1, -2.5], 0.9)] if d == 1 else [([], [], 0.9)]  # noqa: E731
    tree, acc = conditional_ddtree(0, leafy, 5, 3)
    assert tree.tokens.tolist() == [0, 5, 6] and len(acc) == 3


def test_merge_ors_the_mode_bits_of_a_duplicate_and_continues_the_attach_score():
    base = make_tree([9, 1, 2], [-1, 0, 1], [0.0, -0.5, -1.0], modes=[0, 1, 1])
    extra = make_tree([9, 1, 3], [-1, 0, 0], [0.0, -0.2, -0.7], modes=[0, 2, 2])
    m = merge(base, extra)
    validate(m)
    assert m.tokens.tolist() == [9, 1, 2, 3]
    assert m.modes.tolist() == [0, 3, 1, 2]  # node 1 proposed by both modes: its bits are OR-ed
    # with the budget already full, a later duplicate is still identified (and OR-ed), only new nodes are dropped
    full = merge(base, make_tree([9, 3, 1], [-1, 0, 0], [0.0, -0.1, -0.2], modes=[0, 2, 2]), budget=2)
    assert full.tokens.tolist() == [9, 1, 2] and full.modes.tolist() == [0, 3, 1]
    # attached under node 2, an extra node's score continues node 2's path score
    under = merge(base, make_tree([2, 5], [-1, 0], [0.0, -0.25], SOURCE_RETRIEVED), attach=2)
    assert under.parents.tolist()[-1] == 2 and float(under.scores[-1]) == pytest.approx(-1.25)


def test_from_paths_keeps_each_nodes_own_cumulative_score():
    t = from_paths(9, [[1, 2], [1, 3], [4]], path_scores=[[-0.1, -0.5], [-0.7, -0.9], [-2.0]])
    assert t.tokens.tolist() == [9, 1, 2, 3, 4]
    # the shared node keeps its first insertion's score; every node its own depth's, not the path's last
    assert t.scores.tolist() == pytest.approx([0.0, -0.1, -0.5, -0.9, -2.0])
