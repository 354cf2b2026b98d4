"""DFlash checkpoints in z-lab's format: ``config.json`` (Qwen3 shape keys, ``block_size``, ``num_target_layers``,
``dflash_config: {mask_token_id, target_layer_ids}``) and ``model.safetensors`` without embeddings or LM head.

Defaults for keys a z-lab config may omit are the reference's (its ``Qwen3Config`` under transformers 4.57.1), so a
config loads into the model the reference builds from it: ``rope_theta`` 1e4, ``attention_bias`` false.
"""
from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

import torch
from torch import nn
from transformers import Qwen3Config

from graft_block.drafter import (checkpoint_type, is_count, offset_vocab_ids, read_config_json, read_weights,
                                 resolve_checkpoint)
from graft_block.errors import ConfigError

from .model import DFlashModel, build_target_layer_ids

SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size", "hidden_act", "attention_bias")
# what Qwen3Config derives layer_types from when a config.json has no layer_types (as the reference's does)
WINDOW_KEYS = ("layer_types", "use_sliding_window", "sliding_window", "max_window_layers")
# Qwen3Config's default, which the reference applies to a config.json without rope_theta
DEFAULT_ROPE_THETA = 10000.0
ARCHITECTURE = "DFlashDraftModel"
# DSpark's export spelling (DSparkDraftModel + these keys in dflash_config), which from_speculators writes too
DSPARK_ARCHITECTURE = "DSparkDraftModel"
DSPARK_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")


def is_dflash_layout(config: dict) -> bool:
    """Whether a config.json dict is a DFlash draft model (z-lab's layout, ours included): its architectures name
    DFlashDraftModel or, without architectures, it has a dflash_config; or it is a vLLM speculators ``dflash``
    folder. Other z-lab models (DFlash2DraftModel) carry extra weights and are not this layout."""
    if "speculators_model_type" in config:
        return config["speculators_model_type"] == "dflash"
    arch = config.get("architectures")
    if arch:
        return ARCHITECTURE in arch
    return isinstance(config.get("dflash_config"), dict)


def drop_frozen_copies(tensors: dict, shapes: dict, where: str) -> None:
    """Remove a checkpoint's frozen copies of the target's tensors (``shapes``: name -> the shape its config implies),
    which the drafter never reads (it reads the target's own); a copy of another shape is a ConfigError."""
    for name, shape in shapes.items():
        t = tensors.pop(name, None)
        if t is not None and tuple(t.shape) != tuple(shape):
            raise ConfigError(f"{where}: {name} has shape {tuple(t.shape)}, the config implies {tuple(shape)}")


