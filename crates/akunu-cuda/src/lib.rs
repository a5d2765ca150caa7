//! akunu's CUDA backend: the same dispatch table as the CPU backend, replayed
//! on an NVIDIA GPU.
//!
//! - Kernels are CUDA C++ embedded in the binary (`kernels/`), compiled by
//!   NVRTC for the device's architecture at start and cached on disk
//!   ([`compile`]).
//! - Every table command maps onto one or more kernel launches ([`launch`]);
//!   prefill and profiling replay the table launch by launch. Prefill
//!   products of many rows run on cuBLAS where it can be loaded ([`blas`]).
//! - Chain decode ([`chain`]) captures N steps of the table into one CUDA
//!   graph per chunk size and relaunches it for every chunk: positions come
//!   from a device-resident control block that the graph itself advances,
//!   so a relaunch is O(1) host work. Tokens reach the host through mapped
//!   memory as they are produced, and a stop token makes the rest of the
//!   chunk's kernels return at entry.
//!
//! Nothing here loads the driver until [`CudaBackend::new`]; on a machine
//! without one, [`driver_status`] says so instead of panicking.

mod blas;
mod chain;
pub mod compile;
mod device;
mod fusion;
mod knob;
mod launch;
mod persist;
mod repack;
mod stream;

use akunu_core::backend::{
    Backend, BackendError, BufferRead, ChainReport, ChainRequest, StepHook, TokenSink,
};
use akunu_core::dtype::DType;
use akunu_core::gguf::{GgufFile, TensorInfo};
use akunu_core::ops::{AttnParams, GemvParams, KernelId, KvType, RopeParams};
use akunu_core::table::{BufferId, DispatchCmd, DispatchTable, MAX_BUFFERS, StepInfo};
use cudarc::driver::sys;
use device::{Dptr, Event, check};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub use blas::CachePolicy as PrefillCache;
pub use blas::Products as PrefillProducts;
pub use device::driver_status;

/// What the backend knows about its GPU (the chapter's `ChipConfig`).
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub name: String,
    pub ordinal: usize,
    pub cc: (i32, i32),
    pub sm_count: i32,
    pub l2_bytes: i32,
    pub total_mem: usize,
    pub smem_optin: i32,
    pub driver: i32,
}

struct DevBuf {
    ptr: Dptr,
    len: u64,
    what: String,
    weight: bool,
    /// Quantized blocks stored in the repacked layout (`repack`).
    repacked: bool,
}

/// The tensor-core gemv kernels of one weight type (`gemv_tc.cu`).
#[derive(Copy, Clone)]
pub(crate) struct TcgKernels {
    /// GGML type id.
    pub dtype: u32,
    /// One input row, register form.
    pub one: sys::CUfunction,
    /// The same with unguarded rounds, for warps with 2 or more rounds.
    pub one_full: sys::CUfunction,
    /// 2..=8 input rows (speculative verification).
    pub verify: sys::CUfunction,
    /// One input row, bulk-copy form.
    pub bulk: sys::CUfunction,
}

/// The loaded kernel module and its functions.
pub(crate) struct Kernels {
    module: sys::CUmodule,
    pub embedding: sys::CUfunction,
    pub rmsnorm: sys::CUfunction,
    pub residual_rmsnorm: sys::CUfunction,
    pub gemv: sys::CUfunction,
    /// The gemv specialised per weight type (all segments of that type):
    /// (GGML type id, one row per warp, two rows per warp for one input row).
    pub gemv_typed: [(u32, sys::CUfunction, Option<sys::CUfunction>); 11],
    /// The gemv for steps of 5..=8 input rows (speculative verification):
    /// generic, and per type where one exists.
    pub gemv_v8: sys::CUfunction,
    pub gemv_typed_v8: [(u32, sys::CUfunction); 6],
    /// The tensor-core gemv (`gemv_tc.cu`), per weight type.
    pub gemv_tc: [TcgKernels; 4],
    pub gemm: sys::CUfunction,
    pub gemm_tc: sys::CUfunction,
    /// The operand kernels of the cuBLAS prefill products (`blas`).
    pub gemm_split: sys::CUfunction,
    pub gemm_dequant: sys::CUfunction,
    pub gemm_dequant_hi: sys::CUfunction,
    pub rope_kv_write: sys::CUfunction,
    /// Decode attention for heads up to 64, 128 and 256 wide
    /// (model.cu `k_attn_decode_*`).
    pub attn_decode: [sys::CUfunction; 3],
    pub attn_prefill: sys::CUfunction,
    /// Flash prefill attention for heads up to 64, 128 and 256 wide
    /// (model.cu `k_attn_flash_*`), each with its dynamic shared memory;
    /// `None` where the device cannot give a block that much.
    pub attn_flash: [Option<(sys::CUfunction, u32)>; 3],
    /// The tensor-core flash prefill attention for heads up to 64 and 128
    /// wide (model.cu `k_attn_tc_*`), likewise.
    pub attn_tc: [Option<(sys::CUfunction, u32)>; 2],
    /// Their f16 instances (`k_attn_tc_*_f16`: operands rounded to f16, one
    /// product per pair), taken with `--prefill-products f16`.
    pub attn_tc_f16: [Option<(sys::CUfunction, u32)>; 2],
    pub argmax: sys::CUfunction,
    pub gumbel_sample: sys::CUfunction,
    /// The multi-block sampler (sampling.cu, "Gumbel sampling on many
    /// blocks"): penalty and partial max, then selection and merge.
    pub sample_prep: sys::CUfunction,
    pub sample_select: sys::CUfunction,
    pub topk_select: sys::CUfunction,
    pub repetition_penalty: sys::CUfunction,
    pub temperature_scale: sys::CUfunction,
    pub grammar_bitmask: sys::CUfunction,
    pub chain_advance: sys::CUfunction,
    pub clock_probe: sys::CUfunction,
}

