"""Expected tokens a round of each method's tree on fixed held-out contexts, under the target's exact law.

A decoded tau carries two kinds of noise: which contexts the run happens to visit, and, when the target samples,
which token it draws at each node (over 18 prompt-turns at T = 1, runs of one method differ by 0.05-0.1). Here
every context is fixed, a prefix of an answer from the committed calibration split (never trained on), and each
method's tree for it is scored exactly: one target forward over the tree gives each node's probability of being
the target's choice at its parent, and the expected accepted length is the sum over nodes of the probability that
the walk reaches them (``tree.expected_accept_length``). Every method sees the same contexts, so differences come
paired, with a standard error. At T = 0 a context's value is the tree's accepted length there.

    graft-block expect --methods dflash_ddtree,dspark_ddtree,mfd,mfd_k1_ddtree --contexts 300 --temperature 0,1
    graft-block expect --prompts humaneval,mtbench --limit 40 --cuts 4 --temperature 1   # the benchmark's domain

With ``--prompts`` the contexts come from the benchmark's own prompt sets instead: the target's greedy answer to
each prompt's first turn (``--answer-tokens``), cut at ``--cuts`` random points, shuffled; with several sets a
table per set follows the overall one.

Trees come from a fresh round (a drafter's adaptive rows start full). Methods with a graft or a schedule depend on
what earlier rounds verified, and are refused: decode them with ``graft-block bench``.
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
from graft_block.errors import ConfigError  # noqa: E402
from graft_block.eval import presets, report  # noqa: E402
from graft_block.eval.methods import load_method_files, lookup  # noqa: E402
from graft_block.onpolicy import read  # noqa: E402
from graft_block.sampling import SamplingConfig, greedy_tokens, target_probs  # noqa: E402
from graft_block.testing import prefilled_state  # noqa: E402
from graft_block.tree import accept_at_least  # noqa: E402

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
                    seed: int = 0, log=None) -> tuple[list[list[int]], list[str]]:
    """Contexts in a prompt set's domain: the target's greedy answer to each prompt's first turn, cut at ``cuts``
    distinct random points (at least one answer token before a cut, four after), prompt ids included; and each
    context's prompt set."""
    from graft_block import SpeculativeDecoder
    from graft_block.eval.prompts import encode_turn, prompt_records

    recs, _ = prompt_records(sets, limit, first_turn_only=True)
    rng, dec, out, labels = random.Random(seed), SpeculativeDecoder(target, None), [], []
    t0 = time.perf_counter()
    for rec in recs:
        ids = encode_turn(target, [], rec["turns"][0]).tolist()
        answer = dec.generate(ids, max_new_tokens=answer_tokens).tokens
        points = range(1, len(answer) - 3)
        cut = [ids + answer[:c] for c in sorted(rng.sample(points, min(cuts, len(points))))]
        out += cut
        labels += [rec["set"]] * len(cut)
    if log:
        log(f"  {len(recs)} greedy answers of up to {answer_tokens} tokens in {time.perf_counter() - t0:.0f} s")
    if not out:
        raise ConfigError(f"no answer of 5 tokens or more to cut contexts from (--prompts {','.join(sets)})")
    return out, labels


@torch.inference_mode()
def tree_value(target, drafter, ids: list[int], sampling: SamplingConfig) -> tuple[list[float], int]:
    """(P(>= d nodes accepted) for d = 1.. the tree's depth, tree size) of ``drafter``'s tree after the context
    ``ids``; their sum is the expected accepted length."""
    state = prefilled_state(target, ids, drafter)
    state.sampling = sampling
    tree = drafter.propose(state)
    logits, _ = target.verify(tree)
    parents, tokens = tree.parents, tree.tokens.to(logits.device)
    if sampling.greedy:
        q = (greedy_tokens(logits.float())[parents.clamp(min=0)].cpu() == tree.tokens).double()
    else:
        q = target_probs(logits, sampling)[parents.clamp(min=0).to(logits.device), tokens].double().cpu()
    return accept_at_least(tree, q), tree.size


def build_drafter(name: str, spec: dict, target, budget: int | None):
    """The drafter of a tree-only method; ConfigError for anything whose tree depends on earlier rounds."""
    spec = presets.prepare(name, dict(spec), budget)
    if spec.get("graft") or spec.get("schedule"):
        raise ConfigError(f"method {name!r} has a {'graft' if spec.get('graft') else 'schedule'}, which depends on "
                          "what earlier rounds verified: decode it with `graft-block bench` instead")
    if not isinstance(spec.get("drafter"), dict):
        raise ConfigError(f"method {name!r} drafts no tree (AR or a peer): nothing to score here")
    return Drafter.from_config(spec["drafter"], target=target)


