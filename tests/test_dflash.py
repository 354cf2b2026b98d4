"""DFlash drafter: losslessness (greedy and T=1), model semantics (KV injection, masks), checkpoint IO."""
import json
from collections import Counter

import pytest
import torch

import graft_block.drafters.dflash as D
import graft_block.drafters.mfd as M
from graft_block.decoder import SpeculativeDecoder
from graft_block.drafter import Drafter
from graft_block.errors import ConfigError
from graft_block.sampling import SamplingConfig
from graft_block.testing import (chi_square_test, exact_sequence_probs, hf_greedy, null_tv_quantile,
                                  prefilled_state, tiny_target)

PROMPT = [5, 17, 33, 2, 99, 64, 12]


def _drafter(target, **kw):
    cfg = {"type": "dflash", "num_layers": 2, "target_layer_ids": [0, 2], "block_size": 8, "seed": 1}
    cfg.update(kw)
    return Drafter.from_config(cfg, target=target)


def _hf_greedy(target, prompt, n):
    out = target.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("proposal,budget", [("chain", 7), ("ddtree", 20)])
def test_greedy_identity_tiny(arch, proposal, budget):
    target = tiny_target(arch)
    ref = _hf_greedy(target, PROMPT, 32)
    d = _drafter(target, proposal=proposal, budget=budget)
    res = SpeculativeDecoder(target, d).generate(PROMPT, max_new_tokens=32)
    assert res.tokens == ref
    # the draft cache holds exactly the committed context (block K/V are never kept; the last round may overshoot
    # max_new_tokens: count every round's walk, before the stop trim)
    assert d.ctx_len == len(PROMPT) + sum((k + 1) * c for k, c in res.stats.accept_hist.items())
    assert d.last_block_logprobs[0].shape[0] == 7


def test_greedy_identity_planted_drafter_accepts():
    """A drafter whose block hidden states are forced to the target's own answer must be accepted in full: this
    checks same-position alignment (row k predicts start+k) through the whole engine."""
    target = tiny_target("llama")
    ref = _hf_greedy(target, PROMPT, 32)
    d = _drafter(target, proposal="chain", budget=7)
    full = PROMPT + ref
    W = target.model.get_output_embeddings().weight

    def cheat(state, rows=None, length=None):  # logits = one-hot of the true continuation at rows 1..B-1
        start = state.cache_len
        nxt = full[start + 1: start + d.block_size]
        nxt = nxt + [0] * (d.block_size - 1 - len(nxt))
        return torch.nn.functional.one_hot(torch.tensor(nxt), W.shape[0]).float() * 50

    d.block_logits = cheat
    res = SpeculativeDecoder(target, d).generate(PROMPT, max_new_tokens=32)
    assert res.tokens == ref
    assert res.stats.tau > 6.0


@pytest.mark.parametrize("block_size,length", [(3, 2), ("adaptive", 3)])
def test_sampling_matches_target_distribution(block_size, length):
    """T=1 on a 4-token vocabulary: the joint law of the first 2 new tokens under DFlash+DDTree equals the target's
    exact law (chi-square p > 1e-3, TV below the 99.9% quantile of TV under exact sampling with the same n), with
    drafted nodes accepted. Power: the same counts reject the T=0.8 law (TV 0.12 from the true one: the old fixed
    tolerance), at a noncentrality of about 74 for n = 800 (rejected with probability > 0.999). Again for 3 tokens
    with adaptive rows, where the second round's block is cut by the first round's acceptance."""
    V = 4
    target = tiny_target("llama", vocab_size=V, hidden_size=32, num_layers=2)
    d = _drafter(target, proposal="ddtree", budget=4, block_size=block_size, mask_token_id=V - 1,
                 target_layer_ids=[0, 1])
    dec = SpeculativeDecoder(target, d)
    prompt = [1, 3, 2]
    exact = exact_sequence_probs(target, prompt, length, SamplingConfig(1.0))
    n = 800
    gen = torch.Generator().manual_seed(123)
    counts, accepted = Counter(), 0
    for _ in range(n):
        r = dec.generate(prompt, max_new_tokens=length, temperature=1.0, generator=gen)
        counts[tuple(r.tokens)] += 1
        accepted += sum(k * c for k, c in r.stats.accept_hist.items())  # drafted nodes the walk accepted
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in exact.items())
    tol = null_tv_quantile(exact, n)
    stat, dof, p = chi_square_test(counts, exact)
    assert tv < tol and p > 1e-3, (tv, tol, stat, dof, p)
    assert accepted > n // 10  # the tree path is exercised, not only the bonus token
    cooler = exact_sequence_probs(target, prompt, length, SamplingConfig(0.8))
    assert chi_square_test(counts, cooler)[2] < 1e-3  # negative control: a wrong law is rejected


def test_adaptive_rows_follow_the_deepest_recent_acceptance(tiny_qwen3):
    """block_size "adaptive": the rows a tree of the budget reaches until a round is verified, then ROWS_MARGIN
    levels below the deepest acceptance of the call's last ROWS_WINDOW rounds; greedy output stays the target's."""
    d = _drafter(tiny_qwen3, proposal="ddtree", budget=5, block_size="adaptive")
    st = prefilled_state(tiny_qwen3, PROMPT, d)
    assert d.round_size(st) == (5, 6)  # no round yet: the anchor row + 5 drafting rows
    d._accepted.extend([0, 1, 0])
    assert d.round_size(st) == (5, 5)  # deepest acceptance 1 + margin 3 + the anchor row
    d._accepted.extend([0] * d.ROWS_WINDOW)
    assert d.round_size(st) == (5, 4)
    st.draft_nodes = 2  # a schedule's smaller ask wins, and 2 nodes reach 2 rows at most
    assert d.round_size(st) == (2, 3)
    res = SpeculativeDecoder(tiny_qwen3, d).generate(PROMPT, max_new_tokens=24)
    assert res.tokens == _hf_greedy(tiny_qwen3, PROMPT, 24)
    assert len(d._accepted) == min(res.stats.rounds, d.ROWS_WINDOW)  # reset at prefill, one entry a round
    with pytest.raises(ConfigError, match="'budget' or 'adaptive'"):
        _drafter(tiny_qwen3, proposal="ddtree", budget=5, block_size="rows")


def test_features_are_hidden_states_id_plus_one(tiny_qwen3):
    d = _drafter(tiny_qwen3, target_layer_ids=[0, 3])
    assert d.feature_layers == (1, 4)


