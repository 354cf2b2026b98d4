"""Calibration of Graft's pruning thresholds by measurement on ShareGPT *calibration* prompts, and its CLI
(``python -m graft_block.calibrate --drafter dflash-smollm2 --save config.json``). Scoring lives in ``pruning``."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Sequence

import torch

from .adjacency import AdjacencyMatrix
from .decoder import SpeculativeDecoder
from .drafter import Drafter
from .errors import ConfigError, check_options, run_command
from .graft import Graft
from .pruning import CHECKPOINTS, SIGNALS
from .target import load_target


def _prompt_messages(rec, target):
    text = rec["turns"][0] if isinstance(rec, dict) else rec
    if isinstance(text, str) and target.tokenizer is not None:
        return [{"role": "user", "content": text}]
    return text


def _restore_matrix(matrix, start) -> None:
    if matrix is not None:
        matrix.table.copy_(start[0])
        matrix.updates = start[1]


def calibrate(target, drafter, matrix=None, prompts=None, n_prompts: int = 5, max_new_tokens: int = 64,
              quantiles: Sequence[float] = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5), kind: str = "mass",
              checkpoints: Sequence[int] = CHECKPOINTS, graft_kwargs: dict | None = None) -> dict:
    """Pick per-checkpoint thresholds by measurement on ShareGPT *calibration* prompts (never evaluation sets).

    1. Run the drafter with a non-pruning Graft and record every round's signal at each checkpoint.
    2. For each quantile q of the grid, threshold_d = q-quantile of the recorded signals at checkpoint d (so
       roughly a fraction q of rounds fire at each stage; q = 0 never fires = no pruning), decode the same
       prompts with Graft and measure decode tokens/s. Every pass starts from ``matrix`` as given, which is left
       as it was.
    3. Keep the q with the best tokens/s (ties: higher tau). Returns a JSON-able dict for the drafter config.
    """
    if prompts is None:
        from .data import sharegpt

        prompts = sharegpt("calibration", limit=n_prompts)
    prompts = list(prompts)[:n_prompts]
    if not prompts:
        raise ConfigError("calibration needs at least one prompt")
    kw = dict(graft_kwargs or {})
    kw.setdefault("budget", int(drafter.budget))
    # a matrix that learnt earlier passes over these same prompts would favour whichever quantile runs last
    start = None if matrix is None else (matrix.table.clone(), matrix.updates)
    never = {int(c): float("-inf") for c in checkpoints}
    recorder = Graft(matrix=matrix, mode="graft", checkpoints=checkpoints, thresholds=never, signal=kind,
                     record_signals=True, **kw)
    dec = SpeculativeDecoder(target, drafter, recorder)
    for rec in prompts:
        dec.generate(_prompt_messages(rec, target), max_new_tokens=max_new_tokens)
    recorded = {c: torch.tensor(v, dtype=torch.float64) for c, v in recorder.signal_log.items()}
    grid = []
    for q in quantiles:
        if not 0.0 <= q < 1.0:
            raise ConfigError(f"quantiles must lie in [0, 1), got {q}")
        thr = {}
        for c, vals in recorded.items():
            finite = vals[torch.isfinite(vals)]
            if q == 0.0 or finite.numel() == 0:
                thr[c] = float("-inf")  # never fires: nothing is below -inf
            else:
                thr[c] = float(torch.quantile(finite, q))
        _restore_matrix(matrix, start)
        g = Graft(matrix=matrix, mode="graft", checkpoints=checkpoints, thresholds=thr, signal=kind, **kw)
        dec = SpeculativeDecoder(target, drafter, g)
        committed, secs, rounds = 0, 0.0, 0
        for rec in prompts:
            res = dec.generate(_prompt_messages(rec, target), max_new_tokens=max_new_tokens)
            committed += res.stats.committed_in_rounds
            secs += res.stats.decode_s
            rounds += res.stats.rounds
        grid.append({"quantile": float(q), "thresholds": {str(c): v for c, v in thr.items()},
                     "tok_s": committed / secs if secs > 0 else 0.0, "tau": committed / max(rounds, 1),
                     "stages": {str(k): v for k, v in g.stats["stage_counts"].items()}})
    _restore_matrix(matrix, start)
    best = max(grid, key=lambda r: (r["tok_s"], r["tau"]))
    return {"signal": kind, "checkpoints": [int(c) for c in checkpoints], "thresholds": best["thresholds"],
            "quantile": best["quantile"], "rule": "argmax measured decode tok/s over per-checkpoint signal quantiles",
            "prompts": len(prompts), "prompt_source": "sharegpt/calibration", "max_new_tokens": max_new_tokens,
            "grid": grid}


def saved_config(config_path: str | Path) -> dict:
    """The JSON object ``--save`` will add its ``"graft"`` key to ({} for a new file), or a ConfigError naming what
    is wrong; read before calibrating, so a bad path costs no calibration run."""
    path = Path(config_path)
    if not path.parent.is_dir():
        raise ConfigError(f"--save {path}: folder {path.parent} does not exist; create it or save elsewhere")
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--save {path} exists but is not readable JSON ({exc}): repair it or save elsewhere") \
            from exc
    if not isinstance(data, dict):
        raise ConfigError(f"--save {path} holds a JSON {type(data).__name__}, not a config object: save elsewhere")
    return data


def save_calibration(config_path: str | Path, calibration: dict) -> None:
    """Store the calibration under the ``"graft"`` key of a drafter config.json (other keys untouched)."""
    path = Path(config_path)
    data = saved_config(path)
    data["graft"] = {k: calibration[k] for k in ("signal", "checkpoints", "thresholds", "quantile", "rule")}
    path.write_text(json.dumps(data, indent=2) + "\n")


def main(argv=None):
    """CLI: calibrate Graft thresholds for a drafter and store them in its config.json."""
    import argparse

    ap = argparse.ArgumentParser(description="Calibrate Graft pruning thresholds on ShareGPT calibration prompts")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", required=True, help="drafter short name, config file or checkpoint folder")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--signal", default="mass", choices=SIGNALS)
    ap.add_argument("--quantiles", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.2, 0.3, 0.5])
    ap.add_argument("--warmup-rounds", type=int, default=5, help="adjacency warm-up rounds before calibrating")
    ap.add_argument("--save", help="config.json to store the thresholds in (under the 'graft' key); in the drafter "
                    "checkpoint's own config.json, a Graft built for that drafter applies them")
    args = ap.parse_args(argv)
    # named now, not after the target, the drafter, the warm-up and the recording pass (or under internal names)
    check_options(ap, args, (("--prompts", args.prompts >= 1, ">= 1"),
                             ("--max-new-tokens", args.max_new_tokens >= 1, ">= 1"),
                             ("--warmup-rounds", args.warmup_rounds >= 0, ">= 0"),
                             ("--quantiles", all(0 <= q < 1 for q in args.quantiles), "fractions in [0, 1)")))
    if args.save:
        saved_config(args.save)
    target = load_target(args.target, device=args.device)
    drafter = Drafter.from_config(args.drafter, target=target)
    matrix = AdjacencyMatrix(target.vocab_size, device=target.device)
    matrix.warmup(target, rounds=args.warmup_rounds)
    cal = calibrate(target, drafter, matrix, n_prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                    quantiles=args.quantiles, kind=args.signal)
    print(json.dumps({k: v for k, v in cal.items() if k != "grid"}, indent=2))
    for row in cal["grid"]:
        print(f"q={row['quantile']:.2f} tok/s={row['tok_s']:.1f} tau={row['tau']:.2f} stages={row['stages']}")
    if args.save:
        save_calibration(args.save, cal)


if __name__ == "__main__":
    sys.exit(run_command(main, "python -m graft_block.calibrate"))
