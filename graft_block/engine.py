"""The lean forward: a static-KV-cache forward for Llama-family decoders (Llama, Qwen2, Qwen3, Mistral), the
same arithmetic as the Hugging Face model with less around it.

Why it exists: at 1-16 rows a decode step or a tree verify on a small CPU target spends a third of its time
outside the matrix products (cache concatenation, mask building, hundreds of small ops). Here the KV cache is
pre-allocated and written in place, q/k/v and gate/up are one product each, and a tree is verified with its
additive ancestor mask over a view of the cache. ``Target`` calls it for prefill / verify / compact when
``engine="lean"``; every drafter and the AR baseline go through it alike (one verification path).

Small-row products: which BLAS is fastest at 1-16 rows depends on the CPU, by up to 2x, so on CPU fp32 the
forward picks its matrix-product kernel by measuring the candidates once per machine (``choose_gemm``; cached
under the user cache dir; ``GRAFT_BLOCK_GEMM=mkl|openblas|onednn|skinny``, or a pair such as ``onednn+skinny``,
overrides):
- ``mkl``: torch's own ``F.linear``, plus MKL's packed GEMM (``cblas_sgemm_pack``, the kernel inductor's
  max-autotune picks on CPU) for the row buckets where it wins (8 and 16 on Intel Xeon: 1.3-1.5x). A pack serves
  one row count, so a forward of more than a quarter of a bucket is padded up to it: padded rows are masked out of
  every real row's attention, their cache entries lie past ``len`` and are overwritten later, and their logits
  are dropped.
- ``openblas``: the OpenBLAS that numpy ships, called on the same memory. On AMD EPYC it is 2x MKL at 1 row (MKL
  stays far from the bandwidth floor there) and 1.5-2x at 8-16 rows. Its own threads do the products, so torch
  runs the forward's small ops on one thread: two thread pools spinning on 2 cores slow each other 3-10x.
- ``onednn``: the oneDNN (MKL-DNN) inside torch, on weights reordered once into its blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``, the op inductor's weight freezing uses). MKL picks its kernels by
  CPU vendor, oneDNN by instruction set, so on AMD EPYC (AVX-512) it is 2-2.5x MKL and OpenBLAS at 8-16 rows and
  within 10% of OpenBLAS at 1. One reordered copy serves every row count, and a row's output does not depend on
  how many rows share the product, so a decode step and a tree verify compute the same logits for the same prefix.
- ``skinny`` (graft_block/skinny.py), made for decode steps and tree verifies and able to run any forward: C built
  on first use, on weights packed once into blocks of outputs sized for the CPU's vector registers; near the
  bandwidth floor at 1-8 rows, 1.2-1.8x oneDNN at 1-16 rows on AMD EPYC, on par at 65. A row's output does not
  depend on the row count either. As the main kernel it is the engine's only copy of the weights.
When skinny runs every forward, the decoder layers run in C as well (``skinny.DecoderLayers``: norms, rope, the
cache write, attention, SwiGLU and residuals around skinny's products, every layer of a forward in one call, keys
cached transposed). The torch layers cost ~1,000 small ops a decode step, 3-4 ms of a 12-16 ms step on the 2-core
AVX-512 EPYC; in C a step took 13.2 against 15.9 ms and a 17-row verify 20.7 against 24.7 ms (100 cached tokens,
one process, interleaved). Each row is computed on its own, in an order that does not depend on the other rows, so
decode steps and tree verifies keep the same bits. ``GRAFT_BLOCK_FUSED=0`` keeps the torch layers.
Small forwards may use another kernel than the rest when that one is >= 10% faster over the row counts it covers
and not over 5% slower at any: ``skinny`` up to the largest measured row count where that holds, another main
kernel at 1 row only (a decode step). Only a kernel on the same thread pool qualifies (MKL, oneDNN and skinny
share torch's; OpenBLAS has its own): measured, switching pools between forwards let one pool's idle threads spin
against the other's and slowed the next forward 1.5-2x.

Optional: ``compile=True`` wraps each decoder layer in ``torch.compile`` (dynamic shapes, one graph for every
row count). Measured on 2 Xeon cores it gained nothing over eager (the products dominate) and cost ~20 s of
compile per process, so it is off by default. skinny enters a compiled graph as a custom op, so inductor can fuse
the small ops around its products; on the AVX-512 EPYC that AR loop ran 52-56 tok/s against 60-62 eager (same
prompt, 96 tokens, 2026-12-02 20:57 UTC): the fused small ops did not repay the compiled graph's own overhead.
"""
from __future__ import annotations

import ctypes
import glob
import json
import mmap
import os
import platform
import statistics
import sys
import time
import warnings
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

import graft_block

from .errors import ConfigError
from . import skinny

GEMMS = ("mkl", "openblas", "onednn", "skinny")
# kernels that may take the small forwards beside another main kernel, and the most rows they take there: 17 is a
# tree of 16 drafted nodes and its root (skinny runs any row count, and competes as a main kernel as well)
SMALL = {"skinny": 17}
# the row counts the kernels are measured at: a decode step, trees of 8, 16 and 64 drafted nodes with their root
# (65 rows also stands for prefill and the larger trees, which the main kernel runs)
GEMM_ROWS = (1, 9, 17, 65)
POOL = {"mkl": "torch", "onednn": "torch", "openblas": "openblas", "skinny": "torch"}  # whose threads run each kernel

DNN_PACK_ROWS = 16  # the row hint oneDNN lays its weights out for (measured: one layout serves 1-32 rows)

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")


