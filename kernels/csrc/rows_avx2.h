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

/* acc[2 r], acc[2 r + 1] (channels 0-7, 8-15) += x_r[k] * w[k][0..15] for r < rows and
 * k = k0, k0 + 2, ... < k1, in k order, one FMA per product; x_r = x + r * x_stride.
 * Always inlined with a constant `rows`: the accumulators are named locals (the compiler
 * keeps arrays of vectors on the stack and copies them around), read from acc once and
 * written back once. */
static inline __attribute__((always_inline)) void fma_rows_parity(
    const float *x, int64_t x_stride, int rows, const float *w, int64_t k0, int64_t k1,
    __m256 *acc) {
    const __m256 z = _mm256_setzero_ps();
    __m256 a0 = rows > 0 ? acc[0] : z, b0 = rows > 0 ? acc[1] : z;
    __m256 a1 = rows > 1 ? acc[2] : z, b1 = rows > 1 ? acc[3] : z;
    __m256 a2 = rows > 2 ? acc[4] : z, b2 = rows > 2 ? acc[5] : z;
    __m256 a3 = rows > 3 ? acc[6] : z, b3 = rows > 3 ? acc[7] : z;
    __m256 a4 = rows > 4 ? acc[8] : z, b4 = rows > 4 ? acc[9] : z;
    __m256 a5 = rows > 5 ? acc[10] : z, b5 = rows > 5 ? acc[11] : z;
#define QSERVE_ROW_STEP(r)                                                                 \
    if (rows > r) {                                                                        \
        const __m256 xr = _mm256_broadcast_ss(x + r * x_stride + k);                       \
        a##r = _mm256_fmadd_ps(xr, w0, a##r);                                              \
        b##r = _mm256_fmadd_ps(xr, w1, b##r);                                              \
    }
#pragma GCC unroll 16
    for (int64_t k = k0; k < k1; k += 2) {
        __m256 w0 = _mm256_load_ps(w + k * 16), w1 = _mm256_load_ps(w + k * 16 + 8);
        __asm__("" : "+x"(w0), "+x"(w1)); /* in registers, not folded into every FMA */
        QSERVE_ROW_STEP(0)
        QSERVE_ROW_STEP(1)
        QSERVE_ROW_STEP(2)
        QSERVE_ROW_STEP(3)
        QSERVE_ROW_STEP(4)
        QSERVE_ROW_STEP(5)
    }
#undef QSERVE_ROW_STEP
    if (rows > 0) acc[0] = a0, acc[1] = b0;
    if (rows > 1) acc[2] = a1, acc[3] = b1;
    if (rows > 2) acc[4] = a2, acc[5] = b2;
    if (rows > 3) acc[6] = a3, acc[7] = b3;
    if (rows > 4) acc[8] = a4, acc[9] = b4;
    if (rows > 5) acc[10] = a5, acc[11] = b5;
}

#endif
