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
 * Jobs are (seq, block of CONV_CB channels, block of CONV_TB time steps), time blocks fastest.
 * With AVX the conv runs along time (lanes = time steps, unaligned loads of x[t+k ..], the tap
 * broadcast), one vector per channel, then a square tile is transposed in registers so each
 * time step's channels are stored as one vector. Each lane still computes
 * ((0 + x0*w0) + x1*w1) + ..., multiply and add rounded separately (no FMA), as the reference.
 * Outputs of CONV_NT_BYTES or more (prefill: 8 MiB per sequence at 4096 channels x 512 tokens)
 * are written with non-temporal stores: full aligned lines, no read-for-ownership of lines
 * that are only overwritten (~1.6x faster than plain stores at n_t = 512, measured), at the
 * price of leaving the output out of cache, like memcpy past its non-temporal threshold. */
#define CONV_CB 16    /* channels per block */
#define CONV_TB 512   /* time steps per block */
#define CONV_KMAX 8   /* taps handled by the vector paths and the scalar channel-lane path */
#define CONV_PD 64    /* software prefetch distance along a channel row, floats */
#define CONV_NT_BYTES ((int64_t)4 << 20)

#if defined(__AVX__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
/* 16x16 transpose: r[i] lane j <-> r[j] lane i */
static inline __attribute__((always_inline)) void conv_tr16(__m512 r[16]) {
    __m512 t[16];
    __m512d u[16];
    for (int g = 0; g < 4; g++) {
        t[4 * g + 0] = _mm512_unpacklo_ps(r[4 * g + 0], r[4 * g + 1]);     /* a0 b0 a1 b1 per 128 */
        t[4 * g + 1] = _mm512_unpackhi_ps(r[4 * g + 0], r[4 * g + 1]);     /* a2 b2 a3 b3 */
        t[4 * g + 2] = _mm512_unpacklo_ps(r[4 * g + 2], r[4 * g + 3]);     /* c0 d0 c1 d1 */
        t[4 * g + 3] = _mm512_unpackhi_ps(r[4 * g + 2], r[4 * g + 3]);     /* c2 d2 c3 d3 */
        u[4 * g + 0] = _mm512_unpacklo_pd(_mm512_castps_pd(t[4 * g + 0]), _mm512_castps_pd(t[4 * g + 2]));
        u[4 * g + 1] = _mm512_unpackhi_pd(_mm512_castps_pd(t[4 * g + 0]), _mm512_castps_pd(t[4 * g + 2]));
        u[4 * g + 2] = _mm512_unpacklo_pd(_mm512_castps_pd(t[4 * g + 1]), _mm512_castps_pd(t[4 * g + 3]));
        u[4 * g + 3] = _mm512_unpackhi_pd(_mm512_castps_pd(t[4 * g + 1]), _mm512_castps_pd(t[4 * g + 3]));
    }
    /* u[4g+m], 128-bit block L = column 4L+m of rows 4g..4g+3 */
    for (int m = 0; m < 4; m++) {
        const __m512 a = _mm512_castpd_ps(u[m]), b = _mm512_castpd_ps(u[4 + m]);
        const __m512 c = _mm512_castpd_ps(u[8 + m]), d = _mm512_castpd_ps(u[12 + m]);
        const __m512 ab02 = _mm512_shuffle_f32x4(a, b, 0x88), ab13 = _mm512_shuffle_f32x4(a, b, 0xdd);
        const __m512 cd02 = _mm512_shuffle_f32x4(c, d, 0x88), cd13 = _mm512_shuffle_f32x4(c, d, 0xdd);
        r[m] = _mm512_shuffle_f32x4(ab02, cd02, 0x88);
        r[8 + m] = _mm512_shuffle_f32x4(ab02, cd02, 0xdd);
        r[4 + m] = _mm512_shuffle_f32x4(ab13, cd13, 0x88);
        r[12 + m] = _mm512_shuffle_f32x4(ab13, cd13, 0xdd);
    }
}

/* one job: 16 channel rows xp[ii] (time t0 onwards), taps wt[ii][k], nt time steps, nc valid
 * channels; outputs o + t * ostride (floats), 16 channels each */
static inline __attribute__((always_inline)) void conv_job16_512(const float *const xp[16], const float wt[16][CONV_KMAX],
                                                              int64_t K, int64_t nt, int64_t nc, float *o, int64_t ostride,
                                                              int nts) {
    const __mmask16 cm = (__mmask16)((1u << nc) - 1u);
    for (int64_t t = 0; t < nt; t += 16) {
        const int64_t r = mg_min64(16, nt - t);
        const __mmask16 lm = (__mmask16)((1u << r) - 1u);
        __m512 acc[16];
        for (int ii = 0; ii < 16; ii++) {
            const float *x = xp[ii] + t;
            _mm_prefetch((const char *)(x + CONV_PD), _MM_HINT_T0);
            __m512 a = _mm512_setzero_ps();
            if (r == 16) {
                for (int64_t k = 0; k < K; k++)
                    a = _mm512_add_ps(a, _mm512_mul_ps(_mm512_loadu_ps(x + k), _mm512_set1_ps(wt[ii][k])));
            } else {
                for (int64_t k = 0; k < K; k++)
                    a = _mm512_add_ps(a, _mm512_mul_ps(_mm512_maskz_loadu_ps(lm, x + k), _mm512_set1_ps(wt[ii][k])));
            }
            acc[ii] = a;
        }
        conv_tr16(acc);
        float *ot = o + t * ostride;
        if (nts) {          /* nc == 16, rows 64-byte aligned */
            for (int64_t j = 0; j < r; j++) _mm512_stream_ps(ot + j * ostride, acc[j]);
        } else if (nc == 16) {
            for (int64_t j = 0; j < r; j++) _mm512_storeu_ps(ot + j * ostride, acc[j]);
        } else {
            for (int64_t j = 0; j < r; j++) _mm512_mask_storeu_ps(ot + j * ostride, cm, acc[j]);
        }
    }
}
#endif

