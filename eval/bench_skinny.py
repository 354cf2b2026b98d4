"""A/B of the C product kernel (``graft_block/skinny.py``) against its version at a git revision, in one process.

    python eval/bench_skinny.py                          # the working tree's kernel against HEAD's
    python eval/bench_skinny.py --against a1e1b05~2 --rows 1,4,8,16,17 --bf16
    python eval/bench_skinny.py --exact-quant             # float32 packs against exact Q4_1 / Q8_0 ones

Both versions are built for this CPU's tile, loaded side by side and called alternately on the same packed
weights (random, of the embedded target's shapes: 30 layers' q/k/v, o, gate/up and down products and the LM head),
so a slow spell of the machine hits both alike; each row count prints the medians and whether every output is
bit-identical (a kernel change must not move a bit: a row's value may not depend on the kernel version, the row
count or the thread count). ``--bf16`` adds a drafter's products in bfloat16 (3 layers and a 16,384-row head) where
the CPU has AVX512-BF16. Run it alone: the figures are timings.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

if not __package__ and (Path(__file__).resolve().parents[1] / "graft_block").is_dir():
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # `python eval/bench_skinny.py` in a checkout

import torch  # noqa: E402

from graft_block import skinny  # noqa: E402
from graft_block.engine import set_threads  # noqa: E402
from graft_block.errors import ConfigError, run_command  # noqa: E402

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: q/k/v, o, gate/up, down


def source_at(rev: str) -> str:
    """The kernel's C source in ``graft_block/skinny.py`` at git revision ``rev``."""
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(["git", "-C", str(repo), "show", f"{rev}:graft_block/skinny.py"], capture_output=True,
                          text=True)
    if done.returncode:
        raise ConfigError(f"no graft_block/skinny.py at revision {rev!r} ({done.stderr.strip()[:200]}): "
                          "pass a revision of this repository with --against")
    found = re.search(r'SOURCE = r"""(.*?)"""', done.stdout, re.S)
    if not found:
        raise ConfigError(f"graft_block/skinny.py at {rev!r} has no SOURCE string: it predates the C kernel")
    return found.group(1)


def ab(sources: dict[str, str], shapes: list[tuple[int, int]], rows: list[int], reps: int = 12,
       half: str | None = None, seed: int = 0) -> list[dict]:
    """Per row count: {"rows", "ms": {name: median ms over every product of ``shapes``}, "same_bits"} for each
    kernel source in ``sources`` (the first is the reference), the builds alternated ``reps`` times after one
    untimed round."""
    _check(reps, rows)
    try:
        libs = {name: skinny.build_library(skinny.variant(), src) for name, src in sources.items()}
    except AttributeError as exc:  # ctypes: a symbol the current code binds is missing from the old library
        raise ConfigError(f"a kernel version lacks a function this code calls ({exc}): pick a later revision") \
            from exc
    gen = torch.Generator().manual_seed(seed)
    weights = [skinny.SkinnyWeight(torch.randn(o, i, generator=gen) * 0.02, half=half) for o, i in shapes]
    return _alternate({name: (lib, weights) for name, lib in libs.items()}, shapes, rows, reps, gen)


def ab_packing(shapes: list[tuple[int, int]], rows: list[int], reps: int = 12, seed: int = 0) -> list[dict]:
    """As ``ab``, for this kernel's two packings of the same float32 weights: float32, and the exact quantised
    packs (``GRAFT_BLOCK_EXACT_QUANT``) of weights de-quantised as GGUF does (Q4_1 layers, a Q8_0 last product:
    SmolLM2's LM head)."""
    from graft_block.testing import gguf_quantised

    _check(reps, rows)
    if not skinny._lib.quant_weights():
        raise ConfigError(f"this build ({skinny.label()}) has no quantised loads (AVX-512 or AVX2 with F16C)")
    gen = torch.Generator().manual_seed(seed)
    ws = [gguf_quantised(torch.randn(o, i, generator=gen) * 0.02, 8 if k == len(shapes) - 1 else 4)
          for k, (o, i) in enumerate(shapes)]
    exact = [skinny.SkinnyWeight(w, quant=True) for w in ws]
    if any(w.prec not in (skinny.Q4, skinny.Q8) for w in exact):
        raise RuntimeError("a GGUF-quantised weight did not pack as such: exact_quant no longer finds it")
    full = [skinny.SkinnyWeight(w, half=False) for w in ws]
    return _alternate({"float32": (skinny._lib, full), "exact q4_1/q8_0": (skinny._lib, exact)}, shapes, rows, reps,
                      gen)


