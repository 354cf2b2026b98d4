"""The real embedded target: SmolLM2-135M-Instruct (fp32, CPU). Lossless identity against HF generate, and the
T=1 law of the bundled MFD drafter's mixed trees."""
from collections import Counter

import pytest
import torch

from graft_block import Drafter, SpeculativeDecoder
from graft_block.data import humaneval
from graft_block.drafter import bundled_checkpoint
from graft_block.errors import ConfigError
from graft_block.sampling import SamplingConfig
from graft_block.testing import chi_square_test, exact_sequence_probs, hf_greedy

pytestmark = pytest.mark.slow


def test_embedded_target_shape(smollm2):
    assert (smollm2.num_layers, smollm2.hidden_size, smollm2.vocab_size) == (30, 576, 49152)
    assert smollm2.tokenizer is not None and smollm2.eos_token_ids


def test_pld_greedy_identity_humaneval(smollm2):
    """3 HumanEval prompts x 80 tokens with prompt lookup: token-identical to HF greedy, and PLD accepts."""
    dec = SpeculativeDecoder(smollm2, Drafter.from_config({"type": "pld", "budget": 10}))
    accepted = 0
    for prob in humaneval(3):
        ids = smollm2.encode([{"role": "user", "content": prob["turns"][0]}])
        ref = hf_greedy(smollm2, ids, 80)
        res = dec.generate(ids, max_new_tokens=80)
        assert res.tokens == ref, f"{prob['id']}: PLD output differs from HF greedy"
        accepted += sum(k * c for k, c in res.stats.accept_hist.items())
    assert accepted > 20  # PLD really proposed and got accepted on code prompts


def test_chat_messages_and_eos(smollm2):
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    res = SpeculativeDecoder(smollm2).generate(msgs, max_new_tokens=40)
    assert "Paris" in res.text
    assert res.tokens[-1] in smollm2.eos_token_ids and len(res.tokens) < 40  # stopped on EOS
    assert res.tokens == hf_greedy(smollm2, smollm2.encode(msgs), 40)


def test_smollm2_sampling_runs_and_is_seeded(smollm2):
    dec = SpeculativeDecoder(smollm2, Drafter.from_config({"type": "pld", "budget": 6}))
    msgs = [{"role": "user", "content": "Name three colours."}]
    a = dec.generate(msgs, max_new_tokens=24, temperature=0.8, top_p=0.9, seed=3)
    b = dec.generate(msgs, max_new_tokens=24, temperature=0.8, top_p=0.9, seed=3)
    assert a.tokens == b.tokens and len(a.tokens) >= 1


# ---- the trained drafter on SmolLM2 ------------------------------------------------------------------------
FIBONACCI = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]


@pytest.fixture(scope="module")
def fibonacci_reference(smollm2):
    """HF greedy's first 64 tokens for the Fibonacci prompt, computed once (seconds on SmolLM2) for the tests that
    share the prompt; a shorter reference is its prefix (greedy is, and EOS stops both at the same token)."""
    return hf_greedy(smollm2, smollm2.encode(FIBONACCI), 64)


def test_smollm2_mfd_lossless(smollm2, fibonacci_reference):
    folder = bundled_checkpoint("mfd-smollm2")
    if folder is None:
        pytest.skip("drafters/checkpoints/mfd-smollm2 is not present")
    france = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    d = Drafter.from_config({"type": "mfd", "checkpoint": str(folder), "budget": 32}, target=smollm2)
    dec = SpeculativeDecoder(smollm2, d)
    for p, ref in ((FIBONACCI, fibonacci_reference), (france, hf_greedy(smollm2, smollm2.encode(france), 64))):
        res = dec.generate(p, max_new_tokens=64)
        assert res.tokens == ref
        assert res.stats.tau > 1.0


