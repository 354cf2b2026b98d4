"""The measurement core: the one verify-cost timer, the one interleaved method-vs-AR loop, the one speedup.

Speedup (``speedup``): total tokens emitted in the decode phase over total decode seconds, for the method, divided
by the same for AR on the same prompt-turns. Per prompt it is the same function on one pair; the report shows the
aggregate beside the median and IQR of the per-prompt ratios, and a paired bootstrap interval of the aggregate.
"""
from __future__ import annotations

import gc
import hashlib
import inspect
import json
import random
import statistics
import sys
import time
import torch

import graft_block
from graft_block import skinny
from graft_block.engine import device_name
from graft_block.errors import ConfigError
from graft_block.tree.schedule import curve_cost

from . import machine
from .prompts import encode_turn, warmup_ids

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover
    def tqdm(it=None, **_):
        return it


# ---- the speedup --------------------------------------------------------------------------------------------
def rate(runs: list[dict]) -> float | None:
    """Decode tokens per second over several runs: sum of tokens / sum of seconds (not a mean of rates)."""
    secs = sum(r["decode_s"] for r in runs)
    return sum(r["decode_tokens"] for r in runs) / secs if runs and secs > 0 else None


def speedup(runs: list[dict], ar_runs: list[dict]) -> float | None:
    """THE speedup: ``rate(runs) / rate(ar_runs)`` over the same prompt-turns (one pair = the per-prompt ratio)."""
    a, b = rate(runs), rate(ar_runs)
    return a / b if a is not None and b else None


def speedup_interval(pairs: list[tuple[dict, dict]], level: float = 0.9, reps: int = 1000,
                     seed: int = 0) -> tuple[float, float] | None:
    """Paired bootstrap interval of the aggregate speedup: prompt-turns resampled with replacement."""
    if len(pairs) < 2:
        return None
    rng = random.Random(seed)
    vals = []
    for _ in range(reps):
        pick = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        s = speedup([m for m, _ in pick], [a for _, a in pick])
        if s is not None:
            vals.append(s)
    vals.sort()
    lo = vals[int((1 - level) / 2 * (len(vals) - 1))]
    hi = vals[int((1 + level) / 2 * (len(vals) - 1))]
    return (lo, hi)


def pair_with(records: list[dict], baseline: str = "ar") -> None:
    """Per record, in place: ``speedup`` (per prompt-turn, vs ``baseline`` on the same prompt, turn and
    temperature) and at T=0 ``matches_ar`` (token identity, the lossless check)."""
    base = {(r["prompt_id"], r["turn"], r["temperature"]): r for r in records if r["method"] == baseline}
    for r in records:
        b = base.get((r["prompt_id"], r["turn"], r["temperature"]))
        if b is None:
            continue
        r["speedup"] = speedup([r], [b])
        if r["temperature"] == 0:
            r["matches_ar"] = r["tokens"] == b["tokens"]


# ---- the verify-cost timer ----------------------------------------------------------------------------------
def engine_label(target) -> str:
    """The path that computes the forward, e.g. ``hf-sdpa-float32``; a target on another path names it itself."""
    own = getattr(target, "engine_label", None)  # Target names its engine; a custom adapter may not
    if own:
        return str(own)
    attn = getattr(target.config, "_attn_implementation", None) or "default"
    return f"hf-{attn}-{str(target.dtype).removeprefix('torch.')}"


def cost_key(target, sizes, context: int, reps: int) -> dict:
    """Everything that changes a verify-cost curve: the cache is keyed by all of it."""
    cls = type(target)
    engine = "".join(inspect.getsource(getattr(cls, f)) for f in ("prefill", "verify", "compact", "_trim")
                     if hasattr(cls, f))
    lean = getattr(target, "lean", None)
    if lean is not None:  # the lean forward's own code changes the curve too, and so does the C kernel's
        engine += inspect.getsource(inspect.getmodule(type(lean))) + skinny.SOURCE
    return {"target": str(target.name), "target_class": f"{cls.__module__}.{cls.__qualname__}",
            "attn": getattr(target.config, "_attn_implementation", None), "dtype": str(target.dtype),
            "device": str(target.device),
            "device_name": device_name(target.device),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "graft_block": graft_block.__version__,
            "engine": hashlib.sha1(engine.encode()).hexdigest()[:12], "engine_path": engine_label(target),
            "pack_rows": sorted(lean.packs) if lean is not None else None, "context": context,
            "sizes": [int(s) for s in sizes], "reps": reps, "timing": "round-robin, monotone fit"}


def timed_verify(target, tree) -> float:
    """Seconds of one ``target.verify(tree)`` (device-synchronised); its cache entries are dropped again, so
    the next call sees the same context."""
    target.synchronize()
    t0 = time.perf_counter()
    target.verify(tree)
    target.synchronize()
    s = time.perf_counter() - t0
    target.compact(tree.size, torch.arange(0))
    return s


