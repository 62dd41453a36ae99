/* MUL_MAT in ggml's orientation: dst[m, n, i2, i3] = sum_k a[k, m, i2/r2, i3/r3] * b[k, n, i2, i3].
 * Both operands are read along k (rows dense by the shape rule); threads split blocks of dst.
 *
 * Batch invariance: every output element is one dot product computed in one fixed order,
 * whichever micro-tile, thread or column position computes it, so a token's column comes out
 * bit-identical whether src1 holds 1 column or 512 (speculative decoding's rollback compares a
 * batch against token-by-token decoding bit for bit). The order, per element:
 *   r = 0; for each k block of KB floats, ascending:
 *     acc = 0 (one VW-wide vector); for each VW chunk of the block, ascending:
 *       acc = fma(a_chunk, b_chunk, acc)   (a last partial chunk is loaded zero-padded, masked,
 *                                            and goes through the same fma)
 *     r = r + vsum(acc)                     (one fixed horizontal order)
 *   dst = r
 * The micro-tiles (R rows of a x C rows of b, R <= 8, C <= 4) differ only in how many of these
 * independent chains they interleave and which loads they share, and the loop nests only in
 * whether r is carried through dst or in registers between k blocks; none changes a chain. Never
 * give one path a second accumulator per element, a scalar tail or another horizontal sum: that
 * is what made wide ubatches differ from single tokens. */
#include "mg.h"
#include "quant.h"

#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 vf;
#define VW 16
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(acc, x, y) _mm512_fmadd_ps((x), (y), (acc))
typedef __mmask16 vmask;
static inline vmask vmask_first(int64_t r) { return (__mmask16)((1u << r) - 1u); }
#define VLOADM(p, m) _mm512_maskz_loadu_ps((m), (p))
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 vf;
#define VW 8
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(acc, x, y) _mm256_fmadd_ps((x), (y), (acc))
typedef __m256i vmask;
static const int32_t vmask_tab[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
static inline vmask vmask_first(int64_t r) { return _mm256_loadu_si256((const __m256i *)(vmask_tab + 8 - r)); }
#define VLOADM(p, m) _mm256_maskload_ps((p), (m))
static inline float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
/* portable: multiply and add rounded separately (-ffp-contract=off), the same order everywhere */
typedef float vf __attribute__((vector_size(16)));
#define VW 4
static inline vf VZERO(void) { vf z = {0, 0, 0, 0}; return z; }
static inline vf VLOAD(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
#define VFMA(acc, x, y) ((acc) + (x) * (y))
typedef int64_t vmask;
static inline vmask vmask_first(int64_t r) { return r; }
static inline vf VLOADM(const float *p, vmask r) { vf v = VZERO(); memcpy(&v, p, (size_t)r * sizeof(float)); return v; }
static inline float vsum(vf v) { return (v[0] + v[1]) + (v[2] + v[3]); }
#endif

/* columns per micro-tile in the blocked path: 4x4 tiles need 16 accumulators + 4 loads in
 * registers (AVX-512 has 32); with 16 registers 4x3 tiles avoid spilling */
#ifndef CG
#if defined(__AVX512F__)
#define CG 4
#else
#define CG 3
#endif
#endif
#define MB 64                    /* rows of a per job */
#define NB (CG == 4 ? 64 : 63)   /* rows of b per job: whole column groups */
#define KB 1024                  /* k block (a multiple of VW): a job's MB x KB block of a stays in L2 */
#define TR_MAX 8   /* rows of a per micro-tile */
#define TC_MAX 4   /* rows of b per micro-tile */

/* R rows of a x C rows of b over one k block of kk floats: part[j][i] = vsum of the block's
 * chain for A[i], B[j]. Always inlined with constant R, C: the loops unroll and the
 * accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(const float *const *A, const int R, const float *const *B,
                                                       const int C, int64_t kk, float part[TC_MAX][TR_MAX]) {
    vf acc[TR_MAX][TC_MAX];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++) acc[i][j] = VZERO();
    int64_t k = 0;
    for (; k + VW <= kk; k += VW) {
        vf b[TC_MAX];
        for (int j = 0; j < C; j++) b[j] = VLOAD(B[j] + k);
        for (int i = 0; i < R; i++) {
            const vf a = VLOAD(A[i] + k);
            for (int j = 0; j < C; j++) acc[i][j] = VFMA(acc[i][j], a, b[j]);
        }
    }
    if (k < kk) {   /* the partial chunk, zero-padded: the same fma as a full one */
        const vmask m = vmask_first(kk - k);
        vf b[TC_MAX];
        for (int j = 0; j < C; j++) b[j] = VLOADM(B[j] + k, m);
        for (int i = 0; i < R; i++) {
            const vf a = VLOADM(A[i] + k, m);
            for (int j = 0; j < C; j++) acc[i][j] = VFMA(acc[i][j], a, b[j]);
        }
    }
    for (int j = 0; j < C; j++)
        for (int i = 0; i < R; i++) part[j][i] = vsum(acc[i][j]);
}

/* one micro-tile at rows i.., columns j.. of the plane over the k blocks in [k0, k1) (k0 a
 * multiple of KB), into dst. r starts from dst after the first block (the loop nest that runs k
 * blocks outermost) and carries across the blocks of [k0, k1) in registers: the same additions
 * in the same order either way. */
