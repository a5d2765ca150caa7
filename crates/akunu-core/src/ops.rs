//! The kernels a dispatch table can name, and the parameter struct of each.
//!
//! These are the contract between the table builder and every backend: a
//! backend implements each `KernelId` over the bindings and parameters
//! documented here. Parameter structs are `repr(C)` plain data of at most 64
//! bytes; u32 fields that a patch rewrites are named in the docs.

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
    /// RoPE on the Q and K parts of the QKV rows, then K and V written into
    /// the layer's cache at positions `pos..pos+rows`. Bindings: 0 QKV rows
    /// (Q and K rotated in place), 1 K cache, 2 V cache, 3 optional RoPE
    /// frequency factors (f32). Params: [`RopeParams`] (`pos` patched
    /// POSITION). Grid: heads.
    RopeKvWrite = 4,
    /// Causal attention of the step's query rows over the cache. Bindings:
    /// 0 QKV rows (Q read), 1 K cache, 2 V cache, 3 output rows. Params:
    /// [`AttnParams`] (`kv_len` patched KV_SEQ_LEN, or `pos` and `kv_len`
    /// patched POS_AND_KV for windowed layers). Grid: query heads.
    Attention = 5,
    /// Index of the largest logit of the last row. Bindings: 0 logits (f32),
    /// 1 token ids (u32, patched ARGMAX_OUTPUT). Params: [`ArgmaxParams`].
    /// Grid: 1.
    Argmax = 6,
    /// In-chain sampling (Gumbel-max): repetition penalty over the recent
    /// tokens, the candidate set (temperature, top-k, min-p, top-p), then
    /// each kept logit becomes `ln p + Gumbel(seed, position, token)` and
    /// every other one -inf, so the following argmax draws a sample.
    /// Bindings: 0 logits (f32, last row, rewritten), 1 recent tokens
    /// ([`RecentHeader`] then ids), 2 token conveyor. Params:
    /// [`SampleParams`] (`kv_len` patched KV_SEQ_LEN: the position of the
    /// token being produced). Grid: 1.
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
    /// are clamped-out errors on debug builds and read row 0 otherwise.
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
    pub _pad: u32,
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
    pub _pad: u32,
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
