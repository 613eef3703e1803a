/* gguf_gemm's AMX path (included by gguf_gemm.c where the build has AMX-TILE and AMX-INT8 besides
 * AVX-512): q8's integer sums of 16 weight rows x 16 rows of x on the tile unit, the float steps
 * on AVX-512, from 6 or 12 rows of x by type (amx_takes(): a tile holds 16 rows of x, padded).
 *
 * For one run of 32 values, TDPBSSD gives every (output n, row m) its exact int32 dot product of
 * the weight's codes with x's, in one instruction where AVX-512 VNNI spends eight vpdpbusd and a
 * sign fix per 16 outputs and row of x. The weight tile (A) is the codes as signed bytes: Q8_0's
 * straight from the file (a tile's rows 32 codes every row_bytes), the other types' decoded once
 * per 16 weight rows into a panel that every tile of x then reads (Q4_0/Q5_0 as q - 8, q - 16;
 * IQ4 through its table; Q4_K/Q5_K's unsigned codes, below 32). x's tile (B) is its int8 codes in
 * the tile unit's layout: row k/4 holds, for each of the 16 rows of x, the four codes k..k+3
 * (pack_x_amx()). The first tile of x prefetches the next 16 weight rows run by run: 16 rows read
 * side by side are more streams than the hardware prefetcher follows (the LM head at 32 rows of x
 * took 1.7x as long without it).
 * The float steps are the other paths' (gguf_gemm.c's top): per run, in run order,
 *     acc = fma((float)s, d_w * d_x, acc)                                   runs of 32
 *     acc = fma((float)s, (d * sc) * d_x, acc); acc = fma(-(d_x * bsum), dmin * m, acc)
 *                                                                           Q4_K, Q5_K
 *     acc = fma(sc_a * dot_a + sc_b * dot_b, d * d_x, acc)                  Q6_K
 * with s the same integers, so this path gives the other paths' bits: a row's result does not
 * depend on whether its batch ran here or on AVX-512. Q6_K (a scale per 16 codes) takes two
 * tile products a run, its codes 0-15 and 16-31 (signed, q - 32) in two panels with the other
 * half zeros, and forms s - smin in float (exact: every integer below 2^24); it pays from 192
 * rows of x (AMX_MIN_ROWS_Q6_K).
 * Where the time goes (a run of 32, 16 x 16, one core, cycles at the TSC's rate, Xeon family 6
 * model 207): the tile instructions ~26-40, the float steps ~23 (runs of 32), and the two hardly
 * overlap, as the float steps read the tile stores back from L1. The K-quants' float steps took
 * ~67 cycles alone (140 with the tiles, model 167) while their scales sat inside s; with d*sc
 * and dmin*m as floats per run (four operations per output) 57 with the tiles.
 * The accumulators hold the 16 rows of x of one output in a vector, so a tile's results are
 * written transposed into y.
 * Float activations (act f32) stay off the tiles. AMX-BF16 can give a float32-class product:
 * x split into three bfloat16 (hi + mid + lo == x exactly), every block code an exact bfloat16,
 * so each product is exact and the tile sums them in float32. But those sums' bits differ from
 * AVX-512's FMA chains, so for a row's result not to depend on its batch every M would have to
 * run on tiles, and a tried version (weights decoded and transposed into the pair layout per 16
 * rows) cost too much at few rows: the LM head 35.1 against 8.5 ms at 1 row, 36.8 against 22.7
 * at 8, 51.3 against 73.8 at 32 (2 threads, this Xeon); at 512 rows it only matched oneDNN's
 * float32 GEMM that prompts use (qkv 4.65 against 4.23 ms, gate/up 13.0 against 13.2).
 * Linux grants a process the tile data state on request (arch_prctl(ARCH_REQ_XCOMP_PERM)):
 * amx_permitted() asks once; without it the path is not offered (tidal_gguf_has_amx() == 0). The
 * tile configuration is per thread: every thread of a call loads it and releases the tiles. */
#include <sys/syscall.h>
long syscall(long number, ...); /* unistd.h declares it only past -std=c11 (_DEFAULT_SOURCE) */

