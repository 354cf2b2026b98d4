"""MFD vs DDTree (the K=1 control trained identically) on a real target: tau, speedup over AR, chimeric shares.

    python eval/bench_mfd.py --humaneval 5 --mtbench 5 --max-new-tokens 128 --budgets 16 32 64 --temperature 0
    # with the K sweep (checkpoints from scripts/train_mfd_sweep.sh) and the untouched DFlash default
    python eval/bench_mfd.py --k-sweep runs/mfd-sweep/k2/ckpt runs/mfd-sweep/k8/ckpt --base dflash-smollm2 \
        --futures-rounds 20 --temperature 1

Arms (per budget B): ``ddtree`` = the K=1 control checkpoint (``drafters/checkpoints/mfd-smollm2-k1``; an MFD
drafter with one mode and a zero mode vector, which is DFlash + DDTree node for node) and ``mfd`` = the K=4
checkpoint with the best-mode mixed DDTree. Optional: ``--k-sweep CKPT ...`` adds MFD checkpoints trained with other
K by the same recipe (``scripts/train_mfd_sweep.sh``) at the largest budget, ``--base`` adds DDTree from the DFlash
default they were all initialised from.
Per prompt, AR and every arm run back to back (interleaved), so load drift on a shared machine hits all arms alike.
Greedy (``--temperature 0``; T>0 also works). Every greedy output is checked token-identical to AR.
Chimeric shares (mfd.md 3.2, ``tree.chimeric``): the one-pass proxy (b) on every round of every arm (its cost is
timed and subtracted from the arm's decode time), and the sampled-futures reference (a) on ``--futures-rounds``
recorded rounds per arm at the largest budget (N = ``--futures`` target samples at T=1 plus the greedy future).
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

import graft_block.drafters.dflash
import graft_block.drafters.mfd  # noqa: F401  (registers "mfd")
from graft_block import SpeculativeDecoder, load_target
from graft_block.data import humaneval, mtbench
from graft_block.drafter import Drafter, bundled_checkpoint
from graft_block.chimeric import futures_recorder, proxy_hook, sampled_report


class TimedHook:
    """Wraps a round hook and sums its wall time, so analysis cost can be taken out of decode time."""

    def __init__(self, hook):
        self.hook, self.seconds = hook, 0.0

    def __call__(self, verified, state):
        t0 = time.perf_counter()
        self.hook(verified, state)
        self.seconds += time.perf_counter() - t0


def checkpoint(name_or_path: str) -> str:
    path = Path(name_or_path)
    if path.is_dir():
        return str(path)
    found = bundled_checkpoint(name_or_path)
    if found is None:
        raise SystemExit(f"checkpoint {name_or_path!r} not found (train it: see drafters/checkpoints/mfd-smollm2/"
                         "TRAINING.md)")
    return str(found)


def build_arms(target, args) -> dict:
    arms = {}
    k1, k4 = checkpoint(args.control), checkpoint(args.mfd)
    for B in args.budgets:
        arms[f"ddtree(B={B})"] = Drafter.from_config({"type": "mfd", "checkpoint": k1, "budget": B}, target=target)
        arms[f"mfd(B={B})"] = Drafter.from_config({"type": "mfd", "checkpoint": k4, "budget": B,
                                                   "score": args.score}, target=target)
    Bmax = max(args.budgets)
    for path in args.k_sweep:  # separately trained K (same data, steps and init) at the largest budget
        d = Drafter.from_config({"type": "mfd", "checkpoint": checkpoint(path), "budget": Bmax, "score": args.score},
                                target=target)
        arms[f"mfd-K{d.model.num_modes}(B={Bmax})"] = d
    if args.base:
        arms[f"ddtree-base(B={Bmax})"] = Drafter.from_config(
            {"type": "dflash", "checkpoint": checkpoint(args.base), "proposal": "ddtree", "budget": Bmax},
            target=target)
    return arms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--control", default="mfd-smollm2-k1", help="K=1 control checkpoint (DDTree arm)")
    ap.add_argument("--mfd", default="mfd-smollm2", help="MFD checkpoint")
    ap.add_argument("--base", default=None, help="also run DDTree from this DFlash checkpoint (e.g. dflash-smollm2)")
    ap.add_argument("--score", default="best_mode", choices=["best_mode", "mixture_uniform", "mixture_gated"])
    ap.add_argument("--humaneval", type=int, default=5)
    ap.add_argument("--mtbench", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--k-sweep", nargs="*", default=[], metavar="CKPT",
                    help="more MFD checkpoints (other K, same recipe) to run at the largest budget")
    ap.add_argument("--futures", type=int, default=64, help="N sampled target futures per recorded round")
    ap.add_argument("--futures-rounds", type=int, default=6, help="rounds per arm for protocol (a); 0 = skip")
    ap.add_argument("--eps", type=float, default=0.01)
    ap.add_argument("--delta", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--time-limit", type=float, default=None, help="stop after the prompt that passes this (s)")
    ap.add_argument("--out", default="runs/bench_mfd.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.time()

    target = load_target(args.target, device=args.device)
    he = humaneval(args.humaneval) if args.humaneval > 0 else []  # 0 = none (the loaders read 0/None as all)
    mt = mtbench(args.mtbench) if args.mtbench > 0 else []
    # interleaved, so a run cut by --time-limit still covers both datasets
    prompts = [x for pair in zip([("humaneval", r) for r in he], [("mtbench", r) for r in mt]) for x in pair]
    prompts += [("humaneval", r) for r in he[len(mt):]] + [("mtbench", r) for r in mt[len(he):]]
    arms = build_arms(target, args)
    Bmax = max(args.budgets)
    decs, proxies, recorders = {"AR": SpeculativeDecoder(target, None)}, {}, {}
    for name, d in arms.items():
        proxies[name] = TimedHook(proxy_hook(args.eps, args.delta))
        hooks = [proxies[name]]
        if args.futures_rounds and f"(B={Bmax})" in name:
            # one recorded round per prompt, from the 3rd round on, until futures_rounds are collected
            recorders[name] = TimedHook(futures_recorder(count=1, first=2))
            hooks.append(recorders[name])
        decs[name] = SpeculativeDecoder(target, d, round_hooks=hooks)

    def run(name, msgs):
        dec = decs[name]
        target.set_feature_layers(tuple(getattr(dec.drafter, "feature_layers", ()) or ()))
        hook_s0 = sum(h.seconds for h in dec.round_hooks)
        res = dec.generate(msgs, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0)
        hook_s = sum(h.seconds for h in dec.round_hooks) - hook_s0
        return res, hook_s

    for name in decs:  # untimed warm-up (allocator, kernels)
        run(name, [{"role": "user", "content": "Say hello."}])
    for h in list(proxies.values()):
        h.hook.rows.clear()
    for h in recorders.values():
        h.hook.records.clear()

    rows = {name: [] for name in decs}
    mismatches = []
    for pi, (ds, rec) in enumerate(prompts):
        msgs = [{"role": "user", "content": rec["turns"][0]}]
        ref = None
        for name in decs:
            rcd = recorders.get(name)
            if rcd is not None and len(rcd.hook.records) >= args.futures_rounds:
                rcd.hook.count = 0  # enough rounds recorded for this arm
            res, hook_s = run(name, msgs)
            st = res.stats
            if name == "AR":
                ref = res.tokens
            elif args.temperature == 0 and res.tokens != ref:
                mismatches.append((rec["id"], name))
            rows[name].append({"dataset": ds, "id": rec["id"], "tokens": st.committed_in_rounds, "rounds": st.rounds,
                               "decode_s": st.decode_s - hook_s, "tau": st.tau, "phase_s": st.phase_s,
                               "mean_tree_nodes": st.to_dict()["mean_tree_nodes"]})
        print(f"[{pi + 1}/{len(prompts)}] {rec['id']} " + " ".join(
            f"{n}:tau={rows[n][-1]['tau']:.2f}" for n in decs if n != "AR"), f"({time.time() - t_start:.0f}s)",
            flush=True)
        write_report(make_report(rows, mismatches, proxies, args, t_start), args.out)
        if args.time_limit and time.time() - t_start > args.time_limit:
            print(f"time limit: stopping after {pi + 1} prompts", flush=True)
            break

    report = make_report(rows, mismatches, proxies, args, t_start)
    if recorders:
        print(f"protocol (a): sampling {args.futures} futures for "
              f"{sum(min(args.futures_rounds, len(r.hook.records)) for r in recorders.values())} rounds ...",
              flush=True)
        target.set_feature_layers(())
        for name, rcd in recorders.items():
            recs = rcd.hook.records[: args.futures_rounds]
            if recs:
                report["arms"][name]["chimeric_sampled"] = sampled_report(target, recs, n=args.futures, seed=0)
    report["wall_s"] = time.time() - t_start
    write_report(report, args.out)
    print_table(report, args)


def write_report(report, out):
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=1))


def make_report(rows, mismatches, proxies, args, t_start) -> dict:
    def agg(rs):
        tok = sum(r["tokens"] for r in rs)
        return {"tau": tok / max(1, sum(r["rounds"] for r in rs)), "tok_s": tok / sum(r["decode_s"] for r in rs),
                "tokens": tok}

    report = {"args": vars(args), "prompts": len(rows["AR"]), "mismatches": mismatches, "arms": {}}
    ar_all = agg(rows["AR"])
    report["ar_tok_s"] = ar_all["tok_s"]
    for name in rows:
        entry = {"all": agg(rows[name])}
        for ds in ("humaneval", "mtbench"):
            sub = [r for r in rows[name] if r["dataset"] == ds]
            if sub:
                entry[ds] = agg(sub)
        ar_tok_s = {"all": ar_all["tok_s"], **{ds: agg([r for r in rows["AR"] if r["dataset"] == ds])["tok_s"]
                                               for ds in ("humaneval", "mtbench")
                                               if any(r["dataset"] == ds for r in rows["AR"])}}
        for key in list(entry):
            entry[key]["speedup"] = entry[key]["tok_s"] / ar_tok_s[key]
        ratios = [r["tokens"] / r["decode_s"] / (a["tokens"] / a["decode_s"]) for r, a in zip(rows[name], rows["AR"])]
        entry["median_prompt_speedup"] = statistics.median(ratios)
        phases = {}
        for r in rows[name]:
            for k, v in (r["phase_s"] or {}).items():
                phases[k] = phases.get(k, 0.0) + v
        entry["phase_ms_per_round"] = {k: 1000 * v / max(1, sum(r["rounds"] for r in rows[name]))
                                       for k, v in phases.items()}
        if name in proxies:
            entry["chimeric_proxy"] = proxies[name].hook.summary()
        report["arms"][name] = entry
    report["wall_s"] = time.time() - t_start
    return report


def print_table(report, args):
    print(f"\nSmolLM2 {report['prompts']} prompts (of {args.humaneval} HumanEval + {args.mtbench} MT-Bench), "
          f"{args.max_new_tokens} tokens, T={args.temperature}; AR {report['ar_tok_s']:.1f} tok/s; greedy "
          f"mismatches: {len(report['mismatches'])}")
    print("| arm | tau | speedup | HE tau / x | MT tau / x | median x | draft/tree/verify/commit ms per round | "
          "chimeric (b) draft | chimeric (a) | coherent (a) | off-support (a) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, e in report["arms"].items():
        if name == "AR":
            continue
        cp = e.get("chimeric_proxy", {}).get("draft", {})
        cs = e.get("chimeric_sampled", {}).get("draft", {})
        he, mt = e.get("humaneval", {}), e.get("mtbench", {})
        ph = e.get("phase_ms_per_round", {})
        split = "/".join(f"{ph.get(k, 0.0):.0f}" for k in ("draft", "tree", "verify", "commit"))
        print(f"| {name} | {e['all']['tau']:.2f} | {e['all']['speedup']:.2f}x | "
              f"{he.get('tau', 0):.2f} / {he.get('speedup', 0):.2f}x | {mt.get('tau', 0):.2f} / "
              f"{mt.get('speedup', 0):.2f}x | {e['median_prompt_speedup']:.2f}x | {split} | "
              f"{cp.get('chimeric', float('nan')):.3f} | {cs.get('chimeric', float('nan')):.3f} | "
              f"{cs.get('coherent', float('nan')):.3f} | {cs.get('off_support', float('nan')):.3f} |")
    print(f"wall {report['wall_s']:.0f}s -> {args.out}")


if __name__ == "__main__":
    main()
