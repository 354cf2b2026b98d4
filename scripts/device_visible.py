"""Fail fast, before any step of a GPU script, when torch sees no CUDA device.

    python scripts/device_visible.py DEVICE WHO     # WHO: the calling script, named in the message
"""
import sys

import torch

dev, who = sys.argv[1], sys.argv[2]
if dev.startswith("cuda") and not torch.cuda.is_available():
    sys.exit(f"{who}: no CUDA device visible to torch {torch.__version__} (a CPU-only build?); "
             "GRAFT_BLOCK_DEVICE=cpu runs the same steps on the CPU")
print("device:", torch.cuda.get_device_name(dev) if dev.startswith("cuda") else "cpu", "| torch", torch.__version__)
