// A CPU emulator for minigraph's CUDA kernels (tests only: backends/cuda/emu.py).
//
// It compiles the very .cu sources with g++ and runs a launch as CUDA would, block after block;
// the threads of a block are fibers (ucontext) so that __syncthreads() and warp shuffles block
// and resume exactly where the hardware would. It also checks what the hardware cannot:
// the Python side's argument list against the kernel's parameter types (count, size, kind), and
// warp shuffles called by only part of a warp.
#ifndef MG_EMU_H
#define MG_EMU_H

#include <ucontext.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <cstdint>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define MG_EMU 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __restrict__

struct emu_dim3 { unsigned int x, y, z; };

static inline float emu_h2f(unsigned short b) { _Float16 h; memcpy(&h, &b, 2); return (float)h; }
static inline unsigned short emu_f2h(float f) { _Float16 h = (_Float16)f; unsigned short b; memcpy(&b, &h, 2); return b; }

namespace emu {

enum { RUN = 0, WAIT_BLOCK = 1, WAIT_WARP = 2, DONE = 3 };
static const size_t STACK = 128 * 1024;

struct Fiber {
    ucontext_t ctx;
    int state;
    int lin;           // linear thread index in the block
    emu_dim3 tid;
};

static std::vector<Fiber> g_fib;
static std::vector<std::unique_ptr<char[]>> g_stacks;
static ucontext_t g_sched;
static int g_cur;
static std::function<void()> *g_body;
static emu_dim3 g_block, g_bdim, g_gdim;
static unsigned long long g_xchg[32][32];
static char g_err[512];
static int g_reverse;   // run blocks and threads last to first (shakes out order-dependent results)

static inline Fiber &cur() { return g_fib[g_cur]; }

static void wait(int kind) {
    cur().state = kind;
    swapcontext(&cur().ctx, &g_sched);
}

static void entry() {
    (*g_body)();
    cur().state = DONE;
    swapcontext(&cur().ctx, &g_sched);   // never resumed
}

// run one block to completion; returns 0, or 1 with g_err set
static int run_block(int n) {
    while ((int)g_stacks.size() < n) g_stacks.emplace_back(new char[STACK]);
    g_fib.assign(n, Fiber());
    for (int i = 0; i < n; ++i) {
        Fiber &f = g_fib[i];
        f.state = RUN;
        f.lin = i;
        f.tid.x = i % g_bdim.x;
        f.tid.y = (i / g_bdim.x) % g_bdim.y;
        f.tid.z = i / (g_bdim.x * g_bdim.y);
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = g_stacks[i].get();
        f.ctx.uc_stack.ss_size = STACK;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, (void (*)())entry, 0);
    }
    for (;;) {
        for (int k = 0; k < n; ++k) {
            const int i = g_reverse ? n - 1 - k : k;
            if (g_fib[i].state == RUN) {
                g_cur = i;
                swapcontext(&g_sched, &g_fib[i].ctx);
            }
        }
        bool released = false, waiting = false;
        for (int w = 0; w * 32 < n; ++w) {
            const int lo = w * 32, hi = lo + 32 < n ? lo + 32 : n;
            int nw = 0;
            for (int i = lo; i < hi; ++i) nw += g_fib[i].state == WAIT_WARP;
            if (nw == 0) continue;
            if (nw != 32) {
                snprintf(g_err, sizeof g_err, "block (%u,%u,%u) warp %d: a warp shuffle reached by %d of 32 lanes "
                         "(divergent, exited or partial warp)", g_block.x, g_block.y, g_block.z, w, nw);
                return 1;
            }
            for (int i = lo; i < hi; ++i) g_fib[i].state = RUN;
            released = true;
        }
        if (released) continue;
        for (int i = 0; i < n; ++i) waiting |= g_fib[i].state == WAIT_BLOCK;
        if (!waiting) return 0;
        for (int i = 0; i < n; ++i)
            if (g_fib[i].state == WAIT_BLOCK) g_fib[i].state = RUN;
    }
}

template <typename T> static bool kind_ok(char k) {
    if (std::is_pointer<T>::value) return k == 'p';
    if (std::is_floating_point<T>::value) return k == 'f';
    if (std::is_integral<T>::value && std::is_signed<T>::value) return k == 'i';
    if (std::is_integral<T>::value) return k == 'u';
    return false;
}

template <typename... A, size_t... I>
static int launch_impl(void (*k)(A...), emu_dim3 grid, emu_dim3 block, void **args, const int *sizes,
                       const char *kinds, int nargs, std::index_sequence<I...>) {
    if (nargs != (int)sizeof...(A)) {
        snprintf(g_err, sizeof g_err, "the kernel has %d parameters, the launch passed %d", (int)sizeof...(A), nargs);
        return 1;
    }
    const int size_of[] = {(int)sizeof(A)..., 0};
    const bool kind_of[] = {kind_ok<A>(kinds[I])..., true};
    for (int i = 0; i < nargs; ++i) {
        if (size_of[i] != sizes[i] || !kind_of[i]) {
            snprintf(g_err, sizeof g_err, "parameter %d: the kernel takes %d bytes, the launch passed %d bytes of kind '%c'",
                     i, size_of[i], sizes[i], kinds[i]);
            return 1;
        }
    }
    std::tuple<A...> vals(*(A *)args[I]...);
    std::function<void()> body = [&]() { k(std::get<I>(vals)...); };
    g_body = &body;
    g_gdim = grid;
    g_bdim = block;
    const int n = (int)(block.x * block.y * block.z);
    if (n < 1 || n > 1024) {
        snprintf(g_err, sizeof g_err, "block of %d threads", n);
        return 1;
    }
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                g_block.x = g_reverse ? grid.x - 1 - x : x;
                g_block.y = g_reverse ? grid.y - 1 - y : y;
                g_block.z = g_reverse ? grid.z - 1 - z : z;
                if (run_block(n)) return 1;
            }
    return 0;
}

template <typename... A>
static int launch(void (*k)(A...), emu_dim3 grid, emu_dim3 block, void **args, const int *sizes,
                  const char *kinds, int nargs) {
    return launch_impl(k, grid, block, args, sizes, kinds, nargs, std::index_sequence_for<A...>());
}

}  // namespace emu

extern "C" const char *emu_error(void) { return emu::g_err; }
extern "C" void emu_set_reverse(int r) { emu::g_reverse = r; }

#define threadIdx (emu::cur().tid)
#define blockIdx (emu::g_block)
#define blockDim (emu::g_bdim)
#define gridDim (emu::g_gdim)

static inline void __syncthreads() { emu::wait(emu::WAIT_BLOCK); }

template <typename T> static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
    (void)mask;
    const int w = emu::cur().lin / 32, l = emu::cur().lin % 32;
    unsigned long long bits = 0;
    memcpy(&bits, &v, sizeof(T));
    emu::g_xchg[w][l] = bits;
    emu::wait(emu::WAIT_WARP);
    bits = emu::g_xchg[w][l ^ lane_mask];
    emu::wait(emu::WAIT_WARP);
    T r;
    memcpy(&r, &bits, sizeof(T));
    return r;
}

static inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((unsigned long long)a * b) >> 32);
}
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline int __float2int_rn(float x) { return (int)nearbyintf(x); }   // ties to even
static inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }

#endif  // MG_EMU_H
