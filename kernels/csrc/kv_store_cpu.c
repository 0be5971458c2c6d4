/* Write a step's new K/V rows into their paged-cache slots on CPU, quantizing to E4M3.
 *
 * Built and loaded at run time by kernels/native_build.py, called through ctypes by
 * kernels/native_kv_store.py: one call per layer instead of the ~10 torch ops (quantize,
 * cast, scatter for K and for V) a decode step otherwise pays 30 times.
 *
 *   pool[slot[t], h, :] = E4M3(clamp(x[t, h, :] / scale[h or 0], +-448))   (kind 0)
 *   pool[slot[t], h, :] = x[t, h, :]                                         (kind 1, bf16)
 *
 * Bit-identical to kernels/kv_store.py's torch path (quantize_fp8: fp32 division, clamp,
 * round half to even on the E4M3 grid; NaN -> 0x7F with its sign). x is bf16 [T, Hkv, D]
 * with heads contiguous and a token stride; pools are [slots, Hkv, D] contiguous; slots are
 * distinct and in range (checked by the caller's step plan). Given the same rows and pool
 * as K and V (a latent cache, whose values are its keys), it stores them once.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "e4m3.h"
#include "float_bits.h"

static inline uint8_t e4m3_encode(float y) { /* y: any fp32 -> the E4M3 byte of e4m3_round */
    const float q = e4m3_round(y);
    if (q != q) /* torch keeps a NaN's sign */
        return (uint8_t)((float_to_bits(y) >> 24) & 0x80u) | 0x7Fu;
    const uint32_t bits = float_to_bits(q);
    const uint8_t sign = (uint8_t)(bits >> 24) & 0x80u;
    const float a = fabsf(q);
    if (a < 0x1p-6f) /* subnormal or zero: a multiple of 2^-9 below 8 * 2^-9 */
        return sign | (uint8_t)(a * 512.0f);
    const uint32_t e = ((bits >> 23) & 0xFFu) - 127u + 7u, m = (bits >> 20) & 7u;
    return sign | (uint8_t)(e << 3 | m);
}

static void store_one(const uint16_t *x, int64_t tokens, int64_t stride, int64_t hkv,
                      int64_t d, const int64_t *slots, int kind, const float *scale,
                      int64_t scale_len, void *pool) {
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *row = x + t * stride;
        if (kind == 1) {
            memcpy((uint16_t *)pool + slots[t] * hkv * d, row, (size_t)(hkv * d) * 2);
            continue;
        }
        uint8_t *dst = (uint8_t *)pool + slots[t] * hkv * d;
        for (int64_t h = 0; h < hkv; h++) {
            const float s = scale[scale_len == 1 ? 0 : h];
#pragma omp simd
            for (int64_t i = 0; i < d; i++)
                dst[h * d + i] = e4m3_encode(bf16_to_float(row[h * d + i]) / s);
        }
    }
}

void qserve_store_kv(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride,
                     int64_t tokens, int64_t hkv, int64_t d, const int64_t *slots, int kind,
                     const float *k_scale, const float *v_scale, int64_t scale_len,
                     void *k_pool, void *v_pool) {
    store_one(k, tokens, k_stride, hkv, d, slots, kind, k_scale, scale_len, k_pool);
    /* the same rows into the same pool with the same scale: a latent cache (MLA), stored once */
    if (v_pool != k_pool || v != k || v_stride != k_stride || v_scale != k_scale)
        store_one(v, tokens, v_stride, hkv, d, slots, kind, v_scale, scale_len, v_pool);
}