def _check(reps: int, rows: list[int]) -> None:
    if not skinny.available():
        raise ConfigError(f"the C kernel does not run here: {skinny.why_not()}")
    if reps < 1 or not rows or min(rows) < 1:
        raise ConfigError(f"--reps must be >= 1 and --rows positive ints, got {reps} and {rows}")


def _alternate(arms: dict, shapes: list[tuple[int, int]], rows: list[int], reps: int, gen) -> list[dict]:
    """Times each arm (a library and its packs of ``shapes``) on the same inputs, alternately."""
    threads = torch.get_num_threads()
    out = []
    for n in rows:
        xs = [torch.randn(n, i, generator=gen) for _, i in shapes]
        ys = {name: [torch.empty(n, o) for o, _ in shapes] for name in arms}
        times: dict[str, list[float]] = {name: [] for name in arms}
        for rep in range(reps + 1):
            for name, (lib, weights) in arms.items():
                t0 = time.perf_counter()
                for x, w, y in zip(xs, weights, ys[name]):
                    lib.skinny_linear(w.packed.data_ptr(), w.prec, x.data_ptr(), y.data_ptr(), w.out, w.n_in, n,
                                      threads)
                if rep:
                    times[name].append(time.perf_counter() - t0)
        ref = ys[next(iter(ys))]
        same = all(torch.equal(a, b) for name in ys for a, b in zip(ref, ys[name]))
        out.append({"rows": n, "ms": {name: 1e3 * sorted(t)[len(t) // 2] for name, t in times.items()},
                    "same_bits": same})
    return out


def format_rows(label: str, results: list[dict]) -> str:
    names = list(results[0]["ms"])
    lines = [f"| {label}: rows | " + " | ".join(f"{n} ms" for n in names) + f" | {names[-1]} / {names[0]} | "
             "same bits |", "|---" * (len(names) + 3) + "|"]
    for r in results:
        ms = r["ms"]
        lines.append(f"| {r['rows']} | " + " | ".join(f"{ms[n]:.2f}" for n in names)
                     + f" | {ms[names[-1]] / ms[names[0]]:.3f} | {'yes' if r['same_bits'] else '**no**'} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", default="HEAD", help="git revision of the reference kernel (default: %(default)s)")
    ap.add_argument("--rows", default="1,2,4,5,8,9,16,17", help="comma-separated row counts")
    ap.add_argument("--layers", type=int, default=30, help="decoder layers' products (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--bf16", action="store_true", help="also a drafter's products in bfloat16")
    ap.add_argument("--exact-quant", action="store_true",
                    help="instead: this kernel's float32 packs against its exact Q4_1 / Q8_0 packs of the same "
                         "GGUF-quantised weights (--against is not read)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError as exc:
        raise ConfigError(f"--rows takes comma-separated ints, got {args.rows!r}") from exc
    if args.layers < 1:
        raise ConfigError(f"--layers must be >= 1, got {args.layers}")
    set_threads(args.threads)
    print(f"skinny {skinny.label()}, {args.threads} threads, {args.reps} alternations, medians")
    if args.exact_quant:
        print(format_rows("packing", ab_packing(LAYER * args.layers + [(49152, 576)], rows, args.reps)))
        return
    sources = {args.against: source_at(args.against), "working tree": skinny.SOURCE}
    print(format_rows("fp32 target", ab(sources, LAYER * args.layers + [(49152, 576)], rows, args.reps)))
    if args.bf16:
        if not skinny.draft_half():
            print("\nno bfloat16 products on this CPU (AVX512-BF16 missing, or GRAFT_BLOCK_DRAFT_BF16=0)")
        else:
            print()
            print(format_rows("bf16 drafter", ab(sources, LAYER * 3 + [(16384, 576)], rows, args.reps, "bf16")))


if __name__ == "__main__":
    sys.exit(run_command(main, "python eval/bench_skinny.py"))
