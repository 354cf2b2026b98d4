"""Prompt-lookup decoding: the n-gram drafter behind HF ``prompt_lookup_num_tokens``, as a chain proposal."""
from __future__ import annotations

import torch

from graft_block.drafter import Drafter, check_budget, register
from graft_block.errors import ConfigError
from graft_block.tree import Tree, chain, root_only


def prompt_lookup(tokens: torch.Tensor, num_tokens: int, max_ngram: int = 3, min_ngram: int = 1) -> torch.Tensor:
    """HF's rule: for n from max_ngram down to min_ngram, find the first earlier occurrence of the last n tokens and
    return the (up to ``num_tokens``) tokens that followed it; empty if none matches."""
    L = tokens.numel()
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= L:
            continue
        windows = tokens.unfold(0, n, 1)  # [L-n+1, n]
        hits = (windows == tokens[-n:]).all(dim=1).nonzero().flatten()
        for start in hits.tolist():
            s = start + n
            e = min(s + num_tokens, L)
            if s < e:  # the match at the very end has no continuation
                return tokens[s:e]
    return tokens[:0]


@register("pld")
class PromptLookupDrafter(Drafter):
    """Chain of the tokens that followed the first earlier match of the trailing n-gram (HF semantics)."""

    def __init__(self, budget: int = 10, max_ngram: int = 3, min_ngram: int = 1):
        self.budget = check_budget(budget)
        if not (isinstance(max_ngram, int) and isinstance(min_ngram, int) and not isinstance(max_ngram, bool)
                and not isinstance(min_ngram, bool) and 1 <= min_ngram <= max_ngram):
            raise ConfigError(f"pld needs ints 1 <= min_ngram <= max_ngram (n-gram lengths to look up), got "
                              f"min_ngram={min_ngram!r}, max_ngram={max_ngram!r}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, state) -> Tree:
        toks = torch.tensor(state.tokens, dtype=torch.long)
        cont = prompt_lookup(toks, self.budget, self.max_ngram, self.min_ngram)
        return chain(state.root_token, cont) if cont.numel() else root_only(state.root_token)

    def describe(self) -> dict:
        return {"type": self.type_name, "budget": self.budget, "max_ngram": self.max_ngram}