def test_training_mask_matches_inference():
    """The batched training forward (all anchors, block mask) equals the inference forward of each block against
    a context cut strictly before its anchor: same semantics in training and decoding."""
    target = tiny_target("qwen3")
    torch.manual_seed(0)
    model = D.new_model(target, num_layers=2, block_size=5, target_layer_ids=[0, 2], mask_token_id=100)
    L = 20
    ids = torch.randint(0, 128, (1, L))
    target.set_feature_layers(model.feature_layers)
    target.reset()
    target.prefill(ids[0])
    feats = target._take_features() if False else None
    out = target.model(input_ids=ids, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i] for i in model.feature_layers], -1)  # [1, L, F]
    anchors = torch.tensor([[3, 9, 14]])
    B = 5
    pos = anchors.unsqueeze(-1) + torch.arange(B)
    blk = torch.full((1, 3, B), 100)
    blk[:, :, 0] = ids.gather(1, anchors)
    with torch.no_grad():
        ctx = model.fuse(feats)
        kv = model.context_kv(ctx, torch.arange(L).view(1, -1))
        mask = D.block_attention_mask(anchors, L, B, torch.float32)
        batched = model(target.embed(blk.view(1, -1)), pos.view(1, -1), kv, mask).view(3, B, -1)
        for j, a in enumerate(anchors[0].tolist()):
            kv_a = model.context_kv(ctx[:, :a], torch.arange(a).view(1, -1))
            single = model(target.embed(blk[0, j]), pos[0, j], kv_a)
            assert torch.allclose(batched[j], single, atol=1e-5)
        # an explicit all-visible mask equals the default (MFD passes its own masks through this argument)
        R = B
        zero = torch.zeros(R, 9 + R)
        kv9 = model.context_kv(ctx[:, :9], torch.arange(9).view(1, -1))
        assert torch.allclose(model(target.embed(blk[0, 1]), pos[0, 1], kv9, zero),
                              model(target.embed(blk[0, 1]), pos[0, 1], kv9), atol=1e-6)


def test_context_is_kv_only():
    """Context enters only as K/V: changing the MLP cannot change the context keys, and block outputs depend on
    the context (the injection is wired)."""
    target = tiny_target("llama")
    model = D.new_model(target, num_layers=1, block_size=4, target_layer_ids=[1], mask_token_id=100)
    ctx = model.fuse(torch.randn(1, 6, 64))
    k1, _ = model.context_kv(ctx, torch.arange(6).view(1, -1))[0]
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight.mul_(3.0)
    k2, _ = model.context_kv(ctx, torch.arange(6).view(1, -1))[0]
    assert torch.equal(k1, k2)
    emb = target.embed(torch.tensor([3, 100, 100, 100]))
    pos = torch.arange(6, 10)
    with torch.no_grad():
        a = model(emb, pos, model.context_kv(ctx, torch.arange(6).view(1, -1)))
        b = model(emb, pos, model.context_kv(ctx * 2 + 1, torch.arange(6).view(1, -1)))
    assert not torch.allclose(a, b)


# ---- checkpoints -------------------------------------------------------------------------------------------
def _block_logits(d, target):
    st = prefilled_state(target, PROMPT, d)
    with torch.no_grad():
        return d.block_logits(st)


@pytest.mark.parametrize("proposal", ["chain", "ddtree"])
def test_the_head_runs_only_on_the_rows_a_tree_of_the_budget_can_reach(proposal, tiny_qwen3):
    """Budget 3 on a block of 7 drafting rows: the LM head (the largest product of a draft) runs on 3 rows, and the
    tree is the one the head over every row gives."""
    d = _drafter(tiny_qwen3, proposal=proposal, budget=3)
    st = prefilled_state(tiny_qwen3, PROMPT, d)
    with torch.no_grad():
        lean = d.propose(st)
        assert d.last_block_logprobs[0].shape[0] == 3
        full_logits = d.block_logits
        d.block_logits = lambda state, rows=None, length=None: full_logits(state)  # every row, as before
        full = d.propose(st)
    assert d.last_block_logprobs[0].shape[0] == 7
    assert torch.equal(lean.tokens, full.tokens) and torch.equal(lean.parents, full.parents)


@pytest.mark.parametrize("proposal", ["chain", "ddtree"])
def test_a_draft_sized_by_the_schedule_is_the_draft_of_that_budget_and_block(proposal, tiny_qwen3):
    """``state.draft_nodes`` = 3 on a budget-5 drafter with a block of 8: the block forward runs 4 rows (the anchor
    and the 3 a 3-node tree can reach), the head 3, and the tree is the one a drafter built with budget 3 and block
    4 proposes."""
    d = _drafter(tiny_qwen3, proposal=proposal, budget=5)
    st = prefilled_state(tiny_qwen3, PROMPT, d)
    st.draft_nodes = 3
    with torch.no_grad():
        sized = d.propose(st)
        assert d.last_block_logprobs[0].shape[0] == 3
        ref_d = D.DFlashDrafter(tiny_qwen3, d.model, proposal=proposal, budget=3, block_size=4)
        ref = ref_d.propose(prefilled_state(tiny_qwen3, PROMPT, ref_d))
    assert torch.equal(sized.tokens, ref.tokens) and torch.equal(sized.parents, ref.parents)
    assert sized.size - 1 == 3


def test_checkpoint_round_trip(tmp_path, tiny_qwen3):
    d = _drafter(tiny_qwen3)
    D.save_checkpoint(d.model, tmp_path / "ck", dtype=torch.float32, extra={"type": "dflash"})
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 2] and cfg["block_size"] == 8 and cfg["type"] == "dflash"
    d2 = Drafter.from_config(str(tmp_path / "ck"), target=tiny_qwen3)
    assert torch.equal(_block_logits(d, tiny_qwen3), _block_logits(d2, tiny_qwen3))