pub struct CudaBackend {
    pub(crate) ctx: Arc<cudarc::driver::CudaContext>,
    stream: sys::CUstream,
    /// A second stream, used only to raise the chain's done flag while the
    /// main stream still has work queued.
    side: sys::CUstream,
    k: Kernels,
    info: DeviceInfo,
    buffers: Vec<DevBuf>,
    /// Per-head partial results of split (flash-decoding) attention.
    attn_part: Option<(Dptr, u64)>,
    /// The multi-block sampler's ticket, partials and candidates
    /// (`launch::SAMPLE_SCRATCH_BYTES`, zeroed once), allocated with the
    /// attention scratch before the first replay or chain.
    sample_scratch: Option<Dptr>,
    /// Whether `GumbelSample` may run on many blocks (`launch::sample_grid`);
    /// `AKUNU_CUDA_SAMPLE_MB=0` or `set_multi_block_sampling(false)` keeps
    /// the single-block kernel (A/B runs, tests).
    sample_mb: bool,
    chain: chain::ChainState,
    profile: Option<Vec<(std::time::Duration, u64)>>,
    /// Events between the commands of a profiled step.
    prof_events: Vec<Event>,
    /// Programmatic dependent launch (see `pdl()`).
    pdl: bool,
    /// Resident blocks per SM of (kernel, block size, dynamic shared
    /// memory), asked of the driver once: step-by-step replays plan every
    /// command of every token.
    occupancy: std::sync::Mutex<HashMap<(usize, u32, u32), u32>>,
    /// cuBLAS for prefill products, or why there is none (`blas`).
    blas: Result<blas::Blas, String>,
    /// Whether products may use it (`AKUNU_CUDA_CUBLAS=0`, `set_cublas`).
    blas_on: bool,
    /// Split inputs and dequantized weights of the cuBLAS products, sized
    /// for the tables prepared so far.
    blas_scratch: Option<blas::Scratch>,
    /// Commands run on cuBLAS so far (tests check the path was taken).
    blas_commands: Arc<AtomicU64>,
    /// The prefill weight cache (`--prefill-cache`): per product, its
    /// quantized rows dequantized once as `[W_hi | W_lo]`, which prefill
    /// steps then read in place of a dequantization each step; the policy,
    /// and the bytes held.
    prefill_cache: HashMap<blas::CacheKey, Vec<blas::CachedRun>>,
    cache_policy: blas::CachePolicy,
    prefill_cache_bytes: Arc<AtomicU64>,
    /// Whether greedy and sampled chains may run as one persistent kernel (on by
    /// default on sm_90 (H100, H200); `AKUNU_CUDA_PERSIST` 0 / 1,
    /// `set_persistent`), whether a model that cannot is reported (when it
    /// was asked for by name), the plans (or why a table has none) per
    /// table, the device memory the plans hold, and the chains that ran
    /// persistent so far (tests check the path).
    persist_on: bool,
    persist_asked: bool,
    /// Whether a model too large for the persistent kernel may take the
    /// streaming one (`stream.rs`; on by default on sm_90,
    /// `AKUNU_CUDA_STREAM=0` or `set_streaming` turn it off).
    stream_on: bool,
    /// Element type of the K and V caches, which the cache kernels (main
    /// and persistent modules) were compiled for.
    pub(crate) kv: KvType,
    persist_plans: HashMap<u64, Result<persist::Plan, String>>,
    persist_owned: persist::Owned,
    persist_chains: Arc<AtomicU64>,
    /// The streaming kernel's forms of Q6_K matrices (`stream::q6_form`),
    /// by the matrix's device pointer: made once, shared by a model's
    /// greedy and sampled plans, held in `persist_owned`.
    pub(crate) q6_forms: std::sync::Mutex<HashMap<Dptr, Dptr>>,
    /// The streaming kernel's stage images of a Q4_0 model (`stream.rs`
    /// `stage_images`), by its first matrix, the grid and whether the
    /// logits have them: their table and stage counts, shared by the
    /// model's greedy and sampled plans, held in `persist_owned`.
    pub(crate) stage_forms: std::sync::Mutex<HashMap<stream::StageKey, (Dptr, [u32; 5])>>,
}

// SAFETY: the raw handles (streams, module, functions, device pointers,
// mapped host memory) are plain driver handles valid from any thread once
// the context is current; every entry point binds the context first, and
// all mutation goes through `&mut self`.
unsafe impl Send for CudaBackend {}

impl CudaBackend {
    /// Opens GPU `ordinal` with an f16 KV cache (the default), compiles
    /// (or loads cached) kernels. `say` receives progress lines (the first
    /// compile takes a few seconds).
    pub fn new(ordinal: usize, say: &mut dyn FnMut(&str)) -> Result<CudaBackend, BackendError> {
        Self::with_kv_type(ordinal, KvType::F16, say)
    }

