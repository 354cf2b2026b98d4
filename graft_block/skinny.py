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

Beside float32, a pack may hold float16 (a weight whose values all are float16, exact), bfloat16 (a drafter's
products, rounded; on AMX tiles where the CPU has them) or, with ``GRAFT_BLOCK_EXACT_QUANT=1``, the 4- or 8-bit
values with float16 scales that a GGUF target's float32 weights exactly are (the float32 products, bit for bit).

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
typedef int ivec __attribute__((vector_size(VW * 4), aligned(4)));
#define LD(p) (*(const vec *)(p))
#define BO (NV * VW)  /* outputs per packed block */
/* Weights stored in half precision (a drafter checkpoint's fp16 values, exact) are packed as such and widened on
   load: half the bytes a product streams, the same products */
#if defined(__AVX512F__) && VW == 16
#include <immintrin.h>
#define HALF 1
#define LDH(p) ((vec)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p))))
#elif defined(__F16C__) && VW == 8
#include <immintrin.h>
#define HALF 1
#define LDH(p) ((vec)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p))))
#elif defined(__F16C__) && VW == 4
#include <immintrin.h>
#define HALF 1
#define LDH(p) ((vec)_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(p))))
#else
#define HALF 0
#define LDH(p) ((vec){0})  /* never called: half_weights() says 0 and the caller packs float32 */
#endif
/* A drafter's products may also run in bfloat16 (its numbers need not be exact: the verify keeps only what the
   target computes): bfloat16 weight pairs times bfloat16 input pairs, summed in float32 by AVX512-BF16's dot
   product, two multiply-adds per lane per instruction where float32 does one, from half float32's bytes */
#if defined(__AVX512BF16__) && VW == 16
#define BF16 1
#include <stdlib.h>
#include <string.h>
#else
#define BF16 0
#endif
#if BF16 && defined(__AMX_BF16__) && defined(__AMX_TILE__) && !defined(NO_AMX)
#define AMX 1
#else
#define AMX 0
#endif

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

/* a[g] += w * x[g * in] for the G rows of a tile: one input's multiply-adds, every accumulator its own chain */
static inline __attribute__((always_inline)) void madd_rows(vec a[GMAX][NV], const vec *w, const float *x, long in,
                                                             const int G) {
    _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) {
        float xg = x[g * in];
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) a[g][v] += w[v] * xg;
    }
}

/* the G rows' accumulators into Y [., out] at outputs o0.., the last block's outputs past `out` dropped */
static inline __attribute__((always_inline)) void store_rows(vec a[GMAX][NV], float *Y, long out, long o0,
                                                              const int G) {
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

/* Y[g, o0 + j] = sum_k X[g, k] W[o0 + j, k] for g < G, j < BO: one accumulator per output, k in order, so a
   row's value does not depend on G (or on how many rows the product has) */
static inline __attribute__((always_inline)) void tile(const void *P, const float *X, float *Y, long in, long out,
                                                        long o0, const int G, const int half, const char *pf,
                                                        const long pstep) {
    long pc = 0;
    vec a[GMAX][NV];
    _Pragma("GCC unroll 8") for (int g = 0; g < G; g++)
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) a[g][v] = (vec){0};
    for (long k = 0; k < in; k++) {
        vec w[NV];
        if (pf && ++pc == pstep) {  /* every pstep-th input: one input's worth of the next block into L2 */
            pc = 0;
            __builtin_prefetch(pf, 0, 2);
            if (!half) __builtin_prefetch(pf + 64, 0, 2);
            pf += BO * (half ? 2 : 4);
        }
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)
            w[v] = half ? LDH((const unsigned short *)P + k * BO + v * VW) : LD((const float *)P + k * BO + v * VW);
        madd_rows(a, w, X + k, in, G);
    }
    store_rows(a, Y, out, o0, G);
}

/* one case per tile height up to GMAX: T(g) calls the tile for g rows, a constant, so each case is its own code */
#if GMAX > 6
#define ROW_CASES(T) T(1) T(2) T(3) T(4) T(5) T(6) T(7) T(8)
#elif GMAX > 4
#define ROW_CASES(T) T(1) T(2) T(3) T(4) T(5) T(6)
#else
#define ROW_CASES(T) T(1) T(2) T(3) T(4)
#endif

#define TILE(g) case g: tile(pb, x, y, in, out, b * BO, g, half, pf, ng); break;

/* Y [n, out] = X [n, in] W^T from the packed P (float32, or half when `half`); threads split the output blocks,
   each reads its block once per GMAX input rows (from cache after the first). Each row group's tile prefetches an
   equal share of the next block, so memory streams it during this block's arithmetic instead of after it (Xeon,
   2 cores, all of SmolLM2's products: 0.69-0.76x the time at 4-17 rows, 0.96x at 1 row, the same bits) */
static inline __attribute__((always_inline)) void product(const void *P, const float *X, float *Y, long out,
                                                           long in, long n, int threads, const int half) {
    long nb = (out + BO - 1) / BO;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < nb; b++) {
        const char *pb = (const char *)P + b * in * BO * (half ? 2 : 4);
        const char *pn = b + 1 < nb ? pb + in * BO * (half ? 2 : 4) : 0;  /* the next block */
        const long ng = (n + GMAX - 1) / GMAX, share = (in + ng - 1) / ng;  /* row groups; inputs each prefetches */
        for (long r = 0; r < n; r += GMAX) {
            const char *pf = pn ? pn + (r / GMAX) * share * BO * (half ? 2 : 4) : 0;
            const float *x = X + r * in;
            float *y = Y + r * out;
            switch (n - r < GMAX ? n - r : GMAX) { ROW_CASES(TILE) }
        }
    }
}

#if BF16
/* Y[g, o0 + j] for g < G, j < BO from P packed [in / 2][BO][2] (each output's two weights of one input pair side
   by side) and X [G][in / 2] bfloat16 input pairs: one float32 accumulator per output, pairs in order */
static inline __attribute__((always_inline)) void tile_bf16(const unsigned short *P, const unsigned int *X, float *Y,
                                                             long in2, long out, long o0, const int G,
                                                             const char *pf) {
    __m512 a[GMAX][NV];
    _Pragma("GCC unroll 8") for (int g = 0; g < G; g++)
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) a[g][v] = _mm512_setzero_ps();
    for (long k = 0; k < in2; k++) {
        __m512bh w[NV];
        if (pf) {  /* as tile(): the next block's pair of this input (BO x 2 halves: two lines) into L2 */
            __builtin_prefetch(pf + k * BO * 4, 0, 2);
            __builtin_prefetch(pf + k * BO * 4 + 64, 0, 2);
        }
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)
            w[v] = (__m512bh)_mm512_loadu_si512((const void *)(P + (k * BO + v * VW) * 2));
        _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) {
            __m512bh x = (__m512bh)_mm512_set1_epi32((int)X[g * in2 + k]);
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) a[g][v] = _mm512_dpbf16_ps(a[g][v], w[v], x);
        }
    }
    long m = out - o0 < BO ? out - o0 : BO;
    _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) {
        float t[BO];
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) _mm512_storeu_ps(t + v * VW, a[g][v]);
        memcpy(Y + g * out + o0, t, m * sizeof(float));
    }
}

#define TILE_BF16(g) case g: tile_bf16(pb, x, y, in2, out, b * BO, g, r ? 0 : pn); break;

