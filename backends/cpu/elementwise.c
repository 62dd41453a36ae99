/* Elementwise f32 ops: unary math, binary ops with ggml broadcasting (b tiles a by modulo),
 * SCALE (x*s, or x*s + b when b != 0). Rows are dense along dim 0 (nb0 == 4) by the shape
 * rules; dst is a fresh contiguous tensor or, in place, a view of a (same strides).
 *
 * A unary op is one MG_UNARY line (its registry name and the f32 expression of x), or, for the
 * exp-based ops, one MG_UNARY_ROW line with a row function (vectorised exp below). */
#include "mg.h"

/* ---- exp in f32, vectorised ----
 * exp(x) = 2^n * p(r): n = x*log2(e) rounded to the nearest integer in the same FMA that adds
 * 1.5*2^23 (n is then in z's low mantissa bits), r = x - n*ln2 (two FMA steps, ln2 split in a
 * float and its remainder), p a degree-6 polynomial fitted to exp on [-ln2/2, ln2/2] (relative
 * error 1.7e-8 with its coefficients rounded to f32), evaluated by Horner with FMA.
 * Scaling: when |n| <= 125 (the result is a normal number) n is added to p's exponent bits, which
 * is exact. Otherwise (also NaN) x is clamped to [-104, 89] (exp rounds to 0 below and to inf
 * above), the same steps are redone, and 2^n is applied as two exact powers of two (2^(n>>1), then
 * 2^(n-(n>>1))): overflow gives inf, a subnormal result is rounded once, NaN stays NaN. For |n| <= 125
 * both scalings give the same bits, so a lane's result does not depend on its neighbours. The
 * AVX-512 form clamps every lane and scales by vscalefps, which gives those same bits without the
 * test and branch (SILU [4096, 64], 1 thread, Zen 4: 82.6 -> 62.6 us; ggml 85.0).
 * Measured: at most 1 ulp from float64 exp rounded to f32 (tests/test_exp_ulp.py checks <= 2 over
 * random and edge inputs). Every path (AVX-512, AVX2, the scalar loop for row tails and non-AVX
 * builds) does the same operations in the same order with the same roundings (fmaf is the same
 * fused operation), so a value does not depend on its position in a row: batch invariance holds. */
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define EXP_LO -104.0f
#define EXP_HI 89.0f
#define EXP_MAGIC 12582912.0f                         /* 1.5 * 2^23 */
#define EXP_LOG2E 1.44269502162933349609375f          /* float(log2(e)) */
#define EXP_LN2_HI 0.693147182464599609375f           /* float(ln 2) */
#define EXP_LN2_LO -1.904654323148236e-09f            /* ln 2 - EXP_LN2_HI */
#define EXP_C2 4.999999106e-01f
#define EXP_C3 1.666641980e-01f
#define EXP_C4 4.166822508e-02f
#define EXP_C5 8.374815807e-03f
#define EXP_C6 1.383684576e-03f

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* p(r) and z for x (the shared core) */
static inline float exp1_core(float x, float *zo) {
    const float z = fmaf(x, EXP_LOG2E, EXP_MAGIC);
    const float nf = z - EXP_MAGIC;
    float r = fmaf(-nf, EXP_LN2_HI, x);
    r = fmaf(-nf, EXP_LN2_LO, r);
    float p = EXP_C6;
    p = fmaf(p, r, EXP_C5);
    p = fmaf(p, r, EXP_C4);
    p = fmaf(p, r, EXP_C3);
    p = fmaf(p, r, EXP_C2);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    *zo = z;
    return p;
}

static inline float exp1(float x) {
    float z;
    float p = exp1_core(x, &z);
    const float nf = z - EXP_MAGIC;
    if (fabsf(nf) <= 125.0f) return u2f(f2u(p) + (f2u(z) << 23));
    if (x != x) return x;
    x = x < EXP_HI ? x : EXP_HI;
    x = x > EXP_LO ? x : EXP_LO;
    p = exp1_core(x, &z);
    const int32_t n = (int32_t)(f2u(z) - f2u(EXP_MAGIC)), n1 = n >> 1;
    return (p * u2f((uint32_t)(n1 + 127) << 23)) * u2f((uint32_t)(n - n1 + 127) << 23);
}

