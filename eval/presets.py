"""The named methods, suites and paper claims of ``graft-block bench``: plain data, imported normally.

A preset is a dict:
    "drafter": ``Drafter.from_config`` input (None = our AR loop); "{budget}" takes the run's budget
    "graft":   Graft settings ({"mode": "graft" | "prune" | "fixed" | "tail", ...}) or absent
    "hf":      keyword arguments of HF ``generate`` (a peer, not our loop)
    "default_budget": the budget when --budget is not given (this CPU's choice: an n-node verify costs several
               decode steps here; use --budget on a GPU)
    "chimeric": add the one-pass chimeric proxy to this method even without --chimeric
    "schedule": confidence-scheduled verification ({"cost": "curve", "min_nodes": 0}): each round's tree is cut to
               the nodes whose estimated acceptance pays for their verify cost on the run's verify-cost curve
    "about":   one line for --list-methods
``"@name"`` in a drafter's ``checkpoint`` is a bundled drafter (``bundled_checkpoint(name)``); a method whose
bundled drafter is missing is skipped with a message.
"""
from __future__ import annotations

import copy
from pathlib import Path

from graft_block.errors import ConfigError, MethodUnavailable

_EAGLE = {"type": "eagle3", "checkpoint": "@eagle3-smollm2", "budget": "{budget}"}
# block drafters draft only the block rows a tree of the run's budget can reach ("budget": a chain of b, b + 1 rows;
# the whole block for budgets >= the block): measured on the quick suite's prompts, the same tau (1.44 vs 1.43 at
# budget 4, 1.56 both at 8, MFD 1.41 vs 1.42) for a cheaper draft
_DFLASH = {"type": "dflash", "checkpoint": "@dflash-smollm2", "block_size": "budget"}
_DSPARK = {"type": "dspark", "checkpoint": "@dspark-smollm2", "block_size": "budget"}
_DSPARK_RNN = {**_DSPARK, "checkpoint": "@dspark-rnn-smollm2"}  # DeepSpec's RNN head on the same backbone
# trees draft at most 3 rows below the deepest acceptance of their last 16 rounds: at budget 16 the same tau as
# every row (1.94 at 6, 8 and 17 rows) and 5-7% faster (MFD drafts its rows once per mode). Chains (Graft-TAIL
# reads the whole chain) draft every row their length reaches, the 64-node trees (whose depth the chimeric
# analysis measures) every row.
_ROWS = {"block_size": "adaptive"}
_CHAIN = {"default_budget": 15, "max_budget": 15}  # a chain of the bundled blocks: at most their 15 drafting rows

