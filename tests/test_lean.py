"""The lean forward (graft_block/engine.py) against HF's own forward on the same weights: logits, features, the
padded packed-GEMM buckets, the OpenBLAS products, the measured kernel choice, the static cache, the compiled path,
and the errors."""
import os

import pytest
import torch
import torch.nn.functional as F

from graft_block import SpeculativeDecoder
from graft_block.engine import LeanForward, packed_gemm_available, pick_gemm
from graft_block.errors import ConfigError
from graft_block.target import Target
from graft_block.testing import hf_greedy, tiny_target
from graft_block.tree import chain, from_paths, root_only, walk


# the GPU check runs this file on CUDA, where the products are torch's own and no CPU kernel can be chosen
ON_CPU = os.environ.get("GRAFT_BLOCK_TEST_DEVICE", "cpu") == "cpu"


def _pair(arch, gemm=None, **kw):
    if gemm in ("openblas", "onednn") and not ON_CPU:
        pytest.skip(f"{gemm} is a CPU float32 kernel choice")
    lean = tiny_target(arch, engine="lean", gemm=gemm if ON_CPU else None, **kw)
    return lean, Target(lean.model, None, name="hf", engine="hf")


@pytest.mark.parametrize("arch,gemm", [("llama", "mkl"), ("qwen2", "mkl"), ("qwen3", "mkl"), ("mistral", "mkl"),
                                       ("llama", "openblas"), ("qwen3", "openblas"), ("llama", "onednn"),
                                       ("qwen2", "onednn"), ("llama", "skinny"), ("qwen3", "skinny")])
def test_logits_and_features_match_hf_for_every_tree_size(arch, gemm):
    """Sizes across the pack buckets: plain rows (1-2), padded to 8 (3-7), exactly 8, padded to 16, past 16; and
    the same through OpenBLAS, oneDNN and skinny alone (no buckets; skinny also runs the prefill)."""
    from graft_block import skinny

    if gemm == "skinny" and not (ON_CPU and skinny.available()):
        pytest.skip(f"the skinny kernel does not run here: {skinny.why_not()}")
    lean, hf = _pair(arch, gemm=gemm)
    assert lean.lean.gemm == (gemm if ON_CPU else "torch") and (lean.lean.blas is not None) == (gemm == "openblas")
    assert (lean.lean.dnn is not None) == (gemm == "onednn" and ON_CPU)
    assert lean.engine == "lean" and hf.engine == "hf"
    # one copy of the weights beside the kernel's own layout: F.linear's fused q/k/v and gate/up are what HF's
    # modules view; a kernel with a layout of its own keeps no fused copy at all
    layer, fused = lean.model.model.layers[1], lean.lean.layers[1]
    for mod, key in ((layer.self_attn.v_proj, "qkv"), (layer.mlp.up_proj, "gu")):
        if lean.lean.gemm in ("mkl", "torch"):
            assert mod.weight.untyped_storage().data_ptr() == fused[key].untyped_storage().data_ptr()
        else:
            assert fused[key] is None
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
    assert lean.lean.v.shape[2] >= 317  # [layers, kv_heads, rows, head_dim] whichever kernel runs the layers


