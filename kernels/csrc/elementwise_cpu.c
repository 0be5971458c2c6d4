/* The elementwise steps of a decoder layer on bf16 rows on CPU, for the C decode path
 * (runtime/models/native_decoder.py), with torch's roundings.
 *
 * qserve_add_bf16:       x[i] = bf16(x[i] + y[i])                      (in place)
 * qserve_add_rows_bf16:  x[r, i] = bf16(x[r, i] + b[i]) for each of `rows` rows (a bias)
 * qserve_act_mul_bf16:   out[r, i] = bf16(bf16(act(g)) * u), g = gu[r, i], u = gu[r, n + i]
 *                        (gate | up halves of a fused projection's output row); act 0 is
 *                        silu, 1 the tanh approximation of GELU; rows over the threads
 * qserve_round_bf16:     out[i] = bf16(x[i]) from fp32
 * qserve_copy_rows_bf16: dst[r * dst_stride + i] = src[r * src_stride + i], i < width
 *                        (bf16 rows moved between strided layouts; exact)
 * qserve_deinterleave_rows_bf16: the same move with each row's interleaved pairs split,
 *                        dst row = [src[0], src[2], ..., src[w-2], src[1], src[3], ...]
 *                        (RoPE on interleaved pairs as RoPE on halves; exact)
 *
 * The adds and products are bit-identical to torch's bf16 ops (fp32 arithmetic, one
 * rounding). silu = g / (1 + exp(-g)) and gelu = g / 2 * (1 + tanh(sqrt(2 / pi) * (g +
 * 0.044715 g^3))) in fp32, the latter as g / (1 + exp(-2 y)) with y the tanh's argument
 * (equal in exact arithmetic), and exp from `exp_clamped` below (within a few fp32 ulps of
 * expf; torch's vectorised exp differs from expf in the last bits too), so an activation
 * may differ from torch's by one bf16 step where those bits decide the rounding
 * (tests/kernels/test_elementwise.py). Below g ~ -3 torch's 1 + tanh(y) cancels to a few
 * fp32 ulps of 1; the form here keeps its relative accuracy there. The loop vectorises (no
 * library call in it): with the C library's expf it was one scalar call per element, 0.4
 * ms of a SmolLM2 step per row. bf16 travels as uint16 bits.
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "exp_taylor.h"
#include "float_bits.h"

void qserve_add_bf16(uint16_t *x, const uint16_t *y, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        x[i] = bf16_round(bf16_to_float(x[i]) + bf16_to_float(y[i]));
}

void qserve_add_rows_bf16(uint16_t *x, const uint16_t *b, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++)
        qserve_add_bf16(x + r * n, b, n);
}

/* e^x in fp32 for any x, without a library call so the loops vectorise: x log2(e) = i + f
 * with i the nearest integer, e^(f ln 2) by its Taylor series (exp_taylor.h), 2^i put into
 * the exponent bits. x is clamped to [-87, 89]: below, e^-87 ~ 1.6e-38 (nothing beside 1 in
 * 1 + e^x); above, inf as expf (e^88.8 overflows fp32), so g / (1 + e^-g) -> -0 for very
 * negative g. */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 89.0f ? 89.0f : x);
    const float t = x * 1.44269504088896341f;
    const float i = (t + 12582912.0f) - 12582912.0f; /* nearest integer (1.5 * 2^23) */
    const float f = (t - i) * 0.693147180559945309f;
    const float p = EXP_TAYLOR7(f);
    /* 2^i in two factors (i <= 128: 2^128 alone does not fit the exponent field) */
    const int32_t h = (int32_t)i / 2;
    return p * bits_to_float((uint32_t)(h + 127) << 23)
             * bits_to_float((uint32_t)((int32_t)i - h + 127) << 23);
}

static inline float activation(float x, int act) {
    if (act == 0)
        return x / (1.0f + exp_clamped(-x));
    const float cube = x * x * x; /* torch's order: beta * (x + kappa * x^3) */
    const float inner = (float)(M_SQRT2 * M_2_SQRTPI * 0.5) * (x + 0.044715f * cube);
    /* 0.5 x (1 + tanh(y)) = x / (1 + e^-2y): no cancellation where tanh(y) ~ -1 */
    return x / (1.0f + exp_clamped(-2.0f * inner));
}

/* One row; inlined with `act` a constant, so the loop has no branch on it and vectorises. */
static inline __attribute__((always_inline)) void act_mul_row(const uint16_t *g,
                                                              const uint16_t *u, int64_t n,
                                                              int act, uint16_t *o) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float a = bf16_to_float(bf16_round(activation(bf16_to_float(g[i]), act)));
        o[i] = bf16_round(a * bf16_to_float(u[i]));
    }
}

/* Outputs below which one thread does them all (a parallel region costs a few us; one
 * output costs ~1.7 ns on one AVX2 core). */
#define ACT_PARALLEL_MIN 16384

/* Rows [r0, r1) of qserve_act_mul_bf16. */
static void act_mul_rows(const uint16_t *gu, int64_t r0, int64_t r1, int64_t n, int act,
                         uint16_t *out) {
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *g = gu + r * 2 * n;
        if (act == 0)
            act_mul_row(g, g + n, n, 0, out + r * n);
        else
            act_mul_row(g, g + n, n, 1, out + r * n);
    }
}

/* Rows split over up to num_threads threads (whole rows: each output is computed alone, so
 * the split changes no bit). */
void qserve_act_mul_bf16(const uint16_t *gu, int64_t rows, int64_t n, int act, uint16_t *out,
                         int num_threads) {
    if (num_threads <= 1 || rows < 2 || rows * n < ACT_PARALLEL_MIN) {
        act_mul_rows(gu, 0, rows, n, act, out);
        return;
    }
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        act_mul_rows(gu, rows * t / nt, rows * (t + 1) / nt, n, act, out);
    }
}

void qserve_round_bf16(const float *x, int64_t n, uint16_t *out) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        out[i] = bf16_round(x[i]);
}

void qserve_copy_rows_bf16(const uint16_t *src, int64_t rows, int64_t src_stride,
                           int64_t width, uint16_t *dst, int64_t dst_stride) {
    for (int64_t r = 0; r < rows; r++)
        memcpy(dst + r * dst_stride, src + r * src_stride, (size_t)width * sizeof(uint16_t));
}

void qserve_deinterleave_rows_bf16(const uint16_t *src, int64_t rows, int64_t src_stride,
                                   int64_t width, uint16_t *dst, int64_t dst_stride) {
    const int64_t half = width / 2; /* width is even */
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *s = src + r * src_stride;
        uint16_t *d = dst + r * dst_stride;
        for (int64_t i = 0; i < half; i++) {
            d[i] = s[2 * i];
            d[half + i] = s[2 * i + 1];
        }
    }
}
