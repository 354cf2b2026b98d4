"""Entry points name bad input with the fix: target folders, bench flags and methods, prompts, context, drafters."""
import json

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
                                        (["--time-limit", "0"], "--time-limit must be > 0")])
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
