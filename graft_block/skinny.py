"""The product of a few rows (a decode step, a tree verify) by a weight, on CPU float32, near the memory-bandwidth
floor; it runs any row count, and may serve a whole forward (prefill too) from its one packed copy.

Why it exists: at a few rows a forward streams every weight once and does little arithmetic per byte, so its
products should run at memory bandwidth. On an AMD EPYC (2 cores, AVX-512) oneDNN read SmolLM2's weights at
14-21 GB/s at 1-16 rows while a plain ``w.sum()`` read 29-33 GB/s. Here each weight is packed once into blocks of
NV vectors of outputs, [ceil(out / B)][in][B], and each block is multiplied by up to GMAX input rows at a time,
every input value broadcast against the block's vectors (measured, all products, ms at 1/2/4/8/16 rows:
17.5/17.9/19.1/24.8/38.3 against oneDNN's 31.7/29.0/25.7/34.6/46.7). Every output is one accumulator summed over
the inputs in order, so a row's value does not depend on how many rows share the product or on the thread count:
a decode step and a tree verify compute the same logits.

The tile is chosen per instruction set, since a tile whose accumulators do not fit the vector registers spills:
AVX-512 (32 registers) runs 2 x 16-float vectors by 8 rows, AVX2 (16 registers) 2 x 8-float vectors by 6 rows.
The AVX-512 tile built for AVX2 ran 19 / 178 / 403 ms at 1 / 9 / 17 rows on an AVX2 EPYC (one layer + LM head;
OpenBLAS 4.9 / 18.2 / 18.1); built the same way on an AVX-512 EPYC it ran 8.7 / 100 / 181 ms, and the AVX2 tile
2.1 / 5.4 / 7.5 there (OpenBLAS 2.5 / 8.1 / 10.3). ``GRAFT_BLOCK_SKINNY=avx2`` builds the AVX2 tile on any x86 CPU
with AVX2, to measure it; ``GRAFT_BLOCK_SKINNY=custom`` with ``GRAFT_BLOCK_SKINNY_SHAPE=VW,NV,ROWS`` another tile.

It is C compiled on first use with the system compiler (``$CC``, else ``cc``) for this CPU (``-march=native``)
into the user cache dir, and called through ctypes on the tensors' memory. Its OpenMP threads are torch's own:
the library links ``libgomp.so.1``, which torch has already loaded, so no second pool spins beside torch's (the
load checks that, and refuses otherwise). No compiler, another OS or another OpenMP runtime: ``available()``
says why not, and the engine keeps its other kernels.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys

import torch

import graft_block

SOURCE = r"""
#include <omp.h>
/* VW floats per vector, NV vectors per block and GMAX rows per tile are set per instruction set by the build
   (-D): a tile keeps NV * GMAX accumulators and NV weight vectors in registers (AVX-512 has 32, AVX2 16); a tile
   that does not fit spills and runs 4-20x slower */
typedef float vec __attribute__((vector_size(VW * 4), aligned(4)));
#define LD(p) (*(const vec *)(p))
#define BO (NV * VW)  /* outputs per packed block */

/* P = W [out, in] packed as [ceil(out / BO)][in][BO], outputs past `out` zero */
void pack(const float *W, float *P, long out, long in, int threads) {
    long nb = (out + BO - 1) / BO;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < nb; b++)
        for (long j = 0; j < BO; j++) {
            long o = b * BO + j;
            for (long k = 0; k < in; k++) P[(b * in + k) * BO + j] = o < out ? W[o * in + k] : 0.0f;
        }
}

/* Y[g, o0 + j] = sum_k X[g, k] W[o0 + j, k] for g < G, j < BO: one accumulator per output, k in order, so a
   row's value does not depend on G (or on how many rows the product has) */
