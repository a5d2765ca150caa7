//! The CPU implementation of every table kernel (see `akunu_core::ops` for
//! the contract of each). Activations are f32; quantized products live in
//! [`crate::quant`].

use crate::pool::{ThreadPool, split_range};
use crate::quant;
use akunu_core::dtype::DType;
use akunu_core::ops::*;
use akunu_core::table::{DispatchCmd, RowMode, StepInfo};
use half::f16;
use std::cell::RefCell;

/// A raw pointer that may be shared with pool threads. Each kernel below
/// documents why its threads' accesses through it do not overlap.
#[derive(Copy, Clone)]
struct Ptr(*mut u8);
// SAFETY: see the type's doc: sharing is sound only because every kernel
// splits its writes into disjoint ranges per thread and the pool joins all
// threads before the kernel returns.
unsafe impl Send for Ptr {}
unsafe impl Sync for Ptr {}

impl Ptr {
    // Methods (not field access) make closures capture the whole `Ptr`,
    // which is Sync, rather than its raw-pointer field, which is not.
    fn raw(self) -> *mut u8 {
        self.0
    }

    fn f32(self) -> *mut f32 {
        self.0 as *mut f32
    }
}

/// # Safety
/// `p` must be valid for reads of `n` f32s, 4-byte aligned, and not written
/// by anyone for the returned lifetime.
unsafe fn slice<'a>(p: *const f32, n: usize) -> &'a [f32] {
    unsafe { std::slice::from_raw_parts(p, n) }
}

/// # Safety
/// `p` must be valid for writes of `n` f32s, 4-byte aligned, and accessed by
/// no one else for the returned lifetime.
unsafe fn slice_mut<'a>(p: *mut f32, n: usize) -> &'a mut [f32] {
    unsafe { std::slice::from_raw_parts_mut(p, n) }
}

fn dtype(id: u32) -> Result<DType, String> {
    DType::from_ggml(id).ok_or_else(|| format!("unknown dtype id {id}"))
}

/// How the kernels compute (chosen per backend, not per table).
#[derive(Copy, Clone, Debug, Default)]
pub struct KernelOptions {
    /// Decode products against Q4_0/Q4_1/Q8_0 weights quantize the input
    /// row to 8 bits per 32-element block and use integer dot products (as
    /// llama.cpp does): about 1.7x faster kernels, at a relative error of
    /// about 5e-3 per product. Off: every product is f32.
    pub q8_activations: bool,
}

thread_local! {
    static XQ: RefCell<Vec<quant::Q8Act>> = const { RefCell::new(Vec::new()) };
    static ROPE_ANGLES: RefCell<RopeAngles> = RefCell::new(RopeAngles::default());
}

