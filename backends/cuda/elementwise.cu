// Elementwise f32 ops: unary math, binary ops with ggml's broadcasting (b's extents divide a's;
// b is read at each coordinate modulo its extent), SCALE / scale_bias. In-place variants write
// into a's own memory: each element is read and written by the same thread.
#include "common.cuh"

// NumPy's float32 formulas, term for term
struct OpSilu     { typedef float T; static __device__ __forceinline__ float f(float x) { return x / (1.0f + expf(-x)); } };
struct OpSigmoid  { typedef float T; static __device__ __forceinline__ float f(float x) { return 1.0f / (1.0f + expf(-x)); } };
struct OpSoftplus { typedef float T; static __device__ __forceinline__ float f(float x) { return x > 20.0f ? x : logf(1.0f + expf(x)); } };
struct OpExp      { typedef float T; static __device__ __forceinline__ float f(float x) { return expf(x); } };
struct OpSqrt     { typedef float T; static __device__ __forceinline__ float f(float x) { return sqrtf(x); } };
// ggml's CPU GELU (its f16 table of the tanh approximation), as backends/cpu/activation.c
struct OpGelu     { typedef float T; static __device__ __forceinline__ float f(float x) {
    if (x <= -10.0f) return 0.0f;
    if (x >= 10.0f) return x;
    const float h = h2f(f2h(x));
    const float inner = fmaf(__fmul_rn(0.044715f, h), h, 1.0f);
    const float t = (float)tanh((double)__fmul_rn(__fmul_rn(0.7978845608028654f, h), inner));
    return h2f(f2h(__fmul_rn(__fmul_rn(0.5f, h), 1.0f + t)));
} };
struct OpNeg      { typedef u32 T;   static __device__ __forceinline__ u32 f(u32 x) { return x ^ 0x80000000u; } };  // exact, any input

template <typename OP>
__device__ __forceinline__ void unary_body(i64 n, DIVS(dd), const char *a, NB4(a), char *dst, NB4(d)) {
    typedef typename OP::T T;
    GRID_STRIDE_LOOP(i, n) {
        i64 i0, i1, i2, i3;
        unflat(i, n, DIVS_PASS(dd), i0, i1, i2, i3);
        st<T>(dst + OFFS(d, i0, i1, i2, i3), OP::f(ld<T>(a + OFFS(a, i0, i1, i2, i3))));
    }
}

#define UNARY_PARAMS i64 n, DIVS(dd), const char *a, NB4(a), char *dst, NB4(d)
#define UNARY_ARGS n, DIVS_PASS(dd), a, NB4_PASS(a), dst, NB4_PASS(d)

extern "C" __global__ void silu_f32(UNARY_PARAMS) { unary_body<OpSilu>(UNARY_ARGS); }
extern "C" __global__ void sigmoid_f32(UNARY_PARAMS) { unary_body<OpSigmoid>(UNARY_ARGS); }
extern "C" __global__ void softplus_f32(UNARY_PARAMS) { unary_body<OpSoftplus>(UNARY_ARGS); }
extern "C" __global__ void exp_f32(UNARY_PARAMS) { unary_body<OpExp>(UNARY_ARGS); }
extern "C" __global__ void sqrt_f32(UNARY_PARAMS) { unary_body<OpSqrt>(UNARY_ARGS); }
extern "C" __global__ void neg_f32(UNARY_PARAMS) { unary_body<OpNeg>(UNARY_ARGS); }
extern "C" __global__ void gelu_f32(UNARY_PARAMS) { unary_body<OpGelu>(UNARY_ARGS); }

struct OpAdd { static __device__ __forceinline__ float f(float x, float y) { return x + y; } };
struct OpSub { static __device__ __forceinline__ float f(float x, float y) { return x - y; } };
struct OpMul { static __device__ __forceinline__ float f(float x, float y) { return x * y; } };
struct OpDiv { static __device__ __forceinline__ float f(float x, float y) { return x / y; } };

// dst[i] = a[i] OP b[i mod b's extents]   (iterates over a's extents = dst's)
template <typename OP>
__device__ __forceinline__ void binary_body(i64 n, DIVS(dd), const char *a, NB4(a), i64 b_ne0,
                                            i64 b_ne1, i64 b_ne2, i64 b_ne3, const char *b,
                                            NB4(b), char *dst, NB4(d)) {
    GRID_STRIDE_LOOP(i, n) {
        i64 i0, i1, i2, i3;
        unflat(i, n, DIVS_PASS(dd), i0, i1, i2, i3);
        const float x = ld<float>(a + OFFS(a, i0, i1, i2, i3));
        const float y = ld<float>(b + OFFS(b, wrap(i0, b_ne0), wrap(i1, b_ne1), wrap(i2, b_ne2), wrap(i3, b_ne3)));
        st<float>(dst + OFFS(d, i0, i1, i2, i3), OP::f(x, y));
    }
}

#define BINARY_PARAMS i64 n, DIVS(dd), const char *a, NB4(a), i64 b_ne0, i64 b_ne1, i64 b_ne2, i64 b_ne3, const char *b, NB4(b), char *dst, NB4(d)
#define BINARY_ARGS n, DIVS_PASS(dd), a, NB4_PASS(a), b_ne0, b_ne1, b_ne2, b_ne3, b, NB4_PASS(b), dst, NB4_PASS(d)

extern "C" __global__ void add_f32(BINARY_PARAMS) { binary_body<OpAdd>(BINARY_ARGS); }
extern "C" __global__ void sub_f32(BINARY_PARAMS) { binary_body<OpSub>(BINARY_ARGS); }
extern "C" __global__ void mul_f32(BINARY_PARAMS) { binary_body<OpMul>(BINARY_ARGS); }
extern "C" __global__ void div_f32(BINARY_PARAMS) { binary_body<OpDiv>(BINARY_ARGS); }

// SCALE: a*s when b == 0, else a*s + b, each step rounded in f32 (no fused multiply-add)
extern "C" __global__ void scale_f32(i64 n, DIVS(dd), const char *a, NB4(a), char *dst, NB4(d),
                                     float s, float b) {
    GRID_STRIDE_LOOP(i, n) {
        i64 i0, i1, i2, i3;
        unflat(i, n, DIVS_PASS(dd), i0, i1, i2, i3);
        float v = __fmul_rn(ld<float>(a + OFFS(a, i0, i1, i2, i3)), s);
        if (b != 0.0f) v = __fadd_rn(v, b);
        st<float>(dst + OFFS(d, i0, i1, i2, i3), v);
    }
}