/* round to nearest even, as the vector conversion does */
static inline unsigned short bf16_bits(float f) {
    unsigned int u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (unsigned short)((u >> 16) | 0x40);  /* a NaN stays one, quiet */
    return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#if AMX
/* Where the CPU has AMX (and the OS grants its tile state, asked once), every bfloat16 product runs on the tile
   unit: C [16 rows][16 outputs] += A [16 rows][16 input pairs] . B [16 input pairs][16 outputs], B read straight
   from the pack ([in / 2][BO][2] is the unit's pair layout, 128 bytes a pair row). Rows are padded to 16 with
   zeros; each output is one tile sum whatever the rows beside it, so a row's value does not depend on n */
#include <sys/syscall.h>
#include <unistd.h>
typedef struct { unsigned char palette, start; unsigned char res[14]; unsigned short colsb[16];
                 unsigned char rows[16]; } __attribute__((packed)) tilecfg_t;
static int amx_state = 0;  /* 0 not asked, 1 granted, -1 refused */
static int amx_ok(void) {
    if (!amx_state) amx_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) ? -1 : 1;
    return amx_state > 0;
}

static void product_amx(const unsigned short *P, const unsigned int *Xb, float *Y, long out, long in2, long n,
                        long npad, int threads) {
    const long nb = (out + BO - 1) / BO;
    #pragma omp parallel num_threads(threads)
    {
        tilecfg_t cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 5; t++) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }  /* C0, C1, A, B0, B1 */
        _tile_loadconfig(&cfg);
        float t16[16][32];
        #pragma omp for schedule(static)
        for (long b = 0; b < nb; b++) {
            const unsigned short *pb = P + b * in2 * BO * 2;
            for (long r = 0; r < npad; r += 16) {
                _tile_zero(0);
                _tile_zero(1);
                for (long k = 0; k < in2; k += 16) {
                    _tile_loadd(2, Xb + r * in2 + k, in2 * 4);
                    _tile_loadd(3, pb + k * BO * 2, BO * 4);
                    _tile_loadd(4, pb + k * BO * 2 + 32, BO * 4);
                    _tile_dpbf16ps(0, 2, 3);
                    _tile_dpbf16ps(1, 2, 4);
                }
                _tile_stored(0, &t16[0][0], 128);
                _tile_stored(1, &t16[0][16], 128);
                long m = out - b * BO < BO ? out - b * BO : BO;
                for (long g = r; g < n && g < r + 16; g++) memcpy(Y + g * out + b * BO, t16[g - r], m * sizeof(float));
            }
        }
        _tile_release();
    }
}
#endif

/* Y [n, out] = X [n, in] W^T from the bfloat16 pack (in even): each row's inputs rounded to bfloat16 on their own,
   so a row's value does not depend on n either */
static void product_bf16(const unsigned short *P, const float *X, float *Y, long out, long in, long n, int threads) {
    long in2 = in / 2, nb = (out + BO - 1) / BO;
#if AMX
    const int tiles = BO == 32 && in2 % 16 == 0 && amx_ok();
#else
    const int tiles = 0;
#endif
    const long npad = tiles ? (n + 15) / 16 * 16 : n;  /* the tile's rows: zeros past n */
    unsigned int *Xb = malloc((size_t)(npad * in2 > 0 ? npad * in2 : 1) * sizeof(unsigned int));
    memset(Xb + n * in2, 0, (size_t)((npad - n) * in2) * sizeof(unsigned int));
    unsigned short *xs = (unsigned short *)Xb;
    for (long r = 0; r < n; r++) {
        const float *xr = X + r * in;
        long i = 0;
        for (; i + 32 <= in; i += 32)
            _mm512_storeu_si512((void *)(xs + r * in + i),
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + i + 16), _mm512_loadu_ps(xr + i)));
        for (; i < in; i++) xs[r * in + i] = bf16_bits(xr[i]);
    }
#if AMX
    if (tiles) {
        product_amx(P, Xb, Y, out, in2, n, npad, threads);
        free(Xb);
        return;
    }
#endif
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < nb; b++) {
        const unsigned short *pb = P + b * in2 * BO * 2;
        const char *pn = b + 1 < nb ? (const char *)(pb + in2 * BO * 2) : 0;
        for (long r = 0; r < n; r += GMAX) {
            const unsigned int *x = Xb + r * in2;
            float *y = Y + r * out;
            switch (n - r < GMAX ? n - r : GMAX) { ROW_CASES(TILE_BF16) }
        }
    }
    free(Xb);
}
#endif

/* A weight whose every run of QB inputs is exactly d * q + m (a GGUF target's Q4_1 layers and Q8_0 embedding,
   de-quantised to float32 on load) is packed as such: per block and run, d [BO] and m [BO] in float16, then q, 4
   bits (two inputs a byte, the even one low) or 8 (signed, m absent): 5 or 8.5 bits a weight where float32 takes
   32. The tile widens them in registers to the same float32 values (d * q is exact, so d * q + m rounds once, as
   the de-quantiser's did) and sums them as tile() does: the float32 products, bit for bit, from a sixth of the
   bytes */
#if HALF && (VW == 16 || VW == 8)
#define QUANT 1
#if VW == 16
#define LDU8(p) ((ivec)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define LDS8(p) ((ivec)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#else
#define LDU8(p) ((ivec)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define LDS8(p) ((ivec)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#endif
#define QB 32                          /* inputs per scale */
#define RUN_Q4 (BO * (4 + QB / 2))     /* bytes per run of QB inputs of one block */
#define RUN_Q8 (BO * (2 + QB))

static inline __attribute__((always_inline)) void tile_q(const unsigned char *P, const float *X, float *Y, long in,
                                                          long out, long o0, const int G, const int q4,
                                                          const char *pf, const long pbytes) {
    vec a[GMAX][NV];
    _Pragma("GCC unroll 8") for (int g = 0; g < G; g++)
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) a[g][v] = (vec){0};
    const long run = q4 ? RUN_Q4 : RUN_Q8;
    for (long j = 0; j < in / QB; j++) {
        const unsigned char *pj = P + j * run;
        if (pf)  /* this row group's share of the next block, spread over its runs (as tile()) */
            for (long c = 0; c < pbytes; c += 64) __builtin_prefetch(pf + j * pbytes + c, 0, 2);
        vec d[NV], m[NV];
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) {
            d[v] = LDH((const unsigned short *)pj + v * VW);
            m[v] = q4 ? LDH((const unsigned short *)pj + BO + v * VW) : (vec){0};
        }
        const float *xj = X + j * QB;
        if (q4) {
            const unsigned char *qj = pj + 4 * BO;
            for (int t = 0; t < QB / 2; t++) {
                ivec r[NV];
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) r[v] = LDU8(qj + t * BO + v * VW);
                _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
                    vec w[NV];
                    _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)
                        w[v] = d[v] * __builtin_convertvector((r[v] >> (4 * h)) & 15, vec) + m[v];
                    madd_rows(a, w, xj + 2 * t + h, in, G);
                }
            }
        } else {
            const unsigned char *qj = pj + 2 * BO;
            for (int t = 0; t < QB; t++) {
                vec w[NV];
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)
                    w[v] = d[v] * __builtin_convertvector(LDS8(qj + t * BO + v * VW), vec);
                madd_rows(a, w, xj + t, in, G);
            }
        }
    }
    store_rows(a, Y, out, o0, G);
}

#define TILE_Q(g) case g: tile_q(pb, x, y, in, out, b * BO, g, q4, pf, pbytes); break;

