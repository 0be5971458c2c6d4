/* W8A8 FP8 linear for a few rows of bf16 input on CPU, reading E4M3 weight bytes.
 *
 * Built and loaded at run time by kernels/native_build.py, called through ctypes by
 * kernels/native_fp8_gemv.py. A decode step multiplies a handful of rows by every weight
 * of the model once, so its time is the time to read the weights: one byte per weight
 * here instead of the two of the bf16 copy oneDNN multiplies.
 *
 *   q[m, k]   = e4m3_round(x[m, k] / input_scale)                   (e4m3.h)
 *   out[m, n] = bf16(bf16(sum_k q[m, k] * w[n, k]) * scale[n or 0])
 *
 * Weight-only (W8A16, qserve_fp8_gemv_wonly_bf16): q = x, the bf16 input as it is; every
 * product of a bf16 and an E4M3 value is still exact in fp32 (8 + 4 significand bits).
 *
 * Int8 weight-only (W8A16 int, qserve_int8_gemv_wonly_bf16): the same with int8 weights
 * (-127..127, symmetric), in the same tile layout, one byte each. Every such integer is
 * exact in bf16 (8 significand bits) and every product with a bf16 input exact in fp32
 * (8 + 7 bits), so the same sums in the same order give the same bits on every path. The
 * byte of a weight is sign and magnitude (bit 7 the sign, bits 6..0 |w|) in LAYOUT_TILE,
 * decoded by the same byte tables as E4M3 with integer entries, and two's complement in
 * LAYOUT_PAIRS, each k pair's 32 bytes in slot order (no byte permutation), decoded by
 * widening loads (decode32_half_int8);
 * native_fp8_gemv.pack_int8_weight writes the one the build reads.
 *
 * The same rounding points as the torch path (kernels/fp8_gemm.py: quantize-dequantize
 * the input, bf16 matmul with fp32 accumulation rounded to bf16, fp32 rescale rounded to
 * bf16); only the order of the fp32 sum differs. Every E4M3 value is exact in bf16 and
 * every product q * w is exact in fp32 (two 4-bit significands, no subnormal), so bf16
 * matrix instructions form the products without loss.
 *
 * Sum order (that of AMX's tdpbf16ps, found by probing it with sums whose rounding shows
 * the order; tests/kernels/test_fp8_gemv.py): per block of 32 k, an fp32 sum of the
 * products of even k and one of odd k, each from 0 in k order with one rounding per
 * product; then acc += (even + odd). A row's result does not depend on the rows beside it,
 * their number or the threads.
 *
 * Weight layout (`packed`, made once at load by native_fp8_gemv.pack_fp8_weight): the
 * [N, K] E4M3 matrix, zero-padded to N16 = N rounded up to 16 and K32 = K rounded up to
 * 32, cut into B tiles of 16 channels x 32 k, each the 512 bytes
 * [16 k pairs][16 channels][2]: the operand layout of tdpbf16ps, one byte per weight.
 * Channels go in bands of up to 4 tiles (64 channels); a band stores, for each k block
 * in order, its tiles side by side, so a band's weights are one contiguous stream. Within
 * every 64 bytes the bytes are permuted so that decoding them (below) yields bf16 words
 * in order: byte 16 L + r holds word 8 L + r for r < 8 and word 32 + 8 L + r - 8 else.
 *
 * With AMX-BF16 and AVX512-VBMI, 64 bytes are decoded to bf16 by two byte table lookups
 * (vpermi2b over the 128 magnitudes: the high and the low byte of each bf16) and two byte
 * interleaves, stored to a 1 KiB buffer in L1 and loaded as a B tile; the rows of q (up
 * to 16) are the A tile. A band's weights are one forward stream: the hardware
 * prefetcher keeps up with it (software prefetch 2-16 KiB ahead measured slower).
 * Without AMX, with AVX512-BF16 and VBMI, the same decoding feeds vdpbf16ps in the same sum
 * order (run_avx512). With AVX2 and FMA (and no AVX-512) the tiles keep the pair layout
 * with another permutation (`LAYOUT_PAIRS`: in the 32 bytes of k pair p, slot 2 s + j is
 * channel c at k = 2 p + j, s being c with bits 1 and 2 swapped, and slot o sits at byte
 * 4 (o % 8) + o / 8) and run_avx2 decodes each k pair's 32 bytes to 4 vectors of 8 fp32 by
 * integer shifts (decode32_avx2): each 4 channels' even and odd lanes, which fp32 FMAs
 * with a broadcast (x[k], x[k + 1]) pair carry as the same chains, prefetching the weight
 * stream ahead. Elsewhere a
 * 256-entry table and scalar code give the same bits (in the layout of the build). x is
 * bf16 as its uint16 bits with a row stride.
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "argmax_order.h"
#include "e4m3.h"
#include "float_bits.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__) \
    && defined(__AVX512BF16__)
#define QSERVE_GEMV_AVX512 1 /* the byte-table decoder and the AVX512-BF16 path */
#include <immintrin.h>
#endif
#if !defined(QSERVE_GEMV_AVX512) && defined(__AVX2__) && defined(__FMA__)
#define QSERVE_GEMV_AVX2 1 /* shift decoding and fp32 FMAs, LAYOUT_PAIRS */
#include <immintrin.h>

#include "pairs_avx2.h"
#endif
#if defined(QSERVE_GEMV_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define QSERVE_GEMV_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define TILE_K 32     /* k per B tile */
#define TILE_N 16     /* channels per B tile */
#define BAND_TILES 4  /* B tiles (of TILE_N channels) per band */
#define TILE_BYTES (TILE_K * TILE_N)
#define MAX_ROWS 16   /* rows per call: one A tile */
#define AVX512_ROWS 64 /* rows per pass of run_avx512: each k block of a band is decoded
                        * once for all of them; above this oneDNN's bf16 matmul is faster
                        * (docs/kernels.md), so a step that may take it does */
#define AVX512_PREFETCH_L2 32768 /* run_avx512, AVX512_PREFETCH_MIN_ROWS rows or more: asks
                                  * for each k block's weights this far ahead into L2 as it
                                  * decodes it. From memory, 16 rows ran ~10% faster; 1-8 rows,
                                  * bound by memory, 5-15% slower, so they do not
                                  * (prefetcht0 at 2-32 KiB gained nothing) */
#define AVX512_PREFETCH_MIN_ROWS 16
#define PARALLEL_MIN_MACS (1 << 18) /* below this many products one thread does it all; at
                                     * 1 << 20 a one-row step of SmolLM2 ran q/k/v, o and down on
                                     * one thread (2 threads: step 16.1-16.6 -> 12.5-13.4 ms) */

static float e4m3_value(uint8_t b) { /* exact; 0x7F and 0xFF are NaN, as torch decodes them */
    return (b & 0x7Fu) == 0x7Fu ? bits_to_float(0x7FC00000u) : e4m3_to_float(b);
}

/* Where a tile keeps weight [c, k] (c < TILE_N, k < TILE_K): LAYOUT_TILE is tdpbf16ps's
 * pair layout ([16 k pairs][16 channels][2]) with the decoder's byte permutation in every
 * 64 bytes, LAYOUT_PAIRS the same pair layout with the channels of each k pair in the slots
 * run_avx2's horizontal adds return in order (channel c in slot c with its bits 1 and 2
 * swapped: 0 1 4 5 2 3 6 7 8 9 12 13 10 11 14 15). A build uses one
 * (qserve_fp8_gemv_layout()); the packing in native_fp8_gemv.py writes the one the loaded
 * build reads. */
