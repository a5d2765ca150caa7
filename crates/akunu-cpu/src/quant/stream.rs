//! Software prefetch for the x86 weight-streaming kernels (`avx2`, `avx512`,
//! `q8act`): one distance rule for all of them.

/// Software prefetch distance (bytes ahead in each weight row stream; see
/// [`pf_ahead`]).
pub(super) const PF_DIST: usize = 1024;

/// Bytes ahead of the current block to prefetch in a kernel over `r` weight
/// rows of `row` bytes at a stride of `stride` bytes. Adjacent rows (the
/// multi-row kernels) are one interleaved stream: prefetch at least one row
/// group ahead (with long rows a fixed 1 KiB lands in rows the group is
/// already reading). Rows of separate spans (the one-row kernels' span-strided
/// row groups) are each a stream of their own, which continues into the
/// span's next row.
#[inline(always)]
pub(super) fn pf_ahead(r: usize, stride: usize, row: usize) -> usize {
    if stride == row {
        PF_DIST.max(r * row)
    } else {
        PF_DIST
    }
}

/// Prefetch hint for the cache line holding `p`; never faults, so `p` may
/// point past the end of the weights (it is only formed with wrapping_add).
#[inline(always)]
pub(super) fn prefetch(p: *const u8) {
    use core::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    // SAFETY: prefetch is a hint: it performs no architectural memory
    // access and cannot fault, whatever the address.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) };
}
