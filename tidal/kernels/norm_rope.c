/* RMSNorm and rotary embedding for CPU decode steps: one C call where torch runs ~8 small ops.
 *
 *   rms_norm:      out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * scale[:]
 *                  (scale is the float32 weight, or Gemma's (1 + w), prepared by the caller)
 *   qk_norm_rope:  in place on q (T, H, D) and k (T, KVH, D), rows with strides ldq / ldk:
 *                  optionally an RMSNorm per head (scale_q / scale_k over D), then the
 *                  rotate-half rotary embedding with cos/sin (T, D):
 *                  y[i] = x[i] * cos[i] - x[i + D/2] * sin[i]          for i <  D/2
 *                  y[i] = x[i] * cos[i] + x[i - D/2] * sin[i]          for i >= D/2
 *
 * Every row is computed by the same operations whatever else is in the call (the sum of
 * squares runs in 8 float lanes folded in a fixed order), so a sequence's result does not
 * depend on its batch. All float32. Single-threaded: a decode step's rows are far too small to
 * pay for waking a thread pool. Built by tidal/kernels/build.py (-O3 -march=native). */
#include <math.h>
#include <stdint.h>

#include "tidal_kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TIDAL_AVX2 1
#endif

/* Sum of squares of n floats: 8 lanes (lane j takes elements j, j + 8, ...), folded pairwise.
 * The scalar path keeps the same lanes and fold, so both paths give the same bits. */
static float sum_squares(const float *x, int64_t n) {
    float lanes[8] = {0};
    int64_t k = 0;
#ifdef TIDAL_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; k + 8 <= n; k += 8) {
        __m256 v = _mm256_loadu_ps(x + k);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    _mm256_storeu_ps(lanes, acc);
#else
    for (; k + 8 <= n; k += 8)
        for (int j = 0; j < 8; j++) lanes[j] = fmaf(x[k + j], x[k + j], lanes[j]);
#endif
    for (; k < n; k++) lanes[k % 8] = fmaf(x[k], x[k], lanes[k % 8]);
    return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

static void norm_row(const float *x, const float *scale, int64_t n, float eps, float *out) {
    float inv = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
    for (int64_t k = 0; k < n; k++) out[k] = (x[k] * inv) * scale[k];
}

void tidal_rms_norm(const float *x, int64_t rows, int64_t n, int64_t ldx, const float *scale,
                    double eps, float *out, int64_t ldo) {
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * ldx, scale, n, (float)eps, out + r * ldo);
}

/* x[r, :] += rms_norm(o[r, :]) * scale, or x[r, :] += o[r, :] when scale is NULL: a residual
 * add after a post-norm (Gemma) or none (Llama), with the norm's value computed exactly as
 * tidal_rms_norm computes it, so that `x + rms_norm(o)` in torch gives the same bits. */
void tidal_add_rms_norm(float *x, int64_t rows, int64_t n, int64_t ldx, const float *o,
                        int64_t ldo, const float *scale, double eps) {
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * ldx;
        const float *orow = o + r * ldo;
        if (!scale) {
            for (int64_t k = 0; k < n; k++) xr[k] += orow[k];
            continue;
        }
        float inv = 1.0f / sqrtf(sum_squares(orow, n) / (float)n + (float)eps);
        for (int64_t k = 0; k < n; k++) xr[k] += (orow[k] * inv) * scale[k];
    }
}

/* One head of D values in place: optional norm, then the rotation. */
static void head(float *x, int64_t d, const float *scale, float eps, const float *cos,
                 const float *sin) {
    if (scale) norm_row(x, scale, d, eps, x);
    int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

void tidal_qk_norm_rope(float *q, float *k, int64_t t, int64_t h, int64_t kvh, int64_t d,
                        int64_t ldq, int64_t ldk, const float *scale_q, const float *scale_k,
                        double eps, const float *cos, const float *sin) {
    for (int64_t r = 0; r < t; r++) {
        const float *c = cos + r * d, *s = sin + r * d;
        for (int64_t j = 0; j < h; j++) head(q + r * ldq + j * d, d, scale_q, (float)eps, c, s);
        for (int64_t j = 0; j < kvh; j++) head(k + r * ldk + j * d, d, scale_k, (float)eps, c, s);
    }
}
