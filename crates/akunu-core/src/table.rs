//! The dispatch table: one forward pass compiled into a flat array of
//! plain-data commands, replayed for every token with a few fields patched.
//!
//! The hot array (`DispatchTable::commands`) holds only `Copy` data: a kernel
//! id, up to eight buffer bindings, up to 64 bytes of inline parameters, the
//! logical work size and the patch description. Labels live in a parallel,
//! cold vector that only `inspect` and profiling read.

use crate::ops::KernelId;
use bytemuck::Pod;

/// Opaque handle of a buffer owned by a backend.
pub type BufferId = u32;

/// Most buffer bindings one command may have.
pub const MAX_BUFFERS: usize = 8;
/// Most bytes of inline parameters one command may have.
pub const MAX_PARAM_BYTES: usize = 64;

/// One buffer binding: a backend buffer and a byte offset into it.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Binding {
    pub buffer: BufferId,
    pub offset: u64,
}

/// What a command needs rewritten before each replayed step.
///
/// `pos` is the position of the step's first row, `kv_len = pos + rows`
/// (for decode, `rows == 1`, so `kv_len = pos + 1` as in the chapter), and
/// `tok` is the step's index inside the chain.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum PatchType {
    /// Nothing changes between steps.
    None = 0,
    /// Binding 0 is the token-id conveyor; its offset becomes `tok * 4`.
    TokenOffset = 1,
    /// The u32 at `patch_offset_1` in the params becomes `pos`.
    Position = 2,
    /// The u32 at `patch_offset_1` becomes `kv_len`.
    KvSeqLen = 3,
    /// `pos` at `patch_offset_1` and `kv_len` at `patch_offset_2`.
    PosAndKv = 4,
    /// Binding 1 is the token-id conveyor; its offset becomes
    /// `(tok + rows) * 4`, the slot the next step reads.
    ArgmaxOutput = 5,
}

impl PatchType {
    pub const ALL: [PatchType; 6] = [
        PatchType::None,
        PatchType::TokenOffset,
        PatchType::Position,
        PatchType::KvSeqLen,
        PatchType::PosAndKv,
        PatchType::ArgmaxOutput,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PatchType::None => "-",
            PatchType::TokenOffset => "TOKEN_OFFSET",
            PatchType::Position => "POSITION",
            PatchType::KvSeqLen => "KV_SEQ_LEN",
            PatchType::PosAndKv => "POS_AND_KV",
            PatchType::ArgmaxOutput => "ARGMAX_OUTPUT",
        }
    }
}

/// How a command's work scales with the rows (tokens) of one step.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum RowMode {
    /// The command processes every row of the step (prefill: all prompt
    /// tokens of the chunk). The verification table of speculative decode
    /// also runs its logits, argmax and sampling commands on all rows, so
    /// that every drafted position gets the model's choice (see
    /// `KernelId::Argmax` and `KernelId::GumbelSample` for where each row's
    /// result goes).
    AllRows = 0,
    /// The command reads only the step's last row (logits, argmax): prefill
    /// needs the next-token distribution of the last prompt token only.
    LastRow = 1,
}

/// One command of the forward pass. Plain data: no pointers, no heap.
#[derive(Copy, Clone, Debug)]
pub struct DispatchCmd {
    pub kernel: KernelId,
    pub patch: PatchType,
    pub rows: RowMode,
    pub n_buffers: u8,
    pub param_size: u8,
    pub patch_offset_1: u8,
    pub patch_offset_2: u8,
    pub buffers: [Binding; MAX_BUFFERS],
    pub params: [u8; MAX_PARAM_BYTES],
    /// Logical work items per row (output rows of a projection, heads of an
    /// attention, 1 for a reduction). Backends map it onto threads or blocks.
    pub grid: u32,
}

impl DispatchCmd {
    /// The parameter struct of this command, read back (unaligned-safe).
    pub fn params<T: Pod>(&self) -> T {
        bytemuck::pod_read_unaligned(&self.params[..std::mem::size_of::<T>()])
    }

    pub fn bindings(&self) -> &[Binding] {
        &self.buffers[..self.n_buffers as usize]
    }

