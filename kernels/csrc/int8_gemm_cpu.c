/* W8A8 int8 linear on CPU: int8 weights with one scale per output channel, bf16 inputs
 * quantized to int8 per row at run time, exact int32 sums.
 *
 * Built and loaded at run time by kernels/native_build.py, called through ctypes by
 * kernels/native_int8_gemm.py and by the C decode path's step programs.
 *
 *   s[m]      = amax_k |x[m, k]| / 127                                   (fp32)
 *   q[m, k]   = clamp(rint(x[m, k] / s[m]), -127, 127)   (round half to even; 0 where s is 0)
 *   acc[m, n] = sum_k q[m, k] * w[n, k]                                  (int32, exact)
 *   out[m, n] = bf16(fp32(acc[m, n]) * (s[m] * scale[n or 0]))
 *
 * The sums are integers: every order of adding them gives the same acc, so every path
 * here (AVX512-VNNI, AVX2, portable), any blocking of rows, channels and k, any number of
 * threads and torch's own integer matmul (kernels/int8_gemm.py, the reference) give the
 * same bits, and a row's result never depends on the rows beside it (batch invariance
 * for free, at any number of rows). |acc| <= 127 * 127 * k stays below 2^31 for k < 133,000.
 * A row holding an infinity or NaN has no finite scale: its outputs are NaN.
 *
 * Weight layout (`packed`, made once at load by native_int8_gemm.pack_int8_w8a8_weight):
 * the [N, K] int8 matrix zero-padded to N64 = N rounded up to 64 and K4 = K rounded up
 * to 4, in bands of 64 channels, each band one contiguous stream of its K4 / 4 quads of k:
 * byte (band * K4 / 4 + s) * 256 + c * 4 + j holds w[64 band + c, 4 s + j] + 128 (an
 * unsigned byte, 1..255). That is vpdpbusd's unsigned operand for 16 channels per 64
 * bytes: acc' = sum_k q * (w + 128) = acc + 128 * sum_k q, so acc = acc' - 128 * rowsum(q).
 * The AVX2 path widens the same bytes to int16 (vpmovzxbw) and multiplies pairs with
 * vpmaddwd (each pair sum <= 2 * 127 * 255: exact in int32).
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "argmax_order.h"
#include "float_bits.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QSERVE_INT8_VNNI 1 /* vpdpbusd, 16 channels x 4 k per instruction */
#include <immintrin.h>
#elif defined(__AVX2__)
#define QSERVE_INT8_AVX2 1 /* vpmaddwd on widened weights, 4 channels x 4 k per instruction */
#include <immintrin.h>
#endif

#define BAND_N 64     /* channels per band: one contiguous weight stream */
#define QUAD_BYTES (BAND_N * 4) /* one quad of k of a band */
#define K_BLOCK 256   /* k per block: a band's block (16 KiB) stays in L1 across the rows */
#define ROW_CHUNK 128 /* rows per chunk: the chunk's int8 inputs stay in L2 across bands */
#define ROW_BLOCK 6   /* rows sharing each weight load on the VNNI path (24 accumulators) */
#define ROW_BLOCK_AVX2 6 /* rows sharing each weight load on the AVX2 path (12 accumulators, 2 weights) */
#define ROWS_DIRECT_AVX2 3 /* AVX2 path: up to this many rows skip the int16 buffer */
#define PREFETCH_L2_BYTES 65536 /* VNNI path: the first pass of rows over a band's k block
                                 * asks for the weights this far ahead into L2 (at 16 rows
                                 * ~10% faster from memory; 32-64 KiB measured best) */
