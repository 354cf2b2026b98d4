"""The shared training recipe: batched greedy and sampled data generation, the generic loop (loss goes down, resume),
and a trained DFlash drafter that saves, loads and reproduces its logits."""
import json
import re

import pytest
import torch

import graft_block.drafters.dflash as D
from graft_block.errors import ConfigError
from graft_block.testing import tiny_target
from graft_block import train_data as TD
from graft_block import training as T


@pytest.fixture(scope="module")
def tiny():
    return tiny_target("llama")


@pytest.fixture(scope="module")
def data(tiny, tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (int(n),), generator=g).tolist() for n in torch.randint(4, 12, (30,), generator=g)]
    folder = tmp_path_factory.mktemp("data") / "tiny"
    TD.generate_data(tiny, "tiny", prompts=prompts, max_new=32, batch_size=12, layers=(1, 3), topk=4, folder=folder,
                    log=lambda s: None)
    return folder


def test_batched_greedy_matches_unbatched(tiny, data):
    recs, meta = TD.load_records(data)
    assert meta["feature_layers"] == [1, 3] and len(recs) == 30
    for r in recs[:6]:
        ids = r["ids"].long().view(1, -1)
        P = r["prompt_len"]
        ref = tiny.model.generate(ids[:, :P], max_new_tokens=32, do_sample=False)[0, P:]
        assert torch.equal(ids[0, P:], ref)
        out = tiny.model(input_ids=ids, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[1][0], out.hidden_states[3][0]], -1)
        assert torch.allclose(feats[:-1], r["feats"][:-1].float(), atol=2e-2, rtol=1e-2)  # fp16 cache
        lp = torch.log_softmax(out.logits[0, P - 1:-1].float(), -1)
        assert torch.equal(r["top_ids"][P - 1:-1, 0].long(), ids[0, P:])  # greedy = top-1
        assert torch.allclose(r["top_logp"][P - 1:-1].float(), lp.gather(1, r["top_ids"][P - 1:-1].long()),
                              atol=1e-2)


def test_sampled_data_several_futures_per_prompt(tiny, tmp_path):
    """Sampled data: every prompt answered ``samples`` times, tokens drawn inside the warped support (top-k), the
    answers of one prompt differ, and the same seed regenerates the same data."""
    from graft_block.sampling import SamplingConfig

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (6,), generator=g).tolist() for _ in range(4)]
    cfg = SamplingConfig(temperature=1.5, top_k=5)

    def gen(folder):
        TD.generate_data(tiny, "s", prompts=prompts, max_new=16, batch_size=8, layers=(1, 3), topk=8, folder=folder,
                        log=lambda s: None, sampling=cfg, samples=3, seed=7)
        return TD.load_records(folder)

    recs, meta = gen(tmp_path / "a")
    assert len(recs) == 12 and "3 per prompt" in meta["source"]
    by_prompt = {}
    for r in recs:
        by_prompt.setdefault(tuple(r["ids"][: r["prompt_len"]].tolist()), []).append(tuple(r["ids"].tolist()))
    assert sorted(map(len, by_prompt.values())) == [3, 3, 3, 3]
    assert sum(len(set(v)) > 1 for v in by_prompt.values()) >= 3  # sampling, not greedy
    for r in recs:
        P, ids = r["prompt_len"], r["ids"].long()
        logits = tiny.model(input_ids=ids.view(1, -1)).logits[0, P - 1:-1]
        top5 = logits.topk(5, -1).indices
        assert (top5 == ids[P:, None]).any(-1).all()  # every drawn token is in the target's top-5
    again, _ = gen(tmp_path / "b")
    assert [r["ids"].tolist() for r in again] == [r["ids"].tolist() for r in recs]
    with pytest.raises(ConfigError, match="samples"):
        TD.generate_data(tiny, "s", prompts=prompts, folder=tmp_path / "c", samples=2)


def test_requesting_uncached_layers_fails(data):
    with pytest.raises(ConfigError, match="caches hidden_states"):
        TD.load_records(data, feature_layers=[2])


def test_epoch_batches_shard_by_rank():
    a = T.epoch_batches(40, 4, epoch=0, seed=0, rank=0, world=2)
    b = T.epoch_batches(40, 4, epoch=0, seed=0, rank=1, world=2)
    flat_a, flat_b = {i for x in a for i in x}, {i for x in b for i in x}
    assert not flat_a & flat_b and len(flat_a | flat_b) == 40
    assert T.epoch_batches(40, 4, 1, 0) != T.epoch_batches(40, 4, 0, 0)  # reshuffled per epoch
    assert T.lr_at(0, 100, 1.0, 0.04) < T.lr_at(3, 100, 1.0, 0.04) and T.lr_at(99, 100, 1.0, 0.04) < 0.2


def test_block_mask_semantics():
    m = D.block_attention_mask(torch.tensor([[2, 5]]), 8, 3, torch.float32)[0, 0] == 0
    assert m.shape == (6, 14)
    assert m[0, :2].all() and not m[0, 2:8].any()  # anchor 2: context 0..1 only
    assert m[3, :5].all() and not m[3, 5:8].any()
    assert m[0, 8:11].all() and not m[0, 11:].any()  # own block only, bidirectional
    assert m[5, 11:].all() and not m[5, 8:11].any()


