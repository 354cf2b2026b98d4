"""The one training loop shared by every drafter (data: ``graft_block.train_data``).

Data: a feature cache (``load_records``), or with ``online=True`` on-policy id folders whose features come from a
target forward inside each step (``teacher_forced_records``).
Loop (``train``): a drafter class plugs in with ``training_model(target, cfg, init)``, ``training_loss(model, target,
batch)`` and ``save_trained(model, out_dir, cfg)``. The loop does AdamW + warmup + cosine + grad clip, logging
(every metric the loss returns, e.g. DFlash's teacher-forced accepted length per block), checkpoint/resume
(``state.pt`` in the run folder) and torchrun DDP (sequences sharded by rank, gradients all-reduced, rank 0 saves).
The same code runs on CPU and GPU; batches are built on the CPU and moved to the target's device.
"""
from __future__ import annotations

import json
import math
import os
import random
import re
import time
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from .errors import ConfigError
from .target import default_feature_layers
from .train_data import autocast_context, collate, draft_vocab_from_data, load_records, teacher_forced_records


@runtime_checkable
class TrainableDrafter(Protocol):
    """What a drafter class provides to be trained by ``train`` (classmethods). ``training_model`` draws its random
    inits from ``cfg["seed"]`` (``train`` sets it: ``init_seed_of``); the model it returns may carry
    ``config_notes``, a dict that ``train`` logs and adds to every config.json it saves (``save_with_notes``)."""

    def training_model(self, target, cfg: dict, init: str | None = None) -> torch.nn.Module: ...

    def training_loss(self, model, target, batch: dict) -> tuple[torch.Tensor, dict]: ...

    def save_trained(self, model, out_dir, cfg: dict) -> None: ...


def epoch_batches(n: int, batch_size: int, epoch: int, seed: int, rank: int = 0, world: int = 1, lengths=None):
    """Shuffled, length-bucketed batches of indices; rank r takes every world-th batch (DistributedSampler-style)."""
    g = random.Random(seed * 1000 + epoch)
    idx = list(range(n))
    g.shuffle(idx)
    if lengths is not None:  # sort within chunks so a batch pads little
        chunk = batch_size * 16
        idx = [i for c in range(0, n, chunk) for i in sorted(idx[c: c + chunk], key=lambda j: lengths[j])]
    batches = [idx[i: i + batch_size] for i in range(0, n, batch_size)]
    g.shuffle(batches)
    usable = len(batches) - len(batches) % world if world > 1 else len(batches)
    return batches[rank:usable:world]


def check_training_keys(klass, drafter_type: str, cfg: dict) -> None:
    """A ConfigError for a --config key the drafter's training never reads (a misspelt "num_anchor" trained with the
    default without a word); a class without ``training_keys`` is not checked."""
    known = getattr(klass, "training_keys", None)
    unknown = sorted(set(cfg) - set(known or cfg))
    if unknown:
        raise ConfigError(f"{drafter_type} training reads no config keys {unknown}; it reads: {', '.join(known)}")


def init_seed_of(cfg: dict, seed: int) -> int:
    """The seed of a run's initialisation draws (new layers and heads, MFD's mode vectors, EAGLE3's warm-start noise):
    the config's ``"seed"`` when it names one (an explicit choice for the inits; a resumed run keeps its own), else
    ``seed`` (``--seed``), which always orders the data and draws the anchors."""
    own = cfg.get("seed")
    if own is None:
        return int(seed)
    if not isinstance(own, int) or isinstance(own, bool):
        raise ConfigError(f"the config's \"seed\" (the initialisation's; --seed gives it when absent) must be an "
                          f"integer, got {own!r}")
    return own


def save_with_notes(klass, model, folder: Path, cfg: dict) -> None:
    """``klass.save_trained``, then the model's ``config_notes`` (a dict; e.g. DSpark's calibration still needed)
    added to the top level of the saved config.json, where a reader of the folder sees them."""
    klass.save_trained(model, folder, cfg)
    notes = getattr(model, "config_notes", None)
    if notes:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **notes}, indent=2) + "\n")