    /// As `new`, with K and V cached as `kv`: the kernels that write and
    /// read the cache are compiled for that element type.
    pub fn with_kv_type(
        ordinal: usize,
        kv: KvType,
        say: &mut dyn FnMut(&str),
    ) -> Result<CudaBackend, BackendError> {
        let driver = driver_status().map_err(BackendError::Device)?;
        let ctx = cudarc::driver::CudaContext::new(ordinal)
            .map_err(|e| BackendError::Device(format!("opening CUDA device {ordinal}: {e}")))?;
        let attr = |a: sys::CUdevice_attribute| {
            ctx.attribute(a)
                .map_err(|e| BackendError::Device(format!("reading device attribute: {e}")))
        };
        use sys::CUdevice_attribute as A;
        let info = DeviceInfo {
            name: ctx.name().unwrap_or_else(|_| "unknown GPU".into()),
            ordinal,
            cc: (
                attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            sm_count: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            l2_bytes: attr(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?,
            total_mem: ctx.total_mem().unwrap_or(0),
            smem_optin: attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
            driver,
        };
        let arch = format!("sm_{}{}", info.cc.0, info.cc.1);
        let cubin = compile::cubin(&arch, driver, kv, say).map_err(BackendError::Device)?;
        let k = load_kernels(&cubin, info.smem_optin)?;
        let mk_stream = || -> Result<sys::CUstream, BackendError> {
            let mut s: sys::CUstream = std::ptr::null_mut();
            // SAFETY: out-parameter; the context is current (bound by new).
            check(
                unsafe {
                    sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
                },
                "creating a stream",
            )?;
            Ok(s)
        };
        let stream = mk_stream()?;
        let side = mk_stream()?;
        let chain = chain::ChainState::new()?;
        let pdl = info.cc.0 >= 9 && std::env::var("AKUNU_CUDA_PDL").map_or(true, |v| v != "0");
        let blas_on = blas::wanted();
        let persist_env = std::env::var("AKUNU_CUDA_PERSIST").ok();
        // Measured on sm_90 (H100, H200) only: newer parts keep the graph
        // unless asked (AKUNU_CUDA_PERSIST=1).
        let sm90 = info.cc.0 == 9;
        let blas = if blas_on {
            blas::Blas::new(stream)
        } else {
            Err("off (AKUNU_CUDA_CUBLAS=0)".to_string())
        };
        if let (true, Err(why)) = (blas::verbose(), &blas) {
            eprintln!("akunu: prefill without cuBLAS: {why}");
        }
        Ok(CudaBackend {
            ctx,
            stream,
            side,
            k,
            info,
            buffers: Vec::new(),
            attn_part: None,
            sample_scratch: None,
            sample_mb: std::env::var("AKUNU_CUDA_SAMPLE_MB").map_or(true, |v| v != "0"),
            chain,
            profile: None,
            prof_events: Vec::new(),
            pdl,
            occupancy: std::sync::Mutex::new(HashMap::new()),
            blas,
            blas_on,
            blas_scratch: None,
            blas_commands: Arc::new(AtomicU64::new(0)),
            prefill_cache: HashMap::new(),
            cache_policy: blas::CachePolicy::default(),
            prefill_cache_bytes: Arc::new(AtomicU64::new(0)),
            persist_on: match persist_env.as_deref() {
                Some("0") => false,
                Some("1") => true,
                _ => sm90,
            },
            persist_asked: persist_env.as_deref() == Some("1"),
            stream_on: match std::env::var("AKUNU_CUDA_STREAM").as_deref() {
                Ok("0") => false,
                Ok("1") => true,
                _ => sm90,
            },
            kv,
            persist_plans: HashMap::new(),
            persist_owned: persist::Owned::default(),
            persist_chains: Arc::new(AtomicU64::new(0)),
            q6_forms: std::sync::Mutex::new(HashMap::new()),
            stage_forms: std::sync::Mutex::new(HashMap::new()),
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn bind(&self) -> Result<(), BackendError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| BackendError::Device(format!("binding the CUDA context: {e}")))
    }

    fn sync(&self) -> Result<(), BackendError> {
        // SAFETY: the stream is live for the backend's lifetime.
        check(
            unsafe { sys::cuStreamSynchronize(self.stream) },
            "running kernels",
        )
    }

    fn buffer(&self, id: BufferId) -> Result<&DevBuf, BackendError> {
        self.buffers
            .get(id as usize)
            .ok_or(BackendError::UnknownBuffer(id))
    }

    fn range_check(&self, id: BufferId, offset: u64, len: u64) -> Result<&DevBuf, BackendError> {
        let b = self.buffer(id)?;
        match offset.checked_add(len) {
            Some(e) if e <= b.len => Ok(b),
            end => Err(BackendError::OutOfBounds {
                buffer: id,
                len: b.len,
                start: offset,
                end: end.unwrap_or(u64::MAX),
            }),
        }
    }

    /// Launches one step of `table` outside any graph.
    pub(crate) fn run_step(
        &mut self,
        table: &DispatchTable,
        step: &StepInfo,
    ) -> Result<(), BackendError> {
        if self.profile.is_some() {
            return self.profile_step(table, step);
        }
        let decode = step.rows <= launch::decode_rows(self, table);
        for (i, cmd) in table.commands.iter().enumerate() {
            let plan = launch::plan(self, table, i, cmd, step, None, decode)
                .map_err(|why| invalid(table, i, why))?;
            for l in &plan {
                l.fire(self.stream).map_err(|e| {
                    let what = if l.is_gemm() { "cuBLAS" } else { "launch" };
                    invalid(table, i, format!("{what} failed: {e}"))
                })?;
            }
        }
        Ok(())
    }

    /// One step with a timer around every command. The step is captured
    /// into a graph with an event between consecutive commands, so the GPU
    /// runs the commands back to back as in decode and the times exclude
    /// the host's launch overhead.
    fn profile_step(&mut self, table: &DispatchTable, step: &StepInfo) -> Result<(), BackendError> {
        while self.prof_events.len() < table.len() + 1 {
            self.prof_events.push(Event::new()?);
        }
        let mut launches = Vec::with_capacity(table.len());
        let decode = step.rows <= launch::decode_rows(self, table);
        for (i, cmd) in table.commands.iter().enumerate() {
            launches.push(
                launch::plan(self, table, i, cmd, step, None, decode)
                    .map_err(|why| invalid(table, i, why))?,
            );
        }
        let stream = self.stream;
        // SAFETY: capture records the event records and launches below into
        // a graph; every handle is live; the graph is destroyed after one
        // synchronised launch.
        unsafe {
            check(
                sys::cuStreamBeginCapture_v2(
                    stream,
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                ),
                "starting a profiling capture",
            )?;
            let mut failed = None;
            for (i, plan) in launches.iter().enumerate() {
                if let Err(e) = self.prof_events[i].record_in_capture(stream) {
                    failed = Some(e.to_string());
                    break;
                }
                for l in plan {
                    if let Err(e) = l.fire(stream) {
                        failed = Some(e);
                        break;
                    }
                }
            }
            if failed.is_none()
                && let Err(e) = self.prof_events[table.len()].record_in_capture(stream)
            {
                failed = Some(e.to_string());
            }
            let mut graph: sys::CUgraph = std::ptr::null_mut();
            let end = sys::cuStreamEndCapture(stream, &mut graph);
            if let Some(e) = failed {
                if !graph.is_null() {
                    sys::cuGraphDestroy(graph);
                }
                return Err(BackendError::Device(format!("profiling capture: {e}")));
            }
            check(end, "ending a profiling capture")?;
            let mut exec: sys::CUgraphExec = std::ptr::null_mut();
            let r = sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0);
            sys::cuGraphDestroy(graph);
            check(r, "instantiating a profiling graph")?;
            let r = sys::cuGraphLaunch(exec, stream);
            let s = sys::cuStreamSynchronize(stream);
            sys::cuGraphExecDestroy(exec);
            check(r, "launching a profiling graph")?;
            check(s, "running a profiling graph")?;
        }
        let prof = self.profile.as_mut().expect("profiling");
        if prof.len() < table.len() {
            prof.resize(table.len(), Default::default());
        }
        for (i, slot) in prof.iter_mut().enumerate().take(table.len()) {
            let ms = self.prof_events[i].ms_to(&self.prof_events[i + 1])?;
            slot.0 += std::time::Duration::from_secs_f64(ms as f64 / 1e3);
            slot.1 += 1;
        }
        Ok(())
    }

    /// The attention split scratch, grown to at least `bytes`.
    pub(crate) fn attn_scratch(&self) -> Option<Dptr> {
        self.attn_part.map(|(p, _)| p)
    }

    /// The multi-block sampler's scratch (`launch::SAMPLE_SCRATCH_BYTES`).
    pub(crate) fn sample_scratch(&self) -> Option<Dptr> {
        self.sample_scratch
    }

    /// Whether the sampling command may run on many blocks.
    pub(crate) fn sample_multi_block(&self) -> bool {
        self.sample_mb
    }

    /// Whether prefill products may run on cuBLAS (the default where the
    /// library loads; `AKUNU_CUDA_CUBLAS=0` starts with it off). Off, they
    /// take `k_gemm_tc`. Affects steps planned from now on (prefill steps
    /// are never captured into chain graphs).
    pub fn set_cublas(&mut self, on: bool) {
        if self.blas_on != on {
            let _ = self.bind();
            let _ = self.sync();
            self.blas_on = on;
        }
    }

    /// Whether greedy and sampled chains (`persist::sample_mode`) of a model
    /// the persistent kernel takes (plain
    /// llama layers, Q4_1 matrices, heads of 64: `persist.rs`) run as one
    /// kernel per chain while their positions stay under
    /// `persist::MAX_POS`, unless the chain asks for the table's order
    /// (`ChainRequest::table_order`: speculative decoding's plain runs).
    /// On by default on sm_90 (`AKUNU_CUDA_PERSIST=0` starts
    /// with it off, `=1` on everywhere); its tokens can differ from the
    /// graph's where two logits nearly tie. Turned on here, a model the
    /// kernel cannot run is reported on stderr.
    pub fn set_persistent(&mut self, on: bool) {
        self.persist_on = on;
        self.persist_asked = on;
    }

    /// Whether chains (greedy or sampled) of a llama model with F16 matrices
    /// too large for the persistent kernel run on the streaming one (`stream.rs`; on by
    /// default on sm_90, off with `AKUNU_CUDA_STREAM=0`). It needs the
    /// persistent switch on too; its chains count in
    /// [`CudaBackend::persistent_chains`].
    pub fn set_streaming(&mut self, on: bool) {
        self.stream_on = on;
    }

    /// Chains that ran on the persistent kernel so far (a counter
    /// that outlives moving the backend into an engine: tests check the
    /// path was taken).
    pub fn persistent_chains(&self) -> Arc<AtomicU64> {
        self.persist_chains.clone()
    }

    /// The persistent plan for a chain of one-row steps from `first`, when
    /// it is on and the table and the first position allow it, with the
    /// number of the chain's steps it serves (those below its `max_pos`).
    /// A table it cannot run is reported once where the path was asked for
    /// by name (`AKUNU_CUDA_PERSIST=1` users want to know why their model
    /// keeps the graph); by default the graph takes it silently.
    fn persist_plan(
        &mut self,
        table: &DispatchTable,
        first: StepInfo,
        steps: u32,
    ) -> Result<Option<(persist::Plan, u32)>, BackendError> {
        if !self.persist_on || first.rows != 1 || self.profile.is_some() {
            return Ok(None);
        }
        // One plan a table layout: a sampled table's params are read per
        // chain (`Plan::for_chain`), so that a new seed or temperature
        // neither compiles nor allocates.
        let hash = table_hash_with(table, |c| c.kernel != KernelId::GumbelSample);
        if !self.persist_plans.contains_key(&hash) {
            let mut owned = persist::Owned::default();
            let mut plan = persist::plan(self, table, &mut owned);
            // A model that kernel cannot take: the streaming one, when on.
            if let Ok(Err(why)) = &plan
                && self.stream_on
            {
                let why = why.clone();
                plan = stream::plan(self, table, &mut owned)
                    .map(|p| p.map_err(|s| format!("{why}; the streaming kernel: {s}")));
            }
            self.persist_owned.mem.extend(owned.mem);
            self.persist_owned.modules.extend(owned.modules);
            let plan = plan?;
            if let (Err(why), true) = (&plan, self.persist_asked) {
                // Grammar tables end at the logits: say nothing of them.
                if !table
                    .commands
                    .iter()
                    .any(|c| c.kernel == KernelId::GrammarBitmask)
                {
                    eprintln!("akunu: decode keeps the graph path: {why}");
                }
            }
            self.persist_plans.insert(hash, plan);
        }
        Ok(match &self.persist_plans[&hash] {
            Ok(p) if first.pos < p.max_pos => match p.for_chain(table) {
                Ok(p) => Some((p, steps.min(p.max_pos - first.pos))),
                // A sampling configuration the kernel's sampler does not
                // take keeps the graph.
                Err(_) => None,
            },
            _ => None,
        })
    }

    /// cuBLAS's version where it is loaded, or why it is not.
    pub fn cublas_status(&self) -> Result<i32, String> {
        self.blas
            .as_ref()
            .map(|b| b.version())
            .map_err(|e| e.clone())
    }

    /// A counter of the commands run on cuBLAS so far (shared, so that it
    /// can be read after the backend moved into an engine).
    pub fn cublas_commands(&self) -> Arc<AtomicU64> {
        self.blas_commands.clone()
    }

    /// What the cuBLAS prefill products compute (`blas::Products`); steps
    /// that stay off cuBLAS are exact either way.
    pub fn set_prefill_products(&mut self, products: blas::Products) {
        if let Ok(b) = &mut self.blas {
            b.set_products(products);
        }
    }

    /// When prefill keeps its dequantized weights resident
    /// (`blas::CachePolicy`); applies to tables prepared from now on (a
    /// cache already built stays).
    pub fn set_prefill_cache(&mut self, policy: blas::CachePolicy) {
        self.cache_policy = policy;
    }

    /// Device bytes the prefill weight cache holds (0 without one), shared
    /// so that it can be read after the backend moved into an engine.
    pub fn prefill_cache_bytes(&self) -> Arc<AtomicU64> {
        self.prefill_cache_bytes.clone()
    }

    /// The cached runs of the product with this key (none if uncached).
    pub(crate) fn cached_runs(&self, key: &blas::CacheKey) -> &[blas::CachedRun] {
        self.prefill_cache.get(key).map_or(&[], |v| v.as_slice())
    }

    /// The cuBLAS handle, when products may use it.
    pub(crate) fn blas(&self) -> Option<&blas::Blas> {
        self.blas.as_ref().ok().filter(|_| self.blas_on)
    }

    /// Whether steps are being profiled (each captured into a graph on the
    /// main stream alone).
    pub(crate) fn profiling(&self) -> bool {
        self.profile.is_some()
    }

    /// The cuBLAS products' scratch (sized by `prepare`).
    pub(crate) fn blas_scratch(&self) -> Option<blas::Scratch> {
        self.blas_scratch
    }

    pub(crate) fn count_blas_command(&self) {
        self.blas_commands.fetch_add(1, Ordering::Relaxed);
    }

    /// Chooses between the multi-block sampler (the default) and the
    /// single-block `k_gumbel_sample` for `GumbelSample` commands planned
    /// from now on; both give the same bits (the GPU tests compare them).
    /// Captured chain graphs are dropped so that the next chain uses the
    /// choice.
    pub fn set_multi_block_sampling(&mut self, on: bool) {
        if self.sample_mb != on {
            self.sample_mb = on;
            let _ = self.bind();
            let _ = self.sync();
            self.chain.clear_graphs();
        }
    }
}

fn invalid(table: &DispatchTable, i: usize, why: String) -> BackendError {
    BackendError::InvalidCommand {
        index: i,
        label: table.label(i).to_string(),
        why,
    }
}

fn load_kernels(cubin: &[u8], smem_optin: i32) -> Result<Kernels, BackendError> {
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: `cubin` is a complete cubin image produced by NVRTC for this
    // device (or read back from our own cache, keyed by its inputs).
    check(
        unsafe { sys::cuModuleLoadData(&mut module, cubin.as_ptr() as *const _) },
        "loading the kernel module (a stale cache? remove ~/.cache/akunu/cuda)",
    )?;
    let get = |name: &str| -> Result<sys::CUfunction, BackendError> {
        let mut f: sys::CUfunction = std::ptr::null_mut();
        let c = std::ffi::CString::new(name).expect("no NUL");
        // SAFETY: module is loaded; out-parameter.
        check(
            unsafe { sys::cuModuleGetFunction(&mut f, module, c.as_ptr()) },
            &format!("finding kernel {name}"),
        )?;
        Ok(f)
    };
    // The tensor-core gemv's four kernels of a weight type, by suffix.
    let tcg = |dt: DType, suffix: &str| -> Result<TcgKernels, BackendError> {
        Ok(TcgKernels {
            dtype: dt as u32,
            one: get(&format!("k_gemv_tc_{suffix}"))?,
            one_full: get(&format!("k_gemv_tcf_{suffix}"))?,
            verify: get(&format!("k_gemv_tc8_{suffix}"))?,
            bulk: get(&format!("k_gemv_tcb_{suffix}"))?,
        })
    };
    let mut k = Kernels {
        module,
        embedding: get("k_embedding")?,
        rmsnorm: get("k_rmsnorm")?,
        residual_rmsnorm: get("k_residual_rmsnorm")?,
        gemv: get("k_gemv")?,
        gemv_v8: get("k_gemv_v8")?,
        gemv_typed_v8: [
            (DType::F32 as u32, get("k_gemv_f32_v8")?),
            (DType::F16 as u32, get("k_gemv_f16_v8")?),
            (DType::BF16 as u32, get("k_gemv_bf16_v8")?),
            (DType::Q8_0 as u32, get("k_gemv_q8_0_v8")?),
            (DType::Q4_0 as u32, get("k_gemv_q4_0_v8")?),
            (DType::Q4_1 as u32, get("k_gemv_q4_1_v8")?),
        ],
        gemv_typed: [
            (DType::F32 as u32, get("k_gemv_f32")?, None),
            (
                DType::F16 as u32,
                get("k_gemv_f16")?,
                Some(get("k_gemv_f16_r2")?),
            ),
            (
                DType::BF16 as u32,
                get("k_gemv_bf16")?,
                Some(get("k_gemv_bf16_r2")?),
            ),
            (
                DType::Q8_0 as u32,
                get("k_gemv_q8_0")?,
                Some(get("k_gemv_q8_0_r2")?),
            ),
            (
                DType::Q4_0 as u32,
                get("k_gemv_q4_0")?,
                Some(get("k_gemv_q4_0_r2")?),
            ),
            (
                DType::Q4_1 as u32,
                get("k_gemv_q4_1")?,
                Some(get("k_gemv_q4_1_r2")?),
            ),
            (DType::Q5_0 as u32, get("k_gemv_q5_0")?, None),
            (DType::Q5_1 as u32, get("k_gemv_q5_1")?, None),
            (DType::Q4_K as u32, get("k_gemv_q4_k")?, None),
            (DType::Q5_K as u32, get("k_gemv_q5_k")?, None),
            (DType::Q6_K as u32, get("k_gemv_q6_k")?, None),
        ],
        gemv_tc: [
            tcg(DType::F16, "f16")?,
            tcg(DType::Q8_0, "q8_0")?,
            tcg(DType::Q4_0, "q4_0")?,
            tcg(DType::Q4_1, "q4_1")?,
        ],
        gemm: get("k_gemm")?,
        gemm_tc: get("k_gemm_tc")?,
        gemm_split: get("k_gemm_split")?,
        gemm_dequant: get("k_gemm_dequant")?,
        gemm_dequant_hi: get("k_gemm_dequant_hi")?,
        rope_kv_write: get("k_rope_kv_write")?,
        attn_decode: [
            get("k_attn_decode_64")?,
            get("k_attn_decode_128")?,
            get("k_attn_decode_256")?,
        ],
        attn_prefill: get("k_attn_prefill")?,
        attn_flash: [None; 3],
        attn_tc: [None; 2],
        attn_tc_f16: [None; 2],
        argmax: get("k_argmax")?,
        gumbel_sample: get("k_gumbel_sample")?,
        sample_prep: get("k_sample_prep")?,
        sample_select: get("k_sample_select")?,
        topk_select: get("k_topk_select")?,
        repetition_penalty: get("k_repetition_penalty")?,
        temperature_scale: get("k_temperature_scale")?,
        grammar_bitmask: get("k_grammar_bitmask")?,
        chain_advance: get("k_chain_advance")?,
        clock_probe: get("k_clock_probe")?,
    };
    // Kernels that take more dynamic shared memory than the default 48 KB
    // must say so per function.
    let allow_smem = |f: sys::CUfunction, bytes: i32, what: &str| {
        // SAFETY: valid function handle; callers pass at most the device's
        // opt-in limit (less the kernel's static shared memory).
        check(
            unsafe {
                sys::cuFuncSetAttribute(
                    f,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes,
                )
            },
            &format!("raising the {what} shared-memory limit"),
        )
    };
    // The matrix-vector kernels stage their input rows in shared memory:
    // allow them the device's whole opt-in amount.
    let typed = k
        .gemv_typed
        .iter()
        .flat_map(|t| std::iter::once(t.1).chain(t.2));
    let v8 = std::iter::once(k.gemv_v8).chain(k.gemv_typed_v8.iter().map(|t| t.1));
    for f in std::iter::once(k.gemv).chain(typed).chain(v8) {
        allow_smem(f, smem_optin - launch::GEMV_STATIC_SMEM as i32, "gemv")?;
    }
    for f in k
        .gemv_tc
        .iter()
        .flat_map(|t| [t.one, t.one_full, t.verify, t.bulk])
    {
        allow_smem(
            f,
            smem_optin - launch::TCG_STATIC_SMEM as i32,
            "tensor-core gemv",
        )?;
    }
    // The flash prefill attention kernels take their tiles as dynamic
    // shared memory: allowed where the device has that much per block.
    for (slot, width) in k.attn_flash.iter_mut().zip(launch::FLASH_WIDTHS) {
        let bytes = launch::flash_smem_bytes(width);
        if bytes as i32 > smem_optin {
            continue;
        }
        let f = get(&format!("k_attn_flash_{width}"))?;
        allow_smem(f, bytes as i32, "flash attention")?;
        *slot = Some((f, bytes));
    }
    for (i, width) in launch::TC_ATTN_WIDTHS.into_iter().enumerate() {
        let bytes = launch::tc_attention_smem_bytes(width);
        if bytes as i32 > smem_optin {
            continue;
        }
        for (slots, suffix) in [(&mut k.attn_tc, ""), (&mut k.attn_tc_f16, "_f16")] {
            let f = get(&format!("k_attn_tc_{width}{suffix}"))?;
            allow_smem(f, bytes as i32, "tensor-core flash attention")?;
            slots[i] = Some((f, bytes));
        }
    }
    Ok(k)
}

impl BufferRead for CudaBackend {
    fn read(&self, buf: BufferId, offset: u64, out: &mut [u8]) -> Result<(), BackendError> {
        let b = self.range_check(buf, offset, out.len() as u64)?;
        self.bind()?;
        self.sync()?;
        // SAFETY: the range was checked; the stream is idle, so no kernel
        // writes the source while it is copied.
        check(
            unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr() as *mut _, b.ptr + offset, out.len()) },
            "reading device memory",
        )
    }
}

