//! Launch-time fusion for decode steps (one row, or a few verified rows).
//!
//! The dispatch table is the same on every backend; this module lets the
//! CUDA launcher run some neighbouring commands as fewer kernels, because on
//! a GPU a small model's decode token is bound by kernel count, not bytes.
//! Two patterns, both found by looking at a command's neighbours:
//!
//! ```text
//! gemv(out = delta) -> residual_rmsnorm(h += delta; xn = norm(h) * w) -> gemv(x = xn)
//!   becomes  gemv(out = h, accumulate)  ->  (nothing)  ->  gemv(x = h, staged as norm(h) * w)
//!
//! rmsnorm(xn = norm(h) * w) -> gemv(x = xn)
//!   becomes  (nothing)  ->  gemv(x = h, staged as norm(h) * w)
//! ```
//!
//! The residual add moves into the producing gemv (`h + W x`, the same single
//! addition as `h + delta`), and the normalisation into the consuming gemv's
//! input staging, which every block of it already does. `delta` and `xn` are
//! then never written: the builder's tables read them only in the command
//! right after the one that writes them, which the patterns check by buffer
//! identity. The fusions apply to every step launched the decode way (one
//! row, or the few rows of a speculative verification: see
//! `launch::decode_rows`), row by row; larger steps (prefill) and norms with
//! a post-norm (Gemma) are launched as written.
//!
//! A third pattern applies to one-row steps only:
//!
//! ```text
//! rope_kv_write(rotate Q, K in the QKV row; write K, V at pos) -> attention(q = QKV row)
//!   becomes  (nothing)  ->  attention(rotating q itself; the block holding pos
//!                                      rotates K and writes K, V first)
//! ```
//!
//! Only the attention reads the rotated query, and within a one-row step only
//! the split that holds `pos` reads the new key (see `attn_rope_prep` in
//! model.cu). Steps of several rows keep the separate kernel: row r's
//! attention reads the keys that rows before it wrote, across blocks.

use akunu_core::ops::{ACT_NONE, AttnParams, GemvParams, KernelId, NormParams, RopeParams};
use akunu_core::table::{Binding, DispatchCmd, DispatchTable};
use akunu_core::table::{PatchType, RowMode};

/// What the launcher does with one command of a one-row step.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Role {
    /// Launch as written.
    Plain,
    /// Fused into a neighbour: no launch.
    Skip,
    /// A gemv whose output is added into `h` (the residual stream) instead
    /// of written to its own output.
    AccumulateInto(Binding),
    /// A gemv whose input is `rmsnorm(x) * w` (x is the residual stream).
    NormInput { x: Binding, w: Binding, eps: f32 },
}

/// `AKUNU_CUDA_FUSE=0` turns every launch-time fusion off.
static FUSE: crate::knob::Knob = crate::knob::Knob::new("AKUNU_CUDA_FUSE");

fn same(a: &Binding, b: &Binding) -> bool {
    a.buffer == b.buffer && a.offset == b.offset
}

/// A gemv that can read `x` through the norm fusion: one plain input row of
/// exactly `dim` elements.
fn gemv_reads(cmd: &DispatchCmd, x: &Binding, dim: u32) -> bool {
    if cmd.kernel != KernelId::Gemv {
        return false;
    }
    let p: GemvParams = cmd.params();
    // Rows of x are `dim` apart, as the norm kernels lay them out.
    p.input_act == 0 && p.k == dim && p.x_stride == dim && same(&cmd.bindings()[0], x)
}

/// A gemv that writes exactly `delta` (one segment, no bias, no soft-cap,
/// not itself accumulating) and nothing else.
fn gemv_writes(cmd: &DispatchCmd, delta: &Binding, dim: u32) -> bool {
    if cmd.kernel != KernelId::Gemv {
        return false;
    }
    let p: GemvParams = cmd.params();
    p.n_seg == 1
        && p.bias == 0
        && p.accumulate == 0
        && p.softcap == 0.0
        && p.n[0] == dim
        && p.out_stride == dim
        && same(&cmd.bindings()[1], delta)
}

