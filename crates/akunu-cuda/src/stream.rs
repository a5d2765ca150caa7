//! The streaming persistent decode kernel (`kernels/stream.cu`): a greedy
//! chain of a llama model with F16 matrices as one cooperative launch, for
//! models too large for `persist.rs`'s kernel (which keeps a layer's rows in
//! shared memory). Each SM streams its share of every product through a
//! ring of shared-memory stages while its consumer warps wait for the
//! product's input; bench/cuda/stream_probe.cu measured the design
//! (bench/RESULTS.md, session 25: 8B F16 at 92% of the H200's floor).
//!
//! The plan is read off the table as `persist.rs` reads it
//! (`persist::read_shape` with `f16`), and it shares that module's chain
//! integration: `persist::Plan` with [`persist::Args::Stream`], launched by
//! `persist::launch`. A sampled table gets a module with the in-kernel
//! sampler (`chain_sampler.cuh`, the SmolLM2 kernel's, on the consumer
//! warps: `SD_SAMPLED`), its settings set per chain by `Plan::for_chain`.
//!
//! On by default on sm_90 (as the persistent kernel is); `AKUNU_CUDA_STREAM=0`
//! keeps such models on the graph.

use crate::CudaBackend;
use crate::device::{alloc, check};
use crate::persist::{
    Args, CANDS, Owned, PARTS, Plan, SampArgs, VPT, load_kernel, read_shape, sample_smem,
};
use akunu_core::backend::BackendError;
use akunu_core::table::DispatchTable;
use bytemuck::{Pod, Zeroable};
use cudarc::driver::sys;

/// Consumer warps (stream.cu `SD_CW`); the producer is one more.
const CW: u32 = 8;
/// Threads that run the in-kernel sampler: the consumers (stream.cu
/// `SdCfg`).
pub(crate) const SAMPLER_THREADS: u32 = CW * 32;
/// Keys a sampler thread holds in the pick (`SdCfg::PICK_KPT`): top-64
/// lists of 132 blocks.
pub(crate) const PICK_KPT: u32 = 33;
/// Bytes of a ring stage (stream.cu `SD_STB`).
const STB: u32 = 32768;
/// Splits of a head's attention at most (stream.cu `SD_ATT_S`).
const ATT_S_MAX: u32 = 4;
/// Positions the kernel serves: its attention scratch holds a split's
/// scores (max_pos / SD_ATT_S + 1 floats).
pub const MAX_POS: u32 = 4096;
/// Static shared memory of the kernel, with room (stream.cu: `s_last`, the
/// RoPE table): persist.rs's, which `load_kernel` leaves out of the limit.
use crate::persist::STATIC_SMEM;

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
    nl: u32,
    vocab: u32,
    capacity: u32,
    max_pos: u32,
    eps: f32,
    theta: f32,
    freq_scale: f32,
    scale: f32,
    pub s: SampArgs,
}
const _: () = assert!(std::mem::size_of::<SdArgs>() == 168);

/// Units of each product (stream.cu `sd_units`) and rows a unit.
fn products(d: u32, qd: u32, kvd: u32, ff: u32, vocab: u32) -> [(u32, u32); 5] {
    [((qd + 2 * kvd) / 2, 2), (d, 1), (ff, 2), (d, 1), (vocab, 1)]
}

