//! Persistent decode: a whole greedy (or sampled) chain of a small llama model as
//! one cooperative kernel (`kernels/persist.cu`), in place of the chain's
//! graph of one kernel per command.
//!
//! The plan is read off the dispatch table: the table's bindings give every
//! weight, norm and cache buffer, its parameters the shapes, and a table
//! that does not have the plain llama layout (or has a type, head width or
//! size the kernel does not take) gets no plan and keeps the graph. Both
//! paths read and write the same KV cache, so a chain may take either.
//!
//! A sampled table (the greedy one with `GumbelSample` before the argmax)
//! runs on the same kernel compiled with its sampler (persist.cu
//! `pd_sample_publish` / `pd_sample_pick`): repetition penalty, then
//! greedy, dense Gumbel-max, or Gumbel-max over top-k (<= 64) with min-p
//! and top-p, all inside the launch, so that sampled decode costs what
//! greedy does. A sampling configuration it does not take (top-p or min-p
//! without top-k, top-k above 64) keeps the graph ([`sample_mode`]).
//!
//! The kernel adds in another order than the table's gemv kernels, so its
//! tokens can differ from the graph's where two logits nearly tie (as the
//! CPU backend's can); the sampler's dense mode also moves each block's
//! best from the block's own maximum to the global one, which rounds
//! differently from the graph's single subtraction. It is on by default on sm_90 (H100, H200), where it
//! was measured (25-30% above the graph on the SmolLM2 shape: bench/
//! RESULTS.md, sessions 19-20); `CudaBackend::set_persistent` and
//! `AKUNU_CUDA_PERSIST` (0 / 1) switch it. Speculative decoding's plain
//! runs keep the graph (`ChainRequest::table_order`).

use crate::CudaBackend;
use crate::device::{Dptr, alloc, check};
use akunu_core::backend::BackendError;
use akunu_core::builder::RECENT_CAPACITY;
use akunu_core::dtype::DType;
use akunu_core::ops::{
    ACT_NONE, ACT_SWIGLU, AttnParams, EmbedParams, GemvParams, KernelId, NormParams, ROPE_NORM,
    RopeParams, SampleParams,
};
use akunu_core::table::DispatchTable;
use bytemuck::{Pod, Zeroable};
use cudarc::driver::sys;

/// Warps of a block (persist.cu `PD_WARPS`).
const WARPS: u32 = 12;
/// Values of a row a thread holds (persist.cu `PD_MAXPER`).
const MAXPER: u32 = 4;
const HEAD: u32 = 64;
/// Room for the kernel's static shared memory in the plan's first check,
/// before the kernel is compiled (so that a shape that cannot fit costs no
/// compile). The compiled kernel's own then decides (NVRTC 13.5, the
/// SmolLM2 shape with f16 KV: 3,360 bytes for the sampled module, 1,424
/// for the greedy one), and sizes the resident logits rows.
const STATIC_SMEM: u32 = 3072;
/// The sampler's words a block publishes (chain_sampler.cuh `PD_PARTS`) and its
/// top-k keys (`PD_CANDS`, the largest top-k the kernel takes).
pub(crate) const PARTS: u32 = 3;
pub(crate) const CANDS: u32 = 64;
/// Logits of a block's slice a thread holds in the sampler (`PD_VPT`).
pub(crate) const VPT: u32 = 4;
/// Most cache positions a chain may reach on this path: its attention runs
/// on one block per head, which loses to the graph's split attention after
/// a few hundred positions (bench/RESULTS.md, session 18: 1,636 tok/s from
/// position 512 against 1,721 for the graph).
pub const MAX_POS: u32 = 384;

/// Mirror of `PdLayer` in persist.cu.
#[repr(C)]
#[derive(Copy, Clone, Pod, Zeroable)]
pub(crate) struct PdLayer {
    pub w: [u64; 7],
    pub attn_norm: u64,
    pub ffn_norm: u64,
    pub k: u64,
    pub v: u64,
}

/// Mirror of `PdArgs` in persist.cu.
#[repr(C)]
#[derive(Copy, Clone, Pod, Zeroable, Debug)]
pub(crate) struct PdArgs {
    pub layers: u64,
    pub emb: u64,
    pub out: u64,
    pub out_norm: u64,
    pub conveyor: u64,
    pub ctl: u64,
    pub x: u64,
    pub best: u64,
    pub flags: u64,
    /// Llama 3.1-style RoPE divisors (`rope_freqs.weight`), or 0.
    pub freq: u64,
    pub nl: u32,
    pub d: u32,
    pub qd: u32,
    pub kvd: u32,
    pub nh: u32,
    pub nkv: u32,
    pub ff: u32,
    pub vocab: u32,
    pub capacity: u32,
    /// The embedding's and the output's types: 0 the kernel's own (Q4_1,
    /// or F16 / Q4_0 on the streaming kernel), 1 Q8_0, [`Q6K_FORM`] Q6_K.
    pub emb_q8: u32,
    pub out_q8: u32,
    pub max_pos: u32,
    pub eps: f32,
    pub theta: f32,
    pub freq_scale: f32,
    pub scale: f32,
    pub s: SampArgs,
    pub res_rows: u32,
    pub res_off: u32,
}

