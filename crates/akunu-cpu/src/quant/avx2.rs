//! AVX2 + FMA + F16C kernels (8 f32 lanes).
//!
//! Every function here is `#[target_feature(enable = "avx2,fma,f16c")]`;
//! the `unsafe fn` entry points require (1) that the CPU supports those
//! features (guaranteed by `Level::Avx2` only being constructed after
//! detection) and (2) the slice-length contracts stated on each function
//! (checked with `assert!` in `mod.rs` before the call). Inner loops then
//! read through raw pointers whose offsets stay inside those lengths.

use super::x86::{PF_DIST, hsum, pf_ahead, prefetch};
use super::{QK, blocks, row_bytes};
use akunu_core::dtype::DType;
use core::arch::x86_64::*;

/// Horizontal sums of four vectors: `[sum(a0), sum(a1), sum(a2), sum(a3)]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum4(a0: __m256, a1: __m256, a2: __m256, a3: __m256) -> __m128 {
    let h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h))
}

/// The f16 at `p` (2 bytes, unaligned) converted and broadcast to 8 lanes.
///
/// # Safety
/// `p..p+2` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bcast_f16(p: *const u8) -> __m256 {
    // SAFETY: the caller guarantees 2 readable bytes at `p`.
    let h = unsafe { (p as *const u16).read_unaligned() };
    _mm256_cvtph_ps(_mm_set1_epi16(h as i16))
}

/// Bytes `p..p+8` zero-extended to eight 32-bit lanes.
///
/// # Safety
/// `p..p+8` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_u8(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 8 readable bytes (unaligned load).
    _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(p as *const __m128i) })
}

/// Bytes `p..p+8` sign-extended to eight 32-bit lanes.
///
/// # Safety
/// `p..p+8` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_i8(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 8 readable bytes (unaligned load).
    _mm256_cvtepi8_epi32(unsafe { _mm_loadl_epi64(p as *const __m128i) })
}

const T_F32: u8 = 0;
const T_F16: u8 = 1;
const T_BF16: u8 = 2;

/// Eight consecutive elements of a float-typed row starting at element `i`.
///
/// # Safety
/// Elements `i..i+8` of the row at `p` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8<const T: u8>(p: *const u8, i: usize) -> __m256 {
    // SAFETY: (all arms) the caller guarantees elements i..i+8 are in
    // bounds; all loads are unaligned-tolerant.
    unsafe {
        match T {
            T_F32 => _mm256_loadu_ps((p as *const f32).add(i)),
            T_F16 => _mm256_cvtph_ps(_mm_loadu_si128((p as *const u16).add(i) as *const __m128i)),
            _ => {
                let h = _mm_loadu_si128((p as *const u16).add(i) as *const __m128i);
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            }
        }
    }
}

/// One element of a float-typed row.
///
/// # Safety
/// Element `i` of the row at `p` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load1<const T: u8>(p: *const u8, i: usize) -> f32 {
    // SAFETY: the caller guarantees element i is in bounds.
    unsafe {
        match T {
            T_F32 => (p as *const f32).add(i).read_unaligned(),
            T_F16 => half::f16::from_bits((p as *const u16).add(i).read_unaligned()).to_f32(),
            _ => f32::from_bits(((p as *const u16).add(i).read_unaligned() as u32) << 16),
        }
    }
}

// ---------------------------------------------------------------- GEMV ---

/// # Safety
/// AVX2/FMA/F16C available; `w.len() == y.len() * row_bytes(dtype, k)`,
/// `x.len() == k`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn gemv(dtype: DType, w: &[u8], k: usize, x: &[f32], y: &mut [f32]) {
    let rb = row_bytes(dtype, k);
    debug_assert!(w.len() == y.len() * rb && x.len() == k);
    // Each arm passes its kernels as constants, so `gemv_rows` (inlined)
    // calls them directly and the compiler inlines them into the row loop.
    macro_rules! run {
        ($k4:expr, $k1:expr) => {
            // SAFETY: features guaranteed by the caller; the length contract
            // above is exactly what the row kernels require (one input row).
            unsafe { gemv_rows(w, rb, k, x, y, core::ptr::null(), $k4, $k1) }
        };
    }
    match dtype {
        DType::Q4_0 => run!(q4_rows::<4, 1, false>, q4_rows::<1, 1, false>),
        // Q4_1: the sums of x's blocks (for `Σ_b m_b·S_b`), once per call.
        // SAFETY: as in `run!`.
        DType::Q4_1 => {
            SUMS.with(|cell| unsafe { gemv_q41(w, rb, k, x, y, &mut cell.borrow_mut()) })
        }
        DType::Q8_0 => run!(q8_rows::<4, 1>, q8_rows::<1, 1>),
        DType::Q5_0 => run!(q5_rows::<4, 1, false>, q5_rows::<1, 1, false>),
        DType::Q5_1 => run!(q5_rows::<4, 1, true>, q5_rows::<1, 1, true>),
        DType::Q4_K => run!(qk_rows::<4, 1, false>, qk_rows::<1, 1, false>),
        DType::Q5_K => run!(qk_rows::<4, 1, true>, qk_rows::<1, 1, true>),
        DType::Q6_K => run!(q6k_rows::<4, 1>, q6k_rows::<1, 1>),
        DType::F32 => run!(float_rows::<4, 1, T_F32>, float_rows::<1, 1, T_F32>),
        DType::F16 => run!(float_rows::<4, 1, T_F16>, float_rows::<1, 1, T_F16>),
        DType::BF16 => run!(float_rows::<4, 1, T_BF16>, float_rows::<1, 1, T_BF16>),
    }
}

/// The one-row Q4_1 product: the block sums of x ([`block_sum`], in the
/// layout of a one-row chunk of [`block_sums`]: 8 floats per block, the sum
/// in lane 0), then the row kernels. A `target_feature` function of its own
/// so that `gemv_rows` and the kernels inline (through the closure of the
/// scratch's `with` they became indirect calls, 4-5% slower).
///
/// # Safety
/// As for [`gemv`] with `dtype == Q4_1`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv_q41(w: &[u8], rb: usize, k: usize, x: &[f32], y: &mut [f32], sums: &mut Vec<f32>) {
    sums.clear();
    sums.resize(k / QK * 8, 0.0);
    for b in 0..k / QK {
        // SAFETY: `x` holds k floats: blocks b < k / 32 are in bounds.
        sums[b * 8] = unsafe { block_sum(x.as_ptr().add(b * QK)) };
    }
    // SAFETY: the caller's contract; `sums` holds one sum per block.
    unsafe {
        gemv_rows(
            w,
            rb,
            k,
            x,
            y,
            sums.as_ptr(),
            q4_rows::<4, 1, true>,
            q4_rows::<1, 1, true>,
        )
    }
}

