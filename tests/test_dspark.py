"""DSpark: the Markov-corrected block drafter. Lossless decoding (greedy and T=1, chain / tree / scheduled), the
best-first conditional tree, DeepSpec's checkpoint layouts loaded bit for bit and recomputed independently, both
block alignments, training (DeepSpec's loss) and clear errors."""
import json
import math
import os
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import graft_block.drafters.dflash as D
import graft_block.drafters.dspark as S
from graft_block.decoder import SpeculativeDecoder
from graft_block.drafter import Drafter
from graft_block.errors import ConfigError
from graft_block.sampling import SamplingConfig
from graft_block.testing import (chi_square_test, exact_sequence_probs, hf_greedy, null_tv_quantile,
                                  prefilled_state, tiny_target)
from graft_block.tree import paths_to_leaves
from graft_block.tree.ddtree import brute_force_top_prefixes, conditional_ddtree, ddtree

PROMPT = [5, 17, 33, 2, 99, 64, 12]


def _drafter(target, **kw):
    cfg = {"type": "dspark", "num_layers": 2, "target_layer_ids": [0, 2], "block_size": 8, "seed": 1,
           "markov_rank": 8}
    cfg.update(kw)
    return Drafter.from_config(cfg, target=target)


def _bias(model, prev, vocab=None, draft_index=None, hidden=None):
    """The Markov head's logit correction W2 l for draft rows, as drafting and training compose it."""
    return model.markov_project(model.markov_latents(prev, hidden, draft_index), vocab)


def _paths(tree):
    """Every root->node token path of a tree (root excluded), as a set."""
    toks, par = tree.tokens.tolist(), tree.parents.tolist()
    out = set()
    for i in range(1, len(toks)):
        p, j = [], i
        while j > 0:
            p.append(toks[j])
            j = par[j]
        out.add(tuple(reversed(p)))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("alignment", ["zlab", "deepspec"])
@pytest.mark.parametrize("proposal,budget", [("chain", 7), ("ddtree", 20)])
def test_greedy_identity_tiny(arch, alignment, proposal, budget, one_thread):
    target = tiny_target(arch)
    ref = hf_greedy(target, PROMPT, 32)
    d = _drafter(target, proposal=proposal, budget=budget, alignment=alignment)
    res = SpeculativeDecoder(target, d).generate(PROMPT, max_new_tokens=32)
    assert res.tokens == ref
    assert d.model.num_drafts == (7 if alignment == "zlab" else 8)
    surv = d.node_survival(d._last[0])
    assert surv is not None and surv[0] == 1 and bool((surv[1:] <= 1).all())


def test_planted_rows_are_accepted_in_both_alignments(one_thread):
    """Base logits forced to the target's own continuation at the rows each alignment says draft must be accepted
    in full: row k predicts start+k (zlab) or start+k+1 (deepspec)."""
    target = tiny_target("llama")
    ref = hf_greedy(target, PROMPT, 32)
    full = PROMPT + ref
    for alignment in ("zlab", "deepspec"):
        d = _drafter(target, proposal="chain", budget=7, alignment=alignment)
        d.model.markov_head.markov_w2.weight.data.zero_()
        d._w2.zero_()
        orig = d.block_rows

        def planted(state, rows=None, length=None, d=d, orig=orig):
            ids, hidden, base = orig(state, rows, length)
            start = state.cache_len
            nxt = full[start + 1: start + 1 + base.shape[0]]
            nxt = nxt + [0] * (base.shape[0] - len(nxt))
            return ids, hidden, F.one_hot(torch.tensor(nxt), base.shape[-1]).float() * 50

        d.block_rows = planted
        res = SpeculativeDecoder(target, d).generate(PROMPT, max_new_tokens=32)
        assert res.tokens == ref and res.stats.tau > 6.0, alignment


def test_untrained_heads_draft_exactly_as_the_dflash_backbone(one_thread):
    """from_dflash starts with W2 = 0: chain and tree propose what DFlash proposes from the same weights (the
    conditional tree with parent-independent distributions is DDTree's top-budget prefix set)."""
    target = tiny_target("qwen3")
    base = D.new_model(target, num_layers=2, block_size=8, target_layer_ids=[0, 2], mask_token_id=120, seed=3)
    spark = S.from_dflash(base, markov_rank=8, confidence_head=True)
    headless = S.from_dflash(base, markov_rank=0, confidence_head=False)  # DeepSpec's DFlash spelling
    for proposal, budget in (("chain", 7), ("ddtree", 12)):
        a = D.DFlashDrafter(target, base, proposal=proposal, budget=budget)
        ta = a.propose(prefilled_state(target, PROMPT, a))
        for model in (spark, headless):
            b = S.DSparkDrafter(target, model, proposal=proposal, budget=budget)
            tb = b.propose(prefilled_state(target, PROMPT, b))
            assert _paths(ta) == _paths(tb) and ta.size == tb.size
            assert torch.allclose(ta.scores.sort().values, tb.scores.sort().values, atol=1e-5)


def test_markov_head_changes_each_draft_by_its_previous_token(one_thread):
    """The chain is the argmax walk of U_j + W2 W1[draft j-1], recomputed here by hand from the drafter's rows."""
    target = tiny_target("llama")
    d = _drafter(target, proposal="chain", budget=7)
    st = prefilled_state(target, PROMPT, d)
    tree = d.propose(st)
    with torch.no_grad():
        _, hidden, base = d.block_rows(st)
        W1, W2 = d.model.markov_head.markov_w1.weight, d.model.markov_head.markov_w2.weight
        prev, toks = st.root_token, []
        for j in range(7):
            z = base[j] + W2 @ W1[prev]
            prev = int(z.argmax())
            toks.append(prev)
        plain = base.argmax(-1).tolist()
    assert tree.tokens[1:].tolist() == toks
    assert toks != plain  # the correction matters for this random head


def test_first_draft_off_drafts_the_backbone_row_then_the_corrected_ones(one_thread, tmp_path):
    """markov_first_draft false: draft 0 (previous token = the anchor, which the backbone reads) is the backbone's
    argmax and later drafts keep the bias, in the drafter and in the training logits; the switch survives a save,
    a non-bool is refused, and greedy decoding stays the target's."""
    target = tiny_target("llama")
    d = _drafter(target, proposal="chain", budget=7, markov_first_draft=False)
    st = prefilled_state(target, PROMPT, d)
    tree = d.propose(st)
    with torch.no_grad():
        _, hidden, base = d.block_rows(st)
        W1, W2 = d.model.markov_head.markov_w1.weight, d.model.markov_head.markov_w2.weight
        toks = [int(base[0].argmax())]
        for j in range(1, 7):
            toks.append(int((base[j] + W2 @ W1[toks[-1]]).argmax()))
        assert tree.tokens[1:].tolist() == toks
        assert int((base[0] + W2 @ W1[st.root_token]).argmax()) != toks[0]  # the bias would have changed draft 0
        prev, j = torch.tensor([st.root_token, toks[0]]), torch.tensor([0, 1])
        z = S.training.draft_logits(d.model, target, hidden[:2], prev, j)
        plain = d.model.logits(hidden[:2], *D.lm_head(target))
        assert torch.equal(z[0], plain[0]) and not torch.allclose(z[1], plain[1])
    S.save_checkpoint(d.model, tmp_path / "ck", dtype=torch.float32)
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["dflash_config"]["markov_first_draft"] is False
    assert S.load_checkpoint(tmp_path / "ck").markov_first_draft is False
    cfg["dflash_config"]["markov_first_draft"] = "no"
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="markov_first_draft"):
        S.load_checkpoint(tmp_path / "ck")
    tree_d = _drafter(target, proposal="ddtree", budget=12, markov_first_draft=False)
    assert (SpeculativeDecoder(target, tree_d).generate(PROMPT, max_new_tokens=32).tokens
            == hf_greedy(target, PROMPT, 32))


def test_candidate_children_match_the_whole_vocabulary_ranking(one_thread):
    """markov_candidates C ranks a node's children among its depth's C likeliest backbone tokens, the mass outside
    them uncorrected in the normaliser: with C = V - 1 the tree is the exact one (C = 0) up to that normaliser."""
    target = tiny_target("llama")
    trees = {}
    for c in (0, target.vocab_size - 1, 16):
        d = _drafter(target, proposal="ddtree", budget=12, markov_candidates=c)
        with torch.no_grad():  # a strong random Markov head, so that the correction reorders children
            d.model.markov_head.markov_w2.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(4))
        d = S.DSparkDrafter(target, d.model, proposal="ddtree", budget=12, markov_candidates=c)  # re-gathers W2
        trees[c] = d.propose(prefilled_state(target, PROMPT, d))
    exact, wide, narrow = trees[0], trees[target.vocab_size - 1], trees[16]
    assert _paths(exact) == _paths(wide) and torch.allclose(exact.scores, wide.scores, atol=1e-3)
    assert narrow.size == exact.size and len(_paths(narrow) & _paths(exact)) >= exact.size // 2
    with pytest.raises(ConfigError, match="markov_candidates"):
        _drafter(target, proposal="ddtree", budget=4, markov_candidates=-1)


@pytest.mark.parametrize("proposal,budget", [("chain", 6), ("ddtree", 1), ("ddtree", 5), ("ddtree", 24)])
@pytest.mark.parametrize("first,conf,temperature,variant", [
    (False, "markov", 0.0, None), (True, "markov", 0.9, "unit"), (False, "plain", 0.7, "dead"),
    (True, None, 0.0, "dead"), (False, "markov", 0.8, "vocab")])
