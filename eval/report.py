"""From records to what a reader sees: per-method rows, the markdown tables, the spread verdict, the lossless
alarm and the paper claims. Pure functions of the records (no model, no timing)."""
from __future__ import annotations

import statistics

from . import machine
from .measure import rate, speedup, speedup_interval
from .presets import PAPER_CLAIMS

MIN_N = 5  # prompt-turns per method below which no interval is read as a verdict
CLOSE_CALL = 0.02  # a claim's ratio within 2% of its bar is too close to call "holds" on a few prompt-turns
PHASES = ("draft", "tree", "verify", "commit", "overhead")


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _iqr(xs):
    xs = sorted(x for x in xs if x is not None)
    if len(xs) < 2:
        return None
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return (q[0], q[2])


def _key(r):
    return r["prompt_id"], r["turn"], r["temperature"]


def _tau(rs):
    rounds = sum(r.get("rounds") or 0 for r in rs)
    return sum(r["decode_tokens"] for r in rs) / rounds if rounds else None


def _tau_expected(rs):
    """Pooled like ``_tau``: per round, 1 + the drafts the walk accepts in expectation under the target's law (the
    decoder's ``tau_expected``; before the stop trim). Sampled rows read it without the draws' noise."""
    rounds = sum(r.get("rounds") or 0 for r in rs if r.get("tau_expected") is not None)
    return sum(r["tau_expected"] * r["rounds"] for r in rs
               if r.get("tau_expected") is not None and r.get("rounds")) / rounds if rounds else None


def _tau_turn_mean(rs):
    """The mean of each prompt-turn's own tau (DFlash's paper averages per response; ``_tau`` pools rounds)."""
    taus = [r["decode_tokens"] / r["rounds"] for r in rs if r.get("rounds")]
    return statistics.fmean(taus) if taus else None


def _chimeric_share(rs):
    """The drafted nodes' chimeric share per round, over every round of ``rs`` (pooled like tau, so a short turn
    weighs what its rounds weigh); None when no record measured it."""
    parts = []
    for r in rs:
        if r.get("chimeric_share") is None:
            continue
        weight = ((r.get("chimeric") or {}).get("draft") or {}).get("rounds", r.get("rounds") or 1)
        parts.append((r["chimeric_share"], weight))
    total = sum(w for _, w in parts)
    return sum(x * w for x, w in parts) / total if total else None


def suffix_decay(accept_hist: dict, depth_hist: dict | None = None) -> tuple[list, list | None]:
    """Conditional acceptance per draft depth from a summed ``accept_hist`` (accepted draft nodes per round ->
    rounds): entry k-1 is P(depth k accepted | depth k-1 accepted) = #rounds accepting >= k / #rounds accepting
    >= k - 1 (depth 0, the root, always). It is capped by the trees' depth: a round whose tree stops at depth d
    cannot accept d + 1. With ``depth_hist`` (rounds per deepest tree node) the depths run to the deepest tree
    and the second list is, per depth k, the rounds whose tree reached k; without it the depths run to the
    deepest acceptance and the second list is None. None where no round accepted depth k - 1."""
    hist = {int(k): int(v) for k, v in (accept_hist or {}).items()}
    depth = {int(k): int(v) for k, v in (depth_hist or {}).items()}
    deepest = max(depth) if depth else max(hist, default=0)
    at_least = [sum(v for a, v in hist.items() if a >= k) for k in range(deepest + 1)]
    decay = [at_least[k] / at_least[k - 1] if at_least[k - 1] else None for k in range(1, deepest + 1)]
    reach = [sum(v for d, v in depth.items() if d >= k) for k in range(1, deepest + 1)] if depth else None
    return decay, reach


