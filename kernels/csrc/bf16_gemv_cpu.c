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
 * [N, K] bf16 matrix, N zero-padded to N16 (a multiple of 16) and K to K2 (even), as
 * N16 / 16 tiles each [K2 / 2 k pairs][16 slots][2]: a tile is one contiguous stream of
 * K2 * 32 bytes, and 8 words are 4 channels' (even k, odd k) pairs. Channel c sits in slot
 * c with bits 1 and 2 swapped (0 1 4 5 2 3 6 7 8 9 12 13 10 11 14 15), the order in which
 * AVX2's horizontal add returns the pairs' sums. With AVX2 8 bf16 words become 8 fp32 by a
 * zero-extension and a shift (bf16 is the top half of fp32), and one 8-byte broadcast of a
 * row's (x[k], x[k + 1]) multiplies both chains of 4 channels. The padded k of an odd K
 * adds 0 * 0 to odd chains, which never hold -0 (they start at +0), so it changes no bit.
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

#include "pairs_avx2.h"
#endif

#define TILE_N 16
#define MAX_ROWS 16
#define PARALLEL_MIN_MACS (1 << 18)

typedef struct {
    const float *x; /* [m, k2] fp32, zero-padded */
    int64_t m, k2;
    const uint16_t *w; /* packed [n16 / 16][k2 / 2][16][2] */
    int64_t n;
    const float *bias; /* [n] fp32 or NULL */
    uint16_t *out;     /* [m, out_stride] bf16 */
    int64_t out_stride;
} Gemv;

static void store(const Gemv *g, int64_t m, int64_t n, float sum) {
    if (g->bias != NULL)
        sum += g->bias[n];
    g->out[m * g->out_stride + n] = bf16_round(sum);
}

/* Tiles [t0, t1): the scalar form of the documented order. */
static void run_scalar(const Gemv *g, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
        const uint16_t *tile = g->w + t * g->k2 * TILE_N;
        for (int64_t m = 0; m < g->m; m++) {
            const float *x = g->x + m * g->k2;
            for (int c = 0; c < TILE_N && t * TILE_N + c < g->n; c++) {
                const int slot = (c & 9) | ((c & 2) << 1) | ((c & 4) >> 1);
                float even = 0.0f, odd = 0.0f;
                for (int64_t k = 0; k < g->k2; k += 2) { /* one rounding per product */
                    const uint16_t *pair = tile + k * TILE_N + 2 * slot;
                    even = fmaf(x[k], bf16_to_float(pair[0]), even);
                    odd = fmaf(x[k + 1], bf16_to_float(pair[1]), odd);
                }
                store(g, m, t * TILE_N + c, even + odd);
            }
        }
    }
}

#ifdef QSERVE_BF16_GEMV_AVX2
static inline __m256 widen(const uint16_t *words) { /* 8 bf16 -> 8 fp32, exact */
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)words)), 16));
}

#define K_CHUNK 64 /* k per widened chunk of a tile: 32 pairs x 32 fp32, 4 KiB in L1 */
#define PREFETCH_BYTES 4096 /* software prefetch distance in the weight stream: between
                               chunks the FMAs run long enough for the hardware prefetcher
                               to fall behind */

/* 3 rows from m0, k in [k0, k0 + kn) (kn even) of the widened chunk w ([kn / 2][32] fp32):
 * the even/odd chains of 16 channels continue in acc ([3][4] pair vectors), by
 * fma_pairs3 (pairs_avx2.h). Not inlined: inside the caller's loops the
 * compiler spilled accumulators. */
static __attribute__((noinline)) void mul_chunk3(const Gemv *g, const float *w, int64_t m0,
                                                 int64_t k0, int64_t kn, __m256 (*acc)[4]) {
    __m256 a0 = acc[0][0], a1 = acc[0][1], a2 = acc[0][2], a3 = acc[0][3];
    __m256 b0 = acc[1][0], b1 = acc[1][1], b2 = acc[1][2], b3 = acc[1][3];
    __m256 c0 = acc[2][0], c1 = acc[2][1], c2 = acc[2][2], c3 = acc[2][3];
    const float *x0 = g->x + m0 * g->k2 + k0, *x1 = x0 + g->k2, *x2 = x1 + g->k2;
#pragma GCC unroll 8
    for (int64_t k = 0; k < kn; k += 2)
        fma_pairs3(x0 + k, x1 + k, x2 + k, w + k * TILE_N, &a0, &a1, &a2, &a3, &b0, &b1, &b2,
                   &b3, &c0, &c1, &c2, &c3);
    acc[0][0] = a0, acc[0][1] = a1, acc[0][2] = a2, acc[0][3] = a3;
    acc[1][0] = b0, acc[1][1] = b1, acc[1][2] = b2, acc[1][3] = b3;
    acc[2][0] = c0, acc[2][1] = c1, acc[2][2] = c2, acc[2][3] = c3;
}

/* `rows` (1 or 2) rows from m0 over the same k: the widened chunk w or, where w is NULL,
 * the tile's bf16 words at src (the chunk's first k pair) widened on the fly. The same
 * chains. Inlined with constant `rows`. */
