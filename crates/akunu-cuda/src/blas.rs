//! Prefill products on cuBLAS (issue 5): tensor-core GEMMs for steps of many
//! rows, with results that match an f32 product as `k_gemm_tc`'s do.
//!
//! A `Gemv` command of `rows >= min_rows()` input rows whose weights are
//! F16, Q8_0, Q4_0 or Q4_1 becomes (model.cu, "Operands of the cuBLAS
//! prefill products"):
//!
//! ```text
//! k_gemm_split      x (activation applied) -> X = [X_lo | X_hi] f16 per row; bias seeded into out
//! per F16 segment:  out (+)= W . X_hi            cublasGemmEx, depth k
//!                   out  += W . X_lo             cublasGemmEx, depth k
//! per chunk of quantized rows:
//!   k_gemm_dequant  W -> [W_hi | W_lo] f16 per row (scratch)
//!                   out (+)= W_hi . X_hi                         depth k
//!                   out  += [W_hi | W_lo] . [X_lo ; X_hi]         depth 2k
//! ```
//!
//! The weight cache (`CachePolicy`, `akunu --prefill-cache`, on by default
//! where it fits): the first prefill step of a table dequantizes every
//! quantized product's rows once, as `k_gemm_dequant` writes a chunk, into
//! memory kept for the backend's life (`CudaBackend::ensure_prefill_cache`);
//! steps then read `[W_hi | W_lo]` from there, one product per run of rows,
//! and skip the dequantization (28 GB of writes a step on 8B Q4_0: pp512
//! 10.9k -> 13.4-13.6k tok/s on an H200). The cost is 4 bytes a cached
//! weight of device memory (26 GiB for 8B).
//!
//! With `Products::F16` (`akunu --prefill-products f16`) each output range
//! takes one product instead, `W_hi . X_hi` (F16 weights: `W . X_hi`), and
//! `k_gemm_dequant_hi` writes `W_hi` alone: the weights and inputs rounded
//! to f16, as llama.cpp's and PyTorch's f16 GEMMs use them, a third of the
//! products and half the dequantized bytes of the exact form.
//!
//! Every product is f16 x f16 with f32 accumulation (`CUBLAS_COMPUTE_32F`,
//! default math: no TF32 or other reduced modes) into the f32 output, in
//! place (`ldc` = the output's row stride, so fused QKV / gate|up segments
//! land in their columns). The first product of an output range overwrites
//! it unless the command accumulates or has a bias (which `k_gemm_split`
//! seeds); the others add (beta = 1). Soft-capped products stay on
//! `k_gemm_tc` (only the last-row logits have one).
//!
//! In cuBLAS's column-major terms a row-major weight [n x k] is a k x n
//! matrix with leading dimension k, used transposed; the input rows
//! (row-major [rows x 2k] halves) are a 2k x rows matrix, of which the hi
//! half is the k x rows matrix starting k elements in, with the same
//! leading dimension 2k; the output is an n x rows matrix with leading
//! dimension `out_stride`.
//!
//! The library is loaded at run time (`cudarc`'s dynamic loading). Where it
//! cannot be found, or `AKUNU_CUDA_CUBLAS=0`, prefill keeps `k_gemm_tc`;
//! `AKUNU_CUDA_CUBLAS=1` prints why cuBLAS is not used, if it is not.
//! Prefill steps run outside graphs, except a step profiled by `akunu
//! profile`, which is captured: the handle's workspace is set explicitly
//! (`cublasSetWorkspace`), so cuBLAS allocates nothing during a capture.

use crate::device::{self, Dptr, Event};
use crate::knob::Knob;
use crate::launch::{Launch, Tail};
use akunu_core::backend::BackendError;
use akunu_core::dtype::DType;
use akunu_core::ops::{GemvParams, KernelId};
use akunu_core::table::{DispatchTable, RowMode};
use cudarc::cublas::sys as cb;
use cudarc::driver::sys;
use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

/// Fewest input rows that take cuBLAS; smaller steps keep `k_gemm_tc`.
/// Below this a product is too narrow to fill the GPU with cuBLAS's tiles
/// and the split and dequantization passes cost more than they save; a
/// first guess, to be measured (`AKUNU_CUDA_CUBLAS_MIN_ROWS` overrides it).
const MIN_ROWS: u32 = 64;

/// Bytes of dequantized weights (hi + lo, 4 bytes a weight) per chunk of a
/// quantized product. Larger chunks make taller (more efficient) GEMMs;
/// smaller ones may stay in L2 between the dequantization and the two
/// products that read them. Measured on the H200, 8B Q4_0 pp512: 64 MiB
/// 7.67k tok/s, 256 MiB 8.22k, 1 GiB 8.32k; 256 MiB keeps most of the gain
/// for a quarter of the memory (`AKUNU_CUDA_CUBLAS_CHUNK_MB` overrides it).
const CHUNK_BYTES: u64 = 256 << 20;

/// cuBLAS workspace, set explicitly so that no call allocates (32 MiB is
/// NVIDIA's recommendation for Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

/// Fewest input rows of a step whose products take cuBLAS.
pub fn min_rows() -> u32 {
    static ROWS: Knob = Knob::new("AKUNU_CUDA_CUBLAS_MIN_ROWS");
    ROWS.number::<u32>().map_or(MIN_ROWS, |v| v.max(1))
}

fn chunk_bytes() -> u64 {
    static MB: Knob = Knob::new("AKUNU_CUDA_CUBLAS_CHUNK_MB");
    MB.number::<u64>().map_or(CHUNK_BYTES, |mb| mb.max(1) << 20)
}

/// Whether `AKUNU_CUDA_CUBLAS` asks for cuBLAS (anything but `0`; unset
/// means yes).
pub fn wanted() -> bool {
    std::env::var("AKUNU_CUDA_CUBLAS").map_or(true, |v| v != "0")
}

/// Whether `AKUNU_CUDA_CUBLAS=1` asks to be told why cuBLAS is not used.
pub fn verbose() -> bool {
    std::env::var("AKUNU_CUDA_CUBLAS").is_ok_and(|v| v == "1")
}