# Every size a 16-node tree can take: the cost is a staircase (rows go through the kernels in tiles; on the 2-core
# EPYC 1-3 positions cost alike, then 4-5, 6-8, 9-12), and the confidence schedule climbs to a stair's end.
VERIFY_SIZES = tuple(range(1, 18)) + (24, 32, 48, 64)


def monotone_fit(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence to ``values`` in least squares (pool adjacent violators): verifying
    more positions never costs less, so a dip in the medians is timing noise, not a cheaper size."""
    blocks = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(c)]


def verify_cost_curve(target, sizes=VERIFY_SIZES, context: int = 200, reps: int = 7,
                      cache: bool = True, fresh: bool = False) -> dict:
    """Median seconds of one ``target.verify`` over n tree nodes (a chain) after ``context`` cached tokens.

    The sizes are timed round-robin (one warm-up round, then ``reps`` rounds over all sizes), so a slow spell of
    the machine hits every size alike instead of one size's whole sample; ``median_s`` is the monotone fit of
    the medians (``raw_median_s`` keeps them). The confidence schedule and ``--budget auto`` read this curve, and
    a dip or a jump that is noise alone makes them cut trees that cost nothing extra (seen: 1:11 ms, 4:17 ms,
    8:16 ms from a size-by-size sample).

    Cached under GRAFT_BLOCK_CACHE/cost/ by ``cost_key`` (a property of the hardware and the code), but never a
    curve measured while something else competed (``machine`` load window): that one is returned flagged busy."""
    from graft_block.tree import chain

    sizes = sorted(set(int(n) for n in sizes))
    key = cost_key(target, sizes, context, reps)
    path = graft_block.keyed_cache_file("cost", key)
    if cache and not fresh and path.exists():
        data = json.loads(path.read_text())
        if data.get("key") == key:
            return {**data, "source": f"cached {path} (measured {data.get('measured_at', '?')})"}
    saved_layers = target.feature_layers
    target.set_feature_layers([])
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (context,), generator=gen)
    a = machine.snapshot()
    target.prefill(ids)
    trees = {n: chain(int(ids[-1]), torch.randint(0, target.vocab_size, (n - 1,), generator=gen)) for n in sizes}
    times = {n: [] for n in sizes}
    for rep in range(reps + 1):
        for n in sizes:
            s = timed_verify(target, trees[n])
            if rep:  # round 0 warms every shape up
                times[n].append(s)
    load = machine.window(a, machine.snapshot())
    target.set_feature_layers(saved_layers)
    if load["busy"] is None:  # too short a window to judge (tiny targets): judge the moment right after it
        load = {**load, "after": machine.idle_probe(0.3)}
        load["busy"] = load["after"]["busy"]
    raw = [statistics.median(times[n]) for n in sizes]
    med = dict(zip(map(str, sizes), monotone_fit(raw)))
    data = {"key": key, "median_s": med, "raw_median_s": dict(zip(map(str, sizes), raw)),
            "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "load": load, "busy": bool(load["busy"])}
    if cache and not data["busy"]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
    why = "busy machine: not cached" if data["busy"] else ("cached for next time" if cache else "not cached")
    return {**data, "source": f"measured now ({why})"}


def cost_at(curve: dict, nodes: int) -> float:
    """Verify seconds for ``nodes`` positions, interpolated linearly between measured sizes (one copy of the rule:
    ``graft_block.tree.schedule.curve_cost``, which the verification scheduler uses too)."""
    return curve_cost(curve, nodes)


def below_stairs(curve: dict, budgets, drop: float = 0.05) -> list[int]:
    """``budgets`` and, for each b, the largest b' in [b/2, b) whose tree verifies at least ``drop`` cheaper than
    b's (1 + b' a measured size), sorted. The verify cost is a staircase: on the 2-core EPYC 9 positions cost
    16% more than 8, so a budget-7 tree ran 1.20x AR where budget 8 ran 1.11x (DFlash DDTree, one run)."""
    sizes = sorted(int(k) for k in curve["median_s"])
    out = set(budgets)
    for b in budgets:
        limit = (1.0 - drop) * cost_at(curve, b + 1)
        below = [n - 1 for n in sizes if b / 2 <= n - 1 < b and cost_at(curve, n) <= limit]
        if below:
            out.add(max(below))
    return sorted(out)


def auto_budget(build, curve: dict, pilots, candidates=(4, 8, 16, 32), max_new_tokens: int = 48,
                after=None, cap: int | None = None, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0) -> dict:
    """Cost-aware budget: the b maximising tau(b) * cost(1) / (cost(1 + n(b)) + draft(b)), with tau, n(b) (the mean
    non-root nodes verified per round: b for a full tree, fewer where a schedule cuts it) and draft(b) (the seconds per
    round spent outside the verify: drafting, tree building, commit) from pilots of ``max_new_tokens`` on each
    prompt of ``pilots`` (a list of token-id prompts; rounds pooled over them) at the run's ``temperature`` (seed 0,
    the run's ``top_k`` / ``top_p``: a sampled run accepts less, so it is sized by sampled pilots, read by their
    expected acceptance ``tau_expected``; greedy ones by their tau; a run of several temperatures sizes each apart),
    and cost from the measured verify curve. The candidates gain the budgets just below the curve's stairs
    (``below_stairs``). ``build(b)`` -> Method; ``after()`` runs after each candidate (the main job releases the
    target's weight pages a drafter read). ``cap``: the most the method takes (a preset's max_budget); larger
    candidates become it. A candidate the method refuses anyway (a chain longer than its block) is left out, named
    under "refused"; if it refuses them all, the first refusal is raised."""
    if not pilots:
        raise ConfigError("auto_budget needs at least one pilot prompt")
    temperature = float(temperature)
    filters = {"top_k": top_k, "top_p": top_p} if temperature > 0 else {}  # the filters act at T > 0 only
    rows, refused = {}, {}
    for b in below_stairs(curve, sorted({min(b, cap) for b in candidates}) if cap is not None else candidates):
        try:
            method = build(b)
        except ConfigError as exc:
            refused[b] = exc
            continue
        runs = [method.run(ids, max_new_tokens, temperature, 0, **filters) for ids in pilots]
        del method
        gc.collect()  # the pilot's drafter and its weight layouts sit in reference cycles: free them before the next
        if after is not None:
            after()
        counts = [r.get("rounds") or 0 for r in runs]
        rounds = sum(counts)
        if rounds:
            # a sampled pilot reads its expected acceptance under the target's law: the draws' noise left out
            key = "tau_expected" if temperature > 0 else "tau"
            tau = sum((r.get(key) or r.get("tau") or 1.0) * c for r, c in zip(runs, counts)) / rounds
            side = sum(v for r in runs for k, v in (r.get("phase_s") or {}).items()
                       if k not in ("verify", "overhead")) / rounds
            # what the verify sees: a scheduled tree is cut below b
            nodes = 1 + sum((r.get("mean_tree_nodes") or b) * c for r, c in zip(runs, counts)) / rounds
        else:
            tau, side, nodes = 1.0, 0.0, 1 + b
        rows[b] = {"tau": tau, "draft_ms": 1e3 * side, "verify_nodes": nodes, "verify_ms": 1e3 * cost_at(curve, nodes),
                   "est_speedup": tau * cost_at(curve, 1) / (cost_at(curve, nodes) + side)}
    if not rows:
        raise next(iter(refused.values()))
    best = max(rows, key=lambda b: rows[b]["est_speedup"])
    return {"best": best, "pilot": rows, "refused": {b: str(e) for b, e in refused.items()},
            "pilot_prompts": len(pilots), "pilot_temperature": temperature, "curve_busy": curve.get("busy", False)}


# ---- the interleaved loop -----------------------------------------------------------------------------------
def check_context(target, max_new_tokens: int) -> None:
    """ConfigError, before anything runs, when no prompt fits beside ``max_new_tokens`` in the target's context."""
    ctx = getattr(target, "max_positions", None)
    if ctx is not None and max_new_tokens >= ctx:
        raise ConfigError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the target's context "
                          f"window of {ctx} tokens{getattr(target, 'context_note', '')}: lower --max-new-tokens below "
                          f"{ctx}")


