"""EAGLE-3 training: the training-time-test (TTT) unroll and its soft-label loss, warm start from the target, and
the draft vocabulary from cached training data."""
from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch

from graft_block.drafter import is_count, resolve_checkpoint, vocab_maps
from graft_block.errors import ConfigError

from .checkpoint import build_draft_vocab, load_head
from .model import Eagle3Config, Eagle3Head, default_feature_layers


def ttt_forward(head: Eagle3Head, emb_fn, ids: torch.Tensor, feats: torch.Tensor, steps: int = 7, start: int = 0):
    """Training-time test, unrolled ``steps`` times. ids [B, T], feats [B, T, 3H] (row t = target feature of
    position t). Step k at index t: input (fused feature or the step-(k-1) output at t, embedding of token
    t+1+k), RoPE position t+k, predicts token t+2+k. Attention (EAGLE's cache_hidden trick): step-0 keys at
    indices <= t, plus for every step 1..k only the key at index t itself -- what a depth-(k+1) tree node sees.

    Only query indices t >= ``start`` are computed (step-0 keys still cover the whole prefix), so prompt rows
    that carry no loss cost only their k/v projections. Returns one pre-norm output [B, T - start, hidden] per
    step (rows whose input token lies past the sequence end are garbage and must be masked by the caller)."""
    B, T = ids.shape
    attn = head.midlayer.self_attn
    dev = feats.device
    W = T - start
    scale = 1.0 / math.sqrt(attn.head_dim)
    # query index start+i may see step-0 keys j <= start+i
    visible = torch.arange(T, device=dev).view(1, T) <= torch.arange(start, T, device=dev).view(W, 1)
    pos_all = torch.arange(T, device=dev).view(1, T).expand(B, T)
    g_all = head.fuse(feats)
    dtype = g_all.dtype
    # step-0 keys/values over the whole sequence (k/v projections only)
    emb0 = emb_fn(torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)).to(dtype)
    x0, res0 = head.midlayer.attn_input(emb0, g_all)
    cos, sin = head.rope(g_all, pos_all)
    q0, k0, v0 = attn.qkv(x0, cos, sin)
    keys0, vals0 = attn.expand_kv(k0), attn.expand_kv(v0)
    diag_k, diag_v, outs = [], [], []
    g = None
    for k in range(steps):
        if k == 0:
            q, residual = q0[:, :, start:], res0[:, start:]
        else:
            tok = torch.zeros((B, W), dtype=ids.dtype, device=dev)
            n_ok = max(0, min(W, T - 1 - k - start))  # index t reads token t+1+k
            if n_ok:
                tok[:, :n_ok] = ids[:, start + 1 + k: start + 1 + k + n_ok]
            x, residual = head.midlayer.attn_input(emb_fn(tok).to(dtype), g)
            cos, sin = head.rope(g, pos_all[:, start:] + k)
            q, kk, vv = attn.qkv(x, cos, sin)
            diag_k.append(attn.expand_kv(kk))
            diag_v.append(attn.expand_kv(vv))
        s0 = ((q @ keys0.transpose(-1, -2)) * scale).masked_fill(~visible, float("-inf"))  # [B, H, W, T]
        if k == 0:
            w = torch.softmax(s0.float(), dim=-1).to(dtype)
            a = w @ vals0
        else:
            sd = torch.stack([(q * dk).sum(-1) * scale for dk in diag_k], dim=-1)  # [B, H, W, k]
            w = torch.softmax(torch.cat([s0, sd], dim=-1).float(), dim=-1).to(dtype)
            a = w[..., :T] @ vals0 + sum(w[..., T + i: T + i + 1] * dv for i, dv in enumerate(diag_v))
        out = head.midlayer.finish(residual, a)
        outs.append(out)
        g = out
    return outs


def soft_labels(top_ids: torch.Tensor, top_logp: torch.Tensor, t2d: torch.Tensor, d2t: torch.Tensor):
    """Target top-k log-probs [.., k] -> (probabilities over the draft vocabulary [.., Vd] renormalised over the
    top-k ids inside it, bool mask 'target argmax is in the draft vocabulary')."""
    Vd = d2t.numel()
    t2d_index = torch.full((t2d.numel(),), -1, dtype=torch.long, device=top_ids.device)
    used = torch.arange(Vd, device=top_ids.device) + d2t.to(top_ids.device)
    t2d_index[used] = torch.arange(Vd, device=top_ids.device)
    did = t2d_index[top_ids.long()]
    inside = did >= 0
    p = top_logp.float().exp() * inside
    probs = torch.zeros(*top_ids.shape[:-1], Vd, device=top_ids.device)
    probs.scatter_add_(-1, did.clamp(min=0), p)
    probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-12)
    return probs, inside[..., 0]


