// A persistent decode kernel for the large F16 shapes of issue 5 (Llama-1B and
// Llama-8B), whose weights do not fit in shared memory: the next step after
// the graph of one kernel per product, which session 13 and 23 measured at
// its limit (1B F16 63% of the H200's floor, 8B F16 83%).
//
// The design question this probe answers: if each SM streams its share of
// every weight matrix through a ring of shared-memory stages without ever
// waiting on the data a phase consumes, do the phases' dependency waits
// (every product needs the whole vector the one before wrote) hide behind
// the stream, and how close to the bandwidth floor does a token get?
//
// One block per SM, one producer warp and CW consumer warps:
//   - the producer walks the same schedule as the consumers (every layer's
//     q|k|v, o, gate|up and down rows of this block, then its logits rows)
//     and copies it, chunk after chunk, into NST stages of STB bytes with
//     cp.async.bulk, waiting only for a stage to be free again;
//   - the consumers stage each product's input (RMS norm, the attention
//     merge) from tagged words (the value in the low half, the number of the
//     phase that wrote it in the high half, as the engine's persistent kernel
//     hands values over; a staging reloads all its stale words at once),
//     then take the chunks as they land: warp w always takes columns
//     [w K / CW, (w + 1) K / CW) of every row, its piece of the input held in
//     registers for the whole product, the rows' lane sums reduced by
//     halving; the CW partials of a row are added in a fixed order at the
//     product's end, then its epilogue (RoPE and the K/V cache; the
//     residual; SiLU(gate) * up; the block's best logit).
//   - attention: one block per (query head, split of the positions), its
//     partial (max, sum, values) merged by every block that stages the o
//     product's input.
// Rows are split over blocks by units (a RoPE pair of q|k|v rows, a
// gate|up pair, a row), contiguous per block, so that a block's share of a
// matrix is one range of bytes.
//
// The model: random F16 (or Q4_0, QUANT=1) weights of the issue's shapes (SHAPE=1: 16 layers,
// d 2048, 32 heads and 8 KV heads of 64, FFN 8192; SHAPE=8: 32 layers, d
// 4096, heads of 128, FFN 14336; vocabulary 49,152, the embedding tied to
// the logits), F32 norms, an F16 KV cache filled at random below the start
// position. The gate|up matrix interleaves gate row i and up row i (a
// load-time repack in an engine). A CPU forward pass in double over the
// same weights checks the first tokens' logits and argmaxes.
//
// Build and run on the GPU machine (scripts/gpu.sh run stream, STREAM_RUNS):
//   nvcc -O3 -std=c++17 -arch=sm_90 -DSHAPE=1 -Xcompiler -fopenmp -lgomp \
//       -o /tmp/sp bench/cuda/stream_probe.cu && /tmp/sp [tokens] [position]
// Printed: us a token and tok/s (median of 5 launches), the share of the
// floor (weight bytes over the device copy's bandwidth, read + write, as
// akunu bench counts it), where blocks waited, and the check.
//
// Compile-time switches (bench/RESULTS.md, session 25, has what each did):
//   SHAPE 1 / 8; NST stages of STB bytes (5 / 4 of 32 KiB: the ring's depth
//   did not matter, 3 stages ran as fast); CW consumer warps (8); ATT_S
//   splits a head (4); EVICT_FIRST 0/1 (1); PF chunks asked of L2 ahead of
//   the ring (0; any lookahead was slower); SLEEP_NS between reloads of a
//   word (0; any pause was slower); POLL_SEQ 0/1 (0: every stale word of a
//   staging reloaded at once; 1, one at a time, was 23% slower on 1B);
//   ATT_PRE 0/1/2 (K/V rows requested before the wait for q; no change);
//   QUANT 0/1 (F16, or Q4_0 for every matrix and the embedding).
#ifndef __CUDACC_RTC__
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cuda_runtime.h>
typedef uint32_t u32;
typedef uint64_t u64;
#else
typedef unsigned int u32;
typedef unsigned long long u64;
#endif
#include <cuda_fp16.h>

#ifndef SHAPE
#define SHAPE 1
#endif
// QUANT=1: every matrix and the embedding in Q4_0 (GGUF blocks of 32: byte j
// of a block holds weight j in its low nibble and j + 16 in its high one);
// a row is its quants, then its half scales. QUANT=0: F16.
#ifndef QUANT
#define QUANT 0
#endif
#if SHAPE == 8
constexpr int NL = 32, D = 4096, NH = 32, NKV = 8, HD = 128, FF = 14336;
#ifndef NST
#define NST (QUANT ? 8 : 4)
#endif
#else
constexpr int NL = 16, D = 2048, NH = 32, NKV = 8, HD = 64, FF = 8192;
#ifndef NST
#define NST (QUANT ? 8 : 5)
#endif
#endif
#ifndef STB
#define STB (QUANT ? 18432 : 32768)  // bytes a ring stage (Q4_0: 8 rows of 4096)
#endif
#ifndef CW
#define CW 8  // consumer warps
#endif
#ifndef ATT_S
#define ATT_S 4  // blocks a head's attention is split over
#endif
// EVICT_FIRST=1: the weight copies carry an L2 evict-first policy, so that
// the streamed weights do not push the handed-over words and the cache out.
#ifndef EVICT_FIRST
#define EVICT_FIRST 1
#endif
__host__ __device__ constexpr int row_bytes(int k) { return QUANT ? k / 2 + k / 16 : 2 * k; }
__host__ __device__ constexpr int pow2_floor(int n) { return n >= 2 ? 2 * pow2_floor(n / 2) : 1; }
constexpr int VOCAB = 49152, CTX = 1024, QD = NH * HD, KVD = NKV * HD, QKV = QD + 2 * KVD;
constexpr int THREADS = (CW + 1) * 32, CT = CW * 32;
constexpr float EPS = 1e-5f;
constexpr double ROPE_BASE = 500000.0;
static_assert(QD == D, "the o product's rows and columns are both d here");

// The products, in the order a layer streams them, then the logits.
enum { M_QKV = 0, M_O = 1, M_GU = 2, M_DN = 3, M_LOG = 4 };
template <int M>
struct Mat {
    static constexpr int UNITS = M == M_QKV ? QKV / 2 : M == M_O ? D : M == M_GU ? FF : M == M_DN ? D : VOCAB;
    static constexpr int UR = (M == M_QKV || M == M_GU) ? 2 : 1;  // rows a unit
    static constexpr int K = M == M_O ? QD : M == M_DN ? FF : D;
    static constexpr int RB = row_bytes(K);                        // bytes a row
    static constexpr int UB = UR * RB;                             // bytes a unit
    static constexpr int UPC = pow2_floor(STB / UB);               // units a chunk
    static constexpr int RPC = UPC * UR;                           // rows a chunk
    static constexpr int WPR = CW;                                 // warps a row (each its columns)
    static constexpr int SEG = K / CW;                             // columns a warp
    static_assert(UB <= STB, "a unit fits a stage");
    static_assert(RPC <= 32 && (RPC & (RPC - 1)) == 0, "a chunk's rows reduce by halving");
    static_assert(SEG % 256 == 0, "a warp's segment is whole 256-column steps");
};

__host__ __device__ constexpr size_t up256(size_t n) { return (n + 255) / 256 * 256; }
constexpr size_t OFF_QKV = 0, OFF_O = OFF_QKV + up256((size_t)QKV * row_bytes(D)),
                 OFF_GU = OFF_O + up256((size_t)D * row_bytes(QD)),
                 OFF_DN = OFF_GU + up256((size_t)2 * FF * row_bytes(D)),
                 LAYER_BYTES = OFF_DN + up256((size_t)D * row_bytes(FF));
constexpr size_t EMB_BYTES = (size_t)VOCAB * row_bytes(D);

// Tagged-word areas of one set (two sets, by the parity of the layer counted
// over the launch).
constexpr int X_HO = 0, X_HD = X_HO + D, X_Q = X_HD + D, X_K = X_Q + QD, X_V = X_K + KVD, X_ACT = X_V + KVD,
              X_PART = X_ACT + FF, XW = X_PART + NH * ATT_S * (HD + 2);

