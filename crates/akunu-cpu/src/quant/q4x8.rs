//! Q4_0 weights repacked 8 rows at a time for the 8-bit-activation GEMV
//! ([`super::q8act`]): one output row per 32-bit lane.
//!
//! The plain Q4_0 kernel reduces every (row, block) integer sum into 8
//! lanes of one row, then pays a per-row f16 scale broadcast, an int→float
//! conversion, an FMA and the `-8 * sum(qx)` bias for each row and block,
//! and a horizontal sum per row at the end. With 8 rows interleaved so
//! that lane `j` of every vector belongs to row `j`, the integer sums of 8
//! rows end in the 8 lanes of one vector, and the scale (8 f16 in one
//! 16-byte load), bias, conversion and FMA are paid once per 8 rows.
//!
//! Layout ([`repack`]): rows are grouped by 8 (`n_rows / 8` groups; the
//! `n_rows % 8` tail rows stay in the plain layout after the groups, so a
//! repacked tensor has the plain tensor's size and every group starts at
//! its first row's plain offset). A group holds its `nb` blocks in order,
//! 144 bytes each:
//! * bytes 0..16: the 8 rows' f16 scales `d_0 .. d_7`;
//! * bytes 16 + 32 l .. 48 + 32 l (`l < 4`): for each row `j`, bytes
//!   `4 l .. 4 l + 4` of its 16 nibble bytes, at `16 + 32 l + 4 j`.
//!
//! A plain byte `m` holds element `m` (low nibble) and `m + 16` (high
//! nibble), so vector `l` masked to its low nibbles holds elements
//! `4 l .. 4 l + 4` of every row (lane `j`: row `j`), and its high nibbles
//! elements `16 + 4 l ..`: each is multiplied (`vpmaddubsw`) by the
//! activation's matching 4 bytes broadcast to all lanes. The 8 products
//! per block are added as i16 (each pair sum is at most `2 * 15 * 127`,
//! the 8 sums at most 30480 < 32767, so nothing saturates), widened by
//! one `vpmaddwd`, and the shared bias `8 * sum(qx)` (an integer kept
//! with the activations, [`Q8Act::sq`]) is subtracted: lane `j` holds row
//! `j`'s exact `sum((q - 8) * qx)`. Then, per block,
//! `acc = fma(d_w * d_x, float(isum), acc)` in 8 lanes: row `j`'s sum is
//! an FMA chain over its blocks in block order, with no horizontal sum.
//!
//! The multi-row kernels (speculative verification) run the same
//! operations per activation row on the same weight vectors, so every
//! output equals the one-row product bit for bit.

use super::q8act::{Kern, Q8Act, check_act, gemv_q8_multi_with, gemv_q8_with, kern_for};
use super::{QK, f16_at, row_bytes};
use akunu_core::dtype::DType;

/// Bytes of one block of an 8-row group (8 f16 scales, 8 x 16 nibble bytes).
const GB: usize = 8 * 18;

/// Whether the repacked layout has a SIMD kernel at this CPU's level (the
/// backend repacks only then; the scalar kernel exists for tests).
pub fn enabled() -> bool {
    kern_for(super::level()) != Kern::Scalar
}

/// `n_rows` plain Q4_0 rows of `k` elements (`src`, at least `n_rows *
/// row_bytes` bytes) in the row-interleaved layout (see the module doc).
pub fn repack(src: &[u8], k: usize, n_rows: usize) -> Vec<u8> {
    assert!(k.is_multiple_of(QK), "q4x8::repack: k = {k}");
    let rb = row_bytes(DType::Q4_0, k);
    let nb = k / QK;
    let len = rb.checked_mul(n_rows).expect("q4x8::repack: size overflow");
    assert!(src.len() >= len, "q4x8::repack: source too short");
    let mut out = vec![0u8; len];
    let groups = n_rows / 8;
    for g in 0..groups {
        let (gs, gd) = (&src[g * 8 * rb..], &mut out[g * 8 * rb..(g + 1) * 8 * rb]);
        for (b, dst) in gd.chunks_exact_mut(GB).enumerate() {
            for j in 0..8 {
                let blk = &gs[j * rb + b * 18..j * rb + b * 18 + 18];
                dst[2 * j..2 * j + 2].copy_from_slice(&blk[..2]);
                for l in 0..4 {
                    let at = 16 + 32 * l + 4 * j;
                    dst[at..at + 4].copy_from_slice(&blk[2 + 4 * l..6 + 4 * l]);
                }
            }
        }
        debug_assert_eq!(gd.len(), nb * GB);
    }
    out[groups * 8 * rb..].copy_from_slice(&src[groups * 8 * rb..len]);
    out
}

