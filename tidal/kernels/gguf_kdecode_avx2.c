/* Q4_K and Q5_K weight rows against one or two rows of q8 activations on AVX2 (and AVX-VNNI):
 * a decode step's matmul, eight weight rows at a time, on the file's own block layout.
 *
 * The eight-lane form of gguf_kdecode_avx512.c (read its top first): each row's super-block is
 * split in registers into one 32-code vector per run, which meets x's run in maddubs + madd (or
 * one vpdpbusd with AVX-VNNI), and the eight rows' partial sums are reduced together:
 *
 *   P[c] = the run's four-code partial sums of row c        (8 x int32)
 *   L1  rows (2i, 2i+1): add(unpacklo32, unpackhi32)
 *   L2  rows (4q..4q+3): add(unpacklo64, unpackhi64)        -> 128-bit lane h of V[q]: rows
 *                                                              4q..4q+3's sums of codes 16h..
 *   L3  permute2x128 across V[0], V[1], add                 -> lane c = row c: the run's sum
 *
 * The scales and d/dmin of the eight rows are transposed the same way, and the integers and
 * float steps are gguf_gemm.c's per run, in run order, so the bits are every other path's.
 * maddubs cannot saturate: two codes of at most 31 times |x| <= 128 stay below 2^15.
 * Q6_K stays on gguf_gemm.c's q8_direct: re-extracting its codes run by run here (two loads and
 * five operations a run) measured 0.87x of decoding each super-block once into a kblock. 1.36x
 * on Q4_K and 1.1x on Q5_K against q8_direct (one Xeon core, rows in L2). */
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KD8_BUILT 1
#endif

enum { KD_Q4_K = 12, KD_Q5_K = 13 };
#define KD8_ROWS 8
#define X32_BYTES 40 /* a run of x: float d | int16 bsum[2] | int8 q[32] (gguf_gemm.c) */
#define X32_Q 8

#ifdef KD8_BUILT
#define ALWAYS static inline __attribute__((always_inline))

ALWAYS int kd_block_bytes(int type) { return type == KD_Q4_K ? 144 : 176; }

/* dwords 0-3 of 16 bytes at each row's p[c], transposed: d[k] lane c = dword k of row c (z[q]
 * holds rows q and q + 4 in its 128-bit lanes) */
ALWAYS void rows_dwords8(const uint8_t *const p[KD8_ROWS], __m256i d[4]) {
    __m256i z[4], t[4];
    for (int q = 0; q < 4; q++)
        z[q] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p[q])),
                                       _mm_loadu_si128((const __m128i *)p[q + 4]), 1);
    t[0] = _mm256_unpacklo_epi32(z[0], z[1]);
    t[1] = _mm256_unpackhi_epi32(z[0], z[1]);
    t[2] = _mm256_unpacklo_epi32(z[2], z[3]);
    t[3] = _mm256_unpackhi_epi32(z[2], z[3]);
    d[0] = _mm256_unpacklo_epi64(t[0], t[2]);
    d[1] = _mm256_unpackhi_epi64(t[0], t[2]);
    d[2] = _mm256_unpacklo_epi64(t[1], t[3]);
    d[3] = _mm256_unpackhi_epi64(t[1], t[3]);
}

/* L1 + L2: four rows' vectors into one (128-bit lane h: the four rows' sums of its codes) */
ALWAYS __m256i reduce4_8(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
    __m256i t0 = _mm256_add_epi32(_mm256_unpacklo_epi32(p0, p1), _mm256_unpackhi_epi32(p0, p1));
    __m256i t1 = _mm256_add_epi32(_mm256_unpacklo_epi32(p2, p3), _mm256_unpackhi_epi32(p2, p3));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1));
}

/* 8 f16 in the low (hi: high) halves of the dwords of v, as floats */
ALWAYS __m256 halves_ps(__m256i v, int hi) {
    const __m256i pick = hi ? _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                               2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1)
                            : _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                               0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i h = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, pick), 0x08); /* qwords 0, 2 */
    return _mm256_cvtph_ps(_mm256_castsi256_si128(h));
}

