"""The lean forward (graft_block/engine.py) against HF's own forward on the same weights: logits, features, the
padded packed-GEMM buckets, the OpenBLAS products, the measured kernel choice, the static cache, the compiled path,
and the errors."""
import os

import pytest
import torch

from graft_block import SpeculativeDecoder
from graft_block.engine import LeanForward, packed_gemm_available, pick_gemm
from graft_block.errors import ConfigError
from graft_block.target import Target
from graft_block.testing import hf_greedy, tiny_target
from graft_block.tree import chain, from_paths, root_only, walk


# the GPU check runs this file on CUDA, where the products are torch's own and no CPU kernel can be chosen
ON_CPU = os.environ.get("GRAFT_BLOCK_TEST_DEVICE", "cpu") == "cpu"


def _pair(arch, gemm=None, **kw):
    if gemm == "openblas" and not ON_CPU:
        pytest.skip("OpenBLAS is a CPU float32 kernel")
    lean = tiny_target(arch, engine="lean", gemm=gemm if ON_CPU else None, **kw)
    return lean, Target(lean.model, None, name="hf", engine="hf")


@pytest.mark.parametrize("arch,gemm", [("llama", "mkl"), ("qwen2", "mkl"), ("qwen3", "mkl"), ("mistral", "mkl"),
                                       ("llama", "openblas"), ("qwen3", "openblas")])
def test_logits_and_features_match_hf_for_every_tree_size(arch, gemm):
    """Sizes across the pack buckets: plain rows (1-2), padded to 8 (3-7), exactly 8, padded to 16, past 16; and
    the same through OpenBLAS (no buckets)."""
    lean, hf = _pair(arch, gemm=gemm)
    assert lean.lean.gemm == (gemm if ON_CPU else "torch") and (lean.lean.blas is not None) == (gemm == "openblas")
    assert lean.engine == "lean" and hf.engine == "hf"
    for t in (lean, hf):
        t.set_feature_layers([0, 2, 4])  # embeddings, a middle layer, the final norm
    prompt = torch.tensor([5, 9, 2, 7, 11, 3, 8])
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 5, 8, 9, 16, 20):
        (la, fa), (lb, fb) = lean.prefill(prompt), hf.prefill(prompt)
        assert torch.allclose(la, lb, atol=1e-4) and torch.allclose(fa, fb, atol=1e-4)
        depth = max(1, n // 3)  # a bushy tree: the ancestor mask matters, not only the causal one
        paths = [torch.randint(0, 128, (depth,), generator=gen).tolist() for _ in range(n)]
        tree = from_paths(4, paths)
        tree = tree if tree.size <= n else chain(4, torch.randint(0, 128, (n - 1,), generator=gen))
        (va, ga), (vb, gb) = lean.verify(tree), hf.verify(tree)
        assert va.shape == vb.shape == (tree.size, 128) and ga.shape == gb.shape
        assert torch.allclose(va, vb, atol=1e-4), (arch, n, (va - vb).abs().max())
        assert torch.allclose(ga, gb, atol=1e-4)
        assert torch.equal(va.argmax(-1), vb.argmax(-1))
        assert lean.cache_len == hf.cache_len == prompt.numel() + tree.size  # pad rows never count


def test_padded_verify_then_compact_continues_like_a_fresh_prefill():
    """A 5-node tree runs padded to the 8-row bucket; after compaction the cache holds exactly the accepted
    path, and the next decode step equals a sequential prefill's."""
    lean, hf = _pair("llama", gemm="mkl")
    if packed_gemm_available(lean.device, lean.dtype):
        assert lean.lean.bucket(5) == 8 and lean.lean.bucket(1) is None and lean.lean.bucket(2) is None
    prompt = [3, 1, 4, 1, 5]
    ref = hf_greedy(hf, prompt, 6)
    lean.prefill(torch.tensor(prompt))
    tree = from_paths(ref[0], [[ref[1], ref[2], ref[3]], [(ref[1] + 1) % 128]])
    logits, _ = lean.verify(tree)
    path, bonus = walk(tree, logits.argmax(-1))
    assert tree.tokens[path].tolist() == ref[:4] and bonus == ref[4]
    lean.compact(tree.size, path)
    fresh = Target(lean.model, None, engine="hf")
    fresh.prefill(torch.tensor(prompt + ref[:4]))
    for layer in range(lean.num_layers):
        (k, v), (rk, rv) = lean.cached_kv(layer), fresh.cached_kv(layer)
        assert k.shape == rk.shape and torch.allclose(k, rk, atol=1e-5) and torch.allclose(v, rv, atol=1e-5)
    nxt, _ = lean.verify(root_only(bonus))
    assert int(nxt[0].argmax()) == ref[5]


def test_cache_grows_past_its_first_allocation():
    lean, _ = _pair("qwen3", max_positions=2048)
    prompt = list(range(1, 100)) * 3  # 297 tokens: past the first 256-slot allocation
    assert SpeculativeDecoder(lean).generate(prompt, max_new_tokens=20).tokens == hf_greedy(lean, prompt, 20)
    assert lean.lean.k.shape[2] >= 317


def test_compiled_layers_stay_lossless():
    """The opt-in torch.compile path on a tiny target (CI compiles this, not every shape of SmolLM2)."""
    t = tiny_target("llama")
    compiled = Target(t.model, None, engine="lean", compile=True)
    assert compiled.engine_label == "lean-mkl-float32+compile"  # compiled graphs keep torch's own kernels
    prompt = [2, 7, 1, 8]
    assert SpeculativeDecoder(compiled).generate(prompt, max_new_tokens=24).tokens == hf_greedy(t, prompt, 24)


def test_unsupported_models_say_which_engine_to_use():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64))
    assert Target(gpt2).engine == "hf"  # auto falls back to HF's forward
    with pytest.raises(ConfigError, match="engine='lean' cannot run this target.*gpt2.*engine='hf'"):
        Target(gpt2, engine="lean")
    with pytest.raises(ConfigError, match="engine must be 'auto', 'lean' or 'hf'"):
        Target(gpt2, engine="fast")
    half = tiny_target("llama", dtype=torch.bfloat16, engine="hf")
    lean_half = LeanForward(half.model)
    assert lean_half.packs == {} and lean_half.gemm == "torch"  # outside CPU fp32: torch's GEMM, still lean
    assert Target(half.model, engine="lean").engine_label == "lean-bfloat16"
    with pytest.raises(ConfigError, match="pack_rows needs MKL's packed GEMM"):
        LeanForward(half.model, pack_rows=(8,))
    with pytest.raises(ConfigError, match="gemm='openblas' is a CPU float32 kernel choice.*bfloat16"):
        LeanForward(half.model, gemm="openblas")
    with pytest.raises(ConfigError, match="gemm must be one of mkl, openblas"):
        LeanForward(tiny_target("llama", engine="hf").model, gemm="cublas")


