"""The DFlash backbone's drafting forward in C (drafters/dflash/c_block.py) against the torch forward, and the
block cut to a budget's rows (``block_size: "budget"``)."""
import pytest
import torch

from graft_block import skinny
from graft_block.decoder import SpeculativeDecoder
from graft_block.drafter import Drafter
from graft_block.drafters import dflash as D
from graft_block.drafters.dflash import c_block
from graft_block.drafters import mfd as M
from graft_block.errors import ConfigError
from graft_block.testing import hf_greedy, prefilled_state, tiny_target

ON_CPU = torch.device("cpu") == torch.device(__import__("os").environ.get("GRAFT_BLOCK_TEST_DEVICE", "cpu"))


@pytest.fixture(scope="module")
def fused():
    if not (ON_CPU and skinny.available()):
        pytest.skip(f"the skinny kernel does not run here: {skinny.why_not()}")
    t = tiny_target("qwen3", engine="lean", gemm="skinny")
    assert t.lean.fused is not None, t.lean.fused_why_not
    return t


def _pair(target, cls=D.DFlashDrafter, **kw):
    """The same model twice: one drafter on the C layers, one on the torch forward."""
    base = D.new_model(target, num_layers=2, block_size=8, target_layer_ids=[0, 2], seed=3)
    if cls is M.MFDDrafter:
        base = M.MFDModel.from_dflash(base, num_modes=3)
        with torch.no_grad():
            base.break_symmetry(target.embed(torch.tensor([base.mask_token_id]))[0], 0.5, seed=1)
    c, t = cls(target, base, **kw), cls(target, base, **kw)
    t.c_context = None
    return c, t


