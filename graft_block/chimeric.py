"""Chimeric-prefix measurement inside the decoding loop (the model side of ``graft_block.tree.chimeric``).

Round hooks for ``SpeculativeDecoder(..., round_hooks=[hook])``: ``proxy_hook(...)`` accumulates protocol (b) per
round from ``verified.logits``; ``futures_recorder(...)`` stores (context, tree, sampling) of chosen rounds so that (a)
can be computed afterwards with ``sampled_report`` (sampling futures inside the loop would pollute the timings).

Both protocols describe the futures the target would produce under the round's own law (``round_law`` for (b),
``round_sampler`` for (a)): temperature, top-k and top-p as the decoder applies them. At T = 0 both take the plain
softmax (T = 1) instead: the greedy law has a single future, under which no node could ever be chimeric.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from graft_block.sampling import SamplingConfig, choose, target_probs
from graft_block.tree import TreeError
from graft_block.tree.chimeric import GROUPS, mean_rows, proxy_shares, sampled_shares


def round_law(sampling: SamplingConfig | None):
    """Proxy (b)'s P(x | u) for a round decoded under ``sampling``, as logits [n, V] -> probabilities [n, V]: the
    decoder's own law (``target_probs``: temperature, top-k, top-p) at T > 0, the law (a)'s futures follow; at T = 0,
    or when the round's settings are unknown, softmax at T = 1, as ``round_sampler`` (a one-hot greedy law would
    call every node off the greedy path off-support or unreachable, never chimeric)."""
    if sampling is None or sampling.greedy:
        return lambda logits: torch.softmax(logits.float(), dim=-1)
    return lambda logits: target_probs(logits, sampling)


@dataclass
class ProxyHook:
    """Round hook accumulating the one-pass proxy (b) of every verified tree. ``summary()`` averages per round.
    ``temperature`` None (default): each round's own law (``round_law(state.sampling)``); a number: softmax at that
    temperature whatever the run's law."""

    eps: float = 0.01
    delta: float = 0.1
    temperature: float | None = None
    rows: list = field(default_factory=list)

    def __call__(self, verified, state=None) -> None:
        if verified.tree.size > 1:
            if self.temperature is None:  # the round's own law
                shares = proxy_shares(verified.tree, verified.logits, self.eps, self.delta,
                                      law=round_law(getattr(state, "sampling", None)))
            else:
                shares = proxy_shares(verified.tree, verified.logits, self.eps, self.delta, self.temperature)
            self.rows.append(shares)

    def summary(self) -> dict:
        return {group: mean_rows(self.rows, group) for group in GROUPS}


def proxy_hook(eps: float = 0.01, delta: float = 0.1, temperature: float | None = None) -> ProxyHook:
    """``SpeculativeDecoder(..., round_hooks=[proxy_hook()])``; read ``hook.summary()`` afterwards."""
    return ProxyHook(eps, delta, temperature)


@dataclass
class FuturesRecorder:
    """Round hook storing (context ids ending with the root, tree, the round's SamplingConfig) for rounds
    ``first..first+count-1`` of each generation (``every`` > 1 spaces them out). Feed ``records`` to
    ``sampled_report``."""

    count: int = 4
    every: int = 1
    first: int = 0
    records: list = field(default_factory=list)
    _seen: int = 0

    def __call__(self, verified, state) -> None:
        r = state.round - 1  # state.round was advanced before hooks run
        if r == 0:
            self._seen = 0
        if verified.tree.size <= 1 or r < self.first or (r - self.first) % self.every or self._seen >= self.count:
            return
        self._seen += 1
        committed = verified.accepted + 1  # accepted nodes + bonus were appended to state.tokens this round
        self.records.append((list(state.tokens[: len(state.tokens) - committed]), verified.tree, state.sampling))


def futures_recorder(count: int = 4, every: int = 1, first: int = 0) -> FuturesRecorder:
    return FuturesRecorder(count, every, first)


def temperature_sampler(temperature: float = 1.0):
    """Default future sampler: argmax at T=0, else one softmax(logits / T) draw per row (no top-k / top-p; pass
    ``lambda logits, g: graft_block.sampling.choose(logits, cfg, g)`` to sample exactly like the decoder)."""

    def sample(logits: torch.Tensor, generator) -> torch.Tensor:
        if temperature == 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    return sample


