// akunu CUDA kernels of the forward pass: embedding, RMSNorm, the
// projections (gemv for decode, gemm for prefill), RoPE + KV-cache write and
// attention. common.cuh (the launcher ABI) is prepended by the compiler.
//
// Each kernel computes the same function as the CPU backend
// (crates/akunu-cpu/src/kernels.rs), with f32 accumulation; only the order
// of the additions differs.

// ---------------------------------------------------------------------------
// Shared helpers
// ---------------------------------------------------------------------------

#define FULL_MASK 0xffffffffu

// Bytes of one matrix row of `k` elements of type `dt` (k is a multiple of
// 32 for the quantized types, of 256 for the K-quants: the table validated
// it).
__device__ __forceinline__ u64 row_bytes_of(u32 dt, u32 k) {
    switch (dt) {
    case DT_F32: return (u64)k * 4;
    case DT_Q4_0: return (u64)(k >> 5) * 18;
    case DT_Q4_1: return (u64)(k >> 5) * 20;
    case DT_Q5_0: return (u64)(k >> 5) * 22;
    case DT_Q5_1: return (u64)(k >> 5) * 24;
    case DT_Q8_0: return (u64)(k >> 5) * 34;
    case DT_Q4_K: return (u64)(k >> 8) * 144;
    case DT_Q5_K: return (u64)(k >> 8) * 176;
    case DT_Q6_K: return (u64)(k >> 8) * 210;
    default: return (u64)k * 2;  // F16, BF16
    }
}

// ---- 5-bit and K-quant types (GGML layouts; see the CPU backend's
// quant/blocks.rs for the byte map). Their kernels work on runs of 8
// elements that start at a multiple of 8: such a run never crosses a block,
// a K-quant sub-block (32) or a Q6_K scale group (16).

__device__ __forceinline__ bool is_q5_or_k(u32 dt) {
    return dt == DT_Q5_0 || dt == DT_Q5_1 || dt == DT_Q4_K || dt == DT_Q5_K || dt == DT_Q6_K;
}