def test_final_eval_reuses_the_loops_last_eval(tiny, data, tmp_path, monkeypatch):
    """A run whose last step falls on an eval step scores those weights once (an eval costs minutes on the real
    held-out set), and its final record carries that eval; a run that stops between evals still gets a final one."""
    calls = []
    real = T.evaluate
    monkeypatch.setattr(T, "evaluate", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "num_anchors": 4, "mask_token_id": 127, "block_size": 6}
    for steps, want in ((4, 3), (5, 4)):  # eval at 0, 2, 4 (+ a final one at 5)
        calls.clear()
        run = tmp_path / f"run{steps}"
        T.train("dflash", tiny, str(data), tmp_path / f"ck{steps}", run, cfg=cfg, init="random", steps=steps,
                lr=1e-3, batch_size=4, holdout=6, eval_every=2, log=lambda s: None, seed=0)
        log = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
        evals = [r for r in log if "eval" in r]
        assert len(calls) == want and evals[-1]["final"] and evals[-1]["step"] == steps
        if steps == 4:
            assert evals[-1]["eval"] == evals[-2]["eval"] and evals[-2]["step"] == 4


def test_training_lowers_loss_and_round_trips(tiny, data, tmp_path):
    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "num_anchors": 8, "mask_token_id": 127, "block_size": 6}
    T.train("dflash", tiny, str(data), tmp_path / "ck", tmp_path / "run", cfg=cfg, init="random",
            epochs=10, lr=3e-3, batch_size=4, holdout=6, eval_every=0, log=lambda s: None, seed=0)
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert log[0]["step"] == 0 and log[-1]["final"] and log[-1]["step"] == 60
    state = torch.load(tmp_path / "run" / "state.pt", weights_only=False)
    model = D.training_model(tiny, state["cfg"], None)
    model.load_state_dict(state["model"])
    # the loss on the training sequences went down (same anchors before and after)
    recs, _ = TD.load_records(data, feature_layers=model.feature_layers)
    init_model = D.training_model(tiny, cfg, "random")
    before = T.evaluate(D.DFlashDrafter, init_model, tiny, recs[6:], 4)["loss"]
    after = T.evaluate(D.DFlashDrafter, model, tiny, recs[6:], 4)["loss"]
    assert after < before - 0.5, (before, after)
    # the saved public checkpoint reproduces the trained model's logits
    loaded = D.load_checkpoint(tmp_path / "ck", dtype=torch.float32)
    cfgj = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfgj["type"] == "dflash" and cfgj["dflash_config"]["target_layer_ids"] == [0, 2]
    batch = TD.collate(recs[:2], tiny.device)
    ctx_a, ctx_b = model.fuse(batch["feats"]), loaded.fuse(batch["feats"])
    L = batch["ids"].shape[1]
    pos = torch.arange(L).view(1, -1).expand(2, -1)
    emb = tiny.embed(torch.tensor([[5, 127, 127, 127, 127, 127]] * 2))
    bp = torch.arange(10, 16).view(1, -1).expand(2, -1)
    with torch.no_grad():
        ha = model(emb, bp, model.context_kv(ctx_a[:, :10], pos[:, :10]))
        hb = loaded(emb, bp, loaded.context_kv(ctx_b[:, :10], pos[:, :10]))
    W = tiny.model.get_output_embeddings().weight
    # fp16 storage: logits agree to fp16 rounding and the argmax is the same
    la, lb = model.logits(ha, W), loaded.logits(hb, W)
    assert torch.allclose(la, lb, atol=5e-2, rtol=1e-2)
    assert torch.equal(la.argmax(-1), lb.argmax(-1))


def test_resume_continues(tiny, data, tmp_path):
    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "num_anchors": 4, "mask_token_id": 127, "block_size": 4}
    kw = dict(cfg=cfg, init="random", lr=1e-3, batch_size=4, holdout=4, eval_every=0, log=lambda s: None)
    r1 = T.train("dflash", tiny, str(data), tmp_path / "ck", tmp_path / "run", epochs=1, **kw)
    r2 = T.train("dflash", tiny, str(data), tmp_path / "ck", tmp_path / "run", epochs=2, resume=True, **kw)
    assert r2["step"] == 2 * r1["step"]
    # the learning curve beside the checkpoint spans both runs; tokens seen keep counting across the resume
    rows = (tmp_path / "ck" / "learning_curve.csv").read_text().splitlines()
    head = rows[0].split(",")
    assert head[:3] == ["step", "minutes", "tokens_seen"] and "loss" in head
    table = [dict(zip(head, r.split(","))) for r in rows[1:]]
    assert [int(r["step"]) for r in table] == [0, r1["step"], 2 * r1["step"]]
    seen = [int(r["tokens_seen"]) for r in table]
    assert seen[0] == 0 < seen[1] < seen[2] and seen[2] == 2 * seen[1]
    with pytest.raises(ConfigError, match="unknown drafter type"):
        T.train("nope", tiny, str(data), tmp_path / "x", tmp_path / "y")