/* Rows of x from which a type's q8 runs on the tile unit: a tile computes 16 rows of x whatever
 * M is, so below 16 it pays for padding. Q8_0's tiles are read straight from the file, and its
 * 16 weight rows at once are ahead of AVX-512 from 6 rows of x; the other types decode each 16
 * weight rows into a panel first, a cost that 12 rows earn back. The bundled model's shapes,
 * 2 threads, Xeon family 6 model 207, amx / avx512 speed in four runs (the host's speed moved
 * ~2x between them, and the ratios with it):
 *     rows of x             5          6          8          10         12         16
 *     LM head Q8_0          1.04       1.14-1.23  1.25-1.39  1.43-1.50  1.49-1.58  1.65-1.96
 *     q_proj, gate Q5_0     -          0.88-0.93  0.97-0.99  0.94-1.25  1.02-1.26  1.20-1.36
 *     down Q4_K             -          0.86       0.94       0.90-1.10  0.99-1.20  1.18-1.31 */
#define AMX_MIN_ROWS_FILE 6   /* Q8_0 */
#define AMX_MIN_ROWS_PANEL 12 /* the other types but Q6_K */
/* Q6_K: two tile products a run (a scale per 16 codes) and six float operations per output;
 * 3584 x 18944, 2 threads, this Xeon (model 167), amx / avx512: 0.73x at 32 rows, 0.91x at 64,
 * 0.97x at 128, 1.18x at 256, 1.31x at 512 */
#define AMX_MIN_ROWS_Q6_K 192
#define AMX_N 16        /* weight rows (outputs) per tile: CHUNK */
#define AMX_M 16        /* rows of x per tile */

/* one tile of x for one run: the B operand, and its rows' scales and 16-code sums (zeros past M) */
typedef struct {
    _Alignas(64) int8_t b[8][64];
    float dx[AMX_M];
    int32_t bs0[AMX_M], bs1[AMX_M];
} amx_xrun;

/* a panel's scales, per weight row n (row-major, so that the panel writes whole vectors): the
 * runs of 32's d[n][run]; the K-quants' d[n][super-block], dm likewise, and sc[n][16 * block + i],
 * mn likewise, their integer scales and mins per 16 codes as floats (exact: 13 bits at most) */
typedef struct {
    float *d, *dm, *sc, *mn;
} amx_scales;

static int amx_permitted(void) {
    static int granted = -1; /* first asked from tidal_gguf_has_amx(), before any parallel call */
    if (granted < 0) granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                       18 /* XFEATURE_XTILEDATA */) == 0;
    return granted;
}

/* tiles 0, 1: C (16 x 16 int32), 4, 5: A (16 weight rows x 32 codes), 6, 7: B (a run of x): two
 * sets, so that consecutive runs' dot products do not wait for each other's tiles; 2, 3: Q6_K's
 * second C (its runs' codes 16-31) */
static void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 8, 8};
    const uint16_t colsb[8] = {64, 64, 64, 64, 32, 32, 64, 64};
    for (int t = 0; t < 8; t++) c.rows[t] = rows[t], c.colsb[t] = colsb[t];
    _tile_loadconfig(&c);
}

/* rows m0..m0+mt-1 of the quantized x (xq, r32 bytes a row) as `runs` amx_xruns */
static void pack_x_amx(const uint8_t *xq, int64_t r32, int64_t m0, int mt, int64_t runs,
                       amx_xrun *X) {
    for (int64_t r = 0; r < runs; r++) {
        amx_xrun *p = X + r;
        memset(p, 0, sizeof *p);
        for (int m = 0; m < mt; m++) {
            const uint8_t *src = xq + (m0 + m) * r32 + r * X32_BYTES;
            int16_t bsum[2];
            memcpy(&p->dx[m], src, 4);
            memcpy(bsum, src + 4, 4);
            p->bs0[m] = bsum[0];
            p->bs1[m] = bsum[1];
            for (int k4 = 0; k4 < 8; k4++) memcpy(&p->b[k4][4 * m], src + X32_Q + 4 * k4, 4);
        }
    }
}