/// Directories searched for `libcublas.so.13` when the dynamic loader's own
/// search (`LD_LIBRARY_PATH`, the ld.so cache) finds no cuBLAS: the CUDA
/// toolkit's library directories.
fn toolkit_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
        if let Some(root) = std::env::var_os(var) {
            let root = PathBuf::from(root);
            dirs.push(root.join("lib64"));
            dirs.push(root.join("lib"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    if let Ok(rd) = std::fs::read_dir("/usr/local") {
        let mut versioned: Vec<PathBuf> = rd
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("cuda-"))
            .map(|e| e.path().join("lib64"))
            .collect();
        versioned.sort();
        dirs.extend(versioned.into_iter().rev());
    }
    dirs
}

/// Finds and loads cuBLAS once per process. cudarc looks the library up by
/// name (`libcublas.so`, `libcublas.so.13`, ...); where that fails, the
/// toolkit directories are tried by path: cuBLAS Lt and cuBLAS are loaded
/// from there (globally, and kept), after which the lookup by name finds
/// the loaded library by its soname.
fn library() -> Result<(), String> {
    static LIB: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    LIB.get_or_init(|| {
        // SAFETY: loading a shared library runs its initialisers; cuBLAS's
        // have no preconditions.
        if unsafe { cb::is_culib_present() } {
            return Ok(());
        }
        let mut tried = Vec::new();
        for dir in toolkit_dirs() {
            let lib = dir.join("libcublas.so.13");
            if !lib.exists() {
                continue;
            }
            tried.push(lib.display().to_string());
            let lt = dir.join("libcublasLt.so.13");
            let flags = libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL;
            // SAFETY: as above. The handles are leaked on purpose: the
            // libraries stay loaded for the process, as cudarc's own do.
            unsafe {
                if lt.exists()
                    && let Ok(h) = libloading::os::unix::Library::open(Some(&lt), flags)
                {
                    std::mem::forget(h);
                }
                if let Ok(h) = libloading::os::unix::Library::open(Some(&lib), flags) {
                    std::mem::forget(h);
                    if cb::is_culib_present() {
                        return Ok(());
                    }
                }
            }
        }
        Err(if tried.is_empty() {
            "no cuBLAS library (libcublas.so.13) on the loader's path or in the CUDA toolkit"
                .to_string()
        } else {
            format!("cuBLAS could not be loaded from {}", tried.join(", "))
        })
    })
    .clone()
}

fn ok(r: cb::cublasStatus_t, what: &str) -> Result<(), String> {
    r.result().map_err(|e| format!("{what}: {e}"))
}

/// The kernels that write the products' operands (model.cu, "Operands of
/// the cuBLAS prefill products").
#[derive(Copy, Clone, Debug)]
pub struct OperandKernels {
    /// `k_gemm_split`: the input rows as f16 halves.
    pub split: sys::CUfunction,
    /// `k_gemm_dequant`: weight rows as `[W_hi | W_lo]`.
    pub dequant: sys::CUfunction,
    /// `k_gemm_dequant_hi`: `W_hi` alone (`Products::F16`).
    pub dequant_hi: sys::CUfunction,
}

/// What the prefill products compute (`--prefill-products`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum Products {
    /// An f32 product: weights and inputs as f16 hi + lo halves, every
    /// cross term but `W_lo . X_lo` (about 2^-22 of the product) kept.
    #[default]
    Exact,
    /// One f16 x f16 product (f32 accumulation) of the weights and inputs
    /// rounded to f16.
    F16,
}

/// Slots of dequantized weights in the scratch: chunk c is dequantized
/// into slot c % SLOTS on the side stream while the products read the
/// previous chunk's slot on the main stream (`Lane`).
pub const SLOTS: u64 = 2;

/// Whether the weight dequantization runs on its own stream, overlapping
/// the products (`AKUNU_CUDA_DQ_OVERLAP=0` keeps it on the main stream:
/// A/B runs).
fn overlap_wanted() -> bool {
    static DQ: Knob = Knob::new("AKUNU_CUDA_DQ_OVERLAP");
    !DQ.is("0")
}

/// The dequantization's side stream and, per slot, the event that its
/// weights are ready (recorded there) and the event that the products
/// reading them are done (recorded on the main stream). Plain handles, owned by `Blas`
/// (the stream) and its `Event`s.
#[derive(Copy, Clone, Debug)]
pub struct Lane {
    stream: sys::CUstream,
    ready: [sys::CUevent; SLOTS as usize],
    free: [sys::CUevent; SLOTS as usize],
}

impl Lane {
    /// The side stream and its events; the events are owned by the
    /// returned `Event`s (the `Lane` only copies their handles), the stream
    /// by whoever calls `destroy_stream`.
    fn create() -> Result<(Lane, Vec<Event>), String> {
        let events = (0..2 * SLOTS)
            .map(|_| Event::new().map_err(|e| e.to_string()))
            .collect::<Result<Vec<_>, _>>()?;
        let mut stream: sys::CUstream = std::ptr::null_mut();
        // SAFETY: out-parameter; the context is current (Blas::new).
        unsafe {
            sys::cuStreamCreate(
                &mut stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
            .result()
            .map_err(|e| format!("creating the dequantization stream: {e}"))?;
        }
        let n = SLOTS as usize;
        let lane = Lane {
            stream,
            ready: std::array::from_fn(|i| events[i].0),
            free: std::array::from_fn(|i| events[n + i].0),
        };
        Ok((lane, events))
    }

    /// Destroys the side stream (by `Blas`'s Drop, after the owner
    /// synchronised its stream, which waited on every `ready` event, so the
    /// side stream is idle).
    fn destroy_stream(&self) {
        // SAFETY: created by `create`, destroyed once.
        unsafe {
            sys::cuStreamDestroy_v2(self.stream);
        }
    }

    /// Runs `l` (a dequantization into `slot`) on the side stream once the
    /// products that last read the slot are done, and makes `main` wait
    /// for it; or, without `side`, on `main`, whose order already puts it
    /// after them. A slot's `free` event that was never recorded does not
    /// hold the side stream back (the driver treats it as complete).
    pub fn dequantize(
        &self,
        l: &crate::launch::Launch,
        slot: usize,
        side: bool,
        main: sys::CUstream,
    ) -> Result<(), String> {
        if !side {
            return l.fire(main);
        }
        // SAFETY: live handles (owned by `Blas`, which outlives its plans).
        unsafe {
            sys::cuStreamWaitEvent(self.stream, self.free[slot], 0)
                .result()
                .map_err(|e| e.to_string())?;
            l.fire(self.stream)?;
            sys::cuEventRecord(self.ready[slot], self.stream)
                .result()
                .map_err(|e| e.to_string())?;
            sys::cuStreamWaitEvent(main, self.ready[slot], 0)
                .result()
                .map_err(|e| e.to_string())
        }
    }

    /// Marks `slot` free once the work queued on `main` so far is done.
    pub fn release(&self, slot: usize, main: sys::CUstream) -> Result<(), String> {
        // SAFETY: live handles.
        unsafe { sys::cuEventRecord(self.free[slot], main) }
            .result()
            .map_err(|e| e.to_string())
    }
}

/// A cuBLAS handle bound to the backend's stream, with its own workspace.
pub struct Blas {
    handle: cb::cublasHandle_t,
    stream: sys::CUstream,
    workspace: Dptr,
    version: i32,
    /// The dequantization's side stream, unless turned off or its creation
    /// failed (the dequantization then runs on the main stream).
    lane: Option<Lane>,
    /// The events whose handles `lane` holds.
    _lane_events: Vec<Event>,
    /// Dequantized chunks planned so far: the next one's slot.
    next_slot: AtomicU32,
    /// What the products compute.
    products: Products,
}

impl Blas {
    /// Loads the library if needed and creates a handle that runs on
    /// `stream`. The backend's context must be current.
    pub fn new(stream: sys::CUstream) -> Result<Blas, String> {
        library()?;
        // cudarc panics when a symbol is missing (an unexpected library):
        // treat that as "no cuBLAS" rather than taking the process down.
        std::panic::catch_unwind(|| Self::create(stream))
            .unwrap_or_else(|_| Err("the cuBLAS library lacks a function akunu uses".into()))
    }

