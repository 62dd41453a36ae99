/* minigraph CPU kernels: shared declarations.
 *
 * Layout conventions are ggml's: ne[4] element counts and nb[4] byte strides, dim 0 fastest.
 * Shape comments on pointers list extents in ggml order, e.g. [ne0, ne1, ne2, ne3]. */
#ifndef MG_H
#define MG_H

#include <stdint.h>
#include <string.h>
#include <math.h>

#include "mg_api.h"

/* ---- kernels: each thread ith of nth does its share of one node ---- */
typedef void (*mg_kernel)(const mg_node *n, int ith, int nth);
/* an index check: pure, run before any write of the node; returns nonzero and fills err */
typedef int (*mg_check)(const mg_node *n, mg_error *err);

/* Registration: each kernel file says which registry ops its kernels run, next to the kernel,
 *     MG_KERNEL(SET_ROWS, mg_k_set_rows, mg_check_set_rows)
 * (OP is the registry's op name). The registration runs when the extension loads; the plan
 * executor dispatches through the resulting table and Python reads the op names back from it,
 * so there is no op list to keep in step by hand. */
void mg_register_kernel(const char *op, mg_kernel kernel, mg_check check);
#define MG_KERNEL(OP, KERNEL, CHECK) \
    __attribute__((constructor)) static void mg_register_##OP(void) { mg_register_kernel(#OP, KERNEL, CHECK); }

/* ---- helpers ---- */
static inline int64_t mg_min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t mg_max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* bytes of one block (one element for the plain types), like ggml's type_size */
static inline int mg_type_size(int type) {
    switch (type) {
        case MG_F16: case MG_BF16: return 2;
        case MG_I64:  return 8;
        case MG_Q4_0: return 18;
        case MG_Q8_0: return 34;
        case MG_Q4_K: case MG_Q4_KX8: return 144;
        case MG_Q6_K: case MG_Q6_KX8: return 210;
        case MG_Q8_K: case MG_Q8_KP: return 292;
        case MG_Q8_0X: return 68;
        case MG_Q8_0S: return 40;
        default:      return 4;
    }
}

/* elements per block: 1 for the plain types */
static inline int mg_blck_size(int type) {
    switch (type) {
        case MG_Q4_0: case MG_Q8_0: case MG_Q8_0X: case MG_Q8_0S: return 32;
        case MG_Q4_K: case MG_Q4_KX8: case MG_Q6_K: case MG_Q6_KX8: case MG_Q8_K: case MG_Q8_KP: return 256;
        default: return 1;
    }
}

/* bytes of n elements (n a multiple of the block size) */
static inline int64_t mg_row_bytes(int type, int64_t n) {
    return n / mg_blck_size(type) * mg_type_size(type);
}

static inline int64_t mg_nelements(const mg_tensor *t) {
    return t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
}

static inline int64_t mg_nrows(const mg_tensor *t) {
    return t->ne[1] * t->ne[2] * t->ne[3];
}

/* same rule as Tensor.is_contiguous: unit dims are skipped */
static inline int mg_is_contiguous(const mg_tensor *t) {
    int64_t next = mg_type_size(t->type);
    for (int i = 0; i < 4; i++) {
        const int64_t ne = i == 0 ? t->ne[0] / mg_blck_size(t->type) : t->ne[i];
        if (ne != 1) {
            if (t->nb[i] != next) return 0;
            next *= ne;
        }
    }
    return 1;
}

static inline int mg_rows_contiguous(const mg_tensor *t) {
    return t->ne[0] == 1 || t->nb[0] == mg_type_size(t->type);
}

/* the share [*r0, *r1) of n work items for thread ith of nth */
static inline void mg_split(int64_t n, int ith, int nth, int64_t *r0, int64_t *r1) {
    int64_t per = (n + nth - 1) / nth;
    int64_t a = per * ith;
    *r0 = a < n ? a : n;
    *r1 = mg_min64(a + per, n);
}

/* row r (flat over dims 1..3) -> (i1, i2, i3) */
static inline void mg_row_coords(const mg_tensor *t, int64_t r, int64_t *i1, int64_t *i2, int64_t *i3) {
    *i1 = r % t->ne[1];
    r /= t->ne[1];
    *i2 = r % t->ne[2];
    *i3 = r / t->ne[2];
}