def from_speculators(raw: dict, tensors: dict, where: str) -> tuple[dict, dict, torch.Tensor | None]:
    """A vLLM speculators ``dflash`` / ``dspark`` folder -> (its config in our spelling: z-lab's, or DSpark's export
    spelling, which every loader here reads; its drafter tensors; its draft vocabulary as target ids, or None).

    speculators writes ``transformer_layer_config`` as a diff against ``Qwen3Config()`` (absent keys are Qwen3's
    defaults), ``aux_hidden_state_layer_ids`` as capture ids (HF hidden-state indices = decoder-layer ids + 1), and a
    draft vocabulary as ``d2t`` offsets (target id = draft index + d2t) with ``t2d`` (a mask over the target ids).
    Its ``embed_tokens`` / ``lm_head`` are the verifier's frozen rows (``lm_head`` restricted to the draft ids): they
    are checked for shape and dropped, since the drafter reads the target's own. A DSpark ``markov_w2`` over the
    draft ids is widened to our [vocab, rank] with zero rows the draft never reads."""
    kind = raw.get("speculators_model_type")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ConfigError(f"{where}: a speculators {kind} config needs transformer_layer_config (a dict)")
    if layer.get("model_type", "qwen3") != "qwen3":
        raise ConfigError(f"{where}: transformer_layer_config.model_type {layer['model_type']!r}; the DFlash draft "
                          "layers built here are Qwen3's")
    qwen = Qwen3Config(**{k: v for k, v in layer.items() if k not in ("architectures", "model_type")})
    out = {k: getattr(qwen, k) for k in SHAPE_KEYS}
    out.update(model_type="qwen3", rope_parameters=dict(qwen.rope_parameters or {}),
               layer_types=list(qwen.layer_types or []), tie_word_embeddings=False)
    for key in ("block_size", "mask_token_id", "aux_hidden_state_layer_ids", "draft_vocab_size"):
        if raw.get(key) is None:
            raise ConfigError(f"{where}: a speculators {kind} config needs {key} (speculators and vLLM read it too: "
                              "set it to the value the drafter was trained with)")
    aux = raw["aux_hidden_state_layer_ids"]
    if not isinstance(aux, list) or not all(is_count(i, 1) for i in aux):
        raise ConfigError(f"{where}: aux_hidden_state_layer_ids must list capture ids >= 1 (hidden-state indices; "
                          f"decoder layer i is i + 1), got {aux!r}")
    H, V = int(out["hidden_size"]), int(out["vocab_size"])
    if raw.get("target_hidden_size") not in (None, H):
        raise ConfigError(f"{where}: target_hidden_size {raw['target_hidden_size']} != hidden_size {H}; the drafter "
                          "here reads the target's own embeddings and LM head, so the widths must match")
    anchor = raw.get("sample_from_anchor", kind == "dspark")  # speculators' and vLLM's default: DSpark's anchor drafts
    if not isinstance(anchor, bool):
        raise ConfigError(f"{where}: sample_from_anchor must be true or false, got {anchor!r}")
    dcfg = {"mask_token_id": raw["mask_token_id"], "target_layer_ids": [i - 1 for i in aux]}
    if kind == "dspark":
        dcfg.update(projector_type="dspark", sample_from_anchor=anchor, **{k: raw[k] for k in DSPARK_KEYS if k in raw})
        out["architectures"] = [DSPARK_ARCHITECTURE]
    elif anchor:
        raise ConfigError(f"{where}: a dflash with sample_from_anchor true drafts from the anchor row (DeepSpec's "
                          "alignment); graft-block runs that as a dspark without heads: set speculators_model_type "
                          "to \"dspark\" and markov_rank to 0 in config.json")
    else:
        out["architectures"] = [ARCHITECTURE]
    out.update(block_size=raw["block_size"], dflash_config=dcfg)

    tensors = dict(tensors)
    DV = config_int(raw["draft_vocab_size"], "draft_vocab_size", where)
    if DV > V:
        raise ConfigError(f"{where}: draft_vocab_size {DV} exceeds transformer_layer_config.vocab_size {V}: one of "
                          "the two is wrong (draft_vocab_size counts the d2t entries, vocab_size the target's ids)")
    drop_frozen_copies(tensors, {"embed_tokens.weight": (V, H), "lm_head.weight": (DV, H),
                                 "verifier_lm_head.weight": (DV, H), "verifier_norm.weight": (H,)}, where)
    d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
    if DV == V:  # the full vocabulary: maps, if shipped, must be the identity (vLLM would scatter by a permutation)
        if d2t is not None and bool(offset_vocab_ids(d2t, t2d, V, where).ne(torch.arange(V)).any()):
            raise ConfigError(f"{where}: a full-size d2t that permutes the vocabulary is not supported (drop d2t / "
                              "t2d, or set draft_vocab_size to the restricted count)")
        return out, tensors, None
    if d2t is None or tuple(d2t.shape) != (DV,):
        raise ConfigError(f"{where}: draft_vocab_size {DV} < {V} needs a d2t tensor of {DV} offsets, got "
                          f"{None if d2t is None else tuple(d2t.shape)}")
    ids = offset_vocab_ids(d2t, t2d, V, where)
    w2 = "markov_head.markov_w2.weight"
    if w2 in tensors:  # speculators' W2 projects onto the draft ids; ours spans the vocabulary
        rows = tensors[w2].shape[0]
        if rows != DV:
            raise ConfigError(f"{where}: {w2} has {rows} rows; speculators' Markov head projects onto the "
                              f"draft_vocab_size {DV} draft ids (a folder written for another vocabulary?)")
        wide = tensors[w2].new_zeros(V, tensors[w2].shape[1])
        wide[ids] = tensors[w2]
        tensors[w2] = wide
    return out, tensors, ids


