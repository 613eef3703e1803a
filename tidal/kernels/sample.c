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
 * sums); only those candidates are gathered and sorted (w descending, id ascending, as a stable
 * descending sort orders them), then cut where the mass before a token reaches p. min-p keeps
 * w >= min_p. Top-p is taken on the distribution before min-p, as the torch sampler does.
 * isa: 0 plain C, 1 AVX2, 2 AVX-512 (each compiled where the build has it). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif
#if defined(HAVE_AVX2) && defined(__AVX512F__)
#define HAVE_AVX512 1
#endif

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

#define CHUNK 64
#define MAX_TOPK 256
/* top-p's candidate thresholds on w (the last keeps every token) */
#define NTHETA 4
static const float THETA[NTHETA] = {0x1p-8f, 0x1p-14f, 0x1p-22f, 0.0f};
/* the masses above the thresholds are float lane sums: ask them for p plus this margin */
#define MASS_MARGIN 1e-3

/* exp(a) for a <= 0 (0 below the smallest normal result); Cephes' expf */
#define EXP_LO (-87.33654f)
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO (-2.12194440e-4f)
#define P0 1.9875691500e-4f
#define P1 1.3981999507e-3f
#define P2 8.3334519073e-3f
#define P3 4.1665795894e-2f
#define P4 1.6666665459e-1f
#define P5 5.0000001201e-1f

static inline float exp_neg(float a) {
    if (!(a >= EXP_LO)) return 0.0f;
    float n = nearbyintf(a * LOG2E);
    float r = fmaf(n, -LN2_HI, a);
    r = fmaf(n, -LN2_LO, r);
    float p = P0;
    p = fmaf(p, r, P1);
    p = fmaf(p, r, P2);
    p = fmaf(p, r, P3);
    p = fmaf(p, r, P4);
    p = fmaf(p, r, P5);
    float y = fmaf(p, r * r, r) + 1.0f;
    union { int32_t i; float f; } s = {.i = ((int32_t)n + 127) << 23};
    return y * s.f;
}

static inline float weight(float x, float m, float inv_t, float min_p) {
    float w = exp_neg((x - m) * inv_t);
    return w >= min_p ? w : 0.0f;
}

/* the sum of 64 weights v[0..64) as every path adds them: lanes l of the four 16-wide vectors
 * ((v0 + v1) + (v2 + v3)), then lane l + lane l+8, l + l+4, l + l+2, l + l+1 */
static float tree64(const float *v) {
    float s[16];
    for (int l = 0; l < 16; l++) s[l] = (v[l] + v[16 + l]) + (v[32 + l] + v[48 + l]);
    for (int h = 8; h >= 1; h >>= 1)
        for (int l = 0; l < h; l++) s[l] = s[l] + s[l + h];
    return s[0];
}

typedef struct {
    double mass[NTHETA];
    int64_t count[NTHETA];
} theta_stats;

/* the chunk sums of row x[0..n) for chunks [c0, nchunks), in plain C (also every path's tail) */
static void chunks_scalar(const float *x, int64_t n, int64_t c0, float m, float inv_t,
                          float min_p, float *csum, theta_stats *ts) {
    int64_t nchunks = (n + CHUNK - 1) / CHUNK;
    for (int64_t c = c0; c < nchunks; c++) {
        float v[CHUNK];
        for (int j = 0; j < CHUNK; j++) {
            int64_t i = c * CHUNK + j;
            v[j] = i < n ? weight(x[i], m, inv_t, min_p) : 0.0f;
            if (ts && i < n)
                for (int t = 0; t < NTHETA; t++)
                    if (v[j] >= THETA[t]) ts->mass[t] += v[j], ts->count[t]++;
        }
        csum[c] = tree64(v);
    }
}

static float max_scalar(const float *x, int64_t n, int *nan) {
    float m = x[0];
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        m = x[i] > m ? x[i] : m;
        bad |= x[i] != x[i];
    }
    *nan = bad;
    return m;
}

#ifdef HAVE_AVX2
static inline __m256 exp_neg8(__m256 a) {
    __m256 ok = _mm256_cmp_ps(a, _mm256_set1_ps(EXP_LO), _CMP_GE_OQ);
    a = _mm256_max_ps(a, _mm256_set1_ps(EXP_LO));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), a);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
    __m256 p = _mm256_set1_ps(P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P5));
    __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), ok);
}

static inline __m256 weight8(const float *x, __m256 m, __m256 inv_t, __m256 min_p) {
    __m256 w = exp_neg8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x), m), inv_t));
    return _mm256_and_ps(w, _mm256_cmp_ps(w, min_p, _CMP_GE_OQ));
}

static float max_avx2(const float *x, int64_t n, int *nan) {
    int64_t n8 = n & ~(int64_t)7;
    if (n8 == 0) return max_scalar(x, n, nan);
    __m256 m = _mm256_loadu_ps(x), bad = _mm256_setzero_ps();
    for (int64_t i = 0; i < n8; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        m = _mm256_max_ps(m, v);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8], best;
    _mm256_storeu_ps(lanes, m);
    best = lanes[0];
    for (int l = 1; l < 8; l++) best = lanes[l] > best ? lanes[l] : best;
    int tail_nan = 0;
    if (n8 < n) {
        float t = max_scalar(x + n8, n - n8, &tail_nan);
        best = t > best ? t : best;
    }
    *nan = tail_nan | _mm256_movemask_ps(bad);
    return best;
}

