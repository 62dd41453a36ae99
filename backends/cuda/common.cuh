// minigraph CUDA kernels: shared definitions.
//
// Layout is ggml's: ne[4] element counts, nb[4] byte strides, dim 0 fastest. Kernels take raw
// data pointers plus byte strides, so any strided view works (padded rows, permutations,
// overlapping windows). Every kernel is `extern "C"` so cupy.RawModule finds it by name, and is
// written literally as `extern "C" __global__ void NAME(` (the CPU emulator looks for that).
//
// This file is pasted in front of each .cu file by backends/cuda/__init__.py (NVRTC) and found
// through -I by nvcc (tests/test_cuda_compile.py) and by the CPU emulator (backends/cuda/emu.py).
// Device code here must stay C++11 and must not include any header: NVRTC has none.
#ifndef MG_COMMON_CUH
#define MG_COMMON_CUH

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

// ---------------------------------------------------------------------------------------------
// kernel parameter groups (the Python side passes them in exactly this order)

// byte strides of one operand
#define NB4(p) i64 p##_nb0, i64 p##_nb1, i64 p##_nb2, i64 p##_nb3
#define NB4_PASS(p) p##_nb0, p##_nb1, p##_nb2, p##_nb3
// element offset of (i0, i1, i2, i3) in bytes
#define OFFS(p, i0, i1, i2, i3) ((i0) * p##_nb0 + (i1) * p##_nb1 + (i2) * p##_nb2 + (i3) * p##_nb3)

// divisors (d0, d1, d2) that split a flat index into 4 coordinates, with precomputed
// "division by invariant integer" constants (m, s) for each (see fastdiv below)
#define DIVS(p) i64 p##_d0, i64 p##_d1, i64 p##_d2, u32 p##_m0, u32 p##_s0, u32 p##_m1, u32 p##_s1, u32 p##_m2, u32 p##_s2
#define DIVS_PASS(p) p##_d0, p##_d1, p##_d2, p##_m0, p##_s0, p##_m1, p##_s1, p##_m2, p##_s2

#define FLAT_LIMIT 0x7fffffffLL

// q = n / d for 0 <= n < 2^31 and 1 <= d < 2^31, with m = floor(2^32 (2^s - d) / d) + 1 and
// s = ceil(log2 d) computed on the host: the classic multiply-high division.
__device__ __forceinline__ u32 fastdiv(u32 n, u32 m, u32 s) {
    return (__umulhi(n, m) + n) >> s;
}

// flat index i (in [0, n)) -> (i0, i1, i2, i3) for extents (d0, d1, d2, *)
__device__ __forceinline__ void unflat(i64 i, i64 n, i64 d0, i64 d1, i64 d2, u32 m0, u32 s0,
                                       u32 m1, u32 s1, u32 m2, u32 s2,
                                       i64 &i0, i64 &i1, i64 &i2, i64 &i3) {
    if (n <= FLAT_LIMIT) {
        const u32 q0 = fastdiv((u32)i, m0, s0);
        const u32 q1 = fastdiv(q0, m1, s1);
        const u32 q2 = fastdiv(q1, m2, s2);
        i0 = (i64)((u32)i - q0 * (u32)d0);
        i1 = (i64)(q0 - q1 * (u32)d1);
        i2 = (i64)(q1 - q2 * (u32)d2);
        i3 = (i64)q2;
    } else {
        const i64 q0 = i / d0, q1 = q0 / d1, q2 = q1 / d2;
        i0 = i - q0 * d0;
        i1 = q0 - q1 * d1;
        i2 = q1 - q2 * d2;
        i3 = q2;
    }
}

// x % d for a broadcast source extent d, without a division in the usual cases
__device__ __forceinline__ i64 wrap(i64 x, i64 d) {
    return x < d ? x : (d == 1 ? 0 : x % d);
}

#define GRID_STRIDE_LOOP(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

// ---------------------------------------------------------------------------------------------
// element types and conversions (as NumPy converts: f32->f16 rounds to nearest even, float->int
// truncates toward zero, out of range or NaN gives INT_MIN like x86)

struct h16 { u16 bits; };

#ifdef MG_EMU
__device__ __forceinline__ float h2f(h16 h) { return emu_h2f(h.bits); }
__device__ __forceinline__ h16 f2h(float f) { h16 h; h.bits = emu_f2h(f); return h; }
#else
__device__ __forceinline__ float h2f(h16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
    return f;
}
__device__ __forceinline__ h16 f2h(float f) {
    h16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
    return h;
}
#endif

__device__ __forceinline__ int f2i(float x) {
    return (x > -2147483904.0f && x < 2147483648.0f) ? (int)x : (int)0x80000000u;
}

template <typename D, typename S> struct Cvt;
template <typename T> struct Cvt<T, T> { static __device__ __forceinline__ T f(T x) { return x; } };
template <> struct Cvt<h16, float> { static __device__ __forceinline__ h16 f(float x) { return f2h(x); } };
template <> struct Cvt<int, float> { static __device__ __forceinline__ int f(float x) { return f2i(x); } };
template <> struct Cvt<float, h16> { static __device__ __forceinline__ float f(h16 x) { return h2f(x); } };
template <> struct Cvt<float, int> { static __device__ __forceinline__ float f(int x) { return (float)x; } };

template <typename T> __device__ __forceinline__ T ld(const char *p) { return *(const T *)p; }
template <typename T> __device__ __forceinline__ void st(char *p, T v) { *(T *)p = v; }

// ---------------------------------------------------------------------------------------------
// reductions

template <typename T> __device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// sum over the whole block (blockDim.x a multiple of 32, blockDim.y == blockDim.z == 1);
// every thread gets the result; every thread of the block must call it
__device__ __forceinline__ double block_sum(double v) {
    __shared__ double part[32];
    v = warp_sum(v);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();   // part[] may still be read from a previous call
    if (lane == 0) part[warp] = v;
    __syncthreads();
    const int nw = (blockDim.x + 31) / 32;
    v = lane < nw ? part[lane] : 0.0;
    return warp_sum(v);
}

#endif  // MG_COMMON_CUH
