//! AVX-512 (F/BW/VL) kernels (16 f32 lanes).
//!
//! Every function here is `#[target_feature(enable = "avx512f,avx512bw,
//! avx512vl,avx2,fma,f16c")]`; the `unsafe fn` entry points require (1)
//! that the CPU supports those features (guaranteed by `Level::Avx512` only
//! being constructed after detection) and (2) the slice-length contracts
//! stated on each function (checked with `assert!` in `mod.rs`). Inner loops
//! read through raw pointers whose offsets stay inside those lengths; float
//! tails use masked loads, which never touch masked-off elements.
//!
//! Q4 nibbles are turned into floats with a 16-entry f32 lookup table and
//! `vpermps` (`_mm512_permutexvar_ps` only looks at the low 4 bits of each
//! index lane, so the low nibble needs no masking).

use super::x86::{PF_DIST, pf_ahead, prefetch};
use super::{QK, blocks, row_bytes};
use akunu_core::dtype::DType;
use core::arch::x86_64::*;

/// 512 -> 256 bits: lane-wise sum of the two halves.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn fold256(a: __m512) -> __m256 {
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
    _mm256_add_ps(_mm512_castps512_ps256(a), hi)
}

/// Horizontal sums of four vectors: `[sum(a0), sum(a1), sum(a2), sum(a3)]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn hsum4(a0: __m512, a1: __m512, a2: __m512, a3: __m512) -> __m128 {
    let (a0, a1, a2, a3) = (fold256(a0), fold256(a1), fold256(a2), fold256(a3));
    let h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h))
}

/// The f16 at `p` (2 bytes, unaligned) converted and broadcast to 16 lanes.
///
/// # Safety
/// `p..p+2` must be readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn bcast_f16(p: *const u8) -> __m512 {
    // SAFETY: the caller guarantees 2 readable bytes at `p`.
    let h = unsafe { (p as *const u16).read_unaligned() };
    _mm512_cvtph_ps(_mm256_set1_epi16(h as i16))
}

/// Bytes `p..p+16` zero-extended to sixteen 32-bit lanes.
///
/// # Safety
/// `p..p+16` must be readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn widen_u8(p: *const u8) -> __m512i {
    // SAFETY: the caller guarantees 16 readable bytes (unaligned load).
    _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(p as *const __m128i) })
}

/// Bytes `p..p+16` sign-extended to sixteen 32-bit lanes.
///
/// # Safety
/// `p..p+16` must be readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn widen_i8(p: *const u8) -> __m512i {
    // SAFETY: the caller guarantees 16 readable bytes (unaligned load).
    _mm512_cvtepi8_epi32(unsafe { _mm_loadu_si128(p as *const __m128i) })
}

/// Nibble -> f32 table: `q - 8` for Q4_0, `q` for Q4_1.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn nibble_table(q41: bool) -> __m512 {
    let t = _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    );
    if q41 {
        t
    } else {
        _mm512_sub_ps(t, _mm512_set1_ps(8.0))
    }
}

const T_F32: u8 = 0;
const T_F16: u8 = 1;
const T_BF16: u8 = 2;

/// Elements `i..i+16` of a float-typed row, only those whose bit is set in
/// `mask` are read (the others are 0).
///
/// # Safety
/// Every element `i + l` with bit `l` of `mask` set must be readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn load16<const T: u8>(p: *const u8, i: usize, mask: __mmask16) -> __m512 {
    // SAFETY: (all arms) masked loads only access the selected elements,
    // which the caller guarantees are in bounds; unaligned is fine.
    unsafe {
        match T {
            T_F32 => _mm512_maskz_loadu_ps(mask, (p as *const f32).add(i)),
            T_F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, (p as *const i16).add(i))),
            _ => {
                let h = _mm256_maskz_loadu_epi16(mask, (p as *const i16).add(i));
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
        }
    }
}

/// Mask selecting the first `n` (<= 16) lanes.
#[inline(always)]
fn first(n: usize) -> __mmask16 {
    if n >= 16 {
        0xFFFF
    } else {
        ((1u32 << n) - 1) as __mmask16
    }
}

// ---------------------------------------------------------------- GEMV ---