/// [`super::gemv_q8`] of Q4_0 weights in the repacked layout: `w` holds
/// `y.len()` rows as [`repack`] wrote them (groups of 8, then the tail in
/// the plain layout).
pub fn gemv(w: &[u8], k: usize, xq: &Q8Act, y: &mut [f32]) {
    gemv_with(kern_for(super::level()), w, k, xq, y)
}

/// [`super::gemv_q8_multi`] of Q4_0 weights in the repacked layout:
/// `y[t * n_rows + r]`, each bit-identical to [`gemv`] of `xq[t]`.
pub fn gemv_multi(w: &[u8], k: usize, n_rows: usize, xq: &[Q8Act], y: &mut [f32]) {
    gemv_multi_with(kern_for(super::level()), w, k, n_rows, xq, y)
}

pub(crate) fn gemv_with(kern: Kern, w: &[u8], k: usize, xq: &Q8Act, y: &mut [f32]) {
    let n = y.len();
    gemv_multi_with(kern, w, k, n, core::slice::from_ref(xq), y)
}

pub(crate) fn gemv_multi_with(
    kern: Kern,
    w: &[u8],
    k: usize,
    n_rows: usize,
    xq: &[Q8Act],
    y: &mut [f32],
) {
    let rb = row_bytes(DType::Q4_0, k);
    let nb = k / QK;
    for x in xq {
        check_act("q4x8::gemv", x, k);
    }
    let n_x = xq.len();
    assert_eq!(
        y.len(),
        n_rows.checked_mul(n_x).expect("q4x8::gemv: size overflow"),
        "q4x8::gemv: y length"
    );
    let need = rb.checked_mul(n_rows).expect("q4x8::gemv: size overflow");
    assert!(w.len() >= need, "q4x8::gemv: weight buffer too short");
    let groups = n_rows / 8;
    let tail = n_rows - 8 * groups;
    if n_x == 0 || n_rows == 0 {
        return;
    }
    if rb == 0 {
        y.fill(0.0);
        return;
    }
    match kern {
        Kern::Scalar => scalar::gemv(w, rb, nb, groups, n_rows, xq, y),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Kern::Avx2`/`Kern::Vnni` imply AVX2+FMA+F16C; `w` holds
        // `groups` groups of `nb` blocks (`8 * rb` bytes each); every
        // activation holds `nb` blocks; `y` holds `n_x * n_rows` outputs.
        Kern::Avx2 | Kern::Vnni => unsafe { avx2::gemv(w, rb, nb, groups, n_rows, xq, y) },
    }
    // The tail rows, plain layout: the plain q8 kernels (whose multi-row
    // instances equal their one-row instances bit for bit).
    if tail > 0 {
        let wt = &w[8 * groups * rb..need];
        if n_x == 1 {
            gemv_q8_with(kern, DType::Q4_0, wt, k, &xq[0], &mut y[8 * groups..]);
        } else {
            let mut yt = vec![0f32; tail * n_x];
            gemv_q8_multi_with(kern, DType::Q4_0, wt, k, tail, xq, &mut yt);
            for t in 0..n_x {
                y[t * n_rows + 8 * groups..(t + 1) * n_rows]
                    .copy_from_slice(&yt[t * tail..(t + 1) * tail]);
            }
        }
    }
}

mod scalar {
    use super::{GB, Q8Act, QK, f16_at};

    /// The groups of 8 rows, one activation row at a time (the same
    /// function for every activation row: trivially identical).
    pub(super) fn gemv(
        w: &[u8],
        rb: usize,
        nb: usize,
        groups: usize,
        n_rows: usize,
        xq: &[Q8Act],
        y: &mut [f32],
    ) {
        for (t, x) in xq.iter().enumerate() {
            for g in 0..groups {
                let gw = &w[g * 8 * rb..(g + 1) * 8 * rb];
                let mut acc = [0f32; 8];
                for b in 0..nb {
                    let blk = &gw[b * GB..(b + 1) * GB];
                    let qx = &x.qs[b * QK..(b + 1) * QK];
                    for (j, a) in acc.iter_mut().enumerate() {
                        let mut isum = 0i32;
                        for l in 0..4 {
                            for i in 0..4 {
                                let q = blk[16 + 32 * l + 4 * j + i];
                                let e = 4 * l + i;
                                isum += (q & 0xF) as i32 * qx[e] as i32;
                                isum += (q >> 4) as i32 * qx[e + 16] as i32;
                            }
                        }
                        isum -= 8 * x.sq[b];
                        *a += f16_at(&blk[2 * j..]) * x.d[b] * isum as f32;
                    }
                }
                y[t * n_rows + 8 * g..t * n_rows + 8 * g + 8].copy_from_slice(&acc);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::x86::{PF_DIST, prefetch};

    /// Software prefetch distance of the repacked stream. A thread reads
    /// its rows as one dense sequential stream; at the plain kernels'
    /// 1 KiB (one line per block) the default model decoded at 273 tok/s
    /// in the profile example, with every line of a block 1 KiB ahead 323,
    /// 1.5 KiB 297–317, 2–4 KiB 321–360, 6–8 KiB 320–324 (2 threads,
    /// shared machine).
    const PF_X8: usize = 3 * PF_DIST;
    use super::{GB, Q8Act, QK};
    use core::arch::x86_64::*;

    /// Raw pointers into a [`Q8Act`].
    #[derive(Clone, Copy)]
    struct XPtr {
        d: *const f32,
        sq: *const i32,
        qs: *const i8,
    }

    /// Most activation rows per kernel call (2 accumulators per row plus
    /// the group's weight vectors fit the 16 registers).
    const MAX_N: usize = 4;

    type GroupKernel = unsafe fn(*const u8, usize, *const XPtr, *mut f32, usize);

    /// Groups in order; for each group, every chunk of activation rows
    /// (at most [`MAX_N`]) while the group's bytes are in L1.
    ///
    /// # Safety
    /// AVX2+FMA+F16C available; `w` holds `groups` groups of `nb` blocks
    /// (`8 * rb` bytes each); every activation holds `nb` blocks; `y` holds
    /// `xq.len() * n_rows` outputs and `8 * groups <= n_rows`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemv(
        w: &[u8],
        rb: usize,
        nb: usize,
        groups: usize,
        n_rows: usize,
        xq: &[Q8Act],
        y: &mut [f32],
    ) {
        let xs: Vec<XPtr> = xq
            .iter()
            .map(|x| XPtr {
                d: x.d.as_ptr(),
                sq: x.sq.as_ptr(),
                qs: x.qs.as_ptr(),
            })
            .collect();
        let pick =
            |n: usize| -> GroupKernel { super::super::by_n!(n, |N| group::<N> as GroupKernel) };
        let chunks = super::super::multi_chunks(xs.len(), MAX_N, pick);
        let (wp, yp) = (w.as_ptr(), y.as_mut_ptr());
        for g in 0..groups {
            for &(t0, kern) in chunks.iter() {
                // SAFETY: group g (bytes g*8*rb .. (g+1)*8*rb) lies within
                // `w`; activation rows t0.. of the chunk are in `xs`;
                // outputs (t, 8g..8g+8) at y[t * n_rows + 8g ..] lie within
                // `y` (8g + 8 <= n_rows).
                unsafe {
                    kern(
                        wp.add(g * 8 * rb),
                        nb,
                        xs.as_ptr().add(t0),
                        yp.add(t0 * n_rows + 8 * g),
                        n_rows,
                    )
                }
            }
        }
    }

    /// One group of 8 rows x `N` activation rows: outputs (input `n`, row
    /// `j`) to `y[n * ys + j]`.
    ///
    /// # Safety
    /// AVX2+FMA+F16C available; `nb` blocks of 144 bytes at `w`, `N`
    /// activation rows of `nb` blocks at `x`; outputs writable.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn group<const N: usize>(
        w: *const u8,
        nb: usize,
        x: *const XPtr,
        y: *mut f32,
        ys: usize,
    ) {
        let m4 = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        // SAFETY: the caller guarantees N activation rows at `x`.
        let x: [XPtr; N] = core::array::from_fn(|n| unsafe { *x.add(n) });
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..nb {
            // SAFETY: b < nb: the group's block b (144 bytes at b * GB) and
            // block b of every activation row are in bounds; the loads
            // are unaligned.
            unsafe {
                let p = w.add(b * GB);
                // Every cache line of the block PF_X8 bytes ahead (a block
                // spans 2.25 lines; 3 hints cover all of them).
                prefetch(p.wrapping_add(PF_X8));
                prefetch(p.wrapping_add(PF_X8 + 64));
                prefetch(p.wrapping_add(PF_X8 + 128));
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                let mut s16 = [_mm256_setzero_si256(); N];
                for l in 0..4 {
                    let v = _mm256_loadu_si256(p.add(16 + 32 * l) as *const __m256i);
                    let lo = _mm256_and_si256(v, m4);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                    for n in 0..N {
                        let xb = x[n].qs.add(b * QK);
                        let xl = (xb.add(4 * l) as *const i32).read_unaligned();
                        let xh = (xb.add(16 + 4 * l) as *const i32).read_unaligned();
                        let t = _mm256_add_epi16(
                            _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xl)),
                            _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xh)),
                        );
                        s16[n] = _mm256_add_epi16(s16[n], t);
                    }
                }
                for n in 0..N {
                    let bias = _mm256_set1_epi32(8 * *x[n].sq.add(b));
                    let isum = _mm256_sub_epi32(_mm256_madd_epi16(s16[n], ones), bias);
                    let sc = _mm256_mul_ps(dw, _mm256_set1_ps(*x[n].d.add(b)));
                    acc[n] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(isum), acc[n]);
                }
            }
        }
        for n in 0..N {
            // SAFETY: outputs y[n * ys .. n * ys + 8] are writable.
            unsafe { _mm256_storeu_ps(y.add(n * ys), acc[n]) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::q8act::gemv_q8_with;
    use super::super::supported_levels;
    use super::super::tests::{Rng, put_f16};
    use super::*;

    fn kerns() -> Vec<Kern> {
        let mut v: Vec<Kern> = supported_levels().into_iter().map(kern_for).collect();
        v.dedup();
        v
    }

    fn weights(rng: &mut Rng, k: usize, rows: usize) -> Vec<u8> {
        let mut w = Vec::new();
        for _ in 0..rows * (k / QK) {
            put_f16(&mut w, rng.scale());
            (0..16).for_each(|_| w.push(rng.byte()));
        }
        w
    }

    fn act(rng: &mut Rng, kern: Kern, k: usize) -> Q8Act {
        let x: Vec<f32> = (0..k)
            .map(|i| rng.unit() * if i % 64 < 32 { 1.0 } else { 20.0 })
            .collect();
        let mut q = Q8Act::new();
        q.quantize_with(kern, &x);
        q
    }

    /// The repacked product equals the plain one up to f32 rounding (the
    /// integer block sums are exact in both; only the order of the f32
    /// sums differs), at every level; the tail rows are the plain kernel's
    /// exactly.
    #[test]
    fn q4x8_matches_plain_q8_kernel() {
        let mut rng = Rng(0x4A8);
        for kern in kerns() {
            for k in [32, 64, 576, 1536] {
                for rows in [1, 7, 8, 9, 16, 21, 64] {
                    let w = weights(&mut rng, k, rows);
                    let p = repack(&w, k, rows);
                    assert_eq!(p.len(), w.len());
                    let xq = act(&mut rng, kern, k);
                    let mut want = vec![f32::NAN; rows];
                    gemv_q8_with(kern, DType::Q4_0, &w, k, &xq, &mut want);
                    let mut got = vec![f32::NAN; rows];
                    gemv_with(kern, &p, k, &xq, &mut got);
                    // |w| |x| bound of the row, for the tolerance.
                    let rb = row_bytes(DType::Q4_0, k);
                    for r in 0..rows {
                        let row = &w[r * rb..(r + 1) * rb];
                        let mag: f32 = row
                            .chunks_exact(18)
                            .enumerate()
                            .map(|(b, blk)| {
                                let s: i32 = xq.qs[b * QK..(b + 1) * QK]
                                    .iter()
                                    .map(|&q| (q as i32).abs())
                                    .sum();
                                f16_at(blk).abs() * xq.d[b] * 8.0 * s as f32
                            })
                            .sum();
                        let err = (got[r] - want[r]).abs();
                        assert!(
                            err <= 1e-5 * mag + 1e-30,
                            "{kern:?} k={k} rows={rows} r={r}: {} vs {}",
                            got[r],
                            want[r]
                        );
                        if r >= rows / 8 * 8 {
                            assert_eq!(got[r].to_bits(), want[r].to_bits(), "tail row {r}");
                        }
                    }
                }
            }
        }
    }

    /// Multi-row products equal one-row products bit for bit.
    #[test]
    fn q4x8_multi_bit_identical_to_one_row() {
        let mut rng = Rng(0x4A9);
        let mut checked = 0;
        for kern in kerns() {
            for k in [32, 576, 1536] {
                for rows in [8, 13, 24] {
                    let p = repack(&weights(&mut rng, k, rows), k, rows);
                    for n_x in [2, 3, 4, 5, 8, 16] {
                        let xq: Vec<Q8Act> = (0..n_x).map(|_| act(&mut rng, kern, k)).collect();
                        let mut y = vec![f32::NAN; n_x * rows];
                        gemv_multi_with(kern, &p, k, rows, &xq, &mut y);
                        for (t, x) in xq.iter().enumerate() {
                            let mut y1 = vec![f32::NAN; rows];
                            gemv_with(kern, &p, k, x, &mut y1);
                            for r in 0..rows {
                                assert_eq!(
                                    y[t * rows + r].to_bits(),
                                    y1[r].to_bits(),
                                    "{kern:?} k={k} rows={rows} n_x={n_x} t={t} r={r}"
                                );
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
        eprintln!("q4x8 multi: {checked} outputs bit-identical to one-row products");
    }

    /// Worst-case magnitudes: nibbles 0 and 15 against activations of
    /// ±127 (the i16 sums' extremes) give the exact integer results.
    #[test]
    fn q4x8_extreme_values_exact() {
        for kern in kerns() {
            for (nib, xv) in [
                (0xFFu8, 127.0f32),
                (0xFF, -127.0),
                (0x00, 127.0),
                (0x00, -127.0),
            ] {
                let k = 64;
                let mut w = Vec::new();
                for _ in 0..8 * 2 {
                    put_f16(&mut w, 1.0);
                    w.extend([nib; 16]);
                }
                let p = repack(&w, k, 8);
                let mut xq = Q8Act::new();
                xq.quantize_with(kern, &vec![xv; k]);
                let mut y = vec![0f32; 8];
                gemv_with(kern, &p, k, &xq, &mut y);
                let q = (nib & 0xF) as f32 - 8.0;
                assert!(y.iter().all(|&v| v == q * xv * k as f32), "{kern:?} {y:?}");
            }
        }
    }
}
