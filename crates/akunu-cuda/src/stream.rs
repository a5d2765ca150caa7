//! The streaming persistent decode kernel (`kernels/stream.cu`): a greedy
//! chain of a llama model with F16 or Q4_0 matrices as one cooperative launch, for
//! models too large for `persist.rs`'s kernel (which keeps a layer's rows in
//! shared memory). Each SM streams its share of every product through a
//! ring of shared-memory stages while its consumer warps wait for the
//! product's input; bench/cuda/stream_probe.cu measured the design
//! (bench/RESULTS.md, session 25: 8B F16 at 92% of the H200's floor).
//!
//! The plan is read off the table as `persist.rs` reads it
//! (`persist::read_shape`, F16 or Q4_0), and it shares that module's chain
//! integration: `persist::Plan` with [`persist::Args::Stream`], launched by
//! `persist::launch`. A sampled table gets a module with the in-kernel
//! sampler (`chain_sampler.cuh`, the SmolLM2 kernel's, on the consumer
//! warps: `SD_SAMPLED`), its settings set per chain by `Plan::for_chain`.
//!
//! Q4_0 models get the module's `SD_Q4` form: stages of 16-row tiles over
//! a slice of their columns ([`q4_slices`]), multiplied on the tensor
//! cores. Each stage is one linear copy from the model's stage images
//! (`SD_STAGED`: laid out once per model by [`stage_images`], in the order
//! each block streams them and the order its lanes read them), or, where
//! the device has no room for those, two tensor-map copies of the matrices
//! (quants and scales: [`q4_maps`]).
//! A Q6_K output matrix or embedding (llama.cpp's default Q4_0 mix) is
//! converted once into the kernel's Q6 form ([`q6_form`]), whose logits
//! tiles take two stages each (`SD_OUT_Q6`, `SD_EMB_Q6`).
//!
//! On by default on sm_90 (as the persistent kernel is); `AKUNU_CUDA_STREAM=0`
//! keeps such models on the graph.

use crate::CudaBackend;
use crate::device::{alloc, check};
use crate::persist::{
    Args, CANDS, Owned, PARTS, PdArgs, PdLayer, Plan, Q6K_FORM, SampArgs, VPT, load_kernel,
    read_shape, sample_smem, sample_token_areas, upload,
};
use akunu_core::backend::BackendError;
use akunu_core::dtype::DType;
use akunu_core::ops::{GemvParams, KernelId};
use akunu_core::table::DispatchTable;
use bytemuck::{Pod, Zeroable};
use cudarc::driver::sys;

/// Consumer warps (stream.cu `SD_CW`) of the F16 form; the producer is one
/// more.
const CW_F16: u32 = 8;
/// Consumer warps of the Q4_0 form, where the shape allows (otherwise
/// [`CW_F16`]): its consumers convert nibbles and multiply on the tensor
/// cores in short dependent chains, which two warps a scheduler left
/// bound on latency (bench/RESULTS.md, session 28).
/// `AKUNU_CUDA_STREAM_Q4_CW=8` keeps eight for A/B runs.
const CW_Q4: u32 = 16;
static Q4_CW: crate::knob::Knob = crate::knob::Knob::new("AKUNU_CUDA_STREAM_Q4_CW");
/// Keys a sampler thread holds in the pick (stream.cu `SD_PICK_KPT`), over
/// `cw` consumer warps: top-64 lists of 132 blocks.
pub(crate) fn pick_kpt(cw: u32) -> u32 {
    (64 * 132u32).div_ceil(cw * 32)
}
/// Bytes of a ring stage (stream.cu `SD_STB`) of the F16 form.
const STB: u32 = 32768;
/// The most columns of a Q4_0 tile's slice: a tensor-map box row is at most
/// 256 elements (u32 words of 8 quants). `AKUNU_CUDA_STREAM_Q4_KC` sets a
/// smaller bound and `AKUNU_CUDA_STREAM_Q4_L2` the maps' L2 promotion (0
/// none, 1 64 B, 2 128 B, 3 256 B: the default) for A/B runs.
const KC_Q4_MAX: u32 = 2048;
static Q4_KC: crate::knob::Knob = crate::knob::Knob::new("AKUNU_CUDA_STREAM_Q4_KC");
static Q4_L2: crate::knob::Knob = crate::knob::Knob::new("AKUNU_CUDA_STREAM_Q4_L2");
/// Ring stages at most. On 8B Q4_0, five to nine ran the same
/// (bench/RESULTS.md, session 29): the consumers take stages only about as
/// fast as they land, so a deeper ring has nothing to absorb.
/// `AKUNU_CUDA_STREAM_NST` sets a lower cap for A/B runs.
const MAX_NST: u32 = 12;
static NST: crate::knob::Knob = crate::knob::Knob::new("AKUNU_CUDA_STREAM_NST");
/// Bulk copies the producer keeps in flight at most (stream.cu
/// `SD_INFLIGHT`), whatever the ring's depth. A producer that refills its
/// whole ring at once, as every block does after a serial section (the
/// norms, attention, the activations' staging), queues the ring's depth on
/// every SM in the memory system ahead of the consumers' own loads of the
/// other blocks' words, and those sections then wait behind it. Two in
/// flight still feed the F16 form's stream (bench/RESULTS.md, session 39:
/// llama-1b F16 +7%, 8B F16 +3.4%, against no cap). The Q4_0 form's
/// stage images take the same cap: 8B Q4_0 +2.2% greedy, +0.5% sampled
/// (session 49; one in flight: −12%, three and more level). Its tensor-map
/// boxes, bound by their consumers, keep none: level on 8B Q4_0, and the
/// Q6_K-logits form (two stages a tile) 1.3–1.7% slower with two (session
/// 39). 0 lifts the cap; `AKUNU_CUDA_STREAM_INFLIGHT` sets it for A/B runs.
const INFLIGHT_CAP: u32 = 2;
const _: () = assert!(INFLIGHT_CAP >= 1, "a cap of 0 would lift it");
static INFLIGHT: crate::knob::Knob = crate::knob::Knob::new("AKUNU_CUDA_STREAM_INFLIGHT");
fn inflight(geo: Geometry) -> u32 {
    let cap = if geo.q4 && !geo.staged {
        0
    } else {
        INFLIGHT_CAP
    };
    INFLIGHT.number::<u32>().unwrap_or(cap)
}
/// Splits of a head's attention (stream.cu `SD_ATT_S`): one block a head
/// by default. Every block reads every split's partials when it stages o's
/// input (on 8B with four splits: 32 heads x 4 splits x 130 words, 133 KB
/// a block and 17.5 MB over the grid a layer). One split against four
/// (bench/RESULTS.md): 8B Q4_0 2.2-3.0% faster from positions 512, 1,536
/// and 3,584 (session 42); llama-1b F16 0.8% faster greedy and 1.3%
/// sampled, 8B F16 0.6% greedy (also from 3,584) and 0.9% sampled
/// (session 43). `AKUNU_CUDA_STREAM_ATT_S` sets the most for A/B runs (1
/// to 4); the grid bounds it too.
const ATT_S_MAX: u32 = 4;
const ATT_S_DEFAULT: u32 = 1;
static ATT_S: crate::knob::Knob = crate::knob::Knob::new("AKUNU_CUDA_STREAM_ATT_S");
/// Splits of each head's attention on `grid` blocks: one block a (head,
/// split), at most the switch's count.
pub(crate) fn att_splits(grid: u32, nh: u32) -> u32 {
    let cap = ATT_S
        .number::<u32>()
        .unwrap_or(ATT_S_DEFAULT)
        .clamp(1, ATT_S_MAX);
    (grid / nh).clamp(1, cap)
}
/// Positions the kernel serves: its attention scratch holds a split's
/// scores (max_pos / SD_ATT_S + 1 floats).
pub const MAX_POS: u32 = 4096;
/// Room for the static shared memory of a sampled module whose sampler's
/// scalars are static (stream.cu: `s_last`, the RoPE table, the scalars:
/// 2,304 bytes at the 1B shape). The ring is first sized for it, or for
/// [`GREEDY_STATIC`] otherwise, then (`plan`) checked against the compiled
/// module's own.
const SAMPLED_STATIC: u32 = 3072;
/// Room for the static shared memory of a module without the sampler's
/// scalars (384 bytes for the 1B shape's greedy module, NVRTC for sm_90).
/// Reserving persist.rs's 3,072 cost llama-1b F16 its sixth stage by 1,192
/// bytes.
const GREEDY_STATIC: u32 = 1024;

