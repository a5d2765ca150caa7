// ---------------------------------------------------------------------------
// Persistent decode (persist.rs): a whole chain of greedy or sampled tokens
// of a llama model in one cooperative launch, one block per SM.
// ---------------------------------------------------------------------------
//
// The graph of one kernel per command pays a dependent launch boundary
// (about 1.3 us on an H200) five times a layer; on small models that, not
// bytes, sets the token time. Here each layer is five phases of one kernel:
//   qkv   RMS norm of h, the q | k | v rows, RoPE, K and V into the cache;
//   attn  one block per query head: scores, softmax, values;
//   o     h += Wo att (every h row lives in a register of the warp owning
//         it in both o and down);
//   gu    RMS norm of h, gate and up rows, silu(g) u;
//   down  h += Wd act;
// then the logits (each block keeps its best) and, behind per-block flags,
// the argmax over the blocks' bests, which every block computes, so that all
// of them agree on the next token, on a stop token and on the limit. With the
// sampler (a sampled table's module), each block publishes a part of the
// draw before the flags and every block computes the same pick after them
// (pd_sample_publish, pd_sample_pick).
//
// Phases hand their values over as 64-bit words: the float in the low half,
// the number of the phase that wrote it in the high half. A consumer reloads
// a word until it carries the phase it waits for, so the wait and the load
// of its input are one L2 round trip, with no flag, fence or grid barrier
// (bench/RESULTS.md, session 18: 2,711 tok/s against 2,036 with flags on the
// default model's shape). Two sets of words, by the parity of the layer
// counted over the chain, keep a fast writer from overwriting a value that a
// reader of the layer before still needs: every writer of a set for layer
// l + 2 has waited, through the values it read, on every reader of layer l.
// The logits phase ends with the flags (release by each block, acquire by
// every block): they also publish the K/V rows of the token to later ones.
//
// Weights never wait on a phase: each block copies its rows of layer l + 1
// into shared memory (cp.async) while it runs layer l, from the backend's
// repacked Q4_1 buffers (repack.rs: every row's quants, then every row's
// scales) into records of a row's quants then its scales.
//
// The chain's control block is the graph path's (Ctl): block 0 publishes each
// token as k_argmax does (publish_token), and reads `done`, which the host
// raises to cancel, once a token; the blocks learn of it with the bests.
//
// This file is its own module (compile.rs persist_source: common.cuh, then
// this), compiled per model with its shape as macros (PD_D, PD_QD, PD_KVD,
// PD_FF, PD_NH, PD_NKV), so that the row loops unroll and the offsets fold;
// the same values also come in the arguments. -DPD_TIMING prints block 0's
// cycles per phase kind at the end of each chain.

#define PD_WARPS 12
#define PD_THREADS (PD_WARPS * 32)
#define PD_HD 64
// Where a block requests the next layer's rows: 0 at the layer's start, 1
// after its qkv work (after attention on the blocks that run it).
#ifndef PD_PREFETCH_LATE
#define PD_PREFETCH_LATE 0
#endif
// Values of a row of d a thread holds in registers: d <= PD_MAXPER threads.
#define PD_MAXPER 4

// One layer's buffers: Q4_1 matrices q, k, v, o, gate, up, down (repacked),
// norm weights, and the layer's K and V caches ([kv head][capacity][64]
// elements of kv_t: common.cuh, KV_F16).
struct PdLayer {
    const u8* w[7];
    const float* attn_norm;
    const float* ffn_norm;
    kv_t* k;
    kv_t* v;
};

struct PdArgs {
    const PdLayer* layers;
    const u8* emb;         // token embedding (Q4_1 or Q8_0, repacked)
    const u8* out;         // logits weight (the embedding when tied)
    const float* out_norm;
    u32* conveyor;         // token ids: input at ctl->tok0, outputs after it
    Ctl* ctl;
    u64* x;                // 2 sets of tagged words (persist.rs x_words)
    u64* best;             // 2 sets (token parity) of blocks + 1: each block's best key, then cancel
    u32* flags;            // blocks: the last phase each block finished
    const float* freq;     // Llama 3.1-style RoPE divisors (PD_HD / 2), or null
    u32 nl, d, qd, kvd, nh, nkv, ff, vocab, capacity;
    u32 emb_q8, out_q8;    // 1: Q8_0, 0: Q4_1
    u32 max_pos;           // scores a block holds (shared memory)
    float eps, theta, freq_scale, scale;
    SampArgs s;            // the in-kernel sampler (chain_sampler.cuh)
    // The first res_rows rows of each block's slice of the logits weight,
    // kept in shared memory at byte res_off for the whole chain (PD_BULK;
    // persist.rs sizes them to the room left; 0: none).
    u32 res_rows, res_off;
};

// What the logits phase does with the logits: a.s.mode (chain_sampler.cuh,
// PD_SAMPLE_*); a greedy table's module compiles the sampler out.
#ifndef PD_GREEDY_ONLY
#define PD_GREEDY_ONLY 0
#endif
// The block that publishes each token to the host (publish_token): the
// last, which has the fewest rows in a layer (pd_items fills blocks from
// the first; on the SmolLM2 shape it has none), so that the publish's
// system-scope fences delay no phase. -DPD_PUBLISHER=0: block 0, as
// before session 22 (A/B runs).
// -DPD_PEN_IN_DOTS=1: the repetition penalty applied to each logit in the
// logits rows (before session 37), not in a pass after them (A/B runs).
#ifndef PD_PEN_IN_DOTS
#define PD_PEN_IN_DOTS 0
#endif
#ifndef PD_PUBLISHER
#define PD_PUBLISHER (gridDim.x - 1)
#endif
// A block's role (its rows, head, flag and parts): its index, or with
// -DPD_SMID_ROLES=1 a function of the SM it runs on, (smid x PD_SMID_MUL +
// PD_SMID_ADD) mod G, where the SMs are numbered 0..G-1 (%nsmid == G: the
// launch puts one block on each; PD_SMID_MUL coprime to G), so that each
// role sits on the same SM in every launch (the launch's own placement
// varies, and with it the speed: bench/RESULTS.md, session 22).
#ifndef PD_SMID_ROLES
#define PD_SMID_ROLES 0
#endif
#ifndef PD_SMID_MUL
#define PD_SMID_MUL 1
#endif
#ifndef PD_SMID_ADD
#define PD_SMID_ADD 0
#endif
__device__ __forceinline__ u32 pd_bid() {
#if PD_SMID_ROLES
    u32 s, n;
    asm("mov.u32 %0, %%smid;" : "=r"(s));
    asm("mov.u32 %0, %%nsmid;" : "=r"(n));
    return n == gridDim.x ? (s * PD_SMID_MUL + PD_SMID_ADD) % n : blockIdx.x;
#else
    return blockIdx.x;
#endif
}
// The sampler's configuration (chain_sampler.cuh): every warp of the block.
// -DPD_REDUX_MAX=0: the 64-bit maxima by shuffles (chain_sampler.cuh
// pd_warp_max_u64), for A/B runs.
#ifndef PD_REDUX_MAX
#define PD_REDUX_MAX 1
#endif
// -DPD_SPEC_PICK=0: the top-k pick ranks its candidates (A/B runs).
#ifndef PD_SPEC_PICK
#define PD_SPEC_PICK 1
#endif
struct PdCfg {
    static constexpr int WARPS = PD_WARPS, PICK_KPT = 24, PICK_HEAD_KPT = 4;
    static constexpr bool REDUX_MAX = PD_REDUX_MAX, PRED_APPEND = true, SPEC_PICK = PD_SPEC_PICK;
    static __device__ __forceinline__ void sync() { __syncthreads(); }
    static __device__ __forceinline__ u32 bid() { return pd_bid(); }
};
#ifndef PD_WBUF_ARRAY
#define PD_WBUF_ARRAY 0
#endif

__device__ __forceinline__ float pd_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Waits until every block has finished phase e (flags; logits only).
__device__ __forceinline__ void pd_wait_flags(const u32* flags, u32 e) {
    bool ok;
    do {
        u32 v = e;
        if (threadIdx.x < gridDim.x)
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(flags + threadIdx.x) : "memory");
        ok = v >= e;
    } while (!__syncthreads_and(ok));
}
// This block has finished phase e: barrier, then thread 0's release.
__device__ __forceinline__ void pd_end_flags(u32* flags, u32 e) {
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flags + pd_bid()), "r"(e) : "memory");
}

__device__ __forceinline__ void pd_cp8(void* s, const void* g) {
    const u32 sa = (u32)__cvta_generic_to_shared(s);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(sa), "l"(g) : "memory");
}

// A row of k in shared memory: its quants, then its scales padded to 16.
__device__ __forceinline__ u32 pd_rec(u32 k) { return k / 2 + 4 * ((k / 32 + 3) / 4 * 4); }

// PD_BULK=1 (persist.rs sets it on sm_90 and later; bench/RESULTS.md,
// session 19: +3.4% from position 0, +5% from 256, on an H100): a block's
// rows of the next layer arrive by bulk copies (one instruction per
// contiguous range, issued by thread 0, completing on an mbarrier) instead
// of about 1,300 cp.async of 8 and 16 bytes issued by every thread, whose
// requests the phases' own loads of their inputs queued behind. A
// matrix's rows [r0, r1) are contiguous in the repacked buffer (quants,
// then scales), so a slice is two copies:
// its quants (k / 2 bytes a row, a multiple of 16) and its scales (k / 8
// bytes a row, 8-aligned only: the copy starts at the 16-byte boundary
// below and ends at the one above, which stays inside the buffer because
// rows x k / 8 is a multiple of 16). The shared-memory image is then
// "quants of the slice's rows, scales of the slice's rows" per matrix
// (PdBulk), not one record per row.
#ifndef PD_BULK
#define PD_BULK 0
#endif

