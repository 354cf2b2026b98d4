"""Drafter training data shared by every drafter: target-regenerated answers (or teacher-forced text) with the
target features and soft labels captured on the way, cached under the user cache dir.

Data (``generate_data``): first-turn ShareGPT *train* prompts (chat template), answered by the target (greedy, or
sampled several times per prompt, as MFD's T=0.7 regenerated data) with a batched loop that keeps its own KV cache
(left padding; ~2x HF ``generate`` on CPU). While generating, the
loop captures for free, through forward hooks, everything a drafter trainer needs, and caches it under
``<cache dir>/train-data/<name>/`` (``GRAFT_BLOCK_DATA`` overrides) as ``shard_XXXX.pt`` files plus ``meta.json``:
  - ``ids`` [L] int32: prompt + response (the response ends with EOS when the target stopped);
  - ``prompt_len``: loss is on response tokens only (assistant-only loss mask);
  - ``feats`` [L, n_layers * H] fp16: target hidden states for the layers in ``meta["feature_layers"]`` (HF
    ``hidden_states`` indices, concatenated in that order); the last row is zero (the last token never entered
    the target);
  - ``top_ids`` [L, k] int32 / ``top_logp`` [L, k] fp16: the target's top-k next-token log-probs at every response
    position t >= prompt_len - 1 (row t = distribution of token t + 1), rows before that are zero.
Cheaper data (``teacher_forced_data``): one forward over ShareGPT train conversations (user turn + human reference
reply) with no generation (~3-8x more tokens per CPU-minute here). Its records add ``labels`` [L] = the target's
own argmax at every position, so the k=1 block row learns exactly the target's next token given real context
(rows k >= 2 are approximate: the in-between tokens are human, not the target's). Several caches can be trained
on together (``data="a,b"``); the held-out sequences are spread over them (``training.split_holdout``).
Design choice: features are cached by default, and ``training.train(online=True)`` recomputes them inside each
step instead. Measured on 2 CPU cores (SmolLM2, DFlash, 2026-12-02, alone): building the cache 489 tok/s, a
cached training step 689 tok/s, an online step 274 tok/s. So E epochs cost 2.04 + 1.45 E ms per token cached
and 3.65 E online: online wins below ~0.9 epoch (and needs no disk), the cache from one epoch on.
The default layer list is the union that both block drafters need:
DFlash ``target_layer_ids`` [1, 14, 26] = hidden_states [2, 15, 27] = EAGLE3's "layers 2, N//2, N-3" for SmolLM2.
A trainer asking for other layers gets a clear error naming the cached layers (regenerate with ``--layers``).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import time
import warnings
from array import array
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Sequence

import torch

from .errors import ConfigError
from .target import default_feature_layers, hook_feature


def data_root() -> Path:
    """Training-data caches live under the user cache dir (never inside the installed package)."""
    from .target import cache_root

    return Path(os.environ.get("GRAFT_BLOCK_DATA", cache_root() / "train-data"))


# ---- data generation ---------------------------------------------------------------------------------------
# ShareGPT's splits are cut by conversation index and its prompts recur word for word: a split's prompt that
# recurs in a split kept from it is left out (train: the held-out calibration and the benchmark's eval slice)
KEPT_FROM = {"train": ("calibration", "eval"), "calibration": ("train",)}
# ShareGPT prompt indices [first, end) per split whose answers are the held-out set
# (drafters/data/smollm2-sharegpt-heldout, its training set's manifest ``reserved``): no training data answers them
RESERVED_PROMPTS: dict[str, tuple[tuple[int, int], ...]] = {"train": ((8576, 8704),)}


def is_reserved(index: int, ranges: Sequence[Sequence[int]]) -> bool:
    return any(a <= index < b for a, b in ranges)


def leave_out_reserved(pairs: Sequence[tuple], ranges: Sequence[Sequence[int]], log=print,
                       fix: str = "reserve=()") -> list:
    """``pairs`` (prompt index, item) less those whose index lies in a reserved (held-out) range, saying how many."""
    keep = [p for p in pairs if not is_reserved(p[0], ranges)]
    if len(keep) < len(pairs):
        names = ", ".join(f"{a}-{b - 1}" for a, b in sorted({tuple(r) for r in ranges}))
        log(f"left out {len(pairs) - len(keep)} prompts reserved for the held-out set (prompt indices {names}); "
            f"{fix} answers them (only to build that set, never training data)")
    return keep


def turn_key(turn):
    return tuple(turn) if isinstance(turn, list) else turn


def recurring_prompts(split: str) -> set:
    """The first turns (``turn_key``) of the splits that ``split``'s prompts must not repeat."""
    from .data import sharegpt

    return {turn_key(r["turns"][0]) for other in KEPT_FROM.get(split, ()) for r in sharegpt(other)}


