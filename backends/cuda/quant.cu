// Half-precision (bf16) and block-quantized types (q8_0, q4_0, q4_K, q6_K: ggml's byte layouts,
// as in backends/cpu/quant.h): GET_ROWS to f32, CPY f32 <-> bf16 and f32 -> q8_0 / q4_0, and
// MUL_MAT with such weights the way ggml's CPU computes it: src1's rows are first converted to
// the weights' dot type (q8_0, q8_K, f16, bf16) into scratch, then each output element is one
// warp's sum over blocks of (exact integer dot product) * (the blocks' scales). Values and
// bytes agree with ggml's: every product and sum is rounded on its own (__fmul_rn / __fadd_rn,
// no contraction), f16 and bf16 round to nearest even, the q8_0 conversion is ggml's x86 mul_mat
// one (127 / amax, ties to even), q8_K's and q4_0's the reference ones.
// Block fields are read byte by byte (and f16 fields as u16): blocks are 2-byte aligned only.
#include "common.cuh"

__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float((u32)b << 16); }
__device__ __forceinline__ u16 f2bf(float f) {
    const u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 64);   // NaN stays a quiet NaN
    return (u16)((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}
__device__ __forceinline__ float h2f_at(const char *p) { h16 h; h.bits = ld<u16>(p); return h2f(h); }
__device__ __forceinline__ signed char i8_at(const char *p, int j) { return (signed char)p[j]; }
__device__ __forceinline__ unsigned char u8_at(const char *p, int j) { return (unsigned char)p[j]; }

// value j (0..255) of a q4_K block's 6-bit scale (is_min 0) or min (is_min 1) for sub-block s
__device__ __forceinline__ int q4k_scale(const char *blk, int s, int is_min) {
    const char *q = blk + 4;   // after d, dmin (f16)
    if (s < 4) return u8_at(q, s + 4 * is_min) & 63;
    if (!is_min) return (u8_at(q, s + 4) & 0xf) | ((u8_at(q, s - 4) >> 6) << 4);
    return (u8_at(q, s + 4) >> 4) | ((u8_at(q, s) >> 6) << 4);
}

// level j of a block, as an int (q4_0: nibble - 8; q4_K: nibble; q6_K: 6 bits - 32)
__device__ __forceinline__ int q4_0_level(const char *blk, int j) {
    const int b = u8_at(blk + 2, j & 15);
    return (j < 16 ? (b & 0xf) : (b >> 4)) - 8;
}
__device__ __forceinline__ int q4k_level(const char *blk, int j) {
    const int b = u8_at(blk + 16, 32 * (j / 64) + (j & 31));
    return (j & 32) ? (b >> 4) : (b & 0xf);
}
__device__ __forceinline__ int q6k_level(const char *blk, int j) {
    const int h = j / 128, r = j & 127, l = r & 31, k = r / 32;   // k: which quarter of the half
    const int ql = u8_at(blk, 64 * h + l + 32 * (k & 1));
    const int qh = u8_at(blk + 128, 32 * h + l);
    const int lo = k < 2 ? (ql & 0xf) : (ql >> 4);
    return (lo | (((qh >> (2 * k)) & 3) << 4)) - 32;
}

// ---- GET_ROWS to f32: value i0 of row r, with ggml's float operations ----
template <int T> __device__ __forceinline__ float dequant(const char *row, i64 i0);
template <> __device__ __forceinline__ float dequant<0>(const char *row, i64 i0) {   // bf16
    return bf2f(ld<u16>(row + 2 * i0));
}
template <> __device__ __forceinline__ float dequant<1>(const char *row, i64 i0) {   // q8_0
    const char *blk = row + (i0 / 32) * 34;
    return __fmul_rn((float)i8_at(blk + 2, (int)(i0 % 32)), h2f_at(blk));
}
template <> __device__ __forceinline__ float dequant<2>(const char *row, i64 i0) {   // q4_0
    const char *blk = row + (i0 / 32) * 18;
    return __fmul_rn((float)q4_0_level(blk, (int)(i0 % 32)), h2f_at(blk));
}
template <> __device__ __forceinline__ float dequant<3>(const char *row, i64 i0) {   // q4_K
    const char *blk = row + (i0 / 256) * 144;
    const int j = (int)(i0 % 256), s = j / 32;
    const float d = __fmul_rn(h2f_at(blk), (float)q4k_scale(blk, s, 0));
    const float m = __fmul_rn(h2f_at(blk + 2), (float)q4k_scale(blk, s, 1));
    return __fadd_rn(__fmul_rn(d, (float)q4k_level(blk, j)), -m);
}
template <> __device__ __forceinline__ float dequant<4>(const char *row, i64 i0) {   // q6_K
    const char *blk = row + (i0 / 256) * 210;
    const int j = (int)(i0 % 256);
    const int sc = i8_at(blk + 192, j / 16);
    return __fmul_rn(__fmul_rn(h2f_at(blk + 208), (float)sc), (float)q6k_level(blk, j));
}

template <int T>
__device__ __forceinline__ void get_rows_q(i64 n, DIVS(dd), const char *a, NB4(a), const char *b, NB4(b),
                                           char *dst, NB4(d)) {
    GRID_STRIDE_LOOP(i, n) {
        i64 i0, i1, i2, i3;
        unflat(i, n, DIVS_PASS(dd), i0, i1, i2, i3);
        const i64 r = (i64)ld<int>(b + i1 * b_nb0 + i2 * b_nb1 + i3 * b_nb2);
        st<float>(dst + OFFS(d, i0, i1, i2, i3), dequant<T>(a + r * a_nb1 + i2 * a_nb2 + i3 * a_nb3, i0));
    }
}
#define GRQ_PARAMS i64 n, DIVS(dd), const char *a, NB4(a), const char *b, NB4(b), char *dst, NB4(d)
#define GRQ_ARGS n, DIVS_PASS(dd), a, NB4_PASS(a), b, NB4_PASS(b), dst, NB4_PASS(d)
extern "C" __global__ void get_rows_bf16_f32(GRQ_PARAMS) { get_rows_q<0>(GRQ_ARGS); }
extern "C" __global__ void get_rows_q8_0_f32(GRQ_PARAMS) { get_rows_q<1>(GRQ_ARGS); }
extern "C" __global__ void get_rows_q4_0_f32(GRQ_PARAMS) { get_rows_q<2>(GRQ_ARGS); }
extern "C" __global__ void get_rows_q4_k_f32(GRQ_PARAMS) { get_rows_q<3>(GRQ_ARGS); }
extern "C" __global__ void get_rows_q6_k_f32(GRQ_PARAMS) { get_rows_q<4>(GRQ_ARGS); }

// ---- CPY f32 <-> bf16 (flat logical order, any shapes with the same count) ----
#define CQ_PARAMS i64 n, DIVS(dd), DIVS(sd), const char *src, NB4(s), char *dst, NB4(d)
extern "C" __global__ void cpy_f32_bf16(CQ_PARAMS) {
    GRID_STRIDE_LOOP(i, n) {
        i64 a0, a1, a2, a3, b0, b1, b2, b3;
        unflat(i, n, DIVS_PASS(sd), a0, a1, a2, a3);
        unflat(i, n, DIVS_PASS(dd), b0, b1, b2, b3);
        st<u16>(dst + OFFS(d, b0, b1, b2, b3), f2bf(ld<float>(src + OFFS(s, a0, a1, a2, a3))));
    }
}
extern "C" __global__ void cpy_bf16_f32(CQ_PARAMS) {
    GRID_STRIDE_LOOP(i, n) {
        i64 a0, a1, a2, a3, b0, b1, b2, b3;
        unflat(i, n, DIVS_PASS(sd), a0, a1, a2, a3);
        unflat(i, n, DIVS_PASS(dd), b0, b1, b2, b3);
        st<float>(dst + OFFS(d, b0, b1, b2, b3), bf2f(ld<u16>(src + OFFS(s, a0, a1, a2, a3))));
    }
}

// ---- f32 values -> one block (x: the block's values, xs: their byte stride) ----
__device__ __forceinline__ void to_q8_0(const char *x, i64 xs, char *blk) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(ld<float>(x + j * xs)));
    st<u16>(blk, f2h(amax / 127.0f).bits);
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    for (int j = 0; j < 32; j++) blk[2 + j] = (char)(signed char)__float2int_rn(__fmul_rn(ld<float>(x + j * xs), id));
}
__device__ __forceinline__ void to_q4_0(const char *x, i64 xs, char *blk) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < 32; j++) {
        const float v = ld<float>(x + j * xs);
        if (amax < fabsf(v)) { amax = fabsf(v); max = v; }
    }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    st<u16>(blk, f2h(d).bits);
    for (int j = 0; j < 16; j++) {
        const int a = (signed char)(int)__fadd_rn(__fmul_rn(ld<float>(x + j * xs), id), 8.5f);
        const int b = (signed char)(int)__fadd_rn(__fmul_rn(ld<float>(x + (j + 16) * xs), id), 8.5f);
        blk[2 + j] = (char)((a < 15 ? a : 15) | ((b < 15 ? b : 15) << 4));
    }
}
// q8_K: 4-byte f32 scale, 256 int8, 16 int16 sums (292 bytes; blocks here 4-byte aligned)
__device__ __forceinline__ void to_q8_K(const char *x, i64 xs, char *blk) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < 256; j++) {
        const float v = ld<float>(x + j * xs);
        if (fabsf(v) > amax) { amax = fabsf(v); max = v; }
    }
    if (amax == 0.0f) {
        for (int j = 0; j < 292; j++) blk[j] = 0;
        return;
    }
    const float iscale = -127.0f / max;
    for (int g = 0; g < 16; g++) {
        int sum = 0;
        for (int j = 16 * g; j < 16 * g + 16; j++) {
            int v = __float2int_rn(__fmul_rn(iscale, ld<float>(x + j * xs)));
            v = v < 127 ? v : 127;
            blk[4 + j] = (char)(signed char)v;
            sum += v;
        }
        st<short>(blk + 260 + 2 * g, (short)sum);
    }
    st<float>(blk, 1.0f / iscale);
}