def test_checkpoint_with_draft_vocab_round_trip(tmp_path, tiny_llama):
    vocab = torch.tensor([1, 4, 9, 16, 25, 36, 49, 64, 81, 100, 127])
    model = D.new_model(tiny_llama, 1, 6, [1], 127, draft_vocab=vocab)
    d = D.DFlashDrafter(tiny_llama, model, proposal="ddtree", budget=6)
    D.save_checkpoint(model, tmp_path / "ck", dtype=torch.float32, extra={"type": "dflash"})
    d2 = Drafter.from_config({"type": "dflash", "checkpoint": str(tmp_path / "ck"), "proposal": "ddtree",
                              "budget": 6}, target=tiny_llama)
    l1, l2 = _block_logits(d, tiny_llama), _block_logits(d2, tiny_llama)
    assert l1.shape == (5, vocab.numel()) and torch.equal(l1, l2)
    ref = _hf_greedy(tiny_llama, PROMPT, 24)
    assert SpeculativeDecoder(tiny_llama, d2).generate(PROMPT, max_new_tokens=24).tokens == ref
    assert set(d2.last_block_logprobs[0].flatten().tolist()) <= set(vocab.tolist())


def test_continuing_with_a_draft_vocab_adds_ids_and_keeps_the_checkpoints(tmp_path, tiny_llama):
    from graft_block.drafters.dflash.training import training_model

    vocab = torch.tensor([1, 4, 9, 16, 25])
    D.save_checkpoint(D.new_model(tiny_llama, 1, 6, [1], 127, draft_vocab=vocab), tmp_path / "ck",
                      dtype=torch.float32, extra={"type": "dflash"})
    cfg = {"draft_vocab": [2, 4, 100]}
    grown = training_model(tiny_llama, cfg, str(tmp_path / "ck"))
    assert grown.draft_vocab.tolist() == [1, 2, 4, 9, 16, 25, 100]  # the LM head is the target's: no new weights
    assert training_model(tiny_llama, cfg, None).draft_vocab.tolist() == grown.draft_vocab.tolist()  # a resume
    assert training_model(tiny_llama, {}, str(tmp_path / "ck")).draft_vocab.tolist() == vocab.tolist()


