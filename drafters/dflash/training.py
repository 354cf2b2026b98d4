"""The block-drafter recipe (graft_block.training plug-in): DFlash trains with it, DSpark and MFD build on it.

Blocks: ``num_anchors`` anchors per sequence (drawn without replacement when ``unique_anchors``), each a block
[anchor, mask x (B-1)] with context strictly before the anchor; every block of a sequence runs in one masked forward
(``anchor_chunk`` blocks at a time, exact). Loss per drafting row j (j = 0 for the first draft), weighted
exp(-j/gamma):
    ce_weight * CE + l1_weight * L1(softmax(z_j), p_target)
CE is hard CE mixed ``soft_weight`` with CE against the target's cached top-k; p_target is that top-k, renormalised.
Metrics, without decoding: the teacher-forced greedy accepted length (tau_tf = 1 + leading correct rows) and, with
the top-k cached, the expected accepted length tau_exp = 1 + sum_k prod_{j<=k} (1 - TV_j). Held-out evaluation
always uses ``eval_anchors`` unique anchors, so arms with different training anchors compare.
DSpark adds its Markov and confidence heads (``drafters/dspark/training.py``), MFD its K modes
(``drafters/mfd.py``): DSpark through ``recipe_loss``, MFD through ``training_blocks``, ``row_objective`` and
``row_weights``.
"""
from __future__ import annotations

import warnings
from typing import Sequence

import torch

from graft_block.drafter import check_flag, is_count
from graft_block.errors import ConfigError

from .checkpoint import check_compatible, config_int, load_checkpoint, new_model
from .model import DFlashModel, build_target_layer_ids

TRAIN_DEFAULTS = {"num_layers": 3, "block_size": 16, "target_layer_ids": None, "mask_token_id": None,
                  "init_layers": None, "passthrough": -1,
                  # the recipe (RECIPE_KEYS), shared by DFlash, DSpark and MFD. DFlash and MFD default to CE: DeepSpec's
                  # L1 weights (DSpark's defaults) won the held-out metrics but lost DDTree decoding at T 0 and T 1
                  # (docs/training.md#the-block-recipe)
                  "num_anchors": 32, "unique_anchors": False, "anchor_chunk": 32, "eval_anchors": 64,
                  # gamma 2, not the DFlash paper's 7: the first rows decide acceptance, and weighting them more won
                  # held-out and decoded tau (docs/training.md#the-first-row-is-dflashs-weak-spot-row-weights);
                  # None = the paper's value for the block size
                  "gamma": 2.0, "ce_weight": 1.0, "soft_weight": 0.5, "l1_weight": 0.0,
                  # refinement training: each training block fills a share U(0, fill_rate) of its mask rows with
                  # the true tokens (no loss on them), so a multi-step draft (denoise_steps > 1) has seen rows
                  # filled in (the training batch's tau_tf then counts a filled row as a miss; held-out evaluation
                  # fills none); 0 = DFlash's one-step recipe
                  "fill_rate": 0.0}
# every --config key a DFlash run reads ("seed" and "draft_vocab" the loop also sets); others are refused by name
TRAIN_KEYS = (*TRAIN_DEFAULTS, "seed", "draft_vocab")
RECIPE_KEYS = ("num_anchors", "unique_anchors", "anchor_chunk", "eval_anchors", "gamma", "ce_weight", "soft_weight",
               "l1_weight", "fill_rate")