/// Runs `k4` over groups of 4 rows and `k1` over the remaining rows (one
/// input row; `sx`: the Q4_1 kernels' per-block sums of x, else null).
///
/// The rows are cut into 4 equal spans and group `i` takes row `i` of each
/// span (the kernel's row stride is the span's length), so each thread
/// reads 4 long sequential streams, one per span, instead of 4 interleaved
/// streams of one row each (18-48 cache lines) that the hardware
/// prefetchers never lock onto. Decode at 2 threads, on the default model's
/// shapes: F16 +35-40%, Q8_0 +45-50%, Q4_1 +8% (bench/RESULTS.md). Every
/// row runs the same operations as before, so the results do not change.
///
/// # Safety
/// Features available; `w.len() >= y.len() * rb`, `x.len() == k`, and the
/// kernels read at most `rb` bytes per row and `k` elements of `x`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv_rows(
    w: &[u8],
    rb: usize,
    k: usize,
    x: &[f32],
    y: &mut [f32],
    sx: *const f32,
    k4: RowKernel,
    k1: RowKernel,
) {
    let (n, wp, xp, yp) = (y.len(), w.as_ptr(), x.as_ptr(), y.as_mut_ptr());
    let span = n / 4;
    let mut t = [0f32; 4];
    for i in 0..span {
        // SAFETY: rows i + j * span (j < 4) lie within `w` (i < span, 4 *
        // span <= n); the kernel writes its 4 outputs to `t`; one input row
        // (strides unused).
        unsafe { k4(wp.add(i * rb), span * rb, k, xp, k, t.as_mut_ptr(), 0, sx) };
        for (j, v) in t.iter().enumerate() {
            y[i + j * span] = *v;
        }
    }
    for r in 4 * span..n {
        // SAFETY: row r < n lies within `w`, output r within `y`.
        unsafe { k1(wp.add(r * rb), rb, k, xp, k, yp.add(r), 0, sx) };
    }
}

thread_local! {
    /// Per-thread scratch for [`block_sums`].
    static SUMS: core::cell::RefCell<Vec<f32>> = const { core::cell::RefCell::new(Vec::new()) };
}

/// The sum of the 32 floats of a block at `p`, as the Q4_1 kernels use it
/// (`S_b` of `Σ_b m_b·S_b`): lane-wise `(x0 + x1) + (x2 + x3)`, then [`hsum`].
///
/// # Safety
/// `p..p+32` readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_sum(p: *const f32) -> f32 {
    // SAFETY: the caller guarantees 32 readable floats.
    unsafe {
        let (x0, x1) = (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)));
        let (x2, x3) = (_mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24)));
        hsum(_mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3)))
    }
}

/// For the Q4 kernels, computed once per product instead of once per
/// weight-row group. Q4_0: the lane-wise partial sums `x0+x1+x2+x3` of
/// every 32-element block of the `n_x` input rows times -8 (the start value
/// that folds the nibble offset into the accumulation; 8 floats per block,
/// input-row major, row t at `t * nb * 8`). Q4_1: per chunk of input rows
/// (`chunks`: first row and count, at most 8) and block, the chunk's block
/// sums ([`block_sum`]) in lanes 0.. of 8 floats (chunk c at `c * nb * 8`),
/// so a multi-row kernel adds `m_b·S_b` for all its input rows in one FMA.
/// Returns null for other types.
///
/// # Safety
/// AVX2/FMA/F16C available; `x.len() == n_x * k`; the chunks lie in `0..n_x`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_sums(
    dtype: DType,
    x: &[f32],
    n_x: usize,
    k: usize,
    chunks: &[(usize, usize)],
    buf: &mut Vec<f32>,
) -> *const f32 {
    let nb = k / QK;
    if dtype == DType::Q4_1 {
        buf.clear();
        buf.resize(chunks.len() * nb * 8, 0.0);
        for (c, &(t0, n)) in chunks.iter().enumerate() {
            debug_assert!(n <= 8 && t0 + n <= n_x);
            for b in 0..nb {
                for j in 0..n {
                    // SAFETY: row t0 + j < n_x, block b < nb: inside `x`.
                    buf[(c * nb + b) * 8 + j] =
                        unsafe { block_sum(x.as_ptr().add((t0 + j) * k + b * QK)) };
                }
            }
        }
        return buf.as_ptr();
    }
    if dtype != DType::Q4_0 {
        return core::ptr::null();
    }
    buf.resize(n_x * nb * 8, 0.0);
    let (xp, bp) = (x.as_ptr(), buf.as_mut_ptr());
    for t in 0..n_x {
        for b in 0..nb {
            // SAFETY: block b < nb of row t < n_x lies inside `x`; entry
            // (t, b) inside `buf` (just resized to n_x * nb * 8).
            unsafe {
                let xb = xp.add(t * k + b * QK);
                let (x0, x1) = (_mm256_loadu_ps(xb), _mm256_loadu_ps(xb.add(8)));
                let (x2, x3) = (_mm256_loadu_ps(xb.add(16)), _mm256_loadu_ps(xb.add(24)));
                let v = _mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3));
                let v = _mm256_mul_ps(v, _mm256_set1_ps(-8.0));
                _mm256_storeu_ps(bp.add((t * nb + b) * 8), v);
            }
        }
    }
    buf.as_ptr()
}

