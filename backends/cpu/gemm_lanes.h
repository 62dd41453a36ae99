/* The packed f32 GEMM of AVX2 builds (gemm_lanes.c): MUL_MAT's summation order, computed lane
 * by lane so that b can be broadcast (matmul.c says the order; gemm_lanes.c how it is kept). */
#ifndef MG_GEMM_LANES_H
#define MG_GEMM_LANES_H

#include "mg.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define MG_GEMM_LANES 1
/* floats of b's packed copy per plane, for K floats per column in k blocks of kb */
int64_t mg_lanes_packed_floats(int64_t K, int64_t N, int64_t kb);
/* panels of b's packed copy per plane (the unit pack_b splits) */
int64_t mg_lanes_panels(int64_t N);
/* pack panels [q0, q1) (counted over all planes of b) into out */
void mg_lanes_pack_b(const mg_tensor *b, float *out, int64_t kb, int64_t q0, int64_t q1);
/* rows of a per job */
int64_t mg_lanes_row_block(void);
/* jobs [j0, j1) of (plane, block of mg_lanes_row_block() rows) from b's packed copy bk;
 * 0 when no scratch buffer could be had (nothing written) */
int mg_lanes_gemm(const mg_tensor *a, const mg_tensor *b, const float *bk, const mg_tensor *d, int64_t kb,
                  int64_t j0, int64_t j1);
#else
#define MG_GEMM_LANES 0
#endif

#endif
