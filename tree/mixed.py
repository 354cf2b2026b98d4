"""Mixed DDTree (Multi-Future Drafting): the top-``budget`` prefixes of M per-mode blocks of marginals.

Inputs are each mode's per-position top-K: ``top_ids[m, i, r]`` / ``top_logprobs[m, i, r]`` (position i = depth
i+1). Mode m scores a token path p = (x_1..x_d) by ``s_m(p) = sum_i log q_{m,i}(x_i)``, and ``-inf`` when some x_i
is outside mode m's top-K at depth i (the drafter proposes nothing there).

Scores (``score=``):
- ``"best_mode"`` (MFD's rule, default): ``max_m s_m(p)``. Mixture weights are not used.
- ``"mixture_uniform"`` (ablation): ``log mean_m exp(s_m(p))``, the prefix probability of a uniform mixture.
- ``"mixture_gated"`` (ablation): ``log sum_m w_m exp(s_m(p))`` with ``mode_weights`` w (e.g. the training gate).
Every ``s_m`` is non-increasing along a path (log-probs <= 0), hence so are their max and any mixture of them:
the top-B set is prefix-closed for all three rules (ties are broken parent-first), so it is a valid tree.

``best_mode`` is built with one merged best-first heap over (mode, rank tuple) entries and a trie keyed by
(parent node, token). A popped entry whose token path exists already (a higher-scoring mode made it) creates
nothing; either way it pushes its mode's next-rank sibling and rank-0 child, the child hanging under the trie
node. Pops come in non-increasing score order, so the first pop of a path carries its best-mode score and the
first ``budget`` distinct paths are exactly the top-B. Siblings are unique by construction; with M = 1 and finite
log-probs this is ``tree.ddtree.ddtree`` node for node (same heap items, same rank-tuple tie-break, same arithmetic).
A ``-inf`` log-prob (a token outside the mode's support) is never proposed, under every rule.
The mixture rules use a generic best-first search over the trie (each created node pushes all candidate
children: the union of the modes' top-K at the next depth), exact for any prefix-monotone score.

``Tree.modes`` (bit m = mode m) is the set of modes that propose a node: mode m proposes p iff
``s_m(p) >= s_min``, where ``s_min`` is the lowest best-mode score among the tree's nodes, i.e. mode m alone
rates the path at least as high as the weakest node that made the tree. Bits shrink along a path (a node's modes
are a subset of its parent's) and, under ``best_mode``, every node has at least one bit.
"""
from __future__ import annotations

import heapq
import math

import torch

from .ddtree import _proposable
from .tree import SOURCE_DRAFT, Tree, TreeError, make_tree

SCORES = ("best_mode", "mixture_uniform", "mixture_gated")
NEG_INF = float("-inf")


def _check_inputs(top_ids: torch.Tensor, top_logprobs: torch.Tensor, budget: int, score: str, mode_weights):
    if top_ids.dim() == 2:
        raise TreeError(
            f"mixed_ddtree needs per-mode top-k of shape [M, L, K], got {tuple(top_ids.shape)}: "
            "for a single block use tree.ddtree.ddtree or add a mode axis (top_ids[None])"
        )
    if top_ids.dim() != 3 or top_ids.shape != top_logprobs.shape:
        raise TreeError(
            f"top_ids {tuple(top_ids.shape)} and top_logprobs {tuple(top_logprobs.shape)} must both be [M, L, K]"
        )
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise TreeError(f"budget must be an int >= 0 (non-root nodes), got {budget!r}")
    if score not in SCORES:
        raise TreeError(f"unknown score {score!r}; choose one of {', '.join(SCORES)}")
    M = top_ids.shape[0]
    if score == "mixture_gated":
        if mode_weights is None:
            raise TreeError("score='mixture_gated' needs mode_weights (one weight per mode, e.g. the gate's softmax)")
        w = torch.as_tensor(mode_weights, dtype=torch.float64).reshape(-1)
        if w.numel() != M or bool((w < 0).any()) or float(w.sum()) <= 0:
            raise TreeError(f"mode_weights must be {M} non-negative numbers with a positive sum, got {w.tolist()}")
        return (w / w.sum()).tolist()
    if mode_weights is not None:
        raise TreeError(f"mode_weights are only used by score='mixture_gated', not {score!r}")
    return [1.0 / M] * M if M else []  # M = 0: no mode, the root-only tree (not a ZeroDivisionError)


