"""DSpark's Markov-corrected tree (``tree.ddtree.conditional_ddtree`` over ``DSparkDrafter``'s vanilla expander)
walked in C, one call a round.

Why: each node the Python walk expands runs about ten small tensor ops (its W1 row, a [1, r] x [r, C] product, two
log-sum-exps, a top-k, a calibrated confidence, the lists back), about 1.1 of DSpark's 1.5 ms a round over DFlash's
on a 2-core CPU at 16 nodes. Here a node's children are 64 x 64 multiply-adds and a top-k over 64 values in C.
The inputs are the round's per-depth candidate terms the Python walk reads (``candidate_split``: each depth's C
likeliest backbone columns, their W2 rows and the log-mass outside them), so the tree is the one it builds: the
same heap order, the same rules for -inf scores, the same acceptance estimates; a node's log-probs agree to float32
rounding, which can only swap near-tied siblings, and any tree is lossless (``tests/test_dspark.py`` checks both
walks build the same trees). Built on first use with the system compiler; without one ``available()`` is False
and the drafter walks in Python.
"""
from __future__ import annotations

import ctypes

import torch

from graft_block import skinny
from graft_block.tree import Tree
from graft_block.tree.tree import SOURCE_DRAFT, make_tree

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <float.h>

typedef struct { double neg; long seq, parent, depth, rank; } item_t;

static int first(const item_t *a, const item_t *b) { return a->neg < b->neg || (a->neg == b->neg && a->seq < b->seq); }

static void push(item_t *h, long *n, item_t x) {
    long i = (*n)++;
    while (i > 0) { long p = (i - 1) / 2; if (!first(&x, &h[p])) break; h[i] = h[p]; i = p; }
    h[i] = x;
}

static item_t pop(item_t *h, long *n) {
    item_t top = h[0], x = h[--(*n)];
    long i = 0;
    for (;;) {
        long c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && first(&h[c + 1], &h[c])) c++;
        if (!first(&h[c], &x)) break;
        h[i] = h[c]; i = c;
    }
    if (*n > 0) h[i] = x;
    return top;
}

static int proposable(double s) { return s >= -(double)FLT_MAX; }  /* False for -inf and NaN */

typedef struct {
    long C, r, k, rows;
    const float *cand_z, *rest, *cand_w2, *w1, *temps;  /* [D, C], [D], [D, C, r], [V, r], [D] */
    const int64_t *cand_ids;                             /* [D, C] token ids */
    float temperature;
    long plain_n; const int64_t *plain_ids; const float *plain_lps;  /* depth 1 from the backbone row (plain_n > 0) */
    const float *conf_h, *conf_e, *conf_temps;           /* [D], [r] or NULL, [D]; conf_h NULL: no head */
} walk_t;

/* The children of a node with token tok at depth d (1-based): their ids and log-probs, sorted, and the calibrated
   estimate that its top child is accepted. Returns how many. */
static long children(const walk_t *w, long d, int64_t tok, int64_t *ids, double *lps, double *conf, float *z) {
    long C = w->C, r = w->r, row = d - 1, n;
    if (row >= w->rows) return 0;  /* below the block: no children (the wrapper keeps max_depth <= rows) */
    const float *lat = w->w1 + tok * r;
    if (w->conf_h) {
        float c = w->conf_h[row];
        if (w->conf_e) { float dot = 0.f; for (long i = 0; i < r; i++) dot += lat[i] * w->conf_e[i]; c += dot; }
        *conf = (double)(1.f / (1.f + expf(-c / w->conf_temps[row])));
    }
    if (d == 1 && w->plain_n > 0) {
        for (n = 0; n < w->plain_n; n++) { ids[n] = w->plain_ids[n]; lps[n] = (double)w->plain_lps[n]; }
        return n;
    }
    const float *cz = w->cand_z + row * C, *w2 = w->cand_w2 + row * C * r;
    float hi = -INFINITY;
    for (long j = 0; j < C; j++) {
        float b = 0.f;
        for (long i = 0; i < r; i++) b += lat[i] * w2[j * r + i];
        z[j] = cz[j] + (w->temperature > 0.f ? b / w->temperature : b);
        if (z[j] > hi) hi = z[j];
    }
    float s = 0.f;
    for (long j = 0; j < C; j++) s += expf(z[j] - hi);
    float inside = hi + logf(s), rest = w->rest[row];
    float top = inside > rest ? inside : rest;
    float total = top + logf(expf(inside - top) + expf(rest - top));
    float t = w->temps[row], shift = inside - total;
    if (t != 1.f) {  /* log_softmax(z / t) + (inside - total) */
        float m = hi / t, u = 0.f;
        for (long j = 0; j < C; j++) u += expf(z[j] / t - m);
        float lse = m + logf(u);
        for (long j = 0; j < C; j++) z[j] = (z[j] / t - lse) + shift;
    } else {
        for (long j = 0; j < C; j++) z[j] = z[j] - total;
    }
    n = w->k < C ? w->k : C;
    for (long q = 0; q < n; q++) {  /* top-n by selection, the lower column first among equals */
        long best = -1;
        for (long j = 0; j < C; j++)
            if (z[j] == z[j] && (best < 0 || z[j] > z[best])) best = j;  /* NaN: taken */
        if (best < 0 || z[best] == -INFINITY) return q;  /* never proposed: the Python walk skips these too */
        ids[q] = w->cand_ids[row * C + best]; lps[q] = (double)z[best];
        z[best] = NAN;
    }
    return n;
}

