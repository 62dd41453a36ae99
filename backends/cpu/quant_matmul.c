/* MUL_MAT with f16, bf16 or block-quantized weights (src0) and an f32 operand (src1), the way
 * ggml's CPU backend computes it (quant.h), in two plan records:
 *
 *   MUL_MAT:src1_to_dot_type  converts every row of src1 once into a work buffer of the weights'
 *                             dot type (q8_0, q8_K, f16, bf16): threads split its rows;
 *   MUL_MAT                   (this file's mg_mul_mat_blocks, reached from matmul.c when src0 is
 *                             not f32) reads that buffer as its src1: each output is one dot
 *                             product of a weight row with a converted row: integer products per
 *                             block, scaled by the two blocks' scales, summed in f32.
 * The Python side (backends/cpu/__init__.py) inserts the conversion record and owns the buffer.
 *
 * Why these dot products agree with ggml's: the per-block integer sums are exact, the scales are
 * the same f32 products ggml forms, and on AVX2 the float accumulation follows ggml's own lanes
 * and order (8 partial sums per row, one fma per block, one horizontal sum), so results are
 * usually bit-identical to ggml's AVX2 build and otherwise differ by f32 rounding only. The
 * exceptions put 8 weight rows in the vector lanes and sum each output in one f32 chain of their
 * own (q8_0, q4_K and q6_K with MG_KROWS; q8_0 and q4_K with MG_PANELS, below): they differ
 * from ggml's by f32 rounding.
 *
 * Speed: matrix x vector is a stream over the weights (see QPF below) or over 8 rows at a time;
 * with more src1 rows the outputs are computed in register tiles (run_tiles): 8 weight rows by
 * C columns where a type has 8-row kernels, packed once per job into panels (run_panels) from
 * PANEL_MIN_N columns on (q8_0 and q4_K on MG_PANELS builds, q4_K on MG_KROWS ones, and q6_K there
 * from Q6K_PANEL_MIN_N); otherwise
 * one weight row against CMAX columns, so that a weight block is loaded and unpacked once for
 * several converted rows. q4_K and q6_K weights may come packed in groups of 8 rows (MG_Q4_KX8,
 * MG_Q6_KX8: mg_pack_rows at load, on the builds with 8-row kernels), which those kernels read as
 * one stream with the values already in lanes; every output keeps its bits.
 *
 * Batch invariance: an output element is the same function of (weight row, converted row)
 * whatever the thread, the chunk, the tile or the number of src1 rows: a tile only interleaves
 * independent chains, and a src1 row is converted on its own. */
#include <stddef.h>
#include <stdlib.h>
#include "quant.h"
#include "simd_transpose.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MG_QAVX2 1
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define MG_VNNI 1   /* 256-bit vpdpwssd: int16 pair products added into int32 sums in one step */
#endif
#endif
/* q8_0, q4_K and q6_K with one weight row per lane, 8 rows at once (tile_q8_0_8, tile_q4_K_8,
 * tile_q6_K_8), on builds with AVX-512 VNNI and VBMI. There an output is one f32 chain over its
 * blocks' exact integer sums (one fma per block and term), which the one-row kernels then follow
 * too: every kernel of the type gives the same bits, and ggml's (8 partial lanes, one horizontal
 * sum) differ by f32 rounding. q8_0's converted rows there are MG_Q8_0S (quant.h). Other builds
 * keep ggml's lanes and bits. */
#if MG_VNNI && defined(__AVX512VBMI__)
#define MG_KROWS 8
#endif
/* q8_0 and q4_K on the other AVX2 builds: 8 weight rows in the lanes too, without vpdpbusd
 * (maddubs); matrix x matrix packs them once per job into panels (run_panels) that all the
 * converted rows then read, and every kernel of the two types sums an output's blocks in one f32
 * chain, as on the MG_KROWS builds. q4_K's converted rows there are MG_Q8_KP (quant.h: the sums
 * of each 32 values made once per converted row): mg_work_type, dot_q4_K and the panels follow
 * this */
#if MG_QAVX2 && !defined(MG_KROWS)
#define MG_Q4K_PAIR_SUMS 1
#define MG_PANELS 1
#endif
/* q4_K's panels serve the MG_KROWS builds too (their chain is tile_q4_K_8's there), from more
 * columns on (PANEL_MIN_N) */
#if MG_QAVX2
#define MG_Q4K_PANELS 1
#endif

/* Tuning knob (build-time) QPF: how far ahead (bytes) the weight row is prefetched into L1;
 * 2048 measured 0-15% faster than none here (AMD EPYC Zen 3, 4096x4096 matrix x vector). */
#ifndef QPF
#define QPF 2048
#endif
#define PREFETCH(p) do { if (QPF) _mm_prefetch((const char *)(p) + QPF, _MM_HINT_T0); } while (0)

/* A pass is one weight row against C (1 to CMAX) converted rows: the weight block is loaded and
 * unpacked once for the C columns, each column with its own accumulators. (Sharing a converted
 * row across 2-4 weight rows instead measured 0.6-0.9x: matrix x vector streams the weights.) */
#define TMAX 6   /* the widest tile any build may use (array bounds) */
#ifndef CMAX
#if defined(__AVX512F__)
#define CMAX 6   /* 32 vector registers: 6 columns' accumulators fit (q4_K, q6_K 1.05-1.3x of 4 here) */
#else
#define CMAX 4
#endif
#endif

#if MG_QAVX2
/* v kept in a register at this point of the sequence. The integer sums of the kernels below are
 * associative, so the compiler is free to regroup them: it gathered all of a block's products
 * first and summed them in trees, spilling them to the stack (q4_K panels, K768 M2048 by 512,
 * 1 thread, Zen 3: 13.7 ms with the regrouping, 10.6 ms with each sum pinned in its order). The
 * values are the same either way (exact integer sums). */
#define PIN(v) __asm__("" : "+x"(v))

/* acc + the int16 pair products of a and b, summed into int32 lanes: one vpdpwssd on VNNI builds */
static inline __m256i add_madd16(__m256i acc, __m256i a, __m256i b) {
#if MG_VNNI
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

/* independent int32 sum chains per q4_K block: vpdpwssd's latency makes one chain of eight per
 * block wait on it; the add of the AVX2 path has latency 1. Integer sums: the same in any order */
#if MG_VNNI
#define Q4K_CHAINS 4
#else
#define Q4K_CHAINS 1
#endif

/* the int32 total of the lanes, in lane 0 (exact: the lanes are parts of one int32 sum) */
static inline __m128i hsum4_epi32(__m128i s) {
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
}
static inline __m128i hsum8_epi32(__m256i v) {
    return hsum4_epi32(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}
/* one output's chain in the one-row kernels of the types with 8-row kernels, in lane 0:
 * acc + sum * d rounded once, as the 8-row kernels' lanes do (kept in vector registers: a scalar
 * int to float conversion would wait on its destination's last value) */
static inline __m128 chain_fma(__m128 acc, __m128i sum, float d) {
    return _mm_fmadd_ss(_mm_cvtepi32_ps(sum), _mm_set_ss(d), acc);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* Weights streaming from memory (decode of a few sequences) into tiles: a tile reads R rows a
 * block at a time, R streams that the hardware prefetcher follows badly (q4_K's 8 rows 5.3
 * against 16.7 GB/s for the one-row stream, q8_0's 4 rows 5.6 against 22.6; 1 thread), so each
 * block step asks for the next 1/nb of the bytes of the tile TILE_PF_GROUPS tiles ahead, in
 * address order (rows are usually contiguous; a tile of a later job or past the weights asks
 * harmlessly: prefetches do not fault) */
#if MG_QAVX2
#ifndef TILE_PF_GROUPS
#define TILE_PF_GROUPS 2
#endif
static inline void prefetch_tile_step(const char *xrow, size_t tile_bytes, int64_t b, int64_t nb) {
    const size_t step = tile_bytes / (size_t)nb;
    const uintptr_t from = (uintptr_t)(xrow + TILE_PF_GROUPS * tile_bytes + (size_t)b * step);
    const char *x = (const char *)((from + 63) & ~(uintptr_t)63);   /* each line once */
    /* into L2 (prefetcht1: into L1 it measured no better than none, 5.9 against 11.0 GB/s for
     * q6_K by 4), and as asm: GCC drops _mm_prefetch from these kernels */
    for (; (uintptr_t)x < from + step; x += 64) __asm__ volatile("prefetcht1 %0" ::"m"(*x));
}
#endif

/* ---- q8_0 weights x q8_0 rows ---- */
/* one weight row against C converted rows. With SIMD this is the 8-row kernels' chain (below:
 * tile_q8_0_8 and the panels; MG_KROWS builds take dot_q8_0s instead) for the rows they leave:
 * per block the exact int32 sum S (|x| against y carrying x's sign, y > -128: converted rows
 * never hold -128), then acc + S * (dx * dy) rounded once */
static inline __attribute__((always_inline)) void dot_q8_0(int64_t nb, const char *xrow, const void *const *ys,
                                                           const int C, float *out) {
    const mg_block_q8_0 *x = (const mg_block_q8_0 *)xrow;
#if MG_QAVX2
    __m128 chain[TMAX];
    for (int c = 0; c < C; c++) chain[c] = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i qx = _mm256_loadu_si256((const __m256i *)x[b].qs);
        const __m256i ax = _mm256_sign_epi8(qx, qx);
        const float dx = mg_fp16_to_fp32(x[b].d);
        for (int c = 0; c < C; c++) {
            const mg_block_q8_0 *y = (const mg_block_q8_0 *)ys[c] + b;
            const __m256i p = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)y->qs), qx));
            chain[c] = chain_fma(chain[c], hsum8_epi32(_mm256_madd_epi16(p, _mm256_set1_epi16(1))), dx * mg_fp16_to_fp32(y->d));
        }
    }
    for (int c = 0; c < C; c++) out[c] = _mm_cvtss_f32(chain[c]);
#else
    for (int c = 0; c < C; c++) {
        const mg_block_q8_0 *y = ys[c];
        float s = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            int isum = 0;
            for (int j = 0; j < MG_QK8_0; j++) isum += x[b].qs[j] * y[b].qs[j];
            s += (float)isum * (mg_fp16_to_fp32(x[b].d) * mg_fp16_to_fp32(y[b].d));
        }
        out[c] = s;
    }
#endif
}

/* ---- q4_0 weights x q8_0 rows (MG_Q8_0X layout, quant.h) ---- */
static inline __attribute__((always_inline)) void dot_q4_0(int64_t nb, const char *xrow, const void *const *ys,
                                                           const int C, float *out) {
    const mg_block_q4_0 *x = (const mg_block_q4_0 *)xrow;
    const int8_t *yq[TMAX];
    const int16_t *ys8[TMAX];
    const char *yd[TMAX];
    for (int c = 0; c < C; c++) {
        yq[c] = ys[c];
        ys8[c] = (const int16_t *)(yq[c] + 32 * nb);
        yd[c] = (const char *)(ys8[c] + 16 * nb);
    }
#if MG_QAVX2
    __m256 acc[TMAX];
    const __m256i lo4 = _mm256_set1_epi8(0xf), ones = _mm256_set1_epi16(1);
    for (int c = 0; c < C; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        PREFETCH(x + b);
        const __m128i raw = _mm_loadu_si128((const __m128i *)x[b].qs);
        /* low nibbles are values 0..15, high nibbles 16..31 */
        const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), lo4);
        const float dx = mg_fp16_to_fp32(x[b].d);
        for (int c = 0; c < C; c++) {
            /* pairs of nibble * y minus 8 * (pair of y): pairs of (nibble - 8) * y, as ggml's */
            const __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(nib, _mm256_loadu_si256((const __m256i *)(yq[c] + 32 * b))),
                                               _mm256_loadu_si256((const __m256i *)(ys8[c] + 16 * b)));
            const __m256 d = _mm256_set1_ps(dx * mg_load_f32(yd[c] + 4 * b));
            acc[c] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), acc[c]);
        }
    }
    for (int c = 0; c < C; c++) out[c] = hsum8(acc[c]);
#else
    for (int c = 0; c < C; c++) {
        float s = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *y = yq[c] + 32 * b;
            int isum = 0;
            for (int j = 0; j < MG_QK4_0 / 2; j++) {
                isum += ((x[b].qs[j] & 0xf) - 8) * y[j];
                isum += ((x[b].qs[j] >> 4) - 8) * y[j + MG_QK4_0 / 2];
            }
            s += (float)isum * (mg_fp16_to_fp32(x[b].d) * mg_load_f32(yd[c] + 4 * b));
        }
        out[c] = s;
    }
#endif
}

/* the 8 scales and 8 mins of a q4_K block (6 bits each, packed in 12 bytes, quant.h) as bytes:
 * sc[0..3] / m[0..3] are the low 6 bits of bytes 0..3 / 4..7; sc[4..7] / m[4..7] take their low 4
 * bits from the nibbles of bytes 8..11 and their top 2 bits from the top bits of bytes 0..3 / 4..7 */
static inline void q4_K_unpack(const uint8_t *s12, uint32_t sc[2], uint32_t m[2]) {
    uint32_t u0, u1, u2;
    memcpy(&u0, s12, 4); memcpy(&u1, s12 + 4, 4); memcpy(&u2, s12 + 8, 4);
    sc[0] = u0 & 0x3f3f3f3fu;
    m[0] = u1 & 0x3f3f3f3fu;
    sc[1] = (u2 & 0x0f0f0f0fu) | (((u0 >> 6) & 0x03030303u) << 4);
    m[1] = ((u2 >> 4) & 0x0f0f0f0fu) | (((u1 >> 6) & 0x03030303u) << 4);
}

