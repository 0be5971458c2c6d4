/* fp32 <-> its bits, bf16 <-> fp32, for the C kernels of this folder. */
#ifndef QSERVE_FLOAT_BITS_H
#define QSERVE_FLOAT_BITS_H

#include <stdint.h>
#include <string.h>

static inline float bits_to_float(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static inline uint32_t float_to_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

static inline float bf16_to_float(uint16_t b) { return bits_to_float((uint32_t)b << 16); }

#define BF16_NAN 0x7FC0u /* torch's one NaN for every NaN it rounds to bf16 */

static inline uint16_t bf16_round(float f) { /* fp32 -> bf16, round to nearest even */
    const uint32_t b = float_to_bits(f);
    const uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    return (uint16_t)(f != f ? BF16_NAN : rounded);
}

#endif
