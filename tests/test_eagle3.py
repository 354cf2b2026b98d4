"""EAGLE-3 drafter: checkpoint IO, head/tree consistency, greedy identity, sampling exactness, TTT training."""
import json
import math
import os

import pytest
import torch

from graft_block.drafters.eagle3 import (
    Eagle3Config,
    Eagle3Drafter,
    Eagle3Head,
    build_draft_vocab,
    head_config_for,
    load_head,
    prefix_mask,
    save_head,
    soft_labels,
    ttt_forward,
    warm_start,
    widen_draft_vocab,
)
from graft_block.decoder import DecodeState, SpeculativeDecoder
from graft_block.sampling import SamplingConfig
from graft_block.drafter import Drafter
from graft_block.drafters.layers import use_kernel
from graft_block.errors import ConfigError
from graft_block.testing import prefilled_state, tiny_target
from graft_block.tree import validate
from graft_block.tree.eagle import rerank


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny models: thread wake-ups dominate on a shared 2-core box.
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def make_head(target, draft_vocab=64, seed=0, warm=True, with_embedding=False, **over):
    cfg = head_config_for(target, draft_vocab)
    for k, v in over.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg, with_embedding=with_embedding)
    counts = torch.rand(target.vocab_size, generator=torch.Generator().manual_seed(seed))
    d2t, t2d = build_draft_vocab(counts, draft_vocab)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    if warm:
        warm_start(head, target)
    return head


def prompts(n, length, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def hf_greedy(target, prompt, n):
    ids = torch.tensor([prompt])
    # explicit mask: the tiny targets' pad id is 0, so HF would otherwise mask prompt tokens equal to 0
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                min_new_tokens=n)
    return out[0, len(prompt):].tolist()


# ---- checkpoint IO -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout,with_emb", [("eagle", False), ("eagle", True), ("speculators", False)])
def test_layouts_roundtrip(tmp_path, tiny_llama, layout, with_emb):
    head = make_head(tiny_llama, with_embedding=with_emb, norm_before_residual=(layout == "speculators"))
    save_head(head, tmp_path, layout=layout, dtype=torch.float32)
    keys = json.loads((tmp_path / "config.json").read_text())
    assert ("transformer_layer_config" in keys) == (layout == "speculators")
    from safetensors.torch import load_file
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert any(n.startswith("layers.0." if layout == "speculators" else "midlayer.") for n in names)
    assert ("embed_tokens.weight" in names) == with_emb
    loaded = load_head(tmp_path, tiny_llama)
    assert loaded.cfg.norm_before_residual == (layout == "speculators")
    for k, v in head.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    assert (loaded.embed_tokens is None) == (not with_emb)


def test_speculators_layout_keeps_norm_before_fc_and_rope_scaling(tmp_path, tiny_llama):
    """A speculators-layout save loads back as the same head: the fc norm is a config flag (its weight would be
    'unexpected' without it) and a scaled RoPE must not come back unscaled."""
    head = make_head(tiny_llama, norm_before_fc=True, rope_scaling={"rope_type": "linear", "factor": 2.0})
    save_head(head, tmp_path, layout="speculators", dtype=torch.float32)
    loaded = load_head(tmp_path, tiny_llama)
    assert loaded.cfg == head.cfg
    for k, v in head.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    biased = make_head(tiny_llama, attention_bias=True)
    with pytest.raises(ConfigError, match="attention_bias.*speculators"):
        save_head(biased, tmp_path / "biased", layout="speculators")
    assert not (tmp_path / "biased").exists()


def test_model_prefixed_and_bin_layout(tmp_path, tiny_llama):
    head = make_head(tiny_llama)
    sd = {("model.layers.0." + k[len("midlayer."):]) if k.startswith("midlayer.") else k: v
          for k, v in head.state_dict().items()}
    torch.save(sd, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(head.cfg.to_eagle_dict()))
    loaded = load_head(tmp_path, tiny_llama)
    assert torch.equal(loaded.midlayer.self_attn.q_proj.weight, head.midlayer.self_attn.q_proj.weight)


def _write(tmp_path, head, mutate):
    from safetensors.torch import save_file
    sd = {k: v.clone().contiguous() for k, v in head.state_dict().items()}
    mutate(sd)
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(head.cfg.to_eagle_dict()))


@pytest.mark.parametrize("mutate,needle", [
    (lambda sd: sd.pop("midlayer.hidden_norm.weight"), "midlayer.hidden_norm.weight"),
    (lambda sd: sd.pop("d2t"), "d2t"),
    (lambda sd: sd.__setitem__("fc.weight", torch.zeros(64, 100)), "fc.weight"),
    (lambda sd: sd.__setitem__("lm_head.weight", torch.zeros(65, 64)), "lm_head.weight"),
    (lambda sd: sd.__setitem__("layers.1.mlp.up_proj.weight", torch.zeros(1)), "exactly one layer"),
    (lambda sd: sd.__setitem__("extra.weight", torch.zeros(1)), "extra.weight"),
    (lambda sd: sd.__setitem__("d2t", sd["d2t"] + 1000), "outside the target vocabulary"),
])
def test_bad_checkpoints_fail_clearly(tmp_path, tiny_llama, mutate, needle):
    _write(tmp_path, make_head(tiny_llama), mutate)
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_head(tmp_path, tiny_llama)


