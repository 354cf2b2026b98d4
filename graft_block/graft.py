"""Graft: prune the draft tree where it is unconfident, spend the freed slots on retrieved candidates from the
adjacency matrix, keep the total verification budget. Also the ablations (pruning only, fixed split, retrieval
only), Graft-TAIL for chain/block drafters and the static in-place variant for fixed-shape (CUDA-graph) serving.

``Graft(...)`` is a decoder graft object: ``apply(tree, state) -> Tree``, ``observe(verified, state)``, ``budget``.

Modes:
- ``"graft"``: calibrated pruning (pruning.py) picks a stage; keep that stage's draft allowance (the best A draft
  nodes, ancestor-closed) and fill the rest of the budget with a retrieval tree rooted at the current token,
  trie-merged (duplicates of draft nodes are not re-added, their retrieved children hang under the draft node).
- ``"prune"``: the same pruning, no retrieval (the tree shrinks).
- ``"fixed"``: a fixed draft/retrieval split every round (no adaptive pruning).
- ``"retrieve_only"``: ignore the draft; the whole budget is retrieval (Token Recycling on top of any drafter).
- ``"tail"``: Graft-TAIL: keep the confident prefix of a chain/block (per-node confidence >= ``tail_threshold``)
  and replace the tail with retrieval rooted at the last kept token.
- ``"static"``: node count fixed at the incoming tree's size; draft nodes whose path confidence is below
  ``static_threshold`` are swapped for retrieved ones.
If retrieval yields fewer nodes than its allowance (unknown rows, de-duplication), the next best draft nodes fill
the gap (``refill``), so no slot is wasted and the grafted tree still contains every node pruning kept.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Protocol, runtime_checkable

import torch

from graft_block.tree import SOURCE_RETRIEVED, Tree, TreeError, merge, root_only
from graft_block.tree.schedule import integer_key
from graft_block.tree.templates import asymmetric_template, compile_template

from .adjacency import AdjacencyMatrix
from .drafter import check_flag, check_number, is_count, read_config_json, resolve_checkpoint
from .errors import ConfigError
from .kernels import expand as expand_template
from .pruning import (CHECKPOINTS, SIGNALS, fired_stage, normalize_thresholds, path_min_scores, ranked_nodes,
                      reorder, top_nodes, tree_signals)

ATTACH = ("root", "frontier", "both")
# Draft nodes kept per fired stage at Graft's 60-slot budget (seed article); scaled linearly to other budgets.
DEFAULT_DRAFT_ALLOWANCES = {0: 8, 1: 24, 5: 40}
REFERENCE_BUDGET = 60


@runtime_checkable
class RetrievalDrafter(Protocol):
    """A drafter that owns an adjacency matrix (recycling, pld_matrix): Graft shares it instead of a second one."""

    matrix: AdjacencyMatrix | None

    def ensure_matrix(self, target) -> AdjacencyMatrix: ...


class Graft:
    def __init__(self, budget: int = 60, matrix: AdjacencyMatrix | None = None, mode: str = "graft",
                 checkpoints=CHECKPOINTS, thresholds: dict | None = None, signal: str = "mass",
                 draft_allowances: dict | None = None, reference_budget: int = REFERENCE_BUDGET,
                 fixed_draft_fraction: float = 0.5, template_depth: int = 8, template_width: int = 8,
                 templates: dict | None = None, attach: str = "root", frontier_share: float = 0.5,
                 tail_threshold: float = 0.3, tail_confidence: str = "marginal",
                 static_threshold: float = math.log(0.05), refill: bool = True, update_matrix: bool = True,
                 record_signals: bool = False):
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise ConfigError(f"Graft budget must be an int >= 1 (non-root nodes per round), got {budget!r}")
        if mode not in POLICIES:
            raise ConfigError(f"unknown Graft mode {mode!r}; choose one of {tuple(POLICIES)}")
        if signal not in SIGNALS:
            raise ConfigError(f"unknown pruning signal {signal!r}; choose one of {SIGNALS}")
        if attach not in ATTACH:
            raise ConfigError(f"attach must be one of {ATTACH}, got {attach!r}")
        if tail_confidence not in ("marginal", "cumulative"):
            raise ConfigError(f"tail_confidence must be 'marginal' or 'cumulative', got {tail_confidence!r}")
        for name, v in (("fixed_draft_fraction", fixed_draft_fraction), ("frontier_share", frontier_share)):
            check_number(v, name, 0.0, 1.0, "a share of the budget")
        # the two tails read different scales: a log-prob for a probability (or back) kept every node or none
        check_number(tail_threshold, "tail_threshold", 0.0, 1.0, "a per-node confidence, a probability")
        if static_threshold != math.inf:  # inf: swap every draft node
            check_number(static_threshold, "static_threshold", -math.inf, 0.0, "a log-probability (-3.0 = log 0.05)")
        for name, v in (("refill", refill), ("update_matrix", update_matrix), ("record_signals", record_signals)):
            check_flag(v, name)
        if not isinstance(checkpoints, (list, tuple)) or not all(is_count(c, 0) for c in checkpoints):
            raise ConfigError(f"checkpoints must be a list of draft depths (ints >= 0), got {checkpoints!r}")
        if matrix is None and mode != "prune":
            raise ConfigError(f"Graft mode {mode!r} retrieves candidates: pass matrix=AdjacencyMatrix(...) "
                              "(only mode='prune' works without one)")
        self.budget, self.matrix, self.mode = budget, matrix, mode
        self.checkpoints = tuple(sorted(int(c) for c in checkpoints))
        self.signal = signal
        self.thresholds = normalize_thresholds(thresholds, self.checkpoints, signal)
        allow = {}
        for k, v in (draft_allowances or DEFAULT_DRAFT_ALLOWANCES).items():
            depth = integer_key(k)  # JSON keys are text
            if depth is None or depth < 0 or not is_count(v, 0):
                raise ConfigError(f"draft_allowances maps checkpoint depths to draft nodes kept (ints >= 0), got "
                                  f"{k!r}: {v!r}")
            allow[depth] = v
        missing = [c for c in self.checkpoints if c not in allow]
        if missing:
            raise ConfigError(f"draft_allowances lacks checkpoints {missing}; give one allowance per checkpoint")
        self.draft_allowances = allow
        if isinstance(reference_budget, bool) or not isinstance(reference_budget, int) or reference_budget < 1:
            raise ConfigError(f"reference_budget must be an int >= 1 (the budget draft_allowances were set for, "
                              f"{REFERENCE_BUDGET} by default), got {reference_budget!r}")
        self.reference_budget = reference_budget
        self.fixed_draft_fraction = float(fixed_draft_fraction)
        for name, v in (("template_depth", template_depth), ("template_width", template_width)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"Graft {name} must be an int >= 1 (retrieval template levels / ranks per node), "
                                  f"got {v!r}")
        self.template_depth, self.template_width = template_depth, template_width
        # the matrix's successors per row: a rank >= k has no column, so such template paths would fill no slot
        self.matrix_k = None if matrix is None else int(getattr(matrix, "k", None) or matrix.shape[1])
        self.attach, self.frontier_share = attach, float(frontier_share)
        self.tail_threshold, self.tail_confidence = float(tail_threshold), tail_confidence
        self.static_threshold = float(static_threshold)
        self.refill, self.update_matrix = refill, update_matrix
        # One best-first list serves every stage: a stage with retrieval allowance B uses its first B paths, and
        # the rest are spares for slots freed by de-duplication.
        spare = budget + budget // 2 + 8
        default = asymmetric_template(min(spare, self._capacity()), self.template_depth, self._width())
        self.templates = {"default": compile_template(default)}
        for key, tmpl in (templates or {}).items():
            try:  # a bad template is named now, not as a TreeError in the first round
                ct = compile_template(tmpl)
                self.templates[key if key in ("default", "fixed", "tail", "static", "retrieve_only") else int(key)] = ct
            except (TreeError, TypeError, ValueError) as exc:
                raise ConfigError(f"Graft templates[{key!r}]: {exc} (keys: a stage checkpoint or 'default', 'fixed', "
                                  "'tail', 'static', 'retrieve_only'; values: lists of rank paths)") from None
            if self.matrix_k is not None and ct.size and int(ct.ranks.max()) >= self.matrix_k:
                raise ConfigError(f"Graft templates[{key!r}] uses rank {int(ct.ranks.max())} but the adjacency matrix "
                                  f"holds k={self.matrix_k} successors per row (ranks 0..{self.matrix_k - 1}): its "
                                  f"higher-rank paths would never fill a slot; drop them or build the matrix with a "
                                  f"larger k")
        self.record_signals = record_signals
        self.signal_log: dict[int, list[float]] = {c: [] for c in self.checkpoints}
        self.stats = {"rounds": 0, "stage_counts": Counter(), "draft_nodes": 0, "retrieved_nodes": 0,
                      "retrieved_accepted": 0, "rounds_with_retrieved_hit": 0, "accepted": 0}
        self._last: dict | None = None

    def _width(self) -> int:
        """Ranks the default template uses: ``template_width``, capped at the matrix's k."""
        return self.template_width if self.matrix_k is None else min(self.template_width, self.matrix_k)

    def _capacity(self) -> int:
        return sum(self._width() ** d for d in range(1, self.template_depth + 1))

    # ---- allowances ---------------------------------------------------------------------------------------
    def draft_allowance(self, stage) -> int:
        """Draft nodes kept when pruning fired at ``stage`` (None = never fired = the full budget)."""
        if stage is None:
            return self.budget
        if stage == "fixed":
            return int(round(self.fixed_draft_fraction * self.budget))
        a = self.draft_allowances[int(stage)] * self.budget / self.reference_budget
        return max(0, min(self.budget, int(round(a))))

    def template_for(self, stage):
        return self.templates.get(stage, self.templates["default"])

    # ---- the policy ---------------------------------------------------------------------------------------
    def stage_of(self, tree: Tree):
        sig = tree_signals(tree, self.checkpoints, self.signal)
        if self.record_signals:
            for c, v in sig.items():
                self.signal_log[c].append(v)
        return fired_stage(sig, self.thresholds)

    @torch.no_grad()
    def apply(self, tree: Tree, state=None) -> Tree:
        root = int(tree.tokens[0]) if state is None else int(state.root_token)
        if int(tree.tokens[0]) != root:
            raise ConfigError(f"draft tree root {int(tree.tokens[0])} != state.root_token {root}")
        stage, out = POLICIES[self.mode](self, tree, root)
        self._last = {"stage": stage}
        return out

    def hybrid(self, kept: Tree, draft: Tree, stage, budget: int, attach_node: int | None = None) -> Tree:
        """``kept`` plus retrieved candidates up to ``budget`` nodes, then (refill) the next best draft nodes."""
        tmpl = self.template_for(stage)
        out = kept
        attach = self.attach if attach_node is None else "frontier"
        if attach in ("frontier", "both"):
            node = best_path_end(kept) if attach_node is None else attach_node
            # Frontier-only (or nothing kept to continue) takes every free slot; "both" leaves the rest to the root.
            share = budget if (attach == "frontier" or node == 0) else kept.size - 1 + int(round(
                self.frontier_share * (budget - kept.size + 1)))
            ret = expand_template(int(kept.tokens[node]), tmpl, self.matrix)
            out = merge(out, ret, budget=share, attach=node)
        if attach in ("root", "both"):
            out = merge(out, expand_template(int(kept.tokens[0]), tmpl, self.matrix), budget=budget)
        if self.refill and out.size - 1 < budget and draft.size > 1:
            out = merge(out, reorder(draft, ranked_nodes(draft)), budget=budget)
        return out

    # ---- after verification -------------------------------------------------------------------------------
    def observe(self, verified, state=None) -> None:
        if self.matrix is not None and self.update_matrix:
            self.matrix.update(verified.tree.tokens, verified.logits)
        last, self._last = self._last, None
        s = self.stats
        s["rounds"] += 1
        s["accepted"] += verified.accepted
        if last is not None:
            s["stage_counts"][str(last["stage"])] += 1
            # the verified tree's nodes: a schedule (or the context window) may cut the grafted tree after apply
            s["draft_nodes"] += verified.tree.num_drafted
            s["retrieved_nodes"] += verified.tree.num_retrieved
        hits = int((verified.tree.sources[verified.path] == SOURCE_RETRIEVED).sum())
        s["retrieved_accepted"] += hits
        s["rounds_with_retrieved_hit"] += int(hits > 0)

    def summary(self) -> dict:
        """Per-round statistics: which stage fired, nodes drafted/retrieved in the verified tree (after any schedule
        cut), retrieval hit rates over those."""
        s = self.stats
        r = max(s["rounds"], 1)
        return {"mode": self.mode, "rounds": s["rounds"], "stage_counts": dict(s["stage_counts"]),
                "mean_draft_nodes": s["draft_nodes"] / r, "mean_retrieved_nodes": s["retrieved_nodes"] / r,
                "retrieved_accepted_per_round": s["retrieved_accepted"] / r,
                "retrieved_hit_rate_per_node": s["retrieved_accepted"] / max(s["retrieved_nodes"], 1),
                "rounds_with_retrieved_hit": s["rounds_with_retrieved_hit"] / r}

    def reset_stats(self) -> None:
        self.stats = {"rounds": 0, "stage_counts": Counter(), "draft_nodes": 0, "retrieved_nodes": 0,
                      "retrieved_accepted": 0, "rounds_with_retrieved_hit": 0, "accepted": 0}

    def describe(self) -> dict:
        """JSON-able config (store it next to the drafter config; thresholds are log-probabilities)."""
        return {"budget": self.budget, "mode": self.mode, "signal": self.signal,
                "checkpoints": list(self.checkpoints), "thresholds": {str(k): v for k, v in self.thresholds.items()},
                "draft_allowances": {str(k): v for k, v in self.draft_allowances.items()},
                "reference_budget": self.reference_budget, "fixed_draft_fraction": self.fixed_draft_fraction,
                "template_depth": self.template_depth, "template_width": self.template_width, "attach": self.attach,
                "frontier_share": self.frontier_share, "tail_threshold": self.tail_threshold,
                "tail_confidence": self.tail_confidence, "static_threshold": self.static_threshold,
                "refill": self.refill, "update_matrix": self.update_matrix}

    def state_bytes(self) -> int:
        """Bytes of retrieval state (the adjacency matrix) this graft holds."""
        return 0 if self.matrix is None else int(self.matrix.nbytes)

    @classmethod
    def from_config(cls, cfg: dict, matrix: AdjacencyMatrix | None = None, target=None, drafter=None) -> "Graft":
        """From ``describe()`` output or a drafter config's ``"graft"`` entry (calibration keys are accepted).

        Matrix, first match: ``matrix``; the drafter's own ``.matrix`` (a retrieval drafter: one shared matrix);
        a saved file at ``cfg["matrix"]``; a new one for ``target`` (``k``, ``matrix_dtype``) warmed up with
        ``warmup_rounds`` (default 5) ShareGPT calibration prompts when the target has a tokenizer. ``budget``
        defaults to the drafter's; without ``thresholds``, those ``graft_block.calibrate`` saved in the drafter's
        checkpoint config.json apply (``saved_calibration``)."""
        cfg = {k: v for k, v in dict(cfg).items() if k not in ("quantile", "rule", "prompts", "prompt_source",
                                                                   "grid", "max_new_tokens")}
        if drafter is not None and "thresholds" not in cfg:
            cfg.update(saved_calibration(drafter, cfg))
        k, warmup_rounds = matrix_counts(cfg)
        for key in ("k", "warmup_rounds"):
            cfg.pop(key, None)
        mdtype = cfg.pop("matrix_dtype", "int32")
        path = cfg.pop("matrix", None)
        if drafter is not None and "budget" not in cfg:
            cfg["budget"] = int(drafter.budget)
        if matrix is None and isinstance(drafter, RetrievalDrafter):
            matrix = drafter.matrix if drafter.matrix is not None or target is None else drafter.ensure_matrix(target)
        if matrix is None and path is not None:
            matrix = AdjacencyMatrix.load(path, device="cpu" if target is None else target.device)
        if matrix is not None and target is not None:
            matrix.check_target(target)
            matrix.to_(target.device)
        if matrix is None and target is not None and cfg.get("mode", "graft") != "prune":
            matrix = AdjacencyMatrix(target.vocab_size, k, mdtype, target.device)
            if warmup_rounds and getattr(target, "tokenizer", None) is not None:
                matrix.warmup(target, rounds=warmup_rounds)
        try:
            return cls(matrix=matrix, **cfg)
        except TypeError as exc:
            raise ConfigError(f"bad Graft config: {exc}") from exc


