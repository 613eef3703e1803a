/* Sampling's per-row reductions over a logits matrix, without (B, V) temporaries:
 *
 *   tidal_sample_rows    one token per row of softmax(x / T), after top-k, top-p and min-p, by the
 *                        inverse CDF of a uniform u the caller drew; rows are either whole
 *                        (unsorted) logits or a row's top-k candidates, best first.
 *   tidal_lse_rows       log(sum(exp(x))) per row (logprobs: x - lse is log_softmax(x)).
 *   tidal_topk_rows      the k largest values of a row (k <= 256), best first, ties to the lowest id.
 *   tidal_count_greater  how many entries of a row exceed a threshold (a sampled token's rank).
 *
 * Why a kernel: torch's CPU exp runs at ~0.65 G/s here, and each torch step over (B, V) makes a
 * fresh tensor (32 MiB for 32 rows of a 262k vocabulary, mapped and faulted afresh every step):
 * sampling 32 rows at temperature 0.8 took 12.6 ms and top-p alone a stable sort of every row,
 * 433 ms, against a ~30 ms model step.
 *
 * The weights: w_i = exp((x_i - max) / T), so w_i = p_i / p_max (1 at the best token). exp is
 * one fixed sequence of float operations (Cephes' polynomial, explicit FMAs) in every path, and
 * sums run in one fixed order: 64-entry chunks summed as a tree over 16 lanes, chunks in turn.
 * Every path (plain C, AVX2, AVX-512) gives the same bits and tokens, and a row's result depends
 * on that row and its u alone.
 *
 * Drawing over a whole row: pass 1 the max, pass 2 the chunk sums (and, for top-p, the mass
 * above a few thresholds), then a scan of the chunk sums for u * total and one chunk recomputed.
 * Top-p over a whole row: the nucleus is a prefix of the descending order, so it lies inside
 * {w >= theta} for the largest threshold theta whose mass reaches p (with a margin for float
 * sums); only those candidates are gathered (a compare on (x - max) / T picks the tokens worth
 * an exp) and sorted (w descending, id ascending, as a stable descending sort orders them), then
 * cut where the mass before a token reaches p. min-p keeps w >= min_p. Top-p is taken on the
 * distribution before min-p, as the torch sampler does.
 * isa: 0 plain C, 1 AVX2, 2 AVX-512 (each compiled where the build has it). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "sample_weights.h"

int tidal_sample_has_avx2(void) {
#ifdef HAVE_AVX2
    return 1;
#else
    return 0;
#endif
}

int tidal_sample_has_avx512(void) {
#ifdef HAVE_AVX512
    return 1;
#else
    return 0;
#endif
}

#define MAX_TOPK 256
/* the masses above the thresholds are float lane sums: ask them for p plus this margin */
#define MASS_MARGIN 1e-3

typedef struct {
    float w;
    int64_t id;
} cand;

/* Top-p's candidates {i : w_i >= theta} in id order, at most `count` (the chunk pass counted
 * them). For theta > 0 the argument a = (x - max) / T is first compared with log(theta) less a
 * margin, so exp runs only near the candidates: Cephes' exp is within a few ulp of exp, far inside
 * the margin, so the set is the same as exp over every token (tokens kept and their w bit for bit).
 * theta 0 keeps every token (NaN logits too, with w 0); the caller's count is then n, and the
 * vector paths store every weight in order. Their `count >= n` guard is redundant, but without
 * it (or with a mask walk in its place) GCC 12's code for the every-token loop took 12.4 instead
 * of 10.1 ms on 32 rows at temperature 1.5 on a Zen 5: measure before simplifying it. */
#define GATHER_MARGIN 0.01f

static inline int64_t gather_push(cand *c, int64_t k, float w, int64_t i, float theta) {
    if (w >= theta) c[k].w = w, c[k].id = i, k++;
    return k;
}