/// # Safety
/// AVX-512 F/BW/VL + AVX2/FMA/F16C available;
/// `w.len() == y.len() * row_bytes(dtype, k)`, `x.len() == k`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn gemv(dtype: DType, w: &[u8], k: usize, x: &[f32], y: &mut [f32]) {
    let rb = row_bytes(dtype, k);
    debug_assert!(w.len() == y.len() * rb && x.len() == k);
    // SAFETY: features guaranteed by the caller; the length contract above
    // is exactly what the row kernels require (one input row).
    // Each arm passes its kernels as constants, so `gemv_rows` (inlined)
    // calls them directly and the compiler inlines them into the row loop.
    unsafe {
        match dtype {
            DType::Q4_0 => gemv_rows(
                w,
                rb,
                k,
                x,
                y,
                q4_rows::<4, 1, false>,
                q4_rows::<1, 1, false>,
            ),
            DType::Q4_1 => gemv_rows(w, rb, k, x, y, q4_rows::<4, 1, true>, q4_rows::<1, 1, true>),
            DType::Q8_0 => gemv_rows(w, rb, k, x, y, q8_rows::<4, 1>, q8_rows::<1, 1>),
            DType::F32 => gemv_rows(
                w,
                rb,
                k,
                x,
                y,
                float_rows::<4, 1, T_F32>,
                float_rows::<1, 1, T_F32>,
            ),
            DType::F16 => gemv_rows(
                w,
                rb,
                k,
                x,
                y,
                float_rows::<4, 1, T_F16>,
                float_rows::<1, 1, T_F16>,
            ),
            DType::BF16 => gemv_rows(
                w,
                rb,
                k,
                x,
                y,
                float_rows::<4, 1, T_BF16>,
                float_rows::<1, 1, T_BF16>,
            ),
            // The 5-bit and K-quant types run the AVX2 kernels (AVX-512
            // implies AVX2+FMA+F16C; the length contract is the same).
            DType::Q5_0 | DType::Q5_1 | DType::Q4_K | DType::Q5_K | DType::Q6_K => {
                super::avx2::gemv(dtype, w, k, x, y)
            }
        }
    }
}

/// The row kernels for `N` input rows: (`R` weight rows, 1 weight row),
/// `None` for the types served by the AVX2 kernels. With `N == 1` (and
/// `R == 4`) they are the one-row decode kernels; any other `R`, `N` runs
/// the same code per (weight row, input row) pair, so each output is bit
/// for bit the one-row result.
fn kernels<const R: usize, const N: usize>(dtype: DType) -> Option<(RowKernel, RowKernel)> {
    Some(match dtype {
        DType::Q4_0 => (q4_rows::<R, N, false>, q4_rows::<1, N, false>),
        DType::Q4_1 => (q4_rows::<R, N, true>, q4_rows::<1, N, true>),
        DType::Q8_0 => (q8_rows::<R, N>, q8_rows::<1, N>),
        DType::F32 => (float_rows::<R, N, T_F32>, float_rows::<1, N, T_F32>),
        DType::F16 => (float_rows::<R, N, T_F16>, float_rows::<1, N, T_F16>),
        DType::BF16 => (float_rows::<R, N, T_BF16>, float_rows::<1, N, T_BF16>),
        DType::Q5_0 | DType::Q5_1 | DType::Q4_K | DType::Q5_K | DType::Q6_K => return None,
    })
}

/// Weight rows per multi-row kernel call.
const MULTI_R: usize = 2;
/// Most input rows per multi-row kernel call (`MULTI_R * MULTI_N`
/// accumulators, twice that for the float types, out of 32 registers).
const MULTI_N: usize = 6;

/// A row kernel: for `R` weight rows starting at `w` (row stride `rb`
/// bytes) and `N` input rows of `k` elements starting at `x` (input-row
/// stride `xs` floats), writes output (input `n`, weight row `r`) to
/// `y[n * ys + r]`.
type RowKernel = unsafe fn(*const u8, usize, usize, *const f32, usize, *mut f32, usize);

