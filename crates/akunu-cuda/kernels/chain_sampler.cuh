// ---------------------------------------------------------------------------
// The persistent kernels' in-kernel sampler (persist.cu, stream.cu): each
// block penalises, scores and ranks its slice of the logits, publishes its
// part before the logits flags, and after them every block takes the same
// token from all parts (the graph's multi-block sampler, sampling.cu
// k_sample_select, does the same work in two kernels and a merging block).
//
// Its functions are templates on the kernel's configuration Cfg: the warps
// that run the sampler (Cfg::WARPS, threads 0 .. 32 Cfg::WARPS of the
// block), their barrier (Cfg::sync(): __syncthreads, or a named barrier
// where a producer warp stays out), the block's role (Cfg::bid()) and the
// keys a thread holds in the pick (Cfg::PICK_KPT: every block's top-k, so
// blocks x top-k <= PICK_KPT x threads; the plans check). Four more pick
// the forms measured on the SmolLM2 kernel only, which the streaming
// kernel leaves off: Cfg::PICK_HEAD_KPT (the pick's head pass, keys a
// thread; 0: none), Cfg::PRED_APPEND (predicated appends),
// Cfg::REDUX_MAX (64-bit maxima by warp reductions) and Cfg::SPEC_PICK
// (the top-k pick tested candidate by candidate, not ranked). The sampling
// settings come in a SampArgs, which both kernels' argument blocks embed.
// ---------------------------------------------------------------------------

// What the logits phase does with the logits (persist.rs SampleMode):
// GREEDY the argmax; PENALTY the argmax after the repetition penalty
// (temperature 0, or one whose inverse is not a finite positive number);
// DENSE Gumbel-max over every token, (l - max) / T + G; TOPK Gumbel-max
// over the top-k (<= 64) tokens left by min-p and top-p. Each is what the
// graph's GumbelSample then Argmax choose (sampling.cu), computed over the
// blocks' slices of the vocabulary with one exchange between blocks.

#define PD_SAMPLE_GREEDY 0
#define PD_SAMPLE_PENALTY 1
#define PD_SAMPLE_DENSE 2
#define PD_SAMPLE_TOPK 3
#define PD_PARTS 3   // a block's words: best key, mass (f64 bits), dense key
#define PD_CANDS 64  // a block's published top-k keys (top-k <= 64), room a block
// Logits a thread holds in the sampler (a block's slice <= PD_VPT x the
// sampler's threads; the plans check).
#define PD_VPT 4
// The most warps a sampler runs on (the sizes of PdSampShared's arrays).
#define PD_SAMP_MAXW 16
// -DPD_SAMP_NOINLINE=1 (persist.rs sets it for the persistent kernel's
// sampled module): the part and the pick are called, not inlined. Inlined,
// they changed how the compiler built the layers' code around them, and
// that kernel's layers ran about 3% slower in the sampled module than in
// the greedy one (bench/RESULTS.md, session 34); the streaming kernel
// gains nothing from it and inlines them. Their arguments come by value,
// so that nothing goes through the stack, and pd_samp_assume_shared keeps
// their shared-memory accesses shared.
#ifndef PD_SAMP_NOINLINE
#define PD_SAMP_NOINLINE 0
#endif
#if PD_SAMP_NOINLINE
#define PD_SAMP_FN __noinline__
#else
#define PD_SAMP_FN
#endif

// The sampler's settings and buffers (persist.rs SampArgs): the sampled
// table's GumbelSample params, the recent-token buffer (header: chain start,
// count; then the ids) and the chain's conveyor base for the penalty
// window, and the blocks' published parts and candidates.
struct SampArgs {
    const u32* recent;
    const u32* window_chain;
    u64* samp;  // 2 sets (token parity): PD_PARTS words a block, then PD_CANDS keys a block
    u32 mode;   // PD_SAMPLE_*
    u32 top_k, repeat_last_n, seed_lo, seed_hi, recent_capacity;
    float inv_t, top_p, min_p, penalty;
};

__device__ __forceinline__ u64 pd_key(float v, u32 idx) {
    u32 b = __float_as_uint(v);
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)b << 32) | (u64)(0xffffffffu - idx);  // ties: the lower index
}

// -DPD_TIMING: block 0's cycles in the sampler's steps (PD_PT(i) adds the
// cycles since the last mark to pd_pt[i]; printed with the phase cycles).
#ifdef PD_TIMING
__shared__ long long pd_pt[12];
__shared__ long long pd_pt_t0;
#define PD_PT(i)                                           \
    do {                                                   \
        if (Cfg::bid() == 0 && threadIdx.x == 0) {         \
            const long long t1_ = clock64();               \
            if ((i) >= 0) pd_pt[(i) < 0 ? 0 : (i)] += t1_ - pd_pt_t0;   \
            pd_pt_t0 = t1_;                                \
        }                                                  \
    } while (0)
