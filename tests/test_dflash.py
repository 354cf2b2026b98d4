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
from graft_block.testing import prefilled_state, tiny_target

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
    # the draft cache holds exactly the committed context (block K/V are never kept)
    assert d.ctx_len == len(PROMPT) + len(res.tokens) - 1
    assert d.last_block_logprobs[0].shape[0] == 7


def test_greedy_identity_planted_drafter_accepts():
    """A drafter whose block hidden states are forced to the target's own answer must be accepted in full: this
    checks same-position alignment (row k predicts start+k) through the whole engine."""
    target = tiny_target("llama")
    ref = _hf_greedy(target, PROMPT, 32)
    d = _drafter(target, proposal="chain", budget=7)
    full = PROMPT + ref
    W = target.model.get_output_embeddings().weight

    def cheat(state):  # logits = one-hot of the true continuation at rows 1..B-1
        start = state.cache_len
        nxt = full[start + 1: start + d.block_size]
        nxt = nxt + [0] * (d.block_size - 1 - len(nxt))
        return torch.nn.functional.one_hot(torch.tensor(nxt), W.shape[0]).float() * 50

    d.block_logits = cheat
    res = SpeculativeDecoder(target, d).generate(PROMPT, max_new_tokens=32)
    assert res.tokens == ref
    assert res.stats.tau > 6.0


def test_sampling_matches_target_distribution():
    """T=1 on a 4-token vocabulary: the joint law of the first 2 new tokens under DFlash+DDTree equals the
    target's exact law (chi-square p > 1e-3 and TV < 0.12 with 500 samples; sampling noise gives TV ~0.05)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    V = 4
    target = tiny_target("llama", vocab_size=V, hidden_size=32, num_layers=2)
    d = _drafter(target, proposal="ddtree", budget=4, block_size=3, mask_token_id=V - 1, target_layer_ids=[0, 1])
    dec = SpeculativeDecoder(target, d)
    prompt = [1, 3, 2]
    with torch.no_grad():  # exact law of (t1, t2)
        p1 = torch.softmax(target.model(input_ids=torch.tensor([prompt])).logits[0, -1].double(), -1)
        exact = torch.zeros(V, V, dtype=torch.float64)
        for a in range(V):
            p2 = torch.softmax(target.model(input_ids=torch.tensor([prompt + [a]])).logits[0, -1].double(), -1)
            exact[a] = p1[a] * p2
    n = 500
    gen = torch.Generator().manual_seed(123)
    obs = torch.zeros(V, V, dtype=torch.float64)
    accepted = 0
    for _ in range(n):
        r = dec.generate(prompt, max_new_tokens=2, temperature=1.0, generator=gen)
        obs[r.tokens[0], r.tokens[1]] += 1
        accepted += r.stats.committed_in_rounds - r.stats.rounds
    tv = 0.5 * (obs / n - exact).abs().sum().item()
    e, o = exact.flatten() * n, obs.flatten()
    keep = e >= 5  # chi-square needs expected counts >= 5: pool the rest into one cell
    o = torch.cat([o[keep], o[~keep].sum().view(1)])
    e = torch.cat([e[keep], e[~keep].sum().view(1)])
    if e[-1] < 5:
        o, e = o[:-1], e[:-1] * (o[:-1].sum() / e[:-1].sum())
    p = scipy_stats.chisquare(o.numpy(), e.numpy()).pvalue
    assert tv < 0.12 and p > 1e-3, (tv, p)
    assert accepted > 20  # drafted nodes really were accepted, so the tree path is exercised


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


def _zlab_folder(path, target, layer_ids=(0, 2), n_layers=2, block_in_dflash_config=False, hidden=None):
    """A checkpoint written by hand in exactly z-lab's format (Qwen3-like tiny shapes, bf16, no embeddings/head)."""
    from safetensors.torch import save_file

    H = hidden or target.hidden_size
    heads, kv, hd, inter = 4, 2, 16, 96
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False,
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


def test_denoise_steps_lossless(tiny_qwen3):
    pytest.importorskip("diffusers")
    ref = _hf_greedy(tiny_qwen3, PROMPT, 24)
    d = _drafter(tiny_qwen3, proposal="chain", budget=7, denoise_steps=3)
    assert SpeculativeDecoder(tiny_qwen3, d).generate(PROMPT, max_new_tokens=24).tokens == ref


# ---- the trained default on SmolLM2 -----------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_default_lossless(smollm2):
    from graft_block.drafter import bundled_checkpoint

    if bundled_checkpoint("dflash-smollm2") is None:
        pytest.skip("drafters/checkpoints/dflash-smollm2 is not present")
    prompts = [[{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
               [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]]
    def hf_greedy(p):
        ids = smollm2.encode(p)
        out = smollm2.model.generate(ids.view(1, -1), max_new_tokens=64, do_sample=False)
        return out[0, ids.numel():].tolist()

    refs = [hf_greedy(p) for p in prompts]
    for proposal, budget in (("chain", 15), ("ddtree", 16)):
        d = Drafter.from_config({"type": "dflash", "checkpoint": str(bundled_checkpoint("dflash-smollm2")),
                                 "proposal": proposal, "budget": budget}, target=smollm2)
        dec = SpeculativeDecoder(smollm2, d)
        for p, ref in zip(prompts, refs):
            res = dec.generate(p, max_new_tokens=64)
            assert res.tokens == ref
            assert res.stats.tau > 1.0