/// Runs `k4` over groups of 4 rows and `k1` over the remaining rows. As in
/// the AVX2 `gemv_rows`, the rows are cut into 4 equal spans and group `i`
/// takes row `i` of each span (the kernel's row stride is the span's
/// length): 4 long sequential streams per thread, which the hardware
/// prefetchers follow, instead of 4 interleaved one-row streams.
///
/// # Safety
/// Features available; `w.len() >= y.len() * rb`, `x.len() == k`, and the
/// kernels read at most `rb` bytes per row and `k` elements of `x`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn gemv_rows(
    w: &[u8],
    rb: usize,
    k: usize,
    x: &[f32],
    y: &mut [f32],
    k4: RowKernel,
    k1: RowKernel,
) {
    let n = y.len();
    let (wp, xp, yp) = (w.as_ptr(), x.as_ptr(), y.as_mut_ptr());
    let span = n / 4;
    let mut t = [0f32; 4];
    for i in 0..span {
        // SAFETY: rows i + j * span (j < 4) lie within `w` (i < span, 4 *
        // span <= n); the kernel writes its 4 outputs to `t`; one input row
        // (strides unused).
        unsafe { k4(wp.add(i * rb), span * rb, k, xp, k, t.as_mut_ptr(), 0) };
        for (j, v) in t.iter().enumerate() {
            y[i + j * span] = *v;
        }
    }
    for r in 4 * span..n {
        // SAFETY: row r < n lies within `w`, output r within `y`.
        unsafe { k1(wp.add(r * rb), rb, k, xp, k, yp.add(r), 0) };
    }
}

/// Multi-row product (see `super::gemv_multi`): `y[t * n_rows + r]`, each
/// bit-identical to [`gemv`] of input row `t`.
///
/// # Safety
/// AVX-512 F/BW/VL + AVX2/FMA/F16C available; `w.len() == n_rows *
/// row_bytes(dtype, k)`, `x.len() == n_x * k`, `y.len() == n_x * n_rows`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn gemv_multi(
    dtype: DType,
    w: &[u8],
    k: usize,
    n_rows: usize,
    x: &[f32],
    n_x: usize,
    y: &mut [f32],
) {
    let rb = row_bytes(dtype, k);
    debug_assert!(w.len() == n_rows * rb && x.len() == n_x * k && y.len() == n_x * n_rows);
    if kernels::<1, 1>(dtype).is_none() {
        // SAFETY: as for this function (AVX-512 implies AVX2+FMA+F16C).
        return unsafe { super::avx2::gemv_multi(dtype, w, k, n_rows, x, n_x, y) };
    }
    let chunks = super::multi_chunks(n_x, MULTI_N, |n| {
        super::by_n!(n, |N| kernels::<MULTI_R, N>(dtype).expect("checked above"))
    });
    let (wp, xp, yp) = (w.as_ptr(), x.as_ptr(), y.as_mut_ptr());
    let mut r = 0;
    while r < n_rows {
        let group = r + MULTI_R <= n_rows;
        for &(t0, (kr, k1)) in chunks.iter() {
            // SAFETY: rows r..r+MULTI_R (or r) lie within `w`; the chunk's
            // input rows t0.. within `x` (k floats each); outputs (t, r..)
            // at y[t * n_rows + r ..] within `y`.
            unsafe {
                let (xc, yc) = (xp.add(t0 * k), yp.add(t0 * n_rows + r));
                if group {
                    kr(wp.add(r * rb), rb, k, xc, k, yc, n_rows)
                } else {
                    k1(wp.add(r * rb), rb, k, xc, k, yc, n_rows)
                }
            }
        }
        r += if group { MULTI_R } else { 1 };
    }
}