def test_resume_rebuilds_a_run_started_from_a_checkpoint_folder(tiny, data, tmp_path):
    """A run started from a folder (here 3 layers reading target layers [0, 2]; a config that names neither builds
    another shape) resumes on the folder's shape; it used to rebuild the config's defaults and fail."""
    base = D.new_model(tiny, 3, 4, [0, 2], 127)
    D.save_checkpoint(base, tmp_path / "init", dtype=torch.float32)
    kw = dict(cfg={"num_anchors": 4}, lr=1e-3, batch_size=4, holdout=4, eval_every=0, log=lambda s: None)
    r1 = T.train("dflash", tiny, str(data), tmp_path / "ck", tmp_path / "run", epochs=1,
                 init=str(tmp_path / "init"), **kw)
    r2 = T.train("dflash", tiny, str(data), tmp_path / "ck", tmp_path / "run", epochs=2, resume=True, **kw)
    assert r2["step"] == 2 * r1["step"]
    loaded = D.load_checkpoint(tmp_path / "ck", dtype=torch.float32)
    assert len(loaded.layers) == 3 and list(loaded.target_layer_ids) == [0, 2]
    D.save_checkpoint(base, tmp_path / "other", dtype=torch.float32)
    with pytest.raises(ConfigError, match="started from --init"):  # the state's folder wins; another is refused
        T.train("dflash", tiny, str(data), tmp_path / "ck", tmp_path / "run", epochs=3, resume=True,
                init=str(tmp_path / "other"), **kw)


def test_separate_held_out_cache(tiny, data, tmp_path):
    """``eval_data``: every evaluation reads that cache (not a split of the training data) less any sequence whose
    prompt a training sequence shares, ``steps=0`` only evaluates the init, and a cache without the drafter's
    feature layers, or one the training data holds whole, is refused by name."""
    recs, _ = TD.load_records(data)
    g = torch.Generator().manual_seed(5)
    prompts = [r["ids"][: r["prompt_len"]].tolist() for r in recs[:2]]  # 2 prompts the training data also holds
    prompts += [torch.randint(3, 128, (7,), generator=g).tolist() for _ in range(3)]  # and 3 it does not
    held = tmp_path / "held"
    TD.generate_data(tiny, "held", prompts=prompts, max_new=16, batch_size=4, layers=(1, 3), topk=4, folder=held,
                    log=lambda s: None)
    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "num_anchors": 4, "mask_token_id": 127, "block_size": 4}
    lines = []
    ev = T.train("dflash", tiny, str(data), tmp_path / "ck", tmp_path / "run", cfg=cfg, init="random", steps=0,
                 eval_data=str(held), log=lines.append)
    model = D.training_model(tiny, cfg, "random")  # same seed, same init
    held_recs, _ = TD.load_records(held, feature_layers=model.feature_layers)
    held_recs = [r for r in held_recs if r["ids"][: r["prompt_len"]].tolist() not in prompts[:2]]
    assert len(held_recs) == 3
    ref = T.evaluate(D.DFlashDrafter, model, tiny, held_recs)
    assert ev["step"] == 0 and ev["loss"] == pytest.approx(ref["loss"]) and ev["rows"] == pytest.approx(ref["rows"])
    assert not (tmp_path / "ck").exists()  # nothing trained, nothing saved
    T.train("dflash", tiny, str(data), tmp_path / "ck", tmp_path / "run", cfg=cfg, init="random", steps=2,
            batch_size=4, eval_data=str(held), log=lines.append)
    assert any("30 train / 3 held-out sequences" in x for x in lines), lines
    bad = tmp_path / "bad"
    TD.generate_data(tiny, "bad", prompts=prompts, max_new=4, batch_size=4, layers=(1, 2), topk=4, folder=bad,
                    log=lambda s: None)
    with pytest.raises(ConfigError, match="caches hidden_states \\[1, 2\\]; the drafter needs \\[3\\]"):
        T.train("dflash", tiny, str(data), tmp_path / "ck2", tmp_path / "run2", cfg=cfg, init="random", steps=0,
                eval_data=str(bad), log=lines.append)
    with pytest.raises(ConfigError, match="nothing is held out"):  # the training data as its own held-out set
        T.train("dflash", tiny, str(data), tmp_path / "ck2", tmp_path / "run2", cfg=cfg, init="random", steps=0,
                eval_data=str(data), log=lines.append)


def test_warm_start_copies_target_layers(tiny):
    model = D.training_model(tiny, {"num_layers": 2, "target_layer_ids": [1, 2], "mask_token_id": 127,
                                    "block_size": 4}, "target")
    src = tiny.model.model.layers[3]
    assert torch.equal(model.layers[1].self_attn.q_proj.weight, src.self_attn.q_proj.weight)
    assert torch.equal(model.layers[1].mlp.down_proj.weight, src.mlp.down_proj.weight)
    H = tiny.hidden_size
    assert torch.equal(model.fc.weight[:, H:], torch.eye(H)) and not model.fc.weight[:, :H].any()


def test_a_topic_slice_keeps_the_sequences_whose_prompt_matches():
    """--where REGEX trains on the sequences whose decoded prompt matches (case-insensitive); the answer is not
    searched; a pattern matching nothing, or no pattern at all, is a clear error."""
    words = ["write", "python", "code", "a", "poem", "about", "def"]
    target = type("Words", (), {"decode": lambda self, ids: " ".join(words[i] for i in ids)})()
    recs = [{"ids": torch.tensor(p + a), "prompt_len": len(p)}
            for p, a in (([0, 1, 2], [3]), ([0, 3, 4], [6]), ([0, 4, 5, 1], [3]), ([6, 3], [4]))]
    got = T.topic_slice(recs, target, r"\bPYTHON\b|\bdef\b")
    assert [r["ids"].tolist() for r in got] == [[0, 1, 2, 3], [0, 4, 5, 1, 3], [6, 3, 4]]  # not [0, 3, 4] + def
    with pytest.raises(ConfigError, match="matches none of the 4 prompts"):
        T.topic_slice(recs, target, "rust")
    with pytest.raises(ConfigError, match="not a regular expression"):
        T.topic_slice(recs, target, "(code")


