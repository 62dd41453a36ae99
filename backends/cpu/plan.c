/* The plan executor: one call runs every node record of a plan.
 *
 * Threads that degrade gracefully. The caller's thread and n_threads - 1 persistent pool workers
 * run a plan together, but nobody ever waits for a thread that is not working:
 *  - each node gets a chunk count from its work (node_chunks: bytes touched, plus the multiply-adds
 *    of MUL_MAT): a small node is one chunk, run by the caller's thread alone (no hand-off, no
 *    barrier); a large one is split into up to CHUNKS_PER_THREAD chunks per thread;
 *  - a kernel call runs chunk c of n (the kernels' own (ith, nth) split, with ith = c, nth = n:
 *    every kernel gives bit-identical results whatever nth, so the chunking never changes a
 *    reduction order); threads claim chunks from a per-node counter (CAS), so a descheduled
 *    worker claims nothing and the others take its share;
 *  - node i + 1 starts when node i's completed-chunk count reaches its chunk count: the caller
 *    waits only for chunks someone is running, never for a thread to arrive at a barrier; it
 *    returns when the last node is complete, whatever the workers are doing;
 *  - waiting spins briefly, then workers sleep (between runs on a futex, within a run in short
 *    naps) and the caller yields (sched_yield) to a worker finishing a chunk on its core;
 *  - a wait far longer for a worker's chunk than the caller's own chunks took is a stall (the
 *    worker was descheduled holding it). Once a run's stalls add up to a share of its time
 *    (STALL_RUN_SHARE, and at least STALL_SOLO_MIN_NS), the run is the caller's alone for a
 *    backoff (2 ms, doubling to 256 ms on stalls that follow one another, back to 2 ms after an
 *    isolated one, halving over runs without one): the nodes left when it ends are published
 *    again as a new run, which the workers join, and a run that ends first hands what is left
 *    of the backoff to the next run, whose caller runs alone until it has passed and then
 *    publishes the rest. A stall early in a long prefill run (one 533-node run per kimi-like
 *    prefill: it went solo 15 ms in and ran its remaining 1.3 s on one thread) therefore costs
 *    the backoff, not the rest, and so does a backoff a long run starts in;
 *  - a worker the scheduler placed on the caller's CPU moves to another CPU it may use, or, with
 *    none, stands aside (on_main_cpu, move_off_main_cpu).
 * A plan whose nodes are all one chunk never involves the workers.
 * A worker may therefore still be walking a run that has ended (it was descheduled). Every word it
 * reads is the pool's own and tagged with the run's generation, and it touches the plan's records
 * only after claiming a chunk with a CAS that succeeds only while that run is live (the caller
 * waits for every claimed chunk). Ops with an index check are opened by the caller's thread
 * after it ran the check: a failing check stops the run before anything of that node is written.
 * A second plan run started while one is in flight (another Python thread: cffi releases the GIL)
 * runs on its caller's thread alone. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <limits.h>
#include <linux/futex.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif
#include "mg.h"
/* the kernel table, filled by the MG_KERNEL registrations as the extension loads (before any
 * call into it, so no locking); a record's op is an index into it */
#define MG_MAX_KERNELS 256

static struct {
    const char *op;      /* the registry's op name */
    mg_kernel kernel;
    mg_check check;      /* NULL when the op has no indices to check */
} kernels[MG_MAX_KERNELS];
static int n_kernels = 0;
static int n_dropped = 0;   /* registrations past MG_MAX_KERNELS: mg_op_count reports -1 */

void mg_register_kernel(const char *op, mg_kernel kernel, mg_check check) {
    if (n_kernels == MG_MAX_KERNELS) { n_dropped++; return; }
    kernels[n_kernels].op = op;
    kernels[n_kernels].kernel = kernel;
    kernels[n_kernels].check = check;
    n_kernels++;
}

int mg_op_count(void) { return n_dropped ? -1 : n_kernels; }

const char *mg_op_name(int code) { return code >= 0 && code < n_kernels ? kernels[code].op : NULL; }

static mg_kernel kernel_for(int op) {
    return op >= 0 && op < n_kernels ? kernels[op].kernel : NULL;
}

static mg_check check_for(int op) {
    return op >= 0 && op < n_kernels ? kernels[op].check : NULL;
}