@torch.no_grad()
def warm_start(model: DFlashModel, target, layers: Sequence[int], passthrough: int = -1) -> None:
    """Initialise draft layer i from target decoder layer ``layers[i]`` (same shapes), ``fc`` to pass one feature
    through unchanged (``passthrough`` indexes ``target_layer_ids``), ``hidden_norm`` to that first copied layer's
    input norm (so context K/V start as the target's own) and ``norm`` to the target's final norm.
    q_norm/k_norm (absent in Llama-style targets) start at the per-channel RMS of the target's q/k on a short text,
    so attention logits keep their scale."""
    base = target.model.get_decoder() if hasattr(target.model, "get_decoder") else target.model.model
    if len(layers) != len(model.layers):
        raise ConfigError(f"init_layers has {len(layers)} entries for {len(model.layers)} draft layers")
    ids = torch.arange(1, 65, device=target.device).view(1, -1) * 37 % max(2, target.vocab_size - 1) + 1
    hs = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    for dl, tl in zip(model.layers, layers):
        src = base.layers[int(tl)]
        sd = {k: v for k, v in src.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
        own = dl.state_dict()
        for k, v in sd.items():
            if k not in own:
                continue
            if own[k].shape != v.shape:
                raise ConfigError(f"cannot warm-start draft layer from target layer {tl}: {k} {tuple(v.shape)} "
                                  f"!= {tuple(own[k].shape)}")
            own[k].copy_(v)
        if not any(k.endswith("q_norm.weight") for k in sd):
            x = src.input_layernorm(hs[int(tl)][0, 1:])  # skip position 0 (a massive activation sits there)
            a = dl.self_attn
            q = a.q_proj(x).view(-1, a.head_dim)
            k = a.k_proj(x).view(-1, a.head_dim)
            a.q_norm.weight.copy_(q.pow(2).mean(0).sqrt())
            a.k_norm.weight.copy_(k.pow(2).mean(0).sqrt())
    H = model.config.hidden_size
    j = passthrough % len(model.target_layer_ids)
    model.fc.weight.zero_()
    model.fc.weight[:, j * H:(j + 1) * H] = torch.eye(H, dtype=model.fc.weight.dtype, device=model.fc.weight.device)
    model.hidden_norm.weight.copy_(base.layers[int(layers[0])].input_layernorm.weight)
    model.norm.weight.copy_(base.norm.weight)


ARCHITECTURE_KEYS = {"num_layers": lambda m: len(m.layers), "block_size": lambda m: m.block_size,
                     "target_layer_ids": lambda m: list(m.target_layer_ids), "mask_token_id": lambda m: m.mask_token_id}


def check_continued(model, cfg: dict, init: str, keys: dict | None = None, init_only=()) -> None:
    """A model continued from ``init`` keeps what that folder built: a config key (``ARCHITECTURE_KEYS`` plus
    ``keys``: name -> reader) asking for another value is a ConfigError, and an ``init_only`` key (one that shapes a
    new model's first weights) a warning that it is ignored, so neither trains on without a word."""
    for key, read in {**ARCHITECTURE_KEYS, **(keys or {})}.items():
        if key in cfg and cfg[key] != read(model):
            raise ConfigError(f"--init {init} has {key} {read(model)!r} and the config asks for {cfg[key]!r}: a "
                              "continued model keeps its architecture; drop the key, or start from 'target' or "
                              "'random'")
    ignored = sorted(k for k in init_only if k in cfg)
    if ignored:
        warnings.warn(f"--init {init}: {ignored} shape a new model's first weights and are ignored when continuing "
                      "a checkpoint", stacklevel=2)


def check_new_model_keys(opts: dict, target) -> None:
    """A new model's keys as written, or a ConfigError: int() took 16.7 for 16, [] fell back to the default layers,
    a negative layer counted from the end and passthrough wrapped around its features."""
    n = target.num_layers
    config_int(opts["num_layers"], "num_layers", "--config", 1)
    config_int(opts["block_size"], "block_size", "--config", 2)
    for key in ("target_layer_ids", "init_layers"):
        ids = opts[key]
        if ids is not None and (not isinstance(ids, list) or not ids or not all(is_count(i) and i < n for i in ids)):
            raise ConfigError(f"{key} must be a non-empty list of the target's decoder-layer ids (0..{n - 1}), or "
                              f"null for the default, got {ids!r}")
    if opts["mask_token_id"] is not None and not (is_count(opts["mask_token_id"])
                                                  and opts["mask_token_id"] < target.vocab_size):
        raise ConfigError(f"mask_token_id must be a token id in 0..{target.vocab_size - 1}, got "
                          f"{opts['mask_token_id']!r}")
    feats = 3 if opts["target_layer_ids"] is None else len(opts["target_layer_ids"])  # the default layers: 3
    p = opts["passthrough"]
    if isinstance(p, bool) or not isinstance(p, int) or not -feats <= p < feats:
        raise ConfigError(f"passthrough indexes target_layer_ids (-{feats}..{feats - 1}), got {p!r}")


def training_model(target, cfg: dict, init: str | None = None) -> DFlashModel:
    """``init``: None/"random", "target" (warm start from the target's last ``num_layers`` decoder layers, or
    ``cfg["init_layers"]``), or a DFlash checkpoint folder (continue training it). A new model's random weights
    come from ``cfg["seed"]`` (default 0)."""
    opts = {**TRAIN_DEFAULTS, **{k: v for k, v in cfg.items() if k in TRAIN_DEFAULTS}}
    vocab = cfg.get("draft_vocab")
    vocab = None if vocab is None else torch.as_tensor(vocab, dtype=torch.long).sort().values
    if init not in (None, "random", "target"):
        model = load_checkpoint(init, device=target.device, dtype=torch.float32)
        check_continued(model, cfg, init, init_only=("init_layers", "passthrough"))
        if model.draft_vocab is not None:  # a checkpoint's vocabulary only grows: its ids stay, cfg's are added
            own = model.draft_vocab.cpu()
            vocab = own if vocab is None else torch.unique(torch.cat([own, vocab]))
            cfg["draft_vocab"] = vocab.tolist()  # the run state keeps cfg: a resume rebuilds this vocabulary
    else:
        if init != "target" and any(k in cfg for k in ("init_layers", "passthrough")):
            warnings.warn("init_layers and passthrough copy the target's layers: they apply with --init target only",
                          stacklevel=2)
        check_new_model_keys(opts, target)
        ids = opts["target_layer_ids"] if opts["target_layer_ids"] is not None else \
            build_target_layer_ids(target.num_layers, 3)
        mask = opts["mask_token_id"] if opts["mask_token_id"] is not None else target.vocab_size - 1
        model = new_model(target, opts["num_layers"], opts["block_size"], ids, mask, draft_vocab=vocab,
                          seed=int(cfg.get("seed", 0)))  # the run's seed (graft_block.training.init_seed_of)
        model = model.float()
        if init == "target":
            n = opts["num_layers"]
            layers = opts["init_layers"] or list(range(target.num_layers - n, target.num_layers))
            warm_start(model, target, layers, opts["passthrough"])
    model.draft_vocab = None if vocab is None else vocab.to(target.device)
    check_compatible(model, target)
    model.train_opts = block_loss_opts(cfg, model.block_size)
    return model.to(target.device)


def freeze_backbone(model, trainable: tuple[str, ...]) -> None:
    """Train only the parameters named ``trainable*`` (what a drafter adds to its DFlash backbone: DSpark's heads,
    MFD's mode embeddings); the backbone stays bit for bit, so it is the run's control."""
    if not any(n.startswith(trainable) for n, _ in model.named_parameters()):
        raise ConfigError("freeze_backbone leaves nothing to train: this model adds no parameters to its backbone "
                          "(DSpark without heads, MFD with K = 1): the backbone itself is that control")
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith(trainable))