/* the vector forms' shared core: z and p from x (the scaling is each form's own) */
#define EXP_CORE_VEC(V, P, SUF)                                                                     \
    static inline V exp_core_##SUF(V x, V *zo) {                                                   \
        const V z = P##_fmadd_ps(x, P##_set1_ps(EXP_LOG2E), P##_set1_ps(EXP_MAGIC));               \
        const V nf = P##_sub_ps(z, P##_set1_ps(EXP_MAGIC));                                        \
        V r = P##_fnmadd_ps(nf, P##_set1_ps(EXP_LN2_HI), x);                                       \
        r = P##_fnmadd_ps(nf, P##_set1_ps(EXP_LN2_LO), r);                                         \
        V p = P##_set1_ps(EXP_C6);                                                                 \
        p = P##_fmadd_ps(p, r, P##_set1_ps(EXP_C5));                                               \
        p = P##_fmadd_ps(p, r, P##_set1_ps(EXP_C4));                                               \
        p = P##_fmadd_ps(p, r, P##_set1_ps(EXP_C3));                                               \
        p = P##_fmadd_ps(p, r, P##_set1_ps(EXP_C2));                                               \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f));                                                 \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f));                                                 \
        *zo = z;                                                                                   \
        return p;                                                                                  \
    }

#if defined(__AVX2__) && defined(__FMA__)
EXP_CORE_VEC(__m256, _mm256, 256)
/* the AVX2 form's slow path (a lane with |n| > 125, or NaN): clamped, 2^n as two exact powers of two */
static inline __m256 exp_slow_256(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(EXP_HI), x);     /* min/max return x when it is NaN */
    x = _mm256_max_ps(_mm256_set1_ps(EXP_LO), x);
    __m256 z;
    const __m256 p = exp_core_256(x, &z);
    const __m256i n = _mm256_sub_epi32(_mm256_castps_si256(z), _mm256_set1_epi32((int)0x4b400000));
    const __m256i n1 = _mm256_srai_epi32(n, 1), n2 = _mm256_sub_epi32(n, n1);
    const __m256i b = _mm256_set1_epi32(127);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, b), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, b), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}
static inline __m256 exp8(__m256 x) {
    __m256 z;
    const __m256 p = exp_core_256(x, &z);
    const __m256 nf = _mm256_sub_ps(z, _mm256_set1_ps(EXP_MAGIC));
    const __m256 big = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), nf), _mm256_set1_ps(125.0f), _CMP_NLE_UQ);
    const __m256 fast = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p),
                                                             _mm256_slli_epi32(_mm256_castps_si256(z), 23)));
    if (__builtin_expect(_mm256_movemask_ps(big) != 0, 0)) {
        /* lanes at or below EXP_LO (-inf: a masked attention score) are +0 on the slow path too */
        const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_LE_OQ);
        if (_mm256_movemask_ps(_mm256_andnot_ps(under, big)) != 0) return exp_slow_256(x);
        return _mm256_andnot_ps(under, fast);
    }
    return fast;
}
#endif

#if defined(__AVX512F__)
EXP_CORE_VEC(__m512, _mm512, 512)
static inline __m512 exp16(__m512 x) {
    /* clamped, then 2^n by vscalefps: exact for a normal result, one rounding for a subnormal
     * one, inf past the top: the bits of both scalings above, with no branch (min/max return x
     * when it is NaN, and scalef keeps the NaN) */
    x = _mm512_min_ps(_mm512_set1_ps(EXP_HI), x);
    x = _mm512_max_ps(_mm512_set1_ps(EXP_LO), x);
    __m512 z;
    const __m512 p = exp_core_512(x, &z);
    return _mm512_scalef_ps(p, _mm512_sub_ps(z, _mm512_set1_ps(EXP_MAGIC)));
}
#endif

/* the exp-based unary ops, per element: the scalar form and (V = 8 or 16 lanes) the vector form,
 * the same operations in the same order. SOFTPLUS vectorises its exp and 1 + e; the log is libm's. */