PRESETS: dict[str, dict] = {
    "ar": {"drafter": None, "about": "our loop with a root-only tree: the baseline of every speedup"},
    "hf": {"hf": {}, "about": "HF generate (greedy / sampling), a peer"},
    "hf_pld": {"hf": {"prompt_lookup_num_tokens": 10}, "about": "HF prompt-lookup decoding, a peer"},
    "pld": {"drafter": {"type": "pld", "budget": "{budget}"}, "default_budget": 10,
            "about": "prompt lookup (n-gram copy from the context)"},
    "recycling": {"drafter": {"type": "recycling", "budget": "{budget}"}, "default_budget": 16,
                  "about": "Token Recycling: adjacency-matrix retrieval tree"},
    "pld_matrix": {"drafter": {"type": "pld_matrix", "budget": "{budget}"}, "default_budget": 16,
                   "about": "prompt lookup + adjacency-matrix retrieval"},
    "eagle3": {"drafter": _EAGLE, "default_budget": 16, "about": "EAGLE3 dense tree (EAGLE-2 expansion)"},
    "eagle3_prune": {"drafter": _EAGLE, "graft": {"mode": "prune"}, "default_budget": 16,
                     "about": "EAGLE3 + Graft pruning only"},
    "eagle3_fixed": {"drafter": _EAGLE, "graft": {"mode": "fixed"}, "default_budget": 16,
                     "about": "EAGLE3 + fixed-ratio retrieval"},
    "eagle3_graft": {"drafter": _EAGLE, "graft": {"mode": "graft"}, "default_budget": 16,
                     "about": "EAGLE3 + Graft (prune -> retrieve -> splice)"},
    # chains (and Graft-TAIL's) take the run's budget as their length, up to the block's 15 drafting rows: 15 (the
    # papers' chain) unless --budget says otherwise; --budget auto picks it like a tree's size
    "dflash_chain": {"drafter": {**_DFLASH, "proposal": "chain", "budget": "{budget}"}, **_CHAIN,
                     "about": "DFlash block as a chain"},
    "dflash_tail": {"drafter": {**_DFLASH, "proposal": "chain", "budget": "{budget}"}, **_CHAIN,
                    "graft": {"mode": "tail", "tail_threshold": 0.3}, "about": "DFlash chain + Graft-TAIL"},
    "dflash_ddtree": {"drafter": {**_DFLASH, **_ROWS, "proposal": "ddtree", "budget": "{budget}"}, "default_budget": 16,
                      "about": "DFlash DDTree (best-first heap)"},
    "dflash_ddtree64": {"drafter": {**_DFLASH, "proposal": "ddtree", "budget": 64}, "chimeric": True,
                        "about": "DFlash DDTree at 64 nodes, with the chimeric proxy"},
    "dflash_graft": {"drafter": {**_DFLASH, **_ROWS, "proposal": "ddtree", "budget": "{budget}"},
                     "graft": {"mode": "graft"},
                     "default_budget": 16, "about": "DFlash DDTree + Graft (prune -> retrieve -> splice)"},
    "mfd": {"drafter": {"type": "mfd", "checkpoint": "@mfd-smollm2", "budget": "{budget}", **_ROWS},
            "default_budget": 16,
            "about": "Multi-Future Drafting, K=4 best-mode mixed tree"},
    # DSpark + MFD: mfd-smollm2 and dspark-smollm2 share the dflash-smollm2 backbone, so the modes can share the head
    "mfd_markov": {"drafter": {"type": "mfd", "checkpoint": "@mfd-smollm2", "budget": "{budget}", **_ROWS,
                               "markov": "@dspark-smollm2"}, "default_budget": 16,
                   "about": "MFD's K=4 modes under DSpark's Markov head (shared): a best-mode tree of corrected modes"},
    "dspark_chain": {"drafter": {**_DSPARK, "proposal": "chain", "budget": "{budget}"}, **_CHAIN,
                     "about": "DSpark block, Markov-corrected chain"},
    "dspark_ddtree": {"drafter": {**_DSPARK, **_ROWS, "proposal": "ddtree", "budget": "{budget}"}, "default_budget": 16,
                      "about": "DSpark Markov-corrected DDTree (each node expands by its own distribution)"},
    "dspark_sched": {"drafter": {**_DSPARK, **_ROWS, "proposal": "ddtree", "budget": "{budget}"}, "default_budget": 16,
                     "schedule": {"cost": "curve"},
                     "about": "DSpark tree cut each round by its confidence head against the verify-cost curve"},
    # DeepSpec's own decoder cut, a baseline for the cost-aware schedule: the whole block drafted, the head's
    # (offline-calibrated) confidences cut as they are, no online recalibration (docs/results.md: 0.3 and 0.5)
    "dspark_cut": {"drafter": {**_DSPARK, "proposal": "chain"},
                   "schedule": {"stop": "threshold", "threshold": 0.3, "adapt": 0, "size_draft": False,
                                "fit_cost": False},
                   "about": "DSpark chain cut where its confidence first falls below 0.3 (DeepSpec's decoder)"},
    "dspark_graft": {"drafter": {**_DSPARK, **_ROWS, "proposal": "ddtree", "budget": "{budget}"},
                     "graft": {"mode": "graft"},
                     "default_budget": 16, "about": "DSpark Markov tree + Graft (prune -> retrieve -> splice)"},
    "dspark_rnn_chain": {"drafter": {**_DSPARK_RNN, "proposal": "chain", "budget": "{budget}"}, **_CHAIN,
                         "about": "DSpark with DeepSpec's RNN Markov head (a state along the block), chain"},
    "dspark_rnn_ddtree": {"drafter": {**_DSPARK_RNN, **_ROWS, "proposal": "ddtree", "budget": "{budget}"},
                          "default_budget": 16, "about": "DSpark RNN-head tree: each node carries its path's state"},
    "dspark_ddtree64": {"drafter": {**_DSPARK, "proposal": "ddtree", "budget": 64}, "chimeric": True,
                        "about": "DSpark tree at 64 nodes, with the chimeric proxy"},
    "dflash_sched": {"drafter": {**_DFLASH, **_ROWS, "proposal": "ddtree", "budget": "{budget}"}, "default_budget": 16,
                     "schedule": {"cost": "curve"},
                     "about": "DFlash DDTree cut each round by its path probabilities against the verify curve"},
    # The fair DDTree control for MFD: mfd-smollm2's modes trained on a frozen dflash-smollm2, so K = 1 is that backbone
    # (a plain DFlash folder loads as MFD with one zero mode vector).
    "mfd_k1_ddtree": {"drafter": {"type": "mfd", "checkpoint": "@dflash-smollm2", "budget": "{budget}", **_ROWS},
                      "default_budget": 16, "about": "the K=1 control (DDTree): mfd's frozen backbone"},
    # llama.cpp peers (eval/llamacpp.py): llama-speculative-simple on the target's F32 GGUF, chains only. Need a
    # build (--llamacpp DIR or GRAFT_BLOCK_LLAMACPP; scripts/build_llamacpp.sh), else skipped; in no suite.
    "llamacpp": {"llamacpp": {"spec": "none"}, "about": "llama.cpp greedy AR (a peer; the 'vs llama.cpp' base)"},
    # llama.cpp's own defaults (F16 K/V cache, flash attention): its speed at home; its one-token steps then round
    # differently from its batched verifies (eval/llamacpp.py, numerics), so it is not the token reference, and
    # not in the --llamacpp set (its expected difference would print a peer note every run): --methods names it
    "llamacpp_defaults": {"llamacpp": {"spec": "none", "args": ["-fa", "auto", "-ctk", "f16", "-ctv", "f16"]},
                          "about": "llama.cpp greedy AR at its default K/V precision and attention (speed only)"},
    # llama.cpp on the embedded target's own GGUF (SmolLM2's Q4_1 layers and Q8_0 head, the wheel's file): its
    # quantised dot products (activations rounded to 8 bits) are another function than the float32 model, so its
    # tokens are not the reference either; the peer of `--exact-quant`, which streams the same bytes exactly. One
    # row per call (-ub 1): only decode steps are timed, and on the AMX Xeon ggml's batched kernels on repacked Q4_1
    # weights (built with GGML_NATIVE) died on an invalid opcode while its one-row kernels ran (--repack 0 runs
    # batches, but decodes 2.3x slower)
    "llamacpp_q4": {"llamacpp": {"spec": "none", "model": "embedded", "args": ["-ub", "1"]},
                    "about": "llama.cpp greedy AR on the target's quantised GGUF (speed only; other arithmetic)"},
    "llamacpp_ngram": {"llamacpp": {"spec": "ngram-simple", "ngram_n": 3, "ngram_m": 10},
                       "about": "llama.cpp ngram-simple prompt lookup (3-gram key, up to 10 drafted), a peer"},
    # the drafter peers draft one token a round: the fastest of n_max 1, 2, 3, 4 and 7 (and of a --spec-draft-p-min
    # cut) for all three in two sweeps on 2 CPU cores (docs/interop.md, 2026-12-07); their chains of 5-7 ran at
    # 0.6-0.7x llama.cpp's AR, because a round costs llama.cpp far more than its forwards past the first draft
    "llamacpp_dflash": {"llamacpp": {"spec": "draft-dflash", "draft": "dflash-smollm2", "n_max": 1},
                        "about": "llama.cpp draft-dflash with our DFlash exported to GGUF, chain 1, a peer"},
    "llamacpp_eagle3": {"llamacpp": {"spec": "draft-eagle3", "draft": "eagle3-smollm2", "n_max": 1},
                        "about": "llama.cpp draft-eagle3 with our EAGLE3 head exported to GGUF, chain 1, a peer"},
    "llamacpp_dspark": {"llamacpp": {"spec": "draft-dspark", "draft": "dspark-smollm2", "n_max": 1},
                        "about": "llama.cpp draft-dspark with our DSpark exported to GGUF, chain 1, a peer"},
}
LLAMACPP = ["llamacpp", "llamacpp_ngram", "llamacpp_dflash", "llamacpp_eagle3", "llamacpp_dspark"]