def test_the_c_walk_builds_the_python_walks_tree(proposal, budget, first, conf, temperature, variant, one_thread,
                                                 monkeypatch):
    """DSpark's Markov tree walked in C (``c_walk``, what the drafter runs with a vanilla head and a candidate cut)
    is the tree the Python walk builds from the same round terms: the same nodes in the same order, scores and
    acceptance estimates to float32 rounding. Strong random heads and per-depth temperatures reorder children;
    chains and trees, a biased or unbiased first draft, a confidence head with or without its W1 term or none,
    greedy and tempered ranking, ranking temperatures of exactly 1, candidates of probability 0 (never proposed),
    and a draft vocabulary (candidate columns mapped to its ids)."""
    from graft_block.drafters.dspark import c_walk

    if not c_walk.available():
        pytest.skip(f"no C walk here: {c_walk.why_not()}")
    monkeypatch.delenv("GRAFT_BLOCK_C_WALK", raising=False)
    target = tiny_target("llama")
    if target.device.type != "cpu":
        pytest.skip("the C walk reads CPU weights")
    g = torch.Generator().manual_seed(budget)
    if variant == "vocab":
        vocab = torch.randperm(target.vocab_size, generator=g)[:40].sort().values
        m = S.from_dflash(D.new_model(target, 2, 8, [0, 2], 120, draft_vocab=vocab), markov_rank=8,
                          confidence_head=True, markov_first_draft=first)
    else:
        m = _drafter(target, proposal=proposal, budget=budget, markov_candidates=16, markov_first_draft=first,
                     confidence_head=conf is not None).model
    with torch.no_grad():
        m.markov_head.markov_w2.weight.normal_(0, 0.5, generator=g)
        m.draft_temperatures = 0.5 + 1.5 * torch.rand(m.num_drafts, generator=g)
        m.sampled_draft_temperatures = 0.5 + 1.5 * torch.rand(m.num_drafts, generator=g)
        m.confidence_temperatures = 0.5 + torch.rand(m.num_drafts, generator=g)
    if variant == "unit":
        m.draft_temperatures = m.sampled_draft_temperatures = torch.ones(m.num_drafts)
    if conf == "plain":
        m.confidence_with_markov = False
    d = S.DSparkDrafter(target, m, proposal=proposal, budget=budget, markov_candidates=16)  # re-gathers W2
    state = prefilled_state(target, PROMPT, d)
    _, hidden, base = d.block_rows(state, rows=budget)
    depth = base.shape[0] if proposal == "ddtree" else min(budget, base.shape[0])
    terms = d._round_terms(hidden, base, temperature, budget)
    if variant == "dead" and depth > 2:  # probability-0 candidates at one depth, and below another depth's best two
        terms["cand_z"][1, 3:9] = -math.inf
        terms["cand_z"][2, 2:] = -math.inf
    assert d._walks_in_c(terms)
    tree_c, accept_c = d._c_walk(terms, state.root_token, temperature, budget, depth)
    tree_py, accept_py = conditional_ddtree(state.root_token, d._expander(hidden, base, temperature, terms), budget,
                                            depth)
    assert 1 < tree_py.size <= budget + 1
    if variant == "vocab":  # draft-vocabulary ids, not its column indices
        assert set(tree_py.tokens[1:].tolist()) <= set(vocab.tolist())
    assert tree_c.tokens.tolist() == tree_py.tokens.tolist() and tree_c.parents.tolist() == tree_py.parents.tolist()
    assert torch.allclose(tree_c.scores, tree_py.scores, atol=1e-5)
    assert (accept_c is None) == (accept_py is None) == (conf is None)
    if conf is not None:
        assert torch.allclose(torch.tensor(accept_c), torch.tensor(accept_py), atol=1e-5)
    with pytest.raises(ValueError, match="max_depth"):  # the C walk reads rows in place: it refuses to overrun them
        c_walk.markov_tree(state.root_token, budget, terms["cand_z"].shape[0] + 1, terms["k"], terms["cand_z"],
                           terms["cand_cols"], terms["rest"], terms["cand_w2"], d._w1, temperature, terms["ranking"])
    monkeypatch.setenv("GRAFT_BLOCK_C_WALK", "0")  # the switch that measures the Python walk
    assert not d._walks_in_c(terms)


def test_conditional_ddtree_is_the_top_budget_prefixes_of_the_conditional_joint():
    g = torch.Generator().manual_seed(0)
    V, L = 5, 3
    table = torch.log_softmax(torch.randn(L, V, V, generator=g) * 2, -1)  # [depth, parent token, child]

    def expand(depth, prevs, prefix):
        lp = table[depth - 1, prevs[0]]
        vals, ids = lp.sort(descending=True)
        return [(ids.tolist(), vals.tolist(), None)]

    for budget in (1, 4, 9, 20):
        tree, accept = conditional_ddtree(0, expand, budget, L)
        joint = []

        def rec(path, prev, score):
            if len(path) == L:
                return
            for t in range(V):
                s = score + float(table[len(path), prev, t])
                joint.append((s, path + (t,)))
                rec(path + (t,), t, s)

        rec((), 0, 0.0)
        joint.sort(reverse=True)
        assert _paths(tree) == {p for _, p in joint[:budget]} and accept is None
        for i in range(1, tree.size):  # scores are the joint log-probs of the paths
            assert tree.parents[i] < i
    # parent-independent distributions: the same set as DDTree's best-first heap over marginals
    marg = torch.log_softmax(torch.randn(L, V, generator=g), -1)
    vals, ids = marg.sort(dim=-1, descending=True)
    indep = conditional_ddtree(0, lambda d, p, _: [(ids[d - 1].tolist(), vals[d - 1].tolist(), None)], 9, L)[0]
    assert _paths(indep) == brute_force_top_prefixes(ids, vals, 9) == _paths(ddtree(0, ids, vals, 9))


def test_conditional_acceptance_estimates():
    """c for a parent's top child, (1 - c) q(x) / (1 - q(top)) for the others; K = 1 is the greedy chain."""
    lp = [math.log(0.5), math.log(0.3), math.log(0.2)]
    tree, acc = conditional_ddtree(7, lambda d, p, _: [([10 * d + 1, 10 * d + 2, 10 * d + 3], lp, 0.8)], 3, 2)
    assert tree.tokens.tolist() == [7, 11, 12, 21]  # 0.3 beats 0.5 * 0.5
    assert acc == pytest.approx([1.0, 0.8, 0.2 * 0.3 / 0.5, 0.8])
    chain_tree, _ = conditional_ddtree(7, lambda d, p, _: [([p[0] + 1], [-0.1], None)], 5, 5)
    assert chain_tree.tokens.tolist() == [7, 8, 9, 10, 11, 12] and chain_tree.parents.tolist() == [-1, 0, 1, 2, 3, 4]