/* 0 to run, nonzero (err filled) to stop before node i */
static int pre_node(const mg_node *nd, int i, mg_error *err) {
    if (kernel_for(nd->op) == NULL) {
        err->code = MG_ERR_OP; err->node = i; err->value = nd->op;
        return 1;
    }
    mg_check chk = check_for(nd->op);
    if (chk != NULL && chk(nd, err)) { err->node = i; return 1; }
    return 0;
}

int mg_max_threads(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return n;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

/* ---- chunking policy ---- */
/* Below PAR_MIN_COST bytes-equivalent a node is one chunk on the caller's thread: handing part
 * of a node that small to a worker costs more than it saves once the other core is busy (an
 * ssm_conv decode step, 144 KiB, took 7.5 us on one thread and 16 us split in two under
 * contention, bench/ops.py), and saves well under a microsecond on a quiet machine. */
#define PAR_MIN_COST_DEFAULT (192 << 10)
/* A plan whose split nodes add up to less than 1.5 x PAR_MIN_COST runs on the caller's thread
 * alone: a parallel run costs the caller 1-3 us however little it shares (a tiny mamba2 decode
 * layer, 26 nodes, one split scan of 2 us: 10.5 us on one thread, 12 us on two). A single node
 * at 1.9 x PAR_MIN_COST still gains from two threads and stays split (bench/ops.py's ssm_conv
 * n_t 8: 21.5 us on one thread, 18.9 on two) */
#define PLAN_PAR_MIN_COST (PAR_MIN_COST + PAR_MIN_COST / 2)
#define CHUNK_MIN_COST_DEFAULT (16 << 10)
static int64_t PAR_MIN_COST = PAR_MIN_COST_DEFAULT;
static int64_t CHUNK_MIN_COST = CHUNK_MIN_COST_DEFAULT;  /* no chunk gets less than this */

/* tests: (0, 0) splits every node into CHUNKS_PER_THREAD chunks per thread; negative: default */
void mg_set_chunking(int64_t par_min_cost, int64_t chunk_min_cost) {
    PAR_MIN_COST = par_min_cost < 0 ? PAR_MIN_COST_DEFAULT : par_min_cost;
    CHUNK_MIN_COST = chunk_min_cost < 0 ? CHUNK_MIN_COST_DEFAULT : chunk_min_cost;
}
#ifndef CHUNKS_PER_THREAD   /* a build knob (-D): 16 measured no different from 4 on the weights rows, within noise */
#define CHUNKS_PER_THREAD 4          /* dynamic balance: a late thread leaves at most ~1/4 of its share */
#endif
#define MAX_CHUNKS 4096              /* fits the claim word's 15-bit count */
#define MAX_THREADS 512

int mg_thread_limit(void) { return MAX_THREADS; }

static int64_t tensor_bytes(const mg_tensor *t) {
    if (t->data == NULL) return 0;
    int64_t n = mg_nelements(t);
    return n > 0 ? n / mg_blck_size(t->type) * mg_type_size(t->type) : 0;
}

/* the work of a node in bytes-equivalent: bytes read and written, plus for MUL_MAT one per
 * multiply-add of a matrix by at most MV_COLS columns (about what a core streams per multiply-add
 * with the vector kernels: the weights stream from memory, and each thread's share of that
 * stream is what a split buys) and one per GEMM_MAC_DIV of a product with more columns (there
 * the multiply-adds are the work, several per byte a core streams, and a split moves the
 * operands, which sit in the caller's cache, to the other core: a 64 x 128 by 64 product took
 * 16.2 us on one thread and 19.3 split in two, 64 x 64 by 64 8.3 and 9.9; 64 x 328 by 64, 41.0
 * and 38.5; bench/models.py's tiny delta-net and mamba2 prefill layers, Zen 4) */
#define MV_COLS 4
#define GEMM_MAC_DIV 8
static int64_t node_cost(const mg_node *nd) {
    int64_t c = tensor_bytes(&nd->dst);
    for (int j = 0; j < nd->n_src && j < MG_MAX_SRC; j++) c += tensor_bytes(&nd->src[j]);
    const char *name = mg_op_name(nd->op);
    if (name != NULL && strcmp(name, "MUL_MAT") == 0) {
        const int64_t macs = nd->src[0].ne[0] * nd->src[0].ne[1] * nd->src[1].ne[1] * nd->src[1].ne[2] * nd->src[1].ne[3];
        c += nd->src[1].ne[1] <= MV_COLS ? macs : macs / GEMM_MAC_DIV;
    }
    return c;
}

static int node_chunks(mg_node *nd, int nth) {
    if (nd->cost == 0) nd->cost = node_cost(nd) | 1;   /* cached in the record: shapes are fixed */
    const int64_t cost = nd->cost;
    if (cost < PAR_MIN_COST) return 1;
    int64_t n = CHUNK_MIN_COST > 0 ? cost / CHUNK_MIN_COST : MAX_CHUNKS;
    const int64_t cap = (int64_t)nth * CHUNKS_PER_THREAD;
    if (n > cap) n = cap;
    if (n > MAX_CHUNKS) n = MAX_CHUNKS;
    return n < 2 ? 2 : (int)n;
}

/* ---- the pool ---- */
/* per node, one cache line: claim = gen << 32 | open << 31 | n_chunks << 16 | claimed,
 * done = gen << 32 | completed chunks */
#define CL_OPEN ((uint64_t)1 << 31)
#define CL_N(w) ((int)(((w) >> 16) & 0x7fff))
#define CL_C(w) ((int)((w) & 0xffff))
#define GEN(w) ((uint32_t)((w) >> 32))
typedef struct {
    _Atomic uint64_t claim;
    _Atomic uint64_t done;
    char pad[64 - 2 * sizeof(uint64_t)];
} node_sync;

static struct {
    pthread_mutex_t run_lock;          /* held by the thread whose run uses the pool */
    int n_created;                     /* workers started */
    _Atomic uint32_t gen;              /* futex word; even: run `gen` published, odd: being prepared */
    _Atomic int sleepers;              /* workers in futex_wait on gen */
    _Atomic uint32_t abort_gen;        /* == gen when the caller stopped the run at a failed check */
    _Atomic uint32_t solo_gen;         /* == gen when the caller finishes the run alone (a stall) */
    _Atomic int main_cpu;              /* the CPU the caller last ran a split node on */
    int64_t serial_until;              /* after a stall, runs stay on the caller's thread until then */
    int64_t solo_until;                /* a run that went solo is the caller's alone until then */
    int64_t backoff;                   /* the current serial stretch, ns (0: no recent stall) */
    int64_t run_t0, stall_ns;          /* the current run's start and its stalls' waits so far */
    int64_t calm_since;                /* the workers' return after the last stall (see STALL_RECENT) */
    /* the run descriptor (read by workers under the gen seqlock) */
    _Atomic(mg_node *) nodes;
    _Atomic int n_nodes;
    _Atomic int n_workers;
    _Atomic(node_sync *) sync;
    int sync_cap;
} P = { .run_lock = PTHREAD_MUTEX_INITIALIZER };

static long futex(_Atomic uint32_t *addr, int op, uint32_t val) {
    return syscall(SYS_futex, (uint32_t *)addr, op, val, NULL, NULL, 0);
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

#define SPIN_NS 4000          /* the caller spins this long for a chunk before yielding */
#define STALL_MIN_NS 30000    /* waiting this much longer than twice the caller's own chunk time */
#define STALL_SOLO_MIN_NS 1000000  /* a run goes solo once its stalls add up to this (about a timeslice) ... */
#define STALL_RUN_SHARE 16         /* ... and to more than 1/16 of the run so far */
#define BACKOFF_MIN_NS 2000000
#define BACKOFF_MAX_NS 256000000
#define STALL_RECENT 4             /* a stall within 4 backoffs of the workers' return escalates */
#define WORKER_SPIN_NS 20000  /* a worker spins this long within a run, then naps between checks */
#define WORKER_NAP_NS 10000
#define IDLE_SPIN_NS 50000    /* a worker spins this long for the next run, then sleeps (futex) */

/* Workers never sched_yield: on a core shared with a busy process, yielding hands that process
 * the rest of a scheduler slice (milliseconds) while the worker stays runnable but last in line,
 * so it would rarely be there to take a chunk. Spinning keeps its fair share; sleeping (a nap,
 * or the futex between runs) gives the core away and comes back with the scheduler's wakeup
 * preference. The caller does yield while it waits for a chunk: a worker sharing its core gets
 * to finish it. */

/* A worker the scheduler put on the caller's CPU would only take turns with the caller (and a
 * timed nap there would preempt the caller each time it ends). A futex wake puts the wakee there
 * whenever the other CPU looks busy: a busy process, or another library's threads spinning after
 * their own call (OpenBLAS's do for a tenth of a second), and nothing moves it away soon. So the
 * worker moves itself: its affinity becomes its own CPUs without the caller's until it next
 * sleeps, and the move wakes it on the other CPU, where the scheduler shares that CPU with
 * whatever runs there. Measured (bench/ops.py --contention, a busy process on one of 2 cores):
 * 2-thread rows at 0.93-1.05 of their 1-thread time when the worker left the run instead, at
 * 0.53-0.99 moving. With no other CPU to go to it leaves the run and sleeps on the futex until the
 * next one, which may find it elsewhere. */
static inline int on_main_cpu(void) {
    return sched_getcpu() == atomic_load_explicit(&P.main_cpu, memory_order_relaxed);
}

static __thread cpu_set_t worker_cpus;   /* the CPUs a worker may use: its affinity when it started */
static __thread int worker_narrowed;     /* its affinity is narrower than that until it sleeps */
static _Atomic int64_t st_moves;         /* moves off the caller's CPU (workers count them) */

/* the worker, on the caller's CPU, moves to another it may use: 1 when it is now elsewhere */
static int move_off_main_cpu(void) {
    const int main = atomic_load_explicit(&P.main_cpu, memory_order_relaxed);
    cpu_set_t others = worker_cpus;
    if (main >= 0 && main < CPU_SETSIZE) CPU_CLR(main, &others);
    if (CPU_COUNT(&others) == 0 || sched_setaffinity(0, sizeof others, &others) != 0) return 0;
    worker_narrowed = 1;
    atomic_fetch_add_explicit(&st_moves, 1, memory_order_relaxed);
    return !on_main_cpu();
}

/* before a worker sleeps: its own CPUs again, so that the next wake may place it on any of them */
static void widen_affinity(void) {
    if (!worker_narrowed) return;
    sched_setaffinity(0, sizeof worker_cpus, &worker_cpus);
    worker_narrowed = 0;
}

/* tests: each worker pins itself to this CPU when it joins a run (>= 0), as a scheduler that put
 * it on the caller's CPU would; -1: off */
static _Atomic int debug_worker_cpu = -1;

/* tests: the next run starts inside a backoff of ns, as if the last run had ended solo */
void mg_debug_backoff_left(int64_t ns) {
    pthread_mutex_lock(&P.run_lock);
    P.serial_until = now_ns() + ns;
    pthread_mutex_unlock(&P.run_lock);
}
void mg_debug_worker_cpu(int cpu) { atomic_store(&debug_worker_cpu, cpu); }

/* one step of a worker's wait that started at t0 (0: not yet timed); returns the updated t0, or
 * -1 when the worker should leave the run (it is on the caller's CPU and cannot move) */
static inline int64_t wait_step(int64_t t0, int64_t *iter) {
    if (++*iter < 64) { cpu_relax(); return t0; }
    *iter = 0;
    if (on_main_cpu() && !move_off_main_cpu()) return -1;
    const int64_t t = now_ns();
    if (t0 == 0) return t;
    if (t - t0 > WORKER_SPIN_NS) {
        const struct timespec ts = {0, WORKER_NAP_NS};
        nanosleep(&ts, NULL);
    }
    return t0;
}

typedef struct {
    mg_node *nodes;
    int n_nodes;
    node_sync *sync;
    uint32_t gen;
} run_view;

/* Walk the nodes of run v as thread `main_thread` (the caller: opens check nodes, runs the
 * one-chunk nodes, waits for the end) or a worker. Returns MG_OK, or for the caller the error. */
/* tests: a worker sleeps this long after claiming each chunk (a descheduled worker, on demand) */
static _Atomic int64_t debug_worker_delay_ns = 0;
void mg_debug_worker_delay(int64_t ns) { atomic_store(&debug_worker_delay_ns, ns); }

/* counters for tests and tuning (caller-side, under run_lock) */
static int64_t st_parallel, st_serial_backoff, st_stalls, st_wait_ns, st_worker_chunks;

void mg_pool_stats(int64_t out[6]) {
    out[0] = st_parallel; out[1] = st_serial_backoff; out[2] = st_stalls; out[3] = st_wait_ns;
    out[4] = st_worker_chunks;
    out[5] = atomic_load_explicit(&st_moves, memory_order_relaxed);
}

static inline int left(uint32_t gen) {   /* the run was stopped or left to the caller alone */
    return atomic_load_explicit(&P.abort_gen, memory_order_relaxed) == gen ||
           atomic_load_explicit(&P.solo_gen, memory_order_relaxed) == gen;
}

/* The caller (main_thread) sets *stalled when the run goes solo, and P.solo_until to when the
 * workers may come back; once that has passed it stops before the next node and sets *resume to
 * that node's index (the rest is published again as a new run). Workers pass resume NULL. */
static int run_nodes(const run_view *v, int main_thread, int *stalled, int *resume, mg_error *err) {
    const uint64_t tag = (uint64_t)v->gen << 32;
    for (int i = 0; i < v->n_nodes; i++) {
        if (!main_thread) {
            /* a worker skips the one-chunk nodes (the caller's) without waiting on each: it waits
             * only for the node before the next split one. Following the caller node by node had
             * it poll every node's done word, and each of the caller's updates to a word the
             * worker is reading moves that cache line between the cores: ~0.1 us per node on
             * the caller's path (a tiny mamba2 decode layer, 26 nodes, one split: 13.3 us at 2
             * threads against 10.5 at 1) */
            while (i < v->n_nodes) {
                const uint64_t w = atomic_load_explicit(&v->sync[i].claim, memory_order_relaxed);
                if (GEN(w) != v->gen) return MG_OK;
                if (CL_N(w) > 1) break;   /* a split node */
                i++;
            }
            if (i == v->n_nodes) return MG_OK;
        }
        node_sync *ns = &v->sync[i];
        if (main_thread && *stalled && i > 0 && now_ns() >= P.solo_until) {
            *resume = i;   /* the solo stretch is over: the workers join the rest */
            return MG_OK;
        }
        if (i > 0 && !main_thread) {   /* node i - 1 complete (the caller completes each node itself) */
            node_sync *ps = &v->sync[i - 1];
            const uint64_t want = tag | (uint64_t)CL_N(atomic_load_explicit(&ps->claim, memory_order_relaxed));
            int64_t t0 = 0, it = 0;
            for (;;) {
                const uint64_t d = atomic_load_explicit(&ps->done, memory_order_acquire);
                if (d == want) break;
                if (GEN(d) != v->gen || left(v->gen))
                    return MG_OK;   /* the run is over, stopped or left to the caller */
                if ((t0 = wait_step(t0, &it)) < 0) return MG_OK;
            }
        }
        uint64_t w = atomic_load_explicit(&ns->claim, memory_order_acquire);
        if (GEN(w) != v->gen) return MG_OK;   /* a worker late for a run that has ended */
        if (main_thread && !(w & CL_OPEN)) {   /* an index check: run it, then open the node */
            if (pre_node(&v->nodes[i], i, err)) {
                atomic_store_explicit(&P.abort_gen, v->gen, memory_order_release);
                return err->code;
            }
            w = atomic_fetch_or_explicit(&ns->claim, CL_OPEN, memory_order_acq_rel) | CL_OPEN;
        }
        const int n = CL_N(w);   /* > 1 for a worker: it skipped the one-chunk nodes above */
        if (!main_thread && !(w & CL_OPEN)) {
            int64_t t0 = 0, it = 0;
            for (;;) {
                w = atomic_load_explicit(&ns->claim, memory_order_acquire);
                if (GEN(w) != v->gen || left(v->gen)) return MG_OK;
                if (w & CL_OPEN) break;
                if ((t0 = wait_step(t0, &it)) < 0) return MG_OK;
            }
        }
        if (main_thread && n > 1) atomic_store_explicit(&P.main_cpu, sched_getcpu(), memory_order_relaxed);
        else if (!main_thread && on_main_cpu() && !move_off_main_cpu()) continue;   /* see on_main_cpu */
        const int64_t t_start = main_thread && n > 1 ? now_ns() : 0;
        int ran = 0;
        for (;;) {
            if (GEN(w) != v->gen || CL_C(w) >= n) break;
            if (!main_thread && left(v->gen)) return MG_OK;
            if (atomic_compare_exchange_weak_explicit(&ns->claim, &w, w + 1, memory_order_acq_rel,
                                                      memory_order_acquire)) {
                mg_node *nd = &v->nodes[i];           /* claimed: the run is live until we report */
                if (!main_thread) {
                    const int64_t delay = atomic_load_explicit(&debug_worker_delay_ns, memory_order_relaxed);
                    if (delay > 0) {
                        const struct timespec ts = {delay / 1000000000, delay % 1000000000};
                        nanosleep(&ts, NULL);
                    }
                }
                kernel_for(nd->op)(nd, CL_C(w), n);
                atomic_fetch_add_explicit(&ns->done, 1, memory_order_release);
                ran++;
                w = atomic_load_explicit(&ns->claim, memory_order_acquire);
            }
        }
        if (main_thread && n > 1) {
            st_worker_chunks += n - ran;
            /* everything claimed: wait for the chunks others run. A wait far longer than the
             * caller's own chunks took means a worker was descheduled holding one: the rest of
             * the run is the caller's alone, and the next runs are too for a while (stalled) */
            const uint64_t want = tag | (uint64_t)n;
            if (atomic_load_explicit(&ns->done, memory_order_acquire) != want) {
                const int64_t t_claimed = now_ns();
                const int64_t limit = STALL_MIN_NS + (ran ? 2 * (t_claimed - t_start) / ran : 6 * STALL_MIN_NS);
                int64_t it = 0, t = t_claimed, counted = 0;
                while (atomic_load_explicit(&ns->done, memory_order_acquire) != want) {
                    if (++it < 64) { cpu_relax(); continue; }
                    it = 0;
                    t = now_ns();
                    if (!*stalled && t - t_claimed > limit) {   /* a stall: does the run go solo? */
                        P.stall_ns += t - t_claimed - counted;
                        counted = t - t_claimed;
                        if (P.stall_ns > STALL_SOLO_MIN_NS && P.stall_ns * STALL_RUN_SHARE > t - P.run_t0) {
                            *stalled = 1;
                            /* a stall soon after the workers came back from the last one (a worker
                             * that keeps losing its core) doubles the backoff; one after a calm
                             * stretch (a host's brief preemption of a virtual CPU) starts again
                             * from the minimum */
                            const int recent = P.backoff && t - P.calm_since < STALL_RECENT * P.backoff;
                            P.backoff = !recent ? BACKOFF_MIN_NS
                                      : P.backoff * 2 > BACKOFF_MAX_NS ? BACKOFF_MAX_NS : P.backoff * 2;
                            P.solo_until = t + P.backoff;
                            atomic_store_explicit(&P.solo_gen, v->gen, memory_order_relaxed);
                        }
                    }
                    if (t - t_claimed > SPIN_NS) sched_yield();
                }
                st_wait_ns += now_ns() - t_claimed;
            }
        }
    }
    return MG_OK;
}

typedef struct { int index; uint32_t seen; } worker_arg;

static void *worker_main(void *arg) {
    worker_arg a = *(worker_arg *)arg;
    free(arg);
    prctl(PR_SET_TIMERSLACK, 1000UL);   /* naps of 10 us, not the default slack's 60 */
    if (sched_getaffinity(0, sizeof worker_cpus, &worker_cpus) != 0) CPU_ZERO(&worker_cpus);
    uint32_t seen = a.seen;
    mg_error dummy;
    for (;;) {
        /* wait for a published run newer than the last one seen: spin, then sleep */
        uint32_t g;
        int64_t t0 = 0, it = 0;
        for (;;) {
            g = atomic_load_explicit(&P.gen, memory_order_acquire);
            if (g != seen && !(g & 1)) break;
            if (g & 1) { cpu_relax(); continue; }   /* being published: moments away */
            if (++it < 64) { cpu_relax(); continue; }
            it = 0;
            const int64_t t = now_ns();
            if (t0 == 0) t0 = t;
            if (t - t0 > IDLE_SPIN_NS || on_main_cpu()) {
                widen_affinity();
                atomic_fetch_add(&P.sleepers, 1);
                if (atomic_load(&P.gen) == g) futex(&P.gen, FUTEX_WAIT_PRIVATE, g);
                atomic_fetch_sub(&P.sleepers, 1);
                t0 = 0;
            }
        }
        seen = g;
        /* the run's descriptor, consistent with g (seqlock) */
        run_view v;
        v.nodes = atomic_load_explicit(&P.nodes, memory_order_relaxed);
        v.n_nodes = atomic_load_explicit(&P.n_nodes, memory_order_relaxed);
        const int n_workers = atomic_load_explicit(&P.n_workers, memory_order_relaxed);
        v.sync = atomic_load_explicit(&P.sync, memory_order_relaxed);
        v.gen = g;
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load_explicit(&P.gen, memory_order_relaxed) != g) continue;
        if (a.index >= n_workers) continue;
        const int pin = atomic_load_explicit(&debug_worker_cpu, memory_order_relaxed);
        if (pin >= 0 && pin < CPU_SETSIZE) {
            cpu_set_t one;
            CPU_ZERO(&one);
            CPU_SET(pin, &one);
            if (sched_setaffinity(0, sizeof one, &one) == 0) worker_narrowed = 1;
        }
        int unused = 0;
        run_nodes(&v, 0, &unused, NULL, &dummy);
    }
    return NULL;
}

static void pool_after_fork(void) {   /* the child has no workers */
    pthread_mutex_init(&P.run_lock, NULL);
    P.n_created = 0;
    atomic_store(&P.sleepers, 0);
}

static int pool_grow(int n_workers, uint32_t seen) {
    static int atfork = 0;
    if (!atfork) { pthread_atfork(NULL, NULL, pool_after_fork); atfork = 1; }
    while (P.n_created < n_workers) {
        worker_arg *a = malloc(sizeof *a);
        if (a == NULL) break;
        a->index = P.n_created;
        a->seen = seen;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, (size_t)8 << 20);   /* kernels keep blocks on the stack */
        pthread_t th;
        const int rc = pthread_create(&th, &attr, worker_main, a);
        pthread_attr_destroy(&attr);
        if (rc != 0) { free(a); break; }
        P.n_created++;
    }
    return P.n_created;
}

