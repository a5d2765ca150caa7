//! Table command -> kernel launches. The argument layout is the ABI in
//! `kernels/common.cuh`: `(Bind, Params, StepArg[, partials, n_split])`.

use crate::CudaBackend;
use crate::device::Dptr;
use crate::fusion;
use crate::knob::Knob;
use akunu_core::ops::*;
use akunu_core::table::{
    DispatchCmd, DispatchTable, MAX_BUFFERS, MAX_PARAM_BYTES, PatchType, RowMode, StepInfo,
};
use cudarc::driver::sys;
use std::ffi::c_void;
use std::mem::offset_of;

/// Most rows the matrix-vector kernels take (more go to the tiled kernel):
/// up to `GEMV_ONE_KERNEL_ROWS` in the decode kernels, up to this many in
/// their `_v8` twins (model.cu `GEMV_VERIFY_ROWS`), which keep each row's
/// arithmetic and add accumulators.
pub const GEMV_MAX_ROWS: u32 = 8;
/// Most rows of the decode gemv kernels (model.cu `GEMV_MAX_ROWS`).
const GEMV_ONE_KERNEL_ROWS: u32 = 4;
/// Shared memory the gemv kernel declares statically (its reduction
/// scratch), kept out of the dynamic allowance (lib.rs `load_kernels`).
pub const GEMV_STATIC_SMEM: u32 = 1024;
/// Static shared memory of the tensor-core gemv (gemv_tc.cu: `red`, the
/// split partials of up to 8 rows, the zero block and the bulk-copy form's
/// barriers), kept out of its dynamic allowance.
pub const TCG_STATIC_SMEM: u32 = 5120;
/// Warps of a tensor-core gemv block (gemv_tc.cu `TCG_WARPS`).
const TCG_WARPS: u32 = 8;
/// Bytes at the start of the attention scratch that hold the per-head
/// tickets of the fused split merge (`ATTN_TICKET_BYTES` in common.cuh).
pub const ATTN_TICKET_BYTES: u64 = 4096;
/// Splits of one head's key range in decode attention (flash-decoding).
const ATTN_MAX_SPLIT: u32 = 32;
/// Cache positions per split when sizing the split count (capacity / this,
/// at most `ATTN_MAX_SPLIT`), so that a short cache still spreads a head
/// over many blocks; with model.cu `DEC_MIN_KEYS` (the fewest keys a split
/// takes) at 16 too. Measured on SmolLM2's shape (RESULTS.md): 16 against
/// 256 gave tg128 1,222 against 1,219 tok/s with a 648-position cache and
/// 1,222 against 1,195 with 8,192 positions.
const ATTN_KEYS_PER_SPLIT: u32 = 16;
/// Rows of a step from which `k_rope_kv_write` takes several heads a block,
/// and how many (at most model.cu `ROPE_BATCH`): the heads share the row's
/// f64 angles, computed once, and their loads go out together. 8B Q4_0
/// pp512: 28.7 us a layer with a head a block, 10.7 us with 8 (Nsight
/// Compute, bench/RESULTS.md session 40).
const ROPE_MANY_ROWS: u32 = 16;
const ROPE_HEADS_PER_BLOCK: u32 = 8;

/// Head widths of the flash prefill attention kernels (model.cu
/// `k_attn_flash_<width>`); a head takes the narrowest that holds it.
pub const FLASH_WIDTHS: [u32; 3] = [64, 128, 256];
/// Query rows per flash attention block (model.cu `FA_BQ`).
const FLASH_ROWS: u32 = 64;

/// Dynamic shared memory of `k_attn_flash_<width>`: Q and K tiles of 64
/// rows of width + 4 floats and a V tile of 64 rows of width floats
/// (model.cu `attn_flash_body`).
pub const fn flash_smem_bytes(width: u32) -> u32 {
    (64 * (width + 4) * 2 + 64 * width) * 4
}

/// Head widths of the tensor-core flash prefill attention (model.cu
/// `k_attn_tc_<width>`); wider heads take `k_attn_flash_256`.
pub const TC_ATTN_WIDTHS: [u32; 2] = [64, 128];

/// Dynamic shared memory of `k_attn_tc_<width>`: Q and K tiles of 64 rows
/// of width + 8 halves and a transposed V tile of width rows of 72 halves,
/// each as hi and lo halves (model.cu `attn_tc_body`).
pub const fn tc_attention_smem_bytes(width: u32) -> u32 {
    (2 * 64 * (width + 8) * 2 + width * 72 * 2) * 2
}

/// The flash prefill attention kernel for heads of `head_dim` and its
/// shared memory, unless `AKUNU_CUDA_PF_ATTN=0` (the old `k_attn_prefill`,
/// for A/B runs) or the device could not allow it (`load_kernels`).
/// Returns the kernel, its shared memory and its block size: the
/// tensor-core kernel (`k_attn_tc_*`, its f16 instance with `f16`) for
/// heads up to 128 wide, unless `AKUNU_CUDA_PF_ATTN_TC=0`, else the
/// CUDA-core one (`k_attn_flash_*`, exact). `AKUNU_CUDA_PF_ATTN_F16=0`
/// keeps the exact instance under f16 products (A/B runs).
fn flash_attention(
    k: &crate::Kernels,
    head_dim: u32,
    f16: bool,
) -> Option<(sys::CUfunction, u32, u32)> {
    static PF_ATTN: Knob = Knob::new("AKUNU_CUDA_PF_ATTN");
    static PF_ATTN_TC: Knob = Knob::new("AKUNU_CUDA_PF_ATTN_TC");
    static PF_ATTN_F16: Knob = Knob::new("AKUNU_CUDA_PF_ATTN_F16");
    if PF_ATTN.is("0") {
        return None;
    }
    let f16 = f16 && !PF_ATTN_F16.is("0");
    if !PF_ATTN_TC.is("0")
        && let Some(i) = TC_ATTN_WIDTHS.iter().position(|&w| head_dim <= w)
        && let Some((f, smem)) = if f16 { k.attn_tc_f16[i] } else { k.attn_tc[i] }
    {
        return Some((f, smem, 128));
    }
    let i = FLASH_WIDTHS.iter().position(|&w| head_dim <= w)?;
    k.attn_flash[i].map(|(f, smem)| (f, smem, 256))
}

/// The multi-block sampler (sampling.cu `SMB_*`): block size, slice sizes
/// tried (at most `SMB_SLICE_MAX`), most blocks, most merged candidates and
/// the scratch size (at least `SMB_SCRATCH_BYTES`).
const SMB_THREADS: u32 = 512;
const SMB_SLICES: [u32; 3] = [1024, 2048, 4096];
const SMB_MAX_GRID: u32 = 1024;
const SMB_CAND_CAP: u64 = 4096;
pub const SAMPLE_SCRATCH_BYTES: u64 = 64 * 1024;

/// `StepArg` of common.cuh.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub struct StepArg {
    pub pos: u32,
    pub tok: u32,
    pub rows: u32,
    pub step: u32,
    pub patch: u32,
    /// Per-kernel launch options (`SMB_PICK*` of `k_sample_select`), else 0.
    pub flags: u32,
    pub ctl: u64,
}

/// `StepArg::flags` of `k_sample_select` (sampling.cu `SMB_PICK*`).
const SMB_PICK: u32 = 1;
const SMB_PICK_PATCHED: u32 = 2;

/// `GemvExtra` of model.cu: the norm fusion.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub struct GemvExtra {
    /// Device pointer of the RMSNorm weight, or 0: with one, the kernel
    /// stages `rmsnorm(x) * w` instead of `x` (see `fusion`).
    pub norm_w: u64,
    pub norm_eps: f32,
    /// The tensor-core gemv's warps per 16-row tile (`tcg_split`).
    pub tc_split: u32,
    /// Its groups per chunk of a warp's share: 1, or the bulk-copy form's
    /// chunk where that form runs the product's one-row steps (`tcb_plan`).
    pub tc_chunk: u32,
    /// The activation of the paired epilogue (`paired_act`), or `ACT_NONE`.
    pub pair_act: u32,
}

