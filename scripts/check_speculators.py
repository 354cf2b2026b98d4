"""Does vLLM speculators draft from our exported DFlash / DSpark / EAGLE-3 folders as we draft with them?

Two halves, two interpreters, because speculators pins an older transformers than graft-block:
  reference (graft-block's venv): our drafter's teacher-forced block logits at a few anchors of one real sequence
      (EAGLE-3: its first draft at every position), with the target features they read, saved to one file;
  compare (a venv with speculators): speculators' own model class loads the exported folder and runs its training
      forward on the same features; the logits (and DSpark's confidence logits) it hands its loss are captured and
      compared row by row, through the verifier's fp32 rows and through the folder's own lm_head.
scripts/check_speculators.sh runs both, each half once for every drafter (importing speculators takes most of a
compare). Nothing here imports speculators' code into graft-block.
"""
import argparse
import functools
import inspect
import json
import sys

import torch

TEXT = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"
        "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\nfor i in range(10):\n    print(i, fibonacci(i))\n"
        "The loop prints the first ten Fibonacci numbers, one per line, each after its index.")


@functools.cache
def plain_target(name: str):
    """The embedded target as a plain HF model in fp32 (what speculators' trainer reads features from) and its
    tokenizer, loaded once for every drafter of a run."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from graft_block.target import embedded_folder

    folder = embedded_folder(name)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return AutoTokenizer.from_pretrained(folder), model


def reference(args) -> None:
    from graft_block.drafter import resolve_checkpoint
    from graft_block.drafters.dflash.checkpoint import load_checkpoint as load_dflash, read_config
    from graft_block.drafters.dspark.checkpoint import is_dspark_layout, load_checkpoint as load_dspark
    from graft_block.drafters.eagle3.checkpoint import is_eagle3_config

    folder = resolve_checkpoint(args.drafter)
    raw = read_config(folder)
    tok, target = plain_target(args.target)
    ids = tok(TEXT, return_tensors="pt").input_ids
    if is_eagle3_config(raw):
        return eagle3_reference(args, folder, target, ids)
    dspark = is_dspark_layout(raw)
    model = (load_dspark if dspark else load_dflash)(folder, dtype=torch.float32).eval()
    B = model.block_size
    first_draft_biased = bool(getattr(model, "markov_first_draft", True))
    if dspark:
        model.markov_first_draft = True  # bias every draft, as the runtimes do; ours is that minus draft 0's bias
    with torch.inference_mode():
        hs = target(ids, output_hidden_states=True).hidden_states
        features = torch.cat([hs[i] for i in model.feature_layers], -1)
        embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
        offset = getattr(model, "draft_offset", 1)
        rows = []
        for a in args.anchors:
            if a < 1 or a + B >= ids.shape[1]:  # speculators samples anchors before the last B positions only
                sys.exit(f"anchor {a}: a {B}-token block needs 1 <= anchor < {ids.shape[1] - B} in these "
                         f"{ids.shape[1]} tokens")
            ctx = model.fuse(features[:, :a])
            kv = model.context_kv(ctx, torch.arange(a).view(1, -1))
            block = torch.full((B,), model.mask_token_id)
            block[0] = ids[0, a]
            hidden = model(embed[block], torch.arange(a, a + B), kv)[offset:]
            logits = model.logits(hidden, head).float()
            conf, runtime = None, logits
            if dspark:
                j = torch.arange(hidden.shape[0])
                prev = ids[0, a + j]  # teacher forcing: draft j's previous token is the real one
                if model.markov_head is not None:
                    lat = model.markov_latents(prev.view(1, -1), hidden.unsqueeze(0), j.view(1, -1))[0]
                    runtime = logits + model.markov_project(lat, model.draft_vocab).float()
                    # markov_latents zeroes draft 0's latent after computing it, so only that row differs
                    logits = runtime if first_draft_biased else torch.cat([logits[:1], runtime[1:]])
                c = model.confidence_logits(hidden, prev)
                conf = None if c is None else c.float()
            rows.append({"anchor": a, "hidden": hidden.float(), "logits": logits, "runtime_logits": runtime,
                         "confidence": conf})
    vocab = model.draft_vocab if model.draft_vocab is not None else torch.arange(head.shape[0])
    torch.save({"kind": "dspark" if dspark else "dflash", "input_ids": ids, "features": features, "rows": rows,
                "vocab": vocab, "offset": offset,
                "markov_first_draft": first_draft_biased,
                "drafter": str(folder)}, args.out)
    print(f"reference: {folder} ({'DSpark' if dspark else 'DFlash'}), {ids.shape[1]} tokens, anchors {args.anchors}")


def sig(x) -> float:
    return float(f"{float(x):.3g}")


def eagle3_reference(args, folder, target, ids) -> None:
    """EAGLE-3's first draft at every position (feature t with token t + 1 -> token t + 2), causal as in a
    prefill: the step speculators' trainer runs first."""
    from graft_block.drafters.eagle3.checkpoint import load_head

    head = load_head(folder, dtype=torch.float32).eval()
    layers = [i + 1 for i in head.cfg.aux_layer_ids]
    with torch.inference_mode():
        hs = target(ids, output_hidden_states=True).hidden_states
        features = torch.cat([hs[i] for i in layers], -1)[:, :-1]
        emb = target.get_input_embeddings().weight[ids[0, 1:]].unsqueeze(0)
        g = head.fuse(features)
        out, _, _ = head(emb, g, torch.arange(g.shape[1]).view(1, -1))
        logits = head.logits(out)[0].float()
    torch.save({"kind": "eagle3", "input_ids": ids, "features": features, "logits": logits, "d2t": head.d2t,
                "drafter": str(folder)}, args.out)
    print(f"reference: {folder} (EAGLE-3), {ids.shape[1]} tokens, first draft at every position")


