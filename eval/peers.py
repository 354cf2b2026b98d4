"""Peers that are not our loop: HF ``generate`` and HF prompt-lookup decoding, timed the way our loop is.

The decode phase starts when the first forward (the prefill, plus any candidates HF verifies with it) has
emitted its tokens, observed inside the same ``generate`` call through a streamer: nothing is measured in a
separate call and subtracted (an un-warmed separate prefill once made HF look 15x faster than it is).

When the main job's target released HF's weights (``load_target(..., release_hf=True)``: its C layers run on a
copy of their own), each HF call runs in a child process that loads the model from its folder, warms up on the
same prompt, then times the call: HF's weights then never sit in the main job's memory beside the engine's copy
(``python -m graft_block.eval.peers`` reads one JSON request on stdin and prints the record).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

from graft_block.errors import MethodUnavailable

WARMUP_TOKENS = 8  # the child's untimed call on the same prompt (the parent's warm-up call is another process)
CHILD_TIMEOUT_S = 3600.0  # one child call (load, warm-up, timed run): a hung child stops the bench, not stalls it


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


def model_folder(target) -> str | None:
    """The local folder ``target`` was loaded from (None for a model built in memory)."""
    path = getattr(target.model.config, "_name_or_path", "") or ""
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def hf_runner(target, kwargs: dict):
    """``run(ids, max_new_tokens, temperature, seed, top_k, top_p) -> record`` for HF ``generate`` with ``kwargs``
    (``{"prompt_lookup_num_tokens": 10}`` = HF prompt lookup); in a child process per call when the target
    released HF's weights and has a folder to reload them from."""
    if "prompt_lookup_num_tokens" in kwargs and target.tokenizer is None:
        raise MethodUnavailable("HF prompt lookup needs a tokenizer-backed target")
    folder = model_folder(target)
    if folder is not None and getattr(getattr(target, "lean", None), "released", 0):
        return _child_runner(target, folder, kwargs)
    return _runner(target, kwargs)


def _text(out) -> str:
    """A TimeoutExpired's partial output: bytes even from a text-mode run."""
    return out.decode("utf-8", errors="replace") if isinstance(out, bytes) else (out or "")


def _child_runner(target, folder: str, kwargs: dict, timeout: float = CHILD_TIMEOUT_S):
    base = {"folder": folder, "device": str(target.device), "dtype": str(target.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "kwargs": kwargs}

    def run(ids, max_new_tokens, temperature, seed, top_k=0, top_p=1.0):
        req = {**base, "ids": ids.view(-1).tolist(), "max_new_tokens": max_new_tokens, "temperature": temperature,
               "seed": seed, "top_k": top_k, "top_p": top_p}
        try:
            done = subprocess.run([sys.executable, "-m", "graft_block.eval.peers"], input=json.dumps(req),
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:  # run() has killed it
            raise RuntimeError(f"the HF peer's child process did not finish within {timeout:g} s and was stopped: "
                               f"{_text(exc.stderr)[-800:]}") from None
        if done.returncode:
            raise RuntimeError(f"the HF peer's child process failed ({done.returncode}): {done.stderr[-800:]}")
        lines = done.stdout.strip().splitlines()
        try:
            return json.loads(lines[-1])
        except (IndexError, ValueError):
            raise RuntimeError("the HF peer's child process exited without a record (a JSON last line); stdout "
                               f"{done.stdout[-400:]!r}, stderr: {done.stderr[-800:]}") from None

    return run


def _runner(target, kwargs: dict):
    sync = target.synchronize

    def run(ids, max_new_tokens, temperature, seed, top_k=0, top_p=1.0):
        inp = ids.view(1, -1).to(target.device)
        gen_kw = dict(max_new_tokens=max_new_tokens, attention_mask=torch.ones_like(inp), **kwargs)
        if temperature > 0:
            torch.manual_seed(seed)
            gen_kw.update(do_sample=True, temperature=temperature, top_k=int(top_k), top_p=float(top_p))
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
                "prefill_s": t_first - t0, "decode_tok_s": decode_tokens / decode_s, "tau": None, "rounds": None,
                "hf_peer": True}  # its T=0 tokens come from HF's arithmetic, not our engine's: report.lossless_alarm

    return run


def _serve_one() -> None:
    """The child's side: one JSON request on stdin -> one record on stdout."""
    from graft_block.target import load_target

    req = json.loads(sys.stdin.read())
    torch.set_num_threads(int(req["threads"]))
    target = load_target(req["folder"], device=req["device"], dtype=req["dtype"], engine="hf")
    run = _runner(target, req["kwargs"])
    ids = torch.tensor(req["ids"], dtype=torch.long)
    filters = {"top_k": req.get("top_k", 0), "top_p": req.get("top_p", 1.0)}
    run(ids, min(WARMUP_TOKENS, req["max_new_tokens"]), req["temperature"], req["seed"], **filters)
    from graft_block.eval.machine import own_peak_rss_mb

    rec = run(ids, req["max_new_tokens"], req["temperature"], req["seed"], **filters)
    print(json.dumps({**rec, "child_peak_rss_mb": own_peak_rss_mb()}))


if __name__ == "__main__":
    _serve_one()
