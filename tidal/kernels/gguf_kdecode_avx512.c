/* K-quant weight rows against one or two rows of q8 activations on AVX-512 VNNI: a decode
 * step's matmul, sixteen weight rows at a time, on the file's own block layout.
 *
 * gguf_gemm.c's q8 kernels for one or two rows of x (q8_direct) decoded every super-block into a
 * kblock in memory, then met x 32 codes at a time in 256-bit vectors: ~46 cycles per row and
 * super-block of Q4_K on a Xeon, 9.4 GB/s from L2 on one core, less than the memory gives a
 * core. Here each weight row's super-block is split in registers into 64-code vectors (nibbles,
 * Q5_K's fifth bit, Q6_K's two high bits) that meet x in one vpdpbusd each, and the sixteen rows'
 * partial sums are reduced together, so every reduction step serves sixteen rows:
 *
 *   P[c] = vpdpbusd(0, codes of row c, x)     (16 x int32: four-code partial sums, a 128-bit
 *                                               lane per 16 codes)
 *   L1  rows (2i, 2i+1): add(unpacklo32, unpackhi32)  -> two partials a lane and row
 *   L2  rows (4q..4q+3): add(unpacklo64, unpackhi64)  -> lane l of V[q]: rows 4q..4q+3's sums
 *                                                        of the 16 codes of lane l
 *   L3  shuffle_i32x4 across V[0..3]                  -> lane c = row c, one vector per 16 codes
 *                                                        (Q6_K) or per 32 (Q4_K, Q5_K)
 *
 * The scales and d/dmin of the sixteen rows are transposed the same way (128-bit loads, one
 * 4 x 4 dword transpose), so lane c holds row c's throughout, and the float steps are
 * gguf_gemm.c's per run of 32 values, in run order. Q4_K and Q5_K (one scale sc and min m a run):
 *
 *   acc = fma((float)s, (d * sc) * dx, acc); acc = fma(-(dx * (float)bsum), dmin * m, acc)
 *
 * with s the run's codes times x (no scale inside) and bsum x's 32 codes summed; Q6_K:
 *
 *   acc = fma((float)(s - smin), d * dx, acc)
 *
 * with s = sc_lo * (sum of codes 0-15 times x) + sc_hi * (codes 16-31) and smin = 32 * (sc_lo *
 * bsum_lo + sc_hi * bsum_hi): the run's signed codes (q - 32) times x, exact below 2^24. So the bits are every other path's: the scalar kernel's, the
 * panels' for more rows of x and AMX's (tests/kernels check it bit for bit).
 *
 * Q4_K's codes: 16-byte chunk pairs hold sub-blocks (2c, 2c+1) as low and high nibbles, so one
 * 64-byte load gives runs (0, 2) low and (1, 3) high, the next (4, 6) and (5, 7); x's runs are
 * paired the same way (two 32-byte loads a vector, once per super-block for all sixteen rows).
 * Q6_K's 128-code halves come out in their natural order. */
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVX512F__) \
    && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define KD_BUILT 1
#endif

enum { KD_Q4_K = 12, KD_Q5_K = 13, KD_Q6_K = 14 };
#define KD_ROWS 16     /* weight rows per call: one per lane */
#define X32_BYTES 40   /* a run of x: float d | int16 bsum[2] | int8 q[32] (gguf_gemm.c) */
#define X32_Q 8

/* 1 where this file's kernel is built (AVX-512 F/BW/VL with VNNI) */
int tidal_gguf_kdecode_built(void) {
#ifdef KD_BUILT
    return 1;
#else
    return 0;
#endif
}

#ifdef KD_BUILT
#define ALWAYS static inline __attribute__((always_inline))

ALWAYS int kd_block_bytes(int type) { return type == KD_Q4_K ? 144 : type == KD_Q5_K ? 176 : 210; }

