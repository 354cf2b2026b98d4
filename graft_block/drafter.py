"""The Drafter interface, its registry and ``Drafter.from_config``.

A drafter only *proposes*: verification, the walk, KV compaction and grafting are shared (graft_block.decoder).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, ClassVar

from graft_block.tree import Tree

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


def shared_checkpoint(target, kind: str, folder, load):
    """``load()``, or the object an earlier drafter of this kind loaded from ``folder`` onto ``target``, when the
    target opts in (``target.share_drafter_checkpoints = True``: the benchmark does, since its methods only read
    their weights, and a bundled drafter named by three presets was three copies with three kernel layouts).
    Off by default: a training run that starts from a checkpoint changes its weights in place."""
    if not getattr(target, "share_drafter_checkpoints", False):
        return load()
    path = Path(folder).resolve()
    stamp = max((f.stat().st_mtime_ns for f in path.glob("*.safetensors")), default=0) if path.is_dir() else 0
    key = (kind, str(path), stamp, str(getattr(target, "dtype", "")))
    shared = target.__dict__.setdefault("_shared_checkpoints", {})
    if key not in shared:
        shared[key] = load()
    return shared[key]


def shared_by(target, obj) -> bool:
    """Whether ``obj`` is a checkpoint ``shared_checkpoint`` loaded for ``target`` (alone or first of a tuple)."""
    return any(obj is (v[0] if isinstance(v, tuple) else v)
               for v in target.__dict__.get("_shared_checkpoints", {}).values())


def read_weights(folder: str | Path, what: str = "checkpoint") -> dict:
    """All tensors of a checkpoint folder (``*.safetensors`` shards merged), on top of its ``weights_base``
    (``base_weights``) when it is a delta folder. A folder without weights or a file that is not valid safetensors
    raises ConfigError naming the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{what} {folder} has no *.safetensors weights")
    tensors = base_weights(folder, what)
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{what} file {f} is corrupt or truncated ({e}); re-download or re-save it") from e
    return tensors


def own_tensor_names(folder: Path, what: str = "checkpoint") -> set[str]:
    """The tensor names a folder's own ``*.safetensors`` files hold (a delta's base not included), read from the
    headers only; a file that is not valid safetensors raises ConfigError naming it, as ``read_weights`` does."""
    from safetensors import SafetensorError, safe_open

    names: set[str] = set()
    for f in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt") as h:
                names.update(h.keys())
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{what} file {f} is corrupt or truncated ({e}); re-download or re-save it") from e
    return names


def weights_digest(folder: str | Path) -> str:
    """sha256 over a folder's ``*.safetensors`` files, in name order (what a delta folder pins its base by)."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted(Path(folder).glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def delta_base_folder(folder: Path, name: str, what: str = "checkpoint") -> Path:
    """A delta folder's base: the sibling folder ``name`` when there is one, else the bundled/registered ``name``."""
    sibling = Path(folder).parent / name
    return sibling if (sibling / "config.json").exists() else resolve_checkpoint(name, what)


def base_folder(folder: Path, what: str = "checkpoint") -> Path | None:
    """The backbone folder a delta folder's config.json names in ``weights_base``; None for a whole folder."""
    path = folder / "config.json"
    ref = json.loads(path.read_text()).get("weights_base") if path.exists() else None
    return delta_base_folder(folder, ref["checkpoint"], what) if ref else None


def base_weights(folder: Path, what: str = "checkpoint") -> dict:
    """The tensors a delta folder does not repeat: its config.json's ``weights_base`` {"checkpoint": a sibling
    folder or bundled name, "sha256": ``weights_digest`` of it} names the frozen backbone its heads were trained
    on (a DSpark or MFD folder then ships only what training changed). {} for a whole folder; a base whose weights
    changed since is refused, never silently mixed."""
    base = base_folder(folder, what)
    if base is None:
        return {}
    ref = json.loads((folder / "config.json").read_text())["weights_base"]
    digest = weights_digest(base)
    if digest != ref["sha256"]:
        raise ConfigError(f"{what} {folder} holds only what was trained on top of {ref['checkpoint']} ({base}), and "
                          f"those weights changed since (sha256 {digest[:12]}, expected {ref['sha256'][:12]}): "
                          "restore that backbone, or load the full checkpoint the training run wrote")
    return read_weights(base, what)


