"""MFD drafter: K=1 == DFlash (logits, tree, training loss), one forward == K separate forwards, losslessness
(greedy identity vs HF greedy, T=1 distribution), checkpoint IO, training metrics."""
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
from graft_block.testing import (chi_square_test, exact_sequence_probs, null_tv_quantile, prefilled_state,
                                  tiny_target)
from graft_block.tree import validate

PROMPT = [5, 17, 33, 2, 99, 64, 12]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models are latency-bound: 1 thread is much faster


def _mfd(target, **kw):
    cfg = {"type": "mfd", "num_layers": 2, "target_layer_ids": [0, 2], "block_size": 8, "seed": 1, "num_modes": 3,
           "budget": 20, "mode_init_scale": 1.0}
    cfg.update(kw)
    return Drafter.from_config(cfg, target=target)


def _hf_greedy(target, prompt, n):
    out = target.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_k1_zero_modes_reproduces_dflash_exactly(tiny_qwen3):
    base = D.new_model(tiny_qwen3, num_layers=2, block_size=8, target_layer_ids=[0, 2], seed=3)
    dfl = D.DFlashDrafter(tiny_qwen3, base, proposal="ddtree", budget=24)
    mfd = M.MFDDrafter(tiny_qwen3, M.MFDModel.from_dflash(base, num_modes=1), budget=24)
    st = prefilled_state(tiny_qwen3, PROMPT, dfl)
    mfd.prefill(st)
    with torch.no_grad():
        a = dfl.block_logits(st)
        b = mfd.mode_logits(st)
    assert b.shape == (1,) + a.shape and torch.equal(a, b[0])
    t1, t2 = dfl.propose(st), mfd.propose(st)
    assert torch.equal(t1.tokens, t2.tokens) and torch.equal(t1.parents, t2.parents)
    # MFD heads its rows two, then doubling, at a time; on some CPUs a GEMM picked by row count rounds the last ulp
    # differently (seen on the CI machine), so path scores agree to float precision, not bit for bit
    torch.testing.assert_close(t1.scores, t2.scores, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode_rows", ["all", "mask"])
def test_one_forward_equals_separate_mode_forwards(tiny_llama, mode_rows):
    d = _mfd(tiny_llama, mode_rows=mode_rows)
    st = prefilled_state(tiny_llama, PROMPT, d)
    B = d.block_size
    with torch.no_grad():
        joint = d.mode_logits(st)  # [K, B-1, V]
        ids = torch.full((B,), d.model.mask_token_id)
        ids[0] = st.root_token
        emb = tiny_llama.embed(ids)
        for k in range(d.model.num_modes):
            on = (torch.arange(B) > 0) if mode_rows == "mask" else torch.ones(B, dtype=torch.bool)
            rows = emb + d.model.mode_embed[k] * on.float().view(-1, 1)
            h = d.block_hidden(st, ids, block_embeds=rows)  # DFlash's single-block forward, no mask
            single = d.model.logits(h[1:], d._lm_w, d._lm_b, restricted=True, layouts=d._lm_layouts)
            assert torch.allclose(joint[k], single, atol=1e-5)
    # the modes really differ (symmetry broken), and the anchor row is untouched in "mask" mode
    assert not torch.allclose(joint[0], joint[1])


@pytest.mark.parametrize("arch,score", [("llama", "best_mode"), ("qwen3", "best_mode"), ("llama", "mixture_uniform"),
                                        ("qwen3", "mixture_gated")])
def test_greedy_identity_vs_hf(arch, score):
    target = tiny_target(arch)
    ref = _hf_greedy(target, PROMPT, 32)
    d = _mfd(target, score=score, budget=24)
    res = SpeculativeDecoder(target, d).generate(PROMPT, max_new_tokens=32)
    assert res.tokens == ref
    # the draft cache holds exactly the tokens that entered the target cache (the last round may overshoot
    # max_new_tokens: count every round's walk, before the stop trim)
    assert d.ctx_len == len(PROMPT) + sum((k + 1) * c for k, c in res.stats.accept_hist.items())
    ids, _lps = d.last_block_logprobs
    assert ids.shape[0] == 3 and 2 <= ids.shape[1] <= 7  # rows headed: test_rows_headed_on_demand_*


@pytest.mark.parametrize("markov", [False, True])
def test_adaptive_rows_are_headed_in_one_product(tiny_llama, markov, tmp_path, monkeypatch):
    """With adaptive rows the block is already sized from recent rounds, so a round heads all of its drafting rows
    in one product (one read of the LM head), with or without a shared Markov head, and decoding stays
    token-identical to HF greedy. Caught: heading two rows, then doubling, as without adaptive rows."""
    calls = []
    row_logits = M.MFDDrafter.row_logits

    def counted(self, hidden, lo, hi):
        calls.append((lo, hi))
        return row_logits(self, hidden, lo, hi)

    monkeypatch.setattr(M.MFDDrafter, "row_logits", counted)
    if markov:
        model = _mfd_sharing_a_markov_head(tiny_llama, tmp_path / "dspark", block_size=8, target_layer_ids=[0, 2])
        d = M.MFDDrafter(tiny_llama, model, budget=9, block_size="adaptive", markov=str(tmp_path / "dspark"))
    else:
        d = _mfd(tiny_llama, block_size="adaptive", budget=9)
    out = SpeculativeDecoder(tiny_llama, d).generate(PROMPT, max_new_tokens=24)
    assert out.tokens == _hf_greedy(tiny_llama, PROMPT, 24)
    assert len(calls) == out.stats.rounds and all(lo == 0 for lo, _ in calls)
    assert calls[0][1] == min(9, d.block_size - 1) and min(hi for _, hi in calls) < calls[0][1]  # rows adapt


@pytest.mark.parametrize("score", ["best_mode", "mixture_uniform", "mixture_gated"])
def test_rows_headed_on_demand_give_the_tree_of_all_rows(tiny_llama, score):
    """propose() heads the drafting rows two, then doubling, at a time and stops once its tree is shallower than
    the rows headed: the tree is the one every row gives, and shallow trees head fewer rows."""
    from graft_block.tree.ddtree import topk_logprobs
    from graft_block.tree.mixed import mixed_ddtree

    headed = []
    for budget in (1, 2, 3, 5, 9, 40):
        for prefix in range(3, len(PROMPT) + 1):
            d = _mfd(tiny_llama, score=score, budget=budget, mode_init_scale=2.0)
            st = prefilled_state(tiny_llama, PROMPT[:prefix], d)
            tree = d.propose(st)
            headed.append(d.last_block_logprobs[0].shape[1])
            L = min(budget, d.block_size - 1)
            with torch.no_grad():
                logits = d.mode_logits(st, rows=L)
            K = logits.shape[0]
            cols, lps = topk_logprobs(logits.reshape(K * L, -1), max(d.marginal_topk, budget))
            ids = d.model.to_vocab_ids(cols).view(K, L, -1)
            w = d.last_gate if score == "mixture_gated" else None
            full = mixed_ddtree(st.root_token, ids, lps.view(K, L, -1), budget, score, w)
            for a, b in ((tree.tokens, full.tokens), (tree.parents, full.parents), (tree.modes, full.modes)):
                assert torch.equal(a, b), (budget, prefix)
            assert torch.allclose(tree.scores, full.scores)
    assert min(headed) < max(headed)


def test_mixed_trees_are_valid_and_use_several_modes(tiny_llama):
    d = _mfd(tiny_llama, budget=30)
    st = prefilled_state(tiny_llama, PROMPT, d)
    tree = d.propose(st)
    validate(tree, budget=30, root_token=st.root_token)
    assert tree.size == 31
    bits = set(tree.modes[1:].tolist())
    assert any(b != 7 for b in bits)  # some nodes are proposed by a subset of the modes only


def _mfd_sharing_a_markov_head(target, folder, **kw):
    """A random DSpark drafter saved (fp32) to ``folder``, and a K=3 MFD on its backbone that shares its head."""
    from graft_block.drafters.dspark.checkpoint import save_checkpoint

    ds = Drafter.from_config({"type": "dspark", "num_layers": 2, "seed": 1, "markov_rank": 4, **kw}, target=target)
    dm = ds.model
    with torch.no_grad():  # a strong head, so that the correction reorders children
        dm.markov_head.markov_w2.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(4))
    save_checkpoint(dm, folder, dtype=torch.float32)
    model = M.MFDModel(dm.config, dm.block_size, dm.target_layer_ids, dm.mask_token_id, dm.num_target_layers,
                       dm.draft_vocab, num_modes=3)
    backbone = {k: v for k, v in dm.state_dict().items() if not k.startswith(("markov_head.", "confidence_head."))}
    missing, unexpected = model.load_state_dict(backbone, strict=False)
    assert not unexpected and set(missing) == {"mode_embed", "mode_gate.weight"}
    model.break_symmetry(target.embed(torch.tensor([dm.mask_token_id]))[0], 1.0, seed=1)
    return model


