"""EAGLE-3 benchmark: tau and speedup over AR for a grid of tree shapes (greedy and sampled), and tau against
training minutes from saved snapshots.

    python eval/bench_eagle3.py --checkpoint @eagle3-smollm2 --limit 5 --grid 8:4:4,16:5:6,32:6:8,60:7:10 \\
        --sample-grid 16:5:6 --snapshot 6=runs/e3/step100 --snapshot 12=runs/e3/step200

Grid entries are ``total_tokens:depth:top_k`` (total_tokens = verified positions incl. the root, so the drafter
budget is total_tokens - 1). A list of arms over ``run_block`` (the one measurement core); every other option is
run_block's (--limit, --prompts, --max-new-tokens, --threads, --out, ...).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__ and (Path(__file__).resolve().parents[1] / "graft_block").is_dir():
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # `python eval/bench_eagle3.py` in a checkout

from graft_block.errors import ConfigError, run_command  # noqa: E402
from graft_block.eval import run_block  # noqa: E402


def parse_grid(text: str) -> list[tuple[int, int, int]]:
    out = []
    for item in filter(None, text.split(",")):
        try:
            tt, d, k = (int(x) for x in item.split(":"))
        except ValueError:
            raise ConfigError(f"grid entry {item!r} is not total_tokens:depth:top_k (three ints, e.g. 16:5:6)") \
                from None
        out.append((tt, d, k))
    return out


def parse_snapshot(spec: str) -> tuple[float, str, str]:
    """``MINUTES=FOLDER`` -> (minutes, arm prefix, folder); checked before any model loads."""
    minutes, eq, folder = spec.partition("=")
    try:
        value = float(minutes)
    except ValueError:
        value = None
    if not eq or not folder or value is None:
        raise ConfigError(f"--snapshot {spec!r}: give MINUTES=FOLDER, MINUTES a number (e.g. 12=runs/e3/step200)")
    return value, f"snapshot_{minutes}min", folder


def arms(checkpoint: str, grid, prefix: str = "eagle3") -> dict[str, dict]:
    return {f"{prefix}_tt{tt}_d{d}_k{k}": {"drafter": {"type": "eagle3", "checkpoint": checkpoint, "budget": tt - 1,
                                                       "depth": d, "top_k": k}} for tt, d, k in grid}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="@eagle3-smollm2", help="@bundled-name or checkpoint folder")
    ap.add_argument("--grid", default="8:4:4,16:5:6,32:6:8,60:7:10", help="greedy configs tt:depth:top_k")
    ap.add_argument("--sample-grid", default="16:5:6", help="T=1 configs (empty = skip sampling)")
    ap.add_argument("--snapshot", action="append", default=[],
                    help="MINUTES=FOLDER: a checkpoint saved after MINUTES of training (tau vs minutes, greedy)")
    ap.add_argument("--snapshot-config", default="16:5:6")
    ap.add_argument("--snapshot-max-new", type=int, default=64)
    args, rest = ap.parse_known_args(argv)
    out = run_block.parse_args(["--out", "runs/bench_eagle3", *rest]).out
    common = ["--first-turn-only", "--max-new-tokens", "128", "--limit", "5"]
    runs = [(mode, arms(args.checkpoint, parse_grid(grid)), ["--temperature", temp, "--out", f"{out}/{mode}"])
            for mode, grid, temp in (("greedy", args.grid, "0"), ("sample", args.sample_grid, "1"))]
    minutes = {}  # arm -> minutes of training
    if args.snapshot:
        shape, table = parse_grid(args.snapshot_config), {}
        for spec in args.snapshot:
            value, prefix, folder = parse_snapshot(spec)
            new = arms(folder, shape, prefix=prefix)
            if set(new) & set(table):  # one arm name per snapshot, or the later folder silently replaces the first
                raise ConfigError(f"--snapshot {spec!r}: another snapshot has the same MINUTES; give each its own")
            table.update(new)
            minutes.update(dict.fromkeys(new, value))
        runs.append(("snapshots", table, ["--temperature", "0", "--max-new-tokens", str(args.snapshot_max_new),
                                          "--out", f"{out}/snapshots"]))
    if run_block.parse_args(rest).list_methods:  # every arm in one listing, and no model loads
        return run_block.main([*common, *rest], methods={k: v for _, table, _ in runs for k, v in table.items()})
    report, target = {}, None
    for mode, table, opts in runs:
        if not table:
            continue
        if target is None:  # the first run loads the target as run_block does (--engine, --compile, --exact-quant)
            report[mode], target = run_block.run_arms(table, common, [*rest, *opts])
        else:
            report[mode] = run_block.main(["--methods", ",".join(["ar", *table]), *common, *rest, *opts],
                                          methods=table, target=target)
    if "snapshots" in report:
        rows = {r["method"]: r for r in report.pop("snapshots")["summary"]}
        report["tau_vs_minutes"] = [{"minutes": minutes[name], "tau": rows[name]["tau"], "arm": name}
                                    for name in minutes if name in rows]
        for r in report["tau_vs_minutes"]:
            print(f"[snapshot] {r['minutes']:g} min: tau {r['tau']:.3f}")
    return report


if __name__ == "__main__":
    sys.exit(run_command(main, "eval/bench_eagle3.py"))
