/* Copies that move data: CPY (with type conversion) / CONT, CONCAT, REPEAT. */
#include <stdlib.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>   /* the streaming copy at the end */
#endif
#include "mg.h"
#include "quant.h"
#include "simd_transpose.h"

#define CONV_LOOP(DT, ST, EXPR)                                                      \
    do {                                                                             \
        if (dnb == (int64_t)sizeof(DT) && snb == (int64_t)sizeof(ST)) {              \
            DT *d_ = (DT *)dst; const ST *s_ = (const ST *)src;                      \
            for (int64_t i = 0; i < n; i++) { ST x = s_[i]; d_[i] = (EXPR); }        \
        } else {                                                                     \
            for (int64_t i = 0; i < n; i++) {                                        \
                ST x; DT y;                                                          \
                memcpy(&x, src + i * snb, sizeof(ST));                               \
                y = (EXPR);                                                          \
                memcpy(dst + i * dnb, &y, sizeof(DT));                               \
            }                                                                        \
        }                                                                            \
    } while (0)

/* dst: n elements of type dt at stride dnb; src: n elements of type st at stride snb */
void mg_convert_row(char *dst, int64_t dnb, int dt, const char *src, int64_t snb, int st, int64_t n) {
    if (mg_blck_size(st) > 1 || mg_blck_size(dt) > 1) {
        /* block types: whole rows only (dense by the shape rules) */
        if (dt == st) memcpy(dst, src, (size_t)mg_row_bytes(st, n));
        else if (dt == MG_F32 && dnb == 4) mg_to_f32_row(st, src, (float *)dst, n);
        else if (st == MG_F32) mg_from_f32_row(dt, src, snb, dst, n);
        return;
    }
    if (st == MG_BF16 || dt == MG_BF16) {   /* bf16 <-> f32 (and bf16 -> bf16 below) */
        if (st == MG_BF16 && dt == MG_F32) { CONV_LOOP(float, uint16_t, mg_bf16_to_fp32(x)); return; }
        if (st == MG_F32 && dt == MG_BF16) { CONV_LOOP(uint16_t, float, mg_fp32_to_bf16(x)); return; }
    }
    if (dt == st) {
        int es = mg_type_size(dt);
        if (dnb == es && snb == es) { memcpy(dst, src, (size_t)(n * es)); return; }
        switch (es) {
            case 2: CONV_LOOP(uint16_t, uint16_t, x); return;
            case 8: CONV_LOOP(uint64_t, uint64_t, x); return;
            default: CONV_LOOP(uint32_t, uint32_t, x); return;
        }
    }
    if (st == MG_F32 && dt == MG_F16) {
#if defined(__F16C__) && defined(__AVX__)
        if (dnb == 2 && snb == 4) {
            int64_t i = 0;
            for (; i + 8 <= n; i += 8) {
                __m256 v = _mm256_loadu_ps((const float *)src + i);
                _mm_storeu_si128((__m128i *)((uint16_t *)dst + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
            }
            for (; i < n; i++) ((uint16_t *)dst)[i] = mg_fp32_to_fp16(((const float *)src)[i]);
            return;
        }
#endif
        CONV_LOOP(uint16_t, float, mg_fp32_to_fp16(x)); return;
    }
    if (st == MG_F16 && dt == MG_F32) {
#if defined(__F16C__) && defined(__AVX__)
        if (dnb == 4 && snb == 2) {
            int64_t i = 0;
            for (; i + 8 <= n; i += 8) {
                __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)src + i));
                _mm256_storeu_ps((float *)dst + i, _mm256_cvtph_ps(h));
            }
            for (; i < n; i++) ((float *)dst)[i] = mg_fp16_to_fp32(((const uint16_t *)src)[i]);
            return;
        }
#endif
        CONV_LOOP(float, uint16_t, mg_fp16_to_fp32(x)); return;
    }
    if (st == MG_F32 && dt == MG_I32) { CONV_LOOP(int32_t, float, mg_f_to_i32((double)x)); return; }
    if (st == MG_I32 && dt == MG_F32) { CONV_LOOP(float, int32_t, (float)x); return; }
    if (st == MG_F16 && dt == MG_I32) { CONV_LOOP(int32_t, uint16_t, mg_f_to_i32((double)mg_fp16_to_fp32(x))); return; }
    /* int32 -> f32 is exact below 2^24 and beyond 65520 both roundings give inf: one rounding */
    if (st == MG_I32 && dt == MG_F16) { CONV_LOOP(uint16_t, int32_t, mg_fp32_to_fp16((float)x)); return; }
    /* other pairs are refused by the shape rule; leave dst untouched */
}

