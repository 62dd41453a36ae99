/* minigraph CPU kernels: the interface Python sees (plan records, errors, entry points).
 * build.py hands this file to cffi's cdef as it is, and mg.h includes it: one definition for both,
 * so it must stay plain declarations (no #include, no #if). */
#define MG_MAX_SRC 7

enum mg_type { MG_F32 = 0, MG_F16 = 1, MG_I32 = 2, MG_I64 = 3 };

enum mg_op {
    MG_OP_NONE = 0,
    MG_OP_CPY, MG_OP_CONT, MG_OP_CONCAT, MG_OP_REPEAT,
    MG_OP_GET_ROWS, MG_OP_SET_ROWS, MG_OP_ARANGE,
    MG_OP_SILU, MG_OP_SIGMOID, MG_OP_SOFTPLUS, MG_OP_EXP, MG_OP_NEG, MG_OP_SQRT,
    MG_OP_ADD, MG_OP_SUB, MG_OP_MUL, MG_OP_DIV, MG_OP_SCALE,
    MG_OP_RMS_NORM, MG_OP_L2_NORM, MG_OP_SUM_ROWS,
    MG_OP_MUL_MAT,
    MG_OP_SSM_CONV, MG_OP_SSM_SCAN, MG_OP_GATED_DELTA_NET,
    MG_OP_COUNT
};

enum mg_status { MG_OK = 0, MG_ERR_INDEX = 1, MG_ERR_OP = 2 };

typedef struct mg_tensor {
    char    *data;      /* element [0,0,0,0]; NULL for an absent source */
    int64_t  ne[4];     /* extents, dim 0 fastest */
    int64_t  nb[4];     /* strides in bytes */
    int32_t  type;      /* enum mg_type */
    int32_t  pad;
} mg_tensor;

typedef struct mg_node {
    int32_t   op;               /* enum mg_op */
    int32_t   n_src;
    mg_tensor dst;
    mg_tensor src[7];           /* MG_MAX_SRC; in the registry's source order */
    float     fp[4];            /* float params (scale s/b, eps, arange start/step) */
    int64_t   ip[4];            /* int params (concat dim, K) */
} mg_node;

typedef struct mg_error {
    int32_t code;    /* enum mg_status */
    int32_t node;    /* index of the failing record in the plan */
    int32_t src;     /* source slot that holds the bad index */
    int32_t pad;
    int64_t value;   /* the bad index */
    int64_t limit;   /* valid range is [0, limit) */
} mg_error;

int mg_plan_run(const mg_node *nodes, int n_nodes, int n_threads, mg_error *err);
int mg_max_threads(void);
uint16_t mg_f32_to_f16(float x);
float mg_f16_to_f32(uint16_t h);
