/* fp32 -> the nearest E4M3 value (as fp32), for the C kernels of this folder. */
#ifndef QSERVE_E4M3_H
#define QSERVE_E4M3_H

#include <math.h>
#include <stdint.h>

#include "float_bits.h"

/* y clamped to +-448 (NaN stays NaN), rounded half-to-even on the E4M3 grid: spacing
 * 2^(e-3) for |y| in [2^e, 2^(e+1)), e >= -6; 2^-9 below. Exact: an E4M3 value. */
static inline float e4m3_round(float y) {
    y = y < -448.0f ? -448.0f : (y > 448.0f ? 448.0f : y); /* NaN compares false */
    uint32_t exponent = float_to_bits(y) & 0x7F800000u;
    exponent = exponent < (121u << 23) ? (121u << 23) : exponent; /* 2^-6: subnormals */
    const float spacing = bits_to_float(exponent - (3u << 23));
    return rintf(y / spacing) * spacing;
}

#endif
