"""EAGLE-3: a one-layer draft head over fused low/mid/high target features, EAGLE-2 dynamic trees, checkpoint IO
for the EAGLE/SpecForge and speculators layouts, and the training-time-test (TTT) loss.

Head, per draft position t (the "shift"): input = (target feature of position t, embedding of token t+1), output
predicts token t+2. ``fc`` fuses the 3 target features [low; mid; high] (no bias) and is skipped when the input
is the head's own pre-norm output (tree expansion, TTT steps > 0). The single decoder layer attends over
[input_layernorm(embedding); hidden_norm(feature)] (2*hidden wide) with the residual taken from the un-normed
feature (``norm_before_residual``: from the normed one). Logits come from the head's own ``lm_head`` over a reduced
draft vocabulary; ``target id = draft id + d2t[draft id]``. RoPE comes from the draft's config (10000 if absent).
Draft KV is kept only for the accepted prefix; tree-expansion KV is discarded every round.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from graft_block.drafter import Drafter, bundled_checkpoint, check_budget, read_weights, register
from graft_block.errors import ConfigError
from graft_block.tree import Tree, root_only
from graft_block.tree.eagle import (
    EAGLE_AUTO_SIZES,
    Candidates,
    expand,
    next_tree_mask,
    pick_auto_size,
    rerank,
)

# ---- config ------------------------------------------------------------------------------------------------


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

    @classmethod
    def from_dict(cls, d: dict) -> "Eagle3Config":
        """EAGLE/SpecForge config.json (LLaMA keys + draft_vocab_size) or a speculators config
        (``transformer_layer_config`` nested, eagle fields at the top)."""
        speculators = "transformer_layer_config" in d
        base = dict(d["transformer_layer_config"]) if speculators else dict(d)
        top = d
        for flag in ("fc_norm", "norm_output"):
            if top.get(flag):
                raise ConfigError(f"draft config sets {flag}=true, a speculators variant graft-block does not implement")
        aux = top.get("eagle_aux_hidden_state_layer_ids")
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
        scaling = base.get("rope_scaling")
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        return cls(
            hidden_size=int(base["hidden_size"]),
            intermediate_size=int(base["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(base.get("num_key_value_heads", heads)),
            vocab_size=int(vocab),
            draft_vocab_size=int(top.get("draft_vocab_size", base.get("draft_vocab_size", vocab))),
            head_dim=base.get("head_dim"),
            target_hidden_size=top.get("target_hidden_size", base.get("target_hidden_size")),
            rms_norm_eps=float(base.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=int(base.get("max_position_embeddings", 2048)),
            # vLLM defaults norm_before_residual to True for speculators configs.
            norm_before_residual=bool(top.get("norm_before_residual", speculators)),
            norm_before_fc=bool(top.get("norm_before_fc", False)),
            attention_bias=bool(base.get("attention_bias", base.get("bias", False))),
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


# ---- the head ----------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
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
    """x [B, h, T, hd]; cos/sin [B, T, hd]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


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
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

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
        self.__dict__["rotary"] = LlamaRotaryEmbedding(rope_cfg)

    # ---- pieces -----------------------------------------------------------------------------------------
    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """[.., 3*target_hidden] target features -> [.., hidden] (fc applies to target features only)."""
        if feats.shape[-1] != self.fc.in_features:
            raise ConfigError(f"EAGLE-3 fc expects {self.fc.in_features} feature channels (3 x target hidden), got "
                              f"{feats.shape[-1]}: check feature_layers / target_hidden_size")
        feats = feats.to(self.fc.weight.dtype)
        if self.cfg.norm_before_fc:
            feats = self.input_norm(feats)
        return self.fc(feats)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Pre-norm output -> draft-vocabulary logits."""
        return self.lm_head(self.norm(out))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def rope(self, ref: torch.Tensor, positions: torch.Tensor):
        if self.rotary.inv_freq.device != ref.device:
            self.rotary.to(ref.device)
        cos, sin = self.rotary(ref, positions)
        return cos.to(ref.dtype), sin.to(ref.dtype)

    def forward(self, emb, g, positions, past_k=None, past_v=None, mask=None):
        """One pass of the layer. emb/g [B, T, hidden], positions [B, T], past KV [B, kv, L, hd] (or None),
        mask additive [B|1, 1, T, L+T] (None = causal over the new part only when there is no past).
        Returns (pre-norm output [B, T, hidden], new k, new v)."""
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


# ---- checkpoint IO -----------------------------------------------------------------------------------------
LAYER_PREFIXES = ("midlayer.", "layers.0.", "model.layers.0.", "model.midlayer.")


def _normalise_keys(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """EAGLE/SpecForge (``midlayer.*``), speculators (``layers.0.*``) and ``model.``-prefixed exports -> EAGLE names."""
    out = {}
    extra_layers = sorted({k.split(".")[1] for k in sd if k.startswith("layers.") and not k.startswith("layers.0.")}
                          | {k.split(".")[2] for k in sd if k.startswith("model.layers.")
                             and not k.startswith("model.layers.0.")})
    if extra_layers:
        raise ConfigError(f"draft checkpoint has decoder layers {['0'] + extra_layers}; the EAGLE-3 head has "
                          "exactly one layer (multi-layer drafts are not supported)")
    for k, v in sd.items():
        name = k
        for p in LAYER_PREFIXES:
            if name.startswith(p):
                name = "midlayer." + name[len(p):]
                break
        else:
            if name.startswith("model.") and name[6:].split(".")[0] in ("fc", "norm", "embed_tokens", "lm_head",
                                                                        "input_norm"):
                name = name[6:]
        if name in out:
            raise ConfigError(f"draft checkpoint holds {k!r} twice under different layouts")
        out[name] = v
    return out


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """EAGLE tries pytorch_model.bin first, then safetensors; shards (``*.safetensors``) are merged."""
    bin_path = folder / "pytorch_model.bin"
    if bin_path.exists():
        return dict(torch.load(bin_path, map_location="cpu", weights_only=True))
    return read_weights(folder, "EAGLE3 checkpoint (no pytorch_model.bin either)")


def load_head(folder: str | Path, target=None, device=None, dtype=None) -> Eagle3Head:
    """Load an EAGLE-3 draft checkpoint folder strictly (config.json + weights) and check it against ``target``."""
    folder = Path(folder)
    if not (folder / "config.json").exists():
        raise ConfigError(f"EAGLE-3 checkpoint folder {folder} has no config.json")
    cfg = Eagle3Config.from_dict(json.loads((folder / "config.json").read_text()))
    sd = _normalise_keys(read_state_dict(folder))
    return head_from_state_dict(cfg, sd, target, device, dtype, source=str(folder))


def head_from_state_dict(cfg: Eagle3Config, sd: dict, target=None, device=None, dtype=None,
                         source: str = "checkpoint") -> Eagle3Head:
    with_emb = "embed_tokens.weight" in sd
    head = Eagle3Head(cfg, with_embedding=with_emb)
    expected = dict(head.state_dict())
    optional = set()
    if cfg.draft_vocab_size == cfg.vocab_size:
        optional |= {"d2t", "t2d"}  # identity mapping when the vocabularies coincide
    missing = [k for k in expected if k not in sd and k not in optional]
    unexpected = [k for k in sd if k not in expected]
    if missing or unexpected:
        raise ConfigError(
            f"{source} does not match the EAGLE-3 layout: missing {missing or 'none'}, unexpected "
            f"{unexpected or 'none'} (expected midlayer.*/layers.0.*, fc, norm, lm_head, d2t, t2d, optional "
            "embed_tokens)")
    for k, v in sd.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise ConfigError(f"{source}: tensor {k} has shape {tuple(v.shape)} but the config implies "
                              f"{tuple(expected[k].shape)}")
    full = {k: sd.get(k, expected[k]) for k in expected}
    if "d2t" in sd:
        full["d2t"] = sd["d2t"].long()
    if "t2d" in sd:
        full["t2d"] = sd["t2d"].bool()
    elif cfg.draft_vocab_size == cfg.vocab_size:
        full["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    head.load_state_dict(full, strict=True)
    check_vocab_map(head)
    if target is not None:
        check_against_target(head, target)
        device = target.device if device is None else device
        dtype = target.dtype if dtype is None else dtype
    if device is not None or dtype is not None:
        head.to(device=device, dtype=dtype)  # buffers keep their integer/bool dtypes
    return head.eval()


def check_vocab_map(head: Eagle3Head) -> None:
    cfg = head.cfg
    tid = torch.arange(cfg.draft_vocab_size) + head.d2t.cpu()
    if bool(((tid < 0) | (tid >= cfg.vocab_size)).any()):
        raise ConfigError(f"d2t maps draft ids outside the target vocabulary 0..{cfg.vocab_size - 1}: the d2t "
                          "tensor is corrupt or holds absolute ids instead of offsets")
    if tid.unique().numel() != tid.numel():
        raise ConfigError("d2t maps two draft ids to the same target id; the draft vocabulary must be injective")
    if int(head.t2d.sum()) != cfg.draft_vocab_size or not bool(head.t2d.cpu()[tid].all()):
        raise ConfigError(f"t2d marks {int(head.t2d.sum())} target ids but the draft vocabulary has "
                          f"{cfg.draft_vocab_size} (t2d must be True exactly at draft_id + d2t[draft_id])")


def check_against_target(head: Eagle3Head, target) -> None:
    cfg = head.cfg
    if cfg.target_hidden_size != target.hidden_size:
        raise ConfigError(f"drafter target_hidden_size {cfg.target_hidden_size} != target hidden_size "
                          f"{target.hidden_size}: this draft was trained for another target")
    if cfg.vocab_size != target.vocab_size:
        raise ConfigError(f"drafter vocab_size {cfg.vocab_size} != target vocab_size {target.vocab_size}: this "
                          "draft was trained for another tokenizer")
    if head.embed_tokens is None and cfg.hidden_size != target.hidden_size:
        raise ConfigError(f"the checkpoint has no embed_tokens and its hidden_size {cfg.hidden_size} != target "
                          f"hidden_size {target.hidden_size}: it cannot share the target's embedding")


def save_head(head: Eagle3Head, out_dir: str | Path, extra_config: dict | None = None,
              dtype=torch.float16, layout: str = "eagle") -> Path:
    """Write an EAGLE/SpecForge-layout (``layout="eagle"``) or speculators-layout checkpoint: model.safetensors
    (float tensors in ``dtype``; d2t int64, t2d bool) + config.json."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {}
    for k, v in head.state_dict().items():
        v = v.detach().cpu()
        if v.is_floating_point():
            v = v.to(dtype)
        if layout == "speculators" and k.startswith("midlayer."):
            k = "layers.0." + k[len("midlayer."):]
        sd[k] = v.contiguous()
    save_file(sd, str(out / "model.safetensors"))
    cfg = head.cfg.to_eagle_dict()
    if layout == "speculators":
        layer = {k: cfg[k] for k in ("model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                                     "num_key_value_heads", "head_dim", "num_hidden_layers", "rms_norm_eps",
                                     "hidden_act", "rope_theta", "max_position_embeddings", "vocab_size")}
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "transformer_layer_config": layer, "draft_vocab_size": head.cfg.draft_vocab_size,
               "target_hidden_size": head.cfg.target_hidden_size,
               "norm_before_residual": head.cfg.norm_before_residual}
        if head.cfg.aux_layer_ids is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = list(head.cfg.aux_layer_ids)
    cfg.update(extra_config or {})
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return out


