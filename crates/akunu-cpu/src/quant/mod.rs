//! Matrix kernels over quantized and float weights: GEMV (decode) and GEMM
//! (prefill), plus row dequantization.
//!
//! Weights are stored row-major in their GGML block layout (see
//! [`DType`]); activations are always `f32` and every product is accumulated
//! in `f32` (activations are never quantized, so results track an f32
//! reference closely).
//!
//! # SIMD selection
//! The best instruction set is detected once at run time ([`simd_level`]):
//! AVX-512 (F/BW/VL) > AVX2+FMA+F16C > scalar on x86-64, NEON on aarch64.
//! `AKUNU_SIMD=scalar|avx2|avx512` forces a lower level (a request above
//! what the CPU supports is ignored). Internally every entry point has a
//! `*_with(level, ...)` twin so tests can exercise each level side by side.
//!
//! # Kernel structure
//! * GEMV processes 4 weight rows at a time so the `x` loads (and per-block
//!   sums of `x`) are shared and 4 independent accumulator chains are in
//!   flight. The 4 rows come from the 4 quarters of the call's rows (one
//!   long sequential stream per quarter, which the hardware prefetchers
//!   follow; 4 adjacent rows made 4 short interleaved streams that they did
//!   not). Nibbles/bytes are widened to 32-bit lanes and converted to f32
//!   in registers; the block scale is applied once per block.
//!   - Q4_0: `d * sum((q - 8) * x)`; the `-8` is folded into the
//!     accumulator's start value `-8 * x` (AVX2) or into a 16-entry f32
//!     lookup table indexed by the nibble (AVX-512 `vpermps`).
//!   - Q4_1: `d * sum(q * x) + m * sum(x)`.
//!   - Q5_0/Q5_1: as Q4_0/Q4_1, the fifth bits moved into place with a
//!     per-lane variable shift of `qh`.
//!   - Q4_K/Q5_K: per 32-element sub-block, `(d·sc)·Σq·x` in vector
//!     accumulators and `(dmin·m)·Σx` in a per-row scalar from sub-block
//!     sums of `x` shared by the 4 rows; Q6_K: `(d·sc)·Σ(q − 32)·x` per
//!     16-element group. These AVX2 kernels also serve the AVX-512 level.
//!   - Dequantization of those types (embedding rows, GEMM panels) is
//!     portable code in [`blocks`], vectorized by the compiler per level.
//! * GEMM dequantizes a panel of weight rows × a chunk of `k` into an
//!   L1-resident f32 scratch, then runs a register-blocked micro-kernel
//!   (4 weight rows × 3 or 4 activation rows) over it.

use akunu_core::dtype::DType;
use std::sync::OnceLock;

mod blocks;
mod scalar;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "aarch64")]
mod neon;

pub mod q4x8;
pub mod q8act;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;
pub use q8act::{Q8Act, gemv_q8, gemv_q8_multi, supports_q8};

/// Elements per quantization block (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).
const QK: usize = 32;

/// An instruction-set level the kernels can run at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Level {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "aarch64")]
    Neon,
}

impl Level {
    fn name(self) -> &'static str {
        match self {
            Level::Scalar => "scalar",
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => "avx2+fma",
            #[cfg(target_arch = "x86_64")]
            Level::Avx512 => "avx512",
            #[cfg(target_arch = "aarch64")]
            Level::Neon => "neon",
        }
    }
}

/// Levels this CPU supports, lowest first (always starts with `Scalar`).
pub(crate) fn supported_levels() -> Vec<Level> {
    #[allow(unused_mut)]
    let mut v = vec![Level::Scalar];
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c");
        if avx2 {
            v.push(Level::Avx2);
            if std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vl")
            {
                v.push(Level::Avx512);
            }
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        // NEON is part of the aarch64 baseline.
        v.push(Level::Neon);
    }
    v
}

fn detect_level() -> Level {
    let levels = supported_levels();
    let best = *levels.last().unwrap_or(&Level::Scalar);
    // AKUNU_SIMD may only lower the level: pick the requested level if the
    // CPU has it, else fall back to the best available one.
    let want = match std::env::var("AKUNU_SIMD") {
        Ok(s) => s.trim().to_ascii_lowercase(),
        Err(_) => return best,
    };
    let requested = match want.as_str() {
        "scalar" => Some(Level::Scalar),
        #[cfg(target_arch = "x86_64")]
        "avx2" | "avx2+fma" => Some(Level::Avx2),
        #[cfg(target_arch = "x86_64")]
        "avx512" => Some(Level::Avx512),
        #[cfg(target_arch = "aarch64")]
        "neon" => Some(Level::Neon),
        _ => None,
    };
    match requested {
        Some(l) if levels.contains(&l) => l,
        _ => best,
    }
}

/// The level used by the public entry points (detected once).
pub(crate) fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(detect_level)
}

/// Which SIMD path the kernels use on this machine ("avx512", "avx2+fma",
/// "neon", "scalar").
pub fn simd_level() -> &'static str {
    level().name()
}

