//! The kernels a dispatch table can name, and the parameter struct of each.
//!
//! These are the contract between the table builder and every backend: a
//! backend implements each `KernelId` over the bindings and parameters
//! documented here. Parameter structs are `repr(C)` plain data of at most 64
//! bytes; u32 fields that a patch rewrites are named in the docs.

use crate::dtype::DType;
use crate::table::{DispatchCmd, RowMode};
use bytemuck::{Pod, Zeroable};

#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum KernelId {
    /// Bindings: 0 token ids (u32, patched TOKEN_OFFSET), 1 embedding
    /// matrix, 2 output rows (f32). Params: [`EmbedParams`]. Grid: 1.
    Embedding = 0,
    /// Bindings: 0 input rows, 1 weight (f32), 2 output rows. Params:
    /// [`NormParams`]. Grid: 1.
    RmsNorm = 1,
    /// `h += delta` (after an optional RMSNorm of `delta` with weight 4),
    /// then `out = rmsnorm(h) * w`. Bindings: 0 residual stream (read and
    /// written), 1 delta, 2 norm weight, 3 output rows, 4 optional post-norm
    /// weight. Params: [`NormParams`]. Grid: 1.
    ResidualRmsNorm = 2,
    /// Matrix-vector (decode) or matrix-matrix (prefill) product against one
    /// to three weight matrices whose outputs are concatenated: the fused
    /// QKV and gate/up projections, the output projection, the logits, and
    /// (with `input_act`) the fused SiLU+down projection. Bindings: 0 input
    /// rows, 1 output rows, 2..2+n_seg weights, then n_seg biases if `bias`.
    /// Params: [`GemvParams`]. Grid: total output rows.
    Gemv = 3,
    /// Optional per-head RMSNorm of Q and K, RoPE on the Q and K parts of
    /// the QKV rows, then K and V written into the layer's cache at
    /// positions `pos..pos+rows`. Bindings: 0 QKV rows (Q and K normed and
    /// rotated in place), 1 K cache, 2 V cache, then the optional RoPE
    /// frequency factors (f32), then with `qk_norm` the Q-norm and K-norm
    /// weights. Params: [`RopeParams`] (`pos` patched POSITION). Grid: heads.
    RopeKvWrite = 4,
    /// Causal attention of the step's query rows over the cache. Bindings:
    /// 0 QKV rows (Q read), 1 K cache, 2 V cache, 3 output rows. Params:
    /// [`AttnParams`] (`kv_len` patched KV_SEQ_LEN, or `pos` and `kv_len`
    /// patched POS_AND_KV for windowed layers). Grid: query heads.
    Attention = 5,
    /// Index of the largest logit (the lowest index on ties). Bindings: 0
    /// logits (f32), 1 token ids (u32, patched ARGMAX_OUTPUT). Params:
    /// [`ArgmaxParams`]. Grid: 1.
    ///
    /// `RowMode::LastRow` (decode, prefill): binding 0 holds one row of `n`
    /// logits and its argmax goes to conveyor slot `tok + rows`.
    /// `RowMode::AllRows` (speculative verification): binding 0 holds one
    /// row of `n` logits per step row, and row `r`'s argmax goes to slot
    /// `tok + r + 1` (the last row's is still `tok + rows`, the patched
    /// binding; earlier rows write just before it). With one row both modes
    /// are the same.
    Argmax = 6,
    /// In-chain sampling (Gumbel-max): repetition penalty over the recent
    /// tokens, the candidate set (temperature, top-k, min-p, top-p), then
    /// each kept logit becomes `ln p + Gumbel(seed, position, token)` and
    /// every other one -inf, so the following argmax draws a sample.
    /// Bindings: 0 logits (f32, last row, rewritten), 1 recent tokens
    /// ([`RecentHeader`] then ids), 2 token conveyor. Params:
    /// [`SampleParams`] (`kv_len` patched KV_SEQ_LEN: the position of the
    /// token being produced). Grid: 1.
    ///
    /// `RowMode::LastRow`: one row of logits, produced at `kv_len`.
    /// `RowMode::AllRows` (speculative verification): binding 0 holds one
    /// row per step row; row `r` is transformed as the one-row command of a
    /// step at position `pos + r` would be: its position is
    /// `kv_len_r = kv_len - rows + r + 1` (`pos + r + 1`), and its penalty
    /// window is the recent ids plus conveyor slots `1..=kv_len_r -
    /// chain_start`. With `chain_start = pos + 1` and the conveyor holding
    /// `[current, d1, .., dk]`, row `r` therefore penalises the sequence up
    /// to the current token plus the drafts `d1..dr`: exactly the window of
    /// the chain step that would produce the same position.
    GumbelSample = 7,
    /// The top `k` logits as (id u32, value f32) pairs, descending (ties by
    /// id). Bindings: 0 logits, 1 output pairs. Params: [`TopKParams`].
    TopKSelect = 8,
    /// Repetition penalty over the recent tokens. Bindings: 0 logits, 1
    /// recent tokens ([`RecentHeader`] then ids). Params: [`PenaltyParams`].
    RepetitionPenalty = 9,
    /// Divides the logits by the temperature. Bindings: 0 logits. Params:
    /// [`TemperatureParams`].
    TemperatureScale = 10,
    /// Logits of tokens whose bit is 0 in the mask become -inf. Bindings: 0
    /// logits, 1 mask (u32 words, bit `i % 32` of word `i / 32`). Params:
    /// [`BitmaskParams`].
    GrammarBitmask = 11,
}