QUICK = ["ar", "hf", "hf_pld", "pld", "recycling", "pld_matrix", "eagle3_graft", "dflash_tail", "dflash_ddtree",
         "dflash_graft", "mfd", "mfd_markov", "dspark_chain", "dspark_ddtree", "dspark_sched", "dspark_graft"]
PAPER = ["ar", "pld", "eagle3", "eagle3_prune", "eagle3_fixed", "eagle3_graft", "dflash_chain", "dflash_tail",
         "dflash_ddtree", "dflash_ddtree64", "mfd", "mfd_k1_ddtree", "mfd_markov", "dspark_chain", "dspark_ddtree",
         "dspark_sched", "dspark_cut", "dspark_ddtree64", "dflash_sched", "dflash_graft", "dspark_graft",
         "dspark_rnn_chain", "dspark_rnn_ddtree"]

# Per suite: prompt sets, prompts per set (the --limit default), new tokens, temperatures, methods.
SUITES: dict[str, dict] = {
    # quick: 2 HumanEval + 2 two-turn MT-Bench prompts = 6 prompt-turns per method (a few minutes on 2 cores)
    # budgets "auto": each method's budget picked from the verify curve, its drafting cost and a pilot tau
    "quick": {"prompts": ["humaneval", "mtbench"], "limit": 2, "max_new_tokens": 80, "temperatures": [0.0],
              "methods": QUICK, "budget": "auto"},
    "paper": {"prompts": ["humaneval", "mtbench"], "limit": 2, "max_new_tokens": 96, "temperatures": [0.0],
              "methods": PAPER},
    "full": {"prompts": ["humaneval", "mtbench", "sharegpt"], "limit": 20, "max_new_tokens": 256,
             "temperatures": [0.0, 1.0], "methods": [n for n, p in PRESETS.items() if "llamacpp" not in p]},
}

