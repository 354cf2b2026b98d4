import pytest
import torch

from graft_block.drafters.recycling import PLDMatrixDrafter, RecyclingDrafter
from graft_block import Drafter, SpeculativeDecoder
from graft_block.adjacency import AdjacencyMatrix
from graft_block.errors import ConfigError
from graft_block.testing import hf_greedy
from graft_block.tree import SOURCE_DRAFT, SOURCE_RETRIEVED, validate
from graft_block.tree.templates import level_sizes


pytestmark = pytest.mark.usefixtures("one_thread")


class _State:
    def __init__(self, tokens, target=None):
        self.tokens, self.target = list(tokens), target

    @property
    def root_token(self):
        return self.tokens[-1]

    def section(self, name):
        from contextlib import nullcontext

        return nullcontext()


def full_matrix(vocab=64, k=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = AdjacencyMatrix(vocab, k, torch.int64)
    m.table.copy_(torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(vocab)]))
    m.updates = 1
    return m


@pytest.mark.parametrize("budget", [5, 30, 80, 120])
def test_recycling_budget_exact_unique_siblings(budget):
    d = RecyclingDrafter(budget=budget, matrix=full_matrix(), warmup_rounds=0)
    for root in range(0, 64, 9):
        tree = d.propose(_State([1, 2, root]))
        validate(tree, budget=budget, root_token=root)
        assert tree.size - 1 == budget
        assert bool((tree.sources[1:] == SOURCE_RETRIEVED).all())
    if budget == 80:  # TR's shape when nothing is de-duplicated
        assert d.template_name is None and d.template.size > 80


@pytest.mark.parametrize("k,shared", [(2, False), (3, False), (3, True)])
def test_template_ranks_fit_the_matrix_k(k, shared):
    """A rank >= k has no matrix column: the template used to keep width 8 whatever k, and with k = 2 a budget-40
    tree came out with 25 nodes (k = 3, budget 80: 71) although the matrix fills it. The matrix's k bounds the
    ranks: the drafter's own k, or a shared matrix's."""
    m = full_matrix(k=k)
    for budget in (40, 80):
        d = RecyclingDrafter(budget=budget, k=2 if shared else k, matrix=m, warmup_rounds=0)
        for root in (0, 17, 63):
            tree = d.propose(_State([1, root]))
            validate(tree, budget=budget, root_token=root)
            assert tree.size - 1 == budget, (k, budget, root, tree.size - 1)
    with pytest.raises(ConfigError, match="matrix k=1"):  # 6 nodes at most: say so instead of proposing fewer
        RecyclingDrafter(budget=20, k=1, warmup_rounds=0)
    with pytest.raises(ConfigError, match="k "):
        RecyclingDrafter(budget=20, k=0, warmup_rounds=0)


def test_tr80_used_verbatim_without_fill():
    d = RecyclingDrafter(budget=80, matrix=full_matrix(), warmup_rounds=0, fill=False)
    tree = d.propose(_State([3]))
    assert tree.size - 1 == 80
    assert level_sizes([[0] * int(x) for x in tree.depths[1:]]) == [8, 21, 25, 15, 8, 3]


def test_pld_matrix_chain_first_then_retrieval():
    m = full_matrix()
    d = PLDMatrixDrafter(budget=20, pld_tokens=4, matrix=m, warmup_rounds=0)
    tokens = [7, 8, 9, 10, 11, 12, 13, 7, 8]
    tree = d.propose(_State(tokens))
    validate(tree, budget=20, root_token=8)
    assert tree.size - 1 == 20
    assert tree.tokens[1:5].tolist() == [9, 10, 11, 12] and bool((tree.sources[1:5] == SOURCE_DRAFT).all())
    assert tree.num_retrieved == 16
    # No match: pure retrieval.
    assert PLDMatrixDrafter(budget=20, matrix=m, warmup_rounds=0).propose(_State([1, 2, 3])).num_retrieved == 20