@pytest.mark.parametrize("markov", [False, True])
def test_sampling_matches_target_distribution(markov, tmp_path):
    """T=1, 8-token vocabulary, K=3 modes: the joint law of 3 new tokens (512 outcomes) under MFD mixed trees (and
    under the modes sharing a DSpark Markov head: each node's children from its own corrected distribution) equals
    the target's exact law: chi-square p > 1e-3, and TV below the 99.9% quantile of TV under exact sampling with
    the same n (about 0.12 at n = 1600). Drafts are accepted, in second rounds too, whose trees come from the state
    a first round that accepted no draft left. Negative control: the test rejects the T=0.8 law."""
    target = tiny_target("llama", vocab_size=8, hidden_size=32, num_layers=2)
    shape = dict(block_size=4, mask_token_id=7, target_layer_ids=[0, 1])
    if markov:
        model = _mfd_sharing_a_markov_head(target, tmp_path / "dspark", **shape)
        d = M.MFDDrafter(target, model, budget=8, markov=str(tmp_path / "dspark"))
        assert d.markov is not None
    else:
        d = _mfd(target, budget=8, **shape)
    dec = SpeculativeDecoder(target, d)
    prompt = [1, 3, 5]
    exact = exact_sequence_probs(target, prompt, 3, SamplingConfig(1.0))
    n = 1600
    gen = torch.Generator().manual_seed(7)
    counts = Counter()
    accepted = second_round_accepted = 0
    for _ in range(n):
        r = dec.generate(prompt, max_new_tokens=3, temperature=1.0, generator=gen)
        counts[tuple(r.tokens)] += 1
        run_accepted = sum(k * c for k, c in r.stats.accept_hist.items())  # drafted nodes the walk accepted
        accepted += run_accepted
        # 3 tokens take two rounds only when the first accepted no draft: then any accept is the second round's
        second_round_accepted += run_accepted if r.stats.rounds == 2 else 0
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in exact.items())
    tol = null_tv_quantile(exact, n)
    stat, dof, p = chi_square_test(counts, exact)
    assert tv < tol and p > 1e-3, (tv, tol, stat, dof, p)
    assert accepted > n // 10 and second_round_accepted > n // 20, (accepted, second_round_accepted)
    cooler = exact_sequence_probs(target, prompt, 3, SamplingConfig(0.8))
    assert chi_square_test(counts, cooler)[2] < 1e-3  # the test has the power to see a mild distortion


