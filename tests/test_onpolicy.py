"""The on-policy dataset: ids-only shards that are deterministic by prompt index, resumable and appendable, and
whose greedy answers are the target's own; the committed SmolLM2 data passes the same check."""
import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from graft_block import SpeculativeDecoder
from graft_block import onpolicy as OP
from graft_block.errors import ConfigError
from graft_block.sampling import SamplingConfig
from graft_block.testing import tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")
COMMITTED = Path(__file__).resolve().parents[1] / "drafters" / "data" / "smollm2-sharegpt"
HELDOUT = COMMITTED.with_name("smollm2-sharegpt-heldout")  # train-split prompts reserved (one backbone saw them)
CALIBRATION = COMMITTED.with_name("smollm2-sharegpt-calibration")  # ShareGPT's calibration split: never trained on


@pytest.fixture(scope="module")
def target():
    t = tiny_target("llama", vocab_size=96)
    t.model.generation_config.eos_token_id = 3  # so some answers stop early
    return t


def prompts(n=12):
    g = torch.Generator().manual_seed(0)
    return [(i, torch.randint(4, 96, (3 + i % 5,), generator=g).tolist()) for i in range(n)]


def test_greedy_shards_are_the_targets_own_answers(tmp_path, target):
    man = OP.generate(target, tmp_path, 0, 8, chunk=4, max_new=10, batch_size=3, prompts=prompts(), log=lambda *_: None)
    assert [s["file"] for s in man["shards"]] == ["greedy_000000-000004.npz", "greedy_000004-000008.npz"]
    z = np.load(tmp_path / man["shards"][0]["file"])
    assert z["ids"].dtype == np.uint16  # vocab 96 fits 16 bits
    recs = OP.read(tmp_path)
    assert [r["prompt_index"] for r in recs] == list(range(8))
    pool = dict(prompts())
    for r in recs:  # re-decode: one prompt at a time, our own loop, no batching or padding
        p = pool[r["prompt_index"]]
        assert r["ids"][: r["prompt_len"]].tolist() == p
        ref = SpeculativeDecoder(target).generate(torch.tensor(p), max_new_tokens=10).tokens
        assert r["ids"][r["prompt_len"]:].tolist() == ref, r["prompt_index"]
    assert OP.totals(tmp_path)["greedy"]["sequences"] == 8


def test_sampled_rows_depend_only_on_index_and_resume_appends(tmp_path, target):
    cfg = SamplingConfig(1.0, top_k=8)
    kw = dict(chunk=4, samples=2, sampling=cfg, seed=5, max_new=8, prompts=prompts(), log=lambda *_: None)
    OP.generate(target, tmp_path / "a", 0, 8, batch_size=8, **kw)
    OP.generate(target, tmp_path / "b", 0, 4, batch_size=3, **kw)   # other batching, first chunk only
    first = (tmp_path / "b" / "t1-p1-k8-x2_000000-000004.npz").stat().st_mtime_ns
    man = OP.generate(target, tmp_path / "b", 0, 8, batch_size=3, **kw)  # resume: appends the second chunk
    assert (tmp_path / "b" / "t1-p1-k8-x2_000000-000004.npz").stat().st_mtime_ns == first
    assert len(man["shards"]) == 2 and man["shards"][1]["first"] == 4
    a, b = OP.read(tmp_path / "a"), OP.read(tmp_path / "b")
    key = lambda r: (r["prompt_index"], r["sample"])  # noqa: E731
    assert [key(r) for r in a] == [key(r) for r in b] == [(i, j) for i in range(8) for j in range(2)]
    assert all(torch.equal(x["ids"], y["ids"]) for x, y in zip(a, b))
    assert any(not torch.equal(a[2 * i]["ids"], a[2 * i + 1]["ids"]) for i in range(8))  # two futures per prompt


