"""Training-data caches (graft_block.train_data): what a resumed cache holds and what the draft vocabulary counts."""
import pytest
import torch

from graft_block import train_data as TD
from graft_block.errors import ConfigError
from graft_block.testing import tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", vocab_size=96)


def prompt_ids(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(4, 96, (3 + i % 5,), generator=g).tolist() for i in range(n)]


def test_generated_data_resumes_only_with_the_same_prompts_and_batches(tmp_path, target):
    """Shard b is the b-th batch of the length-sorted prompts: another prompt count or batch size gives batch b
    other prompts, so a resume with them repeated some answers and skipped others. It is refused."""
    kw = dict(max_new=4, layers=[1, 2], topk=4, folder=tmp_path, log=lambda *_: None)
    TD.generate_data(target, "x", prompts=prompt_ids(6), batch_size=4, **kw)
    TD.generate_data(target, "x", prompts=prompt_ids(6), batch_size=4, **kw)  # the same: resumes, adds nothing
    assert len(TD.load_records(tmp_path)[0]) == 6
    with pytest.raises(ConfigError, match="other sequences"):
        TD.generate_data(target, "x", prompts=prompt_ids(12), batch_size=4, **kw)
    with pytest.raises(ConfigError, match="other sequences"):
        TD.generate_data(target, "x", prompts=prompt_ids(6), batch_size=3, **kw)
    assert sorted(r["ids"][: r["prompt_len"]].tolist() for r in TD.load_records(tmp_path)[0]) == sorted(prompt_ids(6))


def test_the_draft_vocabulary_counts_a_teacher_forced_records_labels_not_its_human_text():
    """A teacher-forced record trains on ``labels`` (the target's argmax), never on its human reply ``ids``: the
    vocabulary used to weigh the human tokens as the real labels and could keep them over the target's."""
    L = 10
    human = torch.full((L,), 50, dtype=torch.int32)
    labels = torch.full((L,), 7, dtype=torch.int32)
    top = torch.stack([torch.roll(labels, -1), torch.full((L,), 9, dtype=torch.int32)], -1)  # row t: token t + 1
    rec = {"ids": human, "labels": labels, "prompt_len": 2, "top_ids": top}
    assert TD.draft_vocab_from_data([rec], 1).tolist() == [7]
    greedy = {"ids": labels, "prompt_len": 2, "top_ids": top}  # on-policy answers: ids are the labels
    assert TD.draft_vocab_from_data([greedy], 1).tolist() == [7]


def test_split_prompts_leave_out_text_that_recurs_in_a_split_kept_from_training(target, monkeypatch):
    """ShareGPT's splits are cut by conversation index, and its prompts recur word for word (57 of the 487
    calibration prompts, 45 of the 483 eval ones are also train prompts; 3 of the "full" suite's first 20). Train
    prompts now leave out text of the calibration and eval splits, calibration prompts text of the train split;
    an index stays the prompt's position in its split."""
    from graft_block import data

    splits = {"train": [[5, 6], [7, 8], [9, 10], [11, 12]], "calibration": [[7, 8], [13, 14]],
              "eval": [[11, 12], [15, 16]]}
    monkeypatch.setattr(data, "sharegpt", lambda split="train", limit=None: [
        {"id": f"{split}/{i}", "turns": [t], "reference": None} for i, t in enumerate(splits[split])][:limit])
    assert TD.train_prompts(target, 8) == [(0, [5, 6]), (2, [9, 10])]
    assert TD.train_prompts(target, 8, split="calibration") == [(1, [13, 14])]
    assert TD.train_prompts(target, 8, limit=2) == [(0, [5, 6])]


class HeaderChat:
    """A chat template shaped like SmolLM2's: a 20-token system header, then per turn a role id, its content
    (5 ids naming a user turn's text, 40 for a reply) and an end id; the generation prompt is the assistant id."""
    HEADER = [10] * 20

    def apply_chat_template(self, msgs, add_generation_prompt=False, tokenize=True):
        ids = list(self.HEADER)
        for m in msgs:
            body = [4 + ord(m["content"][0]) - ord("a")] * 5 if m["role"] == "user" else [5] * 40
            ids += [11 if m["role"] == "user" else 12, *body, 13]
        return ids + [12] * add_generation_prompt


