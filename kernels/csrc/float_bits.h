/* fp32 <-> its bits, for the C kernels of this folder (memcpy: no aliasing games). */
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

#endif
