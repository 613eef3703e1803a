/* Paged attention for CPU steps, decode and mixed prefill+decode alike: one call per layer writes
 * the step's new K/V into the pages, then attends every query to its keys read in place through
 * its sequence's block table.
 *
 *   q, out        (T, H, D) float32             k, v  (T, KVH, D) float32
 *                 (q, k, v: each token's H x D or KVH x D block contiguous, tokens ldq/ldk/ldv
 *                 floats apart, so column slices of a fused qkv projection need no copy)
 *   k/v pages     (num_blocks, BS, KVH, D)      float32 | bfloat16 | int8 codes | e4m3fn bytes
 *   k/v scales    (num_blocks, BS, KVH) float32, 8-bit pages only: value = code * scale
 *   slots         (T,) int64, flat slot = block * BS + offset of each new token
 *   tables        (S, W) int64 block ids;  qstart, qlen, ctx (S,) int32
 *
 * Query j of sequence i sits at position p = ctx[i] - qlen[i] + j and sees the keys at lo..p,
 * lo = 0, or max(0, p - window + 1) for a sliding layer; query head h reads kv head h / G
 * (G = H / KVH). Scores are q.k * scale, optionally softcap * tanh(s / softcap).
 *
 * Work: a tile is (sequence, kv head, up to QT consecutive queries) times the G heads sharing
 * that kv head, about ROWS rows (query, head) that use every key and value row while it sits in
 * L1. Tiles run in parallel; when a step has fewer tiles than 2 x threads (one long decode), a
 * tile's key segments run in parallel too, and the last to finish folds them (flash-decoding).
 * A small step runs on one thread; a parallel one has a single join and no barrier inside.
 *
 * BATCH INVARIANCE: a row's result is a fixed function of its query and its keys lo..p, the same
 * whatever else is in the step, however the prompt was chunked, and whatever the thread count:
 *   - keys are cut at absolute positions: segments of SEG, chunks of KB; key pos is lane pos % KB;
 *   - in a segment the online softmax starts fresh and takes chunk after chunk; the segments'
 *     states are folded left to right, by the same function whether one thread ran them all or
 *     each ran apart;
 *   - each score is one dot product with one accumulator in the same order; keys outside a row's
 *     range are masked lanes that add exact zeros (exp gives 0, and 0 * v leaves a sum as is).
 * A tile only decides which rows share loads, never the operations on a row.
 *
 * No AMX: q.k and p.v in float32 on the tile unit would take x split into three bfloat16 and a
 * float16 key or value into two (exact products, five tile products per pair of operands), and
 * every tile, a decode's four rows too, would then have to run there (its sums' bits are not the
 * FMA chains'). Tried on 64 rows x 16 keys x 256 (one core, Xeon family 6 model 207): 7.2k
 * cycles on tiles against 13.3k for AVX-512's blocks, but turning the chunk's keys into the tile
 * layout took ~5.6k more there (a tuned transpose perhaps ~1.5k), paid by every tile that reads
 * them: a decode's 4 rows, ~0.8k cycles a chunk on AVX-512, would take 2-3x as long.
 *
 * Built at first use by tidal/kernels/build.py (-O3 -march=native -fopenmp). `isa` picks AVX2+FMA
 * (with F16C for e4m3) or the scalar code below, which computes the same function to rounding. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "cephes_exp.h"
#include "tidal_kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TIDAL_AVX2 1
#else
#define TIDAL_AVX2 0
#endif
/* -march=native on a machine with AVX-512 F/BW/VL/DQ adds the 16-lane path */
#if TIDAL_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define TIDAL_AVX512 1
#else
#define TIDAL_AVX512 0
#endif

enum { KV_F32 = 0, KV_BF16 = 1, KV_INT8 = 2, KV_FP8 = 3, KV_F16 = 4 };
/* bytes per element of a page row */
#define KV_ESZ(t) ((t) == KV_F32 ? 4 : ((t) == KV_BF16 || (t) == KV_F16) ? 2 : 1)
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

#define KB 16   /* keys per chunk: one softmax update per row per chunk; a multiple of 8 */
#ifndef NCH
#define NCH 2
#endif
/* AVX-512: chunks whose scores precede one p.v pass (run_segment512). Their widened values
 * (NCH x KB x D floats: 32 KiB for D = 256) stay in L1 beside the tile's scores; at 4 (64 KiB)
 * prompts ran 1.04-1.07x slower with 64-row tiles on a Zen 5 */
#define SEG 256 /* keys per segment, a multiple of KB: the unit a long decode is split into */
#define ROWS 16 /* rows (query x head) a tile aims for */
#ifndef ROWS512
#define ROWS512 64 /* on the AVX-512 path, whose blocks want more rows per key (64: prompts'
                           attention 1.04-1.07x over 32 on a Zen 5, the same bits) */
#endif
/* below these many row x key x column products a step runs on one thread (~20 us of work) */
#define PARALLEL_WORK (1 << 19)
/* below these many K/V elements the write runs on one thread */
#define PARALLEL_WRITE (1 << 16)
#define ALWAYS_INLINE static inline __attribute__((always_inline))

#define NEG_INF (-__builtin_inff())

/* Cephes expf (its polynomial: cephes_exp.h) and tanhf constants, shared by the scalar, 8- and
 * 16-lane versions */
#define EXP_LO (-87.3365447504f)
#define EXP_HI (88.0f)
#define TANH_P0 (-5.70498872745e-3f)
#define TANH_P1 (2.06390887954e-2f)
#define TANH_P2 (-5.37397155531e-2f)
#define TANH_P3 (1.33314422036e-1f)
#define TANH_P4 (-3.33332819422e-1f)
#define TANH_SMALL (0.625f)

int tidal_paged_attention_best_isa(void) {
    return TIDAL_AVX512 ? ISA_AVX512 : TIDAL_AVX2 ? ISA_AVX2 : ISA_SCALAR;
}

typedef struct {
    const float *q, *k, *v;
    int64_t ldq, ldk, ldv;
    float *out;
    void *kp, *vp;   /* pages */
    float *ks, *vs;  /* scales (8-bit pages) or NULL */
    const int64_t *slots, *tables;
    const int32_t *qstart, *qlen, *ctx;
    int64_t S, T, H, KVH, D, BS, W, window;
    float scale, softcap;
    int type, isa, G, QT;
} prm_t;

typedef struct {
    int32_t seq, g, j0, nq;  /* queries j0 .. j0 + nq - 1 of sequence seq, kv head g */
    int32_t seg0, seg1;      /* the key segments its rows touch, [seg0, seg1) */
    int64_t part;            /* split tiles: float offset of its per-segment states; else -1 */
    int64_t split;           /* split tiles: index of its parts-done counter; else -1 */
} tile_t;

typedef struct {
    int32_t tile, seg;       /* seg < 0: the whole tile */
} item_t;

typedef struct {
    float *cm, *cl, *cacc;   /* per row: the current segment's max, sum, accumulator (D) */
    float *tm, *tl, *tacc;   /* per row: the folded state of the segments so far */
    float *sc;               /* R x KB scores, then probabilities */
    float *kbuf, *vbuf;      /* KB x D: a chunk of e4m3 keys and values widened to float */
    float *alpha;            /* R: this chunk's rescale of the accumulator */
    int64_t *lo, *pos;       /* per row: first and last key position */
    const float **qr;        /* per row: its query */
    float kmul[KB], vmul[KB];
    int64_t off[KB];         /* per lane: slot * KVH + g, the row index into pages and scales */
    int64_t next[KB];        /* per lane: the next chunk's rows, prefetched meanwhile */
    /* the AVX-512 path's group of NCH chunks (run_segment512): lane rows of each and the next,
     * scales of each; sc, alpha and vbuf then hold NCH chunks' worth */
    int64_t goff[NCH + 1][KB];
    float kmul4[NCH][KB], vmul4[NCH][KB];
} scr_t;

typedef struct {
    const void *vbase;       /* a chunk's values: pages, or vbuf's widened rows */
    const int64_t *voff;     /* per lane: its row in vbase */
    int kk0, kk1, ra, rb;    /* its lanes; the tile's rows that meet it, [ra, rb) */
} chunk512_t;

/* ---------------------------------------------------------------- scalar helpers */

static inline float f32_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bits_f32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float maxf(float a, float b) { return a > b ? a : b; }

/* round half to even for |x| < 2^22 (as torch.round); no libm, no dependence on the build */
static inline float rne(float x) {
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    return x >= 0 ? (x + magic) - magic : (x - magic) + magic;
}

/* exp for x <= ~88 (Cephes expf: ~1 ulp); exp(0) == 1 exactly */
static inline float exp_s(float x) {
    x = x < EXP_LO ? EXP_LO : (x > EXP_HI ? EXP_HI : x);
    float n = rne(x * EXP_LOG2E);
    float r = x - n * EXP_LN2_HI;
    r = r - n * EXP_LN2_LO;
    float y = EXP_P0;
    y = y * r + EXP_P1;
    y = y * r + EXP_P2;
    y = y * r + EXP_P3;
    y = y * r + EXP_P4;
    y = y * r + EXP_P5;
    y = y * (r * r) + r + 1.0f;
    return y * f32_bits((uint32_t)((int32_t)n + 127) << 23);
}

/* tanh (Cephes tanhf: polynomial below 0.625, 1 - 2 / (exp(2|x|) + 1) above) */
static inline float tanh_s(float x) {
    float ax = x < 0 ? -x : x;
    if (ax < TANH_SMALL) {
        float z = x * x;
        float p = TANH_P0;
        p = p * z + TANH_P1;
        p = p * z + TANH_P2;
        p = p * z + TANH_P3;
        p = p * z + TANH_P4;
        return p * z * x + x;
    }
    float t = 1.0f - 2.0f / (exp_s(2.0f * ax) + 1.0f);
    return x < 0 ? -t : t;
}

