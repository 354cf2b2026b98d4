"""DFlash: a block-diffusion drafter conditioned on target features by KV injection (z-lab/dflash format).

One draft forward per round proposes a whole block ``[bonus, mask x (B-1)]``; row k predicts the token at
``start + k`` through the target's LM head. One concern per module: ``model`` (``DFlashModel``, attention, layer),
``checkpoint`` (z-lab config.json <-> model, strict safetensors IO, target compatibility, random init),
``training`` (block loss, anchors, warm start; shared with MFD), ``drafter`` (``DFlashDrafter``, registered
"dflash", chain or DDTree proposals).
"""
from ..layers import apply_rope
from .checkpoint import (
    ARCHITECTURE,
    DEFAULT_ROPE_THETA,
    SHAPE_KEYS,
    check_compatible,
    config_dict,
    is_dflash_layout,
    load_checkpoint,
    model_from_config,
    new_model,
    read_config,
    rope_parameters,
    save_checkpoint,
)
from .drafter import DFlashDrafter, random_init_block
from .model import DFlashAttention, DFlashLayer, DFlashModel, build_target_layer_ids
from .training import (
    RECIPE_KEYS,
    TRAIN_DEFAULTS,
    TRAIN_KEYS,
    block_attention_mask,
    block_loss_opts,
    block_metrics,
    draft_rows,
    freeze_backbone,
    lm_head,
    make_blocks,
    recipe_loss,
    row_losses,
    row_objective,
    row_weights,
    sample_anchors,
    target_l1,
    training_blocks,
    training_loss,
    training_model,
    warm_start,
)

__all__ = [
    "ARCHITECTURE", "DEFAULT_ROPE_THETA", "DFlashAttention", "DFlashDrafter", "DFlashLayer", "DFlashModel",
    "RECIPE_KEYS", "SHAPE_KEYS", "TRAIN_DEFAULTS", "TRAIN_KEYS", "apply_rope", "block_attention_mask",
    "block_loss_opts", "block_metrics", "build_target_layer_ids", "draft_rows", "freeze_backbone", "recipe_loss",
    "row_objective", "row_weights", "target_l1", "training_blocks",
    "check_compatible", "config_dict", "is_dflash_layout", "lm_head", "load_checkpoint", "make_blocks",
    "model_from_config", "new_model", "random_init_block", "read_config", "rope_parameters", "row_losses",
    "sample_anchors",
    "save_checkpoint", "training_loss", "training_model", "warm_start",
]