def test_compiled_layers_stay_lossless():
    """The opt-in torch.compile path on a tiny target (CI compiles this, not every shape of SmolLM2)."""
    t = tiny_target("llama")
    compiled = Target(t.model, None, engine="lean", compile=True)
    assert compiled.engine_label == "lean-mkl-float32+compile"  # compiled graphs keep torch's own kernels
    prompt = [2, 7, 1, 8]
    assert SpeculativeDecoder(compiled).generate(prompt, max_new_tokens=24).tokens == hf_greedy(t, prompt, 24)
    from graft_block import skinny

    if ON_CPU and skinny.available():  # skinny is a custom op a compiled graph calls (onednn/openblas are refused)
        thin = Target(t.model, None, engine="lean", compile=True, gemm="skinny")
        assert thin.engine_label == "lean-skinny-float32+compile"
        assert SpeculativeDecoder(thin).generate(prompt, max_new_tokens=24).tokens == hf_greedy(t, prompt, 24)


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
    assert pick_gemm(amd) == ("openblas", (), "openblas", 0)
    assert pick_gemm(xeon) == ("mkl", (8, 16), "mkl", 0)  # OpenBLAS ties at 1 row: not worth a second copy
    assert pick_gemm({**xeon, "mkl_packed": {8: 46.0, 16: 80.0}}) == ("mkl", (8,), "mkl", 0)
    zen4 = {**amd, "onednn": {1: 27.0, 8: 30.0, 16: 41.0}}  # far faster at 8-16 rows, within 10% at 1
    assert pick_gemm(zen4) == ("onednn", (), "onednn", 0)
    zen4["onednn"][1] = 33.0  # OpenBLAS 21% faster at 1 row, but on its own thread pool: never mixed
    assert pick_gemm(zen4) == ("onednn", (), "onednn", 0)
    zen4["mkl"][1] = 20.0  # MKL shares torch's pool: one-row forwards get it
    assert pick_gemm(zen4) == ("onednn", (), "mkl", 1)
    assert pick_gemm({**xeon, "onednn": {1: 20.0, 8: 30.0}}) == ("mkl", (8, 16), "mkl", 0)  # not measured at 16
    # the total counts the one-row kernel: MKL edges OpenBLAS at 8-16 rows, but OpenBLAS halves the 1-row time
    assert pick_gemm({"mkl": {1: 50.0, 8: 60.0, 16: 70.0}, "openblas": {1: 25.0, 8: 62.0, 16: 72.0}})[0] == "openblas"
    # skinny takes small forwards beside another kernel of torch's pool up to the last row count where it wins
    # (never beside OpenBLAS, and not when it is not 10% faster over what it would cover), or every forward alone;
    # a choice within 5% of the fastest that holds fewer copies of the weights wins
    zen4["mkl"][1] = 50.0
    assert pick_gemm({**zen4, "skinny": {1: 17.0, 8: 25.0, 16: 50.0}}) == ("onednn", (), "skinny", 8)
    assert pick_gemm({**zen4, "skinny": {1: 17.0, 8: 25.0, 16: 45.0}}) == ("skinny", (), "skinny", 0)  # 87 vs 83
    assert pick_gemm({**zen4, "skinny": {1: 17.0, 8: 25.0, 16: 38.0}}) == ("skinny", (), "skinny", 0)  # a tie
    assert pick_gemm({**zen4, "skinny": {1: 34.0, 8: 25.0, 16: 99.0}}) == ("onednn", (), "onednn", 0)
    # 42% faster than OpenBLAS at 1 row, but on torch's pool: OpenBLAS keeps every row count
    assert pick_gemm({**amd, "skinny": {1: 15.0, 8: 55.0, 16: 75.0}}) == ("openblas", (), "openblas", 0)
    assert pick_gemm({**xeon, "skinny": {1: 29.0, 8: 45.0, 16: 70.0}}) == ("mkl", (8, 16), "mkl", 0)
    assert pick_gemm({**xeon, "skinny": {1: 29.0, 8: 45.0, 16: 55.0}}) == ("skinny", (), "skinny", 0)
    # fastest at 1-17 rows but far slower at 65 (prefill, large trees): the pair, each kernel where it wins
    wide = {"mkl": {1: 50.0, 9: 70.0, 17: 96.0, 65: 300.0}, "onednn": {1: 27.0, 9: 30.0, 17: 41.0, 65: 90.0},
            "skinny": {1: 17.0, 9: 25.0, 17: 38.0, 65: 160.0}}
    assert pick_gemm(wide) == ("onednn", (), "skinny", 17)
    wide["skinny"][65] = 92.0  # within 5% of the pair alone: one copy of the weights instead of two
    assert pick_gemm(wide) == ("skinny", (), "skinny", 0)
    # products at parity with oneDNN (a fresh measurement on the 2-core EPYC): without the C layers' credit
    # oneDNN takes every forward; with it skinny does, and every decoder layer runs in C
    epyc = {"mkl": {1: 25.1, 9: 54.6, 17: 62.5, 65: 117.1}, "onednn": {1: 12.2, 9: 14.6, 17: 16.0, 65: 37.9},
            "skinny": {1: 11.1, 9: 13.7, 17: 18.7, 65: 37.3}}
    assert pick_gemm(epyc) == ("onednn", (), "onednn", 0)
    assert pick_gemm(epyc, c_layers=True) == ("skinny", (), "skinny", 0)
    assert pick_gemm({**epyc, "skinny": {1: 15.0, 9: 20.0, 17: 25.0, 65: 60.0}}, c_layers=True)[0] == "onednn"
    # a later measurement there favoured oneDNN's products by 1.2-1.4x, yet its engine decoded 1.6x slower than
    # the C layers': they keep the choice
    later = {**epyc, "onednn": {1: 8.6, 9: 13.3, 17: 15.9, 65: 39.1}, "skinny": {1: 12.0, 9: 18.0, 17: 18.7, 65: 44.3}}
    assert pick_gemm(later) == ("onednn", (), "onednn", 0)
    assert pick_gemm(later, c_layers=True) == ("skinny", (), "skinny", 0)
    # the credit is skinny's alone: as another kernel's small-forward partner it runs no C layers (equal products
    # and a second copy of the weights: no pair)
    even = {"mkl": {1: 50.0, 9: 70.0, 17: 96.0, 65: 300.0}, "onednn": {1: 14.0, 9: 15.0, 17: 17.0, 65: 30.0},
            "skinny": {1: 14.0, 9: 15.0, 17: 17.0, 65: 80.0}}
    assert pick_gemm(even, c_layers=True) == pick_gemm(even) == ("onednn", (), "onednn", 0)

    import graft_block.engine as E

    monkeypatch.setenv("GRAFT_BLOCK_CACHE", str(tmp_path))
    monkeypatch.delenv("GRAFT_BLOCK_GEMM", raising=False)
    calls = []
    monkeypatch.setattr(E, "measure_gemms", lambda w, **k: calls.append(len(w)) or amd)
    first = tiny_target("llama", engine="lean")
    second = tiny_target("llama", engine="lean")
    assert calls == [17]  # measured once, streaming: every layer's four products (all 4 are far below the
    # cache) + the LM head
    assert first.lean.gemm == second.lean.gemm == "openblas" and second.lean.gemm_times["openblas"][16] == 60.0
    assert first.engine_label == "lean-openblas-float32"
    monkeypatch.setenv("GRAFT_BLOCK_GEMM", "mkl")  # the override skips the measurement
    assert tiny_target("llama", engine="lean").lean.gemm == "mkl" and calls == [17]
    monkeypatch.delenv("GRAFT_BLOCK_GEMM")
    for f in (tmp_path / "gemm").iterdir():
        f.write_text('["not", "a", "record"]')
    assert tiny_target("llama", engine="lean").lean.gemm == "openblas" and calls == [17, 17]
    model = first.model
    with pytest.raises(ConfigError, match="gemm='openblas' cannot run inside compiled layers"):
        LeanForward(model, compile=True, gemm="openblas")
    with pytest.raises(ConfigError, match="pack_rows needs MKL's packed GEMM"):
        LeanForward(model, gemm="openblas", pack_rows=(8,))
    assert LeanForward(model, pack_rows=()).gemm == "openblas" and calls == [17, 17]  # cached again
    monkeypatch.setenv("GRAFT_BLOCK_GEMM", "fast")
    with pytest.raises(ConfigError, match="GRAFT_BLOCK_GEMM must be one of mkl, openblas, onednn"):
        LeanForward(model)
    monkeypatch.setenv("GRAFT_BLOCK_GEMM", "onednn+openblas")
    with pytest.raises(ConfigError, match="pairs kernels of two thread pools"):
        LeanForward(model)
    monkeypatch.setenv("GRAFT_BLOCK_GEMM", "onednn+mkl")
    forced = LeanForward(model)
    assert (forced.gemm, forced.gemm_small, forced.small_rows) == ("onednn", "mkl", 1) and calls == [17, 17]
    monkeypatch.delenv("GRAFT_BLOCK_GEMM")
    import graft_block

    monkeypatch.setattr("graft_block.OPENBLAS_TIMEOUT_LATE", True)  # numpy came first: OpenBLAS's threads spin
    late = LeanForward(model)
    assert late.gemm == late.gemm_small == "mkl" and late.blas is None and calls == [17, 17, 17]  # own cache entry
    skips = []  # nor is it measured then: its spinning threads slowed the kernels timed after it
    monkeypatch.setattr(E, "measure_gemms", lambda w, **k: skips.append(k.get("skip")) or amd)
    for f in (tmp_path / "gemm").iterdir():
        f.unlink()
    LeanForward(model)
    assert skips == [("openblas",)]