def ttt_loss(head: Eagle3Head, emb_fn, ids, feats, top_ids, top_logp, loss_mask, steps: int = 7,
             decay: float = 0.8):
    """EAGLE-3 loss: soft cross-entropy against the target distribution restricted to the draft vocabulary, per
    TTT step k weighted 0.8^k. ``top_ids/top_logp`` [B, T, k]: row j = target distribution of token j+1;
    ``loss_mask`` [B, T] True where token j is a trained (response) token. Step k at index t predicts token
    t+2+k from row t+1+k; a row counts iff its token is trained and the target argmax is in the draft vocab.
    Logits are computed only on counted rows."""
    B, T = ids.shape
    lm = loss_mask.bool()
    first = int(lm.float().argmax(-1)[lm.any(-1)].min()) if bool(lm.any()) else T
    start = max(0, first - 1 - steps)  # earliest index any step trains on, less a margin
    outs = ttt_forward(head, emb_fn, ids, feats, steps, start)
    probs_all, inside = soft_labels(top_ids, top_logp, head.t2d, head.d2t)
    total = torch.zeros((), device=feats.device)
    metrics = {}
    for k, out in enumerate(outs):
        n = T - 2 - k - start  # window rows whose token t+2+k lies inside the sequence
        if n <= 0:
            break
        rows = slice(start + 1 + k, start + 1 + k + n)
        trained = lm[:, start + 2 + k: start + 2 + k + n]
        m = trained & inside[:, rows]
        cnt, cnt_all = int(m.sum()), int(trained.sum())
        if k == 0:
            metrics["rows"] = float(cnt)
            metrics["vocab_cover"] = cnt / max(cnt_all, 1)  # rows whose target argmax the draft vocab can emit
        if cnt == 0:
            continue
        p = probs_all[:, rows][m]
        logq = torch.log_softmax(head.logits(out[:, :n][m]).float(), dim=-1)
        lk = -(p * logq).sum(-1).mean()
        total = total + (decay ** k) * lk
        metrics[f"loss_{k}"] = float(lk.detach())
        hits = (logq.argmax(-1) == p.argmax(-1)).float()
        metrics[f"acc_{k}"] = float(hits.mean())  # over rows the draft vocab covers
        metrics[f"acc_all_{k}"] = float(hits.sum()) / max(cnt_all, 1)  # over every trained row
    metrics["loss"] = float(total.detach())
    return total, metrics


def head_config_for(target, draft_vocab_size: int, feature_layers: Sequence[int] | None = None) -> Eagle3Config:
    """A draft head shaped like one of the target's layers (same width, heads, MLP, RoPE)."""
    tc = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    heads = int(tc.num_attention_heads)
    rope = getattr(tc, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))
    layers = list(feature_layers) if feature_layers is not None else list(default_feature_layers(target.num_layers))
    return Eagle3Config(
        hidden_size=target.hidden_size, intermediate_size=int(tc.intermediate_size), num_attention_heads=heads,
        num_key_value_heads=int(getattr(tc, "num_key_value_heads", heads) or heads),
        head_dim=int(getattr(tc, "head_dim", None) or target.hidden_size // heads), vocab_size=target.vocab_size,
        draft_vocab_size=int(draft_vocab_size), target_hidden_size=target.hidden_size,
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-5)), rope_theta=float(theta),
        max_position_embeddings=int(getattr(tc, "max_position_embeddings", 2048)),
        aux_layer_ids=[i - 1 for i in layers],
    )


