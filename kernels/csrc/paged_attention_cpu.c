/* Paged attention over an FP8 (E4M3) or bf16 KV cache on CPU, for short queries.
 *
 * Built and loaded at run time by kernels/native_build.py, called through ctypes by
 * kernels/native_attention.py (the Python side checks every shape and dtype).
 *
 * One work item is a sequence (or, when there are few sequences for the threads, one kv
 * head of it; with threads, a prompt of more than Q_CHUNK queries is split by its queries
 * too): its nq query rows x g heads of each GQA group attend over the sequence's context.
 * Every key and value row is read from the pool and converted to fp32 once and used by all
 * nq * g query rows of its kv head, so the FP8 conversion costs one pass over the context
 * (inductor's fused loop converted each element once per query head). Scores
 * are kept for the whole context: exact softmax, no online rescaling.
 *
 * Layouts (row-major, contiguous):
 *   q        [T, hq, d] bf16 bits (q_kind 1) or fp32 (q_kind 2): the pools' kinds
 *   qk_scale [hkv] fp32 multiplies q.k (the softmax scale times k_scale)
 *   pools    [num_blocks, bs, hkv, d] uint8 E4M3 bytes (kind 0), bf16 bits (kind 1) or fp32
 *            (kind 2)
 *   tables   [num_seqs, table_stride] int64 physical block ids
 *   q_start  [num_seqs + 1] int64 first row of each sequence's queries in q
 *   seq_lens [num_seqs] int64 context length incl. the new tokens (stored already)
 *   skip     [num_seqs] uint8, 1 = leave this sequence's rows of out untouched (or NULL)
 *   v_scale  [hkv] fp32 multiplies the output (1 for float pools)
 *   out      [T, hq, d] fp32; only the values' first dv columns are accumulated (dv <= d;
 *            a latent cache (MLA) whose tail is the RoPE key, which is no value), the
 *            columns [dv, d) are 0
 * The queries of a sequence are its last nq positions: query i sits at position
 * seq_len - nq + i and sees key j iff j <= that position (causal) and, with window > 0,
 * position - j < window. softcap > 0 applies tanh(s / softcap) * softcap to the scores.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "e4m3.h"
#include "float_bits.h"
#include "vec_exp.h"

/* d elements of a pool row (or of q) -> fp32. E4M3 bytes decode by integer shifts
 * (e4m3_to_float_scaled, times 2^120: e4m3_to_float's exact values in four vector
 * instructions per 8 bytes; the callers clear DAZ: daz_off). */
static inline void load_row(const void *pool, int kind, int64_t offset, int64_t d,
                            float *restrict dst) {
    if (kind == 0) {
        const int8_t *p = (const int8_t *)pool + offset;
#pragma omp simd
        for (int64_t i = 0; i < d; i++)
            dst[i] = e4m3_to_float_scaled(p[i]) * 0x1p120f;
    } else if (kind == 1) {
        const uint16_t *p = (const uint16_t *)pool + offset;
#pragma omp simd
        for (int64_t i = 0; i < d; i++) dst[i] = bf16_to_float(p[i]);
    } else {
        memcpy(dst, (const float *)pool + offset, (size_t)d * sizeof(float));
    }
}

#define KEY_BLOCK 16 /* keys per block: one vector of 16 fp32 scores per query row */

/* Scores of every query row of one kv head against a block of nk <= KEY_BLOCK keys.
 * kt: the block's K rows of this head transposed, [d][KEY_BLOCK] (zero past nk). The sum
 * over d runs in 4 interleaved partial sums (element c goes to sum c % 4), added as
 * (s0 + s1) + (s2 + s3) at the end: no horizontal reduction, no single dependency chain. */
