//! `akunu bench`: prefill (ppN) and decode (tgN) speed over repeated runs,
//! with the memory-bandwidth floor for decode.

use crate::load::{self, EngineArgs, ModelArgs};
use akunu_core::decode::GenerateOptions;
use anyhow::Result;
use clap::Args;
use std::time::Instant;

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// Sampling for the decode test (default greedy).
    #[command(flatten)]
    sampling: crate::load::SamplingArgs,
    /// Prompt tokens of the prefill test (0: skip).
    #[arg(short = 'p', long, default_value_t = 512)]
    n_prompt: u32,
    /// Generated tokens of the decode test (0: skip).
    #[arg(short = 'n', long, default_value_t = 128)]
    n_gen: u32,
    /// Context depth of the decode test: it generates after a prompt of
    /// this many tokens (prefilled, not timed), as llama-bench's `-d`
    /// (0: after the BOS token alone).
    #[arg(short = 'd', long, default_value_t = 0, conflicts_with = "prompt_file")]
    depth: u32,
    /// Measured repetitions of each test (after one warm-up).
    #[arg(short, long, default_value_t = 5)]
    reps: u32,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Skip the memory-bandwidth measurement.
    #[arg(long)]
    no_bandwidth: bool,
    /// With --speculative, the decode test runs plain and speculative decode
    /// alternately (same prompt, same settings) and reports both.
    #[command(flatten)]
    spec: crate::load::SpecArgs,
    /// Prompt of the decode test, read from a file (default: the BOS
    /// token alone), e.g. an input-grounded task for speculative decode.
    #[arg(long, value_name = "FILE")]
    prompt_file: Option<std::path::PathBuf>,
    /// Wrap the --prompt-file text as one ChatML user turn.
    #[arg(long)]
    chat: bool,
    /// With a constraint: constrained decode against unconstrained decode,
    /// runs alternating, from this request (a ChatML user turn).
    #[command(flatten)]
    constraint: crate::load::ConstraintArgs,
    /// The request of the constrained decode test.
    #[arg(
        long,
        default_value = "Describe a person as a JSON object with a name, an age and a city."
    )]
    ask: String,
}

#[derive(serde::Serialize)]
struct Figure {
    test: String,
    median_tok_s: f64,
    min_tok_s: f64,
    max_tok_s: f64,
    runs: Vec<f64>,
}

fn figure(test: String, mut runs: Vec<f64>) -> Figure {
    runs.sort_by(|a, b| a.total_cmp(b));
    let n = runs.len();
    let median = if n % 2 == 1 {
        runs[n / 2]
    } else {
        (runs[n / 2 - 1] + runs[n / 2]) / 2.0
    };
    Figure {
        test,
        median_tok_s: median,
        min_tok_s: runs[0],
        max_tok_s: runs[n - 1],
        runs,
    }
}