#define LAYOUT_TILE 0
#define LAYOUT_PAIRS 1
#ifdef QSERVE_GEMV_AVX2
#define LAYOUT LAYOUT_PAIRS
#else
#define LAYOUT LAYOUT_TILE
#endif

/* Offset in `packed` of weight [n, k] (the layout above). */
static int64_t packed_offset(int64_t n, int64_t k, int64_t n16, int64_t k32) {
    const int64_t tile = n / TILE_N, band = tile / BAND_TILES;
    const int64_t band_tiles = n16 / TILE_N - band * BAND_TILES < BAND_TILES
                                   ? n16 / TILE_N - band * BAND_TILES : BAND_TILES;
    const int64_t c = n % TILE_N, pair = (k % TILE_K) / 2;
    const int64_t word = pair * 2 * TILE_N + c * 2 + k % 2;
    /* LAYOUT_PAIRS: channel c in slot c with bits 1 and 2 swapped */
    const int64_t slot = (c & 9) * 2 + (c & 2) * 4 + (c & 4) + k % 2; /* vector / 8, lane */
    int64_t byte = pair * 2 * TILE_N + slot % 8 * 4 + slot / 8; /* decode32_avx2's order */
    if (LAYOUT == LAYOUT_TILE) {
        const int64_t w = word % 64, r = w % 32;
        byte = word / 64 * 64 + 16 * (r / 8) + (w >= 32 ? 8 : 0) + r % 8;
    }
    return band * BAND_TILES * TILE_N * k32 + (k / TILE_K) * band_tiles * TILE_BYTES
           + (tile % BAND_TILES) * TILE_BYTES + byte;
}

#define CODES_E4M3 0
#define CODES_INT8 1 /* sign and magnitude in LAYOUT_TILE, two's complement in LAYOUT_PAIRS */

/* The value of an int8 weight's byte in this build's layout. */
static float int8_value(uint8_t b) {
    if (LAYOUT == LAYOUT_PAIRS)
        return (float)(int8_t)b;
    return (b & 0x80u) ? -(float)(b & 0x7Fu) : (float)(b & 0x7Fu);
}

typedef struct {
    const uint16_t *q; /* [M, k32] bf16: the E4M3 input values, zero-padded */
    const float *qf;   /* run_avx2 only: the same values times a power of two (QF_SCALE
                        * for E4M3 inputs), fp32 [M, k32] */
    const uint32_t *qp; /* run_avx512 only: q as mul_tile's pairs, made once per call (not
                         * per band): per row and k block of 32, the 8 even-chain pairs
                         * (high: k = 4s, low: 4s + 2), then the 8 odd (4s + 1, 4s + 3),
                         * [M, k32 / 2] */
    int64_t m, k, k32;
    const uint8_t *w; /* packed, [n16 * k32] */
    int64_t n, n16;
    const float *scale; /* [N] or [1] */
    int64_t scale_len;
    float scale_mul; /* multiplies scale (1: the static entry; the input scale: dynamic) */
    float sum_scale; /* run_avx2 only: multiplies the sums back (2^120 / qf's power of two) */
    uint16_t *out; /* [M, out_stride] bf16 (NULL in an argmax call) */
    int64_t out_stride;
    int codes; /* what a weight byte holds: CODES_E4M3 or CODES_INT8 */
    /* argmax calls (qserve_fp8_gemv_argmax_bf16) only, else NULL: per row, the largest
     * output this thread has computed and its channel (-1: none yet), in place of `out` */
    float *best_value;   /* [M] */
    int64_t *best_index; /* [M] */
} Gemv;

/* An argmax call's epilogue: output y (bf16 bits) of row m, channel n, against the row's
 * best so far; nothing is written to `out`. */
static inline void keep_max(const Gemv *g, int64_t m, int64_t n, uint16_t y) {
    const float v = bf16_to_float(y);
    if (beats(v, n, g->best_value[m], g->best_index[m])) {
        g->best_value[m] = v;
        g->best_index[m] = n;
    }
}

static void store(const Gemv *g, int64_t m, int64_t n, float sum) {
    const float rounded = bf16_to_float(bf16_round(sum));
    const float s = g->scale[g->scale_len == 1 ? 0 : n] * g->scale_mul;
    const uint16_t y = bf16_round(rounded * s);
    if (g->best_index != NULL)
        keep_max(g, m, n, y);
    else
        g->out[m * g->out_stride + n] = y;
}

/* store() for `width` (<= BAND_TILES * TILE_N) channels from n0 of row m, as one
 * vectorisable loop; an argmax call rounds them into a local row instead, and goes
 * through them one by one (keep_max) only where one of them (or a NaN) may beat the row's
 * best so far: once the running max is high, most rows of 64 end at that test. */
static inline void store_row(const Gemv *g, int64_t m, int64_t n0, int64_t width,
                             const float *sums) {
    const float *scale = g->scale + (g->scale_len == 1 ? 0 : n0);
    const int64_t step = g->scale_len == 1 ? 0 : 1;
    const float mul = g->scale_mul;
    if (g->best_index == NULL) {
        uint16_t *out = g->out + m * g->out_stride + n0;
#pragma omp simd
        for (int64_t j = 0; j < width; j++)
            out[j] = bf16_round(bf16_to_float(bf16_round(sums[j])) * (scale[j * step] * mul));
        return;
    }
    uint16_t kept[BAND_TILES * TILE_N]; /* bf16: the outputs, never stored */
    const float best = g->best_index[m] < 0 ? -INFINITY : g->best_value[m];
    int hit = 0; /* some output >= best, or NaN (either side): keep_max decides */
    for (int64_t j = 0; j < width; j++) {
        kept[j] = bf16_round(bf16_to_float(bf16_round(sums[j])) * (scale[j * step] * mul));
        hit |= !(bf16_to_float(kept[j]) < best);
    }
    if (hit)
        for (int64_t j = 0; j < width; j++)
            keep_max(g, m, n0 + j, kept[j]);
}

/* Channels [n0, n1) (whole bands) without AMX: the same products in the same order. */
static void run_table(const Gemv *g, int64_t n0, int64_t n1) {
    float table[256];
    for (int b = 0; b < 256; b++)
        table[b] = g->codes == CODES_INT8 ? int8_value((uint8_t)b) : e4m3_value((uint8_t)b);
    for (int64_t n = n0; n < n1 && n < g->n; n++)
        for (int64_t m = 0; m < g->m; m++) {
            const uint16_t *q = g->q + m * g->k32;
            float acc = 0.0f;
            for (int64_t kb = 0; kb < g->k32; kb += TILE_K) {
                float even = 0.0f, odd = 0.0f;
                for (int64_t k = kb; k < kb + TILE_K; k += 2) {
                    even += bf16_to_float(q[k])
                            * table[g->w[packed_offset(n, k, g->n16, g->k32)]];
                    odd += bf16_to_float(q[k + 1])
                           * table[g->w[packed_offset(n, k + 1, g->n16, g->k32)]];
                }
                acc += even + odd;
            }
            store(g, m, n, acc);
        }
}

#ifdef QSERVE_GEMV_AVX512
typedef struct {
    __m512i hi0, hi1, lo0, lo1; /* bf16 high and low bytes of magnitudes 0..63, 64..127 */
    __m512i sign;
} Decoder;

/* The high and low bytes of the bf16 of each E4M3 magnitude, made once when the library
 * loads (not on every call). */