/* 2-D blocked transpose for one plane: dst rows dense along dim 0, src dense along dim 1.
 * dst: [ne0, ne1] at (es, dnb1); src: [ne0, ne1] at (snb0, es) */
static void transpose_plane(char *dst, int64_t dnb1, const char *src, int64_t snb0,
                            int64_t ne0, int64_t i1a, int64_t i1b, int es) {
    const int64_t B = 32;
    for (int64_t j0 = i1a; j0 < i1b; j0 += B) {
        int64_t j1 = mg_min64(j0 + B, i1b);
        for (int64_t k0 = 0; k0 < ne0; k0 += B) {
            int64_t k1 = mg_min64(k0 + B, ne0);
            if (es == 4) {
                int64_t j = j0;
#if defined(__AVX2__)
                /* 8x8 tiles through registers: 8 loads of 8 source elements (dense along dim 1),
                 * 8 stores of 8 destination elements, instead of 64 single moves */
                for (; j + 8 <= j1; j += 8) {
                    int64_t k = k0;
                    for (; k + 8 <= k1; k += 8) {
                        __m256i v[8];
                        for (int r = 0; r < 8; r++)
                            v[r] = _mm256_loadu_si256((const __m256i *)(src + (k + r) * snb0 + j * 4));
                        mg_transpose8x8_epi32(v);
                        for (int r = 0; r < 8; r++)
                            _mm256_storeu_si256((__m256i *)(dst + (j + r) * dnb1 + k * 4), v[r]);
                    }
                    for (int64_t jj = j; jj < j + 8; jj++)        /* the block's last k (< 8) */
                        for (int64_t kk = k; kk < k1; kk++)
                            memcpy(dst + jj * dnb1 + kk * 4, src + kk * snb0 + jj * 4, 4);
                }
#endif
                for (; j < j1; j++) {
                    uint32_t *d = (uint32_t *)(dst + j * dnb1);
                    for (int64_t k = k0; k < k1; k++) memcpy(&d[k], src + k * snb0 + j * 4, 4);
                }
            } else {
                for (int64_t j = j0; j < j1; j++)
                    for (int64_t k = k0; k < k1; k++)
                        memcpy(dst + j * dnb1 + k * es, src + k * snb0 + j * es, (size_t)es);
            }
        }
    }
}

/* n 4-byte elements at stride snb into a dense run, inline: the rows a decode step moves are often
 * a few elements each (a conv layer's d_conv - 1 columns of history per channel, thousands of
 * channels), where a call per row, or per element, costs more than the copy */
static inline void copy_row4(char *restrict dst, const char *restrict src, int64_t snb, int64_t n) {
    if (snb == 4 && n > 16) {
        memcpy(dst, src, (size_t)(n * 4));
        return;
    }
    for (int64_t k = 0; k < n; k++)
        memcpy(dst + k * 4, src + k * snb, 4);
}

/* CPY / CONT: src[0] a (any strides) -> dst (any strides), same element count, copied in
 * logical (flattened ggml) order with type conversion.
 *   a:   [ne00, ne01, ne02, ne03]
 *   dst: [ne0,  ne1,  ne2,  ne3 ] */
