"""Benchmark the DFlash drafter: tau and speedup over AR for the chain and DDTree budgets, prompt lookup on the
same prompts, and (greedy) every config's tau by teacher-forced replay of AR's output, without timing.

    python eval/bench_dflash.py --limit 5 --temperature 0,1                 # 5 HumanEval + 5 MT-Bench turn-1
    python eval/bench_dflash.py --arms chain,dd16 --sim chain,dd16,dd64     # a subset

A list of arms over ``run_block`` (the one measurement core: interleaved with AR, warmed up, the one speedup
definition, the verify-cost curve, the busy-machine guard); every other option is run_block's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

if not __package__ and (Path(__file__).resolve().parents[1] / "graft_block").is_dir():
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # `python eval/bench_dflash.py` in a checkout

import torch  # noqa: E402

from graft_block.errors import run_command  # noqa: E402
from graft_block.eval import run_block  # noqa: E402
from graft_block.eval.presets import SUITES  # noqa: E402
from graft_block.eval.prompts import encode_turn, prompt_records  # noqa: E402

CONFIGS = {  # DFlash drafter options per arm
    "chain": {"proposal": "chain", "budget": 15},
    "dd8": {"proposal": "ddtree", "budget": 8},
    "dd16": {"proposal": "ddtree", "budget": 16},
    "dd32": {"proposal": "ddtree", "budget": 32},
    "dd64": {"proposal": "ddtree", "budget": 64},
    "chain_dn3": {"proposal": "chain", "budget": 15, "denoise_steps": 3},  # commit-by-confidence refinement
}


def arms(names: list[str], checkpoint: str) -> dict[str, dict]:
    out = {}
    for n in names:
        if n == "pld":
            out["pld"] = {"drafter": {"type": "pld", "budget": 10}}
        elif n in CONFIGS:
            out[f"dflash_{n}"] = {"drafter": {"type": "dflash", "checkpoint": checkpoint, **CONFIGS[n]}}
        else:
            raise SystemExit(f"unknown arm {n!r}; choose from {', '.join([*CONFIGS, 'pld'])}")
    return out


class _State:
    """The slice of DecodeState a drafter's propose() reads (for the teacher-forced replay)."""

    def __init__(self, tokens):
        self.tokens = tokens

    @property
    def cache_len(self):
        return len(self.tokens) - 1

    @property
    def root_token(self):
        return self.tokens[-1]

    def section(self, name):
        from contextlib import nullcontext

        return nullcontext()


@torch.inference_mode()
def greedy_tau_simulation(target, model, prompt_ids: list[int], output: list[int], configs: dict) -> dict:
    """Exact greedy tau per proposal config without timing: greedy output is the same for every lossless method,
    so one target forward over prompt + AR output gives the features every round would see; each config then
    replays its own rounds (draft from the context before the root, accept the longest tree path that matches
    the greedy continuation, advance)."""
    from graft_block.drafters.dflash import DFlashDrafter

    seq = list(prompt_ids) + list(output)
    P = len(prompt_ids)
    target.set_feature_layers(model.feature_layers)
    _, feats = target.prefill(torch.tensor(seq))
    out = {}
    for name, spec in configs.items():
        d = DFlashDrafter(target, model, **spec)
        d.reset_context()
        s, rounds, committed = P, 0, 0  # root of the first round = first generated token, at position P
        while s < len(seq) - 1:
            d._extend(feats[d.ctx_len:s], d.ctx_len)
            tree = d.propose(_State(seq[: s + 1]))
            children = {(int(tree.parents[i]), int(tree.tokens[i])): i for i in range(1, tree.size)}
            cur, pos = 0, s
            while pos + 1 < len(seq) and (cur, seq[pos + 1]) in children:
                cur, pos = children[(cur, seq[pos + 1])], pos + 1
            rounds += 1
            committed += pos - s + (pos + 1 < len(seq))  # accepted + a bonus only if AR emitted it (no overshoot)
            s = pos + 1
        out[name] = committed / max(1, rounds)
    return out


def simulate(rep: dict, target, checkpoint: str, sim: list[str]) -> dict:
    """Teacher-forced greedy tau of each config in ``sim`` on every first turn AR decoded at T=0 in ``rep``."""
    from graft_block import Drafter

    sets = rep["args"]["prompts"].split(",") if rep["args"]["prompts"] else SUITES[rep["suite"]]["prompts"]
    prompts = {p["id"]: p for p in prompt_records(sets, rep["limit"], True)[0]}
    model = Drafter.from_config({"type": "dflash", "checkpoint": checkpoint}, target=target).model
    rows = []
    for r in rep["records"]:
        if r["method"] == "ar" and r["temperature"] == 0 and r["turn"] == 0:
            ids = encode_turn(target, [], prompts[r["prompt_id"]]["turns"][0]).tolist()
            rows.append({"set": r["set"], **greedy_tau_simulation(target, model, ids, r["tokens"],
                                                                  {n: CONFIGS[n] for n in sim})})
    out = {}
    for n in sim:
        out[n] = {"tau": statistics.mean(r[n] for r in rows)}
        for s in dict.fromkeys(r["set"] for r in rows):
            out[n][f"tau_{s}"] = statistics.mean(r[n] for r in rows if r["set"] == s)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="@dflash-smollm2", help="@bundled-name or checkpoint folder")
    ap.add_argument("--arms", default="chain,dd8,dd16,dd32,dd64,pld", help=f"of {', '.join([*CONFIGS, 'pld'])}")
    ap.add_argument("--sim", default="chain,dd8,dd16,dd32,dd64,chain_dn3",
                    help="greedy tau by teacher-forced replay of the AR output (no timing); '' = skip")
    args, rest = ap.parse_known_args(argv)
    table = arms(args.arms.split(","), args.drafter)
    from graft_block.eval.presets import resolve_bundled

    rep, target = run_block.run_arms(table, ["--first-turn-only", "--max-new-tokens", "128", "--limit", "5",
                                             "--out", "runs/bench_dflash"], rest)
    if target is None:
        return rep
    sim = [s for s in args.sim.split(",") if s]
    if sim and rep.get("records"):
        rep["greedy_tau_simulated"] = simulate(rep, target, resolve_bundled(args.drafter, "bench_dflash"), sim)
        for n, v in rep["greedy_tau_simulated"].items():
            print(f"  sim {n:9s} " + " ".join(f"{k} {x:.3f}" for k, x in v.items()))
        out = Path(rep["args"]["out"]) / "greedy_tau_simulated.json"
        out.write_text(json.dumps(rep["greedy_tau_simulated"], indent=1))
    return rep


if __name__ == "__main__":
    sys.exit(run_command(main, "eval/bench_dflash.py"))
