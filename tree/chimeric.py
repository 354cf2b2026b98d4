"""Chimeric-prefix analysis of any draft tree (DDTree, mixed MFD, EAGLE3, grafted), the two protocols of mfd.md 3.2.

A node is identified with its token path p = (x_1..x_d) below the root (the root itself is never labelled).
Shares are computed separately for drafted nodes (``sources == 1``) and retrieved nodes (``sources == 2``);
the headline number is the drafted one ("chimeric nodes / B" when the tree is full).

(a) Sampled-futures reference (canonical). Given a set F of target futures of the next block (token lists that
    continue the root; e.g. N samples from the target at the round's context, plus its greedy continuation),
    let S_i = {f_i : f in F} be the tokens seen at position i. Node p of depth d is
    - ``coherent``    if p is a prefix of some f in F;
    - ``chimeric``    if x_i is in S_i for every i <= d, but p is not a prefix of any f in F;
    - ``off_support`` otherwise (some x_i was never seen at position i).

(b) One-pass proxy from the verify logits (no sampling). With P(x | u) the target's probability of token x after
    node u's path (softmax of the verify logits at u at ``temperature``, 1 by default), node p with parent u is
    - ``coherent``    if every step on its path is supported: P(x_i | x_<i) >= eps for all i <= d;
    - ``chimeric``    (the spec's rule) if P(x_d | u) < eps and x_d is "valid elsewhere": P(x_d | u') >= delta for
                      some other node u' != u of the tree at depth d-1;
    - ``off_support`` if P(x_d | u) < eps and x_d is valid nowhere else;
    - ``unreachable`` if its own step is supported but an ancestor's is not (verification can never reach it).
    Depth-1 nodes have no alternative parent, so they are never chimeric, as under (a).
    ``chimeric_path`` (reported next to the shares) is the path-level variant closer to (a): the node is not
    coherent and every unsupported step on its path is valid elsewhere.
    Defaults eps = 0.01, delta = 0.1 (sweep both).

Round hooks for ``SpeculativeDecoder(..., round_hooks=[hook])``: ``proxy_hook(...)`` accumulates (b) per round
from ``verified.logits``; ``futures_recorder(...)`` stores (context, tree) of chosen rounds so that (a) can be
computed afterwards with ``sampled_report`` (sampling futures inside the loop would pollute the timings).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .tree import SOURCE_DRAFT, SOURCE_RETRIEVED, Tree, TreeError

SAMPLED_LABELS = ("coherent", "chimeric", "off_support")
PROXY_LABELS = ("coherent", "chimeric", "off_support", "unreachable")
GROUPS = {"draft": SOURCE_DRAFT, "retrieved": SOURCE_RETRIEVED}


def _node_paths(tree: Tree) -> list[tuple]:
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    paths: list[tuple] = [()]
    for i in range(1, len(toks)):
        paths.append(paths[pars[i]] + (toks[i],))
    return paths


def _shares(tree: Tree, labels: list[str], names: tuple, extra: dict[str, list[bool]] | None = None) -> dict:
    """Per source group: node count, count and share of each label (and of each boolean ``extra`` flag)."""
    src = tree.sources.tolist()
    out = {}
    for group, code in GROUPS.items():
        idx = [i for i in range(1, tree.size) if src[i] == code]
        n = len(idx)
        row = {"n": n}
        for name in names:
            c = sum(labels[i] == name for i in idx)
            row[name + "_n"] = c
            row[name] = c / n if n else 0.0
        for name, flags in (extra or {}).items():
            c = sum(bool(flags[i]) for i in idx)
            row[name + "_n"] = c
            row[name] = c / n if n else 0.0
        out[group] = row
    return out


# ---- (a) sampled futures -----------------------------------------------------------------------------------
def label_sampled(tree: Tree, futures) -> list[str]:
    """Protocol (a) label of every node (index 0 = "root")."""
    futs = [tuple(int(t) for t in f) for f in futures]
    if not futs:
        raise TreeError("label_sampled needs at least one future (a token list continuing the root)")
    prefixes = {f[:d] for f in futs for d in range(1, len(f) + 1)}
    seen: dict[int, set] = {}
    for f in futs:
        for i, t in enumerate(f):
            seen.setdefault(i, set()).add(t)
    labels = ["root"]
    paths = _node_paths(tree)
    for i in range(1, tree.size):
        p = paths[i]
        if p in prefixes:
            labels.append("coherent")
        elif all(t in seen.get(j, ()) for j, t in enumerate(p)):
            labels.append("chimeric")
        else:
            labels.append("off_support")
    return labels


def sampled_shares(tree: Tree, futures) -> dict:
    """Protocol (a): {"draft": {...}, "retrieved": {...}} with n, coherent, chimeric, off_support (shares, *_n)."""
    return _shares(tree, label_sampled(tree, futures), SAMPLED_LABELS)


# ---- (b) one-pass proxy ------------------------------------------------------------------------------------
def label_proxy(tree: Tree, logits: torch.Tensor, eps: float = 0.01, delta: float = 0.1,
                temperature: float = 1.0) -> tuple[list[str], list[bool]]:
    """Protocol (b) label of every node from the verify logits [n, V] (row i = target's next-token logits after
    node i's path). Returns (labels, chimeric_path flags)."""
    n = tree.size
    if logits.dim() != 2 or logits.shape[0] != n:
        raise TreeError(f"label_proxy needs verify logits of shape [{n}, V] (one row per tree node), got "
                        f"{tuple(logits.shape)}")
    if not (0 < eps <= 1 and 0 < delta <= 1 and temperature > 0):
        raise TreeError(f"need 0 < eps, delta <= 1 and temperature > 0, got eps={eps}, delta={delta}, "
                        f"temperature={temperature}")
    toks = tree.tokens.to(logits.device)
    # log P(token of node j | path of node u) for all (u, j): one logsumexp per row + an [n, n] gather.
    lg = logits.float() / temperature
    lp = (lg[:, toks] - torch.logsumexp(lg, dim=-1, keepdim=True)).cpu()
    pars, depths = tree.parents.tolist(), tree.depths.tolist()
    log_eps, log_delta = math.log(eps), math.log(delta)
    by_depth: dict[int, list[int]] = {}
    for u in range(n):
        by_depth.setdefault(depths[u], []).append(u)
    labels, path_flag = ["root"], [False]
    step_ok, path_ok, all_bad_elsewhere = [True], [True], [True]
    for j in range(1, n):
        u = pars[j]
        own = bool(lp[u, j] >= log_eps)
        others = [v for v in by_depth[depths[j] - 1] if v != u]
        elsewhere = bool(others) and bool((lp[others, j] >= log_delta).any())
        step_ok.append(own)
        path_ok.append(path_ok[u] and own)
        # every unsupported step so far is valid elsewhere
        all_bad_elsewhere.append(all_bad_elsewhere[u] and (own or elsewhere))
        if path_ok[j]:
            labels.append("coherent")
        elif not own:
            labels.append("chimeric" if elsewhere else "off_support")
        else:
            labels.append("unreachable")
        path_flag.append(not path_ok[j] and all_bad_elsewhere[j])
    return labels, path_flag


def proxy_shares(tree: Tree, logits: torch.Tensor, eps: float = 0.01, delta: float = 0.1,
                 temperature: float = 1.0) -> dict:
    """Protocol (b) shares per source group (coherent, chimeric, off_support, unreachable, chimeric_path)."""
    labels, flags = label_proxy(tree, logits, eps, delta, temperature)
    return _shares(tree, labels, PROXY_LABELS, {"chimeric_path": flags})


# ---- round hooks -------------------------------------------------------------------------------------------
def _mean_rows(rows: list[dict], group: str) -> dict:
    """Average of per-round shares over rounds that have nodes of ``group``; counts are summed."""
    live = [r[group] for r in rows if r[group]["n"] > 0]
    if not live:
        return {"rounds": 0, "n": 0}
    out = {"rounds": len(live), "n": sum(r["n"] for r in live)}
    for key in live[0]:
        if key == "n":
            continue
        if key.endswith("_n"):
            out[key] = sum(r[key] for r in live)
        else:
            out[key] = sum(r[key] for r in live) / len(live)
    return out


@dataclass
class ProxyHook:
    """Round hook accumulating the one-pass proxy (b) of every verified tree. ``summary()`` averages per round."""

    eps: float = 0.01
    delta: float = 0.1
    temperature: float = 1.0
    rows: list = field(default_factory=list)

    def __call__(self, verified, state=None) -> None:
        if verified.tree.size > 1:
            self.rows.append(proxy_shares(verified.tree, verified.logits, self.eps, self.delta, self.temperature))

    def summary(self) -> dict:
        return {group: _mean_rows(self.rows, group) for group in GROUPS}


def proxy_hook(eps: float = 0.01, delta: float = 0.1, temperature: float = 1.0) -> ProxyHook:
    """``SpeculativeDecoder(..., round_hooks=[proxy_hook()])``; read ``hook.summary()`` afterwards."""
    return ProxyHook(eps, delta, temperature)


@dataclass
class FuturesRecorder:
    """Round hook storing (context ids ending with the root, tree) for rounds ``first..first+count-1`` of each
    generation (``every`` > 1 spaces them out). Feed ``records`` to ``sampled_report``."""

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
        self.records.append((list(state.tokens[: len(state.tokens) - committed]), verified.tree))


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
    from transformers import DynamicCache  # the only model-side import of this module, needed for (a) only

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


def sampled_report(target, records, n: int = 64, length: int = 15, sampler=None, seed: int = 0,
                   greedy: bool = True) -> dict:
    """Protocol (a) over recorded rounds: per-round shares averaged over rounds, per source group."""
    g = torch.Generator(device=target.device).manual_seed(seed)
    rows = []
    for context, tree in records:
        futs = sample_futures(target, context, n, length, sampler, generator=g, greedy=greedy)
        rows.append(sampled_shares(tree, futs))
    return {group: _mean_rows(rows, group) for group in GROUPS}