def summarize(records: list[dict], baseline: str = "ar", peer: str = "hf", engine_peer: str = "llamacpp") -> list[dict]:
    """One row per (method, temperature, budget). Aggregates are sums over the same prompt-turns (tau = emitted
    tokens / rounds, pooled; ``tau_turn_mean``: the turns' own taus averaged; tok/s = tokens / seconds, speedup
    vs AR = ``measure.speedup``, chimeric share = its per-round mean over all rounds); per-prompt spreads beside.
    ``speedup_vs_hf``: the same ratio against ``peer`` (HF ``generate``: what a transformers user gets);
    ``speedup_vs_llamacpp``: against ``engine_peer`` (llama.cpp's own AR), None when it did not run.
    Records of another engine (``"engine": "llama.cpp"``) are checked for losslessness against that engine's AR
    (``mismatches``); where their tokens differ from our AR's they are only counted (``engine_differs``)."""
    base = {_key(r): r for r in records if r["method"] == baseline}
    hf = {_key(r): r for r in records if r["method"] == peer}
    eng = {_key(r): r for r in records if r["method"] == engine_peer}
    groups: dict = {}
    for r in records:
        groups.setdefault((r["method"], r["temperature"], r.get("budget")), []).append(r)
    rows = []
    for (name, temp, budget), rs in groups.items():
        pairs = [(r, base[_key(r)]) for r in rs if _key(r) in base]
        hf_pairs = [(r, hf[_key(r)]) for r in rs if _key(r) in hf]
        eng_pairs = [(r, eng[_key(r)]) for r in rs if _key(r) in eng]
        engine = next((r["engine"] for r in rs if r.get("engine")), None)
        if engine is None:
            mismatches = [f"{r['prompt_id']}#{r['turn']}" for r in rs if r.get("matches_ar") is False]
        else:  # another engine: lossless against its own AR; a difference from ours is numerics, shown apart
            mismatches = [f"{r['prompt_id']}#{r['turn']}" for r, a in eng_pairs
                          if r["temperature"] == 0 and r is not a and r.get("tokens") != a.get("tokens")]
        phase_tot: dict = {}
        hist: dict = {}
        depth_hist: dict = {}
        for r in rs:
            for k, v in (r.get("phase_s") or {}).items():
                phase_tot[k] = phase_tot.get(k, 0.0) + v
            for k, v in (r.get("accept_hist") or {}).items():
                hist[int(k)] = hist.get(int(k), 0) + v
            for k, v in (r.get("depth_hist") or {}).items():
                depth_hist[int(k)] = depth_hist.get(int(k), 0) + v
        tot = sum(phase_tot.values()) or 1.0
        retr = sum(r.get("retrieved_nodes") or 0 for r in rs)
        per_prompt = [r.get("speedup") for r in rs]
        # records without a depth histogram (older runs, HF peers) leave the reach unknown rather than partial
        full_depth = all(r.get("depth_hist") is not None for r in rs if r.get("accept_hist"))
        decay, reach = suffix_decay(hist, depth_hist if full_depth and depth_hist else None)
        rows.append({
            "method": name, "temperature": temp, "budget": budget, "n": len(rs),
            "tau": _tau(rs) if any(r.get("rounds") for r in rs) else None,
            "tau_turn_mean": _tau_turn_mean(rs),
            "tau_expected": _tau_expected(rs),
            "tau_iqr": _iqr([r.get("tau") for r in rs]),
            "tok_s": rate(rs),
            "speedup": speedup([m for m, _ in pairs], [a for _, a in pairs]) if pairs else None,
            "speedup_vs_hf": speedup([m for m, _ in hf_pairs], [a for _, a in hf_pairs]) if hf_pairs else None,
            "speedup_vs_llamacpp": speedup([m for m, _ in eng_pairs], [a for _, a in eng_pairs]) if eng_pairs
            else None,
            "speedup_median": _med(per_prompt), "speedup_iqr": _iqr(per_prompt),
            "speedup_ci": speedup_interval(pairs) if len(pairs) >= MIN_N and name != baseline else None,
            "time_split": {k: v / tot for k, v in phase_tot.items()},
            "overhead_share": phase_tot.get("overhead", 0.0) / tot if phase_tot else None,
            "accept_hist": dict(sorted(hist.items())),
            "suffix_decay": decay,
            "suffix_reach": reach,
            "schedule": schedule_summary(rs),
            "chimeric_share": _chimeric_share(rs),
            "graft_hit_rate": (sum(r.get("retrieved_accepted") or 0 for r in rs) / retr) if retr else None,
            "retrieval_state_bytes": max([r.get("retrieval_state_bytes") or 0 for r in rs]) or None,
            "peak_rss_mb": max(r.get("peak_rss_mb") or 0 for r in rs),
            "busy_records": sum(1 for r in rs if (r.get("load") or {}).get("busy")),
            "mismatches": mismatches,
            "engine": engine, "engine_reference": bool(engine) and name == engine_peer,
            "hf_peer": any(r.get("hf_peer") for r in rs),
            "engine_differs": sum(1 for r in rs if r.get("matches_ar") is False) if engine else None,
            "prompt_parity_failures": sum(1 for r in rs if r.get("prompt_parity") is False) if engine else None,
        })
    return rows


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def _pair(p, fmt="{:.2f}"):
    return "-" if p is None else f"{fmt.format(p[0])}-{fmt.format(p[1])}"


