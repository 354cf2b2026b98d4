"""The speculative decoding loop, visible at once: propose -> graft -> verify -> walk -> commit -> observe.

The autoregressive baseline is this same loop with an empty tree (drafter=None).
"""
from __future__ import annotations

import numbers
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from graft_block.tree import Tree, expected_accept_length, root_only, validate, walk

from .errors import ConfigError
from .sampling import SamplingConfig, choose, choose_with_law
from .target import Target

PHASES = ("draft", "tree", "verify", "commit", "overhead")


class PhaseTimer:
    """Exclusive wall time per phase; a nested section's time is not counted in its parent."""

    def __init__(self, sync: Callable[[], None] | None = None):
        self.totals: dict[str, float] = {p: 0.0 for p in PHASES}
        self._stack: list[list] = []
        self._sync = sync or (lambda: None)

    @contextmanager
    def section(self, name: str):
        self._sync()
        t0 = time.perf_counter()
        self._stack.append([name, 0.0])
        try:
            yield
        finally:
            self._sync()
            _, child = self._stack.pop()
            dt = time.perf_counter() - t0
            self.totals[name] = self.totals.get(name, 0.0) + dt - child
            if self._stack:
                self._stack[-1][1] += dt


@dataclass
class DecodeState:
    """What a drafter may read. ``tokens`` = prompt + everything committed; its last entry is the root of the next
    tree (not yet in the target KV cache). ``new_features`` are target features of the tokens that entered the KV
    cache since the last round (prefill: the whole prompt; later: root + accepted nodes), starting at position
    ``new_features_start``. ``draft_nodes``: the nodes a schedule asks the next draft for (None: the drafter's own
    budget); block drafters draft no more, and no rows deeper than those nodes reach; the others ignore it."""

    target: Target
    sampling: SamplingConfig
    generator: torch.Generator | None
    tokens: list[int]
    prompt_len: int
    new_features: torch.Tensor | None = None
    new_features_start: int = 0
    timer: PhaseTimer | None = None
    round: int = 0
    draft_nodes: int | None = None

    @property
    def root_token(self) -> int:
        return self.tokens[-1]

    @property
    def cache_len(self) -> int:
        return len(self.tokens) - 1

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def section(self, name: str):
        return self.timer.section(name) if self.timer is not None else _null()


@contextmanager
def _null():
    yield


@dataclass
class Verified:
    """One verification: the tree, the target's logits and choice at every node, the accepted path and bonus."""

    tree: Tree
    logits: torch.Tensor
    choices: torch.Tensor
    path: torch.Tensor
    bonus: int
    features: torch.Tensor | None

    @property
    def accepted(self) -> int:
        return int(self.path.numel()) - 1


@dataclass
class Stats:
    """Counts of one ``generate``. ``committed_in_rounds`` = tokens the rounds *emitted* (after the stop trim: EOS or
    max_new_tokens), so tau and tok/s never count tokens that were verified but thrown away; those are in
    ``dropped``. ``accept_hist`` is the walk's acceptance per round (draft nodes accepted, before the trim), a
    property of the drafter: sum((k + 1) * n) == committed_in_rounds + dropped. ``depth_hist``: rounds per depth
    of the verified tree (the deepest node), the ceiling on that round's acceptance. ``expected_accepted``: per
    round, the draft nodes the walk accepts in expectation under the target's law (the sum over nodes of P(reached),
    from the verify's own probabilities; at T = 0 the accepted count): the sampled acceptance without the draws'
    noise, before the trim."""

    rounds: int = 0
    committed_in_rounds: int = 0
    dropped: int = 0
    accept_hist: Counter = field(default_factory=Counter)
    depth_hist: Counter = field(default_factory=Counter)
    phase_s: dict = field(default_factory=dict)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    hook_s: float = 0.0
    new_tokens: int = 0
    tree_nodes: int = 0
    retrieved_nodes: int = 0
    retrieved_accepted: int = 0
    expected_accepted: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target verification forward, bonus included."""
        return self.committed_in_rounds / self.rounds if self.rounds else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Emitted tokens per second after prefill (the prefill token is excluded, as in the papers)."""
        return self.committed_in_rounds / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "tau": self.tau,
            "tau_expected": 1.0 + self.expected_accepted / self.rounds if self.rounds else 0.0,
            "new_tokens": self.new_tokens,
            "decode_tokens": self.committed_in_rounds,
            "dropped": self.dropped,
            "accept_hist": {int(k): int(v) for k, v in sorted(self.accept_hist.items())},
            "depth_hist": {int(k): int(v) for k, v in sorted(self.depth_hist.items())},
            "phase_s": dict(self.phase_s),
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "decode_tok_s": self.decode_tok_s,
            "hook_s": self.hook_s,
            "mean_tree_nodes": self.tree_nodes / self.rounds if self.rounds else 0.0,
            "retrieved_nodes": self.retrieved_nodes,
            "retrieved_accepted": self.retrieved_accepted,
        }