/// `RopeExtra` of model.cu: the RoPE + KV write fused into one-row decode
/// attention (`fusion::rope_into_attention`); all zero for plain attention.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub struct RopeExtra {
    /// Device pointer of the frequency divisors, or 0.
    pub ff: u64,
    pub on: u32,
    pub rope_dim: u32,
    pub theta: f32,
    pub freq_scale: f32,
    pub style: u32,
    pub _pad: u32,
}

/// The arguments some kernels take after `StepArg`.
#[derive(Copy, Clone, Debug)]
pub enum Tail {
    None,
    /// `(float* partials, u32 n_split, RopeExtra)` of decode attention.
    Attn {
        part: u64,
        n_split: u32,
        rope: RopeExtra,
    },
    /// `GemvExtra` of the matrix-vector kernel.
    Gemv(GemvExtra),
    /// `(char* scratch, u32 slice)` of the multi-block sampler.
    Sample {
        scratch: u64,
        slice: u32,
    },
    /// `(u16* scratch, u32 o0, u32 o1)` of the cuBLAS operand kernels
    /// (`blas`).
    Gemm {
        ptr: u64,
        o0: u32,
        o1: u32,
    },
}

/// One operation of a planned command: a kernel launch, or a cuBLAS
/// product (prefill: `blas`).
#[derive(Copy, Clone)]
pub enum Op {
    Kernel(Launch),
    Gemm(crate::blas::Gemm),
    /// A weight dequantization into a slot of the cuBLAS scratch, on the
    /// side stream if the flag says so (`blas::Lane::dequantize`).
    Dequant(Launch, crate::blas::Lane, usize, bool),
    /// The products reading a slot are queued: it may be written again
    /// once they are done (`blas::Lane::release`).
    Release(crate::blas::Lane, usize),
}

impl Op {
    /// Enqueues the operation on `stream` (or records it, while capturing).
    pub fn fire(&self, stream: sys::CUstream) -> Result<(), String> {
        match self {
            Op::Kernel(l) => l.fire(stream),
            Op::Gemm(g) => g.fire(stream),
            Op::Dequant(l, lane, slot, side) => lane.dequantize(l, *slot, *side, stream),
            Op::Release(lane, slot) => lane.release(*slot, stream),
        }
    }

    pub fn is_gemm(&self) -> bool {
        matches!(self, Op::Gemm(_))
    }
}

/// One kernel launch, with its arguments by value.
#[derive(Copy, Clone)]
pub struct Launch {
    pub f: sys::CUfunction,
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub smem: u32,
    pub bind: [u64; MAX_BUFFERS],
    pub params: [u8; MAX_PARAM_BYTES],
    pub step: StepArg,
    /// Arguments after `StepArg`, for the kernels that take any.
    pub tail: Tail,
    /// Launch with programmatic stream serialization (Hopper): the kernel may
    /// start before the previous one ends and waits in its prologue.
    pub pdl: bool,
}

impl Launch {
    /// Enqueues the launch on `stream` (or records it, while capturing).
    pub fn fire(&self, stream: sys::CUstream) -> Result<(), String> {
        let mut bind = self.bind;
        let mut params = self.params;
        let mut step = self.step;
        let (gd, rd) = (GemvExtra::default(), RopeExtra::default());
        let (mut part, mut n_split, mut last, mut gemv, mut rope) = match self.tail {
            Tail::Attn {
                part,
                n_split,
                rope,
            } => (part, n_split, 0, gd, rope),
            Tail::Sample { scratch, slice } => (scratch, slice, 0, gd, rd),
            Tail::Gemm { ptr, o0, o1 } => (ptr, o0, o1, gd, rd),
            Tail::Gemv(g) => (0, 0, 0, g, rd),
            Tail::None => (0, 0, 0, gd, rd),
        };
        let mut args: [*mut c_void; 6] = [
            bind.as_mut_ptr() as *mut c_void,
            params.as_mut_ptr() as *mut c_void,
            &mut step as *mut StepArg as *mut c_void,
            &mut part as *mut u64 as *mut c_void,
            &mut n_split as *mut u32 as *mut c_void,
            &mut last as *mut u32 as *mut c_void,
        ];
        let n = match self.tail {
            Tail::None => 3,
            Tail::Sample { .. } => 5,
            Tail::Gemm { .. } => 6,
            Tail::Attn { .. } => {
                args[5] = &mut rope as *mut RopeExtra as *mut c_void;
                6
            }
            Tail::Gemv(_) => {
                args[3] = &mut gemv as *mut GemvExtra as *mut c_void;
                4
            }
        };
        if self.pdl {
            // SAFETY: an all-zero attribute is valid plain data; the id and
            // value set below are the documented pair.
            let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            let cfg = sys::CUlaunchConfig {
                gridDimX: self.grid.0,
                gridDimY: self.grid.1,
                gridDimZ: self.grid.2,
                blockDimX: self.block,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: self.smem,
                hStream: stream,
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: as for the plain launch below; `cfg` and `attr` live
            // across the call, and every kernel begins with
            // `griddepcontrol.wait` (AKUNU_PROLOGUE), so starting early
            // never lets it read what the previous kernel still writes.
            return unsafe {
                sys::cuLaunchKernelEx(&cfg, self.f, args[..n].as_mut_ptr(), std::ptr::null_mut())
            }
            .result()
            .map_err(|e| e.to_string());
        }
        // SAFETY: the function comes from our loaded module and its
        // parameter list is the ABI above: each pointer in `args` points at
        // a value of the parameter's size (the params struct is at most 64
        // bytes and `params` holds 64). The driver copies the values before
        // returning, so the locals may go out of scope afterwards. Device
        // pointers in `bind` were range-checked by `validate` and `plan`.
        unsafe {
            sys::cuLaunchKernel(
                self.f,
                self.grid.0,
                self.grid.1,
                self.grid.2,
                self.block,
                1,
                1,
                self.smem,
                stream,
                args[..n].as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|e| e.to_string())
    }
}

/// The patch each kernel resolves itself, and where: a table that patches
/// anything else is rejected at load (the CPU backend patches raw bytes;
/// kernels here patch named fields, so the two must be the same fields).
pub fn check_patch(c: &DispatchCmd) -> Result<(), String> {
    let (o1, o2) = (c.patch_offset_1 as usize, c.patch_offset_2 as usize);
    let ok = match (c.kernel, c.patch) {
        (_, PatchType::None) => true,
        (KernelId::Embedding, PatchType::TokenOffset) => true,
        (KernelId::Argmax, PatchType::ArgmaxOutput) => true,
        (KernelId::RopeKvWrite, PatchType::Position) => o1 == offset_of!(RopeParams, pos),
        (KernelId::Attention, PatchType::KvSeqLen) => o1 == offset_of!(AttnParams, kv_len),
        (KernelId::Attention, PatchType::PosAndKv) => {
            o1 == offset_of!(AttnParams, pos) && o2 == offset_of!(AttnParams, kv_len)
        }
        (KernelId::GumbelSample, PatchType::KvSeqLen) => o1 == offset_of!(SampleParams, kv_len),
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "the CUDA backend cannot apply patch {} at offsets {o1}/{o2} to a {} command",
            c.patch.name(),
            c.kernel.name()
        ))
    }
}

/// Splits of a decode attention at most (the partials' scratch is sized
/// for this many).
fn attn_split(p: &AttnParams) -> u32 {
    p.capacity
        .div_ceil(attn_keys_per_split())
        .clamp(1, ATTN_MAX_SPLIT)
}