// Scale and min (6-bit integers) of sub-block j of a Q4_K/Q5_K super-block
// from its 12 packed bytes `s`.
__device__ __forceinline__ void k4_scale_min(const u8* __restrict__ s, u32 j, float& sc, float& m) {
    if (j < 4) {
        sc = (float)(s[j] & 63);
        m = (float)(s[j + 4] & 63);
    } else {
        sc = (float)((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
        m = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

// Elements [e0, e0 + N) of a row of type `dt` (one of is_q5_or_k): N = 8
// with e0 % 8 == 0 (a run), or N = 1 with any e0 (a single element).
template <u32 N>
__device__ __forceinline__ void load_run_q5k(u32 dt, const u8* __restrict__ row, u32 e0, float (&v)[N]) {
    if (dt == DT_Q5_0 || dt == DT_Q5_1) {
        const bool q51 = dt == DT_Q5_1;
        const u8* blk = row + (u64)(e0 >> 5) * (q51 ? 24 : 22);
        const float d = f16_to_f32(ld_u16(blk));
        const float m = q51 ? f16_to_f32(ld_u16(blk + 2)) : 0.0f;
        const u8* qhp = blk + (q51 ? 4 : 2);
        const u32 qh = (u32)ld_u16(qhp) | ((u32)ld_u16(qhp + 2) << 16);
        const u8* qs = qhp + 4;
        const u32 j0 = e0 & 31, shift = j0 < 16 ? 0 : 4;
#pragma unroll
        for (u32 i = 0; i < N; ++i) {
            const u32 j = j0 + i;
            const u32 q = ((qs[j & 15] >> shift) & 15) | (((qh >> j) & 1) << 4);
            v[i] = q51 ? d * (float)q + m : d * (float)((int)q - 16);
        }
    } else if (dt == DT_Q6_K) {
        const u8* blk = row + (u64)(e0 >> 8) * 210;
        const u32 r = e0 & 255, h = r >> 7, t = (r >> 5) & 3, l0 = r & 31;
        const float s = f16_to_f32(ld_u16(blk + 208)) * (float)(i8)blk[192 + 8 * h + 2 * t + (l0 >> 4)];
        const u8* ql = blk + 64 * h + 32 * (t & 1) + l0;
        const u8* qh = blk + 128 + 32 * h + l0;
        const u32 lsh = 4 * (t >> 1), hsh = 2 * t;
#pragma unroll
        for (u32 i = 0; i < N; ++i) {
            const int q = (int)(((ql[i] >> lsh) & 15) | (((qh[i] >> hsh) & 3) << 4));
            v[i] = s * (float)(q - 32);
        }
    } else {  // Q4_K, Q5_K
        const bool q5 = dt == DT_Q5_K;
        const u8* blk = row + (u64)(e0 >> 8) * (q5 ? 176 : 144);
        const u32 r = e0 & 255, j = r >> 5, l0 = r & 31;
        float sc, mn;
        k4_scale_min(blk + 4, j, sc, mn);
        const float d = f16_to_f32(ld_u16(blk)) * sc;
        const float m = f16_to_f32(ld_u16(blk + 2)) * mn;
        const u8* qs = blk + (q5 ? 48 : 16) + 32 * (j >> 1) + l0;
        const u8* qh = blk + 16 + l0;
        const u32 shift = 4 * (j & 1);
#pragma unroll
        for (u32 i = 0; i < N; ++i) {
            u32 q = (qs[i] >> shift) & 15;
            if (q5) q |= ((qh[i] >> j) & 1) << 4;
            v[i] = d * (float)q - m;
        }
    }
}

// Repacked weights. GGML's Q4_0/Q4_1/Q8_0 blocks are 18/20/34 bytes, so
// their quants are only 2-byte aligned and a warp reading them in place
// issues many narrow loads. The backend repacks every such tensor when it
// uploads it (lib.rs, `repack_blocks`): for a tensor of R rows of nb blocks
// it stores all the blocks' quant bytes first, [R * nb][QB], then all their
// scales, [R * nb][SB] (d, or d and m for Q4_1). The size is unchanged and
// the quants of every row are 16-byte aligned. Kernels need the tensor's
// row count to find the scales; the host checks that such tensors are
// always bound whole.
__device__ __forceinline__ bool is_repacked(u32 dt) {
    return dt == DT_Q4_0 || dt == DT_Q4_1 || dt == DT_Q8_0;
}
__device__ __forceinline__ u32 quant_bytes(u32 dt) { return dt == DT_Q8_0 ? 32 : 16; }
__device__ __forceinline__ u32 scale_bytes(u32 dt) { return dt == DT_Q4_1 ? 4 : 2; }

// One weight row: `w` is its first byte (its quants, when repacked) and
// `sc` its scales (repacked types only).
struct WRow {
    const u8* w;
    const u8* sc;
};

__device__ __forceinline__ WRow weight_row(const u8* base, u32 dt, u32 k, u64 n_rows, u64 row) {
    WRow r;
    if (is_repacked(dt)) {
        const u64 nb = k >> 5;
        const u64 qb = quant_bytes(dt);
        r.w = base + row * nb * qb;
        r.sc = base + n_rows * nb * qb + row * nb * scale_bytes(dt);
    } else {
        r.w = base + row * row_bytes_of(dt, k);
        r.sc = nullptr;
    }
    return r;
}

// Element `e` of a weight row of type `dt`, dequantized.
__device__ __forceinline__ float load_elem(u32 dt, WRow row, u32 e) {
    switch (dt) {
    case DT_F32: return ((const float*)row.w)[e];
    case DT_F16: return f16_to_f32(ld_u16(row.w + 2 * (u64)e));
    case DT_BF16: return bf16_to_f32(ld_u16(row.w + 2 * (u64)e));
    case DT_Q8_0: {
        const u32 blk = e >> 5;
        return f16_to_f32(ld_u16(row.sc + 2 * blk)) * (float)(i8)row.w[32 * blk + (e & 31)];
    }
    case DT_Q4_0: {
        const u32 blk = e >> 5, j = e & 31;
        const u32 q = row.w[16 * blk + (j & 15)];
        const int nib = (int)(j < 16 ? (q & 15) : (q >> 4));
        return f16_to_f32(ld_u16(row.sc + 2 * blk)) * (float)(nib - 8);
    }
    case DT_Q4_1: {
        const u32 blk = e >> 5, j = e & 31;
        const u32 q = row.w[16 * blk + (j & 15)];
        const u32 nib = j < 16 ? (q & 15) : (q >> 4);
        const u8* dm = row.sc + 4 * blk;
        return f16_to_f32(ld_u16(dm)) * (float)nib + f16_to_f32(ld_u16(dm + 2));
    }
    default: {  // Q5_0, Q5_1, Q4_K, Q5_K, Q6_K
        float v[1];
        load_run_q5k<1>(dt, row.w, e, v);
        return v[0];
    }
    }
}

// Binding `i` (0..7) without indexing the parameter array at run time
// (which could force a copy of it into local memory).
__device__ __forceinline__ char* bind_at(const Bind& b, u32 i) {
    char* p = b.p[0];
    p = i == 1 ? b.p[1] : p;
    p = i == 2 ? b.p[2] : p;
    p = i == 3 ? b.p[3] : p;
    p = i == 4 ? b.p[4] : p;
    p = i == 5 ? b.p[5] : p;
    p = i == 6 ? b.p[6] : p;
    p = i == 7 ? b.p[7] : p;
    return p;
}

__device__ __forceinline__ u32 pick3(const u32 (&v)[3], u32 s) {
    return s == 0 ? v[0] : (s == 1 ? v[1] : v[2]);
}

// e^x with the argument clamped like the CPU's exp_fast, so that silu of a
// very negative input is the same tiny value rather than -0.
__device__ __forceinline__ float exp_clamped(float x) {
    return expf(fminf(fmaxf(x, -87.0f), 88.0f));
}

__device__ __forceinline__ float silu(float x) {
    return x / (1.0f + exp_clamped(-x));
}

__device__ __forceinline__ float gelu_tanh(float x) {
    const float c = 0.7978846f;  // sqrt(2/pi), as the CPU rounds it
    return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
}

// The gated activation (ACT_SWIGLU or ACT_GEGLU) of gate g and up u.
__device__ __forceinline__ float gated(float g, float u, u32 act) {
    return (act == ACT_GEGLU ? gelu_tanh(g) : silu(g)) * u;
}

// Element j of the product's input row `xr` (k wide, or [gate | up] of
// width 2k with a gated activation).
__device__ __forceinline__ float gemv_input(const float* __restrict__ xr, u32 j, u32 k, u32 act) {
    return act == ACT_NONE ? xr[j] : gated(xr[j], xr[k + j], act);
}

__device__ __forceinline__ u32 gemv_total_rows(const GemvParams& p) {
    u32 t = p.n[0];
    if (p.n_seg > 1) t += p.n[1];
    if (p.n_seg > 2) t += p.n[2];
    return t;
}

// Output row `o` of a product, resolved to its weight segment.
struct SegRow {
    WRow row;           // the weight row
    const float* bias;  // its bias, or null
    u32 dt;             // weight dtype
};

__device__ __forceinline__ SegRow seg_row(const Bind& b, const GemvParams& p, u32 o) {
    u32 s = 0, off = 0;
    if (p.n_seg > 1 && o >= p.n[0]) {
        s = 1;
        off = p.n[0];
        if (p.n_seg > 2 && o >= p.n[0] + p.n[1]) {
            s = 2;
            off = p.n[0] + p.n[1];
        }
    }
    SegRow g;
    const u32 local = o - off;
    g.dt = pick3(p.dtype, s);
    g.row = weight_row((const u8*)bind_at(b, 2 + s), g.dt, p.k, pick3(p.n, s), local);
    g.bias = p.bias ? (const float*)bind_at(b, 2 + p.n_seg + s) + local : nullptr;
    return g;
}

__device__ __forceinline__ float softcap_score(float s, float cap) {
    return cap > 0.0f ? cap * tanhf(s / cap) : s;
}

// ---------------------------------------------------------------------------
// Embedding: out[r] = dequant(table[id_r]) * scale.
// grid.x = rows, block 256: one block per token, threads over the row.
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(256)
k_embedding(Bind b, EmbedParams p, StepArg a) {
    AKUNU_PROLOGUE(a);
    Step st = step_of(a);
    const u32 r = blockIdx.x;
    const u32 slot = (a.patch == PATCH_TOKEN_OFFSET ? st.tok : 0u) + r;
    u32 id = ((const u32*)b.p[0])[slot];
    // Out-of-range ids are clamped to the last row, as the CPU backend does.
    if (id >= p.n_vocab) id = p.n_vocab - 1;
    const WRow row = weight_row((const u8*)b.p[1], p.dtype, p.dim, p.n_vocab, id);
    float* __restrict__ out = (float*)b.p[2] + (u64)r * p.dim;
    for (u32 e = threadIdx.x; e < p.dim; e += blockDim.x)
        out[e] = load_elem(p.dtype, row, e) * p.scale;
}

// ---------------------------------------------------------------------------
// RMSNorm
// ---------------------------------------------------------------------------


// out = x * rms_inv(x) * w. grid.x = rows, block 512: one block per row,
// one block-wide reduction.
extern "C" __global__ void __launch_bounds__(512)
k_rmsnorm(Bind b, NormParams p, StepArg a) {
    AKUNU_PROLOGUE(a);
    __shared__ float red[32];
    const u32 d = p.dim;
    const float* __restrict__ x = (const float*)b.p[0] + (u64)blockIdx.x * d;
    const float* __restrict__ w = (const float*)b.p[1];
    float* __restrict__ out = (float*)b.p[2] + (u64)blockIdx.x * d;
    float ss = 0.0f;
    for (u32 i = threadIdx.x; i < d; i += blockDim.x) ss += x[i] * x[i];
    const float s = rms_inv(block_sum(ss, red), d, p.eps);
    for (u32 i = threadIdx.x; i < d; i += blockDim.x) out[i] = x[i] * s * w[i];
}

// h += delta (or h += rmsnorm(delta) * post_w with post_norm), then
// out = rmsnorm(h) * w. grid.x = rows, block 512. Each thread re-reads only
// the h elements it wrote itself, so no barrier is needed between the
// update and the final pass beyond the reductions'.
extern "C" __global__ void __launch_bounds__(512)
k_residual_rmsnorm(Bind b, NormParams p, StepArg a) {
    AKUNU_PROLOGUE(a);
    __shared__ float red[32];
    const u32 d = p.dim;
    const u64 base = (u64)blockIdx.x * d;
    float* __restrict__ h = (float*)b.p[0] + base;
    const float* __restrict__ delta = (const float*)b.p[1] + base;
    const float* __restrict__ w = (const float*)b.p[2];
    float* __restrict__ out = (float*)b.p[3] + base;
    float ss = 0.0f;
    if (p.post_norm) {
        const float* __restrict__ pw = (const float*)b.p[4];
        float sd = 0.0f;
        for (u32 i = threadIdx.x; i < d; i += blockDim.x) sd += delta[i] * delta[i];
        const float s = rms_inv(block_sum(sd, red), d, p.eps);
        for (u32 i = threadIdx.x; i < d; i += blockDim.x) {
            float v = h[i] + delta[i] * s * pw[i];
            h[i] = v;
            ss += v * v;
        }
    } else {
        for (u32 i = threadIdx.x; i < d; i += blockDim.x) {
            float v = h[i] + delta[i];
            h[i] = v;
            ss += v * v;
        }
    }
    const float s = rms_inv(block_sum(ss, red), d, p.eps);
    for (u32 i = threadIdx.x; i < d; i += blockDim.x) out[i] = h[i] * s * w[i];
}

// ---------------------------------------------------------------------------
// GEMV (decode and short steps: 1..4 input rows)
//
// Block = 8 warps, dynamic shared memory holding the staged input rows. Each warp computes `rpw` output
// rows (1 or 2) side by side, so that every input value it reads from
// shared memory serves rpw weights: with 4-bit weights, one input float per
// weight would saturate shared-memory bandwidth long before DRAM's. The grid
// is what stays resident (launch.rs), and each block walks row groups of
// 8 * rpw rows, so the input is staged once per block.
//
// Before waiting on the previous kernel (programmatic dependent launch),
// each warp prefetches its first rows' weights into L2: weights are
// constant, so their DRAM latency overlaps the previous kernel's tail. Then
// the block stages its input rows: activation applied, or RMS-normalised
// (the launcher's norm fusion: the input is the residual stream h and the
// staged row is rmsnorm(h) * w_norm, which replaces a separate norm kernel).
//
// Staged rows are padded: element e lives at xs_at(e) = e + 4 * (e / 32),
// so that lanes reading 32-element groups at a stride of one group hit
// distinct banks. Quantized rows (repacked layout, see weight_row): each
// lane takes whole blocks, 16 (Q4) or 32 (Q8) bytes of quants with 16-byte
// loads, so a warp reads 32 consecutive blocks (512 or 1024 bytes) per
// iteration. F16/BF16 lanes take runs of 8 elements (16-byte loads), F32
// runs of 4, when the row is aligned; single elements otherwise. Every loop
// issues several iterations' loads before using any, to keep enough bytes
// in flight. Accumulators live in registers (unrolled over rpw output rows
// and at most 4 input rows).
// ---------------------------------------------------------------------------

#define GEMV_MAX_ROWS 4
// Input rows of the verification gemv kernels (`_v8`): the same per-row
// arithmetic as the kernels above, more accumulators.
#define GEMV_VERIFY_ROWS 8
#define GEMV_RPW 2  // most output rows per warp

// Launch extras of k_gemv (launch.rs `GemvExtra`).
struct GemvExtra {
    const float* norm_w;  // non-null: stage rmsnorm(x) * norm_w (one input row)
    float norm_eps;
    u32 tc_split;  // the tensor-core gemv's warps per row tile (gemv_tc.cu)
    u32 tc_chunk;  // its groups per chunk of a warp's share: 1, or TcbT::CG
    // The tensor-core gemv's paired epilogue (a gate | up product of n[0] +
    // n[0] rows): an ACT_* other than ACT_NONE makes tile t hold gate rows
    // 8t..8t+7 and the up rows of the same units, and write
    // gated(gate, up) of unit u to out[u] (gemv_tc.cu `tcg_finish`).
    u32 pair_act;
};

// Padded shared-memory index of input element e, and a staged row's length.
__device__ __forceinline__ u32 xs_at(u32 e) { return e + ((e >> 5) << 2); }
__device__ __forceinline__ u32 xs_row(u32 k) { return ((k + 31) >> 5) * 36; }

__device__ __forceinline__ float dot4(float4 a, float w0, float w1, float w2, float w3) {
    return a.x * w0 + a.y * w1 + a.z * w2 + a.w * w3;
}

// Small integers to float without the conversion unit (I2F runs at a
// quarter of the ALU rate and would bound 4-bit products): OR the integer
// into the mantissa of 2^23 and subtract 2^23 plus an offset. Exact for
// integers below 2^23.
#define F_2P23 8388608.0f
__device__ __forceinline__ float u_to_f(u32 v, float minus) {
    return __int_as_float((int)(v | 0x4B000000u)) - minus;
}

// sum_b (1 + nibble_b / 16) * x_b over the 4 nibbles of `word` at bits
// `lo` + 8b .. + 3 (lo = 0 or 4): each nibble is placed straight into the
// top mantissa bits of 1.0f, two integer operations and no float add per
// weight. The caller recovers sum(q x) = 16 * (that - sum(x)); the
// rounding error this adds is about 1e-6 of the block's product.
template <u32 S>
__device__ __forceinline__ float nib_one_plus(u32 word) {  // nibble at bit S
    u32 at19;
    if constexpr (S <= 19) at19 = word << (19 - S);
    else at19 = word >> (S - 19);
    return __int_as_float((int)((at19 & (0xFu << 19)) | 0x3F800000u));
}
template <u32 LO>
__device__ __forceinline__ float dot_nib4(u32 word, float4 x) {
    return dot4(x, nib_one_plus<LO>(word), nib_one_plus<8 + LO>(word), nib_one_plus<16 + LO>(word),
                nib_one_plus<24 + LO>(word));
}

// sum_b (i8)byte_b * x_b over the word's 4 bytes (byte ^ 0x80 = q + 128).
__device__ __forceinline__ float dot_i8x4(u32 word, float4 x) {
    const u32 u = word ^ 0x80808080u;
    const float minus = F_2P23 + 128.0f;
    return dot4(x, u_to_f(u & 0xff, minus), u_to_f((u >> 8) & 0xff, minus),
                u_to_f((u >> 16) & 0xff, minus), u_to_f(u >> 24, minus));
}

__device__ __forceinline__ float hsum4(float4 x) { return (x.x + x.y) + (x.z + x.w); }

// [output row][input row]; MR input rows at most (GEMV_MAX_ROWS, or
// GEMV_VERIFY_ROWS in the verification kernels).
template <int MR>
using GemvAcc = float[GEMV_RPW][MR];

// Loads in flight per lane per output row (halved with two rows).
#define Q8_U 2
#define Q4_U 4
#define F16_U 4
#define F32_U 4

template <int RPW, int MR>
__device__ __forceinline__ void gemv_q8_0(const WRow* __restrict__ w, const float* __restrict__ xs,
                                          u32 k, u32 rows, u32 lane, GemvAcc<MR>& acc) {
    constexpr u32 U = Q8_U / RPW;
    constexpr u32 MAXR = RPW == 2 ? 1 : MR;  // two output rows: one input row
    const u32 nb = k >> 5, ks = xs_row(k);
    for (u32 b0 = 0; b0 < nb; b0 += 32 * U) {
        uint4 q0[RPW][U], q1[RPW][U];
        u32 dh[RPW][U];
#pragma unroll
        for (u32 u = 0; u < U; ++u) {
            const u32 blk = b0 + u * 32 + lane;
            if (blk < nb) {
#pragma unroll
                for (u32 o = 0; o < RPW; ++o) {
                    const uint4* qp = (const uint4*)(w[o].w + (u64)blk * 32);
                    q0[o][u] = qp[0];
                    q1[o][u] = qp[1];
                    dh[o][u] = ld_u16(w[o].sc + 2 * (u64)blk);
                }
            }
        }
#pragma unroll
        for (u32 u = 0; u < U; ++u) {
            const u32 blk = b0 + u * 32 + lane;
            if (blk < nb) {
                const float* xb = xs + blk * 36;
#pragma unroll
                for (u32 r = 0; r < MAXR; ++r) {
                    if (r < rows) {
                        const float4* x4 = (const float4*)(xb + r * ks);
                        const float4 a0 = x4[0], a1 = x4[1], a2 = x4[2], a3 = x4[3];
                        const float4 a4 = x4[4], a5 = x4[5], a6 = x4[6], a7 = x4[7];
#pragma unroll
                        for (u32 o = 0; o < RPW; ++o) {
                            const float s = dot_i8x4(q0[o][u].x, a0) + dot_i8x4(q0[o][u].y, a1) +
                                            dot_i8x4(q0[o][u].z, a2) + dot_i8x4(q0[o][u].w, a3) +
                                            dot_i8x4(q1[o][u].x, a4) + dot_i8x4(q1[o][u].y, a5) +
                                            dot_i8x4(q1[o][u].z, a6) + dot_i8x4(q1[o][u].w, a7);
                            acc[o][r] += f16_to_f32((u16)dh[o][u]) * s;
                        }
                    }
                }
            }
        }
    }
}

// Q4_0 and Q4_1: quant byte j holds element j (low nibble) and 16 + j
// (high nibble).
template <bool Q41, int RPW, int MR>
__device__ __forceinline__ void gemv_q4(const WRow* __restrict__ w, const float* __restrict__ xs,
                                        u32 k, u32 rows, u32 lane, GemvAcc<MR>& acc) {
    // Q4_1 carries the input sums too: fewer loads in flight, no spills.
    constexpr u32 U = (Q41 ? Q4_U / 2 : Q4_U) / RPW;
    constexpr u32 MAXR = RPW == 2 ? 1 : MR;  // two output rows: one input row
    const u32 nb = k >> 5, ks = xs_row(k);
    for (u32 b0 = 0; b0 < nb; b0 += 32 * U) {
        uint4 q[RPW][U];
        u32 dm[RPW][U];
#pragma unroll
        for (u32 u = 0; u < U; ++u) {
            const u32 blk = b0 + u * 32 + lane;
            if (blk < nb) {
#pragma unroll
                for (u32 o = 0; o < RPW; ++o) {
                    q[o][u] = *(const uint4*)(w[o].w + (u64)blk * 16);
                    dm[o][u] = Q41 ? *(const u32*)(w[o].sc + 4 * (u64)blk)
                                   : (u32)ld_u16(w[o].sc + 2 * (u64)blk);
                }
            }
        }
#pragma unroll
        for (u32 u = 0; u < U; ++u) {
            const u32 blk = b0 + u * 32 + lane;
            if (blk < nb) {
                const float* xb = xs + blk * 36;
#pragma unroll
                for (u32 r = 0; r < MAXR; ++r) {
                    if (r < rows) {
                        const float4* x4 = (const float4*)(xb + r * ks);
                        const float4 a0 = x4[0], a1 = x4[1], a2 = x4[2], a3 = x4[3];
                        const float4 c0 = x4[4], c1 = x4[5], c2 = x4[6], c3 = x4[7];
                        const float sx = (hsum4(a0) + hsum4(a1)) + (hsum4(a2) + hsum4(a3)) +
                                         (hsum4(c0) + hsum4(c1)) + (hsum4(c2) + hsum4(c3));
#pragma unroll
                        for (u32 o = 0; o < RPW; ++o) {
                            const uint4 v = q[o][u];
                            const float s1 = dot_nib4<0>(v.x, a0) + dot_nib4<0>(v.y, a1) +
                                             dot_nib4<0>(v.z, a2) + dot_nib4<0>(v.w, a3) +
                                             dot_nib4<4>(v.x, c0) + dot_nib4<4>(v.y, c1) +
                                             dot_nib4<4>(v.z, c2) + dot_nib4<4>(v.w, c3);
                            // sum((q - 8) x) for Q4_0, sum(q x) for Q4_1.
                            const float sq = 16.0f * (s1 - sx) - (Q41 ? 0.0f : 8.0f) * sx;
                            const float d = f16_to_f32((u16)(dm[o][u] & 0xffff));
                            if (Q41) {
                                acc[o][r] += d * sq + f16_to_f32((u16)(dm[o][u] >> 16)) * sx;
                            } else {
                                acc[o][r] += d * sq;
                            }
                        }
                    }
                }
            }
        }
    }
}

// 5-bit and K-quant types (stored as GGML lays them out): lane s of each
// group of 4 dequantizes elements 8s..8s+7 of a 32-element column block
// (one group per block), through the shared 8-element loader.
template <int RPW, int MR>
__device__ __forceinline__ void gemv_q5k(u32 dt, const WRow* __restrict__ w, const float* __restrict__ xs,
                                         u32 k, u32 rows, u32 lane, GemvAcc<MR>& acc) {
    constexpr u32 MAXR = RPW == 2 ? 1 : MR;  // two output rows: one input row
    const u32 nb = k >> 5, part = lane & 3, ks = xs_row(k);
#pragma unroll 2
    for (u32 blk = lane >> 2; blk < nb; blk += 8) {
        const u32 e0 = blk * 32 + 8 * part;
#pragma unroll
        for (u32 o = 0; o < RPW; ++o) {
            float v[8];
            load_run_q5k<8>(dt, w[o].w, e0, v);
#pragma unroll
            for (u32 r = 0; r < MAXR; ++r) {
                if (r < rows) {
                    const float4* x4 = (const float4*)(xs + r * ks + xs_at(e0));
                    acc[o][r] += dot4(x4[0], v[0], v[1], v[2], v[3]) + dot4(x4[1], v[4], v[5], v[6], v[7]);
                }
            }
        }
    }
}

__device__ __forceinline__ float half_to_f32(u32 h, bool bf) {
    return bf ? bf16_to_f32((u16)h) : f16_to_f32((u16)h);
}

template <bool BF, int RPW, int MR>
__device__ __forceinline__ void gemv_f16(const WRow* __restrict__ w, const float* __restrict__ xs,
                                         u32 k, u32 rows, u32 lane, GemvAcc<MR>& acc) {
    constexpr u32 U = F16_U / RPW;
    constexpr u32 MAXR = RPW == 2 ? 1 : MR;  // two output rows: one input row
    const u32 ks = xs_row(k);
    bool aligned = (k & 7) == 0;
#pragma unroll
    for (u32 o = 0; o < RPW; ++o) aligned = aligned && ((u64)w[o].w & 15) == 0;
    if (aligned) {
        // 8 elements per lane, 256 per warp iteration.
        for (u32 e0 = 0; e0 < k; e0 += 256 * U) {
            uint4 v[RPW][U];
#pragma unroll
            for (u32 u = 0; u < U; ++u) {
                const u32 e = e0 + u * 256 + lane * 8;
                if (e < k) {
#pragma unroll
                    for (u32 o = 0; o < RPW; ++o) v[o][u] = ((const uint4*)w[o].w)[e >> 3];
                }
            }
#pragma unroll
            for (u32 u = 0; u < U; ++u) {
                const u32 e = e0 + u * 256 + lane * 8;
                if (e < k) {
                    const float* xb = xs + xs_at(e);
#pragma unroll
                    for (u32 r = 0; r < MAXR; ++r) {
                        if (r < rows) {
                            const float4* x4 = (const float4*)(xb + r * ks);
                            const float4 lo = x4[0], hi = x4[1];
#pragma unroll
                            for (u32 o = 0; o < RPW; ++o) {
                                const uint4 t = v[o][u];
                                acc[o][r] += dot4(lo, half_to_f32(t.x & 0xffff, BF), half_to_f32(t.x >> 16, BF),
                                                  half_to_f32(t.y & 0xffff, BF), half_to_f32(t.y >> 16, BF)) +
                                             dot4(hi, half_to_f32(t.z & 0xffff, BF), half_to_f32(t.z >> 16, BF),
                                                  half_to_f32(t.w & 0xffff, BF), half_to_f32(t.w >> 16, BF));
                            }
                        }
                    }
                }
            }
        }
    } else {
        for (u32 e = lane; e < k; e += 32) {
#pragma unroll
            for (u32 o = 0; o < RPW; ++o) {
                const float wv = half_to_f32(ld_u16(w[o].w + 2 * (u64)e), BF);
#pragma unroll
                for (u32 r = 0; r < MAXR; ++r)
                    if (r < rows) acc[o][r] += wv * xs[r * ks + xs_at(e)];
            }
        }
    }
}

template <int RPW, int MR>
__device__ __forceinline__ void gemv_f32(const WRow* __restrict__ w, const float* __restrict__ xs,
                                         u32 k, u32 rows, u32 lane, GemvAcc<MR>& acc) {
    constexpr u32 U = F32_U / RPW;
    constexpr u32 MAXR = RPW == 2 ? 1 : MR;  // two output rows: one input row
    const u32 ks = xs_row(k);
    bool aligned = (k & 3) == 0;
#pragma unroll
    for (u32 o = 0; o < RPW; ++o) aligned = aligned && ((u64)w[o].w & 15) == 0;
    if (aligned) {
        for (u32 e0 = 0; e0 < k; e0 += 128 * U) {
            float4 v[RPW][U];
#pragma unroll
            for (u32 u = 0; u < U; ++u) {
                const u32 e = e0 + u * 128 + lane * 4;
                if (e < k) {
#pragma unroll
                    for (u32 o = 0; o < RPW; ++o) v[o][u] = *(const float4*)((const float*)w[o].w + e);
                }
            }
#pragma unroll
            for (u32 u = 0; u < U; ++u) {
                const u32 e = e0 + u * 128 + lane * 4;
                if (e < k) {
#pragma unroll
                    for (u32 r = 0; r < MAXR; ++r) {
                        if (r < rows) {
                            const float4 x = *(const float4*)(xs + r * ks + xs_at(e));
#pragma unroll
                            for (u32 o = 0; o < RPW; ++o)
                                acc[o][r] += dot4(x, v[o][u].x, v[o][u].y, v[o][u].z, v[o][u].w);
                        }
                    }
                }
            }
        }
    } else {
        for (u32 e = lane; e < k; e += 32) {
#pragma unroll
            for (u32 o = 0; o < RPW; ++o) {
                const float wv = ((const float*)w[o].w)[e];
#pragma unroll
                for (u32 r = 0; r < MAXR; ++r)
                    if (r < rows) acc[o][r] += wv * xs[r * ks + xs_at(e)];
            }
        }
    }
}

// The weight loop for type `dt` (DT >= 0: known at compile time).
template <int DT, int RPW, int MR>
__device__ __forceinline__ void gemv_rows(u32 dt, const WRow* __restrict__ w, const float* xs, u32 k,
                                          u32 rows, u32 lane, GemvAcc<MR>& acc) {
    const u32 t = DT >= 0 ? (u32)DT : dt;
    switch (t) {
    case DT_Q8_0: gemv_q8_0<RPW, MR>(w, xs, k, rows, lane, acc); break;
    case DT_Q4_0: gemv_q4<false, RPW, MR>(w, xs, k, rows, lane, acc); break;
    case DT_Q4_1: gemv_q4<true, RPW, MR>(w, xs, k, rows, lane, acc); break;
    case DT_F16: gemv_f16<false, RPW, MR>(w, xs, k, rows, lane, acc); break;
    case DT_BF16: gemv_f16<true, RPW, MR>(w, xs, k, rows, lane, acc); break;
    case DT_Q5_0:
    case DT_Q5_1:
    case DT_Q4_K:
    case DT_Q5_K:
    case DT_Q6_K: gemv_q5k<RPW, MR>(t, w, xs, k, rows, lane, acc); break;
    default: gemv_f32<RPW, MR>(w, xs, k, rows, lane, acc); break;
    }
}

// Bytes of a weight row that the row's warps stream (the quants only, for
// repacked types: the scales are a sixteenth as many and come along).
__device__ __forceinline__ u64 streamed_row_bytes(u32 dt, u32 k) {
    return is_repacked(dt) ? (u64)(k >> 5) * quant_bytes(dt) : row_bytes_of(dt, k);
}

// float4s of input a thread loads before using any: staging must not be a
// chain of serial L2 round trips (k reaches 16K in an 8B model's FFN). A
// gated input loads two float4s per element group, so it takes half as many.
#define STAGE_V 2

// Stages one input row (k floats, float4-aligned) into `dst`, with the
// gated activation when ACT; returns this thread's sum of squares.
template <bool ACT>
__device__ __forceinline__ float stage_row_vec(const float* __restrict__ xr, float* __restrict__ dst,
                                               u32 k, u32 act) {
    constexpr u32 V = ACT ? STAGE_V / 2 : STAGE_V;
    const u32 tid = threadIdx.x, bd = blockDim.x;
    float ss = 0.0f;
    // A float4 at j (a multiple of 4) stays inside one 32-group, so it is
    // contiguous and 16-byte aligned at xs_at(j) too.
    for (u32 base = 0; base < k; base += bd * 4 * V) {
        float4 v[V], g[V];
#pragma unroll
        for (u32 i = 0; i < V; ++i) {
            const u32 j = base + (tid + i * bd) * 4;
            if (j < k) {
                v[i] = *(const float4*)(xr + j);
                if (ACT) g[i] = *(const float4*)(xr + k + j);
            }
        }
#pragma unroll
        for (u32 i = 0; i < V; ++i) {
            const u32 j = base + (tid + i * bd) * 4;
            if (j < k) {
                float4 t = v[i];
                if (ACT) {
                    t.x = gated(t.x, g[i].x, act);
                    t.y = gated(t.y, g[i].y, act);
                    t.z = gated(t.z, g[i].z, act);
                    t.w = gated(t.w, g[i].w, act);
                }
                ss += t.x * t.x + t.y * t.y + t.z * t.z + t.w * t.w;
                *(float4*)(dst + xs_at(j)) = t;
            }
        }
    }
    return ss;
}

// Stages the gemv's input rows in shared memory `xs` (rows of xs_row(k)
// floats, padded: element e at xs_at(e)):
// the activation applied (gated FFN input [gate | up]), or, with the norm
// fusion, rmsnorm(x) * norm_w per row (x rows of stride k). A row's
// arithmetic does not depend on how many rows the step has, so a row of a
// multi-row step (speculative verification) is staged bit-identically to a
// one-row step. Every thread of the block must call it (it contains
// barriers when normalising).
__device__ __forceinline__ void gemv_stage(const Bind& b, const GemvParams& p, const GemvExtra& ex,
                                           u32 rows, float* __restrict__ xs, float* red) {
    const u32 k = p.k, tid = threadIdx.x, bd = blockDim.x;
    const float* __restrict__ x = (const float*)b.p[0];
    const bool norm = ex.norm_w != nullptr;
    const bool vec = (k & 3) == 0 && (p.x_stride & 3) == 0 && ((u64)x & 15) == 0 &&
                     (!norm || ((u64)ex.norm_w & 15) == 0);
    const u32 act = norm ? ACT_NONE : p.input_act;
    for (u32 r = 0; r < rows; ++r) {
        const float* __restrict__ xr = x + (u64)r * p.x_stride;
        float* __restrict__ dst = xs + r * xs_row(k);
        float ss = 0.0f;
        if (vec) {
            ss = act != ACT_NONE ? stage_row_vec<true>(xr, dst, k, act)
                                 : stage_row_vec<false>(xr, dst, k, act);
        } else {
            for (u32 j = tid; j < k; j += bd) {
                const float t = gemv_input(xr, j, k, act);
                ss += t * t;
                dst[xs_at(j)] = t;
            }
        }
        if (!norm) continue;
        // Rescale the elements this thread staged (same index walk).
        const float sc = rms_inv(block_sum(ss, red), k, ex.norm_eps);
        const float* __restrict__ w = ex.norm_w;
        if (vec) {
            for (u32 j = tid * 4; j < k; j += bd * 4) {
                float4 t = *(float4*)(dst + xs_at(j));
                const float4 wv = *(const float4*)(w + j);
                t.x = t.x * sc * wv.x;
                t.y = t.y * sc * wv.y;
                t.z = t.z * sc * wv.z;
                t.w = t.w * sc * wv.w;
                *(float4*)(dst + xs_at(j)) = t;
            }
        } else {
            for (u32 j = tid; j < k; j += bd) dst[xs_at(j)] = dst[xs_at(j)] * sc * w[j];
        }
    }
}

// DT: the weight type of every segment, known at compile time (one kernel
// per type keeps each one's register count low), or -1 to dispatch per row
// (segments of mixed types).
template <int DT, int RPW, int MR>
__device__ __forceinline__ void gemv_body(const Bind& b, const GemvParams& p, const StepArg& a,
                                          const GemvExtra& ex) {
    extern __shared__ float4 gemv_smem[];
    __shared__ float red[32];  // the norm fusion's block reduction
    float* xs = (float*)gemv_smem;
    const u32 k = p.k;
    const u32 rows = a.rows < (u32)MR ? a.rows : (u32)MR;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // Two rows per warp take one input row (launch.rs picks the kernel).
    constexpr u32 rpw = RPW;
    const u32 total = gemv_total_rows(p);
    const u32 per_block = (blockDim.x >> 5) * rpw;
    const u32 n_groups = (total + per_block - 1) / per_block;
    {
        // First row group: start pulling this warp's weights into L2.
        for (u32 q = 0; q < rpw; ++q) {
            const u32 o = blockIdx.x * per_block + warp * rpw + q;
            if (o < total) {
                SegRow g = seg_row(b, p, o);
                if (DT >= 0) g.dt = (u32)DT;
                const u64 rb = streamed_row_bytes(g.dt, k);
                for (u64 off = (u64)lane * 128; off < rb; off += 32 * 128)
                    asm volatile("prefetch.global.L2 [%0];" ::"l"(g.row.w + off));
            }
        }
    }
    AKUNU_PROLOGUE(a);

    gemv_stage(b, p, ex, rows, xs, red);
    __syncthreads();

    // Blocks walk row groups blockIdx.x, + gridDim.x, ...; warp w computes
    // rows w * rpw .. w * rpw + rpw - 1 of each group.
    for (u32 rg = blockIdx.x; rg < n_groups; rg += gridDim.x) {
        const u32 o0 = rg * per_block + warp * rpw;
        if (o0 >= total) continue;
        WRow wr[RPW];
        SegRow g[RPW];
#pragma unroll
        for (u32 q = 0; q < RPW; ++q) {
            // A missing second row reads the first one again (discarded).
            g[q] = seg_row(b, p, o0 + (o0 + q < total ? q : 0));
            if (DT >= 0) g[q].dt = (u32)DT;
            wr[q] = g[q].row;
        }
        GemvAcc<MR> acc;
#pragma unroll
        for (u32 q = 0; q < GEMV_RPW; ++q)
#pragma unroll
            for (u32 r = 0; r < (u32)MR; ++r) acc[q][r] = 0.0f;
        // Rows of one warp share a type unless they straddle segments (the
        // launcher uses two-row kernels only for single-type products).
        gemv_rows<DT, RPW, MR>(g[0].dt, wr, xs, k, rows, lane, acc);
#pragma unroll
        for (u32 q = 0; q < RPW; ++q) {
            if (o0 + q >= total) continue;
#pragma unroll
            for (u32 r = 0; r < (u32)MR; ++r) {
                const float v = warp_sum(acc[q][r]);
                if (lane == 0 && r < rows) {
                    float* dst = (float*)b.p[1] + (u64)r * p.out_stride + o0 + q;
                    const float t = softcap_score(v + (g[q].bias ? *g[q].bias : 0.0f), p.softcap);
                    *dst = p.accumulate ? *dst + t : t;
                }
            }
        }
    }
}

// Blocks of 256 threads, at least 3 resident per SM (at most 85 registers).
#define GEMV_KERNEL(name, dt, rpw)                                                 \
    extern "C" __global__ void __launch_bounds__(256, 3)                           \
    name(Bind b, GemvParams p, StepArg a, GemvExtra ex) {               \
        gemv_body<dt, rpw, GEMV_MAX_ROWS>(b, p, a, ex);                            \
    }
// Speculative verification steps of 5..8 rows: the same body with
// GEMV_VERIFY_ROWS accumulators per output row (at least 2 blocks per SM, so
// the extra registers do not spill).
#define GEMV_KERNEL_V8(name, dt)                                                   \
    extern "C" __global__ void __launch_bounds__(256, 2)                           \
    name(Bind b, GemvParams p, StepArg a, GemvExtra ex) {               \
        gemv_body<dt, 1, GEMV_VERIFY_ROWS>(b, p, a, ex);                           \
    }
GEMV_KERNEL(k_gemv, -1, 1)
GEMV_KERNEL(k_gemv_f32, DT_F32, 1)
GEMV_KERNEL(k_gemv_f16, DT_F16, 1)
GEMV_KERNEL(k_gemv_bf16, DT_BF16, 1)
GEMV_KERNEL(k_gemv_q8_0, DT_Q8_0, 1)
GEMV_KERNEL(k_gemv_q4_0, DT_Q4_0, 1)
GEMV_KERNEL(k_gemv_q4_1, DT_Q4_1, 1)
GEMV_KERNEL(k_gemv_q5_0, DT_Q5_0, 1)
GEMV_KERNEL(k_gemv_q5_1, DT_Q5_1, 1)
GEMV_KERNEL(k_gemv_q4_k, DT_Q4_K, 1)
GEMV_KERNEL(k_gemv_q5_k, DT_Q5_K, 1)
GEMV_KERNEL(k_gemv_q6_k, DT_Q6_K, 1)
// Two output rows per warp, one input row (decode).
GEMV_KERNEL(k_gemv_f16_r2, DT_F16, 2)
GEMV_KERNEL(k_gemv_bf16_r2, DT_BF16, 2)
GEMV_KERNEL(k_gemv_q8_0_r2, DT_Q8_0, 2)
GEMV_KERNEL(k_gemv_q4_0_r2, DT_Q4_0, 2)
GEMV_KERNEL(k_gemv_q4_1_r2, DT_Q4_1, 2)
// Up to eight input rows (verification).
GEMV_KERNEL_V8(k_gemv_v8, -1)
GEMV_KERNEL_V8(k_gemv_f32_v8, DT_F32)
GEMV_KERNEL_V8(k_gemv_f16_v8, DT_F16)
GEMV_KERNEL_V8(k_gemv_bf16_v8, DT_BF16)
GEMV_KERNEL_V8(k_gemv_q8_0_v8, DT_Q8_0)
GEMV_KERNEL_V8(k_gemv_q4_0_v8, DT_Q4_0)
GEMV_KERNEL_V8(k_gemv_q4_1_v8, DT_Q4_1)

// ---------------------------------------------------------------------------
// GEMM (prefill: any number of input rows)
//
// grid = (ceil(total_rows / 64), ceil(rows / 64)), block 256, static shared
// memory 2 * 32 * 68 * 4 = 17 KB. Each step over k covers 32 columns (one
// quantized block): every thread dequantizes 8 weights of one output row
// and loads 8 activated inputs of one input row, both stored k-major in
// shared memory (row stride 68 keeps float4 alignment; a warp's stores hit
// 32 consecutive rows, so they are conflict-free). Then each thread
// accumulates a 4 (output rows) x 4 (input rows) tile with float4 reads.
// Output rows may straddle segments: each row resolves its own.
// ---------------------------------------------------------------------------

#define GM_TILE 64
#define GM_K 32
#define GM_LD 68

// The 8 weights [8*part, 8*part + 8) of the 32-column tile starting at k0
// of weight row `w` (zero beyond k for the plain types).
__device__ __forceinline__ void gemm_load_w(WRow w, u32 dt, u32 k, u32 k0, u32 part,
                                            float (&v)[8]) {
    if (dt == DT_Q8_0) {
        const u32 blk = k0 >> 5;
        const float d = f16_to_f32(ld_u16(w.sc + 2 * (u64)blk));
        const uint2 q = *(const uint2*)(w.w + (u64)blk * 32 + 8 * part);
#pragma unroll
        for (u32 i = 0; i < 4; ++i) {
            v[i] = d * (float)(i8)((q.x >> (8 * i)) & 0xff);
            v[4 + i] = d * (float)(i8)((q.y >> (8 * i)) & 0xff);
        }
    } else if (dt == DT_Q4_0 || dt == DT_Q4_1) {
        const bool q41 = dt == DT_Q4_1;
        const u32 blk = k0 >> 5;
        const u8* sc = w.sc + (u64)blk * (q41 ? 4 : 2);
        const float d = f16_to_f32(ld_u16(sc));
        const float m = q41 ? f16_to_f32(ld_u16(sc + 2)) : 0.0f;
        const float sub = q41 ? 0.0f : 8.0f;
        // Elements 0..15 are the low nibbles of bytes 0..15, 16..31 the high.
        const uint2 q = *(const uint2*)(w.w + (u64)blk * 16 + 8 * (part & 1));
        const u32 shift = (part >> 1) * 4;
#pragma unroll
        for (u32 i = 0; i < 4; ++i) {
            v[i] = d * ((float)((q.x >> (8 * i + shift)) & 15) - sub) + m;
            v[4 + i] = d * ((float)((q.y >> (8 * i + shift)) & 15) - sub) + m;
        }
    } else if (is_q5_or_k(dt)) {
        load_run_q5k<8>(dt, w.w, k0 + 8 * part, v);
    } else {
#pragma unroll
        for (u32 i = 0; i < 8; ++i) {
            const u32 e = k0 + 8 * part + i;
            float f = 0.0f;
            if (e < k) {
                if (dt == DT_F32) f = ((const float*)w.w)[e];
                else f = half_to_f32(ld_u16(w.w + 2 * (u64)e), dt == DT_BF16);
            }
            v[i] = f;
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
k_gemm(Bind b, GemvParams p, StepArg a) {
    AKUNU_PROLOGUE(a);
    __shared__ __align__(16) float ws[GM_K][GM_LD];
    __shared__ __align__(16) float xt[GM_K][GM_LD];
    const u32 tid = threadIdx.x, k = p.k, rows = a.rows;
    const u32 total = gemv_total_rows(p);
    const u32 o0 = blockIdx.x * GM_TILE, r0 = blockIdx.y * GM_TILE;

    // Loader role: tile row `lr`, columns [8*part, 8*part + 8) of each step.
    const u32 lr = tid & 63, part = tid >> 6;
    const bool have_w = o0 + lr < total;
    SegRow g;
    g.row.w = nullptr;
    g.row.sc = nullptr;
    g.dt = DT_F32;
    if (have_w) g = seg_row(b, p, o0 + lr);
    const bool have_x = r0 + lr < rows;
    const float* __restrict__ xr = (const float*)b.p[0] + (u64)(r0 + lr) * p.x_stride;

    // Compute role: output rows 4*tx..4*tx+3, input rows 4*ty..4*ty+3.
    const u32 tx = tid & 15, ty = tid >> 4;
    float c[4][4];
#pragma unroll
    for (u32 i = 0; i < 4; ++i)
#pragma unroll
        for (u32 j = 0; j < 4; ++j) c[i][j] = 0.0f;

    for (u32 k0 = 0; k0 < k; k0 += GM_K) {
        float wv[8], xv[8];
        if (have_w) {
            gemm_load_w(g.row, g.dt, k, k0, part, wv);
        } else {
#pragma unroll
            for (u32 i = 0; i < 8; ++i) wv[i] = 0.0f;
        }
#pragma unroll
        for (u32 i = 0; i < 8; ++i) {
            const u32 e = k0 + 8 * part + i;
            xv[i] = (have_x && e < k) ? gemv_input(xr, e, k, p.input_act) : 0.0f;
        }
        __syncthreads();  // the previous step's reads are done
#pragma unroll
        for (u32 i = 0; i < 8; ++i) {
            ws[8 * part + i][lr] = wv[i];
            xt[8 * part + i][lr] = xv[i];
        }
        __syncthreads();
#pragma unroll 8
        for (u32 kk = 0; kk < GM_K; ++kk) {
            const float4 wa = *(const float4*)&ws[kk][4 * tx];
            const float4 xb = *(const float4*)&xt[kk][4 * ty];
            const float wr[4] = {wa.x, wa.y, wa.z, wa.w};
            const float xc[4] = {xb.x, xb.y, xb.z, xb.w};
#pragma unroll
            for (u32 i = 0; i < 4; ++i)
#pragma unroll
                for (u32 j = 0; j < 4; ++j) c[i][j] += wr[i] * xc[j];
        }
    }

    float* __restrict__ out = (float*)b.p[1];
#pragma unroll
    for (u32 i = 0; i < 4; ++i) {
        const u32 o = o0 + 4 * tx + i;
        if (o >= total) continue;
        float bias = 0.0f;
        if (p.bias) bias = *seg_row(b, p, o).bias;
#pragma unroll
        for (u32 j = 0; j < 4; ++j) {
            const u32 r = r0 + 4 * ty + j;
            if (r < rows) {
                float* dst = out + (u64)r * p.out_stride + o;
                const float v = softcap_score(c[i][j] + bias, p.softcap);
                *dst = p.accumulate ? *dst + v : v;
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Tensor-core GEMM (prefill) for F16, Q8_0, Q4_0 and Q4_1 weights.
//
// grid = (ceil(total_rows / 64), ceil(rows / 64)), block 128 = 4 warps in a
// 2 x 2 arrangement, each computing 32 output rows x 32 input rows with
// mma.sync m16n8k16 (f16 in, f32 accumulate). The k loop steps one 32-wide
// block at a time. Exactness comes from what goes into the f16 operands:
//  - weights as their integers (Q4_0: q - 8, Q4_1: q, Q8_0: q; all exact in
//    f16), or F16 values as they are; the block's scale d (and Q4_1's min m)
//    is applied in f32 to the block's partial product:
//    acc += d * sum(q x) + m * sum(x);
//  - inputs split as x = hi + lo with hi = f16(x), lo = f16(x - hi), two
//    products per step, so x keeps about 22 bits.
// The result matches the f32 product to within f32 accumulation error
// (the GPU tests compare prefill logits with the CPU's at rel-L2 1e-4).
// ---------------------------------------------------------------------------

#define TC_M 64
#define TC_N 64
#define TC_LD 40  // halves per smem row: 32 + 8 of padding (conflict-free fragments)

// pack_h2 and mma_f16: tc.cuh.

__device__ __forceinline__ bool tc_type(u32 dt) {
    return dt == DT_F16 || dt == DT_Q8_0 || dt == DT_Q4_0 || dt == DT_Q4_1;
}

extern "C" __global__ void __launch_bounds__(128)
k_gemm_tc(Bind b, GemvParams p, StepArg a) {
    AKUNU_PROLOGUE(a);
    __shared__ __align__(16) u16 ws[TC_M * TC_LD];
    __shared__ __align__(16) u16 xh[TC_N * TC_LD];
    __shared__ __align__(16) u16 xl[TC_N * TC_LD];
    __shared__ float wd[TC_M], wmin[TC_M], xsum[TC_N];
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 k = p.k, rows = a.rows, total = gemv_total_rows(p);
    const u32 o0 = blockIdx.x * TC_M, r0 = blockIdx.y * TC_N;

    // Loader role: weight row / input row `lr`, half `lh` of each block.
    const u32 lr = tid >> 1, lh = tid & 1;
    const bool have_w = o0 + lr < total;
    SegRow g;
    g.row.w = nullptr;
    g.row.sc = nullptr;
    g.dt = DT_F16;
    g.bias = nullptr;
    if (have_w) g = seg_row(b, p, o0 + lr);
    const bool have_x = r0 + lr < rows;
    const float* __restrict__ xr = (const float*)b.p[0] + (u64)(r0 + lr) * p.x_stride;

    // Compute role.
    const u32 wm = warp & 1, wn = warp >> 1, gq = lane >> 2, tq = (lane & 3) * 2;
    float acc[2][4][4];
#pragma unroll
    for (u32 i = 0; i < 2; ++i)
#pragma unroll
        for (u32 j = 0; j < 4; ++j)
#pragma unroll
            for (u32 e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

    for (u32 k0 = 0; k0 < k; k0 += 32) {
        const u32 blk = k0 >> 5;
        // Weights: 16 integers (or F16 values) of row lr, its scale and min.
        u32 wq[8];
        float d = 0.0f, m = 0.0f;
        if (have_w) {
            if (g.dt == DT_F16) {
                const uint4* src = (const uint4*)(g.row.w + 2 * (u64)(k0 + 16 * lh));
                const uint4 v0 = src[0], v1 = src[1];
                wq[0] = v0.x; wq[1] = v0.y; wq[2] = v0.z; wq[3] = v0.w;
                wq[4] = v1.x; wq[5] = v1.y; wq[6] = v1.z; wq[7] = v1.w;
                d = 1.0f;
            } else if (g.dt == DT_Q8_0) {
                const uint4 v = *(const uint4*)(g.row.w + (u64)blk * 32 + 16 * lh);
                const u32 wv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (u32 i = 0; i < 4; ++i) {
                    wq[2 * i] = pack_h2((float)(i8)(wv[i] & 0xff), (float)(i8)((wv[i] >> 8) & 0xff));
                    wq[2 * i + 1] = pack_h2((float)(i8)((wv[i] >> 16) & 0xff), (float)(i8)(wv[i] >> 24));
                }
                d = f16_to_f32(ld_u16(g.row.sc + 2 * (u64)blk));
            } else {  // Q4_0, Q4_1: half 0 = low nibbles (elements 0..15), half 1 = high
                const bool q41 = g.dt == DT_Q4_1;
                const uint4 v = *(const uint4*)(g.row.w + (u64)blk * 16);
                const u32 wv[4] = {v.x, v.y, v.z, v.w};
                const u32 sh = 4 * lh;
                const float sub = q41 ? 0.0f : 8.0f;
#pragma unroll
                for (u32 i = 0; i < 4; ++i) {
                    wq[2 * i] = pack_h2((float)((wv[i] >> sh) & 15) - sub,
                                        (float)((wv[i] >> (8 + sh)) & 15) - sub);
                    wq[2 * i + 1] = pack_h2((float)((wv[i] >> (16 + sh)) & 15) - sub,
                                            (float)((wv[i] >> (24 + sh)) & 15) - sub);
                }
                const u8* sc = g.row.sc + (u64)blk * (q41 ? 4 : 2);
                d = f16_to_f32(ld_u16(sc));
                m = q41 ? f16_to_f32(ld_u16(sc + 2)) : 0.0f;
            }
        } else {
#pragma unroll
            for (u32 i = 0; i < 8; ++i) wq[i] = 0;
        }
        // Inputs: 16 floats of row lr (activation applied), split hi + lo.
        float xv[16];
#pragma unroll
        for (u32 i = 0; i < 16; ++i) {
            const u32 e = k0 + 16 * lh + i;
            xv[i] = have_x ? gemv_input(xr, e, k, p.input_act) : 0.0f;
        }
        u32 hi[8], lo[8];
        float sx = 0.0f;
#pragma unroll
        for (u32 i = 0; i < 8; ++i) {
            const float h0 = f16_round(xv[2 * i]), h1 = f16_round(xv[2 * i + 1]);
            hi[i] = pack_h2(h0, h1);
            lo[i] = pack_h2(xv[2 * i] - h0, xv[2 * i + 1] - h1);
            sx += xv[2 * i] + xv[2 * i + 1];
        }
        sx += __shfl_xor_sync(FULL_MASK, sx, 1);  // the row's other half

        __syncthreads();  // the previous block's fragments were read
        {
            uint4* wdst = (uint4*)(ws + lr * TC_LD + 16 * lh);
            wdst[0] = make_uint4(wq[0], wq[1], wq[2], wq[3]);
            wdst[1] = make_uint4(wq[4], wq[5], wq[6], wq[7]);
            uint4* hdst = (uint4*)(xh + lr * TC_LD + 16 * lh);
            hdst[0] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
            hdst[1] = make_uint4(hi[4], hi[5], hi[6], hi[7]);
            uint4* ldst = (uint4*)(xl + lr * TC_LD + 16 * lh);
            ldst[0] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
            ldst[1] = make_uint4(lo[4], lo[5], lo[6], lo[7]);
            if (lh == 0) {
                wd[lr] = d;
                wmin[lr] = m;
                xsum[lr] = sx;
            }
        }
        __syncthreads();

        float part[2][4][4];
#pragma unroll
        for (u32 i = 0; i < 2; ++i)
#pragma unroll
            for (u32 j = 0; j < 4; ++j)
#pragma unroll
                for (u32 e = 0; e < 4; ++e) part[i][j][e] = 0.0f;
#pragma unroll
        for (u32 kk = 0; kk < 32; kk += 16) {
            u32 af[2][4];
#pragma unroll
            for (u32 i = 0; i < 2; ++i) {
                const u16* w0 = ws + (wm * 32 + i * 16 + gq) * TC_LD + kk + tq;
                af[i][0] = *(const u32*)w0;
                af[i][1] = *(const u32*)(w0 + 8 * TC_LD);
                af[i][2] = *(const u32*)(w0 + 8);
                af[i][3] = *(const u32*)(w0 + 8 * TC_LD + 8);
            }
#pragma unroll
            for (u32 j = 0; j < 4; ++j) {
                const u32 off = (wn * 32 + j * 8 + gq) * TC_LD + kk + tq;
                const u32 bh0 = *(const u32*)(xh + off), bh1 = *(const u32*)(xh + off + 8);
                const u32 bl0 = *(const u32*)(xl + off), bl1 = *(const u32*)(xl + off + 8);
#pragma unroll
                for (u32 i = 0; i < 2; ++i) {
                    mma_f16(part[i][j], af[i], bh0, bh1);
                    mma_f16(part[i][j], af[i], bl0, bl1);
                }
            }
        }
        // acc += d_row * part + m_row * xsum_col.
#pragma unroll
        for (u32 i = 0; i < 2; ++i) {
            const u32 ra = wm * 32 + i * 16 + gq, rb = ra + 8;
            const float da = wd[ra], db = wd[rb], ma = wmin[ra], mb = wmin[rb];
#pragma unroll
            for (u32 j = 0; j < 4; ++j) {
                const u32 c = wn * 32 + j * 8 + tq;
                const float s0 = xsum[c], s1 = xsum[c + 1];
                acc[i][j][0] += da * part[i][j][0] + ma * s0;
                acc[i][j][1] += da * part[i][j][1] + ma * s1;
                acc[i][j][2] += db * part[i][j][2] + mb * s0;
                acc[i][j][3] += db * part[i][j][3] + mb * s1;
            }
        }
    }

    float* __restrict__ out = (float*)b.p[1];
#pragma unroll
    for (u32 i = 0; i < 2; ++i) {
#pragma unroll
        for (u32 half = 0; half < 2; ++half) {
            const u32 o = o0 + wm * 32 + i * 16 + gq + 8 * half;
            if (o >= total) continue;
            const float bias = p.bias ? *seg_row(b, p, o).bias : 0.0f;
#pragma unroll
            for (u32 j = 0; j < 4; ++j) {
#pragma unroll
                for (u32 e = 0; e < 2; ++e) {
                    const u32 r = r0 + wn * 32 + j * 8 + tq + e;
                    if (r < rows) {
                        float* dst = out + (u64)r * p.out_stride + o;
                        const float v = softcap_score(acc[i][j][2 * half + e] + bias, p.softcap);
                        *dst = p.accumulate ? *dst + v : v;
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Operands of the cuBLAS prefill products (blas.rs runs the products).
//
// cuBLAS multiplies f16 matrices with f32 accumulation. Exactness comes from
// splitting every value that is not exact in f16 into hi + lo halves, as in
// k_gemm_tc:
//  - inputs: x = hi + lo, hi = f16(x), lo = f16(x - hi), stored per input
//    row r as [lo (k halves) | hi (k halves)] at xs + r * 2k;
//  - F16 weights are used in place; Q8_0/Q4_0/Q4_1 weights w = d * q (+ m)
//    are exact in f32 but not in f16, so each command dequantizes them into
//    a scratch as [hi (k halves) | lo (k halves)] per weight row, a chunk of
//    rows at a time.
// The products (blas.rs) are then W_hi.X_hi (F16: W.X_hi) and, as one
// product of depth 2k, [W_hi | W_lo].[X_lo ; X_hi] = W_hi.X_lo + W_lo.X_hi
// (F16: W.X_lo), accumulated into the output in f32. Only W_lo.X_lo (about
// 2^-22 of the product) is left out.
//
// Both kernels take (Bind, GemvParams, StepArg, u16* scratch, u32 o0,
// u32 o1): the command's own arguments plus where their f16 operand goes.
// ---------------------------------------------------------------------------

// Four elements [j, j + 4) of the product's input row `xr` (the activation
// applied), with one 16-byte load per operand where `vec`.
__device__ __forceinline__ void gemm_input4(const float* __restrict__ xr, u32 j, u32 k, u32 act,
                                            bool vec, float (&v)[4]) {
    if (vec) {
        const float4 t = *(const float4*)(xr + j);
        v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w;
        if (act != ACT_NONE) {
            const float4 u = *(const float4*)(xr + k + j);
            const float up[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (u32 i = 0; i < 4; ++i)
                v[i] = gated(v[i], up[i], act);
        }
    } else {
#pragma unroll
        for (u32 i = 0; i < 4; ++i) v[i] = gemv_input(xr, j + i, k, act);
    }
}

// Splits the step's input rows into f16 halves (`xs`, layout above) and,
// for a product with a bias, seeds the output rows with it (added to them
// when the product accumulates) so that every cuBLAS product adds into the
// output (beta = 1). grid = (ceil(max(k, bias ? total : 0) / 1024), rows),
// block 256: four elements per thread. o0 and o1 are unused.
extern "C" __global__ void __launch_bounds__(256)
k_gemm_split(Bind b, GemvParams p, StepArg a, u16* __restrict__ xs, u32 o0, u32 o1) {
    AKUNU_PROLOGUE(a);
    const u32 r = blockIdx.y, k = p.k;
    if (r >= a.rows) return;
    const u32 j = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    const float* __restrict__ xr = (const float*)b.p[0] + (u64)r * p.x_stride;
    if (j < k) {  // k is a multiple of 32: a group of 4 is whole
        const bool vec = (p.x_stride & 3) == 0 && ((u64)b.p[0] & 15) == 0;
        float v[4];
        gemm_input4(xr, j, k, p.input_act, vec, v);
        const float h0 = f16_round(v[0]), h1 = f16_round(v[1]);
        const float h2 = f16_round(v[2]), h3 = f16_round(v[3]);
        u16* dst = xs + (u64)r * 2 * k + j;
        *(uint2*)dst = make_uint2(pack_h2(v[0] - h0, v[1] - h1), pack_h2(v[2] - h2, v[3] - h3));
        *(uint2*)(dst + k) = make_uint2(pack_h2(h0, h1), pack_h2(h2, h3));
    }
    if (p.bias) {
        const u32 total = gemv_total_rows(p);
        float* __restrict__ out = (float*)b.p[1] + (u64)r * p.out_stride;
#pragma unroll
        for (u32 i = 0; i < 4; ++i) {
            const u32 o = j + i;
            if (o < total) {
                const float bias = *seg_row(b, p, o).bias;
                out[o] = p.accumulate ? out[o] + bias : bias;
            }
        }
    }
}

// Dequantizes weight rows [o0, o1) of the product (global row numbers: the
// rows may span segments, each resolved by seg_row) into `ws`, row o at
// ws + (o - o0) * 2k as [hi | lo]. The values are the CPU's: Q8_0 d * q,
// Q4_0 d * (q - 8), Q4_1 d * q + m, each rounded once to f32 (d * q is exact
// there). grid = ceil((o1 - o0) * k / 8 / 256), block 256: each thread takes
// a quarter block (8 elements), so a warp writes 8 blocks' hi as 512
// contiguous bytes, 16 per lane, and their lo likewise. (A whole block per
// thread, four 16-byte stores at a 64-byte lane stride, ran at 1.7 TB/s and
// took 36% of an 8B Q4_0 prefill: Nsight Compute, bench/RESULTS.md.)
// k_gemm_dequant_hi writes the hi halves alone: the f16 prefill products
// (blas.rs `Products::F16`) use W rounded to f16 and nothing else.
template <bool LO>
__device__ __forceinline__ void gemm_dequant_body(const Bind& b, const GemvParams& p, u16* __restrict__ ws,
                                                  u32 o0, u32 o1) {
    // 32-bit unit arithmetic: a chunk has fewer than 2^32 units (blas.rs
    // chunk_rows: at most 2^26 weights), and a 64-bit division by nb costs
    // a long software sequence a thread.
    const u32 k = p.k, nb = k >> 5;
    const u32 unit = blockIdx.x * blockDim.x + threadIdx.x;
    if (unit >= (o1 - o0) * nb * 4) return;
    const u32 bu = unit >> 2;
    const u32 part = unit & 3;  // elements 8 part .. 8 part + 7
    const u32 o = o0 + bu / nb, blk = bu % nb;
    const SegRow g = seg_row(b, p, o);
    float v[8];
    if (g.dt == DT_Q8_0) {
        const uint2 q = *(const uint2*)(g.row.w + (u64)blk * 32 + part * 8);
        const u32 wv[2] = {q.x, q.y};
        const float d = f16_to_f32(ld_u16(g.row.sc + 2 * (u64)blk));
#pragma unroll
        for (u32 i = 0; i < 8; ++i) v[i] = d * (float)(i8)((wv[i >> 2] >> (8 * (i & 3))) & 0xff);
    } else if (g.dt == DT_Q4_0 || g.dt == DT_Q4_1) {
        // Elements 0..15 are the low nibbles of bytes 0..15, 16..31 the
        // high: part p reads bytes 8 (p & 1) .. + 7, high nibbles for p >= 2.
        const bool q41 = g.dt == DT_Q4_1;
        const uint2 q = *(const uint2*)(g.row.w + (u64)blk * 16 + (part & 1) * 8);
        const u32 wv[2] = {q.x, q.y};
        const u32 shift = part >= 2 ? 4 : 0;
        const u8* sc = g.row.sc + (u64)blk * (q41 ? 4 : 2);
        const float d = f16_to_f32(ld_u16(sc));
        const float m = q41 ? f16_to_f32(ld_u16(sc + 2)) : 0.0f;
#pragma unroll
        for (u32 i = 0; i < 8; ++i) {
            const u32 nib = (wv[i >> 2] >> (8 * (i & 3) + shift)) & 15;
            v[i] = q41 ? d * (float)nib + m : d * (float)((int)nib - 8);
        }
    } else {  // F16 (the launcher keeps F16 weights in place; for completeness)
#pragma unroll
        for (u32 i = 0; i < 8; ++i)
            v[i] = f16_to_f32(ld_u16(g.row.w + 2 * (u64)(blk * 32 + part * 8 + i)));
    }
    u32 hi[4], lo[4];
#pragma unroll
    for (u32 i = 0; i < 4; ++i) {
        const float h0 = f16_round(v[2 * i]), h1 = f16_round(v[2 * i + 1]);
        hi[i] = pack_h2(h0, h1);
        lo[i] = pack_h2(v[2 * i] - h0, v[2 * i + 1] - h1);
    }
    u16* row = ws + (u64)(o - o0) * 2 * k + (u64)blk * 32 + part * 8;
    *(uint4*)row = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    if (LO) *(uint4*)(row + k) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
}

extern "C" __global__ void __launch_bounds__(256)
k_gemm_dequant(Bind b, GemvParams p, StepArg a, u16* __restrict__ ws, u32 o0, u32 o1) {
    AKUNU_PROLOGUE(a);
    gemm_dequant_body<true>(b, p, ws, o0, o1);
}

extern "C" __global__ void __launch_bounds__(256)
k_gemm_dequant_hi(Bind b, GemvParams p, StepArg a, u16* __restrict__ ws, u32 o0, u32 o1) {
    AKUNU_PROLOGUE(a);
    gemm_dequant_body<false>(b, p, ws, o0, o1);
}

// ---------------------------------------------------------------------------
// RoPE + KV-cache write
//
// grid = (rows, G), block 64. Block (r, g) rotates heads g * H .. g * H + H - 1
// (H = ceil((n_heads + n_kv_heads) / G)) of QKV row r in place (Q heads then
// K heads, which are contiguous in the row); for a K head it also writes the
// rotated K head and the matching V head into the caches at position pos + r.
// The angles depend on the row alone, so a block computes its pairs' angles
// once for its H heads: decode launches one head a block (G = all heads,
// the most blocks for one row), prefill several (launch.rs), which saves the
// f64 angle work the heads would repeat. Each thread writes the pairs it
// rotated itself, so no barrier is needed. The angle is computed in f64 as
// the CPU does; sincospi avoids the slow-path argument reduction of sin/cos.
// ---------------------------------------------------------------------------
// Indices of pair i: adjacent (GGUF Llama) or split halves (NeoX).
__device__ __forceinline__ void rope_pair(u32 i, u32 half, bool neox, u32& ia, u32& ib) {
    ia = neox ? i : 2 * i;
    ib = neox ? i + half : 2 * i + 1;
}

// Most heads a block takes on the batched path (launch.rs
// ROPE_HEADS_PER_BLOCK).
#define ROPE_BATCH 8
#ifndef ROPE_PRE  // (AKUNU_CUDA_DEFINES=-DROPE_PRE=0: angles after the wait, for A/B runs)
#define ROPE_PRE 1
#endif
extern "C" __global__ void __launch_bounds__(64)
k_rope_kv_write(Bind b, RopeParams p, StepArg a) {
    // The angles depend on the position alone (inside a chunk graph only
    // k_chain_advance, after the chunk, moves it), so they are computed
    // before the wait on the previous kernel, as in k_attn_decode: pairs
    // threadIdx.x + q * blockDim.x, q < 2, which covers head_dim <= 256.
    Step st = step_of(a);
    const u32 pos = (a.patch == PATCH_POSITION ? st.pos : p.pos) + blockIdx.x;
    const u32 hd = p.head_dim, half = p.rope_dim >> 1;
    const float* __restrict__ ff = p.freq_factors ? (const float*)b.p[3] : nullptr;
    float pre_c[2] = {0.0f, 0.0f}, pre_s[2] = {0.0f, 0.0f};
#pragma unroll
    for (u32 q = 0; q < 2; ++q) {
        const u32 i = threadIdx.x + q * blockDim.x;
        if (ROPE_PRE && i < half)
            rope_cs(pos, i, p.rope_dim, p.theta, p.freq_scale, ff, pre_c[q], pre_s[q]);
    }
    AKUNU_PROLOGUE(a);
    float* __restrict__ row = (float*)b.p[0] + (u64)blockIdx.x * p.qkv_stride;
    const bool neox = p.style == ROPE_NEOX;
    const u32 heads = p.n_heads + p.n_kv_heads;
    const u32 per = (heads + gridDim.y - 1) / gridDim.y;
    const u32 y0 = blockIdx.y * per, y_end = min(heads, y0 + per);
    if (!p.qk_norm && half <= blockDim.x && p.rope_dim == hd && hd <= 2 * blockDim.x && per <= ROPE_BATCH) {
        // Prefill's usual case, a pair and two V elements a thread per head:
        // every head's loads go out before the first store (the stores
        // could alias them for all the compiler knows, which kept each
        // head's loads waiting for the last head's stores).
        const u32 i = threadIdx.x;
        const bool has = i < half;
        u32 ia = 0, ib = 0;
        rope_pair(i, half, neox, ia, ib);
        float c = pre_c[0], s = pre_s[0];
        if (!ROPE_PRE && has) rope_cs(pos, i, p.rope_dim, p.theta, p.freq_scale, ff, c, s);
        float xa[ROPE_BATCH], xb[ROPE_BATCH], v0[ROPE_BATCH], v1[ROPE_BATCH];
#pragma unroll
        for (u32 h = 0; h < ROPE_BATCH; ++h) {
            const u32 y = y0 + h;
            xa[h] = xb[h] = v0[h] = v1[h] = 0.0f;
            if (y >= y_end) continue;
            if (has) {
                xa[h] = row[(u64)y * hd + ia];
                xb[h] = row[(u64)y * hd + ib];
            }
            if (y >= p.n_heads) {
                const float* __restrict__ v = row + (u64)(heads + y - p.n_heads) * hd;
                if (i < hd) v0[h] = v[i];
                if (i + blockDim.x < hd) v1[h] = v[i + blockDim.x];
            }
        }
#pragma unroll
        for (u32 h = 0; h < ROPE_BATCH; ++h) {
            const u32 y = y0 + h;
            if (y >= y_end) continue;
            float* __restrict__ x = row + (u64)y * hd;
            float r0 = 0.0f, r1 = 0.0f;
            if (has) {
                rope_rotate(xa[h], xb[h], c, s, r0, r1);
                x[ia] = r0;
                x[ib] = r1;
            }
            if (y >= p.n_heads) {
                const u32 j = y - p.n_heads;
                kv_t* __restrict__ kdst = (kv_t*)b.p[1] + ((u64)j * p.capacity + pos) * hd;
                kv_t* __restrict__ vdst = (kv_t*)b.p[2] + ((u64)j * p.capacity + pos) * hd;
                if (has) {
                    kdst[ia] = kv_from(r0);
                    kdst[ib] = kv_from(r1);
                }
                if (i < hd) vdst[i] = kv_from(v0[h]);
                if (i + blockDim.x < hd) vdst[i + blockDim.x] = kv_from(v1[h]);
            }
        }
        return;
    }
    for (u32 y = y0; y < y_end; ++y) {
        float* __restrict__ x = row + (u64)y * hd;
        const bool is_k = y >= p.n_heads;
        const u32 j = is_k ? y - p.n_heads : 0;  // kv head (K heads only)
        kv_t* __restrict__ kdst = (kv_t*)b.p[1] + ((u64)j * p.capacity + pos) * hd;

        if (p.qk_norm) {
            // Per-head RMSNorm (Qwen3, Gemma 3) before the rotation: the
            // Q-norm and K-norm weights follow the optional frequency
            // factors.
            __shared__ float red[32];
            const float* __restrict__ nw =
                (const float*)bind_at(b, 3 + (p.freq_factors ? 1u : 0u) + (is_k ? 1u : 0u));
            float ss = 0.0f;
            for (u32 d = threadIdx.x; d < hd; d += blockDim.x) ss += x[d] * x[d];
            // block_sum's barriers also order every read above before the
            // writes below (and the previous head's use of `red`).
            const float sc = rms_inv(block_sum(ss, red), hd, p.norm_eps);
            for (u32 d = threadIdx.x; d < hd; d += blockDim.x) x[d] = x[d] * sc * nw[d];
            __syncthreads();
        }

        auto rotate = [&](u32 i, float c, float s) {
            u32 ia, ib;
            rope_pair(i, half, neox, ia, ib);
            float y0, y1;
            rope_rotate(x[ia], x[ib], c, s, y0, y1);
            x[ia] = y0;
            x[ib] = y1;
            if (is_k) {
                kdst[ia] = kv_from(y0);
                kdst[ib] = kv_from(y1);
            }
        };
        // Pairs threadIdx.x + q * blockDim.x: q < 2 unrolled (the angles
        // stay in registers across heads), any further ones computed here.
#pragma unroll
        for (u32 q = 0; q < 2; ++q) {
            const u32 i = threadIdx.x + q * blockDim.x;
            if (i >= half) continue;
            float c = pre_c[q], s = pre_s[q];
            if (!ROPE_PRE) rope_cs(pos, i, p.rope_dim, p.theta, p.freq_scale, ff, c, s);
            rotate(i, c, s);
        }
        for (u32 i = threadIdx.x + 2 * blockDim.x; i < half; i += blockDim.x) {
            float c, s;
            rope_cs(pos, i, p.rope_dim, p.theta, p.freq_scale, ff, c, s);
            rotate(i, c, s);
        }
        if (is_k) {
            for (u32 d = p.rope_dim + threadIdx.x; d < hd; d += blockDim.x) kdst[d] = kv_from(x[d]);
            const float* __restrict__ v = row + (u64)(p.n_heads + p.n_kv_heads + j) * hd;
            kv_t* __restrict__ vdst = (kv_t*)b.p[2] + ((u64)j * p.capacity + pos) * hd;
            for (u32 d = threadIdx.x; d < hd; d += blockDim.x) vdst[d] = kv_from(v[d]);
        }
    }
}

// ---------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------

// Valid cache entries after this step (the patched kv_len).
__device__ __forceinline__ u32 attn_kv_len(const AttnParams& p, const StepArg& a) {
    if (a.patch == PATCH_KV_SEQ_LEN || a.patch == PATCH_POS_AND_KV) {
        Step st = step_of(a);
        return st.pos + st.rows;
    }
    return p.kv_len;
}

// First key a query at position `pos` may see.
__device__ __forceinline__ int attn_first_key(int pos, u32 window) {
    return (window > 0 && pos + 1 > (int)window) ? pos + 1 - (int)window : 0;
}

#define DEC_WARPS 4
#define DEC_KEYS 4  // keys per warp per step
#ifndef DEC_MIN_KEYS  // (AKUNU_CUDA_DEFINES may set it for experiments)
#define DEC_MIN_KEYS 16  // fewest keys a split takes while others idle
#endif

// Keys per decode split: kv_len spread over the splits, but at least
// DEC_MIN_KEYS, so that a short context uses few splits (fewer partials to
// merge) rather than many near-empty ones.
__device__ __forceinline__ u32 attn_chunk(u32 kv, u32 n_split) {
    const u32 c = (kv + n_split - 1) / n_split;
    return c > DEC_MIN_KEYS ? c : DEC_MIN_KEYS;
}

// Dim of a lane's element i in decode attention: lanes over dims (f32
// cache), or over pairs of dims (f16: one 4-byte load gives both).
__device__ __forceinline__ u32 dec_dim(u32 lane, int i) {
    return KV_F16 ? 2 * (lane + 32 * (u32)(i >> 1)) + (u32)(i & 1) : lane + 32 * (u32)i;
}

// Decode split: each warp runs its own online softmax over keys taken
// DEC_KEYS at a time (lanes over head dims, NI dims per lane as dec_dim maps them; the DEC_KEYS
// dot products are reduced together for ILP); the 4 warps are merged
// through shared memory and the split's (m, l, acc) written to `part`.
template <int NI>
__device__ __forceinline__ void attn_decode_body(const Bind& b, const AttnParams& p, u32 kv,
                                                 const float* q_rot, float* __restrict__ part,
                                                 u32 n_split, float* sm_m, float* sm_l,
                                                 float* sm_acc) {
    const u32 h = blockIdx.x, sp = blockIdx.y, hd = p.head_dim;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 g = h / (p.n_heads / p.n_kv_heads);
    const int pos = (int)kv - 1;
    const int chunk = (int)attn_chunk(kv, n_split);
    int j0 = (int)sp * chunk;
    const int j1 = min(j0 + chunk, (int)kv);
    j0 = max(j0, attn_first_key(pos, p.window));

    // The query: the head's row of QKV, or its rotation staged by the
    // fused RoPE (`attn_rope_prep`).
    const float* qp = q_rot ? q_rot : (const float*)b.p[0] + (u64)h * hd;
    const kv_t* __restrict__ K = (const kv_t*)b.p[1] + (u64)g * p.capacity * hd;
    const kv_t* __restrict__ V = (const kv_t*)b.p[2] + (u64)g * p.capacity * hd;
    float q[NI], acc[NI];
#pragma unroll
    for (int i = 0; i < NI; ++i) {
        const u32 d = dec_dim(lane, i);
        q[i] = d < hd ? qp[d] : 0.0f;
        acc[i] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;

    for (int base = j0 + (int)warp * DEC_KEYS; base < j1; base += DEC_WARPS * DEC_KEYS) {
        // Every K and V element of the step is loaded before any is used:
        // one memory round trip per step instead of two (V's addresses do
        // not depend on the scores).
        float kk[DEC_KEYS][NI], vv[DEC_KEYS][NI];
#pragma unroll
        for (int t = 0; t < DEC_KEYS; ++t) {
            const int j = base + t;
#if KV_F16
            // A lane's pair of dims by one 4-byte load (head_dim is even).
#pragma unroll
            for (int i = 0; i < NI; i += 2) {
                const u32 d = dec_dim(lane, i);
                const bool in = j < j1 && d < hd;
                const u32 kw = in ? *(const u32*)(K + (u64)j * hd + d) : 0u;
                const u32 vw = in ? *(const u32*)(V + (u64)j * hd + d) : 0u;
                const float2 kf = f16x2_to_f32(kw), vf = f16x2_to_f32(vw);
                kk[t][i] = kf.x;
                kk[t][i + 1] = kf.y;
                vv[t][i] = vf.x;
                vv[t][i + 1] = vf.y;
            }
#else
#pragma unroll
            for (int i = 0; i < NI; ++i) {
                const u32 d = dec_dim(lane, i);
                const bool in = j < j1 && d < hd;
                kk[t][i] = in ? ld_f32(K, (u64)j * hd + d) : 0.0f;
                vv[t][i] = in ? ld_f32(V, (u64)j * hd + d) : 0.0f;
            }
#endif
        }
        float sc[DEC_KEYS];
#pragma unroll
        for (int t = 0; t < DEC_KEYS; ++t) {
            const int j = base + t;
            float s = 0.0f;
            if (j < j1) {
#pragma unroll
                for (int i = 0; i < NI; ++i) {
                    const u32 d = dec_dim(lane, i);
                    if (d < hd) s += q[i] * kk[t][i];
                }
            }
            sc[t] = s;
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1)
#pragma unroll
            for (int t = 0; t < DEC_KEYS; ++t) sc[t] += __shfl_xor_sync(FULL_MASK, sc[t], off);
        float mt = NEG_INF;
#pragma unroll
        for (int t = 0; t < DEC_KEYS; ++t) {
            sc[t] = base + t < j1 ? softcap_score(sc[t] * p.scale, p.softcap) : NEG_INF;
            mt = fmaxf(mt, sc[t]);
        }
        // Key `base` is always valid, so mn is finite.
        const float mn = fmaxf(m, mt);
        const float corr = expf(m - mn);
        l *= corr;
#pragma unroll
        for (int i = 0; i < NI; ++i) acc[i] *= corr;
#pragma unroll
        for (int t = 0; t < DEC_KEYS; ++t) {
            const int j = base + t;
            if (j < j1) {
                const float pk = expf(sc[t] - mn);
                l += pk;
#pragma unroll
                for (int i = 0; i < NI; ++i) {
                    const u32 d = dec_dim(lane, i);
                    if (d < hd) acc[i] += pk * vv[t][i];
                }
            }
        }
        m = mn;
    }

    // Merge the warps' partial softmaxes.
#pragma unroll
    for (int i = 0; i < NI; ++i) {
        const u32 d = dec_dim(lane, i);
        if (d < hd) sm_acc[warp * 256 + d] = acc[i];
    }
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
    __syncthreads();
    float M = NEG_INF;
#pragma unroll
    for (int w = 0; w < DEC_WARPS; ++w)
        if (sm_l[w] > 0.0f) M = fmaxf(M, sm_m[w]);
    float f[DEC_WARPS];
    float L = 0.0f;
#pragma unroll
    for (int w = 0; w < DEC_WARPS; ++w) {
        f[w] = sm_l[w] > 0.0f ? expf(sm_m[w] - M) : 0.0f;
        L += sm_l[w] * f[w];
    }
    if (!part) {
        // The only split: the normalised output, row 0.
        float* __restrict__ out = (float*)b.p[3] + (u64)h * hd;
        const float inv = L > 0.0f ? 1.0f / L : 0.0f;
        for (u32 d = threadIdx.x; d < hd; d += blockDim.x) {
            float v = 0.0f;
#pragma unroll
            for (int w = 0; w < DEC_WARPS; ++w) v += f[w] * sm_acc[w * 256 + d];
            out[d] = v * inv;
        }
        return;
    }
    float* __restrict__ dst = part + ((u64)h * n_split + sp) * (hd + 2);
    if (threadIdx.x == 0) {
        dst[0] = M;
        dst[1] = L;
    }
    for (u32 d = threadIdx.x; d < hd; d += blockDim.x) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; ++w) v += f[w] * sm_acc[w * 256 + d];
        dst[2 + d] = v;
    }
}

// sum over splits s = s0, s0 + step, ... < n of f[s] * acc_s, where acc_s is
// at p + s * stride, added in that order. The loads go out ATTN_MERGE_BATCH
// at a time before any is used: one L2 round trip per 16 splits. The
// previous loop (`#pragma unroll 4` over a run-time count) left them
// dependent: SmolLM2-shaped decode after a 512-token prompt went from 1,315
// to 1,455 tok/s, llama-1b F16 from 936 to 973 (bench/RESULTS.md).
#ifndef ATTN_MERGE_BATCH  // (AKUNU_CUDA_DEFINES may set it for A/B runs)
#define ATTN_MERGE_BATCH 16
#endif
__device__ __forceinline__ float attn_combine_dim(const float* p, u32 stride, u32 s0, u32 step,
                                                  u32 n, const float* f) {
    float w = 0.0f;
    for (u32 s = s0; s < n; s += ATTN_MERGE_BATCH * step) {
        float x[ATTN_MERGE_BATCH];
#pragma unroll
        for (u32 i = 0; i < ATTN_MERGE_BATCH; ++i) {
            const u32 si = s + i * step;
            x[i] = si < n ? __ldcg(p + si * stride) : 0.0f;
        }
#pragma unroll
        for (u32 i = 0; i < ATTN_MERGE_BATCH; ++i) {
            const u32 si = s + i * step;
            if (si < n) w += f[si] * x[i];
        }
    }
    return w;
}

// out[d] = the sum over thread groups of their values v for dim d (thread
// t holds group t / hd's), added in group order. Every thread must call it.
__device__ __forceinline__ void attn_sum_groups(float v, u32 hd, u32 groups, u32 g0,
                                                float* __restrict__ out, float* sm_red) {
    const u32 tid = threadIdx.x;
    if (g0 < groups) sm_red[tid] = v;
    __syncthreads();
    if (tid < hd) {
        float t = 0.0f;
        for (u32 q = 0; q < groups; ++q) t += sm_red[q * hd + tid];
        out[tid] = t;
    }
}

// Merges the first n_active decode splits of head h (threads over head
// dims and splits): M = max m_s, L = sum l_s e^(m_s - M),
// out[d] = sum acc_s[d] e^(m_s - M) / L. The partials were written by other
// blocks of this grid: read through L2 (ld.global.cg), never a stale L1
// line. All the loads of a pass are independent, so they overlap.
//
// When a thread's partial values fit one batch of EB loads (heads of up to
// blockDim dims, at most EB splits per thread: every head of 64 dims, heads
// of 128 up to 8 splits), it requests them before the split weights are
// known, so the merge waits on one L2 round trip instead of two (the sums
// are added in the same order either way). `-DATTN_MERGE_EARLY=0` turns it
// off (A/B runs). Heads of 128 take EB = 8 so that the kernel keeps the
// registers, and with them the occupancy, its split count is derived from
// (NVRTC 13.0: 64 registers with 8, 71 with 16). Heads of 256 never take
// it (no whole head per thread group); they pass EB = 1.
#ifndef ATTN_MERGE_EARLY
#define ATTN_MERGE_EARLY 1
#endif
template <u32 EB>
__device__ __forceinline__ void attn_combine_head(const float* ph, u32 hd, u32 n_active,
                                                  float* __restrict__ out, float* sm_f,
                                                  float* sm_red) {
    const u32 stride = hd + 2, tid = threadIdx.x;
    const u32 groups = blockDim.x / hd;
    // Thread t takes dim t % hd of splits t / hd, t / hd + groups, ...
    const u32 d = groups ? tid % hd : 0, g0 = groups ? tid / hd : 0;
    const bool early = ATTN_MERGE_EARLY && groups >= 1 && n_active <= EB * groups;
    float x[EB];
    if (early) {
#pragma unroll
        for (u32 i = 0; i < EB; ++i) {
            const u32 si = g0 + i * groups;
            x[i] = g0 < groups && si < n_active ? __ldcg(ph + 2 + d + si * stride) : 0.0f;
        }
    }
    // Weights of the splits: f_s = e^(m_s - M) / L (n_active <= 32).
    if (tid < 32) {
        const bool live = tid < n_active && __ldcg(ph + tid * stride + 1) > 0.0f;
        const float m = live ? __ldcg(ph + tid * stride) : NEG_INF;
        const float l = live ? __ldcg(ph + tid * stride + 1) : 0.0f;
        const float M = warp_max(m);
        const float e = live ? expf(m - M) : 0.0f;
        const float L = warp_sum(l * e);
        sm_f[tid] = L > 0.0f ? e / L : 0.0f;
    }
    __syncthreads();
    if (early) {
        float v = 0.0f;
#pragma unroll
        for (u32 i = 0; i < EB; ++i) {
            const u32 si = g0 + i * groups;
            if (g0 < groups && si < n_active) v += sm_f[si] * x[i];
        }
        if (groups == 1) {
            if (tid < hd) out[tid] = v;
            return;
        }
        attn_sum_groups(v, hd, groups, g0, out, sm_red);
        return;
    }
    if (groups <= 1) {
        for (u32 d = tid; d < hd; d += blockDim.x)
            out[d] = attn_combine_dim(ph + 2 + d, stride, 0, 1, n_active, sm_f);
        return;
    }
    float v = 0.0f;
    if (g0 < groups) v = attn_combine_dim(ph + 2 + d, stride, g0, groups, n_active, sm_f);
    attn_sum_groups(v, hd, groups, g0, out, sm_red);
}

// Launch-time fusion of the RoPE + KV write that precedes decode attention
// in a one-row step (launch.rs, `fusion::rope_into_attention`): the
// rotation's parameters; `on` = 0 for plain attention.
struct RopeExtra {
    const float* ff;  // frequency divisors, or null
    u32 on;
    u32 rope_dim;
    float theta;
    float freq_scale;
    u32 style;
    u32 _pad;
};

// The fused RoPE + KV write, per block of a one-row decode attention: the
// block rotates its head's query into q_rot; the block whose split holds
// the new position (the last active one) also rotates that position's key
// and writes it and the value into the caches, as k_rope_kv_write would,
// before reading them (the barrier makes its own writes visible to it).
// Blocks of other heads that share the KV head write the same bits; no
// other block reads that position. The QKV row itself is left unrotated:
// nothing after attention reads it.
//
// Every load comes before the first write, and the chain's stop word is
// tested between them (`stop_seen`, after the barrier): the block does not
// spend a dependent L2 round trip on it before reading the row, as the
// short gemv instances (common.cuh, LATE_STOP). Returns true when stopped.
template <class StopSeen>
__device__ __forceinline__ bool attn_rope_prep(const Bind& b, const AttnParams& p, const RopeExtra& re,
                                               u32 pos, float c, float s, bool writes_kv,
                                               float* q_rot, StopSeen stop_seen) {
    const u32 h = blockIdx.x, hd = p.head_dim, half = re.rope_dim >> 1;
    const u32 g = h / (p.n_heads / p.n_kv_heads);
    const bool neox = re.style == ROPE_NEOX;
    const float* __restrict__ row = (const float*)b.p[0];
    const float* __restrict__ qh = row + (u64)h * hd;
    const float* __restrict__ kh = row + (u64)(p.n_heads + g) * hd;
    const float* __restrict__ vh = row + (u64)(p.n_heads + p.n_kv_heads + g) * hd;
    kv_t* __restrict__ kdst = (kv_t*)b.p[1] + ((u64)g * p.capacity + pos) * hd;
    kv_t* __restrict__ vdst = (kv_t*)b.p[2] + ((u64)g * p.capacity + pos) * hd;
    // Thread i rotates pair i with the (c, s) it computed before the wait
    // (half <= 128 = blockDim: head_dim <= 256, so a thread also takes at
    // most two of the dims past the rotation and two of V).
    const u32 i = threadIdx.x;
    u32 ia = 0, ib = 0;
    float qa = 0.0f, qb = 0.0f, ka = 0.0f, kb = 0.0f, qr[2], kr[2], vr[2];
    if (i < half) {
        rope_pair(i, half, neox, ia, ib);
        qa = qh[ia];
        qb = qh[ib];
        if (writes_kv) {
            ka = kh[ia];
            kb = kh[ib];
        }
    }
#pragma unroll
    for (u32 n = 0; n < 2; ++n) {
        const u32 d = re.rope_dim + i + n * blockDim.x, dv = i + n * blockDim.x;
        qr[n] = d < hd ? qh[d] : 0.0f;
        kr[n] = writes_kv && d < hd ? kh[d] : 0.0f;
        vr[n] = writes_kv && dv < hd ? vh[dv] : 0.0f;
    }
    if (stop_seen()) return true;
    if (i < half) {
        rope_rotate(qa, qb, c, s, q_rot[ia], q_rot[ib]);
        if (writes_kv) {
            float y0, y1;
            rope_rotate(ka, kb, c, s, y0, y1);
            kdst[ia] = kv_from(y0);
            kdst[ib] = kv_from(y1);
        }
    }
#pragma unroll
    for (u32 n = 0; n < 2; ++n) {
        const u32 d = re.rope_dim + i + n * blockDim.x, dv = i + n * blockDim.x;
        if (d < hd) {
            q_rot[d] = qr[n];
            if (writes_kv) kdst[d] = kv_from(kr[n]);
        }
        if (writes_kv && dv < hd) vdst[dv] = kv_from(vr[n]);
    }
    __syncthreads();
    return false;
}

#ifndef ATTN_LATE_STOP
#define ATTN_LATE_STOP LATE_STOP
#endif
// The split tickets through `last_to_arrive` (common.cuh);
// `-DATTN_TICKET_ACQREL=0` puts back a fence of every thread on both sides
// (A/B runs).
#ifndef ATTN_TICKET_ACQREL
#define ATTN_TICKET_ACQREL 1
#endif

// One block of decode attention for heads of up to 32 * NI dims.
template <int NI>
__device__ __forceinline__ void attn_decode_block(const Bind& b, const AttnParams& p, const StepArg& a,
                                                  float* part, u32 n_split, const RopeExtra& re,
                                                  u32 kv_len, float rc, float rs, float* sm_m,
                                                  float* sm_l, float* sm_acc, float* sm_q,
                                                  u32* sm_last) {
    // grid.z = query rows (speculative verification): row z is the query at
    // position pos + z, computed exactly as a one-row step there (same
    // split layout), with its own tickets and partials.
    const u32 z = blockIdx.z, hd = p.head_dim;
    const u32 kv = kv_len - (gridDim.z - 1 - z);
    const u32 chunk = attn_chunk(kv, n_split);
    const u32 n_active = (kv + chunk - 1) / chunk;
    if (blockIdx.y >= n_active) return;
    // With the fused RoPE the stop word is tested after the row's loads
    // (attn_rope_prep); `-DATTN_LATE_STOP=0` tests it first (A/B runs).
    __shared__ uint4 ctl_slot;
    const bool late = ATTN_LATE_STOP && re.on;
    if (late) {
        AKUNU_GRID_DEPS();
        chain_stop_copy(a, &ctl_slot);
    } else {
        AKUNU_PROLOGUE(a);
    }
#ifdef DIAG_SKIP_ATTN
    return;  // measurement only (wrong results): decode time without attention
#endif
    Bind bz = b;
    bz.p[0] += (u64)z * p.qkv_stride * sizeof(float);
    bz.p[3] += (u64)z * p.out_stride * sizeof(float);
    u32* tickets = (u32*)((char*)part - ATTN_TICKET_BYTES) + z * p.n_heads;
    part += (u64)z * p.n_heads * n_split * (hd + 2);
    // With the fused RoPE (one row only: grid.z == 1), the new position is
    // kv - 1 and the last active split holds it.
    const float* q_rot = nullptr;
    if (re.on) {
        const bool stopped = attn_rope_prep(bz, p, re, kv - 1, rc, rs, blockIdx.y == n_active - 1, sm_q, [&] {
            if (!late) return false;
            chain_stop_landed();
            __syncthreads();
            return chain_stop_seen(a, &ctl_slot);
        });
        if (stopped) return;
        q_rot = sm_q;
    }
    // One active split writes the output itself (no partials, no merge).
    float* pp = n_active == 1 ? nullptr : part;
    attn_decode_body<NI>(bz, p, kv, q_rot, pp, n_split, sm_m, sm_l, sm_acc);
    if (n_active == 1) return;

    const u32 h = blockIdx.x;
    if (ATTN_TICKET_ACQREL) {
        if (!last_to_arrive(&tickets[h], n_active, sm_last)) return;
    } else {
        __threadfence();  // this block's partial is visible before its ticket
        __syncthreads();
        if (threadIdx.x == 0) *sm_last = atomicAdd(&tickets[h], 1u) == n_active - 1;
        __syncthreads();
        if (!*sm_last) return;
        __threadfence();
    }
    // sm_acc is free again: its first 32 floats hold the split weights,
    // the rest the per-group sums.
    attn_combine_head<NI <= 2 ? ATTN_MERGE_BATCH : NI <= 4 ? 8 : 1>(part + (u64)h * n_split * (hd + 2), hd, n_active,
                      (float*)bz.p[3] + (u64)h * hd, sm_acc, sm_acc + 32);
    if (threadIdx.x == 0) tickets[h] = 0;
}

// Split-KV decode attention. grid = (n_heads, n_split, query rows),
// block 128. Splits take attn_chunk(kv_len) keys each, clipped to the
// window; the first n_active = ceil(kv_len / chunk) write
// part[(h*n_split + s)*(head_dim+2) + {0: m, 1: l, 2+d: acc[d]}] (an empty
// range writes m = -inf, l = 0, acc = 0) and the rest return. The last
// active block of a head to finish (per-head ticket counters in the
// ATTN_TICKET_BYTES before `part`, which it resets for the next launch)
// merges the head's splits into the row's output, so decode attention is
// one kernel.
//
// One kernel per head width class (64, 128, 256: NI = 2, 4, 8), so that
// each gets the registers its width needs: one kernel for every width took
// 122 a thread; the 64-wide one takes 48, the 128-wide one 64 (NVRTC
// 13.0). With that and the idle splits' return moved before the wait,
// tg128 went 1,632 -> 1,734 tok/s on SmolLM2, 1,154 -> 1,182 on
// Llama-1B F16 and 414.5 -> 416.9 on 8B Q4_0 (bench/RESULTS.md, session 15).
#define ATTN_DECODE_KERNEL(WIDTH, NI)                                                              \
    extern "C" __global__ void __launch_bounds__(128)                                              \
        k_attn_decode_##WIDTH(Bind b, AttnParams p, StepArg a, float* part, u32 n_split,           \
                              RopeExtra re) {                                                      \
        /* The fused rotation's angles depend on the position alone, which no                      \
           kernel before this one in a chunk graph writes (k_chain_advance runs                    \
           after the chunk): computed before waiting on the previous kernel, the                   \
           f64 pow and sincospi overlap its tail. The KV length comes from the                     \
           chain's pos0, which only k_chain_advance writes: read once, here. */                    \
        const u32 kv_len = attn_kv_len(p, a);                                                      \
        float rc = 0.0f, rs = 0.0f;                                                                \
        if (re.on && threadIdx.x < (re.rope_dim >> 1))                                             \
            rope_cs(kv_len - 1, threadIdx.x, re.rope_dim, re.theta, re.freq_scale, re.ff, rc, rs); \
        __shared__ float sm_m[DEC_WARPS], sm_l[DEC_WARPS];                                         \
        __shared__ float sm_acc[DEC_WARPS * 256];                                                  \
        __shared__ float sm_q[256];                                                                \
        __shared__ u32 sm_last;                                                                    \
        attn_decode_block<NI>(b, p, a, part, n_split, re, kv_len, rc, rs, sm_m, sm_l, sm_acc,      \
                              sm_q, &sm_last);                                                     \
    }
ATTN_DECODE_KERNEL(64, 2)
ATTN_DECODE_KERNEL(128, 4)
ATTN_DECODE_KERNEL(256, 8)

// Prefill attention. grid = (n_heads, ceil(rows / 8)), block 256 = 8 warps;
// warp w handles query row t = blockIdx.y*8 + w at position
// kv_len - rows + t. The block walks the keys its rows can see in tiles of
// TK (32, or fewer when head_dim > 128 so the tiles fit in 48 KB) staged in
// shared memory and shared by the 8 warps (all rows of a block use the same
// kv head). Per tile, lane j scores key j (padded K rows, float4 reads),
// then the warp updates its online softmax and each lane accumulates its NI
// output dims.
#define PF_WARPS 8
#define PF_TILE_FLOATS (32 * 132)

template <int NI>
__device__ __forceinline__ void attn_prefill_body(const Bind& b, const AttnParams& p, u32 kv,
                                                  u32 rows, float* ks, float* vs, float* qs) {
    const u32 h = blockIdx.x, hd = p.head_dim;
    // Padded K/V row stride: hd + 4 keeps rows 16-byte aligned for float4
    // reads and spreads the lanes of a quarter-warp over all 32 banks.
    const bool vec = (hd & 3) == 0;
    const u32 ld = vec ? hd + 4 : hd + 1;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 g = h / (p.n_heads / p.n_kv_heads);
    const int tk = (int)min(32u, PF_TILE_FLOATS / ld);

    const int base_pos = (int)kv - (int)rows;
    const int t_first = (int)blockIdx.y * PF_WARPS;
    const int t_last = min(t_first + PF_WARPS - 1, (int)rows - 1);
    const int pos_hi = base_pos + t_last;
    const int block_lo = attn_first_key(base_pos + t_first, p.window);

    const int t = t_first + (int)warp;
    const bool active = t < (int)rows;
    const int my_pos = base_pos + t;
    const int my_lo = attn_first_key(my_pos, p.window);

    float* qw = qs + warp * 256;
    if (active) {
        const float* __restrict__ qp = (const float*)b.p[0] + (u64)t * p.qkv_stride + (u64)h * hd;
        for (u32 d = lane; d < hd; d += 32) qw[d] = qp[d];
    }
    const kv_t* __restrict__ K = (const kv_t*)b.p[1] + (u64)g * p.capacity * hd;
    const kv_t* __restrict__ V = (const kv_t*)b.p[2] + (u64)g * p.capacity * hd;
    // Tiles are copied 4 elements at a time when the cache rows are aligned.
    const bool vec4 = vec && kv_aligned4(K) && kv_aligned4(V);

    float acc[NI];
#pragma unroll
    for (int i = 0; i < NI; ++i) acc[i] = 0.0f;
    float m = NEG_INF, l = 0.0f;

    for (int j0 = block_lo; j0 <= pos_hi; j0 += tk) {
        const int nt = min(tk, pos_hi + 1 - j0);
        __syncthreads();  // previous tile consumed (and q staged, first time)
        const kv_t* kt = K + (u64)j0 * hd;
        const kv_t* vt = V + (u64)j0 * hd;
        if (vec4) {
            const u32 hd4 = hd >> 2, n4 = (u32)nt * hd4;
            for (u32 e = threadIdx.x; e < n4; e += blockDim.x) {
                const u32 jj = e / hd4, d = (e - jj * hd4) * 4;
                *(float4*)(ks + jj * ld + d) = ld4_f32(kt, 4 * (u64)e);
                *(float4*)(vs + jj * ld + d) = ld4_f32(vt, 4 * (u64)e);
            }
        } else {
            const u32 n_el = (u32)nt * hd;
            for (u32 e = threadIdx.x; e < n_el; e += blockDim.x) {
                const u32 jj = e / hd, d = e - jj * hd;
                ks[jj * ld + d] = ld_f32(kt, e);
                vs[jj * ld + d] = ld_f32(vt, e);
            }
        }
        __syncthreads();
        if (!active || j0 > my_pos || j0 + nt <= my_lo) continue;

        const int j = j0 + (int)lane;
        const bool valid = (int)lane < nt && j >= my_lo && j <= my_pos;
        float s = NEG_INF;
        if (valid) {
            const float* kr = ks + lane * ld;
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
            if (vec) {
#pragma unroll 4
                for (u32 d = 0; d < hd; d += 4) {
                    const float4 kk = *(const float4*)(kr + d);
                    const float4 qq = *(const float4*)(qw + d);
                    s0 += qq.x * kk.x;
                    s1 += qq.y * kk.y;
                    s2 += qq.z * kk.z;
                    s3 += qq.w * kk.w;
                }
            } else {
                for (u32 d = 0; d < hd; ++d) s0 += qw[d] * kr[d];
            }
            s = softcap_score(((s0 + s1) + (s2 + s3)) * p.scale, p.softcap);
        }
        // The warp's own key my_pos or an earlier visible one lies in this
        // tile (checked above), so mn is finite.
        const float mn = fmaxf(m, warp_max(s));
        const float corr = expf(m - mn);
        const float pr = valid ? expf(s - mn) : 0.0f;
        l = l * corr + warp_sum(pr);
#pragma unroll
        for (int i = 0; i < NI; ++i) acc[i] *= corr;
        for (int jj = 0; jj < nt; ++jj) {
            const float pj = __shfl_sync(FULL_MASK, pr, jj);
            const float* vr = vs + jj * ld;
#pragma unroll
            for (int i = 0; i < NI; ++i) {
                const u32 d = lane + 32 * i;
                if (d < hd) acc[i] += pj * vr[d];
            }
        }
        m = mn;
    }

    if (active) {
        float* __restrict__ op = (float*)b.p[3] + (u64)t * p.out_stride + (u64)h * hd;
        const float inv = 1.0f / l;
#pragma unroll
        for (int i = 0; i < NI; ++i) {
            const u32 d = lane + 32 * i;
            if (d < hd) op[d] = acc[i] * inv;
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
k_attn_prefill(Bind b, AttnParams p, StepArg a) {
    AKUNU_PROLOGUE(a);
    __shared__ __align__(16) float ks[PF_TILE_FLOATS];
    __shared__ __align__(16) float vs[PF_TILE_FLOATS];
    __shared__ __align__(16) float qs[PF_WARPS * 256];
    const u32 kv = attn_kv_len(p, a);
    if (p.head_dim <= 64)
        attn_prefill_body<2>(b, p, kv, a.rows, ks, vs, qs);
    else if (p.head_dim <= 128)
        attn_prefill_body<4>(b, p, kv, a.rows, ks, vs, qs);
    else
        attn_prefill_body<8>(b, p, kv, a.rows, ks, vs, qs);
}

// ---------------------------------------------------------------------------
// Flash prefill attention (k_attn_flash_64 / _128 / _256), on the CUDA
// cores in exact f32.
//
// grid = (n_heads, ceil(rows / FA_BQ)), block FA_THREADS = 256, dynamic
// shared memory fa_smem_bytes(D) (launch.rs `flash_smem_bytes`). A block
// owns FA_BQ = 64 query rows of one head; its row blocks run in reverse
// order (blockIdx.y = 0 takes the last rows, which see the most keys), so
// the longest blocks start first. D is the head width rounded up to 64, 128
// or 256: narrower heads are zero-padded in shared memory (zero dims add
// nothing to a score, and the padded output dims are not written).
//
// Shared memory (floats): Q [64][D+4] | K [64][D+4] | V [64][D]. The block
// walks the keys its rows can see, [first key of its first row, position of
// its last row], in tiles of FA_BK = 64 keys; keys past the last position
// are zero-filled, never read from the cache. Thread (ty, tx) = (tid / 16,
// tid % 16) owns query rows ty*4 + i (i < 4) and, per tile, keys
// tx + 16c (c < 4):
//   1. S = Q K^T: a 4 x 4 micro-tile per thread, d in steps of 4 with
//      float4 reads (each Q float4 feeds 4 keys, each K float4 4 rows: 64
//      FMAs per 8 shared loads). The +4 padding puts the 8 K rows of a
//      quarter-warp on distinct banks; the warp's two ty read two Q rows
//      16 banks apart.
//   2. scale, soft-cap, mask (key j visible to a row at position pos iff
//      attn_first_key(pos) <= j <= pos, the old kernel's rule), then the
//      online softmax per row: the row max over the 16 lanes that share the
//      row (a half-warp: xor shuffles 8, 4, 2, 1), so every owner of a row
//      applies the same max and the same correction. The row sum l stays
//      per thread (its own keys; all are rescaled by the same factors) and
//      is reduced over the half-warp once, at the end.
//   3. P (64 keys x 64 rows, transposed: P^T[key][row], row stride 68) is
//      written over the K tile (a barrier first: K is consumed), then
//      O += P V: each thread accumulates 4 rows x 4*D/64 dims (dims
//      tx*4 + 64c + e), per key one float4 of P (its 4 rows) and D/64
//      float4s of V (32 FMAs per 3 loads at D = 128).
// Exactness: every product and sum is an f32 FMA/add of the true values
// (no reduced-precision inputs); only the summation order differs from the
// CPU backend, as it does for the old kernel. Rows past the step's last row
// (a ragged last block) take the last row's position, so their scores stay
// finite, and are never written. A row that has seen no visible key yet has
// m = -inf: the tile's reference max is then taken as 0 (e^(-inf) = 0 for
// the correction and for masked scores), so no -inf - -inf NaN arises; every
// row sees at least its own position, so its final l >= 1.
// ---------------------------------------------------------------------------
#define FA_BQ 64
#define FA_BK 64
#define FA_THREADS 256
#define FA_LDP (FA_BQ + 4)
#ifndef FA_UNROLL_S
#define FA_UNROLL_S 1
#endif
#ifndef FA_UNROLL_PV
#define FA_UNROLL_PV 8
#endif
// As constants: nvcc (bench/cuda probes) does not expand macros in pragmas.
constexpr int kFaUnrollS = FA_UNROLL_S, kFaUnrollPv = FA_UNROLL_PV;

// Rows [0, n) of a tile of R rows from src + r * stride (f32 or f16
// elements: the query rows or the cache), dims [0, hd) of D, into dst with
// row stride LD; other rows and dims are zero. `vec`: hd == D and src,
// stride aligned for 4-element loads.
template <int D, int R, int LD, class T>
__device__ __forceinline__ void fa_stage(float* dst, const T* __restrict__ src, u64 stride,
                                         int n, u32 hd, bool vec) {
    if (vec) {
        constexpr int C4 = D / 4;
        for (int e = threadIdx.x; e < R * C4; e += FA_THREADS) {
            const int r = e / C4, c = (e - r * C4) * 4;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (r < n) v = ld4_f32(src, (u64)r * stride + c);
            *(float4*)(dst + r * LD + c) = v;
        }
    } else {
        for (int e = threadIdx.x; e < R * D; e += FA_THREADS) {
            const int r = e / D, c = e - r * D;
            dst[r * LD + c] = (r < n && c < (int)hd) ? ld_f32(src, (u64)r * stride + c) : 0.0f;
        }
    }
}

// One row block of a flash prefill attention (k_attn_flash_*, k_attn_tc_*:
// grid = (n_heads, ceil(rows / 64)), row blocks in reverse order): its
// first row t0 and row count nq, the positions it covers, and its head's
// operands. `vec`: Q, K and V take 4-element loads (head_dim == D, aligned).
struct FlashBlock {
    int t0, nq, base_pos, pos_hi, key_lo;
    const float* Q;
    const kv_t* K;
    const kv_t* V;
    float* O;
    bool vec;
};

__device__ __forceinline__ FlashBlock flash_block(const Bind& b, const AttnParams& p, u32 kv, u32 rows,
                                                  int bq, u32 D) {
    FlashBlock f;
    const u32 h = blockIdx.x, hd = p.head_dim;
    const u32 g = h / (p.n_heads / p.n_kv_heads);
    f.t0 = (int)(gridDim.y - 1 - blockIdx.y) * bq;
    f.nq = min(bq, (int)rows - f.t0);
    f.base_pos = (int)kv - (int)rows;
    f.pos_hi = f.base_pos + f.t0 + f.nq - 1;
    f.key_lo = attn_first_key(f.base_pos + f.t0, p.window);
    f.Q = (const float*)b.p[0] + (u64)f.t0 * p.qkv_stride + (u64)h * hd;
    f.K = (const kv_t*)b.p[1] + (u64)g * p.capacity * hd;
    f.V = (const kv_t*)b.p[2] + (u64)g * p.capacity * hd;
    f.O = (float*)b.p[3] + (u64)f.t0 * p.out_stride + (u64)h * hd;
    f.vec = hd == D && (p.qkv_stride & 3) == 0 && ((u64)f.Q & 15) == 0 && kv_aligned4(f.K) &&
            kv_aligned4(f.V);
    return f;
}

template <int D>
__device__ __forceinline__ void attn_flash_body(const Bind& b, const AttnParams& p, u32 kv,
                                                u32 rows, float* sm) {
    constexpr int LDK = D + 4;
    constexpr int NC = D / 64;  // float4 groups of output dims per thread
    float* qs = sm;                // [FA_BQ][LDK]
    float* ks = qs + FA_BQ * LDK;  // [FA_BK][LDK]; P^T [FA_BK][FA_LDP] after S
    float* vs = ks + FA_BK * LDK;  // [FA_BK][D]
    float* ps = ks;
    static_assert(FA_LDP <= LDK, "P^T must fit in the K tile");

    const int tid = (int)threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const u32 hd = p.head_dim;
    const FlashBlock fb = flash_block(b, p, kv, rows, FA_BQ, D);
    const int t0 = fb.t0, nq = fb.nq, base_pos = fb.base_pos, pos_hi = fb.pos_hi, key_lo = fb.key_lo;
    const float* __restrict__ Q = fb.Q;
    const kv_t* __restrict__ K = fb.K;
    const kv_t* __restrict__ V = fb.V;
    float* __restrict__ O = fb.O;
    const bool vec = fb.vec;
    const bool vec_o = hd == (u32)D && (p.out_stride & 3) == 0 && ((u64)O & 15) == 0;

    fa_stage<D, FA_BQ, LDK>(qs, Q, p.qkv_stride, nq, hd, vec);

    // Row ty*4 + i is at position min(pos0 + i, pos_hi): rows past the
    // step's last take its position (finite scores, never written).
    const int pos0 = base_pos + t0 + ty * 4;
    float m[4], l[4], o[4][4 * NC];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        m[i] = NEG_INF;
        l[i] = 0.0f;
#pragma unroll
        for (int e = 0; e < 4 * NC; ++e) o[i][e] = 0.0f;
    }

    for (int j0 = key_lo; j0 <= pos_hi; j0 += FA_BK) {
        const int nt = min(FA_BK, pos_hi + 1 - j0);
        __syncthreads();  // the previous tile's P and V are consumed
        fa_stage<D, FA_BK, LDK>(ks, K + (u64)j0 * hd, hd, nt, hd, vec);
        fa_stage<D, FA_BK, D>(vs, V + (u64)j0 * hd, hd, nt, hd, vec);
        __syncthreads();  // K, V (and Q, the first time) staged

        float s[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int c = 0; c < 4; ++c) s[i][c] = 0.0f;
#pragma unroll kFaUnrollS
        for (int d = 0; d < D; d += 4) {
            float4 a[4], k4[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = *(const float4*)(qs + (ty * 4 + i) * LDK + d);
#pragma unroll
            for (int c = 0; c < 4; ++c) k4[c] = *(const float4*)(ks + (tx + 16 * c) * LDK + d);
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    float t = s[i][c];
                    t = fmaf(a[i].x, k4[c].x, t);
                    t = fmaf(a[i].y, k4[c].y, t);
                    t = fmaf(a[i].z, k4[c].z, t);
                    t = fmaf(a[i].w, k4[c].w, t);
                    s[i][c] = t;
                }
        }
        __syncthreads();  // every thread is done with K: P may overwrite it

#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int qpos = min(pos0 + i, pos_hi);
            const int qlo = attn_first_key(qpos, p.window);
            float mx = NEG_INF;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int j = j0 + tx + 16 * c;
                const bool valid = j >= qlo && j <= qpos;
                s[i][c] = valid ? softcap_score(s[i][c] * p.scale, p.softcap) : NEG_INF;
                mx = fmaxf(mx, s[i][c]);
            }
#pragma unroll
            for (int off = 8; off > 0; off >>= 1)
                mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, off));
            const float mn = fmaxf(m[i], mx);
            const float ref = mn == NEG_INF ? 0.0f : mn;
            const float corr = expf(m[i] - ref);
            m[i] = mn;
            float rs = 0.0f;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                s[i][c] = expf(s[i][c] - ref);
                rs += s[i][c];
            }
            l[i] = l[i] * corr + rs;
#pragma unroll
            for (int e = 0; e < 4 * NC; ++e) o[i][e] *= corr;
        }
#pragma unroll
        for (int c = 0; c < 4; ++c)
            *(float4*)(ps + (tx + 16 * c) * FA_LDP + ty * 4) =
                make_float4(s[0][c], s[1][c], s[2][c], s[3][c]);
        __syncthreads();  // P complete

        // Keys past nt have P = 0 and zero V rows: the loop runs whole
        // tiles (unrolled) and adds exact zeros there.
#pragma unroll kFaUnrollPv
        for (int jj = 0; jj < FA_BK; ++jj) {
            const float4 pj = *(const float4*)(ps + jj * FA_LDP + ty * 4);
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                const float4 v = *(const float4*)(vs + jj * D + tx * 4 + 64 * c);
                o[0][4 * c + 0] = fmaf(pj.x, v.x, o[0][4 * c + 0]);
                o[0][4 * c + 1] = fmaf(pj.x, v.y, o[0][4 * c + 1]);
                o[0][4 * c + 2] = fmaf(pj.x, v.z, o[0][4 * c + 2]);
                o[0][4 * c + 3] = fmaf(pj.x, v.w, o[0][4 * c + 3]);
                o[1][4 * c + 0] = fmaf(pj.y, v.x, o[1][4 * c + 0]);
                o[1][4 * c + 1] = fmaf(pj.y, v.y, o[1][4 * c + 1]);
                o[1][4 * c + 2] = fmaf(pj.y, v.z, o[1][4 * c + 2]);
                o[1][4 * c + 3] = fmaf(pj.y, v.w, o[1][4 * c + 3]);
                o[2][4 * c + 0] = fmaf(pj.z, v.x, o[2][4 * c + 0]);
                o[2][4 * c + 1] = fmaf(pj.z, v.y, o[2][4 * c + 1]);
                o[2][4 * c + 2] = fmaf(pj.z, v.z, o[2][4 * c + 2]);
                o[2][4 * c + 3] = fmaf(pj.z, v.w, o[2][4 * c + 3]);
                o[3][4 * c + 0] = fmaf(pj.w, v.x, o[3][4 * c + 0]);
                o[3][4 * c + 1] = fmaf(pj.w, v.y, o[3][4 * c + 1]);
                o[3][4 * c + 2] = fmaf(pj.w, v.z, o[3][4 * c + 2]);
                o[3][4 * c + 3] = fmaf(pj.w, v.w, o[3][4 * c + 3]);
            }
        }
    }

#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float lt = l[i];
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) lt += __shfl_xor_sync(FULL_MASK, lt, off);
        const int r = ty * 4 + i;
        if (r >= nq) continue;
        const float inv = 1.0f / lt;
        float* __restrict__ op = O + (u64)r * p.out_stride;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const int d = tx * 4 + 64 * c;
            if (vec_o) {
                *(float4*)(op + d) = make_float4(o[i][4 * c] * inv, o[i][4 * c + 1] * inv,
                                                 o[i][4 * c + 2] * inv, o[i][4 * c + 3] * inv);
            } else {
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (d + e < (int)hd) op[d + e] = o[i][4 * c + e] * inv;
            }
        }
    }
}

// Head widths up to 64 / 128 / 256 (launch.rs picks by head_dim). Dynamic
// shared memory: 50, 98 and 194 KiB, so 4, 2 and 1 blocks per SM fit by
// memory on an H100/H200; the register bounds follow.
#define FA_KERNEL(D, MINB)                                                      \
    extern "C" __global__ void __launch_bounds__(FA_THREADS, MINB)              \
    k_attn_flash_##D(Bind b, AttnParams p, StepArg a) {                         \
        AKUNU_PROLOGUE(a);                                                      \
        extern __shared__ float4 fa_smem[];                                     \
        attn_flash_body<D>(b, p, attn_kv_len(p, a), a.rows, (float*)fa_smem);   \
    }
FA_KERNEL(64, 2)
FA_KERNEL(128, 2)
FA_KERNEL(256, 1)

// ---------------------------------------------------------------------------
// Flash prefill attention on the tensor cores (k_attn_tc_64 / _128), exact
// to f32 accumulation.
//
// grid = (n_heads, ceil(rows / 64)), block TA_THREADS = 128 (4 warps), dynamic
// shared memory launch.rs `tc_attention_smem_bytes(D)`. The
// block owns 64 query rows of one head (row blocks in reverse order, as in
// k_attn_flash), warp w the rows 16w .. 16w + 15, and walks the visible keys
// in tiles of 64 as k_attn_flash does, with the same masks, soft-cap and
// online softmax (the same -inf handling); D is the head width rounded up to
// 64 or 128, narrower heads zero-padded.
//
// Operands are f16 hi + lo halves (x = hi + lo, hi = f16(x), lo = f16(x -
// hi)), staged in shared memory: Q and K row-major [row][D + 8], V
// transposed [D][64 + 8] (the padding puts a fragment's 8 rows x 4 words on
// 32 banks). Products are mma.sync m16n8k16 with f32 accumulation, three
// per pair of operands (hi hi + hi lo + lo hi; lo lo, about 2^-22 of the
// product, is left out), as k_gemm_tc does for inputs:
//   S (16 x 64 per warp) = Q K^T, 8 key tiles of 8 over D / 16 k-steps;
//   P = e^(S - max) stays in the S registers, whose m16n8 layout is the A
//   operand's of P V (two key tiles per k-step of 16 keys);
//   O (16 x D per warp) += P V over the tile's 64 keys.
// Lane (g, t) = (lane / 4, lane % 4) holds rows g and g + 8 of its warp,
// keys / dims 2t and 2t + 1 of each 8-wide tile; row maxima are reduced
// over the 4 lanes of a row (xor shuffles 1, 2), row sums once at the end.
// ---------------------------------------------------------------------------
#define TA_THREADS 128
#define TA_BQ 64
#define TA_BK 64
#define TA_LDT (TA_BK + 8)  // halves per transposed V row
#ifndef TA_BATCH  // (AKUNU_CUDA_DEFINES=-DTA_BATCH=N for A/B runs)
#define TA_BATCH 8  // loads in flight per thread while staging
#endif

// Rows [0, n) of R rows of hd elements (f32 query rows, or the f32 or f16
// cache) from src + r * stride into hi/lo halves; row-major [r][D + 8], or
// transposed [d][R + 8] (V). Zero past n and hd. `vec` (hd == D, src and
// stride aligned for 4 elements): 4-element loads;
// row-major tiles store 4 halves at once, transposed ones take two rows
// per thread and store each dim's pair of halves at once. Without LO only
// the hi halves are written (the f16 instances).
template <int D, int R, bool TRANS, bool LO, class T>
__device__ __forceinline__ void ta_stage(u16* hi, u16* lo, const T* __restrict__ src,
                                         u64 stride, int n, u32 hd, bool vec) {
    // The vector paths issue a batch of TA_BATCH loads before converting
    // and storing any of them, and read rows past n from row n - 1 (n >= 1)
    // and zero them by a select: with a branch around each load, the loads
    // of a tile went out one after another, each waiting for the last.
    if (vec && !TRANS) {
        constexpr int C4 = D / 4, PER = R * C4 / TA_THREADS, NB = PER < TA_BATCH ? PER : TA_BATCH;
        static_assert(R * C4 % TA_THREADS == 0 && PER % NB == 0, "whole batches");
#pragma unroll
        for (int b0 = 0; b0 < PER; b0 += NB) {
            float4 v[NB];
#pragma unroll
            for (int q = 0; q < NB; ++q) {
                const int e = (int)threadIdx.x + (b0 + q) * TA_THREADS;
                const int r = e / C4, c = (e - r * C4) * 4;
                v[q] = ld4_f32(src, (u64)min(r, n - 1) * stride + c);
            }
#pragma unroll
            for (int q = 0; q < NB; ++q) {
                const int e = (int)threadIdx.x + (b0 + q) * TA_THREADS;
                const int r = e / C4, c = (e - r * C4) * 4;
                const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f), w = r < n ? v[q] : z;
                const float h0 = f16_round(w.x), h1 = f16_round(w.y), h2 = f16_round(w.z), h3 = f16_round(w.w);
                const u32 at = (u32)(r * (D + 8) + c);
                *(uint2*)(hi + at) = make_uint2(pack_h2(h0, h1), pack_h2(h2, h3));
                if (LO) *(uint2*)(lo + at) = make_uint2(pack_h2(w.x - h0, w.y - h1), pack_h2(w.z - h2, w.w - h3));
            }
        }
        return;
    }
    if (vec && TRANS) {
        constexpr int C4 = D / 4, PER = (R / 2) * C4 / TA_THREADS;
        constexpr int NB = PER < TA_BATCH / 2 ? PER : TA_BATCH / 2;
        static_assert((R / 2) * C4 % TA_THREADS == 0 && PER % NB == 0, "whole batches");
#pragma unroll
        for (int b0 = 0; b0 < PER; b0 += NB) {
            float4 v0[NB], v1[NB];
#pragma unroll
            for (int q = 0; q < NB; ++q) {
                const int e = (int)threadIdx.x + (b0 + q) * TA_THREADS;
                const int r = (e / C4) * 2, c = (e - (e / C4) * C4) * 4;
                v0[q] = ld4_f32(src, (u64)min(r, n - 1) * stride + c);
                v1[q] = ld4_f32(src, (u64)min(r + 1, n - 1) * stride + c);
            }
#pragma unroll
            for (int q = 0; q < NB; ++q) {
                const int e = (int)threadIdx.x + (b0 + q) * TA_THREADS;
                const int r = (e / C4) * 2, c = (e - (e / C4) * C4) * 4;
                const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                const float4 w0 = r < n ? v0[q] : z, w1 = r + 1 < n ? v1[q] : z;
                const float a[4] = {w0.x, w0.y, w0.z, w0.w}, bb[4] = {w1.x, w1.y, w1.z, w1.w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float h0 = f16_round(a[i]), h1 = f16_round(bb[i]);
                    const u32 at = (u32)((c + i) * (R + 8) + r);
                    *(u32*)(hi + at) = pack_h2(h0, h1);
                    if (LO) *(u32*)(lo + at) = pack_h2(a[i] - h0, bb[i] - h1);
                }
            }
        }
        return;
    }
    for (int e = threadIdx.x; e < R * D; e += TA_THREADS) {
        const int r = e / D, c = e - r * D;
        const float x = (r < n && c < (int)hd) ? ld_f32(src, (u64)r * stride + c) : 0.0f;
        const u32 at = TRANS ? (u32)(c * (R + 8) + r) : (u32)(r * (D + 8) + c);
        const float h = f16_round(x);
        hi[at] = f16_bits(h);
        if (LO) lo[at] = f16_bits(x - h);
    }
}

__device__ __forceinline__ u32 ld_u32(const u16* p) { return *(const u32*)p; }

// c += A B over one k-step with split operands: A = ah (+ al), B read at
// bh (+ bl) as the B fragment's two u32 8 halves apart. The exact form
// (LO) adds the three products hi·hi, hi·lo, lo·hi in that order; BLO =
// false leaves out hi·lo where B is exact in f16 (its lo halves are zero,
// so the sum is the same).
template <bool LO, bool BLO = LO>
__device__ __forceinline__ void mma_split(float (&c)[4], const u32 (&ah)[4], const u32 (&al)[4], const u16* bh,
                                          const u16* bl) {
    const u32 bh0 = ld_u32(bh), bh1 = ld_u32(bh + 8);
    mma_f16(c, ah, bh0, bh1);
    if (BLO) {
        const u32 bl0 = ld_u32(bl), bl1 = ld_u32(bl + 8);
        mma_f16(c, ah, bl0, bl1);
    }
    if (LO) mma_f16(c, al, bh0, bh1);
}

template <int D, bool LO>
__device__ __forceinline__ void attn_tc_body(const Bind& b, const AttnParams& p, u32 kv, u32 rows,
                                             u16* sm) {
    constexpr int LD = D + 8;   // halves per Q / K row
    constexpr int NT = D / 8;   // 8-wide dim tiles of O
    constexpr int KS = D / 16;  // k-steps of S
    u16* qh = sm;
    u16* ql = qh + TA_BQ * LD;
    u16* kh = ql + TA_BQ * LD;
    u16* kl = kh + TA_BK * LD;
    u16* vh = kl + TA_BK * LD;  // [D][TA_LDT]
    u16* vl = vh + D * TA_LDT;
    // An f16 cache's K and V are exact in f16: no lo halves to stage or
    // multiply (one product in three fewer, the same sums).
    constexpr bool KV_LO = LO && !KV_F16;

    const int lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const u32 hd = p.head_dim;
    const FlashBlock fb = flash_block(b, p, kv, rows, TA_BQ, D);
    const int t0 = fb.t0, nq = fb.nq, base_pos = fb.base_pos, pos_hi = fb.pos_hi, key_lo = fb.key_lo;
    const float* __restrict__ Q = fb.Q;
    const kv_t* __restrict__ K = fb.K;
    const kv_t* __restrict__ V = fb.V;
    float* __restrict__ O = fb.O;
    const bool vec = fb.vec;
    ta_stage<D, TA_BQ, false, LO>(qh, ql, Q, p.qkv_stride, nq, hd, vec);

    // This lane's rows (block-local) and their positions; rows past the
    // step's last take its position (finite scores, never written).
    const int r0 = warp * 16 + g, r1 = r0 + 8;
    const int qpos[2] = {min(base_pos + t0 + r0, pos_hi), min(base_pos + t0 + r1, pos_hi)};
    const int qlo[2] = {attn_first_key(qpos[0], p.window), attn_first_key(qpos[1], p.window)};
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[n][e] = 0.0f;

    for (int j0 = key_lo; j0 <= pos_hi; j0 += TA_BK) {
        const int nt = min(TA_BK, pos_hi + 1 - j0);
        __syncthreads();  // the previous tile's K and V are consumed
        ta_stage<D, TA_BK, false, KV_LO>(kh, kl, K + (u64)j0 * hd, hd, nt, hd, vec);
        ta_stage<D, TA_BK, true, KV_LO>(vh, vl, V + (u64)j0 * hd, hd, nt, hd, vec);
        __syncthreads();  // K, V (and Q, the first time) staged

        float s[8][4];
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            const int c = ks * 16 + 2 * t;
            const u32 ah[4] = {ld_u32(qh + r0 * LD + c), ld_u32(qh + r1 * LD + c),
                               ld_u32(qh + r0 * LD + c + 8), ld_u32(qh + r1 * LD + c + 8)};
            u32 al[4] = {0u, 0u, 0u, 0u};
            if (LO) {
                al[0] = ld_u32(ql + r0 * LD + c);
                al[1] = ld_u32(ql + r1 * LD + c);
                al[2] = ld_u32(ql + r0 * LD + c + 8);
                al[3] = ld_u32(ql + r1 * LD + c + 8);
            }
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                const int key = n * 8 + g;
                mma_split<LO, KV_LO>(s[n], ah, al, kh + key * LD + c, kl + key * LD + c);
            }
        }

        // Scale, soft-cap, mask; the online softmax of rows r0 (e = 0, 1)
        // and r1 (e = 2, 3).
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            float mx = NEG_INF;
#pragma unroll
            for (int n = 0; n < 8; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int j = j0 + n * 8 + 2 * t + e;
                    const bool valid = j >= qlo[rr] && j <= qpos[rr];
                    float& x = s[n][2 * rr + e];
                    x = valid ? softcap_score(x * p.scale, p.softcap) : NEG_INF;
                    mx = fmaxf(mx, x);
                }
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
            const float mn = fmaxf(m[rr], mx);
            const float ref = mn == NEG_INF ? 0.0f : mn;
            const float corr = expf(m[rr] - ref);
            m[rr] = mn;
            float rs = 0.0f;
#pragma unroll
            for (int n = 0; n < 8; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float& x = s[n][2 * rr + e];
                    x = expf(x - ref);
                    rs += x;
                }
            l[rr] = l[rr] * corr + rs;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                o[n][2 * rr] *= corr;
                o[n][2 * rr + 1] *= corr;
            }
        }

        // O += P V, 16 keys per k-step: P's A fragments are S's tiles 2kk
        // and 2kk + 1, split into f16 halves.
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            u32 ph[4], pl[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                // q: 0 = (row r0, tile 2kk), 1 = (r1, 2kk), 2 = (r0, 2kk+1), 3 = (r1, 2kk+1)
                const float* x = &s[2 * kk + (q >> 1)][2 * (q & 1)];
                const float h0 = f16_round(x[0]), h1 = f16_round(x[1]);
                ph[q] = pack_h2(h0, h1);
                pl[q] = LO ? pack_h2(x[0] - h0, x[1] - h1) : 0u;
            }
            const int c = kk * 16 + 2 * t;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const int dim = n * 8 + g;
                mma_split<LO, KV_LO>(o[n], ph, pl, vh + dim * TA_LDT + c, vl + dim * TA_LDT + c);
            }
        }
    }

#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        float lt = l[rr];
        lt += __shfl_xor_sync(FULL_MASK, lt, 1);
        lt += __shfl_xor_sync(FULL_MASK, lt, 2);
        const int r = rr ? r1 : r0;
        if (r >= nq) continue;
        const float inv = 1.0f / lt;
        float* __restrict__ op = O + (u64)r * p.out_stride;
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int d = n * 8 + 2 * t + e;
                if (d < (int)hd) op[d] = o[n][2 * rr + e] * inv;
            }
    }
}

// k_attn_tc_<D>: exact (hi + lo operands); k_attn_tc_<D>_f16: operands
// rounded to f16, one product per pair (`--prefill-products f16`).
#define TA_KERNEL(D, NAME, LO)                                                 \
    extern "C" __global__ void __launch_bounds__(TA_THREADS)                   \
    NAME(Bind b, AttnParams p, StepArg a) {                                    \
        AKUNU_PROLOGUE(a);                                                     \
        extern __shared__ float4 ta_smem[];                                    \
        attn_tc_body<D, LO>(b, p, attn_kv_len(p, a), a.rows, (u16*)ta_smem);   \
    }
TA_KERNEL(64, k_attn_tc_64, true)
TA_KERNEL(128, k_attn_tc_128, true)
TA_KERNEL(64, k_attn_tc_64_f16, false)
TA_KERNEL(128, k_attn_tc_128_f16, false)
