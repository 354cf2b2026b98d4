"""Peers that are not our loop: HF ``generate`` and HF prompt-lookup decoding, timed the way our loop is.

The decode phase starts when the first forward (the prefill, plus any candidates HF verifies with it) has
emitted its tokens, observed inside the same ``generate`` call through a streamer: nothing is measured in a
separate call and subtracted (an un-warmed separate prefill once made HF look 15x faster than it is).

When the main job's target released HF's weights (``load_target(..., release_hf=True)``: its C layers run on a
copy of their own), each HF peer's calls run in one child process that loads the model from its folder once, and
per call warms up on the same prompt, then times the call: HF's weights then never sit in the main job's memory
beside the engine's copy (``python -m graft_block.eval.peers`` reads one JSON request per stdin line and prints
one record line per request).
"""
from __future__ import annotations

import atexit
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time

import torch

from graft_block.errors import MethodUnavailable
from graft_block.eval import machine

WARMUP_TOKENS = 8  # the child's untimed call on the same prompt (the parent's warm-up call is another process)
SETTLE_S = 0.2  # the child's wait between its timed call and its record (Intel OpenMP spins 200 ms by default)
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
    (``{"prompt_lookup_num_tokens": 10}`` = HF prompt lookup); in a child process of its own when the target
    released HF's weights and has a folder to reload them from."""
    if "prompt_lookup_num_tokens" in kwargs and target.tokenizer is None:
        raise MethodUnavailable("HF prompt lookup needs a tokenizer-backed target")
    folder = model_folder(target)
    if folder is not None and getattr(getattr(target, "lean", None), "released", 0):
        return _child_runner(target, folder, kwargs)
    return _runner(target, kwargs)


RECORD = "GRAFT_BLOCK_HF_RECORD "  # marks the child's record line among anything else it prints


class _Child:
    """One child process that serves every call of one HF peer: it loads the model at its first request and stays
    until the run ends (each call's own process spent ~10 s of the main job on imports and the load)."""

    def __init__(self, timeout: float):
        self.timeout, self.proc, self.lines, self.err = timeout, None, None, None
        atexit.register(self.close)

    def _start(self) -> None:
        self.err = tempfile.TemporaryFile(mode="w+", encoding="utf-8")  # a file: a full stderr pipe would block
        self.proc = subprocess.Popen([sys.executable, "-m", "graft_block.eval.peers"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True, encoding="utf-8")
        machine.adopt(self.proc.pid)  # its CPU is this run's, not a competitor's (the busy flag)
        self.lines = queue.SimpleQueue()
        threading.Thread(target=_pump, args=(self.proc.stdout, self.lines), daemon=True).start()

    def _stderr(self) -> str:
        self.err.flush()
        self.err.seek(0)
        return self.err.read()[-800:]

    def ask(self, req: dict) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.close()
            self._start()
        deadline, printed = time.monotonic() + self.timeout, []
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died first: its EOF below says so, with its stderr
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                err = self.close(kill=True)
                raise RuntimeError(f"the HF peer's child process did not finish within {self.timeout:g} s and was "
                                   f"stopped: {err}") from None
            if line is None:  # EOF: it exited
                code, err = self.proc.wait(), self.close()
                raise RuntimeError(f"the HF peer's child process exited ({code}) without a record (a {RECORD.strip()} "
                                   f"line); stdout {''.join(printed)[-400:]!r}, stderr: {err}")
            if line.startswith(RECORD):
                return json.loads(line[len(RECORD):])
            printed.append(line)

    def close(self, kill: bool = False) -> str:
        """Stop the child (EOF on its stdin ends it; killed if it does not, or at once with ``kill``); returns its
        stderr's tail."""
        if self.proc is None:
            return ""
        proc, self.proc = self.proc, None
        if kill:
            proc.kill()
        try:
            proc.stdin.close()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        machine.disown(proc.pid)  # reaped: its time now counts among os.times()'s children
        err = self._stderr()
        self.err.close()
        return err


def _pump(stream, lines: queue.SimpleQueue) -> None:
    """The child's stdout, line by line, into ``lines``; None at its end."""
    for line in stream:
        lines.put(line)
    lines.put(None)


def _child_runner(target, folder: str, kwargs: dict, timeout: float = CHILD_TIMEOUT_S):
    base = {"folder": folder, "device": str(target.device), "dtype": str(target.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "kwargs": kwargs}
    child = _Child(timeout)

    def run(ids, max_new_tokens, temperature, seed, top_k=0, top_p=1.0):
        return child.ask({**base, "ids": ids.view(-1).tolist(), "max_new_tokens": max_new_tokens,
                          "temperature": temperature, "seed": seed, "top_k": top_k, "top_p": top_p})

    run.close = child.close
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


def _serve() -> None:
    """The child's side: one JSON request per stdin line -> one record line on stdout (RECORD + JSON), until EOF.
    The model loads at the first request; a runner sends the same folder, dtype, threads and kwargs every time."""
    from graft_block.target import load_target

    run = None
    for line in sys.stdin:
        req = json.loads(line)
        if run is None:
            torch.set_num_threads(int(req["threads"]))
            target = load_target(req["folder"], device=req["device"], dtype=req["dtype"], engine="hf")
            run = _runner(target, req["kwargs"])
        ids = torch.tensor(req["ids"], dtype=torch.long)
        filters = {"top_k": req.get("top_k", 0), "top_p": req.get("top_p", 1.0)}
        run(ids, min(WARMUP_TOKENS, req["max_new_tokens"]), req["temperature"], req["seed"], **filters)  # untimed
        rec = run(ids, req["max_new_tokens"], req["temperature"], req["seed"], **filters)
        time.sleep(SETTLE_S)  # idle OpenMP threads may spin a while: let them stop before the parent times again
        print(RECORD + json.dumps({**rec, "child_peak_rss_mb": machine.own_peak_rss_mb(), "child_pid": os.getpid()}),
              flush=True)


if __name__ == "__main__":
    _serve()
