"""Retrieval templates: static trees of candidate *ranks* expanded through an adjacency matrix (Token Recycling).

A template is a list of rank paths in priority order, e.g. ``[[0], [1], [0, 0], [0, 1], ...]``: the path ``[0, 1]``
is the rank-1 successor of the rank-0 successor of the root. Every path's prefix appears earlier in the list, so
template order is topological and truncating a template keeps a valid (prefix-closed) tree of its best nodes.

Expansion gathers one level at a time, ``tok[node] = M[tok[parent(node)], rank(node)]``, on the matrix's device,
then trie-deduplicates on the CPU (a duplicate sibling is identified with the first one and its children continue
under it), so no verification slot is spent on a duplicate. Entries < 0 in the matrix mean "unknown" (a row never
written) and drop that node with its subtree.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

import torch

from .tree import SOURCE_RETRIEVED, Tree, TreeError, make_tree

# Token Recycling's static "2.2.2" template has 80 nodes with level sizes 8/21/25/15/8/3. The published list was
# not available to us, so this is a reconstruction with exactly those level sizes: level by level, the best
# children (ranks 0..7) of the previous level under the rank prior of ``asymmetric_template`` (step_cost 0.3,
# rank_decay 0.7), ties by rank path. Shallow levels are wide, deep levels thin out to rank-0/1 chains.
TR80_TEMPLATE: list[list[int]] = [
    [0], [1], [2], [3], [4], [5], [6], [7],
    [0, 0], [0, 1], [0, 2], [0, 3], [0, 4], [0, 5], [0, 6], [0, 7], [1, 0], [1, 1], [1, 2], [1, 3], [2, 0], [2, 1],
    [2, 2], [3, 0], [3, 1], [4, 0], [5, 0], [6, 0], [7, 0],
    [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 3], [0, 0, 4], [0, 0, 5], [0, 1, 0], [0, 1, 1], [0, 1, 2], [0, 2, 0],
    [0, 2, 1], [0, 3, 0], [0, 4, 0], [0, 5, 0], [1, 0, 0], [1, 0, 1], [1, 0, 2], [1, 1, 0], [1, 2, 0], [2, 0, 0],
    [2, 0, 1], [2, 1, 0], [3, 0, 0], [4, 0, 0], [5, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 3], [0, 0, 1, 0], [0, 0, 1, 1], [0, 0, 2, 0], [0, 0, 3, 0],
    [0, 1, 0, 0], [0, 1, 0, 1], [0, 1, 1, 0], [0, 2, 0, 0], [0, 3, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0],
    [0, 0, 0, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 1, 0], [0, 0, 0, 2, 0], [0, 0, 1, 0, 0],
    [0, 1, 0, 0, 0], [1, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 1, 0],
]


def rank_logprior(rank: int, step_cost: float = 0.3, rank_decay: float = 0.7) -> float:
    """Prior log-weight of taking the rank-``rank`` successor: ``-step_cost - rank_decay * log(1 + rank)``."""
    return -step_cost - rank_decay * math.log1p(rank)


def asymmetric_template(n_nodes: int, depth: int = 8, width: int = 8, step_cost: float = 0.3,
                        rank_decay: float = 0.7) -> list[list[int]]:
    """Graft's stage-adaptive asymmetric template: the ``n_nodes`` best rank paths (depth <= ``depth``, ranks <
    ``width``) under the prior ``sum(rank_logprior)``, best first. High ranks get deeper and wider subtrees (a
    strong rank-0 chain), low ranks keep a little width. ``asymmetric_template(n)`` is a prefix of
    ``asymmetric_template(n + m)``, so one list serves every allowance. ``step_cost`` > 0 trades depth for width."""
    if not isinstance(n_nodes, int) or n_nodes < 0:
        raise TreeError(f"n_nodes must be an int >= 0, got {n_nodes!r}")
    if depth < 1 or width < 1:
        raise TreeError(f"template depth and width must be >= 1, got depth={depth}, width={width}")
    if step_cost < 0 or rank_decay <= 0:
        raise TreeError(f"need step_cost >= 0 and rank_decay > 0 (got {step_cost}, {rank_decay}) so that a child never "
                        "outranks its parent or an earlier sibling")
    capacity = sum(width ** d for d in range(1, depth + 1))
    if n_nodes > capacity:
        raise TreeError(f"a depth-{depth} width-{width} template has at most {capacity} nodes, asked for {n_nodes}: "
                        "raise depth or width")
    lq = [rank_logprior(r, step_cost, rank_decay) for r in range(width)]
    # Each path has one generator (previous sibling, or parent for rank 0), so the heap never repeats a path.
    heap = [(-lq[0], (0,))]
    out: list[list[int]] = []
    while heap and len(out) < n_nodes:
        neg, path = heapq.heappop(heap)
        out.append(list(path))
        r = path[-1]
        if r + 1 < width:
            heapq.heappush(heap, (neg + lq[r] - lq[r + 1], path[:-1] + (r + 1,)))
        if len(path) < depth:
            heapq.heappush(heap, (neg - lq[0], path + (0,)))
    return out


def extend_template(template: Sequence[Sequence[int]], n_total: int, depth: int = 8, width: int = 8) -> list[list[int]]:
    """``template`` followed by the best asymmetric paths it lacks, up to ``n_total`` paths: spare candidates
    that fill slots which de-duplication or unknown matrix rows would otherwise leave empty."""
    out = [list(p) for p in template]
    seen = {tuple(p) for p in out}
    if len(out) >= n_total:
        return out
    capacity = sum(width ** d for d in range(1, depth + 1))
    for p in asymmetric_template(min(capacity, n_total + len(out)), depth, width):
        if len(out) >= n_total:
            break
        if tuple(p) not in seen:
            seen.add(tuple(p))
            out.append(p)
    return out


def validate_template(template: Sequence[Sequence[int]]) -> list[list[int]]:
    """Non-empty rank paths, ranks >= 0, no repeats, every prefix listed earlier. Returns a plain list copy."""
    seen: set[tuple] = set()
    out = []
    for i, path in enumerate(template):
        p = tuple(int(r) for r in path)
        if not p:
            raise TreeError(f"template path {i} is empty: paths start at the root's children")
        if min(p) < 0:
            raise TreeError(f"template path {i} {list(p)} has a negative rank")
        if p in seen:
            raise TreeError(f"template path {list(p)} appears twice")
        if len(p) > 1 and p[:-1] not in seen:
            raise TreeError(f"template path {list(p)} comes before (or without) its prefix {list(p[:-1])}: "
                            "list every prefix first (template order must be topological)")
        seen.add(p)
        out.append(list(p))
    return out


def level_sizes(template: Sequence[Sequence[int]]) -> list[int]:
    depth = max((len(p) for p in template), default=0)
    return [sum(1 for p in template if len(p) == d) for d in range(1, depth + 1)]


@dataclass(frozen=True)
class CompiledTemplate:
    """Template as tensors: node 0 is the root; ``levels[d]`` = indices of the nodes at depth d + 1."""

    parents: torch.Tensor  # long [n + 1]
    ranks: torch.Tensor  # long [n + 1] (root: 0)
    depths: torch.Tensor  # long [n + 1]
    levels: tuple[torch.Tensor, ...]
    scores: torch.Tensor  # float32 [n + 1]: cumulative template prior, for ordering only

    @property
    def size(self) -> int:
        return int(self.parents.numel()) - 1


@lru_cache(maxsize=64)
def _compile(key: tuple[tuple[int, ...], ...]) -> CompiledTemplate:
    index = {(): 0}
    parents, ranks, depths, scores = [-1], [0], [0], [0.0]
    for p in key:
        index[p] = len(parents)
        parents.append(index[p[:-1]])
        ranks.append(p[-1])
        depths.append(len(p))
        scores.append(scores[index[p[:-1]]] + rank_logprior(p[-1]))
    depths_t = torch.tensor(depths, dtype=torch.long)
    max_d = int(depths_t.max()) if key else 0
    levels = tuple((depths_t == d).nonzero().flatten() for d in range(1, max_d + 1))
    return CompiledTemplate(torch.tensor(parents, dtype=torch.long), torch.tensor(ranks, dtype=torch.long), depths_t,
                            levels, torch.tensor(scores, dtype=torch.float32))


def compile_template(template: Sequence[Sequence[int]] | CompiledTemplate) -> CompiledTemplate:
    if isinstance(template, CompiledTemplate):
        return template
    return _compile(tuple(tuple(p) for p in validate_template(template)))


MatrixLike = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]


def _rows_fn(matrix) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.device]:
    table = getattr(matrix, "table", matrix)
    if isinstance(table, torch.Tensor):
        if table.dim() != 2:
            raise TreeError(f"adjacency matrix must be [vocab, k], got shape {tuple(table.shape)}")
        return (lambda toks: table[toks]), table.device
    if callable(matrix):
        return matrix, torch.device("cpu")
    raise TreeError("matrix must be a [vocab, k] tensor, an object with a .table tensor, or a rows function")


def gather_template(root_token: int, template, matrix: MatrixLike) -> torch.Tensor:
    """Tokens of every template node (root first) by one row gather per level; -1 where unknown. Returns a
    tensor on the matrix's device (no host sync)."""
    ct = compile_template(template)
    rows, device = _rows_fn(matrix)
    table = getattr(matrix, "table", matrix)
    if isinstance(table, torch.Tensor) and not 0 <= int(root_token) < table.shape[0]:
        raise TreeError(f"root token {int(root_token)} has no row in the adjacency matrix (rows "
                        f"0..{table.shape[0] - 1}): the matrix was built for another vocabulary; build it with the "
                        "target's vocab_size")
    toks = torch.full((ct.size + 1,), -1, dtype=torch.long, device=device)
    toks[0] = int(root_token)
    parents, ranks = ct.parents.to(device), ct.ranks.to(device)
    for idx in ct.levels:
        idx = idx.to(device)
        ptok = toks[parents[idx]]
        valid = ptok >= 0
        r = rows(ptok.clamp(min=0)).to(torch.long)  # [m, k]
        rk = ranks[idx]
        in_range = rk < r.shape[1]
        got = r.gather(1, rk.clamp(max=r.shape[1] - 1).view(-1, 1)).squeeze(1)
        toks[idx] = torch.where(valid & in_range, got, torch.full_like(got, -1))
    return toks