def test_holdout_spreads_over_lengths_and_drops_copied_answers():
    """Caches come in length buckets and on-policy answers repeat (canned replies to different prompts): the
    held-out set must span the list, and no training sequence may carry a held-out answer."""
    recs = [{"ids": torch.tensor([i, 100 + i, 7, 8 + i]), "prompt_len": 2} for i in range(40)]
    recs[5]["ids"] = torch.tensor([55, 56, 7, 8])  # same answer [7, 8] as record 0, another prompt
    held, train = T.split_holdout(recs, 4)
    assert [int(r["ids"][0]) for r in held] == [0, 13, 26, 39]  # evenly spread, not the first four
    assert len(train) == 40 - 4 - 1 and all(r is not recs[5] for r in train)
    answers = {tuple(r["ids"][2:].tolist()) for r in held}
    assert not any(tuple(r["ids"][2:].tolist()) in answers for r in train)
    assert T.split_holdout(recs, 0) == ([], recs)
    # multi-future data: another sample answering a held-out prompt must not train either
    recs[20]["ids"] = torch.tensor([13, 113, 9, 9])  # prompt of held-out record 13, its own answer
    held, train = T.split_holdout(recs, 4)
    assert len(train) == 40 - 4 - 2 and all(r is not recs[20] for r in train)
    with pytest.raises(ConfigError, match="holdout 40 leaves no training data"):
        T.split_holdout(recs, 40)


def test_a_legacy_teacher_forced_cache_is_held_out_by_its_answer_not_by_the_chat_header_every_record_shares(tiny):
    """Teacher-forced caches built before 2026-12-06 carry ``prompt_len`` 16, an anchor floor inside the chat
    template's header, which is the same for every conversation (SmolLM2: "<|im_start|>system\\nYou are a helpful
    AI assistant ..."): taking it for a prompt held out every training conversation along with the held-out ones."""
    g = torch.Generator().manual_seed(3)
    header = torch.randint(3, 128, (16,), generator=g).tolist()
    seqs = [(header + torch.randint(3, 128, (12,), generator=g).tolist(), 16) for _ in range(10)]
    recs = TD.teacher_forced_records(tiny, seqs, (1, 3), topk=4, labels=True)
    held, train = T.split_holdout(recs, 2)
    assert len(held) == 2 and len(train) == 8


def test_teacher_forced_text_is_held_out_by_its_user_turn_too():
    """Teacher-forced ``prompt_len`` ends after the templated user turn (``teacher_forced_data``), the same tokens as
    an on-policy prompt: a training conversation that repeats a held-out user turn (ShareGPT repeats prompts word
    for word) leaks it, whichever kind either record is, and is dropped."""
    g = torch.Generator().manual_seed(5)
    header = torch.randint(3, 128, (6,), generator=g).tolist()  # the chat header every conversation shares
    turns = [header + torch.randint(3, 128, (5,), generator=g).tolist() for _ in range(8)]  # prompt_len 11

    def rec(turn, reply_len, tf=True):
        ids = torch.tensor(turn + torch.randint(3, 128, (reply_len,), generator=g).tolist())
        return {"ids": ids, "prompt_len": len(turn), **({"labels": ids.roll(1)} if tf else {})}

    train = [rec(t, 9) for t in turns]
    held = [rec(turns[2], 7), rec(turns[5], 8, tf=False)]  # other replies to two training user turns
    kept = T.without_overlap(train, held)
    assert [r["ids"][:11].tolist() for r in kept] == [t for i, t in enumerate(turns) if i not in (2, 5)]
    # and the other way round: held-out teacher-forced text drops an on-policy answer to its user turn
    assert len(T.without_overlap([rec(turns[2], 9, tf=False), rec(turns[3], 9, tf=False)], held[:1])) == 1


def test_a_split_that_leaves_nothing_to_train_is_an_error_not_an_endless_loop(tiny, tmp_path):
    g = torch.Generator().manual_seed(4)
    answer = torch.randint(3, 128, (10,), generator=g).tolist()  # one canned answer to every prompt
    seqs = [(torch.randint(3, 128, (6,), generator=g).tolist() + answer, 6) for _ in range(6)]
    TD.forward_cache(tiny, seqs, tmp_path / "canned", "canned", batch_size=3, layers=(1, 3), topk=4,
                     log=lambda s: None)
    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "num_anchors": 4, "mask_token_id": 127, "block_size": 4}
    with pytest.raises(ConfigError, match="no training sequence"):
        T.train("dflash", tiny, str(tmp_path / "canned"), tmp_path / "ck", tmp_path / "run", cfg=cfg, init="random",
                steps=2, holdout=1, log=lambda s: None)


def test_eagle3_vocabulary_counts_the_training_split_not_the_first_records(data):
    """The loop holds out records spread over the data (``split_holdout``); EAGLE3's draft vocabulary, built from
    response-token counts, must skip those, not the first ``holdout`` records (which then leaked held-out tokens
    into the vocabulary and left training ones out)."""
    from graft_block.drafters.eagle3.training import response_token_counts

    recs, _ = TD.load_records(data)
    _, train = T.split_holdout(recs, 6)
    want = torch.zeros(128, dtype=torch.long)
    for r in train:
        want += torch.bincount(r["ids"][r["prompt_len"]:].long(), minlength=128)
    assert torch.equal(response_token_counts(str(data), 128, skip=6), want)