static inline uint16_t bf16_rne(float f) {
    uint32_t u = bits_f32(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0; /* NaN */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float bf16_f32(uint16_t h) { return f32_bits((uint32_t)h << 16); }

/* float16 pages hold at most 65504 in magnitude: values beyond are saturated (NaN stays NaN),
 * where a plain conversion would write an infinity; tidal.attention.torch_paged clamps alike */
#define F16_MAX 65504.0f
static inline float f16_clamp(float f) { return f > F16_MAX ? F16_MAX : f < -F16_MAX ? -F16_MAX : f; }

/* float -> IEEE half, rounding to nearest even (c10's fp16_ieee_from_fp32_value for finite
 * inputs up to 65504, so the bits match torch's .to(torch.float16)) */
static inline uint16_t f16_rne(float f) {
    uint32_t u = bits_f32(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    u &= 0x7FFFFFFFu;
    if (u > 0x7F800000u) return sign | 0x7E00u; /* NaN */
    if (u < (113u << 23)) { /* below 2^-14: a subnormal half (or zero), rounded by the FPU */
        const uint32_t magic = 126u << 23; /* 0.5f: its ulp is 2^-24, the half's subnormal step */
        return sign | (uint16_t)(bits_f32(f32_bits(u) + f32_bits(magic)) - magic);
    }
    uint32_t odd = (u >> 13) & 1u;
    return sign | (uint16_t)((u + 0xC8000FFFu + odd) >> 13); /* rebias 127 -> 15, round */
}

static inline float f16_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0) { /* zero or subnormal: m * 2^-24, exact */
        float v = (float)m * 0x1p-24f;
        return sign ? -v : v;
    }
    if (e == 31) return f32_bits(sign | 0x7F800000u | (m << 13));
    return f32_bits(sign | ((e + 112u) << 23) | (m << 13));
}

/* float -> e4m3fn byte, rounding to nearest even: c10's fp8e4m3fn_from_fp32_value, so the
 * codes match torch's .to(torch.float8_e4m3fn) bit for bit */
static inline uint8_t e4m3_from_f32(float f) {
    uint32_t u = bits_f32(f);
    uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint8_t res;
    if (u >= (1087u << 20)) {
        res = 0x7F; /* NaN: 480 and above */
    } else if (u < (121u << 23)) {
        const uint32_t denorm = 141u << 23;
        res = (uint8_t)(bits_f32(f32_bits(u) + f32_bits(denorm)) - denorm);
    } else {
        uint32_t odd = (u >> 20) & 1u;
        u += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu;
        u += odd;
        res = (uint8_t)(u >> 20);
    }
    return res | (uint8_t)(sign >> 24);
}

static inline float e4m3_f32(uint8_t b) {
    int e = (b >> 3) & 0xF, m = b & 7;
    float v = e ? (1.0f + m / 8.0f) * (float)(1 << e) / 128.0f : m / 8.0f / 64.0f;
    return (b & 0x80) ? -v : v;
}

/* element i of a page row as float (scalar path); 8-bit codes before their scale */
ALWAYS_INLINE float load1(const void *base, int64_t i, int type) {
    switch (type) {
    case KV_F32: return ((const float *)base)[i];
    case KV_BF16: return bf16_f32(((const uint16_t *)base)[i]);
    case KV_F16: return f16_f32(((const uint16_t *)base)[i]);
    case KV_INT8: return (float)((const int8_t *)base)[i];
    default: return e4m3_f32(((const uint8_t *)base)[i]);
    }
}

/* ---------------------------------------------------------------- AVX2 helpers */
#if TIDAL_AVX2
static inline float hsum256(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline float hmax256(__m256 v) {
    __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_max_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* the same Cephes expf as exp_s, 8 lanes */
static inline __m256 exp256(__m256 x) {
    return cephes_exp256(
        _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(EXP_HI)), _mm256_set1_ps(EXP_LO)));
}

static inline float exp1_avx2(float x) {
    return _mm_cvtss_f32(_mm256_castps256_ps128(exp256(_mm256_set1_ps(x))));
}

static inline __m256 tanh256(__m256 x) {
    __m256 signbit = _mm256_set1_ps(-0.0f);
    __m256 ax = _mm256_andnot_ps(signbit, x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps(TANH_P0);
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(TANH_P1));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(TANH_P2));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(TANH_P3));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(TANH_P4));
    __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
    __m256 e = exp256(_mm256_add_ps(ax, ax));
    __m256 big = _mm256_sub_ps(_mm256_set1_ps(1.0f),
                               _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
    big = _mm256_or_ps(big, _mm256_and_ps(signbit, x));
    return _mm256_blendv_ps(big, small, _mm256_cmp_ps(ax, _mm256_set1_ps(TANH_SMALL), _CMP_LT_OQ));
}

/* 8 e4m3 bytes -> float / 256: moving exponent and mantissa 7 bits up makes an fp16 whose
 * exponent bias is 8 too small (15 vs 7), which F16C converts exactly, subnormals included. */
static inline __m256 e4m3x8_div256(const uint8_t *p) {
    __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    __m128i mag = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7);
    __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
    return _mm256_cvtph_ps(_mm_or_si128(mag, sign));
}

/* 8 elements of a page row as float; 8-bit codes before their scale (e4m3 also / 256) */
ALWAYS_INLINE __m256 load8(const void *base, int64_t i, int type) {
    switch (type) {
    case KV_F32: return _mm256_loadu_ps((const float *)base + i);
    case KV_BF16: {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case KV_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)));
    case KV_INT8:
        return _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)base + i))));
    default: return e4m3x8_div256((const uint8_t *)base + i);
    }
}

/* the 8 lane sums of v[0..7], each as ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)): one
 * tree for every dot product, whichever slot it sits in */
static inline __m256 hsum8x(const __m256 v[8]) {
    __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    /* u0 = [v0 v1 v2 v3 (lanes 0-3) | v0 v1 v2 v3 (lanes 4-7)], u1 likewise for v4..v7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* s[r * KB + kk] = q_r . key(kk) for NR rows x NK keys from kk0; one accumulator per pair, d in
 * order, one reduction tree, so a pair's sum does not depend on NR, NK or its neighbours */
ALWAYS_INLINE void qk_block(const float *const *qr, int NR, const void *kbase, const int64_t *off,
                            const int64_t *next, int kk0, int NK, int64_t D, int type, float *s) {
    __m256 acc[16]; /* pair (i, j) in acc[3 * i + j]; unused ones stay 0 */
    const uint8_t *kr[3], *pf[3];
    int esz = KV_ESZ(type);
    for (int j = 0; j < NK; j++) {
        kr[j] = (const uint8_t *)kbase + off[kk0 + j] * D * esz;
        pf[j] = (const uint8_t *)kbase + next[kk0 + j] * D * esz;
    }
    for (int i = 0; i < 16; i++) acc[i] = _mm256_setzero_ps();
    /* a cache line of each key at a time (64 / esz columns): one prefetch of the next chunk's
     * keys (pages are scattered, so no hardware stream), then the line's steps unrolled */
    const int64_t L = 64 / esz, Dl = D - D % L;
    for (int64_t d0 = 0; d0 < D; d0 += L) {
        for (int j = 0; j < NK; j++) _mm_prefetch((const char *)pf[j] + d0 * esz, _MM_HINT_T0);
        int64_t d1 = d0 < Dl ? d0 + L : D;
#pragma GCC unroll 8
        for (int64_t d = d0; d < d1; d += 8) {
            __m256 kv[3];
            for (int j = 0; j < NK; j++) {
                kv[j] = load8(kr[j], d, type);
                __asm__("" : "+x"(kv[j])); /* one load per vector, kept in a register: GCC else
                                              folds it into each FMA (16 loads per 12 FMAs) */
            }
            for (int i = 0; i < NR; i++) {
                __m256 qv = _mm256_loadu_ps(qr[i] + d);
                __asm__("" : "+x"(qv));
                for (int j = 0; j < NK; j++)
                    acc[3 * i + j] = _mm256_fmadd_ps(qv, kv[j], acc[3 * i + j]);
            }
        }
    }
    float sums[16];
    _mm256_storeu_ps(sums, hsum8x(acc));
    _mm256_storeu_ps(sums + 8, hsum8x(acc + 8));
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < NK; j++) s[i * KB + kk0 + j] = sums[3 * i + j];
}

ALWAYS_INLINE void qk_rows_avx2(const float *const *qr, int nrows, const void *kbase,
                                const int64_t *off, const int64_t *next, int kk0, int kk1, int64_t D,
                                int type, float *s) {
    /* keys outer: three key rows stay in L1 while every row block uses them; 4 x 3 pairs are 12
     * accumulator chains, enough to cover the FMA latency */
    for (int kk = kk0; kk <= kk1; kk += 3) {
        int nk = kk1 - kk + 1 >= 3 ? 3 : kk1 - kk + 1;
        for (int r = 0; r < nrows; r += 4) {
            int nr = nrows - r < 4 ? nrows - r : 4;
            float *sr = s + r * KB;
            const float *const *q = qr + r;
            switch (nr * 4 + nk) { /* constant shapes unroll into registers */
            case 4 * 4 + 3: qk_block(q, 4, kbase, off, next, kk, 3, D, type, sr); break;
            case 4 * 4 + 2: qk_block(q, 4, kbase, off, next, kk, 2, D, type, sr); break;
            case 4 * 4 + 1: qk_block(q, 4, kbase, off, next, kk, 1, D, type, sr); break;
            case 3 * 4 + 3: qk_block(q, 3, kbase, off, next, kk, 3, D, type, sr); break;
            case 3 * 4 + 2: qk_block(q, 3, kbase, off, next, kk, 2, D, type, sr); break;
            case 3 * 4 + 1: qk_block(q, 3, kbase, off, next, kk, 1, D, type, sr); break;
            case 2 * 4 + 3: qk_block(q, 2, kbase, off, next, kk, 3, D, type, sr); break;
            case 2 * 4 + 2: qk_block(q, 2, kbase, off, next, kk, 2, D, type, sr); break;
            case 2 * 4 + 1: qk_block(q, 2, kbase, off, next, kk, 1, D, type, sr); break;
            case 1 * 4 + 3: qk_block(q, 1, kbase, off, next, kk, 3, D, type, sr); break;
            case 1 * 4 + 2: qk_block(q, 1, kbase, off, next, kk, 2, D, type, sr); break;
            default: qk_block(q, 1, kbase, off, next, kk, 1, D, type, sr); break;
            }
        }
    }
}