// The kernel's parameter block: persist.cu's PdArgs, 216 bytes.
const _: () = assert!(std::mem::size_of::<PdArgs>() == 216);

/// Mirror of `SampArgs` in chain_sampler.cuh: the in-kernel sampler's
/// settings (from the sampled table's `GumbelSample` params, per chain)
/// and buffers, embedded in both persistent kernels' argument blocks.
#[repr(C)]
#[derive(Copy, Clone, Pod, Zeroable, Debug)]
pub(crate) struct SampArgs {
    pub recent: u64,
    pub window_chain: u64,
    pub samp: u64,
    pub mode: u32,
    pub top_k: u32,
    pub repeat_last_n: u32,
    pub seed_lo: u32,
    pub seed_hi: u32,
    pub recent_capacity: u32,
    pub inv_t: f32,
    pub top_p: f32,
    pub min_p: f32,
    pub penalty: f32,
}
const _: () = assert!(std::mem::size_of::<SampArgs>() == 64);

/// What the kernel's logits phase does (persist.cu `PD_SAMPLE_*`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum SampleMode {
    /// The argmax.
    Greedy = 0,
    /// The argmax of the penalised logits (temperature 0, or one whose
    /// inverse is not a finite positive number).
    Penalty = 1,
    /// Gumbel-max over every token (no top-k, top-p or min-p).
    Dense = 2,
    /// Gumbel-max over the top-k (1..=64) left by min-p and top-p.
    TopK = 3,
}

/// The kernel's mode for a sampler's params, as the graph's
/// `k_gumbel_sample` / `k_sample_select` branch on them, or why the kernel
/// does not take them (the chain then keeps the graph).
pub(crate) fn sample_mode(p: &SampleParams) -> Result<SampleMode, String> {
    let inv_t = 1.0 / p.temperature;
    if p.temperature == 0.0 || !(inv_t > 0.0 && inv_t.is_finite()) {
        return Ok(if p.repeat_penalty != 1.0 {
            SampleMode::Penalty
        } else {
            SampleMode::Greedy
        });
    }
    if p.no_filter() {
        return Ok(SampleMode::Dense);
    }
    if (1..=CANDS).contains(&p.top_k) {
        return Ok(SampleMode::TopK);
    }
    Err(format!(
        "top-k {} with top-p {} and min-p {}: the kernel's sampler takes top-k 1..={CANDS}, or no filter",
        p.top_k, p.top_p, p.min_p
    ))
}

/// A table's persistent plan: the kernel (compiled for the model's shape),
/// its arguments (but for the chain's conveyor and control block), grid and
/// shared memory.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Plan {
    /// The kernel's `CUfunction`, as an integer so that the plan can go to
    /// the chain's launcher thread (a driver handle, valid from any thread
    /// with the context bound, until the backend unloads its module).
    pub func: u64,
    pub args: Args,
    pub grid: u32,
    pub smem: u32,
    /// Threads of a block.
    pub threads: u32,
    /// Positions the plan serves (`pos + steps <= max_pos`).
    pub max_pos: u32,
    /// The sampled table's `GumbelSample` command (its params are read at
    /// each chain: [`Plan::for_chain`]).
    pub sampler: Option<usize>,
    /// Device bytes of the tagged words, bests and flags, zeroed per chain.
    pub scratch: (Dptr, u64),
}

/// The kernel a plan launches, with its parameter block.
#[derive(Copy, Clone, Debug)]
pub(crate) enum Args {
    /// persist.cu: a layer's rows in shared memory (small models).
    Small(PdArgs),
    /// stream.cu: every product streamed through a ring (`stream.rs`).
    Stream(crate::stream::SdArgs),
}

fn rec(k: u32) -> u64 {
    (k / 2 + 4 * (k / 32).div_ceil(4) * 4) as u64
}

/// Shared memory of one layer's rows for a grid of `blocks`: enough for
/// either image of them, one record a row (persist.cu `pd_areas`, the
/// `cp.async` copies) or slices of quants and scales (`pd_bulk_areas`,
/// the bulk copies of `PD_BULK`), so that the switch needs no host change.
fn layer_smem(d: u32, qd: u32, kvd: u32, ff: u32, blocks: u32) -> u64 {
    let per = |items: u32| items.div_ceil(blocks) as u64;
    let records = per((qd + 2 * kvd) / 2) * 2 * rec(d)
        + per(d) * rec(qd)
        + per(ff) * 2 * rec(d)
        + per(d) * rec(ff);
    records.max(bulk_layer_smem(d, qd, kvd, ff, blocks))
}

