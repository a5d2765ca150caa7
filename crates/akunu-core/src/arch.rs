//! Architecture descriptions and model hyper-parameters.
//!
//! An [`ArchDescriptor`] is data: which optional pieces a transformer block
//! has and how RoPE and the FFN behave. The table builder reads these flags
//! in one walk; adding a Llama-family variant means adding a descriptor, not
//! a new builder.

use crate::dtype::DType;
use crate::gguf::GgufFile;
use crate::ops::{ACT_GEGLU, ACT_SWIGLU, ROPE_NEOX, ROPE_NORM};

#[derive(Clone, Debug, PartialEq)]
pub struct ArchDescriptor {
    /// `general.architecture` value (also the metadata key prefix).
    pub name: &'static str,
    /// `ROPE_NORM` (adjacent pairs) or `ROPE_NEOX` (halves).
    pub rope_style: u32,
    /// Q, K and V projections carry biases (Qwen2).
    pub qkv_bias: bool,
    /// Per-head RMSNorm of Q and K before RoPE (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// RMSNorm of the attention output before the residual add (Gemma).
    pub post_attn_norm: bool,
    /// RMSNorm of the FFN output before the residual add (Gemma).
    pub post_ffn_norm: bool,
    /// Embedding rows are multiplied by sqrt(dim) (Gemma).
    pub embed_scale_sqrt_dim: bool,
    /// Gated FFN activation: `ACT_SWIGLU` or `ACT_GEGLU`.
    pub ffn_act: u32,
    /// Layer pattern of sliding-window attention when the metadata sets
    /// `attention.sliding_window`: every `swa_period`-th layer (1-based) is
    /// global, the others attend over the window only (Gemma 3: 6). 0: no
    /// sliding-window layers.
    pub swa_period: u32,
    /// RoPE base of the sliding-window layers when the metadata has no
    /// `rope.freq_base_swa` (Gemma 3: 10000; their RoPE is never scaled).
    pub swa_rope_base: f32,
    /// Whether akunu's kernels implement every flag above for this
    /// architecture yet. Descriptors that are only data wait for their kernels.
    pub supported: bool,
}

const LLAMA: ArchDescriptor = ArchDescriptor {
    name: "llama",
    rope_style: ROPE_NORM,
    qkv_bias: false,
    qk_norm: false,
    post_attn_norm: false,
    post_ffn_norm: false,
    embed_scale_sqrt_dim: false,
    ffn_act: ACT_SWIGLU,
    swa_period: 0,
    swa_rope_base: 10000.0,
    supported: true,
};

/// Every architecture akunu knows and runs: each is the Llama block plus
/// the optional pieces its flags switch on.
pub const ARCHITECTURES: &[ArchDescriptor] = &[
    LLAMA,
    ArchDescriptor {
        name: "qwen2",
        rope_style: ROPE_NEOX,
        qkv_bias: true,
        ..LLAMA
    },
    ArchDescriptor {
        name: "qwen3",
        rope_style: ROPE_NEOX,
        qk_norm: true,
        ..LLAMA
    },
    ArchDescriptor {
        name: "gemma3",
        rope_style: ROPE_NEOX,
        qk_norm: true,
        post_attn_norm: true,
        post_ffn_norm: true,
        embed_scale_sqrt_dim: true,
        ffn_act: ACT_GEGLU,
        swa_period: 6,
        swa_rope_base: 10000.0,
        ..LLAMA
    },
];

pub fn supported_architectures() -> Vec<&'static str> {
    ARCHITECTURES
        .iter()
        .filter(|a| a.supported)
        .map(|a| a.name)
        .collect()
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("the model file has no 'general.architecture' key")]
    NoArchitecture,
    #[error("unsupported architecture '{0}' (akunu runs: {list})", list = supported_architectures().join(", "))]
    UnsupportedArch(String),
    #[error("missing metadata key '{0}'")]
    Missing(String),
    #[error("metadata key '{key}' has an invalid value: {why}")]
    Invalid { key: String, why: String },
    #[error("missing tensor '{0}'")]
    MissingTensor(String),
    #[error("tensor '{name}' has shape {got:?}, expected {want:?}")]
    Shape {
        name: String,
        got: Vec<u64>,
        want: Vec<u64>,
    },
    #[error("tensor '{name}' has type {dtype}, which cannot be used there ({why})")]
    TensorType {
        name: String,
        dtype: DType,
        why: String,
    },
}

