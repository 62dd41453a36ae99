// Copies that move data: CPY (into a destination view, with type conversion: f32<->f16,
// f32<->i32, as the registry allows), CONT, cast, CONCAT, REPEAT. Same-type copies move raw bits (b2/b4/b8 = element size in bytes), so they
// are exact for every type, NaN payloads included.
#include "common.cuh"

// dst element with flat logical index i <- src element with flat logical index i (the shapes may
// differ: cpy into a tensor of another shape with the same element count, cont_2d, ...)
template <typename S, typename D>
__device__ __forceinline__ void copy_flat(i64 n, DIVS(dd), DIVS(sd), const char *src, NB4(s),
                                          char *dst, NB4(d)) {
    GRID_STRIDE_LOOP(i, n) {
        i64 a0, a1, a2, a3, b0, b1, b2, b3;
        unflat(i, n, DIVS_PASS(sd), a0, a1, a2, a3);
        unflat(i, n, DIVS_PASS(dd), b0, b1, b2, b3);
        st<D>(dst + OFFS(d, b0, b1, b2, b3), Cvt<D, S>::f(ld<S>(src + OFFS(s, a0, a1, a2, a3))));
    }
}

#define COPY_FLAT_PARAMS i64 n, DIVS(dd), DIVS(sd), const char *src, NB4(s), char *dst, NB4(d)
#define COPY_FLAT_ARGS n, DIVS_PASS(dd), DIVS_PASS(sd), src, NB4_PASS(s), dst, NB4_PASS(d)

extern "C" __global__ void cpy_b2(COPY_FLAT_PARAMS) { copy_flat<u16, u16>(COPY_FLAT_ARGS); }
extern "C" __global__ void cpy_b4(COPY_FLAT_PARAMS) { copy_flat<u32, u32>(COPY_FLAT_ARGS); }
extern "C" __global__ void cpy_b8(COPY_FLAT_PARAMS) { copy_flat<u64, u64>(COPY_FLAT_ARGS); }
extern "C" __global__ void cpy_f32_f16(COPY_FLAT_PARAMS) { copy_flat<float, h16>(COPY_FLAT_ARGS); }
extern "C" __global__ void cpy_f32_i32(COPY_FLAT_PARAMS) { copy_flat<float, int>(COPY_FLAT_ARGS); }
extern "C" __global__ void cpy_f16_f32(COPY_FLAT_PARAMS) { copy_flat<h16, float>(COPY_FLAT_ARGS); }
extern "C" __global__ void cpy_i32_f32(COPY_FLAT_PARAMS) { copy_flat<int, float>(COPY_FLAT_ARGS); }