/// persist.cu `pd_bulk_areas(..).bytes`: each slice's quants (k / 2 bytes
/// a row), then its scales (k / 8 a row) with 16 bytes of room for the
/// copy's rounding, every area a multiple of 16; q, k and v have a scale
/// area each.
fn bulk_layer_smem(d: u32, qd: u32, kvd: u32, ff: u32, blocks: u32) -> u64 {
    let per = |items: u32| items.div_ceil(blocks) as u64;
    let scales = |rows: u64, k: u32| (rows * (k / 8) as u64 + 16).next_multiple_of(16);
    let (nq, no, nf) = (2 * per((qd + 2 * kvd) / 2), per(d), per(ff));
    nq * (d / 2) as u64
        + 3 * scales(nq, d)
        + no * (qd / 2) as u64
        + scales(no, qd)
        + 2 * (nf * (d / 2) as u64 + scales(nf, d))
        + no * (ff / 2) as u64
        + scales(no, ff)
}

/// Candidates a block ranks in the pick (persist.cu `PD_PICK_CAP`).
const PICK_CAP: u32 = 1024;
/// Keys a thread holds in the pick (persist.cu `PD_PICK_KPT`): every
/// block's top-k, so grid x top-k <= PICK_KPT x threads.
const PICK_KPT: u32 = 24;

/// Shared memory of the sampler (persist.cu `pd_samp_areas`): its
/// per-token areas, a token a step (`hist` of them: the launch's
/// positions, or 0 where the kernel keeps them in global memory), the
/// recent ids.
pub(crate) fn sample_smem(vocab: u32, g: u32, hist: u32) -> u64 {
    sample_token_areas(vocab, g) + 4 * hist as u64 + 4 * RECENT_CAPACITY as u64
}

/// The sampler's areas that live only from a token's logits to its pick:
/// 16 bytes of alignment, the candidates, the slice's logits, its penalty
/// mask.
pub(crate) fn sample_token_areas(vocab: u32, g: u32) -> u64 {
    let per = vocab.div_ceil(g);
    let cap = per.max(PICK_CAP);
    16 + 8 * cap as u64 + 4 * per as u64 + 4 * per.div_ceil(32) as u64
}

/// What the plans hold on the device, released with the backend.
#[derive(Default)]
pub(crate) struct Owned {
    pub mem: Vec<Dptr>,
    pub modules: Vec<sys::CUmodule>,
}

/// A copy of `bytes` in a new device buffer that `owned` releases; `what`
/// names it in errors. Device allocations are 256-byte aligned, enough for
/// any table a kernel reads (tensor maps need 64).
pub(crate) fn upload(owned: &mut Owned, bytes: &[u8], what: &str) -> Result<Dptr, BackendError> {
    let p = alloc(bytes.len() as u64, what)?;
    owned.mem.push(p);
    // SAFETY: `p` holds bytes.len() bytes; the source is a live slice.
    check(
        unsafe { sys::cuMemcpyHtoD_v2(p, bytes.as_ptr() as *const _, bytes.len()) },
        &format!("writing the {what}"),
    )?;
    Ok(p)
}

/// The macro definitions that specialise persist.cu for a shape.
pub(crate) fn shape_defines(d: u32, qd: u32, kvd: u32, ff: u32, nh: u32, nkv: u32) -> Vec<String> {
    [
        ("PD_D", d),
        ("PD_QD", qd),
        ("PD_KVD", kvd),
        ("PD_FF", ff),
        ("PD_NH", nh),
        ("PD_NKV", nkv),
    ]
    .iter()
    .map(|(k, v)| format!("-D{k}={v}"))
    .collect()
}

/// Whether the kernel is compiled with bulk copies (`PD_BULK`): on sm_90
/// and later, unless a developer switch names PD_BULK.
fn bulk_copies(be: &CudaBackend) -> bool {
    be.info.cc.0 >= 9 && !crate::compile::developer_defines_name("PD_BULK")
}

/// The quant and scale bytes of a row of the logits weight (Q8_0 or Q4_1,
/// repacked: persist.cu `pd_out_qb`, `pd_out_sb`).
fn out_row_bytes(d: u32, q8: bool) -> (u32, u32) {
    if q8 { (d, d / 16) } else { (d / 2, d / 8) }
}

/// How many rows of each block's slice of the logits weight the kernel
/// keeps in shared memory for the whole chain (persist.cu
/// `pd_fetch_logits`), given `free` bytes: the slice's first rows, each
/// its quants and scales, plus 32 bytes for the scale copy's rounding to
/// 16-byte boundaries. The copy's end, rounded up, must stay inside the
/// weight: every row's scales together a multiple of 16 bytes.
fn resident_logits_rows(vocab: u32, d: u32, q8: bool, grid: u32, free: u64) -> u32 {
    let (qb, sb) = out_row_bytes(d, q8);
    if !(vocab as u64 * sb as u64).is_multiple_of(16) || !qb.is_multiple_of(16) {
        return 0;
    }
    let rows = free.saturating_sub(32) / (qb + sb) as u64;
    rows.min(vocab.div_ceil(grid) as u64) as u32
}