def test_config_errors_and_registry():
    with pytest.raises(ConfigError, match="warmup_rounds"):
        RecyclingDrafter(warmup_rounds=-1)
    with pytest.raises(ConfigError, match="template"):
        RecyclingDrafter(template="tr81")
    with pytest.raises(ConfigError, match="k="):
        RecyclingDrafter(matrix=AdjacencyMatrix(10, 2), k=8)
    d = Drafter.from_config({"type": "recycling", "budget": 12, "warmup_rounds": 0})
    assert isinstance(d, RecyclingDrafter) and d.budget == 12
    d = Drafter.from_config({"type": "pld_matrix", "budget": 12, "warmup_rounds": 0, "pld_tokens": 3})
    assert isinstance(d, PLDMatrixDrafter) and d.pld_tokens == 3


def test_pld_tokens_is_refused_out_of_range_or_not_an_int_and_defaults_to_at_most_the_budget():
    """-3 was clamped to 0 (lookup off), 1000 to the budget and 2.5 truncated to 2, without a word."""
    for bad in (-3, 1000, 21, 2.5, "4", True):
        with pytest.raises(ConfigError, match=r"pld_tokens .* must be an int in 0\.\.20 .*got"):
            PLDMatrixDrafter(budget=20, pld_tokens=bad, warmup_rounds=0)
    assert [PLDMatrixDrafter(budget=20, pld_tokens=v, warmup_rounds=0).pld_tokens for v in (0, 7, 20)] == [0, 7, 20]
    # left out: 10, or the whole budget below 10 (the presets sweep budgets 2..16 with no pld_tokens)
    assert [PLDMatrixDrafter(budget=b, warmup_rounds=0).pld_tokens for b in (4, 10, 60)] == [4, 10, 10]


def test_warmup_settings_are_refused_unless_ints_of_at_least_zero():
    """warmup_tokens -5 warmed up like 0 and 2.5 like 2 (int()), without a word."""
    for name in ("warmup_rounds", "warmup_tokens"):
        for bad in (-5, 2.5, True):
            with pytest.raises(ConfigError, match=f"{name} must be an int >= 0"):
                RecyclingDrafter(budget=8, **{name: bad})
    assert RecyclingDrafter(budget=8, warmup_rounds=0, warmup_tokens=0).warmup_tokens == 0