def test_mismatched_target_fails(tmp_path, tiny_llama):
    head = make_head(tiny_llama)
    save_head(head, tmp_path)
    wide = tiny_target("llama", hidden_size=96, heads=4, kv_heads=2)
    with pytest.raises(ConfigError, match="target hidden_size 96"):
        load_head(tmp_path, wide)
    other_vocab = tiny_target("llama", vocab_size=100)
    with pytest.raises(ConfigError, match="vocab_size 128 != target vocab_size 100"):
        load_head(tmp_path, other_vocab)


def test_from_config_and_layer_override(tmp_path, tiny_llama):
    head = make_head(tiny_llama)
    save_head(head, tmp_path, extra_config={"type": "eagle3", "drafter_defaults": {"budget": 9, "depth": 2}})
    dr = Drafter.from_config(str(tmp_path), target=tiny_llama)
    assert isinstance(dr, Eagle3Drafter) and dr.budget == 9 and dr.depth == 2
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "drafter_defaults": {"bugdet": 9}}))
    with pytest.raises(ConfigError, match="drafter_defaults keys \\['bugdet'\\] are not eagle3 options"):
        Drafter.from_config(str(tmp_path), target=tiny_llama)  # was a bare TypeError from __init__
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert dr.feature_layers == (2, 2, 1)  # inputs of layers 2, N//2, N-3 for N=4
    dr = Drafter.from_config({"type": "eagle3", "checkpoint": str(tmp_path), "budget": 5, "top_k": 3}, tiny_llama)
    assert dr.budget == 5 and dr.top_k == 3
    for layers in ("1,2,3", [1, "2", 3], [1, -2, 3]):  # "1,2,3" was a bare ValueError from int(",")
        with pytest.raises(ConfigError, match="feature_layers must be a list of 3 HF hidden_states indices"):
            Drafter.from_config({"type": "eagle3", "checkpoint": str(tmp_path), "feature_layers": layers}, tiny_llama)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}  # SpecForge ids = output of layer i
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert Drafter.from_config(str(tmp_path), target=tiny_llama).feature_layers == (1, 2, 4)
    head.cfg.aux_layer_ids = [0, 1, 3]  # the same layers in vLLM's speculators layout: capture ids 1, 2, 4
    spec = tmp_path / "speculators"
    save_head(head, spec, layout="speculators")
    assert json.loads((spec / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    assert Drafter.from_config({"type": "eagle3", "checkpoint": str(spec)}, tiny_llama).feature_layers == (1, 2, 4)
    with pytest.raises(ConfigError, match="unknown eagle3 config keys"):
        Drafter.from_config({"type": "eagle3", "checkpoint": str(tmp_path), "bogus": 1}, tiny_llama)
    with pytest.raises(ConfigError, match="needs the target"):
        Drafter.from_config({"type": "eagle3", "checkpoint": str(tmp_path)})


def test_speculators_config_parsing():
    cfg = Eagle3Config.from_dict({
        "speculators_model_type": "eagle3", "draft_vocab_size": 32, "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [1, 5, 9],
        "transformer_layer_config": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                     "num_key_value_heads": 2, "vocab_size": 128, "rope_theta": 5e5}})
    assert cfg.norm_before_residual and cfg.draft_vocab_size == 32 and cfg.target_hidden_size == 64
    # speculators (vLLM) capture ids name the input of a layer, HF hidden_states[i]: SpecForge's i - 1
    assert cfg.aux_layer_ids == [0, 4, 8] and cfg.rope_theta == 5e5 and cfg.head_dim == 16
    eagle = Eagle3Config.from_dict({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "vocab_size": 128, "draft_vocab_size": 32})
    assert eagle.rope_theta == 10000.0 and not eagle.norm_before_residual  # draft's RoPE, not the target's
    # transformers 5's rope_parameters carries the scaling too (and the theta, which stays its own field)
    scaled = Eagle3Config.from_dict({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                     "vocab_size": 128, "rope_parameters": {"rope_type": "llama3", "factor": 8.0,
                                                                            "rope_theta": 5e5}})
    assert scaled.rope_scaling == {"rope_type": "llama3", "factor": 8.0} and scaled.rope_theta == 5e5


# ---- untouched hub folders (no "type" key) -----------------------------------------------------------------
# Keys real hub config.json files carry next to the model shape; none of them is a drafter setting.
HUB_EXTRAS = {"torch_dtype": "float16", "transformers_version": "4.51.0", "use_cache": True, "initializer_range": 0.02,
              "attention_dropout": 0.0, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "top_k": 50}


def hub_folder(folder, head, layout):
    """Save ``head`` as an untouched hub checkpoint: EAGLE's template ("LlamaForCausalLM"), SpecForge
    ("LlamaForCausalLMEagle3") or vLLM speculators ("Eagle3Speculator", nested transformer_layer_config)."""
    save_head(head, folder, layout="speculators" if layout == "speculators" else "eagle", dtype=torch.float32)
    cfg = json.loads((folder / "config.json").read_text())
    if layout == "speculators":
        cfg.update({"speculators_version": "0.2.0", "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}}})
    else:
        cfg.update(HUB_EXTRAS)
        if layout == "eagle-template":
            cfg["architectures"] = ["LlamaForCausalLM"]
    assert "type" not in cfg and "drafter_defaults" not in cfg
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("layout", ["eagle-template", "specforge", "speculators"])
def test_hub_folder_without_type_loads_like_explicit(tmp_path, tiny_llama, layout):
    t = tiny_llama
    head = make_head(t, seed=5, norm_before_residual=(layout == "speculators"))
    folder = hub_folder(tmp_path, head, layout)
    assert Eagle3Drafter.claims(json.loads((folder / "config.json").read_text()))
    auto = Drafter.from_config(str(folder), target=t)
    explicit = Drafter.from_config({"type": "eagle3", "checkpoint": str(folder)}, target=t)
    assert isinstance(auto, Eagle3Drafter) and auto.describe() == explicit.describe()
    assert auto.top_k == 10  # the hub file's generation-style top_k is not a drafter setting
    prompt = prompts(1, 10, 128, seed=4)[0]
    trees = []
    for dr in (auto, explicit, Eagle3Drafter(t, head=head)):
        state = prefilled_state(t, prompt, dr)
        tree = dr.propose(state)
        trees.append((tree.tokens, tree.parents, dr.last_candidates.scores))
    for other in trees[1:]:
        assert all(torch.equal(a, b) for a, b in zip(trees[0], other))


def test_claims_only_eagle3_configs():
    from graft_block.drafter import bundled_checkpoint

    for name in ("dflash-smollm2", "mfd-smollm2"):
        folder = bundled_checkpoint(name)
        if folder is None:
            continue
        cfg = json.loads((folder / "config.json").read_text())
        cfg.pop("type")
        assert not Eagle3Drafter.claims(cfg), name
    zlab_dflash = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 4096,
                   "block_size": 16, "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17]}}
    assert not Eagle3Drafter.claims(zlab_dflash)
    assert not Eagle3Drafter.claims({"speculators_model_type": "eagle", "architectures": ["EagleSpeculator"]})
    assert not Eagle3Drafter.claims({"architectures": ["LlamaForCausalLM"], "hidden_size": 64})  # a plain model
    assert Eagle3Drafter.claims({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64})


def test_unrecognised_folder_fails_clearly(tmp_path, tiny_llama):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 64}))
    with pytest.raises(ConfigError, match=r"no 'type' key and no registered drafter recognises.*GPT2LMHeadModel"):
        Drafter.from_config(str(tmp_path), target=tiny_llama)