/* ---- q4_K weights x q8_K rows ---- */
/* one weight row against C converted rows. With SIMD this is the 8-row kernels' chain (below:
 * tile_q4_K_8 and the panels) for the rows they leave: per block the exact sums S and Mn, then
 * acc + S * (d * dy), + Mn * (dmin * -dy), each rounded once */
static inline __attribute__((always_inline)) void dot_q4_K(int64_t nb, const char *xrow, const void *const *ys,
                                                           const int C, float *out) {
    const mg_block_q4_K *x = (const mg_block_q4_K *)xrow;
#if MG_QAVX2
    const __m256i lo4 = _mm256_set1_epi8(0xf);
    __m128 chain[TMAX];
    for (int c = 0; c < C; c++) chain[c] = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        PREFETCH(x + b); PREFETCH((const char *)(x + b) + 64);
        uint32_t sc[2], m[2];
        q4_K_unpack(x[b].scales, sc, m);
        const __m128i mins = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)m[1], (int)m[0]));
        const __m128i s16 = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)sc[1], (int)sc[0]));
        const __m256i scl = _mm256_set_m128i(s16, s16);   /* the 8 scales as int16, both halves */
        const float xd = mg_fp16_to_fp32(x[b].d), xdmin = mg_fp16_to_fp32(x[b].dmin);
        /* the block's int32 sums, in nch chains: several columns are already independent chains */
        const int nch = C >= 3 ? 1 : Q4K_CHAINS;
        __m256i part[TMAX][Q4K_CHAINS];
        __m128i mnsum[TMAX];
        for (int c = 0; c < C; c++) {
            const mg_block_q8_K *y = (const mg_block_q8_K *)ys[c] + b;
            /* the sums of each 32 converted values (pairs of bsums), against the mins */
#if MG_Q4K_PAIR_SUMS
            const __m128i bs32 = _mm_loadu_si128((const __m128i *)y->bsums);
#else
            const __m256i bs = _mm256_loadu_si256((const __m256i *)y->bsums);
            const __m128i bs32 = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
#endif
            mnsum[c] = hsum4_epi32(_mm_madd_epi16(mins, bs32));
            for (int q = 0; q < nch; q++) part[c][q] = _mm256_setzero_si256();
        }
        for (int j = 0; j < 4; j++) {   /* 64 values: 32 bytes of nibbles against 64 converted values */
            const __m256i q4 = _mm256_loadu_si256((const __m256i *)(x[b].qs + 32 * j));
            const __m256i q4l = _mm256_and_si256(q4, lo4), q4h = _mm256_and_si256(_mm256_srli_epi16(q4, 4), lo4);
            /* int16 scales 2j and 2j+1 broadcast */
            const __m256i sl = _mm256_shuffle_epi8(scl, _mm256_set1_epi16((short)(0x0100 + 0x0202 * (2 * j))));
            const __m256i sh = _mm256_shuffle_epi8(scl, _mm256_set1_epi16((short)(0x0100 + 0x0202 * (2 * j + 1))));
            for (int c = 0; c < C; c++) {
                const int8_t *q8 = ((const mg_block_q8_K *)ys[c] + b)->qs + 64 * j;
                const __m256i pl = _mm256_maddubs_epi16(q4l, _mm256_loadu_si256((const __m256i *)q8));
                const __m256i ph = _mm256_maddubs_epi16(q4h, _mm256_loadu_si256((const __m256i *)(q8 + 32)));
                __m256i *lo = &part[c][(2 * j) % nch], *hi = &part[c][(2 * j + 1) % nch];
                *lo = add_madd16(*lo, sl, pl);
                *hi = add_madd16(*hi, sh, ph);
            }
        }
        for (int c = 0; c < C; c++) {
            const float dy = ((const mg_block_q8_K *)ys[c] + b)->d;
            __m256i sumi = part[c][0];
            for (int q = 1; q < nch; q++) sumi = _mm256_add_epi32(sumi, part[c][q]);
            chain[c] = chain_fma(chain[c], hsum8_epi32(sumi), xd * dy);
            chain[c] = chain_fma(chain[c], mnsum[c], xdmin * -dy);
        }
    }
    for (int c = 0; c < C; c++) out[c] = _mm_cvtss_f32(chain[c]);
#else
    for (int c = 0; c < C; c++) {
        const mg_block_q8_K *y = ys[c];
        float s = 0.0f, smin = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            uint32_t sc4[2], m4[2];
            q4_K_unpack(x[b].scales, sc4, m4);
            const uint8_t *sc = (const uint8_t *)sc4, *m = (const uint8_t *)m4;
            int isum = 0, imin = 0;
            for (int j = 0; j < 8; j++) {
                const int8_t *q8 = y[b].qs + 32 * j;
                const uint8_t *q4 = x[b].qs + 32 * (j / 2);
                int dj = 0;
                for (int l = 0; l < 32; l++) dj += (j & 1 ? q4[l] >> 4 : q4[l] & 0xf) * q8[l];
                isum += sc[j] * dj;
                imin += m[j] * (y[b].bsums[2 * j] + y[b].bsums[2 * j + 1]);
            }
            s += (y[b].d * mg_fp16_to_fp32(x[b].d)) * (float)isum;
            smin += (-y[b].d * mg_fp16_to_fp32(x[b].dmin)) * (float)imin;
        }
        out[c] = s + smin;
    }
#endif
}

#if MG_QAVX2
/* v[k] = dword k of the 32 bytes at p[r] + off, for the 8 rows r (lane r) */
static inline __attribute__((always_inline)) void load_rows_transposed(const char *const p[8], size_t off, __m256i v[8]) {
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) v[r] = _mm256_loadu_si256((const __m256i *)(p[r] + off));
    mg_transpose8x8_epi32(v);
}

/* acc[c] (lane r: weight row r) to out[r * C + c] */
static inline __attribute__((always_inline)) void store_lanes(const __m256 *acc, const int C, float *out) {
    float o8[8 * TMAX] = {0};
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) _mm256_storeu_ps(o8 + 8 * c, acc[c]);
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++)
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) out[r * C + c] = o8[8 * c + r];
}
#endif

/* ---- MG_Q4_KX8: q4_K weight rows packed in groups of 8 (mg_pack_rows, at load) ----
 * The 8-row kernels below read 8 rows a block at a time: 8 streams, whose values they transpose
 * into lanes on every pass. Packed, a group of 8 rows is one stream in the order they read it, in
 * the same bytes (8 rows of nb blocks): block b of the group is Q4K_GROUP_BLOCK bytes at
 * b * Q4K_GROUP_BLOCK, first the 8 rows' 16 header bytes (d, dmin, the 12 scale bytes) one
 * after another, then for each 32 value bytes g (sub-blocks 2g and 2g + 1) and each 4-byte column
 * k, the 8 rows' 4 bytes: lane r of the vector at Q4K_GROUP_HEADS + 256 g + 32 k is row r's.
 * The rows after the last whole group keep q4_K's layout (the one-row kernel reads them). Only the
 * arrangement changes, so every output has the bits of the unpacked rows. */
#define Q4K_GROUP_HEADS (8 * 16)
#define Q4K_GROUP_BLOCK (8 * (int64_t)sizeof(mg_block_q4_K))

/* ---- q4_K: 8 weight rows at once (builds with AVX-512 VNNI and VBMI) ----
 * dot_q4_K spends two multiplies per 32 values and output (maddubs, then the scale). Here the
 * 8 rows' bytes are transposed into lanes (lane r holds row r's 4 bytes at one position), so
 * one vpdpbusd against 4 converted values, broadcast, multiplies 8 rows at once; four of them
 * give each lane 16 products (|sum| <= 16 * 15 * 128 < 2^15, an int16 held in an int32), and
 * one vpdpwssd applies the 8 rows' scales (int32 lanes with the scale in the low half): 1.25
 * multiplies per 32 values and output, and no horizontal sums.
 * Each output is lane r's sum over blocks of (dy * d_r) * S + (-dy * dmin_r) * Mn, S and Mn the
 * block's exact integer sums: a fixed order per (weight row, converted row), so results do not
 * depend on the tile, the batch or the thread; they differ from ggml's vec_dot (8 partial lanes
 * per row, one horizontal sum) by f32 rounding. Matrix x vector takes the same path. */
#ifdef MG_KROWS
/* block b's headers of 8 q4_K rows (d, dmin and the 12 scale bytes: 16 bytes a row), rows 0-3 in
 * hd[0] and 4-7 in hd[1]; sm the same rows' 6-bit scales and mins as [8 scales, 8 mins] bytes: the
 * packing undone in lanes, as q4_K_unpack does for one row. Rows packed in groups of 8
 * (MG_Q4_KX8, below) hold the 8 headers side by side: two loads */
static inline __attribute__((always_inline)) void q4_K_heads_8(const mg_block_q4_K *const xr[8], int64_t b,
                                                               const char *packed_block, __m512i hd[2], __m512i sm[2]) {
    const __m512i shifts = _mm512_set4_epi32(4, 0, 0, 0);
    const __m512i lo_mask = _mm512_set4_epi32(0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f);
    const __m512i hi_mask = _mm512_set4_epi32(0x30303030, 0, 0x30303030, 0);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        __m512i v;
        if (packed_block) {
            v = _mm512_loadu_si512((const void *)(packed_block + 64 * h));
        } else {
            v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(xr[4 * h] + b)));
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(xr[4 * h + 1] + b)), 1);
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(xr[4 * h + 2] + b)), 2);
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(xr[4 * h + 3] + b)), 3);
        }
        hd[h] = v;
        /* dwords of a row: [d dmin, u0, u1, u2] -> [u0, u2, u1, u2] and [u0, u0, u1, u1] */
        const __m512i a = _mm512_shuffle_epi32(v, _MM_PERM_DCDB), c = _mm512_shuffle_epi32(v, _MM_PERM_CCBB);
        /* sc 0-3 = u0 & 3f; sc 4-7 = u2 & 0f | top bits of u0; m 0-3 = u1 & 3f; m 4-7 = (u2 >> 4) & 0f | top of u1 */
        const __m512i low = _mm512_and_si512(_mm512_srlv_epi32(a, shifts), lo_mask);
        sm[h] = _mm512_ternarylogic_epi32(low, _mm512_srli_epi32(c, 2), hi_mask, 0xf8);   /* low | (c & hi) */
    }
}

/* byte permutations of the two sm vectors (row r's scale j at 16r + j, its min j at 16r + 8 + j):
 * SC_T makes sub-block-major rows of 8 bytes (one per weight row); M_T makes, per pair of
 * sub-blocks t, 8 rows x 2 bytes (m_2t, m_2t+1); DM_T the 8 rows' d then their dmin (fp16 words
 * of hd) */
static const uint8_t Q4K_SC_T[64] __attribute__((aligned(64))) = {
    0,16,32,48,64,80,96,112,1,17,33,49,65,81,97,113,2,18,34,50,66,82,98,114,3,19,35,51,67,83,99,115,
    4,20,36,52,68,84,100,116,5,21,37,53,69,85,101,117,6,22,38,54,70,86,102,118,7,23,39,55,71,87,103,119};
static const uint8_t Q4K_M_T[64] __attribute__((aligned(64))) = {
    8,9,24,25,40,41,56,57,72,73,88,89,104,105,120,121,10,11,26,27,42,43,58,59,74,75,90,91,106,107,122,123,
    12,13,28,29,44,45,60,61,76,77,92,93,108,109,124,125,14,15,30,31,46,47,62,63,78,79,94,95,110,111,126,127};
static const uint16_t Q4K_DM_T[32] __attribute__((aligned(64))) = {
    0,8,16,24,32,40,48,56,1,9,17,25,33,41,49,57};

/* acc + the 4-byte dot products of w (unsigned) with the 4 signed bytes at p in every lane: the
 * bytes come as an embedded broadcast (a load, no instruction of its own; GCC does not fold
 * _mm256_set1_epi32 into vpdpbusd) */
static inline __m256i dpbusd_bcast(__m256i acc, __m256i w, const void *p) {
    __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}

/* a[c] = the 4 lane vectors w[0..3] (4 values of 8 rows each) against the 16 converted values of
 * column c from off: the panels' inner step (q4_K_panel_block, q6_K_panel_block) */
static inline __attribute__((always_inline)) void dots4_panel(const __m256i *w, const mg_block_q8_K *const *y,
                                                              int64_t off, const int C, __m256i *a) {
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) a[c] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        const __m256i wk = _mm256_load_si256(w + k);
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) a[c] = dpbusd_bcast(a[c], wk, y[c]->qs + off + 4 * k);
    }
}

/* word r = the fp16 at d0 + r * xs, for the 8 rows r (one masked load each: no other byte is
 * read, and nothing goes through memory, where a store-then-load would stall) */
static inline __attribute__((always_inline)) __m128i load_halves_8(const char *d0, size_t xs) {
    __m128i h = _mm_setzero_si128();
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++)
        h = _mm_mask_loadu_epi16(h, (__mmask8)(1u << r), (const uint16_t *)(d0 + (size_t)r * xs) - r);
    return h;
}


/* weight rows xrow + r * xs (r < 8) against C converted rows: out[r * C + c]. packed (a constant
 * in each expansion): the 8 rows are a group of MG_Q4_KX8 at xrow, whose blocks hold the headers
 * side by side and the values already in lanes: no transposition, and one stream of bytes */
