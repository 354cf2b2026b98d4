"""Retrieval-only drafters on a real target: Token Recycling, PLD, PLD + matrix; matrix warm-up 0 vs N rounds.

    python eval/bench_graft.py --limit 5 --max-new-tokens 128          # HumanEval + MT-Bench turn 1, greedy

A list of arms over ``run_block`` (the one measurement core): every other option is run_block's (--prompts,
--limit, --threads, --out, ...). Per arm the table gives tau, speedup vs AR, graft hit rate and matrix bytes;
every greedy output is checked token-identical to AR. Each matrix persists across the prompts of its arm.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__ and (Path(__file__).resolve().parents[1] / "graft_block").is_dir():
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # `python eval/bench_graft.py` in a checkout

from graft_block.errors import run_command  # noqa: E402
from graft_block.eval import run_block  # noqa: E402


def arms(args) -> dict[str, dict]:
    out = {}
    for w in args.warmup:  # warm-up rounds on ShareGPT calibration prompts (never eval prompts)
        for kind, budget in (("recycling", args.recycling_budget), ("pld_matrix", args.pld_matrix_budget)):
            out[f"{kind}_b{budget}_w{w}"] = {"drafter": {"type": kind, "budget": budget, "k": args.k,
                                                         "warmup_rounds": w, "warmup_tokens": args.warmup_tokens}}
    out[f"pld_b{args.pld_budget}"] = {"drafter": {"type": "pld", "budget": args.pld_budget}}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recycling-budget", type=int, default=80)
    ap.add_argument("--pld-matrix-budget", type=int, default=60)
    ap.add_argument("--pld-budget", type=int, default=10)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--warmup", type=int, nargs="+", default=[0, 5], help="matrix warm-up rounds to compare")
    ap.add_argument("--warmup-tokens", type=int, default=64)
    args, rest = ap.parse_known_args(argv)
    table = arms(args)
    return run_block.main(["--methods", ",".join(["ar", *table]), "--first-turn-only", "--max-new-tokens", "128",
                           "--limit", "5", "--out", "runs/bench_graft", *rest], methods=table)


if __name__ == "__main__":
    sys.exit(run_command(main, "eval/bench_graft.py"))
