/* Index ops: GET_ROWS, SET_ROWS (write-through into the destination), ARANGE.
 * Every index is checked (mg_check_*) before the node writes anything. */
#include "mg.h"

static inline int64_t load_index(const char *p, int type) {
    if (type == MG_I64) { int64_t v; memcpy(&v, p, 8); return v; }
    int32_t v; memcpy(&v, p, 4); return v;
}

/* first index of idx (flat ggml order) outside [0, limit), or 0 when all are fine */
static int check_all(const mg_tensor *idx, int64_t limit, int slot, mg_error *err) {
    for (int64_t i3 = 0; i3 < idx->ne[3]; i3++)
    for (int64_t i2 = 0; i2 < idx->ne[2]; i2++)
    for (int64_t i1 = 0; i1 < idx->ne[1]; i1++)
    for (int64_t i0 = 0; i0 < idx->ne[0]; i0++) {
        int64_t v = load_index(mg_ptr(idx, i0, i1, i2, i3), idx->type);
        if (v < 0 || v >= limit) {
            err->code = MG_ERR_INDEX;
            err->src = slot;
            err->value = v;
            err->limit = limit;
            return 1;
        }
    }
    return 0;
}

/* GET_ROWS: a = src[0] [ne0, n_rows, ne2, ne3] (any strides), b = src[1] i32 [n_get, ne2, ne3] */
int mg_check_get_rows(const mg_node *n, mg_error *err) {
    return check_all(&n->src[1], n->src[0].ne[1], 1, err);
}

/* dst [ne0, n_get, ne2, ne3] contiguous, f32 (from f32/f16) or i32 */
void mg_k_get_rows(const mg_node *n, int ith, int nth) {
    const mg_tensor *a = &n->src[0];
    const mg_tensor *b = &n->src[1];
    const mg_tensor *d = &n->dst;
    int64_t r0, r1;
    mg_split(mg_nrows(d), ith, nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        int64_t i, j, k;
        mg_row_coords(d, r, &i, &j, &k);
        int64_t row = load_index(mg_ptr(b, i, j, k, 0), b->type);
        mg_convert_row(mg_ptr(d, 0, i, j, k), d->nb[0], d->type, mg_ptr(a, 0, row, j, k), a->nb[0], a->type, d->ne[0]);
    }
}

/* SET_ROWS: src[0] = b rows [ne0, n_set, ne2, ne3] f32/f16 (rows dense),
 *           src[1] = c indices i32/i64 [n_set, c1, c2] broadcast modulo over dims 2/3,
 *           src[2] = a the destination (same memory as dst) [ne0, n_rows, ne2, ne3] */
int mg_check_set_rows(const mg_node *n, mg_error *err) {
    return check_all(&n->src[1], n->dst.ne[1], 1, err);
}

/* a short f32 row element by element, as the general loop would, with the count known to the
 * compiler for the short rows of a conv-state store (3 floats: a loop set up per row cost more
 * than the copy) */
static inline void copy_f32_row(float *d, const float *s, int64_t n) {
    switch (n) {
        case 1: d[0] = s[0]; return;
        case 2: d[0] = s[0]; d[1] = s[1]; return;
        case 3: d[0] = s[0]; d[1] = s[1]; d[2] = s[2]; return;
        case 4: d[0] = s[0]; d[1] = s[1]; d[2] = s[2]; d[3] = s[3]; return;
        default: for (int64_t k = 0; k < n; k++) d[k] = s[k]; return;
    }
}