/* x's runs ra (low 256 bits) and rb (high) of a super-block's eight at xr */
ALWAYS __m512i x_pair(const uint8_t *xr, int ra, int rb) {
    __m256i a = _mm256_loadu_si256((const __m256i *)(xr + ra * X32_BYTES + X32_Q));
    __m256i b = _mm256_loadu_si256((const __m256i *)(xr + rb * X32_BYTES + X32_Q));
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

/* dwords 0-3 of 16 bytes at each row's p[c] (rows past nc read row 0's), transposed: d[k] lane
 * c = dword k of row c. z[q] holds rows q, q + 4, q + 8, q + 12 in its 128-bit lanes, so the
 * unpacks leave row 4r + q in lane 4r + q. */
ALWAYS void rows_dwords(const uint8_t *const p[KD_ROWS], __m512i d[4]) {
    __m512i z[4], t[4];
    for (int q = 0; q < 4; q++) {
        z[q] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p[q]));
        for (int r = 1; r < 4; r++)
            z[q] = _mm512_inserti32x4(z[q], _mm_loadu_si128((const __m128i *)p[q + 4 * r]), r);
    }
    t[0] = _mm512_unpacklo_epi32(z[0], z[1]); /* lane 4r.. : dwords 0, 0, 1, 1 */
    t[1] = _mm512_unpackhi_epi32(z[0], z[1]); /* dwords 2, 2, 3, 3 */
    t[2] = _mm512_unpacklo_epi32(z[2], z[3]);
    t[3] = _mm512_unpackhi_epi32(z[2], z[3]);
    d[0] = _mm512_unpacklo_epi64(t[0], t[2]);
    d[1] = _mm512_unpackhi_epi64(t[0], t[2]);
    d[2] = _mm512_unpacklo_epi64(t[1], t[3]);
    d[3] = _mm512_unpackhi_epi64(t[1], t[3]);
}

/* L1 + L2 of the reduction (see the top): four rows' vectors into one, lane l of the result
 * holding row i's sum of its 128-bit lane l in dword i */
ALWAYS __m512i reduce4(__m512i p0, __m512i p1, __m512i p2, __m512i p3) {
    __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(p0, p1), _mm512_unpackhi_epi32(p0, p1));
    __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(p2, p3), _mm512_unpackhi_epi32(p2, p3));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
}

/* L3 for 16-code sums: v[q] (rows 4q.., lanes l) -> h[l] (lane c = row c, the 16 codes of l) */
ALWAYS void lanes_to_rows(const __m512i v[4], __m512i h[4]) {
    __m512i x0 = _mm512_shuffle_i32x4(v[0], v[1], _MM_SHUFFLE(1, 0, 1, 0));
    __m512i x1 = _mm512_shuffle_i32x4(v[0], v[1], _MM_SHUFFLE(3, 2, 3, 2));
    __m512i x2 = _mm512_shuffle_i32x4(v[2], v[3], _MM_SHUFFLE(1, 0, 1, 0));
    __m512i x3 = _mm512_shuffle_i32x4(v[2], v[3], _MM_SHUFFLE(3, 2, 3, 2));
    h[0] = _mm512_shuffle_i32x4(x0, x2, _MM_SHUFFLE(2, 0, 2, 0));
    h[1] = _mm512_shuffle_i32x4(x0, x2, _MM_SHUFFLE(3, 1, 3, 1));
    h[2] = _mm512_shuffle_i32x4(x1, x3, _MM_SHUFFLE(2, 0, 2, 0));
    h[3] = _mm512_shuffle_i32x4(x1, x3, _MM_SHUFFLE(3, 1, 3, 1));
}