def dedup_expansion(tokens: torch.Tensor, template, budget: int | None = None,
                    source: int = SOURCE_RETRIEVED) -> Tree:
    """Trie of gathered template tokens (``gather_template`` output) in template order: unknown (-1) nodes drop with
    their subtrees, duplicate siblings are identified with the first one, at most ``budget`` non-root nodes."""
    ct = compile_template(template)
    toks = tokens.tolist()
    pars = ct.parents.tolist()
    tmpl_scores = ct.scores.tolist()
    out_tok, out_par, out_sc = [toks[0]], [-1], [0.0]
    mapped = [0] + [-1] * ct.size
    child: dict[tuple[int, int], int] = {}
    for i in range(1, ct.size + 1):
        p = mapped[pars[i]]
        t = toks[i]
        if p < 0 or t < 0:
            continue
        j = child.get((p, t))
        if j is None:
            if budget is not None and len(out_tok) - 1 >= budget:
                continue
            j = len(out_tok)
            child[(p, t)] = j
            out_tok.append(t)
            out_par.append(p)
            out_sc.append(tmpl_scores[i])
        mapped[i] = j
    return make_tree(out_tok, out_par, out_sc, source)


def expand_template(root_token: int, template, matrix: MatrixLike, budget: int | None = None,
                    source: int = SOURCE_RETRIEVED) -> Tree:
    """Retrieval tree rooted at ``root_token``: gather level by level, then trie-deduplicate (see module doc).
    Retrieved nodes carry the cumulative template prior as ``scores`` (an ordering, not a model probability)."""
    return dedup_expansion(gather_template(root_token, template, matrix), template, budget, source)
