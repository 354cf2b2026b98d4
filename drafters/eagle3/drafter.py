"""The EAGLE-3 drafter: the head's KV over the accepted prefix plus EAGLE-2 dynamic-tree expansion.

Draft KV is kept only for the accepted prefix; tree-expansion KV is discarded every round.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from graft_block.drafter import (Drafter, check_budget, is_count, keys_from_file, read_config_json, register,
                                 resolve_checkpoint, shared_checkpoint)
from graft_block.engine import drafter_kernel
from graft_block.errors import ConfigError
from graft_block.tree import Tree, root_only
from graft_block.tree.eagle import Candidates, expand, next_tree_mask, rerank

from ..layers import use_kernel
from . import c_layer
from .checkpoint import (
    MODEL_CONFIG_KEYS,
    check_against_target,
    is_eagle3_config,
    load_head,
    save_head,
)
from .model import Eagle3Head, default_feature_layers, prefix_mask
from .training import NEW_HEAD_KEYS, training_head, ttt_loss

DRAFTER_KEYS = ("checkpoint", "budget", "depth", "top_k", "feature_layers")

AUTO_BUDGET_REMOVED = ("eagle3 no longer picks its budget by timing target forwards (drafters never time the "
                       "target; EAGLE's total_token=-1 lives in the benchmark harness now): pass an int budget "
                       "(non-root nodes per round, EAGLE's total_token - 1) or run `eval/run_block.py --budget auto`")


@register("eagle3")
class Eagle3Drafter(Drafter):
    """EAGLE-3 head + EAGLE-2 dynamic tree. ``budget`` = total_tokens - 1 non-root nodes, ``depth`` = expansion
    forwards after the root step (trees reach depth ``depth + 1``), ``top_k`` per node."""

    def __init__(self, target, checkpoint: str | Path | None = None, budget: int = 59, depth: int = 7,
                 top_k: int = 10, feature_layers: Sequence[int] | None = None, head: Eagle3Head | None = None):
        if target is None:
            raise ConfigError("the eagle3 drafter needs the target (its features and embedding): "
                              "Drafter.from_config(cfg, target=target)")
        if budget == "auto" or (isinstance(budget, int) and not isinstance(budget, bool) and budget == -1):
            raise ConfigError(AUTO_BUDGET_REMOVED)
        self.budget = check_budget(budget)
        if head is None:
            if checkpoint is None:
                raise ConfigError("eagle3 needs a checkpoint (folder or bundled short name, e.g. 'eagle3-smollm2')")
            folder = resolve_checkpoint(checkpoint, "eagle3")
            head = shared_checkpoint(target, "eagle3", folder, lambda: load_head(folder, target))
        else:
            check_against_target(head, target)
            head = head.to(device=target.device, dtype=target.dtype).eval()
        for p in head.parameters():
            p.requires_grad_(False)
        self.target, self.head = target, head
        use_kernel(head, drafter_kernel(target))  # drafting runs the target engine's product kernel
        self.checkpoint = None if checkpoint is None else str(checkpoint)
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ConfigError(f"depth must be an int >= 0 (expansion steps after the root step), got {depth!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ConfigError(f"top_k must be an int >= 1, got {top_k!r}")
        self.depth, self.top_k = depth, top_k
        # draft -> target id offsets; None when the draft vocabulary is the target's own (read once, not per round)
        self.d2t = None if head.cfg.draft_vocab_size == head.cfg.vocab_size and not bool(head.d2t.any()) else head.d2t
        if feature_layers is None:
            ids = head.cfg.aux_layer_ids
            feature_layers = [i + 1 for i in ids] if ids is not None else default_feature_layers(target.num_layers)
        if not isinstance(feature_layers, (list, tuple)) or not all(is_count(i, 0) for i in feature_layers):
            raise ConfigError(f"feature_layers must be a list of 3 HF hidden_states indices (ints >= 0), got "
                              f"{feature_layers!r}")
        self.feature_layers = tuple(int(i) for i in feature_layers)
        if len(self.feature_layers) != 3:
            raise ConfigError(f"EAGLE-3 fuses exactly 3 target layers, got feature_layers={self.feature_layers}")
        for i in self.feature_layers:
            if not 0 <= i <= target.num_layers:
                raise ConfigError(f"feature layer {i} is outside 0..{target.num_layers} (HF hidden_states indices)")
        self.last_candidates: Candidates | None = None
        # the head's layer on the C decoder layers where the target runs them (one call per level), else torch
        self.c_layer = None if c_layer.why_not(head, target) else c_layer.CLayer(head, target)
        # Optional early stop of the expansion (Graft's pruning checkpoints): stop_fn(level, frontier_scores).
        self.stop_fn = None
        self._reset()

    @classmethod
    def claims(cls, config: dict) -> bool:
        """Untouched EAGLE/SpecForge and vLLM-speculators EAGLE-3 config.json files (no "type" key)."""
        return is_eagle3_config(config)

    @classmethod
    def build(cls, cfg: dict, target=None) -> "Eagle3Drafter":
        cfg = dict(cfg)
        ckpt = cfg.get("checkpoint")
        folder = resolve_checkpoint(ckpt, "eagle3") if ckpt is not None else None
        saved = read_config_json(folder, "eagle3") if folder is not None else {}
        from_file = keys_from_file(cfg, saved)  # the loader's (hub files carry many)
        unknown = [k for k in cfg if k not in DRAFTER_KEYS and k not in MODEL_CONFIG_KEYS and k not in from_file]
        if "auto_sizes" in unknown:
            raise ConfigError(AUTO_BUDGET_REMOVED)
        if unknown:
            raise ConfigError(f"unknown eagle3 config keys {unknown}; known: {', '.join(DRAFTER_KEYS)}")
        # the head is built from the folder's config.json alone, so a model key that differs would be ignored
        overridden = sorted(k for k in cfg if k in MODEL_CONFIG_KEYS and k not in from_file)
        if overridden and folder is not None:
            raise ConfigError(f"eagle3 options {overridden} beside checkpoint {ckpt} differ from its config.json (a "
                              f"saved field cannot be overridden): drop them, or edit {folder / 'config.json'}; the "
                              f"options are {', '.join(DRAFTER_KEYS)}")
        # A checkpoint's config.json may carry drafter defaults; explicit keys win. A hub file's top-level keys
        # are model settings only (HF configs may hold e.g. a generation top_k); ours are honoured as before.
        ours = "type" in saved
        kwargs = dict(saved.get("drafter_defaults", {}))
        stray = sorted(k for k in kwargs if k not in DRAFTER_KEYS or k == "checkpoint")
        if stray:  # a typo here would reach __init__ as a bare TypeError
            known = ", ".join(k for k in DRAFTER_KEYS if k != "checkpoint")
            raise ConfigError(f"{folder / 'config.json' if folder else 'config.json'}: drafter_defaults keys {stray} "
                              f"are not eagle3 options; known: {known}")
        kwargs.update({k: v for k, v in cfg.items() if k in DRAFTER_KEYS and (ours or k not in from_file)})
        if folder is not None:
            kwargs["checkpoint"] = folder
        return cls(target=target, **kwargs)

    def describe(self) -> dict:
        return {"type": self.type_name, "budget": self.budget, "depth": self.depth, "top_k": self.top_k,
                "feature_layers": list(self.feature_layers), "checkpoint": self.checkpoint,
                "draft_vocab_size": self.head.cfg.draft_vocab_size}

    # ---- caches ---------------------------------------------------------------------------------------------
    def _reset(self):
        self.k_cache = self.v_cache = None  # draft KV of the accepted prefix: [1, kv, n_pairs, hd] (torch layer)
        self.n_pairs = 0
        self.pending: list[tuple[torch.Tensor, int]] = []
        self.root_out = None  # pre-norm output of the last accepted pair (its row predicts the root's children)

    def prefill(self, state) -> None:
        self._reset()
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
            if self.c_layer is not None:  # causal over the new pairs, all earlier ones visible
                g = self.c_layer.fuse(feats.view(m, -1))
                self.root_out = self.c_layer.forward(self.embed(toks), g, start, self.n_pairs)[-1]
                self.n_pairs += m
                continue
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

    def cached_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's K/V of the accepted pairs, [1, kv_heads, n_pairs, head_dim] each (for tests and tools)."""
        if self.c_layer is not None:
            return self.c_layer.cache.rows(self.n_pairs)
        return self.k_cache, self.v_cache

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.embed_tokens(ids) if self.head.embed_tokens is not None else self.target.embed(ids)

    # ---- proposing ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, state) -> Tree:
        self._consume(state)
        if self.root_out is None:
            return root_only(state.root_token)
        head, dev = self.head, self.root_out.device
        logits = head.logits if self.c_layer is None else self.c_layer.logits
        root_lp = torch.log_softmax(logits(self.root_out.view(1, -1)).float(), dim=-1)[0]
        n = self.n_pairs
        tree_k, tree_v = [], []  # KV of every drafted frontier node this round (discarded afterwards)
        level_out = [self.root_out.view(1, -1)]
        tree_mask = [torch.zeros(1, 0, dtype=torch.bool, device=dev)]

        def child_fn(level: int, tokens: torch.Tensor, parent_slot: torch.Tensor) -> torch.Tensor:
            f = tokens.numel()
            parent_slot = parent_slot.to(dev)
            g = level_out[-1][parent_slot]
            emb = self.embed(tokens.to(dev)).to(g.dtype)
            tmask = next_tree_mask(tree_mask[-1], parent_slot)  # [f, drafted + f]
            mask = torch.zeros(f, n + tmask.shape[1], dtype=g.dtype, device=dev)
            mask[:, n:].masked_fill_(~tmask, torch.finfo(g.dtype).min)
            tree_mask.append(tmask)
            if self.c_layer is not None:  # the level's K/V after the accepted pairs and the levels before
                out = self.c_layer.forward(emb, g, n - 1 + level, n + tmask.shape[1] - f, mask)
                level_out.append(out)
                return torch.log_softmax(logits(out), dim=-1)
            g, emb = g.view(1, f, -1), emb.view(1, f, -1)
            pos = torch.full((1, f), n - 1 + level, device=dev, dtype=torch.long)
            pk = torch.cat([self.k_cache] + tree_k, dim=2)
            pv = torch.cat([self.v_cache] + tree_v, dim=2)
            out, k, v = head(emb, g, pos, pk, pv, mask.view(1, 1, f, -1))
            tree_k.append(k)
            tree_v.append(v)
            level_out.append(out[0])
            return torch.log_softmax(head.logits(out[0]).float(), dim=-1)

        # a budget-b tree is at most b deep (every node brings its ancestors): deeper levels are never kept
        levels = min(self.depth, max(0, self.budget - 1))
        # nor wider: a node outside its level's top b has b better nodes at that level, so neither it nor its
        # children make the top b; drafting only the top min(k, b) per level proposes the same tree
        # and a level whose frontier cannot place a descendant in the top b is not drafted (frontier_is_dead)
        cands = expand(root_lp, child_fn, levels, min(self.top_k, self.budget), self.d2t, self.stop_fn, self.budget)
        with state.section("tree"):
            tree = rerank(cands, state.root_token, self.budget)
        self.last_candidates = cands
        return tree

    # ---- training protocol ----------------------------------------------------------------------------------
    # a new head's keys, then every run's; budget / depth / top_k become the saved folder's drafter_defaults
    training_keys = (*NEW_HEAD_KEYS, "draft_vocab", "ttt_steps", "seed", "budget", "depth", "top_k")

    @classmethod
    def training_model(cls, target, cfg: dict, init: str | None = None) -> nn.Module:
        """A trainable head for ``target`` (plugs into graft_block.training.train).

        cfg: ``draft_vocab`` (sorted target ids, set by the shared loop's --draft-vocab) or ``token_counts``
        (tensor [V] / path) or ``data`` (cached data name: response-token counts) with ``draft_vocab_size``
        (default 4096); ``feature_layers`` (default [2, N//2, N-3]); ``ttt_steps`` (7); ``warm_layer``.
        ``init``: "target" (default: warm start from the target), "random", or a checkpoint folder to continue."""
        return training_head(target, cfg, init)

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
        if not defaults:  # continuing a checkpoint in place keeps its tree defaults
            from pathlib import Path

            old = Path(out_dir) / "config.json"
            defaults = json.loads(old.read_text()).get("drafter_defaults", {}) if old.exists() else {}
        extra = {"type": "eagle3", "drafter_defaults": defaults or {"budget": 15, "depth": 5, "top_k": 8}}
        save_head(model, out_dir, extra)
