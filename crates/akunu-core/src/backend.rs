//! The interface every device backend implements: buffers, and replay of a
//! dispatch table.

use crate::gguf::{GgufFile, TensorInfo};
use crate::table::{BufferId, DispatchTable, StepInfo};

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("out of memory allocating {bytes} bytes for {what}")]
    OutOfMemory { bytes: u64, what: String },
    #[error("buffer access out of bounds: buffer {buffer} ({len} bytes), bytes {start}..{end}")]
    OutOfBounds {
        buffer: BufferId,
        len: u64,
        start: u64,
        end: u64,
    },
    #[error("unknown buffer id {0}")]
    UnknownBuffer(BufferId),
    #[error("invalid command {index} ({label}): {why}")]
    InvalidCommand {
        index: usize,
        label: String,
        why: String,
    },
    #[error("device error: {0}")]
    Device(String),
}

/// The check every backend's `validate` starts with: each binding of each
/// command exists and holds what the command reads or writes for steps of
/// up to `table.max_rows` rows (`ops::extents`). `buffer(id)` gives a
/// buffer's length in bytes and its name.
pub fn check_extents(
    table: &DispatchTable,
    buffer: &dyn Fn(BufferId) -> Result<(u64, String), BackendError>,
) -> Result<(), BackendError> {
    for (i, cmd) in table.commands.iter().enumerate() {
        let fail = |why: String| BackendError::InvalidCommand {
            index: i,
            label: table.label(i).to_string(),
            why,
        };
        let lens: Vec<u64> = cmd
            .bindings()
            .iter()
            .map(|b| buffer(b.buffer).map(|(len, _)| len.saturating_sub(b.offset)))
            .collect::<Result<_, _>>()?;
        for (slot, need) in crate::ops::extents(cmd, table.max_rows).map_err(&fail)? {
            if need > lens[slot] {
                return Err(fail(format!(
                    "binding {slot} ('{}') needs {need} bytes, has {}",
                    buffer(cmd.buffers[slot].buffer)?.1,
                    lens[slot]
                )));
            }
        }
    }
    Ok(())
}

/// Read access to device buffers while a replay is paused at a step.
pub trait BufferRead {
    fn read(&self, buf: BufferId, offset: u64, out: &mut [u8]) -> Result<(), BackendError>;

    fn read_u32(&self, buf: BufferId, index: u64) -> Result<u32, BackendError> {
        let mut b = [0u8; 4];
        self.read(buf, index * 4, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    fn read_f32s(&self, buf: BufferId, offset: u64, n: usize) -> Result<Vec<f32>, BackendError> {
        let mut bytes = vec![0u8; n * 4];
        self.read(buf, offset, &mut bytes)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect())
    }
}

/// Called after each replayed step with the step's index; returning false
/// ends the replay after that step.
pub type StepHook<'a> = &'a mut dyn FnMut(u32, &dyn BufferRead) -> bool;

/// A chain of decode steps for [`Backend::decode_chain`].
#[derive(Clone, Debug)]
pub struct ChainRequest<'a> {
    /// The u32 token conveyor the table's embedding reads and its argmax
    /// writes: step `s` reads slot `first.tok + s` and writes slot
    /// `first.tok + s + 1`.
    pub conveyor: BufferId,
    /// Tokens that end the chain (EOS and friends). A backend may stop
    /// computing after producing one; the sink sees it either way.
    pub stop_ids: &'a [u32],
    /// Steps wanted (the conveyor must hold `first.tok + steps + 1` slots).
    pub steps: u32,
    /// Steps per device submission.
    pub chunk: u32,
    /// The chain's tokens must be those the table's own step-by-step
    /// arithmetic gives (speculative decoding: its verification steps run
    /// the table, and a plain run between them must agree bit for bit). A
    /// backend with a faster path that adds in another order keeps the
    /// table's path when this is set.
    pub table_order: bool,
}

/// What a chain did, beyond the tokens the sink saw.
#[derive(Clone, Debug, Default)]
pub struct ChainReport {
    /// Steps whose token reached the sink (the chain's length).
    pub steps: u32,
    /// Tokens the device produced after the chain's end (work wasted on a
    /// stop inside a submission); `None` where the backend cannot tell.
    pub computed_after_end: Option<u32>,
    /// Microseconds from each token's production on the device to its
    /// delivery to the sink, where the backend can measure it.
    pub delivery_us: Vec<f32>,
}

/// Receives `(step, token)` for each step of a chain, in order; returning
/// false ends the chain after that step.
pub type TokenSink<'a> = &'a mut dyn FnMut(u32, u32) -> bool;

pub trait Backend: BufferRead + Send {
    /// One line saying what runs the model ("cpu: 2 threads, avx512").
    fn describe(&self) -> String;

    /// Makes a weight tensor available to kernels. The CPU backend binds
    /// the memory-mapped bytes without copying; device backends upload.
    fn weight(&mut self, file: &GgufFile, tensor: &TensorInfo) -> Result<BufferId, BackendError>;

    /// A zero-filled buffer of `bytes` bytes.
    fn alloc(&mut self, bytes: u64, what: &str) -> Result<BufferId, BackendError>;