static inline void block_scores(const float *restrict qf, int64_t rows, int64_t d,
                                const float *restrict kt, int64_t nk, float *restrict out,
                                int64_t n) {
#ifdef HALF_LANES
    for (int64_t r = 0; r < rows; r++) { /* keys 0-7 and 8-15 of the block as two halves */
        const float *qr = qf + r * d;
        vf8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}, t0 = {0}, t1 = {0}, t2 = {0}, t3 = {0};
        int64_t c = 0;
        for (; c + 4 <= d; c += 4) {
            const float *k0 = kt + c * KEY_BLOCK;
            s0 += qr[c] * *(const vf8u *)k0;
            t0 += qr[c] * *(const vf8u *)(k0 + 8);
            s1 += qr[c + 1] * *(const vf8u *)(k0 + KEY_BLOCK);
            t1 += qr[c + 1] * *(const vf8u *)(k0 + KEY_BLOCK + 8);
            s2 += qr[c + 2] * *(const vf8u *)(k0 + 2 * KEY_BLOCK);
            t2 += qr[c + 2] * *(const vf8u *)(k0 + 2 * KEY_BLOCK + 8);
            s3 += qr[c + 3] * *(const vf8u *)(k0 + 3 * KEY_BLOCK);
            t3 += qr[c + 3] * *(const vf8u *)(k0 + 3 * KEY_BLOCK + 8);
        }
        for (; c < d; c++) {
            s0 += qr[c] * *(const vf8u *)(kt + c * KEY_BLOCK);
            t0 += qr[c] * *(const vf8u *)(kt + c * KEY_BLOCK + 8);
        }
        const vf8 lo = (s0 + s1) + (s2 + s3), hi = (t0 + t1) + (t2 + t3);
        for (int64_t jj = 0; jj < nk; jj++) out[r * n + jj] = jj < 8 ? lo[jj] : hi[jj - 8];
    }
    return;
#endif
    const vf16u *k = (const vf16u *)kt;
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) { /* 4 rows share each k[c] load; each row's sums as below */
        const float *q0 = qf + r * d, *q1 = q0 + d, *q2 = q1 + d, *q3 = q2 + d;
        vf16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
        vf16 c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0}, e0 = {0}, e1 = {0}, e2 = {0}, e3 = {0};
        int64_t c = 0;
        for (; c + 4 <= d; c += 4) {
            const vf16 k0 = k[c], k1 = k[c + 1], k2 = k[c + 2], k3 = k[c + 3];
            a0 += q0[c] * k0; a1 += q0[c + 1] * k1; a2 += q0[c + 2] * k2; a3 += q0[c + 3] * k3;
            b0 += q1[c] * k0; b1 += q1[c + 1] * k1; b2 += q1[c + 2] * k2; b3 += q1[c + 3] * k3;
            c0 += q2[c] * k0; c1 += q2[c + 1] * k1; c2 += q2[c + 2] * k2; c3 += q2[c + 3] * k3;
            e0 += q3[c] * k0; e1 += q3[c + 1] * k1; e2 += q3[c + 2] * k2; e3 += q3[c + 3] * k3;
        }
        for (; c < d; c++) {
            a0 += q0[c] * k[c]; b0 += q1[c] * k[c]; c0 += q2[c] * k[c]; e0 += q3[c] * k[c];
        }
        const vf16 ta = (a0 + a1) + (a2 + a3), tb = (b0 + b1) + (b2 + b3);
        const vf16 tc = (c0 + c1) + (c2 + c3), te = (e0 + e1) + (e2 + e3);
        for (int64_t jj = 0; jj < nk; jj++) {
            out[r * n + jj] = ta[jj];
            out[(r + 1) * n + jj] = tb[jj];
            out[(r + 2) * n + jj] = tc[jj];
            out[(r + 3) * n + jj] = te[jj];
        }
    }
    for (; r < rows; r++) {
        const float *qr = qf + r * d;
        vf16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
        int64_t c = 0;
        for (; c + 4 <= d; c += 4) {
            s0 += qr[c] * k[c];
            s1 += qr[c + 1] * k[c + 1];
            s2 += qr[c + 2] * k[c + 2];
            s3 += qr[c + 3] * k[c + 3];
        }
        for (; c < d; c++) s0 += qr[c] * k[c];
        const vf16 total = (s0 + s1) + (s2 + s3);
        for (int64_t jj = 0; jj < nk; jj++) out[r * n + jj] = total[jj];
    }
}

/* acc[0:d] += sum_jj p[jj] * v[jj * stride : + d] over nk rows, skipping p == 0: 64 lanes
 * of acc at a time stay in registers across the rows. */