static inline __attribute__((always_inline)) void mul_chunk(
    const Gemv *g, const uint16_t *src, const float *w, int64_t m0, int rows, int64_t k0,
    int64_t kn, __m256 (*acc)[4]) {
    __m256 a[2][4];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < 4; j++)
            a[i][j] = acc[i][j];
    for (int64_t k = 0; k < kn; k += 2) {
        if (w == NULL) /* the k pair's 64 bytes: a cache line */
            _mm_prefetch((const char *)(src + k * TILE_N) + PREFETCH_BYTES, _MM_HINT_T0);
        __m256 p[2];
        for (int i = 0; i < rows; i++)
            p[i] = broadcast_pair(g->x + (m0 + i) * g->k2 + k0 + k);
        for (int j = 0; j < 4; j++) {
            const __m256 v = w != NULL ? _mm256_load_ps(w + k * TILE_N + 8 * j)
                                       : widen(src + k * TILE_N + 8 * j);
            for (int i = 0; i < rows; i++)
                a[i][j] = _mm256_fmadd_ps(p[i], v, a[i][j]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < 4; j++)
            acc[i][j] = a[i][j];
}

/* Tiles [t0, t1), all rows. One or two rows widen the bf16 words on the fly; more rows
 * widen each K_CHUNK of a tile once into L1 and run over it 3 rows at a time
 * (mul_chunk3), the last one or two by mul_chunk. */
static void run_avx2(const Gemv *g, int64_t t0, int64_t t1) {
    float w[K_CHUNK * TILE_N] __attribute__((aligned(32)));
    __m256 acc[MAX_ROWS][4];
    const int buffered = g->m > 2;
    for (int64_t t = t0; t < t1; t++) {
        const uint16_t *tile = g->w + t * g->k2 * TILE_N;
        for (int64_t i = 0; i < g->m; i++)
            for (int j = 0; j < 4; j++)
                acc[i][j] = _mm256_setzero_ps();
        for (int64_t k0 = 0; k0 < g->k2; k0 += K_CHUNK) {
            const int64_t kn = g->k2 - k0 < K_CHUNK ? g->k2 - k0 : K_CHUNK;
            const uint16_t *src = tile + k0 * TILE_N;
            if (buffered)
                for (int64_t j = 0; j < kn * TILE_N; j += 8) {
                    if (j % 32 == 0) /* a cache line */
                        _mm_prefetch((const char *)(src + j) + PREFETCH_BYTES, _MM_HINT_T0);
                    _mm256_store_ps(w + j, widen(src + j));
                }
            int64_t i = 0;
            if (buffered)
                for (; i + 3 <= g->m; i += 3)
                    mul_chunk3(g, w, i, k0, kn, acc + i);
            if (g->m - i == 2)
                mul_chunk(g, src, buffered ? w : NULL, i, 2, k0, kn, acc + i);
            else if (g->m - i == 1)
                mul_chunk(g, src, buffered ? w : NULL, i, 1, k0, kn, acc + i);
        }
        for (int64_t i = 0; i < g->m; i++) { /* even + odd: channels 0..15 in order */
            float sums[TILE_N] __attribute__((aligned(32)));
            _mm256_store_ps(sums, _mm256_hadd_ps(acc[i][0], acc[i][1]));
            _mm256_store_ps(sums + 8, _mm256_hadd_ps(acc[i][2], acc[i][3]));
            for (int c = 0; c < TILE_N && t * TILE_N + c < g->n; c++)
                store(g, i, t * TILE_N + c, sums[c]);
        }
    }
}
#endif

/* At most MAX_ROWS rows (the accumulators' rows). Returns 0, or -1 when the input buffer
 * cannot be allocated. */
static int gemv_rows(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride,
                     const uint16_t *packed, int64_t n, const float *bias, uint16_t *out,
                     int64_t out_stride, int num_threads) {
    const int64_t k2 = k + k % 2;
    float *xf = malloc((size_t)(m * k2) * sizeof(float) + 64);
    if (xf == NULL)
        return -1;
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j = 0; j < k; j++)
            xf[i * k2 + j] = bf16_to_float(x[i * x_stride + j]);
        if (k2 > k)
            xf[i * k2 + k] = 0.0f;
    }
    const Gemv g = {xf, m, k2, packed, n, bias, out, out_stride};
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

/* Any number of rows, MAX_ROWS at a time: a row's result does not depend on the rows
 * beside it, so the chunks give the bits one call would. Returns 0; -1 when the input
 * buffer cannot be allocated. */
int qserve_bf16_gemv(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride,
                     const uint16_t *packed, int64_t n, const float *bias, uint16_t *out,
                     int64_t out_stride, int num_threads) {
    if (n <= 0)
        return 0;
    for (int64_t r = 0; r < m; r += MAX_ROWS) {
        const int64_t rows = m - r < MAX_ROWS ? m - r : MAX_ROWS;
        if (gemv_rows(x + r * x_stride, rows, k, x_stride, packed, n, bias, out + r * out_stride,
                      out_stride, num_threads) != 0)
            return -1;
    }
    return 0;
}

/* Latent attention's per-head up-projections in one call: for each head h < heads,
 * out + h * out_head = (x + h * x_head) W_h, W_h the packed weight at address packed[h],
 * each with qserve_bf16_gemv's bits (no bias). One head's linear is too small to split
 * over threads, so the heads are: a static share each. Strides and head offsets in bf16
 * elements. Returns 0; -1 when an input buffer cannot be allocated. */
int qserve_bf16_gemv_heads(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride,
                           int64_t x_head, const int64_t *packed, int64_t n, uint16_t *out,
                           int64_t out_stride, int64_t out_head, int64_t heads,
                           int num_threads) {
    int failed = 0;
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(|| : failed)
    for (int64_t h = 0; h < heads; h++)
        failed = qserve_bf16_gemv(x + h * x_head, m, k, x_stride,
                                  (const uint16_t *)(intptr_t)packed[h], n, NULL,
                                  out + h * out_head, out_stride, 1) != 0 || failed;
    return failed ? -1 : 0;
}

/* 1 when this build multiplies with AVX2 FMAs, 0: the portable scalar loop. */
int qserve_bf16_gemv_vector(void) {
#ifdef QSERVE_BF16_GEMV_AVX2
    return 1;
#else
    return 0;
#endif
}