def test_eagle3_vocabulary_counts_a_teacher_forced_records_labels_not_its_human_text(tmp_path):
    """A teacher-forced record's ids after the prompt are human text; training learns its ``labels``."""
    import json

    from graft_block.drafters.eagle3.training import response_token_counts

    rec = {"ids": torch.tensor([1, 2, 5, 5, 5]), "prompt_len": 2, "labels": torch.tensor([0, 0, 7, 8, 8])}
    torch.save([rec], tmp_path / "b0.pt")
    (tmp_path / "meta.json").write_text(json.dumps({"shards": [{"batch": 0, "file": "b0.pt"}]}))
    counts = response_token_counts(str(tmp_path), 16)
    assert counts[7] == 1 and counts[8] == 2 and counts[5] == 0


def test_a_resumed_run_ends_with_the_weights_of_the_uninterrupted_run(tiny, data, tmp_path):
    """Same seed, same steps: stopping after one step (time limit) and resuming must reproduce the run that never
    stopped; the anchors drawn after the resume used to restart from the seed's first draws."""
    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "num_anchors": 4, "mask_token_id": 127, "block_size": 4}
    kw = dict(init="random", lr=1e-3, batch_size=4, holdout=4, eval_every=0, log=lambda s: None, seed=3, steps=6)
    T.train("dflash", tiny, str(data), tmp_path / "ckA", tmp_path / "runA", cfg=dict(cfg), **kw)
    T.train("dflash", tiny, str(data), tmp_path / "ckB", tmp_path / "runB", cfg=dict(cfg), time_limit_s=0.0, **kw)
    assert torch.load(tmp_path / "runB" / "state.pt", weights_only=False)["step"] == 1
    T.train("dflash", tiny, str(data), tmp_path / "ckB", tmp_path / "runB", cfg=dict(cfg), resume=True, **kw)
    a, b = (torch.load(tmp_path / r / "state.pt", weights_only=False)["model"] for r in ("runA", "runB"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_held_out_accepted_lengths_average_over_blocks_not_over_batches(tiny, data):
    """tau_tf and tau_exp are means over held-out blocks; a batch with fewer blocks (the last, partial one) must
    not weigh as much as a full one."""
    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "mask_token_id": 127, "block_size": 4, "eval_anchors": 64}
    model = D.training_model(tiny, cfg, "random")
    recs, _ = TD.load_records(data, feature_layers=model.feature_layers)
    held = recs[:10]  # batches of 4, 4 and 2 sequences
    g = torch.Generator().manual_seed(1234)  # evaluate's anchors
    sums, blocks, per_batch = {"tau_tf": 0.0, "tau_exp": 0.0}, 0, []
    model.eval()
    with torch.no_grad():
        for i in range(0, len(held), 4):
            batch = TD.collate(held[i: i + 4], tiny.device)
            batch["generator"] = g
            _, m = D.DFlashDrafter.training_loss(model, tiny, batch)
            n = sum(min(64, int(L) - 1 - int(p)) for L, p in zip(batch["lengths"], batch["prompt_len"]))
            for k in sums:
                sums[k] += m[k] * n
            blocks += n
            per_batch.append(m["tau_tf"])
    model.train()
    ev = T.evaluate(D.DFlashDrafter, model, tiny, held)
    assert sum(per_batch) / len(per_batch) != pytest.approx(sums["tau_tf"] / blocks)  # the test can tell them apart
    for k in sums:
        assert ev[k] == pytest.approx(sums[k] / blocks)


def test_every_torchrun_rank_starts_from_the_same_weights(tiny, tmp_path, monkeypatch):
    """Gradients are all-reduced but parameters never broadcast, so every rank must build the same initial model;
    EAGLE3's randomly initialised layer came from a generator seeded with seed + rank, one model per rank."""
    from graft_block.drafters.eagle3 import Eagle3Drafter

    g = torch.Generator().manual_seed(6)
    seqs = [(torch.randint(3, 128, (14,), generator=g).tolist(), 4) for _ in range(8)]
    TD.forward_cache(tiny, seqs, tmp_path / "d", "d", batch_size=4, layers=(1, 2), topk=4, log=lambda s: None)
    built = []
    real = Eagle3Drafter.training_model.__func__
    monkeypatch.setattr(Eagle3Drafter, "training_model", classmethod(
        lambda cls, *a, **k: built.append(real(cls, *a, **k)) or built[-1]))
    cfg = {"draft_vocab_size": 32, "token_counts": torch.ones(128), "feature_layers": [2, 2, 1]}
    for rank in (0, 1):
        monkeypatch.setattr(T, "_dist", lambda: (rank, 2))
        T.train("eagle3", tiny, str(tmp_path / "d"), tmp_path / "ck", tmp_path / f"run{rank}", cfg=dict(cfg),
                init="random", steps=0, holdout=2, log=lambda s: None, seed=1)
    a, b = (m.state_dict() for m in built)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_acceptance_label_is_the_overlap_with_the_target_even_when_its_top_k_is_outside_the_draft_vocab():
    """The confidence label and tau_exp read sum_v min(q, p) (DeepSpec's c*); a row whose target top-k lies wholly
    outside the draft vocabulary can accept nothing, where 1 - L1 / 2 read 0.5 (p is all zero there)."""
    from types import SimpleNamespace

    model = SimpleNamespace(draft_vocab=torch.tensor([0, 1, 2]))
    batch = {"top_ids": torch.tensor([[[3, 4]], [[0, 1]]]), "top_logp": torch.log(torch.tensor([[[0.6, 0.4]],
                                                                                               [[0.5, 0.5]]]))}
    opts = {"soft_weight": 0.0, "ce_weight": 1.0, "l1_weight": 1.0}
    rows = D.row_objective(model, torch.zeros(2, 3), torch.tensor([3, 0]), batch, torch.tensor([0, 1]), opts)
    assert rows["accept"].tolist() == pytest.approx([0.0, 2 / 3])
    assert not rows["accept"].requires_grad


def _capture_models(monkeypatch, klass) -> list:
    """The models ``T.train`` builds through ``klass.training_model``, in order."""
    built = []
    real = klass.training_model.__func__
    monkeypatch.setattr(klass, "training_model", classmethod(
        lambda cls, *a, **k: built.append(real(cls, *a, **k)) or built[-1]))
    return built


@pytest.mark.parametrize("kind", ["dspark", "mfd", "eagle3"])
def test_the_seed_governs_every_init_and_a_config_seed_overrides_it(tiny, data, tmp_path, monkeypatch, kind):
    """--seed draws the DSpark heads, MFD's mode vectors, EAGLE3's warm-start noise and the DFlash backbone (they
    read the drafter config's "seed", so two --seed values built the same model); the same seed builds the same
    model, and a "seed" in the config wins for the inits (its documented precedence) and is logged."""
    from graft_block.drafter import drafter_class

    block = {"num_layers": 1, "target_layer_ids": [0, 2], "mask_token_id": 127, "block_size": 4, "num_anchors": 4}
    cfg, init, parts = {
        "dspark": (dict(block, markov_rank=4), "random",
                   ("markov_head.markov_w1.weight", "confidence_head.proj.weight", "layers.0.mlp.up_proj.weight")),
        "mfd": (dict(block, num_modes=2), "random", ("mode_embed", "layers.0.mlp.up_proj.weight")),
        "eagle3": ({"draft_vocab_size": 32, "token_counts": torch.ones(128), "feature_layers": [1, 3, 3],
                    "warm_start": ["layer"]}, "target", ("midlayer.self_attn.q_proj.weight",))}[kind]
    built = _capture_models(monkeypatch, drafter_class(kind))
    lines = []
    for i, (seed, extra) in enumerate(((0, {}), (1, {}), (1, {}), (1, {"seed": 0}))):
        T.train(kind, tiny, str(data), tmp_path / f"ck{i}", tmp_path / f"run{i}", cfg={**cfg, **extra}, init=init,
                steps=0, holdout=2, seed=seed, log=lines.append)
    s0, s1, again, over = (m.state_dict() for m in built)
    assert all(torch.equal(s1[k], again[k]) for k in s1)  # reproducible from the command alone
    for k in parts:
        assert not torch.equal(s0[k], s1[k]), k
    assert all(torch.equal(s0[k], over[k]) for k in s0)
    assert sum("seed 0" in x and "--seed 1" in x for x in lines) == 1, lines


def test_continuing_a_calibrated_dspark_folder_resets_its_temperatures_and_says_calibrate_is_needed(tiny, data,
                                                                                                  tmp_path):
    """The temperatures calibrate.py fitted belong to the folder's weights; a continued run used to ship them
    unchanged with new heads. Now they are reset to 1 (logged), the saved config.json says calibration is needed,
    and calibrate.py's write removes that mark."""
    import graft_block.drafters.dspark as S
    from graft_block.drafter import Drafter
    from graft_block.drafters.dspark.calibrate import calibrate

    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "mask_token_id": 127, "block_size": 4, "num_anchors": 4,
           "markov_rank": 4}
    model = S.DSparkDrafter.training_model(tiny, dict(cfg), "random")
    model.confidence_temperatures = torch.tensor([0.7, 1.3, 2.0])
    model.draft_temperatures = torch.tensor([1.2, 1.5, 1.9])
    model.sampled_draft_temperatures = torch.tensor([1.4, 1.6, 2.2])
    S.DSparkDrafter.save_trained(model, tmp_path / "cal", cfg)
    lines = []
    T.train("dspark", tiny, str(data), tmp_path / "ck", tmp_path / "run", cfg={"num_anchors": 4},
            init=str(tmp_path / "cal"), steps=1, holdout=4, log=lines.append)
    loaded = S.load_checkpoint(tmp_path / "ck", dtype=torch.float32)
    assert loaded.confidence_temperatures.tolist() == [1.0] * 3 and loaded.draft_temperatures.tolist() == [1.0] * 3
    assert loaded.sampled_draft_temperatures is None
    note = json.loads((tmp_path / "ck" / "config.json").read_text())["calibration"]
    assert note["needed"] is True and "calibrate" in note["run"]
    assert all(k in note["why"] for k in ("confidence_temperatures", "draft_temperatures", "reset"))
    assert any("[init] calibration" in x and "reset" in x for x in lines), lines
    assert Drafter.from_config(str(tmp_path / "ck"), target=tiny).model.confidence_temperatures.tolist() == [1.0] * 3
    calibrate(tmp_path / "ck", str(data), holdout=4, target=tiny, min_rows=1, sampled_at=0.0)
    assert "calibration" not in json.loads((tmp_path / "ck" / "config.json").read_text())