static inline void add_weighted_rows(float *restrict acc, int64_t d, const float *restrict p,
                                     const float *restrict v, int64_t stride, int64_t nk) {
    int64_t c = 0;
#ifdef HALF_LANES
    for (; c + 64 <= d; c += 64) { /* the same 64 lanes as 8 registers of 8 */
        vf8 a[8];
        for (int h = 0; h < 8; h++) a[h] = *(vf8u *)(acc + c + 8 * h);
        for (int64_t jj = 0; jj < nk; jj++) {
            if (p[jj] == 0.0f) continue;
            const float pj = p[jj], *vr = v + jj * stride + c;
            for (int h = 0; h < 8; h++) a[h] += pj * *(const vf8u *)(vr + 8 * h);
        }
        for (int h = 0; h < 8; h++) *(vf8u *)(acc + c + 8 * h) = a[h];
    }
#endif
    for (; c + 64 <= d; c += 64) {
        vf16 a0 = *(vf16u *)(acc + c), a1 = *(vf16u *)(acc + c + 16);
        vf16 a2 = *(vf16u *)(acc + c + 32), a3 = *(vf16u *)(acc + c + 48);
        for (int64_t jj = 0; jj < nk; jj++) {
            if (p[jj] == 0.0f) continue;
            const float pj = p[jj], *vr = v + jj * stride + c;
            a0 += pj * *(const vf16u *)vr;
            a1 += pj * *(const vf16u *)(vr + 16);
            a2 += pj * *(const vf16u *)(vr + 32);
            a3 += pj * *(const vf16u *)(vr + 48);
        }
        *(vf16u *)(acc + c) = a0;
        *(vf16u *)(acc + c + 16) = a1;
        *(vf16u *)(acc + c + 32) = a2;
        *(vf16u *)(acc + c + 48) = a3;
    }
    if (c < d) /* head sizes that are not a multiple of 64 */
        for (int64_t jj = 0; jj < nk; jj++) {
            if (p[jj] == 0.0f) continue;
            const float pj = p[jj], *vr = v + jj * stride;
#pragma omp simd
            for (int64_t cc = c; cc < d; cc++) acc[cc] += pj * vr[cc];
        }
}

#ifndef HALF_LANES
/* add_weighted_rows for 4 query rows at once (acc and p rows acc_stride and p_stride
 * apart, d a multiple of 64): each V row's 64 lanes are loaded once for the 4 rows. Every
 * row adds the same products in the same key order as add_weighted_rows, skipping its own
 * p == 0, so each row's sums are the same bits. */
static inline void add_weighted_rows4(float *restrict acc, int64_t acc_stride, int64_t d,
                                      const float *restrict p, int64_t p_stride,
                                      const float *restrict v, int64_t stride, int64_t nk) {
    for (int64_t c = 0; c < d; c += 64) {
        vf16 a[4][4];
        for (int r = 0; r < 4; r++)
            for (int h = 0; h < 4; h++) a[r][h] = *(vf16u *)(acc + r * acc_stride + c + 16 * h);
        for (int64_t jj = 0; jj < nk; jj++) {
            const float p0 = p[jj], p1 = p[p_stride + jj], p2 = p[2 * p_stride + jj],
                        p3 = p[3 * p_stride + jj];
            const float *vr = v + jj * stride + c;
            const vf16 v0 = *(const vf16u *)vr, v1 = *(const vf16u *)(vr + 16);
            const vf16 v2 = *(const vf16u *)(vr + 32), v3 = *(const vf16u *)(vr + 48);
            if (p0 != 0.0f && p1 != 0.0f && p2 != 0.0f && p3 != 0.0f) {
                a[0][0] += p0 * v0; a[0][1] += p0 * v1; a[0][2] += p0 * v2; a[0][3] += p0 * v3;
                a[1][0] += p1 * v0; a[1][1] += p1 * v1; a[1][2] += p1 * v2; a[1][3] += p1 * v3;
                a[2][0] += p2 * v0; a[2][1] += p2 * v1; a[2][2] += p2 * v2; a[2][3] += p2 * v3;
                a[3][0] += p3 * v0; a[3][1] += p3 * v1; a[3][2] += p3 * v2; a[3][3] += p3 * v3;
                continue;
            }
            const float pr[4] = {p0, p1, p2, p3};
            for (int r = 0; r < 4; r++) {
                if (pr[r] == 0.0f) continue;
                a[r][0] += pr[r] * v0; a[r][1] += pr[r] * v1;
                a[r][2] += pr[r] * v2; a[r][3] += pr[r] * v3;
            }
        }
        for (int r = 0; r < 4; r++)
            for (int h = 0; h < 4; h++) *(vf16u *)(acc + r * acc_stride + c + 16 * h) = a[r][h];
    }
}
#endif

/* Key blocks the passes over K and over V fetch ahead, into L2. A block's rows lie in one
 * place of the pool and the next block anywhere (block tables), so the hardware
 * prefetchers stop at each block's end and a pass over a context that is not in cache
 * waited on memory (a 1,024-token context read cold: ~2/3 of the time in the loads).
 * Measured (runtime/benchmark/attention.py --cold, docs/kernels.md): 4 blocks ahead into
 * L2 beat 1-16 blocks and L1. */