#define PREFETCH_BYTES 4096 /* AVX2 path, few rows: software prefetch distance in the
                             * weight stream (without it, 1 row ran at half the FP8
                             * kernel's rate on weights from memory) */
#define PARALLEL_MIN_MACS (1 << 18) /* below this many products one thread does it all */

typedef struct {
    const int8_t *q;     /* [M, k4] int8 inputs, zero-padded */
    const int16_t *q16;  /* AVX2 path only: the same widened, [M, k4] */
    const int32_t *qsum; /* [M] sum_k q[m, k] */
    const float *qs;     /* [M] the rows' scales s[m] */
    int64_t m, k4;
    const uint8_t *w;    /* packed, [n64 * k4] */
    int64_t n;
    const float *scale;  /* [N] or [1] */
    int64_t scale_len;
    uint16_t *out;       /* [M, out_stride] bf16 (NULL in an argmax call) */
    int64_t out_stride;
    /* argmax calls only, else NULL: per row, the largest output this thread has computed
     * and its channel (-1: none yet), in place of `out` */
    float *best_value;   /* [M] */
    int64_t *best_index; /* [M] */
} Gemm;

/* Row x [k] bf16 -> q [k4] int8 (zero-padded), its scale and the sum of its codes. */
static void quantize_row(const uint16_t *x, int64_t k, int64_t k4, int8_t *q, float *scale,
                         int32_t *sum) {
    float amax = 0.0f;
    int finite = 1;
#pragma omp simd reduction(max : amax) reduction(& : finite)
    for (int64_t j = 0; j < k; j++) {
        const float v = fabsf(bf16_to_float(x[j]));
        finite &= v <= 3.4028234663852886e38f; /* false for inf and NaN */
        amax = v > amax ? v : amax;
    }
    const float s = amax / 127.0f;
    int32_t total = 0;
    if (!finite || s == 0.0f) { /* no finite scale, or a row of zeros */
        memset(q, 0, (size_t)k4);
        *scale = finite ? 0.0f : bits_to_float(0x7FC00000u);
        *sum = 0;
        return;
    }
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < k; j++) {
        float r = rintf(bf16_to_float(x[j]) / s); /* IEEE division: as torch divides */
        r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
        q[j] = (int8_t)r;
        total += (int32_t)r;
    }
    for (int64_t j = k; j < k4; j++)
        q[j] = 0;
    *scale = s;
    *sum = total;
}

/* Rows [r0, r0 + rows) of band `band` from their int32 sums' [rows, BAND_N] block (of
 * q * (w + 128)): the epilogue, output channels below n only; an argmax call keeps each
 * row's best output instead of storing them. */
static void store_band(const Gemm *g, int64_t r0, int64_t rows, int64_t band,
                       const int32_t *sums) {
    const int64_t n0 = band * BAND_N;
    const int64_t width = g->n - n0 < BAND_N ? g->n - n0 : BAND_N;
    uint16_t kept[BAND_N]; /* an argmax call's outputs of one row, never stored */
    for (int64_t i = 0; i < rows; i++) {
        const int64_t r = r0 + i;
        const int32_t bias = 128 * g->qsum[r];
        const float s = g->qs[r];
        uint16_t *out = g->best_index != NULL ? kept : g->out + r * g->out_stride + n0;
        const int32_t *sp = sums + i * BAND_N;
        if (g->scale_len == 1) {
            const float f = s * g->scale[0];
#pragma omp simd
            for (int64_t j = 0; j < width; j++)
                out[j] = bf16_round((float)(sp[j] - bias) * f);
        } else {
            const float *sc = g->scale + n0;
#pragma omp simd
            for (int64_t j = 0; j < width; j++)
                out[j] = bf16_round((float)(sp[j] - bias) * (s * sc[j]));
        }
        if (g->best_index != NULL)
            for (int64_t j = 0; j < width; j++) {
                const float v = bf16_to_float(kept[j]);
                if (beats(v, n0 + j, g->best_value[r], g->best_index[r])) {
                    g->best_value[r] = v;
                    g->best_index[r] = n0 + j;
                }
            }
    }
}

/* Bands [b0, b1), rows [r0, r0 + rows) with rows <= ROW_CHUNK, portably. */
static void run_portable(const Gemm *g, int64_t b0, int64_t b1, int64_t r0, int64_t rows) {
    int32_t sums[ROW_CHUNK * BAND_N];
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *band = g->w + b * BAND_N * g->k4;
        for (int64_t i = 0; i < rows; i++) {
            const int8_t *q = g->q + (r0 + i) * g->k4;
            for (int64_t c = 0; c < BAND_N; c++) {
                int32_t acc = 0;
                for (int64_t s = 0; s < g->k4 / 4; s++)
                    for (int j = 0; j < 4; j++)
                        acc += (int32_t)q[4 * s + j] * band[s * QUAD_BYTES + c * 4 + j];
                sums[i * BAND_N + c] = acc;
            }
        }
        store_band(g, r0, rows, b, sums);
    }
}