# ---- draft vocabulary --------------------------------------------------------------------------------------
def build_draft_vocab(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE's rule: the ``size`` most frequent target ids (ties -> lower id), sorted ascending.
    Returns (d2t offsets int64 [size], t2d bool [V])."""
    V = counts.numel()
    size = min(int(size), V)
    order = torch.sort(-counts.double(), stable=True).indices[:size]
    used = order.sort().values
    d2t = used - torch.arange(size)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    return d2t.long(), t2d


# ---- TTT training ------------------------------------------------------------------------------------------
def ttt_forward(head: Eagle3Head, emb_fn, ids: torch.Tensor, feats: torch.Tensor, steps: int = 7, start: int = 0):
    """Training-time test, unrolled ``steps`` times. ids [B, T], feats [B, T, 3H] (row t = target feature of
    position t). Step k at index t: input (fused feature or the step-(k-1) output at t, embedding of token
    t+1+k), RoPE position t+k, predicts token t+2+k. Attention (EAGLE's cache_hidden trick): step-0 keys at
    indices <= t, plus for every step 1..k only the key at index t itself -- what a depth-(k+1) tree node sees.

    Only query indices t >= ``start`` are computed (step-0 keys still cover the whole prefix), so prompt rows
    that carry no loss cost only their k/v projections. Returns one pre-norm output [B, T - start, hidden] per
    step (rows whose input token lies past the sequence end are garbage and must be masked by the caller)."""
    B, T = ids.shape
    attn = head.midlayer.self_attn
    dev = feats.device
    W = T - start
    scale = 1.0 / math.sqrt(attn.head_dim)
    # query index start+i may see step-0 keys j <= start+i
    visible = torch.arange(T, device=dev).view(1, T) <= torch.arange(start, T, device=dev).view(W, 1)
    pos_all = torch.arange(T, device=dev).view(1, T).expand(B, T)
    g_all = head.fuse(feats)
    dtype = g_all.dtype
    # step-0 keys/values over the whole sequence (k/v projections only)
    emb0 = emb_fn(torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)).to(dtype)
    x0, res0 = head.midlayer.attn_input(emb0, g_all)
    cos, sin = head.rope(g_all, pos_all)
    q0, k0, v0 = attn.qkv(x0, cos, sin)
    keys0, vals0 = attn.expand_kv(k0), attn.expand_kv(v0)
    diag_k, diag_v, outs = [], [], []
    g = None
    for k in range(steps):
        if k == 0:
            q, residual = q0[:, :, start:], res0[:, start:]
        else:
            tok = torch.zeros((B, W), dtype=ids.dtype, device=dev)
            n_ok = max(0, min(W, T - 1 - k - start))  # index t reads token t+1+k
            if n_ok:
                tok[:, :n_ok] = ids[:, start + 1 + k: start + 1 + k + n_ok]
            x, residual = head.midlayer.attn_input(emb_fn(tok).to(dtype), g)
            cos, sin = head.rope(g, pos_all[:, start:] + k)
            q, kk, vv = attn.qkv(x, cos, sin)
            diag_k.append(attn.expand_kv(kk))
            diag_v.append(attn.expand_kv(vv))
        s0 = ((q @ keys0.transpose(-1, -2)) * scale).masked_fill(~visible, float("-inf"))  # [B, H, W, T]
        if k == 0:
            w = torch.softmax(s0.float(), dim=-1).to(dtype)
            a = w @ vals0
        else:
            sd = torch.stack([(q * dk).sum(-1) * scale for dk in diag_k], dim=-1)  # [B, H, W, k]
            w = torch.softmax(torch.cat([s0, sd], dim=-1).float(), dim=-1).to(dtype)
            a = w[..., :T] @ vals0 + sum(w[..., T + i: T + i + 1] * dv for i, dv in enumerate(diag_v))
        out = head.midlayer.finish(residual, a)
        outs.append(out)
        g = out
    return outs


def soft_labels(top_ids: torch.Tensor, top_logp: torch.Tensor, t2d: torch.Tensor, d2t: torch.Tensor):
    """Target top-k log-probs [.., k] -> (probabilities over the draft vocabulary [.., Vd] renormalised over the
    top-k ids inside it, bool mask 'target argmax is in the draft vocabulary')."""
    Vd = d2t.numel()
    t2d_index = torch.full((t2d.numel(),), -1, dtype=torch.long, device=top_ids.device)
    used = torch.arange(Vd, device=top_ids.device) + d2t.to(top_ids.device)
    t2d_index[used] = torch.arange(Vd, device=top_ids.device)
    did = t2d_index[top_ids.long()]
    inside = did >= 0
    p = top_logp.float().exp() * inside
    probs = torch.zeros(*top_ids.shape[:-1], Vd, device=top_ids.device)
    probs.scatter_add_(-1, did.clamp(min=0), p)
    probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-12)
    return probs, inside[..., 0]


def ttt_loss(head: Eagle3Head, emb_fn, ids, feats, top_ids, top_logp, loss_mask, steps: int = 7,
             decay: float = 0.8):
    """EAGLE-3 loss: soft cross-entropy against the target distribution restricted to the draft vocabulary, per
    TTT step k weighted 0.8^k. ``top_ids/top_logp`` [B, T, k]: row j = target distribution of token j+1;
    ``loss_mask`` [B, T] True where token j is a trained (response) token. Step k at index t predicts token
    t+2+k from row t+1+k; a row counts iff its token is trained and the target argmax is in the draft vocab.
    Logits are computed only on counted rows."""
    B, T = ids.shape
    lm = loss_mask.bool()
    first = int(lm.float().argmax(-1)[lm.any(-1)].min()) if bool(lm.any()) else T
    start = max(0, first - 1 - steps)  # earliest index any step trains on, less a margin
    outs = ttt_forward(head, emb_fn, ids, feats, steps, start)
    probs_all, inside = soft_labels(top_ids, top_logp, head.t2d, head.d2t)
    total = torch.zeros((), device=feats.device)
    metrics = {}
    for k, out in enumerate(outs):
        n = T - 2 - k - start  # window rows whose token t+2+k lies inside the sequence
        if n <= 0:
            break
        rows = slice(start + 1 + k, start + 1 + k + n)
        m = lm[:, start + 2 + k: start + 2 + k + n] & inside[:, rows]
        cnt = int(m.sum())
        if k == 0:
            metrics["rows"] = float(cnt)
        if cnt == 0:
            continue
        p = probs_all[:, rows][m]
        logq = torch.log_softmax(head.logits(out[:, :n][m]).float(), dim=-1)
        lk = -(p * logq).sum(-1).mean()
        total = total + (decay ** k) * lk
        metrics[f"loss_{k}"] = float(lk.detach())
        metrics[f"acc_{k}"] = float((logq.argmax(-1) == p.argmax(-1)).float().mean())
    metrics["loss"] = float(total.detach())
    return total, metrics


# ---- warm start --------------------------------------------------------------------------------------------
def head_config_for(target, draft_vocab_size: int, feature_layers: Sequence[int] | None = None) -> Eagle3Config:
    """A draft head shaped like one of the target's layers (same width, heads, MLP, RoPE)."""
    tc = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    heads = int(tc.num_attention_heads)
    rope = getattr(tc, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))
    layers = list(feature_layers) if feature_layers is not None else list(default_feature_layers(target.num_layers))
    return Eagle3Config(
        hidden_size=target.hidden_size, intermediate_size=int(tc.intermediate_size), num_attention_heads=heads,
        num_key_value_heads=int(getattr(tc, "num_key_value_heads", heads) or heads),
        head_dim=int(getattr(tc, "head_dim", None) or target.hidden_size // heads), vocab_size=target.vocab_size,
        draft_vocab_size=int(draft_vocab_size), target_hidden_size=target.hidden_size,
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-5)), rope_theta=float(theta),
        max_position_embeddings=int(getattr(tc, "max_position_embeddings", 2048)),
        aux_layer_ids=[i - 1 for i in layers],
    )