#if defined(__AVX__)
/* 8x8 transpose: r[i] lane j <-> r[j] lane i */
static inline __attribute__((always_inline)) void conv_tr8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int g = 0; g < 2; g++) {
        t[4 * g + 0] = _mm256_unpacklo_ps(r[4 * g + 0], r[4 * g + 1]);     /* a0 b0 a1 b1 per 128 */
        t[4 * g + 1] = _mm256_unpackhi_ps(r[4 * g + 0], r[4 * g + 1]);     /* a2 b2 a3 b3 */
        t[4 * g + 2] = _mm256_unpacklo_ps(r[4 * g + 2], r[4 * g + 3]);
        t[4 * g + 3] = _mm256_unpackhi_ps(r[4 * g + 2], r[4 * g + 3]);
        u[4 * g + 0] = _mm256_shuffle_ps(t[4 * g + 0], t[4 * g + 2], 0x44);  /* a0 b0 c0 d0 */
        u[4 * g + 1] = _mm256_shuffle_ps(t[4 * g + 0], t[4 * g + 2], 0xee);  /* a1 b1 c1 d1 */
        u[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
        u[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xee);
    }
    for (int m = 0; m < 4; m++) {
        r[m] = _mm256_permute2f128_ps(u[m], u[4 + m], 0x20);
        r[4 + m] = _mm256_permute2f128_ps(u[m], u[4 + m], 0x31);
    }
}

/* 8x8 tiles, time steps outer, the two 8-channel halves inner. Non-temporal stores write each
 * 64-byte line as two back-to-back 32-byte stores (the first half waits in lo[]): halves written
 * far apart would flush the write-combining buffers half full, which is several times slower. */
static inline __attribute__((always_inline)) void conv_job16_256(const float *const xp[16], const float wt[16][CONV_KMAX],
                                                              int64_t K, int64_t nt, int64_t nc, float *o, int64_t ostride,
                                                              int nts) {
    static const int32_t ones[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    __attribute__((aligned(32))) float lo[8][8];
    for (int64_t t = 0; t < nt; t += 8) {
        const int64_t r = mg_min64(8, nt - t);
        const __m256i lm = _mm256_loadu_si256((const __m256i *)(ones + 8 - r));
        for (int h = 0; h < 16 && h < nc; h += 8) {
            const int64_t ncc = mg_min64(8, nc - h);
            __m256 acc[8];
            for (int ii = 0; ii < 8; ii++) {
                const float *x = xp[h + ii] + t;
                if ((t & 15) == 0) _mm_prefetch((const char *)(x + CONV_PD), _MM_HINT_T0);
                __m256 a = _mm256_setzero_ps();
                if (r == 8) {
                    for (int64_t k = 0; k < K; k++)
                        a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_loadu_ps(x + k), _mm256_set1_ps(wt[h + ii][k])));
                } else {
                    for (int64_t k = 0; k < K; k++)
                        a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_maskload_ps(x + k, lm), _mm256_set1_ps(wt[h + ii][k])));
                }
                acc[ii] = a;
            }
            conv_tr8(acc);
            float *ot = o + t * ostride + h;
            if (nts && h == 0) {        /* nc == 16, rows 64-byte aligned */
                for (int j = 0; j < 8; j++) _mm256_store_ps(lo[j], acc[j]);
            } else if (nts) {
                for (int64_t j = 0; j < r; j++) {
                    _mm256_stream_ps(ot + j * ostride - 8, _mm256_load_ps(lo[j]));
                    _mm256_stream_ps(ot + j * ostride, acc[j]);
                }
            } else if (ncc == 8) {
                for (int64_t j = 0; j < r; j++) _mm256_storeu_ps(ot + j * ostride, acc[j]);
            } else {
                const __m256i cm = _mm256_loadu_si256((const __m256i *)(ones + 8 - ncc));
                for (int64_t j = 0; j < r; j++) _mm256_maskstore_ps(ot + j * ostride, cm, acc[j]);
            }
        }
    }
}
#define CONV_HAVE_VEC 1
#endif

#if defined(__AVX2__)
/* decode with 4 taps, rows of taps back to back in x and w: 8 channels per step. The products
 * x*w are formed in place (channel pairs per vector), a 4x4 transpose per 128-bit half gives one
 * vector per tap, and each lane adds ((0 + p0) + p1) + p2) + p3 like the scalar loop; a lane
 * permutation restores channel order. Returns the first channel not done. */
