// akunu CUDA kernels: the sampling commands (argmax, in-chain Gumbel
// sampling, top-k, repetition penalty, temperature, grammar mask) and the
// two control kernels of a captured chain. common.cuh is prepended.
//
// Reference semantics: the CPU backend (crates/akunu-cpu/src/kernels.rs) and
// crates/akunu-core/src/sampling.rs. The Gumbel noise is bit-identical to the
// CPU's (same hash, same f32 logarithm, no fused multiply-adds); the kept
// candidate set is the CPU's exactly, with weights from expf instead of the
// CPU's exp, so a fixed seed draws the CPU's token except at near-ties.
//
// Candidate selection without sorting the vocabulary. Every token of the
// candidate pool S (finite logit, passing min-p) gets a 64-bit rank key
// (order-mapped logit above, complemented id below): a larger key ranks
// first, equal logits by lower id, exactly the CPU's order. The CPU keeps the
// best L tokens of S, L = min(top-k, first prefix whose mass reaches top-p),
// so the kept set is {key >= T} for one threshold key T. T is found by
// bucketing S in a shared histogram (count and mass per bucket), picking the
// bucket where the running count or mass crosses its goal, and narrowing to
// that bucket until it holds at most SMP_CAP tokens; those are then gathered
// in shared memory, sorted and walked. Masses are fixed-point integers, so
// every sum is exact and independent of the order the atomics land in: the
// result is deterministic.

#define SMP_THREADS 1024   // block of the single-block sampling kernels
#define SMP_BINS 2048      // histogram buckets per narrowing pass
#define SMP_BIN_BITS 11    // log2(SMP_BINS)
#define SMP_CAP 4096       // tokens gathered and sorted in shared memory
#define SMP_WIN 1024       // penalty-window ids de-duplicated in shared memory

// ---------------------------------------------------------------------------
// Shared state of the single-block kernels
// ---------------------------------------------------------------------------

// A bucket where a running total crosses its goal: the bucket, its token
// count, and the count and mass of everything ranked before it.
struct SmpCross {
    u32 bin;
    u32 cnt;
    u32 above_c;
    u32 _pad;
    u64 above_m;
};

struct SmpShared {
    // The phases use these one after another, never two at once.
    union {
        struct {
            u32 cnt[SMP_BINS];
            u64 mass[SMP_BINS];
        } h;
        u64 cand[SMP_CAP];
        u32 win[SMP_WIN];
    } u;
    u32 rc[32];
    u64 rm[32];
    u64 rm2[32];
    float rf[32];
    SmpCross xc, xm;   // count / mass crossings of the last histogram
    u32 ncand;         // tokens gathered into u.cand
    u32 jc, jm;        // cut indices in the sorted candidates
    u64 incl_c, incl_m;
    u64 key;           // broadcast threshold key
};

// (Hashing, noise and rank keys: noise.cuh.)

// total_cmp order of the TopKSelect command (raw bits: -0 < +0, NaN ranked
// by its bits), ties by lower id.
__device__ __forceinline__ u64 total_key(float v, u32 id) {
    return ((u64)ord_bits(__float_as_uint(v)) << 32) | (u64)(~id);
}

// Smallest shift with range >> shift < SMP_BINS.
__device__ __forceinline__ u32 bin_shift(u64 range) {
    u32 bl = 64u - (u32)__clzll((long long)range);
    return bl > SMP_BIN_BITS ? bl - SMP_BIN_BITS : 0u;
}

// Rank-order bucket of a key inside [lo, lo + (SMP_BINS << shift)): bucket 0
// holds the largest keys.
__device__ __forceinline__ u32 key_bin(u64 key, u64 lo, u32 shift) {
    return (SMP_BINS - 1u) - (u32)((key - lo) >> shift);
}

// Narrows [lo, hi] to the keys of bucket `bin`.
__device__ __forceinline__ void narrow(u64& lo, u64& hi, u32 shift, u32 bin) {
    u64 nlo = lo + ((u64)((SMP_BINS - 1u) - bin) << shift);
    u64 mask = (1ull << shift) - 1ull;
    hi = (hi - nlo <= mask) ? hi : nlo + mask;
    lo = nlo;
}

__device__ __forceinline__ u32 pow2_at_least(u32 n) {
    return n <= 1u ? 1u : 1u << (32 - __clz(n - 1u));
}

// ---------------------------------------------------------------------------
// Block-wide primitives (every thread of the block must call them)
// ---------------------------------------------------------------------------

// Largest value, lowest index among equal ones; every thread gets it.
__device__ __forceinline__ void argmax_combine(float& v, u32& i, float ov, u32 oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

__device__ void block_argmax(float& v, u32& i, float* sf, u32* si) {
    const u32 lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_combine(v, i, __shfl_xor_sync(FULL_MASK, v, o), __shfl_xor_sync(FULL_MASK, i, o));
    __syncthreads();
    if (lane == 0) {
        sf[w] = v;
        si[w] = i;
    }
    __syncthreads();
    v = lane < nw ? sf[lane] : NEG_INF;
    i = lane < nw ? si[lane] : NONE32;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_combine(v, i, __shfl_xor_sync(FULL_MASK, v, o), __shfl_xor_sync(FULL_MASK, i, o));
}

__device__ float block_min(float v, float* sf) {
    const u32 lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(FULL_MASK, v, o));
    __syncthreads();
    if (lane == 0) sf[w] = v;
    __syncthreads();
    v = lane < nw ? sf[lane] : POS_INF;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

__device__ u64 block_sum_u64(u64 v, u64* sm) {
    const u32 lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    __syncthreads();
    if (lane == 0) sm[w] = v;
    __syncthreads();
    v = lane < nw ? sm[lane] : 0ull;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ void block_minmax_u64(u64& lo, u64& hi, u64* s1, u64* s2) {
    const u32 lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        u64 a = __shfl_xor_sync(FULL_MASK, lo, o), b = __shfl_xor_sync(FULL_MASK, hi, o);
        lo = a < lo ? a : lo;
        hi = b > hi ? b : hi;
    }
    __syncthreads();
    if (lane == 0) {
        s1[w] = lo;
        s2[w] = hi;
    }
    __syncthreads();
    lo = lane < nw ? s1[lane] : NONE64;
    hi = lane < nw ? s2[lane] : 0ull;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        u64 a = __shfl_xor_sync(FULL_MASK, lo, o), b = __shfl_xor_sync(FULL_MASK, hi, o);
        lo = a < lo ? a : lo;
        hi = b > hi ? b : hi;
    }
}

// Exclusive scan of (count, mass) pairs in thread order; also returns the
// block totals. Synchronises on entry (the scratch may still be read by an
// earlier reduction) and on exit (so it may be reused at once).
__device__ void block_excl_scan(u32& c, u64& m, u32& tot_c, u64& tot_m, u32* sc, u64* sm) {
    const u32 lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    __syncthreads();
    u32 ic = c;
    u64 im = m;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        u32 tc = __shfl_up_sync(FULL_MASK, ic, o);
        u64 tm = __shfl_up_sync(FULL_MASK, im, o);
        if (lane >= (u32)o) {
            ic += tc;
            im += tm;
        }
    }
    if (lane == 31) {
        sc[w] = ic;
        sm[w] = im;
    }
    __syncthreads();
    if (w == 0) {
        u32 x = lane < nw ? sc[lane] : 0u;
        u64 y = lane < nw ? sm[lane] : 0ull;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            u32 tx = __shfl_up_sync(FULL_MASK, x, o);
            u64 ty = __shfl_up_sync(FULL_MASK, y, o);
            if (lane >= (u32)o) {
                x += tx;
                y += ty;
            }
        }
        if (lane < nw) {
            sc[lane] = x;
            sm[lane] = y;
        }
    }
    __syncthreads();
    c = (w ? sc[w - 1] : 0u) + ic - c;
    m = (w ? sm[w - 1] : 0ull) + im - m;
    tot_c = sc[nw - 1];
    tot_m = sm[nw - 1];
    __syncthreads();
}

// Bitonic sort of a[0..P), P a power of two, descending (DESC) or
// ascending. The caller fills `a` and synchronises first; ends synchronised
// when P >= 2.
template <typename T, bool DESC>
__device__ void bitonic(T* a, u32 P) {
    for (u32 k = 2; k <= P; k <<= 1) {
        for (u32 j = k >> 1; j > 0; j >>= 1) {
            for (u32 t = threadIdx.x; t < (P >> 1); t += blockDim.x) {
                u32 i = 2u * t - (t & (j - 1u));
                u32 q = i + j;
                T x = a[i], y = a[q];
                bool first = (i & k) == 0;
                bool sw = DESC ? (first ? x < y : x > y) : (first ? x > y : x < y);
                if (sw) {
                    a[i] = y;
                    a[q] = x;
                }
            }
            __syncthreads();
        }
    }
}

// ---- the 64 largest keys of a shared array, without a block-wide sort
//
// A warp holds 64 keys in registers, two per lane: element e = 2 lane + h
// in x[h]. Bitonic stages whose partner is in the same lane swap
// registers; the others exchange with lane ^ (j / 2) by shuffles, so a
// warp sorts or merges with no barrier. A block sorting 1,024 keys in
// shared memory passes 55 barriers (measured: 16k cycles of a 1,024-key
// slice on an H200); the top-64 below passes 8.