def _kernel_pair(spec: str | None, source: str) -> tuple[str | None, str | None]:
    """A kernel choice as given (``gemm=`` or ``GRAFT_BLOCK_GEMM``): "onednn", or "onednn+skinny" for a kernel of
    its own for small forwards (skinny: up to 17 rows; another main kernel: 1 row) -> (main, small or None)."""
    if spec is None:
        return None, None
    main, _, small = spec.partition("+")
    kinds = GEMMS
    if main not in GEMMS or (small and small not in kinds):
        raise ConfigError(f"{source} must be one of {', '.join(GEMMS)}, optionally + a kernel for small forwards "
                          f"(one of {', '.join(kinds)}, e.g. 'onednn+skinny'), or unset: measured; got {spec!r}")
    if small and POOL[small] != POOL[main]:
        raise ConfigError(f"{source}={spec!r} pairs kernels of two thread pools ({main}: {POOL[main]}'s, {small}: "
                          f"{POOL[small]}'s), whose idle threads spin against each other: pair kernels of one pool")
    if "skinny" in (main, small) and not skinny.available():
        raise ConfigError(f"{source}={spec!r}: the skinny kernel cannot run here ({skinny.why_not()}); "
                          "choose another kernel")
    return main, small or None


def unsupported_reason(model) -> str | None:
    """Why the lean forward cannot run this model (None = it can; a sliding window becomes its context: ``Target``)."""
    cfg = model.config
    kind = getattr(cfg, "model_type", "?")
    if kind not in SUPPORTED:
        return f"model_type {kind!r} is not one of {', '.join(SUPPORTED)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} (the lean forward has SwiGLU/silu only)"
    # a rope type honouring partial_rotary_factor: the layers rotate the whole head (the C layers would read its
    # cos/sin tables past their end)
    inv_freq = getattr(getattr(model.get_decoder(), "rotary_emb", None), "inv_freq", None)
    head_dim = model.get_decoder().layers[0].self_attn.head_dim
    if inv_freq is not None and 2 * inv_freq.numel() != head_dim:
        return f"a partial rotary embedding ({2 * inv_freq.numel()} of the head's {head_dim} dims) is not implemented"
    return None


def _bias(*mods):
    bs = [m.bias for m in mods]
    if all(b is None for b in bs):
        return None
    return torch.cat([b if b is not None else torch.zeros(m.out_features, dtype=m.weight.dtype, device=m.weight.device)
                      for b, m in zip(bs, mods)])


def _weight(w: dict, key: str) -> torch.Tensor:
    """A layer's weight for ``key``: its own, or q/k/v (gate/up) fused into one [out, in] (a new tensor)."""
    if w[key] is not None:
        return w[key]
    return torch.cat([m.weight for m in w["parts"][key]]).contiguous()


def _share(fused: torch.Tensor, mods) -> None:
    """Point each nn.Linear's weight at its rows of ``fused`` (their concatenation), freeing the separate copy."""
    start = 0
    for m in mods:
        rows = m.weight.shape[0]
        m.weight = torch.nn.Parameter(fused[start : start + rows], requires_grad=m.weight.requires_grad)
        start += rows


