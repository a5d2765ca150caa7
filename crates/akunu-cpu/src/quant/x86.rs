//! Helpers shared by the x86 kernels (`avx2`, `avx512`, `q8act`, and the
//! attention kernel in `attn.rs`): software prefetch with one distance rule
//! for every weight stream, and the 8-lane horizontal sum.

use core::arch::x86_64::*;

/// Software prefetch distance (bytes ahead in each weight row stream; see
/// [`pf_ahead`]).
pub(crate) const PF_DIST: usize = 1024;

/// Bytes ahead of the current block to prefetch in a kernel over `r` weight
/// rows of `row` bytes at a stride of `stride` bytes. Adjacent rows (the
/// multi-row kernels) are one interleaved stream: prefetch at least one row
/// group ahead (with long rows a fixed 1 KiB lands in rows the group is
/// already reading). Rows of separate spans (the one-row kernels' span-strided
/// row groups) are each a stream of their own, which continues into the
/// span's next row.
#[inline(always)]
pub(crate) fn pf_ahead(r: usize, stride: usize, row: usize) -> usize {
    if stride == row {
        PF_DIST.max(r * row)
    } else {
        PF_DIST
    }
}

/// Prefetch hint for the cache line holding `p`; never faults, so `p` may
/// point past the end of the weights (it is only formed with wrapping_add).
#[inline(always)]
pub(crate) fn prefetch(p: *const u8) {
    // SAFETY: prefetch is a hint: it performs no architectural memory
    // access and cannot fault, whatever the address.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) };
}

/// Horizontal sum of 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}
