/* Matrix multiply and row decoding straight from GGUF's packed quantized blocks, on CPU.
 *
 *   y[m, col0 + n] = sum_k x[m, k] * W[n, k]     x float32 (M, K), row stride ldx;
 *                                                y float32, row stride ldy
 * W's row n is its blocks exactly as they sit in the file: bytes [n*row_bytes, (n+1)*row_bytes).
 * One block, little-endian (q the stored code, v the value dequantization gives):
 *   Q8_0   34 B / 32:  d f16 | q int8[32]                                        v = d*q
 *   Q4_0   18 B / 32:  d f16 | qs[16]: byte j holds q[j] (low nibble), q[j+16]    v = d*(q-8)
 *   Q5_0   22 B / 32:  d f16 | qh u32: bit i = bit 4 of q[i] | qs[16] as Q4_0     v = d*(q-16)
 *   Q4_K  144 B / 256: d f16 | dmin f16 | scales[12]: eight 6-bit (sc_j, m_j) | qs[128]: 32 B
 *                      chunk c holds sub-block 2c (low nibbles), 2c+1 (high)  v = d*sc_j*q - dmin*m_j
 *   Q5_K  176 B / 256: d | dmin | scales[12] | qh[32]: bit j of byte i = bit 4 of q[32j+i] | qs[128]
 *   Q6_K  210 B / 256: ql[128] | qh[64] | sc int8[16] | d f16, in halves of 128 values: ql byte l
 *                      (l < 64) holds q[l] (low nibble), q[l+64]; qh byte l (l < 32) bits 2t, 2t+1
 *                      are bits 4-5 of q[l+32t]                                  v = d*sc_{i/16}*(q-32)
 *   IQ4_NL 18 B / 32:  d f16 | qs[16] as Q4_0                                   v = d*K[q], K a
 *                      fixed 16-entry int8 table (a byte shuffle on AVX2)
 *   IQ4_XS 136 B / 256: d f16 | scales_h u16 | scales_l[4] | qs[128]: eight runs of 32, run j
 *                      its 16 bytes of qs as IQ4_NL's with the 6-bit scale ls_j (low 4 bits the
 *                      nibble j%2 of scales_l[j/2], high 2 bits 2j, 2j+1 of scales_h)
 *                                                                      v = (d*(ls_j-32))*K[q]
 *
 * "Runs of 32" (runs32(): the 32-blocks and IQ4_XS): values v = s*q with q int8 and one float
 * scale s per 32 (IQ4_XS's s = d*(ls-32) is exact in float32: 11 by 6 bits), so one set of
 * kernels serves them, walking a row run by run; their q8 activations are the 32-form.
 *
 * act F32: weights are decoded in registers and meet float32 x in FMAs: the float32 matmul with
 *   the dequantized weights, up to summation order (a 32-block's d, and Q6_K's d*sc per 16 values,
 *   multiply the partial sum of their values' q * x).
 * act Q8: each row of x is quantized once per call, to int8 with a float scale per 32 values and
 *   the sums of each 16 codes (X32_BYTES). Every type, the K-quants included, meets x run by run:
 *   per (row of x, output, run of 32 values) an exact integer dot product s, then the float steps
 *       acc = fma((float)s, d_w * d_x, acc)                                  runs of 32
 *       acc = fma((float)s, (d * sc) * d_x, acc); acc = fma(-(d_x * bsum), dmin * m, acc)
 *                                                                            Q4_K, Q5_K
 *       acc = fma((float)(s - smin), d * d_x, acc)                           Q6_K
 *   in run order (bsum: the sum of x's 32 codes; every product in parentheses rounds once).
 *   Q4_K/Q5_K (k_steps()) have one 6-bit scale sc and min m a run, taken as floats d*sc and
 *   dmin*m: four float operations per output and run where the scales inside s took seven, which
 *   made the tile unit's K-quant path 1.4-1.8x faster at 512 rows (gguf_amx.h). Q6_K's two
 *   scales a run (one per 16 values) stay inside s, on unsigned codes less smin = 32 * (sc_a *
 *   bsum_a + sc_b * bsum_b): s - smin is the signed codes' (q - 32) sum, |s - smin| < 2^24, so
 *   (float) of it is exact and one FMA a run does. Those steps are the same on every path (scalar fmaf, AVX2 FMA), so every ISA,
 *   every M and every thread count give the same bits. ggml's Q8_K has one scale per 256 for the
 *   K-quants: on the bundled model that read +0.32% perplexity against +0.12% (top-1 agreement
 *   95.3% against 97.3%; docs/quantization.md). On AVX2 the integer sums run on maddubs/madd,
 *   eight outputs at a time, one per lane (q8_group_avx2): no int16 saturation (the sign trick
 *   for the signed types, unsigned codes below 64 otherwise). AVX-512 runs the same kernels with
 *   VNNI's vpdpbusd in place of maddubs/madd (int32 sums, one instruction per four codes), and
 *   past two rows of x two groups' panels side by side in 512-bit vectors (q8_group16).
 * Batch invariance (the contract): every y[m, n] is computed by the same sequence of float
 * operations whatever M is, wherever row m falls in a tile of MT rows, and whatever the thread
 * count: a tile runs each of its rows through identical per-row code, a row's quantization
 * depends on that row alone, and threads split the output columns, never a sum. (No -ffast-math;
 * -std=c11 keeps floating-point contraction off in the plain C.)
 *
 * Work: ONE OpenMP region per call covers up to MAX_SEG matrices sharing K (fused q/k/v, gate/up,
 * whose types may differ). Chunks of CHUNK weight rows are split statically over the threads; in
 * a chunk, f32 passes each tile of up to MT rows of x once over each weight row while it is in
 * L1, and q8 on AVX2 takes the chunk's weight rows QG at a time (q8_group_avx2), on AVX-512 all
 * CHUNK = QG2 of them together (q8_group16_avx512).
 * Kernels: one function per (type, act, ISA), picked at run time by `isa`: ISA_AVX512 (compiled
 * where the build has AVX-512 F/BW/VL + VNNI besides AVX2's set), ISA_AVX2 (AVX2+FMA+F16C) or
 * ISA_SCALAR (plain C; f32 sums in another order, q8 gives the same bits), and ISA_AVX2_VNNI,
 * AVX2's kernels with AVX-VNNI's 256-bit vpdpbusd for q8's integer sums (the same bits again;
 * compiled where the build has AVX-VNNI), and ISA_AMX, AVX-512's with q8's integer sums on the AMX
 * tile unit from 6 or 12 rows of x by type (amx_takes in gguf_amx.h; the same bits again). Each
 * is a table in pick(); an entry may point at a lower path's kernel. AVX-512 f32 looks the 4- and
 * 5-bit codes up in a table of their block's float weights (one permute per 16 codes, see
 * b32_weights512); q8 is AVX2's kernels with vpdpbusd (dpbusd()), sixteen outputs a vector past
 * two rows of x (q8_group16); the activations' quantization and the dequantization are AVX2's. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tidal_kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif
#if defined(HAVE_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) \
    && defined(__AVX512VNNI__)
#define HAVE_AVX512 1
#endif
/* AVX-VNNI: vpdpbusd on 256 bits in a VEX encoding, without AVX-512 (Intel cores from Alder Lake
 * on, the E-core Xeons; AMD from Zen 5, which has AVX-512 besides) */
#if defined(HAVE_AVX2) && defined(__AVXVNNI__)
#define HAVE_AVXVNNI 1
#endif
/* AMX: the tile unit's int8 dot products (Xeons from Sapphire Rapids on), with AVX-512 beside */
#if defined(HAVE_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define HAVE_AMX 1
#endif

enum {
    T_Q4_0 = 2, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20,
    T_IQ4_XS = 23
};
#define N_TYPES (T_IQ4_XS + 1)
/* IQ4_NL: Q4_0's layout, each 4-bit code an index into this non-linear table (v = d * K[code]) */
static const int8_t IQ4NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                        1,    13,   25,  38,  53,  69,  89,  113};
enum { ACT_F32 = 0, ACT_Q8 = 1 };
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
/* This file's own path: AVX2's kernels with AVX-VNNI's vpdpbusd for the q8 integer sums (every
 * other kernel takes it as ISA_AVX2; tidal/kernels/gguf_gemm.py names it "avx2vnni"). */
enum { ISA_AVX2_VNNI = 3 };
/* and AVX-512's path with q8's integer sums on AMX tiles from 6 or 12 rows of x (gguf_amx.h;
 * "amx") */
enum { ISA_AMX = 4 };
enum { ERR_TYPE = -1, ERR_SHAPE = -2, ERR_ISA = -3, ERR_NOMEM = -4 };

#define MT 8             /* rows of x per pass over a weight row */
#define CHUNK 16         /* weight rows per unit of work: in L1 across the tiles of x */
#define PREFETCH_ROWS 4  /* the first tile fetches weight rows this far ahead (+15% on the LM head) */
#define SLICE_BYTES 16384 /* x per K slice of a tile (AVX2, float activations): half of L1 */
#define SLICE_ABOVE 32768 /* tiles whose x is larger are sliced (K = 2048 at 8 rows: 5-8% faster;
                             K = 1024 gained nothing) */
#define MAX_SEG 4
#define X32_BYTES 40     /* quantized x per 32 values: float d | int16 bsum[2] (sums of 16 codes) | int8 q[32] */
#define X32_Q 8          /* where a run's codes start */
#define ALWAYS static inline __attribute__((always_inline))

/* 0 for a type this file does not multiply */
int tidal_gguf_block_elems(int type) {
    switch (type) {
    case T_Q4_0: case T_Q5_0: case T_Q8_0: case T_IQ4_NL: return 32;
    case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS: return 256;
    default: return 0;
    }
}

static int block_bytes(int type) {
    switch (type) {
    case T_Q4_0: case T_IQ4_NL: return 18; case T_Q5_0: return 22; case T_Q8_0: return 34;
    case T_Q4_K: return 144; case T_Q5_K: return 176; case T_Q6_K: return 210;
    case T_IQ4_XS: return 136;
    default: return 0;
    }
}

/* runs of 32 values with one scale each in a block (see the top); 0 for the K-quants' form */
static int runs32(int type) {
    switch (type) {
    case T_Q4_0: case T_Q5_0: case T_Q8_0: case T_IQ4_NL: return 1;
    case T_IQ4_XS: return 8;
    default: return 0;
    }
}

/* Q4_K and Q5_K (one scale and min per run of 32): their q8 float steps take the weight's scales
 * as floats, d*sc and dmin*m (the top) */
static int k_steps(int type) { return type == T_Q4_K || type == T_Q5_K; }

/* IQ4_XS: run j's scale from its super-block sb, d the super-block's scale */
static inline float xs_scale(const uint8_t *sb, int j, float d) {
    uint16_t h;
    memcpy(&h, sb + 2, 2);
    int ls = (sb[4 + j / 2] >> 4 * (j & 1) & 0xF) | (h >> 2 * j & 3) << 4;
    return d * (float)(ls - 32);
}

int tidal_gguf_has_avx2(void) {
#ifdef HAVE_AVX2
    return 1;
#else
    return 0;
#endif
}

int tidal_gguf_has_avx2vnni(void) {
#ifdef HAVE_AVXVNNI
    return 1;
#else
    return 0;
#endif
}

int tidal_gguf_has_avx512(void) {
#ifdef HAVE_AVX512
    return 1;
#else
    return 0;
#endif
}

/* exact fp16 -> float without F16C */
static float half_to_float(const uint8_t *p) {
    uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8, sign = (h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {  /* zero or subnormal: man * 2^-24 is exact in float */
        float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    bits = sign | (exp == 31 ? 0x7F800000u | man << 13 : (exp + 112) << 23 | man << 13);
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

/* ---- a K-quant super-block decoded: v[i] = d*sc[i/16]*q[i] - dmin*mn[i/16] ----
 * Q6_K keeps q unsigned (0..63) with mn = 32*sc and dmin = d, so one integer kernel serves all
 * three. fs, fm = d*sc, dmin*mn as float, filled by the AVX2 decoder when asked. */
typedef struct {
    _Alignas(32) uint8_t q[256]; /* aligned in arrays of kblocks too */
    int16_t sc[16], mn[16];
    float fs[16], fm[16];
    float d, dmin;
} kblock;

/* Q4_K/Q5_K's 12 scale bytes -> bytes 0-7 the eight 6-bit scales, 8-15 the eight mins (layout
 * drawn at tidal/loader/gguf_quants.py:_k_scale_min), four to a 32-bit word */
static inline void k_unpack6(const uint8_t *s, uint32_t u[4]) {
    memcpy(u, s, 12);
    uint32_t mins03 = u[1] & 0x3F3F3F3Fu;
    u[3] = ((u[2] >> 4) & 0x0F0F0F0Fu) | ((u[1] >> 6) & 0x03030303u) << 4; /* mins 4-7 */
    u[1] = (u[2] & 0x0F0F0F0Fu) | ((u[0] >> 6) & 0x03030303u) << 4;        /* scales 4-7 */
    u[2] = mins03;
    u[0] &= 0x3F3F3F3Fu;                                                    /* scales 0-3 */
}

static void k_decode_scalar(int type, const uint8_t *b, kblock *k) {
    if (type == T_Q6_K) {
        for (int s = 0; s < 16; s++) {
            k->sc[s] = (int8_t)b[192 + s];
            k->mn[s] = (int16_t)(32 * k->sc[s]);
        }
        k->d = k->dmin = half_to_float(b + 208);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            uint8_t *q = k->q + 128 * h;
            for (int l = 0; l < 32; l++) {
                q[l] = (ql[l] & 0xF) | (qh[l] & 3) << 4;
                q[l + 32] = (ql[l + 32] & 0xF) | (qh[l] >> 2 & 3) << 4;
                q[l + 64] = (ql[l] >> 4) | (qh[l] >> 4 & 3) << 4;
                q[l + 96] = (ql[l + 32] >> 4) | (qh[l] >> 6) << 4;
            }
        }
        return;
    }
    uint32_t u[4];
    uint8_t v[16];
    k_unpack6(b + 4, u);
    memcpy(v, u, 16);
    for (int j = 0; j < 8; j++) {
        k->sc[2 * j] = k->sc[2 * j + 1] = v[j];
        k->mn[2 * j] = k->mn[2 * j + 1] = v[8 + j];
    }
    k->d = half_to_float(b);
    k->dmin = half_to_float(b + 2);
    const uint8_t *qs = b + (type == T_Q5_K ? 48 : 16), *qh = b + 16;
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 32; i++) {
            k->q[64 * c + i] = qs[32 * c + i] & 0xF;
            k->q[64 * c + 32 + i] = qs[32 * c + i] >> 4;
        }
    if (type == T_Q5_K)
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < 32; i++) k->q[32 * j + i] |= (qh[i] >> j & 1) << 4;
}

/* run g of a row w: its signed values q (v = s*q); returns s */
static float b32_decode_scalar(int type, const uint8_t *w, int64_t g, int8_t *q) {
    const uint8_t *b = w + g * block_bytes(type);
    if (type == T_IQ4_XS) {
        const uint8_t *sb = w + (g >> 3) * 136, *qs = sb + 8 + 16 * (g & 7);
        for (int j = 0; j < 16; j++) {
            q[j] = IQ4NL_VALUES[qs[j] & 0xF];
            q[j + 16] = IQ4NL_VALUES[qs[j] >> 4];
        }
        return xs_scale(sb, (int)(g & 7), half_to_float(sb));
    }
    if (type == T_Q8_0) {
        memcpy(q, b + 2, 32);
    } else if (type == T_IQ4_NL) {
        for (int j = 0; j < 16; j++) {
            q[j] = IQ4NL_VALUES[b[2 + j] & 0xF];
            q[j + 16] = IQ4NL_VALUES[b[2 + j] >> 4];
        }
    } else {
        const uint8_t *qs = b + (type == T_Q5_0 ? 6 : 2);
        uint32_t qh = 0;
        if (type == T_Q5_0) memcpy(&qh, b + 2, 4);
        int off = type == T_Q5_0 ? 16 : 8;
        for (int j = 0; j < 16; j++) {
            q[j] = (int8_t)(((qs[j] & 0xF) | (qh >> j & 1) << 4) - off);
            q[j + 16] = (int8_t)(((qs[j] >> 4) | (qh >> (j + 16) & 1) << 4) - off);
        }
    }
    return half_to_float(b);
}