/* nc weight rows' codes (A, lda bytes a row) and scales (S); rows past nc: zeros */
ALWAYS void amx_panel(int type, const uint8_t *w, int64_t rb, int nc, int64_t nb, int64_t runs,
                      int8_t *A, int64_t lda, const amx_scales *S) {
    for (int n = 0; n < AMX_N; n++) {
        const uint8_t *row = w + n * rb;
        int8_t *a = A + n * lda;
        if (n >= nc) { /* their outputs are dropped: zeros keep the sums finite */
            memset(a, 0, (size_t)(32 * runs));
            if (type == T_Q6_K) memset(a + AMX_N * lda, 0, (size_t)(32 * runs));
            memset(S->d + n * runs, 0, (size_t)runs * sizeof(float)); /* runs of 32, Q6_K */
            if (runs32(type)) continue;
            memset(S->sc + n * runs, 0, (size_t)runs * sizeof(float));
            memset(S->mn + n * runs, 0, (size_t)runs * sizeof(float));
            continue;
        }
        if (runs32(type)) {
            for (int64_t g = 0; g < runs; g++) {
                __m256i q = b32_decode_avx2(type, row, g, &S->d[n * runs + g]);
                _mm256_store_si256((__m256i *)(a + 32 * g), q);
            }
            continue;
        }
        _Alignas(32) kblock k;
        if (type == T_Q6_K) { /* signed codes q - 32, codes 0-15 of a run in A, 16-31 in A's
                                 second panel (AMX_N rows on), the other half zeros; per run
                                 d, sc_a, sc_b (in d, sc, mn) */
            const __m256i lo16 = _mm256_setr_epi64x(-1, -1, 0, 0), off = _mm256_set1_epi8(32);
            for (int64_t b = 0; b < nb; b++) {
                k_decode_avx2(type, row + b * block_bytes(type), &k, 0);
                for (int j = 0; j < 8; j++) {
                    __m256i q = _mm256_sub_epi8(_mm256_load_si256((const __m256i *)(k.q + 32 * j)), off);
                    _mm256_store_si256((__m256i *)(a + 256 * b + 32 * j), _mm256_and_si256(q, lo16));
                    _mm256_store_si256((__m256i *)(a + AMX_N * lda + 256 * b + 32 * j),
                                       _mm256_andnot_si256(lo16, q));
                    S->d[n * runs + 8 * b + j] = k.d;
                    S->sc[n * runs + 8 * b + j] = (float)k.sc[2 * j];
                    S->mn[n * runs + 8 * b + j] = (float)k.sc[2 * j + 1];
                }
            }
            continue;
        }
        for (int64_t b = 0; b < nb; b++) { /* Q4_K, Q5_K (k_steps): per run d*sc, dmin*m */
            k_decode_avx2(type, row + b * block_bytes(type), &k, 0);
            memcpy(a + 256 * b, k.q, 256);
            for (int j = 0; j < 8; j++) {
                S->sc[n * runs + 8 * b + j] = k.d * (float)k.sc[2 * j];
                S->mn[n * runs + 8 * b + j] = k.dmin * (float)k.mn[2 * j];
            }
        }
    }
}

/* run r's dot products (c) into the accumulators: the float steps. The K-quants' integers are
 * formed in float: s = sc * dot and smin = mn * bsum, products of integers exact in float32,
 * round once each, as (float) of the int32 product does. */
ALWAYS void amx_scale_run(int type, const amx_scales *S, int64_t r, int64_t runs,
                          const amx_xrun *x, const int32_t c[AMX_N][AMX_M], __m512 acc[AMX_N]) {
    const __m512 dx = _mm512_load_ps(x->dx);
    if (type == T_Q6_K) { /* c: the codes 0-15 sums, then (AMX_N on) 16-31's. s - smin formed
                             in float: sc_a * dot_a + sc_b * dot_b, each product and the sum
                             exact below 2^24 */
#pragma GCC unroll 16
        for (int n = 0; n < AMX_N; n++) {
            __m512 ca = _mm512_cvtepi32_ps(_mm512_load_si512(c[n]));
            __m512 cb = _mm512_cvtepi32_ps(_mm512_load_si512(c[AMX_N + n]));
            __m512 t = _mm512_fmadd_ps(ca, _mm512_set1_ps(S->sc[n * runs + r]),
                                       _mm512_mul_ps(cb, _mm512_set1_ps(S->mn[n * runs + r])));
            acc[n] = _mm512_fmadd_ps(t, _mm512_mul_ps(_mm512_set1_ps(S->d[n * runs + r]), dx), acc[n]);
        }
        return;
    }
    if (runs32(type)) {
#pragma GCC unroll 16
        for (int n = 0; n < AMX_N; n++) {
            __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512(c[n]));
            __m512 scale = _mm512_mul_ps(_mm512_set1_ps(S->d[n * runs + r]), dx);
            acc[n] = _mm512_fmadd_ps(s, scale, acc[n]);
        }
        return;
    }
    /* Q4_K, Q5_K (k_steps): the run's d*sc and dmin*m per weight row; x's code sums times dx */
    const __m512 xb = _mm512_mul_ps(dx, _mm512_cvtepi32_ps(
        _mm512_add_epi32(_mm512_load_si512(x->bs0), _mm512_load_si512(x->bs1))));