/* Y [n, out] = X [n, in] W^T from a quantised pack (in a multiple of QB), blocks split and prefetched as product() */
static inline __attribute__((always_inline)) void product_q(const unsigned char *P, const float *X, float *Y,
                                                             long out, long in, long n, int threads, const int q4) {
    const long nb = (out + BO - 1) / BO, runs = in / QB, bytes = runs * (q4 ? RUN_Q4 : RUN_Q8);
    const long ng = (n + GMAX - 1) / GMAX, pbytes = (bytes / (ng * runs) + 63) / 64 * 64;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < nb; b++) {
        const unsigned char *pb = P + b * bytes;
        const char *pn = b + 1 < nb ? (const char *)(pb + bytes) : 0;
        for (long r = 0; r < n; r += GMAX) {
            const char *pf = pn ? pn + (r / GMAX) * runs * pbytes : 0;
            const float *x = X + r * in;
            float *y = Y + r * out;
            switch (n - r < GMAX ? n - r : GMAX) { ROW_CASES(TILE_Q) }
        }
    }
}
#else
#define QUANT 0
#endif

/* the one dispatch on the weights' precision (0 float32, 1 float16, 2 bfloat16, 3 4-bit d * q + m, 4 8-bit d * q;
   inlined copies of the product) */
static void any_product(const void *P, int prec, const float *X, float *Y, long out, long in, long n, int th) {
    if (n <= 0) return;  /* no rows: the prefetch shares below divide by the row-group count */
#if QUANT
    if (prec == 3) { product_q((const unsigned char *)P, X, Y, out, in, n, th, 1); return; }
    if (prec == 4) { product_q((const unsigned char *)P, X, Y, out, in, n, th, 0); return; }
#endif
#if BF16
    if (prec == 2) { product_bf16((const unsigned short *)P, X, Y, out, in, n, th); return; }
#endif
    if (prec == 1) product(P, X, Y, out, in, n, th, 1);
    else product(P, X, Y, out, in, n, th, 0);
}

void skinny_linear(const void *P, int prec, const float *X, float *Y, long out, long in, long n, int threads) {
    any_product(P, prec, X, Y, out, in, n, threads);
}

int block_outputs(void) { return BO; }
int half_weights(void) { return HALF; }
int bf16_weights(void) { return BF16; }
int quant_weights(void) { return QUANT; }
int amx_tiles(void) {
#if AMX
    return amx_ok();
#else
    return 0;
#endif
}

/* ---- the decoder layers around the products (a Llama-family layer, pre-norm, SwiGLU) ---------------------------
   One call runs every layer of a forward of n rows, so a decode step costs its products and a few hundred
   microseconds, not the ~1,000 small torch ops a step it cost before. Every row is computed on its own, in an order
   that does not depend on n or on which rows share the forward: a decode step and a tree verify give the same
   bits for the same prefix (attention sums over the visible keys in cache order; a hidden key is skipped). */
#include <math.h>
#include <string.h>
#define HDMAX 256  /* the largest head size this code takes (the caller checks) */

typedef struct {  /* one layer's weights: packed products and vectors; a NULL bias or norm is absent */
    const float *ln1, *ln2;
    const void *qkv;
    const float *qkv_b;
    const void *o;
    const float *o_b;
    const void *gu;
    const float *gu_b;
    const void *d;
    const float *d_b, *q_norm, *k_norm;
    const float *hn;     /* EAGLE-3's layer when set: the attention reads [ln1(e) ; hn(x)] (2 x hidden wide), e the
                            token embeddings passed beside x; with norm_residual the residual is hn(x) */
    long norm_residual;
    long prec;  /* bits 4i..4i+3: product i's (qkv, o, gu, d) packing, any_product's codes */
} layer_t;

typedef struct {
    long hidden, heads, kv_heads, head_dim, inter, cap, kstride;  /* cap: cache rows per kv head; kstride: the
                                                                     floats per transposed key row (>= cap) */
    float eps, qk_eps, scaling;
    int threads;
} dims_t;

static inline vec sel(ivec m, vec a, vec b) { return (vec)((m & (ivec)a) | (~m & (ivec)b)); }

/* e^x, |error| ~1 ulp: x = k ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial */
static inline vec vexp(vec x) {
    x = sel(x > 88.0f, (vec){0} + 88.0f, x);
    x = sel(x < -87.0f, (vec){0} - 87.0f, x);
    vec t = x * 1.44269504088896341f;
    t += sel(t >= 0.0f, (vec){0} + 0.5f, (vec){0} - 0.5f);
    ivec k = __builtin_convertvector(t, ivec);  /* truncation of t +- 0.5: the nearest integer */
    vec kf = __builtin_convertvector(k, vec);
    vec r = x - kf * 0.693359375f;
    r = r + kf * 2.12194440e-4f;
    vec p = (vec){0} + 1.0f / 720;
    p = p * r + 1.0f / 120; p = p * r + 1.0f / 24; p = p * r + 1.0f / 6; p = p * r + 0.5f;
    p = p * r + 1.0f; p = p * r + 1.0f;
    return p * (vec)((k + 127) << 23);
}

static inline float hsum(vec a) {  /* a fixed pairwise order */
    float t[VW];
    memcpy(t, &a, sizeof a);
    for (int w = VW / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) t[i] += t[i + w];
    return t[0];
}

/* y = w * x / sqrt(mean(x^2) + eps) over m values (m a multiple of VW) */
static void rms_norm(const float *x, const float *w, float *y, long m, float eps) {
    vec acc = {0};
    for (long i = 0; i < m; i += VW) acc += LD(x + i) * LD(x + i);
    float inv = 1.0f / sqrtf(hsum(acc) / m + eps);
    for (long i = 0; i < m; i += VW) *(vec *)(y + i) = LD(w + i) * (LD(x + i) * inv);
}

static void add_bias(float *y, const float *b, long n, long m) {
    if (b)
        for (long r = 0; r < n; r++)
            for (long i = 0; i < m; i++) y[r * m + i] += b[i];
}

/* HF's rotate-half rope on one head: x * cos + rotate_half(x) * sin */
static void rope(float *x, const float *cos, const float *sin, long hd) {
    float t[HDMAX];
    long half = hd / 2;
    for (long j = 0; j < half; j++) t[j] = x[j] * cos[j] - x[j + half] * sin[j];
    for (long j = half; j < hd; j++) t[j] = x[j] * cos[j] + x[j - half] * sin[j];
    memcpy(x, t, hd * sizeof(float));
}

/* row r, the G query heads of one kv head (q [G][hd]): softmax(q K^T * scaling + mask) V over the keys row r sees,
   into out [G][hd]. Kh: the kv head's keys transposed, [hd][ks] (ks a multiple of 4 VW), so VW keys' scores are
   one vector with no horizontal sum; Vh: [cap][hd]. Visible: key j when mask[j] > -1e30 (an additive mask [n, L]),
   or j < vis (causal, mask NULL). s: G x (L rounded up to 4 VW). Each score is its lane's own chain over d, and
   each output sums the visible keys in cache order: the bits do not depend on where in the cache a key sits. */