@dataclass
class Result:
    tokens: list[int]
    text: str
    stats: Stats
    prompt_len: int


class SpeculativeDecoder:
    """``SpeculativeDecoder(target, drafter=None, graft=None, schedule=None)``; ``drafter=None`` is plain
    autoregressive decoding.

    ``graft`` (optional) has ``apply(tree, state) -> Tree`` and ``observe(verified, state)``; ``schedule``
    (optional, e.g. ``graft_block.schedule.ConfidenceSchedule``) has ``apply(tree, state, drafter) -> Tree``: it runs
    after graft and before validation (timed as "tree") and returns the subtree to verify; it gets the drafter that
    proposed the tree so that it can ask for per-node confidences, and must not read the target's choices (an
    optional ``observe(verified, state)`` sees each round's outcome afterwards, for later rounds).
    ``round_hooks`` are called as ``hook(verified, state)`` after every round (analysis such as chimeric shares);
    their time is ``stats.hook_s``, not decoding time.
    """

    def __init__(self, target: Target, drafter=None, graft=None, round_hooks=(), check_trees: bool = True,
                 schedule=None):
        owner = getattr(drafter, "target", None)
        # a drafter reads its own target's embedding, LM head and cache: with another target it drafts garbage
        if owner is not None and owner is not target:
            raise ConfigError(
                f"the drafter was built on target {getattr(owner, 'name', owner)!r}, not on this decoder's target "
                f"{getattr(target, 'name', target)!r} (another object): rebuild it on this one with "
                "Drafter.from_config(cfg, target=target)"
            )
        matrix = getattr(graft, "matrix", None)
        if matrix is not None:  # a graft built without a target: another vocabulary's rows retrieve ids it lacks
            matrix.check_target(target)
        self.target = target
        self.drafter = drafter
        self.graft = graft
        self.schedule = schedule
        self.round_hooks = list(round_hooks)
        self.check_trees = check_trees
        self.feature_layers = tuple(getattr(drafter, "feature_layers", ()) or ())
        target.set_feature_layers(self.feature_layers)

    @property
    def budget(self) -> int | None:
        if self.graft is not None and getattr(self.graft, "budget", None):
            return int(self.graft.budget)
        if self.drafter is not None:
            return int(self.drafter.budget)
        return None

    def _sync(self):
        self.target.synchronize()

    @torch.no_grad()
    def generate(
        self,
        prompt,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = 0,
        generator: torch.Generator | None = None,
        stream: Any = None,
        stop_on_eos: bool = True,
    ) -> Result:
        sampling = SamplingConfig(temperature, top_k, top_p)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
            raise ConfigError(f"seed must be an int (or None for 0), got {seed!r}")  # int("3") / int(2.7) took it
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        target = self.target
        # Decoders may share one target (interleaved benchmarks): capture this drafter's layers (no-op if unchanged).
        target.set_feature_layers(self.feature_layers)
        prompt_ids = target.encode(prompt)
        if prompt_ids.numel() + max_new_tokens > target.max_positions:
            raise ConfigError(
                f"prompt ({prompt_ids.numel()} tokens) + max_new_tokens ({max_new_tokens}) exceeds the target's "
                f"context window of {target.max_positions}{getattr(target, 'context_note', '')}: shorten the prompt "
                "or lower max_new_tokens"
            )
        if generator is None and not sampling.greedy:
            generator = torch.Generator(device=target.device)
            generator.manual_seed(0 if seed is None else int(seed))
        eos = target.eos_token_ids if stop_on_eos else set()
        timer = PhaseTimer(self._sync)
        stats = Stats()
        emit = _emitter(stream)

        # ---- prefill: the first new token is the target's own choice --------------------------------------
        self._sync()
        t0 = time.perf_counter()
        logits, feats = target.prefill(prompt_ids)
        first = int(choose(logits.view(1, -1), sampling, generator)[0])
        state = DecodeState(target, sampling, generator, prompt_ids.tolist() + [first], int(prompt_ids.numel()))
        state.new_features, state.new_features_start = feats, 0
        if self.drafter is not None:  # the drafter's prompt pass is prefill: kept out of the rounds' phase split
            self.drafter.prefill(state)
        state.timer = timer
        self._sync()
        stats.prefill_s = time.perf_counter() - t0
        emit([first])
        done = first in eos or max_new_tokens <= 1

        # ---- rounds ---------------------------------------------------------------------------------------
        t_loop = time.perf_counter()
        while not done:
            with timer.section("overhead"):
                with timer.section("draft"):
                    tree = self.drafter.propose(state) if self.drafter is not None else root_only(state.root_token)
                with timer.section("tree"):
                    if self.graft is not None:
                        tree = self.graft.apply(tree, state)
                    # the context window (and a sliding one) cut deeper or later nodes; before the schedule, so that
                    # its expected tokens and recalibration see the tree that is verified
                    tree = target.fit(tree)
                    if self.schedule is not None:
                        tree = self.schedule.apply(tree, state, self.drafter)
                    if self.check_trees:
                        validate(tree, budget=self.budget, root_token=state.root_token, vocab_size=target.vocab_size)
                with timer.section("verify"):
                    logits, feats = target.verify(tree)
                    choices, law = choose_with_law(logits, sampling, generator)
                    # P(the choice at a node's parent is the node's token): the round's expected acceptance
                    node_p = None if law is None else \
                        law[tree.parents[1:].to(law.device), tree.tokens[1:].to(law.device)]
                    law = None  # [n, V]: not kept alive through the commit and the next draft
                with timer.section("commit"):
                    path, bonus = walk(tree, choices.cpu())
                    target.compact(tree.size, path)
                    new = tree.tokens[path[1:]].tolist() + [bonus]
                    start = state.cache_len
                    state.tokens.extend(new)
                    state.new_features = None if feats is None else feats[path.to(feats.device)]
                    state.new_features_start = start
                    state.round += 1
                    verified = Verified(tree, logits, choices, path, bonus, feats)
                    if self.graft is not None:
                        self.graft.observe(verified, state)
                    if self.schedule is not None and hasattr(self.schedule, "observe"):
                        self.schedule.observe(verified, state)
                    if self.drafter is not None:
                        self.drafter.commit(state, verified)
                if self.round_hooks:
                    with timer.section("hooks"):  # analysis: kept out of decode_s and of the phases a schedule reads
                        for hook in self.round_hooks:
                            hook(verified, state)
                # statistics (acceptance before the stop trim; emitted counts after it, below)
                stats.rounds += 1
                stats.accept_hist[len(new) - 1] += 1
                stats.expected_accepted += len(new) - 1 if node_p is None else \
                    expected_accept_length(tree, [1.0] + node_p.tolist())
                stats.tree_nodes += tree.size - 1
                stats.depth_hist[int(tree.depths.max())] += 1
                if tree.num_retrieved:
                    stats.retrieved_nodes += tree.num_retrieved
                    stats.retrieved_accepted += int((tree.sources[path] == 2).sum())
                # stopping: EOS anywhere in the new tokens, or the length limit
                cut = None
                for j, tok in enumerate(new):
                    if tok in eos:
                        cut = j + 1
                        break
                over = state.num_generated - max_new_tokens
                if cut is not None or over >= 0:
                    keep = len(new) if cut is None else cut
                    if over > 0:
                        keep = min(keep, len(new) - over)
                    del state.tokens[len(state.tokens) - len(new) + keep :]
                    stats.dropped += len(new) - keep
                    new = new[:keep]
                    done = True
                stats.committed_in_rounds += len(new)  # emitted tokens only: the trimmed tail never counts
                emit(new)
        self._sync()
        stats.hook_s = timer.totals.pop("hooks", 0.0)
        stats.decode_s = time.perf_counter() - t_loop - stats.hook_s
        stats.phase_s = dict(timer.totals)
        out = state.tokens[state.prompt_len :]
        stats.new_tokens = len(out)
        if stream is not None and hasattr(stream, "end"):
            stream.end()
        return Result(tokens=out, text=target.decode(out), stats=stats, prompt_len=state.prompt_len)


def _emitter(stream):
    if stream is None:
        return lambda toks: None
    if hasattr(stream, "put"):  # a transformers streamer
        return lambda toks: stream.put(torch.tensor([toks])) if toks else None
    if callable(stream):
        return lambda toks: stream(list(toks)) if toks else None
    raise ConfigError("stream must be a callable taking a list of token ids, or a transformers streamer")