void mg_k_cpy(const mg_node *n, int ith, int nth) {
    /* a state store the scan before it already wrote in place (ssm.c: store_ok) */
    if (n->stored && __atomic_load_n(n->stored, __ATOMIC_RELAXED)) return;
    const mg_tensor *a = &n->src[0];
    const mg_tensor *d = &n->dst;
    const int st = a->type, dt = d->type;
    const int64_t nel = mg_nelements(d);
    const int same_shape = a->ne[0] == d->ne[0] && a->ne[1] == d->ne[1] && a->ne[2] == d->ne[2] && a->ne[3] == d->ne[3];

    if (mg_blck_size(st) > 1 || mg_blck_size(dt) > 1) {
        /* to or from blocks: the shape rules give whole-block source rows and a contiguous
         * destination, so source row r starts at value r * ne00 of the destination */
        int64_t r0, r1;
        mg_split(mg_nrows(a), ith, nth, &r0, &r1);
        int64_t i1 = 0, i2 = 0, i3 = 0;   /* row coordinates, moved row by row (no divisions) */
        if (r0 < r1) mg_row_coords(a, r0, &i1, &i2, &i3);
        for (int64_t r = r0; r < r1; r++, mg_row_next(a, &i1, &i2, &i3)) {
            const int64_t off = (r * a->ne[0]) / mg_blck_size(dt) * mg_type_size(dt);
            mg_convert_row(d->data + off, mg_type_size(dt), dt, mg_ptr(a, 0, i1, i2, i3), a->nb[0], st, a->ne[0]);
        }
        return;
    }
    if (mg_is_contiguous(a) && mg_is_contiguous(d)) {
        /* one flat range, split across threads */
        int64_t r0, r1;
        const int64_t chunk = 4096;
        mg_split((nel + chunk - 1) / chunk, ith, nth, &r0, &r1);
        int64_t e0 = r0 * chunk, e1 = mg_min64(r1 * chunk, nel);
        if (e1 > e0)
            mg_convert_row(d->data + e0 * mg_type_size(dt), mg_type_size(dt),
                           dt, a->data + e0 * mg_type_size(st), mg_type_size(st), st, e1 - e0);
        return;
    }
    if (same_shape) {
        const int es = mg_type_size(dt);
        /* transposed source (dense along dim 1), same type, dst rows dense: blocked transpose */
        if (st == dt && a->ne[1] > 1 && a->ne[0] > 1 && a->nb[1] == es && d->nb[0] == es) {
            const int64_t planes = a->ne[2] * a->ne[3];
            const int64_t B = 32;
            const int64_t nblk = (a->ne[1] + B - 1) / B;
            int64_t r0, r1;
            mg_split(planes * nblk, ith, nth, &r0, &r1);
            for (int64_t r = r0; r < r1; r++) {
                int64_t p = r / nblk, blk = r % nblk;
                int64_t i2 = p % a->ne[2], i3 = p / a->ne[2];
                transpose_plane(mg_ptr(d, 0, 0, i2, i3), d->nb[1], mg_ptr(a, 0, 0, i2, i3), a->nb[0],
                                a->ne[0], blk * B, mg_min64((blk + 1) * B, a->ne[1]), es);
            }
            return;
        }
        /* row by row */
        int64_t r0, r1;
        mg_split(mg_nrows(d), ith, nth, &r0, &r1);
        int64_t i1 = 0, i2 = 0, i3 = 0;   /* row coordinates, moved row by row (no divisions) */
        if (r0 < r1) mg_row_coords(d, r0, &i1, &i2, &i3);
        for (int64_t r = r0; r < r1; r++, mg_row_next(d, &i1, &i2, &i3)) {
            mg_convert_row(mg_ptr(d, 0, i1, i2, i3), d->nb[0], dt, mg_ptr(a, 0, i1, i2, i3), a->nb[0], st, d->ne[0]);
        }
        return;
    }
    int64_t r0, r1;
    mg_split(mg_nrows(a), ith, nth, &r0, &r1);
    if (r0 >= r1) return;
    if (st == dt && mg_type_size(st) == 4 && d->nb[0] == 4) {
        /* same 4-byte type into dense destination rows, each source row inside one of them (a conv
         * layer's history store: rows of d_conv - 1 elements, one per channel, into a cache row or
         * a contiguous tensor): inline copies, pointers stepped, the shapes read once (the rows'
         * byte stores could alias them) */
        const mg_tensor ta = *a, td = *d;
        const int64_t ne00 = ta.ne[0], snb0 = ta.nb[0];
        const int flat = mg_is_contiguous(&td);
        const int64_t L = flat ? nel : td.ne[0];     /* elements per dense destination row */
        if (ne00 > 0 && L % ne00 == 0) {
            int64_t q = r0 * ne00 / L, c0 = r0 * ne00 % L, c1 = 0, c2 = 0, c3 = 0;
            if (!flat) { c1 = q % td.ne[1]; q /= td.ne[1]; c2 = q % td.ne[2]; c3 = q / td.ne[2]; }
            char *dp = flat ? td.data + r0 * ne00 * 4 : mg_ptr(&td, c0, c1, c2, c3);
            int64_t i1 = 0, i2 = 0, i3 = 0;
            mg_row_coords(&ta, r0, &i1, &i2, &i3);
            for (int64_t r = r0; r < r1;) {   /* runs of rows along dim 1: the source steps by nb[1] */
                const int64_t run = mg_min64(r1 - r, ta.ne[1] - i1);
                const char *sp = mg_ptr(&ta, 0, i1, i2, i3);
                for (int64_t k = 0; k < run; k++, sp += ta.nb[1]) {
                    copy_row4(dp, sp, snb0, ne00);
                    dp += ne00 * 4;
                    if ((c0 += ne00) == L && !flat) {   /* the next destination row */
                        c0 = 0;
                        if (++c1 == td.ne[1]) {
                            c1 = 0;
                            if (++c2 == td.ne[2]) { c2 = 0; ++c3; }
                        }
                        dp = mg_ptr(&td, 0, c1, c2, c3);
                    }
                }
                r += run;
                i1 = ta.ne[1] - 1;   /* the run's last row: step to the next plane's first */
                mg_row_next(&ta, &i1, &i2, &i3);
            }
            return;
        }
    }
    /* general: walk the source rows; the destination coordinates follow the flat index */
    const int64_t ne00 = a->ne[0];
    int64_t flat = r0 * ne00;
    int64_t c0 = flat % d->ne[0], q = flat / d->ne[0];
    int64_t c1 = q % d->ne[1];  q /= d->ne[1];
    int64_t c2 = q % d->ne[2];
    int64_t c3 = q / d->ne[2];
    int64_t i1 = 0, i2 = 0, i3 = 0;   /* row coordinates, moved row by row (no divisions) */
    if (r0 < r1) mg_row_coords(a, r0, &i1, &i2, &i3);
    for (int64_t r = r0; r < r1; r++, mg_row_next(a, &i1, &i2, &i3)) {
        const char *srow = mg_ptr(a, 0, i1, i2, i3);
        int64_t i0 = 0;
        while (i0 < ne00) {
            /* the longest run that stays within one destination row */
            int64_t run = mg_min64(ne00 - i0, d->ne[0] - c0);
            mg_convert_row(mg_ptr(d, c0, c1, c2, c3), d->nb[0], dt, srow + i0 * a->nb[0], a->nb[0], st, run);
            i0 += run;
            c0 += run;
            if (c0 == d->ne[0]) {
                c0 = 0;
                if (++c1 == d->ne[1]) {
                    c1 = 0;
                    if (++c2 == d->ne[2]) { c2 = 0; ++c3; }
                }
            }
        }
    }
}

