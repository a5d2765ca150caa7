//! f32 → storage-type row quantizers, bit-exact with GGML's reference
//! (`quantize_row_*_ref`) quantizers, so that a file written here holds the
//! same bytes llama.cpp's `llama-quantize` would write for the same floats.
//!
//! Layouts (little-endian, one block per 32 elements for the Q types):
//! - Q8_0: `d: f16`, `qs: [i8; 32]`; x ≈ d·q.
//! - Q4_0: `d: f16`, `qs: [u8; 16]`; element j in the low nibble of byte j,
//!   element j+16 in its high nibble; x ≈ d·(q − 8).
//! - Q4_1: `d: f16`, `m: f16`, `qs: [u8; 16]` (nibbles as Q4_0); x ≈ d·q + m.
//! - Q5_0 / Q5_1: as Q4_0 / Q4_1 with 5-bit values: `d` (and `m`), then
//!   `qh: u32` (bit j = fifth bit of element j), then the 16 nibble bytes;
//!   x ≈ d·(q − 16) and x ≈ d·q + m. Bit-exact with GGML's reference.
//! - Q4_K / Q5_K / Q6_K (256-element super-blocks): see [`quantize_row_q4_k`]
//!   and friends. These are *not* GGML's `make_qkx` searches but a simple
//!   min/max rounding quantizer: the layout is GGML's (any GGML reader
//!   decodes them), the chosen scales are slightly less accurate.
//! - F16 (IEEE half, round to nearest even) and BF16 (top 16 bits of the
//!   f32, round to nearest even, NaN kept quiet), as GGML converts them.

use crate::dtype::DType;
use half::f16;

/// Elements per block of the quantized types.
pub const QK: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum QuantizeError {
    #[error(
        "cannot quantize {n} values to {dtype}: the count must be a multiple of its block size {block}"
    )]
    Length {
        dtype: DType,
        n: usize,
        block: usize,
    },
    #[error("{n} values of {dtype} need {want} bytes, but the output buffer has {got}")]
    Output {
        dtype: DType,
        n: usize,
        want: usize,
        got: usize,
    },
}

/// Bytes that `n` values take in `dtype`, if `n` is a whole number of blocks.
pub fn quantized_size(dtype: DType, n: usize) -> Result<usize, QuantizeError> {
    let block = dtype.block_elems();
    if !n.is_multiple_of(block) {
        return Err(QuantizeError::Length { dtype, n, block });
    }
    Ok(n / block * dtype.block_bytes())
}