#pragma GCC unroll 16
    for (int n = 0; n < AMX_N; n++) {
        __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512(c[n]));
        __m512 ws = _mm512_mul_ps(_mm512_set1_ps(S->sc[n * runs + r]), dx);
        acc[n] = _mm512_fmadd_ps(s, ws, acc[n]);
        acc[n] = _mm512_fnmadd_ps(xb, _mm512_set1_ps(S->mn[n * runs + r]), acc[n]);
    }
}

/* run r's tile instructions: its dot products into c (AMX_N x AMX_M int32). Even runs take
 * tiles C0, A4, B6, odd ones C1, A5, B7: a run does not wait for the one before it to free its
 * tiles. */
ALWAYS void amx_dots(int odd, const int8_t *a, int64_t lda, const amx_xrun *x, int32_t *c) {
    if (odd) {
        _tile_zero(1);
        _tile_loadd(5, a, lda);
        _tile_loadd(7, x->b[0], 64);
        _tile_dpbssd(1, 5, 7);
        _tile_stored(1, c, 64);
    } else {
        _tile_zero(0);
        _tile_loadd(4, a, lda);
        _tile_loadd(6, x->b[0], 64);
        _tile_dpbssd(0, 4, 6);
        _tile_stored(0, c, 64);
    }
}

/* Q6_K's run r: the dot products of its codes 0-15 (A) and 16-31 (the panel AMX_N rows on)
 * into c and c + AMX_N * AMX_M, on C0/C2 (even runs) or C1/C3 */
ALWAYS void amx_dots2(int odd, const int8_t *a, int64_t lda, const amx_xrun *x, int32_t *c) {
    const int8_t *b = a + AMX_N * lda;
    /* tile numbers are immediates: one expansion per set of tiles */
#define DOTS2(C, C2, A, B)                                                                    \
    _tile_zero(C);                                                                            \
    _tile_zero(C2);                                                                           \
    _tile_loadd(B, x->b[0], 64);                                                              \
    _tile_loadd(A, a, lda);                                                                   \
    _tile_dpbssd(C, A, B);                                                                    \
    _tile_loadd(A, b, lda);                                                                   \
    _tile_dpbssd(C2, A, B);                                                                   \
    _tile_stored(C, c, 64);                                                                   \
    _tile_stored(C2, c + AMX_N * AMX_M, 64);
    if (odd) {
        DOTS2(1, 3, 5, 7)
    } else {
        DOTS2(0, 2, 4, 6)
    }
#undef DOTS2
}

#define AMX_DEPTH 2 /* runs between a run's tile instructions and its float steps */

/* one tile of x (X: its runs) against the panel (A: run r at A + astep r, rows lda apart), on
 * from the accumulators acc (the runs before: zeros, or an earlier block's).
 * A run's float steps come AMX_DEPTH runs after its tile instructions: a vector load waits for
 * the tile store before it (no forwarding), and meanwhile the later runs' dot products go on. */
ALWAYS void amx_tile(int type, const int8_t *A, int64_t lda, int64_t astep, const uint8_t *pf,
                     int64_t pf_bytes, const amx_scales *S,
                     const amx_xrun *X, int64_t runs, __m512 acc[AMX_N]) {
    _Alignas(64) int32_t c[2 * AMX_DEPTH][2 * AMX_N][AMX_M]; /* [run % (2 depth)]; Q6_K: two */
    for (int64_t r = 0; r < runs + AMX_DEPTH; r++) {
        if (r < runs) prefetch_part(pf, r, runs, pf_bytes);
        if (r < runs && type == T_Q6_K)
            amx_dots2((int)(r & 1), A + astep * r, lda, X + r, c[r % (2 * AMX_DEPTH)][0]);
        else if (r < runs)
            amx_dots((int)(r & 1), A + astep * r, lda, X + r, c[r % (2 * AMX_DEPTH)][0]);
        int64_t q = r - AMX_DEPTH;
        if (q >= 0) amx_scale_run(type, S, q, runs, X + q, c[q % (2 * AMX_DEPTH)], acc);
    }
}