/// RoPE cos/sin of one position, with the parameters they were made for.
#[derive(Default)]
struct RopeAngles {
    key: [u64; 4],
    pos: u64,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

/// A Q4_0 weight binding's copy in the row-interleaved layout of
/// [`quant::q4x8`] (the whole tensor, rows of `k` elements; the same size
/// as the plain tensor).
#[derive(Copy, Clone, Debug)]
pub struct X8 {
    pub ptr: *const u8,
    pub k: usize,
}

/// Runs one (already patched) command. `ptrs[i]`/`lens[i]` are binding
/// `i`'s address and the bytes available from it, `x8[i]` its repacked
/// copy if it has one; `validate` has checked the static extents, the
/// per-step ones are checked here.
pub fn run(
    pool: &ThreadPool,
    opts: KernelOptions,
    c: &DispatchCmd,
    ptrs: &[*mut u8; 8],
    lens: &[usize; 8],
    x8: &[Option<X8>; 8],
    step: &StepInfo,
) -> Result<(), String> {
    for (i, p) in ptrs.iter().enumerate().take(c.n_buffers as usize) {
        if !(*p as usize).is_multiple_of(4) {
            return Err(format!("binding {i} is not 4-byte aligned"));
        }
    }
    let rows = step.rows as usize;
    let p = |i: usize| Ptr(ptrs[i]);
    match c.kernel {
        KernelId::Embedding => {
            let prm: EmbedParams = c.params();
            if lens[0] < rows * 4 {
                return Err(format!(
                    "token conveyor holds {} ids, step needs {rows}",
                    lens[0] / 4
                ));
            }
            embedding(pool, &prm, p(0), p(1), p(2), rows)
        }
        KernelId::RmsNorm => {
            let prm: NormParams = c.params();
            norm_rows(pool, &prm, rows, None, p(0), p(1), p(2), None);
            Ok(())
        }
        KernelId::ResidualRmsNorm => {
            let prm: NormParams = c.params();
            let post = (prm.post_norm != 0).then(|| p(4));
            norm_rows(pool, &prm, rows, Some(p(1)), p(0), p(2), p(3), post);
            Ok(())
        }
        KernelId::Gemv => gemv(pool, opts, c, ptrs, lens, x8, rows),
        KernelId::RopeKvWrite => {
            let prm: RopeParams = c.params();
            if prm.pos as u64 + rows as u64 > prm.capacity as u64 {
                return Err(format!(
                    "KV write at positions {}..{} beyond the cache ({} positions)",
                    prm.pos,
                    prm.pos as usize + rows,
                    prm.capacity
                ));
            }
            let ff = (prm.freq_factors != 0) as usize;
            rope_kv_write(
                pool,
                &prm,
                rows,
                p(0),
                p(1),
                p(2),
                (ff != 0).then(|| p(3)),
                (prm.qk_norm != 0).then(|| (p(3 + ff), p(4 + ff))),
            );
            Ok(())
        }
        KernelId::Attention => {
            let prm: AttnParams = c.params();
            if prm.kv_len > prm.capacity || (prm.kv_len as usize) < rows {
                return Err(format!(
                    "attention over {} cache entries ({} rows, capacity {})",
                    prm.kv_len, rows, prm.capacity
                ));
            }
            attention(pool, &prm, rows, p(0), p(1), p(2), p(3));
            Ok(())
        }
        KernelId::Argmax => {
            let prm: ArgmaxParams = c.params();
            if lens[1] < 4 {
                return Err("argmax output slot lies beyond the token conveyor".into());
            }
            // LastRow: one row of logits, result in the patched slot
            // (`tok + rows`). AllRows: row r's result in slot `tok + r + 1`,
            // i.e. `rows - 1 - r` slots before the patched one.
            let n_rows = if c.rows == RowMode::LastRow { 1 } else { rows };
            let back = n_rows - 1;
            if (step.tok as usize + rows) < back {
                return Err("argmax rows lie before the token conveyor".into());
            }
            for r in 0..n_rows {
                // SAFETY: extents checked n floats per row (max_rows rows for
                // AllRows) at binding 0; binding 1 points at slot
                // `tok + rows >= back` of the conveyor, so `back - (n_rows - 1
                // - r)` slots before it are inside the buffer too.
                let logits = unsafe { slice(p(0).f32().add(r * prm.n as usize), prm.n as usize) };
                let best = argmax(logits);
                unsafe { (ptrs[1] as *mut u32).sub(n_rows - 1 - r).write(best) };
            }
            Ok(())
        }
        KernelId::GumbelSample => {
            let prm: SampleParams = c.params();
            let hdr: RecentHeader = unsafe { (ptrs[1] as *const RecentHeader).read_unaligned() };
            let n_rows = if c.rows == RowMode::LastRow { 1 } else { rows };
            let nv = prm.n_vocab as usize;
            let cfg = akunu_core::sampling::SamplingConfig {
                temperature: prm.temperature,
                top_k: prm.top_k,
                top_p: prm.top_p,
                min_p: prm.min_p,
                repeat_penalty: prm.repeat_penalty,
                repeat_last_n: prm.repeat_last_n,
                seed: prm.seed_lo as u64 | ((prm.seed_hi as u64) << 32),
            };
            for r in 0..n_rows {
                // Row r is produced at position kv_len - (n_rows - 1 - r):
                // the one-row command of the step at `pos + r` would have
                // `kv_len = pos + r + 1`.
                let kv_len = prm.kv_len - (n_rows - 1 - r) as u32;
                // SAFETY: extents validated n_vocab logits per row at binding
                // 0 and the header plus `recent_capacity` ids at binding 1.
                let (logits, recent) = unsafe {
                    (
                        slice_mut(p(0).f32().add(r * nv), nv),
                        recent_ids(ptrs[1], prm.recent_capacity),
                    )
                };
                // Tokens this chain has produced so far: conveyor slots 1..=s.
                let s = kv_len.saturating_sub(hdr.chain_start) as usize;
                if lens[2] < (s + 1) * 4 {
                    return Err(format!("chain step {s} lies beyond the token conveyor"));
                }
                // SAFETY: checked just above: the conveyor holds s + 1 ids.
                let chain =
                    unsafe { std::slice::from_raw_parts((ptrs[2] as *const u32).add(1), s) };
                SAMPLER.with(|cell| {
                    let mut st = cell.borrow_mut();
                    let SamplerState { window, scratch } = &mut *st;
                    window.clear();
                    window.extend_from_slice(recent);
                    window.extend_from_slice(chain);
                    let keep = window.len().min(prm.repeat_last_n as usize);
                    let from = window.len() - keep;
                    akunu_core::sampling::gumbel_transform(
                        logits,
                        &window[from..],
                        &cfg,
                        kv_len,
                        scratch,
                    );
                });
            }
            Ok(())
        }
        KernelId::TopKSelect => {
            let prm: TopKParams = c.params();
            // SAFETY: extents validated n_vocab logits and k output pairs.
            let logits = unsafe { slice(p(0).f32(), prm.n_vocab as usize) };
            let out =
                unsafe { std::slice::from_raw_parts_mut(ptrs[1] as *mut [u32; 2], prm.k as usize) };
            for (o, (id, v)) in out.iter_mut().zip(top_k(logits, prm.k as usize)) {
                *o = [id, v.to_bits()];
            }
            Ok(())
        }
        KernelId::RepetitionPenalty => {
            let prm: PenaltyParams = c.params();
            // SAFETY: extents validated the logits and the recent buffer.
            let (logits, recent) = unsafe {
                (
                    slice_mut(p(0).f32(), prm.n_vocab as usize),
                    recent_ids(ptrs[1], prm.recent_capacity),
                )
            };
            akunu_core::sampling::apply_repetition_penalty(logits, recent, prm.penalty);
            Ok(())
        }
        KernelId::TemperatureScale => {
            let prm: TemperatureParams = c.params();
            if !(prm.temperature.is_finite() && prm.temperature > 0.0) {
                return Err(format!(
                    "temperature {} must be a positive number",
                    prm.temperature
                ));
            }
            // SAFETY: extents validated n_vocab logits.
            let logits = unsafe { slice_mut(p(0).f32(), prm.n_vocab as usize) };
            let inv = 1.0 / prm.temperature;
            logits.iter_mut().for_each(|l| *l *= inv);
            Ok(())
        }
        KernelId::GrammarBitmask => {
            let prm: BitmaskParams = c.params();
            let n = prm.n_vocab as usize;
            // SAFETY: extents validated n_vocab logits and ceil(n/32) words.
            let (logits, mask) = unsafe {
                (
                    slice_mut(p(0).f32(), n),
                    std::slice::from_raw_parts(ptrs[1] as *const u32, n.div_ceil(32)),
                )
            };
            for (i, l) in logits.iter_mut().enumerate() {
                if mask[i / 32] >> (i % 32) & 1 == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
            Ok(())
        }
    }
}

/// The ids of a recent-token buffer ([`RecentHeader`] then ids), clamped
/// to its capacity.
///
/// # Safety
/// `buf` must hold the header and `capacity` u32 ids, 4-byte aligned.
unsafe fn recent_ids<'a>(buf: *mut u8, capacity: u32) -> &'a [u32] {
    unsafe {
        let hdr = (buf as *const RecentHeader).read_unaligned();
        std::slice::from_raw_parts((buf as *const u32).add(2), hdr.n.min(capacity) as usize)
    }
}

/// The `k` largest values with their ids, descending; ties by lower id.
pub fn top_k(v: &[f32], k: usize) -> Vec<(u32, f32)> {
    let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let mut all: Vec<(u32, f32)> = v.iter().enumerate().map(|(i, &x)| (i as u32, x)).collect();
    let k = k.min(all.len());
    if k == 0 {
        return Vec::new();
    }
    all.select_nth_unstable_by(k - 1, order);
    all.truncate(k);
    all.sort_by(order);
    all
}

struct SamplerState {
    window: Vec<u32>,
    scratch: akunu_core::sampling::Scratch,
}

thread_local! {
    static SAMPLER: RefCell<SamplerState> = RefCell::new(SamplerState {
        window: Vec::new(),
        scratch: akunu_core::sampling::Scratch::new(),
    });
}

/// Index of the largest value; the lowest such index on ties; NaNs ignored.
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &x) in v.iter().enumerate() {
        if x > best_v {
            best_v = x;
            best = i;
        }
    }
    best as u32
}