// (mbar_init, mbar_expect_tx, mbar_wait, bulk_copy: common.cuh.)
__device__ __forceinline__ u32 pd_up16(u32 v) { return (v + 15) & ~15u; }

// Dot product of a 16-byte word of cache elements (4 f32 or 8 f16) with
// q's elements at the same dims.
__device__ __forceinline__ float pd_dot_word(uint4 w, const float* q) {
#if KV_F16
    const u32 u[4] = {w.x, w.y, w.z, w.w};
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) s += f16_to_f32((u16)u[i]) * q[2 * i] + f16_to_f32((u16)(u[i] >> 16)) * q[2 * i + 1];
    return s;
#else
    return __uint_as_float(w.x) * q[0] + __uint_as_float(w.y) * q[1] + __uint_as_float(w.z) * q[2] +
           __uint_as_float(w.w) * q[3];
#endif
}

// Cache elements 4 i .. 4 i + 3 of V, through the read-only path.
__device__ __forceinline__ float4 pd_v4(const kv_t* V, u64 i) {
#if KV_F16
    return f16x4_to_f32(__ldg((const uint2*)V + i));
#else
    return __ldg((const float4*)V + i);
#endif
}

// Small integers as floats without the conversion unit (I2F runs at a
// quarter of the ALU rate, and the logits phase converts every weight of a
// block's 373 rows): byte k of w placed under the exponent of 2^23 by a
// byte permute, then 2^23 (4-bit quants) or 2^23 + 128 (8-bit quants
// offset by 128: w ^ 0x80808080) subtracted, exactly. The values, and so
// the products and sums, are those of the (float) casts.
#define PD_2P23 8388608.0f
__device__ __forceinline__ float pd_byte_f(u32 w, u32 sel) {
    return __uint_as_float(__byte_perm(w, 0x4B000000u, sel));
}
#define PD_U4(w, k) (pd_byte_f((w), 0x7540u | (k)) - PD_2P23)
#define PD_I8(wx, k) (pd_byte_f((wx), 0x7540u | (k)) - (PD_2P23 + 128.0f))

// Dot product of a Q4_1 row (quants q, (d, m) f16 pairs s) with xs (shared),
// the sum in every lane. Lane w takes 4-byte word w of the quants: bytes
// 4i..4i+3 of block w / 4 (i = w % 4), weights 4i.. in their low nibbles
// and 16 + 4i.. in their high ones.
__device__ __forceinline__ float pd_dot_q41(const u8* q, const u8* s, u32 k, const float* xs, int lane) {
    const u32* qw = (const u32*)q;
    const u32* sw = (const u32*)s;
    float acc = 0.0f;
    for (u32 w = lane; w < k / 8; w += 32) {
        const u32 v = qw[w], dm = sw[w >> 2];
        const float d = f16_to_f32((u16)dm), m = f16_to_f32((u16)(dm >> 16));
        const float* xb = xs + 32 * (w >> 2) + 4 * (w & 3);
        const float4 a = *(const float4*)xb, b = *(const float4*)(xb + 16);
        const u32 lo = v & 0x0f0f0f0fu, hi = (v >> 4) & 0x0f0f0f0fu;
        const float qs = PD_U4(lo, 0) * a.x + PD_U4(lo, 1) * a.y + PD_U4(lo, 2) * a.z + PD_U4(lo, 3) * a.w +
                         PD_U4(hi, 0) * b.x + PD_U4(hi, 1) * b.y + PD_U4(hi, 2) * b.z + PD_U4(hi, 3) * b.w;
        acc += d * qs + m * ((a.x + a.y) + (a.z + a.w) + ((b.x + b.y) + (b.z + b.w)));
    }
    return pd_warp_sum(acc);
}
// The logits weight's rows r0, r0 + step, ... (PD_ROWS of them, those
// below rows_end) against x, into s[]: row r's quants at Q + r x (its
// quant bytes), its scales at Sc + r x (its scale bytes), in global or
// shared memory. Every row's words are requested before the first
// product, so that a warp has PD_ROWS rows of loads in flight. Rows past
// rows_end give 0. x holds the lane's input values (pd_x_words), loaded
// once a token rather than from shared memory for every row.
#define PD_ROWS 4
#define PD_MAXW 6  // words a lane loads a row: k / 256, up to d = 1536
// The input values of a lane's words w = lane + 32 i of a row of k, in the
// order pd_dot_rows takes them: Q8_0 word w holds elements 8w..8w+7; Q4_1
// word w (bytes 4i..4i+3 of block w / 4, i = w % 4) elements 4i.. in its
// low nibbles and 16 + 4i.. in its high ones.
__device__ __forceinline__ void pd_x_words(float (&x)[PD_MAXW][8], const float* xs, u32 q8, u32 k, int lane) {
#pragma unroll
    for (int i = 0; i < PD_MAXW; ++i) {
        const u32 w = lane + 32 * i;
        float4 lo = make_float4(0.0f, 0.0f, 0.0f, 0.0f), hi = lo;
        if (w < k / 8) {
            const float* xb = q8 ? xs + 8 * w : xs + 32 * (w >> 2) + 4 * (w & 3);
            lo = *(const float4*)xb;
            hi = *(const float4*)(xb + (q8 ? 4 : 16));
        }
        x[i][0] = lo.x, x[i][1] = lo.y, x[i][2] = lo.z, x[i][3] = lo.w;
        x[i][4] = hi.x, x[i][5] = hi.y, x[i][6] = hi.z, x[i][7] = hi.w;
    }
}
__device__ __forceinline__ void pd_dot_rows(float (&s)[PD_ROWS], const u8* Q, const u8* Sc, u32 q8, u32 k, u32 r0,
                                            u32 step, u32 rows_end, const float (&x)[PD_MAXW][8], int lane) {
    const u32 nw = k / 8;
    if (q8) {
        uint2 q[PD_ROWS][PD_MAXW];
        u16 sc[PD_ROWS][PD_MAXW];
#pragma unroll
        for (int u = 0; u < PD_ROWS; ++u) {
            const u32 r = r0 + u * step;
#pragma unroll
            for (int i = 0; i < PD_MAXW; ++i) {
                const u32 w = lane + 32 * i;
                const bool live = r < rows_end && w < nw;
                q[u][i] = live ? ((const uint2*)(Q + (u64)r * k))[w] : make_uint2(0, 0);
                sc[u][i] = live ? ((const u16*)Sc)[(u64)r * (k / 32) + (w >> 2)] : (u16)0;
            }
        }
#pragma unroll
        for (int u = 0; u < PD_ROWS; ++u) {
            float acc = 0.0f;
#pragma unroll
            for (int i = 0; i < PD_MAXW; ++i) {
                const u32 w = lane + 32 * i;
                if (w < nw) {
                    const u32 v0 = q[u][i].x ^ 0x80808080u, v1 = q[u][i].y ^ 0x80808080u;
                    const float qs = PD_I8(v0, 0) * x[i][0] + PD_I8(v0, 1) * x[i][1] + PD_I8(v0, 2) * x[i][2] +
                                     PD_I8(v0, 3) * x[i][3] + PD_I8(v1, 0) * x[i][4] + PD_I8(v1, 1) * x[i][5] +
                                     PD_I8(v1, 2) * x[i][6] + PD_I8(v1, 3) * x[i][7];
                    acc += f16_to_f32(sc[u][i]) * qs;
                }
            }
            s[u] = pd_warp_sum(acc);
        }
        return;
    }
    u32 q[PD_ROWS][PD_MAXW], dm[PD_ROWS][PD_MAXW];
#pragma unroll
    for (int u = 0; u < PD_ROWS; ++u) {
        const u32 r = r0 + u * step;
#pragma unroll
        for (int i = 0; i < PD_MAXW; ++i) {
            const u32 w = lane + 32 * i;
            const bool live = r < rows_end && w < nw;
            q[u][i] = live ? ((const u32*)(Q + (u64)r * (k / 2)))[w] : 0u;
            dm[u][i] = live ? ((const u32*)Sc)[(u64)r * (k / 32) + (w >> 2)] : 0u;
        }
    }
#pragma unroll
    for (int u = 0; u < PD_ROWS; ++u) {
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < PD_MAXW; ++i) {
            const u32 w = lane + 32 * i;
            if (w < nw) {
                const u32 lo = q[u][i] & 0x0f0f0f0fu, hi = (q[u][i] >> 4) & 0x0f0f0f0fu;
                const float d = f16_to_f32((u16)dm[u][i]), mn = f16_to_f32((u16)(dm[u][i] >> 16));
                const float qs = PD_U4(lo, 0) * x[i][0] + PD_U4(lo, 1) * x[i][1] + PD_U4(lo, 2) * x[i][2] +
                                 PD_U4(lo, 3) * x[i][3] + PD_U4(hi, 0) * x[i][4] + PD_U4(hi, 1) * x[i][5] +
                                 PD_U4(hi, 2) * x[i][6] + PD_U4(hi, 3) * x[i][7];
                acc += d * qs + mn * ((x[i][0] + x[i][1]) + (x[i][2] + x[i][3]) +
                                      ((x[i][4] + x[i][5]) + (x[i][6] + x[i][7])));
            }
        }
        s[u] = pd_warp_sum(acc);
    }
}

