"""The real embedded target: SmolLM2-135M-Instruct (fp32, CPU). Lossless identity against HF generate."""
import pytest
import torch

from graft_block import Drafter, SpeculativeDecoder
from graft_block.data import humaneval
from graft_block.testing import hf_greedy

pytestmark = pytest.mark.slow



def test_embedded_target_shape(smollm2):
    assert (smollm2.num_layers, smollm2.hidden_size, smollm2.vocab_size) == (30, 576, 49152)
    assert smollm2.tokenizer is not None and smollm2.eos_token_ids


def test_pld_greedy_identity_humaneval(smollm2):
    """5 HumanEval prompts x 128 tokens with prompt lookup: token-identical to HF greedy, and PLD accepts."""
    dec = SpeculativeDecoder(smollm2, Drafter.from_config({"type": "pld", "budget": 10}))
    accepted = 0
    for prob in humaneval(5):
        ids = smollm2.encode([{"role": "user", "content": prob["turns"][0]}])
        ref = hf_greedy(smollm2, ids, 128)
        res = dec.generate(ids, max_new_tokens=128)
        assert res.tokens == ref, f"{prob['id']}: PLD output differs from HF greedy"
        accepted += res.stats.committed_in_rounds - res.stats.rounds
    assert accepted > 20  # PLD really proposed and got accepted on code prompts


def test_chat_messages_and_eos(smollm2):
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    res = SpeculativeDecoder(smollm2).generate(msgs, max_new_tokens=40)
    assert "Paris" in res.text
    assert res.tokens[-1] in smollm2.eos_token_ids and len(res.tokens) < 40  # stopped on EOS
    assert res.tokens == hf_greedy(smollm2, smollm2.encode(msgs), 40)


def test_smollm2_sampling_runs_and_is_seeded(smollm2):
    dec = SpeculativeDecoder(smollm2, Drafter.from_config({"type": "pld", "budget": 6}))
    msgs = [{"role": "user", "content": "Name three colours."}]
    a = dec.generate(msgs, max_new_tokens=24, temperature=0.8, top_p=0.9, seed=3)
    b = dec.generate(msgs, max_new_tokens=24, temperature=0.8, top_p=0.9, seed=3)
    assert a.tokens == b.tokens and len(a.tokens) >= 1
