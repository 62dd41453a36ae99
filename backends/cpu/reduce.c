/* Row ops over dim 0, summed in double as ggml's CPU does: RMS_NORM, L2_NORM, SUM_ROWS, SOFT_MAX.
 * a = src[0] [ne0, ne1, ne2, ne3] f32 with dense rows; dst f32 contiguous. */
#include "mg.h"

static double sum_sq(const float *x, int64_t n) {  /* x: [n] */
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += (double)x[i] * x[i];
        s1 += (double)x[i + 1] * x[i + 1];
        s2 += (double)x[i + 2] * x[i + 2];
        s3 += (double)x[i + 3] * x[i + 3];
    }
    for (; i < n; i++) s0 += (double)x[i] * x[i];
    return (s0 + s1) + (s2 + s3);
}

static double sum(const float *x, int64_t n) {  /* x: [n] */
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) { s0 += x[i]; s1 += x[i + 1]; s2 += x[i + 2]; s3 += x[i + 3]; }
    for (; i < n; i++) s0 += x[i];
    return (s0 + s1) + (s2 + s3);
}

/* RMS_NORM, L2_NORM, SUM_ROWS share the row walk; KIND picks the formula (constant-folded) */
enum { RED_SUM, RED_RMS, RED_L2 };

static inline void reduce_rows(const mg_node *n, int ith, int nth, int kind) {
    const mg_tensor *a = &n->src[0];
    const mg_tensor *d = &n->dst;
    const int64_t ne0 = a->ne[0];
    const float eps = n->fp[0];   /* RMS_NORM, L2_NORM: fp = {eps} */
    int64_t r0, r1;
    mg_split(mg_nrows(a), ith, nth, &r0, &r1);
    int64_t i1 = 0, i2 = 0, i3 = 0;   /* row coordinates, moved row by row (no divisions) */
    if (r0 < r1) mg_row_coords(a, r0, &i1, &i2, &i3);
    for (int64_t r = r0; r < r1; r++, mg_row_next(a, &i1, &i2, &i3)) {
        const float *x = (const float *)mg_ptr(a, 0, i1, i2, i3);  /* [ne0] */
        float *y = (float *)mg_ptr(d, 0, i1, i2, i3);              /* [ne0] or [1] for SUM_ROWS */
        if (kind == RED_SUM) {
            y[0] = (float)sum(x, ne0);
        } else if (kind == RED_RMS) {
            const float mean = (float)(sum_sq(x, ne0) / (double)ne0);
            const float scale = 1.0f / sqrtf(mean + eps);
            for (int64_t i = 0; i < ne0; i++) y[i] = x[i] * scale;
        } else {
            const float ss = (float)sum_sq(x, ne0);
            const float nrm = sqrtf(ss);
            const float scale = 1.0f / (nrm < eps ? eps : nrm);   /* NaN propagates like np.maximum */
            for (int64_t i = 0; i < ne0; i++) y[i] = x[i] * scale;
        }
    }
}

static void mg_k_sum_rows(const mg_node *n, int ith, int nth) { reduce_rows(n, ith, nth, RED_SUM); }
static void mg_k_rms_norm(const mg_node *n, int ith, int nth) { reduce_rows(n, ith, nth, RED_RMS); }
static void mg_k_l2_norm(const mg_node *n, int ith, int nth)  { reduce_rows(n, ith, nth, RED_L2); }

MG_KERNEL(SUM_ROWS, mg_k_sum_rows, NULL)
MG_KERNEL(RMS_NORM, mg_k_rms_norm, NULL)
MG_KERNEL(L2_NORM, mg_k_l2_norm, NULL)

/* SOFT_MAX (ggml_soft_max_ext; the shape rule requires max_bias == 0): fp = {scale, max_bias}.
 *   a    = src[0] [ne0, ne1, ne2, ne3] f32
 *   mask = src[1] [ne0, >= ne1, ne2 | a.ne2, ne3 | a.ne3] f32, or absent (data NULL)
 *   dst          [ne0, ne1, ne2, ne3]
 * Per row (i1, i2, i3): w = x*scale (+ mask row (i1, i2 % mask.ne2, i3 % mask.ne3)), rounded
 * after each step; y = exp(w - max w) * (float)(1 / sum), the sum in double as ggml (dense rows:
 * in the 8 chains of soft_max_dense_row; strided rows: in order). w and the
 * exponentials are staged in the destination row, every access through the byte strides; exp is
 * the vectorised one of elementwise.c (mg_exp_row, or mg_exp per element: the same bits). */