def user_token(rec):
    return int(rec["ids"][len(HeaderChat.HEADER) + 1])


def fake_sharegpt(monkeypatch, train, others=(), reference="reply"):
    """``data.sharegpt`` over the given train-split texts (None: no reference reply) and no other splits' text."""
    from graft_block import data

    def split(name="train", limit=None):
        texts = train if name == "train" else others
        return [{"id": f"{name}/{i}", "turns": [t or "a"], "reference": reference if t else None}
                for i, t in enumerate(texts)][:limit]

    monkeypatch.setattr(data, "sharegpt", split)


def test_teacher_forced_text_leaves_out_conversations_whose_prompt_recurs_in_a_kept_split(target, monkeypatch,
                                                                                         tmp_path):
    fake_sharegpt(monkeypatch, ["a", "b", "c"], others=["b", "z"])
    monkeypatch.setattr(target, "tokenizer", HeaderChat(), raising=False)
    TD.teacher_forced_data(target, "tf", num_convs=3, layers=[1], topk=2, folder=tmp_path, log=lambda *_: None)
    assert sorted(user_token(r) for r in TD.load_records(tmp_path)[0]) == [4, 6]  # "a" and "c", not "b"


def test_teacher_forced_prompt_ends_after_the_user_turn(target, monkeypatch, tmp_path):
    """``prompt_len`` was a fixed 16, inside SmolLM2's 21-token system header: the record's "prompt" held no user
    text and its loss and anchors began in the header. It is now the templated user turn with the generation
    prompt, the same ids ``generate_data`` answers."""
    fake_sharegpt(monkeypatch, ["a", "b"])
    monkeypatch.setattr(target, "tokenizer", HeaderChat(), raising=False)
    TD.teacher_forced_data(target, "tf", num_convs=2, layers=[1], topk=2, folder=tmp_path, log=lambda *_: None)
    recs = TD.load_records(tmp_path)[0]
    assert len(recs) == 2
    for r in recs:
        prompt = target.encode([{"role": "user", "content": chr(ord("a") + user_token(r) - 4)}]).tolist()
        assert r["prompt_len"] == len(prompt) == 28 and r["ids"][: r["prompt_len"]].tolist() == prompt


def reserved_split(short):
    """A train split reaching past the held-out prompts (8576-8703): only the indices in ``short`` hold a prompt
    of 3 ids, the others 10 ids (over an 8-token cap), so a generation answers only ``short``."""
    return [[4 + i % 90, 5, 6] if i in short else [7] * 10 for i in range(8580)]


def test_generated_data_leaves_out_the_reserved_heldout_prompts(target, monkeypatch, tmp_path):
    """A prompt count reaching past index 8576 answered the held-out set's prompts (only the on-policy path skipped
    them): now they are left out and the log says how many."""
    short = {0, 1, 8576, 8579}
    fake_sharegpt(monkeypatch, reserved_split(short))
    logs = []
    TD.generate_data(target, "r", num_prompts=8580, max_prompt_tokens=8, max_new=2, layers=[1], topk=2,
                     folder=tmp_path, log=logs.append)
    got = sorted(r["ids"][: r["prompt_len"]].tolist() for r in TD.load_records(tmp_path)[0])
    assert got == [[4, 5, 6], [5, 5, 6]]
    assert any("left out 2 prompts" in s and "8576-8703" in s for s in logs), logs


def test_teacher_forced_data_leaves_out_the_reserved_heldout_prompts(target, monkeypatch, tmp_path):
    """The same for teacher-forced text: a conversation's index is ``skip`` + its position in the split."""
    texts = [None] * 8706
    for i, t in ((1, "a"), (8576, "b"), (8600, "c"), (8704, "d")):  # 8704: the first index past the range
        texts[i] = t
    fake_sharegpt(monkeypatch, texts)
    monkeypatch.setattr(target, "tokenizer", HeaderChat(), raising=False)
    logs = []
    TD.teacher_forced_data(target, "tf", num_convs=8705, skip=1, layers=[1], topk=2, folder=tmp_path,
                           log=logs.append)
    assert sorted(user_token(r) for r in TD.load_records(tmp_path)[0]) == [4, 7]  # "a" and "d"
    assert any("left out 128 prompts" in s for s in logs), logs