static uint8_t bf16_hi[2][128] __attribute__((aligned(64))); /* [codes][magnitude] */
static uint8_t bf16_lo[2][128] __attribute__((aligned(64)));

__attribute__((constructor)) static void make_bf16_tables(void) {
    for (int b = 0; b < 128; b++) {
        const float value[2] = {e4m3_value((uint8_t)b), (float)b}; /* E4M3, int8 magnitude */
        for (int c = 0; c < 2; c++) {
            const uint16_t bits = (uint16_t)(float_to_bits(value[c]) >> 16); /* exact */
            bf16_hi[c][b] = (uint8_t)(bits >> 8);
            bf16_lo[c][b] = (uint8_t)bits;
        }
    }
}

static Decoder decoder(int codes) {
    Decoder d = {_mm512_load_si512(bf16_hi[codes]), _mm512_load_si512(bf16_hi[codes] + 64),
                 _mm512_load_si512(bf16_lo[codes]), _mm512_load_si512(bf16_lo[codes] + 64),
                 _mm512_set1_epi8((char)0x80)};
    return d;
}

/* One B tile: 512 packed bytes -> 512 bf16 in tdpbf16ps's layout. */
static inline void decode_tile(const Decoder *d, const uint8_t *src, uint16_t *dst) {
    for (int i = 0; i < TILE_BYTES; i += 64) {
        const __m512i bytes = _mm512_loadu_si512(src + i);
        __m512i hi = _mm512_permutex2var_epi8(d->hi0, bytes, d->hi1); /* index bit 7 unused */
        hi = _mm512_ternarylogic_epi32(hi, bytes, d->sign, 0xF8);   /* hi | (bytes & 0x80) */
        const __m512i lo = _mm512_permutex2var_epi8(d->lo0, bytes, d->lo1);
        _mm512_store_si512(dst + i, _mm512_unpacklo_epi8(lo, hi));
        _mm512_store_si512(dst + i + 32, _mm512_unpackhi_epi8(lo, hi));
    }
}

#define ROW_BLOCK 4 /* rows sharing each weight load in run_avx512 */
#define CHAIN_PAIRS (TILE_K / 4) /* vdpbf16ps steps per chain (even or odd k) of a k block */

/* `rows` (<= ROW_BLOCK) rows times one decoded tile. vdpbf16ps adds, per fp32 lane, the
 * product of the pair's high halves and then that of the low halves, each with one
 * rounding (probed on an AMD EPYC; tests/kernels/test_fp8_gemv.py checks the bits on
 * every machine the suite runs on).
 * So a lane holding (high: k, low: k + 2) continues the sum over k of one parity in k
 * order. we, wo [CHAIN_PAIRS][16 channels]: the weights of k = 4s, 4s + 2 (even chain)
 * and 4s + 1, 4s + 3 (odd chain) as bf16 pairs; qp: the same pairs of the first input row
 * in Gemv.qp's layout, the next rows qp_stride apart. Per row: even and odd sums from 0,
 * then sums[i * stride + 0..15] += even + odd. Inlined with constant `rows`. */
static inline __attribute__((always_inline)) void mul_tile(
    const uint32_t *qp, int64_t qp_stride, int rows, const __m512i *we, const __m512i *wo,
    float *sums, int64_t stride) {
    __m512 even[ROW_BLOCK], odd[ROW_BLOCK];
    for (int i = 0; i < rows; i++)
        even[i] = odd[i] = _mm512_setzero_ps();
    for (int s = 0; s < CHAIN_PAIRS; s++) {
        const __m512bh e = (__m512bh)we[s], o = (__m512bh)wo[s];
        for (int i = 0; i < rows; i++) {
            const uint32_t *qi = qp + i * qp_stride;
            /* the row's pair as vdpbf16ps's broadcast memory operand ({1to16}): GCC emits
             * _mm512_dpbf16_ps of a _mm512_set1_epi32 as a separate vpbroadcastd per
             * product (slower); the products are the same */
            __asm__("vdpbf16ps %[p]%{1to16%}, %[w], %[a]"
                    : [a] "+v"(even[i]) : [w] "v"(e), [p] "m"(qi[s]));
            __asm__("vdpbf16ps %[p]%{1to16%}, %[w], %[a]"
                    : [a] "+v"(odd[i]) : [w] "v"(o), [p] "m"(qi[CHAIN_PAIRS + s]));
        }
    }
    for (int i = 0; i < rows; i++) {
        float *sp = sums + i * stride;
        _mm512_store_ps(sp, _mm512_add_ps(_mm512_load_ps(sp), _mm512_add_ps(even[i], odd[i])));
    }
}

/* Channels [n0, n1) (whole bands), all rows, without AMX: each k block of a band is
 * decoded once and its weights regrouped into chain pairs (mul_tile); every row keeps, per
 * 16 channels, an even and an odd sum from 0 in k order, each product exact in fp32 and
 * each addition rounded once, as tdpbf16ps does: the same bits as run_amx and run_table. */
static void run_avx512(const Gemv *g, int64_t n0, int64_t n1) {
    const Decoder d = decoder(g->codes);
    const __mmask32 low_words = 0x55555555u;
    uint16_t buf[TILE_BYTES] __attribute__((aligned(64)));
    __m512i we[BAND_TILES][CHAIN_PAIRS], wo[BAND_TILES][CHAIN_PAIRS];
    const int64_t qp_stride = g->k32 / 2;
    float sums[AVX512_ROWS * BAND_TILES * TILE_N] __attribute__((aligned(64))); /* [m, 64] */
    const int64_t band_bytes = BAND_TILES * TILE_N * g->k32, stride = BAND_TILES * TILE_N;
    for (int64_t b0 = n0; b0 < n1; b0 += BAND_TILES * TILE_N) {
        const int64_t left = (g->n16 - b0) / TILE_N;
        const int tiles = left < BAND_TILES ? (int)left : BAND_TILES;
        const uint8_t *band = g->w + b0 / (BAND_TILES * TILE_N) * band_bytes;
        memset(sums, 0, (size_t)(g->m * stride) * sizeof(float));
        for (int64_t kb = 0; kb < g->k32 / TILE_K; kb++) {
            const uint8_t *src = band + kb * tiles * TILE_BYTES;
            if (g->m >= AVX512_PREFETCH_MIN_ROWS) /* see AVX512_PREFETCH_L2 */
                for (int64_t l = 0; l < tiles * TILE_BYTES; l += 64)
                    _mm_prefetch((const char *)src + AVX512_PREFETCH_L2 + l, _MM_HINT_T1);
            for (int t = 0; t < tiles; t++) {
                decode_tile(&d, src + t * TILE_BYTES, buf);
                /* row r of buf: per channel the words of k = 2r (low) and 2r + 1 (high) */
                for (int s = 0; s < CHAIN_PAIRS; s++) {
                    const __m512i r0 = _mm512_load_si512(buf + 2 * s * 2 * TILE_N);
                    const __m512i r1 = _mm512_load_si512(buf + (2 * s + 1) * 2 * TILE_N);
                    /* (high: k = 4s, low: 4s + 2) and (high: 4s + 1, low: 4s + 3) */
                    we[t][s] = _mm512_mask_blend_epi16(low_words, _mm512_slli_epi32(r0, 16), r1);
                    wo[t][s] = _mm512_mask_blend_epi16(low_words, r0, _mm512_srli_epi32(r1, 16));
                }
            }
            const uint32_t *qk = g->qp + kb * 2 * CHAIN_PAIRS; /* row 0's pairs of block kb */
            for (int t = 0; t < tiles; t++) {
                float *sp = sums + t * TILE_N;
                int64_t i = 0;
                for (; i + ROW_BLOCK <= g->m; i += ROW_BLOCK)
                    mul_tile(qk + i * qp_stride, qp_stride, ROW_BLOCK, we[t], wo[t],
                             sp + i * stride, stride);
                const uint32_t *qi = qk + i * qp_stride;
                float *si = sp + i * stride;
                switch (g->m - i) {
                case 3: mul_tile(qi, qp_stride, 3, we[t], wo[t], si, stride); break;
                case 2: mul_tile(qi, qp_stride, 2, we[t], wo[t], si, stride); break;
                case 1: mul_tile(qi, qp_stride, 1, we[t], wo[t], si, stride); break;
                default: break;
                }
            }
        }
        for (int64_t i = 0; i < g->m; i++)
            for (int64_t j = 0; j < tiles * TILE_N && b0 + j < g->n; j++)
                store(g, i, b0 + j, sums[i * stride + j]);
    }
}
#endif