static inline __attribute__((always_inline)) void tile_q4_K_8(int64_t nb, const char *xrow, size_t xs,
                                                              const void *const *ys, const int C, float *out,
                                                              const int packed) {
    const mg_block_q4_K *xr[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) xr[r] = (const mg_block_q4_K *)(xrow + (size_t)r * xs);
    const __m512i sc_t = _mm512_load_si512(Q4K_SC_T), m_t = _mm512_load_si512(Q4K_M_T), dm_t = _mm512_load_si512(Q4K_DM_T);
    const __m256i lo4 = _mm256_set1_epi8(0xf);
    __m256 acc[TMAX];
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) acc[c] = _mm256_setzero_ps();
    uint8_t sct[64] __attribute__((aligned(64))), mt[64] __attribute__((aligned(64)));
    for (int64_t b = 0; b < nb; b++) {
        prefetch_tile_step(xrow, 8 * xs, b, nb);
        const char *qs[8];
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) qs[r] = (const char *)xr[r][b].qs;
        const char *pb = packed ? xrow + b * Q4K_GROUP_BLOCK : NULL;
        __m512i hd[2], sm[2];
        q4_K_heads_8(xr, b, pb, hd, sm);
        _mm512_store_si512(sct, _mm512_permutex2var_epi8(sm[0], sc_t, sm[1]));
        _mm512_store_si512(mt, _mm512_permutex2var_epi8(sm[0], m_t, sm[1]));
        const __m512i dm = _mm512_permutex2var_epi16(hd[0], dm_t, hd[1]);
        /* the mins against each column's sums of 32 values, pairs of sub-blocks per vpdpwssd */
        __m256i mn[TMAX], s[TMAX], s2[TMAX];
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) {
            const mg_block_q8_K *y = (const mg_block_q8_K *)ys[c] + b;
            const __m256i bs = _mm256_loadu_si256((const __m256i *)y->bsums);
            const __m256i s8 = _mm256_castsi128_si256(
                _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1)));
            mn[c] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int t = 0; t < 4; t++)
                mn[c] = _mm256_dpwssd_epi32(mn[c], _mm256_cvtepu8_epi16(_mm_load_si128((const __m128i *)(mt + 16 * t))),
                                            _mm256_permutevar8x32_epi32(s8, _mm256_set1_epi32(t)));
            s[c] = _mm256_setzero_si256();
            s2[c] = _mm256_setzero_si256();
        }
        for (int g = 0; g < 4; g++) {   /* 64 values: sub-blocks 2g (low nibbles) and 2g+1 (high) */
            __m256i v[8];
            if (packed) {
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++) v[k] = _mm256_loadu_si256((const __m256i *)(pb + Q4K_GROUP_HEADS + 256 * g + 32 * k));
            } else {
                load_rows_transposed(qs, 32 * g, v);
            }
            const __m256i scl = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sct + 8 * (2 * g))));
            const __m256i sch = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sct + 8 * (2 * g + 1))));
#pragma GCC unroll 8
            for (int h = 0; h < 2; h++) {   /* 16 products per lane, then the scale */
                __m256i al[TMAX], ah[TMAX];
#pragma GCC unroll 8
                for (int c = 0; c < C; c++) { al[c] = _mm256_setzero_si256(); ah[c] = _mm256_setzero_si256(); }
#pragma GCC unroll 8
                for (int k = 4 * h; k < 4 * h + 4; k++) {
                    const __m256i ql = _mm256_and_si256(v[k], lo4);
                    const __m256i qh = _mm256_and_si256(_mm256_srli_epi16(v[k], 4), lo4);
#pragma GCC unroll 8
                    for (int c = 0; c < C; c++) {
                        const int8_t *q8 = ((const mg_block_q8_K *)ys[c] + b)->qs + 64 * g + 4 * k;
                        al[c] = dpbusd_bcast(al[c], ql, q8);
                        ah[c] = dpbusd_bcast(ah[c], qh, q8 + 32);
                    }
                }
#pragma GCC unroll 8
                for (int c = 0; c < C; c++) {
                    s[c] = _mm256_dpwssd_epi32(s[c], al[c], scl);
                    s2[c] = _mm256_dpwssd_epi32(s2[c], ah[c], sch);
                }
            }
        }
        const __m256 xd = _mm256_cvtph_ps(_mm512_castsi512_si128(dm)), xm = _mm256_cvtph_ps(_mm512_extracti32x4_epi32(dm, 1));
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) {
            const float dy = ((const mg_block_q8_K *)ys[c] + b)->d;
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s[c], s2[c])), _mm256_mul_ps(xd, _mm256_set1_ps(dy)), acc[c]);
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mn[c]), _mm256_mul_ps(xm, _mm256_set1_ps(-dy)), acc[c]);
        }
    }
    store_lanes(acc, C, out);
}
#endif

/* ---- q4_K: 8 weight rows in the lanes (panels on every AVX2 build; the transposing tile on
 * those without MG_KROWS) ----
 * Without vpdpbusd, dot_q4_K spends per 32 values and output a maddubs, a madd with the
 * sub-block's scale and an add. Here 8 weight rows' values are unpacked to bytes with row r in
 * lane r (4 values a lane): one maddubs against 4 converted values, broadcast, multiplies the 8
 * rows at once; eight of them (32 values of a sub-block: |sum| <= 8 * 2 * 15 * 128 < 2^15) add
 * up in int16, and one madd applies the 8 rows' scales: 9 multiplies per 8 x 32 values and
 * output where dot_q4_K spends 16, and no horizontal sums.
 * Matrix x matrix packs this form once per job and 8 rows into a panel (run_panels) that
 * every converted row reads; matrix x vector and a few columns transpose each block on the way
 * (tile_q4_K_8). Each output is lane r's chain over blocks: acc + S * (d_r * dy), then
 * + Mn * (dmin_r * -dy), each rounded once, S and Mn the block's exact integer sums: dot_q4_K's
 * chain, and the MG_KROWS tile_q4_K_8's, so an output has the same bits whichever kernel, tile,
 * batch or thread computes it. On MG_KROWS builds the panels take many columns (PANEL_MIN_N):
 * a panel's values are unpacked once per job, where tile_q4_K_8 transposes them again for
 * every group of CMAX columns. */
#if MG_Q4K_PANELS
/* the headers of one block of 8 rows, row r in lane r: the 6-bit scales of sub-blocks 0-3 (sl)
 * and 4-7 (sh) and the mins (ml, mh) as bytes, and the super-scales */
typedef struct { __m256i sl, sh, ml, mh; __m256 d, dmin; } q4_K_heads;

/* the values of the 8 rows x + r * xs (x at a block) */
static inline __attribute__((always_inline)) void q4_K_qs_8(const char *x, size_t xs, const char *qs[8]) {
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) qs[r] = (const char *)((const mg_block_q4_K *)(x + (size_t)r * xs))->qs;
}

/* the rows x + r * xs (x at the block): the 16 header bytes of rows r and r + 4 share a vector,
 * so that the dword transposition comes out in row order */
static inline __attribute__((always_inline)) q4_K_heads q4_K_heads_lanes(const char *x, size_t xs) {
    __m256i h[4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
        h[r] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(x + (size_t)r * xs))),
                                       _mm_loadu_si128((const __m128i *)(x + (size_t)(r + 4) * xs)), 1);
    const __m256i t0 = _mm256_unpacklo_epi32(h[0], h[1]), t1 = _mm256_unpackhi_epi32(h[0], h[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(h[2], h[3]), t3 = _mm256_unpackhi_epi32(h[2], h[3]);
    /* dword k of the 8 rows: d | dmin << 16, then the 12 scale bytes u0, u1, u2 */
    const __m256i dd = _mm256_unpacklo_epi64(t0, t2), u0 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i u1 = _mm256_unpacklo_epi64(t1, t3), u2 = _mm256_unpackhi_epi64(t1, t3);
    const __m256i m3f = _mm256_set1_epi8(0x3f), m0f = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    q4_K_heads o;   /* q4_K_unpack's bit fields, in every lane */
    o.sl = _mm256_and_si256(u0, m3f);
    o.ml = _mm256_and_si256(u1, m3f);
    o.sh = _mm256_or_si256(_mm256_and_si256(u2, m0f), _mm256_and_si256(_mm256_srli_epi32(u0, 2), m30));
    o.mh = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), m0f), _mm256_and_si256(_mm256_srli_epi32(u1, 2), m30));
    /* the 8 d, then the 8 dmin, as fp16 words */
    const __m256i hw = _mm256_permute4x64_epi64(
        _mm256_shuffle_epi8(dd, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                                 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15)),
        _MM_SHUFFLE(3, 1, 2, 0));
    o.d = _mm256_cvtph_ps(_mm256_castsi256_si128(hw));
    o.dmin = _mm256_cvtph_ps(_mm256_extracti128_si256(hw, 1));
    return o;
}

/* byte i of every dword into its int16 halves: lo 0x80 zeroes a half (pshufb) */
static inline __m256i dword_bytes(__m256i v, int lo, int hi) {
    const int c = lo | 0x80 << 8 | hi << 16 | 0x80 << 24;
    return _mm256_shuffle_epi8(v, _mm256_add_epi32(_mm256_setr_epi32(0, 4 * 0x10001, 8 * 0x10001, 12 * 0x10001,
                                                                     0, 4 * 0x10001, 8 * 0x10001, 12 * 0x10001),
                                                   _mm256_set1_epi32(c)));
}
/* lane r: row r's scale of sub-block j in both int16 halves (a madd applies it to a pair), or
 * in the low half only (both = 0: vpdpwssd applies it to an int32 sum below 2^15) */
static inline __m256i q4_K_scale(const q4_K_heads *h, int j, int both) {
    return dword_bytes(j < 4 ? h->sl : h->sh, j % 4, both ? j % 4 : 0x80);
}
/* lane r: row r's mins of sub-blocks 2t and 2t + 1, an int16 pair */
static inline __m256i q4_K_min_pair(const q4_K_heads *h, int t) {
    return dword_bytes(t < 2 ? h->ml : h->mh, 2 * (t % 2), 2 * (t % 2) + 1);
}

/* the 4 bytes at p in every lane (vbroadcastss: a load, no shuffle) */
static inline __m256i bcast4(const void *p) {
    return _mm256_castps_si256(_mm256_broadcast_ss((const float *)p));
}

/* acc[c] + the block's two sums for the 8 rows against column c (y[c]): S (s[c]) with the
 * scales d, then the mins Mn against the column's sums of 32 values, two sub-blocks a madd */
static inline __attribute__((always_inline)) void q4_K_block_fma(const __m256i *s, const __m256i mn[4], __m256 d, __m256 dmin,
                                                                 const mg_block_q8_K *const *y, const int C, __m256 *acc) {
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) {
#if MG_Q4K_PAIR_SUMS
#define PAIR_SUMS(t) bcast4(y[c]->bsums + 2 * (t))
#else   /* q8_K's sums of 16 values, added in pairs here: the sums of sub-blocks 2t and 2t + 1 */
        const __m256i s8 = _mm256_castsi128_si256(_mm_hadd_epi16(_mm_loadu_si128((const __m128i *)y[c]->bsums),
                                                                 _mm_loadu_si128((const __m128i *)y[c]->bsums + 1)));
#define PAIR_SUMS(t) _mm256_permutevar8x32_epi32(s8, _mm256_set1_epi32(t))
#endif
        __m256i m = _mm256_madd_epi16(mn[0], PAIR_SUMS(0));
#pragma GCC unroll 4
        for (int t = 1; t < 4; t++) m = _mm256_add_epi32(m, _mm256_madd_epi16(mn[t], PAIR_SUMS(t)));
#undef PAIR_SUMS
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[c]), _mm256_mul_ps(d, _mm256_set1_ps(y[c]->d)), acc[c]);
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_mul_ps(dmin, _mm256_set1_ps(-y[c]->d)), acc[c]);
    }
}

/* one block of 8 rows, packed: values, scales and mins in lanes */
typedef struct {
    __m256i w[8][8];   /* [sub-block j][k]: lane r = row r's values 32j + 4k .. 32j + 4k + 3 (0..15) */
    __m256i sc[8];     /* q4_K_scale */
    __m256i mn[4];     /* q4_K_min_pair */
    __m256 d, dmin;
} q4_K_panel;

/* blocks [0, nb) of the 8 rows xrow + r * xs into p[0..nb); packed: the rows are a group of
 * MG_Q4_KX8 at xrow (headers side by side, values already in lanes) */
static inline __attribute__((always_inline)) void q4_K_panel_pack_any(const char *xrow, size_t xs, int64_t nb,
                                                                      void *pan, const int packed) {
    q4_K_panel *p = pan;
    const __m256i lo4 = _mm256_set1_epi8(0xf);
    for (int64_t b = 0; b < nb; b++, p++) {
        const char *x = packed ? xrow + b * Q4K_GROUP_BLOCK : xrow + b * (int64_t)sizeof(mg_block_q4_K);
        const char *qs[8];
        q4_K_qs_8(x, xs, qs);
        for (int g = 0; g < 4; g++) {   /* 32 bytes of nibbles: sub-blocks 2g (low) and 2g + 1 (high) */
            __m256i v[8];
            if (packed) {
                for (int k = 0; k < 8; k++) v[k] = _mm256_loadu_si256((const __m256i *)(x + Q4K_GROUP_HEADS + 256 * g + 32 * k));
            } else {
                load_rows_transposed(qs, 32 * g, v);
            }
            for (int k = 0; k < 8; k++) {
                _mm256_store_si256(&p->w[2 * g][k], _mm256_and_si256(v[k], lo4));
                _mm256_store_si256(&p->w[2 * g + 1][k], _mm256_and_si256(_mm256_srli_epi16(v[k], 4), lo4));
            }
        }
        const q4_K_heads h = q4_K_heads_lanes(x, packed ? 16 : xs);   /* packed: the headers 16 bytes apart */
#ifdef MG_KROWS   /* q4_K_panel_block's vpdpwssd takes the low half */
        for (int j = 0; j < 8; j++) p->sc[j] = q4_K_scale(&h, j, 0);
#else
        for (int j = 0; j < 8; j++) p->sc[j] = q4_K_scale(&h, j, 1);
#endif
        for (int t = 0; t < 4; t++) p->mn[t] = q4_K_min_pair(&h, t);
        p->d = h.d;
        p->dmin = h.dmin;
    }
}
static void q4_K_panel_pack(const char *xrow, size_t xs, int64_t nb, void *pan) {
    q4_K_panel_pack_any(xrow, xs, nb, pan, 0);
}
#ifdef MG_KROWS
static void q4_Kx8_panel_pack(const char *xrow, size_t xs, int64_t nb, void *pan) {
    q4_K_panel_pack_any(xrow, xs, nb, pan, 1);
}
#endif

