"""Chimeric-prefix analysis: hand-built cases with known answers, the 2^m - 2 construction, and the round hooks."""
import math

import pytest
import torch

from graft_block.tree import SOURCE_RETRIEVED, TreeError, from_paths, make_tree, merge, with_sources
from graft_block.chimeric import (beam_futures, futures_recorder, proxy_hook, sample_futures, sampled_report,
                                  temperature_sampler)
from graft_block.tree.chimeric import label_proxy, label_sampled, proxy_shares, sampled_shares
from graft_block.tree.ddtree import ddtree
from graft_block.tree.mixed import mixed_ddtree, tree_paths

V = 100
JUNK = 99
L = 6
A = [10, 11, 12, 13, 14, 15]
B = [10, 21, 12, 23, 24, 15]  # disagrees with A at (1-based) positions 2, 4, 5: m = 3
P = 0.7


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models are latency-bound: one thread is much faster than two on a shared, loaded CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def marginals():
    """Per-position top-2 of the product-of-marginals drafter for the two-future mixture (p on A, 1-p on B)."""
    ids, lps = [], []
    for a, b in zip(A, B):
        if a != b:
            ids.append([a, b])
            lps.append([math.log(P), math.log(1 - P)])
        else:
            ids.append([a, JUNK])
            lps.append([0.0, -50.0])
    return torch.tensor(ids), torch.tensor(lps, dtype=torch.float32)


def point_mode(fut):
    return torch.tensor([[t, JUNK] for t in fut]), torch.tensor([[0.0, -50.0]] * len(fut))


def mixture_logits(tree):
    """Verify logits of a target whose only futures are A (p) and B (1-p); after any other path it says JUNK."""
    rows = []
    paths = [()]
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    for i in range(1, tree.size):
        paths.append(paths[pars[i]] + (toks[i],))
    for path in paths:
        probs = torch.zeros(V)
        d = len(path)
        for fut, w in ((A, P), (B, 1 - P)):
            if d < L and tuple(fut[:d]) == path:
                probs[fut[d]] += w
        if probs.sum() == 0:
            probs[JUNK] = 1.0
        rows.append(torch.log(probs / probs.sum() + 1e-12))
    return torch.stack(rows)


def expected_chimeric_nodes():
    diff = [int(a != b) for a, b in zip(A, B)]
    j = [sum(diff[: t + 1]) for t in range(L)]
    return sum(max(2 ** jt - 2, 0) for jt in j), sum(2 ** jt for jt in j)


def test_product_tree_needs_2m_minus_2_chimeras_to_reach_b():
    ids, lps = marginals()
    order = ddtree(0, ids, lps, 200)
    b_node = tree_paths(order)[tuple(B)]
    tree = ddtree(0, ids, lps, b_node)  # the smallest product-ranked tree holding B's full path
    chimeric, nodes = expected_chimeric_nodes()
    assert tree.size - 1 == nodes == 25
    labels = label_sampled(tree, [A, B])
    assert labels.count("chimeric") == chimeric == 14
    assert labels.count("coherent") == nodes - chimeric and labels.count("off_support") == 0
    full = [i for i in range(1, tree.size) if int(tree.depths[i]) == L]
    m = sum(a != b for a, b in zip(A, B))
    assert len(full) == 2 ** m and sum(labels[i] == "chimeric" for i in full) == 2 ** m - 2
    # B (p < 1/2) is the last full path a product ranking reaches
    assert b_node == max(full)
    shares = sampled_shares(tree, [A, B])["draft"]
    assert shares["n"] == 25 and shares["chimeric"] == pytest.approx(14 / 25)
    # The one-pass proxy agrees node for node on this construction.
    proxy, _ = label_proxy(tree, mixture_logits(tree))
    assert proxy == labels


def test_two_mode_mixture_tree_has_no_chimeras():
    ia, la = point_mode(A)
    ib, lb = point_mode(B)
    first = next(i for i, (a, b) in enumerate(zip(A, B)) if a != b) + 1  # 1-based first disagreement
    budget = L + (L - first + 1)
    tree = mixed_ddtree(0, torch.stack([ia, ib]), torch.stack([la, lb]), budget)
    assert set(tree_paths(tree)) == {tuple(f[:d]) for f in (A, B) for d in range(1, L + 1)}
    assert sampled_shares(tree, [A, B])["draft"]["chimeric_n"] == 0
    assert proxy_shares(tree, mixture_logits(tree))["draft"]["coherent"] == 1.0
    # modes: shared prefix proposed by both, the rest by one each
    paths = tree_paths(tree)
    assert tree.modes[paths[(10,)]] == 3 and tree.modes[paths[tuple(A)]] == 1 and tree.modes[paths[tuple(B)]] == 2