def test_row_weights_start_at_one_for_the_first_draft():
    """Row j weighs exp(-j/gamma) from j = 0: MFD's mixture and WTA read the weighted block NLL unnormalised, so a
    constant factor (rows indexed from 1) changes what they train."""
    w = D.row_weights(4, 2.0, "cpu")
    assert torch.allclose(w, torch.exp(-torch.arange(4.0) / 2.0)) and float(w[0]) == 1.0


def test_target_l1_counts_the_draft_mass_outside_the_targets_top_k():
    """L1(q, p) over the whole vocabulary: |q - p| over the target's top-k plus q's mass on every other token."""
    from types import SimpleNamespace

    model = SimpleNamespace(draft_vocab=None)
    batch = {"top_ids": torch.tensor([[[0, 1]]]), "top_logp": torch.log(torch.tensor([[[0.5, 0.5]]]))}
    q = torch.tensor([[0.25, 0.25, 0.5]])
    l1, overlap = D.target_l1(q, model, batch, torch.tensor([0]), with_overlap=True)
    assert float(l1[0]) == pytest.approx(1.0)  # 0.25 + 0.25 on the top-k, 0.5 elsewhere (2 TV)
    assert float(overlap[0]) == pytest.approx(0.5)


def test_block_metrics_count_leading_rows_only():
    """tau_tf counts the rows before the first miss, tau_exp = 1 + sum_k prod_{j<=k} (1 - TV_j): a row after a
    rejection adds nothing, however good."""
    valid = torch.ones(1, 1, 3, dtype=torch.bool)
    ok = torch.ones(1, 1, dtype=torch.bool)
    m = D.block_metrics(torch.tensor([True, False, True]), valid, ok, torch.tensor([0.5, 0.5, 0.5]))
    assert m["accept_len"] == pytest.approx(1.0) and m["tau_tf"] == pytest.approx(2.0)
    assert m["tau_exp"] == pytest.approx(1.0 + 0.5 + 0.25 + 0.125)
    assert m["acc"] == pytest.approx(2 / 3) and m["acc_k1"] == pytest.approx(1.0)