def train_prompts(target, max_prompt_tokens: int, limit: int | None = None,
                  split: str = "train") -> list[tuple[int, list[int]]]:
    """(index, chat-template ids) of the first ``limit`` ShareGPT prompts of ``split`` (train, or calibration for
    held-out data no drafter trains on), those that fit ``max_prompt_tokens`` and do not recur in a split kept
    from it (``KEPT_FROM``) kept; an index is the prompt's position in the split, so it never shifts."""
    from .data import sharegpt

    records = sharegpt(split, limit=limit)
    shared = recurring_prompts(split)
    return [(i, ids) for i, ids in first_turn_ids(target, records, max_prompt_tokens)
            if turn_key(records[i]["turns"][0]) not in shared]


def first_turn_ids(target, records, max_prompt_tokens: int) -> list[tuple[int, list[int]]]:
    """(position, ids) of each prompt record's first turn (text through the chat template, or token ids as given),
    those that fit ``max_prompt_tokens`` kept."""
    out = []
    for i, rec in enumerate(records):
        turn = rec["turns"][0]
        ids = list(turn) if isinstance(turn, list) else target.encode([{"role": "user", "content": turn}]).tolist()
        if len(ids) <= max_prompt_tokens:
            out.append((i, ids))
    return out


@contextmanager
def hooked_features(model, layers: Sequence[int]):
    """While open, the dict it yields holds each of ``layers``' latest output (HF hidden_states indices, keyed by
    position in ``layers``): the features a drafter trains on, captured by forward hooks."""
    captured: dict[int, torch.Tensor] = {}

    def keep(j):
        def store(hidden):
            captured[j] = hidden.detach()
        return store

    hooks = [hook_feature(model, i, keep(j)) for j, i in enumerate(layers)]
    try:
        yield captured
    finally:
        for h in hooks:
            h.remove()


def batches_digest(batches, *settings) -> str:
    """A hash of what every batch index holds (ids, and prompt_len where given) and of ``settings``."""
    h = hashlib.sha256(json.dumps(settings).encode())
    for batch in batches:
        h.update(b"|")
        for item in batch:
            ids, plen = item if isinstance(item, tuple) else (item, None)
            h.update(array("q", ids).tobytes() + f";{plen};".encode())
    return h.hexdigest()[:16]


def check_resume(meta: dict, digest: str, out: Path) -> None:
    """Record ``digest`` in a new cache's ``meta``; refuse to resume one whose batches held other sequences (a
    resume skips the batch indices on disk, so they must mean the same sequences). Caches from before the digest
    carry none and resume unchecked."""
    if not meta["shards"]:
        meta["batches"] = digest
    elif meta.get("batches", digest) != digest:
        raise ConfigError(f"{out} holds batches of other sequences (other data, prompt count or batch size than "
                          "the run that made it): resuming would repeat some and skip others; use another name (or "
                          "--from-index for on-policy shards added since)")


def _pending_batches(order, meta: dict, time_limit_s, log, max_shards: int | None = None):
    """Batch indices still to generate: skips shards already on disk (resume) and stops at the time limit or
    after the first ``max_shards`` batches of ``order`` (a fixed, reproducible data set)."""
    t0 = time.time()
    done = {s["batch"] for s in meta["shards"]}
    for bi in order[:max_shards]:
        if bi in done:
            continue
        if time_limit_s is not None and time.time() - t0 > time_limit_s:
            log(f"time limit reached after {len(meta['shards'])} shards")
            return
        yield bi