def block_loss_opts(cfg: dict, block_size: int, defaults: dict | None = None) -> dict:
    """The recipe's options (``RECIPE_KEYS``) from ``cfg`` over a drafter's ``defaults`` over ``TRAIN_DEFAULTS``;
    gamma None takes the DFlash paper's value for the block size."""
    base = {**TRAIN_DEFAULTS, **(defaults or {})}
    opts = {k: cfg.get(k, base[k]) for k in RECIPE_KEYS}
    for k in ("num_anchors", "anchor_chunk", "eval_anchors"):
        if not isinstance(opts[k], int) or isinstance(opts[k], bool) or opts[k] < 1:
            raise ConfigError(f"{k} must be a positive integer, got {opts[k]!r}")
    for k in ("ce_weight", "soft_weight", "l1_weight"):
        if not isinstance(opts[k], (int, float)) or opts[k] < 0:
            raise ConfigError(f"{k} must be a number >= 0, got {opts[k]!r}")
    fill = opts["fill_rate"]
    if not isinstance(fill, (int, float)) or isinstance(fill, bool) or not 0 <= fill <= 1:
        raise ConfigError(f"fill_rate must be a number in [0, 1] (the largest share of a block's rows filled with "
                          f"their true tokens), got {fill!r}")
    if opts["ce_weight"] == 0 and opts["l1_weight"] == 0:
        raise ConfigError("ce_weight and l1_weight are both 0: the block loss would be zero (set one of them > 0)")
    gamma = opts["gamma"]
    if gamma is None:
        gamma = {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, block_size / 2.3)
    elif not isinstance(gamma, (int, float)) or isinstance(gamma, bool) or gamma <= 0:
        raise ConfigError(f"gamma must be a number > 0 (row j weighs exp(-j/gamma)) or null for the DFlash paper's "
                          f"value, got {gamma!r}")
    return {**opts, "gamma": float(gamma), "soft_weight": float(opts["soft_weight"]),
            "ce_weight": float(opts["ce_weight"]), "l1_weight": float(opts["l1_weight"]),
            "unique_anchors": check_flag(opts["unique_anchors"], "unique_anchors")}