def matrix_counts(cfg: dict) -> tuple[int, int]:
    """A Graft config's new-matrix settings ``(k, warmup_rounds)`` (defaults 8, 5), or a ConfigError: ``int()``
    turned "x" into a bare ValueError and 2.7 into 2."""
    k, rounds = cfg.get("k", 8), cfg.get("warmup_rounds", 5)
    for key, value, least in (("k", k, 1), ("warmup_rounds", rounds, 0)):
        if not is_count(value, least):
            raise ConfigError(f"graft {key} must be an int >= {least}, got {value!r}")
    return k, rounds


def saved_calibration(drafter, cfg: dict) -> dict:
    """``signal``, ``checkpoints`` and ``thresholds`` from the ``"graft"`` entry that ``graft_block.calibrate``
    saved in the drafter's config file (held as ``drafter.graft_calibration``) or checkpoint config.json; {} when
    there is none or ``cfg`` names another signal or other checkpoints (thresholds are log-probabilities of one
    signal at given depths)."""
    saved = getattr(drafter, "graft_calibration", None)
    ckpt = getattr(drafter, "checkpoint", None)
    if saved is None and ckpt is not None:
        saved = read_config_json(resolve_checkpoint(ckpt)).get("graft")
    if not isinstance(saved, dict) or not saved.get("thresholds"):
        return {}
    cal = {k: saved[k] for k in ("signal", "checkpoints", "thresholds") if k in saved}
    if "signal" in cfg and cfg["signal"] != cal.get("signal", "mass"):
        return {}
    if "checkpoints" in cfg and sorted(map(str, cfg["checkpoints"])) != \
            sorted(map(str, cal.get("checkpoints", CHECKPOINTS))):  # str: a malformed list is Graft's to name
        return {}
    return cal