@torch.inference_mode()
def answer_batch(model, prompts: list[list[int]], max_new: int, eos: set[int], layers: Sequence[int], topk: int,
                 pad_id: int = 0, sampling=None, generator: torch.Generator | list[torch.Generator] | None = None):
    """The target's answers to a batch of prompts with one left-padded KV cache: greedy, or drawn with ``sampling``
    (a ``SamplingConfig``; HF warpers) from ``generator`` (one for the batch, or one per row: then a row's draws do
    not depend on its batch-mates). Returns one record per prompt with the cached features (``layers``; none when
    empty) and the top-k next-token log-probs (of the raw, T=1 distribution; none when ``topk`` is 0) at every
    response position."""
    from transformers import DynamicCache

    from .sampling import SamplingConfig, choose, target_probs

    rule = sampling or SamplingConfig()  # choose() is argmax when greedy

    def pick(logp):
        if isinstance(generator, list) and not rule.greedy:  # warpers batched, one draw per row from its own stream
            probs = target_probs(logp, rule)
            return torch.cat([torch.multinomial(probs[r], 1, generator=g) for r, g in enumerate(generator)])
        return choose(logp, rule, None if isinstance(generator, list) else generator)

    def features():
        return torch.cat([captured[j] for j in range(len(layers))], -1).half().cpu() if layers else None

    def top(logp):
        tv, ti = logp.topk(topk, -1) if topk else (logp[:, :0], logp[:, :0].long())
        return ti.int().cpu(), tv.half().cpu()

    dev = model.get_input_embeddings().weight.device
    b = len(prompts)
    plen = [len(p) for p in prompts]
    P = max(plen)
    ids = torch.full((b, P), pad_id, dtype=torch.long)
    mask = torch.zeros((b, P), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, P - len(p):] = torch.tensor(p)
        mask[r, P - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    with hooked_features(model, layers) as captured:
        cache = DynamicCache(config=model.config)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                    logits_to_keep=1)
        feats_steps = [features()]  # [b, P, F]
        logp = torch.log_softmax(out.logits[:, -1].float(), -1)
        top_steps = [top(logp)]
        nxt = pick(logp)
        gen = [nxt.cpu()]
        done = torch.tensor([int(t) in eos for t in nxt.tolist()])
        last_pos = pos[:, -1]
        for _ in range(max_new - 1):
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=dev)], -1)
            last_pos = last_pos + 1
            out = model(input_ids=nxt.view(b, 1), attention_mask=mask, position_ids=last_pos.view(b, 1),
                        cache=cache, use_cache=True)
            feats_steps.append(features())
            logp = torch.log_softmax(out.logits[:, -1].float(), -1)
            top_steps.append(top(logp))
            nxt = pick(logp)
            gen.append(nxt.cpu())
            done |= torch.tensor([int(t) in eos for t in nxt.tolist()])
    gen_t = torch.stack(gen, 1)  # [b, S]
    feats = torch.cat(feats_steps, 1) if layers else None  # [b, P + S - 1, F]
    top_i = torch.stack([t[0] for t in top_steps], 1)  # [b, S, k]: step s = distribution of generated token s
    top_v = torch.stack([t[1] for t in top_steps], 1)
    recs = []
    for r in range(b):
        g = gen_t[r].tolist()
        n = len(g)
        for j, t in enumerate(g):
            if t in eos:
                n = j + 1
                break
        L = plen[r] + n
        rec = {"ids": torch.tensor(prompts[r] + g[:n], dtype=torch.int32), "prompt_len": plen[r]}
        if layers:
            rec["feats"] = torch.zeros((L, feats.shape[-1]), dtype=torch.float16)
            rec["feats"][: L - 1] = feats[r, P - plen[r]: P - plen[r] + L - 1]
        if topk:
            rec["top_ids"] = torch.zeros((L, topk), dtype=torch.int32)
            rec["top_logp"] = torch.zeros((L, topk), dtype=torch.float16)
            rec["top_ids"][plen[r] - 1: L - 1] = top_i[r, :n]
            rec["top_logp"][plen[r] - 1: L - 1] = top_v[r, :n]
        recs.append(rec)
    return recs


