"""A preset -> a runnable method: ``Method.run(prompt_ids, max_new_tokens, temperature, seed, top_k=0, top_p=1.0)
-> record`` (top-k / top-p filter the target's law at T > 0, in HF's order: temperature, top-k, top-p).

Every record carries ``decode_tokens`` (tokens emitted after the first forward) and ``decode_s`` (the time after
it), the two numbers every speedup is made of (``measure.speedup``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

from graft_block import Drafter, SpeculativeDecoder
from graft_block.drafter import check_flag, is_count
from graft_block.errors import ConfigError

from . import presets
from .peers import hf_runner


@dataclass
class Method:
    """A named way of decoding. ``run(prompt_ids, max_new_tokens, temperature, seed, top_k=0, top_p=1.0) -> dict``."""

    name: str
    run: Callable[..., dict]
    budget: int | None = None
    config: dict = field(default_factory=dict)
    hooks: list = field(default_factory=list)
    temperatures: tuple | None = None  # the run's temperatures this one decodes (None: all; --budget auto sizes each)


_WARM_MATRIX: dict = {}


def warm_matrix(target, k: int = 8, rounds: int = 5, new_tokens: int = 64):
    """One adjacency-matrix warm-up per run and setting (ShareGPT calibration prompts); each method gets its own
    copy so no method learns from another method's verifications of the same prompt."""
    from graft_block.adjacency import AdjacencyMatrix

    key = (id(target), k, rounds, new_tokens)
    if key not in _WARM_MATRIX:
        m = AdjacencyMatrix(target.vocab_size, k, "int32", target.device)
        if rounds and target.tokenizer is not None:
            m.warmup(target, rounds=rounds, new_tokens=new_tokens)
        _WARM_MATRIX[key] = m
    return copy.deepcopy(_WARM_MATRIX[key])


def make_schedule(scfg, curve: dict | None):
    """A preset's ``"schedule": {"cost": "curve", "min_nodes": 0, "stop": "best", "survival": "drafter",
    "adapt": 8, "fit_cost": true, "size_draft": true}`` -> ConfidenceSchedule on the run's verify-cost curve
    (``"cost"`` may also be a curve dict itself; ``"stop"``: "best", "first_drop" or "threshold" (DeepSpec's cut,
    at ``"threshold"``, default 0.5); ``"survival"``: "drafter" or "scores"; ``"adapt"``: the online
    recalibration's prior, 0 = off; ``"fit_cost"``: refit the curve to the call's rounds; ``"size_draft"``: size
    the next draft from the recent cuts)."""
    from graft_block.schedule import ConfidenceSchedule

    scfg = {"cost": "curve", **(scfg if isinstance(scfg, dict) else {})}
    unknown = set(scfg) - {"cost", "min_nodes", "stop", "survival", "adapt", "fit_cost", "size_draft", "threshold"}
    if unknown:
        raise ConfigError(f"unknown schedule keys {sorted(unknown)}; a schedule takes 'cost' ('curve'), "
                          "'min_nodes', 'stop', 'threshold', 'survival', 'adapt', 'fit_cost' and 'size_draft'")
    cost = scfg["cost"]
    if cost == "curve":
        if not curve:
            raise ConfigError("the confidence schedule needs the harness's verify-cost curve: pass make_method(..., "
                              "curve=measure.verify_cost_curve(target)) (graft-block bench does)")
        cost = curve
    elif not isinstance(cost, dict):
        raise ConfigError(f"schedule cost must be 'curve' (the run's verify-cost curve) or a curve dict "
                          f"{{'median_s': {{nodes: seconds}}}}, got {cost!r}")
    return ConfidenceSchedule(cost, min_nodes=scfg.get("min_nodes", 0), stop=scfg.get("stop", "best"),
                              survival=scfg.get("survival", "drafter"), adapt=scfg.get("adapt", 8.0),
                              fit_cost=scfg.get("fit_cost", True), size_draft=scfg.get("size_draft", True),
                              threshold=scfg.get("threshold", 0.5))