fn embedding(
    pool: &ThreadPool,
    prm: &EmbedParams,
    ids: Ptr,
    table: Ptr,
    out: Ptr,
    rows: usize,
) -> Result<(), String> {
    let dt = dtype(prm.dtype)?;
    let dim = prm.dim as usize;
    let rb = quant::row_bytes(dt, dim);
    pool.run(&|tid, nt| {
        for r in split_range(rows, nt, tid, 1) {
            // SAFETY: the conveyor holds `rows` ids (checked by the caller);
            // the table holds n_vocab rows (validated) and the id is clamped
            // into range; each thread writes its own output rows.
            unsafe {
                let id = (*(ids.raw() as *const u32).add(r)).min(prm.n_vocab - 1) as usize;
                let src = std::slice::from_raw_parts(table.raw().add(id * rb), rb);
                let dst = slice_mut(out.f32().add(r * dim), dim);
                quant::dequant_row(dt, src, dim, dst);
                if prm.scale != 1.0 {
                    dst.iter_mut().for_each(|x| *x *= prm.scale);
                }
            }
        }
    });
    Ok(())
}

fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    (1.0 / ((ss / x.len() as f64) + eps as f64).sqrt()) as f32
}

/// For each row: optionally `h += post_norm(delta)`; then `out = rmsnorm(h) * w`.
#[allow(clippy::too_many_arguments)]
fn norm_rows(
    pool: &ThreadPool,
    prm: &NormParams,
    rows: usize,
    delta: Option<Ptr>,
    h: Ptr,
    w: Ptr,
    out: Ptr,
    post: Option<Ptr>,
) {
    let d = prm.dim as usize;
    let eps = prm.eps;
    let work = |r: usize| {
        // SAFETY: extents validated `rows * dim` floats for h, delta and
        // out and `dim` for the weights; each row is touched by one thread.
        unsafe {
            let hr = slice_mut(h.f32().add(r * d), d);
            if let Some(dp) = delta {
                let dr = slice(dp.f32().add(r * d), d);
                match post {
                    Some(pw) => {
                        let pw = slice(pw.f32(), d);
                        let s = rms_scale(dr, eps);
                        for i in 0..d {
                            hr[i] += dr[i] * s * pw[i];
                        }
                    }
                    None => hr.iter_mut().zip(dr).for_each(|(a, b)| *a += *b),
                }
            }
            let wr = slice(w.f32(), d);
            let s = rms_scale(hr, eps);
            let or = slice_mut(out.f32().add(r * d), d);
            for i in 0..d {
                or[i] = hr[i] * s * wr[i];
            }
        }
    };
    if rows == 1 {
        work(0);
    } else {
        pool.run(&|tid, nt| split_range(rows, nt, tid, 1).for_each(work));
    }
}

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// K then V rows of an f16 cache widened to f32 for attention.
    static KV_WIDE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// e^x with a relative error below 1e-7 over the f32 range, written