static int64_t gather_scalar(const float *x, int64_t n, int64_t i, float m, float inv_t,
                             float lo, float theta, cand *c, int64_t k, int64_t count) {
    for (; i < n && k < count; i++) {
        float a = (x[i] - m) * inv_t;
        if (theta > 0.0f && !(a >= lo)) continue;
        k = gather_push(c, k, exp_neg(a), i, theta);
    }
    return k;
}

#ifdef HAVE_AVX2
static int64_t gather_avx2(const float *x, int64_t n, float m, float inv_t, float lo, float theta,
                           cand *c, int64_t count) {
    __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(inv_t), vlo = _mm256_set1_ps(lo);
    int64_t i = 0, k = 0, n8 = n & ~(int64_t)7;
    if (!(theta > 0.0f) && count >= n) { /* every token, in order: no mask to walk */
        for (; i < n8; i += 8) {
            float w[8];
            _mm256_storeu_ps(w, exp_neg8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm), vt)));
            for (int j = 0; j < 8; j++) c[i + j].w = w[j], c[i + j].id = i + j;
        }
        return gather_scalar(x, n, i, m, inv_t, lo, theta, c, i, count);
    }
    for (; i < n8 && k < count; i += 8) {
        __m256 a = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm), vt);
        unsigned bits = theta > 0.0f ? (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, vlo, _CMP_GE_OQ)) : 0xFFu;
        if (!bits) continue;
        float w[8];
        _mm256_storeu_ps(w, exp_neg8(a));
        for (; bits && k < count; bits &= bits - 1) {
            int j = __builtin_ctz(bits);
            k = gather_push(c, k, w[j], i + j, theta);
        }
    }
    return gather_scalar(x, n, i, m, inv_t, lo, theta, c, k, count);
}
#endif

#ifdef HAVE_AVX512
static int64_t gather_avx512(const float *x, int64_t n, float m, float inv_t, float lo,
                             float theta, cand *c, int64_t count) {
    __m512 vm = _mm512_set1_ps(m), vt = _mm512_set1_ps(inv_t), vlo = _mm512_set1_ps(lo);
    int64_t i = 0, k = 0, n16 = n & ~(int64_t)15;
    if (!(theta > 0.0f) && count >= n) { /* every token, in order: no mask to walk */
        for (; i < n16; i += 16) {
            float w[16];
            _mm512_storeu_ps(w, exp_neg16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm), vt)));
            for (int j = 0; j < 16; j++) c[i + j].w = w[j], c[i + j].id = i + j;
        }
        return gather_scalar(x, n, i, m, inv_t, lo, theta, c, i, count);
    }
    for (; i < n16 && k < count; i += 16) {
        __m512 a = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm), vt);
        unsigned bits = theta > 0.0f ? (unsigned)_mm512_cmp_ps_mask(a, vlo, _CMP_GE_OQ) : 0xFFFFu;
        if (!bits) continue;
        float w[16];
        _mm512_storeu_ps(w, exp_neg16(a));
        for (; bits && k < count; bits &= bits - 1) {
            int j = __builtin_ctz(bits);
            k = gather_push(c, k, w[j], i + j, theta);
        }
    }
    return gather_scalar(x, n, i, m, inv_t, lo, theta, c, k, count);
}
#endif

static int64_t gather(const float *x, int64_t n, float m, float inv_t, float theta, cand *c,
                      int64_t count, int64_t isa) {
    float lo = theta > 0.0f ? logf(theta) - GATHER_MARGIN : 0.0f;
#ifdef HAVE_AVX512
    if (isa >= 2) return gather_avx512(x, n, m, inv_t, lo, theta, c, count);
#endif
#ifdef HAVE_AVX2
    if (isa >= 1) return gather_avx2(x, n, m, inv_t, lo, theta, c, count);
#endif
    (void)isa;
    return gather_scalar(x, n, 0, m, inv_t, lo, theta, c, 0, count);
}

static int by_weight(const void *pa, const void *pb) {
    const cand *a = pa, *b = pb;
    if (a->w != b->w) return a->w > b->w ? -1 : 1;
    return (a->id > b->id) - (a->id < b->id);
}

