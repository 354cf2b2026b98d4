"""Calibrate a DSpark checkpoint on held-out data, one temperature per draft position, written into its config.json:
- the confidence head (sequential temperature scaling): ``dflash_config.confidence_temperatures``;
- the draft distributions a tree ranks nodes by (``dflash_config.draft_temperatures``): per position, the
  temperature minimising the NLL of the target's token under the drafter's own candidate distribution (the top-C
  backbone tokens, Markov-corrected, their share of the mass kept). DeepSpec's L1 loss is no proper scoring rule,
  and the corrected rows come out overconfident, which sends a best-first tree too deep;
- the same against the target's *samples* (``dflash_config.sampled_draft_temperatures``, the expected NLL under
  its softmax at ``--sampled-at``, default 1): what a tree drafted for a sampling target ranks by. A sampled
  target leaves the argmax often, so these are flatter (a greedy fit at depth 1 sharpens, and a sampled tree
  built on it spends its nodes too deep).

Greedy, teacher-forced and without decoding: for every anchor of the held-out sequences the chain's draft j is
accepted when the Markov-corrected argmax equals the target's token, and position j counts only when every
earlier draft was accepted (teacher forcing feeds the true previous tokens, which are the drafts while they are
right). Half of the held-out sequences fit the temperatures, the other half (less any sequence sharing an answer
or prompt with the first) reports the calibration error before and after (ECE of the conditional confidences,
and of the survival products against realised prefixes). Training resets these temperatures to 1 and marks the
folder's config.json (``"calibration": {"needed": true, ...}``); writing them here removes that mark:

    python -m graft_block.drafters.dspark.calibrate drafters/checkpoints/dspark-smollm2 --data onpolicy-greedy-a \
        --holdout 32
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from graft_block.engine import set_threads
from graft_block.errors import ConfigError, check_options, run_command
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


TEMP_GRID = tuple(round(1.05 ** i, 4) for i in range(-14, 34))  # 0.51 .. 5.25 in 5% steps, 1.0 included


@torch.no_grad()
def draft_nll_table(model, target, recs, candidates: int = 64, batch_size: int = 4, anchors: int = 64,
                    seed: int = 0, grid=TEMP_GRID, chunk: int = 256,
                    sampled: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed NLL [K, len(grid)], rows [K]): per draft position, the NLL of the target's token under the tempered
    candidate distribution log_softmax(z_C / T) (z = backbone logits + Markov bias, C = the backbone's top
    ``candidates``), over the rows whose token is a candidate (the others add a constant in T). ``sampled`` > 0:
    the token is the target's sample at that temperature instead of its greedy one, so each candidate is weighted
    by the target's probability (its full softmax, one target forward per batch) and ``rows`` counts that mass;
    z is read at 1/``sampled`` first, as a tree drafted for that target reads it."""
    from graft_block.train_data import collate

    model.eval()
    g = torch.Generator().manual_seed(seed)
    K = model.num_drafts
    nll = torch.zeros(K, len(grid), dtype=torch.float64)
    rows = torch.zeros(K, dtype=torch.float64)
    for i in range(0, len(recs), batch_size):
        batch = collate(recs[i: i + batch_size], target.device)
        batch["generator"] = g
        blk = D.make_blocks(model, batch, anchors, unique=True)
        ok = blk["anchor_ok"]
        h = D.draft_rows(model, target, batch, blk)[ok]  # [N, L, H]
        L = h.shape[1]
        prev, j = blk["prev"][ok], blk["draft_index"][ok]
        lat = None if model.markov_head is None else model.markov_latents(prev, h, j)  # whole blocks (an RNN)
        flat = [t.reshape(-1, *t.shape[2:]) for t in (h, prev, j, blk["labels"][ok], blk["valid"][ok],
                                                      blk["src"][ok])]
        lat = None if lat is None else lat.reshape(-1, lat.shape[-1])
        pos = torch.arange(L, device=h.device).repeat(h.shape[0])
        full = None
        if sampled > 0:  # the target's next-token logits at every data row (padding rows are never a label's)
            full = target.model(input_ids=batch["ids"]).logits.flatten(0, 1)
        for c in range(0, flat[0].shape[0], chunk):
            hh, prev, j, lab, valid, src = (t[c: c + chunk] for t in flat)
            base = model.logits(hh, *D.lm_head(target)).float()
            cols = base.topk(min(candidates, base.shape[-1]), dim=-1).indices  # ranked by the backbone, as drafting
            z = draft_logits(model, target, hh, prev, j, base=base,
                             latent=None if lat is None else lat[c: c + chunk]).float().gather(-1, cols)
            if sampled > 0:  # as a sampling tree reads them (dspark.drafter): the temperature fits on top of 1/T
                z = z / sampled
            if full is None:
                hit = ((model.to_vocab_ids(cols) == lab.unsqueeze(-1)) & valid.unsqueeze(-1)).double()
            else:
                lp = torch.log_softmax(full[src].float() / sampled, -1)
                hit = lp.gather(-1, model.to_vocab_ids(cols)).exp().double() * valid.unsqueeze(-1)
            keep = hit.sum(-1) > 0
            if not bool(keep.any()):
                continue
            z, hit, p = z[keep], hit[keep], pos[c: c + chunk][keep]
            rows.index_add_(0, p.cpu(), hit.sum(-1).cpu())
            for gi, t in enumerate(grid):
                ll = (torch.log_softmax(z / t, -1).double() * hit).sum(-1)
                nll[:, gi].index_add_(0, p.cpu(), -ll.cpu())
    return nll, rows