/// Q4_0 (`Q41 == false`) or Q4_1 rows, one input row: the `N == 1`
/// instance of [`q4_rows`] written out (the decode kernel as it was before the
/// multi-row kernels, so its speed is unchanged; the same operations per
/// weight row in the same order, the bit-identity tests pin the two).
///
/// # Safety
/// `R` rows of `k / 32` blocks at `w` (stride `rb`), `k` floats at `x`,
/// `R` writable floats at `y`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn q4_rows_one<const R: usize, const Q41: bool>(
    w: *const u8,
    rb: usize,
    k: usize,
    x: *const f32,
    y: *mut f32,
) {
    let (bs, qoff) = if Q41 { (20, 4) } else { (18, 2) };
    let nb = k / QK;
    let tbl = nibble_table(Q41);
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        // SAFETY: b < nb, so x[b*32 .. b*32+32] is in bounds, and each row's
        // block b (bytes b*bs .. b*bs+bs <= rb) is in bounds.
        unsafe {
            let xb = x.add(b * QK);
            let x0 = _mm512_loadu_ps(xb);
            let x1 = _mm512_loadu_ps(xb.add(16));
            let s = if Q41 { _mm512_add_ps(x0, x1) } else { x0 };
            for (r, a) in acc.iter_mut().enumerate() {
                let p = w.add(r * rb + b * bs);
                prefetch(p.wrapping_add(pf_ahead(R, rb, nb * bs)));
                let d = bcast_f16(p);
                // byte j -> lane j; low nibble = element j, high = j + 16.
                let bw = widen_u8(p.add(qoff));
                let lo = _mm512_permutexvar_ps(bw, tbl);
                let hi = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(bw), tbl);
                let t = _mm512_fmadd_ps(hi, x1, _mm512_mul_ps(lo, x0));
                *a = _mm512_fmadd_ps(d, t, *a);
                if Q41 {
                    *a = _mm512_fmadd_ps(bcast_f16(p.add(2)), s, *a);
                }
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        // SAFETY: r < R outputs are writable.
        unsafe { *y.add(r) = _mm512_reduce_add_ps(*a) };
    }
}

/// Q8_0 rows, one input row (see [`q4_rows_one`]).
///
/// # Safety
/// As for [`q4_rows_one`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn q8_rows_one<const R: usize>(
    w: *const u8,
    rb: usize,
    k: usize,
    x: *const f32,
    y: *mut f32,
) {
    let nb = k / QK;
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        // SAFETY: b < nb: x block and each row's 34-byte block are in bounds.
        unsafe {
            let xb = x.add(b * QK);
            let x0 = _mm512_loadu_ps(xb);
            let x1 = _mm512_loadu_ps(xb.add(16));
            for (r, a) in acc.iter_mut().enumerate() {
                let p = w.add(r * rb + b * 34);
                prefetch(p.wrapping_add(PF_DIST));
                let d = bcast_f16(p);
                let q0 = _mm512_cvtepi32_ps(widen_i8(p.add(2)));
                let q1 = _mm512_cvtepi32_ps(widen_i8(p.add(18)));
                let t = _mm512_fmadd_ps(q1, x1, _mm512_mul_ps(q0, x0));
                *a = _mm512_fmadd_ps(d, t, *a);
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        // SAFETY: r < R outputs are writable.
        unsafe { *y.add(r) = _mm512_reduce_add_ps(*a) };
    }
}

/// F32/F16/BF16 rows, one input row (see [`q4_rows_one`]).
///
/// # Safety
/// `R` rows of `k` elements at `w` (stride `rb` bytes), `k` floats at `x`,
/// `R` writable floats at `y`.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn float_rows_one<const R: usize, const T: u8>(
    w: *const u8,
    rb: usize,
    k: usize,
    x: *const f32,
    y: *mut f32,
) {
    // Two accumulators per row: 2*R independent FMA chains.
    let mut acc0 = [_mm512_setzero_ps(); R];
    let mut acc1 = [_mm512_setzero_ps(); R];
    let mut i = 0;
    while i + 32 <= k {
        // SAFETY: elements i..i+32 < k of x and of each row r < R.
        unsafe {
            let x0 = _mm512_loadu_ps(x.add(i));
            let x1 = _mm512_loadu_ps(x.add(i + 16));
            for r in 0..R {
                let p = w.add(r * rb);
                acc0[r] = _mm512_fmadd_ps(load16::<T>(p, i, 0xFFFF), x0, acc0[r]);
                acc1[r] = _mm512_fmadd_ps(load16::<T>(p, i + 16, 0xFFFF), x1, acc1[r]);
            }
        }
        i += 32;
    }
    while i < k {
        let m = first(k - i);
        // SAFETY: the mask selects only elements i..min(i+16, k).
        unsafe {
            let x0 = _mm512_maskz_loadu_ps(m, x.add(i));
            for r in 0..R {
                acc0[r] = _mm512_fmadd_ps(load16::<T>(w.add(r * rb), i, m), x0, acc0[r]);
            }
        }
        i += 16;
    }
    for r in 0..R {
        // SAFETY: r < R outputs are writable.
        unsafe { *y.add(r) = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r])) };
    }
}