/* acc_r = acc_r * alpha_r + sum over kk0..kk1 (in order) of p[r][kk] * value(kk), for NR rows,
 * 8 x NV columns from d; vrow / vnext: each lane's value row in this chunk and the next */
ALWAYS_INLINE void pv_block(float *acc, int64_t D, int NR, const float *alpha, const float *p,
                            const uint8_t *const *vrow, const uint8_t *const *vnext, int kk0,
                            int kk1, int64_t d, int NV, int type) {
    __m256 a[4][3];
    int esz = KV_ESZ(type);
    for (int i = 0; i < NR; i++) {
        __m256 al = _mm256_set1_ps(alpha[i]);
        for (int c = 0; c < NV; c++)
            a[i][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + i * D + d + 8 * c), al);
    }
    for (int kk = kk0; kk <= kk1; kk++) {
        const uint8_t *vr = vrow[kk];
        _mm_prefetch((const char *)vnext[kk] + d * esz, _MM_HINT_T0);
        if (NV * 8 * esz > 64) _mm_prefetch((const char *)vnext[kk] + d * esz + 64, _MM_HINT_T0);
        __m256 vv[3];
        for (int c = 0; c < NV; c++) {
            vv[c] = load8(vr, d + 8 * c, type);
            __asm__("" : "+x"(vv[c]));
        }
        for (int i = 0; i < NR; i++) {
            __m256 pb = _mm256_broadcast_ss(p + i * KB + kk);
            for (int c = 0; c < NV; c++) a[i][c] = _mm256_fmadd_ps(pb, vv[c], a[i][c]);
        }
    }
    for (int i = 0; i < NR; i++)
        for (int c = 0; c < NV; c++) _mm256_storeu_ps(acc + i * D + d + 8 * c, a[i][c]);
}

ALWAYS_INLINE void pv_rows_avx2(float *acc, int nrows, int64_t D, const float *alpha,
                                const float *p, const void *vbase, const int64_t *off,
                                const int64_t *next, int kk0, int kk1, int type) {
    const uint8_t *vrow[KB], *vnext[KB];
    int esz = KV_ESZ(type);
    for (int kk = kk0; kk <= kk1; kk++) {
        vrow[kk] = (const uint8_t *)vbase + off[kk] * D * esz;
        vnext[kk] = (const uint8_t *)vbase + next[kk] * D * esz;
    }
    /* columns outer: a 24-column slice of the chunk's values stays in L1 for every row block */
    for (int64_t d = 0; d < D; d += 24) {
        int nv = D - d >= 24 ? 3 : (int)(D - d) / 8;
        for (int r = 0; r < nrows; r += 4) {
            int nr = nrows - r < 4 ? nrows - r : 4;
            float *ar = acc + r * D;
            const float *al = alpha + r, *pr = p + r * KB;
            switch (nr * 4 + nv) {
            case 4 * 4 + 3: pv_block(ar, D, 4, al, pr, vrow, vnext, kk0, kk1, d, 3, type); break;
            case 4 * 4 + 2: pv_block(ar, D, 4, al, pr, vrow, vnext, kk0, kk1, d, 2, type); break;
            case 4 * 4 + 1: pv_block(ar, D, 4, al, pr, vrow, vnext, kk0, kk1, d, 1, type); break;
            case 3 * 4 + 3: pv_block(ar, D, 3, al, pr, vrow, vnext, kk0, kk1, d, 3, type); break;
            case 3 * 4 + 2: pv_block(ar, D, 3, al, pr, vrow, vnext, kk0, kk1, d, 2, type); break;
            case 3 * 4 + 1: pv_block(ar, D, 3, al, pr, vrow, vnext, kk0, kk1, d, 1, type); break;
            case 2 * 4 + 3: pv_block(ar, D, 2, al, pr, vrow, vnext, kk0, kk1, d, 3, type); break;
            case 2 * 4 + 2: pv_block(ar, D, 2, al, pr, vrow, vnext, kk0, kk1, d, 2, type); break;
            case 2 * 4 + 1: pv_block(ar, D, 2, al, pr, vrow, vnext, kk0, kk1, d, 1, type); break;
            case 1 * 4 + 3: pv_block(ar, D, 1, al, pr, vrow, vnext, kk0, kk1, d, 3, type); break;
            case 1 * 4 + 2: pv_block(ar, D, 1, al, pr, vrow, vnext, kk0, kk1, d, 2, type); break;
            default: pv_block(ar, D, 1, al, pr, vrow, vnext, kk0, kk1, d, 1, type); break;
            }
        }
    }
}

/* one row's chunk: scores s[KB] (masked lanes -inf) -> probabilities (times vmul), new max/sum */
static void softmax_row_avx2(float *s, const float *kmul, const float *vmul, float scale,
                             float softcap, float *m, float *l, float *alpha) {
    const __m256 ninf = _mm256_set1_ps(NEG_INF);
    __m256 x[2], valid[2];
    for (int c = 0; c < 2; c++) {
        x[c] = _mm256_loadu_ps(s + 8 * c);
        valid[c] = _mm256_cmp_ps(x[c], ninf, _CMP_NEQ_OQ);
        if (kmul) x[c] = _mm256_mul_ps(x[c], _mm256_loadu_ps(kmul + 8 * c));
        x[c] = _mm256_mul_ps(x[c], _mm256_set1_ps(scale));
        if (softcap > 0) {
            __m256 cap = _mm256_set1_ps(softcap);
            x[c] = _mm256_mul_ps(tanh256(_mm256_div_ps(x[c], cap)), cap);
        }
        x[c] = _mm256_blendv_ps(ninf, x[c], valid[c]);
    }
    float mx = maxf(*m, hmax256(_mm256_max_ps(x[0], x[1])));
    *alpha = *m == NEG_INF ? 0.0f : exp1_avx2(*m - mx);
    __m256 mv = _mm256_set1_ps(mx), p[2];
    for (int c = 0; c < 2; c++) p[c] = _mm256_and_ps(exp256(_mm256_sub_ps(x[c], mv)), valid[c]);
    *l = *l * *alpha + hsum256(_mm256_add_ps(p[0], p[1]));
    *m = mx;
    for (int c = 0; c < 2; c++) {
        if (vmul) p[c] = _mm256_mul_ps(p[c], _mm256_loadu_ps(vmul + 8 * c));
        _mm256_storeu_ps(s + 8 * c, p[c]);
    }
}
#endif /* TIDAL_AVX2 */

/* ---------------------------------------------------------------- AVX-512 kernels
 * 16 lanes and 32 registers: a q.k block is 4 rows x 4 keys (16 accumulators, 8 loads per 16
 * FMAs), a p.v block 4 rows x 64 columns (16 accumulators, 4 value loads per 16 FMAs). */
#if TIDAL_AVX512
/* 16 elements of a page row as float; 8-bit codes before their scale (e4m3 also / 256, as
 * e4m3x8_div256) */
ALWAYS_INLINE __m512 load16(const void *base, int64_t i, int type) {
    switch (type) {
    case KV_F32: return _mm512_loadu_ps((const float *)base + i);
    case KV_BF16: {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case KV_F16:
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)));
    case KV_INT8:
        return _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)base + i))));
    default: {
        __m256i b =
            _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)((const uint8_t *)base + i)));
        __m256i mag = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7);
        __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
        return _mm512_cvtph_ps(_mm256_or_si256(mag, sign));
    }
    }
}

/* The 16 lane sums of v[0..15]; the sum of v[i] lands in lane 4 * (i % 4) + i / 4. Every one is
 * the same tree over its lanes x[0..15], whichever slot it sits in:
 *   a(l) = x[l] + x[l + 8], b(m) = a(m) + a(m + 4), c(n) = b(n) + b(n + 2), sum = c(0) + c(1) */
static inline __m512 hsum16x(const __m512 v[16]) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: a() of v[2i]; lanes 8-15: a() of v[2i + 1] */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* 128-bit block k: b() of v[4i + k] */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* block k: c(0), c(1) of v[8i + k], then of v[8i + 4 + k] */
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* the 16 scores of rows q[0..3] x keys kr[0..3]: row i's 4 in lanes 4i..4i+3. One accumulator
 * per pair, d in order, one tree (hsum16x): a pair's sum does not depend on its neighbours
 * (the caller repeats a row or key to fill a block and drops the copies). pf: the next chunk's
 * key rows to prefetch, or NULL. */
ALWAYS_INLINE __m512 qk_block512(const float *const q[4], const uint8_t *const kr[4],
                                 const uint8_t *const *pf, int64_t D, int type, int esz) {
    __m512 acc[16]; /* pair (row i, key j) in slot 4j + i: its sum lands in lane 4i + j */
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
        __m512 kv[4];
        if (pf && ((d * esz) & 63) == 0)
            for (int j = 0; j < 4; j++) _mm_prefetch((const char *)pf[j] + d * esz, _MM_HINT_T0);
        for (int j = 0; j < 4; j++) {
            kv[j] = load16(kr[j], d, type);
            __asm__("" : "+v"(kv[j])); /* one load per vector, kept in a register */
        }
        for (int i = 0; i < 4; i++) {
            __m512 qv = _mm512_loadu_ps(q[i] + d);
            __asm__("" : "+v"(qv));
            for (int j = 0; j < 4; j++) acc[4 * j + i] = _mm512_fmadd_ps(qv, kv[j], acc[4 * j + i]);
        }
    }
    return hsum16x(acc);
}