ALWAYS __m256i byte_u8(__m256i v, int j) {
    if (j == 3) return _mm256_srli_epi32(v, 24);
    return _mm256_and_si256(j ? _mm256_srli_epi32(v, 8 * j) : v, _mm256_set1_epi32(0xFF));
}

/* run j's 32 codes of the super-block at b */
ALWAYS __m256i run_codes(int type, const uint8_t *b, int j) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    const uint8_t *qs = b + (type == KD_Q5_K ? 48 : 16);
    __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * (j >> 1)));
    __m256i q = j & 1 ? _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4) : _mm256_and_si256(v, lo4);
    if (type == KD_Q5_K) { /* bit j of qh's bytes is bit 4 of run j's codes */
        __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        __m256i bit = j <= 4 ? _mm256_slli_epi16(qh, 4 - j) : _mm256_srli_epi16(qh, j - 4);
        q = _mm256_or_si256(q, _mm256_and_si256(bit, _mm256_set1_epi8(0x10)));
    }
    return q;
}

/* four-code partial sums of codes (u8) against x (s8): dpbusd with AVX-VNNI, else maddubs +
 * madd (no saturation, see the top) */
ALWAYS __m256i dot4(int vnni, __m256i codes, __m256i x) {
#ifdef __AVXVNNI__
    if (vnni) return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), codes, x);
#endif
    (void)vnni;
    return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1));
}

ALWAYS void prefetch_part8(const uint8_t *p, int64_t i, int64_t n, int64_t bytes) {
    if (!p) return;
    int64_t a = i * bytes / n, e = (i + 1) * bytes / n;
    for (int64_t o = a; o < e; o += 64) __builtin_prefetch(p + o, 0, 2); /* L2 */
}

ALWAYS void kdecode8(int type, int vnni, const uint8_t *w, int64_t rb, int nc, int64_t nb,
                     const uint8_t *next, const uint8_t *x, int64_t ldx, int M, float *y,
                     int64_t ldy) {
    const int bb = kd_block_bytes(type);
    const uint8_t *row[KD8_ROWS];
    for (int c = 0; c < KD8_ROWS; c++) row[c] = w + (c < nc ? c : 0) * rb; /* past nc: row 0 */
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++) {
        const int64_t at = b * bb;
        /* the rows' scales and mins (six bits, four to a dword) and d, dmin; lane c = row c */
        const uint8_t *hp[KD8_ROWS];
        __m256i dw[4], sc8[2], mn8[2];
        for (int c = 0; c < KD8_ROWS; c++) hp[c] = row[c] + at;
        rows_dwords8(hp, dw);
        const __m256i m6 = _mm256_set1_epi32(0x3F3F3F3F), m4 = _mm256_set1_epi32(0x0F0F0F0F);
        const __m256i m2 = _mm256_set1_epi32(0x03030303);
        sc8[0] = _mm256_and_si256(dw[1], m6); /* k_unpack6 on every lane */
        mn8[0] = _mm256_and_si256(dw[2], m6);
        sc8[1] = _mm256_or_si256(_mm256_and_si256(dw[3], m4),
                                 _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(dw[1], 6), m2), 4));
        mn8[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(dw[3], 4), m4),
                                 _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(dw[2], 6), m2), 4));
        const __m256 d = halves_ps(dw[0], 0), dmin = halves_ps(dw[0], 1);
        for (int j = 0; j < 8; j++) {
            /* the next rows' bytes a run at a time (a super-block's at once measured slower) */
            prefetch_part8(next, 8 * b + j, 8 * nb, KD8_ROWS * rb);
            /* each row's codes once, against every row of x */
            __m256i v[2][2], xv[2];
            for (int m = 0; m < M; m++)
                xv[m] = _mm256_loadu_si256((const __m256i *)(x + m * ldx + (8 * b + j) * X32_BYTES + X32_Q));
            for (int q = 0; q < 2; q++) {
                __m256i p[2][4];
                for (int r = 0; r < 4; r++) {
                    __m256i codes = run_codes(type, row[4 * q + r] + at, j);
                    for (int m = 0; m < M; m++) p[m][r] = dot4(vnni, codes, xv[m]);
                }
                for (int m = 0; m < M; m++) v[m][q] = reduce4_8(p[m][0], p[m][1], p[m][2], p[m][3]);
            }
            /* the run's d*sc and dmin*m, lane c = row c */
            const __m256 ws = _mm256_mul_ps(d, _mm256_cvtepi32_ps(byte_u8(sc8[j >> 2], j & 3)));
            const __m256 wm = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(byte_u8(mn8[j >> 2], j & 3)));
            for (int m = 0; m < M; m++) {
                /* lane c = row c: the sum of codes 0-15 and of 16-31 */
                __m256i sum = _mm256_add_epi32(_mm256_permute2x128_si256(v[m][0], v[m][1], 0x20),
                                               _mm256_permute2x128_si256(v[m][0], v[m][1], 0x31));
                const uint8_t *xj = x + m * ldx + (8 * b + j) * X32_BYTES;
                float dxs;
                int16_t bs[2];
                memcpy(&dxs, xj, 4);
                memcpy(bs, xj + 4, 4);
                const __m256 dx = _mm256_set1_ps(dxs);
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(ws, dx), acc[m]);
                acc[m] = _mm256_fnmadd_ps(_mm256_set1_ps(dxs * (float)(bs[0] + bs[1])), wm, acc[m]);
            }
        }
    }
    for (int m = 0; m < M; m++) {
        if (nc == KD8_ROWS) {
            _mm256_storeu_ps(y + m * ldy, acc[m]);
        } else {
            _Alignas(32) float out[KD8_ROWS];
            _mm256_store_ps(out, acc[m]);
            memcpy(y + m * ldy, out, sizeof(float) * (size_t)nc);
        }
    }
}