/// Hyper-parameters of one model, read from its GGUF metadata.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub arch: ArchDescriptor,
    pub n_layers: u32,
    pub dim: u32,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    pub ffn_dim: u32,
    pub n_vocab: u32,
    /// Context length the model was trained for.
    pub train_ctx: u32,
    pub rope_theta: f32,
    pub rope_dim: u32,
    /// Linear RoPE scaling factor applied to positions (1.0 = none).
    pub rope_freq_scale: f32,
    /// The file has `rope_freqs.weight` (rope_dim / 2 F32 values): each
    /// rotated pair's frequency divided by its factor, in every layer, as
    /// llama.cpp's converter writes Llama 3.1-style RoPE scaling.
    pub rope_freqs: bool,
    pub rms_eps: f32,
    /// The logits reuse the token embedding matrix.
    pub tied_output: bool,
    /// Scale of the attention scores (1/sqrt(head_dim) unless the
    /// architecture says otherwise).
    pub attn_scale: f32,
    /// Keys a sliding-window layer attends over (its own position
    /// included); 0 when the model has no such layers.
    pub sliding_window: u32,
    /// RoPE base of the sliding-window layers.
    pub swa_rope_theta: f32,
    /// Tanh soft-cap of the attention scores (0 = none).
    pub attn_softcap: f32,
    /// Tanh soft-cap of the final logits (0 = none).
    pub final_softcap: f32,
}

/// The per-frequency RoPE divisors' tensor (Llama 3.1-style scaling).
pub const ROPE_FREQS: &str = "rope_freqs.weight";

// Sanity bounds: far beyond any real model, small enough that products of
// them cannot overflow the u32 arithmetic of the kernels' parameters.
const MAX_DIM: i64 = 1 << 16;
const MAX_LAYERS: i64 = 1024;
const MAX_VOCAB: i64 = 1 << 22;

