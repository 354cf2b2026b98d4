"""README.md and docs/*.md against the code: what a newcomer copies from them must work.

Checked, without running anything heavy (no model is loaded; the whole file takes a few seconds):
- every command shown (fenced shell blocks and inline code) whose program is this project's: `graft-block SUB`,
  `python eval/X.py`, `python -m graft_block...`, `bash scripts/X.sh`. Its arguments go through the real argparse
  parser of the module it runs: the module's `main(argv)` is called with argparse patched to stop right after
  parsing, so a renamed or removed flag, a bad choice or a wrong type fails here. Values the parser does not
  check are checked by name: `--methods` against the presets, `train --type` against the drafter registry.
- the `graft-block bench` options the README lists on their own lines or in inline code;
- every repository path in inline code or in a command exists, and every relative link (and its #anchor) resolves;
- the README's methods table matches the presets, and every method a README results table names exists;
- the Python quick start imports what it names, its bundled drafter names exist, and it runs (slow: on the real
  SmolLM2, token-identical to the target's greedy decoding, drafts accepted);
- the README's test command is the one .ci/run runs, and the README stays short (<= 250 lines).

Notation the commands may use: `...` (more arguments elided: a missing required argument is then accepted),
`[--opt X]` (optional, checked as if given), `a|b` inside one word (each alternative is checked).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import glob
import importlib
import itertools
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MARKDOWN = [README, *DOCS]
README_MAX_LINES = 250

# Top-level folders of the checkout that markdown refers to by path. runs/ holds outputs, so it is not checked.
REPO_DIRS = ("graft_block", "tree", "drafters", "eval", "scripts", "tests", "docs", ".ci")
# pyproject's package-dir mapping: an installed path graft_block/drafters/... is drafters/... in the checkout.
INSTALLED_TO_CHECKOUT = {"graft_block/tree/": "tree/", "graft_block/drafters/": "drafters/",
                         "graft_block/eval/": "eval/"}
PYTHONS = ("python", "python3", ".venv/bin/python")
GRAFT_BLOCK = ("graft-block", ".venv/bin/graft-block")
SHELL_INFOS = ("", "bash", "sh", "shell", "console")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---- reading markdown ---------------------------------------------------------------------------------------
FENCE = re.compile(r"^( *)```([\w+-]*)[^\n]*\n(.*?)^\1```[ \t]*$", re.M | re.S)


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced block; a block indented under a list item is dedented."""
    blocks = []
    for m in FENCE.finditer(text):
        indent = len(m.group(1))
        body = "\n".join(line[indent:] if line[:indent].isspace() else line for line in m.group(3).splitlines())
        blocks.append((m.group(2).lower(), body))
    return blocks


def prose(text: str) -> str:
    """The text outside fenced blocks."""
    return FENCE.sub("", text)


def inline_code(text: str) -> list[str]:
    """Inline code spans outside fenced blocks; a span broken over two lines is joined."""
    return [" ".join(s.split()) for s in re.findall(r"`([^`\n]+(?:\n[^`\n]+)?)`", prose(text))]


def logical_lines(body: str) -> list[str]:
    """Shell lines with backslash continuations joined."""
    return re.sub(r"\\\n\s*", " ", body).splitlines()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than - and _ dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#{1,6} +(.+?) *$", prose(path.read_text()), re.M)}


# ---- parsing a command's arguments with the module's own parser, without running it --------------------------
class Parsed(Exception):
    """Raised by the patched argparse as soon as a parser accepted the arguments."""

    def __init__(self, parser, namespace, extras, known):
        super().__init__("parsed")
        self.parser, self.namespace, self.extras, self.known = parser, namespace, extras, known


class Rejected(Exception):
    """Raised instead of argparse's exit when a parser rejects the arguments."""


@contextlib.contextmanager
def parse_only():
    """Make the first top-level parse_args / parse_known_args raise Parsed (or Rejected) instead of returning,
    so a module's main(argv) stops before it loads a model."""
    cls = argparse.ArgumentParser
    real_args, real_known, real_error = cls.parse_args, cls.parse_known_args, cls.error
    nested = []  # parse_args calls parse_known_args itself: that inner call must return normally

    def parse_args(self, args=None, namespace=None):
        nested.append(True)
        try:
            namespace = real_args(self, args, namespace)
        finally:
            nested.pop()
        raise Parsed(self, namespace, [], known=False)

    def parse_known_args(self, args=None, namespace=None):
        if nested:
            return real_known(self, args, namespace)
        namespace, extras = real_known(self, args, namespace)
        raise Parsed(self, namespace, extras, known=True)

    def error(self, message):
        raise Rejected(f"{self.prog}: {message}")

    cls.parse_args, cls.parse_known_args, cls.error = parse_args, parse_known_args, error
    try:
        yield
    finally:
        cls.parse_args, cls.parse_known_args, cls.error = real_args, real_known, real_error


