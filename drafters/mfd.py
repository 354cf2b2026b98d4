"""Multi-Future Drafting (MFD): a DFlash drafter with K learned mode embeddings, all K modes drafted in one forward,
proposals merged into a mixed DDTree (``tree.mixed``) ranked by best-mode log-probability.

Model (``MFDModel``, a ``DFlashModel`` subclass; nothing else is new):
  - ``mode_embed`` [K, H] is *added* to the block input embeddings (every block row by default, or only the MASK
    rows with ``mode_rows="mask"``): mode k's block is ``e([bonus, MASK...]) + m_k``;
  - ``mode_gate`` (Linear H -> 1, no bias; "K + 1 vectors" = K modes + 1 gate vector) scores each mode from its
    pooled final block state. It is a training-time mixture prior only; inference ignores it except for the
    ``mixture_gated`` ablation score;
  - one draft forward over K x B rows: mode-replicated block rows share the context K/V, get identical positions
    and a block-diagonal mask across modes (non-causal inside each block). With K = 1 no mask is passed, so K = 1
    with ``mode_embed = 0`` is bit-for-bit the DFlash drafter.
Checkpoint: the z-lab DFlash format (``drafters.dflash.save_checkpoint``) plus the tensors ``mode_embed`` and
``mode_gate.weight``; config.json adds ``"type": "mfd"`` and ``"mfd_config": {"num_modes", "score", "mode_rows"}``.

Training (the shared loop,
``python -m graft_block.drafters.train --type mfd --init drafters/checkpoints/dflash-smollm2``): the block recipe
(``dflash.training``: anchors, blocks, row weights, CE / soft CE / L1 rows), with every block replicated over the K
modes. Per block and mode the weighted block loss ``L_k = sum_i w_i l_{k,i}`` (l = the recipe's row loss); the
loss is
  - ``mixture`` (default): ``-log sum_k pi_k exp(-L_k)`` summed over blocks / sum of weights (EM-style: each mode
    is trained on the blocks it explains, in proportion to its posterior responsibility r_k); pi = softmax of the
    gate over modes (the gate reads detached states, so it cannot bend the drafter);
  - ``wta``: relaxed winner-take-all, (1 - eps) L_win + eps/(K-1) sum of the others, plus gate CE on the winner;
  plus ``balance`` x KL(mean_r || uniform), a load-balancing term against dead modes. Symmetry breaking: mode
vectors start as random orthogonal directions with norm ``mode_init_scale`` x ||e(MASK)||. With K = 1 the mode
vector is frozen at 0, so the K = 1 control is plain DFlash training with the same data, steps and loss.
Logged: per-mode win rate, pairwise argmax-block disagreement, responsibility entropy (per block) and usage
entropy (of the batch's mean responsibilities: log K when every mode is used, 0 on collapse), teacher-forced
accepted length of mode 0 and of the best mode per block (oracle), and mode 0's tau_exp.
"""
from __future__ import annotations

import functools
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from graft_block.drafter import (check_flag, check_number, is_count, read_weights, register, reject_unknown_options,
                                 resolve_checkpoint, shared_checkpoint)
from graft_block.errors import ConfigError
from graft_block.tree import Tree
from graft_block.tree.ddtree import topk_logprobs
from graft_block.tree.mixed import SCORES, conditional_mixed_ddtree, mixed_ddtree

from . import dflash as D
from .dspark.drafter import candidate_logprobs, candidate_split

MODE_ROWS = ("all", "mask")
MFD_TRAIN_DEFAULTS = {"num_modes": 4, "mode_rows": "all", "mode_init_scale": 0.5, "mix_loss": "mixture",
                      "wta_eps": 0.05, "balance": 0.05, "seed": 0, "freeze_backbone": False}
# every --config key an MFD run reads; others are refused by name (graft_block.training)
MFD_TRAIN_KEYS = tuple(dict.fromkeys((*D.TRAIN_KEYS, *MFD_TRAIN_DEFAULTS, "score")))