struct Params {
    const unsigned char* w;    // NL layers of LAYER_BYTES
    const unsigned char* emb;  // VOCAB rows of D, the logits too
    const float* norms;        // NL x (attention, FFN) x D, then the output norm
    __half* kc;                // NL x NKV x CTX x HD
    __half* vc;
    u64* x;                    // 2 x XW tagged words
    u64* best;                 // 2 x blocks: each block's best logit key, by token parity
    u32* flags;                // blocks: the last token whose logits a block finished
    float* logits;             // the first LOGITS_KEPT tokens' logits
    u32* tokens;               // T
    unsigned long long* stats; // blocks x NSTAT counters (see main), then block 0's clock (kHz)
    u32 tok0, pos0, T;
};
constexpr u32 LOGITS_KEPT = 3;
// Row partials a block keeps: its most rows of any product (the logits'
// ceil(VOCAB / 120) for grids of 120 SMs or more), CW a row.
constexpr int PART_FLOATS = (VOCAB + 119) / 120 * CW;
constexpr int NSTAT = 8;  // a block's counters (see main)

__device__ __forceinline__ u32 sp_smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void sp_mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sp_smem(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void sp_mbar_expect_tx(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sp_smem(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void sp_mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sp_smem(bar)) : "memory");
}
// test_wait never suspends the thread (try_wait may, for a while, before it
// says no), so that the first test tells whether the phase had completed.
__device__ __forceinline__ bool sp_mbar_test(u64* bar, u32 parity, bool suspend) {
    u32 ok;
    if (suspend)
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(ok)
            : "r"(sp_smem(bar)), "r"(parity)
            : "memory");
    else
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(ok)
            : "r"(sp_smem(bar)), "r"(parity)
            : "memory");
    return ok != 0;
}
// Waits for the barrier's phase; returns the cycles it waited (0 when it
// had already completed).
__device__ __forceinline__ long long sp_mbar_wait(u64* bar, u32 parity) {
    if (sp_mbar_test(bar, parity, false)) return 0;
    const long long t0 = clock64();
    while (!sp_mbar_test(bar, parity, true)) {
    }
    return clock64() - t0;
}
__device__ __forceinline__ void sp_bulk_copy(void* dst, const void* src, u32 bytes, u64* bar, u64 policy) {
#if EVICT_FIRST
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
            sp_smem(dst)),
        "l"(src), "r"(bytes), "r"(sp_smem(bar)), "l"(policy)
        : "memory");
#else
    (void)policy;
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     sp_smem(dst)),
                 "l"(src), "r"(bytes), "r"(sp_smem(bar))
                 : "memory");
#endif
}
// The consumers' barrier (named barrier 1; the producer warp never joins).
__device__ __forceinline__ void csync() { asm volatile("bar.sync 1, %0;" ::"r"(CT) : "memory"); }

__device__ __forceinline__ float sp_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float sp_warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ void st_tag(u64* a, float v, u32 tag) {
    const u64 w = ((u64)tag << 32) | __float_as_uint(v);
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(a), "l"(w) : "memory");
}
__device__ __forceinline__ u64 ld_word(const u64* a) {
    u64 w;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(w) : "l"(a) : "memory");
    return w;
}
// SLEEP_NS: a waiting thread's pause between reloads of a word whose tag is
// not yet the awaited one. Every consumer thread of every block polls while
// it waits, and without a pause those reloads compete in L2 with the weight
// stream.
#ifndef SLEEP_NS
#define SLEEP_NS 0
#endif
__device__ __forceinline__ float wait_word(const u64* a, u64 w, u32 tag) {
    while ((u32)(w >> 32) != tag) {
#if SLEEP_NS > 0
        __nanosleep(SLEEP_NS);
#endif
        w = ld_word(a);
    }
    return __uint_as_float((u32)w);
}

// The tag of phase ph of layer l of token t (counted over the launch); 0 is
// never a tag (the words start zeroed).
__device__ __forceinline__ u32 tag_of(u32 t, u32 l, u32 ph) { return ((t * NL + l) * 8u + ph) + 1u; }
__device__ __forceinline__ u32 set_of(u32 t, u32 l) { return (t * NL + l) & 1u; }

// x in shared memory is stored permuted, so that lane i of a warp reads
// columns 8i..8i+7 of each 256-column step as two conflict-free float4:
// columns 8i..8i+3 in the step's first 128 floats, 8i+4..8i+7 in the next.
__device__ __forceinline__ u32 xperm(u32 k) {
    const u32 r = k & 255u, l = r >> 3, j = r & 7u;
    return (k & ~255u) + (j >> 2) * 128u + l * 4u + (j & 3u);
}
__device__ __forceinline__ float dot8(uint4 q, float4 a, float4 b) {
    const float2 w0 = __half22float2(*(const __half2*)&q.x), w1 = __half22float2(*(const __half2*)&q.y),
                 w2 = __half22float2(*(const __half2*)&q.z), w3 = __half22float2(*(const __half2*)&q.w);
    float s = w0.x * a.x;
    s = fmaf(w0.y, a.y, s);
    s = fmaf(w1.x, a.z, s);
    s = fmaf(w1.y, a.w, s);
    s = fmaf(w2.x, b.x, s);
    s = fmaf(w2.y, b.y, s);
    s = fmaf(w3.x, b.z, s);
    s = fmaf(w3.y, b.w, s);
    return s;
}

// Weight i of a row of the embedding (F16 or Q4_0).
__device__ __forceinline__ float emb_at(const unsigned char* row, u32 i) {
#if QUANT
    const u32 q = row[(i / 32) * 16 + (i % 16)];
    const float d = __half2float(((const __half*)(row + D / 2))[i / 32]);
    return d * (float)((int)((i % 32) < 16 ? (q & 15u) : (q >> 4)) - 8);
#else
    return __half2float(((const __half*)row)[i]);
#endif
}
// Nibble byte k of n (each byte 0..15) as a float: 2^23 + n_k built by a
// byte permutation, minus 2^23 (exact).
__device__ __forceinline__ float nib_f(u32 n, u32 k) {
    return __uint_as_float(__byte_perm(n, 0x4B000000u, 0x7540u | k)) - 8388608.0f;
}

__device__ __forceinline__ void block_range(u32 units, u32& u0, u32& u1) {
    u0 = (u32)((u64)units * blockIdx.x / gridDim.x);
    u1 = (u32)((u64)units * (blockIdx.x + 1) / gridDim.x);
}

struct Ring {
    unsigned char* buf;  // NST x STB
    u64* full;           // NST
    u64* empty;          // NST
};

// PF: chunks the producer asks L2 for ahead of its copies into the ring
// (cp.async.bulk.prefetch.L2), so that the stream from memory goes on while
// the consumers wait for an input longer than the ring lasts.
#ifndef PF
#define PF 0
#endif
template <int M>
__device__ __forceinline__ u32 chunks_of() {
    u32 u0, u1;
    block_range(Mat<M>::UNITS, u0, u1);
    return (u1 - u0 + Mat<M>::UPC - 1) / Mat<M>::UPC;
}
template <int M>
__device__ __forceinline__ void chunk_in(const unsigned char* base, u32 i, const unsigned char*& src, u32& bytes) {
    using T = Mat<M>;
    u32 u0, u1;
    block_range(T::UNITS, u0, u1);
    const u32 u = u0 + i * T::UPC;
    src = base + (size_t)u * T::UB;
    bytes = min((u32)T::UPC, u1 - u) * (u32)T::UB;
}
// Chunk c of this block's schedule (every layer's q|k|v, o, gate|up, down,
// then the logits, token after token): its source and size.
__device__ __forceinline__ void chunk_at(const unsigned char* w, const unsigned char* emb, u32 c,
                                         const unsigned char*& src, u32& bytes) {
    const u32 nq = chunks_of<M_QKV>(), no = chunks_of<M_O>(), ng = chunks_of<M_GU>(), nd = chunks_of<M_DN>();
    const u32 per_layer = nq + no + ng + nd, per_token = NL * per_layer + chunks_of<M_LOG>();
    u32 r = c % per_token;
    if (r >= NL * per_layer) return chunk_in<M_LOG>(emb, r - NL * per_layer, src, bytes);
    const unsigned char* L = w + (size_t)(r / per_layer) * LAYER_BYTES;
    r %= per_layer;
    if (r < nq) return chunk_in<M_QKV>(L + OFF_QKV, r, src, bytes);
    r -= nq;
    if (r < no) return chunk_in<M_O>(L + OFF_O, r, src, bytes);
    r -= no;
    if (r < ng) return chunk_in<M_GU>(L + OFF_GU, r, src, bytes);
    return chunk_in<M_DN>(L + OFF_DN, r - ng, src, bytes);
}
__device__ __forceinline__ void prefetch_l2(const void* src, u32 bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}

