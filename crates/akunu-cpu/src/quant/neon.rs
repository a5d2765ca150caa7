//! aarch64 NEON kernels (NEON is baseline on aarch64, so no detection).
//!
//! Deliberately simple: weights are dequantized (by the scalar code) into a
//! small stack buffer, then dotted with `x` using 4-lane FMAs. All loads go
//! through slices whose lengths are checked by the chunking arithmetic.

use super::{row_bytes, scalar};
use akunu_core::dtype::DType;
use core::arch::aarch64::*;

/// Elements dequantized at a time (a multiple of the 32-element block).
const CHUNK: usize = 256;

/// Dot product of two equal-length slices with 4 × 4-lane accumulators.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut i = 0;
    let mut s;
    // SAFETY: NEON is always available on aarch64; every vld1q_f32 reads
    // elements i..i+4 (or i..i+16) with i + 16 <= n resp. i + 4 <= n, inside
    // both slices.
    unsafe {
        let mut acc = [vdupq_n_f32(0.0); 4];
        while i + 16 <= n {
            for (j, v) in acc.iter_mut().enumerate() {
                let p = i + 4 * j;
                *v = vfmaq_f32(
                    *v,
                    vld1q_f32(a.as_ptr().add(p)),
                    vld1q_f32(b.as_ptr().add(p)),
                );
            }
            i += 16;
        }
        while i + 4 <= n {
            acc[0] = vfmaq_f32(
                acc[0],
                vld1q_f32(a.as_ptr().add(i)),
                vld1q_f32(b.as_ptr().add(i)),
            );
            i += 4;
        }
        s = vaddvq_f32(vaddq_f32(
            vaddq_f32(acc[0], acc[1]),
            vaddq_f32(acc[2], acc[3]),
        ));
    }
    for j in i..n {
        s += a[j] * b[j];
    }
    s
}

/// `w.len() == y.len() * row_bytes(dtype, k)`, `x.len() == k` (checked by caller).
pub(super) fn gemv(dtype: DType, w: &[u8], k: usize, x: &[f32], y: &mut [f32]) {
    let rb = row_bytes(dtype, k);
    let mut buf = [0f32; CHUNK];
    for (r, yv) in y.iter_mut().enumerate() {
        let row = &w[r * rb..(r + 1) * rb];
        let mut s = 0f32;
        let mut k0 = 0;
        while k0 < k {
            let kl = CHUNK.min(k - k0);
            // k0 and k0 + kl are multiples of 32 or equal k: whole blocks.
            let src = &row[row_bytes(dtype, k0)..row_bytes(dtype, k0 + kl)];
            scalar::dequant_row(dtype, src, kl, &mut buf[..kl]);
            s += dot(&buf[..kl], &x[k0..k0 + kl]);
            k0 += kl;
        }
        *yv = s;
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
        for j in 0..nt {
            c[i * ldc + j] += dot(&a[i * lda..i * lda + len], &b[j * ldb..j * ldb + len]);
        }
    }
}