impl Backend for CudaBackend {
    fn describe(&self) -> String {
        let i = &self.info;
        format!(
            "cuda: {} (sm_{}{}, {} SMs, {} MB L2, {:.0} GiB), driver {}.{}, {} KV cache{}{}{}",
            i.name,
            i.cc.0,
            i.cc.1,
            i.sm_count,
            i.l2_bytes >> 20,
            i.total_mem as f64 / (1u64 << 30) as f64,
            i.driver / 1000,
            (i.driver % 1000) / 10,
            self.kv.name(),
            if self.pdl { "" } else { ", no PDL" },
            match (self.blas_on, &self.blas) {
                (true, Ok(b)) => format!(
                    ", cuBLAS {} prefill{}",
                    b.version(),
                    match b.products() {
                        blas::Products::Exact => "",
                        blas::Products::F16 => " (f16 products)",
                    }
                ),
                _ => ", no cuBLAS".to_string(),
            },
            match (
                self.prefill_cache_bytes.load(Ordering::Relaxed),
                self.cache_policy
            ) {
                (0, blas::CachePolicy::Off) => ", no prefill weight cache".to_string(),
                (0, _) => String::new(),
                (b, _) => format!(
                    ", prefill weights cached ({:.1} GiB)",
                    b as f64 / (1u64 << 30) as f64
                ),
            }
        )
    }

