/* RMS normalisation of bf16 rows on CPU, both flavours of runtime/layers/norm.py.
 *
 * Built and loaded at run time by kernels/native_build.py, called through ctypes by
 * kernels/native_norm.py: one call per norm instead of the ~8 torch ops (each ~6 us of
 * dispatch here) that a decode step's one-row norm otherwise costs, 60 times a step.
 *
 *   r = 1 / sqrt(sum(x^2) / dim + eps)            fp32, the sum in 16 lanes then a tree
 *   kind 0 (Llama):  out = bf16(w * bf16(x * r))   (weight applied in the model dtype)
 *   kind 1 (Gemma):  out = bf16(x * r * (1 + w))   (in fp32)
 *
 * The same roundings as the torch ops; the sum of squares runs in another fp32 order
 * than torch's mean, so r may differ in its last bit. x, w and out are bf16 as uint16
 * bits; x rows have a stride, out is [rows, dim] contiguous.
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "float_bits.h"

#define LANES 16
#define PARALLEL_MIN 65536 /* elements below which one thread does it all */

static void norm_rows(const uint16_t *x, int64_t r0, int64_t r1, int64_t stride, int64_t dim,
                      const uint16_t *w, float eps, int kind, uint16_t *out) {
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *row = x + r * stride;
        uint16_t *o = out + r * dim;
        float lane[LANES] = {0};
        int64_t i = 0;
        for (; i + LANES <= dim; i += LANES)
#pragma omp simd
            for (int l = 0; l < LANES; l++) {
                const float v = bf16_to_float(row[i + l]);
                lane[l] += v * v;
            }
        for (int l = 0; i < dim; i++, l++) {
            const float v = bf16_to_float(row[i]);
            lane[l] += v * v;
        }
        for (int width = LANES / 2; width >= 1; width /= 2)
            for (int l = 0; l < width; l++)
                lane[l] += lane[l + width];
        const float rms = 1.0f / sqrtf(lane[0] / (float)dim + eps);
        if (kind == 0) {
#pragma omp simd
            for (int64_t j = 0; j < dim; j++) {
                const float normed = bf16_to_float(bf16_round(bf16_to_float(row[j]) * rms));
                o[j] = bf16_round(bf16_to_float(w[j]) * normed);
            }
        } else {
#pragma omp simd
            for (int64_t j = 0; j < dim; j++)
                o[j] = bf16_round(bf16_to_float(row[j]) * rms * (1.0f + bf16_to_float(w[j])));
        }
    }
}

void qserve_rms_norm_bf16(const uint16_t *x, int64_t rows, int64_t stride, int64_t dim,
                          const uint16_t *w, float eps, int kind, uint16_t *out,
                          int num_threads) {
    if (num_threads <= 1 || rows * dim < PARALLEL_MIN || rows < 2) {
        norm_rows(x, 0, rows, stride, dim, w, eps, kind, out);
        return;
    }
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        norm_rows(x, rows * t / nt, rows * (t + 1) / nt, stride, dim, w, eps, kind, out);
    }
}