def block_attention_mask(anchors: torch.Tensor, ctx_len: int, B: int, dtype) -> torch.Tensor:
    """anchors [b, n] -> additive mask [b, 1, n*B, ctx_len + n*B]: a block row sees context positions strictly
    before its anchor and every row of its own block (bidirectional), nothing of other blocks."""
    b, n = anchors.shape
    dev = anchors.device
    row_anchor = anchors.repeat_interleave(B, dim=1)  # [b, R]
    ctx_ok = torch.arange(ctx_len, device=dev).view(1, 1, -1) < row_anchor.unsqueeze(-1)
    blk = torch.arange(n, device=dev).repeat_interleave(B)
    blk_ok = (blk.view(-1, 1) == blk.view(1, -1)).unsqueeze(0).expand(b, -1, -1)
    ok = torch.cat([ctx_ok, blk_ok], dim=-1)
    return torch.zeros(ok.shape, dtype=dtype, device=dev).masked_fill(~ok, torch.finfo(dtype).min).unsqueeze(1)


def sample_anchors(prompt_len: torch.Tensor, lengths: torch.Tensor, n: int, generator=None, unique: bool = False):
    """n anchors per sequence over response positions a with a + 1 still in the sequence (the anchor and its next
    token are both response tokens). ``unique``: drawn without replacement (DeepSpec's packing; a sequence with
    fewer valid positions gets them all and the rest of its n are marked invalid; n shrinks to the batch's
    longest span), else uniform with replacement. Returns (anchors [b, n], ok [b, n])."""
    lo = prompt_len
    hi = lengths - 2
    span = (hi - lo + 1).clamp(min=1)
    b = lo.numel()
    if not unique:
        u = torch.rand((b, n), generator=generator)
        anchors = lo.view(-1, 1) + (u * span.view(-1, 1)).long()
        return anchors, (hi >= lo).view(-1, 1).expand(b, n)
    n = min(n, int(span.max()))  # no block row is spent on an anchor that no sequence of the batch can fill
    width = int(span.max())
    u = torch.rand((b, width), generator=generator)
    inside = torch.arange(width).view(1, -1) < span.view(-1, 1)
    order = u.masked_fill(~inside, 2.0).argsort(dim=1)[:, :n]  # a random subset of the valid offsets first
    ok = (torch.arange(n).view(1, -1) < span.view(-1, 1)) & (hi >= lo).view(-1, 1)
    anchors = (lo.view(-1, 1) + order.masked_fill(~ok, 0)).sort(dim=1)
    return anchors.values, ok.gather(1, anchors.indices)