// The producer's side of product M: this block's units, chunk by chunk.
template <int M>
__device__ __forceinline__ void produce(const Ring& r, const unsigned char* base, u32& c, u64 policy,
                                       unsigned long long& waited) {
    using T = Mat<M>;
    u32 u0, u1;
    block_range(T::UNITS, u0, u1);
    for (u32 u = u0; u < u1; u += T::UPC, ++c) {
        const u32 s = c % NST, n = c / NST;
        if (n > 0) waited += sp_mbar_wait(&r.empty[s], (n - 1) & 1u);
        const u32 bytes = min((u32)T::UPC, u1 - u) * (u32)T::UB;
        sp_mbar_expect_tx(&r.full[s], bytes);
        sp_bulk_copy(r.buf + (size_t)s * STB, base + (size_t)u * T::UB, bytes, &r.full[s], policy);
    }
}

// The sums of N rows' lane partials over the warp, in N / 2 + N / 4 + ...
// + 5 - log2 N shuffles rather than 5 N: each halving step sends half the
// rows to the partner lane and keeps the other half. Afterwards lane l holds
// the sum of row (l >> (5 - log2 N)) % N.
template <int N>
__device__ __forceinline__ float reduce_rows(float (&v)[N], u32 lane) {
#pragma unroll
    for (int half = N / 2, off = 16; half >= 1; half /= 2, off /= 2) {
        const bool hi = (lane & (u32)off) != 0;
#pragma unroll
        for (int i = 0; i < half; ++i) {
            const float keep = hi ? v[i + half] : v[i], send = hi ? v[i] : v[i + half];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, off);
        }
    }
    float s = v[0];
#pragma unroll
    for (int off = 16 / N; off >= 1; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
    return s;
}
template <int N>
struct Log2 {
    static constexpr int v = N <= 1 ? 0 : 1 + Log2<N / 2>::v;
};
template <>
struct Log2<1> {
    static constexpr int v = 0;
};

// The consumers' side of product M: warp w takes columns [w SEG, (w + 1)
// SEG) of every row, its x in registers for the whole product, and each
// chunk's row partials into part (row-major by this block's rows, CW a
// row); returns this block's rows.
template <int M>
__device__ __forceinline__ u32 consume(const Ring& r, const float* xs, float* part, u32& c, unsigned long long& waited) {
    using T = Mat<M>;
    constexpr int STEPS = T::SEG / 256, N = T::RPC, SH = 5 - Log2<N>::v;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    u32 u0, u1;
    block_range(T::UNITS, u0, u1);
    float4 xa[STEPS], xb[STEPS];
#pragma unroll
    for (int i = 0; i < STEPS; ++i) {
        const float* x = xs + warp * T::SEG + i * 256;
        xa[i] = ((const float4*)x)[lane];
        xb[i] = ((const float4*)(x + 128))[lane];
    }
#if QUANT
    // Q4_0: lane l's columns 8l..8l+7 of a step are weights 8 (l % 4) .. + 7
    // of block l / 4: bytes 8 (l % 2) .. + 7, low nibbles for l % 4 < 2, high
    // ones otherwise. The -8 of every weight is taken out of the sum once:
    // d (sum q x - 8 sum x).
    float x8[STEPS];
#pragma unroll
    for (int i = 0; i < STEPS; ++i)
        x8[i] = 8.0f * (((xa[i].x + xa[i].y) + (xa[i].z + xa[i].w)) + ((xb[i].x + xb[i].y) + (xb[i].z + xb[i].w)));
    const u32 nshift = (lane & 2u) ? 4u : 0u;
#endif
    u32 ci = 0;
    for (u32 u = u0; u < u1; u += T::UPC, ++c, ++ci) {
        const u32 s = c % NST, n = c / NST;
        const long long wt = sp_mbar_wait(&r.full[s], n & 1u);
        if (threadIdx.x == 0) waited += wt;
        const u32 rows = min((u32)T::UPC, u1 - u) * T::UR;
        float acc[N];
#if QUANT
        const unsigned char* st = r.buf + (size_t)s * STB;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            const unsigned char* row = st + j * T::RB;
            float a = 0.0f;
#pragma unroll
            for (int i = 0; i < STEPS; ++i) {
                const u32 blk = (warp * T::SEG + i * 256) / 32 + lane / 4;
                const uint2 qv = *(const uint2*)(row + blk * 16 + 8 * (lane & 1u));
                const float d = __half2float(((const __half*)(row + T::K / 2))[blk]);
                const u32 n0 = (qv.x >> nshift) & 0x0F0F0F0Fu, n1 = (qv.y >> nshift) & 0x0F0F0F0Fu;
                float t = nib_f(n0, 0) * xa[i].x;
                t = fmaf(nib_f(n0, 1), xa[i].y, t);
                t = fmaf(nib_f(n0, 2), xa[i].z, t);
                t = fmaf(nib_f(n0, 3), xa[i].w, t);
                t = fmaf(nib_f(n1, 0), xb[i].x, t);
                t = fmaf(nib_f(n1, 1), xb[i].y, t);
                t = fmaf(nib_f(n1, 2), xb[i].z, t);
                t = fmaf(nib_f(n1, 3), xb[i].w, t);
                a = fmaf(d, t - x8[i], a);
            }
            acc[j] = a;
        }
#else
        const uint4* wq = (const uint4*)(r.buf + (size_t)s * STB) + warp * (T::SEG / 8) + lane;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            float a = 0.0f;
#pragma unroll
            for (int i = 0; i < STEPS; ++i) a += dot8(wq[j * (T::K / 8) + i * 32], xa[i], xb[i]);
            acc[j] = a;
        }
#endif
        __syncwarp();
        if (lane == 0) sp_mbar_arrive(&r.empty[s]);  // the stage is in registers
        const float sum = reduce_rows<N>(acc, lane);
        const u32 row = (lane >> SH) % N;
        if ((lane & ((1u << SH) - 1u)) == 0 && row < rows) part[(ci * N + row) * CW + warp] = sum;
    }
    csync();  // every row's partials are in part
    return (u1 - u0) * T::UR;
}
template <int M>
__device__ __forceinline__ float row_sum(const float* part, u32 r) {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < Mat<M>::WPR; ++j) s += part[r * Mat<M>::WPR + j];
    return s;
}

// Reloads, all in flight together, every word of w whose tag is not yet
// `tag`, until all carry it (POLL_SEQ=1: one word at a time, each stale
// word waited for in turn: a round trip for each word that had not arrived
// at the first load).
#ifndef POLL_SEQ
#define POLL_SEQ 0
#endif
template <int N, class F>
__device__ __forceinline__ void poll_words(u64 (&w)[N], F addr, u32 tag) {
#if POLL_SEQ
#pragma unroll
    for (int j = 0; j < N; ++j) w[j] = ((u64)tag << 32) | __float_as_uint(wait_word(addr(j), w[j], tag));
#else
    for (;;) {
        bool ok = true;
#pragma unroll
        for (int j = 0; j < N; ++j) ok &= (u32)(w[j] >> 32) == tag;
        if (ok) return;
#pragma unroll
        for (int j = 0; j < N; ++j)
            if ((u32)(w[j] >> 32) != tag) w[j] = ld_word(addr(j));
    }
#endif
}

// x = rmsnorm(h) * w, h the tagged words at src (or the embedding row when
// src is null), into xs (permuted). Ends synchronised.
__device__ void stage_norm(float* xs, float* red, const u64* src, u32 tag, const unsigned char* emb_row,
                           const float* nw) {
    constexpr int PER = D / CT;
    float v[PER], wn[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) wn[j] = nw[threadIdx.x + j * CT];  // before the wait
    if (src) {
        u64 w[PER];
        auto addr = [&](int j) { return src + threadIdx.x + j * CT; };
#pragma unroll
        for (int j = 0; j < PER; ++j) w[j] = ld_word(addr(j));
        poll_words(w, addr, tag);
#pragma unroll
        for (int j = 0; j < PER; ++j) v[j] = __uint_as_float((u32)w[j]);
    } else {
#pragma unroll
        for (int j = 0; j < PER; ++j) v[j] = emb_at(emb_row, threadIdx.x + j * CT);
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < PER; ++j) ss = fmaf(v[j], v[j], ss);
    ss = sp_warp_sum(ss);
    if ((threadIdx.x & 31u) == 0) red[threadIdx.x >> 5] = ss;
    csync();
    float tot = 0.0f;
#pragma unroll
    for (int i = 0; i < CW; ++i) tot += red[i];
    const float ri = (float)(1.0 / sqrt((double)tot / D + (double)EPS));
#pragma unroll
    for (int j = 0; j < PER; ++j) xs[xperm(threadIdx.x + j * CT)] = v[j] * ri * wn[j];
    csync();
}