static int64_t conv_decode4_avx2(const float *x, const float *w, float *o, int64_t c0, int64_t c1) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int64_t i = c0;
    for (; i + 8 <= c1; i += 8) {
        const float *xi = x + 4 * i, *wi = w + 4 * i;
        const __m256 p0 = _mm256_mul_ps(_mm256_loadu_ps(xi), _mm256_loadu_ps(wi));            /* ch i, i+1 */
        const __m256 p1 = _mm256_mul_ps(_mm256_loadu_ps(xi + 8), _mm256_loadu_ps(wi + 8));    /* i+2, i+3 */
        const __m256 p2 = _mm256_mul_ps(_mm256_loadu_ps(xi + 16), _mm256_loadu_ps(wi + 16));  /* i+4, i+5 */
        const __m256 p3 = _mm256_mul_ps(_mm256_loadu_ps(xi + 24), _mm256_loadu_ps(wi + 24));  /* i+6, i+7 */
        const __m256 t0 = _mm256_unpacklo_ps(p0, p1), t1 = _mm256_unpackhi_ps(p0, p1);
        const __m256 t2 = _mm256_unpacklo_ps(p2, p3), t3 = _mm256_unpackhi_ps(p2, p3);
        /* per half: tap k of channels (i, i+2, i+4, i+6) low, (i+1, i+3, i+5, i+7) high */
        const __m256 k0 = _mm256_shuffle_ps(t0, t2, 0x44), k1 = _mm256_shuffle_ps(t0, t2, 0xee);
        const __m256 k2 = _mm256_shuffle_ps(t1, t3, 0x44), k3 = _mm256_shuffle_ps(t1, t3, 0xee);
        __m256 acc = _mm256_add_ps(_mm256_setzero_ps(), k0);
        acc = _mm256_add_ps(acc, k1);
        acc = _mm256_add_ps(acc, k2);
        acc = _mm256_add_ps(acc, k3);
        _mm256_storeu_ps(o + i, _mm256_permutevar8x32_ps(acc, order));
    }
    return i;
}
#endif