#ifdef QSERVE_GEMV_AVX2
/* Powers of two that keep run_avx2's arithmetic exact and free of subnormal results:
 * decoded weights are 2^-120 times their E4M3 values (decode8_avx2), the fp32 inputs qf
 * 2^112 times theirs (448 * 2^112 < 2^128), so every product and sum is 2^-8 times the
 * true one, every nonzero product a normal number (the smallest is 2^-18 * 2^-8: no slow
 * subnormal results) and every sum a multiple of 2^-26; the sums are multiplied back by
 * 2^8 before rounding. Scaling by powers of two changes no rounding, so the bits are those
 * of the unscaled chains. */
#define QF_SCALE 0x1p112f
#define PREFETCH_BYTES 2048 /* software prefetch distance in the weight stream: without
                               it the hardware prefetcher leaves the cores waiting */

/* Weights decode by decode32_avx2 (below; per byte, e4m3.h's e4m3_to_float_scaled). Its
 * NaN bytes 0x7F / 0xFF would decode to +-480 * 2^-120: the packing refuses weights that
 * hold them (native_fp8_gemv.pack_fp8_weight). E4M3 subnormal weights are fp32 subnormal inputs, so
 * run_avx2 clears MXCSR.DAZ while it runs. */

/* Two of the 4 weight vectors of one k pair of a LAYOUT_PAIRS tile at src, 2^-120 times
 * the E4M3 values (as decode8_avx2, exact), from one 32-byte load and no byte shuffles:
 * byte 4 l + j of the 32 is lane l of vector j. Per 16-bit half (two bytes), an arithmetic
 * shift right by 4 leaves the high byte's sign in bit 15 and its 7 magnitude bits in bits
 * 10..4 (bits 31 and 26..20 of the 32-bit lane for the high half), which the mask keeps;
 * the low byte gets there after a shift left by 8, the low half after one by 16. odd = 1:
 * vectors 1 (*lo) and 3 (*hi); odd = 0: vectors 0 and 2. */
static inline __attribute__((always_inline)) void decode32_half_avx2(const uint8_t *src, int odd,
                                                                      __m256 *lo, __m256 *hi) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)src);
    const __m256i mask = _mm256_set1_epi32((int)0x87F00000u);
    const __m256i x = _mm256_srai_epi16(odd ? bytes : _mm256_slli_epi16(bytes, 8), 4);
    *hi = _mm256_castsi256_ps(_mm256_and_si256(x, mask));
    *lo = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(x, 16), mask));
}

/* decode32_half_avx2 for int8 weights (two's complement in LAYOUT_PAIRS, the k pair's 32
 * bytes in slot order, without E4M3's byte permutation): vector j is bytes 8 j..8 j + 7,
 * sign-extended by a widening load and converted to fp32 (exact): the values themselves,
 * not scaled. (Shifting each byte out of one 32-byte load, as E4M3 does, measured ~20%
 * slower at one row: 1 thread, capped to AVX2, SmolLM2's linear shapes.) */
static inline __attribute__((always_inline)) void decode32_half_int8(const uint8_t *src, int odd,
                                                                      __m256 *lo, __m256 *hi) {
    const __m128i *lo8 = (const __m128i *)(src + 8 * odd), *hi8 = (const __m128i *)(src + 16 + 8 * odd);
    *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(lo8)));
    *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(hi8)));
}

/* Two vectors of the k pair at src by the codes' decoder (int8 constant where inlined). */
static inline __attribute__((always_inline)) void decode32_half(const uint8_t *src, int odd,
                                                                int int8, __m256 *lo,
                                                                __m256 *hi) {
    if (int8)
        decode32_half_int8(src, odd, lo, hi);
    else
        decode32_half_avx2(src, odd, lo, hi);
}

/* All 4 vectors of the k pair at src (*v0..*v3): for E4M3 five shifts and four ands for 32
 * weights (the compiler keeps the one load), where four decode8_avx2 take four widening
 * loads (shuffles), four shifts and four ands. */
static inline __attribute__((always_inline)) void decode32_avx2(const uint8_t *src, int int8,
                                                                 __m256 *v0, __m256 *v1,
                                                                 __m256 *v2, __m256 *v3) {
    decode32_half(src, 0, int8, v0, v2);
    decode32_half(src, 1, int8, v1, v3);
}

/* Rows up to which run_avx2 decodes a tile into registers again for every three rows
 * rather than once into an L1 buffer: decoding from L1 costs less than the buffer's
 * stores and loads there (1 thread, capped to AVX2, FP8 linears of a SmolLM2 step: 5 rows
 * 18.3-20.1 -> 15.3-17.2 ms, 6 rows 19.3-25.6 -> 17.4-18.0; 4 rows, formerly a 4-row
 * kernel of its own, 14.9-16.4 -> 14.2-15.6; 8 or more rows showed no clear gain). */
#define DIRECT_ROWS_MAX 6
#define ROW_CHUNK_AVX2 48 /* rows whose sums [48][64] fp32 stay in L1 while a band runs */

/* In LAYOUT_PAIRS a decoded vector holds 4 channels' (even k, odd k) pairs at one k pair,
 * 4 even and 4 odd chain lanes side by side, so one
 * 8-byte broadcast of a row's (q[k], q[k + 1]) multiplies all of them: one broadcast per
 * row and k pair (a k-major tile needs two), so three rows load 7 vectors per 12 FMAs
 * instead of 10. */

/* sums[0..15] += even + odd of 16 channels from the 4 pair accumulators v0..v3, each 4
 * (even, odd) lane pairs: the tile's channel slots (LAYOUT_PAIRS) put channels 0 1 4 5 in
 * v0, 2 3 6 7 in v1, and so on, so that hadd, which adds each pair (one rounding, as the
 * chains' even + odd), returns channels 0..7 and 8..15 in order. */
static inline __attribute__((always_inline)) void add_pair_sums(float *sums, __m256 v0,
                                                                __m256 v1, __m256 v2,
                                                                __m256 v3) {
    _mm256_store_ps(sums, _mm256_add_ps(_mm256_load_ps(sums), _mm256_hadd_ps(v0, v1)));
    _mm256_store_ps(sums + 8, _mm256_add_ps(_mm256_load_ps(sums + 8), _mm256_hadd_ps(v2, v3)));
}

