// Index ops: GET_ROWS, SET_ROWS (writes through into its destination), ARANGE, and the index
// check that runs before either row op writes anything.
#include "common.cuh"

// flag[0] = 1 when any index of c (flat over its shape) is < 0 or >= limit
template <typename I>
__device__ __forceinline__ void check_body(i64 n, DIVS(cd), const char *c, NB4(c), i64 limit,
                                           int *flag) {
    GRID_STRIDE_LOOP(i, n) {
        i64 i0, i1, i2, i3;
        unflat(i, n, DIVS_PASS(cd), i0, i1, i2, i3);
        const i64 v = (i64)ld<I>(c + OFFS(c, i0, i1, i2, i3));
        if (v < 0 || v >= limit) flag[0] = 1;
    }
}

#define CHECK_PARAMS i64 n, DIVS(cd), const char *c, NB4(c), i64 limit, int *flag
#define CHECK_ARGS n, DIVS_PASS(cd), c, NB4_PASS(c), limit, flag

extern "C" __global__ void check_idx_i32(CHECK_PARAMS) { check_body<int>(CHECK_ARGS); }
extern "C" __global__ void check_idx_i64(CHECK_PARAMS) { check_body<i64>(CHECK_ARGS); }

// GET_ROWS: dst[e, i, j, k] = a[e, b[i, j, k], j, k]   (dst extents (ne0(a), ne0(b), ne1(b), ne2(b)))
template <typename S, typename D>
__device__ __forceinline__ void get_rows_body(i64 n, DIVS(dd), const char *a, NB4(a),
                                              const char *b, NB4(b), char *dst, NB4(d)) {
    GRID_STRIDE_LOOP(i, n) {
        i64 i0, i1, i2, i3;
        unflat(i, n, DIVS_PASS(dd), i0, i1, i2, i3);
        const i64 r = (i64)ld<int>(b + i1 * b_nb0 + i2 * b_nb1 + i3 * b_nb2);
        st<D>(dst + OFFS(d, i0, i1, i2, i3), Cvt<D, S>::f(ld<S>(a + OFFS(a, i0, r, i2, i3))));
    }
}

#define GET_ROWS_PARAMS i64 n, DIVS(dd), const char *a, NB4(a), const char *b, NB4(b), char *dst, NB4(d)
#define GET_ROWS_ARGS n, DIVS_PASS(dd), a, NB4_PASS(a), b, NB4_PASS(b), dst, NB4_PASS(d)

extern "C" __global__ void get_rows_b4(GET_ROWS_PARAMS) { get_rows_body<u32, u32>(GET_ROWS_ARGS); }
extern "C" __global__ void get_rows_f16_f32(GET_ROWS_PARAMS) { get_rows_body<h16, float>(GET_ROWS_ARGS); }

// SET_ROWS: dst[e, c[i, j % c_ne1, k % c_ne2], j, k] = b[e, i, j, k]   (iterates over b's extents)
template <typename S, typename D, typename I>
__device__ __forceinline__ void set_rows_body(i64 n, DIVS(bd), i64 c_ne1, i64 c_ne2,
                                              const char *b, NB4(b), const char *c, NB4(c),
                                              char *dst, NB4(d)) {
    GRID_STRIDE_LOOP(i, n) {
        i64 i0, i1, i2, i3;
        unflat(i, n, DIVS_PASS(bd), i0, i1, i2, i3);
        const i64 j1 = wrap(i2, c_ne1), j2 = wrap(i3, c_ne2);
        const i64 r = (i64)ld<I>(c + i1 * c_nb0 + j1 * c_nb1 + j2 * c_nb2);
        st<D>(dst + OFFS(d, i0, r, i2, i3), Cvt<D, S>::f(ld<S>(b + OFFS(b, i0, i1, i2, i3))));
    }
}

#define SET_ROWS_PARAMS i64 n, DIVS(bd), i64 c_ne1, i64 c_ne2, const char *b, NB4(b), const char *c, NB4(c), char *dst, NB4(d)
#define SET_ROWS_ARGS n, DIVS_PASS(bd), c_ne1, c_ne2, b, NB4_PASS(b), c, NB4_PASS(c), dst, NB4_PASS(d)

extern "C" __global__ void set_rows_f32_f32_i32(SET_ROWS_PARAMS) { set_rows_body<float, float, int>(SET_ROWS_ARGS); }
extern "C" __global__ void set_rows_f32_f32_i64(SET_ROWS_PARAMS) { set_rows_body<float, float, i64>(SET_ROWS_ARGS); }
extern "C" __global__ void set_rows_f32_f16_i32(SET_ROWS_PARAMS) { set_rows_body<float, h16, int>(SET_ROWS_ARGS); }
extern "C" __global__ void set_rows_f32_f16_i64(SET_ROWS_PARAMS) { set_rows_body<float, h16, i64>(SET_ROWS_ARGS); }
extern "C" __global__ void set_rows_f16_f32_i32(SET_ROWS_PARAMS) { set_rows_body<h16, float, int>(SET_ROWS_ARGS); }
extern "C" __global__ void set_rows_f16_f32_i64(SET_ROWS_PARAMS) { set_rows_body<h16, float, i64>(SET_ROWS_ARGS); }
extern "C" __global__ void set_rows_f16_f16_i32(SET_ROWS_PARAMS) { set_rows_body<h16, h16, int>(SET_ROWS_ARGS); }
extern "C" __global__ void set_rows_f16_f16_i64(SET_ROWS_PARAMS) { set_rows_body<h16, h16, i64>(SET_ROWS_ARGS); }

// ARANGE: dst[i] = start + step * i, both roundings in f32 (no fused multiply-add)
extern "C" __global__ void arange_f32(i64 n, float start, float step, char *dst, i64 d_nb0) {
    GRID_STRIDE_LOOP(i, n) {
        st<float>(dst + i * d_nb0, __fadd_rn(start, __fmul_rn(step, (float)i)));
    }
}