#define PREFETCH_BLOCKS 4

/* Bytes per element of a pool of this kind (E4M3, bf16, fp32). */
static inline int64_t pool_elem_bytes(int kind) { return kind == 0 ? 1 : kind == 1 ? 2 : 4; }

/* Prefetch the rows of tokens [j0, j0 + KEY_BLOCK) below seq_len (none when j0 >=
 * seq_len), kv heads [h0, h0 + width / d): one run of cache lines per pool block they
 * touch. */
static inline void prefetch_block(const void *pool, int kind, int64_t bs, int64_t hkv,
                                  int64_t d, const int64_t *table, int64_t h0, int64_t width,
                                  int64_t j0, int64_t seq_len) {
    const int64_t esize = pool_elem_bytes(kind);
    const int64_t end = j0 + KEY_BLOCK < seq_len ? j0 + KEY_BLOCK : seq_len;
    for (int64_t j = j0; j < end;) {
        const int64_t off = j % bs, run = bs - off < end - j ? bs - off : end - j;
        const char *p = (const char *)pool + ((table[j / bs] * bs + off) * hkv + h0) * d * esize;
        const int64_t bytes = ((run - 1) * hkv * d + width) * esize;
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
        j += run;
    }
}

/* Tokens [j0, j0 + nk) of a sequence, kv heads [h0, h0 + width / d), converted to fp32
 * [nk, width] in `block`, nk = min(KEY_BLOCK, seq_len - j0); returns nk. */
static inline int64_t load_block(const void *pool, int kind, int64_t bs, int64_t hkv,
                                 int64_t d, const int64_t *table, int64_t h0, int64_t width,
                                 int64_t j0, int64_t seq_len, float *block) {
    const int64_t nk = seq_len - j0 < KEY_BLOCK ? seq_len - j0 : KEY_BLOCK;
    for (int64_t jj = 0; jj < nk; jj++) {
        const int64_t j = j0 + jj;
        load_row(pool, kind, ((table[j / bs] * bs + j % bs) * hkv + h0) * d, width,
                 block + jj * width);
    }
    return nk;
}

/* A block's K rows transposed, kt [width][KEY_BLOCK] fp32 (zero past nk): what
 * load_block followed by a transpose gives, element for element. */
static void load_block_kt(const void *pool, int kind, int64_t bs, int64_t hkv, int64_t d,
                          const int64_t *table, int64_t h0, int64_t width, int64_t j0,
                          int64_t nk, float *block, float *kt) {
#if defined(__AVX2__)
    /* E4M3 or bf16 pools, width a multiple of 8: 8 tokens x 8 elements at a time,
     * converted as load_row converts them (E4M3: decode8_avx2 times 2^120; bf16:
     * the bits shifted to the top half; the same values) and transposed in registers. The
     * scalar transpose measured ~30% of a 16-sequence decode step's attention. */
    if ((kind == 0 || kind == 1) && width % 8 == 0) {
        const __m256 up = _mm256_set1_ps(0x1p120f);
        for (int64_t t0 = 0; t0 < KEY_BLOCK; t0 += 8) {
            const char *row[8]; /* each token's first element of head h0 */
            for (int t = 0; t < 8; t++) {
                const int64_t j = j0 + t0 + t;
                row[t] = t0 + t < nk
                             ? (const char *)pool + ((table[j / bs] * bs + j % bs) * hkv + h0) * d
                                                        * pool_elem_bytes(kind)
                             : NULL;
            }
            for (int64_t c = 0; c < width; c += 8) {
                __m256 r[8];
                for (int t = 0; t < 8; t++) {
                    if (row[t] == NULL) {
                        r[t] = _mm256_setzero_ps();
                        continue;
                    }
                    if (kind == 0) {
                        r[t] = _mm256_mul_ps(decode8_avx2(row[t] + c), up);
                    } else {
                        const __m256i v = _mm256_cvtepu16_epi32(
                            _mm_loadu_si128((const __m128i *)(row[t] + 2 * c)));
                        r[t] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                    }
                }
                const __m256 a0 = _mm256_unpacklo_ps(r[0], r[1]), a1 = _mm256_unpackhi_ps(r[0], r[1]);
                const __m256 a2 = _mm256_unpacklo_ps(r[2], r[3]), a3 = _mm256_unpackhi_ps(r[2], r[3]);
                const __m256 a4 = _mm256_unpacklo_ps(r[4], r[5]), a5 = _mm256_unpackhi_ps(r[4], r[5]);
                const __m256 a6 = _mm256_unpacklo_ps(r[6], r[7]), a7 = _mm256_unpackhi_ps(r[6], r[7]);
                const __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xEE);
                const __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xEE);
                const __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xEE);
                const __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xEE);
                float *dst = kt + c * KEY_BLOCK + t0; /* element c + e goes to row c + e */
                _mm256_storeu_ps(dst + 0 * KEY_BLOCK, _mm256_permute2f128_ps(b0, b4, 0x20));
                _mm256_storeu_ps(dst + 1 * KEY_BLOCK, _mm256_permute2f128_ps(b1, b5, 0x20));
                _mm256_storeu_ps(dst + 2 * KEY_BLOCK, _mm256_permute2f128_ps(b2, b6, 0x20));
                _mm256_storeu_ps(dst + 3 * KEY_BLOCK, _mm256_permute2f128_ps(b3, b7, 0x20));
                _mm256_storeu_ps(dst + 4 * KEY_BLOCK, _mm256_permute2f128_ps(b0, b4, 0x31));
                _mm256_storeu_ps(dst + 5 * KEY_BLOCK, _mm256_permute2f128_ps(b1, b5, 0x31));
                _mm256_storeu_ps(dst + 6 * KEY_BLOCK, _mm256_permute2f128_ps(b2, b6, 0x31));
                _mm256_storeu_ps(dst + 7 * KEY_BLOCK, _mm256_permute2f128_ps(b3, b7, 0x31));
            }
        }
        return;
    }