def mixed_ddtree(
    root_token: int,
    top_ids: torch.Tensor,
    top_logprobs: torch.Tensor,
    budget: int,
    score: str = "best_mode",
    mode_weights=None,
) -> Tree:
    """Top-``budget`` token prefixes of M modes' top-K marginals under ``score`` (see module doc).

    ``top_ids`` / ``top_logprobs``: [M, L, K]. Returns a Tree (sources DRAFT, ``scores`` = the rule's score of
    each path, ``modes`` = bit set of proposing modes) in pop order, which is topological.
    """
    weights = _check_inputs(top_ids, top_logprobs, budget, score, mode_weights)
    M, L, K = top_ids.shape
    ids = top_ids.tolist()
    lps = top_logprobs.double().tolist()
    if L == 0 or K == 0 or budget < 1 or M == 0:
        # the root's bits as proposing_modes and conditional_mixed_ddtree give them: every mode
        return make_tree([int(root_token)], [-1], [0.0], SOURCE_DRAFT, [(1 << M) - 1])
    if score == "best_mode":
        tokens, parents, scores = _best_mode_heap(root_token, ids, lps, budget, M, L, K)
    else:
        tokens, parents, scores = _mixture_best_first(root_token, ids, lps, budget, M, L, weights)
    modes = proposing_modes(tokens, parents, ids, lps)
    return make_tree(tokens, parents, scores, SOURCE_DRAFT, modes)


def _trie_node(child: dict, tokens: list, parents: list, scores: list, parent: int, tok: int, score: float) -> int:
    """The node of token path (parent's path, tok), created with ``score`` on its first pop: pops come in
    non-increasing score order, so the first one carries the path's best-mode score."""
    node = child.get((parent, tok))
    if node is None:
        node = len(tokens)
        child[(parent, tok)] = node
        tokens.append(tok)
        parents.append(parent)
        scores.append(score)
    return node


def _best_mode_heap(root_token, ids, lps, budget, M, L, K):
    tokens, parents, scores = [int(root_token)], [-1], [0.0]
    child: dict[tuple[int, int], int] = {}
    # heap item: (-score, rank tuple, mode, parent node, depth (1-based), rank); ranks first so M = 1 ties == DDTree
    # a -inf log-prob is a token the mode does not propose: never pushed (popped, it became a node and s - lps gave NaN)
    heap = [(-lps[m][0][0], (0,), m, 0, 1, 0) for m in range(M) if _proposable(lps[m][0][0])]
    heapq.heapify(heap)
    while heap and len(tokens) - 1 < budget:
        neg, ranks, m, parent, depth, rank = heapq.heappop(heap)
        s = -neg
        node = _trie_node(child, tokens, parents, scores, parent, ids[m][depth - 1][rank], s)
        if rank + 1 < K:  # mode m's next sibling; scores below float32's range (ddtree's rule) are not proposed
            s2 = s - lps[m][depth - 1][rank] + lps[m][depth - 1][rank + 1]
            if _proposable(s2):
                heapq.heappush(heap, (-s2, ranks[:-1] + (rank + 1,), m, parent, depth, rank + 1))
        if depth < L and _proposable(s + lps[m][depth][0]):  # mode m's first child, under the (shared) trie node
            heapq.heappush(heap, (-(s + lps[m][depth][0]), ranks + (0,), m, node, depth + 1, 0))
    return tokens, parents, scores