/* A dense row (the attention rows of a decode step: thousands of short rows, most of the
 * mask -inf): the same steps in loops the compiler vectorises, each of them lane by lane with
 * no reordering: w and the max in 8 lanes (max is exact in any order), the sum of the
 * exponentials in 8 double chains (element i in chain i % 8) combined in one fixed tree. The
 * order depends on ne0 only, never on the batch or the thread split. */
#define SM_L 8
static void soft_max_dense_row(const float *x, const float *mr, float *y, int64_t ne0, float scale) {
    float mxl[SM_L];
    for (int l = 0; l < SM_L; l++) mxl[l] = -INFINITY;
    int64_t i = 0;
    for (; i + SM_L <= ne0; i += SM_L)
        for (int l = 0; l < SM_L; l++) {
            float w = x[i + l] * scale;
            if (mr) w += mr[i + l];
            y[i + l] = w;
            mxl[l] = w > mxl[l] ? w : mxl[l];
        }
    for (; i < ne0; i++) {
        float w = x[i] * scale;
        if (mr) w += mr[i];
        y[i] = w;
        mxl[0] = w > mxl[0] ? w : mxl[0];
    }
    float mx = mxl[0];
    for (int l = 1; l < SM_L; l++) mx = mxl[l] > mx ? mxl[l] : mx;
    for (i = 0; i < ne0; i++) y[i] = y[i] - mx;
    mg_exp_row(y, y, ne0);
    double acc[SM_L] = {0};
    for (i = 0; i + SM_L <= ne0; i += SM_L)
        for (int l = 0; l < SM_L; l++) acc[l] += (double)y[i + l];
    for (int l = 0; i < ne0; i++, l++) acc[l] += (double)y[i];
    const double sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    const float inv = (float)(1.0 / sum);
    for (i = 0; i < ne0; i++) y[i] = y[i] * inv;
}

static void mg_k_soft_max(const mg_node *n, int ith, int nth) {
    const mg_tensor *a = &n->src[0];
    const mg_tensor *m = &n->src[1];
    const mg_tensor *d = &n->dst;
    const float scale = n->fp[0];
    const int64_t ne0 = a->ne[0];
    int64_t r0, r1;
    mg_split(mg_nrows(a), ith, nth, &r0, &r1);
    int64_t i1 = 0, i2 = 0, i3 = 0;   /* row coordinates, moved row by row (no divisions) */
    if (r0 < r1) mg_row_coords(a, r0, &i1, &i2, &i3);
    for (int64_t r = r0; r < r1; r++, mg_row_next(a, &i1, &i2, &i3)) {
        const char *x = mg_ptr(a, 0, i1, i2, i3);                                          /* [ne0] */
        const char *mr = m->data ? mg_ptr(m, 0, i1, i2 % m->ne[2], i3 % m->ne[3]) : NULL;  /* [ne0] */
        char *y = mg_ptr(d, 0, i1, i2, i3);                                                /* [ne0] */
        if (a->nb[0] == 4 && d->nb[0] == 4 && (mr == NULL || m->nb[0] == 4)) {
            soft_max_dense_row((const float *)x, (const float *)mr, (float *)y, ne0, scale);
            continue;
        }
        float mx = -INFINITY;
        for (int64_t i = 0; i < ne0; i++) {
            float w = mg_load_f32(x + i * a->nb[0]) * scale;
            if (mr) w += mg_load_f32(mr + i * m->nb[0]);
            mg_store_f32(y + i * d->nb[0], w);
            mx = w > mx ? w : mx;
        }
        double sum = 0.0;
        if (d->nb[0] == 4) {   /* dense row: the vectorised exp (elementwise.c), then the sum in order */
            float *yf = (float *)y;
            for (int64_t i = 0; i < ne0; i++) yf[i] = yf[i] - mx;
            mg_exp_row(yf, yf, ne0);
            for (int64_t i = 0; i < ne0; i++) sum += (double)yf[i];
        } else {
            for (int64_t i = 0; i < ne0; i++) {
                const float e = mg_exp(mg_load_f32(y + i * d->nb[0]) - mx);
                mg_store_f32(y + i * d->nb[0], e);
                sum += (double)e;
            }
        }
        const float inv = (float)(1.0 / sum);
        for (int64_t i = 0; i < ne0; i++) mg_store_f32(y + i * d->nb[0], mg_load_f32(y + i * d->nb[0]) * inv);
    }
}

MG_KERNEL(SOFT_MAX, mg_k_soft_max, NULL)