def test_each_labels_target_distribution_is_read_from_the_row_before_it(tiny, data):
    """The cached top-k at data row t is the target's distribution of token t + 1: a block's label at anchor + j + 1
    reads row anchor + j (on greedy target data its top-1 is the label itself)."""
    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "mask_token_id": 127, "block_size": 4}
    model = D.training_model(tiny, cfg, "random")
    recs, _ = TD.load_records(data, feature_layers=model.feature_layers)
    batch = TD.collate(recs[:4], tiny.device)
    batch["generator"] = torch.Generator().manual_seed(0)
    blk = D.make_blocks(model, batch)
    k = batch["top_ids"].shape[-1]
    top1 = batch["top_ids"].reshape(-1, k)[blk["src"]][..., 0]
    valid = blk["valid"]
    assert int(valid.sum()) > 20 and torch.equal(top1[valid], blk["labels"][valid])
    # a label row is trained iff its anchor is and its token (anchor + j + 1) lies inside the sequence
    lab_pos = blk["anchors"].unsqueeze(-1) + torch.arange(1, valid.shape[-1] + 1)
    inside = lab_pos < batch["lengths"].view(-1, 1, 1)
    assert bool((~inside & blk["anchor_ok"].unsqueeze(-1)).any())  # some blocks run past the end
    assert torch.equal(valid, inside & blk["anchor_ok"].unsqueeze(-1))


def test_soft_weight_is_the_share_of_the_soft_ce():
    """CE = (1 - soft_weight) * hard CE + soft_weight * CE against the target's renormalised top-k."""
    from types import SimpleNamespace

    model = SimpleNamespace(draft_vocab=None)
    q = torch.tensor([[0.5, 0.25, 0.25]])
    batch = {"top_ids": torch.tensor([[[0, 2]]]), "top_logp": torch.log(torch.tensor([[[0.6, 0.15]]]))}
    loss, hard = D.row_losses(model, q.log(), torch.tensor([1]), batch, torch.tensor([0]), 0.25)
    soft = -(0.8 * torch.log(torch.tensor(0.5)) + 0.2 * torch.log(torch.tensor(0.25)))  # top-k renormalised
    assert float(hard[0]) == pytest.approx(-torch.log(torch.tensor(0.25)).item(), rel=1e-5)
    assert float(loss[0]) == pytest.approx(0.75 * float(hard[0]) + 0.25 * float(soft), rel=1e-5)


def test_unique_anchors_cover_a_short_span_and_never_repeat_in_a_long_one():
    """Unique anchors (DeepSpec's packing): a sequence with fewer valid positions than n gets each of them once,
    the rest marked invalid; a longer one gets n distinct response positions a with a + 1 in the sequence."""
    plen, lengths = torch.tensor([2, 3]), torch.tensor([6, 20])  # valid anchors 2..4 and 3..18
    for seed in range(5):
        a, ok = D.sample_anchors(plen, lengths, 8, torch.Generator().manual_seed(seed), unique=True)
        assert a.shape == ok.shape == (2, 8)
        assert int(ok[0].sum()) == 3 and sorted(a[0][ok[0]].tolist()) == [2, 3, 4]
        long = a[1][ok[1]]
        assert bool(ok[1].all()) and long.unique().numel() == 8 and int(long.min()) >= 3 and int(long.max()) <= 18
        a, ok = D.sample_anchors(plen, lengths, 8, torch.Generator().manual_seed(seed))  # with replacement
        assert bool(ok.all()) and bool(((a >= plen.view(-1, 1)) & (a <= lengths.view(-1, 1) - 2)).all())


