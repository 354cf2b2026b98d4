#!/usr/bin/env python
"""graft-block's benchmark and main job: every method side by side on the same target, prompts and budget.

    python eval/run_block.py                      # quick suite on the embedded SmolLM2 default (a few minutes)
    python eval/run_block.py --suite paper        # the seed papers' relative claims, "holds / does not hold"
    python eval/run_block.py --methods ar,pld,recycling --prompts mtbench --limit 5 --budget 8,16,32
    torchrun --nproc_per_node 2 eval/run_block.py ...   # shard prompts over processes, merged by rank 0

Methods are interleaved per prompt (prompt-major loop) so machine drift hits all of them alike. Speedup is the
per-prompt ratio of decode tok/s (prefill excluded) over our AR loop measured on the same prompt in the same run.
At temperature 0 every method's tokens are compared with AR's and any mismatch is flagged loudly.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from graft_block import ConfigError, Drafter, SpeculativeDecoder, load_target  # noqa: E402
from graft_block.data import load_prompts  # noqa: E402
from graft_block.drafter import bundled_checkpoint, load_config  # noqa: E402

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover
    def tqdm(it=None, **_):
        return it

# ---- methods ----------------------------------------------------------------------------------------------
# A preset is {"drafter": Drafter.from_config input or None, "graft": graft config or None, "hf": HF generate
# kwargs or None, "needs": bundled checkpoint that must exist}. "{budget}" placeholders take the run's budget.
PRESETS: dict[str, dict] = {
    "ar": {"drafter": None},
    "hf": {"hf": {}},
    "hf_pld": {"hf": {"prompt_lookup_num_tokens": 10}},
    "pld": {"drafter": {"type": "pld", "budget": "{budget}"}},
}
QUICK_METHODS = ["ar", "hf", "hf_pld", "pld"]
PAPER_CLAIMS: list[dict] = []


def register_preset(name: str, spec: dict, quick: bool = False) -> None:
    PRESETS[name] = spec
    if quick and name not in QUICK_METHODS:
        QUICK_METHODS.append(name)


def _fill(obj, budget):
    if isinstance(obj, dict):
        return {k: _fill(v, budget) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill(v, budget) for v in obj]
    if obj == "{budget}":
        return int(budget)
    return obj


@dataclass
class Method:
    """A named way of decoding. ``run(prompt_ids, max_new_tokens, temperature, seed) -> dict``."""

    name: str
    run: Callable[..., dict]
    budget: int | None = None
    config: dict = field(default_factory=dict)
    hooks: list = field(default_factory=list)


def build_graft(cfg: dict, target, drafter, matrix=None):
    """Graft settings -> a graft object (imported lazily: the graft core is optional for AR/PLD runs)."""
    from graft_block.graft import Graft

    return Graft.from_config(dict(cfg), matrix=matrix, target=target, drafter=drafter)


def _resolve_bundled(obj, name):
    """Replace "@short-name" checkpoint references with the bundled folder (or skip the method)."""
    if isinstance(obj, dict):
        return {k: _resolve_bundled(v, name) for k, v in obj.items()}
    if isinstance(obj, str) and obj.startswith("@"):
        folder = bundled_checkpoint(obj[1:])
        if folder is None:
            raise ConfigError(f"method {name!r} needs the bundled drafter {obj[1:]!r}, which is not installed")
        return str(folder)
    return obj


_WARM_MATRIX: dict = {}


def warm_matrix(target, k: int = 8, rounds: int = 5):
    """One adjacency-matrix warm-up per run (ShareGPT calibration prompts); each method gets its own copy so
    no method learns from another method's verifications of the same prompt."""
    from graft_block.adjacency import AdjacencyMatrix

    key = (id(target), k, rounds)
    if key not in _WARM_MATRIX:
        m = AdjacencyMatrix(target.vocab_size, k, "int32", target.device)
        if rounds and target.tokenizer is not None:
            m.warmup(target, rounds=rounds)
        _WARM_MATRIX[key] = m
    return copy.deepcopy(_WARM_MATRIX[key])