ALWAYS_INLINE void qk_rows512(const float *const *qr, int nrows, const void *kbase,
                              const int64_t *off, const int64_t *next, int kk0, int kk1, int64_t D,
                              int type, float *s) {
    int esz = KV_ESZ(type);
    /* rows outer: the chunk's keys stay in L1 while every row block passes over them */
    for (int r = 0; r < nrows; r += 4) {
        int nr = nrows - r < 4 ? nrows - r : 4;
        const float *q[4];
        for (int i = 0; i < 4; i++) q[i] = qr[r + (i < nr ? i : nr - 1)];
        for (int kk = kk0; kk <= kk1; kk += 4) {
            int nk = kk1 - kk + 1 < 4 ? kk1 - kk + 1 : 4;
            const uint8_t *kr[4], *pf[4];
            for (int j = 0; j < 4; j++) {
                int k = kk + (j < nk ? j : nk - 1);
                kr[j] = (const uint8_t *)kbase + off[k] * D * esz;
                pf[j] = (const uint8_t *)kbase + next[k] * D * esz;
            }
            float t[16];
            _mm512_storeu_ps(t, qk_block512(q, kr, r == 0 ? pf : NULL, D, type, esz));
            for (int i = 0; i < nr; i++)
                for (int j = 0; j < nk; j++) s[(r + i) * KB + kk + j] = t[4 * i + j];
        }
    }
}

/* acc_r = acc_r * alpha_r + sum over kk0..kk1 (in order) of p[r][kk] * value(kk), for 4 rows
 * (nr real, the rest repeat the last and are not stored), NV x 16 columns from d */
ALWAYS_INLINE void pv_block512(float *acc, int64_t D, int nr, const float *alpha, const float *p,
                               const void *vbase, const int64_t *off, const int64_t *next,
                               int kk0, int kk1, int64_t d, int NV, int type, int prefetch) {
    __m512 a[4][4];
    int esz = KV_ESZ(type);
    int ri[4];
    for (int i = 0; i < 4; i++) ri[i] = i < nr ? i : nr - 1;
    for (int i = 0; i < 4; i++) {
        __m512 al = _mm512_set1_ps(alpha[ri[i]]);
        for (int c = 0; c < NV; c++)
            a[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + ri[i] * D + d + 16 * c), al);
    }
    for (int kk = kk0; kk <= kk1; kk++) {
        const uint8_t *vr = (const uint8_t *)vbase + off[kk] * D * esz;
        if (prefetch)
            for (int c = 0; c < NV; c++)
                if ((((d + 16 * c) * esz) & 63) == 0)
                    _mm_prefetch((const char *)vbase + (next[kk] * D + d + 16 * c) * esz,
                                 _MM_HINT_T0);
        __m512 vv[4];
        for (int c = 0; c < NV; c++) vv[c] = load16(vr, d + 16 * c, type);
        for (int i = 0; i < 4; i++) {
            __m512 pb = _mm512_set1_ps(p[ri[i] * KB + kk]);
            for (int c = 0; c < NV; c++) a[i][c] = _mm512_fmadd_ps(pb, vv[c], a[i][c]);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(acc + i * D + d + 16 * c, a[i][c]);
}

ALWAYS_INLINE void pv_rows512(float *acc, int nrows, int64_t D, const float *alpha,
                              const float *p, const void *vbase, const int64_t *off,
                              const int64_t *next, int kk0, int kk1, int type) {
    /* columns outer: a 64-column slice of the chunk's values stays in L1 for every row block */
    for (int64_t d = 0; d < D; d += 64) {
        int nv = D - d >= 64 ? 4 : (int)((D - d) / 16);
        for (int r = 0; r < nrows; r += 4) {
            int nr = nrows - r < 4 ? nrows - r : 4, pf = r == 0;
            float *ar = acc + r * D;
            const float *al = alpha + r, *pr = p + r * KB;
            switch (nv) { /* constant shapes unroll into registers */
            case 4: pv_block512(ar, D, nr, al, pr, vbase, off, next, kk0, kk1, d, 4, type, pf); break;
            case 3: pv_block512(ar, D, nr, al, pr, vbase, off, next, kk0, kk1, d, 3, type, pf); break;
            case 2: pv_block512(ar, D, nr, al, pr, vbase, off, next, kk0, kk1, d, 2, type, pf); break;
            default: pv_block512(ar, D, nr, al, pr, vbase, off, next, kk0, kk1, d, 1, type, pf); break;
            }
        }
    }
}

/* the same Cephes expf as exp_s, 16 lanes */
static inline __m512 exp512(__m512 x) {
    return cephes_exp512(
        _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(EXP_HI)), _mm512_set1_ps(EXP_LO)));
}

static inline __m512 tanh512(__m512 x) {
    __m512 ax = _mm512_abs_ps(x);
    __m512 z = _mm512_mul_ps(x, x);
    __m512 p = _mm512_set1_ps(TANH_P0);
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(TANH_P1));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(TANH_P2));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(TANH_P3));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(TANH_P4));
    __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), x, x);
    __m512 e = exp512(_mm512_add_ps(ax, ax));
    __m512 big = _mm512_sub_ps(_mm512_set1_ps(1.0f),
                               _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
    big = _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(big),
        _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u))));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(ax, _mm512_set1_ps(TANH_SMALL), _CMP_LT_OQ), big,
                                small);
}

/* one row's chunk: scores s[KB] (masked lanes -inf) -> probabilities (times vmul), new max/sum */
static void softmax_row_avx512(float *s, const float *kmul, const float *vmul, float scale,
                               float softcap, float *m, float *l, float *alpha) {
    const __m512 ninf = _mm512_set1_ps(NEG_INF);
    __m512 x = _mm512_loadu_ps(s);
    __mmask16 valid = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
    if (kmul) x = _mm512_mul_ps(x, _mm512_loadu_ps(kmul));
    x = _mm512_mul_ps(x, _mm512_set1_ps(scale));
    if (softcap > 0) {
        __m512 cap = _mm512_set1_ps(softcap);
        x = _mm512_mul_ps(tanh512(_mm512_div_ps(x, cap)), cap);
    }
    x = _mm512_mask_blend_ps(valid, ninf, x);
    float mx = maxf(*m, _mm512_reduce_max_ps(x));
    *alpha = *m == NEG_INF ? 0.0f : exp1_avx2(*m - mx);
    __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(x, _mm512_set1_ps(mx))));
    *l = *l * *alpha + _mm512_reduce_add_ps(p);
    *m = mx;
    if (vmul) p = _mm512_mul_ps(p, _mm512_loadu_ps(vmul));
    _mm512_storeu_ps(s, p);
}
/* hsum16x's tree with max: the 16 lane maxima of v[0..15] (exact in any order), same lanes */
static inline __m512 hmax16x(const __m512 v[16]) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_max_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_max_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_max_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_max_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* hsum16x / hmax16x's result with the value of v[i] in lane i */
static inline __m512 slots_in_order(__m512 z) {
    const __m512i idx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(idx, z);
}

/* One chunk's softmax step for n <= 16 rows at once (row i at sc + i * KB, keys lo[i]..pos[i],
 * lanes kk0..kk1 of a chunk at key position cc): the scores become probabilities (times vmul,
 * zero on other lanes) and each row's max, sum and alpha (the rescale of its accumulator) are
 * updated. Every row takes the same operations whatever n and its slot: the row reductions are
 * hsum16x's and hmax16x's trees (the slots past n repeat the last row and are dropped). */
static void softmax_rows512(float *sc, int n, const int64_t *lo, const int64_t *pos, int64_t cc,
                            int kk0, int kk1, const float *kmul, const float *vmul, float scale,
                            float softcap, float *m, float *l, float *alpha) {
    const __m512 ninf = _mm512_set1_ps(NEG_INF);
    __m512 x[16];
    __mmask16 valid[16];
    for (int i = 0; i < 16; i++) {
        int r = i < n ? i : n - 1;
        int64_t a = lo[r] - cc > kk0 ? lo[r] - cc : kk0, b = pos[r] - cc < kk1 ? pos[r] - cc : kk1;
        valid[i] = a > b ? 0 : (__mmask16)(((2u << b) - 1u) & ~((1u << a) - 1u));
        __m512 v = _mm512_loadu_ps(sc + r * KB);
        if (kmul) v = _mm512_mul_ps(v, _mm512_loadu_ps(kmul));
        v = _mm512_mul_ps(v, _mm512_set1_ps(scale));
        if (softcap > 0) {
            __m512 cap = _mm512_set1_ps(softcap);
            v = _mm512_mul_ps(tanh512(_mm512_div_ps(v, cap)), cap);
        }
        x[i] = _mm512_mask_blend_ps(valid[i], ninf, v);
    }
    __mmask16 rows = (__mmask16)((1u << n) - 1u);
    __m512 mv = _mm512_mask_loadu_ps(ninf, rows, m);
    __m512 mx = _mm512_max_ps(mv, slots_in_order(hmax16x(x)));
    __m512 al = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(mv, ninf, _CMP_NEQ_OQ),
                                    exp512(_mm512_sub_ps(mv, mx)));
    float mxs[16];
    _mm512_storeu_ps(mxs, mx);
    for (int i = 0; i < 16; i++)
        x[i] = _mm512_maskz_mov_ps(valid[i], exp512(_mm512_sub_ps(x[i], _mm512_set1_ps(mxs[i]))));
    __m512 lv = _mm512_maskz_loadu_ps(rows, l);
    lv = _mm512_add_ps(_mm512_mul_ps(lv, al), slots_in_order(hsum16x(x)));
    _mm512_mask_storeu_ps(m, rows, mx);
    _mm512_mask_storeu_ps(l, rows, lv);
    _mm512_mask_storeu_ps(alpha, rows, al);
    for (int i = 0; i < n; i++)
        _mm512_storeu_ps(sc + i * KB, vmul ? _mm512_mul_ps(x[i], _mm512_loadu_ps(vmul)) : x[i]);
}
#endif /* TIDAL_AVX512 */