def lr_at(step: int, total: int, lr: float, warmup: float, min_ratio: float = 0.1) -> float:
    w = max(1, int(total * warmup))
    if step < w:
        return lr * (step + 1) / w
    t = min(1.0, (step - w) / max(1, total - w))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


# ---- the loop ----------------------------------------------------------------------------------------------
def _dist():
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend)
    rank = torch.distributed.get_rank() if world > 1 else 0
    return rank, world


EVAL_BATCH = 4  # held-out batches: fixed, so runs with different training batch sizes see the same anchors


@torch.no_grad()
def evaluate(klass, model, target, recs, batch_size: int = EVAL_BATCH, seed: int = 1234) -> dict:
    """Mean metrics over held-out sequences with fixed anchors (same every call, and the same for every run on
    these sequences at the default ``batch_size``). A batch weighs by the blocks it scored (``blocks``, from the
    block drafters), so tau_tf and tau_exp are means over blocks; without that count, every batch weighs one."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    tot: dict[str, float] = {}
    n = 0.0
    for i in range(0, len(recs), batch_size):
        batch = collate(recs[i: i + batch_size], target.device)
        batch["generator"] = g
        _, m = klass.training_loss(model, target, batch)
        w = float(m.get("blocks", 1))
        for k, v in m.items():
            tot[k] = tot.get(k, 0.0) + w * v
        n += w
    model.train()
    return {k: v / n for k, v in tot.items()} if n > 0 else {}


def write_learning_curve(log_path: str | Path, out_dir: str | Path) -> Path | None:
    """``learning_curve.csv`` (+ ``.png`` when matplotlib is installed) beside a checkpoint: every held-out
    evaluation of the run's log (step, minutes, tokens seen, each metric), across resumed runs in order."""
    log_path, out_dir = Path(log_path), Path(out_dir)
    if not log_path.exists():
        return None
    evals = [r for r in map(json.loads, log_path.read_text().splitlines()) if r.get("eval")]
    if not evals:
        return None
    keys = sorted({k for r in evals for k in r["eval"]})
    out_dir.mkdir(parents=True, exist_ok=True)
    csv = out_dir / "learning_curve.csv"
    lines = [",".join(["step", "minutes", "tokens_seen", *keys])]
    for r in evals:
        lines.append(",".join([str(r["step"]), f"{r.get('minutes', 0):.3f}", str(r.get("tokens_seen", "")),
                               *(f"{r['eval'][k]:.6g}" if k in r["eval"] else "" for k in keys)]))
    csv.write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return csv
    shown = [k for k in keys if k.startswith(("tau", "acc"))] or keys[:2]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, xk, label in ((axes[0], "tokens_seen", "training tokens seen"), (axes[1], "minutes", "training minutes")):
        for k in shown:
            pts = [(r.get(xk), r["eval"][k]) for r in evals if r.get(xk) is not None and k in r["eval"]]
            if pts:
                ax.plot(*zip(*pts), marker=".", label=k)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out metric")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"learning curve: {out_dir.name}")
    fig.tight_layout()
    fig.savefig(out_dir / "learning_curve.png", dpi=110)
    plt.close(fig)
    return csv


def split_holdout(recs: list[dict], holdout: int) -> tuple[list[dict], list[dict]]:
    """(held-out, train): ``holdout`` records spread evenly over the list (caches are stored in length buckets,
    so the first records would all be one length), and no training record whose answer or prompt equals a
    held-out one (on-policy data repeats canned answers to different prompts, and multi-future data answers one
    prompt several times: either copy in training leaks the test)."""
    if holdout <= 0:
        return [], list(recs)
    if holdout >= len(recs):
        raise ConfigError(f"holdout {holdout} leaves no training data ({len(recs)} sequences)")
    picks = {round(i * (len(recs) - 1) / max(1, holdout - 1)) for i in range(holdout)} if holdout > 1 else {0}
    held = [recs[i] for i in sorted(picks)]
    return held, without_overlap([r for i, r in enumerate(recs) if i not in picks], held)