static inline __attribute__((always_inline)) void tile(const float *P, const float *X, float *Y, long in, long out,
                                                        long o0, const int G) {
    vec a[GMAX][NV];
    _Pragma("GCC unroll 8") for (int g = 0; g < G; g++)
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) a[g][v] = (vec){0};
    for (long k = 0; k < in; k++) {
        vec w[NV];
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) w[v] = LD(P + k * BO + v * VW);
        _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) {
            float x = X[g * in + k];
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) a[g][v] += w[v] * x;
        }
    }
    long m = out - o0 < BO ? out - o0 : BO;
    _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) {
        float *y = Y + g * out + o0;
        if (m == BO) {
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) *(vec *)(y + v * VW) = a[g][v];
            continue;
        }
        for (long j = 0; j < m; j++) y[j] = a[g][j / VW][j % VW];
    }
}

#define TILE(g) case g: tile(pb, x, y, in, out, b * BO, g); break;

/* Y [n, out] = X [n, in] W^T from the packed P; threads split the output blocks, each reads its block once per
   GMAX input rows (from cache after the first) */
void skinny_linear(const float *P, const float *X, float *Y, long out, long in, long n, int threads) {
    long nb = (out + BO - 1) / BO;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < nb; b++) {
        const float *pb = P + b * in * BO;
        for (long r = 0; r < n; r += GMAX) {
            const float *x = X + r * in;
            float *y = Y + r * out;
            switch (n - r < GMAX ? n - r : GMAX) {
                TILE(1) TILE(2) TILE(3) TILE(4)
#if GMAX > 4
                TILE(5) TILE(6)
#endif
#if GMAX > 6
                TILE(7) TILE(8)
#endif
            }
        }
    }
}

int block_outputs(void) { return BO; }
"""

# The tile shape per instruction set: (floats per vector, vectors per block, rows per tile, extra compiler
# flags). "avx2" on an AVX-512 CPU is built with AVX-512 off, so one machine can measure both
# (GRAFT_BLOCK_SKINNY=avx2).
VARIANTS = {"avx512": (16, 2, 8, []), "avx2": (8, 2, 6, ["-mno-avx512f"]), "generic": (4, 2, 4, [])}
if os.environ.get("GRAFT_BLOCK_SKINNY_SHAPE"):  # "VW,NV,ROWS" to measure another tile (kept out of the choice)
    _shape = tuple(map(int, os.environ["GRAFT_BLOCK_SKINNY_SHAPE"].split(",")))
    VARIANTS["custom"] = (*_shape, [] if _shape[0] > 8 else ["-mno-avx512f"])

_lib = None
_why_not: str | None = None
_variant: str | None = None


def _openmp_runtimes() -> set[str]:
    with open("/proc/self/maps") as fh:
        return {line.split()[-1] for line in fh if any(k in line for k in ("libgomp", "libiomp", "libomp"))}


def _cpu_flags() -> str:
    """This CPU's instruction sets (-march=native builds for them; two "AMD EPYC" machines differed in AVX-512)."""
    with open("/proc/cpuinfo") as fh:
        return next((line for line in fh if line.startswith(("flags", "Features"))), "")


def variant() -> str:
    """The tile shape this CPU gets: ``avx512``, ``avx2`` or ``generic`` (``GRAFT_BLOCK_SKINNY`` overrides)."""
    chosen = os.environ.get("GRAFT_BLOCK_SKINNY")
    if chosen:
        if chosen not in VARIANTS:
            raise RuntimeError(f"GRAFT_BLOCK_SKINNY={chosen!r}: not one of {', '.join(VARIANTS)}")
        return chosen
    flags = set(_cpu_flags().split())
    return "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else "generic"


