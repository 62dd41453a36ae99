/* MUL_MAT in ggml's orientation: dst[m, n, i2, i3] = sum_k a[k, m, i2/r2, i3/r3] * b[k, n, i2, i3].
 * Both operands are read along k (rows dense by the shape rule), so the core is a register-
 * blocked 4x4 tile of dot products with SIMD accumulators over k; threads split tiles of dst. */
#include "mg.h"

#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 vf;
#define VW 16
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(acc, x, y) _mm512_fmadd_ps((x), (y), (acc))
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 vf;
#define VW 8
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(acc, x, y) _mm256_fmadd_ps((x), (y), (acc))
static inline float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
typedef float vf __attribute__((vector_size(16)));
#define VW 4
static inline vf VZERO(void) { vf z = {0, 0, 0, 0}; return z; }
static inline vf VLOAD(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
#define VFMA(acc, x, y) ((acc) + (x) * (y))
static inline float vsum(vf v) { return (v[0] + v[1]) + (v[2] + v[3]); }
#endif

/* 4 rows of a x 4 rows of b: out[j*ldo + i] = dot(A[i], B[j]), each row has K floats */
static void tile_4x4(const float *A[4], const float *B[4], int64_t K, float *out, int64_t ldo) {
    vf c00 = VZERO(), c01 = VZERO(), c02 = VZERO(), c03 = VZERO();
    vf c10 = VZERO(), c11 = VZERO(), c12 = VZERO(), c13 = VZERO();
    vf c20 = VZERO(), c21 = VZERO(), c22 = VZERO(), c23 = VZERO();
    vf c30 = VZERO(), c31 = VZERO(), c32 = VZERO(), c33 = VZERO();
    int64_t k = 0;
    for (; k + VW <= K; k += VW) {
        vf b0 = VLOAD(B[0] + k), b1 = VLOAD(B[1] + k), b2 = VLOAD(B[2] + k), b3 = VLOAD(B[3] + k);
        vf a = VLOAD(A[0] + k);
        c00 = VFMA(c00, a, b0); c01 = VFMA(c01, a, b1); c02 = VFMA(c02, a, b2); c03 = VFMA(c03, a, b3);
        a = VLOAD(A[1] + k);
        c10 = VFMA(c10, a, b0); c11 = VFMA(c11, a, b1); c12 = VFMA(c12, a, b2); c13 = VFMA(c13, a, b3);
        a = VLOAD(A[2] + k);
        c20 = VFMA(c20, a, b0); c21 = VFMA(c21, a, b1); c22 = VFMA(c22, a, b2); c23 = VFMA(c23, a, b3);
        a = VLOAD(A[3] + k);
        c30 = VFMA(c30, a, b0); c31 = VFMA(c31, a, b1); c32 = VFMA(c32, a, b2); c33 = VFMA(c33, a, b3);
    }
    float r[4][4] = {
        {vsum(c00), vsum(c01), vsum(c02), vsum(c03)},
        {vsum(c10), vsum(c11), vsum(c12), vsum(c13)},
        {vsum(c20), vsum(c21), vsum(c22), vsum(c23)},
        {vsum(c30), vsum(c31), vsum(c32), vsum(c33)},
    };
    for (; k < K; k++)
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 4; j++) r[i][j] += A[i][k] * B[j][k];
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < 4; i++) out[j * ldo + i] = r[i][j];
}

/* one dot product of K floats with 4 independent accumulators */
static float dot1(const float *x, const float *y, int64_t K) {
    vf s0 = VZERO(), s1 = VZERO(), s2 = VZERO(), s3 = VZERO();
    int64_t k = 0;
    for (; k + 4 * VW <= K; k += 4 * VW) {
        s0 = VFMA(s0, VLOAD(x + k), VLOAD(y + k));
        s1 = VFMA(s1, VLOAD(x + k + VW), VLOAD(y + k + VW));
        s2 = VFMA(s2, VLOAD(x + k + 2 * VW), VLOAD(y + k + 2 * VW));
        s3 = VFMA(s3, VLOAD(x + k + 3 * VW), VLOAD(y + k + 3 * VW));
    }
    for (; k + VW <= K; k += VW) s0 = VFMA(s0, VLOAD(x + k), VLOAD(y + k));
    float s = vsum(s0) + vsum(s1) + vsum(s2) + vsum(s3);
    for (; k < K; k++) s += x[k] * y[k];
    return s;
}

/* 4 rows of a against one row of b (matrix-vector): out[i] = dot(A[i], y) */
static void tile_4x1(const float *A[4], const float *y, int64_t K, float *out) {
    vf c0 = VZERO(), c1 = VZERO(), c2 = VZERO(), c3 = VZERO();
    vf e0 = VZERO(), e1 = VZERO(), e2 = VZERO(), e3 = VZERO();
    int64_t k = 0;
    for (; k + 2 * VW <= K; k += 2 * VW) {
        vf b = VLOAD(y + k), b2 = VLOAD(y + k + VW);
        c0 = VFMA(c0, VLOAD(A[0] + k), b); e0 = VFMA(e0, VLOAD(A[0] + k + VW), b2);
        c1 = VFMA(c1, VLOAD(A[1] + k), b); e1 = VFMA(e1, VLOAD(A[1] + k + VW), b2);
        c2 = VFMA(c2, VLOAD(A[2] + k), b); e2 = VFMA(e2, VLOAD(A[2] + k + VW), b2);
        c3 = VFMA(c3, VLOAD(A[3] + k), b); e3 = VFMA(e3, VLOAD(A[3] + k + VW), b2);
    }
    float r[4] = {vsum(c0) + vsum(e0), vsum(c1) + vsum(e1), vsum(c2) + vsum(e2), vsum(c3) + vsum(e3)};
    for (; k < K; k++)
        for (int i = 0; i < 4; i++) r[i] += A[i][k] * y[k];
    for (int i = 0; i < 4; i++) out[i] = r[i];
}