/* ---------------------------------------------------------------- scalar kernels */

static void qk_rows_scalar(const float *const *qr, int nrows, const void *kbase, const int64_t *off,
                           int kk0, int kk1, int64_t D, int type, float *s) {
    for (int r = 0; r < nrows; r++)
        for (int kk = kk0; kk <= kk1; kk++) {
            float t = 0.0f;
            for (int64_t d = 0; d < D; d++) t += qr[r][d] * load1(kbase, off[kk] * D + d, type);
            s[r * KB + kk] = t;
        }
}

static void pv_rows_scalar(float *acc, int nrows, int64_t D, const float *alpha, const float *p,
                           const void *vbase, const int64_t *off, int kk0, int kk1, int type) {
    for (int r = 0; r < nrows; r++) {
        float *a = acc + r * D;
        for (int64_t d = 0; d < D; d++) a[d] *= alpha[r];
        for (int kk = kk0; kk <= kk1; kk++) {
            float pk = p[r * KB + kk];
            for (int64_t d = 0; d < D; d++) a[d] += pk * load1(vbase, off[kk] * D + d, type);
        }
    }
}

static void softmax_row_scalar(float *s, const float *kmul, const float *vmul, float scale,
                               float softcap, float *m, float *l, float *alpha) {
    float mx = *m, sum = 0.0f;
    for (int kk = 0; kk < KB; kk++) {
        if (s[kk] == NEG_INF) continue;
        float x = s[kk];
        if (kmul) x *= kmul[kk];
        x *= scale;
        if (softcap > 0) x = tanh_s(x / softcap) * softcap;
        s[kk] = x;
        mx = maxf(mx, x);
    }
    *alpha = *m == NEG_INF ? 0.0f : exp_s(*m - mx);
    for (int kk = 0; kk < KB; kk++) {
        float pk = s[kk] == NEG_INF ? 0.0f : exp_s(s[kk] - mx);
        sum += pk;
        s[kk] = vmul ? pk * vmul[kk] : pk;
    }
    *l = *l * *alpha + sum;
    *m = mx;
}

/* ---------------------------------------------------------------- the driver */

/* keys (values) of lanes kk0..kk1 at rows off[] of kb (vb), stored as `type` */
static void qk_rows(const prm_t *P, const void *kb, int type, const int64_t *off,
                    const int64_t *next, const float *const *qr, int nrows, int kk0, int kk1,
                    float *s) {
    int64_t D = P->D;
#if TIDAL_AVX512
    if (P->isa == ISA_AVX512) {
        switch (type) {
        case KV_F32: qk_rows512(qr, nrows, kb, off, next, kk0, kk1, D, KV_F32, s); return;
        case KV_BF16: qk_rows512(qr, nrows, kb, off, next, kk0, kk1, D, KV_BF16, s); return;
        case KV_F16: qk_rows512(qr, nrows, kb, off, next, kk0, kk1, D, KV_F16, s); return;
        case KV_INT8: qk_rows512(qr, nrows, kb, off, next, kk0, kk1, D, KV_INT8, s); return;
        default: qk_rows512(qr, nrows, kb, off, next, kk0, kk1, D, KV_FP8, s); return;
        }
    }
#endif
#if TIDAL_AVX2
    if (P->isa == ISA_AVX2) {
        switch (type) {
        case KV_F32: qk_rows_avx2(qr, nrows, kb, off, next, kk0, kk1, D, KV_F32, s); return;
        case KV_BF16: qk_rows_avx2(qr, nrows, kb, off, next, kk0, kk1, D, KV_BF16, s); return;
        case KV_F16: qk_rows_avx2(qr, nrows, kb, off, next, kk0, kk1, D, KV_F16, s); return;
        case KV_INT8: qk_rows_avx2(qr, nrows, kb, off, next, kk0, kk1, D, KV_INT8, s); return;
        default: qk_rows_avx2(qr, nrows, kb, off, next, kk0, kk1, D, KV_FP8, s); return;
        }
    }
#endif
    (void)next;
    qk_rows_scalar(qr, nrows, kb, off, kk0, kk1, D, type, s);
}

static void pv_rows(const prm_t *P, const void *vb, int type, const int64_t *off,
                    const int64_t *next, float *acc, int nrows, const float *alpha,
                    const float *p, int kk0, int kk1) {
    int64_t D = P->D;
#if TIDAL_AVX512
    if (P->isa == ISA_AVX512) {
        switch (type) {
        case KV_F32: pv_rows512(acc, nrows, D, alpha, p, vb, off, next, kk0, kk1, KV_F32); return;
        case KV_BF16: pv_rows512(acc, nrows, D, alpha, p, vb, off, next, kk0, kk1, KV_BF16); return;
        case KV_F16: pv_rows512(acc, nrows, D, alpha, p, vb, off, next, kk0, kk1, KV_F16); return;
        case KV_INT8: pv_rows512(acc, nrows, D, alpha, p, vb, off, next, kk0, kk1, KV_INT8); return;
        default: pv_rows512(acc, nrows, D, alpha, p, vb, off, next, kk0, kk1, KV_FP8); return;
        }
    }
#endif
#if TIDAL_AVX2
    if (P->isa == ISA_AVX2) {
        switch (type) {
        case KV_F32: pv_rows_avx2(acc, nrows, D, alpha, p, vb, off, next, kk0, kk1, KV_F32); return;
        case KV_BF16: pv_rows_avx2(acc, nrows, D, alpha, p, vb, off, next, kk0, kk1, KV_BF16); return;
        case KV_F16: pv_rows_avx2(acc, nrows, D, alpha, p, vb, off, next, kk0, kk1, KV_F16); return;
        case KV_INT8: pv_rows_avx2(acc, nrows, D, alpha, p, vb, off, next, kk0, kk1, KV_INT8); return;
        default: pv_rows_avx2(acc, nrows, D, alpha, p, vb, off, next, kk0, kk1, KV_FP8); return;
        }
    }
#endif
    (void)next;
    pv_rows_scalar(acc, nrows, D, alpha, p, vb, off, kk0, kk1, type);
}

#if TIDAL_AVX2
ALWAYS_INLINE void widen_rows(const void *base, const int64_t *off, const int64_t *next, int kk0,
                              int kk1, int64_t D, int type, float *buf) {
    int esz = KV_ESZ(type);
    for (int kk = kk0; kk <= kk1; kk++) {
        const uint8_t *src = (const uint8_t *)base + off[kk] * D * esz;
        for (int64_t d = 0; d < D; d += 8) {
            if (((d * esz) & 63) == 0)
                _mm_prefetch((const char *)base + (next[kk] * D + d) * esz, _MM_HINT_T0);
            _mm256_storeu_ps(buf + kk * D + d, load8(src, d, type));
        }
    }
}

/* rows off[kk0..kk1] of 16- or 8-bit pages as float32 rows kk of buf: exact, so reading buf
 * gives the very sums that reading the pages would (e4m3 as value / 256, as load8 gives it) */
static void widen_chunk(const void *base, int type, const int64_t *off, const int64_t *next,
                        int kk0, int kk1, int64_t D, float *buf) {
    switch (type) {
    case KV_BF16: widen_rows(base, off, next, kk0, kk1, D, KV_BF16, buf); return;
    case KV_F16: widen_rows(base, off, next, kk0, kk1, D, KV_F16, buf); return;
    case KV_INT8: widen_rows(base, off, next, kk0, kk1, D, KV_INT8, buf); return;
    default: widen_rows(base, off, next, kk0, kk1, D, KV_FP8, buf); return;
    }
}

static const int64_t LANES[KB] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#endif

static void softmax_row(const prm_t *P, float *s, const float *kmul, const float *vmul, float *m,
                        float *l, float *alpha) {
#if TIDAL_AVX512
    if (P->isa == ISA_AVX512) {
        softmax_row_avx512(s, kmul, vmul, P->scale, P->softcap, m, l, alpha);
        return;
    }
#endif
#if TIDAL_AVX2
    if (P->isa == ISA_AVX2) {
        softmax_row_avx2(s, kmul, vmul, P->scale, P->softcap, m, l, alpha);
        return;
    }
#endif
    softmax_row_scalar(s, kmul, vmul, P->scale, P->softcap, m, l, alpha);
}

static inline float exp_isa(const prm_t *P, float x) {
#if TIDAL_AVX2
    if (P->isa >= ISA_AVX2) return exp1_avx2(x); /* AVX-512 folds segments as AVX2 does */
#endif
    (void)P;
    return exp_s(x);
}

/* (tm, tl, tacc) <- fold of itself and a segment's (cm, cl, cacc); an empty state has m = -inf */
static void fold(const prm_t *P, float *tm, float *tl, float *tacc, float cm, float cl,
                 const float *cacc) {
    int64_t D = P->D;
    if (cm == NEG_INF) return;
    if (*tm == NEG_INF) {
        *tm = cm, *tl = cl;
        memcpy(tacc, cacc, sizeof(float) * (size_t)D);
        return;
    }
    float m = maxf(*tm, cm);
    float a1 = exp_isa(P, *tm - m), a2 = exp_isa(P, cm - m);
    *tl = *tl * a1 + cl * a2;
    *tm = m;
    int64_t d = 0;
#if TIDAL_AVX2
    if (P->isa >= ISA_AVX2) {
        __m256 v1 = _mm256_set1_ps(a1), v2 = _mm256_set1_ps(a2);
        for (; d + 8 <= D; d += 8)
            _mm256_storeu_ps(tacc + d, _mm256_fmadd_ps(_mm256_loadu_ps(cacc + d), v2,
                                                       _mm256_mul_ps(_mm256_loadu_ps(tacc + d), v1)));
    }
#endif
    for (; d < D; d++) tacc[d] = tacc[d] * a1 + cacc[d] * a2;
}

