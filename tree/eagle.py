"""EAGLE-2 dynamic trees as pure functions: beam expansion over cumulative log-probs, then a global rerank.

Expansion (EAGLE-2): the root step gives the top-k children of the root; each of ``depth`` further levels runs
the draft once over the whole frontier (k nodes), takes the top-k children of every frontier node (k*k
candidates, score = parent score + child log-prob) and keeps the global top-k of those as the next frontier.
Every candidate is recorded with its parent, so the pool has k + depth*k*k nodes and the deepest node sits at
depth ``depth + 1``. Rerank: the global top-``budget`` of the pool by score (budget = total_tokens - 1 non-root
nodes), in candidate order, which is BFS order. A child never outscores its parent (log-probs <= 0) and a stable
sort puts the parent first on ties, so the selection is ancestor-closed.

The draft itself is a callback (``child_fn``), so everything here is testable without a model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .tree import SOURCE_DRAFT, Tree, TreeError, make_tree

# EAGLE's total_token=-1 auto-tune: verify lengths and the expected-acceptance weights it divides by.
EAGLE_AUTO_SIZES = (40, 48, 50, 56, 60)
EAGLE_AUTO_WEIGHTS = (1.0, 1.05, 1.07, 1.1, 1.13)


@dataclass(frozen=True)
class Candidates:
    """Every node an expansion proposed, in the order it was recorded (level by level).

    ``parents[i]`` is a candidate index (< i) or -1 for a child of the root; ``tokens`` are target ids;
    ``frontiers[j]`` are the frontier's cumulative log-probs after level j+1 was drafted (j = 0 is the root step);
    ``frontier_logmass`` / ``frontier_max`` summarise them (the signals Graft's pruning checkpoints read), on demand
    because a logsumexp per level costs more than the level's bookkeeping."""

    tokens: torch.Tensor  # int64 [P]
    parents: torch.Tensor  # int64 [P]
    scores: torch.Tensor  # float32 [P]
    depths: torch.Tensor  # int64 [P], 1-based
    frontiers: tuple  # float32 [F_j] per drafted level

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    @property
    def frontier_logmass(self) -> torch.Tensor:
        return torch.stack([torch.logsumexp(f, 0) for f in self.frontiers]).float()

    @property
    def frontier_max(self) -> torch.Tensor:
        return torch.stack([f.max() for f in self.frontiers]).float()


def map_draft_ids(draft_ids: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
    """Draft-vocabulary ids -> target ids: ``target = draft + d2t[draft]`` (d2t holds offsets)."""
    if d2t is None:
        return draft_ids
    return draft_ids + d2t.to(draft_ids.device)[draft_ids]


def top_children(parent_scores: torch.Tensor, child_logprobs: torch.Tensor, top_k: int):
    """[F] parent scores, [F, V] child log-probs -> (draft ids [F, k], cumulative scores [F, k])."""
    k = min(int(top_k), child_logprobs.shape[-1])
    lp, ids = child_logprobs.float().topk(k, dim=-1)
    return ids, parent_scores.float().view(-1, 1) + lp


def select_frontier(cum_scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Flat indices of the global top-k of the [F, k] (or flat) candidate scores (stable: earlier index wins ties)."""
    flat = cum_scores.reshape(-1)
    order = torch.sort(flat, descending=True, stable=True).indices
    return order[: min(int(top_k), flat.numel())]


def next_tree_mask(prev_mask: torch.Tensor, parent_slot: torch.Tensor) -> torch.Tensor:
    """Draft-side tree mask for a new frontier: bool [F, n_prev + F], row = parent's row, then self (identity)."""
    f = parent_slot.numel()
    inherited = prev_mask[parent_slot.to(prev_mask.device)]
    return torch.cat([inherited, torch.eye(f, dtype=torch.bool, device=prev_mask.device)], dim=1)


def frontier_is_dead(scores, frontier_scores: torch.Tensor, budget: int) -> bool:
    """True when no descendant of the frontier can make the top ``budget`` of the candidates (``scores``: a tensor
    or list of the candidates' scores; the best ``budget`` of them decide it as well as all do).

    A descendant scores at most its frontier ancestor (log-probs <= 0, and float addition of a non-positive term
    never rounds up) and is recorded after every current candidate, so the stable rerank puts every current
    candidate scoring >= the best frontier score ahead of it: ``budget`` of those leave it no room."""
    top = float(frontier_scores.max())
    return sum(s >= top for s in (scores.tolist() if torch.is_tensor(scores) else scores)) >= budget


def expand(
    root_logprobs: torch.Tensor,
    child_fn: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor],
    depth: int,
    top_k: int,
    d2t: torch.Tensor | None = None,
    stop_fn: Callable[[int, torch.Tensor], bool] | None = None,
    budget: int | None = None,
) -> Candidates:
    """EAGLE-2 expansion. ``root_logprobs`` [V_draft] is the draft's log-softmax at the root.

    ``child_fn(level, frontier_tokens [F] target ids, parent_slot [F]) -> log-probs [F, V_draft]`` runs the
    draft once over the frontier of ``level`` (1-based tree depth of the frontier nodes); ``parent_slot`` indexes
    the previous call's frontier (all 0 = the root for level 1). ``stop_fn(level, frontier_scores)`` may end the
    expansion early (pruning checkpoints); ``level`` there is the number of drafted levels so far.

    ``budget``: the size ``rerank`` will keep. The expansion then stops as soon as no frontier node can place a
    descendant in that top ``budget`` (``frontier_is_dead``), so the reranked tree is the one the full expansion
    gives, for fewer draft forwards.
    """
    if depth < 0 or top_k < 1:
        raise TreeError(f"EAGLE expansion needs depth >= 0 and top_k >= 1, got depth={depth}, top_k={top_k}")
    dev = root_logprobs.device
    ids, cum = top_children(torch.zeros(1, device=dev), root_logprobs.view(1, -1), top_k)
    ids, cum = ids[0], cum[0]
    tokens = [map_draft_ids(ids, d2t)]
    parents = [torch.full_like(ids, -1)]
    scores = [cum]
    frontier = torch.arange(ids.numel(), device=dev)  # candidate indices of the current frontier
    frontier_tokens = tokens[0]
    parent_slot = torch.zeros_like(frontier)
    offset = ids.numel()
    frontiers = [cum]
    # the best ``budget`` scores so far, as Python floats (float32 values, compared exactly): the dead-frontier
    # test reads these, not a concatenation of every candidate each level
    best = sorted(cum.tolist(), reverse=True)[:budget] if budget is not None else []
    for level in range(1, depth + 1):
        if stop_fn is not None and stop_fn(level, frontiers[-1]):
            break
        if budget is not None and frontier_is_dead(best, frontiers[-1], budget):
            break
        child_lp = child_fn(level, frontier_tokens, parent_slot)
        c_ids, c_cum = top_children(frontiers[-1], child_lp, top_k)  # [F, k]
        k = c_ids.shape[1]
        level_scores = c_cum.reshape(-1)
        tokens.append(map_draft_ids(c_ids.reshape(-1), d2t))
        parents.append(frontier.repeat_interleave(k))
        scores.append(level_scores)
        pick = select_frontier(level_scores, top_k)
        parent_slot = pick // k
        frontier = offset + pick
        frontier_tokens = tokens[-1][pick]
        frontiers.append(level_scores[pick])
        offset += level_scores.numel()
        if budget is not None:
            best = sorted(best + level_scores.tolist(), reverse=True)[:budget]
    sizes = torch.tensor([t.numel() for t in tokens])
    return Candidates(
        tokens=torch.cat(tokens).long().cpu(),
        parents=torch.cat(parents).long().cpu(),
        scores=torch.cat(scores).float().cpu(),
        depths=torch.arange(1, len(tokens) + 1).repeat_interleave(sizes),
        frontiers=tuple(f.float().cpu() for f in frontiers),
    )


def rerank(cands: Candidates, root_token: int, budget: int) -> Tree:
    """The top-``budget`` candidates by cumulative log-prob as a Tree (root + BFS order, scores kept)."""
    if budget < 0:
        raise TreeError(f"budget must be >= 0, got {budget}")
    if bool(torch.isnan(cands.scores).any()):
        raise TreeError("EAGLE candidate scores contain NaN: the draft produced NaN log-probs (check its dtype)")
    order = torch.sort(cands.scores, descending=True, stable=True).indices
    keep = order[: min(int(budget), cands.size)].sort().values
    remap = torch.full((cands.size,), -1, dtype=torch.long)
    remap[keep] = torch.arange(1, keep.numel() + 1)
    par = cands.parents[keep]
    new_par = torch.where(par >= 0, remap[par.clamp(min=0)], torch.zeros_like(par))
    if bool((new_par < 0).any()):
        raise TreeError("EAGLE rerank is not ancestor-closed: a selected node's parent was dropped (NaN scores?)")
    tokens = torch.cat([torch.tensor([int(root_token)]), cands.tokens[keep]])
    parents = torch.cat([torch.tensor([-1]), new_par])
    scores = torch.cat([torch.zeros(1), cands.scores[keep]])
    return make_tree(tokens, parents, scores, SOURCE_DRAFT)


def eagle_tree(
    root_token: int,
    root_logprobs: torch.Tensor,
    child_fn: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor],
    budget: int,
    depth: int = 7,
    top_k: int = 10,
    d2t: torch.Tensor | None = None,
    stop_fn=None,
) -> tuple[Tree, Candidates]:
    """Expansion + rerank in one call. Returns (tree, all candidates): the whole pool, so no budget stop here
    (``expand(..., budget=)`` gives the same tree for fewer forwards)."""
    cands = expand(root_logprobs, child_fn, depth, top_k, d2t, stop_fn)
    return rerank(cands, root_token, budget), cands


# ---- reference --------------------------------------------------------------------------------------------
def brute_force_eagle(
    logprob_fn: Callable[[tuple], torch.Tensor], depth: int, top_k: int, budget: int, d2t=None
) -> list[tuple]:
    """Plain-Python EAGLE-2 for tests: ``logprob_fn(path of target ids) -> [V_draft]`` log-probs of the children.
    Returns the selected token paths in BFS (candidate) order."""
    def to_target(i):
        return int(i) + (int(d2t[int(i)]) if d2t is not None else 0)

    pool = []  # (score, path) in record order

    def kids(path, score):
        lp = logprob_fn(path).tolist()
        ranked = sorted(range(len(lp)), key=lambda i: (-lp[i], i))[: min(top_k, len(lp))]
        return [(score + lp[i], path + (to_target(i),)) for i in ranked]

    level = kids((), 0.0)
    pool.extend(level)
    frontier = level
    for _ in range(depth):
        level = [c for s, p in frontier for c in kids(p, s)]
        pool.extend(level)
        ranked = sorted(range(len(level)), key=lambda i: (-level[i][0], i))[:top_k]
        frontier = [level[i] for i in ranked]
    chosen = sorted(sorted(range(len(pool)), key=lambda i: (-pool[i][0], i))[:budget])
    return [pool[i][1] for i in chosen]


# ---- budget auto-tune ------------------------------------------------------------------------------------
def auto_weight(size: int) -> float:
    """Expected-acceptance weight of a verify size; matches EAGLE's table (40->1 ... 60->1.13) at its sizes."""
    return 1.0 + 0.22 * math.log2(size / 40.0)


def pick_auto_size(times: dict[int, float], weights: dict[int, float] | None = None) -> int:
    """EAGLE's rule: argmin over sizes of verify_time / weight (total tokens verified, root included)."""
    if not times:
        raise TreeError("auto budget needs at least one timed size")
    if weights is None:
        table = dict(zip(EAGLE_AUTO_SIZES, EAGLE_AUTO_WEIGHTS))
        weights = {s: table.get(s, auto_weight(s)) for s in times}
    return min(times, key=lambda s: (times[s] / weights[s], s))


def paths_in_order(tree: Tree) -> list[tuple]:
    """Root-excluded token path of every non-root node, in node order (for comparisons in tests)."""
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    out: list[tuple] = [()]
    for i in range(1, len(toks)):
        out.append(out[pars[i]] + (toks[i],))
    return out[1:]


__all__: Sequence[str] = (
    "Candidates", "frontier_is_dead", "map_draft_ids", "top_children", "select_frontier", "next_tree_mask", "expand",
    "rerank", "eagle_tree", "brute_force_eagle", "auto_weight", "pick_auto_size", "paths_in_order", "EAGLE_AUTO_SIZES",
    "EAGLE_AUTO_WEIGHTS",
)