/* ---- quantizing a row of x; both ISAs write identical bytes (exact max, one rounding, RNE) ---- */

static void quant_x_scalar(const float *x, int64_t K, uint8_t *dst) {
    for (int64_t g = 0; g < K / 32; g++, x += 32, dst += X32_BYTES) {
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
        float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int8_t *q = (int8_t *)(dst + X32_Q);
        int16_t bsum[2] = {0, 0};
        for (int i = 0; i < 32; i++) {
            q[i] = (int8_t)rintf(x[i] * id);
            bsum[i / 16] = (int16_t)(bsum[i / 16] + q[i]);
        }
        memcpy(dst, &d, 4);
        memcpy(dst + 4, bsum, 4);
    }
}

/* ---- kernels: out[i] = row i of x (i < mt) against one weight row of nb blocks ---- */

typedef void (*tile_fn)(const uint8_t *w, int64_t nb, const uint8_t *x, int64_t ldx, int mt,
                        float *out);

static float b32_f32_row(int type, const uint8_t *w, int64_t nb, const float *x) {
    float acc = 0.0f;
    int8_t q[32];
    for (int64_t b = 0; b < nb * runs32(type); b++, x += 32) {
        float d = b32_decode_scalar(type, w, b, q), g = 0.0f;
        for (int j = 0; j < 32; j++) g += (float)q[j] * x[j];
        acc += g * d;
    }
    return acc;
}

static float b32_q8_row(int type, const uint8_t *w, int64_t nb, const uint8_t *x) {
    float acc = 0.0f, dx;
    int8_t q[32];
    for (int64_t b = 0; b < nb * runs32(type); b++, x += X32_BYTES) {
        const int8_t *xq = (const int8_t *)(x + X32_Q);
        float dw = b32_decode_scalar(type, w, b, q);
        int32_t s = 0;
        for (int j = 0; j < 32; j++) s += q[j] * xq[j];
        memcpy(&dx, x, 4);
        acc = fmaf((float)s, dw * dx, acc);
    }
    return acc;
}

static float k_f32_row(int type, const uint8_t *w, int64_t nb, const float *x) {
    float acc = 0.0f;
    kblock k;
    for (int64_t b = 0; b < nb; b++, x += 256) {
        k_decode_scalar(type, w + b * block_bytes(type), &k);
        for (int j = 0; j < 256; j++)
            acc += (k.d * k.sc[j / 16] * k.q[j] - k.dmin * k.mn[j / 16]) * x[j];
    }
    return acc;
}

static float k_q8_row(int type, const uint8_t *w, int64_t nb, const uint8_t *x) {
    float acc = 0.0f, dx;
    int16_t bsum[2];
    kblock k;
    for (int64_t b = 0; b < nb; b++) {
        k_decode_scalar(type, w + b * block_bytes(type), &k);
        for (int c = 0; c < 8; c++, x += X32_BYTES) { /* 32 values: one scale of x, two 16s of the weight's */
            const int8_t *xq = (const int8_t *)(x + X32_Q);
            memcpy(&dx, x, 4);
            memcpy(bsum, x + 4, 4);
            if (type != T_Q6_K) { /* one scale and min per 32: k_steps() */
                int32_t s = 0;
                for (int j = 0; j < 32; j++) s += k.q[32 * c + j] * xq[j];
                float ws = k.d * (float)k.sc[2 * c], wm = k.dmin * (float)k.mn[2 * c];
                acc = fmaf((float)s, ws * dx, acc);
                acc = fmaf(-(dx * (float)(bsum[0] + bsum[1])), wm, acc);
                continue;
            }
            int32_t s = 0;
            for (int j = 0; j < 32; j++) s += k.sc[2 * c + j / 16] * k.q[32 * c + j] * xq[j];
            int32_t smin = k.mn[2 * c] * bsum[0] + k.mn[2 * c + 1] * bsum[1];
            acc = fmaf((float)(s - smin), k.d * dx, acc); /* Q6_K: s - smin below 2^24, exact */
        }
    }
    return acc;
}

/* into L2 (prefetcht1): streaming a decode step's weights that way read 1.16-1.19x faster than
 * into L1 on a Xeon (Q8_0 20.2 -> 23.6 GB/s, Q6_K 17.5 -> 19.6, two threads) */
static inline void prefetch(const uint8_t *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 2);
}

#ifdef HAVE_AVX2
/* ---- AVX2 + FMA + F16C ---- */

static inline float half_f16c(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __m256 i8x8_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
static inline __m256 u8x8_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

/* 16 bytes of nibbles -> 32 bytes: [j] = low nibble of byte j, [j+16] = its high nibble */
static inline __m256i nibbles(const uint8_t *p) {
    __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    b = _mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}

/* 32 bits -> 32 bytes, 0xFF where bit i is set */
static inline __m256i bit_bytes(uint32_t bits) {
    const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                              0x0303030303030303);
    const __m256i sel = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread); /* byte i: bits' i/8 */
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, sel), sel);
}

/* run g of a row w: its 32 signed values; *d its scale */
ALWAYS __m256i b32_decode_avx2(int type, const uint8_t *w, int64_t g, float *d) {
    const uint8_t *b = w + g * block_bytes(type);
    if (type == T_IQ4_XS) {
        const uint8_t *sb = w + (g >> 3) * 136;
        *d = xs_scale(sb, (int)(g & 7), half_f16c(sb));
        __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4NL_VALUES));
        return _mm256_shuffle_epi8(table, nibbles(sb + 8 + 16 * (g & 7)));
    }
    *d = half_f16c(b);
    if (type == T_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    if (type == T_Q4_0) return _mm256_sub_epi8(nibbles(b + 2), _mm256_set1_epi8(8));
    if (type == T_IQ4_NL) { /* a byte shuffle looks every code up in the table (both lanes) */
        __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4NL_VALUES));
        return _mm256_shuffle_epi8(table, nibbles(b + 2));
    }
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    /* q - 16 as int8: the nibble where bit 4 is set, nibble | 0xF0 (= nibble - 16) where not */
    __m256i below = _mm256_andnot_si256(bit_bytes(qh), _mm256_set1_epi8((char)0xF0));
    return _mm256_or_si256(nibbles(b + 6), below);
}

static inline __m256 cvt16_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(v)); }

/* a super-block's scales into k (and their float products with d, dmin when asked) */
ALWAYS void k_scales_avx2(int type, const uint8_t *b, kblock *k, int floats) {
    __m256i sc, mn;
    if (type == T_Q6_K) {
        sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
        mn = _mm256_slli_epi16(sc, 5);
        k->d = k->dmin = half_f16c(b + 208);
    } else {
        uint32_t u[4];
        k_unpack6(b + 4, u);
        __m128i v = _mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0]);
        sc = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v)); /* each scale for both its 16s */
        mn = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(v, v));
        k->d = half_f16c(b);
        k->dmin = half_f16c(b + 2);
    }
    _mm256_store_si256((__m256i *)k->sc, sc);
    _mm256_store_si256((__m256i *)k->mn, mn);
    if (floats) { /* the single roundings of k.d * (float)k.sc[g] */
        __m256 d = _mm256_set1_ps(k->d), dm = _mm256_set1_ps(k->dmin);
        __m128i sc_hi = _mm256_extracti128_si256(sc, 1), mn_hi = _mm256_extracti128_si256(mn, 1);
        _mm256_store_ps(k->fs, _mm256_mul_ps(d, cvt16_ps(_mm256_castsi256_si128(sc))));
        _mm256_store_ps(k->fs + 8, _mm256_mul_ps(d, cvt16_ps(sc_hi)));
        _mm256_store_ps(k->fm, _mm256_mul_ps(dm, cvt16_ps(_mm256_castsi256_si128(mn))));
        _mm256_store_ps(k->fm + 8, _mm256_mul_ps(dm, cvt16_ps(mn_hi)));
    }
}

ALWAYS void k_decode_avx2(int type, const uint8_t *b, kblock *k, int floats) {
    k_scales_avx2(type, b, k, floats);
    const __m256i lo4 = _mm256_set1_epi8(0x0F), hi2 = _mm256_set1_epi8(0x30);
    __m256i *q = (__m256i *)k->q; /* the first member: callers align the kblock */
#define OR_AND(a, ma, b, mb) _mm256_or_si256(_mm256_and_si256(a, ma), _mm256_and_si256(b, mb))
    if (type == T_Q6_K) {
        for (int h = 0; h < 2; h++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            q[4 * h] = OR_AND(l0, lo4, _mm256_slli_epi16(qh, 4), hi2);
            q[4 * h + 1] = OR_AND(l1, lo4, _mm256_slli_epi16(qh, 2), hi2);
            q[4 * h + 2] = OR_AND(_mm256_srli_epi16(l0, 4), lo4, qh, hi2);
            q[4 * h + 3] = OR_AND(_mm256_srli_epi16(l1, 4), lo4, _mm256_srli_epi16(qh, 2), hi2);
        }
        return;
    }
    const uint8_t *qs = b + (type == T_Q5_K ? 48 : 16);
    __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16)), bit4 = _mm256_set1_epi8(0x10);
    for (int c = 0; c < 4; c++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m256i lo = _mm256_and_si256(v, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
        if (type == T_Q5_K) { /* bit j of qh's bytes is bit 4 of sub-block j: move it to bit 4 */
            lo = OR_AND(lo, lo4, _mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * c), 4), bit4);
            hi = OR_AND(hi, lo4, _mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * c + 1), 4), bit4);
        }
        q[2 * c] = lo;
        q[2 * c + 1] = hi;
    }
#undef OR_AND
}

/* the tile's rows, unrolled early so the per-row accumulators live in registers */
#define EACH_ROW(i) _Pragma("GCC unroll 8") for (int i = 0; i < mt; i++)

/* run b of the weight row w into acc[i], for each row i of the tile */
ALWAYS void b32_f32_step(int type, const uint8_t *w, const uint8_t *x, int64_t ldx, int64_t b,
                         int mt, __m256 *acc) {
    float d;
    __m256 w0, w1, w2, w3;
    if (type == T_Q8_0) { /* widen straight from memory */
        const uint8_t *blk = w + b * block_bytes(type);
        d = half_f16c(blk);
        w0 = i8x8_ps(_mm_loadl_epi64((const __m128i *)(blk + 2)));
        w1 = i8x8_ps(_mm_loadl_epi64((const __m128i *)(blk + 10)));
        w2 = i8x8_ps(_mm_loadl_epi64((const __m128i *)(blk + 18)));
        w3 = i8x8_ps(_mm_loadl_epi64((const __m128i *)(blk + 26)));
    } else {
        __m256i q = b32_decode_avx2(type, w, b, &d);
        __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
        w0 = i8x8_ps(lo);
        w1 = i8x8_ps(_mm_srli_si128(lo, 8));
        w2 = i8x8_ps(hi);
        w3 = i8x8_ps(_mm_srli_si128(hi, 8));
    }
    __m256 dv = _mm256_set1_ps(d);
    EACH_ROW(i) {
        const float *xr = (const float *)(x + i * ldx) + 32 * b;
        __m256 g = _mm256_mul_ps(w0, _mm256_loadu_ps(xr));
        g = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), g);
        g = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), g);
        g = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), g);
        acc[i] = _mm256_fmadd_ps(g, dv, acc[i]);
    }
}

/* One weight row at a time: interleaving several rows' streams was measured 1.9x slower on the
 * DRAM-bound LM head (the prefetcher follows one stream per thread best). */
#define B32_BODY(name, step)                                                                  \
    ALWAYS void name(int type, const uint8_t *w, int64_t nb, const uint8_t *x, int64_t ldx,   \
                     int mt, float *out) {                                                    \
        __m256 acc[MT];                                                                       \
        EACH_ROW(i) acc[i] = _mm256_setzero_ps();                                             \
        for (int64_t b = 0; b < nb * runs32(type); b++) step(type, w, x, ldx, b, mt, acc);     \
        EACH_ROW(i) out[i] = hsum8(acc[i]);                                                   \
    }
B32_BODY(b32_f32_avx2, b32_f32_step)

/* The same runs' operations as b32_f32_avx2, runs b0..b1-1 only, the rows' accumulators kept in
 * acc between calls (stored and reloaded exactly): a K-sliced pass (see gemm_sliced_avx2) gives
 * the very bits of a whole pass. */
ALWAYS void b32_f32_part_avx2(int type, const uint8_t *w, int64_t b0, int64_t b1,
                              const uint8_t *x, int64_t ldx, int mt, __m256 *acc) {
    __m256 a[MT];
    EACH_ROW(i) a[i] = acc[i];
    for (int64_t b = b0; b < b1; b++) b32_f32_step(type, w, x, ldx, b, mt, a);
    EACH_ROW(i) acc[i] = a[i];
}

/* One super-block for R (<= K_ROWS) rows of x. Q6_K: each 16 values' scale comes out of their sum,
 * as the 32-block types' d does: sum (q - 32) * x, then * d*sc (one FMA-unit op per 8 values less).
 * Q4_K/Q5_K: each weight decoded as fmsub(q, d*sc, dmin*m) (taking the min out of the sum would
 * trade cancellation for speed). Per row two FMA chains that start afresh in each block
 * (sub-block / group t feeds chain t % 2) are added as c0 + c1 into the row's accumulator: a
 * block's chains do not wait on the previous block's, and every tiling runs this same sequence per
 * row (bit-exact whatever M or the row's tile). Rows go K_ROWS at a time so that their chains stay
 * in registers while each converted weight vector is reused. */
#define K_ROWS 4
enum { W_CONVERT, W_STORE, W_LOAD }; /* a tile taller than K_ROWS converts once, then reloads */
ALWAYS void k_f32_rows(int type, const kblock *k, float *wf, int wmode, const uint8_t *x,
                       int64_t ldx, int64_t b, int R, __m256 *acc) {
    __m256 c[K_ROWS][2];
    if (type == T_Q6_K) { /* k->q holds q - 32 as int8 here */
        _Pragma("GCC unroll 16") for (int t = 0; t < 16; t++) {
            __m256 s = _mm256_broadcast_ss(k->fs + t);
            __m256 w0, w1;
            if (wmode == W_LOAD) {
                w0 = _mm256_load_ps(wf + 16 * t);
                w1 = _mm256_load_ps(wf + 16 * t + 8);
            } else {
                w0 = i8x8_ps(_mm_loadl_epi64((const __m128i *)(k->q + 16 * t)));
                w1 = i8x8_ps(_mm_loadl_epi64((const __m128i *)(k->q + 16 * t + 8)));
                if (wmode == W_STORE) {
                    _mm256_store_ps(wf + 16 * t, w0);
                    _mm256_store_ps(wf + 16 * t + 8, w1);
                }
            }
            for (int r = 0; r < R; r++) {
                const float *xr = (const float *)(x + r * ldx) + 256 * b + 16 * t;
                __m256 g = _mm256_mul_ps(w0, _mm256_loadu_ps(xr));
                g = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), g);
                c[r][t % 2] = t < 2 ? _mm256_mul_ps(g, s) : _mm256_fmadd_ps(g, s, c[r][t % 2]);
            }
        }
    } else { /* each weight decoded to float (one fmsub), group g of 8 values feeds chain g % 2 */
        _Pragma("GCC unroll 32") for (int g = 0; g < 32; g++) {
            __m256 wv;
            if (wmode == W_LOAD) {
                wv = _mm256_load_ps(wf + 8 * g);
            } else {
                __m256 s = _mm256_broadcast_ss(k->fs + g / 2);
                __m256 q = u8x8_ps(_mm_loadl_epi64((const __m128i *)(k->q + 8 * g)));
                wv = _mm256_fmsub_ps(q, s, _mm256_broadcast_ss(k->fm + g / 2));
                if (wmode == W_STORE) _mm256_store_ps(wf + 8 * g, wv);
            }
            for (int r = 0; r < R; r++) {
                __m256 xv = _mm256_loadu_ps((const float *)(x + r * ldx) + 256 * b + 8 * g);
                c[r][g % 2] = g < 2 ? _mm256_mul_ps(wv, xv) : _mm256_fmadd_ps(wv, xv, c[r][g % 2]);
            }
        }
    }
    for (int r = 0; r < R; r++) acc[r] = _mm256_add_ps(acc[r], _mm256_add_ps(c[r][0], c[r][1]));
}