static void finish_row(const prm_t *P, float l, const float *acc, float *out) {
    for (int64_t d = 0; d < P->D; d++) out[d] = acc[d] / l;
}

/* the rows of tile tl: positions, bounds, query pointers; returns the row count */
static int tile_rows(const prm_t *P, const tile_t *tl, scr_t *w) {
    int G = P->G, R = tl->nq * G;
    int64_t i = tl->seq, p0 = (int64_t)P->ctx[i] - P->qlen[i] + tl->j0;
    for (int r = 0; r < R; r++) {
        int64_t jj = r / G, hh = r % G, p = p0 + jj;
        int64_t t = (int64_t)P->qstart[i] + tl->j0 + jj;
        w->pos[r] = p;
        w->lo[r] = P->window > 0 && p - P->window + 1 > 0 ? p - P->window + 1 : 0;
        w->qr[r] = P->q + t * P->ldq + ((int64_t)tl->g * G + hh) * P->D;
    }
    return R;
}

/* dst[kk] = the page row (slot * KVH + g) of key c0 + kk, for the keys in [a, b] */
static void lane_rows(const prm_t *P, const int64_t *table, int64_t g, int64_t c0, int64_t a,
                      int64_t b, int64_t *dst) {
    int64_t first = c0 > a ? c0 : a, last = c0 + KB - 1 < b ? c0 + KB - 1 : b;
    for (int64_t pos = first; pos <= last; pos++)
        dst[pos - c0] = (table[pos / P->BS] * P->BS + pos % P->BS) * P->KVH + g;
}

/* the current-segment state of every row of the tile over segment s */
static void run_segment(const prm_t *P, const tile_t *tl, int R, int64_t s, scr_t *w) {
    int G = P->G;
    int64_t D = P->D, nq = tl->nq;
    for (int r = 0; r < R; r++) w->cm[r] = NEG_INF, w->cl[r] = 0.0f;
    memset(w->cacc, 0, sizeof(float) * (size_t)(R * D));
    int64_t a = s * SEG > w->lo[0] ? s * SEG : w->lo[0];
    int64_t b = s * SEG + SEG - 1 < w->pos[R - 1] ? s * SEG + SEG - 1 : w->pos[R - 1];
    int64_t p0 = w->pos[0];
    const int64_t *table = P->tables + (int64_t)tl->seq * P->W;
    int quant = P->type == KV_INT8 || P->type == KV_FP8;
    float qmul = P->type == KV_FP8 && P->isa >= ISA_AVX2 ? 256.0f : 1.0f; /* e4m3x8_div256 */
    int64_t c0 = a - a % KB;
    lane_rows(P, table, tl->g, c0, a, b, w->off);
    for (; c0 <= b; c0 += KB) {
        int64_t ka = c0 > a ? c0 : a, kb = c0 + KB - 1 < b ? c0 + KB - 1 : b;
        int kk0 = (int)(ka - c0), kk1 = (int)(kb - c0);
        int more = c0 + KB <= b;
        if (more) lane_rows(P, table, tl->g, c0 + KB, c0 + KB, b, w->next);
        for (int kk = 0; kk < KB; kk++) /* lanes without a next key re-touch a current one */
            if (!more || c0 + KB + kk > b) w->next[kk] = w->off[kk0];
        /* the queries whose [lo, p] meet [ka, kb]: p >= ka, and lo <= kb */
        int64_t qa = ka - p0 > 0 ? ka - p0 : 0;
        int64_t qb = nq - 1;
        if (P->window > 0 && kb + P->window - 1 - p0 < qb) qb = kb + P->window - 1 - p0;
        if (qa > qb) { /* cannot happen: every key of [lo_0, p_last] has a query */
            memcpy(w->off, w->next, sizeof w->off);
            continue;
        }
        int ra = (int)(qa * G), rb = (int)((qb + 1) * G), nr = rb - ra;
        if (quant) /* each key's and value's scale; 0 on lanes outside the chunk */
            for (int kk = 0; kk < KB; kk++) {
                int in = kk >= kk0 && kk <= kk1;
                w->kmul[kk] = in ? P->ks[w->off[kk]] * qmul : 0.0f;
                w->vmul[kk] = in ? P->vs[w->off[kk]] * qmul : 0.0f;
            }
        float *sc = w->sc + ra * KB;
        if (kk0 > 0 || kk1 < KB - 1) /* lanes outside the chunk's keys: masked */
            for (int r = 0; r < nr; r++)
                for (int kk = 0; kk < KB; kk++)
                    if (kk < kk0 || kk > kk1) sc[r * KB + kk] = NEG_INF;
        const void *kbase = P->kp, *vbase = P->vp;
        const int64_t *off = w->off, *next = w->next;
        int type = P->type;
#if TIDAL_AVX2
        if (nr > 4 && ((P->isa == ISA_AVX2 && type == KV_FP8) ||
                       (P->isa == ISA_AVX512 && type != KV_F32))) {
            /* more than one block of 4 rows would each convert the chunk: convert it once
             * (on AVX2 e4m3 only: int8 and bfloat16 convert in 2 instructions, cheaper than a
             * copy there; AVX-512 tiles have many more row blocks per chunk) */
            widen_chunk(P->kp, type, off, next, kk0, kk1, D, w->kbuf);
            widen_chunk(P->vp, type, off, next, kk0, kk1, D, w->vbuf);
            kbase = w->kbuf, vbase = w->vbuf, off = next = LANES, type = KV_F32;
        }
#endif
        qk_rows(P, kbase, type, off, next, w->qr + ra, nr, kk0, kk1, sc);
        for (int r = 0; r < nr; r++) {
            int64_t lo = w->lo[ra + r], p = w->pos[ra + r];
            float *sr = sc + r * KB;
            int64_t m0 = lo - c0, m1 = p - c0; /* lanes outside [m0, m1]: not this row's keys */
            for (int kk = kk0; kk <= kk1 && kk < m0; kk++) sr[kk] = NEG_INF;
            for (int kk = kk1; kk >= kk0 && kk > m1; kk--) sr[kk] = NEG_INF;
            softmax_row(P, sr, quant ? w->kmul : NULL, quant ? w->vmul : NULL, &w->cm[ra + r],
                        &w->cl[ra + r], &w->alpha[ra + r]);
        }
        pv_rows(P, vbase, type, off, next, w->cacc + ra * D, nr, w->alpha + ra, sc, kk0, kk1);
        memcpy(w->off, w->next, sizeof w->off);
    }
}

#if TIDAL_AVX512
/* p.v over a group of chunks for 4 rows (nr real) x NV x 16 columns from d: per chunk c in order,
 * acc = acc * alpha_c, then acc += p_c[kk] * value_c(kk) for kk in order: the op sequence of a
 * chunk at a time, with the accumulators kept in registers across the group's chunks */
ALWAYS_INLINE void pv_group_block512(float *acc, int64_t D, int nr, const float *alpha,
                                     const float *p, int64_t cstride, const chunk512_t *ch,
                                     int nc, const void *vbase, const int64_t *pfoff, int64_t d,
                                     int NV, int type) {
    __m512 a[4][4];
    int esz = KV_ESZ(type);
    int ri[4];
    for (int i = 0; i < 4; i++) ri[i] = i < nr ? i : nr - 1;
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < NV; c++) a[i][c] = _mm512_loadu_ps(acc + ri[i] * D + d + 16 * c);
    for (int g = 0; g < nc; g++) {
        const float *al = alpha + g * cstride / KB, *pg = p + g * cstride;
        for (int i = 0; i < 4; i++) {
            __m512 av = _mm512_set1_ps(al[ri[i]]);
            for (int c = 0; c < NV; c++) a[i][c] = _mm512_mul_ps(a[i][c], av);
        }
        const uint8_t *vb = (const uint8_t *)ch[g].vbase;
        for (int kk = ch[g].kk0; kk <= ch[g].kk1; kk++) {
            const uint8_t *vr = vb + ch[g].voff[kk] * D * esz;
            if (pfoff)
                for (int c = 0; c < NV; c++)
                    if ((((d + 16 * c) * esz) & 63) == 0)
                        _mm_prefetch((const char *)vbase + (pfoff[kk] * D + d + 16 * c) * esz,
                                     _MM_HINT_T0);
            __m512 vv[4];
            for (int c = 0; c < NV; c++) vv[c] = load16(vr, d + 16 * c, type);
            for (int i = 0; i < 4; i++) {
                __m512 pb = _mm512_set1_ps(pg[ri[i] * KB + kk]);
                for (int c = 0; c < NV; c++) a[i][c] = _mm512_fmadd_ps(pb, vv[c], a[i][c]);
            }
        }
    }
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(acc + i * D + d + 16 * c, a[i][c]);
}