def test_bias_key_is_ignored_like_the_reference(tmp_path, tiny_llama):
    """EAGLE passes config "bias" (default true) to its head, where only the EAGLE-1/2 fc uses it; the EAGLE-3
    head (EAGLE and SpecForge) has no bias anywhere. Only "attention_bias" adds q/k/v biases."""
    base = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 128, "draft_vocab_size": 64}
    assert not Eagle3Config.from_dict({**base, "bias": True}).attention_bias
    assert Eagle3Config.from_dict({**base, "attention_bias": True}).attention_bias
    head = make_head(tiny_llama, seed=6)
    hub_folder(tmp_path, head, "specforge")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "bias": True}))  # weights have no bias tensors
    dr = Drafter.from_config(str(tmp_path), target=tiny_llama)
    assert dr.head.midlayer.self_attn.q_proj.bias is None and dr.head.fc.bias is None
    x = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(3).view(1, 3)
    use_kernel(dr.head, None)  # both on F.linear: the drafter's kernel (this machine's choice) is not the question
    with torch.no_grad():
        assert torch.equal(dr.head.logits(dr.head(x, x, pos)[0]), head.eval().logits(head(x, x, pos)[0]))


# ---- head / tree consistency -------------------------------------------------------------------------------
def test_tree_expansion_equals_sequential_drafting(tiny_llama):
    """Every candidate's score must equal the draft run sequentially along its path (tree mask + positions)."""
    t = tiny_llama
    head = make_head(t, seed=3).eval()
    dr = Eagle3Drafter(t, head=head, budget=30, depth=3, top_k=3)
    t.set_feature_layers(dr.feature_layers)
    state_tokens = prompts(1, 10, 128, seed=9)[0]
    logits, feats = t.prefill(torch.tensor(state_tokens))
    root = int(logits.argmax())
    toks = state_tokens + [root]
    s = DecodeState(t, SamplingConfig(), None, list(toks), len(state_tokens), feats, 0)
    dr.prefill(s)
    tree = dr.propose(s)
    validate(tree, budget=30, root_token=root)
    cands = dr.last_candidates
    n = len(state_tokens)
    with torch.inference_mode():
        g = head.fuse(feats.view(1, n, -1))
        emb = t.embed(torch.tensor(toks[1:])).view(1, n, -1)
        out, k0, v0 = head(emb, g, torch.arange(n).view(1, n))
        paths = {}
        for i in range(cands.size):
            p = int(cands.parents[i])
            paths[i] = (paths[p] if p >= 0 else ()) + (int(cands.tokens[i]),)
        inv = {int(tid): d for d, tid in enumerate((torch.arange(64) + head.d2t).tolist())}
        for i in list(range(cands.size))[::7]:
            path = paths[i]
            K, V, o = k0, v0, out[0, -1]
            score = 0.0
            for j, tok in enumerate(path):
                lp = torch.log_softmax(head.logits(o).float(), -1)
                score += float(lp[inv[tok]])
                if j == len(path) - 1:
                    break
                m = prefix_mask(1, K.shape[2], g.dtype, g.device)
                o2, k, v = head(t.embed(torch.tensor([tok])).view(1, 1, -1), o.view(1, 1, -1),
                                torch.tensor([[n + j]]), K, V, m)
                K, V, o = torch.cat([K, k], 2), torch.cat([V, v], 2), o2[0, 0]
            assert math.isclose(score, float(cands.scores[i]), rel_tol=1e-4, abs_tol=1e-4), (i, path)


def count_forwards(head) -> list:
    """Record the row count of every head forward from now on (the list fills as the head runs)."""
    calls = []
    orig = head.forward
    head.forward = lambda *a, **k: (calls.append(a[0].shape[1]), orig(*a, **k))[1]
    return calls