// Weight i of row r (as model.cu's load_elem).
__device__ __forceinline__ float pd_elem(const u8* m, u32 q8, u32 rows, u32 k, u32 r, u32 i) {
    const u32 blk = i >> 5, j = i & 31;
    if (q8) return f16_to_f32(ld_u16(m + (u64)rows * k + ((u64)r * (k / 32) + blk) * 2)) * (float)(i8)m[(u64)r * k + i];
    const u32 q = m[(u64)r * (k / 2) + 16 * blk + (j & 15)];
    const u32 nib = j < 16 ? (q & 15) : (q >> 4);
    const u8* dm = m + (u64)rows * (k / 2) + ((u64)r * (k / 32) + blk) * 4;
    return f16_to_f32(ld_u16(dm)) * (float)nib + f16_to_f32(ld_u16(dm + 2));
}

struct PdRange {
    u32 lo, n;
};
__device__ __forceinline__ PdRange pd_items(u32 items) {
    const u32 per = (items + gridDim.x - 1) / gridDim.x;
    const u32 lo = min(items, pd_bid() * per);
    return {lo, min(items, lo + per) - lo};
}
__device__ __forceinline__ u32 pd_per(u32 items) { return (items + gridDim.x - 1) / gridDim.x; }

// The block's record areas of one layer (persist.rs layer_smem).
struct PdAreas {
    u8 *q, *o, *g, *d;
};
__device__ __forceinline__ PdAreas pd_areas(u8* buf, const PdArgs& a) {
    PdAreas r;
    r.q = buf;
    r.o = r.q + (u64)pd_per((a.qd + 2 * a.kvd) / 2) * 2 * pd_rec(a.d);
    r.g = r.o + (u64)pd_per(a.d) * pd_rec(a.qd);
    r.d = r.g + (u64)pd_per(a.ff) * 2 * pd_rec(a.d);
    return r;
}

// Rows [r0, r1) of the repacked Q4_1 matrix m (rows x k) into the records
// at dst, dst + stride, ... (quants in 16-byte pieces, scales in 8-byte
// ones: a row's k / 8 bytes of scales start 8-byte aligned).
__device__ __forceinline__ void pd_copy_rows(u8* dst, u32 stride, const u8* m, u32 rows, u32 k, u32 r0, u32 r1) {
    const u32 qb = k / 2, sb = k / 8, nq = qb / 16, ns = sb / 8;
    const u8* q = m + (u64)r0 * qb;
    const u8* s = m + (u64)rows * qb + (u64)r0 * sb;
    for (u32 c = threadIdx.x; c < (r1 - r0) * nq; c += PD_THREADS)
        cp_async16(dst + (u64)(c / nq) * stride + (c % nq) * 16, q + (u64)c * 16);
    for (u32 c = threadIdx.x; c < (r1 - r0) * ns; c += PD_THREADS)
        pd_cp8(dst + (u64)(c / ns) * stride + qb + (c % ns) * 8, s + (u64)c * 8);
}