/// Q4_0 (`Q41 == false`) or Q4_1: `R` weight rows x `N` input rows.
///
/// # Safety
/// `R` rows of `k / 32` blocks at `w` (stride `rb`), `N` rows of `k`
/// floats at `x` (stride `xs`), outputs `y[n * ys + r]` writable for
/// `n < N`, `r < R`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn q4_rows<const R: usize, const N: usize, const Q41: bool>(
    w: *const u8,
    rb: usize,
    k: usize,
    x: *const f32,
    xs: usize,
    y: *mut f32,
    ys: usize,
) {
    if N == 1 {
        // SAFETY: the same contract, one input row.
        return unsafe { q4_rows_one::<R, Q41>(w, rb, k, x, y) };
    }
    let (bs, qoff) = if Q41 { (20, 4) } else { (18, 2) };
    let nb = k / QK;
    let tbl = nibble_table(Q41);
    let mut acc = [[_mm512_setzero_ps(); N]; R];
    for b in 0..nb {
        // SAFETY: b < nb, so x[n*xs + b*32 ..][..32] is in bounds for
        // n < N, and each row's block b (bytes b*bs .. b*bs+bs <= rb) is in
        // bounds.
        unsafe {
            for (r, ar) in acc.iter_mut().enumerate() {
                let p = w.add(r * rb + b * bs);
                prefetch(p.wrapping_add(pf_ahead(R, rb, nb * bs)));
                let d = bcast_f16(p);
                // byte j -> lane j; low nibble = element j, high = j + 16.
                let bw = widen_u8(p.add(qoff));
                let lo = _mm512_permutexvar_ps(bw, tbl);
                let hi = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(bw), tbl);
                let m = if Q41 {
                    bcast_f16(p.add(2))
                } else {
                    _mm512_setzero_ps()
                };
                for (n, a) in ar.iter_mut().enumerate() {
                    let xb = x.add(n * xs + b * QK);
                    let x0 = _mm512_loadu_ps(xb);
                    let x1 = _mm512_loadu_ps(xb.add(16));
                    let t = _mm512_fmadd_ps(hi, x1, _mm512_mul_ps(lo, x0));
                    *a = _mm512_fmadd_ps(d, t, *a);
                    if Q41 {
                        *a = _mm512_fmadd_ps(m, _mm512_add_ps(x0, x1), *a);
                    }
                }
            }
        }
    }
    for (r, ar) in acc.iter().enumerate() {
        for (n, a) in ar.iter().enumerate() {
            // SAFETY: r < R, n < N: the output is writable.
            unsafe { *y.add(n * ys + r) = _mm512_reduce_add_ps(*a) };
        }
    }
}

/// Q8_0: `R` weight rows x `N` input rows.
///
/// # Safety
/// As for [`q4_rows`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn q8_rows<const R: usize, const N: usize>(
    w: *const u8,
    rb: usize,
    k: usize,
    x: *const f32,
    xs: usize,
    y: *mut f32,
    ys: usize,
) {
    if N == 1 {
        // SAFETY: the same contract, one input row.
        return unsafe { q8_rows_one::<R>(w, rb, k, x, y) };
    }
    let nb = k / QK;
    let mut acc = [[_mm512_setzero_ps(); N]; R];
    for b in 0..nb {
        // SAFETY: b < nb: the x blocks and each row's 34-byte block are in
        // bounds.
        unsafe {
            for (r, ar) in acc.iter_mut().enumerate() {
                let p = w.add(r * rb + b * 34);
                prefetch(p.wrapping_add(PF_DIST));
                let d = bcast_f16(p);
                let q0 = _mm512_cvtepi32_ps(widen_i8(p.add(2)));
                let q1 = _mm512_cvtepi32_ps(widen_i8(p.add(18)));
                for (n, a) in ar.iter_mut().enumerate() {
                    let xb = x.add(n * xs + b * QK);
                    let x0 = _mm512_loadu_ps(xb);
                    let x1 = _mm512_loadu_ps(xb.add(16));
                    let t = _mm512_fmadd_ps(q1, x1, _mm512_mul_ps(q0, x0));
                    *a = _mm512_fmadd_ps(d, t, *a);
                }
            }
        }
    }
    for (r, ar) in acc.iter().enumerate() {
        for (n, a) in ar.iter().enumerate() {
            // SAFETY: r < R, n < N: the output is writable.
            unsafe { *y.add(n * ys + r) = _mm512_reduce_add_ps(*a) };
        }
    }
}