    fn create(stream: sys::CUstream) -> Result<Blas, String> {
        let mut handle: cb::cublasHandle_t = std::ptr::null_mut();
        // SAFETY: out-parameter; the context is current.
        ok(
            unsafe { cb::cublasCreate_v2(&mut handle) },
            "creating a cuBLAS handle",
        )?;
        let workspace = match device::alloc(WORKSPACE_BYTES as u64, "cuBLAS workspace") {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: created above, used by nothing.
                unsafe { cb::cublasDestroy_v2(handle) };
                return Err(e.to_string());
            }
        };
        // From here `blas` owns the handle and the workspace: an error
        // drops it, which frees both once. (Building a second `Blas` from
        // its fields would free them twice: `Blas` is `Drop`.)
        let mut blas = Blas {
            handle,
            stream,
            workspace,
            version: 0,
            lane: None,
            _lane_events: Vec::new(),
            next_slot: AtomicU32::new(0),
            products: Products::Exact,
        };
        if overlap_wanted() {
            match Lane::create() {
                Ok((l, events)) => {
                    blas.lane = Some(l);
                    blas._lane_events = events;
                }
                Err(why) if verbose() => {
                    eprintln!("akunu: dequantization on the main stream: {why}")
                }
                Err(_) => {}
            }
        }
        blas.configure()?;
        let mut version = 0;
        // SAFETY: live handle, out-parameter.
        ok(
            unsafe { cb::cublasGetVersion_v2(blas.handle, &mut version) },
            "reading the cuBLAS version",
        )?;
        blas.version = version;
        Ok(blas)
    }

    /// Stream, then workspace (setting the stream resets the workspace to
    /// cuBLAS's own pool), then the math mode.
    fn configure(&self) -> Result<(), String> {
        // SAFETY: the handle, stream and workspace are live; the workspace
        // holds WORKSPACE_BYTES bytes and outlives the handle (Drop).
        unsafe {
            ok(
                cb::cublasSetStream_v2(self.handle, self.stream as cb::cudaStream_t),
                "setting the cuBLAS stream",
            )?;
            ok(
                cb::cublasSetWorkspace_v2(
                    self.handle,
                    self.workspace as *mut c_void,
                    WORKSPACE_BYTES,
                ),
                "setting the cuBLAS workspace",
            )?;
            // Default math: f16 products on the tensor cores, f32
            // accumulation as asked by the compute type; nothing reduced.
            ok(
                cb::cublasSetMathMode(self.handle, cb::cublasMath_t::CUBLAS_DEFAULT_MATH),
                "setting the cuBLAS math mode",
            )
        }
    }

    /// Sets what the products compute (for products planned from now on).
    pub fn set_products(&mut self, products: Products) {
        self.products = products;
    }

    /// What the products compute.
    pub fn products(&self) -> Products {
        self.products
    }

    /// cuBLAS's version number (e.g. 130100 for 13.1.0).
    pub fn version(&self) -> i32 {
        self.version
    }

    /// What planned products run with; `overlap` lets the dequantization
    /// take the side stream (not in profiled steps, captured on one
    /// stream). `sm_count`: the device's SMs (`overlaps`).
    pub fn target(&self, overlap: bool, sm_count: u32) -> Target<'_> {
        Target {
            handle: self.handle,
            stream: self.stream,
            lane: self.lane.filter(|_| overlap),
            next_slot: &self.next_slot,
            sm_count,
            products: self.products,
        }
    }
}

/// The handle and stream of planned products, the dequantization's side
/// stream if it is used, and the slot counter.
#[derive(Copy, Clone, Debug)]
pub struct Target<'a> {
    handle: cb::cublasHandle_t,
    stream: sys::CUstream,
    lane: Option<Lane>,
    next_slot: &'a AtomicU32,
    sm_count: u32,
    products: Products,
}

/// Whether a chunk of `rows` weight rows against `n` input rows takes the
/// side stream: only where its products leave SMs idle, fewer 128 x 128
/// output tiles than SMs (a guess at cuBLAS's tiling). There the next
/// chunk's dequantization runs beside them: SmolLM2-shaped pp512 gained 10%
/// (103.7k to 114.7k tok/s). Where the products fill the GPU, the two only
/// take turns: 8B Q4_0 pp512 measured 1% slower with every chunk on the
/// side stream (bench/RESULTS.md, session 10).
fn overlaps(rows: u32, n: u32, sm_count: u32) -> bool {
    (rows.div_ceil(128) as u64) * (n.div_ceil(128) as u64) < sm_count as u64
}

impl Drop for Blas {
    fn drop(&mut self) {
        if let Some(l) = &self.lane {
            l.destroy_stream();
        }
        // SAFETY: created by `new`, destroyed once; the owner synchronised
        // the stream first, so no product still uses the workspace.
        unsafe {
            cb::cublasDestroy_v2(self.handle);
            sys::cuMemFree_v2(self.workspace);
        }
    }
}

/// One `cublasGemmEx` call: `C (m x n, f32) = A^T . B + beta C` with A
/// (k x m, leading dimension lda) and B (k x n, ldb) in f16.
#[derive(Copy, Clone, Debug)]
pub struct Gemm {
    handle: cb::cublasHandle_t,
    stream: sys::CUstream,
    m: i32,
    n: i32,
    k: i32,
    a: Dptr,
    lda: i32,
    b: Dptr,
    ldb: i32,
    c: Dptr,
    ldc: i32,
    beta: f32,
}