/// The splits of decode attention (verification rows take the same
/// layout): `attn_split`, but no more than the GPU holds at once over the
/// heads, so that a one-row step's blocks run in one wave. When one kernel
/// served every head width (122 registers a thread, 4 blocks an SM: 528 on
/// an H200), 32 heads x 32 splits ran as two waves; with this cap (16
/// splits), after a 512-token prompt llama-1b F16 went from 974 to 1,043
/// tok/s and 8B Q4_0 from 327.7 to 345.6 (bench/RESULTS.md, session 10).
/// The per-width kernels hold 8 to 10 blocks an SM, which allows 32 splits
/// in one wave; after a 512-token prompt that measured 390.1 against 386.3
/// tok/s at 16 on 8B Q4_0 (heads of 128), but 1,075.5 against 1,098.4 on
/// llama-1b F16 (heads of 64, whose splits are half the work): heads up to
/// 64 wide keep the bound of 4 blocks an SM (session 15). SmolLM2's 9 heads
/// keep 32 splits either way.
fn attn_split_resident(be: &CudaBackend, p: &AttnParams) -> u32 {
    // `AKUNU_CUDA_ATTN_SPLITS=N` caps the splits at N instead (A/B runs).
    static SPLITS: Knob = Knob::new("AKUNU_CUDA_ATTN_SPLITS");
    if let Some(n) = SPLITS.number::<u32>().filter(|&n| n >= 1) {
        return attn_split(p).min(n);
    }
    let occupancy = if p.head_dim <= 64 {
        0 // not asked: the bound below does not use it
    } else {
        be.occupancy(attn_decode_kernel(be, p), 128, 0)
    };
    attn_split_one_wave(p, be.sm_count(), occupancy)
}

/// Blocks an SM that heads up to 64 wide count on in `attn_split_one_wave`
/// (the old single kernel's occupancy; see `attn_split_resident`).
const ATTN_BLOCKS_PER_SM_64: u32 = 4;

/// `attn_split(p)` bounded so that the heads' splits fit `sm_count` SMs at
/// `occupancy` blocks each (`ATTN_BLOCKS_PER_SM_64` for heads up to 64).
fn attn_split_one_wave(p: &AttnParams, sm_count: u32, occupancy: u32) -> u32 {
    let per_sm = if p.head_dim <= 64 {
        ATTN_BLOCKS_PER_SM_64
    } else {
        occupancy.max(1)
    };
    let per_head = (sm_count * per_sm / p.n_heads.max(1)).max(1);
    attn_split(p).min(per_head)
}

/// The decode attention kernel for `p`'s head width (at most 256: `plan`
/// rejects wider heads).
fn attn_decode_kernel(be: &CudaBackend, p: &AttnParams) -> sys::CUfunction {
    let k = &be.kernels().attn_decode;
    match p.head_dim {
        0..=64 => k[0],
        65..=128 => k[1],
        _ => k[2],
    }
}

/// `ATTN_KEYS_PER_SPLIT`, or `AKUNU_CUDA_ATTN_KEYS` (developer A/B runs).
fn attn_keys_per_split() -> u32 {
    static KEYS: Knob = Knob::new("AKUNU_CUDA_ATTN_KEYS");
    KEYS.number()
        .filter(|&k| k >= 1)
        .unwrap_or(ATTN_KEYS_PER_SPLIT)
}

/// Bytes of attention scratch the table's decode steps need: the tickets,
/// then the split partials of every query row a decode-style step may have
/// (sized for `GEMV_MAX_ROWS` whatever the table, so that the decode, prefill
/// and verification tables of a model share one allocation).
pub fn attn_scratch_bytes(table: &DispatchTable) -> u64 {
    let rows = GEMV_MAX_ROWS as u64;
    table
        .commands
        .iter()
        .filter(|c| c.kernel == KernelId::Attention)
        .map(|c| {
            let p: AttnParams = c.params();
            ATTN_TICKET_BYTES
                + rows * p.n_heads as u64 * attn_split(&p) as u64 * (p.head_dim as u64 + 2) * 4
        })
        .max()
        .unwrap_or(0)
}

/// Most rows of a step of `table` that launch the decode way: the
/// matrix-vector kernel with the launch-time fusions, decode attention one
/// query row per `grid.z`, programmatic dependent launch. Every row of such
/// a step is computed exactly as a one-row step at its position would be
/// (the kernels' per-row arithmetic does not depend on the row count), which
/// is what lossless speculative verification needs; larger steps take the
/// GEMM and prefill attention, whose sums are ordered differently. The limit
/// is what the gemv's staged input (every row of the widest product) leaves
/// in shared memory, at most `GEMV_MAX_ROWS`; 0 when not even one row fits.
pub fn decode_rows(be: &CudaBackend, table: &DispatchTable) -> u32 {
    let budget = be.smem_optin().saturating_sub(GEMV_STATIC_SMEM) as u64;
    let mut r = GEMV_MAX_ROWS as u64;
    for c in &table.commands {
        match c.kernel {
            KernelId::Gemv if c.rows == RowMode::AllRows => {
                let p: GemvParams = c.params();
                let per_row = p.k.div_ceil(32) as u64 * 36 * 4;
                r = r.min(budget / per_row.max(1));
                // The tensor-core gemv must fit every row too, or the rows
                // of a step would not be computed as a one-row step's.
                if let Some(dt) = tcg_type(&p) {
                    let tc_budget = be.smem_optin().saturating_sub(TCG_STATIC_SMEM) as u64;
                    r = r.min(tc_budget / tcg_smem(dt, p.k, 1).max(1));
                }
            }
            KernelId::Attention => {
                let p: AttnParams = c.params();
                r = r.min(ATTN_TICKET_BYTES / 4 / (p.n_heads as u64).max(1));
            }
            _ => {}
        }
    }
    r as u32
}

/// The multi-block sampler's `(slice, grid)` for these params, or `None`
/// for the single-block `k_gumbel_sample`. It covers greedy steps (penalty
/// only), no filter, and top-k >= 1 (with or without top-p / min-p) when the
/// blocks' best `min(top_k, slice)` keys fit the merge (`SMB_CAND_CAP`):
/// the smallest slice that fits is taken, for the most blocks. A filter
/// without top-k (top-p or min-p alone) can keep most of the vocabulary,
/// which the merge cannot hold: single block. The test mirrors the
/// kernel's (`temperature == 0`, `no_filter`), NaN included.
pub fn sample_grid(p: &SampleParams) -> Option<(u32, u32)> {
    let n = p.n_vocab;
    if n == 0 {
        return None;
    }
    let greedy = p.temperature == 0.0;
    let no_filter = p.no_filter();
    SMB_SLICES.iter().find_map(|&slice| {
        let g = n.div_ceil(slice);
        let fits = greedy
            || no_filter
            || (p.top_k >= 1 && g as u64 * p.top_k.min(slice) as u64 <= SMB_CAND_CAP);
        (g <= SMB_MAX_GRID && fits).then_some((slice, g))
    })
}

/// The launches of one `GumbelSample` row, from `l` (bindings, params and
/// step already set for that row): the multi-block pair (the prep kernel
/// only, for greedy) or the single-block kernel. With `pick` (the
/// conveyor's address and whether the next Argmax patches its slot; see
/// `sampler_picks`) the select kernel also does that Argmax.
fn gumbel_launches(be: &CudaBackend, mut l: Launch, pick: Option<(u64, bool)>) -> Vec<Launch> {
    let p: SampleParams =
        bytemuck::pod_read_unaligned(&l.params[..std::mem::size_of::<SampleParams>()]);
    let k = be.kernels();
    let grid = if be.sample_multi_block() {
        sample_grid(&p).zip(be.sample_scratch())
    } else {
        None
    };
    let Some(((slice, g), scratch)) = grid else {
        l.f = k.gumbel_sample;
        l.grid = (1, 1, 1);
        l.block = 1024;
        return vec![l];
    };
    l.grid = (g, 1, 1);
    l.block = SMB_THREADS;
    l.tail = Tail::Sample { scratch, slice };
    let mut out = vec![Launch {
        f: k.sample_prep,
        ..l
    }];
    if p.temperature != 0.0 {
        let mut sel = Launch {
            f: k.sample_select,
            ..l
        };
        if let Some((tokens, patched)) = pick {
            sel.bind[PICK_CONVEYOR_SLOT] = tokens;
            sel.step.flags = SMB_PICK | if patched { SMB_PICK_PATCHED } else { 0 };
        }
        out.push(sel);
    }
    out
}