// Copies this block's rows of layer L into buf (one cp.async group).
__device__ __forceinline__ void pd_prefetch(u8* buf, const PdArgs& a, const PdLayer& L) {
    const PdAreas ar = pd_areas(buf, a);
    const u32 rd = pd_rec(a.d);
    const PdRange rq = pd_items((a.qd + 2 * a.kvd) / 2);
    const u32 c0 = 2 * rq.lo, c1 = 2 * (rq.lo + rq.n);
    const u32 seg[4] = {0, a.qd, a.qd + a.kvd, a.qd + 2 * a.kvd};
#pragma unroll
    for (int m = 0; m < 3; ++m) {
        const u32 r0 = max(c0, seg[m]), r1 = min(c1, seg[m + 1]);
        if (r0 < r1) pd_copy_rows(ar.q + (u64)(r0 - c0) * rd, rd, L.w[m], seg[m + 1] - seg[m], a.d, r0 - seg[m], r1 - seg[m]);
    }
    const PdRange ro = pd_items(a.d), rg = pd_items(a.ff);
    pd_copy_rows(ar.o, pd_rec(a.qd), L.w[3], a.d, a.qd, ro.lo, ro.lo + ro.n);
    pd_copy_rows(ar.g, 2 * rd, L.w[4], a.ff, a.d, rg.lo, rg.lo + rg.n);       // gate i: record 2i
    pd_copy_rows(ar.g + rd, 2 * rd, L.w[5], a.ff, a.d, rg.lo, rg.lo + rg.n);  // up i: record 2i + 1
    pd_copy_rows(ar.d, pd_rec(a.ff), L.w[6], a.d, a.ff, ro.lo, ro.lo + ro.n);
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// The bulk image of one layer in a block's buffer (PD_BULK): byte offsets
// of each matrix slice's quants (row i at q + i k / 2) and scales (row i at
// s + (r0 k / 8) % 16 + i k / 8, r0 the slice's first row; q, k and v
// each have a scale area). Every area is 16-aligned and a scale area has
// 16 bytes of room for the copy's rounding (persist.rs bulk_layer_smem).
struct PdBulk {
    u32 qkv_q, qkv_s0, qkv_s1, qkv_s2, o_q, o_s, g_q, g_s, u_q, u_s, d_q, d_s, bytes;
};
// Takes `bytes` (a multiple of 16) at offset o; returns where they start.
__device__ __forceinline__ u32 pd_take(u32& o, u32 bytes) {
    const u32 at = o;
    o += bytes;
    return at;
}
__device__ __forceinline__ PdBulk pd_bulk_areas(const PdArgs& a) {
    const u32 nq = 2 * pd_per((a.qd + 2 * a.kvd) / 2), no = pd_per(a.d), nf = pd_per(a.ff);
    // A slice's scales with 16 bytes of room for the copy's rounding.
    const auto scales = [](u32 rows, u32 k) { return pd_up16(rows * (k / 8) + 16); };
    PdBulk b;
    u32 o = 0;
    b.qkv_q = pd_take(o, nq * (a.d / 2));
    b.qkv_s0 = pd_take(o, scales(nq, a.d));
    b.qkv_s1 = pd_take(o, scales(nq, a.d));
    b.qkv_s2 = pd_take(o, scales(nq, a.d));
    b.o_q = pd_take(o, no * (a.qd / 2));
    b.o_s = pd_take(o, scales(no, a.qd));
    b.g_q = pd_take(o, nf * (a.d / 2));
    b.g_s = pd_take(o, scales(nf, a.d));
    b.u_q = pd_take(o, nf * (a.d / 2));
    b.u_s = pd_take(o, scales(nf, a.d));
    b.d_q = pd_take(o, no * (a.ff / 2));
    b.d_s = pd_take(o, scales(no, a.ff));
    b.bytes = o;
    return b;
}

// The layers' weight copies ask L2 to evict their lines first (as the
// streaming kernel's producer does, stream.cu), so that the weights streaming
// through it each token (66 MB of layers on the SmolLM2 shape, more than
// the H200's 60 MB L2) leave in L2 what is read once a token: the code of
// the logits phase and the sampler, the KV cache, the blocks' words.
// Sampled +2.1% to +3.1%, greedy +0.5% to +2.0% on four H200s
// (bench/RESULTS.md, session 48): the sampler's code, about 80 KB run once a
// token, had to come back from DRAM. -DPD_EVICT_FIRST=0: plain copies
// (A/B runs).
#ifndef PD_EVICT_FIRST
#define PD_EVICT_FIRST 1
#endif
// The copies' L2 policy, made once a batch of copies and passed to each.
__device__ __forceinline__ u64 pd_copy_policy() { return PD_EVICT_FIRST ? l2_evict_first_policy() : 0ull; }
__device__ __forceinline__ void pd_copy(void* dst, const void* src, u32 bytes, u64* bar, u64 policy) {
#if PD_EVICT_FIRST
    bulk_copy_hint(dst, src, bytes, bar, policy);
#else
    (void)policy;
    bulk_copy(dst, src, bytes, bar);
#endif
}
// Rows [r0, r1) of a repacked matrix m of `rows` rows (every row's quants,
// qb bytes each, then every row's scales, sb bytes each): quants to
// buf + qo, scales to buf + so, the first row's at buf + so + (its offset
// in m & 15). Returns the bytes the two copies move; issues them only when
// `issue` (the first pass counts the bytes for the mbarrier's expected
// total), with L2 policy `policy` (pd_copy_policy).
__device__ __forceinline__ u32 pd_bulk_range(u8* buf, u32 qo, u32 so, const u8* m, u32 rows, u32 qb, u32 sb,
                                             u32 r0, u32 r1, u64* bar, bool issue, u64 policy) {
    if (r0 >= r1) return 0;
    const u32 qbytes = (r1 - r0) * qb;
    const u64 s_lo = (u64)rows * qb + (u64)r0 * sb;  // 8-aligned
    const u64 s_a = s_lo & ~15ull, s_b = (s_lo + (u64)(r1 - r0) * sb + 15) & ~15ull;
    const u32 sbytes = (u32)(s_b - s_a);
    if (issue) {
        pd_copy(buf + qo, m + (u64)r0 * qb, qbytes, bar, policy);
        pd_copy(buf + so, m + s_a, sbytes, bar, policy);
    }
    return qbytes + sbytes;
}
// The same for the Q4_1 matrix m (rows x k) of a layer.
__device__ __forceinline__ u32 pd_bulk_rows(u8* buf, u32 qo, u32 so, const u8* m, u32 rows, u32 k, u32 r0, u32 r1,
                                            u64* bar, bool issue, u64 policy) {
    return pd_bulk_range(buf, qo, so, m, rows, k / 2, k / 8, r0, r1, bar, issue, policy);
}
__device__ __forceinline__ u32 pd_bulk_pass(u8* buf, const PdArgs& a, const PdLayer& L, u64* bar, bool issue,
                                            u64 policy = 0) {
    const PdBulk b = pd_bulk_areas(a);
    const PdRange rq = pd_items((a.qd + 2 * a.kvd) / 2);
    const u32 c0 = 2 * rq.lo, c1 = 2 * (rq.lo + rq.n);
    const u32 seg[4] = {0, a.qd, a.qd + a.kvd, a.qd + 2 * a.kvd};
    const u32 so[3] = {b.qkv_s0, b.qkv_s1, b.qkv_s2};
    u32 n = 0;
#pragma unroll
    for (int m = 0; m < 3; ++m) {
        const u32 r0 = max(c0, seg[m]), r1 = min(c1, seg[m + 1]);
        if (r0 < r1)
            n += pd_bulk_rows(buf, b.qkv_q + (r0 - c0) * (a.d / 2), so[m], L.w[m], seg[m + 1] - seg[m], a.d,
                              r0 - seg[m], r1 - seg[m], bar, issue, policy);
    }
    const PdRange ro = pd_items(a.d), rg = pd_items(a.ff);
    n += pd_bulk_rows(buf, b.o_q, b.o_s, L.w[3], a.d, a.qd, ro.lo, ro.lo + ro.n, bar, issue, policy);
    n += pd_bulk_rows(buf, b.g_q, b.g_s, L.w[4], a.ff, a.d, rg.lo, rg.lo + rg.n, bar, issue, policy);
    n += pd_bulk_rows(buf, b.u_q, b.u_s, L.w[5], a.ff, a.d, rg.lo, rg.lo + rg.n, bar, issue, policy);
    n += pd_bulk_rows(buf, b.d_q, b.d_s, L.w[6], a.d, a.ff, ro.lo, ro.lo + ro.n, bar, issue, policy);
    return n;
}
// Thread 0: this block's rows of layer L into buf, completing on bar.
__device__ __forceinline__ void pd_prefetch_bulk(u8* buf, const PdArgs& a, const PdLayer& L, u64* bar) {
    mbar_expect_tx(bar, pd_bulk_pass(buf, a, L, bar, false));
    pd_bulk_pass(buf, a, L, bar, true, pd_copy_policy());
}

// The embedding's and the logits weight's forms (1: Q8_0, 0: Q4_1): the
// constants PD_EMB_Q8 and PD_OUT_Q8 that persist.rs compiles in (from the
// plan, so that the module holds one form's code), else the arguments
// (-DPD_FORMS_RUNTIME=1, for A/B).
#if defined(PD_FORMS_RUNTIME) && PD_FORMS_RUNTIME
#undef PD_OUT_Q8
#undef PD_EMB_Q8
#endif
#ifdef PD_OUT_Q8
#define PD_OUTQ8(a) ((u32)PD_OUT_Q8)
#else
#define PD_OUTQ8(a) ((a).out_q8)
#endif
#ifdef PD_EMB_Q8
#define PD_EMBQ8(a) ((u32)PD_EMB_Q8)
#else
#define PD_EMBQ8(a) ((a).emb_q8)
#endif
// The logits weight's quant and scale bytes a row.
__device__ __forceinline__ u32 pd_out_qb(const PdArgs& a) { return PD_OUTQ8(a) ? a.d : a.d / 2; }
__device__ __forceinline__ u32 pd_out_sb(const PdArgs& a) { return PD_OUTQ8(a) ? a.d / 16 : a.d / 8; }
// The rows of this block's slice of the logits weight kept in shared
// memory (its first ones), at smem + a.res_off: their quants, then their
// scales (pd_bulk_range's image). -DPD_LOGITS_SMEM=0 keeps none (A/B).
#ifndef PD_LOGITS_SMEM
#define PD_LOGITS_SMEM 1
#endif
__device__ __forceinline__ u32 pd_res_rows(const PdArgs& a) {
    return PD_BULK && PD_LOGITS_SMEM ? min(a.res_rows, pd_items(a.vocab).n) : 0u;
}
// Thread 0, once a launch: those rows' copies, completing on bar (the
// logits weight never changes, so they serve every token of the chain).
__device__ __forceinline__ void pd_fetch_logits(u8* smem, const PdArgs& a, u64* bar) {
    const u32 n = pd_res_rows(a), lo = pd_items(a.vocab).lo, qb = pd_out_qb(a), sb = pd_out_sb(a);
    if (n == 0) return;
    u8* const dst = smem + a.res_off;
    mbar_expect_tx(bar, pd_bulk_range(dst, 0, n * qb, a.out, a.vocab, qb, sb, lo, lo + n, bar, false, 0));
    pd_bulk_range(dst, 0, n * qb, a.out, a.vocab, qb, sb, lo, lo + n, bar, true, pd_copy_policy());
}

// Block sum; red holds PD_WARPS floats. Ends synchronised.
__device__ __forceinline__ float pd_block_sum(float v, float* red) {
    v = pd_warp_sum(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < PD_WARPS; ++i) s += red[i];
    __syncthreads();
    return s;
}

// v[j] = the value at src[threadIdx.x + j PD_THREADS] (< n) once it carries
// `tag`; every word is requested before the first is checked.
// In two halves: the requests, then the reloads until the tags match (so
// that other work can go between them).
__device__ __forceinline__ void pd_request_tagged(u64 (&w)[PD_MAXPER], const u64* src, u32 n, u32 tag) {
#pragma unroll
    for (int j = 0; j < PD_MAXPER; ++j) {
        const u32 i = threadIdx.x + j * PD_THREADS;
        w[j] = i < n ? tag_load(src + i) : (u64)tag << 32;
    }
}
// Every stale word is reloaded at once (common.cuh tag_wait_all);
// PD_POLL_SEQ=1 waits for the words one after the other, a round trip for
// each word still stale when the one before arrived (A/B runs).
#ifndef PD_POLL_SEQ
#define PD_POLL_SEQ 0
#endif
__device__ __forceinline__ void pd_finish_tagged(float (&v)[PD_MAXPER], u64 (&w)[PD_MAXPER], const u64* src, u32 tag) {
#if PD_POLL_SEQ
#pragma unroll
    for (int j = 0; j < PD_MAXPER; ++j) {
        const u32 i = threadIdx.x + j * PD_THREADS;
        while ((u32)(w[j] >> 32) != tag) w[j] = tag_load(src + i);
    }
#else
    tag_wait_all(w, [&](int j) { return src + threadIdx.x + j * PD_THREADS; }, tag);
#endif
#pragma unroll
    for (int j = 0; j < PD_MAXPER; ++j) v[j] = __uint_as_float((u32)w[j]);
}
__device__ __forceinline__ void pd_load_tagged(float (&v)[PD_MAXPER], const u64* src, u32 n, u32 tag) {
    u64 w[PD_MAXPER];
    pd_request_tagged(w, src, n, tag);
    pd_finish_tagged(v, w, src, tag);
}
// dst[0..n) (shared) = the tagged values at src, PD_MAXPER a thread at a
// time; ends synchronised.
__device__ __forceinline__ void pd_stage_tagged(float* dst, const u64* src, u32 n, u32 tag) {
    for (u32 base = 0; base < n; base += PD_MAXPER * PD_THREADS) {
        float v[PD_MAXPER];
        pd_load_tagged(v, src + base, n - base, tag);
#pragma unroll
        for (int j = 0; j < PD_MAXPER; ++j) {
            const u32 i = base + threadIdx.x + j * PD_THREADS;
            if (i < n) dst[i] = v[j];
        }
    }
    __syncthreads();
}

// This thread's norm weights of a row of d, requested before the wait on
// the row (a dependent round trip after the block sum otherwise).
__device__ __forceinline__ void pd_norm_weights(float (&nw)[PD_MAXPER], const float* w, u32 d) {
#pragma unroll
    for (int j = 0; j < PD_MAXPER; ++j) {
        const u32 i = threadIdx.x + j * PD_THREADS;
        nw[j] = i < d ? __ldg(w + i) : 0.0f;
    }
}

// xs = rmsnorm(v) * nw (model.cu's rms_inv, finished in f64 as the CPU
// does: rsqrtf instead saved about 120 cycles a norm and no tok/s,
// bench/RESULTS.md session 20); ends synchronised.
__device__ __forceinline__ void pd_norm(float* xs, const float (&v)[PD_MAXPER], const float (&nw)[PD_MAXPER],
                                        const PdArgs& a, float* red) {
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < PD_MAXPER; ++j) ss += v[j] * v[j];
    const float r = rms_inv(pd_block_sum(ss, red), a.d, a.eps);
#pragma unroll
    for (int j = 0; j < PD_MAXPER; ++j) {
        const u32 i = threadIdx.x + j * PD_THREADS;
        if (i < a.d) xs[i] = v[j] * r * nw[j];
    }
    __syncthreads();
}