def write_delta(folder: str | Path, base: str | Path) -> dict:
    """Rewrite checkpoint ``folder`` as a delta on ``base`` (a sibling folder or bundled name): keep only the
    tensors that are not bit-identical in the base, and pin the base in config.json (``weights_base``). Loading
    is unchanged (``read_weights``). Returns {"kept": [names], "dropped": count}."""
    import torch
    from safetensors.torch import save_file

    folder, name = Path(folder), str(base)
    src = delta_base_folder(folder, name)
    mine, theirs = read_weights(folder), read_weights(src)
    kept = {k: v.contiguous() for k, v in mine.items()
            if k not in theirs or v.dtype != theirs[k].dtype or not torch.equal(v, theirs[k])}
    for f in folder.glob("*.safetensors"):
        f.unlink()
    save_file(kept, str(folder / "model.safetensors"), metadata={"format": "pt"})
    pin_base(folder, Path(name).name, src)
    return {"kept": sorted(kept), "dropped": len(mine) - len(kept)}


def pin_base(folder: Path, name: str, src: Path) -> str:
    """Write ``weights_base`` = {"checkpoint": ``name``, "sha256": the digest of ``src``} into ``folder``'s
    config.json; returns the digest."""
    digest = weights_digest(src)
    cfg = read_config_json(folder)
    cfg["weights_base"] = {"checkpoint": name, "sha256": digest}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return digest


def repin_delta(folder: str | Path) -> str:
    """Pin delta folder ``folder`` to its base's current weights (after the backbone was retrained), keeping its own
    tensors unchanged. Only heads trained on a frozen backbone may move: a delta that holds any tensor the base
    also has (a fine-tuned backbone part) is refused, since re-pinning would splice it into another backbone.
    Returns the new sha256. Re-measure the heads on the new backbone: a re-pin asserts nothing about their quality."""
    folder = Path(folder)
    src = base_folder(folder)
    if src is None:
        raise ConfigError(f"{folder} is a whole checkpoint (no weights_base in its config.json): nothing to re-pin")
    shared = sorted(own_tensor_names(folder) & set(read_weights(src)))
    if shared:
        raise ConfigError(f"{folder} holds {len(shared)} tensor(s) its base {src} also has ({', '.join(shared[:3])}"
                          f"{', ...' if len(shared) > 3 else ''}): they were trained with the old backbone, so "
                          "re-pinning would mix two backbones; retrain the heads on the new base instead")
    return pin_base(folder, read_config_json(folder)["weights_base"]["checkpoint"], src)


_CHECKPOINT_ROOTS: list[Path] = []
ENTRY_POINT_GROUP = "graft_block.drafters"


def register_checkpoints(folder: str | Path) -> None:
    """Add a folder whose sub-folders are drafters callable by short name (``"dflash-smollm2"``). The drafters
    package registers its bundled ``checkpoints/``; a third-party package may add its own."""
    folder = Path(folder)
    if folder not in _CHECKPOINT_ROOTS:
        _CHECKPOINT_ROOTS.append(folder)


def load_plugins(name: str | None = None) -> None:
    """Import the drafters advertised under the ``graft_block.drafters`` entry-point group (all, or the one
    called ``name``). This is how the core finds drafters without importing them (imports point one way)."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if name is None or ep.name == name:
            obj = ep.load()
            # an entry point naming a Drafter class registers it under the entry point's name (no @register needed)
            if isinstance(obj, type) and issubclass(obj, Drafter) and obj not in _REGISTRY.values():
                register(ep.name)(obj)


def registered_types() -> list[str]:
    load_plugins()
    return sorted(_REGISTRY)


def drafter_class(kind: str) -> type["Drafter"]:
    if kind not in _REGISTRY:
        load_plugins(kind)
    if kind not in _REGISTRY:
        known = ", ".join(registered_types()) or "none (is graft-block installed? `pip install -e .`)"
        raise ConfigError(f"unknown drafter type {kind!r}; known types: {known}")
    return _REGISTRY[kind]


def load_config(cfg: Any) -> dict:
    """A dict, a YAML/JSON file path, a folder holding config.json, or a bundled drafter's short name -> a plain
    dict (copy). A folder's dict carries ``checkpoint`` = the folder."""
    if isinstance(cfg, dict):
        return dict(cfg)
    if isinstance(cfg, (str, Path)):
        path = Path(cfg)
        if not path.exists() and isinstance(cfg, str) and "/" not in cfg:
            path = bundled_checkpoint(cfg) or path
        if path.is_dir():
            data = read_config_json(path)
            data.setdefault("checkpoint", str(path))
            return data
        if not path.exists():
            raise ConfigError(f"drafter config {cfg!r} is not a dict, an existing file, a folder or a bundled "
                              f"drafter (bundled: {', '.join(bundled_checkpoints()) or 'none'})")
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


