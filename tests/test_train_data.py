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