// The o product's input: every head's attention, merged from its ATT_S
// partials (max, sum, values). Warp w merges heads w, w + CW, ..., two at a
// time, every word of both requested before the first is waited for.
__device__ void stage_attn(float* xs, const u64* part, u32 tag) {
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    constexpr int PW = HD + 2, VPL = HD / 32, HB = 2, NW = 1 + ATT_S * VPL;
    static_assert(NH % (CW * HB) == 0, "heads split evenly over warps, HB at a time");
    for (u32 h0 = warp * HB; h0 < NH; h0 += CW * HB) {
        // Word j of head h0 + j / NW: (max, sum) of split lane / 2 for j % NW
        // == 0 (lanes below 2 ATT_S), else values (split, lane + 32 k).
        auto addr = [&](int j) {
            const u64* p = part + (size_t)(h0 + j / NW) * ATT_S * PW;
            const int i = j % NW;
            if (i == 0) return p + (lane < 2 * ATT_S ? (lane >> 1) * PW + HD + (lane & 1u) : HD);
            return p + ((i - 1) / VPL) * PW + lane + 32 * ((i - 1) % VPL);
        };
        u64 w[HB * NW];
#pragma unroll
        for (int j = 0; j < HB * NW; ++j) w[j] = ld_word(addr(j));
        poll_words(w, addr, tag);
#pragma unroll
        for (int hb = 0; hb < HB; ++hb) {
            const float mlv = __uint_as_float((u32)w[hb * NW]);
            float m = -__int_as_float(0x7f800000);  // over the splits that saw a position
#pragma unroll
            for (int s = 0; s < ATT_S; ++s) {
                const float ms = __shfl_sync(0xffffffffu, mlv, 2 * s), ls = __shfl_sync(0xffffffffu, mlv, 2 * s + 1);
                m = fmaxf(m, ls > 0.0f ? ms : -__int_as_float(0x7f800000));
            }
            float den = 0.0f, out[VPL] = {};
#pragma unroll
            for (int s = 0; s < ATT_S; ++s) {
                const float ms = __shfl_sync(0xffffffffu, mlv, 2 * s), ls = __shfl_sync(0xffffffffu, mlv, 2 * s + 1);
                const float e = ls > 0.0f ? expf(ms - m) : 0.0f;
                den += ls * e;
#pragma unroll
                for (int k = 0; k < VPL; ++k) out[k] += e * __uint_as_float((u32)w[hb * NW + 1 + s * VPL + k]);
            }
            const float inv = 1.0f / den;
#pragma unroll
            for (int k = 0; k < VPL; ++k) xs[xperm((h0 + hb) * HD + lane + 32 * k)] = out[k] * inv;
        }
    }
    csync();
}

// x = the tagged words at src (the FFN activation), permuted, 16 words a
// thread in flight at a time.
__device__ void stage_plain(float* xs, const u64* src, u32 n, u32 tag) {
    constexpr int PER = 16;
    for (u32 b = 0; b < n; b += PER * CT) {
        auto addr = [&](int j) { return src + b + threadIdx.x + j * CT; };
        u64 w[PER];
#pragma unroll
        for (int j = 0; j < PER; ++j) w[j] = b + threadIdx.x + j * CT < n ? ld_word(addr(j)) : (u64)tag << 32;
        poll_words(w, addr, tag);
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const u32 i = b + threadIdx.x + j * CT;
            if (i < n) xs[xperm(i)] = __uint_as_float((u32)w[j]);
        }
    }
    csync();
}

// ATT_PRE: the attention block requests its cached K/V rows before it
// waits for q: 1, thread i's K row into registers and its V row into L1;
// 2, both rows into L1 (heads of 128: their K row in registers spills);
// 0, after the wait.
#ifndef ATT_PRE
#define ATT_PRE (SHAPE == 8 ? 2 : 1)
#endif
// One (head, split)'s attention over positions [p0, p1) of kv_len = pos + 1:
// the current position's k and v from the tagged words, the rest from the
// cache. Writes (max, sum, values) as tagged words.
__device__ void attend(const Params& a, u32 l, u32 pos, u32 h, u32 s, const u64* X, u64* part, u32 tag_qkv,
                       u32 tag_att, float* sm) {
    const u32 kvh = h / (NH / NKV), kv = pos + 1;
    const u32 p0 = (u32)((u64)kv * s / ATT_S), p1 = (u32)((u64)kv * (s + 1) / ATT_S);
    float* q = sm;             // HD
    float* kcur = q + HD;      // HD
    float* vcur = kcur + HD;   // HD
    float* sc = vcur + HD;     // CTX
    float* acc = sc + CTX;     // CW x HD
    float* red = acc + CW * HD;  // 2 CW
    const u32 tid = threadIdx.x, warp = tid >> 5, lane = tid & 31u;
    const size_t cbase = ((size_t)l * NKV + kvh) * CTX * HD;
    const __half* K = a.kc + cbase;
    const __half* V = a.vc + cbase;
#if ATT_PRE
    // The cached rows do not depend on q: thread i's rows (position p0 + i)
    // before the wait for q. L1 holds no stale copy of them: a row is read
    // only after the token that wrote it, and no line holds two rows.
    const u32 ppre = p0 + tid;
#if ATT_PRE == 1
    uint4 kpre[HD / 8];
#endif
    if (ppre < min(p1, pos)) {
#if ATT_PRE == 1
        const uint4* kr = (const uint4*)(K + (size_t)ppre * HD);
#pragma unroll
        for (int i = 0; i < HD / 8; ++i) kpre[i] = kr[i];
#else
        const char* kr = (const char*)(K + (size_t)ppre * HD);
#pragma unroll
        for (int b = 0; b < HD * 2; b += 128) asm volatile("prefetch.global.L1 [%0];" ::"l"(kr + b));
#endif
        const char* vr = (const char*)(V + (size_t)ppre * HD);
#pragma unroll
        for (int b = 0; b < HD * 2; b += 128) asm volatile("prefetch.global.L1 [%0];" ::"l"(vr + b));
    }
#endif
    for (u32 i = tid; i < 3 * HD; i += CT) {
        if (i < HD) {
            const u64* qs = X + X_Q + h * HD + i;
            q[i] = wait_word(qs, ld_word(qs), tag_qkv) * rsqrtf((float)HD);
        } else if (p1 == kv) {
            const u32 j = i - HD;
            const u64* src = X + (j < HD ? X_K : X_V) + kvh * HD + (j % HD);
            const float v = __half2float(__float2half_rn(wait_word(src, ld_word(src), tag_qkv)));
            (j < HD ? kcur : vcur)[j % HD] = v;
        }
    }
    csync();
    float mx = -__int_as_float(0x7f800000);
    for (u32 p = p0 + tid; p < p1; p += CT) {
        float d = 0.0f;
        if (p == pos) {
#pragma unroll 8
            for (int i = 0; i < HD; ++i) d = fmaf(q[i], kcur[i], d);
        } else {
            const uint4* kr = (const uint4*)(K + (size_t)p * HD);
            uint4 kw[HD / 8];
#if ATT_PRE == 1
            if (p == ppre) {
#pragma unroll
                for (int i = 0; i < HD / 8; ++i) kw[i] = kpre[i];
            } else
#endif
            {
#pragma unroll
                for (int i = 0; i < HD / 8; ++i) kw[i] = kr[i];
            }
#pragma unroll
            for (int i = 0; i < HD / 8; ++i) {
                const uint4 w = kw[i];
                const float2 k0 = __half22float2(*(const __half2*)&w.x), k1 = __half22float2(*(const __half2*)&w.y),
                             k2 = __half22float2(*(const __half2*)&w.z), k3 = __half22float2(*(const __half2*)&w.w);
                d = fmaf(q[8 * i], k0.x, d);
                d = fmaf(q[8 * i + 1], k0.y, d);
                d = fmaf(q[8 * i + 2], k1.x, d);
                d = fmaf(q[8 * i + 3], k1.y, d);
                d = fmaf(q[8 * i + 4], k2.x, d);
                d = fmaf(q[8 * i + 5], k2.y, d);
                d = fmaf(q[8 * i + 6], k3.x, d);
                d = fmaf(q[8 * i + 7], k3.y, d);
            }
        }
        sc[p - p0] = d;
        mx = fmaxf(mx, d);
    }
    mx = sp_warp_max(mx);
    if (lane == 0) red[warp] = mx;
    csync();
    float m = -__int_as_float(0x7f800000);
#pragma unroll
    for (int i = 0; i < CW; ++i) m = fmaxf(m, red[i]);
    float l_sum = 0.0f;
    for (u32 p = p0 + tid; p < p1; p += CT) {
        const float e = expf(sc[p - p0] - m);
        sc[p - p0] = e;
        l_sum += e;
    }
    l_sum = sp_warp_sum(l_sum);
    if (lane == 0) red[CW + warp] = l_sum;
    csync();
    // Values: warp w takes positions p0 + w, p0 + w + CW, ...; lane the
    // columns 2 lane, 2 lane + 1 (HD 64) or 4 lane .. 4 lane + 3 (HD 128).
    constexpr int VPL = HD / 32;
    // Cached positions 8 at a time, so that their loads are in flight
    // together; the current position's values from vcur.
    float o[VPL] = {};
    const u32 pc = min(p1, pos);  // cached positions end here
    constexpr int UNR = 8;
    for (u32 b = p0 + warp * UNR; b < pc; b += CW * UNR) {
        __half2 v[UNR][VPL / 2];
#pragma unroll
        for (int u = 0; u < UNR; ++u) {
            const __half2* vr = (const __half2*)(V + (size_t)min(b + u, pc - 1) * HD + VPL * lane);
#pragma unroll
            for (int j = 0; j < VPL / 2; ++j) v[u][j] = vr[j];
        }
#pragma unroll
        for (int u = 0; u < UNR; ++u) {
            const float e = b + u < pc ? sc[b + u - p0] : 0.0f;
#pragma unroll
            for (int j = 0; j < VPL / 2; ++j) {
                const float2 f = __half22float2(v[u][j]);
                o[2 * j] = fmaf(e, f.x, o[2 * j]);
                o[2 * j + 1] = fmaf(e, f.y, o[2 * j + 1]);
            }
        }
    }
    if (p1 == kv && warp == CW - 1) {
        const float e = sc[pos - p0];
#pragma unroll
        for (int j = 0; j < VPL; ++j) o[j] = fmaf(e, vcur[VPL * lane + j], o[j]);
    }
#pragma unroll
    for (int j = 0; j < VPL; ++j) acc[warp * HD + VPL * lane + j] = o[j];
    csync();
    u64* dst = part + ((size_t)h * ATT_S + s) * (HD + 2);
    if (tid < HD) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < CW; ++w) v += acc[w * HD + tid];
        st_tag(dst + tid, v, tag_att);
    } else if (tid < HD + 2) {
        float ls = 0.0f;
#pragma unroll
        for (int w = 0; w < CW; ++w) ls += red[CW + w];
        st_tag(dst + tid, tid == HD ? (p1 > p0 ? m : 0.0f) : ls, tag_att);
    }
}