def _zlab_folder(path, target, layer_ids=(0, 2), n_layers=2, block_in_dflash_config=False, hidden=None,
                 rope_theta=1000000.0, attention_bias=False, extra=None):
    """A checkpoint written by hand in exactly z-lab's format (Qwen3-like tiny shapes, bf16, no embeddings/head).
    ``rope_theta=None`` leaves the key out; ``attention_bias`` adds q/k/v/o_proj biases as the reference has them."""
    from safetensors.torch import save_file

    H = hidden or target.hidden_size
    heads, kv, hd, inter = 4, 2, 16, 96
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": attention_bias,
           "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": H, "intermediate_size": inter,
           "num_hidden_layers": n_layers, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
           "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 4096,
           "layer_types": ["full_attention"] * n_layers, "sliding_window": None, "tie_word_embeddings": False,
           "dtype": "bfloat16", "vocab_size": target.vocab_size, "num_target_layers": target.num_layers,
           "dflash_config": {"mask_token_id": 120, "target_layer_ids": list(layer_ids)}}
    if block_in_dflash_config:
        cfg["dflash_config"]["block_size"] = 16
    else:
        cfg["block_size"] = 16
    if rope_theta is None:
        del cfg["rope_theta"]
    else:
        cfg["rope_theta"] = rope_theta
    cfg.update(extra or {})
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    t = {"fc.weight": w(H, len(layer_ids) * H), "hidden_norm.weight": torch.ones(H, dtype=torch.bfloat16),
         "norm.weight": torch.ones(H, dtype=torch.bfloat16)}
    for i in range(n_layers):
        p = f"layers.{i}."
        t.update({p + "self_attn.q_proj.weight": w(heads * hd, H), p + "self_attn.k_proj.weight": w(kv * hd, H),
                  p + "self_attn.v_proj.weight": w(kv * hd, H), p + "self_attn.o_proj.weight": w(H, heads * hd),
                  p + "self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
                  p + "self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
                  p + "mlp.gate_proj.weight": w(inter, H), p + "mlp.up_proj.weight": w(inter, H),
                  p + "mlp.down_proj.weight": w(H, inter),
                  p + "input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
                  p + "post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16)})
        if attention_bias:
            t.update({p + "self_attn.q_proj.bias": w(heads * hd), p + "self_attn.k_proj.bias": w(kv * hd),
                      p + "self_attn.v_proj.bias": w(kv * hd), p + "self_attn.o_proj.bias": w(H)})
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("inner", [False, True])
def test_zlab_format_loads_and_is_lossless(tmp_path, tiny_qwen3, inner):
    folder = _zlab_folder(tmp_path / "z", tiny_qwen3, block_in_dflash_config=inner)
    d = Drafter.from_config({"type": "dflash", "checkpoint": str(folder), "proposal": "ddtree", "budget": 12},
                            target=tiny_qwen3)
    assert d.block_size == 16 and d.model.mask_token_id == 120 and d.feature_layers == (1, 3)
    assert d.model.config.num_attention_heads == 4 and d.model.fc.weight.dtype == tiny_qwen3.dtype
    ref = _hf_greedy(tiny_qwen3, PROMPT, 24)
    assert SpeculativeDecoder(tiny_qwen3, d).generate(PROMPT, max_new_tokens=24).tokens == ref


HUB_KEYS = {"auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "torch_dtype": "bfloat16",
            "transformers_version": "4.57.1", "use_cache": True, "initializer_range": 0.02, "bos_token_id": 151643,
            "eos_token_id": 151645, "use_sliding_window": False, "max_window_layers": 36}


def test_hub_folder_without_type_loads_like_the_explicit_type(tmp_path, tiny_qwen3):
    """An untouched z-lab folder (no "type", hub keys the loader does not use) is recognised as dflash and gives the
    same drafter as {"type": "dflash", "checkpoint": folder}."""
    folder = _zlab_folder(tmp_path / "hub", tiny_qwen3, extra=HUB_KEYS)
    assert "type" not in json.loads((folder / "config.json").read_text())
    d = Drafter.from_config(str(folder), target=tiny_qwen3)
    ref = Drafter.from_config({"type": "dflash", "checkpoint": str(folder)}, target=tiny_qwen3)
    assert type(d) is D.DFlashDrafter and d.block_size == ref.block_size == 16
    assert torch.equal(_block_logits(d, tiny_qwen3), _block_logits(ref, tiny_qwen3))


def test_claims_own_layout_only():
    """Bundled configs without their "type": dflash claims only DFlash, mfd only MFD, neither claims EAGLE3; z-lab's
    DFlash2 (extra weights, another model) is claimed by neither."""
    from graft_block.drafter import bundled_checkpoint

    from graft_block.drafters.dspark import DSparkDrafter

    for name, owner in (("dflash-smollm2", "dflash"), ("mfd-smollm2", "mfd"),
                        ("eagle3-smollm2", None), ("dspark-smollm2", "dspark")):
        folder = bundled_checkpoint(name)
        if folder is None:
            continue
        cfg = json.loads((folder / "config.json").read_text())
        cfg.pop("type")
        assert D.DFlashDrafter.claims(cfg) == (owner == "dflash"), name
        assert M.MFDDrafter.claims(cfg) == (owner == "mfd"), name
        assert DSparkDrafter.claims(cfg) == (owner == "dspark"), name
    dflash2 = {"architectures": ["DFlash2DraftModel"], "dflash_config": {"mask_token_id": 5}, "block_size": 16}
    assert not D.DFlashDrafter.claims(dflash2) and not M.MFDDrafter.claims(dflash2)
    bare = {"dflash_config": {"mask_token_id": 5, "target_layer_ids": [1]}, "block_size": 16}  # no architectures
    assert D.DFlashDrafter.claims(bare) and not M.MFDDrafter.claims(bare)


def test_absent_rope_theta_takes_the_reference_default(tmp_path, tiny_qwen3):
    """z-lab's reference builds its Qwen3Config from config.json, whose default rope_theta is 1e4 (not the Qwen3
    targets' 1e6): a config without the key must rotate exactly like an explicit 1e4."""
    folders = {theta: _zlab_folder(tmp_path / str(theta), tiny_qwen3, rope_theta=theta) for theta in
               (None, 10000.0, 1000000.0)}
    logits = {}
    for theta, folder in folders.items():
        d = Drafter.from_config({"type": "dflash", "checkpoint": str(folder)}, target=tiny_qwen3)
        logits[theta] = _block_logits(d, tiny_qwen3)
        if theta is None:
            assert d.model.config.rope_parameters["rope_theta"] == D.DEFAULT_ROPE_THETA == 10000.0
    assert torch.equal(logits[None], logits[10000.0]) and not torch.allclose(logits[None], logits[1000000.0])
    # and a saved model writes its theta, so the default never applies to our own checkpoints
    model = D.load_checkpoint(folders[None])
    assert D.config_dict(model)["rope_theta"] == 10000.0


def test_attention_bias_loads_on_all_four_projections(tmp_path, tiny_qwen3):
    """attention_bias: true (as in z-lab's reference) puts a bias on q/k/v/o_proj; the biases load, are used, survive
    a save/load round trip, and the drafter stays lossless. A checkpoint missing one fails naming it."""
    folder = _zlab_folder(tmp_path / "bias", tiny_qwen3, attention_bias=True)
    d = Drafter.from_config({"type": "dflash", "checkpoint": str(folder), "proposal": "ddtree", "budget": 12},
                            target=tiny_qwen3)
    from safetensors.torch import load_file, save_file

    t = load_file(str(folder / "model.safetensors"))
    sd = d.model.state_dict()
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        key = f"layers.1.self_attn.{name}.bias"
        assert torch.equal(sd[key], t[key].to(sd[key].dtype)), key
    with_bias = _block_logits(d, tiny_qwen3)
    with torch.no_grad():
        for layer in d.model.layers:
            layer.self_attn.o_proj.bias.zero_()
    # o_proj's bias takes part (a new drafter: one on the C layers drafts on the packs made when it was built)
    again = D.DFlashDrafter(tiny_qwen3, d.model, proposal="ddtree", budget=12)
    assert not torch.allclose(with_bias, _block_logits(again, tiny_qwen3))
    ref = hf_greedy(tiny_qwen3, PROMPT, 24)
    assert SpeculativeDecoder(tiny_qwen3, d).generate(PROMPT, max_new_tokens=24).tokens == ref
    D.save_checkpoint(d.model, tmp_path / "again", dtype=torch.float32, extra={"type": "dflash"})
    again = D.load_checkpoint(tmp_path / "again")
    assert again.config.attention_bias and again.layers[0].self_attn.o_proj.bias is not None
    del t["layers.0.self_attn.o_proj.bias"]
    save_file(t, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"missing tensors \['layers.0.self_attn.o_proj.bias'\].*attention_bias"):
        D.load_checkpoint(folder)


def test_rope_frequencies_stay_fp32_in_half_precision(tiny_qwen3):
    """model.to(bfloat16) must not round RoPE's inverse frequencies (the reference keeps them in fp32): cos/sin at
    large positions equal the fp32 ones rounded once."""
    model = D.new_model(tiny_qwen3, num_layers=1, block_size=4, target_layer_ids=[1])
    pos = torch.arange(3000, 3016).view(1, -1)
    cos32, sin32 = model.rope(pos, torch.zeros(1))
    model.to(torch.bfloat16)
    cos16, sin16 = model.rope(pos, torch.zeros(1, dtype=torch.bfloat16))
    assert torch.equal(cos16, cos32.to(torch.bfloat16)) and torch.equal(sin16, sin32.to(torch.bfloat16))


def test_bad_checkpoints_fail_clearly(tmp_path, tiny_qwen3):
    from safetensors.torch import load_file, save_file

    # missing tensor
    f = _zlab_folder(tmp_path / "missing", tiny_qwen3)
    t = load_file(str(f / "model.safetensors"))
    del t["layers.1.mlp.up_proj.weight"]
    save_file(t, str(f / "model.safetensors"))
    with pytest.raises(ConfigError, match="missing tensors.*layers.1.mlp.up_proj.weight"):
        D.load_checkpoint(f)
    # wrong layer ids: config lists 3 feature layers, fc was trained on 2
    f = _zlab_folder(tmp_path / "ids", tiny_qwen3)
    cfg = json.loads((f / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [0, 1, 2]
    (f / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="fc.weight.*target_layer_ids"):
        D.load_checkpoint(f)
    # layer ids outside the target
    f = _zlab_folder(tmp_path / "range", tiny_qwen3, layer_ids=(0, 9))
    with pytest.raises(ConfigError, match="target_layer_ids"):
        Drafter.from_config({"type": "dflash", "checkpoint": str(f)}, target=tiny_qwen3)
    # wrong hidden size for this target
    f = _zlab_folder(tmp_path / "wide", tiny_qwen3, hidden=96)
    with pytest.raises(ConfigError, match="hidden_size 96 != target hidden_size 64"):
        Drafter.from_config({"type": "dflash", "checkpoint": str(f)}, target=tiny_qwen3)
    # unexpected tensor
    f = _zlab_folder(tmp_path / "extra", tiny_qwen3)
    t = load_file(str(f / "model.safetensors"))
    t["embed_tokens.weight"] = torch.zeros(128, 64, dtype=torch.bfloat16)
    save_file(t, str(f / "model.safetensors"))
    with pytest.raises(ConfigError, match="unexpected tensors.*embed_tokens"):
        D.load_checkpoint(f)
    # truncated weights file (an interrupted download): named, with the fix, for DFlash and MFD loaders alike
    f = _zlab_folder(tmp_path / "cut", tiny_qwen3)
    data = (f / "model.safetensors").read_bytes()
    (f / "model.safetensors").write_bytes(data[: len(data) // 2])
    for load in (D.load_checkpoint, M.load_checkpoint):
        with pytest.raises(ConfigError, match="model.safetensors is corrupt or truncated.*re-download"):
            load(f)


def test_bad_configs_fail_clearly(tiny_llama):
    with pytest.raises(ConfigError, match="mask_token_id 500"):
        _drafter(tiny_llama, mask_token_id=500)
    with pytest.raises(ConfigError, match="proposal"):
        _drafter(tiny_llama, proposal="beam")
    with pytest.raises(ConfigError, match="ddtree"):
        _drafter(tiny_llama, proposal="chain", budget=30)
    with pytest.raises(ConfigError, match="unknown dflash config keys"):
        _drafter(tiny_llama, nonsense=1)
    with pytest.raises(ConfigError, match="needs the target"):
        Drafter.from_config({"type": "dflash"})


def test_marginal_topk_must_be_a_positive_int(tiny_llama):
    """0 and -2 were taken and then ignored (a tree keeps max(marginal_topk, budget)), 2.5 truncated to 2."""
    for bad in (0, -2, 2.5, "8", True):
        with pytest.raises(ConfigError, match="marginal_topk .*must be an int >= 1"):
            _drafter(tiny_llama, proposal="ddtree", budget=6, marginal_topk=bad)
    assert _drafter(tiny_llama, proposal="ddtree", budget=6, marginal_topk=1).marginal_topk == 1


def _head_new_model(target, num_layers, block_size, layer_ids, mask, seed):
    """HEAD's new_model before the fork (c9c0a51): reseed the global RNG, build on the CPU, redraw every matrix."""
    model = D.new_model(target, num_layers, block_size, layer_ids, mask, seed=seed + 1)  # only for its config
    torch.manual_seed(seed)
    ref = D.DFlashModel(model.config, block_size, layer_ids, mask, target.num_layers, None)
    for p in ref.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    return ref.to(device=target.device, dtype=target.dtype)


def test_random_init_keeps_the_callers_rng_and_draws_what_it_drew_before(tiny_qwen3):
    """new_model called torch.manual_seed(seed): it reseeded every caller's global RNG as a side effect. It draws
    in a fork now, and the same seed still gives the weights it gave (the bundled fresh-init recipes used 0)."""
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    got = D.new_model(tiny_qwen3, 2, 5, [0, 2], 100, seed=0)
    assert torch.equal(torch.get_rng_state(), before)
    for seed in (0, 3):
        ref = _head_new_model(tiny_qwen3, 2, 5, [0, 2], 100, seed).state_dict()
        got = D.new_model(tiny_qwen3, 2, 5, [0, 2], 100, seed=seed).state_dict()
        assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref), seed
    torch.set_rng_state(before)  # the reference reseeded it
    d = _drafter(tiny_qwen3)  # the random-init drafter config goes through it too
    assert torch.equal(torch.get_rng_state(), before) and d.model.config.num_hidden_layers == 2


@pytest.mark.parametrize("bad", [{"num_layers": 0}, {"num_layers": -1}, {"num_features": 0}, {"num_layers": 1.5},
                                 {"seed": 0.5}])
def test_random_init_refuses_an_empty_or_fractional_shape(tiny_llama, bad):
    """num_layers 0 built a drafter of no layers; num_features 0 failed as 'target_layer_ids is empty'."""
    key = next(iter(bad))
    with pytest.raises(ConfigError, match=f"{key} must be an int"):
        D.new_model(tiny_llama, **bad)
    cfg = {"type": "dflash", "block_size": 8, **bad}
    with pytest.raises(ConfigError, match=f"{key} must be an int"):
        Drafter.from_config(cfg, target=tiny_llama)


def test_a_string_block_size_in_config_json_is_refused_in_both_spellings_of_the_folder(tmp_path, tiny_qwen3):
    """block_size "4" loaded through {"type": "dflash", "checkpoint": folder} (int("4")) but was refused by
    from_config(folder), where config.json's block_size is also the drafter option: both refuse it now."""
    D.save_checkpoint(D.new_model(tiny_qwen3, 1, 4, [1], 100), tmp_path / "ck", dtype=torch.float32,
                      extra={"type": "dflash"})
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    for key, value in (("block_size", "4"), ("block_size", 4.0), ("num_hidden_layers", "1")):
        (tmp_path / "ck" / "config.json").write_text(json.dumps({**cfg, key: value}))
        for form in ({"type": "dflash", "checkpoint": str(tmp_path / "ck")}, str(tmp_path / "ck")):
            with pytest.raises(ConfigError, match=f"ck/config.json: {key} must be an integer.*got {value!r}"):
                Drafter.from_config(form, target=tiny_qwen3)
    cfg["dflash_config"]["target_layer_ids"] = ["1"]
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="target_layer_ids must be an integer.*without quotes"):
        Drafter.from_config(str(tmp_path / "ck"), target=tiny_qwen3)


def test_config_values_transformers_or_rope_would_refuse_are_named(tmp_path, tiny_qwen3):
    # a negative or text RoPE base gave NaN rotations or a bare ValueError; transformers' own checks (layer_types
    # against num_hidden_layers, a text eps) raised its dataclass errors, which name no file
    for i, (key, value, words) in enumerate((("rope_theta", -1, "rope_theta must be a number > 0.*got -1"),
                                             ("rope_theta", "1e6", "rope_theta must be a number > 0.*'1e6'"),
                                             ("layer_types", ["full_attention"], "transformers refuses.*layer_types"),
                                             ("rms_norm_eps", "x", "transformers refuses it.*rms_norm_eps"))):
        folder = _zlab_folder(tmp_path / str(i), tiny_qwen3, extra={key: value})
        with pytest.raises(ConfigError, match=f"{i}/config.json: {words}"):
            Drafter.from_config(str(folder), target=tiny_qwen3)


def test_denoise_steps_lossless(tiny_qwen3):
    pytest.importorskip("diffusers")
    ref = _hf_greedy(tiny_qwen3, PROMPT, 24)
    d = _drafter(tiny_qwen3, proposal="chain", budget=7, denoise_steps=3)
    assert SpeculativeDecoder(tiny_qwen3, d).generate(PROMPT, max_new_tokens=24).tokens == ref


def test_denoise_steps_refuses_a_bool(tiny_qwen3):
    """``denoise_steps: true`` passed the int check (bool is an int) and ran as one pass, silently."""
    for bad in (True, False, 0, 1.5):
        with pytest.raises(ConfigError, match=f"denoise_steps must be an int >= 1.*got {bad!r}"):
            _drafter(tiny_qwen3, denoise_steps=bad)


# ---- the trained default on SmolLM2 -----------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_default_lossless(smollm2):
    """The bundled checkpoint on the real target: chain and DDTree outputs equal HF greedy token for token, with
    drafts accepted (every DDTree generation; the chain on the code prompt). One HF reference per prompt serves both
    proposals: a code prompt (long accepted runs) and one that stops on EOS inside a block. The T=1 law is checked on
    a tiny target (``test_sampling_matches_target_distribution``): the real one adds nothing to that check but
    minutes."""
    from graft_block.drafter import bundled_checkpoint

    folder = bundled_checkpoint("dflash-smollm2")
    if folder is None:
        pytest.skip("drafters/checkpoints/dflash-smollm2 is not present")
    prompts = [smollm2.encode([{"role": "user", "content": c}]).tolist() for c in
               ("Write a Python function that returns the n-th Fibonacci number.",
                "What is the capital of France? Answer in one sentence.")]
    n = 40
    refs = [hf_greedy(smollm2, p, n) for p in prompts]
    assert refs[1][-1] in smollm2.eos_token_ids and len(refs[1]) < n  # the second prompt really stops on EOS
    for proposal, budget in (("chain", 15), ("ddtree", 16)):
        d = Drafter.from_config({"type": "dflash", "checkpoint": str(folder), "proposal": proposal, "budget": budget},
                                target=smollm2)
        dec = SpeculativeDecoder(smollm2, d)
        taus = []
        for p, ref in zip(prompts, refs):
            res = dec.generate(p, max_new_tokens=n)
            assert res.tokens == ref, proposal
            taus.append(res.stats.tau)
        # drafts really were accepted (so accepted paths were compacted) in every DDTree generation; a 15-token
        # chain may miss the whole 8-token EOS answer, so the chain must accept on the code prompt
        assert all(t > 1.0 for t in (taus if proposal == "ddtree" else taus[:1])), (proposal, taus)


def test_drafters_on_one_target_share_the_gathered_head_rows(tiny_llama):
    """Two drafters on the same target and draft vocabulary hold one gathered copy of the LM head's rows and one
    set of its kernel layouts (each method of a run kept its own before); another vocabulary gets its own."""
    from graft_block.drafters.dflash.drafter import head_rows

    vocab = torch.tensor([3, 1, 4, 15, 9, 2, 6])
    w1, b1, lay1 = head_rows(tiny_llama, vocab)
    w2, _, lay2 = head_rows(tiny_llama, vocab.clone())
    assert w1 is w2 and lay1 is lay2
    assert torch.equal(w1, tiny_llama.model.get_output_embeddings().weight[vocab])
    w3, _, lay3 = head_rows(tiny_llama, vocab[:4])
    assert w3.shape[0] == 4 and lay3 is not lay1
    full, _, _ = head_rows(tiny_llama, None)
    assert full is tiny_llama.model.get_output_embeddings().weight  # no draft vocabulary: the head itself


def test_a_target_that_opts_in_shares_loaded_checkpoints(tiny_llama, tmp_path):
    """With ``share_drafter_checkpoints`` (the benchmark sets it) two drafters built from one folder hold one
    model; without it (training starts from a checkpoint and changes it in place) each loads its own."""
    from graft_block import Drafter
    from graft_block.drafters.dflash import save_checkpoint

    first = Drafter.from_config({"type": "dflash", "num_layers": 1, "target_layer_ids": [0, 1], "block_size": 4,
                                 "seed": 0}, target=tiny_llama)
    save_checkpoint(first.model, tmp_path)
    cfg = {"type": "dflash", "checkpoint": str(tmp_path)}
    try:
        apart = [Drafter.from_config({**cfg, "proposal": p, "budget": 3}, target=tiny_llama)
                 for p in ("chain", "ddtree")]
        assert apart[0].model is not apart[1].model
        tiny_llama.share_drafter_checkpoints = True
        shared = [Drafter.from_config({**cfg, "proposal": p, "budget": 3}, target=tiny_llama)
                  for p in ("chain", "ddtree")]
        assert shared[0].model is shared[1].model and shared[0].proposal != shared[1].proposal
    finally:
        tiny_llama.share_drafter_checkpoints = False
        tiny_llama.__dict__.pop("_shared_checkpoints", None)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0},
                                     {"rope_type": "dynamic", "factor": 2.0}])
def test_rope_lookup_agrees_with_hfs_computation(scaling):
    """The CPU cos/sin table gives HF's angles at any positions (it grows past its first 1,024); rope types whose
    angles depend on the sequence length are computed per call, never looked up."""
    from transformers import LlamaConfig

    from graft_block.drafters.layers import Rotary

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, rope_theta=10000.0, rope_scaling=scaling,
                      max_position_embeddings=512)
    rot = Rotary(cfg)
    cases = (torch.tensor([[0, 5, 5, 1023]]), torch.arange(4000, 4010).view(1, -1), torch.tensor([[7], [3000]]),
             torch.tensor([[-3, 2]]), torch.tensor([[9, 11]], dtype=torch.int32))
    for pos in cases:  # (negative positions are computed by HF, not looked up)
        for like in (torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16)):
            cos, sin = rot(like, pos)
            ref_cos, ref_sin = rot.emb(like, pos)
            assert cos.shape == ref_cos.shape == (pos.shape[0], pos.shape[1], 32) and cos.dtype == like.dtype
            # the same angles; the vector cos/sin may round the last bit differently at another tensor offset
            tol = 1e-6 if like.dtype == torch.float32 else 1e-2
            assert torch.allclose(cos.float(), ref_cos.float(), atol=tol)
            assert torch.allclose(sin.float(), ref_sin.float(), atol=tol)
    # rows(first, count, step): consecutive positions (step 1) or one position repeated (step 0, a tree level)
    for first, count, step in ((0, 3, 1), (1021, 6, 1), (5000, 4, 0), (12, 1, 0), (-2, 3, 1)):
        cos, sin = rot.rows(first, count, step)
        ref_cos, ref_sin = rot.emb(torch.zeros(1), first + step * torch.arange(count).view(1, -1))
        assert cos.shape == (count, 32) and cos.dtype == torch.float32
        assert torch.allclose(cos, ref_cos[0], atol=1e-6) and torch.allclose(sin, ref_sin[0], atol=1e-6)
    assert (rot.table is None) == (scaling is not None and scaling["rope_type"] == "dynamic")


