"""DSpark checkpoints in the four spellings a user meets, read into one ``DSparkModel``:

- DeepSpec native: ``architectures: ["Qwen3DSparkModel"]``, the DSpark keys at the top level of config.json
  (``block_size``, ``mask_token_id``, ``target_layer_ids``, ``num_target_layers``, ``markov_rank``,
  ``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``), tensors without a ``model.``
  prefix plus frozen copies of the target's ``embed_tokens`` / ``lm_head`` (checked for shape, then dropped: the
  drafter uses the target's own);
- the export spelling ``architectures: ["DSparkDraftModel"]`` with those keys under ``dflash_config``
  (``projector_type: "dspark"``);
- ours: the export spelling plus ``block_alignment`` and ``confidence_temperatures`` in ``dflash_config``, and an
  optional ``draft_vocab`` tensor as in our DFlash checkpoints;
- vLLM speculators' ``dspark`` folder (``DSparkSpeculator``), read through ``dflash.checkpoint.from_speculators``.

A DeepSpec-made folder without ``block_alignment`` is DeepSpec-aligned (the anchor row drafts); ours always
writes the key, so a z-lab-aligned model never runs with the wrong rows. A folder that spells the alignment as vLLM,
speculators and llama.cpp do, ``sample_from_anchor`` (true = DeepSpec's rows), is read by it.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from graft_block.drafter import read_weights, resolve_checkpoint
from graft_block.errors import ConfigError

from ..dflash.checkpoint import (DSPARK_ARCHITECTURE, check_compatible, config_dict, draw_model, drop_frozen_copies,
                                 from_speculators, load_strict, model_from_config, read_config, seeded_init)
from ..dflash.checkpoint import save_checkpoint as dflash_save
from .model import ALIGNMENTS, DSparkModel, EmbeddingMarkovHead, from_dflash

NATIVE_ARCHITECTURES = ("Qwen3DSparkModel",)
UNSUPPORTED_ARCHITECTURES = ("Gemma4DSparkModel",)
EXPORT_ARCHITECTURE = DSPARK_ARCHITECTURE


def is_dspark_layout(config: dict) -> bool:
    if "speculators_model_type" in config:  # vLLM speculators' spelling (DSparkSpeculator)
        return config["speculators_model_type"] == "dspark"
    arch = config.get("architectures") or []
    return any(a in arch for a in NATIVE_ARCHITECTURES + UNSUPPORTED_ARCHITECTURES + (EXPORT_ARCHITECTURE,))


def dspark_options(raw: dict, where: str = "config.json") -> dict:
    """The DSpark-specific keys of a config dict (either spelling) -> DSparkModel keyword arguments."""
    arch = raw.get("architectures") or []
    if any(a in arch for a in UNSUPPORTED_ARCHITECTURES):
        raise ConfigError(f"{where}: {arch} has a Gemma4 backbone; only the Qwen3 DSpark backbone is built here")
    native = any(a in arch for a in NATIVE_ARCHITECTURES)
    src = raw if native else (raw.get("dflash_config") or {})
    if not native and src.get("projector_type", "dspark") != "dspark":
        raise ConfigError(f"{where}: dflash_config.projector_type is {src.get('projector_type')!r}, not 'dspark'")
    rank = src.get("markov_rank", raw.get("markov_rank"))
    if rank is None:
        raise ConfigError(f"{where} lacks 'markov_rank' (DSpark configs carry it; 0 = no Markov head)")
    if isinstance(rank, bool) or not isinstance(rank, int):  # int("x") would raise a bare ValueError below
        raise ConfigError(f"{where}: markov_rank must be an int >= 0 (0 = no Markov head), got {rank!r}")
    conf = src.get("enable_confidence_head", raw.get("enable_confidence_head", False))
    with_markov = src.get("confidence_head_with_markov", raw.get("confidence_head_with_markov"))
    for key, value in (("enable_confidence_head", conf), ("confidence_head_with_markov", with_markov)):
        if value is not None and not isinstance(value, bool):  # bool("false") is True: a string would flip it
            raise ConfigError(f"{where}: {key} must be true or false, got {value!r}")
    if conf and with_markov is None:
        raise ConfigError(f"{where} enables the confidence head but lacks 'confidence_head_with_markov'")
    alignment = src.get("block_alignment", raw.get("block_alignment"))
    if alignment is not None and alignment not in ALIGNMENTS:
        raise ConfigError(f"{where}: block_alignment {alignment!r} is not one of {sorted(ALIGNMENTS)}")
    # vLLM, speculators, SGLang and llama.cpp's converter spell the alignment sample_from_anchor
    anchor = src.get("sample_from_anchor", raw.get("sample_from_anchor"))
    if anchor is not None:
        if not isinstance(anchor, bool):
            raise ConfigError(f"{where}: sample_from_anchor must be true or false, got {anchor!r}")
        from_anchor = "deepspec" if anchor else "zlab"
        if alignment is not None and alignment != from_anchor:
            raise ConfigError(f"{where}: block_alignment {alignment!r} contradicts sample_from_anchor {anchor} "
                              f"(true = the anchor row drafts = 'deepspec'); keep the one the model was trained with")
        alignment = from_anchor
    alignment = alignment or "deepspec"  # DeepSpec's folders carry neither key: their anchor row drafts
    first = src.get("markov_first_draft", True)  # absent in DeepSpec's folders: they bias every draft
    if not isinstance(first, bool):
        raise ConfigError(f"{where}: markov_first_draft must be true or false, got {first!r}")
    return {"markov_rank": rank, "markov_head_type": src.get("markov_head_type", "vanilla"),
            "confidence_head": conf, "confidence_with_markov": bool(with_markov) if conf else False,
            "alignment": alignment, "markov_first_draft": first}


def model_from_dspark_config(raw: dict, draft_vocab: torch.Tensor | None = None, where: str = "config.json"):
    # dflash's parser reads mask_token_id / target_layer_ids from dflash_config or the top level (native)
    model = model_from_config(raw, draft_vocab, cls=DSparkModel, where=where, **dspark_options(raw, where))
    for key in ("confidence_temperatures", "draft_temperatures", "sampled_draft_temperatures"):
        temps = (raw.get("dflash_config") or {}).get(key)
        if temps is None:
            continue
        if not isinstance(temps, list):
            raise ConfigError(f"{where}: {key} must be a list of {model.num_drafts} positive numbers (one temperature "
                              f"per draft position), got {temps!r}")
        if len(temps) != model.num_drafts:
            raise ConfigError(f"{where}: {key} has {len(temps)} entries, the block drafts {model.num_drafts} (one "
                              "temperature per draft position)")
        if not all(isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 for t in temps):
            raise ConfigError(f"{where}: {key} must be positive numbers, got {temps}")
        setattr(model, key, torch.tensor([float(t) for t in temps]))
    return model


class UncalibratedWarning(UserWarning):
    """A DSpark folder whose config.json says its confidences still need ``calibrate.py``."""


_WARNED: set[str] = set()  # folders already warned about in this process
CALIBRATE = "python -m graft_block.drafters.dspark.calibrate"  # the command that fits a folder's temperatures


def warn_if_uncalibrated(folder: str | Path) -> None:
    """Warn once per folder when its config.json carries training's ``"calibration": {"needed": true, ...}`` mark
    (``calibrate.py`` removes it): the folder's temperatures are the identity, not fitted to its weights, so its
    confidences and the tree's per-depth ranking are not calibrated. Calibration (``calibrate.py`` itself) and
    training read such folders through ``load_checkpoint``, which stays quiet."""
    folder = resolve_checkpoint(folder, "DSpark")
    note = read_config(folder).get("calibration")
    if note is None or (isinstance(note, dict) and note.get("needed") is False) or str(folder) in _WARNED:
        return
    _WARNED.add(str(folder))
    fields = note if isinstance(note, dict) else {}
    why = fields.get("why") or f"its config.json's 'calibration' entry is {note!r}"
    run = str(fields.get("run") or f"{CALIBRATE} <this folder> --data <its training data> --holdout <its --holdout>")
    warnings.warn(f"DSpark checkpoint {folder} is uncalibrated ({why}): its confidences and draft temperatures were "
                  f"not fitted to these weights, so acceptance estimates (schedule, Graft) and the tree's ranking "
                  f"read uncalibrated probabilities. Calibrate it: {run.replace('<this folder>', str(folder))}",
                  UncalibratedWarning, stacklevel=3)


def load_checkpoint(folder: str | Path, device=None, dtype=None) -> DSparkModel:
    """Any of the four spellings -> DSparkModel, strictly: missing, unexpected or mis-shaped tensors are named."""
    folder = resolve_checkpoint(folder, "DSpark")
    raw = read_config(folder)
    if not is_dspark_layout(raw):
        raise ConfigError(f"{folder}/config.json is not a DSpark checkpoint (architectures "
                          f"{raw.get('architectures')}; expected Qwen3DSparkModel or DSparkDraftModel)")
    tensors = read_weights(folder, "DSpark checkpoint")
    if any(k.startswith("model.") for k in tensors):
        tensors = {k[len("model."):] if k.startswith("model.") else k: v for k, v in tensors.items()}
    vocab = tensors.pop("draft_vocab", None)
    if "speculators_model_type" in raw:
        raw, tensors, vocab = from_speculators(raw, tensors, f"{folder}/config.json")
    model = model_from_dspark_config(raw, vocab, f"{folder}/config.json")
    V, H = model.config.vocab_size, model.config.hidden_size
    drop_frozen_copies(tensors, {"embed_tokens.weight": (V, H), "lm_head.weight": (V, H)},  # DeepSpec's copies
                       f"DSpark checkpoint {folder}")
    return load_strict(model, tensors, folder, device, dtype, what="DSpark")


def dspark_config_dict(model: DSparkModel, extra: dict | None = None) -> dict:
    """Our spelling: the export one (DSparkDraftModel + dflash_config) with the alignment and calibration."""
    out = config_dict(model)
    out["architectures"] = [EXPORT_ARCHITECTURE]
    out["dflash_config"].update({
        "projector_type": "dspark", "markov_rank": model.markov_rank, "markov_head_type": model.markov_head_type,
        "enable_confidence_head": model.confidence_head is not None,
        "confidence_head_with_markov": model.confidence_with_markov, "block_alignment": model.alignment,
        "markov_first_draft": model.markov_first_draft,
        "confidence_temperatures": [round(float(t), 6) for t in model.confidence_temperatures],
        "draft_temperatures": [round(float(t), 6) for t in model.draft_temperatures]})
    if model.sampled_draft_temperatures is not None:
        out["dflash_config"]["sampled_draft_temperatures"] = [round(float(t), 6)
                                                              for t in model.sampled_draft_temperatures]
    out.update(extra or {})
    return out


def save_checkpoint(model: DSparkModel, folder: str | Path, dtype=torch.float16, extra: dict | None = None) -> Path:
    head = model.markov_head
    if isinstance(head, EmbeddingMarkovHead):  # a factored training head is stored as DeepSpec's tables
        model.markov_head = head.tables()
    try:
        return dflash_save(model, folder, dtype, config=dspark_config_dict(model, extra))
    finally:
        model.markov_head = head


def new_dspark_model(target, num_layers: int = 2, block_size: int = 16, markov_rank: int = 8,
                     confidence_head: bool = True, alignment: str = "zlab", seed: int = 0,
                     markov_first_draft: bool = True, markov_head_type: str = "vanilla", **kw) -> DSparkModel:
    """A randomly initialised DSpark drafter for ``target`` (tests, or training from scratch), drawn from ``seed``
    without touching the caller's RNG state."""
    with seeded_init(seed):  # one stream: a gated or RNN head's projection is drawn after the backbone, as ever
        base = draw_model(target, num_layers=num_layers, block_size=block_size, **kw)
        model = from_dflash(base, markov_rank=markov_rank, confidence_head=confidence_head, alignment=alignment,
                            seed=seed, markov_first_draft=markov_first_draft, markov_head_type=markov_head_type)
    if model.markov_head is not None:  # a visible correction, unlike a trained start's W2 = 0
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for w in (model.markov_head.markov_w1.weight, model.markov_head.markov_w2.weight):
                w.copy_(torch.randn(w.shape, generator=g).to(w))
    check_compatible(model, target)
    return model.to(device=target.device, dtype=target.dtype)
