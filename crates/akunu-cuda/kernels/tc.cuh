// Tensor-core building blocks shared by the main module (model.cu's
// k_gemm_tc, gemv_tc.cu) and the streaming decode kernel's Q4_0 form
// (stream.cu): f16 packing, the m16n8k16 product, and Q4 quants as f16
// pairs.

__device__ __forceinline__ u32 pack_h2(float lo, float hi) {
    u32 r;
    asm("{ .reg .f16 a, b;\n cvt.rn.f16.f32 a, %1;\n cvt.rn.f16.f32 b, %2;\n mov.b32 %0, {a, b}; }"
        : "=r"(r) : "f"(lo), "f"(hi));
    return r;
}

__device__ __forceinline__ void mma_f16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 hsub2_u(u32 a, u32 b) {
    u32 r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ u32 hfma2_u(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// The 8 weights of quant word `w` (bytes 4j..4j+3 of a Q4 block) as f16
// pairs: l0 = elements (4j, 4j+2), l1 = (4j+1, 4j+3), h0 = (16+4j, 16+4j+2),
// h1 = (16+4j+1, 16+4j+3); values q - 8 (Q4_0) or q (Q4_1).
#ifndef TCG_DQ_PRMT
#define TCG_DQ_PRMT 1
#endif
template <bool Q41>
__device__ __forceinline__ void tcg_q4_pairs(u32 w, u32& l0, u32& l1, u32& h0, u32& h1) {
    const u32 sub = Q41 ? 0x64006400u : 0x64086408u;  // 1024, 1032
#if TCG_DQ_PRMT
    // Nibbles to bytes, then each byte under 0x64 (1024 + q) by a byte
    // permutation: one long-lived constant register (0x64646464), where the
    // mask-and-OR form needs two masks and 1/16 and the compiler rebuilt
    // them before every use (2 extra moves per word in SASS).
    const u32 lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;
    l0 = hsub2_u(__byte_perm(lo, 0x64646464u, 0x4240), sub);
    l1 = hsub2_u(__byte_perm(lo, 0x64646464u, 0x4341), sub);
    h0 = hsub2_u(__byte_perm(hi, 0x64646464u, 0x4240), sub);
    h1 = hsub2_u(__byte_perm(hi, 0x64646464u, 0x4341), sub);
#else
    const u32 w8 = w >> 8;
    l0 = (w & 0x000F000Fu) | 0x64006400u;   // 1024 + q
    l1 = (w8 & 0x000F000Fu) | 0x64006400u;
    h0 = (w & 0x00F000F0u) | 0x64006400u;   // 1024 + 16 q
    h1 = (w8 & 0x00F000F0u) | 0x64006400u;
    const u32 add = Q41 ? 0xD400D400u : 0xD480D480u;  // -64, -72
    l0 = hsub2_u(l0, sub);
    l1 = hsub2_u(l1, sub);
    h0 = hfma2_u(h0, 0x2C002C00u, add);  // x / 16 - 64 (- 8)
    h1 = hfma2_u(h1, 0x2C002C00u, add);
#endif
}

// The u32 index in a Q4 B image (gemv_tc.cu's layout: 128 u32 a group of
// four 32-element blocks) of the pair holding input elements e and e + 2
// (e % 4 == 0; e + 1 and e + 3 are the next u32), hi (hl 0) or lo (hl 1)
// half of x. Word j of a block feeds products 2j (low nibbles: elements
// 4j..4j+3) and 2j + 1 (high: 16+4j..16+4j+3); B lane 2t + hl of product i
// holds its u32 pair (2i & 3, (2i & 3) + 1) at 32 (2i >> 2) + 4 (2t + hl).
__device__ __forceinline__ u32 q4_img_at(u32 e, u32 hl) {
    const u32 lb = e >> 5, grp = lb >> 2, t = lb & 3, el = e & 31;
    const u32 idx = 2 * (2 * ((el & 15) >> 2) + (el >> 4));
    return grp * 128 + (idx >> 2) * 32 + (2 * t + hl) * 4 + (idx & 3);
}
