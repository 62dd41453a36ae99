/* MUL_MAT's packed path on AVX2 (many columns: a prefill), in MUL_MAT's summation order.
 *
 * The order (matmul.c) sums each output over a k block as eight lane chains, chain l taking
 * k = l, l + 8, l + 16, ... in turn, then adds the eight chain sums in one fixed tree:
 *   ((c0 + c4) + (c2 + c6)) + ((c1 + c5) + (c3 + c7)),
 * then adds that to the sum of the blocks before. matmul.c's tiles run all eight chains at once
 * with k along a vector's lanes, so both operands are loaded as whole vectors: 8 loads per
 * 12 fmas, every loaded float used 2 to 6 times, and a 64-step loop per tile before the data
 * outgrows L1. Here each chain is a product of its own: a's rows along a vector's lanes, b
 * broadcast one float at a time, so one chain of 24 rows x 4 columns is 3 loads + 4 broadcasts
 * per 12 fmas, each chain 256 steps long over a 2048-float k block. The same fmas on the same
 * operands in the same sequence per chain, and the tree above on the chain sums: the bits of
 * matmul.c's tiles (the batch-invariance tests compare the two byte for byte).
 *
 * Measured on a Zen 3 core against OpenBLAS in one process (4096x4096 by 512): micro-kernels
 * alone in L2, 24x4 broadcast 95% of the fma peak, 16x6 broadcast 91%; the lane-along-k 2x6
 * tile with 64 steps 87%. The chains' sums go through three small buffers (the tree needs at
 * most three alive); their traffic measured within noise of none.
 *
 * Layouts. b's packed copy: per plane, per k block, per chain l, per panel of 4 columns,
 * [step][4] (zero past N and past K). a's packed copy (per job and k block, thread scratch):
 * per chain l, per tile of 24 rows, [step][24] (zero past the job's rows and past K). */
#include "gemm_lanes.h"
#include "simd_transpose.h"

#if MG_GEMM_LANES
#include <immintrin.h>

#define MR 24     /* rows per tile: 3 vectors */
#define NR 4      /* columns per panel */
#ifndef PMB
#define PMB 48    /* rows per job: 2 tiles (a's packed copy of a 2048-float block: 384 KiB, in L2) */
#endif
#ifndef PNS
#define PNS 512   /* columns per slab: the slab's running sums ([column][PMB]) stay in L2 */
#endif
#ifndef GC
#define GC 64     /* columns per group: the three chain-sum buffers cover one group */
#endif

static inline int64_t steps_of(int64_t kk) { return (kk + 7) / 8; }

static inline int64_t panels_of(int64_t N) { return (N + NR - 1) / NR; }
int64_t mg_lanes_panels(int64_t N) { return panels_of(N); }
int64_t mg_lanes_row_block(void) { return PMB; }

/* floats per (plane, k block) region: every region sized for a whole block */
static int64_t block_floats(int64_t K, int64_t N, int64_t kb) {
    return 8 * panels_of(N) * NR * steps_of(mg_min64(kb, K));
}
int64_t mg_lanes_packed_floats(int64_t K, int64_t N, int64_t kb) { return (K + kb - 1) / kb * block_floats(K, N, kb); }

static const float *chain_panel(const float *bk, int64_t K, int64_t N, int64_t kb, int64_t p, int64_t k0, int l,
                                int64_t q) {
    const int64_t nkb = (K + kb - 1) / kb, smax = steps_of(mg_min64(kb, K));
    return bk + (p * nkb + k0 / kb) * block_floats(K, N, kb) + ((int64_t)l * panels_of(N) + q) * smax * NR;
}

