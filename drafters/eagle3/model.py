"""The EAGLE-3 draft head: config, one decoder layer over [embedding; fused feature], final norm and lm_head.

Per draft position t (the "shift"): input = (target feature of position t, embedding of token t+1), output
predicts token t+2. ``fc`` fuses the 3 target features [low; mid; high] (no bias) and is skipped when the input
is the head's own pre-norm output (tree expansion, TTT steps > 0). The single decoder layer attends over
[input_layernorm(embedding); hidden_norm(feature)] (2*hidden wide) with the residual taken from the un-normed
feature (``norm_before_residual``: from the normed one). Logits come from the head's own ``lm_head`` over a reduced
draft vocabulary; ``target id = draft id + d2t[draft id]``. RoPE comes from the draft's config (10000 if absent).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from graft_block.drafters.layers import RMSNorm, Rotary, apply_rope, check_not_released
from graft_block.errors import ConfigError


@dataclass
class Eagle3Config:
    """The draft head's shape. ``vocab_size`` is the target vocabulary (length of t2d)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int
    head_dim: int | None = None
    target_hidden_size: int | None = None  # None = hidden_size
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    aux_layer_ids: list[int] | None = None  # SpecForge ids (output of layer i) = HF hidden_states index i + 1

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.hidden_act != "silu":
            raise ConfigError(f"EAGLE-3 head supports hidden_act 'silu' only, got {self.hidden_act!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                              f"num_key_value_heads {self.num_key_value_heads}")
        if self.hidden_size % self.num_attention_heads:  # else transformers' LlamaConfig refuses it, deep inside
            raise ConfigError(f"hidden_size {self.hidden_size} must be a multiple of num_attention_heads "
                              f"{self.num_attention_heads}: this EAGLE-3 config is inconsistent")

    @classmethod
    def from_dict(cls, d: dict) -> "Eagle3Config":
        """EAGLE/SpecForge config.json (LLaMA keys + draft_vocab_size) or a speculators config
        (``transformer_layer_config`` nested, eagle fields at the top).

        ``bias`` is read and ignored, as EAGLE does: its loader passes ``bias`` (default true) to the head
        constructor, where only the EAGLE-1/2 head uses it (for fc); the EAGLE-3 head and SpecForge's build no
        bias at all. Only ``attention_bias`` adds q/k/v biases."""
        speculators = "transformer_layer_config" in d
        base = dict(d["transformer_layer_config"]) if speculators else dict(d)
        top = d
        for flag in ("fc_norm", "norm_output"):
            if top.get(flag):
                raise ConfigError(f"draft config sets {flag}=true, "
                                  "a speculators variant graft-block does not implement")
        aux = top.get("eagle_aux_hidden_state_layer_ids")
        if aux is not None and speculators:  # vLLM's capture ids: the input of layer i (HF hidden_states[i])
            aux = [int(i) - 1 for i in aux]
        if aux is None and isinstance(top.get("eagle_config"), dict):
            aux = top["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
        vocab = base.get("vocab_size", top.get("vocab_size"))
        missing = [k for k, v in (("hidden_size", base.get("hidden_size")), ("vocab_size", vocab)) if v is None]
        if missing:
            raise ConfigError(f"draft config lacks {', '.join(missing)}; is this an EAGLE-3 config.json?")
        heads = int(base.get("num_attention_heads", 1))
        rope_theta = base.get("rope_theta")
        if rope_theta is None and isinstance(base.get("rope_parameters"), dict):
            rope_theta = base["rope_parameters"].get("rope_theta")
        scaling = base.get("rope_scaling") or base.get("rope_parameters")  # transformers 5 spells it the latter
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        if scaling is not None:
            scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}  # rope_theta is a field of its own
        return cls(
            hidden_size=int(base["hidden_size"]),
            intermediate_size=int(base["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(base.get("num_key_value_heads", heads)),
            vocab_size=int(vocab),
            draft_vocab_size=int(top.get("draft_vocab_size", base.get("draft_vocab_size", vocab))),
            head_dim=base.get("head_dim"),
            target_hidden_size=top.get("target_hidden_size", base.get("target_hidden_size")),
            # EAGLE's EConfig and SpecForge's / speculators' LlamaConfig all default to 1e-6
            rms_norm_eps=float(base.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=int(base.get("max_position_embeddings", 2048)),
            # vLLM defaults norm_before_residual to True for speculators configs.
            norm_before_residual=bool(top.get("norm_before_residual", speculators)),
            norm_before_fc=bool(top.get("norm_before_fc", False)),
            attention_bias=bool(base.get("attention_bias", False)),
            hidden_act=str(base.get("hidden_act", "silu")),
            aux_layer_ids=list(aux) if aux is not None else None,
        )

    def to_eagle_dict(self) -> dict:
        """EAGLE/SpecForge-style config.json keys."""
        d = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": self.hidden_act,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "norm_before_residual": self.norm_before_residual,
            "tie_word_embeddings": False,
            "torch_dtype": "float16",
        }
        if self.rope_scaling:
            d["rope_scaling"] = self.rope_scaling
        if self.norm_before_fc:
            d["norm_before_fc"] = True
        if self.attention_bias:
            d["attention_bias"] = True
        if self.aux_layer_ids is not None:
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)}
        return d


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """Inputs of target layers 2, N//2, N-3 = HF hidden_states indices [2, N//2, N-3]."""
    return (2, num_layers // 2, num_layers - 3)


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        d2, hd = 2 * cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(d2, self.n_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d2, self.n_kv * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d2, self.n_kv * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, cfg.hidden_size, bias=False)

    def qkv(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        rep = self.n_heads // self.n_kv
        return t if rep == 1 else t.repeat_interleave(rep, dim=1)


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """``midlayer``: names match the EAGLE/SpecForge checkpoint keys."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)
        self.norm_before_residual = cfg.norm_before_residual

    def attn_input(self, emb, g):
        """(2d attention input, residual)."""
        gn = self.hidden_norm(g)
        x = torch.cat([self.input_layernorm(emb), gn], dim=-1)  # embedding first
        return x, (gn if self.norm_before_residual else g)

    def finish(self, residual, attn):
        """Attention output [B, H, T, hd] -> the layer's pre-norm output."""
        B, _, T, _ = attn.shape
        h = residual + self.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """fc + midlayer + norm + lm_head (+ d2t/t2d buffers, + optional own embedding)."""

    def __init__(self, cfg: Eagle3Config, with_embedding: bool = False):
        super().__init__()
        from transformers import LlamaConfig

        self.cfg = cfg
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(3 * cfg.target_hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool) if cfg.draft_vocab_size ==
                             cfg.vocab_size else torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if with_embedding else None
        # RoPE from the draft's own config (LLaMA semantics, incl. rope_scaling types HF knows).
        rope_cfg = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                               head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling,
                               max_position_embeddings=cfg.max_position_embeddings)
        # Not a registered submodule: module.to(dtype) must not round inv_freq to half precision.
        self.__dict__["rotary"] = Rotary(rope_cfg)

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """[.., 3*target_hidden] target features -> [.., hidden] (fc applies to target features only)."""
        check_not_released(self)
        if feats.shape[-1] != self.fc.in_features:
            raise ConfigError(f"EAGLE-3 fc expects {self.fc.in_features} feature channels (3 x target hidden), got "
                              f"{feats.shape[-1]}: check feature_layers / target_hidden_size")
        feats = feats.to(self.fc.weight.dtype)
        if self.cfg.norm_before_fc:
            feats = self.input_norm(feats)
        return self.fc(feats)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Pre-norm output -> draft-vocabulary logits."""
        check_not_released(self)
        return self.lm_head(self.norm(out))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def rope(self, ref: torch.Tensor, positions: torch.Tensor):
        return self.rotary(ref, positions)

    def forward(self, emb, g, positions, past_k=None, past_v=None, mask=None):
        """One pass of the layer. emb/g [B, T, hidden], positions [B, T], past KV [B, kv, L, hd] (or None),
        mask additive [B|1, 1, T, L+T] (None = causal over the new part only when there is no past).
        Returns (pre-norm output [B, T, hidden], new k, new v)."""
        check_not_released(self)
        attn_mod = self.midlayer.self_attn
        x, residual = self.midlayer.attn_input(emb, g)
        cos, sin = self.rope(g, positions)
        q, k, v = attn_mod.qkv(x, cos, sin)
        K = k if past_k is None else torch.cat([past_k, k], dim=2)
        V = v if past_v is None else torch.cat([past_v, v], dim=2)
        causal = mask is None and past_k is None and q.shape[2] > 1
        a = F.scaled_dot_product_attention(q, attn_mod.expand_kv(K), attn_mod.expand_kv(V), attn_mask=mask,
                                           is_causal=causal)
        return self.midlayer.finish(residual, a), k, v


def prefix_mask(n_new: int, n_past: int, dtype, device) -> torch.Tensor:
    """Additive [1, 1, n_new, n_past + n_new]: the whole past plus causal over the new block."""
    m = torch.full((n_new, n_past + n_new), torch.finfo(dtype).min, dtype=dtype, device=device)
    m[:, :n_past] = 0
    m[:, n_past:] = m[:, n_past:].triu(1)
    return m.view(1, 1, n_new, n_past + n_new)