void mg_k_set_rows(const mg_node *n, int ith, int nth) {
    const mg_tensor *b = &n->src[0];
    const mg_tensor *c = &n->src[1];
    const mg_tensor *d = &n->dst;
    if (c->ne[1] <= 0 || c->ne[2] <= 0) return;
    const int64_t ne0 = b->ne[0];
    const int same_f32 = b->type == MG_F32 && d->type == MG_F32 && (ne0 == 1 || (b->nb[0] == 4 && d->nb[0] == 4));
    int64_t r0, r1;
    mg_split(mg_nrows(b), ith, nth, &r0, &r1);
    if (r0 >= r1) return;
    int64_t i1, i2, i3;
    mg_row_coords(b, r0, &i1, &i2, &i3);
    int64_t j2 = i2 % c->ne[1], j3 = i3 % c->ne[2];   /* broadcast coordinates in c, kept incrementally */
    /* the rows' bases for the current (i2, i3) and (j2, j3), moved as the coordinates move: one
     * index load and two additions per row instead of three full address computations */
    const char *bplane = mg_ptr(b, 0, 0, i2, i3);
    char *dplane = mg_ptr(d, 0, 0, i2, i3);
    const char *cplane = mg_ptr(c, 0, j2, j3, 0);
    const int is64 = c->type == MG_I64;
    for (int64_t r = r0; r < r1; r++) {
        const char *cp = cplane + i1 * c->nb[0];
        const int64_t row = is64 ? *(const int64_t *)cp : *(const int32_t *)cp;
        char *dst = dplane + row * d->nb[1];             /* [ne0] */
        const char *src = bplane + i1 * b->nb[1];        /* [ne0] */
        if (same_f32) copy_f32_row((float *)dst, (const float *)src, ne0);
        else mg_convert_row(dst, d->nb[0], d->type, src, b->nb[0], b->type, ne0);
        if (++i1 == b->ne[1]) {
            i1 = 0;
            if (++j2 == c->ne[1]) j2 = 0;
            if (++i2 == b->ne[2]) {
                i2 = 0; j2 = 0;
                ++i3;
                if (++j3 == c->ne[2]) j3 = 0;
            }
            if (r + 1 < r1) {
                bplane = mg_ptr(b, 0, 0, i2, i3);
                dplane = mg_ptr(d, 0, 0, i2, i3);
                cplane = mg_ptr(c, 0, j2, j3, 0);
            }
        }
    }
}

/* ARANGE: dst f32 [n]: start + step * i, rounded after the product and after the sum */
void mg_k_arange(const mg_node *n, int ith, int nth) {
    const mg_tensor *d = &n->dst;
    const float start = n->fp[0], step = n->fp[2];   /* params start, stop, step */
    int64_t r0, r1;
    mg_split(d->ne[0], ith, nth, &r0, &r1);
    for (int64_t i = r0; i < r1; i++) {
        volatile float p = step * (float)i;   /* two roundings, as NumPy does */
        mg_store_f32(d->data + i * d->nb[0], start + p);
    }
}

MG_KERNEL(GET_ROWS, mg_k_get_rows, mg_check_get_rows)

/* GET_ROWS:side_copy, GET_ROWS for a gather whose output nobody reads during the compute (the
 * undo journal's copy of cache rows that a later node reads and overwrites in place, made just
 * before that node: models/graph.py build_rs). The same bytes as GET_ROWS, for rows of one type
 * with dense rows (the backend checks): the chunks split the output's bytes in 4 KiB units, not
 * its rows (a decode step gathers one row of hundreds of KiB per sequence), and the output goes
 * out as streaming stores, which neither read the destination lines first nor evict the source
 * rows, which the reader that follows then finds in the cache. */
static const char *indexed_row(const void *ctx, int64_t r) {
    const mg_node *n = ctx;
    int64_t i, j, k;
    mg_row_coords(&n->dst, r, &i, &j, &k);
    return mg_ptr(&n->src[0], 0, load_index(mg_ptr(&n->src[1], i, j, k, 0), n->src[1].type), j, k);
}

void mg_k_get_rows_side_copy(const mg_node *n, int ith, int nth) {   /* dst is contiguous */
    mg_copy_rows_streaming(n->dst.data, mg_nrows(&n->dst), n->dst.nb[1], indexed_row, n, ith, nth);
}

/* GET_ROWS:in_scan, a side copy that the scan reading the same rows makes itself, head by head
 * as it reads them (the record's side pointer, ssm.c): this record only checks the indices */
static void mg_k_get_rows_in_scan(const mg_node *n, int ith, int nth) {
    (void)n; (void)ith; (void)nth;
}

__attribute__((constructor)) static void mg_register_get_rows_side_copy(void) {
    mg_register_kernel("GET_ROWS:side_copy", mg_k_get_rows_side_copy, mg_check_get_rows);
    mg_register_kernel("GET_ROWS:in_scan", mg_k_get_rows_in_scan, mg_check_get_rows);
}

MG_KERNEL(SET_ROWS, mg_k_set_rows, mg_check_set_rows)
MG_KERNEL(ARANGE, mg_k_arange, NULL)