/// The row kernels for `N` input rows: (`R` weight rows, 1 weight row).
/// With `N == 1` (and `R == 4`) they are the one-row decode kernels; any
/// other `R`, `N` runs the same code per (weight row, input row) pair, so
/// each output is bit for bit the one-row result.
fn kernels<const R: usize, const N: usize>(dtype: DType) -> (RowKernel, RowKernel) {
    match dtype {
        DType::Q4_0 => (q4_rows::<R, N, false>, q4_rows::<1, N, false>),
        DType::Q4_1 => (q4_rows::<R, N, true>, q4_rows::<1, N, true>),
        DType::Q8_0 => (q8_rows::<R, N>, q8_rows::<1, N>),
        DType::Q5_0 => (q5_rows::<R, N, false>, q5_rows::<1, N, false>),
        DType::Q5_1 => (q5_rows::<R, N, true>, q5_rows::<1, N, true>),
        DType::Q4_K => (qk_rows::<R, N, false>, qk_rows::<1, N, false>),
        DType::Q5_K => (qk_rows::<R, N, true>, qk_rows::<1, N, true>),
        DType::Q6_K => (q6k_rows::<R, N>, q6k_rows::<1, N>),
        DType::F32 => (float_rows::<R, N, T_F32>, float_rows::<1, N, T_F32>),
        DType::F16 => (float_rows::<R, N, T_F16>, float_rows::<1, N, T_F16>),
        DType::BF16 => (float_rows::<R, N, T_BF16>, float_rows::<1, N, T_BF16>),
    }
}

/// (weight rows, most input rows) per multi-row kernel call. AVX2 has 16
/// vector registers: the `rows * n` accumulators (twice that for the float
/// types) plus one weight row's unpacked block must fit.
fn multi_shape(dtype: DType) -> (usize, usize) {
    match dtype {
        DType::Q4_0 | DType::Q4_1 | DType::Q8_0 => (1, 8),
        DType::F32 | DType::F16 | DType::BF16 => (1, 6),
        _ => (2, 4),
    }
}

/// Most bytes of input rows per multi-row chunk: with the weight tile
/// streaming through, the chunk must stay in a 32 KiB L1 (k = 576: 8 rows;
/// k = 1536: 4).
const X_CHUNK_BYTES: usize = 24 * 1024;

/// A row kernel: for `R` weight rows starting at `w` (row stride `rb`
/// bytes) and `N` input rows of `k` elements starting at `x` (input-row
/// stride `xs` floats), writes output (input `n`, weight row `r`) to
/// `y[n * ys + r]`. The last argument holds the input rows' per-block sums
/// for the Q4 kernels when `N > 1` ([`block_sums`]); one-input kernels and
/// the other types ignore it.
type RowKernel = unsafe fn(*const u8, usize, usize, *const f32, usize, *mut f32, usize, *const f32);

/// Multi-row product: `y[t * n_rows + r] = dot(row r of W, x[t*k..][..k])`
/// for `t < n_x`, `r < n_rows`, each bit-identical to [`gemv`] of input
/// row `t`. Input rows go through the kernels in chunks ([`multi_shape`]);
/// per weight-row group every chunk runs while the group's bytes are in
/// L1, so each weight block is unpacked once per chunk.
///
/// # Safety
/// AVX2/FMA/F16C available; `w.len() == n_rows * row_bytes(dtype, k)`,
/// `x.len() == n_x * k`, `y.len() == n_x * n_rows`.
#[target_feature(enable = "avx2,fma,f16c")]
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
    let nb = k / QK;
    debug_assert!(w.len() == n_rows * rb && x.len() == n_x * k && y.len() == n_x * n_rows);
    let (rows, max_n) = multi_shape(dtype);
    // A chunk's input rows stay in L1 while every weight row of the tile
    // passes through (see the loop below): at most `X_CHUNK_BYTES` of them.
    let max_n = max_n.min((X_CHUNK_BYTES / (4 * k.max(1))).max(1));
    let chunks = super::multi_chunks(n_x, max_n, |n| {
        if rows == 1 {
            super::by_n!(n, |N| kernels::<1, N>(dtype))
        } else {
            super::by_n!(n, |N| kernels::<2, N>(dtype))
        }
    });
    let sizes: Vec<(usize, usize)> = (0..chunks.len())
        .map(|c| {
            let end = chunks.get(c + 1).map_or(n_x, |n| n.0);
            (chunks[c].0, end - chunks[c].0)
        })
        .collect();
    SUMS.with(|cell| {
        let mut sums = cell.borrow_mut();
        // SAFETY: `x` holds n_x rows of `k` floats; the chunks cover 0..n_x.
        let sx = unsafe { block_sums(dtype, x, n_x, k, &sizes, &mut sums) };
        let (wp, xp, yp) = (w.as_ptr(), x.as_ptr(), y.as_mut_ptr());
        // Chunk-major: a chunk's input rows (<= X_CHUNK_BYTES) stay in L1
        // while the weight tile (a few hundred rows, from L2 after the first
        // chunk) streams past them. Weight-row-major order re-read every
        // input row per weight row, from L2 once they outgrew L1.
        for (c, &(t0, (kr, k1))) in chunks.iter().enumerate() {
            // Q4_1's block sums are per chunk, Q4_0's per input row.
            let sc = sx.wrapping_add(if dtype == DType::Q4_1 { c } else { t0 } * nb * 8);
            let mut r = 0;
            while r < n_rows {
                let group = r + rows <= n_rows;
                // SAFETY: rows r..r+rows (or r) lie within `w`; the chunk's
                // input rows t0.. within `x` (k floats each) and their block
                // sums at `sc` (when the kernel reads them); outputs
                // (t, r..) at y[t * n_rows + r ..] within `y`.
                unsafe {
                    let (xc, yc) = (xp.add(t0 * k), yp.add(t0 * n_rows + r));
                    if group {
                        kr(wp.add(r * rb), rb, k, xc, k, yc, n_rows, sc)
                    } else {
                        k1(wp.add(r * rb), rb, k, xc, k, yc, n_rows, sc)
                    }
                }
                r += if group { rows } else { 1 };
            }
        }
    })
}