#endif
    load_block(pool, kind, bs, hkv, d, table, h0, width, j0, j0 + nk, block);
    for (int64_t hd = 0; hd < width; hd++) { /* [nk, width] -> [width, KEY_BLOCK] */
        float *dst = kt + hd * KEY_BLOCK;
        int64_t jj = 0;
        for (; jj < nk; jj++) dst[jj] = block[jj * width + hd];
        for (; jj < KEY_BLOCK; jj++) dst[jj] = 0.0f;
    }
}

/* One sequence, kv heads [h0, h1). scratch: nh * rows * n scores, nh * rows * d
 * accumulators, nh * rows * d scaled fp32 queries, KEY_BLOCK * nh * d for a block of
 * tokens' converted K or V rows, nh * d * KEY_BLOCK for the block's K transposed. Keys go
 * in blocks of KEY_BLOCK tokens and the heads of a token are read together: a token's K
 * (or V) rows of all kv heads are contiguous in the pool, so each cache line is read once
 * (a pass per head re-read every block's lines per head and measured ~1.7x slower between
 * other work). Per block, q . k runs as a small matrix product over the block's keys (no
 * dot product per key and row), and p . v adds each converted V row into every query row's
 * accumulator. */
static void attend(const void *q, int q_kind, const float *qk_scale, int64_t hq, int64_t d,
                   int64_t dv,
                   const void *k_pool, const void *v_pool, int kind, int64_t bs, int64_t hkv,
                   const int64_t *table, int64_t q0, int64_t nq, int64_t seq_len, int64_t h0,
                   int64_t h1, int64_t window, float softcap, const float *v_scale, float *out,
                   float *scratch) {
    const int64_t g = hq / hkv, nh = h1 - h0;
    const int64_t rows = nq * g; /* query rows per kv head */
    const int64_t first_pos = seq_len - nq; /* position of query 0 */
    int64_t lo = 0;                         /* first key any query sees */
    if (window > 0 && first_pos - window + 1 > 0) lo = first_pos - window + 1;
    const int64_t n = seq_len - lo, width = nh * d;
    float *scores = scratch;               /* [nh, rows, n] */
    float *acc = scores + nh * rows * n;   /* [nh, rows, d] */
    float *qf = acc + nh * rows * d;       /* [nh, rows, d] queries times qk_scale */
    float *block = qf + nh * rows * d;     /* [KEY_BLOCK, nh, d] a block's converted rows */
    float *kt = block + KEY_BLOCK * width; /* [nh, d, KEY_BLOCK] the block's K, transposed */
    memset(acc, 0, (size_t)(nh * rows * d) * sizeof(float));
    for (int64_t hh = 0; hh < nh; hh++) {
        for (int64_t i = 0; i < nq; i++) { /* query i's g heads are contiguous in q */
            float *dst = qf + (hh * rows + i * g) * d;
            load_row(q, q_kind, ((q0 + i) * hq + (h0 + hh) * g) * d, g * d, dst);
            const float sc = qk_scale[h0 + hh];
#pragma omp simd
            for (int64_t c = 0; c < g * d; c++) dst[c] *= sc;
        }
    }

    /* q . k for every key in reach (keys a query may not see are masked below) */
    for (int64_t b = 0; b < PREFETCH_BLOCKS; b++)
        prefetch_block(k_pool, kind, bs, hkv, d, table, h0, width, lo + b * KEY_BLOCK, seq_len);
    for (int64_t j0 = lo; j0 < seq_len; j0 += KEY_BLOCK) {
        const int64_t nk = seq_len - j0 < KEY_BLOCK ? seq_len - j0 : KEY_BLOCK;
        prefetch_block(k_pool, kind, bs, hkv, d, table, h0, width,
                       j0 + PREFETCH_BLOCKS * KEY_BLOCK, seq_len);
        load_block_kt(k_pool, kind, bs, hkv, d, table, h0, width, j0, nk, block, kt);
        /* causal: the rows of queries before the block's first key see none of it (their
         * scores there stay unwritten; the softmax below zeroes what a row does not see) */
        const int64_t r0 = (j0 > first_pos ? j0 - first_pos : 0) * g;
        for (int64_t hh = 0; hh < nh; hh++)
            block_scores(qf + (hh * rows + r0) * d, rows - r0, d, kt + hh * d * KEY_BLOCK, nk,
                         scores + (hh * rows + r0) * n + (j0 - lo), n);
    }
    /* softmax of each query row over the keys it sees; the rest get probability 0 */
    for (int64_t hh = 0; hh < nh; hh++) {
        for (int64_t i = 0; i < nq; i++) {
            const int64_t pos = first_pos + i;
            int64_t a = lo;
            if (window > 0 && pos - window + 1 > a) a = pos - window + 1;
            const int64_t from = a - lo, to = pos - lo + 1; /* visible [from, to) */
            for (int64_t r = 0; r < g; r++) {
                float *sr = scores + (hh * rows + i * g + r) * n;
                if (softcap > 0.0f)
                    for (int64_t t = from; t < to; t++)
                        sr[t] = tanhf(sr[t] / softcap) * softcap;
                float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
                for (int64_t t = from; t < to; t++) mx = sr[t] > mx ? sr[t] : mx;
                float sum = 0.0f;
                int64_t t = from;
#ifdef HALF_LANES
                vf8 lanes_lo = {0}, lanes_hi = {0};
                for (; t + 16 <= to; t += 16) {
                    const vf8 e0 = exp_nonpositive8(*(vf8u *)(sr + t) - mx);
                    const vf8 e1 = exp_nonpositive8(*(vf8u *)(sr + t + 8) - mx);
                    *(vf8u *)(sr + t) = e0;
                    *(vf8u *)(sr + t + 8) = e1;
                    lanes_lo += e0;
                    lanes_hi += e1;
                }
#else
                vf16 lanes = {0};
                for (; t + 16 <= to; t += 16) {
                    const vf16 e = exp_nonpositive16(*(vf16u *)(sr + t) - mx);
                    *(vf16u *)(sr + t) = e;
                    lanes += e;
                }
#endif
                for (; t < to; t++) {
                    const float e = exp_nonpositive(sr[t] - mx);
                    sr[t] = e;
                    sum += e;
                }
#ifdef HALF_LANES
                for (int l = 0; l < 8; l++) sum += lanes_lo[l];
                for (int l = 0; l < 8; l++) sum += lanes_hi[l];
#else
                for (int l = 0; l < 16; l++) sum += lanes[l];
#endif
                for (int64_t t = 0; t < from; t++) sr[t] = 0.0f;
                for (int64_t t = to; t < n; t++) sr[t] = 0.0f;
                const float inv = v_scale[h0 + hh] / sum;
#pragma omp simd
                for (int64_t t = from; t < to; t++) sr[t] *= inv;
            }
        }
    }
    /* p . v: a block of tokens' converted V rows feed every query row of their heads */
    for (int64_t b = 0; b < PREFETCH_BLOCKS; b++)
        prefetch_block(v_pool, kind, bs, hkv, d, table, h0, width, lo + b * KEY_BLOCK, seq_len);
    for (int64_t j0 = lo; j0 < seq_len; j0 += KEY_BLOCK) {
        prefetch_block(v_pool, kind, bs, hkv, d, table, h0, width,
                       j0 + PREFETCH_BLOCKS * KEY_BLOCK, seq_len);
        const int64_t nk = load_block(v_pool, kind, bs, hkv, d, table, h0, width, j0,
                                      seq_len, block);
        const int64_t r0 = (j0 > first_pos ? j0 - first_pos : 0) * g; /* p = 0 above r0 */
        for (int64_t hh = 0; hh < nh; hh++) {
            int64_t r = r0;
#ifndef HALF_LANES
            if (dv % 64 == 0)
                for (; r + 4 <= rows; r += 4)
                    add_weighted_rows4(acc + (hh * rows + r) * d, d, dv,
                                       scores + (hh * rows + r) * n + (j0 - lo), n,
                                       block + hh * d, width, nk);
#endif
            for (; r < rows; r++)
                add_weighted_rows(acc + (hh * rows + r) * d, dv,
                                  scores + (hh * rows + r) * n + (j0 - lo), block + hh * d,
                                  width, nk);
        }
    }
    for (int64_t hh = 0; hh < nh; hh++)
        for (int64_t i = 0; i < nq; i++)
            memcpy(out + ((q0 + i) * hq + (h0 + hh) * g) * d, acc + (hh * rows + i * g) * d,
                   (size_t)(g * d) * sizeof(float));
}