/* super-blocks b0..b1-1 of weight row w into the rows' accumulators acc (see b32_f32_part_avx2) */
ALWAYS void k_f32_part_avx2(int type, const uint8_t *w, int64_t b0, int64_t b1, const uint8_t *x,
                            int64_t ldx, int mt, __m256 *acc) {
    _Alignas(32) kblock k;
    _Alignas(32) float wf[256];
    __m256 a[MT];
    EACH_ROW(i) a[i] = acc[i];
    for (int64_t b = b0; b < b1; b++) {
        k_decode_avx2(type, w + b * block_bytes(type), &k, 1);
        if (type == T_Q6_K)
            for (int i = 0; i < 8; i++) {
                __m256i *q = (__m256i *)k.q + i;
                __m256i v = _mm256_load_si256(q);
                _mm256_store_si256(q, _mm256_sub_epi8(v, _mm256_set1_epi8(32)));
            }
        int r = 0;
        if (mt > K_ROWS) {
            k_f32_rows(type, &k, wf, W_STORE, x, ldx, b, K_ROWS, a);
            r = K_ROWS;
        }
        int wm = r ? W_LOAD : W_CONVERT;
        for (; r + K_ROWS <= mt; r += K_ROWS)
            k_f32_rows(type, &k, wf, wm, x + r * ldx, ldx, b, K_ROWS, a + r);
        if (mt - r == 3) k_f32_rows(type, &k, wf, wm, x + r * ldx, ldx, b, 3, a + r);
        if (mt - r == 2) k_f32_rows(type, &k, wf, wm, x + r * ldx, ldx, b, 2, a + r);
        if (mt - r == 1) k_f32_rows(type, &k, wf, wm, x + r * ldx, ldx, b, 1, a + r);
    }
    EACH_ROW(i) acc[i] = a[i];
}

ALWAYS void k_f32_avx2(int type, const uint8_t *w, int64_t nb, const uint8_t *x, int64_t ldx,
                       int mt, float *out) {
    __m256 acc[MT];
    EACH_ROW(i) acc[i] = _mm256_setzero_ps();
    k_f32_part_avx2(type, w, 0, nb, x, ldx, mt, acc);
    EACH_ROW(i) out[i] = hsum8(acc[i]);
}

/* ---- q8 on AVX2: QG weight rows (outputs) at a time, one per lane ----
 * A group's runs of 32 values are decoded for its QG rows, QSLAB runs at a time, and transposed
 * into a panel: vector g of a run holds, in lane c, codes 4g..4g+3 of row c. Rows of x (QR at a
 * time, their accumulators in registers) then meet each run as broadcasts of four codes; maddubs
 * and madd leave each lane's exact integer dot product in that lane (no reduction across lanes),
 * and one FMA per row of x (two for the K-quants) adds it to the row's QG outputs: the float steps
 * of the scalar kernels, in the same order. A slab is decoded once per QM rows of x. */
#define QG 8     /* weight rows per group: one per lane */
#define QM 128   /* rows of x per pass over a group's slabs with VNNI (AVX2: 64): their
                    accumulators wait in L1 */
#define QSLAB 16 /* runs per slab (11 KiB of panel; two super-blocks of a K-quant) */
#define QR 8     /* rows of x per pass over a slab with VNNI (AVX2: 4; 16 ymm registers) */

typedef struct {
    __m256i u[8], s[8]; /* the codes (|q| for the signed types, q ^ 0x80 on VNNI), and q for
                           its signs (AVX2) */
    __m256i sc[2], mn;  /* K-quants: each lane's scales of codes 0-15 and 16-31 (in both int16
                           halves; int32 on VNNI), and its two mins (low, high int16) */
    __m256 d, dm;       /* each lane's d_w (runs of 32), or d and dmin (K-quants) */
} qrun;

/* v[g], lane c <- dword g of r[c] (an 8 x 8 transpose of 32-bit elements) */
ALWAYS void transpose8(const __m256i r[8], __m256i v[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++) { /* rows 4h..4h+3: u[4h + g] holds their dwords g and g + 4 */
        u[4 * h] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
        u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
    for (int g = 0; g < 4; g++) {
        v[g] = _mm256_permute2x128_si256(u[g], u[4 + g], 0x20);
        v[g + 4] = _mm256_permute2x128_si256(u[g], u[4 + g], 0x31);
    }
}

/* Q4_0 and Q5_0's run g as its unsigned codes (v = d*(q - 8), d*(q - 16)); *d its scale */
ALWAYS __m256i b32_codes_avx2(int type, const uint8_t *w, int64_t g, float *d) {
    const uint8_t *b = w + g * block_bytes(type);
    *d = half_f16c(b);
    if (type == T_Q4_0) return nibbles(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    return _mm256_or_si256(nibbles(b + 6), _mm256_and_si256(bit_bytes(qh), _mm256_set1_epi8(0x10)));
}

/* the offset of Q4_0/Q5_0's unsigned codes; 0: a signed type (Q8_0, IQ4), or a K-quant */
ALWAYS int code_offset(int type) { return type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : 0; }

/* q8 with VNNI (vnni != 0): vpdpbusd adds each lane's four u8 x s8 products to an int32 in one
 * instruction, exact, where AVX2 spends maddubs + madd (+ sign). Its unsigned operand is the
 * weight: the signed types (Q8_0, IQ4) store q + 128 (q ^ 0x80) and take 128 * (sum of x's
 * codes) off, as Q4_0/Q5_0 take their offset; the integers, so the bits, are AVX2's. VNNI_EVEX:
 * AVX-512 VL's encoding (AVX-512 builds); VNNI_VEX: AVX-VNNI's, the same instruction on machines
 * without AVX-512 (16 ymm registers: the tiles stay AVX2's height). */
enum { VNNI_NONE = 0, VNNI_EVEX = 1, VNNI_VEX = 2 };
#ifdef HAVE_AVX512
#define EVEX_BUILT 1
#else
#define EVEX_BUILT 0
#endif
#ifdef HAVE_AVXVNNI
#define VEX_BUILT 1
#else
#define VEX_BUILT 0
#endif
ALWAYS __m256i dpbusd(int vnni, __m256i acc, __m256i u, __m256i s) {
#ifdef HAVE_AVXVNNI
    if (vnni == VNNI_VEX) return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
#ifdef HAVE_AVX512
    if (vnni == VNNI_EVEX) return _mm256_dpbusd_epi32(acc, u, s);
#endif
    (void)vnni, (void)u, (void)s;
    __builtin_unreachable();
    return acc;
}
/* the offset q8_scale_run takes off: the codes' offset, and on VNNI the signed types' 128 */
ALWAYS int q8_offset(int type, int vnni) {
    return vnni && !code_offset(type) && runs32(type) ? 128 : code_offset(type);
}

/* run g of a runs-of-32 row as the q8 kernels take it: Q4_0/Q5_0's unsigned codes, the signed
 * types' q (q ^ 0x80 on VNNI); *d its scale */
ALWAYS __m256i b32_q8_codes(int type, int vnni, const uint8_t *w, int64_t g, float *d) {
    if (code_offset(type)) return b32_codes_avx2(type, w, g, d);
    __m256i q = b32_decode_avx2(type, w, g, d);
    return vnni ? _mm256_xor_si256(q, _mm256_set1_epi8(-128)) : q;
}

/* the dwords at base + idx[c] for the lanes c < nc, zeros past nc. Gathered: a vector built from
 * eight scalar stores would wait for store forwarding to fail, once per run. */
ALWAYS __m256i gather_lanes(const void *base, __m256i idx, int nc) {
    __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(nc), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)base, idx, live, 1);
}

/* (0, 1, ..., 7) * stride: the lanes' byte offsets for gather_lanes */
ALWAYS __m256i lane_offsets(int64_t stride) {
    return _mm256_mullo_epi32(_mm256_set1_epi32((int)stride), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* part i of n of the `bytes` at p (the next group's, in step with this group's runs) */
static inline void prefetch_part(const uint8_t *p, int64_t i, int64_t n, int64_t bytes) {
    if (!p) return;
    int64_t a = i * bytes / n;
    prefetch(p + a, (i + 1) * bytes / n - a);
}

/* the group's scales and mins per run: sc[j], lane c = k[c].sc[2j] | k[c].sc[2j+1] << 16 (mn
 * likewise), by transposing the eight kblocks' int16 arrays (dword j holds run j's pair) */
ALWAYS void k_scales_t(const kblock *k, __m256i sc[8], __m256i mn[8]) {
    __m256i r[QG];
    for (int c = 0; c < QG; c++) r[c] = _mm256_load_si256((const __m256i *)k[c].sc);
    transpose8(r, sc);
    for (int c = 0; c < QG; c++) r[c] = _mm256_load_si256((const __m256i *)k[c].mn);
    transpose8(r, mn);
}

/* super-block b of a K-quant group's nc rows into k[0..nc-1] (k[nc..] stay zeros); d, dm: each
 * lane's d and dmin; sc, mn: per run, as k_scales_t gives them */
ALWAYS void k_decode_group(int type, const uint8_t *w, int64_t rb, int nc, int64_t b, kblock *k,
                           __m256 *d, __m256 *dm, __m256i sc[8], __m256i mn[8]) {
    const __m256i at = lane_offsets(sizeof(kblock));
    for (int c = 0; c < nc; c++) k_decode_avx2(type, w + c * rb + b * block_bytes(type), &k[c], 0);
    *d = _mm256_castsi256_ps(gather_lanes(&k[0].d, at, nc));
    *dm = _mm256_castsi256_ps(gather_lanes(&k[0].dmin, at, nc));
    k_scales_t(k, sc, mn);
}

/* each lane's scale of run r (rows: the lanes' byte offsets c * rb; zeros past nc) */
ALWAYS __m256 b32_scales(int type, const uint8_t *w, int64_t rb, int nc, int64_t r, __m256i rows) {
    if (type == T_IQ4_XS) { /* from each super-block's 6-bit run scales */
        float ds[QG];
        for (int c = 0; c < QG; c++) {
            const uint8_t *sb = w + c * rb + (r >> 3) * 136;
            ds[c] = c < nc ? xs_scale(sb, (int)(r & 7), half_f16c(sb)) : 0.0f;
        }
        return _mm256_setr_ps(ds[0], ds[1], ds[2], ds[3], ds[4], ds[5], ds[6], ds[7]);
    }
    /* the f16 d at each block's start: the low halves of the gathered dwords */
    __m256i h = gather_lanes(w + r * block_bytes(type), rows, nc);
    h = _mm256_shuffle_epi8(h, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1,
                                                 -1, -1, 0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1,
                                                 -1, -1, -1, -1));
    h = _mm256_permute4x64_epi64(h, 0x08); /* qwords 0, 2 */
    return _mm256_cvtph_ps(_mm256_castsi256_si128(h));
}

/* runs r0..r1-1 of a group of the runs of 32 into P */
ALWAYS void b32_panel(int type, int vnni, const uint8_t *w, int64_t rb, int nc, int64_t r0,
                      int64_t r1, int64_t runs, const uint8_t *pf, qrun *P) {
    const int off = code_offset(type);
    const __m256i rows = lane_offsets(rb);
    for (int64_t r = r0; r < r1; r++) {
        qrun *p = P + (r - r0);
        __m256i q[QG];
        float d;
        prefetch_part(pf, r, runs, QG * rb);
        for (int c = 0; c < QG; c++) /* lanes past nc multiply zeros */
            q[c] = c < nc ? b32_q8_codes(type, vnni, w + c * rb, r, &d) : _mm256_setzero_si256();
        transpose8(q, off || vnni ? p->u : p->s);
        if (!off && !vnni)
            for (int g = 0; g < 8; g++) p->u[g] = _mm256_sign_epi8(p->s[g], p->s[g]);
        p->d = b32_scales(type, w, rb, nc, r, rows);
    }
}

/* super-blocks b0..b1-1 of a K-quant group into P (eight runs each) */
ALWAYS void k_panel(int type, int vnni, const uint8_t *w, int64_t rb, int nc, int64_t b0,
                    int64_t b1, int64_t nb, const uint8_t *pf, qrun *P) {
    _Alignas(32) kblock k[QG];
    const __m256i lo2 = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1,
                                         0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
    const __m256i hi2 = _mm256_add_epi8(lo2, _mm256_set1_epi8(2));
    for (int c = nc; c < QG; c++) memset(&k[c], 0, sizeof k[c]); /* lanes past nc: zeros */
    for (int64_t b = b0; b < b1; b++) {
        __m256 d, dm;
        _Alignas(32) __m256i scs[8], mns[8];
        prefetch_part(pf, b, nb, QG * rb);
        k_decode_group(type, w, rb, nc, b, k, &d, &dm, scs, mns);
        for (int j = 0; j < 8; j++) { /* run j: codes 32j.., scales 2j (codes 0-15), 2j+1 */
            qrun *p = P + 8 * (b - b0) + j;
            __m256i q[QG];
            for (int c = 0; c < QG; c++) /* lanes past nc multiply zeros */
                q[c] = c < nc ? _mm256_load_si256((const __m256i *)(k[c].q + 32 * j))
                              : _mm256_setzero_si256();
            transpose8(q, p->u);
            if (k_steps(type)) { /* the float scales d*sc, dmin*m of the run (lane: row) */
                p->d = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(scs[j], 16), 16)));
                p->dm = _mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(mns[j], 16), 16)));
                continue;
            }
            if (vnni) { /* int32 scales: sc[2j], sc[2j+1] */
                p->sc[0] = _mm256_srai_epi32(_mm256_slli_epi32(scs[j], 16), 16);
                p->sc[1] = _mm256_srai_epi32(scs[j], 16);
            } else {
                p->sc[0] = _mm256_shuffle_epi8(scs[j], lo2); /* both halves: sc[2j] */
                p->sc[1] = _mm256_shuffle_epi8(scs[j], hi2);
            }
            p->mn = mns[j];
            p->d = d;
            p->dm = dm;
        }
    }
}