def test_errors_name_the_problem(tmp_path, target):
    with pytest.raises(ConfigError, match="samples > 1 only with temperature > 0"):
        OP.generate(target, tmp_path, 0, 4, samples=2, prompts=prompts())
    OP.generate(target, tmp_path, 0, 4, chunk=4, max_new=6, prompts=prompts(), log=lambda *_: None)
    from graft_block import training as T

    with pytest.raises(ConfigError, match="--kinds gredy: .* holds no such shards; its kinds: greedy"):
        T.train("dflash", target, str(tmp_path), tmp_path / "ck", tmp_path / "run", online=True, kinds=["gredy"])
    with pytest.raises(ConfigError, match="max_new=6, not 9"):
        OP.generate(target, tmp_path, 4, 4, chunk=4, max_new=9, prompts=prompts())
    other = tiny_target("llama", vocab_size=96, seed=1)
    with pytest.raises(ConfigError, match="another target"):
        OP.generate(other, tmp_path, 4, 4, chunk=4, max_new=6, prompts=prompts())
    with pytest.raises(ConfigError, match="answers ShareGPT 'train' prompts, not 'calibration'"):
        OP.generate(target, tmp_path, 4, 4, chunk=4, max_new=6, prompts=prompts(), split="calibration")
    with pytest.raises(ConfigError, match="'eval' slice is the benchmark's"):
        OP.generate(target, tmp_path / "e", 0, 4, prompts=prompts(), split="eval")
    man = OP.generate(target, tmp_path / "c", 0, 4, chunk=4, max_new=6, prompts=prompts(), split="calibration",
                      log=lambda *_: None)
    assert man["split"] == "calibration" and "calibration split" in man["source"]
    (tmp_path / "greedy_000000-000004.npz").write_bytes(b"not a zip")
    with pytest.raises(ConfigError, match="corrupt"):
        OP.read(tmp_path)
    with pytest.raises(ConfigError, match="not an on-policy dataset"):
        OP.read(tmp_path / "nothing")


@pytest.mark.parametrize("bad, words", [(["--temperature", "-1"], "temperature must be"),
                                        (["--temperature", "1", "--top-p", "0"], "top_p must be"),
                                        (["--batch", "0"], "--batch must be >= 1"),
                                        (["--count", "0"], "--count must be >= 1"),
                                        (["--samples", "4"], "--samples must be 1, or more with --temperature > 0"),
                                        (["--after", "nowhere"], "--after nowhere is not an on-policy dataset"),
                                        (["--merge", "nowhere"], "--merge nowhere is not an on-policy dataset"),
                                        (["--prompts", "none.npz"], "--prompts none.npz does not exist")])
def test_bad_command_options_fail_before_the_target_loads(tmp_path, monkeypatch, refusal, bad, words):
    """A negative temperature used to make greedy shards silently, a missing --after folder to start at prompt 0."""
    monkeypatch.chdir(tmp_path)
    assert words in refusal(OP.main, ["--out", str(tmp_path / "out"), *bad])
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("folder", [COMMITTED, HELDOUT, CALIBRATION], ids=["train", "heldout", "calibration"])
def test_committed_smollm2_data_is_on_policy(smollm2, folder):
    """A few committed greedy answers, teacher-forced through SmolLM2: every response token is the target's argmax
    (a near-tie within 1e-4 may go either way: batched generation pads, so sums run in another order)."""
    if not (folder / OP.MANIFEST).exists():
        pytest.skip(f"{folder} is not committed")
    man = json.loads((folder / OP.MANIFEST).read_text())
    assert man["target_fingerprint"] == OP.fingerprint(smollm2)
    recs = [r for r in OP.read(folder, kinds=["greedy"])][:: 97][:4]
    assert recs
    with torch.inference_mode():
        for r in recs:
            ids, p = r["ids"], r["prompt_len"]
            logits = smollm2.model(input_ids=ids[None]).logits[0, p - 1: len(ids) - 1].float()
            best = logits.max(-1).values
            chosen = logits.gather(-1, ids[p:, None]).squeeze(-1)
            assert bool((best - chosen <= 1e-4 * best.abs().clamp(min=1)).all()), r["prompt_index"]


def test_heldout_prompts_are_not_in_the_training_data():
    """The held-out set is clean only while no training shard answers one of its prompts: the indices never meet,
    and the few ShareGPT prompts repeated verbatim (or canned answers) are what training's held-out filter drops."""
    from graft_block.training import without_overlap

    if not (HELDOUT / OP.MANIFEST).exists() or not (COMMITTED / OP.MANIFEST).exists():
        pytest.skip("the on-policy datasets are not committed")
    held = OP.read(HELDOUT)
    train = OP.read(COMMITTED)
    assert not {int(r["prompt_index"]) for r in held} & {int(r["prompt_index"]) for r in train}
    clean = without_overlap(held, train)
    assert 95 <= len(clean) < len(held)  # ShareGPT prompts that recur word for word (and canned answers) go
    prompts = {tuple(r["ids"][: r["prompt_len"]].tolist()) for r in train}
    answers = {tuple(r["ids"][r["prompt_len"]:].tolist()) for r in train}
    shared = [tuple(r["ids"][: r["prompt_len"]].tolist()) in prompts or tuple(r["ids"][r["prompt_len"]:].tolist())
              in answers for r in held]
    kept = {id(r) for r in clean}
    assert [not s for s in shared] == [id(r) in kept for r in held]  # exactly the shared ones are dropped