__device__ __forceinline__ u64 logit_key(float v, u32 idx) {
    u32 b = __float_as_uint(v);
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)b << 32) | (u64)(0xffffffffu - idx);  // ties: the lower index
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) k_stream(Params a) {
    extern __shared__ __align__(128) unsigned char smem[];
    Ring r;
    r.buf = smem;
    float* xs = (float*)(smem + (size_t)NST * STB);  // FF floats (the widest input)
    float* part = xs + FF;                            // PART_FLOATS
    float* hloc = part + PART_FLOATS;                 // 64: this block's h rows
    float* red = hloc + 64;                           // 64
    float* att = red + 64;                            // attention scratch
    u64* bars = (u64*)(att + 3 * HD + CTX + CW * HD + 2 * CW + 32);
    bars = (u64*)(((unsigned long long)bars + 7) & ~(unsigned long long)7);
    r.full = bars;
    r.empty = bars + NST;
    u64* keys = bars + 2 * NST;  // CW

    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    if (threadIdx.x == 0) {
        for (int s = 0; s < NST; ++s) {
            sp_mbar_init(&r.full[s], 1);
            sp_mbar_init(&r.empty[s], CW);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warp == CW) {
        // The producer: the whole launch's schedule of this block's rows.
        if (lane == 0) {
            u64 policy = 0;
#if EVICT_FIRST
            asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
#endif
            unsigned long long waited = 0;
            u32 c = 0;
#if PF > 0
            {
                const u32 nq = chunks_of<M_QKV>(), no = chunks_of<M_O>(), ng = chunks_of<M_GU>(), nd = chunks_of<M_DN>();
                const u32 total = a.T * (NL * (nq + no + ng + nd) + chunks_of<M_LOG>());
                for (u32 i = 0; i < PF && i < total; ++i) {
                    const unsigned char* src;
                    u32 bytes;
                    chunk_at(a.w, a.emb, i, src, bytes);
                    prefetch_l2(src, bytes);
                }
                for (; c < total; ++c) {
                    if (c + PF < total) {
                        const unsigned char* src;
                        u32 bytes;
                        chunk_at(a.w, a.emb, c + PF, src, bytes);
                        prefetch_l2(src, bytes);
                    }
                    const u32 s = c % NST, n = c / NST;
                    if (n > 0) waited += sp_mbar_wait(&r.empty[s], (n - 1) & 1u);
                    const unsigned char* src;
                    u32 bytes;
                    chunk_at(a.w, a.emb, c, src, bytes);
                    sp_mbar_expect_tx(&r.full[s], bytes);
                    sp_bulk_copy(r.buf + (size_t)s * STB, src, bytes, &r.full[s], policy);
                }
            }
#else
            for (u32 t = 0; t < a.T; ++t) {
                for (u32 l = 0; l < NL; ++l) {
                    const unsigned char* L = a.w + (size_t)l * LAYER_BYTES;
                    produce<M_QKV>(r, L + OFF_QKV, c, policy, waited);
                    produce<M_O>(r, L + OFF_O, c, policy, waited);
                    produce<M_GU>(r, L + OFF_GU, c, policy, waited);
                    produce<M_DN>(r, L + OFF_DN, c, policy, waited);
                }
                produce<M_LOG>(r, a.emb, c, policy, waited);
            }
#endif
            a.stats[blockIdx.x * NSTAT + 0] = waited;
        }
        return;
    }

    // The consumers.
    // Cycles in the stagings (the wait for the input and its load), by
    // phase: q|k|v, attention, o, gate|up, down, logits.
    unsigned long long w_weights = 0, w_st[6] = {};
    const long long clk0 = clock64();
    u64 ns0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns0));
    u32 c = 0;
    u32 h0, h1;
    block_range(D, h0, h1);  // this block's h rows (o and down rows)
    u32 token = a.tok0;
    for (u32 t = 0; t < a.T; ++t) {
        const u32 pos = a.pos0 + t;
        if (t > 0) {
            // The argmax of every block's best of the last token (their flags
            // also publish the K/V rows they wrote).
            if (threadIdx.x < gridDim.x) {
                u32 f;
                for (;;) {
                    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(f) : "l"(a.flags + threadIdx.x) : "memory");
                    if (f >= t) break;
#if SLEEP_NS > 0
                    __nanosleep(SLEEP_NS);
#endif
                }
            }
            csync();
            u64 k = 0;
            for (u32 i = threadIdx.x; i < gridDim.x; i += CT) k = max(k, ld_word(a.best + ((t - 1) & 1u) * gridDim.x + i));
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) k = max(k, __shfl_xor_sync(0xffffffffu, k, o));
            if (lane == 0) keys[warp] = k;
            csync();
            u64 b = 0;