# teacher-forced caches built before 2026-12-06 (records with ``labels``) carry this prompt_len: an anchor floor
# inside SmolLM2's chat header, the same for every conversation, so not a prompt
LEGACY_TF_PROMPT_LEN = 16


def without_overlap(recs: list[dict], held: list[dict]) -> list[dict]:
    """``recs`` less every record whose answer or prompt equals one of ``held``'s. A teacher-forced record's prompt
    is its templated user turn, as an on-policy record's, so the two kinds are matched against each other too."""
    def answer(r):
        return tuple(r["ids"][int(r.get("prompt_len", 0)):].tolist())

    def prompt(r):  # None without a prompt: nothing to share
        n = int(r.get("prompt_len", 0))
        # teacher-forced text (it carries ``labels``) ends its prompt after the user turn (teacher_forced_data);
        # an older cache's prompt_len 16 ends inside the system header that every conversation shares
        legacy = "labels" in r and n == LEGACY_TF_PROMPT_LEN
        return tuple(r["ids"][:n].tolist()) if n and not legacy else None

    seen = {answer(r) for r in held}
    prompts = {prompt(r) for r in held} - {None}
    return [r for r in recs if answer(r) not in seen and prompt(r) not in prompts]


def topic_slice(recs: list[dict], target, pattern: str) -> list[dict]:
    """The records whose prompt (``ids[:prompt_len]``, decoded) matches ``pattern`` (a regular expression, case
    insensitive); none matching is an error, not an empty run."""
    try:
        rx = re.compile(pattern, re.IGNORECASE)
    except re.error as exc:
        raise ConfigError(f"--where {pattern!r} is not a regular expression: {exc}") from None
    out = [r for r in recs if rx.search(target.decode(r["ids"][: int(r["prompt_len"])].tolist()))]
    if not out:
        raise ConfigError(f"--where {pattern!r} matches none of the {len(recs)} prompts: loosen it")
    return out