/* four bytes as an int32 (memcpy: the buffer's bytes were written as other types) */
ALWAYS int32_t load_i32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* four codes of x (bytes 4g..4g+3 of a run's codes at xq) in every dword */
#define XB(xq, g) _mm256_set1_epi32(load_i32((xq) + 4 * (g)))

/* x's run at xr: d_x * (float)(the sum of its 32 codes), k_steps()'s x-side scale */
ALWAYS float x_bsum_scaled(const uint8_t *xr) {
    float dx;
    int16_t bs[2];
    memcpy(&dx, xr, 4);
    memcpy(bs, xr + 4, 4);
    return dx * (float)(bs[0] + bs[1]);
}

/* one row of x's run into its QG accumulators: (float)s * (d_w * d_x), and for the K-quants
 * minus (float)(m * x's code sums) * (dmin * d_x); the codes' offset (q8_offset) comes off s first. x's two
 * 16-code sums sit in both int16 halves of every lane of `bsum`. Q4_K, Q5_K (k_steps): s has no
 * scale in it, d and dm are d*sc and dmin*m, and the min's step is -(d_x * bsum) * (dmin*m). */
ALWAYS __m256 q8_scale_run(int type, int off, __m256i s, const uint8_t *xr, __m256 d, __m256 dm,
                           __m256i mn, __m256 a) {
    __m256 dx = _mm256_broadcast_ss((const float *)xr);
    if (k_steps(type)) {
        a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, dx), a);
        return _mm256_fnmadd_ps(_mm256_set1_ps(x_bsum_scaled(xr)), dm, a);
    }
    __m256i bsum = _mm256_set1_epi32(load_i32(xr + 4));
    if (off) s = _mm256_sub_epi32(s, _mm256_madd_epi16(bsum, _mm256_set1_epi16((short)off)));
    if (runs32(type) == 0) s = _mm256_sub_epi32(s, _mm256_madd_epi16(mn, bsum)); /* Q6_K */
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, dx), a);
}

/* R (<= QR; 4 on AVX2) rows of x (from x, run 0 of the slab) against the slab's nr runs, into
 * acc[0..R-1].
 * Unsigned codes (Q4_0, Q5_0, K-quants): the int16 products of `sum16` vectors are added before
 * one madd (at most sum16 * 2 * code max * 127 < 2^15: 8 for 4-bit codes, 4 for 5-bit, 2 for
 * Q6_K's 6-bit). Signed (Q8_0, IQ4): the sign trick (|q| against x with q's signs; |-128| reads
 * 128 unsigned), one madd each. The rows' values are named (ROWS spells them out): GCC keeps
 * arrays of vectors in memory here. */
#define ROWS(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7)
/* CALL(h) with h the constant tile height n (1..8): each height's row loops unroll */
#define BY_HEIGHT(n, CALL)                                                                    \
    switch (n) {                                                                              \
    case 8: CALL(8); break;                                                                   \
    case 7: CALL(7); break;                                                                   \
    case 6: CALL(6); break;                                                                   \
    case 5: CALL(5); break;                                                                   \
    case 4: CALL(4); break;                                                                   \
    case 3: CALL(3); break;                                                                   \
    case 2: CALL(2); break;                                                                   \
    default: CALL(1); break;                                                                  \
    }
#define XQ(i, g) XB(x + (i) * ldx + X32_Q, g)
ALWAYS void q8_rows(int type, int vnni, const qrun *P, int64_t nr, const uint8_t *x, int64_t ldx,
                    int R, __m256 *acc) {
    const int kq = runs32(type) == 0, off = q8_offset(type, vnni);
    const int sum16 = kq ? (type == T_Q6_K ? 2 : 4) : type == T_Q4_0 ? 8 : 4;
    const __m256i ones = _mm256_set1_epi16(1), zero = _mm256_setzero_si256();
#define LOAD_A(i) __m256 a##i = R > i ? acc[i] : _mm256_setzero_ps();
    ROWS(LOAD_A)
    for (int64_t r = 0; r < nr; r++, x += X32_BYTES) {
        const qrun *p = P + r;
        __m256i s0 = zero, s1 = zero, s2 = zero, s3 = zero, s4 = zero, s5 = zero, s6 = zero, s7 = zero;
        if (vnni) { /* two chains a row: codes 0-15 (a K-quant's first scale) and 16-31 */
            __m256i t0 = zero, t1 = zero, t2 = zero, t3 = zero, t4 = zero, t5 = zero, t6 = zero, t7 = zero;
            for (int g = 0; g < 4; g++) {
                __m256i u = p->u[g], v = p->u[g + 4];
#define S_VNNI(i)                                                                             \
    if (R > i) {                                                                              \
        s##i = dpbusd(vnni, s##i, u, XQ(i, g));                                               \
        t##i = dpbusd(vnni, t##i, v, XQ(i, g + 4));                                           \
    }
                ROWS(S_VNNI)
            }
#define S_JOIN(i)                                                                             \
    if (R > i)                                                                                \
        s##i = type == T_Q6_K ? _mm256_add_epi32(_mm256_mullo_epi32(s##i, p->sc[0]),          \
                                     _mm256_mullo_epi32(t##i, p->sc[1]))                       \
                  : _mm256_add_epi32(s##i, t##i);
            ROWS(S_JOIN)
        } else if (kq || off) { /* one row's int16 sum at a time: few values live, no spills */
            for (int g0 = 0; g0 < 8; g0 += sum16) {
                __m256i m = type == T_Q6_K ? p->sc[g0 / 4] : ones;
#define S_UNSIGNED(i)                                                                         \
    if (R > i) {                                                                              \
        __m256i h = _mm256_maddubs_epi16(p->u[g0], XQ(i, g0));                                \
        for (int g = g0 + 1; g < g0 + sum16; g++)                                             \
            h = _mm256_add_epi16(h, _mm256_maddubs_epi16(p->u[g], XQ(i, g)));                 \
        s##i = _mm256_add_epi32(s##i, _mm256_madd_epi16(h, m));                               \
    }
                ROWS(S_UNSIGNED)
            }
        } else {
            for (int g = 0; g < 8; g++) {
                __m256i u = p->u[g], sg = p->s[g];
#define S_SIGNED(i)                                                                           \
    if (R > i)                                                                                \
        s##i = _mm256_add_epi32(                                                              \
            s##i, _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(XQ(i, g), sg)), ones));
                ROWS(S_SIGNED)
            }
        }
#define EPILOGUE(i) if (R > i) a##i = q8_scale_run(type, off, s##i, x + i * ldx, p->d, p->dm, p->mn, a##i);
        ROWS(EPILOGUE)
    }
#define STORE_A(i) if (R > i) acc[i] = a##i;
    ROWS(STORE_A)
#undef LOAD_A
#undef S_UNSIGNED
#undef S_SIGNED
#undef S_VNNI
#undef S_JOIN
#undef EPILOGUE
#undef STORE_A
}
#undef XQ

/* ---- q8 on AVX2 for 1..QD rows of x: the same integers and float steps without a panel ----
 * Each weight row's run meets a row of x in place (lanes: groups of four values); one reduction
 * per row of x leaves the QG dot products in the lanes, then the panel path's epilogue. Cheaper
 * than building a panel when it would serve one or two rows of x. */
#define QD 2 /* rows of x up to which q8_direct runs */
/* rows of x up to which the K-quants run the decode kernels (gguf_kdecode_*.c), QD rows a call
 * while the group's weight rows sit in L1/L2: 3584 x 18944 Q4_K, 2 threads, this Xeon, rows in
 * L3, AVX-512: 3 rows 3.2 -> 2.8 ms, 4 rows 4.2 -> 3.2 ms (18944 x 3584 Q6_K at 4 rows 5.5 ->
 * 4.5); panels from 5 rows */
#define KD_MAX_ROWS 4

/* a K-quant decode kernel (wide: tidal_gguf_kdecode16, else tidal_gguf_kdecode8) over M <= KD_MAX_ROWS rows of x,
 * QD at a time (the next rows fetched during the first); 0, or -1 where it does not take them */
static int kdecode_rows(int type, const uint8_t *w, int64_t rb, int nc, int64_t nb,
                        const uint8_t *next, const uint8_t *x, int64_t ldx, int64_t M, float *y,
                        int64_t ldy, int vex, int wide) {
    /* Q6_K at 3 rows (a call of 2, one of 1) measured 4.1-4.4 ms against the panels' 3.7 */
    if (M > KD_MAX_ROWS || (type == T_Q6_K && M == 3)) return -1;
    for (int64_t m = 0; m < M; m += QD) {
        int mr = (int)(M - m < QD ? M - m : QD);
        const uint8_t *nx = m == 0 ? next : NULL;
        int rc = wide ? tidal_gguf_kdecode16(type, w, rb, nc, nb, nx, x + m * ldx, ldx, mr, y + m * ldy, ldy)
                      : tidal_gguf_kdecode8(type, vex, w, rb, nc, nb, nx, x + m * ldx, ldx, mr, y + m * ldy, ldy);
        if (rc) return rc; /* only the first call can refuse: the same type and nc */
    }
    return 0;
}

/* lo[c], hi[c]: the sums of lanes 0-3 and 4-7 of p_c (exact; unpacks, cheaper than hadd here) */
ALWAYS __m256i pair_sums(__m256i a, __m256i b) { /* per half: a0+a2, b0+b2, a1+a3, b1+b3 */
    return _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
}
ALWAYS __m256i quad_sums(__m256i t, __m256i u) { /* per half: the four lanes' sums of a, b, c, d */
    return _mm256_add_epi32(_mm256_unpacklo_epi64(t, u), _mm256_unpackhi_epi64(t, u));
}
ALWAYS void hsum8x8_halves(__m256i p0, __m256i p1, __m256i p2, __m256i p3, __m256i p4,
                           __m256i p5, __m256i p6, __m256i p7, __m256i *lo, __m256i *hi) {
    __m256i a = quad_sums(pair_sums(p0, p1), pair_sums(p2, p3));
    __m256i b = quad_sums(pair_sums(p4, p5), pair_sums(p6, p7));
    /* a: the low halves' sums of p0..p3, then their high halves' (b: p4..p7) */
    *lo = _mm256_permute2x128_si256(a, b, 0x20);
    *hi = _mm256_permute2x128_si256(a, b, 0x31);
}

#define COL8(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7)
ALWAYS void q8_direct(int type, int vnni, const uint8_t *w, int64_t rb, int nc, int64_t nb,
                      const uint8_t *next, const uint8_t *x, int64_t ldx, int R, float *y,
                      int64_t ldy) {
    const int kq = runs32(type) == 0, off = q8_offset(type, vnni);
    const int64_t runs = kq ? 8 * nb : nb * runs32(type);
    const __m256i ones = _mm256_set1_epi16(1), zero = _mm256_setzero_si256();
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    if (!kq) {
        const __m256i rows = lane_offsets(rb);
        for (int64_t r = 0; r < runs; r++) {
            prefetch_part(next, r, runs, QG * rb);
            float dd;
#define DECODE(c)                                                                             \
    __m256i q##c = zero;                                                                      \
    if (c < nc) q##c = b32_q8_codes(type, vnni, w + c * rb, r, &dd);
            COL8(DECODE)
#undef DECODE
            __m256 d = b32_scales(type, w, rb, nc, r, rows);
#define ROW_B32(i)                                                                            \
    if (R > i) {                                                                              \
        const uint8_t *xr = x + i * ldx + r * X32_BYTES;                                       \
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xr + X32_Q)), lo, hi;               \
        COL8(DOT)                                                                             \
        hsum8x8_halves(p0, p1, p2, p3, p4, p5, p6, p7, &lo, &hi);                              \
        a##i = q8_scale_run(type, off, _mm256_add_epi32(lo, hi), xr, d, d, zero, a##i);       \
    }
#define DOT(c)                                                                                \
    __m256i p##c;                                                                             \
    if (vnni) p##c = dpbusd(vnni, zero, q##c, xv);                                            \
    else {                                                                                    \
        p##c = off ? _mm256_maddubs_epi16(q##c, xv)                                           \
                   : _mm256_maddubs_epi16(_mm256_sign_epi8(q##c, q##c), _mm256_sign_epi8(xv, q##c)); \
        p##c = _mm256_madd_epi16(p##c, ones);                                                 \
    }
            ROW_B32(0)
            ROW_B32(1)
#undef DOT
#undef ROW_B32
        }
    } else {
        _Alignas(32) kblock k[QG];
        for (int c = nc; c < QG; c++) memset(&k[c], 0, sizeof k[c]); /* lanes past nc: zeros */
        for (int64_t b = 0; b < nb; b++) {
            __m256 d, dm;
            _Alignas(32) __m256i scs[8], mns[8]; /* run j, lane c: (sc or mn)[2j] | [2j+1] << 16 */
            k_decode_group(type, w, rb, nc, b, k, &d, &dm, scs, mns);
            for (int j = 0; j < 8; j++) {
                prefetch_part(next, 8 * b + j, 8 * nb, QG * rb); /* a run's share at a time */
                __m256i sca = _mm256_srai_epi32(_mm256_slli_epi32(scs[j], 16), 16);
                __m256i scb = _mm256_srai_epi32(scs[j], 16);
                __m256i mn = mns[j];
                __m256 ws = d, wm = dm; /* k_steps(): d*sc, dmin*m */
                if (k_steps(type)) {
                    ws = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sca));
                    wm = _mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(mn, 16), 16)));
                }
#define ROW_K(i)                                                                              \
    if (R > i) {                                                                              \
        const uint8_t *xr = x + i * ldx + (8 * b + j) * X32_BYTES;                             \
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xr + X32_Q)), lo, hi;               \
        COL8(DOT)                                                                             \
        hsum8x8_halves(p0, p1, p2, p3, p4, p5, p6, p7, &lo, &hi);                              \
        __m256i s = k_steps(type) ? _mm256_add_epi32(lo, hi)                                  \
                                  : _mm256_add_epi32(_mm256_mullo_epi32(lo, sca), _mm256_mullo_epi32(hi, scb)); \
        a##i = q8_scale_run(type, off, s, xr, ws, wm, mn, a##i);                              \
    }
#define DOT(c)                                                                                \
    __m256i kc##c = _mm256_load_si256((const __m256i *)(k[c].q + 32 * j));                    \
    __m256i p##c = vnni ? dpbusd(vnni, zero, kc##c, xv) : _mm256_madd_epi16(_mm256_maddubs_epi16(kc##c, xv), ones);
                ROW_K(0)
                ROW_K(1)
#undef DOT
#undef ROW_K
            }
        }
    }
    _Alignas(32) float out[2][QG];
    _mm256_store_ps(out[0], a0);
    _mm256_store_ps(out[1], a1);
    for (int i = 0; i < R; i++) memcpy(y + i * ldy, out[i], sizeof(float) * (size_t)nc);
}
#undef COL8

/* nc (<= QG) weight rows from w (row bytes rb, nb blocks each) against M rows of the quantized
 * x (the 32-form, row stride ldx): y[m * ldy + c]. `next`: the group after this one (or NULL),
 * fetched while the first rows of x run. */