// A residual phase (o, down): h += W x. The block stages x (k tagged words
// of phase e at src) when it owns h rows; the warp owning row `own` takes
// its row of W (quants q, scales sc) against it, keeps the sum
// in hreg and hands it over (tagged e + 1) at h[own].
__device__ __forceinline__ void pd_residual(float& hreg, float* xs, const u64* src, u32 k, const u8* q, const u8* sc,
                                            u64* h, int own, u32 owned, u32 e) {
    if (owned > 0) pd_stage_tagged(xs, src, k, e);
    if (own >= 0) {
        hreg += pd_dot_q41(q, sc, k, xs, threadIdx.x & 31);
        if ((threadIdx.x & 31) == 0) tag_store(h + own, hreg, e + 1);
    }
}

extern "C" __global__ void __launch_bounds__(PD_THREADS, 1) k_persist_decode(PdArgs a) {
#ifdef PD_D
    // The model's shape as constants (persist.rs compiles one module per
    // shape; the arguments carry the same values).
    a.d = PD_D;
    a.qd = PD_QD;
    a.kvd = PD_KVD;
    a.ff = PD_FF;
    a.nh = PD_NH;
    a.nkv = PD_NKV;
#endif
#if PD_GREEDY_ONLY
    // A greedy table's module (persist.rs): the sampler compiled out.
    a.s.mode = PD_SAMPLE_GREEDY;
#endif
    // -DPD_BLOCK_TIMES: every block's thread 0 notes %globaltimer (ns, the
    // same clock on every SM) at each mark of layer PD_BT_LAYER of token
    // PD_BT_TOKEN (slot 11: the layer's start; with the last layer, slots
    // 12, 13, 14 and 5 also note the logits phase: its dots' end, the
    // sampler's part, the flags seen, the token) and prints them once the
    // token is done: which blocks end each phase last (gpu.sh
    // persist-blocks summarises them). -DPD_DIAG_TWICE also runs the part
    // and the pick twice, noting slots 15 and 16 after the first runs: a
    // second run at once takes the code from the instruction cache
    // (bench/RESULTS.md, session 47). Timing builds only.
#ifdef PD_BLOCK_TIMES
#ifndef PD_BT_TOKEN
#define PD_BT_TOKEN 64
#endif
#ifndef PD_BT_LAYER
#define PD_BT_LAYER 15
#endif
    // In shared memory, as tm below.
    __shared__ unsigned long long bt[17];
    if (threadIdx.x < 17) bt[threadIdx.x] = 0;
    bool bt_on = false;
#define PD_BT(i)                                                                  \
    do {                                                                          \
        if (bt_on && threadIdx.x == 0) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(bt[i])); \
    } while (0)
#else
#define PD_BT(i) \
    do {         \
    } while (0)
#endif
#ifdef PD_TIMING
    // Phases 0-5 (qkv's dot products and stores, attention, o, gate|up's
    // dot products and stores, down, logits and token); 6-8 split qkv's
    // start: its rows' arrival (bulk copies), its h words' arrival, the
    // norm; 9-10 gate|up's: its h words' arrival, the norm; 15-16
    // attention's: its q|k|v words' arrival (with the barrier after it),
    // the scores with their max (1 then holds the rest).
    // In shared memory (thread 0 of block 0 alone writes it) rather than a
    // local array, which takes registers or a stack frame from the kernel
    // it measures.
    __shared__ long long tm[17];
    // tm0: the same marks in layer 0 alone (the layer after the token's
    // pick, where a skew between blocks' picks would show).
    __shared__ long long tm0[17];
    u32 tm_layer = 1;
    if (threadIdx.x < 17) tm[threadIdx.x] = 0;
    if (threadIdx.x < 17) tm0[threadIdx.x] = 0;
    long long t0 = clock64();
    if (threadIdx.x < 12) pd_pt[threadIdx.x] = 0;
// (PD_TMARK: a timing mark only; 14 and 11-13 split logits and token: the
// h words and the norm, the dot products, the sampler's part, the wait on
// the flags, then the pick.)
#define PD_TMARK(i)                                                  \
    do {                                                             \
        if (pd_bid() == 0 && threadIdx.x == 0) {                     \
            const long long t1 = clock64();                          \
            tm[i] += t1 - t0;                                        \
            if (tm_layer == 0) tm0[i] += t1 - t0;                    \
            t0 = t1;                                                 \
        }                                                            \
    } while (0)
#define PD_MARK(i)  \
    do {            \
        PD_BT(i);   \
        PD_TMARK(i); \
    } while (0)
#else
#define PD_MARK(i) PD_BT(i)
#define PD_TMARK(i) \
    do {            \
    } while (0)
#endif
    // -DPD_CLOCK: block 0 prints each launch's SM clock rate (cycles over
    // %globaltimer ns), its ns a token and its SM: whether runs that differ
    // in speed differ in clock or in placement (gpu.sh persist-clock).
#ifdef PD_CLOCK
    long long ck_c0 = clock64();
    unsigned long long ck_t0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ck_t0));
#endif
    extern __shared__ __align__(16) u8 smem[];
    const u32 rd = pd_rec(a.d);
#if PD_BULK
    const u64 lb = pd_bulk_areas(a).bytes;
#else
    const u64 lb = (u64)pd_per((a.qd + 2 * a.kvd) / 2) * 2 * rd + (u64)pd_per(a.d) * pd_rec(a.qd) +
                   (u64)pd_per(a.ff) * 2 * rd + (u64)pd_per(a.d) * pd_rec(a.ff);
#endif
    // The two row buffers, by offset from smem rather than from a local
    // array of two pointers: an array indexed by a run-time parity lives
    // in the stack frame, and pointers loaded from it are generic, so
    // every weight load from the buffers was a generic load rather than
    // ld.shared. -DPD_WBUF_ARRAY=1: the array (A/B runs).
#if PD_WBUF_ARRAY
    u8* wbuf_a[2] = {smem, smem + lb};
#define wbuf(i) wbuf_a[(i) & 1]
#else
#define wbuf(i) (smem + (u64)((i) & 1) * lb)
#endif
    float* xs = (float*)(smem + 2 * lb);      // max(d, qd, ff) floats
    float* sc = xs + max(max(a.d, a.qd), a.ff);  // max_pos scores
    float* red = sc + a.max_pos;              // PD_WARPS floats
    float* part = red + PD_WARPS;             // PD_WARPS x 64 partials, then q, k, v of the head
    __shared__ u64 wbest[PD_WARPS];
    __shared__ u32 s_token, s_cancel;
    // The sampler (a.s.mode != PD_SAMPLE_GREEDY): its shared memory after the
    // attention partials (the areas are recomputed where they are used, so
    // that no register holds them through the layers), its scalars, the
    // slice's best key, the penalty window's header.
#define PD_SAMP_AREAS() pd_samp_areas((u8*)(part + (PD_WARPS + 3) * PD_HD), pd_per(a.vocab), a.max_pos)
#define PD_PENALTY_ON (a.s.mode != PD_SAMPLE_GREEDY && a.s.penalty != 1.0f)
    __shared__ PdSampShared ss;
    __shared__ u64 s_bkey;
    __shared__ u32 s_wstart, s_wn;
    __shared__ float2 rope[PD_HD / 2];
    // PD_BULK: the two row buffers' mbarriers. Buffer b is filled for the
    // layers gl = 2n + b counted over the chain; fill n completes phase n,
    // so layer gl waits for parity (gl / 2) % 2.
    __shared__ __align__(8) u64 wbar[2];
    // PD_BULK: the resident logits rows' mbarrier (one phase a launch).
    __shared__ __align__(8) u64 lbar;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const PdRange ro = pd_items(a.d);
    // The h row this warp owns in o and down (the launcher makes blocks x
    // PD_WARPS >= d, so that a block's rows are at most one a warp).
    const int own = warp < (int)ro.n ? (int)(ro.lo + warp) : -1;
    const u32 xw = a.d + a.qd + 2 * a.kvd + a.qd + a.ff;  // words a set
    const u32 X_H = 0, X_Q = a.d, X_ATT = a.d + a.qd + 2 * a.kvd, X_ACT = X_ATT + a.qd;
    float hreg = 0.0f;
    u32 e = 0;  // phases finished (every block counts the same)
    Ctl* ctl = a.ctl;
    u32 token = __ldcg(a.conveyor + ctl->tok0);
    const u32 pos0 = ctl->pos0, tok0 = ctl->tok0, limit = ctl->limit;
