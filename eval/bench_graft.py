"""Retrieval-only drafters on a real target: Token Recycling, PLD, PLD + matrix; matrix warm-up 0 vs N rounds.

    python eval/bench_graft.py --target smollm2-135m --humaneval 5 --mtbench 5 --max-new-tokens 128

Greedy, chat template, batch 1. Per prompt, AR and every method run back to back (interleaved), so load drift on a
shared machine hits all methods alike. Reports tau (tokens per target forward, bonus included), decode tok/s,
speedup over AR (ratio of summed tokens/s and median per-prompt ratio), retrieval hit rates and matrix bytes; every
output is checked token-identical to AR. Each matrix persists across the prompts of its method (hot start).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graft_block.drafters.pld import PromptLookupDrafter  # noqa: E402
from graft_block.drafters.recycling import PLDMatrixDrafter, RecyclingDrafter  # noqa: E402
from graft_block import SpeculativeDecoder, load_target  # noqa: E402
from graft_block.adjacency import AdjacencyMatrix  # noqa: E402
from graft_block.data import humaneval, mtbench  # noqa: E402


def build_methods(target, args):
    """name -> (drafter, matrix or None, warm-up seconds)."""
    methods = {}
    for w in args.warmup:
        warm = AdjacencyMatrix(target.vocab_size, args.k, args.dtype, target.device)
        t0 = time.perf_counter()
        warm.warmup(target, rounds=w, new_tokens=args.warmup_tokens)  # ShareGPT calibration split, never eval
        dt = time.perf_counter() - t0
        for kind, budget in (("recycling", args.recycling_budget), ("pld_matrix", args.pld_matrix_budget)):
            if kind == "pld_matrix" and args.pld_matrix_warmup is not None and w not in args.pld_matrix_warmup:
                continue
            m = AdjacencyMatrix(target.vocab_size, args.k, args.dtype, target.device)
            m.table.copy_(warm.table)  # each method gets its own copy of the same warm state
            m.updates = warm.updates
            cls = RecyclingDrafter if kind == "recycling" else PLDMatrixDrafter
            d = cls(budget=budget, k=args.k, warmup_rounds=0, matrix=m)
            methods[f"{kind}(b={budget},warmup={w})"] = (d, m, dt)
    methods[f"pld(b={args.pld_budget})"] = (PromptLookupDrafter(budget=args.pld_budget), None, 0.0)
    return methods


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--humaneval", type=int, default=5)
    ap.add_argument("--mtbench", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--recycling-budget", type=int, default=80)
    ap.add_argument("--pld-matrix-budget", type=int, default=60)
    ap.add_argument("--pld-budget", type=int, default=10)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--dtype", default="int32", choices=["int32", "int64"])
    ap.add_argument("--warmup", type=int, nargs="+", default=[0, 5], help="matrix warm-up rounds to compare")
    ap.add_argument("--pld-matrix-warmup", type=int, nargs="+", default=None,
                    help="warm-up settings for pld_matrix (default: all of --warmup); fewer = a shorter run")
    ap.add_argument("--warmup-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="runs/bench_graft.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    target = load_target(args.target, device=args.device)
    prompts = [("humaneval", r) for r in humaneval(args.humaneval)] + [("mtbench", r) for r in mtbench(args.mtbench)]
    methods = build_methods(target, args)
    ar = SpeculativeDecoder(target, None)
    decs = {name: SpeculativeDecoder(target, d) for name, (d, _, _) in methods.items()}
    # One untimed warm-up generation per decoder (allocator, kernels), as the papers do.
    msgs0 = [{"role": "user", "content": "Say hello."}]
    ar.generate(msgs0, max_new_tokens=8)
    rows = {name: [] for name in ["AR", *methods]}
    mismatches = {name: 0 for name in methods}
    t_start = time.perf_counter()
    for i, (src, rec) in enumerate(prompts):
        msgs = [{"role": "user", "content": rec["turns"][0]}]
        base = ar.generate(msgs, max_new_tokens=args.max_new_tokens)
        rows["AR"].append({"id": rec["id"], "set": src, **_row(base.stats)})
        for name, dec in decs.items():
            res = dec.generate(msgs, max_new_tokens=args.max_new_tokens)
            mismatches[name] += int(res.tokens != base.tokens)
            rows[name].append({"id": rec["id"], "set": src, **_row(res.stats),
                               "speedup": res.stats.decode_tok_s / max(base.stats.decode_tok_s, 1e-9)})
        print(f"[{i + 1}/{len(prompts)}] {rec['id']} done at {time.perf_counter() - t_start:.0f}s", flush=True)

    summary = {}
    ar_tok_s = sum(r["committed"] for r in rows["AR"]) / sum(r["decode_s"] for r in rows["AR"])
    for name, rs in rows.items():
        committed, secs = sum(r["committed"] for r in rs), sum(r["decode_s"] for r in rs)
        rounds = sum(r["rounds"] for r in rs)
        s = {"tau": committed / rounds, "decode_tok_s": committed / secs, "speedup": committed / secs / ar_tok_s,
             "median_prompt_speedup": statistics.median(r.get("speedup", 1.0) for r in rs)}
        for subset in ("humaneval", "mtbench"):
            sub = [r for r in rs if r["set"] == subset]
            if sub:
                s[f"tau_{subset}"] = sum(r["committed"] for r in sub) / sum(r["rounds"] for r in sub)
        if name != "AR":
            d, m, wdt = methods[name]
            ret, acc = sum(r["retrieved_nodes"] for r in rs), sum(r["retrieved_accepted"] for r in rs)
            s.update(mismatches=mismatches[name], retrieved_accepted_per_round=acc / rounds,
                     retrieved_hit_rate_per_node=acc / max(ret, 1),
                     rounds_with_accepted_retrieval=(d.stats["rounds_with_retrieved_hit"] / max(d.stats["rounds"], 1)
                                                     if hasattr(d, "stats") else None),
                     matrix_bytes=None if m is None else m.nbytes, warmup_s=wdt,
                     matrix_filled_rows=None if m is None else m.filled_rows)
        summary[name] = s
    out = {"target": args.target, "device": args.device, "threads": args.threads, "max_new_tokens": args.max_new_tokens,
           "prompts": [r["id"] for _, r in prompts], "summary": summary, "per_prompt": rows,
           "wall_s": time.perf_counter() - t_start}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print("\n| method | tau | tau HE | tau MT | decode tok/s | speedup | median speedup | acc. retrieved/round | "
          "hit/node | rounds w/ hit | matrix bytes | mismatches |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, s in summary.items():
        f = lambda k, fmt="{:.3f}": "-" if s.get(k) is None else fmt.format(s[k])  # noqa: E731
        print(f"| {name} | {f('tau')} | {f('tau_humaneval')} | {f('tau_mtbench')} | {f('decode_tok_s', '{:.1f}')} | "
              f"{f('speedup')} | {f('median_prompt_speedup')} | {f('retrieved_accepted_per_round')} | "
              f"{f('retrieved_hit_rate_per_node')} | {f('rounds_with_accepted_retrieval')} | "
              f"{f('matrix_bytes', '{:d}')} | {f('mismatches', '{:d}')} |")
    print(f"\nwall {out['wall_s']:.0f}s; json: {args.out}")
    return out


def _row(stats) -> dict:
    return {"rounds": stats.rounds, "committed": stats.committed_in_rounds, "decode_s": stats.decode_s,
            "tok_s": stats.decode_tok_s, "tau": stats.tau, "retrieved_nodes": stats.retrieved_nodes,
            "retrieved_accepted": stats.retrieved_accepted}


if __name__ == "__main__":
    main()