#else
#define PD_PT(i) \
    do {         \
    } while (0)
#endif

// The sampler's shared memory (persist.rs sample_smem): candidate keys,
// the slice's logits, the penalty mask of the slice, the tokens this
// launch chose (or, pd_samp_areas' hist, in global memory), and a copy of
// the recent ids.
struct PdSamp {
    u64* cl;    // candidates: the slice's, then the merge's (cap keys)
    float* lg;  // the slice's penalised logits
    u32* mask;  // bit j: slice token j is in the penalty window
    u32* hist;  // hist[s]: the token of this launch's step s
    u32* rec;   // the recent ids (the header's count of them)
    u32 cap;
};

// The candidates a block ranks: a slice's, or the pick's (128 a token,
// measured for the default sampler's top-40 on the SmolLM2 shape's 49,152
// tokens over 132 blocks: bench/RESULTS.md, session 21; more than the cap
// take the pick's slow path).
#define PD_PICK_CAP 1024
// -DPD_PICK_SLOW=1 (tests): every pick takes the slow path.
#ifndef PD_PICK_SLOW
#define PD_PICK_SLOW 0
#endif

// per: the most logits a block's slice holds; max_pos: the tokens a launch
// can choose. hist: where the block keeps those tokens in global memory
// (the streaming kernel, whose shared memory is worth more as ring
// stages), or null to keep them here.
__device__ __forceinline__ PdSamp pd_samp_areas(u8* base, u32 per, u32 max_pos, u32* hist = nullptr) {
    PdSamp s;
    s.cap = max(per, PD_PICK_CAP);
    // Rounded up to 16 bytes by an offset to base, not by casting an
    // integer back to a pointer, so that the compiler still knows these
    // areas are shared memory (ld.shared rather than generic loads).
    s.cl = (u64*)(base + ((16u - (u32)(u64)base) & 15u));
    s.lg = (float*)(s.cl + s.cap);
    s.mask = (u32*)(s.lg + per);
    if (hist) {
        s.hist = hist;
        s.rec = s.mask + (per + 31) / 32;
    } else {
        s.hist = s.mask + (per + 31) / 32;
        s.rec = s.hist + max_pos;
    }
    return s;
}

// The areas are shared memory (hist may be global): said to the compiler
// where a called (not inlined) sampler function cannot see it, so that it
// emits shared rather than generic loads, stores and atomics. Inlined, the
// compiler sees where they come from (and the streaming kernel's modules
// keep the code they were tested with).
__device__ __forceinline__ void pd_samp_assume_shared(const PdSamp& sp) {
#if PD_SAMP_NOINLINE
    __builtin_assume(__isShared(sp.cl));
    __builtin_assume(__isShared(sp.lg));
    __builtin_assume(__isShared(sp.mask));
    __builtin_assume(__isShared(sp.rec));
#else
    (void)sp;
#endif
}

__device__ __forceinline__ float pd_penalised(float l, float pen) {
    return l > 0.0f ? __fdiv_rn(l, pen) : __fmul_rn(l, pen);
}

// Warp max of a u64 (every lane gets it). REDUX (Cfg::REDUX_MAX): two
// 32-bit reductions, one instruction each (the high words' max, then the
// low words' max among the lanes holding it), in place of five dependent
// rounds of two shuffles and a 64-bit compare (bench/RESULTS.md, session
// 36). The streaming kernel keeps the shuffles: its modules were not
// measured with the reductions.
template <bool REDUX>
__device__ __forceinline__ u64 pd_warp_max_u64(u64 v) {
    if constexpr (REDUX) {
        const u32 hi = __reduce_max_sync(FULL_MASK, (u32)(v >> 32));
        const u32 lo = __reduce_max_sync(FULL_MASK, (u32)(v >> 32) == hi ? (u32)v : 0u);
        return ((u64)hi << 32) | lo;
    } else {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(FULL_MASK, v, o));
        return v;
    }
}
// The max of the warps' words red[0 .. Cfg::WARPS), for every lane of the
// whole warps that call it: with REDUX_MAX a word a lane and the warp's
// max, else a chain over the words.
template <class Cfg>
__device__ __forceinline__ u64 pd_max_of_warps(const u64* red) {
    if constexpr (Cfg::REDUX_MAX) {
        const u32 lane = threadIdx.x & 31;
        return pd_warp_max_u64<true>(lane < (u32)Cfg::WARPS ? red[lane] : 0ull);
    } else {
        u64 m = 0;
#pragma unroll
        for (int i = 0; i < Cfg::WARPS; ++i) m = max(m, red[i]);
        return m;
    }
}