/// branch-free so that loops over slices vectorise (libm's `expf` does not,
/// and in the fused SwiGLU it cost as much as the down projection itself).
#[inline(always)]
fn exp_fast(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + ROUND) - ROUND;
    // Cody-Waite: subtract n*ln2 in two parts so f keeps its low bits.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let f = (x - n * LN2_HI) - n * LN2_LO; // |f| <= ln2/2
    // e^f by its Taylor series to degree 7: the remainder is < 3e-9 here.
    let p = 1.0
        + f * (1.0
            + f * (0.5
                + f * (1.0 / 6.0
                    + f * (1.0 / 24.0
                        + f * (1.0 / 120.0 + f * (1.0 / 720.0 + f * (1.0 / 5040.0)))))));
    let scale = f32::from_bits(((n as i32 + 127) << 23) as u32);
    p * scale
}

#[inline(always)]
fn silu(x: f32) -> f32 {
    x / (1.0 + exp_fast(-x))
}

fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2/pi)
    0.5 * x * (1.0 + (C * (x + 0.044715 * x * x * x)).tanh())
}

/// Most rows of a step whose products match a one-row step's bit for bit.
pub const EXACT_ROWS: usize = 16;
/// Weight rows per call of the exact multi-row product (bounds the
/// per-thread scratch; the kernels keep each weight row group in L1
/// across all input rows themselves).
const EXACT_TILE: usize = 256;

