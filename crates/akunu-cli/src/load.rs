//! Model and engine set-up shared by the subcommands: the default-model
//! fetch, loading with a progress bar, and backend selection.

use akunu_core::backend::Backend;
use akunu_core::decode::{Engine, EngineOptions};
use akunu_core::model::Model;
use akunu_core::ops::KvType;
use anyhow::{Context, Result, bail};
use clap::Args;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args, Clone)]
pub struct ModelArgs {
    /// GGUF model file (default: SmolLM2-135M-Instruct Q4_1, fetched on first use).
    #[arg(short, long, value_name = "PATH")]
    pub model: Option<PathBuf>,
}

#[derive(Args, Clone)]
pub struct EngineArgs {
    /// Device: cuda (an NVIDIA GPU), cpu, or auto (the GPU when a CUDA
    /// driver and device are present, else the CPU).
    #[arg(long, env = "AKUNU_DEVICE", default_value = "auto", value_parser = ["auto", "cuda", "cpu"])]
    pub device: String,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// CPU threads (0: one per core).
    #[arg(short, long, default_value_t = 0)]
    pub threads: usize,
    /// Context size in tokens (default: the model's, capped to a 1 GiB KV cache).
    #[arg(short, long)]
    pub ctx: Option<u32>,
    /// Tokens per chain-decode submission (default: chosen for the device:
    /// 16 on the CPU, 32-64 on a GPU).
    #[arg(long)]
    pub chunk: Option<u32>,
    /// CPU decode activations for Q4_0/Q4_1/Q8_0 weights: q8 quantizes each
    /// input row to 8 bits per block and uses integer dot products (faster,
    /// as llama.cpp does); f32 keeps every product in f32 (exact).
    #[arg(long, env = "AKUNU_ACTIVATIONS", default_value = "f32", value_parser = ["f32", "q8"])]
    pub activations: String,
    /// Prompt tokens per prefill step.
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: u32,
    /// GPU prefill matrix products (steps of 64 or more tokens, on cuBLAS):
    /// exact matches an f32 product (three f16 products per quantized
    /// weight, two per F16 one); f16 rounds weights and inputs to f16 and
    /// takes one product, as llama.cpp's and PyTorch's f16 GEMMs do (faster;
    /// logits differ from the CPU's by about 1e-3 instead of 1e-6). Decode is
    /// exact either way.
    #[arg(long, env = "AKUNU_PREFILL_PRODUCTS", default_value = "exact", value_parser = ["exact", "f16"])]
    pub prefill_products: String,
    /// GPU prefill weight cache: keep every quantized weight the prefill
    /// products read dequantized on the GPU (4 bytes a weight: 26 GiB for
    /// an 8B model), so that prefill steps skip their dequantization (8B
    /// Q4_0 pp512 on an H200: 10.9k -> 13.5k tok/s). auto: when the cache
    /// takes at most half the free GPU memory at the first prefill; on:
    /// whatever fits, leaving 1 GiB free; off: dequantize a chunk at a time
    /// in every step. F16 weights need no cache.
    #[arg(long, env = "AKUNU_PREFILL_CACHE", default_value = "auto", value_parser = ["auto", "on", "off"])]
    pub prefill_cache: String,
    /// Element type of the KV cache: f16 rounds each K and V element to
    /// f16 when it is written (half the memory, and half the bytes
    /// attention reads, as llama.cpp's default cache); f32 keeps them
    /// exact. auto: f16 on a GPU, f32 on the CPU (the exact reference; f16
    /// decodes there as fast with AVX2).
    #[arg(long, env = "AKUNU_KV_TYPE", default_value = "auto", value_parser = ["auto", "f16", "f32"])]
    pub kv_type: String,
}

impl EngineArgs {
    /// The KV cache type asked for, or `default` for auto.
    fn kv_type_or(&self, default: KvType) -> KvType {
        self.kv_type.parse().unwrap_or(default)
    }
}

pub fn model_path(a: &ModelArgs) -> Result<PathBuf> {
    match &a.model {
        Some(p) => {
            if !p.exists() {
                bail!("model file {} does not exist", p.display());
            }
            Ok(p.clone())
        }
        None => Ok(akunu_core::fetch::ensure_default_model(&mut |msg| {
            eprintln!("akunu: {msg}")
        })?),
    }
}

