"""The DFlash drafter: one draft forward per round proposes a whole block, as a chain or a DDTree.

The block is ``[bonus, mask x (B-1)]`` embedded with the *target's* embedding table; draft row k (k >= 1) predicts
the token at position ``start + k`` (same-position, no shift) through the draft's final ``norm`` and the
*target's* LM head. The draft "KV cache" holds only context K/V (one entry per committed token whose target
features are known), so it is "cropped to start" by construction: block K/V are never stored.
``DFlashDrafter.block_hidden(state, block_ids)`` runs one block against that cache (MFD drafts through it).

Mask token for SmolLM2: the tokenizer has no mask token, so the default checkpoint uses id 16 ``<empty_output>``, a
StarCoder-era special token that never occurs in chat text: it is a real row of the embedding table (required: the
block embeds it), distinct from pad/BOS/EOS (``<|endoftext|>`` 0, ``<|im_start|>`` 1, ``<|im_end|>`` 2), and
frozen like every target embedding.
"""
from __future__ import annotations

import hashlib
from collections import deque

import torch

from graft_block.drafter import (Drafter, check_budget, is_count, register, reject_unknown_options,
                                 shared_checkpoint)
from graft_block.engine import drafter_kernel, keep_layout
from graft_block.errors import ConfigError
from graft_block.skinny import SkinnyWeight, draft_half
from graft_block.tree import Tree, chain
from graft_block.tree.ddtree import ddtree, topk_logprobs

from ..layers import use_kernel
from .c_block import CContext, c_layers_for
from .checkpoint import check_compatible, is_dflash_layout, load_checkpoint, new_model, save_checkpoint
from . import training as dflash_training
from .model import DFlashModel