def generate_data(target, name: str, num_prompts: int = 2000, max_prompt_tokens: int = 320, max_new: int = 160,
                  batch_size: int = 48, layers: Sequence[int] | None = None, topk: int = 8,
                  time_limit_s: float | None = None, log=print, prompts: list[list[int]] | None = None,
                  folder: str | Path | None = None, sampling=None, samples: int = 1, seed: int = 0,
                  max_shards: int | None = None, reserve: Sequence[Sequence[int]] | None = None) -> Path:
    """Regenerate responses to ShareGPT *train* prompts (or the given token-id ``prompts``) with the target;
    resumable (existing shards are kept). ``folder`` overrides ``data_root() / name``. Greedy by default; with
    ``sampling`` (a ``SamplingConfig`` with T > 0) each prompt is answered ``samples`` times, so one context carries
    several futures (what a mixture drafter's modes can split; mfd.md 1.5). Shard ``b`` draws from seed ``seed``
    + ``b``, so a resumed run gives the same data; ``max_shards`` caps the set at the first N shards of the
    (fixed) shuffled batch order, whatever the time limits of the runs that made it. ShareGPT prompts whose index
    lies in ``reserve`` (default: the held-out set's, ``RESERVED_PROMPTS``) are left out; given ``prompts`` carry
    no index and are all answered."""

    sampled = sampling is not None and not sampling.greedy
    if samples < 1 or (samples > 1 and not sampled):
        raise ConfigError(f"samples={samples}: need samples >= 1, and samples > 1 only with temperature > 0 "
                          "(greedy answers to one prompt are identical)")
    how = (f"target sampled T={sampling.temperature} top_p={sampling.top_p} top_k={sampling.top_k}, {samples} "
           f"per prompt, seed {seed}") if sampled else "target greedy"

    out = Path(folder) if folder is not None else data_root() / name
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / "meta.json"
    layers = list(layers or default_feature_layers(target.num_layers))
    meta = {"feature_layers": list(layers), "topk": topk, "max_new": max_new, "max_prompt_tokens": max_prompt_tokens,
            "target": target.name, "hidden_size": target.hidden_size, "source": "sharegpt train split, first turn, "
            f"chat template, {how}", "shards": []}
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if old["feature_layers"] != list(layers) or old["topk"] != topk or not old["source"].endswith(how):
            raise ConfigError(f"{out} holds other data ({old['source']}, layers {old['feature_layers']}); use "
                              "another name")
        meta = old
    if prompts is None:
        ranges = RESERVED_PROMPTS["train"] if reserve is None else reserve
        prompts = [ids for _, ids in leave_out_reserved(train_prompts(target, max_prompt_tokens, num_prompts),
                                                         ranges, log)]
    else:
        meta["source"] = f"given prompts, {how}"
        prompts = [list(map(int, p)) for p in prompts]
    prompts.sort(key=len)  # similar lengths per batch: less padding
    prompts = [p for p in prompts for _ in range(samples)]  # a prompt's samples sit side by side
    batches = [prompts[i: i + batch_size] for i in range(0, len(prompts), batch_size)]
    check_resume(meta, batches_digest(batches, max_new), out)
    rng = random.Random(0)
    order = list(range(len(batches)))
    rng.shuffle(order)  # a time-limited run still covers short and long prompts
    eos = target.eos_token_ids
    t0 = time.time()
    for bi in _pending_batches(order, meta, time_limit_s, log, max_shards):
        t1 = time.time()
        g = torch.Generator(device=target.device).manual_seed(seed + bi) if sampled else None
        recs = answer_batch(target.model, batches[bi], max_new, eos, layers, topk, sampling=sampling, generator=g)
        fname = f"shard_{bi:04d}.pt"
        torch.save(recs, out / fname)
        gen_tok = sum(len(r["ids"]) - r["prompt_len"] for r in recs)
        all_tok = sum(len(r["ids"]) for r in recs)
        meta["shards"].append({"batch": bi, "file": fname, "sequences": len(recs), "response_tokens": gen_tok,
                               "tokens": all_tok, "seconds": time.time() - t1})
        meta_path.write_text(json.dumps(meta, indent=1))
        dt = time.time() - t1
        log(f"shard {bi}: {len(recs)} seqs, {gen_tok} response tok in {dt:.0f}s ({gen_tok / dt:.0f} tok/s), "
            f"total {sum(s['response_tokens'] for s in meta['shards'])} response tok, {time.time() - t0:.0f}s")
    return out


