/* Rotary position embedding of bf16 heads on CPU (runtime/layers/rotary.py apply_rotary).
 *
 * Built and loaded at run time by kernels/native_build.py, called through ctypes by
 * kernels/native_rotary.py: one call per tensor instead of ~6 torch ops.
 *
 *   out[t, h, i] = bf16(bf16(x[t, h, i] * cos[t, i]) + bf16(rot[t, h, i] * sin[t, i]))
 *   rot = (-x[.., D/2:], x[.., :D/2])   (rotate_half)
 *
 * Bit-identical to the torch ops on bf16 (each product and the sum in fp32, each rounded
 * to bf16 as torch rounds its bf16 results). x: [T, H, D] with heads contiguous and a
 * token stride; cos, sin: [T, D] contiguous; out: [T, H, D] contiguous; bf16 as bits.
 */

#include <stdint.h>

#include "float_bits.h"

static inline float product_bf16(float a, uint16_t b) { /* bf16(a * b), back as fp32 */
    return bf16_to_float(bf16_round(a * bf16_to_float(b)));
}

void qserve_rotary_bf16(const uint16_t *x, int64_t tokens, int64_t token_stride,
                        int64_t heads, int64_t dim, const uint16_t *cos, const uint16_t *sin,
                        uint16_t *out) {
    const int64_t half = dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *xi = x + t * token_stride + h * dim;
            uint16_t *o = out + (t * heads + h) * dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) { /* rot = -x[i + half] */
                const float a = product_bf16(bf16_to_float(xi[i]), c[i]);
                const float b = product_bf16(-bf16_to_float(xi[i + half]), s[i]);
                o[i] = bf16_round(a + b);
            }
#pragma omp simd
            for (int64_t i = half; i < dim; i++) { /* rot = x[i - half] */
                const float a = product_bf16(bf16_to_float(xi[i]), c[i]);
                const float b = product_bf16(bf16_to_float(xi[i - half]), s[i]);
                o[i] = bf16_round(a + b);
            }
        }
    }
}