/* acc[c] + one packed block of 8 rows against the blocks y[c] (MG_Q8_KP) */
static inline __attribute__((always_inline)) void q4_K_panel_block(const q4_K_panel *p, const mg_block_q8_K *const *y,
                                                                   const int C, __m256 *acc) {
    __m256i s[TMAX];
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) s[c] = _mm256_setzero_si256();
    /* a sub-block per pass, not unrolled: the whole block's code overflows the op cache
     * (19.4 against 13.6-14.1 ms, K768 M2048 by 512, 1 thread, Zen 3) */
#ifdef MG_KROWS
    /* vpdpbusd: 4 values of the 8 rows a step into int32 sums, 16 products a lane (|sum| < 2^15)
     * before one vpdpwssd applies the scale (p->sc: the low half), as tile_q4_K_8 does */
#pragma GCC unroll 1
    for (int j = 0; j < 8; j++) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m256i a[TMAX];
            dots4_panel(&p->w[j][4 * h], y, 32 * j + 16 * h, C, a);
#pragma GCC unroll 8
            for (int c = 0; c < C; c++) s[c] = _mm256_dpwssd_epi32(s[c], a[c], p->sc[j]);
        }
    }
#else
#pragma GCC unroll 1
    for (int j = 0; j < 8; j++) {
        __m256i a[TMAX];
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            const __m256i w = _mm256_load_si256(&p->w[j][k]);
#pragma GCC unroll 8
            for (int c = 0; c < C; c++) {
                const __m256i t = _mm256_maddubs_epi16(w, bcast4(y[c]->qs + 32 * j + 4 * k));
                a[c] = k ? _mm256_add_epi16(a[c], t) : t;
                PIN(a[c]);
            }
        }
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) s[c] = _mm256_add_epi32(s[c], _mm256_madd_epi16(a[c], p->sc[j]));
    }
#endif
    q4_K_block_fma(s, p->mn, p->d, p->dmin, y, C, acc);
}

#endif

#if MG_PANELS
/* weight rows xrow + r * xs (r < 8) against C converted rows, each block transposed in
 * registers on the way: out[r * C + c] */
static inline __attribute__((always_inline)) void tile_q4_K_8(int64_t nb, const char *xrow, size_t xs,
                                                              const void *const *ys, const int C, float *out) {
    const __m256i lo4 = _mm256_set1_epi8(0xf);
    __m256 acc[TMAX];
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch_tile_step(xrow, 8 * xs, b, nb);
        const char *x = xrow + b * (int64_t)sizeof(mg_block_q4_K);
        const mg_block_q8_K *y[TMAX];
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) y[c] = (const mg_block_q8_K *)ys[c] + b;
        const q4_K_heads h = q4_K_heads_lanes(x, xs);
        const char *qs[8];
        q4_K_qs_8(x, xs, qs);
        __m256i s[TMAX];
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) s[c] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int g = 0; g < 4; g++) {   /* sub-blocks 2g (low nibbles) and 2g + 1 (high) */
            __m256i v[8];
            load_rows_transposed(qs, 32 * g, v);
            __m256i al[TMAX], ah[TMAX];
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                const __m256i ql = _mm256_and_si256(v[k], lo4), qh = _mm256_and_si256(_mm256_srli_epi16(v[k], 4), lo4);
#pragma GCC unroll 8
                for (int c = 0; c < C; c++) {
                    const __m256i tl = _mm256_maddubs_epi16(ql, bcast4(y[c]->qs + 64 * g + 4 * k));
                    const __m256i th = _mm256_maddubs_epi16(qh, bcast4(y[c]->qs + 64 * g + 32 + 4 * k));
                    al[c] = k ? _mm256_add_epi16(al[c], tl) : tl;
                    ah[c] = k ? _mm256_add_epi16(ah[c], th) : th;
                    PIN(al[c]);
                    PIN(ah[c]);
                }
            }
            const __m256i scl = q4_K_scale(&h, 2 * g, 1), sch = q4_K_scale(&h, 2 * g + 1, 1);
#pragma GCC unroll 8
            for (int c = 0; c < C; c++)
                s[c] = _mm256_add_epi32(s[c], _mm256_add_epi32(_mm256_madd_epi16(al[c], scl), _mm256_madd_epi16(ah[c], sch)));
        }
        __m256i mn[4];
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) mn[t] = q4_K_min_pair(&h, t);
        q4_K_block_fma(s, mn, h.d, h.dmin, y, C, acc);
    }
    store_lanes(acc, C, out);
}

/* ---- q8_0: 8 weight rows in the lanes (AVX2 builds without MG_KROWS) ----
 * Per block and output, ggml's lanes spend two integer multiplies and then a conversion and an
 * fma. Here lane r holds row r's values, 4 a lane: |w| against 4 converted values broadcast and
 * given w's signs (maddubs: pairs below 2 * 127 * 127, no saturation), then pairs of pairs (madd)
 * into the 8 rows' int32 sums: the same two multiplies per 8 x 4 values, but one conversion and
 * one fma per block serve 8 outputs. Matrix x matrix packs the transposed values once per job
 * and 8 rows (the panels below); matrix x vector and a few columns transpose on the way
 * (tile_q8_0_8). Each output is acc + S * (dx_r * dy) per block, rounded once, S the block's
 * exact sum: dot_q8_0's chain on these builds. */
typedef struct {
    __m256i aw[8];   /* [k]: lane r = |row r's values 4k .. 4k + 3| */
    __m256i sw[8];   /* [k]: the same values with their signs */
    __m256 d;        /* [r] */
} q8_0_panel;

/* block of the 8 rows x + r * xs (x at the block): v[k] lane r = row r's values 4k .. 4k + 3;
 * returns the rows' d */
static inline __attribute__((always_inline)) __m256 q8_0_rows_8(const char *x, size_t xs, __m256i v[8]) {
    __m128i dh = _mm_setzero_si128();
    const char *qs[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) {
        const mg_block_q8_0 *xr = (const mg_block_q8_0 *)(x + (size_t)r * xs);
        qs[r] = (const char *)xr->qs;
        dh = _mm_insert_epi16(dh, xr->d, r);
    }
    load_rows_transposed(qs, 0, v);
    return _mm256_cvtph_ps(dh);
}

/* acc[c] + one block of 8 rows (aw, sw, d) against the blocks y[c] */
static inline __attribute__((always_inline)) void q8_0_block_8(const __m256i *aw, const __m256i *sw, __m256 d,
                                                               const mg_block_q8_0 *const *y, const int C, __m256 *acc) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s[TMAX];
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        const __m256i a = aw[k], w = sw[k];
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) {
            const __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(bcast4(y[c]->qs + 4 * k), w)), ones);
            s[c] = k ? _mm256_add_epi32(s[c], t) : t;
            PIN(s[c]);
        }
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; c++)
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[c]), _mm256_mul_ps(d, _mm256_set1_ps(mg_fp16_to_fp32(y[c]->d))), acc[c]);
}

/* blocks [0, nb) of the 8 rows xrow + r * xs into p[0..nb) */
static void q8_0_panel_pack(const char *xrow, size_t xs, int64_t nb, void *pan) {
    q8_0_panel *p = pan;
    for (int64_t b = 0; b < nb; b++, p++) {
        __m256i v[8];
        p->d = q8_0_rows_8(xrow + b * (int64_t)sizeof(mg_block_q8_0), xs, v);
        for (int k = 0; k < 8; k++) {
            p->sw[k] = v[k];
            p->aw[k] = _mm256_sign_epi8(v[k], v[k]);
        }
    }
}

/* acc[c] + one packed block of 8 rows against the blocks y[c] */
static inline __attribute__((always_inline)) void q8_0_panel_block(const q8_0_panel *p, const mg_block_q8_0 *const *y,
                                                                   const int C, __m256 *acc) {
    q8_0_block_8(p->aw, p->sw, p->d, y, C, acc);
}

/* weight rows xrow + r * xs (r < 8) against C converted rows, each block transposed on the way */
static inline __attribute__((always_inline)) void tile_q8_0_8(int64_t nb, const char *xrow, size_t xs,
                                                              const void *const *ys, const int C, float *out) {
    __m256 acc[TMAX];
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch_tile_step(xrow, 8 * xs, b, nb);
        __m256i v[8], aw[8];
        const __m256 d = q8_0_rows_8(xrow + b * (int64_t)sizeof(mg_block_q8_0), xs, v);
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) aw[k] = _mm256_sign_epi8(v[k], v[k]);
        const mg_block_q8_0 *y[TMAX];
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) y[c] = (const mg_block_q8_0 *)ys[c] + b;
        q8_0_block_8(aw, v, d, y, C, acc);
    }
    store_lanes(acc, C, out);
}
#endif

#if MG_Q4K_PANELS
/* ---- panels: 8 weight rows packed once per job, read by every converted row ---- */
/* columns per panel tile (16 vector registers: q4_K's C int16 sums, C int32 sums, the values) */
#define PANEL_C 4
/* from this many converted rows on, matrix x matrix takes the panels (below that, tile_q4_K_8
 * and tile_q8_0_8, which pack nothing). On MG_KROWS builds the tile's vpdpbusd is as cheap as
 * the panel's, and the packing pays back from 8 columns (K2048 M2048, 1 thread, Zen 4, tiles
 * against panels: by 4 0.17 / 0.23 ms; by 8 0.36 / 0.34; by 12 0.50 / 0.48; by 512 22.7 / 18.1) */
#ifdef MG_KROWS
#define PANEL_MIN_N 8
#else
#define PANEL_MIN_N 4
#endif

/* a type's panel tiles: a packed panel's 8 rows against C converted rows, one block at a time
 * (T##_panel_block), out[r * C + c]; and by C = 1..PANEL_C columns, C a constant in each */
#define PANEL_TILES(T, Y)                                                                          \
    static inline __attribute__((always_inline)) void T##_panel_tile(int64_t nb, const T##_panel *p, \
                                                                     const void *const *ys, const int C, float *out) { \
        __m256 acc[TMAX];                                                                          \
        for (int c = 0; c < C; c++) acc[c] = _mm256_setzero_ps();                                  \
        for (int64_t b = 0; b < nb; b++, p++) {                                                    \
            const Y *y[TMAX];                                                                      \
            for (int c = 0; c < C; c++) y[c] = (const Y *)ys[c] + b;                               \
            T##_panel_block(p, y, C, acc);                                                         \
        }                                                                                          \
        store_lanes(acc, C, out);                                                                  \
    }                                                                                              \
    static void T##_panel_cols(int64_t nb, const void *p, const void *const *ys, int C, float *o) { \
        switch (C) {                                                                               \
            case 1: T##_panel_tile(nb, p, ys, 1, o); break;                                        \
            case 2: T##_panel_tile(nb, p, ys, 2, o); break;                                        \
            case 3: T##_panel_tile(nb, p, ys, 3, o); break;                                        \
            case 4: T##_panel_tile(nb, p, ys, 4, o); break;                                        \
            default: break;                                                                        \
        }                                                                                          \
    }
PANEL_TILES(q4_K, mg_block_q8_K)
#if MG_PANELS
PANEL_TILES(q8_0, mg_block_q8_0)
#endif

/* a weight type's panels: values per block, bytes of one packed block of 8 rows, the packing
 * and the tiles (by 1..PANEL_C columns) */
typedef struct {
    int64_t block_values;
    int64_t min_n;   /* from this many converted rows on (PANEL_MIN_N, or the type's own) */
    size_t panel_bytes;
    void (*pack)(const char *xrow, size_t xs, int64_t nb, void *pan);
    void (*cols)(int64_t nb, const void *pan, const void *const *ys, int C, float *o);
} panel_kind;
static const panel_kind q4_K_panels = {MG_QK_K, PANEL_MIN_N, sizeof(q4_K_panel), q4_K_panel_pack, q4_K_panel_cols};
#ifdef MG_KROWS
static const panel_kind q4_Kx8_panels = {MG_QK_K, PANEL_MIN_N, sizeof(q4_K_panel), q4_Kx8_panel_pack, q4_K_panel_cols};
#endif
#if MG_PANELS
static const panel_kind q8_0_panels = {MG_QK8_0, PANEL_MIN_N, sizeof(q8_0_panel), q8_0_panel_pack, q8_0_panel_cols};
#endif
/* the types with panels on this build, and theirs */
#ifdef MG_KROWS
static const panel_kind q6_K_panels, q6_Kx8_panels;   /* defined with the q6_K kernels below */
#endif
static const panel_kind *panels_of(int t) {
    if (t == MG_Q4_K) return &q4_K_panels;
#ifdef MG_KROWS
    if (t == MG_Q4_KX8) return &q4_Kx8_panels;
    if (t == MG_Q6_K) return &q6_K_panels;
    if (t == MG_Q6_KX8) return &q6_Kx8_panels;
#endif
#if MG_PANELS
    if (t == MG_Q8_0) return &q8_0_panels;
#endif
    return NULL;
}