impl ModelConfig {
    pub fn from_gguf(f: &GgufFile) -> Result<ModelConfig, ConfigError> {
        let name = f
            .get_str("general.architecture")
            .ok_or(ConfigError::NoArchitecture)?;
        let arch = ARCHITECTURES
            .iter()
            .find(|a| a.name == name && a.supported)
            .cloned()
            .ok_or_else(|| ConfigError::UnsupportedArch(name.to_string()))?;
        let key = |k: &str| format!("{name}.{k}");
        let int = |k: &str, lo: i64, hi: i64| -> Result<u32, ConfigError> {
            let full = key(k);
            let v = f
                .get_i64(&full)
                .ok_or_else(|| ConfigError::Missing(full.clone()))?;
            if v < lo || v > hi {
                return Err(ConfigError::Invalid {
                    key: full,
                    why: format!("{v} is outside {lo}..={hi}"),
                });
            }
            Ok(v as u32)
        };
        let n_layers = int("block_count", 1, MAX_LAYERS)?;
        let dim = int("embedding_length", 1, MAX_DIM)?;
        let n_heads = int("attention.head_count", 1, MAX_DIM)?;
        let n_kv_heads = match f.get_i64(&key("attention.head_count_kv")) {
            Some(_) => int("attention.head_count_kv", 1, MAX_DIM)?,
            None => n_heads,
        };
        let ffn_dim = int("feed_forward_length", 1, 1 << 20)?;
        let train_ctx = int("context_length", 1, 1 << 24)?;
        if dim % n_heads != 0 {
            return Err(ConfigError::Invalid {
                key: key("attention.head_count"),
                why: format!("{n_heads} heads do not divide width {dim}"),
            });
        }
        if n_heads % n_kv_heads != 0 {
            return Err(ConfigError::Invalid {
                key: key("attention.head_count_kv"),
                why: format!("{n_kv_heads} KV heads do not divide {n_heads} query heads"),
            });
        }
        let head_dim = match f.get_i64(&key("attention.key_length")) {
            Some(_) => int("attention.key_length", 2, 1024)?,
            None => dim / n_heads,
        };
        if let Some(v) = f.get_i64(&key("attention.value_length"))
            && v != head_dim as i64
        {
            return Err(ConfigError::Invalid {
                key: key("attention.value_length"),
                why: format!("{v} differs from the key length {head_dim}, which akunu needs"),
            });
        }
        if head_dim % 2 != 0 {
            return Err(ConfigError::Invalid {
                key: key("attention.key_length"),
                why: format!("head dimension {head_dim} is odd"),
            });
        }
        let rope_dim = match f.get_i64(&key("rope.dimension_count")) {
            Some(_) => int("rope.dimension_count", 2, head_dim as i64)?,
            None => head_dim,
        };
        let rope_theta = f.get_f64(&key("rope.freq_base")).unwrap_or(10000.0) as f32;
        if !(rope_theta.is_finite() && rope_theta > 0.0) {
            return Err(ConfigError::Invalid {
                key: key("rope.freq_base"),
                why: format!("{rope_theta}"),
            });
        }
        let rope_freq_scale = match f.get_str(&key("rope.scaling.type")) {
            None | Some("none") => 1.0,
            Some("linear") => {
                let factor = f.get_f64(&key("rope.scaling.factor")).unwrap_or(1.0) as f32;
                if !(factor.is_finite() && factor > 0.0) {
                    return Err(ConfigError::Invalid {
                        key: key("rope.scaling.factor"),
                        why: format!("{factor}"),
                    });
                }
                1.0 / factor
            }
            Some(other) => {
                return Err(ConfigError::Invalid {
                    key: key("rope.scaling.type"),
                    why: format!(
                        "RoPE scaling '{other}' is not supported yet (none and linear are)"
                    ),
                });
            }
        };
        let rms_eps = f
            .get_f64(&key("attention.layer_norm_rms_epsilon"))
            .unwrap_or(1e-5) as f32;
        if !(rms_eps.is_finite() && rms_eps > 0.0 && rms_eps < 1.0) {
            return Err(ConfigError::Invalid {
                key: key("attention.layer_norm_rms_epsilon"),
                why: format!("{rms_eps}"),
            });
        }
        let embd = f
            .tensor("token_embd.weight")
            .ok_or_else(|| ConfigError::MissingTensor("token_embd.weight".into()))?;
        if embd.dims.len() != 2 || embd.dims[0] != dim as u64 {
            return Err(ConfigError::Shape {
                name: embd.name.clone(),
                got: embd.dims.clone(),
                want: vec![dim as u64, 0],
            });
        }
        let n_vocab = embd.dims[1];
        if n_vocab == 0 || n_vocab as i64 > MAX_VOCAB {
            return Err(ConfigError::Invalid {
                key: "token_embd.weight".into(),
                why: format!("vocabulary of {n_vocab} rows"),
            });
        }
        let tied_output = f.tensor("output.weight").is_none();
        let opt_f32 = |k: &str, default: f32, lo: f32| -> Result<f32, ConfigError> {
            let v = f.get_f64(&key(k)).map_or(default, |v| v as f32);
            if v.is_finite() && v >= lo {
                Ok(v)
            } else {
                Err(ConfigError::Invalid {
                    key: key(k),
                    why: format!("{v}"),
                })
            }
        };
        let sliding_window = if arch.swa_period > 0 {
            match f.get_i64(&key("attention.sliding_window")) {
                Some(_) => int("attention.sliding_window", 1, 1 << 24)?,
                None => 0,
            }
        } else {
            0
        };
        let swa_rope_theta = opt_f32("rope.freq_base_swa", arch.swa_rope_base, f32::MIN_POSITIVE)?;
        let attn_softcap = opt_f32("attn_logit_softcapping", 0.0, 0.0)?;
        let final_softcap = opt_f32("final_logit_softcapping", 0.0, 0.0)?;
        // Gemma 3 27B scales by the width per head rather than the head
        // dimension (llama.cpp recognises it by its 62 layers); every other
        // model by 1/sqrt(head_dim).
        let scale_dim = if arch.name == "gemma3" && n_layers == 62 {
            dim / n_heads
        } else {
            head_dim
        };
        let attn_scale = 1.0 / (scale_dim as f32).sqrt();
        let cfg = ModelConfig {
            arch,
            n_layers,
            dim,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn_dim,
            n_vocab: n_vocab as u32,
            train_ctx,
            rope_theta,
            rope_dim,
            rope_freq_scale,
            rope_freqs: f.tensor(ROPE_FREQS).is_some(),
            rms_eps,
            tied_output,
            attn_scale,
            sliding_window,
            swa_rope_theta,
            attn_softcap,
            final_softcap,
        };
        cfg.check_tensors(f)?;
        Ok(cfg)
    }