/// Why the kernel cannot take a shape on `grid` SMs, if it cannot.
fn shape_fits(
    d: u32,
    qd: u32,
    kvd: u32,
    ff: u32,
    nh: u32,
    vocab: u32,
    grid: u32,
) -> Result<(), String> {
    // A warp's columns are whole 256-column steps of every product's input
    // (k / SD_CW); the norm stages d over the consumer threads.
    if [d, qd, ff].iter().any(|&k| !k.is_multiple_of(256 * CW)) {
        return Err(format!(
            "d = {d}, q = {qd}, ffn = {ff}: the streaming kernel takes multiples of {}",
            256 * CW
        ));
    }
    // A consumer thread polls each block's flag at the token's end.
    if grid > CW * 32 {
        return Err(format!(
            "{grid} SMs: the streaming kernel polls at most {} flags",
            CW * 32
        ));
    }
    if !nh.is_multiple_of(2 * CW) || nh > grid {
        return Err(format!(
            "{nh} heads: the streaming kernel takes multiples of {} up to the SMs",
            2 * CW
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
    if 4 * d > STB || 2 * qd > STB || 2 * ff > STB {
        return Err(format!(
            "rows of {} bytes do not fit a {STB}-byte stage",
            (4 * d).max(2 * ff)
        ));
    }
    Ok(())
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
    part: u32,
    nst: u32,
    att_s: u32,
) -> Vec<String> {
    [
        ("SD_D", d),
        ("SD_QD", qd),
        ("SD_KVD", kvd),
        ("SD_FF", ff),
        ("SD_NH", nh),
        ("SD_NKV", nkv),
        ("SD_HD", qd / nh),
        ("SD_PART", part),
        ("SD_NST", nst),
        ("SD_ATT_S", att_s),
        ("SD_CW", CW),
        ("SD_STB", STB),
    ]
    .iter()
    .map(|(k, v)| format!("-D{k}={v}"))
    .collect()
}

/// Dynamic shared memory of the kernel (stream.cu `k_stream_decode`): the
/// ring, x, the row partials, h rows and reductions, the attention scratch,
/// the mbarriers and keys.
fn smem_bytes(ff: u32, hd: u32, part: u32, nst: u32, att_s: u32, max_pos: u32) -> u64 {
    let floats = ff + part + 64 + 64 + 3 * hd + CW * hd + 2 * CW + max_pos / att_s + 1;
    nst as u64 * STB as u64 + 4 * floats as u64 + 8 + (2 * nst + CW) as u64 * 8
}

fn kernel_for(
    be: &CudaBackend,
    defs: &[String],
    owned: &mut Owned,
) -> Result<sys::CUfunction, BackendError> {
    let mut defs = defs.to_vec();
    defs.push(crate::compile::kv_define(be.kv));
    load_kernel(
        be,
        &crate::compile::stream_source(),
        &defs,
        "the streaming decode kernel",
        "k_stream_decode",
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
    let shape = match read_shape(be, table, true) {
        Ok(s) => s,
        Err(why) => return Ok(Err(why)),
    };
    let p = shape.args;
    let sampled = shape.sampler.is_some();
    let grid = be.sm_count();
    if let Err(why) = shape_fits(p.d, p.qd, p.kvd, p.ff, p.nh, p.vocab, grid) {
        return Ok(Err(why));
    }
    if sampled && p.vocab.div_ceil(grid) > VPT * SAMPLER_THREADS {
        return Ok(Err(format!(
            "a vocabulary of {} over {grid} blocks: the sampler takes {} logits a block",
            p.vocab,
            VPT * SAMPLER_THREADS
        )));
    }
    let hd = p.qd / p.nh;
    let att_s = (grid / p.nh).clamp(1, ATT_S_MAX);
    let max_pos = MAX_POS.min(p.capacity);
    // Row partials: the most rows a block has of any product, SD_CW a row.
    let part = products(p.d, p.qd, p.kvd, p.ff, p.vocab)
        .iter()
        .map(|&(units, ur)| units.div_ceil(grid) * ur)
        .max()
        .unwrap_or(0)
        * CW;
    let budget = be.smem_optin().saturating_sub(STATIC_SMEM) as u64;
    // The sampler's areas follow the rest (stream.cu `pd_samp_areas`).
    let samp = if sampled {
        sample_smem(p.vocab, grid, max_pos)
    } else {
        0
    };
    let need = |n: u32| smem_bytes(p.ff, hd, part, n, att_s, max_pos) + samp;
    // As many stages as fit, up to 8 (three already run as fast as five on
    // the 1B shape: bench/RESULTS.md, session 25).
    let Some(nst) = (2..=8u32).rev().find(|&n| need(n) <= budget) else {
        return Ok(Err(format!(
            "{} bytes of shared memory a block needed, {budget} available",
            need(2)
        )));
    };
    let smem = need(nst);
    let mut defs = defines(p.d, p.qd, p.kvd, p.ff, p.nh, p.nkv, part, nst, att_s);
    if sampled {
        defs.push("-DSD_SAMPLED=1".into());
    }
    let f = match kernel_for(be, &defs, owned) {
        Ok(f) => f,
        Err(e) => return Ok(Err(format!("the streaming kernel is not available: {e}"))),
    };
    let threads = (CW + 1) * 32;
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
    let lp = alloc(bytes.len() as u64, "streaming decode layer table")?;
    owned.mem.push(lp);
    // SAFETY: `lp` holds bytes.len() bytes; the source is a live Vec.
    check(
        unsafe { sys::cuMemcpyHtoD_v2(lp, bytes.as_ptr() as *const _, bytes.len()) },
        "writing the streaming decode layer table",
    )?;
    // Tagged words (two sets: stream.cu SD_XW), bests with the cancel word
    // (two sets), flags: zeroed per chain.
    let xw = (2 * p.d + p.qd + 2 * p.kvd + p.ff + p.nh * att_s * (hd + 2)) as u64;
    let x_bytes = 2 * xw * 8;
    let best_bytes = 2 * (grid as u64 + 1) * 8;
    let flag_bytes = (grid as u64 * 4).next_multiple_of(8);
    let zeroed = x_bytes + best_bytes + flag_bytes;
    // The sampler's parts and candidates (written before they are read,
    // each token; not zeroed).
    let samp_bytes = if sampled {
        2 * grid as u64 * (PARTS + CANDS) as u64 * 8
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
        nl: p.nl,
        vocab: p.vocab,
        capacity: p.capacity,
        max_pos,
        eps: p.eps,
        theta: p.theta,
        freq_scale: p.freq_scale,
        scale: p.scale,
        s,
    };
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

    #[test]
    fn the_issue_shapes_fit_and_others_say_why() {
        // llama-1b and llama-8b on 132 SMs.
        assert!(shape_fits(2048, 2048, 512, 8192, 32, 49152, 132).is_ok());
        assert!(shape_fits(4096, 4096, 1024, 14336, 32, 49152, 132).is_ok());
        // SmolLM2: d 576 is not whole steps of the warps' columns.
        assert!(shape_fits(576, 576, 192, 1536, 9, 49152, 132).is_err());
        // Too few heads' rows for every block.
        assert!(shape_fits(2048, 2048, 512, 8192, 32, 100, 132).is_err());
    }

    #[test]
    fn the_ring_gets_what_shared_memory_leaves() {
        // llama-8b, H100/H200 (227 KiB opt-in less the static room): the
        // probe's four stages fit, five do not.
        let part = 49152u32.div_ceil(132) * CW;
        let budget = (232448 - STATIC_SMEM) as u64;
        assert!(smem_bytes(14336, 128, part, 4, 4, 4096) <= budget);
        assert!(smem_bytes(14336, 128, part, 5, 4, 4096) > budget);
        // A sampled table's module adds the sampler's areas (30 KB at 4,096
        // positions): three stages still fit, which ran as fast as four
        // (bench/RESULTS.md, session 26: sampled 8B 0.4% under greedy).
        let samp = sample_smem(49152, 132, 4096);
        assert!(smem_bytes(14336, 128, part, 3, 4, 4096) + samp <= budget);
        assert!(smem_bytes(14336, 128, part, 4, 4, 4096) + samp > budget);
    }
}