/* weight rows [m0, m0 + 8 * whole panels) of one plane against all N converted rows; returns
 * the first row not done (the caller's one-row kernels take the rest) */
static int64_t run_panels(const panel_kind *pk, const mg_tensor *a, const mg_tensor *b, const mg_tensor *d,
                          const char *ap, int64_t m0, int64_t m1, int64_t i2, int64_t i3, void *pan) {
    const int64_t nb = a->ne[0] / pk->block_values, N = b->ne[1];
    const size_t xs = (size_t)a->nb[1];
    int64_t i = m0;
    for (; i + 8 <= m1; i += 8) {
        pk->pack(ap + i * xs, xs, nb, pan);
        for (int64_t j = 0; j < N; j += PANEL_C) {
            const int C = (int)mg_min64(PANEL_C, N - j);
            const void *ys[TMAX];
            float o[8 * TMAX];
            for (int c = 0; c < C; c++) ys[c] = mg_ptr(b, 0, j + c, i2, i3);
            pk->cols(nb, pan, ys, C, o);
            for (int r = 0; r < 8; r++)
                for (int c = 0; c < C; c++) mg_store_f32(mg_ptr(d, i + r, j + c, i2, i3), o[r * C + c]);
        }
    }
    return i;
}
#endif

/* ---- q6_K weights x q8_K rows (ggml's lanes; MG_KROWS builds take dot_q6_K_512 instead) ---- */
static inline __attribute__((always_inline)) void dot_q6_K(int64_t nb, const char *xrow, const void *const *ys,
                                                           const int C, float *out) {
    const mg_block_q6_K *x = (const mg_block_q6_K *)xrow;
#if MG_QAVX2
    __m256 acc[TMAX];
    const __m256i m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
    for (int c = 0; c < C; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        PREFETCH(x + b); PREFETCH((const char *)(x + b) + 64); PREFETCH((const char *)(x + b) + 128);
        const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x[b].scales));
        __m256i sumi[TMAX];
        for (int c = 0; c < C; c++) {
            /* the values are stored +32: subtract 32 * sum(scale * bsum) */
            const __m256i bs = _mm256_loadu_si256((const __m256i *)((const mg_block_q8_K *)ys[c] + b)->bsums);
            sumi[c] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(bs, s16), 5));
        }
        for (int h = 0; h < 2; h++) {   /* halves of 128 values */
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(x[b].ql + 64 * h));
            const __m256i l2 = _mm256_loadu_si256((const __m256i *)(x[b].ql + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(x[b].qh + 32 * h));
            /* value k*32 + l: nibble of ql (low: k = 0, 1; high: k = 2, 3) and bits 2k..2k+1 of qh */
            __m256i q[4], s[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l1, m15), _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(l2, m15), _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(12)), 2));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m15), _mm256_and_si256(hb, _mm256_set1_epi8(48)));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l2, 4), m15),
                                   _mm256_srli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(-64)), 2));
            /* 32 values use 2 scales: int16 lanes 0..7 scale 8h + 2k, 8..15 scale 8h + 2k + 1, shuffled
             * out of the half's 8 scales in both 128-bit lanes (scalar broadcasts measured 1.3x slower) */
            const __m256i sch = h ? _mm256_permute2x128_si256(s16, s16, 0x11) : _mm256_permute2x128_si256(s16, s16, 0x00);
            for (int k = 0; k < 4; k++)
                s[k] = _mm256_shuffle_epi8(sch, _mm256_set_m128i(_mm_set1_epi16((short)(0x0100 + 0x0202 * (2 * k + 1))),
                                                                 _mm_set1_epi16((short)(0x0100 + 0x0202 * (2 * k)))));
            for (int c = 0; c < C; c++) {
                const int8_t *q8 = ((const mg_block_q8_K *)ys[c] + b)->qs + 128 * h;
                __m256i t = _mm256_setzero_si256();
                for (int k = 0; k < 4; k++) {
                    t = _mm256_add_epi32(t, _mm256_madd_epi16(s[k], _mm256_maddubs_epi16(q[k], _mm256_loadu_si256((const __m256i *)(q8 + 32 * k)))));
                    PIN(t);
                }
                sumi[c] = _mm256_add_epi32(sumi[c], t);
                PIN(sumi[c]);
            }
        }
        const float xd = mg_fp16_to_fp32(x[b].d);
        for (int c = 0; c < C; c++) {
            const float dy = ((const mg_block_q8_K *)ys[c] + b)->d;
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(dy * xd), _mm256_cvtepi32_ps(sumi[c]), acc[c]);
        }
    }
    for (int c = 0; c < C; c++) out[c] = hsum8(acc[c]);
#else
    for (int c = 0; c < C; c++) {
        const mg_block_q8_K *y = ys[c];
        float s = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            int isum = 0;
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = x[b].ql + 64 * h, *qh = x[b].qh + 32 * h;
                const int8_t *sc = x[b].scales + 8 * h, *q8 = y[b].qs + 128 * h;
                for (int l = 0; l < 32; l++) {
                    const int is = l / 16;
                    const int q1 = ((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    const int q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    isum += sc[is] * q1 * q8[l] + sc[is + 2] * q2 * q8[l + 32] + sc[is + 4] * q3 * q8[l + 64] +
                            sc[is + 6] * q4 * q8[l + 96];
                }
            }
            s += (y[b].d * mg_fp16_to_fp32(x[b].d)) * (float)isum;
        }
        out[c] = s;
    }
#endif
}

#ifdef MG_KROWS
/* ---- q6_K: one weight row in 512-bit lanes (AVX-512 VNNI + VBMI builds) ----
 * dot_q6_K's sums with half the instructions: a register holds two of its 32-value groups
 * (ql's low or high nibbles of 64 bytes, with the two groups' qh bits moved into place by one
 * per-half variable shift), so a half-block (128 values) is two maddubs and two vpdpwssd whose
 * int16 scales are permuted per 16 values. The block's integer sum is exact, and it goes into
 * tile_q6_K_8's chain (one fma per block): the same bits as the 8-row tiles. */
/* scale index per int16 lane of register 0: lanes 8i..8i+7 take scale i; register g = 2h + p
 * takes 4g more (scales 8h + 4p + i) */
static const uint16_t Q6K_SC_W0[32] __attribute__((aligned(64))) = {
    0,0,0,0,0,0,0,0,1,1,1,1,1,1,1,1,2,2,2,2,2,2,2,2,3,3,3,3,3,3,3,3};

static inline __attribute__((always_inline)) void dot_q6_K_512(int64_t nb, const char *xrow, const void *const *ys,
                                                               const int C, float *out) {
    const mg_block_q6_K *x = (const mg_block_q6_K *)xrow;
    const __m512i m0f = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    /* qh bits 2q..2q+1 to bits 4..5: groups 0 | 1 shift left by 4 | 2, groups 2 | 3 right by 0 | 2 */
    const __m512i shl01 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i shr23 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i iw0 = _mm512_load_si512(Q6K_SC_W0), iw1 = _mm512_add_epi16(iw0, _mm512_set1_epi16(4));
    const __m512i iw2 = _mm512_add_epi16(iw0, _mm512_set1_epi16(8)), iw3 = _mm512_add_epi16(iw0, _mm512_set1_epi16(12));
    __m128 chain[TMAX];
    for (int c = 0; c < C; c++) chain[c] = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const mg_block_q6_K *xb = x + b;
        const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)xb->scales));
        const __m512i sz = _mm512_castsi256_si512(s16);
        const __m512i sw[4] = {_mm512_permutexvar_epi16(iw0, sz), _mm512_permutexvar_epi16(iw1, sz),
                               _mm512_permutexvar_epi16(iw2, sz), _mm512_permutexvar_epi16(iw3, sz)};
        __m512i q[4];   /* q[2h + p]: values 128h + 64p .. +63, unsigned (stored +32) */
        for (int h = 0; h < 2; h++) {
            const __m512i l = _mm512_loadu_si512((const void *)(xb->ql + 64 * h));
            const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(xb->qh + 32 * h)));
            const __m512i h01 = _mm512_and_si512(_mm512_sllv_epi16(hb, shl01), m30);
            const __m512i h23 = _mm512_and_si512(_mm512_srlv_epi16(hb, shr23), m30);
            q[2 * h] = _mm512_ternarylogic_epi32(l, h01, m0f, 0xEC);   /* (l & 0x0f) | h01 */
            q[2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(l, 4), h23, m0f, 0xEC);
        }
        const float xd = mg_fp16_to_fp32(xb->d);
        for (int c = 0; c < C; c++) {
            const mg_block_q8_K *y = (const mg_block_q8_K *)ys[c] + b;
            /* the values are stored +32: start from -32 * sum(scale * bsum) */
            const __m256i bs = _mm256_loadu_si256((const __m256i *)y->bsums);
            __m512i a0 = _mm512_zextsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(bs, s16), 5)));
            __m512i a1 = _mm512_setzero_si512();
            a0 = _mm512_dpwssd_epi32(a0, _mm512_maddubs_epi16(q[0], _mm512_loadu_si512((const void *)y->qs)), sw[0]);
            a1 = _mm512_dpwssd_epi32(a1, _mm512_maddubs_epi16(q[1], _mm512_loadu_si512((const void *)(y->qs + 64))), sw[1]);
            a0 = _mm512_dpwssd_epi32(a0, _mm512_maddubs_epi16(q[2], _mm512_loadu_si512((const void *)(y->qs + 128))), sw[2]);
            a1 = _mm512_dpwssd_epi32(a1, _mm512_maddubs_epi16(q[3], _mm512_loadu_si512((const void *)(y->qs + 192))), sw[3]);
            const __m512i a = _mm512_add_epi32(a0, a1);
            const __m256i a8 = _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
            chain[c] = chain_fma(chain[c], hsum8_epi32(a8), xd * y->d);
        }
    }
    for (int c = 0; c < C; c++) out[c] = _mm_cvtss_f32(chain[c]);
}
#endif

#ifdef MG_KROWS
/* ---- q6_K: 8 weight rows at once (AVX-512 VNNI + VBMI builds) ----
 * The same lanes as tile_q4_K_8 (lane r = row r): the 6-bit values, stored +32 and unsigned,
 * go to vpdpbusd four at a time for 8 rows; a sub-block's 16 products per lane fit an int32
 * (not an int16), so its scale is applied with one vpmulld per 8 rows, and 32 * sum(scale *
 * bsum) is taken off per block as ggml does. Exact integer sums per block, then one fma per
 * block in lane r: batch invariant; ggml's bits no longer (f32 rounding apart). */
/* byte permutations of 8 rows x 16 scales (row-major, 128 bytes in two registers): sub-block-major
 * rows of 8 bytes (sub-blocks 0..7, then 8..15), and per pair t of sub-blocks, 8 rows x 2 bytes */
static const uint8_t Q6K_SC_T[2][64] __attribute__((aligned(64))) = {
    {0,16,32,48,64,80,96,112,1,17,33,49,65,81,97,113,2,18,34,50,66,82,98,114,3,19,35,51,67,83,99,115,
     4,20,36,52,68,84,100,116,5,21,37,53,69,85,101,117,6,22,38,54,70,86,102,118,7,23,39,55,71,87,103,119},
    {8,24,40,56,72,88,104,120,9,25,41,57,73,89,105,121,10,26,42,58,74,90,106,122,11,27,43,59,75,91,107,123,
     12,28,44,60,76,92,108,124,13,29,45,61,77,93,109,125,14,30,46,62,78,94,110,126,15,31,47,63,79,95,111,127}};
static const uint8_t Q6K_PAIR_T[2][64] __attribute__((aligned(64))) = {
    {0,1,16,17,32,33,48,49,64,65,80,81,96,97,112,113,2,3,18,19,34,35,50,51,66,67,82,83,98,99,114,115,
     4,5,20,21,36,37,52,53,68,69,84,85,100,101,116,117,6,7,22,23,38,39,54,55,70,71,86,87,102,103,118,119},
    {8,9,24,25,40,41,56,57,72,73,88,89,104,105,120,121,10,11,26,27,42,43,58,59,74,75,90,91,106,107,122,123,
     12,13,28,29,44,45,60,61,76,77,92,93,108,109,124,125,14,15,30,31,46,47,62,63,78,79,94,95,110,111,126,127}};

/* the 8 rows' v[r] = 32 bytes at p[r] + off, transposed and stored to t (t[k]: dword k of the
 * 8 rows), where the kernel keeps them in memory */
static inline __attribute__((always_inline)) void load_rows_t(const char *const p[8], size_t off, __m256i t[8]) {
    __m256i v[8];
    load_rows_transposed(p, off, v);
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) _mm256_store_si256(t + k, v[k]);
}

/* the q6_K values 32q + l (l < 32 bytes at a time) of a half-block, unsigned (0..63): a nibble of
 * ql (l0: ql[l], l1: ql[l + 32]; low nibbles for q < 2), bits 2q..2q+1 of qh[l] above it. Bytes in
 * any arrangement, as long as l0, l1 and qh line up (the tiles: 8 rows transposed; the panels'
 * packing: one row in order) */
static inline __attribute__((always_inline)) __m256i q6_K_value_bytes(__m256i l0, __m256i l1, __m256i qh, int q) {
    const __m256i m15 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    const __m256i l = (q & 1) ? l1 : l0;
    const __m256i lo = q < 2 ? _mm256_and_si256(l, m15) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m15);
    const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * q), m3), 4);
    return _mm256_or_si256(lo, hi);
}