impl Gemm {
    /// Enqueues the product on `stream` (or records it, while capturing),
    /// which must be the handle's.
    pub fn fire(&self, stream: sys::CUstream) -> Result<(), String> {
        if stream != self.stream {
            return Err("a cuBLAS product planned for another stream".into());
        }
        let alpha = 1.0f32;
        // SAFETY: the handle is live (owned by the backend, which outlives
        // its plans); A, B and C lie inside the command's bindings and the
        // backend's GEMM scratch (checked by `plan`); alpha and beta are
        // host values read during the call.
        let r = unsafe {
            cb::cublasGemmEx(
                self.handle,
                cb::cublasOperation_t::CUBLAS_OP_T,
                cb::cublasOperation_t::CUBLAS_OP_N,
                self.m,
                self.n,
                self.k,
                &alpha as *const f32 as *const c_void,
                self.a as *const c_void,
                cb::cudaDataType_t::CUDA_R_16F,
                self.lda,
                self.b as *const c_void,
                cb::cudaDataType_t::CUDA_R_16F,
                self.ldb,
                &self.beta as *const f32 as *const c_void,
                self.c as *mut c_void,
                cb::cudaDataType_t::CUDA_R_32F,
                self.ldc,
                cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cb::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        };
        ok(r, "cublasGemmEx")
    }
}

/// The backend's scratch for cuBLAS products: the split input rows, then
/// `SLOTS` slots of `w_bytes` for the dequantized weights of a chunk.
#[derive(Copy, Clone, Debug, Default)]
pub struct Scratch {
    pub ptr: Dptr,
    pub x_bytes: u64,
    pub w_bytes: u64,
}

impl Scratch {
    pub fn bytes(&self) -> u64 {
        self.x_bytes + SLOTS * self.w_bytes
    }
}

/// Whether a weight type takes the cuBLAS path (F16 in place, the others
/// dequantized).
fn blas_type(dt: u32) -> bool {
    matches!(
        DType::from_ggml(dt),
        Some(DType::F16 | DType::Q8_0 | DType::Q4_0 | DType::Q4_1)
    )
}

fn is_f16(dt: u32) -> bool {
    DType::from_ggml(dt) == Some(DType::F16)
}

/// Whether a product of these params can run on cuBLAS at all (the row
/// count aside): every segment of a cuBLAS type, whole 32-element blocks,
/// no soft-cap, sizes within cuBLAS's 32-bit arguments.
pub fn eligible(p: &GemvParams) -> bool {
    let n_seg = (p.n_seg as usize).clamp(1, 3);
    p.k > 0
        && p.k.is_multiple_of(32)
        && p.k < (1 << 29)
        && p.softcap == 0.0
        && p.total_rows() > 0
        && p.out_stride >= p.total_rows()
        && p.dtype[..n_seg].iter().all(|&d| blas_type(d))
}

/// Rows of a quantized chunk for products of depth `k`: the chunk budget's
/// worth, a multiple of 64, at least 64.
fn chunk_rows(k: u32) -> u64 {
    let per_row = k as u64 * 4;
    ((chunk_bytes() / per_row) / 64 * 64).max(64)
}

/// The runs of consecutive quantized segments of a product, as global row
/// ranges `[a, b)`: each is dequantized (or cached) as one block of rows
/// (`k_gemm_dequant` resolves each row's segment).
pub fn quant_runs(p: &GemvParams) -> Vec<(u32, u32)> {
    let n_seg = (p.n_seg as usize).clamp(1, 3);
    let mut runs = Vec::new();
    let (mut off, mut run) = (0u32, None::<(u32, u32)>);
    for s in 0..n_seg {
        let n = p.n[s];
        if n == 0 {
            continue;
        }
        if is_f16(p.dtype[s]) {
            runs.extend(run.take());
        } else {
            run = Some((run.map_or(off, |r| r.0), off + n));
        }
        off += n;
    }
    runs.extend(run);
    runs
}

/// When the dequantized prefill weights stay resident (`--prefill-cache`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum CachePolicy {
    /// Cache while the planes take at most half the device memory free
    /// when the first prefill step is prepared.
    #[default]
    Auto,
    /// Cache whatever fits, leaving `CACHE_HEADROOM` free.
    On,
    /// Dequantize a chunk at a time in every prefill step.
    Off,
}

impl CachePolicy {
    /// `auto`, `on` or `off` (also `1` / `0`).
    pub fn parse(s: &str) -> Option<CachePolicy> {
        match s {
            "auto" => Some(CachePolicy::Auto),
            "on" | "1" => Some(CachePolicy::On),
            "off" | "0" => Some(CachePolicy::Off),
            _ => None,
        }
    }

    /// Bytes the cache may take of `free` device bytes.
    pub fn budget(self, free: u64) -> u64 {
        match self {
            CachePolicy::Auto => free / 2,
            CachePolicy::On => free.saturating_sub(CACHE_HEADROOM),
            CachePolicy::Off => 0,
        }
    }
}

/// Device memory `CachePolicy::On` leaves free for what is allocated after
/// the cache (decode plans, larger scratch for a longer step).
pub const CACHE_HEADROOM: u64 = 1 << 30;

/// A product's identity in the weight cache: its weight pointers, segment
/// rows and depth.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct CacheKey {
    w: [Dptr; 3],
    n: [u32; 3],
    k: u32,
}

impl CacheKey {
    /// The key of a product with these params whose launch bindings are
    /// `bind` (weights at 2, 3, 4).
    pub fn of(p: &GemvParams, bind: &[u64]) -> CacheKey {
        let n_seg = (p.n_seg as usize).clamp(1, 3);
        let mut w = [0; 3];
        let mut n = [0; 3];
        w[..n_seg].copy_from_slice(&bind[2..2 + n_seg]);
        n[..n_seg].copy_from_slice(&p.n[..n_seg]);
        CacheKey { w, n, k: p.k }
    }
}

/// Rows `[a, b)` of a product dequantized once, as `k_gemm_dequant` writes
/// a chunk: row o at `ptr + (o - a) * 4k` bytes, `[W_hi | W_lo]`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CachedRun {
    pub a: u32,
    pub b: u32,
    pub ptr: Dptr,
}

/// Bytes of the cached planes of a product's quantized runs.
pub fn cache_bytes(p: &GemvParams) -> u64 {
    quant_runs(p)
        .iter()
        .map(|&(a, b)| (b - a) as u64 * p.k as u64 * 4)
        .sum()
}

/// The product commands of `table` whose prefill steps take cuBLAS with
/// quantized weights: what the weight cache holds.
pub fn cacheable(table: &DispatchTable) -> impl Iterator<Item = (usize, GemvParams)> + '_ {
    let many_rows = table.max_rows >= min_rows();
    table
        .commands
        .iter()
        .enumerate()
        .filter(move |(_, c)| many_rows && c.kernel == KernelId::Gemv && c.rows == RowMode::AllRows)
        .map(|(i, c)| (i, c.params::<GemvParams>()))
        .filter(|(_, p)| eligible(p) && !quant_runs(p).is_empty())
}

/// Rows of one `k_gemm_dequant` launch of depth `k`: its unit count (a
/// quarter block each) must fit in 32 bits.
pub fn dequant_rows_per_launch(k: u32) -> u32 {
    u32::MAX / (k / 8).max(1)
}

