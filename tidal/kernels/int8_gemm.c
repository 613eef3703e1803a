/* Weight-only quantized matrix multiply for CPU decode steps, int8 and int4 codes in groups.
 *
 *   int8:  w[n, k] = codes[n, k] * scales[n, k / G]                 (codes int8, symmetric)
 *   int4:  w[n, k] = q[n, k] * scales[n, k / 32] + mins[n, k / 32]  (q in 0..15, two per byte:
 *          byte j of a group's 16 holds element j in its low nibble and element j + 16 in its high)
 *   fp8:   w[n, k] = e4m3(codes[n, k]) * scales[n]                  (float8_e4m3fn bytes)
 *   y[m, n] = sum_k x[m, k] * w[n, k] + bias[n]
 *
 * x is float32 (M, K) with row stride ldx, y float32 (M, N) contiguous, scales/mins float32,
 * bias float32 (N,) or NULL. Decode steps have few rows, so the cost is reading the weights once:
 * a weight row is converted to float in registers and reused by up to 4 rows of x while it sits
 * in L1 (one weight row at a time: interleaving several rows' streams was measured slower on the
 * DRAM-bound LM head). Every (m, n) result is computed by the same sequence of float operations whatever M is
 * and wherever row m falls in a tile, so a sequence's result does not depend on its batch.
 *
 * Built at first use by tidal/kernels/build.py (-O3 -march=native -fopenmp); without AVX2+FMA the
 * scalar code below computes the same sums. */
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TIDAL_AVX2 1
#endif

#define MT 4  /* rows of x per tile */
#define Q4_GROUP 32

#ifdef TIDAL_AVX2
static inline float hsum256(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline __m256 i8x8_to_ps(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline __m256 u8x8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

/* 8 e4m3 bytes -> float / 256: moving exponent and mantissa 7 bits up makes an fp16 whose
 * exponent bias is 8 too small (15 vs 7), which F16C converts exactly, subnormals included. */
static inline __m256 e4m3x8_to_ps_div256(const uint8_t *p) {
    __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    __m128i mag = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7);
    __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
    return _mm256_cvtph_ps(_mm_or_si128(mag, sign));
}
#endif

/* e4m3fn byte -> float (scalar path) */
static inline float e4m3_to_float(uint8_t b) {
    int e = (b >> 3) & 0xF, m = b & 7;
    float v = e ? (1.0f + m / 8.0f) * (float)(1 << e) / 128.0f : m / 8.0f / 64.0f;
    return (b & 0x80) ? -v : v;
}

/* ---- int8, group size G (a multiple of 8 dividing K; G == K is one scale per row) ---- */

/* rows m0..m0+mt-1 of x against weight row n; out[i] = y[m0 + i, n] before bias */
static inline __attribute__((always_inline)) void int8_row(const float *x, int64_t ldx, int mt, const int8_t *w, const float *s,
                     int64_t K, int64_t G, float *out) {
#ifdef TIDAL_AVX2
    __m256 acc[MT], g[MT];
    for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += G) {
        for (int i = 0; i < mt; i++) g[i] = _mm256_setzero_ps();
        for (int64_t k = k0; k < k0 + G; k += 8) {
            __m256 wv = i8x8_to_ps(w + k);
            for (int i = 0; i < mt; i++)
                g[i] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i * ldx + k), g[i]);
        }
        __m256 sv = _mm256_set1_ps(s[k0 / G]);
        for (int i = 0; i < mt; i++) acc[i] = _mm256_fmadd_ps(g[i], sv, acc[i]);
    }
    for (int i = 0; i < mt; i++) out[i] = hsum256(acc[i]);
#else
    for (int i = 0; i < mt; i++) {
        float lanes[8] = {0};
        for (int64_t k0 = 0; k0 < K; k0 += G) {
            float g[8] = {0};
            for (int64_t k = k0; k < k0 + G; k++) g[k % 8] += (float)w[k] * x[i * ldx + k];
            for (int l = 0; l < 8; l++) lanes[l] += g[l] * s[k0 / G];
        }
        out[i] = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    }
#endif
}