/* Three rows times one decoded tile w ([16 k pairs][16 channels][2] fp32, 2^-120 times the
 * weights). q: the rows' k block (QF_SCALE times the inputs), stride q_stride. Per row and
 * channel an even and an odd chain from 0 in k order, one FMA per product (exact in fp32,
 * so one rounding per addition, as tdpbf16ps), then sums[i * stride + 0..15] += even +
 * odd, by fma_pairs3 (pairs_avx2.h). Not inlined: inside the caller's loops the
 * compiler spilled accumulators. */
static __attribute__((noinline)) void mul_tile3_avx2(const float *q, int64_t q_stride,
                                                     const float *w, float *sums,
                                                     int64_t stride) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    const float *q1 = q + q_stride, *q2 = q1 + q_stride;
#pragma GCC unroll 16 /* whole: the counter and branch otherwise slow the FMA stream */
    for (int k = 0; k < TILE_K; k += 2)
        fma_pairs3(q + k, q1 + k, q2 + k, w + k * TILE_N, &a0, &a1, &a2, &a3, &b0, &b1, &b2,
                   &b3, &c0, &c1, &c2, &c3);
    add_pair_sums(sums, a0, a1, a2, a3);
    add_pair_sums(sums + stride, b0, b1, b2, b3);
    add_pair_sums(sums + 2 * stride, c0, c1, c2, c3);
}

/* `rows` (1 or 2) rows times one tile: from the decoded tile w (as mul_tile3_avx2) or,
 * where w is NULL, decoding the tile's bytes at src (int8 or E4M3 codes) into registers
 * (steps of one or two rows, which read each weight once: no round trip through a
 * buffer). The same chains. Inlined with constant `rows`, w and int8. */
static inline __attribute__((always_inline)) void mul_tile_avx2(
    const float *q, int64_t q_stride, int rows, const float *w, const uint8_t *src, int int8,
    float *sums, int64_t stride) {
    __m256 acc[2][4];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < 4; j++)
            acc[i][j] = _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int k = 0; k < TILE_K; k += 2) {
        if (w == NULL)
            _mm_prefetch((const char *)src + k * TILE_N + PREFETCH_BYTES, _MM_HINT_T0);
        __m256 x[2], d[4];
        for (int i = 0; i < rows; i++)
            x[i] = broadcast_pair(q + i * q_stride + k);
        if (w == NULL)
            decode32_avx2(src + k * TILE_N, int8, &d[0], &d[1], &d[2], &d[3]);
        for (int j = 0; j < 4; j++) {
            const __m256 v = w == NULL ? d[j] : _mm256_load_ps(w + k * TILE_N + 8 * j);
            for (int i = 0; i < rows; i++)
                acc[i][j] = _mm256_fmadd_ps(x[i], v, acc[i][j]);
        }
    }
    for (int i = 0; i < rows; i++)
        add_pair_sums(sums + i * stride, acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
}

/* Three rows times one tile, decoding its bytes at src into registers: the chains of
 * mul_tile3_avx2 with 2 decoded weight vectors at a time (12 accumulators, 2 weights, a
 * broadcast and the decoder's mask: the 16 ymm registers), each row's pair broadcast
 * loaded once per 2 vectors. */
static inline __attribute__((always_inline)) void mul_tile_direct3(
    const float *q, int64_t q_stride, const uint8_t *src, int int8, float *sums,
    int64_t stride) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    const float *q1 = q + q_stride, *q2 = q1 + q_stride;
#pragma GCC unroll 16
    for (int k = 0; k < TILE_K; k += 2) {
        const uint8_t *b = src + k * TILE_N;
        _mm_prefetch((const char *)b + PREFETCH_BYTES, _MM_HINT_T0);
        __m256 v0, v2;
        decode32_half(b, 0, int8, &v0, &v2);
        __m256 x = broadcast_pair(q + k);
        a0 = _mm256_fmadd_ps(x, v0, a0), a2 = _mm256_fmadd_ps(x, v2, a2);
        x = broadcast_pair(q1 + k);
        b0 = _mm256_fmadd_ps(x, v0, b0), b2 = _mm256_fmadd_ps(x, v2, b2);
        x = broadcast_pair(q2 + k);
        c0 = _mm256_fmadd_ps(x, v0, c0), c2 = _mm256_fmadd_ps(x, v2, c2);
        const uint8_t *b_again = b;
        __asm__("" : "+r"(b_again)); /* the 32 bytes loaded again from L1 */
        decode32_half(b_again, 1, int8, &v0, &v2); /* vectors 1 and 3 */
        const float *r0 = q, *r1 = q1, *r2 = q2;
        __asm__("" : "+r"(r0), "+r"(r1), "+r"(r2)); /* loaded again, not kept in registers */
        x = broadcast_pair(r0 + k);
        a1 = _mm256_fmadd_ps(x, v0, a1), a3 = _mm256_fmadd_ps(x, v2, a3);
        x = broadcast_pair(r1 + k);
        b1 = _mm256_fmadd_ps(x, v0, b1), b3 = _mm256_fmadd_ps(x, v2, b3);
        x = broadcast_pair(r2 + k);
        c1 = _mm256_fmadd_ps(x, v0, c1), c3 = _mm256_fmadd_ps(x, v2, c3);
    }
    add_pair_sums(sums, a0, a1, a2, a3);
    add_pair_sums(sums + stride, b0, b1, b2, b3);
    add_pair_sums(sums + 2 * stride, c0, c1, c2, c3);
}

/* mul_tile_direct3 for E4M3 and for int8 codes, each compiled on its own. */
static __attribute__((noinline)) void mul_tile_direct3_avx2(const float *q, int64_t q_stride,
                                                            const uint8_t *src, float *sums,
                                                            int64_t stride) {
    mul_tile_direct3(q, q_stride, src, 0, sums, stride);
}

static __attribute__((noinline)) void mul_tile_direct3_int8(const float *q, int64_t q_stride,
                                                            const uint8_t *src, float *sums,
                                                            int64_t stride) {
    mul_tile_direct3(q, q_stride, src, 1, sums, stride);
}

/* Channels [n0, n1) (whole tiles), any number of rows, with AVX2. Rows go in chunks of
 * ROW_CHUNK_AVX2 per band (their sums stay in L1; the band's bytes, read again per chunk,
 * in L2). Up to DIRECT_ROWS_MAX rows decode each tile into registers, once per three rows
 * (mul_tile_direct3_avx2) and once for the last one or two (mul_tile_avx2 with src); more
 * rows decode each tile of a band's k block once to fp32 in L1 and run their chains over
 * it, three rows at a time (mul_tile3_avx2), the last one or two by mul_tile_avx2. A row's
 * chains are the same whatever group, chunk or block it falls in. int8: the weights are
 * int8 codes (constant: run_avx2_e4m3 and run_avx2_int8 each compile their own). */
