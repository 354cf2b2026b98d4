"""The verification engine on tiny random HF targets: greedy identity, sampling exactness, KV compaction."""
from collections import Counter
import time

import pytest
import torch

from graft_block import Drafter, SpeculativeDecoder
from graft_block.sampling import SamplingConfig
from graft_block.testing import chi_square_test, exact_sequence_probs, tiny_target
from graft_block.testing import hf_greedy
from graft_block.drafters.pld import PromptLookupDrafter
from graft_block.tree import from_paths



@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_identity_random_planted_trees(arch):
    """>= 30 random trees per model (here: 10 runs x many rounds each), true continuation planted at a random
    sibling rank and depth among garbage branches; every run token-identical to HF greedy for 64+ tokens."""
    target = tiny_target(arch)
    n_trees, accepted = 0, 0
    for run in range(10):
        prompt = [(7 * run + j) % 128 for j in range(3 + run % 5)]
        ref = hf_greedy(target, prompt, 72)
        drafter = Drafter.from_config({"type": "planted", "reference": ref, "budget": 4 + 3 * (run % 5),
                                       "max_width": 1 + run % 4, "max_depth": 2 + run % 6, "seed": run,
                                       "vocab_size": 128})
        res = SpeculativeDecoder(target, drafter).generate(prompt, max_new_tokens=72)
        assert res.tokens == ref, f"{arch} run {run}: speculative output diverged from HF greedy"
        n_trees += res.stats.rounds
        accepted += sum(k * c for k, c in res.stats.accept_hist.items())
    assert n_trees >= 30
    assert accepted > 0.3 * 72 * 10  # the planted paths really were accepted, so compaction was exercised


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_greedy_identity_other_families(arch):
    target = tiny_target(arch)
    prompt = [3, 1, 4, 1, 5]
    ref = hf_greedy(target, prompt, 48)
    drafter = Drafter.from_config({"type": "planted", "reference": ref, "budget": 10, "seed": 3})
    assert SpeculativeDecoder(target, drafter).generate(prompt, max_new_tokens=48).tokens == ref
    assert SpeculativeDecoder(target, None).generate(prompt, max_new_tokens=48).tokens == ref


def test_draw_is_each_rows_law_and_never_a_zero(monkeypatch):
    """``draw`` (the inverse CDF the decoder samples with): each row's draws follow that row's distribution
    (chi-square against it, 40k draws per row, rows of different shapes with zeros between and at both ends),
    a token of zero probability is never drawn, and a uniform at the CDF's very top lands on the last positive
    entry."""
    from graft_block.sampling import draw

    rows = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3, 0.0], [0.7, 0.0, 0.0, 0.0, 0.0, 0.3],
                         [0.0, 0.0, 1e-3, 0.0, 0.999, 0.0]])
    g = torch.Generator().manual_seed(11)
    n = 40000
    got = torch.stack([draw(rows, g) for _ in range(n)])  # [n, 3]
    for r in range(3):
        counts = Counter(got[:, r].tolist())
        assert all(rows[r, t] > 0 for t in counts), (r, counts)  # zeros are never drawn
        expected = {(t,): float(p) for t, p in enumerate(rows[r].tolist()) if p > 0}
        assert chi_square_test(Counter({(t,): c for t, c in counts.items()}), expected)[2] > 1e-3, (r, counts)
    # a wrong rule (the CDF read from the left: the token before) is rejected by the same test
    shifted = Counter({(max(t - 1, 0),): c for t, c in Counter(got[:, 0].tolist()).items()})
    assert chi_square_test(shifted, {(t,): float(p) for t, p in enumerate(rows[0].tolist()) if p > 0})[2] < 1e-3
    # a uniform that rounding carried to the CDF's total (u * total == total) still lands on a positive entry
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(a[:2], dtype=torch.float64))
    assert draw(rows, None).tolist() == [4, 5, 4]