@pytest.mark.parametrize("hidden,rows", [(64, 1), (576, 4), (1728, 37)])
def test_rms_norm_fused_path_keeps_the_reference_bits(hidden, rows):
    """fp32 takes torch's fused rms_norm: the same bits as the reference op order (normalise in fp32, then scale);
    other dtypes keep that order explicitly."""
    from graft_block.drafters.layers import RMSNorm

    torch.manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-6)
    norm.weight.data = torch.randn(hidden)
    x = torch.randn(rows, hidden) * torch.rand(rows, 1) * 10
    ref = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))
    assert torch.equal(norm(x), ref)
    half = norm.to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    ref_b = half.weight * (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(xb.dtype)
    assert half(xb).dtype == torch.bfloat16 and torch.equal(half(xb), ref_b)


def test_block_checkpoints_resolve_bundled_names(tiny_llama):
    """A dict config may name a bundled checkpoint by its short name (as EAGLE-3's already could); an unknown name
    says which ones exist."""
    from graft_block.drafter import bundled_checkpoints

    assert "dflash-smollm2" in bundled_checkpoints()
    assert D.read_config("dflash-smollm2")["block_size"] == 16
    for kind in ("dflash", "mfd", "dspark"):
        with pytest.raises(ConfigError, match="neither a folder with config.json nor a bundled name.*dflash-smollm2"):
            Drafter.from_config({"type": kind, "checkpoint": "no-such-drafter"}, target=tiny_llama)


def test_delta_folder_loads_its_frozen_base_and_refuses_a_changed_one(tmp_path):
    """write_delta keeps only the tensors training changed and pins the base by its sha256; read_weights gives
    back every tensor bit for bit, and a base whose weights changed is refused, not mixed in."""
    from safetensors.torch import save_file

    from graft_block.drafter import read_weights, write_delta

    g = torch.Generator().manual_seed(0)
    base = {"a": torch.randn(4, 3, generator=g).half(), "b": torch.randn(5, generator=g).half()}
    heads = {**base, "b": base["b"] + 1, "c": torch.randn(2, 2, generator=g).half()}
    for name, tensors in (("base", base), ("heads", heads)):
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
        (tmp_path / name / "config.json").write_text(json.dumps({"name": name}))
    assert write_delta(tmp_path / "heads", "base") == {"kept": ["b", "c"], "dropped": 1}
    got = read_weights(tmp_path / "heads")
    assert set(got) == set(heads) and all(torch.equal(got[k], heads[k]) for k in heads)
    save_file({**base, "a": base["a"] * 2}, str(tmp_path / "base" / "model.safetensors"))
    with pytest.raises(ConfigError, match="changed since"):
        read_weights(tmp_path / "heads")


def test_repin_delta_moves_heads_onto_a_retrained_base_and_refuses_to_mix_backbones(tmp_path):
    """repin_delta pins a heads-only delta to its base's new weights (then it loads: the new base under the same
    heads); a delta that also holds a base tensor is refused, and so is a whole folder."""
    from safetensors.torch import save_file

    from graft_block.drafter import read_weights, repin_delta, weights_digest, write_delta

    g = torch.Generator().manual_seed(1)
    base = {"a": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g)}
    for name, tensors in (("base", base), ("heads", {**base, "c": torch.ones(2)}),
                          ("tuned", {**base, "b": base["b"] * 3, "c": torch.ones(2)})):
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
        (tmp_path / name / "config.json").write_text(json.dumps({"name": name}))
    write_delta(tmp_path / "heads", "base")
    write_delta(tmp_path / "tuned", "base")
    new_base = {"a": base["a"] + 1, "b": base["b"]}
    save_file(new_base, str(tmp_path / "base" / "model.safetensors"))
    with pytest.raises(ConfigError, match="changed since"):
        read_weights(tmp_path / "heads")
    assert repin_delta(tmp_path / "heads") == weights_digest(tmp_path / "base")
    got = read_weights(tmp_path / "heads")
    assert torch.equal(got["a"], new_base["a"]) and torch.equal(got["c"], torch.ones(2))
    with pytest.raises(ConfigError, match=r"holds 1 tensor\(s\) its base .* also has \(b\)"):
        repin_delta(tmp_path / "tuned")
    with pytest.raises(ConfigError, match="whole checkpoint"):
        repin_delta(tmp_path / "base")
    (tmp_path / "heads" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ConfigError, match="corrupt or truncated"):
        repin_delta(tmp_path / "heads")


