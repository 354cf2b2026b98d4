"""Confidence-scheduled verification (DSpark's Algorithm 1 at batch 1) and the calibration of its confidences.

``schedule_tree`` keeps the nodes most likely to be on the accepted path, in decreasing survival, while the
expected accepted tokens per verify second still rise, and stops at the first drop. Survival is the estimated
probability that a node is on the accepted path (root = 1); the verify cost of N positions comes from a callable
or from the harness's verify-cost curve (``{"median_s": {"1": s, "2": s, ...}}``, see ``curve_cost``).

The kept set depends only on the drafter's tree and survivals, never on the target's choices, so the walk over the
kept subtree still emits exactly the target's law.

Calibration: a confidence head gives per-position logits ``z[:, k]`` estimating P(position k accepted | positions
< k accepted). ``calibrate_temperatures`` fits one temperature per position (sequential temperature scaling) on
the rows that reached that position; ``expected_calibration_error`` and ``prefix_ece`` measure the result.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Mapping

import torch

from .tree import Tree, TreeError, path_products

CostLike = Callable[[int], float] | Mapping


# ---- the verify-cost curve ----------------------------------------------------------------------------------
def curve_cost(curve: Mapping, nodes: int) -> float:
    """Verify seconds for ``nodes`` positions from ``curve["median_s"]`` (size -> seconds): linear between measured
    sizes, the first value below the smallest size, linear extrapolation of the last segment past the largest (flat
    if that segment falls: a verify never gets cheaper with more positions)."""
    return _interpolate(_curve_points(curve), nodes)


def _curve_points(curve: Mapping) -> list[tuple[int, float]]:
    table = curve.get("median_s") if isinstance(curve, Mapping) else None
    if not table or not isinstance(table, Mapping):
        raise TreeError("a verify-cost curve needs a non-empty 'median_s' table {nodes: seconds} "
                        "(the harness's measure.verify_cost_curve output)")
    pts: dict[int, float] = {}
    for k, v in table.items():
        size = integer_key(k)
        if size is None or size < 1:
            raise TreeError(f"verify-cost curve entry {k!r}: {v!r}: sizes must be integers >= 1 (positions "
                            "verified); fix or drop that entry, or measure the curve again")
        try:
            sec = math.nan if isinstance(v, bool) else float(v)
        except (TypeError, ValueError):
            sec = math.nan
        if not math.isfinite(sec) or sec <= 0:  # 0 s divides by zero in the schedule's tokens-per-second
            raise TreeError(f"verify-cost curve entry {k!r}: {v!r}: seconds must be a finite number > 0 (a "
                            "measured verify time); fix or drop that entry, or measure the curve again")
        if size in pts:
            raise TreeError(f"verify-cost curve lists size {size} twice ({pts[size]} and {sec} s): keep one")
        pts[size] = sec
    return sorted(pts.items())


def integer_key(key) -> int | None:
    """A mapping key as an int (a curve's node count, a Graft checkpoint depth): an int, an integral float or a
    string of digits (JSON keys); else None."""
    if isinstance(key, bool):
        return None
    if isinstance(key, numbers.Integral):
        return int(key)
    if isinstance(key, numbers.Real):
        return int(key) if float(key).is_integer() else None
    if isinstance(key, str):
        text = key.strip()
        # isdecimal, not isdigit: "²" is a digit that int() refuses; one sign at most ("+-5" too)
        if text[1:].isdecimal() if text[:1] in "+-" else text.isdecimal():
            return int(text)
    return None


def _interpolate(pts: list[tuple[int, float]], nodes: int) -> float:
    if nodes <= pts[0][0] or len(pts) == 1:
        return pts[0][1]
    for (a, ta), (b, tb) in zip(pts, pts[1:]):
        if nodes <= b:
            return ta + (tb - ta) * (nodes - a) / (b - a)
    (a, ta), (b, tb) = pts[-2], pts[-1]
    return tb + max(tb - ta, 0.0) * (nodes - b) / (b - a)


def convex_cost_curve(curve: Mapping) -> dict:
    """The lower convex envelope of a verify-cost curve, at the same sizes: ``{"median_s": {size: seconds}}``.

    With a convex cost and nodes added in decreasing survival, expected tokens per second is unimodal in the node
    count (its upper level sets are intervals), so the schedule's first drop is also its best cut. A measured
    step (two sizes timed alike, then a jump) would stop the schedule at the step instead."""
    pts = _curve_points(curve)  # the same errors as the raw curve (missing table, bad entries)
    hull: list[tuple[int, float]] = []
    for x, y in pts:  # monotone chain: drop the last point while it lies on or above the chord to the new one
        while len(hull) >= 2 and (hull[-1][1] - hull[-2][1]) * (x - hull[-2][0]) >= \
                (y - hull[-2][1]) * (hull[-1][0] - hull[-2][0]):
            hull.pop()
        hull.append((x, y))
    envelope = {"median_s": {str(a): b for a, b in hull}}
    return {"median_s": {str(x): curve_cost(envelope, x) for x, _ in pts}}


def cost_function(cost: CostLike) -> Callable[[int], float]:
    """``cost`` as a callable nodes -> seconds (a curve dict is interpolated by ``curve_cost``)."""
    if callable(cost):
        return cost
    if isinstance(cost, Mapping):
        pts = _curve_points(cost)  # fail now, naming the missing table, not inside a decode round
        return lambda nodes: _interpolate(pts, nodes)  # sorted once: the schedule reads it ~10 times a round
    raise TreeError(f"cost must be a callable nodes -> seconds or a curve dict with 'median_s', got "
                    f"{type(cost).__name__}")


def affine_fit(sums: list[float]) -> tuple[float, float]:
    """(a, b) minimising sum w (y - a - b x)^2 from the weighted moments ``sums`` = [sum w, sum w x, sum w y,
    sum w x^2, sum w x y] (kept as running sums, so a refit costs the same after any number of rounds); b = 1 and
    a the weighted mean gap when the xs do not vary."""
    sw, sx, sy, sxx, sxy = sums
    mx, my = sx / sw, sy / sw
    var = sxx - sw * mx * mx
    if var <= 1e-12 * max(1.0, sxx):
        return my - mx, 1.0
    b = (sxy - sw * mx * my) / var
    return my - b * mx, b


# ---- survival -----------------------------------------------------------------------------------------------
def survival_from_scores(tree: Tree) -> torch.Tensor:
    """Fallback survival for drafters without a confidence head: exp of the cumulative path log-prob, in [0, 1]
    (a graft's retrieved nodes continue their attach node's path score: ``tree.merge``)."""
    return torch.exp(tree.scores.double()).clamp(0.0, 1.0)


def path_survival(tree: Tree, survival: torch.Tensor) -> torch.Tensor:
    """Survival made non-increasing along every path (running min from the root; root = 1), in [0, 1]."""
    s = torch.as_tensor(survival, dtype=torch.float64).reshape(-1).cpu()
    if s.numel() != tree.size:
        raise TreeError(f"survival needs one value per tree node ({tree.size}), got {s.numel()}")
    if bool(torch.isnan(s).any()):
        raise TreeError("survival contains NaN: the confidence head produced NaN (check its dtype)")
    vals = s.clamp(0.0, 1.0).tolist()
    vals[0] = 1.0
    pars = tree.parents.tolist()
    for i in range(1, len(vals)):  # topological order: the parent is final before its children
        vals[i] = min(vals[i], vals[pars[i]])
    return torch.tensor(vals, dtype=torch.float64)


def conditional_survival(tree: Tree, path: list[float]) -> list[float]:
    """Each node's estimated P(accepted | its parent accepted): its ``path`` survival (``path_survival``) over its
    parent's (root 1), scaled down among siblings whose estimates sum past 1. Only one child of a node can be the
    target's token, and a graft's retrieved children beside a draft's (or a confidence head rating each child
    alone) would otherwise count the same acceptance twice."""
    s = path
    pars = tree.parents.tolist()
    return _exclusive(pars, [1.0] + [s[i] / s[pars[i]] if s[pars[i]] > 0 else 0.0 for i in range(1, len(s))])


def _exclusive(pars: list[int], cond: list[float]) -> list[float]:
    """``cond`` with each node's children scaled down together where they sum past 1 (root entry kept)."""
    total: dict[int, float] = {}
    for i in range(1, len(cond)):
        total[pars[i]] = total.get(pars[i], 0.0) + cond[i]
    return [cond[0]] + [c / max(1.0, total[pars[i]]) for i, c in enumerate(cond[1:], start=1)]


