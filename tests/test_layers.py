"""Imports point one way: eval -> drafters -> graft_block (core) -> tree, with no cycle between modules, and
tree/ stays model-free. Read from the source (AST), so lazy imports inside functions count too. Every tracked
.py and .sh line fits in 120 columns."""
import ast
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Layer of each source folder (higher may import lower, never the reverse) and its installed package name.
FOLDERS = {"tree": (0, "graft_block.tree"), "graft_block": (1, "graft_block"), "drafters": (2, "graft_block.drafters"),
           "eval": (3, "graft_block.eval")}
LAYER_NAMES = {0: "tree", 1: "graft_block (core)", 2: "drafters", 3: "eval"}
MODEL_LIBS = ("transformers", "diffusers", "triton", "safetensors")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    pkg = FOLDERS[rel.parts[0]][1]
    rest = [p for p in rel.with_suffix("").parts[1:] if p != "__init__"]
    return ".".join([pkg, *rest])


def layer_of(mod: str) -> int | None:
    """Layer of an imported graft_block module; None for anything outside the project."""
    if mod != "graft_block" and not mod.startswith("graft_block."):
        return None
    for _, (layer, pkg) in sorted(FOLDERS.items(), key=lambda kv: -len(kv[1][1])):
        if mod == pkg or mod.startswith(pkg + "."):
            return layer
    return None


def imports_of(path: Path) -> list[tuple[str, int]]:
    """(absolute module, line) for every import statement and literal importlib.import_module call."""
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            # `from graft_block import tree` imports a subpackage: record the names as modules too
            out += [(mod, node.lineno)] + [(f"{mod}.{a.name}", node.lineno) for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append((node.args[0].value, node.lineno))
    return out


def source_files(root: Path = ROOT) -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (root / folder).rglob("*.py"))


def violations(files: list[Path]) -> list[str]:
    bad = []
    for path in files:
        mine = FOLDERS[path.relative_to(ROOT).parts[0]][0]
        seen = set()
        for mod, line in imports_of(path):
            layer = layer_of(mod)
            if layer is not None and layer > mine and (line, layer) not in seen:
                seen.add((line, layer))
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod} ({LAYER_NAMES[layer]} is above "
                           f"{LAYER_NAMES[mine]})")
            if mine == 0 and mod.split(".")[0] in MODEL_LIBS:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}: tree/ must stay model-free")
    return bad


def cycles(files: list[Path]) -> list[list[str]]:
    """Strongly connected groups of project modules that import each other (directly or through others)."""
    names = {module_name(p): p for p in files}
    graph = {}
    for name, path in names.items():
        deps = set()
        for mod, _ in imports_of(path):
            # `import a.b.c` depends on the deepest project module it names
            while mod and mod not in names:
                mod = mod.rpartition(".")[0]
            if mod and mod != name and not name.startswith(mod + "."):  # a module may use its own package
                deps.add(mod)
        graph[name] = deps
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_imports_point_one_way():
    bad = violations(source_files())
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_circular_imports():
    found = cycles(source_files())
    assert not found, "modules importing each other: " + "; ".join(" <-> ".join(c) for c in found)


def test_checker_catches_an_upward_import_and_a_cycle(tmp_path, monkeypatch):
    """The checks above can fail: an upward import from the core and a two-module cycle are reported."""
    fake = tmp_path / "graft_block"
    fake.mkdir()
    (fake / "a.py").write_text("def f():\n    from graft_block.drafters import dflash\n    from . import b\n")
    (fake / "b.py").write_text("from .a import f\n")
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "t.py").write_text("import transformers\nfrom graft_block.decoder import x\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    files = [fake / "a.py", fake / "b.py", tmp_path / "tree" / "t.py"]
    bad = violations(files)
    assert any("graft_block/a.py:2 imports graft_block.drafters" in b for b in bad)
    assert any("model-free" in b for b in bad) and any("tree/t.py:2 imports graft_block.decoder" in b for b in bad)
    assert cycles(files) == [["graft_block.a", "graft_block.b"]]


@pytest.mark.parametrize("folder", list(FOLDERS))
def test_every_folder_is_a_package(folder):
    assert (ROOT / folder / "__init__.py").exists()


MAX_COLUMNS = 120


def test_code_lines_fit_120_columns():
    """No line of a tracked .py or .sh file is longer than 120 characters, except one that holds a URL."""
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not available")
    listed = subprocess.run([git, "-C", str(ROOT), "ls-files", "-z", "--", "*.py", "*.sh"],
                            capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    files = [name for name in listed.stdout.split("\0") if name]
    assert files, "git ls-files listed no .py or .sh file: is the pattern still right?"
    long = []
    for name in files:
        path = ROOT / name
        if not path.is_file():
            continue  # tracked but deleted in this working tree
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").split("\n"), 1):
            if len(line) > MAX_COLUMNS and "http://" not in line and "https://" not in line:
                long.append(f"{name}:{number} ({len(line)} characters)")
    assert not long, f"lines over {MAX_COLUMNS} characters:\n" + "\n".join(long)
