"""Entry points name bad input with the fix: target folders, bench flags and methods, prompts, context, drafters."""
import json
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from graft_block import ConfigError, Drafter, SpeculativeDecoder, load_target
from graft_block.errors import MethodUnavailable
from graft_block.eval import measure, run_block
from graft_block.eval.methods import make_method
from graft_block.eval.presets import PRESETS
from graft_block.testing import tiny_target


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A complete tiny target folder (weights and config, no tokenizer) to copy and break."""
    folder = tmp_path_factory.mktemp("tiny-target")
    tiny_target("llama").model.save_pretrained(folder)
    return folder


def _copy(src, dst, weights: bool = True):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    if weights:
        (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    return dst


def test_target_folder_without_or_with_broken_weights_is_named(saved, tmp_path):
    bare = _copy(saved, tmp_path / "bare", weights=False)
    with pytest.raises(ConfigError, match=f"target folder {bare} does not load: OSError.*complete weight files"):
        load_target(str(bare), engine="hf")
    corrupt = _copy(saved, tmp_path / "corrupt", weights=False)
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file" * 8)
    with pytest.raises(ConfigError, match="does not load: SafetensorError.*re-save or re-download"):
        load_target(str(corrupt), engine="hf")


def test_target_folder_with_missing_weights_is_refused_not_filled_randomly(saved, tmp_path, caplog):
    part = _copy(saved, tmp_path / "part")
    weights = load_file(part / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, part / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"incomplete: 1 weights missing .*up_proj.*fill randomly; re-save"):
        load_target(str(part), engine="hf")
    assert "LOAD REPORT" not in caplog.text  # our error names the keys; HF's table above it is held back
    # a whole folder with one extra tensor loads, and HF's report on it is shown
    extra = _copy(saved, tmp_path / "extra")
    weights = load_file(extra / "model.safetensors")
    weights["model.unused_probe.weight"] = torch.zeros(2)
    save_file(weights, extra / "model.safetensors", metadata={"format": "pt"})
    assert load_target(str(extra), engine="hf").num_layers == 4
    assert "LOAD REPORT" in caplog.text and "unused_probe" in caplog.text
    # a drafter checkpoint given as the target: said so, with the fix
    cfg = json.loads((part / "config.json").read_text())
    (part / "config.json").write_text(json.dumps({**cfg, "type": "dflash"}))
    with pytest.raises(ConfigError, match="drafter checkpoint \\(type .dflash.\\), not a target"):
        load_target(str(part), engine="hf")
    assert load_target(str(saved), engine="hf").num_layers == 4  # the complete folder still loads
    # a tied LM head (saved once, as the embedding) is not a missing weight
    from transformers import AutoModelForCausalLM, LlamaConfig

    tied = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(tied).save_pretrained(tmp_path / "tied")
    assert load_target(str(tmp_path / "tied"), engine="hf").vocab_size == 64


def test_build_methods_skips_only_unavailable_methods():
    target = tiny_target("llama", engine="hf")
    typo = {"drafter": {"type": "pld", "budgt": 4}}
    with pytest.raises(ConfigError, match="method 'typo' cannot be built: bad config for drafter 'pld'"):
        run_block.build_methods(["typo"], {"typo": typo}, target, [None], None, [], False)
    absent = {"drafter": {"type": "dflash", "checkpoint": "@no-such-drafter"}}
    methods, skipped, _ = run_block.build_methods(["absent"], {"absent": absent}, target, [None], None, [], False)
    assert methods == [] and "not installed" in skipped["absent"]
    # a method the suite added (not named by the user) is skipped with its reason, e.g. a SmolLM2 drafter beside
    # another --target; the same method named by the user stops the run
    methods, skipped, _ = run_block.build_methods(["typo"], {"typo": typo}, target, [None], None, [], False,
                                                  named=set())
    assert methods == [] and "budgt" in skipped["typo"]
    with pytest.raises(ConfigError, match="method 'typo' cannot be built"):
        run_block.build_methods(["typo"], {"typo": typo}, target, [None], None, [], False, named={"typo"})
    with pytest.raises(MethodUnavailable, match="tokenizer-backed"):  # the target lacks what the peer needs
        make_method("hf_pld", PRESETS["hf_pld"], target, None)


@pytest.mark.parametrize("bad, words", [(["--warmup-tokens", "-3"], "--warmup-tokens must be >= 0"),
                                        (["--temperature", "0.7x"], "--temperature takes a number"),
                                        (["--threads", "-1"], "--threads must be >= 1"),
                                        (["--threads", "0"], "--threads must be >= 1"),
                                        (["--time-limit", "0"], "--time-limit must be > 0"),
                                        (["--pilot-prompts", "0"], "--pilot-prompts must be >= 1")])
def test_bench_flags_fail_before_the_model_loads(bad, words, tmp_path):
    # a missing target folder: a check after the load would name the folder instead of the flag
    with pytest.raises(ConfigError, match=words):
        run_block.main(["--target", str(tmp_path / "no-such-model"), "--methods", "ar", *bad,
                        "--out", str(tmp_path / "o")])


def test_prompt_ids_of_any_integer_type(tiny_llama):
    want = torch.tensor([3, 4, 5])
    assert torch.equal(tiny_llama.encode([np.int64(3), np.int32(4), 5]), want)
    assert torch.equal(tiny_llama.encode(list(want)), want)  # 0-d tensors
    assert torch.equal(tiny_llama.encode(tuple(want.numpy())), want)
    with pytest.raises(ConfigError, match="only token ids.*bool"):
        tiny_llama.encode([True, 4])
    with pytest.raises(ConfigError, match="only token ids.*float"):
        tiny_llama.encode([3, 4.5])
    with pytest.raises(ConfigError, match="integer token ids, got dtype torch.float32"):
        tiny_llama.encode(torch.tensor([3.0, 4.7]))


def test_turn_outgrowing_the_context_is_skipped_not_fatal(capsys):
    target = tiny_target("llama", max_positions=64, engine="hf")
    ar = make_method("ar", PRESETS["ar"], target, None)
    prompts = [{"id": "mt", "turns": [[5, 6, 7, 8], list(range(1, 61))]}]
    too_long = []
    recs = measure.run_interleaved(target, [ar], prompts, 8, [0.0], progress=False, warmup_tokens=0,
                                   too_long=too_long)
    assert [r["turn"] for r in recs] == [0] and [(t["method"], t["turn"]) for t in too_long] == [("ar", 1)]
    assert "context window of 64" in too_long[0]["reason"] and "[too long] ar on mt turn 1" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--max-new-tokens 64 leaves no room.*window of 64"):
        measure.check_context(target, 64)


def test_tokenizer_failure_is_named_where_text_needs_it(saved, tmp_path):
    broken = _copy(saved, tmp_path / "tok")
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": {')
    (broken / "tokenizer_config.json").write_text("{}")
    t = load_target(str(broken), engine="hf")
    assert t.tokenizer is None
    with pytest.raises(ConfigError, match=f"no tokenizer \\(loading the tokenizer from {broken} failed "
                                          "\\(JSONDecodeError.*pass token ids"):
        t.encode("hello")
    with pytest.raises(ConfigError, match=f"prompts are text but loading the tokenizer from {broken} failed"):
        run_block.check_target(t, 8, [{"id": "a", "turns": ["hello"]}])
    plain = load_target(str(saved), engine="hf")
    with pytest.raises(ConfigError, match=f"{saved} holds no tokenizer files"):
        plain.encode("hello")


def test_drafter_built_on_another_target_is_refused():
    a, b = tiny_target("llama", engine="hf"), tiny_target("llama", engine="hf")
    d = Drafter.from_config({"type": "dflash", "num_layers": 1, "target_layer_ids": [0, 2], "block_size": 4,
                             "seed": 1}, target=a)
    with pytest.raises(ConfigError, match="another object.*Drafter.from_config\\(cfg, target=target\\)"):
        SpeculativeDecoder(b, d)
    assert len(SpeculativeDecoder(a, d).generate([3, 4, 5], max_new_tokens=4).tokens) == 4


# ---- audit of the bench's flags: repeats, a replaced baseline, typos in a method, ignored values -----------------
def _bench_files(tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "p.jsonl").write_text('{"turns": [[1, 2, 3]]}\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "unbuilt").mkdir(exist_ok=True)
    (tmp_path / "unbuilt" / "CMakeLists.txt").write_text("project(llama.cpp)\n")  # sources, no build
    (tmp_path / "noexec" / "bin").mkdir(parents=True, exist_ok=True)
    (tmp_path / "noexec" / "bin" / "llama-speculative-simple").write_text("")  # not executable
    for name, text in (("shadow", "name: ar\ndrafter: {type: pld, budget: 3}\n"),
                       ("typo", "name: m\ndrafter: {type: pld}\ngrafts: {mode: graft}\n"),
                       ("half", 'name: m\ndrafter: {type: pld, budget: "{budget}"}\ndefault_budget: 1.5\n'),
                       ("five", "name: m\ndrafter: 5\n"), ("blank", 'name: m\ndrafter: ""\n'),
                       ("sched", "name: m\ndrafter: {type: pld}\nschedule: yes please\n"),
                       ("graft", "name: m\ndrafter: {type: pld}\ngraft: true\n"),
                       ("hfclash", "name: m\nhf: {max_new_tokens: 5}\n")):
        (tmp_path / f"{name}.yaml").write_text(text)


@pytest.mark.parametrize("bad, words", [
    (["--methods", "ar,pld,pld"], "--methods names 'pld' twice"),
    (["--methods", "pld", "--budget", "8,8"], "--budget lists a budget twice"),
    (["--temperature", "0,1,0"], "--temperature lists a temperature twice"),
    (["--methods", ""], "unknown method ''"),
    (["--temperature", ""], "--temperature takes a number"),
    (["--prompts", ""], "unknown prompt set ''"),
    (["--config", "{tmp}/shadow.yaml"], "a --config method is called 'ar', the name of our AR loop"),
    (["--config", "{tmp}/typo.yaml", "--methods", "m"], r"method 'm' has unknown keys \['grafts'\]"),
    (["--config", "{tmp}/half.yaml", "--methods", "m"], "default_budget must be an int >= 1.*got 1.5"),
    (["--config", "{tmp}/five.yaml", "--methods", "m"], "method 'm': drafter must be a drafter config.*got 5"),
    (["--config", "{tmp}/blank.yaml", "--methods", "m"], "method 'm': drafter must be a drafter config.*got ''"),
    (["--config", "{tmp}/sched.yaml", "--methods", "m"], "method 'm': schedule must be a mapping.*got 'yes please'"),
    (["--config", "{tmp}/graft.yaml", "--methods", "m"], "method 'm': graft must be a mapping.*got True"),
    (["--config", "{tmp}/hfclash.yaml", "--methods", "m"], "method .m.: hf must be a mapping .* without max_new"),
    (["--time-limit", "nan"], "--time-limit must be > 0 seconds, got nan"),
    (["--out", "{tmp}/afile"], "{tmp}/afile is a file, not a folder"),
    (["--out", "{tmp}/afile/run"], "{tmp}/afile is a file, not a folder"),
    (["--llamacpp", "{tmp}/no-build"], "--llamacpp {tmp}/no-build: no llama-speculative-simple.*does not exist"),
    (["--llamacpp", "{tmp}/unbuilt"],
     "--llamacpp {tmp}/unbuilt: .*llama.cpp sources or a configured build, but .* not built"),
    (["--llamacpp", "{tmp}/noexec"], "--llamacpp {tmp}/noexec: .*bin/llama-speculative-simple is not executable"),
])
def test_bench_refuses_what_would_run_wrong_before_the_model_loads(bad, words, tmp_path, refusal):
    """Each ran on without a word: a repeated method shared one turn-2 history (and record key) with its twin, a
    --config 'ar' replaced the baseline of every ratio, 'grafts' ran without Graft, default_budget 1.5 ran at 1,
    'drafter: 5' was refused only after the target loaded and 'drafter: ""' ran as AR, a text schedule ran as the
    default one and 'graft: true' died in dict(),
    an empty --methods/--temperature/--prompts fell back to the suite's, --time-limit nan never fired; --out on a file
    was a FileExistsError, and a --llamacpp folder without the binary a skip after the model loaded (the refusal
    says why: no such path, sources not built, a binary that is not executable)."""
    _bench_files(tmp_path)
    argv = ["--methods", "ar", "--prompts", f"{tmp_path}/p.jsonl", "--out", f"{tmp_path}/o"]
    msg = refusal(run_block.main, argv + [a.replace("{tmp}", str(tmp_path)) for a in bad])
    assert re.search(words.replace("{tmp}", str(tmp_path)), msg), msg


def test_run_arms_checks_prompts_and_budgets_before_its_own_load(tmp_path, refusal):
    """The bench_*.py scripts load their target in run_arms: only the number flags were checked before it."""
    _bench_files(tmp_path)
    table = {"pld4": {"drafter": {"type": "pld", "budget": 4}}}
    for rest, words in ((["--prompts", f"{tmp_path}/empty.jsonl"], "holds no records"),
                        (["--budget", "4,4"], "--budget lists a budget twice"),
                        (["--temperature", "0,0"], "--temperature lists a temperature twice")):
        assert words in refusal(lambda argv: run_block.run_arms(table, ["--out", f"{tmp_path}/o"], argv), rest)


def test_bench_says_which_given_flags_change_nothing(tmp_path, monkeypatch, capsys):
    """--budget beside a method without a '{budget}' (a 64-node tree's size is fixed), and --top-p with every
    temperature 0, were dropped without a word."""
    from graft_block import target as target_module

    class Loaded(Exception):
        pass

    def load(*a, **k):
        raise Loaded

    monkeypatch.setattr(target_module, "load_target", load)
    _bench_files(tmp_path)
    with pytest.raises(Loaded):
        run_block.main(["--methods", "ar,pld,dflash_ddtree64", "--budget", "8", "--top-p", "0.9", "--prompts",
                        f"{tmp_path}/p.jsonl", "--out", f"{tmp_path}/o"])
    err = capsys.readouterr().err
    assert "[budget] --budget 8 does not change dflash_ddtree64:" in err and "pld" not in err.split("[budget]")[1]
    assert "[sampling] --top-k / --top-p filter sampling at T > 0" in err and "max_budget" not in err
    with pytest.raises(Loaded):  # past a chain's block: it runs at its cap, and says so
        run_block.main(["--methods", "ar,pld,dspark_chain", "--budget", "8,32", "--prompts", f"{tmp_path}/p.jsonl",
                        "--out", f"{tmp_path}/o"])
    err = capsys.readouterr().err
    assert "[budget] --budget 8,32 runs dspark_chain (15) at most at the max_budget in brackets" in err
    with pytest.raises(Loaded):  # a sampled temperature: the filters apply, nothing to say
        run_block.main(["--methods", "ar,pld", "--top-p", "0.9", "--temperature", "0,1", "--prompts",
                        f"{tmp_path}/p.jsonl", "--out", f"{tmp_path}/o"])
    assert "[sampling]" not in capsys.readouterr().err


def test_an_empty_cache_variable_is_unset_not_the_current_folder(monkeypatch):
    from pathlib import Path

    import graft_block

    monkeypatch.setenv("GRAFT_BLOCK_CACHE", "")
    assert graft_block.cache_root() == Path.home() / ".cache" / "graft_block"
    monkeypatch.setenv("GRAFT_BLOCK_CACHE", "/x/c")
    assert graft_block.cache_root() == Path("/x/c")


@pytest.mark.parametrize("module, args", [("graft_block.eval.physics", []), ("graft_block.eval.expected_tau", []),
                                          ("graft_block.eval.bench_skinny", []),
                                          ("graft_block.onpolicy", ["--out", "o"]),
                                          ("graft_block.drafters.dspark.calibrate", ["folder", "--data", "d"])])
@pytest.mark.parametrize("threads", ["0", "-2"])
def test_every_threads_flag_refuses_zero_or_fewer(module, args, threads, monkeypatch, tmp_path):
    # torch's own set_num_threads(0) error named no flag, and `if args.threads:` quietly ignored a 0
    import importlib

    monkeypatch.chdir(tmp_path)
    before = torch.get_num_threads()
    with pytest.raises(ConfigError, match="--threads must be >= 1"):
        importlib.import_module(module).main([*args, "--threads", threads])
    assert torch.get_num_threads() == before


def test_graft_matrix_sizes_are_counts(tiny_llama):
    # int("x") raised a bare ValueError, and int(2.7) warmed a k = 2 matrix without a word
    for key, value in (("k", "x"), ("k", 2.7), ("k", 0), ("warmup_rounds", -1)):
        with pytest.raises(ConfigError, match=f"graft {key} must be an int >= [01], got {value!r}"):
            make_method("m", {"drafter": {"type": "pld"}, "graft": {"mode": "graft", key: value}}, tiny_llama, 4)
    for key, value in (("k", "x"), ("warmup_tokens", "x")):  # the bench's shared warm-up took them first
        with pytest.raises(ConfigError, match=f"{key} .*must be an int >= [01].*got 'x'"):
            make_method("m", {"drafter": {"type": "recycling", key: value}}, tiny_llama, 4)
    from graft_block.graft import Graft

    with pytest.raises(ConfigError, match="graft k must be an int >= 1, got 'x'"):
        Graft.from_config({"mode": "graft", "k": "x"}, target=tiny_llama)  # the API path checks the same