/// Scratch the cuBLAS products of `table` need (zero when none of its
/// steps has `min_rows()` rows or no product qualifies).
/// `cached(i)` says that command i's quantized rows are in the weight
/// cache, so that it needs no dequantization slots.
pub fn scratch_need(table: &DispatchTable, cached: &dyn Fn(usize) -> bool) -> Scratch {
    let rows = table.max_rows as u64;
    let mut need = Scratch::default();
    if table.max_rows < min_rows() {
        return need;
    }
    for (i, c) in table.commands.iter().enumerate() {
        if c.kernel != KernelId::Gemv || c.rows != RowMode::AllRows {
            continue;
        }
        let p: GemvParams = c.params();
        if !eligible(&p) {
            continue;
        }
        let k = p.k as u64;
        need.x_bytes = need.x_bytes.max(rows * k * 4);
        let quant_rows: u64 = quant_runs(&p).iter().map(|&(a, b)| (b - a) as u64).sum();
        if quant_rows > 0 && !cached(i) {
            need.w_bytes = need.w_bytes.max(quant_rows.min(chunk_rows(p.k)) * k * 4);
        }
    }
    // Keep the weight chunk 256-byte aligned behind the inputs.
    need.x_bytes = need.x_bytes.div_ceil(256) * 256;
    need
}

/// The operations of a `Gemv` command of `rows` input rows on cuBLAS, or
/// `None` where it does not apply (the caller then launches `k_gemm_tc`).
/// `l` is the command's launch with bindings, params and step set; the
/// kernels are `split` and `dequant` (model.cu `k_gemm_split`,
/// `k_gemm_dequant`). With a side stream in `blas`, each chunk's
/// dequantization runs there into the next slot, so that it overlaps the
/// products of the chunk before it, in this command or an earlier one;
/// without one, everything runs on the main stream in slot 0. A run of
/// quantized rows found in `cached` (the weight cache) is read from there
/// by one product of all its rows, with no dequantization.
pub fn plan(
    blas: Target,
    scratch: Scratch,
    kernels: OperandKernels,
    p: &GemvParams,
    l: &Launch,
    rows: u32,
    cached: &[CachedRun],
) -> Option<Vec<crate::launch::Op>> {
    use crate::launch::Op;
    if rows < min_rows() || !eligible(p) {
        return None;
    }
    let (k, total) = (p.k, p.total_rows());
    let x_need = rows as u64 * k as u64 * 4;
    if x_need > scratch.x_bytes || rows as u64 * (k as u64 * 2) > i32::MAX as u64 {
        return None;
    }
    let n_seg = (p.n_seg as usize).clamp(1, 3);
    let runs = quant_runs(p);
    let cached_run = |a: u32, b: u32| cached.iter().find(|c| c.a == a && c.b == b);
    let to_dequantize = runs.iter().any(|&(a, b)| cached_run(a, b).is_none());
    let chunk = (scratch.w_bytes / (k as u64 * 4)).min(chunk_rows(k));
    // k_gemm_dequant counts a chunk's quarter blocks in 32 bits.
    if to_dequantize && (chunk == 0 || chunk > dequant_rows_per_launch(k) as u64) {
        return None;
    }
    let x = scratch.ptr;
    let w = scratch.ptr + scratch.x_bytes;
    let out = l.bind[1];
    let ld_out = p.out_stride as i32;
    // The first product of each output range overwrites it, unless the
    // output already holds what the product adds to.
    let beta0 = if p.accumulate != 0 || p.bias != 0 {
        1.0
    } else {
        0.0
    };
    let gemm = |m: u32, depth: u32, a: Dptr, lda: u32, b: Dptr, o0: u32, beta: f32| {
        Op::Gemm(Gemm {
            handle: blas.handle,
            stream: blas.stream,
            m: m as i32,
            n: rows as i32,
            k: depth as i32,
            a,
            lda: lda as i32,
            b,
            ldb: 2 * k as i32,
            c: out + o0 as u64 * 4,
            ldc: ld_out,
            beta,
        })
    };
    let x_hi = x + k as u64 * 2;
    let x_lo = x;
    let kernel = |f: sys::CUfunction, grid: u32, gy: u32, ptr: Dptr, o0: u32, o1: u32| {
        Op::Kernel(Launch {
            f,
            grid: (grid, gy, 1),
            block: 256,
            smem: 0,
            tail: Tail::Gemm { ptr, o0, o1 },
            ..*l
        })
    };
    let split_cover = if p.bias != 0 { k.max(total) } else { k };
    let mut ops = vec![kernel(
        kernels.split,
        split_cover.div_ceil(1024),
        rows,
        x,
        0,
        0,
    )];
    let lane = blas.lane;
    let exact = blas.products == Products::Exact;
    // F16 segments are read in place; consecutive quantized ones form one
    // run of rows (the dequantization resolves each row's segment).
    let mut off = 0u32;
    for s in 0..n_seg {
        let n = p.n[s];
        if n > 0 && is_f16(p.dtype[s]) {
            let wptr = l.bind[2 + s];
            ops.push(gemm(n, k, wptr, k, x_hi, off, beta0));
            if exact {
                ops.push(gemm(n, k, wptr, k, x_lo, off, 1.0));
            }
        }
        off += n;
    }
    for (a, b) in runs {
        if let Some(c) = cached_run(a, b) {
            ops.push(gemm(b - a, k, c.ptr, 2 * k, x_hi, a, beta0));
            if exact {
                ops.push(gemm(b - a, 2 * k, c.ptr, 2 * k, x_lo, a, 1.0));
            }
            continue;
        }
        let mut c0 = a;
        while c0 < b {
            let c1 = (c0 as u64 + chunk).min(b as u64) as u32;
            // Quarter blocks: k_gemm_dequant's threads.
            let units = (c1 - c0) as u64 * (k / 8) as u64;
            // With a side stream, every chunk takes the next slot and
            // releases it after its products, so that the side stream's
            // waits see every use of a slot, including the chunks whose
            // dequantization stays on the main stream (`overlaps`).
            let slot = match lane {
                Some(_) => (blas.next_slot.fetch_add(1, Ordering::Relaxed) as u64 % SLOTS) as usize,
                None => 0,
            };
            let ws = w + slot as u64 * scratch.w_bytes;
            let f = if exact {
                kernels.dequant
            } else {
                kernels.dequant_hi
            };
            let dq = kernel(f, units.div_ceil(256) as u32, 1, ws, c0, c1);
            match (lane, dq) {
                (Some(lane), Op::Kernel(l)) => {
                    let side = overlaps(c1 - c0, rows, blas.sm_count);
                    ops.push(Op::Dequant(l, lane, slot, side));
                }
                (_, dq) => ops.push(dq),
            }
            ops.push(gemm(c1 - c0, k, ws, 2 * k, x_hi, c0, beta0));
            if exact {
                ops.push(gemm(c1 - c0, 2 * k, ws, 2 * k, x_lo, c0, 1.0));
            }
            if let Some(lane) = lane {
                ops.push(Op::Release(lane, slot));
            }
            c0 = c1;
        }
    }
    Some(ops)
}