/* acc[n] lane m -> y[m * ldy + n], for n < nc, m < mt */
static void amx_store(const __m512 acc[AMX_N], int nc, int mt, float *y, int64_t ldy) {
    _Alignas(64) float t[AMX_N][AMX_M];
    for (int n = 0; n < AMX_N; n++) _mm512_store_ps(t[n], acc[n]);
    for (int m = 0; m < mt; m++)
        for (int n = 0; n < nc; n++) y[m * ldy + n] = t[n][m];
}

/* a panel's row stride for K codes: a line more than K, so that a tile's 16 rows do not share
 * L1's sets where K is a multiple of 64 lines */
static int64_t amx_lda(int64_t K) { return K + 64; }

/* Blocking (one core, Xeon family 6 model 167, 3584 x 3584 Q4_K against 512 rows of x): one
 * panel of 16 weight rows against every tile of x streamed x (2.5 MB, more than L2) from L3
 * for every 16 weight rows: 145 cycles a run and tile pair. AMX_PANELS panels decoded at once
 * and each tile of x run against all of them: 81 cycles at 8 panels (116 at 2, 98 at 4). Past
 * AMX_KB runs of K (3584 values) the panels and the tile of x outgrow L2, so K is taken in
 * blocks of AMX_KB runs, the tiles' accumulators kept between blocks (1.28x at K = 18944). */
#define AMX_PANELS 8  /* panels per group: 128 weight rows */
#define AMX_KB 112    /* runs per block of K (a multiple of 8: whole K-quant super-blocks) */
#define AMX_ROWS_GROUP (AMX_PANELS * AMX_N)

/* a panel: its codes (two panels' worth: Q6_K's runs in halves), then its scales */
static size_t amx_panel_bytes(int64_t kr) {
    return (size_t)(2 * AMX_N * amx_lda(32 * kr)) + (size_t)(AMX_N * 6 * kr) * sizeof(float);
}

/* scratch bytes one thread needs for a group's panels of K values and M rows of x's results */
static size_t amx_scratch_bytes(int64_t K, int64_t M) {
    int64_t kr = K / 32 < AMX_KB ? K / 32 : AMX_KB;
    size_t panels = AMX_PANELS * ((amx_panel_bytes(kr) + 63) / 64 * 64);
    size_t one = (amx_panel_bytes(K / 32) + 63) / 64 * 64; /* a lone panel: K unblocked */
    panels = one > panels ? one : panels;
    return panels + (size_t)(AMX_PANELS * ((M + AMX_M - 1) / AMX_M)) * AMX_N * AMX_M * sizeof(float);
}

/* the byte offset of run r (a multiple of 8) in a row of this type */
static int64_t amx_run_offset(int type, int64_t r) {
    return runs32(type) ? r / runs32(type) * block_bytes(type) : r / 8 * block_bytes(type);
}

/* nc (<= AMX_ROWS_GROUP) weight rows against every tile of x (X: the tiles' runs) into y: the
 * group's panels a block of K at a time, each tile of x against all of them. `next`: the rows
 * after the group (or NULL), fetched during the first tile of x. */