def fit_draft_temperatures(nll: torch.Tensor, rows: torch.Tensor, grid=TEMP_GRID, min_rows: int = 30) -> list[float]:
    """Per position the grid temperature of least NLL; a position with fewer than ``min_rows`` rows keeps the
    previous position's (1.0 at the first)."""
    out: list[float] = []
    for k in range(nll.shape[0]):
        out.append(float(grid[int(nll[k].argmin())]) if int(rows[k]) >= max(1, min_rows) else
                   (out[-1] if out else 1.0))
    return out


def calibration_report(logits, accepted, valid, exists, temps) -> dict:
    """ECE of the conditional confidences and of the survival products, before and after ``temps``."""
    raw, cal = torch.sigmoid(logits.double()), apply_temperatures(logits, temps)
    return {"ece_before": expected_calibration_error(raw, accepted, valid=valid),
            "ece_after": expected_calibration_error(cal, accepted, valid=valid),
            "prefix_ece_before": prefix_ece(raw, accepted, exists),
            "prefix_ece_after": prefix_ece(cal, accepted, exists),
            "rows": int(logits.shape[0])}


def fitted_draft_temperatures(model, target, fit, test, min_rows: int, sampled: float = 0.0):
    """(per-position temperatures fitted on ``fit``, fit rows per position, NLL per row on ``test`` [K, grid])
    against the target's greedy tokens (``sampled`` 0) or its samples at ``sampled``."""
    nll, n = draft_nll_table(model, target, fit, sampled=sampled)
    test_nll, test_n = draft_nll_table(model, target, test, sampled=sampled)
    return fit_draft_temperatures(nll, n, min_rows=min_rows), n, test_nll / test_n.clamp(min=1e-9).unsqueeze(-1)


def calibrate(folder: str | Path, data: str, holdout: int = 32, target=None, write: bool = True,
              min_rows: int = 30, sampled_at: float = 1.0) -> dict:
    from graft_block.target import load_target
    from graft_block.train_data import load_records
    from graft_block.training import split_holdout, without_overlap

    from .checkpoint import load_checkpoint

    model = load_checkpoint(folder, device="cpu" if target is None else target.device, dtype=torch.float32)
    model.train_opts = {"num_anchors": 64, "unique_anchors": True}
    recs, _ = load_records(data, model.feature_layers)
    target = target or load_target("smollm2-135m")  # once the checkpoint and the data are found
    held, _ = split_holdout(recs, holdout)
    # a report sequence repeating a fit one's answer or prompt would score the fit on its own rows
    fit, test = held[0::2], without_overlap(held[1::2], held[0::2])
    if not test:
        raise ConfigError(f"each of the report half's {len(held[1::2])} held-out sequences repeats an answer or "
                          "prompt of the fit half: raise --holdout")
    def at(per_row, temps):  # test NLL per row at each position's temperature
        return [round(float(per_row[k, TEMP_GRID.index(t)]), 4) for k, t in enumerate(temps)]

    draft_temps, n, per_row = fitted_draft_temperatures(model, target, fit, test, min_rows)
    rep = {"draft_temperatures": draft_temps, "draft_fit_rows": n.tolist(),
           "draft_nll_before": at(per_row, [1.0] * len(draft_temps)), "draft_nll_after": at(per_row, draft_temps)}
    if sampled_at > 0:
        sampled_temps, _, per_row = fitted_draft_temperatures(model, target, fit, test, min_rows, sampled_at)
        rep.update({"sampled_at": sampled_at, "sampled_draft_temperatures": sampled_temps,
                    "sampled_nll_greedy_fit": at(per_row, draft_temps),
                    "sampled_nll_after": at(per_row, sampled_temps)})
    if model.confidence_head is not None:
        tf = acceptance_table(model, target, fit)
        temps = calibrate_temperatures(tf[0], tf[1], tf[2], min_rows=min_rows).float()
        rep.update({"temperatures": [round(float(t), 4) for t in temps], "fit_rows": int(tf[0].shape[0]),
                    "fit_rows_per_position": tf[2].sum(0).tolist(),
                    **calibration_report(*acceptance_table(model, target, test), temps)})
    if write:
        path = Path(folder) / "config.json"
        cfg = json.loads(path.read_text())
        dcfg = cfg.setdefault("dflash_config", {})
        dcfg["draft_temperatures"] = rep["draft_temperatures"]
        if "sampled_draft_temperatures" in rep:
            dcfg["sampled_draft_temperatures"] = rep["sampled_draft_temperatures"]
        if "temperatures" in rep:
            dcfg["confidence_temperatures"] = rep["temperatures"]
        cfg.pop("calibration", None)  # training's "calibration needed" note: these fits are for the current weights
        path.write_text(json.dumps(cfg, indent=2) + "\n")
    return rep


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--data", required=True, help="feature cache (the checkpoint's training data)")
    ap.add_argument("--holdout", type=int, default=32, help="held-out sequences, as in the training run")
    ap.add_argument("--min-rows", type=int, default=30,
                    help="positions reached by fewer held-out rows keep the previous position's temperature")
    ap.add_argument("--sampled-at", type=float, default=1.0,
                    help="also fit the draft temperatures to the target's samples at this temperature (0 = skip)")
    ap.add_argument("--dry-run", action="store_true", help="report only, leave config.json untouched")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    check_options(ap, args, (("--holdout", args.holdout >= 2, ">= 2 (half fits, half reports)"),
                             ("--min-rows", args.min_rows >= 1, ">= 1"),
                             ("--sampled-at", args.sampled_at >= 0, ">= 0")))
    set_threads(args.threads)
    rep = calibrate(args.folder, args.data, args.holdout, write=not args.dry_run, min_rows=args.min_rows,
                    sampled_at=args.sampled_at)
    print(json.dumps(rep, indent=1))


if __name__ == "__main__":
    sys.exit(run_command(main, "python -m graft_block.drafters.dspark.calibrate"))
