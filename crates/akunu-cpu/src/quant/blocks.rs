//! Dequantizers of the 5-bit (Q5_0, Q5_1) and K-quant (Q4_K, Q5_K, Q6_K)
//! block types, written once in portable Rust and shared by every SIMD
//! level.
//!
//! These row dequantizers serve the embedding and the GEMM panels at every
//! level: they are `#[inline(always)]` with fixed-length inner loops, so
//! inlined into the AVX2 / AVX-512 `dequant_row` (`#[target_feature]`
//! functions) the compiler vectorizes them for that level. The scalar GEMV
//! dequantizes through them too; the AVX2 GEMV (also used at the AVX-512
//! level) has its own in-register kernels in `avx2.rs`.
//!
//! Every value is computed with the same f32 operations, in the same order,
//! as GGML's `dequantize_row_*` and the `gguf` Python package
//! (`(d * sc) * q - dmin * m` for Q4_K/Q5_K, never fused into an FMA), so
//! the output is bit-identical across levels and with those references.
//!
//! Block layouts (little-endian):
//! * Q5_0 (32 elements, 22 bytes): `d: f16`, `qh: u32`, `qs: [u8; 16]`.
//!   Element j has low nibble `qs[j % 16]` (low half for j < 16) and fifth
//!   bit `qh >> j & 1`; x = d·(q − 16).
//! * Q5_1 (32, 24 bytes): `d`, `m: f16`, then as Q5_0; x = d·q + m.
//! * Q4_K (256, 144 bytes): `d`, `dmin: f16`, 12 bytes of eight packed
//!   6-bit (scale, min) pairs, `qs: [u8; 128]`; sub-block j (32 elements)
//!   uses the low (j even) or high (j odd) nibbles of `qs[32(j/2)..][..32]`;
//!   x = (d·sc_j)·q − dmin·m_j.
//! * Q5_K (256, 176 bytes): as Q4_K with `qh: [u8; 32]` before `qs`; bit j
//!   of `qh[l]` is the fifth bit of element l of sub-block j.
//! * Q6_K (256, 210 bytes): `ql: [u8; 128]`, `qh: [u8; 64]`, 16 `i8`
//!   scales (one per 16 elements), `d: f16`; x = (d·sc)·(q − 32).

use super::f16_at;
use akunu_core::dtype::DType;

#[inline(always)]
fn u32_at(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Q5_0 (`WITH_MIN == false`) or Q5_1 block: `b` is one block, `o` 32 floats.
#[inline(always)]
fn q5<const WITH_MIN: bool>(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b);
    let (m, rest) = if WITH_MIN {
        (f16_at(&b[2..]), &b[4..])
    } else {
        (0.0, &b[2..])
    };
    let qh = u32_at(rest);
    let qs: &[u8; 16] = rest[4..20].try_into().expect("16 nibble bytes");
    let (lo, hi) = o[..32].split_at_mut(16);
    for j in 0..16 {
        // i32, not u32: AVX2 converts only signed integers to floats.
        let q0 = ((qs[j] & 15) as u32 | ((qh >> j) & 1) << 4) as i32;
        let q1 = ((qs[j] >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4) as i32;
        if WITH_MIN {
            lo[j] = d * q0 as f32 + m;
            hi[j] = d * q1 as f32 + m;
        } else {
            lo[j] = d * (q0 - 16) as f32;
            hi[j] = d * (q1 - 16) as f32;
        }
    }
}

/// The 8 (scale, min) pairs of a Q4_K / Q5_K super-block from its 12 packed
/// bytes: pairs 0..4 are the low 6 bits of bytes 0..4 / 4..8; pairs 4..8
/// take their low 4 bits from bytes 8..12 and their top 2 bits from the top
/// of bytes 0..4 (scales) / 4..8 (mins).
#[inline(always)]
pub(super) fn scale_min_k4(s: &[u8]) -> ([f32; 8], [f32; 8]) {
    let mut sc = [0f32; 8];
    let mut m = [0f32; 8];
    for j in 0..4 {
        sc[j] = (s[j] & 63) as f32;
        m[j] = (s[j + 4] & 63) as f32;
        sc[j + 4] = ((s[j + 8] & 15) | ((s[j] >> 6) << 4)) as f32;
        m[j + 4] = ((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4)) as f32;
    }
    (sc, m)
}

/// Q4_K (`FIVE == false`) or Q5_K super-block: `b` one block, `o` 256 floats.
#[inline(always)]
fn qk<const FIVE: bool>(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b);
    let dmin = f16_at(&b[2..]);
    let (sc, m) = scale_min_k4(&b[4..16]);
    let qh: &[u8; 32] = if FIVE {
        b[16..48].try_into().expect("32 bytes")
    } else {
        &[0; 32]
    };
    let qs = if FIVE { &b[48..176] } else { &b[16..144] };
    let o: &mut [f32; 256] = (&mut o[..256]).try_into().expect("256 floats");
    for i in 0..4 {
        let q: &[u8; 32] = qs[32 * i..32 * i + 32].try_into().expect("32 bytes");
        let (j0, j1) = (2 * i, 2 * i + 1);
        let (d0, m0) = (d * sc[j0], dmin * m[j0]);
        let (d1, m1) = (d * sc[j1], dmin * m[j1]);
        for l in 0..32 {
            // i32, not u32: AVX2 converts only signed integers to floats.
            let (mut a, mut c) = ((q[l] & 15) as i32, (q[l] >> 4) as i32);
            if FIVE {
                a |= ((qh[l] >> j0) as i32 & 1) << 4;
                c |= ((qh[l] >> j1) as i32 & 1) << 4;
            }
            o[64 * i + l] = d0 * a as f32 - m0;
            o[64 * i + 32 + l] = d1 * c as f32 - m1;
        }
    }
}