def test_a_prompt_of_exactly_max_prompt_tokens_is_kept_and_a_longer_one_is_not(target):
    """Mutation test: first_turn_ids keeps a first turn of max_prompt_tokens ids, drops one more, keeps positions."""
    recs = [{"turns": [[5] * n]} for n in (4, 5, 3)]
    assert TD.first_turn_ids(target, recs, 4) == [(0, [5] * 4), (2, [5] * 3)]


def test_held_out_ranges_are_half_open():
    """Mutation test: a range [first, end) holds first and not end."""
    assert [i for i in range(2, 9) if TD.is_reserved(i, [[3, 5], [7, 8]])] == [3, 4, 7]
    got = TD.leave_out_reserved([(i, str(i)) for i in range(2, 9)], [[3, 5], [7, 8]], log=lambda *_: None)
    assert got == [(2, "2"), (5, "5"), (6, "6"), (8, "8")]


def test_a_teacher_forced_reply_of_exactly_the_minimum_fits(target, monkeypatch, tmp_path):
    """Mutation test: a max_len that leaves exactly TF_MIN_REPLY reply tokens after the 28-token prompt keeps it."""
    fake_sharegpt(monkeypatch, ["a"])
    monkeypatch.setattr(target, "tokenizer", HeaderChat(), raising=False)
    TD.teacher_forced_data(target, "tf", num_convs=1, max_len=28 + TD.TF_MIN_REPLY, layers=[1], topk=2,
                           folder=tmp_path, log=lambda *_: None)
    recs = TD.load_records(tmp_path)[0]
    assert [(len(r["ids"]), r["prompt_len"]) for r in recs] == [(28 + TD.TF_MIN_REPLY, 28)]


def test_generated_data_with_an_empty_reserve_answers_the_heldout_prompts(target, monkeypatch, tmp_path):
    """Mutation test: ``reserve=()`` (building the held-out set) waives the built-in range."""
    fake_sharegpt(monkeypatch, reserved_split({0, 8576, 8579}))
    TD.generate_data(target, "r", num_prompts=8580, max_prompt_tokens=8, max_new=2, layers=[1], topk=2,
                     folder=tmp_path, log=lambda *_: None, reserve=())
    got = sorted(r["ids"][: r["prompt_len"]].tolist() for r in TD.load_records(tmp_path)[0])
    assert got == [[4, 5, 6], [30, 5, 6], [33, 5, 6]]


def test_answer_top_ids_row_t_is_the_distribution_of_token_t_plus_1(target):
    """Mutation test: in a greedy answer the soft labels' row t ranks the next token ids[t + 1] first, from the
    prompt's last row on; the prompt's other rows stay empty."""
    recs = TD.answer_batch(target.model, prompt_ids(3), 5, set(), [1], 3)
    for r in recs:
        p, ids = r["prompt_len"], r["ids"].tolist()
        assert r["top_ids"][p - 1: len(ids) - 1, 0].tolist() == ids[p:]
        assert not r["top_logp"][: p - 1].any() and not r["top_logp"][-1].any()


def test_a_feature_cache_of_another_source_is_not_extended(target, tmp_path):
    """Mutation test: a cache built from one source refuses sequences of another under the same folder."""
    seqs = [(p + [7, 8], len(p)) for p in prompt_ids(2)]
    TD.forward_cache(target, seqs, tmp_path, "source a", layers=[1], topk=2, log=lambda *_: None)
    with pytest.raises(ConfigError, match="holds other data"):
        TD.forward_cache(target, seqs, tmp_path, "source b", layers=[1], topk=2, log=lambda *_: None)
