/* A step program: a list of kernel calls run back to back by one call from Python.
 *
 * The C decode path (runtime/models/native_decoder.py) lowers a model's layers to ~14 C
 * calls per layer. Made one by one through ctypes, each costs its argument marshalling and
 * an interpreter line (~1-2 us), while the other OpenMP thread spins; a SmolLM2 decode step
 * makes ~420 of them. Here the calls are data: each op names a kernel (OP_* below, with a
 * trampoline that passes the arguments in the kernel's own types) and its entry point, and
 * every integer or pointer argument is affine in the step's values:
 *
 *     arg[j] = (var[j] < 0 ? 0 : vars[var[j]]) * mul[j] + add[j]      (int64)
 *     farg[j]                                                          (float literal)
 *
 * so "the step's token count times 576" or "the qkv scratch plus 1152 bytes" are written
 * once at build and resolved per step from `vars` (the token count, the scratch and metadata
 * pointers, the thread count). The kernels are the other csrc libraries' exported entry
 * points, passed in by address; their signatures are restated in the trampolines below,
 * checked against the ctypes signatures by tests/kernels/test_native_step_program.py.
 */
#include <stdint.h>

#define MAX_ARGS 24

enum {
    OP_FP8_GEMV = 0,       /* qserve_fp8_gemv_bf16 (returns nonzero on failure) */
    OP_FP8_GEMV_WONLY = 1, /* qserve_fp8_gemv_wonly_bf16 (same; also the int8 entries of
                            * the same signature: qserve_int8_gemv_wonly_bf16,
                            * qserve_int8_gemm_bf16) */
    OP_RMS_NORM = 2,       /* qserve_rms_norm_bf16 */
    OP_ROTARY = 3,         /* qserve_rotary_bf16 */
    OP_STORE_KV = 4,       /* qserve_store_kv */
    OP_ATTENTION = 5,      /* qserve_paged_attention_cpu (returns nonzero on failure) */
    OP_ADD = 6,            /* qserve_add_bf16 */
    OP_ADD_ROWS = 7,       /* qserve_add_rows_bf16 */
    OP_ACT_MUL = 8,        /* qserve_act_mul_bf16 */
    OP_ROUND = 9,          /* qserve_round_bf16 */
    OP_BF16_GEMV = 10,     /* qserve_bf16_gemv (returns nonzero on failure) */
    OP_COPY_ROWS = 11,     /* qserve_copy_rows_bf16 */
    OP_DEINTERLEAVE_ROWS = 12, /* qserve_deinterleave_rows_bf16 */
    OP_BF16_GEMV_HEADS = 13,   /* qserve_bf16_gemv_heads (returns nonzero on failure) */
};

typedef struct {
    int32_t kind; /* OP_* */
    int32_t nargs;
    void *fn;     /* the kernel's entry point */
    int32_t var[MAX_ARGS];
    int64_t mul[MAX_ARGS];
    int64_t add[MAX_ARGS];
    float farg[MAX_ARGS];
} Op;

typedef int (*fp8_gemv_fn)(const void *, int64_t, int64_t, int64_t, float, const void *,
                           int64_t, const void *, int64_t, void *, int64_t, int);
typedef int (*fp8_gemv_wonly_fn)(const void *, int64_t, int64_t, int64_t, const void *, int64_t,
                                 const void *, int64_t, void *, int64_t, int);
typedef void (*rms_norm_fn)(const void *, int64_t, int64_t, int64_t, const void *, float, int,
                            void *, int);
typedef void (*rotary_fn)(const void *, int64_t, int64_t, int64_t, int64_t, const void *,
                          const void *, void *);
typedef void (*store_kv_fn)(const void *, int64_t, const void *, int64_t, int64_t, int64_t,
                            int64_t, const void *, int, const void *, const void *, int64_t,
                            void *, void *);
typedef int (*attention_fn)(const void *, int, const void *, int64_t, int64_t, const void *,
                            const void *, int, int64_t, int64_t, const void *, int64_t,
                            const void *, const void *, const void *, int64_t, int64_t, float,
                            const void *, void *, int, int64_t);
typedef void (*add_fn)(void *, const void *, int64_t);
typedef void (*add_rows_fn)(void *, const void *, int64_t, int64_t);
typedef void (*act_mul_fn)(const void *, int64_t, int64_t, int, void *, int);
typedef void (*round_fn)(const void *, int64_t, void *);
typedef void (*copy_rows_fn)(const void *, int64_t, int64_t, int64_t, void *, int64_t);
typedef int (*bf16_gemv_heads_fn)(const void *, int64_t, int64_t, int64_t, int64_t, const void *,
                                  int64_t, void *, int64_t, int64_t, int64_t, int);