def test_one_head_forward_per_level(tiny_llama):
    t = tiny_llama
    head = make_head(t)
    # a budget above the 84-node pool: no frontier is ever out of the top budget, so every level is drafted
    dr = Eagle3Drafter(t, head=head, budget=100, depth=5, top_k=4)
    dr.c_layer = None  # the torch layer, whose forwards are counted (the kernel choice may put the target in C)
    calls = count_forwards(head)
    res = SpeculativeDecoder(t, dr).generate(prompts(1, 10, 128)[0], max_new_tokens=6)
    # per round: one pass over the newly accepted pairs, then one pass per level over the whole frontier (4 nodes)
    per_round = [calls[i: i + 6] for i in range(0, len(calls), 6)]
    assert len(per_round) == res.stats.rounds
    assert all(r[1:] == [4] * 5 for r in per_round), per_round
    assert per_round[0][0] == 10  # the prompt's pairs


def test_expansion_depth_is_capped_by_the_budget(tiny_llama):
    """A budget-4 tree cannot be deeper than 4 nor use more than 4 nodes of a level: depth 5 / top_k 6 runs only
    3 expansion levels of 4 nodes each, and proposes exactly the tree that all 5 levels of 6 would (the deeper
    and the lower-ranked candidates never make the top 4)."""
    t = tiny_llama
    head = make_head(t)
    capped = Eagle3Drafter(t, head=head, budget=4, depth=5, top_k=6)
    capped.c_layer = None  # the torch layer, whose forwards are counted
    calls = count_forwards(head)
    st = prefilled_state(t, prompts(1, 10, 128)[0], capped)
    calls.clear()
    tree = capped.propose(st)
    # after the pass over the newly committed pair: at most 3 levels (not 5) of 4 (not 6); fewer when no frontier
    # node can place a descendant in the top 4 (tree/eagle.frontier_is_dead)
    assert 1 <= len(calls) - 1 <= 3 and all(c == 4 for c in calls[1:]), calls
    assert len(calls) - 1 == len(capped.last_candidates.frontiers) - 1  # one forward per drafted level
    full = Eagle3Drafter(t, head=head, budget=4, depth=5, top_k=6)
    full.budget = 100  # all 5 levels of 6 nodes expanded, then the top 4 kept, as before the caps
    st2 = prefilled_state(t, prompts(1, 10, 128)[0], full)
    full.propose(st2)
    full_tree = rerank(full.last_candidates, st2.root_token, 4)
    assert torch.equal(tree.tokens, full_tree.tokens) and torch.equal(tree.parents, full_tree.parents)


def test_draft_cache_matches_full_recompute(tiny_qwen3):
    """After a generation, the draft KV (built round by round from accepted nodes) equals one pass over all pairs."""
    t = tiny_qwen3
    head = make_head(t, seed=1)
    dr = Eagle3Drafter(t, head=head, budget=12, depth=3, top_k=3)
    res = SpeculativeDecoder(t, dr).generate(prompts(1, 15, 128, seed=2)[0], max_new_tokens=20)
    seq = torch.tensor(prompts(1, 15, 128, seed=2)[0] + res.tokens)
    n = dr.n_pairs
    _, feats = t.prefill(seq[:n])
    with torch.inference_mode():
        _, k, v = head(t.embed(seq[1:n + 1]).view(1, n, -1), head.fuse(feats.view(1, n, -1)),
                       torch.arange(n).view(1, n))
    kc, vc = dr.cached_kv()
    assert torch.allclose(k, kc, atol=1e-4) and torch.allclose(v, vc, atol=1e-4)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_c_layer_drafts_the_torch_layers_tree(norm_before_residual, tmp_path):
    """On a target that runs the C decoder layers the head's layer runs there too (its two-input variant): the
    same tree and candidate scores as the torch layer to float32 rounding, the same accepted-pair K/V, and greedy
    output token-identical to AR."""
    from graft_block import skinny

    if not skinny.available() or os.environ.get("GRAFT_BLOCK_TEST_DEVICE", "cpu") != "cpu":
        pytest.skip(f"the C layers do not run here: {skinny.why_not()}")
    t = tiny_target("qwen3", engine="lean", gemm="skinny")
    assert t.lean.fused is not None, t.lean.fused_why_not
    head = make_head(t, seed=3, norm_before_residual=norm_before_residual)
    c = Eagle3Drafter(t, head=head, budget=12, depth=3, top_k=4)
    tr = Eagle3Drafter(t, head=head, budget=12, depth=3, top_k=4)
    assert c.c_layer is not None
    tr.c_layer = None
    prompt = prompts(1, 20, 128, seed=6)[0]
    ref = hf_greedy(t, prompt, 30)
    assert SpeculativeDecoder(t, None).generate(prompt, max_new_tokens=30).tokens == ref
    for dr in (c, tr):
        assert SpeculativeDecoder(t, dr).generate(prompt, max_new_tokens=30).tokens == ref
    (kc, vc), (kt, vt) = c.cached_kv(), tr.cached_kv()
    assert kc.shape == kt.shape and torch.allclose(kc, kt, atol=1e-4) and torch.allclose(vc, vt, atol=1e-4)
    trees = []
    for dr in (c, tr):
        tree = dr.propose(prefilled_state(t, prompt, dr))
        trees.append((tree, dr.last_candidates))
    (a, ca), (b, cb) = trees
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert torch.allclose(ca.scores, cb.scores, atol=1e-4), (ca.scores - cb.scores).abs().max()
    # the benchmark (share_drafter_checkpoints) frees a shared checkpoint's torch layer once packed, and says so
    # if it is called; a head passed in is left alone
    t.share_drafter_checkpoints = True
    Eagle3Drafter(t, head=head, budget=12, depth=3, top_k=4)
    assert head.midlayer.mlp.down_proj.weight.numel() > 0
    save_head(make_head(t, seed=4, norm_before_residual=norm_before_residual), tmp_path)
    dr = Eagle3Drafter(t, checkpoint=tmp_path, budget=12, depth=3, top_k=4)
    freed = dr.head
    assert freed.midlayer.mlp.down_proj.weight.numel() == 0 and freed.lm_head.weight.numel() == 0  # packed in C
    assert SpeculativeDecoder(t, dr).generate(prompt, max_new_tokens=30).tokens == ref
    with pytest.raises(ConfigError, match="torch layers were freed"):
        freed(t.embed(torch.tensor([[1, 2]])), torch.zeros(1, 2, 64), torch.arange(2).view(1, 2))
    with pytest.raises(ConfigError, match="torch layers were freed"):
        freed.logits(torch.zeros(1, 64))


