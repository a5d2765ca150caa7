// akunu CUDA kernels: the ABI shared by every kernel and the Rust launcher
// (crates/akunu-cuda/src/launch.rs). Compiled by NVRTC with no system
// headers: everything a kernel needs is defined here.
//
// Every table command launches one or more kernels whose arguments are, in
// order:
//   1. `Bind b`     the command's eight bindings as device pointers, each
//                   already advanced by its static byte offset. A binding
//                   whose offset is patched per step (TOKEN_OFFSET: binding
//                   0, ARGMAX_OUTPUT: binding 1) is passed at offset 0 and
//                   the kernel adds the step's conveyor slot itself.
//   2. `P p`        the command's inline params struct, by value (the
//                   repr(C) structs of crates/akunu-core/src/ops.rs,
//                   mirrored below field for field).
//   3. `StepArg a`  where this step is: see `step_of`.
//
// Inside a captured chunk graph the positions are not baked in: `a.ctl`
// points at the device-resident `Ctl` block, whose `pos0`/`tok0` the chunk
// graph itself advances, and `a.step` is the step's index inside the chunk.
// Outside graphs (prefill, profiling) `a.ctl` is null and `a.pos`/`a.tok`
// are absolute. The host checks at load that every patched field is the one
// the kernel resolves (e.g. RopeParams.pos for PATCH_POSITION), so kernels
// apply `a.patch` to their known fields instead of to raw byte offsets.
//
// Early exit: once a stop token has been produced inside a chain, `ctl->done`
// is set and every later kernel of the chunk returns at entry
// (`AKUNU_PROLOGUE`), so an EOS mid-chunk costs almost nothing. The short
// decode gemv instances test it after their input staging instead
// (`chain_stop_copy` below).

typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef unsigned short u16;
typedef unsigned char u8;
typedef signed char i8;

#define MAX_STOP 16
// Bytes of per-head ticket counters in front of the decode-attention
// partials (launch.rs ATTN_TICKET_BYTES).
#define ATTN_TICKET_BYTES 4096

// Device-resident control block of a chain (one per backend).
struct Ctl {
    u32 pos0;        // position of step 0's first row in the current chunk
    u32 tok0;        // conveyor slot of step 0's first row
    u32 rows;        // rows per step (1 in decode)
    u32 done;        // 1 once a stop token was produced: kernels no-op
    u32 n_stop;      // number of valid ids in `stop`
    u32 stop[MAX_STOP];  // token ids that end generation (EOS, EOT...)
    u32 computed;    // tokens produced by argmax since the chain began
    u32 limit;       // produce at most this many tokens (then set done)
    u32 _pad;
    u32* host_tokens;    // host-mapped: token of conveyor slot t at [t]
    u64* host_stamps;    // host-mapped: %globaltimer when slot t was written
};

struct Bind {
    char* p[8];
};

// PatchType values (crates/akunu-core/src/table.rs).
#define PATCH_NONE 0
#define PATCH_TOKEN_OFFSET 1   // binding 0 is the conveyor: add step.tok
#define PATCH_POSITION 2       // params.pos = step.pos
#define PATCH_KV_SEQ_LEN 3     // params.kv_len = step.pos + step.rows
#define PATCH_POS_AND_KV 4     // both
#define PATCH_ARGMAX_OUTPUT 5  // binding 1 is the conveyor: write slot step.tok + step.rows

struct StepArg {
    u32 pos;    // absolute position of the step's first row (ctl == null)
    u32 tok;    // absolute conveyor slot of the step's first row (ctl == null)
    u32 rows;   // rows of this step
    u32 step;   // step index inside the chunk (ctl != null)
    u32 patch;  // the command's PatchType: which fields the kernel resolves
    u32 flags;  // per-kernel launch options (k_sample_select: SMB_PICK*), else 0
    Ctl* ctl;   // null outside chunk graphs
};

struct Step {
    u32 pos;
    u32 tok;
    u32 rows;
};

__device__ __forceinline__ Step step_of(const StepArg& a) {
    Step s;
    s.rows = a.rows;
    if (a.ctl) {
        s.pos = a.ctl->pos0 + a.step * a.rows;
        s.tok = a.ctl->tok0 + a.step * a.rows;
    } else {
        s.pos = a.pos;
        s.tok = a.tok;
    }
    return s;
}

// Every kernel starts with this: a chain that has produced a stop token
// skips the rest of its chunk. Uniform across the grid, so no barrier can
// be left waiting.
//
// On Hopper the launcher may start each kernel early (programmatic dependent
// launch): `griddepcontrol.wait` then blocks until the previous kernel has
// finished and its writes are visible, so the launch latency of this kernel
// hides under the previous one's tail. `launch_dependents` lets the next
// kernel do the same. Both are no-ops for a kernel launched the ordinary way.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define AKUNU_GRID_DEPS()                                   \
    do {                                                    \
        asm volatile("griddepcontrol.wait;" ::: "memory");  \
        asm volatile("griddepcontrol.launch_dependents;");  \
    } while (0)