def _lossless(r: dict) -> str:
    if r["temperature"] != 0:
        return "n/a (T>0)"
    if r["method"] == "ar":
        return "reference"
    if r.get("engine"):  # another engine: checked against its own AR; a difference from ours is numerics
        own = "ok" if not r["mismatches"] else f"**MISMATCH x{len(r['mismatches'])}**"
        own = f"{r['engine']} reference" if r.get("engine_reference") else f"{own} vs {r['engine']} AR"
        notes = []
        if r.get("engine_differs"):
            notes.append(f"differs from our AR x{r['engine_differs']}")
        if r.get("prompt_parity_failures"):
            notes.append(f"prompt tokens differ x{r['prompt_parity_failures']}")
        return own + (f" ({'; '.join(notes)})" if notes else "")
    if r.get("hf_peer") and r["mismatches"]:
        return f"differs from our AR x{len(r['mismatches'])} (HF's arithmetic)"
    return "ok" if not r["mismatches"] else f"**MISMATCH x{len(r['mismatches'])}**"


def markdown_table(rows: list[dict]) -> str:
    """The main table; a "speedup vs llama.cpp" column joins "speedup vs HF generate" when llama.cpp's AR ran."""
    eng = any(r.get("speedup_vs_llamacpp") is not None for r in rows)
    head = ("| method | T | budget | n | tau | tok/s | speedup vs AR | per-prompt median [IQR] | 90% interval | "
            "speedup vs HF generate | " + ("speedup vs llama.cpp | " if eng else "")
            + "draft/tree/verify/commit/overhead % | chimeric | graft hit | state B | busy | lossless |")
    lines = [head, "|" + "---|" * (17 if eng else 16)]
    for r in rows:
        ts = r["time_split"]
        split = "/".join(f"{100 * ts.get(k, 0):.0f}" for k in PHASES) if ts else "-"
        loss = _lossless(r)
        med = "-" if r["speedup_median"] is None else f"{r['speedup_median']:.2f} [{_pair(r['speedup_iqr'])}]"
        busy = f"**{r['busy_records']}/{r['n']}**" if r["busy_records"] else "0"
        lines.append(
            f"| {r['method']} | {r['temperature']:g} | {r['budget'] or '-'} | {r['n']} | {_f(r['tau'])} | "
            f"{_f(r['tok_s'], '{:.1f}')} | {_f(r['speedup'])} | {med} | {_pair(r['speedup_ci'])} | "
            f"{_f(r.get('speedup_vs_hf'))} | " + (f"{_f(r.get('speedup_vs_llamacpp'))} | " if eng else "")
            + f"{split} | "
            f"{_f(r['chimeric_share'])} | {_f(r['graft_hit_rate'])} | {r['retrieval_state_bytes'] or '-'} | "
            f"{busy} | {loss} |")
    return "\n".join(lines)