/// Q6_K super-block: `b` one block, `o` 256 floats. Element 128h + 32t + l
/// (h < 2, t < 4, l < 32) has low nibble in `ql[64h + 32(t & 1) + l]` (high
/// half of the byte for t ≥ 2), top 2 bits at bit 2t of `qh[32h + l]`, and
/// scale `sc[8h + 2t + l / 16]`.
#[inline(always)]
fn q6_k(b: &[u8], o: &mut [f32]) {
    let (ql, rest) = b.split_at(128);
    let (qh, rest) = rest.split_at(64);
    let (sc, dd) = rest.split_at(16);
    let d = f16_at(dd);
    for h in 0..2 {
        for t in 0..4 {
            let lo: &[u8; 32] = ql[64 * h + 32 * (t & 1)..][..32]
                .try_into()
                .expect("32 bytes");
            let hi: &[u8; 32] = qh[32 * h..][..32].try_into().expect("32 bytes");
            let shift = 4 * (t >> 1) as u32;
            for half in 0..2 {
                let s = d * (sc[8 * h + 2 * t + half] as i8) as f32;
                let out = &mut o[128 * h + 32 * t + 16 * half..][..16];
                let (lo, hi) = (&lo[16 * half..][..16], &hi[16 * half..][..16]);
                for ((o, &l), &h) in out.iter_mut().zip(lo).zip(hi) {
                    let q = ((l >> shift) & 15) as i32 | (((h >> (2 * t)) & 3) as i32) << 4;
                    *o = s * (q - 32) as f32;
                }
            }
        }
    }
}

/// Dequantizes whole blocks: `src` holds `out.len() / block_elems` blocks
/// of `dtype` (Q5_0, Q5_1, Q4_K, Q5_K or Q6_K).
#[inline(always)]
pub(super) fn dequant(dtype: DType, src: &[u8], out: &mut [f32]) {
    let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
    let blocks = out.chunks_exact_mut(be).zip(src.chunks_exact(bb));
    match dtype {
        DType::Q5_0 => blocks.for_each(|(o, b)| q5::<false>(b, o)),
        DType::Q5_1 => blocks.for_each(|(o, b)| q5::<true>(b, o)),
        DType::Q4_K => blocks.for_each(|(o, b)| qk::<false>(b, o)),
        DType::Q5_K => blocks.for_each(|(o, b)| qk::<true>(b, o)),
        DType::Q6_K => blocks.for_each(|(o, b)| q6_k(b, o)),
        _ => unreachable!("blocks::dequant called for {dtype}"),
    }
}