# Relative claims of the seed papers. "threshold": holds when our ratio (method / baseline) is at least it, and
# by more than report.CLOSE_CALL unless "inclusive" (a ">=" claim, where a tie is the claim).
PAPER_CLAIMS: list[dict] = [
    {"claim": "Graft faster than EAGLE3 dense", "method": "eagle3_graft", "baseline": "eagle3",
     "paper": "+15.3% (Qwen3-8B, 2.43x vs 2.11x)", "threshold": 1.0},
    {"claim": "Graft faster than pruning only", "method": "eagle3_graft", "baseline": "eagle3_prune",
     "paper": "2.43x vs 2.20x (Qwen3-8B)", "threshold": 1.0},
    {"claim": "Graft faster than fixed-ratio retrieval", "method": "eagle3_graft", "baseline": "eagle3_fixed",
     "paper": "2.43x vs 1.95x (Qwen3-8B)", "threshold": 1.0},
    {"claim": "pruning only faster than dense", "method": "eagle3_prune", "baseline": "eagle3",
     "paper": "ECHO-style pruning beats dense in speed", "threshold": 1.0},
    {"claim": "Graft MAT >= pruning-only MAT", "method": "eagle3_graft", "baseline": "eagle3_prune",
     "metric": "tau", "paper": "MAT(Graft) >= MAT(pruned) (theorem)", "threshold": 1.0, "inclusive": True},
    {"claim": "Graft-TAIL faster than DFlash chain", "method": "dflash_tail", "baseline": "dflash_chain",
     "paper": "+9.1% (Qwen3-8B, 3.40x -> 3.71x)", "threshold": 1.0},
    {"claim": "MFD faster than DDTree at equal budget", "method": "mfd", "baseline": "mfd_k1_ddtree",
     "paper": "MFD > DDTree / DARTree (+9-16% vs DARTree)", "threshold": 1.0},
    {"claim": "MFD accepts more than DDTree at equal budget", "method": "mfd", "baseline": "mfd_k1_ddtree",
     "metric": "tau", "paper": "higher acceptance at equal budget", "threshold": 1.0},
    {"claim": "DSpark chain accepts >= 16% more than DFlash chain", "method": "dspark_chain",
     "baseline": "dflash_chain", "metric": "tau", "paper": "+16-18% accepted length (block 7), +22-30% (block 15)",
     "threshold": 1.16},
    {"claim": "Markov + confidence heads beat the same recipe without them", "method": "dspark_ddtree",
     # dspark-smollm2's heads were trained on the frozen dflash-smollm2: that backbone is the control
     "baseline": "dflash_ddtree", "metric": "tau", "paper": "2-layer DSpark > 5-layer DFlash",
     "threshold": 1.0},
    {"claim": "DDTree chimeric share at 64 nodes in 27-33%", "method": "dflash_ddtree64", "baseline": None,
     "sweep_alias": "dflash_ddtree@64",
     "metric": "chimeric_share", "ratio": False, "range": (0.27, 0.33), "paper": "27-33% of a 64-node tree"},
]


