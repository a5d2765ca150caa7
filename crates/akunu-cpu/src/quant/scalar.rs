//! Portable scalar kernels: always correct, used as the fallback and as the
//! reference for the SIMD paths. Callers (in `mod.rs`) have already checked
//! all lengths; slices are indexed normally here (no `unsafe`).

use super::{QK, bf16_at, blocks, f16_at, row_bytes};
use akunu_core::dtype::DType;

pub(super) fn dequant_row(dtype: DType, src: &[u8], k: usize, out: &mut [f32]) {
    let out = &mut out[..k];
    match dtype {
        DType::F32 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        DType::F16 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16_at(b);
            }
        }
        DType::BF16 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16_at(b);
            }
        }
        DType::Q4_0 => {
            for (o, blk) in out.chunks_exact_mut(QK).zip(src.chunks_exact(18)) {
                let d = f16_at(blk);
                for j in 0..16 {
                    let q = blk[2 + j];
                    o[j] = d * ((q & 0xF) as i32 - 8) as f32;
                    o[j + 16] = d * ((q >> 4) as i32 - 8) as f32;
                }
            }
        }
        DType::Q4_1 => {
            for (o, blk) in out.chunks_exact_mut(QK).zip(src.chunks_exact(20)) {
                let d = f16_at(blk);
                let m = f16_at(&blk[2..]);
                for j in 0..16 {
                    let q = blk[4 + j];
                    o[j] = d * (q & 0xF) as f32 + m;
                    o[j + 16] = d * (q >> 4) as f32 + m;
                }
            }
        }
        DType::Q8_0 => {
            for (o, blk) in out.chunks_exact_mut(QK).zip(src.chunks_exact(34)) {
                let d = f16_at(blk);
                for j in 0..QK {
                    o[j] = d * (blk[2 + j] as i8) as f32;
                }
            }
        }
        DType::Q5_0 | DType::Q5_1 | DType::Q4_K | DType::Q5_K | DType::Q6_K => {
            blocks::dequant(dtype, src, out)
        }
    }
}

/// Elements dequantized at a time by [`dot_rows_buffered`]: one K-quant
/// super-block, or 8 blocks of the 32-element types.
const CHUNK: usize = 256;

/// Dot products of a 5-bit / K-quant row with the input rows `x[n*k..][..k]`
/// (`acc.len()` of them): each chunk of up to 256 elements is dequantized
/// once into a buffer, then summed with every input row in 8 partial sums.
fn dot_rows_buffered(dtype: DType, row: &[u8], x: &[f32], k: usize, acc: &mut [f32]) {
    let mut buf = [0f32; CHUNK];
    let mut k0 = 0;
    while k0 < k {
        let kl = CHUNK.min(k - k0);
        let src = &row[row_bytes(dtype, k0)..row_bytes(dtype, k0 + kl)];
        blocks::dequant(dtype, src, &mut buf[..kl]);
        for (n, a) in acc.iter_mut().enumerate() {
            let xn = &x[n * k + k0..n * k + k0 + kl];
            let mut s = [0f32; 8];
            for (w8, x8) in buf[..kl].chunks_exact(8).zip(xn.chunks_exact(8)) {
                for i in 0..8 {
                    s[i] += w8[i] * x8[i];
                }
            }
            *a += ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
        }
        k0 += kl;
    }
}