def test_a_shared_markov_head_from_a_shorter_block_is_refused_unless_the_block_fits(tmp_path):
    """A DSpark head of block 4 (3 drafts, 3 draft temperatures) shared by an MFD of block 8: the tree indexed the
    head's temperatures past its rows and raised IndexError mid-generate once it reached depth 4. It is refused at
    construction now, and block_size 4 drafts within the head's rows."""
    target = tiny_target("llama", vocab_size=16, hidden_size=32, num_layers=2)
    dspark = _mfd_sharing_a_markov_head(target, tmp_path / "dspark", block_size=4, mask_token_id=15,
                                        target_layer_ids=[0, 1])
    model = M.MFDModel(dspark.config, 8, dspark.target_layer_ids, dspark.mask_token_id, dspark.num_target_layers,
                       None, num_modes=2)
    model.load_state_dict({k: v for k, v in dspark.state_dict().items() if k != "mode_embed"}, strict=False)
    with pytest.raises(ConfigError, match=r"markov: .* drafts 3 rows \(block_size 4\).* drafts 7.*block_size <= 4"):
        M.MFDDrafter(target, model, budget=12, markov=str(tmp_path / "dspark"))
    d = M.MFDDrafter(target, model, budget=12, block_size=4, markov=str(tmp_path / "dspark"))
    tree = d.propose(prefilled_state(target, [1, 2, 3, 4], d))
    validate(tree, budget=12)
    assert int(tree.depths.max()) == 3


