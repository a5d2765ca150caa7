//! GEMV with 8-bit-quantized activations and integer dot products (the
//! llama.cpp decode path) for Q4_0, Q4_1 and Q8_0 weights.
//!
//! The activation vector is quantized once per product into [`Q8Act`]
//! (GGML `block_q8_1` semantics, scales kept in f32); every weight block is
//! then multiplied with it in exact integer arithmetic and only the block
//! sum is scaled in f32:
//! * Q8_0: `d_w * d_x * sum(qw * qx)`
//! * Q4_0: `d_w * d_x * sum((q - 8) * qx)`; the `-8 * sum(qx)` term is an
//!   integer per-block bias shared by all rows, so it is folded into the
//!   integer accumulator (exactly equal to `d_w * (d_x * sum(q * qx) - 8 s_x)`).
//! * Q4_1: `d_w * d_x * sum(q * qx) + m_w * s_x`.
//!
//! Kernels (chosen from the crate's SIMD level, so `AKUNU_SIMD` lowering
//! applies; VNNI is an extra run-time check on top of the AVX-512 level):
//! * AVX-512 VNNI: 256-bit `vpdpbusd` (unsigned x signed bytes -> i32).
//!   Q4 nibbles are already unsigned. Q8_0 weights are signed: they are
//!   offset by +128 (`xor 0x80`) and the shared per-block bias
//!   `128 * sum(qx)` starts the accumulator, which costs one op per row
//!   instead of the two of the abs/sign trick.
//! * AVX2: `vpmaddubsw` + `vpmaddwd`. Q8_0 uses llama.cpp's sign trick
//!   (`|w|` unsigned, `w`'s sign moved onto `x`); no i16 pair sum can
//!   saturate (`2 * 128 * 127`, `2 * 15 * 127 < 32767`).
//! * Scalar fallback (also the aarch64 path for now).
//!
//! Rows are processed 4 at a time sharing the activation loads; each block
//! sum is converted to f32 and FMA'd with the combined scale into per-row
//! f32 vector accumulators that are reduced once at the end.

use super::{Level, QK, f16_at, row_bytes};
use akunu_core::dtype::DType;

/// `x` quantized per 32-element block with GGML's `block_q8_1` semantics:
/// `d = amax / 127`, `qs = round(x * (1/d))` (half away from zero, as
/// `roundf`), `s = d * sum(qs)`. All `qs` lie in `-127..=127`.
#[derive(Clone, Debug, Default)]
pub struct Q8Act {
    /// Per-block scale (`k / 32` entries).
    pub d: Vec<f32>,
    /// Per-block `d * sum(qs)` (`k / 32` entries).
    pub s: Vec<f32>,
    /// Per-block integer `sum(qs)` (`k / 32` entries; the Q4_0 bias of the
    /// row-interleaved kernels, [`super::q4x8`]).
    pub sq: Vec<i32>,
    /// Quantized values (`k` entries).
    pub qs: Vec<i8>,
}

impl Q8Act {
    /// An empty activation buffer (allocates on the first `quantize`).
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of quantized elements (`k`).
    pub fn k(&self) -> usize {
        self.qs.len()
    }

    /// Quantizes `x` (`x.len() % 32 == 0`) into `self`, reusing the
    /// allocations.
    pub fn quantize(&mut self, x: &[f32]) {
        self.quantize_with(kern_for(super::level()), x)
    }

