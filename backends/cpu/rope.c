/* ROPE (ggml_rope_ext and ggml_rope_multi) on f32 rows.
 *   a = src[0] [ne0, n_head, n_tok, ne3] f32, rows dense (nb0 == 4), any other strides
 *   b = src[1] [n_tok] i32 positions, or [4*n_tok] (t, h, w, e blocks) for MROPE/IMROPE
 *   c = src[2] [>= n_dims/2] f32 frequency factors, or absent (data NULL)
 *   dst        [ne0, n_head, n_tok, ne3]
 * fp = {freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow}
 * ip = {n_dims, mode, n_ctx_orig, sec_t, sec_h, sec_w, sec_e}
 * A row's angles are a function of its own position alone: the heads of one token (consecutive
 * rows) share them, computed once per token and chunk (up to ROPE_CACHE pairs; longer rows compute
 * them row by row), so a row's result does not depend on which other rows or tokens are in the
 * batch or on the thread split. Angles follow
 * ggml's f32 steps: theta_k = p * theta_scale^k by repeated multiplication, YaRN ramp and mscale.
 * ggml's CPU library is built with FMA contraction: a*b + c*d rounds as fmaf(a, b, c*d) there.
 * The same fmaf calls here (and cosf/sinf, the same libm) make NEOX, MROPE and IMROPE bit-identical
 * to libggml 0.20.2. In NORMAL mode its vectorised loop fuses pairs two at a time and rounds an
 * odd last pair without FMA (an artefact of that build, not a rule): that pair differs by an ulp
 * or so; minigraph fuses every pair. */
#include "mg.h"

#define ROPE_CACHE 512   /* pairs whose angles a chunk keeps (n_dims up to 1024) */

enum { ROPE_NORMAL = 0, ROPE_NEOX = 2, ROPE_MROPE = 8, ROPE_IMROPE = 40 };

static float rope_max(float x, float y) { return x > y ? x : y; }   /* C MAX: keeps ggml's NaN behaviour */
static float rope_min(float x, float y) { return x < y ? x : y; }

static float yarn_corr_dim(int n_dims, int n_ctx_orig, float n_rot, float base) {
    return n_dims * logf(n_ctx_orig / (n_rot * 2 * 3.14159265358979323846f)) / (2 * logf(base));
}

/* which position stream (0 t, 1 h, 2 w, 3 e) pair k of a multi-section rope reads */
static int rope_stream(int mode, int64_t k, const int64_t sec[4]) {
    const int64_t s = k % (sec[0] + sec[1] + sec[2] + sec[3]);
    if (mode == ROPE_IMROPE) {        /* interleaved t, h, w while each stream has pairs left */
        if (s % 3 == 1 && s < 3 * sec[1]) return 1;
        if (s % 3 == 2 && s < 3 * sec[2]) return 2;
        if (s % 3 == 0 && s < 3 * sec[0]) return 0;
        return 3;
    }
    if (s < sec[0]) return 0;         /* contiguous blocks t | h | w | e */
    if (s < sec[0] + sec[1]) return 1;
    if (s < sec[0] + sec[1] + sec[2]) return 2;
    return 3;
}