def takes_budget(spec: dict) -> bool:
    """Whether --budget changes this method (a "{budget}" placeholder somewhere in it)."""
    if isinstance(spec, dict):
        return any(takes_budget(v) for v in spec.values())
    if isinstance(spec, list):
        return any(takes_budget(v) for v in spec)
    return spec == "{budget}"


def fill_budget(obj, budget: int):
    """Replace every "{budget}" placeholder with ``budget`` (a copy)."""
    if isinstance(obj, dict):
        return {k: fill_budget(v, budget) for k, v in obj.items()}
    if isinstance(obj, list):
        return [fill_budget(v, budget) for v in obj]
    return int(budget) if obj == "{budget}" else obj


def bundled_refs(obj) -> list[str]:
    """The "@name" bundled-checkpoint references in a preset."""
    if isinstance(obj, dict):
        return [r for v in obj.values() for r in bundled_refs(v)]
    if isinstance(obj, list):
        return [r for v in obj for r in bundled_refs(v)]
    return [obj[1:]] if isinstance(obj, str) and obj.startswith("@") else []


def resolve_bundled(obj, name: str):
    """Replace "@short-name" checkpoint references with the bundled folder; MethodUnavailable (skip) when missing."""
    from graft_block.drafter import bundled_checkpoint

    if isinstance(obj, dict):
        return {k: resolve_bundled(v, name) for k, v in obj.items()}
    if isinstance(obj, list):
        return [resolve_bundled(v, name) for v in obj]
    if isinstance(obj, str) and obj.startswith("@"):
        folder = bundled_checkpoint(obj[1:])
        if folder is None:
            raise MethodUnavailable(f"method {name!r} needs the bundled drafter {obj[1:]!r}, which is not installed")
        return str(folder)
    return obj


METHOD_KEYS = ("drafter", "graft", "schedule", "hf", "llamacpp", "default_budget", "max_budget", "chimeric", "hooks",
               "about")


# the HF generate arguments peers._runner sets per prompt (an hf peer's own may not repeat them)
HF_RUN_ARGS = ("max_new_tokens", "attention_mask", "do_sample", "temperature", "top_k", "top_p", "streamer", "inputs")


def check_spec(name: str, spec: dict) -> None:
    """ConfigError for a method key nobody reads (a misspelt "graft" ran the method without Graft), a default
    budget that is no int >= 1 (1.5 was truncated to 1, "8" failed deep in int()), or a drafter of no usable type."""
    unknown = sorted(set(spec) - set(METHOD_KEYS))
    if unknown:
        raise ConfigError(f"method {name!r} has unknown keys {unknown}; a method takes {', '.join(METHOD_KEYS)}")
    drafter = spec.get("drafter")
    # else Drafter.from_config refuses it only after the target loaded (and "" or 0 ran as AR, being falsy)
    if drafter is not None and (not isinstance(drafter, (dict, str, Path)) or drafter == ""):
        raise ConfigError(f"method {name!r}: drafter must be a drafter config (a mapping with 'type'), a bundled "
                          f"drafter's name, a checkpoint folder or a config file, or left out for none; got "
                          f"{drafter!r}")
    hf = spec.get("hf")
    if hf is not None and (not isinstance(hf, dict) or set(hf) & set(HF_RUN_ARGS)):
        # the harness sets these per prompt: a clash was a bare TypeError at the first prompt, or silently overridden
        raise ConfigError(f"method {name!r}: hf must be a mapping of extra HF generate arguments (e.g. "
                          f"{{\"prompt_lookup_num_tokens\": 10}}) without {', '.join(HF_RUN_ARGS)}, which the run sets "
                          f"(--max-new-tokens, --temperature, ...); got {hf!r}")
    for key, shape in (("graft", "Graft's settings, e.g. {\"mode\": \"tail\"}"),
                       ("schedule", "the schedule's settings, e.g. {\"stop\": \"best\"}, or true for the defaults")):
        value = spec.get(key)  # a truthy string or list read as "on", or died in dict()
        if value not in (None, False) and not isinstance(value, dict) and not (key == "schedule" and value is True):
            raise ConfigError(f"method {name!r}: {key} must be a mapping ({shape}), or left out for none; got "
                              f"{value!r}")
    for key, what in (("default_budget", "its budget without --budget"), ("max_budget", "the most it takes")):
        value = spec.get(key, 10)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"method {name!r}: {key} must be an int >= 1 ({what}), got {value!r}")
    if spec.get("default_budget", 10) > spec.get("max_budget", float("inf")):
        raise ConfigError(f"method {name!r}: default_budget {spec.get('default_budget', 10)} is above its max_budget "
                          f"{spec['max_budget']}: lower it to the cap at most")