# ---- dataset -----------------------------------------------------------------------------------------------
def load_records(name_or_path: str | Path, feature_layers: Sequence[int] | None = None, limit: int | None = None):
    """Cached sequences; ``feats`` reduced to ``feature_layers`` (HF hidden_states indices, in that order)."""
    if isinstance(name_or_path, str) and "," in name_or_path:  # several caches, same feature layers
        recs, meta = [], None
        for part in name_or_path.split(","):
            r, m = load_records(part.strip(), feature_layers, limit)
            if meta is not None and m["feature_layers"] != meta["feature_layers"]:
                raise ConfigError(f"data caches {part} and the first one hold different feature layers")
            recs, meta = recs + r, meta or m
        return recs, meta
    folder = Path(name_or_path)
    if not folder.exists():
        folder = data_root() / str(name_or_path)
    meta_path = folder / "meta.json"
    if not meta_path.exists():
        raise ConfigError(f"no training data at {folder}: "
                          "generate it first (python -m graft_block.drafters.train --generate)")
    meta = json.loads(meta_path.read_text())
    cached = list(meta["feature_layers"])
    H = int(meta["hidden_size"])
    cols = None
    if feature_layers is not None:
        missing = [i for i in feature_layers if i not in cached]
        if missing:
            raise ConfigError(f"training data {folder} caches hidden_states {cached}; the drafter needs {missing} "
                              "too: regenerate with --layers covering them")
        cols = torch.cat([torch.arange(cached.index(i) * H, (cached.index(i) + 1) * H) for i in feature_layers])
    recs = []
    for shard in sorted(meta["shards"], key=lambda s: s["batch"]):
        for r in torch.load(folder / shard["file"]):
            if cols is not None and not torch.equal(cols, torch.arange(len(cached) * H)):
                r["feats"] = r["feats"][:, cols].contiguous()
            recs.append(r)
            if limit and len(recs) >= limit:
                return recs, meta
    return recs, meta


def draft_vocab_from_data(recs, size: int) -> torch.Tensor:
    """The ``size`` most frequent ids among the trained labels (response tokens; a teacher-forced record's
    ``labels``) and the target's top-k candidates (sorted)."""
    counts: dict[int, int] = {}
    for r in recs:
        resp = r.get("labels", r["ids"])[r["prompt_len"]:].tolist()  # teacher-forced ids are human text, not labels
        top = r["top_ids"][r["prompt_len"] - 1: len(r["ids"]) - 1].reshape(-1).tolist()
        for t in resp:
            counts[t] = counts.get(t, 0) + 4  # real labels weigh more than alternatives
        for t in top:
            counts[t] = counts.get(t, 0) + 1
    ids = sorted(counts, key=lambda t: -counts[t])[:size]
    return torch.tensor(sorted(ids), dtype=torch.long)


def collate(recs, device) -> dict:
    b = len(recs)
    L = max(len(r["ids"]) for r in recs)
    F_ = recs[0]["feats"].shape[-1]
    k = recs[0]["top_ids"].shape[-1]
    ids = torch.zeros((b, L), dtype=torch.long)
    feats = torch.zeros((b, L, F_), dtype=torch.float32)
    top_ids = torch.zeros((b, L, k), dtype=torch.long)
    top_logp = torch.zeros((b, L, k), dtype=torch.float32)
    labels = torch.zeros((b, L), dtype=torch.long)
    for i, r in enumerate(recs):
        n = len(r["ids"])
        ids[i, :n] = r["ids"].long()
        labels[i, :n] = (r["labels"] if "labels" in r else r["ids"]).long()
        feats[i, :n] = r["feats"].float()
        top_ids[i, :n] = r["top_ids"].long()
        top_logp[i, :n] = r["top_logp"].float()
    return {"ids": ids.to(device), "labels": labels.to(device), "feats": feats.to(device),
            "top_ids": top_ids.to(device), "top_logp": top_logp.to(device),
            "lengths": torch.tensor([len(r["ids"]) for r in recs], device=device),
            "prompt_len": torch.tensor([r["prompt_len"] for r in recs], device=device)}


# ---- cheaper data: the target's own next-token distributions over offline text -----------------------------
# reply tokens a teacher-forced conversation needs inside max_len (the old rule: 48 tokens, 32 after prompt_len 16)
TF_MIN_REPLY = 32


