/* Recurrent ops: SSM_CONV, SSM_SCAN (Mamba-1/2 with K snapshots), GATED_DELTA_NET.
 * Snapshot layout (both scans): the main output, then K state slots, slot 0 = final state;
 * slots at or beyond the token count are left unwritten. The working state lives in slot 0
 * of the destination, so no scratch memory is needed. */
#include "mg.h"

/* ---------------------------------------------------------------------------------------- */
/* SSM_CONV: out[i, t, s] = sum_k sx[t+k, i, s] * c[k, i], f32 from 0, k ascending.
 *   sx  = src[0] [d_conv-1+n_t, d_inner, n_s], rows dense (nb0 == 4, nb1 == ne0*4)
 *   c   = src[1] [d_conv, d_inner], nb0 == 4
 *   dst        [d_inner, n_t, n_s] contiguous
 * Vectorised over time inside a channel block, then written transposed (channels dense). */
#define CONV_CB 16    /* channels per block */
#define CONV_TB 64    /* time steps per block */
#define CONV_KMAX 8   /* taps handled by the channel-vectorised path */

void mg_k_ssm_conv(const mg_node *n, int ith, int nth) {
    const mg_tensor *sx = &n->src[0];
    const mg_tensor *c = &n->src[1];
    const mg_tensor *d = &n->dst;
    const int64_t d_conv = c->ne[0], d_inner = c->ne[1];
    const int64_t n_t = d->ne[1], n_s = d->ne[2];
    const int64_t cblk = (d_inner + CONV_CB - 1) / CONV_CB;
    const int64_t tblk = (n_t + CONV_TB - 1) / CONV_TB;
    int64_t j0, j1;
    mg_split(n_s * cblk * tblk, ith, nth, &j0, &j1);
    for (int64_t job = j0; job < j1; job++) {
        const int64_t cb = job % cblk, tb = (job / cblk) % tblk, s = job / (cblk * tblk);
        const int64_t c0 = cb * CONV_CB, c1 = mg_min64(c0 + CONV_CB, d_inner);
        const int64_t t0 = tb * CONV_TB, t1 = mg_min64(t0 + CONV_TB, n_t);
        const int64_t nt = t1 - t0;
        if (nt == 1) {
            /* decode: one output per channel */
            float *o = (float *)mg_ptr(d, 0, t0, s, 0);                             /* [d_inner] */
            if (d_conv == 4 && sx->nb[1] == 16 && c->nb[1] == 16) {
                /* rows of 4 taps packed back to back in both: constant strides vectorise */
                const float *x = (const float *)mg_ptr(sx, t0, 0, s, 0);            /* [4, d_inner] */
                const float *w = (const float *)c->data;                            /* [4, d_inner] */
                for (int64_t i = c0; i < c1; i++) {
                    float acc = 0.0f;
                    acc = acc + x[4 * i + 0] * w[4 * i + 0];
                    acc = acc + x[4 * i + 1] * w[4 * i + 1];
                    acc = acc + x[4 * i + 2] * w[4 * i + 2];
                    acc = acc + x[4 * i + 3] * w[4 * i + 3];
                    o[i] = acc;
                }
                continue;
            }
            for (int64_t i = c0; i < c1; i++) {
                const float *x = (const float *)mg_ptr(sx, t0, i, s, 0);            /* [d_conv] */
                const float *w = (const float *)mg_ptr(c, 0, i, 0, 0);              /* [d_conv] */
                float acc = 0.0f;
                for (int64_t k = 0; k < d_conv; k++) acc = acc + x[k] * w[k];
                o[i] = acc;
            }
            continue;
        }
        if (d_conv <= CONV_KMAX) {
            /* transpose the block's inputs so that channels are the vector lanes */
            float xt[CONV_TB + CONV_KMAX - 1][CONV_CB];                             /* [time + taps - 1][channel] */
            float wt[CONV_KMAX][CONV_CB];                                           /* [tap][channel] */
            const int64_t nc = c1 - c0;
            for (int64_t ii = 0; ii < CONV_CB; ii++) {
                if (ii < nc) {
                    const float *x = (const float *)mg_ptr(sx, t0, c0 + ii, s, 0);  /* [nt + d_conv - 1] */
                    const float *w = (const float *)mg_ptr(c, 0, c0 + ii, 0, 0);    /* [d_conv] */
                    for (int64_t j = 0; j < nt + d_conv - 1; j++) xt[j][ii] = x[j];
                    for (int64_t k = 0; k < d_conv; k++) wt[k][ii] = w[k];
                } else {
                    for (int64_t j = 0; j < nt + d_conv - 1; j++) xt[j][ii] = 0.0f;
                    for (int64_t k = 0; k < d_conv; k++) wt[k][ii] = 0.0f;
                }
            }
            for (int64_t t = 0; t < nt; t++) {
                float acc[CONV_CB];
                for (int ii = 0; ii < CONV_CB; ii++) acc[ii] = 0.0f;
                for (int64_t k = 0; k < d_conv; k++)
                    for (int ii = 0; ii < CONV_CB; ii++) acc[ii] = acc[ii] + xt[t + k][ii] * wt[k][ii];
                float *o = (float *)mg_ptr(d, c0, t0 + t, s, 0);                    /* [nc] */
                if (nc == CONV_CB) {
                    for (int ii = 0; ii < CONV_CB; ii++) o[ii] = acc[ii];
                } else {
                    for (int64_t ii = 0; ii < nc; ii++) o[ii] = acc[ii];
                }
            }
            continue;
        }
        float tmp[CONV_CB][CONV_TB];
        for (int64_t i = c0; i < c1; i++) {
            const float *x = (const float *)mg_ptr(sx, t0, i, s, 0);                /* [nt + d_conv - 1] */
            const float *w = (const float *)mg_ptr(c, 0, i, 0, 0);                  /* [d_conv] */
            float *acc = tmp[i - c0];                                               /* [nt] */
            for (int64_t t = 0; t < nt; t++) acc[t] = 0.0f;
            for (int64_t k = 0; k < d_conv; k++) {
                const float wk = w[k];
                const float *xk = x + k;
                for (int64_t t = 0; t < nt; t++) acc[t] = acc[t] + xk[t] * wk;
            }
        }
        for (int64_t t = 0; t < nt; t++) {
            float *o = (float *)mg_ptr(d, 0, t0 + t, s, 0);                         /* [d_inner] */
            for (int64_t i = c0; i < c1; i++) o[i] = tmp[i - c0][t];
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* SSM_SCAN (Mamba-2, A [1, n_head]; Mamba-1, A [d_state, n_head] with K == 1):
 *   s   = src[0] [d_state, head_dim, n_head, rows] contiguous (states, picked by ids)
 *   x   = src[1] [head_dim, n_head, T, n_seqs], dense in dims 0-1
 *   dt  = src[2] [n_head, T, n_seqs] contiguous
 *   A   = src[3] [1 or d_state, n_head]
 *   B   = src[4] [d_state, n_group, T, n_seqs], dense in dims 0-1
 *   C   = src[5] same as B
 *   ids = src[6] i32 [n_seqs]
 *   dst f32 [head_dim*n_head*T*n_seqs + K*d_state*head_dim*n_head*n_seqs]:
 *       y [head_dim, n_head, T, n_seqs], then states [d_state, head_dim, n_head, n_seqs, K] */
int mg_check_ssm_scan(const mg_node *n, mg_error *err) {
    const mg_tensor *ids = &n->src[6];
    const int64_t rows = n->src[0].ne[3];
    for (int64_t q = 0; q < ids->ne[0]; q++) {
        int32_t v;
        memcpy(&v, ids->data + q * ids->nb[0], 4);
        if (v < 0 || v >= rows) {
            err->code = MG_ERR_INDEX; err->src = 6; err->value = v; err->limit = rows;
            return 1;
        }
    }
    return 0;
}

static inline float softplus_f(float x) { return x > 20.0f ? x : logf(1.0f + expf(x)); }

void mg_k_ssm_scan(const mg_node *n, int ith, int nth) {
    const mg_tensor *s = &n->src[0], *x = &n->src[1], *dt = &n->src[2], *A = &n->src[3];
    const mg_tensor *B = &n->src[4], *C = &n->src[5], *ids = &n->src[6];
    const int64_t K = n->ip[0];
    const int64_t ds = s->ne[0], hd = x->ne[0], nh = x->ne[1], T = x->ne[2], ns = x->ne[3];
    const int64_t ng = B->ne[1];
    const int64_t heads_per_group = ng > 0 ? nh / ng : 1;
    const int mamba1 = A->ne[0] != 1;
    float *out = (float *)n->dst.data;
    const int64_t ny = hd * nh * T * ns;
    if (T <= 0 || heads_per_group <= 0) return;
    int64_t j0, j1;
    mg_split(ns * nh, ith, nth, &j0, &j1);
    for (int64_t job = j0; job < j1; job++) {
        const int64_t q = job / nh, h = job % nh, g = h / heads_per_group;
        int32_t row;
        memcpy(&row, ids->data + q * ids->nb[0], 4);
        float *st = out + ny + ((0 * ns + q) * nh + h) * hd * ds;                   /* [ds, hd] working state = slot 0 */
        for (int64_t p = 0; p < hd; p++)
            memcpy(st + p * ds, mg_ptr(s, 0, p, h, row), (size_t)ds * 4);
        for (int64_t t = 0; t < T; t++) {
            const float dsp = softplus_f(mg_load_f32(mg_ptr(dt, h, t, q, 0)));
            const float *xr = (const float *)mg_ptr(x, 0, h, t, q);                 /* [hd] */
            const float *Br = (const float *)mg_ptr(B, 0, g, t, q);                 /* [ds] */
            const float *Cr = (const float *)mg_ptr(C, 0, g, t, q);                 /* [ds] */
            float *y = out + ((q * T + t) * nh + h) * hd;                           /* [hd] */
            if (!mamba1) {
                const float dA = expf(dsp * mg_load_f32(mg_ptr(A, 0, h, 0, 0)));
                for (int64_t p = 0; p < hd; p++) {
                    const float xdt = xr[p] * dsp;
                    float *sp = st + p * ds;
                    float acc = 0.0f;
                    for (int64_t i = 0; i < ds; i++) {
                        sp[i] = sp[i] * dA + Br[i] * xdt;
                        acc += sp[i] * Cr[i];
                    }
                    y[p] = acc;
                }
            } else {
                float dAbuf[256];                                                   /* exp(dsp * A[:, h]) */
                if (ds <= 256)
                    for (int64_t i = 0; i < ds; i++) dAbuf[i] = expf(dsp * mg_load_f32(mg_ptr(A, i, h, 0, 0)));
                for (int64_t p = 0; p < hd; p++) {
                    const float xdt = xr[p] * dsp;
                    float *sp = st + p * ds;
                    float acc = 0.0f;
                    for (int64_t i = 0; i < ds; i++) {
                        const float dA = ds <= 256 ? dAbuf[i] : expf(dsp * mg_load_f32(mg_ptr(A, i, h, 0, 0)));
                        sp[i] = sp[i] * dA + Br[i] * xdt;
                        acc += sp[i] * Cr[i];
                    }
                    y[p] = acc;
                }
            }
            const int64_t slot = T - 1 - t;
            if (slot >= 1 && slot < K)
                memcpy(out + ny + ((slot * ns + q) * nh + h) * hd * ds, st, (size_t)(hd * ds) * 4);
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* GATED_DELTA_NET (REFERENCE 6.4): per sequence and head, with M[j][i] = S[i][j]:
 *   M *= exp(g)  (per column i, or scalar), delta_j = (v_j - M[j].k) * beta,
 *   M[j] += delta_j * k, out_j = M[j].q / sqrt(S).
 *   q = src[0] [S, H_q, T, n_q], k = src[1] [S, H_k, T, n_k]: heads tiled (h % H_q),
 *       sequences broadcast by division (sq / (n_seqs / n_q)), rows dense
 *   v = src[2] [S, H, T, n_seqs], g = src[3] [1 or S, H, T, n_seqs], beta = src[4] [1, H, T, n_seqs]
 *   state = src[5] [S, S, H, n_seqs] contiguous: element (i, j, h, sq) = M[j][i]
 *   dst f32 [S*H, T*n_seqs + K*S*n_seqs]: out [S, H, T, n_seqs], then M [S, S, H, n_seqs, K] */
void mg_k_gated_delta_net(const mg_node *n, int ith, int nth) {
    const mg_tensor *qt = &n->src[0], *kt = &n->src[1], *vt = &n->src[2];
    const mg_tensor *gt = &n->src[3], *bt = &n->src[4], *state = &n->src[5];
    const int64_t K = n->ip[0];
    const int64_t S = vt->ne[0], H = vt->ne[1], T = vt->ne[2], ns = vt->ne[3];
    const int kda = gt->ne[0] != 1;
    float *out = (float *)n->dst.data;
    const int64_t n_o = S * H * T * ns;
    const float scale = 1.0f / sqrtf((float)S);
    if (T <= 0 || qt->ne[1] <= 0 || kt->ne[1] <= 0 || qt->ne[3] <= 0 || kt->ne[3] <= 0) return;
    const int64_t rq = ns / qt->ne[3], rk = ns / kt->ne[3];
    if (rq <= 0 || rk <= 0) return;
    int64_t j0, j1;
    mg_split(ns * H, ith, nth, &j0, &j1);
    for (int64_t job = j0; job < j1; job++) {
        const int64_t sq = job / H, h = job % H;
        const int64_t hq = h % qt->ne[1], hk = h % kt->ne[1];
        const int64_t sqq = sq / rq, sqk = sq / rk;
        float *M = out + n_o + ((0 * ns + sq) * H + h) * S * S;                     /* [S(i), S(j)] = slot 0 */
        for (int64_t j = 0; j < S; j++)
            memcpy(M + j * S, mg_ptr(state, 0, j, h, sq), (size_t)S * 4);
        for (int64_t t = 0; t < T; t++) {
            const float *q = (const float *)mg_ptr(qt, 0, hq, t, sqq);              /* [S] */
            const float *k = (const float *)mg_ptr(kt, 0, hk, t, sqk);              /* [S] */
            const float *v = (const float *)mg_ptr(vt, 0, h, t, sq);                /* [S] */
            const float *g = (const float *)mg_ptr(gt, 0, h, t, sq);                /* [1 or S] */
            const float beta = mg_load_f32(mg_ptr(bt, 0, h, t, sq));
            float *o = out + ((sq * T + t) * H + h) * S;                            /* [S] */
            const float g0 = expf(g[0]);
            float gbuf[256];                                                        /* exp(g) per column */
            if (kda && S <= 256)
                for (int64_t i = 0; i < S; i++) gbuf[i] = expf(g[i]);
            for (int64_t j = 0; j < S; j++) {
                float *Mj = M + j * S;                                              /* [S] */
                float kv = 0.0f;
                if (kda && S <= 256) {
                    for (int64_t i = 0; i < S; i++) { Mj[i] = Mj[i] * gbuf[i]; kv += Mj[i] * k[i]; }
                } else if (kda) {
                    for (int64_t i = 0; i < S; i++) { Mj[i] = Mj[i] * expf(g[i]); kv += Mj[i] * k[i]; }
                } else {
                    for (int64_t i = 0; i < S; i++) { Mj[i] = Mj[i] * g0; kv += Mj[i] * k[i]; }
                }
                const float delta = (v[j] - kv) * beta;
                float qv = 0.0f;
                for (int64_t i = 0; i < S; i++) { Mj[i] = Mj[i] + delta * k[i]; qv += Mj[i] * q[i]; }
                o[j] = scale * qv;
            }
            const int64_t slot = T - 1 - t;
            if (slot >= 1 && slot < K)
                memcpy(out + n_o + ((slot * ns + sq) * H + h) * S * S, M, (size_t)(S * S) * 4);
        }
    }
}
