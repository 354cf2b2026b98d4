"""Tiny random targets for tests and examples (no download, seconds to build)."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config, MistralConfig

from .target import Target

_CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}


def tiny_target(arch: str = "llama", vocab_size: int = 128, hidden_size: int = 64, num_layers: int = 4,
                heads: int = 4, kv_heads: int = 2, seed: int = 0, max_positions: int = 512,
                dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa") -> Target:
    """A randomly initialised causal LM of the given family, wrapped as a Target (EOS disabled).

    ``initializer_range`` 0.3 (not HF's 0.02) so greedy text depends on context instead of repeating one token."""
    cfg_cls = _CONFIGS[arch]
    kw = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
              num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
              max_position_embeddings=max_positions, tie_word_embeddings=False,
              bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.3)
    if arch == "qwen3":
        kw["head_dim"] = hidden_size // heads
    if arch == "mistral":
        kw["sliding_window"] = None
    cfg = cfg_cls(**kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation, dtype=dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return Target(model, None, name=f"tiny-{arch}")
