"""graft-block: the shared core under every drafter (target adapter, sampling, verification loop, graft).

One distribution namespace: the repository's ``tree/``, ``drafters/`` and ``eval/`` folders install as
``graft_block.tree``, ``graft_block.drafters`` and ``graft_block.eval`` (pyproject's package-dir mapping), so
nothing but ``graft_block`` lands at top level. Imports point one way: eval -> drafters -> graft_block -> tree.
"""
import os as _os
import sys as _sys
from pathlib import Path as _Path

# OpenBLAS (numpy's; the lean forward's products on CPUs where it beats MKL) keeps its idle threads spinning for
# ~0.1 s after each product; beside torch's own pool on 2 cores that spinning slowed HF's forward 1.9x (measured).
# 2^20 cycles (~0.4 ms) still bridges the gaps between one forward's products. Read once, when numpy loads.
# numpy loaded first (torch imports it) without the variable: the lean engine warns when it picks OpenBLAS.
OPENBLAS_TIMEOUT_LATE = "numpy" in _sys.modules and "OPENBLAS_THREAD_TIMEOUT" not in _os.environ
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "20")

# In a source checkout the three folders sit beside this one; a wheel places them inside it. Searching the
# checkout root as well lets `python eval/run_block.py` and the tests run without any install.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").exists() and (_checkout / "tree" / "__init__.py").exists() \
        and not (_Path(__file__).parent / "tree").exists():
    __path__.append(str(_checkout))  # noqa: F821 - a package's __path__

__version__ = "0.1.0"


def cache_root() -> _Path:
    """Where converted targets, training data, measured costs and kernel choices live (``GRAFT_BLOCK_CACHE``)."""
    # set but empty (`GRAFT_BLOCK_CACHE= cmd`) is unset, not Path("") = the current folder
    return _Path(_os.environ.get("GRAFT_BLOCK_CACHE") or _Path.home() / ".cache" / "graft_block")


def keyed_cache_file(kind: str, key: dict) -> _Path:
    """The JSON file under ``cache_root()/kind`` for a measurement keyed by ``key`` (hardware, versions, shapes)."""
    import hashlib
    import json

    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / kind / f"{digest}.json"

# Public names, loaded on first use so that `import graft_block.tree` stays free of models and transformers.
_EXPORTS = {
    "DecodeState": "decoder", "Result": "decoder", "SpeculativeDecoder": "decoder", "Stats": "decoder",
    "Verified": "decoder",
    "Drafter": "drafter", "check_budget": "drafter", "register": "drafter", "registered_types": "drafter",
    "ConfigError": "errors",
    "SamplingConfig": "sampling", "choose": "sampling", "target_probs": "sampling",
    "Target": "target", "load_target": "target",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'graft_block' has no attribute {name!r}")
