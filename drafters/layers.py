"""Pieces shared by the drafter models (EAGLE3, DFlash, MFD): RMSNorm, rotary position embedding (``Rotary``
for cos/sin, ``apply_rope`` to rotate) and ``Linear``, which runs the target engine's product kernel."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graft_block.drafter import shared_by
from graft_block.engine import inference_linear, rms_norm
from graft_block.errors import ConfigError
from graft_block.skinny import SkinnyWeight, draft_half


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and checkpoint keys) whose no-grad forward runs ``kernel`` when one is set
    (``use_kernel``): drafting is a few rows per product, where the target engine's kernel choice matters as
    much as for the verify. Training (gradients on) is plain ``F.linear``."""

    kernel: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            return F.linear(x, self.weight, self.bias)
        return inference_linear(x, self.weight, self.bias, self.kernel, laid_out(self))


def c_layers_reason(target, weight: torch.Tensor) -> str | None:
    """Why a drafter whose weights are like ``weight`` cannot run its layers on the target's C decoder layers
    (``skinny.DecoderLayers``); None when it can: the target runs them, and the drafter is float32 on the CPU."""
    lean = getattr(target, "lean", None)
    if lean is None or getattr(lean, "fused", None) is None:
        return "the target does not run the C decoder layers"
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return f"the drafter is {weight.dtype} on {weight.device}, not float32 on the CPU"
    return None


def c_layer(ln1, ln2, q, k, v, o, gate, up, down, **extra) -> dict:
    """One decoder layer's weights for ``skinny.DecoderLayers`` from its modules: q/k/v and gate/up fused into one
    packed product each, packed as ``skinny.draft_half()`` says (bfloat16 on AVX512-BF16 CPUs, else float16 where
    the weights are fp16-exact, as our checkpoints are); ``extra``: q_norm / k_norm weights, or EAGLE-3's ``hn`` /
    ``norm_residual``."""
    half = draft_half()

    def bias(*mods):
        return None if mods[0].bias is None else torch.cat([m.bias.detach() for m in mods])

    def pack(*mods):
        return SkinnyWeight(torch.cat([m.weight for m in mods]).detach(), half=half)

    return dict(ln1=ln1.weight.detach(), ln2=ln2.weight.detach(), qkv=pack(q, k, v), qkv_b=bias(q, k, v),
                o=pack(o), o_b=bias(o), gu=pack(gate, up), gu_b=bias(gate, up), d=pack(down), d_b=bias(down),
                **extra)


def weights_key(params) -> tuple:
    """What C-layer packs kept on a module were made from: each parameter's address and version (an in-place
    update bumps a version, a new tensor moves the address) and the packing drafters use now (``draft_half``), so
    packs are redone when either changed."""
    return tuple((p.data_ptr(), p._version) for p in params) + (draft_half(),)


def release_for_c_layers(target, module: nn.Module, linears) -> None:
    """In the benchmark (``target.share_drafter_checkpoints``, ``module`` loaded through ``shared_checkpoint``),
    free the weights of ``linears`` once the C layers' packs serve every forward, and mark ``module`` so that its
    torch forward fails clearly. A module a caller passed in is left alone."""
    if not getattr(target, "share_drafter_checkpoints", False) or not shared_by(target, module):
        return
    for m in linears:
        m.weight = nn.Parameter(m.weight.new_empty(0), requires_grad=False)
        m.__dict__.pop("_laid_out", None)
    module.__dict__["_released"] = ("the benchmark drafts on their C-layer packs (a target with "
                                    "share_drafter_checkpoints); load the checkpoint again to run them in torch")


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
        return rms_norm(x, self.weight, self.eps)


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
        # angles that do not depend on the sequence length are looked up on CPU: HF's ~10 small ops a call are
        # a measurable share of a drafting level there (dynamic and longrope rescale with the length: computed)
        self.static = "dynamic" not in self.emb.rope_type and self.emb.rope_type != "longrope"  # HF's own test
        self.table: tuple[torch.Tensor, torch.Tensor] | None = None  # fp32 cos, sin [positions, hd]

    def __call__(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, T, hd] in ``like``'s dtype (computed in fp32 on ``like``'s device)."""
        if self.emb.inv_freq.device != like.device:
            self.emb.to(like.device)
        if (not self.static or like.device.type != "cpu" or positions.numel() == 0
                or positions.dtype not in (torch.int32, torch.int64)):
            return self.emb(like, positions)
        low, high = (int(v) for v in torch.aminmax(positions))
        if low < 0:  # negative angles are HF's to compute
            return self.emb(like, positions)
        cos, sin = self._table(high + 1)
        return cos[positions].to(like.dtype), sin[positions].to(like.dtype)

    def rows(self, first: int, count: int, step: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos, sin [count, hd] at positions first, first + step, ... (step 0: ``count`` rows at ``first``, a
        tree level) on the CPU: table views, no per-call index ops (a drafting level's rows are one or the other)."""
        if step not in (0, 1) or first < 0 or not self.static:
            pos = first + step * torch.arange(count).view(1, -1)
            cos, sin = self(torch.empty(0), pos)
            return cos[0], sin[0]
        cos, sin = self._table(first + (count if step else 1))
        if step:
            return cos[first:first + count], sin[first:first + count]
        return cos[first].expand(count, -1), sin[first].expand(count, -1)

    def _table(self, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The CPU table of cos, sin for positions 0..top-1 at least (grown by powers of two)."""
        if self.table is None or self.table[0].shape[0] < top:
            if self.emb.inv_freq.device.type != "cpu":
                self.emb.to("cpu")
            rows = max(1024, 1 << (top - 1).bit_length())
            cos, sin = self.emb(torch.empty(0), torch.arange(rows).view(1, -1))
            self.table = cos[0], sin[0]
        return self.table