def test_training_cache_from_onpolicy_ids(tmp_path, target):
    """Features and soft labels are recomputed from the committed ids by one forward, in the trainer's format."""
    from graft_block import train_data as TD

    OP.generate(target, tmp_path / "ds", 0, 6, chunk=3, max_new=8, prompts=prompts(), log=lambda *_: None)
    cache = OP.training_cache(target, tmp_path / "ds", "x", batch_size=4, layers=[1, 3], topk=4,
                             folder=tmp_path / "cache", log=lambda *_: None)
    recs, meta = TD.load_records(cache)
    src = {r["ids"].tolist()[0:3].__repr__(): r for r in OP.read(tmp_path / "ds")}
    assert len(recs) == 6 and meta["feature_layers"] == [1, 3]
    for r in recs:
        ids = r["ids"].long()
        assert r["prompt_len"] == src[ids.tolist()[0:3].__repr__()]["prompt_len"]  # the real prompt, not a guess
        assert r["feats"].shape == (len(ids), 2 * target.hidden_size)
        # on-policy greedy ids: the target's top-1 at each answer position is the next id
        p = r["prompt_len"]
        assert r["top_ids"][p - 1: len(ids) - 1, 0].tolist() == ids[p:].tolist()
    with pytest.raises(ConfigError, match="another target"):
        OP.training_cache(tiny_target("llama", vocab_size=96, seed=1), tmp_path / "ds", "y", folder=tmp_path / "c2")
    # a cache for the shards added later holds exactly the prompts from that index on
    late = OP.training_cache(target, tmp_path / "ds", "z", batch_size=4, layers=[1, 3], topk=4,
                             folder=tmp_path / "c3", log=lambda *_: None, from_index=3)
    want = sorted(r["ids"].tolist() for r in OP.read(tmp_path / "ds") if r["prompt_index"] >= 3)
    assert sorted(r["ids"].tolist() for r in TD.load_records(late)[0]) == want and len(want) == 3


def test_merge_a_dataset_made_elsewhere(tmp_path, target):
    """What a GPU machine returns is merged in: extension starts after the last shard; overlaps are refused."""
    kw = dict(chunk=4, max_new=6, prompts=prompts(), log=lambda *_: None)
    OP.generate(target, tmp_path / "main", 0, 4, **kw)
    assert OP.next_index(tmp_path / "main", "greedy") == 4
    OP.generate(target, tmp_path / "gpu", OP.next_index(tmp_path / "main", "greedy"), 8, **kw)
    man = OP.merge(tmp_path / "gpu", tmp_path / "main", log=lambda *_: None)
    assert [(e["first"], e["end"]) for e in man["shards"]] == [(0, 4), (4, 8), (8, 12)]
    assert [r["prompt_index"] for r in OP.read(tmp_path / "main")] == list(range(12))
    with pytest.raises(ConfigError, match="overlap"):
        OP.merge(tmp_path / "gpu", tmp_path / "main")


def test_reserved_prompts_are_never_answered_nor_merged(tmp_path, target):
    """Held-out prompts stay out of training: generation skips a reserved index range, and a dataset made
    without the reservation (on another machine) loses those answers when it is merged into one that has it."""
    kw = dict(chunk=4, max_new=6, prompts=prompts(), log=lambda *_: None)
    man = OP.generate(target, tmp_path / "res", 0, 12, reserve=[[4, 6]], **kw)
    assert man["reserved"] == [[4, 6]]
    assert [r["prompt_index"] for r in OP.read(tmp_path / "res")] == [0, 1, 2, 3, 6, 7, 8, 9, 10, 11]
    OP.generate(target, tmp_path / "main", 0, 4, reserve=[[9, 11]], **kw)
    OP.generate(target, tmp_path / "gpu", 4, 8, **kw)  # knows nothing of the reservation
    man = OP.merge(tmp_path / "gpu", tmp_path / "main", log=lambda *_: None)
    assert [r["prompt_index"] for r in OP.read(tmp_path / "main")] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 11]
    dropped = [e for e in man["shards"] if e.get("dropped_reserved")]
    assert [(e["first"], e["sequences"], e["dropped_reserved"]) for e in dropped] == [(8, 2, 2)]
    assert OP.totals(tmp_path / "main")["greedy"]["sequences"] == 10


