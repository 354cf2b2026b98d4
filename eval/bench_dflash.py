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

from graft_block.errors import ConfigError, run_command  # noqa: E402
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
            raise ConfigError(f"unknown arm {n!r}; choose from {', '.join([*CONFIGS, 'pld'])}")
    return out


@torch.inference_mode()
def greedy_tau_simulation(target, model, prompt_ids: list[int], output: list[int], configs: dict) -> dict:
    """Exact greedy tau per proposal config without timing: greedy output is the same for every lossless method,
    so one target forward over prompt + AR output gives the features every round would see; each config then
    replays its own rounds (draft from the context before the root, accept the longest tree path that matches
    the greedy continuation, advance)."""
    from graft_block.decoder import DecodeState
    from graft_block.drafters.dflash import DFlashDrafter
    from graft_block.sampling import SamplingConfig

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
            # the decoder's own state type, so every field a drafter reads exists (a hand-made slice once lacked one)
            tree = d.propose(DecodeState(target, SamplingConfig(), None, seq[: s + 1], P))
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
    ar = [r for r in rep["records"] if r["method"] == "ar" and r["temperature"] == 0 and r["turn"] == 0]
    if not ar:  # a run at T > 0 only: nothing to replay (and no mean of no rounds)
        print("  sim: no greedy AR output in this run to replay (add --temperature 0)", file=sys.stderr)
        return {}
    prompts = {p["id"]: p for p in prompt_records(sets, rep["limit"], True)[0]}
    model = Drafter.from_config({"type": "dflash", "checkpoint": checkpoint}, target=target).model
    rows = []
    for r in ar:
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
    sim = [s for s in args.sim.split(",") if s]
    if set(sim) - set(CONFIGS):  # before the timed run, not after it
        raise ConfigError(f"--sim {args.sim!r}: unknown config(s) {', '.join(sorted(set(sim) - set(CONFIGS)))}; "
                          f"choose from {', '.join(CONFIGS)}")
    from graft_block.eval.presets import resolve_bundled

    rep, target = run_block.run_arms(table, ["--first-turn-only", "--max-new-tokens", "128", "--limit", "5",
                                             "--out", "runs/bench_dflash"], rest)
    if target is None:
        return rep
    if sim and rep.get("records"):
        rep["greedy_tau_simulated"] = simulate(rep, target, resolve_bundled(args.drafter, "bench_dflash"), sim)
        if not rep["greedy_tau_simulated"]:
            return rep
        for n, v in rep["greedy_tau_simulated"].items():
            print(f"  sim {n:9s} " + " ".join(f"{k} {x:.3f}" for k, x in v.items()))
        out = Path(rep["args"]["out"]) / "greedy_tau_simulated.json"
        out.write_text(json.dumps(rep["greedy_tau_simulated"], indent=1))
    return rep


if __name__ == "__main__":
    sys.exit(run_command(main, "eval/bench_dflash.py"))
