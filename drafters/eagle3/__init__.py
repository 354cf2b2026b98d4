"""EAGLE-3: a one-layer draft head over fused low/mid/high target features, EAGLE-2 dynamic trees, checkpoint IO
for the EAGLE/SpecForge and speculators layouts, and the training-time-test (TTT) loss.

One concern per module: ``model`` (config, head, layer), ``checkpoint`` (layouts, load/save, draft vocabulary,
hub-config recognition), ``training`` (TTT loss, warm start), ``drafter`` (``Eagle3Drafter``, registered "eagle3").
"""
from .checkpoint import (
    LAYER_PREFIXES,
    MODEL_CONFIG_KEYS,
    build_draft_vocab,
    check_against_target,
    check_vocab_map,
    head_from_state_dict,
    is_eagle3_config,
    load_head,
    read_state_dict,
    save_head,
)
from .drafter import DRAFTER_KEYS, Eagle3Drafter
from .model import (
    Eagle3Attention,
    Eagle3Config,
    Eagle3Head,
    Eagle3Layer,
    Eagle3MLP,
    default_feature_layers,
    prefix_mask,
)
from .training import (
    head_config_for,
    response_token_counts,
    soft_labels,
    training_head,
    ttt_forward,
    ttt_loss,
    warm_start,
    widen_draft_vocab,
)

__all__ = [
    "DRAFTER_KEYS", "LAYER_PREFIXES", "MODEL_CONFIG_KEYS", "Eagle3Attention", "Eagle3Config", "Eagle3Drafter",
    "Eagle3Head", "Eagle3Layer", "Eagle3MLP", "build_draft_vocab", "check_against_target", "check_vocab_map",
    "default_feature_layers", "head_config_for", "head_from_state_dict", "is_eagle3_config", "load_head",
    "prefix_mask", "read_state_dict", "response_token_counts", "save_head", "soft_labels",
    "training_head", "ttt_forward", "ttt_loss", "warm_start", "widen_draft_vocab",
]
