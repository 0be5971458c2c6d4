/* The two elementwise passes around a W8A8 FP8 linear on CPU, for bf16 activations.
 *
 * Built and loaded at run time by kernels/native_build.py, called through ctypes by
 * kernels/native_fp8.py. Both are bit-identical to the torch ops they replace
 * (kernels/fp8.py quantize_fp8_values, kernels/fp8_gemm.py _rescale), in one pass and one
 * call instead of ~9 and 2 torch ops: what a decode step's small activations pay for.
 * (Identical for every input but NaN: a NaN stays NaN, as 0x7FC0.)
 *
 * qserve_quantize_e4m3_bf16: out = E4M3(x / scale) as bf16 (exact: bf16 holds every E4M3
 *   value): e4m3_round(x / scale) in fp32 (e4m3.h).
 * qserve_rescale_bf16: out[r, c] = bf16(float(acc[r, c]) * scale[c or 0]), fp32 product
 *   rounded to nearest even once (torch's fp32 -> bf16 conversion; any NaN -> 0x7FC0).
 * bf16 travels as its uint16 bits.
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "e4m3.h"
#include "float_bits.h"

#define PARALLEL_MIN 65536 /* elements below which one thread does it all */


static void quantize_range(const uint16_t *x, int64_t lo, int64_t hi, float scale,
                           uint16_t *out) {
#pragma omp simd
    for (int64_t i = lo; i < hi; i++) {
        const float q = e4m3_round(bf16_to_float(x[i]) / scale);
        out[i] = (uint16_t)(q != q ? BF16_NAN : float_to_bits(q) >> 16); /* exact: truncate */
    }
}

static void rescale_rows(const uint16_t *acc, int64_t r0, int64_t r1, int64_t cols,
                         const float *scale, int64_t scale_len, uint16_t *out) {
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *a = acc + r * cols;
        uint16_t *o = out + r * cols;
        if (scale_len == 1) {
            const float s = scale[0];
#pragma omp simd
            for (int64_t c = 0; c < cols; c++)
                o[c] = bf16_round(bf16_to_float(a[c]) * s);
        } else {
#pragma omp simd
            for (int64_t c = 0; c < cols; c++)
                o[c] = bf16_round(bf16_to_float(a[c]) * scale[c]);
        }
    }
}

/* Small calls stay out of OpenMP: entering a parallel region, even an if(0) one, cost
 * ~20 us here, 4x the whole pass over a decode step's activations. */
void qserve_quantize_e4m3_bf16(const uint16_t *x, int64_t n, float scale, uint16_t *out,
                               int num_threads) {
    if (num_threads <= 1 || n < PARALLEL_MIN) {
        quantize_range(x, 0, n, scale, out);
        return;
    }
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        quantize_range(x, n * t / nt, n * (t + 1) / nt, scale, out);
    }
}

void qserve_rescale_bf16(const uint16_t *acc, int64_t rows, int64_t cols, const float *scale,
                         int64_t scale_len, uint16_t *out, int num_threads) {
    if (num_threads <= 1 || rows * cols < PARALLEL_MIN) {
        rescale_rows(acc, 0, rows, cols, scale, scale_len, out);
        return;
    }
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        rescale_rows(acc, rows * t / nt, rows * (t + 1) / nt, cols, scale, scale_len, out);
    }
}
