/* Structured outputs' token mask on fp32 logits on CPU (kernels/native_token_bitmask.py).
 *
 * qserve_apply_token_bitmask: for each listed row r, logits[r, t] = -inf wherever bit t
 *     (bit t % 32 of 32-bit word t / 32, least significant first) of bitmask[r] is 0,
 *     for t < vocab; everything else is left as it is. `rows` holds row indices into both.
 *
 * A grammar allows few tokens at most steps (a JSON key, a digit, a quote): whole words of
 * zeros become a run of -inf stores, whole words of ones are skipped, so a row costs about
 * one pass over its 4-byte words. Exact: only stores of -inf.
 */

#include <math.h>
#include <stdint.h>

void qserve_apply_token_bitmask(float *logits, int64_t logits_stride, const int32_t *bitmask,
                                int64_t bitmask_stride, int64_t vocab, const int64_t *rows,
                                int64_t num_rows) {
    const float neg_inf = -INFINITY;
    const int64_t words = (vocab + 31) / 32;
    for (int64_t i = 0; i < num_rows; i++) {
        float *x = logits + rows[i] * logits_stride;
        const uint32_t *m = (const uint32_t *)(bitmask + rows[i] * bitmask_stride);
        for (int64_t w = 0; w < words; w++) {
            const uint32_t bits = m[w];
            if (bits == 0xFFFFFFFFu)
                continue;
            const int64_t base = w * 32;
            const int64_t n = vocab - base < 32 ? vocab - base : 32;
            if (bits == 0) {
                for (int64_t j = 0; j < n; j++)
                    x[base + j] = neg_inf;
                continue;
            }
            for (int64_t j = 0; j < n; j++)
                if (!((bits >> j) & 1u))
                    x[base + j] = neg_inf;
        }
    }
}