@torch.no_grad()
def warm_start(head: Eagle3Head, target, layer: int | None = None, seed: int = 0,
               parts: Sequence[str] = ("layer", "fc", "lm_head"), lm_head_scale: float = 1.0) -> None:
    """Initialise from the target: ``layer``: the decoder layer from target layer ``layer`` (default N-3; hidden
    half of q/k/v = its weights, embedding half small random); ``fc``: pass the high feature through;
    ``lm_head``: final norm and lm_head rows from the target's norm and LM head for the draft vocabulary."""
    base = target.model.get_decoder() if hasattr(target.model, "get_decoder") else target.model.model
    L = base.layers[target.num_layers - 3 if layer is None else layer]
    d = head.cfg.hidden_size
    gen = torch.Generator().manual_seed(seed)
    mid = head.midlayer
    if d != target.hidden_size:
        raise ConfigError("warm start needs a draft as wide as the target")
    unknown = set(parts) - {"layer", "fc", "lm_head"}
    if unknown:
        raise ConfigError(f"unknown warm-start parts {sorted(unknown)}; choose from layer, fc, lm_head")
    if "lm_head" in parts:
        head.norm.weight.copy_(base.norm.weight)
        used = torch.arange(head.cfg.draft_vocab_size) + head.d2t.cpu()
        rows = target.model.get_output_embeddings().weight[used.to(target.device)]
        head.lm_head.weight.copy_(rows * lm_head_scale)  # < 1 softens the target's confident logits
    if "fc" in parts:
        H = target.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * H: 3 * H] = torch.eye(H, dtype=head.fc.weight.dtype)
    if "layer" not in parts:
        return
    for name in ("q_proj", "k_proj", "v_proj"):
        src = getattr(L.self_attn, name).weight
        dst = getattr(mid.self_attn, name).weight
        noise = torch.randn(dst.shape[0], d, generator=gen) * (src.float().std() * 0.5)
        dst[:, :d] = noise.to(dst.dtype)
        dst[:, d:] = src.to(dst.dtype)
    mid.self_attn.o_proj.weight.copy_(L.self_attn.o_proj.weight)
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(mid.mlp, name).weight.copy_(getattr(L.mlp, name).weight)
    mid.hidden_norm.weight.copy_(L.input_layernorm.weight)
    mid.input_layernorm.weight.copy_(base.layers[0].input_layernorm.weight)
    mid.post_attention_layernorm.weight.copy_(L.post_attention_layernorm.weight)