def train(drafter_type: str, target, data: str, out_dir: str | Path, run_dir: str | Path, cfg: dict | None = None,
          init: str | None = None, epochs: float = 1.0, lr: float = 6e-4, warmup: float = 0.04, clip: float = 1.0,
          weight_decay: float = 0.0, batch_size: int = 4, holdout: int = 24, eval_every: int = 100,
          log_every: int = 10, time_limit_s: float | None = None, resume: bool = False, seed: int = 0,
          draft_vocab_size: int | None = None, limit: int | None = None, steps: int | None = None,
          online: bool = False, kinds: list[str] | None = None, eval_data: str | None = None,
          keep_best: bool = False, where: str | None = None, autocast: str | None = None, log=print) -> dict:
    """Train ``drafter_type``'s ``training_model`` on cached (or ``online``) data; save its public checkpoint to
    ``out_dir`` and the resumable state (``state.pt``) and ``log.jsonl`` to ``run_dir``. ``steps`` (when given)
    fixes the number of optimiser steps instead of ``epochs`` (equal-step comparisons). ``online``: ``data`` names
    on-policy dataset folders (``graft_block.onpolicy``, comma-separated; ``kinds`` selects shard kinds) and each
    batch's features and soft labels come from a target forward inside the step instead of a cache. ``eval_data``
    (a feature cache) replaces the ``holdout`` split: every run on the same data reads the same held-out
    sequences, less any that shares a prompt or an answer with a training sequence. ``keep_best``: also keep
    the weights of the best held-out tau_tf so far in ``<out_dir>-best`` (a long run that starts to overfit).
    ``where``: a regular expression; only sequences whose decoded prompt matches it train (a topic slice: code).
    ``autocast`` ("bfloat16"): each step's forwards (the online target's and the drafter's) run under
    ``torch.autocast`` on the target's device, weights and optimiser state staying float32; held-out evaluation
    stays in the target's dtype, so its figures compare with float32 runs. On a CPU with AMX a bfloat16 product
    is ~10x a float32 one (docs/training.md).
    ``steps=0`` only evaluates the init (or, with ``resume``, the run's state). ``seed`` orders the data, draws the
    anchors and, unless ``cfg`` names its own ``"seed"`` (``init_seed_of``), every random init. Returns the final
    eval metrics."""
    from .drafter import drafter_class

    klass = drafter_class(drafter_type)
    if not isinstance(klass, TrainableDrafter):
        missing = [h for h in ("training_model", "training_loss", "save_trained") if not hasattr(klass, h)]
        raise ConfigError(f"drafter {drafter_type!r} does not implement {', '.join(missing)}; "
                          "it cannot be trained here")
    rank, world = _dist()
    amp = autocast_context(target.device, autocast)
    cfg = dict(cfg or {})
    check_training_keys(klass, drafter_type, cfg)
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    state_path = run_dir / "state.pt"
    state = torch.load(state_path, weights_only=False) if resume and state_path.exists() else None
    if state is not None:
        cfg = {**state["cfg"], **cfg}
    if online:
        from .onpolicy import check_target, read

        recs = []
        for part in data.split(","):
            check_target(target, part.strip())
            recs += read(part.strip(), kinds)[:limit or None]
        if kinds and not recs:  # a misspelt kind read nothing, and the holdout split then took the blame
            have = sorted({r["kind"] for part in data.split(",") for r in read(part.strip())})
            raise ConfigError(f"--kinds {','.join(kinds)}: {data} holds no such shards; its kinds: {', '.join(have)}")
    else:
        recs, meta = load_records(data, None, limit)
    if where is not None:
        recs = topic_slice(recs, target, where)
        log(f"[data] --where {where!r}: {len(recs)} sequences")
    if state is not None and state.get("records", len(recs)) != len(recs):
        raise ConfigError(f"the run in {run_dir} trained on {state['records']} sequences and the data now holds "
                          f"{len(recs)}: its held-out split would change; start a new run with --init from its "
                          "checkpoint instead of --resume")
    eval_recs, train_recs = split_holdout(recs, 0 if eval_data else holdout)
    if draft_vocab_size and cfg.get("draft_vocab") is None:
        if online:
            raise ConfigError("draft_vocab_size counts the cached soft labels: drop --draft-vocab, or build a "
                              "feature cache (--generate --from-onpolicy) to choose the draft vocabulary")
        cfg["draft_vocab"] = draft_vocab_from_data(train_recs, draft_vocab_size).tolist()
    if state is not None:  # rebuild the architecture the run started from (a folder's), then load its weights
        started = state.get("init")
        if started is not None and init is not None and Path(init).resolve() != Path(started).resolve():
            raise ConfigError(f"--resume: the run in {run_dir} started from --init {started}, not {init}: drop --init "
                              "or start a new run from that checkpoint")
        init = started if started is not None else init
    init_seed = init_seed_of(cfg, seed)
    if init_seed != seed:
        log(f"[train] initialisation drawn with the config's seed {init_seed}, not --seed {seed} (which still orders "
            "the data and draws the anchors)")
    cfg["seed"] = init_seed  # every drafter reads its init draws from cfg["seed"]; the run state keeps it
    torch.manual_seed(init_seed)  # not + rank: parameters are never broadcast, so every rank must build the same model
    model = klass.training_model(target, cfg, init)
    for key, note in (getattr(model, "config_notes", None) or {}).items():
        log(f"[init] {key}: {json.dumps(note)}")
    layers = list(getattr(model, "feature_layers", ()) or ())
    if online:
        layers = layers or list(default_feature_layers(target.num_layers))
        meta = {"feature_layers": layers, "hidden_size": target.hidden_size}

        def featurize(rs):  # the cache's records, computed now (one target forward per batch)
            return teacher_forced_records(target, [(r["ids"].tolist(), r["prompt_len"]) for r in rs], layers)

        if rank == 0:  # only rank 0 evaluates
            eval_recs = [x for i in range(0, len(eval_recs), EVAL_BATCH)
                         for x in featurize(eval_recs[i: i + EVAL_BATCH])]
    H = int(meta["hidden_size"])
    cached = list(meta["feature_layers"])
    layers = layers or cached  # a drafter that names no layers takes all the data holds
    if any(i not in cached for i in layers):
        raise ConfigError(f"training data caches hidden_states {cached}; the drafter needs {layers}: regenerate "
                          "the data with --layers covering them")
    if layers != cached:
        cols = torch.cat([torch.arange(cached.index(i) * H, (cached.index(i) + 1) * H) for i in layers])
        for r in eval_recs + train_recs:
            r["feats"] = r["feats"][:, cols].contiguous()
    if eval_data:  # held out only what no training sequence shares (a prompt or a canned answer)
        held, held_meta = load_records(eval_data, layers)  # refuses a cache without these layers
        if int(held_meta["hidden_size"]) != H:
            raise ConfigError(f"held-out cache {eval_data} has features of width {held_meta['hidden_size']}, the "
                              f"training data {H}: they come from different targets")
        eval_recs = without_overlap(held, train_recs)
        if held and not eval_recs:
            raise ConfigError(f"every sequence of the held-out cache {eval_data} is also in the training data "
                              f"{data}: nothing is held out; evaluate with --data naming other data")
    has_eval = rank == 0 and bool(eval_recs)
    if steps == 0:
        if state is not None:
            model.load_state_dict(state["model"])
        ev = evaluate(klass, model, target, eval_recs) if has_eval else {}
        log("[eval] init: " + " ".join(f"{k} {v:.4g}" for k, v in ev.items()))
        return {"step": 0, **ev}
    lengths = [len(r["ids"]) for r in train_recs]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    step, epoch0, elapsed0 = 0, 0, 0.0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, epoch0, elapsed0 = state["step"], state["epoch"], state.get("elapsed", 0.0)
    seen = state.get("tokens_seen", 0) if state is not None else 0  # training tokens consumed (the curve's x axis)
    steps_per_epoch = len(epoch_batches(len(train_recs), batch_size, 0, seed, rank, world))
    if steps_per_epoch == 0:  # an empty epoch would loop forever
        raise ConfigError(f"no training sequence is left in {data} for rank {rank} of {world} once the held-out "
                          f"ones and every sequence sharing their prompt or answer are dropped ({len(train_recs)} "
                          "left): lower --holdout or add data")
    if steps is not None and steps < 0:
        raise ConfigError(f"steps must be >= 0 (0 only evaluates), got {steps}")
    total = steps if steps is not None else max(1, int(math.ceil(epochs * steps_per_epoch)))
    n_params = sum(p.numel() for p in params)
    log(f"[train] {drafter_type}: {n_params / 1e6:.2f} M trainable params, {len(train_recs)} train / "
        f"{len(eval_recs)} held-out sequences, {steps_per_epoch} steps/epoch, {total} steps total, world {world}")
    logf = open(run_dir / "log.jsonl", "a") if rank == 0 else None

    def save():
        if rank != 0:
            return
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "epoch": epoch,
                    "elapsed": elapsed0 + time.time() - t0, "cfg": cfg, "tokens_seen": seen,
                    "records": len(recs), "init": None if init is None or init in ("random", "target")
                    else str(Path(init).resolve())}, state_path)
        save_with_notes(klass, model, out_dir, cfg)
        write_learning_curve(run_dir / "log.jsonl", out_dir)

    best_tau, best_dir = float("-inf"), Path(str(out_dir) + "-best")

    def save_if_best(ev):
        nonlocal best_tau
        if keep_best and rank == 0 and ev.get("tau_tf", float("-inf")) > best_tau:
            best_tau = ev["tau_tf"]
            save_with_notes(klass, model, best_dir, cfg)
            (best_dir / "best_step.json").write_text(json.dumps({"step": step, **ev}) + "\n")

    def write(rec):
        if logf is not None:
            logf.write(json.dumps(rec) + "\n")
            logf.flush()

    if has_eval and step == 0:
        ev = evaluate(klass, model, target, eval_recs)
        write({"step": 0, "minutes": elapsed0 / 60, "tokens_seen": seen, "eval": ev})
        log("[eval] step 0: " + " ".join(f"{k} {v:.4g}" for k, v in ev.items()))
        save_if_best(ev)
    evaluated_at = -1
    t0 = time.time()
    model.train()
    ema: dict[str, float] = {}
    epoch = epoch0
    stop = False
    rows = 0
    while step < total and not stop:
        batches = epoch_batches(len(train_recs), batch_size, epoch, seed, rank, world, lengths)
        skip = step - epoch * steps_per_epoch if state is not None and epoch == epoch0 else 0
        for bi in batches[max(0, skip):]:
            if step >= total:
                break
            batch_recs = [train_recs[i] for i in bi]
            with amp():
                batch = collate(featurize(batch_recs) if online else batch_recs, target.device)
            # the step's anchors come from (seed, step, rank) alone, so a resumed run draws what an unbroken one did
            batch["generator"] = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1024 + rank)
            seen += sum(len(train_recs[i]["ids"]) for i in bi) * world
            cur_lr = lr_at(step, total, lr, warmup)
            for gr in opt.param_groups:
                gr["lr"] = cur_lr
            with amp():
                loss, m = klass.training_loss(model, target, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if world > 1:
                for p in params:
                    if p.grad is not None:
                        torch.distributed.all_reduce(p.grad)
                        p.grad /= world
            gn = torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            step += 1
            rows += int(m.get("rows", 0))
            for k, v in m.items():
                ema[k] = v if k not in ema else 0.95 * ema[k] + 0.05 * v
            minutes = (elapsed0 + time.time() - t0) / 60
            if rank == 0 and step % log_every == 0:
                write({"step": step, "epoch": epoch, "minutes": minutes, "lr": cur_lr, "grad_norm": float(gn),
                       "rows_per_s": rows / max(1e-6, time.time() - t0), **{f"train_{k}": v for k, v in ema.items()}})
                log(f"[train] step {step}/{total} ep {epoch} {minutes:.1f} min lr {cur_lr:.2e} " +
                    " ".join(f"{k} {v:.4g}" for k, v in ema.items() if k != "rows") +
                    f" ({rows / max(1e-6, time.time() - t0):.0f} rows/s)")
            if has_eval and eval_every and step % eval_every == 0:
                ev = evaluate(klass, model, target, eval_recs)
                evaluated_at = step
                write({"step": step, "minutes": minutes, "tokens_seen": seen, "eval": ev})
                log(f"[eval] step {step}: " + " ".join(f"{k} {v:.4g}" for k, v in ev.items()))
                save()
                save_if_best(ev)
            if time_limit_s is not None and time.time() - t0 > time_limit_s:
                log(f"[train] time limit reached at step {step}")
                stop = True
                break
        else:
            epoch += 1
    if not has_eval:
        ev = {}
    elif evaluated_at != step:  # else the loop's last eval already scored these exact weights
        ev = evaluate(klass, model, target, eval_recs)
    minutes = (elapsed0 + time.time() - t0) / 60
    write({"step": step, "minutes": minutes, "tokens_seen": seen, "eval": ev, "final": True})
    if ev:
        log(f"[eval] final step {step} ({minutes:.1f} min): " + " ".join(f"{k} {v:.4g}" for k, v in ev.items()))
    save()
    save_if_best(ev)
    if logf is not None:
        logf.close()
    return {"step": step, "minutes": minutes, **ev}