// One bitonic compare-exchange stage at distance j inside blocks of k, for
// a final descending order.
__device__ __forceinline__ void warp64_stage(u64 (&x)[2], u32 k, u32 j) {
    const u32 lane = threadIdx.x & 31u;
    if (j == 1u) {
        // Elements 2 lane and 2 lane + 1: the pair's lower index is x[0].
        const bool desc = ((2u * lane) & k) == 0u;
        const u64 a = x[0], b = x[1];
        const bool sw = desc ? a < b : a > b;
        x[0] = sw ? b : a;
        x[1] = sw ? a : b;
        return;
    }
    const u32 d = j >> 1;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 e = 2u * lane + (u32)h;
        const u64 y = __shfl_xor_sync(FULL_MASK, x[h], d);
        const bool lower = (e & j) == 0u;
        const bool desc = (e & k) == 0u;
        // The lower element of a descending pair keeps the larger key.
        const bool keep_max = lower == desc;
        x[h] = keep_max ? (x[h] > y ? x[h] : y) : (x[h] < y ? x[h] : y);
    }
}

// Sorts the warp's 64 keys, descending.
__device__ __forceinline__ void warp64_sort(u64 (&x)[2]) {
#pragma unroll
    for (u32 k = 2; k <= 64u; k <<= 1)
#pragma unroll
        for (u32 j = k >> 1; j > 0u; j >>= 1) warp64_stage(x, k, j);
}

// r (sorted descending) becomes the 64 largest of r and y (sorted
// descending): the elementwise max of r and reversed y is a bitonic
// sequence holding them, which one merge pass sorts.
__device__ __forceinline__ void warp64_merge(u64 (&r)[2], const u64 (&y)[2]) {
    const u32 lane = threadIdx.x & 31u;
    // Element 63 - e of y: lane 31 - lane, the other register.
    const u64 y0 = __shfl_sync(FULL_MASK, y[1], 31u - lane);
    const u64 y1 = __shfl_sync(FULL_MASK, y[0], 31u - lane);
    r[0] = r[0] > y0 ? r[0] : y0;
    r[1] = r[1] > y1 ? r[1] : y1;
#pragma unroll
    for (u32 j = 32; j > 0u; j >>= 1) warp64_stage(r, 64u, j);
}

// out[0..64) = the 64 largest of a[0..n) (0 = no key; keys distinct
// otherwise), descending, 0-padded: the first 64 entries of a descending
// sort of a. `wl` holds 64 keys per warp. Every thread of the block calls
// it; blockDim.x is a multiple of 32. Ends synchronised.
__device__ void block_top64_tree(u64 (&r)[2], u64* out, u64* wl);

__device__ void block_top64(const u64* a, u32 n, u64* out, u64* wl) {
    const u32 lane = threadIdx.x & 31u, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    u64 r[2] = {0ull, 0ull};
    for (u32 c = w * 64u; c < n; c += nw * 64u) {
        u64 x[2];
        x[0] = c + 2u * lane < n ? a[c + 2u * lane] : 0ull;
        x[1] = c + 2u * lane + 1u < n ? a[c + 2u * lane + 1u] : 0ull;
        warp64_sort(x);
        warp64_merge(r, x);
    }
    block_top64_tree(r, out, wl);
}

// block_top64 of `n_lists` lists of `len` <= 64 keys at a + l * len, each
// already descending and 0-padded (the select kernel's per-block
// candidates): a list enters its warp's merge as it is, with no sort, and
// the result is the same (keys are distinct). Ends synchronised.
__device__ void block_top64_lists(const u64* a, u32 n_lists, u32 len, u64* out, u64* wl) {
    const u32 lane = threadIdx.x & 31u, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    u64 r[2] = {0ull, 0ull};
    for (u32 l = w; l < n_lists; l += nw) {
        const u64* L = a + (u64)l * len;
        u64 x[2];
        x[0] = 2u * lane < len ? L[2u * lane] : 0ull;
        x[1] = 2u * lane + 1u < len ? L[2u * lane + 1u] : 0ull;
        warp64_merge(r, x);
    }
    block_top64_tree(r, out, wl);
}

// The end of both: each warp's list r merged pairwise across the warps
// into out (descending). Every thread calls it; ends synchronised.
__device__ void block_top64_tree(u64 (&r)[2], u64* out, u64* wl) {
    const u32 lane = threadIdx.x & 31u, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    // Pairwise tree over the warps' lists.
    for (u32 span = 1; span < nw; span <<= 1) {
        const bool give = (w & (2u * span - 1u)) == span;
        if (give) {
            wl[w * 64u + 2u * lane] = r[0];
            wl[w * 64u + 2u * lane + 1u] = r[1];
        }
        __syncthreads();
        if ((w & (2u * span - 1u)) == 0u && w + span < nw) {
            u64 y[2] = {wl[(w + span) * 64u + 2u * lane], wl[(w + span) * 64u + 2u * lane + 1u]};
            warp64_merge(r, y);
        }
        __syncthreads();
    }
    if (w == 0) {
        out[2u * lane] = r[0];
        out[2u * lane + 1u] = r[1];
    }
    __syncthreads();
}

// Zeroes the histogram. The caller synchronises before filling it.
__device__ __forceinline__ void hist_clear(SmpShared& s) {
    for (u32 b = threadIdx.x; b < SMP_BINS; b += blockDim.x) {
        s.u.h.cnt[b] = 0u;
        s.u.h.mass[b] = 0ull;
    }
}

// Scans the filled histogram in rank order and records in s.xc / s.xm the
// bucket where `above + running count` reaches `gc` and where `above +
// running mass` reaches `gm` (bin NONE32 when the goal is not reached, or
// is NONE). Returns the histogram totals. Ends synchronised: s.xc / s.xm are
// readable, and the histogram is no longer read.
__device__ void find_crossing(SmpShared& s, u32 above_c, u64 above_m, u32 gc, u64 gm,
                              u32& tot_c, u64& tot_m) {
    const u32 per = (SMP_BINS + blockDim.x - 1) / blockDim.x;
    const u32 b0 = threadIdx.x * per;
    const u32 b1 = min(b0 + per, (u32)SMP_BINS);
    u32 c = 0;
    u64 m = 0;
    for (u32 b = b0; b < b1; ++b) {
        c += s.u.h.cnt[b];
        m += s.u.h.mass[b];
    }
    if (threadIdx.x == 0) {
        s.xc.bin = NONE32;
        s.xm.bin = NONE32;
    }
    block_excl_scan(c, m, tot_c, tot_m, s.rc, s.rm);
    u32 ec = above_c + c;
    u64 em = above_m + m;
    for (u32 b = b0; b < b1; ++b) {
        u32 bc = s.u.h.cnt[b];
        u64 bm = s.u.h.mass[b];
        if (gc != NONE32 && ec < gc && ec + bc >= gc) {
            s.xc.bin = b;
            s.xc.cnt = bc;
            s.xc.above_c = ec;
            s.xc.above_m = em;
        }
        if (gm != NONE64 && em < gm && em + bm >= gm) {
            s.xm.bin = b;
            s.xm.cnt = bc;
            s.xm.above_c = ec;
            s.xm.above_m = em;
        }
        ec += bc;
        em += bm;
    }
    __syncthreads();
}

// The earlier of the two crossings (count and mass goals both cut the
// ranking; the kept set ends at whichever cut comes first).
__device__ __forceinline__ SmpCross first_crossing(const SmpShared& s) {
    SmpCross c = s.xc, m = s.xm;
    return m.bin < c.bin ? m : c;
}

// ---------------------------------------------------------------------------
// Repetition penalty
// ---------------------------------------------------------------------------

__device__ __forceinline__ void penalise(float* logits, u32 t, float pen) {
    float l = logits[t];
    logits[t] = l > 0.0f ? __fdiv_rn(l, pen) : __fmul_rn(l, pen);
}

// Penalises each distinct id of the window once: entries c0 .. c0 + W of
// the concatenation rec[0..nr) ++ chain[0..). Only ids in [lo, hi) are
// touched (the caller passes [0, n) for the whole vocabulary, or its own
// slice in the multi-block sampler, whose blocks thus penalise disjoint
// ids). Up to SMP_WIN ids are sorted in shared memory and de-duplicated by
// neighbour; longer windows (never built by the engine) take a quadratic
// scan.
__device__ void penalise_window(float* logits, u32 lo, u32 hi, float pen, const u32* rec,
                                u32 nr, const u32* chain, u32 c0, u32 W, u32* win) {
    auto at = [&](u32 j) -> u32 {
        u32 c = c0 + j;
        return c < nr ? rec[c] : chain[c - nr];
    };
    if (W <= SMP_WIN) {
        const u32 P = pow2_at_least(W);
        for (u32 j = threadIdx.x; j < P; j += blockDim.x) win[j] = j < W ? at(j) : NONE32;
        __syncthreads();
        bitonic<u32, false>(win, P);
        for (u32 j = threadIdx.x; j < W; j += blockDim.x) {
            u32 t = win[j];
            if (t >= lo && t < hi && (j == 0 || win[j - 1] != t)) penalise(logits, t, pen);
        }
    } else {
        for (u32 j = threadIdx.x; j < W; j += blockDim.x) {
            u32 t = at(j);
            if (t < lo || t >= hi) continue;
            bool dup = false;
            for (u32 i = 0; i < j && !dup; ++i) dup = at(i) == t;
            if (!dup) penalise(logits, t, pen);
        }
    }
}

// ---------------------------------------------------------------------------
// 1. Argmax
// ---------------------------------------------------------------------------


// float4s per thread in flight in k_argmax; 0 keeps the four-float loop
// alone (A/B runs).
#ifndef ARGMAX_V4
#define ARGMAX_V4 12
#endif