/* a block's start for 8 rows against a converted block's sums of 16 values (bsums): the values are
 * stored +32, so -32 * sum(scale * bsum); sp[t], lane r: row r's scales of sub-blocks 2t and
 * 2t + 1, an int16 pair */
static inline __attribute__((always_inline)) __m256i q6_K_offset_sums(const __m256i sp[8], const int16_t *bsums) {
    __m256i m = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int t = 0; t < 8; t++) {
        int32_t pair;
        memcpy(&pair, bsums + 2 * t, 4);
        m = _mm256_dpwssd_epi32(m, sp[t], _mm256_set1_epi32(pair));
    }
    return _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(m, 5));
}

/* MG_Q6_KX8: q6_K rows packed in groups of 8 (mg_pack_rows, at load), as MG_Q4_KX8 (above) for
 * q4_K. A group of nb blocks holds first, for each block b, Q6K_GROUP_VALUES bytes at
 * b * Q6K_GROUP_VALUES: per half h the vectors tile_q6_K_8 transposes, ql from 64h (8 x 32
 * bytes, lane r = row r) at 512 h, ql from 64h + 32 at 512 h + 256, qh from 32h at 1024 + 256 h;
 * then each block's 8 x 16 scales (row after row) at Q6K_GROUP_SC(nb, b), then each block's 8 d
 * at Q6K_GROUP_D(nb, b). The values come first so that their vectors stay on 32-byte boundaries
 * (a block's 8 rows are 1680 bytes, not a multiple of 32). The rows after the last whole group
 * keep q6_K's layout. */
#define Q6K_GROUP_VALUES (8 * 192)
#define Q6K_GROUP_SC(nb, b) ((nb) * Q6K_GROUP_VALUES + 128 * (b))
#define Q6K_GROUP_D(nb, b) ((nb) * (Q6K_GROUP_VALUES + 128) + 16 * (b))

/* weight rows xrow + r * xs (r < 8) against C converted rows: out[r * C + c]; packed (a constant
 * in each expansion): the 8 rows are a group of MG_Q6_KX8 at xrow */
static inline __attribute__((always_inline)) void tile_q6_K_8(int64_t nb, const char *xrow, size_t xs,
                                                              const void *const *ys, const int C, float *out,
                                                              const int packed) {
    const mg_block_q6_K *xr[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) xr[r] = (const mg_block_q6_K *)(xrow + (size_t)r * xs);
    const __m512i sc_a = _mm512_load_si512(Q6K_SC_T[0]), sc_b = _mm512_load_si512(Q6K_SC_T[1]);
    const __m512i pr_a = _mm512_load_si512(Q6K_PAIR_T[0]), pr_b = _mm512_load_si512(Q6K_PAIR_T[1]);
    __m256 acc[TMAX];
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) acc[c] = _mm256_setzero_ps();
    int8_t sct[128] __attribute__((aligned(64))), spt[128] __attribute__((aligned(64)));
    __m256i tl1[8], tl2[8], th[8];
    for (int64_t b = 0; b < nb; b++) {
        prefetch_tile_step(xrow, 8 * xs, b, nb);
        const char *ql[8], *qh[8];
        const char *pb = xrow + b * Q6K_GROUP_VALUES;   /* packed: the group's block b's values */
        const __m128i dh = packed ? _mm_loadu_si128((const __m128i *)(xrow + Q6K_GROUP_D(nb, b)))
                                  : load_halves_8((const char *)&xr[0][b].d, xs);
        __m512i sv[2];   /* the 8 rows' 16 scales: rows 0-3, 4-7 (loaded into lanes, not through memory) */
        if (packed) {
            sv[0] = _mm512_loadu_si512((const void *)(xrow + Q6K_GROUP_SC(nb, b)));
            sv[1] = _mm512_loadu_si512((const void *)(xrow + Q6K_GROUP_SC(nb, b) + 64));
        } else {
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) {
                const mg_block_q6_K *x = xr[r] + b;
                const __m128i sr = _mm_loadu_si128((const __m128i *)x->scales);
                sv[r / 4] = r % 4 == 0 ? _mm512_castsi128_si512(sr) : _mm512_inserti32x4(sv[r / 4], sr, r % 4);
                ql[r] = (const char *)x->ql; qh[r] = (const char *)x->qh;
            }
        }
        const __m512i s0 = sv[0], s1 = sv[1];
        _mm512_store_si512(sct, _mm512_permutex2var_epi8(s0, sc_a, s1));
        _mm512_store_si512(sct + 64, _mm512_permutex2var_epi8(s0, sc_b, s1));
        _mm512_store_si512(spt, _mm512_permutex2var_epi8(s0, pr_a, s1));
        _mm512_store_si512(spt + 64, _mm512_permutex2var_epi8(s0, pr_b, s1));
        __m256i sp[8], s[TMAX];
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) sp[t] = _mm256_cvtepi8_epi16(_mm_load_si128((const __m128i *)(spt + 16 * t)));
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) s[c] = q6_K_offset_sums(sp, ((const mg_block_q8_K *)ys[c] + b)->bsums);
        for (int h = 0; h < 2; h++) {   /* 128 values: ql[64h..64h+63], qh[32h..32h+31] */
            const __m256i *t1 = tl1, *t2 = tl2, *t3 = th;
            if (packed) {
                t1 = (const __m256i *)(pb + 512 * h);
                t2 = (const __m256i *)(pb + 512 * h + 256);
                t3 = (const __m256i *)(pb + 1024 + 256 * h);
            } else {
                load_rows_t(ql, 64 * h, tl1);
                load_rows_t(ql, 64 * h + 32, tl2);
                load_rows_t(qh, 32 * h, th);
            }
            /* the 24 transposed registers live in memory (L1): kept in registers they would
             * crowd out the accumulators and spill anyway */
            __asm__ volatile("" ::: "memory");
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) {   /* values 32q + l: a nibble of ql, bits 2q..2q+1 of qh */
#pragma GCC unroll 2
                for (int u = 0; u < 2; u++) {   /* sub-block 8h + 2q + u: l = 16u .. 16u + 15 */
                    __m256i a[TMAX];
#pragma GCC unroll 8
                    for (int c = 0; c < C; c++) a[c] = _mm256_setzero_si256();
#pragma GCC unroll 4
                    for (int k = 4 * u; k < 4 * u + 4; k++) {
                        const __m256i w = q6_K_value_bytes(_mm256_loadu_si256(t1 + k), _mm256_loadu_si256(t2 + k),
                                                           _mm256_loadu_si256(t3 + k), q);
#pragma GCC unroll 8
                        for (int c = 0; c < C; c++) {
                            a[c] = dpbusd_bcast(a[c], w, ((const mg_block_q8_K *)ys[c] + b)->qs + 128 * h + 32 * q + 4 * k);
                        }
                    }
                    const __m256i scv = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sct + 8 * (8 * h + 2 * q + u))));
#pragma GCC unroll 8
                    for (int c = 0; c < C; c++) s[c] = _mm256_add_epi32(s[c], _mm256_mullo_epi32(a[c], scv));
                }
            }
        }
        const __m256 xd = _mm256_cvtph_ps(dh);
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) {
            const float dy = ((const mg_block_q8_K *)ys[c] + b)->d;
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[c]), _mm256_mul_ps(xd, _mm256_set1_ps(dy)), acc[c]);
        }
    }
    store_lanes(acc, C, out);
}
#endif

#ifdef MG_KROWS
/* ---- q6_K panels (MG_KROWS builds): tile_q6_K_8's lanes and sums, the 8 rows' values
 * unpacked and transposed once per job instead of once per CMAX columns (run_panels). The
 * block's integer sum is the same exact int32 and goes into the same one fma per block, so an
 * output has the tile's and dot_q6_K_512's bits. */
typedef struct {
    __m256i w[16][4];   /* [sub-block j][k]: lane r = row r's values 16j + 4k .. +3, unsigned (stored +32) */
    __m256i sc[16];     /* lane r: row r's scale of sub-block j, as int32 */
    __m256i sp[8];      /* lane r: row r's scales of sub-blocks 2t and 2t + 1, an int16 pair */
    __m256 d;           /* the rows' super-scales */
} q6_K_panel;

/* one row's block as its 256 values in order, unsigned (0..63: ggml's value + 32) */
static inline void q6_K_values(const mg_block_q6_K *x, uint8_t out[256]) {
    for (int h = 0; h < 2; h++) {   /* values 128h + 32q + l */
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * h));
        for (int q = 0; q < 4; q++)
            _mm256_storeu_si256((__m256i *)(out + 128 * h + 32 * q), q6_K_value_bytes(l0, l1, qh, q));
    }
}

static void q6_K_pieces(int64_t b, int64_t nb, int r, char *blk, char *grp, int unpack);

/* blocks [0, nb) of the 8 rows xrow + r * xs into p[0..nb); packed: the rows are a group of
 * MG_Q6_KX8 at xrow, each row's block gathered back first (the packing is per job, paid back
 * over Q6K_PANEL_MIN_N columns and more) */
static inline __attribute__((always_inline)) void q6_K_panel_pack_any(const char *xrow, size_t xs, int64_t nb,
                                                                      void *pan, const int packed) {
    q6_K_panel *p = pan;
    uint8_t vals[8][256] __attribute__((aligned(32)));
    const char *rows[8];
    for (int r = 0; r < 8; r++) rows[r] = (const char *)vals[r];
    for (int64_t b = 0; b < nb; b++, p++) {
        float d[8];
        for (int r = 0; r < 8; r++) {
            mg_block_q6_K xb;
            const mg_block_q6_K *x = (const mg_block_q6_K *)(xrow + (size_t)r * xs) + b;
            if (packed) {
                q6_K_pieces(b, nb, r, (char *)&xb, (char *)xrow, 1);
                x = &xb;
            }
            q6_K_values(x, vals[r]);
            for (int j = 0; j < 16; j++) ((int32_t *)&p->sc[j])[r] = x->scales[j];
            for (int t = 0; t < 8; t++) {
                ((int16_t *)&p->sp[t])[2 * r] = x->scales[2 * t];
                ((int16_t *)&p->sp[t])[2 * r + 1] = x->scales[2 * t + 1];
            }
            d[r] = mg_fp16_to_fp32(x->d);
        }
        for (int g = 0; g < 8; g++) {   /* values 32g .. 32g + 31 of the 8 rows: dwords 8g .. 8g + 7 */
            __m256i v[8];
            load_rows_transposed(rows, 32 * (size_t)g, v);
            for (int k = 0; k < 8; k++) _mm256_store_si256(&p->w[0][0] + 8 * g + k, v[k]);
        }
        p->d = _mm256_loadu_ps(d);
    }
}
static void q6_K_panel_pack(const char *xrow, size_t xs, int64_t nb, void *pan) {
    q6_K_panel_pack_any(xrow, xs, nb, pan, 0);
}
static void q6_Kx8_panel_pack(const char *xrow, size_t xs, int64_t nb, void *pan) {
    q6_K_panel_pack_any(xrow, xs, nb, pan, 1);
}

/* acc[c] + one packed block of 8 rows against the blocks y[c] (MG_Q8_K): tile_q6_K_8's sums */
static inline __attribute__((always_inline)) void q6_K_panel_block(const q6_K_panel *p, const mg_block_q8_K *const *y,
                                                                   const int C, __m256 *acc) {
    __m256i s[TMAX];
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) s[c] = q6_K_offset_sums(p->sp, y[c]->bsums);
    /* a sub-block per pass, not unrolled (as q4_K_panel_block: the op cache) */
#pragma GCC unroll 1
    for (int j = 0; j < 16; j++) {
        __m256i a[TMAX];
        dots4_panel(p->w[j], y, 16 * j, C, a);
        const __m256i sc = _mm256_load_si256(&p->sc[j]);
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) s[c] = _mm256_add_epi32(s[c], _mm256_mullo_epi32(a[c], sc));
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; c++)
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[c]), _mm256_mul_ps(p->d, _mm256_set1_ps(y[c]->d)), acc[c]);
}
PANEL_TILES(q6_K, mg_block_q8_K)
/* the packing (an unpack, a transposition and the scales in lanes) pays back later than q4_K's:
 * K1024 M4608, 1 thread, Zen 4, tiles against panels: by 16 1.07 / 1.07-1.11 ms; by 24 1.55 /
 * 1.46-1.49; by 32 2.16-2.81 / 1.91-1.99; by 64 4.19-4.23 / 3.52-3.79; by 512 35.1-36.1 / 24.9-25.3 */
#define Q6K_PANEL_MIN_N 24
static const panel_kind q6_K_panels = {MG_QK_K, Q6K_PANEL_MIN_N, sizeof(q6_K_panel), q6_K_panel_pack, q6_K_panel_cols};
static const panel_kind q6_Kx8_panels = {MG_QK_K, Q6K_PANEL_MIN_N, sizeof(q6_K_panel), q6_Kx8_panel_pack, q6_K_panel_cols};
#endif

#ifdef MG_KROWS
/* ---- q8_0 weights x MG_Q8_0S rows: 8 rows per lane ----
 * As tile_q4_K_8: lane r = weight row r, the rows' bytes transposed into lanes, one vpdpbusd
 * against 4 broadcast converted values multiplies 8 rows. vpdpbusd takes the weights unsigned:
 * x + 128 (xor 0x80), and a lane starting from the converted block's -128 * sum ends at exactly
 * sum(x * y). An output is one f32 chain over its blocks: acc + sum * (dx * dy), rounded once.
 * (q8_0 rows are not packed at load as q4_K's and q6_K's are: packed, a 1-thread decode was slower
 * from memory, lfm2-350M-like Q8_0 18.3 against 19.7 ms a step, though faster in cache.) */