def test_a_config_key_no_training_reads_is_refused(tmp_path):
    """A misspelt recipe key ("num_anchor") trained on with the default: every trainable drafter names its keys."""
    tiny = tiny_target("llama", engine="hf")
    for kind, typo in (("dflash", "num_anchor"), ("dspark", "markov_rnk"), ("mfd", "num_mode"), ("eagle3", "ttt")):
        with pytest.raises(ConfigError, match=f"{kind} training reads no config keys \\['{typo}'\\]; it reads: "):
            T.train(kind, tiny, "no-data", tmp_path / "ck", tmp_path / "run", cfg={typo: 1, "seed": 0})
    from graft_block.drafter import drafter_class

    for kind in ("dflash", "dspark", "mfd", "eagle3"):  # the loop writes these two into cfg: a resume reads them
        assert {"seed", "draft_vocab"} <= set(drafter_class(kind).training_keys)
    for kind in ("dflash", "dspark", "mfd"):  # one block recipe: its keys reach every block drafter
        assert set(D.RECIPE_KEYS) <= set(drafter_class(kind).training_keys)


def test_a_continued_model_keeps_its_architecture(tmp_path):
    """--init FOLDER --config '{"block_size": 8}' trained the folder's block of 16 without a word; the same key with
    the folder's own value is fine, and a new model's init-only keys beside a folder are a warning."""
    tiny = tiny_target("llama", engine="hf")
    D.save_checkpoint(D.new_model(tiny, 1, 6, [0, 2], 100), tmp_path / "ck", dtype=torch.float32,
                      extra={"type": "dflash"})
    ck = str(tmp_path / "ck")
    assert D.training_model(tiny, {"block_size": 6, "num_layers": 1}, ck).block_size == 6
    for key, value in (("block_size", 8), ("num_layers", 2), ("target_layer_ids", [1, 2]), ("mask_token_id", 7)):
        asked = re.escape(repr(value))
        with pytest.raises(ConfigError, match=rf"--init .*ck has {key} .* asks for {asked}: a continued model"):
            D.training_model(tiny, {key: value}, ck)
    with pytest.warns(UserWarning, match=r"\['init_layers'\] shape a new model's first weights and are ignored"):
        D.training_model(tiny, {"init_layers": [0]}, ck)
    from graft_block.drafters.dspark import training as DS

    with pytest.raises(ConfigError, match="has markov_rank 4 and the config asks for 8"):
        DS.training_model(tiny, {"markov_rank": 8}, _continued_dspark(tiny, tmp_path))


def _continued_dspark(tiny, tmp_path) -> str:
    from graft_block.drafters.dspark import DSparkDrafter

    model = DSparkDrafter.training_model(tiny, {"num_layers": 1, "target_layer_ids": [0, 2], "mask_token_id": 100,
                                               "block_size": 6, "markov_rank": 4}, "random")
    DSparkDrafter.save_trained(model, tmp_path / "ds", {})
    return str(tmp_path / "ds")


@pytest.mark.parametrize("key, value", [("unique_anchors", "false"), ("freeze_backbone", "no")])
def test_training_switches_are_booleans(key, value):
    """bool("false") is True: a quoted switch trained the opposite way."""
    from graft_block.drafters.dspark import training as DS

    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "mask_token_id": 100, "block_size": 6, key: value}
    with pytest.raises(ConfigError, match=f"{key} must be true or false, got {value!r}"):
        DS.training_model(tiny_target("llama", engine="hf"), cfg, "random")


@pytest.mark.parametrize("kind, key, value, words", [
    ("mfd", "score", "mixture", "score must be one of"),  # saved into config.json, refused only when loaded
    ("mfd", "wta_eps", 1.5, r"wta_eps must be a number in \[0.0, 1.0\]"),  # the winner's weight 1 - eps < 0
    ("mfd", "balance", "0.05", "balance must be a number"),
    ("dspark", "confidence_weight", -1.0, "confidence_weight must be a number in"),
    ("eagle3", "ttt_steps", 0, "ttt_steps must be an int >= 1"),  # died in the first backward
])
def test_training_numbers_are_checked_before_a_step(kind, key, value, words):
    from graft_block.drafter import drafter_class

    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "mask_token_id": 100, "block_size": 6, "seed": 0}
    if kind == "eagle3":
        cfg = {"token_counts": torch.ones(128), "draft_vocab_size": 32, "seed": 0}
    with pytest.raises(ConfigError, match=words):
        drafter_class(kind).training_model(tiny_target("llama", engine="hf"), {**cfg, key: value}, "random")


@pytest.mark.parametrize("key, value, words", [
    ("target_layer_ids", [], "target_layer_ids must be a non-empty list"),  # fell back to the default layers
    ("target_layer_ids", [0, 9], r"decoder-layer ids \(0..3\)"),
    ("init_layers", [-1], "init_layers must be a non-empty list"),  # counted from the end
    ("mask_token_id", 16.7, "mask_token_id must be a token id"),  # int() made it 16
    ("passthrough", 3, r"passthrough indexes target_layer_ids \(-3..2\)"),  # wrapped round to feature 0
    ("block_size", "16", "--config: block_size must be an integer >= 2, got .16."),
])
def test_a_new_models_keys_are_taken_as_written(key, value, words):
    with pytest.raises(ConfigError, match=words):
        D.training_model(tiny_target("llama", engine="hf"), {"num_layers": 1, key: value}, "target")