impl KernelId {
    pub fn name(self) -> &'static str {
        match self {
            KernelId::Embedding => "embedding",
            KernelId::RmsNorm => "rmsnorm",
            KernelId::ResidualRmsNorm => "residual_rmsnorm",
            KernelId::Gemv => "gemv",
            KernelId::RopeKvWrite => "rope_kv_write",
            KernelId::Attention => "attention",
            KernelId::Argmax => "argmax",
            KernelId::GumbelSample => "gumbel_sample",
            KernelId::TopKSelect => "topk_select",
            KernelId::RepetitionPenalty => "repetition_penalty",
            KernelId::TemperatureScale => "temperature_scale",
            KernelId::GrammarBitmask => "grammar_bitmask",
        }
    }
}

#[derive(Copy, Clone, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct EmbedParams {
    /// Row width (model dimension).
    pub dim: u32,
    /// `DType` id of the embedding matrix.
    pub dtype: u32,
    /// Number of rows of the matrix (vocabulary size): ids at or beyond it
    /// read the last row (the engine rejects such ids before they get here).
    pub n_vocab: u32,
    /// Multiplier applied to the looked-up row (Gemma: sqrt(dim)); 1.0 else.
    pub scale: f32,
}

#[derive(Copy, Clone, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct NormParams {
    pub dim: u32,
    pub eps: f32,
    /// ResidualRmsNorm only: 1 when binding 4 (post-norm of delta) is set.
    pub post_norm: u32,
    pub _pad: u32,
}

/// `input_act` values of [`GemvParams`].
pub const ACT_NONE: u32 = 0;
/// Input row is `[gate | up]` of width `2k`; the product consumes
/// `silu(gate) * up`.
pub const ACT_SWIGLU: u32 = 1;
/// As `ACT_SWIGLU` with tanh-approximated GELU (Gemma).
pub const ACT_GEGLU: u32 = 2;

#[derive(Copy, Clone, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct GemvParams {
    /// Reduction length (columns of each weight matrix).
    pub k: u32,
    /// Elements between consecutive input rows.
    pub x_stride: u32,
    /// Elements between consecutive output rows.
    pub out_stride: u32,
    /// Number of weight segments (1..=3).
    pub n_seg: u32,
    /// Output rows of each segment.
    pub n: [u32; 3],
    /// `DType` id of each segment's weight.
    pub dtype: [u32; 3],
    /// One of `ACT_*`.
    pub input_act: u32,
    /// 1: add into the output instead of overwriting it (fused residual).
    pub accumulate: u32,
    /// 1: each segment has an f32 bias bound after the weights.
    pub bias: u32,
    /// Tanh soft-cap of the outputs, `cap * tanh(y / cap)`, applied after
    /// the bias (final logits of Gemma-style models); 0 = none.
    pub softcap: f32,
}

impl GemvParams {
    pub fn total_rows(&self) -> u32 {
        self.n[..self.n_seg as usize].iter().sum()
    }
}

/// `style` values of [`RopeParams`].
pub const ROPE_NORM: u32 = 0; // adjacent pairs (2i, 2i+1): GGML "normal" (Llama)
pub const ROPE_NEOX: u32 = 1; // halves (i, i + d/2): GGML "neox" (Qwen, Gemma)