def test_generation_leaves_out_the_heldout_prompts_in_a_folder_without_them(tmp_path, target):
    """Only a folder whose manifest (or ``--after``) named the held-out range skipped it: a new folder answered
    ShareGPT train prompts 8576-8703. Now the built-in range is always left out (and logged), and
    ``answer_reserved`` (building the held-out set itself) waives it without writing it into the manifest."""
    g = torch.Generator().manual_seed(2)
    near = [(i, torch.randint(4, 96, (4,), generator=g).tolist()) for i in range(8570, 8580)]
    kw = dict(chunk=10, max_new=2, prompts=near)
    logs = []
    man = OP.generate(target, tmp_path / "new", 8570, 10, log=logs.append, **kw)
    assert [r["prompt_index"] for r in OP.read(tmp_path / "new")] == list(range(8570, 8576))
    assert man["reserved"] == [] and any("left out 4 prompts" in s and "8576-8703" in s for s in logs), logs
    OP.generate(target, tmp_path / "held", 8570, 10, answer_reserved=True, log=lambda *_: None, **kw)
    assert [r["prompt_index"] for r in OP.read(tmp_path / "held")] == list(range(8570, 8580))
    OP.generate(target, tmp_path / "file", 8570, 10, source="a prompt file", log=lambda *_: None, **kw)
    assert len(OP.read(tmp_path / "file")) == 10  # a prompt file's indices are its own, not ShareGPT's


def test_merge_leaves_out_the_builtin_heldout_prompts(tmp_path, target):
    """merge dropped only the destination's own ``reserved`` ranges: a ShareGPT folder answered with
    ``answer_reserved`` (or by an older generator) merged its held-out answers (8576-8703) into training data.
    Now merge leaves the built-in range out too (and says so), like generate; ``answer_reserved`` keeps them, and a
    prompt file's indices are its own."""
    g = torch.Generator().manual_seed(2)
    near = [(i, torch.randint(4, 96, (4,), generator=g).tolist()) for i in range(8570, 8580)]
    kw = dict(chunk=10, max_new=2, prompts=near, log=lambda *_: None)
    OP.generate(target, tmp_path / "held", 8570, 10, answer_reserved=True, **kw)
    logs = []
    man = OP.merge(tmp_path / "held", tmp_path / "train", log=logs.append)
    assert [r["prompt_index"] for r in OP.read(tmp_path / "train")] == list(range(8570, 8576))
    assert man["shards"][0]["dropped_reserved"] == 4 and any("8576, 8704" in s for s in logs), logs
    OP.merge(tmp_path / "held", tmp_path / "copy", log=lambda *_: None, answer_reserved=True)
    assert [r["prompt_index"] for r in OP.read(tmp_path / "copy")] == list(range(8570, 8580))
    OP.generate(target, tmp_path / "file", 8570, 10, source="a prompt file", **kw)
    OP.merge(tmp_path / "file", tmp_path / "file-copy", log=lambda *_: None)
    assert len(OP.read(tmp_path / "file-copy")) == 10


def test_committed_data_reserves_the_heldout_prompts():
    if not (HELDOUT / OP.MANIFEST).exists():
        pytest.skip("the on-policy datasets are not committed")
    held = {int(r["prompt_index"]) for r in OP.read(HELDOUT)}
    assert all(OP.is_reserved(i, OP.reserved(COMMITTED)) for i in held)
    assert OP.reserved(COMMITTED) == [list(r) for r in OP.RESERVED_PROMPTS["train"]]  # the built-in range is it


