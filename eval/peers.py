"""Peers that are not our loop: HF ``generate`` and HF prompt-lookup decoding, timed the way our loop is.

The decode phase starts when the first forward (the prefill, plus any candidates HF verifies with it) has
emitted its tokens, observed inside the same ``generate`` call through a streamer: nothing is measured in a
separate call and subtracted (an un-warmed separate prefill once made HF look 15x faster than it is).
"""
from __future__ import annotations

import time

import torch

from graft_block.errors import ConfigError


class FirstForwardClock:
    """A streamer: HF calls ``put`` with the prompt, then with the tokens of every step; ``end`` at the finish."""

    def __init__(self, sync):
        self.sync, self.calls, self.t_first, self.n_first, self.t_end = sync, 0, None, 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:  # the first forward's tokens (call 1 is the prompt itself)
            self.sync()
            self.t_first, self.n_first = time.perf_counter(), int(value.numel())

    def end(self):
        self.sync()
        self.t_end = time.perf_counter()


def hf_runner(target, kwargs: dict):
    """``run(ids, max_new_tokens, temperature, seed) -> record`` for HF ``generate`` with ``kwargs``
    (``{"prompt_lookup_num_tokens": 10}`` = HF prompt lookup)."""
    if "prompt_lookup_num_tokens" in kwargs and target.tokenizer is None:
        raise ConfigError("HF prompt lookup needs a tokenizer-backed target")
    sync = target.synchronize

    def run(ids, max_new_tokens, temperature, seed):
        inp = ids.view(1, -1).to(target.device)
        gen_kw = dict(max_new_tokens=max_new_tokens, attention_mask=torch.ones_like(inp), **kwargs)
        if temperature > 0:
            torch.manual_seed(seed)
            gen_kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            gen_kw.update(do_sample=False)
        clock = FirstForwardClock(sync)
        with torch.no_grad():
            sync()
            t0 = time.perf_counter()
            out = target.model.generate(inp, streamer=clock, **gen_kw)
            sync()
            t1 = time.perf_counter()
        toks = out[0, inp.shape[1]:].tolist()
        t_first = clock.t_first if clock.t_first is not None else t1  # one token only: no decode phase
        decode_tokens = max(len(toks) - clock.n_first, 0)
        decode_s = max(t1 - t_first, 1e-9)
        return {"tokens": toks, "new_tokens": len(toks), "decode_tokens": decode_tokens, "decode_s": decode_s,
                "prefill_s": t_first - t0, "decode_tok_s": decode_tokens / decode_s, "tau": None, "rounds": None}

    return run
