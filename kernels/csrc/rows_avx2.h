/* The register-blocked step both AVX2 linears (fp8_gemv_cpu.c, bf16_gemv_cpu.c) repeat:
 * up to ROWS_AVX2 input rows times one parity of k (the even or the odd k) of a 16-channel
 * fp32 tile stored row-major [k][16]. Their sum order keeps an even and an odd chain per
 * output, so the two parities are independent: running all even k first, then all odd k,
 * gives the same chains (and bits) as alternating them, with half the accumulators live.
 * Include after <immintrin.h>, where __AVX2__ and __FMA__ are defined. */
#ifndef QSERVE_ROWS_AVX2_H
#define QSERVE_ROWS_AVX2_H

#define ROWS_AVX2 6 /* 6 rows x 16 channels: 12 accumulators, 2 weights and a broadcast in
                     * the 16 ymm registers; each weight vector is loaded once per 6 rows */

/* acc[r][0..1] += x_r[k] * w[k][0..15] for r < rows and k = k0, k0 + 2, ... < k1, in k
 * order, one FMA per product. x_r = x + r * x_stride. Always inlined with a constant
 * `rows`, so the loops unroll and acc stays in registers. */
static inline __attribute__((always_inline)) void fma_rows_parity(
    const float *x, int64_t x_stride, int rows, const float *w, int64_t k0, int64_t k1,
    __m256 (*acc)[2]) {
#pragma GCC unroll 16
    for (int64_t k = k0; k < k1; k += 2) {
        __m256 w0 = _mm256_load_ps(w + k * 16), w1 = _mm256_load_ps(w + k * 16 + 8);
        __asm__("" : "+x"(w0), "+x"(w1)); /* in registers, not folded into every FMA */
#pragma GCC unroll 6
        for (int r = 0; r < rows; r++) {
            const __m256 xr = _mm256_broadcast_ss(x + r * x_stride + k);
            acc[r][0] = _mm256_fmadd_ps(xr, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xr, w1, acc[r][1]);
        }
    }
}

#endif
