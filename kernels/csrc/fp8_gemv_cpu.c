/* W8A8 FP8 linear for a few rows of bf16 input on CPU, reading the E4M3 weight bytes.
 *
 * Built and loaded at run time by kernels/native_build.py, called through ctypes by
 * kernels/native_fp8_gemv.py. A decode step multiplies a handful of rows by every weight
 * of the model once, so its time is the time to read the weights: one byte per weight
 * here instead of the two of the bf16 copy oneDNN multiplies.
 *
 *   q[m, k]   = e4m3_round(x[m, k] / input_scale)                   (e4m3.h)
 *   out[m, n] = bf16(bf16(sum_k q[m, k] * w[n, k]) * scale[n or 0])
 *
 * The same rounding points as the torch path (kernels/fp8_gemm.py: quantize-dequantize
 * the input, bf16 matmul with fp32 accumulation rounded to bf16, fp32 rescale rounded to
 * bf16); only the order of the fp32 sum differs. Each output is summed in one fixed order
 * (16 lanes over k, then lanes added as a tree), whatever the number of rows, the tile
 * it falls in or the threads: a row's result does not depend on the rows beside it.
 *
 * Weights: E4M3 bytes (sign, 4 exponent bits with bias 7, 3 mantissa bits) are decoded
 * by placing the 7 magnitude bits under fp32's exponent (bias 127): exact for every
 * finite E4M3 value, subnormals included (as fp32 subnormals), giving the weight times
 * 2^-120. Powers of two folded into q and into the sum undo it exactly (Q_FACTOR), so
 * products and sums are those of the true values. With AVX-512 the decode is a
 * sign-extending load, a shift and an and per 16 weights; elsewhere a 256-entry table.
 * x is bf16 as its uint16 bits with a row stride; w is [N, K] contiguous bytes.
 */

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "e4m3.h"
#include "float_bits.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QSERVE_GEMV_AVX512 1
#include <immintrin.h>
#endif

#define LANES 16
#define TILE_N 8 /* output channels per tile */
#define PARALLEL_MIN_MACS (1 << 20) /* below this many products one thread does it all */

/* Scales that keep every product a normal fp32 and its sum exact to rescale: weights are
 * decoded as value * 2^-120 (the AVX-512 decode's natural result), inputs are held as
 * value * 2^119 (448 * 2^119 < 2^128), so each product is the true one / 2. */
#define Q_FACTOR 0x1p119f
#define SUM_FACTOR 2.0f

static float e4m3_decoded(uint8_t b) { /* the table path's weight decode: value * 2^-120 */
    const uint32_t bits = ((uint32_t)(b & 0x80u) << 24) | ((uint32_t)(b & 0x7Fu) << 20);
    return (b & 0x7Fu) == 0x7Fu ? bits_to_float(0x7FC00000u) : bits_to_float(bits);
}

#ifdef QSERVE_GEMV_AVX512
/* 16 E4M3 bytes -> 16 fp32 (value / 2^120): each byte sign-extended to 32 bits and
 * shifted so its 7 magnitude bits sit under fp32's exponent (bias 127, 120 above E4M3's)
 * and its sign on bit 31; the bits the sign extension left between are cleared. E4M3
 * subnormals become fp32 subnormals, exact. Bytes past `valid` read as 0. */
static inline __m512 widen16(const uint8_t *w, __mmask16 valid) {
    const __m128i bytes = valid == 0xFFFF ? _mm_loadu_si128((const __m128i *)w)
                                          : _mm_maskz_loadu_epi8(valid, w);
    const __m512i bits = _mm512_slli_epi32(_mm512_cvtepi8_epi32(bytes), 20);
    return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32((int)0x87F00000u)));
}

/* out tile: rows m0..m0+MB-1 (of q, [.., kp] fp32) times channels n[0..NB-1] of w.
 * Meanwhile the next tile's weights [ahead, ahead + ahead_len) are prefetched,
 * PREFETCH_STEP bytes per k step: the rows of a tile are short (a few hundred bytes
 * each), too short for the hardware prefetcher to run ahead of, and the weights stream
 * from memory (measured: 4.7 GB/s without, one thread). */