def test_off_support_unreachable_and_retrieved_reported_separately():
    base = from_paths(0, [A[:3], B[:2]])
    # a junk branch (off-support under both protocols) and, under it, the token the target would say after junk
    extra = with_sources(from_paths(0, [[A[0], 77, 78], [A[0], 77, JUNK]]), SOURCE_RETRIEVED)
    tree = merge(base, extra)
    sampled = label_sampled(tree, [A, B])
    proxy, _ = label_proxy(tree, mixture_logits(tree))
    paths = tree_paths(tree)
    n77, n78, n99 = paths[(A[0], 77)], paths[(A[0], 77, 78)], paths[(A[0], 77, JUNK)]
    assert [sampled[n77], sampled[n78], sampled[n99]] == ["off_support"] * 3
    assert [proxy[n77], proxy[n78], proxy[n99]] == ["off_support", "off_support", "unreachable"]
    s = proxy_shares(tree, mixture_logits(tree))
    assert s["draft"]["n"] == 4 and s["draft"]["coherent"] == 1.0  # A[:3] and B[:2] share the first node
    assert s["retrieved"]["n"] == 3 and s["retrieved"]["off_support_n"] == 2 and s["retrieved"]["unreachable_n"] == 1


def test_proxy_thresholds():
    # After root, the target gives token 5 prob 0.05 and token 6 prob 0.95; after node 6, token 7 has prob 0.5.
    tree = make_tree([0, 5, 6, 7], [-1, 0, 0, 1])
    probs = torch.full((4, 10), 1e-9)
    probs[0, 5], probs[0, 6] = 0.05, 0.95
    probs[1, 1] = 1.0  # after 5: the target wants 1, not 7
    probs[2, 7] = 0.5  # after 6: 7 is fine -> node 7 under 5 is chimeric (valid under the sibling path)
    probs[2, 1] = 0.5
    probs[3, 1] = 1.0
    logits = probs.log()
    labels, path_flags = label_proxy(tree, logits, eps=0.01, delta=0.1)
    assert labels[1:] == ["coherent", "coherent", "chimeric"]
    assert path_flags == [False, False, False, True]
    assert label_proxy(tree, logits, eps=0.1)[0][1] == "off_support"  # 0.05 < eps=0.1, nothing else at depth 1
    assert label_proxy(tree, logits, delta=0.6)[0][3] == "off_support"  # 0.5 < delta: not valid elsewhere


def test_proxy_rejects_bad_logits():
    tree = make_tree([0, 5], [-1, 0])
    with pytest.raises(ValueError, match="one row per tree node"):
        label_proxy(tree, torch.zeros(3, 10))


def test_hooks_on_tiny_target(tiny_llama):
    from graft_block.drafters.planted import PlantedTreeDrafter
    from graft_block.decoder import SpeculativeDecoder
    from graft_block.testing import hf_greedy

    target = tiny_llama
    prompt = [1, 5, 9, 17, 33]
    ref = hf_greedy(target, prompt, 24)
    assert SpeculativeDecoder(target).generate(prompt, max_new_tokens=24).tokens == ref
    hook, rec = proxy_hook(), futures_recorder(count=3)
    drafter = PlantedTreeDrafter(reference=ref, budget=10, vocab_size=128, seed=1)
    res = SpeculativeDecoder(target, drafter, round_hooks=[hook, rec]).generate(prompt, max_new_tokens=24)
    assert res.tokens == ref
    assert 0 < len(hook.rows) <= res.stats.rounds
    for row in hook.rows:
        d = row["draft"]
        assert d["coherent_n"] + d["chimeric_n"] + d["off_support_n"] + d["unreachable_n"] == d["n"]
    summ = hook.summary()["draft"]
    assert summ["rounds"] == len(hook.rows) and 0.0 <= summ["chimeric"] <= 1.0
    assert len(rec.records) == 3
    for context, tree, _ in rec.records:
        assert context[-1] == tree.root_token and context[: len(prompt)] == prompt
        done = len(context) - len(prompt)
        # greedy future from its own cache == the target's greedy continuation; T=0 sampler rows too
        futs = sample_futures(target, context, n=2, length=5, sampler=temperature_sampler(0.0))
        want = ref[done : done + 5]
        assert all(f[: len(want)] == want for f in futs)
    g = torch.Generator().manual_seed(0)
    futs = sample_futures(target, rec.records[0][0], n=8, length=4, generator=g)
    assert len(futs) == 9 and len({tuple(f) for f in futs[:8]}) > 1  # T=1 samples differ


