"""Bad input gets a clear error that names the problem and the fix."""
import json

import pytest
import torch

from graft_block import ConfigError, Drafter, SpeculativeDecoder, load_target
from graft_block.drafter import register
from graft_block.tree import TreeError, make_tree


def test_unknown_drafter_type():
    with pytest.raises(ConfigError, match="unknown drafter type 'nope'.*known types:.*pld"):
        Drafter.from_config({"type": "nope"})


def test_config_without_type():
    with pytest.raises(ConfigError, match="no 'type' key"):
        Drafter.from_config({"budget": 3})


def test_malformed_yaml_and_json(tmp_path):
    bad_yaml = tmp_path / "d.yaml"
    bad_yaml.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        Drafter.from_config(bad_yaml)
    bad_json = tmp_path / "d.json"
    bad_json.write_text("{type: pld,,}")
    with pytest.raises(ConfigError, match="cannot parse"):
        Drafter.from_config(bad_json)
    with pytest.raises(ConfigError, match="not a dict, an existing file, a folder"):
        Drafter.from_config(str(tmp_path / "missing.yaml"))


def test_config_from_yaml_json_and_folder(tmp_path):
    (tmp_path / "a.yaml").write_text("type: pld\nbudget: 5\n")
    assert Drafter.from_config(tmp_path / "a.yaml").budget == 5
    (tmp_path / "b.json").write_text('{"type": "pld", "budget": 7}')
    assert Drafter.from_config(str(tmp_path / "b.json")).budget == 7
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text('{"type": "pld", "budget": 2}')
    with pytest.raises(ConfigError, match="checkpoint"):  # pld takes no checkpoint: the unknown key is named
        Drafter.from_config(tmp_path / "ck")


def test_unknown_config_key_is_named():
    with pytest.raises(ConfigError, match="budgett"):
        Drafter.from_config({"type": "pld", "budgett": 3})


@pytest.mark.parametrize("budget", [0, -2, 1.5, "4"])
def test_budget_below_one(budget):
    with pytest.raises(ConfigError, match="budget must be an int >= 1"):
        Drafter.from_config({"type": "pld", "budget": budget})


@pytest.mark.parametrize("kw,msg", [
    ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
    ({"temperature": float("inf")}, "temperature must be a finite number >= 0"),
    ({"temperature": 1.0, "top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"temperature": 1.0, "top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"temperature": 1.0, "top_k": -1}, "top_k must be"),
    ({"max_new_tokens": 0}, "max_new_tokens must be"),
    ({"temperature": 1.0, "seed": "3"}, "seed must be an int.*'3'"),  # int("3") took it, int(2.7) made it 2
    ({"temperature": 1.0, "seed": 2.7}, "seed must be an int.*2.7"),
])
def test_bad_sampling_arguments(tiny_llama, kw, msg):
    args = {"max_new_tokens": 4, **kw}
    with pytest.raises(ValueError, match=msg):
        SpeculativeDecoder(tiny_llama).generate([1, 2], **args)


def test_prompt_longer_than_context(tiny_llama):
    with pytest.raises(ConfigError, match="context window of 512"):
        SpeculativeDecoder(tiny_llama).generate(list(range(100)) * 5, max_new_tokens=20)
    with pytest.raises(ConfigError, match="empty prompt"):
        SpeculativeDecoder(tiny_llama).generate([], max_new_tokens=2)


@pytest.mark.parametrize("ids", [[1, 2, 10**6], [-1, 2], torch.tensor([3, 128])])
def test_prompt_ids_outside_the_vocabulary(tiny_llama, ids):
    """Ids from another tokenizer are named, not an IndexError from inside the embedding (the tiny target has 128)."""
    assert tiny_llama.model.get_input_embeddings().weight.shape[0] == 128
    with pytest.raises(ConfigError, match=r"must lie in 0\.\.127 .*another tokenizer"):
        SpeculativeDecoder(tiny_llama).generate(ids, max_new_tokens=2)


class _BadRoot(Drafter):
    budget = 3

    def propose(self, state):
        return make_tree([state.root_token + 1, 5], [-1, 0])


class _DupSiblings(Drafter):
    budget = 3

    def propose(self, state):
        return make_tree([state.root_token, 5, 5], [-1, 0, 0])