/* L3 for 32-code sums: lanes (0, 1) are one run, (2, 3) another -> lo, hi (lane c = row c) */
ALWAYS void runs_to_rows(const __m512i v[4], __m512i *lo, __m512i *hi) {
    __m512i a = _mm512_add_epi32(_mm512_shuffle_i32x4(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_i32x4(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512i b = _mm512_add_epi32(_mm512_shuffle_i32x4(v[2], v[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_i32x4(v[2], v[3], _MM_SHUFFLE(3, 1, 3, 1)));
    *lo = _mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0));
    *hi = _mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1));
}

/* byte j (0-3) of every dword, unsigned */
ALWAYS __m512i byte_u(__m512i v, int j) {
    if (j == 3) return _mm512_srli_epi32(v, 24);
    return _mm512_and_si512(j ? _mm512_srli_epi32(v, 8 * j) : v, _mm512_set1_epi32(0xFF));
}
/* byte j (0-3) of every dword, sign-extended */
ALWAYS __m512i byte_s(__m512i v, int j) {
    return _mm512_srai_epi32(j == 3 ? v : _mm512_slli_epi32(v, 24 - 8 * j), 24);
}

/* Row c's codes k2 = 0, 1 of the super-block at b as two pairs of 64-code vectors: out[0], out[1]
 * (k = 2 * k2, 2 * k2 + 1; see the top for which runs each holds). */
ALWAYS void row_codes(int type, const uint8_t *b, int k2, __m512i out[2]) {
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    if (type == KD_Q6_K) { /* half k2: ql[64] at 64 k2, qh[32] at 128 + 32 k2 */
        __m512i l = _mm512_loadu_si512((const void *)(b + 64 * k2));
        __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * k2)));
        /* the high half's qh bits 2-3 and 6-7 where the low half's 0-1 and 4-5 are */
        h = _mm512_srlv_epi16(h, _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1));
        const __m512i hi2 = _mm512_set1_epi8(0x30);
        /* A | (B & C): 0xF8 */
        out[0] = _mm512_ternarylogic_epi32(_mm512_and_si512(l, lo4), _mm512_slli_epi16(h, 4), hi2, 0xF8);
        out[1] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(l, 4), lo4), h, hi2, 0xF8);
        return;
    }
    const uint8_t *qs = b + (type == KD_Q5_K ? 48 : 16);
    __m512i v = _mm512_loadu_si512((const void *)(qs + 64 * k2));
    out[0] = _mm512_and_si512(v, lo4);
    out[1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
    if (type == KD_Q5_K) { /* bit j of qh's bytes is bit 4 of run j's codes */
        __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16)));
        /* runs (4 k2, 4 k2 + 2) in out[0], (4 k2 + 1, 4 k2 + 3) in out[1]: the high half's bit
         * sits two above the low half's */
        h = _mm512_srlv_epi16(h, _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1));
        const __m512i bit4 = _mm512_set1_epi8(0x10);
        __m512i h0 = k2 ? h : _mm512_slli_epi16(h, 4);               /* bit 4 k2 -> 4 */
        __m512i h1 = k2 ? _mm512_srli_epi16(h, 1) : _mm512_slli_epi16(h, 3); /* 4 k2 + 1 -> 4 */
        out[0] = _mm512_ternarylogic_epi32(out[0], h0, bit4, 0xF8);
        out[1] = _mm512_ternarylogic_epi32(out[1], h1, bit4, 0xF8);
    }
}

/* x's four 64-code vectors of super-block b, paired as row_codes pairs the weight's codes */
ALWAYS void x_vectors(int type, const uint8_t *xr, __m512i xv[4]) {
    if (type == KD_Q6_K) {
        for (int k = 0; k < 4; k++) xv[k] = x_pair(xr, 2 * k, 2 * k + 1);
        return;
    }
    xv[0] = x_pair(xr, 0, 2);
    xv[1] = x_pair(xr, 1, 3);
    xv[2] = x_pair(xr, 4, 6);
    xv[3] = x_pair(xr, 5, 7);
}

/* part i of n of the `bytes` at p (the next rows', in step with this call's super-blocks) */
ALWAYS void prefetch_part(const uint8_t *p, int64_t i, int64_t n, int64_t bytes) {
    if (!p) return;
    int64_t a = i * bytes / n, e = (i + 1) * bytes / n;
    for (int64_t o = a; o < e; o += 64) __builtin_prefetch(p + o, 0, 2); /* L2 */
}