def test_bf16_drafting_stays_token_identical_to_ar(monkeypatch):
    """With bfloat16 drafting (the benchmark's default on AVX512-BF16 CPUs) the head's layer and its norm + LM
    head run bfloat16 packs in C, and greedy output is still AR's."""
    from graft_block import skinny

    if not skinny.available() or not skinny._lib.bf16_weights() or \
            os.environ.get("GRAFT_BLOCK_TEST_DEVICE", "cpu") != "cpu":
        pytest.skip("bfloat16 drafting needs the skinny kernel on an AVX512-BF16 CPU")
    monkeypatch.setenv(skinny.DRAFT_BF16_ENV, "1")
    t = tiny_target("qwen3", engine="lean", gemm="skinny")
    dr = Eagle3Drafter(t, head=make_head(t, seed=5), budget=8, depth=3, top_k=4)
    assert dr.c_layer is not None and dr.c_layer.lm.packed.dtype == torch.bfloat16
    prompt = prompts(1, 20, 128, seed=7)[0]
    ref = hf_greedy(t, prompt, 30)
    assert SpeculativeDecoder(t, None).generate(prompt, max_new_tokens=30).tokens == ref
    assert SpeculativeDecoder(t, dr).generate(prompt, max_new_tokens=30).tokens == ref


# ---- greedy identity ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("budget,depth,top_k", [(20, 4, 4), (5, 1, 3), (59, 7, 10), (1, 0, 1)])
def test_greedy_identity_tiny(arch, budget, depth, top_k, tiny_llama, tiny_qwen3):
    t = tiny_llama if arch == "llama" else tiny_qwen3
    dr = Eagle3Drafter(t, head=make_head(t, seed=budget), budget=budget, depth=depth, top_k=top_k)
    dec = SpeculativeDecoder(t, dr)
    accepted = 0
    for p in prompts(4, 11, 128, seed=budget):
        res = dec.generate(p, max_new_tokens=24)
        assert res.tokens == hf_greedy(t, p, 24)
        accepted += sum(k * c for k, c in res.stats.accept_hist.items())
    # even these untrained heads get a draft accepted on 4 prompts: the identity covers accepted paths
    assert accepted > 0


def test_runs_in_bfloat16():
    t = tiny_target("qwen3", dtype=torch.bfloat16)
    dr = Eagle3Drafter(t, head=make_head(t), budget=10, depth=3, top_k=3)  # fp32 head follows the target
    res = SpeculativeDecoder(t, dr).generate(prompts(1, 9, 128)[0], max_new_tokens=10)
    assert len(res.tokens) == 10 and dr.k_cache.dtype == torch.bfloat16 and dr.head.fc.weight.dtype == torch.bfloat16


def test_auto_budget_is_the_harness_job(tmp_path, tiny_llama):
    """Drafters never time the target: budget "auto" (or EAGLE's -1) names the int budget and the harness."""
    t = tiny_llama
    for budget in ("auto", -1):
        with pytest.raises(ConfigError, match=r"pass an int budget.*run_block\.py --budget auto"):
            Eagle3Drafter(t, head=make_head(t), budget=budget)
    save_head(make_head(t), tmp_path, extra_config={"type": "eagle3"})
    for extra in ({"budget": "auto"}, {"auto_sizes": [40, 60]}):
        with pytest.raises(ConfigError, match="run_block.py --budget auto"):
            Drafter.from_config({"type": "eagle3", "checkpoint": str(tmp_path), **extra}, tiny_llama)


# ---- TTT training ------------------------------------------------------------------------------------------
def tiny_data(target, layers, n_seq=8, plen=8, gen=24, topk=8, seed=0):
    """Target-greedy continuations of random prompts, with features and top-k soft labels (as the shared cache)."""
    out = []
    for p in prompts(n_seq, plen, target.vocab_size, seed=seed):
        ids = torch.tensor(p + hf_greedy(target, p, gen))
        with torch.no_grad():
            o = target.model(ids.view(1, -1), output_hidden_states=True)
        feats = torch.cat([o.hidden_states[i][0] for i in layers], -1)
        lp = torch.log_softmax(o.logits[0].float(), -1)
        tv, ti = lp.topk(topk, -1)
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[plen:] = True
        out.append({"ids": ids, "feats": feats, "top_ids": ti, "top_logp": tv, "loss_mask": mask})
    return {k: torch.stack([r[k] for r in out]) for k in out[0]}