#ifdef QSERVE_INT8_VNNI
/* `rows` (<= ROW_BLOCK) rows times `quads` quads of a band: w the band's stream at the
 * first quad, q row 0's inputs there (the next rows q_stride apart), sums [rows, BAND_N]
 * (loaded first unless `first`). Inlined with constant `rows`. */
/* acc += per lane the 4 products of the unsigned bytes of w and the signed bytes of x.
 * Inline asm: with _mm512_dpbusd_epi32, GCC 12 moved every accumulator through another
 * register (and, for 24 of them, the stack) on each use. */
#define DPBUSD(acc, w, x) __asm__("vpdpbusd %[b], %[u], %[a]" : [a] "+v"(acc) : [u] "v"(w), [b] "v"(x))
#define VNNI_ROW(I)                                                                         \
    __m512i a##I##0, a##I##1, a##I##2, a##I##3;                                              \
    if (rows > I) {                                                                         \
        int32_t *sp = sums + I * BAND_N;                                                    \
        a##I##0 = first ? _mm512_setzero_si512() : _mm512_load_si512(sp);                   \
        a##I##1 = first ? _mm512_setzero_si512() : _mm512_load_si512(sp + 16);              \
        a##I##2 = first ? _mm512_setzero_si512() : _mm512_load_si512(sp + 32);              \
        a##I##3 = first ? _mm512_setzero_si512() : _mm512_load_si512(sp + 48);              \
    }
