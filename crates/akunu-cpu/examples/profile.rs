//! Times every dispatch-table command of CPU decode and prints the time per
//! kernel kind and per label: `cargo run --release -p akunu-cpu --example
//! profile -- MODEL.gguf [tokens] [threads] [f32|q8] [temperature]`.

use akunu_core::decode::{Engine, EngineOptions, GenerateOptions};
use akunu_core::model::Model;
use std::sync::Arc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .ok_or("usage: profile MODEL.gguf [tokens] [threads] [f32|q8] [temperature]")?;
    let n: u32 = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(64);
    let threads: usize = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(0);
    let model = Arc::new(Model::load(path)?);
    let mut be = akunu_cpu::CpuBackend::new(threads);
    be.set_q8_activations(args.get(4).is_some_and(|a| a == "q8"));
    be.enable_profiling();
    let opts = EngineOptions {
        ctx: Some(n + 16),
        chunk: 16,
        prefill_chunk: 16,
    };
    let mut e = Engine::new(model.clone(), Box::new(be), &opts)?;
    let st = e.generate(
        &[1],
        &GenerateOptions {
            max_tokens: n,
            ignore_eos: true,
            // Optional 5th argument: a temperature, to profile the sampled
            // table (with top-k 40, top-p 0.95 and a 1.1 penalty when > 0).
            sampling: match args.get(5).map(|t| t.parse::<f32>()).transpose()? {
                Some(t) if t > 0.0 => akunu_core::sampling::SamplingConfig {
                    temperature: t,
                    top_k: 40,
                    top_p: 0.95,
                    repeat_penalty: 1.1,
                    seed: 1,
                    ..Default::default()
                },
                _ => Default::default(),
            },
            ..Default::default()
        },
        &mut |_, _| true,
    )?;
    println!(
        "decode {:.1} tok/s over {} steps (profiling on)",
        st.decode_tok_s, st.decode_steps
    );
    let prof = e.command_times().ok_or("no profile")?;
    let table = if st.seed.is_some() {
        e.sampled_table()
    } else {
        e.table()
    };
    let total: f64 = prof.iter().map(|(d, _)| d.as_secs_f64()).sum();
    let mut by_kind: Vec<(String, f64)> = Vec::new();
    for (i, (d, _)) in prof.iter().enumerate() {
        let label = table.label(i);
        // Group labels by their kind: "layer.3.qkv" -> "qkv".
        let kind = label.rsplit('.').next().unwrap_or(label).to_string();
        match by_kind.iter_mut().find(|(k, _)| *k == kind) {
            Some(e) => e.1 += d.as_secs_f64(),
            None => by_kind.push((kind, d.as_secs_f64())),
        }
    }
    by_kind.sort_by(|a, b| b.1.total_cmp(&a.1));
    let steps = st.decode_steps.max(1) as f64 + 1.0;
    for (k, t) in by_kind {
        println!(
            "{k:<24} {:>8.3} ms/token {:>5.1}%",
            t * 1e3 / steps,
            100.0 * t / total
        );
    }
    Ok(())
}