static inline float s_exp(float x)     { return exp1(x); }
static inline float s_sigmoid(float x) { return 1.0f / (1.0f + exp1(-x)); }
static inline float s_silu(float x)    { return x / (1.0f + exp1(-x)); }

#if defined(__AVX512F__)
static inline __m512 xor512(__m512 a, __m512 b) {   /* AVX512F alone has no _mm512_xor_ps */
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_castps_si512(b)));
}
#endif

/* dst row d = f(src row s), n floats, s == d allowed (-x is a sign flip in both forms) */
#if defined(__AVX512F__)
#define VROW(NAME, VEXPR, SEXPR)                                                          \
    static void row_##NAME(const float *s, float *d, int64_t n) {                         \
        int64_t i = 0;                                                                    \
        for (; i + 16 <= n; i += 16) {                                                    \
            const __m512 x = _mm512_loadu_ps(s + i);                                      \
            const __m512 one = _mm512_set1_ps(1.0f);                                      \
            (void)one;                                                                    \
            _mm512_storeu_ps(d + i, VEXPR(exp16, _mm512_add_ps, _mm512_div_ps, xor512,     \
                                          _mm512_set1_ps(-0.0f)));                        \
        }                                                                                 \
        for (; i < n; i++) { const float x = s[i]; d[i] = SEXPR(x); }                     \
    }
#elif defined(__AVX2__) && defined(__FMA__)
/* two vectors per step: exp's Horner chain and the division are long dependency chains, and
 * two independent ones keep the FMA and divide units busy (each lane's operations unchanged) */
#define VROW(NAME, VEXPR, SEXPR)                                                          \
    static void row_##NAME(const float *s, float *d, int64_t n) {                         \
        int64_t i = 0;                                                                    \
        const __m256 one = _mm256_set1_ps(1.0f);                                          \
        (void)one;                                                                        \
        for (; i + 16 <= n; i += 16) {                                                    \
            __m256 x = _mm256_loadu_ps(s + i);                                            \
            const __m256 y0 = VEXPR(exp8, _mm256_add_ps, _mm256_div_ps, _mm256_xor_ps,    \
                                    _mm256_set1_ps(-0.0f));                               \
            x = _mm256_loadu_ps(s + i + 8);                                               \
            const __m256 y1 = VEXPR(exp8, _mm256_add_ps, _mm256_div_ps, _mm256_xor_ps,    \
                                    _mm256_set1_ps(-0.0f));                               \
            _mm256_storeu_ps(d + i, y0);                                                  \
            _mm256_storeu_ps(d + i + 8, y1);                                              \
        }                                                                                 \
        for (; i + 8 <= n; i += 8) {                                                      \
            const __m256 x = _mm256_loadu_ps(s + i);                                      \
            const __m256 one = _mm256_set1_ps(1.0f);                                      \
            (void)one;                                                                    \
            _mm256_storeu_ps(d + i, VEXPR(exp8, _mm256_add_ps, _mm256_div_ps, _mm256_xor_ps, \
                                          _mm256_set1_ps(-0.0f)));                        \
        }                                                                                 \
        for (; i < n; i++) { const float x = s[i]; d[i] = SEXPR(x); }                     \
    }
#else
#define VROW(NAME, VEXPR, SEXPR)                                                          \
    static void row_##NAME(const float *s, float *d, int64_t n) {                         \
        for (int64_t i = 0; i < n; i++) { const float x = s[i]; d[i] = SEXPR(x); }        \
    }
#endif
#define V_EXP(E, ADD, DIV, XOR, SIGN)     E(x)
#define V_SIGMOID(E, ADD, DIV, XOR, SIGN) DIV(one, ADD(one, E(XOR(SIGN, x))))
#define V_SILU(E, ADD, DIV, XOR, SIGN)    DIV(x, ADD(one, E(XOR(SIGN, x))))
VROW(exp, V_EXP, s_exp)
VROW(sigmoid, V_SIGMOID, s_sigmoid)
VROW(silu, V_SILU, s_silu)
/* 1 + exp(x) for softplus (the log comes after, per element) */
#define V_ONE_PLUS_EXP(E, ADD, DIV, XOR, SIGN) ADD(one, E(x))
static inline float s_one_plus_exp(float x) { return 1.0f + exp1(x); }
VROW(one_plus_exp, V_ONE_PLUS_EXP, s_one_plus_exp)