def conditional_mixed_ddtree(root_token: int, expand, budget: int, max_depth: int, modes: int) -> Tree:
    """``best_mode`` tree of M modes whose children depend on the parent's token (MFD modes under a Markov head):
    ``expand(mode, depth, token)`` -> (ids, logprobs), mode m's top-K children at ``depth`` (1-based) under a
    node of ``token``, sorted by log-prob. A path's score is max over modes of that mode's summed conditional
    log-probs; the heap is ``_best_mode_heap``'s with children fetched per (mode, node) when first needed, so
    with M = 1 it is ``tree.ddtree.conditional_ddtree`` node for node. ``Tree.modes``: the modes whose own entry
    for the node was popped, i.e. that rate the path at least as high as the weakest node that made the tree."""
    if not isinstance(modes, int) or isinstance(modes, bool) or modes < 1:
        raise TreeError(f"modes must be an int >= 1, got {modes!r}")
    tokens, parents, scores, bits = [int(root_token)], [-1], [0.0], [(1 << modes) - 1]
    if budget < 1 or max_depth < 1:
        return make_tree(tokens, parents, scores, SOURCE_DRAFT, bits)
    child: dict[tuple[int, int], int] = {}
    kids = {(m, 0): expand(m, 1, int(root_token)) for m in range(modes)}
    heap = [(-kids[(m, 0)][1][0], m, m, 0, 1, 0) for m in range(modes)
            if len(kids[(m, 0)][0]) and _proposable(kids[(m, 0)][1][0])]  # -inf: not proposed (as in the heap above)
    heapq.heapify(heap)  # (-score, pop-order tiebreak, mode, parent node, depth, rank)
    seq = modes
    floor = None  # once the tree is full: its weakest node's score; entries tied with it only add their mode's bit
    while heap:
        if floor is None and len(tokens) - 1 >= budget:
            floor, inner = min(scores[1:]), set(parents)
        if floor is not None and -heap[0][0] < floor:
            break
        neg, _, m, parent, depth, rank = heapq.heappop(heap)
        s = -neg
        ids, lps = kids[(m, parent)]
        tok = int(ids[rank])
        node = _trie_node(child, tokens, parents, scores, parent, tok, s) if floor is None else \
            child.get((parent, tok))
        if node == len(bits):
            bits.append(0)
        if node is not None:
            bits[node] |= 1 << m
        if rank + 1 < len(ids) and _proposable(s - lps[rank] + lps[rank + 1]):  # mode m's next sibling
            heapq.heappush(heap, (-(s - lps[rank] + lps[rank + 1]), seq, m, parent, depth, rank + 1))
            seq += 1
        # mode m's first child: never under the last node, nor, once full, under a node without children in the tree
        if node is not None and depth < max_depth and (len(tokens) - 1 < budget if floor is None else node in inner):
            if (m, node) not in kids:
                kids[(m, node)] = expand(m, depth + 1, tok)
            k_ids, k_lps = kids[(m, node)]
            if len(k_ids) and _proposable(s + k_lps[0]):
                heapq.heappush(heap, (-(s + k_lps[0]), seq, m, node, depth + 1, 0))
                seq += 1
    return make_tree(tokens, parents, scores, SOURCE_DRAFT, bits)


def _logmix(vals, logw):
    terms = [v + lw for v, lw in zip(vals, logw) if v != NEG_INF and lw != NEG_INF]
    if not terms:
        return NEG_INF
    top = max(terms)
    return top + math.log(sum(math.exp(t - top) for t in terms))


def _mixture_best_first(root_token, ids, lps, budget, M, L, weights):
    logw = [math.log(w) if w > 0 else NEG_INF for w in weights]
    lookup = [[dict(zip(ids[m][i], lps[m][i])) for i in range(L)] for m in range(M)]
    tokens, parents, scores = [int(root_token)], [-1], [0.0]
    per_mode = [[0.0] * M]  # s_m of each created node
    heap: list = []
    counter = 0

    def push_children(node, depth):
        nonlocal counter
        if depth >= L:
            return
        cand = {t for m in range(M) if per_mode[node][m] != NEG_INF for t in ids[m][depth]}
        for t in sorted(cand):
            vals = [
                per_mode[node][m] + lookup[m][depth][t] if t in lookup[m][depth] else NEG_INF for m in range(M)
            ]
            s = _logmix(vals, logw)
            if s == NEG_INF:
                continue
            counter += 1
            heapq.heappush(heap, (-s, depth + 1, counter, node, t, vals))

    push_children(0, 0)
    while heap and len(tokens) - 1 < budget:
        neg, depth, _, parent, tok, vals = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(tok)
        parents.append(parent)
        scores.append(-neg)
        per_mode.append(vals)
        push_children(node, depth)
    return tokens, parents, scores