@pytest.mark.slow
def test_gpu_generation_script_runs_on_cpu(tmp_path, smollm2):
    """scripts/gpu_generate.sh, shrunk to a smoke run on the CPU (sizes x 0.002, 0.01 minutes: one shard per
    phase): the format, the size limits and the continuation after the committed data are those a GPU run returns."""
    import os
    import subprocess
    import sys

    out = tmp_path / "gpu"
    env = {**os.environ, "GRAFT_BLOCK_DEVICE": "cpu", "GRAFT_BLOCK_GEN_SCALE": "0.002", "PYTHON": sys.executable}
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_generate.sh"
    res = subprocess.run(["bash", str(script), str(out), "0.01"], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    files = list(out.iterdir())
    assert len(files) <= 8 and all(f.stat().st_size <= 16 << 20 for f in files)
    man = json.loads((out / OP.MANIFEST).read_text())
    start = OP.next_index(COMMITTED, "greedy")
    # since the 2026-12-04 GPU run the committed greedy answers cover the whole train split: no greedy shard is left
    last = max(i for i, _ in OP.train_prompts(smollm2, 320))
    assert {e["kind"] for e in man["shards"]} == {"t0.7-p0.8-k20-x4"} | ({"greedy"} if start <= last else set())
    assert all(e["first"] >= start for e in man["shards"] if e["kind"] == "greedy")
    assert man["reserved"] == OP.reserved(COMMITTED)
    recs = OP.read(out)
    assert recs and all(r["prompt_index"] >= start for r in recs if r["kind"] == "greedy")


def test_online_training_recomputes_the_cache_features(tmp_path, target, monkeypatch):
    """``train(online=True)`` feeds each step the features and soft labels the cache holds for the same ids
    (computed in other batches, so padding must not leak), and it learns: the held-out loss goes down."""
    from graft_block import train_data as TD
    from graft_block import training as T

    OP.generate(target, tmp_path / "ds", 0, 12, chunk=6, max_new=16, prompts=prompts(), log=lambda *_: None)
    cache = OP.training_cache(target, tmp_path / "ds", "x", batch_size=4, layers=[1, 3],
                              folder=tmp_path / "cache", log=lambda *_: None)
    cached = {tuple(r["ids"].tolist()): r for r in TD.load_records(cache)[0]}
    fed = []
    monkeypatch.setattr(T, "collate", lambda recs, device: fed.extend(recs) or TD.collate(recs, device))
    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "num_anchors": 8, "mask_token_id": 95, "block_size": 4}
    res = T.train("dflash", target, str(tmp_path / "ds"), tmp_path / "ck", tmp_path / "run", cfg=cfg,
                  init="random", steps=30, lr=3e-3, batch_size=4, holdout=3, eval_every=0, online=True,
                  keep_best=True, log=lambda *_: None)
    assert len(fed) >= 30  # every step and both evaluations went through collate
    for rec in fed:
        ref = cached[tuple(rec["ids"].tolist())]
        assert rec["prompt_len"] == ref["prompt_len"]
        assert rec["feats"].shape == ref["feats"].shape == (len(rec["ids"]), 2 * target.hidden_size)
        assert torch.allclose(rec["feats"].float(), ref["feats"].float(), atol=1e-2, rtol=1e-2)
        assert torch.equal(rec["top_ids"][:, 0], ref["top_ids"][:, 0])
        assert torch.allclose(rec["top_logp"].float(), ref["top_logp"].float(), atol=1e-2)
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert res["step"] == 30 and log[-1]["eval"]["loss"] < log[0]["eval"]["loss"] - 0.3, (log[0], log[-1])
    best = json.loads((tmp_path / "ck-best" / "best_step.json").read_text())  # keep_best: the higher of 0 and 30
    assert best["step"] in (0, 30) and best["tau_tf"] == max(log[0]["eval"]["tau_tf"], log[-1]["eval"]["tau_tf"])
    assert (tmp_path / "ck-best" / "model.safetensors").exists()
    with pytest.raises(ConfigError, match="draft"):
        T.train("dflash", target, str(tmp_path / "ds"), tmp_path / "ck2", tmp_path / "run2", cfg=cfg,
                init="random", steps=1, holdout=2, draft_vocab_size=32, online=True, log=lambda *_: None)
    with pytest.raises(ConfigError, match="another target"):
        T.train("dflash", tiny_target("llama", vocab_size=96, seed=1), str(tmp_path / "ds"), tmp_path / "ck3",
                tmp_path / "run3", cfg=cfg, init="random", steps=1, holdout=2, online=True, log=lambda *_: None)
    # the data grew since the run started: resuming would reshuffle its held-out split, so it is refused
    OP.generate(target, tmp_path / "ds", 12, 6, chunk=6, max_new=16, prompts=prompts(18), log=lambda *_: None)
    with pytest.raises(ConfigError, match="held-out split"):
        T.train("dflash", target, str(tmp_path / "ds"), tmp_path / "ck", tmp_path / "run", cfg=cfg, steps=40,
                batch_size=4, holdout=3, resume=True, online=True, log=lambda *_: None)


def test_autocast_runs_each_steps_forwards_in_bfloat16_and_evaluates_in_float32(tmp_path, target, monkeypatch):
    """``train(autocast="bfloat16")``: the online target forward and the drafter's loss run under bf16 autocast,
    held-out evaluation does not (its figures compare with float32 runs), the weights stay float32, and it learns
    as the float32 run does."""
    from graft_block import training as T
    from graft_block.drafter import drafter_class

    OP.generate(target, tmp_path / "ds", 0, 12, chunk=6, max_new=16, prompts=prompts(), log=lambda *_: None)
    seen = {"feat": [], "loss": [], "eval": []}

    def autocast_now():
        return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu")

    def spy(owner, name, note):  # record the autocast state at every call, then call through
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, **k: (note(*a), real(*a, **k))[1])

    spy(T, "teacher_forced_records", lambda *a: seen["feat"].append(autocast_now()))
    spy(T, "evaluate", lambda *a: seen["eval"].append(torch.is_autocast_enabled("cpu")))
    spy(drafter_class("dflash"), "training_loss",
        lambda model, *a: seen["loss"].append((autocast_now(), {p.dtype for p in model.parameters()})))
    cfg = {"num_layers": 1, "target_layer_ids": [0, 2], "num_anchors": 8, "mask_token_id": 95, "block_size": 4}
    res = T.train("dflash", target, str(tmp_path / "ds"), tmp_path / "ck", tmp_path / "run", cfg=cfg,
                  init="random", steps=30, lr=3e-3, batch_size=4, holdout=3, eval_every=0, online=True,
                  autocast="bfloat16", log=lambda *_: None)
    n_eval_feats = 1  # the held-out split's features: computed once, before the loop, in float32
    assert seen["feat"][:n_eval_feats] == [False] and set(seen["feat"][n_eval_feats:]) == {torch.bfloat16}
    steps = [d for d, dts in seen["loss"] if dts == {torch.float32}]  # the evaluations score through it too
    assert len(steps) == len(seen["loss"]) and steps.count(torch.bfloat16) == 30
    assert steps.count(False) == len(seen["eval"]) == 2 and not any(seen["eval"])  # step 0 and the final one
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert res["step"] == 30 and log[-1]["eval"]["loss"] < log[0]["eval"]["loss"] - 0.3, (log[0], log[-1])
    with pytest.raises(ConfigError, match="autocast 'float16': use one of bfloat16"):
        T.train("dflash", target, str(tmp_path / "ds"), tmp_path / "ck2", tmp_path / "run2", cfg=cfg,
                init="random", steps=1, holdout=3, online=True, autocast="float16", log=lambda *_: None)


