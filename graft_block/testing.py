"""Tiny random targets for tests and examples (no download, seconds to build)."""
from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config, MistralConfig

from .target import Target

_CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}


def tiny_target(arch: str = "llama", vocab_size: int = 128, hidden_size: int = 64, num_layers: int = 4,
                heads: int = 4, kv_heads: int = 2, seed: int = 0, max_positions: int = 512,
                dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa", engine: str = "auto",
                gemm: str | None = None) -> Target:
    """A randomly initialised causal LM of the given family, wrapped as a Target (EOS disabled).

    ``initializer_range`` 0.3 (not HF's 0.02) so greedy text depends on context instead of repeating one token.
    The device is ``GRAFT_BLOCK_TEST_DEVICE`` (default cpu): the GPU check runs the lossless tests on CUDA."""
    cfg_cls = _CONFIGS[arch]
    kw = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
              num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
              max_position_embeddings=max_positions, tie_word_embeddings=False,
              bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.3)
    if arch == "qwen3":
        kw["head_dim"] = hidden_size // heads
    if arch == "mistral":
        kw["sliding_window"] = None
    cfg = cfg_cls(**kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation, dtype=dtype)
    model.to(os.environ.get("GRAFT_BLOCK_TEST_DEVICE", "cpu"))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return Target(model, None, name=f"tiny-{arch}", engine=engine, gemm=gemm)


def chi_square_test(counts: dict, probs: dict, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson chi-square of observed ``counts`` (outcome -> n) against exact ``probs`` (outcome -> p).

    Outcomes with expected count < ``min_expected`` are pooled into one cell (so rare outcomes still count).
    Returns (statistic, degrees of freedom, p-value via the Wilson-Hilferty approximation).
    An outcome observed but with probability 0 gives p-value 0: the sampler emitted something impossible."""
    import math

    n = sum(counts.values())
    if any(c > 0 and probs.get(k, 0.0) <= 0.0 for k, c in counts.items()):
        return float("inf"), 1, 0.0
    cells, pool_obs, pool_exp = [], 0.0, 0.0
    for k, p in probs.items():
        e = p * n
        o = counts.get(k, 0)
        if e < min_expected:
            pool_obs += o
            pool_exp += e
        else:
            cells.append((o, e))
    if pool_exp > 0:
        cells.append((pool_obs, pool_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = max(1, len(cells) - 1)
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    pval = 0.5 * math.erfc(z / math.sqrt(2))
    return stat, dof, pval


@torch.no_grad()
def exact_sequence_probs(target: Target, prompt: list[int], length: int, sampling) -> dict:
    """Exact probability of every ``length``-token continuation under the target's sampling rule (small vocab).

    Enumerates the prefix tree level by level with batched forwards; fine for vocab**length up to ~1e4."""
    from .sampling import target_probs

    probs = {(): 1.0}
    for _ in range(length):
        prefixes = [p for p in probs if probs[p] > 0]
        ids = torch.tensor([prompt + list(p) for p in prefixes], device=target.device)
        logits = target.model(input_ids=ids).logits[:, -1]
        dist = target_probs(logits, sampling).cpu().double()
        nxt = {}
        for row, p in enumerate(prefixes):
            for tok in torch.nonzero(dist[row] > 0).flatten().tolist():
                nxt[p + (tok,)] = probs[p] * float(dist[row, tok])
        probs = nxt
    return probs


@torch.no_grad()
def hf_greedy(target: Target, prompt, n: int) -> list[int]:
    """The reference for every greedy-identity test: HF ``generate(do_sample=False)`` on the same model.

    The attention mask is explicit: the tiny targets' pad id is 0 and HF would otherwise mask prompt tokens
    equal to 0."""
    ids = torch.as_tensor(prompt, dtype=torch.long).view(1, -1).to(target.device)
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@torch.no_grad()
def prefilled_state(target: Target, prompt, drafter=None):
    """A greedy ``DecodeState`` right after prefill (root = the target's first token), for calling a drafter
    directly; with ``drafter``, its feature layers are captured and its ``prefill`` has run."""
    from .decoder import DecodeState
    from .sampling import SamplingConfig

    if drafter is not None:
        target.set_feature_layers(drafter.feature_layers)
    logits, feats = target.prefill(torch.as_tensor(prompt))
    st = DecodeState(target, SamplingConfig(), None, list(prompt) + [int(logits.argmax())], len(prompt))
    st.new_features, st.new_features_start = feats, 0
    if drafter is not None:
        drafter.prefill(st)
    return st


def null_tv_quantile(exact: dict, n: int, q: float = 0.999, draws: int = 2000) -> float:
    """The q-quantile of the TV distance between n exact samples and the exact law (the test's TV tolerance)."""
    p = torch.tensor(list(exact.values()), dtype=torch.float64)
    idx = torch.multinomial(p, draws * n, replacement=True, generator=torch.Generator().manual_seed(0))
    counts = torch.zeros(draws, p.numel(), dtype=torch.float64)
    counts.scatter_add_(1, idx.view(draws, n), torch.ones(draws, n, dtype=torch.float64))
    return float((0.5 * (counts / n - p).abs().sum(-1)).quantile(q))


def gguf_quantised(w: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """``w`` [out, in] (in a multiple of 32) quantised and de-quantised as GGUF's reference quantiser does, back in
    float32: ``bits`` 4 = Q4_1 (per run of 32 inputs, fp16 d = (max - min) / 15 and m = min, q in 0..15), 8 = Q8_0
    (fp16 d = max |w| / 127, q in -127..127). The weights a GGUF target's layers hold once converted to float32."""
    v = w.detach().float().reshape(w.shape[0], -1, 32)
    if bits == 4:
        lo, hi = v.amin(-1, keepdim=True), v.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        q = ((v - lo) * torch.where(d > 0, 1 / d, 0.0) + 0.5).floor().clamp(max=15)
        out = d.half().float() * q + lo.half().float()
    elif bits == 8:
        d = v.abs().amax(-1, keepdim=True) / 127
        q = (v * torch.where(d > 0, 1 / d, 0.0)).round() + 0.0  # an int8: no -0
        out = d.half().float() * q
    else:
        raise ValueError(f"bits must be 4 (Q4_1) or 8 (Q8_0), got {bits}")
    return out.reshape(w.shape)


def gguf_like(model) -> None:
    """Round ``model``'s weight matrices in place as a GGUF target's (SmolLM2's file) come: Q4_1 layers, a Q8_0 LM
    head, the embedding as it is (``gguf_quantised``)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.copy_(gguf_quantised(p, 8 if "lm_head" in name else 4))