// CPY f32 -> q8_0 / q4_0: one thread per destination block; the source rows are whole blocks and
// the destination is contiguous, so block q holds source values [32 q, 32 q + 32) (flat order)
template <int T>
__device__ __forceinline__ void cpy_to_blocks(i64 n_blocks, DIVS(sd), const char *src, NB4(s), char *dst) {
    GRID_STRIDE_LOOP(q, n_blocks) {
        i64 a0, a1, a2, a3;
        unflat(q * 32, n_blocks * 32, DIVS_PASS(sd), a0, a1, a2, a3);
        const char *x = src + OFFS(s, a0, a1, a2, a3);
        if (T == 1) to_q8_0(x, s_nb0, dst + q * 34);
        else to_q4_0(x, s_nb0, dst + q * 18);
    }
}
#define CB_PARAMS i64 n_blocks, DIVS(sd), const char *src, NB4(s), char *dst
#define CB_ARGS n_blocks, DIVS_PASS(sd), src, NB4_PASS(s), dst
extern "C" __global__ void cpy_f32_q8_0(CB_PARAMS) { cpy_to_blocks<1>(CB_ARGS); }
extern "C" __global__ void cpy_f32_q4_0(CB_PARAMS) { cpy_to_blocks<2>(CB_ARGS); }