def best_path_end(tree: Tree) -> int:
    """Follow the highest-scoring child from the root to a leaf; the node where retrieval can continue a chain."""
    n = tree.size
    if n == 1:
        return 0
    pars, scores = tree.parents.tolist(), tree.scores.tolist()
    best_child: dict[int, int] = {}
    for i in range(1, n):
        b = best_child.get(pars[i])
        if b is None or scores[i] > scores[b]:
            best_child[pars[i]] = i
    cur = 0
    while cur in best_child:
        cur = best_child[cur]
    return cur


# ---- the mode policies: (graft, draft tree, root token) -> (stage label, tree to verify) --------------------
def graft_policy(g: "Graft", tree: Tree, root: int):
    """Calibrated pruning picks a stage; keep its draft allowance and fill the budget with retrieval."""
    stage = g.stage_of(tree)
    kept = tree.subset(top_nodes(tree, g.draft_allowance(stage)))
    return stage, kept if stage is None else g.hybrid(kept, tree, stage, g.budget)


def prune_policy(g: "Graft", tree: Tree, root: int):
    """The same pruning, no retrieval: the tree shrinks."""
    stage = g.stage_of(tree)
    return stage, tree.subset(top_nodes(tree, g.draft_allowance(stage)))


def fixed_policy(g: "Graft", tree: Tree, root: int):
    """A fixed draft/retrieval split every round."""
    kept = tree.subset(top_nodes(tree, g.draft_allowance("fixed")))
    return "fixed", g.hybrid(kept, tree, "fixed", g.budget)


