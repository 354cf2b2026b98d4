"""MFD vs DDTree (the K=1 control trained identically) on a real target: tau, speedup over AR, chimeric shares.

    python eval/bench_mfd.py --limit 5 --max-new-tokens 128 --budgets 16 32 64 --temperature 0
    # with the K sweep (checkpoints from scripts/train_mfd_sweep.sh) and the untouched DFlash default
    python eval/bench_mfd.py --k-sweep runs/mfd-sweep/k2/ckpt runs/mfd-sweep/k8/ckpt --base @dflash-smollm2 \\
        --futures-rounds 20 --temperature 1 --time-limit 1320

Arms (per budget B): ``ddtree_bB`` = the K=1 control (``dflash-smollm2``, mfd-smollm2's frozen backbone, loaded as one
zero mode vector: DFlash + DDTree node for node) and ``mfd_bB`` = the K=4 checkpoint with the best-mode mixed DDTree.
Optional: ``--k-sweep CKPT ...`` adds MFD checkpoints trained with other K at the largest budget, ``--base`` adds
DDTree from the DFlash default they were all initialised from. A list of arms over ``run_block`` (the one measurement
core; every other option is run_block's). Chimeric shares (``graft_block.chimeric``): the one-pass proxy (b) on every
round of every arm (its time is taken out of the arm's decode time), and the sampled-futures reference (a) on
``--futures-rounds`` recorded rounds per arm at the largest budget (``--futures`` target samples at each round's
sampling settings, T = 1 for greedy rounds, + the greedy one, + ``--beams`` top beams at T = 0), computed after the
timed run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if not __package__ and (Path(__file__).resolve().parents[1] / "graft_block").is_dir():
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # `python eval/bench_mfd.py` in a checkout

from graft_block.chimeric import futures_recorder, sampled_report  # noqa: E402
from graft_block.errors import run_command  # noqa: E402
from graft_block.eval import run_block  # noqa: E402


def arms(args) -> tuple[dict[str, dict], dict]:
    """(arms, recorders): every arm has the chimeric proxy; the largest-budget arms also record rounds for (a)."""
    table, recorders = {}, {}
    bmax = max(args.budgets)

    def add(name, drafter, budget):
        spec = {"drafter": {**drafter, "budget": budget}, "chimeric": True}
        if args.futures_rounds and budget == bmax:
            # from the 3rd round on, every 3rd round, so a few prompts give the --futures-rounds records
            recorders[name] = futures_recorder(count=args.futures_per_prompt, every=3, first=2)
            spec["hooks"] = [recorders[name]]
        table[name] = spec

    for b in args.budgets:
        add(f"ddtree_b{b}", {"type": "mfd", "checkpoint": args.control}, b)
        add(f"mfd_b{b}", {"type": "mfd", "checkpoint": args.mfd, "score": args.score}, b)
    for path in args.k_sweep:  # separately trained K (same data, steps and init): runs/mfd-sweep/k2/ckpt -> mfd_k2
        p = Path(path)
        label = p.parent.name if p.name == "ckpt" else p.name
        name = f"mfd_{label}_b{bmax}"
        add(name if name not in table else f"mfd_{len(table)}_{label}_b{bmax}",
            {"type": "mfd", "checkpoint": path, "score": args.score}, bmax)
    if args.base:
        add(f"ddtree_base_b{bmax}", {"type": "dflash", "checkpoint": args.base, "proposal": "ddtree"}, bmax)
    return table, recorders


def spread(items: list, n: int) -> list:
    """``n`` items evenly spaced over the list (all when there are fewer), so every prompt contributes."""
    if len(items) <= n:
        return list(items)
    return [items[round(i * (len(items) - 1) / max(1, n - 1))] for i in range(n)] if n > 1 else items[:n]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--control", default="@dflash-smollm2",
                    help="K=1 control checkpoint (the DDTree arm): the frozen backbone of mfd-smollm2")
    ap.add_argument("--mfd", default="@mfd-smollm2", help="MFD checkpoint")
    ap.add_argument("--base", default=None, help="also run DDTree from this DFlash checkpoint (e.g. @dflash-smollm2)")
    ap.add_argument("--score", default="best_mode", choices=["best_mode", "mixture_uniform", "mixture_gated"])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--k-sweep", nargs="*", default=[], metavar="CKPT",
                    help="more MFD checkpoints (other K, same recipe) to run at the largest budget")
    ap.add_argument("--futures", type=int, default=64, help="N sampled target futures per recorded round")
    ap.add_argument("--futures-rounds", type=int, default=20, help="rounds per arm for protocol (a); 0 = skip")
    ap.add_argument("--futures-per-prompt", type=int, default=4, help="protocol (a): rounds recorded per prompt")
    ap.add_argument("--beams", type=int, default=4, help="protocol (a): the target's top beams added at T = 0")
    args, rest = ap.parse_known_args(argv)
    table, recorders = arms(args)
    rep, target = run_block.run_arms(table, ["--first-turn-only", "--max-new-tokens", "128", "--limit", "5",
                                             "--out", "runs/bench_mfd"], rest)
    if target is None:
        return rep
    if recorders and rep.get("records"):
        target.set_feature_layers(())
        sampled = {}
        print(f"\nprotocol (a): {args.futures} sampled futures + the greedy one per recorded round, drawn at the "
              f"round's own temperature / top-k / top-p (T = 1 for greedy rounds, beside the {args.beams} top beams)")
        print("| arm | rounds | chimeric (a) | coherent (a) | off-support (a) |\n|---|---|---|---|---|")
        for name, rec in recorders.items():
            recs = spread(rec.records, args.futures_rounds)
            if not recs:
                continue
            sampled[name] = sampled_report(target, recs, n=args.futures, seed=0, beams=args.beams)
            d = sampled[name]["draft"]
            print(f"| {name} | {len(recs)} | {d.get('chimeric', float('nan')):.3f} | "
                  f"{d.get('coherent', float('nan')):.3f} | {d.get('off_support', float('nan')):.3f} |")
        rep["chimeric_sampled"] = sampled
        (Path(rep["args"]["out"]) / "chimeric_sampled.json").write_text(json.dumps(sampled, indent=1, default=str))
    return rep


if __name__ == "__main__":
    sys.exit(run_command(main, "eval/bench_mfd.py"))