def test_checkpoint_round_trip_and_config(tmp_path, tiny_qwen3):
    d = _mfd(tiny_qwen3)
    M.save_checkpoint(d.model, tmp_path / "ck", score="best_mode", dtype=torch.float32)
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["type"] == "mfd" and cfg["mfd_config"] == {"num_modes": 3, "score": "best_mode", "mode_rows": "all"}
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 2] and cfg["architectures"] == ["DFlashDraftModel"]
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "ck" / "model.safetensors"))
    assert tensors["mode_embed"].shape == (3, 64) and tensors["mode_gate.weight"].shape == (1, 64)
    d2 = Drafter.from_config(str(tmp_path / "ck"), target=tiny_qwen3)
    assert isinstance(d2, M.MFDDrafter) and d2.model.num_modes == 3
    st = prefilled_state(tiny_qwen3, PROMPT, d)
    d2.prefill(st)
    with torch.no_grad():
        assert torch.equal(d.mode_logits(st), d2.mode_logits(st))
    # use_modes drafts with a prefix of the modes
    d3 = Drafter.from_config({"type": "mfd", "checkpoint": str(tmp_path / "ck"), "use_modes": 2}, target=tiny_qwen3)
    d3.prefill(st)
    with torch.no_grad():
        assert torch.allclose(d3.mode_logits(st), d.mode_logits(st)[:2], atol=1e-5)
    # a misspelt mfd_config key, or a count in quotes, is named instead of ignored or compared as text
    for mcfg, words in (({**cfg["mfd_config"], "num_mode": 3}, "keys \\['num_mode'\\] are unknown"),
                        ({**cfg["mfd_config"], "num_modes": "3"}, "num_modes must be an integer >= 1, got '3'")):
        (tmp_path / "ck" / "config.json").write_text(json.dumps({**cfg, "mfd_config": mcfg}))
        with pytest.raises(ConfigError, match=words):
            Drafter.from_config(str(tmp_path / "ck"), target=tiny_qwen3)


def test_folder_without_type_loads_as_mfd(tmp_path, tiny_qwen3):
    """A saved MFD folder whose config.json lost its "type" (and gained hub keys) is recognised as mfd, not dflash,
    and gives the same drafter as {"type": "mfd", "checkpoint": folder}."""
    d = _mfd(tiny_qwen3)
    M.save_checkpoint(d.model, tmp_path / "ck", dtype=torch.float32)
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    del cfg["type"]
    cfg.update({"torch_dtype": "float32", "transformers_version": "4.57.1", "use_cache": True})
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    got = Drafter.from_config(str(tmp_path / "ck"), target=tiny_qwen3)
    ref = Drafter.from_config({"type": "mfd", "checkpoint": str(tmp_path / "ck")}, target=tiny_qwen3)
    assert type(got) is M.MFDDrafter and got.model.num_modes == 3 and got.budget == ref.budget
    st = prefilled_state(tiny_qwen3, PROMPT, ref)
    got.prefill(st)
    with torch.no_grad():
        assert torch.equal(got.mode_logits(st), ref.mode_logits(st))


