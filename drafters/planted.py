"""A test drafter: random prefix-closed trees with the true continuation planted at a random sibling rank and depth.

It knows the reference continuation (e.g. the target's own greedy output) and hides it among garbage branches,
so verification, the walk and KV compaction are exercised on every tree shape. Not a real drafter.
"""
from __future__ import annotations

import torch

from graft_block.drafter import Drafter, check_budget, register
from graft_block.tree import Tree, make_tree


@register("planted")
class PlantedTreeDrafter(Drafter):
    def __init__(self, reference: list[int] | None = None, budget: int = 12, vocab_size: int = 100,
                 max_width: int = 4, max_depth: int = 6, seed: int = 0, plant_prob: float = 0.8):
        self.budget = check_budget(budget)
        self.reference = list(reference or [])
        self.vocab_size = int(vocab_size)
        self.max_width, self.max_depth = int(max_width), int(max_depth)
        self.plant_prob = float(plant_prob)
        self.gen = torch.Generator().manual_seed(int(seed))

    def _rand(self, hi: int) -> int:
        return int(torch.randint(0, hi, (1,), generator=self.gen))

    def propose(self, state) -> Tree:
        pos = state.num_generated  # index into reference of the token after the root
        truth = self.reference[pos : pos + self.max_depth]
        plant_depth = self._rand(len(truth) + 1) if truth and torch.rand(1, generator=self.gen) < self.plant_prob else 0
        tokens, parents = [state.root_token], [-1]
        children: dict[int, set] = {0: set()}
        depth_of = [0]
        # Plant the true path first at random sibling ranks: garbage siblings are added before it.
        cur = 0
        for d in range(plant_depth):
            n_before = self._rand(self.max_width)
            for _ in range(n_before):
                if len(tokens) - 1 >= self.budget - (plant_depth - d):
                    break
                self._add_garbage(tokens, parents, children, depth_of, cur, avoid=truth[d])
            if len(tokens) - 1 >= self.budget:
                break
            cur = self._add(tokens, parents, children, depth_of, cur, truth[d])
        # Fill the rest with random branches anywhere (shallow-biased), keeping depth <= max_depth.
        while len(tokens) - 1 < self.budget:
            if torch.rand(1, generator=self.gen) < 0.15:
                break
            parent = self._rand(len(tokens))
            if depth_of[parent] >= self.max_depth or len(children[parent]) >= self.max_width:
                continue
            self._add_garbage(tokens, parents, children, depth_of, parent)
        return make_tree(tokens, parents)

    def _add(self, tokens, parents, children, depth_of, parent, tok):
        if tok in children[parent]:
            return next(i for i in range(1, len(tokens)) if parents[i] == parent and tokens[i] == tok)
        tokens.append(int(tok))
        parents.append(parent)
        depth_of.append(depth_of[parent] + 1)
        children[parent].add(int(tok))
        children[len(tokens) - 1] = set()
        return len(tokens) - 1

    def _add_garbage(self, tokens, parents, children, depth_of, parent, avoid=None):
        for _ in range(8):
            tok = self._rand(self.vocab_size)
            if tok != avoid and tok not in children[parent]:
                return self._add(tokens, parents, children, depth_of, parent, tok)
        return parent