/// Read bandwidth of this machine's memory with `threads` threads (GB/s,
/// best of several passes over a buffer far larger than the caches).
fn read_bandwidth(threads: usize) -> f64 {
    let n = (1usize << 30) / 8;
    let buf: Vec<u64> = (0..n as u64)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect();
    let mut best = 0f64;
    for _ in 0..5 {
        let t = Instant::now();
        let total: u64 = std::thread::scope(|s| {
            let per = n.div_ceil(threads);
            let hs: Vec<_> = buf
                .chunks(per)
                .map(|part| {
                    s.spawn(move || {
                        let mut acc = [0u64; 8];
                        for c in part.chunks_exact(8) {
                            for i in 0..8 {
                                acc[i] = acc[i].wrapping_add(c[i]);
                            }
                        }
                        acc.iter().fold(0u64, |a, b| a.wrapping_add(*b))
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or(0))
                .fold(0u64, |a, b| a.wrapping_add(b))
        });
        std::hint::black_box(total);
        best = best.max((n * 8) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

pub fn run(a: BenchArgs) -> Result<()> {
    if a.reps == 0 {
        anyhow::bail!("--reps must be at least 1");
    }
    let model = load::model(&a.model)?;
    let cfg = model.config.clone();
    let start: Vec<u32> = match &a.prompt_file {
        Some(f) => {
            let mut text = std::fs::read_to_string(f)
                .map_err(|e| anyhow::anyhow!("reading prompt file {}: {e}", f.display()))?;
            if a.chat {
                text = format!("<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n");
            }
            model.tokenizer.encode(&text, true, true)?
        }
        None => {
            let bos = model.tokenizer.bos().unwrap_or(1);
            // The same fixed, varied ids as the prefill test's prompt.
            std::iter::once(bos)
                .chain((1..a.depth).map(|i| (i.wrapping_mul(7919) + 13) % cfg.n_vocab))
                .collect()
        }
    };
    if start.is_empty() {
        anyhow::bail!("the prompt file gives no tokens");
    }
    let ctx = a.engine.ctx.unwrap_or(
        (a.n_prompt.max(start.len() as u32) + a.n_gen + 8)
            .max(64)
            .max(start.len() as u32 + a.n_gen + 8),
    );
    let mut engine = load::engine(
        model.clone(),
        &EngineArgs {
            ctx: Some(ctx),
            ..a.engine.clone()
        },
    )?;
    let backend = engine.backend_description();
    let mut grammar_json = None;
    let mut figures = Vec::new();
    if !a.json {
        eprintln!("akunu bench: {} on {}", model.display_name(), backend);
    }
    if a.n_prompt > 0 {
        // A fixed, varied prompt: speed does not depend on the ids.
        let prompt: Vec<u32> = (0..a.n_prompt)
            .map(|i| (i.wrapping_mul(7919) + 13) % cfg.n_vocab)
            .collect();
        let mut runs = Vec::new();
        for r in 0..=a.reps {
            engine.reset();
            let t = Instant::now();
            engine.eval_logits(&prompt)?;
            let s = t.elapsed().as_secs_f64();
            if r > 0 {
                runs.push(a.n_prompt as f64 / s);
            }
        }
        figures.push(figure(format!("pp{}", a.n_prompt), runs));
    }
    let mut spec_summary = None;
    let constraint = a.constraint.constraint()?;
    if let (Some(c), true) = (&constraint, a.n_gen > 0) {
        engine.compile_constraint(c)?;
        let text = format!(
            "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
            a.ask
        );
        let prompt = model.tokenizer.encode(&text, true, true)?;
        let sampling = a.sampling.config()?;
        let free = GenerateOptions {
            max_tokens: a.n_gen + 1,
            ignore_eos: true,
            sampling: sampling.clone(),
            ..Default::default()
        };
        let bound = GenerateOptions {
            constraint: Some(c.clone()),
            ignore_eos: false,
            ..free.clone()
        };
        let (mut plain, mut constrained) = (Vec::new(), Vec::new());
        let (mut mask_med, mut mask_mean, mut stall, mut tokens, mut forced) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        // Alternate the two, so that both see the same machine noise.
        for r in 0..=a.reps {
            engine.reset();
            let p = engine.generate(&prompt, &free, &mut |_, _| true)?;
            engine.reset();
            let g = engine.generate(&prompt, &bound, &mut |_, _| true)?;
            if r > 0 {
                plain.push(p.decode_tok_s);
                constrained.push(g.decode_tok_s);
                let gs = g.grammar.unwrap_or_default();
                mask_med.push(gs.mask_us_median);
                mask_mean.push(gs.mask_us_mean);
                stall.push(gs.stall_us_mean);
                tokens.push(g.generated_tokens as f64);
                forced.push(gs.forced_tokens as f64);
            }
        }
        let med = |v: &mut Vec<f64>| figure(String::new(), std::mem::take(v)).median_tok_s;
        let (fp, fc) = (
            figure(format!("tg{} unconstrained", a.n_gen), plain),
            figure(format!("tg{} constrained", a.n_gen), constrained),
        );
        let ratio = fc.median_tok_s / fp.median_tok_s;
        let g = serde_json::json!({
            "ratio": ratio,
            "mask_us_median": med(&mut mask_med),
            "mask_us_mean": med(&mut mask_mean),
            "stall_us_mean": med(&mut stall),
            "generated_tokens": med(&mut tokens),
            "forced_tokens": med(&mut forced),
        });
        if !a.json {
            eprintln!(
                "constrained / unconstrained decode: {:.0}% | per token: mask {:.0} us (median of run medians; mean {:.0} us), overlapped; wait for the mask {:.1} us | median {} tokens per constrained run, {} forced",
                100.0 * ratio,
                g["mask_us_median"].as_f64().unwrap_or(0.0),
                g["mask_us_mean"].as_f64().unwrap_or(0.0),
                g["stall_us_mean"].as_f64().unwrap_or(0.0),
                g["generated_tokens"],
                g["forced_tokens"],
            );
        } else {
            grammar_json = Some(g);
        }
        figures.push(fp);
        figures.push(fc);
    } else if a.n_gen > 0 {
        let opts = GenerateOptions {
            max_tokens: a.n_gen + 1,
            ignore_eos: true,
            sampling: a.sampling.config()?,
            spec: a.spec.options()?,
            ..Default::default()
        };
        // Plain decode, and with --speculative speculative decode in
        // alternation with it (this machine's speed drifts: alternating
        // keeps the comparison fair).
        let modes: &[bool] = if a.spec.speculative {
            &[false, true]
        } else {
            &[false]
        };
        let mut runs = vec![Vec::new(); modes.len()];
        let mut spec_runs = Vec::new();
        let mut outputs: Vec<Vec<u32>> = vec![Vec::new(); modes.len()];
        for r in 0..=a.reps {
            for (i, &speculative) in modes.iter().enumerate() {
                engine.reset();
                let o = GenerateOptions {
                    speculative,
                    ..opts.clone()
                };
                let mut ids = Vec::new();
                let st = engine.generate(&start, &o, &mut |id, _| {
                    ids.push(id);
                    true
                })?;
                if r > 0 {
                    runs[i].push(st.decode_tok_s);
                    if let Some(s) = st.speculative {
                        spec_runs.push(s);
                    }
                } else {
                    outputs[i] = ids;
                }
            }
        }
        let mut base = if a.sampling.temperature > 0.0 {
            format!("tg{} sampled", a.n_gen)
        } else {
            format!("tg{}", a.n_gen)
        };
        if a.depth > 0 {
            base = format!("{base} @ d{}", a.depth);
        }
        let mut rs = runs.into_iter();
        figures.push(figure(base.clone(), rs.next().unwrap_or_default()));
        if let Some(sr) = rs.next() {
            figures.push(figure(format!("{base} speculative"), sr));
            let (p, s) = (
                figures[figures.len() - 2].median_tok_s,
                figures[figures.len() - 1].median_tok_s,
            );
            let n = spec_runs.len().max(1) as f64;
            spec_summary = Some(serde_json::json!({
                "speedup": s / p,
                "same_tokens": outputs[0] == outputs[1],
                "acceptance_rate": spec_runs.iter().map(|x| x.acceptance_rate).sum::<f64>() / n,
                "tokens_per_pass": spec_runs.iter().map(|x| x.tokens_per_pass).sum::<f64>() / n,
                "drafted": spec_runs.first().map(|x| x.drafted),
                "accepted": spec_runs.first().map(|x| x.accepted),
                "plain_steps": spec_runs.first().map(|x| x.plain_steps),
                "prompt_tokens": start.len(),
            }));
        }
    }
    let weight_bytes = cfg.weight_bytes_per_token(&model.file);
    let threads = if a.engine.threads == 0 {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    } else {
        a.engine.threads
    };
    // Device backends measure their own memory (a device-to-device copy,
    // bytes read plus written); the CPU's is a multi-threaded read.
    let (bw, bw_what) = if a.no_bandwidth {
        (None, String::new())
    } else if let Some(b) = engine.measure_bandwidth() {
        (Some(b / 1e9), "device copy, read+write".to_string())
    } else {
        (
            Some(read_bandwidth(threads)),
            format!("read, {threads} threads"),
        )
    };
    // Described again after the runs: what they set up (the GPU's prefill
    // weight cache) shows in the rows.
    let backend = engine.backend_description();
    let launches = engine.launches_per_token();
    // Chains the backend ran as one kernel (the persistent decode) instead
    // of `launches` kernels a token.
    let single = engine.single_kernel_chains();
    let floor = bw.map(|b| b * 1e9 / weight_bytes as f64);
    let tg = figures
        .iter()
        .find(|f| f.test.starts_with("tg"))
        .map(|f| f.median_tok_s);
    if a.json {
        let obj = serde_json::json!({
            "model": model.display_name(),
            "file": model.file.path.display().to_string(),
            "backend": backend,
            "weight_bytes_per_token": weight_bytes,
            "bandwidth_gb_s": bw,
            "bandwidth_method": bw_what,
            "kernels_per_token": launches,
            "single_kernel_chains": single,
            "floor_tok_s": floor,
            "share_of_floor": tg.zip(floor).map(|(t, f)| t / f),
            "figures": figures,
            "speculative": spec_summary,
            "grammar": grammar_json,
        });
        println!("{obj}");
    } else {
        println!("| model | backend | test | tok/s (median) | min | max | runs |");
        println!("|---|---|---|---:|---:|---:|---:|");
        for f in &figures {
            println!(
                "| {} | {} | {} | {:.1} | {:.1} | {:.1} | {} |",
                model.display_name(),
                backend,
                f.test,
                f.median_tok_s,
                f.min_tok_s,
                f.max_tok_s,
                f.runs.len()
            );
        }
        if single > 0 {
            println!(
                "kernels per token: {launches} on the graph; {single} chains ran as one \
                 persistent kernel each"
            );
        } else {
            println!("kernels per token: {launches}");
        }
        if let Some(sp) = &spec_summary {
            println!("speculative: {sp}");
        }
        if let (Some(bw), Some(floor)) = (bw, floor) {
            println!(
                "weights read per token {:.1} MB; measured bandwidth {:.1} GB/s ({}); decode floor {:.1} tok/s{}",
                weight_bytes as f64 / 1e6,
                bw,
                bw_what,
                floor,
                tg.map(|t| format!("; tg reaches {:.0}% of it", 100.0 * t / floor))
                    .unwrap_or_default()
            );
        }
    }
    Ok(())
}
