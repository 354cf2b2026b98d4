"""The DFlash backbone's drafting forward with every layer in C (``skinny.DecoderLayers``), as the target runs.

A DFlash draft layer is a Qwen3 decoder layer whose attention reads [context K/V; block K/V] with no causal mask.
The C layers run exactly that when the context K/V sit in their cache layout (keys transposed) and the mask is
all-visible (DFlash) or MFD's per-mode block mask: the block's own K/V are written after the context, where the
next commit's context rows overwrite them. One C call per draft forward replaces ~25 small torch ops per layer,
most of a draft's cost on a 2-core CPU. Drafting numerics need not match the torch forward bit for bit (the
verify decides what is kept); ``tests/test_dflash_c_block.py`` checks they agree to float32 rounding.

Used when the target itself runs the C layers (``target.lean.fused``: skinny products on this CPU, and not
``GRAFT_BLOCK_FUSED=0``) and the drafter is a CPU float32 model of sizes the C layers take.
"""
from __future__ import annotations

import torch

from graft_block import skinny
from graft_block.engine import rms_norm

from ..layers import c_layer, c_layers_reason, release_for_c_layers, rotate_half, weights_key
from .model import DFlashModel


def c_layers_for(model: DFlashModel, target) -> "skinny.DecoderLayers | None":
    """The model's layers packed for the C layers (``layers.c_layer``'s packing), kept on the model
    and shared by every drafter on it (repacked when its weights changed since); None where they cannot run."""
    if why_not(model, target) is not None:
        return None
    kept = model.__dict__.get("_c_layers")
    if kept is None or kept[0] != weights_key([*model.layers.parameters(), model.fc.weight]):
        layers = skinny.DecoderLayers(
            [c_layer(lyr.input_layernorm, lyr.post_attention_layernorm, lyr.self_attn.q_proj, lyr.self_attn.k_proj,
                     lyr.self_attn.v_proj, lyr.self_attn.o_proj, lyr.mlp.gate_proj, lyr.mlp.up_proj,
                     lyr.mlp.down_proj, q_norm=lyr.self_attn.q_norm.weight.detach(),
                     k_norm=lyr.self_attn.k_norm.weight.detach()) for lyr in model.layers],
            model.config.hidden_size, *_heads(model), model.config.intermediate_size,
            model.layers[0].input_layernorm.eps, model.layers[0].self_attn.q_norm.eps,
            model.layers[0].self_attn.head_dim ** -0.5)
        context = _context_pack(model)
        release_for_c_layers(target, model, [m for lyr in model.layers for m in (*lyr.self_attn.children(),
                                                                               *lyr.mlp.children())
                                             if isinstance(m, torch.nn.Linear)])
        # keyed after the release: the freed weights are the state these packs belong to
        kept = model.__dict__["_c_layers"] = (weights_key([*model.layers.parameters(), model.fc.weight]), layers,
                                              context)
    return kept[1]


def _heads(model: DFlashModel) -> tuple[int, int, int]:
    a = model.layers[0].self_attn
    return a.heads, a.kv_heads, a.head_dim


def why_not(model: DFlashModel, target) -> str | None:
    reason = c_layers_reason(target, model.fc.weight)
    if reason is None and getattr(model.config, "hidden_act", "silu") != "silu":
        reason = f"the C layers compute SwiGLU with SiLU, and this drafter's MLP uses {model.config.hidden_act}"
    return reason or skinny.layers_unsupported(model.config.hidden_size, *_heads(model))


def _context_pack(model: DFlashModel) -> tuple:
    """Every layer's k_proj and v_proj as one product (the context K/V of all layers in one call), its bias, the
    layers' k_norm weights [layers, 1, head_dim], and ``fc`` packed (None with a bias: the module runs it)."""
    attn = [lyr.self_attn for lyr in model.layers]
    w = torch.cat([t for a in attn for t in (a.k_proj.weight, a.v_proj.weight)]).detach()
    b = None if attn[0].k_proj.bias is None else \
        torch.cat([t for a in attn for t in (a.k_proj.bias, a.v_proj.bias)]).detach()
    k_norm = torch.stack([a.k_norm.weight.detach() for a in attn]).unsqueeze(1)
    fc = None if model.fc.bias is not None else skinny.SkinnyWeight(model.fc.weight, half=skinny.draft_half())
    return skinny.SkinnyWeight(w, half=skinny.draft_half()), b, k_norm, fc


class CContext:
    """One drafter's context K/V in the C layers' layout (``skinny.LayerCache``): the drafter's ``ctx_len``
    committed rows, a block's rows written after them (and overwritten by the next commit)."""

    def __init__(self, model: DFlashModel, layers: "skinny.DecoderLayers"):
        self.model, self.layers = model, layers
        self.cache = skinny.LayerCache(len(model.layers), *_heads(model)[1:])

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[m, n_feat x H] target features -> the projected context [m, H] float32 (``DFlashModel.fuse``), fc from
        its own pack (the module path's checks cost as much as its few-row product)."""
        fc = self.model.__dict__["_c_layers"][2][3]
        if fc is None or features.shape[-1] != fc.n_in:
            return self.model.fuse(features.unsqueeze(0))[0].to(torch.float32)
        norm = self.model.hidden_norm
        return rms_norm(skinny.linear(features.to(torch.float32), fc), norm.weight, norm.eps)

    def append(self, ctx: torch.Tensor, start: int) -> None:
        """ctx [m, H] (``fuse``) at positions start..start+m -> every layer's context K/V (``context_kv``'s
        k_proj / k_norm / RoPE and v_proj, all layers in one product) at cache rows start..start+m."""
        w, b, k_norm, _ = self.model.__dict__["_c_layers"][2]
        nl, kvh, hd = self.cache.shape
        m = ctx.shape[0]
        kv = skinny.linear(ctx.to(torch.float32).contiguous(), w, b).view(m, nl, 2, kvh, hd)
        k, v = kv[:, :, 0], kv[:, :, 1]
        eps = self.model.layers[0].self_attn.k_norm.eps
        k = torch.rms_norm(k, (hd,), None, eps) * k_norm  # every layer's k_norm at once
        cos, sin = (t.view(m, 1, 1, hd) for t in self.model.rotary.rows(start, m))
        k = k * cos + rotate_half(k) * sin
        self.cache.reserve(start + m, start)
        self.cache.k[:, :, :, start : start + m] = k.permute(1, 2, 3, 0)  # [layers, kv_heads, head_dim, m]
        self.cache.v[:, :, start : start + m] = v.permute(1, 2, 0, 3)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                start: int) -> torch.Tensor:
        """embeds [R, H], positions [R], mask additive [R, start + R] or None (every row sees everything), after
        ``start`` context rows -> the block's normed hidden states [R, H]."""
        R = embeds.shape[0]
        self.cache.reserve(start + R, start)
        x = embeds.to(torch.float32).contiguous().clone()  # updated in place by the layers
        cos, sin = self.model.rope(positions.view(1, -1), x[None])
        if mask is None:  # DFlash's block: no causal mask (an explicit one: the C layers' default is causal)
            mask = torch.zeros(R, start + R)
        mask = mask.reshape(R, start + R).to(torch.float32).contiguous()
        self.layers.run(x, cos[0].contiguous(), sin[0].contiguous(), self.cache.k, self.cache.v, start, mask, {})
        return self.model.norm(x)