def make_method(name: str, spec: dict, target, budget: int | None, chimeric: bool = False) -> Method:
    spec = copy.deepcopy(spec)
    default_budget = spec.pop("default_budget", 10)
    chimeric = chimeric or bool(spec.pop("chimeric", False))
    spec = _resolve_bundled(_fill(spec, budget if budget is not None else default_budget), name)
    if spec.get("hf") is not None:
        return Method(name, _hf_runner(target, spec["hf"]), config=spec)
    dcfg = spec.get("drafter")
    if isinstance(dcfg, dict) and dcfg.get("type") in ("recycling", "pld_matrix") and "matrix" not in dcfg \
            and dcfg.get("warmup_rounds", 5) == 5:
        dcfg = {**dcfg, "matrix": warm_matrix(target), "warmup_rounds": 0}
    drafter = Drafter.from_config(dcfg, target=target) if dcfg else None
    graft = None
    if spec.get("graft"):
        gcfg = dict(spec["graft"])
        matrix = None
        if gcfg.get("mode", "graft") != "prune" and "matrix" not in gcfg and getattr(drafter, "matrix", None) is None:
            matrix = warm_matrix(target, int(gcfg.get("k", 8)), int(gcfg.get("warmup_rounds", 5)))
        graft = build_graft(gcfg, target, drafter, matrix)
    hooks = []
    if chimeric and drafter is not None:
        from graft_block.chimeric import proxy_hook

        hooks.append(proxy_hook())
    dec = SpeculativeDecoder(target, drafter, graft=graft, round_hooks=hooks)
    eff_budget = dec.budget

    def run(ids, max_new_tokens, temperature, seed):
        for h in hooks:
            h.rows.clear()
        res = dec.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        out = {"tokens": res.tokens, **res.stats.to_dict()}
        if graft is not None and hasattr(graft, "state_bytes"):
            out["retrieval_state_bytes"] = int(graft.state_bytes())
        elif drafter is not None and hasattr(drafter, "state_bytes"):
            out["retrieval_state_bytes"] = int(drafter.state_bytes())
        if graft is not None and hasattr(graft, "summary"):
            out["graft"] = graft.summary()
            if hasattr(graft, "reset_stats"):
                graft.reset_stats()
        for h in hooks:
            chim = h.summary()
            out["chimeric"] = chim
            out["chimeric_share"] = chim["draft"].get("chimeric")
        return out

    return Method(name, run, budget=eff_budget, config=spec, hooks=hooks)


def _hf_runner(target, kwargs):
    def run(ids, max_new_tokens, temperature, seed):
        model = target.model
        inp = ids.view(1, -1).to(target.device)
        gen_kw = dict(max_new_tokens=max_new_tokens, attention_mask=torch.ones_like(inp), **kwargs)
        if temperature > 0:
            torch.manual_seed(seed)
            gen_kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            gen_kw.update(do_sample=False)
        if "prompt_lookup_num_tokens" in kwargs and target.tokenizer is None:
            raise ConfigError("HF prompt lookup needs a tokenizer-backed target")
        # Prefill is timed separately (one forward over the prompt) so tok/s excludes it, like the other methods.
        sync = (lambda: torch.cuda.synchronize()) if target.device.type == "cuda" else (lambda: None)
        with torch.no_grad():
            sync()
            t0 = time.perf_counter()
            model(input_ids=inp)
            sync()
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = model.generate(inp, **gen_kw)
            sync()
            total = time.perf_counter() - t0
        toks = out[0, inp.shape[1]:].tolist()
        decode = max(total - prefill, 1e-9)
        return {"tokens": toks, "new_tokens": len(toks), "decode_s": decode, "prefill_s": prefill,
                "decode_tok_s": max(len(toks) - 1, 0) / decode, "tau": None, "rounds": None}

    return run


# ---- prompts ----------------------------------------------------------------------------------------------
def prompt_records(sets: list[str], limit: int | None) -> list[dict]:
    out = []
    for name in sets:
        for rec in load_prompts(name, limit):
            out.append({**rec, "set": Path(name).stem if Path(name).suffix else name})
    return out