static void attend(const float *q, const float *Kh, const float *Vh, const float *mask, long L, long vis, long ks,
                   float scaling, long hd, long G, float *s, float *out) {
    L = vis < L ? vis : L;  /* causal: the keys past the row's own are never read */
    const long Lp = (L + 4 * VW - 1) / (4 * VW) * (4 * VW);
    float sum[HDMAX];  /* per head (G <= HDMAX: the caller checks) */
    for (long t = 0; t < G; t++) {
        const float *qt = q + t * hd;
        float *st = s + t * Lp;
        for (long j0 = 0; j0 < Lp; j0 += 4 * VW) {  /* four independent chains: FMA latency, not a dependency */
            vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (long d = 0; d < hd; d++) {
                const float *k = Kh + d * ks + j0;
                float qd = qt[d];
                a0 += LD(k) * qd; a1 += LD(k + VW) * qd; a2 += LD(k + 2 * VW) * qd; a3 += LD(k + 3 * VW) * qd;
            }
            *(vec *)(st + j0) = a0 * scaling; *(vec *)(st + j0 + VW) = a1 * scaling;
            *(vec *)(st + j0 + 2 * VW) = a2 * scaling; *(vec *)(st + j0 + 3 * VW) = a3 * scaling;
        }
        vec mv = (vec){0} - INFINITY;  /* hidden keys -> -inf; the max is exact in any order */
        ivec lane;
        for (int i = 0; i < VW; i++) lane[i] = i;
        long j0 = 0;
        for (; j0 + VW <= L; j0 += VW) {
            vec v = LD(st + j0);
            ivec seen = mask ? (ivec)(LD(mask + j0) > -1e30f) : (lane + (int)j0 < (int)vis);
            v = sel(seen, mask ? v + LD(mask + j0) : v, (vec){0} - INFINITY);
            *(vec *)(st + j0) = v;
            mv = sel(v > mv, v, mv);
        }
        float m = -INFINITY;
        for (int i = 0; i < VW; i++) m = mv[i] > m ? mv[i] : m;
        for (long j = j0; j < Lp; j++) {
            if (j >= L || j >= vis || (mask && !(mask[j] > -1e30f))) { st[j] = -INFINITY; continue; }
            if (mask) st[j] += mask[j];
            m = st[j] > m ? st[j] : m;
        }
        for (long j = 0; j < Lp; j += VW) {
            vec v = LD(st + j);
            *(vec *)(st + j) = sel(v == -INFINITY, (vec){0}, vexp(v - m));
        }
        sum[t] = 0.0f;
    }
    vec o[HDMAX / VW * 4];  /* G x hd / VW accumulators, G <= 4 at a time */
    for (long t0 = 0; t0 < G; t0 += 4) {
        long g = G - t0 < 4 ? G - t0 : 4;
        for (long i = 0; i < g * hd / VW; i++) o[i] = (vec){0};
        /* in cache order: a tree's ancestors come in the order a decode step saw them */
        for (long j = 0; j < L; j++) {
            const float *v = Vh + j * hd;
            for (long t = 0; t < g; t++) {  /* a hidden key adds exact zeros: as if absent */
                float p = s[(t0 + t) * Lp + j];
                sum[t0 + t] += p;
                for (long i = 0; i < hd / VW; i++) o[t * hd / VW + i] += LD(v + i * VW) * p;
            }
        }
        for (long t = 0; t < g; t++) {
            float inv = 1.0f / sum[t0 + t];
            for (long i = 0; i < hd / VW; i++) *(vec *)(out + (t0 + t) * hd + i * VW) = o[t * hd / VW + i] * inv;
        }
    }
}

/* Every layer on x [n, hidden] (the residual stream, updated in place), the new rows' keys and values written at
   cache rows start..start+n of K [layers][kv_heads][head_dim][kstride] (transposed) and V [layers][kv_heads][cap]
   [head_dim]. cos, sin [n, head_dim]; mask [n, start + n]
   or NULL; scratch: lean_scratch floats; feats[i] (or NULL) receives x after layer i. */
long lean_scratch(const dims_t *D, long n, long start) {
    long qkv = (D->heads + 2 * D->kv_heads) * D->head_dim;
    long L = (start + n + 4 * VW - 1) / (4 * VW) * (4 * VW);
    return n * (2 * D->hidden + qkv + D->heads * D->head_dim + 3 * D->inter) +
           (long)D->threads * (D->heads / D->kv_heads) * L;
}

void lean_layers(const layer_t *layers, long nl, const dims_t *D, float *x, long n, const float *cos,
                 const float *sin, float *K, float *V, long start, const float *mask, float *scratch, float **feats,
                 const float *emb) {
    const long H = D->hidden, hd = D->head_dim, nh = D->heads, nkv = D->kv_heads, I = D->inter;
    const long QKV = (nh + 2 * nkv) * hd, A = nh * hd, L = start + n, group = nh / nkv;
    const long Lp = (L + 4 * VW - 1) / (4 * VW) * (4 * VW);
    float *h = scratch, *qkv = h + 2 * n * H, *att = qkv + n * QKV, *gu = att + n * A, *act = gu + n * 2 * I;
    float *sc = act + n * I;
    for (long li = 0; li < nl; li++) {
        const layer_t *w = layers + li;
        float *Kl = K + li * nkv * hd * D->kstride, *Vl = V + li * nkv * D->cap * hd;
        if (w->hn) {  /* EAGLE-3: [ln1(e) ; hn(x)] */
            for (long r = 0; r < n; r++) {
                rms_norm(emb + r * H, w->ln1, h + r * 2 * H, H, D->eps);
                rms_norm(x + r * H, w->hn, h + r * 2 * H + H, H, D->eps);
                if (w->norm_residual) memcpy(x + r * H, h + r * 2 * H + H, H * sizeof(float));
            }
        } else {
            for (long r = 0; r < n; r++) rms_norm(x + r * H, w->ln1, h + r * H, H, D->eps);
        }
        any_product(w->qkv, (w->prec >> 0) & 15, h, qkv, QKV, w->hn ? 2 * H : H, n, D->threads);
        add_bias(qkv, w->qkv_b, n, QKV);
        for (long r = 0; r < n; r++) {
            float *row = qkv + r * QKV;
            for (long j = 0; j < nh + nkv; j++) {
                float *head = row + j * hd;
                const float *nw = j < nh ? w->q_norm : w->k_norm;
                if (nw) rms_norm(head, nw, head, hd, D->qk_eps);  /* Qwen3: per-head norm before rope */
                rope(head, cos + r * hd, sin + r * hd, hd);
            }
            for (long g = 0; g < nkv; g++) {
                for (long d = 0; d < hd; d++) Kl[(g * hd + d) * D->kstride + start + r] = row[(nh + g) * hd + d];
                memcpy(Vl + (g * D->cap + start + r) * hd, row + (nh + nkv + g) * hd, hd * sizeof(float));
            }
        }
        #pragma omp parallel for num_threads(D->threads) schedule(static)
        for (long it = 0; it < n * nkv; it++) {  /* a row's query heads of one kv head */
            long r = it / nkv, g = it % nkv;
            attend(qkv + r * QKV + g * group * hd, Kl + g * hd * D->kstride, Vl + g * D->cap * hd,
                   mask ? mask + r * L : 0, L, mask ? L : start + r + 1, D->kstride, D->scaling, hd, group,
                   sc + omp_get_thread_num() * group * Lp, att + r * A + g * group * hd);
        }
        any_product(w->o, (w->prec >> 4) & 15, att, h, H, A, n, D->threads);
        add_bias(h, w->o_b, n, H);
        for (long i = 0; i < n * H; i++) x[i] += h[i];
        for (long r = 0; r < n; r++) rms_norm(x + r * H, w->ln2, h + r * H, H, D->eps);
        any_product(w->gu, (w->prec >> 8) & 15, h, gu, 2 * I, H, n, D->threads);
        add_bias(gu, w->gu_b, n, 2 * I);
        for (long r = 0; r < n; r++) {
            const float *g = gu + r * 2 * I, *u = g + I;
            float *a = act + r * I;
            long c = 0;
            for (; c + VW <= I; c += VW) *(vec *)(a + c) = LD(g + c) / (1.0f + vexp(-LD(g + c))) * LD(u + c);
            for (; c < I; c++) a[c] = g[c] / (1.0f + expf(-g[c])) * u[c];
        }
        any_product(w->d, (w->prec >> 12) & 15, act, h, H, I, n, D->threads);
        add_bias(h, w->d_b, n, H);
        for (long i = 0; i < n * H; i++) x[i] += h[i];
        if (feats && feats[li]) memcpy(feats[li], x, n * H * sizeof(float));
    }
}