@torch.inference_mode()
def teacher_forced_data(target, name: str, num_convs: int = 3000, max_len: int = 384, batch_size: int = 8,
                        layers: Sequence[int] | None = None, topk: int = 8, time_limit_s: float | None = None,
                        skip: int = 0, log=print, folder: str | Path | None = None,
                        reserve: Sequence[Sequence[int]] | None = None) -> Path:
    """One teacher-forced forward over ShareGPT *train* conversations (user turn + the human reference reply,
    chat template): no generation, so ~3x more tokens per second than ``generate_data``. Records carry
    ``labels`` [L] = the target's own greedy token at every position (``labels[t] = argmax p(. | ids[:t])``), so a
    drafter learns the *target's* next token given real context. ``prompt_len`` is the templated user turn's
    length (``target.encode``, as ``generate_data``'s prompts): loss and anchors on the reply, of which at least
    ``TF_MIN_REPLY`` tokens must fit ``max_len``. Conversations whose prompt index (``skip`` + position) lies in
    ``reserve`` (default: the held-out set's, ``RESERVED_PROMPTS``) are left out. Same file format as
    ``generate_data``."""
    from .data import sharegpt

    seqs = []
    shared = recurring_prompts("train")
    records = list(enumerate(sharegpt("train", limit=num_convs + skip)))[skip:]
    for _, rec in leave_out_reserved(records, RESERVED_PROMPTS["train"] if reserve is None else reserve, log):
        if not rec.get("reference") or turn_key(rec["turns"][0]) in shared:
            continue
        user = {"role": "user", "content": rec["turns"][0]}
        ids = target.tokenizer.apply_chat_template([user, {"role": "assistant", "content": str(rec["reference"])}],
                                                   tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        prompt = target.encode([user]).tolist()
        if ids[: len(prompt)] != prompt:
            raise ConfigError(f"{target.name}'s chat template renders the user turn alone ({len(prompt)} tokens, "
                              "with the generation prompt) other than at the head of the conversation: the reply "
                              "cannot be told from the prompt; use generate_data (the target's own answers)")
        # prompt_len after the user turn: a fixed 16 fell inside SmolLM2's 21-token system header
        if len(ids[:max_len]) - len(prompt) >= TF_MIN_REPLY:
            seqs.append((ids[:max_len], len(prompt)))
    source = ("sharegpt train split, user turn + reference reply, teacher-forced target distributions (labels = "
              "target argmax), prompt_len = templated user turn")
    return forward_cache(target, seqs, Path(folder) if folder is not None else data_root() / name, source,
                         batch_size, layers, topk, time_limit_s, log, labels=True, extra_meta={"max_len": max_len})


# bfloat16 only: float16 would need a gradient scaler against underflow, which the loop does not run
AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16}


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags (``skinny.cpu_flags``), or None where there is no /proc/cpuinfo to read."""
    from .skinny import cpu_flags as flags

    try:
        return flags() or None
    except OSError:
        return None


def autocast_context(device, name: str | None):
    """A factory of ``torch.autocast`` contexts for ``name`` (None: a no-op), checked before any step runs. On a
    CPU without AMX tiles it warns: there torch's bfloat16 products were slower than float32 (1.4x with
    AVX512-BF16, 11x on AVX2; docs/training.md)."""
    if name is None:
        return nullcontext
    if name not in AUTOCAST_DTYPES:
        raise ConfigError(f"autocast {name!r}: use one of {', '.join(AUTOCAST_DTYPES)} (or leave it out for the "
                          "target's own dtype)")
    device_type = torch.device(device).type
    flags = cpu_flags() if device_type == "cpu" else None
    if flags is not None and "amx_bf16" not in flags:
        warnings.warn("autocast bfloat16 on a CPU without AMX tiles (no amx_bf16 flag): torch's bfloat16 products "
                      "run slower than float32 here; leave --autocast out", stacklevel=2)
    return lambda: torch.autocast(device_type, dtype=AUTOCAST_DTYPES[name])


def forward_cache(target, seqs: list[tuple[list[int], int]], out: Path, source: str, batch_size: int = 8,
                  layers: Sequence[int] | None = None, topk: int = 8, time_limit_s: float | None = None, log=print,
                  labels: bool = False, extra_meta: dict | None = None, autocast: str | None = None) -> Path:
    """Teacher-forced records of (ids, prompt_len) sequences with hooked features and top-k soft labels, in
    shards of ``batch_size`` (similar lengths, shuffled order: a time-limited run covers short and long).
    ``autocast``: the forwards run under ``torch.autocast`` in that dtype (``autocast_context``); the cache's
    meta records it, and extending a cache needs the same setting."""
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / "meta.json"
    layers = list(layers or default_feature_layers(target.num_layers))
    meta = {"feature_layers": list(layers), "topk": topk, "target": target.name, "hidden_size": target.hidden_size,
            "source": source, "shards": [], **(extra_meta or {}), **({"autocast": autocast} if autocast else {})}
    amp = autocast_context(target.device, autocast)
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta["feature_layers"] != list(layers) or meta["topk"] != topk or meta["source"] != source:
            raise ConfigError(f"{out} holds other data ({meta['source']}, layers {meta['feature_layers']}); use "
                              "another name")
        if meta.get("autocast") != autocast:
            raise ConfigError(f"{out} was built with autocast {meta.get('autocast')}, this run asks for {autocast}: "
                              "extend it with the same --autocast, or use another name")
    seqs = sorted(seqs, key=lambda s: len(s[0]))
    batches = [seqs[i: i + batch_size] for i in range(0, len(seqs), batch_size)]
    check_resume(meta, batches_digest([[(list(s), p) for s, p in b] for b in batches]), out)
    order = list(range(len(batches)))
    random.Random(0).shuffle(order)
    t0 = time.time()
    for bi in _pending_batches(order, meta, time_limit_s, log):
        t1 = time.time()
        batch = batches[bi]
        with amp():
            recs = teacher_forced_records(target, batch, layers, topk, labels)
        fname = f"shard_{bi:04d}.pt"
        torch.save(recs, out / fname)
        ntok = sum(len(s) for s, _ in batch)
        resp = sum(len(s) - p for s, p in batch)
        meta["shards"].append({"batch": bi, "file": fname, "sequences": len(batch), "tokens": ntok,
                               "response_tokens": resp, "seconds": time.time() - t1})
        meta_path.write_text(json.dumps(meta, indent=1))
        log(f"forward shard {bi}: {len(batch)} seqs, {ntok} tok in {time.time() - t1:.1f}s, total "
            f"{sum(s['tokens'] for s in meta['shards'])} tok, {time.time() - t0:.0f}s")
    return out


def top_logprobs(logits: torch.Tensor, k: int, rows: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., V] logits -> (top-k log-probs, ids) [..., k], in float32 without a full log-softmax copy, ``rows`` rows
    at a time: a chunk's float32 copy stays in cache for its top-k and logsumexp (1.6-1.8x on [1000, 49152])."""
    flat = logits.reshape(-1, logits.shape[-1])
    vals, ids = [], []
    for i in range(0, flat.shape[0], rows):
        chunk = flat[i: i + rows].float()
        v, j = chunk.topk(k, -1)
        vals.append(v - torch.logsumexp(chunk, -1, keepdim=True))
        ids.append(j)
    shape = (*logits.shape[:-1], -1)
    return torch.cat(vals).view(shape), torch.cat(ids).view(shape)