class LeanForward:
    """Weights borrowed from ``model`` (q/k/v and gate/up concatenated once) and a KV cache [layers, kv, cap, hd]."""

    def __init__(self, model, compile: bool = False, pack_rows: tuple[int, ...] | None = None,
                 gemm: str | None = None, release_hf: bool = False):
        reason = unsupported_reason(model)
        if reason:
            raise ConfigError(f"engine='lean' cannot run this target: {reason}; use engine='hf'")
        cfg = model.config
        base = model.get_decoder()
        self.rotary = base.rotary_emb  # HF's own module: every rope scaling type comes for free
        self.embed = base.embed_tokens.weight
        self.norm_w, self.eps = base.norm.weight, base.norm.variance_epsilon
        self.head = model.get_output_embeddings()
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        first = base.layers[0].self_attn
        self.head_dim = first.head_dim
        self.scaling = first.scaling
        self.layers = []
        self.model_layers = base.layers
        for lyr in base.layers:
            a, mlp = lyr.self_attn, lyr.mlp
            self.layers.append(dict(
                ln1=lyr.input_layernorm.weight, ln2=lyr.post_attention_layernorm.weight,
                eps=lyr.input_layernorm.variance_epsilon,
                qkv=None, gu=None, parts={"qkv": (a.q_proj, a.k_proj, a.v_proj), "gu": (mlp.gate_proj, mlp.up_proj)},
                qkv_b=_bias(a.q_proj, a.k_proj, a.v_proj),
                o=a.o_proj.weight, o_b=a.o_proj.bias,
                q_norm=getattr(a, "q_norm", None), k_norm=getattr(a, "k_norm", None),
                gu_b=_bias(mlp.gate_proj, mlp.up_proj),
                d=mlp.down_proj.weight, d_b=mlp.down_proj.bias))
        w = self.embed
        self.device, self.dtype = w.device, w.dtype
        self.k = self.v = None
        self.len = 0
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        self._layer = torch.compile(_layer, dynamic=True) if compile else _layer
        cpu32 = self.device.type == "cpu" and self.dtype == torch.float32
        gemm, gemm_small = _kernel_pair(gemm, "gemm")
        if gemm is not None and not cpu32:
            raise ConfigError(f"gemm={gemm!r} is a CPU float32 kernel choice; this target is {self.dtype} on "
                              f"{self.device}: leave gemm unset")
        own = next((k for k in (gemm, gemm_small) if k in ("openblas", "onednn")), None)
        if own and compile:
            raise ConfigError(f"gemm={own!r} cannot run inside compiled layers (compiled graphs call torch's own "
                              "kernels); use compile=False or gemm='mkl'")
        if gemm == "onednn" and not onednn_available(self.device, self.dtype):
            raise ConfigError("gemm='onednn' needs a torch built with oneDNN (torch.backends.mkldnn.is_available()); "
                              "use gemm='mkl' or 'openblas'")
        env, env_small = _kernel_pair(os.environ.get("GRAFT_BLOCK_GEMM") or None, "GRAFT_BLOCK_GEMM")
        self.gemm_times = None  # the measurement behind an automatic choice (physics prints it)
        if not cpu32:
            gemm = "torch"  # GPU / half precision: torch's own GEMM (the machine-wide override is for CPU fp32)
        elif gemm is None and (compile or pack_rows):
            gemm = "mkl"  # compiled graphs call torch's kernels; explicit pack buckets are MKL's
        elif gemm is None:
            gemm, gemm_small = env, env_small
        gemm_small = gemm_small or gemm
        small_rows = SMALL.get(gemm_small, 1)
        # whether every decoder layer could run in C (they do when skinny runs every forward): the kernel choice
        # credits skinny for the torch small ops it then saves
        self.c_layers_why_not = ("GRAFT_BLOCK_FUSED=0" if os.environ.get("GRAFT_BLOCK_FUSED", "1") == "0" else
                                 "compiled layers" if compile else "not a CPU float32 target" if not cpu32 else
                                 skinny.layers_unsupported(cfg.hidden_size, self.heads, self.kv_heads, self.head_dim))
        self.c_layers_possible = self.c_layers_why_not is None
        if gemm is None:
            gemm, pack_rows_measured, self.gemm_times, gemm_small, small_rows = choose_gemm(self)
            pack_rows = pack_rows_measured if pack_rows is None else pack_rows
        self.gemm = gemm  # the products of forwards past small_rows (prefill, large trees)
        self.gemm_small = gemm_small  # those of forwards of <= small_rows rows (decode steps, tree verifies)
        self.small_rows = small_rows if gemm_small != gemm else 0
        if pack_rows is None:
            pack_rows = (8, 16) if gemm == "mkl" and packed_gemm_available(self.device, self.dtype) else ()
        elif pack_rows and (gemm != "mkl" or not packed_gemm_available(self.device, self.dtype)):
            raise ConfigError("pack_rows needs MKL's packed GEMM: a CPU float32 target on a torch built with MKL, "
                              "with gemm='mkl'")
        self.packs = {int(r): self._reordered("mkl_packed", int(r)) for r in sorted(pack_rows)}
        used = {gemm, gemm_small}
        self.blas = self._reordered("openblas") if "openblas" in used else None
        self.dnn = self._reordered("onednn") if "onednn" in used else None  # one layout for every row count
        # when skinny runs every forward, every layer runs in C (skinny.DecoderLayers) unless GRAFT_BLOCK_FUSED=0;
        # they keep the key cache transposed, so no forward may run the torch layers beside them
        self.fused, self.fused_why_not = None, "not every forward on the skinny kernel"
        if gemm == gemm_small == "skinny":
            self.fused_why_not = self.c_layers_why_not
        # nothing reads HF's layer weights once the C layers hold their packs: with release_hf they leave memory as
        # each layer is packed, so the two copies never sit in memory together
        release = release_hf and self.fused_why_not is None
        self.released = 0  # bytes of HF's weights released
        self.skinny = self._reordered("skinny", release=release) if "skinny" in used else None  # any row count
        if self.fused_why_not is None:
            self.fused = self._decoder_layers(cfg)
        if used & {"mkl", "torch"}:  # F.linear runs on fused q/k/v and gate/up, which HF's modules then view
            for w in self.layers:
                for k in ("qkv", "gu"):
                    w[k] = _weight(w, k)
                    _share(w[k], w["parts"][k])
        # (otherwise every product runs on a layout of its own, made from a fused weight that lived one layer)
        if self.blas is not None and graft_block.OPENBLAS_TIMEOUT_LATE:
            warnings.warn("numpy (and OpenBLAS) loaded before graft_block, so OPENBLAS_THREAD_TIMEOUT was not set in "
                          "time and its idle threads may slow torch's: import graft_block first, or export "
                          "OPENBLAS_THREAD_TIMEOUT=20", RuntimeWarning, stacklevel=2)

    def _reordered(self, kernel: str, rows: int | None = None, release: bool = False) -> list[dict]:
        """Per layer, the q/k/v, o, gate/up and down weights in ``kernel``'s own layout (``kernel_weight``; MKL's
        pack for exactly ``rows``-row inputs), + the LM head; ``release``: each layer's HF weights leave memory
        once packed (``release_file_pages``)."""
        out = []
        for w, lyr in zip(self.layers, self.model_layers):
            out.append({k: kernel_weight(_weight(w, k), kernel, rows) for k in ("qkv", "o", "gu", "d")})
            if release:
                self.released += release_tensors(m.weight for m in (*lyr.self_attn.children(), *lyr.mlp.children())
                                                 if isinstance(m, torch.nn.Linear))
        out.append({"head": kernel_weight(self.head.weight, kernel, rows)})
        if release:  # the head is packed; embedding lookups fault back only the rows they read (tied or not)
            self.released += release_tensors({id(t): t for t in (self.head.weight, self.embed)}.values())
        return out

    def _decoder_layers(self, cfg) -> "skinny.DecoderLayers":
        layers = [dict(ln1=w["ln1"], ln2=w["ln2"], qkv=p["qkv"], o=p["o"], gu=p["gu"], d=p["d"], qkv_b=w["qkv_b"],
                       o_b=w["o_b"], gu_b=w["gu_b"], d_b=w["d_b"],
                       q_norm=None if w["q_norm"] is None else w["q_norm"].weight,
                       k_norm=None if w["k_norm"] is None else w["k_norm"].weight)
                  for w, p in zip(self.layers, self.skinny)]
        q_norm = self.layers[0]["q_norm"]
        qk_eps = q_norm.variance_epsilon if q_norm is not None else 0.0
        return skinny.DecoderLayers(layers, cfg.hidden_size, self.heads, self.kv_heads, self.head_dim,
                                    cfg.intermediate_size, self.layers[0]["eps"], qk_eps, self.scaling)

    def bucket(self, n: int) -> int | None:
        """The packed row count a forward of n rows is padded to (None: plain F.linear)."""
        r = next((r for r in self.packs if r >= n), None)
        # measured: padding 2 rows up to 8 loses to F.linear at 2 rows; from a quarter of the bucket up it wins
        return r if r is not None and 4 * n > r else None

    # ---- cache -------------------------------------------------------------------------------------------
    def _reserve(self, total: int) -> None:
        cap = 0 if self.v is None else self.v.shape[2]
        if total <= cap:
            return
        new_cap = min(max(256, 1 << (total - 1).bit_length()), max(total, self.max_positions))
        shape = (len(self.layers), self.kv_heads, new_cap, self.head_dim)
        # the cache outlives the call that grows it: a normal tensor takes in-place writes in and outside
        # inference mode, one made under torch.inference_mode only inside it
        with torch.inference_mode(False):
            v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if self.fused is not None:  # the C layers keep the keys transposed, [head_dim][rows] per kv head
                k = torch.zeros(skinny.key_cache_shape(*shape[:2], self.head_dim, new_cap), dtype=self.dtype)
            else:
                k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.k is not None and self.len:
            self._keys(k)[:, :, : self.len] = self._keys(self.k)[:, :, : self.len]
            v[:, :, : self.len] = self.v[:, :, : self.len]
        self.k, self.v = k, v

    def _keys(self, k: torch.Tensor) -> torch.Tensor:
        """The key cache as [layers, kv_heads, rows, head_dim] (a view: the C layers keep it transposed, with rows
        padded past the cache's; callers read the first ``len``)."""
        return k.transpose(2, 3) if self.fused is not None else k

    def reset(self) -> None:
        self.len = 0

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached keys and values of one layer, [kv_heads, len, head_dim] each (for tests and tools)."""
        return self._keys(self.k)[layer, :, : self.len], self.v[layer, :, : self.len]

    def compact(self, n_new: int, keep: torch.Tensor) -> None:
        base = self.len - n_new
        m = int(keep.numel())
        if not is_prefix(keep):
            idx = keep.to(self.device) + base
            keys = self._keys(self.k)
            keys[:, :, base : base + m] = keys[:, :, idx]
            self.v[:, :, base : base + m] = self.v[:, :, idx]
        self.len = base + m

    # ---- forward -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None, features=(),
                last_only: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """ids, pos [n]; mask additive [n, len + n] or None (causal). Appends n cache entries.
        Returns (logits [n or 1, V], hidden states at the HF ``hidden_states`` indices in ``features``)."""
        n = ids.numel()
        start = self.len
        causal = mask is None and n > 1
        if causal and start:
            raise ValueError("a multi-row forward after cached tokens needs an explicit mask")
        kernel = self.gemm_small if n <= self.small_rows else self.gemm
        rows = None if causal or kernel != "mkl" else self.bucket(n)
        if rows is not None and rows > n:  # pad to the packed bucket; the pad rows see everything, nobody sees them
            ids = torch.cat([ids, ids[-1:].expand(rows - n)])
            pos = torch.cat([pos, pos[-1:].expand(rows - n)])
            full = torch.zeros(rows, start + rows, dtype=self.dtype, device=self.device)
            full[:, start + n :] = torch.finfo(self.dtype).min
            if mask is not None:
                full[:n, : start + n] = mask.view(n, start + n)
            mask = full
        with torch_threads(1 if kernel == "openblas" else None):
            return self._forward(ids, pos, mask, features, last_only, n, start, causal, rows, kernel)

    @property
    def exact_quant(self) -> list[str]:
        """The quantised forms the skinny packs stream float32 weights in, bit for bit (``skinny.exact_quant``):
        e.g. ["q4_1", "q8_0"] for a GGUF target's layers and head; [] when every weight streams as stored."""
        kinds = {p.prec for layer in (self.skinny or []) for p in layer.values()}
        return [name for code, name in ((skinny.Q4, "q4_1"), (skinny.Q8, "q8_0")) if code in kinds]

    @property
    def kernel_label(self) -> str:
        """The products as run: ``onednn``, or ``onednn+skinny@17rows`` / ``onednn+mkl@1row`` when forwards of up
        to that many rows use another kernel."""
        if not self.small_rows:
            return self.gemm
        return f"{self.gemm}+{self.gemm_small}@{'1row' if self.small_rows == 1 else f'{self.small_rows}rows'}"

    def _forward(self, ids, pos, mask, features, last_only, n, start, causal, rows, kernel):
        m = ids.numel()
        self._reserve(start + m)
        if self.fused is not None:
            return self._fused_forward(ids, pos, mask, features, last_only, start)
        x = F.embedding(ids.view(1, -1), self.embed)  # [1, m, H]
        cos, sin = self.rotary(x, pos.view(1, -1))
        want = set(features)
        got = {0: x[0, :n]} if 0 in want else {}
        if mask is not None:
            mask = mask.view(1, 1, m, start + m)
        packs = (self.blas if kernel == "openblas" else self.dnn if kernel == "onednn" else
                 self.skinny if kernel == "skinny" else self.packs.get(rows))
        for i, w in enumerate(self.layers):
            x = self._layer(x, w, None if packs is None else packs[i], self.k[i], self.v[i], start, cos, sin, mask,
                            causal, self.heads, self.kv_heads, self.head_dim, self.scaling)
            if i + 1 in want and i + 1 < len(self.layers):
                got[i + 1] = x[0, :n]
        return self._finish(x, n, start, got, features, last_only, packs)

    def _finish(self, x, n, start, got, features, last_only, packs):
        """After the layers, x [1, m, H]: the cache length, the final norm and the LM head over the first n rows
        (pad rows dropped), and the requested features (``got`` holds those already taken)."""
        self.len = start + n  # pad rows' cache entries stay past the end
        h = rms_norm(x, self.norm_w, self.eps)
        if len(self.layers) in features:
            got[len(self.layers)] = h[0, :n]
        if last_only:
            h = h[:, n - 1 : n]
        if packs is not None:
            logits = linear(h, self.head.weight, self.head.bias, packs[-1]["head"])[0, :n]
        else:
            logits = self.head(h)[0]
        return logits, [got[f] for f in features]

    def _fused_forward(self, ids, pos, mask, features, last_only, start):
        """``_forward`` with every decoder layer in C (``skinny.DecoderLayers``): one call, no small torch ops."""
        n = ids.numel()
        x = F.embedding(ids, self.embed).contiguous()  # [n, H], updated in place by the layers
        cos, sin = self.rotary(x[None], pos.view(1, -1))
        nl = len(self.layers)
        got = {0: x.clone()} if 0 in features else {}
        outs = {i - 1: torch.empty_like(x) for i in set(features) if 0 < i < nl}
        if mask is not None:
            mask = mask.reshape(n, start + n).contiguous()
        self.fused.run(x, cos[0].contiguous(), sin[0].contiguous(), self.k, self.v, start, mask, outs)
        got.update({i + 1: t for i, t in outs.items()})
        return self._finish(x[None], n, start, got, features, last_only, self.skinny)


