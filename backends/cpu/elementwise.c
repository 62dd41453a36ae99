/* Elementwise f32 ops: unary math, binary ops with ggml broadcasting (b tiles a by modulo),
 * SCALE (x*s, or x*s + b when b != 0). Rows are dense along dim 0 (nb0 == 4) by the shape
 * rules; dst is a fresh contiguous tensor or, in place, a view of a (same strides).
 *
 * A unary op is one MG_UNARY line: its registry name and the f32 expression of x. */
#include "mg.h"

static inline float f_silu(float x)     { return x / (1.0f + expf(-x)); }
static inline float f_sigmoid(float x)  { return 1.0f / (1.0f + expf(-x)); }
static inline float f_softplus(float x) { return x > 20.0f ? x : logf(1.0f + expf(x)); }

/* a = src[0] [ne0, ne1, ne2, ne3] f32 -> dst same extents: dst = EXPR(x) elementwise. The
 * expression is pasted into the row loop (a kernel per op, no per-element dispatch). */
#define MG_UNARY(OP, EXPR)                                                          \
    static void mg_k_unary_##OP(const mg_node *n, int ith, int nth) {               \
        const mg_tensor *a = &n->src[0];                                            \
        const mg_tensor *d = &n->dst;                                               \
        const int64_t ne0 = d->ne[0];                                               \
        int64_t r0, r1;                                                             \
        mg_split(mg_nrows(d), ith, nth, &r0, &r1);                                  \
        for (int64_t r = r0; r < r1; r++) {                                         \
            int64_t i1, i2, i3;                                                     \
            mg_row_coords(d, r, &i1, &i2, &i3);                                     \
            const float *s = (const float *)mg_ptr(a, 0, i1, i2, i3); /* [ne0] */   \
            float *dr = (float *)mg_ptr(d, 0, i1, i2, i3);            /* [ne0] */   \
            for (int64_t i = 0; i < ne0; i++) { const float x = s[i]; dr[i] = (EXPR); } \
        }                                                                           \
    }                                                                               \
    MG_KERNEL(OP, mg_k_unary_##OP, NULL)

MG_UNARY(SILU, f_silu(x))
MG_UNARY(SIGMOID, f_sigmoid(x))
MG_UNARY(SOFTPLUS, f_softplus(x))
MG_UNARY(EXP, expf(x))
MG_UNARY(NEG, -x)
MG_UNARY(SQRT, sqrtf(x))

#define BIN_LOOP(OP)                                                             \
    do {                                                                         \
        if (ne10 == ne0) {                                                       \
            for (int64_t i = 0; i < ne0; i++) dr[i] = ar[i] OP br[i];            \
        } else if (ne10 == 1) {                                                  \
            const float bv = br[0];                                              \
            for (int64_t i = 0; i < ne0; i++) dr[i] = ar[i] OP bv;               \
        } else {                                                                 \
            for (int64_t k = 0; k < ne0; k += ne10)                              \
                for (int64_t i = 0; i < ne10; i++) dr[k + i] = ar[k + i] OP br[i]; \
        }                                                                        \
    } while (0)

/* a = src[0] [ne0, ne1, ne2, ne3], b = src[1] [ne10, ne11, ne12, ne13] (each divides a's):
 * dst = a OP b, b read at each coordinate modulo its extents */
#define MG_BINARY(NAME, OP)                                                                          \
    static void mg_k_binary_##NAME(const mg_node *n, int ith, int nth) {                             \
        const mg_tensor *a = &n->src[0];                                                             \
        const mg_tensor *b = &n->src[1];                                                             \
        const mg_tensor *d = &n->dst;                                                                \
        const int64_t ne0 = d->ne[0], ne10 = b->ne[0];                                               \
        if (ne10 <= 0 || b->ne[1] <= 0 || b->ne[2] <= 0 || b->ne[3] <= 0) return;                    \
        int64_t r0, r1;                                                                              \
        mg_split(mg_nrows(d), ith, nth, &r0, &r1);                                                   \
        for (int64_t r = r0; r < r1; r++) {                                                          \
            int64_t i1, i2, i3;                                                                      \
            mg_row_coords(d, r, &i1, &i2, &i3);                                                      \
            const float *ar = (const float *)mg_ptr(a, 0, i1, i2, i3);                  /* [ne0] */  \
            const float *br = (const float *)mg_ptr(b, 0, i1 % b->ne[1], i2 % b->ne[2], \
                                                    i3 % b->ne[3]);                     /* [ne10] */ \
            float *dr = (float *)mg_ptr(d, 0, i1, i2, i3);                              /* [ne0] */  \
            BIN_LOOP(OP);                                                                            \
        }                                                                                            \
    }                                                                                                \
    MG_KERNEL(NAME, mg_k_binary_##NAME, NULL)

MG_BINARY(ADD, +)
MG_BINARY(SUB, -)
MG_BINARY(MUL, *)
MG_BINARY(DIV, /)

/* SCALE: a = src[0] [ne0..] -> dst: x*s (b == 0) or x*s + b, rounded after each step;
 * fp = {s, b} */
static void mg_k_scale(const mg_node *n, int ith, int nth) {
    const mg_tensor *a = &n->src[0];
    const mg_tensor *d = &n->dst;
    const float s = n->fp[0], bias = n->fp[1];
    const int64_t ne0 = d->ne[0];
    int64_t r0, r1;
    mg_split(mg_nrows(d), ith, nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        int64_t i1, i2, i3;
        mg_row_coords(d, r, &i1, &i2, &i3);
        const float *ar = (const float *)mg_ptr(a, 0, i1, i2, i3);  /* [ne0] */
        float *dr = (float *)mg_ptr(d, 0, i1, i2, i3);              /* [ne0] */
        if (bias == 0.0f) {
            for (int64_t i = 0; i < ne0; i++) dr[i] = ar[i] * s;
        } else {
            for (int64_t i = 0; i < ne0; i++) dr[i] = ar[i] * s + bias;
        }
    }
}
MG_KERNEL(SCALE, mg_k_scale, NULL)