    fn weight(&mut self, file: &GgufFile, tensor: &TensorInfo) -> Result<BufferId, BackendError> {
        self.bind()?;
        let data = file.tensor_data(tensor);
        let repacked = repack::repack_blocks(tensor.dtype, data)
            .map_err(|why| BackendError::Device(format!("tensor {}: {why}", tensor.name)))?;
        let bytes: &[u8] = repacked.as_deref().unwrap_or(data);
        let ptr = device::alloc(bytes.len() as u64, &tensor.name)?;
        // SAFETY: `ptr` holds bytes.len() bytes; the source is a live slice.
        check(
            unsafe { sys::cuMemcpyHtoD_v2(ptr, bytes.as_ptr() as *const _, bytes.len()) },
            &format!("uploading {}", tensor.name),
        )?;
        let id = self.buffers.len() as BufferId;
        self.buffers.push(DevBuf {
            ptr,
            len: bytes.len() as u64,
            what: tensor.name.clone(),
            weight: true,
            repacked: repacked.is_some(),
        });
        Ok(id)
    }

    fn alloc(&mut self, bytes: u64, what: &str) -> Result<BufferId, BackendError> {
        self.bind()?;
        let ptr = device::alloc(bytes, what)?;
        // SAFETY: `ptr` holds at least `bytes` bytes.
        check(
            unsafe { sys::cuMemsetD8_v2(ptr, 0, bytes.max(256) as usize) },
            "clearing a buffer",
        )?;
        let id = self.buffers.len() as BufferId;
        self.buffers.push(DevBuf {
            ptr,
            len: bytes,
            what: what.to_string(),
            weight: false,
            repacked: false,
        });
        Ok(id)
    }

