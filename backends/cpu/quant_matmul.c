/* MUL_MAT with f16, bf16 or block-quantized weights (src0) and an f32 operand (src1), the way
 * ggml's CPU backend computes it (quant.h), in two plan records:
 *
 *   MUL_MAT:src1_to_dot_type  converts every row of src1 once into a work buffer of the weights'
 *                             dot type (q8_0, q8_K, f16, bf16): threads split its rows;
 *   MUL_MAT                   (this file's mg_mul_mat_blocks, reached from matmul.c when src0 is
 *                             not f32) reads that buffer as its src1: each output is one dot
 *                             product of a weight row with a converted row: integer products per
 *                             block, scaled by the two blocks' scales, summed in f32.
 * The Python side (backends/cpu/__init__.py) inserts the conversion record and owns the buffer.
 *
 * Why these dot products agree with ggml's: the per-block integer sums are exact, the scales are
 * the same f32 products ggml forms, and on AVX2 the float accumulation follows ggml's own lanes
 * and order (8 partial sums per row, one fma per block, one horizontal sum), so results are
 * usually bit-identical to ggml's AVX2 build and otherwise differ by f32 rounding only.
 *
 * Speed: matrix x vector is a stream over the weights (see QROWS / QPF below). The dot
 * functions take R weight rows against one converted row (its block loaded once for the R rows,
 * each row with its own accumulators).
 *
 * Batch invariance: an output element is the same function of (weight row, converted row)
 * whatever R, the thread, the chunk or the number of src1 rows: R only interleaves independent
 * per-row chains, and a src1 row is converted on its own. */
#include <stdlib.h>
#include "quant.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MG_QAVX2 1
#include <immintrin.h>
#endif

/* Tuning knobs (build-time). QROWS: weight rows per pass (1, 2 or 4). Sharing the converted
 * row's loads across 2-4 weight rows measured slower here (AMD EPYC Zen 3, AVX2: 0.6-0.9x at
 * 4096x4096), the weight stream being the limit, so a pass is one row. QPF: how far ahead (bytes)
 * the weight rows are prefetched into L1; 2048 measured 0-15% faster than none. */
#define RMAX 4
#ifndef QROWS
#define QROWS 1
#endif
#ifndef QPF
#define QPF 2048
#endif
#define PREFETCH(p) do { if (QPF) _mm_prefetch((const char *)(p) + QPF, _MM_HINT_T0); } while (0)

#if MG_QAVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* sum of x*y over each 4 bytes, as f32 lanes: x, y int8 with y > -128 (converted rows never hold
 * -128). maddubs multiplies unsigned by signed bytes, so |x| goes unsigned and x's sign onto y;
 * pairs stay below 2*128*127 (no int16 saturation) */