#define PREFETCH_STEP 128
#define DEFINE_TILE(MB, NB)                                                                 \
    static void tile_##MB##x##NB(const float *q, int64_t kp, int64_t k_len,                 \
                                 const uint8_t *const *wrow, const char *ahead,             \
                                 int64_t ahead_len, float *sums) {                          \
        __m512 acc[MB][NB];                                                                 \
        for (int i = 0; i < MB; i++)                                                        \
            for (int j = 0; j < NB; j++)                                                    \
                acc[i][j] = _mm512_setzero_ps();                                            \
        for (int64_t k = 0; k < kp; k += LANES) {                                           \
            const int64_t left = k_len - k;                                                 \
            const __mmask16 valid = left >= LANES ? (__mmask16)0xFFFF                       \
                                                  : (__mmask16)((1u << left) - 1u);         \
            const int64_t next = k / LANES * PREFETCH_STEP;                                 \
            for (int64_t p = next; p < next + PREFETCH_STEP && p < ahead_len; p += 64)      \
                _mm_prefetch(ahead + p, _MM_HINT_T0);                                       \
            __m512 wv[NB];                                                                  \
            for (int j = 0; j < NB; j++)                                                    \
                wv[j] = widen16(wrow[j] + k, valid);                                        \
            for (int i = 0; i < MB; i++) {                                                  \
                const __m512 qv = _mm512_load_ps(q + i * kp + k);                           \
                for (int j = 0; j < NB; j++)                                                \
                    acc[i][j] = _mm512_fmadd_ps(qv, wv[j], acc[i][j]);                      \
            }                                                                               \
        }                                                                                   \
        for (int i = 0; i < MB; i++)                                                        \
            for (int j = 0; j < NB; j++)                                                    \
                sums[i * NB + j] = _mm512_reduce_add_ps(acc[i][j]);                         \
    }
DEFINE_TILE(1, 8)
DEFINE_TILE(2, 8)
DEFINE_TILE(3, 4)
DEFINE_TILE(4, 4)
DEFINE_TILE(5, 4)
#endif

/* The same sums in the same order without AVX-512: 16 partial sums, then the tree that
 * _mm512_reduce_add_ps uses (halves added: 16 -> 8 -> 4 -> 2 -> 1). */
static float dot_table(const float *q, int64_t kp, const uint8_t *w, int64_t k_len,
                       const float *table) {
    float lane[LANES] = {0};
    for (int64_t k = 0; k < kp; k += LANES)
        for (int l = 0; l < LANES; l++)
            lane[l] += q[k + l] * (k + l < k_len ? table[w[k + l]] : 0.0f);
    for (int width = LANES / 2; width >= 1; width /= 2)
        for (int l = 0; l < width; l++)
            lane[l] += lane[l + width];
    return lane[0];
}

typedef struct {
    const float *q; /* [M, kp] fp32: the E4M3 input values times Q_FACTOR, zero-padded */
    int64_t m, kp, k;
    const uint8_t *w; /* [N, K] E4M3 */
    int64_t n;
    const float *scale; /* [N] or [1] */
    int64_t scale_len;
    uint16_t *out; /* [M, out_stride] bf16 */
    int64_t out_stride;
    const float *table; /* NULL on the AVX-512 path */
} Gemv;

static void store(const Gemv *g, int64_t m, int64_t n, float sum) {
    const float rounded = bf16_to_float(bf16_round(sum * SUM_FACTOR));
    const float s = g->scale[g->scale_len == 1 ? 0 : n];
    g->out[m * g->out_stride + n] = bf16_round(rounded * s);
}