// Index of the largest of p.n logits, lowest index on ties, NaN ignored, 0
// when nothing beats -inf (the CPU's argmax). Grid 1, block 1024: one
// vector per step, reduced in one block. Inside a chain thread 0 also
// publishes the token and its timestamp to the host and decides whether the
// chain is done.
extern "C" __global__ void __launch_bounds__(SMP_THREADS, 1)
k_argmax(Bind b, ArgmaxParams p, StepArg a) {
    AKUNU_PROLOGUE(a);
    Step st = step_of(a);
    __shared__ float sf[32];
    __shared__ u32 si[32];
    const float* x = (const float*)b.p[0];
    const u32 n = p.n, bd = blockDim.x;
    float bv = NEG_INF;
    u32 bi = NONE32;
    u32 i = threadIdx.x;
    // The vector in float4s, ARGMAX_V4 of them per thread requested before
    // any is compared: two L2 round trips for a 49,152-token vocabulary
    // (ptxas issues 10 of the 12 first), where four floats at a time made
    // twelve dependent ones. That needs the registers: without the launch
    // bound's minimum of one block per SM, ptxas kept the kernel at 32 and
    // sent the loads out five at a time. Indices stay ascending per thread,
    // so the strict `>` keeps the lowest index of equal values.
    if (ARGMAX_V4 > 0 && ((u64)x & 15) == 0) {
        const float4* x4 = (const float4*)x;
        const u32 n4 = n / 4;
        for (u32 base = threadIdx.x; base < n4; base += ARGMAX_V4 * bd) {
            float4 v[ARGMAX_V4 > 0 ? ARGMAX_V4 : 1];
#pragma unroll
            for (u32 j = 0; j < (u32)ARGMAX_V4; ++j) {
                const u32 q = base + j * bd;
                v[j] = q < n4 ? x4[q] : make_float4(NEG_INF, NEG_INF, NEG_INF, NEG_INF);
            }
#pragma unroll
            for (u32 j = 0; j < (u32)ARGMAX_V4; ++j) {
                const u32 e = 4 * (base + j * bd);
                if (v[j].x > bv) { bv = v[j].x; bi = e; }
                if (v[j].y > bv) { bv = v[j].y; bi = e + 1; }
                if (v[j].z > bv) { bv = v[j].z; bi = e + 2; }
                if (v[j].w > bv) { bv = v[j].w; bi = e + 3; }
            }
        }
        // The last n % 4 logits: beyond every index above, so they go last.
        i = 4 * n4 + threadIdx.x;
    }
    // Four loads in flight per thread.
    for (; i + 3u * bd < n; i += 4u * bd) {
        float v0 = x[i], v1 = x[i + bd], v2 = x[i + 2u * bd], v3 = x[i + 3u * bd];
        if (v0 > bv) { bv = v0; bi = i; }
        if (v1 > bv) { bv = v1; bi = i + bd; }
        if (v2 > bv) { bv = v2; bi = i + 2u * bd; }
        if (v3 > bv) { bv = v3; bi = i + 3u * bd; }
    }
    for (; i < n; i += bd) {
        float v = x[i];
        if (v > bv) { bv = v; bi = i; }
    }
    block_argmax(bv, bi, sf, si);
    if (threadIdx.x != 0) return;
    const u32 slot = a.patch == PATCH_ARGMAX_OUTPUT ? st.tok + st.rows : 0u;
    publish_token((u32*)b.p[1], slot, bi == NONE32 ? 0u : bi, a.ctl);
}

// ---------------------------------------------------------------------------
// 2. Gumbel sampling
// ---------------------------------------------------------------------------

// What the filter needs to recompute any token's membership, bucket and
// weight, identically in every pass.
struct Filt {
    float mx;      // largest logit (finite)
    float inv_t;   // 1 / temperature
    float min_w;   // min-p weight floor, 0 = off
    float scale;   // level-0 buckets per unit of scaled distance
    float fxs;     // 2^fx_bits: weights as fixed-point integers
};

__device__ __forceinline__ float scaled(float l, const Filt& f) {
    return __fmul_rn(__fsub_rn(l, f.mx), f.inv_t);
}

__device__ __forceinline__ u64 fixed_weight(float sc, const Filt& f) {
    return __float2ull_rn(__fmul_rn(expf(sc), f.fxs));
}

// In the pool S: finite (the max is finite, so `> -inf` excludes -inf and
// NaN only) and passing min-p.
__device__ __forceinline__ bool in_pool(float l, float sc, const Filt& f) {
    return l > NEG_INF && (f.min_w <= 0.0f || expf(sc) >= f.min_w);
}

// Level-0 bucket: linear in the scaled distance from the max (as the CPU's
// KeyBound), so buckets follow the logits' spread rather than their float
// exponents. Monotone in the logit; bucket 0 holds the max.
__device__ __forceinline__ u32 level0_bin(float sc, const Filt& f) {
    float d = __fmul_rn(-sc, f.scale);
    return d < (float)(SMP_BINS - 1) ? (u32)d : (u32)(SMP_BINS - 1);
}