def is_prefix(keep: torch.Tensor) -> bool:
    """Whether ``keep`` is 0, 1, ..., m-1 (compaction moves nothing), read on the host copy the walk gives: compared
    on a GPU, torch.equal waits for the device every round."""
    keep = keep.cpu()
    return bool(torch.equal(keep, torch.arange(keep.numel(), dtype=keep.dtype)))


def _file_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's file-backed memory mappings (a path, not [heap] / [stack] / anonymous)."""
    out = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/") and parts[4] != "0":  # inode 0: not a real file
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi))
    return out


def release_tensors(tensors) -> int:
    """``release_file_pages`` over the memory of each tensor."""
    return release_file_pages([(t.data_ptr(), t.numel() * t.element_size()) for t in tensors])


def release_file_pages(ranges: list[tuple[int, int]]) -> int:
    """madvise(MADV_DONTNEED) the whole pages inside each (address, bytes) range that lies in a file-backed
    mapping; clean file pages read back unchanged on the next access. Returns the bytes released."""
    if not sys.platform.startswith("linux"):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page, maps, released = mmap.PAGESIZE, _file_mappings(), 0
    for addr, nbytes in ranges:
        lo, hi = -(-addr // page) * page, (addr + nbytes) // page * page
        if hi > lo and any(a <= lo and hi <= b for a, b in maps) and libc.madvise(lo, hi - lo, 4) == 0:
            released += hi - lo
    return released


def packed_gemm_available(device, dtype) -> bool:
    return (torch.device(device).type == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_linear"))


class DnnWeight:
    """A weight reordered into oneDNN's blocked layout; it serves any row count (an MKL pack, also an mkldnn
    tensor, serves exactly one)."""
    __slots__ = ("w",)

    def __init__(self, w: torch.Tensor):
        self.w = torch.ops.mkldnn._reorder_linear_weight(w.detach(), DNN_PACK_ROWS)


def onednn_available(device, dtype) -> bool:
    return (torch.device(device).type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def linear(x, weight, bias, packed=None):
    """x [1, n, in] through ``weight``; with ``packed`` through that kernel: a numpy [in, out] array (OpenBLAS), a
    oneDNN-reordered weight (any n), a skinny pack (a few rows), or an MKL pack for exactly n rows."""
    if packed is None:
        return F.linear(x, weight, bias)
    n = x.shape[1]
    if isinstance(packed, np.ndarray):
        y = torch.from_numpy(x.reshape(n, -1).numpy() @ packed)
        return (y if bias is None else y.add_(bias)).view(1, n, -1)
    if isinstance(packed, skinny.SkinnyWeight):
        return skinny.linear(x, packed, bias)
    if isinstance(packed, DnnWeight):
        return torch.ops.mkldnn._linear_pointwise(x.reshape(n, -1), packed.w, bias, "none", [], "").view(1, n, -1)
    return torch.ops.mkl._mkl_linear(x.reshape(n, -1), packed, weight, bias, n).view(1, n, -1)


def inference_linear(x: torch.Tensor, weight: torch.Tensor, bias, kernel: str | None, cache: dict) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through ``kernel`` when one is given and no gradient is wanted (CPU float32):
    the target engine's kernels as ``drafter_kernel`` names them, "onednn", "skinny", or a main kernel + a kernel
    for small products ("onednn+skinny", "mkl+skinny": skinny up to ``SMALL["skinny"]`` rows, the main one past
    that; "mkl" is ``F.linear``). The weight's layouts are kept in ``cache`` and redone when the weight changes (an
    in-place update bumps its version; a new tensor its address). For drafters, whose few-row products MKL runs
    2-3x slower on AMD."""
    if kernel is None or torch.is_grad_enabled() or x.device.type != "cpu" or weight.dtype != torch.float32:
        return F.linear(x, weight, bias)
    main, _, small = kernel.partition("+")
    lead = x.shape[:-1]
    x = x.reshape(1, -1, x.shape[-1]).to(weight.dtype)
    kind = small if small and x.shape[1] <= SMALL[small] else main
    if kind == "mkl":
        return F.linear(x, weight, bias).view(*lead, -1)
    _follow(cache, weight)
    if kind not in cache:  # a drafter's products: skinny packs them as drafters pack (bf16 where the CPU has it)
        cache[kind] = skinny.SkinnyWeight(weight, half=skinny.draft_half()) if kind == "skinny" else \
            kernel_weight(weight, kind)
    return linear(x, weight, bias, cache[kind]).view(*lead, -1)


def keep_layout(cache: dict, weight: torch.Tensor, kind: str, layout) -> None:
    """Have ``inference_linear`` use ``layout`` for ``weight`` on ``kind`` (a layout made another way, e.g. a
    drafter's rounded fp16 pack), until the weight changes."""
    _follow(cache, weight)
    cache[kind] = layout


def _follow(cache: dict, weight: torch.Tensor) -> None:
    """Empty ``cache`` when ``weight`` is not the one its layouts were made from (a new tensor, or changed), or
    drafters now pack otherwise (``skinny.draft_half``)."""
    key = (weight.data_ptr(), weight._version, tuple(weight.shape), skinny.draft_half())
    if cache.get("key") != key:
        cache.clear()
        cache["key"] = key


def drafter_kernel(target) -> str | None:
    """The product kernels a drafter's inference forwards share with ``target``'s lean engine: "skinny",
    "onednn", or a pair such as "onednn+skinny" / "mkl+skinny" (small products on the second); None for
    ``F.linear`` (MKL alone, OpenBLAS on its own pool, or no lean engine)."""
    lean = getattr(target, "lean", None)
    main, small = getattr(lean, "gemm", None), getattr(lean, "gemm_small", None)
    if main not in ("mkl", "onednn", "skinny"):
        return None
    if small == "skinny" and main != "skinny" and lean.small_rows:
        return f"{main}+skinny"
    return None if main == "mkl" else main


def blas_weight(w: torch.Tensor) -> np.ndarray:
    """A weight [out, in] as the C-contiguous [in, out] numpy array OpenBLAS multiplies fastest (``linear``)."""
    return np.ascontiguousarray(w.detach().numpy().T)


def kernel_weight(w: torch.Tensor, kernel: str, rows: int | None = None):
    """A weight [out, in] in the layout ``linear`` hands to ``kernel`` (None: F.linear on the weight itself);
    ``mkl_packed`` needs the exact row count of its inputs."""
    if kernel == "openblas":
        return blas_weight(w)
    if kernel == "onednn":
        return DnnWeight(w)
    if kernel == "skinny":
        return skinny.SkinnyWeight(w)
    if kernel == "mkl_packed":
        return torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), rows)
    return None


def check_threads(n: int | None) -> None:
    """A command's ``--threads`` (None: torch's choice); 0 or fewer is refused, not ignored."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ConfigError(f"--threads must be >= 1 (leave it out for torch's choice), got {n!r}")


def set_threads(n: int | None) -> None:
    """``check_threads``, then torch's CPU threads set to ``n`` (None: left as they are)."""
    check_threads(n)
    if n is not None:
        torch.set_num_threads(n)


@contextmanager
def torch_threads(n: int | None):
    """Torch on ``n`` threads inside the block (None: unchanged). OpenBLAS runs the products on its own threads,
    so torch's small ops stay on one meanwhile: two pools spinning on 2 cores slow each other 3-10x."""
    before = torch.get_num_threads()
    if n is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def device_name(device: torch.device | str = "cpu") -> str:
    """The GPU's name, or the CPU model from /proc/cpuinfo (keys the kernel choice; physics prints it)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def libc():
    """glibc through ctypes, or None (another C library: its allocator tunes itself)."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def trim_heap() -> None:
    """Give freed memory back to the system: MKL's kept GEMM buffers (``mkl_free_buffers``, where torch's library
    exports it), then glibc's heap (malloc_trim: packs of a few MB live in the heap, and freeing them alone leaves
    them resident)."""
    try:
        ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")).mkl_serv_free_buffers()
    except (OSError, AttributeError):
        pass  # no MKL in this build, or not exported
    c = libc()
    if c is not None:
        c.malloc_trim(0)


def measure_gemms(weights: list[torch.Tensor], rows=GEMM_ROWS, reps: int = 5, skip: tuple = ()) -> dict:
    """Median ms of pushing an [n, in] input through every weight, per kernel and row count: ``mkl`` (F.linear),
    ``mkl_packed`` (packed for exactly n rows; n > 1), ``openblas`` (numpy, torch on one thread meanwhile),
    ``onednn`` (reordered once) and ``skinny`` (packed once, where it builds). One kernel at a time, warmed up
    first: interleaving them call by call lets one pool's spinning threads slow the other. The contenders run a
    second pass in the reverse order and keep their better times; MKL's packs are timed only where F.linear is
    close. Each kernel's copy of the weights is made just before its runs and freed after them, so the
    measurement holds one extra copy at a time (all at once it was the main job's peak memory). ``skip``: kernels
    not measured (their entries stay empty)."""
    out: dict[str, dict[int, float]] = {"mkl": {}, "mkl_packed": {}, "openblas": {}, "onednn": {}, "skinny": {}}
    xs = {n: {w.shape[1]: torch.randn(1, n, w.shape[1]) for w in weights} for n in rows}

    def time_it(kind: str, n: int, packs: list) -> None:  # through ``linear``, the call the forward makes
        x = xs[n]
        fn = lambda: [linear(x[w.shape[1]], w, None, p) for w, p in zip(weights, packs)]  # noqa: E731
        with torch_threads(1 if kind == "openblas" else None):
            fn(), fn()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        out[kind][n] = statistics.median(times) * 1e3

    built = {"mkl_packed": packed_gemm_available("cpu", torch.float32),
             "onednn": onednn_available("cpu", torch.float32), "skinny": skinny.available()}
    kinds = [k for k in out if built.get(k, True) and k not in skip]

    def run(kind: str) -> None:
        best = dict(out[kind])
        if kind == "mkl_packed":  # a pack serves one row count
            for n in (n for n in rows if n > 1):
                time_it(kind, n, [kernel_weight(w, kind, n) for w in weights])
        else:
            packs = [kernel_weight(w, kind) for w in weights]  # MKL: None, F.linear on the weight itself
            for n in rows:
                time_it(kind, n, packs)
            del packs
        trim_heap()  # one copy of the weights at a time: the freed packs leave memory before the next are made
        out[kind] = {n: min(t, best.get(n, t)) for n, t in out[kind].items()}

    plain = [k for k in kinds if k != "mkl_packed"]
    for kind in plain:
        run(kind)
    fastest = {n: min(out[k][n] for k in plain) for n in rows}
    # MKL's packs (the measurement's largest transient: +0.5 GB for SmolLM2) only where F.linear is within 1.5x
    # of the fastest kernel at some multi-row count: on the AMD EPYC it ran 3x behind, and its packs gained at
    # most 1.2x over it there
    if "mkl_packed" in kinds and "mkl" in plain and any(out["mkl"][n] <= 1.5 * fastest[n] for n in rows if n > 1):
        run("mkl_packed")
    # a second pass over the contenders (within 1.5x of the fastest total), in the reverse order, each keeping its
    # better time: a shared machine's bandwidth drifts by tens of percent within a minute, and one pass in a fixed
    # order handed the drift to whichever kernel came last (it picked oneDNN over skinny at 8.6 against 12.0 ms a
    # row, whose whole forwards then ran 19.7 against 12.1 ms)
    total = {k: sum(out[k].values()) for k in plain}
    for kind in [k for k in kinds if out[k]][::-1]:
        if kind == "mkl_packed" or total[kind] <= 1.5 * min(total.values()):
            run(kind)
    return out


# With every decoder layer in C (skinny running every forward), a forward costs its products alone; the other
# kernels' forwards add torch's small ops around theirs: 9-35% of a decode step here, 21% on an AVX2 machine
# (docs/engine.md). The choice times products only, so skinny's count at this share of their value when the C
# layers can run. At 0.85 a fresh measurement on the 2-core EPYC picked oneDNN (8.6 against 12.0 ms a row of
# products), whose engine then decoded at 39.7 tok/s against the C layers' 62.7 the same day (verify(1) 19.7
# against 12.1 ms): the products alone understate what the C layers save.
C_LAYERS_CREDIT = 0.7


def pick_gemm(times: dict, c_layers: bool = False) -> tuple[str, tuple[int, ...], str, int]:
    """(kernel, MKL pack buckets, small-forward kernel, rows it takes) from ``measure_gemms``: the pair with the
    lowest total over the measured row counts (MKL counting its packed GEMM wherever that beats F.linear; the
    buckets are where it wins). A small forward mostly streams the weights, and another kernel on the same thread
    pool may do that faster. It takes the forwards up to some row count when it is >= 10% faster over the
    measured row counts it covers and not over 5% slower at any of them (at parity a median of 5 on a shared
    machine falls either way; within that, one kernel for decode steps and trees keeps their logits
    bit-identical): ``skinny`` up to the largest measured row count where that holds (at most 17), another main
    kernel at 1 row only. ``skinny`` also competes as the main kernel (it runs any row count). A main kernel not
    measured at every row count (not built in) does not compete; on a tie the earlier kernel stays, and a choice
    within 5% of the fastest that holds fewer copies of the weights is preferred. ``c_layers``: skinny running
    every forward alone counts ``C_LAYERS_CREDIT`` of its times (only then do the C decoder layers run)."""
    mkl, packed = times["mkl"], times.get("mkl_packed", {})
    rows = sorted(mkl)
    buckets = tuple(n for n in sorted(packed) if packed[n] < mkl[n])
    per_row = {"mkl": {n: min(t, packed.get(n, float("inf"))) for n, t in mkl.items()}}
    per_row.update({k: times[k] for k in ("openblas", "onednn", "skinny") if set(times.get(k) or {}) >= set(mkl)})
    small = {k: (t, 1) for k, t in per_row.items()}
    small.update({k: (times[k], cap) for k, cap in SMALL.items() if times.get(k)})

    def partner(k: str) -> tuple[str, int]:
        best, best_rows, best_total = k, 0, total(k, k, 0)
        for j, (t, cap) in small.items():
            if j == k or POOL[j] != POOL[k]:
                continue
            covered = []
            for n in rows:  # the longest run of row counts from the smallest up where j wins
                if n > cap or n not in t or t[n] > 1.05 * per_row[k][n]:
                    break
                covered.append(n)
            if covered and sum(t[n] for n in covered) < 0.9 * sum(per_row[k][n] for n in covered):
                upto = cap if len(covered) == len(rows) else covered[-1]
                if total(k, j, upto) < best_total:
                    best, best_rows, best_total = j, upto, total(k, j, upto)
        return best, best_rows

    def total(k: str, j: str, upto: int) -> float:
        alone_in_c = c_layers and k == "skinny" and (j == k or not upto)
        return sum(small[j][0][n] if n <= upto else per_row[k][n] * (C_LAYERS_CREDIT if alone_in_c else 1.0)
                   for n in rows)

    def copies(k: str) -> int:  # weight layouts beside the model's own (MKL's F.linear runs on those)
        j, upto = partner(k)
        return len({k, j if upto else k} - {"mkl"}) + (len(buckets) if k == "mkl" else 0)

    # on a tie (the small kernel covering every measured row count) the main kernel's own total decides: it runs
    # prefill and the larger trees
    best = min(per_row, key=lambda k: (total(k, *partner(k)), total(k, k, 0)))
    # a choice holding fewer copies of the weights wins when within 5% of the fastest (each copy of SmolLM2 is
    # 538 MB: one kernel alone instead of a pair was the difference between 2.3 and 1.5 GB of peak memory)
    lean = [k for k in per_row if copies(k) < copies(best)
            and total(k, *partner(k)) <= 1.05 * total(best, *partner(best))]
    if lean:
        best = min(lean, key=lambda k: (copies(k), total(k, *partner(k)), total(k, k, 0)))
    return (best, (buckets if best == "mkl" else ())) + partner(best)


# the least weight a kernel measurement reads per pass (beside the LM head), and 4x the last-level cache: 256 MB
# before, whose copies per kernel made the measurement the main job's peak memory (1.5-1.7 GB for SmolLM2)
STREAM_BYTES = 128 << 20


def last_level_cache_bytes() -> int:
    """The CPU's largest cache in bytes (0 when sysfs does not say)."""
    sizes = []
    for f in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(f).read().strip().upper()
            sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM" else int(text))
        except (OSError, ValueError):
            pass
    return max(sizes, default=0)


def streamed_weights(lean: "LeanForward") -> list[torch.Tensor]:
    """The weights a kernel measurement pushes its rows through: the first decoder layers' (q/k/v and gate/up
    fused) until they outweigh the last-level cache 4x (at least 128 MB, at most every layer), then the LM head.
    A forward streams its weights from memory; one layer alone (14 MB for SmolLM2) sits in a 32 MB cache, and
    measured that way oneDNN tied skinny on the AVX-512 EPYC (2.5 / 3.1 / 4.2 ms at 1 / 9 / 17 rows) while over
    every layer skinny read 1.13x faster at one row (9.6 against 10.9 ms) and 1.10x at 65."""
    need, got, out = max(STREAM_BYTES, 4 * last_level_cache_bytes()), 0, []
    for w in lean.layers:
        for k in ("qkv", "o", "gu", "d"):
            out.append(_weight(w, k).detach())
            got += out[-1].numel() * out[-1].element_size()
        if got >= need:
            break
    return out + [lean.head.weight.detach()]


def choose_gemm(lean: "LeanForward") -> tuple[str, tuple[int, ...], dict, str, int]:
    """Measure the kernels on the weights a forward streams (``streamed_weights``), once per machine, torch/numpy
    build, thread count and model shape; the choice is cached under the user cache dir. OpenBLAS does not compete
    when numpy loaded before graft_block (``import torch`` first loads it): its idle threads then spin ~0.1 s after
    each product and slow torch's next ops 2x (measured: an 8-row verify after a one-row OpenBLAS forward)."""
    weights = streamed_weights(lean)
    spins = graft_block.OPENBLAS_TIMEOUT_LATE
    key = {"cpu": device_name("cpu"), "torch": torch.__version__, "numpy": np.__version__,
           "threads": torch.get_num_threads(), "shapes": [list(w.shape) for w in weights],
           "kernels": list(GEMMS) + list(SMALL), "skinny": skinny.available() and skinny.SOURCE,
           "exact_quant": skinny.quant_exact_enabled(),
           "rows": list(GEMM_ROWS),
           "openblas_spins": spins, "small_kernel": "same pool", "c_layers": lean.c_layers_possible,
           "c_layers_credit": C_LAYERS_CREDIT}
    path = graft_block.keyed_cache_file("gemm", key)
    try:
        data = json.loads(path.read_text())
        if data["key"] == key and data["gemm"] in GEMMS and data["gemm_small"] in GEMMS + tuple(SMALL):
            times = {k: {int(n): float(v) for n, v in d.items()} for k, d in data["times"].items()}
            return (data["gemm"], tuple(int(r) for r in data["pack_rows"]), times, data["gemm_small"],
                    int(data["small_rows"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # no cache yet, or a damaged one: measure again
    # OpenBLAS cannot be chosen when its threads spin late, and it is not measured then either: its spinning
    # threads slowed the kernels timed after it (skinny measured 24 ms at 9 rows after it, 14-16 ms without)
    skip = ("openblas",) if spins else ()
    times = measure_gemms(weights, skip=skip)
    del weights
    trim_heap()  # the fused q/k/v copies measured (a few MB each, in the heap) leave memory now
    gemm, buckets, small, small_rows = pick_gemm({k: v for k, v in times.items() if k not in skip},
                                                 lean.c_layers_possible)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "gemm": gemm, "gemm_small": small, "small_rows": small_rows,
                                    "pack_rows": list(buckets), "times": times}, indent=1))
    except OSError:
        pass  # a read-only cache dir only costs the measurement next time
    return gemm, buckets, times, small, small_rows


def rms_norm(x, w, eps):
    """RMSNorm as HF computes it (normalise in fp32, scale in the input dtype): the engine's, and the drafters'."""
    if x.dtype == torch.float32 and w.dtype == torch.float32:  # one fused op, bit-identical to HF's order in fp32
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    # HF's LlamaRMSNorm op order (normalise in fp32, scale in the input dtype)
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def _layer(x, w, pk, kc, vc, start: int, cos, sin, mask, causal: bool, heads: int, kv_heads: int, hd: int,
           scaling: float):
    """One pre-norm decoder layer on x [1, n, H]; writes this layer's n keys/values at cache rows start..start+n.
    ``pk``: this layer's weights in the forward's kernel layout (``kernel_weight``), or None for F.linear."""
    n = x.shape[1]
    pk = pk or {}
    h = rms_norm(x, w["ln1"], w["eps"])
    qkv = linear(h, w["qkv"], w["qkv_b"], pk.get("qkv"))
    qk, v = qkv.split(((heads + kv_heads) * hd, kv_heads * hd), dim=-1)
    qk = qk.view(1, n, heads + kv_heads, hd)
    if w["q_norm"] is not None:  # Qwen3: per-head RMSNorm before rope
        q, k = qk.split((heads, kv_heads), dim=2)
        qk = torch.cat([w["q_norm"](q), w["k_norm"](k)], dim=2)
    qk = _rope(qk.transpose(1, 2), cos[:, None], sin[:, None])  # q and k rotated in one pass: half the small ops
    q, k = qk[:, :heads], qk[:, heads:]
    kc.narrow(1, start, n).copy_(k[0])
    vc.narrow(1, start, n).copy_(v.view(n, kv_heads, hd).transpose(0, 1))
    keys, values = kc.narrow(1, 0, start + n)[None], vc.narrow(1, 0, start + n)[None]
    gqa = heads != kv_heads
    if gqa and q.device.type != "cpu" and (mask is not None or hd > 256):
        # CUDA's fused kernels take GQA only unmasked at head_dim <= 256 (HF's rule): else SDPA runs its math kernel
        keys, values = keys.repeat_interleave(heads // kv_heads, 1), values.repeat_interleave(heads // kv_heads, 1)
        gqa = False
    o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, scale=scaling,
                                       enable_gqa=gqa)
    x = x + linear(o.transpose(1, 2).reshape(1, n, heads * hd), w["o"], w["o_b"], pk.get("o"))
    h = rms_norm(x, w["ln2"], w["eps"])
    g, u = linear(h, w["gu"], w["gu_b"], pk.get("gu")).chunk(2, dim=-1)
    return x + linear(F.silu(g) * u, w["d"], w["d_b"], pk.get("d"))