#[derive(Copy, Clone, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct RopeParams {
    /// Position of the step's first row (patched).
    pub pos: u32,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    /// Leading dimensions of each head that are rotated (== head_dim for Llama).
    pub rope_dim: u32,
    pub theta: f32,
    /// Linear position scaling: the rotation uses `pos * freq_scale`.
    pub freq_scale: f32,
    pub style: u32,
    /// Elements between consecutive QKV rows.
    pub qkv_stride: u32,
    /// Positions the cache holds (rows of each head's K and V slab).
    pub capacity: u32,
    /// 1 when binding 3 holds per-frequency divisors (Llama 3.1 `rope_freqs`).
    pub freq_factors: u32,
    /// 1: every Q and K head is RMS-normalised (over `head_dim`, epsilon
    /// `norm_eps`) with its own weight before the rotation (Qwen3, Gemma 3).
    /// The Q-norm and K-norm weights (`head_dim` f32 each) are the two
    /// bindings after the optional frequency factors.
    pub qk_norm: u32,
    pub norm_eps: f32,
    /// Element type of the K and V caches: [`KvType`] as u32 (0 f32, 1 f16).
    pub kv_type: u32,
}

#[derive(Copy, Clone, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct AttnParams {
    /// Position of the step's first query row (patched by POS_AND_KV).
    pub pos: u32,
    /// Valid cache entries after this step (patched).
    pub kv_len: u32,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    pub capacity: u32,
    pub scale: f32,
    /// Sliding window in positions (0 = unlimited).
    pub window: u32,
    pub qkv_stride: u32,
    pub out_stride: u32,
    /// Tanh soft-cap of attention scores (0 = none).
    pub softcap: f32,
    /// Element type of the K and V caches: [`KvType`] as u32 (0 f32, 1 f16).
    pub kv_type: u32,
}

/// Element type of the K and V caches. F16 halves the cache's memory and
/// the bytes attention reads per position; each K and V element is rounded
/// to the nearest f16 (ties to even) when written, and every backend that
/// stores f16 reads back exactly those values, so backends agree.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
#[repr(u32)]
pub enum KvType {
    #[default]
    F32 = 0,
    F16 = 1,
}

impl KvType {
    /// Bytes of one cache element.
    pub fn bytes(self) -> u64 {
        match self {
            KvType::F32 => 4,
            KvType::F16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
        }
    }

    /// The type a command's `kv_type` field names.
    pub fn from_u32(v: u32) -> Option<KvType> {
        match v {
            0 => Some(KvType::F32),
            1 => Some(KvType::F16),
            _ => None,
        }
    }
}

impl std::str::FromStr for KvType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(KvType::F32),
            "f16" => Ok(KvType::F16),
            other => Err(format!(
                "unknown KV cache type '{other}' (expected f16 or f32)"
            )),
        }
    }
}

#[derive(Copy, Clone, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct ArgmaxParams {
    pub n: u32,
    pub _pad: [u32; 3],
}

/// Header of the recent-token buffer the host writes before each replay.
#[derive(Copy, Clone, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct RecentHeader {
    /// `kv_len` of the chain's first step: step `s` of a chain has
    /// `kv_len = chain_start + s`, and conveyor slots `1..=s` hold the
    /// tokens it has produced so far (they join the penalty window).
    pub chain_start: u32,
    /// Number of ids that follow (the last `repeat_last_n` tokens of the
    /// sequence, oldest first).
    pub n: u32,
}

#[derive(Copy, Clone, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct SampleParams {
    /// Position of the token being produced (patched KV_SEQ_LEN).
    pub kv_len: u32,
    pub n_vocab: u32,
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub repeat_penalty: f32,
    pub repeat_last_n: u32,
    pub seed_lo: u32,
    pub seed_hi: u32,
    /// Capacity of the recent-token buffer in ids.
    pub recent_capacity: u32,
    pub _pad: u32,
}

impl SampleParams {
    /// No top-k, top-p or min-p: every token is a candidate (the samplers'
    /// dense Gumbel-max; a NaN top-p or min-p is not this case).
    pub fn no_filter(&self) -> bool {
        self.top_k == 0 && self.top_p >= 1.0 && self.min_p <= 0.0
    }
}

#[derive(Copy, Clone, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct TopKParams {
    pub n_vocab: u32,
    pub k: u32,
    pub _pad: [u32; 2],
}