/* 8 floats from p, the first `have` of them (0..8) real, the rest zero */
static inline __m256 load_part(const float *p, int64_t have) {
    static const int32_t tab[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    if (have >= 8) return _mm256_loadu_ps(p);
    if (have <= 0) return _mm256_setzero_ps();
    return _mm256_maskload_ps(p, _mm256_loadu_si256((const __m256i *)(tab + 8 - have)));
}

void mg_lanes_pack_b(const mg_tensor *b, float *out, int64_t kb, int64_t q0, int64_t q1) {
    const int64_t K = b->ne[0], N = b->ne[1], npan = panels_of(N);
    for (int64_t q = q0; q < q1; q++) {
        const int64_t p = q / npan, qi = q % npan;
        const char *bp = mg_ptr(b, 0, 0, p % b->ne[2], p / b->ne[2]);
        const float *col[NR];
        for (int c = 0; c < NR; c++) col[c] = qi * NR + c < N ? (const float *)(bp + (qi * NR + c) * b->nb[1]) : NULL;
        for (int64_t k0 = 0; k0 < K; k0 += kb) {
            const int64_t kk = mg_min64(kb, K - k0), ns = steps_of(kk);
            float *o[8];
            for (int l = 0; l < 8; l++) o[l] = (float *)chain_panel(out, K, N, kb, p, k0, l, qi);
            for (int64_t t = 0; t < ns; t++) {
                __m256 v[8];
                for (int c = 0; c < NR; c++) v[c] = col[c] ? load_part(col[c] + k0 + 8 * t, kk - 8 * t) : _mm256_setzero_ps();
                /* 4 columns x 8 k -> per k, the 4 columns (rows 4..7 of the transpose stay zero) */
                for (int c = NR; c < 8; c++) v[c] = _mm256_setzero_ps();
                mg_transpose8x8_ps(v);
                for (int l = 0; l < 8; l++) _mm_storeu_ps(o[l] + t * NR, _mm256_castps256_ps128(v[l]));
            }
        }
    }
}

/* a's rows [m0, m1) (zero past m1), floats [k0, k0 + kk), as [chain][tile][step][MR]: 8 rows x
 * 8 k transposed in registers */
static void pack_a(float *out, const char *ap, int64_t lda, int64_t m0, int64_t m1, int64_t k0, int64_t kk) {
    const int64_t ns = steps_of(kk), ntile = (m1 - m0 + MR - 1) / MR;
    for (int64_t ti = 0; ti < ntile; ti++)
        for (int g = 0; g < MR / 8; g++) {
            const float *row[8];
            for (int r = 0; r < 8; r++) {
                const int64_t m = m0 + ti * MR + g * 8 + r;
                row[r] = m < m1 ? (const float *)(ap + m * lda) + k0 : NULL;
            }
            for (int64_t t = 0; t < ns; t++) {
                __m256 v[8];
                for (int r = 0; r < 8; r++) v[r] = row[r] ? load_part(row[r] + 8 * t, kk - 8 * t) : _mm256_setzero_ps();
                mg_transpose8x8_ps(v);
                for (int l = 0; l < 8; l++) _mm256_storeu_ps(out + ((l * ntile + ti) * ns + t) * MR + g * 8, v[l]);
            }
        }
}

/* one chain of a 24 x 4 tile: c[g][j] = the chain over ns steps for rows g*8.., column j */
static inline __attribute__((always_inline)) void chain(const float *A, const float *B, int64_t ns, __m256 c[3][NR]) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00,
           c20 = c00, c21 = c00, c22 = c00, c23 = c00;
    for (int64_t t = 0; t < ns; t++, A += MR, B += NR) {
        __m256 a0 = _mm256_loadu_ps(A), a1 = _mm256_loadu_ps(A + 8), a2 = _mm256_loadu_ps(A + 16);
        /* in registers: left alone, the compiler folds each load into the four fmas that use
         * it (12 loads a step instead of 3; measured 250 ms against 200 for 4096x4096x512) */
        __asm__("" : "+x"(a0), "+x"(a1), "+x"(a2));
        __m256 b = _mm256_broadcast_ss(B);
        c00 = _mm256_fmadd_ps(a0, b, c00), c10 = _mm256_fmadd_ps(a1, b, c10), c20 = _mm256_fmadd_ps(a2, b, c20);
        b = _mm256_broadcast_ss(B + 1);
        c01 = _mm256_fmadd_ps(a0, b, c01), c11 = _mm256_fmadd_ps(a1, b, c11), c21 = _mm256_fmadd_ps(a2, b, c21);
        b = _mm256_broadcast_ss(B + 2);
        c02 = _mm256_fmadd_ps(a0, b, c02), c12 = _mm256_fmadd_ps(a1, b, c12), c22 = _mm256_fmadd_ps(a2, b, c22);
        b = _mm256_broadcast_ss(B + 3);
        c03 = _mm256_fmadd_ps(a0, b, c03), c13 = _mm256_fmadd_ps(a1, b, c13), c23 = _mm256_fmadd_ps(a2, b, c23);
    }
    c[0][0] = c00, c[0][1] = c01, c[0][2] = c02, c[0][3] = c03;
    c[1][0] = c10, c[1][1] = c11, c[1][2] = c12, c[1][3] = c13;
    c[2][0] = c20, c[2][1] = c21, c[2][2] = c22, c[2][3] = c23;
}

/* a tile's values in a [column][ld] buffer at s: store, or add (x + s: the tree's operands in
 * either order give the same bits, addition being commutative) */
static inline void put(float *s, int64_t ld, __m256 c[3][NR]) {
    for (int j = 0; j < NR; j++)
        for (int g = 0; g < 3; g++) _mm256_storeu_ps(s + j * ld + g * 8, c[g][j]);
}
static inline void add(__m256 c[3][NR], const float *s, int64_t ld) {
    for (int j = 0; j < NR; j++)
        for (int g = 0; g < 3; g++) c[g][j] = _mm256_add_ps(c[g][j], _mm256_loadu_ps(s + j * ld + g * 8));
}

/* the chains in the order the tree consumes them, and what each does with its sums:
 * stage 0: c0 -> S0; 1: c4 + S0 -> S0; 2: c2 -> S1; 3: (c6 + S1) + S0 -> S0 (the left half);
 * 4: c1 -> S1; 5: c5 + S1 -> S1; 6: c3 -> S2; 7: ((c7 + S2) + S1) + S0 = the block's sum, then
 * r = r + sum (r = 0 at the first block, as the tiles' r starts) */
