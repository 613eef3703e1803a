/* A whole decoder stack for a CPU step in one C call: the per-op Python and torch dispatch of a
 * decode step (~70 matmul calls, ~90 norms, 18 attention calls and their glue for Gemma 3 270M)
 * becomes a loop here over the same kernels tidal calls one by one otherwise:
 *
 *   per layer, x (T, hidden) float32 updated in place:
 *     h   = rms_norm(x) * norm_in
 *     qkv = h @ Wqkv.T (+ bias)                      tidal_gguf_gemm, GGUF blocks
 *     q, k: per-head rms_norm (optional), rotary     tidal_qk_norm_rope, in place on qkv
 *     a   = paged_attention(q, k, v)                 tidal_paged_attention (writes K/V pages)
 *     o   = a @ Wo.T
 *     x  += rms_norm(o) * norm_attn_out   (Gemma)    or  x += o   (Llama)
 *     h   = rms_norm(x) * norm_ffn_in
 *     gu  = h @ Wgate_up.T                           (the MLP: MLP_ROWS rows at a time)
 *     m   = act(gate) * up                           silu (SwiGLU) or gelu-tanh (GeGLU)
 *     d   = m @ Wdown.T
 *     x  += rms_norm(d) * norm_ffn_out    (Gemma)    or  x += d
 *   then, where the caller passes its scale, the model's final norm: x = rms_norm(x) * norm
 *
 * Every operation is the function the per-op path runs (the modules in tidal/layers/ call the
 * same C entry points, and tidal_gated_act below for the activation), in the same order, so both
 * paths give the same bits and a row's result stays independent of its batch.
 *
 * Built at first use by tidal/kernels/build.py with gguf_gemm.c, paged_attention.c and
 * norm_rope.c linked in (-O3 -march=native -fopenmp). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tidal_kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TIDAL_AVX2 1
#else
#define TIDAL_AVX2 0
#endif

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };
enum { ISA_SCALAR = 0, ISA_AVX2 = 1 };
enum { MAX_ROPES = 4, MAX_GROUPS = 16 };
/* timing slots (seconds), accumulated when the caller passes an array */
enum { TIME_GEMM = 0, TIME_ATTENTION = 1, TIME_NORM_ROPE = 2, TIME_ACT_ADD = 3, TIME_SLOTS = 4 };
/* rows of a step the MLP takes at a time: its (rows, 3 x intermediate) floats of scratch stay
 * small and cache-warm for long prompt chunks (24 MiB at 1,024 rows for Gemma 3 270M, 3 MiB at
 * 128; a 6,000-token prompt's prefill 1.07-1.11x faster, a 1,024-token step's peak RSS ~17 MiB
 * lower). Each row's result does not depend on the rows beside it (the gemm's and the
 * activation's contract), so the bits are the whole step's. */
#define MLP_ROWS 128

int tidal_decoder_best_isa(void) { return TIDAL_AVX2 ? ISA_AVX2 : ISA_SCALAR; }

/* ------------------------------------------------------------------ activations
 * exp(x) for x in [-87.3, 88.7] to ~2 ulp: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], a
 * degree-6 polynomial by Horner's rule. The scalar and AVX2 paths run the same operations
 * (fmaf / vfmadd), so both give the same bits. */
#define EXP_HI 88.3762626647949f
#define EXP_LO (-87.3365478515625f)
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO (-2.12194440e-4f)
static const float EXP_C[6] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f};

static inline float exp_scalar(float x) {
    x = x > EXP_HI ? EXP_HI : (x < EXP_LO ? EXP_LO : x);
    float n = nearbyintf(x * LOG2E);
    float r = fmaf(-n, LN2_HI, x);
    r = fmaf(-n, LN2_LO, r);
    float p = EXP_C[0];
    for (int i = 1; i < 6; i++) p = fmaf(p, r, EXP_C[i]);
    p = fmaf(p, r, 1.0f);
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* gelu-tanh: 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), computed as the equal
 * x / (1 + e^-2u), which has no cancellation where tanh(u) nears -1. */
#define GELU_K0 0.7978845608028654f
#define GELU_K1 0.044715f

static inline float gelu_tanh_scalar(float x) {
    float u = GELU_K0 * (x + GELU_K1 * (x * x * x));
    return x / (1.0f + exp_scalar(-2.0f * u));
}

static inline float silu_scalar(float x) { return x / (1.0f + exp_scalar(-x)); }

#if TIDAL_AVX2
static inline __m256 exp_avx2(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_C[0]);
    for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C[i]));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