def make_blocks(model: DFlashModel, batch: dict, num_anchors: int | None = None, unique: bool | None = None) -> dict:
    """The training blocks of one batch (shared with MFD and DSpark): ``num_anchors`` anchors per sequence, each a
    block [anchor token, mask x (B-1)] at positions anchor..anchor+B-1. Its drafting rows (from ``draft_offset``:
    1 for z-lab's alignment, 0 for DeepSpec's) are labelled with the target's tokens at anchor+1, anchor+2, ...
    Returns anchors / anchor_ok [b, n], seq_ok [b], pos [b, n, B], blk_ids [b, n, B], valid / labels [b, n, L]
    (L drafting rows), src [b, n, L] (flat row of the target's top-k distribution for that label), prev [b, n, L]
    (each label's previous token: teacher forcing for a Markov head), draft_index [b, n, L] (j) and ctx_kv.
    ``num_anchors`` / ``unique`` override the model's training options (a fixed held-out evaluation whatever the
    training count)."""
    ids, lengths, plen = batch["ids"], batch["lengths"], batch["prompt_len"]
    dev = model.fc.weight.device
    b, L = ids.shape
    B = model.block_size
    off = getattr(model, "draft_offset", 1)
    unique = bool(model.train_opts.get("unique_anchors", False)) if unique is None else unique
    anchors, ok = sample_anchors(plen.cpu(), lengths.cpu(), num_anchors or model.train_opts["num_anchors"],
                                 batch.get("generator"), unique=unique)
    anchors, ok = anchors.to(dev), ok.to(dev)
    n = anchors.shape[1]
    pos = anchors.unsqueeze(-1) + torch.arange(B, device=dev)  # [b, n, B]
    blk_ids = torch.full((b, n, B), model.mask_token_id, dtype=torch.long, device=dev)
    blk_ids[:, :, 0] = ids.gather(1, anchors)
    lab_pos = anchors.unsqueeze(-1) + torch.arange(1, B - off + 1, device=dev)  # draft j predicts anchor + j + 1
    valid = (lab_pos < lengths.view(-1, 1, 1)) & ok.unsqueeze(-1)
    # labels[t] = the target's token at t (== ids for target-generated data; the target's argmax for offline text)
    tokens = batch.get("labels", ids)
    labels = tokens.gather(1, lab_pos.clamp(max=L - 1).view(b, -1)).view(b, n, -1)
    prev = tokens.gather(1, (lab_pos - 1).clamp(max=L - 1).view(b, -1)).view(b, n, -1)
    prev[:, :, 0] = blk_ids[:, :, 0]  # the first draft's previous token is the anchor itself
    # the distribution of token anchor+k sits at data row anchor+k-1
    src = torch.arange(b, device=dev).view(b, 1, 1) * L + (lab_pos - 1).clamp(max=L - 1)
    ctx = model.fuse(batch["feats"])
    ctx_kv = model.context_kv(ctx, torch.arange(L, device=dev).expand(b, L))
    draft_index = torch.arange(labels.shape[-1], device=dev).expand_as(labels)  # draft j of each label row
    fill = float(model.train_opts.get("fill_rate", 0.0)) if model.training else 0.0
    if fill > 0:
        if off != 1:
            raise ConfigError("fill_rate trains z-lab's alignment (draft j at block position j + 1); this model "
                              "drafts from the anchor's row (DeepSpec's): set fill_rate 0")
        share = torch.rand((b, n, 1), generator=batch.get("generator")) * fill  # drawn on the CPU, as the anchors
        filled = (torch.rand(tuple(valid.shape), generator=batch.get("generator")) < share).to(dev) & valid
        blk_ids[:, :, 1:][filled] = labels[filled]  # a filled row is given, not drafted: no loss on it
        valid = valid & ~filled
    return {"anchors": anchors, "anchor_ok": ok, "seq_ok": ok.any(1), "pos": pos, "blk_ids": blk_ids,
            "valid": valid, "labels": labels, "src": src, "prev": prev, "draft_index": draft_index, "ctx_kv": ctx_kv,
            "dtype": ctx.dtype}


