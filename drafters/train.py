"""Train a drafter on target-regenerated data: ``python -m graft_block.drafters.train --type dflash ...``.

Two steps, both resumable: ``--generate`` caches target answers (greedy, or ``--temperature/--top-p/--top-k
--samples`` sampled ones) to ShareGPT train prompts with features and
top-k soft labels (graft_block.train_data.generate_data); then training runs the drafter's ``training_model`` /
``training_loss`` through the shared loop and writes its public checkpoint to ``--out``. Works under torchrun.

From the committed on-policy ids (features recomputed by one teacher-forced forward, cached under the user
cache dir), then training resumed from a bundled checkpoint:
    python -m graft_block.drafters.train --generate --from-onpolicy drafters/data/smollm2-sharegpt --data onpolicy-v1
    python -m graft_block.drafters.train --type dflash --data onpolicy-v1 --init drafters/checkpoints/dflash-smollm2 ...
or in one step, the features recomputed inside every training step (no cache; see TRAINING.md for which is faster):
    python -m graft_block.drafters.train --type dflash --online --data drafters/data/smollm2-sharegpt ...

Held-out figures read a split of --data (--holdout N) or, with --eval-data CACHE, a separate feature cache; the
bundled drafters trained on the committed greedy answers, so compare them on drafters/data/smollm2-sharegpt-heldout
(prompts none of them saw; its README has the two commands). --steps 0 only evaluates --init.

DFlash, DSpark and MFD share one block recipe; its keys go in --config: num_anchors, unique_anchors, anchor_chunk,
eval_anchors, gamma, ce_weight, soft_weight, l1_weight, fill_rate (defaults and measurements: docs/training.md, "The
block recipe").

DSpark from the DFlash backbone (DeepSpec's loss, 64 anchors per sequence drawn without replacement; see
drafters/checkpoints/dspark-smollm2/TRAINING.md), then its confidence calibration:
    python -m graft_block.drafters.train --type dspark --data onpolicy-greedy-a \\
        --init drafters/checkpoints/dflash-smollm2 \\
        --config '{"num_anchors": 64, "markov_rank": 64}' --steps 440 --warmup 0.1 --lr 2e-4 --batch-size 2 --holdout 32
    python -m graft_block.drafters.dspark.calibrate OUT --data onpolicy-greedy-a --holdout 32
Training leaves a DSpark folder uncalibrated (a continued one's temperatures reset to 1; its config.json's
"calibration" entry says so) until calibrate runs.

Example (the bundled default, on 2 CPU cores; see drafters/checkpoints/dflash-smollm2/TRAINING.md):
    python -m graft_block.drafters.train --generate --data smollm2-sharegpt --num-prompts 4000 --max-new 160 \\
        --gen-batch 48 --gen-minutes 13
    python -m graft_block.drafters.train --generate --teacher-forced --data smollm2-sharegpt-tf --num-prompts 3000 \\
        --max-len 384 --gen-batch 8 --gen-minutes 6.7
    python -m graft_block.drafters.train --type dflash --data smollm2-sharegpt,smollm2-sharegpt-tf --init target \\
        --config '{"num_layers": 3, "target_layer_ids": [1, 14, 26], "mask_token_id": 16, "num_anchors": 24}' \\
        --draft-vocab 16384 --epochs 6 --lr 6e-4 --batch-size 4 --holdout 8 --eval-every 40 --minutes 26 \\
        --out drafters/checkpoints/dflash-smollm2 --run runs/dflash-smollm2
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from graft_block.errors import check_options, run_command
from graft_block.sampling import sampling_options


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None,
                    help="target dtype: default float32 on a CPU, bfloat16 on a GPU; float32 there trains on the "
                         "features the CPU runs see")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data", default="smollm2-sharegpt", help="data name under .cache/train-data or a folder")
    ap.add_argument("--generate", action="store_true", help="(re)generate/extend the data cache, then exit")
    ap.add_argument("--teacher-forced", action="store_true",
                    help="with --generate: cheap data = target distributions over ShareGPT reference replies")
    ap.add_argument("--from-onpolicy", default=None, metavar="FOLDER",
                    help="with --generate: recompute features and soft labels for a committed on-policy dataset "
                         "(e.g. drafters/data/smollm2-sharegpt; graft_block.onpolicy makes and extends it)")
    ap.add_argument("--kinds", default=None,
                    help="--from-onpolicy / --online: shard kinds to use (e.g. greedy), default all")
    ap.add_argument("--where", default=None, metavar="REGEX",
                    help="train only on sequences whose prompt matches this regular expression (a topic slice)")
    ap.add_argument("--from-index", type=int, default=0,
                    help="--from-onpolicy: only prompts from this index on (features for newly added shards)")
    ap.add_argument("--max-len", type=int, default=384, help="--teacher-forced: tokens per conversation")
    ap.add_argument("--num-prompts", type=int, default=4000)
    ap.add_argument("--gen-minutes", type=float, default=None)
    ap.add_argument("--gen-shards", type=int, default=None, help="with --generate: stop after the first N batches")
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--gen-batch", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0, help="with --generate: 0 = greedy answers")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--samples", type=int, default=1, help="with --generate and T > 0: answers per prompt")
    ap.add_argument("--layers", default=None, help="HF hidden_states indices to cache (default 2,N//2,N-3)")
    ap.add_argument("--type", default="dflash")
    ap.add_argument("--config", default="{}", help="JSON dict of drafter training options (e.g. num_layers)")
    ap.add_argument("--init", default=None, help="random | target | <checkpoint folder>")
    ap.add_argument("--out", default=None, help="public checkpoint folder")
    ap.add_argument("--run", default=None, help="run folder (state.pt, log.jsonl)")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=None, help="optimiser steps (overrides --epochs); 0 only "
                    "evaluates --init on the held-out data")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=float, default=0.04)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--holdout", type=int, default=24)
    ap.add_argument("--eval-data", default=None, metavar="CACHE",
                    help="held-out feature cache replacing --holdout (e.g. one built --from-onpolicy "
                         "drafters/data/smollm2-sharegpt-heldout, prompts no bundled drafter trained on)")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--minutes", type=float, default=None, help="training wall-clock limit")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="restrict the draft softmax to the data's N most frequent ids; with --init, add them to "
                         "the checkpoint's draft vocabulary (its ids stay; new EAGLE3 LM-head rows start from the "
                         "target's, mapped onto the trained rows)")
    ap.add_argument("--limit", type=int, default=None, help="use at most N cached sequences")
    ap.add_argument("--seed", type=int, default=0,
                    help="every random draw of the run: data order, anchors and the drafter's initialisation (new "
                         "layers, DSpark's heads, MFD's mode vectors, EAGLE3's warm-start noise); a \"seed\" in "
                         "--config takes precedence for the initialisation only (--generate: the sampled answers)")
    ap.add_argument("--keep-best", action="store_true",
                    help="also keep the best held-out tau_tf weights so far in <--out>-best (with best_step.json)")
    ap.add_argument("--online", action="store_true",
                    help="--data names on-policy dataset folders (comma-separated); features and soft labels come "
                         "from a target forward in every step instead of a cache (no --generate step)")
    ap.add_argument("--autocast", default=None, choices=("bfloat16",),
                    help="run each step's forwards under torch.autocast in this dtype (float32 weights and "
                         "optimiser); on a CPU with AMX, bfloat16 steps ran 1.4-1.8x faster (docs/training.md)")
    args = ap.parse_args(argv)
    try:  # every bad option fails here, before the target loads
        cfg = json.loads(args.config)
    except json.JSONDecodeError as exc:
        ap.error(f"--config must be a JSON object of training options, e.g. '{{\"num_anchors\": 24}}' ({exc})")
    if not isinstance(cfg, dict):
        ap.error(f"--config must be a JSON object of training options, got {args.config!r}")
    sampling = sampling_options([args.temperature], args.top_k, args.top_p)[0]  # --generate's, checked before loading
    check_options(ap, args, (("--steps", args.steps is None or args.steps >= 0, ">= 0 (0 only evaluates)"),
                             ("--lr", args.lr > 0, "> 0"), ("--batch-size", args.batch_size >= 1, ">= 1"),
                             ("--epochs", args.epochs > 0, "> 0"), ("--warmup", 0 <= args.warmup < 1, "in [0, 1)"),
                             ("--eval-every", args.eval_every >= 1, ">= 1"),
                             ("--minutes", args.minutes is None or args.minutes > 0, "> 0"),
                             ("--threads", args.threads >= 1, ">= 1"),
                             # each of these was taken silently (0 = all prompts, -1 = all shards but one, ...)
                             ("--gen-batch", args.gen_batch >= 1, ">= 1"), ("--holdout", args.holdout >= 0, ">= 0"),
                             ("--num-prompts", args.num_prompts >= 1, ">= 1"),
                             ("--gen-shards", args.gen_shards is None or args.gen_shards >= 1, ">= 1"),
                             ("--limit", args.limit is None or args.limit >= 1, ">= 1"),
                             ("--draft-vocab", args.draft_vocab is None or args.draft_vocab >= 1, ">= 1")))
    try:
        layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    except ValueError:
        layers = [-1]
    if layers is not None and min(layers) < 0:
        ap.error(f"--layers takes comma-separated HF hidden_states indices (ints >= 0), got {args.layers!r}")
    if args.generate and args.autocast and not args.from_onpolicy:
        ap.error("--autocast with --generate applies to --from-onpolicy caches only (generation stays in the "
                 "target's dtype)")
    if not args.generate:
        if not args.out or not args.run:
            ap.error("--out and --run are required for training")
        from graft_block.drafter import drafter_class

        from graft_block.training import check_training_keys

        check_training_keys(drafter_class(args.type), args.type, cfg)  # an unknown type or key, before the load

    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from graft_block.target import load_target
    from graft_block.train_data import generate_data
    from graft_block.training import train

    target = load_target(args.target, device=args.device, dtype=args.dtype)
    gen_limit = None if args.gen_minutes is None else args.gen_minutes * 60
    if args.generate and args.from_onpolicy:
        from graft_block.onpolicy import training_cache

        training_cache(target, args.from_onpolicy, args.data, args.kinds.split(",") if args.kinds else None,
                       batch_size=args.gen_batch, layers=layers, time_limit_s=gen_limit,
                       log=lambda s: print(s, flush=True), from_index=args.from_index, autocast=args.autocast)
        return
    if args.generate and args.teacher_forced:
        from graft_block.train_data import teacher_forced_data

        teacher_forced_data(target, args.data, num_convs=args.num_prompts, max_len=args.max_len,
                            batch_size=args.gen_batch, layers=layers, time_limit_s=gen_limit,
                            log=lambda s: print(s, flush=True))
        return
    if args.generate:
        generate_data(target, args.data, num_prompts=args.num_prompts, max_new=args.max_new,
                      batch_size=args.gen_batch, layers=layers, time_limit_s=gen_limit,
                      log=lambda s: print(s, flush=True),
                      sampling=sampling, samples=args.samples,
                      seed=args.seed, max_shards=args.gen_shards)
        return
    res = train(args.type, target, args.data, args.out, args.run, cfg=cfg, init=args.init,
                epochs=args.epochs, lr=args.lr, warmup=args.warmup, batch_size=args.batch_size,
                holdout=args.holdout, eval_every=args.eval_every,
                time_limit_s=None if args.minutes is None else args.minutes * 60, resume=args.resume,
                seed=args.seed, draft_vocab_size=args.draft_vocab, limit=args.limit, steps=args.steps,
                online=args.online, kinds=args.kinds.split(",") if args.kinds else None, eval_data=args.eval_data,
                keep_best=args.keep_best, where=args.where, autocast=args.autocast, log=lambda s: print(s, flush=True))
    print(json.dumps(res))


if __name__ == "__main__":
    sys.exit(run_command(main, "python -m graft_block.drafters.train"))
