"""Peers that are not our loop: HF ``generate`` and HF prompt-lookup decoding, timed the way our loop is.

The decode phase starts when the first forward (the prefill, plus any candidates HF verifies with it) has
emitted its tokens, observed inside the same ``generate`` call through a streamer: nothing is measured in a
separate call and subtracted (an un-warmed separate prefill once made HF look 15x faster than it is).

When the main job's target released HF's weights (``load_target(..., release_hf=True)``: its C layers run on a
copy of their own), the HF peers' calls run in one child process that loads the model from its folder once and,
per call, warms up on the same prompt, then times the call: HF's weights then never sit in the main job's memory
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
    (``{"prompt_lookup_num_tokens": 10}`` = HF prompt lookup); in the HF peers' child process when the target
    released HF's weights and has a folder to reload them from."""
    if "prompt_lookup_num_tokens" in kwargs and target.tokenizer is None:
        raise MethodUnavailable("HF prompt lookup needs a tokenizer-backed target")
    folder = model_folder(target)
    if folder is not None and getattr(getattr(target, "lean", None), "released", 0):
        return _child_runner(target, folder, kwargs)
    return _runner(target, kwargs)


RECORD = "GRAFT_BLOCK_HF_RECORD "  # marks the child's record line among anything else it prints


class _Child:
    """One child process that serves the HF peers' calls (``hf`` and ``hf_pld`` alike): it loads the model at its
    first request and stays until ``close_children`` (a child per call spent ~10 s of the main job on imports and the
    load each time). The CPU it spends inside calls counts as this run's own (``machine.credit``); what it spends
    between them does not, so the busy guard still sees it."""

    def __init__(self):
        self.proc, self.lines, self.err = None, None, None

    def _start(self) -> None:
        self.err = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")  # a full pipe would block
        self.proc = subprocess.Popen([sys.executable, "-m", "graft_block.eval.peers"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True, encoding="utf-8",
                                     errors="replace")
        self.lines = queue.SimpleQueue()
        threading.Thread(target=_pump, args=(self.proc.stdout, self.lines), daemon=True).start()

    def _stderr(self) -> str:
        self.err.flush()
        self.err.seek(0)
        return self.err.read()[-800:]

    def ask(self, req: dict, timeout: float) -> dict:
        before, proc = machine.children_cpu(), self.proc  # poll() reaps a dead child: forget() needs what that added
        if proc is not None and proc.poll() is not None:  # it died between calls (killed for memory?)
            err = self.close(reaped_since=before)
            print(f"[hf] the HF peers' child process exited ({proc.returncode}) between calls; starting another. "
                  f"Its stderr: {err}", file=sys.stderr)
        if self.proc is None:
            self._start()
        pid, deadline, printed = self.proc.pid, time.monotonic() + timeout, []
        cpu0 = machine.process_cpu(pid)
        # written by a thread: a child stuck before its first read must not block us past the deadline
        threading.Thread(target=_send, args=(self.proc.stdin, json.dumps(req) + "\n"), daemon=True).start()
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                err = self.close(kill=True)
                raise RuntimeError(f"the HF peer's child process did not finish within {timeout:g} s and was "
                                   f"stopped: {err}") from None
            if line is None:  # EOF: it exited (or closed its stdout: close() kills it after 10 s)
                proc, err = self.proc, self.close()
                raise RuntimeError(f"the HF peer's child process exited ({proc.returncode}) without a record (a "
                                   f"{RECORD.strip()} line); stdout {''.join(printed)[-400:]!r}, stderr: {err}")
            at = line.find(RECORD)  # not only at the start: a library's unfinished line may sit before it
            if at >= 0:
                cpu1 = machine.process_cpu(pid)
                if cpu0 is not None and cpu1 is not None:
                    machine.credit(pid, cpu1 - cpu0)
                return json.loads(line[at + len(RECORD):])
            printed.append(line)

    def close(self, kill: bool = False, reaped_since: float | None = None) -> str:
        """Stop the child (EOF on its stdin ends it; killed if it does not, or at once with ``kill``); returns its
        stderr's tail. ``reaped_since``: ``machine.children_cpu()`` read before the caller reaped it."""
        if self.proc is None:
            return ""
        proc, self.proc = self.proc, None
        before = machine.children_cpu() if reaped_since is None else reaped_since
        if kill:
            proc.kill()
        try:
            proc.stdin.close()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        machine.forget(proc.pid, machine.children_cpu() - before)  # reaped: its time moved into os.times()
        err = self._stderr()
        self.err.close()
        return err


def _send(stream, text: str) -> None:
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError):
        pass  # it died or was stopped: the reader sees its EOF


def _pump(stream, lines: queue.SimpleQueue) -> None:
    """The child's stdout, line by line, into ``lines``; None at its end (or if reading it fails)."""
    try:
        for line in stream:
            lines.put(line)
    finally:
        lines.put(None)


_CHILDREN: dict[tuple, _Child] = {}  # one per (folder, device, dtype, threads): the HF peers share its one load


def close_children() -> None:
    """Stop the HF peers' children (the main job calls it after its timed runs; also at exit)."""
    for child in _CHILDREN.values():
        child.close()
    _CHILDREN.clear()


atexit.register(close_children)


def _child_runner(target, folder: str, kwargs: dict, timeout: float = CHILD_TIMEOUT_S):
    base = {"folder": folder, "device": str(target.device), "dtype": str(target.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads()}
    key = (sys.executable, *base.values())

    def run(ids, max_new_tokens, temperature, seed, top_k=0, top_p=1.0):
        child = _CHILDREN.setdefault(key, _Child())
        return child.ask({**base, "kwargs": kwargs, "ids": ids.view(-1).tolist(), "max_new_tokens": max_new_tokens,
                          "temperature": temperature, "seed": seed, "top_k": top_k, "top_p": top_p}, timeout)

    return run


def _runner(target, kwargs: dict):
    sync = target.synchronize  # the arguments set here per prompt: presets.HF_RUN_ARGS, refused in kwargs

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
    The model loads at the first request (every request of one child names the same folder, dtype and threads)."""
    from graft_block.target import load_target

    target = None
    for line in sys.stdin:
        req = json.loads(line)
        if target is None:
            torch.set_num_threads(int(req["threads"]))
            target = load_target(req["folder"], device=req["device"], dtype=req["dtype"], engine="hf")
        run = _runner(target, req["kwargs"])  # the peer's generate options (hf, hf_pld), per request
        ids = torch.tensor(req["ids"], dtype=torch.long)
        filters = {"top_k": req.get("top_k", 0), "top_p": req.get("top_p", 1.0)}
        run(ids, min(WARMUP_TOKENS, req["max_new_tokens"]), req["temperature"], req["seed"], **filters)  # untimed
        rec = run(ids, req["max_new_tokens"], req["temperature"], req["seed"], **filters)
        time.sleep(SETTLE_S)  # idle OpenMP threads may spin a while: let them stop before the parent times again
        print(RECORD + json.dumps({**rec, "child_peak_rss_mb": machine.own_peak_rss_mb(), "child_pid": os.getpid()}),
              flush=True)


if __name__ == "__main__":
    _serve()
