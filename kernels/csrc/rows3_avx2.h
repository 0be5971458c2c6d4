/* The register-blocked step both AVX2 linears (fp8_gemv_cpu.c, bf16_gemv_cpu.c) repeat:
 * three input rows times one k (fma_rows3) or a k pair (fma_rows3_kpair) of a 16-channel
 * tile. Include after <immintrin.h>, where __AVX2__ and __FMA__ are defined. */
#ifndef QSERVE_ROWS3_AVX2_H
#define QSERVE_ROWS3_AVX2_H

/* acc[r][0..1] += x_r[k] * (w0, w1) for the rows x0, x1, x2: one broadcast per row, the
 * weight vectors from registers (6 accumulators, 2 weights and a broadcast: the callers
 * keep two such sets, even and odd k, in the 16 ymm registers). Always inlined, so the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void fma_rows3(
    const float *x0, const float *x1, const float *x2, int64_t k, __m256 w0, __m256 w1,
    __m256 *a0, __m256 *a1, __m256 *b0, __m256 *b1, __m256 *c0, __m256 *c1) {
    __m256 x = _mm256_broadcast_ss(x0 + k);
    *a0 = _mm256_fmadd_ps(x, w0, *a0);
    *a1 = _mm256_fmadd_ps(x, w1, *a1);
    x = _mm256_broadcast_ss(x1 + k);
    *b0 = _mm256_fmadd_ps(x, w0, *b0);
    *b1 = _mm256_fmadd_ps(x, w1, *b1);
    x = _mm256_broadcast_ss(x2 + k);
    *c0 = _mm256_fmadd_ps(x, w0, *c0);
    *c1 = _mm256_fmadd_ps(x, w1, *c1);
}

/* One k pair of a 16-channel fp32 tile row-major [k][16] (w: row k) for the rows x0, x1,
 * x2: the even k into the a/b/c accumulators, the odd k into d/e/f, each weight vector
 * loaded once into a register and used by all three rows. */
static inline __attribute__((always_inline)) void fma_rows3_kpair(
    const float *x0, const float *x1, const float *x2, int64_t k, const float *w,
    __m256 *a0, __m256 *a1, __m256 *b0, __m256 *b1, __m256 *c0, __m256 *c1,
    __m256 *d0, __m256 *d1, __m256 *e0, __m256 *e1, __m256 *f0, __m256 *f1) {
    __m256 w0 = _mm256_load_ps(w), w1 = _mm256_load_ps(w + 8);
    __asm__("" : "+x"(w0), "+x"(w1)); /* keep them in registers, not folded into the FMAs */
    fma_rows3(x0, x1, x2, k, w0, w1, a0, a1, b0, b1, c0, c1);
    w0 = _mm256_load_ps(w + 16);
    w1 = _mm256_load_ps(w + 24);
    __asm__("" : "+x"(w0), "+x"(w1));
    fma_rows3(x0, x1, x2, k + 1, w0, w1, d0, d1, e0, e1, f0, f1);
}

#endif