def test_dflash_checkpoint_loads_as_k1(tmp_path, tiny_qwen3):
    base = D.new_model(tiny_qwen3, num_layers=1, block_size=6, target_layer_ids=[1], seed=2)
    D.save_checkpoint(base, tmp_path / "dfl", dtype=torch.float32, extra={"type": "dflash"})
    d = Drafter.from_config({"type": "mfd", "checkpoint": str(tmp_path / "dfl"), "budget": 10}, target=tiny_qwen3)
    ref = Drafter.from_config({"type": "dflash", "checkpoint": str(tmp_path / "dfl"), "proposal": "ddtree",
                               "budget": 10}, target=tiny_qwen3)
    st = prefilled_state(tiny_qwen3, PROMPT, ref)
    d.prefill(st)
    t1, t2 = ref.propose(st), d.propose(st)
    assert t1.tokens.tolist() == t2.tokens.tolist() and t1.parents.tolist() == t2.parents.tolist()


def test_bad_configs_fail_clearly(tiny_llama):
    with pytest.raises(ConfigError, match="score"):
        _mfd(tiny_llama, score="product")
    with pytest.raises(ConfigError, match="use_modes"):
        _mfd(tiny_llama, use_modes=5)
    with pytest.raises(ConfigError, match="num_modes"):
        _mfd(tiny_llama, num_modes=0)
    with pytest.raises(ConfigError, match="unknown mfd config"):
        _mfd(tiny_llama, colour="red")
    for bad in (0, -2, 2.5):  # were taken, then ignored by max(marginal_topk, budget) or truncated
        with pytest.raises(ConfigError, match="marginal_topk .*must be an int >= 1"):
            _mfd(tiny_llama, marginal_topk=bad)


def test_a_shared_markov_head_from_an_uncalibrated_dspark_folder_warns(tmp_path):
    """The modes rank their children by the DSpark folder's draft temperatures: a folder training marked as
    needing calibrate.py says so when MFD shares its head, as when it is loaded itself."""
    target = tiny_target("llama", vocab_size=16, hidden_size=32, num_layers=2)
    model = _mfd_sharing_a_markov_head(target, tmp_path / "dspark", block_size=4, mask_token_id=15,
                                       target_layer_ids=[0, 1])
    cfg = json.loads((tmp_path / "dspark" / "config.json").read_text())
    note = {"needed": True, "why": "trained weights", "run": "python -m graft_block.drafters.dspark.calibrate "
            "<this folder> --data d --holdout 4"}
    (tmp_path / "dspark" / "config.json").write_text(json.dumps({**cfg, "calibration": note}))
    with pytest.warns(UserWarning, match=f"is uncalibrated .*[.]calibrate {tmp_path / 'dspark'} --data d"):
        M.MFDDrafter(target, model, budget=6, markov=str(tmp_path / "dspark"))


# ---- training ----------------------------------------------------------------------------------------------
def _batch(target, layers, b=2, L=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (b, L), generator=g)
    target.set_feature_layers(layers)
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i] for i in layers], -1)
    logp = torch.log_softmax(out.logits.float(), -1)
    tv, ti = logp.topk(4, -1)
    labels = torch.cat([ids[:, :1], out.logits.argmax(-1)[:, :-1]], 1)  # the target's own token at every position
    return {"ids": ids, "labels": labels, "feats": feats, "top_ids": ti, "top_logp": tv,
            "lengths": torch.tensor([L, L - 7])[:b], "prompt_len": torch.tensor([6, 9])[:b]}