// Block max of a u64 (every thread gets it); red holds Cfg::WARPS words.
// Ends synchronised.
template <class Cfg>
__device__ __forceinline__ u64 pd_block_max(u64 v, u64* red) {
    v = pd_warp_max_u64<Cfg::REDUX_MAX>(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    Cfg::sync();
    const u64 m = pd_max_of_warps<Cfg>(red);
    Cfg::sync();
    return m;
}

// out[r] = the candidate of rank r (candidates larger) for r < k: the k
// best of the C distinct nonzero keys cl[0..C), descending, and with
// `noise` noise[r] its Gumbel noise at hash base `base`. S adjacent lanes
// rank a candidate (S a power of two, at most PD_RANK_LANES, with S C <=
// the sampler's threads), each counting the larger keys in every S-th pair of the
// list, four 16-byte loads in flight, and their counts add up by
// shuffles. (One thread a candidate with eight 8-byte loads took 5.0k
// cycles for the pick's 128 candidates; a warp a candidate, with its
// reduction, measured slower still: bench/RESULTS.md, session 21; one
// warp's bitonic sort of up to 64 candidates in registers, without the
// barrier, took twice these cycles in the part and the pick: session 45;
// one warp counting the part's candidates by broadcast loads, 2.6k cycles
// against 1.4-1.6k, sampled 0.6-1.2% slower: session 46.) cl is
// 16-byte aligned; out is zeroed and published before. Every thread calls
// it; ends synchronised.
#ifndef PD_RANK_LANES
#define PD_RANK_LANES 8
#endif
template <class Cfg>
__device__ __forceinline__ void pd_rank(const u64* cl, u32 C, u32 k, u64* out, float* noise = nullptr,
                                        u32 base = 0) {
    u32 S = 1;
    constexpr u32 T = Cfg::WARPS * 32;
    while (S < PD_RANK_LANES && 2 * S * C <= T) S *= 2;
    const u32 s = threadIdx.x & (S - 1), P = (C + 1) / 2;  // pairs; the last may hold one key
    const ulonglong2* c2 = (const ulonglong2*)cl;
    for (u32 q = threadIdx.x / S; q - threadIdx.x / S < C; q += T / S) {
        const u64 x = q < C ? cl[q] : ~0ull;
        u32 r = 0;
        for (u32 j = s; j < P; j += 4 * S) {
            ulonglong2 z[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) z[i] = j + i * S < P ? c2[j + i * S] : make_ulonglong2(0ull, 0ull);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u32 e = 2 * (j + i * S) + 1;  // the pair's second key, past C when C is odd
                r += (u32)(z[i].x > x) + (u32)(e < C && z[i].y > x);
            }
        }
        for (u32 o = 1; o < S; o <<= 1) r += __shfl_xor_sync(FULL_MASK, r, o);
        if (s == 0 && q < C && r < k) {
            out[r] = x;
            if (noise) noise[r] = gumbel_from_hash(pcg_hash(base ^ ~(u32)x));
        }
    }
    Cfg::sync();
}

// Appends this thread's nonzero keys of v whose ordered logit is at least
// `bound` to list[0..cap) at counter *n: a warp's counts are scanned, and
// its last lane takes the warp's room with one shared atomic (one a key
// queued behind each other on the counter). Every lane of the warp calls it.
template <class Cfg, int N>
__device__ __forceinline__ void pd_append_above(const u64 (&v)[N], u32 bound, u32* n, u64* list, u32 cap) {
    u32 c = 0;
#pragma unroll
    for (int i = 0; i < N; ++i) c += (u32)(v[i] != 0 && (u32)(v[i] >> 32) >= bound);
    const u32 lane = threadIdx.x & 31;
    u32 incl = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= (u32)o) incl += y;
    }
    u32 q = 0;
    if (lane == 31 && incl != 0) q = atomicAdd(n, incl);
    q = __shfl_sync(FULL_MASK, q, 31) + incl - c;
    if constexpr (Cfg::PRED_APPEND) {
        // Each key's store predicated rather than branched around (a
        // convergence region a key, about 50 cycles: bench/RESULTS.md,
        // session 35). The streaming kernel keeps the branches: there the
        // predicated form took 11 more registers and was not measured.
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const bool take = v[i] != 0 && (u32)(v[i] >> 32) >= bound;
            if (take && q < cap) list[q] = v[i];
            q += (u32)take;
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i)
            if (v[i] != 0 && (u32)(v[i] >> 32) >= bound) {
                if (q < cap) list[q] = v[i];
                ++q;
            }
    }
}

