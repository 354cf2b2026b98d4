"""``graft-block export --to llama.cpp|speculators NAME_OR_FOLDER --out PATH``: a drafter leaves this project.

NAME_OR_FOLDER is a bundled drafter (a folder under drafters/checkpoints/) or any drafter folder this project loads
(ours, z-lab DFlash, DeepSpec DSpark, EAGLE/SpecForge, or speculators EAGLE3 / DFlash / DSpark). One plain function
per (format, drafter type) reads the folder's config.json and weights as they are, writes the other project's
layout and returns what did not survive the trip (printed by the command, asserted by tests/test_export.py).

llama.cpp (``--to llama.cpp``, one GGUF file; what its October 2026 loader expects, src/models/dflash.cpp and
eagle3.cpp):
  * DFlash and DSpark are llama.cpp's ``dflash`` architecture (DSpark = DFlash + ``markov_w1/markov_w2`` and an
    optional ``conf_proj``); EAGLE3 is ``eagle3``. Neither stores the target's embeddings or LM head: llama.cpp
    shares the target's (``ctx_other``), as this project does. The draft GGUF carries the target's tokenizer
    (copied from the target's GGUF, ``--target``) so llama.cpp's draft/target vocabulary check passes, plus the
    DFlash mask token as ``tokenizer.ggml.mask_token_id``.
  * ``target_layers`` are the target hidden states llama.cpp captures, as HF ``hidden_states`` indices (the input
    of that layer): DFlash's ``target_layer_ids + 1``; EAGLE3's SpecForge ids + 1 (= our drafter's feature
    layers), or a speculators config's ids unchanged.
  * tensors keep their dtype (F16 / BF16 / F32); 1-D tensors (norms, biases) are written F32 (exact), as
    llama.cpp's converter does. EAGLE3 runs with llama.cpp's NORM (interleaved) RoPE, so its q/k projection rows
    are permuted per head (``llama_rope_permute``); DFlash uses NeoX RoPE and needs none. EAGLE3's ``d2t`` becomes
    absolute target ids (offset + draft id), ``t2d`` is dropped (llama.cpp does not read it).
vLLM speculators (``--to speculators``, a folder: config.json + model.safetensors): ``speculators_model_type``
``eagle3`` / ``dflash`` / ``dspark`` with ``transformer_layer_config`` and ``speculators_config`` (algorithm, one
greedy proposal, verifier); tensors keep names and dtypes (EAGLE3's ``midlayer.*`` -> ``layers.0.*``); the aux
layer ids are vLLM's capture ids (HF ``hidden_states`` indices).

A DFlash/DSpark draft vocabulary reaches both as a draft-owned LM head, the target's head rows for the draft ids
(a drafter folder holds none, so they come from ``--target``), so the draft head reads 16k rows instead of 49k:
llama.cpp gets ``output.weight`` in the target GGUF's own type plus ``d2t`` (the ids); speculators gets
``lm_head.weight`` in ascending id order plus its ``d2t`` offsets and ``t2d`` mask. Lost on the way (see ``LOST``):
that restriction when no head rows can be had (a tokenizer-only GGUF, or speculators' default target not fitting),
and DSpark's calibrated per-position confidence temperatures. MFD has no counterpart in either project and is
refused.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from graft_block.drafter import (bundled_checkpoint, bundled_checkpoints, check_flag, check_number, detect_type,
                                 offset_vocab_ids, read_weights, vocab_maps)
from graft_block.errors import ConfigError, run_command

from .dflash.checkpoint import config_int, from_speculators, model_from_config
from .dspark.checkpoint import dspark_options, model_from_dspark_config
from .eagle3.checkpoint import _normalise_keys
from .eagle3.model import Eagle3Config, Eagle3Head

FORMATS = ("llama.cpp", "speculators")
TYPES = ("dflash", "dspark", "eagle3")
DEFAULT_TOKENIZER = "smollm2-135m"  # the embedded target; its GGUF's tokenizer equals the converted F32 GGUF's
MASK_KEY = "tokenizer.ggml.mask_token_id"
DEFAULT_ROPE_THETA = 10000.0  # the references' default for a config without rope_theta (see dflash/checkpoint.py)

LOST = {
    "draft_vocab": ("draft-vocabulary restriction ({n} of {V} ids) dropped: {path} holds no LM head "
                    "(output.weight or token_embd.weight) to take the draft rows from, so the export drafts over "
                    "the full vocabulary through the target's shared head. Pass the target's full GGUF with "
                    "--target to keep it. Output is unchanged (the target verifies)"),
    "draft_vocab_vllm": ("draft-vocabulary restriction ({n} of {V} ids) dropped: vLLM restricts a draft vocabulary "
                         "only with a draft-owned LM head (the target's head rows), and {why}, so the export drafts "
                         "over the full vocabulary through the target's shared head. Pass the target's weights with "
                         "--target (an HF folder, a GGUF or an embedded target name) to keep it. Output is "
                         "unchanged (the target verifies)"),
    "temperatures": ("DSpark's calibrated per-position confidence temperatures dropped: {where} reads the raw "
                     "sigmoid of the confidence head{how}"),
    "first_draft": ("markov_first_draft false dropped: {where} adds the Markov bias to every draft, the first "
                    "too (its previous token is the anchor), so its first drafts can differ from ours. Output is "
                    "unchanged (the target verifies); acceptance may be lower (dspark-smollm2's chain: exact tau "
                    "1.88 -> 1.80, as DFlash's 1.78; docs/interop.md)"),
}


@dataclass
class Source:
    folder: Path
    name: str
    kind: str  # dflash | dspark | eagle3
    config: dict
    tensors: dict


@dataclass
class ExportResult:
    path: Path
    format: str
    kind: str
    tensors: list = field(default_factory=list)  # names written
    lost: list = field(default_factory=list)
    notes: list = field(default_factory=list)


# ---- reading a drafter folder --------------------------------------------------------------------------------
def resolve_source(name_or_folder: str | os.PathLike) -> Path:
    """A folder holding config.json, or the short name of a bundled drafter (drafters/checkpoints/<name>)."""
    path = Path(name_or_folder).expanduser()
    if (path / "config.json").is_file():
        return path
    if path.is_dir():
        raise ConfigError(f"{path} has no config.json: not a drafter folder (give a drafter folder or a bundled "
                          "drafter name)")
    text = str(name_or_folder)
    if "/" not in text and os.sep not in text:
        found = bundled_checkpoint(text)
        if found is not None:
            return found
    raise ConfigError(f"{text!r} is neither a drafter folder (with config.json) nor a bundled drafter; bundled: "
                      f"{', '.join(bundled_checkpoints()) or 'none'}")


def drafter_kind(config: dict, folder: Path) -> str:
    kind = config.get("type")
    if kind is None:  # an untouched hub folder: the registered drafters say whose layout it is
        kind = detect_type({**config, "checkpoint": str(folder)})
    if kind in TYPES:
        return kind
    if kind == "mfd":
        raise ConfigError(f"{folder} is an MFD drafter: its mode embeddings and mixed tree have no llama.cpp or "
                          "speculators counterpart (export a dflash, dspark or eagle3 drafter)")
    raise ConfigError(f"{folder} is a {kind!r} drafter; only dflash, dspark and eagle3 drafters have weights to "
                      "export")


def load_source(name_or_folder) -> Source:
    folder = resolve_source(name_or_folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{folder}/config.json is not valid JSON ({exc})") from exc
    kind = drafter_kind(config, folder)
    if kind == "eagle3" and (folder / "pytorch_model.bin").is_file():
        tensors = dict(torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True))
    else:
        tensors = read_weights(folder, f"{kind} checkpoint")
    if kind in ("dflash", "dspark") and "speculators_model_type" in config:  # read in our spelling
        config, tensors, vocab = from_speculators(config, tensors, f"{folder}/config.json")
        if vocab is not None:
            tensors["draft_vocab"] = vocab
    return Source(folder, folder.name, kind, config, tensors)


def _rope_theta(raw: dict, what: str) -> float:
    """The default-RoPE theta of a config; any scaled RoPE is refused (neither export maps its parameters)."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in (None, "default"):
        raise ConfigError(f"{what} uses {kind!r} RoPE scaling, which export does not map (only default RoPE)")
    return float(rope.get("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA)))


def _check_shapes(tensors: dict, expected: dict, src: Source, optional=()) -> None:
    missing = sorted(k for k in expected if k not in tensors and k not in optional)
    unexpected = sorted(k for k in tensors if k not in expected)
    if missing or unexpected:
        raise ConfigError(f"{src.folder} does not match its config.json as a {src.kind} drafter: missing "
                          f"{missing[:6] or 'none'}, unexpected {unexpected[:6] or 'none'}")
    for k, shape in expected.items():
        if k in tensors and tuple(tensors[k].shape) != tuple(shape):
            raise ConfigError(f"{src.folder}: tensor {k} has shape {tuple(tensors[k].shape)}, config.json implies "
                              f"{tuple(shape)}")


def dflash_spec(src: Source) -> tuple[dict, dict]:
    """(hyper-parameters, tensors checked and normalised) of a DFlash or DSpark folder (z-lab / DeepSpec / ours).
    The draft vocabulary and DeepSpec's frozen copies of the target's embed_tokens / lm_head are set aside."""
    raw = src.config
    dcfg = raw.get("dflash_config") or {}
    s = {"block_size": raw.get("block_size", dcfg.get("block_size")),
         "mask_token_id": dcfg.get("mask_token_id", raw.get("mask_token_id")),
         "target_layer_ids": dcfg.get("target_layer_ids", raw.get("target_layer_ids")),
         "num_target_layers": raw.get("num_target_layers")}
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        s[key] = raw.get(key)
    missing = [k for k, v in s.items() if v is None and k not in ("num_target_layers", "target_layer_ids")]
    if s["target_layer_ids"] is None and s["num_target_layers"] is None:
        missing.append("target_layer_ids (or num_target_layers)")
    if missing:
        raise ConfigError(f"{src.folder}/config.json lacks {', '.join(missing)} (needed to export a {src.kind} "
                          "drafter; target_layer_ids sit in dflash_config)")
    tensors = {(k[6:] if k.startswith("model.") else k): v for k, v in src.tensors.items()}
    where = f"{src.folder}/config.json"  # as the loader reads them: int("16") / bool("false") wrote another model

    def count(key, value, least=1):
        return config_int(value, key, where, least)

    H, heads = count("hidden_size", s["hidden_size"]), count("num_attention_heads", s["num_attention_heads"])
    qn = tensors.get("layers.0.self_attn.q_norm.weight")
    hd = count("head_dim", raw.get("head_dim") or (qn.shape[0] if qn is not None else H // heads))
    s.update(head_dim=hd, num_key_value_heads=count("num_key_value_heads", raw.get("num_key_value_heads", heads)),
             intermediate_size=count("intermediate_size", raw.get("intermediate_size", 3 * H)),
             rms_norm_eps=check_number(raw.get("rms_norm_eps", 1e-6), f"{where}: rms_norm_eps", 0.0),
             max_position_embeddings=count("max_position_embeddings", raw.get("max_position_embeddings", 32768)),
             hidden_act=raw.get("hidden_act", "silu"),
             attention_bias=check_flag(raw.get("attention_bias", False), f"{where}: attention_bias"),
             rope_theta=_rope_theta(raw, where), block_size=count("block_size", s["block_size"], 2),
             mask_token_id=count("mask_token_id", s["mask_token_id"], 0))
    if s["hidden_act"] != "silu":
        raise ConfigError(f"{src.folder}: hidden_act {s['hidden_act']!r}; the DFlash drafters here use silu")
    if any(t != "full_attention" for t in raw.get("layer_types") or []):
        raise ConfigError(f"{src.folder}: sliding-window draft layers ({raw['layer_types']}) are not exported")
    if src.kind == "dspark":
        opts = dspark_options(raw, where)
        if opts["markov_rank"] and opts["markov_head_type"] != "vanilla":
            raise ConfigError(f"{src.folder}: markov_head_type {opts['markov_head_type']!r}; only the vanilla Markov "
                              "head exports")
        s.update(opts, confidence_temperatures=dcfg.get("confidence_temperatures"))
    # the tensors a checkpoint of this config holds are the drafter model's own (the loader's strict check)
    model = model_from_dspark_config(raw, where=where) if src.kind == "dspark" else model_from_config(raw)
    # the loader's ids: a z-lab config may give only num_target_layers, and llama.cpp's converter derives others
    s["target_layer_ids"] = [int(i) for i in model.target_layer_ids]
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    V, H = int(s["vocab_size"]), int(s["hidden_size"])
    s["draft_vocab"] = tensors.pop("draft_vocab", None)
    for name in ("embed_tokens.weight", "lm_head.weight"):  # DeepSpec's frozen copies of the target's
        if name in tensors and tuple(tensors[name].shape) == (V, H):
            tensors.pop(name)
    _check_shapes(tensors, expected, src)
    return s, tensors


def eagle3_spec(src: Source) -> tuple[dict, dict]:
    """(hyper-parameters, tensors with EAGLE names: fc, midlayer.*, norm, lm_head, d2t, embed_tokens, input_norm)
    of an EAGLE/SpecForge or speculators EAGLE3 folder, read by the EAGLE3 loader's own parsing."""
    raw = src.config
    try:
        cfg = Eagle3Config.from_dict(raw)
        tensors = _normalise_keys(src.tensors)
    except ConfigError as exc:
        raise ConfigError(f"{src.folder}: {exc}") from None
    if cfg.hidden_act != "silu":
        raise ConfigError(f"{src.folder}: EAGLE3 hidden_act {cfg.hidden_act!r} (silu only)")
    rope = dict(cfg.rope_scaling or {})
    rope.pop("rope_theta", None)
    s = {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
         "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
         "intermediate_size": cfg.intermediate_size, "head_dim": cfg.head_dim,
         "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
         "rms_norm_eps": cfg.rms_norm_eps, "rope": rope or None, "rope_theta": cfg.rope_theta,
         "max_position_embeddings": cfg.max_position_embeddings,
         "norm_before_residual": cfg.norm_before_residual, "norm_before_fc": cfg.norm_before_fc,
         "attention_bias": cfg.attention_bias, "hidden_act": cfg.hidden_act,
         # HF hidden_states indices: the config's ids are SpecForge's, the output of layer i (= index i + 1)
         "feature_layers": None if cfg.aux_layer_ids is None else [int(i) + 1 for i in cfg.aux_layer_ids]}
    V, DV = cfg.vocab_size, cfg.draft_vocab_size
    # the tensors a checkpoint of this config holds are the head's own (RoPE sets no shape: built without it)
    head = Eagle3Head(dataclasses.replace(cfg, rope_scaling=None), with_embedding="embed_tokens.weight" in tensors)
    expected = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    _check_shapes(tensors, expected, src, {"t2d"} | ({"d2t"} if DV == V else set()))
    if "d2t" in tensors:
        tid = offset_vocab_ids(tensors["d2t"], None, V, str(src.folder))
        if DV == V:
            if not bool((tid == torch.arange(V)).all()):
                raise ConfigError(f"{src.folder}: a full-size d2t that permutes the vocabulary is not exported")
            tensors.pop("d2t")  # the identity map: nothing to carry
    tensors.pop("t2d", None)  # derived from d2t wherever it is needed
    return s, tensors


# ---- GGUF (llama.cpp) ---------------------------------------------------------------------------------------
def _gguf():
    try:
        import gguf
    except ImportError as exc:
        raise ConfigError("export --to llama.cpp needs the gguf package: pip install gguf") from exc
    return gguf


def tokenizer_source(target: str | os.PathLike | None) -> Path:
    """The GGUF whose tokenizer the draft GGUF copies: a .gguf path, or an embedded target's name."""
    target = target or DEFAULT_TOKENIZER
    path = Path(target).expanduser()
    if path.is_file():
        return path
    from graft_block.target import EMBEDDED_TARGETS, embedded_gguf

    if str(target) in EMBEDDED_TARGETS:
        return embedded_gguf(str(target))
    if path.is_dir():
        raise ConfigError(f"--target {target} is a folder; give the target's GGUF file (the one llama.cpp runs): "
                          "the draft GGUF copies its tokenizer")
    raise ConfigError(f"--target {target!r} is neither a GGUF file nor an embedded target "
                      f"({', '.join(EMBEDDED_TARGETS)})")


def tokenizer_fields(path: Path) -> list[tuple]:
    """(key, value, type, sub-type) of every ``tokenizer.*`` field of a GGUF, values exactly as stored (strings as
    bytes). Parsed once per file version (a 49k-token vocabulary takes ~2 s to read)."""
    path = Path(path)
    st = path.stat()
    return list(_tokenizer_fields(str(path.resolve()), st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=4)
def _tokenizer_fields(path: str, mtime_ns: int, size: int) -> tuple:
    gguf = _gguf()
    T = gguf.GGUFValueType
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - any parse failure names the file
        raise ConfigError(f"{path} is not a readable GGUF ({type(exc).__name__}: {exc})") from exc
    out = []
    for key, f in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = f.types[0]
        if kind == T.ARRAY:
            if len(f.types) != 2:
                continue  # nested arrays: no tokenizer field uses them
            sub = f.types[1]
            vals = [bytes(f.parts[i]) if sub == T.STRING else f.parts[i].tolist()[0] for i in f.data]
            out.append((key, vals, kind, sub))
        elif kind == T.STRING:
            out.append((key, bytes(f.parts[f.data[0]]), kind, None))
        else:
            out.append((key, f.parts[f.data[0]].tolist()[0], kind, None))
    if not any(k == "tokenizer.ggml.tokens" for k, *_ in out):
        raise ConfigError(f"{path} holds no tokenizer (tokenizer.ggml.tokens): pass the target model's GGUF")
    return tuple(out)


def target_head_rows(path: Path, ids: torch.Tensor, hidden: int, vocab: int):
    """The target's LM-head rows for the draft ids ``ids``, from its GGUF, in the GGUF's own type (F32 / F16 /
    BF16 / any quantized type: rows are whole blocks, so a row gather keeps llama.cpp's own numbers): (array, GGML
    type or None, tensor name), or None when the GGUF holds neither ``output.weight`` nor a tied
    ``token_embd.weight`` (a tokenizer-only GGUF)."""
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - any parse failure names the file
        raise ConfigError(f"{path} is not a readable GGUF ({type(exc).__name__}: {exc})") from exc
    split = reader.fields.get("split.count")
    if split is not None and int(split.parts[split.data[0]][0]) > 1:  # the head may sit in another shard
        raise ConfigError(f"{path} is one shard of a split GGUF: merge it (llama-gguf-split --merge) and pass the "
                          "merged file with --target")
    by_name = {t.name: t for t in reader.tensors}
    t = by_name.get("output.weight") or by_name.get("token_embd.weight")
    if t is None:
        return None
    shape = tuple(int(x) for x in t.shape.tolist())  # GGML order: (hidden, vocab)
    if shape != (hidden, vocab):
        raise ConfigError(f"{path}: {t.name} is {shape[0]} x {shape[-1]} (hidden x vocab) but the drafter reads "
                          f"{hidden}-wide states over {vocab} tokens: pass the GGUF of the target it was trained "
                          "for with --target")
    rows = np.ascontiguousarray(np.asarray(t.data)[ids.numpy()])
    plain = t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    return rows, None if plain else t.tensor_type, t.name


def llama_rope_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF (NeoX halves) q/k projection rows -> llama.cpp's NORM RoPE order: per head, row i of the first half and
    row i of the second half become rows 2i and 2i+1."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_array(t: torch.Tensor):
    """A tensor -> (numpy array, raw GGML type or None). Dtypes are kept; 1-D float tensors widen to F32 (exact)."""
    gguf = _gguf()
    t = t.detach().cpu().contiguous()
    if t.dtype in (torch.float16, torch.bfloat16, torch.float32) and t.dim() <= 1:
        return t.float().numpy(), None
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), gguf.GGMLQuantizationType.BF16
    if t.dtype in (torch.float16, torch.float32, torch.int64):
        return t.numpy(), None
    raise ConfigError(f"tensor dtype {t.dtype} is not exported to GGUF (F16, BF16 or F32 weights)")


def _write_gguf(out: Path, arch: str, kv: list, tensors: list) -> None:
    gguf = _gguf()
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for key, val, vtype, sub in kv:
        try:
            writer.add_key_value(key, val, vtype, sub_type=sub)
        except TypeError:  # gguf < 0.16 infers an array's item type (INT32 / FLOAT32 / STRING, as used here)
            writer.add_key_value(key, val, vtype)
    for name, t in tensors:
        arr, raw = t if isinstance(t, tuple) else _gguf_array(t)  # a tuple is already GGUF-encoded
        writer.add_tensor(name, arr, raw_dtype=raw)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)  # a reader never sees a half-written file


def _common_kv(arch: str, name: str, s: dict, n_layers: int, tokenizer: list) -> list:
    from gguf import GGUFValueType as T

    p = arch + "."
    kv = [("general.name", name, T.STRING, None),
          (p + "context_length", s["max_position_embeddings"], T.UINT32, None),
          (p + "embedding_length", s["hidden_size"], T.UINT32, None),
          (p + "block_count", n_layers, T.UINT32, None),
          (p + "feed_forward_length", s["intermediate_size"], T.UINT32, None),
          (p + "attention.head_count", s["num_attention_heads"], T.UINT32, None),
          (p + "attention.head_count_kv", s["num_key_value_heads"], T.UINT32, None),
          (p + "attention.key_length", s["head_dim"], T.UINT32, None),
          (p + "attention.value_length", s["head_dim"], T.UINT32, None),
          (p + "attention.layer_norm_rms_epsilon", s["rms_norm_eps"], T.FLOAT32, None),
          (p + "rope.freq_base", s["rope_theta"], T.FLOAT32, None),
          (p + "rope.dimension_count", s["head_dim"], T.UINT32, None),
          (p + "vocab_size", s["vocab_size"], T.UINT32, None)]
    return kv + tokenizer


def _tokenizer_for(s: dict, target, src: Source, drop_mask: bool) -> list:
    path = tokenizer_source(target)
    fields = tokenizer_fields(path)
    n = next(len(v) for k, v, *_ in fields if k == "tokenizer.ggml.tokens")
    if n != int(s["vocab_size"]):
        raise ConfigError(f"{src.folder} drafts over {s['vocab_size']} tokens but {path} has {n}: pass the GGUF of "
                          "the target this drafter was trained for with --target")
    return [f for f in fields if not (drop_mask and f[0] == MASK_KEY)]


_DFLASH_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                 "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                 "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
                 "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
                 "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                 "mlp.down_proj.weight": "ffn_down.weight"}
GGUF_DFLASH_NAMES = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
                     "norm.weight": "output_norm.weight", "markov_head.markov_w1.weight": "markov_w1.weight",
                     "markov_head.markov_w2.weight": "markov_w2.weight",
                     "confidence_head.proj.weight": "conf_proj.weight", "confidence_head.proj.bias": "conf_proj.bias"}


def gguf_dflash_name(name: str) -> str:
    if name in GGUF_DFLASH_NAMES:
        return GGUF_DFLASH_NAMES[name]
    _, i, rest = name.split(".", 2)
    return f"blk.{i}.{_DFLASH_LAYER[rest]}"


def _dflash_gguf(src: Source, out: Path, target, dspark: bool) -> ExportResult:
    from gguf import GGUFValueType as T

    s, tensors = dflash_spec(src)
    res = ExportResult(out, "llama.cpp", src.kind)
    if s["attention_bias"]:
        raise ConfigError(f"{src.folder}: attention_bias=true; llama.cpp's DFlash has no q/k/v/o biases")
    sample_from_anchor = dspark and s["alignment"] == "deepspec"
    if dspark and s["confidence_head"] and not s["confidence_with_markov"]:
        for k in ("confidence_head.proj.weight", "confidence_head.proj.bias"):
            tensors.pop(k)
        res.lost.append("DSpark's confidence head (it reads no Markov embedding; llama.cpp loads one only as "
                        "conf_proj over [hidden; markov_w1[prev]], with a Markov head) dropped: drafts are "
                        "unchanged, --spec-draft-p-min is refused by llama.cpp")
    has_conf = "confidence_head.proj.weight" in tensors
    if dspark and s["markov_rank"] == 0:
        res.notes.append("no Markov head: llama.cpp runs this as a plain DFlash block")
    kv = _common_kv("dflash", src.name, s, int(src.config["num_hidden_layers"]),
                    _tokenizer_for(s, target, src, drop_mask=True))
    kv += [("dflash.block_size", s["block_size"], T.UINT32, None),
           ("dflash.target_layers", [i + 1 for i in s["target_layer_ids"]], T.ARRAY, T.INT32),
           ("dflash.sample_from_anchor", sample_from_anchor, T.BOOL, None),
           (MASK_KEY, s["mask_token_id"], T.UINT32, None)]
    if dspark:
        kv.append(("dflash.has_confidence_head", has_conf, T.BOOL, None))
    _lost_common(res, s, src, "llama.cpp", " and compares it with --spec-draft-p-min")
    if dspark and s["markov_rank"]:
        res.notes.append("llama.cpp chains the Markov head on the argmax draft even when sampling (T > 0); ours "
                         "conditions on the sampled token")
    if sample_from_anchor:
        res.notes.append("DeepSpec block alignment (the anchor row drafts): run with --spec-type draft-dspark; "
                         "draft-dflash reads rows 1.. and would be misaligned")
    items = {gguf_dflash_name(k): v for k, v in tensors.items()}
    items.update(_draft_vocab_head(s, tensors, target, res))  # adds the head and d2t, narrows a DSpark's markov_w2
    _write_gguf(out, "dflash", kv, list(items.items()))
    res.tensors = list(items)
    return res


def draft_ids(s: dict) -> torch.Tensor | None:
    """A DFlash / DSpark checkpoint's draft vocabulary (target ids, as stored), or None when it drafts over the whole
    vocabulary; ids outside it or repeated are refused (a negative id would wrap in a gather)."""
    vocab, V = s.get("draft_vocab"), int(s["vocab_size"])
    if vocab is None or vocab.numel() >= V:
        return None
    ids = vocab.long().cpu()
    if ids.min() < 0 or ids.max() >= V or ids.unique().numel() != ids.numel():
        raise ConfigError(f"the checkpoint's draft_vocab holds ids outside 0..{V - 1} or twice: it was not built "
                          f"for this {V}-token vocabulary (rebuild it with graft-block train --draft-vocab)")
    return ids


def _draft_vocab_head(s: dict, tensors: dict, target, res: ExportResult) -> dict:
    """A draft vocabulary kept for llama.cpp: ``output.weight`` = the target's LM-head rows for the draft ids (so
    the draft LM head reads 16k rows, not 49k: its largest cost on a small target) and ``d2t`` = those ids, which
    llama.cpp's DFlash loader reads as a reduced draft vocabulary; a DSpark's ``markov_w2`` keeps the same rows, as
    ours does. Returns those GGUF tensors by name (empty when the restriction is dropped for want of a head in the
    target's GGUF, ``LOST``)."""
    ids = draft_ids(s)
    if ids is None:
        return {}
    V = int(s["vocab_size"])
    path = tokenizer_source(target)
    head = target_head_rows(path, ids, int(s["hidden_size"]), V)
    if head is None:
        res.lost.append(LOST["draft_vocab"].format(n=ids.numel(), V=V, path=path))
        return {}
    rows, raw, name = head
    out = {"output.weight": (rows, raw), "d2t": ids.contiguous()}
    w2 = "markov_head.markov_w2.weight"
    if w2 in tensors:  # llama.cpp's markov_w2 spans the draft vocabulary (its bias is scattered by d2t)
        out[gguf_dflash_name(w2)] = tensors[w2][ids].contiguous()
    res.notes.append(f"draft vocabulary kept ({ids.numel()} of {V} ids): output.weight = the target's {name} rows "
                     f"for them ({raw.name if raw is not None else rows.dtype}, from {path}), d2t = their ids. The "
                     "draft LM head is the target's as of this export: re-export for a re-quantized target")
    return out


def _lost_common(res: ExportResult, s: dict, src: Source, where: str, how: str) -> None:
    if s.get("markov_rank") and s.get("markov_first_draft") is False:
        res.lost.append(LOST["first_draft"].format(where=where))
    temps = s.get("confidence_temperatures")
    if s.get("confidence_head") and temps is not None and any(abs(float(t) - 1.0) > 1e-9 for t in temps):
        res.lost.append(LOST["temperatures"].format(where=where, how=how))


def gguf_dflash(src: Source, out: Path, target=None) -> ExportResult:
    """DFlash -> llama.cpp ``dflash`` GGUF (``--spec-type draft-dflash``)."""
    return _dflash_gguf(src, out, target, dspark=False)


def gguf_dspark(src: Source, out: Path, target=None) -> ExportResult:
    """DSpark -> llama.cpp ``dflash`` GGUF with ``markov_w1/w2`` (+ ``conf_proj``) (``--spec-type draft-dspark``)."""
    return _dflash_gguf(src, out, target, dspark=True)


_EAGLE_GGUF = {"fc.weight": "fc.weight", "input_norm.weight": "enc.output_norm.weight",
               "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
               "embed_tokens.weight": "token_embd.weight", "d2t": "d2t",
               "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
               "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
               "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
               "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
               "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
               "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
               "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
               "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
               "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
               "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight"}


def gguf_eagle3(src: Source, out: Path, target=None) -> ExportResult:
    """EAGLE3 -> llama.cpp ``eagle3`` GGUF (``--spec-type draft-eagle3``)."""
    from gguf import GGUFValueType as T

    s, tensors = eagle3_spec(src)
    if s["attention_bias"]:
        raise ConfigError(f"{src.folder}: attention_bias=true; llama.cpp's EAGLE3 has no q/k/v biases")
    if s["rope"]:
        raise ConfigError(f"{src.folder}: RoPE scaling {s['rope']} is not exported (only default RoPE)")
    if s["feature_layers"] is None:
        raise ConfigError(f"{src.folder}/config.json names no eagle_aux_hidden_state_layer_ids; llama.cpp needs "
                          "the target layers (add eagle_config.eagle_aux_hidden_state_layer_ids)")
    if len(s["feature_layers"]) != 3:
        raise ConfigError(f"{src.folder}: llama.cpp's EAGLE3 fuses exactly 3 target layers, the config names "
                          f"{s['feature_layers']}")
    res = ExportResult(out, "llama.cpp", "eagle3")
    kv = _common_kv("eagle3", src.name, s, 1, _tokenizer_for(s, target, src, drop_mask=False))
    kv += [("eagle3.target_layers", list(s["feature_layers"]), T.ARRAY, T.INT32),
           ("eagle3.target_hidden_size", s["target_hidden_size"], T.UINT32, None),
           ("eagle3.norm_before_residual", s["norm_before_residual"], T.BOOL, None),
           ("eagle3.norm_before_fc", s["norm_before_fc"], T.BOOL, None)]
    items = []
    for k, v in tensors.items():
        if k == "midlayer.self_attn.q_proj.weight":
            v = llama_rope_permute(v, s["num_attention_heads"])
        elif k == "midlayer.self_attn.k_proj.weight":
            v = llama_rope_permute(v, s["num_key_value_heads"])
        elif k == "d2t":
            v = v.long() + torch.arange(v.numel())  # llama.cpp scatters by absolute target id
        items.append((_EAGLE_GGUF[k], v))
    res.notes.append("llama.cpp drafts one chain (--spec-draft-n-max), not this project's EAGLE-2 tree")
    _write_gguf(out, "eagle3", kv, items)
    res.tensors = [n for n, _ in items]
    return res


# ---- vLLM speculators ---------------------------------------------------------------------------------------
def _proposal(tokens: int, verifier: str | None) -> dict:
    archs = []
    if verifier and (Path(verifier).expanduser() / "config.json").is_file():
        archs = json.loads((Path(verifier).expanduser() / "config.json").read_text()).get("architectures") or []
    return {"proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(archs)}}


def _dtype_name(tensors: dict) -> str:
    t = next((v for v in tensors.values() if v.is_floating_point() and v.dim() == 2), None)
    return str(t.dtype).replace("torch.", "") if t is not None else "float16"


def _layer_config(s: dict, model_type: str, n_layers: int, dtype: str, extra: dict) -> dict:
    cfg = {"model_type": model_type, "vocab_size": int(s["vocab_size"]), "hidden_size": int(s["hidden_size"]),
           "intermediate_size": s["intermediate_size"], "num_hidden_layers": n_layers,
           "num_attention_heads": int(s["num_attention_heads"]), "num_key_value_heads": s["num_key_value_heads"],
           "head_dim": s["head_dim"], "hidden_act": "silu", "rms_norm_eps": s["rms_norm_eps"],
           "max_position_embeddings": s["max_position_embeddings"], "attention_bias": s["attention_bias"],
           "rope_theta": s["rope_theta"], "rope_parameters": {"rope_type": "default", "rope_theta": s["rope_theta"]},
           "tie_word_embeddings": False, "torch_dtype": dtype, "dtype": dtype}
    cfg.update(extra)
    return cfg


def _write_speculators(out: Path, config: dict, tensors: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


HF_HEAD_NAMES = ("lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight")  # untied first, then tied


def head_rows_tensor(target, ids: torch.Tensor, hidden: int, vocab: int) -> tuple[torch.Tensor, str] | None:
    """The target's LM-head rows for ``ids`` as a float tensor, and where they came from: ``target`` is an HF folder
    (``lm_head.weight``, else the tied ``model.embed_tokens.weight``, in its own dtype), a GGUF or an embedded
    target's name (``target_head_rows``, a quantized type de-quantized to float32; None = the embedded default).
    None when the weights hold no head (a tokenizer-only GGUF)."""
    folder = Path(target).expanduser() if target is not None else None
    if folder is None or not folder.is_dir():
        path = tokenizer_source(target)
        head = target_head_rows(path, ids, hidden, vocab)
        if head is None:
            return None
        rows, raw, name = head
        if raw is not None:
            rows = _gguf().quants.dequantize(rows, raw)
        return torch.from_numpy(np.ascontiguousarray(rows)), f"{name} of {path} ({raw.name if raw else rows.dtype})"
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder} holds no *.safetensors: give the target's HF folder with its weights, or its "
                          "GGUF, with --target")
    found = {}  # head name -> (the first file holding it, its shape)
    for f in files:
        with safe_open(str(f), "pt") as fh:
            for name in set(HF_HEAD_NAMES) & set(fh.keys()) - set(found):
                found[name] = (f, fh.get_slice(name).get_shape())
    name = next((n for n in HF_HEAD_NAMES if n in found), None)
    if name is None:
        raise ConfigError(f"{folder}: its weights hold neither lm_head.weight nor model.embed_tokens.weight: give "
                          "the target's full weights with --target")
    f, shape = found[name]
    if tuple(shape) != (vocab, hidden):
        raise ConfigError(f"{folder}: {name} is {tuple(shape)} but the drafter reads {hidden}-wide states over "
                          f"{vocab} tokens: give the target it was trained for with --target")
    with safe_open(str(f), "pt") as fh:
        rows = fh.get_tensor(name)[ids]
    return rows, f"{name} of {f} ({str(rows.dtype).replace('torch.', '')})"


def _speculators_draft_vocab(s: dict, tensors: dict, target, verifier, res: ExportResult) -> dict:
    """A draft vocabulary kept for vLLM speculators: ``lm_head.weight`` = the target's head rows for the draft ids in
    ascending id order (speculators rebuilds the verifier's rows with the ``t2d`` mask, which orders them so),
    ``d2t`` = offsets (target id = draft index + d2t), ``t2d`` = the mask, and a DSpark's ``markov_w2`` narrowed to
    the same rows. The rows come from ``--target``, else a ``--verifier`` folder, else the embedded default target
    (dropped with a LOST line when that one does not fit). Returns the tensors to write (empty when dropped)."""
    V, H = int(s["vocab_size"]), int(s["hidden_size"])
    ids = draft_ids(s).sort().values
    folder = verifier if target is None and verifier and Path(verifier).expanduser().is_dir() else None
    source = target if target is not None else folder  # None: the embedded default

    def lost(why: str) -> dict:
        res.lost.append(LOST["draft_vocab_vllm"].format(n=ids.numel(), V=V, why=why))
        return {}

    try:
        head = head_rows_tensor(source, ids, H, V)
    except ConfigError as exc:
        if target is not None:  # asked for by name: its problem is an error
            raise
        return lost(f"the {'--verifier folder' if folder else 'embedded default target'} gives no head rows that fit "
                    f"this drafter ({exc})")
    if head is None:
        return lost(f"{tokenizer_source(source)} holds no LM head")
    rows, where = head
    d2t, t2d = vocab_maps(ids, V)
    out = {"lm_head.weight": rows.to(tensors["fc.weight"].dtype).contiguous(), "d2t": d2t, "t2d": t2d}
    w2 = "markov_head.markov_w2.weight"
    if w2 in tensors:  # speculators' markov_w2 projects onto the draft vocabulary
        out[w2] = tensors[w2][ids].contiguous()
    res.notes.append(f"draft vocabulary kept ({ids.numel()} of {V} ids): lm_head.weight = the target's head rows "
                     f"for them ({where}), d2t / t2d = speculators' maps. The draft LM head is the target's as of "
                     "this export: re-export for another target revision")
    return out


def _dflash_speculators(src: Source, out: Path, verifier, tokens, dspark: bool, target=None) -> ExportResult:
    s, tensors = dflash_spec(src)
    res = ExportResult(out, "speculators", src.kind)
    aux = [i + 1 for i in s["target_layer_ids"]]  # vLLM capture ids = HF hidden_states indices
    n_target = s.get("num_target_layers")
    if n_target is not None and int(n_target) in aux:
        raise ConfigError(f"{src.folder}: target layer {int(n_target) - 1} is the target's last; speculators takes "
                          "the last layer's state implicitly and has no aux id for it")
    anchor = dspark and s["alignment"] == "deepspec"
    L = int(src.config["num_hidden_layers"])
    cfg = {"architectures": ["DSparkSpeculator" if dspark else "DFlashSpeculator"],
           "speculators_model_type": "dspark" if dspark else "dflash",
           "transformer_layer_config": _layer_config(s, "qwen3", L, _dtype_name(tensors),
                                                     {"layer_types": ["full_attention"] * L}),
           "draft_vocab_size": int(s["vocab_size"]), "block_size": s["block_size"],
           "target_hidden_size": int(s["hidden_size"]), "aux_hidden_state_layer_ids": aux,
           "mask_token_id": s["mask_token_id"], "sample_from_anchor": anchor}
    if dspark:
        cfg.update(markov_rank=s["markov_rank"], markov_head_type=s["markov_head_type"],
                   enable_confidence_head=s["confidence_head"],
                   confidence_head_with_markov=s["confidence_with_markov"])
    default_tokens = s["block_size"] if anchor else s["block_size"] - 1
    if tokens and tokens > default_tokens:  # one block forward drafts them all: a longer chain has no logits
        raise ConfigError(f"--speculative-tokens {tokens}: one {cfg['speculators_model_type']} block drafts at most "
                          f"{default_tokens} tokens (block_size {s['block_size']}"
                          f"{'' if anchor else ' - 1'}); give {default_tokens} or fewer")
    cfg["speculators_config"] = {"algorithm": cfg["speculators_model_type"],
                                 **_proposal(tokens or default_tokens, verifier)}
    _lost_common(res, s, src, "vLLM", " (speculators has no calibration field)")
    if draft_ids(s) is not None:
        kept = _speculators_draft_vocab(s, tensors, target, verifier, res)
        tensors = {**tensors, **kept}
        if kept:
            cfg["draft_vocab_size"] = int(s["draft_vocab"].numel())
    elif target is not None:
        res.notes.append("--target not read: this drafter has no draft vocabulary, so vLLM shares the target's head")
    if not verifier:
        res.notes.append("no --verifier: speculators_config.verifier.name_or_path is null; serve with the target "
                         "as vLLM's --model")
    _write_speculators(out, cfg, tensors)
    res.tensors = sorted(tensors)
    return res


def speculators_dflash(src: Source, out: Path, verifier=None, tokens=None, target=None) -> ExportResult:
    """DFlash -> speculators ``dflash`` (z-lab's tensor names; the target's embeddings stay shared, and its head too
    unless a draft vocabulary brings its own rows)."""
    return _dflash_speculators(src, out, verifier, tokens, dspark=False, target=target)


def speculators_dspark(src: Source, out: Path, verifier=None, tokens=None, target=None) -> ExportResult:
    """DSpark -> speculators ``dspark`` (``markov_head.*``, ``confidence_head.*``; alignment as
    ``sample_from_anchor``)."""
    return _dflash_speculators(src, out, verifier, tokens, dspark=True, target=target)


def speculators_eagle3(src: Source, out: Path, verifier=None, tokens=None, target=None) -> ExportResult:
    """EAGLE3 -> speculators ``eagle3`` (``midlayer.*`` -> ``layers.0.*``, d2t offsets and t2d as speculators
    stores them; its head is its own, so ``target`` is not read)."""
    s, tensors = eagle3_spec(src)
    if s["attention_bias"]:
        raise ConfigError(f"{src.folder}: attention_bias=true (q/k/v biases, no o_proj bias) has no speculators "
                          "layout")
    res = ExportResult(out, "speculators", "eagle3")
    if target is not None:
        res.notes.append("--target not read: an EAGLE3 drafter carries its own LM head (and its d2t / t2d)")
    V, DV = s["vocab_size"], s["draft_vocab_size"]
    extra = {"rope_scaling": s["rope"]} if s["rope"] else {}
    if s["rope"]:
        extra["rope_parameters"] = {**s["rope"], "rope_theta": s["rope_theta"]}
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
           "transformer_layer_config": _layer_config(s, "llama", 1, _dtype_name(tensors), {"mlp_bias": False, **extra}),
           "draft_vocab_size": DV, "norm_before_residual": s["norm_before_residual"],
           "norm_before_fc": s["norm_before_fc"], "target_hidden_size": s["target_hidden_size"]}
    if s["feature_layers"] is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = list(s["feature_layers"])
    else:
        res.notes.append("no aux layer ids in the config: vLLM uses its default (2, N//2, N-3), as this project")
    cfg["speculators_config"] = {"algorithm": "eagle3", **_proposal(tokens or 3, verifier)}
    out_t = {}
    for k, v in tensors.items():
        out_t["layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k] = v
    if DV < V:
        out_t["d2t"], out_t["t2d"] = vocab_maps(torch.arange(DV) + out_t["d2t"].long(), V)
    if not verifier:
        res.notes.append("no --verifier: speculators_config.verifier.name_or_path is null; serve with the target "
                         "as vLLM's --model")
    res.notes.append("vLLM drafts one chain (num_speculative_tokens), not this project's EAGLE-2 tree")
    if "embed_tokens.weight" not in out_t:
        res.notes.append("no embed_tokens (vLLM shares the target's); speculators' own from_pretrained then leaves "
                         "them zero: call its _load_verifier_weights(overwrite_embed_tokens=True) before using it")
    _write_speculators(out, cfg, out_t)
    res.tensors = sorted(out_t)
    return res


EXPORTERS = {("llama.cpp", "dflash"): gguf_dflash, ("llama.cpp", "dspark"): gguf_dspark,
             ("llama.cpp", "eagle3"): gguf_eagle3, ("speculators", "dflash"): speculators_dflash,
             ("speculators", "dspark"): speculators_dspark, ("speculators", "eagle3"): speculators_eagle3}


# ---- the entry points ---------------------------------------------------------------------------------------
def _check_out(out: Path, to: str, src: Source, force: bool) -> None:
    if out.resolve() == src.folder.resolve() or src.folder.resolve() in out.resolve().parents:
        raise ConfigError(f"--out {out} lies inside the source drafter folder {src.folder}; write elsewhere")
    if to == "llama.cpp":
        if out.is_dir():
            raise ConfigError(f"--out {out} is a folder; --to llama.cpp writes one file (e.g. {out / src.name}.gguf)")
        if out.exists() and not force:
            raise ConfigError(f"--out {out} exists; pass --force to overwrite it")
        out.parent.mkdir(parents=True, exist_ok=True)
        return
    if out.is_file():
        raise ConfigError(f"--out {out} is a file; --to speculators writes a folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ConfigError(f"--out {out} exists and is not empty; pass --force to overwrite its config.json and "
                              "model.safetensors")
        stray = [p.name for p in out.iterdir()
                 if p.suffix in (".safetensors", ".bin") and p.name != "model.safetensors"]
        if stray:
            raise ConfigError(f"--out {out} holds other weights {stray}; a loader would read them too: remove them")


def export(source, to: str, out, force: bool = False, target=None, verifier: str | None = None,
           speculative_tokens: int | None = None) -> ExportResult:
    """Export the drafter ``source`` (bundled name or folder) to ``to`` ("llama.cpp" or "speculators") at ``out``.
    ``target``: the target's GGUF (or an embedded target name) whose tokenizer, and a draft vocabulary's LM-head
    rows, a GGUF copies; for speculators, where a draft vocabulary's head rows come from (also an HF folder;
    default: a ``verifier`` folder, else the embedded target);
    ``verifier``: the target's HF id or folder recorded in a speculators config; ``speculative_tokens``: the
    speculators proposal length (default: block_size - 1 for DFlash, 3 for EAGLE3)."""
    if to not in FORMATS:
        raise ConfigError(f"--to must be one of {', '.join(FORMATS)}, got {to!r}")
    if speculative_tokens is not None and int(speculative_tokens) < 1:
        raise ConfigError(f"--speculative-tokens must be >= 1, got {speculative_tokens}")
    src = load_source(source)
    out = Path(out).expanduser()
    _check_out(out, to, src, force)
    if to == "llama.cpp":
        return EXPORTERS[(to, src.kind)](src, out, target)
    return EXPORTERS[(to, src.kind)](src, out, verifier, speculative_tokens, target)


def export_llamacpp(source, out, tokenizer_gguf=None, force: bool = True) -> Path:
    """``source`` -> a llama.cpp draft GGUF at ``out`` (tokenizer from ``tokenizer_gguf``, default the embedded
    target's GGUF); returns the path (what eval/llamacpp.py calls)."""
    return export(source, "llama.cpp", out, force=force, target=tokenizer_gguf).path


def spec_type(kind: str) -> str:
    return {"dflash": "draft-dflash", "dspark": "draft-dspark", "eagle3": "draft-eagle3"}[kind]


def main(argv=None) -> ExportResult:
    ap = argparse.ArgumentParser(
        description="Export a drafter to llama.cpp (a GGUF for llama-speculative-simple / llama-server -md) or to "
                    "vLLM speculators (a folder). What does not survive the trip is printed.")
    ap.add_argument("source", metavar="NAME_OR_FOLDER", help="a bundled drafter name or a drafter folder")
    ap.add_argument("--to", required=True, choices=FORMATS)
    ap.add_argument("--out", required=True, help="llama.cpp: the .gguf file to write; speculators: the folder")
    ap.add_argument("--force", action="store_true", help="overwrite an existing --out")
    ap.add_argument("--target", default=None,
                    help=f"llama.cpp: the target's GGUF (or an embedded target name) whose tokenizer, and a draft "
                         f"vocabulary's LM-head rows, the draft GGUF copies (default {DEFAULT_TOKENIZER}); "
                         "speculators: where a draft vocabulary's LM-head rows come from, also an HF folder "
                         f"(default: a --verifier folder, else {DEFAULT_TOKENIZER})")
    ap.add_argument("--verifier", default=None,
                    help="speculators: the target's HF id or folder, recorded as speculators_config.verifier")
    ap.add_argument("--speculative-tokens", type=int, default=None,
                    help="speculators: the greedy proposal length (default block_size - 1 for DFlash, block_size "
                         "for anchor-drafting DSpark, 3 for EAGLE3)")
    args = ap.parse_args(argv)
    if args.to == "llama.cpp" and (args.verifier or args.speculative_tokens):
        raise ConfigError("--verifier and --speculative-tokens apply to --to speculators")
    res = export(args.source, args.to, args.out, force=args.force, target=args.target, verifier=args.verifier,
                 speculative_tokens=args.speculative_tokens)
    print(f"wrote {res.path} ({res.format}, {res.kind}, {len(res.tensors)} tensors)")
    for line in res.lost:
        print(f"  lost: {line}")
    for line in res.notes:
        print(f"  note: {line}")
    if res.format == "llama.cpp":
        print(f"  run:  llama-speculative-simple -m TARGET.gguf -md {res.path} --spec-type {spec_type(res.kind)} "
              "--spec-draft-n-max N -p PROMPT")
    return res


if __name__ == "__main__":
    sys.exit(run_command(main, "python -m graft_block.drafters.export"))