/// The binding where a picking `k_sample_select` finds the conveyor.
const PICK_CONVEYOR_SLOT: usize = 7;

/// Whether the `GumbelSample` command `i` is launched as a multi-block
/// select that also does command `i + 1`, an Argmax over the same logits:
/// the select kernel's last block holds every kept candidate, so it picks
/// the best one itself and the Argmax launch (a pass over the whole
/// vocabulary, about 8 us a token) is dropped. Only where the select
/// kernel merges (a filter: top-k, with or without top-p / min-p); with no
/// filter every logit stays a candidate and the Argmax runs.
/// `AKUNU_CUDA_SAMPLE_PICK=0` keeps the Argmax (A/B runs). The answer
/// depends only on the table and the backend's settings, so the Argmax's
/// own `plan` call sees the same answer.
pub fn sampler_picks(be: &CudaBackend, table: &DispatchTable, i: usize) -> bool {
    static PICK: Knob = Knob::new("AKUNU_CUDA_SAMPLE_PICK");
    if PICK.is("0") {
        return false;
    }
    let (Some(s), Some(a)) = (table.commands.get(i), table.commands.get(i + 1)) else {
        return false;
    };
    if s.kernel != KernelId::GumbelSample || a.kernel != KernelId::Argmax || s.rows != a.rows {
        return false;
    }
    let (sb, ab) = (s.bindings(), a.bindings());
    if sb.is_empty() || ab.len() < 2 || sb[0] != ab[0] {
        return false;
    }
    let p: SampleParams = s.params();
    p.temperature != 0.0
        && !p.no_filter()
        && be.sample_multi_block()
        && be.sample_scratch().is_some()
        && sample_grid(&p).is_some()
}

/// Whether a one-row gemv of `total_rows` rows of type `dtype` takes the
/// two-rows-per-warp kernel: for quantized weights, where one staged input
/// float per weight would make shared-memory bandwidth the limit, once
/// there are enough rows to keep every SM's warps busy with two each.
/// `AKUNU_CUDA_GEMV_RPW=1` turns it off (A/B runs).
fn gemv_two_rows(total_rows: u32, dtype: u32, sm_count: u32) -> bool {
    static RPW: Knob = Knob::new("AKUNU_CUDA_GEMV_RPW");
    let off = RPW.is("1");
    let quantized = matches!(
        akunu_core::dtype::DType::from_ggml(dtype),
        Some(
            akunu_core::dtype::DType::Q4_0
                | akunu_core::dtype::DType::Q4_1
                | akunu_core::dtype::DType::Q8_0
        )
    );
    !off && quantized && total_rows >= sm_count * 24
}

/// The weight type of a product that the tensor-core gemv (`gemv_tc.cu`)
/// takes: every segment F16, Q8_0, Q4_0 or Q4_1 (one type), k a multiple of
/// 64. `AKUNU_CUDA_TCG=0` keeps the f32 kernels (A/B runs).
fn tcg_type(p: &GemvParams) -> Option<akunu_core::dtype::DType> {
    use akunu_core::dtype::DType;
    static TCG: Knob = Knob::new("AKUNU_CUDA_TCG");
    if TCG.is("0") || !p.k.is_multiple_of(64) {
        return None;
    }
    let n_seg = (p.n_seg as usize).clamp(1, 3);
    if !p.dtype[..n_seg].iter().all(|&d| d == p.dtype[0]) {
        return None;
    }
    match DType::from_ggml(p.dtype[0])? {
        d @ (DType::F16 | DType::Q8_0 | DType::Q4_0 | DType::Q4_1) => Some(d),
        _ => None,
    }
}

/// Groups a tensor-core gemv warp loads ahead (gemv_tc.cu `tcg_ahead`).
fn tcg_ahead(dt: akunu_core::dtype::DType) -> u32 {
    use akunu_core::dtype::DType;
    if matches!(dt, DType::Q4_0 | DType::Q4_1) {
        4
    } else {
        3
    }
}

/// Elements of a tensor-core gemv lane-block (gemv_tc.cu `TcgT::LB`).
fn tcg_lane_block(dt: akunu_core::dtype::DType) -> u32 {
    if dt == akunu_core::dtype::DType::F16 {
        16
    } else {
        32
    }
}

/// Dynamic shared memory of the tensor-core gemv for `rows` input rows:
/// one B image per row, then Q4_1's block sums, then the groups' sums of
/// squares (gemv_tc.cu `tcg_body`).
pub fn tcg_smem(dt: akunu_core::dtype::DType, k: u32, rows: u32) -> u64 {
    let lb = tcg_lane_block(dt);
    // Products per group: a lane-block's elements over the 4 of a k-slot.
    let mmas = lb as u64 / 4;
    let groups = (k / lb).div_ceil(4) as u64;
    let image = rows as u64 * groups * 16 * mmas * 4;
    let sums = if dt == akunu_core::dtype::DType::Q4_1 {
        rows as u64 * groups * 16
    } else {
        0
    };
    // Each group's sum of squares of the input (the norm fusion's, under
    // the warp-local staging: gemv_tc.cu `tcg_stage_warp`).
    let squares = rows as u64 * groups * 4;
    image + sums + squares
}

/// Warps per 16-row tile of the tensor-core gemv (each takes every S-th
/// group of the tile's k range). A block runs 8 / S tiles at a time (a
/// round) and the grid holds two blocks per SM (`TCG_MINB`), so a product
/// takes ceil(row groups / blocks) rounds. A round costs a warp its share
/// of the tile's groups (groups / S) plus about two groups' time in which
/// its pipeline restarts (the first loads' latency and the split merge): S
/// minimizes rounds x (groups / S + 2), ties going to the larger S, and
/// is at most 8 and at most the groups there are (rounded up to a power
/// of two). On the 8B Q4_0 shape this picks S 1 for gate_up (24.3 against
/// 25.8 us with the former rule's S 2: one round instead of two), 2 for
/// the 49,152-row logits (37.9 against 44.2 us with S 1: 3 rounds of 16
/// groups instead of 2 of 32, the second one 45% full) and 4 for qkv
/// (8.7 against 9.8 us with S 8); the probe's other S measured slower
/// (bench/RESULTS.md, session 12). The count depends on the shape alone,
/// so that verification steps add in the one-row order.
/// `AKUNU_CUDA_TCG_SPLIT=1|2|4|8` forces it (A/B runs), and
/// `AKUNU_CUDA_TCG_SPLIT=warps` keeps the former rule: the fewest warps
/// per tile that give every SM 16 warps of work.
fn tcg_split(tiles: u32, groups: u32, sm_count: u32) -> u32 {
    static SPLIT: Knob = Knob::new("AKUNU_CUDA_TCG_SPLIT");
    if let Some(s) = SPLIT.number::<u32>().filter(|s| [1, 2, 4, 8].contains(s)) {
        return s;
    }
    let cap = groups.next_power_of_two().clamp(1, TCG_WARPS);
    if SPLIT.is("warps") {
        let mut s = 1;
        while s < cap && tiles * s < sm_count * 16 {
            s *= 2;
        }
        return s;
    }
    // The restart cost in groups (`AKUNU_CUDA_TCG_RESTART`, A/B runs).
    static RESTART: Knob = Knob::new("AKUNU_CUDA_TCG_RESTART");
    let restart = RESTART.number::<u64>().unwrap_or(2);
    let blocks = (2 * sm_count).max(1);
    let mut best = (u64::MAX, 1);
    let mut s = 1;
    while s <= cap {
        let rounds = tiles.div_ceil(TCG_WARPS / s).div_ceil(blocks) as u64;
        let cost = rounds * (groups.div_ceil(s) as u64 + restart);
        if cost <= best.0 {
            best = (cost, s);
        }
        s *= 2;
    }
    best.1
}