static inline __attribute__((always_inline)) void run_avx2(const Gemv *g, int64_t n0,
                                                           int64_t n1, int int8) {
    const unsigned csr = daz_off(); /* subnormal weights are values, not zeros */
    float buf[TILE_K * TILE_N] __attribute__((aligned(32)));
    float sums[ROW_CHUNK_AVX2 * BAND_TILES * TILE_N] __attribute__((aligned(32)));
    const int64_t band_ch = BAND_TILES * TILE_N, stride = band_ch;
    const int64_t band_bytes = band_ch * g->k32;
    for (int64_t b0 = n0 / band_ch * band_ch; b0 < n1; b0 += band_ch) {
        const int64_t left = (g->n16 - b0) / TILE_N;
        const int tiles = left < BAND_TILES ? (int)left : BAND_TILES; /* stored in the band */
        const int t0 = b0 < n0 ? (int)((n0 - b0) / TILE_N) : 0;       /* this call's tiles */
        const int t1 = n1 - b0 < tiles * TILE_N ? (int)((n1 - b0) / TILE_N) : tiles;
        const uint8_t *band = g->w + b0 / band_ch * band_bytes;
        for (int64_t r0 = 0; r0 < g->m; r0 += ROW_CHUNK_AVX2) {
            const int64_t rows = g->m - r0 < ROW_CHUNK_AVX2 ? g->m - r0 : ROW_CHUNK_AVX2;
            memset(sums, 0, (size_t)rows * stride * sizeof(float)); /* the rows in use */
            for (int64_t kb = 0; kb < g->k32 / TILE_K; kb++) {
                const uint8_t *src = band + kb * tiles * TILE_BYTES;
                const float *q = g->qf + r0 * g->k32 + kb * TILE_K;
                for (int t = t0; t < t1; t++) {
                    float *sp = sums + t * TILE_N;
                    const uint8_t *tile = src + t * TILE_BYTES;
                    if (rows <= DIRECT_ROWS_MAX) { /* decoded into registers per 3 rows */
                        int64_t i = 0;
                        for (; i + 3 <= rows; i += 3)
                            (int8 ? mul_tile_direct3_int8 : mul_tile_direct3_avx2)(
                                q + i * g->k32, g->k32, tile, sp + i * stride, stride);
                        if (rows - i == 2)
                            mul_tile_avx2(q + i * g->k32, g->k32, 2, NULL, tile, int8,
                                          sp + i * stride, stride);
                        else if (rows - i == 1)
                            mul_tile_avx2(q + i * g->k32, g->k32, 1, NULL, tile, int8,
                                          sp + i * stride, stride);
                        continue;
                    }
                    for (int j = 0; j < TILE_BYTES; j += 32) {
                        __m256 v0, v1, v2, v3;
                        _mm_prefetch((const char *)tile + j + PREFETCH_BYTES, _MM_HINT_T0);
                        decode32_avx2(tile + j, int8, &v0, &v1, &v2, &v3);
                        _mm256_store_ps(buf + j, v0);
                        _mm256_store_ps(buf + j + 8, v1);
                        _mm256_store_ps(buf + j + 16, v2);
                        _mm256_store_ps(buf + j + 24, v3);
                    }
                    int64_t i = 0;
                    for (; i + 3 <= rows; i += 3)
                        mul_tile3_avx2(q + i * g->k32, g->k32, buf, sp + i * stride, stride);
                    if (rows - i == 2)
                        mul_tile_avx2(q + i * g->k32, g->k32, 2, buf, NULL, int8,
                                      sp + i * stride, stride);
                    else if (rows - i == 1)
                        mul_tile_avx2(q + i * g->k32, g->k32, 1, buf, NULL, int8,
                                      sp + i * stride, stride);
                }
            }
            const int64_t c0 = b0 + t0 * TILE_N;
            const int64_t c1 = b0 + t1 * TILE_N < g->n ? b0 + t1 * TILE_N : g->n;
            for (int64_t i = 0; i < rows; i++) {
                float *sp = sums + i * stride + t0 * TILE_N;
                for (int64_t j = 0; j < c1 - c0; j++) /* exact: back to the true sums */
                    sp[j] *= g->sum_scale;
                store_row(g, r0 + i, c0, c1 - c0, sp);
            }
        }
    }
    restore_csr(csr);
}

static void run_avx2_e4m3(const Gemv *g, int64_t n0, int64_t n1) { run_avx2(g, n0, n1, 0); }
static void run_avx2_int8(const Gemv *g, int64_t n0, int64_t n1) { run_avx2(g, n0, n1, 1); }
#endif

#ifdef QSERVE_GEMV_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Asks the kernel once for the AMX register state; 1 when granted. */
static int amx_permitted(void) {
    static int state; /* 0: not asked, 1: granted, -1: refused */
    if (state == 0)
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

/* The compiler does not see that tile loads read memory: order the buffer's stores first. */
#define MEMORY_BARRIER() __asm__ volatile("" ::: "memory")

/* tmm0..3: C (rows x 16 fp32, one per B tile of the band), tmm4: A (rows x 32 bf16),
 * tmm5, tmm6: B (16 k pairs x 16 channels x 2 bf16), alternately. */
#define BAND_TILE_STEP(T, BREG)                                                             \
    if (tiles > T) {                                                                        \
        decode_tile(&d, src + T * TILE_BYTES, buf[T & 1]);                                  \
        MEMORY_BARRIER();                                                                   \
        _tile_loadd(BREG, buf[T & 1], 2 * TILE_N * 2);                                      \
        _tile_dpbf16ps(T, 4, BREG);                                                         \
    }
#define STORE_C(T)                                                                          \
    if (tiles > T)                                                                          \
        _tile_stored(T, sums + T * TILE_N, BAND_TILES * TILE_N * sizeof(float));

/* Channels [n0, n1) (whole bands), all rows. */
static void run_amx(const Gemv *g, int64_t n0, int64_t n1) {
    static __thread TileConfig config __attribute__((aligned(64)));
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 4; t++) {
        config.rows[t] = (uint8_t)g->m;
        config.colsb[t] = TILE_N * sizeof(float);
    }
    config.rows[4] = (uint8_t)g->m;
    config.colsb[4] = TILE_K * 2;
    for (int t = 5; t < 7; t++) {
        config.rows[t] = TILE_K / 2;
        config.colsb[t] = TILE_N * 4;
    }
    MEMORY_BARRIER();
    _tile_loadconfig(&config);
    const Decoder d = decoder(g->codes);
    uint16_t buf[2][TILE_BYTES] __attribute__((aligned(64)));
    float sums[MAX_ROWS * BAND_TILES * TILE_N] __attribute__((aligned(64))); /* [m, 64] */
    const int64_t band_bytes = BAND_TILES * TILE_N * g->k32;
    for (int64_t b0 = n0; b0 < n1; b0 += BAND_TILES * TILE_N) {
        const int64_t left = (g->n16 - b0) / TILE_N;
        const int tiles = left < BAND_TILES ? (int)left : BAND_TILES;
        const uint8_t *band = g->w + b0 / (BAND_TILES * TILE_N) * band_bytes;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < g->k32 / TILE_K; kb++) {
            const uint8_t *src = band + kb * tiles * TILE_BYTES;
            _tile_loadd(4, g->q + kb * TILE_K, g->k32 * 2);
            BAND_TILE_STEP(0, 5)
            BAND_TILE_STEP(1, 6)
            BAND_TILE_STEP(2, 5)
            BAND_TILE_STEP(3, 6)
        }
        STORE_C(0)
        STORE_C(1)
        STORE_C(2)
        STORE_C(3)
        MEMORY_BARRIER();
        for (int64_t i = 0; i < g->m; i++)
            for (int64_t j = 0; j < tiles * TILE_N && b0 + j < g->n; j++)
                store(g, i, b0 + j, sums[i * BAND_TILES * TILE_N + j]);
    }
    _tile_release();
}
#endif

/* The path this build and CPU take, the one place that decides it (an AMX build runs
 * run_avx512 where the kernel refuses AMX). */