typedef int (*bf16_gemv_fn)(const void *, int64_t, int64_t, int64_t, const void *, int64_t,
                            const void *, void *, int64_t, int);

/* the number of arguments each kind takes (checked when a program is built) */
int32_t qserve_step_op_nargs(int32_t kind) {
    static const int32_t nargs[] = {12, 11, 9, 8, 14, 22, 3, 4, 6, 3, 10, 6, 6, 12};
    return kind >= 0 && kind < (int32_t)(sizeof nargs / sizeof nargs[0]) ? nargs[kind] : -1;
}

/* Runs ops[begin, end) in order. Returns -1, or the index of the op whose kernel failed
 * (the ops after it are not run). */
int64_t qserve_run_step(const Op *ops, int64_t begin, int64_t end, const int64_t *vars) {
    for (int64_t i = begin; i < end; i++) {
        const Op *op = &ops[i];
        int64_t a[MAX_ARGS];
        for (int j = 0; j < op->nargs; j++)
            a[j] = (op->var[j] < 0 ? 0 : vars[op->var[j]]) * op->mul[j] + op->add[j];
        const float *f = op->farg;
#define P(j) ((void *)(intptr_t)a[j])
        int rc = 0;
        switch (op->kind) {
        case OP_FP8_GEMV:
            rc = ((fp8_gemv_fn)op->fn)(P(0), a[1], a[2], a[3], f[4], P(5), a[6], P(7), a[8],
                                       P(9), a[10], (int)a[11]);
            break;
        case OP_FP8_GEMV_WONLY:
            rc = ((fp8_gemv_wonly_fn)op->fn)(P(0), a[1], a[2], a[3], P(4), a[5], P(6), a[7],
                                             P(8), a[9], (int)a[10]);
            break;
        case OP_RMS_NORM:
            ((rms_norm_fn)op->fn)(P(0), a[1], a[2], a[3], P(4), f[5], (int)a[6], P(7),
                                  (int)a[8]);
            break;
        case OP_ROTARY:
            ((rotary_fn)op->fn)(P(0), a[1], a[2], a[3], a[4], P(5), P(6), P(7));
            break;
        case OP_STORE_KV:
            ((store_kv_fn)op->fn)(P(0), a[1], P(2), a[3], a[4], a[5], a[6], P(7), (int)a[8],
                                  P(9), P(10), a[11], P(12), P(13));
            break;
        case OP_ATTENTION:
            rc = ((attention_fn)op->fn)(P(0), (int)a[1], P(2), a[3], a[4], P(5), P(6),
                                        (int)a[7], a[8], a[9], P(10), a[11], P(12), P(13),
                                        P(14), a[15], a[16], f[17], P(18), P(19), (int)a[20],
                                        a[21]);
            break;
        case OP_ADD:
            ((add_fn)op->fn)(P(0), P(1), a[2]);
            break;
        case OP_ADD_ROWS:
            ((add_rows_fn)op->fn)(P(0), P(1), a[2], a[3]);
            break;
        case OP_ACT_MUL:
            ((act_mul_fn)op->fn)(P(0), a[1], a[2], (int)a[3], P(4), (int)a[5]);
            break;
        case OP_ROUND:
            ((round_fn)op->fn)(P(0), a[1], P(2));
            break;
        case OP_BF16_GEMV_HEADS:
            rc = ((bf16_gemv_heads_fn)op->fn)(P(0), a[1], a[2], a[3], a[4], P(5), a[6], P(7), a[8],
                                              a[9], a[10], (int)a[11]);
            break;
        case OP_BF16_GEMV:
            rc = ((bf16_gemv_fn)op->fn)(P(0), a[1], a[2], a[3], P(4), a[5], P(6), P(7), a[8],
                                        (int)a[9]);
            break;
        case OP_COPY_ROWS:
        case OP_DEINTERLEAVE_ROWS: /* the same signature */
            ((copy_rows_fn)op->fn)(P(0), a[1], a[2], a[3], P(4), a[5]);
            break;
        default:
            return i;
        }
#undef P
        if (rc != 0)
            return i;
    }
    return -1;
}