#define VNNI_MUL(I)                                                                         \
    if (rows > I) {                                                                         \
        int32_t quad;                                                                       \
        memcpy(&quad, q + I * q_stride + 4 * s, 4);                                         \
        const __m512i x = _mm512_set1_epi32(quad);                                          \
        DPBUSD(a##I##0, w0, x);                                                             \
        DPBUSD(a##I##1, w1, x);                                                             \
        DPBUSD(a##I##2, w2, x);                                                             \
        DPBUSD(a##I##3, w3, x);                                                             \
    }
#define VNNI_STORE(I)                                                                       \
    if (rows > I) {                                                                         \
        int32_t *sp = sums + I * BAND_N;                                                    \
        _mm512_store_si512(sp, a##I##0);                                                    \
        _mm512_store_si512(sp + 16, a##I##1);                                               \
        _mm512_store_si512(sp + 32, a##I##2);                                               \
        _mm512_store_si512(sp + 48, a##I##3);                                               \
    }
static inline __attribute__((always_inline)) void mul_rows_vnni(
    const uint8_t *w, const int8_t *q, int64_t q_stride, int rows, int64_t quads,
    int32_t *sums, int first, int prefetch) {
    VNNI_ROW(0) VNNI_ROW(1) VNNI_ROW(2) VNNI_ROW(3) VNNI_ROW(4) VNNI_ROW(5)
    for (int64_t s = 0; s < quads; s++) {
        const uint8_t *ws = w + s * QUAD_BYTES;
        if (prefetch)
            for (int l = 0; l < QUAD_BYTES; l += 64)
                _mm_prefetch((const char *)(ws + PREFETCH_L2_BYTES + l), _MM_HINT_T1);
        const __m512i w0 = _mm512_loadu_si512(ws), w1 = _mm512_loadu_si512(ws + 64);
        const __m512i w2 = _mm512_loadu_si512(ws + 128), w3 = _mm512_loadu_si512(ws + 192);
        VNNI_MUL(0) VNNI_MUL(1) VNNI_MUL(2) VNNI_MUL(3) VNNI_MUL(4) VNNI_MUL(5)
    }
    VNNI_STORE(0) VNNI_STORE(1) VNNI_STORE(2) VNNI_STORE(3) VNNI_STORE(4) VNNI_STORE(5)
}

static void run_vnni(const Gemm *g, int64_t b0, int64_t b1, int64_t r0, int64_t rows) {
    int32_t sums[ROW_CHUNK * BAND_N] __attribute__((aligned(64)));
    const int64_t quads = g->k4 / 4;
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *band = g->w + b * BAND_N * g->k4;
        for (int64_t s0 = 0; s0 < quads; s0 += K_BLOCK / 4) {
            const int64_t nq = quads - s0 < K_BLOCK / 4 ? quads - s0 : K_BLOCK / 4;
            const uint8_t *w = band + s0 * QUAD_BYTES;
            const int first = s0 == 0;
            int64_t i = 0;
            for (; i + ROW_BLOCK <= rows; i += ROW_BLOCK)
                if (i == 0) /* the pass that first reads this block from memory */
                    mul_rows_vnni(w, g->q + (r0 + i) * g->k4 + 4 * s0, g->k4, ROW_BLOCK, nq,
                                  sums + i * BAND_N, first, 1);
                else
                    mul_rows_vnni(w, g->q + (r0 + i) * g->k4 + 4 * s0, g->k4, ROW_BLOCK, nq,
                                  sums + i * BAND_N, first, 0);
            const int8_t *q = g->q + (r0 + i) * g->k4 + 4 * s0;
            int32_t *sp = sums + i * BAND_N;
            switch (rows - i) {
            case 5: mul_rows_vnni(w, q, g->k4, 5, nq, sp, first, i == 0); break;
            case 4: mul_rows_vnni(w, q, g->k4, 4, nq, sp, first, i == 0); break;
            case 3: mul_rows_vnni(w, q, g->k4, 3, nq, sp, first, i == 0); break;
            case 2: mul_rows_vnni(w, q, g->k4, 2, nq, sp, first, i == 0); break;
            case 1: mul_rows_vnni(w, q, g->k4, 1, nq, sp, first, i == 0); break;
            default: break;
            }
        }
        store_band(g, r0, rows, b, sums);
    }
}
#endif

#ifdef QSERVE_INT8_AVX2
/* Adds (or, for a block's first k block, stores) 8 channels' int32 sums into sums at sp. */
static inline void add_sums8(int32_t *sp, __m256i sums8, int first) {
    __m256i *v = (__m256i *)sp;
    _mm256_store_si256(v, first ? sums8 : _mm256_add_epi32(_mm256_load_si256(v), sums8));
}

/* add_sums8 for 16 channels, lo channels 0..7 and hi 8..15. */
static inline void add_sums16(int32_t *sp, __m256i lo, __m256i hi, int first) {
    add_sums8(sp, lo, first);
    add_sums8(sp + 8, hi, first);
}

/* `rows` (<= ROW_BLOCK_AVX2) rows times `quads` quads of one 8-channel group g of a band's
 * k block, widened to int16 in wide [quads][BAND_N * 4] (the group's 32 values at g * 32);
 * q16 row 0's widened inputs there (the next rows q_stride apart). Each ymm of weights holds
 * 4 channels x 4 k (two per quad: the group's channels 0-3 and 4-7); vpmaddwd with a row's
 * 4 inputs broadcast leaves per channel two int32 lanes (k 0+1, k 2+3), added in pairs at
 * the end into sums [rows, BAND_N] at the group's 8. Six rows take 12 accumulators, the
 * two weights and the broadcast the rest of the 16 ymm registers. Inlined with constant
 * `rows`. */
/* acc += vpmaddwd(w, a) (inline asm: from intrinsics GCC 12 added each product into a new
 * register and moved it back, two instructions more per product) */
#define MADD_ADD(acc, w, a)                                                                 \
    do {                                                                                    \
        __m256i t_;                                                                         \
        __asm__("vpmaddwd %[x], %[y], %[t]\n\tvpaddd %[t], %[c], %[c]"                      \
                : [c] "+x"(acc), [t] "=&x"(t_) : [x] "x"(w), [y] "x"(a));                   \
    } while (0)
#define AVX2_ROW(I) __m256i c##I##0 = _mm256_setzero_si256(), c##I##1 = c##I##0;
#define AVX2_MUL(I)                                                                         \
    if (rows > I) {                                                                         \
        int64_t quad;                                                                       \
        memcpy(&quad, q16 + I * q_stride + 4 * s, 8);                                       \
        const __m256i a = _mm256_set1_epi64x(quad);                                         \
        MADD_ADD(c##I##0, w0, a);                                                           \
        MADD_ADD(c##I##1, w1, a);                                                           \
    }
/* vphaddd leaves channels (0, 1, 4, 5 | 2, 3, 6, 7): vpermq 0xD8 puts them in order */
#define AVX2_STORE(I)                                                                       \
    if (rows > I) {                                                                         \
        add_sums8(sums + I * BAND_N + g * 8,                                                \
                  _mm256_permute4x64_epi64(_mm256_hadd_epi32(c##I##0, c##I##1), 0xD8), first); \
    }
static inline __attribute__((always_inline)) void mul_rows_avx2(
    const int16_t *wide, int g, const int16_t *q16, int64_t q_stride, int rows,
    int64_t quads, int32_t *sums, int first) {
    AVX2_ROW(0) AVX2_ROW(1) AVX2_ROW(2) AVX2_ROW(3) AVX2_ROW(4) AVX2_ROW(5)
    for (int64_t s = 0; s < quads; s++) {
        const __m256i *ww = (const __m256i *)(wide + s * BAND_N * 4 + g * 32);
        const __m256i w0 = _mm256_load_si256(ww), w1 = _mm256_load_si256(ww + 1);
        AVX2_MUL(0) AVX2_MUL(1) AVX2_MUL(2) AVX2_MUL(3) AVX2_MUL(4) AVX2_MUL(5)
    }
    AVX2_STORE(0) AVX2_STORE(1) AVX2_STORE(2) AVX2_STORE(3) AVX2_STORE(4) AVX2_STORE(5)
}

/* One row times `quads` quads of a whole band (all 4 tiles, the stream in order, prefetched
 * ahead): each tile's 4 vpmaddwd results are added in pairs (vphaddd) at once into 2
 * accumulators a tile, 8 in all. */
#define ROW1_TILE(T)                                                                        \
    {                                                                                       \
        const uint8_t *wb = ws + T * 64;                                                    \
        const __m256i m0 = _mm256_madd_epi16(                                               \
            _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)wb)), a);                 \
        const __m256i m1 = _mm256_madd_epi16(                                               \
            _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wb + 16))), a);          \
        const __m256i m2 = _mm256_madd_epi16(                                               \
            _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wb + 32))), a);          \
        const __m256i m3 = _mm256_madd_epi16(                                               \
            _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wb + 48))), a);          \
        lo##T = _mm256_add_epi32(lo##T, _mm256_hadd_epi32(m0, m1));                         \
        hi##T = _mm256_add_epi32(hi##T, _mm256_hadd_epi32(m2, m3));                         \
    }