static inline __m256 dot_i8_lanes(__m256i x, __m256i y) {
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#endif

/* ---- q8_0 weights x q8_0 rows ---- */
static inline __attribute__((always_inline)) void dot_q8_0(int64_t nb, const char *const *xr, const int R,
                                                           const mg_block_q8_0 *y, float *out) {
#if MG_QAVX2
    __m256 acc[RMAX];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i qy = _mm256_loadu_si256((const __m256i *)y[b].qs);
        const float dy = mg_fp16_to_fp32(y[b].d);
        for (int r = 0; r < R; r++) {
            const mg_block_q8_0 *x = (const mg_block_q8_0 *)xr[r] + b;
            PREFETCH(x);
            const __m256 d = _mm256_set1_ps(mg_fp16_to_fp32(x->d) * dy);
            acc[r] = _mm256_fmadd_ps(d, dot_i8_lanes(_mm256_loadu_si256((const __m256i *)x->qs), qy), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
#else
    for (int r = 0; r < R; r++) {
        const mg_block_q8_0 *x = (const mg_block_q8_0 *)xr[r];
        float s = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            int isum = 0;
            for (int j = 0; j < MG_QK8_0; j++) isum += x[b].qs[j] * y[b].qs[j];
            s += (float)isum * (mg_fp16_to_fp32(x[b].d) * mg_fp16_to_fp32(y[b].d));
        }
        out[r] = s;
    }
#endif
}

/* ---- q4_0 weights x q8_0 rows (MG_Q8_0X layout, quant.h) ---- */
static inline __attribute__((always_inline)) void dot_q4_0(int64_t nb, const char *const *xr, const int R,
                                                           const void *yrow, float *out) {
    const int8_t *yq = yrow;
    const int16_t *ys8 = (const int16_t *)(yq + 32 * nb);
    const char *yd = (const char *)(ys8 + 16 * nb);
#if MG_QAVX2
    __m256 acc[RMAX];
    const __m256i lo4 = _mm256_set1_epi8(0xf), ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i qy = _mm256_loadu_si256((const __m256i *)(yq + 32 * b));
        const __m256i s8 = _mm256_loadu_si256((const __m256i *)(ys8 + 16 * b));
        const float dy = mg_load_f32(yd + 4 * b);
        for (int r = 0; r < R; r++) {
            const mg_block_q4_0 *x = (const mg_block_q4_0 *)xr[r] + b;
            PREFETCH(x);
            const __m128i raw = _mm_loadu_si128((const __m128i *)x->qs);
            /* low nibbles are values 0..15, high nibbles 16..31 */
            const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), lo4);
            /* pairs of nibble * y minus 8 * (pair of y): pairs of (nibble - 8) * y, as ggml's */
            const __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(nib, qy), s8);
            const __m256 d = _mm256_set1_ps(mg_fp16_to_fp32(x->d) * dy);
            acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
#else
    for (int r = 0; r < R; r++) {
        const mg_block_q4_0 *x = (const mg_block_q4_0 *)xr[r];
        float s = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *y = yq + 32 * b;
            int isum = 0;
            for (int j = 0; j < MG_QK4_0 / 2; j++) {
                isum += ((x[b].qs[j] & 0xf) - 8) * y[j];
                isum += ((x[b].qs[j] >> 4) - 8) * y[j + MG_QK4_0 / 2];
            }
            s += (float)isum * (mg_fp16_to_fp32(x[b].d) * mg_load_f32(yd + 4 * b));
        }
        out[r] = s;
    }
#endif
}

/* the 8 scales and 8 mins of a q4_K block (6 bits each, packed in 12 bytes, quant.h) as bytes:
 * sc[0..3] / m[0..3] are the low 6 bits of bytes 0..3 / 4..7; sc[4..7] / m[4..7] take their low 4
 * bits from the nibbles of bytes 8..11 and their top 2 bits from the top bits of bytes 0..3 / 4..7 */
static inline void q4_K_unpack(const uint8_t *s12, uint32_t sc[2], uint32_t m[2]) {
    uint32_t u0, u1, u2;
    memcpy(&u0, s12, 4); memcpy(&u1, s12 + 4, 4); memcpy(&u2, s12 + 8, 4);
    sc[0] = u0 & 0x3f3f3f3fu;
    m[0] = u1 & 0x3f3f3f3fu;
    sc[1] = (u2 & 0x0f0f0f0fu) | (((u0 >> 6) & 0x03030303u) << 4);
    m[1] = ((u2 >> 4) & 0x0f0f0f0fu) | (((u1 >> 6) & 0x03030303u) << 4);
}