// ---- MUL_MAT step 1: src1 [K, N, n2, n3] f32 -> rows of the dot type, contiguous in scratch ----
// one thread per (row, block) for q8_0 (T 1) and q8_K (T 3), per value for f16 (T 5) / bf16 (T 6)
template <int T>
__device__ __forceinline__ void src1_convert(i64 n, i64 per_row, DIVS(rd), const char *src, NB4(s), char *dst,
                                             i64 row_bytes) {
    GRID_STRIDE_LOOP(i, n) {
        const i64 r = i / per_row, q = i % per_row;
        i64 r1, r2, r3, unused;
        unflat(r, n / per_row, DIVS_PASS(rd), r1, r2, r3, unused);
        const char *row = src + r1 * s_nb1 + r2 * s_nb2 + r3 * s_nb3;
        char *out = dst + r * row_bytes;
        if (T == 1) to_q8_0(row + 32 * q * s_nb0, s_nb0, out + 34 * q);
        if (T == 3) to_q8_K(row + 256 * q * s_nb0, s_nb0, out + 292 * q);
        if (T == 5) st<u16>(out + 2 * q, f2h(ld<float>(row + q * s_nb0)).bits);
        if (T == 6) st<u16>(out + 2 * q, f2bf(ld<float>(row + q * s_nb0)));
    }
}
#define SC_PARAMS i64 n, i64 per_row, DIVS(rd), const char *src, NB4(s), char *dst, i64 row_bytes
#define SC_ARGS n, per_row, DIVS_PASS(rd), src, NB4_PASS(s), dst, row_bytes
extern "C" __global__ void src1_to_q8_0(SC_PARAMS) { src1_convert<1>(SC_ARGS); }
extern "C" __global__ void src1_to_q8_k(SC_PARAMS) { src1_convert<3>(SC_ARGS); }
extern "C" __global__ void src1_to_f16(SC_PARAMS) { src1_convert<5>(SC_ARGS); }
extern "C" __global__ void src1_to_bf16(SC_PARAMS) { src1_convert<6>(SC_ARGS); }