def run_interleaved(target, methods: list, prompts: list[dict], max_new_tokens: int, temperatures, seed: int = 0,
                    progress: bool = True, shard: tuple[int, int] = (0, 1), guard: machine.LoadGuard | None = None,
                    warmup_tokens: int = 8, time_limit: float | None = None, top_k: int = 0,
                    top_p: float = 1.0, too_long: list | None = None) -> list[dict]:
    """Every method on a prompt before the next prompt (drift hits all alike), after one untimed warm-up call
    per method on a neutral prompt. One record per (prompt, temperature, turn, method); with ``guard``, each
    record carries the load window of its call. ``time_limit`` (s) stops starting new prompts. ``top_k`` /
    ``top_p`` filter the target's law at every T > 0 (records carry them). A turn whose prompt and answer would
    not fit the target's context (later turns grow with each method's own answers) is left out for that method,
    with a note, and so are its later turns: no record, an entry in ``too_long`` (when given) instead."""
    check_context(target, max_new_tokens)
    if warmup_tokens < 0:
        raise ConfigError(f"warmup_tokens must be >= 0 (0 = no warm-up), got {warmup_tokens}")
    ctx = getattr(target, "max_positions", None)
    filters = {"top_k": int(top_k), "top_p": float(top_p)}
    rank, world = shard
    mine = [p for i, p in enumerate(prompts) if i % world == rank]
    if warmup_tokens:
        ids = warmup_ids(target)
        for m in methods:  # allocator, kernels, HF generate's first-call setup: never inside a timed call
            m.run(ids, warmup_tokens, 0.0, seed)
            for h in m.hooks:  # analysis hooks keep nothing from the warm-up
                for kept in (getattr(h, "rows", None), getattr(h, "records", None)):
                    if kept is not None:
                        kept.clear()
    records = []

    def decodes(m, temp) -> bool:  # a method sized for one temperature decodes at that one only
        only = getattr(m, "temperatures", None)
        return only is None or temp in only

    bar = tqdm(total=len(mine) * sum(decodes(m, t) for t in temperatures for m in methods), disable=not progress,
               file=sys.stderr, desc=f"bench[{rank}]" if world > 1 else "bench")
    t_start = time.perf_counter()
    for p in mine:
        if time_limit is not None and time.perf_counter() - t_start > time_limit:
            print(f"[time limit] stopped after {len({r['prompt_id'] for r in records})} prompts", file=sys.stderr)
            break
        for temp in temperatures:
            here = [m for m in methods if decodes(m, temp)]
            histories = {m.name: [] for m in here}
            cut: dict[str, str] = {}  # method -> why its turns of this prompt stopped
            for t_idx, turn in enumerate(p["turns"]):
                for m in here:
                    hist = histories[m.name]
                    if m.name not in cut:
                        ids = encode_turn(target, hist, turn)
                        if ctx is not None and ids.numel() + max_new_tokens > ctx:
                            cut[m.name] = (f"prompt {ids.numel()} + max_new_tokens {max_new_tokens} tokens exceed "
                                           f"the target's context window of {ctx}"
                                           f"{getattr(target, 'context_note', '')}")
                            print(f"[too long] {m.name} on {p['id']} turn {t_idx} (T {temp}): {cut[m.name]}; "
                                  "skipped with its later turns (lower --max-new-tokens, or --first-turn-only)",
                                  file=sys.stderr)
                    if m.name in cut:
                        if too_long is not None:
                            too_long.append({"prompt_id": p["id"], "turn": t_idx, "method": m.name,
                                             "temperature": temp, "reason": cut[m.name]})
                        continue
                    if target.device.type == "cuda":  # the target's GPU, not the current one (cuda:0 by default)
                        torch.cuda.reset_peak_memory_stats(target.device)
                    if guard is not None:
                        with guard.measure() as w:
                            r = m.run(ids, max_new_tokens, temp, seed, **filters)
                        r["load"] = w.load
                    else:
                        r = m.run(ids, max_new_tokens, temp, seed, **filters)
                    r.update(prompt_id=p["id"], set=p.get("set"), category=p.get("category"), turn=t_idx,
                             method=m.name, temperature=temp, budget=m.budget, prompt_tokens=int(ids.numel()),
                             peak_rss_mb=machine.peak_rss_mb(), **(filters if temp > 0 else {}))
                    if target.device.type == "cuda":
                        r["peak_gpu_mb"] = torch.cuda.max_memory_allocated(target.device) / 2**20
                    # the next turn is fed this method's own answer (MT-Bench protocol), as text or as token ids
                    if isinstance(turn, list):
                        hist.extend([{"role": "user", "content": list(turn)},
                                     {"role": "assistant", "content": [int(t) for t in r["tokens"]]}])
                    elif target.tokenizer is not None:
                        r["text"] = target.decode(r["tokens"])
                        hist.extend([{"role": "user", "content": turn}, {"role": "assistant", "content": r["text"]}])
                    records.append(r)
                if t_idx == 0:
                    bar.update(len(here))
    bar.close()
    return records


def gather_shards(records: list[dict], world: int, order: list[str], extra: list | None = None) -> list[dict]:
    """Merge per-rank records on every rank (gloo all-gather of JSON; works on CPU under torchrun), back in the
    prompt order ``order`` (prompt ids). ``extra`` (a per-rank list, e.g. the turns left out) is merged in place."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo")
    gathered = [None] * world
    dist.all_gather_object(gathered, (records, extra))
    dist.barrier()
    if created:  # torn down here, not by the interpreter's exit, where gloo's threads can abort a rank (SIGABRT)
        dist.destroy_process_group()
    merged = [r for part, _ in gathered for r in part]
    if extra is not None:
        extra[:] = [e for _, part in gathered for e in part]
    index = {pid: i for i, pid in enumerate(order)}
    return sorted(merged, key=lambda r: (index[r["prompt_id"]], r["temperature"], r["turn"]))