/* ---- q4_K weights x q8_K rows ---- */
static inline __attribute__((always_inline)) void dot_q4_K(int64_t nb, const char *const *xr, const int R,
                                                           const mg_block_q8_K *y, float *out) {
#if MG_QAVX2
    __m256 acc[RMAX];
    __m128 accm[RMAX];
    const __m256i lo4 = _mm256_set1_epi8(0xf);
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); accm[r] = _mm_setzero_ps(); }
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *q8 = y[b].qs;
        /* the sums of each 32 converted values (pairs of bsums), for the mins */
        const __m256i bs = _mm256_loadu_si256((const __m256i *)y[b].bsums);
        const __m128i bs32 = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
        __m256i sumi[RMAX];
        __m256i scl[RMAX];   /* the 8 scales as int16, in both 128-bit halves */
        for (int r = 0; r < R; r++) {
            const mg_block_q4_K *x = (const mg_block_q4_K *)xr[r] + b;
            PREFETCH(x); PREFETCH((const char *)x + 64);
            uint32_t sc[2], m[2];
            q4_K_unpack(x->scales, sc, m);
            const __m128i mins = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)m[1], (int)m[0]));
            const __m128i prod = _mm_madd_epi16(mins, bs32);
            const float dmin = -y[b].d * mg_fp16_to_fp32(x->dmin);
            accm[r] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), accm[r]);
            const __m128i s16 = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)sc[1], (int)sc[0]));
            scl[r] = _mm256_set_m128i(s16, s16);
            sumi[r] = _mm256_setzero_si256();
        }
        for (int j = 0; j < 4; j++) {   /* 64 values: 32 bytes of nibbles against 64 converted values */
            const __m256i q8l = _mm256_loadu_si256((const __m256i *)(q8 + 64 * j));
            const __m256i q8h = _mm256_loadu_si256((const __m256i *)(q8 + 64 * j + 32));
            /* broadcast int16 scales 2j and 2j+1 */
            const __m256i shl = _mm256_set1_epi16((short)(0x0100 + 0x0202 * (2 * j)));
            const __m256i shh = _mm256_set1_epi16((short)(0x0100 + 0x0202 * (2 * j + 1)));
            for (int r = 0; r < R; r++) {
                const mg_block_q4_K *x = (const mg_block_q4_K *)xr[r] + b;
                const __m256i q4 = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * j));
                const __m256i pl = _mm256_madd_epi16(_mm256_shuffle_epi8(scl[r], shl),
                                                     _mm256_maddubs_epi16(_mm256_and_si256(q4, lo4), q8l));
                const __m256i ph = _mm256_madd_epi16(_mm256_shuffle_epi8(scl[r], shh),
                                                     _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(q4, 4), lo4), q8h));
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(pl, ph));
            }
        }
        for (int r = 0; r < R; r++) {
            const mg_block_q4_K *x = (const mg_block_q4_K *)xr[r] + b;
            const float d = y[b].d * mg_fp16_to_fp32(x->d);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        __m128 m = _mm_add_ps(accm[r], _mm_movehl_ps(accm[r], accm[r]));
        m = _mm_add_ss(m, _mm_movehdup_ps(m));
        out[r] = hsum8(acc[r]) + _mm_cvtss_f32(m);
    }
#else
    for (int r = 0; r < R; r++) {
        const mg_block_q4_K *x = (const mg_block_q4_K *)xr[r];
        float s = 0.0f, smin = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            uint32_t sc4[2], m4[2];
            q4_K_unpack(x[b].scales, sc4, m4);
            const uint8_t *sc = (const uint8_t *)sc4, *m = (const uint8_t *)m4;
            int isum = 0, imin = 0;
            for (int j = 0; j < 8; j++) {
                const int8_t *q8 = y[b].qs + 32 * j;
                const uint8_t *q4 = x[b].qs + 32 * (j / 2);
                int dj = 0;
                for (int l = 0; l < 32; l++) dj += (j & 1 ? q4[l] >> 4 : q4[l] & 0xf) * q8[l];
                isum += sc[j] * dj;
                imin += m[j] * (y[b].bsums[2 * j] + y[b].bsums[2 * j + 1]);
            }
            s += (y[b].d * mg_fp16_to_fp32(x[b].d)) * (float)isum;
            smin += (-y[b].d * mg_fp16_to_fp32(x[b].dmin)) * (float)imin;
        }
        out[r] = s + smin;
    }
#endif
}