/// F32/F16/BF16 (any `k`; the tail uses masked loads): `R` weight rows x
/// `N` input rows.
///
/// # Safety
/// `R` rows of `k` elements at `w` (stride `rb` bytes), `N` rows of `k`
/// floats at `x` (stride `xs`), outputs `y[n * ys + r]` writable.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn float_rows<const R: usize, const N: usize, const T: u8>(
    w: *const u8,
    rb: usize,
    k: usize,
    x: *const f32,
    xs: usize,
    y: *mut f32,
    ys: usize,
) {
    if N == 1 {
        // SAFETY: the same contract, one input row.
        return unsafe { float_rows_one::<R, T>(w, rb, k, x, y) };
    }
    // Two accumulators per output: 2*R*N independent FMA chains.
    let mut acc0 = [[_mm512_setzero_ps(); N]; R];
    let mut acc1 = [[_mm512_setzero_ps(); N]; R];
    let mut i = 0;
    while i + 32 <= k {
        // SAFETY: elements i..i+32 < k of each x row n < N and of each
        // weight row r < R.
        unsafe {
            for r in 0..R {
                let p = w.add(r * rb);
                let w0 = load16::<T>(p, i, 0xFFFF);
                let w1 = load16::<T>(p, i + 16, 0xFFFF);
                for n in 0..N {
                    let xn = x.add(n * xs);
                    acc0[r][n] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xn.add(i)), acc0[r][n]);
                    acc1[r][n] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xn.add(i + 16)), acc1[r][n]);
                }
            }
        }
        i += 32;
    }
    while i < k {
        let m = first(k - i);
        // SAFETY: the mask selects only elements i..min(i+16, k).
        unsafe {
            for r in 0..R {
                let w0 = load16::<T>(w.add(r * rb), i, m);
                for n in 0..N {
                    let xv = _mm512_maskz_loadu_ps(m, x.add(n * xs + i));
                    acc0[r][n] = _mm512_fmadd_ps(w0, xv, acc0[r][n]);
                }
            }
        }
        i += 16;
    }
    for r in 0..R {
        for n in 0..N {
            let v = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r][n], acc1[r][n]));
            // SAFETY: r < R, n < N: the output is writable.
            unsafe { *y.add(n * ys + r) = v };
        }
    }
}

// ------------------------------------------------------------- DEQUANT ---

/// # Safety
/// AVX-512 F/BW/VL + AVX2/FMA/F16C available;
/// `src.len() == row_bytes(dtype, k)`, `out.len() == k`.
///
/// Results are bit-identical to the scalar path (same operations, one
/// rounding each).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn dequant_row(dtype: DType, src: &[u8], k: usize, out: &mut [f32]) {
    debug_assert!(src.len() == row_bytes(dtype, k) && out.len() == k);
    let (s, o) = (src.as_ptr(), out.as_mut_ptr());
    let nb = k / QK;
    // SAFETY: (all arms) block b < nb lies inside `src` and writes go to
    // out[b*32 .. b*32+32] with b*32+32 <= k; float types touch (masked)
    // elements < k only.
    unsafe {
        match dtype {
            DType::Q4_0 | DType::Q4_1 => {
                let q41 = dtype == DType::Q4_1;
                let (bs, qoff) = if q41 { (20, 4) } else { (18, 2) };
                let tbl = nibble_table(q41);
                for b in 0..nb {
                    let p = s.add(b * bs);
                    let d = bcast_f16(p);
                    let bw = widen_u8(p.add(qoff));
                    let mut lo = _mm512_mul_ps(d, _mm512_permutexvar_ps(bw, tbl));
                    let mut hi =
                        _mm512_mul_ps(d, _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(bw), tbl));
                    if q41 {
                        // multiply-then-add, like the scalar code.
                        let m = bcast_f16(p.add(2));
                        lo = _mm512_add_ps(lo, m);
                        hi = _mm512_add_ps(hi, m);
                    }
                    _mm512_storeu_ps(o.add(b * QK), lo);
                    _mm512_storeu_ps(o.add(b * QK + 16), hi);
                }
            }
            DType::Q8_0 => {
                for b in 0..nb {
                    let p = s.add(b * 34);
                    let d = bcast_f16(p);
                    let q0 = _mm512_cvtepi32_ps(widen_i8(p.add(2)));
                    let q1 = _mm512_cvtepi32_ps(widen_i8(p.add(18)));
                    _mm512_storeu_ps(o.add(b * QK), _mm512_mul_ps(d, q0));
                    _mm512_storeu_ps(o.add(b * QK + 16), _mm512_mul_ps(d, q1));
                }
            }
            DType::Q5_0 | DType::Q5_1 | DType::Q4_K | DType::Q5_K | DType::Q6_K => {
                // Portable code, vectorized for this level once inlined.
                blocks::dequant(dtype, src, out)
            }
            DType::F32 => dequant_float::<T_F32>(s, k, o),
            DType::F16 => dequant_float::<T_F16>(s, k, o),
            DType::BF16 => dequant_float::<T_BF16>(s, k, o),
        }
    }
}

