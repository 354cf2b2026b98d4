"""DDTree: the best-first heap that picks the ``budget`` highest-probability prefixes of a block's per-position
marginals (product of marginals = the surrogate joint). Pure function of top-K tensors; nodes come out in pop
order, which is topological. A log-prob of -inf (a token the drafter gives probability 0) is never proposed, nor is
a path whose score would not fit the tree's float32 scores: ``Tree.scores`` stay finite."""
from __future__ import annotations

import heapq
import math

import torch

from .tree import SOURCE_DRAFT, Tree, TreeError, make_tree

# The lowest score a node may carry: below it (-inf, NaN, or a float32 overflow of finite -3e38 log-probs) it is
# not proposed, so Tree.scores stay finite and a sibling's score never becomes -inf - (-inf) = NaN.
_LOWEST = float(torch.finfo(torch.float32).min)


def _proposable(score: float) -> bool:
    return score >= _LOWEST  # False for -inf and NaN


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, V] raw draft logits -> (ids [L, K], log-probs [L, K]) with K = min(k, V); log-softmax over the full
    vocabulary in fp32 (no temperature), on the CPU."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    vals, ids = lp.topk(min(int(k), lp.shape[-1]), dim=-1)
    return ids.cpu(), vals.cpu()


def ddtree(root_token: int, top_ids: torch.Tensor, top_logprobs: torch.Tensor, budget: int) -> Tree:
    """Top-``budget`` prefixes by summed log-prob, depth <= L (rows of ``top_ids``).

    Each rank tuple has one generator (its previous sibling, or its parent for a first child), so the heap never
    produces a duplicate; ties are broken by the rank tuple, as in the reference. Each row of ``top_logprobs``
    must be sorted best first (as ``topk_logprobs`` returns it): the heap only reaches rank r + 1 through rank r.
    Inputs may live on any device and in any float dtype; the tree is built on the CPU.
    """
    if top_ids.dim() != 2 or top_logprobs.shape != top_ids.shape:
        raise TreeError(f"ddtree needs top_ids and top_logprobs of one shape [L, K], got {tuple(top_ids.shape)} and "
                        f"{tuple(top_logprobs.shape)}")
    L, K = top_ids.shape
    lp = top_logprobs.detach().double().cpu()
    if K > 1 and not bool((lp[:, 1:] <= lp[:, :-1]).all()):  # NaN compares False: refused too
        raise TreeError("ddtree needs each row of top_logprobs sorted best first and NaN-free (as topk_logprobs "
                        "returns them): sort ids and log-probs together, or check the drafter's logits for NaN")
    ids = top_ids.tolist()
    lps = lp.tolist()
    tokens, parents, scores = [int(root_token)], [-1], [0.0]
    if L == 0 or K == 0 or budget < 1 or not _proposable(lps[0][0]):
        return make_tree(tokens, parents, scores, SOURCE_DRAFT)
    # heap item: (-score, rank tuple, parent node, depth (1-based), rank); every pushed score is proposable
    heap = [(-lps[0][0], (0,), 0, 1, 0)]
    while heap and len(tokens) - 1 < budget:
        neg, ranks, parent, depth, rank = heapq.heappop(heap)
        score = -neg
        node = len(tokens)
        tokens.append(ids[depth - 1][rank])
        parents.append(parent)
        scores.append(score)
        if rank + 1 < K:  # next sibling (the reference's arithmetic, so the M = 1 mixed tree matches bit for bit)
            s = score - lps[depth - 1][rank] + lps[depth - 1][rank + 1]
            if _proposable(s):  # rows are sorted: past a -inf entry every later sibling is -inf too
                heapq.heappush(heap, (-s, ranks[:-1] + (rank + 1,), parent, depth, rank + 1))
        if depth < L and _proposable(score + lps[depth][0]):  # first child
            heapq.heappush(heap, (-(score + lps[depth][0]), ranks + (0,), node, depth + 1, 0))
    return make_tree(tokens, parents, scores, SOURCE_DRAFT)