// The penalty window's tokens in this block's slice [lo, lo + n), as bits
// of sp.mask (each token once, however often it recurs): the last
// repeat_last_n entries of the recent ids ++ the chain's tokens, as
// sampling.cu's penalise_window reads them. The chain's tokens this launch
// chose come from sp.hist (every block knows them), earlier ones from the
// conveyor. Ends synchronised.
template <class Cfg>
__device__ void pd_window_mask(const PdSamp& sp, const SampArgs& a, u32 lo, u32 n, u32 kv_len, u32 t, u32 tok0,
                               u32 chain_start, u32 nr) {
    constexpr u32 T = Cfg::WARPS * 32;
    for (u32 w = threadIdx.x; w < (n + 31) / 32; w += T) sp.mask[w] = 0u;
    Cfg::sync();
    const u32 sch = kv_len > chain_start ? kv_len - chain_start : 0u;
    const u32 total = nr + sch, W = min(total, a.repeat_last_n), c0 = total - W;
    for (u32 j = threadIdx.x; j < W; j += T) {
        const u32 c = c0 + j;
        u32 id;
        if (c < nr) {
            id = sp.rec[c];
        } else {
            const u32 slot = 1u + (c - nr);  // the conveyor slot (sampling.cu: chain = conveyor + 1)
            id = slot > tok0 && slot - tok0 - 1u < t ? sp.hist[slot - tok0 - 1u] : __ldcg(a.window_chain + slot);
        }
        const u32 j2 = id - lo;
        if (j2 < n) atomicOr(&sp.mask[j2 >> 5], 1u << (j2 & 31));
    }
    Cfg::sync();
}

// Rounds of pd_bound_warp: k <= 64 = PD_CANDS needs ceil(64 / warps) lane
// bests a warp (6 on 12 warps, 8 on 8).
template <class Cfg>
struct PdRounds {
    static constexpr int R = (PD_CANDS + Cfg::WARPS - 1) / Cfg::WARPS;
    static_assert(Cfg::WARPS <= PD_SAMP_MAXW && Cfg::WARPS * R <= 96, "bent's room; three entries a lane");
};
// Shared scalars of the sampler.
struct __align__(16) PdSampShared {
    u64 top[PD_CANDS];
    float noise[PD_CANDS];  // the pick's: top[r]'s Gumbel noise
    u64 ured[PD_SAMP_MAXW], ured2[PD_SAMP_MAXW];
    double dred[PD_SAMP_MAXW];
    // pd_bound_warp's entries: each warp's PdRounds largest lane bests
    // (ordered logit << 32 | lanes holding it), 0 past the last.
    u64 bent[96];
    u32 nc;
    u32 bmax;  // pd_bound_of's bound (0: every key)
    u32 nhb;   // the pick's head pass: nonzero to take the whole lists
};

// Resets the selection's fields (bound, count, ranked keys) for
// pd_bound_of, pd_append_above and pd_rank. The part calls it in the
// logits phase and the pick at the end of the part, each published by
// barriers before its use.
__device__ __forceinline__ void pd_select_begin(PdSampShared& ss) {
    if (threadIdx.x == 0) {
        ss.nc = 0;
        ss.bmax = 0;
    }
    if (threadIdx.x < PD_CANDS) ss.top[threadIdx.x] = 0;
}

// The candidates' bound, in two halves around the caller's barrier. A
// thread's lane best is the largest ordered logit among its keys. First
// each warp records its PdRounds largest lane bests with the number
// of lanes holding each (pd_bound_warp); then, after a barrier, each warp
// tests its own recorded values and ss.bmax becomes the largest value b that
// at least k of the recorded lanes reach (pd_bound_of, published by a
// second barrier): at least k keys are then at or above b, so the k best
// all are, and a candidate's rank among those at or above b is its rank
// among all. 0 (every key) when fewer than k lanes hold a key. The former
// bound, the smallest over the warps of each warp's ceil(k / 12)-th lane
// best, admitted 186 candidates in the pick and most of a slice's keys in
// the part on the default model's logits (bench/RESULTS.md, session 22);
// this one is never looser.
template <class Cfg>
__device__ __forceinline__ void pd_bound_warp(u32 lane_best, PdSampShared& ss) {
    constexpr int R = PdRounds<Cfg>::R;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 v = lane_best;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const u32 top = __reduce_max_sync(FULL_MASK, v);
        const u32 lanes = top ? (u32)__popc(__ballot_sync(FULL_MASK, v == top)) : 0u;
        if (v == top) v = 0u;
        if (lane == 0) ss.bent[warp * R + r] = ((u64)top << 32) | lanes;
    }
}
// Each warp tests its own recorded values (their counts split over the
// lanes, three entries a lane, and summed by shuffles, three 10-bit counts
// a word) and raises ss.bmax to the largest that qualifies; the caller's
// next barrier publishes it. (Every warp testing every value took about
// 3k cycles, the 12 warps' identical work queued on the SM's schedulers.)
template <class Cfg>
__device__ __forceinline__ void pd_bound_of(u32 k, PdSampShared& ss) {
    constexpr int R = PdRounds<Cfg>::R, NW = (R + 2) / 3;  // words of three counts
    constexpr u32 E = Cfg::WARPS * R;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 ev[3], ec[3];
#pragma unroll
    for (u32 i = 0; i < 3; ++i) {
        const u32 e = lane + 32 * i;
        const u64 x = e < E ? ss.bent[e] : 0ull;
        ev[i] = (u32)(x >> 32);
        ec[i] = (u32)x;
    }
    u32 val[R], w[NW] = {};
#pragma unroll
    for (u32 r = 0; r < R; ++r) {
        val[r] = (u32)(ss.bent[warp * R + r] >> 32);
        u32 c = 0;
#pragma unroll
        for (u32 i = 0; i < 3; ++i) c += ev[i] >= val[r] ? ec[i] : 0u;
        w[r / 3] += c << (10 * (r % 3));  // a count is at most the block's lanes (< 1024)
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int i = 0; i < NW; ++i) w[i] += __shfl_xor_sync(FULL_MASK, w[i], o);
    u32 best = 0;
#pragma unroll
    for (u32 r = 0; r < R; ++r)
        if (val[r] != 0 && ((w[r / 3] >> (10 * (r % 3))) & 1023u) >= k) best = max(best, val[r]);
    if (lane == 0 && best != 0) atomicMax(&ss.bmax, best);
}

