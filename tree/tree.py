"""The draft tree as flat tensors, and the pure functions every drafter and the verifier share.

Conventions (used everywhere in graft-block):
- node 0 is the root: the last committed token (the previous round's bonus), not yet in the target KV cache;
- nodes are in topological order: ``parents[i] < i`` for every ``i >= 1`` and ``parents[0] == -1``;
- ``depths[0] == 0`` and a node at depth d is verified at position ``start + d``;
- ``scores`` is the proposer's cumulative log-probability of the path (0 at the root, -inf-free);
- ``sources`` says where a node came from (root / draft / retrieved);
- ``modes`` (optional) is a bit set of the mixture modes that proposed a node (MFD).
A budget counts the non-root nodes, i.e. the target verifies ``budget + 1`` positions.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import torch

SOURCE_ROOT = 0
SOURCE_DRAFT = 1
SOURCE_RETRIEVED = 2
SOURCE_NAMES = {SOURCE_ROOT: "root", SOURCE_DRAFT: "draft", SOURCE_RETRIEVED: "retrieved"}


class TreeError(ValueError):
    """A tree breaks one of the invariants above."""


@dataclass(frozen=True)
class Tree:
    tokens: torch.Tensor  # int64 [n]
    parents: torch.Tensor  # int64 [n]
    depths: torch.Tensor  # int64 [n]
    scores: torch.Tensor  # float32 [n]
    sources: torch.Tensor  # int8 [n]
    modes: torch.Tensor | None = None  # int64 [n] bit set, or None

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    def __len__(self) -> int:
        return self.size

    @property
    def root_token(self) -> int:
        return int(self.tokens[0])

    @property
    def num_drafted(self) -> int:
        return int((self.sources == SOURCE_DRAFT).sum())

    @property
    def num_retrieved(self) -> int:
        return int((self.sources == SOURCE_RETRIEVED).sum())

    def subset(self, keep: torch.Tensor) -> "Tree":
        """The tree restricted to ``keep`` (sorted node indices, containing 0 and closed under parents)."""
        keep = keep.to(torch.long).sort().values
        remap = torch.full((self.size,), -1, dtype=torch.long)
        remap[keep] = torch.arange(keep.numel())
        parents = self.parents[keep]
        new_parents = torch.where(parents >= 0, remap[parents.clamp(min=0)], parents)
        if bool((new_parents[1:] < 0).any()):
            raise TreeError("subset is not closed under parents: a kept node lost its parent")
        return Tree(
            tokens=self.tokens[keep],
            parents=new_parents,
            depths=self.depths[keep],
            scores=self.scores[keep],
            sources=self.sources[keep],
            modes=None if self.modes is None else self.modes[keep],
        )


def make_tree(
    tokens: Sequence[int] | torch.Tensor,
    parents: Sequence[int] | torch.Tensor,
    scores: Sequence[float] | torch.Tensor | None = None,
    sources: Sequence[int] | torch.Tensor | int = SOURCE_DRAFT,
    modes: Sequence[int] | torch.Tensor | None = None,
) -> Tree:
    """Build a Tree from token and parent lists; depths are derived, the root's source is forced to ROOT."""
    tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).cpu()
    parents = torch.as_tensor(parents, dtype=torch.long).reshape(-1).cpu()
    n = tokens.numel()
    if parents.numel() != n or n == 0:
        raise TreeError(f"tokens ({n}) and parents ({parents.numel()}) must be non-empty and the same length")
    depths = torch.zeros(n, dtype=torch.long)
    plist = parents.tolist()
    if plist[0] != -1:
        raise TreeError(f"node 0 must be the root with parent -1, got parent {plist[0]}")
    dl = [0] * n
    for i in range(1, n):
        p = plist[i]
        if not 0 <= p < i:
            raise TreeError(f"node {i} has parent {p}: nodes must be in topological order (0 <= parent < index)")
        dl[i] = dl[p] + 1
    depths = torch.tensor(dl, dtype=torch.long)
    if scores is None:
        scores = torch.zeros(n, dtype=torch.float32)
    scores = torch.as_tensor(scores, dtype=torch.float32).reshape(-1).cpu()
    if isinstance(sources, int):
        sources = torch.full((n,), sources, dtype=torch.int8)
    sources = torch.as_tensor(sources, dtype=torch.int8).reshape(-1).cpu().clone()
    sources[0] = SOURCE_ROOT
    if modes is not None:
        modes = torch.as_tensor(modes, dtype=torch.long).reshape(-1).cpu()
    return Tree(tokens, parents, depths, scores, sources, modes)


