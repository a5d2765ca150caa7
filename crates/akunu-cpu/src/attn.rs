//! Attention of one (input row, query head) over the KV cache with AVX2 and
//! FMA (head dimensions that are a multiple of 8).
//!
//! The portable version in `kernels.rs` compiles for the baseline x86-64
//! target (SSE2: 4 lanes, no FMA, a scalar `exp` per score), which made
//! attention about a fifth of a decode step at a few hundred positions and a
//! larger share of each extra row of a verification pass. Each (row, head)
//! runs the same operations whatever the step's row count, so a verified
//! row's attention stays bit-identical to a one-row step's.

#![cfg(target_arch = "x86_64")]

use crate::quant::x86::hsum;
use core::arch::x86_64::*;
use half::f16;

/// A KV cache element [`head`] reads 8 at a time as f32: f32, or f16 (an
/// f16 cache, widened by F16C's `vcvtph2ps`, exactly as `f16::to_f32`).
pub(crate) trait KvLanes: Copy {
    /// Elements `p .. p + 8` as f32.
    ///
    /// # Safety
    /// 8 elements readable at `p`; called from [`head`] (AVX2, F16C).
    unsafe fn load8(p: *const Self) -> __m256;
}

impl KvLanes for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe { _mm256_loadu_ps(p) }
    }
}

impl KvLanes for f16 {
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> __m256 {
        // SAFETY: the caller's contract (16 bytes readable; F16C enabled in
        // the function this inlines into).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
}

/// e^x in 8 lanes: `kernels::exp_fast`'s method (range reduction by
/// Cody-Waite, degree-7 Taylor polynomial) with FMAs; relative error below
/// 1e-7 for x in [-87, 88], inputs clamped to that range.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn exp8(x: __m256) -> __m256 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const ROUND: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-87.0)),
        _mm256_set1_ps(88.0),
    );
    let r = _mm256_set1_ps(ROUND);
    let n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(LOG2E), r), r);
    let f = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    let f = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), f);
    let mut p = _mm256_set1_ps(1.0 / 5040.0);
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
    }
    let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    _mm256_mul_ps(p, _mm256_castsi256_ps(e))
}

/// `o = softmax(q·K[start..=pos] * scale (softcapped)) · V[start..=pos]`
/// for one query head: `q` and `o` hold `hd` floats, `k` and `v` the cache
/// rows of its KV head (`hd` floats per position).
///
/// Operation order (fixed for a given `hd` and length, whatever else the
/// step holds): each score is a dot product in two 8-lane FMA accumulators
/// (even and odd vectors) added and summed horizontally, times `scale`;
/// the exponentials of `score - max` run 8 at a time ([`exp8`]; the tail
/// lane by lane through the same function) into a lane-wise sum, summed
/// horizontally then with the tail in order; the output is `Σ_j e_j·v_j`
/// (FMA chains over j per 8 output floats) times `1 / sum`.
///
/// # Safety
/// AVX2, FMA and F16C available; `hd % 8 == 0`, `q.len() >= hd`,
/// `o.len() >= hd`, `k` and `v` hold at least `(pos + 1) * hd` elements,
/// `start <= pos`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn head<E: KvLanes>(
    q: &[f32],
    k: &[E],
    v: &[E],
    hd: usize,
    start: usize,
    pos: usize,
    scale: f32,
    softcap: f32,
    scores: &mut Vec<f32>,
    o: &mut [f32],
) {
    debug_assert!(hd.is_multiple_of(8) && q.len() >= hd && o.len() >= hd && start <= pos);
    debug_assert!(k.len() >= (pos + 1) * hd && v.len() >= (pos + 1) * hd);
    let nv = hd / 8;
    let n = pos + 1 - start;
    scores.clear();
    scores.resize(n, 0.0);
    let (qp, kp, vp, sp) = (q.as_ptr(), k.as_ptr(), v.as_ptr(), scores.as_mut_ptr());
    let mut mx = f32::NEG_INFINITY;
    for jj in 0..n {
        // SAFETY: position start + jj <= pos: hd floats of k; nv * 8 == hd
        // floats of q; score jj < n.
        unsafe {
            let kr = kp.add((start + jj) * hd);
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut i = 0;
            while i + 2 <= nv {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(8 * i)), E::load8(kr.add(8 * i)), a0);
                a1 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(qp.add(8 * i + 8)),
                    E::load8(kr.add(8 * i + 8)),
                    a1,
                );
                i += 2;
            }
            if i < nv {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(8 * i)), E::load8(kr.add(8 * i)), a0);
            }
            let mut s = hsum(_mm256_add_ps(a0, a1)) * scale;
            if softcap > 0.0 {
                s = softcap * (s / softcap).tanh();
            }
            mx = mx.max(s);
            *sp.add(jj) = s;
        }
    }
    // Exponentials and their sum.
    let mxv = _mm256_set1_ps(mx);
    let mut vsum = _mm256_setzero_ps();
    let mut jj = 0;
    while jj + 8 <= n {
        // SAFETY: scores jj..jj+8 < n.
        unsafe {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sp.add(jj)), mxv));
            _mm256_storeu_ps(sp.add(jj), e);
            vsum = _mm256_add_ps(vsum, e);
        }
        jj += 8;
    }
    let mut sum = hsum(vsum);
    while jj < n {
        // SAFETY: score jj < n.
        unsafe {
            let e = _mm256_cvtss_f32(exp8(_mm256_set1_ps(*sp.add(jj) - mx)));
            *sp.add(jj) = e;
            sum += e;
        }
        jj += 1;
    }
    let inv = _mm256_set1_ps(1.0 / sum);
    // Σ_j e_j·v_j, 64 output floats (8 vectors) at a time in registers.
    let mut c = 0;
    while c + 8 <= nv {
        // SAFETY: vectors c..c+8 < nv of each row and of `o`.
        unsafe { v_rows::<E, 8>(vp, hd, start, n, sp, c, inv, o.as_mut_ptr()) };
        c += 8;
    }
    while c < nv {
        // SAFETY: vector c < nv.
        unsafe { v_rows::<E, 1>(vp, hd, start, n, sp, c, inv, o.as_mut_ptr()) };
        c += 1;
    }
}

