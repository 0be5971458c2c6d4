/* bf16 linear for a few rows on CPU without native bf16 matmuls: the LM head (and any
 * bf16 linear) of a decode step on AVX2, where torch emulates bf16 matmuls.
 *
 * Built and loaded at run time by kernels/native_build.py, called through ctypes by
 * kernels/native_bf16_gemv.py.
 *
 *   out[m, n] = bf16(sum_k x[m, k] * w[n, k] (+ bias[n]))      fp32 products and sums
 *
 * Sum order: per output, an fp32 sum of the products of even k and one of odd k, each from
 * 0 in k order (one FMA per product), then even + odd (+ bias). A row's result does not
 * depend on the rows beside it, their number or the threads (each channel is summed by
 * one thread in this order), so outputs are batch invariant.
 *
 * Weight layout (`packed`, made once at load by native_bf16_gemv.pack_bf16_weight): the
 * [N, K] bf16 matrix, N zero-padded to N16 (a multiple of 16), as N16 / 16 tiles each
 * [K][16 channels]: a tile is one contiguous stream of K * 32 bytes. With AVX2 16 bf16
 * words become 16 fp32 by a zero-extension and a shift (bf16 is the top half of fp32).
 * x is bf16 as its uint16 bits with a row stride.
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "float_bits.h"

#if defined(__AVX2__) && defined(__FMA__)
#define QSERVE_BF16_GEMV_AVX2 1
#include <immintrin.h>

#include "rows3_avx2.h"
#endif

#define TILE_N 16
#define MAX_ROWS 16
#define PARALLEL_MIN_MACS (1 << 18)

typedef struct {
    const float *x; /* [m, k] fp32 */
    int64_t m, k;
    const uint16_t *w; /* packed [n16 / 16][k][16] */
    int64_t n;
    const float *bias; /* [n] fp32 or NULL */
    uint16_t *out;     /* [m, out_stride] bf16 */
    int64_t out_stride;
} Gemv;

static void store(const Gemv *g, int64_t m, int64_t n, float even, float odd) {
    float sum = even + odd;
    if (g->bias != NULL)
        sum += g->bias[n];
    g->out[m * g->out_stride + n] = bf16_round(sum);
}

/* Tiles [t0, t1): the scalar form of the documented order. */
static void run_scalar(const Gemv *g, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
        const uint16_t *tile = g->w + t * g->k * TILE_N;
        for (int64_t m = 0; m < g->m; m++) {
            const float *x = g->x + m * g->k;
            for (int c = 0; c < TILE_N && t * TILE_N + c < g->n; c++) {
                float even = 0.0f, odd = 0.0f;
                for (int64_t k = 0; k < g->k; k++) { /* one rounding per product */
                    const float w = bf16_to_float(tile[k * TILE_N + c]);
                    if (k % 2 == 0)
                        even = fmaf(x[k], w, even);
                    else
                        odd = fmaf(x[k], w, odd);
                }
                store(g, m, t * TILE_N + c, even, odd);
            }
        }
    }
}

#ifdef QSERVE_BF16_GEMV_AVX2
static inline __m256 widen(__m128i words) { /* 8 bf16 -> 8 fp32, exact */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(words), 16));
}

#define ROW_BLOCK 2
#define K_CHUNK 64 /* k per widened chunk of a tile: 64 x 16 fp32, 4 KiB in L1 */

/* `rows` (<= ROW_BLOCK) rows of x, k in [k0, k0 + kn) (kn even, or the tile's odd end),
 * times the tile's weights w ([kn][16] fp32, widened) or, where w is NULL, the tile's bf16
 * words at `tile` widened on the fly; even/odd chains per 8 channels continue in acc
 * ([rows][4] vectors: e0, e1, o0, o1). */
