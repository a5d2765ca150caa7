//! The engine thread: the engine is not `Sync`, so one thread owns it and
//! runs the queued requests one after another. Each request's output goes
//! back through its own channel; a closed channel (the client went away)
//! cancels the generation at the next token.

use super::stop::StopMatcher;
use akunu_core::decode::{Engine, EngineError, GenerateOptions, StopReason};
use serde::Serialize;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc::UnboundedSender;

/// One generation request, already validated and tokenized.
pub struct Job {
    pub prompt: Vec<u32>,
    pub opts: GenerateOptions,
    /// Text-level stop sequences.
    pub stop: Vec<String>,
    /// Log-probabilities: None (off), or Some(k): the chosen token's and the
    /// k most likely alternatives'.
    pub logprobs: Option<usize>,
    pub events: UnboundedSender<Event>,
}

/// The log-probability of one token.
#[derive(Clone, Debug, Serialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    /// The most likely tokens at this position (empty unless asked for).
    pub top: Vec<(String, f32, Vec<u8>)>,
}

pub enum Event {
    /// Released text, with the log-probabilities of the tokens it completes.
    Text {
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    Done {
        finish_reason: &'static str,
        prompt_tokens: u32,
        completion_tokens: u32,
    },
    /// The request failed before any text: `bad_request` tells a client
    /// error (400) from a server one.
    Error { message: String, bad_request: bool },
}

/// Counters shown by `/health` (the tests read them to see that a
/// disconnected client's generation ended early).
#[derive(Default)]
pub struct Metrics {
    pub queued: AtomicUsize,
    pub completed: AtomicU64,
    pub cancelled: AtomicU64,
    pub failed: AtomicU64,
    pub reused_tokens: AtomicU64,
    pub generating: AtomicUsize,
    pub last: Mutex<Option<LastGeneration>>,
}

#[derive(Clone, Serialize)]
pub struct LastGeneration {
    pub stop_reason: StopReason,
    pub prompt_tokens: u32,
    pub reused_tokens: u32,
    pub generated_tokens: u32,
    pub max_tokens: u32,
    /// A stop sequence ended it (the engine reports that as cancelled).
    pub stop_sequence: bool,
    /// The client went away and the generation was cut short.
    pub client_disconnected: bool,
}

/// Runs jobs until every sender of `jobs` is gone.
pub fn run(mut engine: Engine, jobs: std::sync::mpsc::Receiver<Job>, metrics: Arc<Metrics>) {
    for job in jobs {
        metrics.queued.fetch_sub(1, Ordering::SeqCst);
        if job.events.is_closed() {
            // The client left while the request waited.
            metrics.cancelled.fetch_add(1, Ordering::SeqCst);
            continue;
        }
        metrics.generating.store(1, Ordering::SeqCst);
        let events = job.events.clone();
        // A bug that panics in one request must not take the server down:
        // the request fails, the sequence is dropped, the next one runs.
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            serve_one(&mut engine, job, &metrics)
        }));
        if run.is_err() {
            engine.set_logits_probe(None);
            engine.reset();
            metrics.failed.fetch_add(1, Ordering::SeqCst);
            let _ = events.send(Event::Error {
                message: "internal error during generation (see the server log)".into(),
                bad_request: false,
            });
        }
        metrics.generating.store(0, Ordering::SeqCst);
    }
}