/* ---- q6_K weights x q8_K rows ---- */
static inline __attribute__((always_inline)) void dot_q6_K(int64_t nb, const char *const *xr, const int R,
                                                           const mg_block_q8_K *y, float *out) {
#if MG_QAVX2
    __m256 acc[RMAX];
    const __m256i m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *q8 = y[b].qs;
        const __m256i bs = _mm256_loadu_si256((const __m256i *)y[b].bsums);
        __m256i sumi[RMAX];
        for (int r = 0; r < R; r++) {
            /* the values are stored +32: subtract 32 * sum(scale * bsum) */
            const mg_block_q6_K *x = (const mg_block_q6_K *)xr[r] + b;
            PREFETCH(x); PREFETCH((const char *)x + 64); PREFETCH((const char *)x + 128);
            const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x->scales));
            sumi[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(bs, s16), 5));
        }
        for (int h = 0; h < 2; h++) {   /* halves of 128 values */
            __m256i q8v[4];
            for (int k = 0; k < 4; k++) q8v[k] = _mm256_loadu_si256((const __m256i *)(q8 + 128 * h + 32 * k));
            for (int r = 0; r < R; r++) {
                const mg_block_q6_K *x = (const mg_block_q6_K *)xr[r] + b;
                const __m256i l1 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * h));
                const __m256i l2 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * h + 32));
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * h));
                /* value k*32 + l: nibble of ql (low: k = 0, 1; high: k = 2, 3) and bits 2k..2k+1 of qh */
                __m256i q[4];
                q[0] = _mm256_or_si256(_mm256_and_si256(l1, m15), _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4));
                q[1] = _mm256_or_si256(_mm256_and_si256(l2, m15), _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(12)), 2));
                q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m15), _mm256_and_si256(hb, _mm256_set1_epi8(48)));
                q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l2, 4), m15),
                                       _mm256_srli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(-64)), 2));
                const int8_t *sc = x->scales + 8 * h;
                __m256i t = _mm256_setzero_si256();
                for (int k = 0; k < 4; k++) {
                    /* 32 values use 2 scales: int16 lanes 0..7 scale 2k, 8..15 scale 2k+1 */
                    const __m256i s = _mm256_set_m128i(_mm_set1_epi16(sc[2 * k + 1]), _mm_set1_epi16(sc[2 * k]));
                    t = _mm256_add_epi32(t, _mm256_madd_epi16(s, _mm256_maddubs_epi16(q[k], q8v[k])));
                }
                sumi[r] = _mm256_add_epi32(sumi[r], t);
            }
        }
        for (int r = 0; r < R; r++) {
            const mg_block_q6_K *x = (const mg_block_q6_K *)xr[r] + b;
            const float d = y[b].d * mg_fp16_to_fp32(x->d);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
#else
    for (int r = 0; r < R; r++) {
        const mg_block_q6_K *x = (const mg_block_q6_K *)xr[r];
        float s = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            int isum = 0;
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = x[b].ql + 64 * h, *qh = x[b].qh + 32 * h;
                const int8_t *sc = x[b].scales + 8 * h, *q8 = y[b].qs + 128 * h;
                for (int l = 0; l < 32; l++) {
                    const int is = l / 16;
                    const int q1 = ((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    const int q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    isum += sc[is] * q1 * q8[l] + sc[is + 2] * q2 * q8[l + 32] + sc[is + 4] * q3 * q8[l + 64] +
                            sc[is + 6] * q4 * q8[l + 96];
                }
            }
            s += (y[b].d * mg_fp16_to_fp32(x[b].d)) * (float)isum;
        }
        out[r] = s;
    }
#endif
}

/* ---- f16 / bf16 weights x rows of the same type: f32 products summed with fma ---- */
#if MG_QAVX2
static inline __m256 load8_h(const uint16_t *p, int bf) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (!bf) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

static inline __attribute__((always_inline)) void dot_half(int64_t K, const char *const *xr, const int R,
                                                           const uint16_t *y, float *out, const int bf) {
#if MG_QAVX2
    /* 4 chains of 8 lanes per row over steps of 32; a tail shorter than 32 is zero-padded (a
     * product with 0 changes no sum) */
    __m256 acc[RMAX][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m256 yv[4];
        for (int c = 0; c < 4; c++) yv[c] = load8_h(y + k + 8 * c, bf);
        for (int r = 0; r < R; r++) {
            const uint16_t *x = (const uint16_t *)xr[r] + k;
            for (int c = 0; c < 4; c++) acc[r][c] = _mm256_fmadd_ps(load8_h(x + 8 * c, bf), yv[c], acc[r][c]);
        }
    }
    if (k < K) {
        uint16_t ty[32] = {0}, tx[32];
        memcpy(ty, y + k, (size_t)(K - k) * 2);
        for (int r = 0; r < R; r++) {
            memset(tx, 0, sizeof tx);
            memcpy(tx, (const uint16_t *)xr[r] + k, (size_t)(K - k) * 2);
            for (int c = 0; c < 4; c++) acc[r][c] = _mm256_fmadd_ps(load8_h(tx + 8 * c, bf), load8_h(ty + 8 * c, bf), acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        out[r] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][2]), _mm256_add_ps(acc[r][1], acc[r][3])));