def test_k1_training_loss_equals_dflash(tiny_qwen3):
    cfg = {"num_layers": 2, "block_size": 6, "target_layer_ids": [0, 2], "num_anchors": 5, "num_modes": 1}
    dmodel = D.training_model(tiny_qwen3, cfg, "target")
    mmodel = M.MFDModel.from_dflash(dmodel, num_modes=1)
    mmodel.train_opts = {**dmodel.train_opts, "mix_loss": "mixture", "wta_eps": 0.0, "balance": 0.05}
    batch = _batch(tiny_qwen3, dmodel.feature_layers)
    l1, m1 = D.training_loss(dmodel, tiny_qwen3, {**batch, "generator": torch.Generator().manual_seed(5)})
    l2, m2 = M.training_loss(mmodel, tiny_qwen3, {**batch, "generator": torch.Generator().manual_seed(5)})
    assert torch.allclose(l1, l2, rtol=1e-5, atol=1e-6), (float(l1), float(l2))
    assert m1["accept_len"] == pytest.approx(m2["accept_len"])


@pytest.mark.parametrize("mix_loss", ["mixture", "wta"])
def test_training_loss_k4_metrics_and_gradients(tiny_qwen3, mix_loss):
    cfg = {"num_layers": 2, "block_size": 6, "target_layer_ids": [0, 2], "num_anchors": 5, "num_modes": 4,
           "mix_loss": mix_loss}
    model = M.training_model(tiny_qwen3, cfg, "target")
    assert model.mode_embed.requires_grad and float(model.mode_embed.detach().norm()) > 0
    batch = _batch(tiny_qwen3, model.feature_layers)
    loss, m = M.training_loss(model, tiny_qwen3, {**batch, "generator": torch.Generator().manual_seed(1)})
    loss.backward()
    assert model.mode_embed.grad is not None and float(model.mode_embed.grad.abs().sum()) > 0
    assert model.mode_gate.weight.grad is not None
    assert model.layers[0].mlp.up_proj.weight.grad is not None
    wins = [m[f"win{j}"] for j in range(4)]
    assert sum(wins) == pytest.approx(1.0) and 0.0 <= m["disagree"] <= 1.0 and m["accept_best"] >= m["accept_len"]
    # the mixture loss is never above the mean mode's loss... and the best mode's block NLL is a lower bound
    assert 0 <= m["resp_entropy"] <= torch.log(torch.tensor(4.0)).item() + 1e-5
    assert m["resp_entropy"] - 1e-5 <= m["usage_entropy"] <= torch.log(torch.tensor(4.0)).item() + 1e-5  # concave
    assert 0.0 <= m["gate_acc"] <= 1.0 and m["accept_gated"] <= m["accept_best"] + 1e-6
    with torch.no_grad():  # a flat gate picks mode 0 everywhere: its accuracy is mode 0's win rate, its accept mode 0's
        model.mode_gate.weight.zero_()
    _, m = M.training_loss(model, tiny_qwen3, {**batch, "generator": torch.Generator().manual_seed(1)})
    assert m["gate_acc"] == pytest.approx(m["win0"]) and m["accept_gated"] == pytest.approx(m["accept_len"])


def test_k1_control_keeps_mode_vector_frozen_at_zero(tiny_qwen3):
    cfg = {"num_layers": 1, "block_size": 6, "target_layer_ids": [0], "num_anchors": 3, "num_modes": 1}
    model = M.training_model(tiny_qwen3, cfg, "target")
    assert not model.mode_embed.requires_grad and float(model.mode_embed.abs().sum()) == 0


def test_frozen_backbone_trains_the_modes_only(tiny_qwen3):
    """freeze_backbone: gradients reach the mode vectors (through the frozen layers) and the gate, no backbone
    tensor trains; K = 1 has nothing left to train, and says its control is the backbone."""
    cfg = {"num_layers": 1, "block_size": 6, "target_layer_ids": [0, 2], "num_anchors": 4, "num_modes": 4,
           "freeze_backbone": True}
    model = M.training_model(tiny_qwen3, cfg, "target")
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {"mode_embed", "mode_gate.weight"}
    batch = _batch(tiny_qwen3, model.feature_layers)
    loss, _ = M.training_loss(model, tiny_qwen3, {**batch, "generator": torch.Generator().manual_seed(1)})
    loss.backward()
    assert float(model.mode_embed.grad.abs().sum()) > 0 and model.layers[0].mlp.up_proj.weight.grad is None
    with pytest.raises(ConfigError, match="nothing to train.*backbone"):
        M.training_model(tiny_qwen3, {**cfg, "num_modes": 1}, "target")


