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


def test_teacher_forced_text_leaves_out_conversations_whose_prompt_recurs_in_a_kept_split(target, monkeypatch,
                                                                                         tmp_path):
    from graft_block import data

    splits = {"train": ["a", "b", "c"], "calibration": ["b"], "eval": ["z"]}
    monkeypatch.setattr(data, "sharegpt", lambda split="train", limit=None: [
        {"id": f"{split}/{i}", "turns": [t], "reference": "reply"} for i, t in enumerate(splits[split])][:limit])

    class Chat:  # 48 ids a conversation, the first naming its prompt
        def apply_chat_template(self, msgs, tokenize=True):
            return [4 + ord(msgs[0]["content"]) - ord("a")] + [5] * 47

    monkeypatch.setattr(target, "tokenizer", Chat(), raising=False)
    TD.teacher_forced_data(target, "tf", num_convs=3, layers=[1], topk=2, folder=tmp_path, log=lambda *_: None)
    assert sorted(int(r["ids"][0]) for r in TD.load_records(tmp_path)[0]) == [4, 6]  # "a" and "c", not "b"