/// The norm at `i`, if it can be fused: (its input h, its weight, eps,
/// whether the preceding gemv takes the residual add).
fn fusable_norm(t: &DispatchTable, i: usize) -> Option<(Binding, Binding, f32, bool)> {
    let cmd = t.commands.get(i)?;
    let next = t.commands.get(i + 1)?;
    let b = cmd.bindings();
    match cmd.kernel {
        KernelId::RmsNorm => {
            let p: NormParams = cmd.params();
            // bindings: x, w, out
            gemv_reads(next, &b[2], p.dim).then_some((b[0], b[1], p.eps, false))
        }
        KernelId::ResidualRmsNorm => {
            let p: NormParams = cmd.params();
            // bindings: h, delta, w, out[, post_w]
            if p.post_norm != 0 || i == 0 || same(&b[0], &b[1]) {
                return None;
            }
            // The producing gemv must not itself take a fused norm (a role
            // holds one fusion).
            if i >= 2
                && matches!(
                    t.commands[i - 2].kernel,
                    KernelId::RmsNorm | KernelId::ResidualRmsNorm
                )
            {
                return None;
            }
            let prev = &t.commands[i - 1];
            (gemv_writes(prev, &b[1], p.dim) && gemv_reads(next, &b[3], p.dim))
                .then_some((b[0], b[2], p.eps, true))
        }
        _ => None,
    }
}

/// The role of command `i` in a one-row step of `t`.
pub fn decode_role(t: &DispatchTable, i: usize) -> Role {
    if FUSE.is("0") {
        return Role::Plain;
    }
    if fusable_norm(t, i).is_some() {
        return Role::Skip;
    }
    if i > 0
        && let Some((x, w, eps, _)) = fusable_norm(t, i - 1)
    {
        return Role::NormInput { x, w, eps };
    }
    if let Some((h, _, _, true)) = fusable_norm(t, i + 1) {
        return Role::AccumulateInto(h);
    }
    Role::Plain
}

/// The RoPE command at `i` when the attention right after it can do its
/// work in a one-row step: the same heads, cache and QKV row, a patched
/// position and KV length, and no per-head norm (Qwen3, Gemma 3 keep the
/// separate kernel).
pub fn rope_into_attention(t: &DispatchTable, i: usize) -> Option<RopeParams> {
    static ROPE: crate::knob::Knob = crate::knob::Knob::new("AKUNU_CUDA_FUSE_ROPE");
    if FUSE.is("0") || ROPE.is("0") {
        return None;
    }
    let (rope, attn) = (t.commands.get(i)?, t.commands.get(i + 1)?);
    if rope.kernel != KernelId::RopeKvWrite
        || attn.kernel != KernelId::Attention
        || rope.patch != PatchType::Position
        || !matches!(attn.patch, PatchType::KvSeqLen | PatchType::PosAndKv)
    {
        return None;
    }
    let (r, a): (RopeParams, AttnParams) = (rope.params(), attn.params());
    let (rb, ab) = (rope.bindings(), attn.bindings());
    // bindings: rope (qkv, k cache, v cache[, freq factors]); attention
    // (q, k cache, v cache, out).
    let fits = r.qk_norm == 0
        && r.n_heads == a.n_heads
        && r.n_kv_heads == a.n_kv_heads
        && r.head_dim == a.head_dim
        && r.capacity == a.capacity
        && r.qkv_stride == a.qkv_stride
        && r.rope_dim % 2 == 0
        && r.rope_dim <= r.head_dim
        && a.head_dim <= 256
        && rb.len() >= 3
        && ab.len() >= 3
        && (0..3).all(|s| same(&rb[s], &ab[s]));
    fits.then_some(r)
}