def mode_path_scores(tokens, parents, ids: list, lps: list) -> list[list[float]]:
    """``s_m`` of every node's token path ([n][M], -inf outside mode m's top-K); ``ids``/``lps`` are the nested
    lists of ``top_ids``/``top_logprobs`` [M][L][K]. One pass in topological order."""
    M, L = len(ids), len(ids[0])
    out = [[0.0] * M]
    depth = [0]
    for i in range(1, len(tokens)):
        p, t = parents[i], tokens[i]
        d = depth[p]
        depth.append(d + 1)
        row = []
        for m in range(M):
            prev = out[p][m]
            if prev == NEG_INF or d >= L:
                row.append(NEG_INF)
                continue
            try:
                row.append(prev + lps[m][d][ids[m][d].index(t)])
            except ValueError:  # not in mode m's top-K at this depth
                row.append(NEG_INF)
        out.append(row)
    return out


def proposing_modes(tokens, parents, ids: list, lps: list) -> list[int]:
    """Bit set per node: mode m proposes p iff s_m(p) >= the lowest best-mode score among the tree's nodes."""
    M = len(ids)
    if len(tokens) == 1:
        return [(1 << M) - 1]
    per_mode = mode_path_scores(tokens, parents, ids, lps)
    floor = min(max(row) for row in per_mode[1:])
    return [sum(1 << m for m in range(M) if row[m] >= floor) for row in per_mode]


def path_score(path, top_ids: torch.Tensor, top_logprobs: torch.Tensor, score: str = "best_mode", mode_weights=None):
    """The rule's score of one token path (tests and analysis)."""
    weights = _check_inputs(top_ids, top_logprobs, 0, score, mode_weights)
    M, L, _ = top_ids.shape
    if len(path) > L:
        return NEG_INF
    ids, lps = top_ids.tolist(), top_logprobs.double().tolist()
    vals = []
    for m in range(M):
        s = 0.0
        for i, t in enumerate(path):
            row = ids[m][i]
            if t not in row:
                s = NEG_INF
                break
            s += lps[m][i][row.index(t)]
        vals.append(s)
    if score == "best_mode":
        return max(vals)
    return _logmix(vals, [math.log(w) if w > 0 else NEG_INF for w in weights])


def brute_force_mixed(
    top_ids: torch.Tensor, top_logprobs: torch.Tensor, budget: int, score: str = "best_mode", mode_weights=None
) -> dict[tuple, float]:
    """Reference for tests: enumerate every path in some mode's top-K support, score it, keep the ``budget`` best
    (ties: shorter first). Returns {token path: score}."""
    M, L, K = top_ids.shape
    paths: set[tuple] = set()

    def rec(m, depth, prefix):
        if depth == L:
            return
        for r in range(K):
            p = prefix + (int(top_ids[m, depth, r]),)
            paths.add(p)
            rec(m, depth + 1, p)

    for m in range(M):
        rec(m, 0, ())
    scored = [(path_score(p, top_ids, top_logprobs, score, mode_weights), p) for p in paths]
    scored = [(s, p) for s, p in scored if s != NEG_INF]
    scored.sort(key=lambda sp: (-sp[0], len(sp[1])))
    return {p: s for s, p in scored[:budget]}


def tree_paths(tree: Tree) -> dict[tuple, int]:
    """{token path (root excluded): node index} of every non-root node."""
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    paths: list[tuple] = [()]
    out = {}
    for i in range(1, len(toks)):
        p = paths[pars[i]] + (toks[i],)
        paths.append(p)
        out[p] = i
    return out