/// Mirror of `SdArgs` in stream.cu.
#[repr(C)]
#[derive(Copy, Clone, Pod, Zeroable, Debug)]
pub(crate) struct SdArgs {
    layers: u64,
    emb: u64,
    out: u64,
    out_norm: u64,
    pub conveyor: u64,
    pub ctl: u64,
    x: u64,
    best: u64,
    flags: u64,
    maps: u64,
    freq: u64,
    nl: u32,
    vocab: u32,
    capacity: u32,
    max_pos: u32,
    eps: f32,
    theta: f32,
    freq_scale: f32,
    scale: f32,
    staged: u64,
    sns: [u32; 5],
    pad: u32,
    pub s: SampArgs,
}
const _: () = assert!(std::mem::size_of::<SdArgs>() == 216);

/// Units of each product (stream.cu `sd_units`) and rows a unit.
fn products(d: u32, qd: u32, kvd: u32, ff: u32, vocab: u32) -> [(u32, u32); 5] {
    [((qd + 2 * kvd) / 2, 2), (d, 1), (ff, 2), (d, 1), (vocab, 1)]
}

/// A Q4_0 product of `k` columns in the streaming kernel (stream.cu `Mat`
/// with `SD_Q4`): the fewest slices `ks` of its columns (the same whole
/// number of 128-column groups for each of `cw` consumer warps, at most
/// [`KC_Q4_MAX`] columns), and the bytes of a 16-row tile's slice (quants,
/// then scales).
pub(crate) fn q4_slices(k: u32, cw: u32) -> Option<(u32, u32)> {
    let max = Q4_KC.number().unwrap_or(KC_Q4_MAX).min(KC_Q4_MAX);
    (1..=k / (128 * cw))
        .map(|ks| (ks, k / ks))
        .find(|&(ks, kc)| k.is_multiple_of(ks) && kc.is_multiple_of(128 * cw) && kc <= max)
        .map(|(ks, kc)| (ks, q4_tile_bytes(kc)))
}

/// Bytes of a Q4_0 stage (stream.cu `Mat::SB`): a 16-row tile's slice of
/// `kc` columns, quants then scales.
fn q4_tile_bytes(kc: u32) -> u32 {
    16 * (kc / 2 + kc / 16)
}

/// Stage images (stream.cu `SD_STAGED`, `k_stage_form`): the Q4_0 form's
/// producer copies each stage as one linear copy from images laid out once
/// per model, block by block in the order it takes them, rather than as two
/// tensor-map boxes of the row-major matrices (16 row pieces of 1 KB and 16
/// scale rows of 128 bytes), which left HBM about a fifth idle: the stream
/// alone ran 888 tok/s on 8B Q4_0 with boxes and 975 with linear copies
/// (bench/RESULTS.md, session 49). The images cost the device a second copy
/// of the layers' matrices (about 3% more for the tiles' padding); where
/// free memory cannot hold them and [`STAGED_RESERVE`] besides, the kernel
/// keeps the boxes. `AKUNU_CUDA_STREAM_STAGED=0` keeps the boxes for A/B
/// runs.
static STAGED: crate::knob::Knob = crate::knob::Knob::new("AKUNU_CUDA_STREAM_STAGED");
/// Device memory left free after the stage images (the chain's scratch,
/// the graph's buffers and what the driver needs).
const STAGED_RESERVE: u64 = 1 << 30;

/// Stages a block takes of each product (stream.cu `sd_segs` over
/// `sd_range`, 16-row tiles of each run, `ks` slices each): the most of any
/// block, the stride of the stage images.
pub(crate) fn q4_stage_counts(p: &PdArgs, grid: u32, ks: [u32; 3]) -> [u32; 5] {
    let qkv = p.qd + 2 * p.kvd;
    let units = products(p.d, p.qd, p.kvd, p.ff, p.vocab).map(|(u, _)| u);
    let slices = [ks[0], ks[1], ks[0], ks[2], ks[0]];
    let mut most = [0u32; 5];
    for (m, most) in most.iter_mut().enumerate() {
        for b in 0..grid as u64 {
            let u0 = (units[m] as u64 * b / grid as u64) as u32;
            let u1 = (units[m] as u64 * (b + 1) / grid as u64) as u32;
            let runs: Vec<u32> = match m {
                // q|k|v rows by matrix: RoPE pairs, cut at q's and k's ends.
                0 => {
                    let (b, e) = (2 * u0, 2 * u1);
                    [(0, p.qd), (p.qd, p.qd + p.kvd), (p.qd + p.kvd, qkv)]
                        .iter()
                        .map(|&(lo, hi)| e.min(hi).saturating_sub(b.max(lo)))
                        .collect()
                }
                // The gate rows, then the up rows.
                2 => vec![u1 - u0; 2],
                _ => vec![u1 - u0],
            };
            let tiles: u32 = runs.iter().map(|n| n.div_ceil(16)).sum();
            *most = (*most).max(tiles * slices[m]);
        }
    }
    most
}