/* nc (1..8) rows of a Q4_K or Q5_K weight (row bytes rb, nb super-blocks each) against M
 * (1 or 2) rows of x in gguf_gemm.c's q8 form (row stride ldx bytes): y[m * ldy + c]; vnni:
 * AVX-VNNI's vpdpbusd for the integer sums (where built). `next`: the rows after these (or
 * NULL), fetched in step. Returns 0, or -1 for what it does not take (the caller runs its own). */
int tidal_gguf_kdecode8(int type, int vnni, const uint8_t *w, int64_t rb, int nc, int64_t nb,
                        const uint8_t *next, const uint8_t *x, int64_t ldx, int M, float *y,
                        int64_t ldy) {
    if (nc < 1 || nc > KD8_ROWS || M < 1 || M > 2) return -1;
#ifndef __AVXVNNI__
    if (vnni) return -1;
#endif
#define KD(t)                                                                                 \
    if (vnni) {                                                                               \
        if (M == 1) kdecode8(t, 1, w, rb, nc, nb, next, x, ldx, 1, y, ldy);                    \
        else kdecode8(t, 1, w, rb, nc, nb, next, x, ldx, 2, y, ldy);                           \
    } else if (M == 1) kdecode8(t, 0, w, rb, nc, nb, next, x, ldx, 1, y, ldy);                 \
    else kdecode8(t, 0, w, rb, nc, nb, next, x, ldx, 2, y, ldy);                               \
    return 0;
    switch (type) {
    case KD_Q4_K: { KD(KD_Q4_K) }
    case KD_Q5_K: { KD(KD_Q5_K) }
    default: return -1;
    }
#undef KD
}
#else
int tidal_gguf_kdecode8(int type, int vnni, const uint8_t *w, int64_t rb, int nc, int64_t nb,
                        const uint8_t *next, const uint8_t *x, int64_t ldx, int M, float *y,
                        int64_t ldy) {
    (void)type, (void)vnni, (void)w, (void)rb, (void)nc, (void)nb, (void)next, (void)x;
    (void)ldx, (void)M, (void)y, (void)ldy;
    return -1;
}
#endif