def eagle3_compare(model, ref) -> float:
    ids, feats = ref["input_ids"], ref["features"]
    if not torch.equal(model.d2t.long(), ref["d2t"].long()):
        sys.exit("FAIL: the folder's d2t is not graft-block's draft vocabulary")
    seen = []
    hook = model.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(out))
    with torch.no_grad():
        model(feats, ids[:, 1:], torch.zeros_like(ids[:, 1:]), ttt_steps=1)
    hook.remove()
    diff = finite_max(seen[0][0] - ref["logits"], -1)
    agree = (seen[0][0].argmax(-1) == ref["logits"].argmax(-1)).float().mean()
    print(json.dumps({"class": type(model).__name__, "positions": len(diff), "logits_max_abs_diff": sig(diff.max()),
                      "top1_agree": sig(agree)}))
    return float(diff.max())


def compare(args) -> None:
    from speculators import SpeculatorModel, SpeculatorModelConfig

    ref = torch.load(args.ref)
    cfg = SpeculatorModelConfig.from_pretrained(args.folder)
    if cfg.speculators_config.verifier.name_or_path is None:  # speculators would look it up on the hub
        sys.exit(f"{args.folder} names no verifier, so speculators has no target embeddings to draft with: export it "
                 "with --verifier naming the target's HF folder")
    cfg.transformer_layer_config._attn_implementation = "sdpa"  # flex attention compiles; SDPA's mask is the same
    model = SpeculatorModel.from_pretrained(args.folder, config=cfg).float().eval()
    # again, in fp32 and overwriting: the first load rounded the target's rows to the folder's dtype, and an EAGLE-3
    # folder without embed_tokens comes back from transformers' init of missing keys as zeros, not its NaN sentinel
    model._load_verifier_weights(overwrite_embed_tokens=True, overwrite_lm_head=not model.use_draft_vocab)
    expected = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel", "eagle3": "Eagle3DraftModel"}[ref["kind"]]
    if type(model).__name__ != expected:
        sys.exit(f"--ref {args.ref} is a {ref['kind']} reference, but {args.folder} loads as {type(model).__name__}: "
                 "pass the reference written for this folder's drafter")
    if ref["kind"] == "eagle3":
        return verdict(model, eagle3_compare(model, ref), args.tol)
    ids, feats = ref["input_ids"], ref["features"]
    B = model.block_size
    skip = 0 if model.config.sample_from_anchor else 1  # z-lab's alignment: slot 0 is the anchor's own, no draft
    if ref["offset"] != skip:
        sys.exit(f"FAIL: graft-block drafts from block row {ref['offset']}, the folder's sample_from_anchor "
                 f"({model.config.sample_from_anchor}) from row {skip}: the export wrote the wrong alignment")
    sorted_vocab, order = torch.sort(ref["vocab"])  # speculators' draft columns are in ascending id order
    if model.use_draft_vocab and not torch.equal(model.d2t + torch.arange(len(model.d2t)), sorted_vocab):
        sys.exit("FAIL: the folder's d2t maps its draft columns to other ids than graft-block's draft vocabulary")
    worst, served_worst, report = 0.0, 0.0, []
    for row in ref["rows"]:
        a = row["anchor"]
        # speculators' verifier head is the verifier folder's rows picked by t2d, in fp32: the backbone's exact
        # check; the checkpoint's lm_head (what vLLM reads) holds the same rows rounded to the drafter's dtype
        exact = block_forward(model, feats, ids, a, head=model.verifier_lm_head.weight)
        served = block_forward(model, feats, ids, a)
        n = min(B - skip, len(row["logits"]))
        runtime = row["runtime_logits"][:n, order]  # the runtimes bias every draft: our logits so computed
        diff = finite_max(exact["logits"][skip:skip + n] - runtime, -1)
        served_diff = finite_max(served["logits"][skip:skip + n] - runtime, -1)
        line = {"anchor": a, "hidden_max_abs_diff": sig(finite_max(exact["hidden"][skip:skip + n] - row["hidden"])),
                "logits_max_abs_diff": sig(diff.max()), "served_head_max_abs_diff": sig(served_diff.max()),
                "served_head_top1_agree": sig((served["logits"][skip:skip + n].argmax(-1)
                                               == runtime.argmax(-1)).float().mean())}
        worst, served_worst = max(worst, float(diff.max())), max(served_worst, float(served_diff.max()))
        if not ref["markov_first_draft"]:
            line["first_draft_bias_we_skip"] = sig(finite_max(runtime[0] - row["logits"][0, order]))
        if (exact["confidence"] is None) != (row["confidence"] is None):
            sys.exit("FAIL: one side has a confidence head and the other not: the export dropped or invented it")
        if exact["confidence"] is not None:
            cdiff = finite_max(exact["confidence"][skip:skip + n] - row["confidence"][:n])
            line["confidence_max_abs_diff"] = sig(cdiff)
            worst = max(worst, float(cdiff))
        report.append(line)
    print(json.dumps({"folder": args.folder, "class": type(model).__name__,
                      "draft_vocab": int(model.draft_vocab_size)}))
    for line in report:
        print(" ", json.dumps(line))
    if worst <= args.tol and not served_worst <= args.served_tol:  # the backbone agrees, the served head not
        sys.exit(f"FAIL: the folder's lm_head (what vLLM reads) moves logits by {served_worst:.3g} "
                 f"(> {args.served_tol}, far past its dtype's rounding): its rows are not the target's for d2t")
    verdict(model, worst, args.tol)