def test_soft_labels_restrict_to_draft_vocab():
    d2t, t2d = build_draft_vocab(torch.tensor([5, 0, 3, 9, 0, 1]), 3)  # draft vocab = target ids {0, 2, 3}
    assert (torch.arange(3) + d2t).tolist() == [0, 2, 3] and t2d.tolist() == [1, 0, 1, 1, 0, 0]
    ids = torch.tensor([[3, 1, 0], [1, 2, 5]])
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]]))
    p, inside = soft_labels(ids, lp, t2d, d2t)
    assert torch.allclose(p[0], torch.tensor([0.2, 0.0, 0.5]) / 0.7)
    assert torch.allclose(p[1], torch.tensor([0.0, 1.0, 0.0]))
    assert inside.tolist() == [True, False]  # row 1: target argmax (id 1) is outside the draft vocab


def test_ttt_step0_is_causal_inference_and_steps_match_tree_attention(tiny_llama):
    t = tiny_llama
    # float64: the equivalences are exact, so 1e-5 must hold regardless of the CPU's fp32 summation order
    head = make_head(t, seed=4).eval().double()
    layers = (2, 2, 1)
    batch = tiny_data(t, layers, n_seq=1, gen=10)
    ids, feats = batch["ids"], batch["feats"].double()

    def embed(x):
        return t.embed(x).double()

    T = ids.shape[1]
    with torch.no_grad():
        outs = ttt_forward(head, embed, ids, feats, steps=3)
        g = head.fuse(feats)
        ref, K, V = head(embed(torch.cat([ids[:, 1:], ids[:, :1]], 1)), g, torch.arange(T).view(1, T))
        assert torch.allclose(outs[0][:, : T - 1], ref[:, : T - 1], atol=1e-5)
        # step k at index t == a depth-(k+1) chain node over the prefix cache of pairs 0..t
        for tt in (2, 6):
            Kc, Vc, o = K[:, :, : tt + 1], V[:, :, : tt + 1], ref[:, tt: tt + 1]
            for k in (1, 2):
                m = prefix_mask(1, Kc.shape[2], g.dtype, g.device)
                o, kk, vv = head(embed(ids[:, tt + 1 + k: tt + 2 + k]), o, torch.tensor([[tt + k]]), Kc, Vc, m)
                Kc, Vc = torch.cat([Kc, kk], 2), torch.cat([Vc, vv], 2)
                assert torch.allclose(outs[k][:, tt], o[:, 0], atol=1e-5), (tt, k)
        # a query window (start > 0) computes the same rows
        win = ttt_forward(head, embed, ids, feats, steps=3, start=5)
        for k in range(3):
            assert torch.allclose(win[k][:, : T - 6 - k], outs[k][:, 5: T - 1 - k], atol=1e-5), k


def test_training_lowers_loss_and_raises_tau(tiny_llama):
    t = tiny_llama
    layers = (2, 2, 1)
    train = tiny_data(t, layers, n_seq=12, seed=1)
    counts = torch.bincount(train["ids"][:, 8:].reshape(-1), minlength=t.vocab_size)
    model = Eagle3Drafter.training_model(t, {"draft_vocab_size": 64, "token_counts": counts, "feature_layers": layers})
    model.ttt_steps = 4
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)

    def train_loss():
        with torch.no_grad():
            return float(Eagle3Drafter.training_loss(model, t, train)[0])

    # (a random tiny target's continuations do not generalise across prompts: measure fitting, then use the
    # memorised prompts for decoding)
    before = train_loss()
    for step in range(40):
        loss, metrics = Eagle3Drafter.training_loss(model, t, train)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    after = train_loss()
    assert after < 0.7 * before, (before, after)
    assert metrics["acc_0"] > 0.3
    # the trained head drafts trees the target accepts, and decoding stays identical to greedy
    dr = Eagle3Drafter(t, head=model, budget=16, depth=4, top_k=4, feature_layers=layers)
    dec = SpeculativeDecoder(t, dr)
    taus = []
    for p in prompts(2, 8, 128, seed=1):  # training prompts: the head memorised their continuations
        res = dec.generate(p, max_new_tokens=24)
        assert res.tokens == hf_greedy(t, p, 24)
        taus.append(res.stats.tau)
    assert sum(taus) / len(taus) > 1.5, taus


