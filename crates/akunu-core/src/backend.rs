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
}
