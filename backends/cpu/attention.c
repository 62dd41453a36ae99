/* FLASH_ATTN_EXT (ggml_flash_attn_ext), f32 Q/K/V, optional f16 mask; fp = {scale, max_bias, logit_softcap}.
 *   q    = src[0] [D_k, n_q, n_head, n_seq]        rows dense
 *   k    = src[1] [D_k, n_kv, n_head_kv, n_seq]    rows dense; q head h reads k head h / (n_head / n_head_kv)
 *   v    = src[2] [D_v, n_kv, n_head_v, n_seq]     rows dense
 *   mask = src[3] [>= n_kv, >= n_q, m2, m3] f16, row (iq, h % m2, s % m3); or absent
 *   dst          [D_v, n_head, n_q, n_seq]
 * Per query row: score_j = (float)(q.k_j summed in double) * scale, softcap, + slope*mask (f32, as
 * ggml forms it; a key whose slope*mask is -inf is skipped); then the max, the exponentials, their
 * sum and the weighted V sum in double, rounded once. Keys are visited in order and every row on
 * its own, so a row's result does not depend on the batch or the thread split. */
#include <stdlib.h>

#include "mg.h"

static float fa_slope(int64_t h, int64_t n_head, float max_bias) {
    if (max_bias <= 0.0f) return 1.0f;
    const int64_t n_log2 = (int64_t)1 << (int64_t)floor(log2((double)n_head));
    const float m0 = powf(2.0f, -(max_bias) / n_log2);
    const float m1 = powf(2.0f, -(max_bias / 2.0f) / n_log2);
    return h < n_log2 ? powf(m0, h + 1) : powf(m1, 2 * (h - n_log2) + 1);
}

/* the score of key j for query row qr, or -INFINITY when the key is skipped */
static float fa_score(const mg_tensor *k, const float *qr, const char *kh, const char *mr, int64_t j,
                      float scale, float cap, float slope) {
    float mv = 0.0f;
    if (mr) {
        mv = slope * mg_fp16_to_fp32(*(const uint16_t *)(mr + j * 2));
        if (mv == -INFINITY) return -INFINITY;
    }
    const float *kr = (const float *)(kh + j * k->nb[1]);
    double dot = 0.0;
    for (int64_t d = 0; d < k->ne[0]; d++) dot += (double)qr[d] * (double)kr[d];
    float s = (float)dot * scale;
    if (cap != 0.0f) s = cap * (float)tanh((double)s);
    return s + mv;
}

static void mg_k_flash_attn_ext(const mg_node *n, int ith, int nth) {
    const mg_tensor *q = &n->src[0], *k = &n->src[1], *v = &n->src[2], *m = &n->src[3], *d = &n->dst;
    const float cap = n->fp[2], max_bias = n->fp[1];
    const float scale = cap != 0.0f ? n->fp[0] / cap : n->fp[0];
    const int64_t n_head = q->ne[2], n_kv = k->ne[1], dv = v->ne[0];
    double *acc = malloc((size_t)(dv > 0 ? dv : 1) * sizeof(double));
    if (!acc) return;   /* no memory: the output is left unwritten (never reached in practice) */
    int64_t r0, r1;
    mg_split(mg_nrows(q), ith, nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        int64_t iq, h, s;
        mg_row_coords(q, r, &iq, &h, &s);
        const float *qr = (const float *)mg_ptr(q, 0, iq, h, s);                            /* [D_k] */
        const char *kh = mg_ptr(k, 0, 0, h / (n_head / k->ne[2]), s);                       /* [D_k, n_kv] */
        const char *vh = mg_ptr(v, 0, 0, h / (n_head / v->ne[2]), s);                       /* [D_v, n_kv] */
        const char *mr = m->data ? mg_ptr(m, 0, iq, h % m->ne[2], s % m->ne[3]) : NULL;    /* [>= n_kv] */
        const float slope = fa_slope(h, n_head, max_bias);
        float mx = -INFINITY;
        for (int64_t j = 0; j < n_kv; j++) {
            const float sc = fa_score(k, qr, kh, mr, j, scale, cap, slope);
            if (sc > mx) mx = sc;
        }
        for (int64_t i = 0; i < dv; i++) acc[i] = 0.0;
        double den = 0.0;
        for (int64_t j = 0; j < n_kv; j++) {
            const float sc = fa_score(k, qr, kh, mr, j, scale, cap, slope);
            if (sc == -INFINITY) continue;
            const double w = exp((double)sc - (double)mx);
            const float *vr = (const float *)(vh + j * v->nb[1]);
            den += w;
            for (int64_t i = 0; i < dv; i++) acc[i] += w * (double)vr[i];
        }
        float *y = (float *)mg_ptr(d, 0, h, iq, s);                                          /* [D_v] */
        for (int64_t i = 0; i < dv; i++) y[i] = den == 0.0 ? 0.0f : (float)(acc[i] / den);
    }
    free(acc);
}

MG_KERNEL(FLASH_ATTN_EXT, mg_k_flash_attn_ext, NULL)