/// Bytes of quants per weight row in one chunk of the bulk-copy gemv
/// (gemv_tc.cu `TCB_QROW`), and its ring stages per warp (`TCB_NST`).
const TCB_QROW: u32 = 512;
const TCB_NST: u32 = 2;

/// How the bulk-copy form of the tensor-core gemv (gemv_tc.cu `tcb_body`)
/// runs a product's one-row steps.
#[derive(Copy, Clone, Debug, PartialEq)]
struct TcbPlan {
    /// Groups per chunk (`TcbT::CG`).
    chunk: u32,
    /// Warps per 16-row tile.
    split: u32,
    /// Dynamic shared memory: B image, block sums, then the warps' rings.
    smem: u64,
}

/// The bulk-copy plan of a product, or `None` where the form cannot take
/// it: its copies need every row's quants and scales, and every chunk's,
/// at 16-byte multiples (Q4_0 and Q8_0: k a multiple of 256; Q4_1: 128;
/// F16: always), and its ring must fit beside the B image. The plan
/// depends on the shape alone, not on the step's rows, because the
/// verification kernels must add a product's groups in the one-row order.
/// Split: the most warps per tile, up to 8, that leave each warp two
/// chunks of a row, so that its ring has a chunk in flight while it
/// computes (the best or within 3% of it on every shape of the 1B and 8B
/// models, bench/cuda/gemv_probe.cu). The form runs one block per SM, so
/// products of too few row tiles for that (SmolLM2's, at most 576 rows
/// but for the logits) keep the register form: at least 3/8 of the SMs
/// must get a block. `AKUNU_CUDA_TCB=0` turns the form off (A/B runs).
fn tcb_plan(
    dt: akunu_core::dtype::DType,
    k: u32,
    tiles: u32,
    sm_count: u32,
    smem_budget: u64,
) -> Option<TcbPlan> {
    use akunu_core::dtype::DType;
    static TCB: Knob = Knob::new("AKUNU_CUDA_TCB");
    if TCB.is("0") {
        return None;
    }
    // Bytes of quants per lane-block and row, of scale per 32-element block.
    let (qb, sb, align) = match dt {
        DType::F16 => (32, 0, 64),
        DType::Q8_0 => (32, 2, 256),
        DType::Q4_0 => (16, 2, 256),
        DType::Q4_1 => (16, 4, 128),
        _ => return None,
    };
    if !k.is_multiple_of(align) {
        return None;
    }
    let chunk = TCB_QROW / (4 * qb);
    let pitch = TCB_QROW + if qb == 16 { 64 } else { 16 };
    let stage = 16 * pitch + 16 * chunk * 4 * sb;
    let head = tcg_smem(dt, k, 1).next_multiple_of(128);
    let smem = head + (TCG_WARPS * TCB_NST * stage) as u64;
    if smem > smem_budget {
        return None;
    }
    let chunks = (k / tcg_lane_block(dt)).div_ceil(4).div_ceil(chunk);
    let mut split = 1;
    while split < TCG_WARPS && split * 4 <= chunks {
        split *= 2;
    }
    if tiles.div_ceil(TCG_WARPS / split) * 8 < sm_count * 3 {
        return None;
    }
    // 4-bit products are bound by their arithmetic's latency more than by
    // loads in flight, and keep the register form (two blocks of 8 warps
    // per SM). Alone, it beats this one on the 8B shape's gate_up (25.9
    // against 29.0 us) and down (18.4 against 20.4 us) and loses on its qkv
    // and o (9.9 against 8.8, 7.1 against 6.9 us); in the decode graph,
    // the 8B Q4_0 model runs at 392.8 tok/s with the register form
    // throughout and 337.8 with the bulk-copy form on qkv and o
    // (bench/RESULTS.md). `AKUNU_CUDA_TCB=all` lifts this preference (A/B
    // runs, and the GPU tests' coverage of the 4-bit bulk-copy form).
    if matches!(dt, DType::Q4_0 | DType::Q4_1) && !TCB.is("all") {
        return None;
    }
    Some(TcbPlan { chunk, split, smem })
}

/// The activation that the gate | up gemv at `i` applies in its epilogue
/// in a decode step of `rows` input rows (`fusion::act_pair`), or `None`.
/// Only the tensor-core gemv (both forms, and its verification twins) has
/// that epilogue, so the product must take it: a type it takes, rows it
/// can stage, 16-byte aligned weights. The down product's launch asks the
/// same question of its predecessor, so both agree.
fn paired_act(
    be: &CudaBackend,
    table: &DispatchTable,
    i: usize,
    rows: u32,
) -> Result<Option<u32>, String> {
    let Some(act) = fusion::act_pair(table, i) else {
        return Ok(None);
    };
    let c = &table.commands[i];
    let p: GemvParams = c.params();
    let Some(dt) = tcg_type(&p) else {
        return Ok(None);
    };
    let budget = (be.smem_optin() - TCG_STATIC_SMEM) as u64;
    if rows > GEMV_MAX_ROWS || tcg_smem(dt, p.k, rows) > budget {
        return Ok(None);
    }
    for b in &c.bindings()[2..4] {
        if !(be.dptr(b.buffer)?.0 + b.offset).is_multiple_of(16) {
            return Ok(None);
        }
    }
    Ok(Some(act))
}

/// Whether a multi-row product runs on the tensor cores (`k_gemm_tc`, or
/// cuBLAS for steps of many rows: `blas`): every segment F16, Q8_0, Q4_0
/// or Q4_1, and whole 32-element blocks. `AKUNU_CUDA_TC=0` keeps the f32
/// tiled kernel (A/B runs).
fn gemm_on_tensor_cores(p: &GemvParams) -> bool {
    use akunu_core::dtype::DType;
    static TC: Knob = Knob::new("AKUNU_CUDA_TC");
    if TC.is("0") {
        return false;
    }
    let n_seg = (p.n_seg as usize).clamp(1, 3);
    p.k.is_multiple_of(32)
        && p.dtype[..n_seg].iter().all(|&d| {
            matches!(
                DType::from_ggml(d),
                Some(DType::F16 | DType::Q8_0 | DType::Q4_0 | DType::Q4_1)
            )
        })
}

