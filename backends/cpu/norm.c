/* NORM (ggml_norm): per row of a = src[0] [ne0, ne1, ne2, ne3] f32 (rows dense), fp = {eps}:
 *   mean = (float)(sum x) / ne0 in f32, v = x - mean (stored in dst), var = (float)(sum v*v / ne0),
 *   y = v * (1.0f / sqrtf(var + eps)); both sums in double, in element order, as ggml's CPU. */
#include "mg.h"

static void mg_k_norm(const mg_node *n, int ith, int nth) {
    const mg_tensor *a = &n->src[0], *d = &n->dst;
    const float eps = n->fp[0];
    const int64_t ne0 = a->ne[0];
    int64_t r0, r1;
    mg_split(mg_nrows(a), ith, nth, &r0, &r1);
    int64_t i1 = 0, i2 = 0, i3 = 0;   /* row coordinates, moved row by row (no divisions) */
    if (r0 < r1) mg_row_coords(a, r0, &i1, &i2, &i3);
    for (int64_t r = r0; r < r1; r++, mg_row_next(a, &i1, &i2, &i3)) {
        const float *x = (const float *)mg_ptr(a, 0, i1, i2, i3);   /* [ne0] */
        float *y = (float *)mg_ptr(d, 0, i1, i2, i3);               /* [ne0] */
        double sum = 0.0;
        for (int64_t i = 0; i < ne0; i++) sum += (double)x[i];
        const float mean = (float)sum / ne0;   /* the sum rounded to f32, then divided in f32 */
        double sum2 = 0.0;
        for (int64_t i = 0; i < ne0; i++) {
            const float v = x[i] - mean;
            y[i] = v;
            sum2 += (double)(v * v);
        }
        const float var = (float)(sum2 / ne0);
        const float scale = 1.0f / sqrtf(var + eps);
        for (int64_t i = 0; i < ne0; i++) y[i] *= scale;
    }
}

MG_KERNEL(NORM, mg_k_norm, NULL)
