/* minigraph CPU kernels: the interface Python sees (plan records, errors, entry points).
 * build.py hands this file to cffi's cdef as it is, and mg.h includes it: one definition for both,
 * so it must stay plain declarations (no #include, no #if). */
#define MG_MAX_SRC 7

/* the backend's own type codes (Python maps minigraph types to them); the block types have ggml's
 * byte layouts (quant.h). MG_Q8_K, MG_Q8_0X, MG_Q8_0S, MG_Q8_KP, MG_F16F and MG_BF16F only appear in
 * MUL_MAT's work buffer; MG_Q4_KX8 and MG_Q6_KX8 (q4_K, q6_K rows packed in groups of 8,
 * quant_matmul.c) only as the weights of a MUL_MAT. */
enum mg_type { MG_F32 = 0, MG_F16 = 1, MG_I32 = 2, MG_I64 = 3, MG_BF16 = 4, MG_Q4_0 = 5, MG_Q8_0 = 6,
               MG_Q4_K = 7, MG_Q6_K = 8, MG_Q8_K = 9, MG_Q8_0X = 10, MG_Q8_0S = 11, MG_Q8_KP = 12,
               MG_F16F = 13, MG_BF16F = 14, MG_Q4_KX8 = 15, MG_Q6_KX8 = 16 };

enum mg_status { MG_OK = 0, MG_ERR_INDEX = 1, MG_ERR_OP = 2 };

typedef struct mg_tensor {
    char    *data;      /* element [0,0,0,0]; NULL for an absent source */
    int64_t  ne[4];     /* extents, dim 0 fastest */
    int64_t  nb[4];     /* strides in bytes */
    int32_t  type;      /* enum mg_type */
    int32_t  pad;
} mg_tensor;

typedef struct mg_node {
    int32_t   op;               /* kernel code: the index mg_op_name() names (codes are assigned as
                                   kernels register, see MG_KERNEL in mg.h) */
    int32_t   n_src;
    mg_tensor dst;
    mg_tensor src[7];           /* MG_MAX_SRC; in the registry's source order */
    float     fp[8];            /* the op's float params, in the registry's declaration order */
    int64_t   ip[8];            /* the op's int and bool params, in declaration order */
    int64_t   cost;             /* the executor's work estimate, filled on the first run (0: not yet) */
    /* a state store fused into a scan (build_plan's fused_stores): on the scan's record, where its
     * K state slots go instead of after its main output ([D, n_seqs, K], dims 0 dense; data NULL:
     * not fused); on both records, the word in which the scan says, each run, whether it wrote
     * them there (1) or, as when unfused, after its output (0: the store's CPY then copies them) */
    mg_tensor store;
    int64_t  *stored;
    /* a side copy fused into a scan (build_plan's fused_side_copies): on the scan's record, where
     * each sequence's state row goes, as read before the scan overwrites it ([state bytes,
     * n_seqs] dense; NULL: not fused, the side copy's own record copies it) */
    char     *side;
} mg_node;

typedef struct mg_error {
    int32_t code;    /* enum mg_status */
    int32_t node;    /* index of the failing record in the plan */
    int32_t src;     /* source slot that holds the bad index */
    int32_t pad;
    int64_t value;   /* the bad index */
    int64_t limit;   /* valid range is [0, limit) */
} mg_error;

/* the kernels the C code registered (MG_KERNEL lines): code i runs the registry op
 * mg_op_name(i); Python maps names to codes once at load time */
int mg_op_count(void);
const char *mg_op_name(int code);
/* runs the records in order with n_threads threads (the caller's and pool workers); fills each
 * record's cost on first use */
int mg_plan_run(mg_node *nodes, int n_nodes, int n_threads, mg_error *err);
/* the executor's node split: a node below par_min_cost bytes-equivalent is one chunk, and no
 * chunk gets less than chunk_min_cost (tests set 0, 0 to split everything; -1 restores a default) */
void mg_set_chunking(int64_t par_min_cost, int64_t chunk_min_cost);
/* the executor's counters since load: parallel runs, runs kept serial after a stall, stalls,
 * ns the caller waited for others' chunks, chunks run by workers, workers' moves off the
 * caller's CPU */
void mg_pool_stats(int64_t out[6]);
/* tests: workers sleep ns after claiming each chunk (0: off), as if descheduled holding it */
void mg_debug_worker_delay(int64_t ns);
/* tests: workers pin themselves to this CPU as they join a run (-1: off), as if the scheduler
 * had put them on the caller's */
void mg_debug_worker_cpu(int cpu);
/* tests: the next run starts inside a backoff of ns, as if the last run had ended solo */
void mg_debug_backoff_left(int64_t ns);
int mg_max_threads(void);   /* the CPUs this process may run on */
int mg_thread_limit(void);  /* the most threads one plan run uses (the pool's size) */
int mg_quant_simd(void);    /* 1 when the half / block-type kernels run their AVX2 path */
/* weight rows that the kernel for weights of type t computes at once, one per vector lane: 1 is
 * ggml's lane order (one row's partial sums across lanes); q4_K on AVX-512 VNNI + VBMI builds: 8 */
int mg_quant_row_group(int t);
/* MUL_MAT with weights of type t (enum mg_type) and an f32 src1 of n_cols rows per weight plane:
 * the type code of src1's rows once converted (-1: no conversion, f32 weights) and the bytes of
 * one converted row of k values. Only the speed depends on n_cols, never a result. */
int mg_work_type(int t, int64_t n_cols);
int64_t mg_work_row_bytes(int t, int64_t k, int64_t n_cols);
/* an f32 MUL_MAT given as a record with src[0] = a, src[1] = b, src[2] = dst (the layout of the
 * step MUL_MAT:pack_src1): the floats of b's packed copy its prefill path reads (0: that path
 * does not run for this shape, no copy) */
int64_t mg_mul_mat_pack_floats(const mg_node *n);
uint16_t mg_f32_to_f16(float x);
float mg_f16_to_f32(uint16_t h);
/* weights packed for the 8-row kernels (quant_matmul.c): mg_packed_type(t) is the code of type t's
 * rows packed in groups of 8 (MG_Q4_KX8, MG_Q6_KX8), -1 where no kernel of this build reads them;
 * mg_pack_rows rearranges every whole group of 8 of nrows rows of row_bytes of type t in place
 * (unpack 1: back to t's layout). 0, or -1 when t has no packed form here, row_bytes is not whole
 * blocks or no memory was left for one group's copy (data then unchanged) */
int mg_packed_type(int t);
int mg_pack_rows(int t, char *data, int64_t nrows, int64_t row_bytes, int unpack);