#define RADIX_MIN 256 /* fewer candidates than this: qsort (the radix passes' counts cost more) */

/* c[0..k) in by_weight's order (w descending, then id ascending), by an LSD radix sort of one
 * 64-bit key per candidate: (~bits(w)) << 32 | id ascending is that order, as w >= 0 orders like
 * its bits, and ids are below 2^32 (sample.py passes no wider row). A byte that every key shares
 * is skipped. Returns 0, or -1 when out of memory. */
static int sort_by_weight(cand *c, int64_t k) {
    if (k < RADIX_MIN) {
        qsort(c, (size_t)k, sizeof(cand), by_weight);
        return 0;
    }
    uint64_t *key = malloc(sizeof(uint64_t) * 2 * (size_t)k);
    if (!key) return -1;
    uint64_t *tmp = key + k;
    uint32_t count[8][256];
    memset(count, 0, sizeof count);
    for (int64_t t = 0; t < k; t++) {
        union { float f; uint32_t u; } b = {.f = c[t].w};
        key[t] = (uint64_t)(~b.u) << 32 | (uint32_t)c[t].id;
        for (int d = 0; d < 8; d++) count[d][(key[t] >> (8 * d)) & 255]++;
    }
    for (int d = 0; d < 8; d++) {
        uint32_t *n = count[d];
        if (n[(key[0] >> (8 * d)) & 255] == (uint32_t)k) continue; /* one value: order kept */
        uint32_t at = 0;
        for (int v = 0; v < 256; v++) { uint32_t m = n[v]; n[v] = at; at += m; }
        for (int64_t t = 0; t < k; t++) tmp[n[(key[t] >> (8 * d)) & 255]++] = key[t];
        uint64_t *s = key; key = tmp; tmp = s;
    }
    for (int64_t t = 0; t < k; t++) {
        union { float f; uint32_t u; } b = {.u = ~(uint32_t)(key[t] >> 32)};
        c[t].w = b.f, c[t].id = (int64_t)(uint32_t)key[t];
    }
    free(key < tmp ? key : tmp);
    return 0;
}

/* among c[0..k) (in their order), the one whose cumulative weight first exceeds u * total */
static int64_t draw_sorted(const cand *c, int64_t k, double u) {
    double total = 0.0, run = 0.0;
    for (int64_t t = 0; t < k; t++) total += c[t].w;
    double target = u * total;
    for (int64_t t = 0; t < k; t++) {
        run += c[t].w;
        if (run > target) return t;
    }
    return k - 1;
}

/* how many of c[0..k) (best first) top-p (p < 1: the mass before a token, out of `total`,
 * below p) and then min-p keep; at least one */
static int64_t nucleus(const cand *c, int64_t k, double total, float p, float min_p) {
    int64_t keep = k;
    if (p < 1.0f) {
        double before = 0.0, limit = (double)p * total;
        for (int64_t t = 1; t < k; t++) {
            before += c[t - 1].w;
            if (before >= limit) { keep = t; break; }
        }
    }
    int64_t kept = 1;
    while (kept < keep && c[kept].w >= min_p) kept++;
    return kept;
}

/* nucleus() for many candidates (a flat row) without sorting them all: a histogram of their
 * mass over the top bits of w finds the bucket where the mass reaches p; the buckets above it
 * are kept whole (in id order), only the edge bucket is sorted and cut. c[0..kept) is then the
 * kept set (top-p, then min-p); returns kept, or -1 when out of memory. */
#define SORT_ALL 2048
#define KEY_SHIFT 15
#define NKEYS ((0x3F800000u >> KEY_SHIFT) + 1) /* w in [0, 1] */

static inline uint32_t wkey(float w) {
    union { float f; uint32_t u; } b = {.f = w};
    return b.u >> KEY_SHIFT;
}

