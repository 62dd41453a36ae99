// Recurrent ops: SSM_CONV, SSM_SCAN and GATED_DELTA_NET (both with K rollback snapshots packed
// after the main output, slot 0 = the final state). Formulas follow minigraph/ops/ssm.py term
// for term, in f32 (the build passes --fmad=false, so a*b + c rounds twice as NumPy does).
#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// SSM_CONV: dst[c, t, s] = sum_{k < d_conv} sx[t + k, c, s] * w[k, c], accumulated from 0 with the
// taps in ascending order. sx is [d_conv - 1 + n_t, d_inner, n_s]; dst is [d_inner, n_t, n_s].
// Tiled: a block (32, 8) stages 32 channels x (32 + d_conv - 1) columns in shared memory with
// reads along time, then writes 32 channels x 32 outputs with writes along channels.

#define CONV_TC 32
#define CONV_TT 32
#define CONV_KMAX 32

extern "C" __global__ void ssm_conv_f32(i64 d_conv, i64 d_inner, i64 n_t, i64 n_s, const char *sx,
                                        NB4(x), const char *w, NB4(w), char *dst, NB4(d)) {
    __shared__ float xs[CONV_TC][CONV_TT + CONV_KMAX + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    for (i64 s = blockIdx.z; s < n_s; s += gridDim.z) {
        for (i64 t0 = (i64)blockIdx.y * CONV_TT; t0 < n_t; t0 += (i64)gridDim.y * CONV_TT) {
            for (i64 c0 = (i64)blockIdx.x * CONV_TC; c0 < d_inner; c0 += (i64)gridDim.x * CONV_TC) {
                const i64 nt = n_t - t0 < CONV_TT ? n_t - t0 : CONV_TT;
                const i64 ncols = nt + d_conv - 1;
                for (int ch = ty; ch < CONV_TC; ch += 8) {
                    const i64 c = c0 + ch;
                    for (i64 col = tx; col < ncols; col += 32)
                        xs[ch][col] = c < d_inner ? ld<float>(sx + (t0 + col) * x_nb0 + c * x_nb1 + s * x_nb2) : 0.0f;
                }
                __syncthreads();
                const i64 c = c0 + tx;
                if (c < d_inner) {
                    for (i64 tt = ty; tt < nt; tt += 8) {
                        float acc = 0.0f;
                        for (i64 k = 0; k < d_conv; ++k)
                            acc = __fadd_rn(acc, __fmul_rn(xs[tx][tt + k], ld<float>(w + k * w_nb0 + c * w_nb1)));
                        st<float>(dst + c * d_nb0 + (t0 + tt) * d_nb1 + s * d_nb2, acc);
                    }
                }
                __syncthreads();
            }
        }
    }
}

// any d_conv: one thread per output element (dst extents (d_inner, n_t, n_s))
extern "C" __global__ void ssm_conv_any_f32(i64 n, DIVS(dd), i64 d_conv, const char *sx, NB4(x),
                                            const char *w, NB4(w), char *dst, NB4(d)) {
    GRID_STRIDE_LOOP(i, n) {
        i64 c, t, s, i3;
        unflat(i, n, DIVS_PASS(dd), c, t, s, i3);
        float acc = 0.0f;
        for (i64 k = 0; k < d_conv; ++k)
            acc = __fadd_rn(acc, __fmul_rn(ld<float>(sx + (t + k) * x_nb0 + c * x_nb1 + s * x_nb2),
                                           ld<float>(w + k * w_nb0 + c * w_nb1)));
        st<float>(dst + c * d_nb0 + t * d_nb1 + s * d_nb2, acc);
    }
}

// ---------------------------------------------------------------------------------------------
// SSM_SCAN: one warp per state row (q, h, d), lanes over d_state (J values per lane, so
// d_state <= 32 * J). Per token t:
//   dsp = softplus(dt[h, t, q]);  dA = exp(dsp * A[h, 0 or e]);  xdt = x[d, h, t, q] * dsp
//   st[e] = st[e] * dA + B[e, g, t, q] * xdt;   y[d, h, t, q] = sum_e st[e] * C[e, g, t, q]
// out = y (x's layout, contiguous) then K snapshots [ds, hd, nh, ns] (slot = n_t - 1 - t).

template <int J>
__device__ __forceinline__ void ssm_scan_body(i64 ds, i64 hd, i64 nh, i64 nt, i64 ns, i64 ng,
                                              i64 K, i64 A_ne0, const char *s, NB4(s),
                                              const char *x, NB4(x), const char *dt, NB4(dt),
                                              const char *A, NB4(A), const char *B, NB4(B),
                                              const char *C, NB4(C), const char *ids, i64 ids_nb0,
                                              float *out) {
    const int lane = threadIdx.x % 32;
    const i64 wpb = blockDim.x / 32;
    const i64 nrows = ns * nh * hd;
    const i64 ny = hd * nh * nt * ns;
    const i64 heads_per_group = nh / ng;
    for (i64 row = (i64)blockIdx.x * wpb + threadIdx.x / 32; row < nrows; row += (i64)gridDim.x * wpb) {
        const i64 d = row % hd, h = (row / hd) % nh, q = row / (hd * nh);
        const i64 r = (i64)ld<int>(ids + q * ids_nb0);
        const i64 g = h / heads_per_group;
        float sv[J];
#pragma unroll
        for (int j = 0; j < J; ++j) {
            const i64 e = lane + 32 * j;
            sv[j] = e < ds ? ld<float>(s + OFFS(s, e, d, h, r)) : 0.0f;
        }
        for (i64 t = 0; t < nt; ++t) {
            const float dtv = ld<float>(dt + h * dt_nb0 + t * dt_nb1 + q * dt_nb2);
            const float dsp = dtv > 20.0f ? dtv : logf(1.0f + expf(dtv));
            const float xdt = ld<float>(x + OFFS(x, d, h, t, q)) * dsp;
            float part = 0.0f;
#pragma unroll
            for (int j = 0; j < J; ++j) {
                const i64 e = lane + 32 * j;
                if (e < ds) {
                    const float a = ld<float>(A + (A_ne0 == 1 ? 0 : e) * A_nb0 + h * A_nb1);
                    const float dA = expf(dsp * a);
                    const float bv = ld<float>(B + OFFS(B, e, g, t, q));
                    const float cv = ld<float>(C + OFFS(C, e, g, t, q));
                    sv[j] = sv[j] * dA + bv * xdt;
                    part += sv[j] * cv;
                }
            }
            const float y = warp_sum(part);
            if (lane == 0) out[((q * nt + t) * nh + h) * hd + d] = y;
            const i64 slot = nt - 1 - t;
            if (slot < K) {
                float *o = out + ny + (((slot * ns + q) * nh + h) * hd + d) * ds;
#pragma unroll
                for (int j = 0; j < J; ++j) {
                    const i64 e = lane + 32 * j;
                    if (e < ds) o[e] = sv[j];
                }
            }
        }
    }
}

#define SCAN_PARAMS i64 ds, i64 hd, i64 nh, i64 nt, i64 ns, i64 ng, i64 K, i64 A_ne0, const char *s, NB4(s), \
    const char *x, NB4(x), const char *dt, NB4(dt), const char *A, NB4(A), const char *B, NB4(B), \
    const char *C, NB4(C), const char *ids, i64 ids_nb0, float *out
#define SCAN_ARGS ds, hd, nh, nt, ns, ng, K, A_ne0, s, NB4_PASS(s), x, NB4_PASS(x), dt, NB4_PASS(dt), \
    A, NB4_PASS(A), B, NB4_PASS(B), C, NB4_PASS(C), ids, ids_nb0, out

extern "C" __global__ void ssm_scan_j1(SCAN_PARAMS) { ssm_scan_body<1>(SCAN_ARGS); }
extern "C" __global__ void ssm_scan_j4(SCAN_PARAMS) { ssm_scan_body<4>(SCAN_ARGS); }
extern "C" __global__ void ssm_scan_j32(SCAN_PARAMS) { ssm_scan_body<32>(SCAN_ARGS); }

// ---------------------------------------------------------------------------------------------
// GATED_DELTA_NET: one warp per state row (sq, h, j), lanes over i (J values per lane, so
// S_v <= 32 * J); M[i] is the state element state[i, j, h, sq]. Per token t:
//   M[i] *= exp(g[i or 0, h, t, sq])
//   delta = (v[j, h, t, sq] - sum_i M[i] k[i, hk, t, sqk]) * beta[0, h, t, sq]
//   M[i] += delta * k[i, hk, t, sqk];   out[j, h, t, sq] = scale * sum_i M[i] q[i, hq, t, sqq]
// with hq = h % Hq, sqq = sq / (ns / nq) (and the same for k). Snapshots follow the output.

template <int J>
__device__ __forceinline__ void gdn_body(i64 S, i64 H, i64 T, i64 ns, i64 Hq, i64 nq, i64 Hk,
                                         i64 nk, i64 G0, i64 K, float scale, const char *q, NB4(q),
                                         const char *k, NB4(k), const char *v, NB4(v),
                                         const char *g, NB4(g), const char *beta, NB4(beta),
                                         const char *state, NB4(st), float *out) {
    const int lane = threadIdx.x % 32;
    const i64 wpb = blockDim.x / 32;
    const i64 nrows = ns * H * S;
    const i64 n_o = S * H * T * ns;
    for (i64 row = (i64)blockIdx.x * wpb + threadIdx.x / 32; row < nrows; row += (i64)gridDim.x * wpb) {
        const i64 j = row % S, h = (row / S) % H, sq = row / (S * H);
        const i64 sqq = sq / (ns / nq), sqk = sq / (ns / nk), hq = h % Hq, hk = h % Hk;
        float M[J], kr[J];
#pragma unroll
        for (int u = 0; u < J; ++u) {
            const i64 i = lane + 32 * u;
            M[u] = i < S ? ld<float>(state + OFFS(st, i, j, h, sq)) : 0.0f;
        }
        for (i64 t = 0; t < T; ++t) {
            float part = 0.0f;
#pragma unroll
            for (int u = 0; u < J; ++u) {
                const i64 i = lane + 32 * u;
                kr[u] = 0.0f;
                if (i < S) {
                    M[u] = M[u] * expf(ld<float>(g + OFFS(g, G0 == 1 ? 0 : i, h, t, sq)));
                    kr[u] = ld<float>(k + OFFS(k, i, hk, t, sqk));
                    part += M[u] * kr[u];
                }
            }
            const float dot = warp_sum(part);
            const float delta = (ld<float>(v + OFFS(v, j, h, t, sq)) - dot) * ld<float>(beta + OFFS(beta, 0, h, t, sq));
            part = 0.0f;
#pragma unroll
            for (int u = 0; u < J; ++u) {
                const i64 i = lane + 32 * u;
                if (i < S) {
                    M[u] = M[u] + delta * kr[u];
                    part += M[u] * ld<float>(q + OFFS(q, i, hq, t, sqq));
                }
            }
            const float o = scale * warp_sum(part);
            if (lane == 0) out[((sq * T + t) * H + h) * S + j] = o;
            const i64 slot = T - 1 - t;
            if (slot < K) {
                float *sp = out + n_o + (((slot * ns + sq) * H + h) * S + j) * S;
#pragma unroll
                for (int u = 0; u < J; ++u) {
                    const i64 i = lane + 32 * u;
                    if (i < S) sp[i] = M[u];
                }
            }
        }
    }
}

#define GDN_PARAMS i64 S, i64 H, i64 T, i64 ns, i64 Hq, i64 nq, i64 Hk, i64 nk, i64 G0, i64 K, float scale, \
    const char *q, NB4(q), const char *k, NB4(k), const char *v, NB4(v), const char *g, NB4(g), \
    const char *beta, NB4(beta), const char *state, NB4(st), float *out
#define GDN_ARGS S, H, T, ns, Hq, nq, Hk, nk, G0, K, scale, q, NB4_PASS(q), k, NB4_PASS(k), v, NB4_PASS(v), \
    g, NB4_PASS(g), beta, NB4_PASS(beta), state, NB4_PASS(st), out

extern "C" __global__ void gated_delta_net_j1(GDN_PARAMS) { gdn_body<1>(GDN_ARGS); }
extern "C" __global__ void gated_delta_net_j4(GDN_PARAMS) { gdn_body<4>(GDN_ARGS); }
extern "C" __global__ void gated_delta_net_j32(GDN_PARAMS) { gdn_body<32>(GDN_ARGS); }