def root_only(root_token: int) -> Tree:
    """The empty proposal: verifying it is one autoregressive step."""
    return make_tree([root_token], [-1])


def chain(root_token: int, tokens: Sequence[int] | torch.Tensor, scores=None, source: int = SOURCE_DRAFT) -> Tree:
    """A single path root -> tokens[0] -> tokens[1] ...; ``scores`` are cumulative log-probs of the drafted nodes."""
    toks = [int(root_token)] + [int(t) for t in torch.as_tensor(tokens).reshape(-1).tolist()]
    parents = [-1] + list(range(len(toks) - 1))
    full_scores = None
    if scores is not None:
        full_scores = [0.0] + [float(s) for s in torch.as_tensor(scores).reshape(-1).tolist()]
    return make_tree(toks, parents, full_scores, source)


def from_paths(
    root_token: int,
    paths: Iterable[Sequence[int]],
    source: int = SOURCE_DRAFT,
    path_scores: Iterable[Sequence[float]] | None = None,
    budget: int | None = None,
) -> Tree:
    """Trie of the given token paths under one root; shared prefixes become shared nodes.

    ``path_scores[k][j]`` is the cumulative score of the j-th node of path k (kept from its first insertion).
    With ``budget``, nodes past the budget are dropped (paths are inserted in order, so earlier paths win).
    """
    tokens, parents, scores = [int(root_token)], [-1], [0.0]
    child: dict[tuple[int, int], int] = {}
    score_iter = iter(path_scores) if path_scores is not None else None
    for path in paths:
        ps = list(next(score_iter)) if score_iter is not None else None
        cur = 0
        for j, tok in enumerate(path):
            key = (cur, int(tok))
            nxt = child.get(key)
            if nxt is None:
                if budget is not None and len(tokens) - 1 >= budget:
                    break
                nxt = len(tokens)
                child[key] = nxt
                tokens.append(int(tok))
                parents.append(cur)
                scores.append(float(ps[j]) if ps is not None else 0.0)
            cur = nxt
    return make_tree(tokens, parents, scores, source)


def merge(base: Tree, extra: Tree, budget: int | None = None, attach: int = 0) -> Tree:
    """Trie-merge ``extra`` into ``base``: extra's root is identified with base node ``attach``.

    Equal tokens under one parent become one node (base's node wins, mode bits are OR-ed), so no slot holds a
    duplicate. Extra's nodes are added in their topological order until ``budget`` non-root nodes exist; a node
    whose parent did not fit is dropped too. Extra's scores count from its root; an added node's score continues
    base's path score at ``attach`` (a score is always the whole path's from the root).
    """
    if attach == 0 and int(extra.tokens[0]) != int(base.tokens[0]):
        raise TreeError(f"cannot merge trees with different roots ({int(base.tokens[0])} vs {int(extra.tokens[0])})")
    tokens = base.tokens.tolist()
    parents = base.parents.tolist()
    scores = base.scores.tolist()
    sources = base.sources.tolist()
    has_modes = base.modes is not None or extra.modes is not None
    modes = base.modes.tolist() if base.modes is not None else [0] * len(tokens)
    child = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if i > 0}
    ex_tok, ex_par = extra.tokens.tolist(), extra.parents.tolist()
    ex_sc, ex_src = extra.scores.tolist(), extra.sources.tolist()
    ex_modes = extra.modes.tolist() if extra.modes is not None else [0] * len(ex_tok)
    mapped = [-1] * len(ex_tok)
    mapped[0] = attach
    offset = scores[attach] - ex_sc[0]
    for i in range(1, len(ex_tok)):
        p = mapped[ex_par[i]]
        if p < 0:
            continue
        key = (p, ex_tok[i])
        j = child.get(key)
        if j is None:
            if budget is not None and len(tokens) - 1 >= budget:
                continue
            j = len(tokens)
            child[key] = j
            tokens.append(ex_tok[i])
            parents.append(p)
            scores.append(ex_sc[i] + offset)
            sources.append(ex_src[i])
            modes.append(ex_modes[i])
        else:
            modes[j] |= ex_modes[i]
        mapped[i] = j
    return make_tree(tokens, parents, scores, sources, modes if has_modes else None)


