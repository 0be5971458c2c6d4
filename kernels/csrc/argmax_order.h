/* torch.argmax's order, for the C kernels that find greedy tokens without writing logits. */
#ifndef QSERVE_ARGMAX_ORDER_H
#define QSERVE_ARGMAX_ORDER_H

#include <stdint.h>

/* Whether output v of channel n comes before the best so far (bv of channel bn; bn < 0:
 * none yet) in torch.argmax's order: the larger value; of equal values the lower channel;
 * NaN above every number, the lowest NaN channel first. Independent of the order channels
 * arrive in, so the threads' results reduce to the same channel whatever the split. */
static inline int beats(float v, int64_t n, float bv, int64_t bn) {
    if (bn < 0)
        return 1;
    if (v != v) /* NaN */
        return bv == bv || n < bn;
    if (bv != bv)
        return 0;
    return v > bv || (v == bv && n < bn);
}

/* The threads' bests of each of m rows ([slots, per] each, index -1: that thread saw no
 * channel), reduced in torch.argmax's order into out_ids [m] and out_values [m]. */
static inline void reduce_bests(const float *best_value, const int64_t *best_index,
                                int64_t slots, int64_t per, int64_t m, int64_t *out_ids,
                                float *out_values) {
    for (int64_t i = 0; i < m; i++) {
        float v = 0.0f;
        int64_t at = -1;
        for (int64_t t = 0; t < slots; t++) {
            const int64_t c = best_index[t * per + i];
            if (c >= 0 && beats(best_value[t * per + i], c, v, at)) {
                v = best_value[t * per + i];
                at = c;
            }
        }
        out_ids[i] = at;
        out_values[i] = v;
    }
}

#endif