/* Y [n, out] = rms_norm(X) (weight w) times the packed P, via T [n, in]: a draft head's final norm and LM head in
   one call (in a multiple of VW) */
void skinny_norm_linear(const void *P, int prec, const float *X, const float *w, float eps, float *T, float *Y,
                        long out, long in, long n, int threads) {
    for (long r = 0; r < n; r++) rms_norm(X + r * in, w, T + r * in, in, eps);
    any_product(P, prec, T, Y, out, in, n, threads);
}
"""

# The tile shape per instruction set: (floats per vector, vectors per block, rows per tile, extra compiler
# flags). "avx2" on an AVX-512 CPU is built with AVX-512 off, so one machine can measure both
# (GRAFT_BLOCK_SKINNY=avx2).
VARIANTS = {"avx512": (16, 2, 8, []), "avx2": (8, 2, 6, ["-mno-avx512f"]), "generic": (4, 2, 4, [])}
if os.environ.get("GRAFT_BLOCK_SKINNY_SHAPE"):  # "VW,NV,ROWS" to measure another tile (kept out of the choice)
    _shape = tuple(map(int, os.environ["GRAFT_BLOCK_SKINNY_SHAPE"].split(",")))
    VARIANTS["custom"] = (*_shape, [] if _shape[0] > 8 else ["-mno-avx512f"])

class _Layer(ctypes.Structure):  # layer_t
    POINTERS = ("ln1", "ln2", "qkv", "qkv_b", "o", "o_b", "gu", "gu_b", "d", "d_b", "q_norm", "k_norm", "hn")
    _fields_ = [(k, ctypes.c_void_p) for k in POINTERS] + [("norm_residual", ctypes.c_long), ("prec", ctypes.c_long)]


class _Dims(ctypes.Structure):  # dims_t
    _fields_ = [(k, ctypes.c_long) for k in ("hidden", "heads", "kv_heads", "head_dim", "inter", "cap", "kstride")] + \
               [(k, ctypes.c_float) for k in ("eps", "qk_eps", "scaling")] + [("threads", ctypes.c_int)]


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


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo's flags line, as a set)."""
    return set(_cpu_flags().split(":", 1)[-1].split())


def variant() -> str:
    """The tile shape this CPU gets: ``avx512``, ``avx2`` or ``generic`` (``GRAFT_BLOCK_SKINNY`` overrides)."""
    chosen = os.environ.get("GRAFT_BLOCK_SKINNY")
    if chosen:
        if chosen not in VARIANTS:
            raise RuntimeError(f"GRAFT_BLOCK_SKINNY={chosen!r}: not one of {', '.join(VARIANTS)}")
        return chosen
    flags = cpu_flags()
    return "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else "generic"


AMX_ENV = "GRAFT_BLOCK_AMX"  # "0": bfloat16 products without the AMX tiles, where the CPU has them (to measure)