static inline __m256 gelu_tanh_avx2(__m256 x) {
    __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    __m256 u = _mm256_mul_ps(_mm256_set1_ps(GELU_K0),
                             _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(GELU_K1), x3)));
    __m256 e = exp_avx2(_mm256_mul_ps(_mm256_set1_ps(-2.0f), u));
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

static inline __m256 silu_avx2(__m256 x) {
    __m256 e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), x));
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}
#endif

/* out[r, i] = act(gu[r, i]) * gu[r, I + i] for i < I: the gated MLP's activation on a fused
 * gate/up output (gate in the first I columns). Elementwise, so batch-invariant. */
void tidal_gated_act(const float *gu, int64_t rows, int64_t I, int64_t ldgu, int64_t act,
                     float *out, int64_t ldo, int64_t isa) {
    (void)isa; /* a build without AVX2 has the scalar loop only */
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * ldgu, *u = g + I;
        float *o = out + r * ldo;
        int64_t i = 0;
#if TIDAL_AVX2
        if (isa >= ISA_AVX2) { /* a higher code (AVX-512) runs AVX2 here */
            for (; i + 8 <= I; i += 8) {
                __m256 gv = _mm256_loadu_ps(g + i), uv = _mm256_loadu_ps(u + i);
                __m256 a = act == ACT_SILU ? silu_avx2(gv) : gelu_tanh_avx2(gv);
                _mm256_storeu_ps(o + i, _mm256_mul_ps(a, uv));
            }
        }
#endif
        for (; i < I; i++) o[i] = (act == ACT_SILU ? silu_scalar(g[i]) : gelu_tanh_scalar(g[i])) * u[i];
    }
}

/* ------------------------------------------------------------------ the stack
 * Both blocks are packed by tidal/kernels/decoder.py, 8 bytes a field. */
typedef struct {
    const int64_t *qkv; /* gemm segment descriptors (pointer, ggml type, rows) and their count */
    int64_t qkv_nseg;
    const float *qkv_bias; /* NULL: none */
    const int64_t *o;
    int64_t o_nseg;
    const int64_t *gate_up;
    int64_t gate_up_nseg;
    const int64_t *down;
    int64_t down_nseg;
    const float *norm_in, *norm_attn_out, *norm_ffn_in, *norm_ffn_out; /* scales; *_out NULL: none */
    const float *q_norm, *k_norm;                                     /* NULL: no q/k norm */
    void *k_pages, *v_pages;
    float *k_scales, *v_scales;
    int64_t kv_type, block_size;
    int64_t group, rope, window; /* KV group, rotary table, sliding window (0: none) */
    double scale, softcap;       /* attention scale, logit soft-cap (0: none) */
} layer_t;

typedef struct {
    const layer_t *layers;
    int64_t n_layers;
    int64_t hidden, H, KVH, D, inter;
    int64_t act, gemm_act; /* ACT_*; the gemm's activation mode (f32 or q8) */
    double eps;
    int64_t gemm_isa, isa, nthreads; /* attention and elementwise kernels take `isa` */
    /* the step */
    float *x;
    int64_t T;
    const float *cos[MAX_ROPES], *sin[MAX_ROPES];
    const int64_t *slots[MAX_GROUPS], *tables[MAX_GROUPS];
    int64_t width[MAX_GROUPS];
    const int32_t *seqs;
    int64_t S;
    double *times; /* NULL, or TIME_SLOTS seconds accumulated per kind of work */
    const float *final_norm; /* the model's final norm scale, applied to x in place; NULL: none */
} run_t;

int64_t tidal_decoder_layer_size(void) { return (int64_t)sizeof(layer_t); }
int64_t tidal_decoder_run_size(void) { return (int64_t)sizeof(run_t); }

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Timing: one clock read per kernel, only when asked. */
#define TICK(slot)                                  \
    do {                                            \
        if (R.times) {                              \
            double t1_ = now();                     \
            R.times[slot] += t1_ - t0;              \
            t0 = t1_;                               \
        }                                           \
    } while (0)

static void add_bias(float *y, int64_t rows, int64_t n, int64_t ld, const float *bias) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < n; c++) y[r * ld + c] += bias[c];
}

/* Returns 0, or the first failing kernel's code: -1..-4 from the gemm (see gguf_gemm.c), -10
 * when the attention kernel's scratch could not be allocated, -11 when this call's could not,
 * -12 for a bad block (too many ropes or groups). x is then partly updated. */