def parse(module_name: str, argv: list[str]) -> Parsed:
    """Run ``module_name``'s main(argv) up to its argument parsing; Rejected when the parser refuses argv."""
    module = importlib.import_module(module_name)
    with parse_only():
        try:
            module.main(argv)
        except Parsed as done:
            return done
    raise AssertionError(f"{module_name}.main returned without parsing its arguments")


def bench_parser() -> argparse.ArgumentParser:
    return parse("graft_block.eval.run_block", []).parser


def option_names(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def check_values(module_name: str, namespace) -> list[str]:
    """Values a parser takes as free text but the program resolves by name."""
    problems = []
    # methods named by a --config file are defined there, not in the presets
    if module_name == "graft_block.eval.run_block" and getattr(namespace, "methods", None) \
            and not getattr(namespace, "config", None):
        from graft_block.eval.presets import PRESETS

        problems += [f"unknown method {m!r}" for m in namespace.methods.split(",") if m not in PRESETS]
    if module_name == "graft_block.drafters.train":
        from graft_block.drafter import drafter_class

        try:
            klass = drafter_class(namespace.type)
        except Exception as exc:  # noqa: BLE001 - any failure to resolve the type is the finding
            problems.append(f"--type {namespace.type}: {exc}")
        else:
            missing = [h for h in ("training_model", "training_loss", "save_trained") if not hasattr(klass, h)]
            problems += [f"--type {namespace.type} cannot train (no {', '.join(missing)})"] if missing else []
    return problems


def check_args(module_name: str, argv: list[str], elided: bool) -> list[str]:
    try:
        done = parse(module_name, argv)
    except ModuleNotFoundError as exc:
        return [f"no module {module_name} ({exc})"]
    except Rejected as exc:
        if elided and "the following arguments are required" in str(exc):
            return []  # "..." stands for them
        return [str(exc)]
    problems = check_values(module_name, done.namespace)
    if done.known and done.extras:
        # The eval/bench_*.py scripts parse their own options and pass every other one to run_block.
        problems += check_args("graft_block.eval.run_block", done.extras, elided)
    return problems


# ---- commands -----------------------------------------------------------------------------------------------
def is_repo_path(word: str) -> bool:
    return "/" in word and word.split("/", 1)[0] in REPO_DIRS and not re.search(r"[\s<>]", word)


def checkout_path(word: str) -> str:
    for installed, checkout in INSTALLED_TO_CHECKOUT.items():
        if word.startswith(installed):
            return checkout + word[len(installed):]
    return word


def path_exists(word: str) -> bool:
    return bool(glob.glob(str(ROOT / checkout_path(word))))


def module_of_script(path: str) -> str:
    """eval/run_block.py -> graft_block.eval.run_block (the installed name of a checkout file)."""
    dotted = path[:-3].replace("/", ".")
    return dotted if dotted.startswith("graft_block.") else "graft_block." + dotted


def alternatives(words: list[str]) -> list[list[str]]:
    """`--type dflash|eagle3` -> one argv per alternative."""
    options = [w.split("|") if "|" in w and "://" not in w else [w] for w in words]
    return [list(choice) for choice in itertools.product(*options)]


def check_command(words: list[str]) -> list[str] | None:
    """Problems with one simple command (no && or pipes); None when its program is not this project's."""
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words = words[1:]  # environment assignments
    if not words:
        return None
    elided = "..." in words
    words = [w.strip("[]") for w in words if w != "..."]
    program, args = words[0], words[1:]
    problems = [f"path {w} does not exist" for w in args if is_repo_path(w) and not path_exists(w)]
    if program == "bash":
        return problems
    if program in GRAFT_BLOCK:
        from graft_block.eval.cli import COMMANDS

        if not args or args[0] in ("-h", "--help"):
            return problems
        if args[0] not in COMMANDS:
            return problems + [f"graft-block has no command {args[0]!r} (it has {', '.join(COMMANDS)})"]
        module_name, args = COMMANDS[args[0]][0], args[1:]
    elif program in PYTHONS and args[:1] == ["-m"] and len(args) > 1:
        if args[1] == "pytest":
            return problems  # pytest's own options; test_ci_runs_the_readme_test_command covers that command
        module_name, args = args[1], args[2:]
    elif program in PYTHONS and args and args[0].endswith(".py") and is_repo_path(args[0]):
        module_name, args = module_of_script(args[0]), args[1:]
    else:
        return None
    for argv in alternatives(args):
        problems += check_args(module_name, argv, elided)
    return problems


def commands(path: Path) -> list[str]:
    """Every shell command line shown in a file: fenced shell blocks, and inline code that starts like one."""
    lines = [line for info, body in code_blocks(path.read_text()) if info in SHELL_INFOS
             for line in logical_lines(body)]
    lines += inline_code(path.read_text())
    start = re.compile(r"^\s*(?:[A-Z_][A-Z0-9_]*=\S+\s+)*(?:" +
                       "|".join(map(re.escape, (*PYTHONS, *GRAFT_BLOCK, "bash"))) + r")(\s|$)")
    return [line.strip() for line in lines if start.match(line)]


def split_simple(line: str) -> list[list[str]]:
    words = shlex.split(line, comments=True)
    groups = [list(g) for sep, g in itertools.groupby(words, lambda w: w in ("&&", "||", ";", "|")) if not sep]
    return groups


@pytest.mark.parametrize("path", MARKDOWN, ids=rel)
def test_commands_parse(path):
    problems, checked = [], 0
    for line in commands(path):
        for words in split_simple(line):
            found = check_command(words)
            if found is not None:
                checked += 1
                problems += [f"{line}\n    -> {p}" for p in found]
    assert not problems, f"{rel(path)}:\n" + "\n".join(problems)
    if path == README:
        assert checked >= 4, "the README's commands were not found: is the extraction still right?"


def section(text: str, heading: str) -> str:
    """The text under ``## heading`` up to the next heading of the same level."""
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"no section '## {heading}'"
    return m.group(1)


BENCH_SECTIONS = ("Methods", "Current results")  # the README sections about `graft-block bench`


def test_bench_options_listed_in_the_readme_exist():
    """In the README's benchmark sections, lines like `--engine lean|hf   what it does` in a block and inline
    spans like `--budget auto` are `graft-block bench` options."""
    parser = bench_parser()
    names = option_names(parser)
    listed = []
    for heading in BENCH_SECTIONS:
        text = section(README.read_text(), heading)
        listed += [line.split("  ")[0].split() for info, body in code_blocks(text) for line in body.splitlines()
                   if line.startswith("--")]
        listed += [span.split() for span in inline_code(text) if span.startswith("--")]
    assert len(listed) >= 10
    problems = []
    for words in listed:
        problems += [f"{w}: not an option of graft-block bench" for w in words if w.startswith("--") and w not in names]
        flag, value = words[0], words[1] if len(words) > 1 else None
        if value is None or value.startswith("--") or re.fullmatch(r"[A-Z]+", value) or flag not in names:
            continue  # a bare flag or a placeholder (N, S): nothing more to parse
        for argv in alternatives(words):
            problems += check_args("graft_block.eval.run_block", argv, elided=False)
    assert not problems, "\n".join(problems)


# ---- paths and links ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", MARKDOWN, ids=rel)
def test_paths_in_inline_code_exist(path):
    missing = [w for w in inline_code(path.read_text()) if is_repo_path(w) and not path_exists(w)]
    assert not missing, f"{rel(path)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("path", MARKDOWN, ids=rel)
def test_relative_links_resolve(path):
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(path.read_text())):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            problems.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{target}: no heading with anchor #{anchor} in {linked.name}")
    assert not problems, f"{rel(path)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", MARKDOWN, ids=rel)