    pub(crate) fn quantize_with(&mut self, kern: Kern, x: &[f32]) {
        assert!(
            x.len().is_multiple_of(QK),
            "Q8Act::quantize: length {} is not a multiple of {QK}",
            x.len()
        );
        let nb = x.len() / QK;
        self.d.resize(nb, 0.0);
        self.s.resize(nb, 0.0);
        self.sq.resize(nb, 0);
        self.qs.resize(x.len(), 0);
        match kern {
            Kern::Scalar => {
                scalar::quantize(x, &mut self.d, &mut self.s, &mut self.sq, &mut self.qs)
            }
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Kern::Avx2`/`Kern::Vnni` are only produced when the
            // CPU has AVX2+FMA+F16C (both imply the AVX2 level); the
            // output slices were just resized to `nb` / `nb * 32` entries.
            Kern::Avx2 | Kern::Vnni => unsafe {
                avx2::quantize(
                    x.as_ptr(),
                    nb,
                    self.d.as_mut_ptr(),
                    self.s.as_mut_ptr(),
                    self.sq.as_mut_ptr(),
                    self.qs.as_mut_ptr(),
                )
            },
        }
    }
}

/// Whether [`gemv_q8`] handles `dtype` (Q4_0, Q4_1, Q8_0).
pub fn supports_q8(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q8_0)
}

/// `y[r] = dot(row r of W, dequant(xq))` for `r in 0..y.len()`; `w` starts
/// at row 0 and holds at least `y.len() * row_bytes(dtype, k)` bytes and
/// `xq` holds `k` quantized activations. Only for [`supports_q8`] dtypes.
pub fn gemv_q8(dtype: DType, w: &[u8], k: usize, xq: &Q8Act, y: &mut [f32]) {
    gemv_q8_with(kern_for(super::level()), dtype, w, k, xq, y)
}

/// The kernel family a GEMV runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kern {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Vnni,
}

impl Kern {
    #[cfg(test)]
    fn name(self) -> &'static str {
        match self {
            Kern::Scalar => "scalar",
            #[cfg(target_arch = "x86_64")]
            Kern::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            Kern::Vnni => "avx512vnni",
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn has_vnni() -> bool {
    static VNNI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *VNNI.get_or_init(|| std::is_x86_feature_detected!("avx512vnni"))
}

/// The kernel family for a SIMD level (VNNI needs the AVX-512 level plus
/// the `avx512vnni` feature; AVX-512 without VNNI uses the AVX2 kernels).
pub(crate) fn kern_for(lvl: Level) -> Kern {
    match lvl {
        Level::Scalar => Kern::Scalar,
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => Kern::Avx2,
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => {
            if has_vnni() {
                Kern::Vnni
            } else {
                Kern::Avx2
            }
        }
        #[cfg(target_arch = "aarch64")]
        Level::Neon => Kern::Scalar,
    }
}

/// Raw pointers into a [`Q8Act`] of `nb` blocks.
#[derive(Clone, Copy)]
struct XPtr {
    d: *const f32,
    s: *const f32,
    qs: *const i8,
}

impl XPtr {
    fn of(xq: &Q8Act) -> Self {
        XPtr {
            d: xq.d.as_ptr(),
            s: xq.s.as_ptr(),
            qs: xq.qs.as_ptr(),
        }
    }
}

/// Panics unless `xq` holds `k` quantized activations.
pub(crate) fn check_act(what: &str, xq: &Q8Act, k: usize) {
    let nb = k / QK;
    assert!(
        xq.qs.len() == k && xq.d.len() == nb && xq.s.len() == nb && xq.sq.len() == nb,
        "{what}: activations hold {} elements, want {k}",
        xq.qs.len()
    );
}

pub(crate) fn gemv_q8_with(
    kern: Kern,
    dtype: DType,
    w: &[u8],
    k: usize,
    xq: &Q8Act,
    y: &mut [f32],
) {
    assert!(supports_q8(dtype), "gemv_q8: unsupported dtype {dtype}");
    let rb = row_bytes(dtype, k);
    let nb = k / QK;
    check_act("gemv_q8", xq, k);
    let need = rb.checked_mul(y.len()).expect("gemv_q8: size overflow");
    assert!(w.len() >= need, "gemv_q8: weight buffer too short");
    let w = &w[..need];
    match kern {
        Kern::Scalar => scalar::gemv(dtype, w, rb, xq, y),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Kern::Avx2` implies AVX2+FMA+F16C; `w.len() == y.len() *
        // rb` and the activation lengths were checked above.
        Kern::Avx2 => unsafe { avx2::gemv(dtype, w, rb, nb, xq, y) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Kern::Vnni` implies AVX-512 F/BW/VL + VNNI and AVX2+FMA+
        // F16C; lengths as above.
        Kern::Vnni => unsafe { vnni::gemv(dtype, w, rb, nb, xq, y) },
    }
}

/// Multi-row product with quantized activations: for `t < xq.len()` and
/// `r < n_rows`, `y[t * n_rows + r] = dot(row r of W, dequant(xq[t]))`,
/// each value **bit-identical** to [`gemv_q8`] of `xq[t]` alone (the
/// one-row kernels are the one-input instances of the same code). Only for
/// [`supports_q8`] dtypes; every `xq[t]` holds `k` activations.
pub fn gemv_q8_multi(dtype: DType, w: &[u8], k: usize, n_rows: usize, xq: &[Q8Act], y: &mut [f32]) {
    gemv_q8_multi_with(kern_for(super::level()), dtype, w, k, n_rows, xq, y)
}

pub(crate) fn gemv_q8_multi_with(
    kern: Kern,
    dtype: DType,
    w: &[u8],
    k: usize,
    n_rows: usize,
    xq: &[Q8Act],
    y: &mut [f32],
) {
    assert!(
        supports_q8(dtype),
        "gemv_q8_multi: unsupported dtype {dtype}"
    );
    let rb = row_bytes(dtype, k);
    let nb = k / QK;
    for x in xq {
        check_act("gemv_q8_multi", x, k);
    }
    let n_x = xq.len();
    assert_eq!(
        y.len(),
        n_rows
            .checked_mul(n_x)
            .expect("gemv_q8_multi: size overflow"),
        "gemv_q8_multi: y length"
    );
    let need = rb
        .checked_mul(n_rows)
        .expect("gemv_q8_multi: size overflow");
    assert!(w.len() >= need, "gemv_q8_multi: weight buffer too short");
    let w = &w[..need];
    if n_x <= 1 || n_rows == 0 {
        if n_x == 1 {
            gemv_q8_with(kern, dtype, w, k, &xq[0], y);
        }
        return;
    }
    match kern {
        Kern::Scalar => scalar::gemv_multi(dtype, w, rb, n_rows, xq, y),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Kern::Avx2` implies AVX2+FMA+F16C; `w.len() == n_rows *
        // rb`, `y.len() == n_x * n_rows`, every activation holds `nb` blocks.
        Kern::Avx2 => unsafe { avx2::gemv_multi(dtype, w, rb, nb, n_rows, xq, y) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Kern::Vnni` implies AVX-512 F/BW/VL + VNNI and AVX2+FMA+
        // F16C; lengths as above.
        Kern::Vnni => unsafe { vnni::gemv_multi(dtype, w, rb, nb, n_rows, xq, y) },
    }
}

/// A row kernel: for `R` weight rows at `w` (stride `rb` bytes) of `nb`
/// blocks and `N` activation rows `x[0..N]`, writes output (input `n`,
/// weight row `r`) to `y[n * ys + r]`.
#[cfg(target_arch = "x86_64")]
type RowKernel = unsafe fn(*const u8, usize, usize, *const XPtr, *mut f32, usize);

/// Runs `k4` over groups of 4 rows and `k1` over the remaining rows. As in
/// the f32 kernels' `gemv_rows`, the rows are cut into 4 equal spans and
/// group `i` takes row `i` of each span (the kernel's row stride is the
/// span's length): 4 long sequential streams per thread, which the
/// hardware prefetchers follow, instead of 4 interleaved one-row streams.
///
/// # Safety
/// The CPU supports the kernels' features; `w.len() >= y.len() * rb`; `xq`
/// holds `nb` blocks and the kernels read `nb` blocks per row (`rb` bytes).
#[cfg(target_arch = "x86_64")]
unsafe fn run_rows(
    w: &[u8],
    rb: usize,
    nb: usize,
    xq: &Q8Act,
    y: &mut [f32],
    k4: RowKernel,
    k1: RowKernel,
) {
    let n = y.len();
    let x = XPtr::of(xq);
    let (wp, yp) = (w.as_ptr(), y.as_mut_ptr());
    let span = n / 4;
    let mut t = [0f32; 4];
    for i in 0..span {
        // SAFETY: rows i + j * span (j < 4) lie within `w` (i < span, 4 *
        // span <= n); the kernel writes its 4 outputs to `t`; one
        // activation row (stride unused).
        unsafe { k4(wp.add(i * rb), span * rb, nb, &x, t.as_mut_ptr(), 0) };
        for (j, v) in t.iter().enumerate() {
            y[i + j * span] = *v;
        }
    }
    for r in 4 * span..n {
        // SAFETY: row r < n lies within `w`, output r within `y`.
        unsafe { k1(wp.add(r * rb), rb, nb, &x, yp.add(r), 0) };
    }
}

/// Multi-row driver: weight rows in groups of `rows` (then single rows),
/// each group running every chunk of activation rows while its bytes are
/// in L1. `pick(n)` gives the (`rows`-row, 1-row) kernels for `n` inputs.
///
/// # Safety
/// The CPU supports the kernels' features; `w.len() >= n_rows * rb`,
/// `y.len() == xq.len() * n_rows`, every activation holds `nb` blocks.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn run_multi(
    w: &[u8],
    rb: usize,
    nb: usize,
    n_rows: usize,
    xq: &[Q8Act],
    y: &mut [f32],
    (rows, max_n): (usize, usize),
    pick: impl Fn(usize) -> (RowKernel, RowKernel),
) {
    let xs: Vec<XPtr> = xq.iter().map(XPtr::of).collect();
    let chunks = super::multi_chunks(xs.len(), max_n, pick);
    let (wp, yp) = (w.as_ptr(), y.as_mut_ptr());
    let mut r = 0;
    while r < n_rows {
        let group = r + rows <= n_rows;
        for &(t0, (kr, k1)) in chunks.iter() {
            // SAFETY: rows r..r+rows (or r) lie within `w`; the chunk's
            // activation rows t0.. are in `xs`; outputs (t, r..) at
            // y[t * n_rows + r ..] lie within `y`.
            unsafe {
                let (xc, yc) = (xs.as_ptr().add(t0), yp.add(t0 * n_rows + r));
                if group {
                    kr(wp.add(r * rb), rb, nb, xc, yc, n_rows)
                } else {
                    k1(wp.add(r * rb), rb, nb, xc, yc, n_rows)
                }
            }
        }
        r += if group { rows } else { 1 };
    }
}

mod scalar {
    use super::{DType, Q8Act, QK, f16_at};

    pub(super) fn quantize(x: &[f32], d: &mut [f32], s: &mut [f32], sq: &mut [i32], qs: &mut [i8]) {
        for ((((xb, qb), db), sb), sqb) in x
            .chunks_exact(QK)
            .zip(qs.chunks_exact_mut(QK))
            .zip(d.iter_mut())
            .zip(s.iter_mut())
            .zip(sq.iter_mut())
        {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let dv = amax / 127.0;
            let id = if dv != 0.0 { 1.0 / dv } else { 0.0 };
            let mut sum = 0i32;
            for (q, &v) in qb.iter_mut().zip(xb) {
                // `as` saturates (and maps NaN to 0): no UB, no panic.
                let r = (v * id).round() as i32;
                *q = r.clamp(-127, 127) as i8;
                sum += *q as i32;
            }
            *db = dv;
            *sb = sum as f32 * dv;
            *sqb = sum;
        }
    }

    pub(super) fn gemv(dtype: DType, w: &[u8], rb: usize, xq: &Q8Act, y: &mut [f32]) {
        for (yr, row) in y.iter_mut().zip(w.chunks_exact(rb.max(1))) {
            *yr = dot_row(dtype, row, xq);
        }
        if rb == 0 {
            y.fill(0.0);
        }
    }

    /// One-row products per (weight row, activation row): the same
    /// function as the one-row path, so trivially identical to it.
    pub(super) fn gemv_multi(
        dtype: DType,
        w: &[u8],
        rb: usize,
        n_rows: usize,
        xq: &[Q8Act],
        y: &mut [f32],
    ) {
        for (t, x) in xq.iter().enumerate() {
            gemv(dtype, w, rb, x, &mut y[t * n_rows..(t + 1) * n_rows]);
        }
    }

    fn dot_row(dtype: DType, row: &[u8], xq: &Q8Act) -> f32 {
        let mut acc = 0f32;
        let xs = xq.qs.chunks_exact(QK).zip(xq.d.iter().zip(&xq.s));
        match dtype {
            DType::Q4_0 | DType::Q4_1 => {
                let (bs, qoff) = if dtype == DType::Q4_1 {
                    (20, 4)
                } else {
                    (18, 2)
                };
                for (blk, (qx, (&dx, &sx))) in row.chunks_exact(bs).zip(xs) {
                    let mut isum = 0i32;
                    let mut xsum = 0i32;
                    for j in 0..16 {
                        let q = blk[qoff + j];
                        isum += (q & 0xF) as i32 * qx[j] as i32;
                        isum += (q >> 4) as i32 * qx[j + 16] as i32;
                        xsum += qx[j] as i32 + qx[j + 16] as i32;
                    }
                    let dw = f16_at(blk);
                    if dtype == DType::Q4_1 {
                        acc += dw * dx * isum as f32 + f16_at(&blk[2..]) * sx;
                    } else {
                        acc += dw * dx * (isum - 8 * xsum) as f32;
                    }
                }
            }
            DType::Q8_0 => {
                for (blk, (qx, (&dx, _))) in row.chunks_exact(34).zip(xs) {
                    let isum: i32 = blk[2..]
                        .iter()
                        .zip(qx)
                        .map(|(&a, &b)| (a as i8) as i32 * b as i32)
                        .sum();
                    acc += f16_at(blk) * dx * isum as f32;
                }
            }
            _ => unreachable!("checked by gemv_q8"),
        }
        acc
    }
}

/// AVX2 (+FMA, F16C) kernels; also the activation quantizer for every x86
/// SIMD level.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::x86::{PF_DIST, hsum, pf_ahead, prefetch};
    use super::{DType, Q8Act, QK, RowKernel, XPtr, run_multi, run_rows};
    use core::arch::x86_64::*;

    /// The f16 at `p` converted and broadcast to 8 lanes.
    ///
    /// # Safety
    /// `p..p+2` readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn bcast_f16(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 2 readable bytes (unaligned read).
        let h = unsafe { (p as *const u16).read_unaligned() };
        _mm256_cvtph_ps(_mm_set1_epi16(h as i16))
    }

    /// The two f16 at `p` (Q4_1's `d`, `m`) converted into lanes 0 and 1
    /// (lanes 2, 3 are 0).
    ///
    /// # Safety
    /// `p..p+4` readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dm_pair(p: *const u8) -> __m128 {
        // SAFETY: the caller guarantees 4 readable bytes (unaligned read).
        let h = unsafe { (p as *const u32).read_unaligned() };
        _mm_cvtph_ps(_mm_cvtsi32_si128(h as i32))
    }

    /// The 16 nibbles at `p` as 32 unsigned bytes: low nibbles (elements
    /// 0..16) then high nibbles (16..32).
    ///
    /// # Safety
    /// `p..p+16` readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn nibbles(p: *const u8) -> __m256i {
        // SAFETY: the caller guarantees 16 readable bytes (unaligned load).
        let q = unsafe { _mm_loadu_si128(p as *const __m128i) };
        let v = _mm256_set_m128i(_mm_srli_epi16::<4>(q), q);
        _mm256_and_si256(v, _mm256_set1_epi8(0x0F))
    }

    /// Quantizes `nb` blocks of `x` (GGML `quantize_row_q8_1`, bit-identical
    /// to the scalar path for finite input).
    ///
    /// # Safety
    /// AVX2+FMA+F16C available; `x` and `qs` hold `nb * 32` elements, `d`,
    /// `s` and `sq` hold `nb`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantize(
        x: *const f32,
        nb: usize,
        d: *mut f32,
        s: *mut f32,
        sq: *mut i32,
        qs: *mut i8,
    ) {
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        let sign = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
        let half = _mm256_set1_ps(0.5);
        let one = _mm256_set1_ps(1.0);
        let lim = _mm256_set1_ps(127.0);
        let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for b in 0..nb {
            // SAFETY: b < nb: elements b*32 .. b*32+32 of x/qs and entry b
            // of d/s are in bounds (unaligned loads/stores).
            unsafe {
                let xb = x.add(b * QK);
                let v = [
                    _mm256_loadu_ps(xb),
                    _mm256_loadu_ps(xb.add(8)),
                    _mm256_loadu_ps(xb.add(16)),
                    _mm256_loadu_ps(xb.add(24)),
                ];
                let m01 = _mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs));
                let m23 = _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs));
                let m = _mm256_max_ps(m01, m23);
                let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
                let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
                let m = _mm_max_ss(m, _mm_movehdup_ps(m));
                let dv = _mm_cvtss_f32(m) / 127.0;
                let id = if dv != 0.0 { 1.0 / dv } else { 0.0 };
                let idv = _mm256_set1_ps(id);
                let mut ri = [_mm256_setzero_si256(); 4];
                let mut fsum = _mm256_setzero_ps();
                for (r, &vi) in ri.iter_mut().zip(&v) {
                    let t = _mm256_mul_ps(vi, idv);
                    // roundf: truncate, then step away from zero when the
                    // (exact) remainder is >= 0.5.
                    let tr = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(t);
                    let rem = _mm256_and_ps(_mm256_sub_ps(t, tr), abs);
                    let step = _mm256_or_ps(_mm256_and_ps(t, sign), one);
                    let up = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(rem, half), step);
                    let q = _mm256_max_ps(
                        _mm256_min_ps(_mm256_add_ps(tr, up), lim),
                        _mm256_sub_ps(_mm256_setzero_ps(), lim),
                    );
                    fsum = _mm256_add_ps(fsum, q);
                    *r = _mm256_cvtps_epi32(q);
                }
                let p01 = _mm256_packs_epi32(ri[0], ri[1]);
                let p23 = _mm256_packs_epi32(ri[2], ri[3]);
                let packed = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), perm);
                _mm256_storeu_si256(qs.add(b * QK) as *mut __m256i, packed);
                // The sum of 32 integers <= 127 in magnitude is exact in f32.
                let sum = hsum(fsum);
                *d.add(b) = dv;
                *s.add(b) = sum * dv;
                *sq.add(b) = sum as i32;
            }
        }
    }

    /// # Safety
    /// AVX2+FMA+F16C available; `w.len() == y.len() * rb`, `rb` the row
    /// bytes of `nb` blocks of `dtype`; `xq` holds `nb` blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemv(
        dtype: DType,
        w: &[u8],
        rb: usize,
        nb: usize,
        xq: &Q8Act,
        y: &mut [f32],
    ) {
        let (k4, k1) = kernels::<4, 1>(dtype);
        // SAFETY: features and lengths as guaranteed by the caller.
        unsafe { run_rows(w, rb, nb, xq, y, k4, k1) }
    }

    /// # Safety
    /// AVX2+FMA+F16C available; `w.len() == n_rows * rb`, `rb` the row
    /// bytes of `nb` blocks of `dtype`; `y.len() == xq.len() * n_rows`;
    /// every activation holds `nb` blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemv_multi(
        dtype: DType,
        w: &[u8],
        rb: usize,
        nb: usize,
        n_rows: usize,
        xq: &[Q8Act],
        y: &mut [f32],
    ) {
        let pick = |n: usize| super::super::by_n!(n, |N| kernels::<MULTI_R, N>(dtype));
        // SAFETY: features and lengths as guaranteed by the caller.
        unsafe { run_multi(w, rb, nb, n_rows, xq, y, (MULTI_R, MULTI_N), pick) }
    }

    /// Weight rows and most activation rows per multi-row kernel call.
    const MULTI_R: usize = 2;
    const MULTI_N: usize = 4;

    /// The (`R`-row, 1-row) kernels for `N` activation rows; `N == 1`,
    /// `R == 4` are the one-row decode kernels.
    fn kernels<const R: usize, const N: usize>(dtype: DType) -> (RowKernel, RowKernel) {
        match dtype {
            DType::Q4_0 => (q4_rows::<R, N, false>, q4_rows::<1, N, false>),
            DType::Q4_1 => (q4_rows::<R, N, true>, q4_rows::<1, N, true>),
            _ => (q8_rows::<R, N>, q8_rows::<1, N>),
        }
    }

    /// Q4_0 (`Q41 == false`) or Q4_1: `R` weight rows x `N` activation rows.
    ///
    /// # Safety
    /// `R` rows of `nb` blocks at `w` (stride `rb`), `N` activation rows of
    /// `nb` blocks at `x`, outputs `y[n * ys + r]` writable.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_rows<const R: usize, const N: usize, const Q41: bool>(
        w: *const u8,
        rb: usize,
        nb: usize,
        x: *const XPtr,
        y: *mut f32,
        ys: usize,
    ) {
        let (bs, qoff) = if Q41 { (20, 4) } else { (18, 2) };
        let ones = _mm256_set1_epi16(1);
        let eight = _mm256_set1_epi8(8);
        // SAFETY: the caller guarantees N activation rows at `x`.
        let x: [XPtr; N] = core::array::from_fn(|n| unsafe { *x.add(n) });
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        let mut accm = [[_mm_setzero_ps(); N]; R];
        for b in 0..nb {
            // SAFETY: b < nb: activation block b of every row and each
            // weight row's block b (bytes b*bs .. b*bs+bs <= rb) are in
            // bounds.
            unsafe {
                // (Loops, not closures: the intrinsics inline into this
                // function's target features.)
                let mut xq = [_mm256_setzero_si256(); N];
                for (n, v) in xq.iter_mut().enumerate() {
                    *v = _mm256_loadu_si256(x[n].qs.add(b * QK) as *const __m256i);
                }
                // Q4_0: 8 * sum(qx) per 32-bit lane, subtracted from the
                // unsigned-nibble products to give sum((q - 8) * qx).
                let mut bias = [_mm256_setzero_si256(); N];
                if !Q41 {
                    for (v, q) in bias.iter_mut().zip(&xq) {
                        *v = _mm256_madd_epi16(_mm256_maddubs_epi16(eight, *q), ones);
                    }
                }
                for r in 0..R {
                    let p = w.add(r * rb + b * bs);
                    prefetch(p.wrapping_add(pf_ahead(R, rb, nb * bs)));
                    let v = nibbles(p.add(qoff));
                    for n in 0..N {
                        let mut isum = _mm256_madd_epi16(_mm256_maddubs_epi16(v, xq[n]), ones);
                        if !Q41 {
                            isum = _mm256_sub_epi32(isum, bias[n]);
                        }
                        let sc = if Q41 {
                            // [d_x, s_x]: one multiply gives [d_w d_x, m_w s_x].
                            let dxs = _mm_setr_ps(*x[n].d.add(b), *x[n].s.add(b), 0.0, 0.0);
                            let dm = _mm_mul_ps(dm_pair(p), dxs);
                            // Lane 1 accumulates m_w * s_x (lane 0 is unused).
                            accm[r][n] = _mm_add_ps(accm[r][n], dm);
                            _mm256_broadcastss_ps(dm)
                        } else {
                            _mm256_mul_ps(bcast_f16(p), _mm256_set1_ps(*x[n].d.add(b)))
                        };
                        acc[r][n] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(isum), acc[r][n]);
                    }
                }
            }
        }
        for r in 0..R {
            for n in 0..N {
                let v = hsum(acc[r][n]) + _mm_cvtss_f32(_mm_movehdup_ps(accm[r][n]));
                // SAFETY: r < R, n < N: the output is writable.
                unsafe { *y.add(n * ys + r) = v };
            }
        }
    }

    /// Q8_0 (sign trick: `|w|` x `sign(w) * qx`): `R` weight rows x `N`
    /// activation rows.
    ///
    /// # Safety
    /// As for [`q4_rows`].
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_rows<const R: usize, const N: usize>(
        w: *const u8,
        rb: usize,
        nb: usize,
        x: *const XPtr,
        y: *mut f32,
        ys: usize,
    ) {
        let ones = _mm256_set1_epi16(1);
        // SAFETY: the caller guarantees N activation rows at `x`.
        let x: [XPtr; N] = core::array::from_fn(|n| unsafe { *x.add(n) });
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        for b in 0..nb {
            // SAFETY: b < nb: activation block b of every row and each
            // weight row's 34-byte block b are in bounds.
            unsafe {
                // (Loops, not closures: the intrinsics inline into this
                // function's target features.)
                let mut xq = [_mm256_setzero_si256(); N];
                for (n, v) in xq.iter_mut().enumerate() {
                    *v = _mm256_loadu_si256(x[n].qs.add(b * QK) as *const __m256i);
                }
                for r in 0..R {
                    let p = w.add(r * rb + b * 34);
                    prefetch(p.wrapping_add(PF_DIST));
                    let wq = _mm256_loadu_si256(p.add(2) as *const __m256i);
                    let ax = _mm256_sign_epi8(wq, wq);
                    for n in 0..N {
                        let sy = _mm256_sign_epi8(xq[n], wq);
                        let isum = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), ones);
                        let sc = _mm256_mul_ps(bcast_f16(p), _mm256_set1_ps(*x[n].d.add(b)));
                        acc[r][n] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(isum), acc[r][n]);
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
}

/// AVX-512 VNNI kernels (256-bit `vpdpbusd`, AVX-512VL encoding).
#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::super::x86::{PF_DIST, hsum, pf_ahead, prefetch};
    use super::avx2::{bcast_f16, dm_pair, nibbles};
    use super::{DType, Q8Act, QK, RowKernel, XPtr, run_multi, run_rows};
    use core::arch::x86_64::*;

    /// # Safety
    /// AVX-512 F/BW/VL/VNNI + AVX2/FMA/F16C available; `w.len() == y.len() *
    /// rb`, `rb` the row bytes of `nb` blocks of `dtype`; `xq` holds `nb`
    /// blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn gemv(
        dtype: DType,
        w: &[u8],
        rb: usize,
        nb: usize,
        xq: &Q8Act,
        y: &mut [f32],
    ) {
        let (k4, k1) = kernels::<4, 1>(dtype);
        // SAFETY: features and lengths as guaranteed by the caller.
        unsafe { run_rows(w, rb, nb, xq, y, k4, k1) }
    }

    /// # Safety
    /// AVX-512 F/BW/VL/VNNI + AVX2/FMA/F16C available; `w.len() == n_rows *
    /// rb`, `rb` the row bytes of `nb` blocks of `dtype`; `y.len() ==
    /// xq.len() * n_rows`; every activation holds `nb` blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn gemv_multi(
        dtype: DType,
        w: &[u8],
        rb: usize,
        nb: usize,
        n_rows: usize,
        xq: &[Q8Act],
        y: &mut [f32],
    ) {
        let pick = |n: usize| super::super::by_n!(n, |N| kernels::<MULTI_R, N>(dtype));
        // SAFETY: features and lengths as guaranteed by the caller.
        unsafe { run_multi(w, rb, nb, n_rows, xq, y, (MULTI_R, MULTI_N), pick) }
    }

    /// Weight rows and most activation rows per multi-row kernel call.
    const MULTI_R: usize = 2;
    const MULTI_N: usize = 6;

    /// The (`R`-row, 1-row) kernels for `N` activation rows; `N == 1`,
    /// `R == 4` are the one-row decode kernels.
    fn kernels<const R: usize, const N: usize>(dtype: DType) -> (RowKernel, RowKernel) {
        match dtype {
            DType::Q4_0 => (q4_rows::<R, N, false>, q4_rows::<1, N, false>),
            DType::Q4_1 => (q4_rows::<R, N, true>, q4_rows::<1, N, true>),
            _ => (q8_rows::<R, N>, q8_rows::<1, N>),
        }
    }

    /// Q4_0 (`Q41 == false`) or Q4_1: `R` weight rows x `N` activation rows.
    ///
    /// # Safety
    /// `R` rows of `nb` blocks at `w` (stride `rb`), `N` activation rows of
    /// `nb` blocks at `x`, outputs `y[n * ys + r]` writable.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q4_rows<const R: usize, const N: usize, const Q41: bool>(
        w: *const u8,
        rb: usize,
        nb: usize,
        x: *const XPtr,
        y: *mut f32,
        ys: usize,
    ) {
        let (bs, qoff) = if Q41 { (20, 4) } else { (18, 2) };
        let zero = _mm256_setzero_si256();
        let eight = _mm256_set1_epi8(8);
        // SAFETY: the caller guarantees N activation rows at `x`.
        let x: [XPtr; N] = core::array::from_fn(|n| unsafe { *x.add(n) });
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        let mut accm = [[_mm_setzero_ps(); N]; R];
        for b in 0..nb {
            // SAFETY: b < nb: activation block b of every row and each
            // weight row's block b (bytes b*bs .. b*bs+bs <= rb) are in
            // bounds.
            unsafe {
                // (Loops, not closures: the intrinsics inline into this
                // function's target features.)
                let mut xq = [_mm256_setzero_si256(); N];
                for (n, v) in xq.iter_mut().enumerate() {
                    *v = _mm256_loadu_si256(x[n].qs.add(b * QK) as *const __m256i);
                }
                // Q4_0: start every integer sum at -8 * sum(qx) (per lane),
                // so it ends as sum((q - 8) * qx).
                let mut start = [zero; N];
                if !Q41 {
                    for (v, q) in start.iter_mut().zip(&xq) {
                        *v = _mm256_sub_epi32(zero, _mm256_dpbusd_epi32(zero, eight, *q));
                    }
                }
                for r in 0..R {
                    let p = w.add(r * rb + b * bs);
                    prefetch(p.wrapping_add(pf_ahead(R, rb, nb * bs)));
                    let v = nibbles(p.add(qoff));
                    for n in 0..N {
                        let isum = _mm256_dpbusd_epi32(start[n], v, xq[n]);
                        let sc = if Q41 {
                            // [d_x, s_x]: one multiply gives [d_w d_x, m_w s_x].
                            let dxs = _mm_setr_ps(*x[n].d.add(b), *x[n].s.add(b), 0.0, 0.0);
                            let dm = _mm_mul_ps(dm_pair(p), dxs);
                            // Lane 1 accumulates m_w * s_x (lane 0 is unused).
                            accm[r][n] = _mm_add_ps(accm[r][n], dm);
                            _mm256_broadcastss_ps(dm)
                        } else {
                            _mm256_mul_ps(bcast_f16(p), _mm256_set1_ps(*x[n].d.add(b)))
                        };
                        acc[r][n] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(isum), acc[r][n]);
                    }
                }
            }
        }
        for r in 0..R {
            for n in 0..N {
                let v = hsum(acc[r][n]) + _mm_cvtss_f32(_mm_movehdup_ps(accm[r][n]));
                // SAFETY: r < R, n < N: the output is writable.
                unsafe { *y.add(n * ys + r) = v };
            }
        }
    }