static int64_t wide_nucleus(cand *c, int64_t k, double total, float p, float min_p) {
    double *mass = calloc(NKEYS, sizeof(double));
    if (!mass) return -1;
    for (int64_t i = 0; i < k; i++) mass[wkey(c[i].w)] += c[i].w;
    double limit = (double)p * total, above = 0.0;
    int64_t edge = NKEYS - 1;
    for (; edge > 0; edge--) {
        if (above + mass[edge] >= limit) break;
        above += mass[edge];
    }
    free(mass);
    int64_t na = 0, nb;
    for (int64_t i = 0; i < k; i++) /* the buckets above the edge to the front, in order */
        if (wkey(c[i].w) > (uint32_t)edge) { cand t = c[i]; c[i] = c[na]; c[na] = t; na++; }
    nb = na;
    for (int64_t i = na; i < k; i++)
        if (wkey(c[i].w) == (uint32_t)edge) { cand t = c[i]; c[i] = c[nb]; c[nb] = t; nb++; }
    qsort(c + na, (size_t)(nb - na), sizeof(cand), by_weight);
    int64_t keep = na;
    double before = above;
    while (keep < nb && (keep == 0 || before < limit)) before += c[keep++].w;
    int64_t kept = 0;
    for (int64_t i = 0; i < keep; i++)
        if (c[i].w >= min_p) c[kept++] = c[i];
    return kept;
}

/* one whole row: returns the token id, or -1 when out of memory */
static int64_t sample_full(const float *x, int64_t n, float temp, float p, float min_p, double u,
                           int64_t isa) {
    int nan;
    float m = row_max(x, n, isa, &nan);
    if (nan || !isfinite(m)) { /* no usable logit: uniform, as the torch sampler does */
        int64_t i = (int64_t)(u * (double)n);
        return i < n ? i : n - 1;
    }
    float inv_t = 1.0f / temp;
    int64_t nchunks = (n + CHUNK - 1) / CHUNK;
    float *csum = malloc(sizeof(float) * (size_t)nchunks);
    if (!csum) return -1;
    int64_t token;
    if (p < 1.0f) {
        theta_stats ts;
        memset(&ts, 0, sizeof ts);
        row_chunks(x, n, m, inv_t, 0.0f, csum, &ts, isa);
        double total = 0.0;
        for (int64_t c = 0; c < nchunks; c++) total += csum[c];
        int t = 0;
        while (t < NTHETA - 1 && !(ts.mass[t] >= ((double)p + MASS_MARGIN) * total)) t++;
        float theta = THETA[t];
        int64_t count = t < NTHETA - 1 ? ts.count[t] : n;
        cand *c = malloc(sizeof(cand) * (size_t)(count > 0 ? count : 1));
        if (!c) { free(csum); return -1; }
        int64_t k = gather(x, n, m, inv_t, theta, c, count, isa);
        int64_t kept;
        if (k <= SORT_ALL) {
            kept = sort_by_weight(c, k) ? -1 : nucleus(c, k, total, p, min_p);
        } else {
            kept = wide_nucleus(c, k, total, p, min_p);
        }
        token = kept > 0 ? c[draw_sorted(c, kept, u)].id : -1;
        free(c);
    } else {
        row_chunks(x, n, m, inv_t, min_p, csum, NULL, isa);
        double total = 0.0, run = 0.0;
        for (int64_t c = 0; c < nchunks; c++) total += csum[c];
        double target = u * total;
        int64_t chunk = -1;
        for (int64_t c = 0; c < nchunks; c++) {
            if (run + csum[c] > target) { chunk = c; break; }
            run += csum[c];
        }
        if (chunk < 0) { /* rounding left u * total past the end: the last chunk with weight */
            chunk = nchunks - 1;
            while (chunk > 0 && !(csum[chunk] > 0.0f)) chunk--;
            target = INFINITY;
        }
        int64_t end = (chunk + 1) * CHUNK < n ? (chunk + 1) * CHUNK : n;
        token = -2;
        for (int64_t i = chunk * CHUNK; i < end; i++) {
            float w = weight(x[i], m, inv_t, min_p);
            if (w > 0.0f) token = i;
            run += w;
            if (w > 0.0f && run > target) break;
        }
        if (token < 0) token = 0; /* not reached: the chunk picked has weight */
    }
    free(csum);
    return token;
}

