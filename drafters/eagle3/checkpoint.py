"""EAGLE-3 checkpoint IO: the EAGLE/SpecForge (``midlayer.*``) and vLLM speculators (``layers.0.*``) layouts,
strict loading against the target, saving, the reduced draft vocabulary and recognising hub config.json files."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch

from graft_block.drafter import offset_vocab_ids, read_config_json, read_weights, vocab_maps
from graft_block.errors import ConfigError

from .model import Eagle3Config, Eagle3Head

LAYER_PREFIXES = ("midlayer.", "layers.0.", "model.layers.0.", "model.midlayer.")

# Model-config keys a checkpoint's config.json may carry next to "type" (ignored by build; the loader reads them).
MODEL_CONFIG_KEYS = {
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "num_hidden_layers", "rms_norm_eps", "hidden_act", "rope_theta", "rope_scaling",
    "max_position_embeddings", "vocab_size", "draft_vocab_size", "target_hidden_size", "norm_before_residual",
    "norm_before_fc", "attention_bias", "bias", "tie_word_embeddings", "torch_dtype", "eagle_config",
    "drafter_defaults", "pad_token_id", "bos_token_id", "eos_token_id", "transformer_layer_config",
    "speculators_model_type", "eagle_aux_hidden_state_layer_ids", "speculators_config", "training",
}

# Markers of the other block drafters' configs (z-lab DFlash, this project's MFD): never an EAGLE-3 head.
_FOREIGN_KEYS = ("dflash_config", "block_size", "mfd_config")


def is_eagle3_config(cfg: dict) -> bool:
    """Whether an untouched hub config.json describes an EAGLE-3 head: a speculators config with
    ``speculators_model_type: "eagle3"``, an ``*Eagle3*`` architecture (SpecForge ``LlamaForCausalLMEagle3``,
    speculators ``Eagle3Speculator``), or EAGLE's training template (a plain ``*ForCausalLM`` architecture such
    as ``LlamaForCausalLM`` plus the EAGLE-3-only ``draft_vocab_size``)."""
    if "speculators_model_type" in cfg:
        return cfg["speculators_model_type"] == "eagle3"  # speculators also ships "eagle" (EAGLE-1) and "dflash"
    archs = cfg.get("architectures") or []
    archs = [str(a).lower() for a in (archs if isinstance(archs, list) else [archs])]
    if any("dflash" in a for a in archs) or any(k in cfg for k in _FOREIGN_KEYS):
        return False
    if any("eagle3" in a for a in archs):
        return True
    return "draft_vocab_size" in cfg and all(a.endswith("forcausallm") for a in archs)


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
        try:
            sd = torch.load(bin_path, map_location="cpu", weights_only=True)
        except (RuntimeError, pickle.UnpicklingError, EOFError, OSError, ValueError, AttributeError) as e:
            raise ConfigError(f"EAGLE-3 weights file {bin_path} is corrupt, truncated or not a plain state dict "
                              f"({type(e).__name__}: {str(e)[:200]}); re-download it (or save it as "
                              "model.safetensors)") from e
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise ConfigError(f"EAGLE-3 weights file {bin_path} holds a {type(sd).__name__}, not a dict of tensors "
                              "(a state dict); re-download it or save the head's state_dict()")
        return dict(sd)
    return read_weights(folder, "EAGLE3 checkpoint (no pytorch_model.bin either)")


def load_head(folder: str | Path, target=None, device=None, dtype=None) -> Eagle3Head:
    """Load an EAGLE-3 draft checkpoint folder strictly (config.json + weights) and check it against ``target``."""
    folder = Path(folder)
    cfg = Eagle3Config.from_dict(read_config_json(folder, "EAGLE-3 checkpoint"))
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
    offset_vocab_ids(head.d2t, head.t2d, head.cfg.vocab_size)


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

    if layout == "speculators" and head.cfg.attention_bias:
        raise ConfigError("attention_bias=true (q/k/v biases, no o_proj bias) has no speculators layout: save it "
                          "with layout='eagle'")
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
        if head.cfg.rope_scaling:  # else the head loads back with unscaled RoPE
            scaling = {k: v for k, v in head.cfg.rope_scaling.items() if k != "rope_theta"}
            layer.update(rope_scaling=scaling, rope_parameters={**scaling, "rope_theta": head.cfg.rope_theta})
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "transformer_layer_config": layer, "draft_vocab_size": head.cfg.draft_vocab_size,
               "target_hidden_size": head.cfg.target_hidden_size,
               "norm_before_residual": head.cfg.norm_before_residual, "norm_before_fc": head.cfg.norm_before_fc}
        if head.cfg.aux_layer_ids is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in head.cfg.aux_layer_ids]  # vLLM's ids
    cfg.update(extra_config or {})
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return out


def build_draft_vocab(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE's rule: the ``size`` most frequent target ids (ties -> lower id), sorted ascending.
    Returns (d2t offsets int64 [size], t2d bool [V])."""
    V = counts.numel()
    size = min(int(size), V)
    order = torch.sort(-counts.double(), stable=True).indices[:size]
    return vocab_maps(order.sort().values, V)