#pragma unroll
            for (int i = 0; i < CW; ++i) b = max(b, keys[i]);
            token = 0xffffffffu - (u32)(b & 0xffffffffu);
            if (threadIdx.x == 0) a.tokens[t] = token;
        } else if (threadIdx.x == 0) {
            a.tokens[0] = token;
        }
        const unsigned char* erow = a.emb + (size_t)token * row_bytes(D);
        for (u32 i = h0 + threadIdx.x; i < h1; i += CT) hloc[i - h0] = emb_at(erow, i);

        for (u32 l = 0; l < NL; ++l) {
            const u32 set = set_of(t, l);
            u64* X = a.x + (size_t)set * XW;
            const float* nrm = a.norms + (size_t)l * 2 * D;
            long long t0 = clock64();
            // q|k|v: the norm of h, the rows, RoPE, the K/V cache.
            if (l == 0)
                stage_norm(xs, red, nullptr, 0, erow, nrm);
            else
                stage_norm(xs, red, a.x + (size_t)set_of(t, l - 1) * XW + X_HD, tag_of(t, l - 1, 4), nullptr, nrm);
            if (threadIdx.x == 0) w_st[0] += clock64() - t0;
            {
                const u32 rows = consume<M_QKV>(r, xs, part, c, w_weights);
                u32 u0, u1;
                block_range(Mat<M_QKV>::UNITS, u0, u1);
                const u32 tg = tag_of(t, l, 0);
                for (u32 i = threadIdx.x; i < rows / 2; i += CT) {
                    const u32 row = 2 * (u0 + i);
                    float y0 = row_sum<M_QKV>(part, 2 * i), y1 = row_sum<M_QKV>(part, 2 * i + 1);
                    if (row < QD + KVD) {
                        const u32 pi = (row % HD) / 2;
                        const double inv = pow(ROPE_BASE, -2.0 * (double)pi / (double)HD);
                        double sn, cs;
                        sincos((double)pos * inv, &sn, &cs);
                        const float c0 = (float)cs, s0 = (float)sn;
                        const float r0 = y0 * c0 - y1 * s0, r1 = y0 * s0 + y1 * c0;
                        y0 = r0;
                        y1 = r1;
                    }
                    if (row < QD) {
                        st_tag(X + X_Q + row, y0, tg);
                        st_tag(X + X_Q + row + 1, y1, tg);
                    } else {
                        const bool is_k = row < QD + KVD;
                        const u32 j = row - (is_k ? QD : QD + KVD);
                        st_tag(X + (is_k ? X_K : X_V) + j, y0, tg);
                        st_tag(X + (is_k ? X_K : X_V) + j + 1, y1, tg);
                        __half* cache = (is_k ? a.kc : a.vc) + (((size_t)l * NKV + j / HD) * CTX + pos) * HD + j % HD;
                        *(__half2*)cache = __floats2half2_rn(y0, y1);
                    }
                }
            }
            // Attention: blocks below NH * ATT_S take one (head, split).
            t0 = clock64();
            if (blockIdx.x < NH * ATT_S)
                attend(a, l, pos, blockIdx.x / ATT_S, blockIdx.x % ATT_S, X, X + X_PART, tag_of(t, l, 0),
                       tag_of(t, l, 1), att);
            if (threadIdx.x == 0) w_st[1] += clock64() - t0;
            // o: h += Wo att.
            t0 = clock64();
            stage_attn(xs, X + X_PART, tag_of(t, l, 1));
            if (threadIdx.x == 0) w_st[2] += clock64() - t0;
            {
                consume<M_O>(r, xs, part, c, w_weights);
                const u32 tg = tag_of(t, l, 2);
                for (u32 i = threadIdx.x; i < h1 - h0; i += CT) {
                    hloc[i] += row_sum<M_O>(part, i);
                    st_tag(X + X_HO + h0 + i, hloc[i], tg);
                }
            }
            // gate|up: the norm of h, SiLU(gate) * up.
            t0 = clock64();
            stage_norm(xs, red, X + X_HO, tag_of(t, l, 2), nullptr, nrm + D);
            if (threadIdx.x == 0) w_st[3] += clock64() - t0;
            {
                const u32 rows = consume<M_GU>(r, xs, part, c, w_weights);
                u32 u0, u1;
                block_range(Mat<M_GU>::UNITS, u0, u1);
                const u32 tg = tag_of(t, l, 3);
                for (u32 i = threadIdx.x; i < rows / 2; i += CT) {
                    const float g = row_sum<M_GU>(part, 2 * i), u = row_sum<M_GU>(part, 2 * i + 1);
                    st_tag(X + X_ACT + u0 + i, g / (1.0f + expf(-g)) * u, tg);
                }
            }
            // down: h += Wd act.
            t0 = clock64();
            stage_plain(xs, X + X_ACT, FF, tag_of(t, l, 3));
            if (threadIdx.x == 0) w_st[4] += clock64() - t0;
            {
                consume<M_DN>(r, xs, part, c, w_weights);
                const u32 tg = tag_of(t, l, 4);
                for (u32 i = threadIdx.x; i < h1 - h0; i += CT) {
                    hloc[i] += row_sum<M_DN>(part, i);
                    st_tag(X + X_HD + h0 + i, hloc[i], tg);
                }
            }
        }
        // Logits: the output norm, this block's rows, its best.
        long long t0 = clock64();
        stage_norm(xs, red, a.x + (size_t)set_of(t, NL - 1) * XW + X_HD, tag_of(t, NL - 1, 4), nullptr,
                   a.norms + (size_t)NL * 2 * D);
        if (threadIdx.x == 0) w_st[5] += clock64() - t0;
        {
            const u32 rows = consume<M_LOG>(r, xs, part, c, w_weights);
            u32 u0, u1;
            block_range(VOCAB, u0, u1);
            u64 k = 0;
            for (u32 i = threadIdx.x; i < rows; i += CT) {
                const float v = row_sum<M_LOG>(part, i);
                if (t < LOGITS_KEPT) a.logits[(size_t)t * VOCAB + u0 + i] = v;
                k = max(k, logit_key(v, u0 + i));
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) k = max(k, __shfl_xor_sync(0xffffffffu, k, o));
            if (lane == 0) keys[warp] = k;
            csync();
            if (threadIdx.x == 0) {
                u64 b = 0;
                for (int i = 0; i < CW; ++i) b = max(b, keys[i]);
                asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(a.best + (t & 1u) * gridDim.x + blockIdx.x),
                             "l"(b)
                             : "memory");
                asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(a.flags + blockIdx.x), "r"(t + 1) : "memory");
            }
        }
    }
    if (threadIdx.x == 0) {
        a.stats[blockIdx.x * NSTAT + 1] = w_weights;
        for (int i = 0; i < 6; ++i) a.stats[blockIdx.x * NSTAT + 2 + i] = w_st[i];
        u64 ns1;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns1));
        if (blockIdx.x == 0)
            a.stats[gridDim.x * NSTAT] = (unsigned long long)(clock64() - clk0) * 1000000ull / max(ns1 - ns0, (u64)1);
    }
}

#ifndef __CUDACC_RTC__
#define CK(x)                                                              \
    do {                                                                   \
        cudaError_t e_ = (x);                                              \
        if (e_ != cudaSuccess) {                                           \
            printf("%s: %s\n", #x, cudaGetErrorString(e_));                \
            exit(1);                                                       \
        }                                                                  \
    } while (0)

// The random bits of element i of a fill with `seed` (a SplitMix64 step).
__device__ __forceinline__ u64 fill_hash(size_t i, u32 seed) {
    u64 z = (u64)i * 0x9E3779B97F4A7C15ull + ((u64)seed << 32) + 0x632BE59BD9B4E019ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Random values on the device: a hash of the index, uniform in [-1, 1).
__global__ void k_fill_half(__half* p, size_t n, u32 seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const u64 z = fill_hash(i, seed);
        const float u = (float)(z >> 40) * (1.0f / 8388608.0f) - 1.0f;
        p[i] = __float2half_rn(u * scale);
    }
}
static void fill(__half* p, size_t n, u32 seed, float scale) {
    k_fill_half<<<1024, 256>>>(p, n, seed, scale);
    CK(cudaGetLastError());
}

// Random Q4_0 rows: random quant bytes, scales dscale (0.5 + u).
__global__ void k_fill_q40(unsigned char* p, size_t rows, int k, u32 seed, float dscale) {
    const size_t rb = (size_t)row_bytes(k), total = rows * rb;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const u64 z = fill_hash(i, seed);
        const size_t o = i % rb;
        if (o < (size_t)k / 2) {
            p[i] = (unsigned char)(z >> 56);
        } else if ((o - k / 2) % 2 == 0) {
            const float u = (float)(z >> 40) * (1.0f / 16777216.0f);
            *(__half*)(p + i) = __float2half_rn(dscale * (0.5f + u));
        }
    }
}
// A matrix of rows x k at p: F16 uniform in [-scale, scale), or Q4_0 of the
// same variance.
static void fill_mat(unsigned char* p, size_t rows, int k, u32 seed, float scale) {
#if QUANT
    // E[(q - 8)^2] = 21.5 over q in 0..15, E[(0.5 + u)^2] = 13 / 12.
    k_fill_q40<<<1024, 256>>>(p, rows, k, seed, scale / sqrtf(3.0f * 21.5f * 13.0f / 12.0f));
    CK(cudaGetLastError());
#else
    fill((__half*)p, rows * (size_t)k, seed, scale);
#endif
}