class MFDModel(D.DFlashModel):
    """DFlash + ``mode_embed`` [K, H] at the block input + a training-only ``mode_gate``."""

    def __init__(self, *args, num_modes: int = 4, mode_rows: str = "all", **kw):
        super().__init__(*args, **kw)
        if not isinstance(num_modes, int) or num_modes < 1:
            raise ConfigError(f"num_modes must be an int >= 1, got {num_modes!r}")
        if mode_rows not in MODE_ROWS:
            raise ConfigError(f"mode_rows must be one of {MODE_ROWS}, got {mode_rows!r}")
        H = self.config.hidden_size
        self.num_modes, self.mode_rows = num_modes, mode_rows
        self.mode_embed = nn.Parameter(torch.zeros(num_modes, H))
        self.mode_gate = nn.Linear(H, 1, bias=False)
        nn.init.zeros_(self.mode_gate.weight)

    @classmethod
    def from_dflash(cls, base: D.DFlashModel, num_modes: int = 4, mode_rows: str = "all") -> MFDModel:
        """Same weights as ``base``; zero mode vectors and gate (call ``break_symmetry`` before training K > 1)."""
        model = cls(base.config, base.block_size, base.target_layer_ids, base.mask_token_id, base.num_target_layers,
                    base.draft_vocab, num_modes=num_modes, mode_rows=mode_rows)
        missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
        if unexpected or set(missing) - {"mode_embed", "mode_gate.weight"}:
            raise ConfigError(f"cannot build MFD from this DFlash model: missing {missing}, unexpected {unexpected}")
        p = next(base.parameters())
        return model.to(device=p.device, dtype=p.dtype)

    @torch.no_grad()
    def break_symmetry(self, mask_embedding: torch.Tensor, scale: float = 0.5, seed: int = 0) -> None:
        """Mode vectors = random orthonormal directions x ``scale`` x ||e(MASK)|| (K = 1 stays at zero)."""
        K, H = self.mode_embed.shape
        if K == 1:
            self.mode_embed.zero_()
            return
        g = torch.Generator().manual_seed(seed)
        q, _ = torch.linalg.qr(torch.randn(H, K, generator=g, dtype=torch.float64))
        norm = float(mask_embedding.float().norm()) * scale
        self.mode_embed.copy_((q.T * norm).to(self.mode_embed))

    def mode_inputs(self, block_embeds: torch.Tensor, modes: int | None = None) -> torch.Tensor:
        """[.., B, H] block embeddings -> [.., K, B, H] with mode k's vector added (all rows, or rows 1.. only)."""
        K = self.num_modes if modes is None else modes
        m = self.mode_embed[:K].to(block_embeds.dtype)  # [K, H]
        B = block_embeds.shape[-2]
        rows = torch.ones(B, 1, dtype=block_embeds.dtype, device=block_embeds.device)
        if self.mode_rows == "mask":
            rows[0] = 0  # the bonus/anchor row keeps its clean embedding
        return block_embeds.unsqueeze(-3) + m.view(K, 1, -1) * rows  # [.., K, B, H]

    def gate_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[.., K, B, H] final block states -> [.., K] gate logits (mean-pooled over rows, detached: the gate is a
        training-time prior and must not shape the drafter)."""
        return self.mode_gate(hidden.detach().mean(-2).to(self.mode_gate.weight.dtype)).squeeze(-1)


def mode_block_mask(K: int, B: int, ctx_len: int, dtype, device) -> torch.Tensor | None:
    """Additive mask [K*B, ctx_len + K*B]: all context visible; block rows see their own mode's block only.
    None for K = 1 (DFlash's unmasked non-causal block, which keeps K = 1 bit-identical to DFlash)."""
    if K == 1:
        return None
    out = torch.zeros(K * B, ctx_len + K * B, dtype=dtype, device=device)
    out[:, ctx_len:] = _mode_blocks(K, B, dtype, str(device))  # every round: only the context width changes
    return out


@functools.lru_cache(maxsize=16)
def _mode_blocks(K: int, B: int, dtype, device: str) -> torch.Tensor:
    """The block columns of ``mode_block_mask``: additive [K*B, K*B], 0 within a mode, the dtype's min across
    (read only)."""
    blk = torch.arange(K, device=device).repeat_interleave(B)
    same = blk.view(-1, 1) == blk.view(1, -1)
    return torch.zeros(same.shape, dtype=dtype, device=device).masked_fill(~same, torch.finfo(dtype).min)


# ---- checkpoint IO -----------------------------------------------------------------------------------------
def mfd_config(model: MFDModel, score: str = "best_mode") -> dict:
    return {"num_modes": model.num_modes, "score": score, "mode_rows": model.mode_rows}


def save_checkpoint(model: MFDModel, folder, score: str = "best_mode", dtype=torch.float16, extra=None) -> Path:
    """z-lab DFlash format + ``mode_embed`` / ``mode_gate.weight``; config.json carries type "mfd" and K, score."""
    return D.save_checkpoint(model, folder, dtype=dtype,
                             extra={"type": "mfd", "mfd_config": mfd_config(model, score), **(extra or {})})


def load_checkpoint(folder, device=None, dtype=None) -> tuple[MFDModel, dict]:
    """An MFD checkpoint -> (model, mfd_config). A plain DFlash checkpoint loads as K = 1 with a zero mode vector."""
    folder = resolve_checkpoint(folder, "MFD")
    raw = D.read_config(folder)
    mcfg = dict(raw.get("mfd_config") or {})
    tensors = read_weights(folder, "MFD checkpoint")
    if "mode_embed" not in tensors:
        if raw.get("type") == "mfd" or "mfd_config" in raw:
            raise ConfigError(f"MFD checkpoint {folder} has no 'mode_embed' tensor: re-save it with drafters.mfd")
        base = D.load_checkpoint(folder, device=device, dtype=dtype)
        return MFDModel.from_dflash(base, num_modes=1), {"num_modes": 1, "score": "best_mode", "mode_rows": "all"}
    K = int(tensors["mode_embed"].shape[0])
    stray = sorted(set(mcfg) - {"num_modes", "score", "mode_rows"})
    if stray:  # a misspelt key would be ignored without a word
        raise ConfigError(f"{folder}: mfd_config keys {stray} are unknown; known: num_modes, score, mode_rows")
    if "num_modes" in mcfg and not is_count(mcfg["num_modes"], 1):
        raise ConfigError(f"{folder}: mfd_config.num_modes must be an integer >= 1, got {mcfg['num_modes']!r}")
    if mcfg.get("num_modes", K) != K:
        raise ConfigError(f"{folder}: mfd_config.num_modes {mcfg['num_modes']} != mode_embed rows {K}")
    vocab = tensors.pop("draft_vocab", None)
    base = D.model_from_config(raw, vocab)
    model = MFDModel(base.config, base.block_size, base.target_layer_ids, base.mask_token_id, base.num_target_layers,
                     vocab, num_modes=K, mode_rows=mcfg.get("mode_rows", "all"))
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    bad = [k for k in set(expected) & set(tensors) if tuple(expected[k].shape) != tuple(tensors[k].shape)]
    if missing or unexpected or bad:
        raise ConfigError(f"MFD checkpoint {folder} does not match its config.json: missing {missing[:8]}, "
                          f"unexpected {unexpected[:8]}, wrong shapes {bad[:8]}")
    model.load_state_dict(tensors, strict=True)
    dtype = dtype or tensors["fc.weight"].dtype
    mcfg.setdefault("num_modes", K)
    mcfg.setdefault("score", "best_mode")
    mcfg.setdefault("mode_rows", model.mode_rows)
    return model.to(device=device or "cpu", dtype=dtype), mcfg


# ---- the drafter -------------------------------------------------------------------------------------------
@register("mfd")
class MFDDrafter(D.DFlashDrafter):
    """Config keys: ``checkpoint`` (MFD or DFlash folder), ``budget``, ``score`` ("best_mode" | "mixture_uniform"
    | "mixture_gated"), ``use_modes`` (draft with the first n modes only; default all), ``block_size``,
    ``marginal_topk`` (per-mode candidates per position; the tree uses max(marginal_topk, budget)), ``markov`` (a
    DSpark checkpoint on the same backbone whose Markov head every mode shares: each node's children then come
    from softmax(U_{m,d} + W2 W1[node token]), ``tree.mixed.conditional_mixed_ddtree``; best_mode only),
    ``markov_candidates`` (children ranked among each mode's C likeliest backbone tokens per depth, default 64).
    Random-init keys (tests): ``num_modes``, ``mode_rows``, ``mode_init_scale``, plus DFlash's ``num_layers``,
    ``target_layer_ids``, ``mask_token_id``, ``seed``, ``num_features``."""

    def __init__(self, target, model: MFDModel, budget: int | None = None, block_size: int | None = None,
                 marginal_topk: int = 8, checkpoint: str | None = None, score: str = "best_mode",
                 use_modes: int | None = None, markov: str | None = None, markov_candidates: int = 64):
        if not isinstance(model, MFDModel):
            raise ConfigError("MFDDrafter needs an MFDModel (MFDModel.from_dflash(dflash_model, num_modes))")
        super().__init__(target, model, proposal="ddtree", budget=budget, block_size=block_size, denoise_steps=1,
                         marginal_topk=marginal_topk, checkpoint=checkpoint)
        if score not in SCORES:
            raise ConfigError(f"score must be one of {SCORES}, got {score!r}")
        use = model.num_modes if use_modes is None else use_modes
        if not isinstance(use, int) or not 1 <= use <= model.num_modes:
            raise ConfigError(f"use_modes must be an int in 1..{model.num_modes} (the checkpoint's modes), got {use!r}")
        self.proposal, self.score, self.use_modes = "mixed", score, use
        self.last_gate: torch.Tensor | None = None
        self.markov = None
        if markov is not None:
            self._share_markov(markov, markov_candidates)

    @classmethod
    def build(cls, cfg: dict, target=None) -> MFDDrafter:
        if target is None:
            raise ConfigError("the mfd drafter needs the target: Drafter.from_config(cfg, target=target)")
        cfg = dict(cfg)
        cfg.pop("mfd_config", None)
        keys = ("budget", "block_size", "marginal_topk", "score", "use_modes", "markov", "markov_candidates")
        opts = {k: cfg.pop(k) for k in keys if k in cfg}
        ckpt = cfg.pop("checkpoint", None)
        if ckpt is not None:
            reject_unknown_options(cfg, ckpt, "mfd", (*keys, "checkpoint"))
            model, mcfg = shared_checkpoint(target, "mfd", ckpt,
                                            lambda: load_checkpoint(ckpt, device=target.device, dtype=target.dtype))
            opts.setdefault("score", mcfg.get("score", "best_mode"))
            return cls(target, model, checkpoint=str(ckpt), **opts)
        mode_keys = {k: cfg.pop(k) for k in ("num_modes", "mode_rows") if k in cfg}
        scale = float(cfg.pop("mode_init_scale", 0.5))
        init = {k: cfg.pop(k) for k in ("num_layers", "target_layer_ids", "mask_token_id", "seed", "num_features")
                if k in cfg}
        if cfg:
            raise ConfigError(f"unknown mfd config keys {sorted(cfg)}")
        base = D.new_model(target, block_size=D.random_init_block(opts), **init)
        model = MFDModel.from_dflash(base, **mode_keys)
        with torch.no_grad():
            mask_e = target.embed(torch.tensor([model.mask_token_id], device=target.device))[0]
        model.break_symmetry(mask_e, scale, seed=int(init.get("seed", 0)))
        return cls(target, model, **opts)

    @classmethod
    def claims(cls, config: dict) -> bool:
        """This project's MFD checkpoints: the DFlash layout plus ``mfd_config`` (a plain DFlash folder is dflash's,
        although ``build`` also loads one as K = 1)."""
        return D.is_dflash_layout(config) and isinstance(config.get("mfd_config"), dict)

    # ---- a Markov head shared by the modes (DSpark + MFD) ---------------------------------------------------
    def _share_markov(self, folder, candidates) -> None:
        """Take the Markov head of the DSpark checkpoint ``folder``. It corrects the logits of the backbone it was
        trained on, so that backbone must be this one, tensor for tensor (the mode vectors aside)."""
        from .dspark.checkpoint import load_checkpoint as load_dspark
        from .dspark.checkpoint import warn_if_uncalibrated

        if not is_count(candidates, 1):
            raise ConfigError(f"markov_candidates must be an int >= 1 (children ranked among each mode's C likeliest "
                              f"backbone tokens per depth), got {candidates!r}")
        if self.score != "best_mode":
            raise ConfigError(f"a shared Markov head builds the best_mode tree only, not score={self.score!r}")
        # fresh copies from disk: a loaded model's layer weights may have moved into the C layers' packs
        dev, dt = self.target.device, self.target.dtype
        dm = load_dspark(resolve_checkpoint(folder, "markov"), device=dev, dtype=dt)
        warn_if_uncalibrated(folder)  # the shared head's draft temperatures rank every mode's children
        if dm.markov_head is None:
            raise ConfigError(f"markov: {folder} has no Markov head (markov_rank 0), so there is nothing to share")
        if dm.markov_head_type != "vanilla":
            raise ConfigError(f"markov: {folder} has a {dm.markov_head_type!r} Markov head, which reads DSpark's own "
                              "hidden rows; MFD shares vanilla heads only (a bias from the previous token alone)")
        if dm.draft_offset != getattr(self.model, "draft_offset", 1):
            raise ConfigError(f"markov: {folder} drafts from block row {dm.draft_offset} ({dm.alignment!r} alignment) "
                              f"but this MFD model from row {getattr(self.model, 'draft_offset', 1)}: their rows "
                              "predict different tokens")
        if self.block_size - self.offset > dm.num_drafts:  # its per-depth temperatures end at its own block
            raise ConfigError(f"markov: {folder} drafts {dm.num_drafts} rows (block_size {dm.block_size}) but this "
                              f"MFD drafter drafts {self.block_size - self.offset}: its head is calibrated for its "
                              f"own rows only; pass block_size <= {dm.block_size}")
        mine = (self.model if self.checkpoint is None else load_checkpoint(self.checkpoint, dev, dt)[0]).state_dict()
        theirs = dm.state_dict()
        for name, t in mine.items():
            if name in ("mode_embed", "mode_gate.weight"):
                continue
            if name not in theirs or theirs[name].shape != t.shape or not torch.equal(theirs[name].to(t), t):
                raise ConfigError(f"markov: {folder}'s backbone differs from this MFD checkpoint's at {name!r}; a "
                                  "Markov head corrects the logits of the backbone it was trained on: train one on "
                                  "this backbone (graft-block train --type dspark --init <this MFD's base>)")
        # draft_vocab is a non-persistent buffer, so the state-dict comparison above never saw it
        a, b = dm.draft_vocab, self.model.draft_vocab
        if (a is None) != (b is None) or (a is not None and not torch.equal(a.cpu(), b.cpu())):
            theirs, ours = ("the full vocabulary" if v is None else f"{v.numel()} ids" for v in (a, b))
            raise ConfigError(f"markov: draft vocabularies differ ({folder}: {theirs}, this MFD model: {ours}); "
                              "the Markov head's W2 rows are indexed by its own draft vocabulary: use a DSpark "
                              "checkpoint trained with this MFD's draft vocabulary")
        w2 = dm.markov_head.markov_w2.weight
        self._w2 = (w2 if dm.draft_vocab is None else w2[dm.draft_vocab.to(w2.device)]).detach().float()
        self._w1 = dm.markov_head.markov_w1.weight.detach().float()
        self._markov_first = dm.markov_first_draft
        # the head's calibration (DSpark's calibrate.py), for greedy and for sampling targets
        self._draft_temps = (dm.ranking_temperatures(0.0).tolist(), dm.ranking_temperatures(1.0).tolist())
        self.markov_candidates = candidates
        self.markov = str(folder)

    def _markov_expander(self, hidden: torch.Tensor, temperature: float, rows: int, budget: int):
        """``expand(mode, depth, token)`` for ``conditional_mixed_ddtree``: mode m's children at ``depth`` under a
        node of ``token``, ranked among the mode's C likeliest backbone tokens there (the mass outside them stays
        in the normaliser, uncorrected). LM-head rows are computed when a depth is first reached (``rows_to_head``)."""
        K = hidden.shape[0]
        k = max(self.marginal_topk, budget)
        got: dict[str, torch.Tensor] = {}
        cache: dict = {}
        temps = self._draft_temps[temperature > 0]

        def head(depth: int) -> None:
            done = 0 if not got else got["cand_z"].shape[1]
            if depth <= done:
                return
            upto = self.rows_to_head(done, depth, rows)
            z = self.row_logits(hidden, done, upto).float()  # [K, upto - done, V']
            z = z / temperature if temperature > 0 else z
            if not done:  # depth 1's children when the head skips the first draft: the backbone's row, tempered
                got["first"] = torch.log_softmax(z[:, 0] / temps[0], -1).topk(min(k, z.shape[-1]), dim=-1)
            parts = candidate_split(z, min(self.markov_candidates, z.shape[-1]))
            for key, v in zip(("cand_z", "cand_cols", "rest"), parts):
                got[key] = v if key not in got else torch.cat([got[key], v], 1)

        def expand(m: int, depth: int, token: int):
            key = (depth, token) if (depth > 1 or self._markov_first) else (depth,)
            if key not in cache:  # every mode's children under this (depth, token) in one product: modes share tokens
                head(depth)
                d = depth - 1
                if len(key) == 1:
                    vals, cols = got["first"]
                else:
                    cand = got["cand_cols"][:, d]  # [K, C]
                    z = candidate_logprobs(got["cand_z"][:, d], self._w2[cand] @ self._w1[token], got["rest"][:, d],
                                           temperature, temps[d])
                    vals, idx = z.topk(min(k, z.shape[-1]), dim=-1)
                    cols = cand.gather(1, idx)
                cache[key] = (self.model.to_vocab_ids(cols).tolist(), vals.tolist())
            ids, lps = cache[key]
            return ids[m], lps[m]

        return expand

    # ---- drafting ---------------------------------------------------------------------------------------
    def mode_hidden(self, state, modes: int | None = None, length: int | None = None) -> torch.Tensor:
        """One draft forward for ``modes`` modes (default ``use_modes``) -> normed block states [K, B, H];
        ``length``: a block B shorter than the drafter's."""
        K = self.use_modes if modes is None else modes
        B, dev = length or self.block_size, self.target.device
        ids = torch.full((B,), self.model.mask_token_id, dtype=torch.long, device=dev)
        ids[0] = state.root_token
        embeds = self.model.mode_inputs(self.target.embed(ids), K).reshape(K * B, -1)
        start = state.cache_len
        pos = torch.arange(start, start + B, device=dev).repeat(K)  # every mode at the same positions
        mask = mode_block_mask(K, B, self.ctx_len, embeds.dtype, dev)
        hidden = self.block_hidden(state, ids, block_embeds=embeds, positions=pos, mask=mask).view(K, B, -1)
        if self.score == "mixture_gated":  # the only tree score that reads the gate
            self.last_gate = torch.softmax(self.model.gate_logits(hidden).float(), -1)
        return hidden

    def mode_logits(self, state, modes: int | None = None, rows: int | None = None) -> torch.Tensor:
        """One draft forward -> logits [K, B-1, V'] (V' = draft vocab or full); ``rows``: the LM head on each
        mode's first ``rows`` drafting rows only."""
        return self.row_logits(self.mode_hidden(state, modes), 0, rows)

    def rows_to_head(self, done: int, need: int, rows: int) -> int:
        """How many of the ``rows`` drafting rows to have headed once a tree needs row ``need`` and ``done`` are:
        doubling from two, since most trees of a small budget stay shallow; all at once under adaptive rows, whose
        block recent rounds already sized (a second product re-reads the whole head)."""
        return rows if self.adaptive_rows else min(rows, max(need, 2 * done, 2))

    def row_logits(self, hidden: torch.Tensor, lo: int, hi: int | None) -> torch.Tensor:
        """The LM head on drafting rows lo..hi of every mode (row 0 = depth 1) -> [K, rows, V']."""
        return self.model.logits(hidden[:, 1:][:, lo:hi], self._lm_w, self._lm_b, restricted=True,  # pre-gathered
                                 layouts=self._lm_layouts)

    @torch.inference_mode()
    def propose(self, state) -> Tree:
        budget, length = self.round_size(state)
        hidden = self.mode_hidden(state, length=length)
        K, L = hidden.shape[0], min(budget, hidden.shape[1] - 1)  # no tree of this budget goes deeper than L
        if self.markov is not None:
            temp = float(state.sampling.temperature) if state.sampling is not None else 0.0
            expand = self._markov_expander(hidden, temp, L, budget)
            self.last_block_logprobs = None  # no per-mode marginals: each node has its own distribution
            with state.section("tree"):
                return conditional_mixed_ddtree(state.root_token, expand, budget, L, K)
        k = max(self.marginal_topk, budget)
        weights = self.last_gate.cpu() if self.score == "mixture_gated" else None
        # The LM head over the draft vocabulary is the largest product of a round, and most trees of a small budget
        # stay shallow: the rows are headed two, then doubling, at a time. A tree that does not reach the last
        # headed row is the tree all L rows give (``tree.mixed``: a row is read only under a node one level up),
        # given the same logits per row (a kernel chosen by row count may round a near-tie otherwise).
        id_parts, lp_parts, done, rows = [], [], 0, self.rows_to_head(0, 1, L)
        while True:
            cols, lps = topk_logprobs(self.row_logits(hidden, done, rows).reshape(K * (rows - done), -1), k)
            id_parts.append(self.model.to_vocab_ids(cols.to(self.target.device)).cpu().view(K, rows - done, -1))
            lp_parts.append(lps.view(K, rows - done, -1))
            ids, lps = torch.cat(id_parts, 1), torch.cat(lp_parts, 1)
            with state.section("tree"):
                tree = mixed_ddtree(state.root_token, ids, lps, budget, self.score, weights)
            if rows == L or int(tree.depths.max()) < rows:
                break
            done, rows = rows, self.rows_to_head(rows, rows + 1, L)
        self.last_block_logprobs = (ids, lps)  # per-mode top-k marginals [K, rows headed, k]
        return tree

    def describe(self) -> dict:
        d = super().describe()
        d.update({"num_modes": self.model.num_modes, "use_modes": self.use_modes, "score": self.score,
                  "mode_rows": self.model.mode_rows, "markov": self.markov})
        return d

    # ---- training plug-in (graft_block.training) --------------------------------------------------------
    training_keys = MFD_TRAIN_KEYS

    @classmethod
    def training_model(cls, target, cfg: dict, init: str | None = None) -> MFDModel:
        return training_model(target, cfg, init)

    @classmethod
    def training_loss(cls, model, target, batch):
        return training_loss(model, target, batch)

    @classmethod
    def save_trained(cls, model, out_dir, cfg: dict) -> None:
        save_checkpoint(model, out_dir, score=cfg.get("score", "best_mode"))


# ---- training ----------------------------------------------------------------------------------------------
def training_model(target, cfg: dict, init: str | None = None) -> MFDModel:
    """``init``: a DFlash checkpoint (the trained default: modes start from it), an MFD checkpoint (continue), or
    None/"random"/"target" (DFlash's fresh inits). DFlash's training options (num_anchors, gamma, soft_weight ...)
    apply unchanged; MFD adds ``MFD_TRAIN_DEFAULTS`` (``freeze_backbone``: train the mode embeddings only)."""
    opts = {**MFD_TRAIN_DEFAULTS, **{k: v for k, v in cfg.items() if k in MFD_TRAIN_DEFAULTS}}
    if opts["mix_loss"] not in ("mixture", "wta"):
        raise ConfigError(f"mix_loss must be 'mixture' or 'wta', got {opts['mix_loss']!r}")
    if cfg.get("score", "best_mode") not in SCORES:  # save_trained writes it: a typo would load nowhere
        raise ConfigError(f"score must be one of {SCORES}, got {cfg['score']!r}")
    for key, low, high in (("wta_eps", 0.0, 1.0), ("balance", 0.0, math.inf), ("mode_init_scale", 0.0, math.inf)):
        check_number(opts[key], key, low, high)  # wta_eps > 1 gave the winner a negative weight
    is_mfd = init not in (None, "random", "target") and D.read_config(init).get("type") == "mfd"
    if is_mfd:
        model, _ = load_checkpoint(init, device=target.device, dtype=torch.float32)
        D.training.check_continued(model, cfg, init, {"num_modes": lambda m: m.num_modes,
                                                      "mode_rows": lambda m: m.mode_rows},
                                   init_only=("init_layers", "passthrough", "mode_init_scale"))
        train_opts = None
    else:
        # the seed is also the backbone's: a new one draws its weights from it
        base = D.training_model(target, {k: v for k, v in cfg.items() if k not in MFD_TRAIN_DEFAULTS or k == "seed"},
                                init)
        train_opts = base.train_opts
        if not is_count(opts["num_modes"], 1):  # int() made true a K = 1 control
            raise ConfigError(f"num_modes must be an int >= 1, got {opts['num_modes']!r}")
        model = MFDModel.from_dflash(base, opts["num_modes"], opts["mode_rows"])
        with torch.no_grad():
            mask_e = target.embed(torch.tensor([model.mask_token_id], device=target.device))[0]
        model.break_symmetry(mask_e, float(opts["mode_init_scale"]), int(opts["seed"]))
    if train_opts is None:  # continuing an MFD checkpoint: DFlash's defaults for the block loss
        train_opts = D.block_loss_opts(cfg, model.block_size)
    D.check_compatible(model, target)
    model.mode_embed.requires_grad_(model.num_modes > 1)  # K = 1 control: exactly DFlash + the same extra training
    if check_flag(opts["freeze_backbone"], "freeze_backbone"):  # the modes only: their control is the backbone itself
        D.freeze_backbone(model, ("mode_embed", "mode_gate.") if model.num_modes > 1 else ())
    model.train_opts = {**train_opts, "mix_loss": opts["mix_loss"], "wta_eps": float(opts["wta_eps"]),
                        "balance": float(opts["balance"])}
    return model.to(target.device)


def training_loss(model: MFDModel, target, batch: dict):
    """Mixture (or relaxed-WTA) loss over whole blocks, K modes per anchor in one forward (see module doc); a
    block's loss under a mode is the block recipe's (``dflash.training.row_objective``) weighted row sum."""
    opts = model.train_opts
    K = model.num_modes
    blk = D.training_blocks(model, batch)
    valid, pos = blk["valid"], blk["pos"]  # [b, n, B-1], [b, n, B]
    b, n, B = pos.shape
    L = batch["ids"].shape[1]
    dev = pos.device
    # K replicas of every block (anchor-major): same anchor, same positions, own rows only.
    mask = D.block_attention_mask(blk["anchors"].repeat_interleave(K, dim=1), L, B, blk["dtype"])
    with torch.no_grad():
        emb = target.embed(blk["blk_ids"]).float()  # [b, n, B, H]
    rows = model.mode_inputs(emb).reshape(b, n * K * B, -1)
    hidden = model(rows, pos.repeat_interleave(K, dim=1).reshape(b, -1), blk["ctx_kv"], mask).view(b, n, K, B, -1)
    valid_k = valid.unsqueeze(2).expand(b, n, K, B - 1)
    h = hidden[:, :, :, 1:][valid_k]  # [N, H], rows ordered (b, n, K, i)
    logits = model.logits(h, *D.lm_head(target))
    lab = blk["labels"].unsqueeze(2).expand(b, n, K, B - 1)[valid_k]
    src = blk["src"].unsqueeze(2).expand(b, n, K, B - 1)[valid_k]
    objective = D.row_objective(model, logits, lab, batch, src, opts)
    w = D.row_weights(B - 1, opts["gamma"], dev).view(1, 1, 1, -1)
    dense = torch.zeros(b, n, K, B - 1, device=dev)
    dense[valid_k] = objective["loss"]
    block_nll = (dense * w).sum(-1)  # [b, n, K]: L_k of every block
    live = valid.any(-1)  # blocks with at least one label
    norm = (w.view(1, 1, -1) * valid).sum().clamp(min=1e-6)  # one weight set per block, as DFlash normalises
    log_pi = torch.log_softmax(model.gate_logits(hidden).float(), -1)  # [b, n, K]
    post = torch.log_softmax(log_pi - block_nll, -1)  # log responsibilities
    resp = post.exp()
    if opts["mix_loss"] == "mixture":
        per_block = -torch.logsumexp(log_pi - block_nll, -1)
        loss = per_block[live].sum() / norm
    else:  # relaxed WTA; the gate learns to predict the winner
        win = block_nll.argmin(-1)
        eps = opts["wta_eps"] if K > 1 else 0.0
        wts = torch.full_like(block_nll, eps / max(1, K - 1)).scatter(-1, win.unsqueeze(-1), 1 - eps)
        loss = (wts * block_nll).sum(-1)[live].sum() / norm
        loss = loss + F.cross_entropy(log_pi[live], win[live]) * 0.1
    if K > 1 and opts["balance"] > 0 and bool(live.any()):
        mean_r = resp[live].mean(0)
        loss = loss + opts["balance"] * (mean_r * (mean_r * K).clamp(min=1e-9).log()).sum()

    with torch.no_grad():
        pred = model.to_vocab_ids(logits.argmax(-1))
        correct = torch.zeros(b, n, K, B - 1, device=dev)
        correct[valid_k] = (pred == lab).float()
        accept = correct.cumprod(-1).sum(-1)  # [b, n, K] leading correct rows per block and mode
        argmax = torch.full((b, n, K, B - 1), -1, dtype=torch.long, device=dev)
        argmax[valid_k] = pred
        m = {"loss": float(loss), "block_nll": float(block_nll[live].min(-1).values.sum() / norm) if bool(live.any())
             else 0.0, "rows": int(lab.numel()), "blocks": int(live.sum())}
        if objective["accept"] is not None:  # mode 0's expected accepted length, read as DFlash's tau_exp
            soft = torch.zeros(b, n, K, B - 1, device=dev)
            soft[valid_k] = objective["accept"]
            exp_len = soft[:, :, 0].cumprod(-1).sum(-1)[blk["anchor_ok"]]
            m["tau_exp"] = 1.0 + (float(exp_len.mean()) if exp_len.numel() else 0.0)
        if bool(live.any()):
            acc = accept[live]
            m["accept_len"] = float(acc[:, 0].mean())  # mode 0 (== DFlash's metric for K = 1)
            m["accept_best"] = float(acc.max(-1).values.mean())  # oracle over modes
            m["tau_tf"] = 1.0 + m["accept_len"]
            wins = block_nll[live].argmin(-1)
            if K > 1:  # can the gate, which sees only the modes' own block states, pick the block's best mode?
                pick = log_pi[live].argmax(-1)
                m["gate_acc"] = float((pick == wins).float().mean())
                m["accept_gated"] = float(acc.gather(-1, pick.unsqueeze(-1)).mean())
            for j in range(K):
                m[f"win{j}"] = float((wins == j).float().mean())
            ent = -(resp[live] * post[live]).sum(-1).mean()
            m["resp_entropy"] = float(ent)
            usage = resp[live].mean(0)  # how much each mode is used over the batch: log K when all are, 0 on collapse
            m["usage_entropy"] = float(-(usage * usage.clamp(min=1e-12).log()).sum())
            if K > 1:
                am, vm = argmax[live], valid[live]  # [N, K, B-1], [N, B-1]
                dis = [float(((am[:, i] != am[:, j]) & vm).sum() / vm.sum().clamp(min=1))
                       for i in range(K) for j in range(i + 1, K)]
                m["disagree"] = sum(dis) / len(dis)
    return loss, m