def test_fill_rate_gives_some_rows_their_true_tokens_and_takes_them_out_of_the_loss():
    """Refinement training (``fill_rate``): a filled row's block input is its label and it is no longer a loss row;
    the other rows stay masked; held-out evaluation (eval mode) fills nothing; a rate outside [0, 1] is refused."""
    from graft_block.drafters.dflash import training as DT

    torch.manual_seed(0)
    target = tiny_target("llama", vocab_size=64, num_layers=4)
    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "num_anchors": 6, "mask_token_id": 63, "block_size": 6,
           "fill_rate": 1.0}
    model = DT.training_model(target, cfg, "random")
    ids = torch.randint(0, 60, (2, 40))
    batch = {"ids": ids, "lengths": torch.tensor([40, 40]), "prompt_len": torch.tensor([4, 4]),
             "feats": torch.randn(2, 40, 2 * target.hidden_size), "generator": torch.Generator().manual_seed(1)}
    model.train()
    blk = DT.make_blocks(model, batch)
    rows = blk["blk_ids"][:, :, 1:]
    in_seq = blk["anchor_ok"].unsqueeze(-1) & (blk["anchors"].unsqueeze(-1) + torch.arange(1, 6) < 40)
    filled = (rows != 63) & in_seq
    assert filled.any() and (~filled & in_seq).any()  # U(0, 1) shares: some rows filled, some not
    assert torch.equal(rows[filled], blk["labels"][filled])  # filled with the true token
    assert not (blk["valid"] & filled).any() and torch.equal(blk["valid"], in_seq & ~filled)
    model.eval()
    plain = DT.make_blocks(model, batch)
    assert bool((plain["blk_ids"][:, :, 1:] == 63).all())
    for bad in (1.5, -0.1, "half"):
        with pytest.raises(ConfigError, match="fill_rate must be a number in"):
            DT.training_model(target, {**cfg, "fill_rate": bad}, "random")


