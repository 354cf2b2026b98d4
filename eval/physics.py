"""The physics report: what this machine can do, and how far the target's forward is from it (gpt-fast's GB/s line).

    graft-block physics [--target smollm2-135m --device cpu --threads 2 --sizes 1,2,4,8,16,32,64 --json OUT]
    python -m graft_block.eval.physics ...        # the same; run_block prints it after its table (--no-physics)

All in one process, medians of a few reps (machines of one kind differ 2-3x: only ratios from one run compare):
- copy bandwidth: GB/s moved (read + write) copying one large tensor;
- matrix-product peak: GFLOP/s of one NxN product in the target's dtype;
- all linear layers alone: F.linear of an [n, in] input through every nn.Linear weight (LM head included, tied
  weights once) per row count n, against the floor max(weight bytes / bandwidth, FLOPs / peak);
- the full verify at the same row counts, from ``measure.verify_cost_curve`` (the one verify timer), on the
  target's engine and, for comparison in the same run, on HF's own forward (the eager path) when the target
  runs the lean engine.
Non-GEMM share of a decode step = (verify(1) - linear(1)) / verify(1), for each engine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import graft_block  # noqa: F401 - first: it sets the BLAS thread policy before numpy loads
import torch

from graft_block.engine import STREAM_BYTES, device_name, kernel_weight, linear, set_threads, torch_threads
from graft_block.errors import ConfigError, run_command
from graft_block.eval import machine, measure

SIZES = (1, 2, 4, 8, 16, 32, 64)


def _median_s(fn, device: torch.device, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after one untimed warm-up (allocator, kernel selection)."""
    times = []
    for rep in range(reps + 1):
        if device.type == "cuda":  # GPU work is asynchronous: time only what has finished
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if rep:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def linear_weights(model) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight, bias) of every nn.Linear in the model, each weight once (a tied LM head counts once)."""
    seen, out = set(), []
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear) and id(mod.weight) not in seen:
            seen.add(id(mod.weight))
            out.append((mod.weight, mod.bias))
    if not out:
        raise ConfigError(f"{type(model).__name__} has no nn.Linear layers: the physics report times F.linear "
                          "through them (a quantised or fused model needs its own engine label and sweep)")
    return out


@torch.no_grad()
def paired_verify(a, b, sizes, context: int = 200, reps: int = 5, block: int = 2) -> dict:
    """Two targets (two engines on the same weights) timed in alternating blocks after the same cached context:
    machine drift over minutes hits both alike. Each block starts with one untimed forward, so neither engine is
    timed straight after the other's thread pool ran (idle OpenMP or OpenBLAS threads spin for a while; only a
    benchmark switches engines every forward), then times ``block`` forwards. Returns per row count the median
    seconds of each ("a_s", "b_s") and the median over rounds of the block ratio b / a ("gain")."""
    from graft_block.tree import chain

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, a.vocab_size, (context,), generator=gen)
    saved = [(t, t.feature_layers) for t in (a, b)]
    for t in (a, b):
        t.set_feature_layers([])
        t.prefill(ids)
    out = {"a_s": {}, "b_s": {}, "gain": {}}
    for n in sizes:
        tr = chain(int(ids[-1]), torch.randint(0, a.vocab_size, (n - 1,), generator=gen))
        ta, tb, ratios = [], [], []
        for _ in range(reps):
            xa = [measure.timed_verify(a, tr) for _ in range(block + 1)][1:]
            xb = [measure.timed_verify(b, tr) for _ in range(block + 1)][1:]
            ta += xa
            tb += xb
            ratios.append(statistics.median(xb) / statistics.median(xa))
        out["a_s"][int(n)] = statistics.median(ta)
        out["b_s"][int(n)] = statistics.median(tb)
        out["gain"][int(n)] = statistics.median(ratios)
    for t, layers in saved:
        t.set_feature_layers(layers)
    return out


def linear_flops(weights, n: int) -> int:
    """Multiply-adds x 2 of an [n, in] input through every weight: 2 * n * sum(in * out)."""
    return 2 * n * sum(w.shape[0] * w.shape[1] for w, _ in weights)


def copy_bandwidth(device: torch.device, mb: int, reps: int = 5) -> float:
    """GB/s of ``dst.copy_(src)`` on an ``mb``-MB tensor, read and write both counted."""
    src = torch.ones(mb * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    s = _median_s(lambda: dst.copy_(src), device, reps)
    return 2 * src.numel() * 4 / s / 1e9


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int, reps: int = 3, kernels=()) -> float:
    """Practical GFLOP/s: one n x n by n x n product (2 n^3 FLOPs), the best of ``torch.mm`` and the engine's own
    ``kernels`` ("openblas", "onednn"; on AMD, MKL's torch.mm stays well below oneDNN)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = _median_s(lambda: torch.mm(a, b), device, reps)
    for k in kernels:
        w = kernel_weight(b, k)
        with torch_threads(1 if k == "openblas" else None):
            best = min(best, _median_s(lambda: linear(a[None], b, None, w), device, reps))
    return 2 * n**3 / best / 1e9


def streamed_bytes(lean, weights, rows: int | None = None) -> int | None:
    """The bytes a forward streams through the lean engine's skinny packs (the exact quantised ones included, and
    the biases): None when the engine keeps none, or runs forwards of ``rows`` rows on another kernel (the
    products read ``weights`` as stored)."""
    packs = getattr(lean, "skinny", None)
    if not packs:
        return None
    if rows is not None and (lean.gemm_small if rows <= lean.small_rows else lean.gemm) != "skinny":
        return None
    return sum(p.packed.numel() * p.packed.element_size() for layer in packs for p in layer.values()) + \
        sum(b.numel() * b.element_size() for _, b in weights if b is not None)


def linear_sweep(weights, sizes, device: torch.device, dtype: torch.dtype, reps: int = 3,
                 kernel: str = "torch", kernel_small: str | None = None, small_rows: int = 0) -> dict[int, float]:
    """Median seconds of an [n, in] input through every weight, per row count n, with the lean forward's own
    ``linear``: ``F.linear`` (kernel "torch" or "mkl"), numpy's OpenBLAS ("openblas": torch on one thread),
    oneDNN on reordered weights ("onednn") or skinny on packed ones ("skinny"); ``kernel_small`` up to
    ``small_rows`` rows (the engine's pair)."""
    out = {}
    laid_out = {}
    for n in sizes:
        k = kernel_small if kernel_small and n <= small_rows else kernel
        if k not in laid_out:
            laid_out[k] = [kernel_weight(w, k) for w, _ in weights]
        xs = {w.shape[1]: torch.randn(1, n, w.shape[1], device=device).to(dtype) for w, _ in weights}

        def stack():
            for (w, b), a in zip(weights, laid_out[k]):
                linear(xs[w.shape[1]], w, b, a)

        with torch_threads(1 if k == "openblas" else None):
            out[int(n)] = _median_s(stack, device, reps)
    return out


@torch.no_grad()
def measure_physics(target, sizes=None, curve: dict | None = None, cache: bool = True, fresh: bool = False,
                    reps: int = 3, copy_mb: int | None = None, peak_n: int | None = None, context: int = 200,
                    verify_reps: int = 5, probe_s: float = 0.5, compare: bool = True) -> dict:
    """Every figure of the report as a dict, at row counts ``sizes`` (default: SIZES, those the curve has).
    ``curve``: a verify-cost curve already measured in this run (reused, not re-timed); otherwise
    ``measure.verify_cost_curve`` with ``cache``/``fresh``, ``context``, ``verify_reps``. ``compare``: also time
    HF's eager forward on the same weights when the target runs another engine (the before/after of the engine,
    one run)."""
    dev, dtype = target.device, target.dtype
    gpu = dev.type == "cuda"
    copy_mb = copy_mb or (1024 if gpu else 256)  # well past the last-level cache, cheap to copy
    peak_n = peak_n or (8192 if gpu else 2048)
    measured = sorted(int(k) for k in curve["median_s"]) if curve else None
    # the report's row counts: SIZES where the curve has them (its in-between sizes only serve the schedule)
    sizes = [int(n) for n in (sizes or (([n for n in SIZES if n in measured] or measured) if curve else SIZES))]
    t0 = time.perf_counter()
    guard = machine.LoadGuard(probe_s)
    guard.before()
    with guard.measure():
        bw = copy_bandwidth(dev, copy_mb)
    weights = linear_weights(target.model)
    lean = getattr(target, "lean", None)
    kernel = getattr(lean, "gemm", None) or "torch"  # the products as the engine runs them
    small, small_rows = getattr(lean, "gemm_small", None), getattr(lean, "small_rows", 0)
    with guard.measure():  # torch.mm stands for MKL and torch's own kernels
        peak = matmul_peak(dev, dtype, peak_n, kernels=sorted({kernel, small} & {"openblas", "onednn"}))
    with guard.measure():  # MKL's packs are not swept: F.linear stands for them
        lin = linear_sweep(weights, sizes, dev, dtype, reps, kernel=kernel, kernel_small=small,
                            small_rows=small_rows)
    if curve is None:
        with guard.measure():
            curve = measure.verify_cost_curve(target, sizes, context, verify_reps, cache=cache, fresh=fresh)
    eager = None
    if compare and getattr(target, "engine", "hf") != "hf":
        from graft_block.target import Target

        hf = Target(target.model, target.tokenizer, name=target.name, engine="hf")
        with guard.measure():
            eager = paired_verify(target, hf, sizes, curve.get("key", {}).get("context", context), verify_reps)
    guard.after()
    load = guard.report()
    if curve.get("busy"):  # a busy verify curve distorts every ratio below
        why = curve.get("load", {}).get("reasons") or ["measured on a busy machine"]
        load = {**load, "busy": True, "reasons": load["reasons"] + [f"verify curve: {r}" for r in why]}
    nbytes = sum(w.numel() * w.element_size() + (b.numel() * b.element_size() if b is not None else 0)
                 for w, b in weights)
    streamed = streamed_bytes(lean, weights) or nbytes  # what a forward reads: the engine's packs where it has them

    def mem_floor_s(n: int) -> float:  # an n-row forward reads the packs only where skinny runs that many rows
        return (streamed_bytes(lean, weights, n) or nbytes) / (bw * 1e9)

    mem_floor = mem_floor_s(1)  # a decode step's
    verify = {int(k): v for k, v in curve["median_s"].items()}
    base = eager["b_s"] if eager else {}
    rows = []
    for n in sizes:
        flops = linear_flops(weights, n)
        v = verify.get(n)
        rows.append({"n": n, "linear_ms": 1e3 * lin[n], "gflop": flops / 1e9, "gflops": flops / lin[n] / 1e9,
                     "pct_peak": 100 * flops / lin[n] / 1e9 / peak,
                     "mem_floor_ms": 1e3 * mem_floor_s(n),
                     "floor_ms": 1e3 * max(mem_floor_s(n), flops / (peak * 1e9)),
                     "verify_ms": None if v is None else 1e3 * v,
                     "verify_ratio": None if v is None or 1 not in verify else v / verify[1],
                     "linear_share": None if v is None else lin[n] / v,
                     "paired_ms": 1e3 * eager["a_s"][n] if eager else None,
                     "eager_ms": 1e3 * base[n] if n in base else None,
                     "engine_gain": eager["gain"][n] if eager else None})
    non_gemm = (verify[1] - lin[1]) / verify[1] if 1 in verify and 1 in lin else None
    eager_non_gemm = (base[1] - lin[1]) / base[1] if 1 in base and 1 in lin else None
    if eager and 1 in lin:  # the share on this engine from the same interleaved timing, for a like-for-like pair
        non_gemm = (eager["a_s"][1] - lin[1]) / eager["a_s"][1] if 1 in eager["a_s"] else non_gemm
    return {"target": str(target.name), "device": str(dev), "device_name": device_name(dev),
            "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
            "engine": measure.engine_label(target), "gemm": getattr(lean, "kernel_label", kernel),
            "layers": "C" if getattr(lean, "fused", None) is not None else "torch",
            "skinny_tile": _skinny_tile(lean),
            "gemm_times": getattr(lean, "gemm_times", None), "bandwidth_gbs": bw, "copy_mb": copy_mb,
            "peak_gflops": peak, "peak_n": peak_n,
            "linear": {"count": len(weights), "params": sum(w.numel() for w, _ in weights),
                       "bytes": nbytes, "streamed_bytes": streamed,
                       "packing": getattr(lean, "exact_quant", None) or None,
                       "mem_floor_ms": 1e3 * mem_floor},
            "rows": rows, "non_gemm_share": non_gemm, "eager_non_gemm_share": eager_non_gemm,
            "eager_engine": measure.engine_label(hf) if eager else None, "verify_source": curve.get("source", "given"),
            "verify_context": curve.get("key", {}).get("context", context), "busy": load["busy"], "load": load,
            "reps": reps, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_s": time.perf_counter() - t0}


def _skinny_tile(lean) -> str | None:
    """The skinny tile this CPU runs (e.g. ``avx512 (2 x 16-float vectors, 8-row tiles)``), when the engine uses it."""
    if lean is None or "skinny" not in (getattr(lean, "gemm", None), getattr(lean, "gemm_small", None)):
        return None
    from graft_block import skinny

    return skinny.label()


def _ms(x) -> str:
    return "-" if x is None else format(x, ".2f" if x < 10 else ".1f")  # GPU and tiny-model times are sub-10 ms


def format_report(p: dict) -> str:
    """The markdown report: the machine's limits, then per row count the linear layers and the full verify."""
    lin = p["linear"]
    lines = [f"## physics: target={p['target']} device={p['device']} ({p['device_name']}) threads={p['threads']} "
             f"engine={p['engine']}"]
    banner = machine.busy_banner(p["load"])
    if banner:
        lines += ["", banner]
    elif p["busy"] is None:
        lines += ["(machine load could not be read here: no busy-machine check)"]
    lines += [
        "",
        f"- memory copy bandwidth: {p['bandwidth_gbs']:.1f} GB/s (read+write, a {p['copy_mb']} MB copy, median)",
        f"- matrix-product peak: {p['peak_gflops']:.1f} GFLOP/s ({p['peak_n']}x{p['peak_n']} {p['dtype']} "
        "product, median)",
        f"- linear layers: {lin['count']} weights, {lin['params'] / 1e6:.1f}M parameters, {lin['bytes'] / 1e6:.0f} MB"
        + (f", streamed as {'/'.join(lin['packing'])} packs: {lin['streamed_bytes'] / 1e6:.0f} MB"
           if lin.get("packing") else "")
        + f"; memory-bound floor {_ms(lin['mem_floor_ms'])} ms per one-row forward (bytes streamed / bandwidth)",
    ]
    if p.get("gemm_times"):  # the engine's measured kernel choice: which product wins at which row count
        t = p["gemm_times"]
        per = "; ".join(f"{k} " + "/".join(_ms(t[k].get(n)) for n in sorted(t["mkl"])) for k in t if t[k])
        lines.append(f"- products: {p['gemm']}, chosen by measuring the weights a forward streams (first layers up "
                     f"to 4x the last-level cache, >= {STREAM_BYTES >> 20} MB, + the LM head) at rows "
                     f"{'/'.join(str(n) for n in sorted(t['mkl']))} (ms): {per}")
    elif p.get("gemm"):
        lines.append(f"- products: {p['gemm']}")
    if p.get("skinny_tile"):
        lines.append(f"- skinny tile on this CPU: {p['skinny_tile']}")
    if p.get("layers") == "C":
        lines.append("- decoder layers: C (graft_block/skinny.py, every layer of a forward in one call); "
                     "'linear layers alone' below times one product per Python call, so it can exceed a whole verify")
    if p["non_gemm_share"] is not None:
        r1 = p["rows"][[r["n"] for r in p["rows"]].index(1)]
        lines.append(f"- non-GEMM share of a decode step: {100 * p['non_gemm_share']:.0f}% (verify(1) "
                     f"{_ms(r1.get('paired_ms') or r1['verify_ms'])} ms, "
                     f"linear layers alone {_ms(r1['linear_ms'])} ms)"
                     + ("" if p.get("eager_non_gemm_share") is None else
                        f"; {100 * p['eager_non_gemm_share']:.0f}% on {p['eager_engine']} "
                        f"({_ms(r1['eager_ms'])} ms), both from the interleaved timing"))
    stale = " (an earlier run: --fresh-cost times it now)" if p["verify_source"].startswith("cached") else ""
    lines += [f"- verify: {p['verify_context']}-token cache, {p['verify_source']}{stale}", "",
              f"| rows | linear ms ({p.get('gemm') or 'torch'}) | GFLOP | GFLOP/s | % of peak | floor ms | verify ms "
              "| verify(n)/verify(1) | linear share of verify |"
              + (f" interleaved: {p['engine']} ms | {p['eager_engine']} ms | engine gain "
                 "(median of paired block ratios) |" if p.get("eager_engine") else ""),
              "|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if p.get("eager_engine") else "")]
    for r in p["rows"]:
        extra = "" if not p.get("eager_engine") else (
            f" {_ms(r['paired_ms'])} | {_ms(r['eager_ms'])} | "
            f"{'-' if r['engine_gain'] is None else format(r['engine_gain'], '.2f') + 'x'} |")
        lines.append(f"| {r['n']} | {_ms(r['linear_ms'])} | {r['gflop']:.2f} | {r['gflops']:.1f} | "
                     f"{r['pct_peak']:.0f}% | {_ms(r['floor_ms'])} | {_ms(r['verify_ms'])} | "
                     f"{'-' if r['verify_ratio'] is None else format(r['verify_ratio'], '.2f')} | "
                     f"{'-' if r['linear_share'] is None else format(100 * r['linear_share'], '.0f') + '%'} |" + extra)
    return "\n".join(lines)


def sizes_of(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--sizes takes a comma list of row counts >= 1, e.g. 1,2,4,8,16,32,64; got {text!r}")
    return sizes


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m", help="embedded name or local HF model folder")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) / bfloat16 (GPU default) / float16")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="row counts (tree nodes) to time")
    ap.add_argument("--reps", type=int, default=3, help="timed reps per linear-layer sweep (median)")
    ap.add_argument("--fresh-cost", action="store_true", help="re-measure the verify-cost curve (ignore the cache)")
    ap.add_argument("--no-cost-cache", action="store_true", help="neither read nor write the verify-cost cache")
    ap.add_argument("--json", default=None, help="also write the figures as JSON to this path")
    ap.add_argument("--engine", default="auto", choices=("auto", "lean", "hf"), help="the forward to measure")
    ap.add_argument("--compile", action="store_true", help="torch.compile the lean forward's layers")
    return ap.parse_args(argv)


def main(argv=None, target=None) -> dict:
    """Measure and print the report; ``target``: an already loaded Target (else ``--target`` is loaded)."""
    args = parse_args(argv)
    sizes = sizes_of(args.sizes)
    if args.reps < 1:
        raise ConfigError(f"--reps must be >= 1 (timed reps per sweep, their median reported), got {args.reps}")
    set_threads(args.threads)
    if target is None:
        from graft_block import load_target

        target = load_target(args.target, device=args.device, dtype=args.dtype, engine=args.engine,
                             compile=args.compile)
    phys = measure_physics(target, sizes, cache=not args.no_cost_cache, fresh=args.fresh_cost, reps=args.reps)
    print(format_report(phys))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(phys, fh, indent=1)
        print(f"\nwrote {args.json}")
    if phys["busy"]:
        print(machine.busy_banner(phys["load"]).splitlines()[0], file=sys.stderr)
    return phys


if __name__ == "__main__":
    sys.exit(run_command(main, "python -m graft_block.eval.physics"))
