//! Grammar constraints through `llguidance`: a JSON Schema, a Lark grammar
//! or a regular expression becomes a matcher that, after each token, says
//! which tokens may come next (a bitmask with one bit per vocabulary id).
//!
//! llguidance sees the vocabulary through [`AkunuTokEnv`], built on akunu's
//! own tokenizer: every id's bytes (special tokens as `0xFF` + their text,
//! which no text grammar can match), and the end-of-generation ids as its
//! EOS set.

use crate::builder::{RECENT_CAPACITY, sample_params};
use crate::decode::{
    Constraint, DecodePath, Engine, EngineError, GenerateOptions, GrammarStats, Stats, StopReason,
    rate,
};
use crate::model::Model;
use crate::table::StepInfo;
use crate::tokenizer::TokenType;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use std::sync::Arc;
use std::time::Instant;
use toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

/// llguidance's view of akunu's tokenizer.
pub struct AkunuTokEnv {
    trie: TokTrie,
    model: Arc<Model>,
}

impl AkunuTokEnv {
    /// The vocabulary is the model's (`n_vocab` ids; ids the tokenizer does
    /// not know have no bytes and are never allowed).
    pub fn new(model: Arc<Model>) -> Result<AkunuTokEnv, EngineError> {
        let tok = &model.tokenizer;
        let n_vocab = model.config.n_vocab;
        let eos = tok.eog_ids();
        let Some(&first_eos) = eos.first() else {
            return Err(EngineError::Unsupported(
                "grammar-constrained decoding needs a model with an end-of-generation token".into(),
            ));
        };
        let words: Vec<Vec<u8>> = (0..n_vocab)
            .map(|id| match tok.token_type(id) {
                Some(TokenType::Control | TokenType::UserDefined | TokenType::Unknown) => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tok.token_piece(id).unwrap_or("").as_bytes());
                    w
                }
                Some(_) => tok.token_bytes(id),
                None => Vec::new(),
            })
            .collect();
        let mut info = TokRxInfo::new(n_vocab, first_eos);
        info.tok_bos = tok.bos();
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        Ok(AkunuTokEnv { trie, model })
    }
}

impl TokenizerEnv for AkunuTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        // Forced text is tokenized as the model would tokenize it (so that
        // forced tokens are canonical); bytes that are not UTF-8 fall back
        // to the trie's greedy split.
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.model
                .tokenizer
                .encode_continuation(text)
                .unwrap_or_default()
        })
    }
}

/// Compiles constraints for one model (the token trie and llguidance's
/// per-vocabulary tables are built once and shared).
pub struct GrammarCompiler {
    factory: ParserFactory,
}

impl GrammarCompiler {
    pub fn new(model: Arc<Model>) -> Result<GrammarCompiler, EngineError> {
        let env: TokEnv = Arc::new(AkunuTokEnv::new(model)?);
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| {
            EngineError::Unsupported(format!("llguidance rejected the vocabulary: {e}"))
        })?;
        factory.quiet();
        Ok(GrammarCompiler { factory })
    }

    /// A fresh matcher for `c`; an invalid schema, grammar or expression is
    /// an [`EngineError::InvalidConstraint`] naming what is wrong.
    pub fn matcher(&self, c: &Constraint) -> Result<Matcher, EngineError> {
        let invalid =
            |kind: &'static str, message: String| EngineError::InvalidConstraint { kind, message };
        let (kind, grammar) = match c {
            Constraint::JsonSchema(s) => {
                let v: serde_json::Value = serde_json::from_str(s)
                    .map_err(|e| invalid("JSON schema", format!("not valid JSON: {e}")))?;
                (
                    "JSON schema",
                    TopLevelGrammar::from_json_schema(bounded_whitespace(v)),
                )
            }
            Constraint::JsonObject => (
                "JSON schema",
                TopLevelGrammar::from_json_schema(bounded_whitespace(
                    serde_json::json!({"type": "object"}),
                )),
            ),
            Constraint::Lark(g) => ("Lark grammar", TopLevelGrammar::from_lark(g.clone())),
            Constraint::Regex(r) => ("regular expression", TopLevelGrammar::from_regex(r)),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| invalid(kind, format!("{e:#}")))?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(invalid(kind, e));
        }
        Ok(m)
    }
}

/// Whitespace allowed between two JSON tokens unless the schema says
/// otherwise: flexible (any JSON whitespace, so the model can indent as it
/// likes), but at most this many characters, so that a sampled run of
/// newlines cannot fill the whole token budget.
pub const JSON_WHITESPACE: &str = r"[\x20\x0A\x0D\x09]{1,12}";

/// Adds `"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}` to a schema
/// object that has no `x-guidance` options of its own (those win).
fn bounded_whitespace(mut v: serde_json::Value) -> serde_json::Value {
    if let Some(o) = v.as_object_mut()
        && !o.contains_key("x-guidance")
    {
        o.insert(
            "x-guidance".into(),
            serde_json::json!({ "whitespace_pattern": JSON_WHITESPACE }),
        );
    }
    v
}

