/* Causal attention of a prompt chunk over its whole context on CPU, in fp32, for chunks
 * too long for the paged decode kernel (paged_attention_cpu.c does one query row at a
 * time against a score row of the whole context; here queries go in tiles).
 *
 * Built and loaded at run time by kernels/native_build.py, called through ctypes by
 * kernels/native_prefill_attention.py (the Python side checks every shape and dtype).
 *
 * Layouts (row-major, contiguous, fp32):
 *   q        [nq, hq, d]   the chunk's queries, already times the q.k scale of their kv head
 *   k, v     [lk, hkv, d]  the context's keys and values, the chunk's own last
 *   v_scale  [hkv]         multiplies the output
 *   out      [nq, hq, d]
 * Query i sits at key index lk - nq + i and sees key j iff j <= that index and, with
 * window > 0, index - j < window. Query head h * g + r (g = hq / hkv) reads kv head h.
 *
 * A work item is one kv head and a tile of Q_TILE queries: its rows (query, head of the
 * group) attend over key blocks of KEY_BLOCK keys up to the tile's last query, with the
 * online softmax (a running max and sum per row, the accumulator rescaled when the max
 * grows), so scores never leave a KEY_BLOCK-wide buffer. Per block, q . k is a register
 * tile of QK_ROWS rows x KEY_BLOCK keys over the block's K transposed, and p . v a tile of
 * PV_ROWS rows x PV_VECS vectors of columns: each loaded K or V vector feeds several
 * rows' multiply-adds (the decode kernel's one row per load measured ~2.5x slower per
 * multiply-add on prompt chunks).
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_exp.h"

#if defined(__AVX512F__)
#define VL 16 /* fp32 lanes per vector */
typedef vf16 vf;
typedef vf16u vfu;
typedef vi16 vi;
#define vexp exp_nonpositive16
#define QK_ROWS 6 /* 12 accumulators of 32 registers */
#define PV_ROWS 4 /* 16 accumulators */
#define ROW_PAD 12 /* lcm(QK_ROWS, PV_ROWS): rows of a tile are padded to a multiple */
#else
#define VL 8
typedef vf8 vf;
typedef vf8u vfu;
typedef vi8 vi;
#define vexp exp_nonpositive8
#define QK_ROWS 4 /* 8 accumulators of 16 registers */
#define PV_ROWS 3 /* 12 accumulators (2 rows measured ~12% slower; 6 q.k rows no faster) */
#define ROW_PAD 12
#endif
#define PV_VECS 4
#define KEY_BLOCK (2 * VL) /* keys per block: two vectors of scores per row */
#define Q_TILE 32          /* queries per work item */

#if defined(__AVX2__)
#include <immintrin.h>
#endif

static inline vf select_lanes(vi mask, vf yes, vf no) {
    return (vf)(((vi)yes & mask) | ((vi)no & ~mask));
}

