// Row ops over dim 0 (NORM, RMS_NORM, L2_NORM, SUM_ROWS, SOFT_MAX): one block of 256 threads per row,
// sums in double as ggml's CPU backend and the NumPy reference do.
#include "common.cuh"

#define RED_SUM 0
#define RED_RMS 1
#define RED_L2 2

template <int KIND>
__device__ __forceinline__ void reduce_body(i64 nrows, i64 ne0, i64 ne1, i64 ne2, const char *a,
                                            NB4(a), char *dst, NB4(d), float eps) {
    for (i64 r = blockIdx.x; r < nrows; r += gridDim.x) {       // uniform over the block
        const i64 i1 = r % ne1, q = r / ne1, i2 = q % ne2, i3 = q / ne2;
        const char *ar = a + i1 * a_nb1 + i2 * a_nb2 + i3 * a_nb3;
        char *dr = dst + i1 * d_nb1 + i2 * d_nb2 + i3 * d_nb3;
        double s = 0.0;
        for (i64 i0 = threadIdx.x; i0 < ne0; i0 += blockDim.x) {
            const double v = (double)ld<float>(ar + i0 * a_nb0);
            s += KIND == RED_SUM ? v : v * v;
        }
        s = block_sum(s);
        if (KIND == RED_SUM) {
            if (threadIdx.x == 0) st<float>(dr, (float)s);
            continue;
        }
        float scale;
        if (KIND == RED_RMS) {
            const float mean = (float)(s / (double)ne0);
            scale = 1.0f / sqrtf(mean + eps);
        } else {
            const float nrm = sqrtf((float)s);
            scale = 1.0f / (nrm < eps ? eps : nrm);          // NaN stays NaN, as np.maximum
        }
        for (i64 i0 = threadIdx.x; i0 < ne0; i0 += blockDim.x)
            st<float>(dr + i0 * d_nb0, ld<float>(ar + i0 * a_nb0) * scale);
    }
}

#define REDUCE_PARAMS i64 nrows, i64 ne0, i64 ne1, i64 ne2, const char *a, NB4(a), char *dst, NB4(d), float eps
#define REDUCE_ARGS nrows, ne0, ne1, ne2, a, NB4_PASS(a), dst, NB4_PASS(d), eps

extern "C" __global__ void sum_rows_f32(REDUCE_PARAMS) { reduce_body<RED_SUM>(REDUCE_ARGS); }
extern "C" __global__ void rms_norm_f32(REDUCE_PARAMS) { reduce_body<RED_RMS>(REDUCE_ARGS); }
extern "C" __global__ void l2_norm_f32(REDUCE_PARAMS) { reduce_body<RED_L2>(REDUCE_ARGS); }

// max over the whole block (same contract as block_sum)
__device__ __forceinline__ float block_max(float v) {
    __shared__ float part[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();   // part[] may still be read from a previous call
    if (lane == 0) part[warp] = v;
    __syncthreads();
    const int nw = (blockDim.x + 31) / 32;
    v = lane < nw ? part[lane] : -3.402823466e38f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// SOFT_MAX (ggml_soft_max_ext, max_bias == 0): one block per row of a. w = a*scale (+ the mask
// row (i1, i2 % m_ne2, i3 % m_ne3) when has_mask), y = exp(w - max w) * (float)(1 / sum), the sum
// in double. w and the exponentials are staged in dst; each thread reads back only its own.
extern "C" __global__ void soft_max_f32(i64 nrows, i64 ne0, i64 ne1, i64 ne2, const char *a, NB4(a),
                                        i64 has_mask, i64 m_ne2, i64 m_ne3, const char *m, NB4(m),
                                        char *dst, NB4(d), float scale) {
    for (i64 r = blockIdx.x; r < nrows; r += gridDim.x) {       // uniform over the block
        const i64 i1 = r % ne1, q = r / ne1, i2 = q % ne2, i3 = q / ne2;
        const char *ar = a + i1 * a_nb1 + i2 * a_nb2 + i3 * a_nb3;
        const char *mr = m + i1 * m_nb1 + (i2 % m_ne2) * m_nb2 + (i3 % m_ne3) * m_nb3;
        char *dr = dst + i1 * d_nb1 + i2 * d_nb2 + i3 * d_nb3;
        float mx = -3.402823466e38f;
        for (i64 i0 = threadIdx.x; i0 < ne0; i0 += blockDim.x) {
            float w = __fmul_rn(ld<float>(ar + i0 * a_nb0), scale);
            if (has_mask) w = __fadd_rn(w, ld<float>(mr + i0 * m_nb0));
            st<float>(dr + i0 * d_nb0, w);
            mx = fmaxf(mx, w);
        }
        mx = block_max(mx);
        double s = 0.0;
        for (i64 i0 = threadIdx.x; i0 < ne0; i0 += blockDim.x) {
            const float e = expf(ld<float>(dr + i0 * d_nb0) - mx);
            st<float>(dr + i0 * d_nb0, e);
            s += (double)e;
        }
        s = block_sum(s);
        const float inv = (float)(1.0 / s);
        for (i64 i0 = threadIdx.x; i0 < ne0; i0 += blockDim.x)
            st<float>(dr + i0 * d_nb0, __fmul_rn(ld<float>(dr + i0 * d_nb0), inv));
    }
}

// NORM (ggml_norm): one block per row. mean = (float)(sum x) / ne0 in f32; v = x - mean, staged in dst
// (each thread reads back only its own elements); var = (float)(sum v*v / ne0) with v*v rounded
// to f32 first; y = v * (1 / sqrtf(var + eps)). Sums in double, as the CPU kernel.
extern "C" __global__ void norm_f32(REDUCE_PARAMS) {
    for (i64 r = blockIdx.x; r < nrows; r += gridDim.x) {       // uniform over the block
        const i64 i1 = r % ne1, q = r / ne1, i2 = q % ne2, i3 = q / ne2;
        const char *ar = a + i1 * a_nb1 + i2 * a_nb2 + i3 * a_nb3;
        char *dr = dst + i1 * d_nb1 + i2 * d_nb2 + i3 * d_nb3;
        double s = 0.0;
        for (i64 i0 = threadIdx.x; i0 < ne0; i0 += blockDim.x) s += (double)ld<float>(ar + i0 * a_nb0);
        const float mean = (float)block_sum(s) / (float)ne0;
        double s2 = 0.0;
        for (i64 i0 = threadIdx.x; i0 < ne0; i0 += blockDim.x) {
            const float v = ld<float>(ar + i0 * a_nb0) - mean;
            st<float>(dr + i0 * d_nb0, v);
            s2 += (double)__fmul_rn(v, v);
        }
        const float var = (float)(block_sum(s2) / (double)ne0);
        const float scale = 1.0f / sqrtf(var + eps);
        for (i64 i0 = threadIdx.x; i0 < ne0; i0 += blockDim.x)
            st<float>(dr + i0 * d_nb0, __fmul_rn(ld<float>(dr + i0 * d_nb0), scale));
    }
}