def schedule_summary(records: list[dict]) -> dict | None:
    """Per-round means over a scheduled method's records: nodes drafted and kept, the tokens the survivals
    expected and the tokens realised (accepted + bonus, before the stop trim at EOS or max_new_tokens, as expected
    is; not the emitted tau): their gap is the survivals' calibration on these prompts. None when no record was
    scheduled."""
    rs = [r for r in records if r.get("schedule") and r["schedule"].get("rounds")]
    if not rs:
        return None
    n = sum(r["schedule"]["rounds"] for r in rs)

    def mean(key: str) -> float:
        return sum(r["schedule"][key] * r["schedule"]["rounds"] for r in rs) / n

    def realised(r: dict) -> float:  # a record from before the schedule counted it: emitted plus trimmed tokens
        got = r["schedule"].get("mean_realised_tokens")
        return got if got is not None else (r["decode_tokens"] + (r.get("dropped") or 0)) / r["rounds"]

    sources: dict = {}
    for r in rs:
        for k, v in (r["schedule"].get("survival_source") or {}).items():
            sources[k] = sources.get(k, 0) + v
    return {"rounds": n, "nodes_in": mean("mean_nodes_in"), "nodes_kept": mean("mean_nodes_kept"),
            "expected_raw": mean("mean_expected_raw"),
            "expected_tokens": mean("mean_expected_tokens"),
            "realised_tokens": sum(realised(r) * r["schedule"]["rounds"] for r in rs) / n,
            "survival_source": sources}