// In-chain sampling: repetition penalty over the window, then (unless
// greedy) either the dense transform `(l - max) / T + G` (no filter) or the
// filtered one: every kept token becomes `ln p + G`, every other -inf, so a
// following argmax draws from the filtered distribution. G is the Gumbel
// noise of (seed, kv_len, token). Grid 1, block 1024: the selection needs
// block-wide agreement on thresholds, and one block keeps it in shared
// memory; the vocabulary (L2-resident) is streamed a few times.
//
// The launcher uses it for what the multi-block pair below does not cover
// (a filter without top-k, candidate sets too large for its merge, and
// AKUNU_CUDA_SAMPLE_MB=0); the pair reproduces its output bit for bit.
//
// Passes over the vocabulary for the filtered path: max, histogram, gather
// of the crossing bucket, write. A crossing bucket of more than SMP_CAP
// tokens (heavy ties, clustered logits) adds one key-range pass and one
// histogram pass per narrowing level (1 or 2 in practice, 6 at most).
extern "C" __global__ void __launch_bounds__(SMP_THREADS, 1)
k_gumbel_sample(Bind b, SampleParams p, StepArg a) {
    AKUNU_PROLOGUE(a);
    Step st = step_of(a);
    __shared__ SmpShared s;
    float* logits = (float*)b.p[0];
    const u32 n = p.n_vocab, bd = blockDim.x, tid = threadIdx.x;
    const u32 kv_len = a.patch == PATCH_KV_SEQ_LEN ? st.pos + st.rows : p.kv_len;
    if (n == 0) return;

    // ---- repetition penalty over the last repeat_last_n of recent ++ chain
    if (p.repeat_penalty != 1.0f) {
        const u32* rb = (const u32*)b.p[1];
        const u32 chain_start = rb[0];
        const u32 nr = min(rb[1], p.recent_capacity);
        const u32 sch = kv_len > chain_start ? kv_len - chain_start : 0u;
        const u32 total = nr + sch;
        const u32 W = min(total, p.repeat_last_n);
        if (W > 0) {
            penalise_window(logits, 0u, n, p.repeat_penalty, rb + 2, nr,
                            (const u32*)b.p[2] + 1, total - W, W, s.u.win);
            __syncthreads();
        }
    }
    if (p.temperature == 0.0f) return;  // greedy: the argmax reads the penalised logits

    const float inv_t = __fdiv_rn(1.0f, p.temperature);
    const bool inv_ok = inv_t > 0.0f && inv_t < POS_INF;
    const u32 base = position_base(p.seed_lo, p.seed_hi, kv_len);

    // ---- pass A: max (lowest index), smallest finite logit
    float mx = NEG_INF, mn = POS_INF;
    u32 am = NONE32;
    {
        u32 i = tid;
        for (; i + 3u * bd < n; i += 4u * bd) {
            float v0 = logits[i], v1 = logits[i + bd], v2 = logits[i + 2u * bd],
                  v3 = logits[i + 3u * bd];
            if (v0 > mx) { mx = v0; am = i; }
            if (v1 > mx) { mx = v1; am = i + bd; }
            if (v2 > mx) { mx = v2; am = i + 2u * bd; }
            if (v3 > mx) { mx = v3; am = i + 3u * bd; }
            if (fabsf(v0) < POS_INF) mn = fminf(mn, v0);
            if (fabsf(v1) < POS_INF) mn = fminf(mn, v1);
            if (fabsf(v2) < POS_INF) mn = fminf(mn, v2);
            if (fabsf(v3) < POS_INF) mn = fminf(mn, v3);
        }
        for (; i < n; i += bd) {
            float v = logits[i];
            if (v > mx) { mx = v; am = i; }
            if (fabsf(v) < POS_INF) mn = fminf(mn, v);
        }
    }
    block_argmax(mx, am, s.rf, s.rc);
    mn = block_min(mn, s.rf);
    const bool mx_finite = fabsf(mx) < POS_INF;

    // ---- no filter: every token a candidate
    const bool no_filter = p.top_k == 0 && p.top_p >= 1.0f && p.min_p <= 0.0f;
    if (no_filter && inv_ok && mx_finite) {
        for (u32 i = tid; i < n; i += bd) {
            float l = logits[i];
            float g = gumbel_from_hash(pcg_hash(base ^ i));
            logits[i] = l > NEG_INF ? __fadd_rn(__fmul_rn(__fsub_rn(l, mx), inv_t), g) : NEG_INF;
        }
        return;
    }

    // ---- a single certain token: 1/T unusable (argmax), all masked (token
    // 0, which the argmax gives too) or a +inf logit (the first one: again
    // the argmax)
    if (!inv_ok || !mx_finite) {
        const u32 tok = am == NONE32 ? 0u : am;
        for (u32 i = tid; i < n; i += bd) logits[i] = i == tok ? 0.0f : NEG_INF;
        return;
    }

    // ---- filtered path
    Filt f;
    f.mx = mx;
    f.inv_t = inv_t;
    f.min_w = p.min_p > 0.0f ? fminf(p.min_p, 1.0f) : 0.0f;
    {
        // Level-0 range: up to the farthest finite logit, or the min-p
        // bound (beyond it nothing is in the pool).
        float span = __fmul_rn(__fsub_rn(mx, mn), inv_t);
        if (f.min_w > 0.0f) span = fminf(span, (float)(-log((double)f.min_w)) * 1.001f + 1e-4f);
        float scale = (span > 0.0f && span < POS_INF) ? (float)(SMP_BINS - 1) / span : 0.0f;
        f.scale = scale < POS_INF ? scale : 0.0f;
    }
    // Weights in [0, 1] as integers of fx_bits fractional bits: n of them
    // sum below 2^62, and each is exact unless below 2^(24 - fx_bits).
    const u32 fx_bits = 62u - (32u - (u32)__clz((int)n));
    f.fxs = __uint_as_float((127u + fx_bits) << 23);
    const bool top_p_on = p.top_p < 1.0f;

    // ---- pass B: level-0 histogram of the pool; softmax mass of every
    // finite token (top-p measures against it)
    hist_clear(s);
    __syncthreads();
    u64 all_mass = 0;
    for (u32 i = tid; i < n; i += bd) {
        float l = logits[i];
        if (!(l > NEG_INF)) continue;
        float sc = scaled(l, f);
        u64 w = fixed_weight(sc, f);
        all_mass += w;
        if (in_pool(l, sc, f)) {
            u32 bin = level0_bin(sc, f);
            atomicAdd(&s.u.h.cnt[bin], 1u);
            atomicAdd(&s.u.h.mass[bin], w);
        }
    }
    __syncthreads();
    all_mass = block_sum_u64(all_mass, s.rm);

    const u32 gc = p.top_k > 0 ? p.top_k : NONE32;
    u64 gm = NONE64;
    if (top_p_on) {
        gm = __double2ull_ru((double)fmaxf(p.top_p, 0.0f) * (double)all_mass);
        gm = gm > 0 ? gm : 1ull;
    }
    u32 pool_c;
    u64 pool_m;
    find_crossing(s, 0u, 0ull, gc, gm, pool_c, pool_m);
    SmpCross x = first_crossing(s);

    u64 thr = 0;           // kept: in the pool and rank key >= thr
    u64 kept_mass = pool_m;  // fixed-point weight of the kept set
    if (x.bin != NONE32) {
        // The cut lies in bucket x.bin; everything ranked before it is kept.
        u32 above_c = x.above_c;
        u64 above_m = x.above_m;
        u64 lo = 0, hi = NONE64;
        const u32 bin0 = x.bin;
        bool keyed = false;  // region given by [lo, hi] rather than bin0
        if (x.cnt > SMP_CAP) {
            // Too many tokens to sort: narrow by key ranges. First the key
            // range of the bucket (its members' keys are contiguous in rank
            // order within the pool, since bucket and pool are monotone).
            u64 klo = NONE64, khi = 0;
            for (u32 i = tid; i < n; i += bd) {
                float l = logits[i];
                if (!(l > NEG_INF)) continue;
                float sc = scaled(l, f);
                if (in_pool(l, sc, f) && level0_bin(sc, f) == bin0) {
                    u64 k = rank_key(l, i);
                    klo = k < klo ? k : klo;
                    khi = k > khi ? k : khi;
                }
            }
            block_minmax_u64(klo, khi, s.rm, s.rm2);
            lo = klo;
            hi = khi;
            keyed = true;
            // Each level shrinks the range SMP_BINS-fold: at most 6 levels
            // for 64-bit keys; a bucket of shift 0 holds one token.
            for (int level = 0; level < 8; ++level) {
                const u32 shift = bin_shift(hi - lo);
                __syncthreads();  // the previous crossing has been read
                hist_clear(s);
                __syncthreads();
                for (u32 i = tid; i < n; i += bd) {
                    float l = logits[i];
                    if (!(l > NEG_INF)) continue;
                    u64 k = rank_key(l, i);
                    if (k < lo || k > hi) continue;
                    float sc = scaled(l, f);
                    if (!in_pool(l, sc, f)) continue;
                    u32 bin = key_bin(k, lo, shift);
                    atomicAdd(&s.u.h.cnt[bin], 1u);
                    atomicAdd(&s.u.h.mass[bin], fixed_weight(sc, f));
                }
                __syncthreads();
                u32 tc;
                u64 tm;
                find_crossing(s, above_c, above_m, gc, gm, tc, tm);
                SmpCross y = first_crossing(s);
                if (y.bin == NONE32) break;  // cannot happen: the region holds the cut
                narrow(lo, hi, shift, y.bin);
                above_c = y.above_c;
                above_m = y.above_m;
                if (y.cnt <= SMP_CAP) break;
            }
        }

        // ---- gather the crossing bucket, sort it, walk it
        if (tid == 0) s.ncand = 0;
        __syncthreads();
        for (u32 i = tid; i < n; i += bd) {
            float l = logits[i];
            if (!(l > NEG_INF)) continue;
            float sc = scaled(l, f);
            if (!in_pool(l, sc, f)) continue;
            u64 k = rank_key(l, i);
            bool member = keyed ? (k >= lo && k <= hi) : level0_bin(sc, f) == bin0;
            if (member) {
                u32 at = atomicAdd(&s.ncand, 1u);
                if (at < SMP_CAP) s.u.cand[at] = k;
            }
        }
        __syncthreads();
        const u32 m = min(s.ncand, (u32)SMP_CAP);
        const u32 P = pow2_at_least(m);
        for (u32 j = m + tid; j < P; j += bd) s.u.cand[j] = 0ull;  // ranks last
        if (tid == 0) {
            s.jm = NONE32;
            s.incl_c = 0;
            s.incl_m = 0;
        }
        __syncthreads();
        bitonic<u64, true>(s.u.cand, P);

        // Count cut: the gc-th token of the ranking, if it lies here.
        const u32 jc = (gc != NONE32 && gc > above_c && gc - above_c <= m) ? gc - above_c - 1u
                                                                         : NONE32;
        // Mass cut: the first token where above + running mass reaches gm.
        const u32 per = (m + bd - 1) / bd;
        const u32 j0 = min(tid * per, m), j1 = min(j0 + per, m);
        u32 dummy = 0, tc;
        u64 run = 0, tm;
        for (u32 j = j0; j < j1; ++j) run += fixed_weight(scaled(rank_logit(s.u.cand[j]), f), f);
        block_excl_scan(dummy, run, tc, tm, s.rc, s.rm);
        u64 em = above_m + run;
        for (u32 j = j0; j < j1; ++j) {
            u64 w = fixed_weight(scaled(rank_logit(s.u.cand[j]), f), f);
            if (gm != NONE64 && em < gm && em + w >= gm) {
                s.jm = j;
                s.incl_m = em + w;
            }
            if (j == jc) s.incl_c = em + w;
            em += w;
        }
        __syncthreads();
        const u32 jm = s.jm;
        u32 L;
        if (jm != NONE32 && (jc == NONE32 || jm < jc)) {
            L = jm;
            kept_mass = s.incl_m;
        } else {
            // jc exists here: the bucket was chosen for one of the cuts.
            L = jc == NONE32 ? (m ? m - 1u : 0u) : jc;
            kept_mass = jc == NONE32 ? above_m + tm : s.incl_c;
        }
        thr = s.u.cand[L];
    }

    // ---- write: kept tokens get ln p + G, the rest -inf
    const double ln_sum = log(ldexp((double)kept_mass, -(int)fx_bits));
    for (u32 i = tid; i < n; i += bd) {
        float l = logits[i];
        float out = NEG_INF;
        if (l > NEG_INF) {
            float sc = scaled(l, f);
            if (in_pool(l, sc, f) && rank_key(l, i) >= thr) {
                float ln_p = __double2float_rn((double)sc - ln_sum);
                out = __fadd_rn(ln_p, gumbel_from_hash(pcg_hash(base ^ i)));
            }
        }
        logits[i] = out;
    }
}