def budget_for(spec: dict, budget: int | None) -> int | None:
    """The budget a method runs at for the run's ``budget``: capped at its ``max_budget`` (a chain: its block's
    drafting rows), None = its default."""
    cap = spec.get("max_budget")
    return budget if budget is None or cap is None else min(int(budget), cap)


def prepare(name: str, spec: dict, budget: int | None) -> dict:
    """A preset ready to build: budget filled (the run's or the preset's default), bundled folders resolved."""
    check_spec(name, spec)
    spec = copy.deepcopy(spec)
    spec.pop("about", None)
    budget = budget_for(spec, budget)
    spec.pop("max_budget", None)
    default = spec.pop("default_budget", 10)
    return resolve_bundled(fill_budget(spec, default if budget is None else budget), name)


def method_rows(extra: dict | None = None) -> list[dict]:
    """One row per method for --list-methods: name, drafter, graft mode, default budget, checkpoint status, suites.
    Reads only the table and the checkpoint folders: no model is loaded."""
    from graft_block.drafter import bundled_checkpoint

    rows = []
    for name, spec in {**PRESETS, **(extra or {})}.items():
        d = spec.get("drafter")
        if spec.get("hf") is not None:
            drafter = "HF generate" + (" + prompt lookup" if "prompt_lookup_num_tokens" in spec["hf"] else "")
        elif spec.get("llamacpp") is not None:
            from .llamacpp import describe

            drafter = describe(spec["llamacpp"])
        elif d is None:
            drafter = "none (AR)"
        elif isinstance(d, dict):
            drafter = d.get("type", "?") + (f" {d['proposal']}" if "proposal" in d else "")
        else:
            drafter = str(d)
        refs = bundled_refs(spec)
        if refs:
            found = {r: bundled_checkpoint(r) for r in refs}
            ckpt = ", ".join(f"{r}: {'found' if f else 'MISSING'}" for r, f in found.items())
        elif isinstance(d, dict) and d.get("checkpoint"):
            ckpt = str(d["checkpoint"])
        elif (spec.get("llamacpp") or {}).get("draft"):
            dname = spec["llamacpp"]["draft"]
            ckpt = f"{dname}: {'found' if bundled_checkpoint(dname) else 'MISSING'} (as GGUF)"
        else:
            ckpt = "-"
        budget = spec.get("default_budget", 10) if takes_budget(spec) else _fixed_budget(d)
        rows.append({"name": name, "drafter": drafter, "graft": (spec.get("graft") or {}).get("mode", "-"),
                     "budget": budget, "checkpoint": ckpt,
                     "suites": ",".join(s for s, v in SUITES.items() if name in v["methods"]) or "-",
                     "about": spec.get("about", "")})
    return rows


def _fixed_budget(d) -> str:
    if isinstance(d, dict) and isinstance(d.get("budget"), int):
        return str(d["budget"])
    return "-" if d is None else "drafter's"


def format_methods(rows: list[dict]) -> str:
    lines = ["| method | drafter | graft | default budget | checkpoint | suites | what |", "|" + "---|" * 7]
    for r in rows:
        lines.append(f"| {r['name']} | {r['drafter']} | {r['graft']} | {r['budget']} | {r['checkpoint']} | "
                     f"{r['suites']} | {r['about']} |")
    return "\n".join(lines)