fn gemv(
    pool: &ThreadPool,
    opts: KernelOptions,
    c: &DispatchCmd,
    ptrs: &[*mut u8; 8],
    lens: &[usize; 8],
    x8: &[Option<X8>; 8],
    rows: usize,
) -> Result<(), String> {
    let p: GemvParams = c.params();
    let k = p.k as usize;
    let ns = p.n_seg as usize;
    let (first_row, n_x) = match c.rows {
        RowMode::AllRows => (0, rows),
        RowMode::LastRow => (rows - 1, 1),
    };
    let xs = p.x_stride as usize;
    // SAFETY: extents validated `max_rows * x_stride` input floats and the
    // step has at most max_rows rows.
    let x_all = unsafe {
        slice(
            (ptrs[0] as *const f32).add(first_row * xs),
            (n_x - 1) * xs + if p.input_act == ACT_NONE { k } else { 2 * k },
        )
    };
    // The product wants `n_x` contiguous rows of `k`: apply the gated
    // activation (fused SwiGLU/GeGLU + down) or compact strided rows.
    let owned: Vec<f32>;
    let x: &[f32] = if p.input_act == ACT_NONE && (xs == k || n_x == 1) {
        &x_all[..(n_x - 1) * xs + k]
    } else {
        let mut v = vec![0f32; n_x * k];
        for t in 0..n_x {
            let row = &x_all[t * xs..];
            let dst = &mut v[t * k..(t + 1) * k];
            // Zipped slices (no indexing) so the loops vectorise.
            let (gate, up) = (&row[..k], &row[k..2 * k.min(row.len() / 2)]);
            match p.input_act {
                ACT_SWIGLU => dst
                    .iter_mut()
                    .zip(gate)
                    .zip(up)
                    .for_each(|((d, &g), &u)| *d = silu(g) * u),
                ACT_GEGLU => dst
                    .iter_mut()
                    .zip(gate)
                    .zip(up)
                    .for_each(|((d, &g), &u)| *d = gelu_tanh(g) * u),
                _ => dst.copy_from_slice(&row[..k]),
            }
        }
        owned = v;
        &owned
    };

    struct Seg {
        start: usize,
        n: usize,
        dt: DType,
        w: Ptr,
        rb: usize,
        bias: Option<Ptr>,
        /// The segment's rows in the row-interleaved Q4_0 layout.
        x8: Option<Ptr>,
    }
    let mut segs = Vec::with_capacity(ns);
    let mut start = 0usize;
    for s in 0..ns {
        let dt = dtype(p.dtype[s])?;
        let (n, rb) = (p.n[s] as usize, quant::row_bytes(dt, k));
        // The repacked copy holds the whole tensor (binding offset 0) with
        // rows of k: its groups of 8 are the segment's, and a tail of fewer
        // than 8 rows (plain layout) is the segment's only when the
        // segment is the whole tensor. A segment starting on a multiple of
        // 8 output columns has thread ranges starting on group boundaries
        // (`split_range` aligns to 16) for every thread count, so which
        // kernel a row runs does not depend on the thread count.
        let x8 = x8[2 + s]
            .filter(|x| {
                dt == DType::Q4_0
                    && x.k == k
                    && start.is_multiple_of(8)
                    && (n.is_multiple_of(8) || n * rb == lens[2 + s])
            })
            .map(|x| Ptr(x.ptr as *mut u8));
        segs.push(Seg {
            start,
            n,
            dt,
            w: Ptr(ptrs[2 + s]),
            rb,
            bias: (p.bias != 0).then(|| Ptr(ptrs[2 + ns + s])),
            x8,
        });
        start += p.n[s] as usize;
    }
    let total = start;
    let out = Ptr(ptrs[1]);
    let os = p.out_stride as usize;
    let acc = p.accumulate != 0;
    // Steps of up to `EXACT_ROWS` rows (speculative verification, short
    // prefills) compute every row exactly as a one-row step does: the
    // multi-row GEMV kernels unpack each weight block once and apply it to
    // every row with the one-row kernel's operation order (the one-row
    // kernel is their one-input instance). Larger steps use the GEMM, whose
    // sums are ordered differently.
    let exact = n_x <= EXACT_ROWS;
    let use_q8 = opts.q8_activations && exact && segs.iter().all(|sg| quant::supports_q8(sg.dt));
    // The input rows are quantized once, by the calling thread, and read by all.
    XQ.with(|cell| {
        let mut xq_cell = cell.borrow_mut();
        if use_q8 {
            if xq_cell.len() < n_x {
                xq_cell.resize_with(n_x, quant::Q8Act::new);
            }
            for (t, q) in xq_cell.iter_mut().take(n_x).enumerate() {
                q.quantize(&x[t * k..(t + 1) * k]);
            }
        }
        let xq = &*xq_cell;
        pool.run(&|tid, nt| {
            let mine = split_range(total, nt, tid, 16);
            for sg in &segs {
                let a = mine.start.max(sg.start);
                let b = mine.end.min(sg.start + sg.n);
                if a >= b {
                    continue;
                }
                let (r0, nr) = (a - sg.start, b - a);
                // SAFETY: rows r0..r0+nr of this segment's weight lie inside the
                // binding (validated n * row_bytes); this thread alone writes
                // output columns a..b of every row (ranges are disjoint per
                // thread).
                let w =
                    unsafe { std::slice::from_raw_parts(sg.w.raw().add(r0 * sg.rb), nr * sg.rb) };
                // The repacked rows when this thread's range is whole
                // groups (plus the segment's tail): the same choice for a
                // row at every step, so one-row and multi-row products of
                // it run the same kernel.
                let x8 = sg
                    .x8
                    .filter(|_| use_q8 && r0 % 8 == 0 && (nr % 8 == 0 || r0 + nr == sg.n))
                    // SAFETY: the copy has the plain tensor's size and row
                    // offsets at group boundaries, so rows r0..r0+nr lie
                    // inside it as they do in the binding.
                    .map(|xp| unsafe {
                        std::slice::from_raw_parts(xp.raw().add(r0 * sg.rb), nr * sg.rb)
                    });
                let bias = sg.bias.map(|bp| unsafe { slice(bp.f32().add(r0), nr) });
                // Writes `vals` (output columns c0.. of input row t).
                let store = |t: usize, c0: usize, vals: &[f32]| {
                    // SAFETY: columns a + c0 .. a + c0 + vals.len() <= b of
                    // row t belong to this thread (see above).
                    let dst = unsafe { slice_mut(out.f32().add(t * os + a + c0), vals.len()) };
                    for (i, (d, &v)) in dst.iter_mut().zip(vals).enumerate() {
                        let v = match bias {
                            Some(bs) => v + bs[c0 + i],
                            None => v,
                        };
                        let v = if p.softcap > 0.0 {
                            p.softcap * (v / p.softcap).tanh()
                        } else {
                            v
                        };
                        *d = if acc { *d + v } else { v };
                    }
                };
                SCRATCH.with(|cell| {
                    let mut tmp = cell.borrow_mut();
                    tmp.clear();
                    if exact && n_x == 1 {
                        // One row (decode): the whole range in one call.
                        tmp.resize(nr, 0.0);
                        if let Some(wx) = x8 {
                            quant::q4x8::gemv(wx, k, &xq[0], &mut tmp);
                        } else if use_q8 {
                            quant::gemv_q8(sg.dt, w, k, &xq[0], &mut tmp);
                        } else {
                            quant::gemv(sg.dt, w, k, &x[..k], &mut tmp);
                        }
                        store(0, 0, &tmp);
                    } else if exact {
                        // The multi-row kernels: each weight block unpacked
                        // once for all rows, every row bit-identical to a
                        // one-row step. Tiles of EXACT_TILE weight rows
                        // bound the scratch.
                        let tile = EXACT_TILE.min(nr);
                        tmp.resize(tile * n_x, 0.0);
                        let mut i0 = 0;
                        while i0 < nr {
                            let tn = tile.min(nr - i0);
                            let wt = &w[i0 * sg.rb..(i0 + tn) * sg.rb];
                            let y = &mut tmp[..tn * n_x];
                            if let Some(wx) = x8 {
                                let wxt = &wx[i0 * sg.rb..(i0 + tn) * sg.rb];
                                quant::q4x8::gemv_multi(wxt, k, tn, &xq[..n_x], y);
                            } else if use_q8 {
                                quant::gemv_q8_multi(sg.dt, wt, k, tn, &xq[..n_x], y);
                            } else {
                                quant::gemv_multi(sg.dt, wt, k, tn, &x[..n_x * k], n_x, y);
                            }
                            for t in 0..n_x {
                                store(t, i0, &y[t * tn..(t + 1) * tn]);
                            }
                            i0 += tn;
                        }
                    } else {
                        tmp.resize(nr * n_x, 0.0);
                        quant::gemm(sg.dt, w, k, nr, x, n_x, &mut tmp);
                        let mut row = vec![0f32; nr];
                        for t in 0..n_x {
                            for (i, r) in row.iter_mut().enumerate() {
                                *r = tmp[i * n_x + t];
                            }
                            store(t, 0, &row);
                        }
                    }
                });
            }
        });
    });
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn rope_kv_write(
    pool: &ThreadPool,
    p: &RopeParams,
    rows: usize,
    qkv: Ptr,
    kc: Ptr,
    vc: Ptr,
    factors: Option<Ptr>,
    qk_norm: Option<(Ptr, Ptr)>,
) {
    let hd = p.head_dim as usize;
    let half = p.rope_dim as usize / 2;
    let (nh, nkv) = (p.n_heads as usize, p.n_kv_heads as usize);
    let cap = p.capacity as usize;
    let stride = p.qkv_stride as usize;
    let f16_cache = p.kv_type == KvType::F16 as u32;
    // Every layer rotates by the same angles at a given position: keep the
    // last position's cos/sin per thread and reuse them.
    let key = [
        p.theta.to_bits() as u64,
        p.freq_scale.to_bits() as u64,
        p.rope_dim as u64,
        factors.map_or(0, |f| f.raw() as u64),
    ];
    let work = |t: usize| {
        ROPE_ANGLES.with(|cell| {
            let mut cache = cell.borrow_mut();
            let at_pos = p.pos as u64 + t as u64;
            if cache.key != key || cache.pos != at_pos || cache.cos.len() != half {
                let pos = at_pos as f64 * p.freq_scale as f64;
                cache.cos.resize(half, 0.0);
                cache.sin.resize(half, 0.0);
                for i in 0..half {
                    // Inverse frequency base^(-2i/rope_dim) in f64, divided by
                    // the optional per-frequency factor.
                    let mut inv = (p.theta as f64).powf(-2.0 * i as f64 / p.rope_dim as f64);
                    if let Some(fp) = factors {
                        // SAFETY: extents validated rope_dim/2 factors when enabled.
                        inv /= unsafe { *fp.f32().add(i) } as f64;
                    }
                    let a = pos * inv;
                    cache.cos[i] = a.cos() as f32;
                    cache.sin[i] = a.sin() as f32;
                }
                cache.key = key;
                cache.pos = at_pos;
            }
            let (cos, sin) = (&cache.cos, &cache.sin);
            // SAFETY: row t of the QKV buffer (validated for max_rows rows) is
            // touched only by the thread handling t; cache rows `pos + t` of
            // every head are likewise written by that thread only, and
            // `pos + rows <= capacity` was checked by the caller.
            let row = unsafe { slice_mut(qkv.f32().add(t * stride), (nh + 2 * nkv) * hd) };
            for h in 0..nh + nkv {
                let x = &mut row[h * hd..(h + 1) * hd];
                if let Some((qn, kn)) = qk_norm {
                    // SAFETY: extents validated head_dim weights for each.
                    let wn = unsafe { slice(if h < nh { qn } else { kn }.f32(), hd) };
                    let sc = rms_scale(x, p.norm_eps);
                    x.iter_mut().zip(wn).for_each(|(v, &g)| *v = *v * sc * g);
                }
                for i in 0..half {
                    let (a, b) = if p.style == ROPE_NEOX {
                        (i, i + half)
                    } else {
                        (2 * i, 2 * i + 1)
                    };
                    let (x0, x1) = (x[a], x[b]);
                    x[a] = x0 * cos[i] - x1 * sin[i];
                    x[b] = x0 * sin[i] + x1 * cos[i];
                }
            }
            let at = p.pos as usize + t;
            for g in 0..nkv {
                let ksrc = &row[(nh + g) * hd..(nh + g + 1) * hd];
                let vsrc = &row[(nh + nkv + g) * hd..(nh + nkv + g + 1) * hd];
                let el = (g * cap + at) * hd;
                if f16_cache {
                    // SAFETY: as above, for a slab of 2-byte elements
                    // (validated by `ops::extents` for this kv_type).
                    unsafe {
                        let kd = std::slice::from_raw_parts_mut(kc.raw().cast::<f16>().add(el), hd);
                        let vd = std::slice::from_raw_parts_mut(vc.raw().cast::<f16>().add(el), hd);
                        kd.iter_mut()
                            .zip(ksrc)
                            .for_each(|(d, &x)| *d = f16::from_f32(x));
                        vd.iter_mut()
                            .zip(vsrc)
                            .for_each(|(d, &x)| *d = f16::from_f32(x));
                    }
                } else {
                    unsafe {
                        slice_mut(kc.f32().add(el), hd).copy_from_slice(ksrc);
                        slice_mut(vc.f32().add(el), hd).copy_from_slice(vsrc);
                    }
                }
            }
        });
    };
    if rows == 1 {
        work(0);
    } else {
        pool.run(&|tid, nt| split_range(rows, nt, tid, 1).for_each(work));
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent lanes let the compiler vectorise the reduction.
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[allow(clippy::too_many_arguments)]
fn attention(pool: &ThreadPool, p: &AttnParams, rows: usize, qkv: Ptr, kc: Ptr, vc: Ptr, out: Ptr) {
    let hd = p.head_dim as usize;
    let (nh, nkv) = (p.n_heads as usize, p.n_kv_heads as usize);
    let group = nh / nkv;
    let cap = p.capacity as usize;
    let pos0 = p.kv_len as usize - rows;
    let items = rows * nh;
    // The AVX2 kernel where the CPU has it (every level but the portable
    // ones; the level, and so the choice, is fixed per process).
    #[cfg(target_arch = "x86_64")]
    let fast = hd.is_multiple_of(8)
        && matches!(quant::level(), quant::Level::Avx2 | quant::Level::Avx512)
        && is_x86_feature_detected!("f16c");
    let f16_cache = p.kv_type == KvType::F16 as u32;
    let work = |item: usize, scores: &mut Vec<f32>, wide: &mut Vec<f32>| {
        let (t, h) = (item / nh, item % nh);
        let pos = pos0 + t;
        let start = if p.window > 0 {
            (pos + 1).saturating_sub(p.window as usize)
        } else {
            0
        };
        let g = h / group;
        // SAFETY: the QKV row t and the cache slabs were validated; cache
        // entries 0..kv_len were written by earlier RoPE/KV commands; the
        // output slot (t, h) belongs to this work item alone.
        let q = unsafe { slice(qkv.f32().add(t * p.qkv_stride as usize + h * hd), hd) };
        #[cfg(target_arch = "x86_64")]
        if fast {
            let o = unsafe { slice_mut(out.f32().add(t * p.out_stride as usize + h * hd), hd) };
            let at = g * cap * hd;
            // SAFETY: AVX2, FMA and F16C available (`fast`); hd % 8 == 0;
            // the slabs (of this kv_type's elements, validated) hold
            // `cap > pos` positions of head g; start <= pos.
            unsafe {
                if f16_cache {
                    let k = std::slice::from_raw_parts(kc.raw().cast::<f16>().add(at), cap * hd);
                    let v = std::slice::from_raw_parts(vc.raw().cast::<f16>().add(at), cap * hd);
                    crate::attn::head(q, k, v, hd, start, pos, p.scale, p.softcap, scores, o)
                } else {
                    let (k, v) = (
                        slice(kc.f32().add(at), cap * hd),
                        slice(vc.f32().add(at), cap * hd),
                    );
                    crate::attn::head(q, k, v, hd, start, pos, p.scale, p.softcap, scores, o)
                }
            };
            return;
        }
        // An f16 cache on the portable path: the visible rows start..=pos
        // widened into the thread's scratch, which then stands for the slab
        // from `start` on.
        let (kbase, vbase, start, pos) = if f16_cache {
            let n = (pos + 1 - start) * hd;
            // SAFETY: as above; the slabs hold 2-byte elements (validated
            // for this kv_type), rows start..=pos < capacity of head g.
            let (k16, v16) = unsafe {
                let at = (g * cap + start) * hd;
                (
                    std::slice::from_raw_parts(kc.raw().cast::<f16>().add(at), n),
                    std::slice::from_raw_parts(vc.raw().cast::<f16>().add(at), n),
                )
            };
            wide.clear();
            wide.extend(k16.iter().chain(v16).map(|x| x.to_f32()));
            let (k, v) = wide.split_at(n);
            (k, v, 0, pos - start)
        } else {
            // SAFETY: as above.
            unsafe {
                (
                    slice(kc.f32().add(g * cap * hd), cap * hd),
                    slice(vc.f32().add(g * cap * hd), cap * hd),
                    start,
                    pos,
                )
            }
        };
        scores.clear();
        let mut mx = f32::NEG_INFINITY;
        for j in start..=pos {
            let mut s = dot(q, &kbase[j * hd..(j + 1) * hd]) * p.scale;
            if p.softcap > 0.0 {
                s = p.softcap * (s / p.softcap).tanh();
            }
            mx = mx.max(s);
            scores.push(s);
        }
        let mut sum = 0f32;
        for s in scores.iter_mut() {
            *s = exp_fast(*s - mx);
            sum += *s;
        }
        let o = unsafe { slice_mut(out.f32().add(t * p.out_stride as usize + h * hd), hd) };
        o.fill(0.0);
        for (jj, &w) in scores.iter().enumerate() {
            let v = &vbase[(start + jj) * hd..(start + jj + 1) * hd];
            let w = w / sum;
            for i in 0..hd {
                o[i] += w * v[i];
            }
        }
    };
    pool.run(&|tid, nt| {
        SCRATCH.with(|cell| {
            KV_WIDE.with(|wide| {
                let (mut scores, mut wide) = (cell.borrow_mut(), wide.borrow_mut());
                for item in split_range(items, nt, tid, 1) {
                    work(item, &mut scores, &mut wide);
                }
            })
        })
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_fast_matches_libm() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (a, b) = (exp_fast(x) as f64, (x as f64).exp());
            worst = worst.max(((a - b) / b).abs());
            x += 0.0137;
        }
        assert!(worst < 1e-6, "worst relative error {worst}");
        assert!(silu(-200.0).abs() < 1e-30 && (silu(200.0) - 200.0).abs() < 1e-3);
    }

    /// Values in [-2, 2) from a fixed linear congruential sequence.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
            })
            .collect()
    }

    /// An f16 cache holds each K and V element rounded to the nearest f16
    /// (the `half` crate's conversion), and attention over it gives the
    /// same bits as over an f32 cache holding those rounded values: with
    /// and without a sliding window, on the AVX2 path and the portable one
    /// (head dims 64 and 6).
    #[test]
    fn f16_cache_is_the_f32_cache_rounded() {
        let pool = ThreadPool::new(2);
        for (hd, window) in [(64usize, 0u32), (64, 9), (6, 0), (6, 5)] {
            let (nh, nkv, cap, rows, pos) = (4usize, 2usize, 24usize, 3usize, 17usize);
            let stride = (nh + 2 * nkv) * hd;
            let rope = |kv_type: KvType| RopeParams {
                pos: pos as u32,
                n_heads: nh as u32,
                n_kv_heads: nkv as u32,
                head_dim: hd as u32,
                rope_dim: hd as u32,
                theta: 10000.0,
                freq_scale: 1.0,
                style: 0,
                qkv_stride: stride as u32,
                capacity: cap as u32,
                freq_factors: 0,
                qk_norm: 0,
                norm_eps: 1e-5,
                kv_type: kv_type as u32,
            };
            let attn = |kv_type: KvType| AttnParams {
                pos: pos as u32,
                kv_len: (pos + rows) as u32,
                n_heads: nh as u32,
                n_kv_heads: nkv as u32,
                head_dim: hd as u32,
                capacity: cap as u32,
                scale: 0.125,
                window,
                qkv_stride: stride as u32,
                out_stride: (nh * hd) as u32,
                softcap: 0.0,
                kv_type: kv_type as u32,
            };
            // Earlier positions already cached (f16 values in both), then
            // the step's rows written by rope_kv_write.
            let early: Vec<f16> = values(nkv * cap * hd, 7)
                .into_iter()
                .map(f16::from_f32)
                .collect();
            let (mut k16, mut v16) = (
                early.clone(),
                early.iter().rev().copied().collect::<Vec<_>>(),
            );
            let mut k32: Vec<f32> = k16.iter().map(|x| x.to_f32()).collect();
            let mut v32: Vec<f32> = v16.iter().map(|x| x.to_f32()).collect();
            let qkv0 = values(rows * stride, hd as u64);
            let (mut qa, mut qb) = (qkv0.clone(), qkv0.clone());
            let ptr = |v: &mut [f32]| Ptr(v.as_mut_ptr().cast());
            let ptr16 = |v: &mut [f16]| Ptr(v.as_mut_ptr().cast());
            let p32 = rope(KvType::F32);
            rope_kv_write(
                &pool,
                &p32,
                rows,
                ptr(&mut qa),
                ptr(&mut k32),
                ptr(&mut v32),
                None,
                None,
            );
            let p16 = rope(KvType::F16);
            rope_kv_write(
                &pool,
                &p16,
                rows,
                ptr(&mut qb),
                ptr16(&mut k16),
                ptr16(&mut v16),
                None,
                None,
            );
            assert_eq!(qa, qb, "the rotated rows do not depend on the cache type");
            let mut rounded = 0;
            for (a, b) in k32.iter_mut().zip(&k16).chain(v32.iter_mut().zip(&v16)) {
                assert_eq!(
                    f16::from_f32(*a),
                    *b,
                    "hd {hd}: an f16 element is not the f32 one rounded"
                );
                rounded += (*a != b.to_f32()) as usize;
                *a = b.to_f32();
            }
            assert!(
                rounded > 0,
                "the step's K and V were all f16 values already"
            );
            let (mut oa, mut ob) = (vec![0f32; rows * nh * hd], vec![0f32; rows * nh * hd]);
            attention(
                &pool,
                &attn(KvType::F32),
                rows,
                ptr(&mut qa),
                ptr(&mut k32),
                ptr(&mut v32),
                ptr(&mut oa),
            );
            attention(
                &pool,
                &attn(KvType::F16),
                rows,
                ptr(&mut qb),
                ptr16(&mut k16),
                ptr16(&mut v16),
                ptr(&mut ob),
            );
            assert!(oa.iter().any(|&x| x != 0.0));
            assert_eq!(
                oa.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                ob.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "hd {hd}, window {window}: attention over the f16 cache"
            );
        }
    }
}
