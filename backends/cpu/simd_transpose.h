/* AVX2 register transposes shared by the kernels that turn rows into lanes (quant_matmul.c's
 * weight rows, gemm_lanes.c's packed copies). */
#ifndef MG_SIMD_TRANSPOSE_H
#define MG_SIMD_TRANSPOSE_H

#if defined(__AVX2__)
#include <immintrin.h>

/* v[r] (8 dwords of row r) -> v[k] (dword k of rows 0..7) */
static inline __attribute__((always_inline)) void mg_transpose8x8_epi32(__m256i v[8]) {
    __m256i t[8], u[8];
#pragma GCC unroll 8
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
#pragma GCC unroll 8
    for (int h = 0; h < 2; h++) {   /* rows 4h..4h+3 */
        u[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
        u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
#pragma GCC unroll 8
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x20);
        v[k + 4] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x31);
    }
}

/* the same for floats (a bit-for-bit move of the 32-bit elements) */
static inline __attribute__((always_inline)) void mg_transpose8x8_ps(__m256 v[8]) {
    __m256i w[8];
    for (int i = 0; i < 8; i++) w[i] = _mm256_castps_si256(v[i]);
    mg_transpose8x8_epi32(w);
    for (int i = 0; i < 8; i++) v[i] = _mm256_castsi256_ps(w[i]);
}
#endif

#endif