/// Copies a mask into `n_vocab.div_ceil(32)` little-endian u32 words.
pub fn mask_words(mask: &SimpleVob, n_vocab: u32, out: &mut Vec<u8>) {
    let n = n_vocab.div_ceil(32) as usize;
    out.clear();
    let words = mask.as_slice();
    for i in 0..n {
        let mut w = words.get(i).copied().unwrap_or(0);
        if i == n - 1 && !n_vocab.is_multiple_of(32) {
            w &= (1u32 << (n_vocab % 32)) - 1;
        }
        out.extend_from_slice(&w.to_le_bytes());
    }
}

/// Whether the mask allows nothing but tokens from `eos` (the grammar is
/// complete: the only continuation is to end).
pub fn only_eos(mask: &SimpleVob, eos: &[u32]) -> bool {
    let mut m = mask.clone();
    for &e in eos {
        if (e as usize) < m.len() {
            m.disallow_token(e);
        }
    }
    m.is_zero()
}

/// A computed mask and the time it took.
type TimedMask = (Result<SimpleVob, String>, std::time::Duration);

fn timed_mask(m: &mut Matcher) -> TimedMask {
    let t = Instant::now();
    // A stopped matcher allows only the end.
    let mask = m.compute_mask_or_eos().map_err(|e| format!("{e:#}"));
    (mask, t.elapsed())
}

impl Engine {
    /// A matcher for `c`, compiling it now: errors in the constraint come
    /// back before anything is generated.
    pub fn compile_constraint(&mut self, c: &Constraint) -> Result<Matcher, EngineError> {
        if self.grammar_compiler.is_none() {
            self.grammar_compiler = Some(Arc::new(GrammarCompiler::new(self.model.clone())?));
        }
        self.grammar_compiler
            .as_ref()
            .expect("just built")
            .matcher(c)
    }