def validate(tree: Tree, budget: int | None = None, root_token: int | None = None,
             vocab_size: int | None = None) -> Tree:
    """Check every invariant the verifier relies on; return the tree or raise TreeError naming the problem.
    ``vocab_size``: the target's, when known; every token id must then be a row of its embedding table."""
    n = tree.size
    for name in ("parents", "depths", "scores", "sources"):
        t = getattr(tree, name)
        if t.dim() != 1 or t.numel() != n:
            raise TreeError(f"tree.{name} must be 1-D with {n} entries, got shape {tuple(t.shape)}")
    if tree.modes is not None and tree.modes.numel() != n:
        raise TreeError(f"tree.modes must have {n} entries, got {tree.modes.numel()}")
    if n == 0:
        raise TreeError("a tree needs at least the root node")
    if root_token is not None and int(tree.tokens[0]) != int(root_token):
        raise TreeError(
            f"tree root token {int(tree.tokens[0])} != last committed token {int(root_token)}: "
            "a proposal must be rooted at the current bonus token (state.root_token)"
        )
    if budget is not None and n - 1 > budget:
        raise TreeError(f"tree has {n - 1} non-root nodes, over the budget of {budget}")
    parents = tree.parents.tolist()
    if parents[0] != -1 or int(tree.depths[0]) != 0:
        raise TreeError("node 0 must be the root (parent -1, depth 0)")
    idx = torch.arange(n)
    par = tree.parents[1:]
    if bool(((par < 0) | (par >= idx[1:])).any()):
        bad = int(idx[1:][(par < 0) | (par >= idx[1:])][0])
        raise TreeError(f"node {bad} has parent {parents[bad]}: nodes must be topologically ordered and prefix-closed")
    if n > 1 and not torch.equal(tree.depths[1:], tree.depths[par] + 1):
        raise TreeError("depths must equal parent depth + 1")
    lo, hi = (int(v) for v in tree.tokens.aminmax())  # one pass for both bounds (and the sibling key): every round
    if lo < 0:
        raise TreeError("negative token id in tree")
    if vocab_size is not None and hi >= vocab_size:
        raise TreeError(f"token id {hi} in the tree is outside the target vocabulary 0..{vocab_size - 1}: a drafter "
                        "or adjacency matrix made for another tokenizer proposed it; use one built for this target")
    if n > 1:
        key = tree.parents[1:] * (hi + 1) + tree.tokens[1:]
        if key.unique().numel() != n - 1:
            raise TreeError("duplicate sibling tokens: two children of one parent carry the same token "
                            "(trie-merge them)")
    return tree


def ancestor_mask(tree: Tree) -> torch.Tensor:
    """Bool [n, n]: entry (i, j) is True iff node j is node i or one of its ancestors."""
    n = tree.size
    mask = torch.zeros(n, n, dtype=torch.bool)
    rows = torch.arange(n)
    cur = rows.clone()
    # Pointer walk up the tree: one vectorised step per depth level.
    for _ in range(int(tree.depths.max()) + 1):
        live = cur >= 0
        mask[rows[live], cur[live]] = True
        cur = torch.where(live, tree.parents[cur.clamp(min=0)], cur)
    return mask