@pytest.mark.parametrize("kernel", ["onednn", "skinny", "onednn+skinny", "mkl+skinny"])
def test_drafter_linears_take_the_engine_kernel_and_follow_weight_updates(kernel, monkeypatch):
    """``use_kernel`` turns every nn.Linear (also inside transformers' modules) into a drafters ``Linear``
    with the same parameters; without gradients it runs the kernel on a kept layout (in a pair, the second up to
    17 rows and the first past that; MKL is F.linear on the weight itself), redone after an in-place update; with
    gradients (training) it is F.linear and the gradient reaches the weight."""
    from torch import nn
    from torch.nn import functional as F

    from graft_block import skinny
    from graft_block.drafters.layers import Linear, use_kernel
    from graft_block.engine import onednn_available

    if not (ON_CPU and onednn_available("cpu", torch.float32)):
        pytest.skip("oneDNN is a CPU float32 kernel")
    if kernel == "skinny" and not skinny.available():
        pytest.skip(f"the skinny kernel does not build here: {skinny.why_not()}")
    monkeypatch.setenv(skinny.DRAFT_BF16_ENV, "0")  # exact packs (bf16 drafting: test_bf16_drafter_products)
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    net = nn.Sequential(lin, nn.ReLU())
    keys = set(net.state_dict())
    use_kernel(net, kernel)
    assert type(lin) is Linear and lin.kernel == kernel and set(net.state_dict()) == keys
    main, _, small = kernel.partition("+")
    x = torch.randn(3, 5, 16)  # 15 rows: the small kernel's when there is one
    with torch.no_grad():
        y = net(x)
        assert y.shape == (3, 5, 8) and torch.allclose(y, F.linear(x, lin.weight, lin.bias).relu(), atol=1e-5)
        first = lin._laid_out[small or main]
        lin(x)
        assert lin._laid_out[small or main] is first  # kept, not laid out again per call
        lin.weight.mul_(2)  # an in-place update (a load, an optimizer step) must be seen
        assert torch.allclose(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5)
        assert lin._laid_out[small or main] is not first
        wide = torch.randn(3, 7, 16)  # 21 rows: the main kernel's
        assert torch.allclose(lin(wide), F.linear(wide, lin.weight, lin.bias), atol=1e-5)
        assert set(lin._laid_out) - {"key"} == {small, main} - {"", "mkl"}
    lin(x).sum().backward()  # gradients on: F.linear
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0
    use_kernel(net, None)
    with torch.no_grad():
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


@pytest.mark.parametrize("kind,gemm", [("eagle3", "onednn"), ("dflash", "onednn"), ("mfd", "onednn"),
                                       ("eagle3", "onednn+skinny"), ("mfd", "onednn+skinny"), ("dflash", "skinny")])
def test_drafters_on_a_onednn_target_draft_through_it_and_stay_lossless(kind, gemm):
    """A target whose engine runs oneDNN (with skinny for small forwards) hands its kernel to its drafter's
    products; greedy output stays the target's."""
    from graft_block import Drafter, skinny
    from graft_block.drafters.layers import Linear
    from graft_block.engine import onednn_available

    if not (ON_CPU and onednn_available("cpu", torch.float32)):
        pytest.skip("oneDNN is a CPU float32 kernel")
    if "skinny" in gemm and not skinny.available():
        pytest.skip(f"the skinny kernel does not build here: {skinny.why_not()}")
    kernel = gemm
    t = tiny_target("llama", engine="lean", gemm=gemm)
    if kind in ("dflash", "mfd"):
        cfg = {"type": kind, "num_layers": 2, "target_layer_ids": [0, 2], "block_size": 6, "seed": 1, "budget": 8}
        d = Drafter.from_config({**cfg, "proposal": "ddtree"} if kind == "dflash" else {**cfg, "num_modes": 2},
                                target=t)
    else:
        from graft_block.drafters.eagle3 import (Eagle3Drafter, Eagle3Head, build_draft_vocab, head_config_for,
                                                 warm_start)

        torch.manual_seed(0)
        head = Eagle3Head(head_config_for(t, 64))
        d2t, t2d = build_draft_vocab(torch.rand(t.vocab_size, generator=torch.Generator().manual_seed(0)), 64)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        warm_start(head, t)
        d = Eagle3Drafter(t, head=head, budget=8, depth=3, top_k=3)
    model = d.head if kind == "eagle3" else d.model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is Linear and m.kernel == kernel for m in linears)
    dec = SpeculativeDecoder(t, d)
    for prompt in ([3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 7, 2]):
        res = dec.generate(prompt, max_new_tokens=20)
        assert res.tokens == hf_greedy(t, prompt, 20)
    if kind != "eagle3":  # the LM-head product too, its layouts shared by every drafter on the same rows
        assert model.kernel == kernel and set(d._lm_layouts) - {"key"}


@pytest.mark.parametrize("small,layout,label", [("mkl", "NoneType", "mkl@1row"),
                                                ("skinny", "SkinnyWeight", "skinny@8rows")])
def test_a_small_forward_kernel_of_the_same_pool_runs_them_and_stays_exact(monkeypatch, tmp_path, small, layout,
                                                                          label):
    """When the measurement gives small forwards their own kernel (MKL at 1 row, or skinny up to 8 rows, beside
    oneDNN), those forwards run it and every other forward runs the main one; logits match HF's either way, and
    the label names both."""
    from graft_block import skinny
    from graft_block.engine import onednn_available

    if not (ON_CPU and onednn_available("cpu", torch.float32)):
        pytest.skip("a CPU float32 kernel choice")
    if small == "skinny" and not skinny.available():
        pytest.skip(f"the skinny kernel does not build here: {skinny.why_not()}")
    import graft_block.engine as E

    monkeypatch.setenv("GRAFT_BLOCK_CACHE", str(tmp_path))
    monkeypatch.delenv("GRAFT_BLOCK_GEMM", raising=False)
    times = {"mkl": {1: 20.0 if small == "mkl" else 50.0, 8: 70.0, 16: 96.0}, "openblas": {1: 26.0, 8: 51.0, 16: 60.0},
             "onednn": {1: 33.0, 8: 30.0, 16: 41.0},
             "skinny": {1: 17.0, 8: 25.0, 16: 90.0} if small == "skinny" else {}}  # alone, even in C: slower
    monkeypatch.setattr(E, "measure_gemms", lambda w, **k: times)
    lean = tiny_target("llama", engine="lean")
    hf = Target(lean.model, None, engine="hf")
    assert (lean.lean.gemm, lean.lean.gemm_small) == ("onednn", small) and lean.lean.blas is None
    assert lean.engine_label == f"lean-onednn+{label}-float32"
    used = []
    real = E.linear
    monkeypatch.setattr(E, "linear", lambda x, w, b, p=None: used.append(type(p).__name__) or real(x, w, b, p))
    prompt = torch.tensor([5, 9, 2, 7, 11])
    chain12 = torch.tensor([8, 1, 3, 6, 2, 9, 4, 7, 5, 10, 12, 11])
    for tree in (root_only(4), chain(4, torch.tensor([8, 1, 3, 6])), chain(4, chain12)):
        lean.prefill(prompt), hf.prefill(prompt)
        used.clear()
        (va, _), (vb, _) = lean.verify(tree), hf.verify(tree)
        assert torch.allclose(va, vb, atol=1e-4) and torch.equal(va.argmax(-1), vb.argmax(-1))
        assert set(used) == ({layout} if tree.size <= lean.lean.small_rows else {"DnnWeight"})