def test_every_table_has_a_header_row(path):
    """A run of `|` lines starts with a header and a `|---|` separator: without them markdown renders the rows
    as one paragraph, and the checks that find tables by their header (methods named, presets) skip them."""
    lines = prose(path.read_text()).splitlines()
    problems = [f"line {i + 1} of the prose: {line[:60]}" for i, line in enumerate(lines)
                if line.startswith("|") and not (i and lines[i - 1].startswith("|"))
                and not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+\s*", lines[i + 1] if i + 1 < len(lines) else "")]
    assert not problems, f"{rel(path)} has tables without a header row:\n" + "\n".join(problems)


# ---- the README's own claims --------------------------------------------------------------------------------
def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; keep it <= {README_MAX_LINES} and move detail to docs/"


def test_ci_runs_the_readme_test_command():
    tests = [line.split("#")[0].strip() for info, body in code_blocks(README.read_text()) if info in SHELL_INFOS
             for line in logical_lines(body) if "-m pytest" in line]
    assert len(tests) == 1, f"expected one test command in README.md, found {tests}"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert tests[0] in ci, f".ci/run does not run the README's test command {tests[0]!r}"


def table_rows(text: str, first_header: str) -> list[list[str]]:
    """Body rows (cells) of every markdown table whose header row starts with ``| first_header |``."""
    rows, inside = [], False
    for line in prose(text).splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not inside:
                inside = cells[0] == first_header
                header = True
            elif header:
                header = False  # the |---| line
            else:
                rows.append(cells)
        else:
            inside = False
    return rows


def test_methods_table_matches_the_presets():
    from graft_block.eval.presets import method_rows

    listed = {cells[0]: cells for cells in table_rows(README.read_text(), "method") if len(cells) == 7}
    presets = {row["name"]: row for row in method_rows()}
    assert set(listed) == set(presets), (f"missing from README: {sorted(set(presets) - set(listed))}; "
                                         f"not presets: {sorted(set(listed) - set(presets))}")
    problems = []
    for name, (_, drafter, graft, budget, checkpoint, suites, about) in listed.items():
        row = presets[name]
        # method_rows writes "name: found" per bundled drafter (", "-joined), "-" for none; the README the names
        refs = {part.split(":")[0].strip(): part.split(":", 1)[-1] for part in row["checkpoint"].split(",")}
        expected_checkpoints = {"-"} if row["checkpoint"] == "-" else set(refs)
        checkpoint_names = {re.sub(r"\(.*?\)", "", c).strip() for c in checkpoint.split(",")}
        problems += [f"{name}: {what} is {mine!r}, the preset says {theirs!r}" for what, mine, theirs, ok in (
            ("drafter", drafter, row["drafter"], drafter.startswith(row["drafter"])),
            ("graft", graft, row["graft"], graft == row["graft"]),
            ("default budget", budget, str(row["budget"]), budget.startswith(str(row["budget"]))),
            ("checkpoint", checkpoint, row["checkpoint"], checkpoint_names == expected_checkpoints),
            ("suites", suites, row["suites"], suites == row["suites"]),
            ("what", about, row["about"], about == row["about"])) if not ok]
        problems += [f"{name}: bundled drafter {r} is missing" for r, status in refs.items() if "MISSING" in status]
    assert not problems, "\n".join(problems)


def test_results_tables_name_real_methods():
    from graft_block.eval.presets import PRESETS

    named = {cells[0] for cells in table_rows(README.read_text(), "method")}
    assert not named - set(PRESETS), f"README tables name methods that are not presets: {named - set(PRESETS)}"


def test_python_quick_start():
    import graft_block
    from graft_block.drafter import bundled_checkpoint, registered_types

    snippets = [body for info, body in code_blocks(README.read_text()) if info == "python"]
    assert snippets, "the README has no Python quick start"
    problems = []
    for snippet in snippets:
        tree = ast.parse(snippet)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "graft_block":
                problems += [f"graft_block has no {a.name}" for a in node.names if not hasattr(graft_block, a.name)]
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "from_config" and node.args):
                continue
            arg = node.args[0]  # a bundled name, or a config dict: its type must exist and its checkpoint be bundled
            cfg = ast.literal_eval(arg) if isinstance(arg, ast.Dict) else {"checkpoint": getattr(arg, "value", None)}
            if cfg.get("type") is not None and cfg["type"] not in registered_types():
                problems.append(f"no drafter type {cfg['type']!r}")
            name = cfg.get("checkpoint")
            if isinstance(name, str) and not re.search(r"[/.]", name) and bundled_checkpoint(name) is None:
                problems.append(f"no bundled drafter {name!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_python_quick_start_runs_lossless(smollm2, monkeypatch, capsys):
    """The README's snippet as written (its load_target handed the session's SmolLM2): greedy output equals HF's
    greedy decoding of the same messages, and the drafter it builds gets drafts accepted."""
    import graft_block
    from graft_block.testing import hf_greedy

    monkeypatch.setattr(graft_block, "load_target", lambda *a, **kw: smollm2)
    (snippet,) = [body for info, body in code_blocks(README.read_text()) if info == "python"]
    scope: dict = {}
    exec(compile(snippet, "README.md", "exec"), scope)
    res, call = scope["res"], next(n for n in ast.walk(ast.parse(snippet))
                                   if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "generate")
    messages, tokens = ast.literal_eval(call.args[0]), next(ast.literal_eval(k.value) for k in call.keywords
                                                            if k.arg == "max_new_tokens")
    assert res.tokens == hf_greedy(smollm2, smollm2.encode(messages), tokens)
    assert res.stats.tau > 1.2 and res.text in capsys.readouterr().out


# ---- the checker itself must be able to fail ----------------------------------------------------------------
@pytest.mark.parametrize("line, complaint", [
    ("graft-block bench --no-such-flag", "unrecognized arguments"),
    (".venv/bin/python eval/run_block.py --suite nope", "invalid choice"),
    ("graft-block bench --methods ar,no_such_method", "unknown method"),
    ("graft-block physics --reps three", "invalid int value"),
    ("graft-block calibrate --signal mass", "required"),
    ("graft-block train --type no_such_type", "no_such_type"),
    ("graft-block nosuch", "has no command"),
    ("python -m graft_block.no_such_module", "no module"),
    ("python eval/bench_mfd.py --budgets 16 --no-such-flag", "unrecognized arguments"),
    ("bash scripts/no_such_script.sh", "does not exist"),
])
def test_the_checker_catches(line, complaint):
    problems = [p for words in split_simple(line) for p in check_command(words) or []]
    assert any(complaint in p for p in problems), problems
