"""Calibrated pruning: confidence signals of a draft tree at a few depth checkpoints, the stage that fires, the best
``A`` draft nodes to keep (scoring only; the warm-up that calibrates thresholds is ``graft_block.calibrate``).

Signal (our reading of Graft's "cumulative confidence of the current best path"; the paper's exact form is not
available): after the draft expanded depth ``d`` its frontier is the set of draft nodes at depth ``d + 1``;
``"best"`` = max cumulative log-prob over the frontier (the best path's confidence), ``"mass"`` = logsumexp over the
frontier (DDD's ``H_d``, the probability mass the tree still covers). A missing frontier (the tree never reached
depth d + 1) has signal -inf, i.e. zero confidence. Stage ``d`` fires when signal_d < threshold_d; checkpoints are
tested shallow first and the first one that fires wins.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from graft_block.tree import SOURCE_DRAFT, Tree
from graft_block.tree.schedule import integer_key

from .drafter import check_number
from .errors import ConfigError

CHECKPOINTS = (0, 1, 5)
SIGNALS = ("mass", "best")
# Uncalibrated placeholders (log-probabilities); run ``graft_block.calibrate`` to replace them for a
# drafter/target pair.
DEFAULT_THRESHOLDS = {"mass": {0: math.log(0.5), 1: math.log(0.35), 5: math.log(0.15)},
                      "best": {0: math.log(0.4), 1: math.log(0.25), 5: math.log(0.1)}}


def checkpoint_signal(tree: Tree, checkpoint: int, kind: str = "mass") -> float:
    """Confidence after expanding depth ``checkpoint`` (see module doc); -inf if no draft node at depth + 1."""
    sel = (tree.depths == checkpoint + 1) & (tree.sources == SOURCE_DRAFT)
    if not bool(sel.any()):
        return float("-inf")
    s = tree.scores[sel].double()
    if kind == "mass":
        return float(torch.logsumexp(s, 0))
    if kind == "best":
        return float(s.max())
    raise ConfigError(f"unknown pruning signal {kind!r}; choose one of {SIGNALS}")


def tree_signals(tree: Tree, checkpoints: Sequence[int] = CHECKPOINTS, kind: str = "mass") -> dict[int, float]:
    return {int(c): checkpoint_signal(tree, int(c), kind) for c in checkpoints}


def fired_stage(signals: dict[int, float], thresholds: dict[int, float]) -> int | None:
    """The shallowest checkpoint whose signal is below its threshold, or None (keep the full draft)."""
    for c in sorted(signals):
        if signals[c] < thresholds[c]:
            return c
    return None


def normalize_thresholds(thresholds, checkpoints: Sequence[int], kind: str) -> dict[int, float]:
    """Accept {int|str: float} (JSON keys are strings); fill missing checkpoints from the placeholders."""
    out = {}
    if thresholds is not None and not isinstance(thresholds, dict):
        raise ConfigError(f"thresholds must map checkpoint depths to log-probabilities, got {thresholds!r}")
    given = {}
    for k, v in (thresholds or {}).items():
        depth = integer_key(k)  # JSON keys are text
        if depth is None:
            raise ConfigError(f"thresholds key {k!r} is not a checkpoint depth (an int)")
        # a probability here (0.5) would sit above every log-prob signal and fire the stage every round; +inf is
        # the explicit "always"
        given[depth] = v if v == math.inf else check_number(v, f"thresholds[{k!r}]", -math.inf, 0.0,
                                                            "a log-probability of the signal, or inf: always fire")
    unknown = set(given) - set(int(c) for c in checkpoints)
    if unknown:
        raise ConfigError(f"thresholds given for checkpoints {sorted(unknown)} that are not in checkpoints "
                          f"{list(checkpoints)}")
    for c in checkpoints:
        c = int(c)
        if c in given:
            out[c] = given[c]
        elif c in DEFAULT_THRESHOLDS[kind]:
            out[c] = DEFAULT_THRESHOLDS[kind][c]
        else:
            raise ConfigError(f"no threshold for checkpoint depth {c}: "
                              f"pass thresholds={{{c}: <log-prob>}} or calibrate")
    return out


def path_min_scores(tree: Tree) -> torch.Tensor:
    """Score of each node's weakest ancestor-or-self: non-increasing along every path even when raw scores are not.
    A NaN score counts as -inf (min(x, nan) is x in Python: a NaN parent would rank after its child)."""
    eff = tree.scores.double().nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    eff[0] = float("inf")
    pars = tree.parents.tolist()
    vals = eff.tolist()
    for i in range(1, len(vals)):
        vals[i] = min(vals[i], vals[pars[i]])
    return torch.tensor(vals, dtype=torch.float64)


def ranked_nodes(tree: Tree) -> torch.Tensor:
    """All node indices, root first, best path-min score first, ties by index: every prefix is ancestor-closed
    (a parent's path-min is >= its child's and its index is smaller)."""
    eff = path_min_scores(tree)
    order = torch.sort(-eff, stable=True).indices
    return order


def top_nodes(tree: Tree, n: int) -> torch.Tensor:
    """Sorted indices of the root plus the ``n`` best non-root nodes (ancestor-closed)."""
    return ranked_nodes(tree)[: n + 1].sort().values


def reorder(tree: Tree, order: torch.Tensor) -> Tree:
    """The same nodes listed in ``order`` (a topological permutation starting with the root)."""
    order = order.to(torch.long)
    if order.numel() != tree.size or int(order[0]) != 0:  # the check below sees parents[1:] only: not the root's
        raise ConfigError(f"reorder needs a permutation of the tree's {tree.size} nodes starting with the root (0)")
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel())
    parents = tree.parents[order]
    new_parents = torch.where(parents >= 0, inv[parents.clamp(min=0)], parents)
    if bool((new_parents[1:] >= torch.arange(1, order.numel())).any()):
        raise ConfigError("reorder needs a topological order (every parent before its children)")
    return Tree(tree.tokens[order], new_parents, tree.depths[order], tree.scores[order], tree.sources[order],
                None if tree.modes is None else tree.modes[order])