ALWAYS_INLINE void pv_group512(float *acc, int ra, int rb, int64_t D, const float *alpha,
                               const float *p, int64_t cstride, const chunk512_t *ch, int nc,
                               const void *vbase, const int64_t *pfoff, int type) {
    /* columns outer: a 64-column slice of the group's values stays in L1 for every row block */
    for (int64_t d = 0; d < D; d += 64) {
        int nv = D - d >= 64 ? 4 : (int)((D - d) / 16);
        for (int r = ra; r < rb; r += 4) {
            int nr = rb - r < 4 ? rb - r : 4;
            const int64_t *pf = r == ra ? pfoff : NULL;
            float *ar = acc + r * D;
            const float *al = alpha + r, *pr = p + r * KB;
            switch (nv) { /* constant shapes unroll into registers */
            case 4: pv_group_block512(ar, D, nr, al, pr, cstride, ch, nc, vbase, pf, d, 4, type); break;
            case 3: pv_group_block512(ar, D, nr, al, pr, cstride, ch, nc, vbase, pf, d, 3, type); break;
            case 2: pv_group_block512(ar, D, nr, al, pr, cstride, ch, nc, vbase, pf, d, 2, type); break;
            default: pv_group_block512(ar, D, nr, al, pr, cstride, ch, nc, vbase, pf, d, 1, type); break;
            }
        }
    }
}

static void pv_group(const prm_t *P, int type, float *acc, int ra, int rb, const float *alpha,
                     const float *p, int64_t cstride, const chunk512_t *ch, int nc,
                     const void *vbase, const int64_t *pfoff) {
    int64_t D = P->D;
    switch (type) {
    case KV_F32: pv_group512(acc, ra, rb, D, alpha, p, cstride, ch, nc, vbase, pfoff, KV_F32); return;
    case KV_BF16: pv_group512(acc, ra, rb, D, alpha, p, cstride, ch, nc, vbase, pfoff, KV_BF16); return;
    case KV_F16: pv_group512(acc, ra, rb, D, alpha, p, cstride, ch, nc, vbase, pfoff, KV_F16); return;
    case KV_INT8: pv_group512(acc, ra, rb, D, alpha, p, cstride, ch, nc, vbase, pfoff, KV_INT8); return;
    default: pv_group512(acc, ra, rb, D, alpha, p, cstride, ch, nc, vbase, pfoff, KV_FP8); return;
    }
}

/* run_segment on the AVX-512 path: the same chunks, each row's softmax updates and p.v sums in
 * the same order, but NCH chunks' scores first, then one p.v pass over the group (its
 * accumulators loaded and stored once per group, not per chunk). A row of the group that does
 * not meet one of its chunks takes that chunk as alpha = 1 and p = 0, which leaves its sums
 * exactly as they are, as if the chunk had been skipped. */
static void run_segment512(const prm_t *P, const tile_t *tl, int R, int64_t s, scr_t *w) {
    int G = P->G;
    int64_t D = P->D, nq = tl->nq, cstride = (int64_t)R * KB;
    for (int r = 0; r < R; r++) w->cm[r] = NEG_INF, w->cl[r] = 0.0f;
    memset(w->cacc, 0, sizeof(float) * (size_t)(R * D));
    int64_t a = s * SEG > w->lo[0] ? s * SEG : w->lo[0];
    int64_t b = s * SEG + SEG - 1 < w->pos[R - 1] ? s * SEG + SEG - 1 : w->pos[R - 1];
    int64_t p0 = w->pos[0];
    const int64_t *table = P->tables + (int64_t)tl->seq * P->W;
    int quant = P->type == KV_INT8 || P->type == KV_FP8;
    float qmul = P->type == KV_FP8 ? 256.0f : 1.0f; /* load16 gives e4m3 / 256 */
    /* a tile of more than one row block converts 16- and 8-bit chunks to float once */
    int widen = P->type != KV_F32 && R > 4;
    int type = widen ? KV_F32 : P->type;
    int64_t c0 = a - a % KB;
    lane_rows(P, table, tl->g, c0, a, b, w->goff[0]);
    while (c0 <= b) {
        chunk512_t ch[NCH];
        int nc = 0, ra = R, rb = 0;
        for (; nc < NCH && c0 + nc * KB <= b; nc++) {
            int64_t cc = c0 + nc * KB;
            int64_t ka = cc > a ? cc : a, kb = cc + KB - 1 < b ? cc + KB - 1 : b;
            int kk0 = (int)(ka - cc), kk1 = (int)(kb - cc);
            int64_t *off = w->goff[nc], *next = w->goff[nc + 1];
            int more = cc + KB <= b;
            if (more) lane_rows(P, table, tl->g, cc + KB, cc + KB, b, next);
            for (int kk = 0; kk < KB; kk++)
                if (!more || cc + KB + kk > b) next[kk] = off[kk0];
            /* the queries whose [lo, p] meet [ka, kb]: p >= ka, and lo <= kb */
            int64_t qa = ka - p0 > 0 ? ka - p0 : 0, qb = nq - 1;
            if (P->window > 0 && kb + P->window - 1 - p0 < qb) qb = kb + P->window - 1 - p0;
            int cra = (int)(qa * G), crb = qa > qb ? cra : (int)((qb + 1) * G), nr = crb - cra;
            float *kmul = w->kmul4[nc], *vmul = w->vmul4[nc];
            if (quant)
                for (int kk = 0; kk < KB; kk++) {
                    int in = kk >= kk0 && kk <= kk1;
                    kmul[kk] = in ? P->ks[off[kk]] * qmul : 0.0f;
                    vmul[kk] = in ? P->vs[off[kk]] * qmul : 0.0f;
                }
            float *sc = w->sc + nc * cstride;
            const void *kbase = P->kp;
            const int64_t *koff = off, *knext = next;
            ch[nc] = (chunk512_t){P->vp, off, kk0, kk1, cra, crb};
            if (widen) {
                float *vbuf = w->vbuf + (int64_t)nc * KB * D;
                widen_chunk(P->kp, P->type, off, next, kk0, kk1, D, w->kbuf);
                widen_chunk(P->vp, P->type, off, next, kk0, kk1, D, vbuf);
                kbase = w->kbuf, koff = knext = LANES;
                ch[nc].vbase = vbuf, ch[nc].voff = LANES;
            }
            if (nr <= 0) continue;
            ra = cra < ra ? cra : ra, rb = crb > rb ? crb : rb;
            /* scores on lanes kk0..kk1 (the others are masked below, whatever they hold) */
            qk_rows(P, kbase, type, koff, knext, w->qr + cra, nr, kk0, kk1, sc + cra * KB);
            for (int r = cra; r < crb; r += 16)
                softmax_rows512(sc + r * KB, crb - r < 16 ? crb - r : 16, w->lo + r, w->pos + r,
                                cc, kk0, kk1, quant ? kmul : NULL, quant ? vmul : NULL, P->scale,
                                P->softcap, w->cm + r, w->cl + r, w->alpha + nc * R + r);
        }
        if (ra < rb) {
            for (int g = 0; g < nc; g++) /* rows of the group that miss chunk g: exact no-ops */
                for (int r = ra; r < rb; r++)
                    if (r < ch[g].ra || r >= ch[g].rb || ch[g].ra >= ch[g].rb) {
                        w->alpha[g * R + r] = 1.0f;
                        for (int kk = 0; kk < KB; kk++) w->sc[g * cstride + r * KB + kk] = 0.0f;
                    }
            pv_group(P, widen ? KV_F32 : P->type, w->cacc, ra, rb, w->alpha, w->sc, cstride, ch,
                     nc, P->vp, widen ? NULL : w->goff[nc]);
        }
        c0 += (int64_t)nc * KB;
        memcpy(w->goff[0], w->goff[nc], sizeof w->goff[0]);
    }
}
#endif

static void run_segment_isa(const prm_t *P, const tile_t *tl, int R, int64_t s, scr_t *w) {
#if TIDAL_AVX512
    if (P->isa == ISA_AVX512) {
        run_segment512(P, tl, R, s, w);
        return;
    }
#endif
    run_segment(P, tl, R, s, w);
}

/* a whole tile: its segments in order, folded, written to out */
static void run_tile(const prm_t *P, const tile_t *tl, scr_t *w) {
    int R = tile_rows(P, tl, w);
    int64_t D = P->D;
    for (int r = 0; r < R; r++) w->tm[r] = NEG_INF, w->tl[r] = 0.0f;
    for (int64_t s = tl->seg0; s < tl->seg1; s++) {
        run_segment_isa(P, tl, R, s, w);
        for (int r = 0; r < R; r++)
            fold(P, &w->tm[r], &w->tl[r], w->tacc + r * D, w->cm[r], w->cl[r], w->cacc + r * D);
    }
    for (int r = 0; r < R; r++) {
        int64_t t = (int64_t)P->qstart[tl->seq] + tl->j0 + r / P->G;
        int64_t h = (int64_t)tl->g * P->G + r % P->G;
        finish_row(P, w->tl[r], w->tacc + r * D, P->out + (t * P->H + h) * D);
    }
}

/* one segment of a split tile: every row's state (m, l, acc[D]) into its slot of `part` */
static void run_part(const prm_t *P, const tile_t *tl, int64_t s, float *part, scr_t *w) {
    int R = tile_rows(P, tl, w);
    int64_t D = P->D;
    run_segment_isa(P, tl, R, s, w);
    float *dst = part + tl->part + (s - tl->seg0) * R * (D + 2);
    for (int r = 0; r < R; r++, dst += D + 2) {
        dst[0] = w->cm[r], dst[1] = w->cl[r];
        memcpy(dst + 2, w->cacc + r * D, sizeof(float) * (size_t)D);
    }
}

/* a split tile's segments folded in order, as run_tile folds them */
static void merge_parts(const prm_t *P, const tile_t *tl, const float *part, scr_t *w) {
    int R = tl->nq * P->G;
    int64_t D = P->D;
    for (int r = 0; r < R; r++) {
        float m = NEG_INF, l = 0.0f;
        for (int64_t s = tl->seg0; s < tl->seg1; s++) {
            const float *src = part + tl->part + ((s - tl->seg0) * R + r) * (D + 2);
            fold(P, &m, &l, w->tacc, src[0], src[1], src + 2);
        }
        int64_t t = (int64_t)P->qstart[tl->seq] + tl->j0 + r / P->G;
        int64_t h = (int64_t)tl->g * P->G + r % P->G;
        finish_row(P, l, w->tacc, P->out + (t * P->H + h) * D);
    }
}