/// Converts `src` to `dtype` into `dst`, which must be exactly
/// [`quantized_size`] bytes long.
pub fn quantize_into(dtype: DType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantizeError> {
    let want = quantized_size(dtype, src.len())?;
    if dst.len() != want {
        return Err(QuantizeError::Output {
            dtype,
            n: src.len(),
            want,
            got: dst.len(),
        });
    }
    match dtype {
        DType::F32 => quantize_row_f32(src, dst),
        DType::F16 => quantize_row_f16(src, dst),
        DType::BF16 => quantize_row_bf16(src, dst),
        DType::Q8_0 => quantize_row_q8_0(src, dst),
        DType::Q4_0 => quantize_row_q4_0(src, dst),
        DType::Q4_1 => quantize_row_q4_1(src, dst),
        DType::Q5_0 => quantize_row_q5_0(src, dst),
        DType::Q5_1 => quantize_row_q5_1(src, dst),
        DType::Q4_K => quantize_row_q4_k(src, dst),
        DType::Q5_K => quantize_row_q5_k(src, dst),
        DType::Q6_K => quantize_row_q6_k(src, dst),
    }
    Ok(())
}

/// Converts `src` to `dtype`, returning the bytes.
pub fn quantize(dtype: DType, src: &[f32]) -> Result<Vec<u8>, QuantizeError> {
    let mut out = vec![0u8; quantized_size(dtype, src.len())?];
    quantize_into(dtype, src, &mut out)?;
    Ok(out)
}

fn check_lengths(dtype: DType, src: &[f32], dst: &[u8]) {
    assert!(
        src.len().is_multiple_of(dtype.block_elems())
            && dst.len() == src.len() / dtype.block_elems() * dtype.block_bytes(),
        "{dtype} row: {} values need {} bytes, got {}",
        src.len(),
        src.len() / dtype.block_elems() * dtype.block_bytes(),
        dst.len()
    );
}

/// f32 → little-endian f32 bytes.
///
/// # Panics
/// If `dst.len() != 4 * src.len()`.
pub fn quantize_row_f32(src: &[f32], dst: &mut [u8]) {
    check_lengths(DType::F32, src, dst);
    for (o, &x) in dst.chunks_exact_mut(4).zip(src) {
        o.copy_from_slice(&x.to_le_bytes());
    }
}

/// f32 → IEEE half (round to nearest even, as `GGML_FP32_TO_FP16`).
///
/// # Panics
/// If `dst.len() != 2 * src.len()`.
pub fn quantize_row_f16(src: &[f32], dst: &mut [u8]) {
    check_lengths(DType::F16, src, dst);
    for (o, &x) in dst.chunks_exact_mut(2).zip(src) {
        o.copy_from_slice(&f16::from_f32(x).to_le_bytes());
    }
}

/// GGML's `ggml_compute_fp32_to_bf16`: round to nearest even; NaN stays a
/// (quiet) NaN.
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// f32 → bfloat16 (as `ggml_fp32_to_bf16_row_ref`).
///
/// # Panics
/// If `dst.len() != 2 * src.len()`.
pub fn quantize_row_bf16(src: &[f32], dst: &mut [u8]) {
    check_lengths(DType::BF16, src, dst);
    for (o, &x) in dst.chunks_exact_mut(2).zip(src) {
        o.copy_from_slice(&f32_to_bf16_bits(x).to_le_bytes());
    }
}

/// GGML's `quantize_row_q8_0_ref`: d = amax/127, q = round(x/d).
///
/// # Panics
/// If `src.len()` is not a multiple of 32 or `dst` is not 34 bytes per block.
pub fn quantize_row_q8_0(src: &[f32], dst: &mut [u8]) {
    check_lengths(DType::Q8_0, src, dst);
    for (x, y) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(34)) {
        let amax = x.iter().fold(0f32, |m, &v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        y[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
        for (q, &v) in y[2..].iter_mut().zip(x) {
            // roundf: halves away from zero, as f32::round. The value lies
            // in [-127, 127], so the cast is exact.
            *q = (v * id).round() as i8 as u8;
        }
    }
}

/// GGML's `quantize_row_q4_0_ref`: `max` is the value of largest magnitude
/// (with its sign), d = max / −8, q = min(15, (int8)(x/d + 8.5)).
///
/// # Panics
/// If `src.len()` is not a multiple of 32 or `dst` is not 18 bytes per block.
pub fn quantize_row_q4_0(src: &[f32], dst: &mut [u8]) {
    check_lengths(DType::Q4_0, src, dst);
    for (x, y) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(18)) {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in x {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        y[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
        for j in 0..QK / 2 {
            let x0 = x[j] * id;
            let x1 = x[j + QK / 2] * id;
            // C's (int8_t) cast truncates toward zero; the values lie in
            // [0.5, 16.5] here (NaN inputs give 0 in Rust, UB in C).
            let q0 = ((x0 + 8.5) as i8).min(15) as u8;
            let q1 = ((x1 + 8.5) as i8).min(15) as u8;
            y[2 + j] = q0 | (q1 << 4);
        }
    }
}

/// GGML's `quantize_row_q4_1_ref`: d = (max − min)/15, m = min,
/// q = min(15, (int8)((x − min)/d + 0.5)).
///
/// # Panics
/// If `src.len()` is not a multiple of 32 or `dst` is not 20 bytes per block.
pub fn quantize_row_q4_1(src: &[f32], dst: &mut [u8]) {
    check_lengths(DType::Q4_1, src, dst);
    for (x, y) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(20)) {
        let (mut min, mut max) = (f32::MAX, -f32::MAX);
        for &v in x {
            if v < min {
                min = v;
            }
            if v > max {
                max = v;
            }
        }
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        y[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
        y[2..4].copy_from_slice(&f16::from_f32(min).to_le_bytes());
        for j in 0..QK / 2 {
            let x0 = (x[j] - min) * id;
            let x1 = (x[j + QK / 2] - min) * id;
            let q0 = ((x0 + 0.5) as i8).min(15) as u8;
            let q1 = ((x1 + 0.5) as i8).min(15) as u8;
            y[4 + j] = q0 | (q1 << 4);
        }
    }
}

/// Packs the 5-bit values `q` (0..=31) of one 32-element block into
/// (`qh`, 16 nibble bytes): element j's low nibble in byte j % 16 (low
/// half for j < 16), its fifth bit in bit j of `qh`.
fn pack_q5(q: &[u8; QK], qh_out: &mut [u8], qs_out: &mut [u8]) {
    let mut qh = 0u32;
    for j in 0..QK / 2 {
        qs_out[j] = (q[j] & 15) | ((q[j + QK / 2] & 15) << 4);
        qh |= (((q[j] >> 4) & 1) as u32) << j;
        qh |= (((q[j + QK / 2] >> 4) & 1) as u32) << (j + QK / 2);
    }
    qh_out.copy_from_slice(&qh.to_le_bytes());
}

/// GGML's `quantize_row_q5_0_ref`: d = max / −16, q = min(31, (int8)(x/d + 16.5)).
///
/// # Panics
/// If `src.len()` is not a multiple of 32 or `dst` is not 22 bytes per block.
pub fn quantize_row_q5_0(src: &[f32], dst: &mut [u8]) {
    check_lengths(DType::Q5_0, src, dst);
    for (x, y) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(22)) {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in x {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        y[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
        let mut q = [0u8; QK];
        for (qj, &v) in q.iter_mut().zip(x) {
            // Truncation as C's (int8_t) cast; values lie in [0.5, 32.5].
            *qj = ((v * id + 16.5) as i8).min(31) as u8;
        }
        let (qh, qs) = y[2..].split_at_mut(4);
        pack_q5(&q, qh, qs);
    }
}

/// GGML's `quantize_row_q5_1_ref`: d = (max − min)/31, m = min,
/// q = (uint8)((x − min)/d + 0.5).
///
/// # Panics
/// If `src.len()` is not a multiple of 32 or `dst` is not 24 bytes per block.
pub fn quantize_row_q5_1(src: &[f32], dst: &mut [u8]) {
    check_lengths(DType::Q5_1, src, dst);
    for (x, y) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(24)) {
        let (mut min, mut max) = (f32::MAX, -f32::MAX);
        for &v in x {
            min = if v < min { v } else { min };
            max = if v > max { v } else { max };
        }
        let d = (max - min) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        y[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
        y[2..4].copy_from_slice(&f16::from_f32(min).to_le_bytes());
        let mut q = [0u8; QK];
        for (qj, &v) in q.iter_mut().zip(x) {
            // No clamp, as in GGML: the value lies in [0.5, 31.5].
            *qj = ((v - min) * id + 0.5) as u8;
        }
        let (qh, qs) = y[4..].split_at_mut(4);
        pack_q5(&q, qh, qs);
    }
}

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

/// Rounds to the nearest integer in `0..=max` (NaN → 0).
fn round_clamp(v: f32, max: u8) -> u8 {
    v.round().clamp(0.0, max as f32) as u8
}

/// Packs 8 (scale, min) pairs of 6 bits into GGML's 12-byte K-quant layout:
/// pairs 0..4 in the low 6 bits of bytes 0..4 (scales) and 4..8 (mins);
/// pairs 4..8 split into a low nibble (bytes 8..12) and 2 high bits (the
/// top bits of bytes 0..8).
fn pack_scale_min_k4(sc: &[u8; 8], m: &[u8; 8], out: &mut [u8]) {
    out[..12].fill(0);
    for j in 0..4 {
        out[j] = sc[j] & 63;
        out[j + 4] = m[j] & 63;
    }
    for j in 4..8 {
        out[j + 4] = (sc[j] & 15) | ((m[j] & 15) << 4);
        out[j - 4] |= (sc[j] >> 4) << 6;
        out[j] |= (m[j] >> 4) << 6;
    }
}

/// Q4_K (`NMAX` = 15) and Q5_K (`NMAX` = 31) super-block quantizer. Each
/// 32-element sub-block j gets x ≈ (d·sc_j)·q − dmin·m_j with 6-bit sc_j,
/// m_j: its min (clipped to ≤ 0) and range, rounded onto the super-block's
/// f16 `d`, `dmin` grids; then each value is rounded to the nearest level.
/// Returns (d, dmin, sc, m, q).
fn quantize_kx<const NMAX: u8>(x: &[f32]) -> (f16, f16, [u8; 8], [u8; 8], [u8; QK_K]) {
    let mut scale = [0f32; 8];
    let mut neg_min = [0f32; 8];
    for (j, sub) in x.chunks_exact(QK).enumerate() {
        let lo = sub.iter().fold(0f32, |a, &v| a.min(v));
        let hi = sub.iter().fold(lo, |a, &v| a.max(v));
        scale[j] = (hi - lo) / NMAX as f32;
        neg_min[j] = -lo;
    }
    let max_scale = scale.iter().fold(0f32, |a, &v| a.max(v));
    let max_min = neg_min.iter().fold(0f32, |a, &v| a.max(v));
    let d = f16::from_f32(max_scale / 63.0);
    let dmin = f16::from_f32(max_min / 63.0);
    let (df, dminf) = (d.to_f32(), dmin.to_f32());
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    let mut q = [0u8; QK_K];
    for j in 0..8 {
        sc[j] = if df > 0.0 {
            round_clamp(scale[j] / df, 63)
        } else {
            0
        };
        m[j] = if dminf > 0.0 {
            round_clamp(neg_min[j] / dminf, 63)
        } else {
            0
        };
        let step = df * sc[j] as f32;
        let off = dminf * m[j] as f32;
        let inv = if step > 0.0 { 1.0 / step } else { 0.0 };
        for l in 0..QK {
            q[j * QK + l] = round_clamp((x[j * QK + l] + off) * inv, NMAX);
        }
    }
    (d, dmin, sc, m, q)
}

/// Q4_K: `d: f16`, `dmin: f16`, 12 bytes of packed 6-bit (scale, min)
/// pairs, 128 bytes `qs`; sub-block 2i sits in the low nibbles of
/// `qs[32i..32i+32]`, sub-block 2i+1 in their high nibbles.
///
/// # Panics
/// If `src.len()` is not a multiple of 256 or `dst` is not 144 bytes per block.
pub fn quantize_row_q4_k(src: &[f32], dst: &mut [u8]) {
    check_lengths(DType::Q4_K, src, dst);
    for (x, y) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(144)) {
        let (d, dmin, sc, m, q) = quantize_kx::<15>(x);
        y[..2].copy_from_slice(&d.to_le_bytes());
        y[2..4].copy_from_slice(&dmin.to_le_bytes());
        pack_scale_min_k4(&sc, &m, &mut y[4..16]);
        for i in 0..4 {
            for l in 0..QK {
                y[16 + 32 * i + l] = q[64 * i + l] | (q[64 * i + 32 + l] << 4);
            }
        }
    }
}

/// Q5_K: as Q4_K, then 32 bytes `qh` before `qs`: bit j of `qh[l]` is the
/// fifth bit of element l of sub-block j.
///
/// # Panics
/// If `src.len()` is not a multiple of 256 or `dst` is not 176 bytes per block.
pub fn quantize_row_q5_k(src: &[f32], dst: &mut [u8]) {
    check_lengths(DType::Q5_K, src, dst);
    for (x, y) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(176)) {
        let (d, dmin, sc, m, q) = quantize_kx::<31>(x);
        y[..2].copy_from_slice(&d.to_le_bytes());
        y[2..4].copy_from_slice(&dmin.to_le_bytes());
        pack_scale_min_k4(&sc, &m, &mut y[4..16]);
        let (qh, qs) = y[16..].split_at_mut(32);
        qh.fill(0);
        for j in 0..8 {
            for l in 0..QK {
                qh[l] |= (q[j * QK + l] >> 4) << j;
            }
        }
        for i in 0..4 {
            for l in 0..QK {
                qs[32 * i + l] = (q[64 * i + l] & 15) | ((q[64 * i + 32 + l] & 15) << 4);
            }
        }
    }
}

/// Q6_K: 128 bytes `ql`, 64 bytes `qh`, 16 `i8` scales, `d: f16`;
/// x ≈ (d·sc_g)·(q − 32) per 16-element group g. Each group's scale is its
/// max |x| / 31 rounded onto the f16 `d`'s grid of 127 steps. Element e of
/// half h = e / 128 (r = e % 128, quarter t = r / 32, l = r % 32): low
/// nibble in `ql[64h + 32(t & 1) + l]` (high half of the byte for t ≥ 2),
/// top 2 bits at bit 2t of `qh[32h + l]`.
///
/// # Panics
/// If `src.len()` is not a multiple of 256 or `dst` is not 210 bytes per block.
pub fn quantize_row_q6_k(src: &[f32], dst: &mut [u8]) {
    check_lengths(DType::Q6_K, src, dst);
    for (x, y) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(210)) {
        let mut gscale = [0f32; 16];
        for (g, grp) in x.chunks_exact(16).enumerate() {
            gscale[g] = grp.iter().fold(0f32, |a, &v| a.max(v.abs())) / 31.0;
        }
        let max_scale = gscale.iter().fold(0f32, |a, &v| a.max(v));
        let d = f16::from_f32(max_scale / 127.0);
        let df = d.to_f32();
        let mut sc = [0i8; 16];
        let mut q = [0u8; QK_K];
        for g in 0..16 {
            sc[g] = if df > 0.0 {
                (gscale[g] / df).round().clamp(0.0, 127.0) as i8
            } else {
                0
            };
            let step = df * sc[g] as f32;
            let inv = if step > 0.0 { 1.0 / step } else { 0.0 };
            for l in 0..16 {
                let v = (x[16 * g + l] * inv).round().clamp(-32.0, 31.0);
                q[16 * g + l] = (v as i32 + 32) as u8;
            }
        }
        let (ql, rest) = y.split_at_mut(128);
        let (qh, rest) = rest.split_at_mut(64);
        let (scales, dd) = rest.split_at_mut(16);
        ql.fill(0);
        qh.fill(0);
        for (e, &qe) in q.iter().enumerate() {
            let (h, r) = (e / 128, e % 128);
            let (t, l) = (r / 32, r % 32);
            let b = 64 * h + 32 * (t & 1) + l;
            ql[b] |= (qe & 15) << (4 * (t >> 1));
            qh[32 * h + l] |= (qe >> 4) << (2 * t);
        }
        for (o, &s) in scales.iter_mut().zip(&sc) {
            *o = s as u8;
        }
        dd.copy_from_slice(&d.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_at(b: &[u8]) -> f32 {
        f16::from_le_bytes([b[0], b[1]]).to_f32()
    }

    /// Reference dequantizer (GGML's `dequantize_row_*`).
    fn dequantize(dtype: DType, src: &[u8], n: usize) -> Vec<f32> {
        let mut out = vec![0f32; n];
        match dtype {
            DType::F32 => {
                for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                    *o = f32::from_le_bytes(b.try_into().unwrap());
                }
            }
            DType::F16 => {
                for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                    *o = f16_at(b);
                }
            }
            DType::BF16 => {
                for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                    *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
                }
            }
            DType::Q8_0 => {
                for (o, b) in out.chunks_exact_mut(QK).zip(src.chunks_exact(34)) {
                    let d = f16_at(b);
                    for j in 0..QK {
                        o[j] = d * (b[2 + j] as i8) as f32;
                    }
                }
            }
            DType::Q4_0 => {
                for (o, b) in out.chunks_exact_mut(QK).zip(src.chunks_exact(18)) {
                    let d = f16_at(b);
                    for j in 0..16 {
                        o[j] = d * ((b[2 + j] & 15) as i32 - 8) as f32;
                        o[j + 16] = d * ((b[2 + j] >> 4) as i32 - 8) as f32;
                    }
                }
            }
            DType::Q4_1 => {
                for (o, b) in out.chunks_exact_mut(QK).zip(src.chunks_exact(20)) {
                    let (d, m) = (f16_at(b), f16_at(&b[2..]));
                    for j in 0..16 {
                        o[j] = d * (b[4 + j] & 15) as f32 + m;
                        o[j + 16] = d * (b[4 + j] >> 4) as f32 + m;
                    }
                }
            }
            // The newer types are checked against the `gguf` package's
            // dequantizer instead (crates/akunu-cpu/tests/gguf_dequant.rs).
            other => panic!("no test dequantizer for {other}"),
        }
        out
    }

    /// Deterministic pseudo-random values with some structure (outliers,
    /// all-equal and all-zero blocks).
    fn sample(n: usize) -> Vec<f32> {
        let mut s = 0x1234_5678_9abc_def0u64;
        let mut v: Vec<f32> = (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
            })
            .collect();
        v[5] = 3.0; // outlier in block 0
        v[40] = -2.5; // negative outlier in block 1
        for x in &mut v[64..96] {
            *x = 0.0; // all-zero block 2
        }
        for x in &mut v[96..128] {
            *x = 0.75; // constant block 3
        }
        v
    }

    #[test]
    fn block_errors_within_half_step() {
        let x = sample(32 * 40);
        for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
            let q = quantize(dtype, &x).unwrap();
            assert_eq!(q.len(), x.len() / 32 * dtype.block_bytes());
            let y = dequantize(dtype, &q, x.len());
            for (b, (xb, yb)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
                let qb = &q[b * dtype.block_bytes()..];
                let d = f16_at(qb).abs();
                // f16 rounding of the scale (relative error 2^-11, times a quant
                // of up to 127) and of Q4_1's min moves each value slightly.
                let m = if dtype == DType::Q4_1 {
                    f16_at(&qb[2..]).abs()
                } else {
                    0.0
                };
                let eps = 128.0 * d * 2f32.powi(-11) + m * 2f32.powi(-10) + 1e-6;
                for (j, (&a, &r)) in xb.iter().zip(yb).enumerate() {
                    let err = (a - r).abs();
                    // Q4_0 maps the extreme value to −8 and clamps the
                    // opposite extreme at +7: up to one full step there.
                    let bound = if dtype == DType::Q4_0 && err > d / 2.0 + eps {
                        let nib = if j < 16 {
                            qb[2 + j] & 15
                        } else {
                            qb[2 + j - 16] >> 4
                        };
                        assert_eq!(
                            nib, 15,
                            "{dtype} block {b} elem {j}: only a clamped value may exceed d/2"
                        );
                        d
                    } else {
                        d / 2.0
                    };
                    assert!(
                        err <= bound + eps,
                        "{dtype} block {b} elem {j}: {a} -> {r}, err {err} > {bound} (d {d})"
                    );
                }
            }
        }
    }

    #[test]
    fn q8_0_hand_block() {
        let mut x = [0f32; 32];
        x[0] = 127.0;
        x[1] = -63.5; // exactly −63.5 → roundf away from zero → −64
        x[2] = 0.49;
        x[3] = 1.5;
        x[31] = -127.0;
        let q = quantize(DType::Q8_0, &x).unwrap();
        assert_eq!(q.len(), 34);
        assert_eq!(&q[..2], &f16::from_f32(1.0).to_le_bytes());
        assert_eq!(q[2] as i8, 127);
        assert_eq!(q[3] as i8, -64);
        assert_eq!(q[4] as i8, 0);
        assert_eq!(q[5] as i8, 2);
        assert_eq!(q[33] as i8, -127);
        assert!(q[6..33].iter().all(|&b| b == 0));
        // all zero: d = 0 and every quant 0.
        assert!(
            quantize(DType::Q8_0, &[0f32; 32])
                .unwrap()
                .iter()
                .all(|&b| b == 0)
        );
    }

    #[test]
    fn q4_0_hand_block() {
        // max magnitude is +8 → d = −1, id = −1: q = min(15, (int8)(8.5 − x)).
        let mut x = [0f32; 32];
        x[0] = 8.0; // 0.5 → 0
        x[1] = -8.0; // 16.5 → 16 → clamped 15
        x[2] = 1.0; // 7.5 → 7
        x[16] = -3.0; // 11.5 → 11
        x[17] = 0.4; // 8.1 → 8
        let q = quantize(DType::Q4_0, &x).unwrap();
        assert_eq!(q.len(), 18);
        assert_eq!(&q[..2], &f16::from_f32(-1.0).to_le_bytes());
        // byte j: low nibble element j, high nibble element j + 16
        assert_eq!(q[2], 11 << 4);
        assert_eq!(q[3], 15 | (8 << 4));
        assert_eq!(q[4], 7 | (8 << 4));
        for &b in &q[5..18] {
            assert_eq!(b, 8 | (8 << 4)); // zeros → 8
        }
        // negative extreme: max = −4 → d = 0.5.
        let mut x = [0f32; 32];
        x[0] = -4.0;
        x[16] = 3.75; // 7.5 + 8.5 = 16 → 15
        let q = quantize(DType::Q4_0, &x).unwrap();
        assert_eq!(&q[..2], &f16::from_f32(0.5).to_le_bytes());
        assert_eq!(q[2], 15 << 4);
        // all zero: d = 0 / −8 = −0.0 (as in C, the f16 sign bit is set),
        // id = 0, every nibble 8.
        let q = quantize(DType::Q4_0, &[0f32; 32]).unwrap();
        assert_eq!(&q[..2], &f16::NEG_ZERO.to_le_bytes());
        assert!(q[2..].iter().all(|&b| b == 0x88));
    }

    #[test]
    fn q4_1_hand_block() {
        // min −1, max 14 → d = 1, m = −1; q = (int8)(x + 1 + 0.5).
        let mut x = [0f32; 32];
        x[0] = -1.0;
        x[1] = 14.0;
        x[2] = 2.4; // 3.9 → 3
        x[16] = 2.6; // 4.1 → 4
        let q = quantize(DType::Q4_1, &x).unwrap();
        assert_eq!(q.len(), 20);
        assert_eq!(&q[..2], &f16::from_f32(1.0).to_le_bytes());
        assert_eq!(&q[2..4], &f16::from_f32(-1.0).to_le_bytes());
        assert_eq!(q[4], 4 << 4);
        assert_eq!(q[5], 15 | (1 << 4)); // zeros → 1
        assert_eq!(q[6], 3 | (1 << 4));
        // constant block: d = 0, m = value, nibbles 0.
        let q = quantize(DType::Q4_1, &[0.75f32; 32]).unwrap();
        assert_eq!(&q[..2], &[0, 0]);
        assert_eq!(&q[2..4], &f16::from_f32(0.75).to_le_bytes());
        assert!(q[4..].iter().all(|&b| b == 0));
        assert_eq!(dequantize(DType::Q4_1, &q, 32), vec![0.75f32; 32]);
    }

    #[test]
    fn float_conversions() {
        let x = [
            1.0f32,
            -2.5,
            1.0 + 2f32.powi(-11),
            1.0 + 3.0 * 2f32.powi(-11),
            65504.0,
            1e-8,
        ];
        let q = quantize(DType::F16, &x).unwrap();
        let y = dequantize(DType::F16, &q, x.len());
        // ties to even: 1 + 2^-11 → 1, 1 + 3·2^-11 → 1 + 2^-9
        assert_eq!(
            y,
            vec![
                1.0,
                -2.5,
                1.0,
                1.0 + 2f32.powi(-9),
                65504.0,
                f16::from_f32(1e-8).to_f32()
            ]
        );

        assert_eq!(f32_to_bf16_bits(1.0), 0x3f80);
        assert_eq!(f32_to_bf16_bits(-2.0), 0xc000);
        // 1 + 2^-8 is a tie between bf16 1.0 and 1 + 2^-7: even wins (1.0).
        assert_eq!(f32_to_bf16_bits(1.0 + 2f32.powi(-8)), 0x3f80);
        // 1 + 3·2^-8: tie between 1 + 2^-7 (odd) and 1 + 2^-6: even wins.
        assert_eq!(f32_to_bf16_bits(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
        assert_eq!(
            f32_to_bf16_bits(1.0 + 2f32.powi(-8) + 2f32.powi(-20)),
            0x3f81
        );
        let nan = f32_to_bf16_bits(f32::NAN);
        assert_eq!(nan & 0x7f80, 0x7f80);
        assert_ne!(nan & 0x7f, 0);
        assert_eq!(f32_to_bf16_bits(f32::INFINITY), 0x7f80);
        let x = sample(256);
        let y = dequantize(DType::BF16, &quantize(DType::BF16, &x).unwrap(), 256);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() <= a.abs() * 2f32.powi(-8), "{a} -> {b}");
        }
        let y = dequantize(DType::F32, &quantize(DType::F32, &x).unwrap(), 256);
        assert_eq!(x, y);
    }

    #[test]
    fn length_errors() {
        assert!(matches!(
            quantize(DType::Q4_0, &[0.0; 33]),
            Err(QuantizeError::Length {
                n: 33,
                block: 32,
                ..
            })
        ));
        let mut out = [0u8; 10];
        let e = quantize_into(DType::Q8_0, &[0.0; 32], &mut out).unwrap_err();
        assert!(e.to_string().contains("34 bytes"), "{e}");
    }
}