/// The one-input-row instance of [`q4_rows`], written out: the same
/// operations per weight row in the same order (the bit-identity tests pin
/// the two together), as the generic instance compiled about 4% slower
/// (register allocation) on the decode path.
///
/// Q4_1 is `Σ_b d_b·(Σ q·x) + Σ_b m_b·S_b`: the first sum lane-wise in a
/// vector accumulator per weight row, the second an FMA chain over the
/// blocks' sums `S_b` of x ([`block_sum`], at `sx`), added after the
/// horizontal sum. Here the chains of the `R <= 4` weight rows run in the
/// lanes of one vector; a multi-row kernel runs one weight row's chains for
/// all its input rows in one vector (lane n: input row n). Either way each
/// (weight row, input row) gets the same sequence of FMAs, and an extra
/// input row costs 5 FMA-class operations per (weight row, block), not 6.
///
/// # Safety
/// `R` rows of `k / 32` blocks at `w` (stride `rb`), `k` floats at `x`,
/// `R` writable floats at `y`; Q4_1: `k / 32` block sums at `sx`, one per
/// 8 floats (the layout of a one-row chunk of [`block_sums`]).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_rows_one<const R: usize, const Q41: bool>(
    w: *const u8,
    rb: usize,
    k: usize,
    x: *const f32,
    y: *mut f32,
    sx: *const f32,
) {
    let (bs, qoff) = if Q41 { (20, 4) } else { (18, 2) };
    let nb = k / QK;
    let mask = _mm256_set1_epi32(0xF);
    let mut acc = [_mm256_setzero_ps(); R];
    debug_assert!(R <= 4);
    // Lane r: weight row r's chain `Σ_b m_b·S_b` (Q4_1).
    let mut accm = _mm_setzero_ps();
    for b in 0..nb {
        // SAFETY: b < nb, so x[b*32 .. b*32+32] is in bounds, and each row's
        // block b (bytes b*bs .. b*bs+bs < rb) is in bounds.
        unsafe {
            let xb = x.add(b * QK);
            let x0 = _mm256_loadu_ps(xb);
            let x1 = _mm256_loadu_ps(xb.add(8));
            let x2 = _mm256_loadu_ps(xb.add(16));
            let x3 = _mm256_loadu_ps(xb.add(24));
            // Q4_0: lane-wise partial sums of the block of x times -8, the
            // start value that folds the nibble offset into the
            // accumulation. Q4_1: the block's sum for m * sum(x).
            let s = if Q41 {
                _mm256_setzero_ps()
            } else {
                let s = _mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3));
                _mm256_mul_ps(s, _mm256_set1_ps(-8.0))
            };
            // Q4_0: the rows' scales d (f16) gathered in general registers
            // and converted in one instruction, then broadcast from memory
            // (+3% over a broadcast and a conversion per row and block;
            // Q4_1 measured 4% slower this way and keeps the latter).
            let mut dmf = [0f32; 4];
            if Q41 {
                // The rows' minima m (f16) in lanes 0..R.
                let mut mh = [0u16; 8];
                for (r, h) in mh.iter_mut().enumerate().take(R) {
                    *h = (w.add(r * rb + b * bs + 2) as *const u16).read_unaligned();
                }
                let m = _mm_cvtph_ps(_mm_loadu_si128(mh.as_ptr() as *const __m128i));
                accm = _mm_fmadd_ps(m, _mm_set1_ps(*sx.add(b * 8)), accm);
            } else {
                let mut dbits = 0u64;
                for r in 0..R {
                    let h = w.add(r * rb + b * bs) as *const u16;
                    dbits |= u64::from(h.read_unaligned()) << (16 * r);
                }
                let dv = _mm_cvtph_ps(_mm_cvtsi64_si128(dbits as i64));
                _mm_storeu_ps(dmf.as_mut_ptr(), dv);
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let p = w.add(r * rb + b * bs);
                prefetch(p.wrapping_add(pf_ahead(R, rb, nb * bs)));
                let d = if Q41 {
                    bcast_f16(p)
                } else {
                    _mm256_set1_ps(dmf[r])
                };
                // bytes 0..8 -> lanes: low nibbles = elements 0..8,
                // high nibbles = elements 16..24; bytes 8..16 likewise.
                let b0 = widen_u8(p.add(qoff));
                let b1 = widen_u8(p.add(qoff + 8));
                let q0 = _mm256_cvtepi32_ps(_mm256_and_si256(b0, mask));
                let q1 = _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask));
                let q2 = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(b0));
                let q3 = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(b1));
                let mut t = if Q41 {
                    _mm256_mul_ps(q0, x0)
                } else {
                    _mm256_fmadd_ps(q0, x0, s)
                };
                t = _mm256_fmadd_ps(q1, x1, t);
                t = _mm256_fmadd_ps(q2, x2, t);
                t = _mm256_fmadd_ps(q3, x3, t);
                *a = _mm256_fmadd_ps(d, t, *a);
            }
        }
    }
    let mut m = [0f32; 4];
    // SAFETY: 4 writable floats.
    unsafe { _mm_storeu_ps(m.as_mut_ptr(), accm) };
    for (r, a) in acc.iter().enumerate() {
        // SAFETY: r < R outputs are writable.
        unsafe { *y.add(r) = if Q41 { hsum(*a) + m[r] } else { hsum(*a) } };
    }
}