// A warp's f64 sum into red[warp] (lane 0), for pd_red_sum after a barrier:
// a block sum in a fixed order (every block that sums the same values gets
// the same bits), with no barrier of its own.
__device__ __forceinline__ void pd_warp_sum_f64(double v, double* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
}
template <class Cfg>
__device__ __forceinline__ double pd_red_sum(const double* red) {
    double s = 0.0;
#pragma unroll
    for (int i = 0; i < Cfg::WARPS; ++i) s += red[i];
    return s;
}

// DENSE and TOPK, before the logits flags: this block's part. sp.lg holds
// the slice's penalised logits; bkey is the slice's best (pd_key).
// DENSE: the best (l - max_b) / T + G of the slice (max_b its own max;
// pd_sample_pick moves it to the global max). TOPK: the slice's mass
// sum exp((l - max_b) / T) over finite logits, and its min(top-k, n) best
// rank keys, descending, 0-padded to top-k. The selection's fields were
// reset and published before (the logits phase); this resets them for
// the pick. Four barriers: the bound's entries and the mass, the bound,
// the appends, the ranks.
template <class Cfg>
__device__ PD_SAMP_FN void pd_sample_publish(const PdSamp sp, PdSampShared& ss, const SampArgs a, u64* set, u32 lo,
                                             u32 n, u64 bkey, u32 base) {
    pd_samp_assume_shared(sp);
    const float mxb = rank_logit(bkey);
    const u32 tid = threadIdx.x;
    u64* part = set + (u64)Cfg::bid() * PD_PARTS;
    if (a.mode == PD_SAMPLE_DENSE) {
        u64 best = 0;
        for (u32 j = tid; j < n; j += (Cfg::WARPS * 32)) {
            const float l = sp.lg[j];
            if (l > NEG_INF) {
                const float g = gumbel_from_hash(pcg_hash(base ^ (lo + j)));
                best = max(best, pd_key(__fadd_rn(__fmul_rn(__fsub_rn(l, mxb), a.inv_t), g), lo + j));
            }
        }
        best = pd_block_max<Cfg>(best, ss.ured);
        if (tid == 0) {
            part[0] = bkey;
            part[2] = best;
        }
        return;
    }
    // TOPK: keys (0: -inf or NaN, never drawn), the mass, the lane bests.
    PD_PT(-1);
    u64 key[PD_VPT];
    double mass = 0.0;
    u32 lane_best = 0;
#pragma unroll
    for (int v = 0; v < PD_VPT; ++v) {
        const u32 j = tid + v * (Cfg::WARPS * 32);
        key[v] = 0;
        if (j < n) {
            const float l = sp.lg[j];
            if (l > NEG_INF) {
                mass += (double)expf(__fmul_rn(__fsub_rn(l, mxb), a.inv_t));
                key[v] = rank_key(l, lo + j);
                lane_best = max(lane_best, (u32)(key[v] >> 32));
            }
        }
    }
    const u32 k = min(a.top_k, n);
    pd_bound_warp<Cfg>(lane_best, ss);
    pd_warp_sum_f64(mass, ss.dred);
    Cfg::sync();
    pd_bound_of<Cfg>(k, ss);
    Cfg::sync();
    PD_PT(0);
    pd_append_above<Cfg>(key, ss.bmax, &ss.nc, sp.cl, sp.cap);
    Cfg::sync();
    PD_PT(1);
#ifdef PD_TIMING
    if (Cfg::bid() == 0 && tid == 0) pd_pt[9] += ss.nc;
#endif
    pd_rank<Cfg>(sp.cl, ss.nc, k, ss.top);
    PD_PT(2);
    u64* cand = set + (u64)gridDim.x * PD_PARTS + (u64)Cfg::bid() * a.top_k;
    if (tid < a.top_k) cand[tid] = ss.top[tid];
    if (tid == 0) {
        part[0] = bkey;
        part[1] = (u64)__double_as_longlong(pd_red_sum<Cfg>(ss.dred));
    }
    // Every thread has read ss.nc (pd_rank's barrier), and each thread
    // below top_k reads its own ss.top word before zeroing it.
    pd_select_begin(ss);
}

