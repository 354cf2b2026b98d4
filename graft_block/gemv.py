"""A one-row matrix product (y = W x) at the memory-bandwidth floor, for decode steps on CPU float32.

Why it exists: a decode step streams every weight once, so its products are bound by memory bandwidth. On an
AMD EPYC (2 cores, AVX-512) oneDNN and OpenBLAS reached 14-21 GB/s there while a plain ``w.sum()`` over the same
weights read 29-33 GB/s; this kernel reads them at that rate (SmolLM2's products at 1 row: 17 against oneDNN's
30 ms). Each thread sums whole rows, four 16-float accumulators each, so a row's value does not depend on the
thread count.

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

static float row_dot(const float *w, const float *x, long in) {
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    long i = 0;
    for (; i + 64 <= in; i += 64) {
        a0 += *(const v16 *)(w + i) * *(const v16 *)(x + i);
        a1 += *(const v16 *)(w + i + 16) * *(const v16 *)(x + i + 16);
        a2 += *(const v16 *)(w + i + 32) * *(const v16 *)(x + i + 32);
        a3 += *(const v16 *)(w + i + 48) * *(const v16 *)(x + i + 48);
    }
    for (; i + 16 <= in; i += 16) a0 += *(const v16 *)(w + i) * *(const v16 *)(x + i);
    v16 a = (a0 + a1) + (a2 + a3);
    float s = 0.0f;
    for (int j = 0; j < 16; j++) s += a[j];
    for (; i < in; i++) s += w[i] * x[i];
    return s;
}

/* y[o] = W[o, :] . x for o < out; W row-major [out, in] */
void gemv(const float *W, const float *x, float *y, long out, long in, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long o = 0; o < out; o++) y[o] = row_dot(W + o * in, x, in);
}
"""

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
    path = graft_block.cache_root() / "gemv" / f"gemv-{key}.so"
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
    lib.gemv.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                         ctypes.c_int]
    lib.gemv.restype = None
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


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for one row: x [..., in] with one row in all, w [out, in]; CPU float32."""
    if not available():
        raise RuntimeError(f"the gemv kernel is unavailable here: {_why_not}")
    out, n_in = w.shape
    if x.numel() != n_in or w.dtype != torch.float32 or x.dtype != torch.float32 or w.device.type != "cpu":
        raise ValueError(f"gemv takes one float32 CPU row of {n_in} against a float32 CPU weight [out, in]; got "
                         f"x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype} on {w.device}")
    w = w.contiguous()  # views of the engine's weights already are: no copy
    x = x.contiguous()
    y = torch.empty(out, dtype=torch.float32)
    _lib.gemv(w.data_ptr(), x.data_ptr(), y.data_ptr(), out, n_in, torch.get_num_threads())
    if bias is not None:
        y.add_(bias)
    return y.view(*x.shape[:-1], out)