DFLASH_KEYS = {"mask_token_id": 120, "target_layer_ids": [0, 2]}


@pytest.mark.parametrize("extra,word", [
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}, "sliding"),
    ({"layer_types": None, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, "sliding"),
    ({"is_causal": True}, "is_causal"),
    ({"dflash_config": {**DFLASH_KEYS, "input_embedding_scale": 8.0}}, "input_embedding_scale"),
    ({"dflash_config": {**DFLASH_KEYS, "output_multiplier": 0.5}}, "output_multiplier"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
])
def test_reference_attention_and_scale_settings_we_do_not_implement_are_refused(tmp_path, tiny_qwen3, extra, word):
    """z-lab's reference honours sliding-window (causal) layers, ``is_causal``, ``input_embedding_scale``,
    ``output_multiplier`` and ``final_logit_softcapping``; this forward is full, non-causal and unscaled, so such a
    folder must fail naming the setting rather than load and draft other logits. ``layer_types: None``: the key
    is absent and Qwen3Config derives the types from use_sliding_window / max_window_layers, as the reference does."""
    folder = _zlab_folder(tmp_path / "z", tiny_qwen3, extra=extra)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    with pytest.raises(ConfigError, match=word):
        Drafter.from_config(str(folder), target=tiny_qwen3)