def attention_mask(tree: Tree, cache_len: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Additive float mask [1, 1, n, cache_len + n]: the whole cached prefix and each node's ancestors are visible.

    Additive (0 / finfo.min) on purpose: a bool mask is silently wrong under eager attention.
    """
    n = tree.size
    mask = torch.full((n, cache_len + n), torch.finfo(dtype).min, dtype=dtype, device=device)
    mask[:, :cache_len] = 0
    anc = ancestor_mask(tree).to(device)
    mask[:, cache_len:].masked_fill_(anc, 0)
    return mask.view(1, 1, n, cache_len + n)


def window_cut(mask: torch.Tensor, tree: Tree, cache_len: int, window: int) -> torch.Tensor:
    """A copy of ``attention_mask``'s ``mask`` for a sliding-window layer: of what it shows each node, only the keys
    less than ``window`` positions behind it. Node j sits at ``cache_len + depth[j]``; the mask's cached columns are
    the last ones of ``cache_len`` cached positions (all of them, or the rows a trimmed sliding layer still holds)."""
    query = (cache_len + tree.depths).to(mask.device)
    held = mask.shape[-1] - tree.size
    key = torch.cat([torch.arange(cache_len - held, cache_len, device=mask.device), query])
    far = (query[:, None] - key[None, :] >= window).view(1, 1, *mask.shape[-2:])
    return mask.masked_fill(far, torch.finfo(mask.dtype).min)


def position_ids(tree: Tree, start: int, device=None) -> torch.Tensor:
    """[1, n] positions ``start + depth``: siblings share a position, as in sequential decoding."""
    return (tree.depths + start).to(device).view(1, -1)


def walk(tree: Tree, choices: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, int]:
    """Follow the target: from the root, descend into the child whose token equals the target's choice at the
    current node. Returns (accepted node indices starting with 0, bonus token = the choice at the last one).

    Lossless for any tree whose tokens do not depend on the choices: each emitted token is the target's own
    choice at a node whose ancestors are exactly the committed prefix.
    """
    choice = torch.as_tensor(choices).reshape(-1).tolist()
    if len(choice) != tree.size:
        raise TreeError(f"walk needs one target choice per node ({tree.size}), got {len(choice)}")
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    child = {(pars[i], toks[i]): i for i in range(1, len(toks))}
    path = [0]
    cur = 0
    while True:
        nxt = child.get((cur, choice[cur]))
        if nxt is None:
            break
        path.append(nxt)
        cur = nxt
    return torch.tensor(path, dtype=torch.long), int(choice[cur])


def accept_length(tree: Tree, choices) -> int:
    """Number of drafted/retrieved nodes the walk accepts (0..max depth)."""
    path, _ = walk(tree, choices)
    return int(path.numel()) - 1


def path_products(tree: Tree, conditional: torch.Tensor | Sequence[float]) -> list[float]:
    """Per node, the product of ``conditional`` along its path from the root (entry 0 unused; the root's is 1): a
    node's P(reached) from its P(reached | parent reached)."""
    # a drafter's list stays a list: this runs in every scheduled round, where a tensor round trip buys nothing
    q = conditional.reshape(-1).tolist() if isinstance(conditional, torch.Tensor) else list(conditional)
    if len(q) != tree.size:
        raise TreeError(f"path products need one conditional per node ({tree.size}), got {len(q)}")
    out, pars = [1.0] * tree.size, tree.parents.tolist()
    for i in range(1, tree.size):  # topological order: a parent's product is final
        out[i] = out[pars[i]] * q[i]
    return out


def accept_at_least(tree: Tree, node_probs: torch.Tensor | Sequence[float]) -> list[float]:
    """P(the walk accepts >= d nodes) for d = 1 .. the tree's depth, when the target's choice at every node is
    random: ``node_probs[i]`` (i >= 1) is the probability that the choice at node i's parent is node i's token (0/1
    for a greedy target). The walk reaches a node with the product of those along its path (``path_products``) and
    at most one node per depth, so a depth's reach probabilities add up."""
    reach, depths = path_products(tree, node_probs), tree.depths.tolist()
    out = [0.0] * max(depths)
    for i in range(1, tree.size):
        out[depths[i] - 1] += reach[i]
    return out


def expected_accept_length(tree: Tree, node_probs: torch.Tensor | Sequence[float]) -> float:
    """E[nodes the walk accepts] = sum over d of P(>= d accepted) (``accept_at_least``)."""
    return float(sum(accept_at_least(tree, node_probs)))


def with_sources(tree: Tree, source: int) -> Tree:
    """Same tree, every non-root node relabelled with ``source``."""
    src = torch.full_like(tree.sources, source)
    src[0] = SOURCE_ROOT
    return replace(tree, sources=src)


def paths_to_leaves(tree: Tree) -> list[list[int]]:
    """Token paths root->leaf (root excluded), in node order of the leaves."""
    n = tree.size
    has_child = torch.zeros(n, dtype=torch.bool)
    if n > 1:
        has_child[tree.parents[1:]] = True
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    out = []
    for leaf in range(1, n):
        if has_child[leaf]:
            continue
        path, cur = [], leaf
        while cur > 0:
            path.append(toks[cur])
            cur = pars[cur]
        out.append(path[::-1])
    return out
