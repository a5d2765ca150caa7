//! `akunu chat`: an interactive chat in the terminal. The conversation is
//! rendered through the chat template every turn, and the engine keeps the
//! KV cache of what it already saw, so a turn prefills only its new tokens.
//! Ctrl-C stops the reply being written, not the program.

use crate::load::{self, EngineArgs, ModelArgs, SamplingArgs};
use akunu_core::chat_template::ChatMessage;
use akunu_core::decode::{GenerateOptions, Stats, StopReason};
use anyhow::{Context, Result};
use clap::Args;
use std::io::{BufRead, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Most tokens per reply.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 512)]
    max_tokens: u32,
    /// A system message to start the conversation with.
    #[arg(long)]
    system: Option<String>,
    /// Jinja chat template file to use instead of the model's.
    #[arg(long, value_name = "FILE")]
    chat_template: Option<std::path::PathBuf>,
    /// Print statistics after every reply (also toggled by /stats).
    #[arg(long)]
    stats: bool,
}

const HELP: &str = "commands: /stats (toggle statistics after each reply), /reset (new conversation), /system TEXT (set the system message and reset), /exit or /quit (or end of input); Ctrl-C stops a reply";

pub fn run(a: ChatArgs) -> Result<()> {
    let model = load::model(&a.model)?;
    let template = load::chat_template(&model, a.chat_template.as_deref())?;
    let mut engine = load::engine(model.clone(), &a.engine)?;
    let sampling = a.sampling.config()?;
    let interrupted = Arc::new(AtomicBool::new(false));
    let generating = Arc::new(AtomicBool::new(false));
    {
        let (flag, busy) = (interrupted.clone(), generating.clone());
        ctrlc::set_handler(move || {
            if busy.load(Ordering::SeqCst) {
                flag.store(true, Ordering::SeqCst);
            } else {
                eprint!("\n(Ctrl-C stops a reply; /exit or Ctrl-D quits)\n> ");
            }
        })
        .context("installing the Ctrl-C handler")?;
    }
    eprintln!(
        "akunu: chatting with {} on {} (context {}); {HELP}",
        model.display_name(),
        engine.backend_description(),
        engine.capacity()
    );
    let mut system = a.system.clone();
    let mut messages = new_conversation(&system);
    let mut show_stats = a.stats;
    let mut last: Option<(Stats, usize)> = None;
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    let tok = &model.tokenizer;
    loop {
        eprint!("> ");
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            eprintln!();
            break;
        }
        let line = line.trim_end_matches(['\n', '\r']);
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/help" => {
                eprintln!("{HELP}");
                continue;
            }
            "/reset" => {
                messages = new_conversation(&system);
                engine.reset();
                eprintln!("akunu: new conversation");
                continue;
            }
            "/stats" => {
                show_stats = !show_stats;
                eprintln!(
                    "akunu: statistics {}",
                    if show_stats { "on" } else { "off" }
                );
                if let Some((s, reused)) = &last {
                    print_stats(s, *reused, engine.capacity());
                }
                continue;
            }
            l if l.starts_with("/system") => {
                let text = l["/system".len()..].trim();
                system = (!text.is_empty()).then(|| text.to_string());
                messages = new_conversation(&system);
                engine.reset();
                eprintln!("akunu: system message set; new conversation");
                continue;
            }
            _ => {}
        }
        messages.push(ChatMessage::new("user", line));
        let text = match template.render(&messages, true) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("akunu: {e}");
                messages.pop();
                continue;
            }
        };
        let bos = tok.bos().map(|b| tok.decode(&[b]));
        let add_bos = !bos.is_some_and(|b| !b.is_empty() && text.starts_with(&b));
        let ids = tok.encode(&text, add_bos, true)?;
        let room = engine.capacity() as usize;
        if ids.len() >= room {
            eprintln!(
                "akunu: the conversation ({} tokens) no longer fits in the context ({room}); /reset starts a new one",
                ids.len()
            );
            messages.pop();
            continue;
        }
        // Keep the part of the cache this conversation already filled.
        let reused = engine.reuse_prefix(&ids);
        let opts = GenerateOptions {
            max_tokens: a.max_tokens.min((room - ids.len()) as u32),
            sampling: sampling.clone(),
            ..Default::default()
        };
        interrupted.store(false, Ordering::SeqCst);
        generating.store(true, Ordering::SeqCst);
        let mut reply = String::new();
        let result = engine.generate(&ids[reused..], &opts, &mut |_, piece| {
            reply.push_str(piece);
            let _ = out.write_all(piece.as_bytes()).and_then(|_| out.flush());
            !interrupted.load(Ordering::SeqCst)
        });
        generating.store(false, Ordering::SeqCst);
        println!();
        match result {
            Ok(stats) => {
                if stats.stop_reason == StopReason::Cancelled {
                    eprintln!("akunu: [reply stopped]");
                }
                if show_stats {
                    print_stats(&stats, reused, engine.capacity());
                }
                last = Some((stats, reused));
                messages.push(ChatMessage::new("assistant", &reply));
            }
            Err(e) => {
                eprintln!("akunu: error: {e}");
                messages.pop();
                engine.reset();
            }
        }
    }
    Ok(())
}

fn new_conversation(system: &Option<String>) -> Vec<ChatMessage> {
    system
        .iter()
        .map(|s| ChatMessage::new("system", s))
        .collect()
}

fn print_stats(s: &Stats, reused: usize, capacity: u32) {
    eprintln!(
        "akunu: prefilled {} new tokens ({} reused from the cache) in {:.1} ms ({:.1} tok/s) | generated {} tokens in {:.1} ms ({:.1} tok/s) | stop: {:?} | context {}/{}",
        s.prompt_tokens,
        reused,
        s.prefill_ms,
        s.prefill_tok_s,
        s.generated_tokens,
        s.decode_ms,
        s.decode_tok_s,
        s.stop_reason,
        s.position,
        capacity
    );
}
