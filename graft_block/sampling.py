"""Target-side decoding rule: temperature, top-k and top-p as HF ``generate`` applies them (top-p's nucleus found
among the likeliest tokens instead of a sort of the whole vocabulary: ``NucleusWarper``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from .errors import ConfigError


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def warpers(self) -> LogitsProcessorList:
        # Same classes, same order and same min_tokens_to_keep as GenerationMixin._get_logits_processor.
        procs = LogitsProcessorList()
        if self.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(float(self.temperature)))
        if self.top_k:
            procs.append(TopKLogitsWarper(top_k=self.top_k, min_tokens_to_keep=1))
        if self.top_p < 1.0:
            procs.append(NucleusWarper(float(self.top_p)))
        return procs


def sampling_options(temperatures, top_k: int = 0, top_p: float = 1.0) -> list[SamplingConfig]:
    """One SamplingConfig per temperature from a command's flags; a bad value is a ConfigError naming those flags
    (commands call this before any model loads)."""
    try:
        return [SamplingConfig(t, top_k, top_p) for t in temperatures]
    except ValueError as exc:
        raise ConfigError(f"bad sampling options (--temperature / --top-k / --top-p): {exc}") from None


class NucleusWarper:
    """HF's ``TopPLogitsWarper`` rule (min_tokens_to_keep 1): a token is removed when the probability of it and of
    every token below it is <= 1 - top_p; the likeliest token always stays. HF finds that with a sort of the whole
    vocabulary, 3 ms a row over SmolLM2's 49k tokens (more than a decode step, and 17x that for a 17-node tree).
    The removed tail is the whole vocabulary but the nucleus, so each row's nucleus is found among its top m tokens,
    m = 64, 512, 4096, then all: once the mass outside the top m is <= 1 - top_p, all of it is removed, and inside,
    a token's mass-at-or-below is that tail plus its suffix sum (summed in float64 here, in float32 by HF, so the
    two can differ only for a token whose mass-at-or-below is within float32 rounding of 1 - top_p)."""

    SIZES = (64, 512, 4096)

    def __init__(self, top_p: float):
        self.top_p = float(top_p)

    def __call__(self, input_ids, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores.float(), dim=-1)  # float32, as HF's
        total = probs.sum(-1, keepdim=True, dtype=torch.float64)
        cut = 1.0 - self.top_p
        V = scores.shape[-1]
        removed = torch.ones_like(scores, dtype=torch.bool)
        todo = torch.arange(scores.shape[0], device=scores.device)
        for m in (*[m for m in self.SIZES if m < V], V):  # a row leaves once its nucleus lies in its top m
            vals, idx = probs[todo].topk(m, dim=-1)  # descending
            vals = vals.double()
            tail = (total[todo] - vals.sum(-1, keepdim=True)).clamp(min=0.0)
            done = (tail <= cut).squeeze(-1) if m < V else torch.ones_like(todo, dtype=torch.bool)
            at_or_below = vals[done].flip(-1).cumsum(-1).flip(-1) + tail[done]  # mass of a candidate and all below
            keep = at_or_below > cut
            keep[:, 0] = True
            rows = todo[done]
            removed[rows] = removed[rows].scatter(1, idx[done], ~keep)
            todo = todo[~done]
            if todo.numel() == 0:
                break
        return scores.masked_fill(removed, -float("inf"))


def target_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """[n, V] logits -> [n, V] fp32 probabilities of the target's sampling distribution (T > 0 only)."""
    if cfg.greedy:
        raise ValueError("target_probs is defined for temperature > 0; greedy decoding uses argmax")
    scores = cfg.warpers()(None, logits.float())
    return torch.softmax(scores, dim=-1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)``: the first index of each row's largest value (a NaN counts as largest, as in torch).
    CPU float32 rows go through numpy's argmax, the same rule at 1/7 of the time (measured: [5, 49152] logits
    148 -> 20 us; torch's CPU reduction keeps an index beside every value)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad and logits.dim():
        return torch.as_tensor(logits.detach().numpy().argmax(-1), dtype=torch.long)
    return logits.argmax(dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One independent draw per row of ``probs`` [n, V] (rows of a distribution, zeros allowed): the inverse CDF
    of a uniform, in float64, with one uniform per row from ``generator`` (drawn on its device). torch's CPU
    ``multinomial`` takes 0.7 ms a row over SmolLM2's 49k vocabulary (12 ms for a 17-node tree, half its verify);
    this, 0.03-0.1 ms. A token of zero probability is never drawn: a uniform that rounding carries to the CDF's
    total lands on the row's last token of positive probability."""
    dev = probs.device if generator is None else generator.device
    cdf = probs.to(dev, torch.float64).cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=generator, device=dev, dtype=torch.float64) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    top = (cdf < cdf[:, -1:]).sum(-1)  # where the CDF reaches its total: an entry of positive probability
    return torch.minimum(idx, top).to(probs.device)


def choose(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """The target's token at every row: argmax at T=0, else one independent draw per row from ``generator``."""
    return choose_with_law(logits, cfg, generator)[0]


def choose_with_law(logits: torch.Tensor, cfg: SamplingConfig,
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``choose``'s tokens and the law they were drawn from ([n, V] probabilities; None at T=0, where each choice
    is its row's argmax): the decoder reads a round's expected acceptance from it at no second softmax."""
    if cfg.greedy:
        return greedy_tokens(logits), None
    probs = target_probs(logits, cfg)
    return draw(probs, generator), probs
