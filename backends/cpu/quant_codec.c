/* Conversions between f32 and the half / block-quantized types (layouts in quant.h).
 *
 * to f32 (GET_ROWS, CPY): each value is computed with the same float operations, in the same
 * order, as ggml's dequantize (its scalar code, built without FMA contraction: this file is built
 * with -ffp-contract=off too), so the values agree bit for bit.
 *
 * from f32 (the f32 operand of MUL_MAT, converted once per node to the weights' dot type): the
 * bytes ggml's x86 CPU backend produces for that operand, which for q8_0 is NOT what
 * ggml_quantize_chunk writes (that is the reference code used for files): the mul_mat path
 * scales by 127/amax and rounds half to even, the reference by 1/(amax/127) with ties away from
 * zero. q8_K uses the reference code on x86 (ties to even through the 1.5*2^23 trick, which
 * equals nearbyint for |v| < 2^22). Both builds here (vector and portable) produce the same bytes. */
#include <math.h>
#include "quant.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* ---- to f32 ---- */

static void q4_0_to_f32(const mg_block_q4_0 *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        const float d = mg_fp16_to_fp32(x[i].d);
        for (int j = 0; j < MG_QK4_0 / 2; j++) {
            const int x0 = (x[i].qs[j] & 0x0f) - 8;
            const int x1 = (x[i].qs[j] >> 4) - 8;
            y[i * MG_QK4_0 + j] = (float)x0 * d;
            y[i * MG_QK4_0 + j + MG_QK4_0 / 2] = (float)x1 * d;
        }
    }
}

static void q8_0_to_f32(const mg_block_q8_0 *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        const float d = mg_fp16_to_fp32(x[i].d);
        for (int j = 0; j < MG_QK8_0; j++) y[i * MG_QK8_0 + j] = (float)x[i].qs[j] * d;
    }
}

/* the 6-bit scale and min of sub-block j of a q4_K block: j < 4 in the low 6 bits of bytes j and
 * j + 4; j >= 4 a nibble of byte j + 4 plus the top 2 bits of byte j - 4 (scale) or j (min) */
static inline void q4_K_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

static void q4_K_to_f32(const mg_block_q4_K *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *q = x[i].qs;
        const float d = mg_fp16_to_fp32(x[i].d);
        const float dmin = mg_fp16_to_fp32(x[i].dmin);
        for (int j = 0; j < 8; j += 2) {   /* two sub-blocks share 32 bytes: low, then high nibbles */
            uint8_t sc, m;
            q4_K_scale_min(j, x[i].scales, &sc, &m);
            const float d1 = d * (float)sc, m1 = dmin * (float)m;
            q4_K_scale_min(j + 1, x[i].scales, &sc, &m);
            const float d2 = d * (float)sc, m2 = dmin * (float)m;
            for (int l = 0; l < 32; l++) *y++ = d1 * (float)(q[l] & 0xf) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * (float)(q[l] >> 4) - m2;
            q += 32;
        }
    }
}

static void q6_K_to_f32(const mg_block_q6_K *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        const float d = mg_fp16_to_fp32(x[i].d);
        const uint8_t *ql = x[i].ql, *qh = x[i].qh;
        const int8_t *sc = x[i].scales;
        for (int h = 0; h < 2; h++) {   /* two halves of 128: 64 bytes of ql, 32 of qh, 8 scales */
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = ((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = d * (float)sc[is] * (float)q1;
                y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                y[l + 96] = d * (float)sc[is + 6] * (float)q4;
            }
            y += 128; ql += 64; qh += 32; sc += 8;
        }
    }
}

static void q8_K_to_f32(const mg_block_q8_K *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++)
        for (int j = 0; j < MG_QK_K; j++) y[i * MG_QK_K + j] = x[i].d * (float)x[i].qs[j];
}

void mg_to_f32_row(int t, const void *src, float *dst, int64_t n) {
    switch (t) {
        case MG_Q4_0: q4_0_to_f32(src, dst, n / MG_QK4_0); return;
        case MG_Q8_0: q8_0_to_f32(src, dst, n / MG_QK8_0); return;
        case MG_Q4_K: q4_K_to_f32(src, dst, n / MG_QK_K); return;
        case MG_Q6_K: q6_K_to_f32(src, dst, n / MG_QK_K); return;
        case MG_Q8_K: q8_K_to_f32(src, dst, n / MG_QK_K); return;
        case MG_BF16: {
            const uint16_t *s = src;
            for (int64_t i = 0; i < n; i++) dst[i] = mg_bf16_to_fp32(s[i]);
            return;
        }
        case MG_F16: mg_convert_row((char *)dst, 4, MG_F32, src, 2, MG_F16, n); return;
        case MG_F16F: case MG_BF16F: memcpy(dst, src, (size_t)n * sizeof(float)); return;
        default: return;
    }
}