static inline __attribute__((always_inline)) void tile_q8_0_8(int64_t nb, const char *xrow, size_t xs,
                                                              const void *const *ys, const int C, float *out) {
    const mg_block_q8_0 *xr[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) xr[r] = (const mg_block_q8_0 *)(xrow + (size_t)r * xs);
    const __m256i k80 = _mm256_set1_epi8((char)0x80);
    __m256 acc[TMAX];
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch_tile_step(xrow, 8 * xs, b, nb);
        const char *qs[8];
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) qs[r] = (const char *)xr[r][b].qs;
        const __m128i dh = load_halves_8((const char *)&xr[0][b].d, xs);
        __m256i v[8];
        load_rows_transposed(qs, 0, v);
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) v[k] = _mm256_xor_si256(v[k], k80);
        const __m256 xd = _mm256_cvtph_ps(dh);
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) {
            const mg_block_q8_0s *y = (const mg_block_q8_0s *)ys[c] + b;
            /* two chains of 4 (exact integers: the split does not change the sum) */
            __m256i s0 = _mm256_set1_epi32(y->nsum), s1 = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int k = 0; k < 8; k += 2) {
                s0 = dpbusd_bcast(s0, v[k], y->qs + 4 * k);
                s1 = dpbusd_bcast(s1, v[k + 1], y->qs + 4 * k + 4);
            }
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), _mm256_mul_ps(xd, _mm256_set1_ps(y->d)),
                                     acc[c]);
        }
    }
    store_lanes(acc, C, out);
}

/* one q8_0 weight row against C MG_Q8_0S rows: tile_q8_0_8's chain, for the rows a tile leaves */
static inline __attribute__((always_inline)) void dot_q8_0s(int64_t nb, const char *xrow, const void *const *ys,
                                                            const int C, float *out) {
    const mg_block_q8_0 *x = (const mg_block_q8_0 *)xrow;
    const __m256i k80 = _mm256_set1_epi8((char)0x80);
    __m128 chain[TMAX];
    for (int c = 0; c < C; c++) chain[c] = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i xu = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)x[b].qs), k80);
        const float dx = mg_fp16_to_fp32(x[b].d);
        for (int c = 0; c < C; c++) {
            const mg_block_q8_0s *y = (const mg_block_q8_0s *)ys[c] + b;
            const __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), xu, _mm256_loadu_si256((const __m256i *)y->qs));
            chain[c] = chain_fma(chain[c], _mm_add_epi32(hsum8_epi32(s), _mm_cvtsi32_si128(y->nsum)), dx * y->d);
        }
    }
    for (int c = 0; c < C; c++) out[c] = _mm_cvtss_f32(chain[c]);
}
#endif

/* ---- f16 / bf16 weights x converted rows (MG_F16F / MG_BF16F: half values held as f32, quant.h):
 * f32 products summed with fma; only the weights are converted in the loop ---- */
#if MG_QAVX2
static inline __m256 load8_h(const uint16_t *p, int bf) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (!bf) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

#if MG_QAVX2 && defined(__AVX512F__)
static inline __m512 load16_h(const uint16_t *p, int bf) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (!bf) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

/* the last n < 32 values of a row, zero-padded to 32 (a product with 0 changes no sum) */
static inline void pad32(uint16_t out[32], const uint16_t *src, int64_t n) {
    memset(out, 0, 32 * sizeof(uint16_t));
    memcpy(out, src, (size_t)n * sizeof(uint16_t));
}
static inline float half_to_f32(uint16_t h, int bf) { return bf ? mg_bf16_to_fp32(h) : mg_fp16_to_fp32(h); }
/* value k of a converted row: held as f32 (yf: MG_F16F, MG_BF16F) or as the half type */
static inline float y_at(const void *y, int64_t k, int bf, int yf) {
    return yf ? ((const float *)y)[k] : half_to_f32(((const uint16_t *)y)[k], bf);
}
/* values k .. k + n - 1 (n < 32) of a converted row as f32, zero-padded to 32 */
static inline void pad_y(float out[32], const void *y, int64_t k, int64_t n, int bf, int yf) {
    for (int i = 0; i < 32; i++) out[i] = i < n ? y_at(y, k + i, bf, yf) : 0.0f;
}
#if MG_QAVX2
static inline __m256 load8_y(const void *y, int64_t k, int bf, int yf) {
    return yf ? _mm256_loadu_ps((const float *)y + k) : load8_h((const uint16_t *)y + k, bf);
}
#endif
#if MG_QAVX2 && defined(__AVX512F__)
static inline __m512 load16_y(const void *y, int64_t k, int bf, int yf) {
    return yf ? _mm512_loadu_ps((const float *)y + k) : load16_h((const uint16_t *)y + k, bf);
}
#endif

static inline __attribute__((always_inline)) void dot_half(int64_t K, const char *xrow, const void *const *ys,
                                                           const int C, float *out, const int bf, const int yf) {
    const uint16_t *x = (const uint16_t *)xrow;
#if MG_QAVX2 && defined(__AVX512F__)
    /* the AVX2 loop below in 16-lane registers: chains 0|1 in one, 2|3 in the other, lane for
     * lane the same fmas in the same order, and the same final sum ((0 + 2) + (1 + 3)), so the
     * result is bit-identical; half the instructions (the conversions bound this loop). No
     * software prefetch: a single row stream is prefetched by the hardware, and the extra
     * requests only slowed it (4096 x 4096 x vector, 1 thread: 1.13 ms with, 1.00 ms without) */
    __m512 acc2[TMAX][2];
    for (int c = 0; c < C; c++) acc2[c][0] = acc2[c][1] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        const __m512 x0 = load16_h(x + k, bf), x1 = load16_h(x + k + 16, bf);
        for (int c = 0; c < C; c++) {
            acc2[c][0] = _mm512_fmadd_ps(x0, load16_y(ys[c], k, bf, yf), acc2[c][0]);
            acc2[c][1] = _mm512_fmadd_ps(x1, load16_y(ys[c], k + 16, bf, yf), acc2[c][1]);
        }
    }
    if (k < K) {
        uint16_t tx[32];
        float ty[32];
        pad32(tx, x + k, K - k);
        const __m512 x0 = load16_h(tx, bf), x1 = load16_h(tx + 16, bf);
        for (int c = 0; c < C; c++) {
            pad_y(ty, ys[c], k, K - k, bf, yf);
            acc2[c][0] = _mm512_fmadd_ps(x0, _mm512_loadu_ps(ty), acc2[c][0]);
            acc2[c][1] = _mm512_fmadd_ps(x1, _mm512_loadu_ps(ty + 16), acc2[c][1]);
        }
    }
    for (int c = 0; c < C; c++) {
        const __m512 s = _mm512_add_ps(acc2[c][0], acc2[c][1]);   /* lanes 0-7: 0 + 2, 8-15: 1 + 3 */
        out[c] = hsum8(_mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1)));
    }
#elif MG_QAVX2
    /* 4 chains of 8 lanes per column over steps of 32; a tail shorter than 32 is zero-padded (a
     * product with 0 changes no sum) */
    __m256 acc[TMAX][4];
    for (int c = 0; c < C; c++)
        for (int q = 0; q < 4; q++) acc[c][q] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        PREFETCH(x + k);
        __m256 xv[4];
        for (int q = 0; q < 4; q++) xv[q] = load8_h(x + k + 8 * q, bf);
        for (int c = 0; c < C; c++)
            for (int q = 0; q < 4; q++) acc[c][q] = _mm256_fmadd_ps(xv[q], load8_y(ys[c], k + 8 * q, bf, yf), acc[c][q]);
    }
    if (k < K) {
        uint16_t tx[32];
        float ty[32];
        pad32(tx, x + k, K - k);
        __m256 xv[4];
        for (int q = 0; q < 4; q++) xv[q] = load8_h(tx + 8 * q, bf);
        for (int c = 0; c < C; c++) {
            pad_y(ty, ys[c], k, K - k, bf, yf);
            for (int q = 0; q < 4; q++) acc[c][q] = _mm256_fmadd_ps(xv[q], _mm256_loadu_ps(ty + 8 * q), acc[c][q]);
        }
    }
    for (int c = 0; c < C; c++)
        out[c] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[c][0], acc[c][2]), _mm256_add_ps(acc[c][1], acc[c][3])));
#else
    for (int c = 0; c < C; c++) {
        float s = 0.0f;
        for (int64_t k = 0; k < K; k++) s += half_to_f32(x[k], bf) * y_at(ys[c], k, bf, yf);
        out[c] = s;
    }
#endif
}

/* one weight row against C converted rows; C is a constant in each expansion */
static inline __attribute__((always_inline)) void dot_cols(int t, int64_t K, const char *xrow, const void *const *ys,
                                                           const int C, float *out) {
    switch (t) {
#ifdef MG_KROWS
        case MG_Q8_0: dot_q8_0s(K / MG_QK8_0, xrow, ys, C, out); break;
#else
        case MG_Q8_0: dot_q8_0(K / MG_QK8_0, xrow, ys, C, out); break;
#endif
        case MG_Q4_0: dot_q4_0(K / MG_QK4_0, xrow, ys, C, out); break;
        case MG_Q4_K: case MG_Q4_KX8: dot_q4_K(K / MG_QK_K, xrow, ys, C, out); break;   /* KX8: a row after the groups */
#ifdef MG_KROWS
        case MG_Q6_K: case MG_Q6_KX8: dot_q6_K_512(K / MG_QK_K, xrow, ys, C, out); break;   /* KX8: a row after the groups */
#else
        case MG_Q6_K: dot_q6_K(K / MG_QK_K, xrow, ys, C, out); break;
#endif
        case MG_F16: dot_half(K, xrow, ys, C, out, 0, 0); break;
        case MG_BF16: dot_half(K, xrow, ys, C, out, 1, 0); break;
        case MG_F16F: dot_half(K, xrow, ys, C, out, 0, 1); break;    /* f16 weights, f32-held rows */
        case MG_BF16F: dot_half(K, xrow, ys, C, out, 1, 1); break;
        default: for (int c = 0; c < C; c++) out[c] = 0.0f; break;
    }
}

/* rows of src0 per job: a job's weights (16 rows of at most K * 34/32 bytes) are re-read from
 * cache for every src1 row */
#define QMB 16

/* A type's kernels: rows[C] computes a tile of tr weight rows by C columns, row[C] one weight
 * row by C columns (the rows left over), for C = 1..tc; K is the row length in values, xs the
 * weight row stride in bytes, o[r * C + c] the outputs. Matrix x vector takes row[1] for every
 * row (a stream over the weights), or rows[1] where vec_tiles is set (faster there: q4_K's). */
typedef void (*tile_fn)(int64_t K, const char *x, size_t xs, const void *const *ys, float *o);
typedef struct { int tr, tc, vec_tiles; tile_fn rows[TMAX + 1], row[TMAX + 1]; } tiles;

/* the one-row kernels behind the tiles, with the tiles' signature (R is 1) */
static inline __attribute__((always_inline)) void row_tile(int t, int64_t K, const char *x, size_t xs,
                                                           const void *const *ys, int R, int C, float *o) {
    (void)xs; (void)R;
    dot_cols(t, K, x, ys, C, o);
}

#define DEFINE_TILE(name, kernel, T, R, C)                                                         \
    static void name##_##R##x##C(int64_t K, const char *x, size_t xs, const void *const *ys, float *o) { \
        kernel(T, K, x, xs, ys, R, C, o);                                                          \
    }
#define DEFINE_TILE_WIDTHS(name, kernel, T, R)                                                     \
    DEFINE_TILE(name, kernel, T, R, 1) DEFINE_TILE(name, kernel, T, R, 2)                          \
    DEFINE_TILE(name, kernel, T, R, 3) DEFINE_TILE(name, kernel, T, R, 4)                          \
    DEFINE_TILE(name, kernel, T, R, 5) DEFINE_TILE(name, kernel, T, R, 6)
#define TILE_WIDTHS(name, R) {NULL, name##_##R##x1, name##_##R##x2, name##_##R##x3, name##_##R##x4, name##_##R##x5, name##_##R##x6}

/* the other types: one weight row against up to CMAX columns (a q4_K or q6_K block's unpacking
 * is shared by the columns; the converted blocks are small) */
#define ROW_TILES(name, T, width)                                                                  \
    DEFINE_TILE_WIDTHS(name, row_tile, T, 1)                                                       \
    static const tiles name##_tiles = {1, width, 0, TILE_WIDTHS(name, 1), TILE_WIDTHS(name, 1)};
ROW_TILES(q4_0, MG_Q4_0, CMAX)
#if defined(MG_KROWS) || MG_PANELS
/* 8 rows by C columns (q8_0, q4_K, q6_K on MG_KROWS builds; q8_0 and q4_K on MG_PANELS ones;
 * from PANEL_MIN_N columns on, the panels take q4_K on both and q8_0 on MG_PANELS ones, and
 * from Q6K_PANEL_MIN_N q6_K on MG_KROWS ones); the
 * rows left over by the one-row kernels,
 * which follow the same chain on these builds; matrix x vector by 8-row tiles where vec_tiles
 * (q4_K, K1024 M4608, 1 thread: 0.10 against 0.19 ms in cache, 23.6 against 15.8 GB/s from
 * memory; q8_0 the same shape: 0.14 ms in cache, 32.8 GB/s over 24 such weights; AVX-512), by
 * the one-row kernel for q6_K (dot_q6_K_512: the faster there) */
