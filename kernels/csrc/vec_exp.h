/* e^x for x <= 0, scalar and on vectors of 16 and 8 fp32 lanes (GCC / Clang vector
 * extensions), for the softmax of the attention kernels of this folder. Every form splits
 * x log2(e) = i + f the same way, so every lane is the scalar's bits. */
#ifndef QSERVE_VEC_EXP_H
#define QSERVE_VEC_EXP_H

#include <stdint.h>

#include "exp_taylor.h"
#include "float_bits.h"

/* e^x for x <= 0 (softmax after subtracting the max), vectorisable: x * log2(e) = i + f
 * with i = round(x * log2(e)), |f| <= 1/2, 2^f by its Taylor series to degree 7
 * (exp_taylor.h), 2^i put into the exponent bits. Below -87 it returns e^-87 ~ 1e-38
 * instead of a smaller number: nothing next to the max's e^0 = 1 in a sum. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.44269504088896341f;
    const int32_t i = (int32_t)(t - 0.5f); /* t <= 0: truncation of t - 1/2 rounds t */
    const float f = (t - (float)i) * 0.693147180559945309f; /* f * ln 2, |.| <= 0.35 */
    return EXP_TAYLOR7(f) * bits_to_float((uint32_t)(i + 127) << 23);
}

/* 16 fp32 lanes (GCC / Clang vector extension: one AVX-512 register, or smaller ones where
 * the machine has no 512-bit vectors); `vf16u` loads and stores at any float alignment. */
typedef float vf16 __attribute__((vector_size(64)));
typedef float vf16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi16 __attribute__((vector_size(64)));

/* exp_nonpositive on 16 lanes, the same operations (the compiler left the scalar loop
 * over a score row unvectorised). */
static inline vf16 exp_nonpositive16(vf16 x) {
    const vi16 low = x < -87.0f; /* all ones where clamped */
    const vf16 floor = {0};
    x = (vf16)(((vi16)x & ~low) | ((vi16)(floor - 87.0f) & low));
    const vf16 t = x * 1.44269504088896341f;
    const vi16 i = __builtin_convertvector(t - 0.5f, vi16);
    const vf16 f = (t - __builtin_convertvector(i, vf16)) * 0.693147180559945309f;
    return EXP_TAYLOR7(f) * (vf16)((i + 127) << 23);
}

/* Without AVX-512 the compiler lowers a 16-lane vector to two 8-lane registers but spills
 * them around every operation (measured: a 256-token prefill spent 10x the time of its
 * multiply-adds in stack moves). There the hot loops below run on explicit 8-lane halves:
 * the same operations on the same lanes in the same order, so the same bits. */
#if !defined(__AVX512F__)
#define HALF_LANES 1
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t vi8 __attribute__((vector_size(32)));

static inline vf8 exp_nonpositive8(vf8 x) { /* exp_nonpositive16 on 8 lanes */
    const vi8 low = x < -87.0f;
    const vf8 floor = {0};
    x = (vf8)(((vi8)x & ~low) | ((vi8)(floor - 87.0f) & low));
    const vf8 t = x * 1.44269504088896341f;
    const vi8 i = __builtin_convertvector(t - 0.5f, vi8);
    const vf8 f = (t - __builtin_convertvector(i, vf8)) * 0.693147180559945309f;
    return EXP_TAYLOR7(f) * (vf8)((i + 127) << 23);
}
#endif

#endif