def encode_turn(target, history: list[dict], turn) -> torch.Tensor:
    if isinstance(turn, list):  # token ids (tokenizer-less targets)
        return torch.tensor(turn, dtype=torch.long)
    if target.tokenizer is None:
        raise ConfigError("this target has no tokenizer: give prompts as token-id lists ('turns': [[ids]])")
    msgs = history + [{"role": "user", "content": turn}]
    return target.encode(msgs)


# ---- cost-aware budgets -----------------------------------------------------------------------------------
def verify_cost_curve(target, sizes=(1, 2, 4, 8, 16, 32, 64), context: int = 200, reps: int = 5,
                      cache: bool = True) -> dict:
    """Median seconds of one verify forward over n tree nodes (a chain) after ``context`` cached tokens.
    Cached per target and device under GRAFT_BLOCK_CACHE/cost/ because it is a property of the hardware."""
    from graft_block.target import cache_root
    from graft_block.tree import chain

    key = f"{Path(str(target.name)).name}-{target.device.type}-{str(target.dtype).split('.')[-1]}-{torch.get_num_threads()}t"
    path = cache_root() / "cost" / f"{key}.json"
    if cache and path.exists():
        data = json.loads(path.read_text())
        if all(str(s) in data["median_s"] for s in sizes):
            return data
    target.set_feature_layers([])
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (context,), generator=gen)
    sync = (lambda: torch.cuda.synchronize()) if target.device.type == "cuda" else (lambda: None)
    target.prefill(ids)
    med = {}
    for n in sizes:
        tr = chain(int(ids[-1]), torch.randint(0, target.vocab_size, (n - 1,), generator=gen))
        times = []
        for rep in range(reps + 1):  # the first forward of each shape is a warm-up, not timed
            sync()
            t0 = time.perf_counter()
            target.verify(tr)
            sync()
            if rep:
                times.append(time.perf_counter() - t0)
            target.compact(tr.size, torch.arange(0))  # drop the appended entries: same context every time
        med[str(n)] = statistics.median(times)
    data = {"target": str(target.name), "device": str(target.device), "context": context, "median_s": med}
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
    return data


def cost_at(curve: dict, nodes: int) -> float:
    """Verify seconds for ``nodes`` positions, interpolated linearly between measured sizes."""
    pts = sorted((int(k), v) for k, v in curve["median_s"].items())
    if nodes <= pts[0][0]:
        return pts[0][1]
    for (a, ta), (b, tb) in zip(pts, pts[1:]):
        if nodes <= b:
            return ta + (tb - ta) * (nodes - a) / (b - a)
    (a, ta), (b, tb) = pts[-2], pts[-1]
    return tb + (tb - ta) * (nodes - b) / (b - a)


def auto_budget(name, spec, target, curve, pilot_ids, candidates=(4, 8, 16, 32, 64), max_new_tokens=48) -> dict:
    """Pick the budget that maximises tau(b) / verify_cost(b + 1) on one pilot prompt (greedy)."""
    rows = {}
    for b in candidates:
        m = make_method(name, spec, target, b)
        r = m.run(pilot_ids, max_new_tokens, 0.0, 0)
        tau = r.get("tau") or 1.0
        rows[b] = {"tau": tau, "est_speedup": tau * cost_at(curve, 1) / cost_at(curve, b + 1)}
    best = max(rows, key=lambda b: rows[b]["est_speedup"])
    return {"best": best, "pilot": rows}