/// The kernel compiled for the shape of `a` (disk-cached like the main
/// module), with its sampler for a sampled table, its module pushed to
/// `owned`, and its static shared memory.
fn kernel_for(
    be: &CudaBackend,
    a: &PdArgs,
    sampled: bool,
    owned: &mut Owned,
) -> Result<(sys::CUfunction, u32), BackendError> {
    let mut defs = shape_defines(a.d, a.qd, a.kvd, a.ff, a.nh, a.nkv);
    defs.push(crate::compile::kv_define(be.kv));
    if !sampled && !crate::compile::developer_defines_name("PD_GREEDY_ONLY") {
        // A greedy table's kernel has no use for the sampler's code
        // (-DPD_GREEDY_ONLY=0 keeps it, to time the layers with it).
        defs.push("-DPD_GREEDY_ONLY=1".into());
    }
    // The embedding's and the logits weight's forms as constants: the
    // module then holds one form's code (persist.cu PD_EMB_Q8, PD_OUT_Q8).
    for (name, q8) in [("PD_EMB_Q8", a.emb_q8), ("PD_OUT_Q8", a.out_q8)] {
        if !crate::compile::developer_defines_name(name) {
            defs.push(format!("-D{name}={q8}"));
        }
    }
    // The sampler's part and pick as called functions: inlined, they
    // slowed the layers' code around them (chain_sampler.cuh;
    // -DPD_SAMP_NOINLINE=0 inlines them, for A/B). Also where a developer
    // switch keeps the sampler in a greedy table's module
    // (-DPD_GREEDY_ONLY=0): that module must be the sampled table's to
    // time its layers.
    let with_sampler = sampled || crate::compile::developer_defines_name("PD_GREEDY_ONLY");
    if with_sampler && !crate::compile::developer_defines_name("PD_SAMP_NOINLINE") {
        defs.push("-DPD_SAMP_NOINLINE=1".into());
    }
    // Bulk copies (sm_90's copy engine) bring the next layer's rows where
    // the device has them, unless a developer switch names PD_BULK.
    if bulk_copies(be) {
        defs.push("-DPD_BULK=1".into());
    }
    load_kernel(
        be,
        &crate::compile::persist_source(),
        &defs,
        "the persistent decode kernel",
        "k_persist_decode",
        owned,
    )
}