#else
    for (int r = 0; r < R; r++) {
        const uint16_t *x = (const uint16_t *)xr[r];
        float s = 0.0f;
        for (int64_t k = 0; k < K; k++)
            s += bf ? mg_bf16_to_fp32(x[k]) * mg_bf16_to_fp32(y[k]) : mg_fp16_to_fp32(x[k]) * mg_fp16_to_fp32(y[k]);
        out[r] = s;
    }
#endif
}

/* R weight rows against one converted row; R is a constant in each expansion */
static inline __attribute__((always_inline)) void dot_rows(int t, int64_t K, const char *const *xr, const int R,
                                                           const void *y, float *out) {
    switch (t) {
        case MG_Q8_0: dot_q8_0(K / MG_QK8_0, xr, R, y, out); break;
        case MG_Q4_0: dot_q4_0(K / MG_QK4_0, xr, R, y, out); break;
        case MG_Q4_K: dot_q4_K(K / MG_QK_K, xr, R, y, out); break;
        case MG_Q6_K: dot_q6_K(K / MG_QK_K, xr, R, y, out); break;
        case MG_F16: dot_half(K, xr, R, y, out, 0); break;
        case MG_BF16: dot_half(K, xr, R, y, out, 1); break;
        default: for (int r = 0; r < R; r++) out[r] = 0.0f; break;
    }
}

#define DEFINE_DOT(T)                                                                          \
    static void dot_##T##_4(int64_t K, const char *const *xr, const void *y, float *o) { dot_rows(T, K, xr, 4, y, o); } \
    static void dot_##T##_2(int64_t K, const char *const *xr, const void *y, float *o) { dot_rows(T, K, xr, 2, y, o); } \
    static void dot_##T##_1(int64_t K, const char *const *xr, const void *y, float *o) { dot_rows(T, K, xr, 1, y, o); }
DEFINE_DOT(MG_Q8_0)
DEFINE_DOT(MG_Q4_0)
DEFINE_DOT(MG_Q4_K)
DEFINE_DOT(MG_Q6_K)
DEFINE_DOT(MG_F16)
DEFINE_DOT(MG_BF16)

typedef void (*dot_fn)(int64_t K, const char *const *xr, const void *y, float *o);

/* rows of src0 per job: a job's weights (16 rows of at most K * 34/32 bytes) are re-read from
 * cache for every src1 row */
#define QMB 16

/* MUL_MAT, src0 [K, M, a2, a3] of a half / block type (rows dense), src1 the converted rows
 * [K, N, b2, b3] (contiguous, the dot type), dst [M, N, b2, b3] f32 */