/* the row after (i1, i2, i3) in t's row order: what mg_row_coords(t, r + 1) gives, without its
 * divisions (three per row cost more than a short row's work) */
static inline void mg_row_next(const mg_tensor *t, int64_t *i1, int64_t *i2, int64_t *i3) {
    if (++*i1 == t->ne[1]) {
        *i1 = 0;
        if (++*i2 == t->ne[2]) { *i2 = 0; ++*i3; }
    }
}

static inline char *mg_ptr(const mg_tensor *t, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
    return t->data + i0 * t->nb[0] + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
}

static inline float mg_load_f32(const char *p) { float v; memcpy(&v, p, 4); return v; }
static inline void mg_store_f32(char *p, float v) { memcpy(p, &v, 4); }

/* f16 <-> f32, round to nearest even like NumPy's float16 cast */
#if defined(__F16C__)
#include <immintrin.h>
static inline uint16_t mg_fp32_to_fp16(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
static inline float mg_fp16_to_fp32(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline uint32_t mg_f_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float mg_bits_f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t mg_fp32_to_fp16(float fin) {
    /* round-to-nearest-even through the FPU for subnormals, integer rounding for normals */
    uint32_t f = mg_f_bits(fin);
    uint32_t sign = f & 0x80000000u;
    uint16_t o;
    f ^= sign;
    if (f >= (uint32_t)(127 + 16) << 23) {            /* >= 65536, inf or nan */
        o = f > 0x7f800000u ? (uint16_t)(0x7e00u | ((f >> 13) & 0x3ffu)) : 0x7c00u;
    } else if (f < (uint32_t)113 << 23) {             /* below 2^-14: half subnormal or zero */
        const uint32_t magic = (uint32_t)((127 - 15) + (23 - 10) + 1) << 23;  /* 0.5 */
        float ff = mg_bits_f(f) + mg_bits_f(magic);
        o = (uint16_t)(mg_f_bits(ff) - magic);
    } else {
        uint32_t odd = (f >> 13) & 1u;
        f += ((uint32_t)(15 - 127) << 23) + 0xfffu;
        f += odd;
        o = (uint16_t)(f >> 13);                      /* may carry into inf: correct */
    }
    return (uint16_t)(o | (sign >> 16));
}
static inline float mg_fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else {                                      /* subnormal: man * 2^-24, exact */
            float v = (float)man * 5.9604644775390625e-08f;
            return sign ? -v : v;
        }
    } else {
        u = sign | ((exp + 112) << 23) | (man << 13);
    }
    return mg_bits_f(u);
}
#endif

/* float -> int32 as NumPy does on x86 (trunc toward zero; out of range and NaN -> INT32_MIN) */
static inline int32_t mg_f_to_i32(double x) {
    if (x >= -2147483648.0 && x < 2147483648.0) return (int32_t)x;
    return INT32_MIN;
}

/* exp of f32 (elementwise.c): within 1 ulp, the same bits whether a value goes through the row
 * function (vectorised) or alone; d may alias s */
void mg_exp_row(const float *s, float *d, int64_t n);
float mg_exp(float x);

/* n bytes, the whole lines of dst as streaming stores (copy.c) */
void mg_copy_streaming(char *dst, const char *src, int64_t n);
/* after streaming stores: they are visible before anyone reads them (copy.c) */
void mg_stream_fence(void);
/* a dense copy of rows from wherever src(ctx, r) says row r is, split by bytes between chunks and
 * written with streaming stores (copy.c) */
typedef const char *(*mg_row_source)(const void *ctx, int64_t r);
void mg_copy_rows_streaming(char *dst, int64_t rows, int64_t row_bytes, mg_row_source src, const void *ctx,
                            int ith, int nth);
/* convert (or copy) n elements between strided rows; dst/src strides in bytes */
void mg_convert_row(char *dst, int64_t dnb, int dt, const char *src, int64_t snb, int st, int64_t n);
/* this thread's scratch memory, at least `bytes`, 64-byte aligned, or NULL when it cannot be had
 * (the kernel then takes a path without it): kept and grown on demand for the thread's life
 * (the pool's threads persist), so a reused plan allocates nothing. One kernel call uses it at a
 * time; what it held is gone at the next call (plan.c) */
void *mg_thread_scratch(size_t bytes);

#endif