def head_rows(target, draft_vocab: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """The target LM head's rows for a draft vocabulary (all rows for None), gathered once per target and shared
    by every drafter on that vocabulary, with one dict for their kernel layouts: each DFlash / DSpark / MFD method
    of a run kept its own gathered copy and layout before (2 x 38 MB each for SmolLM2 at 16k rows). Draft-vocabulary
    rows come from the engine's resident pack; without a draft vocabulary the head itself is read (and its fp16
    drafting pack made from it)."""
    lm = target.model.get_output_embeddings()
    w, b = lm.weight, getattr(lm, "bias", None)
    ids = None if draft_vocab is None else draft_vocab.to(w.device)
    key = (w.data_ptr(), w._version, None if ids is None else hashlib.sha1(ids.cpu().numpy().tobytes()).hexdigest(),
           draft_half())
    shared = target.__dict__.setdefault("_draft_head_rows", {})
    if key not in shared:
        if ids is not None:  # gathered once, not every round
            w, b = target.head_rows(ids)
        layouts = {}
        if "skinny" in (drafter_kernel(target) or "") and w.dtype == torch.float32 and w.device.type == "cpu" \
                and float(w.abs().max()) < 6e4:
            # the draft's few-row head products stream these rows every round: packed in bf16 (or fp16), half the
            # bytes (a draft's numbers need not be the target's: the verify keeps only what the target computes)
            keep_layout(layouts, w, "skinny", SkinnyWeight(w, half=draft_half() or "round"))
        shared[key] = (w, b, layouts)
    return shared[key]

def random_init_block(opts: dict) -> int:
    """The block a random-init drafter is built with: the asked int, else 16 ("budget" cuts it later)."""
    b = opts.get("block_size")
    return b if isinstance(b, int) and not isinstance(b, bool) else 16


@register("dflash")
class DFlashDrafter(Drafter):
    """Config keys: ``checkpoint`` (folder in z-lab format), ``proposal`` ("chain" | "ddtree"), ``budget``
    (non-root nodes; chain: at most B-1), ``block_size`` (<= the checkpoint's; ``"budget"``: only the rows a
    tree of that budget can reach, a cheaper draft; ``"adaptive"``: at most those, and ``ROWS_MARGIN`` levels
    below the deepest acceptance of the call's last ``ROWS_WINDOW`` rounds: the presets), ``denoise_steps`` (1 = one
    DFlash pass; >1 = commit-by-confidence refinement with diffusers' BlockRefinementScheduler), ``marginal_topk``
    (how many per-position candidates ``last_block_logprobs`` keeps). Random-init keys (no checkpoint, for tests):
    ``num_layers``, ``target_layer_ids``, ``mask_token_id``, ``seed``."""

    # "adaptive" rows: a 16-node tree here is accepted 5 deep at most, and its rows 8-16 cost 3-7% of a round
    # (the forward and the LM head per row) for no tau (paper suite: 1.94 at 6, 8 and 17 rows)
    ROWS_WINDOW, ROWS_MARGIN = 16, 3

    def __init__(self, target, model: DFlashModel, proposal: str = "chain", budget: int | None = None,
                 block_size: int | None = None, denoise_steps: int = 1, marginal_topk: int = 8,
                 checkpoint: str | None = None):
        if proposal not in ("chain", "ddtree"):
            raise ConfigError(f"proposal must be 'chain' or 'ddtree', got {proposal!r}")
        check_compatible(model, target)
        self.target, self.model, self.proposal = target, model.eval(), proposal
        use_kernel(model, drafter_kernel(target))  # drafting runs the target engine's product kernel
        self.offset = offset = getattr(model, "draft_offset", 1)  # the first drafting row (DSpark's may be row 0)
        self.adaptive_rows = block_size == "adaptive"
        self._accepted: deque = deque(maxlen=self.ROWS_WINDOW)  # this call's last acceptance depths
        if block_size in ("budget", "adaptive"):  # the rows a tree of this budget reaches; None budget: every row
            block_size = model.block_size if budget is None else \
                min(model.block_size, max(2, check_budget(budget) + offset))
        if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)):
            raise ConfigError(f"block_size must be an int, 'budget' or 'adaptive', got {block_size!r}")
        self.block_size = model.block_size if block_size is None else block_size
        if not 2 <= self.block_size <= model.block_size:
            raise ConfigError(f"block_size {block_size} must be in 2..{model.block_size} (the trained block size)")
        drafts = self.block_size - offset
        self.budget = check_budget(drafts if budget is None else budget)
        if proposal == "chain" and self.budget > drafts:
            raise ConfigError(f"a chain proposal has at most {drafts} nodes (the block's drafting rows), "
                              f"budget is {self.budget}; use proposal='ddtree' for larger budgets")
        # a bool is an int to isinstance: True would run as 1 step
        if not is_count(denoise_steps, 1):
            raise ConfigError(f"denoise_steps must be an int >= 1 (a number of passes, not true/false), "
                              f"got {denoise_steps!r}")
        self.denoise_steps = denoise_steps
        if not is_count(marginal_topk, 1):
            raise ConfigError(f"marginal_topk (candidates kept per block position; a tree takes at least its budget) "
                              f"must be an int >= 1, got {marginal_topk!r}")
        self.marginal_topk = marginal_topk
        self.checkpoint = checkpoint
        self.feature_layers = model.feature_layers
        self._lm_w, self._lm_b, self._lm_layouts = head_rows(target, model.draft_vocab)
        # the draft's context K/V: in the C layers' layout where the target runs them (one C call per draft
        # forward), else per-layer torch tensors for the torch forward
        layers = c_layers_for(model, target)
        self.c_context = None if layers is None else CContext(model, layers)
        self.reset_context()
        self.last_block_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, cfg: dict, target=None) -> "DFlashDrafter":
        if target is None:
            raise ConfigError("the dflash drafter needs the target: Drafter.from_config(cfg, target=target)")
        cfg = dict(cfg)
        keys = ("proposal", "budget", "block_size", "denoise_steps", "marginal_topk")
        opts = {k: cfg.pop(k) for k in keys if k in cfg}
        ckpt = cfg.pop("checkpoint", None)
        if ckpt is not None:
            # what else cfg holds is the folder's config.json (architectures, torch_dtype, ...), not drafter options
            reject_unknown_options(cfg, ckpt, "dflash", (*keys, "checkpoint"))
            model = shared_checkpoint(target, "dflash", ckpt,
                                      lambda: load_checkpoint(ckpt, device=target.device, dtype=target.dtype))
            return cls(target, model, checkpoint=str(ckpt), **opts)
        init = {k: cfg.pop(k) for k in ("num_layers", "target_layer_ids", "mask_token_id", "seed", "num_features")
                if k in cfg}
        if cfg:
            raise ConfigError(f"unknown dflash config keys {sorted(cfg)} (without 'checkpoint' only "
                              "num_layers/target_layer_ids/mask_token_id/seed/num_features and drafter options)")
        model = new_model(target, block_size=random_init_block(opts), **init)
        return cls(target, model, **opts)

    @classmethod
    def claims(cls, config: dict) -> bool:
        """An untouched z-lab DFlash folder (architectures DFlashDraftModel, dflash_config); MFD checkpoints share
        that layout but carry mfd_config and belong to the mfd drafter."""
        return is_dflash_layout(config) and "mfd_config" not in config

    # ---- context cache ----------------------------------------------------------------------------------
    def _extend(self, features: torch.Tensor | None, start: int) -> None:
        if features is None:
            raise ConfigError("the dflash drafter needs target features: the engine did not capture them "
                              f"(feature_layers {self.feature_layers})")
        if start != self.ctx_len:
            raise ConfigError(f"draft context holds {self.ctx_len} tokens but new features start at {start}")
        m = features.shape[0]
        if self.c_context is not None:
            self.c_context.append(self.c_context.fuse(features), start)
            self.ctx_len += m
            return
        ctx = self.model.fuse(features.unsqueeze(0))
        pos = torch.arange(start, start + m, device=ctx.device).view(1, -1)
        if not self.ctx_k:
            kv = self.model.context_kv(ctx, pos)
            self.ctx_k, self.ctx_v = [k for k, _ in kv], [v for _, v in kv]
        else:
            kv = self.model.context_kv(ctx, pos)
            self.ctx_k = [torch.cat([a, k], 2) for a, (k, _) in zip(self.ctx_k, kv)]
            self.ctx_v = [torch.cat([a, v], 2) for a, (_, v) in zip(self.ctx_v, kv)]
        self.ctx_len += m

    def reset_context(self) -> None:
        self.ctx_k: list[torch.Tensor] = []  # the torch forward's context K/V (the C layers keep theirs in
        self.ctx_v: list[torch.Tensor] = []  # c_context's cache; both hold ctx_len rows)
        self.ctx_len = 0

    def prefill(self, state) -> None:
        self.reset_context()
        self._accepted.clear()
        with torch.inference_mode():
            self._extend(state.new_features, state.new_features_start)

    def commit(self, state, verified) -> None:
        if self.adaptive_rows:
            self._accepted.append(verified.accepted)
        with torch.inference_mode():
            self._extend(state.new_features, state.new_features_start)

    # ---- drafting ---------------------------------------------------------------------------------------
    def block_hidden(self, state, block_ids: torch.Tensor, block_embeds: torch.Tensor | None = None,
                     positions: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """One draft forward of a block against the committed context -> normed hidden [R, H]."""
        start = state.cache_len
        if self.ctx_len != start:
            raise ConfigError(f"draft context ({self.ctx_len}) out of sync with the target cache ({start})")
        dev = self.target.device
        if block_embeds is None:
            block_embeds = self.target.embed(block_ids.to(dev))
        if positions is None:
            positions = torch.arange(start, start + block_embeds.shape[0], device=dev)
        if self.c_context is not None:
            return self.c_context.forward(block_embeds, positions, mask, start)
        return self.model(block_embeds, positions, list(zip(self.ctx_k, self.ctx_v)), mask)

    def round_size(self, state) -> tuple[int, int]:
        """(nodes, block length) of this round's draft: the configured budget and block, or less where a schedule
        sized the draft from its recent cuts (``state.draft_nodes``: n nodes reach no deeper than n rows, and rows a
        tree cannot reach are neither drafted nor headed) or the rows are adaptive (block_size "adaptive"). Both are
        functions of earlier rounds only, so decoding stays lossless."""
        budget, length = self.budget, self.block_size
        if state.draft_nodes is not None:
            budget = max(1, min(budget, int(state.draft_nodes)))
            length = min(length, budget + self.offset)
        if self.adaptive_rows and self._accepted:
            length = min(length, max(self._accepted) + self.ROWS_MARGIN + self.offset)
        return budget, max(2, length)

    def block_rows(self, state, rows: int | None = None,
                   length: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One draft forward of ``[root, mask x (B-1)]`` -> (block ids [B], hidden [L, H] and logits [min(L, rows),
        V'] of the L drafting rows: from row 1 in z-lab's alignment, from row 0 in DeepSpec's). ``rows``: the LM
        head runs on the first ``rows`` only (a tree of budget b reaches depth b at most; the head over the draft
        vocabulary is the largest product of a draft). ``length``: a shorter block than the drafter's (B)."""
        ids = torch.full((length or self.block_size,), self.model.mask_token_id, dtype=torch.long,
                         device=self.target.device)
        ids[0] = state.root_token
        hidden = self.block_hidden(state, ids)[self.offset:]
        return ids, hidden, self.model.logits(hidden[:rows], self._lm_w, self._lm_b, restricted=True,
                                              layouts=self._lm_layouts)

    def block_logits(self, state, rows: int | None = None, length: int | None = None) -> torch.Tensor:
        """Draft logits [B-1, V'] (V' = draft vocab or full) for rows 1..B-1, after ``denoise_steps`` passes;
        ``rows``: only the first ``rows`` of them (one pass: refinement redrafts every row); ``length``: the block
        length B when shorter than the drafter's."""
        ids, _, logits = self.block_rows(state, rows if self.denoise_steps == 1 else None, length)
        if self.denoise_steps > 1:
            logits = self._refine(state, ids, logits)
        return logits

    def _refine(self, state, ids, logits):
        """Commit-by-confidence refinement (diffusers' BlockRefinementScheduler, mask mode, greedy): each step
        fixes the most confident still-masked rows to their argmax and redrafts the block with them filled in.
        A row keeps the logits of the pass that committed it, so chain/DDTree read its committed token."""
        from diffusers import BlockRefinementScheduler

        L = ids.numel() - 1
        # threshold > 1: commit exactly the scheduler's even quota per step
        sched = BlockRefinementScheduler(block_length=L, num_inference_steps=self.denoise_steps, threshold=1.1)
        sched.set_timesteps(self.denoise_steps, block_length=L)
        cols = torch.full((1, L), -1, dtype=torch.long, device=logits.device)  # -1 = still masked (column space)
        out = logits.clone()
        for step in range(self.denoise_steps):
            cols = sched.step(logits.unsqueeze(0).float(), step, cols, mask_token_id=-1, temperature=0.0).prev_sample
            still = cols[0] < 0
            if step == self.denoise_steps - 1 or not bool(still.any()):
                break
            block = ids.clone()
            block[1:][~still] = self.model.to_vocab_ids(cols[0][~still])
            logits = self.model.logits(self.block_hidden(state, block)[1:], self._lm_w, self._lm_b, restricted=True,
                                       layouts=self._lm_layouts)
            out[still] = logits[still]
        return out

    @torch.inference_mode()
    def propose(self, state) -> Tree:
        budget, length = self.round_size(state)
        logits = self.block_logits(state, rows=budget, length=length)  # no chain or tree of this budget goes deeper
        k = max(self.marginal_topk, budget if self.proposal == "ddtree" else 1)
        cols, lps = topk_logprobs(logits, k)
        ids = self.model.to_vocab_ids(cols.to(self.target.device)).cpu()
        self.last_block_logprobs = (ids, lps)  # per-position marginals (top-k) for Graft-TAIL / chimeric analysis
        with state.section("tree"):
            if self.proposal == "chain":
                n = min(budget, ids.shape[0])
                return chain(state.root_token, ids[:n, 0], torch.cumsum(lps[:n, 0].double(), 0).float())
            return ddtree(state.root_token, ids[:, : min(budget, ids.shape[1])], lps[:, : min(budget, ids.shape[1])],
                          budget)

    def describe(self) -> dict:
        return {"type": self.type_name, "budget": self.budget, "proposal": self.proposal,
                "block_size": self.block_size, "adaptive_rows": self.adaptive_rows, "denoise_steps": self.denoise_steps,
                "checkpoint": self.checkpoint,
                "layers": self.model.config.num_hidden_layers, "target_layer_ids": self.model.target_layer_ids}

    # ---- training plug-in (graft_block.training) --------------------------------------------------------
    # a subclass with its own recipe (DSpark) swaps in its module and checkpoint writer
    training_module = dflash_training
    training_keys = dflash_training.TRAIN_KEYS  # graft_block.training refuses any other --config key
    write_checkpoint = staticmethod(save_checkpoint)

    @classmethod
    def training_model(cls, target, cfg: dict, init: str | None = None) -> DFlashModel:
        return cls.training_module.training_model(target, cfg, init)

    @classmethod
    def training_loss(cls, model, target, batch):
        return cls.training_module.training_loss(model, target, batch)

    @classmethod
    def save_trained(cls, model, out_dir, cfg: dict) -> None:
        cls.write_checkpoint(model, out_dir, extra={"type": cls.type_name})