def test_sampled_report_draws_futures_from_the_rounds_own_law(tiny_llama):
    """Protocol (a) samples at the evaluation's settings (mfd.md 3.2): at T=1 with top-k 1 every future is the
    greedy one, so a depth-1 sibling of the greedy token is off-support, never coherent."""
    from graft_block.drafters.planted import PlantedTreeDrafter
    from graft_block.decoder import SpeculativeDecoder
    from graft_block.sampling import SamplingConfig
    from graft_block.testing import hf_greedy

    target = tiny_llama
    prompt = [1, 5, 9, 17, 33]
    ref = hf_greedy(target, prompt, 24)
    rec = futures_recorder(count=3)
    drafter = PlantedTreeDrafter(reference=ref, budget=10, vocab_size=128, seed=1)
    res = SpeculativeDecoder(target, drafter, round_hooks=[rec]).generate(prompt, max_new_tokens=24,
                                                                          temperature=1.0, top_k=1)
    assert res.tokens == ref  # top-k 1 at T=1 decodes greedily
    assert len(rec.records) == 3 and all(r[2] == SamplingConfig(1.0, 1, 1.0) for r in rec.records)
    records = []
    for context, _, sampling in rec.records:
        done = len(context) - len(prompt)
        logits = target.model(input_ids=torch.tensor([context])).logits[0, -1]
        runners_up = [t for t in logits.topk(4).indices.tolist() if t != ref[done]][:3]  # T=1 futures would hold them
        records.append((context, from_paths(context[-1], [ref[done:done + 3]] + [[t] for t in runners_up]), sampling))
    got = sampled_report(target, records, n=32, length=5)["draft"]
    # 6 nodes: the greedy chain's 3 are coherent, the 3 runners-up off-support
    assert got["coherent"] == pytest.approx(0.5) and got["off_support"] == pytest.approx(0.5)
    assert got["chimeric"] == 0.0


def proxy_case():
    """Root -> 5 (P 0.05 at T=1) and 6 (0.95); after 6, token 7 has P 0.6; after 5 the target wants 1, not 7."""
    tree = make_tree([0, 5, 6, 7], [-1, 0, 0, 1])
    probs = torch.full((4, 10), 1e-9)
    probs[0, 5], probs[0, 6] = 0.05, 0.95
    probs[1, 1] = 1.0
    probs[2, 7], probs[2, 1] = 0.6, 0.4
    probs[3, 1] = 1.0
    return tree, probs.log()


def test_proxy_hook_scores_each_round_under_its_own_law():
    """Proxy (b) describes the futures (a) samples: the round's temperature / top-k / top-p, not T=1 always. Token 5
    (P 0.05 at T=1) is supported at T=1, but not at T=0.5 (P 0.003), top-k 1 or top-p 0.9 (outside the nucleus);
    a greedy round (or one of unknown law) scores at T=1, as (a) samples its futures there."""
    from types import SimpleNamespace

    from graft_block.sampling import SamplingConfig

    tree, logits = proxy_case()
    verified = SimpleNamespace(tree=tree, logits=logits)
    laws = {SamplingConfig(0.0): "coherent", SamplingConfig(1.0): "coherent", SamplingConfig(0.5): "off_support",
            SamplingConfig(1.0, top_k=1): "off_support", SamplingConfig(1.0, top_p=0.9): "off_support",
            SamplingConfig(2.0, top_k=2): "coherent"}
    for sampling, label in laws.items():
        hook = proxy_hook()
        hook(verified, SimpleNamespace(sampling=sampling))
        d = hook.rows[0]["draft"]
        assert (d["coherent_n"], d["off_support_n"], d["chimeric_n"]) == \
            ((2, 0, 1) if label == "coherent" else (1, 1, 1)), sampling  # node 7 stays chimeric: valid after 6
    hook = proxy_hook()
    hook(verified)  # no state: the T=1 law
    assert hook.rows[0]["draft"]["coherent_n"] == 2
    fixed = proxy_hook(temperature=1.0)  # an explicit temperature overrides the round's law
    fixed(verified, SimpleNamespace(sampling=SamplingConfig(1.0, top_k=1)))
    assert fixed.rows[0]["draft"]["coherent_n"] == 2