/// Q4_0 (`Q41 == false`) or Q4_1: `R` weight rows x `N` input rows.
///
/// # Safety
/// `R` rows of `k / 32` blocks at `w` (stride `rb`), `N` rows of `k`
/// floats at `x` (stride `xs`), outputs `y[n * ys + r]` writable for
/// `n < N`, `r < R`; at `sx` ([`block_sums`]): Q4_0 with `N > 1`, `N * k
/// / 32` block-sum vectors (8 floats each) of the input rows; Q4_1, `k /
/// 32` vectors, lane n the sum of input row n's block. `N == 1` runs
/// [`q4_rows_one`].
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_rows<const R: usize, const N: usize, const Q41: bool>(
    w: *const u8,
    rb: usize,
    k: usize,
    x: *const f32,
    xs: usize,
    y: *mut f32,
    ys: usize,
    sx: *const f32,
) {
    if N == 1 {
        // SAFETY: the same contract, one input row.
        return unsafe { q4_rows_one::<R, Q41>(w, rb, k, x, y, sx) };
    }
    let (bs, qoff) = if Q41 { (20, 4) } else { (18, 2) };
    let nb = k / QK;
    let mask = _mm256_set1_epi32(0xF);
    let mut acc = [[_mm256_setzero_ps(); N]; R];
    // Q4_1: lane n runs input row n's scalar chain `Σ_b m_b·S_b`.
    let mut accm = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        // SAFETY: b < nb, so x[n*xs + b*32 .. + 32] is in bounds for n < N,
        // and each row's block b (bytes b*bs .. b*bs+bs <= rb) is in bounds.
        unsafe {
            // Q4_0: lane-wise partial sums of the block of each input row
            // times -8 (the start value that folds the nibble offset into
            // the accumulation), precomputed once per call by the one-row
            // kernel's operations ([`block_sums`]). Q4_1: the block's sums.
            let mut s = [_mm256_setzero_ps(); N];
            let sm = if Q41 {
                _mm256_loadu_ps(sx.add(b * 8))
            } else {
                for (n, sn) in s.iter_mut().enumerate() {
                    *sn = _mm256_loadu_ps(sx.add((n * nb + b) * 8));
                }
                _mm256_setzero_ps()
            };
            for (r, (ar, am)) in acc.iter_mut().zip(accm.iter_mut()).enumerate() {
                let p = w.add(r * rb + b * bs);
                prefetch(p.wrapping_add(pf_ahead(R, rb, nb * bs)));
                let d = bcast_f16(p);
                // bytes 0..8 -> lanes: low nibbles = elements 0..8,
                // high nibbles = elements 16..24; bytes 8..16 likewise.
                let b0 = widen_u8(p.add(qoff));
                let b1 = widen_u8(p.add(qoff + 8));
                let q0 = _mm256_cvtepi32_ps(_mm256_and_si256(b0, mask));
                let q1 = _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask));
                let q2 = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(b0));
                let q3 = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(b1));
                if Q41 {
                    *am = _mm256_fmadd_ps(bcast_f16(p.add(2)), sm, *am);
                }
                for (n, a) in ar.iter_mut().enumerate() {
                    let xb = x.add(n * xs + b * QK);
                    let xv = [
                        _mm256_loadu_ps(xb),
                        _mm256_loadu_ps(xb.add(8)),
                        _mm256_loadu_ps(xb.add(16)),
                        _mm256_loadu_ps(xb.add(24)),
                    ];
                    let mut t = if Q41 {
                        _mm256_mul_ps(q0, xv[0])
                    } else {
                        _mm256_fmadd_ps(q0, xv[0], s[n])
                    };
                    t = _mm256_fmadd_ps(q1, xv[1], t);
                    t = _mm256_fmadd_ps(q2, xv[2], t);
                    t = _mm256_fmadd_ps(q3, xv[3], t);
                    *a = _mm256_fmadd_ps(d, t, *a);
                }
            }
        }
    }
    for (r, (ar, am)) in acc.iter().zip(&accm).enumerate() {
        let mut m = [0f32; 8];
        // SAFETY: 8 writable floats.
        unsafe { _mm256_storeu_ps(m.as_mut_ptr(), *am) };
        for (n, a) in ar.iter().enumerate() {
            // SAFETY: r < R, n < N: the output is writable. Q4_0's `m` is 0
            // and not added (the one-row kernel adds nothing).
            unsafe { *y.add(n * ys + r) = if Q41 { hsum(*a) + m[n] } else { hsum(*a) } };
        }
    }
}

/// Q8_0: `R` weight rows x `N` input rows.
///
/// # Safety
/// As for [`q4_rows`].
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_rows<const R: usize, const N: usize>(
    w: *const u8,
    rb: usize,
    k: usize,
    x: *const f32,
    xs: usize,
    y: *mut f32,
    ys: usize,
    _sx: *const f32,
) {
    let nb = k / QK;
    let mut acc = [[_mm256_setzero_ps(); N]; R];
    for b in 0..nb {
        // SAFETY: b < nb: the x blocks and each row's 34-byte block are in
        // bounds.
        unsafe {
            for (r, ar) in acc.iter_mut().enumerate() {
                let p = w.add(r * rb + b * 34);
                prefetch(p.wrapping_add(PF_DIST));
                let d = bcast_f16(p);
                let q0 = _mm256_cvtepi32_ps(widen_i8(p.add(2)));
                let q1 = _mm256_cvtepi32_ps(widen_i8(p.add(10)));
                let q2 = _mm256_cvtepi32_ps(widen_i8(p.add(18)));
                let q3 = _mm256_cvtepi32_ps(widen_i8(p.add(26)));
                for (n, a) in ar.iter_mut().enumerate() {
                    let xb = x.add(n * xs + b * QK);
                    let mut t = _mm256_mul_ps(q0, _mm256_loadu_ps(xb));
                    t = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xb.add(8)), t);
                    t = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xb.add(16)), t);
                    t = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xb.add(24)), t);
                    *a = _mm256_fmadd_ps(d, t, *a);
                }
            }
        }
    }
    for (r, ar) in acc.iter().enumerate() {
        for (n, a) in ar.iter().enumerate() {
            // SAFETY: r < R, n < N: the output is writable.
            unsafe { *y.add(n * ys + r) = hsum(*a) };
        }
    }
}

/// Sum of the 32 floats at `p`, as one f32.
///
/// # Safety
/// `p..p+32` readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sum32(p: *const f32) -> f32 {
    // SAFETY: the caller guarantees 32 readable floats.
    unsafe {
        let a = _mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)));
        let b = _mm256_add_ps(_mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24)));
        hsum(_mm256_add_ps(a, b))
    }
}