static void mg_k_rope(const mg_node *n, int ith, int nth) {
    const mg_tensor *a = &n->src[0], *b = &n->src[1], *c = &n->src[2], *d = &n->dst;
    const float freq_base = n->fp[0], freq_scale = n->fp[1], ext_factor = n->fp[2];
    const float attn_factor = n->fp[3], beta_fast = n->fp[4], beta_slow = n->fp[5];
    const int n_dims = (int)n->ip[0], mode = (int)n->ip[1], n_ctx_orig = (int)n->ip[2];
    const int64_t sec[4] = {n->ip[3], n->ip[4], n->ip[5], n->ip[6]};
    const int multi = mode == ROPE_MROPE || mode == ROPE_IMROPE;
    const int64_t ne0 = a->ne[0], n_tok = a->ne[2], half = n_dims / 2;
    const int32_t *pos = (const int32_t *)b->data;
    const float *ff = c->data ? (const float *)c->data : NULL;

    const float theta_scale = powf(freq_base, -2.0f / n_dims);
    const float low = rope_max(0, floorf(yarn_corr_dim(n_dims, n_ctx_orig, beta_fast, freq_base)));
    const float high = rope_min(n_dims - 1, ceilf(yarn_corr_dim(n_dims, n_ctx_orig, beta_slow, freq_base)));
    float mscale = attn_factor;
    if (ext_factor != 0.0f) mscale *= fmaf(0.1f, logf(1.0f / freq_scale), 1.0f);

    /* cos and sin (times mscale) of pair k's angle for the token cached_i2 */
    float cs_c[ROPE_CACHE], sn_c[ROPE_CACHE];
    int64_t cached_i2 = -1;
    int64_t r0, r1;
    mg_split(mg_nrows(a), ith, nth, &r0, &r1);
    int64_t i1 = 0, i2 = 0, i3 = 0;   /* row coordinates, moved row by row (no divisions) */
    if (r0 < r1) mg_row_coords(a, r0, &i1, &i2, &i3);
    for (int64_t r = r0; r < r1; r++, mg_row_next(a, &i1, &i2, &i3)) {
        const char *x = mg_ptr(a, 0, i1, i2, i3);   /* [ne0] */
        char *y = mg_ptr(d, 0, i1, i2, i3);         /* [ne0] */
        float theta[4] = {0, 0, 0, 0};
        for (int s = 0; s < (multi ? 4 : 1); s++) theta[s] = (float)pos[i2 + s * n_tok];
        for (int64_t k0 = 0; k0 < half; k0 += ROPE_CACHE) {
            const int64_t kn = mg_min64(ROPE_CACHE, half - k0);
            if (half > ROPE_CACHE || cached_i2 != i2) {
                for (int64_t k = k0; k < k0 + kn; k++) {
                    const float extrap = theta[multi ? rope_stream(mode, k, sec) : 0] / (ff ? ff[k] : 1.0f);
                    const float interp = freq_scale * extrap;
                    float th = interp;
                    if (ext_factor != 0.0f) {
                        const float ry = (k - low) / rope_max(0.001f, high - low);
                        const float mix = (1 - rope_min(1, rope_max(0, ry))) * ext_factor;
                        th = fmaf(interp, 1 - mix, extrap * mix);
                    }
                    cs_c[k - k0] = cosf(th) * mscale;
                    sn_c[k - k0] = sinf(th) * mscale;
                    for (int s = 0; s < 4; s++) theta[s] *= theta_scale;
                }
                cached_i2 = half > ROPE_CACHE ? -1 : i2;
            }
            /* NORMAL rotates the adjacent pair (2k, 2k+1), the others (k, k + n_dims/2); rows
             * are dense, and a loop per layout without a branch vectorises */
            const float *xf = (const float *)x;
            float *yf = (float *)y;
            if (mode == ROPE_NORMAL) {
                for (int64_t k = k0; k < k0 + kn; k++) {
                    const float cs = cs_c[k - k0], sn = sn_c[k - k0], x0 = xf[2 * k], x1 = xf[2 * k + 1];
                    yf[2 * k] = fmaf(x0, cs, -(x1 * sn));
                    yf[2 * k + 1] = fmaf(x0, sn, x1 * cs);
                }
            } else {
                for (int64_t k = k0; k < k0 + kn; k++) {
                    const float cs = cs_c[k - k0], sn = sn_c[k - k0], x0 = xf[k], x1 = xf[k + half];
                    yf[k] = fmaf(x0, cs, -(x1 * sn));
                    yf[k + half] = fmaf(x0, sn, x1 * cs);
                }
            }
        }
        for (int64_t i = n_dims; i < ne0; i++) mg_store_f32(y + i * d->nb[0], mg_load_f32(x + i * a->nb[0]));
    }
}

MG_KERNEL(ROPE, mg_k_rope, NULL)