#else
#define AKUNU_GRID_DEPS() do { } while (0)
#endif

__device__ __forceinline__ bool chain_stopped(const StepArg& a) {
    return a.ctl && *(volatile const u32*)&a.ctl->done;
}

// The decode gemv's first work after the wait only reads (its input
// staging), so it need not spend a dependent L2 round trip on the stop word
// first: thread 0 copies the control block's first 16 bytes (pos0, tok0,
// rows, done) into shared memory asynchronously, and the block tests `done`
// after the staging's barrier, before its first global write. A plain load
// would not do: the compiler tests its value right after the load, before
// issuing the staging's loads. Thread 0 must run `cp.async.wait_all` before
// that barrier. The 16-byte copy needs `ctl` 16-byte aligned: it is an
// allocation of its own (chain.rs, cuMemAlloc: 256-byte aligned). Every
// thread reads the one copy, so the test is uniform across the block even
// when the host raises `done` mid-kernel. `-DLATE_STOP=0` tests the word
// first (A/B runs).
#ifndef LATE_STOP
#define LATE_STOP 1
#endif
// One 16-byte asynchronous copy from global to shared memory (L2 only).
__device__ __forceinline__ void cp_async16(void* s, const void* g) {
    const u32 sa = (u32)__cvta_generic_to_shared(s);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa), "l"(g) : "memory");
}
__device__ __forceinline__ void chain_stop_copy(const StepArg& a, uint4* slot) {
    if (threadIdx.x == 0 && a.ctl) cp_async16(slot, a.ctl);
}
__device__ __forceinline__ void chain_stop_landed() {
    if (threadIdx.x == 0) asm volatile("cp.async.commit_group;\n\tcp.async.wait_all;" ::: "memory");
}
__device__ __forceinline__ bool chain_stop_seen(const StepArg& a, const uint4* slot) {
    // `done` is the fourth word of the copied 16 bytes (chain.rs asserts the
    // layout of its mirror of Ctl).
    return a.ctl && slot->w;
}

// Whether this block is the last of `n` to take a ticket from `*ticket`,
// with every block's global writes before the call visible to it when it
// is: a barrier, then one acquire-release atomic by thread 0 (the tickets
// form one release sequence), then a barrier; the pattern of CUTLASS's
// semaphore. Every thread of the block must call it; the answer is the
// same for all of them. Decode attention measured it against a fence by
// every thread on both sides (fence.sc.gpu): SmolLM2 1,845 -> 1,868 tok/s
// (bench/RESULTS.md, session 16).
__device__ __forceinline__ bool last_to_arrive(u32* ticket, u32 n, u32* flag) {
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 old;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(ticket) : "memory");
        *flag = old == n - 1;
    }
    __syncthreads();
    return *flag;
}

#define AKUNU_PROLOGUE(a)                                                   \
    do {                                                                    \
        AKUNU_GRID_DEPS();                                                  \
        if ((a).ctl && *(volatile const u32*)&(a).ctl->done) return;        \
    } while (0)

// ---- params structs (mirror crates/akunu-core/src/ops.rs) ----

struct EmbedParams { u32 dim; u32 dtype; u32 n_vocab; float scale; };
struct NormParams { u32 dim; float eps; u32 post_norm; u32 _pad; };
#define ACT_NONE 0
#define ACT_SWIGLU 1
#define ACT_GEGLU 2
struct GemvParams {
    u32 k; u32 x_stride; u32 out_stride; u32 n_seg;
    u32 n[3]; u32 dtype[3];
    u32 input_act; u32 accumulate; u32 bias; float softcap;
};
#define ROPE_NORM 0
#define ROPE_NEOX 1
struct RopeParams {
    u32 pos; u32 n_heads; u32 n_kv_heads; u32 head_dim; u32 rope_dim;
    float theta; float freq_scale; u32 style; u32 qkv_stride; u32 capacity;
    u32 freq_factors; u32 qk_norm; float norm_eps; u32 _pad;
};
struct AttnParams {
    u32 pos; u32 kv_len; u32 n_heads; u32 n_kv_heads; u32 head_dim;
    u32 capacity; float scale; u32 window; u32 qkv_stride; u32 out_stride;
    float softcap; u32 _pad;
};
struct ArgmaxParams { u32 n; u32 _pad[3]; };
struct RecentHeader { u32 chain_start; u32 n; };
struct SampleParams {
    u32 kv_len; u32 n_vocab; float temperature; u32 top_k; float top_p;
    float min_p; float repeat_penalty; u32 repeat_last_n; u32 seed_lo;
    u32 seed_hi; u32 recent_capacity; u32 _pad;
};
struct TopKParams { u32 n_vocab; u32 k; u32 _pad[2]; };
struct PenaltyParams { u32 n_vocab; float penalty; u32 recent_capacity; u32 _pad; };
struct TemperatureParams { u32 n_vocab; float temperature; u32 _pad[2]; };
struct BitmaskParams { u32 n_vocab; u32 _pad[3]; };

