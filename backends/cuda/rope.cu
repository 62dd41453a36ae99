// ROPE (ggml_rope_ext, ggml_rope_multi) on f32 rows: one thread per (row, item), where items
// 0 .. n_dims/2-1 rotate one pair and the rest copy one element past n_dims. A thread builds its
// pair's angle alone with the CPU kernel's f32 steps (theta = p, then k multiplications by
// theta_scale), so no state is shared between threads or rows and the batch does not matter.
// fp: theta_scale, freq_scale, ext_factor, mscale, corr_lo, corr_hi (derived on the host as the
// CPU kernel derives them); mode 0 NORMAL, 2 NEOX, 8 MROPE, 40 IMROPE.
#include "common.cuh"

// C's MAX/MIN as ggml writes them (a NaN operand is not dropped, unlike fmaxf/fminf)
__device__ __forceinline__ float c_max(float x, float y) { return x > y ? x : y; }
__device__ __forceinline__ float c_min(float x, float y) { return x < y ? x : y; }

__device__ __forceinline__ int rope_stream(int mode, i64 k, i64 s0, i64 s1, i64 s2, i64 s3) {
    const i64 s = k % (s0 + s1 + s2 + s3);
    if (mode == 40) {   // interleaved t, h, w while each stream has pairs left
        if (s % 3 == 1 && s < 3 * s1) return 1;
        if (s % 3 == 2 && s < 3 * s2) return 2;
        if (s % 3 == 0 && s < 3 * s0) return 0;
        return 3;
    }
    return s < s0 ? 0 : s < s0 + s1 ? 1 : s < s0 + s1 + s2 ? 2 : 3;
}

extern "C" __global__ void rope_f32(i64 n, i64 ne0, i64 ne1, i64 ne2, i64 n_dims, i64 mode,
                                    i64 s0, i64 s1, i64 s2, i64 s3,
                                    const char *a, NB4(a), const int *pos, const float *ff, i64 has_ff,
                                    char *dst, NB4(d), float theta_scale, float freq_scale, float ext_factor,
                                    float mscale, float lo, float hi) {
    const i64 half = n_dims / 2, w = half + ne0 - n_dims;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 j = i % w, r = i / w;
        const i64 i1 = r % ne1, q = r / ne1, i2 = q % ne2, i3 = q / ne2;
        const char *x = a + i1 * a_nb1 + i2 * a_nb2 + i3 * a_nb3;
        char *y = dst + i1 * d_nb1 + i2 * d_nb2 + i3 * d_nb3;
        if (j >= half) {   // past the rotated dims: copy
            const i64 e = n_dims + (j - half);
            st<float>(y + e * d_nb0, ld<float>(x + e * a_nb0));
            continue;
        }
        const int multi = mode == 8 || mode == 40;
        const int stream = multi ? rope_stream((int)mode, j, s0, s1, s2, s3) : 0;
        float theta = (float)pos[i2 + stream * ne2];
        for (i64 k = 0; k < j; k++) theta = __fmul_rn(theta, theta_scale);
        const float extrap = theta / (has_ff ? ff[j] : 1.0f);
        const float interp = __fmul_rn(freq_scale, extrap);
        float th = interp;
        if (ext_factor != 0.0f) {
            const float ry = ((float)j - lo) / c_max(0.001f, hi - lo);
            const float mix = __fmul_rn(1.0f - c_min(1.0f, c_max(0.0f, ry)), ext_factor);
            th = fmaf(interp, 1.0f - mix, __fmul_rn(extrap, mix));   // ggml's contraction, as the CPU kernel
        }
        const float cs = __fmul_rn(cosf(th), mscale), sn = __fmul_rn(sinf(th), mscale);
        const i64 j0 = mode == 0 ? 2 * j : j, j1 = mode == 0 ? 2 * j + 1 : j + half;
        const float x0 = ld<float>(x + j0 * a_nb0), x1 = ld<float>(x + j1 * a_nb0);
        st<float>(y + j0 * d_nb0, fmaf(x0, cs, -__fmul_rn(x1, sn)));
        st<float>(y + j1 * d_nb0, fmaf(x0, sn, __fmul_rn(x1, cs)));
    }
}