@torch.no_grad()
def warm_start(head: Eagle3Head, target, layer: int | None = None, seed: int = 0,
               parts: Sequence[str] = ("layer", "fc", "lm_head"), lm_head_scale: float = 1.0) -> None:
    """Initialise from the target: ``layer``: the decoder layer from target layer ``layer`` (default N-3; hidden
    half of q/k/v = its weights, embedding half small random); ``fc``: pass the high feature through;
    ``lm_head``: final norm and lm_head rows from the target's norm and LM head for the draft vocabulary."""
    base = target.model.get_decoder() if hasattr(target.model, "get_decoder") else target.model.model
    L = base.layers[target.num_layers - 3 if layer is None else layer]
    d = head.cfg.hidden_size
    gen = torch.Generator().manual_seed(seed)
    mid = head.midlayer
    if d != target.hidden_size:
        raise ConfigError("warm start needs a draft as wide as the target")
    unknown = set(parts) - {"layer", "fc", "lm_head"}
    if unknown:
        raise ConfigError(f"unknown warm-start parts {sorted(unknown)}; choose from layer, fc, lm_head")
    if "lm_head" in parts:
        head.norm.weight.copy_(base.norm.weight)
        used = torch.arange(head.cfg.draft_vocab_size) + head.d2t.cpu()
        rows = target.model.get_output_embeddings().weight[used.to(target.device)]
        head.lm_head.weight.copy_(rows * lm_head_scale)  # < 1 softens the target's confident logits
    if "fc" in parts:
        H = target.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * H: 3 * H] = torch.eye(H, dtype=head.fc.weight.dtype)
    if "layer" not in parts:
        return
    for name in ("q_proj", "k_proj", "v_proj"):
        src = getattr(L.self_attn, name).weight
        dst = getattr(mid.self_attn, name).weight
        noise = torch.randn(dst.shape[0], d, generator=gen) * (src.float().std() * 0.5)
        dst[:, :d] = noise.to(dst.dtype)
        dst[:, d:] = src.to(dst.dtype)
    mid.self_attn.o_proj.weight.copy_(L.self_attn.o_proj.weight)
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(mid.mlp, name).weight.copy_(getattr(L.mlp, name).weight)
    mid.hidden_norm.weight.copy_(L.input_layernorm.weight)
    mid.input_layernorm.weight.copy_(base.layers[0].input_layernorm.weight)
    mid.post_attention_layernorm.weight.copy_(L.post_attention_layernorm.weight)


def response_token_counts(data: Any, vocab_size: int, skip: int = 0) -> torch.Tensor:
    """Token frequencies over the trained (response) tokens of cached training data (graft_block.train_data; a
    name, a folder, or a comma-separated list), less the ``skip`` sequences the shared loop holds out
    (``split_holdout``: spread over the load order, with every sequence sharing their prompt or answer)."""
    from graft_block.train_data import data_root
    from graft_block.training import split_holdout

    if data is None:
        raise ConfigError("eagle3 training needs cfg['data'] (cached data name/folder) or cfg['token_counts'] to "
                          "build the draft vocabulary")
    recs = []
    for part in str(data).split(","):
        folder = Path(part.strip())
        if not folder.exists():
            folder = data_root() / part.strip()
        meta = json.loads((folder / "meta.json").read_text())
        for shard in sorted(meta["shards"], key=lambda s: s["batch"]):
            for rec in torch.load(folder / shard["file"], weights_only=False):
                recs.append({k: rec[k] for k in ("ids", "prompt_len", "labels") if k in rec})  # what the split reads
    _, train = split_holdout(recs, skip)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for rec in train:
        trained = rec.get("labels", rec["ids"])[rec["prompt_len"]:].long()  # teacher-forced ids are human text
        counts += torch.bincount(trained, minlength=vocab_size)[:vocab_size]
    return counts


