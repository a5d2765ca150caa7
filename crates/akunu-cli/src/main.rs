//! The `akunu` command line: generate, tokenize, inspect, bench, profile, eval.

mod bench;
mod chat;
mod inspect;
mod load;
mod profile;
mod serve;
mod synth;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use load::{ConstraintArgs, EngineArgs, ModelArgs, SamplingArgs};
use std::io::Write;

#[derive(Parser)]
#[command(
    name = "akunu",
    version,
    about = "Run a GGUF language model fast on one machine: a dispatch table compiled once, replayed for every token."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text after a prompt, streaming it to stdout (statistics go to stderr).
    Generate(GenerateArgs),
    /// Print the token ids of a text (like llama.cpp's llama-tokenize).
    Tokenize(TokenizeArgs),
    /// Print a model's metadata and its dispatch table.
    Inspect(inspect::InspectArgs),
    /// Measure prefill and decode speed (like llama-bench's pp/tg tests).
    Bench(bench::BenchArgs),
    /// Time every dispatch-table command during decode, per command kind and kernel.
    Profile(profile::ProfileArgs),
    /// Evaluate a prompt and write the logits of its last position (raw little-endian f32).
    Eval(EvalArgs),
    /// Download the default model now (if not cached) and print its path.
    Fetch,
    /// Write a random-weight llama GGUF in the shape of a real model (tests, benchmarks).
    Synth(synth::SynthArgs),
    /// Chat in the terminal; the conversation's KV cache is kept between turns.
    Chat(chat::ChatArgs),
    /// Serve the OpenAI API (chat completions, completions, models) over HTTP.
    Serve(serve::ServeArgs),
}

#[derive(Args)]
struct PromptArgs {
    /// Prompt text.
    #[arg(short, long, conflicts_with_all = ["prompt_file", "prompt_ids"])]
    prompt: Option<String>,
    /// Read the prompt text from a file.
    #[arg(long, value_name = "FILE", conflicts_with = "prompt_ids")]
    prompt_file: Option<std::path::PathBuf>,
    /// Prompt given as comma-separated token ids (no tokenization, no BOS added).
    #[arg(long, value_name = "IDS")]
    prompt_ids: Option<String>,
    /// Treat special-token text such as <|im_start|> as plain text.
    #[arg(long)]
    no_parse_special: bool,
    /// Wrap the prompt as one user turn through the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Jinja chat template file to use instead of the model's (implies --chat).
    #[arg(long, value_name = "FILE")]
    chat_template: Option<std::path::PathBuf>,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    prompt: PromptArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    spec: load::SpecArgs,
    #[command(flatten)]
    constraint: ConstraintArgs,
    /// Most tokens to generate (0: evaluate the prompt only).
    #[arg(short = 'n', long = "max-tokens", default_value_t = 256)]
    max_tokens: u32,
    /// Keep generating past end-of-generation tokens (benchmarks, tests).
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object (prompt_ids, generated_ids, text, stats) instead of streaming.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct TokenizeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Text to tokenize (or use --file).
    text: Option<String>,
    /// Read the text from a file.
    #[arg(long, value_name = "FILE", conflicts_with = "text")]
    file: Option<std::path::PathBuf>,
    /// Print a JSON array of ids.
    #[arg(long)]
    json: bool,
    /// Print only the ids, as [1, 2, 3].
    #[arg(long, conflicts_with = "json")]
    ids: bool,
    /// Treat special-token text as plain text.
    #[arg(long)]
    no_parse_special: bool,
    /// Never add a BOS token, even where the model asks for one.
    #[arg(long)]
    no_bos: bool,
}

#[derive(Args)]
struct EvalArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// Comma-separated token ids.
    #[arg(long)]
    ids: String,
    /// Output file for n_vocab little-endian f32 logits.
    #[arg(long)]
    out: std::path::PathBuf,
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Generate(a) => generate(a),
        Cmd::Tokenize(a) => tokenize(a),
        Cmd::Inspect(a) => inspect::run(a),
        Cmd::Bench(a) => bench::run(a),
        Cmd::Profile(a) => profile::run(a),
        Cmd::Eval(a) => eval(a),
        Cmd::Fetch => fetch(),
        Cmd::Synth(a) => synth::run(a),
        Cmd::Chat(a) => chat::run(a),
        Cmd::Serve(a) => serve::run(a),
    };
    if let Err(e) = r {
        eprintln!("akunu: error: {e:#}");
        std::process::exit(1);
    }
}

pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    s.split(',')
        .map(|t| t.trim())
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u32>()
                .with_context(|| format!("'{t}' is not a token id"))
        })
        .collect()
}

fn prompt_tokens(model: &akunu_core::model::Model, p: &PromptArgs) -> Result<Vec<u32>> {
    if let Some(ids) = &p.prompt_ids {
        return parse_ids(ids);
    }
    let mut text = match (&p.prompt, &p.prompt_file) {
        (Some(t), _) => t.clone(),
        (None, Some(f)) => std::fs::read_to_string(f)
            .with_context(|| format!("reading prompt file {}", f.display()))?,
        (None, None) => {
            bail!("no prompt: give --prompt TEXT, --prompt-file FILE or --prompt-ids IDS")
        }
    };
    let mut add_special = true;
    if p.chat || p.chat_template.is_some() {
        let tmpl = load::chat_template(model, p.chat_template.as_deref())?;
        let msgs = [akunu_core::chat_template::ChatMessage::new("user", &text)];
        text = tmpl.render(&msgs, true)?;
        // A template that writes the BOS text itself gets no second one.
        let tok = &model.tokenizer;
        if let Some(b) = tok.bos().map(|b| tok.decode(&[b]))
            && !b.is_empty()
            && text.starts_with(&b)
        {
            add_special = false;
        }
    }
    Ok(model
        .tokenizer
        .encode(&text, add_special, !p.no_parse_special)?)
}

