"""Expected tokens a round of each method's tree on fixed held-out contexts, under the target's exact law.

A decoded tau carries two kinds of noise: which contexts the run happens to visit, and, when the target samples,
which token it draws at each node (over 18 prompt-turns at T = 1, runs of one method differ by 0.05-0.1). Here
every context is fixed, a prefix of an answer from the committed calibration split (never trained on), and each
method's tree for it is scored exactly: one target forward over the tree gives each node's probability of being
the target's choice at its parent, and the expected accepted length is the sum over nodes of the probability that
the walk reaches them (``tree.expected_accept_length``). Every method sees the same contexts, so differences come
paired, with a standard error over answers (the cuts of one answer are not independent draws). At T = 0 a
context's value is the tree's accepted length there.

    graft-block expect --methods dflash_ddtree,dspark_ddtree,mfd,mfd_k1_ddtree --contexts 300 --temperature 0,1
    graft-block expect --prompts humaneval,mtbench --limit 40 --cuts 4 --temperature 1   # the benchmark's domain

With ``--prompts`` the contexts come from the benchmark's own prompt sets instead: the target's greedy answer to
each prompt's first turn (``--answer-tokens``), cut at ``--cuts`` random points, shuffled; with several sets a
table per set follows the overall one.

A cut weighs every position alike, while decoding starts a round only where the last one stopped and crosses an
easy stretch in a few long rounds: gains in deep rows read larger here than decoded (docs/measuring.md). Trees come
from a fresh round (a drafter's adaptive rows start full). Methods with a graft or a schedule depend on what
earlier rounds verified, and are refused: decode them with ``graft-block bench``.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

if not __package__ and (Path(__file__).resolve().parents[1] / "graft_block").is_dir():
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # `python eval/expected_tau.py` in a checkout

import torch  # noqa: E402

from graft_block import Drafter, load_target  # noqa: E402
from graft_block.engine import set_threads  # noqa: E402
from graft_block.errors import ConfigError, run_command  # noqa: E402
from graft_block.eval import presets, report  # noqa: E402
from graft_block.eval.methods import load_method_files, lookup  # noqa: E402
from graft_block.onpolicy import read  # noqa: E402
from graft_block.sampling import SamplingConfig, greedy_tokens, sampling_options, target_probs  # noqa: E402
from graft_block.schedule import node_survival  # noqa: E402
from graft_block.testing import prefilled_state  # noqa: E402
from graft_block.tree import accept_at_least, path_products  # noqa: E402
from graft_block.tree.schedule import (conditional_survival, cost_function, path_survival,  # noqa: E402
                                       schedule_tree, survival_from_scores)

CALIBRATION = Path(__file__).resolve().parents[1] / "drafters" / "data" / "smollm2-sharegpt-calibration"


def sample_contexts(dataset: str | Path, count: int, seed: int = 0, min_answer: int = 8) -> list[list[int]]:
    """``count`` prefixes of the dataset's answers: a random answer, cut at a random point inside it (at least one
    answer token before the cut, four after), each answer used once, in a seeded order."""
    recs = [r for r in read(dataset) if len(r["ids"]) - r["prompt_len"] >= min_answer]
    if not recs:
        raise ConfigError(f"{dataset} has no answer of {min_answer} tokens or more to cut contexts from")
    rng = random.Random(seed)
    rng.shuffle(recs)
    return [r["ids"][: rng.randrange(r["prompt_len"] + 1, len(r["ids"]) - 4)].tolist() for r in recs[:count]]


def answer_contexts(target, sets: list[str], limit: int, cuts: int = 4, answer_tokens: int = 96,
                    seed: int = 0, log=None) -> tuple[list[list[int]], list[str], list[int]]:
    """Contexts in a prompt set's domain: the target's greedy answer to each prompt's first turn, cut at ``cuts``
    distinct random points (at least one answer token before a cut, four after), prompt ids included; each
    context's prompt set; and the number of the answer it was cut from. ``cuts=None``: every position from the
    answer's first token on, in order (``walk_taus`` reads them back per answer: each answer's contexts are
    prompt + answer[:c], c = 0, 1, ...)."""
    from graft_block import SpeculativeDecoder
    from graft_block.eval.prompts import encode_turn, prompt_records

    recs, _ = prompt_records(sets, limit, first_turn_only=True)
    rng, dec, out, labels, answers = random.Random(seed), SpeculativeDecoder(target, None), [], [], []
    t0 = time.perf_counter()
    for n, rec in enumerate(recs):
        ids = encode_turn(target, [], rec["turns"][0]).tolist()
        answer = dec.generate(ids, max_new_tokens=answer_tokens).tokens
        if cuts is None:
            cut = [ids + answer[:c] for c in range(len(answer) - 1)]
        else:
            points = range(1, len(answer) - 3)
            cut = [ids + answer[:c] for c in sorted(rng.sample(points, min(cuts, len(points))))]
        out += cut
        labels += [rec["set"]] * len(cut)
        answers += [n] * len(cut)
    if log:
        log(f"  {len(recs)} greedy answers of up to {answer_tokens} tokens in {time.perf_counter() - t0:.0f} s")
    if not out:
        raise ConfigError(f"no answer of 5 tokens or more to cut contexts from (--prompts {','.join(sets)})")
    return out, labels, answers


@torch.inference_mode()
def tree_value(target, drafter, ids: list[int], sampling: SamplingConfig, survival_from: str = "drafter") -> dict:
    """One round's tree after the context ``ids``, scored exactly: ``at_least`` (P(>= d nodes accepted) for d = 1..
    the tree's depth; their sum is the expected accepted length), ``reach`` (per node, P(the walk reaches it)),
    ``estimate`` (P(node accepted) as a schedule reads it: the drafter's ``node_survival`` where it has one and
    ``survival_from`` is "drafter", else the tree's path probabilities), ``tree``."""
    state = prefilled_state(target, ids, drafter)
    state.sampling = sampling
    tree = drafter.propose(state)
    logits, _ = target.verify(tree)
    parents, tokens = tree.parents, tree.tokens.to(logits.device)
    if sampling.greedy:
        q = (greedy_tokens(logits.float())[parents.clamp(min=0)].cpu() == tree.tokens).double()
    else:
        q = target_probs(logits, sampling)[parents.clamp(min=0).to(logits.device), tokens].double().cpu()
    return {"at_least": accept_at_least(tree, q), "reach": path_products(tree, q.tolist()), "tree": tree,
            "estimate": node_survival(tree, drafter, survival_from)[0]}


def cut_values(tree, reach: list[float], estimate, cost, overhead: float) -> dict:
    """One context's numbers for ``headroom``: the realised tokens of every prefix of the tree's best-first order
    (by its path probabilities; a DDTree-N is its first N nodes), and those of the cut the confidence schedule makes
    from ``estimate`` (siblings' conditionals scaled to sum to 1 at most, as ``ConfidenceSchedule`` does, without its
    online recalibration), with its size. Tokens count the round's bonus token (the root's reach, 1). At T > 0
    ``reach`` is a probability, so "realised" means expected under the target's law."""
    order = (torch.sort(-path_survival(tree, survival_from_scores(tree))[1:], stable=True).indices + 1).tolist()
    prefix = [1.0]
    for i in order:
        prefix.append(prefix[-1] + reach[i])
    offline = path_products(tree, conditional_survival(tree, path_survival(tree, estimate).tolist()))
    _, info = schedule_tree(tree, torch.tensor(offline, dtype=torch.float64), cost, 0, overhead)
    return {"prefix": prefix, "cut_tokens": sum(reach[i] for i in info["nodes"]), "cut_nodes": info["kept"],
            "estimated": sum(offline), "realised": sum(reach)}


def headroom(values: list[dict], cost, overhead: float) -> dict:
    """What a per-round cut could gain on a verify-cost curve, from ``cut_values`` of many contexts. A round of n
    non-root nodes costs ``overhead + cost(1 + n)`` seconds and AR ``cost(1)`` a token; speedup = tokens per second
    over AR's. Rows: each fixed prefix size N (about a smaller DDTree: a block drafter's rows also change with the
    rows drafted), the schedule's cut, and an oracle that knows each context's best prefix size (the most any cut
    along the tree's order can get: the ratio of sums, maximised by Dinkelbach's iteration; at T > 0 it knows the
    acceptance probabilities, not the draws). ``estimated / realised``: the estimate's expected tokens over the
    realised ones for the whole tree, the bonus token included in both (1 = calibrated)."""
    def secs(n):
        return overhead + float(cost(1 + n))

    ar, n_ctx = float(cost(1)), len(values)
    sizes = [len(v["prefix"]) - 1 for v in values]
    fixed = {}
    for N in range(max(sizes) + 1):
        tok = sum(v["prefix"][min(N, s)] for v, s in zip(values, sizes))
        fixed[N] = {"tau": tok / n_ctx, "speedup": tok * ar / sum(secs(min(N, s)) for s in sizes)}
    best = max(fixed, key=lambda n: (fixed[n]["speedup"], -n))
    tok, t = sum(v["cut_tokens"] for v in values), sum(secs(v["cut_nodes"]) for v in values)
    cut = {"tau": tok / n_ctx, "nodes": sum(v["cut_nodes"] for v in values) / n_ctx, "speedup": tok * ar / t}
    picks = [min(best, s) for s in sizes]  # Dinkelbach from the best fixed size: each step raises the rate
    tok = sum(v["prefix"][n] for v, n in zip(values, picks))
    rate = tok / sum(secs(n) for n in picks)
    for _ in range(50):
        step = [max(range(s + 1), key=lambda n: (v["prefix"][n] - rate * secs(n), -n)) for v, s in zip(values, sizes)]
        got = sum(v["prefix"][n] for v, n in zip(values, step))
        step_rate = got / sum(secs(n) for n in step)
        if step_rate <= rate * (1 + 1e-12):
            if step_rate >= rate * (1 - 1e-12):  # as good: the step's smaller trees at ties
                picks, tok = step, got
            break
        picks, tok, rate = step, got, step_rate
    oracle = {"tau": tok / n_ctx, "nodes": sum(picks) / n_ctx, "speedup": rate * ar}
    return {"fixed": fixed, "best_fixed": best, "cut": cut, "oracle": oracle, "overhead_s": overhead,
            "estimated_over_realised": sum(v["estimated"] for v in values) / sum(v["realised"] for v in values)}


def tree_spec(name: str, spec: dict, budget: int | None, schedule_ok: bool = False) -> dict:
    """A tree-only method's prepared spec; ConfigError, before any model loads, for anything whose tree depends on
    earlier rounds (a schedule only cuts the drafter's tree, so ``schedule_ok`` lets the headroom price its cut, as
    long as the cut is the default one that prices)."""
    spec = presets.prepare(name, dict(spec), budget)
    if spec.get("graft") or (spec.get("schedule") and not schedule_ok):
        raise ConfigError(f"method {name!r} has a {'graft' if spec.get('graft') else 'schedule'}, which depends on "
                          "what earlier rounds verified: decode it with `graft-block bench` instead"
                          + ("" if spec.get("graft") else " (or price its cut with --headroom)"))
    sched = spec.get("schedule") or {}
    if sched.get("min_nodes", 0) != 0 or sched.get("stop", "best") != "best":
        raise ConfigError(f"method {name!r}: --headroom prices the schedule's default cut (min_nodes 0, stop "
                          "'best'); decode other cuts with `graft-block bench`")
    if not isinstance(spec.get("drafter"), dict):
        raise ConfigError(f"method {name!r} drafts no tree (AR or a peer): nothing to score here")
    return spec


def estimate_source(spec: dict) -> str:
    """Where a method's schedule reads node survival: "drafter" (its confidence head where it has one) or "scores"
    (path probabilities); a method without a schedule is priced as if it had the default one."""
    return (spec.get("schedule") or {}).get("survival", "drafter")


def evaluate(target, drafters: dict, contexts: list[list[int]], samplings: list[SamplingConfig],
             log=None, cuts: tuple | None = None, estimates: dict | None = None) -> dict:
    """{"values": {method: {temperature: [expected accepted nodes per context]}}, "at_least": {method:
    {temperature: [mean P(>= d accepted), d = 1..]}}, "nodes": {method: mean tree size}, "per_context": {method:
    {temperature: [(P(>= d accepted), d = 1..) per context]}}, "first_draft": {method: {temperature: [its tree's
    ``first_draft_logp`` per context]}}}; with ``cuts`` = (cost,
    overhead seconds), also "headroom": {method: {temperature: ``headroom`` of its trees}}, each cut from the
    survival source ``estimates[method]`` names ("drafter" by default: ``estimate_source``)."""
    out = {name: {s.temperature: [] for s in samplings} for name in drafters}
    per_context = {name: {s.temperature: [] for s in samplings} for name in drafters}
    first = {name: {s.temperature: [] for s in samplings} for name in drafters}
    cut_rows = {name: {s.temperature: [] for s in samplings} for name in drafters}
    sizes = {name: [] for name in drafters}
    t0 = time.perf_counter()
    for i, ids in enumerate(contexts):
        for name, d in drafters.items():
            for s in samplings:
                v = tree_value(target, d, ids, s, (estimates or {}).get(name, "drafter"))
                at_least = v["at_least"]
                out[name][s.temperature].append(sum(at_least))
                per_context[name][s.temperature].append(at_least)
                first[name][s.temperature].append(first_draft_logp(v["tree"]))
                sizes[name].append(v["tree"].size - 1)
                if cuts is not None:
                    cut_rows[name][s.temperature].append(cut_values(v["tree"], v["reach"], v["estimate"], *cuts))
        if log and (i + 1) % 50 == 0:
            log(f"  {i + 1}/{len(contexts)} contexts, {time.perf_counter() - t0:.0f} s")
    at_least = {m: {t: mean_at_least(rows) for t, rows in d.items()} for m, d in per_context.items()}
    res = {"values": out, "at_least": at_least, "nodes": {m: sum(v) / max(1, len(v)) for m, v in sizes.items()},
           "per_context": per_context, "first_draft": first}
    if cuts is not None:
        res["headroom"] = {m: {t: headroom(vs, *cuts) for t, vs in d.items()} for m, d in cut_rows.items()}
    return res


def mean_at_least(rows: list[list[float]]) -> list[float]:
    """The mean over contexts of P(>= d accepted), d = 1.. the deepest tree's depth (a shallower tree adds 0 there);
    [] for no contexts."""
    depth = max(map(len, rows), default=0)
    return [sum(r[k] for r in rows if k < len(r)) / len(rows) for k in range(depth)]


def first_draft_logp(tree) -> float:
    """The drafter's log-probability of its likeliest first draft (the best depth-1 node's score: block drafters
    and EAGLE score nodes by path log-probability); -inf when the tree has no depth-1 node."""
    first = tree.depths == 1
    return float(tree.scores[first].max()) if bool(first.any()) else float("-inf")


def paired_se(diffs: list[float], groups: list) -> float:
    """Standard error of the mean of ``diffs`` with the contexts of one group (one answer) as one draw: the
    cluster-robust estimate, sqrt(G / (G - 1) * sum over groups of (their summed deviations)^2) / n, which is
    sd / sqrt(n) when every context is its own group. Cuts of one answer share its difficulty, so counting them
    as independent would shrink the interval."""
    n = len(diffs)
    mean = sum(diffs) / n
    dev: dict = {}
    for x, g in zip(diffs, groups):
        dev[g] = dev.get(g, 0.0) + x - mean
    G = len(dev)
    return math.sqrt(G / max(1, G - 1) * sum(v * v for v in dev.values())) / n


def summary_rows(res: dict, only: list[int] | None = None, groups: list | None = None) -> list[dict]:
    """One row per (method, temperature): expected tau and its paired difference from the first method, over the
    contexts numbered ``only`` (all when None); ``groups`` (one per context: the answer it was cut from; None =
    each context its own) are the independent units of the difference's standard error."""
    vals = res["values"]
    n_all = len(next(iter(vals[next(iter(vals))].values())))  # contexts scored (every method saw them all)
    keep = list(range(n_all)) if only is None else list(only)
    units = [i if groups is None else groups[i] for i in keep]
    vals = {m: {t: [xs[i] for i in keep] for t, xs in d.items()} for m, d in vals.items()}
    names = list(vals)
    rows = []
    for name in names:
        for temp, xs in vals[name].items():
            ref = vals[names[0]][temp]
            d = [a - b for a, b in zip(xs, ref)]
            rows.append({"method": name, "temperature": temp, "tau": 1.0 + sum(xs) / len(xs),
                         "nodes": res["nodes"][name], "diff": sum(d) / len(d), "se": paired_se(d, units),
                         "contexts": len(xs), "answers": len(set(units))})
    return rows


def walk_taus(res: dict, answers: list[int]) -> list[dict]:
    """Greedy decoding's own path over every-position values (``answer_contexts(cuts=None)``, whose third list,
    ``answers``, numbers each context's answer; an answer's contexts sit in position order): a round on context
    c accepts value(c) drafts and emits them and its bonus, so the next starts at c + value(c) + 1. Per method: the
    mean over all positions (what random cuts estimate) and the walk's tokens per round, which is the decoded tau
    of those turns at T = 0 (the last round counted up to the answer's end). Rounds start after a token the last
    tree missed, so the walk visits the harder positions and reads below the mean."""
    starts = [i for i, a in enumerate(answers) if i == 0 or a != answers[i - 1]]  # a new answer
    spans = list(zip(starts, starts[1:] + [len(answers)]))  # one answer's positions each
    rows = []
    for name, d in res["values"].items():
        vals = [round(v) for v in d[0.0]]  # at T = 0 a value is a count of accepted nodes
        tokens = rounds = 0
        for lo, hi in spans:
            c = 0
            while c < hi - lo:
                tokens += min(vals[lo + c] + 1, hi - lo - c)
                rounds += 1
                c += vals[lo + c] + 1
        rows.append({"method": name, "mean_tau": 1.0 + sum(vals) / len(vals), "walk_tau": tokens / rounds,
                     "rounds": rounds, "positions": len(vals)})
    return rows


def format_table(rows: list[dict]) -> str:
    base = rows[0]["method"]
    lines = [f"| method | T | tree nodes | expected tau | vs {base} (paired, +- 1 se) | contexts |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        diff = "-" if r["method"] == base else f"{r['diff']:+.3f} +- {r['se']:.3f}"
        answers = r.get("answers", r["contexts"])
        count = f"{r['contexts']}" + (f" ({answers} answers)" if answers < r["contexts"] else "")
        lines.append(f"| {r['method']} | {r['temperature']:g} | {r['nodes']:.1f} | {r['tau']:.3f} | {diff} | "
                     f"{count} |")
    return "\n".join(lines)


def format_headroom(res: dict) -> str:
    lines = ["| method | T | tree nodes | whole tree: tau / vs AR | best fixed size: N / tau / vs AR "
             "| the schedule's cut: nodes / tau / vs AR | best size per context (oracle): nodes / tau / vs AR "
             "| estimated / realised |",
             "|---|---|---|---|---|---|---|---|"]
    for name, by_t in res["headroom"].items():
        for temp, h in by_t.items():
            whole = h["fixed"][max(h["fixed"])]
            best, cut, orc = h["fixed"][h["best_fixed"]], h["cut"], h["oracle"]
            cells = [f"{whole['tau']:.3f} / {whole['speedup']:.3f}",
                     f"{h['best_fixed']} / {best['tau']:.3f} / {best['speedup']:.3f}",
                     f"{cut['nodes']:.2f} / {cut['tau']:.3f} / {cut['speedup']:.3f}",
                     f"{orc['nodes']:.2f} / {orc['tau']:.3f} / {orc['speedup']:.3f}",
                     f"{h['estimated_over_realised']:.2f}"]
            lines.append(f"| {name} | {temp:g} | {res['nodes'][name]:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_sizes(res: dict) -> str:
    """Estimated speedup over AR of each fixed size N (the first N nodes by path probability; 0 = the root alone) per
    method: where the verify curve's stairs fall against the tokens each size adds."""
    sizes = sorted({n for by_t in res["headroom"].values() for h in by_t.values() for n in h["fixed"]})
    shown = [n for n in sizes if n in (0, 1, 2, 3, 4, 5, 6, 8, 12) or n % 16 == 0 or n == sizes[-1]]
    lines = ["| method | T | " + " | ".join(f"N = {n}" for n in shown) + " |", "|---|---|" + "---|" * len(shown)]
    for name, by_t in res["headroom"].items():
        for temp, h in by_t.items():
            cells = [f"{h['fixed'][n]['speedup']:.3f}" if n in h["fixed"] else "-" for n in shown]
            lines.append(f"| {name} | {temp:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def decay_rows(res: dict) -> list[dict]:
    """Per (method, temperature): P(depth k accepted | depth k-1 accepted) under the target's law, in the rows
    ``report.suffix_decay_table`` prints for bench (None where depth k - 1 is reached with P < 1e-6, a ratio of
    rounding-sized numbers)."""
    rows = []
    for name, by_t in res["at_least"].items():
        for temp, at_least in by_t.items():
            prev = [1.0] + at_least[:-1]
            rows.append({"method": name, "temperature": temp,
                         "suffix_decay": [a / p if p >= 1e-6 else None for a, p in zip(at_least, prev)]})
    return rows


def decay_by_first_draft(res: dict, bins: int) -> list[dict]:
    """``decay_rows`` within ``bins`` equal-count groups of contexts, ordered by how sure the first method's drafter
    was of its first draft (``first_draft_logp``), at each temperature: where each method's conditional acceptance
    comes from. Every method is read on the same contexts of a group, so the rows of one group are paired. Each row
    adds "group" (1 = the least sure), "p_first" (the group's range of that probability) and "contexts"."""
    ref = next(iter(res["first_draft"]))
    rows = []
    for temp, logps in res["first_draft"][ref].items():
        order = sorted(range(len(logps)), key=lambda i: logps[i])
        for g in range(bins):
            idx = order[g * len(order) // bins: (g + 1) * len(order) // bins]
            if not idx:
                continue
            span = (math.exp(logps[idx[0]]), math.exp(logps[idx[-1]]))
            for name, by_t in res["per_context"].items():
                mean = mean_at_least([by_t[temp][i] for i in idx])
                row = decay_rows({"at_least": {name: {temp: mean}}})[0]
                rows.append({**row, "method": f"{name}, {ref} p1 {span[0]:.2f}-{span[1]:.2f}", "group": g + 1,
                             "p_first": span, "contexts": len(idx)})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--methods", default="dflash_ddtree,dspark_ddtree,mfd,mfd_k1_ddtree",
                    help="comma-separated presets or --config names; the first is the reference of the paired "
                         "differences (default: %(default)s)")
    ap.add_argument("--config", action="append", default=[], help="YAML/JSON method file, as for bench")
    ap.add_argument("--contexts", type=int, default=200,
                    help="contexts (one per answer of --data; with --prompts, --cuts of each answer)")
    ap.add_argument("--temperature", default="0", help="comma-separated target temperatures (0 = greedy)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--budget", default=None, help="every method's budget, or a comma-separated list (each method "
                                                   "at each budget, named method@budget); default: each preset's")
    ap.add_argument("--data", default=str(CALIBRATION), help="on-policy dataset folder the contexts are cut from")
    ap.add_argument("--prompts", default=None, help="cut the contexts from the target's greedy answers to these prompt "
                                                    "sets instead (as bench's --prompts: humaneval, mtbench, a .jsonl)")
    ap.add_argument("--limit", type=int, default=20, help="with --prompts: prompts per set (0 = all)")
    ap.add_argument("--cuts", type=int, default=4, help="with --prompts: contexts cut from each answer")
    ap.add_argument("--answer-tokens", type=int, default=96, help="with --prompts: greedy answer length")
    ap.add_argument("--walk", action="store_true",
                    help="with --prompts, greedy: score every position of each answer instead of --cuts random ones, "
                         "and give the tau of decoding's own walk over them (= the decoded tau of those turns; "
                         "--cuts and --contexts do not apply)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) / bfloat16 (GPU default) / float16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--headroom", action="store_true",
                    help="also estimate, on this machine's verify-cost curve, the speedup of each fixed tree size, of "
                         "the confidence schedule's cut and of the best size per context (an oracle)")
    ap.add_argument("--overhead-ms", type=float, default=2.5,
                    help="with --headroom: a round's time outside its verify (bench's draft + tree + commit)")
    ap.add_argument("--by-first-draft", type=int, default=0, metavar="N",
                    help="also split the contexts into N equal groups by the first method's probability of its "
                         "first draft and give P(depth k | k-1) of every method within each")
    ap.add_argument("--out", default=None, help="write rows and per-context values to this JSON file")
    args = ap.parse_args(argv)
    if args.overhead_ms < 0:
        raise ConfigError(f"--overhead-ms must be >= 0, got {args.overhead_ms}")
    if args.by_first_draft < 0:
        raise ConfigError(f"--by-first-draft must be >= 0 (0 = no split), got {args.by_first_draft}")
    if args.cuts < 1 or args.answer_tokens < 5:
        raise ConfigError(f"--cuts must be >= 1 and --answer-tokens >= 5 (a cut keeps one answer token before it and "
                          f"four after), got {args.cuts} and {args.answer_tokens}")
    set_threads(args.threads)
    if args.contexts < 1:
        raise ConfigError(f"--contexts must be >= 1, got {args.contexts}")
    try:
        budgets = [None] if args.budget is None else [int(b) for b in str(args.budget).split(",")]
    except ValueError as exc:
        raise ConfigError(f"--budget takes an int or comma-separated ints, got {args.budget!r}") from exc
    if any(b is not None and b < 1 for b in budgets):
        raise ConfigError(f"--budget must be >= 1, got {args.budget}")
    try:
        temps = [float(t) for t in args.temperature.split(",")]
    except ValueError as exc:
        raise ConfigError(f"--temperature takes comma-separated numbers, got {args.temperature!r}") from exc
    samplings = sampling_options(temps, args.top_k, args.top_p)  # a bad one fails before any model loads
    if args.walk and (not args.prompts or temps != [0.0]):
        raise ConfigError("--walk needs --prompts and --temperature 0: it follows greedy decoding's path over the "
                          "target's own answers (a sampled path depends on the draws)")
    extra = load_method_files(args.config)
    names = [m for m in args.methods.split(",") if m]
    # every method's refusal, before the model loads; a budget past a method's max_budget runs (once) at the cap
    runs = dict.fromkeys((n, presets.budget_for(lookup(n, extra), b)) for b in budgets for n in names)
    specs = {n if len(budgets) == 1 else f"{n}@{b}": tree_spec(n, lookup(n, extra), b, schedule_ok=args.headroom)
             for n, b in runs}
    target = load_target(args.target, device=args.device, dtype=args.dtype)
    drafters = {label: Drafter.from_config(spec["drafter"], target=target) for label, spec in specs.items()}
    estimates = {label: estimate_source(spec) for label, spec in specs.items()}
    if args.prompts:
        contexts, sets, answers = answer_contexts(target, args.prompts.split(","), args.limit,
                                                  None if args.walk else args.cuts, args.answer_tokens, args.seed,
                                                  log=print)
        if not args.walk:  # the walk keeps every position, in order
            order = list(range(len(contexts)))
            random.Random(args.seed).shuffle(order)
            contexts, sets, answers = ([xs[i] for i in order[: args.contexts]] for xs in (contexts, sets, answers))
    else:
        contexts = sample_contexts(args.data, args.contexts, args.seed)
        sets, answers = [Path(args.data).name] * len(contexts), list(range(len(contexts)))  # one cut an answer
    source = f"greedy answers to {args.prompts}" if args.prompts else args.data
    print(f"expected tau: {len(contexts)} contexts from {source}, target {args.target}, T {temps}"
          + (f", top-k {args.top_k}" if args.top_k else "") + (f", top-p {args.top_p}" if args.top_p < 1 else ""))
    cuts = None
    if args.headroom:
        from graft_block.eval.measure import verify_cost_curve

        curve = verify_cost_curve(target)
        cuts = (cost_function(curve), args.overhead_ms / 1e3)
        print(f"verify-cost curve ({curve.get('source', 'measured')}): 1 / 5 / 17 positions "
              + " / ".join(f"{1e3 * cuts[0](n):.1f}" for n in (1, 5, 17)) + " ms")
    res = evaluate(target, drafters, contexts, samplings, log=print, cuts=cuts, estimates=estimates)
    rows = summary_rows(res, groups=answers)
    print(format_table(rows))
    walk = walk_taus(res, answers) if args.walk else None
    if walk:
        print("\nDecoding's own walk over these values (a round starts where the last stopped):\n")
        print("| method | mean over positions | walk (= decoded) | rounds | positions |\n|---|---|---|---|---|")
        for w in walk:
            print(f"| {w['method']} | {w['mean_tau']:.3f} | {w['walk_tau']:.3f} | {w['rounds']} | {w['positions']} |")
    per_set = {}
    if len(set(sets)) > 1:  # paired within each set: a drafter can win on one domain and lose on the other
        for name in dict.fromkeys(sets):
            per_set[name] = summary_rows(res, [i for i, s in enumerate(sets) if s == name], answers)
            print(f"\nprompt set {name}:\n")
            print(format_table(per_set[name]))
    if cuts is not None:
        print(f"\nPer-round cuts on this machine's verify-cost curve (a round = {args.overhead_ms:g} ms + its verify; "
              "vs AR = estimated speedup):\n")
        print(format_headroom(res))
        print("\nEstimated speedup over AR of a fixed size N (the first N nodes by path probability: a DDTree-N):\n")
        print(format_sizes(res))
    print("\nP(depth k accepted | depth k-1 accepted), exact, mean over contexts:\n")
    print(report.suffix_decay_table(decay_rows(res)))
    by_first = decay_by_first_draft(res, args.by_first_draft) if args.by_first_draft > 0 else None
    if by_first:
        ref = next(iter(res["first_draft"]))
        print(f"\nThe same, within {args.by_first_draft} equal groups of contexts by {ref}'s probability of its "
              "first draft (paired within a group):\n")
        print(report.suffix_decay_table(by_first))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        per_method = {key: {n: {str(t): v for t, v in d.items()} for n, d in res[key].items()}
                      for key in ("values", "at_least", "per_context")}
        per_method["first_draft"] = {n: {str(t): [None if math.isinf(x) else x for x in v] for t, v in d.items()}
                                     for n, d in res["first_draft"].items()}  # -inf (no depth-1 node): null
        if cuts is not None:
            per_method["headroom"] = {n: {str(t): h for t, h in d.items()} for n, d in res["headroom"].items()}
        Path(args.out).write_text(json.dumps({"rows": rows, "per_set": per_set, "sets": sets, "answers": answers,
                                              "args": vars(args), "walk": walk, "by_first_draft": by_first,
                                              **per_method}, indent=1))


if __name__ == "__main__":
    sys.exit(run_command(main, "python -m graft_block.eval.expected_tau"))