    /// The grammar path. Per token: the forward pass of the fed tokens (the
    /// last chosen one plus any the grammar forces) runs on this thread
    /// while a scoped thread computes the mask of the next token (it
    /// depends only on tokens already chosen); then the mask is written and
    /// the tail (`GrammarBitmask`, the sampler when sampling, `Argmax`)
    /// chooses the token on the backend.
    pub(crate) fn generate_grammar(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_token: &mut dyn FnMut(u32, &str) -> bool,
    ) -> Result<Stats, EngineError> {
        let Some(constraint) = opts.constraint.as_ref() else {
            return Err(EngineError::InvalidOption(
                "the grammar path needs a constraint".into(),
            ));
        };
        let mut matcher = self.compile_constraint(constraint)?;
        let sampled = !opts.sampling.is_greedy();
        if sampled {
            opts.sampling.validate()?;
            let p = sample_params(&opts.sampling, self.model.config.n_vocab);
            let bytes = bytemuck::bytes_of(&p);
            let at = self.grammar.sampler_cmd;
            self.grammar.sampled_tail.commands[at].params[..bytes.len()].copy_from_slice(bytes);
        }
        let model = self.model.clone();
        let tok = &model.tokenizer;
        let n_vocab = model.config.n_vocab;
        let eos = tok.eog_ids();
        let penalised = sampled && opts.sampling.repeat_penalty != 1.0;

        // Prefill, with the first mask computed alongside.
        let t0 = Instant::now();
        let (pre, mut mask) = std::thread::scope(|s| {
            let h = s.spawn(|| timed_mask(&mut matcher));
            let pre = self.prefill(prompt, false);
            (pre, h.join())
        });
        pre?;
        let prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
        let n_prompt = prompt.len() as u32;
        let mut stats = Stats::after_prefill(
            n_prompt,
            prefill_ms,
            self.pos,
            DecodePath::Grammar,
            sampled.then_some(opts.sampling.seed),
        );
        if opts.max_tokens == 0 {
            return Ok(stats);
        }

        let mut stream = tok.stream();
        let mut mask_times: Vec<f64> = Vec::new();
        let mut stall = 0f64;
        let mut advance = 0f64;
        let mut forced = 0u32;
        let mut words = Vec::new();
        let conveyor = self.scratch.token_ids;
        let t1 = Instant::now();
        loop {
            // The logits of the next token are in the logits buffer, and
            // `mask` is its mask.
            let (m, took) = match mask {
                Ok(m) => m,
                Err(_) => {
                    return Err(EngineError::Grammar("the mask thread panicked".into()));
                }
            };
            mask_times.push(took.as_secs_f64() * 1e6);
            let m = m.map_err(EngineError::Grammar)?;
            if matcher.is_stopped() || only_eos(&m, &eos) {
                stats.stop_reason = StopReason::GrammarComplete;
                break;
            }
            if m.is_zero() {
                return Err(EngineError::Grammar(
                    "the grammar allows no token here".into(),
                ));
            }
            mask_words(&m, n_vocab, &mut words);
            self.backend.write(self.mask_buf, 0, &words)?;
            if penalised {
                let h = &self.history;
                let window = h[h.len().saturating_sub(RECENT_CAPACITY as usize)..].to_vec();
                self.write_recent(self.pos, &window)?;
            }
            // The tail runs as the last step's row: `kv_len` (the sampler's
            // noise position) is the position of the token it chooses.
            let step = StepInfo {
                pos: self.pos - 1,
                tok: 0,
                rows: 1,
            };
            let tail = if sampled {
                &self.grammar.sampled_tail
            } else {
                &self.grammar.greedy_tail
            };
            self.backend.replay(tail, step, 1, None)?;
            let id = self.backend.read_u32(conveyor, 1)?;
            if let Some(p) = self.probe.as_mut() {
                let l = self
                    .backend
                    .read_f32s(self.scratch.logits, 0, n_vocab as usize)?;
                p(&l);
            }
            if !m.is_allowed(id) {
                return Err(EngineError::Grammar(format!(
                    "the backend chose token {id}, which the mask forbids"
                )));
            }
            if tok.is_eog(id) || opts.stop_tokens.contains(&id) {
                // Allowed by the grammar: it is complete, and the model ends.
                stats.stop_reason = StopReason::Eos;
                break;
            }
            let ta = Instant::now();
            matcher
                .consume_token(id)
                .map_err(|e| EngineError::Grammar(format!("{e:#}")))?;
            // Tokens the grammar forces next, fed with `id` in one step.
            let room = (self.capacity - self.pos) as usize;
            let left = (opts.max_tokens - stats.generated_tokens - 1) as usize;
            let mut ff = if matcher.is_stopped() {
                Vec::new()
            } else {
                matcher.compute_ff_tokens()
            };
            ff.truncate(
                left.min(room.saturating_sub(1))
                    .min(self.prefill_chunk as usize - 1),
            );
            if !ff.is_empty() {
                matcher
                    .consume_tokens(&ff)
                    .map_err(|e| EngineError::Grammar(format!("{e:#}")))?;
            }
            advance += ta.elapsed().as_secs_f64() * 1e6;

            let mut going = true;
            for (i, &t) in std::iter::once(&id).chain(ff.iter()).enumerate() {
                stats.generated_tokens += 1;
                forced += u32::from(i > 0);
                self.history.push(t);
                self.pending.push(t);
                let text = stream.push(t).unwrap_or_default();
                if !on_token(t, &text) {
                    stats.stop_reason = StopReason::Cancelled;
                    going = false;
                    break;
                }
                if stats.generated_tokens >= opts.max_tokens {
                    stats.stop_reason = StopReason::MaxTokens;
                    going = false;
                    break;
                }
            }
            if !going {
                break;
            }
            if matcher.is_stopped() {
                stats.stop_reason = StopReason::GrammarComplete;
                break;
            }
            let n = self.pending.len() as u32;
            if self.pos + n > self.capacity {
                stats.stop_reason = StopReason::ContextFull;
                break;
            }
            let bytes: Vec<u8> = self.pending.iter().flat_map(|t| t.to_le_bytes()).collect();
            self.backend.write(conveyor, 0, &bytes)?;
            let step = StepInfo {
                pos: self.pos,
                tok: 0,
                rows: n,
            };
            // The forward pass here, the next mask there.
            let (backend, forward) = (&mut self.backend, &self.grammar.forward);
            let (ran, next) = std::thread::scope(|s| {
                let h = s.spawn(|| timed_mask(&mut matcher));
                let ran = backend.replay(forward, step, 1, None);
                let tw = Instant::now();
                let next = h.join();
                stall += tw.elapsed().as_secs_f64() * 1e6;
                (ran, next)
            });
            ran?;
            mask = next;
            self.pos += n;
            self.pending.clear();
            stats.decode_steps += 1;
        }
        drop(stream);
        stats.decode_ms = t1.elapsed().as_secs_f64() * 1e3;
        // The first token costs this path a tail, not a forward pass: the
        // rate counts the tokens after it, like the other paths.
        stats.decode_tok_s = rate(stats.generated_tokens.saturating_sub(1), stats.decode_ms);
        let k = mask_times.len().max(1) as f64;
        let mean = mask_times.iter().sum::<f64>() / k;
        mask_times.sort_by(f64::total_cmp);
        stats.grammar = Some(GrammarStats {
            masks: mask_times.len() as u32,
            mask_us_mean: mean,
            mask_us_median: mask_times.get(mask_times.len() / 2).copied().unwrap_or(0.0),
            mask_us_max: mask_times.last().copied().unwrap_or(0.0),
            stall_us_mean: stall / k,
            advance_us_mean: advance / k,
            forced_tokens: forced,
        });
        stats.position = self.pos;
        Ok(stats)
    }
}