fn generate(a: GenerateArgs) -> Result<()> {
    let model = load::model(&a.model)?;
    let prompt = prompt_tokens(&model, &a.prompt)?;
    let constraint = a.constraint.constraint()?;
    let mut engine = load::engine(model.clone(), &a.engine)?;
    if let Some(c) = &constraint {
        // An invalid schema, grammar or expression fails here, before any
        // generation.
        engine.compile_constraint(c)?;
    }
    if !a.json {
        eprintln!(
            "akunu: {} on {}",
            model.display_name(),
            engine.backend_description()
        );
    }
    let opts = akunu_core::decode::GenerateOptions {
        max_tokens: a.max_tokens,
        ignore_eos: a.ignore_eos,
        sampling: a.sampling.config()?,
        speculative: a.spec.speculative,
        spec: a.spec.options()?,
        constraint,
        ..Default::default()
    };
    let mut ids = Vec::new();
    let mut text = String::new();
    let mut out = std::io::stdout().lock();
    let json = a.json;
    let mut write_err = None;
    let stats = engine.generate(&prompt, &opts, &mut |id, piece| {
        ids.push(id);
        text.push_str(piece);
        if !json && let Err(e) = out.write_all(piece.as_bytes()).and_then(|_| out.flush()) {
            // A closed stdout (e.g. `| head`) ends generation cleanly.
            write_err = Some(e);
            return false;
        }
        true
    })?;
    if json {
        let obj = serde_json::json!({
            "prompt_ids": prompt,
            "generated_ids": ids,
            "text": text,
            "stats": stats,
        });
        writeln!(out, "{obj}")?;
    } else {
        if write_err.is_none() {
            let _ = writeln!(out);
        }
        eprintln!(
            "akunu: prompt {} tokens in {:.1} ms ({:.1} tok/s) | generated {} tokens, decode {:.1} ms ({:.1} tok/s) | stop: {:?} | position {}/{}{}",
            stats.prompt_tokens,
            stats.prefill_ms,
            stats.prefill_tok_s,
            stats.generated_tokens,
            stats.decode_ms,
            stats.decode_tok_s,
            stats.stop_reason,
            stats.position,
            engine.capacity(),
            stats
                .seed
                .map(|s| format!(" | seed {s}"))
                .unwrap_or_default()
        );
        if let Some(sp) = &stats.speculative {
            eprintln!(
                "akunu: speculative: drafted {} accepted {} ({:.0}%) | {} verification passes, {:.2} tokens each | {} plain steps",
                sp.drafted,
                sp.accepted,
                100.0 * sp.acceptance_rate,
                sp.verify_passes,
                sp.tokens_per_pass,
                sp.plain_steps
            );
        }
        if let Some(g) = &stats.grammar {
            eprintln!(
                "akunu: grammar: {} masks, {:.0} us median ({:.0} mean, {:.0} max) overlapped with the forward pass, {:.0} us mean wait for a mask, {} forced tokens",
                g.masks,
                g.mask_us_median,
                g.mask_us_mean,
                g.mask_us_max,
                g.stall_us_mean,
                g.forced_tokens
            );
        }
        if stats.stop_reason == akunu_core::decode::StopReason::ContextFull {
            eprintln!(
                "akunu: stopped because the context ({} positions) is full; raise --ctx to generate more",
                engine.capacity()
            );
        }
    }
    Ok(())
}

fn tokenize(a: TokenizeArgs) -> Result<()> {
    let model = load::model(&a.model)?;
    let text = match (&a.text, &a.file) {
        (Some(t), _) => t.clone(),
        (None, Some(f)) => {
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?
        }
        (None, None) => bail!("no text: give TEXT or --file FILE"),
    };
    let ids = model
        .tokenizer
        .encode(&text, !a.no_bos, !a.no_parse_special)?;
    let mut out = std::io::stdout().lock();
    if a.json {
        writeln!(out, "{}", serde_json::to_string(&ids)?)?;
    } else if a.ids {
        let s: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
        writeln!(out, "[{}]", s.join(", "))?;
    } else {
        for id in ids {
            let piece = model.tokenizer.decode(&[id]);
            writeln!(out, "{id:>6} -> '{piece}'")?;
        }
    }
    Ok(())
}

fn eval(a: EvalArgs) -> Result<()> {
    let model = load::model(&a.model)?;
    let ids = parse_ids(&a.ids)?;
    let mut engine = load::engine(model, &a.engine)?;
    let logits = engine.eval_logits(&ids)?;
    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&a.out, bytes).with_context(|| format!("writing {}", a.out.display()))?;
    Ok(())
}

fn fetch() -> Result<()> {
    let path = akunu_core::fetch::ensure_default_model(&mut |msg| eprintln!("akunu: {msg}"))?;
    println!("{}", path.display());
    Ok(())
}