enum { PATH_PORTABLE = 0, PATH_AVX2 = 1, PATH_AVX512 = 2, PATH_AMX = 3 };
static int gemv_path(void) {
#if defined(QSERVE_GEMV_AMX)
    if (amx_permitted())
        return PATH_AMX;
#endif
#if defined(QSERVE_GEMV_AVX512)
    return PATH_AVX512;
#elif defined(QSERVE_GEMV_AVX2)
    return PATH_AVX2;
#else
    return PATH_PORTABLE;
#endif
}

/* Rows one pass over the weights serves: any number on the AVX2 path (its row loop is
 * not bound to a tile), AVX512_ROWS on the AVX512-BF16 path, else one A tile's MAX_ROWS
 * (AMX, and the table path). A call takes any number of rows: beyond this, run_rows reads
 * the weights again per pass. */
static int64_t pass_rows(void) {
    switch (gemv_path()) {
    case PATH_AVX2: return INT64_MAX;
    case PATH_AVX512: return AVX512_ROWS;
    default: return MAX_ROWS;
    }
}

/* Channels [n0, n1) (whole bands) of every row, pass_rows() rows at a time: each pass is a
 * Gemv of its rows alone (q, qf and out offset), so a row gets the sums it gets in a call
 * by itself whatever the rows beside it (batch invariance on every path). The passes go
 * band by band, so a band's weight bytes (64 channels x k) are read from memory once and
 * from cache by the later passes. */
static void run_rows(void (*run)(const Gemv *, int64_t, int64_t), const Gemv *g, int64_t n0,
                     int64_t n1) {
    const int64_t step = pass_rows();
    if (g->m <= step) {
        run(g, n0, n1);
        return;
    }
    for (int64_t b0 = n0; b0 < n1; b0 += BAND_TILES * TILE_N) {
        const int64_t b1 = b0 + BAND_TILES * TILE_N < n1 ? b0 + BAND_TILES * TILE_N : n1;
        for (int64_t r0 = 0; r0 < g->m; r0 += step) {
            Gemv part = *g;
            part.q = g->q + r0 * g->k32;
            part.qf = g->qf == NULL ? NULL : g->qf + r0 * g->k32;
            part.qp = g->qp == NULL ? NULL : g->qp + r0 * (g->k32 / 2);
            part.m = g->m - r0 < step ? g->m - r0 : step;
            part.out = g->out == NULL ? NULL : g->out + r0 * g->out_stride;
            if (g->best_index != NULL) {
                part.best_value = g->best_value + r0;
                part.best_index = g->best_index + r0;
            }
            run(&part, b0, b1);
        }
    }
}

#ifdef QSERVE_GEMV_AVX2
/* The power of two run_avx2 multiplies weight-only inputs by: QF_SCALE, or less where
 * the largest |x| times it would come near fp32's top (bf16 reaches 2^128; weight-only
 * inputs are not bounded by 448 as E4M3 values are). */
static float wonly_qf_scale(const uint16_t *q, int64_t count) {
    uint32_t top = 0; /* the largest exponent field among the inputs */
    for (int64_t i = 0; i < count; i++) {
        const uint32_t e = (q[i] >> 7) & 0xFFu;
        top = e > top ? e : top;
    }
    /* |x| < 2^(top - 126), so |x| 2^p < 2^124 for p <= 250 - top: qf finite, and so is
     * every sum (each product < 2^(124 + 9 - 120), at most 2^20 of them) */
    const int p = 250 - (int)top < 112 ? 250 - (int)top : 112;
    return ldexpf(1.0f, p);
}
#endif

/* out_ids NULL: writes out [m, out_stride] bf16. Else (an argmax call, out unused): writes
 * out_ids [m] (int64) and out_values [m] (fp32), per row the channel of the largest output
 * (torch.argmax's: the lowest of equal ones, the first NaN) and that output as fp32, from
 * the same sums and roundings, each thread keeping its channels' best and the threads'
 * bests reduced in the end. */
static int gemv(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, float input_scale,
                int quantize_input, const uint8_t *packed, int codes, int64_t n,
                const float *scale, int64_t scale_len, float scale_mul, uint16_t *out,
                int64_t out_stride, int64_t *out_ids, float *out_values, int num_threads) {
    if (m <= 0 || n <= 0) /* nothing to do (and a tile of 0 rows cannot be configured) */
        return 0;
    const int64_t k32 = (k + TILE_K - 1) / TILE_K * TILE_K;
    const int64_t n16 = (n + TILE_N - 1) / TILE_N * TILE_N;
    const int64_t slots = num_threads > 1 ? num_threads : 1; /* argmax: one best per thread */
    const int64_t per = (m + 15) / 16 * 16; /* a thread's bests: whole 64-byte lines apart */
    float *best_value = NULL;   /* [slots, per], the first m of each in use */
    int64_t *best_index = NULL; /* [slots, per], -1: that thread saw no channel */
    if (out_ids != NULL) {
        best_value = aligned_alloc(64, (size_t)(slots * per) * sizeof(float));
        best_index = aligned_alloc(64, (size_t)(slots * per) * sizeof(int64_t));
        if (best_value == NULL || best_index == NULL) {
            free(best_value);
            free(best_index);
            return -1;
        }
        for (int64_t i = 0; i < slots * per; i++) {
            best_value[i] = 0.0f;
            best_index[i] = -1;
        }
    }
    uint16_t *q = aligned_alloc(64, (size_t)(m * k32) * sizeof(uint16_t) + 64);
    const int path = gemv_path();
    const int pairs = path == PATH_AVX512; /* run_avx512 runs: it reads Gemv.qp */
    uint32_t *qp = pairs ? aligned_alloc(64, (size_t)(m * k32 / 2) * sizeof(uint32_t) + 64)
                         : NULL;
    if (q == NULL || (pairs && qp == NULL)) {
        free(q);
        free(qp);
        free(best_value);
        free(best_index);
        return -1;
    }
#pragma omp parallel for num_threads(num_threads) if (m * k >= PARALLEL_MIN_MACS / 16)
    for (int64_t i = 0; i < m; i++) {
        const uint16_t *row = x + i * x_stride;
        uint16_t *qrow = q + i * k32;
        if (quantize_input) {
#pragma omp simd
            for (int64_t j = 0; j < k; j++) /* an E4M3 value: exact in bf16 (NaN kept) */
                qrow[j] = (uint16_t)(float_to_bits(e4m3_round(bf16_to_float(row[j]) / input_scale))
                                     >> 16);
        } else {
            memcpy(qrow, row, (size_t)k * sizeof(uint16_t));
        }
        for (int64_t j = k; j < k32; j++)
            qrow[j] = 0;
#ifdef QSERVE_GEMV_AVX512
        if (qp != NULL)
            for (int64_t kb = 0; kb < k32 / TILE_K; kb++) {
                const uint16_t *src = qrow + kb * TILE_K;
                uint32_t *dst = qp + i * (k32 / 2) + kb * 2 * CHAIN_PAIRS;
                for (int s = 0; s < CHAIN_PAIRS; s++) {
                    dst[s] = (uint32_t)src[4 * s] << 16 | src[4 * s + 2];
                    dst[CHAIN_PAIRS + s] = (uint32_t)src[4 * s + 1] << 16 | src[4 * s + 3];
                }
            }
#endif
    }
    float *qf = NULL;
    float sum_scale = 1.0f;
#ifdef QSERVE_GEMV_AVX2
    qf = aligned_alloc(64, (size_t)(m * k32) * sizeof(float) + 64);
    if (qf == NULL) {
        free(q);
        free(qp);
        free(best_value);
        free(best_index);
        return -1;
    }
    /* int8 weights decode to their values (not 2^-120 times them): no scaling, the
     * products are exact and normal unless an input is itself subnormal */
    const float qf_scale = codes == CODES_INT8 ? 1.0f
                           : quantize_input ? QF_SCALE : wonly_qf_scale(q, m * k32);
    sum_scale = (codes == CODES_INT8 ? 1.0f : 0x1p120f) / qf_scale;
#pragma omp parallel for simd num_threads(num_threads) if (m * k >= PARALLEL_MIN_MACS / 16)
    for (int64_t i = 0; i < m * k32; i++) /* exact: the values times a power of two */
        qf[i] = bf16_to_float(q[i]) * qf_scale;
#endif
    Gemv g = {q, qf, qp, m, k, k32, packed, n, n16, scale, scale_len, scale_mul, sum_scale,
              out_ids != NULL ? NULL : out, out_stride, codes, best_value, best_index};
    void (*run)(const Gemv *, int64_t, int64_t) = run_table;
#ifdef QSERVE_GEMV_AVX2
    run = codes == CODES_INT8 ? run_avx2_int8 : run_avx2_e4m3;
#endif
#ifdef QSERVE_GEMV_AVX512
    run = run_avx512;
#endif
#ifdef QSERVE_GEMV_AMX
    if (path == PATH_AMX)
        run = run_amx;
#endif
    if (num_threads <= 1 || m * n * k < PARALLEL_MIN_MACS) {
        run_rows(run, &g, 0, n16);
    } else {
#pragma omp parallel num_threads(num_threads)
        {
            /* contiguous channel ranges: whole tiles on the AVX2 path (run_avx2 takes part
             * of a band: 576 channels split 18:18 tiles instead of 4:5 bands), else whole
             * bands */
            const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#ifdef QSERVE_GEMV_AVX2
            const int64_t unit = TILE_N;
#else
            const int64_t unit = BAND_TILES * TILE_N; /* a band */
#endif
            const int64_t units = (n16 + unit - 1) / unit;
            const int64_t lo = units * t / nt * unit, hi = units * (t + 1) / nt * unit;
            Gemv mine = g; /* an argmax call: this thread's own bests */
            if (best_index != NULL) {
                mine.best_value = best_value + t * per;
                mine.best_index = best_index + t * per;
            }
            run_rows(run, &mine, lo, hi < n16 ? hi : n16);
        }
    }
    if (out_ids != NULL)
        reduce_bests(best_value, best_index, slots, per, m, out_ids, out_values);
    free(q);
    free(qf);
    free(qp);
    free(best_value);
    free(best_index);
    return 0;
}