def schedule_table(rows: list[dict]) -> str | None:
    """Markdown: per scheduled method, nodes drafted -> kept per round and the tokens per round the offline
    survivals expected, the recalibrated ones the schedule cut by expected, and the realised ones (before the stop
    trim, like expected)."""
    rs = [r for r in rows if r.get("schedule")]
    if not rs:
        return None
    lines = ["| method | T | budget | nodes drafted | nodes kept | expected tokens (offline) | expected (recalibrated) "
             "| realised tokens | survival from |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        s = r["schedule"]
        src = ", ".join(f"{k} {v}" for k, v in s["survival_source"].items())
        lines.append(f"| {r['method']} | {r['temperature']:g} | {r['budget'] or '-'} | {s['nodes_in']:.2f} | "
                     f"{s['nodes_kept']:.2f} | {s['expected_raw']:.2f} | {s['expected_tokens']:.2f} | "
                     f"{s['realised_tokens']:.2f} | {src} |")
    return "\n".join(lines)


def suffix_decay_table(rows: list[dict], depths: int = 8) -> str | None:
    """Markdown: per method, P(depth k accepted | depth k-1 accepted) at depths 1..``depths`` ("-": the trees
    never reached that depth or no round got that far). None when no row has drafted rounds."""
    rs = [r for r in rows if r.get("suffix_decay")]
    if not rs:
        return None
    lines = ["| method | T | " + " | ".join(str(k) for k in range(1, depths + 1)) + " |",
             "|" + "---|" * (depths + 2)]
    for r in rs:
        d = r["suffix_decay"]
        lines.append(f"| {r['method']} | {r['temperature']:g} | "
                     + " | ".join(_f(d[k]) if k < len(d) else "-" for k in range(depths)) + " |")
    return "\n".join(lines)


def group_of(r: dict, by: str = "category") -> str:
    """A record's category (its prompt set when it has none), or its prompt set."""
    return (r.get("category") if by == "category" else None) or r.get("set") or "-"


def group_rows(records: list[dict], by: str = "category", baseline: str = "ar") -> list[dict]:
    """Per category (``by="category"``; a record without one counts under its prompt set) or per prompt set:
    {method, temperature, group, n, tau, speedup} with the aggregate definitions. [] when there would be one
    group only, or no category at all."""
    if by == "category" and not any(r.get("category") for r in records):
        return []
    groups = list(dict.fromkeys(group_of(r, by) for r in records))
    if len(groups) < 2:
        return []
    base = {_key(r): r for r in records if r["method"] == baseline}
    out = []
    for name, temp in dict.fromkeys((r["method"], r["temperature"]) for r in records):
        for g in groups:
            rs = [r for r in records if (r["method"], r["temperature"]) == (name, temp) and group_of(r, by) == g]
            pairs = [(r, base[_key(r)]) for r in rs if _key(r) in base]
            out.append({"method": name, "temperature": temp, "group": g, "n": len(rs),
                        "tau": _tau(rs) if any(r.get("rounds") for r in rs) else None,
                        "speedup": speedup([m for m, _ in pairs], [a for _, a in pairs]) if pairs else None})
    return out


def group_table(grows: list[dict]) -> str | None:
    """``group_rows`` as markdown: one row per method, one "tau / x (n)" column per group."""
    if not grows:
        return None
    groups = list(dict.fromkeys(g["group"] for g in grows))
    lines = ["| method | T | " + " | ".join(f"{g} tau / x (n)" for g in groups) + " |",
             "|" + "---|" * (len(groups) + 2)]
    for name, temp in dict.fromkeys((g["method"], g["temperature"]) for g in grows):
        cells = {g["group"]: g for g in grows if (g["method"], g["temperature"]) == (name, temp)}
        lines.append(f"| {name} | {temp:g} | " + " | ".join(
            f"{_f(c['tau'])} / {_f(c['speedup'])} ({c['n']})" if c["n"] else "-"
            for c in (cells[g] for g in groups)) + " |")
    return "\n".join(lines)


def spread_notes(rows: list[dict], baseline: str = "ar") -> list[str]:
    """Can this run separate methods? Says so when n is too small, else reads the paired bootstrap intervals."""
    notes = []
    for temp in sorted({r["temperature"] for r in rows}):
        rs = [r for r in rows if r["temperature"] == temp and r["method"] != baseline and r["speedup"] is not None]
        if not rs:
            continue
        n = min(r["n"] for r in rs)
        if n < MIN_N:
            notes.append(f"T={temp:g}: n = {n} prompt-turns per method is too small to separate methods (need >= "
                         f"{MIN_N}; raise --limit): read the speedups as a rough picture, not a verdict")
            continue
        faster = [r["method"] for r in rs if r["speedup_ci"] and r["speedup_ci"][0] > 1]
        slower = [r["method"] for r in rs if r["speedup_ci"] and r["speedup_ci"][1] < 1]
        tied = [r["method"] for r in rs if r["method"] not in faster + slower]
        parts = [f"faster than AR: {', '.join(faster) or 'none'}", f"slower: {', '.join(slower) or 'none'}"]
        if tied:
            parts.append(f"not separable from AR: {', '.join(tied)}")
        ranked = sorted((r for r in rs if r["speedup_ci"]), key=lambda r: -r["speedup"])
        close = [f"{a['method']} ~ {b['method']}" for a, b in zip(ranked, ranked[1:])
                 if a["speedup_ci"][0] <= b["speedup_ci"][1]]
        if close:
            parts.append(f"neighbours whose 90% intervals overlap: {', '.join(close)}")
        notes.append(f"T={temp:g}, n = {n} prompt-turns: " + "; ".join(parts))
    return notes


HALF_DTYPES = ("bfloat16", "float16")


def lossless_alarm(rows: list[dict], dtype: str = "float32") -> tuple[str | None, str | None]:
    """The T=0 identity failures as (alarm, note): ours (the lossless contract broke), and peer engines' (a
    peer's speculative output against its own greedy AR is its numerics, which no test of ours covers; HF
    ``generate`` against our AR: two engines' float32 arithmetic, which tests/test_smollm2.py checks on its prompts).
    In bfloat16/float16 ours are a note too: a verify row computed beside other rows rounds differently from the
    same row decoded alone (batch-variant attention and GEMM kernels), so identity holds only in float32, where the
    tests check it; tests/test_dtypes.py shows half-precision trees identical once products run row by row."""
    ours = [(r["method"], r["mismatches"], "AR") for r in rows
            if r["mismatches"] and not r.get("engine") and not r.get("hf_peer")]
    peers = [(r["method"], r["mismatches"], r["engine"] + " AR") for r in rows if r["mismatches"] and r.get("engine")]
    if dtype in HALF_DTYPES:  # ours are arithmetic here too: listed first among the notes, no alarm
        peers = [(m, ids, f"AR in {dtype} (batch-variant kernels)") for m, ids, _ in ours] + peers
        ours = []
    # HF generate's greedy tokens against our AR's: the two engines' float32 arithmetic near a tie, not a method
    peers += [(r["method"], r["mismatches"], "our AR (HF's arithmetic)") for r in rows
              if r["mismatches"] and r.get("hf_peer")]

    def lines(bad):
        return "\n".join(f"  {m}: differs from {ref} on {', '.join(ids)}" for m, ids, ref in bad)

    alarm = ("!!! LOSSLESS CHECK FAILED at T=0: these methods' outputs differ from the target's greedy output:\n"
             + lines(ours)) if ours else None
    note = ("note: outputs that differ from a greedy AR at T=0 through arithmetic, not a broken lossless check "
            "(peer engines' numerics; half-precision kernels):\n" + lines(peers)) if peers else None
    return alarm, note


def paper_verdicts(rows: list[dict], claims: list[dict] = PAPER_CLAIMS) -> list[dict]:
    """Each claim: compare two methods' aggregates from this run and say whether it holds here. In a budget sweep
    (rows named ``method@budget``) a claim is judged at every budget both methods ran (a budget-free baseline, e.g.
    a 64-node tree, pairs with each), and a claim's ``sweep_alias`` stands in for its method."""
    out = []
    idx = {(r["method"], r["temperature"]): r for r in rows}

    def pairs(c):
        """(label suffix, method row, baseline row or None) for every way this run measured the claim."""
        base = c.get("baseline")
        a = idx.get((c["method"], 0.0)) or idx.get((c.get("sweep_alias"), 0.0))
        if a is not None:
            return [("", a, idx.get((base, 0.0)) if base else None)]
        found = []
        for (name, temp), r in idx.items():
            head, at, budget = name.partition("@")
            if temp != 0.0 or not at or head != c["method"]:
                continue
            b = (idx.get((f"{base}@{budget}", 0.0)) or idx.get((base, 0.0))) if base else None
            found.append((f" (budget {budget})", r, b))
        return found or [("", None, None)]

    for c in claims:
        metric = c.get("metric", "speedup")
        for suffix, a, b in pairs(c):
            claim = c["claim"] + suffix
            if a is None or a.get(metric) is None or (c.get("baseline") and (b is None or b.get(metric) is None)):
                out.append({"claim": claim, "paper": c["paper"], "here": None, "holds": None, "close": False})
                continue
            ours = a[metric] / b[metric] if b is not None and c.get("ratio", True) else a[metric]
            close = "range" not in c and not c.get("inclusive") and abs(ours / c["threshold"] - 1) < CLOSE_CALL
            holds = c["range"][0] <= ours <= c["range"][1] if "range" in c else ours >= c["threshold"] and not close
            out.append({"claim": claim, "paper": c["paper"], "here": ours, "holds": holds, "close": close})
    return out


def verdict_table(verdicts: list[dict]) -> str:
    lines = ["| claim | paper | here | verdict |", "|---|---|---|---|"]
    for v in verdicts:
        if v["here"] is None:
            lines.append(f"| {v['claim']} | {v['paper']} | - | not measured (method skipped) |")
        else:
            said = (f"too close to call (within {CLOSE_CALL:.0%} of the bar)" if v["close"]
                    else "holds here" if v["holds"] else "does not hold here")
            lines.append(f"| {v['claim']} | {v['paper']} | {v['here']:.2f} | {said} |")
    return "\n".join(lines)


def header(suite: str, target_name: str, sets_line: str, first_turn_only: bool, max_new: int, temps, load: dict,
           threads: int, device: str, top_k: int = 0, top_p: float = 1.0) -> str:
    filters = (f", top-k {top_k}" if top_k else "") + (f", top-p {top_p:g}" if top_p < 1 else "")
    lines = [f"## graft-block bench: suite={suite} target={target_name} device={device} threads={threads}",
             f"prompts: {sets_line}; first-turn-only: {'yes' if first_turn_only else 'no'}; max_new_tokens "
             f"{max_new}; T {','.join(f'{t:g}' for t in temps)}{filters if any(t > 0 for t in temps) else ''}",
             "speedup vs AR = decode tokens / decode seconds over the same prompt-turns, total over total "
             "(per-prompt median [IQR] and a paired-bootstrap 90% interval beside it)"]
    banner = machine.busy_banner(load)
    if banner:
        lines.append("")
        lines.append(banner)
    elif load.get("busy") is None:
        lines.append("(machine load could not be read here: no busy-machine check)")
    return "\n".join(lines)