def test_c_block_matches_the_torch_forward_as_the_context_grows(fused):
    """A block drafted by the C layers equals the torch forward's to float32 rounding, after a prefill that
    outgrows the first cache allocation and after commits of a few rows (appended in the C cache layout)."""
    c, t = _pair(fused, proposal="ddtree", budget=6)
    assert c.c_context is not None
    prompt = torch.randint(3, 128, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    st = prefilled_state(fused, prompt, c)
    t.prefill(st)
    ids = torch.full((8,), c.model.mask_token_id)
    ids[0] = st.root_token
    feats = st.new_features
    with torch.inference_mode():
        for extra in (0, 1, 3):
            if extra:  # a commit of `extra` rows: any features will do, both drafters take the same
                more = torch.randn(extra, feats.shape[1], generator=torch.Generator().manual_seed(extra))
                c._extend(more, c.ctx_len)
                t._extend(more, t.ctx_len)
                st.tokens.extend([5] * extra)
            assert c.ctx_len == t.ctx_len
            kc, vc = c.c_context.cache.rows(c.ctx_len)  # the C cache holds the torch path's context K/V
            assert torch.allclose(kc, torch.cat(t.ctx_k), atol=1e-4)
            assert torch.allclose(vc, torch.cat(t.ctx_v), atol=1e-4)
            hc, ht = c.block_hidden(st, ids), t.block_hidden(st, ids)
            assert torch.allclose(hc, ht, atol=1e-4, rtol=1e-4), (extra, (hc - ht).abs().max())
            assert not torch.allclose(hc[1], hc[2])  # rows really differ: positions reach the C layers


def test_c_block_takes_mfd_mode_masks(fused):
    """MFD's K modes in one forward (each mode's rows see the context and their own mode's block only) give the
    torch forward's logits on the C layers, and the modes stay distinct."""
    c, t = _pair(fused, cls=M.MFDDrafter, budget=5)
    prompt = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    st = prefilled_state(fused, prompt, c)
    t.prefill(st)
    with torch.inference_mode():
        lc, lt = c.mode_logits(st), t.mode_logits(st)
    assert lc.shape[0] == 3 and torch.allclose(lc, lt, atol=1e-3, rtol=1e-3), (lc - lt).abs().max()
    assert not torch.allclose(lc[0], lc[1], atol=1e-3)


@pytest.mark.parametrize("bf16", [False, True])
# budgets of 12: wide enough first levels that even these untrained drafters get a few drafts accepted
@pytest.mark.parametrize("cls,kw", [(D.DFlashDrafter, {"proposal": "ddtree", "budget": 12}),
                                    (M.MFDDrafter, {"budget": 12})])
def test_c_block_drafts_stay_token_identical_to_ar(fused, cls, kw, bf16, monkeypatch):
    """Greedy output is HF greedy's (and AR's) with the exact packs and with bfloat16 drafting (the benchmark's
    default on AVX512-BF16 CPUs), whose block stays near the torch forward's; some drafts were accepted (tau > 1),
    so the identity covers commits of accepted rows into the C cache."""
    if bf16:
        if not skinny._lib.bf16_weights():
            pytest.skip("bfloat16 drafting needs an AVX512-BF16 CPU")
        monkeypatch.setenv(skinny.DRAFT_BF16_ENV, "1")
    c, t = _pair(fused, cls=cls, block_size="budget", **kw)
    if bf16:
        with torch.inference_mode():
            monkeypatch.setenv(skinny.DRAFT_BF16_ENV, "0")  # the reference: torch layers on exact packs
            st = prefilled_state(fused, list(range(3, 30)), c)
            t.prefill(st)
            ref = t.block_hidden(st, torch.full((c.block_size,), c.model.mask_token_id))
            monkeypatch.setenv(skinny.DRAFT_BF16_ENV, "1")
            got = c.block_hidden(st, torch.full((c.block_size,), c.model.mask_token_id))
        assert c.model.__dict__["_c_layers"][1]._keep[2].dtype == torch.bfloat16  # the C layers run bf16 packs
        err = (got - ref).abs().max()
        assert 1e-5 < err < 0.1 * ref.abs().max(), err  # rounded, not broken
    prompt = torch.randint(3, 128, (24,), generator=torch.Generator().manual_seed(5))
    ref = hf_greedy(fused, prompt, 80)
    ar = SpeculativeDecoder(fused, None).generate(prompt, max_new_tokens=80)
    spec = SpeculativeDecoder(fused, c).generate(prompt, max_new_tokens=80)
    assert ar.tokens == ref and spec.tokens == ref
    assert spec.stats.tau > 1.0, dict(spec.stats.accept_hist)


def test_block_size_budget_keeps_the_rows_a_tree_can_reach(tiny_qwen3):
    base = D.new_model(tiny_qwen3, num_layers=1, block_size=8, target_layer_ids=[0, 2], seed=3)
    assert D.DFlashDrafter(tiny_qwen3, base, proposal="ddtree", budget=3, block_size="budget").block_size == 4
    assert D.DFlashDrafter(tiny_qwen3, base, proposal="ddtree", budget=30, block_size="budget").block_size == 8
    assert D.DFlashDrafter(tiny_qwen3, base, proposal="chain", block_size="budget").block_size == 8  # no budget
    with pytest.raises(ConfigError, match="block_size must be an int, 'budget' or 'adaptive'"):
        D.DFlashDrafter(tiny_qwen3, base, proposal="ddtree", budget=3, block_size="rows")


def test_benchmark_mode_frees_the_torch_layer_weights(fused, tmp_path):
    """With target.share_drafter_checkpoints (the benchmark), a shared checkpoint's layer weights that the C packs
    serve are freed: drafting stays token-identical to AR, and the torch forward fails with a message naming why
    instead of running on empty weights. A model passed in directly is left alone."""
    t = tiny_target("qwen3", engine="lean", gemm="skinny")
    t.share_drafter_checkpoints = True
    mine = D.new_model(t, num_layers=2, block_size=8, target_layer_ids=[0, 2], seed=3)
    D.DFlashDrafter(t, mine, proposal="ddtree", budget=4)
    assert mine.layers[0].mlp.gate_proj.weight.numel() > 0
    D.save_checkpoint(mine, tmp_path)
    d = Drafter.from_config({"type": "dflash", "checkpoint": str(tmp_path), "proposal": "ddtree", "budget": 4},
                            target=t)
    base = d.model
    assert base.layers[0].mlp.gate_proj.weight.numel() == 0 and base.layers[1].self_attn.k_proj.weight.numel() == 0
    assert base.fc.weight.numel() > 0  # the features' projection still runs in torch
    prompt = torch.randint(3, 128, (24,), generator=torch.Generator().manual_seed(7))
    ref = hf_greedy(t, prompt, 30)
    assert SpeculativeDecoder(t, None).generate(prompt, max_new_tokens=30).tokens == ref
    assert SpeculativeDecoder(t, d).generate(prompt, max_new_tokens=30).tokens == ref
    with pytest.raises(ConfigError, match="torch layers were freed"):
        base(torch.zeros(8, 64), torch.arange(8), [])


def test_c_packs_follow_weight_changes(fused):
    """A model whose weights change in place after a drafter packed them (training, then drafting again), its
    layers' or its features' projection (fc), is repacked for the next drafter built on it, so the C forward keeps
    matching the torch one; and the C layers refuse a forward that would run past their cache or with a mask of
    the wrong shape."""
    c, t = _pair(fused, proposal="ddtree", budget=4)
    prompt = torch.randint(3, 128, (30,), generator=torch.Generator().manual_seed(8)).tolist()
    fc = c.model.fc.weight
    for change in ("layers", "fc"):
        with torch.no_grad():
            if change == "layers":
                for p in c.model.layers.parameters():
                    p.mul_(1.5)
            else:  # not a uniform scale: the hidden norm after fc would undo that
                fc.add_(0.5 * torch.randn(fc.shape, generator=torch.Generator().manual_seed(1)))
        c2, t2 = (D.DFlashDrafter(fused, c.model, proposal="ddtree", budget=4) for _ in range(2))
        t2.c_context = None
        st = prefilled_state(fused, prompt, c2)
        t2.prefill(st)
        ids = torch.full((8,), c2.model.mask_token_id)
        ids[0] = st.root_token
        with torch.inference_mode():
            hc, ht = c2.block_hidden(st, ids), t2.block_hidden(st, ids)
        assert torch.allclose(hc, ht, atol=1e-4, rtol=1e-4), (change, (hc - ht).abs().max())
    layers, cache = c2.c_context.layers, c2.c_context.cache
    x, cs = torch.zeros(2, 64), torch.zeros(2, 16)
    with pytest.raises(ValueError, match="do not fit a cache"):
        layers.run(x, cs, cs, cache.k, cache.v, cache.v.shape[2] - 1, None, {})
    with pytest.raises(ValueError, match="mask must be a contiguous"):
        layers.run(x, cs, cs, cache.k, cache.v, 3, torch.zeros(2, 4), {})


def test_c_block_runs_only_a_silu_mlp_and_leaves_its_inputs_alone(fused):
    """The C layers compute SwiGLU with SiLU: a drafter whose MLP uses another activation drafts in torch, and
    says why. The C forward updates its own copy of the block's embeddings, never the caller's."""
    c, _ = _pair(fused, proposal="ddtree", budget=4)
    assert c_block.why_not(c.model, fused) is None
    prompt = torch.randint(3, 128, (20,), generator=torch.Generator().manual_seed(9)).tolist()
    prefilled_state(fused, prompt, c)
    embeds = torch.randn(8, 64, generator=torch.Generator().manual_seed(10))
    before = embeds.clone()
    with torch.inference_mode():
        c.c_context.forward(embeds, torch.arange(8) + c.ctx_len, None, c.ctx_len)
    assert torch.equal(embeds, before)
    gelu = D.new_model(fused, num_layers=1, block_size=8, target_layer_ids=[0, 2], seed=3)
    gelu.config.hidden_act = "gelu"
    assert "SwiGLU with SiLU, and this drafter's MLP uses gelu" in c_block.why_not(gelu, fused)
    assert D.DFlashDrafter(fused, gelu, proposal="ddtree", budget=4).c_context is None
