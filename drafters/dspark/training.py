"""DSpark training plug-in (graft_block.training): DeepSpec's recipe on the shared block machinery.

Blocks come from ``dflash.training.make_blocks`` (anchors packed into one masked forward per chunk, drawn without
replacement when ``unique_anchors``); the Markov head is teacher-forced on the true previous tokens. Loss per
drafting row j, weighted exp(-j/gamma) (j = 0 for the first draft):
    ce_weight * CE + l1_weight * L1(softmax(z_j), p_target) + confidence_weight * BCE(conf_j, 1 - TV_j)
(CE is hard, or mixed ``soft_weight`` with CE against the target's top-k as in our DFlash recipe)
with p_target the target's cached top-k distribution (renormalised; the L1 counts the draft's mass outside it) and
the confidence label 1 - TV(q, p) detached. Metrics: the teacher-forced greedy accepted length (tau_tf, exact for
the greedy chain because teacher forcing feeds the drafts themselves while they are right) and the expected
accepted length 1 + sum_k prod_{j<=k} (1 - TV_j) (tau_exp), both without decoding.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from graft_block.errors import ConfigError

from ..dflash import training as D
from ..dflash.checkpoint import check_compatible
from .checkpoint import load_checkpoint
from .model import DSparkModel, from_dflash

TRAIN_DEFAULTS = {"markov_rank": 64, "confidence_head": True, "ce_weight": 0.1, "l1_weight": 0.9,
                  "confidence_weight": 1.0, "soft_weight": 0.0, "gamma": 4.0, "num_anchors": 24,
                  "unique_anchors": True,
                  "anchor_chunk": 32, "eval_anchors": 64}


def training_model(target, cfg: dict, init: str | None = None) -> DSparkModel:
    """``init``: a DSpark folder (continue it), a DFlash folder or None/"random"/"target" (a DFlash backbone as
    ``dflash.training.training_model`` builds it, wrapped with new heads: W2 = 0, so step 0 drafts as the
    backbone does)."""
    opts = {**TRAIN_DEFAULTS, **{k: v for k, v in cfg.items() if k in TRAIN_DEFAULTS}}
    arch = None
    if init not in (None, "random", "target"):
        path = Path(init) / "config.json"
        if not path.exists():
            raise ConfigError(f"--init {init}: no config.json there (a DSpark or DFlash checkpoint folder)")
        arch = json.loads(path.read_text()).get("architectures") or []
    if arch and "DFlashDraftModel" not in arch:
        model = load_checkpoint(init, device=target.device, dtype=torch.float32)
        if model.draft_vocab is not None:
            cfg["draft_vocab"] = model.draft_vocab.cpu().tolist()  # a resume rebuilds this vocabulary
    else:
        base = D.training_model(target, cfg, init)
        model = from_dflash(base, markov_rank=int(opts["markov_rank"]), confidence_head=bool(opts["confidence_head"]),
                            alignment="zlab", seed=int(cfg.get("seed", 0)))
    check_compatible(model, target)
    model.train_opts = {**D.block_loss_opts(cfg, model.block_size), "gamma": float(opts["gamma"]),
                        "soft_weight": float(opts["soft_weight"]),
                        **{k: opts[k] for k in ("ce_weight", "l1_weight", "confidence_weight", "unique_anchors",
                                                "anchor_chunk", "eval_anchors")}}
    return model.to(target.device)


def target_l1(q: torch.Tensor, model, batch: dict, src: torch.Tensor) -> torch.Tensor:
    """L1 distance between draft probabilities q [N, V'] and the target's cached top-k distribution at data rows
    ``src`` [N] (``dflash.training.target_topk``): sum over the top-k of |q - p| plus the draft's mass elsewhere."""
    cols, p = D.target_topk(model, batch, src)
    qk = q.gather(1, cols) * (p > 0)
    return (qk - p).abs().sum(-1) + (1.0 - qk.sum(-1)).clamp(min=0.0)


def draft_rows(model: DSparkModel, target, batch: dict, blk: dict, chunk: int = 32) -> torch.Tensor:
    """Hidden states [b, n, L, H] of the drafting rows of ``blk`` (``make_blocks``), the anchors run ``chunk`` blocks
    per masked forward (exact: a block sees only its own rows and the context before its anchor)."""
    pos = blk["pos"]
    b, n, B = pos.shape
    L = batch["ids"].shape[1]
    with torch.no_grad():
        emb = target.embed(blk["blk_ids"].view(b, -1)).float().view(b, n, B, -1)
    hidden = []
    for c in range(0, n, max(1, chunk)):
        e = slice(c, min(n, c + max(1, chunk)))
        m = e.stop - e.start
        mask = D.block_attention_mask(blk["anchors"][:, e], L, B, blk["dtype"])
        h = model(emb[:, e].reshape(b, m * B, -1), pos[:, e].reshape(b, -1), blk["ctx_kv"], mask)
        hidden.append(h.view(b, m, B, -1)[:, :, model.draft_offset:])
    return torch.cat(hidden, 1)


def draft_logits(model: DSparkModel, target, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """Markov-corrected draft logits over the draft vocabulary: U(hidden) + W2 W1[prev] (teacher-forced prev)."""
    z = model.logits(hidden, *D.lm_head(target))
    return z if model.markov_head is None else z + model.markov_bias(prev, model.draft_vocab)


def training_loss(model: DSparkModel, target, batch: dict):
    if "top_ids" not in batch:
        raise ConfigError("DSpark's L1 and confidence losses need the target's top-k distributions in the data "
                          "cache (top_ids / top_logp): regenerate the cache with graft_block.drafters.train --generate")
    opts = model.train_opts
    # held-out metrics use the same anchors whatever the training count (comparable across anchor counts)
    blk = (D.make_blocks(model, batch) if model.training
           else D.make_blocks(model, batch, int(opts["eval_anchors"]), unique=True))
    valid, pos = blk["valid"], blk["pos"]
    b, n, _ = pos.shape
    Lr = valid.shape[-1]
    h = draft_rows(model, target, batch, blk, int(opts["anchor_chunk"]))[valid]
    prev, lab = blk["prev"][valid], blk["labels"][valid]
    z = draft_logits(model, target, h, prev)
    ce, hard = D.row_losses(model, z, lab, batch, blk["src"][valid], float(opts["soft_weight"]))
    q = torch.softmax(z.float(), -1)
    l1 = target_l1(q, model, batch, blk["src"][valid])
    accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()  # 1 - TV: the soft acceptance label
    j = torch.arange(Lr, device=pos.device, dtype=torch.float32)
    w = torch.exp(-j / float(opts["gamma"])).view(1, 1, -1).expand(b, n, -1)[valid]
    wsum = w.sum().clamp(min=1e-6)
    loss = float(opts["ce_weight"]) * (w * ce).sum() / wsum + float(opts["l1_weight"]) * (w * l1).sum() / wsum
    conf = model.confidence_logits(h, prev)
    metrics = {}
    if conf is not None:
        bce = torch.nn.functional.binary_cross_entropy_with_logits(conf, accept, reduction="none")
        loss = loss + float(opts["confidence_weight"]) * (w * bce).sum() / wsum
    with torch.no_grad():
        if conf is not None:
            metrics["conf_bce"] = float((w * bce).sum() / wsum)
            metrics["conf_abs_err"] = float((torch.sigmoid(conf) - accept).abs().mean()) if accept.numel() else 0.0
        pred = model.to_vocab_ids(z.argmax(-1))
        correct = torch.zeros((b, n, Lr), dtype=torch.float32, device=pos.device)
        correct[valid] = (pred == lab).float()
        soft = torch.zeros((b, n, Lr), dtype=torch.float32, device=pos.device)
        soft[valid] = accept
        ok = blk["anchor_ok"]
        lead = correct.cumprod(-1).sum(-1)[ok]
        exp_len = soft.cumprod(-1).sum(-1)[ok]
        metrics.update({
            "loss": float(loss), "hard_ce": float((w * hard).sum() / wsum), "l1": float((w * l1).sum() / wsum),
            "acc": float((pred == lab).float().mean()) if lab.numel() else 0.0,
            "acc_k1": float(correct[:, :, 0][valid[:, :, 0]].mean()) if bool(valid[:, :, 0].any()) else 0.0,
            "accept_len": float(lead.mean()) if lead.numel() else 0.0,
            "tau_tf": 1.0 + (float(lead.mean()) if lead.numel() else 0.0),
            "tau_exp": 1.0 + (float(exp_len.mean()) if exp_len.numel() else 0.0), "rows": int(lab.numel())})
    return loss, metrics