// Same shape, same type, source "transposed" (its dim 1 has the smaller stride): 32x32 tiles
// through shared memory so that both the reads (along dim 1) and the writes (along dim 0) are
// coalesced. Block (32, 8); grid (tiles of dim 0, tiles of dim 1, ne2*ne3), each looping.
template <typename T>
__device__ __forceinline__ void copy_tiled(i64 ne0, i64 ne1, i64 ne2, i64 ne3, const char *src,
                                           NB4(s), char *dst, NB4(d)) {
    __shared__ T tile[32][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    for (i64 z = blockIdx.z; z < ne2 * ne3; z += gridDim.z) {
        const i64 i2 = z % ne2, i3 = z / ne2;
        const char *sp = src + i2 * s_nb2 + i3 * s_nb3;
        char *dp = dst + i2 * d_nb2 + i3 * d_nb3;
        for (i64 t1 = (i64)blockIdx.y * 32; t1 < ne1; t1 += (i64)gridDim.y * 32) {
            for (i64 t0 = (i64)blockIdx.x * 32; t0 < ne0; t0 += (i64)gridDim.x * 32) {
                for (int k = ty; k < 32; k += 8) {            // read: lanes walk dim 1
                    const i64 i0 = t0 + k, i1 = t1 + tx;
                    if (i0 < ne0 && i1 < ne1) tile[k][tx] = ld<T>(sp + i0 * s_nb0 + i1 * s_nb1);
                }
                __syncthreads();
                for (int k = ty; k < 32; k += 8) {            // write: lanes walk dim 0
                    const i64 i0 = t0 + tx, i1 = t1 + k;
                    if (i0 < ne0 && i1 < ne1) st<T>(dp + i0 * d_nb0 + i1 * d_nb1, tile[tx][k]);
                }
                __syncthreads();
            }
        }
    }
}

#define COPY_TILED_PARAMS i64 ne0, i64 ne1, i64 ne2, i64 ne3, const char *src, NB4(s), char *dst, NB4(d)
#define COPY_TILED_ARGS ne0, ne1, ne2, ne3, src, NB4_PASS(s), dst, NB4_PASS(d)

extern "C" __global__ void cpy_tr_b2(COPY_TILED_PARAMS) { copy_tiled<u16>(COPY_TILED_ARGS); }
extern "C" __global__ void cpy_tr_b4(COPY_TILED_PARAMS) { copy_tiled<u32>(COPY_TILED_ARGS); }
extern "C" __global__ void cpy_tr_b8(COPY_TILED_PARAMS) { copy_tiled<u64>(COPY_TILED_ARGS); }

// CONCAT along dim: coordinates below a's extent read a, the rest read b shifted by a's extent
template <typename T>
__device__ __forceinline__ void concat_body(i64 n, DIVS(dd), i64 dim, i64 a_ext, const char *a,
                                            NB4(a), const char *b, NB4(b), char *dst, NB4(d)) {
    GRID_STRIDE_LOOP(i, n) {
        i64 i0, i1, i2, i3;
        unflat(i, n, DIVS_PASS(dd), i0, i1, i2, i3);
        const i64 c = dim == 0 ? i0 : dim == 1 ? i1 : dim == 2 ? i2 : i3;
        T v;
        if (c < a_ext) {
            v = ld<T>(a + OFFS(a, i0, i1, i2, i3));
        } else {
            const i64 j0 = dim == 0 ? i0 - a_ext : i0;
            const i64 j1 = dim == 1 ? i1 - a_ext : i1;
            const i64 j2 = dim == 2 ? i2 - a_ext : i2;
            const i64 j3 = dim == 3 ? i3 - a_ext : i3;
            v = ld<T>(b + OFFS(b, j0, j1, j2, j3));
        }
        st<T>(dst + OFFS(d, i0, i1, i2, i3), v);
    }
}

#define CONCAT_PARAMS i64 n, DIVS(dd), i64 dim, i64 a_ext, const char *a, NB4(a), const char *b, NB4(b), char *dst, NB4(d)
#define CONCAT_ARGS n, DIVS_PASS(dd), dim, a_ext, a, NB4_PASS(a), b, NB4_PASS(b), dst, NB4_PASS(d)

extern "C" __global__ void concat_b2(CONCAT_PARAMS) { concat_body<u16>(CONCAT_ARGS); }
extern "C" __global__ void concat_b4(CONCAT_PARAMS) { concat_body<u32>(CONCAT_ARGS); }
extern "C" __global__ void concat_b8(CONCAT_PARAMS) { concat_body<u64>(CONCAT_ARGS); }

// REPEAT: dst[i0, i1, i2, i3] = a[i0 % a_ne0, i1 % a_ne1, i2 % a_ne2, i3 % a_ne3]
template <typename T>
__device__ __forceinline__ void repeat_body(i64 n, DIVS(dd), i64 a_ne0, i64 a_ne1, i64 a_ne2,
                                            i64 a_ne3, const char *a, NB4(a), char *dst, NB4(d)) {
    GRID_STRIDE_LOOP(i, n) {
        i64 i0, i1, i2, i3;
        unflat(i, n, DIVS_PASS(dd), i0, i1, i2, i3);
        const i64 j0 = wrap(i0, a_ne0), j1 = wrap(i1, a_ne1), j2 = wrap(i2, a_ne2), j3 = wrap(i3, a_ne3);
        st<T>(dst + OFFS(d, i0, i1, i2, i3), ld<T>(a + OFFS(a, j0, j1, j2, j3)));
    }
}

#define REPEAT_PARAMS i64 n, DIVS(dd), i64 a_ne0, i64 a_ne1, i64 a_ne2, i64 a_ne3, const char *a, NB4(a), char *dst, NB4(d)
#define REPEAT_ARGS n, DIVS_PASS(dd), a_ne0, a_ne1, a_ne2, a_ne3, a, NB4_PASS(a), dst, NB4_PASS(d)

extern "C" __global__ void repeat_b2(REPEAT_PARAMS) { repeat_body<u16>(REPEAT_ARGS); }
extern "C" __global__ void repeat_b4(REPEAT_PARAMS) { repeat_body<u32>(REPEAT_ARGS); }
extern "C" __global__ void repeat_b8(REPEAT_PARAMS) { repeat_body<u64>(REPEAT_ARGS); }