@torch.inference_mode()
def sample_futures(target, context_ids, n: int = 64, length: int = 15, sampler=None,
                   generator: torch.Generator | None = None, greedy: bool = True) -> list[list[int]]:
    """``n`` futures of ``length`` tokens drawn with ``sampler`` (default: ``temperature_sampler(1.0)``) from the
    target (an object with ``.model``, an HF causal LM, and ``.device``) after ``context_ids`` (last = the tree
    root), plus its greedy continuation when ``greedy``. Uses its own KV cache: the decoder's cache is untouched."""
    if n < 0 or length < 1 or (n == 0 and not greedy):
        raise TreeError(f"need n >= 0 futures (or greedy) and length >= 1, got n={n}, length={length}")
    sampler = sampler or temperature_sampler(1.0)
    model = target.model
    ids = torch.as_tensor(context_ids, dtype=torch.long).to(target.device).view(1, -1)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    rows = n + int(greedy)
    cache.batch_repeat_interleave(rows)  # one prefill, then the context KV is shared by all rows
    logits = out.logits[:, -1].expand(rows, -1)
    result = torch.empty(rows, length, dtype=torch.long, device=target.device)
    for step in range(length):
        nxt = torch.empty(rows, dtype=torch.long, device=target.device)
        if n:
            nxt[:n] = sampler(logits[:n], generator)
        if greedy:
            nxt[n] = logits[n].argmax(-1)
        result[:, step] = nxt
        if step + 1 < length:
            logits = model(input_ids=nxt.view(rows, 1), cache=cache, use_cache=True).logits[:, -1]
    return result.tolist()


@torch.inference_mode()
def beam_futures(target, context_ids, k: int = 4, length: int = 15) -> list[list[int]]:
    """The ``k`` beams of a beam search of width ``k`` over the target's log-probs after ``context_ids`` (last = the
    tree root), ``length`` tokens each, best first: protocol (a)'s futures for greedy rounds beside the sampled
    ones (mfd.md 3.2: "for T=0 also add top-k beams"). Uses its own KV cache: the decoder's cache is untouched."""
    if k < 1 or length < 1:
        raise TreeError(f"need k >= 1 beams and length >= 1, got k={k}, length={length}")
    model = target.model
    ids = torch.as_tensor(context_ids, dtype=torch.long).to(target.device).view(1, -1)
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    score = torch.zeros(1, device=target.device)
    seqs = torch.empty(1, 0, dtype=torch.long, device=target.device)
    for step in range(length):
        total = (score[:, None] + torch.log_softmax(logits.float(), -1)).view(-1)
        score, flat = total.topk(min(k, total.numel()))
        beam, tok = flat // logits.shape[-1], flat % logits.shape[-1]
        seqs = torch.cat([seqs[beam], tok[:, None]], 1)
        if step + 1 < length:
            if step == 0:
                cache.batch_repeat_interleave(len(beam))  # one prefill row, then one row per beam
            else:
                cache.reorder_cache(beam)
            logits = model(input_ids=tok.view(-1, 1), cache=cache, use_cache=True).logits[:, -1]
    return seqs.tolist()


def round_sampler(sampling: SamplingConfig | None):
    """The futures' law for a round decoded under ``sampling`` (mfd.md 3.2: "sampling settings as in the
    evaluation"): the decoder's own rule (temperature, top-k, top-p) at T > 0; at T = 0, or when the round's
    settings are unknown, ``temperature_sampler(1.0)``, since the greedy law's only future is the greedy one."""
    if sampling is None or sampling.greedy:
        return temperature_sampler(1.0)
    return lambda logits, generator: choose(logits, sampling, generator)


def sampled_report(target, records, n: int = 64, length: int = 15, sampler=None, seed: int = 0,
                   greedy: bool = True, beams: int = 4) -> dict:
    """Protocol (a) over recorded rounds ((context, tree) or (context, tree, SamplingConfig)): per-round shares
    averaged over rounds, per source group. Futures follow ``sampler`` if given, else each round's own law
    (``round_sampler``); they are ``length`` tokens long, or as deep as the round's tree where it is deeper. A greedy
    round (or one of unknown settings) also counts the target's ``beams`` top beams (``beam_futures``; 0: none)."""
    g = torch.Generator(device=target.device).manual_seed(seed)
    rows = []
    for context, tree, *sampling in records:
        law = sampler or round_sampler(sampling[0] if sampling else None)
        # a node deeper than every future would be labelled off-support whatever the target says there
        depth = max(length, int(tree.depths.max()))
        futs = sample_futures(target, context, n, depth, law, generator=g, greedy=greedy)
        if beams and (not sampling or sampling[0] is None or sampling[0].greedy):
            futs += beam_futures(target, context, beams, depth)
        rows.append(sampled_shares(tree, futs))
    return {group: mean_rows(rows, group) for group in GROUPS}