def test_smollm2_mfd_with_a_shared_markov_head_is_lossless(smollm2, fibonacci_reference):
    """mfd-smollm2's modes under dspark-smollm2's Markov head (both on the dflash-smollm2 backbone): greedy output
    equals HF greedy; a Markov head from another backbone is refused, naming the first tensor that differs."""
    if bundled_checkpoint("mfd-smollm2") is None or bundled_checkpoint("dspark-smollm2") is None:
        pytest.skip("the bundled mfd-smollm2 / dspark-smollm2 checkpoints are not present")
    d = Drafter.from_config({"type": "mfd", "checkpoint": "mfd-smollm2", "budget": 16, "markov": "dspark-smollm2"},
                            target=smollm2)
    res = SpeculativeDecoder(smollm2, d).generate(FIBONACCI, max_new_tokens=48)
    assert res.tokens == fibonacci_reference[:48] and res.stats.tau > 1.0
    assert d.describe()["markov"] == "dspark-smollm2"
    with pytest.raises(ConfigError, match="backbone differs from this MFD checkpoint's at"):
        Drafter.from_config({"type": "mfd", "num_layers": 1, "seed": 3, "budget": 8, "markov": "dspark-smollm2"},
                            target=smollm2)
    with pytest.raises(ConfigError, match="best_mode"):
        Drafter.from_config({"type": "mfd", "checkpoint": "mfd-smollm2", "budget": 8, "markov": "dspark-smollm2",
                             "score": "mixture_uniform"}, target=smollm2)


@pytest.mark.parametrize("name", ["dflash-smollm2", "dspark-smollm2"])
def test_a_speculators_export_drafts_as_the_bundled_drafter(name, smollm2, fibonacci_reference, tmp_path):
    """The bundled drafter written for vLLM speculators (draft vocabulary, head rows from the embedded target) and
    read back through Drafter.from_config(folder) decodes losslessly; the DFlash drafts what the bundled one drafts
    (the same rounds). The DSpark comes back as vLLM runs it (the export's lost lines: every draft Markov-biased,
    no calibrated temperatures), so only its output is compared."""
    from graft_block.drafters import export

    if bundled_checkpoint(name) is None:
        pytest.skip(f"drafters/checkpoints/{name} is not present")
    folder = export.export(name, "speculators", tmp_path / name).path
    runs = []
    for source in (name, str(folder)):
        res = SpeculativeDecoder(smollm2, Drafter.from_config(source, target=smollm2)).generate(FIBONACCI,
                                                                                             max_new_tokens=48)
        assert res.tokens == fibonacci_reference[:48]
        runs.append((res.stats.tau, res.stats.rounds))
    assert runs[1][0] > 1.0 and (name != "dflash-smollm2" or runs[0] == runs[1])


