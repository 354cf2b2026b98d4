"""Named methods for eval/run_block.py beyond AR/HF/PLD: retrieval, EAGLE3 (+Graft ablations), DFlash (chain,
Graft-TAIL, DDTree), MFD. ``@name`` in a drafter's ``checkpoint`` is a bundled drafter (drafters/checkpoints/);
a method whose bundled drafter is missing is skipped with a message. ``default_budget`` is this CPU's choice
(small: an n-node verify costs several decode steps here; use --budget on a GPU)."""


def install(rb) -> None:
    """Register the presets and the paper claims into the run_block module ``rb``."""
    register_preset, PAPER_METHODS, PAPER_CLAIMS = rb.register_preset, rb.PAPER_METHODS, rb.PAPER_CLAIMS
    register_preset("recycling", {"drafter": {"type": "recycling", "budget": "{budget}"}, "default_budget": 16}, quick=True)
    register_preset("pld_matrix", {"drafter": {"type": "pld_matrix", "budget": "{budget}"}, "default_budget": 16},
                    quick=True)

    EAGLE = {"type": "eagle3", "checkpoint": "@eagle3-smollm2", "budget": "{budget}"}
    register_preset("eagle3", {"drafter": EAGLE, "default_budget": 16})
    register_preset("eagle3_prune", {"drafter": EAGLE, "graft": {"mode": "prune"}, "default_budget": 16})
    register_preset("eagle3_fixed", {"drafter": EAGLE, "graft": {"mode": "fixed"}, "default_budget": 16})
    register_preset("eagle3_graft", {"drafter": EAGLE, "graft": {"mode": "graft"}, "default_budget": 16}, quick=True)

    DFLASH = {"type": "dflash", "checkpoint": "@dflash-smollm2"}
    register_preset("dflash_chain", {"drafter": {**DFLASH, "proposal": "chain"}})
    register_preset("dflash_tail", {"drafter": {**DFLASH, "proposal": "chain"},
                                    "graft": {"mode": "tail", "tail_threshold": 0.3}}, quick=True)
    register_preset("dflash_ddtree", {"drafter": {**DFLASH, "proposal": "ddtree", "budget": "{budget}"},
                                      "default_budget": 16}, quick=True)
    register_preset("dflash_ddtree64", {"drafter": {**DFLASH, "proposal": "ddtree", "budget": 64}, "chimeric": True})

    register_preset("mfd", {"drafter": {"type": "mfd", "checkpoint": "@mfd-smollm2", "budget": "{budget}"},
                            "default_budget": 16}, quick=True)
    # The fair DDTree control for MFD: the K=1 drafter given the same extra training (mfd.md: equal compute).
    register_preset("mfd_k1_ddtree", {"drafter": {"type": "mfd", "checkpoint": "@mfd-smollm2-k1", "budget": "{budget}"},
                                      "default_budget": 16})

    PAPER_METHODS[:] = ["ar", "pld", "eagle3", "eagle3_prune", "eagle3_fixed", "eagle3_graft", "dflash_chain",
                        "dflash_tail", "dflash_ddtree", "dflash_ddtree64", "mfd", "mfd_k1_ddtree"]

    # Relative claims of the seed papers. "threshold": holds when our ratio (method / baseline) is at least it.
    PAPER_CLAIMS[:] = [
        {"claim": "Graft faster than EAGLE3 dense", "method": "eagle3_graft", "baseline": "eagle3",
         "paper": "+15.3% (Qwen3-8B, 2.43x vs 2.11x)", "threshold": 1.0},
        {"claim": "Graft faster than pruning only", "method": "eagle3_graft", "baseline": "eagle3_prune",
         "paper": "2.43x vs 2.20x (Qwen3-8B)", "threshold": 1.0},
        {"claim": "Graft faster than fixed-ratio retrieval", "method": "eagle3_graft", "baseline": "eagle3_fixed",
         "paper": "2.43x vs 1.95x (Qwen3-8B)", "threshold": 1.0},
        {"claim": "pruning only faster than dense", "method": "eagle3_prune", "baseline": "eagle3",
         "paper": "ECHO-style pruning beats dense in speed", "threshold": 1.0},
        {"claim": "Graft MAT >= pruning-only MAT", "method": "eagle3_graft", "baseline": "eagle3_prune",
         "metric": "tau", "paper": "MAT(Graft) >= MAT(pruned) (theorem)", "threshold": 1.0},
        {"claim": "Graft-TAIL faster than DFlash chain", "method": "dflash_tail", "baseline": "dflash_chain",
         "paper": "+9.1% (Qwen3-8B, 3.40x -> 3.71x)", "threshold": 1.0},
        {"claim": "MFD faster than DDTree at equal budget", "method": "mfd", "baseline": "mfd_k1_ddtree",
         "paper": "MFD > DDTree / DARTree (+9-16% vs DARTree)", "threshold": 1.0},
        {"claim": "MFD accepts more than DDTree at equal budget", "method": "mfd", "baseline": "mfd_k1_ddtree",
         "metric": "tau", "paper": "higher acceptance at equal budget", "threshold": 1.0},
        {"claim": "DDTree chimeric share at 64 nodes in 27-33%", "method": "dflash_ddtree64", "baseline": None,
         "metric": "chimeric_share", "ratio": False, "range": (0.27, 0.33), "paper": "27-33% of a 64-node tree"},
    ]