// ---- tensor types: GGML ids and block layouts ----

#define DT_F32 0
#define DT_F16 1
#define DT_Q4_0 2
#define DT_Q4_1 3
#define DT_Q5_0 6
#define DT_Q5_1 7
#define DT_Q8_0 8
#define DT_Q4_K 12
#define DT_Q5_K 13
#define DT_Q6_K 14
#define DT_BF16 30

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __uint_as_float(((u32)h) << 16);
}

// The f16 nearest to x (ties to even, as the CPU's `half` conversion), as
// its bits.
__device__ __forceinline__ u16 f16_bits(float x) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

__device__ __forceinline__ float f16_round(float x) {
    return f16_to_f32(f16_bits(x));
}

// ---- KV cache elements
//
// The backend compiles its modules with KV_F16=1 for an f16 cache (the
// default) and KV_F16=0 for an f32 one (`--kv-type`). K and V are rounded
// to f16 once, when written; readers widen them to f32, so every
// attention kernel (and the CPU backend's) sees the same values.
#ifndef KV_F16
#define KV_F16 0
#endif
// The two f16 of a word, the first in the low half, as f32.
__device__ __forceinline__ float2 f16x2_to_f32(u32 w) {
    return make_float2(f16_to_f32((u16)w), f16_to_f32((u16)(w >> 16)));
}
// The four f16 of two words, as f32.
__device__ __forceinline__ float4 f16x4_to_f32(uint2 w) {
    const float2 a = f16x2_to_f32(w.x), b = f16x2_to_f32(w.y);
    return make_float4(a.x, a.y, b.x, b.y);
}
// Element i of f32 or f16 (u16 bits) storage, as f32; elements i .. i + 3
// (i a multiple of 4, 16- or 8-byte aligned) by one load.
__device__ __forceinline__ float ld_f32(const float* p, u64 i) { return p[i]; }
__device__ __forceinline__ float ld_f32(const u16* p, u64 i) { return f16_to_f32(p[i]); }
__device__ __forceinline__ float4 ld4_f32(const float* p, u64 i) { return *(const float4*)(p + i); }
__device__ __forceinline__ float4 ld4_f32(const u16* p, u64 i) { return f16x4_to_f32(*(const uint2*)(p + i)); }
#if KV_F16
typedef u16 kv_t;
__device__ __forceinline__ kv_t kv_from(float x) { return f16_bits(x); }
// Stores elements i, i + 1 (i even).
__device__ __forceinline__ void kv_put2(kv_t* p, u64 i, float a, float b) {
    *(u32*)(p + i) = (u32)f16_bits(a) | ((u32)f16_bits(b) << 16);
}
#else
typedef float kv_t;
__device__ __forceinline__ kv_t kv_from(float x) { return x; }
__device__ __forceinline__ void kv_put2(kv_t* p, u64 i, float a, float b) {
    *(float2*)(p + i) = make_float2(a, b);
}
#endif
// The value a cache element holds once x is written to it.
__device__ __forceinline__ float kv_round(float x) { return KV_F16 ? f16_round(x) : x; }
// Whether ld4_f32 may read cache elements at p (4 elements' alignment).
__device__ __forceinline__ bool kv_aligned4(const kv_t* p) { return ((u64)p & (4 * sizeof(kv_t) - 1)) == 0; }

// Unaligned-safe little-endian u16 read (quant blocks are 18/20/34 bytes,
// so their f16 fields are only 2-byte aligned).
__device__ __forceinline__ u16 ld_u16(const u8* p) {
    return *(const u16*)p;
}

#define NEG_INF (__int_as_float(0xff800000))

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of up to 1024 threads; every thread gets the result.
// `red` is shared scratch of at least 32 floats; the call contains barriers,
// so every thread of the block must reach it.
__device__ __forceinline__ float block_sum(float v, float* red) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    int nw = (blockDim.x + 31) >> 5;
    float t = lane < nw ? red[lane] : 0.0f;
    t = warp_sum(t);
    return t;
}

// ---- helpers shared by model.cu, sampling.cu and persist.cu ----

// 1 / sqrt(mean(x^2) + eps), finished in f64 like the CPU.
__device__ __forceinline__ float rms_inv(float ss, u32 dim, float eps) {
    return (float)(1.0 / sqrt((double)ss / (double)dim + (double)eps));
}

