/* E4M3 <-> fp32 for the C kernels of this folder: the nearest E4M3 value of an fp32,
 * and the value of an E4M3 byte. */
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

/* Exact E4M3 -> fp32. Normal bytes (exponent field e >= 1): put e and the 3 mantissa bits
 * into an fp32 whose exponent is e + 120, i.e. 2^(e - 7) * (1 + m / 8). Subnormal bytes
 * (e == 0): m * 2^-9. The sign bit moves to bit 31. The NaN bytes 0x7F/0xFF come out as
 * +-480 (stores saturate, so KV pools never hold them; callers that can meet them check).
 * Integer selects only, so a row loop vectorises (a ?: on floats left it scalar). */
static inline float e4m3_to_float(uint8_t x) {
    const uint32_t mag = x & 0x7Fu;
    const uint32_t normal = (mag << 20) + (120u << 23);
    const uint32_t sub = float_to_bits((float)(x & 0x07u) * 0x1p-9f);
    const uint32_t is_sub = 0u - (uint32_t)(mag < 8u); /* all ones for subnormals */
    return bits_to_float(((normal & ~is_sub) | (sub & is_sub)) | ((uint32_t)(x & 0x80u) << 24));
}

#endif