/// Q5_0 (`Q51 == false`) or Q5_1: as the Q4 kernels, with the fifth bit of
/// element e taken from `qh >> e` by a variable shift per lane.
///
/// # Safety
/// As for [`q4_rows`].
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_rows<const R: usize, const N: usize, const Q51: bool>(
    w: *const u8,
    rb: usize,
    k: usize,
    x: *const f32,
    xs: usize,
    y: *mut f32,
    ys: usize,
    _sx: *const f32,
) {
    let (bs, hoff) = if Q51 { (24, 4) } else { (22, 2) };
    let nb = k / QK;
    let mask = _mm256_set1_epi32(15);
    let one = _mm256_set1_epi32(1);
    let bias = _mm256_set1_epi32(if Q51 { 0 } else { 16 });
    // Lane shifts for elements 0..8, 8..16, 16..24, 24..32.
    let sh = [0, 8, 16, 24]
        .map(|o| _mm256_setr_epi32(o, o + 1, o + 2, o + 3, o + 4, o + 5, o + 6, o + 7));
    let mut acc = [[_mm256_setzero_ps(); N]; R];
    for b in 0..nb {
        // SAFETY: b < nb: the x blocks and each row's block b are in bounds.
        unsafe {
            let mut xsum = [_mm256_setzero_ps(); N];
            for (n, sn) in xsum.iter_mut().enumerate() {
                let xb = x.add(n * xs + b * QK);
                let xv = [0, 8, 16, 24].map(|o| _mm256_loadu_ps(xb.add(o)));
                *sn = _mm256_add_ps(_mm256_add_ps(xv[0], xv[1]), _mm256_add_ps(xv[2], xv[3]));
            }
            for (r, ar) in acc.iter_mut().enumerate() {
                let p = w.add(r * rb + b * bs);
                prefetch(p.wrapping_add(pf_ahead(R, rb, nb * bs)));
                let qh = _mm256_set1_epi32((p.add(hoff) as *const i32).read_unaligned());
                let qs = p.add(hoff + 4);
                // The four 8-element groups in the order they are summed.
                let mut qf = [_mm256_setzero_ps(); 4];
                let mut order = [0usize; 4];
                let mut i = 0;
                for c in 0..2 {
                    let v = widen_u8(qs.add(8 * c));
                    for (half, nib) in [_mm256_and_si256(v, mask), _mm256_srli_epi32::<4>(v)]
                        .into_iter()
                        .enumerate()
                    {
                        let e = 2 * half + c; // which 8 of the 32 elements
                        let hb = _mm256_and_si256(_mm256_srlv_epi32(qh, sh[e]), one);
                        let q = _mm256_or_si256(nib, _mm256_slli_epi32::<4>(hb));
                        qf[i] = _mm256_cvtepi32_ps(_mm256_sub_epi32(q, bias));
                        order[i] = e;
                        i += 1;
                    }
                }
                let d = bcast_f16(p);
                let m = if Q51 {
                    bcast_f16(p.add(2))
                } else {
                    _mm256_setzero_ps()
                };
                for (n, a) in ar.iter_mut().enumerate() {
                    let xb = x.add(n * xs + b * QK);
                    let mut t = _mm256_setzero_ps();
                    for (q, &e) in qf.iter().zip(&order) {
                        t = _mm256_fmadd_ps(*q, _mm256_loadu_ps(xb.add(8 * e)), t);
                    }
                    *a = _mm256_fmadd_ps(d, t, *a);
                    if Q51 {
                        *a = _mm256_fmadd_ps(m, xsum[n], *a);
                    }
                }
            }
        }
    }
    for (r, ar) in acc.iter().enumerate() {
        for (n, a) in ar.iter().enumerate() {
            // SAFETY: r < R, n < N: the output is writable.
            unsafe { *y.add(n * ys + r) = hsum(*a) };
        }
    }
}

/// Q4_K (`FIVE == false`) or Q5_K, in registers. Per super-block the
/// product is `Σ_j (d·sc_j)·Σ q·x − Σ_j (dmin·m_j)·Σ x` over the 8
/// sub-blocks j: the first sum in vector accumulators (the sub-block sums
/// of `q·x` scaled once per sub-block), the second, per row, in scalars
/// from the per-sub-block sums of `x` that all rows share.
///
/// # Safety
/// `R` rows of `k / 256` super-blocks at `w` (stride `rb`), `N` rows of
/// `k` floats at `x` (stride `xs`), outputs `y[n * ys + r]` writable.
#[allow(clippy::needless_range_loop)]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn qk_rows<const R: usize, const N: usize, const FIVE: bool>(
    w: *const u8,
    rb: usize,
    k: usize,
    x: *const f32,
    xs: usize,
    y: *mut f32,
    ys: usize,
    _sx: *const f32,
) {
    let (bs, qoff) = if FIVE { (176, 48) } else { (144, 16) };
    let nsb = k / 256;
    let mask = _mm256_set1_epi32(15);
    let one = _mm256_set1_epi32(1);
    let mut acc = [[_mm256_setzero_ps(); N]; R];
    let mut mins = [[0f32; N]; R];
    for b in 0..nsb {
        // SAFETY: b < nsb: x[n*xs + b*256 ..][..256] and each row's
        // super-block b (bytes b*bs .. b*bs+bs <= rb) are in bounds.
        unsafe {
            let mut xsum = [[0f32; 8]; N];
            for (n, xn) in xsum.iter_mut().enumerate() {
                let xsb = x.add(n * xs + b * 256);
                for (j, s) in xn.iter_mut().enumerate() {
                    *s = sum32(xsb.add(32 * j));
                }
            }
            let mut dsc = [[0f32; 8]; R];
            for r in 0..R {
                let p = w.add(r * rb + b * bs);
                prefetch(p.wrapping_add(pf_ahead(R, rb, nsb * bs)));
                let blk = core::slice::from_raw_parts(p, bs);
                let (d, dmin) = (super::f16_at(blk), super::f16_at(&blk[2..]));
                let (sc, m) = blocks::scale_min_k4(&blk[4..16]);
                for j in 0..8 {
                    dsc[r][j] = d * sc[j];
                    for n in 0..N {
                        mins[r][n] += dmin * m[j] * xsum[n][j];
                    }
                }
            }
            for i in 0..4 {
                let mut s_lo = [[_mm256_setzero_ps(); N]; R];
                let mut s_hi = [[_mm256_setzero_ps(); N]; R];
                for c in 0..4 {
                    for r in 0..R {
                        let p = w.add(r * rb + b * bs);
                        let v = widen_u8(p.add(qoff + 32 * i + 8 * c));
                        let mut lo = _mm256_and_si256(v, mask);
                        let mut hi = _mm256_srli_epi32::<4>(v);
                        if FIVE {
                            let h = widen_u8(p.add(16 + 8 * c));
                            let j0 = _mm_cvtsi32_si128(2 * i as i32);
                            let j1 = _mm_cvtsi32_si128(2 * i as i32 + 1);
                            let b0 = _mm256_and_si256(_mm256_srl_epi32(h, j0), one);
                            let b1 = _mm256_and_si256(_mm256_srl_epi32(h, j1), one);
                            lo = _mm256_or_si256(lo, _mm256_slli_epi32::<4>(b0));
                            hi = _mm256_or_si256(hi, _mm256_slli_epi32::<4>(b1));
                        }
                        let (lo, hi) = (_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi));
                        for n in 0..N {
                            let xsb = x.add(n * xs + b * 256);
                            let xl = _mm256_loadu_ps(xsb.add(64 * i + 8 * c));
                            let xh = _mm256_loadu_ps(xsb.add(64 * i + 32 + 8 * c));
                            s_lo[r][n] = _mm256_fmadd_ps(lo, xl, s_lo[r][n]);
                            s_hi[r][n] = _mm256_fmadd_ps(hi, xh, s_hi[r][n]);
                        }
                    }
                }
                for r in 0..R {
                    let (dl, dh) = (dsc[r][2 * i], dsc[r][2 * i + 1]);
                    for n in 0..N {
                        let a = _mm256_fmadd_ps(_mm256_set1_ps(dl), s_lo[r][n], acc[r][n]);
                        acc[r][n] = _mm256_fmadd_ps(_mm256_set1_ps(dh), s_hi[r][n], a);
                    }
                }
            }
        }
    }
    for r in 0..R {
        for n in 0..N {
            // SAFETY: r < R, n < N: the output is writable.
            unsafe { *y.add(n * ys + r) = hsum(acc[r][n]) - mins[r][n] };
        }
    }
}