def test_train_loop_runs_and_saves(tmp_path, tiny_qwen3, monkeypatch):
    """Two steps through the shared loop (graft_block.training.train) on a tiny cached data set."""
    from graft_block import training as T

    layers = [1, 3]
    recs = []
    for s in range(6):
        b = _batch(tiny_qwen3, layers, b=1, L=30, seed=s)
        recs.append({"ids": b["ids"][0].int(), "labels": b["labels"][0].int(), "prompt_len": 5,
                     "feats": b["feats"][0].half(),
                     "top_ids": b["top_ids"][0].int(), "top_logp": b["top_logp"][0].half()})
    folder = tmp_path / "data"
    folder.mkdir()
    torch.save(recs, folder / "shard_0000.pt")
    (folder / "meta.json").write_text(json.dumps({"feature_layers": layers, "topk": 4, "hidden_size": 64,
                                                  "shards": [{"batch": 0, "file": "shard_0000.pt"}]}))
    cfg = {"num_layers": 1, "block_size": 6, "target_layer_ids": [0, 2], "num_anchors": 4, "num_modes": 2}
    res = T.train("mfd", tiny_qwen3, str(folder), tmp_path / "out", tmp_path / "run", cfg=cfg, init="target",
                  epochs=1, batch_size=2, holdout=2, eval_every=0, log=lambda s: None)
    assert res["step"] == 2 and "win0" in res and "disagree" in res
    d = Drafter.from_config(str(tmp_path / "out"), target=tiny_qwen3)
    assert isinstance(d, M.MFDDrafter) and d.model.num_modes == 2


def test_draft_vocab_model_is_lossless_and_proposes_in_vocab(tiny_llama):
    vocab = torch.tensor([1, 4, 9, 16, 25, 36, 49, 64, 81, 100, 127])
    base = D.new_model(tiny_llama, 1, 6, [1], 127, draft_vocab=vocab)
    model = M.MFDModel.from_dflash(base, num_modes=2)
    model.break_symmetry(tiny_llama.embed(torch.tensor([127]))[0], 1.0)
    d = M.MFDDrafter(tiny_llama, model, budget=12)
    ref = _hf_greedy(tiny_llama, PROMPT, 24)
    assert SpeculativeDecoder(tiny_llama, d).generate(PROMPT, max_new_tokens=24).tokens == ref
    ids, _ = d.last_block_logprobs
    assert ids.shape[0] == 2 and 2 <= ids.shape[1] <= 5 and set(ids.flatten().tolist()) <= set(vocab.tolist())


def _markov_mfd_with_depth_temperatures(tmp_path, temps, first_draft=True):
    """A K=3 MFD sharing a DSpark head whose draft temperatures differ per depth (written into the folder's config,
    as calibrate.py does), its drafter and a greedy state after prefill."""
    target = tiny_target("llama", vocab_size=32, hidden_size=32, num_layers=2)
    folder = tmp_path / "dspark"
    model = _mfd_sharing_a_markov_head(target, folder, block_size=len(temps) + 1, mask_token_id=31,
                                       target_layer_ids=[0, 1], markov_first_draft=first_draft)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dflash_config"]["draft_temperatures"] = list(temps)
    (folder / "config.json").write_text(json.dumps(cfg))
    d = M.MFDDrafter(target, model, budget=14, markov=str(folder))  # markov_candidates 64 >= V: exact children
    return target, folder, d, prefilled_state(target, [5, 17, 2, 29, 12], d)