def bundled_checkpoints() -> list[str]:
    """Short names of every registered drafter checkpoint folder."""
    load_plugins()
    return sorted(p.name for root in _CHECKPOINT_ROOTS if root.is_dir() for p in root.iterdir()
                  if (p / "config.json").exists())


def resolve_checkpoint(ckpt: str | Path, what: str = "drafter") -> Path:
    """A folder holding config.json, or the short name of a bundled checkpoint (``bundled_checkpoints``)."""
    if not isinstance(ckpt, (str, Path)):  # Path(5) is a TypeError from pathlib that names no key
        raise ConfigError(f"{what} checkpoint must be a folder path or a bundled drafter's short name (a string), "
                          f"got {type(ckpt).__name__} {ckpt!r}")
    path = Path(ckpt)
    if (path / "config.json").exists():
        return path
    if isinstance(ckpt, str) and "/" not in ckpt:
        found = bundled_checkpoint(ckpt)
        if found is not None:
            return found
    raise ConfigError(f"{what} checkpoint {str(ckpt)!r} is neither a folder with config.json nor a bundled name "
                      f"(bundled: {', '.join(bundled_checkpoints()) or 'none'})")


def read_config_json(folder: str | Path, what: str = "drafter") -> dict:
    """``folder``/config.json as a dict; a ConfigError naming the file when it is missing, not JSON or no object."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{what} folder {folder} has no config.json")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}): repair it or save the checkpoint again") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def keys_from_file(cfg: dict, saved: dict) -> set[str]:
    """The keys of ``cfg`` that came from a checkpoint's config.json ``saved``, value for value
    (``Drafter.from_config(folder)`` passes the file whole): the loader's, not drafter options."""
    return {k for k, v in cfg.items() if k in saved and saved[k] == v}


def reject_unknown_options(cfg: dict, ckpt: str | Path, kind: str, options) -> None:
    """With a checkpoint, what ``cfg`` still holds once the drafter took its options must come from the folder's own
    config.json, value for value (``Drafter.from_config(folder)`` passes it whole); any other key is a misspelt or
    misplaced option, and a different value for a saved field would be ignored."""
    extra = sorted(set(cfg) - keys_from_file(cfg, read_config_json(resolve_checkpoint(ckpt, kind), kind)))
    if extra:
        raise ConfigError(f"{kind} options {extra} beside checkpoint {ckpt} are neither options nor its config.json's "
                          f"values (a saved field cannot be overridden): the options are {', '.join(options)}")


def bundled_checkpoint(name: str) -> Path | None:
    """The folder of a drafter shipped with graft-block (or a plugin) under the short name ``name``, if any."""
    load_plugins()
    for root in _CHECKPOINT_ROOTS:
        if (root / name / "config.json").exists():
            return root / name
    return None


def detect_type(data: dict) -> str:
    """The drafter type of a checkpoint config without a ``type`` key (an untouched hub folder): asks each
    registered drafter class whether it claims the config."""
    load_plugins()
    claims = [name for name, klass in sorted(_REGISTRY.items()) if klass.claims(data)]
    where = f" ({data['checkpoint']})" if "checkpoint" in data else ""
    if len(claims) == 1:
        return claims[0]
    if not claims:
        raise ConfigError(f"drafter config{where} has no 'type' key and no registered drafter recognises its "
                          f"layout (architectures={data.get('architectures')}); add \"type\": one of "
                          f"{', '.join(sorted(_REGISTRY))}")
    raise ConfigError(f"drafter config{where} is claimed by several drafter types ({', '.join(claims)}); "
                      f"add \"type\" to say which")


def checkpoint_type(data: dict) -> str | None:
    """The drafter type a checkpoint's config.json names: its ``type`` key, else the one registered drafter that
    claims its layout (``detect_type``); None when neither says."""
    kind = data.get("type")
    if isinstance(kind, str) and kind:
        return kind
    try:
        return detect_type({k: v for k, v in data.items() if k != "checkpoint"})
    except ConfigError:
        return None


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
        if data.get("type") is not None and not (isinstance(data["type"], str) and data["type"]):
            raise ConfigError(f"drafter config 'type' must be a drafter type name, got {data['type']!r}: one of "
                              f"{', '.join(registered_types())}, or leave 'type' out for a checkpoint folder")
        kind = data.pop("type", None) or detect_type(data)
        calibration = data.pop("graft", None)  # Graft's thresholds (calibrate --save), not a drafter argument
        check_calibration(calibration)
        try:
            drafter = drafter_class(kind).build(data, target)
        except ConfigError:
            raise
        except Exception as exc:
            err = option_error(kind, data, exc)
            if err is None:
                raise
            raise err from exc
        if calibration is not None:
            drafter.graft_calibration = calibration
        return drafter

    @classmethod
    def claims(cls, config: dict) -> bool:
        """Whether a checkpoint config without a ``type`` key is in this drafter's format (hub folders)."""
        return False

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