/* one row of candidates x[0..k) (best first): the position drawn, or -1 when out of memory */
static int64_t sample_sorted(const float *x, int64_t k, float temp, float p, float min_p,
                             double u) {
    float m = x[0];
    if (!isfinite(m)) {
        int64_t i = (int64_t)(u * (double)k);
        return i < k ? i : k - 1;
    }
    cand *c = malloc(sizeof(cand) * (size_t)k);
    if (!c) return -1;
    float inv_t = 1.0f / temp;
    double total = 0.0;
    for (int64_t t = 0; t < k; t++) {
        c[t].w = x[t] == x[t] ? exp_neg((x[t] - m) * inv_t) : 0.0f;
        c[t].id = t;
        total += c[t].w;
    }
    int64_t kept = nucleus(c, k, total, p, min_p);
    int64_t pos = draw_sorted(c, kept, u);
    free(c);
    return pos;
}

/* out[b] for rows b < B: row r = rows ? rows[b] : b of x (stride ld, n columns). sorted: the rows
 * are candidates best first and limit[b] > 0 keeps only the first limit[b] (top-k); out[b] is
 * then a column. temp[b] > 0, top_p[b] in (0, 1] (1: off), min_p[b] in [0, 1], u[b] in [0, 1).
 * Returns 0, -3 for an ISA not built, -12 when out of memory. */
int tidal_sample_rows(const float *x, int64_t ld, int64_t n, int64_t B, const int64_t *rows,
                      int64_t sorted, const int64_t *limit, const float *temp, const float *top_p,
                      const float *min_p, const double *u, int64_t *out, int64_t isa,
                      int64_t nthreads) {
    if (isa < 0 || isa > 2 || (isa >= 1 && !tidal_sample_has_avx2()) ||
        (isa == 2 && !tidal_sample_has_avx512()))
        return -3;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads > 0 ? (int)nthreads : 1) \
    if (B > 1 && B * n >= 65536) reduction(| : failed)
    for (int64_t b = 0; b < B; b++) {
        const float *row = x + (rows ? rows[b] : b) * ld;
        int64_t got;
        if (sorted) {
            int64_t k = limit && limit[b] > 0 && limit[b] < n ? limit[b] : n;
            got = sample_sorted(row, k, temp[b], top_p[b], min_p[b], u[b]);
        } else {
            got = sample_full(row, n, temp[b], top_p[b], min_p[b], u[b], isa);
        }
        failed |= got < 0;
        out[b] = got < 0 ? 0 : got;
    }
    return failed ? -12 : 0;
}

/* lse[b] = log(sum_i exp(x[b, i])) for rows b < B (max + log of the chunk sums); a row with a NaN
 * or no finite maximum gets that maximum (NaN, +inf or -inf). Returns 0, -3 or -12. */
int tidal_lse_rows(const float *x, int64_t ld, int64_t n, int64_t B, float *lse, int64_t isa,
                   int64_t nthreads) {
    if (isa < 0 || isa > 2 || (isa >= 1 && !tidal_sample_has_avx2()) ||
        (isa == 2 && !tidal_sample_has_avx512()))
        return -3;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads > 0 ? (int)nthreads : 1) \
    if (B > 1 && B * n >= 65536) reduction(| : failed)
    for (int64_t b = 0; b < B; b++) {
        const float *row = x + b * ld;
        int nan;
        float m = row_max(row, n, isa, &nan);
        if (nan || !isfinite(m)) { lse[b] = nan ? NAN : m; continue; }
        int64_t nchunks = (n + CHUNK - 1) / CHUNK;
        float *csum = malloc(sizeof(float) * (size_t)nchunks);
        if (!csum) { failed = 1; continue; }
        row_chunks(row, n, m, 1.0f, 0.0f, csum, NULL, isa);
        double total = 0.0;
        for (int64_t c = 0; c < nchunks; c++) total += csum[c];
        lse[b] = m + (float)log(total);
        free(csum);
    }
    return failed ? -12 : 0;
}