@torch.inference_mode()
def teacher_forced_records(target, seqs: list[tuple[list[int], int]], layers: Sequence[int], topk: int = 8,
                           labels: bool = False) -> list[dict]:
    """One padded target forward over (ids, prompt_len) sequences: the records ``collate`` reads (hooked features
    of ``layers``, top-k soft labels, and with ``labels`` the target's argmax). Used by ``forward_cache`` and by
    online training (``train(..., online=True)``)."""
    L = max(len(s) for s, _ in seqs)
    ids = torch.zeros((len(seqs), L), dtype=torch.long)
    att = torch.zeros((len(seqs), L), dtype=torch.long)
    for r, (s, _) in enumerate(seqs):
        ids[r, : len(s)] = torch.as_tensor(s)
        att[r, : len(s)] = 1
    with hooked_features(target.model, layers) as captured:
        logits = target.model(input_ids=ids.to(target.device), attention_mask=att.to(target.device)).logits
    feats = torch.cat([captured[j] for j in range(len(layers))], -1).half().cpu()
    tv, ti = top_logprobs(logits, topk)
    del logits
    recs = []
    for r, (s, plen) in enumerate(seqs):
        n = len(s)
        rec = {"ids": torch.as_tensor(s, dtype=torch.int32), "prompt_len": plen, "feats": feats[r, :n].clone(),
               "top_ids": ti[r, :n].int().cpu(), "top_logp": tv[r, :n].half().cpu()}
        if labels:
            rec["labels"] = torch.zeros(n, dtype=torch.int32)
            rec["labels"][1:] = ti[r, : n - 1, 0].int().cpu()
        recs.append(rec)
    return recs