/// Q6_K, in registers: per 16-element group g, `(d·sc_g)·Σ (q − 32)·x`.
///
/// # Safety
/// As for [`qk_rows`] (210-byte super-blocks).
#[allow(clippy::needless_range_loop)]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_rows<const R: usize, const N: usize>(
    w: *const u8,
    rb: usize,
    k: usize,
    x: *const f32,
    xs: usize,
    y: *mut f32,
    ys: usize,
    _sx: *const f32,
) {
    let nsb = k / 256;
    let mask = _mm256_set1_epi32(15);
    let three = _mm256_set1_epi32(3);
    let bias = _mm256_set1_epi32(32);
    let mut acc = [[_mm256_setzero_ps(); N]; R];
    for b in 0..nsb {
        // SAFETY: b < nsb: x[n*xs + b*256 ..][..256] and each row's
        // 210-byte super-block b are in bounds.
        unsafe {
            let mut ds = [0f32; R];
            for (r, dv) in ds.iter_mut().enumerate() {
                let p = w.add(r * rb + b * 210);
                prefetch(p.wrapping_add(pf_ahead(R, rb, nsb * 210)));
                *dv = super::f16_at(core::slice::from_raw_parts(p.add(208), 2));
            }
            for h in 0..2 {
                for t in 0..4 {
                    let lsh = _mm_cvtsi32_si128(4 * (t as i32 >> 1));
                    let hsh = _mm_cvtsi32_si128(2 * t as i32);
                    // Elements 128h + 32t + 8c + lane; groups c / 2.
                    let mut sg = [[[_mm256_setzero_ps(); 2]; N]; R];
                    for c in 0..4 {
                        for r in 0..R {
                            let p = w.add(r * rb + b * 210);
                            let ql = widen_u8(p.add(64 * h + 32 * (t & 1) + 8 * c));
                            let qh = widen_u8(p.add(128 + 32 * h + 8 * c));
                            let lo = _mm256_and_si256(_mm256_srl_epi32(ql, lsh), mask);
                            let hi = _mm256_and_si256(_mm256_srl_epi32(qh, hsh), three);
                            let q = _mm256_or_si256(lo, _mm256_slli_epi32::<4>(hi));
                            let q = _mm256_cvtepi32_ps(_mm256_sub_epi32(q, bias));
                            for n in 0..N {
                                let off = n * xs + b * 256 + 128 * h + 32 * t + 8 * c;
                                let xv = _mm256_loadu_ps(x.add(off));
                                sg[r][n][c / 2] = _mm256_fmadd_ps(q, xv, sg[r][n][c / 2]);
                            }
                        }
                    }
                    for r in 0..R {
                        let sc = w.add(r * rb + b * 210 + 192 + 8 * h + 2 * t) as *const i8;
                        let s0 = ds[r] * *sc as f32;
                        let s1 = ds[r] * *sc.add(1) as f32;
                        for n in 0..N {
                            let a = _mm256_fmadd_ps(_mm256_set1_ps(s0), sg[r][n][0], acc[r][n]);
                            acc[r][n] = _mm256_fmadd_ps(_mm256_set1_ps(s1), sg[r][n][1], a);
                        }
                    }
                }
            }
        }
    }
    for r in 0..R {
        for n in 0..N {
            // SAFETY: r < R, n < N: the output is writable.
            unsafe { *y.add(n * ys + r) = hsum(acc[r][n]) };
        }
    }
}

/// F32/F16/BF16 (any `k`): `R` weight rows x `N` input rows.
///
/// # Safety
/// `R` rows of `k` elements at `w` (stride `rb` bytes), `N` rows of `k`
/// floats at `x` (stride `xs`), outputs `y[n * ys + r]` writable.
#[allow(clippy::needless_range_loop)]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float_rows<const R: usize, const N: usize, const T: u8>(
    w: *const u8,
    rb: usize,
    k: usize,
    x: *const f32,
    xs: usize,
    y: *mut f32,
    ys: usize,
    _sx: *const f32,
) {
    // Two accumulators per output: 2*R*N independent FMA chains.
    let mut acc0 = [[_mm256_setzero_ps(); N]; R];
    let mut acc1 = [[_mm256_setzero_ps(); N]; R];
    let mut i = 0;
    while i + 16 <= k {
        // SAFETY: elements i..i+16 < k of each x row n < N and of each
        // weight row r < R.
        unsafe {
            for r in 0..R {
                let p = w.add(r * rb);
                let (w0, w1) = (load8::<T>(p, i), load8::<T>(p, i + 8));
                for n in 0..N {
                    let xn = x.add(n * xs);
                    acc0[r][n] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xn.add(i)), acc0[r][n]);
                    acc1[r][n] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xn.add(i + 8)), acc1[r][n]);
                }
            }
        }
        i += 16;
    }
    if i + 8 <= k {
        // SAFETY: elements i..i+8 < k of each x row and each weight row.
        unsafe {
            for r in 0..R {
                let w0 = load8::<T>(w.add(r * rb), i);
                for n in 0..N {
                    let xv = _mm256_loadu_ps(x.add(n * xs + i));
                    acc0[r][n] = _mm256_fmadd_ps(w0, xv, acc0[r][n]);
                }
            }
        }
        i += 8;
    }
    for r in 0..R {
        for n in 0..N {
            let mut s = hsum(_mm256_add_ps(acc0[r][n], acc1[r][n]));
            for j in i..k {
                // SAFETY: j < k, r < R, n < N.
                unsafe { s += load1::<T>(w.add(r * rb), j) * *x.add(n * xs + j) };
            }
            // SAFETY: r < R, n < N: the output is writable.
            unsafe { *y.add(n * ys + r) = s };
        }
    }
}