fn serve_one(engine: &mut Engine, job: Job, metrics: &Metrics) {
    let Job {
        prompt,
        opts,
        stop,
        logprobs,
        events,
    } = job;
    // Chat clients resend the whole conversation: keep what the cache
    // already holds of it.
    let kept = engine.reuse_prefix(&prompt);
    metrics
        .reused_tokens
        .fetch_add(kept as u64, Ordering::SeqCst);

    // Log-probabilities need the logits of every token: a probe (which
    // also takes the step-by-step path) only when they are asked for.
    let last_logits: Arc<Mutex<Vec<f32>>> = Arc::default();
    if logprobs.is_some() {
        let sink = last_logits.clone();
        engine.set_logits_probe(Some(Box::new(move |l: &[f32]| {
            let mut v = sink.lock().unwrap_or_else(|e| e.into_inner());
            v.clear();
            v.extend_from_slice(l);
        })));
    }
    let model = engine.model.clone();
    let tok = &model.tokenizer;
    let mut matcher = StopMatcher::new(stop);
    let mut stopped_by_string = false;
    let mut client_gone = false;
    // Token log-probabilities wait with their text until it is released.
    let mut waiting: Vec<(usize, TokenLogprob)> = Vec::new();
    let mut received = 0usize;
    let mut released = 0usize;
    let mut release = |text: String, waiting: &mut Vec<(usize, TokenLogprob)>| -> bool {
        released += text.len();
        let n = waiting
            .iter()
            .take_while(|(end, _)| *end <= released)
            .count();
        let lp: Vec<TokenLogprob> = waiting.drain(..n).map(|(_, t)| t).collect();
        if text.is_empty() && lp.is_empty() {
            return true;
        }
        events.send(Event::Text { text, logprobs: lp }).is_ok()
    };
    let result = engine.generate(&prompt[kept..], &opts, &mut |id, piece| {
        if events.is_closed() {
            client_gone = true;
            return false;
        }
        received += piece.len();
        if let Some(k) = logprobs {
            let l = last_logits.lock().unwrap_or_else(|e| e.into_inner());
            waiting.push((received, token_logprob(tok, &l, id, k)));
        }
        let r = matcher.push(piece);
        if r.stopped {
            stopped_by_string = true;
            // The tokens that made the stop string are not part of the
            // output; their log-probabilities go with them.
            release(r.text, &mut waiting);
            waiting.clear();
            return false;
        }
        if !release(r.text, &mut waiting) {
            client_gone = true;
            return false;
        }
        true
    });
    engine.set_logits_probe(None);
    let stats = match result {
        Ok(s) => s,
        Err(e) => {
            metrics.failed.fetch_add(1, Ordering::SeqCst);
            let bad_request = matches!(
                e,
                EngineError::InvalidConstraint { .. }
                    | EngineError::ContextOverflow { .. }
                    | EngineError::BadToken { .. }
                    | EngineError::Sampling(_)
                    | EngineError::InvalidOption(_)
            );
            // A failed generation may have left the sequence half-fed.
            engine.reset();
            let _ = events.send(Event::Error {
                message: e.to_string(),
                bad_request,
            });
            return;
        }
    };
    if !stopped_by_string && !client_gone {
        let rest = matcher.finish();
        release(rest, &mut waiting);
    }
    *metrics.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(LastGeneration {
        stop_reason: stats.stop_reason,
        prompt_tokens: prompt.len() as u32,
        reused_tokens: kept as u32,
        generated_tokens: stats.generated_tokens,
        max_tokens: opts.max_tokens,
        stop_sequence: stopped_by_string,
        client_disconnected: client_gone,
    });
    if client_gone {
        metrics.cancelled.fetch_add(1, Ordering::SeqCst);
        return;
    }
    metrics.completed.fetch_add(1, Ordering::SeqCst);
    let finish_reason = match stats.stop_reason {
        StopReason::MaxTokens | StopReason::ContextFull => "length",
        _ => "stop",
    };
    let _ = events.send(Event::Done {
        finish_reason,
        prompt_tokens: prompt.len() as u32,
        completion_tokens: stats.generated_tokens,
    });
}

/// log-softmax of `logits` at `id`, and the `k` most likely tokens.
fn token_logprob(
    tok: &akunu_core::tokenizer::Tokenizer,
    logits: &[f32],
    id: u32,
    k: usize,
) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&x| ((x - max) as f64).exp()).sum();
    let lse = max + sum.ln() as f32;
    let lp = |i: u32| {
        logits
            .get(i as usize)
            .map_or(f32::NEG_INFINITY, |&x| x - lse)
    };
    let mut top = Vec::new();
    if k > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let k = k.min(idx.len());
        idx.select_nth_unstable_by(k - 1, |&a, &b| {
            logits[b as usize].total_cmp(&logits[a as usize])
        });
        idx.truncate(k);
        idx.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        top = idx
            .into_iter()
            .map(|i| (tok.decode(&[i]), lp(i), tok.token_bytes(i)))
            .collect();
    }
    TokenLogprob {
        token: tok.decode(&[id]),
        logprob: lp(id),
        bytes: tok.token_bytes(id),
        top,
    }
}
