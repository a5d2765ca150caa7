//! akunu's CPU backend: replays the dispatch table on all cores.
//!
//! Buffers are 64-byte aligned host allocations; weights are bound straight
//! from the memory-mapped GGUF file (no copy). The replay loop is the
//! chapter's: for each step, for each command, patch a stack copy of the
//! command and run its kernel, split across the thread pool.

mod attn;
pub mod kernels;
pub mod pool;
pub mod quant;

use akunu_core::backend::{Backend, BackendError, BufferRead, StepHook};
use akunu_core::dtype::DType;
use akunu_core::gguf::{GgufFile, TensorInfo};
use akunu_core::ops::KvType;
use akunu_core::table::{BufferId, DispatchTable, StepInfo};
use memmap2::Mmap;
use pool::ThreadPool;
use std::alloc::Layout;
use std::sync::Arc;

const ALIGN: usize = 64;

enum Storage {
    /// Owned, zero-initialised, `ALIGN`-aligned allocation.
    Owned(Layout),
    /// A view into a memory-mapped file kept alive by the `Arc`.
    Mapped(#[allow(dead_code)] Arc<Mmap>),
}

pub(crate) struct Buffer {
    ptr: *mut u8,
    len: usize,
    storage: Storage,
    what: String,
    /// A Q4_0 weight's copy in the 8-row interleaved layout
    /// (`quant::q4x8`) and its row length, made at load when 8-bit
    /// activations are on.
    x8: Option<(Vec<u8>, usize)>,
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if let Storage::Owned(layout) = self.storage {
            // SAFETY: `ptr` came from `alloc_zeroed(layout)` in `alloc` and
            // is freed exactly once, here.
            unsafe { std::alloc::dealloc(self.ptr, layout) }
        }
    }
}

pub struct CpuBackend {
    buffers: Vec<Buffer>,
    pool: ThreadPool,
    opts: kernels::KernelOptions,
    /// Per-command wall time accumulated over replays, when profiling.
    profile: Option<Vec<(std::time::Duration, u64)>>,
    /// Bytes of Q4_0 weights repacked at load (`quant::q4x8`) and the time
    /// it took.
    repacked: (usize, std::time::Duration),
    /// Element type of the K and V caches (`set_kv_type`).
    kv: KvType,
}

// SAFETY: the raw pointers in `buffers` point to allocations owned by the
// backend (or to read-only mapped files it keeps alive); they are only
// dereferenced by the backend's own methods, which take `&mut self` for
// every write, so moving the backend to another thread is sound.
unsafe impl Send for CpuBackend {}

impl CpuBackend {
    /// A backend using `threads` threads (0: one per available core).
    pub fn new(threads: usize) -> CpuBackend {
        let n = if threads == 0 {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        } else {
            threads
        };
        CpuBackend {
            buffers: Vec::new(),
            pool: ThreadPool::new(n),
            opts: kernels::KernelOptions::default(),
            profile: None,
            repacked: (0, std::time::Duration::ZERO),
            kv: KvType::F32,
        }
    }

    /// Decode products against Q4_0/Q4_1/Q8_0 weights with 8-bit
    /// activations and integer dot products (see `KernelOptions`). Set it
    /// before loading weights: Q4_0 weights loaded while it is on also get
    /// a copy in the 8-row interleaved layout of `quant::q4x8` (where the
    /// CPU has its SIMD kernel), which the decode products read.
    pub fn set_q8_activations(&mut self, on: bool) {
        self.opts.q8_activations = on;
    }

    /// The element type of the K and V caches of engines made on this
    /// backend from now on (default f32). f16 halves the cache; the AVX2
    /// attention reads it directly (F16C), the portable one widens the
    /// rows it reads into a scratch. The GPU tests use it as the reference
    /// for the CUDA backend's f16 cache.
    pub fn set_kv_type(&mut self, kv: KvType) {
        self.kv = kv;
    }

    /// Starts timing every command of every replay (a clock read per
    /// command: leave it off for speed measurements).
    pub fn enable_profiling(&mut self) {
        self.profile = Some(Vec::new());
    }

    pub fn n_threads(&self) -> usize {
        self.pool.n_threads()
    }

    fn buffer(&self, id: BufferId) -> Result<&Buffer, BackendError> {
        self.buffers
            .get(id as usize)
            .ok_or(BackendError::UnknownBuffer(id))
    }

    fn range_check(&self, id: BufferId, offset: u64, len: u64) -> Result<&Buffer, BackendError> {
        let b = self.buffer(id)?;
        let end = offset.checked_add(len);
        match end {
            Some(e) if e <= b.len as u64 => Ok(b),
            _ => Err(BackendError::OutOfBounds {
                buffer: id,
                len: b.len as u64,
                start: offset,
                end: end.unwrap_or(u64::MAX),
            }),
        }
    }
}

impl BufferRead for CpuBackend {
    fn read(&self, buf: BufferId, offset: u64, out: &mut [u8]) -> Result<(), BackendError> {
        let b = self.range_check(buf, offset, out.len() as u64)?;
        // SAFETY: the range was checked against the buffer's length, and no
        // kernel runs while `&self` is borrowed here.
        unsafe {
            std::ptr::copy_nonoverlapping(b.ptr.add(offset as usize), out.as_mut_ptr(), out.len())
        };
        Ok(())
    }
}

impl Backend for CpuBackend {
    fn exact_rows(&self, _table: &DispatchTable) -> u32 {
        kernels::EXACT_ROWS as u32
    }