/* Queries per work item of a long prompt when threads share the call: a prompt's query
 * rows split into chunks of this many, each attending to the keys its last row sees, so
 * that one long prompt spreads over the threads (as kv heads alone, 3 on SmolLM2, do not
 * over 2 threads). Every query row's scores, softmax and p . v are the same operations in
 * any chunk (per row, in key order), so the output is the same bits. */
#define Q_CHUNK 64

/* Query chunks a sequence of nq new tokens is walked in (one unless nq > Q_CHUNK). */
static inline int64_t query_chunks(int64_t nq) {
    return nq > Q_CHUNK ? (nq + Q_CHUNK - 1) / Q_CHUNK : 1;
}

/* Work item: sequence b, kv heads [part * hkv / per, ...) with per = 1 (whole sequences)
 * or hkv (one head each, to spread few sequences over threads), and queries
 * [chunk * Q_CHUNK, ...) of the sequence's (chunk 0 and chunked = 0: all of them).
 * Returns 0, or -1 when its scratch allocation failed. */
static int run_item(int64_t b, int64_t part, int64_t per, int64_t chunk, int chunked,
                    const void *q, int q_kind,
                    const float *qk_scale, int64_t hq, int64_t d, const void *k_pool,
                    const void *v_pool, int kind, int64_t bs, int64_t hkv,
                    const int64_t *tables, int64_t table_stride, const int64_t *q_start,
                    const int64_t *seq_lens, const uint8_t *skip, int64_t window,
                    float softcap, const float *v_scale, float *out, int64_t dv) {
    const int64_t h0 = part * hkv / per, h1 = (part + 1) * hkv / per;
    int64_t q0 = q_start[b], nq = q_start[b + 1] - q0, seq_len = seq_lens[b];
    if ((skip && skip[b]) || nq <= 0) return 0;
    if (chunked) { /* queries [c0, c1) of the nq; the keys up to the last one's position */
        const int64_t c0 = chunk * Q_CHUNK, c1 = c0 + Q_CHUNK < nq ? c0 + Q_CHUNK : nq;
        seq_len -= nq - c1;
        q0 += c0;
        nq = c1 - c0;
    }
    const int64_t nh = h1 - h0, rows = nq * (hq / hkv);
    const size_t floats = (size_t)(nh * rows * seq_len + 2 * nh * rows * d
                                   + 2 * KEY_BLOCK * nh * d);
    float *scratch = (float *)malloc(floats * sizeof(float));
    if (!scratch) return -1;
    const unsigned csr = daz_off();
    attend(q, q_kind, qk_scale, hq, d, dv, k_pool, v_pool, kind, bs, hkv,
           tables + b * table_stride, q0, nq, seq_len, h0, h1, window, softcap, v_scale, out,
           scratch);
    restore_csr(csr);
    free(scratch);
    return 0;
}