/* conditional_ddtree with this expander; writes up to budget + 1 nodes, returns how many (-1: out of memory). */
long markov_walk(const walk_t *w, int64_t root, long budget, long max_depth, int64_t *tokens, int64_t *parents,
                 double *scores, double *accept) {
    tokens[0] = root; parents[0] = -1; scores[0] = 0.0; accept[0] = 1.0;
    if (budget < 1 || max_depth < 1) return 1;
    long k = w->k > w->plain_n ? w->k : w->plain_n, cap = budget + 1, n = 1, heap_n = 0, seq = 1;
    int64_t *kid_ids = malloc(sizeof(int64_t) * cap * k);
    long *kid_n = malloc(sizeof(long) * cap);
    double *kid_lps = malloc(sizeof(double) * cap * k), *kid_conf = malloc(sizeof(double) * cap);
    double *rest = malloc(sizeof(double) * cap);
    item_t *heap = malloc(sizeof(item_t) * (2 * cap + 2));
    float *z = malloc(sizeof(float) * w->C);
    if (!kid_ids || !kid_n || !kid_lps || !kid_conf || !rest || !heap || !z) {
        free(kid_ids); free(kid_n); free(kid_lps); free(kid_conf); free(rest); free(heap); free(z);
        return -1;
    }
    for (long i = 0; i < cap; i++) rest[i] = -1.0;
    kid_n[0] = children(w, 1, root, kid_ids, kid_lps, kid_conf, z);
    if (kid_n[0] > 0 && proposable(kid_lps[0])) push(heap, &heap_n, (item_t){-kid_lps[0], 0, 0, 1, 0});
    while (heap_n > 0 && n - 1 < budget) {
        item_t it = pop(heap, &heap_n);
        long p = it.parent, node = n++;
        const int64_t *ids = kid_ids + p * k;
        const double *lps = kid_lps + p * k;
        tokens[node] = ids[it.rank]; parents[node] = p; scores[node] = -it.neg;
        if (w->conf_h) {
            double c = kid_conf[p];
            if (it.rank == 0) accept[node] = c;
            else {
                if (rest[p] < 0.0) {  /* 1 - q(top), floored by the siblings' mass when q(top) rounds to 1 */
                    double m = -expm1(lps[0]), sib = 0.0;
                    for (long j = 1; j < kid_n[p]; j++) sib += exp(lps[j]);
                    rest[p] = m > sib ? m : sib;
                    if (rest[p] < 1e-12) rest[p] = 1e-12;
                }
                accept[node] = (1.0 - c) * exp(lps[it.rank]) / rest[p];
            }
        }
        if (it.rank + 1 < kid_n[p] && proposable(scores[p] + lps[it.rank + 1]))
            push(heap, &heap_n, (item_t){-(scores[p] + lps[it.rank + 1]), seq++, p, it.depth, it.rank + 1});
        if (it.depth < max_depth && n - 1 < budget) {
            kid_n[node] = children(w, it.depth + 1, tokens[node], kid_ids + node * k, kid_lps + node * k,
                                   kid_conf + node, z);
            if (kid_n[node] > 0 && proposable(scores[node] + kid_lps[node * k]))
                push(heap, &heap_n, (item_t){-(scores[node] + kid_lps[node * k]), seq++, node, it.depth + 1, 0});
        } else {
            kid_n[node] = 0;
        }
    }
    free(kid_ids); free(kid_n); free(kid_lps); free(kid_conf); free(rest); free(heap); free(z);
    return n;
}
"""


class _Walk(ctypes.Structure):  # walk_t
    _fields_ = [(k, ctypes.c_long) for k in ("C", "r", "k", "rows")] + \
        [(k, ctypes.c_void_p) for k in ("cand_z", "rest", "cand_w2", "w1", "temps", "cand_ids")] + \
        [("temperature", ctypes.c_float), ("plain_n", ctypes.c_long)] + \
        [(k, ctypes.c_void_p) for k in ("plain_ids", "plain_lps", "conf_h", "conf_e", "conf_temps")]


_lib: ctypes.CDLL | None = None
_why_not: str | None = None


def available() -> bool:
    """Whether the C walk is built and loaded here (once per process; ``why_not()`` says what failed)."""
    global _lib, _why_not
    if _lib is None and _why_not is None:
        try:
            _lib = ctypes.CDLL(str(skinny.compile_library(SOURCE, ["-O2"], "markov-walk", libs=("-lm",))))
            _lib.markov_walk.argtypes = [ctypes.POINTER(_Walk), ctypes.c_int64, ctypes.c_long, ctypes.c_long] + \
                [ctypes.c_void_p] * 4
            _lib.markov_walk.restype = ctypes.c_long
        except (OSError, RuntimeError) as e:
            _why_not = str(e)
    return _lib is not None


def why_not() -> str | None:
    available()
    return _why_not


def markov_tree(root_token: int, budget: int, max_depth: int, k: int, cand_z: torch.Tensor, cand_ids: torch.Tensor,
                rest: torch.Tensor, cand_w2: torch.Tensor, w1: torch.Tensor, temperature: float,
                temps: torch.Tensor, plain: tuple[torch.Tensor, torch.Tensor] | None = None,
                confidence: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None,
                ) -> tuple[Tree, list[float] | None]:
    """The tree ``conditional_ddtree`` builds over DSpark's vanilla expander with C candidates per depth (names as
    in ``DSparkDrafter._expander``): ``cand_z`` [D, C] candidate logits at the sampling temperature, ``cand_ids``
    [D, C] their token ids, ``rest`` [D, 1] the log-mass outside them, ``cand_w2`` [D, C, r] their W2 rows, ``w1``
    [V, r], ``temps`` [D] the ranking temperatures, ``k`` children per node; ``plain``: depth 1's (ids, log-probs)
    from the backbone row when the first draft is unbiased; ``confidence``: (h part [D], W1 weight [r] or None,
    calibration temperatures [D]). Returns the tree and, with ``confidence``, each node's acceptance estimate."""
    if not available():
        raise RuntimeError(f"the C Markov walk is unavailable here: {_why_not}")
    if budget < 1 or max_depth < 1:  # the root alone, and no estimates (as conditional_ddtree)
        return make_tree([int(root_token)], [-1], [0.0], SOURCE_DRAFT), None
    D, C = cand_z.shape
    r = cand_w2.shape[-1]
    firsts = [int(root_token)] + ([] if plain is None else plain[0].reshape(-1).tolist())
    checks = [(max_depth <= D, f"max_depth {max_depth} > the {D} rows of candidates"),
              (tuple(cand_ids.shape) == (D, C) and tuple(cand_w2.shape) == (D, C, r) and rest.numel() == D,
               f"cand_ids {tuple(cand_ids.shape)}, cand_w2 {tuple(cand_w2.shape)} and rest ({rest.numel()}) must be "
               f"[{D}, {C}], [{D}, {C}, r] and [{D}]"),
              (w1.dim() == 2 and w1.shape[1] == r, f"w1 {tuple(w1.shape)} must be [V, {r}]"),
              (temps.numel() >= D and (confidence is None or (confidence[0].numel() >= D and
                                                              confidence[2].numel() >= D)),
               f"temperatures for each of the {D} depths"),
              (confidence is None or confidence[1] is None or confidence[1].numel() == r,
               f"the confidence head's W1 weight must have {r} values"),
              (0 <= min(firsts) and max(firsts) < w1.shape[0] and 0 <= int(cand_ids.min())
               and int(cand_ids.max()) < w1.shape[0], f"token ids outside W1's {w1.shape[0]} rows")]
    for ok, what in checks:  # the C walk reads these in place: a wrong shape would read outside them
        if not ok:
            raise ValueError(f"markov_tree: {what}")
    keep = []  # the contiguous float32 / int64 copies the walk reads, alive until it returns

    def ptr(t: torch.Tensor | None, dtype: torch.dtype):
        if t is None:
            return None
        t = t.detach().to(device="cpu", dtype=dtype).contiguous()
        keep.append(t)
        return t.data_ptr()

    w = _Walk(C=C, r=r, k=k, rows=D, cand_z=ptr(cand_z, torch.float32),
              rest=ptr(rest.reshape(D), torch.float32), cand_w2=ptr(cand_w2, torch.float32),
              w1=ptr(w1, torch.float32), temps=ptr(temps[:D], torch.float32), cand_ids=ptr(cand_ids, torch.long),
              temperature=float(temperature), plain_n=0 if plain is None else plain[0].numel())
    if plain is not None:
        w.plain_ids, w.plain_lps = ptr(plain[0].reshape(-1), torch.long), ptr(plain[1].reshape(-1), torch.float32)
    if confidence is not None:
        conf_h, conf_e, conf_t = confidence
        w.conf_h, w.conf_e = ptr(conf_h.reshape(-1)[:D], torch.float32), ptr(conf_e, torch.float32)
        w.conf_temps = ptr(conf_t.reshape(-1)[:D], torch.float32)
    cap = budget + 1
    tokens, parents = torch.empty(cap, dtype=torch.long), torch.empty(cap, dtype=torch.long)
    scores, accept = torch.empty(cap, dtype=torch.float64), torch.empty(cap, dtype=torch.float64)
    n = _lib.markov_walk(ctypes.byref(w), int(root_token), int(budget), int(max_depth), tokens.data_ptr(),
                         parents.data_ptr(), scores.data_ptr(), accept.data_ptr())
    if n < 1:
        raise MemoryError(f"the C Markov walk could not allocate its buffers for a {budget}-node tree")
    tree = make_tree(tokens[:n], parents[:n], scores[:n], SOURCE_DRAFT)
    return tree, (accept[:n].tolist() if confidence is not None else None)