ALWAYS void q8_group(int type, int vnni, const uint8_t *w, int64_t rb, int nc, int64_t nb,
                     const uint8_t *next, const uint8_t *x, int64_t ldx, int64_t M, float *y,
                     int64_t ldy) {
    const int kq = runs32(type) == 0;
    const int64_t runs = kq ? 8 * nb : nb * runs32(type);
    /* a decode step's K-quants: eight rows in registers (gguf_kdecode_avx2.c, same bits) */
    if (kq && vnni != VNNI_EVEX
        && kdecode_rows(type, w, rb, nc, nb, next, x, ldx, M, y, ldy, vnni == VNNI_VEX, 0) == 0)
        return;
    if (M <= QD) {
        if (M == 2) q8_direct(type, vnni, w, rb, nc, nb, next, x, ldx, 2, y, ldy);
        else q8_direct(type, vnni, w, rb, nc, nb, next, x, ldx, 1, y, ldy);
        return;
    }
    _Alignas(32) qrun P[QSLAB];
    _Alignas(32) float acc[QM][QG];
    const int64_t qm = vnni ? QM : 64; /* VNNI: 1.0-1.09x at 512 rows from 64 (Zen 4) */
    for (int64_t m0 = 0; m0 < M; m0 += qm) {
        int64_t mq = M - m0 < qm ? M - m0 : qm;
        for (int64_t i = 0; i < mq; i++) _mm256_store_ps(acc[i], _mm256_setzero_ps());
        for (int64_t r0 = 0; r0 < runs; r0 += QSLAB) {
            int64_t r1 = r0 + QSLAB < runs ? r0 + QSLAB : runs;
            const uint8_t *pf = m0 == 0 ? next : NULL;
            if (kq) k_panel(type, vnni, w, rb, nc, r0 / 8, r1 / 8, nb, pf, P);
            else b32_panel(type, vnni, w, rb, nc, r0, r1, runs, pf, P);
            const uint8_t *xs = x + m0 * ldx + r0 * X32_BYTES;
            /* EVEX: 32 registers (8 rows: 3-10% on the K-quants); AVX2 and VEX: 16 */
            const int qr = vnni == VNNI_EVEX ? QR : 4;
            for (int64_t i = 0; i < mq; i += qr) {
                __m256 a[QR];
                int R = (int)(mq - i < qr ? mq - i : qr);
                for (int t = 0; t < R; t++) a[t] = _mm256_load_ps(acc[i + t]);
#define Q8_ROWS(h) q8_rows(type, vnni, P, r1 - r0, xs + i * ldx, ldx, h, a)
                BY_HEIGHT(R, Q8_ROWS)
#undef Q8_ROWS
                for (int t = 0; t < R; t++) _mm256_store_ps(acc[i + t], a[t]);
            }
        }
        for (int64_t i = 0; i < mq; i++) {
            float *yr = y + (m0 + i) * ldy;
            if (nc == QG) _mm256_storeu_ps(yr, _mm256_load_ps(acc[i]));
            else memcpy(yr, acc[i], sizeof(float) * (size_t)nc);
        }
    }
}

/* q8 for a group on AVX2, or with VNNI (vnni: VNNI_EVEX where EVEX_BUILT, VNNI_VEX where
 * VEX_BUILT) */
static void q8_group_avx2(int vnni, int type, const uint8_t *w, int64_t rb, int nc, int64_t nb,
                          const uint8_t *next, const uint8_t *x, int64_t ldx, int64_t M,
                          float *y, int64_t ldy) {
    /* one specialization per (type, VNNI or not) */
#define Q8T(t)                                                                                \
    if (EVEX_BUILT && vnni == VNNI_EVEX)                                                      \
        q8_group(t, EVEX_BUILT ? VNNI_EVEX : 0, w, rb, nc, nb, next, x, ldx, M, y, ldy);       \
    else if (VEX_BUILT && vnni == VNNI_VEX)                                                   \
        q8_group(t, VEX_BUILT ? VNNI_VEX : 0, w, rb, nc, nb, next, x, ldx, M, y, ldy);         \
    else q8_group(t, VNNI_NONE, w, rb, nc, nb, next, x, ldx, M, y, ldy);
#define Q8G(t) case t: { Q8T(t) } break;
    switch (type) {
    Q8G(T_Q8_0) Q8G(T_Q4_0) Q8G(T_Q5_0) Q8G(T_IQ4_NL) Q8G(T_IQ4_XS) Q8G(T_Q4_K) Q8G(T_Q5_K)
    default: { Q8T(T_Q6_K) } break;
    }
#undef Q8G
#undef Q8T
}

static void quant_x_avx2(const float *x, int64_t K, uint8_t *dst) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undoes packs' lane mix */
    for (int64_t g = 0; g < K / 32; g++, x += 32, dst += X32_BYTES) {
        __m256 mx = _mm256_setzero_ps();
        for (int i = 0; i < 32; i += 8)
            mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(x + i), absmask));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m256 idv = _mm256_set1_ps(id);
        __m256i v[4];
        for (int k = 0; k < 4; k++)
            v[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), idv));
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]),
                                       _mm256_packs_epi32(v[2], v[3]));
        p = _mm256_permutevar8x32_epi32(p, order);
        _mm256_storeu_si256((__m256i *)(dst + X32_Q), p);
        /* the sums of codes 0-15 and 16-31: int32 lanes 0-3 and 4-7 of madd(maddubs(1, q), 1) */
        __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), p),
                                      _mm256_set1_epi16(1));
        t = _mm256_hadd_epi32(t, t);
        t = _mm256_hadd_epi32(t, t);
        int16_t bsum[2] = {(int16_t)_mm256_extract_epi32(t, 0), (int16_t)_mm256_extract_epi32(t, 4)};
        memcpy(dst, &d, 4);
        memcpy(dst + 4, bsum, 4);
    }
}
#endif /* HAVE_AVX2 */

#ifdef HAVE_AVX512
/* ---- AVX-512 (F, BW, VL) + VNNI, on top of the AVX2 helpers ----
 * Zen 4 runs a 512-bit op as two 256-bit halves (the gain there is in fewer instructions), Zen 5
 * and the Xeons at full width. f32: the 4- and 5-bit codes index a table of their block's 16
 * (32) float weights, one permute per 16 codes where AVX2 widens, converts and scales. q8 runs
 * AVX2's kernels here with vpdpbusd (q8_group_avx2(vnni = 1): the same integers, so the same
 * bits on every path), and past QD rows of x sixteen outputs a vector (q8_group16). */

static inline float hsum16(__m512 v) {
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), hi));
}

static inline __m512 i8x16_ps(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }
static inline __m512i u8x16_epi32(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
static inline __m512 iota16(float from) {
    return _mm512_add_ps(_mm512_set1_ps(from), _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                               11, 12, 13, 14, 15));
}
/* the int32 lanes of ix with bit 4 taken from b4 (vpternlog: b4 where the mask 0x10 is set) */
static inline __m512i with_bit4(__m512i ix, __m512i b4) {
    return _mm512_ternarylogic_epi32(ix, b4, _mm512_set1_epi32(0x10), 0xD8);
}

/* Weight lookup (f32). A byte of two nibbles widened to an int32 lane indexes the table with
 * its low nibble as it is (vpermps reads bits 0-3, vpermt2ps bits 0-4) and with its high one
 * after a shift: lanes stay in code order, so x is read as it lies. The 32-blocks' tables hold
 * their dequantized values bit for bit (d*(i-8), d*K[i], d*(i-16)); the K-quants' hold
 * fmsub(i, d*sc, dmin*m), the one rounding AVX2's f32 decode makes too. */

/* run g's 32 weights as floats: w[0..15], w[16..31]. Q8_0's 256 codes fit no table: widened
 * from memory, converted and times d (AVX2's decode-then-scale order, 16 lanes wide, measured
 * ~3% faster for a lone row but up to ~10% slower from 4 rows up) */
ALWAYS void b32_weights512(int type, const uint8_t *w, int64_t g, __m512 *w0, __m512 *w1) {
    const uint8_t *b = w + g * block_bytes(type), *qs = b + 2;
    if (type == T_Q8_0) {
        __m512 dv = _mm512_set1_ps(half_f16c(b));
        *w0 = _mm512_mul_ps(dv, i8x16_ps(_mm_loadu_si128((const __m128i *)qs)));
        *w1 = _mm512_mul_ps(dv, i8x16_ps(_mm_loadu_si128((const __m128i *)(qs + 16))));
        return;
    }
    float d;
    if (type == T_IQ4_XS) {
        const uint8_t *sb = w + (g >> 3) * 136;
        d = xs_scale(sb, (int)(g & 7), half_f16c(sb));
        qs = sb + 8 + 16 * (g & 7);
    } else {
        d = half_f16c(b);
    }
    __m512 dv = _mm512_set1_ps(d);
    __m512i v = u8x16_epi32(type == T_Q5_0 ? b + 6 : qs), v4 = _mm512_srli_epi32(v, 4);
    if (type == T_Q5_0) { /* qh bit i is bit 4 of code i: lane i's index bit 4 */
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        __m512 lo = _mm512_mul_ps(dv, iota16(-16.0f)), hi = _mm512_mul_ps(dv, iota16(0.0f));
        const __m512i bit4 = _mm512_set1_epi32(0x10);
        __m512i c0 = _mm512_andnot_si512(bit4, v); /* v4 has no bit 4 */
        __m512i i0 = _mm512_mask_or_epi32(c0, (__mmask16)qh, c0, bit4);
        __m512i i1 = _mm512_mask_or_epi32(v4, (__mmask16)(qh >> 16), v4, bit4);
        *w0 = _mm512_permutex2var_ps(lo, i0, hi);
        *w1 = _mm512_permutex2var_ps(lo, i1, hi);
        return;
    }
    __m512 t;
    if (type == T_Q4_0) {
        t = _mm512_mul_ps(dv, iota16(-8.0f));
    } else {
        t = _mm512_mul_ps(dv, i8x16_ps(_mm_loadu_si128((const __m128i *)IQ4NL_VALUES)));
    }
    *w0 = _mm512_permutexvar_ps(v, t);
    *w1 = _mm512_permutexvar_ps(v4, t);
}

/* run b into the rows' accumulators: one FMA per 16 values and row, two chains a row (one
 * would leave a lone row waiting on the FMA latency) */
ALWAYS void b32_f32_step512(int type, const uint8_t *w, const uint8_t *x, int64_t ldx, int64_t b,
                            int mt, __m512 *acc) {
    __m512 w0, w1;
    b32_weights512(type, w, b, &w0, &w1);
    EACH_ROW(i) {
        const float *xr = (const float *)(x + i * ldx) + 32 * b;
        acc[2 * i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[2 * i]);
        acc[2 * i + 1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[2 * i + 1]);
    }
}

ALWAYS void b32_f32_avx512(int type, const uint8_t *w, int64_t nb, const uint8_t *x, int64_t ldx,
                           int mt, float *out) {
    __m512 acc[2 * MT];
    EACH_ROW(i) acc[2 * i] = acc[2 * i + 1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb * runs32(type); b++) b32_f32_step512(type, w, x, ldx, b, mt, acc);
    EACH_ROW(i) out[i] = hsum16(_mm512_add_ps(acc[2 * i], acc[2 * i + 1]));
}

/* The 64 weights 64c..64c+63 of super-block b (sub-blocks 2c, 2c+1) as four groups of 16.
 * Q4_K/Q5_K: the 32 bytes qs[32c..] hold sub-block 2c's codes (low nibbles) and 2c+1's (high),
 * looked up in fmsub(i, d*sc, dmin*m) for i < 16 (32: Q5_K's bit 4 from qh, bit j of byte i for
 * code i of sub-block j). Q6_K (6-bit codes, a scale per 16): k->q holds q - 32, widened and
 * converted, times d*sc. */
ALWAYS void k_weights512(int type, const uint8_t *b, const kblock *k, int c, __m512 wv[4]) {
    if (type == T_Q6_K) {
        for (int t = 0; t < 4; t++) {
            __m128i q = _mm_load_si128((const __m128i *)(k->q + 64 * c + 16 * t));
            wv[t] = _mm512_mul_ps(i8x16_ps(q), _mm512_set1_ps(k->fs[4 * c + t]));
        }
        return;
    }
    const uint8_t *qs = b + (type == T_Q5_K ? 48 : 16) + 32 * c;
    __m512 ta[2], tb[2]; /* sub-block 2c's table (codes 0-15, 16-31), 2c+1's */
    for (int h = 0; h < (type == T_Q5_K ? 2 : 1); h++) {
        __m512 i = iota16(16.0f * (float)h);
        ta[h] = _mm512_fmsub_ps(i, _mm512_set1_ps(k->fs[4 * c]), _mm512_set1_ps(k->fm[4 * c]));
        tb[h] = _mm512_fmsub_ps(i, _mm512_set1_ps(k->fs[4 * c + 2]),
                                _mm512_set1_ps(k->fm[4 * c + 2]));
    }
    for (int h = 0; h < 2; h++) { /* codes 16h..16h+15 of both sub-blocks */
        __m512i v = u8x16_epi32(qs + 16 * h), v4 = _mm512_srli_epi32(v, 4);
        if (type == T_Q4_K) {
            wv[h] = _mm512_permutexvar_ps(v, ta[0]);
            wv[2 + h] = _mm512_permutexvar_ps(v4, tb[0]);
        } else {
            __m512i qh = u8x16_epi32(b + 16 + 16 * h); /* bit j: sub-block j's bit 4 */
            __m512i ha = 2 * c < 4 ? _mm512_slli_epi32(qh, 4 - 2 * c)
                                   : _mm512_srli_epi32(qh, 2 * c - 4);
            __m512i hb = 2 * c + 1 < 4 ? _mm512_slli_epi32(qh, 3 - 2 * c)
                                       : _mm512_srli_epi32(qh, 2 * c - 3);
            wv[h] = _mm512_permutex2var_ps(ta[0], with_bit4(v, ha), ta[1]);
            wv[2 + h] = _mm512_permutex2var_ps(tb[0], with_bit4(v4, hb), tb[1]);
        }
    }
}

/* k_f32_rows with 16-wide vectors and decoded weights: each row costs one FMA per 16 values,
 * group g (16 values, one scale) feeding chain g % 4, which keeps a lone row (M = 1) off the
 * FMA latency; the chains are added in a fixed order into the row's accumulator. */