def test_a_cache_built_under_autocast_says_so_and_is_extended_only_the_same_way(tmp_path, target):
    """``training_cache(autocast="bfloat16")``: features and soft labels near the float32 cache's, the meta records
    the setting, and extending that cache in float32 (or a float32 cache under autocast) is refused."""
    from graft_block import train_data as TD

    OP.generate(target, tmp_path / "ds", 0, 12, chunk=6, max_new=16, prompts=prompts(), log=lambda *_: None)
    build = functools.partial(OP.training_cache, target, tmp_path / "ds", "x", batch_size=4, layers=[1, 3],
                              log=lambda *_: None)
    ref = build(folder=tmp_path / "f32")
    half = build(folder=tmp_path / "bf16", autocast="bfloat16")
    with pytest.raises(ConfigError, match="built with autocast bfloat16, this run asks for None"):
        build(folder=tmp_path / "bf16")
    with pytest.raises(ConfigError, match="built with autocast None, this run asks for bfloat16"):
        build(folder=tmp_path / "f32", autocast="bfloat16")
    build(folder=tmp_path / "bf16", autocast="bfloat16")  # the same setting resumes (nothing left to do)
    assert json.loads((half / "meta.json").read_text())["autocast"] == "bfloat16"
    f32 = {tuple(r["ids"].tolist()): r for r in TD.load_records(ref)[0]}
    recs = TD.load_records(half)[0]
    assert len(recs) == len(f32)
    same_top = []
    for r in recs:
        q = f32[tuple(r["ids"].tolist())]
        assert not torch.equal(r["feats"], q["feats"])  # computed in bfloat16, not a copy of the float32 run
        a, b = r["feats"].float(), q["feats"].float()
        assert (a - b).norm() < 0.05 * b.norm(), float((a - b).norm() / b.norm())  # bfloat16's rounding, no more
        same_top.append(r["top_ids"][:, 0] == q["top_ids"][:, 0])
    assert torch.cat(same_top).float().mean() > 0.85  # a random tiny target has near-ties; SmolLM2 few


def test_autocast_warns_on_a_cpu_without_amx(monkeypatch):
    """Without AMX tiles torch's bfloat16 products are slower than float32: asking for autocast there warns."""
    from graft_block import train_data as TD

    monkeypatch.setattr(TD, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    with pytest.warns(UserWarning, match="without AMX tiles"):
        TD.autocast_context("cpu", "bfloat16")
    monkeypatch.setattr(TD, "cpu_flags", lambda: {"avx512f", "amx_bf16", "amx_tile"})
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with TD.autocast_context("cpu", "bfloat16")():
            assert torch.is_autocast_enabled("cpu")
        TD.autocast_context("cpu", None)


def test_a_prompt_file_is_answered_and_named_in_the_manifest(tmp_path, target):
    """``--prompt-file``: any JSONL prompt file (here token-id turns, for the tokenizer-less tiny target) is
    answered like ShareGPT's prompts, and the manifest names the file so that no other source extends it."""
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"id": i, "turns": [ids]}) for i, ids in prompts(6)) + "\n")
    pool = OP.file_prompts(target, path, max_prompt_tokens=6)
    assert pool == [(i, ids) for i, ids in prompts(6) if len(ids) <= 6]
    man = OP.generate(target, tmp_path / "d", 0, 6, chunk=6, max_new=5, prompts=pool, source="prompt file p.jsonl",
                      log=lambda *_: None)
    assert man["source"] == "prompt file p.jsonl"
    assert [r["prompt_index"] for r in OP.read(tmp_path / "d")] == [i for i, _ in pool]
    with pytest.raises(ConfigError, match="answers 'prompt file p.jsonl', not 'prompt file q.jsonl'"):
        OP.generate(target, tmp_path / "d", 6, 6, chunk=6, max_new=5, prompts=pool, source="prompt file q.jsonl")
    with pytest.raises(ConfigError, match="not .ShareGPT train split"):  # nor is it extended with ShareGPT's answers
        OP.generate(target, tmp_path / "d", 6, 6, chunk=6, max_new=5, prompts=pool)


