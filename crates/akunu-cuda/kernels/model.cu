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
// 32 for the quantized types: the table validated it).
__device__ __forceinline__ u64 row_bytes_of(u32 dt, u32 k) {
    switch (dt) {
    case DT_F32: return (u64)k * 4;
    case DT_Q4_0: return (u64)(k >> 5) * 18;
    case DT_Q4_1: return (u64)(k >> 5) * 20;
    case DT_Q8_0: return (u64)(k >> 5) * 34;
    default: return (u64)k * 2;  // F16, BF16
    }
}

// Element `e` of a row of type `dt`, dequantized (GGML block layouts).
__device__ __forceinline__ float load_elem(u32 dt, const u8* __restrict__ row, u32 e) {
    switch (dt) {
    case DT_F32: return ((const float*)row)[e];
    case DT_F16: return f16_to_f32(ld_u16(row + 2 * (u64)e));
    case DT_BF16: return bf16_to_f32(ld_u16(row + 2 * (u64)e));
    case DT_Q8_0: {
        const u8* blk = row + (u64)(e >> 5) * 34;
        return f16_to_f32(ld_u16(blk)) * (float)(i8)blk[2 + (e & 31)];
    }
    case DT_Q4_0: {
        const u8* blk = row + (u64)(e >> 5) * 18;
        u32 j = e & 31;
        u32 q = blk[2 + (j & 15)];
        int nib = (int)(j < 16 ? (q & 15) : (q >> 4));
        return f16_to_f32(ld_u16(blk)) * (float)(nib - 8);
    }
    default: {  // Q4_1
        const u8* blk = row + (u64)(e >> 5) * 20;
        u32 j = e & 31;
        u32 q = blk[4 + (j & 15)];
        u32 nib = j < 16 ? (q & 15) : (q >> 4);
        return f16_to_f32(ld_u16(blk)) * (float)nib + f16_to_f32(ld_u16(blk + 2));
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

// Element j of the product's input row `xr` (k wide, or [gate | up] of
// width 2k with a gated activation).
__device__ __forceinline__ float gemv_input(const float* __restrict__ xr, u32 j, u32 k, u32 act) {
    if (act == ACT_SWIGLU) return silu(xr[j]) * xr[k + j];
    if (act == ACT_GEGLU) return gelu_tanh(xr[j]) * xr[k + j];
    return xr[j];
}

__device__ __forceinline__ u32 gemv_total_rows(const GemvParams& p) {
    u32 t = p.n[0];
    if (p.n_seg > 1) t += p.n[1];
    if (p.n_seg > 2) t += p.n[2];
    return t;
}

// Output row `o` of a product, resolved to its weight segment.
struct SegRow {
    const u8* w;        // start of the weight row
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
    u32 local = o - off;
    g.dt = pick3(p.dtype, s);
    g.w = (const u8*)bind_at(b, 2 + s) + (u64)local * row_bytes_of(g.dt, p.k);
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
    const u8* __restrict__ row = (const u8*)b.p[1] + (u64)id * row_bytes_of(p.dtype, p.dim);
    float* __restrict__ out = (float*)b.p[2] + (u64)r * p.dim;
    for (u32 e = threadIdx.x; e < p.dim; e += blockDim.x)
        out[e] = load_elem(p.dtype, row, e) * p.scale;
}

// ---------------------------------------------------------------------------
// RMSNorm
// ---------------------------------------------------------------------------

// 1 / sqrt(mean(x^2) + eps), finished in f64 like the CPU.
__device__ __forceinline__ float rms_inv(float ss, u32 dim, float eps) {
    return (float)(1.0 / sqrt((double)ss / (double)dim + (double)eps));
}

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
// grid.x = ceil(total_rows / 8), block 256 = 8 warps, dynamic shared memory
// rows * k * 4 bytes. The block first stages its input rows (activation
// applied) in shared memory; then warp w computes output row
// blockIdx.x * 8 + w for every input row, streaming its weight row once.
//
// Quantized rows: four lanes share a 32-element block, each dequantizing 8
// of its elements, so a warp covers 8 consecutive blocks per step. Lanes of
// odd blocks read their two float4s of x in the opposite order, which makes
// every quarter-warp's shared-memory access conflict-free (quant blocks are
// only 2-byte aligned, so their bytes are read with 16-bit loads). Plain
// rows: lanes take consecutive runs of 8 (F16/BF16, 16-byte loads) or 4
// (F32 16-byte, F16 8-byte loads) elements when the row is aligned, single
// elements otherwise. Each warp prefetches its weight row into L2 before
// the staging barrier so the two overlap.
// Per-row accumulators live in registers (unrolled over at most 4 rows).
// ---------------------------------------------------------------------------

#define GEMV_MAX_ROWS 4

__device__ __forceinline__ float dot4(float4 a, float w0, float w1, float w2, float w3) {
    return a.x * w0 + a.y * w1 + a.z * w2 + a.w * w3;
}

__device__ __forceinline__ void gemv_q8_0(const u8* __restrict__ w, const float* __restrict__ xs,
                                          u32 k, u32 rows, u32 lane, float (&acc)[GEMV_MAX_ROWS]) {
    const u32 nb = k >> 5, s = lane & 3, par = (lane >> 2) & 1;
#pragma unroll 2
    for (u32 blk = lane >> 2; blk < nb; blk += 8) {
        const u8* q = w + (u64)blk * 34;
        const float d = f16_to_f32(ld_u16(q));
        const u8* qs = q + 2 + 8 * s;
        const u32 h0 = ld_u16(qs), h1 = ld_u16(qs + 2), h2 = ld_u16(qs + 4), h3 = ld_u16(qs + 6);
        const float w0 = (float)(i8)(h0 & 0xff), w1 = (float)(i8)(h0 >> 8);
        const float w2 = (float)(i8)(h1 & 0xff), w3 = (float)(i8)(h1 >> 8);
        const float w4 = (float)(i8)(h2 & 0xff), w5 = (float)(i8)(h2 >> 8);
        const float w6 = (float)(i8)(h3 & 0xff), w7 = (float)(i8)(h3 >> 8);
        const float* xb = xs + blk * 32 + 8 * s;
#pragma unroll
        for (u32 r = 0; r < GEMV_MAX_ROWS; ++r) {
            if (r < rows) {
                const float4 u = *(const float4*)(xb + r * k + 4 * par);
                const float4 v = *(const float4*)(xb + r * k + 4 * (1 - par));
                const float4 lo = par ? v : u, hi = par ? u : v;
                acc[r] += d * (dot4(lo, w0, w1, w2, w3) + dot4(hi, w4, w5, w6, w7));
            }
        }
    }
}

// Q4_0 and Q4_1: lane s of a block takes quant bytes 4s..4s+3, i.e.
// elements 4s..4s+3 (low nibbles) and 16+4s..16+4s+3 (high nibbles).
template <bool Q41>
__device__ __forceinline__ void gemv_q4(const u8* __restrict__ w, const float* __restrict__ xs,
                                        u32 k, u32 rows, u32 lane, float (&acc)[GEMV_MAX_ROWS]) {
    const u32 nb = k >> 5, s = lane & 3, par = (lane >> 2) & 1;
    const u32 bsz = Q41 ? 20 : 18, qoff = Q41 ? 4 : 2;
    const float sub = Q41 ? 0.0f : 8.0f;
#pragma unroll 2
    for (u32 blk = lane >> 2; blk < nb; blk += 8) {
        const u8* q = w + (u64)blk * bsz;
        const float d = f16_to_f32(ld_u16(q));
        const float m = Q41 ? f16_to_f32(ld_u16(q + 2)) : 0.0f;
        const u8* qs = q + qoff + 4 * s;
        const u32 h0 = ld_u16(qs), h1 = ld_u16(qs + 2);
        const float l0 = (float)(h0 & 15) - sub, l1 = (float)((h0 >> 8) & 15) - sub;
        const float l2 = (float)(h1 & 15) - sub, l3 = (float)((h1 >> 8) & 15) - sub;
        const float g0 = (float)((h0 >> 4) & 15) - sub, g1 = (float)(h0 >> 12) - sub;
        const float g2 = (float)((h1 >> 4) & 15) - sub, g3 = (float)(h1 >> 12) - sub;
        const float* xb = xs + blk * 32 + 4 * s;
#pragma unroll
        for (u32 r = 0; r < GEMV_MAX_ROWS; ++r) {
            if (r < rows) {
                const float4 u = *(const float4*)(xb + r * k + 16 * par);
                const float4 v = *(const float4*)(xb + r * k + 16 * (1 - par));
                const float4 lo = par ? v : u, hi = par ? u : v;
                const float dotq = dot4(lo, l0, l1, l2, l3) + dot4(hi, g0, g1, g2, g3);
                if (Q41) {
                    const float sx = (lo.x + lo.y + lo.z + lo.w) + (hi.x + hi.y + hi.z + hi.w);
                    acc[r] += d * dotq + m * sx;
                } else {
                    acc[r] += d * dotq;
                }
            }
        }
    }
}

__device__ __forceinline__ float half_to_f32(u32 h, bool bf) {
    return bf ? bf16_to_f32((u16)h) : f16_to_f32((u16)h);
}

template <bool BF>
__device__ __forceinline__ void gemv_f16(const u8* __restrict__ w, const float* __restrict__ xs,
                                         u32 k, u32 rows, u32 lane, float (&acc)[GEMV_MAX_ROWS]) {
    if ((k & 7) == 0 && ((u64)w & 15) == 0) {
        // 8 elements per lane; lanes (lane >> 2) odd read their two float4s
        // of x in the opposite order (conflict-free quarter-warps).
        const uint4* __restrict__ w16 = (const uint4*)w;
        const u32 par = (lane >> 2) & 1;
#pragma unroll 2
        for (u32 e = lane * 8; e < k; e += 256) {
            const uint4 v = w16[e >> 3];
            const float w0 = half_to_f32(v.x & 0xffff, BF), w1 = half_to_f32(v.x >> 16, BF);
            const float w2 = half_to_f32(v.y & 0xffff, BF), w3 = half_to_f32(v.y >> 16, BF);
            const float w4 = half_to_f32(v.z & 0xffff, BF), w5 = half_to_f32(v.z >> 16, BF);
            const float w6 = half_to_f32(v.w & 0xffff, BF), w7 = half_to_f32(v.w >> 16, BF);
#pragma unroll
            for (u32 r = 0; r < GEMV_MAX_ROWS; ++r) {
                if (r < rows) {
                    const float4 u = *(const float4*)(xs + r * k + e + 4 * par);
                    const float4 t = *(const float4*)(xs + r * k + e + 4 * (1 - par));
                    const float4 lo = par ? t : u, hi = par ? u : t;
                    acc[r] += dot4(lo, w0, w1, w2, w3) + dot4(hi, w4, w5, w6, w7);
                }
            }
        }
    } else if ((k & 3) == 0 && ((u64)w & 7) == 0) {
        const uint2* __restrict__ w8 = (const uint2*)w;
#pragma unroll 2
        for (u32 e = lane * 4; e < k; e += 128) {
            const uint2 v = w8[e >> 2];
            const float w0 = half_to_f32(v.x & 0xffff, BF), w1 = half_to_f32(v.x >> 16, BF);
            const float w2 = half_to_f32(v.y & 0xffff, BF), w3 = half_to_f32(v.y >> 16, BF);
#pragma unroll
            for (u32 r = 0; r < GEMV_MAX_ROWS; ++r)
                if (r < rows) acc[r] += dot4(*(const float4*)(xs + r * k + e), w0, w1, w2, w3);
        }
    } else {
        for (u32 e = lane; e < k; e += 32) {
            const float wv = half_to_f32(ld_u16(w + 2 * (u64)e), BF);
#pragma unroll
            for (u32 r = 0; r < GEMV_MAX_ROWS; ++r)
                if (r < rows) acc[r] += wv * xs[r * k + e];
        }
    }
}

__device__ __forceinline__ void gemv_f32(const u8* __restrict__ w, const float* __restrict__ xs,
                                         u32 k, u32 rows, u32 lane, float (&acc)[GEMV_MAX_ROWS]) {
    const float* __restrict__ wf = (const float*)w;
    if ((k & 3) == 0 && ((u64)w & 15) == 0) {
#pragma unroll 2
        for (u32 e = lane * 4; e < k; e += 128) {
            const float4 v = *(const float4*)(wf + e);
#pragma unroll
            for (u32 r = 0; r < GEMV_MAX_ROWS; ++r)
                if (r < rows) acc[r] += dot4(*(const float4*)(xs + r * k + e), v.x, v.y, v.z, v.w);
        }
    } else {
        for (u32 e = lane; e < k; e += 32) {
            const float wv = wf[e];
#pragma unroll
            for (u32 r = 0; r < GEMV_MAX_ROWS; ++r)
                if (r < rows) acc[r] += wv * xs[r * k + e];
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
k_gemv(Bind b, GemvParams p, StepArg a) {
    AKUNU_PROLOGUE(a);
    extern __shared__ float4 gemv_smem[];
    float* xs = (float*)gemv_smem;
    const u32 k = p.k;
    const u32 rows = a.rows < GEMV_MAX_ROWS ? a.rows : GEMV_MAX_ROWS;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    const u32 total = gemv_total_rows(p);
    const u32 o = blockIdx.x * 8 + warp;
    const bool have_row = o < total;
    const SegRow g = seg_row(b, p, have_row ? o : total - 1);
    if (have_row) {
        // Start pulling this warp's weight row into L2 while the block
        // stages the input: the row is read exactly once, right after.
        const u64 rb = row_bytes_of(g.dt, k);
        for (u64 off = (u64)lane * 128; off < rb; off += 32 * 128)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(g.w + off));
    }

    // Stage the input rows, activation applied (float4 loads when every
    // row start is 16-byte aligned).
    const float* __restrict__ x = (const float*)b.p[0];
    const bool vec = (k & 3) == 0 && (p.x_stride & 3) == 0 && ((u64)x & 15) == 0;
    for (u32 r = 0; r < rows; ++r) {
        const float* xr = x + (u64)r * p.x_stride;
        float* dst = xs + r * k;
        if (vec) {
            for (u32 j = threadIdx.x * 4; j < k; j += blockDim.x * 4) {
                float4 v = *(const float4*)(xr + j);
                if (p.input_act != ACT_NONE) {
                    const float4 u = *(const float4*)(xr + k + j);
                    const bool ge = p.input_act == ACT_GEGLU;
                    v.x = (ge ? gelu_tanh(v.x) : silu(v.x)) * u.x;
                    v.y = (ge ? gelu_tanh(v.y) : silu(v.y)) * u.y;
                    v.z = (ge ? gelu_tanh(v.z) : silu(v.z)) * u.z;
                    v.w = (ge ? gelu_tanh(v.w) : silu(v.w)) * u.w;
                }
                *(float4*)(dst + j) = v;
            }
        } else {
            for (u32 j = threadIdx.x; j < k; j += blockDim.x)
                dst[j] = gemv_input(xr, j, k, p.input_act);
        }
    }
    __syncthreads();
    if (!have_row) return;

    float acc[GEMV_MAX_ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
    switch (g.dt) {
    case DT_Q8_0: gemv_q8_0(g.w, xs, k, rows, lane, acc); break;
    case DT_Q4_0: gemv_q4<false>(g.w, xs, k, rows, lane, acc); break;
    case DT_Q4_1: gemv_q4<true>(g.w, xs, k, rows, lane, acc); break;
    case DT_F16: gemv_f16<false>(g.w, xs, k, rows, lane, acc); break;
    case DT_BF16: gemv_f16<true>(g.w, xs, k, rows, lane, acc); break;
    default: gemv_f32(g.w, xs, k, rows, lane, acc); break;
    }

    const float bias = g.bias ? *g.bias : 0.0f;
    float* __restrict__ out = (float*)b.p[1] + o;
#pragma unroll
    for (u32 r = 0; r < GEMV_MAX_ROWS; ++r) {
        if (r < rows) {
            const float v = softcap_score(warp_sum(acc[r]) + bias, p.softcap);
            if (lane == 0) {
                float* dst = out + (u64)r * p.out_stride;
                *dst = p.accumulate ? *dst + v : v;
            }
        }
    }
}

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
__device__ __forceinline__ void gemm_load_w(const u8* __restrict__ w, u32 dt, u32 k, u32 k0,
                                            u32 part, float (&v)[8]) {
    if (dt == DT_Q8_0) {
        const u8* q = w + (u64)(k0 >> 5) * 34;
        const float d = f16_to_f32(ld_u16(q));
        const u8* qs = q + 2 + 8 * part;
#pragma unroll
        for (u32 i = 0; i < 4; ++i) {
            const u32 h = ld_u16(qs + 2 * i);
            v[2 * i] = d * (float)(i8)(h & 0xff);
            v[2 * i + 1] = d * (float)(i8)(h >> 8);
        }
    } else if (dt == DT_Q4_0 || dt == DT_Q4_1) {
        const bool q41 = dt == DT_Q4_1;
        const u8* q = w + (u64)(k0 >> 5) * (q41 ? 20 : 18);
        const float d = f16_to_f32(ld_u16(q));
        const float m = q41 ? f16_to_f32(ld_u16(q + 2)) : 0.0f;
        const float sub = q41 ? 0.0f : 8.0f;
        // Elements 0..15 are the low nibbles of bytes 0..15, 16..31 the high.
        const u8* qs = q + (q41 ? 4 : 2) + 8 * (part & 1);
        const u32 shift = (part >> 1) * 4;
#pragma unroll
        for (u32 i = 0; i < 4; ++i) {
            const u32 h = ld_u16(qs + 2 * i);
            v[2 * i] = d * ((float)((h >> shift) & 15) - sub) + m;
            v[2 * i + 1] = d * ((float)((h >> (8 + shift)) & 15) - sub) + m;
        }
    } else {
#pragma unroll
        for (u32 i = 0; i < 8; ++i) {
            const u32 e = k0 + 8 * part + i;
            float f = 0.0f;
            if (e < k) {
                if (dt == DT_F32) f = ((const float*)w)[e];
                else f = half_to_f32(ld_u16(w + 2 * (u64)e), dt == DT_BF16);
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
    g.w = nullptr;
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
            gemm_load_w(g.w, g.dt, k, k0, part, wv);
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
// RoPE + KV-cache write
//
// grid = (rows, n_heads + n_kv_heads), block 64. Block (r, y) rotates head y
// of QKV row r in place (Q heads then K heads, which are contiguous in the
// row); a K block also writes its rotated K head and the matching V head
// into the caches at position pos + r. Each thread writes the pairs it
// rotated itself, so no barrier is needed. The angle is computed in f64 as
// the CPU does; sincospi avoids the slow-path argument reduction of sin/cos.
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(64)
k_rope_kv_write(Bind b, RopeParams p, StepArg a) {
    AKUNU_PROLOGUE(a);
    Step st = step_of(a);
    const u32 pos = (a.patch == PATCH_POSITION ? st.pos : p.pos) + blockIdx.x;
    const u32 hd = p.head_dim, half = p.rope_dim >> 1, y = blockIdx.y;
    float* __restrict__ row = (float*)b.p[0] + (u64)blockIdx.x * p.qkv_stride;
    float* __restrict__ x = row + (u64)y * hd;
    const bool is_k = y >= p.n_heads;
    const u32 j = is_k ? y - p.n_heads : 0;  // kv head (K blocks only)
    float* __restrict__ kdst = (float*)b.p[1] + ((u64)j * p.capacity + pos) * hd;
    const float* __restrict__ ff = (const float*)b.p[3];
    const double ppos = (double)pos * (double)p.freq_scale;
    const bool neox = p.style == ROPE_NEOX;

    if (p.qk_norm) {
        // Per-head RMSNorm (Qwen3, Gemma 3) before the rotation: the Q-norm
        // and K-norm weights follow the optional frequency factors.
        __shared__ float red[32];
        const float* __restrict__ nw =
            (const float*)bind_at(b, 3 + (p.freq_factors ? 1u : 0u) + (is_k ? 1u : 0u));
        float ss = 0.0f;
        for (u32 d = threadIdx.x; d < hd; d += blockDim.x) ss += x[d] * x[d];
        // block_sum's barriers also order every read above before the
        // writes below.
        const float sc = rms_inv(block_sum(ss, red), hd, p.norm_eps);
        for (u32 d = threadIdx.x; d < hd; d += blockDim.x) x[d] = x[d] * sc * nw[d];
        __syncthreads();
    }

    for (u32 i = threadIdx.x; i < half; i += blockDim.x) {
        double inv = pow((double)p.theta, -2.0 * (double)i / (double)p.rope_dim);
        if (p.freq_factors) inv /= (double)ff[i];
        double sn, cs;
        sincospi(ppos * inv * 0.318309886183790671538, &sn, &cs);  // angle / pi
        const float c = (float)cs, s = (float)sn;
        const u32 ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
        const float x0 = x[ia], x1 = x[ib];
        const float y0 = x0 * c - x1 * s, y1 = x0 * s + x1 * c;
        x[ia] = y0;
        x[ib] = y1;
        if (is_k) {
            kdst[ia] = y0;
            kdst[ib] = y1;
        }
    }
    if (is_k) {
        for (u32 d = p.rope_dim + threadIdx.x; d < hd; d += blockDim.x) kdst[d] = x[d];
        const float* __restrict__ v = row + (u64)(p.n_heads + p.n_kv_heads + j) * hd;
        float* __restrict__ vdst = (float*)b.p[2] + ((u64)j * p.capacity + pos) * hd;
        for (u32 d = threadIdx.x; d < hd; d += blockDim.x) vdst[d] = v[d];
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

// Decode split: each warp runs its own online softmax over keys taken
// DEC_KEYS at a time (lanes over head dims, NI dims per lane; the DEC_KEYS
// dot products are reduced together for ILP); the 4 warps are merged
// through shared memory and the split's (m, l, acc) written to `part`.
template <int NI>
__device__ __forceinline__ void attn_decode_body(const Bind& b, const AttnParams& p, u32 kv,
                                                 float* __restrict__ part, u32 n_split,
                                                 float* sm_m, float* sm_l, float* sm_acc) {
    const u32 h = blockIdx.x, sp = blockIdx.y, hd = p.head_dim;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 g = h / (p.n_heads / p.n_kv_heads);
    const int pos = (int)kv - 1;
    const int chunk = (int)((kv + n_split - 1) / n_split);
    int j0 = (int)sp * chunk;
    const int j1 = min(j0 + chunk, (int)kv);
    j0 = max(j0, attn_first_key(pos, p.window));

    const float* __restrict__ qp = (const float*)b.p[0] + (u64)h * hd;
    const float* __restrict__ K = (const float*)b.p[1] + (u64)g * p.capacity * hd;
    const float* __restrict__ V = (const float*)b.p[2] + (u64)g * p.capacity * hd;
    float q[NI], acc[NI];
#pragma unroll
    for (int i = 0; i < NI; ++i) {
        const u32 d = lane + 32 * i;
        q[i] = d < hd ? qp[d] : 0.0f;
        acc[i] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;

    for (int base = j0 + (int)warp * DEC_KEYS; base < j1; base += DEC_WARPS * DEC_KEYS) {
        float sc[DEC_KEYS];
#pragma unroll
        for (int t = 0; t < DEC_KEYS; ++t) {
            const int j = base + t;
            float s = 0.0f;
            if (j < j1) {
                const float* kr = K + (u64)j * hd;
#pragma unroll
                for (int i = 0; i < NI; ++i) {
                    const u32 d = lane + 32 * i;
                    if (d < hd) s += q[i] * kr[d];
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
                const float* vr = V + (u64)j * hd;
#pragma unroll
                for (int i = 0; i < NI; ++i) {
                    const u32 d = lane + 32 * i;
                    if (d < hd) acc[i] += pk * vr[d];
                }
            }
        }
        m = mn;
    }

    // Merge the warps' partial softmaxes.
#pragma unroll
    for (int i = 0; i < NI; ++i) {
        const u32 d = lane + 32 * i;
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

// Split-KV decode attention (one query row). grid = (n_heads, n_split),
// block 128. Split s covers keys [s*chunk, min((s+1)*chunk, kv_len)),
// chunk = ceil(kv_len / n_split), clipped to the window; it writes
// part[(h*n_split + s)*(head_dim+2) + {0: m, 1: l, 2+d: acc[d]}] (an empty
// range writes m = -inf, l = 0, acc = 0). k_attn_combine merges the splits.
extern "C" __global__ void __launch_bounds__(128)
k_attn_decode(Bind b, AttnParams p, StepArg a, float* part, u32 n_split) {
    AKUNU_PROLOGUE(a);
    __shared__ float sm_m[DEC_WARPS], sm_l[DEC_WARPS];
    __shared__ float sm_acc[DEC_WARPS * 256];
    const u32 kv = attn_kv_len(p, a);
    if (p.head_dim <= 64)
        attn_decode_body<2>(b, p, kv, part, n_split, sm_m, sm_l, sm_acc);
    else if (p.head_dim <= 128)
        attn_decode_body<4>(b, p, kv, part, n_split, sm_m, sm_l, sm_acc);
    else
        attn_decode_body<8>(b, p, kv, part, n_split, sm_m, sm_l, sm_acc);
}

// Merges the decode splits of head blockIdx.x: M = max m_s,
// L = sum l_s e^(m_s - M), out[d] = sum acc_s[d] e^(m_s - M) / L, written to
// row 0 of the output. grid = n_heads, block 128 (threads over head dims).
extern "C" __global__ void __launch_bounds__(128)
k_attn_combine(Bind b, AttnParams p, StepArg a, float* part, u32 n_split) {
    AKUNU_PROLOGUE(a);
    const u32 h = blockIdx.x, hd = p.head_dim, stride = hd + 2;
    const float* __restrict__ ph = part + (u64)h * n_split * stride;
    float M = NEG_INF;
    for (u32 s = 0; s < n_split; ++s)
        if (ph[s * stride + 1] > 0.0f) M = fmaxf(M, ph[s * stride]);
    float L = 0.0f;
    for (u32 s = 0; s < n_split; ++s) {
        const float ls = ph[s * stride + 1];
        if (ls > 0.0f) L += ls * expf(ph[s * stride] - M);
    }
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
    float* __restrict__ out = (float*)b.p[3] + (u64)h * hd;
    for (u32 d = threadIdx.x; d < hd; d += blockDim.x) {
        float v = 0.0f;
        for (u32 s = 0; s < n_split; ++s) {
            const float ls = ph[s * stride + 1];
            if (ls > 0.0f) v += ph[s * stride + 2 + d] * expf(ph[s * stride] - M);
        }
        out[d] = v * inv;
    }
}

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
    const float* __restrict__ K = (const float*)b.p[1] + (u64)g * p.capacity * hd;
    const float* __restrict__ V = (const float*)b.p[2] + (u64)g * p.capacity * hd;
    // Tiles are copied with float4s when the cache rows are 16-byte aligned.
    const bool vec4 = vec && (((u64)K | (u64)V) & 15) == 0;

    float acc[NI];
#pragma unroll
    for (int i = 0; i < NI; ++i) acc[i] = 0.0f;
    float m = NEG_INF, l = 0.0f;

    for (int j0 = block_lo; j0 <= pos_hi; j0 += tk) {
        const int nt = min(tk, pos_hi + 1 - j0);
        __syncthreads();  // previous tile consumed (and q staged, first time)
        const float* kt = K + (u64)j0 * hd;
        const float* vt = V + (u64)j0 * hd;
        if (vec4) {
            const u32 hd4 = hd >> 2, n4 = (u32)nt * hd4;
            for (u32 e = threadIdx.x; e < n4; e += blockDim.x) {
                const u32 jj = e / hd4, d = (e - jj * hd4) * 4;
                *(float4*)(ks + jj * ld + d) = ((const float4*)kt)[e];
                *(float4*)(vs + jj * ld + d) = ((const float4*)vt)[e];
            }
        } else {
            const u32 n_el = (u32)nt * hd;
            for (u32 e = threadIdx.x; e < n_el; e += blockDim.x) {
                const u32 jj = e / hd, d = e - jj * hd;
                ks[jj * ld + d] = kt[e];
                vs[jj * ld + d] = vt[e];
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
