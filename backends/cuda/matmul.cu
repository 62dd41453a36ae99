// MUL_MAT in ggml's orientation: dst[m, n, i2, i3] = sum_k a[k, m, i2 / r2, i3 / r3] * b[k, n, i2, i3]
// (b's dims 2/3 broadcast a's by division, r2 = ne2(b) / ne2(a)). 16x16 output tiles through
// shared memory, f32 accumulation with fused multiply-adds; any strides.
#include "common.cuh"

extern "C" __global__ void mul_mat_f32(i64 M, i64 N, i64 K, i64 ne2, i64 ne3, i64 r2, i64 r3,
                                       const char *a, NB4(a), const char *b, NB4(b), char *dst,
                                       NB4(d)) {
    __shared__ float As[16][17];   // As[m][k]
    __shared__ float Bs[16][17];   // Bs[n][k]
    const int tx = threadIdx.x, ty = threadIdx.y;   // block (16, 16)
    for (i64 z = blockIdx.z; z < ne2 * ne3; z += gridDim.z) {
        const i64 i2 = z % ne2, i3 = z / ne2;
        const char *ap = a + (i2 / r2) * a_nb2 + (i3 / r3) * a_nb3;
        const char *bp = b + i2 * b_nb2 + i3 * b_nb3;
        char *dp = dst + i2 * d_nb2 + i3 * d_nb3;
        for (i64 n0 = (i64)blockIdx.y * 16; n0 < N; n0 += (i64)gridDim.y * 16) {
            for (i64 m0 = (i64)blockIdx.x * 16; m0 < M; m0 += (i64)gridDim.x * 16) {
                float acc = 0.0f;
                for (i64 k0 = 0; k0 < K; k0 += 16) {
                    const i64 k = k0 + tx;                     // loads: lanes walk k (rows are contiguous)
                    As[ty][tx] = (k < K && m0 + ty < M) ? ld<float>(ap + k * a_nb0 + (m0 + ty) * a_nb1) : 0.0f;
                    Bs[ty][tx] = (k < K && n0 + ty < N) ? ld<float>(bp + k * b_nb0 + (n0 + ty) * b_nb1) : 0.0f;
                    __syncthreads();
#pragma unroll
                    for (int kk = 0; kk < 16; ++kk) acc = fmaf(As[tx][kk], Bs[ty][kk], acc);
                    __syncthreads();
                }
                const i64 m = m0 + tx, n = n0 + ty;
                if (m < M && n < N) st<float>(dp + m * d_nb0 + n * d_nb1, acc);
            }
        }
    }
}