static inline __attribute__((always_inline)) void tile_store(const char *ap, int64_t lda, const char *bp, int64_t ldb,
                                                             char *dp, int64_t ldd, int64_t i, int64_t j, const int R,
                                                             const int C, int64_t k0, int64_t k1) {
    const float *A[TR_MAX], *B[TC_MAX];
    float part[TC_MAX][TR_MAX], r[TC_MAX][TR_MAX];
    for (int q = 0; q < R; q++) A[q] = (const float *)(ap + (i + q) * lda);
    for (int q = 0; q < C; q++) B[q] = (const float *)(bp + (j + q) * ldb);
    for (int jj = 0; jj < C; jj++) {
        const float *o = (const float *)(dp + (j + jj) * ldd) + i;
        for (int ii = 0; ii < R; ii++) r[jj][ii] = k0 ? o[ii] : 0.0f;
    }
    for (int64_t kb = k0; kb < k1; kb += KB) {
        const float *Ak[TR_MAX], *Bk[TC_MAX];
        for (int q = 0; q < R; q++) Ak[q] = A[q] + kb;
        for (int q = 0; q < C; q++) Bk[q] = B[q] + kb;
        tile(Ak, R, Bk, C, mg_min64(KB, k1 - kb), part);
        for (int jj = 0; jj < C; jj++)
            for (int ii = 0; ii < R; ii++) r[jj][ii] = r[jj][ii] + part[jj][ii];
    }
    for (int jj = 0; jj < C; jj++) {
        float *o = (float *)(dp + (j + jj) * ldd) + i;
        for (int ii = 0; ii < R; ii++) o[ii] = r[jj][ii];
    }
}

#define TILE_ARGS ap, lda, bp, ldb, dp, ldd
#define ROWS_PARAMS const char *ap, int64_t lda, const char *bp, int64_t ldb, char *dp, int64_t ldd, \
                    int64_t m0, int64_t m1, int64_t j, int64_t k0, int64_t k1
/* the last 1-3 rows of [m0, m1) against C columns */
#define ROWS_TAIL(C)                                                              \
    switch (m1 - i) {                                                             \
        case 1: tile_store(TILE_ARGS, i, j, 1, C, k0, k1); break;                 \
        case 2: tile_store(TILE_ARGS, i, j, 2, C, k0, k1); break;                 \
        case 3: tile_store(TILE_ARGS, i, j, 3, C, k0, k1); break;                 \
        default: break;                                                           \
    }

/* the rows [m0, m1) against the C columns at j: 4-row tiles, then the rest */
#define DEFINE_ROWS(name, C)                                                      \
    static void name(ROWS_PARAMS) {                                               \
        int64_t i = m0;                                                           \
        for (; i + 4 <= m1; i += 4) tile_store(TILE_ARGS, i, j, 4, C, k0, k1);    \
        ROWS_TAIL(C)                                                              \
    }
DEFINE_ROWS(rows_c4, 4)
DEFINE_ROWS(rows_c3, 3)
DEFINE_ROWS(rows_c2, 2)

/* a single column (matrix x vector): 8 rows per tile */
static void rows_c1(ROWS_PARAMS) {
    int64_t i = m0;
    for (; i + 8 <= m1; i += 8) tile_store(TILE_ARGS, i, j, 8, 1, k0, k1);
    for (; i + 4 <= m1; i += 4) tile_store(TILE_ARGS, i, j, 4, 1, k0, k1);
    ROWS_TAIL(1)
}

/* a = src[0] [K, M, a2, a3], b = src[1] [K, N, b2, b3], dst [M, N, b2, b3] f32, rows dense */
void mg_k_mul_mat(const mg_node *n, int ith, int nth) {
    if (n->src[0].type != MG_F32) { mg_mul_mat_blocks(n, ith, nth); return; }   /* quant_matmul.c */
    const mg_tensor *a = &n->src[0];
    const mg_tensor *b = &n->src[1];
    const mg_tensor *d = &n->dst;
    const int64_t K = a->ne[0], M = a->ne[1], N = b->ne[1];
    const int64_t r2 = b->ne[2] / a->ne[2], r3 = b->ne[3] / a->ne[3];
    const int64_t mblk = (M + MB - 1) / MB, nblk = (N + NB - 1) / NB;
    const int64_t planes = b->ne[2] * b->ne[3];
    const int64_t jobs = planes * mblk * nblk;
    const int64_t lda = a->nb[1], ldb = b->nb[1], ldd = d->nb[1];
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
        if (K == 0) {
            for (int64_t j = n0; j < n1; j++)
                for (int64_t i = m0; i < m1; i++) ((float *)(dp + j * ldd))[i] = 0.0f;
            continue;
        }
        /* groups of CG columns: k blocks outermost, so the job's block of a (MB x KB floats) is
         * reused from cache by every column group; r goes through dst between blocks */
        const int64_t jg = n0 + (n1 - n0) / CG * CG;
        for (int64_t k0 = 0; jg > n0 && k0 < K; k0 += KB) {
            const int64_t k1 = mg_min64(k0 + KB, K);
            for (int64_t j = n0; j < jg; j += CG) (CG == 4 ? rows_c4 : rows_c3)(TILE_ARGS, m0, m1, j, k0, k1);
        }
        /* the last 1 to CG-1 columns (one alone: matrix x vector) read a once, each tile over all of K */
        switch (n1 - jg) {
            case 3: rows_c3(TILE_ARGS, m0, m1, jg, 0, K); break;
            case 2: rows_c2(TILE_ARGS, m0, m1, jg, 0, K); break;
            case 1: rows_c1(TILE_ARGS, m0, m1, jg, 0, K); break;
            default: break;
        }
    }
}

MG_KERNEL(MUL_MAT, mg_k_mul_mat, NULL)
