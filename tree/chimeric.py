"""Chimeric-prefix analysis of any draft tree (DDTree, mixed MFD, EAGLE3, grafted), the two protocols of mfd.md 3.2.

A node is identified with its token path p = (x_1..x_d) below the root (the root itself is never labelled).
Shares are computed separately for drafted nodes (``sources == 1``) and retrieved nodes (``sources == 2``);
the headline number is the drafted one ("chimeric nodes / B" when the tree is full).

(a) Sampled-futures reference (canonical). Given a set F of target futures of the next block (token lists that
    continue the root; e.g. N samples from the target at the round's context, plus its greedy continuation),
    let S_i = {f_i : f in F} be the tokens seen at position i. Node p of depth d is
    - ``coherent``    if p is a prefix of some f in F;
    - ``chimeric``    if x_i is in S_i for every i <= d, but p is not a prefix of any f in F;
    - ``off_support`` otherwise (some x_i was never seen at position i).

(b) One-pass proxy from the verify logits (no sampling). With P(x | u) the target's probability of token x after
    node u's path under the law the futures of (a) follow (``law``: the round's decoding law, temperature / top-k /
    top-p, so that both protocols describe the same futures; softmax at T = 1 for a greedy round, whose one future
    leaves nothing chimeric: ``graft_block.chimeric.round_law``; default softmax at ``temperature``, 1 by default),
    node p with parent u is
    - ``coherent``    if every step on its path is supported: P(x_i | x_<i) >= eps for all i <= d;
    - ``chimeric``    (the spec's rule) if P(x_d | u) < eps and x_d is "valid elsewhere": P(x_d | u') >= delta for
                      some other coherent node u' != u of the tree at depth d-1 (a future the target would produce
                      passes through u'; after an unsupported u' it never goes, so its next token is no witness,
                      as under (a), where a token counts only if some future holds it at that position);
    - ``off_support`` if P(x_d | u) < eps and x_d is valid nowhere else;
    - ``unreachable`` if its own step is supported but an ancestor's is not (verification can never reach it).
    Depth-1 nodes have no alternative parent, so they are never chimeric, as under (a).
    ``chimeric_path`` (reported next to the shares) is the path-level variant closer to (a): the node is not
    coherent and every unsupported step on its path is valid elsewhere.
    Defaults eps = 0.01, delta = 0.1 (sweep both).

This module is model-free: the round hooks that feed it and the sampling of target futures for (a) live in
``graft_block.chimeric``.
"""
from __future__ import annotations

import math
import torch

from .tree import SOURCE_DRAFT, SOURCE_RETRIEVED, Tree, TreeError

SAMPLED_LABELS = ("coherent", "chimeric", "off_support")
PROXY_LABELS = ("coherent", "chimeric", "off_support", "unreachable")
GROUPS = {"draft": SOURCE_DRAFT, "retrieved": SOURCE_RETRIEVED}


def _node_paths(tree: Tree) -> list[tuple]:
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    paths: list[tuple] = [()]
    for i in range(1, len(toks)):
        paths.append(paths[pars[i]] + (toks[i],))
    return paths


def _shares(tree: Tree, labels: list[str], names: tuple, extra: dict[str, list[bool]] | None = None) -> dict:
    """Per source group: node count, count and share of each label (and of each boolean ``extra`` flag)."""
    src = tree.sources.tolist()
    out = {}
    for group, code in GROUPS.items():
        idx = [i for i in range(1, tree.size) if src[i] == code]
        n = len(idx)
        row = {"n": n}
        for name in names:
            c = sum(labels[i] == name for i in idx)
            row[name + "_n"] = c
            row[name] = c / n if n else 0.0
        for name, flags in (extra or {}).items():
            c = sum(bool(flags[i]) for i in idx)
            row[name + "_n"] = c
            row[name] = c / n if n else 0.0
        out[group] = row
    return out


# ---- (a) sampled futures -----------------------------------------------------------------------------------
def label_sampled(tree: Tree, futures) -> list[str]:
    """Protocol (a) label of every node (index 0 = "root")."""
    futs = [tuple(int(t) for t in f) for f in futures]
    if not futs:
        raise TreeError("label_sampled needs at least one future (a token list continuing the root)")
    prefixes = {f[:d] for f in futs for d in range(1, len(f) + 1)}
    seen: dict[int, set] = {}
    for f in futs:
        for i, t in enumerate(f):
            seen.setdefault(i, set()).add(t)
    labels = ["root"]
    paths = _node_paths(tree)
    for i in range(1, tree.size):
        p = paths[i]
        if p in prefixes:
            labels.append("coherent")
        elif all(t in seen.get(j, ()) for j, t in enumerate(p)):
            labels.append("chimeric")
        else:
            labels.append("off_support")
    return labels