/* insert (v, i) into vals/ids[0..k) (descending) when v beats the last; ties keep the earlier id */
static inline void topk_insert(float *vals, int64_t *ids, int64_t k, float v, int64_t i) {
    if (!(v > vals[k - 1])) return;
    int64_t j = k - 1;
    while (j > 0 && v > vals[j - 1]) {
        vals[j] = vals[j - 1];
        ids[j] = ids[j - 1];
        j--;
    }
    vals[j] = v;
    ids[j] = i;
}

static void topk_row(const float *x, int64_t n, int64_t k, float *vals, int64_t *ids,
                     int64_t isa) {
    for (int64_t j = 0; j < k; j++) vals[j] = -INFINITY, ids[j] = -1;
    int64_t i = 0;
#ifdef HAVE_AVX2
    if (isa >= 1)
        for (; i + 8 <= n; i += 8) {
            int hit = _mm256_movemask_ps(
                _mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(vals[k - 1]), _CMP_GT_OQ));
            while (hit) {
                int l = __builtin_ctz((unsigned)hit);
                hit &= hit - 1;
                topk_insert(vals, ids, k, x[i + l], i + l);
            }
        }
#endif
    (void)isa;
    for (; i < n; i++) topk_insert(vals, ids, k, x[i], i);
    /* rows with fewer than k entries above -inf: the lowest ids not taken (-inf or NaN) */
    int64_t filled = 0;
    while (filled < k && ids[filled] >= 0) filled++;
    for (int64_t c = 0; c < n && filled < k; c++) {
        if (x[c] > -INFINITY) continue;
        int taken = 0;
        for (int64_t j = 0; j < filled; j++) taken |= ids[j] == c;
        if (!taken) vals[filled] = x[c], ids[filled] = c, filled++;
    }
}

/* vals/ids (B, k), the k <= 256 largest of each row, best first (ties: the lower id first).
 * Returns 0, -3, or -22 for k out of range. */
int tidal_topk_rows(const float *x, int64_t ld, int64_t n, int64_t B, const int64_t *rows,
                    int64_t k, float *vals, int64_t *ids, int64_t isa, int64_t nthreads) {
    if (isa < 0 || isa > 2 || (isa >= 1 && !tidal_sample_has_avx2()) ||
        (isa == 2 && !tidal_sample_has_avx512()))
        return -3;
    if (k < 1 || k > MAX_TOPK || k > n) return -22;
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? (int)nthreads : 1) \
    if (B > 1 && B * n >= 65536)
    for (int64_t b = 0; b < B; b++)
        topk_row(x + (rows ? rows[b] : b) * ld, n, k, vals + b * k, ids + b * k, isa);
    return 0;
}

/* out[b] = how many x[b, i] > thr[b] (NaN never counts). Returns 0 or -3. */
int tidal_count_greater(const float *x, int64_t ld, int64_t n, int64_t B, const float *thr,
                        int64_t *out, int64_t isa, int64_t nthreads) {
    if (isa < 0 || isa > 2 || (isa >= 1 && !tidal_sample_has_avx2()) ||
        (isa == 2 && !tidal_sample_has_avx512()))
        return -3;
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? (int)nthreads : 1) \
    if (B > 1 && B * n >= 65536)
    for (int64_t b = 0; b < B; b++) {
        const float *row = x + b * ld;
        int64_t count = 0, i = 0;
#ifdef HAVE_AVX2
        if (isa >= 1) {
            __m256 t = _mm256_set1_ps(thr[b]);
            for (; i + 8 <= n; i += 8)
                count += __builtin_popcount(
                    _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), t, _CMP_GT_OQ)));
        }
#endif
        for (; i < n; i++) count += row[i] > thr[b];
        out[b] = count;
    }
    return 0;
}