#if PD_BULK
#if PD_PREFETCH_LATE
#error "PD_PREFETCH_LATE applies to the cp.async copies only"
#endif
    if (threadIdx.x == 0) {
        mbar_init(&wbar[0], 1);
        mbar_init(&wbar[1], 1);
        mbar_init(&lbar, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        pd_prefetch_bulk(wbuf(0), a, a.layers[0], &wbar[0]);
        // Behind the first layer's rows: the logits phase comes last.
        pd_fetch_logits(smem, a, &lbar);
    }
#else
    pd_prefetch(wbuf(0), a, a.layers[0]);
#endif
    u32 gnext = 0;  // the layer (counted over the chain) of the copies last requested
    // The penalty window's recent ids, copied once (published by the first
    // layer's barriers); the host wrote them before the launch.
    if (PD_PENALTY_ON) {
        const PdSamp sp = PD_SAMP_AREAS();
        const u32 nr = min(__ldg(a.s.recent + 1), a.s.recent_capacity);
        if (threadIdx.x == 0) {
            s_wstart = __ldg(a.s.recent);
            s_wn = nr;
        }
        for (u32 i = threadIdx.x; i < nr; i += PD_THREADS) sp.rec[i] = __ldg(a.s.recent + 2 + i);
    }
    for (u32 t = 0; t < limit; ++t) {
        const u32 pos = pos0 + t;
        if (own >= 0) hreg = pd_elem(a.emb, PD_EMBQ8(a), a.vocab, a.d, token, own);
        if (threadIdx.x < PD_HD / 2) {
            // model.cu's rope_cs; published by the qkv staging's barriers.
            float c, s;
            rope_cs(pos, threadIdx.x, PD_HD, a.theta, a.freq_scale, a.freq, c, s);
            rope[threadIdx.x] = make_float2(c, s);
        }
        for (u32 l = 0; l < a.nl; ++l) {
            const PdLayer& L = a.layers[l];
            // Layers counted over the chain: the parity of gl picks this
            // layer's row buffer and its set of tagged words.
            const u32 gl = t * a.nl + l;
            // This layer's rows arrived (requested a layer ago); request the
            // next layer's (the next token's first at the last) into the
            // buffer the layer before read, which every warp has left (this
            // barrier).
            const PdLayer& Ln = a.layers[(l + 1) % a.nl];
            gnext = gl + 1;
#ifdef PD_BLOCK_TIMES
            bt_on = t == PD_BT_TOKEN && l == PD_BT_LAYER;
            PD_BT(11);
#endif
#ifdef PD_TIMING
            tm_layer = l;
#endif
#if PD_BULK
            // Every warp left the other buffer (read by the layer before) at
            // the barrier that ended its last phase; thread 0 requests the
            // next layer's rows into it once its own loads of h are in
            // flight (below), so that they do not wait behind the issue.
            bool issue = threadIdx.x == 0;
            mbar_wait(&wbar[gl & 1], (gl >> 1) & 1);
            PD_MARK(6);
            u8* const wb = wbuf(gl);
            const PdBulk B = pd_bulk_areas(a);
#else
            asm volatile("cp.async.wait_group 0;" ::: "memory");
            __syncthreads();
            if (!PD_PREFETCH_LATE) pd_prefetch(wbuf(gl + 1), a, Ln);
            const PdAreas ws = pd_areas(wbuf(gl), a);
#endif
            u64* X = a.x + (u64)(gl & 1) * xw;        // this layer's values
            u64* Xp = a.x + (u64)((gl + 1) & 1) * xw;  // the layer before's (its h)

            // ---- qkv
            {
                const PdRange r = pd_items((a.qd + 2 * a.kvd) / 2);
                if (r.n > 0) {
                    float v[PD_MAXPER], nw[PD_MAXPER];
                    pd_norm_weights(nw, L.attn_norm, a.d);
                    if (l == 0) {
#pragma unroll
                        for (int j = 0; j < PD_MAXPER; ++j) {
                            const u32 i = threadIdx.x + j * PD_THREADS;
                            v[j] = i < a.d ? pd_elem(a.emb, PD_EMBQ8(a), a.vocab, a.d, token, i) : 0.0f;
                        }
                    } else {
                        u64 w[PD_MAXPER];
                        pd_request_tagged(w, Xp + X_H, a.d, e);
#if PD_BULK
                        if (issue) {
                            pd_prefetch_bulk(wbuf(gnext), a, Ln, &wbar[gnext & 1]);
                            issue = false;
                        }
#endif
                        pd_finish_tagged(v, w, Xp + X_H, e);
                    }
                    PD_MARK(7);
                    pd_norm(xs, v, nw, a, red);
                    PD_MARK(8);
                }
#if PD_BULK
                // The first layer, or a block without q | k | v rows.
                if (issue) pd_prefetch_bulk(wbuf(gnext), a, Ln, &wbar[gnext & 1]);
#endif
                for (u32 it = warp; it < r.n; it += PD_WARPS) {
#if PD_BULK
                    // Pair it's rows c, c + 1 of q | k | v: one matrix (its
                    // sizes are multiples of 64), whose slice starts at r0.
                    const u32 c0 = 2 * r.lo, c = c0 + 2 * it, sb = a.d / 8;
                    const u32 sg = c < a.qd ? 0 : (c < a.qd + a.kvd ? a.qd : a.qd + a.kvd);
                    const u32 so = c < a.qd ? B.qkv_s0 : (c < a.qd + a.kvd ? B.qkv_s1 : B.qkv_s2);
                    const u32 r0 = max(c0, sg);
                    const u8* q0 = wb + B.qkv_q + (c - c0) * (a.d / 2);
                    const u8* s0 = wb + so + (((r0 - sg) * sb) & 15) + (c - r0) * sb;
                    const u8 *q1 = q0 + a.d / 2, *s1 = s0 + sb;
#else
                    const u8* r0 = ws.q + (u64)it * 2 * rd;
                    const u8 *q0 = r0, *s0 = r0 + a.d / 2, *q1 = r0 + rd, *s1 = r0 + rd + a.d / 2;
#endif
                    const float x0 = pd_dot_q41(q0, s0, a.d, xs, lane);
                    const float x1 = pd_dot_q41(q1, s1, a.d, xs, lane);
                    if (lane == 0) {
                        const u32 row = 2 * (r.lo + it);
                        float y0 = x0, y1 = x1;
                        if (row < a.qd + a.kvd) {
                            const float2 cs = rope[(row % PD_HD) / 2];
                            rope_rotate(x0, x1, cs.x, cs.y, y0, y1);
                        }
                        // q, k and v words follow each other as the rows do.
                        tag_store(X + X_Q + row, y0, e + 1);
                        tag_store(X + X_Q + row + 1, y1, e + 1);
                        if (row >= a.qd) {
                            const bool isk = row < a.qd + a.kvd;
                            const u32 rr = row - a.qd - (isk ? 0 : a.kvd), g = rr / PD_HD, dim = rr % PD_HD;
                            kv_put2(isk ? L.k : L.v, ((u64)g * a.capacity + pos) * PD_HD + dim, y0, y1);
                        }
                    }
                }
                if (PD_PREFETCH_LATE && pd_bid() >= a.nh) pd_prefetch(wbuf(gl + 1), a, Ln);
                ++e;
                __syncthreads();
                PD_MARK(0);
            }
            // ---- attention: block j < nh takes query head j
            if (pd_bid() < a.nh) {
                const u32 hq = pd_bid(), g = hq / (a.nh / a.nkv);
                float* qs = part + PD_WARPS * PD_HD;  // q, then the new k and v
                float* kn = qs + PD_HD;
                float* vn = kn + PD_HD;
                const kv_t* K = L.k + (u64)g * a.capacity * PD_HD;
                const kv_t* V = L.v + (u64)g * a.capacity * PD_HD;
                // The cached rows (written in earlier tokens, behind the
                // logits flags, and never read before: L1 holds no stale
                // line of them) are asked of L1 before the wait, a line of
                // 128 bytes at a time.
                constexpr u32 LINES = PD_HD * (u32)sizeof(kv_t) / 128;  // per position
                for (u32 j = threadIdx.x; j < LINES * pos; j += PD_THREADS) {
                    asm volatile("prefetch.global.L1 [%0];" ::"l"((const u8*)K + (u64)j * 128));
                    asm volatile("prefetch.global.L1 [%0];" ::"l"((const u8*)V + (u64)j * 128));
                }
                if (threadIdx.x < 3 * PD_HD) {
                    const u32 which = threadIdx.x / PD_HD, d = threadIdx.x % PD_HD;
                    const u32 src = X_Q + (which == 0 ? hq * PD_HD : a.qd + (which - 1) * a.kvd + g * PD_HD) + d;
                    u64 w = tag_load(X + src);
                    while ((u32)(w >> 32) != e) w = tag_load(X + src);
                    // The new k and v as the cache holds them (the graph's
                    // attention reads them back from it).
                    const float x = __uint_as_float((u32)w);
                    qs[threadIdx.x] = which == 0 ? x : kv_round(x);
                }
                __syncthreads();
                PD_TMARK(15);
                float m = __int_as_float(0xff800000);  // -inf
                for (u32 j = threadIdx.x; j <= pos; j += PD_THREADS) {
                    float s = 0.0f;
                    if (j < pos) {
                        // The row as 16-byte words of KE elements.
                        constexpr int KW = PD_HD * (int)sizeof(kv_t) / 16, KE = 16 / (int)sizeof(kv_t);
                        const uint4* kr = (const uint4*)(K + (u64)j * PD_HD);
#pragma unroll
                        for (int h = 0; h < KW / 4; ++h) {  // four loads in flight at a time
                            uint4 kv[4];
#pragma unroll
                            for (int u = 0; u < 4; ++u) kv[u] = __ldg(kr + 4 * h + u);
#pragma unroll
                            for (int u = 0; u < 4; ++u) s += pd_dot_word(kv[u], qs + KE * (4 * h + u));
                        }
                    } else {
                        for (int d = 0; d < PD_HD; ++d) s += kn[d] * qs[d];
                    }
                    s *= a.scale;
                    sc[j] = s;
                    m = fmaxf(m, s);
                }
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
                if (lane == 0) red[warp] = m;
                __syncthreads();
                m = red[0];
#pragma unroll
                for (int i = 1; i < PD_WARPS; ++i) m = fmaxf(m, red[i]);
                __syncthreads();
                PD_TMARK(16);
                float z = 0.0f;
                for (u32 j = threadIdx.x; j <= pos; j += PD_THREADS) {
                    const float x = __expf(sc[j] - m);
                    sc[j] = x;
                    z += x;
                }
                z = pd_block_sum(z, red);  // its barriers publish sc
                // Values of the cached positions: thread t takes dims
                // 4 (t % 16).. of every S-th position from t / 16, four rows
                // requested at a time; the stripes add up by a shuffle in the
                // warp and through shared memory across warps.
                constexpr u32 S = PD_THREADS / 16;
                const u32 c = threadIdx.x & 15;
                float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                u32 j = threadIdx.x >> 4;
                for (; j + 3 * S < pos; j += 4 * S) {
                    float4 v[4];
#pragma unroll
                    for (int u = 0; u < 4; ++u) v[u] = pd_v4(V, (u64)(j + u * S) * 16 + c);
#pragma unroll
                    for (int u = 0; u < 4; ++u) {
                        const float wgt = sc[j + u * S];
                        acc[0] += wgt * v[u].x;
                        acc[1] += wgt * v[u].y;
                        acc[2] += wgt * v[u].z;
                        acc[3] += wgt * v[u].w;
                    }
                }
                for (; j < pos; j += S) {
                    const float4 v = pd_v4(V, (u64)j * 16 + c);
                    const float wgt = sc[j];
                    acc[0] += wgt * v.x;
                    acc[1] += wgt * v.y;
                    acc[2] += wgt * v.z;
                    acc[3] += wgt * v.w;
                }
#pragma unroll
                for (int k = 0; k < 4; ++k) acc[k] += __shfl_xor_sync(0xffffffffu, acc[k], 16);
                if (lane < 16) {
#pragma unroll
                    for (int k = 0; k < 4; ++k) part[warp * PD_HD + 4 * lane + k] = acc[k];
                }
                __syncthreads();
                if (threadIdx.x < PD_HD) {
                    float o = sc[pos] * vn[threadIdx.x];
#pragma unroll
                    for (int i = 0; i < PD_WARPS; ++i) o += part[i * PD_HD + threadIdx.x];
                    tag_store(X + X_ATT + hq * PD_HD + threadIdx.x, o / z, e + 1);
                }
            }
            if (PD_PREFETCH_LATE && pd_bid() < a.nh) pd_prefetch(wbuf(gl + 1), a, Ln);
            ++e;
            __syncthreads();
            PD_MARK(1);
            // ---- o: h += Wo att
            {
#if PD_BULK
                const u8* q = wb + B.o_q + warp * (a.qd / 2);
                const u8* sc = wb + B.o_s + ((ro.lo * (a.qd / 8)) & 15) + warp * (a.qd / 8);
#else
                const u8* q = ws.o + (u64)warp * pd_rec(a.qd);
                const u8* sc = q + a.qd / 2;
#endif
                pd_residual(hreg, xs, X + X_ATT, a.qd, q, sc, X + X_H, own, ro.n, e);
            }
            ++e;
            __syncthreads();
            PD_MARK(2);
            // ---- gate | up
            {
                const PdRange r = pd_items(a.ff);
                if (r.n > 0) {
                    float v[PD_MAXPER], nw[PD_MAXPER];
                    pd_norm_weights(nw, L.ffn_norm, a.d);
                    pd_load_tagged(v, X + X_H, a.d, e);
                    PD_MARK(9);
                    pd_norm(xs, v, nw, a, red);
                    PD_MARK(10);
                }
                for (u32 it = warp; it < r.n; it += PD_WARPS) {
#if PD_BULK
                    const u32 sb = a.d / 8, pre = (r.lo * sb) & 15;
                    const u8 *gq = wb + B.g_q + it * (a.d / 2), *gs = wb + B.g_s + pre + it * sb;
                    const u8 *uq = wb + B.u_q + it * (a.d / 2), *us = wb + B.u_s + pre + it * sb;
#else
                    const u8* r0 = ws.g + (u64)it * 2 * rd;
                    const u8 *gq = r0, *gs = r0 + a.d / 2, *uq = r0 + rd, *us = r0 + rd + a.d / 2;
#endif
                    const float gv = pd_dot_q41(gq, gs, a.d, xs, lane);
                    const float uv = pd_dot_q41(uq, us, a.d, xs, lane);
                    // silu as model.cu's gated activation computes it.
                    if (lane == 0) tag_store(X + X_ACT + r.lo + it, gv / (1.0f + __expf(-gv)) * uv, e + 1);
                }
                ++e;
                __syncthreads();
                PD_MARK(3);
            }
            // ---- down: h += Wd act
            {
#if PD_BULK
                const u8* q = wb + B.d_q + warp * (a.ff / 2);
                const u8* sc = wb + B.d_s + ((ro.lo * (a.ff / 8)) & 15) + warp * (a.ff / 8);
#else
                const u8* q = ws.d + (u64)warp * pd_rec(a.ff);
                const u8* sc = q + a.ff / 2;
#endif
                pd_residual(hreg, xs, X + X_ACT, a.ff, q, sc, X + X_H, own, ro.n, e);
            }
            ++e;
            __syncthreads();
            PD_MARK(4);
        }
        // ---- logits: the output norm, this block's rows of the output
        // weight, its best; block 0 also reads the host's cancel word.
        // With the sampler, the repetition penalty (tokens of the window,
        // sp.mask) applies to each logit as it is computed, and DENSE and
        // TOPK keep the slice's logits (sp.lg) for their part.
        const u32 sbase = a.s.mode >= PD_SAMPLE_DENSE ? position_base(a.s.seed_lo, a.s.seed_hi, pos + 1) : 0u;
        const PdSamp sp = PD_SAMP_AREAS();
        const bool pen = PD_PENALTY_ON;
        // Two sets of parts, by the token's parity: a block can reach the
        // next token's logits while another still reads this token's parts
        // (blocks without rows of a layer wait on no one), but not the
        // logits after (the flags).
        u64* sset = a.s.samp + (u64)(t & 1) * gridDim.x * (PD_PARTS + PD_CANDS);
        // The bests and the cancel word likewise.
        u64* bset = a.best + (u64)(t & 1) * (gridDim.x + 1);
        {
            const u64* Xl = a.x + (u64)((t * a.nl + a.nl - 1) & 1) * xw;
            float v[PD_MAXPER], nw[PD_MAXPER];
            u64 wv[PD_MAXPER];
            pd_norm_weights(nw, a.out_norm, a.d);
            pd_request_tagged(wv, Xl + X_H, a.d, e);
            // The host's cancel word, read at the phase's start so that its
            // round trip does not delay block 0's best (and so every
            // block's flags wait).
            u32 done = 0;
            if (pd_bid() == 0 && threadIdx.x == 0) done = *(volatile const u32*)&ctl->done;
            if (pen) {
                const PdRange r = pd_items(a.vocab);
                pd_window_mask<PdCfg>(sp, a.s, r.lo, r.n, pos + 1, t, tok0, s_wstart, s_wn);
            }
            pd_finish_tagged(v, wv, Xl + X_H, e);
            pd_norm(xs, v, nw, a, red);
            PD_TMARK(14);
            const PdRange r = pd_items(a.vocab);
            float xr[PD_MAXW][8];
            pd_x_words(xr, xs, PD_OUTQ8(a), a.d, lane);
            u64 best = 0;
            // Rows j0, j0 + PD_WARPS, ... of the slice (PD_ROWS of them
            // below end) from quants Q and scales Sc of its row j0 = 0.
            auto rows = [&](const u8* Q, const u8* Sc, u32 j0, u32 end) {
                float s[PD_ROWS];
                pd_dot_rows(s, Q, Sc, PD_OUTQ8(a), a.d, j0, PD_WARPS, end, xr, lane);
                // Lane u keeps row u's logit and the warp stores its rows'
                // logits at once, not a store a row from lane 0 each in its
                // own branch (sampled +0.4%: bench/RESULTS.md, session 36).
                float mine = 0.0f;
#pragma unroll
                for (int u = 0; u < PD_ROWS; ++u) {
                    const u32 j = j0 + u * PD_WARPS;
                    float l = s[u];
#if PD_PEN_IN_DOTS
                    if (pen && j < end && ((sp.mask[j >> 5] >> (j & 31)) & 1u)) l = pd_penalised(l, a.s.penalty);
#endif
                    mine = lane == u ? l : mine;
                    if (j < end) best = max(best, pd_key(l, r.lo + j));
                }
                {
                    const u32 j = j0 + lane * PD_WARPS;
                    if ((a.s.mode >= PD_SAMPLE_DENSE || (!PD_PEN_IN_DOTS && pen)) && lane < PD_ROWS && j < end)
                        sp.lg[j] = mine;
                }
            };
            // The rows past the resident ones stream from global memory,
            // first, then the resident ones (loaded once a launch).
            const u32 res = pd_res_rows(a), qb = pd_out_qb(a), sb = pd_out_sb(a);
            const u8* gs = a.out + (u64)a.vocab * qb;
            for (u32 j0 = res + warp; j0 < r.n; j0 += PD_ROWS * PD_WARPS)
                rows(a.out + (u64)r.lo * qb, gs + (u64)r.lo * sb, j0, r.n);
            if (res > 0) {
                mbar_wait(&lbar, 0);  // at once after the launch's first token
                const u8* lq = smem + a.res_off;
                const u8* ls = lq + res * qb + (((u64)a.vocab * qb + (u64)r.lo * sb) & 15);
                for (u32 j0 = warp; j0 < res; j0 += PD_ROWS * PD_WARPS) rows(lq, ls, j0, res);
            }
#if !PD_PEN_IN_DOTS
            if (pen) {
                // The penalty on the stored logits, then the slice's best
                // again, in a pass of its own: applied in the rows above,
                // its division's code sat in every unrolled row of both
                // loops, executed or not, in every sampled chain.
                __syncthreads();
                best = 0;
                for (u32 j = threadIdx.x; j < r.n; j += PD_THREADS) {
                    float l = sp.lg[j];
                    if ((sp.mask[j >> 5] >> (j & 31)) & 1u) {
                        l = pd_penalised(l, a.s.penalty);
                        sp.lg[j] = l;
                    }
                    best = max(best, pd_key(l, r.lo + j));
                }
                best = pd_warp_max_u64<PdCfg::REDUX_MAX>(best);
            }
#endif
            if (lane == 0) wbest[warp] = best;
            // The part's selection fields, published by this barrier (the
            // part resets them for the pick).
            if (a.s.mode == PD_SAMPLE_TOPK) pd_select_begin(ss);
            __syncthreads();
            if (warp == 0) {
                const u64 mx = pd_max_of_warps<PdCfg>(wbest);
                if (lane == 0) {
                    bset[pd_bid()] = mx;
                    s_bkey = mx;
                    if (pd_bid() == 0) bset[gridDim.x] = done;
                }
            }
            PD_TMARK(11);
            PD_BT(12);
            if (a.s.mode >= PD_SAMPLE_DENSE) {
                __syncthreads();
                pd_sample_publish<PdCfg>(sp, ss, a.s, sset, r.lo, r.n, s_bkey, sbase);
#ifdef PD_DIAG_TWICE
                PD_BT(15);
                __syncthreads();
                pd_sample_publish<PdCfg>(sp, ss, a.s, sset, r.lo, r.n, s_bkey, sbase);
#endif
            }
            PD_TMARK(12);
            PD_BT(13);
            pd_end_flags(a.flags, ++e);
        }
        // ---- the token: every block takes the argmax of the bests (and
        // the cancel word), or the sampler's pick from every block's part,
        // so that all agree on it and on stopping.
        pd_wait_flags(a.flags, e);
        PD_TMARK(13);
        PD_BT(14);
        // The cancel word, requested beside the bests (or the sampler's
        // parts) rather than after them: its round trip is off the path.
        u32 cancel = 0;
        if (threadIdx.x == PD_THREADS - 1) cancel = (u32)__ldcg(bset + gridDim.x);
        // The token goes to the host from the publisher block, not from a
        // block with rows in the next token's first layer: publish_token's
        // system-scope fences would delay that block's q|k|v rows, which
        // every attention block waits on.
        const bool publisher = pd_bid() == PD_PUBLISHER;
        if (a.s.mode >= PD_SAMPLE_DENSE) {
#ifdef PD_DIAG_TWICE
            {
                (void)pd_sample_pick<PdCfg>(sp, ss, a.s, sset, sbase);
                PD_BT(16);
                __syncthreads();
                pd_select_begin(ss);
                __syncthreads();
            }
#endif
            const u32 tok = pd_sample_pick<PdCfg>(sp, ss, a.s, sset, sbase);
            if (threadIdx.x == 0) {
                s_token = tok;
                sp.hist[t] = tok;
                if (publisher) publish_token(a.conveyor, tok0 + 1 + t, tok, ctl);
            }
            if (threadIdx.x == PD_THREADS - 1) s_cancel = cancel;
            __syncthreads();
        } else {
            u64 b = 0;
            for (u32 i = threadIdx.x; i < gridDim.x; i += PD_THREADS) b = max(b, __ldcg(bset + i));
            b = pd_warp_max_u64<PdCfg::REDUX_MAX>(b);
            if (lane == 0) wbest[warp] = b;
            if (threadIdx.x == PD_THREADS - 1) s_cancel = cancel;
            __syncthreads();
            if (warp == 0) {
                const u64 mx = pd_max_of_warps<PdCfg>(wbest);
                if (lane == 0) {
                    s_token = 0xffffffffu - (u32)mx;
                    if (pen) sp.hist[t] = s_token;
                    if (publisher) publish_token(a.conveyor, tok0 + 1 + t, s_token, ctl);
                }
            }
            __syncthreads();
        }
        PD_MARK(5);
#ifdef PD_BLOCK_TIMES
        if (t == PD_BT_TOKEN && threadIdx.x == 0)
            printf("bt %u %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu\n",
                   pd_bid(), bt[11], bt[6], bt[7], bt[8], bt[0], bt[1], bt[2], bt[9], bt[10], bt[3], bt[4], bt[12], bt[13],
                   bt[14], bt[5], bt[15], bt[16]);
#endif
        token = s_token;
        bool stop = s_cancel != 0u || t + 1 >= limit;
        const u32 ns = min(ctl->n_stop, (u32)MAX_STOP);
        for (u32 j = 0; j < ns; ++j) stop |= ctl->stop[j] == token;
        if (stop) {
#ifdef PD_CLOCK
            if (pd_bid() == 0 && threadIdx.x == 0) {
                unsigned long long ck_t1;
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ck_t1));
                const long long ck_c1 = clock64();
                u32 smid;
                asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
                printf("persist clock: %u tokens, %.1f ns a token, %.1f MHz, block 0 on SM %u\n", t + 1,
                       (double)(ck_t1 - ck_t0) / (t + 1), 1e3 * (double)(ck_c1 - ck_c0) / (double)(ck_t1 - ck_t0), smid);
            }
            // Every block's SM (the launch's placement), for gpu.sh
            // persist-clock's log.
            if (threadIdx.x == 0) {
                u32 smid;
                asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
                printf("persist place: block %u role %u SM %u\n", blockIdx.x, pd_bid(), smid);
            }
#endif
#ifdef PD_TIMING
            if (pd_bid() == 0 && threadIdx.x == 0)
                printf("persist timing: %u tokens from %u, block 0 cycles a token: qkv %lld attn %lld o %lld gu %lld "
                       "down %lld logits+token %lld; qkv = rows %lld + h %lld + norm %lld + dots %lld; "
                       "attn = q|k|v words %lld + scores %lld + rest %lld; "
                       "gu = h %lld + norm %lld + dots %lld; logits+token = h+norm %lld + dots %lld + part %lld + "
                       "wait %lld + pick %lld\n",
                       t + 1, pos0, (tm[6] + tm[7] + tm[8] + tm[0]) / (t + 1), (tm[15] + tm[16] + tm[1]) / (t + 1),
                       tm[2] / (t + 1), (tm[9] + tm[10] + tm[3]) / (t + 1), tm[4] / (t + 1),
                       (tm[14] + tm[11] + tm[12] + tm[13] + tm[5]) / (t + 1), tm[6] / (t + 1), tm[7] / (t + 1),
                       tm[8] / (t + 1), tm[0] / (t + 1), tm[15] / (t + 1), tm[16] / (t + 1), tm[1] / (t + 1),
                       tm[9] / (t + 1), tm[10] / (t + 1), tm[3] / (t + 1),
                       tm[14] / (t + 1), tm[11] / (t + 1), tm[12] / (t + 1), tm[13] / (t + 1), tm[5] / (t + 1));
            if (pd_bid() == 0 && threadIdx.x == 0)
                printf("persist timing layer 0: qkv %lld (rows %lld h %lld norm %lld dots %lld) attn %lld (q|k|v words "
                       "%lld scores %lld rest %lld) o %lld gu %lld down %lld\n",
                       (tm0[6] + tm0[7] + tm0[8] + tm0[0]) / (t + 1), tm0[6] / (t + 1), tm0[7] / (t + 1),
                       tm0[8] / (t + 1), tm0[0] / (t + 1), (tm0[15] + tm0[16] + tm0[1]) / (t + 1),
                       tm0[15] / (t + 1), tm0[16] / (t + 1), tm0[1] / (t + 1), tm0[2] / (t + 1),
                       (tm0[9] + tm0[10] + tm0[3]) / (t + 1), tm0[4] / (t + 1));
            if (pd_bid() == 0 && threadIdx.x == 0 && a.s.mode >= PD_SAMPLE_DENSE)
                printf("persist sampler: part = bound+mass %lld + appends %lld + rank %lld; pick = loads+max+bound "
                       "%lld + mass+appends %lld + rank %lld + cuts %lld; candidates: part %lld, pick %lld; candidates "
                       "tested (all tokens) %lld\n",
                       pd_pt[0] / (t + 1), pd_pt[1] / (t + 1), pd_pt[2] / (t + 1), pd_pt[3] / (t + 1),
                       pd_pt[4] / (t + 1), pd_pt[6] / (t + 1), pd_pt[7] / (t + 1), pd_pt[9] / (t + 1),
                       pd_pt[10] / (t + 1), pd_pt[11]);
#endif
            break;
        }
    }
    // The copies last requested (the next token's first layer) land before
    // the block exits: its shared memory must not be written after that.
#if PD_BULK
    mbar_wait(&wbar[gnext & 1], (gnext >> 1) & 1);
    if (pd_res_rows(a) > 0) mbar_wait(&lbar, 0);
#else
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    (void)gnext;
#endif
}