/// Allocates `need` bytes of GEMM scratch (no clearing needed: every
/// product writes what it reads first).
pub fn alloc_scratch(need: Scratch) -> Result<Scratch, BackendError> {
    let ptr = device::alloc(need.bytes(), "cuBLAS prefill scratch")?;
    Ok(Scratch { ptr, ..need })
}

#[cfg(test)]
mod tests {
    //! The plan's operations run on the host: the two operand kernels as
    //! model.cu defines them, `cublasGemmEx` by its definition (column
    //! major, A transposed), on a toy memory. This checks the layouts,
    //! leading dimensions, output offsets, chunks and betas against a
    //! plain f64 product; the device kernels themselves are checked on a
    //! GPU (tests/gpu.rs).
    use super::*;
    use crate::launch::{Op, StepArg};
    use akunu_core::ops::{ACT_NONE, ACT_SWIGLU};
    use akunu_core::table::MAX_PARAM_BYTES;
    use half::f16;

    const SPLIT: usize = 0x51;
    const DEQUANT: usize = 0xde;
    const DEQUANT_HI: usize = 0xdf;

    /// Device memory: regions at 2^32-spaced addresses.
    struct Mem(Vec<Vec<u8>>);

    impl Mem {
        fn add(&mut self, bytes: Vec<u8>) -> u64 {
            self.0.push(bytes);
            (self.0.len() as u64) << 32
        }
        fn at(&mut self, addr: u64, n: usize) -> &mut [u8] {
            let (r, off) = ((addr >> 32) as usize - 1, (addr & 0xffff_ffff) as usize);
            &mut self.0[r][off..off + n]
        }
        fn f32(&mut self, a: u64) -> f32 {
            f32::from_le_bytes(self.at(a, 4).try_into().unwrap())
        }
        fn set_f32(&mut self, a: u64, v: f32) {
            self.at(a, 4).copy_from_slice(&v.to_le_bytes());
        }
        fn f16(&mut self, a: u64) -> f32 {
            f16::from_le_bytes(self.at(a, 2).try_into().unwrap()).to_f32()
        }
        fn set_f16(&mut self, a: u64, v: f16) {
            self.at(a, 2).copy_from_slice(&v.to_le_bytes());
        }
    }

    fn split(v: f32) -> (f16, f16) {
        let hi = f16::from_f32(v);
        (hi, f16::from_f32(v - hi.to_f32()))
    }

    fn silu(x: f32) -> f32 {
        x / (1.0 + (-x).exp())
    }

    /// Runs `ops` on `mem`; `w(o, e)` is weight row o's element e (what
    /// k_gemm_dequant reads from the quantized blocks).
    fn run(
        ops: &[Op],
        mem: &mut Mem,
        p: &GemvParams,
        rows: u32,
        w: &dyn Fn(u32, u32) -> f32,
        bias: &dyn Fn(u32) -> f32,
    ) {
        let k = p.k as u64;
        // Slots holding dequantized weights that products have yet to read
        // (a slot may be written again only after its `Release`).
        let mut busy = [false; SLOTS as usize];
        for op in ops {
            let l = match op {
                Op::Release(_, slot) => {
                    assert!(busy[*slot], "slot {slot} released twice");
                    busy[*slot] = false;
                    continue;
                }
                Op::Dequant(l, _, slot, _) => {
                    assert!(!busy[*slot], "slot {slot} written before its release");
                    busy[*slot] = true;
                    assert!([DEQUANT, DEQUANT_HI].contains(&(l.f as usize)));
                    Op::Kernel(*l)
                }
                op => *op,
            };
            match &l {
                Op::Kernel(l) => {
                    let Tail::Gemm { ptr, o0, o1 } = l.tail else {
                        panic!("unexpected tail")
                    };
                    match l.f as usize {
                        SPLIT => {
                            assert_eq!(l.grid.1, rows);
                            assert!(l.grid.0 as u64 * 1024 >= k);
                            for r in 0..rows as u64 {
                                let xr = l.bind[0] + r * p.x_stride as u64 * 4;
                                for j in 0..k {
                                    let mut v = mem.f32(xr + j * 4);
                                    if p.input_act == ACT_SWIGLU {
                                        v = silu(v) * mem.f32(xr + (k + j) * 4);
                                    }
                                    let (hi, lo) = split(v);
                                    mem.set_f16(ptr + (r * 2 * k + j) * 2, lo);
                                    mem.set_f16(ptr + (r * 2 * k + k + j) * 2, hi);
                                }
                                if p.bias != 0 {
                                    assert!(l.grid.0 as u64 * 1024 >= p.total_rows() as u64);
                                    for o in 0..p.total_rows() {
                                        let a =
                                            l.bind[1] + (r * p.out_stride as u64 + o as u64) * 4;
                                        let old = if p.accumulate != 0 { mem.f32(a) } else { 0.0 };
                                        mem.set_f32(a, old + bias(o));
                                    }
                                }
                            }
                        }
                        f @ (DEQUANT | DEQUANT_HI) => {
                            let units = (o1 - o0) as u64 * k / 8;
                            assert!(l.grid.0 as u64 * 256 >= units);
                            for o in o0..o1 {
                                for e in 0..k {
                                    let (hi, lo) = split(w(o, e as u32));
                                    let row = ptr + (o - o0) as u64 * 2 * k * 2;
                                    mem.set_f16(row + e * 2, hi);
                                    // The hi-only kernel leaves the lo half
                                    // as it was: poison, which a product
                                    // reading it would show.
                                    let lo = if f == DEQUANT { lo } else { f16::NAN };
                                    mem.set_f16(row + (k + e) * 2, lo);
                                }
                            }
                        }
                        f => panic!("unexpected kernel {f:#x}"),
                    }
                }
                Op::Gemm(g) => {
                    assert!(g.lda >= g.k && g.ldb >= g.k && g.ldc >= g.m);
                    for j in 0..g.n as u64 {
                        for i in 0..g.m as u64 {
                            let mut s = 0f64;
                            for kk in 0..g.k as u64 {
                                let a = mem.f16(g.a + (i * g.lda as u64 + kk) * 2);
                                let b = mem.f16(g.b + (j * g.ldb as u64 + kk) * 2);
                                s += a as f64 * b as f64;
                            }
                            let c = g.c + (j * g.ldc as u64 + i) * 4;
                            let old = if g.beta != 0.0 { mem.f32(c) } else { 0.0 };
                            mem.set_f32(c, (s + g.beta as f64 * old as f64) as f32);
                        }
                    }
                }
                Op::Dequant(..) | Op::Release(..) => unreachable!("handled above"),
            }
        }
        assert!(!busy.iter().any(|&b| b), "a slot never released");
    }