@pytest.mark.parametrize("bad, words", [(["--prompt-file", "none.jsonl"], "--prompt-file none.jsonl does not exist"),
                                        (["--prompt-file", "p.jsonl", "--split", "calibration"],
                                         "--prompt-file replaces the ShareGPT prompts")])
def test_bad_prompt_file_options_fail_before_the_target_loads(tmp_path, monkeypatch, refusal, bad, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    assert words in refusal(OP.main, ["--out", str(tmp_path / "out"), *bad])


def test_merge_refuses_another_split_or_prompt_source(tmp_path, target):
    """Prompt indices count positions in one prompt list: calibration answers (held-out data) or a prompt file's
    answers merged into a train dataset would pass as train prompts of the same indices. Generation refuses to mix
    sources in a folder; so does a merge."""
    kw = dict(chunk=4, max_new=6, prompts=prompts(), log=lambda *_: None)
    OP.generate(target, tmp_path / "train", 0, 4, **kw)
    OP.generate(target, tmp_path / "calib", 4, 4, split="calibration", **kw)
    OP.generate(target, tmp_path / "file", 8, 4, source="prompt file p.jsonl", **kw)
    with pytest.raises(ConfigError, match="prompt split differs"):
        OP.merge(tmp_path / "calib", tmp_path / "train", log=lambda *_: None)
    with pytest.raises(ConfigError, match="prompt source differs"):
        OP.merge(tmp_path / "file", tmp_path / "train", log=lambda *_: None)
    assert [r["prompt_index"] for r in OP.read(tmp_path / "train")] == [0, 1, 2, 3]
    man = OP.merge(tmp_path / "calib", tmp_path / "calib-copy", log=lambda *_: None)  # a new folder takes its split
    assert man["split"] == "calibration" and len(OP.read(tmp_path / "calib-copy")) == 4


def test_a_rerun_regenerates_a_deleted_or_unrecorded_shard_once(tmp_path, target):
    """A shard counts as done when the manifest records it and its file is there. Deleting a corrupt shard and
    rerunning (read()'s advice) used to record it a second time (its answers read twice), and a file left without
    a manifest entry (a run killed while writing it) was skipped for good (its answers silently missing)."""
    kw = dict(chunk=4, max_new=6, prompts=prompts(), log=lambda *_: None)
    OP.generate(target, tmp_path, 0, 8, **kw)
    want = [r["ids"].tolist() for r in OP.read(tmp_path)]
    (tmp_path / "greedy_000000-000004.npz").unlink()
    OP.generate(target, tmp_path, 0, 8, **kw)
    assert [r["prompt_index"] for r in OP.read(tmp_path)] == list(range(8))
    assert OP.totals(tmp_path)["greedy"] == {**OP.totals(tmp_path)["greedy"], "shards": 2, "sequences": 8}
    (tmp_path / "greedy_000008-000012.npz").write_bytes(b"PK\x03\x04 cut short")  # written, never recorded
    OP.generate(target, tmp_path, 0, 12, **kw)
    assert [r["prompt_index"] for r in OP.read(tmp_path)] == list(range(12))
    assert [r["ids"].tolist() for r in OP.read(tmp_path)][:8] == want


def test_a_feature_cache_is_resumed_only_over_the_same_sequences(tmp_path, target):
    """A cache resumes by skipping the batch indices it holds; once the dataset grew, those indices hold other
    sequences, so "extending" the cache repeated some answers and left others out. It is refused instead (a cache
    of the added shards is --from-index), and a rerun over the same sequences still resumes."""
    from graft_block import train_data as TD

    kw = dict(chunk=6, max_new=8, prompts=prompts(), log=lambda *_: None)
    cache = dict(batch_size=4, layers=[1, 3], topk=4, folder=tmp_path / "cache", log=lambda *_: None)
    OP.generate(target, tmp_path / "ds", 0, 6, **kw)
    OP.training_cache(target, tmp_path / "ds", "x", **cache)
    OP.training_cache(target, tmp_path / "ds", "x", **cache)  # same sequences: nothing to add, no refusal
    OP.generate(target, tmp_path / "ds", 6, 6, **kw)
    with pytest.raises(ConfigError, match="other sequences"):
        OP.training_cache(target, tmp_path / "ds", "x", **cache)
    assert sorted(r["ids"].tolist() for r in TD.load_records(tmp_path / "cache")[0]) == \
        sorted(r["ids"].tolist() for r in OP.read(tmp_path / "ds") if r["prompt_index"] < 6)


def test_merge_refuses_a_shard_that_starts_before_and_overlaps_one_of_the_same_kind(tmp_path, target):
    """Mutation test: an incoming shard [2, 6) overlaps [4, 8) though its first index lies before it; a sampled
    shard over the same indices is another kind and merges."""
    kw = dict(chunk=4, max_new=4, prompts=prompts(), log=lambda *_: None)
    OP.generate(target, tmp_path / "main", 4, 4, **kw)
    OP.generate(target, tmp_path / "gpu", 2, 4, **kw)
    with pytest.raises(ConfigError, match="overlap"):
        OP.merge(tmp_path / "gpu", tmp_path / "main", log=lambda *_: None)
    OP.generate(target, tmp_path / "sampled", 4, 4, sampling=SamplingConfig(1.0, top_k=8), **kw)
    man = OP.merge(tmp_path / "sampled", tmp_path / "main", log=lambda *_: None)
    assert sorted((e["kind"], e["first"], e["end"]) for e in man["shards"]) == [
        ("greedy", 4, 8), ("t1-p1-k8-x1", 4, 8)]


def test_merge_drops_a_reserved_range_that_starts_before_the_shard(tmp_path, target):
    """Mutation test: the destination reserves [2, 6); an incoming shard [4, 8) loses its answers to 4 and 5."""
    kw = dict(chunk=4, max_new=4, prompts=prompts(), log=lambda *_: None)
    OP.generate(target, tmp_path / "main", 0, 4, reserve=[[2, 6]], **kw)
    OP.generate(target, tmp_path / "gpu", 4, 4, **kw)
    OP.merge(tmp_path / "gpu", tmp_path / "main", log=lambda *_: None)
    assert [r["prompt_index"] for r in OP.read(tmp_path / "main")] == [0, 1, 6, 7]


def test_next_index_follows_the_shards_of_the_asked_kind_only(tmp_path, target):
    """Mutation test: a folder with greedy [0, 4) and sampled [0, 8) extends greedy from 4, sampled from 8."""
    kw = dict(chunk=4, max_new=3, prompts=prompts(), log=lambda *_: None)
    OP.generate(target, tmp_path, 0, 4, **kw)
    OP.generate(target, tmp_path, 0, 8, sampling=SamplingConfig(1.0, top_k=8), **kw)
    assert OP.next_index(tmp_path, "greedy") == 4
    assert OP.next_index(tmp_path, "t1-p1-k8-x1") == 8
    assert OP.next_index(tmp_path / "none", "greedy") == 0


def test_an_extended_folder_keeps_the_reserved_ranges_it_was_made_with(tmp_path, target):
    """Mutation test: a folder made with reserve [4, 6) and extended without it still leaves 4 and 5 out."""
    kw = dict(chunk=4, max_new=3, prompts=prompts(), log=lambda *_: None)
    OP.generate(target, tmp_path, 0, 4, reserve=[[4, 6]], **kw)
    man = OP.generate(target, tmp_path, 4, 4, **kw)
    assert man["reserved"] == [[4, 6]]
    assert [r["prompt_index"] for r in OP.read(tmp_path)] == [0, 1, 2, 3, 6, 7]


def test_saved_prompts_load_back_whole_and_only_under_the_same_cap(tmp_path, target, monkeypatch):
    """Mutation test: ``save_prompts`` -> ``load_prompts`` gives every (index, ids) pair back whole, and a file
    written under another max_prompt_tokens is refused."""
    pool = [(0, [5, 6, 7]), (2, [8]), (5, [9, 10, 11, 12])]
    monkeypatch.setattr(OP, "train_prompts", lambda target, cap: pool)
    assert OP.save_prompts(target, tmp_path / "p.npz", 6) == 3
    assert OP.load_prompts(target, tmp_path / "p.npz", 6) == pool
    with pytest.raises(ConfigError, match="max_prompt_tokens=6"):
        OP.load_prompts(target, tmp_path / "p.npz", 7)


def test_merge_refuses_a_dataset_made_under_another_prompt_cap(tmp_path, target):
    """Mutation test: max_prompt_tokens sets which prompts a folder answers, so folders made under two caps do
    not merge."""
    kw = dict(chunk=4, max_new=3, prompts=prompts(), log=lambda *_: None)
    OP.generate(target, tmp_path / "main", 0, 4, **kw)
    OP.generate(target, tmp_path / "gpu", 4, 4, max_prompt_tokens=6, **kw)
    with pytest.raises(ConfigError, match="max_prompt_tokens differs"):
        OP.merge(tmp_path / "gpu", tmp_path / "main", log=lambda *_: None)