static std::vector<float> to_float(const __half* d, size_t n) {
    std::vector<__half> h(n);
    CK(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost));
    std::vector<float> f(n);
#pragma omp parallel for
    for (long long i = 0; i < (long long)n; ++i) f[i] = __half2float(h[i]);
    return f;
}

// A matrix of rows x k on the device, as floats (dequantized).
static std::vector<float> mat_to_float(const unsigned char* d, size_t rows, int k) {
#if QUANT
    const size_t rb = (size_t)row_bytes(k);
    std::vector<unsigned char> h(rows * rb);
    CK(cudaMemcpy(h.data(), d, h.size(), cudaMemcpyDeviceToHost));
    std::vector<float> f(rows * (size_t)k);
#pragma omp parallel for
    for (long long r = 0; r < (long long)rows; ++r) {
        const unsigned char* row = &h[(size_t)r * rb];
        for (int i = 0; i < k; ++i) {
            const unsigned q = row[(i / 32) * 16 + (i % 16)];
            __half dh;
            memcpy(&dh, row + k / 2 + 2 * (i / 32), 2);
            const int nib = (i % 32) < 16 ? (int)(q & 15u) : (int)(q >> 4);
            f[(size_t)r * k + i] = __half2float(dh) * (float)(nib - 8);
        }
    }
    return f;
#else
    return to_float((const __half*)d, rows * (size_t)k);
#endif
}

// y = W x for a row-major F16 matrix (as floats), in double.
static void matvec(const float* W, const std::vector<double>& x, std::vector<double>& y, int rows, int k) {
    y.assign(rows, 0.0);
#pragma omp parallel for
    for (int r = 0; r < rows; ++r) {
        const float* w = W + (size_t)r * k;
        double s = 0.0;
        for (int i = 0; i < k; ++i) s += (double)w[i] * x[i];
        y[r] = s;
    }
}
static float round_half(double v) { return __half2float(__float2half_rn((float)v)); }

