/* E4M3 <-> fp32 for the C kernels of this folder: the nearest E4M3 value of an fp32,
 * and the value of an E4M3 byte. */
#ifndef QSERVE_E4M3_H
#define QSERVE_E4M3_H

#include <math.h>
#include <stdint.h>

#include "float_bits.h"

#if defined(__SSE__)
#include <xmmintrin.h>
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#endif

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

/* 2^-120 times the value of E4M3 byte x, by integer ops only: the byte sign-extended to
 * 32 bits and shifted left by 20 has its exponent and mantissa in the low bits of fp32's
 * exponent and the top of its mantissa (bias 127 against 7: the factor 2^-120) and its
 * sign in bit 31; the mask clears the sign's copies in bits 27-30. E4M3 subnormals land
 * on fp32 subnormals with the same factor, so the result is exact, and times 2^120 it is
 * e4m3_to_float(x) for every byte (NaN bytes too: +-480). Cheaper than e4m3_to_float (no
 * subnormal select) where the caller keeps subnormal inputs as values: daz_off.
 * decode8_avx2 below is this on 8 bytes. */
static inline float e4m3_to_float_scaled(int8_t x) {
    return bits_to_float(((uint32_t)(int32_t)x << 20) & 0x87F00000u);
}

#if defined(__AVX2__)
/* e4m3_to_float_scaled on the 8 bytes at src: 8 fp32 lanes, each 2^-120 times its E4M3
 * value (exact), three integer ops per 8 bytes (fewer than F16C's unpack, shift, mask and
 * two-uop convert). Used by the attention's key blocks (paged_attention_cpu.c); the AVX2
 * FP8 linear (fp8_gemv_cpu.c) decodes 32 bytes at a time without the widening shuffle. */
static inline __m256 decode8_avx2(const void *src) {
    const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)src));
    return _mm256_castsi256_ps(
        _mm256_and_si256(_mm256_slli_epi32(v, 20), _mm256_set1_epi32((int)0x87F00000u)));
}
#endif

/* MXCSR with DAZ (denormals are zero) cleared, returning the caller's MXCSR for
 * restore_csr: the shifted decode's subnormal results must stay values. No-ops where
 * there is no MXCSR. */
#if defined(__SSE__)
static inline unsigned daz_off(void) {
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr & ~0x0040u);
    return csr;
}
static inline void restore_csr(unsigned csr) { _mm_setcsr(csr); }
#else
static inline unsigned daz_off(void) { return 0; }
static inline void restore_csr(unsigned csr) { (void)csr; }
#endif

#endif