def compile_library(source: str, flags: list[str], stem: str, libs: tuple[str, ...] = ()):
    """The shared library of C ``source`` built with ``flags`` (and linked with ``libs``, e.g. "-lm", after the
    source) by the system compiler (``$CC``, else ``cc``), once per source, compiler, flags and CPU, into the user
    cache; its path. RuntimeError without a working compiler."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc!r} not found; set CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    flags = [*flags, "-shared", "-fPIC"]
    key = hashlib.sha1(repr((source, version, flags, libs, _cpu_flags())).encode()).hexdigest()[:16]
    path = graft_block.cache_root() / "skinny" / f"{stem}-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        src = path.with_suffix(f".{os.getpid()}.c")
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        src.write_text(source)
        done = subprocess.run([cc, *flags, str(src), *libs, "-o", str(tmp)], capture_output=True, text=True)
        src.unlink()
        if done.returncode:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[:300]}")
        os.replace(tmp, path)  # atomic: a parallel process never loads a half-written library
    return path


def build_library(kind: str, source: str = SOURCE) -> ctypes.CDLL:
    """The library of ``source`` (this module's kernel, or another version of it: ``eval/bench_skinny.py``) for
    the tile ``kind``, compiled once per source, compiler, flags and CPU into the user cache."""
    vw, nv, rows, extra = VARIANTS[kind]
    flags = ["-O3", "-march=native", *extra, f"-DVW={vw}", f"-DNV={nv}", f"-DGMAX={rows}", "-fopenmp"] + \
        (["-DNO_AMX"] if os.environ.get(AMX_ENV) == "0" else [])
    path = compile_library(source, flags, f"skinny-{kind}")
    before = _openmp_runtimes()
    lib = ctypes.CDLL(str(path))
    # it must bind to the libgomp.so.1 torch loaded: a runtime it brings in would spin a second pool beside torch's
    # (other runtimes already loaded under their own names, e.g. a wheel's renamed libgomp, are not its concern)
    if _openmp_runtimes() != before or not any("libgomp.so" in r for r in before):
        raise RuntimeError("its OpenMP runtime is not torch's (a second thread pool would spin beside torch's)")
    lib.pack.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int]
    lib.skinny_linear.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_long] * 3 + \
        [ctypes.c_int]
    lib.pack.restype = lib.skinny_linear.restype = None
    lib.block_outputs.restype = lib.half_weights.restype = lib.bf16_weights.restype = ctypes.c_int
    for name in ("quant_weights", "amx_tiles"):  # absent from older kernel versions (eval/bench_skinny.py builds them)
        if hasattr(lib, name):
            getattr(lib, name).restype = ctypes.c_int
    lib.lean_scratch.argtypes = [ctypes.POINTER(_Dims), ctypes.c_long, ctypes.c_long]
    lib.lean_scratch.restype = ctypes.c_long
    lib.lean_layers.argtypes = [ctypes.POINTER(_Layer), ctypes.c_long, ctypes.POINTER(_Dims), ctypes.c_void_p,
                                ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.lean_layers.restype = None
    lib.skinny_norm_linear.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                                       ctypes.c_int]
    lib.skinny_norm_linear.restype = None
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
                _lib = build_library(_variant)
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _why_not = str(e)
    return _lib is not None


def label() -> str | None:
    """The tile shape as built here, e.g. ``avx2 (8-float vectors, 6-row tiles)``; None when unavailable."""
    if not available():
        return None
    vw, nv, rows, _ = VARIANTS[_variant]
    amx = ", bfloat16 on AMX tiles" if _lib.bf16_weights() and _lib.amx_tiles() else ""
    return f"{_variant} ({nv} x {vw}-float vectors, {rows}-row tiles{amx})"


def why_not() -> str | None:
    available()
    return _why_not


DRAFT_BF16_ENV = "GRAFT_BLOCK_DRAFT_BF16"
_bf16: bool | None = None  # whether this CPU runs the bfloat16 products


def draft_half() -> str | None:
    """How a drafter packs its products (``SkinnyWeight``'s ``half``): "bf16" where this CPU has AVX512-BF16 (half
    the bytes of float32 and twice its multiply-adds per instruction; a draft's numbers need not be the target's,
    the verify keeps only what the target computes), unless ``GRAFT_BLOCK_DRAFT_BF16=0``; else None (float32, or
    float16 where the weights are fp16-exact). Read at each packing, so tests can switch it."""
    global _bf16
    if os.environ.get(DRAFT_BF16_ENV, "1") == "0":
        return None
    if _bf16 is None:  # read once: drafters' linears check the packing on every call
        _bf16 = available() and bool(_lib.bf16_weights())
    return "bf16" if _bf16 else None


class SkinnyWeight:
    """A weight [out, in] packed for ``linear``: [ceil(out / B)][in][B] with B two vectors' worth of outputs (32
    on AVX-512, 16 on AVX2), the outputs past ``out`` zero. In float16 when every value is one exactly (a drafter
    checkpoint stored in fp16, upcast on load) and the CPU converts on load (F16C): half the bytes per product,
    the same products bit for bit. ``half``: None = whenever exact; False = float32; "round": float16 always,
    rounded (a drafter's own copy of rows whose products need not be exact); "bf16": bfloat16 pairs
    [ceil(out / B)][in / 2][B][2], the inputs rounded to bfloat16 too (AVX512-BF16 only, ``in`` even; elsewhere
    as "round"). With ``quant`` (default: ``GRAFT_BLOCK_EXACT_QUANT=1``), None also packs a weight that is exactly
    4-bit d * q + m or 8-bit d * q per 32 inputs (``exact_quant``: a GGUF target's) in that form, uint8: the same
    products again.
    ``prec``: the packing's code for the C products (``F32``, ``F16``, ``BF16``, ``Q4``, ``Q8``)."""
    __slots__ = ("packed", "out", "n_in", "prec")

    def __init__(self, w: torch.Tensor, half: bool | str | None = None, quant: bool | None = None):
        if not available():
            raise RuntimeError(f"the skinny kernel is unavailable here: {_why_not}")
        w = w.detach()
        if w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu":
            raise ValueError(f"skinny packs a float32 CPU weight [out, in]; got {tuple(w.shape)} {w.dtype} on "
                             f"{w.device}")
        w = w.contiguous()
        self.out, self.n_in = w.shape
        block = _lib.block_outputs()
        nb = (self.out + block - 1) // block
        if half == "bf16" and _lib.bf16_weights() and self.n_in % 2 == 0:
            padded = torch.zeros(nb * block, self.n_in, dtype=torch.bfloat16)
            padded[: self.out] = w  # rounded to nearest even on the copy
            self.packed = padded.view(nb, block, self.n_in // 2, 2).transpose(1, 2).contiguous().view(-1)
            self.prec = BF16
            return
        if half is None and (quant_exact_enabled() if quant is None else quant and _lib.quant_weights()):
            found = exact_quant(w)
            if found is not None:
                self.packed, self.prec = _pack_quant(*found, block), Q4 if found[2] is not None else Q8
                return
        if half is not False and _lib.half_weights() and (half in ("round", "bf16")
                                                          or bool((w.half().float() == w).all())):
            padded = torch.zeros(nb * block, self.n_in, dtype=torch.float16)
            padded[: self.out] = w  # rounded to float16 on the copy: no float32 transpose of the whole weight
            self.packed, self.prec = padded.view(nb, block, self.n_in).transpose(1, 2).contiguous().view(-1), F16
            return
        self.prec = F32
        self.packed = torch.empty(nb * block * self.n_in)
        _lib.pack(w.data_ptr(), self.packed.data_ptr(), self.out, self.n_in, torch.get_num_threads())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows ``ids`` [n] back out of the pack, float32 [n, in]: the engine's resident copy, so a
        drafter gathering LM-head rows does not fault HF's released pages back in."""
        block = _lib.block_outputs()
        ids = ids.to(torch.long).cpu()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.out):
            raise ValueError(f"row ids must lie in 0..{self.out - 1}")
        if self.prec in (Q4, Q8):
            return _quant_rows(self.packed, self.prec, self.n_in, ids, block)
        if self.prec == BF16:
            pairs = self.packed.view(-1, self.n_in // 2, block, 2)[ids // block, :, ids % block]
            return pairs.reshape(-1, self.n_in).float()
        return self.packed.view(-1, self.n_in, block)[ids // block, :, ids % block].float()


# the C code's codes for a pack (any_product): float32, float16, bfloat16, and the quantised packs, 4-bit d * q + m
# and 8-bit d * q per run of QB inputs
F32, F16, BF16, Q4, Q8 = 0, 1, 2, 3, 4
QB = 32
QUANT_ENV = "GRAFT_BLOCK_EXACT_QUANT"


def quant_exact_enabled() -> bool:
    """Whether float32 weights that are exactly quantised values pack as such: with ``GRAFT_BLOCK_EXACT_QUANT=1``
    (``graft-block bench --exact-quant``), read at each packing. Off by default: it changes which regime a CPU
    target runs in, not its numbers (docs/engine.md, "Weights streamed in the form they are exact in")."""
    return os.environ.get(QUANT_ENV, "0") == "1" and available() and bool(_lib.quant_weights())


def _fp16_steps(x: torch.Tensor, step: int) -> torch.Tensor:
    """x (float16 values) moved ``step`` float16 ulps, as float32."""
    return (x.view(torch.int16) + step).view(torch.float16).float() if step else x.float()


def exact_quant(w: torch.Tensor, chunk: int = 4096):
    """(d, q, m) with ``w`` [out, in] == d * q + m bit for bit in float32, per run of QB inputs: d and m float16
    values [out, in / QB], q [out, in] in 0..15 (GGUF's Q4_1) or, with m None, d * q with q in -127..127 (Q8_0);
    None when ``w`` is neither (in not a multiple of QB, or one value off). Found from the float32 values alone: m
    is the run's least value (q = 0), d the float16 next to (max - m) / 15 (or max |w| / 127) that rebuilds every
    value of the run."""
    out, n_in = w.shape
    if n_in % QB or not out or not n_in:  # no runs: nothing to pack, and the C product would divide by zero runs
        return None
    for q4 in (True, False):
        if _exact_runs(w[:64], q4) is None:  # a cheap refusal for the float32 weights most are
            continue
        parts = [_exact_runs(w[r:r + chunk], q4) for r in range(0, out, chunk)]
        if any(p is None for p in parts):
            return None
        return tuple(None if parts[0][i] is None else torch.cat([p[i] for p in parts]) for i in range(3))
    return None


def _exact_runs(w: torch.Tensor, q4: bool):
    v = w.reshape(w.shape[0], -1, QB)
    if q4:
        lo = v.amin(-1, keepdim=True)
        m16 = lo.half()
        if not bool((m16.float() == lo).all()):
            return None
        d16, top, base = ((v.amax(-1, keepdim=True) - lo) / 15).half(), 15, lo
    else:
        m16, base = None, 0.0
        d16, top = (v.abs().amax(-1, keepdim=True) / 127).half(), 127
    bits = v.view(torch.int32)
    ok = torch.zeros(v.shape[:2] + (1,), dtype=torch.bool)
    d_best, q_best = torch.zeros(v.shape[:2] + (1,)), torch.zeros_like(v)
    for step in (0, 1, -1, 2, -2):  # the float16 rounding of d may sit an ulp or two off the ratio
        d = _fp16_steps(d16, step)
        q = torch.where(d > 0, (v - base) / torch.where(d > 0, d, 1.0), 0.0).round().clamp(0 if q4 else -top, top)
        q += 0.0  # an integer has no -0: a -0.0 weight (d * -0.0) is not one the pack can hold
        rebuilt = d * q + base if q4 else d * q  # Q8 adds nothing: d * -q for d = 0 is -0.0, as in the C code
        good = (rebuilt.view(torch.int32) == bits).all(-1, keepdim=True) & ~ok & (d >= 0)
        d_best, q_best, ok = torch.where(good, d, d_best), torch.where(good, q, q_best), ok | good
        if bool(ok.all()):
            return (d_best.squeeze(-1).half(), q_best.to(torch.int8).view(w.shape),
                    None if m16 is None else m16.squeeze(-1))
    return None


def _pack_quant(d: torch.Tensor, q: torch.Tensor, m: torch.Tensor | None, block: int) -> torch.Tensor:
    """The C code's quantised pack (uint8): per block of ``block`` outputs and run of QB inputs, d [block] float16,
    m [block] float16 (Q4), then q: for Q4 [QB / 2][block] bytes, inputs 2t (low nibble) and 2t + 1 (high); for
    Q8 [QB][block] int8."""
    out, n_in = q.shape
    nb, runs = -(-out // block), n_in // QB

    def per_block(t: torch.Tensor, width: int) -> torch.Tensor:  # [out, runs * width] -> [nb, runs, width, block]
        padded = torch.zeros((nb * block, runs * width), dtype=t.dtype)
        padded[:out] = t.reshape(out, runs * width)
        return padded.view(nb, block, runs, width).permute(0, 2, 3, 1)

    parts = [per_block(d, 1).contiguous().view(torch.uint8)]  # [nb, runs, 1, 2 * block]
    if m is not None:
        parts.append(per_block(m, 1).contiguous().view(torch.uint8))
        nib = q.view(torch.uint8).view(out, runs, QB // 2, 2)
        parts.append(per_block(nib[..., 0] | (nib[..., 1] << 4), QB // 2).contiguous().view(nb, runs, 1, -1))
    else:
        parts.append(per_block(q.view(torch.uint8), QB).contiguous().view(nb, runs, 1, -1))
    return torch.cat(parts, -1).view(-1)


def _quant_rows(packed: torch.Tensor, prec: int, n_in: int, ids: torch.Tensor, block: int) -> torch.Tensor:
    """Rows ``ids`` of a quantised pack as float32 [n, in]: d * q + m, the values it was packed from."""
    runs = n_in // QB
    run = block * (4 + QB // 2) if prec == Q4 else block * (2 + QB)
    p = packed.view(-1, runs, run)[ids // block]  # [n, runs, run bytes]
    lane = (ids % block).view(-1, 1, 1)

    def column(lo: int, width: int) -> torch.Tensor:  # bytes lo.. as [n, runs, width, block] -> the rows' lanes
        t = p[..., lo: lo + width * block].reshape(len(ids), runs, width, block)
        return t.gather(3, lane.unsqueeze(-1).expand(-1, runs, width, 1)).squeeze(-1)

    def scale(lo: int) -> torch.Tensor:  # the float16 [block] at byte lo -> the rows' lanes [n, runs, 1]
        return p[..., lo: lo + 2 * block].contiguous().view(torch.float16).gather(2, lane.expand(-1, runs, 1)).float()

    d = scale(0)
    if prec == Q4:
        m = scale(2 * block)
        nib = column(4 * block, QB // 2)
        q = torch.stack((nib & 15, nib >> 4), -1).reshape(len(ids), runs, QB).float()
        return (d * q + m).reshape(len(ids), n_in)
    q = column(2 * block, QB).view(torch.int8).float()
    return (d * q).reshape(len(ids), n_in)


def _product(x: torch.Tensor, packed: torch.Tensor, out_features: int, prec: int) -> torch.Tensor:
    """x [n, in] (contiguous) times the packed weight (its packing ``prec``) -> [n, out_features]."""
    y = torch.empty(x.shape[0], out_features)
    _lib.skinny_linear(packed.data_ptr(), prec, x.data_ptr(), y.data_ptr(), out_features, x.shape[1], x.shape[0],
                       torch.get_num_threads())
    return y


@torch.library.custom_op("graft_block::skinny_linear", mutates_args=())
def _linear_op(x: torch.Tensor, packed: torch.Tensor, out_features: int, prec: int) -> torch.Tensor:
    """The product as an op torch.compile can place in a graph (it fuses the small ops around it)."""
    return _product(x, packed, out_features, prec)


@_linear_op.register_fake
def _(x, packed, out_features, prec):
    return x.new_empty(x.shape[0], out_features)


def linear(x: torch.Tensor, w: SkinnyWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the packed weight: x [..., in] float32 on CPU, a few rows in all."""
    if x.shape[-1] != w.n_in or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"skinny multiplies float32 CPU rows of {w.n_in}; got x {tuple(x.shape)} {x.dtype} on "
                         f"{x.device}")
    lead = x.shape[:-1]
    x = x.reshape(lead.numel(), w.n_in).contiguous()  # not -1: ambiguous for a weight of 0 inputs
    y = (_linear_op if torch.compiler.is_compiling() else _product)(x, w.packed, w.out, w.prec)  # eager: no dispatch
    if bias is not None:
        y.add_(bias)
    return y.view(*lead, w.out)


def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: SkinnyWeight) -> torch.Tensor:
    """``linear(rms_norm(x), w)`` in one call: x [n, in] float32 rows, ``norm_weight`` [in] float32 (a draft head's
    final norm and LM head; ``in`` a multiple of the vector width, else the norm runs in torch)."""
    n = x.shape[0]
    if x.dim() != 2 or x.shape[1] != w.n_in or x.dtype != torch.float32 or norm_weight.dtype != torch.float32:
        raise ValueError(f"norm_linear takes float32 rows of {w.n_in}; got x {tuple(x.shape)} {x.dtype}")
    if w.n_in % VARIANTS[_variant][0]:
        return _product(torch.rms_norm(x, (w.n_in,), norm_weight, eps).contiguous(), w.packed, w.out, w.prec)
    x, norm_weight = x.contiguous(), norm_weight.contiguous()
    t, y = torch.empty(n, w.n_in), torch.empty(n, w.out)
    _lib.skinny_norm_linear(w.packed.data_ptr(), w.prec, x.data_ptr(), norm_weight.data_ptr(), eps,
                            t.data_ptr(), y.data_ptr(), w.out, w.n_in, n, torch.get_num_threads())
    return y


CAP_MULTIPLE = 64  # a transposed key row holds a multiple of this many floats (whole blocks of 4 vectors)


def key_cache_shape(layers: int, kv_heads: int, head_dim: int, cap: int) -> tuple[int, int, int, int]:
    """The transposed key cache for ``cap`` cache rows. Each row of a head's [head_dim][rows] block is padded by
    one block off a multiple of 4 KB: the attention walks down head_dim, and at a 4 KB stride every access falls in
    one L1 set (measured at 1,024 rows, 17-row verifies: +10 ms from 100 to 600 cached tokens, against +4.6 ms
    for torch's attention)."""
    rows = -(-cap // CAP_MULTIPLE) * CAP_MULTIPLE
    return layers, kv_heads, head_dim, rows + (CAP_MULTIPLE if rows * 4 % 4096 == 0 else 0)


class LayerCache:
    """The K/V cache of a C layer stack beside the target's (a drafter's): keys transposed, [layers, kv_heads,
    head_dim, kstride] (``key_cache_shape``), values [layers, kv_heads, cap, head_dim]; grown by doubling."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int):
        self.shape = (layers, kv_heads, head_dim)
        self.k = self.v = None

    def reserve(self, total: int, keep: int) -> None:
        """Room for ``total`` rows; the first ``keep`` rows survive a reallocation."""
        cap = 0 if self.v is None else self.v.shape[2]
        if total <= cap:
            return
        if keep > cap:
            raise ValueError(f"cannot keep {keep} rows of a cache holding {cap}: reserve the rows before writing them")
        new = max(256, 1 << (total - 1).bit_length())
        nl, kvh, hd = self.shape
        k, v = torch.zeros(key_cache_shape(nl, kvh, hd, new)), torch.zeros(nl, kvh, new, hd)
        if keep:
            k[..., :keep] = self.k[..., :keep]
            v[:, :, :keep] = self.v[:, :, :keep]
        self.k, self.v = k, v

    def rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n rows as [layers, kv_heads, n, head_dim] keys and values (views; for tests and tools)."""
        if self.v is None:  # nothing reserved yet
            empty = torch.zeros(self.shape[0], self.shape[1], 0, self.shape[2])
            return empty, empty.clone()
        return self.k[..., :n].transpose(2, 3), self.v[:, :, :n]


class DecoderLayers:
    """A Llama-family decoder stack run by ``lean_layers`` (C): every layer of a forward in one call, on the
    layers' packed products. ``layers``: per layer a dict of float32 CPU tensors (``ln1``, ``ln2``, the biases
    ``qkv_b``, ``o_b``, ``gu_b``, ``d_b`` and Qwen3's ``q_norm``/``k_norm`` weights, each possibly None) and
    SkinnyWeights (``qkv``, ``o``, ``gu``, ``d``: q/k/v and gate/up fused). EAGLE-3's layer adds ``hn`` (its
    hidden_norm: the q/k/v product reads [ln1(embeddings) ; hn(x)], 2 x hidden wide) and ``norm_residual``."""

    def __init__(self, layers: list[dict], hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int,
                 eps: float, qk_eps: float, scaling: float):
        reason = layers_unsupported(hidden, heads, kv_heads, head_dim)
        if reason:
            raise ValueError(f"the C decoder layers cannot run this model: {reason}")
        self._keep = []  # every tensor a pointer below points into

        def ptr(t):
            if t is None:
                return None
            t = t.packed if isinstance(t, SkinnyWeight) else t.detach().contiguous()
            if t.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.uint8) or t.device.type != "cpu":
                raise ValueError(f"the C decoder layers take float32 CPU tensors; got {t.dtype} on {t.device}")
            self._keep.append(t)
            return t.data_ptr()

        def prec(w):  # each product's packing (``SkinnyWeight.prec``), four bits apiece
            return sum(w[k].prec << 4 * i for i, k in enumerate(("qkv", "o", "gu", "d")))

        self.layers = (_Layer * len(layers))(*[_Layer(**{k: ptr(w.get(k)) for k in _Layer.POINTERS},
                                                      norm_residual=int(bool(w.get("norm_residual"))),
                                                      prec=prec(w)) for w in layers])
        self.dims = _Dims(hidden, heads, kv_heads, head_dim, inter, 0, 0, eps, qk_eps, scaling, 1)
        self.scratch = torch.empty(0)
        self.reads_emb = any(w.get("hn") is not None for w in layers)  # an EAGLE-3 layer: run() needs emb

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            start: int, mask: torch.Tensor | None, feats: dict[int, torch.Tensor],
            emb: torch.Tensor | None = None) -> None:
        """x [n, hidden] through every layer in place; cos, sin [n, head_dim]; the caches k [layers, kv_heads,
        head_dim, >= cap] (keys transposed, ``key_cache_shape``) and v [layers, kv_heads, cap, head_dim] take the
        n new rows at start; mask: additive [n, start + n] or None (causal); feats[i] ([n, hidden],
        preallocated) receives x after layer i; emb [n, hidden]: the embeddings an ``hn`` layer reads."""
        n = x.shape[0]
        if self.reads_emb and (emb is None or emb.shape != x.shape or not emb.is_contiguous()
                               or emb.dtype != torch.float32):
            raise ValueError(f"an EAGLE-3 layer (hn) needs float32 emb of x's shape {tuple(x.shape)}, contiguous")
        hd = self.dims.head_dim
        if any(t.shape != (n, hd) or t.dtype != torch.float32 or not t.is_contiguous() for t in (cos, sin)):
            # the C code reads hd values a row: a narrower (partial rotary) table would be read past its end
            raise ValueError(f"cos and sin must be float32 [{n}, {hd}], contiguous; got {tuple(cos.shape)} and "
                             f"{tuple(sin.shape)}")
        if start + n > v.shape[2]:
            raise ValueError(f"rows {start}..{start + n} do not fit a cache of {v.shape[2]} rows: reserve first")
        if mask is not None and (tuple(mask.shape) != (n, start + n) or not mask.is_contiguous()):
            raise ValueError(f"mask must be a contiguous [{n}, {start + n}] additive mask, got {tuple(mask.shape)}")
        if k.shape[3] % CAP_MULTIPLE or k.shape[3] < v.shape[2]:
            raise ValueError(f"key cache {tuple(k.shape)} / value cache {tuple(v.shape)}: each transposed key row "
                             f"must hold the value cache's rows and a multiple of {CAP_MULTIPLE} floats")
        self.dims.cap, self.dims.kstride, self.dims.threads = v.shape[2], k.shape[3], torch.get_num_threads()
        need = _lib.lean_scratch(ctypes.byref(self.dims), n, start)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(need)
        out = None
        if feats:
            out = (ctypes.c_void_p * len(self.layers))(*[feats[i].data_ptr() if i in feats else None
                                                         for i in range(len(self.layers))])
        _lib.lean_layers(self.layers, len(self.layers), ctypes.byref(self.dims), x.data_ptr(), n, cos.data_ptr(),
                         sin.data_ptr(), k.data_ptr(), v.data_ptr(), start,
                         None if mask is None else mask.data_ptr(), self.scratch.data_ptr(), out,
                         None if emb is None else emb.data_ptr())


def layers_unsupported(hidden: int, heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Why the C decoder layers cannot run a model of these sizes (None = they can)."""
    if not available():
        return f"the skinny kernel is unavailable here: {_why_not}"
    vw = VARIANTS[_variant][0]
    if hidden % vw or head_dim % vw:
        return f"hidden size {hidden} and head size {head_dim} must be multiples of the vector width {vw}"
    if head_dim > 256 or head_dim % 2:
        return f"head size {head_dim} is odd or above 256"
    if heads % kv_heads or heads // kv_heads > 256:
        return f"{heads} attention heads do not split into {kv_heads} key/value groups of at most 256"
    return None