/// The gated activation that the gate | up gemv at `i` can apply in its
/// epilogue, sparing the down projection after it the activation in its
/// input staging (which every block of it repeats over 2F inputs): `i` is
/// a gemv of two F-row segments of one type (gate, then up) with no bias,
/// soft-cap or accumulation, and `i + 1` a gemv that reads its output row
/// (k = F, rows 2F apart) through the activation. The down product then
/// reads `gated(gate, up)`, written over the gate half of each row, as a
/// plain input; nothing else reads the row (the builder's tables). Whether
/// the gemv can take that epilogue is the launcher's call
/// (`launch::paired_act`). `AKUNU_CUDA_FUSE_ACT=0` turns it off.
pub fn act_pair(t: &DispatchTable, i: usize) -> Option<u32> {
    static PAIR: crate::knob::Knob = crate::knob::Knob::new("AKUNU_CUDA_FUSE_ACT");
    if FUSE.is("0") || PAIR.is("0") {
        return None;
    }
    let (gu, down) = (t.commands.get(i)?, t.commands.get(i + 1)?);
    if gu.kernel != KernelId::Gemv || down.kernel != KernelId::Gemv || gu.rows == RowMode::LastRow {
        return None;
    }
    let (p, q): (GemvParams, GemvParams) = (gu.params(), down.params());
    let f = p.n[0];
    let fits = p.n_seg == 2
        && p.n[1] == f
        && f.is_multiple_of(8)
        && p.dtype[0] == p.dtype[1]
        && p.bias == 0
        && p.softcap == 0.0
        && p.accumulate == 0
        && p.input_act == ACT_NONE
        && p.out_stride == 2 * f
        && q.input_act != ACT_NONE
        && q.k == f
        && q.x_stride == 2 * f
        && same(&down.bindings()[0], &gu.bindings()[1]);
    fits.then_some(q.input_act)
}

/// Kernel launches the fusions remove from a one-row step of `t`.
pub fn fused_away(t: &DispatchTable) -> usize {
    (0..t.len())
        .filter(|&i| decode_role(t, i) == Role::Skip || rope_into_attention(t, i).is_some())
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use akunu_core::ops::{ACT_GEGLU, ACT_SWIGLU};
    use akunu_core::table::{BufferId, CmdBuilder};

    /// gate | up (buffers: x 0, out 1, weights 2 and 3) of `f` + `f` rows,
    /// then down reading buffer `down_x` with activation `act` and rows
    /// `x_stride` apart.
    fn ffn(f: u32, down_x: BufferId, x_stride: u32, act: u32) -> DispatchTable {
        let mut t = DispatchTable::default();
        let gp = GemvParams {
            k: 64,
            x_stride: 64,
            out_stride: 2 * f,
            n_seg: 2,
            n: [f, f, 0],
            dtype: [1, 1, 0],
            input_act: ACT_NONE,
            accumulate: 0,
            bias: 0,
            softcap: 0.0,
        };
        CmdBuilder::new(&mut t, KernelId::Gemv, 2 * f)
            .buf(0, 0)
            .buf(1, 0)
            .buf(2, 0)
            .buf(3, 0)
            .params(&gp)
            .emit();
        let dp = GemvParams {
            k: f,
            x_stride,
            out_stride: 64,
            n_seg: 1,
            n: [64, 0, 0],
            dtype: [1, 0, 0],
            input_act: act,
            ..gp
        };
        CmdBuilder::new(&mut t, KernelId::Gemv, 64)
            .buf(down_x, 0)
            .buf(4, 0)
            .buf(5, 0)
            .params(&dp)
            .emit();
        t
    }

    #[test]
    fn activation_moves_into_the_gate_up_epilogue_only_where_it_fits() {
        assert_eq!(act_pair(&ffn(64, 1, 128, ACT_SWIGLU), 0), Some(ACT_SWIGLU));
        assert_eq!(act_pair(&ffn(64, 1, 128, ACT_GEGLU), 0), Some(ACT_GEGLU));
        // The down product itself pairs with nothing.
        assert_eq!(act_pair(&ffn(64, 1, 128, ACT_SWIGLU), 1), None);
        // No activation to move, another input, other row pitches, or
        // units that do not fill 16-row tiles of 8 gate + 8 up rows.
        assert_eq!(act_pair(&ffn(64, 1, 128, ACT_NONE), 0), None);
        assert_eq!(act_pair(&ffn(64, 6, 128, ACT_SWIGLU), 0), None);
        assert_eq!(act_pair(&ffn(64, 1, 64, ACT_SWIGLU), 0), None);
        assert_eq!(act_pair(&ffn(12, 1, 24, ACT_SWIGLU), 0), None);
    }
}