// ------------------------------------------------------------- DEQUANT ---

/// # Safety
/// AVX2/FMA/F16C available; `src.len() == row_bytes(dtype, k)`,
/// `out.len() == k`.
///
/// Results are bit-identical to the scalar path (same operations, one
/// rounding each).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dequant_row(dtype: DType, src: &[u8], k: usize, out: &mut [f32]) {
    debug_assert!(src.len() == row_bytes(dtype, k) && out.len() == k);
    let (s, o) = (src.as_ptr(), out.as_mut_ptr());
    let nb = k / QK;
    let mask = _mm256_set1_epi32(0xF);
    // SAFETY: (all arms) block b < nb lies inside `src` (b * block_bytes +
    // block_bytes <= src.len()) and writes go to out[b*32 .. b*32+32] with
    // b*32+32 <= k; float types touch elements < k only.
    unsafe {
        match dtype {
            DType::Q4_0 | DType::Q4_1 => {
                let q41 = dtype == DType::Q4_1;
                let (bs, qoff) = if q41 { (20, 4) } else { (18, 2) };
                let off = _mm256_set1_ps(if q41 { 0.0 } else { 8.0 });
                for b in 0..nb {
                    let p = s.add(b * bs);
                    let d = bcast_f16(p);
                    let m = if q41 {
                        bcast_f16(p.add(2))
                    } else {
                        _mm256_setzero_ps()
                    };
                    let b0 = widen_u8(p.add(qoff));
                    let b1 = widen_u8(p.add(qoff + 8));
                    let qs = [
                        _mm256_and_si256(b0, mask),
                        _mm256_and_si256(b1, mask),
                        _mm256_srli_epi32::<4>(b0),
                        _mm256_srli_epi32::<4>(b1),
                    ];
                    for (j, q) in qs.into_iter().enumerate() {
                        // q - 8 is exact; then a single rounding in the
                        // multiply (Q4_0), or multiply-then-add (Q4_1) like
                        // the scalar code.
                        let q = _mm256_sub_ps(_mm256_cvtepi32_ps(q), off);
                        let v = _mm256_mul_ps(d, q);
                        let v = if q41 { _mm256_add_ps(v, m) } else { v };
                        _mm256_storeu_ps(o.add(b * QK + j * 8), v);
                    }
                }
            }
            DType::Q8_0 => {
                for b in 0..nb {
                    let p = s.add(b * 34);
                    let d = bcast_f16(p);
                    for j in 0..4 {
                        let q = _mm256_cvtepi32_ps(widen_i8(p.add(2 + j * 8)));
                        _mm256_storeu_ps(o.add(b * QK + j * 8), _mm256_mul_ps(d, q));
                    }
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
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequant_float<const T: u8>(s: *const u8, k: usize, o: *mut f32) {
    let mut i = 0;
    // SAFETY: i + 8 <= k in the loop, j < k in the tail.
    unsafe {
        while i + 8 <= k {
            _mm256_storeu_ps(o.add(i), load8::<T>(s, i));
            i += 8;
        }
        for j in i..k {
            *o.add(j) = load1::<T>(s, j);
        }
    }
}

// ---------------------------------------------------------------- GEMM ---

/// Micro-kernel: `c[i*ldc + j] += dot(a[i*lda..][..len], b[j*ldb..][..len])`
/// for `i < mr <= 4`, `j < nt <= 3`.
///
/// # Safety
/// AVX2/FMA available and the bounds verified by `super::check_tile`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
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
    go!(4,3; 4,2; 4,1; 3,3; 3,2; 3,1; 2,3; 2,2; 2,1; 1,3; 1,2; 1,1);
}

/// # Safety
/// `a[i*lda + l]`, `b[j*ldb + l]` readable and `c[i*ldc + j]` writable for
/// `i < M`, `j < N`, `l < len`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_k<const M: usize, const N: usize>(
    a: *const f32,
    lda: usize,
    b: *const f32,
    ldb: usize,
    len: usize,
    c: *mut f32,
    ldc: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); N]; M];
    let mut l = 0;
    while l + 8 <= len {
        // SAFETY: l + 8 <= len, rows i < M of a and j < N of b.
        unsafe {
            let mut bv = [_mm256_setzero_ps(); N];
            for (j, v) in bv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(b.add(j * ldb + l));
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let av = _mm256_loadu_ps(a.add(i * lda + l));
                for (j, r) in row.iter_mut().enumerate() {
                    *r = _mm256_fmadd_ps(av, bv[j], *r);
                }
            }
        }
        l += 8;
    }
    for (i, row) in acc.iter().enumerate() {
        // Reduce the (up to 4) accumulators of this row together.
        let z = _mm256_setzero_ps();
        let v = |j: usize| if j < N { row[j] } else { z };
        let mut sums = [0f32; 4];
        // SAFETY: `sums` has room for 4 floats.
        unsafe { _mm_storeu_ps(sums.as_mut_ptr(), hsum4(v(0), v(1), v(2), v(3))) };
        for (j, s) in sums.iter_mut().take(N).enumerate() {
            for t in l..len {
                // SAFETY: t < len, i < M, j < N.
                unsafe { *s += *a.add(i * lda + t) * *b.add(j * ldb + t) };
            }
            // SAFETY: i < M, j < N: c[i*ldc + j] is writable.
            unsafe { *c.add(i * ldc + j) += *s };
        }
    }
}