ALWAYS void amx_rows_t(int type, const uint8_t *w, int64_t rb, int nc, int64_t nb, int64_t K,
                       const uint8_t *next, const amx_xrun *X, int64_t M, float *y, int64_t ldy,
                       uint8_t *scratch) {
    (void)nb;
    const int np = (nc + AMX_N - 1) / AMX_N;
    /* a lone panel takes K whole: its rows stream start to end (few rows of x: the weights'
     * read sets the pace, and blocks of K broke the rows into 128 short streams) */
    const int64_t runs = K / 32, kb = runs < AMX_KB || np == 1 ? runs : AMX_KB;
    const int64_t tiles = (M + AMX_M - 1) / AMX_M, nkb = (runs + kb - 1) / kb;
    const size_t pbytes = (amx_panel_bytes(kb) + 63) / 64 * 64;
    /* after the np panels ([panel][tile][n][m]): inside amx_scratch_bytes() for either kb */
    float *accs = (float *)(scratch + np * pbytes);
    const int64_t pf_share = next ? (int64_t)np * AMX_N * rb / (nkb * np) : 0;
    for (int64_t k0 = 0, ki = 0; k0 < runs; k0 += kb, ki++) {
        const int64_t kr = runs - k0 < kb ? runs - k0 : kb, lda = amx_lda(32 * kr);
        amx_scales S[AMX_PANELS];
        const int8_t *A[AMX_PANELS];
        int64_t la[AMX_PANELS], astep[AMX_PANELS];
        for (int p = 0; p < np; p++) {
            uint8_t *sp = scratch + p * pbytes;
            float *f = (float *)(sp + 2 * AMX_N * lda);
            /* runs of 32: d per run; K-quants: d*sc, dmin*m per run (sc, mn) */
            S[p] = (amx_scales){f, f + AMX_N * kr, f + 2 * AMX_N * kr, f + 4 * AMX_N * kr};
            const uint8_t *wp = w + p * AMX_N * rb + amx_run_offset(type, k0);
            int rows = nc - p * AMX_N < AMX_N ? nc - p * AMX_N : AMX_N;
            if (type == T_Q8_0 && rows == AMX_N) { /* tiles straight from the file */
                for (int n = 0; n < AMX_N; n++)
                    for (int64_t g = 0; g < kr; g++) S[p].d[n * kr + g] = half_f16c(wp + n * rb + 34 * g);
                A[p] = (const int8_t *)(wp + 2), la[p] = rb, astep[p] = 34;
            } else {
                amx_panel(type, wp, rb, rows, kr / 8, kr, (int8_t *)sp, lda, &S[p]);
                A[p] = (const int8_t *)sp, la[p] = lda, astep[p] = 32;
            }
        }
        for (int64_t t = 0; t < tiles; t++) {
            for (int p = 0; p < np; p++) {
                __m512 acc[AMX_N];
                float *ap = accs + (p * tiles + t) * AMX_N * AMX_M;
                const uint8_t *pf = t == 0 && next ? next + (ki * np + p) * pf_share : NULL;
                for (int n = 0; n < AMX_N; n++) /* the chain goes on from the block before */
                    acc[n] = k0 ? _mm512_load_ps(ap + n * AMX_M) : _mm512_setzero_ps();
                amx_tile(type, A[p], la[p], astep[p], pf, pf_share, &S[p], X + t * runs + k0, kr, acc);
                if (k0 + kr < runs) {
                    for (int n = 0; n < AMX_N; n++) _mm512_store_ps(ap + n * AMX_M, acc[n]);
                    continue;
                }
                int rows = nc - p * AMX_N < AMX_N ? nc - p * AMX_N : AMX_N;
                amx_store(acc, rows, (int)(M - t * AMX_M < AMX_M ? M - t * AMX_M : AMX_M),
                          y + t * AMX_M * ldy + p * AMX_N, ldy);
            }
        }
    }
}

#define AMX_ROWS(name, t)                                                                      \
    static void name(const uint8_t *w, int64_t rb, int nc, int64_t nb, int64_t K,             \
                     const uint8_t *next, const amx_xrun *X, int64_t M, float *y, int64_t ldy, \
                     uint8_t *scratch) {                                                       \
        amx_rows_t(t, w, rb, nc, nb, K, next, X, M, y, ldy, scratch);                          \
    }
AMX_ROWS(amx_q8_0, T_Q8_0)
AMX_ROWS(amx_q4_0, T_Q4_0)
AMX_ROWS(amx_q5_0, T_Q5_0)
AMX_ROWS(amx_iq4_nl, T_IQ4_NL)
AMX_ROWS(amx_iq4_xs, T_IQ4_XS)
AMX_ROWS(amx_q4_k, T_Q4_K)
AMX_ROWS(amx_q5_k, T_Q5_K)
AMX_ROWS(amx_q6_k, T_Q6_K)
#undef AMX_ROWS

typedef void (*amx_fn)(const uint8_t *, int64_t, int, int64_t, int64_t, const uint8_t *,
                       const amx_xrun *, int64_t, float *, int64_t, uint8_t *);
static const amx_fn AMX_ROWS_FN[N_TYPES] = {
    [T_Q8_0] = amx_q8_0, [T_Q4_0] = amx_q4_0, [T_Q5_0] = amx_q5_0, [T_IQ4_NL] = amx_iq4_nl,
    [T_IQ4_XS] = amx_iq4_xs, [T_Q4_K] = amx_q4_k, [T_Q5_K] = amx_q5_k, [T_Q6_K] = amx_q6_k};

/* whether a segment of this type on M rows of x runs on the tile unit */
static int amx_takes(int type, int64_t M) {
    if (AMX_ROWS_FN[type] == NULL) return 0;
    return M >= (type == T_Q8_0 ? AMX_MIN_ROWS_FILE
                 : type == T_Q6_K ? AMX_MIN_ROWS_Q6_K : AMX_MIN_ROWS_PANEL);
}