/* Returns 0, or -1 when a scratch allocation failed (out is then incomplete). One thread
 * runs without entering OpenMP (a parallel region costs ~20 us per call here). */
int qserve_paged_attention_cpu(const void *q, int q_kind, const float *qk_scale, int64_t hq,
                               int64_t d, const void *k_pool, const void *v_pool, int kind,
                               int64_t bs, int64_t hkv, const int64_t *tables,
                               int64_t table_stride, const int64_t *q_start,
                               const int64_t *seq_lens, const uint8_t *skip, int64_t num_seqs,
                               int64_t window, float softcap, const float *v_scale, float *out,
                               int num_threads, int64_t dv) {
    int failed = 0;
    if (dv <= 0 || dv > d) dv = d;
    if (num_threads <= 1) {
        /* a prompt of more than Q_CHUNK queries in chunks here too (the same bits): the
         * score rows of a chunk stay in cache, and a chunk reads only the keys its last
         * query sees (one 1,024-token chunk measured 60 ms whole, see docs/kernels.md) */
        for (int64_t b = 0; b < num_seqs; b++) {
            const int64_t chunks = query_chunks(q_start[b + 1] - q_start[b]);
            for (int64_t c = 0; c < chunks; c++)
                failed |= run_item(b, 0, 1, c, chunks > 1, q, q_kind, qk_scale, hq, d, k_pool,
                                   v_pool, kind, bs, hkv, tables, table_stride, q_start,
                                   seq_lens, skip, window, softcap, v_scale, out, dv);
        }
        return failed ? -1 : 0;
    }
    const int64_t per = num_seqs >= 2 * num_threads ? 1 : hkv; /* enough items per thread */
    /* first[b]: sequence b's first item; a prompt of more than Q_CHUNK queries has per
     * items for each chunk of them */
    int64_t *first = (int64_t *)malloc((size_t)(num_seqs + 1) * sizeof(int64_t));
    if (!first) return -1;
    first[0] = 0;
    for (int64_t b = 0; b < num_seqs; b++)
        first[b + 1] = first[b] + per * query_chunks(q_start[b + 1] - q_start[b]);
    const int64_t items = first[num_seqs];
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
    for (int64_t it = 0; it < items; it++) {
        int64_t lo = 0, hi = num_seqs; /* the sequence: first[lo] <= it < first[lo + 1] */
        while (hi - lo > 1) {
            const int64_t mid = (lo + hi) / 2;
            if (first[mid] <= it) lo = mid; else hi = mid;
        }
        const int64_t b = lo;
        const int64_t local = it - first[b], chunks = (first[b + 1] - first[b]) / per;
        /* the last chunks (the most keys) first: the dynamic schedule ends on short ones */
        failed |= run_item(b, local % per, per, chunks - 1 - local / per, chunks > 1, q, q_kind,
                           qk_scale, hq, d, k_pool, v_pool, kind, bs, hkv, tables,
                           table_stride, q_start, seq_lens, skip, window, softcap, v_scale,
                           out, dv);
    }
    free(first);
    return failed ? -1 : 0;
}