/* Output channels [n0, n1) for every row. */
static void run_channels(const Gemv *g, int64_t n0, int64_t n1) {
#ifdef QSERVE_GEMV_AVX512
    if (g->table == NULL) {
        /* channel tiles of TILE_N (outer: each tile's weights are read from memory once,
         * then stay in L1 for every group of up to 5 input rows) */
        for (int64_t c = n0; c < n1; c += TILE_N) {
            const uint8_t *wrow[TILE_N];
            for (int64_t j = 0; j < TILE_N; j++) /* past n1: repeat the last row, unused */
                wrow[j] = g->w + (c + j < n1 ? c + j : n1 - 1) * g->k;
            /* prefetched while the first row group runs: the tile two ahead (contiguous) */
            const int64_t after = c + 2 * TILE_N;
            const char *ahead = (const char *)(g->w + after * g->k);
            const int64_t ahead_len = after < n1 ? (after + TILE_N < n1 ? TILE_N : n1 - after)
                                                   * g->k : 0;
            for (int64_t m0 = 0; m0 < g->m;) {
                const int64_t mb = g->m - m0 >= 5 ? 5 : g->m - m0;
                const int64_t pf = m0 == 0 ? ahead_len : 0;
                const float *q = g->q + m0 * g->kp;
                float sums[5 * TILE_N]; /* [mb, TILE_N] */
                float half[5 * 4];
                switch (mb) {
                case 1: tile_1x8(q, g->kp, g->k, wrow, ahead, pf, sums); break;
                case 2: tile_2x8(q, g->kp, g->k, wrow, ahead, pf, sums); break;
                default: /* two tiles of 4 channels */
                    for (int h = 0; h < 2; h++) {
                        const int64_t p = h ? 0 : pf;
                        if (mb == 3)
                            tile_3x4(q, g->kp, g->k, wrow + 4 * h, ahead, p, half);
                        else if (mb == 4)
                            tile_4x4(q, g->kp, g->k, wrow + 4 * h, ahead, p, half);
                        else
                            tile_5x4(q, g->kp, g->k, wrow + 4 * h, ahead, p, half);
                        for (int64_t i = 0; i < mb; i++)
                            for (int j = 0; j < 4; j++)
                                sums[i * TILE_N + 4 * h + j] = half[i * 4 + j];
                    }
                }
                for (int64_t i = 0; i < mb; i++)
                    for (int64_t j = 0; j < TILE_N && c + j < n1; j++)
                        store(g, m0 + i, c + j, sums[i * TILE_N + j]);
                m0 += mb;
            }
        }
        return;
    }
#endif
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < g->m; m++)
            store(g, m, n, dot_table(g->q + m * g->kp, g->kp, g->w + n * g->k, g->k, g->table));
}

/* Returns 0, or -1 when the input buffer cannot be allocated. */
int qserve_fp8_gemv_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride,
                         float input_scale, const uint8_t *w, int64_t n, const float *scale,
                         int64_t scale_len, uint16_t *out, int64_t out_stride,
                         int num_threads) {
    const int64_t kp = (k + LANES - 1) / LANES * LANES;
    float *q = aligned_alloc(64, (size_t)(m * kp) * sizeof(float) + 64);
    if (q == NULL)
        return -1;
    for (int64_t i = 0; i < m; i++) {
        const uint16_t *row = x + i * x_stride;
        float *qrow = q + i * kp;
#pragma omp simd
        for (int64_t j = 0; j < k; j++)
            qrow[j] = e4m3_round(bf16_to_float(row[j]) / input_scale) * Q_FACTOR;
        for (int64_t j = k; j < kp; j++)
            qrow[j] = 0.0f;
    }
    float table[256];
    Gemv g = {q, m, kp, k, w, n, scale, scale_len, out, out_stride, NULL};
#ifndef QSERVE_GEMV_AVX512
    for (int b = 0; b < 256; b++)
        table[b] = e4m3_decoded((uint8_t)b);
    g.table = table;
#else
    (void)table;
    (void)e4m3_decoded;
#endif
    if (num_threads <= 1 || m * n * k < PARALLEL_MIN_MACS) {
        run_channels(&g, 0, n);
    } else {
#pragma omp parallel num_threads(num_threads)
        {
            /* contiguous channel ranges of whole tiles */
            const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t tiles = (n + TILE_N - 1) / TILE_N;
            const int64_t lo = tiles * t / nt * TILE_N, hi = tiles * (t + 1) / nt * TILE_N;
            run_channels(&g, lo, hi < n ? hi : n);
        }
    }
    free(q);
    return 0;
}