def make_method(name: str, spec: dict, target, budget: int | None, chimeric: bool = False,
                extra_hooks: list | None = None, curve: dict | None = None) -> Method:
    """Build one method from a preset (``presets.PRESETS`` shape). ConfigError when it cannot be built here.
    A preset's ``"hooks"`` (round-hook objects, kept by the caller to read afterwards) join ``extra_hooks``.
    A preset's ``"schedule"`` (``{"cost": "curve", "min_nodes": 0}``) adds confidence-scheduled verification
    on ``curve``, the run's verify-cost curve (``measure.verify_cost_curve``)."""
    spec = dict(spec)
    extra_hooks = list(extra_hooks or []) + list(spec.pop("hooks", None) or [])  # objects: not deep-copied
    spec = presets.prepare(name, spec, budget)
    chimeric = chimeric or check_flag(spec.pop("chimeric", False), f"method {name!r}: chimeric")
    if spec.get("hf") is not None:
        return Method(name, hf_runner(target, spec["hf"]), config=spec)
    if spec.get("llamacpp") is not None:  # llama.cpp peer: ConfigError (a skip) without a build
        from .llamacpp import llamacpp_runner

        return Method(name, llamacpp_runner(target, spec["llamacpp"]), config=spec)
    dcfg = spec.get("drafter")
    if isinstance(dcfg, dict) and dcfg.get("type") in ("recycling", "pld_matrix") and "matrix" not in dcfg \
            and dcfg.get("warmup_rounds", 5) == 5 and is_count(dcfg.get("k", 8), 1) \
            and is_count(dcfg.get("warmup_tokens", 64)):  # the run's shared warm-up; bad counts: the drafter's error
        warm = warm_matrix(target, dcfg.get("k", 8), 5, dcfg.get("warmup_tokens", 64))
        dcfg = {**dcfg, "matrix": warm, "warmup_rounds": 0}
    drafter = Drafter.from_config(dcfg, target=target) if dcfg else None
    graft = None
    if spec.get("graft"):
        from graft_block.graft import Graft, matrix_counts

        gcfg = dict(spec["graft"])
        matrix = None
        if gcfg.get("mode", "graft") != "prune" and "matrix" not in gcfg and getattr(drafter, "matrix", None) is None:
            matrix = warm_matrix(target, *matrix_counts(gcfg))
        graft = Graft.from_config(gcfg, matrix=matrix, target=target, drafter=drafter)
    schedule = make_schedule(spec["schedule"], curve) if spec.get("schedule") else None
    hooks = list(extra_hooks or [])
    if chimeric and drafter is not None:
        from graft_block.chimeric import proxy_hook

        hooks.append(proxy_hook())
    dec = SpeculativeDecoder(target, drafter, graft=graft, round_hooks=hooks, schedule=schedule)
    proxies = [h for h in hooks if hasattr(h, "rows")]

    def run(ids, max_new_tokens, temperature, seed, top_k=0, top_p=1.0):
        for h in proxies:
            h.rows.clear()
        res = dec.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                           seed=seed)
        out = {"tokens": res.tokens, **res.stats.to_dict()}  # analysis hooks' time is hook_s, not decode_s
        if graft is not None and hasattr(graft, "state_bytes"):
            out["retrieval_state_bytes"] = int(graft.state_bytes())
        elif drafter is not None and hasattr(drafter, "state_bytes"):
            out["retrieval_state_bytes"] = int(drafter.state_bytes())
        if graft is not None and hasattr(graft, "summary"):
            out["graft"] = graft.summary()
            if hasattr(graft, "reset_stats"):
                graft.reset_stats()
        if schedule is not None:
            out["schedule"] = schedule.summary()
            schedule.reset_stats()
        for h in proxies:
            chim = h.summary()
            out["chimeric"] = chim
            out["chimeric_share"] = chim["draft"].get("chimeric")
        return out

    return Method(name, run, budget=dec.budget, config=spec, hooks=hooks)


def lookup(name: str, extra: dict) -> dict:
    """The preset called ``name`` (a --config method first); the error names the real choices."""
    spec = extra.get(name) or presets.PRESETS.get(name)
    if spec is None:
        raise ConfigError(f"unknown method {name!r}; presets: {', '.join(presets.PRESETS)}"
                          + (f"; from --config: {', '.join(extra)}" if extra else "")
                          + " (see --list-methods, or add one with --config FILE)")
    return spec


def load_method_files(paths: list[str]) -> dict[str, dict]:
    """--config files: YAML/JSON {name, drafter, graft, ...} or a list of them."""
    import json
    from pathlib import Path

    out = {}
    for p in paths:
        if not Path(p).is_file():
            raise ConfigError(f"method file {p} does not exist (--config takes a YAML or JSON file of methods)")
        text = Path(p).read_text()
        try:
            if str(p).endswith((".yaml", ".yml")):
                import yaml

                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
        except Exception as exc:  # noqa: BLE001 - re-raised with the file named
            raise ConfigError(f"cannot parse method file {p}: {exc}") from exc
        for it in data if isinstance(data, list) else [data]:
            if not isinstance(it, dict) or "name" not in it:
                raise ConfigError(f"{p}: each method needs a 'name' and a 'drafter' (and optional 'graft')")
            if not any(k in it for k in ("drafter", "hf", "llamacpp")):
                raise ConfigError(f"{p}: method {it['name']!r} says nothing to run: give it a 'drafter' (a drafter "
                                  "config, or null for AR), an 'hf' or a 'llamacpp' entry")
            out[it["name"]] = {k: v for k, v in it.items() if k != "name"}
    return out