// DENSE and TOPK, after the logits flags: the token, the same in every
// block (the same loads and the same arithmetic in the same order); with
// TOPK only warp 0 returns it. Keys come from the first H of every block's
// top-k list, N a thread: HEAD, the head pass (H may be less than top-k),
// returns PD_PICK_RETRY to every thread when the whole lists must be read;
// otherwise H is top-k.
#define PD_PICK_RETRY 0xfffffffeu
#ifndef PD_PICK_RETRY_ALL
#define PD_PICK_RETRY_ALL 0
#endif
// Cfg::SPEC_PICK: the top-k pick without ranking its candidates, where they
// fit a warp (two a lane). The Gumbel-max over the kept candidates is the
// candidate of the largest (l - max) / T + G that is kept, and whether
// one candidate is kept takes no order: fewer than top-k candidates above
// it, its weight at least min-p's, and (top-p) the mass above it short of
// top-p of the total. Every warp takes the candidates' largest perturbed
// value, tests it and drops it if it is not kept, up to PD_SPEC_TRIES
// times (the same keys and arithmetic in every warp, so every warp returns
// the same token, with no barrier); past that, the ranks and the cuts
// below. The token differs from theirs only at a near-tie of perturbed
// values: the cuts subtract ln(kept mass) before adding G. Measured
// (bench/RESULTS.md, session 46): SmolLM2 sampled +0.7 to +1.2%.
#ifndef PD_SPEC_TRIES
#define PD_SPEC_TRIES 8
#endif
#define PD_SPEC_MISS 0xfffffffdu
template <class Cfg>
__device__ __forceinline__ u32 pd_pick_spec(const PdSamp& sp, const PdSampShared& ss, const SampArgs& a, float mx,
                                            u32 K, u32 base) {
    const u32 lane = threadIdx.x & 31u, n = ss.nc;
    const double mass = pd_red_sum<Cfg>(ss.dred);
    const float min_w = a.min_p > 0.0f ? fminf(a.min_p, 1.0f) : 0.0f;
    const double target = a.top_p < 1.0f ? (double)fmaxf(a.top_p, 0.0f) * mass : -1.0;
    u64 key[2], g[2];
    double w[2];
    // min_w, target, sc, e and in as the cuts below compute them (keep the
    // two alike: a helper both call moved every sampled module's schedule,
    // the streaming kernel's unmeasured, so each keeps its own lines).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 i = lane + 32u * h;
        key[h] = i < n ? sp.cl[i] : 0ull;
        const float sc = key[h] ? __fmul_rn(__fsub_rn(rank_logit(key[h]), mx), a.inv_t) : NEG_INF;
        const float e = key[h] ? expf(sc) : 0.0f;
        const bool in = key[h] != 0 && (min_w <= 0.0f || e >= min_w);
        w[h] = in ? (double)e : 0.0;
        g[h] = in ? pd_key(__fadd_rn(sc, gumbel_from_hash(pcg_hash(base ^ ~(u32)key[h]))), ~(u32)key[h]) : 0ull;
    }