/// Bytes of a stage of each product ([`q4_tile_bytes`] of its slices).
fn q4_stage_bytes(p: &PdArgs, ks: [u32; 3]) -> [u32; 5] {
    let (d, qd) = (q4_tile_bytes(p.d / ks[0]), q4_tile_bytes(p.qd / ks[1]));
    [d, qd, d, q4_tile_bytes(p.ff / ks[2]), d]
}

/// The stage images of a Q4_0 model's matrices on `grid` blocks
/// (stream.cu `k_stage_form`), shared by a model's greedy and sampled
/// plans: the device address of their table (4 products a layer, then the
/// logits'), or None where the switch is off or the device has no room
/// for them (the kernel then keeps the tensor maps).
pub(crate) struct StageImages {
    table: u64,
    sns: [u32; 5],
    /// Where each product's images start (4 a layer, then the logits', 0
    /// where they have none), while they are still to be laid out (once
    /// the module is compiled, then kept under `key`); empty where an
    /// earlier plan of the model laid them out.
    unfilled: Vec<u64>,
    key: StageKey,
}
/// A model's stage images: its first matrix, the grid, whether the logits
/// have them.
pub(crate) type StageKey = (u64, u32, bool);

fn stage_images(
    be: &CudaBackend,
    layers: &[PdLayer],
    p: &PdArgs,
    grid: u32,
    ks: [u32; 3],
    logits: bool,
    owned: &mut Owned,
) -> Result<Option<StageImages>, BackendError> {
    if STAGED.number::<u32>() == Some(0) {
        return Ok(None);
    }
    let sns = q4_stage_counts(p, grid, ks);
    let sb = q4_stage_bytes(p, ks);
    let region = |m: usize| grid as u64 * sns[m] as u64 * sb[m] as u64;
    let per_layer: u64 = (0..4).map(region).sum();
    let total = per_layer * layers.len() as u64 + if logits { region(4) } else { 0 };
    let key = (layers[0].w[0], grid, logits);
    let cached = be
        .stage_forms
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&key)
        .copied();
    if let Some((table, counts)) = cached
        && counts == sns
    {
        return Ok(Some(StageImages {
            table,
            sns,
            unfilled: Vec::new(),
            key,
        }));
    }
    let (mut free, mut all) = (0usize, 0usize);
    // SAFETY: out-parameters; the context is current (plans run under it).
    check(
        unsafe { sys::cuMemGetInfo_v2(&mut free, &mut all) },
        "reading free device memory",
    )?;
    if (free as u64) < total + STAGED_RESERVE {
        eprintln!(
            "akunu: the streaming kernel's stage images need {} MiB and {} MiB are free: \
             it copies tensor-map boxes instead (slower)",
            total >> 20,
            free >> 20
        );
        return Ok(None);
    }
    let base = match alloc(total, "streaming kernel's stage images") {
        Ok(b) => b,
        Err(BackendError::OutOfMemory { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    owned.mem.push(base);
    let mut at = base;
    let mut table = Vec::with_capacity(4 * layers.len() + 1);
    for _ in layers {
        for m in 0..4 {
            table.push(at);
            at += region(m);
        }
    }
    table.push(if logits { at } else { 0 });
    let dev = upload(
        owned,
        bytemuck::cast_slice(&table),
        "streaming kernel's stage image table",
    )?;
    Ok(Some(StageImages {
        table: dev,
        sns,
        unfilled: table,
        key,
    }))
}

/// Lays the stage images out (stream.cu `k_stage_form`, from the decode
/// module) with the plan's arguments: one launch a product, on the decode
/// kernel's grid; `regions` as [`StageImages`] holds them.
fn fill_stage_images(
    be: &CudaBackend,
    f: sys::CUfunction,
    args: &SdArgs,
    grid: u32,
    regions: &[u64],
) -> Result<(), BackendError> {
    let mut a = *args;
    // Product i: layer i / 4's product i % 4, the last the logits (layer nl).
    let jobs = regions
        .iter()
        .enumerate()
        .filter(|&(_, &dst)| dst != 0)
        .map(|(i, &dst)| ((i / 4) as u32, (i % 4) as u32, dst));
    for (mut layer, mut m, mut dst) in jobs {
        if layer == args.nl {
            m = 4;
        }
        let mut params = [
            &mut a as *mut SdArgs as *mut std::ffi::c_void,
            &mut layer as *mut u32 as *mut _,
            &mut m as *mut u32 as *mut _,
            &mut dst as *mut u64 as *mut _,
        ];
        // SAFETY: k_stage_form(SdArgs, u32, u32, u8*) reads the plan's
        // layer table and matrices and writes its block's images inside the
        // region at `dst` (stage_images sized it from the same counts); the
        // parameters live until the launch is queued, and the launch is
        // synchronised before the plan is used.
        check(
            unsafe {
                sys::cuLaunchKernel(
                    f,
                    grid,
                    1,
                    1,
                    256,
                    1,
                    1,
                    0,
                    be.stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "laying out the streaming kernel's stage images",
        )?;
    }
    be.sync()
}

/// How the kernel is specialised for its matrices' type: the stage size
/// and, for Q4_0, the slices of the d-, q- and ffn-column products.
#[derive(Copy, Clone, Debug, PartialEq)]
pub(crate) struct Geometry {
    q4: bool,
    stb: u32,
    ks: [u32; 3],
    /// Consumer warps.
    pub cw: u32,
    /// The Q4_0 form's producer copies stage images (`SD_STAGED`), where
    /// the plan made them.
    pub staged: bool,
}

/// Why the kernel cannot take a shape on `grid` SMs, if it cannot, or how
/// it is specialised for it: Q4_0 with [`CW_Q4`] consumer warps where the
/// shape allows, else (and F16) with [`CW_F16`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn shape_fits(
    d: u32,
    qd: u32,
    kvd: u32,
    ff: u32,
    nh: u32,
    vocab: u32,
    grid: u32,
    q4: bool,
) -> Result<Geometry, String> {
    // The shape with cw consumer warps.
    let with = |cw: u32| -> Result<Geometry, String> {
        let mut geo = Geometry {
            q4,
            stb: STB,
            ks: [1; 3],
            cw,
            staged: false,
        };
        if q4 {
            // Columns in whole groups for each consumer warp (which also
            // covers the norm's staging of d over the consumer threads).
            if [d, qd, ff].iter().any(|&k| !k.is_multiple_of(128 * cw)) {
                return Err(format!(
                    "d = {d}, q = {qd}, ffn = {ff}: the streaming kernel takes Q4_0 products of multiples of {} columns",
                    128 * cw
                ));
            }
            geo.stb = 0;
            for (i, k) in [d, qd, ff].into_iter().enumerate() {
                let (ks, bytes) = q4_slices(k, cw).ok_or_else(|| {
                    format!(
                        "{k}-column Q4_0 rows do not split into slices of at most {KC_Q4_MAX} columns, \
                         the same whole groups for each of the {cw} consumer warps"
                    )
                })?;
                geo.ks[i] = ks;
                geo.stb = geo.stb.max(bytes);
            }
        } else if [d, qd, ff].iter().any(|&k| !k.is_multiple_of(256 * cw)) {
            // A warp's columns are whole 256-column steps of every product's
            // input (k / SD_CW); the norm stages d over the consumer threads.
            return Err(format!(
                "d = {d}, q = {qd}, ffn = {ff}: the streaming kernel takes multiples of {}",
                256 * cw
            ));
        }
        // A consumer thread polls each block's flag at the token's end.
        if grid > cw * 32 {
            return Err(format!(
                "{grid} SMs: the streaming kernel polls at most {} flags",
                cw * 32
            ));
        }
        if !nh.is_multiple_of(2 * cw) || nh > grid {
            return Err(format!(
                "{nh} heads: the streaming kernel takes multiples of {} up to the SMs",
                2 * cw
            ));
        }
        // Every block has rows of every product (the two sets of tagged words
        // rely on it).
        for (units, _) in products(d, qd, kvd, ff, vocab) {
            if units < grid {
                return Err(format!("a product of {units} units over {grid} SMs"));
            }
        }
        // The largest unit fits a stage.
        if !q4 && (4 * d > STB || 2 * qd > STB || 2 * ff > STB) {
            return Err(format!(
                "rows of {} bytes do not fit a {STB}-byte stage",
                (4 * d).max(2 * ff)
            ));
        }
        Ok(geo)
    };
    if q4 && !Q4_CW.is("8") {
        with(CW_Q4).or_else(|_| with(CW_F16))
    } else {
        with(CW_F16)
    }
}

/// The consumers' scratch after the ring (stream.cu `k_stream_decode`), in
/// floats from x's start: a product's input, its row partials after it
/// (SD_CW a row of the block's rows), and the attention scratch, laid over
/// each other where their lifetimes allow (docs/ARCHITECTURE.md, "the
/// streaming persistent kernel"); what that saves goes to the ring.
#[derive(Copy, Clone, Debug, PartialEq)]
pub(crate) struct Layout {
    /// Floats of x, the partials and the attention scratch together.
    pub region: u32,
    /// Where the attention scratch starts: after the q|k|v partials, which
    /// are read while attention runs.
    pub att_off: u32,
    /// Where the logits' partials end: from there to down's partials (at
    /// ff) nothing is live between a token's logits and its pick.
    pub log_end: u32,
}

/// The layout of a shape's scratch on `grid` blocks of `cw` consumer warps,
/// with `att` floats of attention scratch. The input of every product but
/// down (d or q columns) is followed by its partials; down's (ffn columns)
/// by its own, rows of d: the other products' partials lie over down's
/// input, which is staged only after gate|up's partials are summed.
#[allow(clippy::too_many_arguments)]
pub(crate) fn layout(
    d: u32,
    qd: u32,
    kvd: u32,
    ff: u32,
    vocab: u32,
    grid: u32,
    cw: u32,
    att: u32,
) -> Layout {
    let [qkv, o, gu, dn, log] =
        products(d, qd, kvd, ff, vocab).map(|(units, ur)| units.div_ceil(grid) * ur * cw);
    let img = d.max(qd);
    let att_off = img + qkv;
    let region = (img + qkv.max(o).max(gu).max(log).max(qkv + att)).max(ff + dn);
    Layout {
        region,
        att_off,
        log_end: img + log,
    }
}

/// Bytes the sampled module keeps for the sampler's shared scalars
/// (stream.cu `SD_SAMP_SS`, at least `sizeof(PdSampShared)`).
const SAMP_SHARED: u32 = 2048;

/// Where (floats from the scratch's start) the sampler's per-token areas
/// and scalars go: the span the logits phase leaves free, past the logits'
/// partials and short of down's, whose last reader (the last layer's rows)
/// is done before the logits phase begins, and whose next writers (the
/// next token's layers) start after the pick. None where they do not fit
/// there: then they follow the rest (`sample_smem`), as they did before.
/// In that span they cost the ring nothing: llama-1b F16's sampled module
/// keeps the greedy one's six stages.
fn samp_window(lay: Layout, ff: u32, vocab: u32, grid: u32) -> Option<u32> {
    let off = lay.log_end.next_multiple_of(4); // 16-byte aligned
    let bytes = SAMP_SHARED as u64 + sample_token_areas(vocab, grid);
    (4 * off as u64 + bytes <= 4 * ff as u64).then_some(off)
}

/// Where the sampler's shared memory goes and the static room the ring's
/// first size leaves (the plan then checks the compiled module's own).
struct SmemPlan {
    /// `samp_window`'s offset (`-DSD_SAMP_OFF`), if it fits.
    window: Option<u32>,
    /// Dynamic bytes after the rest: the sampler's areas, where the window
    /// does not take them.
    samp: u64,
    /// Static bytes reserved: the sampler's scalars are static only in the
    /// fallback.
    reserve: u32,
}

fn smem_plan(lay: Layout, ff: u32, vocab: u32, grid: u32, sampled: bool) -> SmemPlan {
    let window = if sampled {
        samp_window(lay, ff, vocab, grid)
    } else {
        None
    };
    let samp = if sampled && window.is_none() {
        sample_smem(vocab, grid, 0)
    } else {
        0
    };
    let reserve = if samp > 0 {
        SAMPLED_STATIC
    } else {
        GREEDY_STATIC
    };
    SmemPlan {
        window,
        samp,
        reserve,
    }
}

/// Floats of the attention scratch (stream.cu `sd_attend`): q, the current
/// k and v, a head's values for each consumer warp, the warps' maxima and
/// sums, and a split's scores.
pub(crate) fn att_floats(hd: u32, cw: u32, max_pos: u32, att_s: u32) -> u32 {
    3 * hd + cw * hd + 2 * cw + max_pos / att_s + 1
}

/// The tensor maps of the Q4_0 form (stream.cu `SdArgs::maps`): for each
/// layer's seven matrices (q, k, v, o, gate, up, down), then the output,
/// one map of the quants (u32 words, 8 quants each: `k / 8` a row) and one
/// of the scales (`k / 64` words a row) of the backend's repacked layout
/// (repack.rs), with boxes of 16 rows by one slice (`ks` of the d-, q- and
/// ffn-column products).
fn q4_maps(layers: &[PdLayer], p: &PdArgs, ks: [u32; 3]) -> Result<Vec<u64>, String> {
    let (d, qd, kvd, ff) = (p.d as u64, p.qd as u64, p.kvd as u64, p.ff as u64);
    use sys::CUtensorMapL2promotion as P;
    let promotion = match Q4_L2.number::<u32>() {
        Some(0) => P::CU_TENSOR_MAP_L2_PROMOTION_NONE,
        Some(1) => P::CU_TENSOR_MAP_L2_PROMOTION_L2_64B,
        Some(2) => P::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        _ => P::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
    };
    let mut out = Vec::new();
    let mut add = |base: u64, rows: u64, k: u64, ks: u32| -> Result<(), String> {
        let kc = k / ks as u64;
        for (addr, words, box_words) in [
            (base, k / 8, kc / 8),
            (base + rows * k / 2, k / 64, kc / 64),
        ] {
            out.extend_from_slice(&tensor_map(addr, rows, words, box_words, promotion)?);
        }
        Ok(())
    };
    for l in layers {
        let [q, k, v, o, gate, up, down] = l.w;
        add(q, qd, d, ks[0])?;
        add(k, kvd, d, ks[0])?;
        add(v, kvd, d, ks[0])?;
        add(o, d, qd, ks[1])?;
        add(gate, ff, d, ks[0])?;
        add(up, ff, d, ks[0])?;
        add(down, d, ff, ks[2])?;
    }
    if p.out_q8 == Q6K_FORM {
        // The Q6 form (repack.rs `q6k_stream_form`): the nibbles as Q4_0's
        // quants, then the top bits (k / 16 words a row), the int8 scales
        // (k / 64) and the super-block scales (k / 256), taken in the same
        // slices.
        let (rows, kc) = (p.vocab as u64, d / ks[0] as u64);
        let at = crate::repack::q6_form_arrays(rows * d);
        for (a, per) in at.into_iter().zip([8, 16, 64, 256]) {
            out.extend_from_slice(&tensor_map(p.out + a, rows, d / per, kc / per, promotion)?);
        }
    } else {
        add(p.out, p.vocab as u64, d, ks[0])?;
    }
    Ok(out)
}

/// A tensor map of `rows` rows of `words` u32 words at `addr`, whose
/// copies take boxes of 16 rows by `box_words`.
fn tensor_map(
    addr: u64,
    rows: u64,
    words: u64,
    box_words: u64,
    promotion: sys::CUtensorMapL2promotion,
) -> Result<[u64; 16], String> {
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    let dims = [words, rows];
    let strides = [words * 4];
    let boxes = [box_words as u32, 16];
    let elem = [1u32, 1];
    // SAFETY: every pointer refers to a live local array of the rank the
    // call is given (2 dims and box sizes, 1 stride); the map is a local
    // the call writes.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT32,
            2,
            addr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
            promotion,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(format!(
            "encoding a tensor map of a quantized matrix: {r:?}"
        ));
    }
    Ok(map.opaque)
}

/// The kernel's form (repack.rs `q6k_stream_form`) of the Q6_K matrix at
/// `src`, `rows` rows of `k`: made once a matrix (a model's greedy and
/// sampled plans share it) by copying it to the host, converting it there
/// and uploading the result, which `owned` then holds. Where the device has
/// no room for it, the reason (the model then keeps the graph).
fn q6_form(
    be: &CudaBackend,
    src: u64,
    rows: u32,
    k: u32,
    owned: &mut Owned,
) -> Result<Result<u64, String>, BackendError> {
    let mut forms = be.q6_forms.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&p) = forms.get(&src) {
        return Ok(Ok(p));
    }
    let Some(bytes) = DType::Q6_K.bytes_for(rows as u64 * k as u64) else {
        return Ok(Err(format!("Q6_K rows of {k} elements")));
    };
    let mut host = vec![0u8; bytes as usize];
    // SAFETY: `src` is where the logits (or embedding) command reads
    // `rows` Q6_K rows of `k` (read_shape), live weight memory; `host`
    // holds that many bytes. Weights are written only at upload, which
    // completed.
    check(
        unsafe { sys::cuMemcpyDtoH_v2(host.as_mut_ptr() as *mut _, src, host.len()) },
        "reading a Q6_K matrix for the streaming kernel",
    )?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let form = match crate::repack::q6k_stream_form(&host, rows as usize, k as usize, threads) {
        Ok(f) => f,
        Err(why) => return Ok(Err(why)),
    };
    drop(host);
    // Without room for the form the model decodes on the graph, as before.
    let p = match upload(owned, &form, "streaming kernel's Q6_K form") {
        Ok(p) => p,
        Err(e) => {
            return Ok(Err(format!(
                "the Q6_K matrix's form ({} MiB): {e}",
                form.len() >> 20
            )));
        }
    };
    forms.insert(src, p);
    Ok(Ok(p))
}

/// The macro definitions that specialise stream.cu.
#[allow(clippy::too_many_arguments)]
pub(crate) fn defines(
    d: u32,
    qd: u32,
    kvd: u32,
    ff: u32,
    nh: u32,
    nkv: u32,
    lay: Layout,
    nst: u32,
    att_s: u32,
    geo: Geometry,
) -> Vec<String> {
    let mut defs: Vec<String> = [
        ("SD_D", d),
        ("SD_QD", qd),
        ("SD_KVD", kvd),
        ("SD_FF", ff),
        ("SD_NH", nh),
        ("SD_NKV", nkv),
        ("SD_HD", qd / nh),
        ("SD_REGION", lay.region),
        ("SD_ATT_OFF", lay.att_off),
        ("SD_NST", nst),
        ("SD_ATT_S", att_s),
        ("SD_CW", geo.cw),
        ("SD_PICK_KPT", pick_kpt(geo.cw)),
        ("SD_STB", geo.stb),
        ("SD_INFLIGHT", inflight(geo)),
    ]
    .iter()
    .map(|(k, v)| format!("-D{k}={v}"))
    .collect();
    if geo.q4 {
        defs.push("-DSD_Q4=1".into());
        if geo.staged {
            defs.push("-DSD_STAGED=1".into());
        }
        for (name, ks) in ["SD_KS_D", "SD_KS_Q", "SD_KS_F"].iter().zip(geo.ks) {
            defs.push(format!("-D{name}={ks}"));
        }
    }
    defs
}

/// Dynamic shared memory of the kernel (stream.cu `k_stream_decode`): the
/// ring, the scratch's region ([`layout`]), h rows and reductions, the
/// mbarriers and keys, and for Q4_0 the zeros that B reads of lanes that
/// feed none land on (aligned to 16 bytes).
fn smem_bytes(lay: Layout, nst: u32, geo: Geometry) -> u64 {
    let floats = lay.region + 64 + 64;
    let zeros = if geo.q4 { 16 + 512 } else { 0 };
    nst as u64 * geo.stb as u64 + 4 * floats as u64 + 8 + (2 * nst + geo.cw) as u64 * 8 + zeros
}

/// The module's entry `name` (`k_stream_decode`, or `k_stage_form`, whose
/// module the compile cache already holds) and its static shared memory.
fn kernel_for(
    be: &CudaBackend,
    defs: &[String],
    name: &str,
    owned: &mut Owned,
) -> Result<(sys::CUfunction, u32), BackendError> {
    let mut defs = defs.to_vec();
    defs.push(crate::compile::kv_define(be.kv));
    load_kernel(
        be,
        &crate::compile::stream_source(),
        &defs,
        "the streaming decode kernel",
        name,
        owned,
    )
}

/// Why a table cannot run on the streaming kernel, or its plan. What the
/// plan holds on the device goes to `owned`, which the backend releases.
pub(crate) fn plan(
    be: &CudaBackend,
    table: &DispatchTable,
    owned: &mut Owned,
) -> Result<Result<Plan, String>, BackendError> {
    if be.info.cc.0 < 9 {
        return Ok(Err("the streaming kernel needs sm_90 (bulk copies)".into()));
    }
    // Q4_0 tables take the module's SD_Q4 form; anything else must be F16.
    let q4 = table.commands.get(2).is_some_and(|c| {
        c.kernel == KernelId::Gemv && c.params::<GemvParams>().dtype[0] == DType::Q4_0 as u32
    });
    let mats = if q4 { DType::Q4_0 } else { DType::F16 };
    let shape = match read_shape(be, table, mats) {
        Ok(s) => s,
        Err(why) => return Ok(Err(why)),
    };
    let mut p = shape.args;
    let sampled = shape.sampler.is_some();
    let grid = be.sm_count();
    let geo = match shape_fits(p.d, p.qd, p.kvd, p.ff, p.nh, p.vocab, grid, q4) {
        Ok(g) => g,
        Err(why) => return Ok(Err(why)),
    };
    if sampled && p.vocab.div_ceil(grid) > VPT * geo.cw * 32 {
        return Ok(Err(format!(
            "a vocabulary of {} over {grid} blocks: the sampler takes {} logits a block",
            p.vocab,
            VPT * geo.cw * 32
        )));
    }
    let hd = p.qd / p.nh;
    let att_s = att_splits(grid, p.nh);
    let max_pos = MAX_POS.min(p.capacity);
    let att = att_floats(hd, geo.cw, max_pos, att_s);
    let lay = layout(p.d, p.qd, p.kvd, p.ff, p.vocab, grid, geo.cw, att);
    let SmemPlan {
        window,
        samp,
        reserve,
    } = smem_plan(lay, p.ff, p.vocab, grid, sampled);
    let optin = be.smem_optin() as u64;
    let budget = optin.saturating_sub(reserve as u64);
    let need = |n: u32| smem_bytes(lay, n, geo) + samp;
    // As many stages as fit, up to MAX_NST (or the switch's cap).
    let most = NST.number::<u32>().unwrap_or(MAX_NST).clamp(2, MAX_NST);
    let Some(mut nst) = (2..=most).rev().find(|&n| need(n) <= budget) else {
        return Ok(Err(format!(
            "{} bytes of shared memory a block needed, {budget} available",
            need(2)
        )));
    };
    let mut extra: Vec<String> = Vec::new();
    if sampled {
        extra.push("-DSD_SAMPLED=1".into());
    }
    if let Some(off) = window {
        extra.push(format!("-DSD_SAMP_OFF={off}"));
    }
    // A Q6_K output or embedding (the same matrix when tied) in the
    // kernel's Q6 form.
    for (q6, ptr, def) in [
        (p.out_q8 == Q6K_FORM, &mut p.out, "-DSD_OUT_Q6=1"),
        (p.emb_q8 == Q6K_FORM, &mut p.emb, "-DSD_EMB_Q6=1"),
    ] {
        if q6 {
            *ptr = match q6_form(be, *ptr, p.vocab, p.d, owned)? {
                Ok(f) => f,
                Err(why) => return Ok(Err(why)),
            };
            extra.push(def.into());
        }
    }
    // The Q4_0 form's stage images, where the device has room for them
    // (the Q6 form's logits keep their maps).
    let images = if q4 {
        stage_images(
            be,
            &shape.layers,
            &p,
            grid,
            geo.ks,
            p.out_q8 != Q6K_FORM,
            owned,
        )?
    } else {
        None
    };
    let geo = Geometry {
        staged: images.is_some(),
        ..geo
    };
    // The module's static shared memory is known once it is compiled: where
    // it leaves less than the guess did (a developer switch's counters),
    // one stage fewer, compiled again.
    let (f, defs) = loop {
        let mut defs = defines(p.d, p.qd, p.kvd, p.ff, p.nh, p.nkv, lay, nst, att_s, geo);
        defs.extend(extra.iter().cloned());
        let (f, static_smem) = match kernel_for(be, &defs, "k_stream_decode", owned) {
            Ok(f) => f,
            Err(e) => return Ok(Err(format!("the streaming kernel is not available: {e}"))),
        };
        if need(nst) + static_smem as u64 <= optin {
            break (f, defs);
        }
        if nst == 2 {
            return Ok(Err(format!(
                "{} bytes of shared memory a block needed with {static_smem} static, {optin} available",
                need(2)
            )));
        }
        nst -= 1;
    };
    let smem = need(nst);
    let threads = (geo.cw + 1) * 32;
    if be.occupancy(f, threads, smem as u32) < 1 {
        return Ok(Err("the streaming kernel does not fit an SM".into()));
    }
    // The layer table: persist.rs's `PdLayer` has stream.cu's `SdLayer`
    // layout (seven matrices, two norms, the K and V caches).
    let bytes: Vec<u8> = shape
        .layers
        .iter()
        .flat_map(|l| bytemuck::bytes_of(l).to_vec())
        .collect();
    let lp = upload(owned, &bytes, "streaming decode layer table")?;
    let maps = if q4 {
        let words = match q4_maps(&shape.layers, &p, geo.ks) {
            Ok(w) => w,
            Err(why) => return Ok(Err(why)),
        };
        upload(
            owned,
            bytemuck::cast_slice(&words),
            "streaming decode tensor maps",
        )?
    } else {
        0
    };
    // Tagged words (two sets: stream.cu SD_XW), bests with the cancel word
    // (two sets), flags: zeroed per chain.
    let xw = (2 * p.d + p.qd + 2 * p.kvd + p.ff + p.nh * att_s * (hd + 2)) as u64;
    let x_bytes = 2 * xw * 8;
    let best_bytes = 2 * (grid as u64 + 1) * 8;
    let flag_bytes = (grid as u64 * 4).next_multiple_of(8);
    let zeroed = x_bytes + best_bytes + flag_bytes;
    // The sampler's parts and candidates (written before they are read,
    // each token; not zeroed), then each block's tokens of the launch
    // (stream.cu: written at each step before they are read).
    let samp_bytes = if sampled {
        2 * grid as u64 * (PARTS + CANDS) as u64 * 8 + grid as u64 * max_pos as u64 * 4
    } else {
        0
    };
    let scratch = alloc(zeroed + samp_bytes, "streaming decode scratch")?;
    owned.mem.push(scratch);
    let mut s = p.s;
    if sampled {
        s.samp = scratch + zeroed;
    }
    let args = SdArgs {
        layers: lp,
        emb: p.emb,
        out: p.out,
        out_norm: p.out_norm,
        conveyor: 0,
        ctl: 0,
        x: scratch,
        best: scratch + x_bytes,
        flags: scratch + x_bytes + best_bytes,
        maps,
        freq: p.freq,
        nl: p.nl,
        vocab: p.vocab,
        capacity: p.capacity,
        max_pos,
        eps: p.eps,
        theta: p.theta,
        freq_scale: p.freq_scale,
        scale: p.scale,
        staged: images.as_ref().map_or(0, |i| i.table),
        sns: images.as_ref().map_or([0; 5], |i| i.sns),
        pad: 0,
        s,
    };
    if let Some(i) = images.as_ref().filter(|i| !i.unfilled.is_empty()) {
        let (form, _) = kernel_for(be, &defs, "k_stage_form", owned)?;
        fill_stage_images(be, form, &args, grid, &i.unfilled)?;
        be.stage_forms
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(i.key, (i.table, i.sns));
    }
    Ok(Ok(Plan {
        func: f as u64,
        args: Args::Stream(args),
        grid,
        smem: smem as u32,
        threads,
        max_pos,
        sampler: shape.sampler,
        scratch: (scratch, zeroed),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const F16: Geometry = Geometry {
        q4: false,
        stb: STB,
        ks: [1; 3],
        cw: CW_F16,
        staged: false,
    };

    #[test]
    fn the_issue_shapes_fit_and_others_say_why() {
        // llama-1b and llama-8b on 132 SMs, F16 and Q4_0.
        for q4 in [false, true] {
            assert!(shape_fits(2048, 2048, 512, 8192, 32, 49152, 132, q4).is_ok());
            assert!(shape_fits(4096, 4096, 1024, 14336, 32, 49152, 132, q4).is_ok());
            // SmolLM2: d 576 is not whole steps of the warps' columns.
            assert!(shape_fits(576, 576, 192, 1536, 9, 49152, 132, q4).is_err());
            // Too few heads' rows for every block.
            assert!(shape_fits(2048, 2048, 512, 8192, 32, 100, 132, q4).is_err());
        }
    }

    #[test]
    fn attention_takes_one_block_a_head() {
        if std::env::var_os("AKUNU_CUDA_STREAM_ATT_S").is_some() {
            return; // the A/B switch overrides the default
        }
        assert_eq!(att_splits(132, 32), 1);
        assert_eq!(att_splits(132, 8), 1);
        assert_eq!(att_splits(20, 32), 1);
    }

    #[test]
    fn q4_rows_split_into_slices_of_a_box() {
        // 2048 columns: one slice, 16 x (1024 + 128) bytes.
        assert_eq!(q4_slices(2048, 8), Some((1, 18432)));
        assert_eq!(q4_slices(4096, 8), Some((2, 18432)));
        // llama-8b's down product: seven slices of 16 groups.
        assert_eq!(q4_slices(14336, 8), Some((7, 18432)));
        assert_eq!(q4_slices(14336, 16), Some((7, 18432)));
        // 5,120 = 5 x 1,024 (1,280 is not a group for each of 8 warps);
        // 16 warps need slices of 2,048 columns, which 5,120 is not.
        assert_eq!(q4_slices(5120, 8), Some((5, 9216)));
        assert_eq!(q4_slices(5120, 16), None);
        // 1,536 columns are 12 groups: none splits evenly over 8 warps.
        assert_eq!(q4_slices(1536, 8), None);
        // The issue's shapes take 16 consumer warps; a 5,120-wide model
        // falls back to 8.
        let g = shape_fits(4096, 4096, 1024, 14336, 32, 49152, 132, true).unwrap();
        assert_eq!((g.stb, g.ks, g.cw), (18432, [2, 2, 7], 16));
        let g = shape_fits(2048, 2048, 512, 8192, 32, 49152, 132, true).unwrap();
        assert_eq!((g.ks, g.cw), ([1, 1, 4], 16));
        let g = shape_fits(5120, 5120, 1024, 14336, 32, 49152, 132, true).unwrap();
        assert_eq!((g.ks, g.cw), ([5, 5, 7], 8));
        // F16 keeps 8.
        let g = shape_fits(4096, 4096, 1024, 14336, 32, 49152, 132, false).unwrap();
        assert_eq!(g.cw, 8);
        // The sampler's pick holds top-64 lists of 132 blocks either way.
        assert!(pick_kpt(8) * 8 * 32 >= 64 * 132 && pick_kpt(16) * 16 * 32 >= 64 * 132);
        assert_eq!((pick_kpt(8), pick_kpt(16)), (33, 17));
    }

    #[test]
    fn stage_images_take_the_most_stages_of_any_block() {
        let p = PdArgs {
            d: 4096,
            qd: 4096,
            kvd: 1024,
            ff: 14336,
            vocab: 49152,
            ..Zeroable::zeroed()
        };
        // llama-8b on 132 SMs: q|k|v 46-48 rows (3 tiles where a run ends
        // at q's or k's end on a tile), o and down 31-32 rows, gate|up 108-109
        // rows of each, the logits 372-373 rows; 2, 2, 2, 7, 2 slices.
        assert_eq!(q4_stage_counts(&p, 132, [2, 2, 7]), [6, 4, 28, 14, 48]);
        assert_eq!(q4_stage_bytes(&p, [2, 2, 7]), [18432; 5]);
        // A run cut by a matrix's end mid-tile costs its block a tile: q, k
        // and v of 40 rows each over 2 blocks, 60 rows a block (4 tiles
        // as one run), q 40 and k 20 rows (3 + 2), then k 20 and v 40.
        let p = PdArgs {
            d: 2048,
            qd: 40,
            kvd: 40,
            ff: 2048,
            vocab: 48,
            ..Zeroable::zeroed()
        };
        assert_eq!(q4_stage_counts(&p, 2, [1, 1, 1])[0], 5);
    }

    #[test]
    fn the_scratch_lies_over_itself_where_lifetimes_allow() {
        // llama-8b on 132 SMs, 8 warps: the logits' partials (373 rows) are
        // the most; down's input (14,336) and its 32 rows' partials the
        // longest run.
        let att = att_floats(128, 8, 4096, 4);
        assert_eq!(att, 384 + 1024 + 16 + 1025);
        let lay = layout(4096, 4096, 1024, 14336, 49152, 132, 8, att);
        assert_eq!(lay.att_off, 4096 + 48 * 8);
        assert_eq!(
            lay.region,
            (4096 + 373 * 8)
                .max(4096 + 48 * 8 + att)
                .max(14336 + 32 * 8)
        );
        assert_eq!(lay.region, 14336 + 256);
        // A vocabulary large enough that the logits' partials pass down's
        // input sets the region instead.
        let lay = layout(4096, 4096, 1024, 14336, 256 * 1024, 132, 16, att);
        assert_eq!(lay.region, 4096 + (256 * 1024u32).div_ceil(132) * 16);
    }

    #[test]
    fn the_ring_gets_what_shared_memory_leaves() {
        let samp = sample_smem(49152, 132, 0);
        assert_eq!(sample_smem(49152, 132, 4096) - samp, 4 * 4096);
        // The stages of the plan's first guess, on 132 SMs with 227 KiB of
        // opt-in shared memory (H100/H200), and where the sampler went.
        let stages_of =
            |d: u32, kvd: u32, ff: u32, hd: u32, vocab: u32, geo: Geometry, sampled: bool| {
                let att = att_floats(hd, geo.cw, 4096, 4);
                let lay = layout(d, d, kvd, ff, vocab, 132, geo.cw, att);
                let plan = smem_plan(lay, ff, vocab, 132, sampled);
                let budget = (232448 - plan.reserve) as u64;
                let nst = (2..=MAX_NST)
                    .rev()
                    .find(|&n| smem_bytes(lay, n, geo) + plan.samp <= budget);
                (nst, plan.window.is_some())
            };
        let stages =
            |geo: Geometry, sampled: bool| stages_of(4096, 1024, 14336, 128, 49152, geo, sampled);
        // llama-1b F16: six stages (five while the greedy module reserved
        // the sampled one's room, and while the sampled one kept its
        // sampler's areas after the rest).
        assert_eq!(
            stages_of(2048, 512, 8192, 64, 49152, F16, false),
            (Some(6), false)
        );
        assert_eq!(
            stages_of(2048, 512, 8192, 64, 49152, F16, true),
            (Some(6), true)
        );
        // Llama 3.2's vocabulary (128,256): the logits' partials (972 rows
        // of 8 warps) pass down's input, so the sampler's areas follow
        // the rest.
        assert_eq!(
            stages_of(2048, 512, 8192, 64, 128256, F16, true),
            (Some(5), false)
        );
        // llama-8b F16: five stages of 32 KiB (four sampled while its areas
        // followed the rest; with its token history in shared memory, at
        // 4,096 positions, 16 KB more and another stage).
        assert_eq!(stages(F16, false), (Some(5), false));
        assert_eq!(stages(F16, true), (Some(5), true));
        // Q4_0 with 16 consumer warps: nine stages of 18,432 bytes (eight
        // sampled while the areas followed the rest; seven and six while x,
        // the partials and the attention scratch each had their own room).
        let q4 = shape_fits(4096, 4096, 1024, 14336, 32, 49152, 132, true).unwrap();
        assert_eq!(stages(q4, false), (Some(9), false));
        assert_eq!(stages(q4, true), (Some(9), true));
    }

    #[test]
    fn the_q4_0_boxes_alone_keep_no_cap_on_copies_in_flight() {
        if std::env::var_os("AKUNU_CUDA_STREAM_INFLIGHT").is_some() {
            return; // an A/B run's cap, not the default under test
        }
        let cap = |geo: Geometry| {
            let att = att_floats(128, geo.cw, 4096, 4);
            let lay = layout(4096, 4096, 1024, 14336, 49152, 132, geo.cw, att);
            let defs = defines(4096, 4096, 1024, 14336, 32, 8, lay, 5, 4, geo);
            let found: Vec<_> = defs
                .iter()
                .filter(|d| d.starts_with("-DSD_INFLIGHT="))
                .collect();
            assert_eq!(found.len(), 1, "{defs:?}");
            found[0].clone()
        };
        assert_eq!(cap(F16), format!("-DSD_INFLIGHT={INFLIGHT_CAP}"));
        let q4 = shape_fits(4096, 4096, 1024, 14336, 32, 49152, 132, true).unwrap();
        assert_eq!(cap(q4), "-DSD_INFLIGHT=0");
        let staged = Geometry { staged: true, ..q4 };
        assert_eq!(cap(staged), format!("-DSD_INFLIGHT={INFLIGHT_CAP}"));
    }
}