    fn write(&mut self, buf: BufferId, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        let b = self.range_check(buf, offset, data.len() as u64)?;
        if b.weight {
            return Err(BackendError::Device(format!(
                "buffer '{}' is a read-only weight",
                b.what
            )));
        }
        let dst = b.ptr + offset;
        self.bind()?;
        self.sync()?;
        // SAFETY: range checked; the stream is idle, so no kernel reads the
        // destination while it is written.
        check(
            unsafe { sys::cuMemcpyHtoD_v2(dst, data.as_ptr() as *const _, data.len()) },
            "writing device memory",
        )
    }

    fn validate(&self, table: &DispatchTable) -> Result<(), BackendError> {
        akunu_core::backend::check_extents(table, &|id| {
            self.buffer(id).map(|b| (b.len, b.what.clone()))
        })?;
        for (i, cmd) in table.commands.iter().enumerate() {
            // The kernels that touch the cache are compiled for one type.
            let kv = match cmd.kernel {
                KernelId::RopeKvWrite => {
                    let p = cmd.params::<RopeParams>();
                    Some((p.kv_type, p.head_dim))
                }
                KernelId::Attention => {
                    let p = cmd.params::<AttnParams>();
                    Some((p.kv_type, p.head_dim))
                }
                _ => None,
            };
            if let Some((t, head_dim)) = kv {
                if t != self.kv as u32 {
                    return Err(invalid(
                        table,
                        i,
                        format!(
                            "KV cache type {t} on a backend whose kernels were compiled for {}",
                            self.kv.name()
                        ),
                    ));
                }
                // Decode attention reads an f16 cache two dims at a time.
                if self.kv == KvType::F16 && head_dim % 2 != 0 {
                    return Err(invalid(
                        table,
                        i,
                        format!(
                            "an f16 KV cache needs an even head dimension, not {head_dim} \
                             (use --kv-type f32)"
                        ),
                    ));
                }
            }
            launch::check_patch(cmd).map_err(|why| invalid(table, i, why))?;
            repack::check_bindings(cmd, &|id| self.buffer(id).map(|b| (b.len, b.repacked)))
                .map_err(|why| invalid(table, i, why))?;
        }
        Ok(())
    }

    fn command_times(&self) -> Option<Vec<(std::time::Duration, u64)>> {
        self.profile.clone()
    }

    fn set_profiling(&mut self, on: bool) -> bool {
        self.profile = on.then(Vec::new);
        true
    }

    fn kv_type(&self) -> KvType {
        self.kv
    }

    fn single_kernel_chains(&self) -> u64 {
        self.persist_chains.load(Ordering::Relaxed)
    }

    fn preferred_chunk(&self) -> u32 {
        // Early exit makes a long chunk cost nothing after a stop, and
        // streaming makes it cost no latency; graph size (commands x chunk)
        // is what bounds it. Big GPUs run a token in well under a
        // millisecond, so give them longer chunks.
        if self.info.sm_count >= 64 { 64 } else { 32 }
    }

    fn launches_per_step(&self, table: &DispatchTable) -> usize {
        // One kernel per command (decode attention merges its splits in
        // its last block), less the commands fused into a neighbour.
        table.len() - fusion::fused_away(table)
    }

    fn measure_bandwidth(&mut self) -> Option<f64> {
        self.bind().ok()?;
        chain::copy_bandwidth(self.stream).ok()
    }

    fn replay(
        &mut self,
        table: &DispatchTable,
        first: StepInfo,
        steps: u32,
        mut hook: Option<StepHook<'_>>,
    ) -> Result<u32, BackendError> {
        if first.rows == 0 || first.rows > table.max_rows {
            return Err(BackendError::Device(format!(
                "a step of {} rows (the table allows 1..={})",
                first.rows, table.max_rows
            )));
        }
        self.prepare(table, first.rows)?;
        for s in 0..steps {
            let step = StepInfo {
                pos: first.pos + s * first.rows,
                tok: first.tok + s * first.rows,
                rows: first.rows,
            };
            self.run_step(table, &step)?;
            if let Some(h) = hook.as_mut() {
                self.sync()?;
                if !h(s, &*self) {
                    return Ok(s + 1);
                }
            }
        }
        self.sync()?;
        Ok(steps)
    }

    fn decode_chain(
        &mut self,
        table: &DispatchTable,
        first: StepInfo,
        req: &ChainRequest<'_>,
        sink: TokenSink<'_>,
    ) -> Result<ChainReport, BackendError> {
        self.prepare(table, first.rows)?;
        let persist = if req.table_order {
            None
        } else {
            self.persist_plan(table, first, req.steps)?
        };
        let Some((plan, served)) = persist else {
            return chain::decode_chain(self, table, first, req, sink, None);
        };
        self.persist_chains.fetch_add(1, Ordering::Relaxed);
        if served == req.steps {
            return chain::decode_chain(self, table, first, req, sink, Some(plan));
        }
        // The chain runs past the positions the persistent kernel serves:
        // its first `served` steps run persistent, the rest on the graph
        // (both read and write the same cache and conveyor). Which path
        // computes a position therefore depends on the position alone, not
        // on the chain's length.
        let head_req = ChainRequest {
            steps: served,
            ..req.clone()
        };
        let (mut last, mut cancelled) = (None, false);
        let head = chain::decode_chain(
            self,
            table,
            first,
            &head_req,
            &mut |s, tok| {
                last = Some(tok);
                cancelled = !sink(s, tok);
                !cancelled
            },
            Some(plan),
        )?;
        let ended =
            head.steps < served || cancelled || last.is_some_and(|t| req.stop_ids.contains(&t));
        if ended {
            return Ok(head);
        }
        let rest = StepInfo {
            pos: first.pos + served,
            tok: first.tok + served,
            rows: 1,
        };
        let tail_req = ChainRequest {
            steps: req.steps - served,
            ..req.clone()
        };
        let tail = chain::decode_chain(
            self,
            table,
            rest,
            &tail_req,
            &mut |s, tok| sink(s + served, tok),
            None,
        )?;
        Ok(ChainReport {
            steps: head.steps + tail.steps,
            computed_after_end: match (head.computed_after_end, tail.computed_after_end) {
                (Some(a), Some(b)) => Some(a + b),
                _ => None,
            },
            delivery_us: [head.delivery_us, tail.delivery_us].concat(),
        })
    }

    fn verify_step(&mut self, table: &DispatchTable, first: StepInfo) -> Result<(), BackendError> {
        if first.rows == 0 || first.rows > table.max_rows {
            return Err(BackendError::Device(format!(
                "a step of {} rows (the table allows 1..={})",
                first.rows, table.max_rows
            )));
        }
        self.prepare(table, first.rows)?;
        if self.profile.is_some() {
            // Per-command timing needs the uncaptured path.
            return self.run_step(table, &first);
        }
        chain::verify_step(self, table, first)
    }

    fn exact_rows(&self, table: &DispatchTable) -> u32 {
        launch::decode_rows(self, table)
    }

    fn slow_start_drafts(&self) -> bool {
        // An 8-row pass cost about 1.9 one-row steps on the default model
        // (repeat-text, bench/RESULTS.md), so a draft is cheap per token:
        // full-length drafts from the start.
        false
    }