#[derive(Copy, Clone, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct PenaltyParams {
    pub n_vocab: u32,
    pub penalty: f32,
    pub recent_capacity: u32,
    pub _pad: u32,
}

#[derive(Copy, Clone, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct TemperatureParams {
    pub n_vocab: u32,
    pub temperature: f32,
    pub _pad: [u32; 2],
}

#[derive(Copy, Clone, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BitmaskParams {
    pub n_vocab: u32,
    pub _pad: [u32; 3],
}

fn row_bytes(dt: DType, k: u32) -> Result<u64, String> {
    dt.bytes_for(k as u64)
        .ok_or_else(|| format!("rows of {k} elements are not whole {dt} blocks"))
}

fn dtype(id: u32) -> Result<DType, String> {
    DType::from_ggml(id).ok_or_else(|| format!("unknown dtype id {id}"))
}

const F: u64 = 4;

fn kv_bytes(kv_type: u32) -> Result<u64, String> {
    KvType::from_u32(kv_type)
        .map(KvType::bytes)
        .ok_or_else(|| format!("unknown KV cache type {kv_type}"))
}

/// The bytes each binding must hold for steps of up to `max_rows` rows:
/// `(slot, bytes)`. Also checks the parameters' internal consistency.
/// Every backend's `validate` uses this, so all agree on what a command
/// reads and writes.
pub fn extents(c: &DispatchCmd, max_rows: u32) -> Result<Vec<(usize, u64)>, String> {
    let r = max_rows as u64;
    let nb = c.n_buffers as usize;
    let need_buffers = |n: usize| {
        if nb == n {
            Ok(())
        } else {
            Err(format!("expects {n} bindings, has {nb}"))
        }
    };
    Ok(match c.kernel {
        KernelId::Embedding => {
            need_buffers(3)?;
            let p: EmbedParams = c.params();
            let dt = dtype(p.dtype)?;
            if !(p.dim as usize).is_multiple_of(dt.block_elems()) {
                return Err(format!("dim {} not a multiple of the {dt} block", p.dim));
            }
            vec![
                (0, 4),
                (1, p.n_vocab as u64 * row_bytes(dt, p.dim)?),
                (2, r * p.dim as u64 * F),
            ]
        }
        KernelId::RmsNorm => {
            need_buffers(3)?;
            let p: NormParams = c.params();
            let d = p.dim as u64;
            vec![(0, r * d * F), (1, d * F), (2, r * d * F)]
        }
        KernelId::ResidualRmsNorm => {
            let p: NormParams = c.params();
            need_buffers(if p.post_norm != 0 { 5 } else { 4 })?;
            let d = p.dim as u64;
            let mut v = vec![(0, r * d * F), (1, r * d * F), (2, d * F), (3, r * d * F)];
            if p.post_norm != 0 {
                v.push((4, d * F));
            }
            v
        }
        KernelId::Gemv => {
            let p: GemvParams = c.params();
            let ns = p.n_seg as usize;
            if !(1..=3).contains(&ns) {
                return Err(format!("n_seg {ns} outside 1..=3"));
            }
            need_buffers(2 + ns * (1 + (p.bias != 0) as usize))?;
            let k = p.k as u64;
            let width = if p.input_act == ACT_NONE { k } else { 2 * k };
            if (p.x_stride as u64) < width {
                return Err(format!("x_stride {} < input width {width}", p.x_stride));
            }
            if p.out_stride < p.total_rows() {
                return Err(format!(
                    "out_stride {} < {} output rows",
                    p.out_stride,
                    p.total_rows()
                ));
            }
            if c.grid != p.total_rows() {
                return Err(format!("grid {} != {} output rows", c.grid, p.total_rows()));
            }
            let out_rows = if c.rows == RowMode::LastRow { 1 } else { r };
            let mut v = vec![
                (0, r * p.x_stride as u64 * F),
                (1, out_rows * p.out_stride as u64 * F),
            ];
            for s in 0..ns {
                let dt = dtype(p.dtype[s])?;
                if !(p.k as usize).is_multiple_of(dt.block_elems()) {
                    return Err(format!("k {} not a multiple of the {dt} block", p.k));
                }
                v.push((2 + s, p.n[s] as u64 * row_bytes(dt, p.k)?));
                if p.bias != 0 {
                    v.push((2 + ns + s, p.n[s] as u64 * F));
                }
            }
            v
        }
        KernelId::RopeKvWrite => {
            let p: RopeParams = c.params();
            let ff = (p.freq_factors != 0) as usize;
            let qkn = (p.qk_norm != 0) as usize;
            need_buffers(3 + ff + 2 * qkn)?;
            if p.rope_dim > p.head_dim
                || !p.rope_dim.is_multiple_of(2)
                || p.n_kv_heads == 0
                || !p.n_heads.is_multiple_of(p.n_kv_heads)
            {
                return Err("inconsistent head geometry".into());
            }
            if p.qkv_stride < (p.n_heads + 2 * p.n_kv_heads) * p.head_dim {
                return Err("qkv_stride too small".into());
            }
            let slab =
                p.n_kv_heads as u64 * p.capacity as u64 * p.head_dim as u64 * kv_bytes(p.kv_type)?;
            let mut v = vec![(0, r * p.qkv_stride as u64 * F), (1, slab), (2, slab)];
            if ff != 0 {
                v.push((3, p.rope_dim as u64 / 2 * F));
            }
            if qkn != 0 {
                v.push((3 + ff, p.head_dim as u64 * F));
                v.push((4 + ff, p.head_dim as u64 * F));
            }
            v
        }
        KernelId::Attention => {
            need_buffers(4)?;
            let p: AttnParams = c.params();
            if p.n_kv_heads == 0 || !p.n_heads.is_multiple_of(p.n_kv_heads) {
                return Err("inconsistent head geometry".into());
            }
            if p.qkv_stride < p.n_heads * p.head_dim || p.out_stride < p.n_heads * p.head_dim {
                return Err("row strides too small".into());
            }
            let slab =
                p.n_kv_heads as u64 * p.capacity as u64 * p.head_dim as u64 * kv_bytes(p.kv_type)?;
            vec![
                (0, r * p.qkv_stride as u64 * F),
                (1, slab),
                (2, slab),
                (3, r * p.out_stride as u64 * F),
            ]
        }
        KernelId::Argmax => {
            need_buffers(2)?;
            let p: ArgmaxParams = c.params();
            let rows = if c.rows == RowMode::LastRow { 1 } else { r };
            vec![(0, rows * p.n as u64 * F), (1, 4)]
        }
        KernelId::GumbelSample => {
            need_buffers(3)?;
            let p: SampleParams = c.params();
            let rows = if c.rows == RowMode::LastRow { 1 } else { r };
            vec![
                (0, rows * p.n_vocab as u64 * F),
                (1, 8 + p.recent_capacity as u64 * 4),
                (2, 4),
            ]
        }
        KernelId::TopKSelect => {
            need_buffers(2)?;
            let p: TopKParams = c.params();
            if p.k == 0 || p.k > p.n_vocab {
                return Err(format!("k {} outside 1..={}", p.k, p.n_vocab));
            }
            vec![(0, p.n_vocab as u64 * F), (1, p.k as u64 * 8)]
        }
        KernelId::RepetitionPenalty => {
            need_buffers(2)?;
            let p: PenaltyParams = c.params();
            vec![
                (0, p.n_vocab as u64 * F),
                (1, 8 + p.recent_capacity as u64 * 4),
            ]
        }
        KernelId::TemperatureScale => {
            need_buffers(1)?;
            let p: TemperatureParams = c.params();
            vec![(0, p.n_vocab as u64 * F)]
        }
        KernelId::GrammarBitmask => {
            need_buffers(2)?;
            let p: BitmaskParams = c.params();
            vec![
                (0, p.n_vocab as u64 * F),
                (1, (p.n_vocab as u64).div_ceil(32) * 4),
            ]
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::MAX_PARAM_BYTES;

    #[test]
    fn params_fit_inline() {
        assert!(std::mem::size_of::<EmbedParams>() <= MAX_PARAM_BYTES);
        assert!(std::mem::size_of::<NormParams>() <= MAX_PARAM_BYTES);
        assert!(std::mem::size_of::<GemvParams>() <= MAX_PARAM_BYTES);
        assert!(std::mem::size_of::<RopeParams>() <= MAX_PARAM_BYTES);
        assert!(std::mem::size_of::<AttnParams>() <= MAX_PARAM_BYTES);
        assert!(std::mem::size_of::<ArgmaxParams>() <= MAX_PARAM_BYTES);
        assert!(std::mem::size_of::<SampleParams>() <= MAX_PARAM_BYTES);
        assert!(std::mem::size_of::<TopKParams>() <= MAX_PARAM_BYTES);
    }
}