#pragma unroll 1
    for (int tries = 0; tries < PD_SPEC_TRIES; ++tries) {
        const u64 best = pd_warp_max_u64<Cfg::REDUX_MAX>(max(g[0], g[1]));
        if (best == 0) break;
        const bool own0 = g[0] == best, own1 = g[1] == best;
        const u32 holder = __ffs(__ballot_sync(FULL_MASK, own0 || own1)) - 1;
        const u64 kj = __shfl_sync(FULL_MASK, own1 ? key[1] : key[0], holder);
        const bool a0 = key[0] > kj, a1 = key[1] > kj;
        const u32 above = __popc(__ballot_sync(FULL_MASK, a0)) + __popc(__ballot_sync(FULL_MASK, a1));
        double m = (a0 ? w[0] : 0.0) + (a1 ? w[1] : 0.0);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m += __shfl_xor_sync(FULL_MASK, m, o);
#ifdef PD_TIMING
        if (Cfg::bid() == 0 && threadIdx.x == 0) pd_pt[11] += 1;  // the candidates tested
#endif
        if (above < K && (target < 0.0 || above == 0 || m < target)) return ~(u32)best;
        g[0] = own0 ? 0ull : g[0];
        g[1] = own1 ? 0ull : g[1];
    }
    return PD_SPEC_MISS;
}
template <class Cfg, int N, bool HEAD>
__device__ __forceinline__ u32 pd_pick_from(const PdSamp& sp, PdSampShared& ss, const SampArgs& a, const u64* set,
                                            u32 base, u32 H) {
    const u32 tid = threadIdx.x, G = gridDim.x;
    PD_PT(-1);
    // One round of loads: the blocks' parts (G <= the sampler's threads) and, for
    // TOPK, the first H keys of every block's list.
    const u64* part = set + (u64)tid * PD_PARTS;
    const u64 bk = tid < G ? __ldcg(part) : 0ull;
    const u64 pw = tid < G ? __ldcg(part + (a.mode == PD_SAMPLE_DENSE ? 2 : 1)) : 0ull;
    const u32 K = a.top_k, total = a.mode == PD_SAMPLE_TOPK ? G * H : 0u;
    const u64* cand = set + (u64)G * PD_PARTS;
    if (HEAD && tid == 0) ss.nhb = 0;  // published by the first barrier
    u64 y[N];
    u32 last = 0;  // bit i: y[i] is the last key read of its block's list
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const u32 q = tid + i * (Cfg::WARPS * 32);
        if constexpr (HEAD) {
            const u32 b = q / H, r = q - b * H;
            y[i] = q < total ? __ldcg(cand + (u64)b * K + r) : 0ull;
            last |= (u32)(r == H - 1) << i;
        } else {
            y[i] = q < total ? __ldcg(cand + q) : 0ull;
        }
    }
    // The global max (lowest id on ties) from the blocks' bests and, for
    // TOPK, the bound's entries (pd_bound_warp over every key), published
    // by one barrier.
    const u64 wm = pd_warp_max_u64<Cfg::REDUX_MAX>(bk);
    if ((tid & 31) == 0) ss.ured[tid >> 5] = wm;
    if (a.mode == PD_SAMPLE_TOPK) {
        u32 lane_best = 0;
#pragma unroll
        for (int i = 0; i < N; ++i) lane_best = max(lane_best, (u32)(y[i] >> 32));
        pd_bound_warp<Cfg>(lane_best, ss);
    }
    Cfg::sync();
    const u64 m = pd_max_of_warps<Cfg>(ss.ured);
    PD_PT(3);
    const float mx = rank_logit(m);
    // Not finite: the argmax (every token -inf gives id 0, as the CPU).
    if (!(fabsf(mx) < POS_INF)) return ~(u32)m;
    if (a.mode == PD_SAMPLE_DENSE) {
        // Each block's best, moved from its own max to the global one
        // (ured2: other warps may still be reading ured).
        u64 best = 0;
        if (pw != 0) {
            const float shift = __fmul_rn(__fsub_rn(mx, rank_logit(bk)), a.inv_t);
            best = pd_key(__fsub_rn(rank_logit(pw), shift), ~(u32)pw);
        }
        return ~(u32)pd_block_max<Cfg>(best, ss.ured2);
    }
    // TOPK. The total mass, every block's moved to the global max (summed
    // by warp 0 for the cuts), and the bound (one barrier); then the keys
    // at or above it appended as candidates (another).
    const double mb = __longlong_as_double((long long)pw);
    const double mass_b = mb > 0.0 ? mb * (double)expf(__fmul_rn(__fsub_rn(rank_logit(bk), mx), a.inv_t)) : 0.0;
    pd_warp_sum_f64(mass_b, ss.dred);
    pd_bound_of<Cfg>(K, ss);
    Cfg::sync();
    pd_append_above<Cfg>(y, ss.bmax, &ss.nc, sp.cl, sp.cap);
    if (HEAD && H < K) {
        // A block's last key read at or above the bound: its unread keys
        // may rank among the top-k (PD_PICK_RETRY_ALL: always, for tests).
#pragma unroll
        for (int i = 0; i < N; ++i)
            if (PD_PICK_RETRY_ALL || (((last >> i) & 1u) && y[i] != 0 && (u32)(y[i] >> 32) >= ss.bmax)) ss.nhb = 1;
    }
    Cfg::sync();
    if (HEAD && H < K && ss.nhb != 0) return PD_PICK_RETRY;
    PD_PT(4);
#ifdef PD_TIMING
    if (Cfg::bid() == 0 && tid == 0) pd_pt[10] += ss.nc;
