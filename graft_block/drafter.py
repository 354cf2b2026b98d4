"""The Drafter interface, its registry and ``Drafter.from_config``.

A drafter only *proposes*: verification, the walk, KV compaction and grafting are shared (graft_block.decoder).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path
from typing import Any, ClassVar

from tree import Tree

from .errors import ConfigError

_REGISTRY: dict[str, type["Drafter"]] = {}


def register(name: str):
    """Class decorator: make a drafter constructible by ``Drafter.from_config({"type": name, ...})``."""

    def deco(cls):
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ConfigError(f"drafter type {name!r} is registered twice ({_REGISTRY[name].__name__}, {cls.__name__})")
        _REGISTRY[name] = cls
        cls.type_name = name
        return cls

    return deco


def read_weights(folder: str | Path, what: str = "checkpoint") -> dict:
    """All tensors of a checkpoint folder (``*.safetensors`` shards merged). A folder without weights or a file that
    is not valid safetensors raises ConfigError naming the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{what} {folder} has no *.safetensors weights")
    tensors = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{what} file {f} is corrupt or truncated ({e}); re-download or re-save it") from e
    return tensors


def registered_types() -> list[str]:
    _import_builtin_drafters()
    return sorted(_REGISTRY)


def _import_builtin_drafters():
    # Imported lazily so graft_block never imports drafters at import time (imports point eval->drafters->core).
    importlib.import_module("drafters")


def load_config(cfg: Any) -> dict:
    """A dict, a YAML/JSON file path, or a folder holding config.json -> a plain dict (copy)."""
    if isinstance(cfg, dict):
        return dict(cfg)
    if isinstance(cfg, (str, Path)):
        path = Path(cfg)
        if not path.exists() and isinstance(cfg, str) and "/" not in cfg:
            path = bundled_checkpoint(cfg) or path
        if path.is_dir():
            if not (path / "config.json").exists():
                raise ConfigError(f"drafter folder {path} has no config.json")
            data = json.loads((path / "config.json").read_text())
            data.setdefault("checkpoint", str(path))
            return data
        if not path.exists():
            raise ConfigError(f"drafter config {cfg!r} is not a dict, an existing file or a folder")
        text = path.read_text()
        try:
            if path.suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
        except Exception as exc:  # noqa: BLE001 - re-raised with the file named
            raise ConfigError(f"cannot parse drafter config {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"drafter config {path} must hold a mapping, got {type(data).__name__}")
        return data
    raise ConfigError(f"drafter config must be a dict, a path or a folder, got {type(cfg).__name__}")


def bundled_checkpoint(name: str) -> Path | None:
    """The folder of a drafter trained and shipped with graft-block (``drafters/checkpoints/<name>``), if any."""
    spec = importlib.util.find_spec("drafters")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]) / "checkpoints" / name
    return folder if (folder / "config.json").exists() else None


class Drafter:
    """Base class. Subclasses set ``type_name`` through ``@register`` and implement ``propose``.

    Lifecycle, once per prompt: ``prefill(state)``; then each round ``propose(state) -> Tree`` and, after
    verification, ``commit(state, verified)``. ``feature_layers`` lists the target hidden-state indices the
    drafter needs (HF ``hidden_states`` numbering); the engine captures exactly those.
    """

    type_name: ClassVar[str] = "base"
    feature_layers: tuple[int, ...] = ()
    budget: int = 1

    @classmethod
    def from_config(cls, cfg: Any, target=None) -> "Drafter":
        data = load_config(cfg)
        kind = data.pop("type", None)
        if kind is None:
            raise ConfigError(f"drafter config has no 'type' key; known types: {', '.join(registered_types())}")
        if kind not in _REGISTRY:
            _import_builtin_drafters()
        if kind not in _REGISTRY:
            raise ConfigError(f"unknown drafter type {kind!r}; known types: {', '.join(sorted(_REGISTRY))}")
        klass = _REGISTRY[kind]
        return klass.build(data, target)

    @classmethod
    def build(cls, cfg: dict, target=None) -> "Drafter":
        """Construct from a config dict (``type`` removed). Default: keyword arguments, unknown keys rejected."""
        try:
            return cls(**cfg) if target is None or not cls._wants_target() else cls(target=target, **cfg)
        except TypeError as exc:
            raise ConfigError(f"bad config for drafter {cls.type_name!r}: {exc}") from exc

    @classmethod
    def _wants_target(cls) -> bool:
        import inspect

        return "target" in inspect.signature(cls.__init__).parameters

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def prefill(self, state) -> None:
        """Called once after the target prefilled the prompt."""

    def propose(self, state) -> Tree:
        raise NotImplementedError

    def commit(self, state, verified) -> None:
        """Called after each verification with the accepted path (``verified`` is a decoder.Verified)."""

    def describe(self) -> dict:
        return {"type": self.type_name, "budget": self.budget}


def check_budget(budget) -> int:
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ConfigError(f"budget must be an int >= 1 (non-root tree nodes per round), got {budget!r}")
    return budget
