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
 * The micro-tiles (R rows of a x C rows of b, R <= 8, C <= 6, read in place or from packed
 * copies) differ only in how many of these independent chains they interleave and which loads
 * they share, and the loop nests only in whether r is carried through dst, a buffer or registers
 * between k blocks; none changes a chain (vsum4 is four vsums in the same order). Never give one
 * path a second accumulator per element, a scalar tail or another horizontal sum: that is what
 * made wide ubatches differ from single tokens. */
#include <stdlib.h>

#include "gemm_lanes.h"
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
/* 16 lanes folded to 8 (lo + hi), then AVX2's order (below); the order _mm512_reduce_add_ps
 * has in GCC, written out so that vsum4 can repeat it exactly */
static inline __m256 vfold(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
static inline float vsum(vf v) {
    const __m256 h = vfold(v);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
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
#ifndef KB
/* k block (a multiple of VW): the summation order's block, and a direct job's MB x KB block of a
 * stays in L2. AVX-512 takes twice AVX2's: with 16 lanes a block of 512 is only 32 fma steps per
 * vsum, and the sums then cost a quarter of the packed GEMM's time (measured 4096x4096x512 on a
 * 2 MiB-L2 Xeon core: 1024 ~10% faster than 512, 2048 slower). AVX2 builds take 2048: their
 * packed GEMM (gemm_lanes.c) runs each lane chain as a loop of KB / 8 steps, and a loop of 64
 * (KB 512) spends 13% of its time starting and ending (Zen 3: a 24x4 chain in L2 86% of the fma
 * peak at 64 steps, 95% at 256) */
#if defined(__AVX512F__)
#define KB 1024
#elif MG_GEMM_LANES
#define KB 2048
#else
#define KB 512
#endif
#endif
#define MB (KB >= 2048 ? 32 : 64)   /* rows of a per direct job: MB x KB floats of a (at most 256 KiB) reused from L2 */
#define NB (CG == 4 ? 64 : 63)   /* rows of b per job: whole column groups */
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

/* Rows of a up to this many floats are read one at a time against a few columns, longer ones
 * several rows in step. One row at a time is one sequential stream, which the core's prefetchers
 * follow; 4 or 8 short rows in step are as many short interleaved streams, and they lose track
 * of them. A long row (past the core's out-of-order window) read alone waits on its one fma
 * chain instead, and rows in step hide that. Measured on a Zen 4 core, weights read cold (a
 * standalone C loop and /tmp scripts against ggml and NumPy in one run): 3352 x 768 by one
 * column 16-20 GB/s in step, 22-29 GB/s a row at a time (ggml 21-25, OpenBLAS 22-26); by 4
 * columns 23 ms -> 12-16 ms for 24 such weights; 2048-float rows 22 -> 24-26 GB/s; 4096-float
 * rows 23-24 GB/s in step, 15-16 a row at a time. An AVX2 core (Zen 3, 8 lanes: twice the fma
 * steps per row, so a lone row's chain is twice as long) measured the other way: 24 layers of a
 * 3352 x 768 and a 768 x 1536 weight and a 32000 x 768 head by one column, read cold, against
 * ggml in one run (/tmp scripts), 1 thread: ggml/minigraph 0.96-1.11 a row at a time, 1.08-1.24
 * in step (three runs each). So AVX-512 builds read short rows one at a time, AVX2 builds in step. */
#ifndef MV_ROW_MAX
#if defined(__AVX512F__)
#define MV_ROW_MAX 2048
#else
#define MV_ROW_MAX 0
#endif
#endif
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

/* the rows [m0, m1) against the C columns at j: 4-row tiles, then the rest (name##_tiles), or,
 * when [k0, k1) is the whole of a short row (name), one row at a time (MV_ROW_MAX). Either way
 * the same chains, so a column's result does not depend on which. */
#define DEFINE_ROWS(name, C)                                                      \
    static void name##_tiles(ROWS_PARAMS) {                                       \
        int64_t i = m0;                                                           \
        for (; i + 4 <= m1; i += 4) tile_store(TILE_ARGS, i, j, 4, C, k0, k1);    \
        ROWS_TAIL(C)                                                              \
    }                                                                             \
    static void name(ROWS_PARAMS) {   /* [k0, k1) is all of K */                  \
        if (k1 - k0 > MV_ROW_MAX) { name##_tiles(TILE_ARGS, m0, m1, j, k0, k1); return; } \
        for (int64_t i = m0; i < m1; i++) tile_store(TILE_ARGS, i, j, 1, C, k0, k1);     \
    }
DEFINE_ROWS(rows_c4, 4)
DEFINE_ROWS(rows_c3, 3)
DEFINE_ROWS(rows_c2, 2)

/* exactly 4 columns with AVX2's 16 registers: 2 x 4 tiles over all of K (8 chains, 6 loads per
 * 8 fmas, a read once), or for rows up to N4_ROW_MAX floats 1 x 4 tiles (a row at a time: one
 * sequential stream, as MV_ROW_MAX says). Measured on this Zen 3 core (a standalone C loop over
 * 450 MB of weights by 4 columns, variants interleaved in one process): 1 x 4 against 2 x 4
 * 44-51 ms against 59-65 at K 768, 54-58 against 57-61 at 1024-1536, slower at 2048 and 4608
 * (60-70 against 51-62); see direct_block */
#ifndef N4_ROW_MAX
#define N4_ROW_MAX 1536
#endif
static void rows_2x4(ROWS_PARAMS) {
    int64_t i = m0;
    if (k1 - k0 <= N4_ROW_MAX) {
        for (; i < m1; i++) tile_store(TILE_ARGS, i, j, 1, 4, k0, k1);
        return;
    }
    for (; i + 2 <= m1; i += 2) tile_store(TILE_ARGS, i, j, 2, 4, k0, k1);
    if (i < m1) tile_store(TILE_ARGS, i, j, 1, 4, k0, k1);
}

/* a single column (matrix x vector): a short row at a time, as above; long rows 8 per tile, and
 * so are rows of at most MV_ROW_MIN floats: a lone row that short is all chain and horizontal
 * sum. A decode step's attention reads V's rows of n_kv floats: qwen35-like q4_k_m, 3 layers of
 * V (256 cells by 128) by one column, 1 thread, Zen 4: 0.115 -> 0.082 ms; lfm2-like, 6 layers of
 * (256 by 64), 0.39-0.41 -> 0.25-0.28 ms. Rows of 64 and 128 floats (K's, head_dim) measured the
 * same either way. */
#ifndef MV_ROW_MIN
#if defined(__AVX512F__)
#define MV_ROW_MIN 256
#else
#define MV_ROW_MIN 0   /* AVX2 builds already read short rows in step (MV_ROW_MAX 0) */
#endif
#endif
static void rows_c1(ROWS_PARAMS) {
    int64_t i = m0;
    if (k1 - k0 <= MV_ROW_MAX && k1 - k0 > MV_ROW_MIN) {
        for (; i < m1; i++) tile_store(TILE_ARGS, i, j, 1, 1, k0, k1);
        return;
    }
    for (; i + 8 <= m1; i += 8) tile_store(TILE_ARGS, i, j, 8, 1, k0, k1);
    for (; i + 4 <= m1; i += 4) tile_store(TILE_ARGS, i, j, 4, 1, k0, k1);
    ROWS_TAIL(1)
}

/* ---- the packed path (many columns: prefill) ----
 * The same chains as above, from packed copies of both operands. b is packed once per node by
 * the step MUL_MAT:pack_src1 (a record before the MUL_MAT's, all threads, into the plan's work
 * buffer): per plane and k block, its columns in panels of PC, each panel [chunk][PC][VW], so
 * that the micro-kernel reads its columns as one sequential stream. Read in place instead, the
 * PC rows of b sit ldb bytes apart (16 KiB for K 4096: every row in the same L1 sets) and the
 * next panel has to come from L3 as PC separate streams; measured on this Zen 3 core (a C loop
 * over mg_k_mul_mat against OpenBLAS's sgemm in one process, 1 thread, 4096x4096 by 512, the
 * packing timed with the product): OpenBLAS/minigraph 0.78-0.84 in place, 0.90-0.94 packed.
 * A job is one block of PMB rows of a (one plane); for each k block it copies the block's rows
 * into a thread-local buffer, pairs of rows interleaved chunk by chunk ([chunk][2][VW]), then
 * for each panel of b runs PR x PC micro-tiles down the block (kept in L2), prefetching the next
 * panel and the next block's rows of a as it goes. The last partial chunk of a block is packed
 * zero-padded on both sides: the same fma as the direct path's masked loads. PR x PC = 2 x 6
 * holds 12 accumulators + 2 + 1 vectors in AVX2's 16 registers; each k step is 12 fmas for 8
 * loads. AVX-512 runs 4 x 6 tiles (24 accumulators of 32 registers: 24 fmas for 10 loads) and
 * sums two rows x two columns per vsum4, as 2 x 6 does. AVX2 builds run gemm_lanes.c instead:
 * the same chains one lane at a time with b broadcast (measured there: 2 x 6 here reached
 * 0.90-0.94 of OpenBLAS, 24 x 4 chains 0.98-1.01); this path serves AVX-512 and portable
 * builds. Without the packed copy of b (none given, or no buffer for a) the jobs run the direct
 * path. */
#ifndef PACKED_MIN_N
#define PACKED_MIN_N 24   /* fewer columns: packing a costs more than it saves (measured crossover 24-32) */
#endif

#if !MG_GEMM_LANES   /* AVX2 builds: gemm_lanes.c */
/* keep a loaded vector in a register: left alone, the compiler folds the load into each fma
 * that uses it (R loads of the same b per k step instead of one) and the loop is load-bound */
#if defined(__GNUC__) && (defined(__AVX2__) || defined(__AVX512F__))
#define MG_IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define MG_IN_REGISTER(v) ((void)0)
#endif
/* vsum of four vectors at once, each sum in exactly vsum's order ((lo + hi), then lanes
 * (0 + 2, 1 + 3), then those two): [vsum(v0), vsum(v1), vsum(v2), vsum(v3)]; AVX-512 folds
 * each vector to 8 lanes first, as its vsum does */
#if defined(__AVX2__)
#define VSUM4 1
static inline __m128 vsum4_256(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
    const __m256 t01 = _mm256_add_ps(_mm256_permute2f128_ps(v0, v1, 0x20), _mm256_permute2f128_ps(v0, v1, 0x31));
    const __m256 t23 = _mm256_add_ps(_mm256_permute2f128_ps(v2, v3, 0x20), _mm256_permute2f128_ps(v2, v3, 0x31));
    /* t01 = [t0 | t1], t23 = [t2 | t3] (4 lanes each): u = [t0 0+2, 1+3, t2 0+2, 1+3 | t1 .., t3 ..] */
    const __m256 u = _mm256_add_ps(_mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(3, 2, 3, 2)));
    /* w = [s0, s2, s0, s2 | s1, s3, s1, s3] */
    const __m256 w = _mm256_add_ps(_mm256_shuffle_ps(u, u, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(u, u, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm_unpacklo_ps(_mm256_castps256_ps128(w), _mm256_extractf128_ps(w, 1));
}
#if defined(__AVX512F__)
static inline __m128 vsum4(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
    return vsum4_256(vfold(v0), vfold(v1), vfold(v2), vfold(v3));
}
#else
#define vsum4 vsum4_256
#endif
#else
#define VSUM4 0
#endif
/* PR x PC micro-tiles: 2 x 6 in 16 registers (12 accumulators), 4 x 6 in AVX-512's 32
 * (24 accumulators + 4 rows of a + 1 of b: twice the fmas per load of b) */
#if defined(__AVX512F__)
#define PR 4
#else
#define PR 2
#endif
#define PC 6
#ifndef PMB
#define PMB 128   /* rows of a per job: the packed PMB x KB block of a and the PMB x PNS results (256 KiB each) */
#endif
/* columns per slab: the slab's results (PMB x PNS floats) are kept in a contiguous buffer until
 * its last k block (dst's columns are M floats apart: all in a few cache sets) */
#ifndef PNS
#define PNS 512
#endif


/* rows [r0, r0 + R) of a row-major block (ld bytes apart), floats [k0, k0 + kk), as [nch][R][VW] */
static inline __attribute__((always_inline)) void pack_rows(float *out, const char *base, int64_t ld, int64_t r0,
                                                            const int R, int64_t k0, int64_t kk, int64_t nch) {
    for (int q = 0; q < R; q++) {
        const float *src = (const float *)(base + (r0 + q) * ld) + k0;
        float *o = out + q * VW;
        int64_t c = 0;
        for (; (c + 1) * VW <= kk; c++) memcpy(o + c * R * VW, src + c * VW, VW * sizeof(float));
        if (c < nch) {
            float *t = o + c * R * VW;
            const int64_t rem = kk - c * VW;
            for (int64_t e = 0; e < VW; e++) t[e] = e < rem ? src[c * VW + e] : 0.0f;
        }
    }
}

static void pack_group(float *out, const char *base, int64_t ld, int64_t r0, int R, int64_t k0, int64_t kk, int64_t nch) {
    switch (R) {
        case 1: pack_rows(out, base, ld, r0, 1, k0, kk, nch); break;
        case 2: pack_rows(out, base, ld, r0, 2, k0, kk, nch); break;
        case 3: pack_rows(out, base, ld, r0, 3, k0, kk, nch); break;
        case 4: pack_rows(out, base, ld, r0, 4, k0, kk, nch); break;
        case 5: pack_rows(out, base, ld, r0, 5, k0, kk, nch); break;
        default: pack_rows(out, base, ld, r0, 6, k0, kk, nch); break;
    }
}

/* R packed rows of a x a packed panel of C columns of b, over kk floats (nch chunks), into
 * dst rows i.., columns j..: first k block: dst = 0 + part, later ones: dst = dst + part (the
 * order of tile_store). Partial chunks are zero-padded in both copies. */
static inline __attribute__((always_inline)) void ukernel(const float *Ap, const int R, const float *Bp, const int C,
                                                          int64_t nch, char *dp, int64_t ldd, int64_t i, int64_t j,
                                                          int first) {
    vf acc[PR][PC];
    for (int q = 0; q < R; q++)
        for (int c = 0; c < C; c++) acc[q][c] = VZERO();
    for (int64_t k = 0; k < nch; k++, Ap += R * VW, Bp += C * VW) {
        vf a[PR];
        for (int q = 0; q < R; q++) a[q] = VLOAD(Ap + q * VW);
        for (int jj = 0; jj < C; jj++) {
            vf b = VLOAD(Bp + jj * VW);
            MG_IN_REGISTER(b);
            for (int q = 0; q < R; q++) acc[q][jj] = VFMA(acc[q][jj], a[q], b);
        }
    }
    int jj = 0;
#if VSUM4
    if (R % 2 == 0) {   /* two rows x two columns at a time: four vsums in one shuffle tree, one add and store */
        for (; jj + 2 <= C; jj += 2) {
            for (int q = 0; q + 2 <= R; q += 2) {
                float *o0 = (float *)(dp + (j + jj) * ldd) + i + q, *o1 = (float *)(dp + (j + jj + 1) * ldd) + i + q;
                const __m128 part = vsum4(acc[q][jj], acc[q + 1][jj], acc[q][jj + 1], acc[q + 1][jj + 1]);
                __m128 r = _mm_setzero_ps();
                if (!first) r = _mm_loadh_pi(_mm_castpd_ps(_mm_load_sd((const double *)o0)), (const __m64 *)o1);
                r = _mm_add_ps(r, part);
                _mm_store_sd((double *)o0, _mm_castps_pd(r));
                _mm_storeh_pi((__m64 *)o1, r);
            }
        }
    }
#endif
    for (; jj < C; jj++) {
        float *o = (float *)(dp + (j + jj) * ldd) + i;
        for (int q = 0; q < R; q++) o[q] = (first ? 0.0f : o[q]) + vsum(acc[q][jj]);
    }
}

/* Prefetching what comes next while a panel runs, a few cache lines per micro-tile: the next
 * packed panel of b (from L3, into L1: PF_B lines per tile spread it over the panel's tiles),
 * and the rows of a the next packing copies (from memory, into L2). */
typedef struct {
    const char *row;          /* the current row's first byte (NULL: nothing to prefetch) */
    int64_t ld, bytes, off;   /* row stride; bytes per row; next offset in the row */
    int64_t rows;             /* rows left, the current one included */
} prefetcher;

static inline void pf_set(prefetcher *p, const char *base, int64_t ld, int64_t rows, int64_t bytes) {
    p->row = rows > 0 && bytes > 0 ? base : NULL;
    p->ld = ld;
    p->bytes = bytes;
    p->off = 0;
    p->rows = rows;
}

static inline void pf_next(prefetcher *p, int count, int hint_l1) {
    for (int q = 0; q < count && p->row != NULL; q++) {
        if (hint_l1) __builtin_prefetch(p->row + p->off, 0, 3);
        else __builtin_prefetch(p->row + p->off, 0, 2);
        p->off += 64;
        if (p->off >= p->bytes) {
            p->off = 0;
            p->row = --p->rows > 0 ? p->row + p->ld : NULL;
        }
    }
}

#define UK_CASE(R, C) case C: for (; g + R <= m1; g += R, Ag += nch * R * VW) { \
        ukernel(Ag, R, Bp, C, nch, dp, ldd, g, j, first); pf_next(pb, PF_B, PF_B_L1); pf_next(pa, PF_A, 0); } break;
/* lines per micro-tile. Measured on this Zen 3 core (4096x4096 by 512 against OpenBLAS in one
 * process, 3-4 runs each): b 3 into L1 (the panel spread evenly over its tiles) 0.90-0.94,
 * 6 into L2 (front-loaded) 0.86-0.89; a 2 0.91-0.94, 1 0.89-0.92, 4 0.88-0.91 */
#ifndef PF_B
#define PF_B 3
#endif
#ifndef PF_A
#define PF_A 2
#endif
#ifndef PF_B_L1
#define PF_B_L1 1
#endif
/* the row groups [m0, m1) of the packed block against a packed panel of C columns of b */
static void panel_rows(const float *Ap, const float *Bp, int C, int64_t nch, char *dp, int64_t ldd,
                       int64_t m0, int64_t m1, int64_t j, int first, prefetcher *pb, prefetcher *pa) {
    int64_t g = m0;
    const float *Ag = Ap;
    switch (C) { UK_CASE(PR, 1) UK_CASE(PR, 2) UK_CASE(PR, 3) UK_CASE(PR, 4) UK_CASE(PR, 5) UK_CASE(PR, 6) default: break; }
#if PR == 4
    if (g + 2 <= m1) {   /* two of the last three rows */
        switch (C) { UK_CASE(2, 1) UK_CASE(2, 2) UK_CASE(2, 3) UK_CASE(2, 4) UK_CASE(2, 5) UK_CASE(2, 6) default: break; }
    }
#endif
    if (g < m1) {   /* an odd last row */
        switch (C) { UK_CASE(1, 1) UK_CASE(1, 2) UK_CASE(1, 3) UK_CASE(1, 4) UK_CASE(1, 5) UK_CASE(1, 6) default: break; }
    }
}

/* b's packed copy: per plane of b, per k block, the columns' chunks, panel by panel (a panel is
 * PC columns, fewer at the end of a slab of PNS, each [chunk][C][VW], zero-padded past K). A
 * panel starting at column j of k block kb takes the floats from j * nch(kb) * VW on in its
 * block's region, so the panels of a block tile it without gaps. */
static int64_t packed_block_floats(int64_t K, int64_t N) { return N * ((mg_min64(KB, K) + VW - 1) / VW) * VW; }

static const float *packed_panel(const float *bk, int64_t K, int64_t N, int64_t p, int64_t k0, int64_t j) {
    const int64_t nkb = (K + KB - 1) / KB, nch = (mg_min64(KB, K - k0) + VW - 1) / VW;
    return bk + (p * nkb + k0 / KB) * packed_block_floats(K, N) + j * nch * VW;
}

/* the packed path for jobs [j0, j1) of (plane, block of PMB rows), b read from its packed copy
 * bk; 0 when no buffer for a could be had */
static int mul_mat_packed(const mg_tensor *a, const mg_tensor *b, const float *bk, const mg_tensor *d, int64_t j0,
                          int64_t j1) {
    const int64_t K = a->ne[0], M = a->ne[1], N = b->ne[1];
    const int64_t r2 = b->ne[2] / a->ne[2], r3 = b->ne[3] / a->ne[3];
    const int64_t mblk = (M + PMB - 1) / PMB;
    const int64_t lda = a->nb[1], ldd = d->nb[1];
    const int64_t nchmax = (mg_min64(KB, K) + VW - 1) / VW;
    float *Ap = mg_thread_scratch(((size_t)PMB * nchmax * VW + (size_t)PMB * PNS) * sizeof(float));
    if (Ap == NULL) return 0;
    float *rb = Ap + (size_t)PMB * nchmax * VW;   /* r of the slab: [column][PMB], contiguous */
    for (int64_t job = j0; job < j1; job++) {
        const int64_t mb = job % mblk, p = job / mblk;
        const int64_t i2 = p % b->ne[2], i3 = p / b->ne[2];
        const int64_t m0 = mb * PMB, m1 = mg_min64(m0 + PMB, M);
        const char *ap = mg_ptr(a, 0, 0, i2 / r2, i3 / r3);
        char *dp = mg_ptr(d, 0, 0, i2, i3);
        for (int64_t n0 = 0; n0 < N; n0 += PNS) {
            const int64_t n1 = mg_min64(n0 + PNS, N);
            for (int64_t k0 = 0; k0 < K; k0 += KB) {
                const int64_t kk = mg_min64(KB, K - k0), nch = (kk + VW - 1) / VW;
                int64_t g = m0;
                float *Ag = Ap;
                /* the groups panel_rows runs: PR rows, (AVX-512) 2, then 1 */
                for (; g + PR <= m1; g += PR, Ag += nch * PR * VW) pack_group(Ag, ap, lda, g, PR, k0, kk, nch);
                for (; PR == 4 && g + 2 <= m1; g += 2, Ag += nch * 2 * VW) pack_group(Ag, ap, lda, g, 2, k0, kk, nch);
                if (g < m1) pack_group(Ag, ap, lda, g, (int)(m1 - g), k0, kk, nch);
                prefetcher pa, pb;   /* the next k block's rows of a (this job's) while this one runs */
                const int64_t kn = k0 + KB < K ? k0 + KB : -1;
                pf_set(&pa, kn >= 0 ? ap + m0 * lda + kn * (int64_t)sizeof(float) : NULL, lda, m1 - m0,
                       mg_min64(KB, K - kn) * (int64_t)sizeof(float));
                for (int64_t j = n0; j < n1; j += PC) {
                    const int C = (int)mg_min64(PC, n1 - j);
                    const int64_t jn = j + PC;   /* the next panel: one run of floats */
                    pf_set(&pb, jn < n1 ? (const char *)packed_panel(bk, K, N, p, k0, jn) : NULL, 0, 1,
                           mg_min64(PC, n1 - jn) * nch * VW * (int64_t)sizeof(float));
                    panel_rows(Ap, packed_panel(bk, K, N, p, k0, j), C, nch, (char *)rb, PMB * sizeof(float), 0,
                               m1 - m0, j - n0, k0 == 0, &pb, &pa);
                }
            }
            for (int64_t j = n0; j < n1; j++)
                memcpy((float *)(dp + j * ldd) + m0, rb + (j - n0) * PMB, (size_t)(m1 - m0) * sizeof(float));
        }
    }
    return 1;
}
#endif

/* a = src[0] [K, M, a2, a3], b = src[1] [K, N, b2, b3], dst [M, N, b2, b3] f32, rows dense */
/* rows [m0, m1) x columns [n0, n1) of plane p, straight from a and b */
static void direct_block(const mg_tensor *a, const mg_tensor *b, const mg_tensor *d, int64_t p,
                         int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    const int64_t K = a->ne[0];
    const int64_t r2 = b->ne[2] / a->ne[2], r3 = b->ne[3] / a->ne[3];
    const int64_t lda = a->nb[1], ldb = b->nb[1], ldd = d->nb[1];
    const int64_t i2 = p % b->ne[2], i3 = p / b->ne[2];
    const char *ap = mg_ptr(a, 0, 0, i2 / r2, i3 / r3);  /* [K, M] plane */
    const char *bp = mg_ptr(b, 0, 0, i2, i3);            /* [K, N] plane */
    char *dp = mg_ptr(d, 0, 0, i2, i3);                  /* [M, N] plane */
    if (K == 0) {
        for (int64_t j = n0; j < n1; j++)
            for (int64_t i = m0; i < m1; i++) ((float *)(dp + j * ldd))[i] = 0.0f;
        return;
    }
#if CG == 3
    /* exactly 4 columns (a decode step of 4 sequences): 4 x 3 tiles and then a pass for the 4th
     * column alone would run that pass as one fma chain per row, bound by the fma latency, not by
     * memory; 2 x 4 tiles keep 8 chains in flight and read a once */
    if (n1 - n0 == 4) { rows_2x4(TILE_ARGS, m0, m1, n0, 0, K); return; }
#endif
    /* groups of CG columns: k blocks outermost, so the block of a (MB x KB floats) is reused
     * from cache by every column group; r goes through dst between blocks */
    const int64_t jg = n0 + (n1 - n0) / CG * CG;
    for (int64_t k0 = 0; jg > n0 && k0 < K; k0 += KB) {
        const int64_t k1 = mg_min64(k0 + KB, K);
        for (int64_t j = n0; j < jg; j += CG) {
            if (K <= KB) (CG == 4 ? rows_c4 : rows_c3)(TILE_ARGS, m0, m1, j, k0, k1);   /* the whole row */
            else (CG == 4 ? rows_c4_tiles : rows_c3_tiles)(TILE_ARGS, m0, m1, j, k0, k1);
        }
    }
    /* the last 1 to CG-1 columns (one alone: matrix x vector) read a once, each tile over all of K */
    switch (n1 - jg) {
        case 3: rows_c3(TILE_ARGS, m0, m1, jg, 0, K); break;
        case 2: rows_c2(TILE_ARGS, m0, m1, jg, 0, K); break;
        case 1: rows_c1(TILE_ARGS, m0, m1, jg, 0, K); break;
        default: break;
    }
}

/* The byte step of t's columns when dims 1..3 are one arithmetic run of columns (each dim of
 * extent > 1 steps by the product of the previous ones), else 0. */
static int64_t column_run_stride(const mg_tensor *t) {
    int64_t st = 0, count = 1;
    for (int k = 1; k < 4; k++) {
        if (t->ne[k] == 1) continue;
        if (st == 0) st = t->nb[k];
        else if (t->nb[k] != st * count) return 0;
        count *= t->ne[k];
    }
    return st != 0 ? st : t->nb[1];
}

/* MUL_MAT with a single plane of a (broadcast to every plane of b) and b, dst one run of columns
 * each: the same product as one plane of ne1*ne2*ne3 columns. A decode step of several sequences
 * is [K, 1, n_seqs] against a 2D weight: as planes it reads the weight once per sequence, as
 * columns once in all. Each output is still its own dot product, so the results do not change. */
static void merge_planes(const mg_tensor *a, mg_tensor *b, mg_tensor *d) {
    if (a->ne[2] != 1 || a->ne[3] != 1 || b->ne[2] * b->ne[3] == 1) return;
    const int64_t sb = column_run_stride(b), sd = column_run_stride(d);
    if (sb == 0 || sd == 0) return;
    const int64_t cols = b->ne[1] * b->ne[2] * b->ne[3];
    b->ne[1] = d->ne[1] = cols;
    b->ne[2] = b->ne[3] = d->ne[2] = d->ne[3] = 1;
    b->nb[1] = sb;
    d->nb[1] = sd;
    b->nb[2] = b->nb[3] = sb * cols;
    d->nb[2] = d->nb[3] = sd * cols;
}

/* whether an f32 product of these operands (planes merged) takes the packed path */
static int takes_packed_path(const mg_tensor *a, const mg_tensor *b) {
    return a->type == MG_F32 && b->type == MG_F32 && b->ne[1] >= PACKED_MIN_N && a->ne[0] > 0;
}

int64_t mg_mul_mat_pack_floats(const mg_node *n) {
    mg_tensor b = n->src[1], d = n->src[2];
    merge_planes(&n->src[0], &b, &d);
    if (!takes_packed_path(&n->src[0], &b)) return 0;
    const int64_t K = n->src[0].ne[0];
#if MG_GEMM_LANES
    return b.ne[2] * b.ne[3] * mg_lanes_packed_floats(K, b.ne[1], KB);
#else
    return b.ne[2] * b.ne[3] * ((K + KB - 1) / KB) * packed_block_floats(K, b.ne[1]);
#endif
}

/* MUL_MAT:pack_src1: src[0] = a, src[1] = b, src[2] = the MUL_MAT's dst (their shapes decide,
 * as in the MUL_MAT, whether planes merge into columns), dst = b's packed copy (the work
 * buffer). Threads split the panels (PC columns from the start of each slab of PNS); each panel
 * of every k block is packed as a's row groups are (pack_group: [chunk][C][VW], the last partial
 * chunk zero-padded), at the place packed_panel gives it. */
static void mg_k_mul_mat_pack_src1(const mg_node *n, int ith, int nth) {
    const mg_tensor *a = &n->src[0];
    mg_tensor b = n->src[1], d = n->src[2];
    merge_planes(a, &b, &d);
    if (!takes_packed_path(a, &b)) return;
#if MG_GEMM_LANES
    int64_t q0, q1;
    mg_split(b.ne[2] * b.ne[3] * mg_lanes_panels(b.ne[1]), ith, nth, &q0, &q1);
    mg_lanes_pack_b(&b, (float *)n->dst.data, KB, q0, q1);
#else
    const int64_t K = a->ne[0], N = b.ne[1];
    const int64_t per_slab = (PNS + PC - 1) / PC, panels = N / PNS * per_slab + (N % PNS + PC - 1) / PC;
    int64_t q0, q1;
    mg_split(b.ne[2] * b.ne[3] * panels, ith, nth, &q0, &q1);
    for (int64_t q = q0; q < q1; q++) {
        const int64_t p = q / panels, in = q % panels;
        const int64_t n0 = in / per_slab * PNS, j = n0 + in % per_slab * PC;
        const int C = (int)mg_min64(PC, mg_min64(n0 + PNS, N) - j);
        const char *bp = mg_ptr(&b, 0, 0, p % b.ne[2], p / b.ne[2]);
        for (int64_t k0 = 0; k0 < K; k0 += KB) {
            const int64_t kk = mg_min64(KB, K - k0), nch = (kk + VW - 1) / VW;
            pack_group((float *)packed_panel((const float *)n->dst.data, K, N, p, k0, j), bp, b.nb[1], j, C, k0, kk,
                       nch);
        }
    }
#endif
}

/* a = src[0] [K, M, a2, a3], b = src[1] [K, N, b2, b3], dst [M, N, b2, b3] f32, rows dense;
 * src[2]: for the packed path, b's packed copy (MUL_MAT:pack_src1's dst; data NULL: none) */
void mg_k_mul_mat(const mg_node *n, int ith, int nth) {
    const mg_tensor *a = &n->src[0];
    mg_tensor bm = n->src[1], dm = n->dst;
    merge_planes(a, &bm, &dm);
    const mg_tensor *b = &bm;
    const mg_tensor *d = &dm;
    if (a->type != MG_F32) { mg_mul_mat_blocks(a, b, d, ith, nth); return; }   /* quant_matmul.c */
    const int64_t M = a->ne[1], N = b->ne[1];
    const int64_t planes = b->ne[2] * b->ne[3];
    int64_t j0, j1;
    if (takes_packed_path(a, b)) {   /* jobs: (plane, block of rows) x every column */
#if MG_GEMM_LANES
        const int64_t rows = mg_lanes_row_block();
#else
        const int64_t rows = PMB;
#endif
        const int64_t mblk = (M + rows - 1) / rows;
        mg_split(planes * mblk, ith, nth, &j0, &j1);
        const float *bk = (const float *)n->src[2].data;
#if MG_GEMM_LANES
        if (bk != NULL && mg_lanes_gemm(a, b, bk, d, KB, j0, j1)) return;
#else
        if (bk != NULL && mul_mat_packed(a, b, bk, d, j0, j1)) return;
#endif
        for (int64_t job = j0; job < j1; job++) {   /* no packed copy: the same jobs, directly */
            const int64_t m0 = job % mblk * rows;
            for (int64_t n0 = 0; n0 < N; n0 += NB)
                direct_block(a, b, d, job / mblk, m0, mg_min64(m0 + rows, M), n0, mg_min64(n0 + NB, N));
        }
        return;
    }
    const int64_t mblk = (M + MB - 1) / MB, nblk = (N + NB - 1) / NB;
    mg_split(planes * mblk * nblk, ith, nth, &j0, &j1);
    for (int64_t job = j0; job < j1; job++) {
        const int64_t mb = job % mblk, nbk = (job / mblk) % nblk, p = job / (mblk * nblk);
        const int64_t m0 = mb * MB, n0 = nbk * NB;
        direct_block(a, b, d, p, m0, mg_min64(m0 + MB, M), n0, mg_min64(n0 + NB, N));
    }
}

MG_KERNEL(MUL_MAT, mg_k_mul_mat, NULL)

/* an internal step of MUL_MAT, not a registry op: the name says whose ("OP:step") */
__attribute__((constructor)) static void mg_register_pack_src1(void) {
    mg_register_kernel("MUL_MAT:pack_src1", mg_k_mul_mat_pack_src1, NULL);
}