/* CONCAT along ip[0]: a [ne00..] and b [ne10..], any strides, same type -> dst contiguous */
void mg_k_concat(const mg_node *n, int ith, int nth) {
    const mg_tensor *a = &n->src[0];
    const mg_tensor *b = &n->src[1];
    const mg_tensor *d = &n->dst;
    const int dim = (int)n->ip[0];
    const int t = d->type;
    int64_t r0, r1;
    mg_split(mg_nrows(d), ith, nth, &r0, &r1);
    int64_t i1 = 0, i2 = 0, i3 = 0;   /* row coordinates, moved row by row: a decode step's rows are a
                                       * few elements each, and two divisions per row cost more */
    if (r0 < r1) mg_row_coords(d, r0, &i1, &i2, &i3);
    if (dim == 0 && mg_type_size(t) == 4 && d->nb[0] == 4) {
        /* 4-byte elements into a dense row, inline: the conv inputs of a decode step are many
         * rows of a few elements (d_conv - 1 of history + 1), where a call per row dominated.
         * The shapes and strides are read once: the rows' byte stores could alias them */
        const mg_tensor ta = *a, tb = *b, td = *d;
        /* a transposed source (dense along dim 1: a prefill's tokens, transposed to meet a conv
         * layer's history) goes through CONT's 8x8 register tiles (transpose_plane): element by
         * element, every value read a cache line and a page of its own (a 515 x 6144 conv input,
         * 1 thread: 10.6 ms against 1.55) */
        const int a_t = ta.ne[0] >= 8 && ta.nb[1] == 4, b_t = tb.ne[0] >= 8 && tb.nb[1] == 4;
        for (int64_t r = r0; r < r1;) {   /* runs of rows along dim 1: pointers step by nb[1] */
            const int64_t run = mg_min64(r1 - r, td.ne[1] - i1);
            char *pd = mg_ptr(&td, 0, i1, i2, i3);
            const char *pa = mg_ptr(&ta, 0, i1, i2, i3), *pb = mg_ptr(&tb, 0, i1, i2, i3);
            if (a_t)
                transpose_plane(mg_ptr(&td, 0, 0, i2, i3), td.nb[1], mg_ptr(&ta, 0, 0, i2, i3), ta.nb[0], ta.ne[0], i1,
                                i1 + run, 4);
            if (b_t)
                transpose_plane(mg_ptr(&td, ta.ne[0], 0, i2, i3), td.nb[1], mg_ptr(&tb, 0, 0, i2, i3), tb.nb[0], tb.ne[0],
                                i1, i1 + run, 4);
            if (!a_t || !b_t)
                for (int64_t k = 0; k < run; k++, pd += td.nb[1], pa += ta.nb[1], pb += tb.nb[1]) {
                    if (!a_t) copy_row4(pd, pa, ta.nb[0], ta.ne[0]);
                    if (!b_t) copy_row4(pd + ta.ne[0] * 4, pb, tb.nb[0], tb.ne[0]);
                }
            r += run;
            i1 = td.ne[1] - 1;   /* the run's last row: step to the next plane's first */
            mg_row_next(&td, &i1, &i2, &i3);
        }
        return;
    }
    for (int64_t r = r0; r < r1; r++, mg_row_next(d, &i1, &i2, &i3)) {
        int64_t i[4] = {0, i1, i2, i3};
        char *drow = mg_ptr(d, 0, i[1], i[2], i[3]);
        if (dim == 0) {
            mg_convert_row(drow, d->nb[0], t, mg_ptr(a, 0, i[1], i[2], i[3]), a->nb[0], t, a->ne[0]);
            mg_convert_row(drow + a->ne[0] * d->nb[0], d->nb[0], t, mg_ptr(b, 0, i[1], i[2], i[3]), b->nb[0], t, b->ne[0]);
        } else if (i[dim] < a->ne[dim]) {
            mg_convert_row(drow, d->nb[0], t, mg_ptr(a, 0, i[1], i[2], i[3]), a->nb[0], t, d->ne[0]);
        } else {
            i[dim] -= a->ne[dim];
            mg_convert_row(drow, d->nb[0], t, mg_ptr(b, 0, i[1], i[2], i[3]), b->nb[0], t, d->ne[0]);
        }
    }
}

