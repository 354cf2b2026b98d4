"""The EAGLE-3 head's layer on the target's C decoder layers (``skinny.DecoderLayers``), as the target runs.

EAGLE-3's one layer reads [input_layernorm(token embedding) ; hidden_norm(fused features)] (2 x hidden wide) into
q/k/v, and its residual is the fused features (or their norm, ``norm_before_residual``); the rest is a Llama
layer. The C layers take that input as their ``hn`` variant, with the head's K/V (accepted pairs, then this
round's tree nodes after them) in their cache layout. One C call per expansion level replaces ~30 small torch
ops, most of an EAGLE-3 round's drafting on a 2-core CPU. Drafting numerics need not match the torch forward bit
for bit (the verify decides what is kept); ``tests/test_eagle3.py`` checks that they agree to float32 rounding.
"""
from __future__ import annotations

import torch

from graft_block import skinny

from ..layers import release_linears
from .model import Eagle3Head


def why_not(head: Eagle3Head, target) -> str | None:
    lean = getattr(target, "lean", None)
    if lean is None or getattr(lean, "fused", None) is None:
        return "the target does not run the C decoder layers"
    w = head.fc.weight
    if w.dtype != torch.float32 or w.device.type != "cpu":
        return f"the head is {w.dtype} on {w.device}, not float32 on the CPU"
    a = head.midlayer.self_attn
    return skinny.layers_unsupported(head.cfg.hidden_size, a.n_heads, a.n_kv, a.head_dim)


def _pack(head: Eagle3Head) -> "skinny.DecoderLayers":
    m, cfg = head.midlayer, head.cfg
    a, mlp = m.self_attn, m.mlp
    bias = None if a.q_proj.bias is None else torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]).detach()
    layer = dict(ln1=m.input_layernorm.weight.detach(), hn=m.hidden_norm.weight.detach(),
                 norm_residual=m.norm_before_residual, ln2=m.post_attention_layernorm.weight.detach(),
                 qkv=skinny.SkinnyWeight(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach()),
                 qkv_b=bias, o=skinny.SkinnyWeight(a.o_proj.weight),
                 gu=skinny.SkinnyWeight(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()),
                 d=skinny.SkinnyWeight(mlp.down_proj.weight))
    return skinny.DecoderLayers([layer], cfg.hidden_size, a.n_heads, a.n_kv, a.head_dim, cfg.intermediate_size,
                                m.input_layernorm.eps, 0.0, a.head_dim ** -0.5)


class CLayer:
    """The head's layer packed for C (shared by every drafter on the head) and one drafter's K/V cache:
    ``forward`` runs rows at cache rows start.., each seeing the rows before start that its mask allows (causal
    when the mask is None). ``release``: the head's torch layer weights are freed once packed (the benchmark)."""

    def __init__(self, head: Eagle3Head, release: bool = False):
        if "_c_layer" not in head.__dict__:
            head.__dict__["_c_layer"] = _pack(head)
            if release:
                m = head.midlayer
                release_linears(head, [*m.self_attn.children(), *m.mlp.children()],
                                "the benchmark drafts on their C-layer packs (a target with "
                                "share_drafter_checkpoints); load the checkpoint again to run them in torch")
        a = head.midlayer.self_attn
        self.head, self.layers = head, head.__dict__["_c_layer"]
        self.cache = skinny.LayerCache(1, a.n_kv, a.head_dim)

    def forward(self, emb: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, start: int,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """emb, g [f, hidden] (token embeddings, fused features), positions [f] -> the layer's pre-norm output
        [f, hidden]; the rows' K/V go to cache rows start..start+f. mask: additive [f, start + f] or None."""
        f = g.shape[0]
        self.cache.reserve(start + f, start)
        x = g.to(torch.float32).contiguous().clone()  # updated in place by the layer
        cos, sin = self.head.rope(x[None], positions.view(1, -1))
        if mask is not None:
            mask = mask.reshape(f, start + f).to(torch.float32).contiguous()
        self.layers.run(x, cos[0].contiguous(), sin[0].contiguous(), self.cache.k, self.cache.v, start, mask, {},
                        emb=emb.to(torch.float32).contiguous())
        return x