    fn describe(&self) -> String {
        let mut s = format!(
            "cpu: {} threads, {}, {} activations, {} KV cache",
            self.pool.n_threads(),
            quant::simd_level(),
            if self.opts.q8_activations {
                "q8"
            } else {
                "f32"
            },
            self.kv.name()
        );
        if self.repacked.0 > 0 {
            s += &format!(
                " (Q4_0 repacked x8 at load: {:.1} MiB in {:.0} ms)",
                self.repacked.0 as f64 / (1 << 20) as f64,
                self.repacked.1.as_secs_f64() * 1e3
            );
        }
        s
    }

    fn weight(&mut self, file: &GgufFile, tensor: &TensorInfo) -> Result<BufferId, BackendError> {
        let data = file.tensor_data(tensor);
        let id = self.buffers.len() as BufferId;
        // Q4_0 matrices get a row-interleaved copy for the 8-bit-activation
        // GEMV (the plain mapping stays for embeddings and the GEMM).
        let k = tensor.dims.first().copied().unwrap_or(0) as usize;
        let n_rows = (tensor.n_elements() as usize).checked_div(k).unwrap_or(0);
        let x8 = (self.opts.q8_activations
            && tensor.dtype == DType::Q4_0
            && quant::q4x8::enabled()
            && k.is_multiple_of(32)
            && n_rows >= 8
            && data.len() == n_rows * quant::row_bytes(DType::Q4_0, k))
        .then(|| {
            let t0 = std::time::Instant::now();
            let p = quant::q4x8::repack(data, k, n_rows);
            self.repacked.0 += p.len();
            self.repacked.1 += t0.elapsed();
            (p, k)
        });
        self.buffers.push(Buffer {
            ptr: data.as_ptr() as *mut u8,
            len: data.len(),
            storage: Storage::Mapped(file.mmap().clone()),
            what: tensor.name.clone(),
            x8,
        });
        Ok(id)
    }

    fn alloc(&mut self, bytes: u64, what: &str) -> Result<BufferId, BackendError> {
        let oom = || BackendError::OutOfMemory {
            bytes,
            what: what.to_string(),
        };
        let size = usize::try_from(bytes).map_err(|_| oom())?.max(ALIGN);
        let layout = Layout::from_size_align(size, ALIGN).map_err(|_| oom())?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(oom());
        }
        let id = self.buffers.len() as BufferId;
        self.buffers.push(Buffer {
            ptr,
            len: bytes as usize,
            storage: Storage::Owned(layout),
            what: what.to_string(),
            x8: None,
        });
        Ok(id)
    }

    fn write(&mut self, buf: BufferId, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        let b = self.range_check(buf, offset, data.len() as u64)?;
        if matches!(b.storage, Storage::Mapped(_)) {
            return Err(BackendError::Device(format!(
                "buffer '{}' is a read-only weight",
                b.what
            )));
        }
        // SAFETY: range checked; `&mut self` excludes concurrent kernels.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), b.ptr.add(offset as usize), data.len())
        };
        Ok(())
    }

    fn kv_type(&self) -> KvType {
        self.kv
    }

    fn validate(&self, table: &DispatchTable) -> Result<(), BackendError> {
        akunu_core::backend::check_extents(table, &|id| {
            self.buffer(id).map(|b| (b.len as u64, b.what.clone()))
        })
    }

    fn command_times(&self) -> Option<Vec<(std::time::Duration, u64)>> {
        self.profile.clone()
    }

    fn set_profiling(&mut self, on: bool) -> bool {
        self.profile = on.then(Vec::new);
        true
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
        let mut ptrs = [std::ptr::null_mut::<u8>(); akunu_core::table::MAX_BUFFERS];
        for s in 0..steps {
            let step = StepInfo {
                pos: first.pos + s * first.rows,
                tok: first.tok + s * first.rows,
                rows: first.rows,
            };
            for (i, cmd) in table.commands.iter().enumerate() {
                let mut c = *cmd;
                c.apply_patch(&step);
                // Pointers and the bytes available from each, in one lookup
                // per binding.
                let mut lens = [0usize; akunu_core::table::MAX_BUFFERS];
                let mut x8 = [None; akunu_core::table::MAX_BUFFERS];
                for (slot, b) in c.bindings().iter().enumerate() {
                    let buf = self.buffer(b.buffer)?;
                    // Patched offsets (conveyor slots) are the only ones not
                    // covered by `validate`: check them per step.
                    if b.offset as usize > buf.len {
                        return Err(BackendError::OutOfBounds {
                            buffer: b.buffer,
                            len: buf.len as u64,
                            start: b.offset,
                            end: b.offset,
                        });
                    }
                    // SAFETY: offset <= len, checked just above.
                    ptrs[slot] = unsafe { buf.ptr.add(b.offset as usize) };
                    lens[slot] = buf.len - b.offset as usize;
                    // The repacked copy serves bindings of the whole tensor.
                    if let (Some((p, k)), 0) = (&buf.x8, b.offset) {
                        x8[slot] = Some(kernels::X8 {
                            ptr: p.as_ptr(),
                            k: *k,
                        });
                    }
                }
                let t0 = self.profile.is_some().then(std::time::Instant::now);
                kernels::run(&self.pool, self.opts, &c, &ptrs, &lens, &x8, &step).map_err(
                    |why| BackendError::InvalidCommand {
                        index: i,
                        label: table.label(i).to_string(),
                        why,
                    },
                )?;
                if let (Some(t0), Some(prof)) = (t0, self.profile.as_mut()) {
                    if prof.len() < table.commands.len() {
                        prof.resize(table.commands.len(), Default::default());
                    }
                    prof[i].0 += t0.elapsed();
                    prof[i].1 += 1;
                }
            }
            if let Some(h) = hook.as_mut()
                && !h(s, &*self)
            {
                return Ok(s + 1);
            }
        }
        Ok(steps)
    }
}