# ---- checkpoint layouts -------------------------------------------------------------------------------------
def _dspark_folder(path, target, layout: str, alignment=None, rank=6, conf=True, with_markov=True, prefix=False,
                   drop=None, extra=None, kind="vanilla", w2_scale=0.05):
    """A DSpark checkpoint written by hand: ``native`` = DeepSpec's Qwen3DSparkModel (keys at the top level, frozen
    embed/lm_head copies), ``export`` = DSparkDraftModel with a dflash_config. Tiny Qwen3 shapes, fp32. ``kind``:
    the Markov head's type (DeepSpec's tensor names: ``gate_proj`` for gated, ``joint_proj`` for rnn)."""
    from safetensors.torch import save_file

    H, V = target.hidden_size, target.vocab_size
    heads, kv, hd, inter, n_layers, ids = 4, 2, 16, 96, 2, [0, 2]
    cfg = {"model_type": "qwen3", "attention_bias": False, "hidden_act": "silu", "hidden_size": H,
           "intermediate_size": inter, "num_hidden_layers": n_layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "head_dim": hd, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "max_position_embeddings": 4096, "tie_word_embeddings": False, "vocab_size": V,
           "num_target_layers": target.num_layers, "block_size": 6}
    keys = {"mask_token_id": 120, "target_layer_ids": ids, "markov_rank": rank, "markov_head_type": kind,
            "enable_confidence_head": conf, "confidence_head_with_markov": with_markov}
    if alignment is not None:
        keys["block_alignment"] = alignment
    if layout == "native":
        cfg.update({"architectures": ["Qwen3DSparkModel"], "num_anchors": 512, **keys})
    else:
        cfg.update({"architectures": ["DSparkDraftModel"], "dflash_config": {"projector_type": "dspark", **keys}})
    cfg.update(extra or {})
    g = torch.Generator().manual_seed(0)

    def w(*shape, s=0.05):
        return torch.randn(*shape, generator=g) * s

    t = {"fc.weight": w(H, 2 * H), "hidden_norm.weight": 1 + w(H), "norm.weight": 1 + w(H)}
    for i in range(n_layers):
        p = f"layers.{i}."
        t.update({p + "self_attn.q_proj.weight": w(heads * hd, H), p + "self_attn.k_proj.weight": w(kv * hd, H),
                  p + "self_attn.v_proj.weight": w(kv * hd, H), p + "self_attn.o_proj.weight": w(H, heads * hd),
                  p + "self_attn.q_norm.weight": 1 + w(hd), p + "self_attn.k_norm.weight": 1 + w(hd),
                  p + "mlp.gate_proj.weight": w(inter, H), p + "mlp.up_proj.weight": w(inter, H),
                  p + "mlp.down_proj.weight": w(H, inter), p + "input_layernorm.weight": 1 + w(H),
                  p + "post_attention_layernorm.weight": 1 + w(H)})
    if rank:
        t.update({"markov_head.markov_w1.weight": w(V, rank, s=1.0),
                  "markov_head.markov_w2.weight": w(V, rank, s=w2_scale)})
        if kind == "gated":
            t.update({"markov_head.gate_proj.weight": w(rank, H + rank, s=0.5), "markov_head.gate_proj.bias": w(rank)})
        elif kind == "rnn":
            t.update({"markov_head.joint_proj.weight": w(3 * rank, 2 * rank + H, s=0.5),
                      "markov_head.joint_proj.bias": w(3 * rank, s=0.5)})
    if conf:
        t.update({"confidence_head.proj.weight": w(1, H + (rank if with_markov else 0), s=0.3),
                  "confidence_head.proj.bias": w(1)})
    if layout == "native":
        t["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach().clone()
        t["lm_head.weight"] = target.model.get_output_embeddings().weight.detach().clone()
    if prefix:
        t = {"model." + k: v for k, v in t.items()}
    for k in drop or ():
        t.pop(k)
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return path, {k[len("model."):] if prefix else k: v for k, v in t.items()}


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = pos.float().view(-1, 1) * inv.view(1, -1)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    a, b = x.chunk(2, -1)
    return x * cos + torch.cat([-b, a], -1) * sin


def _markov_step(t, kind, h, prev, state):
    """One step of DeepSpec's Markov heads from the raw tensors: (bias over the vocabulary, the new RNN state)."""
    e = t["markov_head.markov_w1.weight"][prev]
    if kind == "gated":
        lat = torch.sigmoid(t["markov_head.gate_proj.weight"] @ torch.cat([h, e]) + t["markov_head.gate_proj.bias"]) * e
    elif kind == "rnn":
        r = e.shape[0]
        proj = t["markov_head.joint_proj.weight"] @ torch.cat([state, e, h]) + t["markov_head.joint_proj.bias"]
        a = torch.sigmoid(proj[:r])
        state = a * state + (1 - a) * torch.tanh(proj[r: 2 * r])
        lat = torch.tanh(proj[2 * r:])
    else:
        lat = e
    return t["markov_head.markov_w2.weight"] @ lat, state


def _reference_block(t, target, feats, start, block_ids, offset, rank, with_markov, temps=None, kind="vanilla"):
    """An independent DSpark forward from the raw tensors: context K/V from fc/hidden_norm, non-causal block
    attention over [context; block], Qwen3 layers, then the Markov walk and confidences. Returns (chain tokens,
    confidences)."""
    heads, kv, hd = 4, 2, 16
    ctx = _rms(feats @ t["fc.weight"].T, t["hidden_norm.weight"])  # [m, H]
    x = target.model.get_input_embeddings().weight[block_ids].detach()
    cpos, bpos = torch.arange(ctx.shape[0]), torch.arange(start, start + len(block_ids))
    for i in range(2):
        p = f"layers.{i}."
        hn = _rms(x, t[p + "input_layernorm.weight"])

        def kvs(src, pos):
            k = (src @ t[p + "self_attn.k_proj.weight"].T).view(-1, kv, hd)
            k = _rope(_rms(k, t[p + "self_attn.k_norm.weight"]).transpose(0, 1), pos, 1e4)
            return k, (src @ t[p + "self_attn.v_proj.weight"].T).view(-1, kv, hd).transpose(0, 1)

        kc, vc = kvs(ctx, cpos)
        kb, vb = kvs(hn, bpos)
        q = (hn @ t[p + "self_attn.q_proj.weight"].T).view(-1, heads, hd)
        q = _rope(_rms(q, t[p + "self_attn.q_norm.weight"]).transpose(0, 1), bpos, 1e4)
        k = torch.cat([kc, kb], 1).repeat_interleave(heads // kv, 0)
        v = torch.cat([vc, vb], 1).repeat_interleave(heads // kv, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd), -1) @ v
        x = x + att.transpose(0, 1).reshape(len(block_ids), -1) @ t[p + "self_attn.o_proj.weight"].T
        m = _rms(x, t[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T)) \
            @ t[p + "mlp.down_proj.weight"].T
    h = _rms(x, t["norm.weight"])[offset:]
    U = h @ target.model.get_output_embeddings().weight.detach().T
    prev, toks, confs, state = int(block_ids[0]), [], [], torch.zeros(rank)
    for j in range(h.shape[0]):
        bias, state = _markov_step(t, kind, h[j], prev, state) if rank else (0, state)
        z = U[j] + bias
        if "confidence_head.proj.weight" in t:
            f = torch.cat([h[j], t["markov_head.markov_w1.weight"][prev]]) if with_markov else h[j]
            logit = float(f @ t["confidence_head.proj.weight"][0] + t["confidence_head.proj.bias"][0])
            confs.append(1 / (1 + math.exp(-logit / (1.0 if temps is None else temps[j]))))
        prev = int(z.argmax())
        toks.append(prev)
    return toks, confs


@pytest.mark.parametrize("layout,prefix,alignment", [("native", False, None), ("export", False, None),
                                                     ("export", True, "zlab"), ("native", False, "zlab")])
def test_deepspec_folders_load_bit_for_bit_and_match_an_independent_forward(tmp_path, layout, prefix, alignment,
                                                                            one_thread):
    target = tiny_target("qwen3")
    folder, raw = _dspark_folder(tmp_path / "ds", target, layout, alignment=alignment, prefix=prefix)
    d = Drafter.from_config(str(folder), target=target)  # no "type": the folder's architectures say dspark
    assert isinstance(d, S.DSparkDrafter) and d.model.alignment == (alignment or "deepspec")
    sd = d.model.state_dict()
    for k, v in raw.items():
        if k in ("embed_tokens.weight", "lm_head.weight"):
            assert k not in sd  # the target's own are used
            continue
        assert torch.equal(sd[k], v), k
    offset = d.model.draft_offset
    d.budget = d.model.num_drafts
    st = prefilled_state(target, PROMPT, d)
    with torch.no_grad():
        tree = d.propose(st)
        feats = st.new_features  # the prompt's target features, context of the first block
        block = torch.tensor([st.root_token] + [120] * 5)
        toks, confs = _reference_block(raw, target, feats, len(PROMPT), block, offset, 6, True)
    assert tree.tokens[1:].tolist() == toks
    surv = d.node_survival(tree)
    assert torch.allclose(surv[1:].float(), torch.tensor(confs).cumprod(0), atol=1e-5)
    ref = hf_greedy(target, PROMPT, 24)
    assert SpeculativeDecoder(target, d).generate(PROMPT, max_new_tokens=24).tokens == ref


@pytest.mark.parametrize("rank,conf,with_markov", [(0, False, False), (0, True, False), (6, True, False)])
def test_head_options_load(tmp_path, rank, conf, with_markov, one_thread):
    """markov_rank 0 with the confidence head off is DeepSpec's DFlash; a head without the Markov embedding."""
    target = tiny_target("qwen3")
    folder, raw = _dspark_folder(tmp_path / "ds", target, "native", rank=rank, conf=conf, with_markov=with_markov)
    d = Drafter.from_config(str(folder), target=target)
    d.budget = d.model.num_drafts
    st = prefilled_state(target, PROMPT, d)
    with torch.no_grad():
        tree = d.propose(st)
        toks, confs = _reference_block(raw, target, st.new_features, len(PROMPT),
                                       torch.tensor([st.root_token] + [120] * 5), 0, rank, with_markov)
    assert tree.tokens[1:].tolist() == toks
    assert (d.node_survival(tree) is None) == (not conf)
    tree_d = Drafter.from_config({"checkpoint": str(folder), "type": "dspark", "proposal": "ddtree", "budget": 12},
                                 target=target)
    ref = hf_greedy(target, PROMPT, 20)
    assert SpeculativeDecoder(target, tree_d).generate(PROMPT, max_new_tokens=20).tokens == ref


@pytest.mark.parametrize("kind,layout", [("gated", "native"), ("rnn", "native"), ("rnn", "export")])
def test_gated_and_rnn_heads_load_bit_for_bit_and_match_an_independent_forward(tmp_path, kind, layout, one_thread):
    """DeepSpec's other two Markov heads (``gate_proj``, ``joint_proj``): the chain and its confidences equal a
    forward recomputed from the raw tensors, and decoding stays token-identical to greedy."""
    target = tiny_target("qwen3")
    folder, raw = _dspark_folder(tmp_path / "ds", target, layout, kind=kind, w2_scale=0.5)  # a bias that matters
    d = Drafter.from_config(str(folder), target=target)
    assert d.model.markov_head_type == kind == d.describe()["markov_head_type"]
    sd = d.model.state_dict()
    for k, v in raw.items():
        if k not in ("embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(sd[k], v), k
    d.budget = d.model.num_drafts
    st = prefilled_state(target, PROMPT, d)
    with torch.no_grad():
        tree = d.propose(st)
        toks, confs = _reference_block(raw, target, st.new_features, len(PROMPT),
                                       torch.tensor([st.root_token] + [120] * 5), 0, 6, True, kind=kind)
        plain, _ = _reference_block(raw, target, st.new_features, len(PROMPT),
                                    torch.tensor([st.root_token] + [120] * 5), 0, 6, True)
    assert tree.tokens[1:].tolist() == toks != plain  # the head's type changes the chain
    assert torch.allclose(d.node_survival(tree)[1:].float(), torch.tensor(confs).cumprod(0), atol=1e-5)
    tree_d = Drafter.from_config({"checkpoint": str(folder), "type": "dspark", "proposal": "ddtree", "budget": 10},
                                 target=target)
    ref = hf_greedy(target, PROMPT, 20)
    for drafter in (d, tree_d):
        assert SpeculativeDecoder(target, drafter).generate(PROMPT, max_new_tokens=20).tokens == ref


def test_rnn_tree_scores_every_node_by_its_own_path(tmp_path, one_thread):
    """An RNN head's state carries the whole path, so two nodes with the same token at the same depth may have
    different children: the tree must be the top-budget prefixes of the path-conditional joint, recomputed here
    from the raw tensors by a best-first search over every child of every node."""
    import heapq

    target = tiny_target("qwen3")
    folder, raw = _dspark_folder(tmp_path / "ds", target, "native", kind="rnn", w2_scale=0.5)
    budget = 14
    d = Drafter.from_config({"checkpoint": str(folder), "type": "dspark", "proposal": "ddtree", "budget": budget,
                             "markov_candidates": 0, "marginal_topk": 128}, target=target)
    st = prefilled_state(target, PROMPT, d)
    with torch.no_grad():
        tree = d.propose(st)
        _, h, U = d.block_rows(st)
        U = U.float()
    # best-first over the exact joint: (neg score, path, RNN state after the path's last step)
    heap, best = [(0.0, (), torch.zeros(6))], {}
    while heap and len(best) < budget + 1:
        neg, path, state = heapq.heappop(heap)
        best[path] = -neg
        if len(path) == U.shape[0]:
            continue
        prev = path[-1] if path else st.root_token
        bias, nxt = _markov_step(raw, "rnn", h[len(path)].float(), prev, state)
        lp = torch.log_softmax(U[len(path)] + bias, -1)
        for tok in range(lp.shape[0]):
            heapq.heappush(heap, (neg - float(lp[tok]), path + (tok,), nxt))
    best.pop(())
    assert _paths(tree) == set(best)
    for i in range(1, tree.size):
        p, j = [], i
        while j > 0:
            p, j = [int(tree.tokens[j])] + p, int(tree.parents[j])
        assert float(tree.scores[i]) == pytest.approx(best[tuple(p)], abs=1e-4)


def test_a_bad_markov_head_type_fails_clearly(tmp_path, one_thread):
    target = tiny_target("qwen3")
    folder, _ = _dspark_folder(tmp_path / "ds", target, "native", kind="lstm")
    with pytest.raises(ConfigError, match="markov_head_type 'lstm' is not one of vanilla, gated, rnn"):
        Drafter.from_config(str(folder), target=target)
    d = _drafter(target, markov_head_type="rnn")
    with pytest.raises(ConfigError, match="RNN Markov head needs whole blocks"):
        _bias(d.model, torch.tensor([3, 4, 5]), draft_index=torch.tensor([0, 0, 1]),
              hidden=torch.zeros(3, target.hidden_size))  # rows of different blocks, not one block


def test_round_trip_keeps_alignment_calibration_and_vocab(tmp_path, one_thread):
    target = tiny_target("llama")
    vocab = torch.tensor([1, 4, 9, 16, 25, 36, 49, 64, 81, 100, 120, 127])
    base = D.new_model(target, 2, 8, [0, 2], 120, draft_vocab=vocab)
    model = S.from_dflash(base, markov_rank=4, confidence_head=True)
    with torch.no_grad():
        model.markov_head.markov_w2.weight.normal_()
    model.confidence_temperatures = torch.linspace(0.5, 2.0, 7)
    model.draft_temperatures = torch.linspace(1.0, 3.0, 7)
    S.save_checkpoint(model, tmp_path / "none", dtype=torch.float32, extra={"type": "dspark"})
    assert "sampled_draft_temperatures" not in json.loads((tmp_path / "none" / "config.json").read_text())[
        "dflash_config"]  # absent = sampling trees rank by the greedy fit
    model.sampled_draft_temperatures = torch.linspace(2.0, 4.0, 7)
    S.save_checkpoint(model, tmp_path / "ck", dtype=torch.float32, extra={"type": "dspark"})
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["architectures"] == ["DSparkDraftModel"] and cfg["dflash_config"]["block_alignment"] == "zlab"
    a = S.DSparkDrafter(target, model, proposal="ddtree", budget=10)
    b = Drafter.from_config({"type": "dspark", "checkpoint": str(tmp_path / "ck"), "proposal": "ddtree",
                             "budget": 10}, target=target)
    assert torch.allclose(b.model.confidence_temperatures, model.confidence_temperatures)
    assert torch.allclose(b.model.draft_temperatures, model.draft_temperatures)
    assert torch.allclose(b.model.sampled_draft_temperatures, model.sampled_draft_temperatures)
    assert Drafter.from_config(str(tmp_path / "none"), target=target).model.sampled_draft_temperatures is None
    ta, tb = a.propose(prefilled_state(target, PROMPT, a)), b.propose(prefilled_state(target, PROMPT, b))
    assert torch.equal(ta.tokens, tb.tokens) and torch.equal(ta.parents, tb.parents)
    assert set(tb.tokens[1:].tolist()) <= set(vocab.tolist())
    assert torch.allclose(a.node_survival(ta), b.node_survival(tb))
    assert Drafter.from_config(str(tmp_path / "ck"), target=target).model.alignment == "zlab"


def test_an_uncalibrated_folder_warns_once_and_a_calibrated_one_loads_silently(tmp_path, one_thread):
    """Training marks a folder whose temperatures it reset ("calibration": {"needed": true, ...}); loading one gave
    no sign that its confidences were uncalibrated. It warns once per folder now, naming calibrate.py's command."""
    import warnings

    from graft_block.drafters.dspark.training import calibration_note

    target = tiny_target("llama")
    model = S.from_dflash(D.new_model(target, 1, 6, [1], 120), markov_rank=4, confidence_head=True)
    for name in ("marked", "calibrated", "cleared"):
        S.save_checkpoint(model, tmp_path / name, dtype=torch.float32, extra={"type": "dspark"})
    for name, note in (("marked", calibration_note("runs/x", ["confidence_temperatures"])),
                       ("cleared", {"needed": False})):
        cfg = json.loads((tmp_path / name / "config.json").read_text())
        (tmp_path / name / "config.json").write_text(json.dumps({**cfg, "calibration": note}))
    marked = str(tmp_path / "marked")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Drafter.from_config({"type": "dspark", "checkpoint": marked}, target=target)
        Drafter.from_config(marked, target=target)  # the same folder again, in the other spelling: no second word
        for name in ("calibrated", "cleared"):
            Drafter.from_config(str(tmp_path / name), target=target)
    said = [w for w in caught if "uncalibrated" in str(w.message)]
    assert len(said) == 1 and said[0].category.__name__ == "UncalibratedWarning", [str(w.message) for w in said]
    assert f"{marked} is uncalibrated (continued from runs/x" in str(said[0].message)
    assert f"Calibrate it: python -m graft_block.drafters.dspark.calibrate {marked} --data" in str(said[0].message)


def test_prefetch_must_be_an_int_of_at_least_zero(one_thread):
    """-1 was taken (int(-1)) and made expand() look up a node it had never computed: a KeyError mid-round."""
    target = tiny_target("qwen3")
    for bad in (-1, 1.5, "3"):
        with pytest.raises(ConfigError, match="prefetch .*must be an int >= 0"):
            _drafter(target, prefetch=bad)
    assert _drafter(target, prefetch=0).prefetch == 0


def test_random_init_keeps_the_callers_rng_and_its_heads_are_drawn_as_before(one_thread):
    """new_dspark_model reseeded the global RNG (through new_model); a gated or RNN head's projection is drawn after
    the backbone from the same stream, so a seed still gives the model it gave."""
    from graft_block.drafters.dspark.model import from_dflash

    target = tiny_target("qwen3")
    torch.manual_seed(99)
    before = torch.get_rng_state()
    got = S.new_dspark_model(target, num_layers=1, block_size=6, markov_rank=4, markov_head_type="rnn", seed=2,
                             target_layer_ids=[0, 2])
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(2)  # HEAD's order: the seed, the backbone's draws, then the heads' constructor draws
    base = D.DFlashModel(got.config, 6, [0, 2], target.vocab_size - 1, target.num_layers, None)
    for p in base.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    ref = from_dflash(base, markov_rank=4, confidence_head=True, alignment="zlab", seed=2, markov_head_type="rnn")
    want, have = ref.state_dict(), got.state_dict()
    assert torch.equal(want["markov_head.joint_proj.weight"], have["markov_head.joint_proj.weight"])
    assert all(torch.equal(want[k], have[k]) for k in want if not k.startswith("markov_head.markov_w"))


def test_bad_dspark_folders_fail_clearly(tmp_path):
    target = tiny_target("qwen3")
    cases = [
        (dict(extra={"architectures": ["Gemma4DSparkModel"]}), "Gemma4"),
        (dict(drop=["markov_head.markov_w2.weight"]), "markov_head.markov_w2.weight"),
        (dict(alignment="sideways"), "block_alignment"),
        (dict(with_markov=True, rank=0), "needs a Markov head"),
    ]
    for i, (kw, words) in enumerate(cases):
        folder, _ = _dspark_folder(tmp_path / f"b{i}", target, "native", **kw)
        with pytest.raises(ConfigError, match=words):
            Drafter.from_config(str(folder), target=target)
    folder, _ = _dspark_folder(tmp_path / "nr", target, "native")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["markov_rank"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="markov_rank"):
        Drafter.from_config(str(folder), target=target)
    folder, _ = _dspark_folder(tmp_path / "al", target, "export")
    with pytest.raises(ConfigError, match="trained with 'deepspec'"):
        Drafter.from_config({"type": "dspark", "checkpoint": str(folder), "alignment": "zlab"}, target=target)
    folder, _ = _dspark_folder(tmp_path / "t", target, "export", extra=None)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dflash_config"]["confidence_temperatures"] = [1.0, 2.0]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="confidence_temperatures has 2 entries"):
        Drafter.from_config(str(folder), target=target)
    cfg["dflash_config"]["confidence_temperatures"] = [1.0] * 6
    cfg["dflash_config"]["draft_temperatures"] = [1.0] * 5 + [-1.0]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="draft_temperatures must be positive"):
        Drafter.from_config(str(folder), target=target)
    cfg["dflash_config"]["draft_temperatures"] = "hot"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="draft_temperatures must be a list of 6 positive numbers.*'hot'"):
        Drafter.from_config(str(folder), target=target)
    del cfg["dflash_config"]["draft_temperatures"]
    # a string flag would read as true (bool("false")), a string rank as a bare ValueError: both are named
    for key, value, words in (("enable_confidence_head", "false", "enable_confidence_head must be true or false"),
                              ("confidence_head_with_markov", 1, "confidence_head_with_markov must be true or"),
                              ("markov_rank", "8", "markov_rank must be an int >= 0.*'8'")):
        (folder / "config.json").write_text(json.dumps({**cfg, "dflash_config": {**cfg["dflash_config"],
                                                                                 key: value}}))
        with pytest.raises(ConfigError, match=words):
            Drafter.from_config(str(folder), target=target)
    with pytest.raises(ConfigError, match="at most 7 nodes"):
        _drafter(target, proposal="chain", budget=8)
    assert _drafter(target, proposal="chain", budget=8, alignment="deepspec").budget == 8


# ---- sampling: the exact law -----------------------------------------------------------------------------
def _law(dec, target, prompt, n, seed=123):
    """n T=1 samples of 3 new tokens: a first round that accepts no draft is followed by a second whose tree the
    drafter builds from the state the first left, so that carried state is law-tested too. Returns (counts, drafted
    nodes accepted by first rounds, by second rounds)."""
    gen = torch.Generator().manual_seed(seed)
    counts, first_accepted, second_accepted = Counter(), 0, 0
    for _ in range(n):
        r = dec.generate(prompt, max_new_tokens=3, temperature=1.0, generator=gen)
        counts[tuple(r.tokens)] += 1
        accepted = sum(k * c for k, c in r.stats.accept_hist.items())
        # one round emits 3 tokens only by accepting a draft; two rounds mean the first accepted none
        if r.stats.rounds == 1:
            first_accepted += accepted
        else:
            second_accepted += accepted
    return counts, first_accepted, second_accepted


def test_a_draft_sized_by_the_schedule_is_the_markov_tree_of_that_budget_and_block(tiny_qwen3):
    """``state.draft_nodes`` = 4 on a budget-9 DSpark tree over a block of 8: the tree (and its head's survivals)
    is the one a drafter built with budget 4 and the block a 4-node tree can reach proposes."""
    from graft_block.drafters.dspark.drafter import DSparkDrafter

    d = _drafter(tiny_qwen3, proposal="ddtree", budget=9)
    st = prefilled_state(tiny_qwen3, PROMPT, d)
    st.draft_nodes = 4
    with torch.no_grad():
        sized = d.propose(st)
        s1 = d.node_survival(sized)
        ref_d = DSparkDrafter(tiny_qwen3, d.model, proposal="ddtree", budget=4, block_size=4 + d.offset)
        ref = ref_d.propose(prefilled_state(tiny_qwen3, PROMPT, ref_d))
    assert sized.size == 5
    assert torch.equal(sized.tokens, ref.tokens) and torch.equal(sized.parents, ref.parents)
    assert (s1 is None) == (ref_d.node_survival(ref) is None)
    if s1 is not None:
        assert torch.allclose(s1, ref_d.node_survival(ref))


def _expected_accepts(d, target, prompt, sched=None) -> tuple[float, float]:
    """Exact mean and variance of the drafted nodes accepted in the one round of a 2-token call at T=1: for each
    first token, the tree the drafter proposes (cut by a fresh ``sched`` as a call's first round is), and each
    node's path probability under the target (accepted depth k counts k; depth <= 2 here)."""
    from graft_block.decoder import DecodeState

    exact = exact_sequence_probs(target, prompt, 3, SamplingConfig(1.0))
    path_p = lambda path: sum(p for k, p in exact.items() if k[: len(path)] == path)  # noqa: E731
    m1 = m2 = 0.0
    for t1 in range(target.vocab_size):
        target.set_feature_layers(d.feature_layers)
        _, feats = target.prefill(torch.as_tensor(prompt))
        st = DecodeState(target, SamplingConfig(1.0), None, list(prompt) + [t1], len(prompt))
        st.new_features, st.new_features_start = feats, 0
        d.prefill(st)
        with torch.no_grad():
            tree = d.propose(st)
        tree = tree if sched is None else sched.apply(tree, st, d)
        toks, pars, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
        for i in range(1, len(toks)):
            path, j = [toks[i]], pars[i]
            while j > 0:
                path, j = [toks[j]] + path, pars[j]
            p = path_p(tuple([t1] + path))
            m1 += p  # E[X] = sum over depths k of P(depth k reached)
            m2 += (2 * depths[i] - 1) * p  # E[X^2] = sum_k (2k - 1) P(depth k reached)
    return m1, m2 - m1 * m1


@pytest.mark.parametrize("proposal,budget,scheduled,candidates,first,kind", [
    ("chain", 2, False, 64, True, "vanilla"), ("ddtree", 4, False, 64, True, "vanilla"),
    ("ddtree", 6, True, 64, True, "vanilla"), ("ddtree", 4, False, 2, True, "vanilla"),
    ("ddtree", 4, False, 64, False, "vanilla"), ("ddtree", 4, False, 64, True, "gated"),
    ("ddtree", 6, True, 64, False, "rnn"), ("ddtree", 6, True, 2, False, "vanilla")])
def test_sampling_matches_target_distribution(proposal, budget, scheduled, candidates, first, kind, one_thread,
                                              monkeypatch):
    """T=1 on a 4-token vocabulary: the joint law of 3 new tokens under DSpark (chain, Markov tree, the tree cut by
    its confidence head every round, children ranked among 2 candidate tokens, no bias on the first draft, gated
    and RNN heads; a vanilla head with a candidate cut walks its trees in C) equals the target's exact law
    (chi-square and TV), with drafted nodes accepted in first rounds as often as the law says and in second rounds
    too (state carried over a round); the T=0.8 law is rejected."""
    from graft_block.drafters.dspark import c_walk
    from graft_block.schedule import ConfidenceSchedule

    walked = []
    monkeypatch.setattr(c_walk, "markov_tree", lambda *a, _f=c_walk.markov_tree: walked.append(1) or _f(*a))
    V = 4
    target = tiny_target("llama", vocab_size=V, hidden_size=32, num_layers=2)
    d = _drafter(target, proposal=proposal, budget=budget, block_size=3, mask_token_id=V - 1, target_layer_ids=[0, 1],
                 markov_rank=4, markov_candidates=candidates, markov_first_draft=first, markov_head_type=kind)
    prompt = [1, 3, 2]
    exact = exact_sequence_probs(target, prompt, 3, SamplingConfig(1.0))
    n = 800
    sched = ConfidenceSchedule(lambda k: 1.0 + 0.3 * k) if scheduled else None
    counts, accepted, second_accepted = _law(SpeculativeDecoder(target, d, schedule=sched), target, prompt, n)
    if scheduled:  # the head's survivals cut the trees, and not to the root
        s = sched.summary()
        assert s["survival_source"] == {"drafter": s["rounds"]} and 1 <= s["mean_nodes_kept"] < s["mean_nodes_in"]
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in exact.items())
    stat, dof, p = chi_square_test(counts, exact)
    assert tv < null_tv_quantile(exact, n) and p > 1e-3, (tv, stat, dof, p)
    # drafted nodes were accepted as often as the target's law says they are: within 4 sd of the exact expectation
    mean, var = _expected_accepts(d, target, prompt, ConfidenceSchedule(lambda k: 1.0 + 0.3 * k) if scheduled else None)
    assert mean > 0.05 and abs(accepted - n * mean) < 4 * math.sqrt(n * var), (accepted, n * mean, n * var)
    assert second_accepted > n // 20, second_accepted
    assert chi_square_test(counts, exact_sequence_probs(target, prompt, 3, SamplingConfig(0.8)))[2] < 1e-3
    # which walk built the trees: C for a vanilla head with a candidate cut (where it is built), else Python
    assert bool(walked) == (kind == "vanilla" and candidates < V and d._w1.device.type == "cpu"
                            and c_walk.available() and os.environ.get("GRAFT_BLOCK_C_WALK") != "0")


# ---- training ----------------------------------------------------------------------------------------------
def _batch(target, model, n=3, L=24, plen=6):
    """Greedy continuations of random prompts with the target's features and top-4 distributions."""
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.cat([p, torch.tensor(hf_greedy(target, p.tolist(), L - plen))])
                       for p in torch.randint(3, 120, (n, plen), generator=g)])
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i] for i in model.feature_layers], -1)
    top = torch.log_softmax(out.logits.float(), -1).topk(4, -1)
    return {"ids": ids, "labels": ids, "feats": feats, "top_ids": top.indices, "top_logp": top.values,
            "lengths": torch.full((n,), L), "prompt_len": torch.full((n,), plen)}


