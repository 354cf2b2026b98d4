"""EAGLE-3 benchmark on SmolLM2: tau and wall-clock speedup over autoregressive decoding (same loop, same run,
interleaved per prompt), draft vs verify time per round, and tau against training minutes.

    python -m eval.bench_eagle3 --checkpoint eagle3-smollm2 --n-humaneval 5 --n-mtbench 5 --max-new 128 \\
        --grid 8:4:4,16:5:6,32:6:8,60:7:10 --sample-grid 16:5:6 --out runs/bench_eagle3.json

Grid entries are ``total_tokens:depth:top_k`` (total_tokens = verified positions incl. the root, so the drafter
budget is total_tokens - 1). Speedup = mean over prompts of (tokens/s of EAGLE-3) / mean of (tokens/s of AR), as
EAGLE's speed.py; the pooled ratio (sum tokens / sum seconds) is reported too. Prefill is excluded from both.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def parse_grid(text: str) -> list[tuple[int, int, int]]:
    out = []
    for item in filter(None, text.split(",")):
        tt, d, k = (int(x) for x in item.split(":"))
        out.append((tt, d, k))
    return out


def load_prompts(target, n_he: int, n_mt: int) -> list[tuple[str, list[int]]]:
    from graft_block.data import humaneval, mtbench

    recs = [("humaneval", r) for r in humaneval(n_he)] + [("mtbench", r) for r in mtbench(n_mt)]
    return [(f"{src}:{r['id']}", target.encode([{"role": "user", "content": r["turns"][0]}]).tolist())
            for src, r in recs]


def run_one(dec, ids, max_new, temperature, seed):
    res = dec.generate(ids, max_new_tokens=max_new, temperature=temperature, seed=seed)
    st = res.stats
    return {"tokens": res.tokens, "n": len(res.tokens), "decode_s": st.decode_s, "rounds": st.rounds,
            "tau": st.tau, "tok_s": st.decode_tok_s, "committed": st.committed_in_rounds,
            "draft_s": st.phase_s.get("draft", 0.0) + st.phase_s.get("tree", 0.0),
            "verify_s": st.phase_s.get("verify", 0.0), "commit_s": st.phase_s.get("commit", 0.0)}


def summarise(runs: list[dict], base: list[dict]) -> dict:
    rounds = sum(r["rounds"] for r in runs)
    return {
        "tau": sum(r["committed"] for r in runs) / max(1, rounds),
        "speedup_mean_ratio": statistics.mean(r["tok_s"] for r in runs) / statistics.mean(b["tok_s"] for b in base),
        "speedup_pooled": (sum(r["committed"] for r in runs) / sum(r["decode_s"] for r in runs))
        / (sum(b["committed"] for b in base) / sum(b["decode_s"] for b in base)),
        "tok_s": statistics.mean(r["tok_s"] for r in runs),
        "draft_ms_per_round": 1000 * sum(r["draft_s"] for r in runs) / max(1, rounds),
        "verify_ms_per_round": 1000 * sum(r["verify_s"] for r in runs) / max(1, rounds),
        "rounds": rounds,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--checkpoint", default="eagle3-smollm2")
    ap.add_argument("--n-humaneval", type=int, default=5)
    ap.add_argument("--n-mtbench", type=int, default=5)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--grid", default="8:4:4,16:5:6,32:6:8,60:7:10", help="greedy configs tt:depth:top_k")
    ap.add_argument("--sample-grid", default="16:5:6", help="T=1 configs (empty = skip sampling)")
    ap.add_argument("--snapshot", action="append", default=[],
                    help="MINUTES=FOLDER: a checkpoint saved after MINUTES of training (tau vs minutes, greedy)")
    ap.add_argument("--snapshot-config", default="16:5:6")
    ap.add_argument("--snapshot-max-new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from graft_block.drafters.eagle3 import Eagle3Drafter, load_head, resolve_checkpoint
    from graft_block.decoder import SpeculativeDecoder
    from graft_block.target import load_target

    t_start = time.time()
    target = load_target(args.target)
    prompts = load_prompts(target, args.n_humaneval, args.n_mtbench)
    head = load_head(resolve_checkpoint(args.checkpoint), target)
    report = {"checkpoint": str(args.checkpoint), "max_new": args.max_new, "threads": args.threads,
              "prompts": [p[0] for p in prompts], "greedy": {}, "sample": {}, "tau_vs_minutes": []}

    def drafter(tt, d, k, h=head):
        return Eagle3Drafter(target, head=h, budget=tt - 1, depth=d, top_k=k)

    ar = SpeculativeDecoder(target, None)
    for mode, grid, temp in (("greedy", parse_grid(args.grid), 0.0), ("sample", parse_grid(args.sample_grid), 1.0)):
        if not grid:
            continue
        decs = {f"tt{tt}_d{d}_k{k}": SpeculativeDecoder(target, drafter(tt, d, k)) for tt, d, k in grid}
        runs = {name: [] for name in ["ar", *decs]}
        mismatches = {name: 0 for name in decs}
        for i, (pid, ids) in enumerate(prompts):
            seed = args.seed + i
            base = run_one(ar, ids, args.max_new, temp, seed)
            runs["ar"].append(base)
            for name, dec in decs.items():  # interleaved: every config right after the AR run of the same prompt
                r = run_one(dec, ids, args.max_new, temp, seed)
                runs[name].append(r)
                if temp == 0.0 and r["tokens"] != base["tokens"]:
                    mismatches[name] += 1
            print(f"[{mode}] {pid}: AR {base['tok_s']:.1f} tok/s | " + " ".join(
                f"{n} tau {runs[n][-1]['tau']:.2f} {runs[n][-1]['tok_s']:.1f} tok/s" for n in decs), flush=True)
        summary = {"ar_tok_s": statistics.mean(b["tok_s"] for b in runs["ar"])}
        for name in decs:
            summary[name] = summarise(runs[name], runs["ar"])
            if temp == 0.0:
                summary[name]["greedy_mismatches"] = mismatches[name]
        report[mode] = summary
        print(json.dumps({mode: summary}, indent=1), flush=True)

    if args.snapshot:
        tt, d, k = parse_grid(args.snapshot_config)[0]
        for spec in args.snapshot:
            minutes, folder = spec.split("=", 1)
            dec = SpeculativeDecoder(target, drafter(tt, d, k, load_head(folder, target)))
            runs = [run_one(dec, ids, args.snapshot_max_new, 0.0, 0) for _, ids in prompts]
            tau = sum(r["committed"] for r in runs) / sum(r["rounds"] for r in runs)
            report["tau_vs_minutes"].append({"minutes": float(minutes), "folder": folder, "tau": tau,
                                             "config": f"tt{tt}_d{d}_k{k}", "max_new": args.snapshot_max_new})
            print(f"[snapshot] {minutes} min: tau {tau:.3f}", flush=True)
    report["wall_s"] = time.time() - t_start
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    print(f"done in {report['wall_s']:.0f} s")
    return report


if __name__ == "__main__":
    main()