static inline __attribute__((always_inline)) void krows_tile(int t, int64_t K, const char *x, size_t xs,
                                                             const void *const *ys, int R, int C, float *o) {
    (void)R;
#ifdef MG_KROWS
    if (t == MG_Q4_K || t == MG_Q4_KX8) tile_q4_K_8(K / MG_QK_K, x, xs, ys, C, o, t == MG_Q4_KX8);
    else if (t == MG_Q6_K || t == MG_Q6_KX8) tile_q6_K_8(K / MG_QK_K, x, xs, ys, C, o, t == MG_Q6_KX8);
#else
    if (t == MG_Q4_K) tile_q4_K_8(K / MG_QK_K, x, xs, ys, C, o);
#endif
    else tile_q8_0_8(K / MG_QK8_0, x, xs, ys, C, o);
}
#define KROWS_TILES(name, T, vec_tiles)   /* 8 rows, spelled out for the token pasting */          \
    DEFINE_TILE_WIDTHS(name, krows_tile, T, 8)                                                     \
    DEFINE_TILE_WIDTHS(name, row_tile, T, 1)                                                       \
    static const tiles name##_tiles = {8, CMAX, vec_tiles, TILE_WIDTHS(name, 8), TILE_WIDTHS(name, 1)};
KROWS_TILES(q4_K, MG_Q4_K, 1)
#ifdef MG_KROWS
KROWS_TILES(q4_Kx8, MG_Q4_KX8, 1)   /* packed groups; the rows after them are plain */
#endif
KROWS_TILES(q8_0, MG_Q8_0, 1)
#else
ROW_TILES(q4_K, MG_Q4_K, CMAX)
ROW_TILES(q8_0, MG_Q8_0, CMAX)
#endif
#ifdef MG_KROWS
KROWS_TILES(q6_K, MG_Q6_K, 0)
KROWS_TILES(q6_Kx8, MG_Q6_KX8, 1)   /* packed groups, also by one column; the rows after them are plain q6_K */
#else
/* q6_K: one weight row against 6 columns on every build (AVX2: 1.13x of 4, K768 M2048 by 512,
 * 1 thread, Zen 3) */
ROW_TILES(q6_K, MG_Q6_K, TMAX)
#endif
ROW_TILES(f16, MG_F16, CMAX)
ROW_TILES(bf16, MG_BF16, CMAX)
ROW_TILES(f16f, MG_F16F, CMAX)     /* half weights by f32-held rows (quant.h) */
ROW_TILES(bf16f, MG_BF16F, CMAX)

/* weight rows [m0, m1) of one plane against all N converted rows, tile by tile; each output
 * comes out the same whichever tile computes it */
static void run_tiles(const tiles *t, const mg_tensor *a, const mg_tensor *b, const mg_tensor *d, const char *ap,
                      int64_t m0, int64_t m1, int64_t i2, int64_t i3) {
    const int64_t K = a->ne[0], N = b->ne[1];
    const size_t xs = (size_t)a->nb[1];
    float o[8 * TMAX];   /* the tallest tile: q4_K's 8 rows */
    for (int64_t j = 0; j < N; j += t->tc) {
        const int C = (int)mg_min64(t->tc, N - j);
        const void *ys[TMAX];
        for (int c = 0; c < C; c++) ys[c] = mg_ptr(b, 0, j + c, i2, i3);
        int64_t i = m0;
        for (; i + t->tr <= m1; i += t->tr) {
            t->rows[C](K, ap + i * xs, xs, ys, o);
            for (int r = 0; r < t->tr; r++)
                for (int c = 0; c < C; c++) mg_store_f32(mg_ptr(d, i + r, j + c, i2, i3), o[r * C + c]);
        }
        for (; i < m1; i++) {
            t->row[C](K, ap + i * xs, xs, ys, o);
            for (int c = 0; c < C; c++) mg_store_f32(mg_ptr(d, i, j + c, i2, i3), o[c]);
        }
    }
}

/* MUL_MAT, src0 [K, M, a2, a3] of a half / block type (rows dense), src1 the converted rows
 * [K, N, b2, b3] (contiguous, the dot type), dst [M, N, b2, b3] f32 */
void mg_mul_mat_blocks(const mg_tensor *a, const mg_tensor *b, const mg_tensor *d, int ith, int nth) {
    const int64_t K = a->ne[0], M = a->ne[1], N = b->ne[1];
    const int64_t r2 = b->ne[2] / a->ne[2], r3 = b->ne[3] / a->ne[3];
    const int64_t mblk = (M + QMB - 1) / QMB, planes = b->ne[2] * b->ne[3];
    const tiles *tl;
    switch (a->type) {
        case MG_Q8_0: tl = &q8_0_tiles; break;
        case MG_Q4_0: tl = &q4_0_tiles; break;
        case MG_Q4_K: tl = &q4_K_tiles; break;
#ifdef MG_KROWS
        case MG_Q4_KX8: tl = &q4_Kx8_tiles; break;
        case MG_Q6_KX8: tl = &q6_Kx8_tiles; break;
#endif
        case MG_Q6_K: tl = &q6_K_tiles; break;
        case MG_F16: tl = b->type == MG_F16F ? &f16f_tiles : &f16_tiles; break;
        case MG_BF16: tl = b->type == MG_BF16F ? &bf16f_tiles : &bf16_tiles; break;
        default: return;   /* refused by the backend's type table */
    }
    int64_t j0, j1;
    mg_split(planes * mblk, ith, nth, &j0, &j1);
#if MG_Q4K_PANELS
    /* one panel in the thread's scratch; without it the one-row kernels (the same bits) */
    const panel_kind *pk = panels_of(a->type);
    void *pan = NULL;
    if (pk && N >= pk->min_n && K > 0 && j0 < j1) pan = mg_thread_scratch((size_t)(K / pk->block_values) * pk->panel_bytes);
#endif
    for (int64_t job = j0; job < j1; job++) {
        const int64_t mb = job % mblk, p = job / mblk;
        const int64_t i2 = p % b->ne[2], i3 = p / b->ne[2];
        const int64_t m0 = mb * QMB, m1 = mg_min64(m0 + QMB, M);
        const char *ap = mg_ptr(a, 0, 0, i2 / r2, i3 / r3);
        if (K == 0) {
            for (int64_t j = 0; j < N; j++)
                for (int64_t i = m0; i < m1; i++) mg_store_f32(mg_ptr(d, i, j, i2, i3), 0.0f);
            continue;
        }
        if (N > 1 || tl->vec_tiles) {   /* matrix x matrix: tiles */
#if MG_Q4K_PANELS
            if (pan) {
                run_tiles(tl, a, b, d, ap, run_panels(pk, a, b, d, ap, m0, m1, i2, i3, pan), m1, i2, i3);
                continue;
            }
#endif
            run_tiles(tl, a, b, d, ap, m0, m1, i2, i3);
            continue;
        }
        const void *ys[1] = {mg_ptr(b, 0, 0, i2, i3)};   /* matrix x vector: a stream over the rows */
        for (int64_t i = m0; i < m1; i++) {
            float o[1];
            tl->row[1](K, ap + i * a->nb[1], (size_t)a->nb[1], ys, o);
            mg_store_f32(mg_ptr(d, i, 0, i2, i3), o[0]);
        }
    }
}

/* MUL_MAT:src1_to_dot_type: src[0] the f32 operand [K, N, b2, b3] (any strides), dst the work
 * buffer [K, N, b2, b3] of the dot type, contiguous; threads split the rows */
static void mg_k_src1_to_dot_type(const mg_node *n, int ith, int nth) {
    const mg_tensor *s = &n->src[0];
    const mg_tensor *d = &n->dst;
    int64_t r0, r1;
    mg_split(mg_nrows(s), ith, nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        int64_t i1, i2, i3;
        mg_row_coords(s, r, &i1, &i2, &i3);
        mg_from_f32_row(d->type, mg_ptr(s, 0, i1, i2, i3), s->nb[0], mg_ptr(d, 0, i1, i2, i3), s->ne[0]);
    }
}

int mg_work_type(int t, int64_t n_cols) {
    switch (t) {
        /* quant.h: f32-held half values by several columns; half rows for a matrix x vector
         * (4096 x 4096, 1 thread: 1.1 against 1.3-1.6 ms with f32-held ones) */
        case MG_F16: return n_cols > 1 ? MG_F16F : MG_F16;
        case MG_BF16: return n_cols > 1 ? MG_BF16F : MG_BF16;
#ifdef MG_KROWS
        case MG_Q8_0: return MG_Q8_0S;
#else
        case MG_Q8_0: return MG_Q8_0;
#endif
        case MG_Q4_0: return MG_Q8_0X;
#if MG_Q4K_PAIR_SUMS
        case MG_Q4_K: return MG_Q8_KP;   /* 1.05x, K768 M2048 by 512 */
#else
        case MG_Q4_K: case MG_Q4_KX8: return MG_Q8_K;
#endif
        case MG_Q6_K: case MG_Q6_KX8: return MG_Q8_K;
        default: return -1;
    }
}

int64_t mg_work_row_bytes(int t, int64_t k, int64_t n_cols) {
    const int w = mg_work_type(t, n_cols);
    return w < 0 ? 0 : mg_row_bytes(w, k);
}

int mg_quant_simd(void) {
#if MG_QAVX2
    return 1;
#else
    return 0;
#endif
}

int mg_quant_row_group(int t) {
#ifdef MG_KROWS
    if (t == MG_Q8_0 || t == MG_Q4_K || t == MG_Q6_K) return MG_KROWS;
#endif
#if MG_Q4K_PANELS
    if (panels_of(t)) return 8;
#endif
    (void)t;
    return 1;
}

/* an internal step of MUL_MAT, not a registry op: the name says whose ("OP:step") */
__attribute__((constructor)) static void mg_register_src1_to_dot_type(void) {
    mg_register_kernel("MUL_MAT:src1_to_dot_type", mg_k_src1_to_dot_type, NULL);
}

/* ---- packing rows in groups of 8 (MG_Q4_KX8, MG_Q6_KX8): piece by piece between a group's rows
 * (the type's own layout) and its packed blocks ---- */
int mg_packed_type(int t) {
#ifdef MG_KROWS
    if (t == MG_Q4_K) return MG_Q4_KX8;
    if (t == MG_Q6_K) return MG_Q6_KX8;
#endif
    (void)t;
    return -1;   /* no kernel reads packed rows of this type on this build */
}

/* the pieces of row r's block b (blk) and their places in its group's packed bytes (grp, nb
 * blocks a row), one MOVE(offset in blk, offset in grp, bytes) each: the layouts written out above
 * each type's 8-row kernel */
#ifdef MG_KROWS
#define MOVE(x, y, n) (unpack ? memcpy(blk + (x), grp + (y), n) : memcpy(grp + (y), blk + (x), n))
static void q4_K_pieces(int64_t b, int64_t nb, int r, char *blk, char *grp, int unpack) {
    (void)nb;
    const int64_t at = b * Q4K_GROUP_BLOCK;
    MOVE(0, at + 16 * r, 16);
    for (int g = 0; g < 4; g++)
        for (int k = 0; k < 8; k++) MOVE(16 + 32 * g + 4 * k, at + Q4K_GROUP_HEADS + 256 * g + 32 * k + 4 * r, 4);
}
static void q6_K_pieces(int64_t b, int64_t nb, int r, char *blk, char *grp, int unpack) {
    const int64_t at = b * Q6K_GROUP_VALUES;
    MOVE(offsetof(mg_block_q6_K, scales), Q6K_GROUP_SC(nb, b) + 16 * r, 16);
    MOVE(offsetof(mg_block_q6_K, d), Q6K_GROUP_D(nb, b) + 2 * r, 2);
    for (int k = 0; k < 8; k++)
        for (int h = 0; h < 2; h++) {
            MOVE(64 * h + 4 * k, at + 512 * h + 32 * k + 4 * r, 4);
            MOVE(64 * h + 32 + 4 * k, at + 512 * h + 256 + 32 * k + 4 * r, 4);
            MOVE(offsetof(mg_block_q6_K, qh) + 32 * h + 4 * k, at + 1024 + 256 * h + 32 * k + 4 * r, 4);
        }
}
#undef MOVE

int mg_pack_rows(int t, char *data, int64_t nrows, int64_t row_bytes, int unpack) {
    if (mg_packed_type(t) < 0) return -1;
    void (*pieces)(int64_t, int64_t, int, char *, char *, int) = t == MG_Q4_K ? q4_K_pieces : q6_K_pieces;
    const int64_t block = t == MG_Q4_K ? (int64_t)sizeof(mg_block_q4_K) : (int64_t)sizeof(mg_block_q6_K);
    if (row_bytes <= 0 || row_bytes % block != 0 || nrows < 0) return -1;
    const int64_t nb = row_bytes / block, group = 8 * row_bytes;
    char *tmp = malloc((size_t)group);
    if (tmp == NULL) return -1;
    for (int64_t g0 = 0; g0 + 8 <= nrows; g0 += 8) {
        char *grp = data + g0 * row_bytes;
        memcpy(tmp, grp, (size_t)group);
        for (int64_t b = 0; b < nb; b++)
            for (int r = 0; r < 8; r++) {
                const int64_t at = r * row_bytes + b * block;   /* row r's block b */
                if (unpack) pieces(b, nb, r, grp + at, tmp, 1);
                else pieces(b, nb, r, tmp + at, grp, 0);
            }
    }
    free(tmp);
    return 0;
}
#else
int mg_pack_rows(int t, char *data, int64_t nrows, int64_t row_bytes, int unpack) {
    (void)t; (void)data; (void)nrows; (void)row_bytes; (void)unpack;
    return -1;   /* mg_packed_type: nothing is packed on this build */
}
#endif