ALWAYS void k_f32_rows512(int type, const uint8_t *blk, const kblock *k, float *wf, int wmode,
                          const uint8_t *x, int64_t ldx, int64_t b, int R, __m512 *acc) {
    __m512 c[K_ROWS][4];
    _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++) {
        __m512 wv[4];
        if (wmode == W_LOAD) {
            for (int t = 0; t < 4; t++) wv[t] = _mm512_load_ps(wf + 64 * q + 16 * t);
        } else {
            k_weights512(type, blk, k, q, wv);
            if (wmode == W_STORE)
                for (int t = 0; t < 4; t++) _mm512_store_ps(wf + 64 * q + 16 * t, wv[t]);
        }
        for (int r = 0; r < R; r++) {
            const float *xr = (const float *)(x + r * ldx) + 256 * b + 64 * q;
            for (int t = 0; t < 4; t++) {
                __m512 xv = _mm512_loadu_ps(xr + 16 * t);
                c[r][t] = q == 0 ? _mm512_mul_ps(wv[t], xv) : _mm512_fmadd_ps(wv[t], xv, c[r][t]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        __m512 s = _mm512_add_ps(_mm512_add_ps(c[r][0], c[r][1]), _mm512_add_ps(c[r][2], c[r][3]));
        acc[r] = _mm512_add_ps(acc[r], s);
    }
}

ALWAYS void k_f32_avx512(int type, const uint8_t *w, int64_t nb, const uint8_t *x, int64_t ldx,
                         int mt, float *out) {
    _Alignas(64) kblock k;
    _Alignas(64) float wf[256];
    __m512 acc[MT];
    EACH_ROW(i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * block_bytes(type);
        if (type == T_Q6_K) {
            k_decode_avx2(type, blk, &k, 1);
            for (int i = 0; i < 8; i++) {
                __m256i *q = (__m256i *)k.q + i;
                _mm256_store_si256(q, _mm256_sub_epi8(_mm256_load_si256(q), _mm256_set1_epi8(32)));
            }
        } else {
            k_scales_avx2(type, blk, &k, 1); /* the codes are read from the block itself */
        }
        int r = 0;
        if (mt > K_ROWS) {
            k_f32_rows512(type, blk, &k, wf, W_STORE, x, ldx, b, K_ROWS, acc);
            r = K_ROWS;
        }
        int wm = r ? W_LOAD : W_CONVERT;
        for (; r + K_ROWS <= mt; r += K_ROWS)
            k_f32_rows512(type, blk, &k, wf, wm, x + r * ldx, ldx, b, K_ROWS, acc + r);
        if (mt - r == 3) k_f32_rows512(type, blk, &k, wf, wm, x + r * ldx, ldx, b, 3, acc + r);
        if (mt - r == 2) k_f32_rows512(type, blk, &k, wf, wm, x + r * ldx, ldx, b, 2, acc + r);
        if (mt - r == 1) k_f32_rows512(type, blk, &k, wf, wm, x + r * ldx, ldx, b, 1, acc + r);
    }
    EACH_ROW(i) out[i] = hsum16(acc[i]);
}

/* ---- q8 with VNNI, sixteen outputs per vector (prompts and batches: M > QD) ----
 * Two groups' panels (b32_panel / k_panel, eight lanes each) sit side by side in one 512-bit
 * vector, so each broadcast of x's codes, each vpdpbusd and each epilogue op serves sixteen
 * outputs where q8_rows spends two of each. Every lane runs q8_rows' integer and float steps in
 * the same order, so the bits are q8_group's (and the scalar kernels'). */
#define QG2 (2 * QG) /* weight rows per pair of groups: one per lane of a 512-bit vector */

typedef struct {
    __m512i u[8];      /* lanes 0-7: the first group's panel vector, 8-15: the second's */
    __m512i sc[2], mn; /* K-quants: as qrun's (int32 scales) */
    __m512 d, dm;
} qrun2;

/* the eight-lane panel P (nr runs) into half h (0: lanes 0-7, 1: lanes 8-15) of P2 */
ALWAYS void panel_half(int type, const qrun *P, int64_t nr, int h, qrun2 *P2) {
    const int kq = runs32(type) == 0;
    for (int64_t r = 0; r < nr; r++) {
        const qrun *p = P + r;
        qrun2 *q = P2 + r;
        for (int g = 0; g < 8; g++) _mm256_store_si256((__m256i *)&q->u[g] + h, p->u[g]);
        _mm256_store_ps((float *)&q->d + 8 * h, p->d);
        if (kq) {
            _mm256_store_si256((__m256i *)&q->sc[0] + h, p->sc[0]);
            _mm256_store_si256((__m256i *)&q->sc[1] + h, p->sc[1]);
            _mm256_store_si256((__m256i *)&q->mn + h, p->mn);
            _mm256_store_ps((float *)&q->dm + 8 * h, p->dm);
        }
    }
}

/* q8_scale_run, sixteen lanes */
ALWAYS __m512 q8_scale_run16(int type, int off, __m512i s, const uint8_t *xr, __m512 d, __m512 dm,
                             __m512i mn, __m512 a) {
    float dxs;
    memcpy(&dxs, xr, 4);
    __m512 dx = _mm512_set1_ps(dxs);
    if (k_steps(type)) {
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, dx), a);
        return _mm512_fnmadd_ps(_mm512_set1_ps(x_bsum_scaled(xr)), dm, a);
    }
    __m512i bsum = _mm512_set1_epi32(load_i32(xr + 4));
    if (off) s = _mm512_sub_epi32(s, _mm512_madd_epi16(bsum, _mm512_set1_epi16((short)off)));
    if (runs32(type) == 0) s = _mm512_sub_epi32(s, _mm512_madd_epi16(mn, bsum)); /* Q6_K */
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, dx), a);
}