#endif
    if (Cfg::SPEC_PICK && !PD_PICK_SLOW && ss.nc <= 64) {
        const u32 tok = pd_pick_spec<Cfg>(sp, ss, a, mx, K, base);
        PD_PT(6);
        if (tok != PD_SPEC_MISS) return tok;
    }
    if (!PD_PICK_SLOW && ss.nc <= sp.cap) {
        pd_rank<Cfg>(sp.cl, ss.nc, K, ss.top, ss.noise, base);
    } else {
        // Too many at the bound (a warp with too few keys: short lists):
        // the K best one at a time (keys are distinct).
        for (u32 r = 0; r < K; ++r) {
            u64 b = 0;
#pragma unroll
            for (int i = 0; i < N; ++i) b = max(b, y[i]);
            b = pd_block_max<Cfg>(b, ss.ured);
            if (b == 0) break;
            if (tid == 0) {
                ss.top[r] = b;
                ss.noise[r] = gumbel_from_hash(pcg_hash(base ^ ~(u32)b));
            }
#pragma unroll
            for (int i = 0; i < N; ++i) y[i] = y[i] == b ? 0ull : y[i];
        }
        Cfg::sync();
    }
    PD_PT(6);
    // The cuts, in warp 0 over the ranked keys (K <= 64: two a lane): min-p
    // (a prefix: weights fall with rank), top-k, and top-p (the first rank
    // where the running mass reaches top-p of the total), then Gumbel-max
    // over the kept ones: ln p + G, ln p = (l - max) / T - ln(kept mass).
    if (tid >= 32) return 0;
    const u32 lane = tid;
    const double mass = pd_red_sum<Cfg>(ss.dred);
    const float min_w = a.min_p > 0.0f ? fminf(a.min_p, 1.0f) : 0.0f;
    const double target = a.top_p < 1.0f ? (double)fmaxf(a.top_p, 0.0f) * mass : -1.0;
    float sc[2];
    double w[2];
    bool in[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 r = 2 * lane + h;
        const u64 key = r < K ? ss.top[r] : 0;
        sc[h] = key ? __fmul_rn(__fsub_rn(rank_logit(key), mx), a.inv_t) : NEG_INF;
        const float e = key ? expf(sc[h]) : 0.0f;
        in[h] = key != 0 && (min_w <= 0.0f || e >= min_w);
        w[h] = in[h] ? (double)e : 0.0;
    }
    // Inclusive running mass at each rank (a scan over the lanes' pairs).
    double run = w[0] + w[1];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const double y = __shfl_up_sync(FULL_MASK, run, o);
        if (lane >= (u32)o) run += y;
    }
    const double incl1 = run, incl0 = run - w[1];
    // Kept: pool members up to and including the first that reaches the
    // target (rank 0 always, being the max).
    const bool hit0 = in[0] && target >= 0.0 && incl0 >= target, hit1 = in[1] && target >= 0.0 && incl1 >= target;
    const u32 first_hit = __reduce_min_sync(FULL_MASK, hit0 ? 2 * lane : hit1 ? 2 * lane + 1 : NONE32);
    const u32 pool = __popc(__ballot_sync(FULL_MASK, in[0])) + __popc(__ballot_sync(FULL_MASK, in[1]));
    const u32 L = first_hit == NONE32 ? pool : min(pool, first_hit + 1);
    const double kept = __shfl_sync(FULL_MASK, (L - 1) % 2 ? incl1 : incl0, (L - 1) / 2);
    const float ln_sum = logf((float)kept);
    u64 best = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 r = 2 * lane + h;
        if (r < L) best = max(best, pd_key(__fadd_rn(__fsub_rn(sc[h], ln_sum), ss.noise[r]), ~(u32)ss.top[r]));
    }
    best = pd_warp_max_u64<Cfg::REDUX_MAX>(best);
    PD_PT(7);
    return ~(u32)best;
}

// The pick. With TOPK it first reads only the head of every block's list,
// the first PD_PICK_HEAD keys (a fifth of the loads for the default
// top-40): the top-k of those are the top-k of all unless a block's last
// head key reaches the candidates' bound, in which case (every block sees
// the same keys, so every block decides alike) the whole lists are read.
// The lists' loads were the pick's longest step (4.3k of 14.5k cycles,
// bench/RESULTS.md, session 35).
#ifndef PD_PICK_HEAD
#define PD_PICK_HEAD 8
#endif
template <class Cfg>
__device__ PD_SAMP_FN u32 pd_sample_pick(const PdSamp sp, PdSampShared& ss, const SampArgs a, const u64* set,
                                         u32 base) {
    pd_samp_assume_shared(sp);
    constexpr int HN = Cfg::PICK_HEAD_KPT;
    if constexpr (HN > 0 && PD_PICK_HEAD > 0 && !PD_PICK_SLOW) {
        const u32 H = min(a.top_k, (u32)PD_PICK_HEAD);
        if (a.mode == PD_SAMPLE_TOPK && gridDim.x * H <= HN * (Cfg::WARPS * 32)) {
            const u32 tok = pd_pick_from<Cfg, HN, true>(sp, ss, a, set, base, H);
            if (tok != PD_PICK_RETRY) return tok;
            // Every thread has read ss.nhb; the fields start over.
            Cfg::sync();
            pd_select_begin(ss);
            Cfg::sync();
        }
    }
    return pd_pick_from<Cfg, Cfg::PICK_KPT, false>(sp, ss, a, set, base, a.top_k);
}