/// Bytes of one row of `k` elements.
///
/// Panics if `k` is not a whole number of `dtype` blocks (32 elements, or
/// 256 for the K-quants).
pub fn row_bytes(dtype: DType, k: usize) -> usize {
    let be = dtype.block_elems();
    assert!(
        k.is_multiple_of(be),
        "row of {k} elements is not a whole number of {dtype} blocks"
    );
    (k / be) * dtype.block_bytes()
}

/// Dequantize one row (`src` = exactly `row_bytes(dtype, k)` bytes) into
/// `out` (len `k`), f32.
pub fn dequant_row(dtype: DType, src: &[u8], k: usize, out: &mut [f32]) {
    dequant_row_with(level(), dtype, src, k, out)
}

pub(crate) fn dequant_row_with(lvl: Level, dtype: DType, src: &[u8], k: usize, out: &mut [f32]) {
    assert_eq!(src.len(), row_bytes(dtype, k), "dequant_row: src length");
    assert_eq!(out.len(), k, "dequant_row: out length");
    match lvl {
        Level::Scalar => scalar::dequant_row(dtype, src, k, out),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level is only constructed when the CPU supports its
        // features (`supported_levels`); lengths were checked just above.
        Level::Avx2 => unsafe { avx2::dequant_row(dtype, src, k, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Level::Avx512 => unsafe { avx512::dequant_row(dtype, src, k, out) },
        #[cfg(target_arch = "aarch64")]
        Level::Neon => scalar::dequant_row(dtype, src, k, out),
    }
}

/// `y[r] = dot(row r of W, x)` for `r in 0..y.len()`. `w` starts at row 0
/// and holds at least `y.len() * row_bytes(dtype, k)` bytes; `x.len() == k`.
/// This is the decode hot path.
pub fn gemv(dtype: DType, w: &[u8], k: usize, x: &[f32], y: &mut [f32]) {
    gemv_with(level(), dtype, w, k, x, y)
}

pub(crate) fn gemv_with(lvl: Level, dtype: DType, w: &[u8], k: usize, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), k, "gemv: x length");
    let rb = row_bytes(dtype, k);
    let need = rb.checked_mul(y.len()).expect("gemv: size overflow");
    assert!(w.len() >= need, "gemv: weight buffer too short");
    let w = &w[..need];
    match lvl {
        Level::Scalar => scalar::gemv(dtype, w, k, x, y),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level is only constructed when the CPU supports its
        // features; `w.len() == y.len() * rb` and `x.len() == k` hold.
        Level::Avx2 => unsafe { avx2::gemv(dtype, w, k, x, y) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Level::Avx512 => unsafe { avx512::gemv(dtype, w, k, x, y) },
        #[cfg(target_arch = "aarch64")]
        Level::Neon => neon::gemv(dtype, w, k, x, y),
    }
}

/// Multi-row product for short steps (speculative verification): for
/// `t in 0..n_x` and `r in 0..n_rows`, `y[t * n_rows + r] = dot(row r of W,
/// x[t*k .. t*k+k])` (input-row major), each value **bit-identical** to
/// [`gemv`] of input row `t` alone. Each weight block is unpacked once and
/// applied to a chunk of input rows, every (weight row, input row) pair
/// keeping the one-row kernel's exact operation order; the one-row kernels
/// are the one-input instances of the same code.
pub fn gemv_multi(
    dtype: DType,
    w: &[u8],
    k: usize,
    n_rows: usize,
    x: &[f32],
    n_x: usize,
    y: &mut [f32],
) {
    gemv_multi_with(level(), dtype, w, k, n_rows, x, n_x, y)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn gemv_multi_with(
    lvl: Level,
    dtype: DType,
    w: &[u8],
    k: usize,
    n_rows: usize,
    x: &[f32],
    n_x: usize,
    y: &mut [f32],
) {
    let rb = row_bytes(dtype, k);
    let need = rb.checked_mul(n_rows).expect("gemv_multi: size overflow");
    assert!(w.len() >= need, "gemv_multi: weight buffer too short");
    assert_eq!(
        x.len(),
        k.checked_mul(n_x).expect("gemv_multi: size overflow"),
        "gemv_multi: x length"
    );
    assert_eq!(
        y.len(),
        n_rows.checked_mul(n_x).expect("gemv_multi: size overflow"),
        "gemv_multi: y length"
    );
    let w = &w[..need];
    if n_x <= 1 || n_rows == 0 {
        // One input row: the same layout as `gemv`.
        if n_x == 1 {
            gemv_with(lvl, dtype, w, k, x, y);
        }
        return;
    }
    match lvl {
        Level::Scalar => scalar::gemv_multi(dtype, w, k, n_rows, x, n_x, y),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports the level's features; the lengths were
        // checked above (`w.len() == n_rows * rb`, `x.len() == n_x * k`,
        // `y.len() == n_x * n_rows`).
        Level::Avx2 => unsafe { avx2::gemv_multi(dtype, w, k, n_rows, x, n_x, y) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Level::Avx512 => unsafe { avx512::gemv_multi(dtype, w, k, n_rows, x, n_x, y) },
        #[cfg(target_arch = "aarch64")]
        Level::Neon => {
            // One-row products per input row (exact by construction).
            for t in 0..n_x {
                let yt = &mut y[t * n_rows..(t + 1) * n_rows];
                neon::gemv(dtype, w, k, &x[t * k..(t + 1) * k], yt);
            }
        }
    }
}

/// Splits `n_x` input rows into chunks of at most `max` (sizes as even as
/// possible) and picks each chunk's kernels: `(first row, pick(size))`.
pub(crate) fn multi_chunks<K>(
    n_x: usize,
    max: usize,
    pick: impl Fn(usize) -> K,
) -> Vec<(usize, K)> {
    let nc = n_x.div_ceil(max.max(1));
    let mut out = Vec::with_capacity(nc);
    let mut t0 = 0;
    for c in 0..nc {
        let n = (n_x - t0).div_ceil(nc - c);
        out.push((t0, pick(n)));
        t0 += n;
    }
    out
}

/// `by_n!(n, |N| expr)`: evaluates `expr` with the constant `N == n` for
/// `n` in `1..=8` (const-generic kernels chosen by a run-time row count).
macro_rules! by_n {
    ($n:expr, |$N:ident| $e:expr) => {
        match $n {
            1 => {
                const $N: usize = 1;
                $e
            }
            2 => {
                const $N: usize = 2;
                $e
            }
            3 => {
                const $N: usize = 3;
                $e
            }
            4 => {
                const $N: usize = 4;
                $e
            }
            5 => {
                const $N: usize = 5;
                $e
            }
            6 => {
                const $N: usize = 6;
                $e
            }
            7 => {
                const $N: usize = 7;
                $e
            }
            8 => {
                const $N: usize = 8;
                $e
            }
            n => unreachable!("by_n: {n} input rows (1..=8)"),
        }
    };
}
#[allow(unused_imports)]
pub(crate) use by_n;

/// Batched product for prefill: for `t in 0..n_x` and `r in 0..n_rows`,
/// `y[r * n_x + t] = dot(row r of W, x[t*k .. t*k+k])` (weight-row major).
pub fn gemm(dtype: DType, w: &[u8], k: usize, n_rows: usize, x: &[f32], n_x: usize, y: &mut [f32]) {
    gemm_with(level(), dtype, w, k, n_rows, x, n_x, y)
}

/// Weight rows dequantized together into the scratch panel.
const PANEL_ROWS: usize = 8;
/// Columns (elements of `k`) per scratch chunk; a multiple of 256 so chunks
/// start on block boundaries. PANEL_ROWS * KC * 4 B = 16 KiB (L1-resident).
const KC: usize = 512;

#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_with(
    lvl: Level,
    dtype: DType,
    w: &[u8],
    k: usize,
    n_rows: usize,
    x: &[f32],
    n_x: usize,
    y: &mut [f32],
) {
    let rb = row_bytes(dtype, k);
    let need_w = rb.checked_mul(n_rows).expect("gemm: size overflow");
    assert!(w.len() >= need_w, "gemm: weight buffer too short");
    assert_eq!(
        x.len(),
        k.checked_mul(n_x).expect("gemm: size overflow"),
        "gemm: x length"
    );
    assert_eq!(
        y.len(),
        n_rows.checked_mul(n_x).expect("gemm: size overflow"),
        "gemm: y length"
    );
    if n_x == 1 {
        // Same layout as GEMV (y[r * 1 + 0]).
        return gemv_with(lvl, dtype, w, k, x, y);
    }
    y.fill(0.0);
    if k == 0 || n_rows == 0 || n_x == 0 {
        return;
    }
    let (mr, nt) = tile_shape(lvl);
    let mut scratch = vec![0f32; PANEL_ROWS * KC];
    let mut r0 = 0;
    while r0 < n_rows {
        let pr = PANEL_ROWS.min(n_rows - r0);
        let mut k0 = 0;
        while k0 < k {
            let kl = KC.min(k - k0);
            // k0 and k0 + kl are multiples of 256 (or k itself), so the byte
            // range below starts and ends on block boundaries.
            let b0 = row_bytes(dtype, k0);
            let b1 = row_bytes(dtype, k0 + kl);
            for i in 0..pr {
                let row = &w[(r0 + i) * rb..(r0 + i + 1) * rb];
                dequant_row_with(
                    lvl,
                    dtype,
                    &row[b0..b1],
                    kl,
                    &mut scratch[i * KC..i * KC + kl],
                );
            }
            let mut t0 = 0;
            while t0 < n_x {
                let ntl = nt.min(n_x - t0);
                let mut i0 = 0;
                while i0 < pr {
                    let mrl = mr.min(pr - i0);
                    let a = &scratch[i0 * KC..];
                    let b = &x[t0 * k + k0..];
                    let c = &mut y[(r0 + i0) * n_x + t0..];
                    tile_with(lvl, a, KC, mrl, b, k, ntl, kl, c, n_x);
                    i0 += mrl;
                }
                t0 += ntl;
            }
            k0 += kl;
        }
        r0 += pr;
    }
}

/// (weight rows, activation rows) of the GEMM micro-kernel at `lvl`.
fn tile_shape(lvl: Level) -> (usize, usize) {
    match lvl {
        Level::Scalar => (4, 4),
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => (4, 3),
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => (4, 4),
        #[cfg(target_arch = "aarch64")]
        Level::Neon => (4, 4),
    }
}

/// Checks the bounds every micro-kernel relies on:
/// `c[i*ldc + j] += dot(a[i*lda ..][..len], b[j*ldb ..][..len])` for
/// `i < mr`, `j < nt`, with `1 <= mr <= mr_max`, `1 <= nt <= nt_max`.
#[allow(clippy::too_many_arguments)]
fn check_tile(
    a: &[f32],
    lda: usize,
    mr: usize,
    b: &[f32],
    ldb: usize,
    nt: usize,
    len: usize,
    c: &[f32],
    ldc: usize,
    (mr_max, nt_max): (usize, usize),
) {
    assert!((1..=mr_max).contains(&mr) && (1..=nt_max).contains(&nt));
    assert!(a.len() >= (mr - 1) * lda + len);
    assert!(b.len() >= (nt - 1) * ldb + len);
    assert!(c.len() >= (mr - 1) * ldc + nt);
}

#[allow(clippy::too_many_arguments)]
fn tile_with(
    lvl: Level,
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
    check_tile(a, lda, mr, b, ldb, nt, len, c, ldc, tile_shape(lvl));
    match lvl {
        Level::Scalar => scalar::tile(a, lda, mr, b, ldb, nt, len, c, ldc),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports the level's features; `check_tile`
        // verified every index the kernel touches is in bounds.
        Level::Avx2 => unsafe { avx2::tile(a, lda, mr, b, ldb, nt, len, c, ldc) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Level::Avx512 => unsafe { avx512::tile(a, lda, mr, b, ldb, nt, len, c, ldc) },
        #[cfg(target_arch = "aarch64")]
        Level::Neon => neon::tile(a, lda, mr, b, ldb, nt, len, c, ldc),
    }
}

/// Reads the little-endian f16 at `b[0..2]` as f32.
#[inline(always)]
fn f16_at(b: &[u8]) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// Reads the little-endian bf16 at `b[0..2]` as f32.
#[inline(always)]
fn bf16_at(b: &[u8]) -> f32 {
    f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift64* — small deterministic RNG for test data (shared with the
    /// q8-activation tests).
    pub(super) struct Rng(pub(super) u64);
    impl Rng {
        pub(super) fn next_u64(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        pub(super) fn byte(&mut self) -> u8 {
            (self.next_u64() >> 56) as u8
        }
        /// Uniform in [-1, 1).
        pub(super) fn unit(&mut self) -> f32 {
            ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
        /// A block scale: usually O(1), sometimes tiny (f16 subnormal
        /// range) or zero; either sign.
        pub(super) fn scale(&mut self) -> f32 {
            match self.next_u64() % 8 {
                0 => self.unit() * 1e-6,
                1 => self.unit() * 3e-3,
                2 => 0.0,
                _ => self.unit() * 2.0,
            }
        }
    }

    pub(super) fn put_f16(out: &mut Vec<u8>, v: f32) {
        out.extend_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
    }

    /// `rows` random rows of `k` elements in `dtype` layout.
    fn random_weights(rng: &mut Rng, dtype: DType, k: usize, rows: usize) -> Vec<u8> {
        let mut w = Vec::with_capacity(rows * row_bytes(dtype, k));
        for _ in 0..rows {
            match dtype {
                DType::F32 => {
                    for _ in 0..k {
                        w.extend_from_slice(&(rng.unit() * 3.0).to_le_bytes());
                    }
                }
                DType::F16 => {
                    for _ in 0..k {
                        put_f16(&mut w, rng.unit() * 3.0);
                    }
                }
                DType::BF16 => {
                    for _ in 0..k {
                        let b = (rng.unit() * 3.0).to_bits() >> 16;
                        w.extend_from_slice(&(b as u16).to_le_bytes());
                    }
                }
                DType::Q4_0 | DType::Q4_1 | DType::Q8_0 => {
                    for _ in 0..k / QK {
                        put_f16(&mut w, rng.scale());
                        if dtype == DType::Q4_1 {
                            put_f16(&mut w, rng.scale());
                        }
                        let nq = if dtype == DType::Q8_0 { 32 } else { 16 };
                        for _ in 0..nq {
                            w.push(rng.byte());
                        }
                    }
                }
                DType::Q5_0 | DType::Q5_1 | DType::Q4_K | DType::Q5_K | DType::Q6_K => {
                    // Random quants, scales and mins; the f16 fields get
                    // finite values from `scale()`.
                    let f16_at: &[usize] = match dtype {
                        DType::Q5_0 => &[0],
                        DType::Q6_K => &[208],
                        _ => &[0, 2],
                    };
                    for _ in 0..k / dtype.block_elems() {
                        let mut blk: Vec<u8> =
                            (0..dtype.block_bytes()).map(|_| rng.byte()).collect();
                        for &o in f16_at {
                            let h = half::f16::from_f32(rng.scale()).to_bits().to_le_bytes();
                            blk[o..o + 2].copy_from_slice(&h);
                        }
                        w.extend_from_slice(&blk);
                    }
                }
            }
        }
        assert_eq!(w.len(), rows * row_bytes(dtype, k));
        w
    }

    const ALL: [DType; 11] = DType::ALL;

    /// The row lengths tested for `dtype`: whole blocks only.
    fn test_ks(dtype: DType, float_extra: &[usize]) -> Vec<usize> {
        let mut ks: Vec<usize> = [32, 64, 256, 576, 1536, 2048]
            .into_iter()
            .filter(|k: &usize| k.is_multiple_of(dtype.block_elems()))
            .collect();
        if dtype.block_elems() == 1 {
            ks.extend(float_extra);
        }
        ks
    }

    /// f64 reference rows: scalar dequantization, then exact-ish dot in f64.
    /// Returns (dot, sum |w||x|) per (row, x-row).
    fn reference(
        dtype: DType,
        w: &[u8],
        k: usize,
        rows: usize,
        x: &[f32],
        n_x: usize,
    ) -> Vec<(f64, f64)> {
        let rb = row_bytes(dtype, k);
        let mut deq = vec![0f32; k];
        let mut out = Vec::with_capacity(rows * n_x);
        for r in 0..rows {
            dequant_row_with(Level::Scalar, dtype, &w[r * rb..(r + 1) * rb], k, &mut deq);
            for t in 0..n_x {
                let xt = &x[t * k..(t + 1) * k];
                let mut s = 0f64;
                let mut a = 0f64;
                for (wv, xv) in deq.iter().zip(xt) {
                    s += *wv as f64 * *xv as f64;
                    a += (*wv as f64 * *xv as f64).abs();
                }
                out.push((s, a));
            }
        }
        out
    }

    fn check_close(what: &str, got: f32, (want, mag): (f64, f64)) {
        let err = (got as f64 - want).abs();
        assert!(
            err <= 1e-5 * mag + 1e-30,
            "{what}: got {got}, want {want} (err {err:e}, sum|wx| {mag:e})"
        );
    }

    #[test]
    fn gemv_matches_reference_all_levels() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for lvl in supported_levels() {
            for dtype in ALL {
                for k in test_ks(dtype, &[1, 7, 15, 17, 33, 100, 577]) {
                    for rows in [1, 3, 7, 130] {
                        let w = random_weights(&mut rng, dtype, k, rows);
                        let x: Vec<f32> = (0..k).map(|_| rng.unit()).collect();
                        let want = reference(dtype, &w, k, rows, &x, 1);
                        let mut y = vec![f32::NAN; rows];
                        gemv_with(lvl, dtype, &w, k, &x, &mut y);
                        for r in 0..rows {
                            let what =
                                format!("gemv {} {dtype} k={k} rows={rows} r={r}", lvl.name());
                            check_close(&what, y[r], want[r]);
                        }
                    }
                }
            }
        }
    }

    /// The multi-row product equals, bit for bit, one one-row product per
    /// input row: every level, every type, R = 2, 3, 5, 8, 16 input rows,
    /// weight-row counts that leave tails after the kernels' row groups, odd
    /// `k` for the float types, inputs of mixed magnitudes (so any change in
    /// the order of the sums shows in the low bits).
    #[test]
    fn gemv_multi_bit_identical_to_one_row() {
        let mut rng = Rng(0x5EED_0006);
        let mut checked = 0usize;
        for lvl in supported_levels() {
            for dtype in ALL {
                // 3072 and 8192: rows too long for the AVX2 kernels' chunks
                // of 8 input rows in L1 (chunks of 2, and of 1).
                let ks: Vec<usize> = test_ks(dtype, &[1, 7, 17, 33, 577])
                    .into_iter()
                    .filter(|&k| k <= 1536)
                    .chain([3072, 8192])
                    .collect();
                for k in ks {
                    for n_rows in [1, 3, 5, 9] {
                        let w = random_weights(&mut rng, dtype, k, n_rows);
                        for n_x in [2, 3, 5, 8, 16] {
                            let x: Vec<f32> = (0..n_x * k)
                                .map(|i| rng.unit() * [1.0, 37.0, 1e-3][i % 3])
                                .collect();
                            let mut y = vec![f32::NAN; n_x * n_rows];
                            gemv_multi_with(lvl, dtype, &w, k, n_rows, &x, n_x, &mut y);
                            for t in 0..n_x {
                                let mut y1 = vec![f32::NAN; n_rows];
                                gemv_with(lvl, dtype, &w, k, &x[t * k..(t + 1) * k], &mut y1);
                                for r in 0..n_rows {
                                    let got = y[t * n_rows + r];
                                    assert_eq!(
                                        got.to_bits(),
                                        y1[r].to_bits(),
                                        "{} {dtype} k={k} rows={n_rows} n_x={n_x} t={t} r={r}: \
                                         multi {got:e} vs one-row {:e}",
                                        lvl.name(),
                                        y1[r]
                                    );
                                    checked += 1;
                                }
                            }
                        }
                    }
                }
            }
        }
        eprintln!("gemv_multi: {checked} outputs bit-identical to one-row products");
    }

    #[test]
    fn gemv_multi_edge_cases() {
        let mut rng = Rng(31);
        for lvl in supported_levels() {
            for dtype in ALL {
                let k = dtype.block_elems().max(64);
                // Extra weight bytes beyond n_rows rows are ignored.
                let w = random_weights(&mut rng, dtype, k, 7);
                let x: Vec<f32> = (0..3 * k).map(|_| rng.unit()).collect();
                let mut y = vec![f32::NAN; 3 * 5];
                gemv_multi_with(lvl, dtype, &w, k, 5, &x, 3, &mut y);
                let want = reference(dtype, &w, k, 5, &x, 3);
                for r in 0..5 {
                    for t in 0..3 {
                        check_close("multi extra bytes", y[t * 5 + r], want[r * 3 + t]);
                    }
                }
                // k = 0, no rows, no inputs.
                let mut y = vec![f32::NAN; 6];
                gemv_multi_with(lvl, dtype, &[], 0, 3, &[], 2, &mut y);
                assert_eq!(y, [0.0; 6]);
                gemv_multi_with(lvl, dtype, &[], k, 0, &vec![0.0; 2 * k], 2, &mut []);
                gemv_multi_with(lvl, dtype, &w, k, 3, &[], 0, &mut []);
            }
        }
    }

    #[test]
    fn gemm_matches_reference_all_levels() {
        let mut rng = Rng(0x1234_5678_9ABC_DEF1);
        for lvl in supported_levels() {
            for dtype in ALL {
                for k in test_ks(dtype, &[1, 7, 33, 300, 1100]) {
                    for rows in [1, 3, 7, 130] {
                        let w = random_weights(&mut rng, dtype, k, rows);
                        for n_x in [1, 2, 5, 17] {
                            let x: Vec<f32> = (0..k * n_x).map(|_| rng.unit()).collect();
                            let want = reference(dtype, &w, k, rows, &x, n_x);
                            let mut y = vec![f32::NAN; rows * n_x];
                            gemm_with(lvl, dtype, &w, k, rows, &x, n_x, &mut y);
                            for r in 0..rows {
                                for t in 0..n_x {
                                    let what = format!(
                                        "gemm {} {dtype} k={k} rows={rows} n_x={n_x} r={r} t={t}",
                                        lvl.name()
                                    );
                                    check_close(&what, y[r * n_x + t], want[r * n_x + t]);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn extra_weight_bytes_are_ignored() {
        // `w` may be longer than y.len() rows (e.g. a slice into a bigger
        // tensor); only the first rows are used.
        let mut rng = Rng(77);
        for lvl in supported_levels() {
            for dtype in ALL {
                let k = dtype.block_elems().max(64);
                let w = random_weights(&mut rng, dtype, k, 9);
                let x: Vec<f32> = (0..k).map(|_| rng.unit()).collect();
                let want = reference(dtype, &w, k, 5, &x, 1);
                let mut y = vec![0f32; 5];
                gemv_with(lvl, dtype, &w, k, &x, &mut y);
                for r in 0..5 {
                    check_close("extra bytes", y[r], want[r]);
                }
            }
        }
    }

    #[test]
    fn empty_shapes() {
        for lvl in supported_levels() {
            for dtype in ALL {
                // k = 0: every dot product is empty.
                let mut y = vec![f32::NAN; 3];
                gemv_with(lvl, dtype, &[], 0, &[], &mut y);
                assert_eq!(y, [0.0; 3]);
                let mut y = vec![f32::NAN; 6];
                gemm_with(lvl, dtype, &[], 0, 3, &[], 2, &mut y);
                assert_eq!(y, [0.0; 6]);
                // no rows / no activations.
                let k = dtype.block_elems().max(32);
                gemv_with(lvl, dtype, &[], k, &vec![0.0; k], &mut []);
                gemm_with(lvl, dtype, &[], k, 0, &vec![0.0; 2 * k], 2, &mut []);
                gemm_with(
                    lvl,
                    dtype,
                    &vec![0u8; row_bytes(dtype, k)],
                    k,
                    1,
                    &[],
                    0,
                    &mut [],
                );
            }
        }
    }

    #[test]
    fn dequant_known_values() {
        // Q4_0: d = 0.5; qs[j] = j | (15 - j) << 4.
        let mut q40 = Vec::new();
        put_f16(&mut q40, 0.5);
        q40.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut want40 = [0f32; 32];
        for j in 0..16 {
            want40[j] = 0.5 * (j as f32 - 8.0);
            want40[j + 16] = 0.5 * (7.0 - j as f32);
        }
        // Q4_1: d = 0.5, m = -1; same nibbles.
        let mut q41 = Vec::new();
        put_f16(&mut q41, 0.5);
        put_f16(&mut q41, -1.0);
        q41.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut want41 = [0f32; 32];
        for j in 0..16 {
            want41[j] = 0.5 * j as f32 - 1.0;
            want41[j + 16] = 0.5 * (15 - j) as f32 - 1.0;
        }
        // Q8_0: d = -0.25; bytes cover the extremes -128 and 127.
        let q8vals: [i8; 32] = [
            -128, 127, 0, 1, -1, 2, -2, 64, -64, 100, -100, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
            14, 15, 16, -17, -18, -19, -20, -21, -22, -23,
        ];
        let mut q8 = Vec::new();
        put_f16(&mut q8, -0.25);
        q8.extend(q8vals.iter().map(|&v| v as u8));
        let want8: Vec<f32> = q8vals.iter().map(|&v| -0.25 * v as f32).collect();
        // Two blocks: a second block with d = 2 checks block indexing.
        let mut q40x2 = q40.clone();
        q40x2.extend_from_slice(&half::f16::from_f32(2.0).to_bits().to_le_bytes());
        q40x2.extend(std::iter::repeat_n(0xF0u8, 16));
        let mut want40x2 = want40.to_vec();
        want40x2.extend([-16.0f32; 16]);
        want40x2.extend([14.0f32; 16]);
        // Float types.
        let fvals = [1.0f32, -2.5, 65504.0, 0.0, -0.0, 1.5e-5, 3.25, -7.0, 0.125];
        let f32b: Vec<u8> = fvals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let f16b: Vec<u8> = fvals
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes())
            .collect();
        let want_f16: Vec<f32> = fvals
            .iter()
            .map(|&v| half::f16::from_f32(v).to_f32())
            .collect();
        let bf16b: Vec<u8> = [
            0x3F80u16, 0xC020, 0x0000, 0x8000, 0x4049, 0x7F80, 0xFF80, 0x3E00,
        ]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
        let want_bf16 = [
            1.0f32,
            -2.5,
            0.0,
            -0.0,
            3.140625,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.125,
        ];

        let cases: Vec<(DType, &[u8], Vec<f32>)> = vec![
            (DType::Q4_0, &q40, want40.to_vec()),
            (DType::Q4_0, &q40x2, want40x2),
            (DType::Q4_1, &q41, want41.to_vec()),
            (DType::Q8_0, &q8, want8),
            (DType::F32, &f32b, fvals.to_vec()),
            (DType::F16, &f16b, want_f16),
            (DType::BF16, &bf16b, want_bf16.to_vec()),
        ];
        for lvl in supported_levels() {
            for (dtype, src, want) in &cases {
                let mut out = vec![f32::NAN; want.len()];
                dequant_row_with(lvl, *dtype, src, want.len(), &mut out);
                for (j, (o, w)) in out.iter().zip(want).enumerate() {
                    assert_eq!(
                        o.to_bits(),
                        w.to_bits(),
                        "{} {dtype} element {j}: {o} vs {w}",
                        lvl.name()
                    );
                }
            }
        }
    }

    #[test]
    fn dequant_levels_bit_identical() {
        let mut rng = Rng(4242);
        for dtype in ALL {
            let ks = [32, 96, 256, 576, 768, 1056];
            for k in ks
                .into_iter()
                .filter(|k: &usize| k.is_multiple_of(dtype.block_elems()))
            {
                let w = random_weights(&mut rng, dtype, k, 1);
                let mut want = vec![0f32; k];
                dequant_row_with(Level::Scalar, dtype, &w, k, &mut want);
                for lvl in supported_levels() {
                    let mut out = vec![f32::NAN; k];
                    dequant_row_with(lvl, dtype, &w, k, &mut out);
                    for j in 0..k {
                        assert_eq!(
                            out[j].to_bits(),
                            want[j].to_bits(),
                            "{} {dtype} k={k} j={j}",
                            lvl.name()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn level_names() {
        assert!(["avx512", "avx2+fma", "neon", "scalar"].contains(&simd_level()));
        assert!(supported_levels().contains(&level()));
        eprintln!("levels tested: {:?}", supported_levels());
        assert_eq!(row_bytes(DType::Q4_0, 64), 36);
        assert_eq!(row_bytes(DType::Q4_1, 64), 40);
        assert_eq!(row_bytes(DType::Q8_0, 64), 68);
        assert_eq!(row_bytes(DType::F16, 7), 14);
        assert_eq!(row_bytes(DType::F32, 7), 28);
        assert_eq!(row_bytes(DType::Q5_0, 64), 44);
        assert_eq!(row_bytes(DType::Q5_1, 64), 48);
        assert_eq!(row_bytes(DType::Q4_K, 512), 288);
        assert_eq!(row_bytes(DType::Q5_K, 512), 352);
        assert_eq!(row_bytes(DType::Q6_K, 512), 420);
    }

    /// Dequantization of random blocks against the `gguf` Python package's
    /// dequantizer (vectors written by tools/dequant_vectors.py): bit for
    /// bit at every level; and GEMV over those blocks against the f64 dot
    /// product of gguf's floats. `AKUNU_DEQUANT_VECTORS` points at a fresh
    /// set (scripts/test.sh writes one); the committed set is the default.
    #[test]
    fn gguf_dequant_vectors() {
        let dir = std::env::var_os("AKUNU_DEQUANT_VECTORS")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| {
                std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gguf_dequant")
            });
        eprintln!("dequantization vectors from {}", dir.display());
        let mut rng = Rng(2024);
        for dtype in [
            DType::Q5_0,
            DType::Q5_1,
            DType::Q4_K,
            DType::Q5_K,
            DType::Q6_K,
        ] {
            let read = |ext: &str| {
                let p = dir.join(format!("{dtype}.{ext}"));
                std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
            };
            let blocks = read("blocks");
            let want: Vec<f32> = read("f32")
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let n = want.len();
            assert_eq!(blocks.len(), row_bytes(dtype, n), "{dtype}: file sizes");
            for lvl in supported_levels() {
                let mut got = vec![f32::NAN; n];
                dequant_row_with(lvl, dtype, &blocks, n, &mut got);
                for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{} {dtype} element {j}: akunu {g} vs gguf {w}",
                        lvl.name()
                    );
                }
                // The same bytes as a matrix of rows of k elements.
                for k in [dtype.block_elems(), 1024.min(n), n] {
                    let rows = n / k;
                    let x: Vec<f32> = (0..k).map(|_| rng.unit()).collect();
                    let mut y = vec![f32::NAN; rows];
                    gemv_with(lvl, dtype, &blocks, k, &x, &mut y);
                    let mut y2 = vec![f32::NAN; rows * 3];
                    let x3: Vec<f32> = x.iter().cycle().take(3 * k).copied().collect();
                    gemm_with(lvl, dtype, &blocks, k, rows, &x3, 3, &mut y2);
                    for r in 0..rows {
                        let wr = &want[r * k..(r + 1) * k];
                        let dot: f64 = wr.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
                        let mag: f64 = wr
                            .iter()
                            .zip(&x)
                            .map(|(a, b)| (*a as f64 * *b as f64).abs())
                            .sum();
                        let what = format!("{} {dtype} k={k} row {r}", lvl.name());
                        check_close(&format!("gemv {what}"), y[r], (dot, mag));
                        for t in 0..3 {
                            check_close(&format!("gemm {what} t={t}"), y2[r * 3 + t], (dot, mag));
                        }
                    }
                }
            }
        }
    }

    /// akunu_core's quantizers for the 5-bit and K-quant types, read back
    /// by the dequantizers here: the round trip keeps the values within the
    /// error of a `bits`-bit grid (relative RMS error over uniform values
    /// in [-1, 1); an ideal uniform grid of 2^bits levels over the range
    /// gives 1 / (sqrt(3) * (2^bits - 1)): 0.038 at 4 bits).
    #[test]
    fn quantizer_round_trip() {
        let mut rng = Rng(99);
        let x: Vec<f32> = (0..4096).map(|_| rng.unit()).collect();
        for (dtype, bound) in [
            (DType::Q4_0, 0.08),
            (DType::Q5_0, 0.04),
            (DType::Q5_1, 0.04),
            (DType::Q4_K, 0.08),
            (DType::Q5_K, 0.04),
            (DType::Q6_K, 0.02),
        ] {
            let q = akunu_core::quantize::quantize(dtype, &x).unwrap();
            let mut y = vec![0f32; x.len()];
            dequant_row_with(Level::Scalar, dtype, &q, x.len(), &mut y);
            let err: f64 = x
                .iter()
                .zip(&y)
                .map(|(a, b)| ((a - b) as f64).powi(2))
                .sum();
            let norm: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum();
            let rel = (err / norm).sqrt();
            eprintln!("{dtype}: relative RMS round-trip error {rel:.4}");
            assert!(rel < bound, "{dtype}: relative RMS error {rel} >= {bound}");
        }
        // Constant and all-zero super-blocks come back exactly (or as 0).
        for dtype in [DType::Q4_K, DType::Q5_K, DType::Q6_K] {
            let q = akunu_core::quantize::quantize(dtype, &[0f32; 256]).unwrap();
            let mut y = vec![f32::NAN; 256];
            dequant_row_with(Level::Scalar, dtype, &q, 256, &mut y);
            assert!(y.iter().all(|v| *v == 0.0), "{dtype}: zeros");
        }
    }
}
