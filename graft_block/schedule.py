"""Confidence-scheduled verification as a decoder schedule object (the algorithm is ``tree/schedule.py``).

``ConfidenceSchedule(cost, min_nodes=0, stop="best")`` is what ``SpeculativeDecoder(schedule=...)`` takes: each round the decoder
calls ``schedule.apply(tree, state, drafter)`` after graft, and verifies the returned subtree. Survival per node:
``drafter.node_survival(tree)`` when the drafter offers it and it returns a tensor (a confidence head), else the
tree's own path probabilities (``survival_from_scores``). Neither reads the target, so the kept set never
depends on the target's choices and decoding stays exactly the target's law.
"""
from __future__ import annotations

from collections import Counter

from graft_block.tree import Tree, TreeError
from graft_block.tree.schedule import convex_cost_curve, cost_function, survival_from_scores, schedule_tree

from .errors import ConfigError


class ConfidenceSchedule:
    """Cut each round's tree to the nodes worth their verify cost (DSpark's Algorithm 1 at batch 1).

    ``cost``: a callable nodes -> verify seconds (root included) or the harness's verify-cost curve
    (``{"median_s": {"1": s, ...}}``). ``min_nodes``: non-root nodes kept every round whatever the cost says.
    ``stop``: "best" (the node count of the highest expected tokens per second; the measured curve's stairs are
    real and it climbs them) or "first_drop" (DSpark's early stop; the curve is then read through its lower convex
    envelope, on which the first drop is the best cut: ``tree/schedule.convex_cost_curve``). ``survival``: "drafter"
    (its ``node_survival`` when it has one, else path probabilities) or "scores" (path probabilities always)."""

    def __init__(self, cost, min_nodes: int = 0, stop: str = "best", survival: str = "drafter"):
        if not isinstance(min_nodes, int) or isinstance(min_nodes, bool) or min_nodes < 0:
            raise ConfigError(f"schedule min_nodes must be an int >= 0 (non-root nodes always kept), got {min_nodes!r}")
        if stop not in ("best", "first_drop"):
            raise ConfigError(f"schedule stop must be 'best' or 'first_drop', got {stop!r}")
        if survival not in ("drafter", "scores"):
            raise ConfigError(f"schedule survival must be 'drafter' (its confidence head where it has one) or "
                              f"'scores' (path probabilities), got {survival!r}")
        self.survival_from = survival
        try:
            envelope = isinstance(cost, dict) and stop == "first_drop"
            self.cost = cost_function(convex_cost_curve(cost) if envelope else cost)
        except TreeError as exc:
            raise ConfigError(f"schedule cost: {exc}") from None
        self.curve = cost if isinstance(cost, dict) else None
        self.min_nodes, self.stop = min_nodes, stop
        self.reset_stats()

    def survival(self, tree: Tree, drafter=None):
        """(survival tensor, where it came from): the drafter's confidence head first, the tree's scores else."""
        head = getattr(drafter, "node_survival", None) if self.survival_from == "drafter" else None
        if head is not None:
            s = head(tree)
            if s is not None:
                return s, "drafter"
        return survival_from_scores(tree), "scores"

    @staticmethod
    def overhead(state) -> float:
        """Mean seconds per round outside the verify so far (drafting, tree building, commit), from the decoder's
        own phase timer: a round costs that plus its verify. Timing only, never the target's choices."""
        timer = getattr(state, "timer", None)
        if timer is None or not getattr(state, "round", 0):
            return 0.0
        return sum(timer.totals.get(p, 0.0) for p in ("draft", "tree", "commit")) / state.round

    def apply(self, tree: Tree, state=None, drafter=None) -> Tree:
        """The scheduled subtree of ``tree``. Of ``state`` only the phase timer is read (the schedule must not read
        the target's choices)."""
        survival, source = self.survival(tree, drafter)
        try:
            out, info = schedule_tree(tree, survival, self.cost, self.min_nodes, self.overhead(state), self.stop)
        except TreeError as exc:
            raise ConfigError(f"confidence schedule: {exc} (a drafter's node_survival must return one probability "
                              "per node of the tree it is given)") from None
        s = self.stats
        s["rounds"] += 1
        s["nodes_in"] += info["nodes_in"]
        s["nodes_kept"] += info["kept"]
        s["expected_tokens"] += info["expected_tokens"]
        s["survival_source"][source] += 1
        return out

    def summary(self) -> dict:
        """Per-round means: nodes in and kept, the share kept, expected tokens per round; survival sources."""
        s = self.stats
        r = max(s["rounds"], 1)
        return {"rounds": s["rounds"], "min_nodes": self.min_nodes, "stop": self.stop, "mean_nodes_in": s["nodes_in"] / r,
                "mean_nodes_kept": s["nodes_kept"] / r,
                "kept_share": s["nodes_kept"] / s["nodes_in"] if s["nodes_in"] else None,
                "mean_expected_tokens": s["expected_tokens"] / r,
                "survival_source": dict(s["survival_source"])}

    def reset_stats(self) -> None:
        self.stats = {"rounds": 0, "nodes_in": 0, "nodes_kept": 0, "expected_tokens": 0.0,
                      "survival_source": Counter()}

    def describe(self) -> dict:
        return {"min_nodes": self.min_nodes, "stop": self.stop, "survival": self.survival_from, "cost": "curve" if self.curve is not None else "callable"}