static inline __attribute__((always_inline)) void mul_chunk(
    const Gemv *g, const uint16_t *tile, const float *w, int64_t m0, int rows, int64_t k0,
    int64_t kn, __m256 (*acc)[4]) {
    __m256 e0[ROW_BLOCK], e1[ROW_BLOCK], o0[ROW_BLOCK], o1[ROW_BLOCK];
    for (int i = 0; i < rows; i++) {
        e0[i] = acc[i][0];
        e1[i] = acc[i][1];
        o0[i] = acc[i][2];
        o1[i] = acc[i][3];
    }
    int64_t k = 0;
    for (; k + 1 < kn; k += 2) {
        __m256 we0, we1, wo0, wo1;
        if (w != NULL) {
            we0 = _mm256_load_ps(w + k * TILE_N);
            we1 = _mm256_load_ps(w + k * TILE_N + 8);
            wo0 = _mm256_load_ps(w + (k + 1) * TILE_N);
            wo1 = _mm256_load_ps(w + (k + 1) * TILE_N + 8);
        } else {
            const __m128i *we = (const __m128i *)(tile + (k0 + k) * TILE_N);
            we0 = widen(_mm_loadu_si128(we));
            we1 = widen(_mm_loadu_si128(we + 1));
            wo0 = widen(_mm_loadu_si128(we + 2));
            wo1 = widen(_mm_loadu_si128(we + 3));
        }
        for (int i = 0; i < rows; i++) {
            const float *x = g->x + (m0 + i) * g->k + k0;
            const __m256 xe = _mm256_broadcast_ss(x + k), xo = _mm256_broadcast_ss(x + k + 1);
            e0[i] = _mm256_fmadd_ps(xe, we0, e0[i]);
            e1[i] = _mm256_fmadd_ps(xe, we1, e1[i]);
            o0[i] = _mm256_fmadd_ps(xo, wo0, o0[i]);
            o1[i] = _mm256_fmadd_ps(xo, wo1, o1[i]);
        }
    }
    if (k < kn) { /* the last even product of an odd K */
        const __m128i *we = (const __m128i *)(tile + (k0 + k) * TILE_N);
        const __m256 we0 = widen(_mm_loadu_si128(we)), we1 = widen(_mm_loadu_si128(we + 1));
        for (int i = 0; i < rows; i++) {
            const __m256 xe = _mm256_broadcast_ss(g->x + (m0 + i) * g->k + k0 + k);
            e0[i] = _mm256_fmadd_ps(xe, we0, e0[i]);
            e1[i] = _mm256_fmadd_ps(xe, we1, e1[i]);
        }
    }
    for (int i = 0; i < rows; i++) {
        acc[i][0] = e0[i];
        acc[i][1] = e1[i];
        acc[i][2] = o0[i];
        acc[i][3] = o1[i];
    }
}

/* mul_chunk for 3 rows over the widened buffer w, written out so that each weight vector
 * is loaded once and used by the three rows from a register: 12 accumulators, 2 weights
 * and a broadcast in the 16 ymm registers. The same chains, so the same bits. */
static inline void mul_chunk3(const Gemv *g, const uint16_t *tile, const float *w, int64_t m0,
                              int64_t k0, int64_t kn, __m256 (*acc)[4]) {
    __m256 a0 = acc[0][0], a1 = acc[0][1], d0 = acc[0][2], d1 = acc[0][3];
    __m256 b0 = acc[1][0], b1 = acc[1][1], e0 = acc[1][2], e1 = acc[1][3];
    __m256 c0 = acc[2][0], c1 = acc[2][1], f0 = acc[2][2], f1 = acc[2][3];
    const float *x0 = g->x + m0 * g->k + k0, *x1 = x0 + g->k, *x2 = x1 + g->k;
    int64_t k = 0;
#pragma GCC unroll 8
    for (; k + 1 < kn; k += 2)
        fma_rows3_kpair(x0, x1, x2, k, w + k * TILE_N, &a0, &a1, &b0, &b1, &c0, &c1, &d0, &d1,
                        &e0, &e1, &f0, &f1);
    if (k < kn) { /* the last even product of an odd K */
        const __m128i *we = (const __m128i *)(tile + (k0 + k) * TILE_N);
        fma_rows3(x0, x1, x2, k, widen(_mm_loadu_si128(we)), widen(_mm_loadu_si128(we + 1)),
                  &a0, &a1, &b0, &b1, &c0, &c1);
    }
    acc[0][0] = a0, acc[0][1] = a1, acc[0][2] = d0, acc[0][3] = d1;
    acc[1][0] = b0, acc[1][1] = b1, acc[1][2] = e0, acc[1][3] = e1;
    acc[2][0] = c0, acc[2][1] = c1, acc[2][2] = f0, acc[2][3] = f1;
}