# ---- the drafter -------------------------------------------------------------------------------------------
DRAFTER_KEYS = ("checkpoint", "budget", "depth", "top_k", "feature_layers", "auto_sizes")


@register("eagle3")
class Eagle3Drafter(Drafter):
    """EAGLE-3 head + EAGLE-2 dynamic tree. ``budget`` = total_tokens - 1 non-root nodes (or ``"auto"``),
    ``depth`` = expansion forwards after the root step (trees reach depth ``depth + 1``), ``top_k`` per node."""

    def __init__(self, target, checkpoint: str | Path | None = None, budget: int | str = 59, depth: int = 7,
                 top_k: int = 10, feature_layers: Sequence[int] | None = None, head: Eagle3Head | None = None,
                 auto_sizes: Sequence[int] = EAGLE_AUTO_SIZES):
        if target is None:
            raise ConfigError("the eagle3 drafter needs the target (its features and embedding): "
                              "Drafter.from_config(cfg, target=target)")
        if head is None:
            if checkpoint is None:
                raise ConfigError("eagle3 needs a checkpoint (folder or bundled short name, e.g. 'eagle3-smollm2')")
            head = load_head(resolve_checkpoint(checkpoint), target)
        else:
            check_against_target(head, target)
            head = head.to(device=target.device, dtype=target.dtype).eval()
        for p in head.parameters():
            p.requires_grad_(False)
        self.target, self.head = target, head
        self.checkpoint = None if checkpoint is None else str(checkpoint)
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ConfigError(f"depth must be an int >= 0 (expansion steps after the root step), got {depth!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ConfigError(f"top_k must be an int >= 1, got {top_k!r}")
        self.depth, self.top_k = depth, top_k
        self.auto = budget == "auto" or budget == -1
        self.auto_sizes = tuple(int(s) for s in auto_sizes)
        self.budget = max(self.auto_sizes) - 1 if self.auto else check_budget(budget)
        if feature_layers is None:
            ids = head.cfg.aux_layer_ids
            feature_layers = [i + 1 for i in ids] if ids is not None else default_feature_layers(target.num_layers)
        self.feature_layers = tuple(int(i) for i in feature_layers)
        if len(self.feature_layers) != 3:
            raise ConfigError(f"EAGLE-3 fuses exactly 3 target layers, got feature_layers={self.feature_layers}")
        for i in self.feature_layers:
            if not 0 <= i <= target.num_layers:
                raise ConfigError(f"feature layer {i} is outside 0..{target.num_layers} (HF hidden_states indices)")
        self.last_candidates: Candidates | None = None
        # Optional early stop of the expansion (Graft's pruning checkpoints): stop_fn(level, frontier_scores).
        self.stop_fn = None
        self._reset()

    @classmethod
    def build(cls, cfg: dict, target=None) -> "Eagle3Drafter":
        cfg = dict(cfg)
        ckpt = cfg.get("checkpoint")
        folder = resolve_checkpoint(ckpt) if ckpt is not None else None
        # A checkpoint's config.json may carry drafter defaults; explicit keys win.
        kwargs = {}
        if folder is not None:
            saved = json.loads((folder / "config.json").read_text())
            kwargs.update(saved.get("drafter_defaults", {}))
        unknown = [k for k in cfg if k not in DRAFTER_KEYS and k not in _MODEL_CONFIG_KEYS]
        if unknown:
            raise ConfigError(f"unknown eagle3 config keys {unknown}; known: {', '.join(DRAFTER_KEYS)}")
        kwargs.update({k: v for k, v in cfg.items() if k in DRAFTER_KEYS})
        if folder is not None:
            kwargs["checkpoint"] = folder
        return cls(target=target, **kwargs)

    def describe(self) -> dict:
        return {"type": self.type_name, "budget": self.budget, "depth": self.depth, "top_k": self.top_k,
                "feature_layers": list(self.feature_layers), "checkpoint": self.checkpoint,
                "draft_vocab_size": self.head.cfg.draft_vocab_size, "auto": self.auto}

    # ---- caches ---------------------------------------------------------------------------------------------
    def _reset(self):
        self.k_cache = self.v_cache = None  # draft KV of the accepted prefix: [1, kv, n_pairs, hd]
        self.n_pairs = 0
        self.pending: list[tuple[torch.Tensor, int]] = []
        self.root_out = None  # pre-norm output of the last accepted pair (its row predicts the root's children)

    def prefill(self, state) -> None:
        self._reset()
        if self.auto and state.round == 0 and not getattr(self, "_tuned", False):
            self.budget = self.tune_budget()
            self._tuned = True
        self.pending.append((state.new_features, state.new_features_start))

    def commit(self, state, verified) -> None:
        self.pending.append((state.new_features, state.new_features_start))

    @torch.inference_mode()
    def _consume(self, state) -> None:
        """Run the head over the pairs (feature t, token t+1) that entered the target since the last round."""
        for feats, start in self.pending:
            if feats is None:
                raise ConfigError("eagle3 got no target features: the decoder must capture drafter.feature_layers")
            if start != self.n_pairs:
                raise ConfigError(f"eagle3 draft cache holds {self.n_pairs} positions but new features start at "
                                  f"{start}: prefill/commit were not called in order")
            m = feats.shape[0]
            toks = torch.tensor(state.tokens[start + 1: start + 1 + m], device=self.target.device)
            if toks.numel() != m:
                raise ConfigError("eagle3: fewer committed tokens than features (token/feature shift broken)")
            emb = self.embed(toks).view(1, m, -1)
            g = self.head.fuse(feats.view(1, m, -1))
            pos = torch.arange(start, start + m, device=g.device).view(1, m)
            mask = None if self.k_cache is None else prefix_mask(m, self.n_pairs, g.dtype, g.device)
            out, k, v = self.head(emb, g, pos, self.k_cache, self.v_cache, mask)
            self.k_cache = k if self.k_cache is None else torch.cat([self.k_cache, k], dim=2)
            self.v_cache = v if self.v_cache is None else torch.cat([self.v_cache, v], dim=2)
            self.n_pairs += m
            self.root_out = out[0, -1]
        self.pending = []

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.embed_tokens(ids) if self.head.embed_tokens is not None else self.target.embed(ids)

    # ---- proposing ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, state) -> Tree:
        self._consume(state)
        if self.root_out is None:
            return root_only(state.root_token)
        head, dev = self.head, self.root_out.device
        root_lp = torch.log_softmax(head.logits(self.root_out).float(), dim=-1)
        n = self.n_pairs
        tree_k, tree_v = [], []  # KV of every drafted frontier node this round (discarded afterwards)
        level_out = [self.root_out.view(1, -1)]
        tree_mask = [torch.zeros(1, 0, dtype=torch.bool, device=dev)]

        def child_fn(level: int, tokens: torch.Tensor, parent_slot: torch.Tensor) -> torch.Tensor:
            f = tokens.numel()
            parent_slot = parent_slot.to(dev)
            g = level_out[-1][parent_slot].view(1, f, -1)
            emb = self.embed(tokens.to(dev)).view(1, f, -1).to(g.dtype)
            pos = torch.full((1, f), n - 1 + level, device=dev, dtype=torch.long)
            tmask = next_tree_mask(tree_mask[-1], parent_slot)  # [f, drafted + f]
            mask = torch.full((f, n + tmask.shape[1]), torch.finfo(g.dtype).min, dtype=g.dtype, device=dev)
            mask[:, :n] = 0
            mask[:, n:].masked_fill_(tmask, 0)
            pk = torch.cat([self.k_cache] + tree_k, dim=2)
            pv = torch.cat([self.v_cache] + tree_v, dim=2)
            out, k, v = head(emb, g, pos, pk, pv, mask.view(1, 1, f, -1))
            tree_k.append(k)
            tree_v.append(v)
            tree_mask.append(tmask)
            level_out.append(out[0])
            return torch.log_softmax(head.logits(out[0]).float(), dim=-1)

        d2t = None if head.cfg.draft_vocab_size == head.cfg.vocab_size and not bool(head.d2t.any()) else head.d2t
        cands = expand(root_lp, child_fn, self.depth, self.top_k, d2t, self.stop_fn)
        with state.section("tree"):
            tree = rerank(cands, state.root_token, self.budget)
        self.last_candidates = cands
        return tree

    # ---- auto budget ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def tune_budget(self, repeats: int = 3) -> int:
        """EAGLE's total_token=-1: time a target verify of each size in ``auto_sizes`` on the current cache (a
        chain of random tokens; the cache is restored) and pick argmin time / expected-acceptance weight."""
        from graft_block.tree import chain

        target = self.target
        if target.cache is None or target.cache_len == 0:
            raise ConfigError("auto budget tuning needs a prefilled target cache")
        gen = torch.Generator().manual_seed(0)
        times = {}
        for size in self.auto_sizes:
            toks = torch.randint(0, target.vocab_size, (size,), generator=gen)
            tree = chain(int(toks[0]), toks[1:])
            samples = []
            for _ in range(repeats + 1):
                if target.device.type == "cuda":
                    torch.cuda.synchronize(target.device)
                t0 = time.perf_counter()
                target.verify(tree)
                if target.device.type == "cuda":
                    torch.cuda.synchronize(target.device)
                samples.append(time.perf_counter() - t0)
                target.compact(tree.size, torch.zeros(0, dtype=torch.long))
            times[size] = sorted(samples[1:])[len(samples[1:]) // 2]
        self.auto_times = times
        return pick_auto_size(times) - 1

    # ---- training protocol ----------------------------------------------------------------------------------
    @classmethod
    def training_model(cls, target, cfg: dict, init: str | None = None) -> nn.Module:
        """A trainable head for ``target`` (plugs into graft_block.training.train).

        cfg: ``draft_vocab`` (sorted target ids, set by the shared loop's --draft-vocab) or ``token_counts``
        (tensor [V] / path) or ``data`` (cached data name: response-token counts) with ``draft_vocab_size``
        (default 4096); ``feature_layers`` (default [2, N//2, N-3]); ``ttt_steps`` (7); ``warm_layer``.
        ``init``: "target" (default: warm start from the target), "random", or a checkpoint folder to continue."""
        if init not in (None, "target", "random"):
            head = load_head(resolve_checkpoint(init), target)
        else:
            if cfg.get("draft_vocab") is not None:
                used = torch.as_tensor(cfg["draft_vocab"], dtype=torch.long)
                counts = torch.zeros(target.vocab_size)
                counts[used] = 1.0
                size = used.numel()
            else:
                size = int(cfg.get("draft_vocab_size", 4096))
                counts = cfg.get("token_counts")
                if counts is None:
                    counts = response_token_counts(cfg.get("data"), target.vocab_size, int(cfg.get("holdout", 24)))
                elif not isinstance(counts, torch.Tensor):
                    counts = torch.load(counts)
            hcfg = head_config_for(target, size, cfg.get("feature_layers"))
            head = Eagle3Head(hcfg)
            d2t, t2d = build_draft_vocab(counts, hcfg.draft_vocab_size)
            head.d2t.copy_(d2t)
            head.t2d.copy_(t2d)
            # default from a probe on SmolLM2: copying a target layer or the full-scale LM head made early training
            # slower than random init; LM-head rows at 0.2 scale keep token semantics without overconfidence.
            parts = cfg.get("warm_start", ("lm_head",))
            if init != "random" and parts:
                parts = [parts] if isinstance(parts, str) else list(parts)
                warm_start(head, target, cfg.get("warm_layer"), seed=int(cfg.get("seed", 0)), parts=parts,
                           lm_head_scale=float(cfg.get("lm_head_scale", 0.2)))
        ids = head.cfg.aux_layer_ids
        head.feature_layers = [i + 1 for i in ids] if ids is not None else list(default_feature_layers(target.num_layers))
        head.ttt_steps = int(cfg.get("ttt_steps", 7))
        head = head.to(target.device).float().train()
        for p in head.parameters():
            p.requires_grad_(True)
        return head

    @classmethod
    def training_loss(cls, model, target, batch: dict):
        """Batch (graft_block.training.collate): ids [B, T], feats [B, T, 3H] (the drafter's feature_layers),
        top_ids/top_logp [B, T, k] (row j = target distribution of token j+1), and ``loss_mask`` [B, T] or
        ``prompt_len``/``lengths`` [B] (trained tokens = the response: prompt_len <= j < length)."""
        dev = model.fc.weight.device
        ids = batch["ids"].to(dev).long()
        feats = batch["feats"].to(dev)
        if "loss_mask" in batch:
            mask = batch["loss_mask"].to(dev).bool()
        else:
            j = torch.arange(ids.shape[1], device=dev).view(1, -1)
            mask = (j >= batch["prompt_len"].to(dev).view(-1, 1)) & (j < batch["lengths"].to(dev).view(-1, 1))
        emb_fn = model.embed_tokens if model.embed_tokens is not None else target.embed
        loss, metrics = ttt_loss(model, lambda t: emb_fn(t).detach(), ids, feats, batch["top_ids"].to(dev),
                                 batch["top_logp"].to(dev), mask, steps=int(getattr(model, "ttt_steps", 7)))
        return loss, metrics

    @classmethod
    def save_trained(cls, model, out_dir, cfg: dict) -> None:
        defaults = {k: cfg[k] for k in ("budget", "depth", "top_k") if k in cfg}
        extra = {"type": "eagle3", "drafter_defaults": defaults or {"budget": 15, "depth": 5, "top_k": 8}}
        save_head(model, out_dir, extra)


# Model-config keys a checkpoint's config.json may carry next to "type" (ignored by build; the loader reads them).
_MODEL_CONFIG_KEYS = {
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "num_hidden_layers", "rms_norm_eps", "hidden_act", "rope_theta", "rope_scaling",
    "max_position_embeddings", "vocab_size", "draft_vocab_size", "target_hidden_size", "norm_before_residual",
    "norm_before_fc", "attention_bias", "bias", "tie_word_embeddings", "torch_dtype", "eagle_config",
    "drafter_defaults", "pad_token_id", "bos_token_id", "eos_token_id", "transformer_layer_config",
    "speculators_model_type", "eagle_aux_hidden_state_layer_ids", "speculators_config", "training",
}


def resolve_checkpoint(ckpt: str | Path) -> Path:
    """A folder path, or the short name of a bundled checkpoint under drafters/checkpoints/."""
    path = Path(ckpt)
    if (path / "config.json").exists():
        return path
    if isinstance(ckpt, str) and "/" not in ckpt:
        found = bundled_checkpoint(ckpt)
        if found is not None:
            return found
    raise ConfigError(f"eagle3 checkpoint {ckpt!r} is neither a folder with config.json nor a bundled name under "
                      "drafters/checkpoints/")


def response_token_counts(data: Any, vocab_size: int, skip: int = 0) -> torch.Tensor:
    """Token frequencies over the trained (response) tokens of cached training data (graft_block.training; a name,
    a folder, or a comma-separated list), skipping the first ``skip`` sequences in load order (the shared loop's
    held-out set)."""
    from graft_block.training import data_root

    if data is None:
        raise ConfigError("eagle3 training needs cfg['data'] (cached data name/folder) or cfg['token_counts'] to "
                          "build the draft vocabulary")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    seen = 0
    for part in str(data).split(","):
        folder = Path(part.strip())
        if not folder.exists():
            folder = data_root() / part.strip()
        meta = json.loads((folder / "meta.json").read_text())
        for shard in sorted(meta["shards"], key=lambda s: s["batch"]):
            for rec in torch.load(folder / shard["file"], weights_only=False):
                seen += 1
                if seen <= skip:
                    continue
                resp = rec["ids"][rec["prompt_len"]:].long()
                counts += torch.bincount(resp, minlength=vocab_size)[:vocab_size]
    return counts