/* REPEAT: dst[i] = a[i mod a.ne]; a [ne00..] any strides -> dst contiguous */
void mg_k_repeat(const mg_node *n, int ith, int nth) {
    const mg_tensor *a = &n->src[0];
    const mg_tensor *d = &n->dst;
    const int t = d->type;
    if (mg_nelements(a) <= 0) return;
    int64_t r0, r1;
    mg_split(mg_nrows(d), ith, nth, &r0, &r1);
    int64_t i1 = 0, i2 = 0, i3 = 0;   /* row coordinates, moved row by row (no divisions) */
    if (r0 < r1) mg_row_coords(d, r0, &i1, &i2, &i3);
    for (int64_t r = r0; r < r1; r++, mg_row_next(d, &i1, &i2, &i3)) {
        char *drow = mg_ptr(d, 0, i1, i2, i3);
        const char *srow = mg_ptr(a, 0, i1 % a->ne[1], i2 % a->ne[2], i3 % a->ne[3]);
        for (int64_t k = 0; k < d->ne[0]; k += a->ne[0])
            mg_convert_row(drow + k * d->nb[0], d->nb[0], t, srow, a->nb[0], t, mg_min64(a->ne[0], d->ne[0] - k));
    }
}

MG_KERNEL(CPY, mg_k_cpy, NULL)
MG_KERNEL(CONT, mg_k_cpy, NULL)
MG_KERNEL(CONCAT, mg_k_concat, NULL)
MG_KERNEL(REPEAT, mg_k_repeat, NULL)

