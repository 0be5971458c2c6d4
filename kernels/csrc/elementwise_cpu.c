/* The elementwise steps of a decoder layer on bf16 rows on CPU, for the C decode path
 * (runtime/models/native_decoder.py), with torch's roundings.
 *
 * qserve_add_bf16:       x[i] = bf16(x[i] + y[i])                      (in place)
 * qserve_silu_mul_bf16:  out[r, i] = bf16(bf16(silu(g)) * u), g = gu[r, i], u = gu[r, n + i]
 *                        (gate | up halves of a fused projection's output row)
 * qserve_round_bf16:     out[i] = bf16(x[i]) from fp32
 *
 * The adds and products are bit-identical to torch's bf16 ops (fp32 arithmetic, one
 * rounding). silu = g / (1 + exp(-g)) in fp32 uses the C library's expf, which may differ
 * from torch's vectorised exp in the last fp32 bit, so a silu value may differ by one bf16
 * step where that bit decides the rounding. bf16 travels as uint16 bits.
 */

#include <math.h>
#include <stdint.h>

#include "float_bits.h"

static inline float bf(uint16_t b) { return bits_to_float((uint32_t)b << 16); }

void qserve_add_bf16(uint16_t *x, const uint16_t *y, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        x[i] = bf16_round(bf(x[i]) + bf(y[i]));
}

void qserve_silu_mul_bf16(const uint16_t *gu, int64_t rows, int64_t n, uint16_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gu + r * 2 * n, *u = g + n;
        uint16_t *o = out + r * n;
        for (int64_t i = 0; i < n; i++) {
            const float x = bf(g[i]);
            const float s = bf(bf16_round(x / (1.0f + expf(-x))));
            o[i] = bf16_round(s * bf(u[i]));
        }
    }
}

void qserve_round_bf16(const float *x, int64_t n, uint16_t *out) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        out[i] = bf16_round(x[i]);
}