/* ---- from f32 ---- */

/* one q8_0 block the way ggml's x86 mul_mat quantizes its f32 operand (see the file comment) */
static void f32_to_q8_0_block(const float *x, mg_block_q8_0 *y) {
#if defined(__AVX2__)
    __m256 v[4];
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_loadu_ps(x + 8 * k);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
    }
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float am = _mm_cvtss_f32(m4);
    y->d = mg_fp32_to_fp16(am / 127.f);
    const __m256 id = _mm256_set1_ps(am != 0.0f ? 127.f / am : 0.0f);
    __m256i q[4];
    for (int k = 0; k < 4; k++)
        q[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[k], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    /* packs work per 128-bit lane: the permute puts the bytes back in order */
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)y->qs, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    float am = 0.0f;
    for (int j = 0; j < MG_QK8_0; j++) am = fmaxf(am, fabsf(x[j]));
    y->d = mg_fp32_to_fp16(am / 127.f);
    const float id = am != 0.0f ? 127.f / am : 0.0f;
    for (int j = 0; j < MG_QK8_0; j++) {
        const float v = nearbyintf(x[j] * id);   /* the default rounding mode: ties to even */
        y->qs[j] = (int8_t)(v > 127.f ? 127 : v < -128.f ? -128 : v);
    }
#endif
}

/* one q4_0 block as ggml's quantizer writes it (the reference code, which is also what its CPU
 * cpy to q4_0 runs): d = (the value of largest magnitude, the first such) / -8, levels
 * trunc(x / d + 8.5) capped at 15 */
static void f32_to_q4_0_block(const float *x, mg_block_q4_0 *y) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < MG_QK4_0; j++) {
        if (amax < fabsf(x[j])) { amax = fabsf(x[j]); max = x[j]; }
    }
    const float d = max / -8;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y->d = mg_fp32_to_fp16(d);
    for (int j = 0; j < MG_QK4_0 / 2; j++) {
        const int8_t a = (int8_t)(x[j] * id + 8.5f), b = (int8_t)(x[j + MG_QK4_0 / 2] * id + 8.5f);
        const uint8_t lo = (uint8_t)(a < 15 ? a : 15), hi = (uint8_t)(b < 15 ? b : 15);
        y->qs[j] = (uint8_t)(lo | (hi << 4));
    }
}

/* one q8_K block: the scale is -127 over the value of largest magnitude (the first such), so that
 * value becomes -127 exactly; values round half to even and are capped at 127 */
static void f32_to_q8_K_block(const float *x, mg_block_q8_K *y) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < MG_QK_K; j++) {
        const float ax = fabsf(x[j]);
        if (ax > amax) { amax = ax; max = x[j]; }
    }
    if (amax == 0.0f) {
        memset(y, 0, sizeof *y);
        return;
    }
    const float iscale = -127.f / max;
#if defined(__AVX2__)
    const __m256 is = _mm256_set1_ps(iscale);
    const __m256i cap = _mm256_set1_epi32(127);
    for (int j = 0; j < MG_QK_K; j += 32) {
        __m256i q[4];
        for (int k = 0; k < 4; k++) {
            const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + j + 8 * k), is);
            q[k] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)), cap);
        }
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(y->qs + j), _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
#else
    for (int j = 0; j < MG_QK_K; j++) {
        const float v = nearbyintf(iscale * x[j]);
        y->qs[j] = (int8_t)(v > 127.f ? 127 : v);
    }
#endif
    for (int j = 0; j < MG_QK_K / 16; j++) {
        int s = 0;
        for (int k = 0; k < 16; k++) s += y->qs[16 * j + k];
        y->bsums[j] = (int16_t)s;
    }
    y->d = 1.0f / iscale;
}

