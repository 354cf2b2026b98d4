"""The DSpark drafter: one backbone forward per round, then the Markov head walks the block.

Proposals (``proposal``):
  - ``chain``: draft j = argmax of softmax(U_j + W2 W1[draft j-1]) (draft -1 = the anchor), j < budget;
  - ``ddtree``: a best-first tree (``tree.ddtree.conditional_ddtree``) where each node's children come from its
    own corrected distribution softmax(U_d + W2 W1[node token]); in the Python walk products for a node and its
    likeliest later siblings run as one batch, and a (depth, parent token) pair is never computed twice a round.
    A gated head's latent also reads the depth's hidden row; an RNN head's reads a state kept per node, so its
    cache is by path. A vanilla head with a candidate cut and float32 CPU weights walks the same tree in C
    (``c_walk``).
Without a Markov head both reduce to DFlash's chain and DDTree over the same rows.

At T > 0 the draft scores use softmax(z / T) (the tree's order then tracks what the target will sample); the
walk stays the target's own choice at every node, so any tree is lossless. ``node_survival(tree)`` gives the
estimated probability that each node of the last proposed tree is accepted, from the calibrated confidence head
(``ConfidenceSchedule`` cuts trees with it; without the head, None and the schedule falls back to path scores).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from graft_block.drafter import is_count, register, reject_unknown_options, shared_checkpoint
from graft_block.engine import inference_linear
from graft_block.errors import ConfigError
from graft_block.tree import Tree, path_products
from graft_block.tree.ddtree import conditional_ddtree

from ..dflash.drafter import DFlashDrafter, random_init_block
from . import c_walk
from . import training as dspark_training
from .checkpoint import is_dspark_layout, load_checkpoint, new_dspark_model, save_checkpoint, warn_if_uncalibrated
from .model import DSparkModel


def candidate_split(z: torch.Tensor, C: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of backbone logits ``z`` [..., V]: the C likeliest columns' logits and indices [..., C] and the
    log-mass of the columns outside them [..., 1] (kept, uncorrected, in the children's normaliser)."""
    cand_z, cand_cols = z.topk(C, dim=-1)
    lse = torch.logsumexp(z, -1, keepdim=True)
    inside = torch.logsumexp(cand_z, -1, keepdim=True)
    return cand_z, cand_cols, lse + torch.log1p(-torch.exp(inside - lse).clamp(max=1.0 - 1e-7))


def candidate_logprobs(cand_z: torch.Tensor, bias: torch.Tensor, rest: torch.Tensor, temperature: float,
                       t: float) -> torch.Tensor:
    """Log-probs of a node's C candidate children: backbone logits ``cand_z`` plus the Markov ``bias`` (both at the
    sampling ``temperature``; 0 = greedy), normalised with the outside mass ``rest``. The candidates keep their
    share of the mass, and the checkpoint's draft temperature ``t`` at this depth reshapes it inside."""
    z = cand_z + (bias / temperature if temperature > 0 else bias)
    inside = torch.logsumexp(z, -1, keepdim=True)
    total = torch.logaddexp(inside, rest)
    if t == 1.0:
        return z - total
    return torch.log_softmax(z / t, -1) + (inside - total)


