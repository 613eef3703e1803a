/* Cephes' expf, one sequence of float operations shared by the kernels that exponentiate
 * (paged attention's softmax, the sampler's weights), so that each gives the same bits for the
 * same argument on its 8- and 16-lane paths. The callers clamp or mask the argument first (each
 * its own range); these are the steps after: n = round(x log2 e), r = x - n ln 2 in two parts,
 * a degree-5 polynomial, times 2^n. */
#ifndef TIDAL_CEPHES_EXP_H
#define TIDAL_CEPHES_EXP_H

#define EXP_LOG2E (1.44269504088896341f)
#define EXP_LN2_HI (0.693359375f)
#define EXP_LN2_LO (-2.12194440e-4f)
#define EXP_P0 (1.9875691500e-4f)
#define EXP_P1 (1.3981999507e-3f)
#define EXP_P2 (8.3334519073e-3f)
#define EXP_P3 (4.1665795894e-2f)
#define EXP_P4 (1.6666665459e-1f)
#define EXP_P5 (5.0000001201e-1f)

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* exp(x) for x already in [-87.3, 88], 8 lanes */
static inline __m256 cephes_exp256(__m256 x) {
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 y = _mm256_set1_ps(EXP_P0);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P1));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P2));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P3));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P4));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P5));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

#if defined(__AVX512F__)
/* the same, 16 lanes */
static inline __m512 cephes_exp512(__m512 x) {
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 y = _mm512_set1_ps(EXP_P0);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_P1));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_P2));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_P3));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_P4));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_P5));
    y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
#endif
#endif
#endif
