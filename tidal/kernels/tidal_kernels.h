/* The public entry points of tidal's C kernels, for kernels that call each other inside one
 * library (tidal/kernels/decoder.c runs a whole decoder stack through them). Each is documented
 * at its definition. Every integer is int64_t and every field 8 bytes, as the ctypes side packs
 * them. */
#ifndef TIDAL_KERNELS_H
#define TIDAL_KERNELS_H
#include <stdint.h>

/* gguf_gemm.c */
int tidal_gguf_gemm(const float *x, int64_t M, int64_t K, int64_t ldx, const int64_t *segs,
                    int64_t nseg, float *y, int64_t ldy, int64_t act, int64_t isa,
                    int64_t nthreads);
int tidal_gguf_gemm_jobs(const float *x, int64_t T, int64_t K, int64_t ldx, const int64_t *jobs,
                         int64_t njobs, const int64_t *rows, float *y, int64_t ldy, int64_t isa,
                         int64_t nthreads);
int tidal_gguf_gemm_panels(const float *x, int64_t M, int64_t K, int64_t ldx, const int64_t *segs,
                           int64_t nseg, float *y, int64_t ldy, int64_t nthreads);

/* gguf_kdecode_avx512.c (gguf_gemm.c's decode-step K-quants on AVX-512 VNNI) */
int tidal_gguf_kdecode_built(void);
int tidal_gguf_kdecode16(int type, const uint8_t *w, int64_t rb, int nc, int64_t nb,
                         const uint8_t *next, const uint8_t *x, int64_t ldx, int M, float *y,
                         int64_t ldy);

/* gguf_kdecode_avx2.c (the same on AVX2, and AVX-VNNI's vpdpbusd where vnni) */
int tidal_gguf_kdecode8(int type, int vnni, const uint8_t *w, int64_t rb, int nc, int64_t nb,
                        const uint8_t *next, const uint8_t *x, int64_t ldx, int M, float *y,
                        int64_t ldy);

/* norm_rope.c */
void tidal_rms_norm(const float *x, int64_t rows, int64_t n, int64_t ldx, const float *scale,
                    double eps, float *out, int64_t ldo);
void tidal_add_rms_norm(float *x, int64_t rows, int64_t n, int64_t ldx, const float *o,
                        int64_t ldo, const float *scale, double eps);
void tidal_qk_norm_rope(float *q, float *k, int64_t t, int64_t h, int64_t kvh, int64_t d,
                        int64_t ldq, int64_t ldk, const float *scale_q, const float *scale_k,
                        double eps, const float *cos, const float *sin);

/* paged_attention.c: the call's arguments, as tidal/kernels/paged_attention.py packs them: one
 * pointer crosses ctypes instead of 27 converted arguments (~4 us a call, 18 calls a step). */
typedef struct {
    const float *q, *k, *v;
    int64_t ldq, ldk, ldv;  /* token strides of q, k, v in floats */
    float *out;
    int64_t T, H, KVH, D;
    void *k_pages, *v_pages;
    float *k_scales, *v_scales;  /* NULL unless 8-bit */
    int64_t kv_type, block_size;
    const int64_t *slot_mapping, *block_tables;
    int64_t table_width;
    const int32_t *seqs;  /* (3, S): query_start, query_lens, context_lens */
    int64_t S, window;    /* window 0: none */
    double scale, softcap; /* softcap 0: none */
    int64_t isa, nthreads;
} tidal_attention_args;

int tidal_paged_attention(const void *packed);

#endif