def test_proxy_witness_is_a_path_the_target_would_take():
    """"Valid elsewhere" needs a coherent other parent: after a junk node (10, 77) the target says JUNK, but no
    future goes through (10, 77), so JUNK at depth 3 under the coherent (10, 11) is off-support, as under (a)."""
    tree = from_paths(0, [A[:2] + [JUNK], [A[0], 77]])
    node = tree_paths(tree)[tuple(A[:2] + [JUNK])]
    assert label_sampled(tree, [A, B])[node] == "off_support"
    labels, flags = label_proxy(tree, mixture_logits(tree))
    assert labels[node] == "off_support" and not flags[node]
    assert labels == label_sampled(tree, [A, B])


def test_sampled_report_futures_reach_the_trees_depth(tiny_llama):
    """Futures shorter than the tree left its deeper nodes off-support whatever the target says: a greedy chain
    of depth 4 with length=2 futures is coherent all the way down."""
    from graft_block.testing import hf_greedy

    prompt = [1, 5, 9, 17, 33]
    ref = hf_greedy(tiny_llama, prompt, 5)
    tree = from_paths(ref[0], [ref[1:5]])  # the root is the first new token, the chain the next four
    got = sampled_report(tiny_llama, [(prompt + ref[:1], tree)], n=0, length=2)["draft"]
    assert got["n"] == 4 and got["coherent"] == 1.0


def test_chimeric_path_flag_needs_every_unsupported_step_on_the_path_valid_elsewhere():
    """A supported step under an off-support node is unreachable, and its path is not chimeric: the off-support
    step above it is valid nowhere, whatever its own step says."""
    tree = make_tree([0, 5, 6, 7], [-1, 0, 0, 1])  # 7 hangs under 5
    probs = torch.full((4, 10), 1e-9)
    probs[0, 5], probs[0, 6] = 0.05, 0.95
    probs[1, 7] = 1.0  # after 5 the target says 7: node 7's own step is supported
    probs[2, 1] = 1.0
    probs[3, 1] = 1.0
    labels, flags = label_proxy(tree, probs.log(), eps=0.1, delta=0.1)
    assert labels[1:] == ["off_support", "coherent", "unreachable"]
    assert flags == [False, False, False, False]
    assert proxy_shares(tree, probs.log(), eps=0.1)["draft"]["chimeric_path_n"] == 0


def test_proxy_temperature_reshapes_the_law():
    """label_proxy's ``temperature`` (ProxyHook(temperature=...)): token 5 has P 0.05 at T=1 (supported at
    eps=0.01) but 0.05^2 / (0.05^2 + 0.95^2) ~ 0.003 at T=0.5 (off-support)."""
    tree = make_tree([0, 5, 6], [-1, 0, 0])
    probs = torch.full((3, 10), 1e-9)
    probs[0, 5], probs[0, 6] = 0.05, 0.95
    probs[1, 1] = probs[2, 1] = 1.0
    logits = probs.log()
    assert label_proxy(tree, logits)[0][1:] == ["coherent", "coherent"]
    assert label_proxy(tree, logits, temperature=0.5)[0][1:] == ["off_support", "coherent"]
    assert label_proxy(tree, logits, temperature=2.0)[0][1:] == ["coherent", "coherent"]


