"""The DFlash draft model: Qwen3-style layers whose attention reads target context by KV injection.

Target features (HF ``hidden_states[id+1]`` for ``target_layer_ids``) are concatenated, projected by ``fc`` (no
bias) and ``hidden_norm``; in every draft layer that context goes through the layer's own ``k_proj``/``v_proj``,
``k_norm`` and RoPE at its own positions and is attended to non-causally by the block queries (Q comes only from
block rows). The model has no embeddings and no LM head: both are the target's, frozen.

Structure for subclasses (MFD adds K mode embeddings and K mode-replicated block rows in one forward):
  - ``DFlashModel.fuse(features)`` -> projected context ``[b, m, H]``;
  - ``DFlashModel.context_kv(ctx, positions)`` -> per-layer ``(k, v)`` (k_norm + RoPE applied);
  - ``DFlashModel.forward(block_embeds, block_positions, ctx_kv, mask=None)``: ``block_embeds`` is ``[R, H]`` or
    ``[b, R, H]`` (modify embeddings freely before calling: mode embeddings, etc.), ``block_positions`` ``[R]`` or
    ``[b, R]`` (absolute positions: replicated rows may share positions), ``mask`` an optional additive float mask
    ``[R, m + R]`` or ``[b, 1, R, m + R]`` over [context columns; block columns] (None = every row sees all
    context and all block rows, DFlash's non-causal block). Returns normed hidden ``[.., R, H]``;
  - ``DFlashModel.logits(hidden, lm_head_weight)`` through the target LM head (restricted to ``draft_vocab`` when
    the checkpoint carries one).

Draft vocabulary (optional, our extension): a checkpoint may carry a ``draft_vocab`` int64 tensor of target ids;
draft logits are then computed over those LM-head rows only (cheaper, and never-trained tokens cannot win the
argmax). z-lab checkpoints have none and load unchanged.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

from graft_block.engine import inference_linear
from graft_block.errors import ConfigError

from ..layers import RMSNorm, Rotary, apply_rope, check_not_released, laid_out


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default: uniform between the 2nd and the 3rd-to-last target layer (0-based decoder-layer ids)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


class DFlashAttention(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # z-lab's reference puts attention_bias on all four projections (o_proj included)
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, n, H] -> k, v [b, kv_heads, n, hd]; k normed and rotated at its positions."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k, v = self.kv(x, cos, sin)
        k = torch.cat([ctx_k.expand(b, -1, -1, -1), k], dim=2)  # [context; block]
        v = torch.cat([ctx_v.expand(b, -1, -1, -1), v], dim=2)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashModel(nn.Module):
    """The trainable drafter (no embeddings, no LM head: both are the target's, frozen)."""

    kernel: str | None = None  # the product kernel of no-grad forwards (``layers.use_kernel``)

    def __init__(self, config: Qwen3Config, block_size: int, target_layer_ids: Sequence[int], mask_token_id: int,
                 num_target_layers: int | None = None, draft_vocab: torch.Tensor | None = None):
        super().__init__()
        if not isinstance(block_size, int) or block_size < 2:
            raise ConfigError(f"block_size must be an int >= 2 (bonus + at least one proposal), got {block_size!r}")
        if not target_layer_ids:
            raise ConfigError("target_layer_ids is empty: DFlash needs at least one target feature layer")
        self.config = config
        self.block_size = block_size
        self.target_layer_ids = [int(i) for i in target_layer_ids]
        self.mask_token_id = int(mask_token_id)
        self.num_target_layers = num_target_layers
        H = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(H, eps=config.rms_norm_eps)
        self.rotary = Rotary(config)
        self.register_buffer("draft_vocab", None if draft_vocab is None else draft_vocab.long(), persistent=False)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(i + 1 for i in self.target_layer_ids)

    def rope(self, positions: torch.Tensor, like: torch.Tensor):
        return self.rotary(like, positions)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[.., m, n_feat * H] concatenated target features -> projected context [.., m, H]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """ctx [b, m, H] (from ``fuse``), positions [b, m] -> per layer (k, v) [b, kv_heads, m, hd]."""
        check_not_released(self)
        cos, sin = self.rope(positions, ctx)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor, ctx_kv, mask=None) -> torch.Tensor:
        check_not_released(self)
        unbatched = block_embeds.dim() == 2
        x = block_embeds.unsqueeze(0) if unbatched else block_embeds
        pos = block_positions.view(1, -1) if block_positions.dim() == 1 else block_positions
        if mask is not None and mask.dim() == 2:
            mask = mask.view(1, 1, *mask.shape)
        x = x.to(self.fc.weight.dtype)  # before the mask: SDPA wants the mask in the queries' (the model's) dtype
        if mask is not None:
            mask = mask.to(x.dtype)
        cos, sin = self.rope(pos, x)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k, v, mask)
        x = self.norm(x)
        return x[0] if unbatched else x

    def logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, lm_head_bias=None,
               restricted: bool = False, layouts: dict | None = None) -> torch.Tensor:
        """Target LM head on draft hidden states; columns = ``draft_vocab`` ids when present, else the full vocab.
        ``restricted=True``: the weight (and bias) already hold only the draft-vocab rows (cached by the drafter).
        ``layouts``: where the weight's kernel layouts are kept (shared by drafters on the same rows; else this
        module's own)."""
        if self.draft_vocab is not None and not restricted:
            lm_head_weight = lm_head_weight[self.draft_vocab]
            lm_head_bias = None if lm_head_bias is None else lm_head_bias[self.draft_vocab]
            # a fresh gather every call: no layout worth keeping
            return F.linear(hidden.to(lm_head_weight.dtype), lm_head_weight, lm_head_bias)
        # the head's dtype is the target's, which a drafter loaded in another dtype does not share
        return inference_linear(hidden.to(lm_head_weight.dtype), lm_head_weight, lm_head_bias, self.kernel,
                                laid_out(self) if layouts is None else layouts)

    def to_vocab_ids(self, cols: torch.Tensor) -> torch.Tensor:
        """Logit column indices -> target token ids."""
        return cols if self.draft_vocab is None else self.draft_vocab.to(cols.device)[cols]
