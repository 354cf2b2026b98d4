"""Calibrate a DSpark checkpoint's confidence head on held-out data: one temperature per draft position (sequential
temperature scaling), written into its config.json (``dflash_config.confidence_temperatures``).

Greedy, teacher-forced and without decoding: for every anchor of the held-out sequences the chain's draft j is
accepted when the Markov-corrected argmax equals the target's token, and position j counts only when every
earlier draft was accepted (teacher forcing feeds the true previous tokens, which are the drafts while they are
right). Half of the held-out sequences fit the temperatures, the other half reports the calibration error
before and after (ECE of the conditional confidences, and of the survival products against realised prefixes):

    python -m graft_block.drafters.dspark.calibrate drafters/checkpoints/dspark-smollm2 --data onpolicy-greedy-a \
        --holdout 32
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from graft_block.tree.schedule import (apply_temperatures, calibrate_temperatures, expected_calibration_error,
                                       prefix_ece)

from ..dflash import training as D
from .training import draft_logits


@torch.no_grad()
def acceptance_table(model, target, recs, batch_size: int = 4, anchors: int = 64, seed: int = 0):
    """(confidence logits, accepted, valid, exists), each [N, K]: one row per held-out anchor, K draft positions."""
    from graft_block.train_data import collate

    model.eval()
    g = torch.Generator().manual_seed(seed)
    out = {"logits": [], "accepted": [], "exists": []}
    for i in range(0, len(recs), batch_size):
        batch = collate(recs[i: i + batch_size], target.device)
        batch["generator"] = g
        blk = D.make_blocks(model, batch, anchors, unique=True)
        ok = blk["anchor_ok"]
        h = D.draft_rows(model, target, batch, blk)[ok]
        prev, lab, exists = blk["prev"][ok], blk["labels"][ok], blk["valid"][ok]
        z = draft_logits(model, target, h, prev, blk["draft_index"][ok])
        out["accepted"].append(model.to_vocab_ids(z.argmax(-1)) == lab)
        out["logits"].append(model.confidence_logits(h, prev))
        out["exists"].append(exists)
    logits, accepted, exists = (torch.cat(out[k]).cpu() for k in ("logits", "accepted", "exists"))
    accepted &= exists
    valid = exists & torch.cat([torch.ones_like(accepted[:, :1]), accepted[:, :-1].cumprod(1).bool()], 1)
    return logits, accepted, valid, exists


def calibration_report(logits, accepted, valid, exists, temps) -> dict:
    """ECE of the conditional confidences and of the survival products, before and after ``temps``."""
    raw, cal = torch.sigmoid(logits.double()), apply_temperatures(logits, temps)
    return {"ece_before": expected_calibration_error(raw, accepted, valid=valid),
            "ece_after": expected_calibration_error(cal, accepted, valid=valid),
            "prefix_ece_before": prefix_ece(raw, accepted, exists), "prefix_ece_after": prefix_ece(cal, accepted, exists),
            "rows": int(logits.shape[0])}


def calibrate(folder: str | Path, data: str, holdout: int = 32, target=None, write: bool = True,
              min_rows: int = 30) -> dict:
    from graft_block.target import load_target
    from graft_block.train_data import load_records
    from graft_block.training import split_holdout

    from .checkpoint import load_checkpoint

    target = target or load_target("smollm2-135m")
    model = load_checkpoint(folder, device=target.device, dtype=torch.float32)
    if model.confidence_head is None:
        raise SystemExit(f"{folder}: no confidence head to calibrate")
    model.train_opts = {"num_anchors": 64, "unique_anchors": True}
    recs, _ = load_records(data, model.feature_layers)
    held, _ = split_holdout(recs, holdout)
    fit, test = held[0::2], held[1::2]
    tf = acceptance_table(model, target, fit)
    temps = calibrate_temperatures(tf[0], tf[1], tf[2], min_rows=min_rows).float()
    rep = {"temperatures": [round(float(t), 4) for t in temps], "fit_rows": int(tf[0].shape[0]),
           "fit_rows_per_position": tf[2].sum(0).tolist(),
           **calibration_report(*acceptance_table(model, target, test), temps)}
    if write:
        path = Path(folder) / "config.json"
        cfg = json.loads(path.read_text())
        cfg.setdefault("dflash_config", {})["confidence_temperatures"] = rep["temperatures"]
        path.write_text(json.dumps(cfg, indent=2) + "\n")
    return rep


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--data", required=True, help="feature cache (the checkpoint's training data)")
    ap.add_argument("--holdout", type=int, default=32, help="held-out sequences, as in the training run")
    ap.add_argument("--min-rows", type=int, default=30,
                    help="positions reached by fewer held-out rows keep the previous position's temperature")
    ap.add_argument("--dry-run", action="store_true", help="report only, leave config.json untouched")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rep = calibrate(args.folder, args.data, args.holdout, write=not args.dry_run, min_rows=args.min_rows)
    print(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