/* ---- a streaming copy (not an op: the undo journal's, through the cffi API) ----
 * The bytes of dst up to its first 64-byte boundary and after its last one go through memcpy,
 * the rest as streaming stores, which write whole lines without reading them first (a plain
 * copy reads each destination line before writing it: half again the traffic) and leave the
 * caches to the data the next graph reads. */
void mg_copy_streaming(char *dst, const char *src, int64_t n) {
#if defined(__AVX512F__) || defined(__AVX2__)
    const int64_t head = (int64_t)((64 - ((uintptr_t)dst & 63)) & 63);
    if (n < head + 256) { memcpy(dst, src, (size_t)n); return; }
    memcpy(dst, src, (size_t)head);
    int64_t i = head;
    for (; i + 64 <= n; i += 64) {
#if defined(__AVX512F__)
        _mm512_stream_si512((__m512i *)(dst + i), _mm512_loadu_si512((const void *)(src + i)));
#else
        _mm256_stream_si256((__m256i *)(dst + i), _mm256_loadu_si256((const __m256i *)(src + i)));
        _mm256_stream_si256((__m256i *)(dst + i + 32), _mm256_loadu_si256((const __m256i *)(src + i + 32)));
#endif
    }
    memcpy(dst + i, src + i, (size_t)(n - i));
#else
    memcpy(dst, src, (size_t)n);
#endif
}

void mg_stream_fence(void) {
#if defined(__AVX512F__) || defined(__AVX2__)
    _mm_sfence();
#endif
}

/* rows dense rows of row_bytes into dst, row r read from src(ctx, r), as chunk ith of nth: the
 * chunks split dst's bytes in 4 KiB units (a copy of a few rows of hundreds of KiB still splits),
 * each unit written with streaming stores */
void mg_copy_rows_streaming(char *dst, int64_t rows, int64_t row_bytes, mg_row_source src, const void *ctx,
                            int ith, int nth) {
    const int64_t total = rows * row_bytes;
    int64_t u0, u1;
    mg_split((total + 4095) / 4096, ith, nth, &u0, &u1);
    int64_t b = u0 * 4096;
    const int64_t end = mg_min64(u1 * 4096, total);
    while (b < end) {
        const int64_t r = b / row_bytes, off = b % row_bytes, len = mg_min64(row_bytes - off, end - b);
        mg_copy_streaming(dst + b, src(ctx, r) + off, len);
        b += len;
    }
    mg_stream_fence();
}

/* CPY:save_rows, the undo journal's copy as one plan record, so that the executor's threads share
 * it (a decode step's journal is tens of MB, bound by memory bandwidth, which two cores have more
 * of than one): dst.data the dense destination, src[0].data the first row, ip = {source stride,
 * rows, bytes per row}. */
static const char *strided_row(const void *ctx, int64_t r) {
    const mg_node *nd = ctx;
    return nd->src[0].data + r * nd->ip[0];
}

static void mg_k_save_rows(const mg_node *nd, int ith, int nth) {
    mg_copy_rows_streaming(nd->dst.data, nd->ip[1], nd->ip[2], strided_row, nd, ith, nth);
}

__attribute__((constructor)) static void mg_register_save_rows(void) {
    mg_register_kernel("CPY:save_rows", mg_k_save_rows, NULL);
}