def sampled_shares(tree: Tree, futures) -> dict:
    """Protocol (a): {"draft": {...}, "retrieved": {...}} with n, coherent, chimeric, off_support (shares, *_n)."""
    return _shares(tree, label_sampled(tree, futures), SAMPLED_LABELS)


# ---- (b) one-pass proxy ------------------------------------------------------------------------------------
def label_proxy(tree: Tree, logits: torch.Tensor, eps: float = 0.01, delta: float = 0.1,
                temperature: float = 1.0, law=None) -> tuple[list[str], list[bool]]:
    """Protocol (b) label of every node from the verify logits [n, V] (row i = target's next-token logits after
    node i's path). ``law``: logits [n, V] -> probabilities [n, V] of the decoding law (e.g. the round's
    ``graft_block.sampling.target_probs``); None: softmax(logits / temperature). Returns (labels, chimeric_path
    flags)."""
    n = tree.size
    if logits.dim() != 2 or logits.shape[0] != n:
        raise TreeError(f"label_proxy needs verify logits of shape [{n}, V] (one row per tree node), got "
                        f"{tuple(logits.shape)}")
    if not (0 < eps <= 1 and 0 < delta <= 1 and temperature > 0):
        raise TreeError(f"need 0 < eps, delta <= 1 and temperature > 0, got eps={eps}, delta={delta}, "
                        f"temperature={temperature}")
    toks = tree.tokens.to(logits.device)
    # log P(token of node j | path of node u) for all (u, j): one normalisation per row + an [n, n] gather.
    if law is None:
        lg = logits.float() / temperature
        lp = (lg[:, toks] - torch.logsumexp(lg, dim=-1, keepdim=True)).cpu()
    else:
        probs = law(logits)
        if tuple(probs.shape) != tuple(logits.shape):
            raise TreeError(f"label_proxy's law must map logits {tuple(logits.shape)} to probabilities of the same "
                            f"shape, got {tuple(probs.shape)}")
        lp = probs.float()[:, toks].log().cpu()  # a token outside top-k / top-p: log 0 = -inf, below any eps
    pars, depths = tree.parents.tolist(), tree.depths.tolist()
    log_eps, log_delta = math.log(eps), math.log(delta)
    # first pass: which paths are supported (parents come before children, not every shallower node before j)
    step_ok, path_ok = [True], [True]
    for j in range(1, n):
        step_ok.append(bool(lp[pars[j], j] >= log_eps))
        path_ok.append(path_ok[pars[j]] and step_ok[j])
    witnesses: dict[int, list[int]] = {}  # coherent nodes by depth: the paths the target's futures go through
    for u in range(n):
        if path_ok[u]:
            witnesses.setdefault(depths[u], []).append(u)
    labels, path_flag, all_bad_elsewhere = ["root"], [False], [True]
    for j in range(1, n):
        u, own = pars[j], step_ok[j]
        others = [v for v in witnesses.get(depths[j] - 1, ()) if v != u]
        elsewhere = bool(others) and bool((lp[others, j] >= log_delta).any())
        # every unsupported step so far is valid elsewhere
        all_bad_elsewhere.append(all_bad_elsewhere[u] and (own or elsewhere))
        if path_ok[j]:
            labels.append("coherent")
        elif not own:
            labels.append("chimeric" if elsewhere else "off_support")
        else:
            labels.append("unreachable")
        path_flag.append(not path_ok[j] and all_bad_elsewhere[j])
    return labels, path_flag


def proxy_shares(tree: Tree, logits: torch.Tensor, eps: float = 0.01, delta: float = 0.1,
                 temperature: float = 1.0, law=None) -> dict:
    """Protocol (b) shares per source group (coherent, chimeric, off_support, unreachable, chimeric_path)."""
    labels, flags = label_proxy(tree, logits, eps, delta, temperature, law)
    return _shares(tree, labels, PROXY_LABELS, {"chimeric_path": flags})


# ---- aggregation over rounds -------------------------------------------------------------------------------
def mean_rows(rows: list[dict], group: str) -> dict:
    """Average of per-round shares over rounds that have nodes of ``group``; counts are summed."""
    live = [r[group] for r in rows if r[group]["n"] > 0]
    if not live:
        return {"rounds": 0, "n": 0}
    out = {"rounds": len(live), "n": sum(r["n"] for r in live)}
    for key in live[0]:
        if key == "n":
            continue
        if key.endswith("_n"):
            out[key] = sum(r[key] for r in live)
        else:
            out[key] = sum(r[key] for r in live) / len(live)
    return out
