/* GELU on f32 rows as ggml's CPU computes it: through its f16 table of the tanh approximation.
 * x <= -10 -> 0; x >= 10 -> x; else h = x rounded to f16 and the result is
 * f16(0.5*h*(1 + tanh(sqrt(2/pi)*h*(1 + 0.044715*h*h)))), the inner 1 + 0.044715*h*h one fmaf as
 * ggml's contracted build rounds it. tanh is taken in double and rounded (as the NumPy
 * reference), which agrees with the table's f16 values except in rare rounding ties.
 * a = src[0] [ne0, ne1, ne2, ne3] rows dense; dst the same extents (fresh, or a itself in place). */
#include "mg.h"

static inline float gelu_f16_table(float x) {
    if (x <= -10.0f) return 0.0f;
    if (x >= 10.0f) return x;
    const float h = mg_fp16_to_fp32(mg_fp32_to_fp16(x));
    const float inner = fmaf(0.044715f * h, h, 1.0f);
    const float t = (float)tanh((double)(0.7978845608028654f * h * inner));
    return mg_fp16_to_fp32(mg_fp32_to_fp16(0.5f * h * (1.0f + t)));
}

static void mg_k_gelu(const mg_node *n, int ith, int nth) {
    const mg_tensor *a = &n->src[0], *d = &n->dst;
    int64_t r0, r1;
    mg_split(mg_nrows(d), ith, nth, &r0, &r1);
    int64_t i1 = 0, i2 = 0, i3 = 0;   /* row coordinates, moved row by row (no divisions) */
    if (r0 < r1) mg_row_coords(d, r0, &i1, &i2, &i3);
    for (int64_t r = r0; r < r1; r++, mg_row_next(d, &i1, &i2, &i3)) {
        const float *s = (const float *)mg_ptr(a, 0, i1, i2, i3);   /* [ne0] */
        float *y = (float *)mg_ptr(d, 0, i1, i2, i3);               /* [ne0] */
        for (int64_t i = 0; i < d->ne[0]; i++) y[i] = gelu_f16_table(s[i]);
    }
}

MG_KERNEL(GELU, mg_k_gelu, NULL)