def check_calibration(calibration) -> None:
    """A drafter config's ``graft`` entry is the calibration ``calibrate --save`` wrote; anything else would be
    ignored by Graft without a word (e.g. Graft's own settings nested in the drafter config instead of beside it)."""
    if calibration is None:
        return
    if not isinstance(calibration, dict) or not isinstance(calibration.get("thresholds"), dict) \
            or not calibration["thresholds"]:
        raise ConfigError(f"a drafter config's 'graft' entry is the calibration `graft-block calibrate --save` writes "
                          f"({{'signal', 'checkpoints', 'thresholds': {{depth: log-prob}}}}), got {calibration!r}: "
                          "Graft's own settings (mode, ...) go in the method's 'graft', beside 'drafter'")


def option_error(kind: str, cfg: dict, exc: Exception) -> ConfigError | None:
    """A ConfigError naming the options whose text value ``exc`` (raised deep inside a drafter's build, e.g. by
    ``int('x')`` or HF's config checks) quotes; None when it quotes none: that is no config mistake, re-raise it."""
    quoted = [k for k, v in cfg.items() if k != "checkpoint" and isinstance(v, str) and repr(v) in str(exc)]
    if not quoted:
        return None
    named = ", ".join(f"{k}={cfg[k]!r}" for k in quoted)
    return ConfigError(f"bad config for drafter {kind!r}: {named} was refused ({type(exc).__name__}: "
                       f"{' '.join(str(exc).split())}); give the option a value of its type (e.g. 1, not '1')")


def offset_vocab_ids(d2t, t2d, vocab: int, where: str = ""):
    """The target ids of a draft vocabulary stored the EAGLE / speculators way: ``d2t`` offsets (target id = draft
    index + d2t) and ``t2d`` (None, or a mask over the target ids that must mark exactly those). A ConfigError, led by
    ``where``, names what is wrong."""
    import torch

    at = f"{where}: " if where else ""
    ids = torch.arange(d2t.numel()) + d2t.detach().cpu().long().flatten()
    if bool(((ids < 0) | (ids >= vocab)).any()):
        raise ConfigError(f"{at}d2t maps draft ids outside the target vocabulary 0..{vocab - 1}: the d2t tensor is "
                          "corrupt or holds absolute ids instead of offsets")
    if ids.unique().numel() != ids.numel():
        raise ConfigError(f"{at}d2t maps two draft ids to the same target id; the draft vocabulary must be injective")
    if t2d is not None:
        mask = t2d.detach().cpu().bool().flatten()
        if mask.numel() != vocab or int(mask.sum()) != ids.numel() or not bool(mask[ids].all()):
            raise ConfigError(f"{at}t2d marks {int(mask.sum())} of {mask.numel()} target ids but the draft vocabulary "
                              f"has {ids.numel()} of {vocab} (t2d must be True exactly at draft_id + d2t[draft_id])")
    return ids


def vocab_maps(ids, vocab: int):
    """``offset_vocab_ids``' inverse: (``d2t`` int64 offsets, ``t2d`` bool mask over ``vocab``) for the draft
    vocabulary ``ids``, target ids in ascending order (as EAGLE and speculators store one)."""
    import torch

    ids = ids.detach().cpu().long()
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return (ids - torch.arange(ids.numel())).contiguous(), t2d


def is_count(value, minimum: int = 0) -> bool:
    """An int of at least ``minimum``, never a bool (``isinstance(True, int)`` holds: True would pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_flag(value, name: str) -> bool:
    """``value`` if it is a bool, else a ConfigError naming ``name``: ``bool("false")`` is True."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


def check_number(value, name: str, low: float = -math.inf, high: float = math.inf, what: str = "") -> float:
    """``value`` as a float if it is a real number in [low, high] (never a bool or text), else a ConfigError naming
    ``name``; ``what`` says what the number is (e.g. its scale)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high
    if not ok:  # NaN fails both comparisons
        span = "" if (low, high) == (-math.inf, math.inf) else f" in [{low}, {high}]"
        raise ConfigError(f"{name} must be a number{span}{f' ({what})' if what else ''}, got {value!r}")
    return float(value)


def check_budget(budget) -> int:
    if not is_count(budget, 1):
        raise ConfigError(f"budget must be an int >= 1 (non-root tree nodes per round), got {budget!r}")
    return budget