@torch.no_grad()
def widen_draft_vocab(head: Eagle3Head, target, add_ids: torch.Tensor) -> Eagle3Head:
    """A copy of a trained ``head`` whose draft vocabulary also holds ``add_ids`` (target ids). Every old id keeps its
    trained LM-head row. A new id's row is the target's LM-head row mapped by the least-squares linear map that
    takes the target's rows to the trained rows over the old ids, so it starts on the trained head's scale and
    basis instead of at random."""
    old = torch.arange(head.cfg.draft_vocab_size) + head.d2t.cpu()
    add_ids = add_ids.long().cpu()
    if bool(((add_ids < 0) | (add_ids >= head.cfg.vocab_size)).any()):
        raise ConfigError(f"draft_vocab holds ids outside the target vocabulary 0..{head.cfg.vocab_size - 1}")
    used = torch.unique(torch.cat([old, add_ids]))  # sorted, as EAGLE's d2t needs
    if used.numel() == old.numel():
        return head
    cfg = dataclasses.replace(head.cfg, draft_vocab_size=int(used.numel()))
    wide = Eagle3Head(cfg, with_embedding=getattr(head, "embed_tokens", None) is not None).to(head.lm_head.weight)
    state = {k: v for k, v in head.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    missing, unexpected = wide.load_state_dict(state, strict=False)
    assert set(missing) == {"lm_head.weight", "d2t", "t2d"} and not unexpected, (missing, unexpected)
    d2t, t2d = vocab_maps(used, cfg.vocab_size)
    wide.d2t.copy_(d2t)
    wide.t2d.copy_(t2d)
    target_rows = target.model.get_output_embeddings().weight.detach().float().cpu()
    trained = head.lm_head.weight.detach().float().cpu()
    src = target_rows[old]
    rows = target_rows[used] @ torch.linalg.lstsq(src, trained).solution  # [H, H] map, rank-deficiency safe
    keep = torch.searchsorted(used, old)
    rows[keep] = trained
    wide.lm_head.weight.copy_(rows.to(wide.lm_head.weight))
    return wide


NEW_HEAD_KEYS = ("token_counts", "data", "holdout", "draft_vocab_size", "feature_layers", "warm_layer", "warm_start",
                 "lm_head_scale")  # read only when a head is built, not when one is continued


def training_head(target, cfg: dict, init: str | None = None) -> Eagle3Head:
    """A trainable head for ``target`` (``Eagle3Drafter.training_model``; see its docstring for ``cfg``)."""
    if init not in (None, "target", "random"):
        head = load_head(resolve_checkpoint(init, "eagle3"), target)
        ignored = sorted(k for k in NEW_HEAD_KEYS if k in cfg)
        if ignored:  # e.g. lm_head_scale beside --init in earlier runs' commands: it changed nothing
            warnings.warn(f"--init {init}: {ignored} shape a new head and are ignored when continuing a checkpoint",
                          stacklevel=2)
        if cfg.get("draft_vocab") is not None:
            head = widen_draft_vocab(head, target, torch.as_tensor(cfg["draft_vocab"], dtype=torch.long))
            # the run state keeps cfg: a resume (no init) rebuilds exactly this vocabulary
            cfg["draft_vocab"] = (torch.arange(head.cfg.draft_vocab_size) + head.d2t.cpu()).tolist()
    else:
        if cfg.get("draft_vocab") is not None:
            used = torch.as_tensor(cfg["draft_vocab"], dtype=torch.long)
            counts = torch.zeros(target.vocab_size)
            counts[used] = 1.0
            size = used.numel()
        else:
            size = int(cfg.get("draft_vocab_size", 4096))
            counts = cfg.get("token_counts")
            if counts is None:
                counts = response_token_counts(cfg.get("data"), target.vocab_size, int(cfg.get("holdout", 24)))
            elif not isinstance(counts, torch.Tensor):
                counts = torch.load(counts)
        hcfg = head_config_for(target, size, cfg.get("feature_layers"))
        head = Eagle3Head(hcfg)
        d2t, t2d = build_draft_vocab(counts, hcfg.draft_vocab_size)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        # default from a probe on SmolLM2: copying a target layer or the full-scale LM head made early training
        # slower than random init; LM-head rows at 0.2 scale keep token semantics without overconfidence.
        parts = cfg.get("warm_start", ("lm_head",))
        if init != "random" and parts:
            parts = [parts] if isinstance(parts, str) else list(parts)
            warm_start(head, target, cfg.get("warm_layer"), seed=int(cfg.get("seed", 0)), parts=parts,
                       lm_head_scale=float(cfg.get("lm_head_scale", 0.2)))
    ids = head.cfg.aux_layer_ids
    head.feature_layers = [i + 1 for i in ids] if ids is not None else list(default_feature_layers(target.num_layers))
    if not is_count(cfg.get("ttt_steps", 7), 1):  # 0 died in the first backward, 2.5 became 2
        raise ConfigError(f"ttt_steps must be an int >= 1 (draft steps trained per position), got {cfg['ttt_steps']!r}")
    head.ttt_steps = cfg.get("ttt_steps", 7)
    head = head.to(target.device).float().train()
    for p in head.parameters():
        p.requires_grad_(True)
    return head