/* q8_rows' VNNI branch, sixteen lanes: R (<= QR) rows of x against the slab's nr runs */
#define XQ16(i, g) _mm512_set1_epi32(load_i32(x + (i) * ldx + X32_Q + 4 * (g)))
ALWAYS void q8_rows16(int type, const qrun2 *P, int64_t nr, const uint8_t *x, int64_t ldx, int R,
                      __m512 *acc) {
    const int off = q8_offset(type, 1);
    const __m512i zero = _mm512_setzero_si512();
#define LOAD_A(i) __m512 a##i = R > i ? acc[i] : _mm512_setzero_ps();
    ROWS(LOAD_A)
    for (int64_t r = 0; r < nr; r++, x += X32_BYTES) {
        const qrun2 *p = P + r;
        __m512i s0 = zero, s1 = zero, s2 = zero, s3 = zero, s4 = zero, s5 = zero, s6 = zero, s7 = zero;
        __m512i t0 = zero, t1 = zero, t2 = zero, t3 = zero, t4 = zero, t5 = zero, t6 = zero, t7 = zero;
        for (int g = 0; g < 4; g++) {
            __m512i u = _mm512_load_si512(&p->u[g]), v = _mm512_load_si512(&p->u[g + 4]);
#define S_VNNI(i)                                                                             \
    if (R > i) {                                                                              \
        s##i = _mm512_dpbusd_epi32(s##i, u, XQ16(i, g));                                      \
        t##i = _mm512_dpbusd_epi32(t##i, v, XQ16(i, g + 4));                                  \
    }
            ROWS(S_VNNI)
        }
#define S_JOIN(i)                                                                             \
    if (R > i)                                                                                \
        s##i = type == T_Q6_K ? _mm512_add_epi32(_mm512_mullo_epi32(s##i, p->sc[0]),          \
                                     _mm512_mullo_epi32(t##i, p->sc[1]))                       \
                  : _mm512_add_epi32(s##i, t##i);
        ROWS(S_JOIN)
#define EPILOGUE(i)                                                                           \
    if (R > i) a##i = q8_scale_run16(type, off, s##i, x + i * ldx, p->d, p->dm, p->mn, a##i);
        ROWS(EPILOGUE)
    }
#define STORE_A(i) if (R > i) acc[i] = a##i;
    ROWS(STORE_A)
#undef LOAD_A
#undef S_VNNI
#undef S_JOIN
#undef EPILOGUE
#undef STORE_A
}
#undef XQ16

/* q8_group for nc (<= QG2) weight rows, sixteen lanes: each slab's two eight-row panels are built
 * as q8_group builds them, then side by side (panel_half); a group of up to QG rows runs
 * q8_group itself. M > QD (q8_direct's rows take eight lanes). */
ALWAYS void q8_group16(int type, const uint8_t *w, int64_t rb, int nc, int64_t nb,
                       const uint8_t *next, const uint8_t *x, int64_t ldx, int64_t M, float *y,
                       int64_t ldy) {
    /* a decode step's K-quants: sixteen rows in registers (gguf_kdecode_avx512.c, same bits) */
    if (runs32(type) == 0 && kdecode_rows(type, w, rb, nc, nb, next, x, ldx, M, y, ldy, 0, 1) == 0)
        return;
    if (nc <= QG || M <= QD) {
        for (int n = 0; n < nc; n += QG) {
            const uint8_t *nx = n + QG < nc ? w + (n + QG) * rb : next;
            q8_group(type, VNNI_EVEX, w + n * rb, rb, nc - n < QG ? nc - n : QG, nb, nx, x, ldx, M,
                     y + n, ldy);
        }
        return;
    }
    const int kq = runs32(type) == 0;
    const int64_t runs = kq ? 8 * nb : nb * runs32(type);
    _Alignas(64) qrun P[QSLAB];
    _Alignas(64) qrun2 P2[QSLAB];
    _Alignas(64) float acc[QM][QG2];
    for (int64_t m0 = 0; m0 < M; m0 += QM) {
        int64_t mq = M - m0 < QM ? M - m0 : QM;
        for (int64_t i = 0; i < mq; i++) _mm512_store_ps(acc[i], _mm512_setzero_ps());
        for (int64_t r0 = 0; r0 < runs; r0 += QSLAB) {
            int64_t r1 = r0 + QSLAB < runs ? r0 + QSLAB : runs;
            for (int h = 0; h < 2; h++) {
                const uint8_t *wh = w + h * QG * rb;
                const uint8_t *pf = m0 == 0 && next ? next + h * QG * rb : NULL;
                int nch = h ? nc - QG : QG;
                if (kq) k_panel(type, VNNI_EVEX, wh, rb, nch, r0 / 8, r1 / 8, nb, pf, P);
                else b32_panel(type, VNNI_EVEX, wh, rb, nch, r0, r1, runs, pf, P);
                panel_half(type, P, r1 - r0, h, P2);
            }
            const uint8_t *xs = x + m0 * ldx + r0 * X32_BYTES;
            for (int64_t i = 0; i < mq; i += QR) {
                __m512 a[QR];
                int R = (int)(mq - i < QR ? mq - i : QR);
                for (int t = 0; t < R; t++) a[t] = _mm512_load_ps(acc[i + t]);
#define Q8_ROWS16(h) q8_rows16(type, P2, r1 - r0, xs + i * ldx, ldx, h, a)
                BY_HEIGHT(R, Q8_ROWS16)
#undef Q8_ROWS16
                for (int t = 0; t < R; t++) _mm512_store_ps(acc[i + t], a[t]);
            }
        }
        for (int64_t i = 0; i < mq; i++) {
            float *yr = y + (m0 + i) * ldy;
            if (nc == QG2) _mm512_storeu_ps(yr, _mm512_load_ps(acc[i]));
            else memcpy(yr, acc[i], sizeof(float) * (size_t)nc);
        }
    }
}

/* q8 on AVX-512 VNNI for up to QG2 weight rows: one specialization per type */
static void q8_group16_avx512(int type, const uint8_t *w, int64_t rb, int nc, int64_t nb,
                              const uint8_t *next, const uint8_t *x, int64_t ldx, int64_t M,
                              float *y, int64_t ldy) {
#define Q8G(t) case t: q8_group16(t, w, rb, nc, nb, next, x, ldx, M, y, ldy); break;
    switch (type) {
    Q8G(T_Q8_0) Q8G(T_Q4_0) Q8G(T_Q5_0) Q8G(T_IQ4_NL) Q8G(T_IQ4_XS) Q8G(T_Q4_K) Q8G(T_Q5_K)
    default: q8_group16(T_Q6_K, w, rb, nc, nb, next, x, ldx, M, y, ldy); break;
    }
#undef Q8G
}

#endif /* HAVE_AVX512 */
#ifdef HAVE_AMX
#include "gguf_amx.h"
#endif

/* 1 where the build has AMX and the OS granted this process the tile state (asked here once) */
int tidal_gguf_has_amx(void) {
#ifdef HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

/* ---- one function per (type, act, ISA); constant tile heights let the row loops unroll ---- */
#define TILE(name, body, type)                                                                \
    static void name(const uint8_t *w, int64_t nb, const uint8_t *x, int64_t ldx, int mt,      \
                     float *out) {                                                             \
        switch (mt) {                                                                          \
        case 8: body(type, w, nb, x, ldx, 8, out); break;                                      \
        case 7: body(type, w, nb, x, ldx, 7, out); break;                                      \
        case 6: body(type, w, nb, x, ldx, 6, out); break;                                      \
        case 5: body(type, w, nb, x, ldx, 5, out); break;                                      \
        case 4: body(type, w, nb, x, ldx, 4, out); break;                                      \
        case 3: body(type, w, nb, x, ldx, 3, out); break;                                      \
        case 2: body(type, w, nb, x, ldx, 2, out); break;                                      \
        default: body(type, w, nb, x, ldx, 1, out); break;                                     \
        }                                                                                      \
    }
#define SCALAR_TILE(name, row, type)                                                          \
    static void name(const uint8_t *w, int64_t nb, const uint8_t *x, int64_t ldx, int mt,      \
                     float *out) {                                                             \
        for (int i = 0; i < mt; i++) out[i] = row(type, w, nb, (const void *)(x + i * ldx));    \
    }
#define TYPES(act, isa, T, b32, kq)                                                             \
    T(q8_0_##act##_##isa, b32, T_Q8_0) T(q4_0_##act##_##isa, b32, T_Q4_0)                       \
    T(q5_0_##act##_##isa, b32, T_Q5_0) T(q4_k_##act##_##isa, kq, T_Q4_K)                        \
    T(q5_k_##act##_##isa, kq, T_Q5_K) T(q6_k_##act##_##isa, kq, T_Q6_K)                         \
    T(iq4_nl_##act##_##isa, b32, T_IQ4_NL) T(iq4_xs_##act##_##isa, b32, T_IQ4_XS)
#define TABLE(act, isa)                                                                         \
    [T_Q8_0] = q8_0_##act##_##isa, [T_Q4_0] = q4_0_##act##_##isa,                               \
    [T_Q5_0] = q5_0_##act##_##isa, [T_Q4_K] = q4_k_##act##_##isa,                               \
    [T_Q5_K] = q5_k_##act##_##isa, [T_Q6_K] = q6_k_##act##_##isa,                              \
    [T_IQ4_NL] = iq4_nl_##act##_##isa, [T_IQ4_XS] = iq4_xs_##act##_##isa

TYPES(f32, scalar, SCALAR_TILE, b32_f32_row, k_f32_row)
TYPES(q8, scalar, SCALAR_TILE, b32_q8_row, k_q8_row)
static const tile_fn SCALAR[2][N_TYPES] = {{TABLE(f32, scalar)}, {TABLE(q8, scalar)}};
#ifdef HAVE_AVX2
TYPES(f32, avx2, TILE, b32_f32_avx2, k_f32_avx2)
static const tile_fn AVX2[N_TYPES] = {TABLE(f32, avx2)}; /* q8: q8_group_avx2 */

/* float activations on AVX2, K sliced: kernel steps (runs of 32, or super-blocks) b0..b1-1 of a
 * weight row into the tile's accumulators */
typedef void (*part_fn)(const uint8_t *w, int64_t b0, int64_t b1, const uint8_t *x, int64_t ldx,
                        int mt, __m256 *acc);
#define PART_TILE(name, body, type)                                                           \
    static void name(const uint8_t *w, int64_t b0, int64_t b1, const uint8_t *x, int64_t ldx,  \
                     int mt, __m256 *acc) {                                                    \
        switch (mt) {                                                                          \
        case 8: body(type, w, b0, b1, x, ldx, 8, acc); break;                                  \
        case 7: body(type, w, b0, b1, x, ldx, 7, acc); break;                                  \
        case 6: body(type, w, b0, b1, x, ldx, 6, acc); break;                                  \
        case 5: body(type, w, b0, b1, x, ldx, 5, acc); break;                                  \
        case 4: body(type, w, b0, b1, x, ldx, 4, acc); break;                                  \
        case 3: body(type, w, b0, b1, x, ldx, 3, acc); break;                                  \
        case 2: body(type, w, b0, b1, x, ldx, 2, acc); break;                                  \
        default: body(type, w, b0, b1, x, ldx, 1, acc); break;                                 \
        }                                                                                      \
    }
TYPES(part, avx2, PART_TILE, b32_f32_part_avx2, k_f32_part_avx2)
static const part_fn AVX2_PART[N_TYPES] = {TABLE(part, avx2)};

/* Weight rows lo..hi-1 (one chunk) against every row of x, for a tile whose x rows outgrow L1
 * (K * mt * 4 > SLICE_ABOVE; a whole pass then streams the tile from L2 once per weight row):
 * the chunk's weight rows take the tile's K in slices of SLICE_BYTES of x, so each slice is read
 * from L1 by all of them.
 * Every (row, output)'s accumulator goes through the same operations in the same order as in a
 * whole pass (it waits in memory between slices, exactly), so the bits are a whole pass's. */
static void chunk_sliced_avx2(part_fn fn, const uint8_t *w, int64_t rb, int64_t units,
                              int64_t unit_elems, int64_t nrows, const uint8_t *x, int64_t ldx,
                              int64_t M, int64_t lo, int64_t hi, float *y, int64_t ldy) {
    __m256 acc[CHUNK][MT];
    for (int64_t m = 0; m < M; m += MT) {
        int mt = (int)(M - m < MT ? M - m : MT);
        int64_t su = SLICE_BYTES / (mt * unit_elems * (int64_t)sizeof(float));
        su = su < 1 ? 1 : su;
        for (int64_t n = lo; n < hi; n++)
            for (int i = 0; i < mt; i++) acc[n - lo][i] = _mm256_setzero_ps();
        for (int64_t u0 = 0; u0 < units; u0 += su) {
            int64_t u1 = u0 + su < units ? u0 + su : units;
            for (int64_t n = lo; n < hi; n++) {
                if (m == 0 && u0 == 0 && n + PREFETCH_ROWS < nrows)
                    prefetch(w + (n + PREFETCH_ROWS) * rb, rb);
                fn(w + n * rb, u0, u1, x + m * ldx, ldx, mt, acc[n - lo]);
            }
        }
        for (int64_t n = lo; n < hi; n++)
            for (int i = 0; i < mt; i++) y[(m + i) * ldy + n] = hsum8(acc[n - lo][i]);
    }
}
#endif
#ifdef HAVE_AVX512
TYPES(f32, avx512, TILE, b32_f32_avx512, k_f32_avx512)
static const tile_fn AVX512[N_TYPES] = {TABLE(f32, avx512)}; /* q8: q8_group_avx2, VNNI */
#endif

/* The per-row kernel of (isa, act, type); NULL where the ISA is not built, or where q8 runs
 * q8_group_avx2 (q8_grouped()). */
static tile_fn pick(int isa, int act, int type) {
    if (isa == ISA_SCALAR) return SCALAR[act][type];
    if (act != ACT_F32) return NULL;
#ifdef HAVE_AVX512
    if (isa == ISA_AVX512) return AVX512[type];
#endif
#ifdef HAVE_AVX2
    if (isa == ISA_AVX2) return AVX2[type];
#endif
    return NULL;
}

/* whether q8 on `isa` runs q8_group_avx2 (AVX2, and AVX-512 with VNNI where it is built) */
static int q8_grouped(int isa) {
    (void)isa; /* a build without AVX2 groups nothing */
#ifdef HAVE_AVX512
    if (isa == ISA_AVX512) return 1;
#endif
#ifdef HAVE_AVX2
    if (isa == ISA_AVX2) return 1;
#endif
    return 0;
}

/* a row of x as the 32-form (both ISAs write identical bytes: exact max, one rounding, RNE) */
static void quant_x(int isa, const float *x, int64_t K, uint8_t *dst) {
    (void)isa;
#ifdef HAVE_AVX2
    if (isa == ISA_AVX2 || isa == ISA_AVX512) { quant_x_avx2(x, K, dst); return; }
#endif
    quant_x_scalar(x, K, dst);
}


/* One call's weight segments, read and checked once for both entry points (segments past nseg
 * are empty). */
typedef struct {
    const uint8_t *w;
    int type;
    int64_t n, nb, rb, col0; /* rows, blocks and bytes per row, first output column */
} seg_t;

static int read_segs(const int64_t *segs, int64_t nseg, int64_t K, seg_t sg[MAX_SEG]) {
    if (nseg < 0 || nseg > MAX_SEG) return ERR_SHAPE;
    memset(sg, 0, sizeof(seg_t) * MAX_SEG);
    int64_t col = 0;
    for (int s = 0; s < MAX_SEG; s++) {
        sg[s].col0 = col;
        if (s >= nseg) continue;
        sg[s].w = (const uint8_t *)(intptr_t)segs[3 * s];
        sg[s].type = (int)segs[3 * s + 1];
        sg[s].n = segs[3 * s + 2];
        if (sg[s].n < 0) return ERR_SHAPE;
        col += sg[s].n;
        if (sg[s].n == 0) continue;
        int be = tidal_gguf_block_elems(sg[s].type);
        if (be == 0) return ERR_TYPE;
        if (K <= 0 || K % be) return ERR_SHAPE;
        sg[s].nb = K / be;
        sg[s].rb = sg[s].nb * block_bytes(sg[s].type);
    }
    return 0;
}

/* Weight rows lo..hi-1 of segment g against M rows of x (ldxs bytes apart: floats, or the q8
 * form) by a per-row kernel, MT rows of x a pass; output column n of row m to y[m * ldy + n]. */
static void fn_rows(tile_fn fn, const seg_t *g, int64_t lo, int64_t hi, const uint8_t *xs,
                    int64_t ldxs, int64_t M, float *y, int64_t ldy) {
    float out[MT];
    for (int64_t m = 0; m < M; m += MT) {
        int mt = (int)(M - m < MT ? M - m : MT);
        for (int64_t n = lo; n < hi; n++) {
            if (m == 0 && n + PREFETCH_ROWS < g->n) prefetch(g->w + (n + PREFETCH_ROWS) * g->rb, g->rb);
            fn(g->w + n * g->rb, g->nb, xs + m * ldxs, ldxs, mt, out);
            for (int i = 0; i < mt; i++) y[(m + i) * ldy + n] = out[i];
        }
    }
}

/* Weight rows lo..hi-1 of segment g against M rows of q8 x (row stride r32) on the grouped
 * kernels (q8_grouped(isa)); output column n of row m goes to y[m * ldy + n]. */
static void q8_grouped_rows(int isa, int vex, const seg_t *g, int64_t lo, int64_t hi,
                            const uint8_t *xq, int64_t r32, int64_t M, float *y, int64_t ldy) {
    (void)isa, (void)vex, (void)g, (void)lo, (void)hi, (void)xq, (void)r32, (void)M, (void)y,
        (void)ldy;
#ifdef HAVE_AVX2
#ifdef HAVE_AVX512
    if (isa == ISA_AVX512) { /* sixteen outputs a vector (eight for M <= QD) */
        for (int64_t n = lo; n < hi; n += QG2) {
            const uint8_t *next = n + QG2 < g->n ? g->w + (n + QG2) * g->rb : NULL;
            q8_group16_avx512(g->type, g->w + n * g->rb, g->rb, (int)(hi - n < QG2 ? hi - n : QG2),
                              g->nb, next, xq, r32, M, y + n, ldy);
        }
        return;
    }
#endif
    for (int64_t n = lo; n < hi; n += QG) {
        const uint8_t *next = n + QG < g->n ? g->w + (n + QG) * g->rb : NULL;
        q8_group_avx2(isa == ISA_AVX512 ? VNNI_EVEX : vex ? VNNI_VEX : VNNI_NONE, g->type,
                      g->w + n * g->rb, g->rb, (int)(hi - n < QG ? hi - n : QG), g->nb, next, xq,
                      r32, M, y + n, ldy);
    }
#endif
}

/* segs: nseg (<= MAX_SEG) triples (weight pointer, ggml type, rows N_s) sharing K; segment s goes
 * to y's columns from N_0 + ... + N_{s-1}. Integers are int64_t so that every argument travels as
 * one 64-bit word (the ctypes side passes them all as c_void_p, its fastest conversion). Returns
 * 0, or ERR_* having written nothing. */
int tidal_gguf_gemm(const float *x, int64_t M, int64_t K, int64_t ldx, const int64_t *segs,
                    int64_t nseg, float *y, int64_t ldy, int64_t act, int64_t isa,
                    int64_t nthreads) {
    seg_t sg[MAX_SEG];
    tile_fn fn[MAX_SEG] = {0};
    int64_t nch[MAX_SEG], rows_per[MAX_SEG], total = 0;
    int rc = read_segs(segs, nseg, K, sg);
    if (rc) return rc;
    /* AVX-VNNI is AVX2's path with vpdpbusd for q8's integer sums: AVX2 everywhere else */
    const int vex = isa == ISA_AVX2_VNNI;
    if (vex && !tidal_gguf_has_avx2vnni()) return ERR_ISA;
    if (vex) isa = ISA_AVX2;
    /* AMX is AVX-512's path with the tile unit for q8's integer sums (amx_takes: from 6 or 12
     * rows of x, by type) */
    if (isa == ISA_AMX && !tidal_gguf_has_amx()) return ERR_ISA;
#ifdef HAVE_AMX
    int amx = 0, on_tiles[MAX_SEG] = {0}; /* which segments run on the tile unit */
    for (int s = 0; s < MAX_SEG; s++) {
        on_tiles[s] = isa == ISA_AMX && act == ACT_Q8 && sg[s].n > 0 && amx_takes(sg[s].type, M);
        amx |= on_tiles[s];
    }
    const int64_t amx_tiles = (M + AMX_M - 1) / AMX_M, runs = K / 32;
    amx_xrun *xt = NULL;
    /* panels per unit of work on the tiles: AMX_PANELS, fewer where that would leave under
     * four units a thread */
    int64_t tile_rows = 0;
    for (int s = 0; s < MAX_SEG; s++) tile_rows += on_tiles[s] ? sg[s].n : 0;
    int64_t amx_group = tile_rows / (AMX_N * 4 * (nthreads > 0 ? nthreads : 1));
    amx_group = amx_group < 1 ? 1 : amx_group > AMX_PANELS ? AMX_PANELS : amx_group;
    if (amx_tiles <= 2) amx_group = 1; /* up to 32 rows of x: nothing of x to reuse across panels */
#endif
    if (isa == ISA_AMX) isa = ISA_AVX512;
    if (act != ACT_F32 && act != ACT_Q8) return ERR_SHAPE;
    int grouped = act == ACT_Q8 && q8_grouped((int)isa);
    for (int s = 0; s < MAX_SEG; s++) {
        rows_per[s] = CHUNK;
#ifdef HAVE_AMX
        if (on_tiles[s]) rows_per[s] = AMX_N * amx_group;
#endif
        nch[s] = (sg[s].n + rows_per[s] - 1) / rows_per[s];
        total += nch[s];
        if (sg[s].n == 0 || grouped) continue;
        if (!(fn[s] = pick((int)isa, (int)act, sg[s].type))) return ERR_ISA;
    }
    if (act == ACT_Q8 && !grouped && isa != ISA_SCALAR) return ERR_ISA;
    if (M <= 0 || total == 0) return 0;
    int64_t r32 = K / 32 * X32_BYTES; /* a row of quantized x */
    size_t need = act == ACT_Q8 ? (size_t)(M * r32) : 0;
    _Alignas(64) uint8_t stack[65536]; /* on the caller's stack: M = 32 at K = 1536 fits */
#ifdef HAVE_AVX2
    /* float activations on AVX2: K-sliced tiles where a tile's x outgrows L1 */
    int sliced = act == ACT_F32 && isa == ISA_AVX2 && K * (M < MT ? M : MT) * 4 > SLICE_ABOVE;
#endif
    uint8_t *xq = need <= sizeof(stack) ? stack : malloc(need);
    if (!xq) return ERR_NOMEM;
#ifdef HAVE_AMX
    if (amx && !(xt = aligned_alloc(64, (size_t)(amx_tiles * runs) * sizeof(amx_xrun)))) {
        if (xq != stack) free(xq);
        return ERR_NOMEM;
    }
#endif
#pragma omp parallel num_threads(nthreads > 0 ? (int)nthreads : 1)
    {
        if (act == ACT_Q8) {
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) quant_x((int)isa, x + m * ldx, K, xq + m * r32);
        }
#ifdef HAVE_AMX
        /* the tile path; a thread without its scratch runs AVX-512's (the same bits) */
        uint8_t *scratch = NULL;
        if (amx) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < amx_tiles; t++) {
                int mt = (int)(M - t * AMX_M < AMX_M ? M - t * AMX_M : AMX_M);
                pack_x_amx(xq, r32, t * AMX_M, mt, runs, xt + t * runs);
            }
            size_t bytes = (amx_scratch_bytes(K, M) + 63) / 64 * 64;
            if ((scratch = aligned_alloc(64, bytes))) amx_configure();
        }
#endif
#pragma omp for schedule(static)
        for (int64_t c = 0; c < total; c++) {
            int s = 0;
            int64_t cc = c;
            while (cc >= nch[s]) cc -= nch[s++];
            const seg_t *g = &sg[s];
            int64_t lo = cc * rows_per[s], hi = lo + rows_per[s] < g->n ? lo + rows_per[s] : g->n;
#ifdef HAVE_AMX
            if (scratch && on_tiles[s]) {
                const uint8_t *next = hi < g->n ? g->w + hi * g->rb : NULL;
                AMX_ROWS_FN[g->type](g->w + lo * g->rb, g->rb, (int)(hi - lo), g->nb, K, next, xt,
                                     M, y + g->col0 + lo, ldy, scratch);
                continue;
            }
#endif
            if (grouped) {
                q8_grouped_rows((int)isa, vex, g, lo, hi, xq, r32, M, y + g->col0, ldy);
                continue;
            }
            const uint8_t *xs = act == ACT_Q8 ? xq : (const uint8_t *)x;
            int64_t ldxs = act == ACT_Q8 ? r32 : ldx * (int64_t)sizeof(float);
#ifdef HAVE_AVX2
            if (sliced) { /* kernel steps: super-blocks, or runs of 32 */
                int kq = runs32(g->type) == 0;
                chunk_sliced_avx2(AVX2_PART[g->type], g->w, g->rb, kq ? g->nb : g->nb * runs32(g->type),
                                  kq ? 256 : 32, g->n, xs, ldxs, M, lo, hi, y + g->col0, ldy);
                continue;
            }
#endif
            fn_rows(fn[s], g, lo, hi, xs, ldxs, M, y + g->col0, ldy);
        }
#ifdef HAVE_AMX
        if (scratch) {
            _tile_release();
            free(scratch);
        }
#endif
    }
#ifdef HAVE_AMX
    free(xt);
#endif
    if (xq != stack) free(xq);
    return 0;
}

/* Grouped products, for mixture-of-experts layers: job j is up to MAX_SEG weight segments (one
 * expert's gate and up, or its down) sharing K, applied to n_j rows of x, the ones listed in
 * rows[r_j .. r_j + n_j) (r_j = n_0 + ... + n_{j-1}); its outputs go to y's rows r_j .. r_j +
 * n_j - 1, segments side by side as tidal_gguf_gemm writes them. jobs holds JOB_WORDS int64s a
 * job: nseg, n_j, then MAX_SEG (pointer, type, rows) triples; a job of no segments keeps its rows
 * of y untouched (the caller computes them another way). One parallel region runs every
 * job's rows (a decode step's experts were a call each); the q8 activations only, on the
 * grouped kernels or scalar C, so each output has the bits tidal_gguf_gemm gives it for the same
 * rows of x on any path. */
#define JOB_WORDS (2 + 3 * MAX_SEG)
int tidal_gguf_gemm_jobs(const float *x, int64_t T, int64_t K, int64_t ldx, const int64_t *jobs,
                         int64_t njobs, const int64_t *rows, float *y, int64_t ldy, int64_t isa,
                         int64_t nthreads) {
    const int vex = isa == ISA_AVX2_VNNI;
    if (vex && !tidal_gguf_has_avx2vnni()) return ERR_ISA;
    if (vex) isa = ISA_AVX2;
    if (isa == ISA_AMX && !tidal_gguf_has_amx()) return ERR_ISA;
    if (isa == ISA_AMX) isa = ISA_AVX512; /* the same bits as the tile unit's */
    int grouped = q8_grouped((int)isa);
    if (!grouped && isa != ISA_SCALAR) return ERR_ISA;
    if (njobs < 0 || T < 0 || K <= 0 || K % 32) return ERR_SHAPE;
    if (njobs == 0) return 0;
    seg_t *sg = malloc(sizeof(seg_t) * MAX_SEG * (size_t)njobs);
    int64_t *r0 = malloc(sizeof(int64_t) * (size_t)(njobs + 1));
    if (!sg || !r0) {
        free(sg), free(r0);
        return ERR_NOMEM;
    }
    int64_t units = 0, width = 0;
    int rc = 0;
    r0[0] = 0;
    for (int64_t j = 0; j < njobs && !rc; j++) {
        const int64_t *jb = jobs + j * JOB_WORDS;
        rc = read_segs(jb + 2, jb[0], K, sg + j * MAX_SEG);
        if (!rc && jb[1] < 0) rc = ERR_SHAPE;
        r0[j + 1] = r0[j] + (rc ? 0 : jb[1]);
        for (int s = 0; !rc && s < MAX_SEG; s++) {
            const seg_t *g = sg + j * MAX_SEG + s;
            if (!grouped && g->n && !SCALAR[ACT_Q8][g->type]) rc = ERR_TYPE;
            units += jb[1] ? (g->n + CHUNK - 1) / CHUNK : 0;
            width = g->col0 + g->n > width ? g->col0 + g->n : width;
        }
    }
    const int64_t nrows = rc ? 0 : r0[njobs];
    for (int64_t r = 0; r < nrows && !rc; r++)
        if (rows[r] < 0 || rows[r] >= T) rc = ERR_SHAPE;
    if (!rc && width > ldy && nrows > 1) rc = ERR_SHAPE;
    const int64_t r32 = K / 32 * X32_BYTES;
    uint8_t *xq = rc ? NULL : malloc((size_t)(nrows * r32) + 1);
    int64_t *unit = rc ? NULL : malloc(sizeof(int64_t) * 3 * (size_t)(units + 1));
    if (!rc && (!xq || !unit)) rc = ERR_NOMEM;
    if (rc) {
        free(sg), free(r0), free(xq), free(unit);
        return rc;
    }
    int64_t u = 0; /* (job, segment, first row) per unit of CHUNK weight rows, job by job */
    for (int64_t j = 0; j < njobs; j++)
        for (int s = 0; s < MAX_SEG && r0[j + 1] > r0[j]; s++)
            for (int64_t lo = 0; lo < sg[j * MAX_SEG + s].n; lo += CHUNK, u++)
                unit[3 * u] = j, unit[3 * u + 1] = s, unit[3 * u + 2] = lo;
#pragma omp parallel num_threads(nthreads > 0 ? (int)nthreads : 1)
    {
#pragma omp for schedule(static)
        for (int64_t j = 0; j < njobs; j++) /* the rows of jobs with segments */
            for (int64_t r = jobs[j * JOB_WORDS] ? r0[j] : r0[j + 1]; r < r0[j + 1]; r++)
                quant_x((int)isa, x + rows[r] * ldx, K, xq + r * r32);
#pragma omp for schedule(static)
        for (int64_t c = 0; c < units; c++) {
            int64_t j = unit[3 * c], lo = unit[3 * c + 2];
            const seg_t *g = sg + j * MAX_SEG + unit[3 * c + 1];
            int64_t hi = lo + CHUNK < g->n ? lo + CHUNK : g->n, M = r0[j + 1] - r0[j];
            const uint8_t *xs = xq + r0[j] * r32;
            float *yj = y + r0[j] * ldy + g->col0;
            if (grouped) {
                q8_grouped_rows((int)isa, vex, g, lo, hi, xs, r32, M, yj, ldy);
                continue;
            }
            fn_rows(SCALAR[ACT_Q8][g->type], g, lo, hi, xs, r32, M, yj, ldy);
        }
    }
    free(sg), free(r0), free(xq), free(unit);
    return 0;
}

/* ---- dequantization, bit-exact with gguf-py's numpy (float32, no fused multiply-add) ---- */

static void dequant_row_scalar(int type, const uint8_t *w, int64_t nb, float *out) {
    if (runs32(type)) {
        int8_t q[32];
        for (int64_t g = 0; g < nb * runs32(type); g++) {
            float d = b32_decode_scalar(type, w, g, q);
            for (int j = 0; j < 32; j++) *out++ = d * (float)q[j];
        }
        return;
    }
    for (int64_t b = 0; b < nb; b++, w += block_bytes(type)) {
        kblock k;
        k_decode_scalar(type, w, &k);
        for (int i = 0; i < 256; i++) {
            float s = k.d * (float)k.sc[i / 16], m = k.dmin * (float)k.mn[i / 16];
            *out++ = type == T_Q6_K ? s * (float)(k.q[i] - 32) : s * (float)k.q[i] - m;
        }
    }
}

#ifdef HAVE_AVX2
ALWAYS void dequant_row_avx2_t(int type, const uint8_t *w, int64_t nb, float *out) {
    if (runs32(type)) {
        for (int64_t g = 0; g < nb * runs32(type); g++, out += 32) {
            float d;
            __m256i q = b32_decode_avx2(type, w, g, &d);
            __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
            __m256 dv = _mm256_set1_ps(d);
            _mm256_storeu_ps(out, _mm256_mul_ps(dv, i8x8_ps(lo)));
            _mm256_storeu_ps(out + 8, _mm256_mul_ps(dv, i8x8_ps(_mm_srli_si128(lo, 8))));
            _mm256_storeu_ps(out + 16, _mm256_mul_ps(dv, i8x8_ps(hi)));
            _mm256_storeu_ps(out + 24, _mm256_mul_ps(dv, i8x8_ps(_mm_srli_si128(hi, 8))));
        }
        return;
    }
    for (int64_t b = 0; b < nb; b++, w += block_bytes(type)) {
        _Alignas(32) kblock k;
        k_decode_avx2(type, w, &k, 1);
        for (int g = 0; g < 32; g++, out += 8) {
            __m256 s = _mm256_broadcast_ss(k.fs + g / 2), m = _mm256_broadcast_ss(k.fm + g / 2);
            __m256 q = u8x8_ps(_mm_loadl_epi64((const __m128i *)(k.q + 8 * g)));
            _mm256_storeu_ps(out, type == T_Q6_K ? _mm256_mul_ps(s, _mm256_sub_ps(q, _mm256_set1_ps(32)))
                                                  : _mm256_sub_ps(_mm256_mul_ps(s, q), m));
        }
    }
}

static void dequant_row_avx2(int type, const uint8_t *w, int64_t nb, float *out) {
    switch (type) {
    case T_Q8_0: dequant_row_avx2_t(T_Q8_0, w, nb, out); break;
    case T_Q4_0: dequant_row_avx2_t(T_Q4_0, w, nb, out); break;
    case T_Q5_0: dequant_row_avx2_t(T_Q5_0, w, nb, out); break;
    case T_IQ4_NL: dequant_row_avx2_t(T_IQ4_NL, w, nb, out); break;
    case T_IQ4_XS: dequant_row_avx2_t(T_IQ4_XS, w, nb, out); break;
    case T_Q4_K: dequant_row_avx2_t(T_Q4_K, w, nb, out); break;
    case T_Q5_K: dequant_row_avx2_t(T_Q5_K, w, nb, out); break;
    default: dequant_row_avx2_t(T_Q6_K, w, nb, out); break;
    }
}
#endif

/* out row i (row stride ldo) = W's row ids[i], or row start + i when ids is NULL; i < count.
 * Returns 0 or ERR_*. Row ids are not checked here: the caller bounds them. */
int tidal_gguf_dequantize(const uint8_t *w, int64_t type, int64_t K, const int64_t *ids,
                          int64_t start, int64_t count, float *out, int64_t ldo, int64_t isa,
                          int64_t nthreads) {
    int be = tidal_gguf_block_elems((int)type);
    if (be == 0) return ERR_TYPE;
    if (K <= 0 || K % be) return ERR_SHAPE;
    if (isa == ISA_AVX2_VNNI && tidal_gguf_has_avx2vnni()) isa = ISA_AVX2; /* no integer sums */
    if (isa == ISA_AMX && tidal_gguf_has_amx()) isa = ISA_AVX512;
    if (isa != ISA_SCALAR && !(isa == ISA_AVX2 && tidal_gguf_has_avx2())
        && !(isa == ISA_AVX512 && tidal_gguf_has_avx512()))
        return ERR_ISA;
    int64_t nb = K / be, rb = nb * block_bytes((int)type);
    /* a few rows (an embedding lookup) are not worth waking the threads */
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? (int)nthreads : 1) \
    if (count * K >= 65536)
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = w + (ids ? ids[i] : start + i) * rb;
#ifdef HAVE_AVX2
        if (isa != ISA_SCALAR) { dequant_row_avx2((int)type, row, nb, out + i * ldo); continue; }
#endif
        dequant_row_scalar((int)type, row, nb, out + i * ldo);
    }
    return 0;
}

/* ---- prefill-sized products on AVX2: decoded panels and a 6 x 16 register kernel ----
 *
 *   y[m, col0 + n] = sum_k x[m, k] * W[n, k], float activations, for many rows of x
 *
 * The float32 product with the dequantized weights, as the tile kernels above and a float32
 * GEMM library compute it, up to summation order: each y[m, n] is one FMA chain over k = 0..K-1
 * in order (one lane of one accumulator), so its bits do not depend on M, on where row m falls
 * in a block of PM rows, on its panel, or on the thread count.
 * Work: W's rows go PN (16) at a time into a panel, decoded by dequant_row_avx2 (the very floats
 * gguf_dequantize gives) and laid out k-major (panel[k][j] = W[n0 + j, k]), zero past W's last
 * row. Groups of consecutive panels (GROUP_BYTES of them) are split statically over the threads;
 * a thread runs each block of PM (6) rows of x through every panel of its group, so the block is
 * read from L1 by all of them and x streams from L3 once per group, not once per panel (8% less
 * time over the bundled model's four shapes at 1024 rows, in one process). Per k, two panel loads
 * and six broadcasts of x feed 12 FMAs into 12 accumulators. Nothing is packed for x, and no float
 * copy of W outlives its group (128 KiB per thread). */
#ifdef HAVE_AVX2
#define PM 6
#define PN 16
/* a thread's group of panels: up to this many bytes of them (in L2 together), MAX_GROUP at most */
#define GROUP_BYTES (128 * 1024)
#define MAX_GROUP 8

/* y rows m0.. (pm of them) x panel columns (pn valid) over all of K. The 12 accumulators are
 * named variables: GCC keeps an array of them in memory, storing it on every k. */
static void panel_block(const float *x, int64_t ldx, int64_t K, const float *panel, int pm,
                        int pn, float *y, int64_t ldy) {
    const float *x0 = x, *x1 = x + (pm > 1 ? 1 : 0) * ldx, *x2 = x + (pm > 2 ? 2 : 0) * ldx;
    const float *x3 = x + (pm > 3 ? 3 : 0) * ldx, *x4 = x + (pm > 4 ? 4 : 0) * ldx;
    const float *x5 = x + (pm > 5 ? 5 : 0) * ldx; /* rows past pm repeat row 0: discarded */
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int64_t k = 0; k < K; k++) {
        __m256 b0 = _mm256_load_ps(panel + k * PN), b1 = _mm256_load_ps(panel + k * PN + 8), a;
#define PANEL_ROW(i)                                                                          \
    a = _mm256_broadcast_ss(x##i + k);                                                         \
    c##i##0 = _mm256_fmadd_ps(a, b0, c##i##0);                                                 \
    c##i##1 = _mm256_fmadd_ps(a, b1, c##i##1);
        PANEL_ROW(0) PANEL_ROW(1) PANEL_ROW(2) PANEL_ROW(3) PANEL_ROW(4) PANEL_ROW(5)
#undef PANEL_ROW
    }
    float out[PM][PN];
    _mm256_storeu_ps(out[0], c00), _mm256_storeu_ps(out[0] + 8, c01);
    _mm256_storeu_ps(out[1], c10), _mm256_storeu_ps(out[1] + 8, c11);
    _mm256_storeu_ps(out[2], c20), _mm256_storeu_ps(out[2] + 8, c21);
    _mm256_storeu_ps(out[3], c30), _mm256_storeu_ps(out[3] + 8, c31);
    _mm256_storeu_ps(out[4], c40), _mm256_storeu_ps(out[4] + 8, c41);
    _mm256_storeu_ps(out[5], c50), _mm256_storeu_ps(out[5] + 8, c51);
    for (int i = 0; i < pm; i++) memcpy(y + i * ldy, out[i], sizeof(float) * (size_t)pn);
}

/* panel[k][j] = W row (n0 + j), k-major; columns j >= pn are 0. row: K floats of scratch */
static void build_panel(int type, const uint8_t *w, int64_t rb, int64_t nb, int64_t K, int64_t n0,
                        int pn, float *row, float *panel) {
    for (int j = 0; j < PN; j++) {
        if (j < pn) dequant_row_avx2(type, w + (n0 + j) * rb, nb, row);
        for (int64_t k = 0; k < K; k++) panel[k * PN + j] = j < pn ? row[k] : 0.0f;
    }
}
#endif

/* Same arguments as tidal_gguf_gemm without act and isa (float activations, AVX2). Returns 0, or
 * ERR_* having written nothing (ERR_ISA where this build or CPU has no AVX2). */
int tidal_gguf_gemm_panels(const float *x, int64_t M, int64_t K, int64_t ldx, const int64_t *segs,
                           int64_t nseg, float *y, int64_t ldy, int64_t nthreads) {
#ifdef HAVE_AVX2
    seg_t sg[MAX_SEG];
    int64_t np[MAX_SEG + 1] = {0}; /* panels before segment s */
    int rc = read_segs(segs, nseg, K, sg);
    if (rc) return rc;
    for (int s = 0; s < MAX_SEG; s++) np[s + 1] = np[s] + (sg[s].n + PN - 1) / PN;
    int64_t total = np[MAX_SEG];
    if (M <= 0 || total == 0) return 0;
    int failed = 0, nt = nthreads > 1 ? (int)nthreads : 1;
    /* panels per group: GROUP_BYTES of them, but a group for every thread where there are enough */
    int64_t G = (int64_t)GROUP_BYTES / (K * PN * (int64_t)sizeof(float));
    int64_t per_thread = (total + nt - 1) / nt;
    G = G > per_thread ? per_thread : G;
    G = G < 1 ? 1 : G > MAX_GROUP ? MAX_GROUP : G;
    int64_t ngroups = (total + G - 1) / G;
#pragma omp parallel num_threads(nt)
    {
        float *panel = aligned_alloc(32, sizeof(float) * (size_t)(G * K * PN + K));
        if (!panel) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t gi = 0; gi < ngroups; gi++) {
            if (!panel) continue;
            int64_t p0 = gi * G, p1 = p0 + G < total ? p0 + G : total;
            int gpn[MAX_GROUP];     /* each panel's valid columns */
            int64_t gcol[MAX_GROUP]; /* and its first output column */
            for (int64_t p = p0; p < p1; p++) {
                int s = 0;
                while (p >= np[s + 1]) s++;
                int64_t n0 = (p - np[s]) * PN;
                int i = (int)(p - p0);
                gpn[i] = (int)(sg[s].n - n0 < PN ? sg[s].n - n0 : PN);
                gcol[i] = sg[s].col0 + n0;
                build_panel(sg[s].type, sg[s].w, sg[s].rb, sg[s].nb, K, n0, gpn[i],
                            panel + G * K * PN, panel + i * K * PN);
            }
            for (int64_t m = 0; m < M; m += PM) {
                int pm = (int)(M - m < PM ? M - m : PM);
                for (int i = 0; i < (int)(p1 - p0); i++)
                    panel_block(x + m * ldx, ldx, K, panel + i * K * PN, pm, gpn[i],
                                y + m * ldy + gcol[i], ldy);
            }
        }
        free(panel);
    }
    return failed ? ERR_NOMEM : 0;
#else
    (void)x, (void)M, (void)K, (void)ldx, (void)segs, (void)nseg, (void)y, (void)ldy, (void)nthreads;
    return ERR_ISA;
#endif
}
