/* The elementwise steps of a decoder layer on bf16 rows on CPU, for the C decode path
 * (runtime/models/native_decoder.py), with torch's roundings.
 *
 * qserve_add_bf16:       x[i] = bf16(x[i] + y[i])                      (in place)
 * qserve_act_mul_bf16:   out[r, i] = bf16(bf16(act(g)) * u), g = gu[r, i], u = gu[r, n + i]
 *                        (gate | up halves of a fused projection's output row); act 0 is
 *                        silu, 1 the tanh approximation of GELU
 * qserve_round_bf16:     out[i] = bf16(x[i]) from fp32
 *
 * The adds and products are bit-identical to torch's bf16 ops (fp32 arithmetic, one
 * rounding). silu = g / (1 + exp(-g)) and gelu = g / 2 * (1 + tanh(sqrt(2 / pi) * (g +
 * 0.044715 g^3))) in fp32 use the C library's expf and tanhf, which may differ from torch's
 * vectorised ones in the last fp32 bit, so an activation may differ by one bf16 step where
 * that bit decides the rounding. bf16 travels as uint16 bits.
 */

#include <math.h>
#include <stdint.h>

#include "float_bits.h"

void qserve_add_bf16(uint16_t *x, const uint16_t *y, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        x[i] = bf16_round(bf16_to_float(x[i]) + bf16_to_float(y[i]));
}

static inline float activation(float x, int act) {
    if (act == 0)
        return x / (1.0f + expf(-x));
    const float cube = x * x * x; /* torch's order: beta * (x + kappa * x^3) */
    const float inner = (float)(M_SQRT2 * M_2_SQRTPI * 0.5) * (x + 0.044715f * cube);
    return 0.5f * x * (1.0f + tanhf(inner));
}

void qserve_act_mul_bf16(const uint16_t *gu, int64_t rows, int64_t n, int act, uint16_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gu + r * 2 * n, *u = g + n;
        uint16_t *o = out + r * n;
        for (int64_t i = 0; i < n; i++) {
            const float a = bf16_to_float(bf16_round(activation(bf16_to_float(g[i]), act)));
            o[i] = bf16_round(a * bf16_to_float(u[i]));
        }
    }
}

void qserve_round_bf16(const float *x, int64_t n, uint16_t *out) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        out[i] = bf16_round(x[i]);
}
