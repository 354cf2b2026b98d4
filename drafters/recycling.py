"""Retrieval-only drafters: no draft model, only the adjacency matrix.

- ``recycling``: Token Recycling: expand a static template from the root token through the matrix; after each
  verification every verified node's row is overwritten with the target's top-k there.
- ``pld_matrix``: the prompt-lookup chain, plus matrix retrieval from the root filling the rest of the budget.

Both share one ``AdjacencyMatrix`` object across prompts (pass ``matrix=`` to share it with a Graft or another
drafter). ``warmup_rounds`` > 0 fills a fresh matrix from the target on ShareGPT *calibration* prompts once.
"""
from __future__ import annotations

from pathlib import Path

import torch

from graft_block.adjacency import AdjacencyMatrix
from graft_block.drafter import Drafter, check_budget, check_flag, is_count, register
from graft_block.errors import ConfigError
from graft_block.tree import SOURCE_RETRIEVED, Tree, TreeError, chain, merge
from graft_block.kernels import expand as expand_template
from graft_block.tree.templates import TR80_TEMPLATE, asymmetric_template, compile_template, extend_template

from .pld import prompt_lookup

PLD_TOKENS = 10  # pld_matrix's default chain length (at most the budget)


def build_template(template, budget: int, depth: int, width: int, fill: bool, k: int | None = None):
    """``"tr80"`` (Token Recycling's 80-node shape, reconstructed), ``"asymmetric"`` (Graft's generator) or an explicit
    list of rank paths; with ``fill``, spare asymmetric paths follow so de-duplicated slots are refilled. ``k``: the
    matrix's successors per row; generated paths use ranks < min(width, k)."""
    if template is None:
        template = "tr80" if budget == 80 else "asymmetric"
    for name, v in (("depth", depth), ("width", width)):
        if not is_count(v, 1):
            raise ConfigError(f"template {name} must be an int >= 1, got {v!r}")
    if k is not None:  # a rank >= k has no matrix column: such paths would only leave their slots empty
        width = min(width, k)
    if template not in ("tr80", "asymmetric") and not isinstance(template, (list, tuple)):
        raise ConfigError(f"template must be 'tr80', 'asymmetric' or a list of rank paths, got {template!r}")
    try:  # a template the tree code refuses is a config mistake: name it at construction, not in round 1
        if template == "tr80":
            base = TR80_TEMPLATE
        elif template == "asymmetric":
            base = asymmetric_template(budget, depth, width)
        else:
            base = [list(p) for p in template]
        if fill:
            capacity = sum(width ** d for d in range(1, depth + 1))
            dead = 0 if k is None else sum(any(r >= k for r in p) for p in base)  # no column: they fill no slot
            base = extend_template(base, min(capacity, budget + budget // 2 + 8) + dead, depth, width)
        return compile_template(base)
    except (TreeError, TypeError, ValueError) as exc:
        raise ConfigError(f"recycling template (budget={budget}, depth={depth}, width={width}"
                          f"{'' if k is None else f', matrix k={k}'}): {exc}") from None


@register("recycling")
class RecyclingDrafter(Drafter):
    def __init__(self, target=None, budget: int = 80, k: int = 8, warmup_rounds: int = 5, warmup_tokens: int = 64,
                 template=None, depth: int = 6, width: int = 8, matrix=None, dtype: str = "int32",
                 fill: bool = True, warmup_prompts=None):
        self.budget = check_budget(budget)
        for name, v in (("warmup_rounds", warmup_rounds), ("warmup_tokens", warmup_tokens)):
            if not is_count(v):
                raise ConfigError(f"{name} must be an int >= 0 (warm-up prompts, and tokens generated on each), "
                                  f"got {v!r}")
        if not is_count(k, 1):
            raise ConfigError(f"k (matrix successors per row) must be an int >= 1, got {k!r}")
        self.k, self.dtype = k, dtype
        self.warmup_rounds, self.warmup_tokens = warmup_rounds, warmup_tokens
        self.warmup_prompts = warmup_prompts
        if isinstance(matrix, (str, Path)):
            matrix = AdjacencyMatrix.load(matrix)
        if matrix is not None and not isinstance(matrix, AdjacencyMatrix):
            raise ConfigError(f"matrix must be an AdjacencyMatrix or a saved matrix path, got {type(matrix).__name__}")
        if matrix is not None and matrix.k < self.k:
            raise ConfigError(f"shared matrix has k={matrix.k} < drafter k={self.k}: "
                              f"build the matrix with k >= {self.k}")
        self.matrix = matrix
        self.template_name = template if isinstance(template, str) or template is None else "custom"
        # the matrix this drafter reads has matrix.k columns (self.k when it builds its own)
        self.template = build_template(template, self.budget, depth, width, check_flag(fill, "fill"),
                                       self.k if matrix is None else matrix.k)
        self.stats = {"rounds": 0, "retrieved_nodes": 0, "retrieved_accepted": 0, "rounds_with_retrieved_hit": 0}
        if target is not None:
            self.ensure_matrix(target)

    def ensure_matrix(self, target) -> AdjacencyMatrix:
        """Create the matrix on the target's device (once), or move a given or loaded one there, and warm it up if
        it has never been written."""
        if self.matrix is None:
            self.matrix = AdjacencyMatrix(target.vocab_size, self.k, self.dtype, target.device)
        else:
            self.matrix.check_target(target)
            self.matrix.to_(target.device)  # on another device every round would copy all the tree's logits over
        if self.warmup_rounds and self.matrix.updates == 0:
            self.matrix.warmup(target, self.warmup_prompts, rounds=self.warmup_rounds, new_tokens=self.warmup_tokens)
        return self.matrix

    def prefill(self, state) -> None:
        self.ensure_matrix(state.target)

    def retrieve(self, root_token: int) -> Tree:
        return expand_template(root_token, self.template, self.matrix, budget=self.budget)

    def propose(self, state) -> Tree:
        with state.section("tree"):
            return self.retrieve(state.root_token)

    def commit(self, state, verified) -> None:
        self.matrix.update(verified.tree.tokens, verified.logits)
        hits = int((verified.tree.sources[verified.path] == SOURCE_RETRIEVED).sum())
        s = self.stats
        s["rounds"] += 1
        s["retrieved_nodes"] += verified.tree.num_retrieved
        s["retrieved_accepted"] += hits
        s["rounds_with_retrieved_hit"] += int(hits > 0)

    def state_bytes(self) -> int:
        return 0 if self.matrix is None else int(self.matrix.nbytes)

    def describe(self) -> dict:
        return {"type": self.type_name, "budget": self.budget, "k": self.k, "warmup_rounds": self.warmup_rounds,
                "template": self.template_name, "template_nodes": self.template.size,
                "matrix_bytes": None if self.matrix is None else self.matrix.nbytes}


@register("pld_matrix")
class PLDMatrixDrafter(RecyclingDrafter):
    """Prompt-lookup chain first (its tokens are drafts), matrix retrieval under the root for the remaining slots.
    ``pld_tokens``: the chain's longest length, an int in 0..budget (0 = no lookup: retrieval only); left out, it is
    min(10, budget), so a budget sweep below 10 needs no second setting."""

    def __init__(self, target=None, budget: int = 60, pld_tokens: int | None = None, max_ngram: int = 3,
                 min_ngram: int = 1, **kw):
        super().__init__(target=target, budget=budget, **kw)
        if not (is_count(min_ngram, 1) and is_count(max_ngram, min_ngram)):
            raise ConfigError(f"pld_matrix needs ints 1 <= min_ngram <= max_ngram (n-gram lengths to look up), got "
                              f"min_ngram={min_ngram!r}, max_ngram={max_ngram!r}")
        if pld_tokens is None:
            pld_tokens = min(PLD_TOKENS, self.budget)
        elif not is_count(pld_tokens) or pld_tokens > self.budget:
            raise ConfigError(f"pld_tokens (the lookup chain's longest length) must be an int in 0..{self.budget} "
                              f"(the budget; 0 = no lookup), got {pld_tokens!r}: set it in that range, or leave it "
                              f"out for min({PLD_TOKENS}, budget)")
        self.pld_tokens = pld_tokens
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, state) -> Tree:
        toks = torch.tensor(state.tokens, dtype=torch.long)
        cont = prompt_lookup(toks, self.pld_tokens, self.max_ngram, self.min_ngram) if self.pld_tokens else toks[:0]
        with state.section("tree"):
            base = chain(state.root_token, cont)
            return merge(base, self.retrieve(state.root_token), budget=self.budget)

    def describe(self) -> dict:
        d = super().describe()
        d.update(pld_tokens=self.pld_tokens, max_ngram=self.max_ngram)
        return d
