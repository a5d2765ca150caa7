//! `akunu synth`: write a random-weight GGUF (llama, qwen2, qwen3 or gemma3)
//! in the shape of a real model, for tests and benchmarks.

use akunu_core::dtype::DType;
use akunu_core::synth::{Shape, SynthArch, SynthSpec, parse_dtype, write_synthetic};
use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Clone)]
pub struct SynthArgs {
    /// Model shape: tiny, tiny-k, smollm2-135m, llama-1b or llama-8b.
    #[arg(long)]
    pub shape: Shape,
    /// Architecture: llama, qwen2, qwen3 or gemma3.
    #[arg(long, default_value = "llama")]
    pub arch: SynthArch,
    /// Type of the weight matrices: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0,
    /// q5_1, q4_k, q5_k or q6_k (norms stay f32). Rows that are not whole
    /// K-quant super-blocks (256) fall back as llama.cpp does: q4_k -> q5_0,
    /// q5_k -> q5_1, q6_k -> q8_0.
    #[arg(long = "type", value_name = "TYPE", value_parser = parse_dtype)]
    pub dtype: DType,
    /// Type of the token embedding instead of --type (same names); the
    /// default model's mix is `--type q4_1 --embedding-type q8_0`.
    #[arg(long, value_name = "TYPE", value_parser = parse_dtype)]
    pub embedding_type: Option<DType>,
    /// Type of the output matrix (`output.weight`) instead of --type;
    /// `--type q4_0 --output-type q6_k` is llama.cpp's default Q4_0 mix.
    /// A tied shape has no output matrix (use --embedding-type).
    #[arg(long, value_name = "TYPE", value_parser = parse_dtype)]
    pub output_type: Option<DType>,
    /// Seed of the random weights (the same seed gives the same file).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// GGUF whose tokenizer to copy (default for the 49152-token shapes: the
    /// default model, fetched on first use; tiny has a built-in tokenizer).
    #[arg(long, value_name = "GGUF")]
    pub tokenizer_from: Option<PathBuf>,
    /// Also write `rope_freqs.weight`, the per-frequency RoPE divisors of
    /// Llama 3.1-style scaling (1 to 8 across the frequencies).
    #[arg(long)]
    pub rope_freqs: bool,
    /// Output file.
    #[arg(value_name = "OUT.gguf")]
    pub out: PathBuf,
}

pub fn run(a: SynthArgs) -> Result<()> {
    let tokenizer_from = match a.tokenizer_from {
        Some(p) => {
            if !p.exists() {
                anyhow::bail!("tokenizer source {} does not exist", p.display());
            }
            Some(p)
        }
        None if a.shape.needs_tokenizer() => Some(
            akunu_core::fetch::ensure_default_model(&mut |m| eprintln!("akunu: {m}"))
                .context("fetching the default model to copy its tokenizer")?,
        ),
        None => None,
    };
    let spec = SynthSpec {
        shape: a.shape,
        arch: a.arch,
        dtype: a.dtype,
        embedding: a.embedding_type,
        output: a.output_type,
        seed: a.seed,
        tokenizer_from,
        rope_freqs: a.rope_freqs,
    };

    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "akunu: writing {bar:40} {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let start = Instant::now();
    let r = write_synthetic(&a.out, &spec, &mut |done, total| {
        if bar.length() != Some(total) {
            bar.set_length(total);
        }
        bar.set_position(done);
    });
    bar.finish_and_clear();
    r.with_context(|| format!("writing synthetic model {}", a.out.display()))?;

    let size = std::fs::metadata(&a.out).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "akunu: wrote {} ({} {} {}, seed {}): {:.1} MiB in {:.1} s",
        a.out.display(),
        spec.arch,
        spec.shape,
        spec.dtype,
        spec.seed,
        size as f64 / (1u64 << 20) as f64,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