def _train_steps(target, model, steps: int) -> dict:
    """``steps`` AdamW steps of the DSpark loss on one ``_batch``; returns the batch."""
    batch = _batch(target, model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(steps):
        batch["generator"] = torch.Generator().manual_seed(step)
        loss, _ = S.DSparkDrafter.training_loss(model, target, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return batch


def test_training_loss_learns_and_packs_unique_anchors(one_thread):
    target = tiny_target("llama")
    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "mask_token_id": 127, "block_size": 5, "num_anchors": 64,
           "markov_rank": 8, "anchor_chunk": 5}
    model = S.DSparkDrafter.training_model(target, cfg, "random")
    batch = _batch(target, model)
    blk = D.make_blocks(model, batch)
    # 64 > the 17 valid anchors per sequence: each valid one exactly once, and no padding anchor is run
    assert blk["anchors"].shape == (3, 17)
    for i in range(3):
        a = blk["anchors"][i][blk["anchor_ok"][i]].tolist()
        assert sorted(a) == list(range(6, 23)) and int(blk["anchor_ok"][i].sum()) == 17
    # the Markov head is teacher-forced: each row's previous token is the true one (the anchor for row 0)
    lab, prev = blk["labels"][blk["valid"]], blk["prev"][blk["valid"]]
    ids = batch["ids"][0]
    a0 = int(blk["anchors"][0][blk["anchor_ok"][0]][0])
    assert blk["prev"][0, 0, 0] == ids[a0] and blk["labels"][0, 0, 0] == ids[a0 + 1]
    assert blk["prev"][0, 0, 1] == ids[a0 + 1]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for step in range(40):
        batch["generator"] = torch.Generator().manual_seed(step)
        loss, m = S.DSparkDrafter.training_loss(model, target, batch)
        first = first or m
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert m["loss"] < first["loss"] - 0.3 and m["tau_exp"] > first["tau_exp"] and "conf_bce" in m
    assert 1.0 <= m["tau_tf"] <= 5.0 and m["rows"] > 0
    assert model.markov_head.markov_w2.weight.abs().sum() > 0  # the head learned (it started at W2 = 0)


def test_frozen_backbone_trains_the_heads_only_and_the_greedy_label_is_argmax_acceptance(one_thread):
    """freeze_backbone: a step moves the Markov and confidence heads and no backbone tensor; the "greedy" confidence
    label is 1 exactly where the row's Markov-corrected argmax is the target's token."""
    target = tiny_target("llama")
    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "mask_token_id": 127, "block_size": 5, "num_anchors": 8,
           "markov_rank": 4, "freeze_backbone": True, "confidence_label": "greedy"}
    model = S.DSparkDrafter.training_model(target, cfg, "random")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("markov_head.", "confidence_head.")) for n in trainable)
    batch = _train_steps(target, model, 2)
    after = model.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(k.startswith(("markov_head.", "confidence_head.")) for k in moved)
    batch["generator"] = torch.Generator().manual_seed(5)
    _, _, rows = D.recipe_loss(model, target, batch,
                               lambda h, prev, j, ok: S.training.draft_logits(model, target, h, prev, j, valid=ok))
    batch["generator"] = torch.Generator().manual_seed(5)
    blk = D.make_blocks(model, batch)
    j = torch.arange(blk["valid"].shape[-1]).expand_as(blk["valid"])[blk["valid"]]
    logits = S.training.draft_logits(model, target, D.draft_rows(model, target, batch, blk)[blk["valid"]],
                                     blk["prev"][blk["valid"]], j)
    want = (model.to_vocab_ids(logits.argmax(-1)) == blk["labels"][blk["valid"]]).float()
    assert rows["correct"].shape == want.shape and torch.equal(rows["correct"], want)
    with pytest.raises(ConfigError, match="confidence_label"):
        S.DSparkDrafter.training_model(target, dict(cfg, confidence_label="argmax"), "random")
    with pytest.raises(ConfigError, match="nothing to train"):
        S.DSparkDrafter.training_model(target, dict(cfg, markov_rank=0, confidence_head=False), "random")


