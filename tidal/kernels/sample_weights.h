/* A logits row's sampling weights w_i = exp((x_i - max) / T) as tidal's sampling kernels
 * (sample.c) compute them: the row's max, the sums of its 64-entry chunks and the masses above
 * top-p's thresholds. exp is one fixed sequence of float operations (Cephes' polynomial, explicit
 * FMAs) and sums run in one fixed order on every path (plain C, AVX2, AVX-512), so every path
 * gives the same bits. */
#ifndef TIDAL_SAMPLE_WEIGHTS_H
#define TIDAL_SAMPLE_WEIGHTS_H

#include <math.h>
#include <stdint.h>

#include "cephes_exp.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif
#if defined(HAVE_AVX2) && defined(__AVX512F__)
#define HAVE_AVX512 1
#endif

#define CHUNK 64
/* top-p's candidate thresholds on w (the last keeps every token) */
#define NTHETA 4
static const float THETA[NTHETA] = {0x1p-8f, 0x1p-14f, 0x1p-22f, 0.0f};

/* exp(a) for a <= 0 (0 below the smallest normal result); Cephes' expf (cephes_exp.h) */
#define WEIGHT_EXP_LO (-87.33654f)

static inline float exp_neg(float a) {
    if (!(a >= WEIGHT_EXP_LO)) return 0.0f;
    float n = nearbyintf(a * EXP_LOG2E);
    float r = fmaf(n, -EXP_LN2_HI, a);
    r = fmaf(n, -EXP_LN2_LO, r);
    float p = EXP_P0;
    p = fmaf(p, r, EXP_P1);
    p = fmaf(p, r, EXP_P2);
    p = fmaf(p, r, EXP_P3);
    p = fmaf(p, r, EXP_P4);
    p = fmaf(p, r, EXP_P5);
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
    __m256 ok = _mm256_cmp_ps(a, _mm256_set1_ps(WEIGHT_EXP_LO), _CMP_GE_OQ);
    return _mm256_and_ps(cephes_exp256(_mm256_max_ps(a, _mm256_set1_ps(WEIGHT_EXP_LO))), ok);
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
    __mmask16 ok = _mm512_cmp_ps_mask(a, _mm512_set1_ps(WEIGHT_EXP_LO), _CMP_GE_OQ);
    return _mm512_maskz_mov_ps(ok, cephes_exp512(_mm512_max_ps(a, _mm512_set1_ps(WEIGHT_EXP_LO))));
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

#endif