ALWAYS void kdecode(int type, const uint8_t *w, int64_t rb, int nc, int64_t nb,
                    const uint8_t *next, const uint8_t *x, int64_t ldx, int M, float *y,
                    int64_t ldy) {
    const int bb = kd_block_bytes(type);
    const uint8_t *row[KD_ROWS];
    for (int c = 0; c < KD_ROWS; c++) row[c] = w + (c < nc ? c : 0) * rb; /* past nc: row 0 */
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t b = 0; b < nb; b++) {
        const int64_t at = b * bb;
        /* the rows' scales: sc[s], mn[s] per 16 codes s (Q4_K, Q5_K: per 32, s = 2j) */
        __m512i dw[4], sc8[4], mn8[2], d16;
        const uint8_t *hp[KD_ROWS];
        if (type == KD_Q6_K) {
            for (int c = 0; c < KD_ROWS; c++) hp[c] = row[c] + at + 192;
            rows_dwords(hp, sc8); /* int8 scales 4t..4t+3 in dword t */
            __m512i idx = _mm512_mullo_epi32(_mm512_set1_epi32((int)rb),
                                             _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
            idx = _mm512_maskz_mov_epi32((__mmask16)((1u << nc) - 1), idx); /* past nc: row 0 */
            d16 = _mm512_srli_epi32(_mm512_i32gather_epi32(idx, (const void *)(w + at + 206), 1), 16);
            (void)mn8;
        } else {
            for (int c = 0; c < KD_ROWS; c++) hp[c] = row[c] + at;
            rows_dwords(hp, dw);
            const __m512i m6 = _mm512_set1_epi32(0x3F3F3F3F), m4 = _mm512_set1_epi32(0x0F0F0F0F);
            const __m512i m2 = _mm512_set1_epi32(0x03030303);
            /* k_unpack6 on every lane: dw[1..3] are the 12 scale bytes */
            sc8[0] = _mm512_and_si512(dw[1], m6);
            mn8[0] = _mm512_and_si512(dw[2], m6);
            sc8[1] = _mm512_or_si512(_mm512_and_si512(dw[3], m4),
                                     _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(dw[1], 6), m2), 4));
            mn8[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(dw[3], 4), m4),
                                     _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(dw[2], 6), m2), 4));
            d16 = dw[0];
        }
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d16));
        const __m512 dmin = type == KD_Q6_K ? d : _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(d16, 16)));
        __m512i xv[2][4]; /* x's code vectors of this super-block, per row of x */
        for (int m = 0; m < M; m++) x_vectors(type, x + m * ldx + 8 * b * X32_BYTES, xv[m]);
        for (int k2 = 0; k2 < 2; k2++) { /* runs 4 k2 .. 4 k2 + 3 */
            /* V[m][e][q]: rows 4q..4q+3 of code vector k = 2 k2 + e against row m of x, reduced
             * within 128-bit lanes; each row's codes are decoded once for every row of x */
            __m512i V[2][2][4];
            for (int q = 0; q < 4; q++) {
                /* the next rows' bytes in eight parts a super-block: bursts of prefetches
                 * between the loads measured slower than a few at a time */
                prefetch_part(next, 8 * b + 4 * k2 + q, 8 * nb, KD_ROWS * rb);
                __m512i p[2][2][4];
                for (int r = 0; r < 4; r++) {
                    __m512i codes[2];
                    row_codes(type, row[4 * q + r] + at, k2, codes);
                    for (int m = 0; m < M; m++)
                        for (int e = 0; e < 2; e++)
                            p[m][e][r] = _mm512_dpbusd_epi32(zero, codes[e], xv[m][2 * k2 + e]);
                }
                for (int m = 0; m < M; m++)
                    for (int e = 0; e < 2; e++)
                        V[m][e][q] = reduce4(p[m][e][0], p[m][e][1], p[m][e][2], p[m][e][3]);
            }
            for (int m = 0; m < M; m++) {
                /* s[i]: run 4 k2 + i's scaled integer sum, lane c = row c */
                __m512i s[4];
                if (type == KD_Q6_K) {
                    for (int e = 0; e < 2; e++) { /* runs 2k, 2k + 1 (k = 2 k2 + e): 16s 4k.. */
                        __m512i h[4];
                        lanes_to_rows(V[m][e], h);
                        for (int f = 0; f < 2; f++) {
                            int g = 8 * k2 + 4 * e + 2 * f; /* the run's first 16 */
                            __m512i sa = byte_s(sc8[g >> 2], g & 3), sb = byte_s(sc8[g >> 2], (g & 3) + 1);
                            s[2 * e + f] = _mm512_add_epi32(_mm512_mullo_epi32(h[2 * f], sa),
                                                            _mm512_mullo_epi32(h[2 * f + 1], sb));
                        }
                    }
                } else {
                    for (int e = 0; e < 2; e++) { /* runs (4 k2 + e, 4 k2 + e + 2) */
                        __m512i lo, hi;
                        runs_to_rows(V[m][e], &lo, &hi);
                        s[e] = lo; /* the scales come in the float steps */
                        s[e + 2] = hi;
                    }
                }
                const uint8_t *xr = x + m * ldx + 8 * b * X32_BYTES;
                __m512 a = acc[m];
                for (int i = 0; i < 4; i++) { /* run order: gguf_gemm.c's float steps */
                    const int j = 4 * k2 + i;
                    const uint8_t *xj = xr + j * X32_BYTES;
                    float dxs;
                    int16_t bs[2];
                    memcpy(&dxs, xj, 4);
                    memcpy(bs, xj + 4, 4);
                    const __m512 dx = _mm512_set1_ps(dxs);
                    if (type != KD_Q6_K) { /* d*sc and dmin*m as floats, x's sum scaled by dx */
                        const __m512 ws = _mm512_mul_ps(d, _mm512_cvtepi32_ps(byte_u(sc8[k2], j & 3)));
                        const __m512 wm = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(byte_u(mn8[k2], j & 3)));
                        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(ws, dx), a);
                        a = _mm512_fnmadd_ps(_mm512_set1_ps(dxs * (float)(bs[0] + bs[1])), wm, a);
                        continue;
                    }
                    __m512i smin;
                    { /* Q6_K: mn = 32 sc */
                        int g = 2 * j;
                        __m512i sa = byte_s(sc8[g >> 2], g & 3), sb = byte_s(sc8[g >> 2], (g & 3) + 1);
                        smin = _mm512_slli_epi32(_mm512_add_epi32(_mm512_mullo_epi32(sa, _mm512_set1_epi32(bs[0])),
                                                                  _mm512_mullo_epi32(sb, _mm512_set1_epi32(bs[1]))), 5);
                    }
                    a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s[i], smin)), _mm512_mul_ps(d, dx), a);
                }
                acc[m] = a;
            }
        }
    }
    const __mmask16 live = (__mmask16)((1u << nc) - 1);
    for (int m = 0; m < M; m++) _mm512_mask_storeu_ps(y + m * ldy, live, acc[m]);
}

