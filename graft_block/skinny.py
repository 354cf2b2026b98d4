"""The product of a few rows (up to 17: a decode step, a tree of up to 16 drafted nodes and its root) by a
weight, on CPU float32, near the memory-bandwidth floor.

Why it exists: at a few rows a forward streams every weight once and does little arithmetic per byte, so its
products should run at memory bandwidth. On an AMD EPYC (2 cores, AVX-512) oneDNN read SmolLM2's weights at
14-21 GB/s at 1-16 rows while a plain ``w.sum()`` read 29-33 GB/s. Here each weight is packed once into blocks of
32 outputs, [ceil(out / 32)][in][32], and each block is multiplied by up to 8 input rows at a time, every input
value broadcast against two 16-float vectors of the block (measured, all products, ms at 1/2/4/8/16 rows:
17.5/17.9/19.1/24.8/38.3 against oneDNN's 31.7/29.0/25.7/34.6/46.7). Every output is one accumulator summed over
the inputs in order, so a row's value does not depend on how many rows share the product or on the thread count:
a decode step and a tree verify compute the same logits.

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
typedef float v16 __attribute__((vector_size(64), aligned(4)));
#define LD(p) (*(const v16 *)(p))
#define BO 32  /* outputs per packed block: two 16-float vectors */

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
    v16 a[8][2];
    _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) { a[g][0] = (v16){0}; a[g][1] = (v16){0}; }
    for (long k = 0; k < in; k++) {
        v16 w0 = LD(P + k * BO), w1 = LD(P + k * BO + 16);
        _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) {
            float x = X[g * in + k];
            a[g][0] += w0 * x;
            a[g][1] += w1 * x;
        }
    }
    long m = out - o0 < BO ? out - o0 : BO;
    _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) {
        float *y = Y + g * out + o0;
        if (m == BO) { *(v16 *)y = a[g][0]; *(v16 *)(y + 16) = a[g][1]; continue; }
        for (long j = 0; j < m; j++) y[j] = j < 16 ? a[g][0][j] : a[g][1][j - 16];
    }
}

/* Y [n, out] = X [n, in] W^T from the packed P; threads split the output blocks, each reads its block once per
   8 input rows (from cache after the first) */
void skinny_linear(const float *P, const float *X, float *Y, long out, long in, long n, int threads) {
    long nb = (out + BO - 1) / BO;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < nb; b++) {
        const float *pb = P + b * in * BO;
        for (long r = 0; r < n; r += 8) {
            const float *x = X + r * in;
            float *y = Y + r * out;
            switch (n - r < 8 ? n - r : 8) {
                case 1: tile(pb, x, y, in, out, b * BO, 1); break;
                case 2: tile(pb, x, y, in, out, b * BO, 2); break;
                case 3: tile(pb, x, y, in, out, b * BO, 3); break;
                case 4: tile(pb, x, y, in, out, b * BO, 4); break;
                case 5: tile(pb, x, y, in, out, b * BO, 5); break;
                case 6: tile(pb, x, y, in, out, b * BO, 6); break;
                case 7: tile(pb, x, y, in, out, b * BO, 7); break;
                default: tile(pb, x, y, in, out, b * BO, 8);
            }
        }
    }
}
"""
BLOCK = 32  # BO above

_lib = None
_why_not: str | None = None


def _openmp_runtimes() -> set[str]:
    with open("/proc/self/maps") as fh:
        return {line.split()[-1] for line in fh if any(k in line for k in ("libgomp", "libiomp", "libomp"))}


def _cpu_flags() -> str:
    """This CPU's instruction sets (-march=native builds for them; two "AMD EPYC" machines differed in AVX-512)."""
    with open("/proc/cpuinfo") as fh:
        return next((line for line in fh if line.startswith(("flags", "Features"))), "")


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc!r} not found; set CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
    key = hashlib.sha1(repr((SOURCE, version, flags, _cpu_flags())).encode()).hexdigest()[:16]
    path = graft_block.cache_root() / "skinny" / f"skinny-{key}.so"
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
    if len(_openmp_runtimes()) > 1 or not before:
        raise RuntimeError("its OpenMP runtime is not torch's (a second thread pool would spin beside torch's)")
    lib.pack.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int]
    lib.skinny_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.pack.restype = lib.skinny_linear.restype = None
    return lib


def available() -> bool:
    """Whether the kernel runs here (built and loaded once per process; ``why_not()`` says what failed)."""
    global _lib, _why_not
    if _lib is None and _why_not is None:
        if not sys.platform.startswith("linux"):
            _why_not = "a Linux-only kernel (it checks the OpenMP runtime in /proc/self/maps)"
        elif "OpenMP" not in torch.__config__.parallel_info():
            _why_not = "torch is not built with OpenMP"
        else:
            try:
                _lib = _build()
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _why_not = str(e)
    return _lib is not None


def why_not() -> str | None:
    available()
    return _why_not


class SkinnyWeight:
    """A weight [out, in] packed for ``linear``: [ceil(out / 32)][in][32], the outputs past ``out`` zero."""
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
        self.packed = torch.empty((self.out + BLOCK - 1) // BLOCK * BLOCK * self.n_in)
        _lib.pack(w.data_ptr(), self.packed.data_ptr(), self.out, self.n_in, torch.get_num_threads())


def linear(x: torch.Tensor, w: SkinnyWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the packed weight: x [..., in] float32 on CPU, a few rows in all."""
    if x.shape[-1] != w.n_in or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"skinny multiplies float32 CPU rows of {w.n_in}; got x {tuple(x.shape)} {x.dtype} on "
                         f"{x.device}")
    lead = x.shape[:-1]
    x = x.reshape(-1, w.n_in).contiguous()
    y = torch.empty(x.shape[0], w.out)
    _lib.skinny_linear(w.packed.data_ptr(), x.data_ptr(), y.data_ptr(), w.out, w.n_in, x.shape[0],
                       torch.get_num_threads())
    if bias is not None:
        y.add_(bias)
    return y.view(*lead, w.out)