// ---------------------------------------------------------------------------
// 2b. Gumbel sampling on many blocks
// ---------------------------------------------------------------------------
//
// The single-block k_gumbel_sample is a latency chain of several passes over
// the vocabulary on one SM (about 50 us a token for 49,152 logits on an
// H200). For the configurations the engine uses (top-k with or without
// top-p / min-p; temperature only; greedy with a penalty) the launcher runs
// two kernels instead, each a grid of G blocks that own one slice of
// `slice` logits (launch.rs `sample_grid`; G = ceil(n / slice)):
//
//   k_sample_prep    the repetition penalty on the slice's ids, and the
//                    slice's max (lowest index) into the scratch partials;
//   k_sample_select  every block reduces the G partials to the global max
//                    (the same value and index as the single-block
//                    reduction: largest, lowest index among equal ones),
//                    then on its slice: the softmax mass of the finite
//                    tokens, the rank keys of the pool, and its best
//                    Kc = min(top-k, slice) keys (smb_rank_top for top-k
//                    <= 64, else a shared-memory sort), which it
//                    publishes; every other token of the slice
//                    becomes -inf. The last block to finish (ticket) merges
//                    the G * Kc keys, finds the top-k / top-p cut exactly as
//                    the single-block kernel does, and writes ln p + G for
//                    the kept candidates and -inf for the rest.
//
// Why exact: the kept set is a prefix of the pool's rank order (min-p and
// the pool are monotone in the logit), of length L + 1 <= top-k, so it lies
// in the union of the blocks' top-Kc; the merged, sorted keys are the
// global ranking's head. Masses are the same fixed-point integers, summed
// exactly (any order); the written values use the same expressions. So the
// output is the single-block kernel's bit for bit (tests:
// gpu_sampling_kernels.rs `multi_block_*`).
//
// Why two kernels: the weights of top-p need the global max first, and a
// grid can only meet once through a ticket. The prep kernel doubles as the
// only kernel for greedy (temperature 0) steps.
//
// Scratch (CudaBackend::sample_scratch, SMB_SCRATCH_BYTES, zeroed once):
//   [0, 4)                  the select kernel's ticket
//   [SMB_PART_OFF, +8 G)    per-block (max bits, argmax id) of the prep kernel
//   [SMB_MASS_OFF, +8 G)    per-block fixed-point mass of the select kernel
//   [SMB_CAND_OFF, +8 G Kc) per-block best keys, descending, 0-padded
// Several launches (the rows of a verification step, the steps of a chain)
// use it one after another: each kernel waits for the previous one to end.

#define SMB_THREADS 512     // block of both kernels
#define SMB_SLICE_MAX 4096  // largest slice (keys sorted in shared memory)
#define SMB_CAND_CAP 4096   // most merged keys (G * Kc)
#define SMB_MAX_GRID 1024   // most blocks
#define SMB_PART_OFF 256
#define SMB_MASS_OFF (SMB_PART_OFF + 8 * SMB_MAX_GRID)
#define SMB_CAND_OFF (SMB_MASS_OFF + 8 * SMB_MAX_GRID)
#define SMB_SCRATCH_BYTES (SMB_CAND_OFF + 8 * SMB_CAND_CAP)
// StepArg flags of k_sample_select. SMB_PICK: the select kernel also does
// the table's next command, the Argmax over the logits it writes (launch.rs
// `sampler_picks`): the last block, which holds every kept candidate, picks
// the best and publishes it as k_argmax would, and the Argmax launch is
// dropped. The conveyor is binding 7. SMB_PICK_PATCHED: that Argmax's
// output is patched (slot tok + rows), else it writes slot 0.
#ifndef SMB_MERGE_SORT
#define SMB_MERGE_SORT 0
#endif
#define SMB_PICK 1u
#define SMB_PICK_PATCHED 2u
// Loads a thread of k_sample_select requests before using the first: its
// slice's logits, and the merge's keys (a slice of 1,024 is 2 a thread, the
// merge's 1,920 keys 4). 1 = one at a time (A/B runs).
#ifndef SMB_AHEAD
#define SMB_AHEAD 4
#endif

// Developer timing (AKUNU_CUDA_DEFINES=-DSMB_TIMING): thread 0 of block 0
// and of the merging block note the SM clock at the phase marks and print
// the phase lengths in cycles every 64th position.
#ifdef SMB_TIMING
#define SMB_MARK(k) (t_mark[k] = clock64())
#define SMB_TIMING_DECL long long t_mark[10] = {0};
// One printf per report, so that the two blocks' lines do not interleave.
#define SMB_D(q) (t_mark[q] && t_mark[q - 1] && (q) < (n) ? t_mark[q] - t_mark[q - 1] : 0ll)
// Then the candidates smb_rank_top had (slice, merge).
#define SMB_REPORT(who, cond, n)                                                               \
    do {                                                                                       \
        if ((cond) && tid == 0 && kv_len % 64u == 0u) {                                        \
            printf("smb %s kv %u: %lld %lld %lld %lld %lld %lld %lld %lld %lld\n", who, kv_len, \
                   SMB_D(1), SMB_D(2), SMB_D(3), SMB_D(4), SMB_D(5), SMB_D(6), SMB_D(7),        \
                   SMB_D(8), SMB_D(9));                                                        \
            printf("smbc %s kv %u: %u %u\n", who, kv_len, s.nc, s.ncm);                        \
        }                                                                                      \
    } while (0)
#else
#define SMB_REPORT(who, cond, n) ((void)0)
#define SMB_MARK(k) ((void)0)
#define SMB_TIMING_DECL
#endif

struct __align__(16) SmbShared {
    // A block's slice keys, then (last block) the merged keys: SMB_SLICE_MAX
    // == SMB_CAND_CAP, and the two uses are separated by barriers.
    u64 keys[SMB_CAND_CAP];
    u64 top[64];  // the best keys, descending, 0-padded (top-k <= 64)
    // block_top64's per-warp lists, or smb_rank_top's candidates (16-byte
    // aligned: read two keys at a time).
    u64 wl[(SMB_THREADS / 32) * 64];
    u64 mbound;  // merge: the candidates' lower bound (a j-th key)
    u32 bound;   // slice: the candidates' lower bound (ordered logit bits)
    u32 nc;      // slice candidates
    u32 ncm;     // merge candidates
    u32 rc[32];
    u64 rm[32];
    float rf[32];
    u32 last;    // this block took the last ticket
    u32 nnz;     // nonzero merged keys
    u32 jm;      // mass cut index
    u64 incl_c, incl_m;
};

// The K = min(top-k, slice) <= 64 best keys by ranking a few candidates
// (SMB_RANK=1) rather than merging sorted lists of 64 (only the first K of
// the 64 are ever read). A lower bound b is found first such that at least
// K keys are >= b; every key of the K best is then >= b, and so is every
// key above any of them, so a candidate's rank among the candidates (how
// many candidates are larger) is its rank among all keys. The bounds: in a
// slice, the smallest over the 16 warps of each warp's ceil(K / 16)-th
// largest lane value (a lane's best ordered logit); in the merge, a j-th
// key of the G sorted lists (see there). A zero bound (some warp or list
// too short) admits every key; more than SMB_RANK_CAP candidates take
// block_top64 / block_top64_lists instead, whose first K keys are the same.
#ifndef SMB_RANK
#define SMB_RANK 1
#endif
#ifndef SMB_RANK_CAP
#define SMB_RANK_CAP 384
#endif
// The candidate list's length: SMB_RANK_CAP keys, then zeros for
// smb_rank_top's loads of eight pairs per lane past the end.
#define SMB_RANK_LIST (SMB_RANK_CAP + 2 * 8 * 32)
static_assert(SMB_THREADS / 32 * 4 >= 64, "the slice bound needs 16 warps for K <= 64");
static_assert(SMB_RANK_LIST <= (SMB_THREADS / 32) * 64, "candidates live in SmbShared::wl");

// Largest m such that at least k <= 4 lanes hold v >= m, or 0 when fewer
// than k lanes hold a nonzero v. k warp-uniform; every lane calls it.
__device__ __forceinline__ u32 warp_kth_largest(u32 v, u32 k) {
    u32 seen = 0, m = 0;
    for (u32 r = 0; r < 4u && seen < k; ++r) {
        m = __reduce_max_sync(FULL_MASK, v);
        if (m == 0u) return 0u;
        seen += (u32)__popc(__ballot_sync(FULL_MASK, v == m));
        if (v == m) v = 0u;
    }
    return m;
}

// Appends `key` to list[0..cap) at counter *n when `take`: one shared atomic
// per warp. Every lane of the warp calls it.
__device__ __forceinline__ void warp_append(bool take, u64 key, u32* n, u64* list, u32 cap) {
    const u32 lane = threadIdx.x & 31u, m = __ballot_sync(FULL_MASK, take);
    if (m == 0u) return;
    const u32 leader = (u32)__ffs((int)m) - 1u;
    u32 q = 0;
    if (lane == leader) q = atomicAdd(n, (u32)__popc(m));
    q = __shfl_sync(FULL_MASK, q, leader) + (u32)__popc(m & ((1u << lane) - 1u));
    if (take && q < cap) list[q] = key;
}

// out[r] = cand[q] for each candidate whose rank r (candidates larger) is
// below K. Candidates: C <= SMB_RANK_CAP distinct nonzero keys, 16-byte
// aligned, in a list of SMB_RANK_LIST keys zeroed before the appends (so
// that loads past C read zeros, which count nothing); out is zeroed and
// both are published (barrier) before. A candidate is ranked by S lanes of
// one warp (S a power of two, as many as the block allows), each counting
// every S-th pair of keys, eight pairs requested at a time. Every thread
// calls it; ends synchronised.
__device__ void smb_rank_top(const u64* cand, u32 C, u32 K, u64* out) {
    const u32 bd = blockDim.x, tid = threadIdx.x;
    u32 S = 1;
    while (S < 32u && C * (2u * S) <= bd) S *= 2u;
    const u32 pairs = (C + 1u) / 2u;
    const ulonglong2* c2 = (const ulonglong2*)cand;
    // Block-uniform trip count, so that every lane reaches the shuffles.
    for (u32 base = 0; base < C * S; base += bd) {
        const u32 t = base + tid, q = t / S, part = t % S;
        const bool live = q < C;
        const u64 x = live ? cand[q] : NONE64;
        u32 r = 0;
        if (live) {
            for (u32 k0 = part; k0 < pairs; k0 += 8u * S) {
                ulonglong2 y[8];
                // k0 + 7 S < pairs + 8 S <= 192 + 256 pairs: inside the list.
#pragma unroll
                for (u32 i = 0; i < 8u; ++i) y[i] = c2[k0 + i * S];
#pragma unroll
                for (u32 i = 0; i < 8u; ++i) r += (u32)(y[i].x > x) + (u32)(y[i].y > x);
            }
        }
        for (u32 o = S / 2u; o > 0u; o >>= 1) r += __shfl_xor_sync(FULL_MASK, r, o);
        if (live && part == 0u && r < K) out[r] = x;
    }
    __syncthreads();
}