# ---- sampling exactness ------------------------------------------------------------------------------------
def test_sampling_matches_target_distribution():
    """T=1, vocab 5: the joint law of the first 3 generated tokens equals the target's (exact, by enumeration)."""
    from itertools import product

    from scipy.stats import chi2

    t = tiny_target("llama", vocab_size=5, seed=3)
    prompt = [1, 4, 2, 3, 0]
    V = 5
    with torch.no_grad():
        seqs = torch.tensor([prompt + [a, b] for a, b in product(range(V), repeat=2)])
        probs = torch.softmax(t.model(seqs).logits.double(), -1)
    P = len(prompt)
    exact = torch.zeros(V, V, V, dtype=torch.float64)
    for a, b in product(range(V), repeat=2):
        r = probs[a * V + b]
        exact[a, b] = r[P - 1, a] * r[P, b] * r[P + 1]
    head = make_head(t, draft_vocab=4, seed=0)  # reduced draft vocab: one target token is never drafted
    dr = Eagle3Drafter(t, head=head, budget=6, depth=2, top_k=2)
    dec = SpeculativeDecoder(t, dr)
    N = 1200
    counts = torch.zeros(V, V, V, dtype=torch.float64)
    accepted = 0
    for i in range(N):
        res = dec.generate(prompt, max_new_tokens=3, temperature=1.0, seed=i)
        counts[tuple(res.tokens)] += 1
        accepted += sum(k * v for k, v in res.stats.accept_hist.items())
    assert accepted > N // 4  # drafted tokens really were accepted (the tree matters for the law)
    e = exact.reshape(-1) * N
    o = counts.reshape(-1)
    big = e >= 5  # pool sparse cells so the chi-square approximation holds
    stat = float((((o[big] - e[big]) ** 2) / e[big]).sum()
                 + (o[~big].sum() - e[~big].sum()) ** 2 / max(e[~big].sum(), 1e-9))
    dof = int(big.sum())  # (cells + pooled cell) - 1
    pval = float(chi2.sf(stat, dof))
    tv = 0.5 * float((o / N - exact.reshape(-1)).abs().sum())
    # tolerance: 99.9th percentile of the TV of N exact samples
    g = torch.Generator().manual_seed(0)
    null = sorted(0.5 * float((torch.bincount(torch.multinomial(exact.reshape(-1).float(), N, True, generator=g),
                                                minlength=V ** 3) / N - exact.reshape(-1)).abs().sum())
                  for _ in range(300))
    print(f"chi2={stat:.1f} dof={dof} p={pval:.3f} tv={tv:.4f} tol={null[-1]:.4f} accepted={accepted}")
    assert pval > 1e-3, (stat, dof, pval)
    assert tv <= null[-1], (tv, null[-1])
    # the test has power at this N: the same counts are rejected against the target's law at 0.8 T
    from graft_block.testing import chi_square_test, exact_sequence_probs

    colder = exact_sequence_probs(t, prompt, 3, SamplingConfig(temperature=0.8))
    observed = {seq: float(counts[seq]) for seq in colder if counts[seq] > 0}
    assert chi_square_test(observed, colder)[2] < 1e-3


# ---- SmolLM2 -----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_greedy_identity_smollm2_trained(smollm2):
    from graft_block.drafter import bundled_checkpoint
    if bundled_checkpoint("eagle3-smollm2") is None:
        pytest.skip("no trained eagle3-smollm2 checkpoint bundled")
    from graft_block.data import humaneval, mtbench

    t = smollm2
    dr = Drafter.from_config({"type": "eagle3", "checkpoint": "eagle3-smollm2", "budget": 15, "depth": 5,
                              "top_k": 6}, target=t)
    assert dr.feature_layers == (2, 15, 27)
    dec = SpeculativeDecoder(t, dr)
    taus = []
    for rec in (humaneval(1)[0], mtbench(1)[0]):
        ids = t.encode([{"role": "user", "content": rec["turns"][0]}]).tolist()
        res = dec.generate(ids, max_new_tokens=64)
        ref = t.model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)[0, len(ids):].tolist()
        assert res.tokens == ref[: len(res.tokens)] and len(res.tokens) == len(ref)
        taus.append(res.stats.tau)
    assert sum(taus) / len(taus) > 1.15, taus  # a random head gives ~1.0; the trained one ~1.5 (TRAINING.md)


def test_continuing_a_checkpoint_in_place_keeps_its_tree_defaults(tiny_llama, tmp_path):
    t = tiny_llama
    counts = torch.ones(t.vocab_size, dtype=torch.long)
    model = Eagle3Drafter.training_model(t, {"draft_vocab_size": 32, "token_counts": counts,
                                             "feature_layers": (2, 2, 1)})
    Eagle3Drafter.save_trained(model, tmp_path, {"budget": 7, "depth": 4, "top_k": 4})
    Eagle3Drafter.save_trained(model, tmp_path, {})  # a resumed run whose cfg names no tree shape
    assert json.loads((tmp_path / "config.json").read_text())["drafter_defaults"] == {"budget": 7, "depth": 4,
                                                                                        "top_k": 4}
    fresh = tmp_path / "new"
    Eagle3Drafter.save_trained(model, fresh, {})
    assert json.loads((fresh / "config.json").read_text())["drafter_defaults"] == {"budget": 15, "depth": 5,
                                                                                    "top_k": 8}


def test_widening_the_draft_vocab_keeps_trained_rows(tiny_llama, tmp_path):
    t = tiny_llama
    head = make_head(t, draft_vocab=80, seed=3)
    with torch.no_grad():  # a "trained" head: its rows are a fixed linear map of the target's (80 rows > 64 dims)
        mix = torch.randn(t.hidden_size, t.hidden_size, generator=torch.Generator().manual_seed(0)) * 0.3
        W = t.model.get_output_embeddings().weight.detach().float()
        head.lm_head.weight.copy_(W[torch.arange(80) + head.d2t] @ mix)
    old = (torch.arange(80) + head.d2t).tolist()
    add = [i for i in range(t.vocab_size) if i not in old][:24] + old[:5]  # 24 new ids, 5 already there
    wide = widen_draft_vocab(head, t, torch.tensor(add))
    used = (torch.arange(wide.cfg.draft_vocab_size) + wide.d2t).tolist()
    assert wide.cfg.draft_vocab_size == 104 and used == sorted(set(old) | set(add))
    assert int(wide.t2d.sum()) == 104 and bool(wide.t2d[used].all())
    rows = dict(zip(used, wide.lm_head.weight))
    assert all(torch.equal(rows[i], r) for i, r in zip(old, head.lm_head.weight))  # trained rows untouched
    new = [i for i in used if i not in old]
    assert torch.allclose(torch.stack([rows[i] for i in new]), W[new] @ mix, atol=1e-3)  # the fitted map
    out = torch.randn(1, 5, t.hidden_size)  # any pre-norm state: old ids' logits must not move
    assert torch.equal(wide.logits(out)[..., [used.index(i) for i in old]], head.logits(out))
    save_head(wide, tmp_path)  # round-trips through the strict loader
    assert load_head(tmp_path, t).cfg.draft_vocab_size == 104
    # through training: --draft-vocab with --init adds the data's ids and keeps the checkpoint's
    save_head(head, tmp_path / "init")
    cfg = {"draft_vocab": add}
    grown = Eagle3Drafter.training_model(t, cfg, str(tmp_path / "init"))
    assert (torch.arange(104) + grown.d2t.cpu()).tolist() == used
    resumed = Eagle3Drafter.training_model(t, cfg, None)  # a resume rebuilds from the run state's cfg, no init
    resumed.load_state_dict(grown.state_dict())
    assert (torch.arange(104) + resumed.d2t.cpu()).tolist() == used
    with pytest.raises(ConfigError, match="outside the target vocabulary"):
        widen_draft_vocab(head, t, torch.tensor([t.vocab_size]))


