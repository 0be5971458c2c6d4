/* The register-blocked step both AVX2 linears (fp8_gemv_cpu.c, bf16_gemv_cpu.c) repeat on
 * their pair tiles, where a vector of 8 fp32 weights is 4 channels' (even k, odd k) pairs:
 * one k pair of a 16-channel tile (4 such vectors) for three input rows. Include after
 * <immintrin.h>, where __AVX2__ and __FMA__ are defined. */
#ifndef QSERVE_PAIRS_AVX2_H
#define QSERVE_PAIRS_AVX2_H

/* (x[k], x[k + 1]) repeated over the 8 lanes: one load. */
static inline __attribute__((always_inline)) __m256 broadcast_pair(const float *x) {
    return _mm256_castpd_ps(_mm256_broadcast_sd((const double *)x));
}

/* a_j += (x0[0], x0[1]) * w_j, likewise b_j for x1 and c_j for x2, j = 0..3, w_j the 8
 * floats at w + 8 j: each row's even and odd chains, one FMA per product. 12
 * accumulators, 3 broadcasts and the weight vector fill the 16 ymm registers; each weight
 * vector is loaded once for the three rows. Always inlined into a loop over k pairs. */
static inline __attribute__((always_inline)) void fma_pairs3(
    const float *x0, const float *x1, const float *x2, const float *w, __m256 *a0,
    __m256 *a1, __m256 *a2, __m256 *a3, __m256 *b0, __m256 *b1, __m256 *b2, __m256 *b3,
    __m256 *c0, __m256 *c1, __m256 *c2, __m256 *c3) {
    const __m256 p0 = broadcast_pair(x0), p1 = broadcast_pair(x1), p2 = broadcast_pair(x2);
    __m256 v = _mm256_load_ps(w);
    __asm__("" : "+x"(v)); /* in a register, not folded into three FMAs as a load */
    *a0 = _mm256_fmadd_ps(p0, v, *a0), *b0 = _mm256_fmadd_ps(p1, v, *b0);
    *c0 = _mm256_fmadd_ps(p2, v, *c0);
    v = _mm256_load_ps(w + 8);
    __asm__("" : "+x"(v));
    *a1 = _mm256_fmadd_ps(p0, v, *a1), *b1 = _mm256_fmadd_ps(p1, v, *b1);
    *c1 = _mm256_fmadd_ps(p2, v, *c1);
    v = _mm256_load_ps(w + 16);
    __asm__("" : "+x"(v));
    *a2 = _mm256_fmadd_ps(p0, v, *a2), *b2 = _mm256_fmadd_ps(p1, v, *b2);
    *c2 = _mm256_fmadd_ps(p2, v, *c2);
    v = _mm256_load_ps(w + 24);
    __asm__("" : "+x"(v));
    *a3 = _mm256_fmadd_ps(p0, v, *a3), *b3 = _mm256_fmadd_ps(p1, v, *b3);
    *c3 = _mm256_fmadd_ps(p2, v, *c3);
}

#endif