def test_neutral_reference_settings_still_load(tmp_path, tiny_qwen3):
    """The same keys at their neutral values (z-lab's own configs carry them) load unchanged."""
    plain = Drafter.from_config(str(_zlab_folder(tmp_path / "a", tiny_qwen3)), target=tiny_qwen3)
    neutral = {"sliding_window": None, "use_sliding_window": False, "is_causal": False,
               "final_logit_softcapping": None,
               "dflash_config": {**DFLASH_KEYS, "input_embedding_scale": 1.0, "output_multiplier": 1}}
    d = Drafter.from_config(str(_zlab_folder(tmp_path / "b", tiny_qwen3, extra=neutral)), target=tiny_qwen3)
    assert torch.equal(_block_logits(d, tiny_qwen3), _block_logits(plain, tiny_qwen3))


def test_chain_scores_are_the_cumulative_log_probs_of_its_drafts(tiny_qwen3):
    """A chain's nodes are rows 1.. top-1 drafts in order, and their scores the running sum of those rows' top-1
    log-probs (a path's log-probability), not each row's own."""
    d = _drafter(tiny_qwen3, proposal="chain", budget=5)
    st = prefilled_state(tiny_qwen3, PROMPT, d)
    with torch.no_grad():
        tree = d.propose(st)
    ids, lps = d.last_block_logprobs
    assert tree.tokens[1:].tolist() == ids[:5, 0].tolist()
    assert torch.allclose(tree.scores[1:], torch.cumsum(lps[:5, 0].double(), 0).float(), atol=1e-5)
    assert bool((tree.scores[1:] <= 0).all()) and bool((tree.scores[2:] <= tree.scores[1:-1] + 1e-6).all())


def test_ddtree_proposal_is_the_ddtree_of_the_rows_log_probs(tiny_qwen3):
    """The DDTree ranks prefixes by summed log-probs (each row normalised), not raw logits: the proposal is the
    ddtree of the kept top-k log-probs, node scores included."""
    from graft_block.tree.ddtree import ddtree

    budget = 6
    d = _drafter(tiny_qwen3, proposal="ddtree", budget=budget)
    st = prefilled_state(tiny_qwen3, PROMPT, d)
    with torch.no_grad():
        tree = d.propose(st)
        logits = d.block_logits(st, rows=budget)
    ids, lps = d.last_block_logprobs
    want = torch.log_softmax(logits.double(), -1).topk(lps.shape[1], -1).values
    assert torch.allclose(lps.double(), want, atol=1e-4)
    ref = ddtree(st.root_token, ids[:, :budget], lps[:, :budget], budget)
    assert torch.equal(tree.tokens, ref.tokens) and torch.equal(tree.parents, ref.parents)
    assert torch.allclose(tree.scores, ref.scores, atol=1e-5)


def test_a_loaded_checkpoint_saves_back_its_rope_theta_and_norm_eps(tmp_path, tiny_qwen3):
    """Load a z-lab folder with a non-default theta (1e6) and eps (1e-5), save it, reload: the config keeps both
    and the reloaded drafter's logits equal the original's."""
    folder = _zlab_folder(tmp_path / "z", tiny_qwen3, extra={"rms_norm_eps": 1e-5})
    model = D.load_checkpoint(folder)
    assert model.config.rms_norm_eps == 1e-5
    D.save_checkpoint(model, tmp_path / "ck", dtype=torch.float32, extra={"type": "dflash"})
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["rope_theta"] == 1000000.0 and cfg["rms_norm_eps"] == 1e-5
    again = D.load_checkpoint(tmp_path / "ck")
    assert again.config.rope_parameters["rope_theta"] == 1000000.0 and again.config.rms_norm_eps == 1e-5
    d1 = Drafter.from_config({"type": "dflash", "checkpoint": str(folder)}, target=tiny_qwen3)
    d2 = Drafter.from_config({"type": "dflash", "checkpoint": str(tmp_path / "ck")}, target=tiny_qwen3)
    assert torch.allclose(_block_logits(d1, tiny_qwen3), _block_logits(d2, tiny_qwen3), atol=1e-4)
