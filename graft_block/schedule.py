"""Confidence-scheduled verification as a decoder schedule object (the algorithm is ``tree/schedule.py``).

``ConfidenceSchedule(cost, min_nodes=0, stop="best", survival="drafter", adapt=8)`` is what
``SpeculativeDecoder(schedule=...)`` takes: each round the decoder calls ``schedule.apply(tree, state, drafter)``
after graft, verifies the returned subtree, and passes the round's outcome to ``schedule.observe``. Survival per
node: ``drafter.node_survival(tree)`` when the drafter offers it and it returns a tensor (a confidence head), else
the tree's own path probabilities (``survival_from_scores``), rescaled by the outcomes of the call's earlier
rounds. None of it reads this round's target choices, so decoding stays exactly the target's law.
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping

from graft_block.tree import Tree, TreeError
from graft_block.tree.schedule import (STOPS, affine_fit, calibration_keys, check_threshold, conditional_survival,
                                       convex_cost_curve, cost_function, path_survival, rescaled_survival,
                                       schedule_tree, survival_from_scores)

from .errors import ConfigError


def _add_point(sums: list[float], x: float, y: float, w: float = 1.0) -> None:
    """Add (x, y) with weight w to the moments ``affine_fit`` reads."""
    for i, v in enumerate((w, w * x, w * y, w * x * x, w * x * y)):
        sums[i] += v


def node_survival(tree: Tree, drafter=None, source: str = "drafter"):
    """(P(node accepted) per node, where it came from) as a schedule reads them: with ``source`` "drafter", the
    drafter's own ``node_survival`` (a confidence head) when it has one for this tree; else the tree's path
    probabilities."""
    head = getattr(drafter, "node_survival", None) if source == "drafter" else None
    if head is not None:
        s = head(tree)
        if s is not None:
            return s, "drafter"
    return survival_from_scores(tree), "scores"


class ConfidenceSchedule:
    """Cut each round's tree to the nodes worth their verify cost (DSpark's Algorithm 1 at batch 1).

    ``cost``: a callable nodes -> verify seconds (root included) or the harness's verify-cost curve
    (``{"median_s": {"1": s, ...}}``). ``min_nodes``: non-root nodes kept every round whatever the cost says.
    ``stop``: "best" (the node count of the highest expected tokens per second; the measured curve's stairs are
    real and it climbs them) or "first_drop" (DSpark's early stop; the curve is then read through its lower convex
    envelope, on which the first drop is the best cut: ``tree/schedule.convex_cost_curve``) or "threshold"
    (DeepSpec's decoder cut, the cost only reported: the nodes whose estimated acceptance given their parent's, and
    every ancestor's, reaches ``threshold``; with ``adapt`` on, the recalibrated estimates). ``survival``:
    "drafter" (its ``node_survival`` when it has one, else path probabilities) or "scores" (path probabilities).

    ``adapt``: online recalibration, on by default (a prior of ``adapt`` pseudo-nodes per depth; 0 = off). Survivals
    fitted offline miss on other prompts (DSpark's head on the paper suite's turns expected 1.94 tokens a round
    where 1.69 came). So after every round (``observe``) the schedule counts, per depth, apart for each parent's
    likeliest child and the others and apart for drafted and retrieved nodes (a graft's), the conditional
    acceptances it predicted for the nodes whose parent was accepted and how many were accepted, and scales each
    group's conditionals by (accepted + adapt) / (predicted + adapt) from the next round on. Counts restart with
    each generate call. The cut then depends on earlier rounds' outcomes, never on this round's, which keeps
    decoding lossless (the exact-law tests run with it, one with a graft before the schedule). Siblings'
    conditionals never sum past 1, before the factors and after them (``tree.schedule.rescaled_survival``).

    ``fit_cost``: the curve is timed once, at a run's start, and the VM's speed flips within minutes (one-token
    verify 9 or 15 ms), so by default the schedule refits it to the call's own rounds: verify seconds of each
    round against the curve's cost at that round's size, an affine least-squares fit a + b * cost(N), anchored by
    two pseudo-rounds on the curve itself (at 1 position and at the tree's size, weight ``COST_PRIOR`` each).

    ``size_draft``: a block drafter's draft costs by its rows (the forward and the LM head per row) and its tree by
    its nodes, while the cut keeps a few shallow nodes (4-5 of 16 on this CPU). So the schedule asks the next draft
    for ``SIZE_MARGIN`` more nodes than the most its last ``SIZE_WINDOW`` cuts kept (``state.draft_nodes``; the
    drafter's budget stays the cap, and n nodes reach no deeper than n rows). A cut that keeps all it was given
    grows the next draft. The size depends on earlier rounds' cuts only, so decoding stays lossless."""

    COST_PRIOR = 1.0
    SIZE_WINDOW, SIZE_MARGIN = 16, 2

    def __init__(self, cost, min_nodes: int = 0, stop: str = "best", survival: str = "drafter",
                 adapt: float = 8.0, fit_cost: bool = True, size_draft: bool = True, threshold: float = 0.5):
        if not isinstance(min_nodes, int) or isinstance(min_nodes, bool) or min_nodes < 0:
            raise ConfigError(f"schedule min_nodes must be an int >= 0 (non-root nodes always kept), got {min_nodes!r}")
        if stop not in STOPS:
            raise ConfigError(f"schedule stop must be one of {', '.join(map(repr, STOPS))}, got {stop!r}")
        try:
            check_threshold(threshold)
        except TreeError as exc:
            raise ConfigError(f"schedule {exc}") from None
        if survival not in ("drafter", "scores"):
            raise ConfigError(f"schedule survival must be 'drafter' (its confidence head where it has one) or "
                              f"'scores' (path probabilities), got {survival!r}")
        if isinstance(adapt, bool) or not isinstance(adapt, (int, float)) or not adapt >= 0:
            raise ConfigError(f"schedule adapt must be a number >= 0 (pseudo-nodes per depth of the online "
                              f"recalibration's prior; 0 = off), got {adapt!r}")
        for key, val in (("fit_cost", fit_cost), ("size_draft", size_draft)):
            if not isinstance(val, bool):
                raise ConfigError(f"schedule {key} must be true or false, got {val!r}")
        self.survival_from, self.adapt, self.fit_cost = survival, float(adapt), fit_cost
        self.size_draft = size_draft
        self._cuts: deque = deque(maxlen=self.SIZE_WINDOW)  # nodes kept by this call's last cuts
        # weighted moments of (curve cost at a round's size, its verify seconds) over this call's rounds
        self._timed = [0.0] * 5
        self._verify_mark = 0.0
        # (depth, top child, source) -> [predicted, accepted], this generate call (tree.schedule.calibration_keys)
        self._counts: dict[tuple[int, bool, int], list[float]] = {}
        self._pending = None  # (the verified subtree, its nodes' keys and predicted conditionals)
        try:
            envelope = isinstance(cost, Mapping) and stop == "first_drop"  # any mapping curve, not dict alone
            self.cost = cost_function(convex_cost_curve(cost) if envelope else cost)
        except TreeError as exc:
            raise ConfigError(f"schedule cost: {exc}") from None
        self.curve = cost if isinstance(cost, Mapping) else None
        self.min_nodes, self.stop, self.threshold = min_nodes, stop, float(threshold)
        self.reset_stats()

    @staticmethod
    def overhead(state) -> float:
        """Mean seconds per round outside the verify so far (drafting, tree building, commit; this round's draft
        counts from the first round on), from the decoder's own phase timer: a round costs that plus its verify.
        Timing only, never the target's choices."""
        timer = getattr(state, "timer", None)
        if timer is None:
            return 0.0
        done, totals = getattr(state, "round", 0), timer.totals
        # called between this round's draft and its tree: the drafts timed are one more than the rounds done
        draft = totals.get("draft", 0.0) / (done + 1)
        return draft + (sum(totals.get(p, 0.0) for p in ("tree", "commit")) / done if done else 0.0)

    def apply(self, tree: Tree, state=None, drafter=None) -> Tree:
        """The scheduled subtree of ``tree``. Of ``state`` only the round counter and the phase timer are read (the
        schedule must not read this round's target choices; earlier rounds' outcomes come through ``observe``)."""
        survival, source = node_survival(tree, drafter, self.survival_from)
        if state is None or not getattr(state, "round", 0):  # a new generate call
            self._counts, self._timed = {}, [0.0] * 5
            self._verify_mark = self._verify_total(state)
            self._cuts.clear()
        try:
            cond = conditional_survival(tree, path_survival(tree, survival).tolist())
            keys = calibration_keys(tree, cond)
            survival = offline = rescaled_survival(tree, cond, {}, keys)  # siblings exclusive, no online factors
            if self.adapt > 0 and self._counts:
                survival = rescaled_survival(tree, cond, self.factors(), keys)
                self.stats["recalibrated_rounds"] += 1
            raw = offline.tolist()
            out, info = schedule_tree(tree, survival, self.fitted_cost(tree.size), self.min_nodes,
                                      self.overhead(state), self.stop, self.threshold)
        except TreeError as exc:
            raise ConfigError(f"confidence schedule: {exc} (a drafter's node_survival must return one probability "
                              "per node of the tree it is given)") from None
        self._pending = (out, [keys[i] for i in info["nodes"]], [cond[i] for i in info["nodes"]])
        if self.size_draft and state is not None:
            self._cuts.append(info["kept"])
            state.draft_nodes = max(self._cuts) + self.SIZE_MARGIN
            self.stats["draft_nodes"] += state.draft_nodes
        s = self.stats
        s["rounds"] += 1
        s["expected_raw"] += sum(raw[i] for i in info["nodes"])  # the root's 1 included
        s["nodes_in"] += info["nodes_in"]
        s["nodes_kept"] += info["kept"]
        s["expected_tokens"] += info["expected_tokens"]
        s["survival_source"][source] += 1
        return out

    @staticmethod
    def _verify_total(state) -> float:
        timer = getattr(state, "timer", None)
        return 0.0 if timer is None else timer.totals.get("verify", 0.0)

    def fitted_cost(self, size: int):
        """The cost callable for this round: the curve, or a + b * curve refitted to this call's timed rounds."""
        if not (self.fit_cost and self._timed[0]):
            return self.cost
        sums = list(self._timed)
        for c in (float(self.cost(1)), float(self.cost(max(size, 2)))):  # the prior: two pseudo-rounds on the curve
            _add_point(sums, c, c, self.COST_PRIOR)
        a, b = affine_fit(sums)
        b = max(b, 0.0)  # noise may tilt it; a verify never gets cheaper with more positions
        self.stats["cost_fit"] = (a, b)
        self.stats["refit_rounds"] += 1
        return lambda n: max(a + b * float(self.cost(n)), 1e-9)

    def factors(self) -> dict[tuple[int, bool, int], float]:
        """(depth, top child, source) -> the online recalibration's factor on conditional acceptances:
        (accepted + adapt) / (predicted + adapt) over this generate call's rounds so far."""
        a = self.adapt
        return {d: (acc + a) / (pred + a) for d, (pred, acc) in self._counts.items()} if a > 0 else {}

    def observe(self, verified, state=None) -> None:
        """After the round: per depth, the predicted conditional acceptances of the verified nodes whose parent was
        accepted, and how many of them were (the decoder calls this; the outcome feeds later rounds only)."""
        # the walk's tokens (accepted + bonus) before the decoder's stop trim: what expected_tokens estimates
        self.stats["realised_tokens"] += int(verified.path.numel())
        total = self._verify_total(state)
        # timed whatever was verified (the decoder may cut the tree to its window), so no round's time carries over
        if self.fit_cost and state is not None and getattr(state, "timer", None) is not None:
            _add_point(self._timed, float(self.cost(verified.tree.size)), total - self._verify_mark)
        self._verify_mark = total
        if self._pending is None or self._pending[0] is not verified.tree:
            return
        tree, keys, cond = self._pending
        self._pending = None
        on_path = set(verified.path.tolist())
        pars = tree.parents.tolist()
        for i in range(1, len(pars)):
            if pars[i] in on_path:
                c = self._counts.setdefault(keys[i], [0.0, 0.0])
                c[0] += cond[i]
                c[1] += float(i in on_path)

    def summary(self) -> dict:
        """Per-round means: nodes in and kept, the share kept, expected tokens per round (as the schedule saw them,
        and before the online recalibration) and realised ones (accepted + bonus, counted before the decoder trims
        the last round at EOS or max_new_tokens, as expected is: the emitted tau is after it); survival sources."""
        s = self.stats
        r = max(s["rounds"], 1)
        return {"rounds": s["rounds"], "min_nodes": self.min_nodes, "stop": self.stop,
                "threshold": self.threshold if self.stop == "threshold" else None, "adapt": self.adapt,
                "fit_cost": self.fit_cost, "last_cost_fit": s.get("cost_fit"), "size_draft": self.size_draft,
                "mean_draft_nodes": s["draft_nodes"] / r if self.size_draft else None,
                "recalibrated_rounds": s["recalibrated_rounds"], "refit_rounds": s["refit_rounds"],
                "mean_nodes_in": s["nodes_in"] / r, "mean_nodes_kept": s["nodes_kept"] / r,
                "kept_share": s["nodes_kept"] / s["nodes_in"] if s["nodes_in"] else None,
                "mean_expected_tokens": s["expected_tokens"] / r, "mean_expected_raw": s["expected_raw"] / r,
                "mean_realised_tokens": s["realised_tokens"] / r, "survival_source": dict(s["survival_source"])}

    def reset_stats(self) -> None:
        self.stats = {"rounds": 0, "nodes_in": 0, "nodes_kept": 0, "expected_tokens": 0.0, "expected_raw": 0.0,
                      "realised_tokens": 0, "recalibrated_rounds": 0, "refit_rounds": 0, "draft_nodes": 0,
                      "survival_source": Counter()}

    def describe(self) -> dict:
        return {"min_nodes": self.min_nodes, "stop": self.stop,
                "threshold": self.threshold if self.stop == "threshold" else None, "survival": self.survival_from,
                "adapt": self.adapt,
                "fit_cost": self.fit_cost, "size_draft": self.size_draft,
                "cost": "curve" if self.curve is not None else "callable"}
