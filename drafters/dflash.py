"""DFlash: a block-diffusion drafter conditioned on target features by KV injection (z-lab/dflash format).

One draft forward per round proposes a whole block. The block is ``[bonus, mask x (B-1)]`` embedded with the
*target's* embedding table; draft row k (k >= 1) predicts the token at position ``start + k`` (same-position, no
shift) through the draft's final ``norm`` and the *target's* LM head. Target features (HF ``hidden_states[id+1]``
for ``target_layer_ids``) are concatenated, projected by ``fc`` (no bias) and ``hidden_norm``; in every draft layer
that context goes through the layer's own ``k_proj``/``v_proj``, ``k_norm`` and RoPE at its own positions and is
attended to non-causally by the block queries (Q comes only from block rows). The draft "KV cache" holds only
context K/V (one entry per committed token whose target features are known), so it is "cropped to start" by
construction: block K/V are never stored.

Structure for subclasses (MFD adds K mode embeddings and K mode-replicated block rows in one forward):
  - ``DFlashModel.fuse(features)`` -> projected context ``[b, m, H]``;
  - ``DFlashModel.context_kv(ctx, positions)`` -> per-layer ``(k, v)`` (k_norm + RoPE applied);
  - ``DFlashModel.forward(block_embeds, block_positions, ctx_kv, mask=None)``: ``block_embeds`` is ``[R, H]`` or
    ``[b, R, H]`` (modify embeddings freely before calling: mode embeddings, etc.), ``block_positions`` ``[R]`` or
    ``[b, R]`` (absolute positions: replicated rows may share positions), ``mask`` an optional additive float mask
    ``[R, m + R]`` or ``[b, 1, R, m + R]`` over [context columns; block columns] (None = every row sees all
    context and all block rows, DFlash's non-causal block). Returns normed hidden ``[.., R, H]``;
  - ``DFlashModel.logits(hidden, lm_head_weight)`` through the target LM head (restricted to ``draft_vocab`` when
    the checkpoint carries one);
  - ``DFlashDrafter.block_hidden(state, block_ids)`` runs one block against the drafter's context cache.

Mask token for SmolLM2: the tokenizer has no mask token, so the default checkpoint uses id 16 ``<empty_output>``, a
StarCoder-era special token that never occurs in chat text: it is a real row of the embedding table (required: the
block embeds it), distinct from pad/BOS/EOS (``<|endoftext|>`` 0, ``<|im_start|>`` 1, ``<|im_end|>`` 2), and
frozen like every target embedding.

Training plug-in (graft_block.training): ``training_model`` (random init, warm start from the target's own decoder
layers with ``fc`` passing one feature through, or continue a checkpoint), ``training_loss`` (random anchors per
sequence, block [anchor, mask x (B-1)], context strictly before the anchor, blocks isolated by an additive mask,
CE with weights exp(-(k-1)/gamma) mixed with soft-label CE against the target's top-k, teacher-forced accepted
length per block as the monitor), ``save_trained`` (z-lab format + {"type": "dflash"}).

Draft vocabulary (optional, our extension): a checkpoint may carry a ``draft_vocab`` int64 tensor of target ids;
draft logits are then computed over those LM-head rows only (cheaper, and never-trained tokens cannot win the
argmax). z-lab checkpoints have none and load unchanged.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from graft_block.drafter import Drafter, check_budget, read_weights, register
from graft_block.errors import ConfigError
from graft_block.tree import Tree, chain, root_only
from graft_block.tree.ddtree import ddtree, topk_logprobs

SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size", "hidden_act", "attention_bias")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default: uniform between the 2nd and the 3rd-to-last target layer (0-based decoder-layer ids)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, n, hd]; cos/sin [b, n, hd]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


# ---- model -------------------------------------------------------------------------------------------------
class DFlashAttention(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

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
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashModel(nn.Module):
    """The trainable drafter (no embeddings, no LM head: both are the target's, frozen)."""

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
        self.hidden_norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(config)
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
        cos, sin = self.rope(positions, ctx)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor, ctx_kv, mask=None) -> torch.Tensor:
        unbatched = block_embeds.dim() == 2
        x = block_embeds.unsqueeze(0) if unbatched else block_embeds
        pos = block_positions.view(1, -1) if block_positions.dim() == 1 else block_positions
        if mask is not None and mask.dim() == 2:
            mask = mask.view(1, 1, *mask.shape)
        if mask is not None:
            mask = mask.to(x.dtype)
        x = x.to(self.fc.weight.dtype)
        cos, sin = self.rope(pos, x)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k, v, mask)
        x = self.norm(x)
        return x[0] if unbatched else x

    def logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, lm_head_bias=None,
               restricted: bool = False) -> torch.Tensor:
        """Target LM head on draft hidden states; columns = ``draft_vocab`` ids when present, else the full vocab.
        ``restricted=True``: the weight (and bias) already hold only the draft-vocab rows (cached by the drafter)."""
        if self.draft_vocab is not None and not restricted:
            lm_head_weight = lm_head_weight[self.draft_vocab]
            lm_head_bias = None if lm_head_bias is None else lm_head_bias[self.draft_vocab]
        return F.linear(hidden.to(lm_head_weight.dtype), lm_head_weight, lm_head_bias)

    def to_vocab_ids(self, cols: torch.Tensor) -> torch.Tensor:
        """Logit column indices -> target token ids."""
        return cols if self.draft_vocab is None else self.draft_vocab.to(cols.device)[cols]


