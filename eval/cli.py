"""The ``graft-block`` command: ``graft-block bench|train|calibrate|physics|export [options]`` (options pass through).

    graft-block bench ...       = python eval/run_block.py ...   (the benchmark and main job)
    graft-block train ...       = python -m graft_block.drafters.train ...
    graft-block calibrate ...   = python -m graft_block.calibrate ...
    graft-block physics ...     = python -m graft_block.eval.physics ...   (bandwidth, peak, linear layers, verify)
    graft-block export ...      = python -m graft_block.drafters.export ...
                                  (a drafter to llama.cpp GGUF or vLLM speculators)
    graft-block expect ...      = python -m graft_block.eval.expected_tau ...   (trees' exact expected tau, paired)
"""
from __future__ import annotations

import importlib
import sys

from graft_block.errors import run_command

COMMANDS = {
    "bench": ("graft_block.eval.run_block", "benchmark methods side by side (the main job; --list-methods)"),
    "train": ("graft_block.drafters.train", "train a drafter (dflash, dspark, eagle3, mfd) with the shared loop"),
    "calibrate": ("graft_block.calibrate", "calibrate Graft's pruning thresholds"),
    "physics": ("graft_block.eval.physics", "bandwidth, matrix-product peak, linear layers vs verify"),
    "export": ("graft_block.drafters.export", "export a drafter to llama.cpp (GGUF) or vLLM speculators"),
    "expect": ("graft_block.eval.expected_tau", "trees' exact expected tau on fixed held-out contexts, paired"),
}


def usage() -> str:
    lines = ["usage: graft-block {" + ",".join(COMMANDS) + "} [options]   (graft-block COMMAND --help)", ""]
    lines += [f"  {name:10s} {about}" for name, (_, about) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"graft-block: unknown command {cmd!r}\n{usage()}", file=sys.stderr)
        return 2
    prog = f"graft-block {cmd}"
    mod = importlib.import_module(COMMANDS[cmd][0])
    if cmd == "bench":
        return mod.cli(rest, prog=prog)
    saved, sys.argv[0] = sys.argv[0], prog  # argparse names the program after argv[0]
    try:
        return run_command(lambda: mod.main(rest), prog)
    finally:
        sys.argv[0] = saved


if __name__ == "__main__":
    sys.exit(main())
