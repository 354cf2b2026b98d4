"""The lean forward: a static-KV-cache forward for Llama-family decoders (Llama, Qwen2, Qwen3, Mistral), the
same arithmetic as the Hugging Face model with less around it.

Why it exists: at 1-16 rows a decode step or a tree verify on a small CPU target spends a third of its time
outside the matrix products (cache concatenation, mask building, hundreds of small ops). Here the KV cache is
pre-allocated and written in place, q/k/v and gate/up are one product each, and a tree is verified with its
additive ancestor mask over a view of the cache. ``Target`` calls it for prefill / verify / compact when
``engine="lean"``; every drafter and the AR baseline go through it alike (one verification path).

Small-row products: which BLAS is fastest at 1-16 rows depends on the CPU, by up to 2x, so on CPU fp32 the
forward picks its matrix-product kernel by measuring the candidates once per machine (``choose_gemm``; cached
under the user cache dir; ``GRAFT_BLOCK_GEMM=mkl|openblas`` overrides):
- ``mkl``: torch's own ``F.linear``, plus MKL's packed GEMM (``cblas_sgemm_pack``, the kernel inductor's
  max-autotune picks on CPU) for the row buckets where it wins (8 and 16 on Intel Xeon: 1.3-1.5x). A pack serves
  one row count, so a forward of more than a quarter of a bucket is padded up to it: padded rows are masked out of
  every real row's attention, their cache entries lie past ``len`` and are overwritten later, and their logits
  are dropped.
- ``openblas``: the OpenBLAS that numpy ships, called on the same memory. On AMD EPYC it is 2x MKL at 1 row (MKL
  stays far from the bandwidth floor there) and 1.5-2x at 8-16 rows. Its own threads do the products, so torch
  runs the forward's small ops on one thread: two thread pools spinning on 2 cores slow each other 3-10x.

Optional: ``compile=True`` wraps each decoder layer in ``torch.compile`` (dynamic shapes, one graph for every
row count). Measured on 2 Xeon cores it gained nothing over eager (the products dominate) and cost ~20 s of
compile per process, so it is off by default.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
import warnings
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

import graft_block

from .errors import ConfigError

GEMMS = ("mkl", "openblas")

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")


def unsupported_reason(model) -> str | None:
    """Why the lean forward cannot run this model (None = it can)."""
    cfg = model.config
    kind = getattr(cfg, "model_type", "?")
    if kind not in SUPPORTED:
        return f"model_type {kind!r} is not one of {', '.join(SUPPORTED)}"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", kind == "mistral"):
        return "sliding-window attention is not implemented in the lean forward"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} (the lean forward has SwiGLU/silu only)"
    return None


def _bias(*mods):
    bs = [m.bias for m in mods]
    if all(b is None for b in bs):
        return None
    return torch.cat([b if b is not None else torch.zeros(m.out_features, dtype=m.weight.dtype, device=m.weight.device)
                      for b, m in zip(bs, mods)])


class LeanForward:
    """Weights borrowed from ``model`` (q/k/v and gate/up concatenated once) and a KV cache [layers, kv, cap, hd]."""

    def __init__(self, model, compile: bool = False, pack_rows: tuple[int, ...] | None = None,
                 gemm: str | None = None):
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
        for lyr in base.layers:
            a, mlp = lyr.self_attn, lyr.mlp
            self.layers.append(dict(
                ln1=lyr.input_layernorm.weight, ln2=lyr.post_attention_layernorm.weight, eps=lyr.input_layernorm.variance_epsilon,
                qkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).contiguous(),
                qkv_b=_bias(a.q_proj, a.k_proj, a.v_proj),
                o=a.o_proj.weight, o_b=a.o_proj.bias,
                q_norm=getattr(a, "q_norm", None), k_norm=getattr(a, "k_norm", None),
                gu=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).contiguous(),
                gu_b=_bias(mlp.gate_proj, mlp.up_proj),
                d=mlp.down_proj.weight, d_b=mlp.down_proj.bias))
        w = self.embed
        self.device, self.dtype = w.device, w.dtype
        self.k = self.v = None
        self.len = 0
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        self._layer = torch.compile(_layer, dynamic=True) if compile else _layer
        cpu32 = self.device.type == "cpu" and self.dtype == torch.float32
        if gemm is not None and gemm not in GEMMS:
            raise ConfigError(f"gemm must be one of {', '.join(GEMMS)} (or unset: measured), got {gemm!r}")
        if gemm is not None and not cpu32:
            raise ConfigError(f"gemm={gemm!r} is a CPU float32 kernel choice; this target is {self.dtype} on "
                              f"{self.device}: leave gemm unset")
        if gemm == "openblas" and compile:
            raise ConfigError("gemm='openblas' cannot run inside compiled layers (numpy breaks the graph); "
                              "use compile=False or gemm='mkl'")
        env = os.environ.get("GRAFT_BLOCK_GEMM") or None
        if env is not None and env not in GEMMS:
            raise ConfigError(f"GRAFT_BLOCK_GEMM must be one of {', '.join(GEMMS)} (or unset: measured), got {env!r}")
        self.gemm_times = None  # the measurement behind an automatic choice (physics prints it)
        if not cpu32:
            gemm = "torch"  # GPU / half precision: torch's own GEMM (the machine-wide override is for CPU fp32)
        elif gemm is None and (compile or pack_rows):
            gemm = "mkl"  # compiled graphs call torch's kernels; explicit pack buckets are MKL's
        elif gemm is None:
            gemm = env
        if gemm is None:
            gemm, pack_rows_measured, self.gemm_times = choose_gemm(self)
            pack_rows = pack_rows_measured if pack_rows is None else pack_rows
        self.gemm = gemm
        if pack_rows is None:
            pack_rows = (8, 16) if gemm == "mkl" and packed_gemm_available(self.device, self.dtype) else ()
        elif pack_rows and (gemm != "mkl" or not packed_gemm_available(self.device, self.dtype)):
            raise ConfigError("pack_rows needs MKL's packed GEMM: a CPU float32 target on a torch built with MKL, "
                              "with gemm='mkl'")
        self.packs = {int(r): self._pack(int(r)) for r in sorted(pack_rows)}
        # OpenBLAS takes each weight as a C-contiguous [in, out] array (its fastest layout here)
        self.blas = self._blas() if gemm == "openblas" else None
        if self.blas is not None and graft_block.OPENBLAS_TIMEOUT_LATE:
            warnings.warn("numpy (and OpenBLAS) loaded before graft_block, so OPENBLAS_THREAD_TIMEOUT was not set in "
                          "time and its idle threads may slow torch's: import graft_block first, or export "
                          "OPENBLAS_THREAD_TIMEOUT=20", RuntimeWarning, stacklevel=2)

    def _pack(self, rows: int) -> list[dict]:
        """Per layer, the MKL-packed q/k/v, o, gate/up and down weights for ``rows``-row inputs (+ the LM head)."""
        out = [{k: torch.ops.mkl._mkl_reorder_linear_weight(w[k], rows) for k in ("qkv", "o", "gu", "d")}
               for w in self.layers]
        out.append({"head": torch.ops.mkl._mkl_reorder_linear_weight(self.head.weight, rows)})
        return out

    def _blas(self) -> list[dict]:
        """Per layer, every weight in OpenBLAS's layout (``blas_weight``), + the LM head."""
        out = [{k: blas_weight(w[k]) for k in ("qkv", "o", "gu", "d")} for w in self.layers]
        out.append({"head": blas_weight(self.head.weight)})
        return out

    def bucket(self, n: int) -> int | None:
        """The packed row count a forward of n rows is padded to (None: plain F.linear)."""
        r = next((r for r in self.packs if r >= n), None)
        # measured: padding 2 rows up to 8 loses to F.linear at 2 rows; from a quarter of the bucket up it wins
        return r if r is not None and 4 * n > r else None

    # ---- cache -------------------------------------------------------------------------------------------
    def _reserve(self, total: int) -> None:
        cap = 0 if self.k is None else self.k.shape[2]
        if total <= cap:
            return
        new_cap = min(max(256, 1 << (total - 1).bit_length()), max(total, self.max_positions))
        shape = (len(self.layers), self.kv_heads, new_cap, self.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.k is not None and self.len:
            k[:, :, : self.len] = self.k[:, :, : self.len]
            v[:, :, : self.len] = self.v[:, :, : self.len]
        self.k, self.v = k, v

    def reset(self) -> None:
        self.len = 0

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached keys and values of one layer, [kv_heads, len, head_dim] each (for tests and tools)."""
        return self.k[layer, :, : self.len], self.v[layer, :, : self.len]

    def compact(self, n_new: int, keep: torch.Tensor) -> None:
        base = self.len - n_new
        m = int(keep.numel())
        if not torch.equal(keep, torch.arange(m, device=keep.device)):
            idx = keep.to(self.device) + base
            self.k[:, :, base : base + m] = self.k[:, :, idx]
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
        rows = None if causal else self.bucket(n)
        if rows is not None and rows > n:  # pad to the packed bucket; the pad rows see everything, nobody sees them
            ids = torch.cat([ids, ids[-1:].expand(rows - n)])
            pos = torch.cat([pos, pos[-1:].expand(rows - n)])
            full = torch.zeros(rows, start + rows, dtype=self.dtype, device=self.device)
            full[:, start + n :] = torch.finfo(self.dtype).min
            if mask is not None:
                full[:n, : start + n] = mask.view(n, start + n)
            mask = full
        with torch_threads(1 if self.blas is not None else None):
            return self._forward(ids, pos, mask, features, last_only, n, start, causal, rows)

    def _forward(self, ids, pos, mask, features, last_only, n, start, causal, rows):
        m = ids.numel()
        self._reserve(start + m)
        x = F.embedding(ids.view(1, -1), self.embed)  # [1, m, H]
        cos, sin = self.rotary(x, pos.view(1, -1))
        want = set(features)
        got = {0: x[0, :n]} if 0 in want else {}
        if mask is not None:
            mask = mask.view(1, 1, m, start + m)
        packs = self.blas if self.blas is not None else self.packs.get(rows) if rows is not None else None
        for i, w in enumerate(self.layers):
            x = self._layer(x, w, None if packs is None else packs[i], self.k[i], self.v[i], start, cos, sin, mask,
                            causal, self.heads, self.kv_heads, self.head_dim, self.scaling)
            if i + 1 in want and i + 1 < len(self.layers):
                got[i + 1] = x[0, :n]
        self.len = start + n  # pad rows' cache entries stay past the end
        h = _rms(x, self.norm_w, self.eps)
        if len(self.layers) in want:
            got[len(self.layers)] = h[0, :n]
        if last_only:
            h = h[:, n - 1 : n]
        if packs is not None:
            logits = linear(h, self.head.weight, self.head.bias, packs[-1]["head"])[0, :n]
        else:
            logits = self.head(h)[0]
        return logits, [got[f] for f in features]


def packed_gemm_available(device, dtype) -> bool:
    return (torch.device(device).type == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_linear"))


def linear(x, weight, bias, packed=None):
    """x [1, n, in] through ``weight``; with ``packed`` through that kernel: a numpy [in, out] array (OpenBLAS) or
    an MKL pack for exactly n rows."""
    if packed is None:
        return F.linear(x, weight, bias)
    n = x.shape[1]
    if isinstance(packed, np.ndarray):
        y = torch.from_numpy(x.reshape(n, -1).numpy() @ packed)
        return (y if bias is None else y.add_(bias)).view(1, n, -1)
    return torch.ops.mkl._mkl_linear(x.reshape(n, -1), packed, weight, bias, n).view(1, n, -1)


def blas_weight(w: torch.Tensor) -> np.ndarray:
    """A weight [out, in] as the C-contiguous [in, out] numpy array OpenBLAS multiplies fastest (``linear``)."""
    return np.ascontiguousarray(w.detach().numpy().T)


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


def measure_gemms(weights: list[torch.Tensor], rows=(1, 8, 16), reps: int = 5) -> dict:
    """Median ms of pushing an [n, in] input through every weight, per kernel and row count: ``mkl`` (F.linear),
    ``mkl_packed`` (packed for exactly n rows; n > 1) and ``openblas`` (numpy, torch on one thread meanwhile).
    One kernel at a time, warmed up first: interleaving them call by call lets one pool's spinning threads
    slow the other."""
    out: dict[str, dict[int, float]] = {"mkl": {}, "mkl_packed": {}, "openblas": {}}
    mkl_pack = packed_gemm_available("cpu", torch.float32)
    for n in rows:
        xs = {w.shape[1]: torch.randn(n, w.shape[1]) for w in weights}
        runs = {"mkl": lambda: [F.linear(xs[w.shape[1]], w) for w in weights]}
        if mkl_pack and n > 1:
            packs = [torch.ops.mkl._mkl_reorder_linear_weight(w, n) for w in weights]
            runs["mkl_packed"] = lambda: [torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, n)
                                          for w, p in zip(weights, packs)]
        arrays = [blas_weight(w) for w in weights]
        xn = {k: v.numpy() for k, v in xs.items()}
        runs["openblas"] = lambda: [xn[a.shape[0]] @ a for a in arrays]
        for name, fn in runs.items():
            with torch_threads(1 if name == "openblas" else None):
                fn(), fn()
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
            out[name][n] = statistics.median(times) * 1e3
    return out


def pick_gemm(times: dict) -> tuple[str, tuple[int, ...]]:
    """(kernel, MKL pack buckets) from ``measure_gemms``: the kernel with the lower total over the row counts
    (MKL counting its packed GEMM wherever that beats F.linear), and the buckets where the pack wins."""
    mkl, packed, blas = times["mkl"], times.get("mkl_packed", {}), times["openblas"]
    buckets = tuple(n for n in sorted(packed) if packed[n] < mkl[n])
    mkl_total = sum(min(mkl[n], packed.get(n, float("inf"))) for n in mkl)
    return ("openblas", ()) if sum(blas.values()) < mkl_total else ("mkl", buckets)


def choose_gemm(lean: "LeanForward") -> tuple[str, tuple[int, ...], dict]:
    """Measure the kernels on one decoder layer's weights and the LM head (the shapes of every product), once per
    machine, torch/numpy build, thread count and model shape; the choice is cached under the user cache dir."""
    weights = [lean.layers[0][k].detach() for k in ("qkv", "o", "gu", "d")] + [lean.head.weight.detach()]
    key = {"cpu": device_name("cpu"), "torch": torch.__version__, "numpy": np.__version__,
           "threads": torch.get_num_threads(), "shapes": [list(w.shape) for w in weights]}
    path = graft_block.keyed_cache_file("gemm", key)
    try:
        data = json.loads(path.read_text())
        if data["key"] == key and data["gemm"] in GEMMS:
            times = {k: {int(n): float(v) for n, v in d.items()} for k, d in data["times"].items()}
            return data["gemm"], tuple(int(r) for r in data["pack_rows"]), times
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # no cache yet, or a damaged one: measure again
    times = measure_gemms(weights)
    gemm, buckets = pick_gemm(times)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "gemm": gemm, "pack_rows": list(buckets), "times": times}, indent=1))
    except OSError:
        pass  # a read-only cache dir only costs the measurement next time
    return gemm, buckets, times


def _rms(x, w, eps):
    # HF's LlamaRMSNorm op order, so logits stay bit-identical in fp32
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def _layer(x, w, pk, kc, vc, start: int, cos, sin, mask, causal: bool, heads: int, kv_heads: int, hd: int,
           scaling: float):
    """One pre-norm decoder layer on x [1, n, H]; writes this layer's n keys/values at cache rows start..start+n.
    ``pk``: this layer's MKL-packed weights for exactly n rows, or None."""
    n = x.shape[1]
    pk = pk or {}
    h = _rms(x, w["ln1"], w["eps"])
    qkv = linear(h, w["qkv"], w["qkv_b"], pk.get("qkv"))
    q, k, v = qkv.split((heads * hd, kv_heads * hd, kv_heads * hd), dim=-1)
    q = q.view(1, n, heads, hd)
    k = k.view(1, n, kv_heads, hd)
    if w["q_norm"] is not None:  # Qwen3: per-head RMSNorm before rope
        q, k = w["q_norm"](q), w["k_norm"](k)
    q = _rope(q.transpose(1, 2), cos[:, None], sin[:, None])
    k = _rope(k.transpose(1, 2), cos[:, None], sin[:, None])
    kc[:, start : start + n] = k[0]
    vc[:, start : start + n] = v.view(n, kv_heads, hd).transpose(0, 1)
    keys, values = kc[None, :, : start + n], vc[None, :, : start + n]
    o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, scale=scaling,
                                       enable_gqa=heads != kv_heads)
    x = x + linear(o.transpose(1, 2).reshape(1, n, heads * hd), w["o"], w["o_b"], pk.get("o"))
    h = _rms(x, w["ln2"], w["eps"])
    g, u = linear(h, w["gu"], w["gu_b"], pk.get("gu")).chunk(2, dim=-1)
    return x + linear(F.silu(g) * u, w["d"], w["d_b"], pk.get("d"))