/// # Safety
/// `k` elements readable at `s`, `k` floats writable at `o`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dequant_float<const T: u8>(s: *const u8, k: usize, o: *mut f32) {
    let mut i = 0;
    while i < k {
        let m = first(k - i);
        // SAFETY: the mask selects only elements i..min(i+16, k).
        unsafe { _mm512_mask_storeu_ps(o.add(i), m, load16::<T>(s, i, m)) };
        i += 16;
    }
}

// ---------------------------------------------------------------- GEMM ---

/// Micro-kernel: `c[i*ldc + j] += dot(a[i*lda..][..len], b[j*ldb..][..len])`
/// for `i < mr <= 4`, `j < nt <= 4`.
///
/// # Safety
/// AVX-512 available and the bounds verified by `super::check_tile`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn tile(
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
    let (ap, bp, cp) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
    macro_rules! go {
        ($($m:literal, $n:literal);*) => {
            match (mr, nt) {
                // SAFETY: the caller verified the bounds for (mr, nt).
                $(($m, $n) => unsafe { tile_k::<$m, $n>(ap, lda, bp, ldb, len, cp, ldc) },)*
                _ => unreachable!("tile shape checked by caller"),
            }
        };
    }
    go!(4,4; 4,3; 4,2; 4,1; 3,4; 3,3; 3,2; 3,1; 2,4; 2,3; 2,2; 2,1; 1,4; 1,3; 1,2; 1,1);
}

/// # Safety
/// `a[i*lda + l]`, `b[j*ldb + l]` readable and `c[i*ldc + j]` writable for
/// `i < M`, `j < N`, `l < len`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn tile_k<const M: usize, const N: usize>(
    a: *const f32,
    lda: usize,
    b: *const f32,
    ldb: usize,
    len: usize,
    c: *mut f32,
    ldc: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); N]; M];
    let mut l = 0;
    loop {
        // Full vectors, then one masked step for the tail (if any).
        let m = if l + 16 <= len {
            0xFFFF
        } else if l < len {
            first(len - l)
        } else {
            break;
        };
        // SAFETY: the mask selects only offsets l..min(l+16, len), for rows
        // i < M of a and j < N of b.
        unsafe {
            let mut bv = [_mm512_setzero_ps(); N];
            for (j, v) in bv.iter_mut().enumerate() {
                *v = _mm512_maskz_loadu_ps(m, b.add(j * ldb + l));
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let av = _mm512_maskz_loadu_ps(m, a.add(i * lda + l));
                for (j, r) in row.iter_mut().enumerate() {
                    *r = _mm512_fmadd_ps(av, bv[j], *r);
                }
            }
        }
        l += 16;
    }
    for (i, row) in acc.iter().enumerate() {
        // Reduce the (up to 4) accumulators of this row together.
        let z = _mm512_setzero_ps();
        let v = |j: usize| if j < N { row[j] } else { z };
        let mut sums = [0f32; 4];
        // SAFETY: `sums` has room for 4 floats.
        unsafe { _mm_storeu_ps(sums.as_mut_ptr(), hsum4(v(0), v(1), v(2), v(3))) };
        for (j, s) in sums.iter().take(N).enumerate() {
            // SAFETY: i < M, j < N: c[i*ldc + j] is writable.
            unsafe { *c.add(i * ldc + j) += *s };
        }
    }
}