def vocab_columns(model: DFlashModel, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target token ids -> (the draft's logit columns, whether each id is in the draft vocabulary); an id outside it
    gets a valid column that its mask zeroes."""
    dv = model.draft_vocab
    if dv is None:
        return ids, torch.ones_like(ids, dtype=torch.bool)
    col = torch.searchsorted(dv, ids).clamp(max=dv.numel() - 1)
    return col, dv[col] == ids


def row_losses(model: DFlashModel, logits: torch.Tensor, lab: torch.Tensor, batch: dict, src: torch.Tensor,
               soft_w: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss for draft rows with labels ``lab`` [N]: hard CE mixed ``soft_w`` with soft CE against the
    target's top-k distribution at flat data row ``src`` [N]. Returns (loss rows, hard CE rows)."""
    logp = torch.log_softmax(logits.float(), -1)
    col, in_vocab = vocab_columns(model, lab)
    hard = -logp.gather(1, col.view(-1, 1)).squeeze(1) * in_vocab
    if soft_w <= 0 or "top_ids" not in batch:
        return hard, hard
    tcol, p = target_topk(model, batch, src)
    soft = -(p * logp.gather(1, tcol)).sum(-1)
    return (1 - soft_w) * hard + soft_w * soft, hard


def target_topk(model: DFlashModel, batch: dict, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's cached top-k distribution at flat data rows ``src`` [N], in the draft's logit columns:
    (columns [N, k], probabilities [N, k]); ids outside the draft vocabulary get probability 0 and the rest are
    renormalised."""
    k = batch["top_ids"].shape[-1]
    tid = batch["top_ids"].reshape(-1, k)[src]
    tlp = batch["top_logp"].reshape(-1, k)[src].float()
    tcol, tin = vocab_columns(model, tid)
    return tcol, torch.softmax(tlp.masked_fill(~tin, float("-inf")), -1).nan_to_num(0.0)


def lm_head(target) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's LM head weight and bias in fp32 (frozen; draft logits go through it)."""
    lm = target.model.get_output_embeddings()
    return lm.weight.float(), None if getattr(lm, "bias", None) is None else lm.bias.float()


def target_l1(q: torch.Tensor, model, batch: dict, src: torch.Tensor, with_overlap: bool = False):
    """L1 distance between draft probabilities q [N, V'] and the target's cached top-k distribution at data rows
    ``src`` [N] (``target_topk``): sum over the top-k of |q - p| plus the draft's mass elsewhere. ``with_overlap``:
    also sum_v min(q, p), the acceptance probability (1 - TV while p has mass in the draft vocabulary, 0 where it
    has none)."""
    cols, p = target_topk(model, batch, src)
    qk = q.gather(1, cols) * (p > 0)
    l1 = (qk - p).abs().sum(-1) + (1.0 - qk.sum(-1)).clamp(min=0.0)
    return (l1, torch.minimum(qk, p).sum(-1)) if with_overlap else l1


def training_blocks(model, batch: dict) -> dict:
    """``make_blocks`` with the training anchors, or, for held-out evaluation (model in eval mode), with
    ``eval_anchors`` unique anchors whatever the training count."""
    if model.training:
        return make_blocks(model, batch)
    return make_blocks(model, batch, int(model.train_opts["eval_anchors"]), unique=True)


def draft_rows(model, target, batch: dict, blk: dict, chunk: int = 32) -> torch.Tensor:
    """Hidden states [b, n, L, H] of the drafting rows of ``blk`` (``make_blocks``), the anchors run ``chunk`` blocks
    per masked forward (exact: a block sees only its own rows and the context before its anchor)."""
    pos = blk["pos"]
    b, n, B = pos.shape
    L = batch["ids"].shape[1]
    off = getattr(model, "draft_offset", 1)
    with torch.no_grad():
        emb = target.embed(blk["blk_ids"].view(b, -1)).float().view(b, n, B, -1)
    hidden = []
    for c in range(0, n, max(1, chunk)):
        e = slice(c, min(n, c + max(1, chunk)))
        m = e.stop - e.start
        mask = block_attention_mask(blk["anchors"][:, e], L, B, blk["dtype"])
        h = model(emb[:, e].reshape(b, m * B, -1), pos[:, e].reshape(b, -1), blk["ctx_kv"], mask)
        hidden.append(h.view(b, m, B, -1)[:, :, off:])
    return torch.cat(hidden, 1)


def row_objective(model, logits: torch.Tensor, lab: torch.Tensor, batch: dict, src: torch.Tensor,
                  opts: dict) -> dict:
    """The recipe's per-row loss for draft logits [N, V'] with labels ``lab`` [N]: ce_weight * CE (mixed
    ``soft_weight`` with soft CE) + l1_weight * L1 to the target's top-k. Returns loss, hard (CE rows), l1 and
    accept (sum_v min(q, p) = 1 - TV, detached) rows; l1 and accept are None without a cached top-k."""
    ce, hard = row_losses(model, logits, lab, batch, src, opts["soft_weight"])
    loss = opts["ce_weight"] * ce
    l1 = accept = None
    if "top_ids" in batch:
        l1, overlap = target_l1(torch.softmax(logits.float(), -1), model, batch, src, with_overlap=True)
        accept = overlap.clamp(0.0, 1.0).detach()
        loss = loss + opts["l1_weight"] * l1
    elif opts["l1_weight"] > 0:
        raise ConfigError("l1_weight > 0 needs the target's top-k distributions in the data cache (top_ids / "
                          "top_logp): regenerate the cache with graft_block.drafters.train --generate")
    return {"loss": loss, "hard": hard, "l1": l1, "accept": accept}


def row_weights(rows: int, gamma: float, device) -> torch.Tensor:
    """exp(-j/gamma) for drafting rows j = 0..rows-1 (the first draft weighs most)."""
    return torch.exp(-torch.arange(rows, device=device, dtype=torch.float32) / gamma)


@torch.no_grad()
def block_metrics(hit: torch.Tensor, valid: torch.Tensor, anchor_ok: torch.Tensor,
                  accept: torch.Tensor | None) -> dict:
    """Teacher-forced greedy accepted length (tau_tf: exact for the greedy chain, since teacher forcing feeds the
    drafts themselves while they are right), per-row accuracies and, given 1 - TV rows, the expected accepted
    length tau_exp; ``hit`` [N] (each flat row's argmax is its label), placed by ``valid`` [b, n, L]."""
    b, n, Lr = valid.shape
    correct = torch.zeros((b, n, Lr), dtype=torch.float32, device=valid.device)
    correct[valid] = hit.float()
    lead = correct.cumprod(-1).sum(-1)[anchor_ok]
    m = {"acc": float(hit.float().mean()) if hit.numel() else 0.0,
         "acc_k1": float(correct[:, :, 0][valid[:, :, 0]].mean()) if bool(valid[:, :, 0].any()) else 0.0,
         "accept_len": float(lead.mean()) if lead.numel() else 0.0, "rows": int(hit.numel()),
         "blocks": int(lead.numel())}
    m["tau_tf"] = 1.0 + m["accept_len"]
    if accept is not None:
        soft = torch.zeros((b, n, Lr), dtype=torch.float32, device=valid.device)
        soft[valid] = accept
        exp_len = soft.cumprod(-1).sum(-1)[anchor_ok]
        m["tau_exp"] = 1.0 + (float(exp_len.mean()) if exp_len.numel() else 0.0)
    return m


def recipe_loss(model, target, batch: dict, logits_fn=None) -> tuple[torch.Tensor, dict, dict]:
    """The recipe's loss (module doc) over every drafting row of the batch's blocks, with its metrics.
    ``logits_fn(hidden, prev, draft_index, valid)`` scores the rows: it gets the blocks' grid ([b, n, L, H], [b, n,
    L], [b, n, L]) and returns logits of the ``valid`` rows [N, V'] (default: the model's LM head; DSpark adds its
    Markov bias).
    Returns (loss, metrics, rows) with rows = hidden, prev, accept (1 - TV), correct (argmax == label), w (row
    weights), wsum: what a drafter's extra losses (DSpark's confidence head) need."""
    opts = model.train_opts
    blk = training_blocks(model, batch)
    valid = blk["valid"]
    b, n, Lr = valid.shape
    grid = draft_rows(model, target, batch, blk, int(opts["anchor_chunk"]))
    h, prev, lab = grid[valid], blk["prev"][valid], blk["labels"][valid]
    if logits_fn is None:
        logits = model.logits(h, *lm_head(target))
    else:  # the blocks' grid: a head that reads earlier rows (DSpark's RNN) needs whole blocks
        logits = logits_fn(grid, blk["prev"], blk["draft_index"], valid)
    rows = row_objective(model, logits, lab, batch, blk["src"][valid], opts)
    w = row_weights(Lr, opts["gamma"], valid.device).view(1, 1, -1).expand(b, n, -1)[valid]
    wsum = w.sum().clamp(min=1e-6)
    loss = (w * rows["loss"]).sum() / wsum
    with torch.no_grad():
        hit = model.to_vocab_ids(logits.argmax(-1)) == lab
        m = {"loss": float(loss), "hard_ce": float((w * rows["hard"]).sum() / wsum),
             **block_metrics(hit, valid, blk["anchor_ok"], rows["accept"])}
        if rows["l1"] is not None:
            m["l1"] = float((w * rows["l1"]).sum() / wsum)
    return loss, m, {"hidden": h, "prev": prev, "accept": rows["accept"], "correct": hit.float(), "w": w,
                     "wsum": wsum}


def training_loss(model: DFlashModel, target, batch: dict):
    loss, m, _ = recipe_loss(model, target, batch)
    return loss, m