/// Dot products of one row (exactly `row_bytes(dtype, k)` bytes) with the
/// input rows `x[n*k..][..k]` for `n < acc.len()`, into `acc`. Each weight
/// block is unpacked once; every input row sees the same operations in
/// the same order (so one input row gives the one-row result).
#[allow(clippy::needless_range_loop)]
fn dot_rows(dtype: DType, row: &[u8], x: &[f32], k: usize, acc: &mut [f32]) {
    acc.fill(0.0);
    let xb = |n: usize, b: usize| &x[n * k + b * QK..n * k + b * QK + QK];
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => {
            let wv = |j: usize| match dtype {
                DType::F32 => {
                    let b = &row[4 * j..4 * j + 4];
                    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
                }
                DType::F16 => f16_at(&row[2 * j..]),
                _ => bf16_at(&row[2 * j..]),
            };
            for j in 0..k {
                let v = wv(j);
                for (n, a) in acc.iter_mut().enumerate() {
                    *a += v * x[n * k + j];
                }
            }
        }
        DType::Q4_0 => {
            for (b, blk) in row.chunks_exact(18).enumerate() {
                let d = f16_at(blk);
                let mut lo = [0f32; 16];
                let mut hi = [0f32; 16];
                for j in 0..16 {
                    let q = blk[2 + j];
                    lo[j] = ((q & 0xF) as i32 - 8) as f32;
                    hi[j] = ((q >> 4) as i32 - 8) as f32;
                }
                for (n, a) in acc.iter_mut().enumerate() {
                    let xv = xb(n, b);
                    let mut s = 0f32;
                    for j in 0..16 {
                        s += lo[j] * xv[j];
                        s += hi[j] * xv[j + 16];
                    }
                    *a += d * s;
                }
            }
        }
        DType::Q4_1 => {
            for (b, blk) in row.chunks_exact(20).enumerate() {
                let (d, m) = (f16_at(blk), f16_at(&blk[2..]));
                let mut lo = [0f32; 16];
                let mut hi = [0f32; 16];
                for j in 0..16 {
                    let q = blk[4 + j];
                    lo[j] = (q & 0xF) as f32;
                    hi[j] = (q >> 4) as f32;
                }
                for (n, a) in acc.iter_mut().enumerate() {
                    let xv = xb(n, b);
                    let mut s = 0f32;
                    let mut sx = 0f32;
                    for j in 0..16 {
                        s += lo[j] * xv[j];
                        s += hi[j] * xv[j + 16];
                        sx += xv[j] + xv[j + 16];
                    }
                    *a += d * s + m * sx;
                }
            }
        }
        DType::Q8_0 => {
            for (b, blk) in row.chunks_exact(34).enumerate() {
                let d = f16_at(blk);
                let mut q = [0f32; QK];
                for j in 0..QK {
                    q[j] = (blk[2 + j] as i8) as f32;
                }
                for (n, a) in acc.iter_mut().enumerate() {
                    let xv = xb(n, b);
                    let mut s = 0f32;
                    for j in 0..QK {
                        s += q[j] * xv[j];
                    }
                    *a += d * s;
                }
            }
        }
        DType::Q5_0 | DType::Q5_1 | DType::Q4_K | DType::Q5_K | DType::Q6_K => {
            dot_rows_buffered(dtype, row, x, k, acc)
        }
    }
}

/// `w.len() == y.len() * row_bytes(dtype, k)`, `x.len() == k` (checked by caller).
pub(super) fn gemv(dtype: DType, w: &[u8], k: usize, x: &[f32], y: &mut [f32]) {
    let rb = super::row_bytes(dtype, k);
    if rb == 0 {
        y.fill(0.0);
        return;
    }
    for (yv, row) in y.iter_mut().zip(w.chunks_exact(rb)) {
        dot_rows(dtype, row, x, k, std::slice::from_mut(yv));
    }
}

/// Multi-row product (see `super::gemv_multi`): `w.len() == n_rows *
/// row_bytes(dtype, k)`, `x.len() == n_x * k`, `y.len() == n_x * n_rows`
/// (checked by caller).
pub(super) fn gemv_multi(
    dtype: DType,
    w: &[u8],
    k: usize,
    n_rows: usize,
    x: &[f32],
    n_x: usize,
    y: &mut [f32],
) {
    let rb = super::row_bytes(dtype, k);
    if rb == 0 {
        y.fill(0.0);
        return;
    }
    let mut acc = vec![0f32; n_x];
    for (r, row) in w.chunks_exact(rb).take(n_rows).enumerate() {
        dot_rows(dtype, row, x, k, &mut acc);
        for (t, a) in acc.iter().enumerate() {
            y[t * n_rows + r] = *a;
        }
    }
}

/// `c[i*ldc + j] += dot(a[i*lda..][..len], b[j*ldb..][..len])` for `i < mr`,
/// `j < nt` (bounds checked by the caller).
#[allow(clippy::too_many_arguments)]
pub(super) fn tile(
    a: &[f32],
    lda: usize,
    mr: usize,
    b: &[f32],
    ldb: usize,
    nt: usize,
    len: usize,
    c: &mut [f32],
    ldc: usize,
) {
    for i in 0..mr {
        let ar = &a[i * lda..i * lda + len];
        for j in 0..nt {
            let br = &b[j * ldb..j * ldb + len];
            // Four partial sums: shorter dependency chains, slightly better
            // rounding than one running sum.
            let mut s = [0f32; 4];
            let mut ca = ar.chunks_exact(4);
            let mut cb = br.chunks_exact(4);
            for (p, q) in (&mut ca).zip(&mut cb) {
                s[0] += p[0] * q[0];
                s[1] += p[1] * q[1];
                s[2] += p[2] * q[2];
                s[3] += p[3] * q[3];
            }
            let mut t = (s[0] + s[1]) + (s[2] + s[3]);
            for (p, q) in ca.remainder().iter().zip(cb.remainder()) {
                t += p * q;
            }
            c[i * ldc + j] += t;
        }
    }
}