def test_embedding_basis_trains_two_small_matrices_and_saves_the_tables_it_implies(one_thread, tmp_path):
    """markov_basis "embedding": only A, B [H, r] train (W1 = E A, W2 = E B on the target's embedding E); the
    saved folder holds DeepSpec's tables, and the loaded drafter's logits equal the training model's."""
    target = tiny_target("llama")
    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "mask_token_id": 127, "block_size": 5, "num_anchors": 8,
           "markov_rank": 4, "freeze_backbone": True, "markov_basis": "embedding"}
    model = S.DSparkDrafter.training_model(target, cfg, "random")
    trainable = {n: p.shape for n, p in model.named_parameters() if p.requires_grad}
    H = target.model.config.hidden_size
    assert {k: tuple(v) for k, v in trainable.items() if k.startswith("markov_head.")} == {
        "markov_head.a": (H, 4), "markov_head.b": (H, 4)}
    _train_steps(target, model, 2)
    assert float(model.markov_head.b.detach().abs().sum()) > 0  # W2 left 0: the bias moved
    S.DSparkDrafter.save_trained(model, tmp_path / "ck", cfg)
    loaded = S.load_checkpoint(tmp_path / "ck", dtype=torch.float32)
    E = target.model.get_input_embeddings().weight.float()
    w1 = loaded.markov_head.markov_w1.weight
    assert torch.allclose(w1, (E @ model.markov_head.a).half().float(), atol=1e-6)
    prev = torch.tensor([3, 7, 7, 50])
    want = _bias(model, prev, model.draft_vocab)
    assert torch.allclose(_bias(loaded, prev, loaded.draft_vocab), want, atol=2e-3 * float(want.abs().max()))
    with pytest.raises(ConfigError, match="markov_basis"):
        S.DSparkDrafter.training_model(target, dict(cfg, markov_basis="rows"), "random")


@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_gated_and_rnn_heads_train_on_whole_blocks_and_save_what_they_draft(kind, one_thread, tmp_path):
    """Heads only, embedding basis: step 0 drafts as the backbone (W2 = 0), the loss falls, the RNN's
    teacher-forced latents equal a step-by-step unroll, and the saved tables + projection give the same bias."""
    target = tiny_target("llama")
    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "mask_token_id": 127, "block_size": 5, "num_anchors": 16,
           "markov_rank": 4, "freeze_backbone": True, "markov_basis": "embedding", "markov_head_type": kind}
    model = S.DSparkDrafter.training_model(target, cfg, "random")
    head = model.markov_head
    proj = "gate_proj" if kind == "gated" else "joint_proj"
    assert head.kind == kind and any(n.startswith(f"markov_head.{proj}.") for n, p in model.named_parameters()
                                     if p.requires_grad)
    H = target.model.config.hidden_size
    prev, hid, rows = torch.randint(0, 128, (2, 4)), torch.randn(2, 4, H), torch.arange(4).expand(2, 4)
    assert float(_bias(model, prev, None, rows, hid).detach().abs().max()) == 0.0  # W2 = 0 at the start
    batch = _batch(target, model)
    batch["generator"] = torch.Generator().manual_seed(0)
    first = float(S.DSparkDrafter.training_loss(model, target, batch)[0])
    _train_steps(target, model, 12)
    batch["generator"] = torch.Generator().manual_seed(0)
    assert float(S.DSparkDrafter.training_loss(model, target, batch)[0]) < first
    with torch.no_grad():
        lat = head.block_latents(prev, hid)
        state = None
        for j in range(4):  # the RNN's state runs along the block; the gated head is row by row
            step, state = head.latent(head.prev_embed(prev[:, j]), head.hidden_terms(hid[:, j]), state)
            assert torch.allclose(lat[:, j], step, atol=1e-6)
        if kind == "rnn":
            alone = head.latent(head.prev_embed(prev[:, 2]), head.hidden_terms(hid[:, 2]))[0]  # no rows 0-1
            assert not torch.allclose(alone, lat[:, 2], atol=1e-4)
    S.DSparkDrafter.save_trained(model, tmp_path / "ck", cfg)
    loaded = S.load_checkpoint(tmp_path / "ck", dtype=torch.float32)
    assert loaded.markov_head_type == kind
    with torch.no_grad():
        want = _bias(model, prev, model.draft_vocab, rows, hid)
        got = _bias(loaded, prev, loaded.draft_vocab, rows, hid)
    assert torch.allclose(got, want, atol=3e-3 * float(want.abs().max()))
    with pytest.raises(ConfigError, match="has a 'rnn' Markov head|has a 'gated' Markov head"):
        S.DSparkDrafter.training_model(target, dict(cfg, markov_head_type="vanilla", markov_basis="table"),
                                       str(tmp_path / "ck"))


