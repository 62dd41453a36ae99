// FLASH_ATTN_EXT (ggml_flash_attn_ext), f32 Q/K/V, optional f16 mask: one block of FA_THREADS
// threads per query row. Keys are visited in order; each key's score is one block-wide double
// dot product rounded to f32, then scale, softcap (tanh in double), + slope*mask as the CPU kernel
// forms it (-inf slope*mask: key skipped). Pass 1 finds the max score; pass 2 accumulates the
// exponentials and the weighted V rows in double, each thread owning the output dims
// d = tid, tid + FA_THREADS, ... (at most FA_MAX_DV dims: the backend refuses more).
#include "common.cuh"

// NVRTC has no headers, so no INFINITY: a skipped key is flagged, and the running max starts at
// -FLT_MAX (a row whose keys are all skipped has den == 0 and is written as 0 whatever the max)
#define FA_LOWEST (-3.402823466e38f)
#define FA_THREADS 128
#define FA_PER_THREAD 8   // FA_MAX_DV = FA_THREADS * FA_PER_THREAD = 1024

__device__ __forceinline__ float fa_score(const char *qr, const char *kr, i64 dk, const char *mr, i64 j,
                                          float scale, float cap, float slope, int has_mask, bool &skip) {
    float mv = 0.0f;
    if (has_mask) mv = __fmul_rn(slope, h2f(ld<h16>(mr + j * 2)));   // uniform over the block
    skip = mv < FA_LOWEST;                                            // slope*mask == -inf
    if (skip) return 0.0f;
    double p = 0.0;
    for (i64 d = threadIdx.x; d < dk; d += blockDim.x)
        p += (double)ld<float>(qr + d * 4) * (double)ld<float>(kr + d * 4);
    float s = __fmul_rn((float)block_sum(p), scale);
    if (cap != 0.0f) s = __fmul_rn(cap, (float)tanh((double)s));
    return __fadd_rn(s, mv);
}

extern "C" __global__ void flash_attn_ext_f32(i64 nrows, i64 n_q, i64 n_head, i64 dk, i64 dv, i64 n_kv,
                                              const char *q, NB4(q), const char *k, i64 k_ne2, NB4(k),
                                              const char *v, i64 v_ne2, NB4(v),
                                              i64 has_mask, i64 m_ne2, i64 m_ne3, const char *m, NB4(m),
                                              char *dst, NB4(d), float scale, float max_bias, float cap) {
    for (i64 r = blockIdx.x; r < nrows; r += gridDim.x) {       // uniform over the block
        const i64 iq = r % n_q, t = r / n_q, h = t % n_head, s = t / n_head;
        const char *qr = q + iq * q_nb1 + h * q_nb2 + s * q_nb3;
        const char *kh = k + (h / (n_head / k_ne2)) * k_nb2 + s * k_nb3;
        const char *vh = v + (h / (n_head / v_ne2)) * v_nb2 + s * v_nb3;
        const char *mr = m + iq * m_nb1 + (h % m_ne2) * m_nb2 + (s % m_ne3) * m_nb3;
        float slope = 1.0f;
        if (max_bias > 0.0f) {   // ggml's ALiBi slope of head h
            i64 n_log2 = 1;
            while (n_log2 * 2 <= n_head) n_log2 *= 2;
            const float m0 = powf(2.0f, -(max_bias) / n_log2), m1 = powf(2.0f, -(max_bias / 2.0f) / n_log2);
            slope = h < n_log2 ? powf(m0, (float)(h + 1)) : powf(m1, (float)(2 * (h - n_log2) + 1));
        }
        float mx = FA_LOWEST;
        bool skip;
        for (i64 j = 0; j < n_kv; j++) {
            const float sc = fa_score(qr, kh + j * k_nb1, dk, mr, j, scale, cap, slope, (int)has_mask, skip);
            if (!skip && sc > mx) mx = sc;
        }
        double acc[FA_PER_THREAD];
        for (int i = 0; i < FA_PER_THREAD; i++) acc[i] = 0.0;
        double den = 0.0;
        for (i64 j = 0; j < n_kv; j++) {
            const float sc = fa_score(qr, kh + j * k_nb1, dk, mr, j, scale, cap, slope, (int)has_mask, skip);
            if (skip) continue;
            const double w = exp((double)sc - (double)mx);
            den += w;
            const char *vr = vh + j * v_nb1;
            for (int i = 0; i < FA_PER_THREAD; i++) {
                const i64 d = threadIdx.x + (i64)i * blockDim.x;
                if (d < dv) acc[i] += w * (double)ld<float>(vr + d * v_nb0);
            }
        }
        char *y = dst + h * d_nb1 + iq * d_nb2 + s * d_nb3;
        for (int i = 0; i < FA_PER_THREAD; i++) {
            const i64 d = threadIdx.x + (i64)i * blockDim.x;
            if (d < dv) st<float>(y + d * d_nb0, den == 0.0 ? 0.0f : (float)(acc[i] / den));
        }
    }
}