def test_tree_root_must_match_last_token(tiny_llama):
    with pytest.raises(TreeError, match="rooted at the current bonus token"):
        SpeculativeDecoder(tiny_llama, _BadRoot()).generate([1, 2], max_new_tokens=4)


def test_duplicate_siblings_rejected(tiny_llama):
    with pytest.raises(TreeError, match="duplicate sibling tokens"):
        SpeculativeDecoder(tiny_llama, _DupSiblings()).generate([1, 2], max_new_tokens=4)


def test_tree_over_budget_rejected(tiny_llama):
    class Big(Drafter):
        budget = 1

        def propose(self, state):
            return make_tree([state.root_token, 5, 6], [-1, 0, 0])

    with pytest.raises(TreeError, match="over the budget of 1"):
        SpeculativeDecoder(tiny_llama, Big()).generate([1, 2], max_new_tokens=4)


def test_feature_layer_out_of_range(tiny_llama):
    with pytest.raises(ConfigError, match="outside 0..4"):
        tiny_llama.set_feature_layers([7])


def test_missing_target_folder(tmp_path):
    with pytest.raises(ConfigError, match="neither an embedded name"):
        load_target(str(tmp_path / "nothing"))


def test_a_target_folder_without_sdpa_attention_loads_with_eager_and_says_so(tmp_path, capsys):
    """The default attention (SDPA) meets an architecture transformers runs only eagerly (Gemma 2 here): the folder
    loads with eager attention, which applies the same additive tree mask, and stderr says so, rather than a
    ConfigError blaming its config.json."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gemma2", vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=128, head_dim=16, sliding_window=8)
    AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").save_pretrained(tmp_path / "gemma2")
    target = load_target(str(tmp_path / "gemma2"))
    assert target.engine == "hf" and target.config._attn_implementation == "eager" and target.window == 8
    assert "no SDPA attention for this architecture; loading it with eager" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="does not load: ValueError.*sdpa_paged"):  # a choice of the user's stands
        load_target(str(tmp_path / "gemma2"), attn_implementation="sdpa_paged")


def test_unusable_device_or_dtype_fails_before_the_weights_load(monkeypatch):
    """A device this torch cannot use, or a dtype torch does not have, is named with the fix before anything is
    read (the embedded target's folder is never resolved: its first conversion loads every weight)."""
    from graft_block import target as target_module

    def no_folder(name):
        raise AssertionError("the target's folder was resolved before the device and dtype were checked")

    monkeypatch.setattr(target_module, "embedded_folder", no_folder)
    with pytest.raises(ConfigError, match="not a torch device.*use cpu"):
        load_target("smollm2-135m", device="gpu")
    with pytest.raises(ConfigError, match="dtype 'bf16' is not a torch dtype"):
        load_target("smollm2-135m", dtype="bf16")
    for wrong in ("int8", torch.int8, "bool"):  # a dtype, but not one weights can take: named, not blamed on the folder
        with pytest.raises(ConfigError, match="not a floating-point dtype.*float32, bfloat16 or float16"):
            load_target("smollm2-135m", dtype=wrong)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="'cuda:0' asked for.*--device cpu"):
        load_target("smollm2-135m", device="cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="only 1 CUDA device.*cuda:0 .. cuda:0"):
        load_target("smollm2-135m", device="cuda:3")


def test_duplicate_registration():
    with pytest.raises(ConfigError, match="registered twice"):
        register("pld")(type("Other", (Drafter,), {}))


def test_bad_prompt_type(tiny_llama):
    with pytest.raises(ConfigError, match="no tokenizer"):
        SpeculativeDecoder(tiny_llama).generate("hello", max_new_tokens=2)
    with pytest.raises(ConfigError, match="prompt must be"):
        tiny_llama.encode(3.5)


def test_sampling_on_gpu_style_generator_is_explicit(tiny_llama):
    # Same seed -> same sample; different seed -> (almost surely) different text: randomness is explicit.
    dec = SpeculativeDecoder(tiny_llama)
    a = dec.generate([1, 2], max_new_tokens=20, temperature=1.0, seed=1).tokens
    b = dec.generate([1, 2], max_new_tokens=20, temperature=1.0, seed=1).tokens
    c = dec.generate([1, 2], max_new_tokens=20, temperature=1.0, seed=2).tokens
    assert a == b and a != c
    g = torch.Generator().manual_seed(5)
    assert len(dec.generate([1, 2], max_new_tokens=5, temperature=1.0, generator=g).tokens) == 5


@pytest.mark.parametrize("bad, words", [(["--config", "{bad"], "--config must be a JSON object"),
                                        (["--config", "[1]"], "--config must be a JSON object"),
                                        (["--lr", "0"], "--lr must be > 0, got 0.0"),
                                        (["--steps", "-1"], "--steps must be >= 0 (0 only evaluates), got -1"),
                                        (["--warmup", "1"], "--warmup must be in [0, 1), got 1.0"),
                                        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
                                        (["--type", "nothing"], "unknown drafter type 'nothing'"),
                                        # taken silently, or a bare error after the load, until 2026-12-08
                                        (["--gen-batch", "0"], "--gen-batch must be >= 1, got 0"),
                                        (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
                                        (["--draft-vocab", "-5"], "--draft-vocab must be >= 1, got -5"),
                                        (["--holdout", "-5"], "--holdout must be >= 0, got -5"),
                                        (["--limit", "-1"], "--limit must be >= 1, got -1"),
                                        (["--layers", "2,x"], "--layers takes comma-separated HF hidden_states"),
                                        (["--config", '{"num_anchor": 8}'], "reads no config keys ['num_anchor']"),
                                        (["--generate", "--top-p", "0"], "top_p must be in"),
                                        (["--out", ""], "--out and --run are required")])
def test_bad_training_options_fail_before_the_target_loads(bad, words, refusal):
    from graft_block.drafters import train

    assert words in refusal(train.main, ["--out", "o", "--run", "r", *bad])


def test_steps_0_still_evaluates_an_init(monkeypatch):
    """--steps 0 is valid (it only evaluates --init): the options pass and the target is asked for."""
    from graft_block.drafters import train
    from graft_block import target as target_module

    class Loaded(Exception):
        pass

    def load(*a, **k):
        raise Loaded

    monkeypatch.setattr(target_module, "load_target", load)
    with pytest.raises(Loaded):
        train.main(["--steps", "0", "--out", "o", "--run", "r"])


@pytest.mark.parametrize("kind, bundled", [("dflash", "dflash-smollm2"), ("dspark", "dspark-smollm2"),
                                           ("eagle3", "eagle3-smollm2"), ("mfd", "mfd-smollm2")])
def test_bundled_drafter_folders_fail_clearly(tmp_path, kind, bundled):
    """Checked before any weight loads (the target is a stub): a config.json that is not JSON names its file, an
    option nobody reads beside a checkpoint is named with the real options (keys of the folder's own config.json are
    not options: from_config(folder) passes them whole), and an EAGLE-3 width the heads cannot divide is named."""
    import shutil

    from graft_block.drafter import bundled_checkpoint

    src = bundled_checkpoint(bundled)
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    (broken / "config.json").write_text("{nope")
    stub = type("Stub", (), {"device": torch.device("cpu"), "dtype": torch.float32})()
    with pytest.raises(ConfigError, match=r"broken/config.json is not valid JSON"):
        Drafter.from_config({"type": kind, "checkpoint": str(broken)}, target=stub)
    if kind != "eagle3":  # eagle3 names unknown keys its own way (test_eagle3)
        with pytest.raises(ConfigError, match=rf"{kind} options \['bogus'\] .*the options are .*budget"):
            Drafter.from_config({"type": kind, "checkpoint": bundled, "bogus": 1}, target=stub)
        with pytest.raises(ConfigError, match=rf"{kind} options \['hidden_size'\] .*cannot be overridden"):
            Drafter.from_config({"type": kind, "checkpoint": bundled, "hidden_size": 100}, target=stub)
    else:
        cfg = json.loads((src / "config.json").read_text())
        cfg["hidden_size"] = 100
        (broken / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ConfigError, match="hidden_size 100 must be a multiple of num_attention_heads"):
            Drafter.from_config({"type": kind, "checkpoint": str(broken)}, target=stub)


@pytest.mark.parametrize("bad, words", [(["--holdout", "0"], "--holdout must be >= 2"),
                                        (["--holdout", "1"], "--holdout must be >= 2"),
                                        (["--min-rows", "0"], "--min-rows must be >= 1"),
                                        (["--sampled-at", "-1"], "--sampled-at must be >= 0")])
def test_dspark_calibration_options_fail_before_anything_loads(bad, words, refusal):
    """--holdout 0 used to end in torch.cat's error on an empty fit half."""
    from graft_block.drafters.dspark import calibrate

    assert words in refusal(calibrate.main, ["dspark-smollm2", "--data", "nowhere", *bad])


def test_every_command_turns_bad_input_into_one_line_and_status_2(capsys):
    """``python -m`` entry points run through run_command: a ConfigError is one line naming the program, not a
    traceback; anything else still raises."""
    import subprocess
    import sys

    from graft_block.errors import run_command

    def bad():
        raise ConfigError("budget must be >= 1")

    assert run_command(bad, "prog") == 2 and capsys.readouterr().err == "prog: error: budget must be >= 1\n"
    assert run_command(lambda: None, "prog") == 0
    with pytest.raises(KeyError):
        run_command(lambda: {}["x"], "prog")
    out = subprocess.run([sys.executable, "-m", "graft_block.drafters.dspark.calibrate", "/nowhere", "--data", "x"],
                         capture_output=True, text=True, timeout=120)  # the checkpoint is looked for before the target
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1
    assert out.stderr.startswith("python -m graft_block.drafters.dspark.calibrate: error: DSpark checkpoint '/nowhere'")


# ---- review fixes: wrong folder type, foreign matrices, corrupt files, silent overrides, bad numbers -----------
_STUB = type("Stub", (), {"device": torch.device("cpu"), "dtype": torch.float32})()


@pytest.mark.parametrize("kind, bundled, named", [("dflash", "dspark-smollm2", "dspark"),
                                                  ("dflash", "mfd-smollm2", "mfd"),
                                                  ("mfd", "dspark-smollm2", "dspark")])
def test_a_folder_of_another_drafter_type_names_that_type(kind, bundled, named):
    """Used to report its extra tensors (markov_..., mode_embed) as unexpected and blame num_hidden_layers."""
    with pytest.raises(ConfigError, match=rf"{bundled} is an? '{named}' checkpoint.*use type '{named}' or omit type"):
        Drafter.from_config({"type": kind, "checkpoint": bundled}, target=_STUB)


def test_an_adjacency_matrix_for_another_vocabulary_is_refused(tiny_llama):
    """Smaller: an IndexError in the template gather; larger (another tokenizer): ids past the embedding table."""
    from graft_block.adjacency import AdjacencyMatrix
    from graft_block.drafters.recycling import RecyclingDrafter
    from graft_block.graft import Graft

    for rows in (64, 256):
        words = rf"adjacency matrix has vocab_size {rows} but the target's vocabulary has 128 .*AdjacencyMatrix\("
        with pytest.raises(ConfigError, match=words):
            RecyclingDrafter(target=tiny_llama, matrix=AdjacencyMatrix(rows, 8), warmup_rounds=0)
        with pytest.raises(ConfigError, match=words):
            Graft.from_config({"mode": "graft"}, matrix=AdjacencyMatrix(rows, 8), target=tiny_llama)
        g = Graft(budget=4, matrix=AdjacencyMatrix(rows, 8))  # built without a target: checked by the decoder
        with pytest.raises(ConfigError, match=words):
            SpeculativeDecoder(tiny_llama, None, g)


def test_tree_and_template_name_ids_outside_the_vocabulary():
    from graft_block.adjacency import AdjacencyMatrix
    from graft_block.tree import validate
    from graft_block.tree.templates import TR80_TEMPLATE, expand_template

    with pytest.raises(TreeError, match=r"token id 200 .*outside the target vocabulary 0\.\.127"):
        validate(make_tree([5, 200], [-1, 0]), vocab_size=128)
    assert validate(make_tree([5, 127], [-1, 0]), vocab_size=128).size == 2
    with pytest.raises(TreeError, match=r"root token 200 has no row in the adjacency matrix \(rows 0\.\.127\)"):
        expand_template(200, TR80_TEMPLATE, AdjacencyMatrix(128, 8))


def test_a_missing_or_corrupt_adjacency_file_is_named(tmp_path):
    from graft_block.adjacency import AdjacencyMatrix
    from graft_block.graft import Graft

    with pytest.raises(ConfigError, match=r"adjacency matrix file .*nothing\.safetensors is missing"):
        Graft.from_config({"mode": "graft", "budget": 4, "matrix": str(tmp_path / "nothing.safetensors")})
    path = tmp_path / "m.safetensors"
    AdjacencyMatrix(16, 2).save(path)
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ConfigError, match=r"adjacency matrix file .*m\.safetensors is corrupt or truncated"):
        AdjacencyMatrix.load(path)


def _tiny_eagle3_folder(target, folder):
    from graft_block.drafters.eagle3 import Eagle3Head, build_draft_vocab, head_config_for, save_head

    head = Eagle3Head(head_config_for(target, 64))
    d2t, t2d = build_draft_vocab(torch.rand(target.vocab_size, generator=torch.Generator().manual_seed(0)), 64)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    return save_head(head, folder, extra_config={"type": "eagle3"})


def test_a_corrupt_eagle3_pytorch_model_bin_is_named(tmp_path, tiny_llama):
    from graft_block.drafters.eagle3 import load_head

    folder = _tiny_eagle3_folder(tiny_llama, tmp_path / "e3")
    torch.save({"fc.weight": torch.zeros(64, 64)}, folder / "pytorch_model.bin")  # EAGLE reads the .bin first
    whole = (folder / "pytorch_model.bin").read_bytes()
    for broken in (whole[: len(whole) // 2], b"", b"not a pickle" * 8):
        (folder / "pytorch_model.bin").write_bytes(broken)
        with pytest.raises(ConfigError, match=r"e3/pytorch_model\.bin is corrupt, truncated.*re-download"):
            load_head(folder, tiny_llama)


def test_eagle3_refuses_a_model_key_that_differs_from_its_checkpoint(tmp_path, tiny_llama):
    """draft_vocab_size 4096 beside a 64-id checkpoint was accepted and ignored."""
    folder = _tiny_eagle3_folder(tiny_llama, tmp_path / "e3")
    for key, value in (("draft_vocab_size", 4096), ("hidden_size", 100)):
        with pytest.raises(ConfigError, match=rf"eagle3 options \['{key}'\] .*cannot be overridden"):
            Drafter.from_config({"type": "eagle3", "checkpoint": str(folder), key: value}, target=tiny_llama)
    same = Drafter.from_config({"type": "eagle3", "checkpoint": str(folder), "draft_vocab_size": 64}, tiny_llama)
    assert same.head.cfg.draft_vocab_size == 64  # the checkpoint's own value is no override


def test_mfd_markov_head_with_another_draft_vocabulary_is_refused(tmp_path, tiny_llama):
    """Same backbone, but DSpark's W2 rows follow its 64-id draft vocabulary while MFD drafts over all 128 ids."""
    from graft_block.drafters import mfd as M
    from graft_block.drafters.dspark.checkpoint import new_dspark_model, save_checkpoint

    dm = new_dspark_model(tiny_llama, num_layers=1, block_size=4, markov_rank=4, draft_vocab=torch.arange(0, 128, 2))
    save_checkpoint(dm, tmp_path / "dspark", dtype=torch.float32)
    model = M.MFDModel(dm.config, dm.block_size, dm.target_layer_ids, dm.mask_token_id, dm.num_target_layers, None,
                       num_modes=2)
    heads = ("markov_head.", "confidence_head.")
    model.load_state_dict({k: v for k, v in dm.state_dict().items() if not k.startswith(heads)}, strict=False)
    with pytest.raises(ConfigError, match=r"markov: draft vocabularies differ .*64 ids.*the full vocabulary"):
        M.MFDDrafter(tiny_llama, model, budget=8, markov=str(tmp_path / "dspark"))


@pytest.mark.parametrize("cfg, words", [
    ({"type": "pld", "max_ngram": 0}, r"pld needs ints 1 <= min_ngram <= max_ngram"),
    ({"type": "pld", "min_ngram": 3, "max_ngram": 2}, r"pld needs ints 1 <= min_ngram <= max_ngram"),
    ({"type": "recycling", "budget": 20, "depth": 1, "width": 2, "warmup_rounds": 0},
     r"recycling template .*at most 2 nodes, asked for 20: raise depth or width"),
    ({"type": "recycling", "depth": 0, "warmup_rounds": 0}, r"template depth must be an int >= 1"),
    ({"type": "recycling", "template": [[1, 0]], "warmup_rounds": 0}, r"recycling template .*before .*its prefix"),
])
def test_drafter_construction_raises_config_errors(cfg, words):
    with pytest.raises(ConfigError, match=words):
        Drafter.from_config(cfg)


@pytest.mark.parametrize("kw, words", [
    ({"template_depth": 0}, r"template_depth must be an int >= 1"),
    ({"template_width": 0}, r"template_width must be an int >= 1"),
    ({"templates": {"default": [[0, 0]]}}, r"templates\['default'\]: .*prefix"),
    ({"reference_budget": 0}, r"reference_budget must be an int >= 1"),
    ({"reference_budget": -60}, r"reference_budget must be an int >= 1"),
    ({"reference_budget": 1.5}, r"reference_budget must be an int >= 1"),
])
def test_graft_numbers_fail_at_construction(kw, words):
    """reference_budget 0 was a ZeroDivisionError in round 1 (negative: silently 0 draft nodes); template_depth 0
    a TreeError."""
    from graft_block.adjacency import AdjacencyMatrix
    from graft_block.graft import Graft

    with pytest.raises(ConfigError, match=words):
        Graft(budget=8, matrix=AdjacencyMatrix(16, 2), **kw)


@pytest.mark.parametrize("table, words", [
    ({"1": 0.0, "8": 0.02}, r"entry '1': 0\.0: seconds must be a finite number > 0"),
    ({"1": 0.01, "8": -0.02}, r"entry '8': -0\.02: seconds must be"),
    ({"1": 0.01, "8": float("nan")}, r"entry '8': nan: seconds must be"),
    ({"1": 0.01, "8": "fast"}, r"entry '8': 'fast': seconds must be"),
    ({"1": 0.01, "2.5": 0.02}, r"entry '2\.5': 0\.02: sizes must be integers >= 1"),
    ({"0": 0.01, "8": 0.02}, r"entry '0': 0\.01: sizes must be integers >= 1"),
    ({"one": 0.01}, r"entry 'one': 0\.01: sizes must be integers >= 1"),
])
def test_a_bad_verify_cost_curve_entry_is_named(table, words):
    """A 0-second entry divided by zero in round 1; a non-integer size was a raw ValueError."""
    from graft_block.schedule import ConfidenceSchedule
    from graft_block.tree.schedule import curve_cost

    for stop in ("best", "first_drop"):
        with pytest.raises(ConfigError, match=words):
            ConfidenceSchedule({"median_s": table}, stop=stop)
    with pytest.raises(TreeError, match=words):
        curve_cost({"median_s": table}, 4)


def test_a_falling_curve_end_and_a_zero_callable_cost_never_price_a_tree_at_zero():
    """Past the largest measured size a falling last segment used to extrapolate to 0 s and below (a schedule then
    divided by it); a callable cost returning 0 did the same silently."""
    from graft_block.tree import from_paths
    from graft_block.tree.schedule import curve_cost, schedule_tree

    falling = {"median_s": {"1": 0.010, "8": 0.020, "16": 0.015}}
    assert curve_cost(falling, 64) == pytest.approx(0.015)  # flat past 16, not 0.015 - 48 * 0.000625 < 0
    tree = from_paths(0, [[1, 2], [3]], path_scores=[[-0.1, -0.2], [-0.5]])
    with pytest.raises(TreeError, match=r"cost\(1\) returned 0\.0: a verify cost must be a finite number"):
        schedule_tree(tree, torch.exp(tree.scores.double()), lambda n: 0.0)


def test_an_entry_point_naming_an_unregistered_drafter_class_registers_it(monkeypatch):
    """design.md: a third-party drafter is decorated with @register or listed under the entry-point group; a class
    that is only listed is constructible under the entry point's name."""
    import importlib.metadata

    from graft_block import drafter as drafter_mod
    from graft_block.drafters.pld import PromptLookupDrafter

    class ListedOnly(PromptLookupDrafter):
        pass

    class FakeEntryPoint:
        name = "listed_only_drafter"

        def load(self):
            return ListedOnly

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [FakeEntryPoint()])
    monkeypatch.delitem(drafter_mod._REGISTRY, "listed_only_drafter", raising=False)
    try:
        d = Drafter.from_config({"type": "listed_only_drafter", "budget": 3})
        assert type(d) is ListedOnly and d.budget == 3 and ListedOnly.type_name == "listed_only_drafter"
    finally:
        drafter_mod._REGISTRY.pop("listed_only_drafter", None)


# ---- audit of Drafter.from_config: text where a number goes, a checkpoint that is no path, a stray 'graft' -------
@pytest.mark.parametrize("cfg, words", [
    ({"type": "dflash", "num_layers": "1", "seed": 1}, r"num_layers.*'1'"),
    ({"type": "dflash", "num_layers": 1, "seed": "a"}, r"seed.*'a'"),
    ({"type": "mfd", "num_layers": 1, "mode_init_scale": "big"}, r"mode_init_scale.*'big'"),
])
def test_a_text_value_a_drafter_build_refused_is_named(tiny_llama, cfg, words):
    """HF's strict config check, torch.manual_seed('a') and float('big') used to escape as their own tracebacks."""
    with pytest.raises(ConfigError, match=words):
        Drafter.from_config(cfg, target=tiny_llama)


def test_from_config_names_the_option_a_deep_value_error_quotes():
    @register("audit_int")
    class Widths(Drafter):
        def __init__(self, budget: int = 1, width: int = 8):
            self.width = int(width)  # a ValueError, as many builds' int(...) of an option give

    try:
        with pytest.raises(ConfigError, match=r"'audit_int': width='x' was refused \(ValueError.*its type"):
            Drafter.from_config({"type": "audit_int", "width": "x"})
    finally:
        from graft_block import drafter as drafter_mod

        drafter_mod._REGISTRY.pop("audit_int", None)


def test_an_error_that_quotes_no_option_still_raises_as_itself():
    @register("audit_boom")
    class Boom(Drafter):
        def __init__(self, budget: int = 1, note: str = "ok"):
            raise RuntimeError("a bug, not a config mistake")

    try:
        with pytest.raises(RuntimeError, match="a bug"):
            Drafter.from_config({"type": "audit_boom", "note": "fine"})
    finally:
        from graft_block import drafter as drafter_mod

        drafter_mod._REGISTRY.pop("audit_boom", None)


@pytest.mark.parametrize("cfg, words", [
    ({"type": "dflash", "checkpoint": 5}, "dflash checkpoint must be a folder path .* got int 5"),
    ({"type": "mfd", "checkpoint": ["mfd-smollm2"]}, "mfd checkpoint must be a folder path .* got list"),
    ({"type": ""}, "'type' must be a drafter type name, got '': one of .*pld"),
    ({"type": 3, "budget": 2}, "'type' must be a drafter type name, got 3"),
    ({"type": "pld", "graft": {"mode": "graft"}}, r"'graft' entry is the calibration .* beside 'drafter'"),
    ({"type": "pld", "graft": "x"}, r"'graft' entry is the calibration"),
])
def test_a_checkpoint_type_or_graft_entry_of_the_wrong_kind_is_named(cfg, words):
    """A checkpoint 5 was pathlib's TypeError; type '' said 'no type key'; Graft's settings nested in the drafter
    config were kept as a calibration that Graft then ignored without a word."""
    with pytest.raises(ConfigError, match=words):
        Drafter.from_config(cfg, target=_STUB)


def test_a_saved_calibration_still_rides_on_the_drafter():
    cal = {"signal": "mass", "checkpoints": [0], "thresholds": {"0": -1.0}}
    assert Drafter.from_config({"type": "pld", "graft": cal}).graft_calibration == cal


@pytest.mark.parametrize("bad, words", [(["--quantiles", "5", "10"], "--quantiles must be fractions in [0, 1)"),
                                        (["--prompts", "0"], "--prompts must be >= 1, got 0"),
                                        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
                                        (["--warmup-rounds", "-1"], "--warmup-rounds must be >= 0, got -1")])
def test_bad_calibrate_options_fail_before_the_target_loads(bad, words, refusal, monkeypatch):
    """Percent quantiles were refused only after the load, the warm-up and the recording pass."""
    from graft_block import calibrate as C

    monkeypatch.setattr(C, "load_target", lambda *a, **k: pytest.fail("the target loaded before the check"))
    assert words in refusal(C.main, ["--drafter", "pld", *bad])