def read_config(folder: str | Path) -> dict:
    """config.json of a checkpoint folder or bundled name (``resolve_checkpoint``)."""
    return read_config_json(resolve_checkpoint(folder, "DFlash-family"), "DFlash-family checkpoint")


def rope_parameters(raw: dict, where: str = "config.json") -> dict:
    """The draft's RoPE parameters from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``
    (z-lab's transformers 4 configs); an absent theta is the reference's default, not the Qwen3 targets' 1e6."""
    theta = raw.get("rope_theta", DEFAULT_ROPE_THETA)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
        raise ConfigError(f"{where}: rope_theta must be a number > 0 (the RoPE base, e.g. 10000.0), got {theta!r}")
    theta = float(theta)
    rope = dict(raw.get("rope_parameters") or {})
    if rope:
        rope.setdefault("rope_type", "default")
        rope.setdefault("rope_theta", theta)
        return rope
    rope = dict(raw.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope["rope_theta"] = theta
    return rope


def config_int(value, key: str, where: str, minimum: int = 1) -> int:
    """A config.json integer as written, or a ConfigError: ``int()`` would take "4" or 4.7 for 4 here, while the
    same folder passed whole to ``Drafter.from_config`` hands its keys to options that refuse them."""
    if not is_count(value, minimum):
        quoted = " (a string: write the number without quotes)" if isinstance(value, str) else ""
        raise ConfigError(f"{where}: {key} must be an integer >= {minimum}, got {value!r}{quoted}")
    return value


def model_from_config(raw: dict, draft_vocab: torch.Tensor | None = None, cls=DFlashModel,
                      where: str = "DFlash config.json", **model_kw) -> DFlashModel:
    """A z-lab config.json dict -> an (uninitialised) DFlashModel (or ``cls``, a subclass such as DSpark's, built
    with ``model_kw`` besides). ``where`` names the file in errors."""
    dcfg = raw.get("dflash_config") or {}
    block_size = raw.get("block_size", dcfg.get("block_size"))
    if block_size is None:
        raise ConfigError(f"{where} has no block_size (top level or dflash_config.block_size)")
    block_size = config_int(block_size, "block_size", where, 2)
    mask_id = dcfg.get("mask_token_id", raw.get("mask_token_id"))
    if mask_id is None:
        raise ConfigError(f"{where} has no dflash_config.mask_token_id (never substitute pad/eos: set it)")
    mask_id = config_int(mask_id, "mask_token_id", where, 0)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads"):
        if key not in raw:
            raise ConfigError(f"{where} lacks {key!r}")
    for key in SHAPE_KEYS:  # the integer shape keys Qwen3Config would store as given (null: its default)
        if key not in ("rms_norm_eps", "hidden_act", "attention_bias") and raw.get(key) is not None:
            config_int(raw[key], key, where)
    n_layers = raw["num_hidden_layers"]
    num_target = raw.get("num_target_layers")
    if num_target is not None:
        num_target = config_int(num_target, "num_target_layers", where)
    layer_ids = dcfg.get("target_layer_ids", raw.get("target_layer_ids"))
    if layer_ids is None:
        if num_target is None:
            raise ConfigError(f"{where} needs dflash_config.target_layer_ids or num_target_layers")
        layer_ids = build_target_layer_ids(num_target, n_layers)
    if not isinstance(layer_ids, list):
        raise ConfigError(f"{where}: target_layer_ids must be a list of decoder-layer ids, got {layer_ids!r}")
    layer_ids = [config_int(i, "each of target_layer_ids", where, 0) for i in layer_ids]
    kw = {k: raw[k] for k in SHAPE_KEYS if k in raw}
    kw.setdefault("intermediate_size", 3 * int(raw["hidden_size"]))
    kw.setdefault("num_key_value_heads", raw["num_attention_heads"])
    window = {k: raw[k] for k in WINDOW_KEYS if k in raw}  # as written: null must not become 4096
    rope = rope_parameters(raw, where)
    try:
        cfg = Qwen3Config(**kw, **window, rope_parameters=rope, tie_word_embeddings=False)
    except Exception as exc:  # transformers' own validation (strict dataclass fields, layer_types vs layers)
        raise ConfigError(f"{where}: transformers refuses it as the drafter's Qwen3 config ({type(exc).__name__}: "
                          f"{' '.join(str(exc).split())[:300]}); fix that key") from exc
    check_reference_features(raw, cfg)
    return cls(cfg, block_size, layer_ids, mask_id, num_target, draft_vocab, **model_kw)


def check_reference_features(raw: dict, cfg: Qwen3Config) -> None:
    """A ConfigError when the config asks z-lab's reference for what this forward lacks: sliding-window or causal
    layers, a scaled block embedding, scaled or soft-capped logits (dflash_config first, as the reference reads)."""
    dcfg = raw.get("dflash_config") or {}

    def value(key):
        return dcfg.get(key, raw.get(key))

    bad = []
    sliding = [i for i, t in enumerate(cfg.layer_types or []) if t != "full_attention"]
    if sliding:
        bad.append(f"sliding-window layers {sliding} (layer_types / use_sliding_window)")
    for key in ("is_causal", "causal", "use_swa"):  # the reference's key, then vLLM's dflash_config spellings
        if value(key):
            bad.append(f"{key}: {value(key)!r}")
    for key in ("input_embedding_scale", "output_multiplier"):
        if value(key) is not None and float(value(key)) != 1.0:
            bad.append(f"{key}: {value(key)!r}")
    if value("final_logit_softcapping") is not None and float(value("final_logit_softcapping")) > 0:
        bad.append(f"final_logit_softcapping: {value('final_logit_softcapping')!r}")
    if bad:
        raise ConfigError(f"DFlash-family config.json sets {'; '.join(bad)}: graft-block's drafting forward has full, "
                          "non-causal attention and unscaled embeddings and logits only, so this checkpoint would "
                          "draft other tokens than its reference; it is not supported")


def config_dict(model: DFlashModel, extra: dict | None = None) -> dict:
    """z-lab's config.json keys (+ ``extra``, e.g. {"type": "dflash"} for graft-block's registry)."""
    c = model.config
    out = {"architectures": [ARCHITECTURE], "model_type": "qwen3"}
    for k in SHAPE_KEYS:
        if hasattr(c, k):
            out[k] = getattr(c, k)
    rope = dict(c.rope_parameters or {})
    out["rope_theta"] = rope.get("rope_theta", DEFAULT_ROPE_THETA)
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


def save_checkpoint(model: DFlashModel, folder: str | Path, dtype=torch.float16, extra: dict | None = None,
                    config: dict | None = None) -> Path:
    """Weights (``dtype``) and config.json: ``config`` when given (a subclass's spelling), else z-lab's + ``extra``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    if model.draft_vocab is not None:
        tensors["draft_vocab"] = model.draft_vocab.detach().cpu().long().contiguous()
    cfg = dict(config) if config is not None else config_dict(model, extra)
    cfg["dtype"] = str(dtype).replace("torch.", "")
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return folder


def load_checkpoint(folder: str | Path, device=None, dtype=None) -> DFlashModel:
    """Strict loader: every expected tensor present, nothing unexpected (besides optional ``draft_vocab``), shapes
    equal. Raises ConfigError naming the tensor otherwise."""
    folder = resolve_checkpoint(folder, "DFlash")
    raw = read_config(folder)
    check_folder_kind(raw, folder, "dflash")
    tensors = read_weights(folder, "DFlash checkpoint")
    vocab = tensors.pop("draft_vocab", None)
    if "speculators_model_type" in raw:
        raw, tensors, vocab = from_speculators(raw, tensors, f"{folder}/config.json")
    return load_strict(model_from_config(raw, vocab, where=f"{folder}/config.json"), tensors, folder, device, dtype)


def check_folder_kind(raw: dict, folder, kind: str) -> None:
    """A ConfigError naming the right type when ``folder`` is another drafter's checkpoint: its tensors would
    otherwise be reported as unexpected, blaming the layer settings."""
    other = checkpoint_type(raw)
    if other is not None and other != kind:
        article = "an" if other[0] in "aeiou" else "a"
        raise ConfigError(f"{folder} is {article} {other!r} checkpoint: use type {other!r} or omit type")


def load_strict(model: nn.Module, tensors: dict, folder, device=None, dtype=None, what: str = "DFlash") -> nn.Module:
    """Load ``tensors`` into ``model`` with every expected tensor present, nothing unexpected and equal shapes; a
    ConfigError names the tensor otherwise. The dtype defaults to the checkpoint's ``fc`` dtype."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        bias = any(k.endswith("_proj.bias") for k in missing + unexpected)
        hint = (" (attention_bias in config.json must match: true = q/k/v/o_proj all carry a bias)" if bias
                else " (num_hidden_layers / target_layer_ids / head settings / shapes wrong?)")
        raise ConfigError(
            f"{what} checkpoint {folder} does not match its config.json: missing tensors {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected tensors {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}{hint}"
        )
    for k, v in expected.items():
        if tuple(tensors[k].shape) != tuple(v.shape):
            hint = (" (fc in-features = len(target_layer_ids) x hidden_size: are target_layer_ids right?)"
                    if k == "fc.weight" else "")
            raise ConfigError(f"{what} checkpoint {folder}: tensor {k} has shape {tuple(tensors[k].shape)}, "
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


@contextmanager
def seeded_init(seed: int):
    """Random inits drawn as ``torch.manual_seed(seed)`` then construction on the CPU would draw them, without
    touching the caller's RNG state: the CPU generator is forked, seeded, and restored on exit."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an int (the random init's), got {seed!r}")
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):  # CPU draws only, so only its state is forked
        torch.default_generator.manual_seed(seed)  # not torch.manual_seed, which would reseed every CUDA device too
        yield


def new_model(target, num_layers: int = 2, block_size: int = 16, target_layer_ids: Sequence[int] | None = None,
              mask_token_id: int | None = None, num_features: int = 3, seed: int = 0,
              intermediate_size: int | None = None, draft_vocab: torch.Tensor | None = None) -> DFlashModel:
    """A randomly initialised drafter shaped like the target's layers (heads, KV heads, head_dim, rope theta), drawn
    from ``seed`` (``seeded_init``: the caller's RNG state is left as it was)."""
    with seeded_init(seed):
        return draw_model(target, num_layers, block_size, target_layer_ids, mask_token_id, num_features,
                          intermediate_size, draft_vocab)


def draw_model(target, num_layers: int = 2, block_size: int = 16, target_layer_ids: Sequence[int] | None = None,
               mask_token_id: int | None = None, num_features: int = 3, intermediate_size: int | None = None,
               draft_vocab: torch.Tensor | None = None) -> DFlashModel:
    """``new_model`` drawing from the global CPU generator as it stands (``new_dspark_model`` draws its heads next,
    inside the same ``seeded_init``)."""
    for key, value in (("num_layers", num_layers), ("num_features", num_features)):
        if not is_count(value, 1):
            raise ConfigError(f"{key} must be an int >= 1 (a drafter has at least one decoder layer and reads at least "
                              f"one target feature layer), got {value!r}")
    tc = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    heads = int(tc.num_attention_heads)
    head_dim = int(getattr(tc, "head_dim", None) or tc.hidden_size // heads)
    rope = dict(getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": DEFAULT_ROPE_THETA})
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
    model = DFlashModel(cfg, block_size, target_layer_ids, mask_token_id, target.num_layers, draft_vocab)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    return model.to(device=target.device, dtype=target.dtype)