/// The operations that run command `i` for `step`: kernel launches, and
/// for prefill products cuBLAS calls (`blas`). `chain` is `Some((ctl, s))`
/// inside a chunk graph: step `s` of the chunk, positions read from the
/// control block at `ctl`.
pub fn plan(
    be: &CudaBackend,
    table: &DispatchTable,
    i: usize,
    c: &DispatchCmd,
    step: &StepInfo,
    chain: Option<(Dptr, u32)>,
    decode: bool,
) -> Result<Vec<Op>, String> {
    let k = be.kernels();
    let rows = step.rows;
    let mut bind = [0u64; MAX_BUFFERS];
    let mut lens = [0u64; MAX_BUFFERS];
    for (slot, b) in c.bindings().iter().enumerate() {
        let (ptr, len) = be.dptr(b.buffer)?;
        // Patched bindings are passed at their base: the kernel adds the
        // step's slot.
        let patched = matches!(
            (c.patch, slot),
            (PatchType::TokenOffset, 0) | (PatchType::ArgmaxOutput, 1)
        );
        let off = if patched { 0 } else { b.offset };
        if off > len {
            return Err(format!(
                "binding {slot} offset {off} beyond its {len} bytes"
            ));
        }
        bind[slot] = ptr + off;
        lens[slot] = len - off;
    }
    // A command the launcher fused into a neighbour runs no kernel.
    if decode && c.kernel != KernelId::Gemv && fusion::decode_role(table, i) == fusion::Role::Skip {
        return Ok(Vec::new());
    }
    // Per-step extents the static validation cannot see: the conveyor
    // slots a step touches (outside graphs; chains check their whole range
    // up front).
    if chain.is_none() {
        match c.patch {
            PatchType::TokenOffset if (step.tok as u64 + rows as u64) * 4 > lens[0] => {
                return Err(format!(
                    "conveyor slots {}..{} out of range",
                    step.tok,
                    step.tok + rows
                ));
            }
            PatchType::ArgmaxOutput if (step.tok as u64 + rows as u64 + 1) * 4 > lens[1] => {
                return Err(format!("conveyor slot {} out of range", step.tok + rows));
            }
            _ => {}
        }
    }
    let (ctl, s) = chain.unwrap_or((0, 0));
    let arg = StepArg {
        pos: step.pos,
        tok: step.tok,
        rows,
        step: s,
        patch: c.patch as u32,
        flags: 0,
        ctl,
    };
    let mk = |f: sys::CUfunction, grid: (u32, u32, u32), block: u32, smem: u32| Launch {
        f,
        grid,
        block,
        smem,
        bind,
        params: c.params,
        step: arg,
        tail: Tail::None,
        // Decode steps only: a prefill grid runs in several waves, and
        // dependents launched early would sit waiting on SMs its last wave
        // needs (measured: pp512 of SmolLM2 fell from 32.9k to 17.2k tok/s
        // with PDL on every launch, while tg128 rose from 817 to 946).
        pdl: be.pdl() && decode,
    };
    let out = match c.kernel {
        KernelId::Embedding => vec![mk(k.embedding, (rows, 1, 1), 256, 0)],
        KernelId::RmsNorm => vec![mk(k.rmsnorm, (rows, 1, 1), 512, 0)],
        KernelId::ResidualRmsNorm => vec![mk(k.residual_rmsnorm, (rows, 1, 1), 512, 0)],
        KernelId::Gemv => {
            let mut p: GemvParams = c.params();
            let total = p.total_rows();
            let mut l = mk(k.gemv, (1, 1, 1), 256, 0);
            let mut r = rows;
            let last_row = c.rows == RowMode::LastRow && rows > 1;
            if last_row {
                r = 1;
            }
            l.step.rows = r;
            let mut extra = GemvExtra::default();
            if decode {
                match fusion::decode_role(table, i) {
                    fusion::Role::AccumulateInto(h) => {
                        l.bind[1] = be.dptr(h.buffer)?.0 + h.offset;
                        p.accumulate = 1;
                        l.params[..std::mem::size_of::<GemvParams>()]
                            .copy_from_slice(bytemuck::bytes_of(&p));
                    }
                    fusion::Role::NormInput { x, w, eps } => {
                        l.bind[0] = be.dptr(x.buffer)?.0 + x.offset;
                        extra.norm_w = be.dptr(w.buffer)?.0 + w.offset;
                        extra.norm_eps = eps;
                    }
                    fusion::Role::Skip | fusion::Role::Plain => {}
                }
                if let Some(act) = paired_act(be, table, i, r)? {
                    extra.pair_act = act;
                }
                if i > 0 && paired_act(be, table, i - 1, r)?.is_some() {
                    // The gate | up product before this one applied it.
                    p.input_act = ACT_NONE;
                    l.params[..std::mem::size_of::<GemvParams>()]
                        .copy_from_slice(bytemuck::bytes_of(&p));
                }
            }
            if last_row {
                // Only the last input row matters (logits of prefill).
                l.bind[0] += (rows as u64 - 1) * p.x_stride as u64 * 4;
            }
            // Staged rows are padded by 4 floats per 32 (model.cu `xs_row`).
            let smem = r as u64 * p.k.div_ceil(32) as u64 * 36 * 4;
            let n_seg = (p.n_seg as usize).clamp(1, 3);
            // The tensor-core gemv reads weight rows with 16-byte copies.
            let tc = tcg_type(&p)
                .filter(|_| r <= GEMV_MAX_ROWS)
                .filter(|_| l.bind[2..2 + n_seg].iter().all(|&a| a % 16 == 0))
                .map(|dt| (dt, tcg_smem(dt, p.k, r)))
                .filter(|&(_, m)| m <= (be.smem_optin() - TCG_STATIC_SMEM) as u64);
            if let Some((dt, tc_smem)) = tc {
                let Some(tk) = k.gemv_tc.iter().find(|t| t.dtype == dt as u32) else {
                    unreachable!("tcg_type returns only the types of gemv_tc")
                };
                let groups = (p.k / tcg_lane_block(dt)).div_ceil(4);
                let tiles = total.div_ceil(16);
                let budget = (be.smem_optin() - TCG_STATIC_SMEM) as u64;
                l.smem = tc_smem as u32;
                if let Some(plan) = tcb_plan(dt, p.k, tiles, be.sm_count(), budget) {
                    // Verification steps take the bulk-copy form's split and
                    // chunk order too, so that they add as its one-row steps.
                    extra.tc_split = plan.split;
                    extra.tc_chunk = plan.chunk;
                    l.f = tk.verify;
                    if r == 1 {
                        l.f = tk.bulk;
                        l.smem = plan.smem as u32;
                    }
                } else {
                    extra.tc_split = tcg_split(tiles, groups, be.sm_count());
                    extra.tc_chunk = 1;
                    // Warps with 2 or more rounds of groups in flight take
                    // the unguarded instance: 8B Q4_0 gate_up 33.2 -> 25.9 us.
                    let full = groups.div_ceil(extra.tc_split) >= 2 * tcg_ahead(dt);
                    l.f = match (r, full) {
                        (1, true) => tk.one_full,
                        (1, false) => tk.one,
                        _ => tk.verify,
                    };
                }
                let row_groups = tiles.div_ceil(TCG_WARPS / extra.tc_split);
                l.block = TCG_WARPS * 32;
                // A resident grid (the input is staged once per block);
                // one block per row group measured no faster.
                let resident = be.sm_count() * be.occupancy(l.f, l.block, l.smem);
                l.grid = (row_groups.min(resident), 1, 1);
                l.tail = Tail::Gemv(extra);
            } else if r <= GEMV_MAX_ROWS && smem <= (be.smem_optin() - GEMV_STATIC_SMEM) as u64 {
                let mut rpw = 1;
                let one_type = p.dtype[..n_seg].iter().all(|&d| d == p.dtype[0]);
                if r > GEMV_ONE_KERNEL_ROWS {
                    l.f = k.gemv_v8;
                    if one_type
                        && let Some(&(_, f)) = k.gemv_typed_v8.iter().find(|t| t.0 == p.dtype[0])
                    {
                        l.f = f;
                    }
                } else if one_type
                    && let Some(&(_, f1, f2)) = k.gemv_typed.iter().find(|t| t.0 == p.dtype[0])
                {
                    l.f = f1;
                    if let Some(f2) = f2
                        && r == 1
                        && gemv_two_rows(total, p.dtype[0], be.sm_count())
                    {
                        l.f = f2;
                        rpw = 2;
                    }
                }
                l.smem = smem as u32;
                l.block = 256;
                // A resident grid: blocks loop over row groups, so the input
                // is staged once per block rather than once per group.
                let groups = total.div_ceil(8 * rpw);
                let resident = be.sm_count() * be.occupancy(l.f, l.block, l.smem);
                l.grid = (groups.min(resident), 1, 1);
                l.tail = Tail::Gemv(extra);
            } else if gemm_on_tensor_cores(&p) {
                // Steps of many rows on cuBLAS where it is loaded (outside
                // graphs: its scratch is the backend's, not a chain's).
                let blas = be.blas().filter(|_| chain.is_none());
                if let Some(ops) = blas.zip(be.blas_scratch()).and_then(|(b, s)| {
                    crate::blas::plan(
                        b.target(!be.profiling(), be.sm_count()),
                        s,
                        crate::blas::OperandKernels {
                            split: k.gemm_split,
                            dequant: k.gemm_dequant,
                            dequant_hi: k.gemm_dequant_hi,
                        },
                        &p,
                        &l,
                        r,
                        be.cached_runs(&crate::blas::CacheKey::of(&p, &l.bind)),
                    )
                }) {
                    be.count_blas_command();
                    return Ok(ops);
                }
                l.f = k.gemm_tc;
                l.block = 128;
                l.grid = (total.div_ceil(64), r.div_ceil(64), 1);
            } else {
                l.f = k.gemm;
                l.grid = (total.div_ceil(64), r.div_ceil(64), 1);
            }
            vec![l]
        }
        // One-row steps: the attention right after does the rotation.
        KernelId::RopeKvWrite
            if decode && rows == 1 && fusion::rope_into_attention(table, i).is_some() =>
        {
            Vec::new()
        }
        KernelId::RopeKvWrite => {
            let p: RopeParams = c.params();
            if chain.is_none() {
                let pos = if c.patch == PatchType::Position {
                    step.pos
                } else {
                    p.pos
                };
                if pos as u64 + rows as u64 > p.capacity as u64 {
                    return Err(format!(
                        "KV write at positions {pos}..{} beyond the cache ({} positions)",
                        pos as u64 + rows as u64,
                        p.capacity
                    ));
                }
            }
            // Decode (few rows): a block a head, the most blocks for the
            // row. Prefill: ROPE_HEADS_PER_BLOCK heads a block, which share
            // the row's angles (model.cu k_rope_kv_write).
            let heads = p.n_heads + p.n_kv_heads;
            let per = if rows >= ROPE_MANY_ROWS {
                ROPE_HEADS_PER_BLOCK
            } else {
                1
            };
            vec![mk(k.rope_kv_write, (rows, heads.div_ceil(per), 1), 64, 0)]
        }
        KernelId::Attention => {
            let p: AttnParams = c.params();
            if p.head_dim > 256 || p.n_kv_heads == 0 || !p.n_heads.is_multiple_of(p.n_kv_heads) {
                return Err(format!(
                    "attention with head_dim {} and {}/{} heads is not supported on CUDA",
                    p.head_dim, p.n_heads, p.n_kv_heads
                ));
            }
            if decode {
                // One query row per grid.z, each as a one-row step.
                let n_split = attn_split_resident(be, &p);
                let part = be
                    .attn_scratch()
                    .ok_or("attention partials were not allocated")?;
                if p.n_heads as u64 * rows as u64 * 4 > ATTN_TICKET_BYTES {
                    return Err(format!(
                        "{} attention heads x {rows} rows exceed the CUDA backend's {} tickets",
                        p.n_heads,
                        ATTN_TICKET_BYTES / 4
                    ));
                }
                let mut rope = RopeExtra::default();
                let fused = (rows == 1 && i > 0)
                    .then(|| fusion::rope_into_attention(table, i - 1))
                    .flatten();
                if let Some(r) = fused {
                    // The KV write moved here: check it as its own launch
                    // would (chains check their whole range up front).
                    if chain.is_none() && step.pos as u64 + 1 > r.capacity as u64 {
                        return Err(format!(
                            "KV write at position {} beyond the cache ({} positions)",
                            step.pos, r.capacity
                        ));
                    }
                    if r.freq_factors != 0 {
                        let b = table.commands[i - 1].bindings()[3];
                        rope.ff = be.dptr(b.buffer)?.0 + b.offset;
                    }
                    rope.on = 1;
                    rope.rope_dim = r.rope_dim;
                    rope.theta = r.theta;
                    rope.freq_scale = r.freq_scale;
                    rope.style = r.style;
                }
                let mut a = mk(
                    attn_decode_kernel(be, &p),
                    (p.n_heads, n_split, rows),
                    128,
                    0,
                );
                a.tail = Tail::Attn {
                    part: part + ATTN_TICKET_BYTES,
                    n_split,
                    rope,
                };
                vec![a]
            } else if let Some((f, smem, block)) = flash_attention(
                k,
                p.head_dim,
                be.blas()
                    .is_some_and(|b| b.products() == crate::blas::Products::F16),
            ) {
                vec![mk(
                    f,
                    (p.n_heads, rows.div_ceil(FLASH_ROWS), 1),
                    block,
                    smem,
                )]
            } else {
                vec![mk(k.attn_prefill, (p.n_heads, rows.div_ceil(8), 1), 256, 0)]
            }
        }
        KernelId::Argmax | KernelId::GumbelSample if c.rows == RowMode::AllRows && rows > 1 => {
            // Speculative verification: every row, each as the one-row
            // kernel of the step at `pos + r` (k_argmax writes slot
            // `tok + rows`, k_gumbel_sample keys on `pos + rows`): row r's
            // logits, a one-row step at (pos + r, tok + r).
            let (f, n) = if c.kernel == KernelId::Argmax {
                (k.argmax, c.params::<ArgmaxParams>().n)
            } else {
                (k.gumbel_sample, c.params::<SampleParams>().n_vocab)
            };
            // Rows run one after another on the stream (each kernel waits
            // for the previous one in its prologue, PDL or not), so the
            // sampler's rows share its scratch: each row's prep kernel
            // resets the ticket that its select kernel uses.
            if c.kernel == KernelId::Argmax && i > 0 && sampler_picks(be, table, i - 1) {
                return Ok(Vec::new());
            }
            let pick = pick_target(be, table, i)?;
            let mut out = Vec::new();
            for r in 0..rows {
                let mut l = mk(f, (1, 1, 1), 1024, 0);
                l.bind[0] += r as u64 * n as u64 * 4;
                if chain.is_some() {
                    // Inside a verification graph: one-row steps
                    // r = 0, 1, ... after the control block's position.
                    l.step.step = r;
                } else {
                    l.step.pos = step.pos + r;
                    l.step.tok = step.tok + r;
                }
                l.step.rows = 1;
                if c.kernel == KernelId::GumbelSample {
                    out.extend(gumbel_launches(be, l, pick));
                } else {
                    out.push(l);
                }
            }
            out
        }
        KernelId::Argmax if i > 0 && sampler_picks(be, table, i - 1) => Vec::new(),
        KernelId::Argmax => vec![mk(k.argmax, (1, 1, 1), 1024, 0)],
        KernelId::GumbelSample => gumbel_launches(
            be,
            mk(k.gumbel_sample, (1, 1, 1), 1024, 0),
            pick_target(be, table, i)?,
        ),
        KernelId::TopKSelect => vec![mk(k.topk_select, (1, 1, 1), 1024, 0)],
        KernelId::RepetitionPenalty => vec![mk(k.repetition_penalty, (1, 1, 1), 256, 0)],
        KernelId::TemperatureScale => {
            let p: TemperatureParams = c.params();
            vec![mk(
                k.temperature_scale,
                (p.n_vocab.div_ceil(256), 1, 1),
                256,
                0,
            )]
        }
        KernelId::GrammarBitmask => {
            let p: BitmaskParams = c.params();
            vec![mk(
                k.grammar_bitmask,
                (p.n_vocab.div_ceil(256), 1, 1),
                256,
                0,
            )]
        }
    };
    Ok(out.into_iter().map(Op::Kernel).collect())
}