static void row_softplus(const float *s, float *d, int64_t n) {
    float t[64];
    for (int64_t i0 = 0; i0 < n; i0 += 64) {
        const int64_t m = mg_min64(64, n - i0);
        row_one_plus_exp(s + i0, t, m);
        for (int64_t j = 0; j < m; j++) {
            const float x = s[i0 + j];
            d[i0 + j] = x > 20.0f ? x : logf(t[j]);
        }
    }
}

/* a = src[0] [ne0, ne1, ne2, ne3] f32 -> dst same extents: a row function per op */
#define MG_UNARY_ROW(OP, ROW)                                                       \
    static void mg_k_unary_##OP(const mg_node *n, int ith, int nth) {               \
        const mg_tensor *a = &n->src[0];                                            \
        const mg_tensor *d = &n->dst;                                               \
        int64_t r0, r1;                                                             \
        mg_split(mg_nrows(d), ith, nth, &r0, &r1);                                  \
        int64_t i1 = 0, i2 = 0, i3 = 0;                                             \
        if (r0 < r1) mg_row_coords(d, r0, &i1, &i2, &i3);                           \
        for (int64_t r = r0; r < r1; r++, mg_row_next(d, &i1, &i2, &i3)) {          \
            ROW((const float *)mg_ptr(a, 0, i1, i2, i3),                            \
                (float *)mg_ptr(d, 0, i1, i2, i3), d->ne[0]);                       \
        }                                                                           \
    }                                                                               \
    MG_KERNEL(OP, mg_k_unary_##OP, NULL)

MG_UNARY_ROW(SILU, row_silu)
MG_UNARY_ROW(SIGMOID, row_sigmoid)
MG_UNARY_ROW(SOFTPLUS, row_softplus)
MG_UNARY_ROW(EXP, row_exp)

/* exp of n floats for other kernels (SOFT_MAX): dst may alias src */
void mg_exp_row(const float *s, float *d, int64_t n) { row_exp(s, d, n); }
float mg_exp(float x) { return exp1(x); }

/* a = src[0] [ne0, ne1, ne2, ne3] f32 -> dst same extents: dst = EXPR(x) elementwise. The
 * expression is pasted into the row loop (a kernel per op, no per-element dispatch). */
#define MG_UNARY(OP, EXPR)                                                          \
    static void mg_k_unary_##OP(const mg_node *n, int ith, int nth) {               \
        const mg_tensor *a = &n->src[0];                                            \
        const mg_tensor *d = &n->dst;                                               \
        const int64_t ne0 = d->ne[0];                                               \
        int64_t r0, r1;                                                             \
        mg_split(mg_nrows(d), ith, nth, &r0, &r1);                                  \
        int64_t i1 = 0, i2 = 0, i3 = 0;                                             \
        if (r0 < r1) mg_row_coords(d, r0, &i1, &i2, &i3);                           \
        for (int64_t r = r0; r < r1; r++, mg_row_next(d, &i1, &i2, &i3)) {          \
            const float *s = (const float *)mg_ptr(a, 0, i1, i2, i3); /* [ne0] */   \
            float *dr = (float *)mg_ptr(d, 0, i1, i2, i3);            /* [ne0] */   \
            for (int64_t i = 0; i < ne0; i++) { const float x = s[i]; dr[i] = (EXPR); } \
        }                                                                           \
    }                                                                               \
    MG_KERNEL(OP, mg_k_unary_##OP, NULL)

MG_UNARY(NEG, -x)
MG_UNARY(SQRT, sqrtf(x))

#define BIN_LOOP(OP)                                                             \
    do {                                                                         \
        if (ne10 == ne0) {                                                       \
            for (int64_t i = 0; i < ne0; i++) dr[i] = ar[i] OP br[i];            \
        } else if (ne10 == 1) {                                                  \
            const float bv = br[0];                                              \
            for (int64_t i = 0; i < ne0; i++) dr[i] = ar[i] OP bv;               \
        } else {                                                                 \
            for (int64_t k = 0; k < ne0; k += ne10)                              \
                for (int64_t i = 0; i < ne10; i++) dr[k + i] = ar[k + i] OP br[i]; \
        }                                                                        \
    } while (0)

/* a = src[0] [ne0, ne1, ne2, ne3], b = src[1] [ne10, ne11, ne12, ne13] (each divides a's):
 * dst = a OP b, b read at each coordinate modulo its extents */
#define MG_BINARY(NAME, OP)                                                                          \
    static void mg_k_binary_##NAME(const mg_node *n, int ith, int nth) {                             \
        const mg_tensor *a = &n->src[0];                                                             \
        const mg_tensor *b = &n->src[1];                                                             \
        const mg_tensor *d = &n->dst;                                                                \
        const int64_t ne0 = d->ne[0], ne10 = b->ne[0];                                               \
        if (ne10 <= 0 || b->ne[1] <= 0 || b->ne[2] <= 0 || b->ne[3] <= 0) return;                    \
        int64_t r0, r1;                                                                              \
        mg_split(mg_nrows(d), ith, nth, &r0, &r1);                                                   \
        if (r0 >= r1) return;                                                                        \
        /* dst's row coordinates and b's (modulo its extents) move row by row, no divisions */      \
        int64_t i1, i2, i3;                                                                          \
        mg_row_coords(d, r0, &i1, &i2, &i3);                                                         \
        int64_t j1 = i1 % b->ne[1], j2 = i2 % b->ne[2], j3 = i3 % b->ne[3];                          \
        for (int64_t r = r0; r < r1; r++) {                                                          \
            const float *ar = (const float *)mg_ptr(a, 0, i1, i2, i3);                  /* [ne0] */  \
            const float *br = (const float *)mg_ptr(b, 0, j1, j2, j3);                  /* [ne10] */ \
            float *dr = (float *)mg_ptr(d, 0, i1, i2, i3);                              /* [ne0] */  \
            BIN_LOOP(OP);                                                                            \
            if (++i1 == d->ne[1]) {                                                                  \
                i1 = j1 = 0;                                                                         \
                if (++i2 == d->ne[2]) {                                                              \
                    i2 = j2 = 0; ++i3;                                                               \
                    if (++j3 == b->ne[3]) j3 = 0;                                                    \
                } else if (++j2 == b->ne[2]) j2 = 0;                                                 \
            } else if (++j1 == b->ne[1]) j1 = 0;                                                     \
        }                                                                                            \
    }                                                                                                \
    MG_KERNEL(NAME, mg_k_binary_##NAME, NULL)

MG_BINARY(ADD, +)
MG_BINARY(SUB, -)
MG_BINARY(MUL, *)
MG_BINARY(DIV, /)

/* SCALE: a = src[0] [ne0..] -> dst: x*s (b == 0) or x*s + b, rounded after each step;
 * fp = {s, b} */
static void mg_k_scale(const mg_node *n, int ith, int nth) {
    const mg_tensor *a = &n->src[0];
    const mg_tensor *d = &n->dst;
    const float s = n->fp[0], bias = n->fp[1];
    const int64_t ne0 = d->ne[0];
    int64_t r0, r1;
    mg_split(mg_nrows(d), ith, nth, &r0, &r1);
    int64_t i1 = 0, i2 = 0, i3 = 0;
    if (r0 < r1) mg_row_coords(d, r0, &i1, &i2, &i3);
    for (int64_t r = r0; r < r1; r++, mg_row_next(d, &i1, &i2, &i3)) {
        const float *ar = (const float *)mg_ptr(a, 0, i1, i2, i3);  /* [ne0] */
        float *dr = (float *)mg_ptr(d, 0, i1, i2, i3);              /* [ne0] */
        if (bias == 0.0f) {
            for (int64_t i = 0; i < ne0; i++) dr[i] = ar[i] * s;
        } else {
            for (int64_t i = 0; i < ne0; i++) dr[i] = ar[i] * s + bias;
        }
    }
}
MG_KERNEL(SCALE, mg_k_scale, NULL)