#define ROW1_STORE(T)                                                                       \
    add_sums16(sums + T * 16, _mm256_permute4x64_epi64(lo##T, 0xD8),                        \
               _mm256_permute4x64_epi64(hi##T, 0xD8), first);
static void mul_row1_avx2(const uint8_t *bytes, const int16_t *q16, int64_t quads,
                          int32_t *sums, int first) {
    __m256i lo0 = _mm256_setzero_si256(), hi0 = lo0, lo1 = lo0, hi1 = lo0, lo2 = lo0,
            hi2 = lo0, lo3 = lo0, hi3 = lo0;
    for (int64_t s = 0; s < quads; s++) {
        const uint8_t *ws = bytes + s * QUAD_BYTES;
        for (int l = 0; l < QUAD_BYTES; l += 64)
            _mm_prefetch((const char *)(ws + PREFETCH_BYTES + l), _MM_HINT_T0);
        int64_t quad;
        memcpy(&quad, q16 + 4 * s, 8);
        const __m256i a = _mm256_set1_epi64x(quad);
        ROW1_TILE(0) ROW1_TILE(1) ROW1_TILE(2) ROW1_TILE(3)
    }
    ROW1_STORE(0) ROW1_STORE(1) ROW1_STORE(2) ROW1_STORE(3)
}

static void run_avx2(const Gemm *g, int64_t b0, int64_t b1, int64_t r0, int64_t rows) {
    int32_t sums[ROW_CHUNK * BAND_N] __attribute__((aligned(32)));
    int16_t wide[K_BLOCK * BAND_N] __attribute__((aligned(32))); /* a band's k block, 32 KiB */
    const int64_t quads = g->k4 / 4;
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *band = g->w + b * BAND_N * g->k4;
        for (int64_t s0 = 0; s0 < quads; s0 += K_BLOCK / 4) {
            const int64_t nq = quads - s0 < K_BLOCK / 4 ? quads - s0 : K_BLOCK / 4;
            const uint8_t *w = band + s0 * QUAD_BYTES;
            const int first = s0 == 0;
            const int16_t *q16 = g->q16 + r0 * g->k4 + 4 * s0;
            if (rows <= ROWS_DIRECT_AVX2) { /* widened in registers, a row at a time: the
                                              * later rows read the block from L1 */
                for (int64_t i = 0; i < rows; i++)
                    mul_row1_avx2(w, q16 + i * g->k4, nq, sums + i * BAND_N, first);
                continue;
            }
            for (int64_t j = 0; j < nq * QUAD_BYTES; j += 16) {
                if (j % 64 == 0) { /* and the next k block into L2, read while this one's
                                    * rows are multiplied */
                    _mm_prefetch((const char *)(w + j + PREFETCH_BYTES), _MM_HINT_T0);
                    _mm_prefetch((const char *)(w + j + K_BLOCK * BAND_N), _MM_HINT_T1);
                }
                _mm256_store_si256((__m256i *)(wide + j), _mm256_cvtepu8_epi16(
                    _mm_loadu_si128((const __m128i *)(w + j))));
            }
            for (int c8 = 0; c8 < BAND_N / 8; c8++) { /* the group's 4 KiB stay in L1 */
                int64_t i = 0;
                for (; i + ROW_BLOCK_AVX2 <= rows; i += ROW_BLOCK_AVX2)
                    mul_rows_avx2(wide, c8, q16 + i * g->k4, g->k4, ROW_BLOCK_AVX2, nq,
                                  sums + i * BAND_N, first);
                const int16_t *qi = q16 + i * g->k4;
                int32_t *sp = sums + i * BAND_N;
                switch (rows - i) {
                case 5: mul_rows_avx2(wide, c8, qi, g->k4, 5, nq, sp, first); break;
                case 4: mul_rows_avx2(wide, c8, qi, g->k4, 4, nq, sp, first); break;
                case 3: mul_rows_avx2(wide, c8, qi, g->k4, 3, nq, sp, first); break;
                case 2: mul_rows_avx2(wide, c8, qi, g->k4, 2, nq, sp, first); break;
                case 1: mul_rows_avx2(wide, c8, qi, g->k4, 1, nq, sp, first); break;
                default: break;
                }
            }
        }
        store_band(g, r0, rows, b, sums);
    }
}
#endif

/* The path this build takes, the one place that decides it. */
enum { PATH_PORTABLE = 0, PATH_AVX2 = 1, PATH_VNNI = 2 };
static int gemm_path(void) {
#if defined(QSERVE_INT8_VNNI)
    return PATH_VNNI;
#elif defined(QSERVE_INT8_AVX2)
    return PATH_AVX2;
#else
    return PATH_PORTABLE;
#endif
}

static void run(const Gemm *g, int64_t b0, int64_t b1, int64_t r0, int64_t rows) {
#if defined(QSERVE_INT8_VNNI)
    run_vnni(g, b0, b1, r0, rows);
#elif defined(QSERVE_INT8_AVX2)
    run_avx2(g, b0, b1, r0, rows);
#else
    run_portable(g, b0, b1, r0, rows);
#endif
}

/* x [m, x_stride] bf16 (k used) times the packed weight: into out [m, out_stride] bf16
 * (n used), or, where out_ids is not NULL, per row the channel of the largest output
 * (torch.argmax's: the lowest of equal ones, the first NaN) into out_ids [m] and that
 * output into out_values [m], each thread keeping its channels' best and the threads'
 * bests reduced in the end. scale: the weight scales, [n] or [1] (scale_len). Returns 0,
 * or -1 when a buffer cannot be allocated. */
static int gemm(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride,
                const uint8_t *packed, int64_t n, const float *scale, int64_t scale_len,
                uint16_t *out, int64_t out_stride, int64_t *out_ids, float *out_values,
                int num_threads) {
    if (m <= 0 || n <= 0)
        return 0;
    const int64_t k4 = (k + 3) / 4 * 4;
    const int64_t bands = (n + BAND_N - 1) / BAND_N;
    const int64_t slots = num_threads > 1 ? num_threads : 1; /* argmax: one best per thread */
    const int64_t per = (m + 15) / 16 * 16; /* a thread's bests: whole 64-byte lines apart */
    int8_t *q = aligned_alloc(64, (size_t)(m * k4) + 64);
    int32_t *qsum = aligned_alloc(64, (size_t)m * sizeof(int32_t) + 64);
    float *qs = aligned_alloc(64, (size_t)m * sizeof(float) + 64);
    int16_t *q16 = NULL;
    float *best_value = NULL;   /* [slots, per] */
    int64_t *best_index = NULL; /* [slots, per], -1: that thread saw no channel */
#ifdef QSERVE_INT8_AVX2
    q16 = aligned_alloc(64, (size_t)(m * k4) * sizeof(int16_t) + 64);
#endif
    if (out_ids != NULL) {
        best_value = aligned_alloc(64, (size_t)(slots * per) * sizeof(float));
        best_index = aligned_alloc(64, (size_t)(slots * per) * sizeof(int64_t));
    }
    if (q == NULL || qsum == NULL || qs == NULL || (gemm_path() == PATH_AVX2 && q16 == NULL)
        || (out_ids != NULL && (best_value == NULL || best_index == NULL))) {
        free(q);
        free(qsum);
        free(qs);
        free(q16);
        free(best_value);
        free(best_index);
        return -1;
    }
    for (int64_t i = 0; best_index != NULL && i < slots * per; i++) {
        best_value[i] = 0.0f;
        best_index[i] = -1;
    }
    const int parallel = num_threads > 1 && m * n * k >= PARALLEL_MIN_MACS;
#pragma omp parallel for num_threads(num_threads) if (parallel && m > 1)
    for (int64_t i = 0; i < m; i++) {
        quantize_row(x + i * x_stride, k, k4, q + i * k4, qs + i, qsum + i);
        if (q16 != NULL)
            for (int64_t j = 0; j < k4; j++)
                q16[i * k4 + j] = q[i * k4 + j];
    }
    Gemm g = {q, q16, qsum, qs, m, k4, packed, n, scale, scale_len,
              out_ids != NULL ? NULL : out, out_stride, NULL, NULL};
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
        /* contiguous ranges of whole bands per thread; each thread all rows */
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t lo = bands * t / nt, hi = bands * (t + 1) / nt;
        Gemm mine = g; /* an argmax call: this thread's own bests */
        if (best_index != NULL) {
            mine.best_value = best_value + t * per;
            mine.best_index = best_index + t * per;
        }
        for (int64_t r0 = 0; r0 < m; r0 += ROW_CHUNK)
            run(&mine, lo, hi, r0, m - r0 < ROW_CHUNK ? m - r0 : ROW_CHUNK);
    }
    if (out_ids != NULL)
        reduce_bests(best_value, best_index, slots, per, m, out_ids, out_values);
    free(q);
    free(qsum);
    free(qs);
    free(q16);
    free(best_value);
    free(best_index);
    return 0;
}

/* x [m, x_stride] bf16 (k used) times the packed weight -> out [m, out_stride] bf16 (n
 * used). scale: the weight scales, [n] or [1] (scale_len). Returns 0, or -1 when a buffer
 * cannot be allocated. */
int qserve_int8_gemm_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride,
                          const uint8_t *packed, int64_t n, const float *scale,
                          int64_t scale_len, uint16_t *out, int64_t out_stride,
                          int num_threads) {
    return gemm(x, m, k, x_stride, packed, n, scale, scale_len, out, out_stride, NULL, NULL,
                num_threads);
}

/* Greedy tokens from a W8A8 int8 LM head: per row of x, the vocabulary id (channel) of the
 * largest output, out_ids [m] int64, and that output, out_values [m] fp32 (a bf16 value),
 * as torch.argmax finds them in what qserve_int8_gemm_bf16 writes, without writing those
 * outputs. Same returns. */
int qserve_int8_gemm_argmax_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride,
                                 const uint8_t *packed, int64_t n, const float *scale,
                                 int64_t scale_len, int64_t *out_ids, float *out_values,
                                 int num_threads) {
    return gemm(x, m, k, x_stride, packed, n, scale, scale_len, NULL, n, out_ids, out_values,
                num_threads);
}

/* The path this build takes: 0 portable, 1 AVX2, 2 AVX512-VNNI. */
int qserve_int8_gemm_path(void) { return gemm_path(); }