    /// Writes the per-step patch into `params` and `buffers` in place. The
    /// CPU replay calls this on a stack copy of the command; other backends
    /// may resolve the same values differently but must agree with it.
    #[inline]
    pub fn apply_patch(&mut self, step: &StepInfo) {
        let put = |p: &mut [u8; MAX_PARAM_BYTES], off: u8, v: u32| {
            let o = off as usize;
            p[o..o + 4].copy_from_slice(&v.to_le_bytes());
        };
        match self.patch {
            PatchType::None => {}
            PatchType::TokenOffset => self.buffers[0].offset = step.tok as u64 * 4,
            PatchType::Position => put(&mut self.params, self.patch_offset_1, step.pos),
            PatchType::KvSeqLen => put(&mut self.params, self.patch_offset_1, step.kv_len()),
            PatchType::PosAndKv => {
                put(&mut self.params, self.patch_offset_1, step.pos);
                put(&mut self.params, self.patch_offset_2, step.kv_len());
            }
            PatchType::ArgmaxOutput => self.buffers[1].offset = (step.tok + step.rows) as u64 * 4,
        }
    }
}

/// What changes from one replayed step to the next.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct StepInfo {
    /// Position (in the sequence) of the step's first row.
    pub pos: u32,
    /// Index of the step's first token in the token-id conveyor.
    pub tok: u32,
    /// Rows (tokens) processed by this step: 1 in decode, the chunk in prefill.
    pub rows: u32,
}

impl StepInfo {
    /// Number of valid KV entries once this step has written its own.
    pub fn kv_len(&self) -> u32 {
        self.pos + self.rows
    }
}

/// The compiled forward pass of one model.
#[derive(Clone, Debug, Default)]
pub struct DispatchTable {
    /// Hot: iterated for every token.
    pub commands: Vec<DispatchCmd>,
    /// Cold: `labels[i]` names `commands[i]`, for inspect and profiling.
    pub labels: Vec<String>,
    /// Most rows one step may have (the rows the scratch buffers hold).
    pub max_rows: u32,
}

impl DispatchTable {
    pub fn len(&self) -> usize {
        self.commands.len()
    }

    pub fn is_empty(&self) -> bool {
        self.commands.is_empty()
    }

    pub fn label(&self, i: usize) -> &str {
        self.labels.get(i).map(|s| s.as_str()).unwrap_or("")
    }

    /// Commands grouped by kernel, in first-use order, with their counts.
    pub fn kernel_histogram(&self) -> Vec<(KernelId, usize)> {
        let mut out: Vec<(KernelId, usize)> = Vec::new();
        for c in &self.commands {
            match out.iter_mut().find(|(k, _)| *k == c.kernel) {
                Some((_, n)) => *n += 1,
                None => out.push((c.kernel, 1)),
            }
        }
        out
    }
}

/// Fluent helper that assembles one command and appends it to a table.
pub struct CmdBuilder<'t> {
    table: &'t mut DispatchTable,
    cmd: DispatchCmd,
    label: String,
}

impl<'t> CmdBuilder<'t> {
    pub fn new(table: &'t mut DispatchTable, kernel: KernelId, grid: u32) -> Self {
        CmdBuilder {
            table,
            cmd: DispatchCmd {
                kernel,
                patch: PatchType::None,
                rows: RowMode::AllRows,
                n_buffers: 0,
                param_size: 0,
                patch_offset_1: 0,
                patch_offset_2: 0,
                buffers: [Binding::default(); MAX_BUFFERS],
                params: [0; MAX_PARAM_BYTES],
                grid,
            },
            label: String::new(),
        }
    }

    /// Binds `buffer` at `offset` bytes as the next binding slot.
    pub fn buf(mut self, buffer: BufferId, offset: u64) -> Self {
        let i = self.cmd.n_buffers as usize;
        assert!(
            i < MAX_BUFFERS,
            "a command binds at most {MAX_BUFFERS} buffers"
        );
        self.cmd.buffers[i] = Binding { buffer, offset };
        self.cmd.n_buffers += 1;
        self
    }

    pub fn params<T: Pod>(mut self, p: &T) -> Self {
        let bytes = bytemuck::bytes_of(p);
        assert!(
            bytes.len() <= MAX_PARAM_BYTES,
            "params exceed {MAX_PARAM_BYTES} bytes"
        );
        self.cmd.params[..bytes.len()].copy_from_slice(bytes);
        self.cmd.param_size = bytes.len() as u8;
        self
    }