#define MB 64    /* rows of a per job */
#define NB 64    /* rows of b per job */
#define KB 1024  /* k block: 4+4 rows of KB floats stay in L1/L2 */

/* a = src[0] [K, M, a2, a3], b = src[1] [K, N, b2, b3], dst [M, N, b2, b3] contiguous f32 */
void mg_k_mul_mat(const mg_node *n, int ith, int nth) {
    const mg_tensor *a = &n->src[0];
    const mg_tensor *b = &n->src[1];
    const mg_tensor *d = &n->dst;
    const int64_t K = a->ne[0], M = a->ne[1], N = b->ne[1];
    const int64_t r2 = b->ne[2] / a->ne[2], r3 = b->ne[3] / a->ne[3];
    const int64_t mblk = (M + MB - 1) / MB, nblk = (N + NB - 1) / NB;
    const int64_t planes = b->ne[2] * b->ne[3];
    const int64_t jobs = planes * mblk * nblk;
    int64_t j0, j1;
    mg_split(jobs, ith, nth, &j0, &j1);
    for (int64_t job = j0; job < j1; job++) {
        const int64_t mb = job % mblk, nbk = (job / mblk) % nblk, p = job / (mblk * nblk);
        const int64_t i2 = p % b->ne[2], i3 = p / b->ne[2];
        const int64_t m0 = mb * MB, m1 = mg_min64(m0 + MB, M);
        const int64_t n0 = nbk * NB, n1 = mg_min64(n0 + NB, N);
        const char *ap = mg_ptr(a, 0, 0, i2 / r2, i3 / r3);  /* [K, M] plane */
        const char *bp = mg_ptr(b, 0, 0, i2, i3);            /* [K, N] plane */
        char *dp = mg_ptr(d, 0, 0, i2, i3);                  /* [M, N] plane */
        const int64_t ldo = d->nb[1] / 4;
        if (K == 0) {
            for (int64_t j = n0; j < n1; j++)
                for (int64_t i = m0; i < m1; i++) ((float *)(dp + j * d->nb[1]))[i] = 0.0f;
            continue;
        }
        /* k-blocked: partial sums accumulate in dst */
        for (int64_t k0 = 0; k0 < K; k0 += KB) {
            const int64_t kk = mg_min64(KB, K - k0);
            float tmp[16];
            int64_t j = n0;
            for (; j + 4 <= n1; j += 4) {
                const float *B4[4];
                for (int q = 0; q < 4; q++) B4[q] = (const float *)(bp + (j + q) * b->nb[1]) + k0;
                int64_t i = m0;
                for (; i + 4 <= m1; i += 4) {
                    const float *A4[4];
                    for (int q = 0; q < 4; q++) A4[q] = (const float *)(ap + (i + q) * a->nb[1]) + k0;
                    tile_4x4(A4, B4, kk, tmp, 4);
                    for (int jj = 0; jj < 4; jj++) {
                        float *o = (float *)(dp + (j + jj) * d->nb[1]) + i;
                        for (int ii = 0; ii < 4; ii++) o[ii] = (k0 ? o[ii] : 0.0f) + tmp[jj * 4 + ii];
                    }
                }
                for (; i < m1; i++) {
                    const float *Ar = (const float *)(ap + i * a->nb[1]) + k0;
                    for (int jj = 0; jj < 4; jj++) {
                        float *o = (float *)(dp + (j + jj) * d->nb[1]) + i;
                        *o = (k0 ? *o : 0.0f) + dot1(Ar, B4[jj], kk);
                    }
                }
            }
            for (; j < n1; j++) {
                const float *y = (const float *)(bp + j * b->nb[1]) + k0;
                float *o = (float *)(dp + j * d->nb[1]);
                int64_t i = m0;
                for (; i + 4 <= m1; i += 4) {
                    const float *A4[4];
                    for (int q = 0; q < 4; q++) A4[q] = (const float *)(ap + (i + q) * a->nb[1]) + k0;
                    tile_4x1(A4, y, kk, tmp);
                    for (int ii = 0; ii < 4; ii++) o[i + ii] = (k0 ? o[i + ii] : 0.0f) + tmp[ii];
                }
                for (; i < m1; i++) o[i] = (k0 ? o[i] : 0.0f) + dot1((const float *)(ap + i * a->nb[1]) + k0, y, kk);
            }
        }
        (void)ldo;
    }
}

MG_KERNEL(MUL_MAT, mg_k_mul_mat, NULL)