/// A persistent kernel (`name` in translation unit `src`, compiled with
/// `defs` for this device, disk-cached like the main module), loaded with
/// its shared-memory limit raised to the device's opt-in amount less its
/// static shared memory, which it returns with the kernel; its module goes
/// to `owned`. `what` names it in messages.
pub(crate) fn load_kernel(
    be: &CudaBackend,
    src: &str,
    defs: &[String],
    what: &str,
    name: &str,
    owned: &mut Owned,
) -> Result<(sys::CUfunction, u32), BackendError> {
    let arch = format!("sm_{}{}", be.info.cc.0, be.info.cc.1);
    let cubin = crate::compile::cubin_of(
        src,
        crate::compile::Module::Persistent,
        defs,
        what,
        &arch,
        be.info.driver,
        &mut |m| eprintln!("akunu: {m}"),
    )
    .map_err(BackendError::Device)?;
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: a complete cubin for this device, produced by NVRTC (or our
    // cache, keyed by its inputs); out-parameters.
    check(
        unsafe { sys::cuModuleLoadData(&mut module, cubin.as_ptr() as *const _) },
        &format!("loading {what}"),
    )?;
    owned.modules.push(module);
    let mut f: sys::CUfunction = std::ptr::null_mut();
    let cname = std::ffi::CString::new(name).expect("no NUL");
    // SAFETY: the module is loaded; out-parameter.
    check(
        unsafe { sys::cuModuleGetFunction(&mut f, module, cname.as_ptr()) },
        &format!("finding {name}"),
    )?;
    let mut static_smem: std::ffi::c_int = 0;
    // SAFETY: a valid function; out-parameter.
    check(
        unsafe {
            sys::cuFuncGetAttribute(
                &mut static_smem,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                f,
            )
        },
        &format!("reading {what}'s static shared memory"),
    )?;
    let static_smem = static_smem.max(0) as u32;
    // SAFETY: a valid function; at most the device's opt-in amount less
    // the kernel's static shared memory.
    check(
        unsafe {
            sys::cuFuncSetAttribute(
                f,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                be.smem_optin().saturating_sub(static_smem) as i32,
            )
        },
        &format!("raising {what}'s shared-memory limit"),
    )?;
    Ok((f, static_smem))
}

/// Why a table cannot run persistent, or its plan. What the plan holds on
/// the device goes to `owned`, which the backend releases.
pub(crate) fn plan(
    be: &CudaBackend,
    table: &DispatchTable,
    owned: &mut Owned,
) -> Result<Result<Plan, String>, BackendError> {
    let shape = match read_shape(be, table, DType::Q4_1) {
        Ok(s) => s,
        Err(why) => return Ok(Err(why)),
    };
    let Shape {
        layers,
        args: mut a,
        sampler,
    } = shape;
    let grid = be.sm_count();
    if grid * WARPS < a.d || grid < a.nh || grid > WARPS * 32 {
        return Ok(Err(format!(
            "{grid} SMs do not fit d = {} ({WARPS} warps a block) or {} heads",
            a.d, a.nh
        )));
    }
    let lb = layer_smem(a.d, a.qd, a.kvd, a.ff, grid);
    let fixed = 2 * lb + 4 * (a.d.max(a.qd).max(a.ff) + WARPS + (WARPS + 3) * HEAD) as u64;
    let budget = be.smem_optin().saturating_sub(STATIC_SMEM) as u64;
    let max_pos = MAX_POS.min(a.capacity);
    let mut smem = fixed + 4 * max_pos as u64;
    if sampler.is_some() {
        if a.vocab.div_ceil(grid) > VPT * WARPS * 32 {
            return Ok(Err(format!(
                "a vocabulary of {} over {grid} blocks: the sampler takes {} logits a block",
                a.vocab,
                VPT * WARPS * 32
            )));
        }
        smem += sample_smem(a.vocab, grid, max_pos);
    }
    if smem > budget {
        return Ok(Err(format!(
            "{smem} bytes of shared memory a block needed, {budget} available"
        )));
    }
    a.max_pos = max_pos;
    // A kernel that does not compile or load (an older toolkit, say) leaves
    // the model on the graph path, with the reason on stderr.
    let (f, static_smem) = match kernel_for(be, &a, sampler.is_some(), owned) {
        Ok(f) => f,
        Err(e) => return Ok(Err(format!("the persistent kernel is not available: {e}"))),
    };
    // The compiled kernel's own static shared memory decides what fits
    // (STATIC_SMEM was a guess). The room left holds the first rows of each
    // block's logits slice for the whole chain (with bulk copies): the
    // logits phase then reads them from shared memory rather than
    // streaming them every token.
    let room = be.smem_optin().saturating_sub(static_smem) as u64;
    if smem > room {
        return Ok(Err(format!(
            "{smem} bytes of shared memory a block needed with {static_smem} static, {} available",
            be.smem_optin()
        )));
    }
    if bulk_copies(be) {
        let off = smem.next_multiple_of(16);
        a.res_rows =
            resident_logits_rows(a.vocab, a.d, a.out_q8 == 1, grid, room.saturating_sub(off));
        if a.res_rows > 0 {
            a.res_off = off as u32;
            let (qb, sb) = out_row_bytes(a.d, a.out_q8 == 1);
            smem = off + a.res_rows as u64 * (qb + sb) as u64 + 32;
        }
    }
    let threads = WARPS * 32;
    if be.occupancy(f, threads, smem as u32) < 1 {
        return Ok(Err("the kernel does not fit an SM".into()));
    }
    // The pointer table.
    let bytes: Vec<u8> = layers
        .iter()
        .flat_map(|l| bytemuck::bytes_of(l).to_vec())
        .collect();
    a.layers = upload(owned, &bytes, "persistent decode layer table")?;
    // Tagged words (two sets), bests (+ the cancel word; two sets), flags, and the
    // sampler's parts and candidates (every word written before it is
    // read, each token).
    let xw = (a.d + a.qd + 2 * a.kvd + a.qd + a.ff) as u64;
    let x_bytes = 2 * xw * 8;
    let best_bytes = 2 * (grid as u64 + 1) * 8;
    let flag_bytes = (grid as u64 * 4).next_multiple_of(8);
    let samp_bytes = if sampler.is_some() {
        2 * grid as u64 * (PARTS + CANDS) as u64 * 8
    } else {
        0
    };
    let zeroed = x_bytes + best_bytes + flag_bytes;
    let scratch = alloc(zeroed + samp_bytes, "persistent decode scratch")?;
    owned.mem.push(scratch);
    a.x = scratch;
    a.best = scratch + x_bytes;
    a.flags = scratch + x_bytes + best_bytes;
    if samp_bytes > 0 {
        a.s.samp = scratch + zeroed;
    }
    Ok(Ok(Plan {
        func: f as u64,
        args: Args::Small(a),
        grid,
        smem: smem as u32,
        threads,
        max_pos,
        sampler,
        scratch: (scratch, zeroed),
    }))
}

impl Plan {
    /// The plan with the sampler's settings of this chain: the sampled
    /// table's `GumbelSample` params (which the engine rewrites when the
    /// configuration changes), or why the kernel does not take them.
    pub(crate) fn for_chain(mut self, table: &DispatchTable) -> Result<Plan, String> {
        let Some(i) = self.sampler else {
            return Ok(self);
        };
        let c = table
            .commands
            .get(i)
            .filter(|c| c.kernel == KernelId::GumbelSample)
            .ok_or("the sampled table changed shape")?;
        let p: SampleParams = c.params();
        let mode = sample_mode(&p)?;
        // Keys the pick holds: PICK_KPT a thread of the sampler's warps
        // (persist.cu PdCfg, stream.cu SdCfg).
        let pick_keys = match self.args {
            Args::Small(_) => PICK_KPT * WARPS * 32,
            Args::Stream(_) => crate::stream::pick_kpt(self.threads / 32 - 1) * (self.threads - 32),
        };
        if mode == SampleMode::TopK && p.top_k * self.grid > pick_keys {
            return Err(format!(
                "top-k {} over {} blocks: the kernel's pick holds {pick_keys} keys",
                p.top_k, self.grid
            ));
        }
        if p.recent_capacity > RECENT_CAPACITY {
            return Err(format!(
                "a recent-token window of {} ids (the kernel holds {RECENT_CAPACITY})",
                p.recent_capacity
            ));
        }
        let s = match &mut self.args {
            Args::Small(a) => &mut a.s,
            Args::Stream(a) => &mut a.s,
        };
        s.mode = mode as u32;
        s.top_k = p.top_k;
        s.repeat_last_n = p.repeat_last_n;
        s.seed_lo = p.seed_lo;
        s.seed_hi = p.seed_hi;
        s.recent_capacity = p.recent_capacity;
        s.inv_t = 1.0 / p.temperature;
        s.top_p = p.top_p;
        s.min_p = p.min_p;
        s.penalty = p.repeat_penalty;
        Ok(self)
    }
}

pub(crate) struct Shape {
    pub layers: Vec<PdLayer>,
    pub args: PdArgs,
    /// The index of a sampled table's `GumbelSample` command.
    pub sampler: Option<usize>,
}

/// `emb_q8` / `out_q8` of a Q6_K embedding or output: the streaming
/// kernel reads it in its Q6 form (`stream::q6_form`).
pub(crate) const Q6K_FORM: u32 = 2;

/// The model read off a greedy (or sampled) llama table, or why the kernel
/// cannot run it.
/// `mats`: the matrices' type. F16 or Q4_0 (the streaming kernel,
/// `stream.rs`): the embedding and output of that type too, or for Q4_0
/// of Q6_K (llama.cpp's default mix; `emb_q8`/`out_q8` [`Q6K_FORM`]), heads of 64 or
/// 128. Q4_1 (this kernel): a Q4_1 or Q8_0 embedding and output
/// (`emb_q8`/`out_q8` 0 or 1), heads of 64.
pub(crate) fn read_shape(
    be: &CudaBackend,
    table: &DispatchTable,
    mats: DType,
) -> Result<Shape, String> {
    let streaming = mats != DType::Q4_1;
    let c = &table.commands;
    // A sampled table: the greedy layout with its sampler before the argmax.
    let sampler =
        (c.len() >= 2 && c[c.len() - 2].kernel == KernelId::GumbelSample).then(|| c.len() - 2);
    let n = c.len() - sampler.map_or(0, |_| 1);
    if n < 12 || !(n - 4).is_multiple_of(8) {
        return Err("not the plain llama layout".into());
    }
    let nl = ((n - 4) / 8) as u32;
    let label = |i: usize| table.labels.get(i).map(String::as_str).unwrap_or("");
    let want = |i: usize, k: KernelId, l: &str| -> Result<(), String> {
        if c[i].kernel == k && label(i) == l {
            Ok(())
        } else {
            Err(format!(
                "command {i} is {:?} {:?}, not {l}",
                c[i].kernel,
                label(i)
            ))
        }
    };
    // A weight or cache binding's device pointer (whole buffers at 0).
    let ptr = |i: usize, slot: usize| -> Result<u64, String> {
        let b = c[i]
            .bindings()
            .get(slot)
            .ok_or_else(|| format!("command {i} has no binding {slot}"))?;
        let (p, _) = be.dptr(b.buffer)?;
        Ok(p + b.offset)
    };
    want(0, KernelId::Embedding, "embedding")?;
    want(1, KernelId::RmsNorm, "layer.0.attn_norm")?;
    let emb: EmbedParams = c[0].params();
    let norm: NormParams = c[1].params();
    let d = emb.dim;
    let q8 = |dt: u32| -> Result<u32, String> {
        let name =
            DType::from_ggml(dt).map_or_else(|| format!("type {dt}"), |t| t.name().to_string());
        match dt {
            x if streaming && x == mats as u32 => Ok(0),
            x if mats == DType::Q4_0 && x == DType::Q6_K as u32 => Ok(Q6K_FORM),
            x if !streaming && x == DType::Q8_0 as u32 => Ok(1),
            x if !streaming && x == DType::Q4_1 as u32 => Ok(0),
            _ if mats == DType::Q4_0 => Err(format!(
                "an embedding or output of {name} (Q4_0 or Q6_K only)"
            )),
            _ if streaming => Err(format!(
                "an embedding or output of {name} ({} only)",
                mats.name()
            )),
            _ => Err(format!(
                "an embedding or output of {name} (Q4_1 or Q8_0 only)"
            )),
        }
    };
    let emb_q8 = q8(emb.dtype)?;
    if emb.scale != 1.0 {
        return Err("a scaled embedding".into());
    }
    let (want_dt, dt_name) = (mats as u32, mats.name());
    let mut a = PdArgs::zeroed();
    let mut layers = Vec::with_capacity(nl as usize);
    let mut attn_norm = ptr(1, 1)?;
    for l in 0..nl as usize {
        let b = 2 + 8 * l;
        want(b, KernelId::Gemv, &format!("layer.{l}.qkv"))?;
        want(
            b + 1,
            KernelId::RopeKvWrite,
            &format!("layer.{l}.rope_kv_write"),
        )?;
        want(b + 2, KernelId::Attention, &format!("layer.{l}.attention"))?;
        want(b + 3, KernelId::Gemv, &format!("layer.{l}.attn_output"))?;
        want(
            b + 4,
            KernelId::ResidualRmsNorm,
            &format!("layer.{l}.residual_ffn_norm"),
        )?;
        want(b + 5, KernelId::Gemv, &format!("layer.{l}.gate_up"))?;
        want(b + 6, KernelId::Gemv, &format!("layer.{l}.act_down"))?;
        let next = if l + 1 < nl as usize {
            format!("layer.{l}.residual_next_norm")
        } else {
            "output_norm".to_string()
        };
        want(b + 7, KernelId::ResidualRmsNorm, &next)?;
        let qkv: GemvParams = c[b].params();
        let rope: RopeParams = c[b + 1].params();
        let att: AttnParams = c[b + 2].params();
        let o: GemvParams = c[b + 3].params();
        let gu: GemvParams = c[b + 5].params();
        let dn: GemvParams = c[b + 6].params();
        let (qd, kvd) = (qkv.n[0], qkv.n[1]);
        let plain = |g: &GemvParams, segs: u32, k: u32| {
            g.n_seg == segs
                && g.k == k
                && g.bias == 0
                && g.softcap == 0.0
                && g.dtype[..segs as usize].iter().all(|&t| t == want_dt)
        };
        if !plain(&qkv, 3, d) || qkv.n[2] != kvd || qkv.input_act != ACT_NONE {
            return Err(format!(
                "layer {l}: q|k|v not three {dt_name} matrices without bias"
            ));
        }
        if !plain(&o, 1, qd) || o.n[0] != d || o.input_act != ACT_NONE {
            return Err(format!("layer {l}: the output projection is not {dt_name}"));
        }
        if !plain(&gu, 2, d) || gu.n[1] != gu.n[0] || gu.input_act != ACT_NONE {
            return Err(format!("layer {l}: gate|up not two {dt_name} matrices"));
        }
        let ff = gu.n[0];
        if !plain(&dn, 1, ff) || dn.n[0] != d || dn.input_act != ACT_SWIGLU {
            return Err(format!(
                "layer {l}: the down projection is not {dt_name} after SwiGLU"
            ));
        }
        let head_ok = rope.head_dim == HEAD || (streaming && rope.head_dim == 128);
        if !head_ok
            || rope.rope_dim != rope.head_dim
            || rope.style != ROPE_NORM
            || rope.qk_norm != 0
            || rope.n_heads * rope.head_dim != qd
            || rope.n_kv_heads * rope.head_dim != kvd
            || rope.n_kv_heads == 0
            || !rope.n_heads.is_multiple_of(rope.n_kv_heads)
        {
            return Err(format!(
                "layer {l}: heads of {} (rope over {}, style {}): the kernel takes plain RoPE on heads of {}",
                rope.head_dim,
                rope.rope_dim,
                rope.style,
                if streaming { "64 or 128" } else { "64" }
            ));
        }
        if att.softcap != 0.0 || att.window != 0 {
            return Err(format!("layer {l}: soft-capped or windowed attention"));
        }
        // Llama 3.1-style divisors (`rope_freqs.weight`, one table of
        // head_dim / 2 for every layer): the kernels' rope_cs takes them.
        let freq = if rope.freq_factors != 0 {
            ptr(b + 1, 3)?
        } else {
            0
        };
        let ffn_norm: NormParams = c[b + 4].params();
        let next_norm: NormParams = c[b + 7].params();
        if ffn_norm.post_norm != 0 || next_norm.post_norm != 0 {
            return Err(format!("layer {l}: post-norms"));
        }
        if ffn_norm.eps != norm.eps || next_norm.eps != norm.eps {
            return Err("norms of different epsilons".into());
        }
        if l == 0 {
            a.d = d;
            a.qd = qd;
            a.kvd = kvd;
            a.nh = rope.n_heads;
            a.nkv = rope.n_kv_heads;
            a.ff = ff;
            a.capacity = rope.capacity;
            a.theta = rope.theta;
            a.freq_scale = rope.freq_scale;
            a.freq = freq;
            a.scale = att.scale;
        } else if (
            a.qd,
            a.kvd,
            a.ff,
            a.capacity,
            a.theta,
            a.freq_scale,
            a.freq,
            a.scale,
        ) != (
            qd,
            kvd,
            ff,
            rope.capacity,
            rope.theta,
            rope.freq_scale,
            freq,
            att.scale,
        ) {
            return Err(format!("layer {l} differs from layer 0"));
        }
        layers.push(PdLayer {
            w: [
                ptr(b, 2)?,
                ptr(b, 3)?,
                ptr(b, 4)?,
                ptr(b + 3, 2)?,
                ptr(b + 5, 2)?,
                ptr(b + 5, 3)?,
                ptr(b + 6, 2)?,
            ],
            attn_norm,
            ffn_norm: ptr(b + 4, 2)?,
            k: ptr(b + 1, 1)?,
            v: ptr(b + 1, 2)?,
        });
        if layers
            .last()
            .is_some_and(|w| w.w.iter().any(|p| p % 16 != 0))
        {
            // Rows are copied in 16-byte pieces (or bulk copies).
            return Err(format!("layer {l}: a matrix not 16-byte aligned"));
        }
        attn_norm = ptr(b + 7, 2)?;
    }
    let lg = n - 2;
    want(lg, KernelId::Gemv, "logits")?;
    want(c.len() - 1, KernelId::Argmax, "argmax")?;
    if let Some(i) = sampler {
        want(i, KernelId::GumbelSample, "gumbel_sample")?;
        // Its window: the recent-token buffer, and the conveyor the chain's
        // tokens join it from.
        a.s.recent = ptr(i, 1)?;
        a.s.window_chain = ptr(i, 2)?;
    }
    let lp: GemvParams = c[lg].params();
    if lp.n_seg != 1 || lp.k != d || lp.bias != 0 || lp.softcap != 0.0 {
        return Err("the logits product has a bias or a soft-cap".into());
    }
    let sizes_ok = [a.d, a.qd, a.ff].iter().all(|&k| k % 64 == 0)
        && (streaming || a.d <= MAXPER * WARPS * 32)
        && a.nh > 0;
    if !sizes_ok {
        return Err(format!(
            "d = {}, q = {}, ffn = {}: the kernel takes multiples of 64 and d <= {}",
            a.d,
            a.qd,
            a.ff,
            MAXPER * WARPS * 32
        ));
    }
    a.nl = nl;
    a.vocab = lp.n[0];
    a.emb = ptr(0, 1)?;
    a.emb_q8 = emb_q8;
    a.out = ptr(lg, 2)?;
    a.out_q8 = q8(lp.dtype[0])?;
    a.out_norm = attn_norm;
    a.eps = norm.eps;
    if emb.n_vocab != a.vocab {
        return Err("the embedding and the logits have different vocabularies".into());
    }
    Ok(Shape {
        layers,
        args: a,
        sampler,
    })
}

/// Launches the plan's kernel on `stream`: the chain's tokens from the
/// control block `ctl` (position, first slot, limit, stop ids), its
/// conveyor `conveyor`. The scratch is zeroed first, on the same stream.
pub(crate) fn launch(
    plan: &Plan,
    ctl: Dptr,
    conveyor: Dptr,
    stream: sys::CUstream,
) -> Result<(), BackendError> {
    let mut small;
    let mut stream_args;
    let params: *mut std::ffi::c_void = match plan.args {
        Args::Small(a) => {
            small = a;
            small.ctl = ctl;
            small.conveyor = conveyor;
            &mut small as *mut PdArgs as *mut _
        }
        Args::Stream(a) => {
            stream_args = a;
            stream_args.ctl = ctl;
            stream_args.conveyor = conveyor;
            &mut stream_args as *mut crate::stream::SdArgs as *mut _
        }
    };
    let (scratch, bytes) = plan.scratch;
    // SAFETY: the scratch holds `bytes` (a multiple of 4) bytes; the kernel
    // is loaded, its arguments are a live local read at launch, and every
    // pointer in them is a live device buffer of this backend. The grid is
    // one block per SM, which the plan checked fits (a cooperative launch
    // fails rather than run blocks that cannot all be resident).
    unsafe {
        check(
            sys::cuMemsetD32Async(scratch, 0, (bytes / 4) as usize, stream),
            "clearing the persistent decode scratch",
        )?;
        let mut p = [params];
        check(
            sys::cuLaunchCooperativeKernel(
                plan.func as sys::CUfunction,
                plan.grid,
                1,
                1,
                plan.threads,
                1,
                1,
                plan.smem,
                stream,
                p.as_mut_ptr(),
            ),
            "launching the persistent decode kernel",
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resident_logits_rows_fit_the_room_and_the_slice() {
        // SmolLM2's Q8_0 embedding over 132 blocks: 612 bytes a row.
        assert_eq!(
            resident_logits_rows(49152, 576, true, 132, 32 + 612 * 200),
            200
        );
        assert_eq!(
            resident_logits_rows(49152, 576, true, 132, 32 + 612 * 200 - 1),
            199
        );
        // Q4_1: 360 bytes a row; never more than the slice (373 rows).
        assert_eq!(resident_logits_rows(49152, 576, false, 132, 1 << 20), 373);
        assert_eq!(resident_logits_rows(49152, 576, true, 132, 31), 0);
        // Scales that do not end on a 16-byte boundary: none kept.
        assert_eq!(resident_logits_rows(49151, 576, true, 132, 1 << 20), 0);
    }
}
