//! Chain decode on the GPU: chunk graphs, the device control block, token
//! streaming through mapped memory, and early exit.
//!
//! A chunk of N steps is captured once into a CUDA graph (N copies of the
//! table plus one `k_chain_advance`) and relaunched for every chunk of that
//! size. Kernels inside read the chunk's first position and conveyor slot
//! from the control block (`Ctl`), which the graph's last kernel advances by
//! N: relaunching needs no host work beyond `cuGraphLaunch`. The host keeps
//! two chunks in flight and, while they run, polls the mapped token array
//! that the argmax kernel fills as each token is produced, handing tokens to
//! the sink one by one. A stop token sets `done`, and every later kernel of
//! the chain returns at entry.

use crate::device::{Dptr, Event, HostMapped, alloc, check};
use crate::launch;
use crate::{CudaBackend, table_hash};
use akunu_core::backend::{BackendError, ChainReport, ChainRequest, TokenSink};
use akunu_core::table::{DispatchTable, StepInfo};
use bytemuck::{Pod, Zeroable};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A driver handle moved into the launcher thread.
struct SendPtr<T>(T);
// SAFETY: CUDA stream and graph-exec handles may be used from any thread
// with the context bound; the launcher thread binds it, and the owner joins
// the thread before using the handles again.
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

impl<T: Copy> SendPtr<T> {
    // A method (not field access), so closures capture the wrapper.
    fn get(&self) -> T {
        self.0
    }
}

/// Mirror of `Ctl` in common.cuh.
#[repr(C)]
#[derive(Copy, Clone, Pod, Zeroable)]
struct Ctl {
    pos0: u32,
    tok0: u32,
    rows: u32,
    done: u32,
    n_stop: u32,
    stop: [u32; MAX_STOP],
    computed: u32,
    limit: u32,
    _pad: u32,
    host_tokens: u64,
    host_stamps: u64,
}

const MAX_STOP: usize = 16;
/// Byte offset of `Ctl.done`. The decode gemv also relies on it: it copies
/// Ctl's first 16 bytes and reads `done` as their fourth word (common.cuh
/// `chain_stop_seen`).
const DONE_OFFSET: u64 = 12;
const _: () = assert!(std::mem::offset_of!(Ctl, done) as u64 == DONE_OFFSET);
const COMPUTED_OFFSET: u64 = 20 + 4 * MAX_STOP as u64;
/// Marks a mapped token slot the device has not written yet.
const EMPTY: u32 = u32::MAX;
/// Most distinct graphs kept (table variants x chunk sizes).
const MAX_GRAPHS: usize = 32;
/// Marks a graph key's size as a verification step's row count.
const VERIFY: u32 = 1 << 31;

pub struct ChainState {
    ctl: Dptr,
    tokens: Option<HostMapped>,
    stamps: Option<HostMapped>,
    graphs: HashMap<(u64, u32), sys::CUgraphExec>,
    /// Host clock origin and the GPU timer's offset from it (ns), measured
    /// once, to turn device timestamps into host time.
    clock: Option<(Instant, i64, u64)>,
}

impl ChainState {
    pub fn new() -> Result<ChainState, BackendError> {
        let ctl = alloc(std::mem::size_of::<Ctl>() as u64, "chain control block")?;
        Ok(ChainState {
            ctl,
            tokens: None,
            stamps: None,
            graphs: HashMap::new(),
            clock: None,
        })
    }

    pub fn clear_graphs(&mut self) {
        for (_, g) in self.graphs.drain() {
            // SAFETY: created by instantiate below; no launch of it is in
            // flight (callers synchronise first).
            unsafe {
                sys::cuGraphExecDestroy(g);
            }
        }
    }

    fn ensure_mapped(&mut self, slots: usize) -> Result<(), BackendError> {
        if self.tokens.as_ref().is_none_or(|t| t.bytes < slots * 4) {
            self.tokens = Some(HostMapped::new(slots * 4)?);
            self.stamps = Some(HostMapped::new(slots * 8)?);
            // Graphs captured earlier point at the old arrays only through
            // the control block, which is rewritten per chain: they stay valid.
        }
        Ok(())
    }
}

impl Drop for ChainState {
    fn drop(&mut self) {
        self.clear_graphs();
        // SAFETY: allocated in `new`, freed once; the owner synchronised.
        unsafe {
            sys::cuMemFree_v2(self.ctl);
        }
    }
}

