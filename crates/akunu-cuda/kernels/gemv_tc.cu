// akunu tensor-core GEMV: decode steps (one input row) and speculative
// verification steps (2..8 rows) against F16, Q8_0, Q4_0 and Q4_1 weights.
// Uses model.cu's helpers (seg_row, mma_f16, pack_h2, ...), which precede
// it in the translation unit.
//
// Why: the f32 gemv (model.cu) spends three or four instructions per weight
// on dequantization and FMAs and spills at its 80 registers, so it runs out
// of issue slots and warps long before DRAM is busy (Nsight Compute: 16-30%
// of DRAM bandwidth on an 8B-shaped Q4_0 model, warps stalled on memory).
// Here a tensor-core product does the multiply-adds and the weights become
// f16 operands with two or three bit operations per pair.
//
// Fragments (mma.sync m16n8k16, f16 operands, f32 accumulators). Each warp
// computes a tile of 16 output rows. Lane (g, t) = (lane / 4, lane % 4)
// holds rows g and g + 8 of A and its k-slots 2t, 2t+1, 2t+8, 2t+9 of every
// product. The k order is ours to choose (a product sums over k), so lane t
// of each row takes a whole "lane-block" of that row: one quantized block
// (32 elements, one scale) or 16 F16 elements, and four lane-blocks (lanes
// t = 0..3) make a "group" of 8 products (4 for F16).
//
// The scale differs per block, so the four blocks of a group must not be
// summed before scaling. B has 8 columns: column 2t holds the hi half of
// the input on lane-block t's k-slots and zeros elsewhere, column 2t + 1 the
// lo half (x = hi + lo, both f16: about 22 bits of x, as in k_gemm_tc).
// Accumulator registers c0, c1 (c2, c3) of lane (g, t) are then row g's
// (row g + 8's) hi and lo partial products over block t alone: the lane
// scales them, acc += d * (c0 + c1) (+ m * sum(x) over the block for Q4_1),
// and goes on. Weights enter the products as exact small integers (q - 8,
// q) or as the F16 values they are, so the result is the f32 product to
// within f32 accumulation error.
//
// Dequantization to f16 pairs: a nibble or a byte OR-ed into the mantissa
// of 1024.0 (0x6400) is 1024 + v exactly; one f16x2 subtraction (or a
// multiply-add for high nibbles, which land as 1024 + 16 v) leaves v.
//
// The staged input is an image of B fragments: for each group and each of
// the 8 lanes that feed B (lane (g, t) with g / 2 == t: block t, hi for
// even g, lo for odd g), the 16 (8 for F16) u32 that lane passes to the
// group's products, laid out so that its 16-byte reads are conflict-free.
// The other 24 lanes pass zeros.
//
// Work: warps of a block share out 8 / S row tiles and split each tile's
// groups S ways (groups s, s + S, ...); split partials are added in a fixed
// order through shared memory, so a result never depends on timing. With R
// input rows, a lane dequantizes a group once and runs its products against
// each row's B in turn: each row's arithmetic is exactly a one-row step's,
// as lossless speculative verification needs.
//
// Weights go straight from global memory into registers, each warp keeping
// its next groups' loads in flight (a rotating register pipeline). A ring
// of cp.async copies through shared memory was tried first: it left the
// registers free but doubled the shared-memory traffic, and decode ran
// slower on every shape (bench/RESULTS.md). The first tile's weights are
// requested before the kernel waits on the previous one (programmatic
// dependent launch): they are constants (held in registers across the
// staging: prefetching them into L2 instead, to free those registers, measured
// 8-17% slower).

#define TCG_WARPS 8

template <int DT> struct TcgT;
// LB: elements per lane-block; QB: its bytes of quants (per row);
// SB: bytes of scale per block (d, or d and m); MMAS: products per group.
template <> struct TcgT<DT_Q4_0> { static constexpr u32 LB = 32, QB = 16, SB = 2, MMAS = 8; };
template <> struct TcgT<DT_Q4_1> { static constexpr u32 LB = 32, QB = 16, SB = 4, MMAS = 8; };
template <> struct TcgT<DT_Q8_0> { static constexpr u32 LB = 32, QB = 32, SB = 2, MMAS = 8; };
template <> struct TcgT<DT_F16> { static constexpr u32 LB = 16, QB = 32, SB = 0, MMAS = 4; };

// u32 of B image per group and input row.
template <int DT> __device__ __forceinline__ constexpr u32 tcg_img_u32() {
    return 16 * TcgT<DT>::MMAS;
}

// hsub2_u, hfma2_u and tcg_q4_pairs (a Q4 word as f16 pairs): tc.cuh.

// The 4 weights of word `w` (bytes 4i..4i+3 of a Q8_0 block) as f16 pairs:
// p02 = elements (4i, 4i+2), p13 = (4i+1, 4i+3).
__device__ __forceinline__ void tcg_q8_pairs(u32 w, u32& p02, u32& p13) {
    const u32 u = w ^ 0x80808080u;  // q + 128 per byte
    p02 = hsub2_u(__byte_perm(u, 0x64646464u, 0x4240), 0x64806480u);  // 1024 + q + 128 - 1152
    p13 = hsub2_u(__byte_perm(u, 0x64646464u, 0x4341), 0x64806480u);
}

// One group's weights for one lane: its lane-block of rows g and g + 8,
// and their scales (f16 d for Q4_0/Q8_0, d | m << 16 for Q4_1).
template <int DT> struct TcgW {
    uint4 q[2][TcgT<DT>::QB / 16];
    u32 sc[2];
};

// A weight load of the 4-bit products asks L2 for the 128 bytes around it
// (the `.L2::128B` prefetch-size hint): a warp reads 64 contiguous bytes of
// each of its 16 rows per group, and the hint lets DRAM serve the row's
// next group in the same burst. Probe (bench/RESULTS.md, session 12): 8B
// gate_up 24.5 -> 23.1 us, logits 38.4 -> 36.8; 256 bytes measured the
// same on Q4_0 and slower on F16. `-DTCG_L2PF=0` drops the hint.
#ifndef TCG_L2PF
#define TCG_L2PF 128
#endif
template <int DT>
__device__ __forceinline__ uint4 tcg_ldw(const uint4* p) {
    if constexpr (TCG_L2PF == 128 && (DT == DT_Q4_0 || DT == DT_Q4_1)) {
        uint4 v;
        asm("ld.global.nc.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
            : "l"(p));
        return v;
    }
    return *p;
}

// Loads group `grp` of rows w0 (row g) and w1 (row g + 8) into registers;
// lane-blocks past the row read as zeros.
template <int DT>
__device__ __forceinline__ void tcg_load(TcgW<DT>& W, WRow w0, WRow w1, u32 grp, u32 n_lb, u32 t) {
    using T = TcgT<DT>;
    const u32 lb = grp * 4 + t;
    if (lb < n_lb) {
        const uint4* a = (const uint4*)(w0.w + (u64)lb * T::QB);
        const uint4* c = (const uint4*)(w1.w + (u64)lb * T::QB);
#pragma unroll
        for (u32 i = 0; i < T::QB / 16; ++i) {
            W.q[0][i] = tcg_ldw<DT>(a + i);
            W.q[1][i] = tcg_ldw<DT>(c + i);
        }
        if constexpr (T::SB == 2) {
            W.sc[0] = ld_u16(w0.sc + 2 * (u64)lb);
            W.sc[1] = ld_u16(w1.sc + 2 * (u64)lb);
        } else if constexpr (T::SB == 4) {
            W.sc[0] = *(const u32*)(w0.sc + 4 * (u64)lb);
            W.sc[1] = *(const u32*)(w1.sc + 4 * (u64)lb);
        }
    } else {
#pragma unroll
        for (u32 i = 0; i < T::QB / 16; ++i) W.q[0][i] = W.q[1][i] = make_uint4(0, 0, 0, 0);
        W.sc[0] = W.sc[1] = 0;
    }
}