/// For a `GumbelSample` command `i` that `sampler_picks`, the next
/// Argmax's conveyor binding as that Argmax would receive it (a patched
/// slot is passed at the buffer's base) and whether it is patched.
fn pick_target(
    be: &CudaBackend,
    table: &DispatchTable,
    i: usize,
) -> Result<Option<(u64, bool)>, String> {
    if !sampler_picks(be, table, i) {
        return Ok(None);
    }
    let a = &table.commands[i + 1];
    let out = a.bindings()[1];
    let patched = a.patch == PatchType::ArgmaxOutput;
    let base = be.dptr(out.buffer)?.0;
    Ok(Some((
        if patched { base } else { base + out.offset },
        patched,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The split counts measured in bench/RESULTS.md (session 15) on an
    /// H200's 132 SMs: 32 for SmolLM2's 9 heads of 64, 16 for llama-1b's
    /// 32 heads of 64, 32 for 8B's 32 heads of 128 at the 128-wide
    /// kernel's 8 blocks an SM.
    #[test]
    fn attention_splits_per_head_width() {
        let attn = |n_heads, head_dim, capacity| AttnParams {
            pos: 0,
            kv_len: 1,
            n_heads,
            n_kv_heads: 8.min(n_heads),
            head_dim,
            capacity,
            scale: 1.0,
            window: 0,
            qkv_stride: 0,
            out_stride: 0,
            softcap: 0.0,
            kv_type: 0,
        };
        assert_eq!(attn_split_one_wave(&attn(9, 64, 8192), 132, 0), 32);
        assert_eq!(attn_split_one_wave(&attn(32, 64, 8192), 132, 10), 16);
        assert_eq!(attn_split_one_wave(&attn(32, 128, 8192), 132, 8), 32);
        assert_eq!(attn_split_one_wave(&attn(32, 128, 8192), 132, 4), 16);
        // A short cache takes fewer (capacity / 16), whatever the bound.
        assert_eq!(attn_split_one_wave(&attn(32, 128, 160), 132, 8), 10);
        // More heads than the bound's blocks: one split each.
        assert_eq!(attn_split_one_wave(&attn(1024, 64, 8192), 132, 0), 1);
    }

    fn sp(n: u32, t: f32, k: u32, tp: f32, mp: f32) -> SampleParams {
        SampleParams {
            n_vocab: n,
            temperature: t,
            top_k: k,
            top_p: tp,
            min_p: mp,
            repeat_penalty: 1.1,
            repeat_last_n: 64,
            ..bytemuck::Zeroable::zeroed()
        }
    }

    #[test]
    fn tensor_core_gemv_split() {
        // H200: 132 SMs. 8B shapes (Q4_0: 32 groups a row of 4096).
        assert_eq!(tcg_split(1792, 32, 132), 1, "gate_up: one round");
        assert_eq!(tcg_split(3072, 32, 132), 2, "logits: 3 rounds of 16");
        assert_eq!(tcg_split(384, 32, 132), 4, "qkv");
        assert_eq!(tcg_split(256, 32, 132), 8, "o");
        assert_eq!(tcg_split(256, 112, 132), 8, "down");
        // SmolLM2 (5 groups a row of 576): as many warps as groups allow,
        // but for the logits' 3,072 tiles.
        assert_eq!(tcg_split(60, 5, 132), 8);
        assert_eq!(tcg_split(3072, 5, 132), 1);
        // Never more warps than groups.
        assert_eq!(tcg_split(4, 1, 132), 1);
        assert_eq!(tcg_split(4, 3, 132), 4);
    }

    #[test]
    fn bulk_copy_gemv_plans() {
        use akunu_core::dtype::DType;
        let budget = 227 * 1024 - TCG_STATIC_SMEM as u64;
        let plan = |dt, k, rows: u32| tcb_plan(dt, k, rows.div_ceil(16), 132, budget);
        // 4-bit products keep the register form.
        assert!(plan(DType::Q4_0, 4096, 6144).is_none());
        assert!(plan(DType::Q4_1, 4096, 49_152).is_none());
        // Q8_0 and F16 keep it on every big product.
        assert_eq!(plan(DType::Q8_0, 14_336, 4096).unwrap().split, 8);
        assert_eq!(plan(DType::F16, 4096, 28_672).unwrap().split, 8);
        // 1B F16: 8 chunks of 4 groups a row of 2048, 32 of 8192.
        let p = plan(DType::F16, 2048, 2048).unwrap();
        assert_eq!((p.chunk, p.split), (4, 4));
        assert_eq!(plan(DType::F16, 8192, 2048).unwrap().split, 8);
        // The ring and the image fit: 8 warps x 2 stages beside k = 14336.
        assert!(plan(DType::F16, 14_336, 4096).unwrap().smem <= budget);
        // Rows whose scales would not be 16-byte aligned.
        assert!(plan(DType::Q8_0, 576, 49_152).is_none());
        assert!(plan(DType::Q8_0, 128, 49_152).is_none());
        assert!(plan(DType::Q8_0, 256, 8192).is_some());
        // SmolLM2's products are too few tiles for one block per SM; its
        // logits (49,152 rows) are not.
        assert!(plan(DType::Q8_0, 1536, 576).is_none());
        assert!(plan(DType::F16, 576, 1536).is_none());
        assert!(plan(DType::F16, 576, 49_152).is_some());
        // The GPU tests' tiny-k models with a 49,152-token vocabulary: one
        // short chunk of 2 groups a row.
        assert_eq!(plan(DType::Q8_0, 256, 49_152).map(|p| p.split), Some(1));
        // Types the form does not read.
        assert!(plan(DType::F32, 4096, 4096).is_none());
        assert!(plan(DType::Q6_K, 4096, 4096).is_none());
    }

    #[test]
    fn sampler_grid_choices() {
        // The default model and configuration: 48 slices of 1,024.
        assert_eq!(
            sample_grid(&sp(49_152, 0.8, 40, 0.95, 0.0)),
            Some((1024, 48))
        );
        // Ragged vocabulary: the last block is partial, none is empty.
        assert_eq!(
            sample_grid(&sp(50_003, 0.8, 40, 0.95, 0.0)),
            Some((1024, 49))
        );
        // Candidates beyond the merge at 1,024 take larger slices.
        assert_eq!(
            sample_grid(&sp(151_936, 0.8, 40, 0.95, 0.0)),
            Some((2048, 75))
        );
        assert_eq!(
            sample_grid(&sp(49_152, 0.8, 256, 1.0, 0.0)),
            Some((4096, 12))
        );
        // top-k above a slice: Kc = slice.
        assert_eq!(
            sample_grid(&sp(1_500, 0.8, 5_000, 1.0, 0.0)),
            Some((1024, 2))
        );
        // Too many candidates for any slice: single block.
        assert_eq!(sample_grid(&sp(262_144, 0.8, 200, 1.0, 0.0)), None);
        // Greedy (penalty only) and no filter: any top-k value.
        assert_eq!(sample_grid(&sp(49_152, 0.0, 0, 0.5, 0.0)), Some((1024, 48)));
        assert_eq!(sample_grid(&sp(49_152, 0.8, 0, 1.0, 0.0)), Some((1024, 48)));
        // A filter without top-k, and a NaN top-p (not "no filter"): single.
        assert_eq!(sample_grid(&sp(49_152, 0.8, 0, 0.9, 0.0)), None);
        assert_eq!(sample_grid(&sp(49_152, 0.8, 0, 1.0, 0.05)), None);
        assert_eq!(sample_grid(&sp(49_152, 0.8, 0, f32::NAN, 0.0)), None);
        assert_eq!(sample_grid(&sp(0, 0.8, 40, 0.95, 0.0)), None);
    }
}