fn graph_for(
    be: &mut CudaBackend,
    table: &DispatchTable,
    key: (u64, u32),
) -> Result<sys::CUgraphExec, BackendError> {
    if let Some(&g) = be.chain.graphs.get(&key) {
        return Ok(g);
    }
    if be.chain.graphs.len() >= MAX_GRAPHS {
        be.sync()?;
        be.chain.clear_graphs();
    }
    // A chunk of n one-row steps ending in k_chain_advance, or one
    // verification step of `rows` rows (VERIFY set) and no advance.
    let verify = key.1 & VERIFY != 0;
    let (n, rows) = if verify {
        (1, key.1 & !VERIFY)
    } else {
        (key.1, 1)
    };
    let ctl = be.chain.ctl;
    let stream = be.stream;
    let mut launches = Vec::with_capacity(table.len() * n as usize + 1);
    let step = StepInfo {
        pos: 0,
        tok: 0,
        rows,
    };
    let decode = rows <= launch::decode_rows(be, table);
    for s in 0..n {
        for (i, cmd) in table.commands.iter().enumerate() {
            let plan = launch::plan(be, table, i, cmd, &step, Some((ctl, s)), decode)
                .map_err(|why| crate::invalid(table, i, why))?;
            launches.extend(plan);
        }
    }
    // SAFETY (whole block): capture records the launches below into a graph
    // instead of running them; every handle is live. On a failed launch the
    // capture is ended and its graph destroyed before returning.
    unsafe {
        check(
            sys::cuStreamBeginCapture_v2(
                stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            ),
            "starting graph capture",
        )?;
        let mut failed = None;
        for l in &launches {
            if let Err(e) = l.fire(stream) {
                failed = Some(e);
                break;
            }
        }
        if failed.is_none() && !verify {
            let mut ctl_arg = ctl;
            let mut steps = n;
            let mut args = [
                &mut ctl_arg as *mut u64 as *mut std::ffi::c_void,
                &mut steps as *mut u32 as *mut std::ffi::c_void,
            ];
            if let Err(e) = sys::cuLaunchKernel(
                be.k.chain_advance,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                stream,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()
            {
                failed = Some(e.to_string());
            }
        }
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        let end = sys::cuStreamEndCapture(stream, &mut graph);
        if let Some(e) = failed {
            if !graph.is_null() {
                sys::cuGraphDestroy(graph);
            }
            return Err(BackendError::Device(format!(
                "capturing a chunk graph: {e}"
            )));
        }
        check(end, "ending graph capture")?;
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        let r = sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0);
        sys::cuGraphDestroy(graph);
        check(
            r,
            &format!("instantiating a graph of {} launches", launches.len() + 1),
        )?;
        check(sys::cuGraphUpload(exec, stream), "uploading a graph")?;
        be.chain.graphs.insert(key, exec);
        Ok(exec)
    }
}