def calibration_keys(tree: Tree, conditional: list[float]) -> list[tuple[int, bool, int]]:
    """Per node (depth, whether it is its parent's likeliest child (ties: the lower index), its source): the groups
    the online recalibration counts apart, since a confidence head rates a parent's top child and its siblings
    differently, and a graft's retrieved nodes carry a template prior, not a model probability."""
    pars, depths, src = tree.parents.tolist(), tree.depths.tolist(), tree.sources.tolist()
    top: dict[int, int] = {}
    for i in range(1, len(pars)):
        j = top.get(pars[i])
        if j is None or conditional[i] > conditional[j]:
            top[pars[i]] = i
    return [(0, True, src[0])] + [(depths[i], top[pars[i]] == i, src[i]) for i in range(1, len(pars))]


def rescaled_survival(tree: Tree, conditional: list[float], factors: Mapping, keys: list) -> torch.Tensor:
    """Path survival from per-node conditionals, each times its key's factor (missing: 1) and capped at 1, then
    scaled down among siblings that sum past 1 (a parent's top child and the others have factors of their own)."""
    scaled = [min(1.0, c * factors.get(k, 1.0)) for c, k in zip(conditional, keys)]
    return torch.tensor(path_products(tree, _exclusive(tree.parents.tolist(), scaled)), dtype=torch.float64)