/* quantize or store token t's kv head g of x at page row idx = slot * KVH + g */
static void write_row(const prm_t *P, const float *x, int64_t idx, void *pages, float *scales) {
    int64_t D = P->D;
    switch (P->type) {
    case KV_F32: memcpy((float *)pages + idx * D, x, sizeof(float) * (size_t)D); return;
    case KV_BF16: {
        uint16_t *dst = (uint16_t *)pages + idx * D;
        for (int64_t d = 0; d < D; d++) dst[d] = bf16_rne(x[d]);
        return;
    }
    case KV_F16: {
        uint16_t *dst = (uint16_t *)pages + idx * D;
        int64_t d = 0;
#if TIDAL_AVX2
        if (P->isa != ISA_SCALAR) { /* F16C rounds to nearest even as f16_rne does */
            const __m256 hi = _mm256_set1_ps(F16_MAX), lo = _mm256_set1_ps(-F16_MAX);
            for (; d + 8 <= D; d += 8) {
                __m256 v = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_loadu_ps(x + d))); /* NaN stays */
                _mm_storeu_si128((__m128i *)(dst + d),
                                 _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            }
        }
#endif
        for (; d < D; d++) dst[d] = f16_rne(f16_clamp(x[d]));
        return;
    }
    default: break;
    }
    /* as tidal.quant.kv_quant.quantize_kv: scale = max(amax / qmax, 1e-12), codes of x / scale */
    float amax = 0.0f;
    for (int64_t d = 0; d < D; d++) amax = maxf(amax, x[d] < 0 ? -x[d] : x[d]);
    float sc = amax / (P->type == KV_INT8 ? 127.0f : 448.0f);
    sc = sc < 1e-12f ? 1e-12f : sc;
    scales[idx] = sc;
    if (P->type == KV_INT8) {
        int8_t *dst = (int8_t *)pages + idx * D;
        for (int64_t d = 0; d < D; d++) {
            float c = rne(x[d] / sc);
            dst[d] = (int8_t)(c > 127.0f ? 127.0f : (c < -127.0f ? -127.0f : c));
        }
    } else {
        uint8_t *dst = (uint8_t *)pages + idx * D;
        for (int64_t d = 0; d < D; d++) dst[d] = e4m3_from_f32(x[d] / sc);
    }
}

/* The call's arguments (one packed block, see tidal_kernels.h). */
typedef tidal_attention_args args_t;

int64_t tidal_paged_attention_args_size(void) { return (int64_t)sizeof(args_t); }

static void write_token(const prm_t *P, int64_t r) {
    int64_t t = r / P->KVH, g = r % P->KVH, idx = P->slots[t] * P->KVH + g;
    write_row(P, P->k + t * P->ldk + g * P->D, idx, P->kp, P->ks);
    write_row(P, P->v + t * P->ldv + g * P->D, idx, P->vp, P->vs);
}

/* Returns 0, or -1 when an allocation failed (out is then incomplete). */
int tidal_paged_attention(const void *packed) {
    args_t a;
    memcpy(&a, packed, sizeof a); /* no alignment assumed */
    int64_t T = a.T, H = a.H, KVH = a.KVH, D = a.D, S = a.S, window = a.window;
    const int32_t *query_lens = a.seqs + S, *context_lens = a.seqs + 2 * S;
    int nthreads = (int)a.nthreads;
    prm_t P = {a.q, a.k, a.v, a.ldq, a.ldk, a.ldv, a.out, a.k_pages, a.v_pages, a.k_scales,
               a.v_scales, a.slot_mapping, a.block_tables, a.seqs, query_lens, context_lens,
               S, T, H, KVH, D, a.block_size, a.table_width, window, (float)a.scale,
               (float)a.softcap, (int)a.kv_type, (int)a.isa, 0, 0};
    if (P.isa > tidal_paged_attention_best_isa()) P.isa = tidal_paged_attention_best_isa();
    if (P.isa == ISA_AVX512 && D % 16) P.isa = ISA_AVX2; /* 16-lane blocks: AVX2 takes the rest */
    if (!TIDAL_AVX2 || D % 8) P.isa = ISA_SCALAR;
    P.G = (int)(H / KVH);
    int rows = P.isa == ISA_AVX512 ? ROWS512 : ROWS;
    P.QT = P.G >= rows ? 1 : rows / P.G;
    int rmax = P.QT * P.G;

    /* Threads: one for a small step, where waking a second one costs more than it saves (and
     * on a busy machine a whole scheduler slice); work counts row x key x column products. */
    int64_t n_tiles = 0, work = 0;
    for (int64_t i = 0; i < S; i++) {
        int64_t nq = query_lens[i], ctx = context_lens[i];
        int64_t keys = window > 0 && window < ctx ? window : ctx - nq / 2;
        n_tiles += KVH * ((nq + P.QT - 1) / P.QT);
        work += H * nq * keys * D;
    }
    int nt = work < PARALLEL_WORK ? 1 : nthreads;
    int split = nt > 1 && n_tiles < 2 * (int64_t)nt;
    tile_t *tiles = malloc(sizeof(tile_t) * (size_t)(n_tiles + 1));
    if (!tiles) return -1;
    int64_t n_items = 0, n_split = 0, part_floats = 0, ti = 0;
    for (int64_t i = 0; i < S; i++) {
        int64_t first = (int64_t)context_lens[i] - query_lens[i];
        for (int64_t g = 0; g < KVH; g++)
            for (int64_t j0 = 0; j0 < query_lens[i]; j0 += P.QT) {
                tile_t *tl = &tiles[ti++];
                int64_t nq = query_lens[i] - j0 < P.QT ? query_lens[i] - j0 : P.QT;
                int64_t plo = first + j0, phi = first + j0 + nq - 1;
                int64_t lo = window > 0 && plo - window + 1 > 0 ? plo - window + 1 : 0;
                *tl = (tile_t){(int32_t)i, (int32_t)g, (int32_t)j0, (int32_t)nq,
                               (int32_t)(lo / SEG), (int32_t)(phi / SEG + 1), -1, -1};
                int64_t nseg = tl->seg1 - tl->seg0;
                if (split && nseg > 1) {
                    tl->part = part_floats;
                    tl->split = (int32_t)n_split++;
                    part_floats += nseg * nq * P.G * (D + 2);
                    n_items += nseg;
                } else {
                    n_items += 1;
                }
            }
    }
    item_t *items = malloc(sizeof(item_t) * (size_t)(n_items + 1));
    int32_t *parts_done = calloc((size_t)(n_split + 1), sizeof(int32_t));
    float *part = part_floats ? malloc(sizeof(float) * (size_t)part_floats) : NULL;
    if (!items || !parts_done || (part_floats && !part)) {
        free(tiles), free(items), free(parts_done), free(part);
        return -1;
    }
    int64_t ni = 0;
    for (int64_t t = 0; t < n_tiles; t++) {
        if (tiles[t].split >= 0) {
            for (int32_t s = tiles[t].seg0; s < tiles[t].seg1; s++) items[ni++] = (item_t){(int32_t)t, s};
        } else {
            items[ni++] = (item_t){(int32_t)t, -1};
        }
    }

    /* the step's K/V first: every read below may see them */
    if (nt == 1 || T * KVH * D < PARALLEL_WRITE) {
        for (int64_t r = 0; r < T * KVH; r++) write_token(&P, r);
    } else {
#pragma omp parallel for schedule(static) num_threads(nt)
        for (int64_t r = 0; r < T * KVH; r++) write_token(&P, r);
    }

    int failed = 0;
    /* one join, no barrier inside: a split tile's last part to finish folds its parts */
#pragma omp parallel num_threads(nt)
    {
        size_t fl = (size_t)rmax * (size_t)(2 * D + 4 + (KB + 1) * NCH) + (NCH + 1) * KB * (size_t)D;
        fl = (fl + 1) & ~(size_t)1; /* int64 after */
        size_t bytes = sizeof(float) * fl + sizeof(int64_t) * 2 * (size_t)rmax +
                       sizeof(float *) * (size_t)rmax;
        char *mem = malloc(bytes);
        scr_t w;
        if (mem) {
            float *f = (float *)mem;
            w.cacc = f, f += rmax * D;
            w.tacc = f, f += rmax * D;
            w.sc = f, f += rmax * KB * NCH;
            w.cm = f, f += rmax;
            w.cl = f, f += rmax;
            w.tm = f, f += rmax;
            w.tl = f, f += rmax;
            w.alpha = f, f += rmax * NCH;
            w.kbuf = f, f += KB * D;
            w.vbuf = f, f += KB * D * NCH;
            w.lo = (int64_t *)(mem + sizeof(float) * fl);
            w.pos = w.lo + rmax;
            w.qr = (const float **)(w.pos + rmax);
        } else {
#pragma omp atomic write
            failed = 1;
        }
        /* longest tiles (last queries of a chunk) first */
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t it = n_items - 1; it >= 0; it--) {
            if (!mem) continue;
            const item_t *item = &items[it];
            const tile_t *tl = &tiles[item->tile];
            if (item->seg < 0) {
                run_tile(&P, tl, &w);
                continue;
            }
            run_part(&P, tl, item->seg, part, &w);
            /* acq_rel: the last of the parts sees every other part's stores */
            if (__atomic_add_fetch(&parts_done[tl->split], 1, __ATOMIC_ACQ_REL) ==
                tl->seg1 - tl->seg0)
                merge_parts(&P, tl, part, &w);
        }
        free(mem);
    }
    free(tiles), free(items), free(parts_done), free(part);
    return failed ? -1 : 0;
}