def test_skinny_equals_f_linear_on_awkward_shapes_whatever_the_row_or_thread_count():
    """The small-forward kernel: outputs off its 32-output blocks, any input width, 1-20 rows (past its 8-row
    tiles), with and without bias, within float32 rounding of a float64 product; a row's value is bit-identical
    whatever the number of rows beside it or the thread count, and what it cannot take is refused by name."""
    from graft_block import skinny

    if not ON_CPU or not skinny.available():
        pytest.skip(f"the skinny kernel does not build here: {skinny.why_not()}")
    g = torch.Generator().manual_seed(0)
    for out, n_in in [(1, 1), (7, 5), (33, 100), (130, 577), (64, 64), (1000, 1536)]:
        w, b = torch.randn(out, n_in, generator=g), torch.randn(out, generator=g)
        pw = skinny.SkinnyWeight(w)
        x = torch.randn(1, 20, n_in, generator=g)
        bound = 1e-6 * n_in * (x.abs()[0] @ w.abs().T).max()
        for n in (1, 2, 7, 8, 9, 16, 20):
            for bias in (b, None):
                y = skinny.linear(x[:, :n], pw, bias)
                want = F.linear(x[:, :n].double(), w.double(), None if bias is None else bias.double())
                assert y.shape == (1, n, out) and y.dtype == torch.float32
                assert (y.double() - want).abs().max() <= bound
            assert torch.equal(skinny.linear(x[:, :n], pw)[0], skinny.linear(x[:, :20], pw)[0, :n])
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            one = skinny.linear(x, pw)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, skinny.linear(x, pw))
        # a weight whose values are all float16 (a drafter's fp16 checkpoint, upcast) is packed in half precision
        # where the CPU widens on load, and gives the float32 pack's products bit for bit
        exact = w.half().float()
        half, full = skinny.SkinnyWeight(exact), skinny.SkinnyWeight(exact, half=False)
        assert full.packed.dtype == torch.float32 and pw.packed.dtype == torch.float32  # randn: not fp16-exact
        if skinny._lib.half_weights():
            assert half.packed.dtype == torch.float16 and half.packed.numel() == full.packed.numel()
        assert torch.equal(skinny.linear(x, half, b), skinny.linear(x, full, b))
        # rows come back out of either pack exactly (a drafter's LM-head rows, read from the engine's copy)
        ids = torch.tensor([out - 1, 0, out // 2, 1 % out])
        assert torch.equal(pw.rows(ids), w[ids]) and torch.equal(half.rows(ids), exact[ids])
    # a draft head's final norm and LM head in one call: the product of torch's rms_norm, to float32 rounding
    for n_in in (64, 577):  # a multiple of the vector width (normed in C), and not (normed in torch)
        w, nw = torch.randn(50, n_in, generator=g), torch.rand(n_in, generator=g) + 0.5
        x = torch.randn(3, n_in, generator=g)
        for pw in (skinny.SkinnyWeight(w), skinny.SkinnyWeight(w, half="bf16")):
            got = skinny.norm_linear(x, nw, 1e-5, pw)
            assert torch.allclose(got, skinny.linear(torch.rms_norm(x, (n_in,), nw, 1e-5), pw), atol=1e-4)
    with pytest.raises(ValueError, match="norm_linear takes float32 rows of 577"):
        skinny.norm_linear(torch.randn(3, 64), nw, 1e-5, pw)
    with pytest.raises(ValueError, match="row ids must lie in"):
        skinny.SkinnyWeight(torch.randn(4, 8)).rows(torch.tensor([4]))
    with pytest.raises(ValueError, match="float32 CPU rows of 8"):
        skinny.linear(torch.randn(2, 7), skinny.SkinnyWeight(torch.randn(4, 8)))
    with pytest.raises(ValueError, match="skinny packs a float32 CPU weight"):
        skinny.SkinnyWeight(torch.randn(4, 8, dtype=torch.float64))


def test_bf16_drafter_products(monkeypatch):
    """On AVX512-BF16 CPUs drafters pack their products in bfloat16: a product equals the one of the bf16-rounded
    inputs and weights to float32 summation rounding, a row's value does not depend on the rows beside it, rows
    come back out of the pack, and GRAFT_BLOCK_DRAFT_BF16=0 returns drafters to the exact packs (repacked)."""
    from graft_block import skinny
    from graft_block.drafters.layers import Linear, use_kernel

    if not ON_CPU or not skinny.available() or not skinny._lib.bf16_weights():
        pytest.skip("bfloat16 products need the skinny kernel on an AVX512-BF16 CPU")
    g = torch.Generator().manual_seed(1)
    for out, n_in in [(1, 2), (37, 34), (130, 578), (130, 576), (1000, 1536)]:  # 576, 1536: AMX tiles if there
        w = torch.randn(out, n_in, generator=g)
        pw = skinny.SkinnyWeight(w, half="bf16")
        assert pw.packed.dtype == torch.bfloat16
        x = torch.randn(20, n_in, generator=g)
        xb, wb = x.bfloat16().double(), w.bfloat16().double()
        bound = 1e-6 * n_in * (xb.abs() @ wb.abs().T).max()
        y = skinny.linear(x, pw)
        err = (y.double() - xb @ wb.T).abs().max()
        assert err <= bound
        assert (y - x @ w.T).abs().max() > 10 * err  # the inputs really are rounded: not the float32 product
        for n in (1, 3, 8, 9, 16, 17):
            assert torch.equal(skinny.linear(x[:n], pw), y[:n])
        ids = torch.tensor([out - 1, 0, out // 2])
        assert torch.equal(pw.rows(ids), w[ids].bfloat16().float())
    assert skinny.SkinnyWeight(torch.randn(4, 7), half="bf16").packed.dtype == torch.float16  # odd width: fp16
    lin = torch.nn.Linear(64, 40)
    use_kernel(lin, "skinny")
    assert type(lin) is Linear
    x = torch.randn(5, 64)
    with torch.no_grad():
        monkeypatch.delenv(skinny.DRAFT_BF16_ENV, raising=False)
        assert skinny.draft_half() == "bf16"
        y16 = lin(x)
        assert lin._laid_out["skinny"].packed.dtype == torch.bfloat16
        assert torch.equal(y16, skinny.linear(x, skinny.SkinnyWeight(lin.weight, half="bf16"), lin.bias))
        monkeypatch.setenv(skinny.DRAFT_BF16_ENV, "0")
        assert skinny.draft_half() is None
        assert torch.allclose(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-5)
        assert lin._laid_out["skinny"].packed.dtype == torch.float32


def test_skinny_without_a_compiler_is_left_out_and_says_why(monkeypatch, tmp_path):
    """No C compiler: the kernel reports why, the measurement leaves it out, and asking for it is a clear error."""
    import graft_block.engine as E
    from graft_block import skinny

    if not ON_CPU:
        pytest.skip("a CPU float32 kernel")
    monkeypatch.setattr(skinny, "_lib", None)
    monkeypatch.setattr(skinny, "_why_not", None)
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("GRAFT_BLOCK_CACHE", str(tmp_path))
    assert not skinny.available() and "no C compiler" in skinny.why_not()
    times = E.measure_gemms([torch.randn(8, 16)], rows=(1,), reps=1)
    assert times["skinny"] == {} and 1 in times["mkl"]
    model = tiny_target("llama", engine="hf").model
    with pytest.raises(ConfigError, match="the skinny kernel cannot run here .*no C compiler"):
        LeanForward(model, gemm="onednn+skinny")


def test_every_skinny_tile_computes_the_same_bits(tmp_path):
    """The AVX2 tile (built with AVX-512 off, so an AVX-512 machine runs it too) and this CPU's own tile give
    bit-identical products at 1-20 rows: each output is one accumulator over the inputs in order, whatever the
    vector width or rows per tile, so a machine's choice of tile never changes a decode. The AVX2 build's
    quantised tile (a Q4_1 weight) gives this CPU's float32 products too."""
    import subprocess
    import sys

    from graft_block import skinny

    if not ON_CPU or not skinny.available():
        pytest.skip(f"the skinny kernel does not build here: {skinny.why_not()}")
    if "avx2" not in skinny._cpu_flags().split():
        pytest.skip("no AVX2 on this CPU")
    from graft_block.testing import gguf_quantised

    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(100, 77, generator=g), torch.randn(20, 77, generator=g)
    wq, xq = gguf_quantised(torch.randn(100, 96, generator=g)), torch.randn(20, 96, generator=g)  # a Q4_1 weight
    torch.save({"w": w, "x": x, "wq": wq, "xq": xq}, tmp_path / "in.pt")
    script = ("import torch, sys; from graft_block import skinny; d = torch.load(sys.argv[1]); "
              "assert skinny.label().startswith('avx2'), skinny.label(); p = skinny.SkinnyWeight(d['w']); "
              "q = skinny.SkinnyWeight(d['wq']); assert q.prec == skinny.Q4, q.prec; "
              "torch.save([skinny.linear(d['x'][:n], p) for n in (1, 6, 7, 20)] + "
              "[skinny.linear(d['xq'][:n], q) for n in (1, 6, 7, 20)], sys.argv[2])")
    env = {**os.environ, "GRAFT_BLOCK_SKINNY": "avx2", "OMP_NUM_THREADS": "1", skinny.QUANT_ENV: "1"}
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], env=env,
                   check=True)
    theirs = torch.load(tmp_path / "out.pt")
    pw, pq = skinny.SkinnyWeight(w), skinny.SkinnyWeight(wq, half=False)  # float32 here: the quantised tile's bits
    for n, y, yq in zip((1, 6, 7, 20), theirs[:4], theirs[4:]):
        assert torch.equal(y, skinny.linear(x[:n], pw)), (n, skinny.label())
        assert torch.equal(yq, skinny.linear(xq[:n], pq)), (n, skinny.label())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_c_decoder_layers_give_a_decode_step_and_a_tree_the_same_bits(arch, monkeypatch):
    """On skinny's products every layer runs in C (skinny.DecoderLayers). A node's logits in a bushy tree, whose
    ancestors sit behind siblings in the cache, must equal bit for bit those of plain one-row decode steps along
    its path (that is what keeps every tree method token-identical to AR), and stay within HF's tolerance of the
    torch layers on the same packed products (GRAFT_BLOCK_FUSED=0)."""
    from graft_block import skinny

    if not (ON_CPU and skinny.available()):
        pytest.skip(f"the skinny kernel does not run here: {skinny.why_not()}")
    t = tiny_target(arch, engine="lean", gemm="skinny")
    assert t.lean.fused is not None, t.lean.fused_why_not
    monkeypatch.setenv("GRAFT_BLOCK_FUSED", "0")
    torch_layers = Target(t.model, None, engine="lean", gemm="skinny")
    assert torch_layers.lean.fused is None and torch_layers.lean.fused_why_not == "GRAFT_BLOCK_FUSED=0"
    prompt = torch.tensor([5, 9, 2, 7, 11, 3, 8, 1, 4])
    paths = [[17], [40, 41, 42], [40, 6], [9, 60, 61, 62], [9, 60, 70]]  # keys at other offsets than in AR
    tree = from_paths(4, paths)
    t.prefill(prompt)
    tree_logits, _ = t.verify(tree)
    torch_layers.prefill(prompt)
    assert torch.allclose(tree_logits, torch_layers.verify(tree)[0], atol=1e-4)
    parents = tree.parents.tolist()
    for node in range(1, tree.size):
        line = [node]
        while parents[line[-1]] > 0:
            line.append(parents[line[-1]])
        tokens = [4] + tree.tokens[line[::-1]].tolist()  # root, then the node's ancestors and itself
        t.prefill(prompt)
        for tok in tokens:
            step, _ = t.verify(root_only(tok))
        assert torch.equal(step[0], tree_logits[node]), (arch, node, (step[0] - tree_logits[node]).abs().max())


def test_c_decoder_layers_on_float16_exact_weights_stream_half_the_bytes_and_keep_the_bits(monkeypatch):
    """A target whose weights are all float16 values (an fp16 checkpoint upcast to float32) gets its products
    packed in half precision, and every logit equals the float32 packs' bit for bit."""
    from graft_block import skinny

    if not (ON_CPU and skinny.available() and skinny._lib.half_weights()):
        pytest.skip("no skinny kernel with float16 loads here")
    t = tiny_target("qwen2", engine="hf")  # biases too
    with torch.no_grad():
        for p in t.model.parameters():
            p.copy_(p.half().float())
    half = Target(t.model, None, engine="lean", gemm="skinny")
    assert all(p[k].packed.dtype == torch.float16 for p in half.lean.skinny for k in p)
    monkeypatch.setattr(skinny._lib, "half_weights", lambda: 0)
    full = Target(t.model, None, engine="lean", gemm="skinny")
    assert all(p[k].packed.dtype == torch.float32 for p in full.lean.skinny for k in p)
    prompt = torch.tensor([5, 9, 2, 7, 11, 3])
    tree = from_paths(4, [[17], [40, 41, 42], [40, 6]])
    for target in (half, full):
        target.prefill(prompt)
    assert torch.equal(half.verify(tree)[0], full.verify(tree)[0])


def test_exactly_quantised_weights_pack_in_their_quantised_form_and_keep_the_bits(monkeypatch):
    """With GRAFT_BLOCK_EXACT_QUANT=1 a float32 weight whose every run of 32 inputs is exactly GGUF's Q4_1 (or Q8_0)
    de-quantised packs as 4-bit (8-bit) values with float16 scales, and its products equal the float32 pack's bit
    for bit at every row count; rows come back exactly. A weight one ulp off, an input width off the runs, or the
    switch off (the default) keeps the float32 pack."""
    from graft_block import skinny
    from graft_block.testing import gguf_quantised

    if not (ON_CPU and skinny.available() and skinny._lib.quant_weights()):
        pytest.skip("no skinny kernel with quantised loads here")
    g = torch.Generator().manual_seed(5)
    w4 = gguf_quantised(torch.randn(1000, 576, generator=g), 4)
    w4[7, 32:64] = w4[7, 40]  # a run of one value: d = 0
    monkeypatch.delenv(skinny.QUANT_ENV, raising=False)
    assert skinny.SkinnyWeight(w4).prec == skinny.F32  # off by default
    monkeypatch.setenv(skinny.QUANT_ENV, "1")
    for w, prec, bytes_per_weight in ((w4, skinny.Q4, 0.625), (gguf_quantised(torch.randn(64, 1536, generator=g),
                                                                              8), skinny.Q8, 1.0625)):
        q, full = skinny.SkinnyWeight(w), skinny.SkinnyWeight(w, half=False)
        assert q.prec == prec and full.prec == skinny.F32
        assert q.packed.numel() <= bytes_per_weight * w.numel() * 1.1 < full.packed.numel() * 4
        x = torch.randn(20, w.shape[1], generator=g)
        for n in (1, 2, 7, 8, 9, 16, 20):
            assert torch.equal(skinny.linear(x[:n], q).view(torch.int32), skinny.linear(x[:n], full).view(torch.int32))
        ids = torch.tensor([w.shape[0] - 1, 0, 7, w.shape[0] // 2])
        assert torch.equal(q.rows(ids).view(torch.int32), w[ids].view(torch.int32))
    off = w4.clone()
    off[3, 5] = torch.nextafter(off[3, 5], torch.tensor(1.0))
    assert skinny.SkinnyWeight(off).prec == skinny.F32
    assert skinny.SkinnyWeight(gguf_quantised(torch.randn(8, 64, generator=g))[:, :48].contiguous()).prec != skinny.Q4
    assert skinny.exact_quant(torch.randn(64, 64, generator=g)) is None


def test_c_decoder_layers_on_gguf_quantised_weights_keep_the_bits(monkeypatch):
    """A target holding a GGUF model's de-quantised weights (Q4_1 layers, a Q8_0 head) streams them in that form
    under GRAFT_BLOCK_EXACT_QUANT=1, says so in its engine label, and every logit of a tree verify equals the
    float32 packs' bit for bit (so every method stays token-identical to AR in either form)."""
    from graft_block import skinny
    from graft_block.testing import gguf_like

    if not (ON_CPU and skinny.available() and skinny._lib.quant_weights()):
        pytest.skip("no skinny kernel with quantised loads here")
    t = tiny_target("llama", engine="hf", hidden_size=64)
    gguf_like(t.model)
    monkeypatch.setenv(skinny.QUANT_ENV, "1")
    quant = Target(t.model, None, engine="lean", gemm="skinny")
    assert quant.lean.exact_quant == ["q4_1", "q8_0"] and quant.engine_label.endswith("+exact-q4_1/q8_0")
    assert quant.lean.fused is not None
    monkeypatch.setenv(skinny.QUANT_ENV, "0")
    full = Target(t.model, None, engine="lean", gemm="skinny")
    assert full.lean.exact_quant == [] and all(p[k].prec == skinny.F32 for p in full.lean.skinny for k in p)
    prompt = torch.tensor([5, 9, 2, 7, 11, 3])
    tree = from_paths(4, [[17], [40, 41, 42], [40, 6]])
    for target in (quant, full):
        target.prefill(prompt)
    assert torch.equal(quant.verify(tree)[0], full.verify(tree)[0])


def test_hf_weights_the_c_layers_do_not_read_are_released_and_read_back_unchanged(tmp_path):
    """With every layer in C, HF's mmapped weights leave memory (``release_hf_weights``); anything that reads them
    later (HF generate) reads the file's values again. Weights in anonymous memory are never released: dropping
    those pages would zero them."""
    from graft_block import skinny
    from graft_block.target import load_target

    if not (ON_CPU and skinny.available()):
        pytest.skip(f"the skinny kernel does not run here: {skinny.why_not()}")
    made = tiny_target("llama", engine="hf")
    assert Target(made.model, None, engine="lean", gemm="skinny").release_hf_weights() == 0  # anonymous memory
    made.model.save_pretrained(tmp_path)  # safetensors: from_pretrained maps the file
    t = load_target(str(tmp_path), gemm="skinny")
    t.model.generation_config.eos_token_id = None
    before = {n: p.clone() for n, p in t.model.named_parameters()}
    assert t.release_hf_weights() > 0
    prompt = [5, 9, 2, 7]
    assert SpeculativeDecoder(t).generate(prompt, max_new_tokens=12).tokens == hf_greedy(t, prompt, 12)
    assert all(torch.equal(p, before[n]) for n, p in t.model.named_parameters())
    assert Target(t.model, None, engine="lean", gemm="mkl").release_hf_weights() == 0  # the torch layers read them
    early = load_target(str(tmp_path), gemm="skinny", release_hf=True)  # released layer by layer while packing
    early.model.generation_config.eos_token_id = None
    assert early.lean.released > 0
    assert SpeculativeDecoder(early).generate(prompt, max_new_tokens=12).tokens == hf_greedy(early, prompt, 12)


def test_layer_cache_refuses_to_keep_rows_it_never_held():
    from graft_block import skinny

    cache = skinny.LayerCache(1, 2, 16)
    with pytest.raises(ValueError, match="cannot keep 5 rows of a cache holding 0"):
        cache.reserve(10, 5)
    cache.reserve(10, 0)
    assert cache.v.shape[2] >= 10 and cache.rows(3)[0].shape == (1, 2, 3, 16)


@pytest.mark.parametrize("gemm", ["mkl", "skinny"])
def test_a_cache_grown_under_inference_mode_takes_writes_outside_it(gemm):
    """`graft-block expect` scores trees under torch.inference_mode and its caller decodes after it: the engine's
    KV cache must stay writable in both modes, whichever grew it first (seen on a Xeon, where the tiny target's
    measured kernel choice took the torch layers: "Inplace update to inference tensor outside InferenceMode")."""
    from graft_block import Drafter, skinny
    from graft_block.testing import prefilled_state

    if not ON_CPU:
        pytest.skip("a CPU kernel choice")
    if gemm == "skinny" and not skinny.available():
        pytest.skip(f"the skinny kernel does not build here: {skinny.why_not()}")
    t = tiny_target("llama", engine="lean", gemm=gemm)
    d = Drafter.from_config({"type": "dflash", "num_layers": 1, "target_layer_ids": [0, 2], "block_size": 4,
                             "seed": 1, "proposal": "ddtree", "budget": 4}, target=t)
    ids = list(range(3, 12))
    with torch.inference_mode():
        first = d.propose(prefilled_state(t, ids, d))
    again = d.propose(prefilled_state(t, ids, d))  # outside: writes into the caches grown above
    assert torch.equal(first.tokens, again.tokens)
    assert SpeculativeDecoder(t, d).generate(ids, max_new_tokens=6).tokens == hf_greedy(t, ids, 6)


def test_a_partial_rotary_embedding_is_refused_not_run_on_half_a_table():
    """A rope type that honours ``partial_rotary_factor`` gives cos/sin narrower than the head; HF's Llama and the
    torch layers then fail on the shapes, while the C layers read [n, head_dim] past the end of the tables and ran
    on. The lean forward refuses such a model, and the C layers refuse tables of another width."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from graft_block import skinny

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                                       "partial_rotary_factor": 0.5})
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ConfigError, match="partial rotary embedding.*16 of the head's 32"):
        LeanForward(model)
    if not (ON_CPU and skinny.available()):
        return
    t = tiny_target("llama", engine="lean", gemm="skinny")
    assert t.lean.fused is not None, t.lean.fused_why_not
    t.prefill(torch.tensor([5, 9, 2]))  # the cache exists
    x, hd = torch.randn(3, 64), t.lean.head_dim
    for width in (hd // 2, hd + 2):
        cos = torch.ones(3, width)
        with pytest.raises(ValueError, match=f"cos and sin must be float32 \\[3, {hd}\\]"):
            t.lean.fused.run(x, cos, cos, t.lean.k, t.lean.v, 0, None, {})


def _rope_tables(positions, hd):
    inv = 1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.tensor(positions, dtype=torch.float64)[:, None] * inv
    ang = torch.cat([ang, ang], -1)
    return ang.cos(), ang.sin()


def _reference_layers(layers, x, emb, cos, sin, ks, vs, mask, dims):
    """One forward of ``layers`` (float64 dicts of c_layer's keys) on x [n, H] after the cached keys ks / values vs
    (per layer [rows, kv_heads, hd], appended to): a Llama / Qwen3 / EAGLE-3 decoder layer written out in torch."""
    nh, nkv, hd, eps, qk_eps, scaling = dims
    n, start = x.shape[0], ks[0].shape[0]

    def norm(t, w, e):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + e) * w

    def rope(t):  # [n, heads, hd]
        half = hd // 2
        rot = torch.cat([-t[..., half:], t[..., :half]], -1)
        return t * cos[:, None] + rot * sin[:, None]

    def lin(t, w, key):
        y = t @ w[key].T
        return y if w[key + "_b"] is None else y + w[key + "_b"]

    if mask is None:
        mask = torch.full((n, start + n), float("-inf"), dtype=torch.float64)
        for r in range(n):
            mask[r, : start + r + 1] = 0.0
    for li, w in enumerate(layers):
        if w.get("hn") is not None:
            h = torch.cat([norm(emb, w["ln1"], eps), norm(x, w["hn"], eps)], -1)
            if w.get("norm_residual"):
                x = norm(x, w["hn"], eps)
        else:
            h = norm(x, w["ln1"], eps)
        q, k, v = lin(h, w, "qkv").split([nh * hd, nkv * hd, nkv * hd], -1)
        q, k, v = q.view(n, nh, hd), k.view(n, nkv, hd), v.view(n, nkv, hd)
        if w.get("q_norm") is not None:
            q, k = norm(q, w["q_norm"], qk_eps), norm(k, w["k_norm"], qk_eps)
        q, k = rope(q), rope(k)
        ks[li], vs[li] = torch.cat([ks[li], k]), torch.cat([vs[li], v])
        kk, vv = ks[li].repeat_interleave(nh // nkv, 1), vs[li].repeat_interleave(nh // nkv, 1)  # [L, nh, hd]
        scores = torch.einsum("nhd,lhd->hnl", q, kk) * scaling + mask
        att = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), vv).reshape(n, nh * hd)
        x = x + lin(att, w, "o")
        g, u = lin(norm(x, w["ln2"], eps), w, "gu").chunk(2, -1)
        x = x + lin(F.silu(g) * u, w, "d")
    return x


@pytest.mark.parametrize("case", ["mixed-packs", "eagle3", "eagle3-norm-residual"])
def test_c_decoder_layers_equal_a_torch_reference_layer(case):
    """The C decoder layers against the layer written out in torch, on weights the tiny targets never have:
    random norm weights (ln1 / ln2 / q_norm / k_norm / EAGLE-3's hidden_norm, each where it belongs), a bias on
    every product, norm epsilons large enough to matter, an MLP width off the vector width (the SiLU tail), scores
    past exp's range (softmax must shift by the max), products of different packings in one layer (float32,
    float16, Q4_1, Q8_0), a causal prefill and then rows at a later start under a finite additive mask: the
    outputs, and the K/V the cache holds, agree to float32 rounding."""
    from graft_block import skinny
    from graft_block.testing import gguf_quantised

    if not (ON_CPU and skinny.available()):
        pytest.skip(f"the skinny kernel does not run here: {skinny.why_not()}")
    g = torch.Generator().manual_seed(11)
    H, nh, nkv, hd = 32, 4, 2, 16
    inter = 64 if case == "mixed-packs" else 40  # Q4 / Q8 packs need widths of whole 32-input runs
    eps, qk_eps = 0.05, 0.2
    scaling = 8.0 if case == "mixed-packs" else hd ** -0.5  # q/k-normed heads: scores up to ~100 and more
    hn = case.startswith("eagle3")
    qkv_in = 2 * H if hn else H

    def rand(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    ref, packed = [], []
    for _ in range(1 if hn else 2):
        w = dict(ln1=torch.rand(H, generator=g) + 0.5, ln2=torch.rand(H, generator=g) + 0.5,
                 qkv=rand((nh + 2 * nkv) * hd, qkv_in), qkv_b=rand((nh + 2 * nkv) * hd),
                 o=rand(H, nh * hd).half().float(), o_b=rand(H), gu=rand(2 * inter, H), gu_b=rand(2 * inter),
                 d=rand(H, inter), d_b=rand(H))
        if hn:
            w.update(hn=torch.rand(H, generator=g) + 0.5, norm_residual=case.endswith("residual"))
        else:
            w.update(q_norm=torch.rand(hd, generator=g) + 0.5, k_norm=torch.rand(hd, generator=g) + 0.5)
        if case == "mixed-packs":
            w["gu"], w["d"] = gguf_quantised(w["gu"], 4), gguf_quantised(w["d"], 8)
        p = dict(w, qkv=skinny.SkinnyWeight(w["qkv"], half=False), o=skinny.SkinnyWeight(w["o"]),
                 gu=skinny.SkinnyWeight(w["gu"], quant=True), d=skinny.SkinnyWeight(w["d"], quant=True))
        if case == "mixed-packs" and skinny._lib.half_weights() and skinny._lib.quant_weights():
            assert [p[k].prec for k in ("qkv", "o", "gu", "d")] == [skinny.F32, skinny.F16, skinny.Q4, skinny.Q8]
        packed.append(p)
        ref.append({k: v.double() if isinstance(v, torch.Tensor) else v for k, v in w.items()})
    layers = skinny.DecoderLayers(packed, H, nh, nkv, hd, inter, eps, qk_eps, scaling)
    cache = skinny.LayerCache(len(packed), nkv, hd)
    cache.reserve(19, 0)
    ks = [torch.zeros(0, nkv, hd, dtype=torch.float64) for _ in packed]
    vs = [torch.zeros(0, nkv, hd, dtype=torch.float64) for _ in packed]
    mask = torch.randn(6, 19, generator=g)  # finite additive values, and hidden keys; past one vector of keys
    mask[0, 2] = mask[1, 15] = mask[2, 0] = mask[3, 17] = float("-inf")
    for start, positions, m in ((0, list(range(13)), None), (13, [13, 14, 14, 15, 15, 16], mask)):
        n = len(positions)
        x, emb = torch.randn(n, H, generator=g), torch.randn(n, H, generator=g)
        cos, sin = _rope_tables(positions, hd)
        want = _reference_layers(ref, x.double(), emb.double(), cos, sin, ks, vs,
                                 None if m is None else m.double(), (nh, nkv, hd, eps, qk_eps, scaling))
        got = x.clone()
        layers.run(got, cos.float(), sin.float(), cache.k, cache.v, start, m, {}, emb=emb if hn else None)
        assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-4), (case, start, (got - want).abs().max())
        kc, vc = cache.rows(start + n)  # [layers, kv_heads, rows, hd]
        for li in range(len(packed)):
            assert torch.allclose(kc[li].transpose(0, 1).double(), ks[li], atol=1e-4, rtol=1e-4), (case, li)
            assert torch.allclose(vc[li].transpose(0, 1).double(), vs[li], atol=1e-4, rtol=1e-4), (case, li)


def test_c_decoder_layers_refuse_inputs_they_would_read_past():
    """``DecoderLayers.run`` checks what the C code would otherwise read or write past the end of: an EAGLE-3 layer
    without its embeddings, a key cache whose rows are not whole blocks or shorter than the value cache's; rows that
    exactly fill the cache are taken."""
    from graft_block import skinny

    if not (ON_CPU and skinny.available()):
        pytest.skip(f"the skinny kernel does not run here: {skinny.why_not()}")
    g = torch.Generator().manual_seed(12)
    H, nh, nkv, hd, inter = 32, 2, 1, 16, 32
    w = dict(ln1=torch.ones(H), ln2=torch.ones(H), hn=torch.ones(H),
             qkv=skinny.SkinnyWeight(torch.randn((nh + 2 * nkv) * hd, 2 * H, generator=g)),
             o=skinny.SkinnyWeight(torch.randn(H, nh * hd, generator=g)),
             gu=skinny.SkinnyWeight(torch.randn(2 * inter, H, generator=g)),
             d=skinny.SkinnyWeight(torch.randn(H, inter, generator=g)))
    layers = skinny.DecoderLayers([w], H, nh, nkv, hd, inter, 1e-5, 1e-5, hd ** -0.5)
    cache = skinny.LayerCache(1, nkv, hd)
    cache.reserve(4, 0)
    cap = cache.v.shape[2]
    x, cs = torch.randn(2, H, generator=g), torch.ones(2, hd)
    with pytest.raises(ValueError, match="an EAGLE-3 layer \\(hn\\) needs float32 emb"):
        layers.run(x.clone(), cs, cs, cache.k, cache.v, 0, None, {})
    with pytest.raises(ValueError, match="an EAGLE-3 layer \\(hn\\) needs float32 emb"):
        layers.run(x.clone(), cs, cs, cache.k, cache.v, 0, None, {}, emb=torch.randn(3, H))
    for k in (cache.k[..., : cap - 1], cache.k[..., : cap - skinny.CAP_MULTIPLE]):
        with pytest.raises(ValueError, match="each transposed key row must hold the value cache's rows"):
            layers.run(x.clone(), cs, cs, k, cache.v, 0, None, {}, emb=x.clone())
    last = x.clone()
    layers.run(last, cs, cs, cache.k, cache.v, cap - 2, None, {}, emb=x.clone())  # the cache's last two rows
    assert last.isfinite().all() and not torch.equal(last, x)


def test_layer_cache_keeps_its_rows_when_it_grows():
    """A drafter's C-layer cache grows by reallocating: the rows it keeps come back unchanged, keys and values."""
    from graft_block import skinny

    cache = skinny.LayerCache(2, 2, 16)
    cache.reserve(10, 0)
    g = torch.Generator().manual_seed(13)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    k, v = (t.clone() for t in cache.rows(10))
    cache.reserve(cache.v.shape[2] + 1, 10)
    assert cache.v.shape[2] > 256 and cache.k.shape[3] >= cache.v.shape[2]
    assert torch.equal(cache.rows(10)[0], k) and torch.equal(cache.rows(10)[1], v)