// smb_rank_top over the nonzero keys of a[0..n) at or above `bound`,
// collected into `list` (zeroed and published before) at counter *nc.
// Returns false, with out untouched, when more than SMB_RANK_CAP keys
// qualify: the caller then takes its sorting fallback, whose first K keys
// are the same. Every thread calls it; ends synchronised.
__device__ bool smb_top_by_rank(const u64* a, u32 n, u64 bound, u32* nc, u64* list, u32 K, u64* out) {
    const u32 bd = blockDim.x, tid = threadIdx.x;
    for (u32 j0 = 0; j0 < n; j0 += bd) {  // warp-uniform trips
        const u64 key = j0 + tid < n ? a[j0 + tid] : 0ull;
        warp_append(key != 0ull && key >= bound, key, nc, list, SMB_RANK_CAP);
    }
    __syncthreads();
    const u32 C = *nc;
    if (C > SMB_RANK_CAP) return false;
    smb_rank_top(list, C, K, out);
    return true;
}

// The window of the sampler's penalty (as k_gumbel_sample computes it),
// applied to the ids in [lo, hi) of this block. Block-uniform; ends
// synchronised when it touched anything.
__device__ void smb_penalise(const Bind& b, const SampleParams& p, u32 kv_len, u32 lo, u32 hi,
                             u32* win) {
    if (p.repeat_penalty == 1.0f) return;
    const u32* rb = (const u32*)b.p[1];
    const u32 chain_start = rb[0];
    const u32 nr = min(rb[1], p.recent_capacity);
    const u32 sch = kv_len > chain_start ? kv_len - chain_start : 0u;
    const u32 total = nr + sch;
    const u32 W = min(total, p.repeat_last_n);
    if (W == 0) return;
    penalise_window((float*)b.p[0], lo, hi, p.repeat_penalty, rb + 2, nr, (const u32*)b.p[2] + 1,
                    total - W, W, win);
    __syncthreads();  // the slice's penalised logits are visible to the block
}

// Pass 1: penalty and partial max. Grid G, block SMB_THREADS.
extern "C" __global__ void __launch_bounds__(SMB_THREADS)
k_sample_prep(Bind b, SampleParams p, StepArg a, char* scratch, u32 slice) {
    AKUNU_GRID_DEPS();
    // The select kernel's ticket is reset here, before anything can return:
    // a select grid cut short (a `done` raised by the host while its blocks
    // were starting) may leave it partly counted, and a prep launch always
    // runs, whole, between two select launches. (The select kernel's last
    // block resets it too.)
    if (blockIdx.x == 0 && threadIdx.x == 0) *(u32*)scratch = 0u;
    if (a.ctl && *(volatile const u32*)&a.ctl->done) return;
    Step st = step_of(a);
    __shared__ u32 win[SMP_WIN];
    __shared__ float sf[32];
    __shared__ u32 si[32];
    const float* logits = (const float*)b.p[0];
    const u32 n = p.n_vocab, bd = blockDim.x, tid = threadIdx.x;
    const u32 lo = blockIdx.x * slice;
    if (lo >= n) return;  // the launcher sizes the grid so that none is empty
    const u32 hi = min(lo + slice, n);
    const u32 kv_len = a.patch == PATCH_KV_SEQ_LEN ? st.pos + st.rows : p.kv_len;
    smb_penalise(b, p, kv_len, lo, hi, win);
    if (p.temperature == 0.0f) return;  // greedy: the argmax reads the penalised logits

    // Ascending indices per thread with a strict `>`, then the block
    // reduction: the slice's largest value, lowest index among equal ones.
    float mx = NEG_INF;
    u32 am = NONE32;
    for (u32 i = lo + tid; i < hi; i += bd) {
        float v = logits[i];
        if (v > mx) {
            mx = v;
            am = i;
        }
    }
    block_argmax(mx, am, sf, si);
    if (tid == 0) {
        uint2* part = (uint2*)(scratch + SMB_PART_OFF);
        part[blockIdx.x] = make_uint2(__float_as_uint(mx), am);
    }
}