/* A sequence's cached tokens [first, first + n) as one contiguous [n, hkv, d] tensor of
 * fp32 (out_kind 0) or bf16 (out_kind 1: exact for E4M3 and bf16 pools, rounded to nearest
 * even from fp32 pools), for the prompt path's SDPA: the one pass over the prefix that
 * eager torch makes ~3x slower per chunk. Tokens are whole rows of hkv * d elements,
 * contiguous within a block. */
void qserve_gather_context(const void *pool, int kind, int64_t bs, int64_t hkv, int64_t d,
                           const int64_t *table, int64_t first, int64_t n, int out_kind,
                           void *out) {
    const int64_t width = hkv * d;
    float tmp[1024];
    const unsigned csr = daz_off();
    for (int64_t t = 0; t < n;) {
        const int64_t pos = first + t, blk = table[pos / bs], off = pos % bs;
        int64_t run = bs - off; /* tokens left in this block */
        if (run > n - t) run = n - t;
        const int64_t src = (blk * bs + off) * width, count = run * width;
        for (int64_t c = 0; c < count; c += 1024) {
            const int64_t m = count - c < 1024 ? count - c : 1024;
            if (out_kind == 0) {
                load_row(pool, kind, src + c, m, (float *)out + t * width + c);
            } else {
                uint16_t *o = (uint16_t *)out + t * width + c;
                load_row(pool, kind, src + c, m, tmp);
#pragma omp simd
                for (int64_t i = 0; i < m; i++) o[i] = bf16_round(tmp[i]);
            }
        }
        t += run;
    }
    restore_csr(csr);
}