/// Checks that `n` KV positions from `pos` fit every cache the table writes
/// (kernels inside graphs do not check them per launch).
fn check_kv_room(table: &DispatchTable, pos: u32, n: u32, what: &str) -> Result<(), BackendError> {
    for (i, c) in table.commands.iter().enumerate() {
        if c.kernel == akunu_core::ops::KernelId::RopeKvWrite {
            let p: akunu_core::ops::RopeParams = c.params();
            if pos as u64 + n as u64 > p.capacity as u64 {
                return Err(crate::invalid(
                    table,
                    i,
                    format!(
                        "{what} ({n}) from position {pos} exceeds the cache ({} positions)",
                        p.capacity
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// One speculative verification step (`first.rows` rows: the current token
/// and the draft) as a captured graph, one per table and row count, reused
/// for every pass: the kernels read the position from the control block,
/// which is rewritten before each launch. Rows run the decode kernels (see
/// `launch::decode_rows`), so each row's token equals what a one-row step
/// would produce. The launch is asynchronous; reading the tokens back
/// synchronises.
pub fn verify_step(
    be: &mut CudaBackend,
    table: &DispatchTable,
    first: StepInfo,
) -> Result<(), BackendError> {
    if first.rows == 0 || first.rows > launch::decode_rows(be, table) {
        // Not a step the graph path takes (the engine caps drafts at
        // `exact_rows`): run it the ordinary way.
        return be.run_step(table, &first);
    }
    // The extents a graph cannot check per launch: the KV positions the
    // step writes, and the conveyor slots it reads and writes.
    check_kv_room(
        table,
        first.pos,
        first.rows,
        "a verification step of that many rows",
    )?;
    for c in &table.commands {
        let need = match (c.kernel, c.patch) {
            (akunu_core::ops::KernelId::Embedding, akunu_core::table::PatchType::TokenOffset) => {
                Some((0, first.tok as u64 + first.rows as u64))
            }
            (akunu_core::ops::KernelId::Argmax, akunu_core::table::PatchType::ArgmaxOutput) => {
                Some((1, first.tok as u64 + first.rows as u64 + 1))
            }
            _ => None,
        };
        if let Some((slot, slots)) = need {
            let b = c.bindings()[slot];
            let (_, len) = be.dptr(b.buffer).map_err(BackendError::Device)?;
            if slots * 4 > len {
                return Err(BackendError::OutOfBounds {
                    buffer: b.buffer,
                    len,
                    start: first.tok as u64 * 4,
                    end: slots * 4,
                });
            }
            if slot == 1 {
                // k_argmax also publishes each token to the mapped array.
                be.chain.ensure_mapped((len / 4) as usize)?;
            }
        }
    }
    let exec = graph_for(be, table, (table_hash(table), VERIFY | first.rows))?;
    let mut ctl = Ctl::zeroed();
    ctl.pos0 = first.pos;
    ctl.tok0 = first.tok;
    ctl.rows = first.rows;
    ctl.limit = u32::MAX;
    if let (Some(t), Some(s)) = (be.chain.tokens.as_ref(), be.chain.stamps.as_ref()) {
        ctl.host_tokens = t.dev;
        ctl.host_stamps = s.dev;
    }
    // SAFETY: the copy reads `ctl` (a live local) before returning (a
    // pageable source is staged synchronously), and is ordered on the
    // stream before the graph that reads the control block; the graph is
    // live and instantiated for this stream's context.
    unsafe {
        check(
            sys::cuMemcpyHtoDAsync_v2(
                be.chain.ctl,
                &ctl as *const Ctl as *const _,
                std::mem::size_of::<Ctl>(),
                be.stream,
            ),
            "writing the verification control block",
        )?;
        check(
            sys::cuGraphLaunch(exec, be.stream),
            "launching a verification graph",
        )?;
    }
    Ok(())
}

/// Estimates the GPU timer's offset from the host clock: the probe whose
/// round trip is shortest bounds the error by half of it.
fn calibrate(be: &CudaBackend, origin: Instant) -> Result<(i64, u64), BackendError> {
    let probe = HostMapped::new(8)?;
    let mut best = (0i64, u64::MAX);
    for _ in 0..20 {
        let t0 = origin.elapsed().as_nanos() as i64;
        let mut out = probe.dev;
        let mut args = [&mut out as *mut u64 as *mut std::ffi::c_void];
        // SAFETY: k_clock_probe(u64*) writes one value into mapped memory
        // that outlives the synchronised launch.
        unsafe {
            check(
                sys::cuLaunchKernel(
                    be.k.clock_probe,
                    1,
                    1,
                    1,
                    1,
                    1,
                    1,
                    0,
                    be.stream,
                    args.as_mut_ptr(),
                    std::ptr::null_mut(),
                ),
                "launching the clock probe",
            )?;
        }
        be.sync()?;
        let t1 = origin.elapsed().as_nanos() as i64;
        // SAFETY: the launch completed; the host owns the memory again.
        let gpu = unsafe { std::ptr::read_volatile(probe.host as *const u64) } as i64;
        let rtt = (t1 - t0) as u64;
        if rtt < best.1 {
            best = (gpu - (t0 + t1) / 2, rtt);
        }
    }
    Ok(best)
}

/// A chain: chunk graphs of the table, or with `persist` the
/// persistent kernel (`persist.rs`), one launch for the whole chain. Both
/// publish tokens through the control block and the mapped slots, which
/// this function polls and hands to the sink.
pub fn decode_chain(
    be: &mut CudaBackend,
    table: &DispatchTable,
    first: StepInfo,
    req: &ChainRequest<'_>,
    sink: TokenSink<'_>,
    persist: Option<crate::persist::Plan>,
) -> Result<ChainReport, BackendError> {
    if req.steps == 0 {
        return Ok(ChainReport::default());
    }
    let (_, conveyor_len) = be.dptr(req.conveyor).map_err(BackendError::Device)?;
    let slots = conveyor_len / 4;
    let last_slot = first.tok as u64 + req.steps as u64;
    if last_slot >= slots {
        return Err(BackendError::OutOfBounds {
            buffer: req.conveyor,
            len: conveyor_len,
            start: first.tok as u64 * 4,
            end: (last_slot + 1) * 4,
        });
    }
    if req.stop_ids.len() > MAX_STOP {
        return Err(BackendError::Device(format!(
            "{} stop tokens (the CUDA chain supports {MAX_STOP})",
            req.stop_ids.len()
        )));
    }
    check_kv_room(table, first.pos, req.steps, "a chain of that many steps")?;
    let chunk = if persist.is_some() {
        req.steps
    } else {
        req.chunk.clamp(1, req.steps)
    };
    be.chain.ensure_mapped(slots as usize)?;
    be.sync()?;
    if be.chain.clock.is_none() {
        let origin = Instant::now();
        let (off, rtt) = calibrate(be, origin)?;
        be.chain.clock = Some((origin, off, rtt));
    }
    let (origin, offset, _) = be.chain.clock.expect("calibrated");
    let tokens = be.chain.tokens.as_ref().expect("mapped").host as *mut u32;
    let stamps = be.chain.stamps.as_ref().expect("mapped").host as *const u64;
    let mut ctl = Ctl::zeroed();
    ctl.pos0 = first.pos;
    ctl.tok0 = first.tok;
    ctl.rows = 1;
    ctl.n_stop = req.stop_ids.len() as u32;
    ctl.stop[..req.stop_ids.len()].copy_from_slice(req.stop_ids);
    ctl.limit = req.steps;
    ctl.host_tokens = be.chain.tokens.as_ref().expect("mapped").dev;
    ctl.host_stamps = be.chain.stamps.as_ref().expect("mapped").dev;
    // SAFETY: the stream is idle (synchronised above), so no kernel reads
    // the control block or the mapped slots while they are reset; the slot
    // range was checked against the mapped array's size (= conveyor slots).
    unsafe {
        for t in first.tok as usize + 1..=last_slot as usize {
            std::ptr::write_volatile(tokens.add(t), EMPTY);
        }
        check(
            sys::cuMemcpyHtoD_v2(
                be.chain.ctl,
                &ctl as *const Ctl as *const _,
                std::mem::size_of::<Ctl>(),
            ),
            "writing the chain control block",
        )?;
    }
    let hash = table_hash(table);
    // The chain's submissions: full chunks, then the remainder as a sum of
    // powers of two, so that any chain length reuses at most
    // log2(chunk) + 1 captured graphs per table (a capture costs a few
    // milliseconds per step; a launch costs microseconds). The persistent
    // kernel is one submission of every step.
    let mut sizes: Vec<u32> = vec![chunk; (req.steps / chunk) as usize];
    let rem = req.steps % chunk;
    for bit in (0..32).rev() {
        if rem & (1 << bit) != 0 {
            sizes.push(1 << bit);
        }
    }
    let mut execs: Vec<SendPtr<sys::CUgraphExec>> = Vec::with_capacity(sizes.len());
    if persist.is_none() {
        // Capture every size up front, so that the launcher thread below
        // does nothing but launch.
        let mut distinct = sizes.clone();
        distinct.dedup();
        let missing = distinct
            .iter()
            .filter(|&&n| !be.chain.graphs.contains_key(&(hash, n)))
            .count();
        if be.chain.graphs.len() + missing > MAX_GRAPHS {
            // Make room first: `graph_for` must not evict graphs this chain
            // holds.
            be.chain.clear_graphs();
        }
        for &n in &sizes {
            execs.push(SendPtr(graph_for(be, table, (hash, n))?));
        }
    }
    let conveyor_ptr = be.dptr(req.conveyor).map_err(BackendError::Device)?.0;
    // AKUNU_CUDA_TRACE=1: GPU time of every chunk, from events around each
    // graph launch, printed when the chain ends.
    let trace = std::env::var_os("AKUNU_CUDA_TRACE").is_some();
    let t_chain = Instant::now();

    // A launch of a large graph can block the host until earlier work has
    // drained, so launches happen on their own thread while this one polls
    // the mapped token slots and feeds the sink: a blocked launch never
    // delays a token. The launcher keeps at most two chunks ahead of the
    // tokens consumed.
    let consumed_at = AtomicU32::new(0);
    let launched_at = AtomicU32::new(0);
    let stop = AtomicBool::new(false);
    let ctx = be.ctx.clone();
    let stream = SendPtr(be.stream);
    let steps = req.steps;
    let mut consumed = 0u32;
    let mut delivery = Vec::with_capacity(req.steps as usize);
    let mut ended_by_sink = false;
    // A short chain (speculative decode's plain runs between drafts: at
    // most two small graphs) is launched inline: a thread would cost more
    // than it hides.
    let inline = persist.is_some() || (sizes.len() <= 2 && req.steps <= 8);
    let ctl_ptr = be.chain.ctl;
    let (launch_result, marks) = std::thread::scope(|sc| {
        let launch_all = || -> (Result<(), BackendError>, Vec<(Event, u32)>) {
            let mut marks = Vec::new();
            let r = (|| {
                ctx.bind_to_thread()
                    .map_err(|e| BackendError::Device(format!("binding the CUDA context: {e}")))?;
                if trace {
                    let e = Event::new()?;
                    e.record(stream.get())?;
                    marks.push((e, 0));
                }
                let mut launched = 0u32;
                let mut next = 0usize;
                while next < sizes.len() && !stop.load(Ordering::Acquire) {
                    if launched >= consumed_at.load(Ordering::Acquire) + 2 * chunk {
                        std::thread::yield_now();
                        continue;
                    }
                    let n = sizes[next];
                    if let Some(plan) = persist.as_ref() {
                        crate::persist::launch(plan, ctl_ptr, conveyor_ptr, stream.get())?;
                    } else {
                        let exec = execs[next].get();
                        // SAFETY: a live, instantiated graph on our stream;
                        // the owner joins this thread before touching either
                        // again.
                        check(
                            unsafe { sys::cuGraphLaunch(exec, stream.get()) },
                            "launching a chunk graph",
                        )?;
                    }
                    next += 1;
                    launched += n;
                    launched_at.store(launched, Ordering::Release);
                    if trace {
                        let e = Event::new()?;
                        e.record(stream.get())?;
                        marks.push((e, n));
                    }
                }
                Ok(())
            })();
            if r.is_err() {
                // Unblock the consumer: nothing more will be launched.
                stop.store(true, Ordering::Release);
            }
            (r, marks)
        };
        let (launcher, early) = if inline {
            (None, Some(launch_all()))
        } else {
            (Some(sc.spawn(launch_all)), None)
        };
        let poll = (|| -> Result<(), BackendError> {
            while consumed < steps {
                let slot = first.tok as usize + 1 + consumed as usize;
                let mut spins = 0u32;
                let id = loop {
                    // SAFETY: `slot` <= last_slot < mapped slots; the device
                    // writes each slot once (an aligned u32 read is atomic).
                    let v = unsafe { std::ptr::read_volatile(tokens.add(slot)) };
                    if v != EMPTY {
                        break v;
                    }
                    spins += 1;
                    if spins.is_multiple_of(1024) {
                        if stop.load(Ordering::Acquire) {
                            return Ok(()); // the launcher failed; it reports why
                        }
                        // Has the stream finished (or failed) without this
                        // token though its chunk was launched?
                        let launched = launched_at.load(Ordering::Acquire);
                        // SAFETY: a live stream.
                        let q = unsafe { sys::cuStreamQuery(stream.get()) };
                        if q == sys::CUresult::CUDA_SUCCESS && launched > consumed {
                            // SAFETY: as above.
                            let v = unsafe { std::ptr::read_volatile(tokens.add(slot)) };
                            if v != EMPTY {
                                break v;
                            }
                            return Err(BackendError::Device(format!(
                                "the chain stopped producing tokens at step {consumed}"
                            )));
                        } else if q != sys::CUresult::CUDA_SUCCESS
                            && q != sys::CUresult::CUDA_ERROR_NOT_READY
                        {
                            check(q, "running a chunk graph")?;
                        }
                        if spins > 1 << 16 {
                            std::thread::sleep(Duration::from_micros(20));
                        } else {
                            std::thread::yield_now();
                        }
                    }
                };
                let now = origin.elapsed().as_nanos() as i64;
                // SAFETY: the stamp was written (and fenced) before the token.
                let stamp = unsafe { std::ptr::read_volatile(stamps.add(slot)) } as i64;
                delivery.push(((now - (stamp - offset)) as f64 / 1e3) as f32);
                consumed += 1;
                consumed_at.store(consumed, Ordering::Release);
                if !sink(consumed - 1, id) {
                    ended_by_sink = true;
                    break;
                }
            }
            Ok(())
        })();
        stop.store(true, Ordering::Release);
        let (launch_result, marks) = match (launcher, early) {
            (Some(h), _) => h.join().unwrap_or_else(|_| {
                (
                    Err(BackendError::Device("the launcher thread panicked".into())),
                    Vec::new(),
                )
            }),
            (None, early) => early.unwrap_or_else(|| {
                (
                    Err(BackendError::Device("the chain was never launched".into())),
                    Vec::new(),
                )
            }),
        };
        (poll.and(launch_result), marks)
    });
    launch_result?;
    let launched = launched_at.load(Ordering::Acquire);
    let raised = ended_by_sink && launched > consumed;
    if raised {
        // Raise `done` from the side stream so the queued kernels return at
        // entry instead of computing tokens nobody will read.
        // SAFETY: a 4-byte store into our control block; a racing read by a
        // kernel sees either value, and both are valid.
        unsafe {
            if persist.is_some() {
                // The persistent kernel holds every SM, so a memset kernel
                // would wait for it: a copy-engine write instead, which its
                // block 0 reads once a token.
                static ONE: u32 = 1;
                check(
                    sys::cuMemcpyHtoDAsync_v2(
                        be.chain.ctl + DONE_OFFSET,
                        &ONE as *const u32 as *const _,
                        4,
                        be.side,
                    ),
                    "stopping the chain",
                )?;
            } else {
                check(
                    sys::cuMemsetD32Async(be.chain.ctl + DONE_OFFSET, 1, 1, be.side),
                    "stopping the chain",
                )?;
            }
        }
    }
    be.sync()?;
    if raised {
        // A kernel grid already running when the host raised `done` may
        // have had some blocks return at entry and others not: decode
        // attention's per-head tickets can be left part-counted.
        be.clear_attn_tickets()?;
    }
    if trace {
        let mut line = format!(
            "akunu trace: chain of {consumed} steps in {:.2} ms host time; chunk GPU ms:",
            t_chain.elapsed().as_secs_f64() * 1e3
        );
        for w in marks.windows(2) {
            let ms = w[0].0.ms_to(&w[1].0)?;
            line.push_str(&format!(" {}:{ms:.3}", w[1].1));
        }
        eprintln!("{line}");
    }
    let mut computed = 0u32;
    // SAFETY: the stream is idle; 4 bytes inside the control block.
    check(
        unsafe {
            sys::cuMemcpyDtoH_v2(
                &mut computed as *mut u32 as *mut _,
                be.chain.ctl + COMPUTED_OFFSET,
                4,
            )
        },
        "reading the chain counters",
    )?;
    Ok(ChainReport {
        steps: consumed,
        computed_after_end: Some(computed.saturating_sub(consumed)),
        delivery_us: delivery,
    })
}

/// Device-to-device copy bandwidth (bytes read plus written per second):
/// the median of 10 copies of 1 GiB after a warm-up.
pub fn copy_bandwidth(stream: sys::CUstream) -> Result<f64, BackendError> {
    let bytes: u64 = 1 << 30;
    let a = alloc(bytes, "bandwidth probe")?;
    let b = match alloc(bytes, "bandwidth probe") {
        Ok(b) => b,
        Err(e) => {
            // SAFETY: allocated just above, unused.
            unsafe { sys::cuMemFree_v2(a) };
            return Err(e);
        }
    };
    let run = || -> Result<f64, BackendError> {
        // SAFETY: both buffers hold `bytes` bytes; the stream is live.
        unsafe {
            check(
                sys::cuMemsetD32Async(a, 0x3c00_3c00, (bytes / 4) as usize, stream),
                "filling the probe",
            )?;
        }
        let (e0, e1) = (Event::new()?, Event::new()?);
        let mut times = Vec::new();
        for i in 0..13 {
            e0.record(stream)?;
            // SAFETY: as above.
            unsafe {
                check(
                    sys::cuMemcpyDtoDAsync_v2(b, a, bytes as usize, stream),
                    "copying the probe",
                )?;
            }
            e1.record(stream)?;
            // SAFETY: live stream.
            check(unsafe { sys::cuStreamSynchronize(stream) }, "timing a copy")?;
            if i >= 3 {
                times.push(e0.ms_to(&e1)? as f64);
            }
        }
        times.sort_by(f64::total_cmp);
        Ok(2.0 * bytes as f64 / (times[times.len() / 2] / 1e3))
    };
    let r = run();
    // SAFETY: allocated above; the stream was synchronised by `run` (or
    // failed, in which case the driver reports the error on free too).
    unsafe {
        sys::cuStreamSynchronize(stream);
        sys::cuMemFree_v2(a);
        sys::cuMemFree_v2(b);
    }
    r
}