// ---- MUL_MAT step 2: one warp per output element: weight row x converted row ----
// dot_row<T>(x, y, K, lane) is lane's share: blocks (or values, for f16 / bf16) lane, lane + 32,
// ... in order; the warp then adds the 32 partial sums (warp_sum: a fixed butterfly order), so an
// output does not depend on the launch shape. Consecutive lanes read consecutive blocks.
template <int T> __device__ __forceinline__ float dot_row(const char *x, const char *y, i64 K, int lane);
template <> __device__ __forceinline__ float dot_row<1>(const char *x, const char *y, i64 K, int lane) {   // q8_0
    float s = 0.0f;
    for (i64 b = lane; b < K / 32; b += 32) {
        const char *xb = x + 34 * b, *yb = y + 34 * b;
        int isum = 0;
        for (int j = 0; j < 32; j++) isum += i8_at(xb + 2, j) * i8_at(yb + 2, j);
        s = __fadd_rn(s, __fmul_rn((float)isum, __fmul_rn(h2f_at(xb), h2f_at(yb))));
    }
    return s;
}
template <> __device__ __forceinline__ float dot_row<2>(const char *x, const char *y, i64 K, int lane) {   // q4_0
    float s = 0.0f;
    for (i64 b = lane; b < K / 32; b += 32) {
        const char *xb = x + 18 * b, *yb = y + 34 * b;
        int isum = 0;
        for (int j = 0; j < 32; j++) isum += q4_0_level(xb, j) * i8_at(yb + 2, j);
        s = __fadd_rn(s, __fmul_rn((float)isum, __fmul_rn(h2f_at(xb), h2f_at(yb))));
    }
    return s;
}
template <> __device__ __forceinline__ float dot_row<3>(const char *x, const char *y, i64 K, int lane) {   // q4_K
    float s = 0.0f, smin = 0.0f;
    for (i64 b = lane; b < K / 256; b += 32) {
        const char *xb = x + 144 * b, *yb = y + 292 * b;
        const float yd = ld<float>(yb);
        int isum = 0, imin = 0;
        for (int sb = 0; sb < 8; sb++) {
            int dj = 0;
            for (int l = 0; l < 32; l++) dj += q4k_level(xb, 32 * sb + l) * i8_at(yb + 4, 32 * sb + l);
            isum += q4k_scale(xb, sb, 0) * dj;
            imin += q4k_scale(xb, sb, 1) * (ld<short>(yb + 260 + 4 * sb) + ld<short>(yb + 262 + 4 * sb));
        }
        s = __fadd_rn(s, __fmul_rn(__fmul_rn(yd, h2f_at(xb)), (float)isum));
        smin = __fadd_rn(smin, __fmul_rn(__fmul_rn(-yd, h2f_at(xb + 2)), (float)imin));
    }
    return __fadd_rn(s, smin);
}
template <> __device__ __forceinline__ float dot_row<4>(const char *x, const char *y, i64 K, int lane) {   // q6_K
    float s = 0.0f;
    for (i64 b = lane; b < K / 256; b += 32) {
        const char *xb = x + 210 * b, *yb = y + 292 * b;
        int isum = 0;
        for (int g = 0; g < 16; g++) {
            int dg = 0;
            for (int l = 0; l < 16; l++) dg += q6k_level(xb, 16 * g + l) * i8_at(yb + 4, 16 * g + l);
            isum += i8_at(xb + 192, g) * dg;
        }
        s = __fadd_rn(s, __fmul_rn(__fmul_rn(ld<float>(yb), h2f_at(xb + 208)), (float)isum));
    }
    return s;
}
template <> __device__ __forceinline__ float dot_row<5>(const char *x, const char *y, i64 K, int lane) {   // f16
    float s = 0.0f;
    for (i64 k = lane; k < K; k += 32) s = __fadd_rn(s, __fmul_rn(h2f_at(x + 2 * k), h2f_at(y + 2 * k)));
    return s;
}
template <> __device__ __forceinline__ float dot_row<6>(const char *x, const char *y, i64 K, int lane) {   // bf16
    float s = 0.0f;
    for (i64 k = lane; k < K; k += 32) s = __fadd_rn(s, __fmul_rn(bf2f(ld<u16>(x + 2 * k)), bf2f(ld<u16>(y + 2 * k))));
    return s;
}

