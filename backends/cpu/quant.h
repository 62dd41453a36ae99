/* Half-precision and block-quantized types: ggml's byte layouts, and the conversions and dot
 * products the cpu backend's GET_ROWS, CPY and MUL_MAT run on them.
 *
 * The layouts are ggml's so that a GGUF file's tensor data can be used as it is (a loader may
 * still pack q4_K and q6_K weights in groups of 8 rows for the 8-row kernels: quant_matmul.c's
 * MG_Q4_KX8, MG_Q6_KX8):
 *   q4_0: 32 values, one f16 scale d, value = d * (nibble - 8); nibble j < 16 is the low half of
 *         byte j, nibble j >= 16 the high half of byte j - 16.
 *   q8_0: 32 values, f16 scale d, value = d * q (int8).
 *   q4_K: 256 values in 8 sub-blocks of 32; f16 super-scales d and dmin; 6-bit scale and min per
 *         sub-block packed in 12 bytes; value = d * sc * nibble - dmin * m.
 *   q6_K: 256 values in 16 sub-blocks of 16; 6-bit values split in a low nibble (ql) and 2 high
 *         bits (qh); int8 scale per sub-block; value = d * sc * (q - 32).
 *   q8_K: 256 values, f32 scale, int8 values and the sum of each 16 values (bsums): the form the
 *         f32 operand of a q4_K / q6_K mul_mat is converted to.
 * MUL_MAT follows ggml's CPU arithmetic: the f32 operand's rows are first converted to the weight
 * type's "dot type" (q8_0 for q4_0/q8_0, q8_K for the K-quants, f16 for f16, bf16 for bf16), then
 * each output is an integer dot product per block scaled by the two blocks' scales, so results
 * match ggml's to f32 rounding of the final sums, not merely a dequantize-then-multiply. */
#ifndef MG_QUANT_H
#define MG_QUANT_H

#include "mg.h"

#define MG_QK4_0 32
#define MG_QK8_0 32
#define MG_QK_K 256

typedef struct { uint16_t d; uint8_t qs[MG_QK4_0 / 2]; } mg_block_q4_0;
typedef struct { uint16_t d; int8_t qs[MG_QK8_0]; } mg_block_q8_0;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[MG_QK_K / 2]; } mg_block_q4_K;
typedef struct { uint8_t ql[MG_QK_K / 2]; uint8_t qh[MG_QK_K / 4]; int8_t scales[MG_QK_K / 16]; uint16_t d; } mg_block_q6_K;
typedef struct { float d; int8_t qs[MG_QK_K]; int16_t bsums[MG_QK_K / 16]; } mg_block_q8_K;

_Static_assert(sizeof(mg_block_q4_0) == 18, "q4_0 block layout");
_Static_assert(sizeof(mg_block_q8_0) == 34, "q8_0 block layout");
_Static_assert(sizeof(mg_block_q4_K) == 144, "q4_K block layout");
_Static_assert(sizeof(mg_block_q6_K) == 210, "q6_K block layout");
_Static_assert(sizeof(mg_block_q8_K) == 292, "q8_K block layout");

/* bf16 <-> f32: the upper half of the f32 bits; rounding to nearest even, a NaN stays a (quiet) NaN */
static inline uint16_t mg_fp32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64);
    return (uint16_t)((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}
static inline float mg_bf16_to_fp32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* MG_Q8_0X: a row of q8_0 blocks (the same values and scales ggml's q8_0 conversion gives) laid
 * out for the q4_0 dot product, structure of arrays over the row's nb blocks:
 *   int8 qs[nb][32], int16 s8[nb][16] (8 * the sum of each pair of values), float d[nb] (the
 *   f16 scale, widened).
 * maddubs takes the q4_0 nibbles unsigned; subtracting s8 gives the same int16 pair sums as
 * multiplying by nibble - 8, without the two sign operations per block, and d needs no f16
 * conversion per weight row. */
#define MG_Q8_0X_BLOCK (32 + 32 + 4)

/* MG_Q8_0S: q8_0 blocks (ggml's q8_0 conversion: the same values and scales) for the q8_0
 * weights' 8-row kernels: the scale widened to f32, and -128 * the sum of the values, which
 * vpdpbusd needs to turn (weight + 128) * value into weight * value exactly. */
typedef struct { float d; int32_t nsum; int8_t qs[MG_QK8_0]; } mg_block_q8_0s;

/* MG_F16F, MG_BF16F: f32 values that are exactly f16 (bf16) ones, for the f16 (bf16) weights' dot
 * products by several columns: src1 rounded to the half type as ggml converts it, then widened
 * back (exactly) once per converted row, so the dot products convert only the weights. The
 * products and sums are the same as with half rows; the conversions, which bound those loops,
 * are halved. A matrix x vector keeps half rows: there the f32 row, twice the bytes, read again
 * for every weight row, cost more than the conversions it saves (mg_work_type). */

/* MG_Q8_KP: q8_K blocks (ggml's q8_K conversion: the same values and scale) for the q4_K weights'
 * AVX2 dot product, whose mins term takes the sums of each 32 values: bsums[0..7] hold those 8 sums
 * (ggml's bsums added in pairs; |sum| <= 32 * 127, an int16), bsums[8..15] are 0. Made once per
 * converted row instead of once per weight row and block. */

/* quant_codec.c */
/* n values of a row of type t (n a multiple of its block size) to f32 */
void mg_to_f32_row(int t, const void *src, float *dst, int64_t n);
/* n f32 values (src stride snb bytes) to a row of type t (f16, bf16, q8_0, q8_K, q4_0), exactly
 * as ggml's x86 CPU backend converts f32 there (mul_mat's operand, cpy) */
void mg_from_f32_row(int t, const char *src, int64_t snb, void *dst, int64_t n);

/* quant_matmul.c: MUL_MAT with src0 f16 / bf16 / q4_0 / q8_0 / q4_K / q6_K and src1 already
 * converted to the dot type (matmul.c dispatches here, planes already merged into columns) */
void mg_mul_mat_blocks(const mg_tensor *a, const mg_tensor *b, const mg_tensor *d, int ith, int nth);

#endif