def test_nucleus_is_hfs_top_p_without_the_sort():
    """``NucleusWarper`` removes the tokens HF's ``TopPLogitsWarper`` removes, on rows from peaked to flat (nuclei of
    1 token to most of the vocabulary, so every candidate size and the whole-vocabulary fallback run, rows of one
    batch leaving at different sizes) and after a top-k: identical masks except on rows where some token's
    mass-at-or-below lies within float32 rounding of 1 - top_p (HF sums in float32)."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    from graft_block.sampling import NucleusWarper

    g = torch.Generator().manual_seed(5)
    checked = 0
    for scale in (0.05, 0.3, 1.0, 3.0, 8.0):
        for top_p in (0.3, 0.8, 0.95, 0.99):
            x = torch.randn(12, 6000, generator=g) * scale
            x[0] = x[0] * 0.01  # near uniform: the nucleus spans most of the vocabulary
            for z in (x, TopKLogitsWarper(50)(None, x.clone())):
                ref = torch.isinf(TopPLogitsWarper(top_p)(None, z.clone()))
                got = torch.isinf(NucleusWarper(top_p)(None, z.clone()))
                p = torch.softmax(z.double(), -1).sort(-1).values.cumsum(-1)
                clear = ((p - (1 - top_p)).abs() > 1e-6).all(-1)  # no token near the boundary
                assert torch.equal(got[clear], ref[clear]), (scale, top_p)
                assert bool((~got).any(-1).all())  # every row keeps a token
                checked += int(clear.sum())
    assert checked > 400


def test_target_probs_are_hf_generates_sampling_law():
    """``target_probs`` is the law HF ``generate(do_sample=True)`` samples from: its own processor list (the
    warpers, their order and their k / p) applied to the same logits. The 3-token law tests cannot see top-k
    keeping one token too many (a tail of the tiny vocabulary) nor top-p applied before top-k; this can."""
    from transformers import GenerationConfig

    from graft_block.sampling import target_probs

    model = tiny_target("llama", vocab_size=8, hidden_size=32, num_layers=1, heads=2, kv_heads=1, seed=4).model
    logits = torch.randn(64, 96, generator=torch.Generator().manual_seed(9)) * 2.5
    for t, k, p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (0.8, 0, 0.9), (0.6, 3, 0.6), (1.3, 20, 0.5), (2.0, 40, 0.8)]:
        gen_cfg = GenerationConfig(do_sample=True, temperature=t, top_k=k, top_p=p)
        ref = torch.softmax(model._get_logits_processor(gen_cfg, device="cpu")(None, logits.clone()), -1)
        got = target_probs(logits, SamplingConfig(t, k, p))
        assert torch.equal(got > 0, ref > 0), (t, k, p)  # the same support, token for token
        assert torch.allclose(got, ref, atol=1e-6), (t, k, p)


def test_greedy_tokens_follow_torchs_argmax_rule():
    """The greedy pick (numpy's argmax on CPU float32) is torch's: the first of tied maxima, NaN as largest, any
    shape and stride, float32 and not; a wrong rule (the last of tied maxima) would fail here."""
    from graft_block.sampling import greedy_tokens

    g = torch.Generator().manual_seed(3)
    ties = torch.zeros(3, 9)
    ties[0, [2, 6]] = 4.0  # tied maxima: the first wins
    ties[1, [1, 5]] = float("nan")  # NaN counts as largest, first NaN wins
    ties[2, 8] = float("inf")
    cases = [torch.randn(5, 49152, generator=g), torch.randn(49152, generator=g), ties,
             torch.randn(6, 40, generator=g)[:, ::3], torch.randn(4, 30, generator=g).double(),
             torch.randn(2, 3, 17, generator=g)]
    for x in cases:
        got = greedy_tokens(x)
        assert torch.equal(got, x.argmax(-1)) and got.dtype == torch.long and got.shape == x.argmax(-1).shape
    assert greedy_tokens(ties).tolist() == [2, 1, 8]


def test_ar_loop_matches_hf_greedy(tiny_llama):
    prompt = [1, 2, 3]
    out = SpeculativeDecoder(tiny_llama).generate(prompt, max_new_tokens=40).tokens
    assert out == hf_greedy(tiny_llama, prompt, 40)


@pytest.mark.parametrize("engine", ["lean", "hf"])
def test_kv_compaction_through_non_first_siblings(engine):
    """Accept a path that goes through the 2nd/3rd sibling at each depth; the compacted cache must equal the
    cache of a sequential prefill of the same tokens, and decoding must continue identically."""
    target = tiny_target("qwen3", engine=engine)
    prompt = [5, 9, 2, 7]
    ref = hf_greedy(target, prompt, 6)
    target.set_feature_layers([])
    target.prefill(torch.tensor(prompt))
    root = ref[0]
    garbage = [(t + 1) % 128 for t in ref]
    g2 = [(t + 2) % 128 for t in ref]
    # siblings ordered so the true token is never first
    paths = [[garbage[1]], [g2[1]], [ref[1], garbage[2]], [ref[1], ref[2], g2[3]], [ref[1], ref[2], ref[3]]]
    tree = from_paths(root, paths)
    logits, _ = target.verify(tree)
    from graft_block.tree import walk

    path, bonus = walk(tree, logits.argmax(-1))
    assert tree.tokens[path].tolist() == [root] + ref[1:4] and bonus == ref[4]
    assert path.tolist() != list(range(path.numel()))  # really non-contiguous
    target.compact(tree.size, path)
    seq = torch.tensor(prompt + ref[:4])
    ref_target = tiny_target("qwen3", engine="hf")  # the reference cache comes from HF's own forward
    ref_target.prefill(seq)
    for layer in range(target.num_layers):
        (k, v), (rk, rv) = target.cached_kv(layer), ref_target.cached_kv(layer)
        assert k.shape == rk.shape
        assert torch.allclose(k, rk, atol=1e-5) and torch.allclose(v, rv, atol=1e-5)
    # and the next step continues exactly
    from graft_block.tree import root_only

    nxt, _ = target.verify(root_only(bonus))
    assert int(nxt[0].argmax()) == ref[5]


def test_stream_receives_every_token(tiny_llama):
    got = []
    res = SpeculativeDecoder(tiny_llama, Drafter.from_config({"type": "pld", "budget": 4})).generate(
        [1, 2, 3, 1, 2], max_new_tokens=30, stream=got.extend)
    assert got == res.tokens and len(got) == 30


def test_stats_are_consistent(tiny_llama):
    prompt = [4, 4, 2]
    ref = hf_greedy(tiny_llama, prompt, 50)
    planted = Drafter.from_config({"type": "planted", "reference": ref, "budget": 8})
    res = SpeculativeDecoder(tiny_llama, planted).generate(prompt, max_new_tokens=50)
    s = res.stats
    assert sum(s.accept_hist.values()) == s.rounds
    assert s.committed_in_rounds + s.dropped == sum((k + 1) * v for k, v in s.accept_hist.items())
    assert s.new_tokens == 50 and s.committed_in_rounds == 49  # prefill emits 1, the rounds the rest
    assert s.tau == pytest.approx(s.committed_in_rounds / s.rounds)
    assert set(s.phase_s) >= {"draft", "tree", "verify", "commit", "overhead"}


def _round_lengths(target, drafter_cfg, prompt, max_new):
    """Tokens emitted per call of the stream: [prefill token] then one entry per round."""
    lens = []
    SpeculativeDecoder(target, Drafter.from_config(drafter_cfg)).generate(
        prompt, max_new_tokens=max_new, stream=lambda toks: lens.append(len(toks)))
    return lens


@pytest.mark.parametrize("stop", ["length", "eos"])
def test_stats_count_emitted_tokens_only_when_stopping_mid_round(stop):
    """The round that hits max_new_tokens (or EOS) accepted more tokens than are emitted: tau, decode tok/s and
    committed_in_rounds must count only the emitted ones; the rest is reported as ``dropped``."""
    target = tiny_target("llama", seed=1)
    prompt = [1, 2, 3]
    ref = hf_greedy(target, prompt, 64)
    cfg = {"type": "planted", "reference": ref, "budget": 16, "max_depth": 8, "plant_prob": 1.0, "seed": 5}
    lens = _round_lengths(target, cfg, prompt, 64)
    r = next(i for i in range(2, len(lens)) if lens[i] >= 3)  # a round (not the first) that emits >= 3 tokens
    before = sum(lens[:r])
    stop_at = before + 1  # stop after the first token of round r: it drops lens[r] - 1 tokens
    if stop == "length":
        res = SpeculativeDecoder(target, Drafter.from_config(cfg)).generate(prompt, max_new_tokens=stop_at)
    else:
        target.model.generation_config.eos_token_id = ref[stop_at - 1]
        try:
            assert ref[stop_at - 1] not in ref[:stop_at - 1], "pick a round whose first token is new"
            res = SpeculativeDecoder(target, Drafter.from_config(cfg)).generate(prompt, max_new_tokens=64)
        finally:
            target.model.generation_config.eos_token_id = None
    s = res.stats
    assert res.tokens == ref[:stop_at]
    assert s.rounds == r and s.new_tokens == stop_at
    assert s.committed_in_rounds == stop_at - 1  # emitted by rounds: everything but the prefill token
    assert s.dropped == lens[r] - 1 > 0
    assert s.tau == pytest.approx((stop_at - 1) / r)
    assert s.decode_tok_s == pytest.approx((stop_at - 1) / s.decode_s)
    assert sum((k + 1) * v for k, v in s.accept_hist.items()) == s.committed_in_rounds + s.dropped
    assert s.to_dict()["decode_tokens"] == stop_at - 1


def test_eos_stops_and_matches_hf():
    target = tiny_target("llama", seed=1)
    prompt = [1, 2, 3]
    free = hf_greedy(target, prompt, 30)
    eos = free[12]  # pretend the 13th token is EOS
    target.model.generation_config.eos_token_id = eos
    try:
        ref = hf_greedy(target, prompt, 30)
        planted = Drafter.from_config({"type": "planted", "reference": free, "budget": 6})
        res = SpeculativeDecoder(target, planted).generate(prompt, max_new_tokens=30)
        assert res.tokens == ref and res.tokens[-1] == eos
    finally:
        target.model.generation_config.eos_token_id = None


# ---- sampling exactness, end to end -------------------------------------------------------------------
SAMPLING_CASES = [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.7, top_k=5),
    SamplingConfig(temperature=0.8, top_p=0.9),
]


def _law_case(cfg):
    """The tiny target, prompt and exact 3-token law the end-to-end sampling tests share (vocab 8: 512 outcomes)."""
    target = tiny_target("llama", vocab_size=8, hidden_size=32, num_layers=1, heads=2, kv_heads=1, seed=4)
    prompt = [1, 5, 3]
    return target, prompt, exact_sequence_probs(target, prompt, 3, cfg)


def _planted_law_drafter(exact):
    """Random planted trees over the target's likeliest 3-token sequence (so drafts get accepted) among garbage."""
    likely = max(exact, key=exact.get)
    return Drafter.from_config({"type": "planted", "reference": list(likely) * 2, "budget": 6,
                                "vocab_size": 8, "max_width": 3, "max_depth": 3, "seed": 0})


def _spec_counts(target, prompt, drafter, cfg, n=1200):
    """n speculative samples of 3 new tokens; returns (counts, drafted nodes accepted over all runs)."""
    dec = SpeculativeDecoder(target, drafter)
    gen = torch.Generator().manual_seed(123)
    counts, accepted = Counter(), 0
    for _ in range(n):
        res = dec.generate(prompt, max_new_tokens=3, temperature=cfg.temperature, top_k=cfg.top_k,
                           top_p=cfg.top_p, generator=gen)
        counts[tuple(res.tokens)] += 1
        accepted += sum(k * c for k, c in res.stats.accept_hist.items())
    return counts, accepted


@pytest.mark.parametrize("cfg", SAMPLING_CASES, ids=["T1", "T0.7-topk5", "T0.8-topp0.9"])
def test_sampling_distribution_matches_plain_sampling(cfg):
    """First 3 new tokens from speculative decoding with random trees vs the exact distribution of plain
    sampling from the target (enumerated), chi-square at p > 1e-3 with 1200 samples; drafted nodes really were
    accepted, and the same counts are rejected against the law at 1.25x the temperature (the test has power)."""
    from dataclasses import replace

    target, prompt, exact = _law_case(cfg)
    n = 1200
    counts, accepted = _spec_counts(target, prompt, _planted_law_drafter(exact), cfg, n)
    stat, dof, p = chi_square_test(counts, exact)
    assert p > 1e-3, f"{cfg}: speculative sampling differs from the target (chi2={stat:.1f}, dof={dof}, p={p:.2g})"
    assert accepted > n // 10, f"{cfg}: only {accepted} drafted nodes accepted in {n} runs: the trees went unused"
    # warmer, not colder: top-p's nucleus only grows, so the rejection is the chi-square's, not an impossible outcome
    warmer = exact_sequence_probs(target, prompt, 3, replace(cfg, temperature=1.25 * cfg.temperature))
    assert chi_square_test(counts, warmer)[2] < 1e-3, f"{cfg}: the law at 1.25 T is not told apart"


def test_sampling_past_a_sliding_window_matches_plain_sampling():
    """The exact-law test on a mixed sliding-window target (Qwen2, window 3, HF's forward) whose 5-token prompt
    already fills the window: every tree is verified through the windowed mask on a full cache, and the first 3
    new tokens follow the target's own law (its forward with HF's sliding masks, enumerated), chi-square at
    p > 1e-3, with drafted nodes accepted."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from graft_block.target import Target

    cfg = Qwen2Config(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, use_sliding_window=True, sliding_window=3, initializer_range=0.3,
                      layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(4)
    target = Target(AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval(),
                    None)
    assert target.window == 3
    law, prompt = SamplingConfig(temperature=1.0), [1, 5, 3, 2, 6]
    exact = exact_sequence_probs(target, prompt, 3, law)
    n = 400
    counts, accepted = _spec_counts(target, prompt, _planted_law_drafter(exact), law, n)
    stat, dof, p = chi_square_test(counts, exact)
    assert p > 1e-3, f"speculative sampling differs from the target (chi2={stat:.1f}, dof={dof}, p={p:.2g})"
    assert accepted > n // 10


def test_sampling_law_test_rejects_a_biased_acceptance_rule(monkeypatch):
    """Power of the end-to-end law test: a verifier that, at ~30% of the tree's nodes with children, swaps the
    target's sampled choice for its first drafted child (accepting drafts too often) is rejected, p < 1e-3, at
    the 1200 samples the real test uses."""
    from graft_block import decoder as decoder_module

    cfg = SAMPLING_CASES[0]
    target, prompt, exact = _law_case(cfg)
    trees, cheat_gen, real_choose = [], torch.Generator().manual_seed(7), decoder_module.choose_with_law

    def biased_choose(logits, sampling, generator=None):
        choices, law = real_choose(logits, sampling, generator)
        tree = trees[-1] if trees else None
        if tree is None or logits.shape[0] != tree.size:  # no tree to bias
            return choices, law
        choices = choices.clone()
        parents = tree.parents.tolist()
        for node in range(tree.size):
            kids = [j for j in range(1, tree.size) if parents[j] == node]
            if kids and float(torch.rand(1, generator=cheat_gen)) < 0.3:
                choices[node] = tree.tokens[kids[0]]
        return choices, law

    monkeypatch.setattr(decoder_module, "choose_with_law", biased_choose)  # the rounds' only choice
    drafter = _planted_law_drafter(exact)
    propose = drafter.propose
    # the decoder verifies exactly the proposed tree (no graft, no schedule): record it for the biased verifier
    monkeypatch.setattr(drafter, "propose", lambda state: trees.append(propose(state)) or trees[-1])
    counts, _ = _spec_counts(target, prompt, drafter, cfg)
    assert trees, "the biased verifier never saw a tree"
    stat, dof, p = chi_square_test(counts, exact)
    assert p < 1e-3, f"a biased acceptance rule passed the law test (chi2={stat:.1f}, dof={dof}, p={p:.2g})"


def test_decoders_sharing_a_target_each_capture_their_drafters_layers(tiny_llama, one_thread):
    """Interleaved decoders on one target (as in the benchmark): every generate captures its own drafter's layers."""
    featured = Drafter.from_config({"type": "pld", "budget": 4})
    featured.feature_layers = (1, 3)
    a = SpeculativeDecoder(tiny_llama, featured)
    b = SpeculativeDecoder(tiny_llama, Drafter.from_config({"type": "pld", "budget": 4}))
    assert tiny_llama.feature_layers == ()  # the last one built
    a.generate(torch.tensor([5, 6, 7]), max_new_tokens=4)
    assert tiny_llama.feature_layers == (1, 3)
    b.generate(torch.tensor([5, 6, 7]), max_new_tokens=4)
    assert tiny_llama.feature_layers == ()


PREFILL_SLEEP_S = 0.3


class SlowPrefillPLD(PromptLookupDrafter):
    """PLD whose prompt pass takes a known time (a block drafter's context forward over the prompt)."""

    def prefill(self, state) -> None:
        time.sleep(PREFILL_SLEEP_S)


def test_drafter_prefill_is_prefill_not_a_round_phase():
    """The time split is of the rounds (decode_s); the drafter's prompt pass is prefill (in prefill_s) and must
    not also be billed to the draft phase, nor to the per-round overhead a schedule reads after round 1."""
    seen_draft_s = []
    dec = SpeculativeDecoder(tiny_target("llama"), SlowPrefillPLD(budget=4),
                             round_hooks=[lambda v, st: seen_draft_s.append(st.timer.totals["draft"])])
    s = dec.generate([5, 6, 7, 5, 6], max_new_tokens=12).stats
    assert s.prefill_s >= PREFILL_SLEEP_S
    assert sum(s.phase_s.values()) <= s.decode_s + 1e-3  # phases partition the decode loop, nothing more
    assert seen_draft_s[0] <= s.decode_s  # round 1's draft time is round 1's, not the prompt pass's


def test_round_hooks_are_analysis_not_decoding_time(monkeypatch):
    """A slow analysis hook (the chimeric proxy) is timed as hook_s: decode_s, the phases and so a schedule's
    per-round overhead estimate are what they are without it. A fake clock makes this exact, whatever the load."""
    import types
    import graft_block.decoder as decoder_module

    now = [0.0]

    def perf_counter():  # every reading moves 1 us, so nothing but the hook takes more than microseconds
        now[0] += 1e-6
        return now[0]

    monkeypatch.setattr(decoder_module, "time", types.SimpleNamespace(perf_counter=perf_counter))
    seen = []

    def slow_hook(verified, state):
        seen.append(dict(state.timer.totals))
        now[0] += 1000.0

    s = SpeculativeDecoder(tiny_target("llama"), PromptLookupDrafter(budget=4),
                           round_hooks=[slow_hook]).generate([5, 6, 7, 5, 6], max_new_tokens=12).stats
    assert s.rounds >= 2 and s.hook_s == pytest.approx(1000.0 * s.rounds, abs=1e-3)
    assert s.decode_s < 1.0 and max(s.phase_s.values()) < 1.0  # the hook's 1000 s is in none of them
    assert "hooks" not in s.phase_s and sum(s.phase_s.values()) <= s.decode_s + 1e-3
    assert all(t["commit"] < 0.02 for t in seen[1:])  # no earlier hook's sleep billed to commit


def _dynamic_rope_llama(window: int):
    """A tiny Llama whose RoPE rescales itself once a forward reaches past ``window`` positions (HF "dynamic")."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=window,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                      initializer_range=0.3, rope_parameters={"rope_type": "dynamic", "factor": 4.0,
                                                              "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


class _ReferenceChain:
    """Proposes the next ``depth`` tokens of a known greedy continuation as one chain, padded with token 0 past
    its end (so a chain reaches past the context window)."""

    budget, feature_layers = 8, ()

    def __init__(self, prompt, ref, depth=8):
        self.seq, self.depth = list(prompt) + list(ref), depth

    def prefill(self, state):
        pass

    def commit(self, state, verified):
        pass

    def propose(self, state):
        from graft_block.tree import chain

        n = len(state.tokens)
        known = self.seq[n : n + self.depth]
        return chain(state.root_token, known + [0] * (self.depth - len(known)))


@pytest.mark.parametrize("engine", ["lean", "hf"])
def test_trees_reaching_past_the_context_window_are_cut_to_it(engine):
    """Near the end of the context window a deep tree's last nodes would sit at positions the target has none
    for. The decoder verifies only the nodes inside the window (greedy output stays HF's even where the RoPE
    changes past it), and a tree past the window given to ``verify`` is a ConfigError naming the window."""
    from graft_block.errors import ConfigError
    from graft_block.target import Target
    from graft_block.tree import chain

    target = Target(_dynamic_rope_llama(32), None, engine=engine)
    prompt = [(3 * j + 1) % 128 for j in range(18)]
    ref = hf_greedy(target, prompt, 14)  # 18 + 14 = the whole window
    res = SpeculativeDecoder(target, _ReferenceChain(prompt, ref)).generate(prompt, max_new_tokens=14)
    assert res.tokens == ref
    assert res.stats.rounds <= 3  # the chains really were accepted
    target.prefill(torch.tensor(prompt + ref[:10]))  # 28 cached: positions 28..31 are left
    with pytest.raises(ConfigError, match="context window of 32"):
        target.verify(chain(ref[10], ref[11:14] + [0, 0]))  # depth 5: position 33
    assert target.cache_len == 28  # refused before anything was appended
    logits, _ = target.verify(chain(ref[10], ref[11:14]))  # depth 3: position 31, the last one
    assert logits.shape[0] == 4 and target.cache_len == 32


def _sliding_window_model(kind: str, window: int, attn: str = "sdpa"):
    """A tiny HF model with sliding-window layers (engine 'auto' runs HF's forward on them, past the window):
    "mistral" every layer sliding; "qwen2" / "gemma3" / "gemma4" (whose last two layers reuse earlier layers'
    keys) sliding and full layers mixed (a mask per layer type), "qwen2_full_first" with a full layer first;
    "llama4" chunked layers (trees cut to the first chunk)."""
    from transformers import (AutoModelForCausalLM, Gemma3TextConfig, Gemma4TextConfig, Llama4TextConfig,
                              MistralConfig, Qwen2Config)

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None, initializer_range=0.3)
    mixed = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    cfg = {"mistral": lambda: MistralConfig(**common, sliding_window=window),
           "qwen2": lambda: Qwen2Config(**common, use_sliding_window=True, sliding_window=window, layer_types=mixed),
           "qwen2_full_first": lambda: Qwen2Config(**common, use_sliding_window=True, sliding_window=window,
                                                   layer_types=mixed[1:] + mixed[:1]),
           "gemma3": lambda: Gemma3TextConfig(**common, head_dim=16, sliding_window=window, layer_types=mixed),
           "gemma4": lambda: Gemma4TextConfig(**common, head_dim=16, global_head_dim=16, sliding_window=window,
                                              layer_types=mixed, vocab_size_per_layer_input=128,
                                              hidden_size_per_layer_input=8, num_kv_shared_layers=2),
           "llama4": lambda: Llama4TextConfig(**{**common, "num_hidden_layers": 2}, head_dim=16,
                                              intermediate_size_mlp=128, num_local_experts=1,
                                              attention_chunk_size=window)}[kind]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _assert_tree_logits_are_the_models(target, model, ids, kind):
    """Verify a 6-node tree rooted at ids[-1] after ``ids[:-1]`` were prefilled: every node's logits are the model's
    own forward of its path (HF's masks, sliding windows included)."""
    from graft_block.tree import make_tree

    tokens, parents = [int(ids[-1]), 5, 9, 7, 11, 3], [-1, 0, 0, 1, 1, 3]
    logits, _ = target.verify(make_tree(tokens, parents))
    for i in range(len(tokens)):
        path, j = [], i
        while j > 0:
            path.insert(0, tokens[j])
            j = parents[j]
        seq = torch.cat([ids, torch.tensor(path, dtype=torch.long)]).view(1, -1)
        assert torch.allclose(logits[i], model(input_ids=seq, use_cache=False).logits[0, -1], atol=1e-4), (kind, i)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])  # eager: HF's own masks, where we pass none, size both alike
@pytest.mark.parametrize("kind", ["mistral", "qwen2", "qwen2_full_first", "gemma3", "gemma4"])
def test_sliding_window_targets_verify_whole_trees_past_their_window(kind, attn):
    """Past a sliding window a tree still verifies whole: the sliding layers keep a tree's rows until it is
    compacted, then only the window's last rows, and see the ancestor mask cut to their window (the full layers of a
    mixed model the whole of it). Every node's logits are HF's own for its path, then decoding with a drafter is
    HF's greedy with far more than a token a round, the sliding layers never holding more than the window."""
    from transformers import DynamicCache

    from graft_block.target import Target
    from graft_block.tree import make_tree

    model = _sliding_window_model(kind, 8, attn)
    target = Target(model, None)
    assert target.engine == "hf" and target.window == 8 and target.sliding_window is None
    sliding = [bool(getattr(lay, "is_sliding", False)) for lay in DynamicCache(config=model.config).layers]

    def rows_held():  # per cache layer (Gemma 4's KV-sharing layers have none of their own)
        return [(sliding[i], lay.keys.shape[-2]) for i, lay in enumerate(target.cache.layers)]

    ids = torch.randint(0, 128, (21,), generator=torch.Generator().manual_seed(1))
    target.prefill(ids[:-1])  # 20 cached, the root's token next: every node sits past the window
    assert all(r == (7 if s else 20) for s, r in rows_held()) and target.cache_len == 20
    with target.side_cache():  # a decoding beside this one drops rows of its own, and leaves these as they were
        target.prefill(ids[:15])
        assert target.cache_len == 15
    assert all(r == (7 if s else 20) for s, r in rows_held()) and target.cache_len == 20
    _assert_tree_logits_are_the_models(target, model, ids, kind)
    target.prefill(ids[:-1])  # a plain step (a root-only tree) on the trimmed sliding layers too
    logits, _ = target.verify(make_tree([int(ids[-1])], [-1]))
    assert torch.allclose(logits[0], model(input_ids=ids.view(1, -1), use_cache=False).logits[0, -1], atol=1e-4)
    prompt = [3, 1, 4, 1, 5]
    ref = hf_greedy(target, prompt, 40)  # 45 tokens: five windows
    drafter = Drafter.from_config({"type": "planted", "reference": ref, "budget": 4, "max_depth": 3, "seed": 3})
    res = SpeculativeDecoder(target, drafter).generate(prompt, max_new_tokens=40)
    assert res.tokens == ref
    accepted = sum(k * c for k, c in res.stats.accept_hist.items())
    assert 0 < accepted < res.stats.tree_nodes  # drafts accepted, and rejected nodes compacted away
    # whole trees every round (a cut to the window would verify one node a round past token 8, tau near 1)
    assert res.stats.tree_nodes > 2 * res.stats.rounds and res.stats.tau > 1.5
    assert target.cache_len == len(prompt) + 40 + res.stats.dropped - 1  # every committed token but the last bonus
    assert all(r == (7 if s else target.cache_len) for s, r in rows_held())


def test_chunked_attention_target_cuts_trees_to_its_first_chunk():
    """Layer types the windowed mask does not cover (Llama 4's chunked attention) keep HF's own cache layers, which
    count their tokens apart from the rows they hold: compaction must drop the rejected nodes from that count too.
    A tree that would cross the chunk is a ConfigError naming it; a decoder cuts its trees to fit, one node a
    round past it, and still gives HF's greedy tokens."""
    from graft_block.errors import ConfigError
    from graft_block.target import Target
    from graft_block.tree import chain

    target = Target(_sliding_window_model("llama4", 48), None)
    assert target.engine == "hf" and target.window is None and target.sliding_window == 48
    prompt = [3, 1, 4, 1, 5]
    ref = hf_greedy(target, prompt, 40)  # 45 tokens: inside the first chunk of 48
    drafter = Drafter.from_config({"type": "planted", "reference": ref, "budget": 2, "max_depth": 2, "seed": 3})
    res = SpeculativeDecoder(target, drafter).generate(prompt, max_new_tokens=40)
    assert res.tokens == ref
    accepted = sum(k * c for k, c in res.stats.accept_hist.items())
    assert 0 < accepted < res.stats.tree_nodes
    assert target.cache_len == len(prompt) + 40 + res.stats.dropped - 1
    target.prefill(torch.tensor(prompt + ref[:40]))  # 45 cached
    with pytest.raises(ConfigError, match="sliding window of 48: verify at most 2 nodes"):
        target.verify(chain(ref[39], [1, 2, 3]))  # 45 + 4 rows: the oldest would leave the window
    assert target.cache_len == 45
    longer = hf_greedy(target, prompt, 70)
    drafter = Drafter.from_config({"type": "planted", "reference": longer, "budget": 4, "max_depth": 3, "seed": 3})
    res = SpeculativeDecoder(target, drafter).generate(prompt, max_new_tokens=70)
    assert res.tokens == longer and res.stats.tau > 1.0


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_the_lean_engine_runs_a_sliding_window_model_within_its_window(kind):
    """engine='lean' attends to every cached row, which is the model's sliding window only while the whole sequence
    fits in it: the window is then its context. Inside it, node logits are HF's own (sliding masks and all) and
    decoding is HF's greedy; a request past it is refused up front, naming the window and engine='hf'. 'auto'
    keeps HF's forward, which runs past the window."""
    from graft_block.errors import ConfigError
    from graft_block.target import Target

    model = _sliding_window_model(kind, 16)
    assert Target(model, None).engine == "hf"
    target = Target(model, None, engine="lean")
    assert target.engine == "lean" and target.max_positions == 16 and target.window is None
    ids = torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(2))
    target.prefill(ids[:-1])
    _assert_tree_logits_are_the_models(target, model, ids, kind)  # deepest node at position len(ids) + 3
    prompt = [3, 1, 4, 1, 5]
    ref = hf_greedy(Target(model, None), prompt, 11)  # 16 tokens: the whole window
    drafter = Drafter.from_config({"type": "planted", "reference": ref, "budget": 3, "max_depth": 2, "seed": 3})
    res = SpeculativeDecoder(target, drafter).generate(prompt, max_new_tokens=11)
    assert res.tokens == ref and res.stats.tau > 1.0
    with pytest.raises(ConfigError, match="sliding window of 16 tokens.*engine='hf' runs past it"):
        SpeculativeDecoder(target, drafter).generate(prompt, max_new_tokens=12)
    with pytest.raises(ConfigError, match="context window is 16 .engine='lean' stops at the model's sliding window"):
        target.prefill(torch.arange(16))


