"""DSpark training plug-in (graft_block.training): the block recipe (``dflash.training``) plus DSpark's two heads.

DSpark's recipe defaults are DeepSpec's (``RECIPE_DEFAULTS``): 0.1 CE + 0.9 L1 to the target's top-k, rows weighted
exp(-j/4), unique anchors packed into one masked forward per chunk, 24 of them (DeepSpec: 512; 24 gave the most
held-out tau per CPU-minute here). The Markov head is teacher-forced on the true previous tokens (its bias enters
the logits the recipe scores), and the confidence head adds confidence_weight * BCE(conf_j, label_j), the label
detached: 1 - TV_j (``confidence_label: "tv"``, DeepSpec's) or whether row j's argmax is the target's token
(``"greedy"``, what greedy decoding accepts). ``markov_basis: "embedding"`` trains W1 = E A and W2 = E B on the
target's embedding E (saved as the usual tables); ``markov_first_draft: false`` leaves draft 0 (previous token =
the anchor) unbiased. ``freeze_backbone`` trains the heads only, on a frozen DFlash backbone: the drafts stay the
backbone's plus the Markov bias, and the backbone itself is the control. Metrics are the recipe's (tau_tf, tau_exp)
plus the confidence head's error.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from graft_block.drafter import check_flag, check_number, is_count, resolve_checkpoint
from graft_block.errors import ConfigError

from ..dflash import training as D
from ..dflash.checkpoint import check_compatible
from .checkpoint import CALIBRATE, load_checkpoint
from .model import DSparkModel, EmbeddingMarkovHead, from_dflash

TRAIN_DEFAULTS = {"markov_rank": 64, "markov_head_type": "vanilla", "confidence_head": True, "confidence_weight": 1.0,
                  "alignment": "zlab", "freeze_backbone": False, "confidence_label": "tv", "markov_basis": "table",
                  "markov_first_draft": True}
TRAIN_KEYS = (*D.TRAIN_KEYS, *TRAIN_DEFAULTS)  # DSpark's heads over the DFlash backbone's keys
MARKOV_BASES = ("table", "embedding")  # W1/W2 as free [V, r] tables (DeepSpec) or E A / E B (EmbeddingMarkovHead)
CONFIDENCE_LABELS = ("tv", "greedy")  # 1 - TV (DeepSpec; acceptance when sampling) or argmax == target token
RECIPE_DEFAULTS = {"ce_weight": 0.1, "l1_weight": 0.9, "soft_weight": 0.0, "gamma": 4.0, "num_anchors": 24,
                   "unique_anchors": True}  # DeepSpec's weights over the block recipe's (dflash.training)
# 24 anchors a sequence (DeepSpec: 512): the most held-out tau_tf per CPU-minute of 24 / 64 / 128 / 512 here
# (docs/training.md, "Anchor count")


def training_model(target, cfg: dict, init: str | None = None) -> DSparkModel:
    """``init``: a DSpark folder (continue it), a DFlash folder or None/"random"/"target" (a DFlash backbone as
    ``dflash.training.training_model`` builds it, wrapped with new heads: W2 = 0, so step 0 drafts as the
    backbone does). ``alignment`` ("zlab" | "deepspec") picks the rows that draft for a new model; from a z-lab
    DFlash folder, "deepspec" asks the anchor row to draft and shifts every mask row's target by one. New heads
    draw from ``cfg["seed"]`` (the run's: ``graft_block.training.init_seed_of``). A continued folder's
    ``calibrate.py`` temperatures are reset to identity (the heads and drafts they fitted change under training),
    and the model's ``config_notes`` mark every folder training saves as needing ``calibrate.py``."""
    opts = {**TRAIN_DEFAULTS, **{k: v for k, v in cfg.items() if k in TRAIN_DEFAULTS}}
    arch, stale = None, []
    if init not in (None, "random", "target"):
        init = str(resolve_checkpoint(init, "DSpark or DFlash"))  # a bundled name too, as --type dflash takes
        arch = json.loads((Path(init) / "config.json").read_text()).get("architectures") or []
    from_dspark = bool(arch) and "DFlashDraftModel" not in arch  # continue a DSpark folder, heads included
    if from_dspark:
        model = load_checkpoint(init, device=target.device, dtype=torch.float32)
        D.check_continued(model, cfg, init, {"markov_rank": lambda m: m.markov_rank,
                                             "confidence_head": lambda m: m.confidence_head is not None},
                          init_only=("init_layers", "passthrough"))
        if "markov_head_type" in cfg and cfg["markov_head_type"] != model.markov_head_type:
            raise ConfigError(f"--init {init} has a {model.markov_head_type!r} Markov head and the config asks for "
                              f"{cfg['markov_head_type']!r}: start from a DFlash folder for a new head type")
        if "alignment" in cfg and cfg["alignment"] != model.alignment:
            raise ConfigError(f"--init {init} drafts with {model.alignment!r} rows and the config asks for "
                              f"{cfg['alignment']!r}: a DSpark checkpoint keeps its alignment (start from a DFlash "
                              "folder to change it)")
        if model.draft_vocab is not None:
            cfg["draft_vocab"] = model.draft_vocab.cpu().tolist()  # a resume rebuilds this vocabulary
        stale = reset_calibration(model)
    else:
        base = D.training_model(target, cfg, init)
        if not is_count(opts["markov_rank"]):  # int() made "64" 64 and 64.9 64
            raise ConfigError(f"markov_rank must be an int >= 0 (0 = no Markov head), got {opts['markov_rank']!r}")
        model = from_dflash(base, markov_rank=opts["markov_rank"],
                            confidence_head=check_flag(opts["confidence_head"], "confidence_head"),
                            alignment=str(opts["alignment"]), seed=int(cfg.get("seed", 0)),
                            markov_head_type=opts["markov_head_type"])
    if not isinstance(opts["markov_first_draft"], bool):
        raise ConfigError(f"markov_first_draft must be true or false, got {opts['markov_first_draft']!r}")
    if "markov_first_draft" in cfg or not from_dspark:  # a DSpark init keeps its own unless asked
        model.markov_first_draft = opts["markov_first_draft"]
    check_compatible(model, target)
    if opts["markov_basis"] not in MARKOV_BASES:
        raise ConfigError(f"markov_basis must be one of {MARKOV_BASES} ('table': free W1/W2 rows per token, "
                          f"DeepSpec's; 'embedding': W1 = E A, W2 = E B on the target's embedding E), got "
                          f"{opts['markov_basis']!r}")
    if opts["markov_basis"] == "embedding":
        if from_dspark:
            raise ConfigError("markov_basis 'embedding' trains a new Markov head: --init a DFlash folder (the "
                              "backbone), not a DSpark one, whose tables it would discard")
        if model.markov_head is None:
            raise ConfigError("markov_basis 'embedding' needs a Markov head: set markov_rank > 0")
        embed = target.model.get_input_embeddings().weight.detach().to(target.device, torch.float32)
        model.markov_head = EmbeddingMarkovHead(embed, model.markov_rank, seed=int(cfg.get("seed", 0)),
                                                kind=model.markov_head_type, hidden_size=model.config.hidden_size)
    if opts["confidence_label"] not in CONFIDENCE_LABELS:
        raise ConfigError(f"confidence_label must be one of {CONFIDENCE_LABELS} ('tv': 1 - TV to the target, the "
                          f"acceptance when sampling; 'greedy': the draft's argmax is the target's token), got "
                          f"{opts['confidence_label']!r}")
    # heads only: the drafts start and stay the backbone's, plus the Markov bias
    if check_flag(opts["freeze_backbone"], "freeze_backbone"):
        D.freeze_backbone(model, ("markov_head.", "confidence_head."))
    # whatever trains, the saved folder is uncalibrated: its config.json says so until calibrate.py runs
    model.config_notes = {"calibration": calibration_note(init, stale)}
    model.train_opts = {**D.block_loss_opts(cfg, model.block_size, RECIPE_DEFAULTS),
                        "confidence_weight": check_number(opts["confidence_weight"], "confidence_weight", 0.0),
                        "confidence_label": opts["confidence_label"]}
    return model.to(target.device)


CALIBRATED = ("confidence_temperatures", "draft_temperatures", "sampled_draft_temperatures")  # calibrate.py's fits


def reset_calibration(model: DSparkModel) -> list[str]:
    """Set ``calibrate.py``'s per-position temperatures back to identity (sampled ones: none, i.e. the greedy fit's)
    and return the names of those that were not: they were fitted to the weights training is about to change."""
    stale = [k for k in CALIBRATED if getattr(model, k) is not None and not bool((getattr(model, k) == 1).all())]
    model.confidence_temperatures = torch.ones_like(model.confidence_temperatures)
    model.draft_temperatures = torch.ones_like(model.draft_temperatures)
    model.sampled_draft_temperatures = None
    return stale


def calibration_note(init: str | None, stale: list[str]) -> dict:
    """The ``"calibration"`` entry of a trained folder's config.json (``calibrate.py`` removes it once it fits)."""
    why = "trained weights; their per-position temperatures are 1 (identity)"
    if stale:
        why = (f"continued from {init}, whose calibrated {', '.join(stale)} fitted its old weights: reset to 1 "
               "(identity) rather than shipped stale")
    return {"needed": True, "why": why,
            "run": f"{CALIBRATE} <this folder> --data <its training data> --holdout <its --holdout>"}


def draft_logits(model: DSparkModel, target, hidden: torch.Tensor, prev: torch.Tensor,
                 draft_index: torch.Tensor, base: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                 latent: torch.Tensor | None = None) -> torch.Tensor:
    """Markov-corrected draft logits over the draft vocabulary: U(hidden) + W2 l (teacher-forced prev; l the head's
    latent, ``DSparkModel.markov_latents``). hidden [..., H], prev and ``draft_index`` (each row's draft position j)
    [...]; an RNN head needs whole blocks ([..., L, H], [..., L]). ``valid`` (a mask over prev's shape): score only
    those rows, flattened. ``base``: U of the scored rows when the caller has it; ``latent``: likewise l."""
    pick = (lambda t: t) if valid is None else (lambda t: t[valid])
    z = model.logits(pick(hidden), *D.lm_head(target)) if base is None else base
    if model.markov_head is None:
        return z
    lat = pick(model.markov_latents(prev, hidden, draft_index)) if latent is None else latent
    return z + model.markov_project(lat, model.draft_vocab).to(z.dtype)


def training_loss(model: DSparkModel, target, batch: dict):
    if "top_ids" not in batch:
        raise ConfigError("DSpark's L1 and confidence losses need the target's top-k distributions in the data "
                          "cache (top_ids / top_logp): regenerate the cache with graft_block.drafters.train --generate")
    loss, m, rows = D.recipe_loss(model, target, batch,
                                  lambda h, prev, j, ok: draft_logits(model, target, h, prev, j, valid=ok))
    conf = model.confidence_logits(rows["hidden"], rows["prev"])
    if conf is not None:
        w, wsum = rows["w"], rows["wsum"]
        label = rows["accept"] if model.train_opts.get("confidence_label", "tv") == "tv" else rows["correct"]
        bce = torch.nn.functional.binary_cross_entropy_with_logits(conf, label, reduction="none")
        loss = loss + model.train_opts["confidence_weight"] * (w * bce).sum() / wsum
        with torch.no_grad():
            m.update({"loss": float(loss), "conf_bce": float((w * bce).sum() / wsum),
                      "conf_abs_err": float((torch.sigmoid(conf) - label).abs().mean()) if w.numel() else 0.0})
    return loss, m