pub fn model(a: &ModelArgs) -> Result<Arc<Model>> {
    let path = model_path(a)?;
    let model = Model::load(&path)?;
    prefault(&model);
    Ok(Arc::new(model))
}

/// Touches every page of the mapped weights with a progress bar, so that a
/// model on a slow disk shows progress at load instead of stalling the
/// first token.
fn prefault(model: &Model) {
    let data: &[u8] = model.file.mmap();
    let total = data.len() as u64;
    let bar = if total > (256 << 20) {
        let b = indicatif::ProgressBar::new(total);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "akunu: loading {bar:40} {bytes}/{total_bytes} ({eta})",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Some(b)
    } else {
        None
    };
    let mut sum = 0u8;
    for (i, chunk) in data.chunks(16 << 20).enumerate() {
        for page in chunk.chunks(4096) {
            sum = sum.wrapping_add(page[0]);
        }
        if let Some(b) = &bar {
            b.set_position(((i as u64 + 1) * (16 << 20)).min(total));
        }
    }
    std::hint::black_box(sum);
    if let Some(b) = bar {
        b.finish_and_clear();
    }
}

pub fn engine(model: Arc<Model>, a: &EngineArgs) -> Result<Engine> {
    let backend = backend(a)?;
    let opts = EngineOptions {
        ctx: a.ctx,
        chunk: a.chunk.unwrap_or_else(|| backend.preferred_chunk()),
        prefill_chunk: a.prefill_chunk,
    };
    Engine::new(model, backend, &opts).context("setting up the engine")
}

fn cpu_backend(a: &EngineArgs) -> Box<dyn Backend> {
    let mut be = akunu_cpu::CpuBackend::new(a.threads);
    be.set_q8_activations(a.activations == "q8");
    be.set_kv_type(a.kv_type_or(KvType::F32));
    Box::new(be)
}

/// The backend `--device` asks for. `auto` takes the GPU when a CUDA driver
/// and device are present and falls back to the CPU with one line saying why.
pub fn backend(a: &EngineArgs) -> Result<Box<dyn Backend>> {
    match a.device.as_str() {
        "cpu" => Ok(cpu_backend(a)),
        "cuda" => cuda_backend(a),
        "auto" => match cuda_backend(a) {
            Ok(b) => Ok(b),
            Err(e) => {
                eprintln!("akunu: {e:#}; using the CPU");
                Ok(cpu_backend(a))
            }
        },
        other => bail!("unknown device '{other}' (expected cpu, cuda or auto)"),
    }
}

#[cfg(feature = "cuda")]
fn cuda_backend(a: &EngineArgs) -> Result<Box<dyn Backend>> {
    akunu_cuda::driver_status().map_err(|e| anyhow::anyhow!("no CUDA GPU ({e})"))?;
    let kv = a.kv_type_or(KvType::F16);
    let mut be = akunu_cuda::CudaBackend::with_kv_type(a.gpu, kv, &mut |m| eprintln!("akunu: {m}"))
        .with_context(|| format!("opening CUDA device {}", a.gpu))?;
    if a.prefill_products == "f16" {
        be.set_prefill_products(akunu_cuda::PrefillProducts::F16);
    }
    let cache = akunu_cuda::PrefillCache::parse(&a.prefill_cache).with_context(|| {
        format!(
            "--prefill-cache {}: expected auto, on or off",
            a.prefill_cache
        )
    })?;
    be.set_prefill_cache(cache);
    Ok(Box::new(be))
}

#[cfg(not(feature = "cuda"))]
fn cuda_backend(_a: &EngineArgs) -> Result<Box<dyn Backend>> {
    bail!("this build of akunu has no CUDA backend (rebuild with --features cuda)")
}