// Word i (0..) of a lane-block's registers.
template <u32 N> __device__ __forceinline__ u32 tcg_word(const uint4 (&v)[N], u32 i) {
    const uint4 x = v[i >> 2];
    switch (i & 3) {
    case 0: return x.x;
    case 1: return x.y;
    case 2: return x.z;
    default: return x.w;
    }
}

// The A fragments of products 2q and 2q + 1 of a group.
template <int DT>
__device__ __forceinline__ void tcg_a_pair(const TcgW<DT>& W, u32 q, u32 (&a0)[4], u32 (&a1)[4]) {
    if constexpr (DT == DT_Q4_0 || DT == DT_Q4_1) {
        // Word q of the block feeds product 2q (low nibbles), 2q + 1 (high).
        u32 l0a, l1a, h0a, h1a, l0b, l1b, h0b, h1b;
        tcg_q4_pairs<DT == DT_Q4_1>(tcg_word(W.q[0], q), l0a, l1a, h0a, h1a);
        tcg_q4_pairs<DT == DT_Q4_1>(tcg_word(W.q[1], q), l0b, l1b, h0b, h1b);
        a0[0] = l0a;  // row g, slots 2t, 2t+1
        a0[1] = l0b;  // row g + 8
        a0[2] = l1a;  // row g, slots 2t+8, 2t+9
        a0[3] = l1b;
        a1[0] = h0a;
        a1[1] = h0b;
        a1[2] = h1a;
        a1[3] = h1b;
    } else if constexpr (DT == DT_Q8_0) {
        // Word i feeds product i.
        tcg_q8_pairs(tcg_word(W.q[0], 2 * q), a0[0], a0[2]);
        tcg_q8_pairs(tcg_word(W.q[1], 2 * q), a0[1], a0[3]);
        tcg_q8_pairs(tcg_word(W.q[0], 2 * q + 1), a1[0], a1[2]);
        tcg_q8_pairs(tcg_word(W.q[1], 2 * q + 1), a1[1], a1[3]);
    } else {
        // F16: word m holds elements (2m, 2m + 1); product i takes words 2i, 2i + 1.
        a0[0] = tcg_word(W.q[0], 4 * q);
        a0[1] = tcg_word(W.q[1], 4 * q);
        a0[2] = tcg_word(W.q[0], 4 * q + 1);
        a0[3] = tcg_word(W.q[1], 4 * q + 1);
        a1[0] = tcg_word(W.q[0], 4 * q + 2);
        a1[1] = tcg_word(W.q[1], 4 * q + 2);
        a1[2] = tcg_word(W.q[0], 4 * q + 3);
        a1[3] = tcg_word(W.q[1], 4 * q + 3);
    }
}

#ifndef TCG_ZB
#define TCG_ZB 1
#endif
// Zeroed shared memory that B reads of non-feeding lanes land on: the
// largest offset read is 8 * (MMAS / 2 - 1) + 1 uint4s.
#define TCG_ZERO_U4 32