def retrieve_only_policy(g: "Graft", tree: Tree, root: int):
    """A pure ablation: no draft node is used, not even to refill."""
    empty = root_only(root)
    return "retrieve_only", g.hybrid(empty, empty, "retrieve_only", g.budget)


def tail_policy(g: "Graft", tree: Tree, root: int):
    """Graft-TAIL: keep nodes whose confidence (and every ancestor's) passes; retrieve from the last kept token."""
    if g.tail_confidence == "marginal":
        par = tree.parents.clamp(min=0)
        conf = torch.exp(tree.scores.double() - tree.scores.double()[par])
    else:
        conf = torch.exp(tree.scores.double())
    ok = (conf >= g.tail_threshold).tolist()
    pars = tree.parents.tolist()
    keep = [True] + [False] * (tree.size - 1)
    for i in range(1, tree.size):
        keep[i] = ok[i] and keep[pars[i]]
    idx = torch.tensor([i for i, k in enumerate(keep) if k], dtype=torch.long)
    kept = tree.subset(idx[: g.budget + 1])
    if kept.size - 1 >= g.budget:
        return "tail_none", kept
    end = best_path_end(kept)
    return f"tail@{int(kept.depths[end])}", g.hybrid(kept, tree, "tail", g.budget, attach_node=end)


def static_policy(g: "Graft", tree: Tree, root: int):
    """Same node count as the incoming tree; low-confidence draft nodes are replaced by retrieved ones."""
    n = min(tree.size - 1, g.budget)
    eff = path_min_scores(tree)
    confident = int((eff[1:] >= g.static_threshold).sum())
    kept = tree.subset(top_nodes(tree, min(confident, n)))
    if kept.size - 1 >= n:
        return "static_none", kept
    return "static", g.hybrid(kept, tree, "static", n)


POLICIES = {"graft": graft_policy, "prune": prune_policy, "fixed": fixed_policy, "tail": tail_policy,
            "static": static_policy, "retrieve_only": retrieve_only_policy}