void tidal_int8_gemm_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *codes,
                         const float *scales, int64_t G, const float *bias, float *y, int64_t N,
                         int nthreads) {
    int64_t ng = K / G;
    int64_t nb = (N + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t blk = 0; blk < nb; blk++) {
        int64_t n0 = blk * 4, nr = N - n0 < 4 ? N - n0 : 4;
        float out[MT];
        for (int64_t m = 0; m < M; m += MT) {
            int mt = (int)(M - m < MT ? M - m : MT);
            const float *xm = x + m * ldx;
            for (int64_t n = n0; n < n0 + nr; n++) {
                const int8_t *wn = codes + n * K;
                const float *sn = scales + n * ng;
                if (G == 32 && mt == 4) int8_row(xm, ldx, 4, wn, sn, K, 32, out);
                else switch (mt) {  /* constant heights: the per-row loops unroll into registers */
                case 4: int8_row(xm, ldx, 4, wn, sn, K, G, out); break;
                case 3: int8_row(xm, ldx, 3, wn, sn, K, G, out); break;
                case 2: int8_row(xm, ldx, 2, wn, sn, K, G, out); break;
                default: int8_row(xm, ldx, 1, wn, sn, K, G, out); break;
                }
                for (int i = 0; i < mt; i++) y[(m + i) * N + n] = out[i] + (bias ? bias[n] : 0.0f);
            }
        }
    }
}

/* ---- int4, groups of 32 with a scale and a min each ---- */



static inline __attribute__((always_inline)) void int4_row(const float *x, int64_t ldx, int mt, const float *xsum, int64_t ng,
                     const uint8_t *q, const float *s, const float *mn, float *out) {
#ifdef TIDAL_AVX2
    __m256 acc[MT];
    float off[MT];
    for (int i = 0; i < mt; i++) { acc[i] = _mm256_setzero_ps(); off[i] = 0.0f; }
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t gi = 0; gi < ng; gi++) {
        int64_t k = gi * Q4_GROUP;
        /* unpacked once for the whole tile of x rows */
        __m128i b = _mm_loadu_si128((const __m128i *)(q + k / 2));
        __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
        __m256 w0 = u8x8_to_ps(lo), w1 = u8x8_to_ps(_mm_srli_si128(lo, 8));
        __m256 w2 = u8x8_to_ps(hi), w3 = u8x8_to_ps(_mm_srli_si128(hi, 8));
        __m256 sv = _mm256_set1_ps(s[gi]);
        for (int i = 0; i < mt; i++) {
            const float *xr = x + i * ldx + k;
            __m256 g = _mm256_mul_ps(w0, _mm256_loadu_ps(xr));
            g = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), g);
            g = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), g);
            g = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), g);
            acc[i] = _mm256_fmadd_ps(g, sv, acc[i]);
            off[i] += mn[gi] * xsum[i * ng + gi];
        }
    }
    for (int i = 0; i < mt; i++) out[i] = hsum256(acc[i]) + off[i];
#else
    for (int i = 0; i < mt; i++) {
        float lanes[8] = {0}, off = 0.0f;
        for (int64_t gi = 0; gi < ng; gi++) {
            const float *xr = x + i * ldx + gi * Q4_GROUP;
            const uint8_t *qb = q + gi * Q4_GROUP / 2;
            float g[8] = {0};
            for (int j = 0; j < 16; j++) {
                g[j % 8] += (float)(qb[j] & 0x0F) * xr[j];
            }
            for (int j = 0; j < 16; j++) g[j % 8] += (float)(qb[j] >> 4) * xr[16 + j];
            for (int l = 0; l < 8; l++) lanes[l] += g[l] * s[gi];
            off += mn[gi] * xsum[i * ng + gi];
        }
        out[i] = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7])) + off;
    }
#endif
}

/* Sums of each row of x over each group of 32: the mins' share of the dot products. */
static void group_sums(const float *x, int64_t M, int64_t K, int64_t ldx, float *xsum) {
    int64_t ng = K / Q4_GROUP;
    for (int64_t m = 0; m < M; m++)
        for (int64_t gi = 0; gi < ng; gi++) {
            const float *xr = x + m * ldx + gi * Q4_GROUP;
            float t = 0.0f;
            for (int j = 0; j < Q4_GROUP; j++) t += xr[j];
            xsum[m * ng + gi] = t;
        }
}