int main(int argc, char** argv) {
    int sms = 0;
    CK(cudaSetDevice(0));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const u32 T = argc > 1 ? (u32)atoi(argv[1]) : 128u;
    const u32 pos0 = argc > 2 ? (u32)atoi(argv[2]) : 512u;
    const int blocks = sms;
    if (T < 1 || pos0 + T > CTX || blocks > CT || blocks < 120 || NH * ATT_S > blocks) {
        printf("need 1 <= tokens, position + tokens <= %d, 120 <= SMs <= %d and >= %d\n", CTX, CT, NH * ATT_S);
        return 1;
    }
    const size_t wbytes = (size_t)NL * LAYER_BYTES;
    const double floor_bytes = (double)NL * ((double)QKV * row_bytes(D) + (double)D * row_bytes(QD) +
                                             2.0 * FF * row_bytes(D) + (double)D * row_bytes(FF)) +
                               (double)EMB_BYTES;
    printf("%s, %d SMs; shape %s (%d layers, d %d, FFN %d, heads %d/%d of %d), %u tokens from position %u; "
           "%d consumer warps, %d stages of %d bytes, attention split %d, evict-first %d\n",
           prop.name, sms,
           SHAPE == 8 ? (QUANT ? "llama-8b q4_0" : "llama-8b f16") : (QUANT ? "llama-1b q4_0" : "llama-1b f16"), NL, D, FF, NH, NKV, HD, T, pos0, CW, NST,
           STB, ATT_S, EVICT_FIRST);

    unsigned char* dw;
    unsigned char* demb;
    __half *dkc, *dvc;
    float* dnorms;
    CK(cudaMalloc(&dw, wbytes));
    CK(cudaMalloc(&demb, EMB_BYTES));
    const size_t cache = (size_t)NL * NKV * CTX * HD;
    CK(cudaMalloc(&dkc, cache * 2));
    CK(cudaMalloc(&dvc, cache * 2));
    for (int l = 0; l < NL; ++l) {
        unsigned char* L = dw + (size_t)l * LAYER_BYTES;
        fill_mat(L + OFF_QKV, QKV, D, 10 * l + 1, sqrtf(3.0f / D));
        fill_mat(L + OFF_O, D, QD, 10 * l + 2, sqrtf(3.0f / QD));
        fill_mat(L + OFF_GU, 2 * (size_t)FF, D, 10 * l + 3, sqrtf(3.0f / D));
        fill_mat(L + OFF_DN, D, FF, 10 * l + 4, sqrtf(3.0f / FF));
    }
    fill_mat(demb, VOCAB, D, 7777, 4.0f * sqrtf(3.0f / D));
    fill(dkc, cache, 8888, 1.0f);
    fill(dvc, cache, 9999, 1.0f);
    std::vector<float> norms((size_t)(2 * NL + 1) * D);
    for (size_t i = 0; i < norms.size(); ++i) norms[i] = 0.5f + (float)((i * 2654435761u) % 1000u) / 1000.0f;
    CK(cudaMalloc(&dnorms, norms.size() * 4));
    CK(cudaMemcpy(dnorms, norms.data(), norms.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaDeviceSynchronize());
    // The random cache below the start position, kept to restore before each launch.
    __half *kc0, *vc0;
    CK(cudaMalloc(&kc0, cache * 2));
    CK(cudaMalloc(&vc0, cache * 2));
    CK(cudaMemcpy(kc0, dkc, cache * 2, cudaMemcpyDeviceToDevice));
    CK(cudaMemcpy(vc0, dvc, cache * 2, cudaMemcpyDeviceToDevice));

    // The device copy's bandwidth (read + write), as akunu bench measures it.
    double copy_gbs = 0.0;
    {
        const size_t n = (size_t)1 << 30;
        void *s, *d;
        CK(cudaMalloc(&s, n));
        CK(cudaMalloc(&d, n));
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        float best = 1e9f;
        for (int i = 0; i < 6; ++i) {
            CK(cudaEventRecord(e0));
            CK(cudaMemcpy(d, s, n, cudaMemcpyDeviceToDevice));
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            if (i > 0) best = std::min(best, ms);
        }
        copy_gbs = 2.0 * n / (best * 1e-3) / 1e9;
        CK(cudaFree(s));
        CK(cudaFree(d));
    }

    Params p = {};
    u64 *dx, *dbest;
    u32 *dflags, *dtok;
    float* dlog;
    unsigned long long* dstats;
    CK(cudaMalloc(&dx, 2 * (size_t)XW * 8));
    CK(cudaMalloc(&dbest, 2 * (size_t)blocks * 8));
    CK(cudaMalloc(&dflags, blocks * 4));
    CK(cudaMalloc(&dtok, T * 4));
    CK(cudaMalloc(&dlog, (size_t)LOGITS_KEPT * VOCAB * 4));
    CK(cudaMalloc(&dstats, ((size_t)blocks * NSTAT + 1) * 8));
    p = {dw, demb, dnorms, dkc, dvc, dx, dbest, dflags, dlog, dtok, dstats, 11u, pos0, T};

    const size_t smem = (size_t)NST * STB + (size_t)(FF + PART_FLOATS + 64 + 64 + 3 * HD + CTX + CW * HD + 2 * CW + 32) * 4 +
                        8 + (2 * NST + CW) * 8;
    if (smem > prop.sharedMemPerBlockOptin) {
        printf("%zu bytes of shared memory a block needed, %zu the most (fewer stages: NST)\n", smem,
               (size_t)prop.sharedMemPerBlockOptin);
        return 1;
    }
    CK(cudaFuncSetAttribute(k_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    void* args[] = {&p};
    std::vector<float> us;
    for (int rr = 0; rr < 6; ++rr) {
        CK(cudaMemcpyAsync(dkc, kc0, cache * 2, cudaMemcpyDeviceToDevice, st));
        CK(cudaMemcpyAsync(dvc, vc0, cache * 2, cudaMemcpyDeviceToDevice, st));
        CK(cudaMemsetAsync(dflags, 0, blocks * 4, st));
        CK(cudaMemsetAsync(dx, 0, 2 * (size_t)XW * 8, st));
        CK(cudaEventRecord(e0, st));
        CK(cudaLaunchCooperativeKernel((void*)k_stream, blocks, THREADS, args, smem, st));
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (rr > 0) us.push_back(ms * 1000.0f / T);
    }
    std::sort(us.begin(), us.end());
    const double med = us[us.size() / 2];
    const double floor_us = floor_bytes / (copy_gbs * 1e9) * 1e6;
    printf("device copy %.0f GB/s; weights %.3f GB a token, floor %.1f us (%.0f tok/s)\n", copy_gbs, floor_bytes / 1e9,
           floor_us, 1e6 / floor_us);
    printf("stream: %.2f us a token, %.1f tok/s, %.1f%% of the floor (runs %.2f .. %.2f us)\n", med, 1e6 / med,
           100.0 * floor_us / med, us.front(), us.back());
    {
        // Counters, cycles a token: [0] the producer waiting for a stage to be
        // freed (with the ring full it always is: not a measure of the
        // stream's idleness, and not printed), [1] the consumers waiting
        // for weights (thread 0 of the block), [2..7]
        // the stagings of q|k|v, attention (its blocks only), o, gate|up,
        // down, logits: the wait for the input and its load.
        std::vector<unsigned long long> s((size_t)blocks * NSTAT + 1);
        CK(cudaMemcpy(s.data(), dstats, s.size() * 8, cudaMemcpyDeviceToHost));
        const double khz = (double)s[(size_t)blocks * NSTAT];
        printf("cycles a token (SM clock %.0f MHz; %.0f a token), over blocks: least / average / most:\n", khz / 1000.0,
               med * khz / 1000.0);
        const char* names[NSTAT] = {"producer stalled", "weights awaited", "qkv staging", "attention",
                                    "o staging",        "gu staging",      "down staging", "logits staging"};
        for (int k = 1; k < NSTAT; ++k) {
            double sum = 0.0, mx = 0.0, mn = 1e30;
            int n = 0;
            for (int b = 0; b < blocks; ++b) {
                if (k == 3 && b >= NH * ATT_S) continue;
                sum += (double)s[(size_t)b * NSTAT + k];
                mx = std::max(mx, (double)s[(size_t)b * NSTAT + k]);
                mn = std::min(mn, (double)s[(size_t)b * NSTAT + k]);
                ++n;
            }
            printf("  %-16s %9.0f / %9.0f / %9.0f\n", names[k], mn / T, sum / n / T, mx / T);
        }
    }

    // The check: the CPU's first tokens against the kernel's.
    std::vector<u32> tok(T);
    CK(cudaMemcpy(tok.data(), dtok, T * 4, cudaMemcpyDeviceToHost));
    const u32 steps = std::min<u32>(T, LOGITS_KEPT);
    std::vector<float> lg((size_t)steps * VOCAB);
    CK(cudaMemcpy(lg.data(), dlog, lg.size() * 4, cudaMemcpyDeviceToHost));
    std::vector<float> emb = mat_to_float(demb, VOCAB, D);
    std::vector<float> kc = to_float(kc0, cache), vc = to_float(vc0, cache);
    std::vector<std::vector<float>> Wl(NL * 4);
    for (int l = 0; l < NL; ++l) {
        const unsigned char* L = dw + (size_t)l * LAYER_BYTES;
        Wl[4 * l] = mat_to_float(L + OFF_QKV, QKV, D);
        Wl[4 * l + 1] = mat_to_float(L + OFF_O, D, QD);
        Wl[4 * l + 2] = mat_to_float(L + OFF_GU, 2 * (size_t)FF, D);
        Wl[4 * l + 3] = mat_to_float(L + OFF_DN, D, FF);
    }
    bool ok = true;
    for (u32 t = 0; t < steps; ++t) {
        const u32 pos = pos0 + t;
        std::vector<double> h(D), xn(D), y;
        for (int i = 0; i < D; ++i) h[i] = emb[(size_t)tok[t] * D + i];
        auto norm = [&](const float* w) {
            double ss = 0.0;
            for (int i = 0; i < D; ++i) ss += h[i] * h[i];
            const double ri = 1.0 / sqrt(ss / D + EPS);
            for (int i = 0; i < D; ++i) xn[i] = h[i] * ri * w[i];
        };
        for (int l = 0; l < NL; ++l) {
            norm(&norms[(size_t)l * 2 * D]);
            matvec(Wl[4 * l].data(), xn, y, QKV, D);
            for (int r = 0; r < QD + KVD; r += 2) {
                const double inv = pow(ROPE_BASE, -2.0 * (double)((r % HD) / 2) / HD);
                const double c = cos(pos * inv), s = sin(pos * inv);
                const double a0 = y[r] * c - y[r + 1] * s, a1 = y[r] * s + y[r + 1] * c;
                y[r] = a0;
                y[r + 1] = a1;
            }
            for (int j = 0; j < KVD; ++j) {
                const size_t ci = (((size_t)l * NKV + j / HD) * CTX + pos) * HD + j % HD;
                kc[ci] = round_half(y[QD + j]);
                vc[ci] = round_half(y[QD + KVD + j]);
            }
            std::vector<double> att(QD);
            for (int hh = 0; hh < NH; ++hh) {
                const int kvh = hh / (NH / NKV);
                const size_t cb = ((size_t)l * NKV + kvh) * CTX * HD;
                std::vector<double> sc(pos + 1);
                double m = -1e300;
                for (u32 p2 = 0; p2 <= pos; ++p2) {
                    double d = 0.0;
                    for (int i = 0; i < HD; ++i) d += y[hh * HD + i] * kc[cb + (size_t)p2 * HD + i];
                    sc[p2] = d / sqrt((double)HD);
                    m = std::max(m, sc[p2]);
                }
                double den = 0.0;
                for (u32 p2 = 0; p2 <= pos; ++p2) den += (sc[p2] = exp(sc[p2] - m));
                for (int i = 0; i < HD; ++i) {
                    double o = 0.0;
                    for (u32 p2 = 0; p2 <= pos; ++p2) o += sc[p2] * vc[cb + (size_t)p2 * HD + i];
                    att[hh * HD + i] = o / den;
                }
            }
            matvec(Wl[4 * l + 1].data(), att, y, D, QD);
            for (int i = 0; i < D; ++i) h[i] += y[i];
            norm(&norms[(size_t)l * 2 * D + D]);
            matvec(Wl[4 * l + 2].data(), xn, y, 2 * FF, D);
            std::vector<double> act(FF);
            for (int i = 0; i < FF; ++i) act[i] = y[2 * i] / (1.0 + exp(-y[2 * i])) * y[2 * i + 1];
            matvec(Wl[4 * l + 3].data(), act, y, D, FF);
            for (int i = 0; i < D; ++i) h[i] += y[i];
        }
        norm(&norms[(size_t)NL * 2 * D]);
        std::vector<double> ref;
        matvec(emb.data(), xn, ref, VOCAB, D);
        double num = 0.0, den = 0.0;
        u32 cpu_arg = 0, gpu_arg = 0;
        for (int i = 0; i < VOCAB; ++i) {
            const double d = (double)lg[(size_t)t * VOCAB + i] - ref[i];
            num += d * d;
            den += ref[i] * ref[i];
            if (ref[i] > ref[cpu_arg]) cpu_arg = i;
            if (lg[(size_t)t * VOCAB + i] > lg[(size_t)t * VOCAB + gpu_arg]) gpu_arg = i;
        }
        const double rel = sqrt(num / den);
        const u32 took = t + 1 < T ? tok[t + 1] : gpu_arg;
        printf("check token %u (id %u at %u): logits rel-L2 %.2e, argmax cpu %u gpu %u, chain took %u\n", t, tok[t],
               pos, rel, cpu_arg, gpu_arg, took);
        ok = ok && rel < 1e-3 && cpu_arg == gpu_arg && took == gpu_arg;
    }
    printf("check: %s\n", ok ? "PASS" : "FAIL");
    return ok ? 0 : 2;
}
#endif