    /// A product of segments `types` (rows `n`) over `rows` input rows,
    /// planned and run, against the f64 product.
    fn check(types: &[DType], n: &[u32], k: u32, rows: u32, act: u32, bias: bool, acc: bool) {
        // No side stream; a side stream that takes every chunk (slots from
        // 0); one that takes none (slots from 1, on the main stream); each
        // with the exact and the f16 products.
        // Each also with the quantized runs in the weight cache (and no
        // dequantization slots), with and without a side stream.
        for products in [Products::Exact, Products::F16] {
            for (side, slot0) in [(false, 0), (true, 0), (true, 1)] {
                for cache in [false, true] {
                    let case = Case {
                        side,
                        slot0,
                        products,
                        cache,
                    };
                    check_on(types, n, k, rows, act, bias, acc, case);
                }
            }
        }
    }

    /// How a product is planned in `check_on`.
    #[derive(Copy, Clone, Debug)]
    struct Case {
        side: bool,
        slot0: u32,
        products: Products,
        cache: bool,
    }

    #[allow(clippy::too_many_arguments)]
    fn check_on(
        types: &[DType],
        n: &[u32],
        k: u32,
        rows: u32,
        act: u32,
        bias: bool,
        acc: bool,
        case: Case,
    ) {
        let Case {
            side,
            slot0,
            products,
            cache,
        } = case;
        let mut seed = 0x2545f4914f6cdd1du64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            ((seed >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
        };
        let n_seg = types.len();
        let total: u32 = n.iter().sum();
        let out_stride = total + 8;
        let x_stride = if act == ACT_SWIGLU { 2 * k } else { k } + 4;
        let mut p = GemvParams {
            k,
            x_stride,
            out_stride,
            n_seg: n_seg as u32,
            input_act: act,
            accumulate: acc as u32,
            bias: bias as u32,
            ..bytemuck::Zeroable::zeroed()
        };
        for s in 0..n_seg {
            p.n[s] = n[s];
            p.dtype[s] = types[s] as u32;
        }
        // Weights: F16 segments exact in f16; the others any f32 value
        // (the dequantized d * q), with a wide spread of magnitudes.
        let wv: Vec<Vec<f32>> = (0..total)
            .map(|o| {
                (0..k)
                    .map(|e| rnd() * 2f32.powi(((o + e) % 7) as i32 - 3))
                    .collect()
            })
            .collect();
        let seg_of = |o: u32| {
            let mut off = 0;
            for (s, &rows) in n.iter().enumerate() {
                if o < off + rows {
                    return (s, o - off);
                }
                off += rows;
            }
            unreachable!()
        };
        let w = |o: u32, e: u32| {
            let v = wv[o as usize][e as usize];
            if types[seg_of(o).0] == DType::F16 {
                f16::from_f32(v).to_f32()
            } else {
                v
            }
        };
        let bv: Vec<f32> = (0..total).map(|_| rnd()).collect();
        let mut mem = Mem(Vec::new());
        let xv: Vec<f32> = (0..rows * x_stride).map(|_| rnd() * 4.0).collect();
        let mut bind = [0u64; 8];
        bind[0] = mem.add(bytemuck::cast_slice(&xv).to_vec());
        let out0: Vec<f32> = (0..rows * out_stride).map(|_| rnd()).collect();
        bind[1] = mem.add(bytemuck::cast_slice(&out0).to_vec());
        let mut off = 0;
        for s in 0..n_seg {
            // Only F16 segments are read in place; quantized ones go
            // through the dequantization (emulated from `w`).
            let bytes: Vec<u8> = (off..off + n[s])
                .flat_map(|o| (0..k).flat_map(move |e| f16::from_f32(w(o, e)).to_le_bytes()))
                .collect();
            bind[2 + s] = mem.add(bytes);
            off += n[s];
        }
        let need = {
            let x_bytes = (rows as u64 * k as u64 * 4).div_ceil(256) * 256;
            let quant: u64 = (0..n_seg)
                .filter(|&s| types[s] != DType::F16)
                .map(|s| n[s] as u64)
                .sum();
            Scratch {
                ptr: 0,
                x_bytes,
                // A small chunk, so that chunks cross segment boundaries;
                // none where the weight cache holds every quantized row.
                w_bytes: if cache {
                    0
                } else {
                    quant.min(64) * k as u64 * 4
                },
            }
        };
        // The weight cache as k_gemm_dequant fills it (one launch per run).
        let cached: Vec<CachedRun> = if cache {
            quant_runs(&p)
                .into_iter()
                .map(|(a, b)| {
                    let mut bytes = vec![0u8; ((b - a) as u64 * k as u64 * 4) as usize];
                    for o in a..b {
                        for e in 0..k {
                            let (hi, lo) = split(w(o, e));
                            let row = ((o - a) * 2 * k) as usize * 2;
                            let at = row + e as usize * 2;
                            bytes[at..at + 2].copy_from_slice(&hi.to_le_bytes());
                            let at = row + (k + e) as usize * 2;
                            bytes[at..at + 2].copy_from_slice(&lo.to_le_bytes());
                        }
                    }
                    CachedRun {
                        a,
                        b,
                        ptr: mem.add(bytes),
                    }
                })
                .collect()
        } else {
            Vec::new()
        };
        let scratch = Scratch {
            ptr: mem.add(vec![0u8; need.bytes() as usize]),
            ..need
        };
        let mut params = [0u8; MAX_PARAM_BYTES];
        params[..std::mem::size_of::<GemvParams>()].copy_from_slice(bytemuck::bytes_of(&p));
        let l = Launch {
            f: std::ptr::null_mut(),
            grid: (1, 1, 1),
            block: 256,
            smem: 0,
            bind,
            params,
            step: StepArg {
                rows,
                ..Default::default()
            },
            tail: Tail::None,
            pdl: false,
        };
        let next_slot = AtomicU32::new(slot0);
        // A side stream that is never fired: `run` interprets the ops.
        let lane = side.then_some(Lane {
            stream: std::ptr::null_mut(),
            ready: [std::ptr::null_mut(); SLOTS as usize],
            free: [std::ptr::null_mut(); SLOTS as usize],
        });
        let target = Target {
            handle: std::ptr::null_mut(),
            stream: std::ptr::null_mut(),
            lane,
            next_slot: &next_slot,
            // 132 SMs: these small chunks leave SMs idle and take the side
            // stream; 1 SM: none does, and the slots rotate on the main
            // stream.
            sm_count: if slot0 == 1 { 1 } else { 132 },
            products,
        };
        let ops = plan(
            target,
            scratch,
            OperandKernels {
                split: SPLIT as sys::CUfunction,
                dequant: DEQUANT as sys::CUfunction,
                dequant_hi: DEQUANT_HI as sys::CUfunction,
            },
            &p,
            &l,
            rows,
            &cached,
        )
        .expect("a cuBLAS plan");
        run(&ops, &mut mem, &p, rows, &w, &|o| bv[o as usize]);
        let what =
            format!("{types:?} {n:?} k {k} rows {rows} act {act} bias {bias} acc {acc} {case:?}");
        if cache {
            // Cached runs take one product range each and no dequantization.
            assert!(
                ops.iter()
                    .all(|o| !matches!(o, Op::Dequant(..) | Op::Release(..))
                        && !matches!(o, Op::Kernel(l) if l.f as usize != SPLIT)),
                "{what}: a dequantization of cached rows"
            );
        }
        // The f16 products: one per output range (per F16 segment, per
        // chunk of quantized rows), on the operands rounded to f16.
        let exact = products == Products::Exact;
        let gemms = ops.iter().filter(|o| matches!(o, Op::Gemm(_))).count();
        let ranges = ops
            .iter()
            .filter(|o| {
                matches!(o, Op::Dequant(..)) || matches!(o, Op::Kernel(l) if l.f as usize != SPLIT)
            })
            .count()
            + if cache { cached.len() } else { 0 }
            + types
                .iter()
                .zip(n)
                .filter(|(t, n)| **t == DType::F16 && **n > 0)
                .count();
        assert_eq!(
            gemms,
            ranges * if exact { 2 } else { 1 },
            "{what}: products"
        );
        let round = |v: f32| {
            if exact {
                v as f64
            } else {
                f16::from_f32(v).to_f64()
            }
        };
        let (mut num, mut den) = (0f64, 0f64);
        for r in 0..rows {
            for o in 0..out_stride {
                let got = mem.f32(bind[1] + (r * out_stride + o) as u64 * 4) as f64;
                let old = out0[(r * out_stride + o) as usize] as f64;
                if o >= total {
                    assert_eq!(got, old, "{what}: row {r} column {o} beyond the product");
                    continue;
                }
                let xr = &xv[(r * x_stride) as usize..];
                let mut want = if acc { old } else { 0.0 };
                if bias {
                    want += bv[o as usize] as f64;
                }
                for e in 0..k as usize {
                    let x = if act == ACT_SWIGLU {
                        silu(xr[e]) * xr[k as usize + e]
                    } else {
                        xr[e]
                    };
                    want += round(w(o, e as u32)) * round(x);
                }
                num += (got - want).powi(2);
                den += want.powi(2);
            }
        }
        let err = (num / den).sqrt();
        assert!(err < 1e-6, "{what}: relative L2 error {err:.2e}");
    }

    #[test]
    fn planned_products_match_an_f64_product() {
        use DType::*;
        // One segment of each type; fused QKV-like products of mixed types
        // (F16 segments between quantized runs); gate|up with SwiGLU input;
        // a bias; accumulation into the output.
        check(&[F16], &[96], 64, 70, ACT_NONE, false, false);
        check(&[Q8_0], &[200], 96, 65, ACT_NONE, false, false);
        check(&[Q4_0], &[130], 64, 64, ACT_SWIGLU, false, true);
        check(&[Q4_1, Q4_1], &[96, 40], 32, 66, ACT_SWIGLU, false, false);
        check(
            &[Q8_0, F16, Q4_0],
            &[64, 32, 72],
            64,
            67,
            ACT_NONE,
            true,
            false,
        );
        check(
            &[F16, Q4_1, Q8_0],
            &[40, 50, 30],
            96,
            64,
            ACT_NONE,
            true,
            true,
        );
    }

    #[test]
    fn cache_policies_parse_and_budget() {
        assert_eq!(CachePolicy::parse("auto"), Some(CachePolicy::Auto));
        assert_eq!(CachePolicy::parse("on"), Some(CachePolicy::On));
        assert_eq!(CachePolicy::parse("1"), Some(CachePolicy::On));
        assert_eq!(CachePolicy::parse("off"), Some(CachePolicy::Off));
        assert_eq!(CachePolicy::parse("0"), Some(CachePolicy::Off));
        assert_eq!(CachePolicy::parse("yes"), None);
        let free = 100u64 << 30;
        assert_eq!(CachePolicy::Auto.budget(free), 50 << 30);
        assert_eq!(CachePolicy::On.budget(free), free - CACHE_HEADROOM);
        assert_eq!(CachePolicy::On.budget(CACHE_HEADROOM / 2), 0);
        assert_eq!(CachePolicy::Off.budget(free), 0);
        // A fused QKV of Q8_0, F16 and Q4_0 segments: two runs, 4 bytes a
        // quantized weight.
        let p = GemvParams {
            k: 64,
            n_seg: 3,
            n: [32, 16, 8],
            dtype: [DType::Q8_0 as u32, DType::F16 as u32, DType::Q4_0 as u32],
            out_stride: 56,
            ..bytemuck::Zeroable::zeroed()
        };
        assert_eq!(quant_runs(&p), vec![(0, 32), (48, 56)]);
        assert_eq!(cache_bytes(&p), (32 + 8) * 64 * 4);
        // Consecutive quantized segments form one run.
        let q = GemvParams {
            dtype: [DType::Q4_0 as u32, DType::Q4_1 as u32, DType::F16 as u32],
            ..p
        };
        assert_eq!(quant_runs(&q), vec![(0, 48)]);
        // The most rows whose quarter blocks a launch counts in 32 bits.
        for k in [32u64, 4096, 14336] {
            let rows = dequant_rows_per_launch(k as u32) as u64;
            assert!(rows * (k / 8) <= u32::MAX as u64 && (rows + 1) * (k / 8) > u32::MAX as u64);
        }
    }

    #[test]
    fn what_stays_off_cublas() {
        let p = GemvParams {
            k: 64,
            x_stride: 64,
            out_stride: 32,
            n_seg: 1,
            n: [32, 0, 0],
            dtype: [DType::Q4_0 as u32, 0, 0],
            ..bytemuck::Zeroable::zeroed()
        };
        assert!(eligible(&p));
        assert!(!eligible(&GemvParams { softcap: 30.0, ..p }));
        assert!(!eligible(&GemvParams { k: 48, ..p }));
        for dt in [
            DType::F32,
            DType::BF16,
            DType::Q5_0,
            DType::Q4_K,
            DType::Q6_K,
        ] {
            let q = GemvParams {
                n_seg: 2,
                n: [32, 32, 0],
                dtype: [DType::Q4_0 as u32, dt as u32, 0],
                out_stride: 64,
                ..p
            };
            assert!(!eligible(&q), "{dt:?}");
        }
    }
}