def evaluate(target, drafters: dict, contexts: list[list[int]], samplings: list[SamplingConfig],
             log=None) -> dict:
    """{"values": {method: {temperature: [expected accepted nodes per context]}}, "at_least": {method:
    {temperature: [mean P(>= d accepted), d = 1..]}}, "nodes": {method: mean tree size}}."""
    out = {name: {s.temperature: [] for s in samplings} for name in drafters}
    depth = {name: {s.temperature: [] for s in samplings} for name in drafters}
    sizes = {name: [] for name in drafters}
    t0 = time.perf_counter()
    for i, ids in enumerate(contexts):
        for name, d in drafters.items():
            for s in samplings:
                at_least, size = tree_value(target, d, ids, s)
                out[name][s.temperature].append(sum(at_least))
                sums = depth[name][s.temperature]
                sums += [0.0] * (len(at_least) - len(sums))
                for k, v in enumerate(at_least):
                    sums[k] += v
                sizes[name].append(size - 1)
        if log and (i + 1) % 50 == 0:
            log(f"  {i + 1}/{len(contexts)} contexts, {time.perf_counter() - t0:.0f} s")
    n = max(1, len(contexts))
    at_least = {m: {t: [v / n for v in sums] for t, sums in d.items()} for m, d in depth.items()}
    return {"values": out, "at_least": at_least, "nodes": {m: sum(v) / max(1, len(v)) for m, v in sizes.items()}}


def summary_rows(res: dict, only: list[int] | None = None) -> list[dict]:
    """One row per (method, temperature): expected tau and its paired difference from the first method, over the
    contexts numbered ``only`` (all when None)."""
    vals = res["values"]
    if only is not None:
        vals = {m: {t: [xs[i] for i in only] for t, xs in d.items()} for m, d in vals.items()}
    names = list(vals)
    rows = []
    for name in names:
        for temp, xs in vals[name].items():
            ref = vals[names[0]][temp]
            d = [a - b for a, b in zip(xs, ref)]
            mean = sum(d) / len(d)
            sd = math.sqrt(sum((x - mean) ** 2 for x in d) / max(1, len(d) - 1))
            rows.append({"method": name, "temperature": temp, "tau": 1.0 + sum(xs) / len(xs),
                         "nodes": res["nodes"][name], "diff": mean, "se": sd / math.sqrt(len(d)),
                         "contexts": len(xs)})
    return rows


def format_table(rows: list[dict]) -> str:
    base = rows[0]["method"]
    lines = [f"| method | T | tree nodes | expected tau | vs {base} (paired, +- 1 se) | contexts |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        diff = "-" if r["method"] == base else f"{r['diff']:+.3f} +- {r['se']:.3f}"
        lines.append(f"| {r['method']} | {r['temperature']:g} | {r['nodes']:.1f} | {r['tau']:.3f} | {diff} | "
                     f"{r['contexts']} |")
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--methods", default="dflash_ddtree,dspark_ddtree,mfd,mfd_k1_ddtree",
                    help="comma-separated presets or --config names; the first is the reference of the paired "
                         "differences (default: %(default)s)")
    ap.add_argument("--config", action="append", default=[], help="YAML/JSON method file, as for bench")
    ap.add_argument("--contexts", type=int, default=200, help="contexts (one per answer)")
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
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="write rows and per-context values to this JSON file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
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
    samplings = [SamplingConfig(temperature=t, top_k=args.top_k, top_p=args.top_p) for t in temps]
    extra = load_method_files(args.config)
    names = [m for m in args.methods.split(",") if m]
    target = load_target(args.target)
    drafters = {n if len(budgets) == 1 else f"{n}@{b}": build_drafter(n, lookup(n, extra), target, b)
                for b in budgets for n in names}
    if args.prompts:
        contexts, sets = answer_contexts(target, args.prompts.split(","), args.limit, args.cuts,
                                         args.answer_tokens, args.seed, log=print)
        order = list(range(len(contexts)))
        random.Random(args.seed).shuffle(order)
        contexts, sets = [contexts[i] for i in order[: args.contexts]], [sets[i] for i in order[: args.contexts]]
    else:
        contexts = sample_contexts(args.data, args.contexts, args.seed)
        sets = [Path(args.data).name] * len(contexts)
    source = f"greedy answers to {args.prompts}" if args.prompts else args.data
    print(f"expected tau: {len(contexts)} contexts from {source}, target {args.target}, T {temps}"
          + (f", top-k {args.top_k}" if args.top_k else "") + (f", top-p {args.top_p}" if args.top_p < 1 else ""))
    res = evaluate(target, drafters, contexts, samplings, log=print)
    rows = summary_rows(res)
    print(format_table(rows))
    per_set = {}
    if len(set(sets)) > 1:  # paired within each set: a drafter can win on one domain and lose on the other
        for name in dict.fromkeys(sets):
            per_set[name] = summary_rows(res, [i for i, s in enumerate(sets) if s == name])
            print(f"\nprompt set {name}:\n")
            print(format_table(per_set[name]))
    print("\nP(depth k accepted | depth k-1 accepted), exact, mean over contexts:\n")
    print(report.suffix_decay_table(decay_rows(res)))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        per_method = {key: {n: {str(t): v for t, v in d.items()} for n, d in res[key].items()}
                      for key in ("values", "at_least")}
        Path(args.out).write_text(json.dumps({"rows": rows, "per_set": per_set, "sets": sets, "args": vars(args),
                                              **per_method}, indent=1))


if __name__ == "__main__":
    main()