void mg_from_f32_row(int t, const char *src, int64_t snb, void *dst, int64_t n) {
    float tmp[MG_QK_K];
    const int dense = snb == 4;
    switch (t) {
        case MG_F16: mg_convert_row(dst, 2, MG_F16, src, snb, MG_F32, n); return;
        case MG_F16F: case MG_BF16F: {   /* quant.h: the half type's row, widened back */
            const int half = t == MG_F16F ? MG_F16 : MG_BF16;
            uint16_t h[MG_QK_K];
            for (int64_t i = 0; i < n; i += MG_QK_K) {
                const int64_t m = mg_min64(MG_QK_K, n - i);
                mg_from_f32_row(half, src + i * snb, snb, h, m);
                mg_to_f32_row(half, h, (float *)dst + i, m);
            }
            return;
        }
        case MG_BF16: {
            uint16_t *d = dst;
            for (int64_t i = 0; i < n; i++) d[i] = mg_fp32_to_bf16(mg_load_f32(src + i * snb));
            return;
        }
        case MG_Q8_0: {
            mg_block_q8_0 *y = dst;
            for (int64_t b = 0; b < n / MG_QK8_0; b++) {
                const float *x = (const float *)(src + b * MG_QK8_0 * snb);
                if (!dense) {
                    for (int j = 0; j < MG_QK8_0; j++) tmp[j] = mg_load_f32(src + (b * MG_QK8_0 + j) * snb);
                    x = tmp;
                }
                f32_to_q8_0_block(x, &y[b]);
            }
            return;
        }
        case MG_Q4_0: {
            mg_block_q4_0 *y = dst;
            for (int64_t b = 0; b < n / MG_QK4_0; b++) {
                const float *x = (const float *)(src + b * MG_QK4_0 * snb);
                if (!dense) {
                    for (int j = 0; j < MG_QK4_0; j++) tmp[j] = mg_load_f32(src + (b * MG_QK4_0 + j) * snb);
                    x = tmp;
                }
                f32_to_q4_0_block(x, &y[b]);
            }
            return;
        }
        case MG_Q8_0X: {
            const int64_t nb = n / MG_QK8_0;
            int8_t *qs = dst;
            int16_t *s8 = (int16_t *)(qs + 32 * nb);
            char *dd = (char *)(s8 + 16 * nb);
            for (int64_t b = 0; b < nb; b++) {
                mg_block_q8_0 blk;
                mg_from_f32_row(MG_Q8_0, src + b * MG_QK8_0 * snb, snb, &blk, MG_QK8_0);
                memcpy(qs + 32 * b, blk.qs, 32);
                for (int j = 0; j < 16; j++) s8[16 * b + j] = (int16_t)(8 * (blk.qs[2 * j] + blk.qs[2 * j + 1]));
                mg_store_f32(dd + 4 * b, mg_fp16_to_fp32(blk.d));
            }
            return;
        }
        case MG_Q8_0S: {
            mg_block_q8_0s *y = dst;
            for (int64_t b = 0; b < n / MG_QK8_0; b++) {
                mg_block_q8_0 blk;
                mg_from_f32_row(MG_Q8_0, src + b * MG_QK8_0 * snb, snb, &blk, MG_QK8_0);
                int32_t sum = 0;
                for (int j = 0; j < MG_QK8_0; j++) sum += blk.qs[j];
                y[b].d = mg_fp16_to_fp32(blk.d);
                y[b].nsum = -128 * sum;
                memcpy(y[b].qs, blk.qs, MG_QK8_0);
            }
            return;
        }
        case MG_Q8_K: case MG_Q8_KP: {
            mg_block_q8_K *y = dst;
            for (int64_t b = 0; b < n / MG_QK_K; b++) {
                const float *x = (const float *)(src + b * MG_QK_K * snb);
                if (!dense) {
                    for (int j = 0; j < MG_QK_K; j++) tmp[j] = mg_load_f32(src + (b * MG_QK_K + j) * snb);
                    x = tmp;
                }
                f32_to_q8_K_block(x, &y[b]);
                if (t == MG_Q8_KP) {   /* the sums of each 32 values (quant.h) */
                    for (int j = 0; j < 8; j++) y[b].bsums[j] = (int16_t)(y[b].bsums[2 * j] + y[b].bsums[2 * j + 1]);
                    for (int j = 8; j < 16; j++) y[b].bsums[j] = 0;
                }
            }
            return;
        }
        default: return;
    }
}