/* Tiles [t0, t1), all rows. Up to ROW_BLOCK rows widen the bf16 words on the fly; more
 * rows widen each K_CHUNK of a tile once into L1 and run over it 3 rows at a time
 * (mul_chunk3), the rest by ROW_BLOCK. */
static void run_avx2(const Gemv *g, int64_t t0, int64_t t1) {
    float w[K_CHUNK * TILE_N] __attribute__((aligned(32)));
    __m256 acc[MAX_ROWS][4];
    const int buffered = g->m > ROW_BLOCK;
    for (int64_t t = t0; t < t1; t++) {
        const uint16_t *tile = g->w + t * g->k * TILE_N;
        for (int64_t i = 0; i < g->m; i++)
            for (int j = 0; j < 4; j++)
                acc[i][j] = _mm256_setzero_ps();
        for (int64_t k0 = 0; k0 < g->k; k0 += K_CHUNK) {
            const int64_t kn = g->k - k0 < K_CHUNK ? g->k - k0 : K_CHUNK;
            const int64_t even = kn - kn % 2; /* widened; an odd end is read as bf16 */
            if (buffered)
                for (int64_t j = 0; j < even * TILE_N; j += 8)
                    _mm256_store_ps(w + j, widen(_mm_loadu_si128(
                                               (const __m128i *)(tile + k0 * TILE_N + j))));
            int64_t i = 0;
            if (buffered)
                for (; i + 3 <= g->m; i += 3)
                    mul_chunk3(g, tile, w, i, k0, kn, acc + i);
            for (; i + ROW_BLOCK <= g->m; i += ROW_BLOCK)
                mul_chunk(g, tile, buffered ? w : NULL, i, ROW_BLOCK, k0, kn, acc + i);
            if (i < g->m)
                mul_chunk(g, tile, buffered ? w : NULL, i, 1, k0, kn, acc + i);
        }
        for (int64_t i = 0; i < g->m; i++) {
            float e[TILE_N] __attribute__((aligned(32))), o[TILE_N] __attribute__((aligned(32)));
            _mm256_store_ps(e, acc[i][0]);
            _mm256_store_ps(e + 8, acc[i][1]);
            _mm256_store_ps(o, acc[i][2]);
            _mm256_store_ps(o + 8, acc[i][3]);
            for (int c = 0; c < TILE_N && t * TILE_N + c < g->n; c++)
                store(g, i, t * TILE_N + c, e[c], o[c]);
        }
    }
}
#endif

/* Returns 0; -1 when the input buffer cannot be allocated, -2 for more than MAX_ROWS rows. */
int qserve_bf16_gemv(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride,
                     const uint16_t *packed, int64_t n, const float *bias, uint16_t *out,
                     int64_t out_stride, int num_threads) {
    if (m > MAX_ROWS)
        return -2;
    if (m <= 0 || n <= 0)
        return 0;
    float *xf = malloc((size_t)(m * k) * sizeof(float) + 64);
    if (xf == NULL)
        return -1;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < k; j++)
            xf[i * k + j] = bf16_to_float(x[i * x_stride + j]);
    const Gemv g = {xf, m, k, packed, n, bias, out, out_stride};
    void (*run)(const Gemv *, int64_t, int64_t) = run_scalar;
#ifdef QSERVE_BF16_GEMV_AVX2
    run = run_avx2;
#endif
    const int64_t tiles = (n + TILE_N - 1) / TILE_N;
    if (num_threads <= 1 || m * n * k < PARALLEL_MIN_MACS) {
        run(&g, 0, tiles);
    } else {
#pragma omp parallel num_threads(num_threads)
        {
            const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
            run(&g, tiles * t / nt, tiles * (t + 1) / nt);
        }
    }
    free(xf);
    return 0;
}

/* 1 when this build multiplies with AVX2 FMAs, 0: the portable scalar loop. */
int qserve_bf16_gemv_vector(void) {
#ifdef QSERVE_BF16_GEMV_AVX2
    return 1;
#else
    return 0;
#endif
}