/* nc (1..16) rows of a Q4_K, Q5_K or Q6_K weight (row bytes rb, nb super-blocks each) against
 * M (1 or 2) rows of x in gguf_gemm.c's q8 form (row stride ldx bytes): y[m * ldy + c]. `next`:
 * the rows after these (or NULL), fetched in step. Returns 0, or -1 for what it does not take
 * (another type, M or nc out of range, or not built here: the caller runs its own kernels). */
int tidal_gguf_kdecode16(int type, const uint8_t *w, int64_t rb, int nc, int64_t nb,
                         const uint8_t *next, const uint8_t *x, int64_t ldx, int M, float *y,
                         int64_t ldy) {
    if (nc < 1 || nc > KD_ROWS || M < 1 || M > 2) return -1;
#define KD(t)                                                                                 \
    if (M == 1) kdecode(t, w, rb, nc, nb, next, x, ldx, 1, y, ldy);                            \
    else kdecode(t, w, rb, nc, nb, next, x, ldx, 2, y, ldy);                                   \
    return 0;
    switch (type) {
    case KD_Q4_K: { KD(KD_Q4_K) }
    case KD_Q5_K: { KD(KD_Q5_K) }
    case KD_Q6_K: { KD(KD_Q6_K) }
    default: return -1;
    }
#undef KD
}
#else
int tidal_gguf_kdecode16(int type, const uint8_t *w, int64_t rb, int nc, int64_t nb,
                         const uint8_t *next, const uint8_t *x, int64_t ldx, int M, float *y,
                         int64_t ldy) {
    (void)type, (void)w, (void)rb, (void)nc, (void)nb, (void)next, (void)x, (void)ldx, (void)M;
    (void)y, (void)ldy;
    return -1;
}
#endif