    /// Whether layer `l` attends over the sliding window only.
    pub fn layer_is_local(&self, l: u32) -> bool {
        self.sliding_window > 0
            && self.arch.swa_period > 0
            && !(l + 1).is_multiple_of(self.arch.swa_period)
    }

    /// RoPE base and position scale of layer `l`.
    pub fn layer_rope(&self, l: u32) -> (f32, f32) {
        if self.layer_is_local(l) {
            (self.swa_rope_theta, 1.0)
        } else {
            (self.rope_theta, self.rope_freq_scale)
        }
    }

    pub fn q_dim(&self) -> u32 {
        self.n_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> u32 {
        self.n_kv_heads * self.head_dim
    }

    /// Width of one fused QKV row.
    pub fn qkv_dim(&self) -> u32 {
        self.q_dim() + 2 * self.kv_dim()
    }

    /// Every tensor the forward pass reads, with its expected GGML shape.
    pub fn expected_tensors(&self) -> Vec<(String, Vec<u64>)> {
        let (d, q, kv, ff) = (
            self.dim as u64,
            self.q_dim() as u64,
            self.kv_dim() as u64,
            self.ffn_dim as u64,
        );
        let mut v = vec![
            (
                "token_embd.weight".to_string(),
                vec![d, self.n_vocab as u64],
            ),
            ("output_norm.weight".to_string(), vec![d]),
        ];
        if !self.tied_output {
            v.push(("output.weight".into(), vec![d, self.n_vocab as u64]));
        }
        if self.rope_freqs {
            v.push((ROPE_FREQS.into(), vec![self.rope_dim as u64 / 2]));
        }
        for l in 0..self.n_layers {
            let b = |s: &str| format!("blk.{l}.{s}");
            v.push((b("attn_norm.weight"), vec![d]));
            v.push((b("attn_q.weight"), vec![d, q]));
            v.push((b("attn_k.weight"), vec![d, kv]));
            v.push((b("attn_v.weight"), vec![d, kv]));
            v.push((b("attn_output.weight"), vec![q, d]));
            v.push((b("ffn_norm.weight"), vec![d]));
            v.push((b("ffn_gate.weight"), vec![d, ff]));
            v.push((b("ffn_up.weight"), vec![d, ff]));
            v.push((b("ffn_down.weight"), vec![ff, d]));
            if self.arch.qkv_bias {
                v.push((b("attn_q.bias"), vec![q]));
                v.push((b("attn_k.bias"), vec![kv]));
                v.push((b("attn_v.bias"), vec![kv]));
            }
            if self.arch.qk_norm {
                v.push((b("attn_q_norm.weight"), vec![self.head_dim as u64]));
                v.push((b("attn_k_norm.weight"), vec![self.head_dim as u64]));
            }
            if self.arch.post_attn_norm {
                v.push((b("post_attention_norm.weight"), vec![d]));
            }
            if self.arch.post_ffn_norm {
                v.push((b("post_ffw_norm.weight"), vec![d]));
            }
        }
        v
    }

    fn check_tensors(&self, f: &GgufFile) -> Result<(), ConfigError> {
        for (name, want) in self.expected_tensors() {
            let t = f
                .tensor(&name)
                .ok_or_else(|| ConfigError::MissingTensor(name.clone()))?;
            if t.dims != want {
                return Err(ConfigError::Shape {
                    name,
                    got: t.dims.clone(),
                    want,
                });
            }
            // Norm weights and biases are read element-wise as f32.
            if want.len() == 1 && t.dtype != DType::F32 {
                return Err(ConfigError::TensorType {
                    name,
                    dtype: t.dtype,
                    why: "norm weights, biases and RoPE factors must be F32".into(),
                });
            }
        }
        Ok(())
    }

    /// Bytes of weights read per decoded token (every matrix once; the
    /// embedding contributes one row).
    pub fn weight_bytes_per_token(&self, f: &GgufFile) -> u64 {
        let mut total = 0;
        for (name, _) in self.expected_tensors() {
            if let Some(t) = f.tensor(&name) {
                if name == "token_embd.weight" {
                    let row = t.n_bytes / t.dims[1];
                    total += if self.tied_output { t.n_bytes } else { row };
                } else {
                    total += t.n_bytes;
                }
            }
        }
        total
    }
}