/* Static input scale. Returns 0, or -1 when the input buffer cannot be allocated. */
int qserve_fp8_gemv_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride,
                         float input_scale, const uint8_t *packed, int64_t n,
                         const float *scale, int64_t scale_len, uint16_t *out,
                         int64_t out_stride, int num_threads) {
    return gemv(x, m, k, x_stride, input_scale, 1, packed, CODES_E4M3, n, scale, scale_len,
                1.0f, out, out_stride, NULL, NULL, num_threads);
}

/* Weight-only (W8A16): the bf16 input unquantized, the sums times `scale` (the weight
 * scales, [N] or [1]). Same returns. */
int qserve_fp8_gemv_wonly_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride,
                               const uint8_t *packed, int64_t n, const float *scale,
                               int64_t scale_len, uint16_t *out, int64_t out_stride,
                               int num_threads) {
    return gemv(x, m, k, x_stride, 1.0f, 0, packed, CODES_E4M3, n, scale, scale_len, 1.0f,
                out, out_stride, NULL, NULL, num_threads);
}

/* Int8 weight-only (W8A16 int): `packed` holds int8 weights (pack_int8_weight), the bf16
 * input unquantized, the sums times `scale` ([N] or [1]). Same returns. */
int qserve_int8_gemv_wonly_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride,
                                const uint8_t *packed, int64_t n, const float *scale,
                                int64_t scale_len, uint16_t *out, int64_t out_stride,
                                int num_threads) {
    return gemv(x, m, k, x_stride, 1.0f, 0, packed, CODES_INT8, n, scale, scale_len, 1.0f,
                out, out_stride, NULL, NULL, num_threads);
}

/* Dynamic input scale: input_scale = max(amax(x), 1e-12) / 448 over all m rows (fp32), and
 * `weight_scale` [N] or [1] times it rescales the sums, as the static entry with
 * input_scale and out scale weight_scale * input_scale (fp32). Same returns. */
int qserve_fp8_gemv_dynamic_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride,
                                 const uint8_t *packed, int64_t n, const float *weight_scale,
                                 int64_t scale_len, uint16_t *out, int64_t out_stride,
                                 int num_threads) {
    float amax = 0.0f;
    for (int64_t i = 0; i < m; i++) {
        const uint16_t *row = x + i * x_stride;
#pragma omp simd reduction(max : amax)
        for (int64_t j = 0; j < k; j++) {
            const float v = bf16_to_float(row[j] & 0x7FFFu);
            amax = v > amax ? v : amax;
        }
    }
    const float input_scale = (amax > 1e-12f ? amax : 1e-12f) / 448.0f;
    return gemv(x, m, k, x_stride, input_scale, 1, packed, CODES_E4M3, n, weight_scale,
                scale_len, input_scale, out, out_stride, NULL, NULL, num_threads);
}

/* Greedy tokens from an LM head: per row of x, the vocabulary id (channel) of the largest
 * output and that output, out_ids [m] int64 and out_values [m] fp32 (a bf16 value), as
 * torch.argmax finds it in the [m, n] bf16 outputs the entries above write (the lowest of
 * equal outputs, the first NaN), from the same sums and roundings, without writing those
 * outputs: each thread keeps, per row, the best of its channels while it computes them
 * (the store of each band becomes a running max), then the threads' bests are reduced.
 * input_scale > 0: the static entry's (E4M3 codes; `scale` then the out scale, input scale
 * times the weight scales); 0: weight-only (E4M3 or int8 codes; `scale` the weight
 * scales). codes: CODES_E4M3 or CODES_INT8, as `packed` holds.
 * A final logit softcap (cap * tanh(logit / cap)) is monotonic, so the argmax of capped
 * logits is that of the raw ones: it is not applied here (runtime/models/llama.py's
 * greedy_tokens says where fp32 rounding makes it merely non-decreasing). Same returns. */
int qserve_fp8_gemv_argmax_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride,
                                float input_scale, const uint8_t *packed, int codes,
                                int64_t n, const float *scale, int64_t scale_len,
                                int64_t *out_ids, float *out_values, int num_threads) {
    const int quantize_input = input_scale > 0.0f;
    return gemv(x, m, k, x_stride, quantize_input ? input_scale : 1.0f, quantize_input,
                packed, codes, n, scale, scale_len, 1.0f, NULL, n, out_ids, out_values,
                num_threads);
}

/* The path this build and CPU take: 0 the portable scalar loop, 1 AVX2 (F16C + FMA),
 * 2 AVX512-BF16, 3 AMX (granted by the kernel at run time). */
int qserve_fp8_gemv_path(void) { return gemv_path(); }

/* The rows one pass over the weights serves (pass_rows). */
int64_t qserve_fp8_gemv_pass_rows(void) { return pass_rows(); }

/* The tile layout this build reads: LAYOUT_TILE (0) or LAYOUT_PAIRS (1). */
int qserve_fp8_gemv_layout(void) { return LAYOUT; }