def test_training_follows_the_configured_alignment(one_thread, tmp_path):
    """DeepSpec's alignment trains the anchor row too (B drafts a block, z-lab's B - 1), each draft j labelled with
    the token at anchor + j + 1 either way; the saved folder says which, and a DSpark init keeps its own."""
    target = tiny_target("llama")
    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "mask_token_id": 127, "block_size": 5, "num_anchors": 4,
           "markov_rank": 4}
    for alignment, drafts in (("zlab", 4), ("deepspec", 5)):
        model = S.DSparkDrafter.training_model(target, dict(cfg, alignment=alignment), "random")
        assert model.alignment == alignment and model.draft_offset == 5 - drafts
        batch = _batch(target, model)
        blk = D.make_blocks(model, batch)
        assert blk["labels"].shape[-1] == drafts
        a0 = int(blk["anchors"][0][blk["anchor_ok"][0]][0])
        assert blk["labels"][0, 0, :3].tolist() == batch["ids"][0, a0 + 1: a0 + 4].tolist()
        loss, m = S.DSparkDrafter.training_loss(model, target, batch)
        assert torch.isfinite(loss) and m["rows"] > 0
    S.DSparkDrafter.save_trained(model, tmp_path / "ds", dict(cfg, alignment="deepspec"))
    assert json.loads((tmp_path / "ds" / "config.json").read_text())["dflash_config"]["block_alignment"] == "deepspec"
    assert S.DSparkDrafter.training_model(target, {}, str(tmp_path / "ds")).alignment == "deepspec"
    with pytest.raises(ConfigError, match="keeps its alignment"):
        S.DSparkDrafter.training_model(target, {"alignment": "zlab"}, str(tmp_path / "ds"))
    # --init takes a bundled short name, as DFlash's does (it read "<name>/config.json" relative to the cwd)
    import graft_block.drafter as registry

    registry._CHECKPOINT_ROOTS.append(tmp_path)
    try:
        assert S.DSparkDrafter.training_model(target, {}, "ds").alignment == "deepspec"
    finally:
        registry._CHECKPOINT_ROOTS.remove(tmp_path)


def test_chunked_anchors_equal_one_packed_forward(one_thread):
    """Blocks see only their own rows and earlier context, so chunking the anchors leaves the loss unchanged."""
    target = tiny_target("llama")
    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "mask_token_id": 127, "block_size": 4, "num_anchors": 12,
           "markov_rank": 4}
    model = S.DSparkDrafter.training_model(target, dict(cfg, anchor_chunk=100), "random")
    batch = _batch(target, model)
    batch["generator"] = torch.Generator().manual_seed(0)
    whole, _ = S.DSparkDrafter.training_loss(model, target, batch)
    model.train_opts["anchor_chunk"] = 5
    batch["generator"] = torch.Generator().manual_seed(0)
    parts, _ = S.DSparkDrafter.training_loss(model, target, batch)
    assert torch.allclose(whole, parts, atol=1e-5)


def test_tempered_candidates_keep_their_mass_share_and_order():
    from graft_block.drafters.dspark.drafter import candidate_logprobs

    def tempered_candidates(z, rest, t):  # no Markov bias, greedy: the draft temperature alone
        return candidate_logprobs(z, torch.zeros_like(z), rest, 0.0, t)

    g = torch.Generator().manual_seed(0)
    z, rest = torch.randn(3, 8, generator=g) * 3, torch.randn(3, 1, generator=g)
    plain = tempered_candidates(z, rest, 1.0)
    assert torch.allclose(plain, z - torch.logaddexp(torch.logsumexp(z, -1, keepdim=True), rest))
    for t in (0.5, 2.0):
        hot = tempered_candidates(z, rest, t)
        assert torch.allclose(torch.logsumexp(hot, -1), torch.logsumexp(plain, -1), atol=1e-6)  # same share
        assert torch.equal(hot.argsort(-1), plain.argsort(-1))  # same order within a node's children
        top = (hot.max(-1).values - torch.logsumexp(hot, -1)).exp()
        assert bool(((top < (plain.max(-1).values - torch.logsumexp(plain, -1)).exp()) == (t > 1)).all())


def test_draft_temperatures_are_the_least_nll_grid_points():
    """fit_draft_temperatures: per position the grid temperature of least summed NLL; a position with too few
    rows keeps the previous position's temperature (1.0 at the first)."""
    from graft_block.drafters.dspark.calibrate import TEMP_GRID, fit_draft_temperatures

    assert 1.0 in TEMP_GRID and TEMP_GRID == tuple(sorted(TEMP_GRID))
    best = [TEMP_GRID.index(1.0), TEMP_GRID.index(1.0) + 5, 3]
    nll = torch.stack([(torch.arange(len(TEMP_GRID), dtype=torch.float64) - b) ** 2 for b in best])
    assert fit_draft_temperatures(nll, torch.tensor([100, 100, 100]), min_rows=30) == [TEMP_GRID[b] for b in best]
    assert fit_draft_temperatures(nll, torch.tensor([5, 100, 5]), min_rows=30) == [1.0, TEMP_GRID[best[1]],
                                                                                  TEMP_GRID[best[1]]]


def test_sampling_trees_rank_by_the_sampled_fit(one_thread):
    """A tree drafted while the target samples ranks by ``sampled_draft_temperatures``; a greedy one by
    ``draft_temperatures``: each equals the tree of a twin whose only temperatures are those."""
    target = tiny_target("qwen3")
    sharp, flat = torch.full((7,), 0.5), torch.full((7,), 3.0)

    def tree(draft, sampled, temperature):
        d = _drafter(target, proposal="ddtree", budget=12)
        d.model.draft_temperatures, d.model.sampled_draft_temperatures = draft, sampled
        st = prefilled_state(target, PROMPT, d)
        st.sampling = SamplingConfig(temperature=temperature)
        return _paths(d.propose(st))

    for temperature in (0.0, 1.0):
        assert tree(sharp, None, temperature) != tree(flat, None, temperature)  # the temperatures shape the tree
    assert tree(sharp, flat, 1.0) == tree(flat, None, 1.0)
    assert tree(sharp, flat, 0.0) == tree(sharp, None, 0.0)


def test_sampled_draft_temperatures_recover_a_planted_sharpening(one_thread, monkeypatch):
    """A draft whose logits are twice the target's log-probabilities is the target's law at draft temperature 2,
    whatever temperature the target samples at (the fit reads the draft at 1/T, as a sampling tree does)."""
    import graft_block.drafters.dflash.training as DT
    from graft_block.drafters.dspark.calibrate import draft_nll_table, fit_draft_temperatures

    target = tiny_target("llama")
    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "mask_token_id": 127, "block_size": 5, "markov_rank": 4}
    model = S.DSparkDrafter.training_model(target, cfg, "random")
    model.markov_head.markov_w2.weight.data.zero_()
    b = _batch(target, model)
    recs = [{"ids": b["ids"][i], "feats": b["feats"][i], "top_ids": b["top_ids"][i], "top_logp": b["top_logp"][i],
             "prompt_len": 6} for i in range(3)]

    def planted_rows(m, tgt, batch, blk, chunk=32):  # "hidden" = the planted logits; model.logits passes them on
        with torch.no_grad():
            full = torch.log_softmax(tgt.model(input_ids=batch["ids"]).logits.float(), -1).flatten(0, 1)
        return 2.0 * full[blk["src"]]

    monkeypatch.setattr(DT, "draft_rows", planted_rows)
    monkeypatch.setattr(model, "logits", lambda h, w, b=None, **k: h)
    V = target.vocab_size
    for sampled in (1.0, 0.5):
        nll, rows = draft_nll_table(model, target, recs, candidates=V, anchors=8, sampled=sampled)
        assert rows.min() > 0
        assert all(1.9 < t < 2.1 for t in fit_draft_temperatures(nll, rows, min_rows=1))
    greedy, rows = draft_nll_table(model, target, recs, candidates=V, anchors=8)
    assert all(t < 1.9 for t in fit_draft_temperatures(greedy, rows, min_rows=1))  # argmax labels: sharper


def test_calibration_reports_on_held_out_sequences_that_share_nothing_with_its_fit_half(monkeypatch):
    """The held-out sequences split into a fit half and a report half; a report sequence that repeats a fit
    sequence's answer (a canned reply) or prompt (another future of it) would report the error on what was fitted,
    so it is left out of the report, as split_holdout leaves such copies out of training."""
    import types

    import graft_block.drafters.dspark.calibrate as C
    import graft_block.drafters.dspark.checkpoint as CK
    import graft_block.train_data as TD
    import graft_block.training  # noqa: F401 - first imported under the patch, it would keep the fake load_records

    def rec(prompt, answer):
        return {"ids": torch.tensor(prompt + answer), "prompt_len": len(prompt)}

    recs = [rec([1, i], [50 + i, 60 + i]) for i in range(12)]
    # split_holdout(recs, 6) holds 0, 2, 4, 7, 9, 11 out; the fit half is 0, 4, 9 and the report half 2, 7, 11
    recs[2] = rec([1, 2], [50, 60])  # recs[0]'s answer to another prompt
    recs[7] = rec([1, 4], [90, 91])  # another answer to recs[4]'s prompt
    seen = []

    def fitted(model, target, fit, test, min_rows, sampled=0.0):
        seen.append((fit, test))
        return [1.0], torch.ones(1), torch.zeros(1, len(C.TEMP_GRID))

    model = types.SimpleNamespace(feature_layers=(0,), confidence_head=None)
    monkeypatch.setattr(CK, "load_checkpoint", lambda *a, **k: model)
    monkeypatch.setattr(TD, "load_records", lambda data, layers: (recs, None))
    monkeypatch.setattr(C, "fitted_draft_temperatures", fitted)
    C.calibrate("folder", "data", holdout=6, target=types.SimpleNamespace(device="cpu"), write=False, sampled_at=0)
    (fit, test), = seen
    assert [r["ids"].tolist() for r in fit] == [recs[i]["ids"].tolist() for i in (0, 4, 9)]
    assert [r["ids"].tolist() for r in test] == [recs[11]["ids"].tolist()]
    recs[11] = rec([1, 9], [70])  # every report sequence repeats a fit one: nothing left to report on
    with pytest.raises(ConfigError, match="report half"):
        C.calibrate("folder", "data", holdout=6, target=types.SimpleNamespace(device="cpu"), write=False,
                    sampled_at=0)


def _calibration_records():
    """A tiny target, a random DSpark training model on it and three of its teacher-forced records."""
    target = tiny_target("llama")
    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "mask_token_id": 127, "block_size": 5, "markov_rank": 4}
    model = S.DSparkDrafter.training_model(target, cfg, "random")
    b = _batch(target, model)
    recs = [{"ids": b["ids"][i], "feats": b["feats"][i], "top_ids": b["top_ids"][i], "top_logp": b["top_logp"][i],
             "prompt_len": 6} for i in range(3)]
    return target, model, recs


def _record_block_labels(monkeypatch):
    """Make the training blocks also store their valid anchors' labels on the model (``m._labels``), so that a
    test's planted logits can name the right (or a wrong) token at every draft position."""
    import graft_block.drafters.dflash.training as DT

    real = DT.make_blocks

    def with_labels(m, batch, *a, **k):
        blk = real(m, batch, *a, **k)
        m._labels = blk["labels"][blk["anchor_ok"]]
        return blk

    monkeypatch.setattr(DT, "make_blocks", with_labels)


def test_acceptance_table_counts_a_position_only_after_accepted_ones(one_thread, monkeypatch):
    """The calibration table: accepted = the Markov-corrected argmax equals the target's token; position k is
    valid only when every earlier draft was accepted; a planted perfect head is accepted everywhere."""
    from graft_block.drafters.dspark.calibrate import acceptance_table, calibration_report

    target, model, recs = _calibration_records()
    logits, acc, valid, exists = acceptance_table(model, target, recs, anchors=8)
    assert logits.shape == acc.shape == valid.shape == (24, 4)
    assert torch.equal(valid[:, 0], exists[:, 0])
    assert torch.equal(valid[:, 1:], exists[:, 1:] & acc[:, :-1].cumprod(1).bool())
    rep = calibration_report(logits, acc, valid, exists, torch.ones(4))
    assert rep["ece_before"] == pytest.approx(rep["ece_after"]) and rep["rows"] == 24
    # a head that knows the answer: every existing position is accepted and valid
    W = target.model.get_output_embeddings().weight
    model.markov_head.markov_w2.weight.data.zero_()
    orig = model.logits
    model.logits = lambda h, w, b=None, restricted=False: orig(h, w, b) * 0 + F.one_hot(
        model._labels, W.shape[0]).float() * 50
    _record_block_labels(monkeypatch)
    _, acc2, valid2, exists2 = acceptance_table(model, target, recs, anchors=8)
    assert torch.equal(acc2, exists2) and torch.equal(valid2, exists2)