def finite_max(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max |x|, with a NaN (speculators' mark of a weight it never loaded) counted as infinitely far."""
    x = torch.nan_to_num(x.abs(), nan=float("inf"))
    return x.max() if dim is None else x.amax(dim)


def block_forward(model, feats, ids, a: int, head: torch.Tensor | None = None) -> dict:
    """speculators' own training forward on the one anchor ``a``: the normed hidden rows, and the logits and
    confidence logits it hands its loss (captured there). ``head``: LM-head rows to run it with instead of the
    folder's own."""
    L, B = ids.shape[1], model.block_size
    loss_mask, docs = torch.zeros(1, L, dtype=torch.long), torch.zeros(1, L, dtype=torch.long)
    loss_mask[0, a] = 1  # the one valid anchor, so its sampler can pick no other
    anchors, valid = model._build_attention_mask(loss_mask, 1, docs, "cpu")[2:]
    if int(anchors[0]) != a or not bool(valid[0]):
        sys.exit(f"speculators anchored the block at {int(anchors[0])} (valid {bool(valid[0])}), not at {a}")
    seen, module = {}, sys.modules[type(model).__module__]
    names = list(inspect.signature(module.compute_metrics).parameters)  # DSpark's takes confidence_logits

    def capture(*args, **kw):
        got = {**dict(zip(names, args)), **kw}
        conf = got.get("confidence_logits")
        seen["logits"], seen["confidence"] = got["logits"].reshape(B, -1), None if conf is None else conf.reshape(B)
        return got["logits"].sum() * 0, {}

    hook = model.norm.register_forward_hook(lambda mod, inp, out: seen.__setitem__("hidden", out.reshape(B, -1)))
    saved, module.compute_metrics = module.compute_metrics, capture
    own = model.lm_head.weight.data
    try:
        if head is not None:
            model.lm_head.weight.data = head.data
        with torch.no_grad():
            model(feats, ids, loss_mask, torch.zeros(1, L, model.config.transformer_layer_config.hidden_size), docs,
                  max_anchors=1)
    finally:
        module.compute_metrics, model.lm_head.weight.data = saved, own
        hook.remove()
    return seen


def verdict(model, worst: float, tol: float) -> None:
    if not worst <= tol:  # NaN too
        sys.exit(f"FAIL: speculators' logits differ from graft-block's by {worst:.3g} (> {tol})")
    print(f"OK: speculators' {type(model).__name__} reproduces graft-block's drafts (max |diff| {worst:.2g})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reference", help="graft-block's side (run in graft-block's venv)")
    r.add_argument("drafter", nargs="+", help="bundled DFlash / DSpark / EAGLE-3 drafter names or folders")
    r.add_argument("--target", default="smollm2-135m")
    r.add_argument("--anchors", type=lambda s: [int(x) for x in s.split(",")], default=[12, 30, 47])
    r.add_argument("--out", nargs="+", required=True, help="one reference file per drafter")
    c = sub.add_parser("compare", help="speculators' side (run in a venv with speculators)")
    c.add_argument("folder", nargs="+", help="folders `graft-block export --to speculators` wrote")
    c.add_argument("--ref", nargs="+", required=True, help="the reference file of each folder's drafter, in order")
    c.add_argument("--tol", type=float, default=1e-2,
                   help="fp32 logits against the verifier's rows (typically 4e-5, a process's first forward up to "
                        "1.2e-3; a 1%% error in one weight: 0.13-0.24)")
    c.add_argument("--served-tol", type=float, default=0.05,
                   help="logits through the folder's own lm_head rows, in its dtype (fp16: ~0.015 here)")
    args = p.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the weight-loading bars
    halves = {"reference": ("drafter", "out", reference), "compare": ("folder", "ref", compare)}
    name_key, file_key, run = halves[args.cmd]
    names, files = getattr(args, name_key), getattr(args, file_key)
    if len(names) != len(files):
        p.error(f"{len(names)} {name_key}s but {len(files)} --{file_key} files: give one each, in the same order")
    failed = []
    for one, file in zip(names, files):
        try:
            run(argparse.Namespace(**{**vars(args), name_key: one, file_key: file}))
        except SystemExit as exc:  # a refusal or a FAIL: say whose, go on with the others, fail at the end
            if exc.code not in (None, 0):
                print(f"{one}: {exc.code}", file=sys.stderr)
                failed.append(one)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