// Pass 2: selection and write. Grid G (the prep kernel's), block
// SMB_THREADS. The launcher runs it only when temperature != 0 and either
// no filter applies or 1 <= top-k with G * min(top-k, slice) <=
// SMB_CAND_CAP (launch.rs `sample_grid`); other filters take
// k_gumbel_sample.
extern "C" __global__ void __launch_bounds__(SMB_THREADS)
k_sample_select(Bind b, SampleParams p, StepArg a, char* scratch, u32 slice) {
    AKUNU_PROLOGUE(a);
    SMB_TIMING_DECL
    Step st = step_of(a);
    __shared__ SmbShared s;
    float* logits = (float*)b.p[0];
    const u32 n = p.n_vocab, bd = blockDim.x, tid = threadIdx.x, G = gridDim.x;
    const u32 lo = blockIdx.x * slice;
    if (lo >= n) return;  // never: the grid has no empty block (the ticket needs all G)
    const u32 hi = min(lo + slice, n), cnt = hi - lo;
    const u32 kv_len = a.patch == PATCH_KV_SEQ_LEN ? st.pos + st.rows : p.kv_len;
    if (p.temperature == 0.0f) return;

    const float inv_t = __fdiv_rn(1.0f, p.temperature);
    const bool inv_ok = inv_t > 0.0f && inv_t < POS_INF;
    const u32 base = position_base(p.seed_lo, p.seed_hi, kv_len);

    if (tid == 0) {
        // Before the first barrier (block_argmax's): the bounds and the
        // counters change only after it.
        s.bound = ~0u;
        s.mbound = 0;
        s.nc = 0;
        s.ncm = 0;
    }
    SMB_MARK(0);
    // ---- the global max and its lowest index, from the prep partials
    // (L2 loads: written by the previous grid)
    float mx = NEG_INF;
    u32 am = NONE32;
    {
        const uint2* part = (const uint2*)(scratch + SMB_PART_OFF);
        for (u32 g = tid; g < G; g += bd) {
            uint2 v = __ldcg(part + g);
            argmax_combine(mx, am, __uint_as_float(v.x), v.y);
        }
        block_argmax(mx, am, s.rf, s.rc);
    }
    SMB_MARK(1);
    const bool mx_finite = fabsf(mx) < POS_INF;

    // The two unfiltered outcomes need no merge: every block writes its
    // slice and returns (the branch depends only on the params and the
    // global max, so the whole grid takes it and no ticket is taken).
    const bool no_filter = p.top_k == 0 && p.top_p >= 1.0f && p.min_p <= 0.0f;
    if (no_filter && inv_ok && mx_finite) {
        for (u32 i = lo + tid; i < hi; i += bd) {
            float l = logits[i];
            float g = gumbel_from_hash(pcg_hash(base ^ i));
            logits[i] = l > NEG_INF ? __fadd_rn(__fmul_rn(__fsub_rn(l, mx), inv_t), g) : NEG_INF;
        }
        return;
    }
    if (!inv_ok || !mx_finite) {
        const u32 tok = am == NONE32 ? 0u : am;
        for (u32 i = lo + tid; i < hi; i += bd) logits[i] = i == tok ? 0.0f : NEG_INF;
        // The argmax of that vector is `tok`: every block knows it.
        if ((a.flags & SMB_PICK) && blockIdx.x == 0 && tid == 0)
            publish_token((u32*)b.p[7], (a.flags & SMB_PICK_PATCHED) ? st.tok + st.rows : 0u, tok,
                          a.ctl);
        return;
    }

    // ---- filtered (top-k >= 1 here)
    Filt f;
    f.mx = mx;
    f.inv_t = inv_t;
    f.min_w = p.min_p > 0.0f ? fminf(p.min_p, 1.0f) : 0.0f;
    f.scale = 0.0f;  // no level-0 buckets here
    const u32 fx_bits = 62u - (32u - (u32)__clz((int)n));
    f.fxs = __uint_as_float((127u + fx_bits) << 23);
    const u32 Kc = min(p.top_k, slice);

    // Slice keys (0 = not in the pool: -inf, NaN, below min-p; real keys
    // are never 0) and the slice's mass of finite tokens (top-p measures
    // against all of them, as the single-block kernel).
    // The slice's keys in rank order, at least the first Kc of them: for
    // top-k <= 64 (the engine's usual settings) the Kc best (smb_rank_top)
    // or the 64 best (block_top64), a block sort otherwise.
#ifdef SMB_NO_TOP64
    const bool top64 = false;  // developer A/B: the block sort only
#else
    const bool top64 = p.top_k <= 64u;
#endif
    const u32 P = pow2_at_least(cnt);
    u64 mass = 0;
    u32 lane_best = 0;  // this thread's best ordered logit (0: no key)
    for (u32 j0 = tid; j0 < P; j0 += SMB_AHEAD * bd) {
        float lv[SMB_AHEAD];  // SMB_AHEAD loads in flight, then the keys
#pragma unroll
        for (u32 t = 0; t < SMB_AHEAD; ++t) {
            const u32 j = j0 + t * bd;
            lv[t] = j < cnt ? logits[lo + j] : NEG_INF;
        }
#pragma unroll
        for (u32 t = 0; t < SMB_AHEAD; ++t) {
            const u32 j = j0 + t * bd;
            if (j >= P) break;
            const float l = lv[t];
            u64 key = 0;
            if (l > NEG_INF) {
                float sc = scaled(l, f);
                mass += fixed_weight(sc, f);
                if (in_pool(l, sc, f)) key = rank_key(l, lo + j);
            }
            s.keys[j] = key;
            lane_best = max(lane_best, (u32)(key >> 32));
        }
    }
    if (SMB_RANK && top64) {
        const u32 t = warp_kth_largest(lane_best, (Kc + 15u) / 16u);
        if ((tid & 31u) == 0u) atomicMin(&s.bound, t);
        for (u32 j = tid; j < SMB_RANK_LIST; j += bd) s.wl[j] = 0ull;  // smb_rank_top's list
    }
    mass = block_sum_u64(mass, s.rm);  // its barriers also publish s.keys and s.bound
    SMB_MARK(2);
    __syncthreads();
    if (top64 && SMB_RANK) {
        // Candidates: the keys whose ordered logit is at or above the bound.
        const u64 b = (u64)s.bound << 32;
        if (tid < 64u) s.top[tid] = 0ull;
        if (!smb_top_by_rank(s.keys, cnt, b, &s.nc, s.wl, Kc, s.top)) block_top64(s.keys, cnt, s.top, s.wl);
    } else if (top64) {
        block_top64(s.keys, cnt, s.top, s.wl);
    } else {
        bitonic<u64, true>(s.keys, P);
        __syncthreads();  // (bitonic ends synchronised only when P >= 2)
    }
    const u64* best = top64 ? s.top : s.keys;

    SMB_MARK(3);
    // Publish the best Kc keys (0-padded) and the mass.
    {
        u64* cand = (u64*)(scratch + SMB_CAND_OFF) + (u64)blockIdx.x * Kc;
        for (u32 j = tid; j < Kc; j += bd) cand[j] = j < cnt ? best[j] : 0ull;
        if (tid == 0) ((u64*)(scratch + SMB_MASS_OFF))[blockIdx.x] = mass;
    }
    // Candidates of this slice: nonzero keys >= its kb-th best (keys are
    // distinct, so exactly the published ones). The rest are written -inf
    // now; the candidates are left for the last block, which alone writes
    // them (disjoint addresses: no race). Each token is read and written by
    // the thread that read it above.
    {
        const u32 kb = min(Kc, cnt);
        const u64 thr = best[kb - 1u];
        for (u32 j = tid; j < cnt; j += bd) {
            const u32 i = lo + j;
            float l = logits[i];
            u64 key = 0;
            if (l > NEG_INF) {
                float sc = scaled(l, f);
                if (in_pool(l, sc, f)) key = rank_key(l, i);
            }
            if (key == 0ull || key < thr) logits[i] = NEG_INF;
        }
    }

    SMB_MARK(4);
    // ---- ticket: the last block to arrive merges (k_attn_decode's pattern)
    u32* ticket = (u32*)scratch;
    if (!last_to_arrive(ticket, G, &s.last)) {
        SMB_REPORT("block 0", blockIdx.x == 0, 5);
        return;
    }
    SMB_MARK(5);

    // ---- merge: all G * Kc keys, sorted; the global pool's head
    const u32 M = G * Kc;  // <= SMB_CAND_CAP (launcher)
    const u32 PM = pow2_at_least(M);
    const bool rank_merge = SMB_RANK && top64 && !SMB_MERGE_SORT;
    {
        const u64* cand = (const u64*)(scratch + SMB_CAND_OFF);
        for (u32 j0 = tid; j0 < PM; j0 += SMB_AHEAD * bd) {
            u64 v[SMB_AHEAD];  // SMB_AHEAD loads in flight
#pragma unroll
            for (u32 t = 0; t < SMB_AHEAD; ++t) {
                const u32 j = j0 + t * bd;
                v[t] = j < M ? __ldcg(cand + j) : 0ull;
            }
#pragma unroll
            for (u32 t = 0; t < SMB_AHEAD; ++t)
                if (j0 + t * bd < PM) s.keys[j0 + t * bd] = v[t];
        }
        if (rank_merge) {
            // Every thread of this block is past its reads of s.top and s.wl.
            if (tid < 64u) s.top[tid] = 0ull;
            for (u32 j = tid; j < SMB_RANK_LIST; j += bd) s.wl[j] = 0ull;
        }
    }
    u64 all_mass = 0;
    {
        const u64* bm = (const u64*)(scratch + SMB_MASS_OFF);
        for (u32 g = tid; g < G; g += bd) all_mass += __ldcg(bm + g);
    }
    if (tid == 0) {
        s.nnz = 0;
        s.jm = NONE32;
        s.incl_c = 0;
        s.incl_m = 0;
    }
    all_mass = block_sum_u64(all_mass, s.rm);  // barriers: s.keys and the fields are set
    SMB_MARK(6);
    __syncthreads();
    // The pool's head in rank order: with top-k <= 64 its first top-k
    // (smb_rank_top) or 64 keys, which hold every key the cuts below read
    // (they stop by the top-k-th; nnz is then min(nonzero keys, top-k or
    // 64), which decides them the same way because top-k <= 64); else all
    // PM, sorted.
    // The G published lists are each in rank order already (block_top64's
    // output), so they are merged without sorting (SMB_MERGE_SORT=1: as
    // one unsorted set, for A/B runs).
    if (rank_merge) {
        // smb_rank_top's bound: the r-th largest of the lists' jb-th keys,
        // jb = max(2, ceil(Kc / G)) and r = ceil(Kc / jb) <= G, so that r
        // lists hold jb keys at or above it (jb = 2 measured fewer
        // candidates than 1 or 3-4 on the default model's logits and on
        // Gaussian ones). It is the largest jb-th key with at least r - 1
        // others above it: the one nonzero key with exactly r - 1 above
        // (keys are distinct), stored by its thread. When fewer than r lists
        // are that long, no thread stores and the bound stays 0: every key
        // is a candidate. Lists shorter than jb, or more than 256 of them
        // (a G^2 count), take bound 0 as well.
        const u32 jb = max(2u, (Kc + G - 1u) / G), r = (Kc + jb - 1u) / jb;
        if (jb <= Kc && G <= 256u) {
            const u64* jth = s.keys + (jb - 1u);  // list u's jb-th key: jth[u * Kc]
            for (u32 v = tid; v < G; v += bd) {
                const u64 a = jth[v * Kc];
                u32 above = 0;
                for (u32 u0 = 0; u0 < G; u0 += 8u) {  // eight loads in flight
                    u64 y[8];
#pragma unroll
                    for (u32 i = 0; i < 8u; ++i) y[i] = u0 + i < G ? jth[(u0 + i) * Kc] : 0ull;
#pragma unroll
                    for (u32 i = 0; i < 8u; ++i) above += (u32)(y[i] > a);
                }
                if (a != 0ull && above + 1u == r) s.mbound = a;
            }
        }
        __syncthreads();
        if (!smb_top_by_rank(s.keys, M, s.mbound, &s.ncm, s.wl, Kc, s.top))
            block_top64_lists(s.keys, G, Kc, s.top, s.wl);
    } else if (top64 && !SMB_MERGE_SORT) {
        block_top64_lists(s.keys, G, Kc, s.top, s.wl);
    } else if (top64) {
        block_top64(s.keys, PM, s.top, s.wl);
    } else {
        bitonic<u64, true>(s.keys, PM);
        __syncthreads();
    }
    const u64* rk = top64 ? s.top : s.keys;
    const u32 RK = top64 ? 64u : PM;
    for (u32 j = tid; j < RK; j += bd)
        if (rk[j] != 0ull && (j + 1u == RK || rk[j + 1u] == 0ull)) s.nnz = j + 1u;
    __syncthreads();
    SMB_MARK(7);
    const u32 nnz = s.nnz;

    // Cuts, as in k_gumbel_sample with the whole ranking in one bucket:
    // count cut at the top-k-th token, mass cut at the first token where
    // the running mass reaches gm; L is the earlier.
    const u32 gc = p.top_k;
    const u32 jc = gc <= nnz ? gc - 1u : NONE32;
    const u32 m = min(nnz, gc);
    u64 gm = NONE64;
    if (p.top_p < 1.0f) {
        gm = __double2ull_ru((double)fmaxf(p.top_p, 0.0f) * (double)all_mass);
        gm = gm > 0 ? gm : 1ull;
    }
    const u32 per = (m + bd - 1) / bd;
    const u32 j0 = min(tid * per, m), j1 = min(j0 + per, m);
    u32 dummy = 0, tc;
    u64 run = 0, tm;
    for (u32 j = j0; j < j1; ++j) run += fixed_weight(scaled(rank_logit(rk[j]), f), f);
    block_excl_scan(dummy, run, tc, tm, s.rc, s.rm);
    u64 em = run;
    for (u32 j = j0; j < j1; ++j) {
        u64 w = fixed_weight(scaled(rank_logit(rk[j]), f), f);
        if (gm != NONE64 && em < gm && em + w >= gm) {
            s.jm = j;
            s.incl_m = em + w;
        }
        if (j == jc) s.incl_c = em + w;
        em += w;
    }
    __syncthreads();
    const u32 jm = s.jm;
    u32 L;
    u64 kept_mass;
    if (jm != NONE32 && (jc == NONE32 || jm < jc)) {
        L = jm;
        kept_mass = s.incl_m;
    } else {
        // The count cut, or (neither cut reached) the whole pool, which then
        // has fewer than top-k tokens, all of them candidates.
        L = jc == NONE32 ? (m ? m - 1u : 0u) : jc;
        kept_mass = jc == NONE32 ? tm : s.incl_c;
    }

    // ---- write every candidate: kept ones ln p + G, the rest -inf
    SMB_MARK(8);
    const double ln_sum = log(ldexp((double)kept_mass, -(int)fx_bits));
    // With SMB_PICK, also the argmax of what is written: the candidates are
    // every value above -inf in the vector (the blocks wrote -inf over the
    // rest of their slices), so the best (value, lowest id) here is the one
    // k_argmax would find.
    // Kept: the first L + 1 keys in rank order, i.e. (keys being distinct)
    // every merged key at or above the (L+1)-th; s.keys holds all merged
    // keys, in any order.
    const u64 kept_min = rk[L];
    float bv = NEG_INF;
    u32 bi = NONE32;
    for (u32 j = tid; j < PM; j += bd) {
        const u64 key = s.keys[j];
        if (key == 0ull) continue;
        const u32 i = ~(u32)key;
        float out = NEG_INF;
        if (key >= kept_min) {
            // The penalised logit: the key holds it (with -0 as +0, which
            // gives the same output), so no load is needed.
            float sc = scaled(SMB_RANK ? rank_logit(key) : logits[i], f);
            float ln_p = __double2float_rn((double)sc - ln_sum);
            out = __fadd_rn(ln_p, gumbel_from_hash(pcg_hash(base ^ i)));
            if (out > NEG_INF) argmax_combine(bv, bi, out, i);
        }
        logits[i] = out;
    }
    if (a.flags & SMB_PICK) {
        block_argmax(bv, bi, s.rf, s.rc);
        if (tid == 0)
            publish_token((u32*)b.p[7], (a.flags & SMB_PICK_PATCHED) ? st.tok + st.rows : 0u,
                          bi == NONE32 ? 0u : bi, a.ctl);
    }
    SMB_MARK(9);
    SMB_REPORT("last block", true, 10);
    if (tid == 0) *ticket = 0u;  // for the next launch
}