/* Returns 0, or -1 when the scratch allocation fails. */
int tidal_int4_gemm_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
                        const float *scales, const float *mins, const float *bias, float *y,
                        int64_t N, int nthreads) {
    int64_t ng = K / Q4_GROUP;
    float *xsum = malloc(sizeof(float) * (size_t)(M * ng));
    if (!xsum) return -1;
    group_sums(x, M, K, ldx, xsum);
    int64_t nb = (N + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t blk = 0; blk < nb; blk++) {
        int64_t n0 = blk * 4, nr = N - n0 < 4 ? N - n0 : 4;
        float out[MT];
        for (int64_t m = 0; m < M; m += MT) {
            int mt = (int)(M - m < MT ? M - m : MT);
            const float *xm = x + m * ldx, *xs = xsum + m * ng;
            for (int64_t n = n0; n < n0 + nr; n++) {
                const uint8_t *qn = packed + n * (K / 2);
                const float *sn = scales + n * ng, *mn = mins + n * ng;
                switch (mt) {
                case 4: int4_row(xm, ldx, 4, xs, ng, qn, sn, mn, out); break;
                case 3: int4_row(xm, ldx, 3, xs, ng, qn, sn, mn, out); break;
                case 2: int4_row(xm, ldx, 2, xs, ng, qn, sn, mn, out); break;
                default: int4_row(xm, ldx, 1, xs, ng, qn, sn, mn, out); break;
                }
                for (int i = 0; i < mt; i++) y[(m + i) * N + n] = out[i] + (bias ? bias[n] : 0.0f);
            }
        }
    }
    free(xsum);
    return 0;
}

/* ---- fp8 e4m3, one scale per row ---- */

static inline __attribute__((always_inline)) void fp8_row(const float *x, int64_t ldx, int mt,
                                                          const uint8_t *w, int64_t K, float *out) {
#ifdef TIDAL_AVX2
    /* 2 accumulators per row (even and odd chunks of 8) break the FMA latency chain of a row */
    __m256 a[MT], b[MT];
    for (int i = 0; i < mt; i++) { a[i] = _mm256_setzero_ps(); b[i] = _mm256_setzero_ps(); }
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256 w0 = e4m3x8_to_ps_div256(w + k), w1 = e4m3x8_to_ps_div256(w + k + 8);
        for (int i = 0; i < mt; i++) {
            a[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i * ldx + k), a[i]);
            b[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i * ldx + k + 8), b[i]);
        }
    }
    for (; k < K; k += 8) {
        __m256 w0 = e4m3x8_to_ps_div256(w + k);
        for (int i = 0; i < mt; i++) a[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i * ldx + k), a[i]);
    }
    for (int i = 0; i < mt; i++) out[i] = hsum256(_mm256_add_ps(a[i], b[i])) * 256.0f;
#else
    for (int i = 0; i < mt; i++) {
        float t = 0.0f;
        for (int64_t k = 0; k < K; k++) t += e4m3_to_float(w[k]) * x[i * ldx + k];
        out[i] = t;
    }
#endif
}

/* K a multiple of 8 */
void tidal_fp8_gemm_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *codes,
                        const float *scales, const float *bias, float *y, int64_t N, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        float out[MT];
        float b = bias ? bias[n] : 0.0f;
        for (int64_t m = 0; m < M; m += MT) {
            int mt = (int)(M - m < MT ? M - m : MT);
            const float *xm = x + m * ldx;
            const uint8_t *wn = codes + n * K;
            switch (mt) {
            case 4: fp8_row(xm, ldx, 4, wn, K, out); break;
            case 3: fp8_row(xm, ldx, 3, wn, K, out); break;
            case 2: fp8_row(xm, ldx, 2, wn, K, out); break;
            default: fp8_row(xm, ldx, 1, wn, K, out); break;
            }
            for (int i = 0; i < mt; i++) y[(m + i) * N + n] = out[i] * scales[n] + b;
        }
    }
}