static inline float lanes_max(vf x) {
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps((__m512)x);
#elif defined(__AVX2__)
    __m128 m = _mm_max_ps(_mm256_castps256_ps128((__m256)x), _mm256_extractf128_ps((__m256)x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
#else
    float m = x[0];
    for (int l = 1; l < VL; l++) m = x[l] > m ? x[l] : m;
    return m;
#endif
}

static inline float lanes_sum(vf x) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)x);
#elif defined(__AVX2__)
    __m128 m = _mm_add_ps(_mm256_castps256_ps128((__m256)x), _mm256_extractf128_ps((__m256)x, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
#else
    float t = 0.0f;
    for (int l = 0; l < VL; l++) t += x[l];
    return t;
#endif
}

/* s[r][0:KEY_BLOCK] = qb[r] . kt for QK_ROWS rows; kt [d][KEY_BLOCK] (zero past the
 * block's keys). */
static inline void qk_tile(const float *restrict qb, int64_t d, const float *restrict kt,
                           float *restrict s) {
    vf a0[QK_ROWS], a1[QK_ROWS];
    const vf zero = {0};
#pragma GCC unroll 8
    for (int r = 0; r < QK_ROWS; r++) a0[r] = a1[r] = zero;
    for (int64_t c = 0; c < d; c++) {
        const vf k0 = *(const vfu *)(kt + c * KEY_BLOCK);
        const vf k1 = *(const vfu *)(kt + c * KEY_BLOCK + VL);
#pragma GCC unroll 8
        for (int r = 0; r < QK_ROWS; r++) {
            const float x = qb[r * d + c];
            a0[r] += x * k0;
            a1[r] += x * k1;
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < QK_ROWS; r++) {
        *(vfu *)(s + r * KEY_BLOCK) = a0[r];
        *(vfu *)(s + r * KEY_BLOCK + VL) = a1[r];
    }
}

/* acc[r][c0:c0 + PV_VECS * VL] += sum_jj p[r][jj] * v[jj][c0:...] for PV_ROWS rows; acc
 * rows are d apart, v rows vstride apart (both already at column c0). */
static inline void pv_tile(float *restrict acc, int64_t d, const float *restrict p,
                           const float *restrict v, int64_t vstride, int64_t nk) {
    vf a[PV_ROWS][PV_VECS];
#pragma GCC unroll 8
    for (int r = 0; r < PV_ROWS; r++)
#pragma GCC unroll 4
        for (int u = 0; u < PV_VECS; u++) a[r][u] = *(const vfu *)(acc + r * d + u * VL);
    for (int64_t jj = 0; jj < nk; jj++) {
        vf x[PV_VECS];
#pragma GCC unroll 4
        for (int u = 0; u < PV_VECS; u++) x[u] = *(const vfu *)(v + jj * vstride + u * VL);
#pragma GCC unroll 8
        for (int r = 0; r < PV_ROWS; r++) {
            const float w = p[r * KEY_BLOCK + jj];
#pragma GCC unroll 4
            for (int u = 0; u < PV_VECS; u++) a[r][u] += w * x[u];
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < PV_ROWS; r++)
#pragma GCC unroll 4
        for (int u = 0; u < PV_VECS; u++) *(vfu *)(acc + r * d + u * VL) = a[r][u];
}

/* A tile's rows (queries x heads of the group) padded to a multiple of ROW_PAD. */
static inline int64_t padded_rows(int64_t rows) {
    return (rows + ROW_PAD - 1) / ROW_PAD * ROW_PAD;
}

/* One work item: kv head h, queries [q0, q1). scratch: see run_item. */
static void attend_tile(const float *q, const float *k, const float *v, int64_t nq,
                        int64_t lk, int64_t hq, int64_t hkv, int64_t d, int64_t window,
                        const float *v_scale, float *out, int64_t h, int64_t q0, int64_t q1,
                        float *scratch) {
    const int64_t g = hq / hkv, rows = (q1 - q0) * g;
    const int64_t padded = padded_rows(rows);
    const int64_t stride = hkv * d; /* between consecutive keys (values) of a head */
    float *qb = scratch;                   /* [padded, d] the tile's query rows */
    float *acc = qb + padded * d;          /* [padded, d] */
    float *s = acc + padded * d;           /* [padded, KEY_BLOCK] scores, then p */
    float *kt = s + padded * KEY_BLOCK;    /* [d, KEY_BLOCK] the block's K transposed */
    float *mx = kt + d * KEY_BLOCK;        /* [padded] running max per row */
    float *sum = mx + padded;              /* [padded] running sum of e^(s - mx) */
    for (int64_t i = q0; i < q1; i++) /* query i's g heads of kv head h are contiguous */
        memcpy(qb + (i - q0) * g * d, q + (i * hq + h * g) * d, (size_t)(g * d) * sizeof(float));
    memset(qb + rows * d, 0, (size_t)((padded - rows) * d) * sizeof(float));
    memset(acc, 0, (size_t)(padded * d) * sizeof(float));
    for (int64_t r = 0; r < padded; r++) {
        mx[r] = -INFINITY;
        sum[r] = 0.0f;
    }
    const int64_t first = lk - nq + q0, last = lk - nq + q1 - 1; /* key index of q0, q1 - 1 */
    const int64_t lo = window > 0 && first - window + 1 > 0 ? first - window + 1 : 0;
    const int64_t d_vec = d / (PV_VECS * VL) * (PV_VECS * VL); /* columns the tiles cover */
    vi lane; /* 0, 1, ..., VL - 1 */
    for (int l = 0; l < VL; l++) lane[l] = l;
    const vf zero = {0}, minus_inf = zero - INFINITY;
    for (int64_t j0 = lo; j0 <= last; j0 += KEY_BLOCK) {
        const int64_t nk = last + 1 - j0 < KEY_BLOCK ? last + 1 - j0 : KEY_BLOCK;
        for (int64_t c = 0; c < d; c++) {
            float *dst = kt + c * KEY_BLOCK;
            int64_t jj = 0;
            for (; jj < nk; jj++) dst[jj] = k[(j0 + jj) * stride + h * d + c];
            for (; jj < KEY_BLOCK; jj++) dst[jj] = 0.0f;
        }
        for (int64_t r0 = 0; r0 < padded; r0 += QK_ROWS)
            qk_tile(qb + r0 * d, d, kt, s + r0 * KEY_BLOCK);
        /* the online softmax: p = e^(s - new max) over the keys a row sees, 0 elsewhere
         * (padding rows see nothing: p = 0, their accumulators never leave the tile) */
        for (int64_t r = 0; r < padded; r++) {
            float *sr = s + r * KEY_BLOCK;
            const int64_t pos = first + r / g;
            int64_t a = j0, b = j0 + nk; /* visible keys [a, b) of the block */
            if (window > 0 && pos - window + 1 > a) a = pos - window + 1;
            if (pos + 1 < b) b = pos + 1;
            if (r >= rows || b <= a) {
                memset(sr, 0, KEY_BLOCK * sizeof(float));
                continue;
            }
            vf s0 = *(vfu *)sr, s1 = *(vfu *)(sr + VL);
            vi in0 = lane == lane, in1 = in0; /* all lanes visible */
            if (a != j0 || b != j0 + KEY_BLOCK) {
                const int32_t from = (int32_t)(a - j0), to = (int32_t)(b - j0);
                in0 = (lane >= from) & (lane < to);
                in1 = (lane + VL >= from) & (lane + VL < to);
                s0 = select_lanes(in0, s0, minus_inf);
                s1 = select_lanes(in1, s1, minus_inf);
            }
            const float bm = lanes_max(select_lanes(s0 > s1, s0, s1));
            const float m = bm > mx[r] ? bm : mx[r];
            const float alpha = exp_nonpositive(mx[r] - m); /* ~0 on the first block */
            const vf e0 = select_lanes(in0, vexp(s0 - m), zero);
            const vf e1 = select_lanes(in1, vexp(s1 - m), zero);
            *(vfu *)sr = e0;
            *(vfu *)(sr + VL) = e1;
            const float total = lanes_sum(e0 + e1);
            if (mx[r] != m) {
                float *ar = acc + r * d;
#pragma omp simd
                for (int64_t c = 0; c < d; c++) ar[c] *= alpha;
                sum[r] *= alpha;
                mx[r] = m;
            }
            sum[r] += total;
        }
        const float *vb = v + j0 * stride + h * d;
        for (int64_t r0 = 0; r0 < padded; r0 += PV_ROWS) {
            for (int64_t c0 = 0; c0 < d_vec; c0 += PV_VECS * VL)
                pv_tile(acc + r0 * d + c0, d, s + r0 * KEY_BLOCK, vb + c0, stride, nk);
            for (int64_t r = r0; r < r0 + PV_ROWS; r++) /* head sizes past the tiles */
                for (int64_t jj = 0; jj < nk; jj++) {
                    const float w = s[r * KEY_BLOCK + jj];
                    for (int64_t c = d_vec; c < d; c++) acc[r * d + c] += w * vb[jj * stride + c];
                }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = q0 + r / g, head = h * g + r % g;
        const float scale = sum[r] > 0.0f ? v_scale[h] / sum[r] : 0.0f;
        float *o = out + (i * hq + head) * d;
        const float *ar = acc + r * d;
#pragma omp simd
        for (int64_t c = 0; c < d; c++) o[c] = ar[c] * scale;
    }
}

static int run_item(const float *q, const float *k, const float *v, int64_t nq, int64_t lk,
                    int64_t hq, int64_t hkv, int64_t d, int64_t window, const float *v_scale,
                    float *out, int64_t h, int64_t tile) {
    const int64_t q0 = tile * Q_TILE, q1 = q0 + Q_TILE < nq ? q0 + Q_TILE : nq;
    const int64_t padded = padded_rows((q1 - q0) * (hq / hkv));
    const size_t floats = (size_t)(2 * padded * d + padded * KEY_BLOCK + d * KEY_BLOCK
                                   + 2 * padded);
    float *scratch = (float *)malloc(floats * sizeof(float));
    if (!scratch) return -1;
    attend_tile(q, k, v, nq, lk, hq, hkv, d, window, v_scale, out, h, q0, q1, scratch);
    free(scratch);
    return 0;
}

/* Returns 0, or -1 when a scratch allocation failed (out is then incomplete). Items run
 * the last tiles (the most keys) first so that the dynamic schedule ends on short ones.
 * A call is milliseconds of work: entering OpenMP on one thread (~20 us) does not matter
 * here, unlike in the decode kernel. */
int qserve_prefill_attention_cpu(const float *q, const float *k, const float *v, int64_t nq,
                                 int64_t lk, int64_t hq, int64_t hkv, int64_t d,
                                 int64_t window, const float *v_scale, float *out,
                                 int num_threads) {
    const int64_t tiles = (nq + Q_TILE - 1) / Q_TILE, items = tiles * hkv;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads > 1 ? num_threads : 1) \
    reduction(| : failed)
    for (int64_t it = 0; it < items; it++)
        failed |= run_item(q, k, v, nq, lk, hq, hkv, d, window, v_scale, out, it % hkv,
                           tiles - 1 - it / hkv);
    return failed ? -1 : 0;
}