// ---------------------------------------------------------------------------
// 3. Top-k selection
// ---------------------------------------------------------------------------

// The k largest logits as (id, value bits) pairs, descending in total_cmp
// order, ties by lower id (the CPU's top_k). Grid 1, block 1024. Output in
// chunks of up to SMP_CAP: each chunk's threshold key is found by range
// narrowing on a shared histogram, then the chunk is gathered, sorted in
// shared memory and written.
extern "C" __global__ void __launch_bounds__(SMP_THREADS, 1)
k_topk_select(Bind b, TopKParams p, StepArg a) {
    AKUNU_PROLOGUE(a);
    __shared__ SmpShared s;
    const float* x = (const float*)b.p[0];
    u32* out = (u32*)b.p[1];
    const u32 n = p.n_vocab, bd = blockDim.x, tid = threadIdx.x;
    const u32 k = min(p.k, n);
    if (k == 0) return;

    u64 lo_all = NONE64, hi_all = 0;
    for (u32 i = tid; i < n; i += bd) {
        u64 key = total_key(x[i], i);
        lo_all = key < lo_all ? key : lo_all;
        hi_all = key > hi_all ? key : hi_all;
    }
    block_minmax_u64(lo_all, hi_all, s.rm, s.rm2);

    u64 top = hi_all;  // best key not yet written
    for (u32 done = 0; done < k;) {
        const u32 c = min((u32)SMP_CAP, k - done);
        // Threshold: the c-th largest key in [lo_all, top].
        u64 thr = lo_all;
        if (c < n - done) {
            u64 lo = lo_all, hi = top;
            u32 above = 0;
            for (int level = 0; level < 8; ++level) {
                const u32 shift = bin_shift(hi - lo);
                __syncthreads();  // earlier readers of the shared union are done
                hist_clear(s);
                __syncthreads();
                for (u32 i = tid; i < n; i += bd) {
                    u64 key = total_key(x[i], i);
                    if (key >= lo && key <= hi) atomicAdd(&s.u.h.cnt[key_bin(key, lo, shift)], 1u);
                }
                __syncthreads();
                u32 tc;
                u64 tm;
                find_crossing(s, above, 0ull, c, NONE64, tc, tm);
                SmpCross y = s.xc;
                if (y.bin == NONE32) break;  // cannot happen
                narrow(lo, hi, shift, y.bin);
                above = y.above_c;
                if (y.cnt <= SMP_CAP) break;
            }
            // Gather the crossing bucket and pick the (c - above)-th key.
            if (tid == 0) s.ncand = 0;
            __syncthreads();
            for (u32 i = tid; i < n; i += bd) {
                u64 key = total_key(x[i], i);
                if (key >= lo && key <= hi) {
                    u32 at = atomicAdd(&s.ncand, 1u);
                    if (at < SMP_CAP) s.u.cand[at] = key;
                }
            }
            __syncthreads();
            const u32 m = min(s.ncand, (u32)SMP_CAP);
            const u32 P = pow2_at_least(m);
            for (u32 j = m + tid; j < P; j += bd) s.u.cand[j] = 0ull;
            __syncthreads();
            bitonic<u64, true>(s.u.cand, P);
            const u32 r = c - above;  // >= 1 and <= m by the crossing
            thr = s.u.cand[r >= 1 && r <= m ? r - 1u : 0u];
            __syncthreads();  // cand is refilled below
        }
        // Gather the chunk [thr, top] (c keys), sort, write.
        if (tid == 0) s.ncand = 0;
        __syncthreads();
        for (u32 i = tid; i < n; i += bd) {
            u64 key = total_key(x[i], i);
            if (key >= thr && key <= top) {
                u32 at = atomicAdd(&s.ncand, 1u);
                if (at < SMP_CAP) s.u.cand[at] = key;
            }
        }
        __syncthreads();
        const u32 m = min(s.ncand, c);
        const u32 P = pow2_at_least(m);
        for (u32 j = m + tid; j < P; j += bd) s.u.cand[j] = 0ull;
        __syncthreads();
        bitonic<u64, true>(s.u.cand, P);
        for (u32 j = tid; j < m; j += bd) {
            u64 key = s.u.cand[j];
            out[2u * (done + j)] = ~(u32)key;
            out[2u * (done + j) + 1u] = unord_bits((u32)(key >> 32));
        }
        done += c;
        top = thr - 1ull;  // the next chunk ranks below this one
        __syncthreads();  // cand is read above before the next chunk reuses it
    }
}

// ---------------------------------------------------------------------------
// 4. Repetition penalty
// ---------------------------------------------------------------------------

// The CPU's apply_repetition_penalty over the buffer's ids (header n,
// clamped to recent_capacity), once per distinct id: positive logits divided
// by the penalty, others multiplied. Grid 1, block 256: at most 1024 ids,
// de-duplicated with one shared sort.
extern "C" __global__ void __launch_bounds__(256)
k_repetition_penalty(Bind b, PenaltyParams p, StepArg a) {
    AKUNU_PROLOGUE(a);
    __shared__ u32 win[SMP_WIN];
    const u32* rb = (const u32*)b.p[1];
    const u32 nr = min(rb[1], p.recent_capacity);
    if (p.penalty == 1.0f || nr == 0) return;
    penalise_window((float*)b.p[0], 0u, p.n_vocab, p.penalty, rb + 2, nr, nullptr, 0u, nr, win);
}

// ---------------------------------------------------------------------------
// 5. Temperature, 6. grammar mask
// ---------------------------------------------------------------------------

// logits *= 1 / temperature (the CPU multiplies by the reciprocal). Grid
// ceil(n / 256), block 256: one logit per thread.
extern "C" __global__ void __launch_bounds__(256)
k_temperature_scale(Bind b, TemperatureParams p, StepArg a) {
    AKUNU_PROLOGUE(a);
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= p.n_vocab) return;
    float* l = (float*)b.p[0];
    l[i] = __fmul_rn(l[i], __fdiv_rn(1.0f, p.temperature));
}

// Logit i becomes -inf where bit i % 32 of mask word i / 32 is 0. Grid
// ceil(n / 256), block 256: one logit per thread.
extern "C" __global__ void __launch_bounds__(256)
k_grammar_bitmask(Bind b, BitmaskParams p, StepArg a) {
    AKUNU_PROLOGUE(a);
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= p.n_vocab) return;
    const u32 word = ((const u32*)b.p[1])[i >> 5];
    if (((word >> (i & 31u)) & 1u) == 0) ((float*)b.p[0])[i] = NEG_INF;
}

// ---------------------------------------------------------------------------
// 7. Chain control
// ---------------------------------------------------------------------------

// Moves the chain's step 0 past the `steps` steps just replayed. Grid 1,
// block 1. No prologue: it runs after `done` too, which is harmless.
extern "C" __global__ void k_chain_advance(Ctl* ctl, u32 steps) {
    ctl->pos0 += steps * ctl->rows;
    ctl->tok0 += steps * ctl->rows;
}

// The GPU's %globaltimer, for the host to calibrate GPU stamps against its
// own clock. Grid 1, block 1.
extern "C" __global__ void k_clock_probe(u64* out) {
    u64 now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    out[0] = now;
}
