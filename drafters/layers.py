"""Pieces shared by the drafter models (EAGLE3, DFlash, MFD): RMSNorm, rotary position embedding (``Rotary``
for cos/sin, ``apply_rope`` to rotate) and ``Linear``, which runs the target engine's product kernel."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graft_block.engine import inference_linear
from graft_block.errors import ConfigError


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and checkpoint keys) whose no-grad forward runs ``kernel`` when one is set
    (``use_kernel``): drafting is a few rows per product, where the target engine's kernel choice matters as
    much as for the verify. Training (gradients on) is plain ``F.linear``."""

    kernel: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            return F.linear(x, self.weight, self.bias)
        return inference_linear(x, self.weight, self.bias, self.kernel, laid_out(self))


def release_linears(module: nn.Module, linears, why: str) -> int:
    """Free the weights of ``linears`` (linear layers inside ``module``) once another copy serves every forward
    (the C layers' packs), and mark ``module`` so that its torch forward fails clearly. Returns the bytes freed."""
    freed = 0
    for m in linears:
        freed += m.weight.numel() * m.weight.element_size()
        m.weight = nn.Parameter(m.weight.new_empty(0), requires_grad=False)
        m.__dict__.pop("_laid_out", None)
    module.__dict__["_released"] = why
    return freed


def check_not_released(module: nn.Module) -> None:
    why = module.__dict__.get("_released")
    if why:
        raise ConfigError(f"this {type(module).__name__}'s torch layers were freed: {why}")


def laid_out(module: nn.Module) -> dict:
    """The module's kept weight layout (``engine.inference_linear``'s cache), outside its parameters and buffers."""
    return module.__dict__.setdefault("_laid_out", {})


def use_kernel(module: nn.Module, kernel: str | None) -> None:
    """Every linear layer in ``module`` runs its no-grad forwards through ``kernel`` (None: ``F.linear``): a plain
    ``nn.Linear`` (also inside transformers' modules) becomes a ``Linear``, a class swap that adds no parameter;
    a module with its own ``kernel`` attribute (DFlash's LM-head product) takes it too."""
    for m in module.modules():
        if type(m) is nn.Linear and kernel is not None:  # without a kernel the module stays as it was built
            m.__class__ = Linear
        if isinstance(m, Linear) or hasattr(type(m), "kernel"):
            m.kernel = kernel


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