def test_dspark_tree_composes_with_graft_losslessly(one_thread):
    """prune -> retrieve -> splice over a Markov-corrected tree, then the confidence schedule: greedy-identical, with
    retrieved nodes verified and accepted."""
    from graft_block.adjacency import AdjacencyMatrix
    from graft_block.graft import Graft
    from graft_block.schedule import ConfidenceSchedule

    target = tiny_target("qwen3")
    ref = hf_greedy(target, PROMPT, 32)
    d = _drafter(target, proposal="ddtree", budget=12)
    graft = Graft.from_config({"mode": "graft"}, matrix=AdjacencyMatrix(target.vocab_size, 4, "int32", "cpu"),
                              target=target, drafter=d)
    sched = ConfidenceSchedule(lambda n: 1.0 + 0.05 * n)
    res = SpeculativeDecoder(target, d, graft=graft, schedule=sched).generate(PROMPT, max_new_tokens=32)
    assert res.tokens == ref and sched.summary()["rounds"] == res.stats.rounds
    # the matrix, empty at first, fills from verified rounds: retrieved nodes reach the verified trees and some are
    # accepted, so the identity covers walks through grafted nodes that the schedule kept
    assert graft.summary()["mean_retrieved_nodes"] > 0 and res.stats.retrieved_nodes > 0
    assert res.stats.retrieved_accepted > 0


# ---- the bundled drafter on the real target ---------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name,cases", [
    ("dspark-smollm2", (("chain", 15, None), ("ddtree", 16, None), ("ddtree", 16, "curve"), ("ddtree", 16, "graft"))),
    ("dspark-rnn-smollm2", (("chain", 15, None), ("ddtree", 16, None)))])
def test_smollm2_bundled_dspark_lossless(smollm2, name, cases):
    """The bundled DSpark drafters on SmolLM2: chain, Markov tree, the scheduled tree and the grafted tree
    (dspark_graft; the RNN head: chain and tree) equal HF greedy token for token, with drafts accepted on a code
    prompt."""
    from graft_block.adjacency import AdjacencyMatrix
    from graft_block.drafter import bundled_checkpoint
    from graft_block.graft import Graft
    from graft_block.schedule import ConfidenceSchedule

    folder = bundled_checkpoint(name)
    if folder is None:
        pytest.skip(f"drafters/checkpoints/{name} is not present")
    prompt = smollm2.encode([{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci "
                                                         "number."}]).tolist()
    n = 40
    ref = hf_greedy(smollm2, prompt, n)
    for proposal, budget, sched in cases:
        d = Drafter.from_config({"type": "dspark", "checkpoint": str(folder), "proposal": proposal, "budget": budget},
                                target=smollm2)
        schedule = ConfidenceSchedule(lambda k: 0.03 + 0.002 * k) if sched == "curve" else None
        graft = None if sched != "graft" else Graft.from_config(
            {"mode": "graft"}, matrix=AdjacencyMatrix(smollm2.vocab_size, 8, "int32", "cpu"), target=smollm2, drafter=d)
        res = SpeculativeDecoder(smollm2, d, schedule=schedule, graft=graft).generate(prompt, max_new_tokens=n)
        assert res.tokens == ref, (proposal, sched)
        assert res.stats.tau > 1.0, (proposal, sched)
        if schedule is not None:
            assert schedule.summary()["survival_source"] == {"drafter": res.stats.rounds}
        if graft is not None:  # retrieved nodes were spliced into the verified trees
            assert graft.summary()["mean_retrieved_nodes"] > 0


def test_one_recipe_dspark_without_heads_is_dflash(one_thread):
    """DFlash, DSpark and MFD share the block recipe: DSpark with no heads and DFlash, given the same recipe
    options, compute the same loss and metrics (one code path, whatever the weights)."""
    target = tiny_target("llama")
    recipe = {"num_anchors": 6, "unique_anchors": True, "gamma": 3.0, "ce_weight": 0.3, "soft_weight": 0.2,
              "l1_weight": 0.7, "anchor_chunk": 4}
    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "mask_token_id": 127, "block_size": 5, **recipe}
    dmodel = D.training_model(target, dict(cfg), "random")
    smodel = S.DSparkDrafter.training_model(target, dict(cfg, markov_rank=0, confidence_head=False), "random")
    smodel.load_state_dict(dmodel.state_dict(), strict=False)
    assert {k: smodel.train_opts[k] for k in D.RECIPE_KEYS} == {k: dmodel.train_opts[k] for k in D.RECIPE_KEYS}
    batch = _batch(target, dmodel)
    batch["generator"] = torch.Generator().manual_seed(3)
    ld, md = D.training_loss(dmodel, target, batch)
    batch["generator"] = torch.Generator().manual_seed(3)
    ls, ms = S.DSparkDrafter.training_loss(smodel, target, batch)
    assert torch.allclose(ld, ls, atol=1e-6) and md["tau_exp"] == pytest.approx(ms["tau_exp"])
    assert md["tau_tf"] == pytest.approx(ms["tau_tf"]) and md["l1"] == pytest.approx(ms["l1"])
    # the loss is the weighted mix: l1_weight 0 drops exactly the L1 term
    dmodel.train_opts["l1_weight"] = 0.0
    batch["generator"] = torch.Generator().manual_seed(3)
    l0, m0 = D.training_loss(dmodel, target, batch)
    assert float(ld.detach()) == pytest.approx(float(l0.detach()) + 0.7 * md["l1"], rel=1e-5)
    # held-out evaluation uses eval_anchors unique anchors whatever the training count
    dmodel.eval()
    blk = D.training_blocks(dmodel, batch)
    assert blk["anchors"].shape[1] == 17 and bool(blk["anchor_ok"].all())


@pytest.mark.parametrize("bad, word", [({"num_anchors": 0}, "num_anchors"), ({"l1_weight": -1}, "l1_weight"),
                                       ({"ce_weight": 0, "l1_weight": 0}, "both 0"),
                                       ({"eval_anchors": 2.5}, "eval_anchors"), ({"gamma": 0}, "gamma"),
                                       ({"gamma": -2.0}, "gamma"), ({"gamma": "7"}, "gamma")])
def test_bad_recipe_options_fail_clearly(bad, word):
    with pytest.raises(ConfigError, match=word):
        D.block_loss_opts(bad, 16)


def test_row_weights_default_to_gamma_2_and_null_gives_the_papers():
    # gamma 2 puts 39% of a 16-row block's weight on the first draft; the paper's 7 (null) puts 15%
    assert D.block_loss_opts({}, 16)["gamma"] == 2.0
    assert D.block_loss_opts({"gamma": None}, 16)["gamma"] == 7.0
    assert D.block_loss_opts({"gamma": None}, 8)["gamma"] == 4.0
    w = D.row_weights(15, D.block_loss_opts({}, 16)["gamma"], "cpu")
    assert float(w[0] / w.sum()) == pytest.approx(0.394, abs=1e-3)


def test_l1_recipe_without_cached_topk_fails_clearly(one_thread):
    target = tiny_target("llama")
    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "mask_token_id": 127, "block_size": 5, "l1_weight": 0.5}
    model = D.training_model(target, cfg, "random")
    batch = {k: v for k, v in _batch(target, model).items() if k not in ("top_ids", "top_logp")}
    with pytest.raises(ConfigError, match="top-k"):
        D.training_loss(model, target, batch)


# ---- per-node acceptance estimates stay probabilities ------------------------------------------------------
def test_sibling_acceptance_stays_a_probability_when_the_top_child_is_near_certain():
    # float32 log-softmax of a 20-nat gap: the top child's log-prob rounds to 0.0, its siblings' do not
    lp = torch.log_softmax(torch.tensor([30.0, 10.0, 9.0]), -1).tolist()
    assert lp[0] == 0.0 and lp[1] > -21
    tree, acc = conditional_ddtree(7, lambda d, p, _: [([1, 2, 3], lp, 0.9)], 3, 1)
    assert tree.tokens.tolist() == [7, 1, 2, 3]
    assert acc[1] == 0.9
    assert all(0.0 <= a <= 1.0 for a in acc)
    assert sum(acc[2:]) <= 0.1 + 1e-9  # the siblings share what the top child leaves
    assert acc[2] > acc[3]
    from graft_block.drafters.dspark import c_walk  # the C walk floors 1 - q(top) the same way

    if not c_walk.available():
        return
    z = torch.tensor([[30.0, 10.0, 9.0]])
    tree_c, acc_c = c_walk.markov_tree(7, 3, 1, 3, z, torch.tensor([[1, 2, 3]]), torch.tensor([[-math.inf]]),
                                       torch.zeros(1, 3, 1), torch.zeros(8, 1), 0.0, torch.ones(1),
                                       confidence=(torch.logit(torch.tensor([0.9])), None, torch.ones(1)))
    assert tree_c.tokens.tolist() == [7, 1, 2, 3] and tree_c.scores[1] == 0.0
    assert acc_c == pytest.approx(acc, abs=1e-6)
    with pytest.raises(ValueError, match="W1 weight"):  # a confidence weight of another rank would be overrun
        c_walk.markov_tree(7, 3, 1, 3, z, torch.tensor([[1, 2, 3]]), torch.tensor([[-9.0]]), torch.zeros(1, 3, 1),
                           torch.zeros(8, 1), 0.0, torch.ones(1), confidence=(torch.zeros(1), torch.zeros(2),
                                                                             torch.ones(1)))
    for budget, depth in ((0, 1), (3, 0)):  # no room: the root alone and no estimates, as the Python walk
        tree_c, acc_c = c_walk.markov_tree(7, budget, depth, 3, z, torch.tensor([[1, 2, 3]]), torch.tensor([[-9.0]]),
                                           torch.zeros(1, 3, 1), torch.zeros(8, 1), 0.0, torch.ones(1))
        assert tree_c.tokens.tolist() == [7] and acc_c is None


def test_dspark_node_survival_is_at_most_one_with_sharp_draft_temperatures():
    target = tiny_target("llama")
    d = Drafter.from_config({"type": "dspark", "num_layers": 2, "target_layer_ids": [0, 2], "block_size": 3,
                             "seed": 1, "markov_rank": 8, "proposal": "ddtree", "budget": 12,
                             "confidence_head": True, "markov_candidates": 0}, target=target)
    state = prefilled_state(target, PROMPT, d)
    for t in (0.25, 0.2, 0.1):  # sharp enough that a top child's float32 log-prob rounds to 0
        d.model.draft_temperatures.fill_(t)
        tree = d.propose(state)
        surv = d.node_survival(tree)
        assert float(surv.max()) <= 1.0 + 1e-9, t
        cond = surv[1:] / surv[tree.parents[1:]]
        sums = torch.zeros(tree.size, dtype=torch.float64).index_add_(0, tree.parents[1:], cond)
        assert float(sums.max()) <= 1.0 + 1e-9, t  # only one child of a node can be the target's token


