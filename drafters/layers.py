"""Pieces shared by the drafter models (EAGLE3, DFlash, MFD): RMSNorm and rotary position embedding (``Rotary``
for cos/sin, ``apply_rope`` to rotate)."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """LLaMA/Qwen RMSNorm: normalised in fp32, scaled in the input dtype (``weight`` key as in HF checkpoints)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd]; cos/sin [B, T, hd]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class Rotary:
    """RoPE cos/sin at absolute positions from an HF config (``rope_parameters``/``head_dim``; any rope type HF
    knows, with HF's numerics). A plain object, not a submodule, so ``module.to(bfloat16)`` cannot round
    ``inv_freq``: rounded frequencies turn the angle at position p by p x the rounding error (up to pi within a few
    thousand positions), while HF and the reference checkpoints keep them in fp32."""

    def __init__(self, config):
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.emb = LlamaRotaryEmbedding(config)

    def __call__(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, T, hd] in ``like``'s dtype (computed in fp32 on ``like``'s device)."""
        if self.emb.inv_freq.device != like.device:
            self.emb.to(like.device)
        return self.emb(like, positions)