    fn idle_run_max(&self) -> u32 {
        // Every plain run is a submission with its own round trip (control
        // block, graph launch, token read-back: the GPU idles for it), and
        // runs of up to 32 amortise it on text the n-grams cannot predict.
        // Measured on the default model's free-text task (RESULTS.md),
        // after the tensor-core gemv made plain decode 18% faster: caps of
        // 16, 32 and 64 gave 0.945x, 0.978x and 0.986x plain speed (32 and
        // 64 found no draft there), the copy task 2.13x, 2.13x and 2.11x.
        // `AKUNU_CUDA_SPEC_IDLE_MAX` overrides it (developer A/B runs).
        static IDLE_MAX: knob::Knob = knob::Knob::new("AKUNU_CUDA_SPEC_IDLE_MAX");
        IDLE_MAX.number().filter(|&v| v >= 1).unwrap_or(32)
    }
}

impl CudaBackend {
    /// Binds the context and sizes the scratch buffers `table`'s steps of
    /// `rows` rows use: what every replay, chain and verification does
    /// first. Only steps of `blas::min_rows()` or more take cuBLAS, so only
    /// they look at its weight cache and scratch (decode steps skip the
    /// per-command scan).
    fn prepare(&mut self, table: &DispatchTable, rows: u32) -> Result<(), BackendError> {
        self.bind()?;
        self.ensure_attn_scratch(table)?;
        self.ensure_sample_scratch()?;
        if rows >= blas::min_rows() {
            self.ensure_prefill_cache(table)?;
            self.ensure_blas_scratch(table)?;
        }
        Ok(())
    }

    /// A product command's bindings resolved as `launch::plan` resolves a
    /// prefill product's (no patched slots).
    fn product_bindings(&self, c: &DispatchCmd) -> Result<[u64; MAX_BUFFERS], String> {
        let mut bind = [0u64; MAX_BUFFERS];
        for (slot, b) in c.bindings().iter().enumerate() {
            bind[slot] = self.dptr(b.buffer)?.0 + b.offset;
        }
        Ok(bind)
    }

    /// The key of a product command in the weight cache.
    fn cache_key(&self, c: &DispatchCmd, p: &GemvParams) -> Result<blas::CacheKey, String> {
        Ok(blas::CacheKey::of(p, &self.product_bindings(c)?))
    }

    /// Dequantizes, once, the quantized weights of `table`'s cuBLAS
    /// products into the weight cache, as far as the policy's budget of the
    /// free device memory allows (products left out dequantize a chunk at
    /// a time in every step, as without a cache). Synchronous: a few ms.
    fn ensure_prefill_cache(&mut self, table: &DispatchTable) -> Result<(), BackendError> {
        if self.blas().is_none() || self.cache_policy == blas::CachePolicy::Off {
            return Ok(());
        }
        let mut todo = Vec::new();
        for (i, p) in blas::cacheable(table) {
            let c = &table.commands[i];
            let key = self.cache_key(c, &p).map_err(BackendError::Device)?;
            if !self.prefill_cache.contains_key(&key) && !todo.iter().any(|(k, _, _)| *k == key) {
                todo.push((key, i, p));
            }
        }
        if todo.is_empty() {
            return Ok(());
        }
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: out-parameters; the context is current (prepare binds it).
        check(
            unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
            "reading free device memory",
        )?;
        let mut budget = self.cache_policy.budget(free as u64);
        let (mut built, mut left_out, mut left_bytes) = (0u64, 0usize, 0u64);
        for (key, i, p) in todo {
            let bytes = blas::cache_bytes(&p);
            let ptr = match (bytes <= budget).then(|| device::alloc(bytes, "prefill weight cache"))
            {
                Some(Ok(ptr)) => ptr,
                None | Some(Err(BackendError::OutOfMemory { .. })) => {
                    left_out += 1;
                    left_bytes += bytes;
                    continue;
                }
                Some(Err(e)) => return Err(e),
            };
            match self.fill_cached_runs(&table.commands[i], &p, ptr) {
                Ok(runs) => {
                    budget -= bytes;
                    self.prefill_cache.insert(key, runs);
                    self.prefill_cache_bytes.fetch_add(bytes, Ordering::Relaxed);
                    built += bytes;
                }
                Err(e) => {
                    // The launches queued for it finish first (sync), so
                    // nothing writes the memory once it is freed.
                    let _ = self.sync();
                    // SAFETY: allocated above, recorded nowhere else.
                    unsafe { sys::cuMemFree_v2(ptr) };
                    return Err(BackendError::Device(e));
                }
            }
        }
        if left_out > 0 && (self.cache_policy == blas::CachePolicy::On || blas::verbose()) {
            eprintln!(
                "akunu: prefill weight cache: {left_out} products ({:.1} GiB) left out for lack of \
                 GPU memory ({:.1} GiB free); they dequantize in every prefill step",
                left_bytes as f64 / (1u64 << 30) as f64,
                free as f64 / (1u64 << 30) as f64
            );
        }
        if built > 0 {
            self.sync()?;
        }
        Ok(())
    }

    /// Queues the dequantization of product `c`'s quantized runs into the
    /// cache allocation at `ptr` (`blas::cache_bytes(p)` bytes), in
    /// `k_gemm_dequant` launches whose unit counts fit 32 bits; returns the
    /// runs as the cache holds them.
    fn fill_cached_runs(
        &self,
        c: &DispatchCmd,
        p: &GemvParams,
        ptr: Dptr,
    ) -> Result<Vec<blas::CachedRun>, String> {
        let bind = self.product_bindings(c)?;
        let per_launch = blas::dequant_rows_per_launch(p.k);
        let row_bytes = p.k as u64 * 4;
        let mut runs = Vec::new();
        let mut at = ptr;
        for (a, b) in blas::quant_runs(p) {
            let mut c0 = a;
            while c0 < b {
                let c1 = b.min(c0.saturating_add(per_launch));
                let units = (c1 - c0) as u64 * (p.k / 8) as u64;
                launch::Launch {
                    f: self.k.gemm_dequant,
                    grid: (units.div_ceil(256) as u32, 1, 1),
                    block: 256,
                    smem: 0,
                    bind,
                    params: c.params,
                    step: launch::StepArg::default(),
                    tail: launch::Tail::Gemm {
                        ptr: at + (c0 - a) as u64 * row_bytes,
                        o0: c0,
                        o1: c1,
                    },
                    pdl: false,
                }
                .fire(self.stream)?;
                c0 = c1;
            }
            runs.push(blas::CachedRun { a, b, ptr: at });
            at += (b - a) as u64 * row_bytes;
        }
        Ok(runs)
    }