int tidal_decoder_run(const void *packed) {
    run_t R;
    memcpy(&R, packed, sizeof R);
    int64_t T = R.T, hid = R.hidden, H = R.H, KVH = R.KVH, D = R.D, I = R.inter;
    int64_t qdim = H * D, kvdim = KVH * D, wqkv = qdim + 2 * kvdim;
    if (T <= 0 || R.n_layers <= 0) return 0;
    /* scratch: h (T, hid), qkv (T, wqkv), attn (T, qdim), o (T, hid), and for the MLP, which
     * takes the rows MLP_ROWS at a time, gu (MLP_ROWS, 2I), m (MLP_ROWS, I) */
    int64_t mr = T < MLP_ROWS ? T : MLP_ROWS;
    int64_t per_row = hid + wqkv + qdim + hid;
    float *scratch = malloc(sizeof(float) * (size_t)(T * per_row + mr * 3 * I));
    if (!scratch) return -11;
    float *h = scratch, *qkv = h + T * hid, *attn = qkv + T * wqkv, *o = attn + T * qdim;
    float *gu = o + T * hid, *m = gu + mr * 2 * I;
    int rc = 0;
    double t0 = R.times ? now() : 0.0;
    for (int64_t l = 0; l < R.n_layers && rc == 0; l++) {
        const layer_t *L = &R.layers[l];
        if (L->rope < 0 || L->rope >= MAX_ROPES || L->group < 0 || L->group >= MAX_GROUPS) {
            rc = -12;
            break;
        }
        tidal_rms_norm(R.x, T, hid, hid, L->norm_in, R.eps, h, hid);
        TICK(TIME_NORM_ROPE);
        rc = tidal_gguf_gemm(h, T, hid, hid, L->qkv, L->qkv_nseg, qkv, wqkv, R.gemm_act,
                             R.gemm_isa, R.nthreads);
        if (rc) break;
        if (L->qkv_bias) add_bias(qkv, T, wqkv, wqkv, L->qkv_bias);
        TICK(TIME_GEMM);
        tidal_qk_norm_rope(qkv, qkv + qdim, T, H, KVH, D, wqkv, wqkv, L->q_norm, L->k_norm, R.eps,
                           R.cos[L->rope], R.sin[L->rope]);
        TICK(TIME_NORM_ROPE);
        tidal_attention_args a = {
            qkv, qkv + qdim, qkv + qdim + kvdim, wqkv, wqkv, wqkv, attn, T, H, KVH, D,
            L->k_pages, L->v_pages, L->k_scales, L->v_scales, L->kv_type, L->block_size,
            R.slots[L->group], R.tables[L->group], R.width[L->group], R.seqs, R.S, L->window,
            L->scale, L->softcap, R.isa, R.nthreads};
        if (tidal_paged_attention(&a) != 0) {
            rc = -10;
            break;
        }
        TICK(TIME_ATTENTION);
        rc = tidal_gguf_gemm(attn, T, qdim, qdim, L->o, L->o_nseg, o, hid, R.gemm_act,
                             R.gemm_isa, R.nthreads);
        if (rc) break;
        TICK(TIME_GEMM);
        tidal_add_rms_norm(R.x, T, hid, hid, o, hid, L->norm_attn_out, R.eps);
        tidal_rms_norm(R.x, T, hid, hid, L->norm_ffn_in, R.eps, h, hid);
        TICK(TIME_NORM_ROPE);
        for (int64_t r0 = 0; r0 < T && rc == 0; r0 += mr) {
            int64_t n = T - r0 < mr ? T - r0 : mr;
            rc = tidal_gguf_gemm(h + r0 * hid, n, hid, hid, L->gate_up, L->gate_up_nseg, gu,
                                 2 * I, R.gemm_act, R.gemm_isa, R.nthreads);
            if (rc) break;
            TICK(TIME_GEMM);
            tidal_gated_act(gu, n, I, 2 * I, R.act, m, I, R.isa);
            TICK(TIME_ACT_ADD);
            rc = tidal_gguf_gemm(m, n, I, I, L->down, L->down_nseg, o + r0 * hid, hid, R.gemm_act,
                                 R.gemm_isa, R.nthreads);
            TICK(TIME_GEMM);
        }
        if (rc) break;
        tidal_add_rms_norm(R.x, T, hid, hid, o, hid, L->norm_ffn_out, R.eps);
        TICK(TIME_NORM_ROPE);
    }
    /* the final norm, in place (each row's squares are summed before any of it is written): the
     * call the model's norm module makes, so the bits are the same; one Python call less a step */
    if (rc == 0 && R.final_norm) {
        tidal_rms_norm(R.x, T, hid, hid, R.final_norm, R.eps, R.x, hid);
        TICK(TIME_NORM_ROPE);
    }
    free(scratch);
    return rc;
}