@pytest.mark.parametrize("layout", ["specforge", "speculators"])
def test_absent_rms_norm_eps_takes_the_references_default(tmp_path, tiny_llama, layout):
    """A config.json without rms_norm_eps gets the default of the config class the reference builds it with:
    EAGLE's EConfig, SpecForge's and speculators' LlamaConfig all say 1e-6. Every norm of the loaded head uses it."""
    head = make_head(tiny_llama, seed=7, norm_before_residual=(layout == "speculators"))
    folder = hub_folder(tmp_path, head, layout)
    cfg = json.loads((folder / "config.json").read_text())
    (cfg["transformer_layer_config"] if layout == "speculators" else cfg).pop("rms_norm_eps")
    (folder / "config.json").write_text(json.dumps(cfg))
    loaded = load_head(folder)
    assert loaded.cfg.rms_norm_eps == 1e-6
    norms = [m for m in loaded.modules() if type(m).__name__ == "RMSNorm"]
    assert norms and all(m.eps == 1e-6 for m in norms)


def test_ttt_step_k_at_index_t_is_scored_on_token_t_plus_2_plus_k(monkeypatch):
    """ttt_loss's alignment: step k's output at index t is scored against the target's distribution of token
    t + 2 + k (cached at row t + 1 + k), and counts iff that token is trained. A stand-in unroll that names
    exactly that token at every index scores (nearly) zero loss and full accuracy."""
    from types import SimpleNamespace

    import graft_block.drafters.eagle3.training as ET

    T, V, steps = 8, 16, 3
    ids = torch.arange(T).view(1, T)
    top_ids = torch.arange(1, T + 1).view(1, T, 1) % V  # row j: the target's next token j + 1, certain
    top_logp = torch.zeros(1, T, 1)
    loss_mask = ids >= 3  # a prompt of 3 tokens

    def unroll(head, emb_fn, ids, feats, steps, start):
        outs = []
        for k in range(steps):
            t = torch.arange(start, T)
            out = torch.nn.functional.one_hot((t + 2 + k) % V, V).float().view(1, -1, V) * 50
            outs.append(out)
        return outs

    monkeypatch.setattr(ET, "ttt_forward", unroll)
    head = SimpleNamespace(t2d=torch.ones(V, dtype=torch.bool), d2t=torch.zeros(V, dtype=torch.long),
                           logits=lambda h: h)
    loss, m = ET.ttt_loss(head, None, ids, torch.zeros(1, T, 3), top_ids, top_logp, loss_mask, steps=steps)
    assert float(loss) < 1e-6
    assert m["rows"] == 5.0  # step 0: indices 0..5 predict tokens 2..7, of which 3..7 are trained
    assert [m[f"acc_{k}"] for k in range(steps)] == [1.0] * steps


def test_a_d2t_mapping_two_draft_ids_onto_one_target_id_is_refused(tmp_path, tiny_llama):
    """A corrupt d2t whose draft id 1 lands on draft id 0's target id (t2d unchanged, so the t2d check alone would
    pass) is refused when loaded, not drafted with."""
    def dup(sd):
        d2t = sd["d2t"].clone()
        d2t[1] = d2t[0] - 1
        sd["d2t"] = d2t
    _write(tmp_path, make_head(tiny_llama), dup)
    with pytest.raises(ConfigError, match="same target id"):
        load_head(tmp_path, tiny_llama)


def test_c_layer_leaves_its_inputs_alone_and_names_a_wrong_feature_width():
    """The head's C layer updates its own copy of the fused features, never the caller's (a drafter reuses them),
    and features of the wrong width get the torch head's message naming the expected channels, not a product
    over the wrong number of inputs."""
    from graft_block import skinny

    if not skinny.available() or os.environ.get("GRAFT_BLOCK_TEST_DEVICE", "cpu") != "cpu":
        pytest.skip(f"the C layers do not run here: {skinny.why_not()}")
    t = tiny_target("qwen3", engine="lean", gemm="skinny")
    dr = Eagle3Drafter(t, head=make_head(t, seed=8), budget=4, depth=2, top_k=2)
    assert dr.c_layer is not None
    g = torch.Generator().manual_seed(8)
    emb, feats = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g)
    before = feats.clone()
    out = dr.c_layer.forward(emb, feats, 0, 0)
    assert torch.equal(feats, before) and not torch.equal(out, feats)
    with pytest.raises(ConfigError, match="EAGLE-3 fc expects 192 feature channels"):
        dr.c_layer.fuse(torch.randn(2, 128))