    /// Declares the per-step patch; offsets are byte offsets of u32 fields
    /// inside the params struct (use `std::mem::offset_of!`).
    pub fn patch(mut self, patch: PatchType, offset_1: usize, offset_2: usize) -> Self {
        assert!(offset_1 + 4 <= MAX_PARAM_BYTES && offset_2 + 4 <= MAX_PARAM_BYTES);
        self.cmd.patch = patch;
        self.cmd.patch_offset_1 = offset_1 as u8;
        self.cmd.patch_offset_2 = offset_2 as u8;
        self
    }

    pub fn last_row(mut self) -> Self {
        self.cmd.rows = RowMode::LastRow;
        self
    }

    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = label.into();
        self
    }

    pub fn emit(self) {
        let CmdBuilder { table, cmd, label } = self;
        // Patched params must lie inside the serialized struct.
        if matches!(
            cmd.patch,
            PatchType::Position | PatchType::KvSeqLen | PatchType::PosAndKv
        ) {
            debug_assert!(cmd.patch_offset_1 as usize + 4 <= cmd.param_size as usize);
        }
        table.commands.push(cmd);
        table.labels.push(label);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{AttnParams, KernelId};
    use bytemuck::Zeroable;
    use std::mem::offset_of;

    fn u32_at(c: &DispatchCmd, off: usize) -> u32 {
        u32::from_le_bytes(c.params[off..off + 4].try_into().unwrap())
    }

    #[test]
    fn every_patch_type_rewrites_its_fields() {
        let mut t = DispatchTable::default();
        let p = AttnParams::zeroed();
        let (o_pos, o_kv) = (offset_of!(AttnParams, pos), offset_of!(AttnParams, kv_len));
        for patch in PatchType::ALL {
            let (a, b) = match patch {
                PatchType::PosAndKv => (o_pos, o_kv),
                PatchType::KvSeqLen => (o_kv, 0),
                _ => (o_pos, 0),
            };
            CmdBuilder::new(&mut t, KernelId::Attention, 1)
                .buf(7, 100)
                .buf(8, 200)
                .params(&p)
                .patch(patch, a, b)
                .label(patch.name())
                .emit();
        }
        let step = StepInfo {
            pos: 40,
            tok: 3,
            rows: 1,
        };
        for (i, cmd) in t.commands.iter().enumerate() {
            let mut c = *cmd;
            c.apply_patch(&step);
            assert_eq!(t.label(i), cmd.patch.name());
            match cmd.patch {
                PatchType::None => {
                    assert_eq!(c.params, cmd.params);
                    assert_eq!(c.buffers, cmd.buffers);
                }
                PatchType::TokenOffset => {
                    assert_eq!(c.buffers[0].offset, 12);
                    assert_eq!(c.buffers[1].offset, 200);
                }
                PatchType::Position => assert_eq!(u32_at(&c, o_pos), 40),
                PatchType::KvSeqLen => {
                    assert_eq!(u32_at(&c, o_kv), 41);
                    assert_eq!(u32_at(&c, o_pos), 0);
                }
                PatchType::PosAndKv => {
                    assert_eq!(u32_at(&c, o_pos), 40);
                    assert_eq!(u32_at(&c, o_kv), 41);
                }
                PatchType::ArgmaxOutput => {
                    assert_eq!(c.buffers[1].offset, 16);
                    assert_eq!(c.buffers[0].offset, 100);
                }
            }
        }
        // Prefill steps: several rows; kv_len covers them all and the
        // argmax lands after the last row.
        let step = StepInfo {
            pos: 10,
            tok: 0,
            rows: 5,
        };
        let mut c = t.commands[4];
        c.apply_patch(&step);
        assert_eq!(u32_at(&c, o_kv), 15);
        let mut c = t.commands[5];
        c.apply_patch(&step);
        assert_eq!(c.buffers[1].offset, 20);
    }

    #[test]
    fn labels_stay_parallel_and_commands_stay_plain() {
        let mut t = DispatchTable::default();
        CmdBuilder::new(&mut t, KernelId::Argmax, 1)
            .label("a")
            .emit();
        CmdBuilder::new(&mut t, KernelId::Argmax, 1).emit();
        assert_eq!(t.labels.len(), t.commands.len());
        assert_eq!(t.label(0), "a");
        assert_eq!(t.label(1), "");
        assert_eq!(t.label(9), "");
        // The hot array holds no pointers: each command is a small Copy value.
        fn is_copy<T: Copy>() {}
        is_copy::<DispatchCmd>();
        assert!(std::mem::size_of::<DispatchCmd>() <= 256);
    }
}