    fn write(&mut self, buf: BufferId, offset: u64, data: &[u8]) -> Result<(), BackendError>;

    /// Checks a table against the buffers it binds (every binding exists,
    /// every kernel's reads and writes fit). Called once after building.
    fn validate(&self, table: &DispatchTable) -> Result<(), BackendError>;

    /// Replays `table` for `steps` steps. Step `s` runs at
    /// `pos = first.pos + s * first.rows`, conveyor slot
    /// `tok = first.tok + s * first.rows`, with `first.rows` rows. After each
    /// step `hook` (if any) may read buffers and stop the replay. Returns the
    /// number of steps run.
    /// `(total time, runs)` per command index, when the backend was asked to
    /// profile; `None` otherwise.
    fn command_times(&self) -> Option<Vec<(std::time::Duration, u64)>> {
        None
    }

    fn replay(
        &mut self,
        table: &DispatchTable,
        first: StepInfo,
        steps: u32,
        hook: Option<StepHook<'_>>,
    ) -> Result<u32, BackendError>;

    /// Chain decode: up to `req.steps` one-row steps of `table` starting at
    /// `first`, each step's token (conveyor slot `tok + 1`) fed to the next
    /// step on the device and handed to `sink` as soon as it is known.
    ///
    /// The default runs `replay` in chunks of `req.chunk` with a hook that
    /// reads each token back; device backends override it to keep several
    /// submissions in flight and stream tokens while they run.
    fn decode_chain(
        &mut self,
        table: &DispatchTable,
        first: StepInfo,
        req: &ChainRequest<'_>,
        sink: TokenSink<'_>,
    ) -> Result<ChainReport, BackendError> {
        let mut done = 0u32;
        let mut going = true;
        while going && done < req.steps {
            let n = req.chunk.max(1).min(req.steps - done);
            let step = StepInfo {
                pos: first.pos + done,
                tok: first.tok + done,
                rows: 1,
            };
            let base = done;
            let mut hook = |s: u32, bufs: &dyn BufferRead| -> bool {
                let id = match bufs.read_u32(req.conveyor, (step.tok + s + 1) as u64) {
                    Ok(id) => id,
                    Err(_) => {
                        going = false;
                        return false;
                    }
                };
                going = sink(base + s, id);
                going
            };
            done += self.replay(table, step, n, Some(&mut hook))?;
        }
        Ok(ChainReport {
            steps: done,
            computed_after_end: Some(0),
            delivery_us: Vec::new(),
        })
    }

    /// One speculative verification step: a step of `first.rows` rows of
    /// `table` (the current token and the draft), every row's token written
    /// to its conveyor slot. Device backends override it to run the step as
    /// one captured submission.
    fn verify_step(&mut self, table: &DispatchTable, first: StepInfo) -> Result<(), BackendError> {
        self.replay(table, first, 1, None).map(|_| ())
    }

    /// Most rows of a step of `table` whose every row is computed bit for
    /// bit as a one-row step at its position would be (the limit of lossless
    /// speculative verification on this backend).
    fn exact_rows(&self, _table: &DispatchTable) -> u32 {
        u32::MAX
    }

    /// Whether speculative decode starts with one-token drafts and doubles
    /// them on full accepts (where each verified row costs a good part of a
    /// one-row step, as on the CPU), rather than with the full draft length
    /// (where a pass costs about one step whatever its rows, as on a GPU).
    fn slow_start_drafts(&self) -> bool {
        true
    }

    /// Longest run of plain steps speculative decode makes while the n-gram
    /// predictor has no draft, before it tries again (the run doubles from
    /// 1 up to this while drafts stay absent). 1 where a submission costs no
    /// more than its steps (the CPU); more on a device, where each
    /// submission carries a host round trip.
    fn idle_run_max(&self) -> u32 {
        1
    }

    /// Steps per chain submission suited to this device (the chapter's
    /// `ChipConfig`): what `--chunk` defaults to.
    fn preferred_chunk(&self) -> u32 {
        16
    }

    /// Element type of the K and V caches this backend keeps (chosen when
    /// the backend is made; the engine sizes the caches by it and names it
    /// in every RoPE and attention command).
    fn kv_type(&self) -> crate::ops::KvType {
        crate::ops::KvType::F32
    }

    /// Turns per-command timing on for later replays (see
    /// [`Backend::command_times`]). Returns false if the backend cannot.
    fn set_profiling(&mut self, _on: bool) -> bool {
        false
    }

    /// Decode chains run so far as one kernel for the whole chain instead
    /// of the table's commands (the CUDA backend's persistent decode).
    fn single_kernel_chains(&self) -> u64 {
        0
    }

    /// Kernel launches one step of `table` makes (some commands take more
    /// than one kernel on some devices).
    fn launches_per_step(&self, table: &DispatchTable) -> usize {
        table.len()
    }

    /// Device memory bandwidth in bytes per second, measured now (a large
    /// device-to-device copy, bytes read plus written), where the backend
    /// can measure it.
    fn measure_bandwidth(&mut self) -> Option<f64> {
        None
    }
}