@pytest.mark.parametrize("where", ["dflash_config", "top"])
@pytest.mark.parametrize("anchor,alignment", [(True, "deepspec"), (False, "zlab")])
def test_sample_from_anchor_sets_the_block_alignment(tmp_path, where, anchor, alignment, one_thread):
    """vLLM, speculators, SGLang and llama.cpp's converter spell the alignment ``sample_from_anchor`` (true: the anchor
    row drafts, DeepSpec's rows); a folder that says false is z-lab-aligned and must not run DeepSpec's rows."""
    target = tiny_target("qwen3")
    folder, _ = _dspark_folder(tmp_path / "ds", target, "export")
    cfg = json.loads((folder / "config.json").read_text())
    (cfg["dflash_config"] if where == "dflash_config" else cfg)["sample_from_anchor"] = anchor
    (folder / "config.json").write_text(json.dumps(cfg))
    assert S.load_checkpoint(folder).alignment == alignment
    cfg["dflash_config"]["block_alignment"] = "zlab" if anchor else "deepspec"  # two keys that disagree
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="sample_from_anchor"):
        S.load_checkpoint(folder)


def test_conditional_acceptance_estimates_divide_by_one_minus_q_top():
    """The other children's estimates divide by 1 - q(top), the mass outside the top child, which includes the
    tokens beyond the K drafted ones (here 0.2), not by the drafted siblings' mass alone."""
    lp = [math.log(0.5), math.log(0.2), math.log(0.1)]  # 0.2 of the mass is outside the top-3
    tree, acc = conditional_ddtree(7, lambda d, p, _: [([10 * d + 1, 10 * d + 2, 10 * d + 3], lp, 0.8)], 3, 1)
    assert tree.tokens.tolist() == [7, 11, 12, 13]
    assert acc == pytest.approx([1.0, 0.8, 0.2 * 0.2 / 0.5, 0.2 * 0.1 / 0.5])


def test_candidate_logprobs_temper_the_markov_bias_like_the_backbone():
    """At T > 0 a node's children follow softmax((U_d + bias) / T): the bias is tempered like the backbone logits
    (passed already divided by T), so with no outside mass the candidates' law is the exact one."""
    from graft_block.drafters.dspark.drafter import candidate_logprobs

    g = torch.Generator().manual_seed(0)
    base, bias = torch.randn(2, 6, generator=g) * 3
    none = torch.tensor([-math.inf])
    for T in (0.5, 1.0, 2.0):
        got = candidate_logprobs(base / T, bias, none, T, 1.0)
        assert torch.allclose(got, torch.log_softmax((base + bias) / T, -1), atol=1e-5), T
    assert torch.allclose(candidate_logprobs(base, bias, none, 0.0, 1.0), torch.log_softmax(base + bias, -1), atol=1e-5)


def test_node_survival_calibrates_each_depth_with_its_own_confidence_temperature(one_thread):
    """confidence_temperatures differ per draft position: a parent's top child at depth d gets
    sigmoid(logit(c) / T_{d-1}), c its uncalibrated confidence (read off a twin whose temperatures are all 1), and
    its other children (1 - that) q(x) / (1 - q(top)). Caught: T_0 used at every depth."""
    target = tiny_target("llama")
    d = _drafter(target, proposal="ddtree", budget=16, confidence_head=True, markov_candidates=0)
    st = prefilled_state(target, PROMPT, d)
    n = d.model.num_drafts
    d.model.confidence_temperatures = torch.ones(n)
    raw_tree = d.propose(st)
    raw = d.node_survival(raw_tree)
    temps = torch.tensor([1.0, 2.0, 0.5, 3.0, 0.7, 1.5, 0.4][:n])
    d.model.confidence_temperatures = temps
    tree = d.propose(st)
    surv = d.node_survival(tree)
    assert torch.equal(tree.tokens, raw_tree.tokens) and torch.equal(tree.parents, raw_tree.parents)
    par, depth = tree.parents.tolist(), tree.depths.tolist()
    raw_acc = [1.0] + [float(raw[i] / raw[par[i]]) for i in range(1, tree.size)]
    acc = [1.0] + [float(surv[i] / surv[par[i]]) for i in range(1, tree.size)]
    top: dict[int, int] = {}
    for i in range(1, tree.size):  # nodes in pop order: a parent's first child is its top child
        top.setdefault(par[i], i)
    checked_deep = 0
    for i in range(1, tree.size):
        c = raw_acc[top[par[i]]]
        cal = torch.sigmoid(torch.logit(torch.tensor(c, dtype=torch.float64)) / float(temps[depth[i] - 1])).item()
        want = cal if top[par[i]] == i else raw_acc[i] * (1.0 - cal) / (1.0 - c)
        assert acc[i] == pytest.approx(want, rel=1e-4, abs=1e-7), (i, depth[i])
        checked_deep += depth[i] > 1
    assert checked_deep >= 3 and max(depth) >= 3


@pytest.mark.parametrize("label", ["tv", "greedy"])
def test_confidence_loss_is_the_row_weighted_bce_against_its_configured_label(one_thread, label):
    """DSpark's loss = the recipe's + confidence_weight * sum_j w_j BCE(conf_j, label_j) / sum_j w_j, the label
    1 - TV (``"tv"``) or argmax acceptance (``"greedy"``); and DeepSpec's recipe weights 0.1 CE + 0.9 L1."""
    target = tiny_target("llama")
    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "mask_token_id": 127, "block_size": 5, "num_anchors": 8,
           "markov_rank": 4, "confidence_label": label, "confidence_weight": 2.0}
    model = S.DSparkDrafter.training_model(target, cfg, "random")
    assert (model.train_opts["ce_weight"], model.train_opts["l1_weight"]) == (0.1, 0.9)
    batch = _batch(target, model)
    batch["generator"] = torch.Generator().manual_seed(3)
    loss, m = S.DSparkDrafter.training_loss(model, target, batch)
    batch["generator"] = torch.Generator().manual_seed(3)
    base, _, rows = D.recipe_loss(model, target, batch,
                                  lambda h, prev, j, ok: S.training.draft_logits(model, target, h, prev, j, valid=ok))
    conf = model.confidence_logits(rows["hidden"], rows["prev"])
    assert float(conf.abs().min()) > 0 and not torch.equal(rows["accept"], rows["correct"])  # the labels differ
    y = rows["accept"] if label == "tv" else rows["correct"]
    bce = F.binary_cross_entropy_with_logits(conf, y, reduction="none")
    assert rows["w"].unique().numel() > 1  # rows weigh differently: a plain mean would not match
    assert torch.allclose(loss, base + 2.0 * (rows["w"] * bce).sum() / rows["wsum"], rtol=1e-5, atol=1e-6)


def test_acceptance_table_drops_every_position_after_a_rejection(one_thread, monkeypatch):
    """Sequential calibration fits position k on chains that reached it: a draft 0 that always misses leaves no
    valid row at any later position, however often the later drafts would have been right."""
    from graft_block.drafters.dspark.calibrate import acceptance_table

    target, model, recs = _calibration_records()
    V = target.model.get_output_embeddings().weight.shape[0]
    model.markov_head.markov_w2.weight.data.zero_()
    orig = model.logits

    def planted(h, w, b=None, restricted=False):  # draft 0 names a wrong token, every later draft the right one
        lab = model._labels.clone()
        lab[:, 0] = (lab[:, 0] + 1) % V
        return orig(h, w, b) * 0 + F.one_hot(lab, V).float() * 50

    model.logits = planted
    _record_block_labels(monkeypatch)
    _, acc, valid, exists = acceptance_table(model, target, recs, anchors=8)
    assert not acc[:, 0].any() and torch.equal(acc[:, 1:], exists[:, 1:]) and bool(acc[:, 1:].any())
    assert torch.equal(valid[:, 0], exists[:, 0]) and not valid[:, 1:].any()


def test_draft_nll_table_files_each_row_under_its_own_draft_position(one_thread):
    """Every (anchor, position) row whose token is a candidate counts at its own position: with the whole
    vocabulary as candidates, position j holds one row per anchor whose label anchor + j + 1 is in the sequence,
    and its NLL at T = 1 is the corrected draft's CE there."""
    from graft_block.drafters.dspark.calibrate import draft_nll_table

    target = tiny_target("llama")
    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "mask_token_id": 127, "block_size": 5, "markov_rank": 4}
    model = S.DSparkDrafter.training_model(target, cfg, "random")
    with torch.no_grad():
        model.markov_head.markov_w2.weight.normal_()
    b = _batch(target, model)  # 3 sequences of 24 tokens, prompts of 6: anchors 6..22
    recs = [{"ids": b["ids"][i], "feats": b["feats"][i], "top_ids": b["top_ids"][i], "top_logp": b["top_logp"][i],
             "prompt_len": 6} for i in range(3)]
    nll, rows = draft_nll_table(model, target, recs, candidates=128, grid=(1.0, 2.0))
    assert rows.tolist() == [3.0 * (17 - j) for j in range(4)]
    model.train_opts = {"num_anchors": 64, "unique_anchors": True}
    batch = {**b, "generator": torch.Generator().manual_seed(0)}
    blk = D.make_blocks(model, batch, 64, unique=True)
    ok = blk["valid"]
    with torch.no_grad():
        z = S.training.draft_logits(model, target, D.draft_rows(model, target, batch, blk), blk["prev"],
                                    blk["draft_index"], valid=ok)
    ce = F.cross_entropy(z.float(), blk["labels"][ok], reduction="none").double()
    want = torch.zeros(4, dtype=torch.float64).index_add_(0, blk["draft_index"][ok], ce)
    assert torch.allclose(nll[:, 0], want, rtol=1e-4)


@pytest.mark.parametrize("name", ["embed_tokens.weight", "lm_head.weight"])
def test_a_native_folders_misshaped_frozen_copy_is_refused(tmp_path, name):
    """DeepSpec's frozen embed_tokens / lm_head copies are dropped, but only after their shape is checked: a copy
    that is not vocab_size x hidden_size means the folder was made for another target."""
    from safetensors.torch import load_file, save_file

    target = tiny_target("qwen3")
    folder, _ = _dspark_folder(tmp_path / "n", target, "native")
    t = load_file(str(folder / "model.safetensors"))
    t[name] = t[name][:-1].clone()
    save_file(t, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
        Drafter.from_config(str(folder), target=target)


def test_a_schedule_sized_deepspec_draft_runs_only_the_rows_its_nodes_reach(tiny_qwen3):
    """DeepSpec alignment (the anchor row drafts, offset 0): ``state.draft_nodes`` = 3 runs a block of 3 rows, not
    the 4 z-lab's alignment needs; the tree equals the one a budget-3, block-3 drafter proposes."""
    from graft_block.drafters.dspark.drafter import DSparkDrafter

    d = _drafter(tiny_qwen3, proposal="chain", budget=6, alignment="deepspec")
    assert d.offset == 0
    st = prefilled_state(tiny_qwen3, PROMPT, d)
    st.draft_nodes = 3
    assert d.round_size(st) == (3, 3)
    with torch.no_grad():
        sized = d.propose(st)
        ref_d = DSparkDrafter(tiny_qwen3, d.model, proposal="chain", budget=3, block_size=3)
        ref = ref_d.propose(prefilled_state(tiny_qwen3, PROMPT, ref_d))
    assert torch.equal(sized.tokens, ref.tokens) and torch.equal(sized.parents, ref.parents)