# ---- the run ----------------------------------------------------------------------------------------------
def peak_rss_mb() -> float:
    # ru_maxrss is KiB on Linux: the process's peak resident set so far.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_benchmark(target, methods: list[Method], prompts: list[dict], max_new_tokens: int, temperatures,
                  seed: int = 0, progress: bool = True, shard: tuple[int, int] = (0, 1)) -> list[dict]:
    """Prompt-major loop; returns one record per (prompt, temperature, method, turn)."""
    rank, world = shard
    mine = [p for i, p in enumerate(prompts) if i % world == rank]
    records = []
    total = len(mine) * len(temperatures) * len(methods)
    bar = tqdm(total=total, desc=f"run_block[{rank}]" if world > 1 else "run_block", disable=not progress,
               file=sys.stderr)
    for p in mine:
        for temp in temperatures:
            histories = {m.name: [] for m in methods}
            for t_idx, turn in enumerate(p["turns"]):
                for m in methods:
                    hist = histories[m.name]
                    ids = encode_turn(target, hist, turn)
                    if target.device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    r = m.run(ids, max_new_tokens, temp, seed)
                    r.update(prompt_id=p["id"], set=p.get("set"), turn=t_idx, method=m.name, temperature=temp,
                             budget=m.budget, prompt_tokens=int(ids.numel()), peak_rss_mb=peak_rss_mb())
                    if target.device.type == "cuda":
                        r["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
                    if target.tokenizer is not None and not isinstance(turn, list):
                        r["text"] = target.decode(r["tokens"])
                        # the next turn is fed this method's own answer (MT-Bench protocol)
                        hist.extend([{"role": "user", "content": turn}, {"role": "assistant", "content": r["text"]}])
                    records.append(r)
                bar.update(len(methods)) if t_idx == 0 else None
    bar.close()
    return records


def add_comparisons(records: list[dict], baseline: str = "ar") -> None:
    """Per-prompt speedup over the baseline and the T=0 lossless flag, in place."""
    base = {(r["prompt_id"], r["turn"], r["temperature"]): r for r in records if r["method"] == baseline}
    for r in records:
        b = base.get((r["prompt_id"], r["turn"], r["temperature"]))
        if b is None:
            continue
        r["speedup"] = r["decode_tok_s"] / b["decode_tok_s"] if b.get("decode_tok_s") else None
        if r["temperature"] == 0:
            r["matches_ar"] = r["tokens"] == b["tokens"]


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _spread(xs):
    xs = sorted(x for x in xs if x is not None)
    if len(xs) < 2:
        return None
    q = lambda f: xs[min(len(xs) - 1, int(round(f * (len(xs) - 1))))]  # noqa: E731
    return (q(0.25), q(0.75))


def summarize(records: list[dict]) -> list[dict]:
    """One row per (method, temperature, budget): medians and IQR over prompts."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r["method"], r["temperature"], r.get("budget")), []).append(r)
    rows = []
    for (name, temp, budget), rs in groups.items():
        phase_tot: dict = {}
        for r in rs:
            for k, v in (r.get("phase_s") or {}).items():
                phase_tot[k] = phase_tot.get(k, 0.0) + v
        tot = sum(phase_tot.values()) or 1.0
        hist: dict = {}
        for r in rs:
            for k, v in (r.get("accept_hist") or {}).items():
                hist[int(k)] = hist.get(int(k), 0) + v
        mism = [r["prompt_id"] + f"#{r['turn']}" for r in rs if r.get("matches_ar") is False]
        retr = sum(r.get("retrieved_nodes") or 0 for r in rs)
        rows.append({
            "method": name, "temperature": temp, "budget": budget, "n": len(rs),
            "tau": _med([r.get("tau") for r in rs]), "tau_iqr": _spread([r.get("tau") for r in rs]),
            "tok_s": _med([r.get("decode_tok_s") for r in rs]),
            "speedup": _med([r.get("speedup") for r in rs]), "speedup_iqr": _spread([r.get("speedup") for r in rs]),
            "time_split": {k: v / tot for k, v in phase_tot.items()},
            "overhead_share": phase_tot.get("overhead", 0.0) / tot if phase_tot else None,
            "accept_hist": dict(sorted(hist.items())),
            "chimeric_share": _med([r.get("chimeric_share") for r in rs]),
            "graft_hit_rate": (sum(r.get("retrieved_accepted") or 0 for r in rs) / retr) if retr else None,
            "retrieval_state_bytes": max([r.get("retrieval_state_bytes") or 0 for r in rs]) or None,
            "peak_rss_mb": max(r.get("peak_rss_mb") or 0 for r in rs),
            "mismatches": mism,
        })
    return rows


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def markdown_table(rows: list[dict]) -> str:
    head = ("| method | T | budget | n | tau | tok/s | speedup vs AR | draft/tree/verify/commit/overhead % "
            "| chimeric | graft hit | state B | lossless |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        ts = r["time_split"]
        split = "/".join(f"{100 * ts.get(k, 0):.0f}" for k in ("draft", "tree", "verify", "commit", "overhead")) if ts else "-"
        if r["temperature"] != 0:
            loss = "n/a (T>0)"
        elif r["method"] == "ar":
            loss = "reference"
        else:
            loss = "ok" if not r["mismatches"] else f"**MISMATCH x{len(r['mismatches'])}**"
        lines.append(
            f"| {r['method']} | {r['temperature']:g} | {r['budget'] or '-'} | {r['n']} | {_f(r['tau'])} | "
            f"{_f(r['tok_s'], '{:.1f}')} | {_f(r['speedup'])} | {split} | {_f(r['chimeric_share'])} | "
            f"{_f(r['graft_hit_rate'])} | {r['retrieval_state_bytes'] or '-'} | {loss} |")
    return "\n".join(lines)


def lossless_alarm(rows: list[dict]) -> str | None:
    bad = [(r["method"], r["mismatches"]) for r in rows if r["mismatches"]]
    if not bad:
        return None
    msg = "\n".join(f"  {m}: differs from AR on {', '.join(ids)}" for m, ids in bad)
    return "!!! LOSSLESS CHECK FAILED at T=0: these methods' outputs differ from the target's greedy output:\n" + msg


def environment() -> dict:
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "platform": platform.platform(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def plots(out: Path, rows: list[dict], records: list[dict]) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    by = {}
    for r in rows:
        if r["budget"] and r["tau"] is not None:
            by.setdefault((r["method"], r["temperature"]), []).append(r)
    if any(len(v) > 1 for v in by.values()):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for (m, t), rs in sorted(by.items()):
            rs = sorted(rs, key=lambda r: r["budget"])
            axes[0].plot([r["budget"] for r in rs], [r["tau"] for r in rs], marker="o", label=f"{m} T={t:g}")
            axes[1].plot([r["budget"] for r in rs], [r["speedup"] or 0 for r in rs], marker="o", label=f"{m} T={t:g}")
        for ax, yl in zip(axes, ("tau (tokens / round)", "speedup vs AR")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("budget (tree nodes)")
            ax.set_ylabel(yl)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "budget_sweep.png", dpi=110)
        plt.close(fig)
        files.append("budget_sweep.png")
    hist_rows = [r for r in rows if r["accept_hist"]]
    if hist_rows:
        fig, ax = plt.subplots(figsize=(8, 4))
        for r in hist_rows:
            h = r["accept_hist"]
            tot = sum(h.values())
            ks = sorted(h)
            ax.plot(ks, [h[k] / tot for k in ks], marker=".", label=f"{r['method']} T={r['temperature']:g} b={r['budget']}")
        ax.set_xlabel("accepted draft tokens per round")
        ax.set_ylabel("share of rounds")
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / "accept_hist.png", dpi=110)
        plt.close(fig)
        files.append("accept_hist.png")
    chim = [r for r in rows if r["chimeric_share"] is not None]
    if chim:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.bar([f"{r['method']}\nb={r['budget']}" for r in chim], [r["chimeric_share"] for r in chim])
        ax.set_ylabel("chimeric share of tree nodes")
        fig.tight_layout()
        fig.savefig(out / "chimeric.png", dpi=110)
        plt.close(fig)
        files.append("chimeric.png")
    return files


# ---- suites -----------------------------------------------------------------------------------------------
SUITES = {
    # quick: 1 HumanEval + 1 two-turn MT-Bench prompt per method (a few minutes on 2 CPU cores)
    "quick": {"prompts": ["humaneval", "mtbench"], "limit": 1, "max_new_tokens": 128, "temperatures": [0.0]},
    "paper": {"prompts": ["humaneval", "mtbench"], "limit": 2, "max_new_tokens": 96, "temperatures": [0.0]},
    "full": {"prompts": ["humaneval", "mtbench", "sharegpt"], "limit": 20, "max_new_tokens": 256,
             "temperatures": [0.0, 1.0]},
}


def paper_verdicts(rows: list[dict]) -> list[dict]:
    """Each registered claim: compare two methods' medians from this run and say whether it holds here."""
    out = []
    idx = {(r["method"], r["temperature"]): r for r in rows}
    for c in PAPER_CLAIMS:
        a = idx.get((c["method"], 0.0))
        b = idx.get((c["baseline"], 0.0)) if c.get("baseline") else None
        metric = c.get("metric", "speedup")
        if a is None or a.get(metric) is None or (c.get("baseline") and (b is None or b.get(metric) is None)):
            out.append({"claim": c["claim"], "paper": c["paper"], "here": None, "holds": None})
            continue
        ours = a[metric] / b[metric] if b is not None and c.get("ratio", True) else a[metric]
        if "range" in c:
            holds = c["range"][0] <= ours <= c["range"][1]
        else:
            holds = ours >= c["threshold"]
        out.append({"claim": c["claim"], "paper": c["paper"], "here": ours, "holds": holds})
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=sorted(SUITES), default="quick")
    ap.add_argument("--target", default="smollm2-135m", help="embedded name or local HF model folder")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) / bfloat16 (GPU default) / float16")
    ap.add_argument("--methods", default=None, help="comma list of presets (default: the suite's)")
    ap.add_argument("--config", action="append", default=[],
                    help="YAML/JSON method file: {name, drafter, graft} or a list of them (repeatable)")
    ap.add_argument("--prompts", default=None, help="comma list: humaneval, mtbench, sharegpt, or JSONL paths")
    ap.add_argument("--limit", type=int, default=None, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--temperature", default=None, help="comma list, e.g. 0,1")
    ap.add_argument("--budget", default=None, help="int, comma list (sweep) or 'auto'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="output folder (default runs/<suite>-<time>)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--chimeric", action="store_true", help="add the one-pass chimeric proxy column")
    return ap.parse_args(argv)


def load_method_files(paths: list[str]) -> dict[str, dict]:
    out = {}
    for p in paths:
        data = load_config(p) if not str(p).endswith((".yaml", ".yml")) else None
        if data is None:
            import yaml

            data = yaml.safe_load(Path(p).read_text())
        items = data if isinstance(data, list) else [data]
        for it in items:
            if not isinstance(it, dict) or "name" not in it:
                raise ConfigError(f"{p}: each method needs a 'name' and a 'drafter' (and optional 'graft')")
            out[it["name"]] = {k: v for k, v in it.items() if k != "name"}
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    _register_drafter_presets()
    suite = SUITES[args.suite]
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    prompts_sets = args.prompts.split(",") if args.prompts else suite["prompts"]
    limit = args.limit if args.limit is not None else suite["limit"]
    max_new = args.max_new_tokens or suite["max_new_tokens"]
    temps = [float(t) for t in args.temperature.split(",")] if args.temperature else suite["temperatures"]
    extra = load_method_files(args.config)
    if args.methods:
        names = args.methods.split(",")
    elif args.suite == "paper":
        names = [n for n in PAPER_METHODS if n in PRESETS]
    elif args.suite == "full":
        names = list(PRESETS)
    else:
        names = list(QUICK_METHODS)
    names += [n for n in extra if n not in names]
    if "ar" not in names:
        names.insert(0, "ar")  # speedups and the lossless check are relative to our AR loop
    out = Path(args.out or f"runs/{args.suite}-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)

    t_start = time.time()
    target = load_target(args.target, device=args.device, dtype=args.dtype)
    prompts = prompt_records(prompts_sets, limit)
    curve = verify_cost_curve(target)
    budgets: list = [None]
    auto = None
    if args.budget == "auto":
        budgets = ["auto"]
    elif args.budget:
        budgets = [int(b) for b in args.budget.split(",")]

    methods: list[Method] = []
    skipped = {}
    auto_report = {}
    for name in names:
        spec = extra.get(name) or PRESETS.get(name)
        if spec is None:
            raise ConfigError(f"unknown method {name!r}; presets: {', '.join(PRESETS)}; or pass --config FILE")
        takes_budget = "{budget}" in json.dumps(spec)
        for b in (budgets if takes_budget else [None]):
            try:
                if b == "auto":
                    pilot = encode_turn(target, [], prompts[0]["turns"][0])
                    auto = auto_budget(name, spec, target, curve, pilot)
                    auto_report[name] = auto
                    b = auto["best"]
                label = name if (b is None or len(budgets) == 1) else f"{name}@{b}"
                m = make_method(name, spec, target, b, chimeric=args.chimeric)
                m.name = label
                methods.append(m)
            except ConfigError as exc:
                skipped[name] = str(exc)
    if rank == 0:
        for n, why in skipped.items():
            print(f"[skip] {n}: {why}", file=sys.stderr)

    records = run_benchmark(target, methods, prompts, max_new, temps, args.seed, not args.no_progress, (rank, world))
    if world > 1:
        records = _gather_shards(records, out, rank, world)
        if rank != 0:
            return {}
    add_comparisons(records)
    rows = summarize(records)
    wall = time.time() - t_start
    report = {
        "suite": args.suite, "args": vars(args), "methods": {m.name: m.config for m in methods}, "skipped": skipped,
        "environment": environment(), "target": str(target.name), "verify_cost_curve": curve,
        "auto_budget": auto_report, "wall_s": wall, "peak_rss_mb": peak_rss_mb(), "summary": rows,
        "records": records, "world_size": world,
    }
    table = markdown_table(rows)
    print(f"\n## graft-block run_block: suite={args.suite} target={target.name} prompts={','.join(prompts_sets)} "
          f"x{limit} max_new_tokens={max_new}\n")
    print(table)
    cc = ", ".join(f"{k}:{1000 * v:.0f}ms" for k, v in curve["median_s"].items())
    print(f"\nverify cost (nodes:median ms): {cc}")
    for n, a in auto_report.items():
        print(f"auto budget for {n}: {a['best']} (pilot {json.dumps({k: round(v['est_speedup'], 2) for k, v in a['pilot'].items()})})")
    if args.suite == "paper":
        verdicts = paper_verdicts(rows)
        report["paper_verdicts"] = verdicts
        if verdicts:
            print("\n| claim | paper | here | verdict |\n|---|---|---|---|")
            for v in verdicts:
                if v["here"] is None:
                    print(f"| {v['claim']} | {v['paper']} | - | not measured (method skipped) |")
                else:
                    verdict = "holds here" if v["holds"] else "does not hold here"
                    print(f"| {v['claim']} | {v['paper']} | {v['here']:.2f} | {verdict} |")
    alarm = lossless_alarm(rows)
    if alarm:
        print("\n" + alarm, file=sys.stderr)
        print("\n" + alarm)
    if not args.no_plots:
        report["plots"] = plots(out, rows, records)
    (out / "results.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwall {wall:.0f}s, peak RSS {peak_rss_mb():.0f} MB; wrote {out / 'results.json'}"
          + (f" and {', '.join(report.get('plots', []))}" if report.get("plots") else ""))
    return report


def _gather_shards(records, out: Path, rank: int, world: int) -> list[dict]:
    """Merge per-rank records on rank 0 (gloo all-gather of JSON; works on CPU under torchrun)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    gathered = [None] * world
    dist.all_gather_object(gathered, records)
    dist.barrier()
    merged = [r for part in gathered for r in part]
    order = {}
    for r in merged:
        order.setdefault(r["prompt_id"], len(order))
    return sorted(merged, key=lambda r: (order[r["prompt_id"]], r["temperature"], r["turn"]))


PAPER_METHODS: list[str] = ["ar", "pld"]


_PRESETS_INSTALLED = []


def _register_drafter_presets():
    """Presets for drafters that ship with graft-block (eval/presets.py); a missing checkpoint skips the method."""
    if _PRESETS_INSTALLED:
        return
    import importlib.util

    spec = importlib.util.spec_from_file_location("graft_block_eval_presets", Path(__file__).with_name("presets.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.install(sys.modules[__name__])
    _PRESETS_INSTALLED.append(True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