def _build(kind: str) -> ctypes.CDLL:
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc!r} not found; set CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    vw, nv, rows, extra = VARIANTS[kind]
    flags = ["-O3", "-march=native", *extra, f"-DVW={vw}", f"-DNV={nv}", f"-DGMAX={rows}", "-fopenmp", "-shared",
             "-fPIC"]
    key = hashlib.sha1(repr((SOURCE, version, flags, _cpu_flags())).encode()).hexdigest()[:16]
    path = graft_block.cache_root() / "skinny" / f"skinny-{kind}-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        src = path.with_suffix(f".{os.getpid()}.c")
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        src.write_text(SOURCE)
        done = subprocess.run([cc, *flags, str(src), "-o", str(tmp)], capture_output=True, text=True)
        src.unlink()
        if done.returncode:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[:300]}")
        os.replace(tmp, path)  # atomic: a parallel process never loads a half-written library
    before = _openmp_runtimes()
    lib = ctypes.CDLL(str(path))
    # it must bind to the libgomp.so.1 torch loaded: a runtime it brings in would spin a second pool beside torch's
    # (other runtimes already loaded under their own names, e.g. a wheel's renamed libgomp, are not its concern)
    if _openmp_runtimes() != before or not any("libgomp.so" in r for r in before):
        raise RuntimeError("its OpenMP runtime is not torch's (a second thread pool would spin beside torch's)")
    lib.pack.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int]
    lib.skinny_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.pack.restype = lib.skinny_linear.restype = None
    lib.block_outputs.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the kernel runs here (built and loaded once per process; ``why_not()`` says what failed)."""
    global _lib, _why_not, _variant
    if _lib is None and _why_not is None:
        if not sys.platform.startswith("linux"):
            _why_not = "a Linux-only kernel (it checks the OpenMP runtime in /proc/self/maps)"
        elif "OpenMP" not in torch.__config__.parallel_info():
            _why_not = "torch is not built with OpenMP"
        else:
            try:
                _variant = variant()
                _lib = _build(_variant)
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _why_not = str(e)
    return _lib is not None


def label() -> str | None:
    """The tile shape as built here, e.g. ``avx2 (8-float vectors, 6-row tiles)``; None when unavailable."""
    if not available():
        return None
    vw, nv, rows, _ = VARIANTS[_variant]
    return f"{_variant} ({nv} x {vw}-float vectors, {rows}-row tiles)"


def why_not() -> str | None:
    available()
    return _why_not


class SkinnyWeight:
    """A weight [out, in] packed for ``linear``: [ceil(out / B)][in][B] with B two vectors' worth of outputs (32
    on AVX-512, 16 on AVX2), the outputs past ``out`` zero."""
    __slots__ = ("packed", "out", "n_in")

    def __init__(self, w: torch.Tensor):
        if not available():
            raise RuntimeError(f"the skinny kernel is unavailable here: {_why_not}")
        w = w.detach()
        if w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu":
            raise ValueError(f"skinny packs a float32 CPU weight [out, in]; got {tuple(w.shape)} {w.dtype} on "
                             f"{w.device}")
        w = w.contiguous()
        self.out, self.n_in = w.shape
        block = _lib.block_outputs()
        self.packed = torch.empty((self.out + block - 1) // block * block * self.n_in)
        _lib.pack(w.data_ptr(), self.packed.data_ptr(), self.out, self.n_in, torch.get_num_threads())


def _product(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [n, in] (contiguous) times the packed weight -> [n, out_features]."""
    y = torch.empty(x.shape[0], out_features)
    _lib.skinny_linear(packed.data_ptr(), x.data_ptr(), y.data_ptr(), out_features, x.shape[1], x.shape[0],
                       torch.get_num_threads())
    return y


@torch.library.custom_op("graft_block::skinny_linear", mutates_args=())
def _linear_op(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The product as an op torch.compile can place in a graph (it fuses the small ops around it)."""
    return _product(x, packed, out_features)


@_linear_op.register_fake
def _(x, packed, out_features):
    return x.new_empty(x.shape[0], out_features)


def linear(x: torch.Tensor, w: SkinnyWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the packed weight: x [..., in] float32 on CPU, a few rows in all."""
    if x.shape[-1] != w.n_in or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"skinny multiplies float32 CPU rows of {w.n_in}; got x {tuple(x.shape)} {x.dtype} on "
                         f"{x.device}")
    lead = x.shape[:-1]
    x = x.reshape(-1, w.n_in).contiguous()
    y = (_linear_op if torch.compiler.is_compiling() else _product)(x, w.packed, w.out)  # eager: no op dispatch
    if bias is not None:
        y.add_(bias)
    return y.view(*lead, w.out)