static const int chain_of_stage[8] = {0, 4, 2, 6, 1, 5, 3, 7};

static inline __attribute__((always_inline)) void stage_tile(int s, const float *A, const float *B, int64_t ns,
                                                             float *S0, float *S1, float *S2, int64_t lds, float *R,
                                                             int64_t ldr, int first) {
    __m256 c[3][NR];
    chain(A, B, ns, c);
    switch (s) {
        case 0: put(S0, lds, c); break;
        case 1: add(c, S0, lds); put(S0, lds, c); break;
        case 2: put(S1, lds, c); break;
        case 3: add(c, S1, lds); add(c, S0, lds); put(S0, lds, c); break;
        case 4: put(S1, lds, c); break;
        case 5: add(c, S1, lds); put(S1, lds, c); break;
        case 6: put(S2, lds, c); break;
        default:
            add(c, S2, lds);
            add(c, S1, lds);
            add(c, S0, lds);
            if (first) {
                for (int j = 0; j < NR; j++)
                    for (int g = 0; g < 3; g++) c[g][j] = _mm256_add_ps(_mm256_setzero_ps(), c[g][j]);
            } else {
                add(c, R, ldr);
            }
            put(R, ldr, c);
    }
}

/* A job: PMB rows of one plane. Per slab of PNS columns and k block: pack a's rows, then per
 * group of GC columns, per chain (in the tree's order), per tile of rows (its 24 KiB of a stay in
 * L1), per panel (4 KiB of b from L2). Measured 4096x4096 by 512 on the Zen 3 core, ms at 1 / 2
 * threads (OpenBLAS 185 / 94.5): PMB 96 187 / 106 (a's copy outgrows L2), PMB 48 184-188 /
 * 94-96; panels outer and tiles inner instead streamed 24 KiB of a per chain from L2, within
 * noise at 1 thread. */
int mg_lanes_gemm(const mg_tensor *a, const mg_tensor *b, const float *bk, const mg_tensor *d, int64_t kb,
                  int64_t j0, int64_t j1) {
    const int64_t K = a->ne[0], M = a->ne[1], N = b->ne[1];
    const int64_t r2 = b->ne[2] / a->ne[2], r3 = b->ne[3] / a->ne[3];
    const int64_t mblk = (M + PMB - 1) / PMB, smax = steps_of(mg_min64(kb, K));
    const int64_t lda = a->nb[1], ldd = d->nb[1];
    const int64_t ld = PMB;   /* buffers: [column][PMB] */
    const size_t a_floats = (size_t)8 * PMB * smax, s_floats = (size_t)3 * GC * ld, r_floats = (size_t)PNS * ld;
    float *Ap = mg_thread_scratch((a_floats + s_floats + r_floats) * sizeof(float));
    if (Ap == NULL) return 0;
    float *S = Ap + a_floats, *R = S + s_floats;
    for (int64_t job = j0; job < j1; job++) {
        const int64_t mb = job % mblk, p = job / mblk;
        const int64_t i2 = p % b->ne[2], i3 = p / b->ne[2];
        const int64_t m0 = mb * PMB, m1 = mg_min64(m0 + PMB, M), ntile = (m1 - m0 + MR - 1) / MR;
        const char *ap = mg_ptr(a, 0, 0, i2 / r2, i3 / r3);
        char *dp = mg_ptr(d, 0, 0, i2, i3);
        for (int64_t n0 = 0; n0 < N; n0 += PNS) {
            const int64_t n1 = mg_min64(n0 + PNS, N);
            for (int64_t k0 = 0; k0 < K; k0 += kb) {
                const int64_t kk = mg_min64(kb, K - k0), ns = steps_of(kk);
                pack_a(Ap, ap, lda, m0, m1, k0, kk);
                for (int64_t g0 = n0; g0 < n1; g0 += GC) {
                    const int64_t g1 = mg_min64(g0 + GC, n1);
                    for (int s = 0; s < 8; s++) {
                        const int l = chain_of_stage[s];
                        for (int64_t ti = 0; ti < ntile; ti++) {
                            const float *Al = Ap + (l * ntile + ti) * ns * MR;
                            for (int64_t j = g0; j < g1; j += NR) {
                                const int64_t off = (j - g0) * ld + ti * MR;
                                stage_tile(s, Al, chain_panel(bk, K, N, kb, p, k0, l, j / NR), ns, S + off,
                                           S + GC * ld + off, S + 2 * GC * ld + off, ld, R + (j - n0) * ld + ti * MR,
                                           ld, k0 == 0);
                            }
                        }
                    }
                }
            }
            for (int64_t j = n0; j < n1; j++)
                memcpy((float *)(dp + j * ldd) + m0, R + (j - n0) * ld, (size_t)(m1 - m0) * sizeof(float));
        }
    }
    return 1;
}
#endif