def test_a_window_that_limits_nothing_leaves_the_lean_engine_whole():
    """Qwen2 with use_sliding_window whose max_window_layers covers every layer has no sliding layer, and a window
    as long as the context window cuts nothing: 'auto' runs the lean engine on both, over the whole context."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    from graft_block.target import Target

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    for cfg in (Qwen2Config(**common, use_sliding_window=True, sliding_window=16, max_window_layers=2),
                MistralConfig(**common, sliding_window=64)):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        target = Target(model, None)
        assert target.engine == "lean" and target.max_positions == 64 and target.context_note == ""
        assert Target(model, None, engine="lean").max_positions == 64
    for kind in ("mistral", "qwen2"):  # a window that limits: the lean engine's context, and 'auto' keeps HF's
        model = _sliding_window_model(kind, 16)
        assert Target(model, None, engine="lean").max_positions == 16 and Target(model, None).engine == "hf"


@pytest.mark.parametrize("kind", ["mamba", "lfm2", "bloom", "falcon", "bart"])
def test_a_target_that_cannot_verify_trees_is_refused_naming_why(kind):
    """A recurrent state (Mamba's scan, LFM2's short convolution) would keep a tree's rejected nodes, and a sibling
    would read its brother as its past: silently wrong logits (Qwen3-Next's gated delta rule read 0.06 off on a
    tiny model). ALiBi (BLOOM, Falcon's option) takes positions from the mask's row count, and a forward without
    position ids (BART's decoder) counts them itself, so siblings cannot share one. Such a target is refused when
    wrapped, naming why."""
    import transformers

    from graft_block.errors import ConfigError
    from graft_block.target import Target

    common = dict(vocab_size=128, hidden_size=64)
    cfg, why = {"mamba": (lambda: transformers.MambaConfig(**common, num_hidden_layers=2, state_size=8,
                                                           intermediate_size=128), "linear_attention layers carry a "),
                "lfm2": (lambda: transformers.Lfm2Config(**common, num_hidden_layers=2, intermediate_size=128,
                                                         num_attention_heads=4, num_key_value_heads=2,
                                                         layer_types=["conv", "full_attention"]),
                         "conv layers carry a "),
                "bloom": (lambda: transformers.BloomConfig(**common, n_layer=2, n_head=4), "bloom. takes no position"),
                "falcon": (lambda: transformers.FalconConfig(**common, num_hidden_layers=2, num_attention_heads=4,
                                                             alibi=True), "falcon. places tokens by ALiBi"),
                "bart": (lambda: transformers.BartConfig(**common, d_model=64, decoder_layers=1, encoder_layers=1,
                                                         decoder_attention_heads=4, encoder_attention_heads=4,
                                                         decoder_ffn_dim=64, encoder_ffn_dim=64),
                         "bart. takes no position ids")}[kind]
    model = transformers.AutoModelForCausalLM.from_config(cfg(), dtype=torch.float32)
    with pytest.raises(ConfigError, match=why + ".*tree verification needs an attention-only target"):
        Target(model, None)


HF_ARCHITECTURES = {  # tiny configs: model_type -> (config keys, attention implementation)
    "gpt2": ({"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256}, "sdpa"),
    "gpt_neox": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
                  "rotary_pct": 0.25}, "sdpa"),
    "opt": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "ffn_dim": 128,
             "word_embed_proj_dim": 64}, "sdpa"),
    "falcon": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_kv_heads": 2,
                "new_decoder_architecture": True}, "sdpa"),
    "phi": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}, "sdpa"),
    "phi3": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "pad_token_id": 0}, "sdpa"),
    "gemma2": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "intermediate_size": 128, "head_dim": 16, "sliding_window": 8}, "eager"),
    "olmo2": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}, "sdpa"),
    "stablelm": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                  "intermediate_size": 128}, "sdpa"),
    "starcoder2": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "intermediate_size": 128, "sliding_window": None}, "sdpa"),
    "cohere": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}, "sdpa"),
    "granite": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128},
                "sdpa"),
    "deepseek_v3": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
                     "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
                     "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
                     "qk_nope_head_dim": 8, "v_head_dim": 16, "first_k_dense_replace": 1}, "sdpa"),
    "glm4": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "head_dim": 16, "pad_token_id": 0}, "sdpa"),
    "gpt_oss": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "intermediate_size": 64, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                 "sliding_window": 8}, "eager"),
    "qwen3_moe": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "intermediate_size": 128, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4,
                   "num_experts_per_tok": 2}, "sdpa"),
    "mixtral": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "intermediate_size": 128, "num_local_experts": 4, "sliding_window": 8}, "sdpa"),
    "smollm3": ({"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "intermediate_size": 128, "no_rope_layer_interval": 2, "pad_token_id": 0}, "sdpa"),
    "nemotron": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "intermediate_size": 128}, "sdpa"),
    "exaone4": ({"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "intermediate_size": 128, "sliding_window": 8, "sliding_window_pattern": 2}, "sdpa"),
    "ministral": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "intermediate_size": 128, "head_dim": 16, "sliding_window": 8, "rope_theta": 10000.0}, "sdpa"),
    "olmo3": ({"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 128, "sliding_window": 8}, "sdpa"),
    "seed_oss": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "intermediate_size": 128, "head_dim": 16}, "sdpa"),
    "apertus": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "intermediate_size": 128}, "sdpa"),
    "hunyuan_v1_dense": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "intermediate_size": 128, "head_dim": 16}, "sdpa"),
}


@pytest.mark.parametrize("arch", sorted(HF_ARCHITECTURES))
def test_every_tree_node_gets_the_models_own_logits_for_its_path_across_hf_architectures(arch):
    """Real targets run HF's forward where the lean engine does not reach: learned, partial and skipped (NoPE)
    rotary positions, MLA, mixtures of experts, attention sinks, soft-capping, sliding windows (the cache here is
    past them). Each node of a two-branch tree verified after 20 cached tokens gets the logits of the model's own
    forward over its path, so a transformers release that drops the 4-D mask or the position ids fails here, and
    the features a drafter reads (hidden states 0, 1 and the last, found under each decoder's own names: GPT-2's
    ``h`` / ``ln_f``, OPT's ``final_layer_norm``, ...) are HF's ``output_hidden_states`` for that path."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from graft_block.target import Target
    from graft_block.tree import make_tree

    keys, attn = HF_ARCHITECTURES[arch]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, vocab_size=128, **keys),
                                             attn_implementation=attn, dtype=torch.float32).eval()
    target = Target(model, None)
    assert target.engine == "hf"
    layers = [0, 1, target.num_layers]
    target.set_feature_layers(layers)
    ids = torch.randint(1, 128, (21,), generator=torch.Generator().manual_seed(1))
    target.prefill(ids[:-1])
    paths = [[], [5], [9], [5, 7], [9, 11]]
    logits, feats = target.verify(make_tree([int(ids[-1]), 5, 9, 7, 11], [-1, 0, 0, 1, 2]))
    for i, path in enumerate(paths):
        seq = torch.cat([ids, torch.tensor(path, dtype=torch.long)]).view(1, -1)
        out = model(input_ids=seq, use_cache=False, output_hidden_states=True)
        assert torch.allclose(logits[i], out.logits[0, -1], atol=1e-4), (arch, i)
        want = torch.cat([out.hidden_states[j][0, -1] for j in layers])
        assert torch.allclose(feats[i], want, atol=1e-4), (arch, i, (feats[i] - want).abs().max())


def test_a_schedule_sees_the_tree_cut_to_the_context_window():
    """Near the window's end the decoder cuts a tree before the schedule reads it, so the schedule's kept nodes are
    the nodes verified and every round's outcome feeds its recalibration (a cut after the schedule counted nodes
    never verified and skipped those rounds)."""
    from graft_block.schedule import ConfidenceSchedule
    from graft_block.target import Target

    target = Target(_dynamic_rope_llama(32), None, engine="lean")
    prompt = [(3 * j + 1) % 128 for j in range(18)]
    ref = hf_greedy(target, prompt, 14)
    sched = ConfidenceSchedule(lambda n: 1.0)  # a flat cost: every node is worth verifying
    res = SpeculativeDecoder(target, _ReferenceChain(prompt, ref), schedule=sched).generate(prompt,
                                                                                            max_new_tokens=14)
    assert res.tokens == ref
    s = sched.summary()
    assert s["rounds"] == res.stats.rounds >= 2
    assert round(s["mean_nodes_kept"] * s["rounds"]) == res.stats.tree_nodes  # kept = verified
    assert sum(p for p, _ in sched._counts.values()) > 0 and s["mean_realised_tokens"] <= s["mean_nodes_kept"] + 1


class _TwoBranches:
    """Proposes the same two 2-deep branches every round (4 nodes, depth 2); its prompt pass takes ``prefill_s``
    on the given clock."""

    budget, feature_layers = 4, ()

    def __init__(self, clock=None, prefill_s=0.0):
        self.clock, self.prefill_s = clock, prefill_s

    def prefill(self, state):
        if self.clock is not None:
            self.clock[0] += self.prefill_s

    def commit(self, state, verified):
        pass

    def propose(self, state):
        return from_paths(state.root_token, [[1, 2], [3, 4]])


def test_stats_count_the_verified_trees_nodes_and_depth_and_keep_prefill_out_of_decode(monkeypatch):
    """mean_tree_nodes counts the non-root nodes verified per round and depth_hist the deepest node's depth; a
    slow prompt pass (fake clock: 1000 s) is prefill_s, never decode_s, so it never enters tok/s or a speedup."""
    import types
    import graft_block.decoder as decoder_module

    now = [0.0]

    def perf_counter():
        now[0] += 1e-6
        return now[0]

    monkeypatch.setattr(decoder_module, "time", types.SimpleNamespace(perf_counter=perf_counter))
    s = SpeculativeDecoder(tiny_target("llama"), _TwoBranches(now, 1000.0)).generate(
        [5, 6, 7], max_new_tokens=10).stats
    assert s.rounds >= 2 and dict(s.depth_hist) == {2: s.rounds}
    assert s.to_dict()["mean_tree_nodes"] == pytest.approx(4.0)
    assert s.prefill_s >= 1000.0 and s.decode_s < 1.0
    assert s.to_dict()["decode_tok_s"] == pytest.approx(s.committed_in_rounds / s.decode_s)


def test_expected_acceptance_is_what_the_sampled_walk_accepts_on_average(tiny_llama):
    """``tau_expected`` (per round, the sum over nodes of P(reached) under the target's law, from the verify's own
    probabilities; what --budget auto reads from sampled pilots) is the walk's mean acceptance: over 200 seeded
    answers the accepted drafts minus the expected ones average 0 within 4 standard errors, while the same sum under
    a colder law (T = 0.3, on the same verified trees) misses by more. With top_k 1 the law is one-hot, so expected
    and accepted agree answer by answer (a law read at the wrong rows or tokens would not)."""
    import math

    from graft_block.sampling import target_probs
    from graft_block.tree import expected_accept_length

    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = hf_greedy(tiny_llama, prompt, 40)

    class Colder:  # the counter-case: the expectation under a law the walk does not sample
        total = 0.0

        def __call__(self, v, state):
            p = target_probs(v.logits, SamplingConfig(temperature=0.3))
            self.total += expected_accept_length(v.tree, [1.0] + p[v.tree.parents[1:], v.tree.tokens[1:]].tolist())

    def answer(seed, **sampling):
        drafter = Drafter.from_config({"type": "planted", "reference": ref, "budget": 8, "seed": seed})
        colder = Colder()
        st = SpeculativeDecoder(tiny_llama, drafter, round_hooks=[colder]).generate(
            prompt, max_new_tokens=12, seed=seed, **sampling).stats
        assert st.to_dict()["tau_expected"] == pytest.approx(1 + st.expected_accepted / st.rounds)
        return sum(k * n for k, n in st.accept_hist.items()), st.expected_accepted, colder.total

    for seed in range(3):
        acc, exp, _ = answer(seed, temperature=1.0, top_k=1)
        assert exp == pytest.approx(acc, abs=1e-6)
    runs = [answer(seed, temperature=1.0) for seed in range(200)]
    assert sum(a for a, _, _ in runs) > 40  # the walk accepted drafts: the comparison has something to measure

    def z_score(diffs):
        mean = sum(diffs) / len(diffs)
        return mean / math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))

    assert abs(z_score([a - e for a, e, _ in runs])) < 4
    assert abs(z_score([a - c for a, _, c in runs])) > 4