def test_kernel_choice_follows_the_measurement_and_is_cached(tmp_path, monkeypatch):
    """The kernel with the lower total wins; MKL keeps its pack only where the pack beat F.linear; a second
    target on the same machine reads the cached choice instead of measuring again; a damaged cache file is
    measured again; explicit choices that cannot hold are errors."""
    if not ON_CPU:
        pytest.skip("the kernel choice is a CPU float32 matter")
    amd = {"mkl": {1: 50.0, 8: 70.0, 16: 96.0}, "mkl_packed": {8: 94.0, 16: 121.0},
           "openblas": {1: 26.0, 8: 51.0, 16: 60.0}}
    xeon = {"mkl": {1: 31.0, 8: 65.0, 16: 69.0}, "mkl_packed": {8: 46.0, 16: 56.0},
            "openblas": {1: 31.0, 8: 69.0, 16: 83.0}}
    assert pick_gemm(amd) == ("openblas", ())
    assert pick_gemm(xeon) == ("mkl", (8, 16))
    assert pick_gemm({**xeon, "mkl_packed": {8: 46.0, 16: 80.0}}) == ("mkl", (8,))

    import graft_block.engine as E

    monkeypatch.setenv("GRAFT_BLOCK_CACHE", str(tmp_path))
    monkeypatch.delenv("GRAFT_BLOCK_GEMM", raising=False)
    calls = []
    monkeypatch.setattr(E, "measure_gemms", lambda w, **k: calls.append(len(w)) or amd)
    first = tiny_target("llama", engine="lean")
    second = tiny_target("llama", engine="lean")
    assert calls == [5]  # one decoder layer's four products + the LM head, measured once
    assert first.lean.gemm == second.lean.gemm == "openblas" and second.lean.gemm_times["openblas"][16] == 60.0
    assert first.engine_label == "lean-openblas-float32"
    monkeypatch.setenv("GRAFT_BLOCK_GEMM", "mkl")  # the override skips the measurement
    assert tiny_target("llama", engine="lean").lean.gemm == "mkl" and calls == [5]
    monkeypatch.delenv("GRAFT_BLOCK_GEMM")
    for f in (tmp_path / "gemm").iterdir():
        f.write_text('["not", "a", "record"]')
    assert tiny_target("llama", engine="lean").lean.gemm == "openblas" and calls == [5, 5]
    model = first.model
    with pytest.raises(ConfigError, match="gemm='openblas' cannot run inside compiled layers"):
        LeanForward(model, compile=True, gemm="openblas")
    with pytest.raises(ConfigError, match="pack_rows needs MKL's packed GEMM"):
        LeanForward(model, gemm="openblas", pack_rows=(8,))
    assert LeanForward(model, pack_rows=()).gemm == "openblas" and calls == [5, 5]  # cached again
    monkeypatch.setenv("GRAFT_BLOCK_GEMM", "fast")
    with pytest.raises(ConfigError, match="GRAFT_BLOCK_GEMM must be one of mkl, openblas"):
        LeanForward(model)
