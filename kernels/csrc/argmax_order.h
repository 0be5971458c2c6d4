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

#endif