// One group's products for every input row, added into acc[row][g or g+8].
template <int DT, int MR>
__device__ __forceinline__ void tcg_group(const TcgW<DT>& W, u32 grp, u32 rows, u32 ng, const u32* img,
                                          const float* bsum, bool feeds, u32 lane8, u32 t,
                                          float (&acc)[MR][2], const uint4* zeros) {
    using T = TcgT<DT>;
    constexpr u32 MMAS = T::MMAS, IMG = tcg_img_u32<DT>();
    float d0 = 1.0f, d1 = 1.0f, m0 = 0.0f, m1 = 0.0f;
    if constexpr (T::SB != 0) {
        d0 = f16_to_f32((u16)(W.sc[0] & 0xffff));
        d1 = f16_to_f32((u16)(W.sc[1] & 0xffff));
        m0 = f16_to_f32((u16)(W.sc[0] >> 16));
        m1 = f16_to_f32((u16)(W.sc[1] >> 16));
    }
    // One row (decode): each pair of products' fragments is built just
    // before use, which keeps fewer registers live. Several rows: built once
    // for all of them. Either way a row sees the same products in the same
    // order: even ones into c, odd ones into c2 (two accumulator chains, half
    // as long: +1-2% decode against one, bench/RESULTS.md), then c + c2.
    u32 af[MR == 1 ? 1 : MMAS / 2][2][4];
    if constexpr (MR > 1) {
#pragma unroll
        for (u32 q = 0; q < MMAS / 2; ++q) tcg_a_pair<DT>(W, q, af[q][0], af[q][1]);
    }
#pragma unroll
    for (u32 r = 0; r < (u32)MR; ++r) {
        if (r < rows) {
            // Lanes that pass no B read a zeroed block instead (a select
            // of the address, not of the loaded values).
            const uint4* bp = TCG_ZB && !feeds ? zeros : (const uint4*)(img + (r * ng + grp) * IMG + lane8 * 4);
            float c[4] = {0.0f, 0.0f, 0.0f, 0.0f}, c2[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (u32 q = 0; q < MMAS / 2; ++q) {
                const uint4 v = TCG_ZB || feeds ? bp[q * 8] : make_uint4(0, 0, 0, 0);
                if constexpr (MR == 1) {
                    tcg_a_pair<DT>(W, q, af[0][0], af[0][1]);
                    mma_f16(c, af[0][0], v.x, v.y);
                    mma_f16(c2, af[0][1], v.z, v.w);
                } else {
                    mma_f16(c, af[q][0], v.x, v.y);
                    mma_f16(c2, af[q][1], v.z, v.w);
                }
            }
#pragma unroll
            for (u32 j = 0; j < 4; ++j) c[j] += c2[j];
            if constexpr (T::SB == 0) {
                acc[r][0] += c[0] + c[1];
                acc[r][1] += c[2] + c[3];
            } else {
                acc[r][0] = fmaf(d0, c[0] + c[1], acc[r][0]);
                acc[r][1] = fmaf(d1, c[2] + c[3], acc[r][1]);
                if constexpr (T::SB == 4) {
                    const float sx = bsum[r * ng * 4 + grp * 4 + t];
                    acc[r][0] = fmaf(m0, sx, acc[r][0]);
                    acc[r][1] = fmaf(m1, sx, acc[r][1]);
                }
            }
        }
    }
}

// Where the float4 of input elements [e, e + 4) goes in a row's B image:
// the u32 index of its first pair (the second follows). Q4: word j of a
// block feeds products 2j (low nibbles) and 2j + 1 (high); Q8/F16: word i
// of the lane-block's elements feeds product i.
template <int DT>
__device__ __forceinline__ u32 tcg_img_at(u32 e, u32 hl) {
    if constexpr (DT == DT_Q4_0 || DT == DT_Q4_1) return q4_img_at(e, hl);  // tc.cuh
    constexpr u32 LB = TcgT<DT>::LB;
    const u32 lb = e / LB, grp = lb >> 2, t = lb & 3, el = e % LB;
    const u32 idx = 2 * (el >> 2);  // B0 of product el / 4, then B1
    return grp * tcg_img_u32<DT>() + (idx >> 2) * 32 + (2 * t + hl) * 4 + (idx & 3);
}

// float4s of input a thread loads before using any (staging must not be a
// chain of serial L2 round trips: k reaches 14K in an 8B model's FFN).
#ifndef TCG_SV
#define TCG_SV 4
#endif

__device__ __forceinline__ float4 tcg_ld4(const float* __restrict__ p, u32 j, bool vec) {
    if (vec) return *(const float4*)(p + j);
    return make_float4(p[j], p[j + 1], p[j + 2], p[j + 3]);
}

// The hi/lo image pairs of input elements [j, j + 4) and, for Q4_1, the
// block sums (8 consecutive lanes hold a 32-element block), as the
// load-ahead staging below writes them. That staging keeps its own copy of
// these lines, so that the kernels without raw staging keep the exact
// instructions they were tuned with (code a product never runs moved decode
// by -4% to +3% in session 13, bench/RESULTS.md).
template <int DT>
__device__ __forceinline__ void tcg_put4(u32* im, float* bsum, u32 j, u32 k, const float (&e)[4], bool lead8) {
    if (j < k) {
        float h[4];
#pragma unroll
        for (u32 c = 0; c < 4; ++c) h[c] = f16_round(e[c]);
        const u32 at_hi = tcg_img_at<DT>(j, 0), at_lo = tcg_img_at<DT>(j, 1);
        if constexpr (DT == DT_F16) {
            *(uint2*)(im + at_hi) = make_uint2(pack_h2(h[0], h[1]), pack_h2(h[2], h[3]));
            *(uint2*)(im + at_lo) = make_uint2(pack_h2(e[0] - h[0], e[1] - h[1]), pack_h2(e[2] - h[2], e[3] - h[3]));
        } else {
            *(uint2*)(im + at_hi) = make_uint2(pack_h2(h[0], h[2]), pack_h2(h[1], h[3]));
            *(uint2*)(im + at_lo) = make_uint2(pack_h2(e[0] - h[0], e[2] - h[2]), pack_h2(e[1] - h[1], e[3] - h[3]));
        }
    }
    if constexpr (DT == DT_Q4_1) {
        float s = (e[0] + e[1]) + (e[2] + e[3]);
        s += __shfl_xor_sync(FULL_MASK, s, 1);
        s += __shfl_xor_sync(FULL_MASK, s, 2);
        s += __shfl_xor_sync(FULL_MASK, s, 4);
        if (j < k && lead8) bsum[j >> 5] = s;
    }
}

// Raw staging of one plain input row (no norm, no activation, 16-byte
// aligned, k % 4 == 0) longer than one pass of the load-ahead staging
// below: the FFN down product. That staging is a chain of dependent L2
// round trips per thread, k / (1024 SV) of them (four for the 8B shape's
// k = 14,336). Here every float4 of the row is requested at once with
// asynchronous copies straight into the row's image region, and each warp
// then turns 128-element spans into image pairs in place: a group's image
// (4 LB elements, one u32 each) occupies exactly the bytes of its raw
// elements and a span holds whole groups, so no warp writes where another
// still reads. Only the unguarded register instances and the bulk-copy
// form compile it (`tcg_stage`'s RAW), so the short products' code stays
// as it was. Decode tok/s, same binary, -DTCG_RAW=0 -> 1: 1B F16 1,117 ->
// 1,148, 8B Q4_0 408 -> 413. As kernel instances of its own chosen by the
// launcher, without the load-ahead path beside it, the 8B Q4_0 decode
// instead fell 406 -> 381 (code generation of the weight pipeline;
// bench/RESULTS.md, session 14). `-DTCG_RAW=0` turns it off (A/B runs).
#ifndef TCG_RAW
#define TCG_RAW 1
#endif
template <int DT>
__device__ __forceinline__ void tcg_stage_raw(const float* __restrict__ xr, u32 k, u32* im, float* bsum_r) {
    constexpr u32 LB = TcgT<DT>::LB;
    static_assert(tcg_img_u32<DT>() == 4 * LB, "a group's image must take its raw elements' bytes");
    const u32 tid = threadIdx.x, bd = blockDim.x, lane = tid & 31;
    for (u32 i = tid; i < k / 4; i += bd)
        cp_async16(im + 4 * i, xr + 4 * i);
    asm volatile("cp.async.commit_group;\n\tcp.async.wait_all;" ::: "memory");
    __syncthreads();
    for (u32 c = tid >> 5; c * 128 < k; c += bd / 32) {
        const u32 j = c * 128 + lane * 4;
        float e[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (j < k) {
            const float4 v = *(const float4*)(im + j);
            e[0] = v.x;
            e[1] = v.y;
            e[2] = v.z;
            e[3] = v.w;
        }
        __syncwarp();  // the whole span is read before any lane overwrites it
        tcg_put4<DT>(im, bsum_r, j, k, e, (lane & 7) == 0);
    }
    // The image slots of lane-blocks past the row (zeroed next) may hold
    // raw elements another warp is still converting.
    const u32 n_lb = k / LB;
    if (4 * ((n_lb + 3) >> 2) != n_lb) __syncthreads();
}

// Lane-blocks past the row in the last group: zero their B (their A is
// zero-filled too, but 0 * garbage could be NaN) and Q4_1 block sums.
// Threads i0, i0 + di, ... share the work.
template <int DT>
__device__ __forceinline__ void tcg_zero_tail(u32* im, float* bs, u32 n_lb, u32 ng, u32 i0, u32 di) {
    constexpr u32 IMG = tcg_img_u32<DT>();
    for (u32 i = i0; i < (4 * ng - n_lb) * 2 * (IMG / 8); i += di) {
        const u32 per_lb = 2 * (IMG / 8);  // u32 of one lane-block, hi and lo
        const u32 lb = n_lb + i / per_lb, w = i % per_lb, hl = w / (IMG / 8), idx = w % (IMG / 8);
        im[(lb >> 2) * IMG + (idx >> 2) * 32 + (2 * (lb & 3) + hl) * 4 + (idx & 3)] = 0;
        if (DT == DT_Q4_1 && w == 0) bs[lb] = 0.0f;
    }
}

// Stages `rows` input rows as B images (and per-block sums for Q4_1): the
// activation applied, or rmsnorm(x) * norm_w with the norm fusion, each
// value split into f16 hi + lo. Every thread of the block must call it.
template <int DT, u32 SV, bool RAW = false>
__device__ __forceinline__ void tcg_stage(const Bind& b, const GemvParams& p, const GemvExtra& ex,
                                          u32 rows, u32* img, float* bsum, float* red) {
    constexpr u32 LB = TcgT<DT>::LB, IMG = tcg_img_u32<DT>();
    const u32 k = p.k, tid = threadIdx.x, bd = blockDim.x;
    const u32 n_lb = k / LB, ng = (n_lb + 3) >> 2;
    const float* __restrict__ x = (const float*)b.p[0];
    const float* __restrict__ nw = ex.norm_w;
    const u32 act = nw ? ACT_NONE : p.input_act;
    const bool vec = ((u64)x & 15) == 0 && (p.x_stride & 3) == 0 && (!nw || ((u64)nw & 15) == 0);
    for (u32 r = 0; r < rows; ++r) {
        const float* __restrict__ xr = x + (u64)r * p.x_stride;
        u32* im = img + r * ng * IMG;
        float sc = 1.0f;
        if (RAW && TCG_RAW && act == ACT_NONE && !nw && vec && k > bd * 4 * SV && k % 4 == 0) {
            tcg_stage_raw<DT>(xr, k, im, bsum + r * ng * 4);
        } else {
        if (nw) {
            float ss = 0.0f;
            for (u32 base = 0; base < k; base += bd * 4 * SV) {
                float4 v[SV];
#pragma unroll
                for (u32 i = 0; i < SV; ++i) {
                    const u32 j = base + (tid + i * bd) * 4;
                    v[i] = j < k ? tcg_ld4(xr, j, vec) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                }
#pragma unroll
                for (u32 i = 0; i < SV; ++i)
                    ss += v[i].x * v[i].x + v[i].y * v[i].y + v[i].z * v[i].z + v[i].w * v[i].w;
            }
            sc = rms_inv(block_sum(ss, red), k, ex.norm_eps);
        }
        // The loop bound is uniform over each warp (k % 64 == 0 and a warp
        // covers 128 elements), so the block sums can use shuffles.
        for (u32 base = 0; base < k; base += bd * 4 * SV) {
            float4 v[SV], u[SV];
#pragma unroll
            for (u32 i = 0; i < SV; ++i) {
                const u32 j = base + (tid + i * bd) * 4;
                v[i] = u[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (j < k) {
                    v[i] = tcg_ld4(xr, j, vec);
                    if (act != ACT_NONE) u[i] = tcg_ld4(xr + k, j, vec);
                    else if (nw) u[i] = tcg_ld4(nw, j, vec);
                }
            }
#pragma unroll
            for (u32 i = 0; i < SV; ++i) {
                const u32 j = base + (tid + i * bd) * 4;
                float e[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
                const float f[4] = {u[i].x, u[i].y, u[i].z, u[i].w};
                if (act != ACT_NONE) {
#pragma unroll
                    for (u32 c = 0; c < 4; ++c) e[c] = gated(e[c], f[c], act);
                } else if (nw) {
#pragma unroll
                    for (u32 c = 0; c < 4; ++c) e[c] = e[c] * sc * f[c];
                }
                if (j < k) {
                    float h[4];
#pragma unroll
                    for (u32 c = 0; c < 4; ++c) h[c] = f16_round(e[c]);
                    const u32 at_hi = tcg_img_at<DT>(j, 0), at_lo = tcg_img_at<DT>(j, 1);
                    if constexpr (DT == DT_F16) {
                        *(uint2*)(im + at_hi) = make_uint2(pack_h2(h[0], h[1]), pack_h2(h[2], h[3]));
                        *(uint2*)(im + at_lo) = make_uint2(pack_h2(e[0] - h[0], e[1] - h[1]),
                                                           pack_h2(e[2] - h[2], e[3] - h[3]));
                    } else {
                        *(uint2*)(im + at_hi) = make_uint2(pack_h2(h[0], h[2]), pack_h2(h[1], h[3]));
                        *(uint2*)(im + at_lo) = make_uint2(pack_h2(e[0] - h[0], e[2] - h[2]),
                                                           pack_h2(e[1] - h[1], e[3] - h[3]));
                    }
                }
                if constexpr (DT == DT_Q4_1) {
                    // Sum of each 32-element block: 8 consecutive threads.
                    float s = (e[0] + e[1]) + (e[2] + e[3]);
                    s += __shfl_xor_sync(FULL_MASK, s, 1);
                    s += __shfl_xor_sync(FULL_MASK, s, 2);
                    s += __shfl_xor_sync(FULL_MASK, s, 4);
                    if (j < k && (tid & 7) == 0) bsum[r * ng * 4 + (j >> 5)] = s;
                }
            }
        }
        }
        tcg_zero_tail<DT>(im, bsum + r * ng * 4, n_lb, ng, tid, bd);
    }
}

// Warp-local staging (TCG_WSTAGE, the default). A warp reads only the
// groups of its split (every S-th group, or every S-th chunk of CG groups
// where the bulk-copy order applies), so it need not wait for the block's
// whole image: the tpb warps that share a split stage its units between
// them (unit u = split + S (my_tile + tpb i)), and where one warp stages
// all of them (tpb = 1, S = 8) it waits on no other warp. The norm fusion
// no longer needs the row's sum of squares before the image: the image
// holds x * norm_w, each group's sum of x^2 lands in `ssg`, and the
// epilogue multiplies the outputs by rms^-1 (`tcg_norm_scale`), so the
// input is read once, not twice with a block reduction between the reads.
// Decode and verification stage and scale alike, so their rows still add
// bit for bit the same; against the per-block staging (`-DTCG_WSTAGE=0`)
// the outputs move by f32 rounding (rms^-1 applied after the product
// instead of before the f16 hi/lo split).
#ifndef TCG_WSTAGE
#define TCG_WSTAGE 1
#endif
// Only the products of the unguarded instances (and their verification
// twins, which must stage alike) stage warp-locally: 8B Q4_0 graph decode
// 384.2 -> 391.0 tok/s, SmolLM2's the same (H100). Elsewhere it measured
// no faster or slower (bench/RESULTS.md, session 24): the bulk-copy form's
// products on the 8B F16 shape 183.5 against 183.1, on the 1B F16 1,030
// against 1,011; every one-row register instance 8B Q4_0 397.6 but SmolLM2
// 1,887 -> 1,630; the guarded instances choosing at run time (rows of 2048
// or more), both stagings compiled in, SmolLM2 -6%, 8B Q4_0 +0.5%.
// `-DTCG_WSTAGE_BULK=1` stages the bulk-copy form's products warp-locally
// too (A/B runs).
#ifndef TCG_WSTAGE_BULK
#define TCG_WSTAGE_BULK 0
#endif
// 128-element spans of the second input stream (norm weights, up half)
// a lane loads before using any.
#ifndef TCG_WSV
#define TCG_WSV 4
#endif

// The end of the warp-local staging: where a split's units are staged by
// several warps (tpb > 1), a barrier of the block (a named barrier per
// split would spare the other splits' warps the wait, but an id held in a
// register makes ptxas reserve all 16 of the block's barriers).
__device__ __forceinline__ void tcg_staged(u32 tpb) {
    if (tpb == 1) __syncwarp();
    else __syncthreads();
}

// Span L of this warp's units: the lane's 4 elements [j, j + 4), j = k
// when the lane has none. A unit is 2^ush spans of 128 elements (one
// group of 64 F16 elements is one span, its upper half-warp idle).
struct TcgSpan {
    u32 j;
    bool ok;
};
__device__ __forceinline__ TcgSpan tcg_span(u32 L, u32 ush, u32 ue, u32 first, u32 step, u32 n_units, u32 k,
                                            u32 lane) {
    const u32 u = first + (L >> ush) * step;
    const u32 in_unit = ((L & ((1u << ush) - 1)) << 7) + lane * 4;
    const u32 j = u * ue + in_unit;
    const bool ok = u < n_units && in_unit < ue && j < k;
    return {ok ? j : k, ok};
}

// Stages this warp's units of `rows` input rows: B image pairs, Q4_1 block
// sums, and with the norm fusion each group's sum of squares in
// ssg[r * ng + group]. `unit` groups per unit; the warp takes units first,
// first + step, ... below n_units. The input itself goes by asynchronous
// copies straight into the image region (a span's image takes exactly
// its raw elements' bytes, as in tcg_stage_raw), all requested at once;
// only the second stream (norm weights, or the up half of a gated input)
// passes through registers, WSV spans at a time, so the staging holds few
// registers beside the weights already in flight (holding both streams in
// registers spilled the register form's unguarded instances, NVRTC).
template <int DT, u32 WSV>
__device__ __forceinline__ void tcg_stage_warp(const Bind& b, const GemvParams& p, const GemvExtra& ex,
                                               u32 rows, u32* img, float* bsum, float* ssg, u32 unit,
                                               u32 first, u32 step) {
    constexpr u32 LB = TcgT<DT>::LB, IMG = tcg_img_u32<DT>(), GE = 4 * LB;
    static_assert(IMG == GE, "a group's image must take its raw elements' bytes");
    const u32 k = p.k, lane = threadIdx.x & 31;
    const u32 n_lb = k / LB, ng = (n_lb + 3) >> 2, n_units = (ng + unit - 1) / unit;
    const u32 ue = unit * GE;  // elements per unit: 64 or a multiple of 128
    const u32 ush = ue <= 128 ? 0 : 31 - __clz(ue >> 7);
    const u32 mine = first < n_units ? (n_units - first + step - 1) / step : 0;
    const u32 spans = mine << ush;
    const float* __restrict__ x = (const float*)b.p[0];
    const float* __restrict__ nw = ex.norm_w;
    const u32 act = nw ? ACT_NONE : p.input_act;
    const bool two = nw || act != ACT_NONE;  // a second stream
    const bool vec = ((u64)x & 15) == 0 && (p.x_stride & 3) == 0 && (!nw || ((u64)nw & 15) == 0);
    // Lanes whose group sums are reduced together: a group is GE / 4 lanes.
    constexpr u32 GL = GE / 4;
    for (u32 r = 0; r < rows; ++r) {
        const float* __restrict__ xr = x + (u64)r * p.x_stride;
        u32* im = img + r * ng * IMG;
        float* bs = bsum + r * ng * 4;
        if (vec) {
            for (u32 L = 0; L < spans; ++L) {
                const TcgSpan s = tcg_span(L, ush, ue, first, step, n_units, k, lane);
                // Written out rather than cp_async16: the helper compiled to
                // other instructions here than the measured ones (NVRTC).
                if (s.ok)
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(
                                     (u32)__cvta_generic_to_shared(im + s.j)),
                                 "l"(xr + s.j)
                                 : "memory");
            }
            asm volatile("cp.async.commit_group;" ::: "memory");
        }
        for (u32 L0 = 0; L0 < spans; L0 += WSV) {
            float4 u[WSV];
            u32 js[WSV];
#pragma unroll
            for (u32 i = 0; i < WSV; ++i) {
                const TcgSpan s = tcg_span(L0 + i, ush, ue, first, step, n_units, k, lane);
                js[i] = s.j;
                u[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (s.ok && two) u[i] = nw ? tcg_ld4(nw, s.j, vec) : tcg_ld4(xr + k, s.j, vec);
            }
            if (vec && L0 == 0) asm volatile("cp.async.wait_all;" ::: "memory");
            __syncwarp();  // every lane's copies have landed
#pragma unroll
            for (u32 i = 0; i < WSV; ++i) {
                if (L0 + i >= spans) break;  // uniform over the warp
                const u32 j = js[i];
                float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (j < k) v = vec ? *(const float4*)(im + j) : tcg_ld4(xr, j, false);
                __syncwarp();  // the span is read before any lane overwrites it
                float e[4] = {v.x, v.y, v.z, v.w};
                const float f[4] = {u[i].x, u[i].y, u[i].z, u[i].w};
                if (act != ACT_NONE) {
#pragma unroll
                    for (u32 c = 0; c < 4; ++c) e[c] = gated(e[c], f[c], act);
                } else if (nw) {
                    float sq = (e[0] * e[0] + e[1] * e[1]) + (e[2] * e[2] + e[3] * e[3]);
#pragma unroll
                    for (u32 o = 1; o < GL; o <<= 1) sq += __shfl_xor_sync(FULL_MASK, sq, o);
                    if (j < k && lane % GL == 0) ssg[r * ng + j / GE] = sq;
#pragma unroll
                    for (u32 c = 0; c < 4; ++c) e[c] *= f[c];
                }
                tcg_put4<DT>(im, bs, j, k, e, (lane & 7) == 0);
            }
        }
        // The last group's tail: the warp that staged that group, alone.
        if (4 * ng != n_lb && (ng - 1) / unit >= first && ((ng - 1) / unit - first) % step == 0) {
            __syncwarp();
            tcg_zero_tail<DT>(im, bs, n_lb, ng, lane, 32);
        }
    }
}

// rms^-1 of an input row from its groups' sums of squares, added in one
// fixed order (lane l takes groups l, l + 32, ...; then a butterfly, whose
// pairs add alike in both lanes), so every warp, form and row count gets
// the same bits. A whole warp must call it.
__device__ __forceinline__ float tcg_norm_scale(const float* ssg, u32 ng, u32 k, float eps) {
    const u32 lane = threadIdx.x & 31;
    float s = 0.0f;
    for (u32 i = lane; i < ng; i += 32) s += ssg[i];
    return rms_inv(warp_sum(s), k, eps);
}

// Groups a warp has loaded ahead (a rotating register pipeline; 4 and 3
// measured best against 2 and 6/4, bench/RESULTS.md).
#ifndef TCG_AHEAD_Q4
#define TCG_AHEAD_Q4 4
#endif
#ifndef TCG_AHEAD
#define TCG_AHEAD 3
#endif
template <int DT> __device__ __forceinline__ constexpr u32 tcg_ahead() {
    return DT == DT_Q4_0 || DT == DT_Q4_1 ? TCG_AHEAD_Q4 : TCG_AHEAD;
}

// Chunks of the bulk-copy form (below); the register form takes its
// group order from them where that form runs the one-row products.
#ifndef TCB_QROW
#define TCB_QROW 512
#endif
#ifndef TCB_NST
#define TCB_NST 2
#endif
#ifndef TCB_FULL
#define TCB_FULL 1
#endif

template <int DT> struct TcbT {
    using T = TcgT<DT>;
    static constexpr u32 CG = TCB_QROW / (4 * T::QB);             // groups per chunk
    static constexpr u32 QROW = CG * 4 * T::QB;                   // quant bytes per row
    static constexpr u32 SROW = CG * 4 * T::SB;                   // scale bytes per row
    static constexpr u32 QPITCH = QROW + (T::QB == 16 ? 64 : 16);  // conflict-free reads
    static constexpr u32 STAGE = 16 * QPITCH + 16 * SROW;
};

// The values an accumulating one-row product (the o projection and the
// FFN down: h += W x) adds its rows g and g + 8 to, requested by the lanes
// that write them when a tile starts. Read in tcg_finish instead, that load
// was the kernel's last step: one dependent L2 round trip after the last
// product, paid by every block before the next kernel could start
// (bench/RESULTS.md, session 16). Safe after the wait on the previous
// kernel: no other block writes these rows, and they are not the input.
// `-DTCG_PRIOR_EARLY=0` turns it off (A/B runs), 1 keeps it to the short
// instances.
#ifndef TCG_PRIOR_EARLY
#define TCG_PRIOR_EARLY 2
#endif
template <bool FULL>
__device__ __forceinline__ constexpr bool tcg_prior_early() {
    return TCG_PRIOR_EARLY == 2 || (TCG_PRIOR_EARLY == 1 && !FULL);
}
__device__ __forceinline__ void tcg_prior(const Bind& b, const GemvParams& p, u32 tile, u32 total, u32 g,
                                          float (&prior)[2]) {
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        const u32 o = tile * 16 + g + 8 * h;
        prior[h] = o < total ? ((const float*)b.p[1])[o] : 0.0f;
    }
}

// The end of a tile, in both forms: lanes t = 0..3 of a row add their
// blocks' partials, the tile's S warps add theirs through `part` in split
// order (so a result never depends on timing), and split 0's lanes t = 0
// write rows g and g + 8: bias, soft-cap, then store or accumulate. Every
// warp of the block must call it (barriers when S > 1). `bias_of(h, o)`:
// the bias of output row o (row g + 8 h of the tile), or null. The register
// form passes the one it holds: finding the row's segment again here
// measured 3.9% slower on SmolLM2 (1,531 against 1,593 tok/s).
//
// `prior(h, dst)`: the value an accumulating product adds to at dst (row
// g + 8 h of the tile). The one-row forms pass the value they requested
// when the tile started (`tcg_prior`); the others read dst here.
// The norm fusion's scale under warp-local staging: the row sums of
// squares by group (null without the fusion), and rms^-1 per input row,
// found at a warp's first tile end and kept.
template <int MR> struct TcgNorm {
    const float* ssg;
    u32 ng;
    float eps;
    bool ready;
    float sc[MR];
};

template <int MR, class BiasOf, class Prior>
__device__ __forceinline__ void tcg_finish(const Bind& b, const GemvParams& p, float (&acc)[MR][2], u32 rows,
                                           u32 tile, u32 n_tiles, u32 S, u32 g, u32 t, float* part,
                                           u32 pair_act, TcgNorm<MR>& nm, BiasOf bias_of, Prior prior) {
    const u32 warp = threadIdx.x >> 5, split = warp % S, total = gemv_total_rows(p);
#pragma unroll
    for (u32 r = 0; r < (u32)MR; ++r) {
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            acc[r][h] += __shfl_xor_sync(FULL_MASK, acc[r][h], 1);
            acc[r][h] += __shfl_xor_sync(FULL_MASK, acc[r][h], 2);
        }
    }
    if (S > 1) {
        if (t == 0) {
#pragma unroll
            for (u32 r = 0; r < (u32)MR; ++r) {
                part[(warp * MR + r) * 16 + g] = acc[r][0];
                part[(warp * MR + r) * 16 + g + 8] = acc[r][1];
            }
        }
        __syncthreads();
        if (split == 0) {
#pragma unroll
            for (u32 r = 0; r < (u32)MR; ++r) {
                for (u32 s = 1; s < S; ++s) {
                    acc[r][0] += part[((warp + s) * MR + r) * 16 + g];
                    acc[r][1] += part[((warp + s) * MR + r) * 16 + g + 8];
                }
            }
        }
        __syncthreads();  // part is rewritten by the next tile
    }
    // Every group's sum of squares is in by now: with S = 1 the staging
    // ended at a barrier of the whole block, with S > 1 the one above.
    if (nm.ssg && split == 0) {
        if (!nm.ready) {
#pragma unroll
            for (u32 r = 0; r < (u32)MR; ++r)
                nm.sc[r] = r < rows ? tcg_norm_scale(nm.ssg + r * nm.ng, nm.ng, p.k, nm.eps) : 0.0f;
            nm.ready = true;
        }
#pragma unroll
        for (u32 r = 0; r < (u32)MR; ++r) {
            acc[r][0] *= nm.sc[r];
            acc[r][1] *= nm.sc[r];
        }
    }
    if (pair_act != ACT_NONE) {
        // Paired epilogue: rows g and g + 8 are unit tile * 8 + g's gate
        // and up (no bias, soft-cap or accumulation: the launcher checks).
        const u32 u = tile * 8 + g;
        if (split == 0 && t == 0 && tile < n_tiles) {
#pragma unroll
            for (u32 r = 0; r < (u32)MR; ++r)
                if (r < rows) ((float*)b.p[1])[(u64)r * p.out_stride + u] = gated(acc[r][0], acc[r][1], pair_act);
        }
        return;
    }
    if (split == 0 && t == 0 && tile < n_tiles) {
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            const u32 o = tile * 16 + g + 8 * h;
            if (o >= total) continue;
            const float* bp = bias_of(h, o);
            const float bias = bp ? *bp : 0.0f;
#pragma unroll
            for (u32 r = 0; r < (u32)MR; ++r) {
                if (r < rows) {
                    float* dst = (float*)b.p[1] + (u64)r * p.out_stride + o;
                    const float v = softcap_score(acc[r][h] + bias, p.softcap);
                    *dst = p.accumulate ? prior(h, dst) + v : v;
                }
            }
        }
    }
}

// Shared memory of the kernel (the launcher's `tcg_smem` mirrors it):
// [B images: rows x groups][Q4_1 block sums]. FULL: rounds whose groups
// and refills all exist run unguarded (below), and long plain inputs are
// staged raw (`tcg_stage_raw`); a separate instance, since
// the extra path costs the products too short to use it (SmolLM2: 1,592
// against 1,524 tok/s with it compiled into every one-row kernel).
template <int DT, int MR, bool FULL = false>
__device__ __forceinline__ void tcg_body(const Bind& b, const GemvParams& p, const StepArg& a,
                                         const GemvExtra& ex) {
    using T = TcgT<DT>;
    constexpr u32 IMG = tcg_img_u32<DT>(), D = tcg_ahead<DT>();
    extern __shared__ float4 gemv_smem[];
    __shared__ float red[32];
    __shared__ float part[TCG_WARPS * MR * 16];
    __shared__ uint4 zeros[TCG_ZERO_U4];
    if (threadIdx.x < TCG_ZERO_U4) zeros[threadIdx.x] = make_uint4(0, 0, 0, 0);
    const u32 k = p.k, n_lb = k / T::LB, ng = (n_lb + 3) >> 2;
    const u32 rows = a.rows < (u32)MR ? a.rows : (u32)MR;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const u32 S = ex.tc_split;  // warps per tile: 1, 2, 4 or 8
    const u32 tpb = TCG_WARPS / S, my_tile = warp / S, split = warp % S;
    const u32 total = gemv_total_rows(p), n_tiles = (total + 15) >> 4;
    const u32 n_rg = (n_tiles + tpb - 1) / tpb;
    // This warp's groups of a tile: chunks split, split + S, ... of
    // `chunk` groups each (1, or the bulk-copy form's CG where that form
    // runs the one-row products, so that verification adds in its order).
    const bool chunked = ex.tc_chunk > 1;
    constexpr u32 CG = TcbT<DT>::CG;
    const u32 chunk = chunked ? CG : 1, n_ch = (ng + chunk - 1) / chunk;
    u32 my_n = split < n_ch ? (n_ch - split + S - 1) / S * chunk : 0;
    if (split < n_ch && (n_ch - 1) % S == split) my_n -= n_ch * chunk - ng;  // the short last chunk
    auto grp_of = [&](u32 n) {
        return chunked ? (split + (n / CG) * S) * CG + n % CG : split + n * S;
    };

    u32* img = (u32*)gemv_smem;
    float* bsum = (float*)(img + rows * ng * IMG);
    float* ssg = bsum + (DT == DT_Q4_1 ? rows * ng * 4 : 0);
    // Which staging: the launcher's rule for the unguarded instances (2 or
    // more rounds of groups a warp), so that a product's decode and
    // verification steps stage alike; one-row steps never take the
    // bulk-copy order here (the launcher runs those on the bulk-copy form),
    // so only the verification instances carry both stagings.
    const bool long_rows = (ng + S - 1) / S >= 2 * D;
    const bool wstage = MR == 1 ? TCG_WSTAGE && FULL : TCG_WSTAGE && (chunked ? TCG_WSTAGE_BULK : long_rows);
    TcgNorm<MR> nm{wstage && ex.norm_w ? ssg : nullptr, ng, ex.norm_eps, false, {}};
    TcgW<DT> W[D];

    // This lane's rows of a tile (a missing row reads the last one again).
    // With the paired epilogue, gate row u = tile * 8 + g and up row n[0] + u.
    auto tile_rows = [&](u32 tile, SegRow& s0, SegRow& s1) {
        if (ex.pair_act != ACT_NONE) {
            const u32 u = tile * 8 + g;
            s0 = seg_row(b, p, u);
            s1 = seg_row(b, p, p.n[0] + u);
            return;
        }
        const u32 o0 = tile * 16 + g, o1 = o0 + 8;
        s0 = seg_row(b, p, o0 < total ? o0 : total - 1);
        s1 = seg_row(b, p, o1 < total ? o1 : total - 1);
    };
    // Requests the tile's first groups.
    auto prologue = [&](const SegRow& s0, const SegRow& s1) {
#pragma unroll
        for (u32 u = 0; u < D; ++u)
            if (u < my_n) tcg_load<DT>(W[u], s0.row, s1.row, grp_of(u), n_lb, t);
    };

    // The first tile's weights start streaming before the wait.
    u32 rg = blockIdx.x;
    SegRow s0, s1;
    const u32 tile0 = rg * tpb + my_tile;
    if (rg < n_rg && tile0 < n_tiles) {
        tile_rows(tile0, s0, s1);
        prologue(s0, s1);
    }
    AKUNU_GRID_DEPS();
    // Staging only reads global memory: the short products (the non-FULL
    // instances) test the stop word after it. In the unguarded instances
    // the same change cost 8B Q4_0 4% (bench/RESULTS.md, session 14).
    constexpr bool LATE = LATE_STOP && !FULL;
    __shared__ uint4 ctl_slot;
    if (LATE) chain_stop_copy(a, &ctl_slot);
    else if (chain_stopped(a)) return;
    // Staging loads TCG_SV float4s per thread before using any; that hurts
    // rows of under 2048 (SmolLM2: 1477 against 1281 tok/s), where one
    // suffices, and helps wider ones (llama-1b F16: 945 against 922).
#ifdef DIAG_SKIP_STAGE
    // Measurement only (wrong results): products of k >= DIAG_SKIP_STAGE
    // run without their staging (a zeroed image instead).
    if (k >= DIAG_SKIP_STAGE) {
        for (u32 i = threadIdx.x; i < rows * ng * (IMG + (DT == DT_Q4_1 ? 5 : 1)); i += blockDim.x) img[i] = 0;
        __syncthreads();
    } else
#endif
    if (wstage) {
        tcg_stage_warp<DT, TCG_WSV>(b, p, ex, rows, img, bsum, ssg, chunk, split + S * my_tile, S * tpb);
        // The stop word's copy needs the whole block's barrier.
        if (!LATE) tcg_staged(tpb);
    } else if (k < 2048) {
        tcg_stage<DT, 1>(b, p, ex, rows, img, bsum, red);
    } else {
        tcg_stage<DT, TCG_SV, FULL>(b, p, ex, rows, img, bsum, red);
    }
    if (LATE) chain_stop_landed();
    if (LATE || !wstage) __syncthreads();
    if (LATE && chain_stop_seen(a, &ctl_slot)) return;

    const bool feeds = (g >> 1) == t;  // this lane passes B: block t, hi (even g) or lo
    const u32 lane8 = 2 * t + (g & 1);
    for (bool first = true; rg < n_rg; rg += gridDim.x, first = false) {
        const u32 tile = rg * tpb + my_tile;
        float acc[MR][2];
#pragma unroll
        for (u32 r = 0; r < (u32)MR; ++r) acc[r][0] = acc[r][1] = 0.0f;
        float prior[2] = {0.0f, 0.0f};
        constexpr bool EARLY = MR == 1 && tcg_prior_early<FULL>();
        if (tile < n_tiles) {
            if (!first) {
                tile_rows(tile, s0, s1);
                prologue(s0, s1);
            }
            if (EARLY && p.accumulate && split == 0 && t == 0) tcg_prior(b, p, tile, total, g, prior);
            // Group n computes from W[n % D] and refills it with group n + D.
            // Rounds whose groups and refills all exist run without guards
            // (as the bulk-copy form's full chunks), so that groups overlap.
            for (u32 n0 = 0; n0 < my_n; n0 += D) {
                if (FULL && n0 + 2 * D <= my_n) {
#pragma unroll
                    for (u32 u = 0; u < D; ++u) {
                        tcg_group<DT, MR>(W[u], grp_of(n0 + u), rows, ng, img, bsum, feeds, lane8, t, acc, zeros);
                        tcg_load<DT>(W[u], s0.row, s1.row, grp_of(n0 + u + D), n_lb, t);
                    }
                    continue;
                }
#pragma unroll
                for (u32 u = 0; u < D; ++u) {
                    const u32 n = n0 + u;
                    if (n < my_n) {
                        tcg_group<DT, MR>(W[u], grp_of(n), rows, ng, img, bsum, feeds, lane8, t, acc, zeros);
                        if (n + D < my_n) tcg_load<DT>(W[u], s0.row, s1.row, grp_of(n + D), n_lb, t);
                    }
                }
            }
        }
        tcg_finish<MR>(b, p, acc, rows, tile, n_tiles, S, g, t, part, ex.pair_act, nm,
                       [&](u32 h, u32) { return h ? s1.bias : s0.bias; },
                       [&](u32 h, const float* dst) { return EARLY ? prior[h] : *dst; });
    }
}

// One input row (decode): 256 threads, at least TCG_MINB blocks per SM.
#ifndef TCG_MINB
#define TCG_MINB 2
#endif
#define TCG_KERNEL(name, dt, mr, minb, full)                                    \
    extern "C" __global__ void __launch_bounds__(TCG_WARPS * 32, minb)          \
    name(Bind b, GemvParams p, StepArg a, GemvExtra ex) {                       \
        tcg_body<dt, mr, full>(b, p, a, ex);                                    \
    }
TCG_KERNEL(k_gemv_tc_f16, DT_F16, 1, TCG_MINB, false)
TCG_KERNEL(k_gemv_tc_q8_0, DT_Q8_0, 1, TCG_MINB, false)
TCG_KERNEL(k_gemv_tc_q4_0, DT_Q4_0, 1, TCG_MINB, false)
TCG_KERNEL(k_gemv_tc_q4_1, DT_Q4_1, 1, TCG_MINB, false)
// The same for products whose warps take at least 2 rounds of groups.
TCG_KERNEL(k_gemv_tcf_f16, DT_F16, 1, TCG_MINB, true)
TCG_KERNEL(k_gemv_tcf_q8_0, DT_Q8_0, 1, TCG_MINB, true)
TCG_KERNEL(k_gemv_tcf_q4_0, DT_Q4_0, 1, TCG_MINB, true)
TCG_KERNEL(k_gemv_tcf_q4_1, DT_Q4_1, 1, TCG_MINB, true)
// 2..8 input rows (speculative verification): the same per-row arithmetic.
TCG_KERNEL(k_gemv_tc8_f16, DT_F16, 8, 1, false)
TCG_KERNEL(k_gemv_tc8_q8_0, DT_Q8_0, 8, 1, false)
TCG_KERNEL(k_gemv_tc8_q4_0, DT_Q4_0, 8, 1, false)
TCG_KERNEL(k_gemv_tc8_q4_1, DT_Q4_1, 8, 1, false)

// ---------------------------------------------------------------------------
// Bulk-copy form (one input row). The register pipeline above holds the
// weights in flight in registers, which caps a lane at a few groups and the
// SM at 16 warps; Nsight Compute shows its warps stalled on memory with
// DRAM far from busy. Here each warp streams its weights into a ring of
// shared-memory stages with the copy engine (cp.async.bulk, completing on an
// mbarrier): 32 copies per chunk, lane L copying row L % 16's quants
// (L < 16) or scales (L >= 16), so no register holds a weight in flight and
// no instruction is spent per 16 bytes on the way in. The warp then reads
// its fragments back from shared memory (one 16-byte read per lane and
// row, as the register form's global read) and runs the same group
// arithmetic (`tcg_group`).
//
// A chunk is TCB_QROW bytes of quants of each of the tile's 16 rows (CG
// groups), with their scales; a tile's chunks are shared out over its S
// warps (chunks s, s + S, ...). Row pitch in a stage keeps the 8 lanes of
// each quarter-warp on distinct banks: 64 mod 128 for 16-byte lane-blocks,
// 16 mod 128 for 32-byte ones.
// ---------------------------------------------------------------------------

// (smem_u32, mbar_*, bulk_copy: common.cuh.)

// Phase stamps of the bulk-copy form (bench/cuda/gemv_probe.cu builds it
// with -DTCB_TIMING): %globaltimer at entry, after the wait, after the
// staging and at the end, per block.
#ifdef TCB_TIMING
__device__ u64 tcb_stamps[4096][4];
#define TCB_STAMP(i)                                                                    \
    do {                                                                                \
        if (threadIdx.x == 0) {                                                         \
            u64 t_;                                                                     \
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                      \
            tcb_stamps[blockIdx.x][i] = t_;                                             \
        }                                                                               \
    } while (0)
#else
#define TCB_STAMP(i) do { } while (0)
#endif

template <int DT>
__device__ __forceinline__ void tcb_body(const Bind& b, const GemvParams& p, const StepArg& a,
                                         const GemvExtra& ex) {
    using T = TcgT<DT>;
    using C = TcbT<DT>;
    constexpr u32 IMG = tcg_img_u32<DT>();
    extern __shared__ float4 gemv_smem[];
    __shared__ float red[32];
    __shared__ float part[TCG_WARPS * 16];
    __shared__ uint4 zeros[TCG_ZERO_U4];
    if (threadIdx.x < TCG_ZERO_U4) zeros[threadIdx.x] = make_uint4(0, 0, 0, 0);
    __shared__ u64 bars[TCG_WARPS][TCB_NST];
    const u32 k = p.k, n_lb = k / T::LB, ng = (n_lb + 3) >> 2, n_ch = (ng + C::CG - 1) / C::CG;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const u32 S = ex.tc_split;
    const u32 tpb = TCG_WARPS / S, my_tile = warp / S, split = warp % S;
    const u32 total = gemv_total_rows(p), n_tiles = (total + 15) >> 4;
    const u32 n_rg = (n_tiles + tpb - 1) / tpb;

    u32* img = (u32*)gemv_smem;
    float* bsum = (float*)(img + ng * IMG);
    float* ssg = bsum + (DT == DT_Q4_1 ? 4 * ng : 0);
    constexpr bool wstage = TCG_WSTAGE && TCG_WSTAGE_BULK;
    TcgNorm<1> nm{wstage && ex.norm_w ? ssg : nullptr, ng, ex.norm_eps, false, {}};
    // The ring starts 128-byte aligned after the image, block sums and
    // groups' sums of squares.
    const u32 head = ((ng * IMG + (DT == DT_Q4_1 ? 4 * ng : 0) + ng) * 4 + 127) & ~127u;
    u8* ring = (u8*)gemv_smem + head + warp * TCB_NST * C::STAGE;
    u64* bar = bars[warp];
    TCB_STAMP(0);
    if (lane == 0) {
#pragma unroll
        for (u32 s = 0; s < TCB_NST; ++s) mbar_init(&bar[s], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncwarp();

    // This warp's chunks, in order: (row group rg, chunk c) for rg =
    // blockIdx.x, + gridDim.x, ... and c = split, split + S, ...
    auto valid = [&](u32 rg) { return rg < n_rg && rg * tpb + my_tile < n_tiles; };
    // Lane L's copy of chunk c of tile `tile` into stage s.
    auto issue = [&](u32 tile, u32 c, u32 s) {
        const u32 g0 = c * C::CG, gq = ng - g0 < C::CG ? ng - g0 : C::CG;
        if (lane == 0) mbar_expect_tx(&bar[s], 16 * gq * 4 * (T::QB + T::SB));
        __syncwarp();
        // Tile row r; with the paired epilogue, gate row tile * 8 + r or
        // (r >= 8) the same unit's up row.
        const u32 r = lane & 15;
        const u32 o = ex.pair_act != ACT_NONE ? (r < 8 ? 0 : p.n[0]) + tile * 8 + (r & 7) : tile * 16 + r;
        const SegRow sr = seg_row(b, p, o < total ? o : total - 1);
        u8* st = ring + s * C::STAGE;
        if (lane < 16) {
            bulk_copy(st + r * C::QPITCH, sr.row.w + (u64)g0 * 4 * T::QB, gq * 4 * T::QB, &bar[s]);
        } else if (T::SB != 0) {
            bulk_copy(st + 16 * C::QPITCH + r * C::SROW, sr.row.sc + (u64)g0 * 4 * T::SB, gq * 4 * T::SB,
                      &bar[s]);
        }
    };

    // Prime the ring before waiting on the previous kernel: weights are
    // constants.
    u32 rg_i = blockIdx.x, c_i = split;  // next chunk to issue
    auto advance = [&](u32& rg, u32& c) {
        c += S;
        if (c >= n_ch) {
            c = split;
            rg += gridDim.x;
        }
    };
    u32 primed = 0;
#pragma unroll
    for (u32 s = 0; s < TCB_NST; ++s) {
        if (valid(rg_i) && c_i < n_ch) {
            issue(rg_i * tpb + my_tile, c_i, s);
            advance(rg_i, c_i);
            ++primed;
        }
    }
    AKUNU_GRID_DEPS();
    TCB_STAMP(1);
    if (a.ctl && *(volatile const u32*)&a.ctl->done) {
        // No block may leave with copies still landing in its shared memory.
        for (u32 s = 0; s < primed; ++s) mbar_wait(&bar[s], 0);
        return;
    }
    // Staging with 8 or 16 loads ahead for rows over 4096 measured slower
    // (bench/RESULTS.md): the x loads queue behind the ring's copies.
#ifdef DIAG_SKIP_STAGE
    // Measurement only (wrong results), as in the register form.
    if (k >= DIAG_SKIP_STAGE) {
        for (u32 i = threadIdx.x; i < ng * (IMG + (DT == DT_Q4_1 ? 5 : 1)); i += blockDim.x) img[i] = 0;
        __syncthreads();
    } else
#endif
    if (wstage) {
        tcg_stage_warp<DT, TCG_WSV>(b, p, ex, 1, img, bsum, ssg, C::CG, split + S * my_tile, S * tpb);
        tcg_staged(tpb);
    } else {
        if (k < 2048) tcg_stage<DT, 1>(b, p, ex, 1, img, bsum, red);
        else tcg_stage<DT, TCG_SV, true>(b, p, ex, 1, img, bsum, red);
        __syncthreads();
    }
    TCB_STAMP(2);

    const bool feeds = (g >> 1) == t;
    const u32 lane8 = 2 * t + (g & 1);
    u32 stage = 0, phase = 0;
    for (u32 rg = blockIdx.x; rg < n_rg; rg += gridDim.x) {
        const u32 tile = rg * tpb + my_tile;
        float acc[1][2] = {{0.0f, 0.0f}};
        float prior[2] = {0.0f, 0.0f};
        constexpr bool EARLY = tcg_prior_early<true>();
        if (tile < n_tiles) {
            if (EARLY && p.accumulate && split == 0 && t == 0) tcg_prior(b, p, tile, total, g, prior);
            for (u32 c = split; c < n_ch; c += S) {
                mbar_wait(&bar[stage], phase);
                const u8* st = ring + stage * C::STAGE;
                const u32 g0 = c * C::CG, gq = ng - g0 < C::CG ? ng - g0 : C::CG;
                auto group = [&](u32 j) {
                    TcgW<DT> W;
#pragma unroll
                    for (u32 i = 0; i < T::QB / 16; ++i) {
                        W.q[0][i] = *(const uint4*)(st + g * C::QPITCH + (j * 4 + t) * T::QB + i * 16);
                        W.q[1][i] = *(const uint4*)(st + (g + 8) * C::QPITCH + (j * 4 + t) * T::QB + i * 16);
                    }
                    if constexpr (T::SB == 2) {
                        W.sc[0] = *(const u16*)(st + 16 * C::QPITCH + g * C::SROW + (j * 4 + t) * 2);
                        W.sc[1] = *(const u16*)(st + 16 * C::QPITCH + (g + 8) * C::SROW + (j * 4 + t) * 2);
                    } else if constexpr (T::SB == 4) {
                        W.sc[0] = *(const u32*)(st + 16 * C::QPITCH + g * C::SROW + (j * 4 + t) * 4);
                        W.sc[1] = *(const u32*)(st + 16 * C::QPITCH + (g + 8) * C::SROW + (j * 4 + t) * 4);
                    }
                    tcg_group<DT, 1>(W, g0 + j, 1, ng, img, bsum, feeds, lane8, t, acc, zeros);
                };
                // A full chunk runs its groups without a branch between
                // them, so the compiler can overlap one group's reads and
                // products with the next's (a guard per group kept each
                // group's chain alone, with 2 warps per scheduler).
                if (TCB_FULL && gq == C::CG) {
#pragma unroll
                    for (u32 j = 0; j < C::CG; ++j) group(j);
                } else {
#pragma unroll
                    for (u32 j = 0; j < C::CG; ++j)
                        if (j < gq) group(j);
                }
                // Every lane has its fragments: the stage may be refilled.
                __syncwarp();
                if (valid(rg_i)) {
                    issue(rg_i * tpb + my_tile, c_i, stage);
                    advance(rg_i, c_i);
                }
                if (++stage == TCB_NST) {
                    stage = 0;
                    phase ^= 1;
                }
            }
        }
        tcg_finish<1>(b, p, acc, 1, tile, n_tiles, S, g, t, part, ex.pair_act, nm,
                      [&](u32, u32 o) { return seg_row(b, p, o).bias; },
                      [&](u32 h, const float* dst) { return EARLY ? prior[h] : *dst; });
    }
    TCB_STAMP(3);
}

#ifndef TCB_MINB
#define TCB_MINB 1
#endif
#define TCB_KERNEL(name, dt)                                                    \
    extern "C" __global__ void __launch_bounds__(TCG_WARPS * 32, TCB_MINB)      \
    name(Bind b, GemvParams p, StepArg a, GemvExtra ex) {                       \
        tcb_body<dt>(b, p, a, ex);                                              \
    }
TCB_KERNEL(k_gemv_tcb_f16, DT_F16)
TCB_KERNEL(k_gemv_tcb_q8_0, DT_Q8_0)
TCB_KERNEL(k_gemv_tcb_q4_0, DT_Q4_0)
TCB_KERNEL(k_gemv_tcb_q4_1, DT_Q4_1)