    /// Sizes the cuBLAS products' scratch for `table` (when cuBLAS is
    /// loaded). Without the memory, products keep `k_gemm_tc`.
    fn ensure_blas_scratch(&mut self, table: &DispatchTable) -> Result<(), BackendError> {
        if self.blas.is_err() {
            return Ok(());
        }
        let cached = |i: usize| {
            let c = &table.commands[i];
            self.cache_key(c, &c.params())
                .is_ok_and(|k| self.prefill_cache.contains_key(&k))
        };
        let need = blas::scratch_need(table, &cached);
        let have = self.blas_scratch.unwrap_or_default();
        if need.bytes() == 0 || (have.x_bytes >= need.x_bytes && have.w_bytes >= need.w_bytes) {
            return Ok(());
        }
        let need = blas::Scratch {
            x_bytes: need.x_bytes.max(have.x_bytes),
            w_bytes: need.w_bytes.max(have.w_bytes),
            ptr: 0,
        };
        if let Some(old) = self.blas_scratch.take() {
            self.sync()?;
            // SAFETY: allocated by us; the stream is idle and no graph
            // holds it (cuBLAS products are never captured into chains).
            unsafe { sys::cuMemFree_v2(old.ptr) };
        }
        match blas::alloc_scratch(need) {
            Ok(s) => self.blas_scratch = Some(s),
            Err(BackendError::OutOfMemory { bytes, .. }) => {
                if blas::verbose() {
                    eprintln!(
                        "akunu: prefill without cuBLAS: no memory for its {bytes}-byte scratch"
                    );
                }
            }
            Err(e) => return Err(e),
        }
        Ok(())
    }

    /// Zeroes decode attention's per-head tickets (each merge resets its
    /// own, so this is needed only for a new buffer or after a chain was
    /// stopped from the host mid-kernel). Synchronous.
    pub(crate) fn clear_attn_tickets(&mut self) -> Result<(), BackendError> {
        if let Some((p, _)) = self.attn_part {
            // SAFETY: the scratch holds at least ATTN_TICKET_BYTES bytes
            // (attn_scratch_bytes); the memset is ordered on our stream
            // after every kernel that used them and before any later one.
            check(
                unsafe {
                    sys::cuMemsetD8Async(p, 0, launch::ATTN_TICKET_BYTES as usize, self.stream)
                },
                "clearing the attention tickets",
            )?;
            self.sync()?;
        }
        Ok(())
    }

    /// Sizes the split-attention scratch for the table's attention commands.
    fn ensure_attn_scratch(&mut self, table: &DispatchTable) -> Result<(), BackendError> {
        let need = launch::attn_scratch_bytes(table);
        if need == 0 || self.attn_part.is_some_and(|(_, n)| n >= need) {
            return Ok(());
        }
        if let Some((p, _)) = self.attn_part.take() {
            self.sync()?;
            // SAFETY: allocated by us, no longer referenced (stream idle;
            // graphs that bound it are dropped below).
            unsafe { sys::cuMemFree_v2(p) };
            self.chain.clear_graphs();
        }
        let p = device::alloc(need, "attention partials")?;
        self.attn_part = Some((p, need));
        // Fresh allocations may hold a freed buffer's bytes.
        self.clear_attn_tickets()?;
        Ok(())
    }

    /// Allocates the multi-block sampler's scratch once, zeroed (its ticket
    /// must start at 0; the kernels keep it so).
    fn ensure_sample_scratch(&mut self) -> Result<(), BackendError> {
        if self.sample_scratch.is_some() {
            return Ok(());
        }
        let p = device::alloc(launch::SAMPLE_SCRATCH_BYTES, "sampling scratch")?;
        // SAFETY: `p` is a fresh allocation of SAMPLE_SCRATCH_BYTES bytes;
        // the memset is synchronous with respect to the host.
        let r = check(
            unsafe { sys::cuMemsetD8_v2(p, 0, launch::SAMPLE_SCRATCH_BYTES as usize) },
            "clearing the sampling scratch",
        );
        if let Err(e) = r {
            // SAFETY: allocated just above, referenced by nothing.
            unsafe { sys::cuMemFree_v2(p) };
            return Err(e);
        }
        self.sample_scratch = Some(p);
        Ok(())
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let _ = self.bind();
        // SAFETY: all handles were created by this backend and are released
        // once; the stream is synchronised first so no work still uses them.
        unsafe {
            sys::cuStreamSynchronize(self.stream);
            sys::cuStreamSynchronize(self.side);
            self.chain.clear_graphs();
            for b in &self.buffers {
                sys::cuMemFree_v2(b.ptr);
            }
            if let Some((p, _)) = self.attn_part {
                sys::cuMemFree_v2(p);
            }
            if let Some(p) = self.sample_scratch {
                sys::cuMemFree_v2(p);
            }
            if let Some(s) = self.blas_scratch {
                sys::cuMemFree_v2(s.ptr);
            }
            // One allocation per product: its first run starts it.
            for runs in self.prefill_cache.values() {
                if let Some(r) = runs.first() {
                    sys::cuMemFree_v2(r.ptr);
                }
            }
            for &p in &self.persist_owned.mem {
                sys::cuMemFree_v2(p);
            }
            for &m in &self.persist_owned.modules {
                sys::cuModuleUnload(m);
            }
            // The handle goes before its stream.
            self.blas = Err(String::new());
            sys::cuModuleUnload(self.k.module);
            sys::cuStreamDestroy_v2(self.stream);
            sys::cuStreamDestroy_v2(self.side);
        }
    }
}

/// Device buffers by id, for the launch planner.
impl CudaBackend {
    pub(crate) fn dptr(&self, id: BufferId) -> Result<(Dptr, u64), String> {
        self.buffers
            .get(id as usize)
            .map(|b| (b.ptr, b.len))
            .ok_or_else(|| format!("unknown buffer {id}"))
    }

    pub(crate) fn kernels(&self) -> &Kernels {
        &self.k
    }

    /// Whether kernels launch with programmatic dependent launch: on by
    /// default from compute capability 9.0 (Hopper);
    /// `AKUNU_CUDA_PDL=0` turns it off (for comparisons).
    pub(crate) fn pdl(&self) -> bool {
        self.pdl
    }

    /// Blocks of kernel `f` that fit on one SM at once with this block size
    /// and dynamic shared memory (at least 1), cached per configuration.
    pub(crate) fn occupancy(&self, f: sys::CUfunction, block: u32, smem: u32) -> u32 {
        let key = (f as usize, block, smem);
        let mut cache = self.occupancy.lock().unwrap_or_else(|e| e.into_inner());
        *cache.entry(key).or_insert_with(|| {
            let mut n: std::ffi::c_int = 0;
            // SAFETY: `f` is a loaded kernel and `n` an out-parameter.
            let r = unsafe {
                sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    &mut n,
                    f,
                    block as i32,
                    smem as usize,
                )
            };
            if r == sys::CUresult::CUDA_SUCCESS {
                n.max(1) as u32
            } else {
                1
            }
        })
    }

    pub(crate) fn sm_count(&self) -> u32 {
        self.info.sm_count.max(1) as u32
    }

    pub(crate) fn smem_optin(&self) -> u32 {
        self.info.smem_optin.max(0) as u32
    }
}

/// Graph cache key: a hash of the table's commands (the sampled table's
/// parameters change with the sampling configuration).
pub(crate) fn table_hash(table: &DispatchTable) -> u64 {
    table_hash_with(table, |_| true)
}

/// `table_hash` with the params of the commands `params_count` rejects
/// left out.
pub(crate) fn table_hash_with(
    table: &DispatchTable,
    params_count: impl Fn(&DispatchCmd) -> bool,
) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for c in &table.commands {
        (c.kernel as u16).hash(&mut h);
        (c.patch as u8, c.rows as u8, c.n_buffers).hash(&mut h);
        (c.patch_offset_1, c.patch_offset_2, c.grid).hash(&mut h);
        for b in c.bindings() {
            (b.buffer, b.offset).hash(&mut h);
        }
        if params_count(c) {
            c.params.hash(&mut h);
        }
    }
    h.finish()
}

#[allow(dead_code)]
type GraphMap = HashMap<(u64, u32), sys::CUgraphExec>;
