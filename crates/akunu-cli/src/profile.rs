//! `akunu profile`: time every dispatch-table command on the device.
//!
//! Decode runs step by step (no chain graphs), so the backend can put a
//! timer around each command; the table's cold labels name the rows. Time
//! is reported per label kind (the label with its layer index removed:
//! `layer.7.qkv` counts as `qkv`) and per kernel.

use crate::load::{self, EngineArgs, ModelArgs, SamplingArgs};
use akunu_core::decode::GenerateOptions;
use anyhow::{Result, bail};
use clap::Args;
use std::collections::HashMap;

#[derive(Args)]
pub struct ProfileArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// Sampling options: with any, the sampled decode table is profiled.
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Prompt tokens before decoding (prefill is not profiled).
    #[arg(short = 'p', long, default_value_t = 32)]
    n_prompt: u32,
    /// Decode steps to time.
    #[arg(short = 'n', long, default_value_t = 64)]
    n_gen: u32,
    /// Also print every command of the table (one row per label).
    #[arg(long)]
    all: bool,
}

/// `layer.12.attn_output` -> `attn_output`; other labels unchanged.
fn kind_of(label: &str) -> &str {
    match label.strip_prefix("layer.") {
        Some(rest) => rest.split_once('.').map(|(_, k)| k).unwrap_or(rest),
        None => label,
    }
}

pub fn run(a: ProfileArgs) -> Result<()> {
    if a.n_gen == 0 {
        bail!("-n must be at least 1");
    }
    let model = load::model(&a.model)?;
    let cfg = model.config.clone();
    let ctx = a.engine.ctx.unwrap_or(a.n_prompt + a.n_gen + 8);
    let mut engine = load::engine(
        model.clone(),
        &EngineArgs {
            ctx: Some(ctx),
            ..a.engine.clone()
        },
    )?;
    engine.set_chain_decode(false);
    let prompt: Vec<u32> = (0..a.n_prompt.max(1))
        .map(|i| (i.wrapping_mul(7919) + 13) % cfg.n_vocab)
        .collect();
    let opts = GenerateOptions {
        max_tokens: 1,
        ignore_eos: true,
        ..Default::default()
    };
    // Prefill and the first token untimed; then time decode steps only.
    engine.generate(&prompt, &opts, &mut |_, _| true)?;
    if !engine.set_profiling(true) {
        bail!("this backend cannot time commands");
    }
    let sampling = a.sampling.config()?;
    let sampled = !sampling.is_greedy();
    let opts = GenerateOptions {
        max_tokens: a.n_gen,
        ignore_eos: true,
        sampling,
        ..Default::default()
    };
    let st = engine.generate(&[], &opts, &mut |_, _| true)?;
    let times = engine
        .command_times()
        .ok_or_else(|| anyhow::anyhow!("the backend recorded no times"))?;
    let table = if sampled {
        engine.sampled_table()
    } else {
        engine.table()
    };
    let steps = st.decode_steps.max(1) as f64;
    let total: f64 = times.iter().map(|(d, _)| d.as_secs_f64()).sum();
    let mut kinds: Vec<(String, String, f64, usize)> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    for (i, (d, _)) in times.iter().enumerate() {
        let label = table.label(i);
        let kind = kind_of(label).to_string();
        let at = *index.entry(kind.clone()).or_insert_with(|| {
            kinds.push((
                kind.clone(),
                table.commands[i].kernel.name().to_string(),
                0.0,
                0,
            ));
            kinds.len() - 1
        });
        kinds[at].2 += d.as_secs_f64();
        kinds[at].3 += 1;
    }
    kinds.sort_by(|x, y| y.2.total_cmp(&x.2));
    println!(
        "akunu profile: {} on {} | {} decode steps | {} commands per token | {:.1} us per token in commands",
        model.display_name(),
        engine.backend_description(),
        st.decode_steps,
        table.len(),
        total / steps * 1e6
    );
    println!("| command kind | kernel | per token | us/token | share |");
    println!("|---|---|---:|---:|---:|");
    for (kind, kernel, t, n) in &kinds {
        println!(
            "| {kind} | {kernel} | {n} | {:.1} | {:.1}% |",
            t / steps * 1e6,
            100.0 * t / total
        );
    }
    let mut per_kernel: Vec<(&str, f64)> = Vec::new();
    for (_, kernel, t, _) in &kinds {
        match per_kernel.iter_mut().find(|(k, _)| k == kernel) {
            Some((_, s)) => *s += t,
            None => per_kernel.push((kernel, *t)),
        }
    }
    per_kernel.sort_by(|x, y| y.1.total_cmp(&x.1));
    println!();
    println!("| kernel | us/token | share |");
    println!("|---|---:|---:|");
    for (k, t) in per_kernel {
        println!(
            "| {k} | {:.1} | {:.1}% |",
            t / steps * 1e6,
            100.0 * t / total
        );
    }
    if a.all {
        println!();
        println!("| # | label | us/token |");
        println!("|---:|---|---:|");
        for (i, (d, _)) in times.iter().enumerate() {
            println!(
                "| {i} | {} | {:.2} |",
                table.label(i),
                d.as_secs_f64() / steps * 1e6
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn kinds_drop_the_layer_index() {
        assert_eq!(super::kind_of("layer.12.attn_output"), "attn_output");
        assert_eq!(super::kind_of("layer.0.attn_norm"), "attn_norm");
        assert_eq!(super::kind_of("logits"), "logits");
        assert_eq!(super::kind_of("output_norm"), "output_norm");
    }
}
