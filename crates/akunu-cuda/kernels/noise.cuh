// ---------------------------------------------------------------------------
// Sampling noise and rank keys, shared by the sampling kernels (sampling.cu)
// and the persistent decode's in-kernel sampler (persist.cu). Bit-identical
// to sampling.rs.
// ---------------------------------------------------------------------------

#define NONE32 0xffffffffu
#define NONE64 0xffffffffffffffffull
#define POS_INF (__int_as_float(0x7f800000))
#define FULL_MASK 0xffffffffu

// ---------------------------------------------------------------------------
// Hashing and noise (bit-identical to sampling.rs)
// ---------------------------------------------------------------------------

__device__ __forceinline__ u32 pcg_hash(u32 x) {
    u32 state = x * 747796405u + 2891336453u;
    u32 word = ((state >> ((state >> 28) + 4u)) ^ state) * 277803737u;
    return (word >> 22) ^ word;
}

// The (seed, position) part of the per-token hash.
__device__ __forceinline__ u32 position_base(u32 seed_lo, u32 seed_hi, u32 pos) {
    u32 s = pcg_hash(seed_lo ^ pcg_hash(seed_hi));
    return pcg_hash(s ^ pos);
}

// The CPU's ln_fast, operation for operation in round-to-nearest f32 with
// no contraction, so it returns the same bits.
__device__ __forceinline__ float ln_fast(float x) {
    u32 bits = __float_as_uint(x);
    int e = (int)((bits >> 23) & 0xffu) - 126;
    float m = __uint_as_float((bits & 0x007fffffu) | 0x3f000000u);
    bool small = m < __uint_as_float(0x3f3504f3u);  // f32 1/sqrt(2)
    e -= small ? 1 : 0;
    m = small ? __fadd_rn(m, m) : m;
    float f = __fsub_rn(m, 1.0f);
    float z = __fmul_rn(f, f);
    float y = 7.0376836e-2f;
    y = __fsub_rn(__fmul_rn(y, f), 1.1514611e-1f);
    y = __fadd_rn(__fmul_rn(y, f), 1.1676999e-1f);
    y = __fsub_rn(__fmul_rn(y, f), 1.2420141e-1f);
    y = __fadd_rn(__fmul_rn(y, f), 1.4249323e-1f);
    y = __fsub_rn(__fmul_rn(y, f), 1.6668058e-1f);
    y = __fadd_rn(__fmul_rn(y, f), 2.0000715e-1f);
    y = __fsub_rn(__fmul_rn(y, f), 2.4999994e-1f);
    y = __fadd_rn(__fmul_rn(y, f), 3.3333331e-1f);
    y = __fmul_rn(y, __fmul_rn(f, z));
    float ef = (float)e;
    y = __fadd_rn(y, __fmul_rn(ef, -2.1219444e-4f));
    y = __fsub_rn(y, __fmul_rn(0.5f, z));
    return __fadd_rn(__fadd_rn(f, y), __fmul_rn(ef, 0.6933594f));
}

// Gumbel noise from a hash: u = (2k + 1) / 2^24 from the top 23 bits.
__device__ __forceinline__ float gumbel_from_hash(u32 h) {
    float u = __fmul_rn((float)(2u * (h >> 9) + 1u), __uint_as_float(0x33800000u));
    return -ln_fast(-ln_fast(u));
}

// ---------------------------------------------------------------------------
// Keys
// ---------------------------------------------------------------------------

// Order-preserving map of f32 bits to u32 (IEEE total order).
__device__ __forceinline__ u32 ord_bits(u32 b) {
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ u32 unord_bits(u32 o) {
    return (o & 0x80000000u) ? (o & 0x7fffffffu) : ~o;
}

// The CPU's rank key, complemented: larger logit first, -0 folded into +0,
// equal logits by lower id. Larger key = better rank.
__device__ __forceinline__ u64 rank_key(float l, u32 id) {
    u32 o = ord_bits(__float_as_uint(__fadd_rn(l, 0.0f)));
    return ((u64)o << 32) | (u64)(~id);
}
__device__ __forceinline__ float rank_logit(u64 key) {
    return __uint_as_float(unord_bits((u32)(key >> 32)));
}