    /// Q8_0: `sum(w * qx) = sum((w + 128) * qx) - 128 * sum(qx)`, with
    /// `w + 128 = w ^ 0x80` as an unsigned byte and the bias shared by rows.
    ///
    /// # Safety
    /// As for [`q4_rows`].
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q8_rows<const R: usize, const N: usize>(
        w: *const u8,
        rb: usize,
        nb: usize,
        x: *const XPtr,
        y: *mut f32,
        ys: usize,
    ) {
        let zero = _mm256_setzero_si256();
        let off = _mm256_set1_epi8(i8::MIN);
        // SAFETY: the caller guarantees N activation rows at `x`.
        let x: [XPtr; N] = core::array::from_fn(|n| unsafe { *x.add(n) });
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        for b in 0..nb {
            // SAFETY: b < nb: activation block b of every row and each
            // weight row's 34-byte block b are in bounds.
            unsafe {
                // (Loops, not closures: the intrinsics inline into this
                // function's target features.)
                let mut xq = [_mm256_setzero_si256(); N];
                for (n, v) in xq.iter_mut().enumerate() {
                    *v = _mm256_loadu_si256(x[n].qs.add(b * QK) as *const __m256i);
                }
                // 0x80 as unsigned is 128: start = -128 * sum(qx) per lane.
                let mut start = [zero; N];
                for (v, q) in start.iter_mut().zip(&xq) {
                    *v = _mm256_sub_epi32(zero, _mm256_dpbusd_epi32(zero, off, *q));
                }
                for r in 0..R {
                    let p = w.add(r * rb + b * 34);
                    prefetch(p.wrapping_add(PF_DIST));
                    let wq = _mm256_loadu_si256(p.add(2) as *const __m256i);
                    let wx = _mm256_xor_si256(wq, off);
                    for n in 0..N {
                        let isum = _mm256_dpbusd_epi32(start[n], wx, xq[n]);
                        let sc = _mm256_mul_ps(bcast_f16(p), _mm256_set1_ps(*x[n].d.add(b)));
                        acc[r][n] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(isum), acc[r][n]);
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
}

#[cfg(test)]
mod tests {
    use super::super::tests::{Rng, put_f16};
    use super::super::{gemv_with, supported_levels};
    use super::*;

    const DTYPES: [DType; 3] = [DType::Q4_0, DType::Q4_1, DType::Q8_0];

    fn random_weights(rng: &mut Rng, dtype: DType, k: usize, rows: usize) -> Vec<u8> {
        let mut w = Vec::with_capacity(rows * row_bytes(dtype, k));
        for _ in 0..rows * (k / QK) {
            put_f16(&mut w, rng.scale());
            if dtype == DType::Q4_1 {
                put_f16(&mut w, rng.scale());
            }
            let nq = if dtype == DType::Q8_0 { 32 } else { 16 };
            (0..nq).for_each(|_| w.push(rng.byte()));
        }
        w
    }

    /// Activations with varied per-block magnitudes (incl. an all-zero block).
    fn random_x(rng: &mut Rng, k: usize) -> Vec<f32> {
        let mut x = vec![0f32; k];
        for (b, xb) in x.chunks_exact_mut(QK).enumerate() {
            let mag = match b % 5 {
                0 => 1.0,
                1 => 30.0,
                2 => 1e-3,
                3 if b % 3 == 0 => 0.0,
                _ => 4.0,
            };
            xb.iter_mut().for_each(|v| *v = rng.unit() * mag);
        }
        x
    }

    /// Exact (f64) dequantization of one weight row.
    fn dequant_f64(dtype: DType, row: &[u8]) -> Vec<f64> {
        let f = |b: &[u8]| f16_at(b) as f64;
        let mut out = Vec::new();
        for blk in row.chunks_exact(dtype.block_bytes()) {
            match dtype {
                DType::Q4_0 => {
                    let mut e = [0f64; 32];
                    for j in 0..16 {
                        e[j] = f(blk) * ((blk[2 + j] & 0xF) as f64 - 8.0);
                        e[j + 16] = f(blk) * ((blk[2 + j] >> 4) as f64 - 8.0);
                    }
                    out.extend(e);
                }
                DType::Q4_1 => {
                    let mut e = [0f64; 32];
                    for j in 0..16 {
                        e[j] = f(blk) * (blk[4 + j] & 0xF) as f64 + f(&blk[2..]);
                        e[j + 16] = f(blk) * (blk[4 + j] >> 4) as f64 + f(&blk[2..]);
                    }
                    out.extend(e);
                }
                _ => out.extend(blk[2..].iter().map(|&q| f(blk) * (q as i8) as f64)),
            }
        }
        out
    }

    /// Per row: (dot(W row, dequant(xq)), sum |w| |xq|) in f64.
    fn reference(dtype: DType, w: &[u8], k: usize, rows: usize, xq: &Q8Act) -> Vec<(f64, f64)> {
        let rb = row_bytes(dtype, k);
        let xd: Vec<f64> = xq
            .qs
            .iter()
            .enumerate()
            .map(|(i, &q)| xq.d[i / QK] as f64 * q as f64)
            .collect();
        (0..rows)
            .map(|r| {
                let wd = dequant_f64(dtype, &w[r * rb..(r + 1) * rb]);
                let dot = wd.iter().zip(&xd).map(|(a, b)| a * b).sum();
                let mag = wd.iter().zip(&xd).map(|(a, b)| (a * b).abs()).sum();
                (dot, mag)
            })
            .collect()
    }

    fn kerns() -> Vec<Kern> {
        let mut v: Vec<Kern> = supported_levels().into_iter().map(kern_for).collect();
        v.dedup();
        v
    }

    #[test]
    fn q8act_quantize_known_values() {
        for kern in kerns() {
            let mut xq = Q8Act::new();
            // Block 0: all zeros. Block 1: amax 2.54. Block 2: amax 127
            // (d = 1) with exact halves to check rounding.
            let mut x = vec![0f32; 96];
            x[32] = 2.54;
            x[33] = -1.27;
            x[34] = 0.01;
            x[35] = -0.03; // -1.5 -> -2
            let halves = [
                2.5f32, -2.5, 0.5, -0.5, 1.5, -1.5, 126.5, -126.5, 0.49, -0.49, 127.0,
            ];
            x[64..64 + halves.len()].copy_from_slice(&halves);
            xq.quantize_with(kern, &x);
            let name = kern.name();
            assert_eq!(xq.d[0], 0.0, "{name}");
            assert_eq!(xq.s[0], 0.0, "{name}");
            assert!(xq.qs[..32].iter().all(|&q| q == 0), "{name}");
            assert_eq!(xq.d[1], 2.54f32 / 127.0, "{name}");
            assert!((xq.d[1] - 0.02).abs() < 1e-8, "{name}");
            assert_eq!(
                &xq.qs[32..36],
                &[127, -64, 1, -2],
                "{name}: {:?}",
                &xq.qs[32..36]
            );
            assert!(xq.qs[36..64].iter().all(|&q| q == 0), "{name}");
            assert_eq!(xq.s[1], 62.0 * xq.d[1], "{name}");
            assert_eq!(xq.sq[..3], [0, 62, 127], "{name}");
            assert_eq!(xq.d[2], 1.0, "{name}");
            let want: [i8; 11] = [3, -3, 1, -1, 2, -2, 127, -127, 0, 0, 127];
            assert_eq!(&xq.qs[64..75], &want, "{name}");
            assert_eq!(
                xq.s[2],
                3.0 - 3.0 + 1.0 - 1.0 + 2.0 - 2.0 + 127.0 - 127.0 + 127.0
            );
            assert!(xq.d.iter().chain(&xq.s).all(|v| v.is_finite()), "{name}");
            // Reuse with a shorter input shrinks the buffers.
            xq.quantize_with(kern, &x[..32]);
            assert_eq!((xq.k(), xq.d.len(), xq.s.len()), (32, 1, 1));
            xq.quantize_with(kern, &[]);
            assert_eq!(xq.k(), 0);
        }
    }

    #[test]
    fn q8act_quantize_levels_bit_identical() {
        let mut rng = Rng(99);
        for k in [32, 64, 576, 2048] {
            let x = random_x(&mut rng, k);
            let mut want = Q8Act::new();
            want.quantize_with(Kern::Scalar, &x);
            for kern in kerns() {
                let mut got = Q8Act::new();
                got.quantize_with(kern, &x);
                assert_eq!(got.qs, want.qs, "{} k={k}", kern.name());
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got.d), bits(&want.d), "{} k={k}", kern.name());
                assert_eq!(bits(&got.s), bits(&want.s), "{} k={k}", kern.name());
                assert_eq!(got.sq, want.sq, "{} k={k}", kern.name());
            }
            // Every value within half a step of x, qs in -127..=127.
            for (i, (&q, &xv)) in want.qs.iter().zip(&x).enumerate() {
                let d = want.d[i / QK];
                assert!(q != i8::MIN);
                assert!((q as f32 * d - xv).abs() <= 0.5 * d * 1.0001 + 1e-30);
            }
        }
    }

    #[test]
    fn q8act_gemv_matches_reference_all_kernels() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let ks = [32, 64, 576, 1536, 2048];
        let kerns = kerns();
        eprintln!("q8act kernels tested: {:?}", kerns);
        let mut worst = 0f64;
        for &kern in &kerns {
            for dtype in DTYPES {
                for k in ks {
                    for rows in [1, 3, 7, 130] {
                        let w = random_weights(&mut rng, dtype, k, rows);
                        let x = random_x(&mut rng, k);
                        let mut xq = Q8Act::new();
                        xq.quantize_with(kern, &x);
                        let want = reference(dtype, &w, k, rows, &xq);
                        let mut y = vec![f32::NAN; rows];
                        gemv_q8_with(kern, dtype, &w, k, &xq, &mut y);
                        for (r, (&got, &(dot, mag))) in y.iter().zip(&want).enumerate() {
                            let err = (got as f64 - dot).abs();
                            if mag > 0.0 {
                                worst = worst.max(err / mag);
                            }
                            assert!(
                                err <= 1e-6 * mag + 1e-30,
                                "{} {dtype} k={k} rows={rows} r={r}: got {got}, want {dot} \
                                 (err {err:e}, sum|w||xq| {mag:e})",
                                kern.name()
                            );
                        }
                    }
                }
            }
        }
        eprintln!("q8act worst |err| / sum|w||xq|: {worst:.2e} (bound 1e-6)");
    }

    /// Multi-row products with quantized activations equal one-row
    /// products bit for bit: every kernel family, R = 2, 3, 5, 8, 16
    /// activation rows, weight-row counts with tails.
    #[test]
    fn q8act_multi_bit_identical_to_one_row() {
        let mut rng = Rng(0xC0FF_EE06);
        let mut checked = 0usize;
        for kern in kerns() {
            for dtype in DTYPES {
                for k in [32, 96, 576, 1536] {
                    for n_rows in [1, 3, 5, 9] {
                        let w = random_weights(&mut rng, dtype, k, n_rows);
                        for n_x in [2, 3, 5, 8, 16] {
                            let xq: Vec<Q8Act> = (0..n_x)
                                .map(|_| {
                                    let mut q = Q8Act::new();
                                    q.quantize_with(kern, &random_x(&mut rng, k));
                                    q
                                })
                                .collect();
                            let mut y = vec![f32::NAN; n_x * n_rows];
                            gemv_q8_multi_with(kern, dtype, &w, k, n_rows, &xq, &mut y);
                            for (t, x) in xq.iter().enumerate() {
                                let mut y1 = vec![f32::NAN; n_rows];
                                gemv_q8_with(kern, dtype, &w, k, x, &mut y1);
                                for r in 0..n_rows {
                                    let got = y[t * n_rows + r];
                                    assert_eq!(
                                        got.to_bits(),
                                        y1[r].to_bits(),
                                        "{} {dtype} k={k} rows={n_rows} n_x={n_x} t={t} r={r}: \
                                         multi {got:e} vs one-row {:e}",
                                        kern.name(),
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
        eprintln!("gemv_q8_multi: {checked} outputs bit-identical to one-row products");
    }

    #[test]
    fn q8act_public_entry_and_edge_cases() {
        let mut rng = Rng(5);
        for dtype in DTYPES {
            assert!(supports_q8(dtype));
            // Extra weight bytes beyond y.len() rows are ignored.
            let k = 64;
            let w = random_weights(&mut rng, dtype, k, 9);
            let x = random_x(&mut rng, k);
            let mut xq = Q8Act::new();
            xq.quantize(&x);
            let want = reference(dtype, &w, k, 5, &xq);
            let mut y = vec![0f32; 5];
            gemv_q8(dtype, &w, k, &xq, &mut y);
            for (g, (d, m)) in y.iter().zip(want) {
                assert!((*g as f64 - d).abs() <= 1e-6 * m + 1e-30);
            }
            for kern in kerns() {
                // k = 0 and no rows.
                let empty = Q8Act::new();
                let mut y = vec![f32::NAN; 3];
                gemv_q8_with(kern, dtype, &[], 0, &empty, &mut y);
                assert_eq!(y, [0.0; 3]);
                gemv_q8_with(kern, dtype, &[], 64, &xq, &mut []);
                // Zero activations give exactly zero.
                let mut z = Q8Act::new();
                z.quantize_with(kern, &[0.0; 64]);
                let mut y = vec![f32::NAN; 9];
                gemv_q8_with(kern, dtype, &w, k, &z, &mut y);
                assert!(
                    y.iter().all(|&v| v == 0.0),
                    "{} {dtype}: {y:?}",
                    kern.name()
                );
            }
        }
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            assert!(!supports_q8(dtype));
        }
    }

    #[test]
    #[should_panic(expected = "unsupported dtype")]
    fn q8act_rejects_float_dtypes() {
        let mut y = [0f32; 1];
        gemv_q8(DType::F32, &[0; 128], 32, &Q8Act::new(), &mut y);
    }

    #[test]
    #[should_panic(expected = "activations hold")]
    fn q8act_rejects_wrong_k() {
        let mut xq = Q8Act::new();
        xq.quantize(&[1.0; 32]);
        let mut y = [0f32; 1];
        gemv_q8(DType::Q8_0, &[0; 68], 64, &xq, &mut y);
    }

    /// Quantization error of the q8-activation path against the exact
    /// f32-activation GEMV (reported, not asserted).
    #[test]
    fn q8act_quantization_error_report() {
        let mut rng = Rng(2024);
        let (rows, k) = (256, 1536);
        for dtype in DTYPES {
            let w = random_weights(&mut rng, dtype, k, rows);
            // Gaussian-ish activations (sum of uniforms), like hidden states.
            let x: Vec<f32> = (0..k)
                .map(|_| (0..4).map(|_| rng.unit()).sum::<f32>())
                .collect();
            let mut exact = vec![0f32; rows];
            gemv_with(Level::Scalar, dtype, &w, k, &x, &mut exact);
            let mut xq = Q8Act::new();
            xq.quantize(&x);
            let mut y = vec![0f32; rows];
            gemv_q8(dtype, &w, k, &xq, &mut y);
            let (mut num, mut den, mut max_rel) = (0f64, 0f64, 0f64);
            for (a, b) in y.iter().zip(&exact) {
                let e = (*a as f64 - *b as f64).abs();
                num += e * e;
                den += (*b as f64) * (*b as f64);
                max_rel = max_rel.max(e / (*b as f64).abs().max(1e-30));
            }
            let rms_y = (den / rows as f64).sqrt();
            let max_abs = y
                .iter()
                .zip(&exact)
                .map(|(a, b)| (*a as f64 - *b as f64).abs())
                .fold(0.0, f64::max);
            eprintln!(
                "q8act quantization error {dtype} {rows}x{k}: relative L2 {:.3e}, \
                 max |err| / rms(y) {:.3e}",
                (num / den).sqrt(),
                max_abs / rms_y
            );
            let _ = max_rel;
        }
    }
}