def test_vllm_speculators_drafts_from_our_exports(tmp_path):
    """speculators' own model classes (0.9.0, in a side venv: scripts/check_speculators.sh) load the bundled DFlash,
    DSpark and EAGLE-3 drafters as exported and reproduce graft-block's draft logits (and DSpark's confidences);
    the same check fails on an export with one weight off by 1%, and on one whose LM-head rows are shifted."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    root = Path(__file__).resolve().parents[1]
    if Path(sys.prefix).resolve() != (root / ".venv").resolve():
        pytest.skip("the check builds its side venv from this repository's .venv (scripts/install.sh)")
    run = subprocess.run(["bash", "scripts/check_speculators.sh", str(tmp_path)], cwd=root, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert run.stdout.count("OK: speculators'") == 3, run.stdout[-4000:]
    for cls in ("DFlashDraftModel", "DSparkDraftModel", "Eagle3DraftModel"):
        assert f"OK: speculators' {cls} reproduces" in run.stdout
    side = os.environ.get("GRAFT_BLOCK_SPECULATORS_VENV", str(root / ".venv-speculators"))

    def corrupted(name, change):
        folder = tmp_path / name
        shutil.copytree(tmp_path / "dflash-smollm2", folder)
        tensors = load_file(folder / "model.safetensors")
        change(tensors)
        save_file(tensors, folder / "model.safetensors")
        return str(folder)

    down = "layers.1.mlp.down_proj.weight"
    weight = corrupted("weight", lambda t: t.__setitem__(down, t[down] * 1.01))
    # the head vLLM reads, its rows one id off: only the served-head gate sees it
    head = corrupted("head", lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"].roll(1, 0)))
    ref = str(tmp_path / "dflash-smollm2.pt")
    bad = subprocess.run([f"{side}/bin/python", "scripts/check_speculators.py", "compare", weight, head,
                          str(tmp_path / "dflash-smollm2"), "--ref", ref, ref, ref],
                         cwd=root, capture_output=True, text=True, timeout=300)
    out = bad.stdout + bad.stderr
    assert bad.returncode != 0 and f"{weight}: FAIL: speculators' logits differ" in bad.stderr, out
    assert f"{head}: FAIL: the folder's lm_head" in bad.stderr, out
    assert bad.stdout.count("OK: speculators'") == 1, out  # each folder is judged alone: the sound one after them


def test_smollm2_mfd_sampling_exact(smollm2):
    """T=1 with top-k 4 on the real target and the bundled K=4 drafter: the joint law of the first 2 new tokens
    (token 2 comes through the mixed tree's depth-1 nodes) equals the target's exact law (chi-square p > 1e-3);
    the same counts reject the T=0.6 law, so the test can fail."""
    folder = bundled_checkpoint("mfd-smollm2")
    if folder is None:
        pytest.skip("drafters/checkpoints/mfd-smollm2 is not present")
    # A short raw prompt (no chat template) and a small tree keep each of the n generations to one cheap round;
    # the mixed tree still has several depth-1 nodes from different modes, which is what the law exercises.
    prompt = smollm2.tokenizer("My favourite colour is").input_ids
    cfg = SamplingConfig(1.0, top_k=4)
    exact = exact_sequence_probs(smollm2, prompt, 2, cfg)
    d = Drafter.from_config({"type": "mfd", "checkpoint": str(folder), "budget": 8}, target=smollm2)
    dec = SpeculativeDecoder(smollm2, d)
    gen = torch.Generator().manual_seed(11)
    counts, accepted, n = Counter(), 0, 400
    for _ in range(n):
        r = dec.generate(prompt, max_new_tokens=2, temperature=1.0, top_k=4, generator=gen)
        counts[tuple(r.tokens[:2])] += 1
        accepted += sum(k * c for k, c in r.stats.accept_hist.items())
    stat, dof, p = chi_square_test(counts, exact)
    assert p > 1e-3, (stat, dof, p, counts.most_common(6))
    assert accepted > n // 10  # the tree's depth-1 nodes were really accepted
    assert chi_square_test(counts, exact_sequence_probs(smollm2, prompt, 2, SamplingConfig(0.6, top_k=4)))[2] < 1e-3


@pytest.mark.parametrize("gemm", ["mkl", "openblas", "onednn", "onednn+skinny", "skinny"])
def test_every_cpu_kernel_decodes_smollm2_like_hf(smollm2, gemm):
    """Whatever kernel this machine's measurement picks, each candidate stays lossless on the real target: the AR
    loop (one-row forwards) and EAGLE3 trees (whose head runs the same kernel) through the lean engine equal HF
    greedy decoding."""
    from graft_block import skinny
    from graft_block.engine import onednn_available
    from graft_block.target import Target

    if smollm2.device.type != "cpu" or ("onednn" in gemm and not onednn_available("cpu", torch.float32)):
        pytest.skip(f"{gemm} is a CPU float32 kernel choice")
    if "skinny" in gemm and not skinny.available():
        pytest.skip(f"the skinny kernel does not build here: {skinny.why_not()}")
    t = Target(smollm2.model, smollm2.tokenizer, engine="lean", gemm=gemm)
    assert t.lean.kernel_label == gemm.replace("+skinny", "+skinny@17rows")
    ids = t.encode([{"role": "user", "content": "Write a function that reverses a string."}])
    assert SpeculativeDecoder(t, None).generate(ids, max_new_tokens=32).tokens == hf_greedy(smollm2, ids, 32)
    d = Drafter.from_config({"type": "eagle3", "checkpoint": "eagle3-smollm2", "budget": 8}, target=t)
    res = SpeculativeDecoder(t, d).generate(ids, max_new_tokens=32)
    assert res.tokens == hf_greedy(smollm2, ids, 32) and res.stats.rounds < 32