@register("dspark")
class DSparkDrafter(DFlashDrafter):
    """Config keys: ``checkpoint`` (a DSpark folder in any spelling), ``proposal`` ("chain" | "ddtree"),
    ``budget``, ``block_size`` (<= the checkpoint's), ``alignment`` (optional: must equal the checkpoint's),
    ``marginal_topk``, ``prefetch`` (later siblings whose children share a node's product), ``markov_candidates``
    (children ranked among the backbone's C likeliest tokens per depth, default 64; 0 = exact). Random-init keys (no
    checkpoint, for tests): ``num_layers``, ``target_layer_ids``, ``mask_token_id``, ``seed``, ``markov_rank``,
    ``markov_head_type``, ``confidence_head``, ``alignment``, ``markov_first_draft``."""

    def __init__(self, target, model: DSparkModel, proposal: str = "chain", budget: int | None = None,
                 block_size: int | None = None, marginal_topk: int = 8, prefetch: int = 3,
                 markov_candidates: int = 64, checkpoint: str | None = None):
        super().__init__(target, model, proposal=proposal, budget=budget, block_size=block_size,
                         marginal_topk=marginal_topk, checkpoint=checkpoint)
        if not is_count(prefetch):
            raise ConfigError(f"prefetch (later siblings whose children share a node's Markov product) must be an int "
                              f">= 0, got {prefetch!r}")
        self.prefetch = prefetch
        if not is_count(markov_candidates):
            raise ConfigError(f"markov_candidates must be an int >= 0 (0 = rank children over the whole draft "
                              f"vocabulary), got {markov_candidates!r}")
        self.markov_candidates = markov_candidates
        self._w1 = self._w2 = None
        head = model.markov_head
        self._latent_head = head if head is not None and head.kind != "vanilla" else None  # reads hidden states
        if head is not None:  # W1 and the draft-vocabulary rows of W2, gathered once
            w2 = head.markov_w2.weight
            self._w2 = (w2 if model.draft_vocab is None else w2[model.draft_vocab.to(w2.device)]).detach()
            self._w1 = head.markov_w1.weight.detach()
        # draft-vocabulary column -> target id as a list: a tree's few ids are mapped in Python, not by an index op
        self._vocab = None if model.draft_vocab is None else model.draft_vocab.tolist()
        self._w2_layouts: dict = {}  # W2's layout for the engine's kernel (a few parent rows per product)
        self._last: tuple[Tree, torch.Tensor | None] | None = None

    @classmethod
    def build(cls, cfg: dict, target=None) -> "DSparkDrafter":
        if target is None:
            raise ConfigError("the dspark drafter needs the target: Drafter.from_config(cfg, target=target)")
        cfg = dict(cfg)
        opts_keys = ("proposal", "budget", "block_size", "marginal_topk", "prefetch", "markov_candidates")
        opts = {k: cfg.pop(k) for k in opts_keys if k in cfg}
        want = cfg.pop("alignment", None)
        if cfg.pop("denoise_steps", 1) != 1:
            raise ConfigError("dspark drafts in one backbone pass: denoise_steps must be 1")
        ckpt = cfg.pop("checkpoint", None)
        if ckpt is not None:
            reject_unknown_options(cfg, ckpt, "dspark", (*opts_keys, "alignment", "checkpoint"))
            model = shared_checkpoint(target, "dspark", ckpt,
                                      lambda: load_checkpoint(ckpt, device=target.device, dtype=target.dtype))
            if want is not None and want != model.alignment:
                raise ConfigError(f"alignment {want!r} was asked for, but checkpoint {ckpt} was trained with "
                                  f"{model.alignment!r} rows: drop the option or use a matching checkpoint")
            warn_if_uncalibrated(ckpt)
            return cls(target, model, checkpoint=str(ckpt), **opts)
        init = {k: cfg.pop(k) for k in ("num_layers", "target_layer_ids", "mask_token_id", "seed", "num_features",
                                        "markov_rank", "markov_head_type", "confidence_head", "markov_first_draft")
                if k in cfg}
        if cfg:
            raise ConfigError(f"unknown dspark config keys {sorted(cfg)}")
        model = new_dspark_model(target, block_size=random_init_block(opts), alignment=want or "zlab", **init)
        return cls(target, model, **opts)

    @classmethod
    def claims(cls, config: dict) -> bool:
        return is_dspark_layout(config)

    # ---- drafting ---------------------------------------------------------------------------------------
    def _round_terms(self, hidden, base, temperature: float, budget: int) -> dict:
        """What every node's children read this round, computed once per block: ``k`` children per node; with
        ``restricted`` (C = ``markov_candidates`` > 0) each depth's C candidate logits ``cand_z`` (at the sampling
        temperature), columns ``cand_cols``, outside log-mass ``rest`` and W2 rows ``cand_w2``; the depths'
        ``ranking`` temperatures; ``plain_vals`` / ``plain_cols``, the top-k of the rows drafted without a bias
        (depth 1 only under ``plain_first``); the confidence head's h part ``conf_h`` and W1 weight ``conf_e``."""
        model = self.model
        k = k_all = min(budget if self.proposal == "ddtree" else 1, base.shape[-1])
        zb = base.float() / temperature if temperature > 0 else base.float()
        C = self.markov_candidates
        rt = {"restricted": self._w2 is not None and 0 < C < zb.shape[-1],
              "plain_first": self._w2 is not None and not model.markov_first_draft,  # depth 1: the backbone's row
              "ranking": model.ranking_temperatures(temperature)}  # the tree's ranking only: top-k orders stay
        if rt["restricted"]:  # per depth: the C candidate columns, their W2 rows and the log-mass outside them
            k = min(k, C)
            rt["cand_z"], rt["cand_cols"], rt["rest"] = candidate_split(zb, C)
            rt["cand_w2"] = self._w2[rt["cand_cols"]].float()  # [D, C, r]
        if self._w2 is None or rt["plain_first"]:  # no bias: every parent of a depth has that depth's children
            rows = zb[:1] if rt["plain_first"] else zb
            t_rows = rt["ranking"][: rows.shape[0]].to(rows).unsqueeze(-1)
            rt["plain_vals"], rt["plain_cols"] = torch.log_softmax(rows / t_rows, -1).topk(k_all, dim=-1)
        rt["conf_h"], rt["conf_e"] = model.confidence_terms(hidden) or (None, None)
        rt["k"] = k
        return rt

    def _walks_in_c(self, rt: dict) -> bool:
        """Whether this round's tree is walked in C (``c_walk``): not for a head whose latent reads hidden states,
        without a candidate cut, with W1 not float32 on the CPU (the walk reads it in place), without a compiler,
        or under ``GRAFT_BLOCK_C_WALK=0`` (to measure the Python walk)."""
        return (rt["restricted"] and self._latent_head is None and self._w1.device.type == "cpu"
                and self._w1.dtype == torch.float32 and os.environ.get("GRAFT_BLOCK_C_WALK", "1") != "0"
                and c_walk.available())

    def _c_walk(self, rt: dict, root_token: int, temperature: float, budget: int, depth: int):
        """The round's tree and acceptance estimates from ``c_walk`` (where ``_walks_in_c``)."""
        vocab = self.model.draft_vocab
        ids = rt["cand_cols"] if vocab is None else vocab[rt["cand_cols"]]
        plain = None
        if rt["plain_first"]:
            cols = rt["plain_cols"][0]
            plain = (cols if vocab is None else vocab[cols], rt["plain_vals"][0])
        conf = None
        if rt["conf_h"] is not None:
            conf = (rt["conf_h"], rt["conf_e"], self.model.confidence_temperatures)
        return c_walk.markov_tree(root_token, budget, depth, rt["k"], rt["cand_z"], ids, rt["rest"], rt["cand_w2"],
                                  self._w1, temperature, rt["ranking"], plain, conf)

    def _expander(self, hidden, base, temperature: float, rt: dict):
        """``expand(depth, prev tokens, prefix)`` for ``conditional_ddtree``, with a per-round cache by (depth, token),
        or by the node's path for an RNN head, whose state (kept per node) carries the path's earlier drafts.
        With ``markov_candidates`` C > 0 a node's children are ranked among the C likeliest backbone tokens of its
        depth: the Markov bias is computed on those C columns only (one [n, r] x [r, C] product), and the
        normaliser adds the backbone's mass outside them, uncorrected. Any tree is lossless, so the cut only
        changes which children are drafted (C = 0: the whole draft vocabulary, exact). ``rt``: ``_round_terms``."""
        model, dev = self.model, base.device
        k, restricted, plain_first, temps = rt["k"], rt["restricted"], rt["plain_first"], rt["ranking"].tolist()
        if restricted:
            cand_z, cand_cols, rest, cand_w2 = rt["cand_z"], rt["cand_cols"], rt["rest"], rt["cand_w2"]
        if "plain_vals" in rt:
            plain_vals, plain_cols = rt["plain_vals"], rt["plain_cols"]
        conf_h, conf_e = rt["conf_h"], rt["conf_e"]
        cache: dict = {}
        head = self._latent_head
        stateful = head is not None and head.stateful
        h_terms = None if head is None else head.hidden_terms(hidden)  # the h part of the head, once per row
        states: dict = {}  # RNN: a node's path -> the state its children's step reads

        def expand(depth: int, prevs: list[int], prefix: tuple):
            scope = prefix if stateful else depth  # a child's distribution reads its path, or only its depth
            todo = [t for t in dict.fromkeys(prevs[: 1 + self.prefetch]) if (scope, t) not in cache]
            if todo:
                prev = torch.tensor(todo, device=dev)
                emb = lat = None if self._w1 is None else F.embedding(prev, self._w1)
                if head is not None and (stateful or not (plain_first and depth == 1)):  # gated / RNN: the latent
                    # reads this depth's hidden row (and the path's state; an unbiased draft 0 still starts it)
                    parent = states[prefix].expand(len(todo), -1) if stateful and prefix else None
                    lat, new = head.latent(emb, h_terms[depth - 1], parent)
                    if new is not None:
                        states.update({prefix + (t,): new[i] for i, t in enumerate(todo)})
                if self._w2 is None or (plain_first and depth == 1):
                    vals = plain_vals[depth - 1].expand(len(todo), -1)
                    cols = plain_cols[depth - 1].expand(len(todo), -1)
                elif restricted:
                    d = depth - 1
                    z = candidate_logprobs(cand_z[d], lat.float() @ cand_w2[d].T, rest[d], temperature, temps[d])
                    vals, idx = z.topk(k, dim=-1)
                    cols = cand_cols[d][idx]
                else:  # base + W2 W1[prev] over the whole draft vocabulary, summed into the product's output
                    z = inference_linear(lat.to(self._w2.dtype), self._w2, None, model.kernel, self._w2_layouts)
                    z = z.add_(base[depth - 1]) if z.dtype == base.dtype else z + base[depth - 1]
                    z = z.float() / temperature if temperature > 0 else z.float()
                    lp = torch.log_softmax(z / temps[depth - 1], -1)
                    vals, cols = lp.topk(k, dim=-1)
                vals, cols = vals.tolist(), cols.tolist()
                ids = cols if self._vocab is None else [[self._vocab[c] for c in row] for row in cols]
                conf = None
                if conf_h is not None:
                    c = conf_h[depth - 1].expand(len(todo))
                    if conf_e is not None:
                        c = c + emb.float() @ conf_e  # a head on W1[prev] implies a Markov head: emb is set
                    conf = model.calibrated(c, depth - 1).tolist()
                for i, t in enumerate(todo):
                    cache[(scope, t)] = (ids[i], vals[i], None if conf is None else conf[i])
            return [cache[(scope, prevs[0])]]

        return expand

    @torch.inference_mode()
    def propose(self, state) -> Tree:
        budget, length = self.round_size(state)
        _, hidden, base = self.block_rows(state, rows=budget, length=length)  # no tree of this budget goes deeper
        temp = float(state.sampling.temperature) if state.sampling is not None else 0.0
        depth = base.shape[0] if self.proposal == "ddtree" else min(budget, base.shape[0])
        rt = self._round_terms(hidden, base, temp, budget)
        in_c = self._walks_in_c(rt)
        expand = None if in_c else self._expander(hidden, base, temp, rt)
        with state.section("tree"):
            if in_c:
                tree, accept = self._c_walk(rt, state.root_token, temp, budget, depth)
            else:
                tree, accept = conditional_ddtree(state.root_token, expand, budget, depth)
            survival = None
            if accept is not None:  # P(node accepted) = product of its path's conditional acceptances
                survival = torch.tensor(path_products(tree, accept), dtype=torch.float64)
        self._last = (tree, survival)
        return tree

    def node_survival(self, tree: Tree) -> torch.Tensor | None:
        """Estimated P(accepted) per node of ``tree`` if it is the tree this drafter last proposed and the model has
        a confidence head; None otherwise (a graft changed it, or no head)."""
        if self._last is None or self._last[0] is not tree:
            return None
        return self._last[1]

    def describe(self) -> dict:
        d = super().describe()
        d.pop("denoise_steps", None)
        m = self.model
        d.update({"markov_rank": m.markov_rank, "markov_head_type": m.markov_head_type,
                  "confidence_head": m.confidence_head is not None, "alignment": m.alignment})
        return d

    training_module = dspark_training
    training_keys = dspark_training.TRAIN_KEYS
    write_checkpoint = staticmethod(save_checkpoint)