// cos and sin of pair i's angle at position pos: theta^(-2i / rope_dim),
// divided by the frequency factor when there is one, times pos * freq_scale.
// Shared by k_rope_kv_write and the rotation fused into k_attn_decode, so
// both give the same bits (speculative verification compares a fused
// one-row step with unfused multi-row steps bit for bit).
__device__ __forceinline__ void rope_cs(u32 pos, u32 i, u32 rope_dim, float theta, float freq_scale,
                                        const float* __restrict__ ff, float& c, float& s) {
    double inv = pow((double)theta, -2.0 * (double)i / (double)rope_dim);
    if (ff) inv /= (double)ff[i];
    double sn, cs;
    sincospi((double)pos * (double)freq_scale * inv * 0.318309886183790671538, &sn, &cs);  // angle / pi
    c = (float)cs;
    s = (float)sn;
}

// The rotated pair, with the roundings spelled out so that no caller's
// context can contract them differently.
__device__ __forceinline__ void rope_rotate(float x0, float x1, float c, float s, float& y0, float& y1) {
    y0 = __fmaf_rn(x0, c, -__fmul_rn(x1, s));
    y1 = __fmaf_rn(x0, s, __fmul_rn(x1, c));
}

// The persistent kernels' tagged words (persist.cu, stream.cu): a value in
// the low half, the number of the phase that wrote it in the high half,
// stored and loaded relaxed at GPU scope, so that a reader polls one word
// for both its value and its arrival.
__device__ __forceinline__ void tag_store(u64* a, float v, u32 tag) {
    const u64 w = ((u64)tag << 32) | __float_as_uint(v);
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(a), "l"(w) : "memory");
}
__device__ __forceinline__ u64 tag_load(const u64* a) {
    u64 w;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(w) : "l"(a) : "memory");
    return w;
}
// Reloads, all in flight together, every word of w (word j at addr(j))
// whose tag is not yet `tag`, until all carry it: one round trip after the
// last producer, not one for each word that had not arrived at the first
// load (the SmolLM2 kernel's word-by-word wait cost 23% of its token,
// bench/RESULTS.md session 33).
template <int N, class F>
__device__ __forceinline__ void tag_wait_all(u64 (&w)[N], F addr, u32 tag) {
    for (;;) {
        bool ok = true;
#pragma unroll
        for (int j = 0; j < N; ++j) ok &= (u32)(w[j] >> 32) == tag;
        if (ok) return;
#pragma unroll
        for (int j = 0; j < N; ++j)
            if ((u32)(w[j] >> 32) != tag) w[j] = tag_load(addr(j));
    }
}

// The GPU's %globaltimer (ns), the same clock on every SM.
__device__ __forceinline__ u64 globaltimer_ns() {
    u64 now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    return now;
}

// What an Argmax command does with its token: store it in conveyor slot
// `slot`, and inside a chain publish it (and its %globaltimer stamp) to the
// host, count the step and raise `done` at the limit or a stop token. One
// thread of one block calls it.
__device__ void publish_token(u32* tokens, u32 slot, u32 id, Ctl* c) {
    tokens[slot] = id;
    if (!c) return;
    const u64 now = globaltimer_ns();
    // The host polls the token slot, then reads the stamp: stamp first.
    *(volatile u64*)&c->host_stamps[slot] = now;
    __threadfence_system();
    *(volatile u32*)&c->host_tokens[slot] = id;
    __threadfence_system();
    const u32 computed = c->computed + 1u;
    c->computed = computed;
    bool stop = computed >= c->limit;
    const u32 ns = min(c->n_stop, (u32)MAX_STOP);
    for (u32 j = 0; j < ns; ++j) stop |= c->stop[j] == id;
    if (stop) *(volatile u32*)&c->done = 1u;
}

// Bulk copies (the copy engine of sm_90) completing on an mbarrier: the
// decode gemv's bulk-copy form (gemv_tc.cu) and the persistent decode
// (persist.cu).
__device__ __forceinline__ u32 smem_u32(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    asm volatile(
        "{\n"
        " .reg .pred p;\n"
        "TCB_WAIT_%=:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        " @!p bra TCB_WAIT_%=;\n"
        "}\n" ::"r"(smem_u32(bar)),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, u64* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            smem_u32(dst)),
        "l"(src), "r"(bytes), "r"(smem_u32(bar))
        : "memory");
}
// An L2 policy that evicts the lines it is given first, for weights read
// once a token (the streaming kernel's stages, the SmolLM2 kernel's rows).
__device__ __forceinline__ u64 l2_evict_first_policy() {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}
// bulk_copy with an L2 cache policy (l2_evict_first_policy).
__device__ __forceinline__ void bulk_copy_hint(void* dst, const void* src, u32 bytes, u64* bar, u64 policy) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], "
        "%4;" ::"r"(smem_u32(dst)),
        "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(policy)
        : "memory");
}