// dst [M, N, n2, n3]: element (m, n, i2, i3) = row m of a's plane (i2 / r2, i3 / r3) . converted
// row (n, i2, i3) (row_bytes apart, contiguous). Block (32, 8): warp threadIdx.y of each block
// takes outputs blockIdx.x * 8 + threadIdx.y, then every gridDim.x * 8-th.
template <int T>
__device__ __forceinline__ void mul_mat_q(i64 n, DIVS(dd), i64 K, i64 r2, i64 r3, const char *a, NB4(a),
                                          const char *y, i64 row_bytes, char *dst, NB4(d)) {
    const int lane = threadIdx.x;
    for (i64 i = (i64)blockIdx.x * blockDim.y + threadIdx.y; i < n; i += (i64)gridDim.x * blockDim.y) {
        i64 m, c, i2, i3;
        unflat(i, n, DIVS_PASS(dd), m, c, i2, i3);
        const i64 ne1 = dd_d1, ne2 = dd_d2;
        const char *x = a + m * a_nb1 + (i2 / r2) * a_nb2 + (i3 / r3) * a_nb3;
        const char *yr = y + ((i3 * ne2 + i2) * ne1 + c) * row_bytes;
        const float s = warp_sum(dot_row<T>(x, yr, K, lane));
        if (lane == 0) st<float>(dst + OFFS(d, m, c, i2, i3), s);
    }
}
#define MQ_PARAMS i64 n, DIVS(dd), i64 K, i64 r2, i64 r3, const char *a, NB4(a), const char *y, i64 row_bytes, char *dst, NB4(d)
#define MQ_ARGS n, DIVS_PASS(dd), K, r2, r3, a, NB4_PASS(a), y, row_bytes, dst, NB4_PASS(d)
extern "C" __global__ void mul_mat_q8_0(MQ_PARAMS) { mul_mat_q<1>(MQ_ARGS); }
extern "C" __global__ void mul_mat_q4_0(MQ_PARAMS) { mul_mat_q<2>(MQ_ARGS); }
extern "C" __global__ void mul_mat_q4_k(MQ_PARAMS) { mul_mat_q<3>(MQ_ARGS); }
extern "C" __global__ void mul_mat_q6_k(MQ_PARAMS) { mul_mat_q<4>(MQ_ARGS); }
extern "C" __global__ void mul_mat_f16(MQ_PARAMS) { mul_mat_q<5>(MQ_ARGS); }
extern "C" __global__ void mul_mat_bf16(MQ_PARAMS) { mul_mat_q<6>(MQ_ARGS); }