void mg_k_ssm_conv(const mg_node *n, int ith, int nth) {
    const mg_tensor *sx = &n->src[0];
    const mg_tensor *c = &n->src[1];
    const mg_tensor *d = &n->dst;
    const int64_t d_conv = c->ne[0], d_inner = c->ne[1];
    const int64_t n_t = d->ne[1], n_s = d->ne[2];
    /* channel blocks start on the output's 64-byte lines where its rows allow: sh virtual
     * channels in front, so the first block holds the channels before the first line boundary
     * (the allocator's buffers are NumPy arrays, 16 bytes past a line for large ones) */
    const int lines = d->nb[1] % 64 == 0 && d->nb[2] % 64 == 0 && ((uintptr_t)d->data & 3) == 0;
    const int64_t sh = lines ? (int64_t)(((uintptr_t)d->data & 63) / 4) : 0;
    const int64_t cblk = (d_inner + sh + CONV_CB - 1) / CONV_CB;
    const int64_t tblk = (n_t + CONV_TB - 1) / CONV_TB;
#if defined(CONV_HAVE_VEC)
    /* non-temporal stores for large outputs, in full blocks (whole aligned lines) */
    const int nts = lines && n_t > 1 && d_inner * n_t * n_s * 4 >= CONV_NT_BYTES;
#endif
    int64_t j0, j1;
    mg_split(n_s * cblk * tblk, ith, nth, &j0, &j1);
    for (int64_t job = j0; job < j1; job++) {
        /* time blocks fastest: a thread streams along its channel rows (prefetch-friendly) */
        const int64_t tb = job % tblk, cb = (job / tblk) % cblk, s = job / (cblk * tblk);
        const int64_t c0 = mg_max64(0, cb * CONV_CB - sh), c1 = mg_min64(cb * CONV_CB + CONV_CB - sh, d_inner);
        const int64_t t0 = tb * CONV_TB, t1 = mg_min64(t0 + CONV_TB, n_t);
        const int64_t nt = t1 - t0;
        if (c1 <= c0) continue;                                                     /* d_inner == 0 */
        if (nt == 1) {
            /* decode: one output per channel */
            float *o = (float *)mg_ptr(d, 0, t0, s, 0);                             /* [d_inner] */
            if (d_conv == 4 && sx->nb[1] == 16 && c->nb[1] == 16) {
                /* rows of 4 taps packed back to back in both: constant strides vectorise */
                const float *x = (const float *)mg_ptr(sx, t0, 0, s, 0);            /* [4, d_inner] */
                const float *w = (const float *)c->data;                            /* [4, d_inner] */
                int64_t i = c0;
#if defined(__AVX2__)
                i = conv_decode4_avx2(x, w, o, c0, c1);
#endif
                for (; i < c1; i++) {
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
        const int64_t nc = c1 - c0;
#if defined(CONV_HAVE_VEC)
        if (d_conv <= CONV_KMAX) {
            const float *xp[CONV_CB];                                               /* [nt + d_conv - 1] each */
            float wt[CONV_CB][CONV_KMAX];                                           /* [channel][tap] */
            for (int64_t ii = 0; ii < CONV_CB; ii++) {
                /* lanes past the last channel reuse channel c0's row; their outputs are not stored */
                xp[ii] = (const float *)mg_ptr(sx, t0, ii < nc ? c0 + ii : c0, s, 0);
                const float *w = (const float *)mg_ptr(c, 0, ii < nc ? c0 + ii : c0, 0, 0);
                for (int64_t k = 0; k < CONV_KMAX; k++) wt[ii][k] = k < d_conv ? w[k] : 0.0f;
            }
            float *o = (float *)mg_ptr(d, c0, t0, s, 0);                            /* [nc] per time step */
            const int64_t ostride = d->nb[1] / 4;
            if (nt <= 16 && job + 1 < j1) {
                /* short rows: the next job's rows (the next channels, contiguous) are a few lines */
                const char *p = mg_ptr(sx, 0, c1, s, 0), *pe = p + CONV_CB * sx->nb[1];
                for (; p < pe; p += 64) _mm_prefetch(p, _MM_HINT_T0);
            }
#if defined(__AVX512F__)
            if (nt > 8) {
                if (d_conv == 4) conv_job16_512(xp, wt, 4, nt, nc, o, ostride, nts && nc == CONV_CB);
                else conv_job16_512(xp, wt, d_conv, nt, nc, o, ostride, nts && nc == CONV_CB);
                continue;
            }
#endif
            /* with AVX-512 too when nt <= 8 (n_t = 8: a 16x16 tile would be half empty) */
            if (d_conv == 4) conv_job16_256(xp, wt, 4, nt, nc, o, ostride, nts && nc == CONV_CB);
            else conv_job16_256(xp, wt, d_conv, nt, nc, o, ostride, nts && nc == CONV_CB);
            continue;
        }
#endif
        if (d_conv <= CONV_KMAX) {
            /* transpose the block's inputs so that channels are the vector lanes */
            float xt[CONV_TB + CONV_KMAX - 1][CONV_CB];                             /* [time + taps - 1][channel] */
            float wt[CONV_KMAX][CONV_CB];                                           /* [tap][channel] */
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
#if defined(CONV_HAVE_VEC)
    if (nts) _mm_sfence();   /* order the weakly-ordered stores before this chunk is reported done */
#endif
}

/* ---------------------------------------------------------------------------------------- */
/* The scans' inner loops over one state row, vectorised along the row (8 lanes with AVX, a
 * scalar loop without). Each element's update is rounded as the scalar form (multiply, then add,
 * no FMA); the dot products sum in two 8-lane accumulators (even and odd vectors), then the
 * lanes in a fixed order, then the scalar tail: a row's result depends on that row's data alone,
 * never on the other sequences, heads or the thread count (batch invariance). */
#if defined(__AVX__)
static inline float scan_hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    return _mm_cvtss_f32(_mm_add_ss(s, sh));
}
#endif

/* sp[i] = sp[i] * (av ? av[i] : a) + b[i] * c; returns sum_i sp[i] * w[i] */
static inline float scan_update_dot(float *restrict sp, const float *restrict av, float a, const float *restrict b,
                                    float c, const float *restrict w, int64_t n) {
    int64_t i = 0;
    float acc = 0.0f;
#if defined(__AVX__)
    if (n >= 16) {
        const __m256 va = _mm256_set1_ps(a), vc = _mm256_set1_ps(c);
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        for (; i + 16 <= n; i += 16) {
            __m256 s0 = _mm256_loadu_ps(sp + i), s1 = _mm256_loadu_ps(sp + i + 8);
            const __m256 a0 = av ? _mm256_loadu_ps(av + i) : va, a1 = av ? _mm256_loadu_ps(av + i + 8) : va;
            s0 = _mm256_add_ps(_mm256_mul_ps(s0, a0), _mm256_mul_ps(_mm256_loadu_ps(b + i), vc));
            s1 = _mm256_add_ps(_mm256_mul_ps(s1, a1), _mm256_mul_ps(_mm256_loadu_ps(b + i + 8), vc));
            _mm256_storeu_ps(sp + i, s0);
            _mm256_storeu_ps(sp + i + 8, s1);
            acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(s0, _mm256_loadu_ps(w + i)));
            acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(s1, _mm256_loadu_ps(w + i + 8)));
        }
        acc = scan_hsum8(_mm256_add_ps(acc0, acc1));
    }
#endif
    for (; i < n; i++) {
        sp[i] = sp[i] * (av ? av[i] : a) + b[i] * c;
        acc += sp[i] * w[i];
    }
    return acc;
}

/* two tokens of one row in one pass: what scan_update_dot(sp, NULL, a0, b0, c0, w0, n) and then
 * scan_update_dot(sp, NULL, a1, b1, c1, w1, n) compute, each element's operations and each sum's
 * order the same (into *r0, *r1), with the row read and written once instead of twice: a
 * mamba2 head's state (64 x 128 floats) fills L1, so a prefill's scan is bound by moving it.
 * In-process A/B on this Zen 3 core (a mamba2 layer's scan, 24 heads of 64 x 128, 512 tokens,
 * 1 thread, two runs): token by token 13.6 and 20.4 ms, in pairs 13.0 and 16.8 */
static inline void scan_update_dot2(float *restrict sp, float a0, const float *restrict b0, float c0,
                                    const float *restrict w0, float a1, const float *restrict b1, float c1,
                                    const float *restrict w1, int64_t n, float *r0, float *r1) {
    int64_t i = 0;
    float acc0 = 0.0f, acc1 = 0.0f;
#if defined(__AVX__)
    if (n >= 16) {
        const __m256 va0 = _mm256_set1_ps(a0), vc0 = _mm256_set1_ps(c0);
        const __m256 va1 = _mm256_set1_ps(a1), vc1 = _mm256_set1_ps(c1);
        __m256 e0 = _mm256_setzero_ps(), o0 = _mm256_setzero_ps();   /* token 0: even, odd vectors */
        __m256 e1 = _mm256_setzero_ps(), o1 = _mm256_setzero_ps();   /* token 1 */
        for (; i + 16 <= n; i += 16) {
            __m256 s0 = _mm256_loadu_ps(sp + i), s1 = _mm256_loadu_ps(sp + i + 8);
            s0 = _mm256_add_ps(_mm256_mul_ps(s0, va0), _mm256_mul_ps(_mm256_loadu_ps(b0 + i), vc0));
            s1 = _mm256_add_ps(_mm256_mul_ps(s1, va0), _mm256_mul_ps(_mm256_loadu_ps(b0 + i + 8), vc0));
            e0 = _mm256_add_ps(e0, _mm256_mul_ps(s0, _mm256_loadu_ps(w0 + i)));
            o0 = _mm256_add_ps(o0, _mm256_mul_ps(s1, _mm256_loadu_ps(w0 + i + 8)));
            s0 = _mm256_add_ps(_mm256_mul_ps(s0, va1), _mm256_mul_ps(_mm256_loadu_ps(b1 + i), vc1));
            s1 = _mm256_add_ps(_mm256_mul_ps(s1, va1), _mm256_mul_ps(_mm256_loadu_ps(b1 + i + 8), vc1));
            e1 = _mm256_add_ps(e1, _mm256_mul_ps(s0, _mm256_loadu_ps(w1 + i)));
            o1 = _mm256_add_ps(o1, _mm256_mul_ps(s1, _mm256_loadu_ps(w1 + i + 8)));
            _mm256_storeu_ps(sp + i, s0);
            _mm256_storeu_ps(sp + i + 8, s1);
        }
        acc0 = scan_hsum8(_mm256_add_ps(e0, o0));
        acc1 = scan_hsum8(_mm256_add_ps(e1, o1));
    }
#endif
    for (; i < n; i++) {
        float v = sp[i] * a0 + b0[i] * c0;
        acc0 += v * w0[i];
        v = v * a1 + b1[i] * c1;
        acc1 += v * w1[i];
        sp[i] = v;
    }
    *r0 = acc0;
    *r1 = acc1;
}

/* The two passes of GATED_DELTA_NET over a state row, vectorised along it, for R rows at once
 * (row r at m + r * rs; R a constant in each expansion), over the first n values, n a multiple
 * of 16. Each row's operations and sums are the one-row forms' (scan_scale_dot, scan_axpy_dot,
 * below, which take R = 1), only interleaved: one row's two sums are a chain of dependent adds and
 * a horizontal sum each, and its delta waits on the first, so a row alone keeps the core waiting on
 * that latency (S 128: about 100 cycles a row and token); rows are independent, and SCAN_ROWS of
 * them at once overlap it. */
#define SCAN_ROWS 4
#if defined(__AVX__)
/* m[i] *= (gv ? gv[i] : g); out[r] = sum_i m[i] * k[i] */
static inline __attribute__((always_inline)) void scan_scale_dot_rows(float *m, int64_t rs, const int R,
                                                                      const float *restrict gv, float g,
                                                                      const float *restrict k, int64_t n, float *out) {
    const __m256 vg = _mm256_set1_ps(g);
    __m256 acc0[SCAN_ROWS], acc1[SCAN_ROWS];
    for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i + 16 <= n; i += 16) {
        const __m256 g0 = gv ? _mm256_loadu_ps(gv + i) : vg, g1 = gv ? _mm256_loadu_ps(gv + i + 8) : vg;
        const __m256 k0 = _mm256_loadu_ps(k + i), k1 = _mm256_loadu_ps(k + i + 8);
        for (int r = 0; r < R; r++) {
            float *mr = m + r * rs;
            const __m256 m0 = _mm256_mul_ps(_mm256_loadu_ps(mr + i), g0);
            const __m256 m1 = _mm256_mul_ps(_mm256_loadu_ps(mr + i + 8), g1);
            _mm256_storeu_ps(mr + i, m0);
            _mm256_storeu_ps(mr + i + 8, m1);
            acc0[r] = _mm256_add_ps(acc0[r], _mm256_mul_ps(m0, k0));
            acc1[r] = _mm256_add_ps(acc1[r], _mm256_mul_ps(m1, k1));
        }
    }
    for (int r = 0; r < R; r++) out[r] = scan_hsum8(_mm256_add_ps(acc0[r], acc1[r]));
}

/* m[i] += d[r] * k[i]; out[r] = sum_i m[i] * q[i] */
static inline __attribute__((always_inline)) void scan_axpy_dot_rows(float *m, int64_t rs, const int R,
                                                                     const float *d, const float *restrict k,
                                                                     const float *restrict q, int64_t n, float *out) {
    __m256 acc0[SCAN_ROWS], acc1[SCAN_ROWS], vd[SCAN_ROWS];
    for (int r = 0; r < R; r++) {
        acc0[r] = acc1[r] = _mm256_setzero_ps();
        vd[r] = _mm256_set1_ps(d[r]);
    }
    for (int64_t i = 0; i + 16 <= n; i += 16) {
        const __m256 k0 = _mm256_loadu_ps(k + i), k1 = _mm256_loadu_ps(k + i + 8);
        const __m256 q0 = _mm256_loadu_ps(q + i), q1 = _mm256_loadu_ps(q + i + 8);
        for (int r = 0; r < R; r++) {
            float *mr = m + r * rs;
            const __m256 m0 = _mm256_add_ps(_mm256_loadu_ps(mr + i), _mm256_mul_ps(vd[r], k0));
            const __m256 m1 = _mm256_add_ps(_mm256_loadu_ps(mr + i + 8), _mm256_mul_ps(vd[r], k1));
            _mm256_storeu_ps(mr + i, m0);
            _mm256_storeu_ps(mr + i + 8, m1);
            acc0[r] = _mm256_add_ps(acc0[r], _mm256_mul_ps(m0, q0));
            acc1[r] = _mm256_add_ps(acc1[r], _mm256_mul_ps(m1, q1));
        }
    }
    for (int r = 0; r < R; r++) out[r] = scan_hsum8(_mm256_add_ps(acc0[r], acc1[r]));
}
#endif

/* m[i] = m[i] * (gv ? gv[i] : g); returns sum_i m[i] * k[i]: the vector part, then a scalar tail */
static inline float scan_scale_dot(float *restrict m, const float *restrict gv, float g, const float *restrict k,
                                   int64_t n) {
    int64_t i = 0;
    float acc = 0.0f;
#if defined(__AVX__)
    if (n >= 16) {
        i = n - n % 16;
        scan_scale_dot_rows(m, 0, 1, gv, g, k, i, &acc);
    }
#endif
    for (; i < n; i++) {
        m[i] = m[i] * (gv ? gv[i] : g);
        acc += m[i] * k[i];
    }
    return acc;
}

/* m[i] = m[i] + d * k[i]; returns sum_i m[i] * q[i]: the vector part, then a scalar tail */
static inline float scan_axpy_dot(float *restrict m, float d, const float *restrict k, const float *restrict q,
                                  int64_t n) {
    int64_t i = 0;
    float acc = 0.0f;
#if defined(__AVX__)
    if (n >= 16) {
        i = n - n % 16;
        scan_axpy_dot_rows(m, 0, 1, &d, k, q, i, &acc);
    }
#endif
    for (; i < n; i++) {
        m[i] = m[i] + d * k[i];
        acc += m[i] * q[i];
    }
    return acc;
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

/* A state store fused into the scan (mg_node.store, set up by the plan builder): the scan writes
 * slot j of sequence q straight into the store's row (q, j) of the cache instead of after its main
 * output, which saves the store's copy of every state. The source state of a sequence is read whole
 * by its jobs before they write, so slot 0 may be that very source (a state updated in place); any
 * other overlap between one sequence's slots and a source another sequence still has to read (a
 * sequence moved into a cell another one leaves this step) makes the run write after the output as
 * usual, and the store's copy then runs. Every chunk decides alike: the decision is the data's. */
typedef const char *(*state_src_fn)(const mg_node *n, int64_t q);

static inline char *store_slot(const mg_node *n, int64_t q, int64_t j) {
    return n->store.data + q * n->store.nb[1] + j * n->store.nb[2];
}

static int store_ok(const mg_node *n, int64_t ns, int64_t K, state_src_fn src, int64_t bytes) {
    if (n->store.data == NULL) return 0;
    for (int64_t q = 0; q < ns; q++)
        for (int64_t j = 0; j < K; j++) {
            const char *d = store_slot(n, q, j);
            for (int64_t r = 0; r < ns; r++) {
                const char *s = src(n, r);
                if (d < s + bytes && s < d + bytes && !(r == q && j == 0 && d == s)) return 0;
            }
        }
    return 1;
}

static void store_decide(const mg_node *n, int fused) {
    if (n->stored) __atomic_store_n(n->stored, (int64_t)fused, __ATOMIC_RELAXED);
}

static const char *scan_src(const mg_node *n, int64_t q) {
    int32_t row;
    memcpy(&row, n->src[6].data + q * n->src[6].nb[0], 4);
    return mg_ptr(&n->src[0], 0, 0, 0, row);
}

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
    const int fused = store_ok(n, ns, K, scan_src, ds * hd * nh * 4);
    store_decide(n, fused);
    if (T <= 0 || heads_per_group <= 0) return;
    int64_t j0, j1;
    mg_split(ns * nh, ith, nth, &j0, &j1);
    for (int64_t job = j0; job < j1; job++) {
        const int64_t q = job / nh, h = job % nh, g = h / heads_per_group;
        int32_t row;
        memcpy(&row, ids->data + q * ids->nb[0], 4);
        float *st = fused ? (float *)store_slot(n, q, 0) + h * hd * ds             /* [ds, hd] working state = slot 0 */
                          : out + ny + ((0 * ns + q) * nh + h) * hd * ds;
        if (n->side)   /* the undo journal's copy of this head's state, before anything writes it */
            mg_copy_streaming(n->side + (q * nh + h) * hd * ds * 4, mg_ptr(s, 0, 0, h, row), hd * ds * 4);
        if ((const char *)st != mg_ptr(s, 0, 0, h, row))                            /* not in place */
            for (int64_t p = 0; p < hd; p++)
                memcpy(st + p * ds, mg_ptr(s, 0, p, h, row), (size_t)ds * 4);
        for (int64_t t = 0; t < T; t++) {
            const float dsp = softplus_f(mg_load_f32(mg_ptr(dt, h, t, q, 0)));
            const float *xr = (const float *)mg_ptr(x, 0, h, t, q);                 /* [hd] */
            const float *Br = (const float *)mg_ptr(B, 0, g, t, q);                 /* [ds] */
            const float *Cr = (const float *)mg_ptr(C, 0, g, t, q);                 /* [ds] */
            float *y = out + ((q * T + t) * nh + h) * hd;                           /* [hd] */
            const int64_t slot_t = T - 1 - t;
            if (!mamba1 && t + 1 < T && !(slot_t >= 1 && slot_t < K)) {
                /* tokens t and t + 1 together (t's state is not stored): the same results */
                const float dsp1 = softplus_f(mg_load_f32(mg_ptr(dt, h, t + 1, q, 0)));
                const float *xr1 = (const float *)mg_ptr(x, 0, h, t + 1, q);
                const float *Br1 = (const float *)mg_ptr(B, 0, g, t + 1, q);
                const float *Cr1 = (const float *)mg_ptr(C, 0, g, t + 1, q);
                float *y1 = out + ((q * T + t + 1) * nh + h) * hd;
                const float Ah = mg_load_f32(mg_ptr(A, 0, h, 0, 0));
                const float dA = expf(dsp * Ah), dA1 = expf(dsp1 * Ah);
                for (int64_t p = 0; p < hd; p++)
                    scan_update_dot2(st + p * ds, dA, Br, xr[p] * dsp, Cr, dA1, Br1, xr1[p] * dsp1, Cr1, ds, y + p,
                                     y1 + p);
                t++;   /* the state after t + 1: stored below when that is a slot */
            } else if (!mamba1) {
                const float dA = expf(dsp * mg_load_f32(mg_ptr(A, 0, h, 0, 0)));
                for (int64_t p = 0; p < hd; p++)
                    y[p] = scan_update_dot(st + p * ds, NULL, dA, Br, xr[p] * dsp, Cr, ds);
            } else {
                float dAbuf[256];                                                   /* exp(dsp * A[:, h]) */
                if (ds <= 256)
                    for (int64_t i = 0; i < ds; i++) dAbuf[i] = expf(dsp * mg_load_f32(mg_ptr(A, i, h, 0, 0)));
                for (int64_t p = 0; p < hd; p++) {
                    const float xdt = xr[p] * dsp;
                    float *sp = st + p * ds;
                    if (ds <= 256) {
                        y[p] = scan_update_dot(sp, dAbuf, 0.0f, Br, xdt, Cr, ds);
                        continue;
                    }
                    float acc = 0.0f;
                    for (int64_t i = 0; i < ds; i++) {
                        const float dA = expf(dsp * mg_load_f32(mg_ptr(A, i, h, 0, 0)));
                        sp[i] = sp[i] * dA + Br[i] * xdt;
                        acc += sp[i] * Cr[i];
                    }
                    y[p] = acc;
                }
            }
            const int64_t slot = T - 1 - t;
            if (slot >= 1 && slot < K)
                memcpy(fused ? (float *)store_slot(n, q, slot) + h * hd * ds
                             : out + ny + ((slot * ns + q) * nh + h) * hd * ds, st, (size_t)(hd * ds) * 4);
        }
    }
    if (n->side) mg_stream_fence();
}

/* ---------------------------------------------------------------------------------------- */
/* GATED_DELTA_NET (ggml_gated_delta_net, the state kept transposed): per sequence and head, with M[j][i] = S[i][j]:
 *   M *= exp(g)  (per column i, or scalar), delta_j = (v_j - M[j].k) * beta,
 *   M[j] += delta_j * k, out_j = M[j].q / sqrt(S).
 *   q = src[0] [S, H_q, T, n_q], k = src[1] [S, H_k, T, n_k]: heads tiled (h % H_q),
 *       sequences broadcast by division (sq / (n_seqs / n_q)), rows dense
 *   v = src[2] [S, H, T, n_seqs], g = src[3] [1 or S, H, T, n_seqs], beta = src[4] [1, H, T, n_seqs]
 *   state = src[5] [S, S, H, n_seqs] contiguous: element (i, j, h, sq) = M[j][i]
 *   dst f32 [S*H, T*n_seqs + K*S*n_seqs]: out [S, H, T, n_seqs], then M [S, S, H, n_seqs, K] */
/* tokens per pass over the state. In-process A/B on this Zen 3 core (S 128, 8 heads, 512 tokens,
 * 1 thread, two runs): 1 token 17.3-17.9 ms, 4 tokens 16.7-16.9; per-column gates (kda)
 * 24.4-32.7 -> 21.6-27.6 ms; 8 tokens no better than 4 */
#define GDN_TB 4
static const char *gdn_src(const mg_node *n, int64_t q) { return mg_ptr(&n->src[5], 0, 0, 0, q); }

void mg_k_gated_delta_net(const mg_node *n, int ith, int nth) {
    const mg_tensor *qt = &n->src[0], *kt = &n->src[1], *vt = &n->src[2];
    const mg_tensor *gt = &n->src[3], *bt = &n->src[4], *state = &n->src[5];
    const int64_t K = n->ip[0];
    const int64_t S = vt->ne[0], H = vt->ne[1], T = vt->ne[2], ns = vt->ne[3];
    const int kda = gt->ne[0] != 1;
    float *out = (float *)n->dst.data;
    const int64_t n_o = S * H * T * ns;
    const float scale = 1.0f / sqrtf((float)S);
    const int fused = store_ok(n, ns, K, gdn_src, S * S * H * 4);
    store_decide(n, fused);
    if (T <= 0 || qt->ne[1] <= 0 || kt->ne[1] <= 0 || qt->ne[3] <= 0 || kt->ne[3] <= 0) return;
    const int64_t rq = ns / qt->ne[3], rk = ns / kt->ne[3];
    if (rq <= 0 || rk <= 0) return;
    int64_t j0, j1;
    mg_split(ns * H, ith, nth, &j0, &j1);
    for (int64_t job = j0; job < j1; job++) {
        const int64_t sq = job / H, h = job % H;
        const int64_t hq = h % qt->ne[1], hk = h % kt->ne[1];
        const int64_t sqq = sq / rq, sqk = sq / rk;
        float *M = fused ? (float *)store_slot(n, sq, 0) + h * S * S               /* [S(i), S(j)] = slot 0 */
                         : out + n_o + ((0 * ns + sq) * H + h) * S * S;
        if ((const char *)M != mg_ptr(state, 0, 0, h, sq))                          /* not in place */
            for (int64_t j = 0; j < S; j++)
                memcpy(M + j * S, mg_ptr(state, 0, j, h, sq), (size_t)S * 4);
        /* tokens in blocks of up to GDN_TB, row by row: each row's operations for the block's
         * tokens in token order, then the next row. A row's updates and sums read only that row,
         * so this is the token-by-token computation, with the state (S x S floats: 64 KiB for
         * S 128, more than L1) read and written once per block instead of once per token. A block
         * ends at a token whose state is stored as a slot. */
        for (int64_t t0 = 0; t0 < T;) {
            int64_t t1 = t0;
            while (t1 < T && t1 - t0 < GDN_TB) {
                const int64_t slot = T - 1 - t1++;
                if (slot >= 1 && slot < K) break;
            }
            const float *q[GDN_TB], *k[GDN_TB], *v[GDN_TB], *g[GDN_TB];
            float beta[GDN_TB], g0[GDN_TB], *o[GDN_TB];
            float gbuf[GDN_TB][256];                                                /* exp(g) per column */
            const int nb = (int)(t1 - t0);
            for (int u = 0; u < nb; u++) {
                const int64_t t = t0 + u;
                q[u] = (const float *)mg_ptr(qt, 0, hq, t, sqq);                    /* [S] */
                k[u] = (const float *)mg_ptr(kt, 0, hk, t, sqk);                    /* [S] */
                v[u] = (const float *)mg_ptr(vt, 0, h, t, sq);                      /* [S] */
                g[u] = (const float *)mg_ptr(gt, 0, h, t, sq);                      /* [1 or S] */
                beta[u] = mg_load_f32(mg_ptr(bt, 0, h, t, sq));
                o[u] = out + ((sq * T + t) * H + h) * S;                            /* [S] */
                g0[u] = expf(g[u][0]);
                if (kda && S <= 256)
                    for (int64_t i = 0; i < S; i++) gbuf[u][i] = expf(g[u][i]);
            }
            int64_t j = 0;
#if defined(__AVX__)
            if (S % 16 == 0 && (!kda || S <= 256))   /* SCAN_ROWS rows at once: the same operations */
                for (; j + SCAN_ROWS <= S; j += SCAN_ROWS) {
                    float *Mj = M + j * S;                                          /* [SCAN_ROWS, S] */
                    for (int u = 0; u < nb; u++) {
                        float kv[SCAN_ROWS], delta[SCAN_ROWS], dot[SCAN_ROWS];
                        scan_scale_dot_rows(Mj, S, SCAN_ROWS, kda ? gbuf[u] : NULL, g0[u], k[u], S, kv);
                        for (int r = 0; r < SCAN_ROWS; r++) delta[r] = (v[u][j + r] - kv[r]) * beta[u];
                        scan_axpy_dot_rows(Mj, S, SCAN_ROWS, delta, k[u], q[u], S, dot);
                        for (int r = 0; r < SCAN_ROWS; r++) o[u][j + r] = scale * dot[r];
                    }
                }
#endif
            for (; j < S; j++) {
                float *Mj = M + j * S;                                              /* [S] */
                for (int u = 0; u < nb; u++) {
                    float kv = 0.0f;
                    if (kda && S <= 256) {
                        kv = scan_scale_dot(Mj, gbuf[u], 0.0f, k[u], S);
                    } else if (kda) {
                        for (int64_t i = 0; i < S; i++) { Mj[i] = Mj[i] * expf(g[u][i]); kv += Mj[i] * k[u][i]; }
                    } else {
                        kv = scan_scale_dot(Mj, NULL, g0[u], k[u], S);
                    }
                    const float delta = (v[u][j] - kv) * beta[u];
                    o[u][j] = scale * scan_axpy_dot(Mj, delta, k[u], q[u], S);
                }
            }
            const int64_t slot = T - t1;   /* the state after the block's last token t1 - 1 */
            if (slot >= 1 && slot < K)
                memcpy(fused ? (float *)store_slot(n, sq, slot) + h * S * S
                             : out + n_o + ((slot * ns + sq) * H + h) * S * S, M, (size_t)(S * S) * 4);
            t0 = t1;
        }
    }
}

MG_KERNEL(SSM_CONV, mg_k_ssm_conv, NULL)
MG_KERNEL(SSM_SCAN, mg_k_ssm_scan, mg_check_ssm_scan)
MG_KERNEL(GATED_DELTA_NET, mg_k_gated_delta_net, NULL)