def test_mean_rows_averages_over_rounds_that_have_the_groups_nodes():
    """A round without retrieved nodes does not dilute the retrieved shares (and its draft nodes still count)."""
    from graft_block.tree.chimeric import mean_rows

    drafted = from_paths(0, [A[:2]])  # 2 coherent draft nodes
    extra = with_sources(from_paths(0, [[A[0], 77]]), SOURCE_RETRIEVED)  # 1 off-support retrieved node
    rows = [sampled_shares(drafted, [A, B]), sampled_shares(merge(drafted, extra), [A, B])]
    got = mean_rows(rows, "retrieved")
    assert got["rounds"] == 1 and got["n"] == 1 and got["off_support"] == 1.0 and got["off_support_n"] == 1
    got = mean_rows(rows, "draft")
    assert got["rounds"] == 2 and got["n"] == 4 and got["coherent"] == 1.0
    assert mean_rows([rows[0]], "retrieved") == {"rounds": 0, "n": 0}


def test_sample_futures_last_row_is_the_greedy_continuation_of_the_context(tiny_llama):
    """With n sampled rows the extra row is the target's own greedy continuation, not argmax after a sample."""
    from graft_block.testing import hf_greedy

    prompt = [1, 5, 9, 17, 33]
    ref = hf_greedy(tiny_llama, prompt, 6)
    g = torch.Generator().manual_seed(0)
    futs = sample_futures(tiny_llama, prompt, n=4, length=6, generator=g)
    assert len(futs) == 5 and futs[-1] == ref
    assert any(f != ref for f in futs[:4])  # T=1 samples leave the greedy path


def test_futures_recorder_counts_every_from_first():
    """Rounds first, first + every, ... are recorded (count of them), each with the context before the round's
    accepted tokens and bonus; round 0 of a new generation restarts the count."""
    from types import SimpleNamespace

    tree = make_tree([3, 4], [-1, 0])
    rec = futures_recorder(count=2, every=2, first=1)
    for r in range(7):
        tokens = list(range(10 + r))
        rec(SimpleNamespace(tree=tree, accepted=1), SimpleNamespace(round=r + 1, tokens=tokens, sampling=None))
    assert [len(c) for c, _, _ in rec.records] == [9, 11]  # rounds 1 and 3: 11 and 13 tokens, 2 committed


def test_beam_futures_are_a_width_k_beam_search_over_the_targets_log_probs(tiny_llama):
    """Protocol (a)'s T = 0 beams (mfd.md 3.2): each step keeps the k best extensions of the k beams by summed
    log-prob, as a cache-free recomputation finds them, best first; one beam is the greedy continuation."""
    from graft_block.testing import hf_greedy

    prompt = [1, 5, 9, 17, 33]
    beams, scores = [[]], [0.0]
    for _ in range(3):
        cand = []
        for b, sc in zip(beams, scores):
            logp = torch.log_softmax(tiny_llama.model(input_ids=torch.tensor([prompt + b])).logits[0, -1], -1)
            cand += [(sc + float(logp[v]), b + [v]) for v in range(logp.numel())]
        cand.sort(key=lambda c: -c[0])
        scores, beams = [c[0] for c in cand[:3]], [c[1] for c in cand[:3]]
    assert beam_futures(tiny_llama, prompt, k=3, length=3) == beams
    assert beam_futures(tiny_llama, prompt, k=1, length=4) == [hf_greedy(tiny_llama, prompt, 4)]
    with pytest.raises(TreeError, match="k >= 1 beams"):
        beam_futures(tiny_llama, prompt, k=0)


def test_sampled_report_adds_the_top_beams_to_greedy_rounds_only(tiny_llama):
    """At T = 0 the second beam's path is a future of the round: coherent with beams, not wholly without them (the
    greedy future alone differs from it somewhere); a sampled round (T = 1, top-k 1) takes no beams."""
    from graft_block.sampling import SamplingConfig

    prompt = [1, 5, 9, 17, 33]
    second = beam_futures(tiny_llama, prompt, k=2, length=2)[1]
    tree = from_paths(prompt[-1], [second])
    greedy_round = [(prompt, tree, SamplingConfig(0.0, 0, 1.0))]
    assert sampled_report(tiny_llama, greedy_round, n=0, length=2, beams=2)["draft"]["coherent"] == 1.0
    assert sampled_report(tiny_llama, greedy_round, n=0, length=2, beams=0)["draft"]["coherent"] < 1.0
    sampled_round = [(prompt, tree, SamplingConfig(1.0, 1, 1.0))]
    assert sampled_report(tiny_llama, sampled_round, n=4, length=2, beams=2)["draft"]["coherent"] < 1.0
