#!/usr/bin/env python
"""graft-block's benchmark and main job: every method side by side on the same target, prompts and budget.

    graft-block bench                               # = python eval/run_block.py: the quick suite, a few minutes
    graft-block bench --list-methods                # every method: drafter, graft mode, budget, checkpoint
    graft-block bench --suite paper --chimeric      # the seed papers' relative claims, "holds / does not hold"
    graft-block bench --methods ar,pld,recycling --prompts mtbench --limit 5 --budget 8,16,32
    graft-block bench --prompts my.jsonl --limit 0 --first-turn-only
    torchrun --nproc_per_node 2 eval/run_block.py ...   # shard prompts over processes, merged by rank 0

Methods are interleaved per prompt after one untimed warm-up call each, so drift hits all of them alike.
Speedup vs AR = decode tokens / decode seconds of the method over the same for our AR loop on the same
prompt-turns (total over total), with the per-prompt median, IQR and a paired-bootstrap interval beside it.
At temperature 0 every method's tokens are compared with AR's and any mismatch is flagged loudly (HF generate's
differences from our AR, and llama.cpp's from its own AR, are a note on their arithmetic). The machine's
load is sampled before, during and after: a busy machine is flagged in the header and in the JSON.
After the table come the suffix decay (acceptance at draft depth k given depth k - 1, per method), the schedule's
kept nodes and expected vs realised tokens per round (scheduled methods; realised = accepted + bonus, counted
before the stop trim at EOS or max_new_tokens, as expected is, so not the emitted tau), and the physics
report (eval/physics.py: bandwidth, matrix-product peak, linear layers vs the verify curve measured above);
--no-physics skips the latter.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if not __package__ and (Path(__file__).resolve().parents[1] / "graft_block").is_dir():
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # `python eval/run_block.py` in an uninstalled checkout

import graft_block  # noqa: E402,F401 - first: it sets the BLAS thread policy before numpy loads
import torch  # noqa: E402

from graft_block import skinny  # noqa: E402
from graft_block.engine import check_threads, set_threads, trim_heap  # noqa: E402
from graft_block.errors import ConfigError, MethodUnavailable, run_command  # noqa: E402
from graft_block.sampling import sampling_options  # noqa: E402
from graft_block.eval import llamacpp, machine, measure, peers, physics, presets, report  # noqa: E402
from graft_block.eval.methods import load_method_files, lookup, make_method  # noqa: E402
from graft_block.eval.plots import plots  # noqa: E402
from graft_block.eval.prompts import describe_sets, encode_turn, prompt_records  # noqa: E402


def _suite_defaults(key: str) -> str:
    vals = {name: v.get(key, "preset") for name, v in presets.SUITES.items()}
    return ", ".join(f"{name} {x if not isinstance(x, list) else ','.join(map(str, x))}" for name, x in vals.items())


def parse_args(argv=None, prog: str | None = None):
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=sorted(presets.SUITES), default="quick",
                    help="defaults for prompts, --limit, --max-new-tokens, --temperature and --methods (default quick)")
    ap.add_argument("--list-methods", action="store_true", help="print every method and exit (loads no model)")
    ap.add_argument("--target", default="smollm2-135m", help="embedded name or local HF model folder "
                    "(default smollm2-135m)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) / bfloat16 (GPU default) / float16")
    ap.add_argument("--engine", default="auto", choices=("auto", "lean", "hf"),
                    help="the target forward under AR and every method: lean (static KV cache, fused and packed "
                         "products; Llama family; a sliding window becomes its context) or hf (the model's own "
                         "forward); auto = lean where it runs the whole context")
    ap.add_argument("--compile", action="store_true", help="torch.compile the lean forward's layers (opt-in: no "
                    "gain measured on 2 CPU cores; compile time is spent in the untimed warm-up)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--methods", default=None,
                    help=f"comma list of methods (default: the suite's); one of {', '.join(presets.PRESETS)} "
                         "or a --config name; see --list-methods")
    ap.add_argument("--config", action="append", default=[],
                    help="YAML/JSON method file: {name, drafter, graft, schedule} (or hf / llamacpp peers) or a "
                    "list of them (repeatable)")
    ap.add_argument("--prompts", default=None,
                    help="comma list of humaneval, mtbench, sharegpt or JSONL paths (lines with 'turns' or "
                         "'prompt'/'text', optional 'question_id'/'id' and 'category'); default: the suite's "
                         f"({_suite_defaults('prompts')})")
    ap.add_argument("--limit", type=int, default=None,
                    help=f"prompts per set, 0 = all (default: the suite's: {_suite_defaults('limit')})")
    ap.add_argument("--first-turn-only", action="store_true", help="use only the first turn of multi-turn prompts")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help=f"default: the suite's ({_suite_defaults('max_new_tokens')})")
    ap.add_argument("--temperature", default=None,
                    help=f"comma list, e.g. 0,1 (default: the suite's: {_suite_defaults('temperatures')})")
    ap.add_argument("--top-k", type=int, default=0, help="at T > 0: sample from the target's k likeliest (0 = off)")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="at T > 0: sample from the target's nucleus of mass p, after the temperature (1 = off)")
    ap.add_argument("--budget", default=None,
                    help="int, comma list (a sweep), 'auto' (cost-aware: pilot tau and drafting cost against the "
                         "measured verify-cost curve, a budget for each of the run's temperatures) or 'preset' (each "
                         "method's default budget, --list-methods); "
                         f"default: the suite's ({_suite_defaults('budget')})")
    ap.add_argument("--pilot-prompts", type=int, default=1,
                    help="--budget auto: the prompts each candidate budget's pilot decodes (48 tokens each, at each of "
                         "the run's temperatures; the first N of the run's; default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="output folder (default runs/<suite>-<time>)")
    ap.add_argument("--warmup-tokens", type=int, default=8, help="untimed warm-up generation per method (0 = none)")
    ap.add_argument("--time-limit", type=float, default=None, help="seconds: start no new prompt after this")
    ap.add_argument("--cached-cost", action="store_true",
                    help="reuse the last verify-cost curve measured for this setup instead of timing it now (a few "
                         "seconds); the VM's speed drifts within minutes, so the default times it every run")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--chimeric", action="store_true", help="add the one-pass chimeric proxy column")
    ap.add_argument("--llamacpp", default=None, metavar="DIR",
                    help="a llama.cpp build folder (scripts/build_llamacpp.sh makes one): adds the llama.cpp peers ("
                         + ", ".join(presets.LLAMACPP) + ") to the suite's methods, and a 'vs llama.cpp' column; "
                         "$GRAFT_BLOCK_LLAMACPP locates the build too, for --methods naming them; without a build "
                         "they are skipped with a note")
    ap.add_argument("--exact-quant", action="store_true",
                    help="stream float32 weights that are exactly quantised values (a GGUF target's: SmolLM2's "
                         "Q4_1 layers, Q8_0 head) in that form: the same bits, a sixth of the bytes, a verify-cost "
                         "curve of the compute-bound regime (GRAFT_BLOCK_EXACT_QUANT=1; docs/engine.md)")
    ap.add_argument("--no-physics", action="store_true",
                    help="skip the physics report after the table (bandwidth, matrix-product peak, linear layers)")
    return ap.parse_args(argv)


# the methods the report's ratios divide by (report.summarize): a --config method of that name would replace them
BASELINES = {"ar": "our AR loop, the base of every speedup", "hf": "HF generate, the base of the 'vs HF' column",
             "llamacpp": "llama.cpp's AR, the base of the 'vs llama.cpp' column"}


def method_names(args, suite: dict, extra: dict) -> list[str]:
    """The methods of this run, validated before any model loads (AR always first: every ratio is against it)."""
    names = args.methods.split(",") if args.methods is not None else \
        [n for n in suite["methods"] if n in presets.PRESETS]
    names += [n for n in extra if n not in names and args.methods is None]
    if getattr(args, "llamacpp", None) and args.methods is None:
        names += [n for n in presets.LLAMACPP if n not in names]
    for n in names:
        presets.check_spec(n, lookup(n, extra))
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:  # two methods of one name would share one record key and one turn-2 history
        raise ConfigError(f"--methods names {twice!r} twice: list each method once (a budget sweep is --budget 8,16)")
    for n in sorted(set(extra) & set(BASELINES)):
        if extra[n] != presets.PRESETS[n]:
            raise ConfigError(f"a --config method is called {n!r}, the name of {BASELINES[n]}: it would replace that "
                              "baseline in every ratio; give it another name")
    return ["ar"] + [n for n in names if n != "ar"]


def check_target(target, max_new: int, prompts: list[dict]) -> None:
    """What the loaded target must allow for this run, checked before the verify-cost curve and the methods: room
    for a prompt beside --max-new-tokens, and a tokenizer for text prompts (with the reason it has none)."""
    measure.check_context(target, max_new)
    if target.tokenizer is None and any(isinstance(t, str) for p in prompts for t in p["turns"]):
        why = getattr(target, "tokenizer_error", None) or "this target has no tokenizer"
        raise ConfigError(f"the prompts are text but {why}: fix the target's tokenizer, or give prompts as "
                          "token-id lists ('turns': [[ids]])")


def budgets_of(text: str | None) -> list:
    if text is None or text == "preset":
        return [None]
    if text == "auto":
        return ["auto"]
    try:
        out = [int(b) for b in text.split(",")]
    except ValueError:
        raise ConfigError(f"--budget takes an int, a comma list of ints, 'auto' or 'preset', got {text!r}") from None
    if min(out) < 1:
        raise ConfigError(f"--budget must be >= 1 (the nodes a tree may draft besides its root), got {text!r}")
    if len(set(out)) < len(out):  # "pld@8" twice: one name for two methods
        raise ConfigError(f"--budget lists a budget twice ({text!r}): list each once")
    return out


def check_flags(args) -> None:
    """ConfigError naming the flag, before any model loads, for a number no run can use (they would fail minutes
    in, or with another flag's name)."""
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.warmup_tokens < 0:
        raise ConfigError(f"--warmup-tokens must be >= 0 (0 = no warm-up), got {args.warmup_tokens}")
    check_threads(args.threads)
    if args.pilot_prompts < 1:
        raise ConfigError(f"--pilot-prompts must be >= 1 (the prompts --budget auto's pilots decode), got "
                          f"{args.pilot_prompts}")
    if args.time_limit is not None and not args.time_limit > 0:  # nan compared False: the limit never fired
        raise ConfigError(f"--time-limit must be > 0 seconds, got {args.time_limit}")
    if args.out:
        blocker = next((p for p in (Path(args.out), *Path(args.out).parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            raise ConfigError(f"--out {args.out}: {blocker} is a file, not a folder; give another --out")
    if args.llamacpp and llamacpp.find_binary(args.llamacpp) is None:  # the reason: no path, not executable, unbuilt
        raise ConfigError(f"--llamacpp {args.llamacpp}: {llamacpp.missing_build(args.llamacpp)}")
    temperatures(args.temperature)


def temperatures(text: str | None) -> list[float] | None:
    """--temperature's comma list as floats (None: the suite's)."""
    if text is None:
        return None
    try:
        out = [float(t) for t in text.split(",")]
    except ValueError:
        raise ConfigError(f"--temperature takes a number or a comma list of numbers (e.g. 0,1), got {text!r}") from None
    if len(set(out)) < len(out):  # every method would run each prompt twice at it, summed into one row
        raise ConfigError(f"--temperature lists a temperature twice ({text!r}): list each once")
    return out


def plan(args, extra: dict, notes: bool = True) -> dict:
    """Everything of a run that needs no model, checked: flags, methods, budgets, prompt files and sampling options
    fail here, before any target loads (``main``; ``run_arms`` before its own load). ``notes``: say on stderr which
    given flags change nothing in this run."""
    check_flags(args)
    suite = presets.SUITES[args.suite]
    names = method_names(args, suite, extra)
    budgets = budgets_of(args.budget if args.budget is not None else suite.get("budget"))
    limit = suite["limit"] if args.limit is None else args.limit
    sets = args.prompts.split(",") if args.prompts is not None else suite["prompts"]
    prompts, set_info = prompt_records(sets, limit, args.first_turn_only)
    temps = temperatures(args.temperature) or suite["temperatures"]
    sampling_options(temps, args.top_k, args.top_p)  # a bad temperature or filter fails before any model loads
    if notes and int(os.environ.get("RANK", 0)) == 0:
        fixed = [n for n in names if n != "ar" and not presets.takes_budget(lookup(n, extra))]
        if args.budget not in (None, "preset") and fixed:
            print(f"[budget] --budget {args.budget} does not change {', '.join(fixed)}: no '{{budget}}' in their "
                  "methods, whose sizes are fixed (--list-methods)", file=sys.stderr)
        top = max((b for b in budgets if isinstance(b, int)), default=0)
        capped = [f"{n} ({cap})" for n in names if n not in fixed
                  and (cap := lookup(n, extra).get("max_budget")) is not None and top > cap]
        if capped:
            print(f"[budget] --budget {args.budget} runs {', '.join(capped)} at most at the max_budget in brackets "
                  "(the most each takes: a chain's block)", file=sys.stderr)
        if args.pilot_prompts != 1 and budgets != ["auto"]:
            print(f"[budget] --pilot-prompts {args.pilot_prompts} sizes --budget auto's pilots, and this run's budgets "
                  f"are fixed ({args.budget if args.budget is not None else suite.get('budget')}): it changes "
                  "nothing", file=sys.stderr)
        if (args.top_k or args.top_p < 1) and all(t == 0 for t in temps):
            print("[sampling] --top-k / --top-p filter sampling at T > 0, and every temperature of this run is 0 "
                  "(greedy): they change nothing (add e.g. --temperature 0,1)", file=sys.stderr)
    return {"suite": suite, "names": names, "budgets": budgets, "limit": limit, "prompts": prompts,
            "set_info": set_info, "max_new": args.max_new_tokens or suite["max_new_tokens"], "temps": temps}


def method_key(name: str, temperatures: tuple | None) -> str:
    """A method's key in results.json's ``methods`` and ``auto_budget``: its name, and its temperature when the run
    sized one instance per temperature (``Method.temperatures``)."""
    return name if temperatures is None else f"{name} (T {temperatures[0]:g})"


def build_methods(names, extra, target, budgets, curve, prompts, chimeric, named=None, pilot_prompts=1,
                  sampling=None):
    """The runnable methods (``sampling``: the run's temperatures, top_k and top_p, which --budget auto's pilots
    decode at; default greedy; with several temperatures, --budget auto builds one instance per temperature, each
    sized by pilots at its own). A method that cannot run here (MethodUnavailable)
    is skipped with its reason; so is any method the suite added by default (a SmolLM2 drafter beside another
    ``--target``). Any other ConfigError of a method the user named (``named``: --methods, --config; None = all)
    stops the run naming it (a typo in its config, a checkpoint for another target)."""
    methods, skipped, auto = [], {}, {}
    def release():
        # a drafter reads rows of HF's embedding and LM head while it is built: release those pages again after
        # each; a pilot's freed drafter leaves small blocks in the heap: give them back (80 MB of the peak)
        target.release_hf_weights()
        trim_heap()

    for name in names:
        spec = lookup(name, extra)
        runs_at = budgets if presets.takes_budget(spec) else [None]
        # a sweep past a method's max_budget runs it once at that cap (a chain's block)
        runs_at = list(dict.fromkeys(b if b == "auto" else presets.budget_for(spec, b) for b in runs_at))
        for b in runs_at:
            try:
                if b != "auto":
                    m = make_method(name, spec, target, b, chimeric=chimeric, curve=curve)
                    m.name = name if (b is None or len(budgets) == 1) else f"{name}@{b}"
                    methods.append(m)
                    continue
                pilots = [encode_turn(target, [], p["turns"][0]) for p in prompts[:pilot_prompts]]
                law = dict(sampling or {})
                temps = [float(t) for t in law.pop("temperatures", (0.0,))]
                # a run of several temperatures sizes the method for each law apart: one instance per temperature
                for t in temps:
                    only = (t,) if len(temps) > 1 else None
                    auto[method_key(name, only)] = a = measure.auto_budget(
                        lambda x: make_method(name, spec, target, x, curve=curve), curve, pilots, after=release,
                        cap=spec.get("max_budget"), temperature=t, **law)
                    m = make_method(name, spec, target, a["best"], chimeric=chimeric, curve=curve)
                    m.temperatures = only
                    methods.append(m)
            except ConfigError as exc:
                if not (isinstance(exc, MethodUnavailable) or (named is not None and name not in named)):
                    raise ConfigError(f"method {name!r} cannot be built: {exc} (fix its config, or leave it out of "
                                      "--methods)") from exc
                skipped[name] = str(exc)
            release()
    return methods, skipped, auto


def run_arms(table: dict, defaults: list[str], rest: list[str]) -> tuple[dict, object]:
    """The bench scripts' entry: ``table``'s arms beside AR through ``main`` (``rest`` overrides ``defaults``).
    Returns (report, target); the target is None for ``--list-methods``, which loads no model."""
    from graft_block import load_target

    run_args = ["--methods", ",".join(["ar", *table]), *defaults, *rest]
    opts = parse_args(run_args)
    if opts.list_methods:
        return main(run_args, methods=table), None
    plan(opts, {**load_method_files(opts.config), **table}, notes=False)  # before the target loads here too
    exact_quant_env(opts)
    target = load_target(opts.target, device=opts.device, dtype=opts.dtype, engine=opts.engine, compile=opts.compile,
                         release_hf=True)
    return main(run_args, methods=table, target=target), target


def exact_quant_env(args) -> None:
    """--exact-quant as the engine reads it (an environment switch, as GRAFT_BLOCK_GEMM: the kernel choice and the
    verify-cost cache key on it, and the HF peers' child processes see it)."""
    if args.exact_quant:
        os.environ[skinny.QUANT_ENV] = "1"


def main(argv=None, methods: dict | None = None, target=None, prog: str | None = None) -> dict:
    """Run a benchmark; returns the report (also written as results.json). ``methods``: extra named presets for
    this run (the bench_*.py scripts' arms); ``target``: an already loaded Target."""
    args = parse_args(argv, prog)
    extra = {**load_method_files(args.config), **(methods or {})}
    if args.list_methods:
        rows = presets.method_rows(extra)
        print(presets.format_methods(rows))
        return {"methods": rows}
    pre = plan(args, extra)
    names, budgets, limit = pre["names"], pre["budgets"], pre["limit"]
    prompts, set_info, max_new, temps = pre["prompts"], pre["set_info"], pre["max_new"], pre["temps"]
    llamacpp.set_build(args.llamacpp)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    set_threads(args.threads)
    for s in set_info:
        if rank == 0 and s["used"] < s["of"] and args.limit is None:
            print(f"[prompts] {s['set']}: {s['used']} of {s['of']} prompts (--limit {limit}, the {args.suite} "
                  "suite's default; --limit 0 for all)", file=sys.stderr)
    out = Path(args.out or f"runs/{args.suite}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a read-only or missing mount: named before the model loads, not a traceback
        raise ConfigError(f"--out {out}: cannot create the output folder ({exc.strerror or exc}); "
                          "give another --out") from exc

    t_start = time.time()
    machine.return_large_frees()
    guard = machine.LoadGuard(expected_cores=(world - 1) * torch.get_num_threads())
    guard.before()
    if target is None:
        from graft_block import load_target

        # HF's weights leave memory once the engine's C layers hold their copy; the HF peers reload them in a
        # child process (eval/peers.py)
        exact_quant_env(args)
        target = load_target(args.target, device=args.device, dtype=args.dtype, engine=args.engine,
                             compile=args.compile, release_hf=True)
    check_target(target, max_new, prompts)  # before minutes of cost curve and method building
    curve = measure.verify_cost_curve(target, fresh=not args.cached_cost)
    target.share_drafter_checkpoints = True  # methods only read their drafters' weights: one copy per checkpoint
    named = set(args.methods.split(",")) if args.methods is not None else set(extra)  # what the user asked for by name
    runs, skipped, auto = build_methods(names, extra, target, budgets, curve, prompts, args.chimeric, named,
                                        args.pilot_prompts,
                                        {"temperatures": temps, "top_k": args.top_k, "top_p": args.top_p})
    too_long: list[dict] = []  # turns that outgrew the target's context, per method (run_interleaved's notes)
    trim_heap()
    if rank == 0:
        for n, why in skipped.items():
            print(f"[skip] {n}: {why}", file=sys.stderr)
    try:
        records = measure.run_interleaved(target, runs, prompts, max_new, temps, args.seed, not args.no_progress,
                                          (rank, world), guard, args.warmup_tokens, args.time_limit, args.top_k,
                                          args.top_p, too_long=too_long)
    finally:
        peers.close_children()  # the HF peers' child: its model copy leaves memory with the timed runs
    guard.after()
    if world > 1:
        records = measure.gather_shards(records, world, [p["id"] for p in prompts], extra=too_long)
        if rank != 0:
            return {}
    measure.pair_with(records)
    rows = report.summarize(records)
    load = guard.report([r["load"] for r in records])
    rss = machine.peak_rss_mb()  # the benchmark's own, before the physics report's copy buffers (2 x 256 MB on CPU)
    # the HF peers' child's own peak (one, beside this process, serving both peers)
    child_rss = max((r.get("child_peak_rss_mb") or 0 for r in records), default=0)
    # after the timed runs, with their own load guard; the verify curve measured above is reused, not re-timed
    phys = None if args.no_physics else physics.measure_physics(target, curve=curve, probe_s=0.3)
    wall = time.time() - t_start
    rep = {
        "suite": args.suite, "args": vars(args), "skipped": skipped,
        "methods": {method_key(m.name, m.temperatures): m.config for m in runs},
        "skipped_turns": too_long,
        "environment": machine.environment(), "target": str(target.name), "prompt_sets": set_info, "limit": limit,
        "max_new_tokens": max_new, "temperatures": temps, "top_k": args.top_k, "top_p": args.top_p,
        "busy": load["busy"], "load": load,
        "verify_cost_curve": curve, "auto_budget": auto, "wall_s": wall, "peak_rss_mb": rss,
        "child_peak_rss_mb": child_rss,
        "speedup_definition": "sum(decode_tokens)/sum(decode_s) of the method / the same for ar, same prompt-turns",
        "summary": rows, "spread": report.spread_notes(rows), "records": records, "world_size": world,
        "physics": phys,
    }
    print()
    print(report.header(args.suite, str(target.name), describe_sets(set_info, limit), args.first_turn_only, max_new,
                        temps, load, torch.get_num_threads(),
                        f"{target.device} engine={measure.engine_label(target)} (AR and every method)",
                        args.top_k, args.top_p))
    print()
    print(report.markdown_table(rows))
    decay = report.suffix_decay_table(rows)
    if decay:
        print("\nsuffix decay: P(depth k accepted | depth k-1 accepted), from the summed accept_hist (capped by the "
              "trees' depth)\n")
        print(decay)
    sched = report.schedule_table(rows)
    if sched:
        print("\nschedule: per round, nodes drafted and kept, and the tokens the survivals expected against those "
              "realised (accepted + bonus, before the stop trim at EOS or max_new_tokens, as expected is; not tau)\n")
        print(sched)
    for by in ("set", "category"):
        rep[f"per_{by}"] = report.group_rows(records, by)
        table = report.group_table(rep[f"per_{by}"])
        if table:
            print(f"\nper {by}{' (or prompt set)' if by == 'category' else ''}: tau / speedup vs AR (prompt-turns)\n")
            print(table)
    print()
    for note in rep["spread"]:
        print(f"spread: {note}")
    cc = ", ".join(f"{k}:{1000 * v:.0f}ms" for k, v in curve["median_s"].items())
    print(f"verify cost (nodes:median ms): {cc} [{curve['source']}]")
    for n, a in auto.items():
        est = {k: round(v["est_speedup"], 2) for k, v in a["pilot"].items()}
        print(f"auto budget for {n}: {a['best']} (pilot est. speedup {json.dumps(est)}, "
              f"{a['pilot_prompts']} prompt{'s' if a['pilot_prompts'] > 1 else ''}"
              + (f" at T {a['pilot_temperature']:g}" if a.get("pilot_temperature") else "") + ")"
              + (f"; refused {', '.join(map(str, a['refused']))}" if a.get("refused") else "")
              + (" - cost curve measured on a busy machine" if a["curve_busy"] else ""))
    if phys is not None:
        print("\n" + physics.format_report(phys))
    if args.suite == "paper":
        rep["paper_verdicts"] = report.paper_verdicts(rows)
        print("\n" + report.verdict_table(rep["paper_verdicts"]))
    if too_long:
        print(f"\n[too long] {len(too_long)} method-turns did not fit the target's context and were left out "
              "(results.json: skipped_turns)", file=sys.stderr)
    alarm, note = report.lossless_alarm(rows, str(target.dtype).removeprefix("torch."))
    if alarm:
        print("\n" + alarm, file=sys.stderr)
    for text in (alarm, note):
        if text:
            print("\n" + text)
    banner = machine.busy_banner(load)
    if banner:
        print("\n" + banner.splitlines()[0], file=sys.stderr)
    if phys is not None and phys["busy"]:
        print("physics report: " + machine.busy_banner(phys["load"]).splitlines()[0], file=sys.stderr)
    if not args.no_plots:
        rep["plots"] = plots(out, rows)
    (out / "results.json").write_text(json.dumps(rep, indent=1, default=str))
    print(f"\nwall {wall:.0f}s, peak RSS {rss:.0f} MB"
          + (f" (HF peer child processes: largest {child_rss:.0f} MB)" if child_rss else "")
          + f"; wrote {out / 'results.json'}"
          + (f" and {', '.join(rep['plots'])}" if rep.get("plots") else ""))
    return rep


def cli(argv=None, prog: str | None = None) -> int:
    """Command-line entry: a ConfigError is a one-line message and exit status 2, not a traceback."""
    return run_command(lambda: main(argv, prog=prog), prog or "run_block")


if __name__ == "__main__":
    sys.exit(cli())