# ---- the scheduler ------------------------------------------------------------------------------------------
STOPS = ("best", "first_drop", "threshold")


def check_threshold(threshold) -> None:
    """TreeError unless ``threshold`` (``stop="threshold"``'s) is a probability."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
        raise TreeError(f"threshold must be a probability in [0, 1] (the conditional acceptance a kept node reaches), "
                        f"got {threshold!r}")


def schedule_tree(tree: Tree, survival: torch.Tensor, cost: CostLike, min_nodes: int = 0,
                  overhead: float = 0.0, stop: str = "best", threshold: float = 0.5) -> tuple[Tree, dict]:
    """Keep non-root nodes in decreasing survival (ties: lower index first); the objective of the first k is
    (1 + their survivals) / (overhead + cost(1 + k)). ``stop="best"``: the k of the highest objective (ties: the
    smaller k); ``stop="first_drop"``: DSpark's rule, the k before the first step where it does not rise. A measured
    verify cost is a staircase (rows go through the kernels in tiles: on the 2-core EPYC 1-3 positions cost alike,
    then 4-5, 6-8, 9-12), and the first drop stops at the first stair while the best k climbs it. Either way the
    kept set is a function of the tree and its survivals only, never of the target's choices. ``overhead``: seconds
    a round costs besides its verify (drafting, commit), which makes extra nodes relatively cheaper. ``min_nodes``
    non-root nodes are kept regardless (capped at the tree's). ``stop="threshold"``: DeepSpec's decoder cut, the
    cost only reported: the nodes whose path survival over their parent's, and every ancestor's, is at least
    ``threshold`` (on a chain: up to the first position below it; a node of survival 0 never), then ``min_nodes``
    as above. Returns (the prefix-closed subtree, info)."""
    if not isinstance(min_nodes, int) or isinstance(min_nodes, bool) or min_nodes < 0:
        raise TreeError(f"min_nodes must be an int >= 0 (non-root nodes always kept), got {min_nodes!r}")
    if stop not in STOPS:
        raise TreeError(f"stop must be one of {', '.join(map(repr, STOPS))}, got {stop!r}")
    if stop == "threshold":
        check_threshold(threshold)
    cost_of = cost_function(cost)
    surv = path_survival(tree, survival)
    # Stable sort on -survival: ties keep index order, and running-min survival makes parents precede children.
    order = (torch.sort(-surv[1:], stable=True).indices + 1).tolist()
    vals = surv.tolist()

    def seconds(nodes: int) -> float:  # a round's; 0 or NaN (a user's callable) would break tokens per second
        sec = overhead + float(cost_of(nodes))
        if not sec > 0 or not math.isfinite(sec):
            raise TreeError(f"cost({nodes}) returned {sec - overhead}: a verify cost must be a finite number of "
                            "seconds > 0")
        return sec

    if stop == "threshold":
        pars = tree.parents.tolist()
        passed = [True] + [False] * (len(vals) - 1)
        for i in range(1, len(vals)):  # parents first; a node's conditional is its path survival over its parent's
            passed[i] = passed[pars[i]] and vals[i] >= threshold * vals[pars[i]] and vals[i] > 0
        floor = set(order[: min(min_nodes, len(order))])
        keep = sorted(i for i in range(len(vals)) if passed[i] or i in floor)
        out = tree.subset(torch.tensor(keep, dtype=torch.long)) if len(keep) < tree.size else tree
        expected = 1.0 + sum(vals[i] for i in keep[1:])
        return out, {"nodes_in": tree.size - 1, "kept": len(keep) - 1, "expected_tokens": expected,
                     "objective": expected / seconds(len(keep)), "nodes": keep}
    expected, best = [1.0], [1.0 / seconds(1)]  # per k kept: expected tokens, objective
    for k, node in enumerate(order, start=1):
        expected.append(expected[-1] + vals[node])
        best.append(expected[-1] / seconds(k + 1))
        if stop == "first_drop" and k > min_nodes and not best[k] > best[k - 1]:
            best.pop(), expected.pop()
            break  # the first drop ends the schedule: no look-ahead past it
    floor = min(min_nodes, len(order))
    k = max(range(floor, len(best)), key=lambda j: (best[j], -j)) if stop == "best" else len(best) - 1
    keep = sorted([0] + order[:k])
    out = tree.subset(torch.tensor(keep, dtype=torch.long)) if k < len(order) else tree
    info = {"nodes_in": tree.size - 1, "kept": k, "expected_tokens": expected[k], "objective": best[k],
            "nodes": keep}
    return out, info


# ---- calibration --------------------------------------------------------------------------------------------
LOG_T_RANGE = (math.log(0.02), math.log(50.0))


def _bce(logits: torch.Tensor, labels: torch.Tensor, log_t: float) -> float:
    z = logits / math.exp(log_t)
    return float(torch.nn.functional.binary_cross_entropy_with_logits(z, labels))


def _fit_log_temperature(logits: torch.Tensor, labels: torch.Tensor, lo: float, hi: float) -> float:
    """argmin over log T in [lo, hi] of the BCE: a grid for the bracket, then golden-section search inside it
    (the BCE is convex in 1/T, hence unimodal in log T)."""
    grid = torch.linspace(lo, hi, 49).tolist()
    losses = [_bce(logits, labels, u) for u in grid]
    best = min(range(len(grid)), key=lambda i: losses[i])
    a, b = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    phi = (math.sqrt(5) - 1) / 2
    c, d = b - phi * (b - a), a + phi * (b - a)
    fc, fd = _bce(logits, labels, c), _bce(logits, labels, d)
    for _ in range(40):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - phi * (b - a)
            fc = _bce(logits, labels, c)
        else:
            a, c, fc = c, d, fd
            d = a + phi * (b - a)
            fd = _bce(logits, labels, d)
    return (a + b) / 2


def _check_kn(name: str, x: torch.Tensor, shape) -> None:
    if x.dim() != 2 or (shape is not None and tuple(x.shape) != tuple(shape)):
        want = "[N, K]" if shape is None else str(list(shape))
        raise TreeError(f"{name} must be a 2-D tensor {want} (rows = drafts, columns = draft positions), got "
                        f"shape {tuple(x.shape)}")


def calibrate_temperatures(logits: torch.Tensor, accepted: torch.Tensor, valid: torch.Tensor,
                           log_t_range: tuple[float, float] = LOG_T_RANGE, min_rows: int = 1) -> torch.Tensor:
    """Sequential temperature scaling: for each draft position k, left to right, the T_k minimising the binary
    cross-entropy of sigmoid(logits[:, k] / T_k) against ``accepted[:, k]`` over the rows with ``valid[:, k]``
    (position k reached: all earlier positions accepted, label present). Returns float [K]. A position with
    fewer than ``min_rows`` valid rows keeps the previous position's temperature (1.0 at the first): deep
    positions are rarely reached, and a handful of rows is no fit."""
    logits = torch.as_tensor(logits).double()
    _check_kn("logits", logits, None)
    accepted = torch.as_tensor(accepted).bool()
    valid = torch.as_tensor(valid).bool()
    _check_kn("accepted", accepted, logits.shape)
    _check_kn("valid", valid, logits.shape)
    lo, hi = log_t_range
    temps = torch.ones(logits.shape[1], dtype=torch.float32)
    for k in range(logits.shape[1]):
        rows = valid[:, k]
        if int(rows.sum()) < max(1, min_rows):
            temps[k] = temps[k - 1] if k else 1.0
            continue
        temps[k] = math.exp(_fit_log_temperature(logits[rows, k], accepted[rows, k].double(), lo, hi))
    return temps


def apply_temperatures(logits: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """Calibrated per-position probabilities sigmoid(logits[:, k] / temps[k])."""
    logits = torch.as_tensor(logits)
    return torch.sigmoid(logits / torch.as_tensor(temps, dtype=logits.dtype).to(logits.device))


def expected_calibration_error(probs: torch.Tensor, outcomes: torch.Tensor, bins: int = 10,
                               valid: torch.Tensor | None = None) -> float:
    """Equal-width-bin ECE: sum over bins of (share of entries) * |mean probability - mean outcome|, over the
    entries where ``valid`` is True (all entries without it)."""
    p = torch.as_tensor(probs).double().reshape(-1)
    y = torch.as_tensor(outcomes).double().reshape(-1)
    if p.numel() != y.numel():
        raise TreeError(f"probs ({p.numel()}) and outcomes ({y.numel()}) must have the same number of entries")
    if valid is not None:
        m = torch.as_tensor(valid).bool().reshape(-1)
        p, y = p[m], y[m]
    if p.numel() == 0:
        return 0.0
    idx = (p * bins).long().clamp(0, bins - 1)
    # sum_b (n_b / n) |mean_b(p) - mean_b(y)| = sum_b |sum_b(p - y)| / n
    gap = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, p - y)
    return float(gap.abs().sum() / p.numel())


def prefix_ece(probs: torch.Tensor, accepted: torch.Tensor, exists: torch.Tensor | None = None,
               bins: int = 10) -> float:
    """ECE of the paper's view: predicted survival prod_{i<=k} probs[:, i] against realised prefix acceptance
    (all positions <= k accepted), over the entries whose label exists (``exists``; all without it). Unlike
    ``valid``, ``exists`` keeps rows past a rejection: their realised prefix acceptance is 0."""
    probs = torch.as_tensor(probs).double()
    _check_kn("probs", probs, None)
    accepted = torch.as_tensor(accepted).bool()
    _check_kn("accepted", accepted, probs.shape)
    predicted = torch.cumprod(probs, dim=1)
    realised = torch.cumprod(accepted.double(), dim=1)
    return expected_calibration_error(predicted, realised, bins, exists)