static void chunks_avx2(const float *x, int64_t n, float m, float inv_t, float min_p, float *csum,
                        theta_stats *ts) {
    int64_t full = n / CHUNK;
    __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(inv_t), vp = _mm256_set1_ps(min_p);
    __m256 mass[NTHETA];
    for (int t = 0; t < NTHETA; t++) mass[t] = _mm256_setzero_ps();
    for (int64_t c = 0; c < full; c++) {
        const float *p = x + c * CHUNK;
        __m256 lo[4], hi[4];
        for (int j = 0; j < 4; j++) {
            lo[j] = weight8(p + 16 * j, vm, vt, vp);
            hi[j] = weight8(p + 16 * j + 8, vm, vt, vp);
            if (ts)
                for (int t = 0; t < NTHETA; t++) {
                    __m256 th = _mm256_set1_ps(THETA[t]);
                    __m256 a = _mm256_cmp_ps(lo[j], th, _CMP_GE_OQ), b = _mm256_cmp_ps(hi[j], th, _CMP_GE_OQ);
                    mass[t] = _mm256_add_ps(mass[t], _mm256_add_ps(_mm256_and_ps(lo[j], a), _mm256_and_ps(hi[j], b)));
                    ts->count[t] += __builtin_popcount(_mm256_movemask_ps(a)) + __builtin_popcount(_mm256_movemask_ps(b));
                }
        }
        __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(lo[0], lo[1]), _mm256_add_ps(lo[2], lo[3])),
                                 _mm256_add_ps(_mm256_add_ps(hi[0], hi[1]), _mm256_add_ps(hi[2], hi[3])));
        __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        q = _mm_add_ps(q, _mm_movehl_ps(q, q));
        q = _mm_add_ss(q, _mm_movehdup_ps(q));
        csum[c] = _mm_cvtss_f32(q);
    }
    if (ts)
        for (int t = 0; t < NTHETA; t++) {
            float lanes[8];
            _mm256_storeu_ps(lanes, mass[t]);
            for (int l = 0; l < 8; l++) ts->mass[t] += lanes[l];
        }
    chunks_scalar(x, n, full, m, inv_t, min_p, csum, ts);
}
#endif

#ifdef HAVE_AVX512
static inline __m512 exp_neg16(__m512 a) {
    __mmask16 ok = _mm512_cmp_ps_mask(a, _mm512_set1_ps(EXP_LO), _CMP_GE_OQ);
    a = _mm512_max_ps(a, _mm512_set1_ps(EXP_LO));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(a, _mm512_set1_ps(LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), a);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
    __m512 p = _mm512_set1_ps(P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P5));
    __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(ok, y, _mm512_castsi512_ps(e));
}

static void chunks_avx512(const float *x, int64_t n, float m, float inv_t, float min_p,
                          float *csum, theta_stats *ts) {
    int64_t full = n / CHUNK;
    __m512 vm = _mm512_set1_ps(m), vt = _mm512_set1_ps(inv_t), vp = _mm512_set1_ps(min_p);
    __m512 mass[NTHETA];
    for (int t = 0; t < NTHETA; t++) mass[t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < full; c++) {
        const float *p = x + c * CHUNK;
        __m512 v[4];
        for (int j = 0; j < 4; j++) {
            __m512 w = exp_neg16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(p + 16 * j), vm), vt));
            v[j] = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(w, vp, _CMP_GE_OQ), w);
            if (ts)
                for (int t = 0; t < NTHETA; t++) {
                    __mmask16 k = _mm512_cmp_ps_mask(v[j], _mm512_set1_ps(THETA[t]), _CMP_GE_OQ);
                    mass[t] = _mm512_mask_add_ps(mass[t], k, mass[t], v[j]);
                    ts->count[t] += __builtin_popcount(k);
                }
        }
        __m512 s = _mm512_add_ps(_mm512_add_ps(v[0], v[1]), _mm512_add_ps(v[2], v[3]));
        __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
        __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        q = _mm_add_ps(q, _mm_movehl_ps(q, q));
        q = _mm_add_ss(q, _mm_movehdup_ps(q));
        csum[c] = _mm_cvtss_f32(q);
    }
    if (ts)
        for (int t = 0; t < NTHETA; t++) ts->mass[t] += _mm512_reduce_add_ps(mass[t]);
    chunks_scalar(x, n, full, m, inv_t, min_p, csum, ts);
}
#endif

static float row_max(const float *x, int64_t n, int64_t isa, int *nan) {
#ifdef HAVE_AVX2
    if (isa >= 1) return max_avx2(x, n, nan);
#endif
    (void)isa;
    return max_scalar(x, n, nan);
}

static void row_chunks(const float *x, int64_t n, float m, float inv_t, float min_p, float *csum,
                       theta_stats *ts, int64_t isa) {
#ifdef HAVE_AVX512
    if (isa >= 2) { chunks_avx512(x, n, m, inv_t, min_p, csum, ts); return; }
#endif
#ifdef HAVE_AVX2
    if (isa >= 1) { chunks_avx2(x, n, m, inv_t, min_p, csum, ts); return; }
#endif
    (void)isa;
    chunks_scalar(x, n, 0, m, inv_t, min_p, csum, ts);
}

typedef struct {
    float w;
    int64_t id;
} cand;

static int by_weight(const void *pa, const void *pb) {
    const cand *a = pa, *b = pb;
    if (a->w != b->w) return a->w > b->w ? -1 : 1;
    return (a->id > b->id) - (a->id < b->id);
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
        int64_t k = 0;
        for (int64_t i = 0; i < n && k < count; i++) {
            float w = weight(x[i], m, inv_t, 0.0f);
            if (w >= theta) c[k].w = w, c[k].id = i, k++;
        }
        int64_t kept;
        if (k <= SORT_ALL) {
            qsort(c, (size_t)k, sizeof(cand), by_weight);
            kept = nucleus(c, k, total, p, min_p);
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
