"""Benchmark the DFlash drafter on SmolLM2: tau and speedup over AR (same run, interleaved per prompt) for the
chain and DDTree budgets, prompt lookup on the same prompts, and the target's verify-cost curve.

    python -m eval.bench_dflash --out runs/bench_dflash.json            # defaults: 5 HumanEval + 5 MT-Bench
    python -m eval.bench_dflash --temps 0 --methods ar,chain,dd16       # a subset

Speedup = mean AR time per output token / mean method time per output token, decode phase only (prefill and
the first token excluded, as in the papers), over the same prompts. Greedy runs also check token identity with AR.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

METHODS = {
    "ar": None,
    "chain": {"proposal": "chain", "budget": 15},
    "dd8": {"proposal": "ddtree", "budget": 8},
    "dd16": {"proposal": "ddtree", "budget": 16},
    "dd32": {"proposal": "ddtree", "budget": 32},
    "dd64": {"proposal": "ddtree", "budget": 64},
    "pld": "pld",
    "chain_dn3": {"proposal": "chain", "budget": 15, "denoise_steps": 3},  # commit-by-confidence refinement
}


def verify_cost(target, sizes=(1, 2, 4, 8, 16, 32, 64), cache_len: int = 200, reps: int = 5) -> dict:
    """Median ms of one target.verify over a chain of T nodes after a ``cache_len``-token prefix."""
    from graft_block.tree import chain

    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, 10000, (cache_len,), generator=g)
    out = {}
    for T in sizes:
        times = []
        for _ in range(reps):
            target.prefill(prefix)
            tree = chain(int(prefix[-1]), torch.randint(100, 10000, (T - 1,), generator=g))
            t0 = time.perf_counter()
            target.verify(tree)
            times.append((time.perf_counter() - t0) * 1000)
        out[T] = statistics.median(times)
    return out


def _mean(xs):
    xs = list(xs)
    return statistics.mean(xs) if xs else None


class _State:
    """The slice of DecodeState a drafter's propose() reads (for the teacher-forced simulation)."""

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
        d.ctx_k, d.ctx_v, d.ctx_len = [], [], 0
        s, rounds, committed = P, 0, 0  # root of the first round = first generated token, at position P
        while s < len(seq) - 1:
            d._extend(feats[d.ctx_len:s], d.ctx_len)
            tree = d.propose(_State(seq[: s + 1]))
            children = {}
            for i in range(1, tree.size):
                children[(int(tree.parents[i]), int(tree.tokens[i]))] = i
            cur, pos = 0, s
            while pos + 1 < len(seq) and (cur, seq[pos + 1]) in children:
                cur, pos = children[(cur, seq[pos + 1])], pos + 1
            rounds += 1
            committed += pos - s + 1
            s = pos + 1
        out[name] = committed / max(1, rounds)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="dflash-smollm2", help="bundled name or checkpoint folder")
    ap.add_argument("--n-humaneval", type=int, default=5)
    ap.add_argument("--n-mtbench", type=int, default=5)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--temps", default="0,1")
    ap.add_argument("--methods", default="ar,chain,dd8,dd16,dd32,dd64,pld")
    ap.add_argument("--t1-methods", default=None, help="methods at T>0 (default: same as --methods)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-verify-cost", action="store_true")
    ap.add_argument("--t1-prompts", type=int, default=None, help="use only the first N prompts per set at T>0")
    ap.add_argument("--e2e-prompts", type=int, default=None,
                    help="at T=0 time drafters (not ar/pld) only on the first N prompts per set; tau of every "
                         "config still comes from the --sim replay on all prompts")
    ap.add_argument("--sim", default="chain,dd8,dd16,dd32,dd64,chain_dn3",
                    help="greedy tau by teacher-forced replay of the AR output (no timing) for these configs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    import graft_block.drafters  # noqa: F401  (registers pld)
    import graft_block.drafters.dflash  # noqa: F401
    from graft_block.data import humaneval, mtbench
    from graft_block.decoder import SpeculativeDecoder
    from graft_block.drafter import Drafter
    from graft_block.target import load_target

    t_start = time.time()
    target = load_target("smollm2-135m")
    prompts = [("humaneval", p["turns"][0]) for p in humaneval(args.n_humaneval)] if args.n_humaneval else []
    prompts += [("mtbench", p["turns"][0]) for p in mtbench(args.n_mtbench)] if args.n_mtbench else []
    decoders = {}
    for name in args.methods.split(","):
        spec = METHODS[name]
        if spec is None:
            decoders[name] = SpeculativeDecoder(target)
        elif spec == "pld":
            decoders[name] = SpeculativeDecoder(target, Drafter.from_config({"type": "pld", "budget": 10}))
        else:
            d = Drafter.from_config(args.drafter, target=target)
            d = type(d)(target, d.model, checkpoint=d.checkpoint, **spec)
            decoders[name] = SpeculativeDecoder(target, d)
    sim_model = Drafter.from_config(args.drafter, target=target).model
    report = {"drafter": args.drafter, "max_new": args.max_new, "prompts": len(prompts), "results": {}}
    for temp in [float(x) for x in args.temps.split(",")]:
        names = list(decoders)
        if temp > 0 and args.t1_methods:
            names = [n for n in args.t1_methods.split(",") if n in decoders]
        rows = {n: [] for n in names}
        use = prompts
        if temp > 0 and args.t1_prompts:  # the first N prompts of each set
            seen = {}
            use = [p for p in prompts if seen.setdefault(p[0], []).append(p) or len(seen[p[0]]) <= args.t1_prompts]
        sim_rows = []
        per_src: dict[str, int] = {}
        for i, (src, text) in enumerate(use):
            msgs = [{"role": "user", "content": text}]
            ar_tokens = None
            for n in names:  # interleaved: every method on this prompt before the next prompt
                if n not in ("ar", "pld") and args.e2e_prompts is not None and temp == 0 and \
                        per_src.get(src, 0) >= args.e2e_prompts:
                    continue
                dec = decoders[n]
                dec.target.set_feature_layers(getattr(dec.drafter, "feature_layers", ()) or ())
                r = dec.generate(msgs, max_new_tokens=args.max_new, temperature=temp, seed=1000 + i)
                st = r.stats
                if n == "ar":
                    ar_tokens = r.tokens
                rows[n].append({"i": i, "src": src, "tau": st.tau, "decode_s": st.decode_s, "tokens": st.committed_in_rounds,
                                "rounds": st.rounds, "phase_s": st.phase_s,
                                "identical": (r.tokens == ar_tokens) if (temp == 0 and ar_tokens is not None) else None})
            per_src[src] = per_src.get(src, 0) + 1
            line = " ".join(f"{n} tau {rows[n][-1]['tau']:.2f}" for n in names if rows[n] and rows[n][-1]["i"] == i)
            if temp == 0 and ar_tokens is not None and args.sim:
                specs = {n: {k: v for k, v in METHODS[n].items()} for n in args.sim.split(",")}
                sim = greedy_tau_simulation(target, sim_model, target.encode(msgs).tolist(), ar_tokens, specs)
                sim_rows.append({"src": src, **sim})
                line += " | sim " + " ".join(f"{n} {v:.2f}" for n, v in sim.items())
            print(f"T={temp} prompt {i} ({src}): " + line, flush=True)
        summary = {}
        for n in names:
            rs = rows[n]
            if not rs:
                continue
            tpot = sum(r["decode_s"] for r in rs) / max(1, sum(r["tokens"] for r in rs))
            summary[n] = {"tau": statistics.mean(r["tau"] for r in rs), "tpot_ms": tpot * 1000,
                          "tau_humaneval": statistics.mean(r["tau"] for r in rs if r["src"] == "humaneval") if any(
                              r["src"] == "humaneval" for r in rs) else None,
                          "tau_mtbench": statistics.mean(r["tau"] for r in rs if r["src"] == "mtbench") if any(
                              r["src"] == "mtbench" for r in rs) else None,
                          "draft_ms_per_round": 1000 * sum(r["phase_s"].get("draft", 0) for r in rs) / max(
                              1, sum(r["rounds"] for r in rs)),
                          "identical_to_ar": None if temp > 0 else all(r["identical"] for r in rs)}
        if "ar" in summary:  # over the prompts both ran (AR time per token / method time per token)
            ar_by_i = {r["i"]: r for r in rows["ar"]}
            for n in names:
                rs = [r for r in rows[n] if r["i"] in ar_by_i]
                ar_t = sum(ar_by_i[r["i"]]["decode_s"] for r in rs) / max(1, sum(ar_by_i[r["i"]]["tokens"] for r in rs))
                m_t = sum(r["decode_s"] for r in rs) / max(1, sum(r["tokens"] for r in rs))
                summary[n]["speedup"] = ar_t / m_t if m_t > 0 else float("nan")
                summary[n]["prompts"] = len(rs)
        if sim_rows:
            simsum = {n: {"tau": statistics.mean(r[n] for r in sim_rows),
                          "tau_humaneval": _mean(r[n] for r in sim_rows if r["src"] == "humaneval"),
                          "tau_mtbench": _mean(r[n] for r in sim_rows if r["src"] == "mtbench")}
                      for n in args.sim.split(",")}
            report.setdefault("greedy_tau_simulated", simsum)
            for n, v in simsum.items():
                print(f"  sim {n:9s} tau {v['tau']:.3f} (HE {v['tau_humaneval'] or 0:.3f} / MT {v['tau_mtbench'] or 0:.3f})")
        report["results"][f"T={temp:g}"] = {"summary": summary, "per_prompt": rows}
        print(f"== T={temp:g}")
        for n, s in summary.items():
            print(f"  {n:6s} tau {s['tau']:.2f} (HE {s['tau_humaneval'] or 0:.2f} / MT {s['tau_mtbench'] or 0:.2f}) "
                  f"tpot {s['tpot_ms']:.1f} ms speedup {s.get('speedup', float('nan')):.2f}x "
                  f"draft {s['draft_ms_per_round']:.1f} ms/round identical {s['identical_to_ar']}", flush=True)
    if not args.no_verify_cost:
        target.set_feature_layers(())
        report["verify_ms"] = verify_cost(target)
        print("verify ms by nodes:", {k: round(v, 1) for k, v in report["verify_ms"].items()})
    report["wall_s"] = time.time() - t_start
    print(f"wall {report['wall_s']:.0f} s")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