/// Output vectors `c..c + C` of [`head`]: `o = inv · Σ_j e_j·v_j`.
///
/// # Safety
/// As for [`head`], with vectors `c..c + C` inside `hd` and `n` scores at `e`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn v_rows<E: KvLanes, const C: usize>(
    v: *const E,
    hd: usize,
    start: usize,
    n: usize,
    e: *const f32,
    c: usize,
    inv: __m256,
    o: *mut f32,
) {
    let mut acc = [_mm256_setzero_ps(); C];
    for jj in 0..n {
        // SAFETY: the caller's contract: row start + jj, vectors c..c+C.
        unsafe {
            let w = _mm256_set1_ps(*e.add(jj));
            let vr = v.add((start + jj) * hd + 8 * c);
            for (u, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(w, E::load8(vr.add(8 * u)), *a);
            }
        }
    }
    for (u, a) in acc.iter().enumerate() {
        // SAFETY: output vector c + u < hd / 8.
        unsafe { _mm256_storeu_ps(o.add(8 * (c + u)), _mm256_mul_ps(*a, inv)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn avx2() -> bool {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }

    #[test]
    fn exp8_matches_libm() {
        if !avx2() {
            return;
        }
        let mut worst = 0f64;
        let mut x = -87.0f32;
        // The lanes reach x + 0.012: stay inside the clamp range.
        while x < 87.98 {
            let xs: [f32; 8] = core::array::from_fn(|i| x + i as f32 * 0.0017);
            let mut out = [0f32; 8];
            // SAFETY: AVX2 and FMA checked above.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), exp8(_mm256_loadu_ps(xs.as_ptr()))) };
            for (a, b) in out.iter().zip(xs) {
                let b = (b as f64).exp();
                worst = worst.max(((*a as f64 - b) / b).abs());
            }
            x += 0.0137;
        }
        assert!(worst < 1e-6, "worst relative error {worst}");
    }

    /// Against an f64 reference, head dims 8..=136 and 1..=70 positions.
    #[test]
    fn head_matches_reference() {
        if !avx2() {
            return;
        }
        let mut seed = 0x1234_5678u64;
        let mut unit = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        let mut scores = Vec::new();
        for hd in [8, 16, 64, 72, 128, 136] {
            for len in [1, 2, 7, 8, 9, 31, 70] {
                for softcap in [0.0f32, 5.0] {
                    let start = len / 3;
                    let pos = start + len - 1;
                    let q: Vec<f32> = (0..hd).map(|_| unit()).collect();
                    let k: Vec<f32> = (0..(pos + 1) * hd).map(|_| 2.0 * unit()).collect();
                    let v: Vec<f32> = (0..(pos + 1) * hd).map(|_| unit()).collect();
                    let scale = 1.0 / (hd as f32).sqrt();
                    let mut o = vec![f32::NAN; hd];
                    // SAFETY: AVX2 and FMA checked; lengths as documented.
                    unsafe {
                        head(
                            &q,
                            &k,
                            &v,
                            hd,
                            start,
                            pos,
                            scale,
                            softcap,
                            &mut scores,
                            &mut o,
                        )
                    };
                    let s: Vec<f64> = (start..=pos)
                        .map(|j| {
                            let d: f64 = (0..hd).map(|i| q[i] as f64 * k[j * hd + i] as f64).sum();
                            let s = d * scale as f64;
                            if softcap > 0.0 {
                                softcap as f64 * (s / softcap as f64).tanh()
                            } else {
                                s
                            }
                        })
                        .collect();
                    let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for i in 0..hd {
                        let want: f64 = (0..len)
                            .map(|jj| e[jj] * v[(start + jj) * hd + i] as f64)
                            .sum::<f64>()
                            / sum;
                        assert!(
                            (o[i] as f64 - want).abs() < 1e-5,
                            "hd={hd} len={len} softcap={softcap} i={i}: {} vs {want}",
                            o[i]
                        );
                    }
                }
            }
        }
    }
}
