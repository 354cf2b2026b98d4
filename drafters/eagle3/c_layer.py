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

from ..layers import c_layer, c_layers_reason, release_for_c_layers, weights_key
from .model import Eagle3Head


def why_not(head: Eagle3Head, target) -> str | None:
    a = head.midlayer.self_attn
    return c_layers_reason(target, head.fc.weight) or \
        skinny.layers_unsupported(head.cfg.hidden_size, a.n_heads, a.n_kv, a.head_dim)


class CLayer:
    """The head's layer packed for C (kept on the head, shared by every drafter on it, repacked when its weights
    changed since) and one drafter's K/V cache: ``forward`` runs rows at cache rows start.., each seeing the rows
    before start that its mask allows (causal when the mask is None)."""

    def __init__(self, head: Eagle3Head, target=None):
        m, cfg = head.midlayer, head.cfg
        a = m.self_attn
        kept = head.__dict__.get("_c_layer")
        if kept is None or kept[0] != weights_key([*m.parameters(), head.lm_head.weight, head.fc.weight]):
            layer = c_layer(m.input_layernorm, m.post_attention_layernorm, a.q_proj, a.k_proj, a.v_proj, a.o_proj,
                            m.mlp.gate_proj, m.mlp.up_proj, m.mlp.down_proj, hn=m.hidden_norm.weight.detach(),
                            norm_residual=m.norm_before_residual)
            layers = skinny.DecoderLayers([layer], cfg.hidden_size, a.n_heads, a.n_kv, a.head_dim,
                                          cfg.intermediate_size, m.input_layernorm.eps, 0.0, a.head_dim ** -0.5)
            # the final norm and LM head in one C call, not a module chain: ~0.1 ms of wrappers per level otherwise
            lm = None if head.lm_head.bias is not None else skinny.SkinnyWeight(head.lm_head.weight,
                                                                                half=skinny.draft_half())
            # fc too (its pack called directly: the module path's checks cost as much as its 1-5-row product)
            fc = None if cfg.norm_before_fc or head.fc.bias is not None else skinny.SkinnyWeight(
                head.fc.weight, half=skinny.draft_half())
            release_for_c_layers(target, head, [*a.children(), *m.mlp.children(), *([head.lm_head] if lm else []),
                                                *([head.fc] if fc else [])])
            # keyed after the release: the freed weights are the state this pack belongs to
            key = weights_key([*m.parameters(), head.lm_head.weight, head.fc.weight])
            kept = head.__dict__["_c_layer"] = (key, layers, lm, fc)
        self.head, self.layers, self.lm, self.fc = head, kept[1], kept[2], kept[3]
        self.cache = skinny.LayerCache(1, a.n_kv, a.head_dim)

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """[m, 3 x target hidden] target features -> [m, hidden] float32 (``Eagle3Head.fuse``)."""
        if self.fc is None or feats.shape[-1] != self.fc.n_in:
            return self.head.fuse(feats)  # (which names a wrong feature width)
        return skinny.linear(feats.to(torch.float32), self.fc)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The head's draft-vocabulary logits of pre-norm outputs [f, hidden] (``Eagle3Head.logits``)."""
        if self.lm is None:
            return self.head.logits(out)
        n = self.head.norm
        return skinny.norm_linear(out.to(torch.float32), n.weight.detach(), n.eps, self.lm)

    def forward(self, emb: torch.Tensor, g: torch.Tensor, position: int, start: int,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """emb, g [f, hidden] float32 (token embeddings, fused features) -> the layer's pre-norm output [f, hidden];
        the rows' K/V go to cache rows start..start+f. Without a mask the rows are consecutive positions from
        ``position``, causal; with an additive mask [f, start + f] they are one tree level, all at ``position``."""
        f = g.shape[0]
        self.cache.reserve(start + f, start)
        x = g.contiguous().clone()  # updated in place by the layer
        cos, sin = self.head.rotary.rows(position, f, 0 if mask is not None else 1)
        self.layers.run(x, cos.contiguous(), sin.contiguous(), self.cache.k, self.cache.v, start, mask, {},
                        emb=emb.contiguous())
        return x