void mg_mul_mat_blocks(const mg_node *n, int ith, int nth) {
    const mg_tensor *a = &n->src[0];
    const mg_tensor *b = &n->src[1];
    const mg_tensor *d = &n->dst;
    const int64_t K = a->ne[0], M = a->ne[1], N = b->ne[1];
    const int64_t r2 = b->ne[2] / a->ne[2], r3 = b->ne[3] / a->ne[3];
    const int64_t mblk = (M + QMB - 1) / QMB, planes = b->ne[2] * b->ne[3];
    dot_fn f4, f2, f1;
    switch (a->type) {
        case MG_Q8_0: f4 = dot_MG_Q8_0_4; f2 = dot_MG_Q8_0_2; f1 = dot_MG_Q8_0_1; break;
        case MG_Q4_0: f4 = dot_MG_Q4_0_4; f2 = dot_MG_Q4_0_2; f1 = dot_MG_Q4_0_1; break;
        case MG_Q4_K: f4 = dot_MG_Q4_K_4; f2 = dot_MG_Q4_K_2; f1 = dot_MG_Q4_K_1; break;
        case MG_Q6_K: f4 = dot_MG_Q6_K_4; f2 = dot_MG_Q6_K_2; f1 = dot_MG_Q6_K_1; break;
        case MG_F16: f4 = dot_MG_F16_4; f2 = dot_MG_F16_2; f1 = dot_MG_F16_1; break;
        case MG_BF16: f4 = dot_MG_BF16_4; f2 = dot_MG_BF16_2; f1 = dot_MG_BF16_1; break;
        default: return;   /* refused by the backend's type table */
    }
    int64_t j0, j1;
    mg_split(planes * mblk, ith, nth, &j0, &j1);
    for (int64_t job = j0; job < j1; job++) {
        const int64_t mb = job % mblk, p = job / mblk;
        const int64_t i2 = p % b->ne[2], i3 = p / b->ne[2];
        const int64_t m0 = mb * QMB, m1 = mg_min64(m0 + QMB, M);
        const char *ap = mg_ptr(a, 0, 0, i2 / r2, i3 / r3);
        for (int64_t j = 0; j < N; j++) {
            const void *y = mg_ptr(b, 0, j, i2, i3);
            char *dp = mg_ptr(d, 0, j, i2, i3);
            float o[RMAX];
            const char *xr[RMAX];
            int64_t i = m0;
            if (K == 0) {
                for (; i < m1; i++) mg_store_f32(dp + i * d->nb[0], 0.0f);
                continue;
            }
            for (; QROWS >= 4 && i + 4 <= m1; i += 4) {
                for (int r = 0; r < 4; r++) xr[r] = ap + (i + r) * a->nb[1];
                f4(K, xr, y, o);
                for (int r = 0; r < 4; r++) mg_store_f32(dp + (i + r) * d->nb[0], o[r]);
            }
            for (; QROWS >= 2 && i + 2 <= m1; i += 2) {
                for (int r = 0; r < 2; r++) xr[r] = ap + (i + r) * a->nb[1];
                f2(K, xr, y, o);
                for (int r = 0; r < 2; r++) mg_store_f32(dp + (i + r) * d->nb[0], o[r]);
            }
            for (; i < m1; i++) {
                xr[0] = ap + i * a->nb[1];
                f1(K, xr, y, o);
                mg_store_f32(dp + i * d->nb[0], o[0]);
            }
        }
    }
}

/* MUL_MAT:src1_to_dot_type: src[0] the f32 operand [K, N, b2, b3] (any strides), dst the work
 * buffer [K, N, b2, b3] of the dot type, contiguous; threads split the rows */
static void mg_k_src1_to_dot_type(const mg_node *n, int ith, int nth) {
    const mg_tensor *s = &n->src[0];
    const mg_tensor *d = &n->dst;
    int64_t r0, r1;
    mg_split(mg_nrows(s), ith, nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        int64_t i1, i2, i3;
        mg_row_coords(s, r, &i1, &i2, &i3);
        mg_from_f32_row(d->type, mg_ptr(s, 0, i1, i2, i3), s->nb[0], mg_ptr(d, 0, i1, i2, i3), s->ne[0]);
    }
}

int mg_work_type(int t) {
    switch (t) {
        case MG_F16: return MG_F16;
        case MG_BF16: return MG_BF16;
        case MG_Q8_0: return MG_Q8_0;
        case MG_Q4_0: return MG_Q8_0X;
        case MG_Q4_K: case MG_Q6_K: return MG_Q8_K;
        default: return -1;
    }
}

int64_t mg_work_row_bytes(int t, int64_t k) {
    const int w = mg_work_type(t);
    return w < 0 ? 0 : mg_row_bytes(w, k);
}

int mg_quant_simd(void) {
#if MG_QAVX2
    return 1;
#else
    return 0;
#endif
}

/* an internal step of MUL_MAT, not a registry op: the name says whose ("OP:step") */
__attribute__((constructor)) static void mg_register_src1_to_dot_type(void) {
    mg_register_kernel("MUL_MAT:src1_to_dot_type", mg_k_src1_to_dot_type, NULL);
}