def brute_force_top_prefixes(top_ids: torch.Tensor, top_logprobs: torch.Tensor, budget: int) -> set[tuple]:
    """Reference for tests: enumerate every prefix (rank paths) and keep the ``budget`` best token paths; a prefix
    that is not proposable (a -inf log-prob on it) is left out with its extensions, as in ``ddtree``."""
    L, K = top_ids.shape
    items = []

    def rec(depth, ranks, score):
        if depth == L:
            return
        for r in range(K):
            s = score + float(top_logprobs[depth, r])
            if not _proposable(s):
                continue
            rk = ranks + (r,)
            items.append((-s, rk))
            rec(depth + 1, rk, s)

    rec(0, (), 0.0)
    items.sort()
    return {tuple(int(top_ids[d, r]) for d, r in enumerate(rk)) for _, rk in items[:budget]}


def conditional_ddtree(root_token: int, expand, budget: int, max_depth: int) -> tuple[Tree, list[float] | None]:
    """Best-first tree whose children come from each node's *own* distribution (a Markov-corrected block: the
    distribution at depth d depends on the parent's token), not from one marginal per depth.

    ``expand(depth, tokens, prefix)`` -> one ``(ids, logprobs, confidence)`` per parent token: the top-K children
    at ``depth`` (1-based) sorted by log-prob, and the drafter's estimate of P(its top child is accepted) (None if
    it has none). The first token is the one needed now; the others are that node's later siblings, passed so that
    the drafter can compute their children in the same product (they are the likeliest next expansions).
    ``prefix``: the tokens' common parent's path from the root, root token included (() for the root itself), so
    ``prefix + (token,)`` names a node: a drafter whose distributions read the whole path (DSpark's RNN head) keys
    its state by it.
    Returns the tree (nodes in pop order, so topological) and, when confidences exist, each node's estimated
    acceptance given its parent: c for a parent's top child, (1 - c) q(x) / (1 - q(top)) for the others.
    With K = 1 children per node this is the greedy chain. A child whose log-prob is -inf is never proposed (nor
    passed to ``expand`` as a sibling), and an empty ``ids`` list means no children. ``drafters/dspark/c_walk.py``
    is this walk in C over DSpark's vanilla expander: change both (``tests/test_dspark.py`` pins them equal)."""
    tokens, parents, scores, accept = [int(root_token)], [-1], [0.0], [1.0]
    if budget < 1 or max_depth < 1:
        return make_tree(tokens, parents, scores, SOURCE_DRAFT), None
    kids = {0: expand(1, [int(root_token)], ())[0]}
    paths = [(int(root_token),)]
    has_conf = kids[0][2] is not None
    heap = []  # (-score, pop-order tiebreak, parent node, depth, rank)
    if len(kids[0][0]) and _proposable(kids[0][1][0]):
        heap.append((-kids[0][1][0], 0, 0, 1, 0))
    seq = 1
    rest: dict[int, float] = {}  # parent node -> 1 - q(its top child), for its other children's estimates
    while heap and len(tokens) - 1 < budget:
        neg, _, parent, depth, rank = heapq.heappop(heap)
        ids, lps, conf = kids[parent]
        node = len(tokens)
        tokens.append(int(ids[rank]))
        parents.append(parent)
        scores.append(-neg)
        paths.append(paths[parent] + (int(ids[rank]),))
        if has_conf:
            c = float(conf)
            if rank == 0:
                accept.append(c)
            else:
                if parent not in rest:  # q(top) ~ 1 rounds lps[0] to 0: the siblings' mass floors 1 - q(top)
                    rest[parent] = max(1e-12, -math.expm1(lps[0]), math.fsum(math.exp(v) for v in lps[1:]))
                accept.append((1.0 - c) * math.exp(lps[rank]) / rest[parent])
        if rank + 1 < len(ids) and _proposable(scores[parent] + lps[rank + 1]):  # next sibling; rows are sorted
            heapq.heappush(heap, (-(scores[parent] + lps[rank + 1]), seq, parent, depth, rank + 1))
            seq += 1
        if depth < max_depth and len(tokens) - 1 < budget:  # first child, from its own distribution (the
            # budget's last node is never expanded: its children could not join the tree)
            later = [int(t) for t, v in zip(ids[rank + 1:], lps[rank + 1:]) if _proposable(scores[parent] + v)]
            kids[node] = expand(depth + 1, [int(ids[rank])] + later, paths[parent])[0]
            k_ids, k_lps = kids[node][0], kids[node][1]
            if len(k_ids) and _proposable(scores[node] + k_lps[0]):
                heapq.heappush(heap, (-(scores[node] + k_lps[0]), seq, node, depth + 1, 0))
                seq += 1
    return make_tree(tokens, parents, scores, SOURCE_DRAFT), (accept if has_conf else None)