# ---- checkpoint IO (z-lab format) --------------------------------------------------------------------------
def read_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.exists():
        raise ConfigError(f"DFlash checkpoint folder {folder} has no config.json")
    return json.loads(path.read_text())


def model_from_config(raw: dict, draft_vocab: torch.Tensor | None = None) -> DFlashModel:
    """A z-lab config.json dict -> an (uninitialised) DFlashModel."""
    dcfg = raw.get("dflash_config") or {}
    block_size = raw.get("block_size", dcfg.get("block_size"))
    if block_size is None:
        raise ConfigError("DFlash config has no block_size (top level or dflash_config.block_size)")
    mask_id = dcfg.get("mask_token_id", raw.get("mask_token_id"))
    if mask_id is None:
        raise ConfigError("DFlash config has no dflash_config.mask_token_id (never substitute pad/eos: set it)")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads"):
        if key not in raw:
            raise ConfigError(f"DFlash config.json lacks {key!r}")
    n_layers = int(raw["num_hidden_layers"])
    num_target = raw.get("num_target_layers")
    layer_ids = dcfg.get("target_layer_ids", raw.get("target_layer_ids"))
    if layer_ids is None:
        if num_target is None:
            raise ConfigError("DFlash config needs dflash_config.target_layer_ids or num_target_layers")
        layer_ids = build_target_layer_ids(int(num_target), n_layers)
    kw = {k: raw[k] for k in SHAPE_KEYS if k in raw}
    kw.setdefault("intermediate_size", 3 * int(raw["hidden_size"]))
    kw.setdefault("num_key_value_heads", raw["num_attention_heads"])
    rope = raw.get("rope_parameters") or {}
    if not rope:
        rope = dict(raw.get("rope_scaling") or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope["rope_theta"] = float(raw.get("rope_theta", 1e6))
    cfg = Qwen3Config(**kw, rope_parameters=rope, tie_word_embeddings=False)
    return DFlashModel(cfg, int(block_size), layer_ids, int(mask_id), num_target, draft_vocab)


def config_dict(model: DFlashModel, extra: dict | None = None) -> dict:
    """z-lab's config.json keys (+ ``extra``, e.g. {"type": "dflash"} for graft-block's registry)."""
    c = model.config
    out = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3"}
    for k in SHAPE_KEYS:
        if hasattr(c, k):
            out[k] = getattr(c, k)
    rope = dict(c.rope_parameters or {})
    out["rope_theta"] = rope.get("rope_theta", 1e6)
    if rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    out["tie_word_embeddings"] = False
    out["layer_types"] = ["full_attention"] * c.num_hidden_layers
    out["block_size"] = model.block_size
    if model.num_target_layers is not None:
        out["num_target_layers"] = int(model.num_target_layers)
    out["dflash_config"] = {"mask_token_id": model.mask_token_id, "target_layer_ids": list(model.target_layer_ids)}
    out.update(extra or {})
    return out


def save_checkpoint(model: DFlashModel, folder: str | Path, dtype=torch.float16, extra: dict | None = None) -> Path:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    if model.draft_vocab is not None:
        tensors["draft_vocab"] = model.draft_vocab.detach().cpu().long().contiguous()
    cfg = config_dict(model, extra)
    cfg["dtype"] = str(dtype).replace("torch.", "")
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return folder


def load_checkpoint(folder: str | Path, device=None, dtype=None) -> DFlashModel:
    """Strict loader: every expected tensor present, nothing unexpected (besides optional ``draft_vocab``), shapes
    equal. Raises ConfigError naming the tensor otherwise."""
    folder = Path(folder)
    raw = read_config(folder)
    tensors = read_weights(folder, "DFlash checkpoint")
    vocab = tensors.pop("draft_vocab", None)
    model = model_from_config(raw, vocab)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ConfigError(
            f"DFlash checkpoint {folder} does not match its config.json: missing tensors {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected tensors {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''} (num_hidden_layers / target_layer_ids / shapes wrong?)"
        )
    for k, v in expected.items():
        if tuple(tensors[k].shape) != tuple(v.shape):
            hint = (" (fc in-features = len(target_layer_ids) x hidden_size: are target_layer_ids right?)"
                    if k == "fc.weight" else "")
            raise ConfigError(f"DFlash checkpoint {folder}: tensor {k} has shape {tuple(tensors[k].shape)}, "
                              f"config.json implies {tuple(v.shape)}{hint}")
    model.load_state_dict(tensors, strict=True)
    dtype = dtype or tensors["fc.weight"].dtype
    return model.to(device=device or "cpu", dtype=dtype)


def check_compatible(model: DFlashModel, target) -> None:
    """Clear errors when a drafter cannot run against this target."""
    H = model.config.hidden_size
    if H != target.hidden_size:
        raise ConfigError(f"drafter hidden_size {H} != target hidden_size {target.hidden_size}: DFlash shares the "
                          "target's embeddings and LM head, so the widths must match (use a drafter for this target)")
    V = getattr(model.config, "vocab_size", None)
    if V is not None and int(V) != target.vocab_size:
        raise ConfigError(f"drafter vocab_size {V} != target vocab size {target.vocab_size}: this drafter was made "
                          "for another target")
    if not 0 <= model.mask_token_id < target.vocab_size:
        raise ConfigError(f"mask_token_id {model.mask_token_id} is not a row of the target's embedding table "
                          f"(0..{target.vocab_size - 1}); set dflash_config.mask_token_id to a real, unused token id")
    if model.num_target_layers is not None and int(model.num_target_layers) != target.num_layers:
        raise ConfigError(f"drafter was trained for a {model.num_target_layers}-layer target, this target has "
                          f"{target.num_layers} layers")
    bad = [i for i in model.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise ConfigError(f"target_layer_ids {bad} are outside 0..{target.num_layers - 1} (decoder-layer ids; "
                          "feature = hidden_states[id + 1])")
    if model.draft_vocab is not None and (model.draft_vocab.min() < 0 or model.draft_vocab.max() >= target.vocab_size):
        raise ConfigError("draft_vocab holds ids outside the target vocabulary")


def new_model(target, num_layers: int = 2, block_size: int = 16, target_layer_ids: Sequence[int] | None = None,
              mask_token_id: int | None = None, num_features: int = 3, seed: int = 0,
              intermediate_size: int | None = None, draft_vocab: torch.Tensor | None = None) -> DFlashModel:
    """A randomly initialised drafter shaped like the target's layers (heads, KV heads, head_dim, rope theta)."""
    tc = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    heads = int(tc.num_attention_heads)
    head_dim = int(getattr(tc, "head_dim", None) or tc.hidden_size // heads)
    rope = dict(getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 1e4})
    cfg = Qwen3Config(hidden_size=target.hidden_size, intermediate_size=intermediate_size or int(tc.intermediate_size),
                      num_hidden_layers=num_layers, num_attention_heads=heads,
                      num_key_value_heads=int(getattr(tc, "num_key_value_heads", heads)), head_dim=head_dim,
                      rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
                      max_position_embeddings=int(getattr(tc, "max_position_embeddings", 4096)),
                      vocab_size=target.vocab_size, rope_parameters=rope, tie_word_embeddings=False)
    if target_layer_ids is None:
        target_layer_ids = build_target_layer_ids(target.num_layers, num_features)
    if mask_token_id is None:
        mask_token_id = target.vocab_size - 1
    torch.manual_seed(seed)
    model = DFlashModel(cfg, block_size, target_layer_ids, mask_token_id, target.num_layers, draft_vocab)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    return model.to(device=target.device, dtype=target.dtype)


# ---- the drafter -------------------------------------------------------------------------------------------
@register("dflash")
class DFlashDrafter(Drafter):
    """Config keys: ``checkpoint`` (folder in z-lab format), ``proposal`` ("chain" | "ddtree"), ``budget``
    (non-root nodes; chain: at most B-1), ``block_size`` (<= the checkpoint's), ``denoise_steps`` (1 = one
    DFlash pass; >1 = commit-by-confidence refinement with diffusers' BlockRefinementScheduler), ``marginal_topk``
    (how many per-position candidates ``last_block_logprobs`` keeps). Random-init keys (no checkpoint, for tests):
    ``num_layers``, ``target_layer_ids``, ``mask_token_id``, ``seed``."""

    def __init__(self, target, model: DFlashModel, proposal: str = "chain", budget: int | None = None,
                 block_size: int | None = None, denoise_steps: int = 1, marginal_topk: int = 8,
                 checkpoint: str | None = None):
        if proposal not in ("chain", "ddtree"):
            raise ConfigError(f"proposal must be 'chain' or 'ddtree', got {proposal!r}")
        check_compatible(model, target)
        self.target, self.model, self.proposal = target, model.eval(), proposal
        self.block_size = model.block_size if block_size is None else int(block_size)
        if not 2 <= self.block_size <= model.block_size:
            raise ConfigError(f"block_size {block_size} must be in 2..{model.block_size} (the trained block size)")
        default_budget = self.block_size - 1
        self.budget = check_budget(default_budget if budget is None else budget)
        if proposal == "chain" and self.budget > self.block_size - 1:
            raise ConfigError(f"a chain proposal has at most block_size - 1 = {self.block_size - 1} nodes, "
                              f"budget is {self.budget}; use proposal='ddtree' for larger budgets")
        if not isinstance(denoise_steps, int) or denoise_steps < 1:
            raise ConfigError(f"denoise_steps must be an int >= 1, got {denoise_steps!r}")
        self.denoise_steps = denoise_steps
        self.marginal_topk = int(marginal_topk)
        self.checkpoint = checkpoint
        self.feature_layers = model.feature_layers
        lm = target.model.get_output_embeddings()
        self._lm_w, self._lm_b = lm.weight, getattr(lm, "bias", None)
        if model.draft_vocab is not None:  # gather the draft-vocab rows once, not every round
            dv = model.draft_vocab.to(lm.weight.device)
            self._lm_w = lm.weight[dv].detach()
            self._lm_b = None if self._lm_b is None else self._lm_b[dv].detach()
        self.ctx_k: list[torch.Tensor] = []
        self.ctx_v: list[torch.Tensor] = []
        self.ctx_len = 0
        self.last_block_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, cfg: dict, target=None) -> "DFlashDrafter":
        if target is None:
            raise ConfigError("the dflash drafter needs the target: Drafter.from_config(cfg, target=target)")
        cfg = dict(cfg)
        keys = ("proposal", "budget", "block_size", "denoise_steps", "marginal_topk")
        opts = {k: cfg.pop(k) for k in keys if k in cfg}
        ckpt = cfg.pop("checkpoint", None)
        if ckpt is not None:
            model = load_checkpoint(ckpt, device=target.device, dtype=target.dtype)
            trained_block = model.block_size
            if "block_size" in opts and opts["block_size"] == trained_block:
                pass
            return cls(target, model, checkpoint=str(ckpt), **opts)
        init = {k: cfg.pop(k) for k in ("num_layers", "target_layer_ids", "mask_token_id", "seed", "num_features")
                if k in cfg}
        if cfg:
            raise ConfigError(f"unknown dflash config keys {sorted(cfg)} (without 'checkpoint' only "
                              "num_layers/target_layer_ids/mask_token_id/seed/num_features and drafter options)")
        model = new_model(target, block_size=opts.get("block_size", 16), **init)
        return cls(target, model, **opts)

    # ---- context cache ----------------------------------------------------------------------------------
    def _extend(self, features: torch.Tensor | None, start: int) -> None:
        if features is None:
            raise ConfigError("the dflash drafter needs target features: the engine did not capture them "
                              f"(feature_layers {self.feature_layers})")
        if start != self.ctx_len:
            raise ConfigError(f"draft context holds {self.ctx_len} tokens but new features start at {start}")
        m = features.shape[0]
        ctx = self.model.fuse(features.unsqueeze(0))
        pos = torch.arange(start, start + m, device=ctx.device).view(1, -1)
        kv = self.model.context_kv(ctx, pos)
        if not self.ctx_k:
            self.ctx_k, self.ctx_v = [k for k, _ in kv], [v for _, v in kv]
        else:
            self.ctx_k = [torch.cat([a, k], 2) for a, (k, _) in zip(self.ctx_k, kv)]
            self.ctx_v = [torch.cat([a, v], 2) for a, (_, v) in zip(self.ctx_v, kv)]
        self.ctx_len += m

    def prefill(self, state) -> None:
        self.ctx_k, self.ctx_v, self.ctx_len = [], [], 0
        with torch.inference_mode():
            self._extend(state.new_features, state.new_features_start)

    def commit(self, state, verified) -> None:
        with torch.inference_mode():
            self._extend(state.new_features, state.new_features_start)

    # ---- drafting ---------------------------------------------------------------------------------------
    def block_hidden(self, state, block_ids: torch.Tensor, block_embeds: torch.Tensor | None = None,
                     positions: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """One draft forward of a block against the committed context -> normed hidden [R, H]."""
        start = state.cache_len
        if self.ctx_len != start:
            raise ConfigError(f"draft context ({self.ctx_len}) out of sync with the target cache ({start})")
        dev = self.target.device
        if block_embeds is None:
            block_embeds = self.target.embed(block_ids.to(dev))
        if positions is None:
            positions = torch.arange(start, start + block_embeds.shape[0], device=dev)
        return self.model(block_embeds, positions, list(zip(self.ctx_k, self.ctx_v)), mask)

    def block_logits(self, state) -> torch.Tensor:
        """Draft logits [B-1, V'] (V' = draft vocab or full) for rows 1..B-1, after ``denoise_steps`` passes."""
        B = self.block_size
        ids = torch.full((B,), self.model.mask_token_id, dtype=torch.long, device=self.target.device)
        ids[0] = state.root_token
        logits = self.model.logits(self.block_hidden(state, ids)[1:], self._lm_w, self._lm_b, restricted=True)
        if self.denoise_steps > 1:
            logits = self._refine(state, ids, logits)
        return logits

    def _refine(self, state, ids, logits):
        """Commit-by-confidence refinement (diffusers' BlockRefinementScheduler, mask mode, greedy): each step
        fixes the most confident still-masked rows to their argmax and redrafts the block with them filled in.
        A row keeps the logits of the pass that committed it, so chain/DDTree read its committed token."""
        from diffusers import BlockRefinementScheduler

        L = ids.numel() - 1
        # threshold > 1: commit exactly the scheduler's even quota per step
        sched = BlockRefinementScheduler(block_length=L, num_inference_steps=self.denoise_steps, threshold=1.1)
        sched.set_timesteps(self.denoise_steps, block_length=L)
        cols = torch.full((1, L), -1, dtype=torch.long, device=logits.device)  # -1 = still masked (column space)
        out = logits.clone()
        for step in range(self.denoise_steps):
            cols = sched.step(logits.unsqueeze(0).float(), step, cols, mask_token_id=-1, temperature=0.0).prev_sample
            still = cols[0] < 0
            if step == self.denoise_steps - 1 or not bool(still.any()):
                break
            block = ids.clone()
            block[1:][~still] = self.model.to_vocab_ids(cols[0][~still])
            logits = self.model.logits(self.block_hidden(state, block)[1:], self._lm_w, self._lm_b, restricted=True)
            out[still] = logits[still]
        return out

    @torch.inference_mode()
    def propose(self, state) -> Tree:
        logits = self.block_logits(state)
        k = max(self.marginal_topk, self.budget if self.proposal == "ddtree" else 1)
        cols, lps = topk_logprobs(logits, k)
        ids = self.model.to_vocab_ids(cols.to(self.target.device)).cpu()
        self.last_block_logprobs = (ids, lps)  # per-position marginals (top-k) for Graft-TAIL / chimeric analysis
        with state.section("tree"):
            if self.proposal == "chain":
                n = min(self.budget, ids.shape[0])
                return chain(state.root_token, ids[:n, 0], torch.cumsum(lps[:n, 0].double(), 0).float())
            return ddtree(state.root_token, ids[:, : min(self.budget, ids.shape[1])],
                          lps[:, : min(self.budget, ids.shape[1])], self.budget)

    def describe(self) -> dict:
        return {"type": self.type_name, "budget": self.budget, "proposal": self.proposal,
                "block_size": self.block_size, "denoise_steps": self.denoise_steps, "checkpoint": self.checkpoint,
                "layers": self.model.config.num_hidden_layers, "target_layer_ids": self.model.target_layer_ids}

    # ---- training plug-in (graft_block.training) --------------------------------------------------------
    @classmethod
    def training_model(cls, target, cfg: dict, init: str | None = None) -> DFlashModel:
        return training_model(target, cfg, init)

    @classmethod
    def training_loss(cls, model, target, batch):
        return training_loss(model, target, batch)

    @classmethod
    def save_trained(cls, model, out_dir, cfg: dict) -> None:
        save_checkpoint(model, out_dir, extra={"type": "dflash"})


# ---- training ----------------------------------------------------------------------------------------------
TRAIN_DEFAULTS = {"num_layers": 3, "block_size": 16, "target_layer_ids": None, "mask_token_id": None,
                  "num_anchors": 32, "gamma": None, "soft_weight": 0.5, "init_layers": None, "passthrough": -1}


@torch.no_grad()
def warm_start(model: DFlashModel, target, layers: Sequence[int], passthrough: int = -1) -> None:
    """Initialise draft layer i from target decoder layer ``layers[i]`` (same shapes), ``fc`` to pass one feature
    through unchanged (``passthrough`` indexes ``target_layer_ids``), ``hidden_norm`` to that first copied layer's
    input norm (so context K/V start as the target's own) and ``norm`` to the target's final norm.
    q_norm/k_norm (absent in Llama-style targets) start at the per-channel RMS of the target's q/k on a short text,
    so attention logits keep their scale."""
    base = target.model.get_decoder() if hasattr(target.model, "get_decoder") else target.model.model
    if len(layers) != len(model.layers):
        raise ConfigError(f"init_layers has {len(layers)} entries for {len(model.layers)} draft layers")
    ids = torch.arange(1, 65, device=target.device).view(1, -1) * 37 % max(2, target.vocab_size - 1) + 1
    hs = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    for dl, tl in zip(model.layers, layers):
        src = base.layers[int(tl)]
        sd = {k: v for k, v in src.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
        own = dl.state_dict()
        for k, v in sd.items():
            if k not in own:
                continue
            if own[k].shape != v.shape:
                raise ConfigError(f"cannot warm-start draft layer from target layer {tl}: {k} {tuple(v.shape)} "
                                  f"!= {tuple(own[k].shape)}")
            own[k].copy_(v)
        if not any(k.endswith("q_norm.weight") for k in sd):
            x = src.input_layernorm(hs[int(tl)][0, 1:])  # skip position 0 (a massive activation sits there)
            a = dl.self_attn
            q = a.q_proj(x).view(-1, a.head_dim)
            k = a.k_proj(x).view(-1, a.head_dim)
            a.q_norm.weight.copy_(q.pow(2).mean(0).sqrt())
            a.k_norm.weight.copy_(k.pow(2).mean(0).sqrt())
    H = model.config.hidden_size
    j = passthrough % len(model.target_layer_ids)
    model.fc.weight.zero_()
    model.fc.weight[:, j * H:(j + 1) * H] = torch.eye(H, dtype=model.fc.weight.dtype, device=model.fc.weight.device)
    model.hidden_norm.weight.copy_(base.layers[int(layers[0])].input_layernorm.weight)
    model.norm.weight.copy_(base.norm.weight)


def training_model(target, cfg: dict, init: str | None = None) -> DFlashModel:
    """``init``: None/"random", "target" (warm start from the target's last ``num_layers`` decoder layers, or
    ``cfg["init_layers"]``), or a DFlash checkpoint folder (continue training it)."""
    opts = {**TRAIN_DEFAULTS, **{k: v for k, v in cfg.items() if k in TRAIN_DEFAULTS}}
    vocab = cfg.get("draft_vocab")
    vocab = None if vocab is None else torch.as_tensor(vocab, dtype=torch.long).sort().values
    if init not in (None, "random", "target"):
        model = load_checkpoint(init, device=target.device, dtype=torch.float32)
        if model.draft_vocab is not None:
            vocab = model.draft_vocab
    else:
        ids = opts["target_layer_ids"] or build_target_layer_ids(target.num_layers, 3)
        mask = opts["mask_token_id"] if opts["mask_token_id"] is not None else target.vocab_size - 1
        model = new_model(target, opts["num_layers"], opts["block_size"], ids, mask, draft_vocab=vocab)
        model = model.float()
        if init == "target":
            n = opts["num_layers"]
            layers = opts["init_layers"] or list(range(target.num_layers - n, target.num_layers))
            warm_start(model, target, layers, opts["passthrough"])
    model.draft_vocab = None if vocab is None else vocab.to(target.device)
    check_compatible(model, target)
    model.train_opts = block_loss_opts(cfg, model.block_size)
    return model.to(target.device)


def block_loss_opts(cfg: dict, block_size: int) -> dict:
    """The block loss's options (anchors per sequence, soft-label weight, position decay gamma) from ``cfg`` over
    ``TRAIN_DEFAULTS``; gamma defaults to the DFlash paper's value for the block size."""
    opts = {**TRAIN_DEFAULTS, **{k: v for k, v in cfg.items() if k in TRAIN_DEFAULTS}}
    gamma = opts["gamma"] or {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, block_size / 2.3)
    return {"num_anchors": int(opts["num_anchors"]), "soft_weight": float(opts["soft_weight"]), "gamma": gamma}


def block_attention_mask(anchors: torch.Tensor, ctx_len: int, B: int, dtype) -> torch.Tensor:
    """anchors [b, n] -> additive mask [b, 1, n*B, ctx_len + n*B]: a block row sees context positions strictly
    before its anchor and every row of its own block (bidirectional), nothing of other blocks."""
    b, n = anchors.shape
    dev = anchors.device
    row_anchor = anchors.repeat_interleave(B, dim=1)  # [b, R]
    ctx_ok = torch.arange(ctx_len, device=dev).view(1, 1, -1) < row_anchor.unsqueeze(-1)
    blk = torch.arange(n, device=dev).repeat_interleave(B)
    blk_ok = (blk.view(-1, 1) == blk.view(1, -1)).unsqueeze(0).expand(b, -1, -1)
    ok = torch.cat([ctx_ok, blk_ok], dim=-1)
    return torch.zeros(ok.shape, dtype=dtype, device=dev).masked_fill(~ok, torch.finfo(dtype).min).unsqueeze(1)


def sample_anchors(prompt_len: torch.Tensor, lengths: torch.Tensor, n: int, generator=None):
    """n anchors per sequence, uniform over response positions a with a + 1 still in the sequence (the anchor
    and its next token are both response tokens). Returns (anchors [b, n], valid [b])."""
    lo = prompt_len
    hi = lengths - 2
    span = (hi - lo + 1).clamp(min=1)
    u = torch.rand((lo.numel(), n), generator=generator)
    anchors = lo.view(-1, 1) + (u * span.view(-1, 1)).long()
    return anchors, hi >= lo


def make_blocks(model: DFlashModel, batch: dict) -> dict:
    """The training blocks of one batch (shared with MFD): ``num_anchors`` random anchors per sequence, each a block
    [anchor token, mask x (B-1)] at positions anchor..anchor+B-1 whose row k is labelled with the target's token at
    anchor + k. Returns anchors [b, n], seq_ok [b], pos [b, n, B], blk_ids [b, n, B], valid / labels [b, n, B-1],
    src [b, n, B-1] (flat row of the target's top-k distribution for that label) and ctx_kv."""
    ids, lengths, plen = batch["ids"], batch["lengths"], batch["prompt_len"]
    dev = model.fc.weight.device
    b, L = ids.shape
    B, n = model.block_size, model.train_opts["num_anchors"]
    anchors, seq_ok = sample_anchors(plen.cpu(), lengths.cpu(), n, batch.get("generator"))
    anchors, seq_ok = anchors.to(dev), seq_ok.to(dev)
    pos = anchors.unsqueeze(-1) + torch.arange(B, device=dev)  # [b, n, B]
    blk_ids = torch.full((b, n, B), model.mask_token_id, dtype=torch.long, device=dev)
    blk_ids[:, :, 0] = ids.gather(1, anchors)
    lab_pos = pos[:, :, 1:]
    valid = (lab_pos < lengths.view(-1, 1, 1)) & seq_ok.view(-1, 1, 1)
    # labels[t] = the target's token at t (== ids for target-generated data; the target's argmax for offline text)
    labels = batch.get("labels", ids).gather(1, lab_pos.clamp(max=L - 1).view(b, -1)).view(b, n, B - 1)
    # the distribution of token anchor+k sits at data row anchor+k-1
    src = torch.arange(b, device=dev).view(b, 1, 1) * L + (lab_pos - 1).clamp(max=L - 1)
    ctx = model.fuse(batch["feats"])
    ctx_kv = model.context_kv(ctx, torch.arange(L, device=dev).expand(b, L))
    return {"anchors": anchors, "seq_ok": seq_ok, "pos": pos, "blk_ids": blk_ids, "valid": valid, "labels": labels,
            "src": src, "ctx_kv": ctx_kv, "dtype": ctx.dtype}


def row_losses(model: DFlashModel, logits: torch.Tensor, lab: torch.Tensor, batch: dict, src: torch.Tensor,
               soft_w: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss for draft rows with labels ``lab`` [N]: hard CE mixed ``soft_w`` with soft CE against the
    target's top-k distribution at flat data row ``src`` [N]. Returns (loss rows, hard CE rows)."""
    logp = torch.log_softmax(logits.float(), -1)
    dv = model.draft_vocab
    if dv is not None:
        col = torch.searchsorted(dv, lab).clamp(max=dv.numel() - 1)
        in_vocab = dv[col] == lab
    else:
        col, in_vocab = lab, torch.ones_like(lab, dtype=torch.bool)
    hard = -logp.gather(1, col.view(-1, 1)).squeeze(1) * in_vocab
    if soft_w <= 0 or "top_ids" not in batch:
        return hard, hard
    k = batch["top_ids"].shape[-1]
    tid = batch["top_ids"].reshape(-1, k)[src]
    tlp = batch["top_logp"].reshape(-1, k)[src].float()
    if dv is not None:
        tcol = torch.searchsorted(dv, tid).clamp(max=dv.numel() - 1)
        tin = dv[tcol] == tid
    else:
        tcol, tin = tid, torch.ones_like(tid, dtype=torch.bool)
    p = torch.softmax(tlp.masked_fill(~tin, float("-inf")), -1).nan_to_num(0.0)
    soft = -(p * logp.gather(1, tcol)).sum(-1)
    return (1 - soft_w) * hard + soft_w * soft, hard


def lm_head(target) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's LM head weight and bias in fp32 (frozen; draft logits go through it)."""
    lm = target.model.get_output_embeddings()
    return lm.weight.float(), None if getattr(lm, "bias", None) is None else lm.bias.float()


def training_loss(model: DFlashModel, target, batch: dict):
    """Weighted CE (w_k = exp(-(k-1)/gamma)) of block rows k = 1..B-1 against the target's tokens at anchor + k,
    mixed with soft-label CE against the target's top-k distribution there; metrics include the teacher-forced
    accepted length per block (leading correct rows) and tau_tf = 1 + that."""
    opts = model.train_opts
    blk = make_blocks(model, batch)
    valid, pos, seq_ok = blk["valid"], blk["pos"], blk["seq_ok"]
    b, n, B = pos.shape
    L = batch["ids"].shape[1]
    dev = pos.device
    mask = block_attention_mask(blk["anchors"], L, B, blk["dtype"])
    with torch.no_grad():
        emb = target.embed(blk["blk_ids"].view(b, -1)).float()
    hidden = model(emb, pos.view(b, -1), blk["ctx_kv"], mask).view(b, n, B, -1)[:, :, 1:]
    logits = model.logits(hidden[valid], *lm_head(target))
    lab = blk["labels"][valid]
    loss_rows, hard = row_losses(model, logits, lab, batch, blk["src"][valid], opts["soft_weight"])
    k = torch.arange(B, device=dev)
    w = torch.exp(-(k[1:].float() - 1) / opts["gamma"]).view(1, 1, -1).expand(b, n, -1)[valid]
    loss = (w * loss_rows).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():
        pred = model.to_vocab_ids(logits.argmax(-1))
        correct = torch.zeros((b, n, B - 1), dtype=torch.float32, device=dev)
        correct[valid] = (pred == lab).float()
        accept = correct.cumprod(-1).sum(-1)[seq_ok]  # leading correct rows per block
        metrics = {"loss": float(loss), "hard_ce": float((w * hard).sum() / w.sum()),
                   "acc": float((pred == lab).float().mean()) if lab.numel() else 0.0,
                   "acc_k1": float(correct[:, :, 0][valid[:, :, 0]].mean()) if bool(valid[:, :, 0].any()) else 0.0,
                   "accept_len": float(accept.mean()) if accept.numel() else 0.0,
                   "tau_tf": 1.0 + (float(accept.mean()) if accept.numel() else 0.0), "rows": int(lab.numel())}
    return loss, metrics