/// Sampling flags (the chapter's parameters and defaults).
#[derive(Args, Clone)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 is greedy (argmax).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: no limit).
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    /// Nucleus sampling: keep the most likely tokens up to this cumulative probability (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Drop tokens less likely than min-p times the most likely one (0: off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Repetition penalty over the last --repeat-last-n tokens (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// How many previous tokens the repetition penalty looks at.
    #[arg(long, default_value_t = 64)]
    pub repeat_last_n: u32,
    /// Random seed (default: a fresh one, reported in the statistics).
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    pub fn config(&self) -> Result<akunu_core::sampling::SamplingConfig> {
        let cfg = akunu_core::sampling::SamplingConfig {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            seed: self.seed.unwrap_or_else(akunu_core::sampling::random_seed),
        };
        cfg.validate()?;
        if cfg.repeat_last_n > akunu_core::builder::RECENT_CAPACITY {
            bail!(
                "--repeat-last-n must be at most {}",
                akunu_core::builder::RECENT_CAPACITY
            );
        }
        Ok(cfg)
    }
}

/// Speculative decoding flags.
#[derive(Args, Clone)]
pub struct SpecArgs {
    /// N-gram speculative decoding: drafts from earlier text (prompt and
    /// output) verified in one pass; the output is unchanged.
    #[arg(long)]
    pub speculative: bool,
    /// Shortest n-gram the draft predictor matches.
    #[arg(long, default_value_t = akunu_core::speculative::SpecOptions::default().ngram_min)]
    pub spec_ngram_min: u32,
    /// Longest n-gram the draft predictor matches (tried first).
    #[arg(long, default_value_t = akunu_core::speculative::SpecOptions::default().ngram_max)]
    pub spec_ngram_max: u32,
    /// Most drafted tokens per verification pass.
    #[arg(long, default_value_t = akunu_core::speculative::SpecOptions::default().draft)]
    pub spec_draft: u32,
}

impl SpecArgs {
    pub fn options(&self) -> Result<akunu_core::speculative::SpecOptions> {
        let o = akunu_core::speculative::SpecOptions {
            ngram_min: self.spec_ngram_min,
            ngram_max: self.spec_ngram_max,
            draft: self.spec_draft,
        };
        o.validate().map_err(anyhow::Error::msg)?;
        Ok(o)
    }
}

/// Output constraints (grammar-constrained decoding through llguidance).
#[derive(Args, Clone, Debug, Default)]
#[group(multiple = false)]
pub struct ConstraintArgs {
    /// Constrain the output to JSON valid under this JSON Schema file.
    #[arg(long, value_name = "FILE")]
    pub json_schema: Option<std::path::PathBuf>,
    /// Constrain the output to this Lark grammar file (llguidance's Lark dialect).
    #[arg(long, value_name = "FILE")]
    pub grammar: Option<std::path::PathBuf>,
    /// Constrain the output to match this regular expression.
    #[arg(long, value_name = "RE")]
    pub regex: Option<String>,
    /// Constrain the output to any JSON object.
    #[arg(long)]
    pub json_object: bool,
}

impl ConstraintArgs {
    pub fn constraint(&self) -> Result<Option<akunu_core::decode::Constraint>> {
        use akunu_core::decode::Constraint;
        let read = |p: &std::path::Path| {
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
        };
        Ok(if let Some(p) = &self.json_schema {
            Some(Constraint::JsonSchema(read(p)?))
        } else if let Some(p) = &self.grammar {
            Some(Constraint::Lark(read(p)?))
        } else if let Some(r) = &self.regex {
            Some(Constraint::Regex(r.clone()))
        } else if self.json_object {
            Some(Constraint::JsonObject)
        } else {
            None
        })
    }
}

/// The chat template: `file` when given, else the model's own.
pub fn chat_template(
    model: &Model,
    file: Option<&std::path::Path>,
) -> Result<akunu_core::chat_template::ChatTemplate> {
    let source = match file {
        Some(f) => Some(
            std::fs::read_to_string(f)
                .with_context(|| format!("reading chat template {}", f.display()))?,
        ),
        None => None,
    };
    let t = akunu_core::chat_template::ChatTemplate::for_model(
        &model.file,
        &model.tokenizer,
        source.as_deref(),
    );
    match (t, file) {
        (Ok(t), _) => Ok(t),
        (Err(e), Some(f)) => {
            Err(anyhow::Error::new(e).context(format!("chat template {}", f.display())))
        }
        (Err(e), None) => Err(e.into()),
    }
}