/* nodes [*next, n_nodes) on the caller's thread alone, while now < until; *next is left at the
 * first node not run */
static int run_alone(mg_node *nodes, int n_nodes, int64_t until, int *next, mg_error *err) {
    for (; *next < n_nodes && (until == INT64_MAX || now_ns() < until); ++*next) {
        if (pre_node(&nodes[*next], *next, err)) return err->code;
        kernel_for(nodes[*next].op)(&nodes[*next], 0, 1);
    }
    return MG_OK;
}

static int run_serial(mg_node *nodes, int n_nodes, mg_error *err) {
    int next = 0;
    return run_alone(nodes, n_nodes, INT64_MAX, &next, err);
}

/* whether a plan has split nodes, and enough of their work (PLAN_PAR_MIN_COST) to pay for a
 * parallel run; a plan of one-chunk nodes has nothing to share */
static int worth_sharing(mg_node *nodes, int n_nodes, int nth) {
    int64_t split = 0;
    for (int i = 0; i < n_nodes; i++) {
        if (node_chunks(&nodes[i], nth) > 1) split += nodes[i].cost;
        if (split > 0 && split >= PLAN_PAR_MIN_COST) return 1;
    }
    return 0;
}

int mg_plan_run(mg_node *nodes, int n_nodes, int n_threads, mg_error *err) {
    memset(err, 0, sizeof *err);
    if (n_threads > MAX_THREADS) n_threads = MAX_THREADS;
    if (n_threads <= 1 || n_nodes <= 0) return run_serial(nodes, n_nodes, err);
    if (!worth_sharing(nodes, n_nodes, n_threads) || pthread_mutex_trylock(&P.run_lock) != 0)
        return run_serial(nodes, n_nodes, err);

    /* a recent stall: the caller runs the nodes alone until the backoff has passed, and the
     * workers join the nodes left after it. (Running the whole run alone made a 4 x 128-token
     * kimi-like prefill that started 2 ms into a backoff take 1.9 s on one thread: 270 tok/s
     * against 420-480 in runs that did not.) */
    int start = 0;
    if (P.serial_until != 0) {
        if (now_ns() < P.serial_until) {
            st_serial_backoff++;
            const int rc = run_alone(nodes, n_nodes, P.serial_until, &start, err);
            if (rc != MG_OK || start == n_nodes) {
                pthread_mutex_unlock(&P.run_lock);
                return rc;
            }
        }
        P.serial_until = 0;
        P.calm_since = now_ns();   /* the workers come back after the last run's stall */
    }
    int n_workers = pool_grow(n_threads - 1, atomic_load_explicit(&P.gen, memory_order_relaxed));
    if (n_workers > n_threads - 1) n_workers = n_threads - 1;
    if (n_workers == 0) {
        pthread_mutex_unlock(&P.run_lock);
        return run_serial(nodes, n_nodes, err);
    }
    node_sync *sync = atomic_load_explicit(&P.sync, memory_order_relaxed);
    if (n_nodes > P.sync_cap) {
        /* the old array is kept (leaked): a late worker may still read it. Doubling bounds the
         * total at twice the largest plan's. */
        int cap = P.sync_cap ? P.sync_cap : 256;
        while (cap < n_nodes) cap *= 2;
        node_sync *ns = aligned_alloc(64, (size_t)cap * sizeof(node_sync));
        if (ns == NULL) {
            pthread_mutex_unlock(&P.run_lock);
            return run_serial(nodes, n_nodes, err);
        }
        for (int i = 0; i < cap; i++) {
            atomic_init(&ns[i].claim, 0);
            atomic_init(&ns[i].done, 0);
        }
        sync = ns;
        P.sync_cap = cap;
    }
    /* the run, published as one or more segments: a segment that went solo ends once its solo
     * stretch (the backoff) is over, and the nodes left are published again as a new run, which
     * the workers join; a long prefill run that stalls once loses the backoff, not its rest */
    int rc = MG_OK, stalled = 0;
    for (;;) {
        const uint32_t g = atomic_load_explicit(&P.gen, memory_order_relaxed) + 2;
        const int n_seg = n_nodes - start;
        atomic_store(&P.gen, g - 1);   /* preparing: workers re-read after it turns even */
        const uint64_t tag = (uint64_t)g << 32;
        for (int i = 0; i < n_seg; i++) {
            mg_node *nd = &nodes[start + i];
            const int n = node_chunks(nd, n_workers + 1);
            const uint64_t open = check_for(nd->op) != NULL || kernel_for(nd->op) == NULL ? 0 : CL_OPEN;
            atomic_store_explicit(&sync[i].done, tag, memory_order_relaxed);
            atomic_store_explicit(&sync[i].claim, tag | open | ((uint64_t)n << 16), memory_order_relaxed);
        }
        atomic_store_explicit(&P.nodes, nodes + start, memory_order_relaxed);
        atomic_store_explicit(&P.n_nodes, n_seg, memory_order_relaxed);
        atomic_store_explicit(&P.n_workers, n_workers, memory_order_relaxed);
        atomic_store_explicit(&P.sync, sync, memory_order_relaxed);
        atomic_store(&P.gen, g);           /* published (seq_cst: ordered before the sleepers check) */
        if (atomic_load(&P.sleepers) > 0) futex(&P.gen, FUTEX_WAKE_PRIVATE, INT_MAX);

        run_view v = { nodes + start, n_seg, sync, g };
        int resume = -1;
        stalled = 0;
        P.run_t0 = now_ns();
        P.stall_ns = 0;
        rc = run_nodes(&v, 1, &stalled, &resume, err);
        if (rc != MG_OK) err->node += start;   /* the index in the caller's plan */
        st_parallel++;
        if (stalled) st_stalls++;
        if (rc != MG_OK || resume < 0) break;
        start += resume;
        P.calm_since = now_ns();   /* the solo stretch is over: the workers come back */
    }
    if (stalled) P.serial_until = P.solo_until;   /* ended solo: the next runs finish the stretch */
    else P.backoff /= 2;                          /* decays over runs that went well */
    pthread_mutex_unlock(&P.run_lock);
    return rc;
}

uint16_t mg_f32_to_f16(float x) { return mg_fp32_to_fp16(x); }
float mg_f16_to_f32(uint16_t h) { return mg_fp16_to_fp32(h); }

static __thread void *scratch_buf;
static __thread size_t scratch_cap;

void *mg_thread_scratch(size_t bytes) {
    if (bytes > scratch_cap) {
        free(scratch_buf);
        scratch_buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        scratch_cap = scratch_buf != NULL ? bytes : 0;
    }
    return scratch_buf;
}