@pytest.mark.parametrize("first_draft", [True, False])
def test_a_shared_markov_head_gives_each_mode_its_own_corrected_children_at_each_depth(tmp_path, first_draft):
    """The tree of MFD + a shared DSpark head equals the conditional mixed tree built from an independent expander:
    mode m's children at depth d under a node of token t are the top-k of log_softmax((U_{m,d} + W2 W1[t]) / T_d),
    with the head's own per-depth draft temperatures T_d (here all different) and, when the head skips the first
    draft, no bias at depth 1. Tokens, parents, mode bits and scores match. Caught: every mode given mode 0's
    children, a cache key without the depth (the Markov correction lost below depth 1) and T_0 used at every
    depth."""
    from graft_block.drafters.dspark.checkpoint import load_checkpoint as load_dspark
    from graft_block.tree.mixed import conditional_mixed_ddtree

    temps = [1.0, 2.0, 0.5, 1.5]
    target, folder, d, st = _markov_mfd_with_depth_temperatures(tmp_path, temps, first_draft)
    dm = load_dspark(folder)
    assert dm.draft_temperatures.tolist() == temps and dm.markov_first_draft == first_draft
    with torch.inference_mode():
        tree = d.propose(st)
        hidden = d.mode_hidden(st)
        K, L = hidden.shape[0], len(temps)
        z = d.row_logits(hidden, 0, L).float()  # [K, L, V]: mode m's backbone logits per depth
        prev = torch.arange(32).expand(L, -1)  # the head's own bias per depth (none at depth 1 if it skips it)
        bias = dm.markov_project(dm.markov_latents(prev, draft_index=torch.arange(L)[:, None].expand(L, 32)))
        bias = bias.float()  # [depth - 1, prev token, V]
    k = max(d.marginal_topk, d.budget)

    def expand(m, depth, token):
        row = z[m, depth - 1] + bias[depth - 1, token]
        vals, ids = torch.log_softmax(row / temps[depth - 1], -1).topk(k)
        return ids.tolist(), vals.tolist()

    ref = conditional_mixed_ddtree(st.root_token, expand, d.budget, L, K)
    validate(tree, budget=d.budget, root_token=st.root_token)
    assert tree.tokens.tolist() == ref.tokens.tolist() and tree.parents.tolist() == ref.parents.tolist()
    assert tree.modes.tolist() == ref.modes.tolist()
    assert torch.allclose(tree.scores.double(), ref.scores.double(), atol=1e-4)
    assert int(tree.depths.max()) >= 3 and len(set(tree.modes[1:].tolist())) > 1  # deep, and modes disagree


def test_mixture_wta_and_balance_losses_against_the_best_modes_block_nll(tiny_qwen3):
    """With a flat gate (pi = 1/K): hard WTA (eps 0) trains the best mode's block NLL plus 0.1 * the gate's CE
    (log K); the mixture -log sum_k pi_k exp(-L_k) lies above the best mode's NLL; the anti-collapse term adds
    balance * KL(usage || uniform) = balance * (log K - usage entropy) >= 0."""
    import math

    cfg = {"num_layers": 2, "block_size": 6, "target_layer_ids": [0, 2], "num_anchors": 5, "num_modes": 4}
    model = M.training_model(tiny_qwen3, cfg, "target")
    with torch.no_grad():
        model.mode_gate.weight.zero_()
    batch = _batch(tiny_qwen3, model.feature_layers)
    base = dict(model.train_opts)

    def run(**opts):
        model.train_opts = {**base, **opts}
        with torch.no_grad():
            return M.training_loss(model, tiny_qwen3, {**batch, "generator": torch.Generator().manual_seed(1)})

    wta, m = run(mix_loss="wta", wta_eps=0.0, balance=0.0)
    assert float(wta) == pytest.approx(m["block_nll"] + 0.1 * math.log(4), rel=1e-5)
    relaxed, _ = run(mix_loss="wta", wta_eps=0.3, balance=0.0)
    assert float(relaxed) > float(wta)  # the losing modes' share only adds
    mix, mm = run(mix_loss="mixture", balance=0.0)
    assert mm["block_nll"] < float(mix)
    bal, mb = run(mix_loss="mixture", balance=0.5)
    assert 0 < float(bal - mix) == pytest.approx(0.5 * (math.log(4) - mb["usage_entropy"]), rel=1e-4)