def _prompts(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(0, vocab, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
           for _ in range(n)]
    out[0] = [5, 6, 7, 5, 6, 7, 5, 6]
    return out



@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_identity_recycling_and_pld_matrix(arch, request):
    target = request.getfixturevalue(f"tiny_{arch}")
    m = AdjacencyMatrix(target.vocab_size, 8)
    rec = RecyclingDrafter(budget=24, warmup_rounds=2, warmup_prompts=[[1, 2, 3], [9, 9, 4]], warmup_tokens=16,
                           matrix=m)
    pldm = PLDMatrixDrafter(budget=16, matrix=m, warmup_rounds=0)
    dec_rec, dec_pldm = SpeculativeDecoder(target, rec), SpeculativeDecoder(target, pldm)
    hits = 0
    for i, prompt in enumerate(_prompts(10, target.vocab_size)):
        ref = hf_greedy(target, prompt, 64)
        res = dec_rec.generate(prompt, max_new_tokens=64)
        assert res.tokens == ref, (arch, i)
        hits += res.stats.retrieved_accepted
        if i % 2 == 0:
            assert dec_pldm.generate(prompt, max_new_tokens=64).tokens == ref, (arch, i, "pld_matrix")
    assert hits > 0 and rec.stats["retrieved_accepted"] == hits
    assert m.updates > 0 and rec.matrix is m  # the shared matrix persisted across prompts and drafters


def test_matrix_is_created_on_prefill_and_persists(tiny_llama):
    d = RecyclingDrafter(budget=8, warmup_rounds=0)
    assert d.matrix is None
    dec = SpeculativeDecoder(tiny_llama, d)
    dec.generate([1, 2, 3], max_new_tokens=8)
    m = d.matrix
    assert m is not None and m.vocab_size == tiny_llama.vocab_size and m.filled_rows > 0
    before = m.table.clone()
    dec.generate([4, 5, 6], max_new_tokens=8)
    assert d.matrix is m and not torch.equal(before, m.table)


@pytest.mark.slow
def test_smollm2_greedy_identity_recycling(smollm2):
    from graft_block.data import humaneval

    d = RecyclingDrafter(budget=24, warmup_rounds=0, depth=6)
    dec = SpeculativeDecoder(smollm2, d)
    for rec in humaneval(limit=2):
        ids = smollm2.encode([{"role": "user", "content": rec["turns"][0]}])
        ref = hf_greedy(smollm2, ids.tolist(), 64)
        # HF stops at EOS; the decoder does too, so compare the common length.
        out = dec.generate(ids, max_new_tokens=64).tokens
        assert out == ref[: len(out)] and len(out) == len(ref)


def test_matrix_given_or_loaded_on_another_device_moves_to_the_targets(tmp_path):
    """A matrix file loads on the CPU; with a target elsewhere (a GPU) it must move there, or every round copies
    all of the tree's logits to the host for the update. The meta device stands in for a GPU on this machine."""
    from types import SimpleNamespace

    from graft_block.graft import Graft

    full_matrix(vocab=64).save(tmp_path / "adj.safetensors")
    elsewhere = SimpleNamespace(vocab_size=64, device=torch.device("meta"))
    d = RecyclingDrafter(budget=8, warmup_rounds=0, matrix=str(tmp_path / "adj.safetensors"))
    assert d.ensure_matrix(elsewhere).device.type == "meta"
    g = Graft.from_config({"mode": "fixed", "budget": 8}, matrix=full_matrix(vocab=64), target=elsewhere)
    assert g.matrix.device.type == "meta"


# ---- added from mutation testing -----------------------------------------------------------------------------------
def test_prompt_lookup_prefers_the_longest_ngram_and_its_first_occurrence():
    from graft_block.drafters.pld import PromptLookupDrafter, prompt_lookup

    t = torch.tensor([3, 0, 1, 2, 3, 4, 5, 1, 2, 3, 6, 7, 1, 2, 3])
    # trailing 3-gram [1, 2, 3] first occurs at 1: what followed it there (not after its later copy at 7, and not
    # after the first [3] at 0, which the 1-gram would pick), num_tokens long
    assert prompt_lookup(t, 3).tolist() == [4, 5, 1]
    assert prompt_lookup(t, 1).tolist() == [4]
    assert prompt_lookup(t, 3, max_ngram=1).tolist() == [0, 1, 2]
    # only the 1-gram matches: min_ngram=1 is searched too
    assert prompt_lookup(torch.tensor([5, 8, 9, 6, 5]), 3).tolist() == [8, 9, 6]
    assert prompt_lookup(torch.tensor([5, 8, 9, 6, 5]), 3, min_ngram=2).tolist() == []
    # the continuation stops at the end of the context
    assert prompt_lookup(torch.tensor([1, 2, 1]), 5).tolist() == [2, 1]
    tree = PromptLookupDrafter(budget=4).propose(_State(t.tolist()))
    validate(tree, budget=4, root_token=3)
    assert tree.tokens[1:].tolist() == [4, 5, 1, 2] and tree.parents[1:].tolist() == [0, 1, 2, 3]


def test_warmup_runs_once_and_never_over_a_matrix_that_already_learnt(monkeypatch):
    """ensure_matrix runs at every prefill: warming up again would overwrite what the matrix learnt (the hot start)
    and spend the warm-up's decode time on every prompt."""
    from types import SimpleNamespace

    calls = []

    def fake_warmup(self, target, prompts=None, rounds=5, new_tokens=64):
        calls.append(rounds)
        self.updates += 1
        return rounds

    monkeypatch.setattr(AdjacencyMatrix, "warmup", fake_warmup)
    target = SimpleNamespace(vocab_size=64, device=torch.device("cpu"))
    d = RecyclingDrafter(budget=10, warmup_rounds=2)
    m = d.ensure_matrix(target)
    assert d.ensure_matrix(target) is m and calls == [2]
    d.prefill(_State([1], target=target))
    assert calls == [2]
    RecyclingDrafter(target=target, budget=10, warmup_rounds=2, matrix=full_matrix())  # learnt: no warm-up
    assert calls == [2]
