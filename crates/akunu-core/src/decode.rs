//! The engine and its decode loop: prefill, first token, chain decode, stop
//! conditions, statistics and multi-turn continuation.

use crate::backend::{Backend, BackendError, BufferRead, ChainRequest};
use crate::builder::{
    BuildInputs, GrammarTables, KvBuffers, MissingWeight, RECENT_BYTES, RECENT_CAPACITY, Scratch,
    WeightBuf, build_dispatch_table, build_grammar_tables, build_sampled_table, build_verify_table,
    sample_params,
};
use crate::grammar::GrammarCompiler;
use crate::model::Model;
use crate::sampling::SamplingConfig;
use crate::speculative::{MAX_DRAFT, NgramPredictor, SpecOptions};
use crate::table::{BufferId, DispatchTable, StepInfo};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// Default KV-cache budget when `--ctx` is not given.
pub const DEFAULT_KV_BUDGET_BYTES: u64 = 1 << 30;
/// Default rows per prefill step.
pub const DEFAULT_PREFILL_CHUNK: u32 = 512;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(
        "the prompt is empty: nothing to evaluate (the model adds no BOS token, so give at least one token of text)"
    )]
    EmptyPrompt,
    #[error(
        "the prompt needs {needed} positions but the context holds {capacity} ({used} already used); shorten the prompt or raise --ctx"
    )]
    ContextOverflow {
        needed: u64,
        capacity: u32,
        used: u32,
    },
    #[error("invalid option: {0}")]
    InvalidOption(String),
    #[error("token id {id} is outside the vocabulary ({n_vocab} tokens)")]
    BadToken { id: u32, n_vocab: u32 },
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Build(#[from] MissingWeight),
    #[error("invalid sampling configuration: {0}")]
    Sampling(#[from] crate::sampling::SamplingError),
    #[error("{0}")]
    Unsupported(String),
    /// A constraint that does not compile: `kind` names what was given
    /// ("JSON schema", "Lark grammar", "regular expression").
    #[error("invalid {kind}: {message}")]
    InvalidConstraint { kind: &'static str, message: String },
    /// The grammar matcher failed during generation.
    #[error("grammar matcher: {0}")]
    Grammar(String),
}

#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// KV-cache capacity in positions (None: the model's context length,
    /// capped to `DEFAULT_KV_BUDGET_BYTES`).
    pub ctx: Option<u32>,
    /// Tokens per chain-decode submission.
    pub chunk: u32,
    /// Rows per prefill step.
    pub prefill_chunk: u32,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            ctx: None,
            chunk: 16,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct GenerateOptions {
    /// Tokens to generate; 0 evaluates the prompt only.
    pub max_tokens: u32,
    /// Keep generating past end-of-generation tokens.
    pub ignore_eos: bool,
    /// Temperature, top-k, top-p, min-p, repetition penalty and seed;
    /// temperature 0 (the default) is greedy.
    pub sampling: SamplingConfig,
    /// Use n-gram speculative decoding (greedy or sampled: the output is the
    /// same as without it, token for token).
    pub speculative: bool,
    /// The n-gram range and draft length of speculative decoding.
    pub spec: SpecOptions,
    /// Constrain the output to a grammar.
    pub constraint: Option<Constraint>,
    /// Take this path instead of the one `decode_path` picks (tests and
    /// benchmarks: e.g. temperature 0 through the sampled table).
    pub force_path: Option<DecodePath>,
    /// More token ids that end generation like EOS (not emitted), on top of
    /// the model's end-of-generation tokens; they apply even with
    /// `ignore_eos`.
    pub stop_tokens: Vec<u32>,
}

/// An output constraint for grammar-constrained decoding.
#[derive(Clone, Debug, PartialEq)]
pub enum Constraint {
    JsonSchema(String),
    Lark(String),
    Regex(String),
    /// Any JSON object.
    JsonObject,
}

/// The four decode paths of the decode loop.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DecodePath {
    /// Chain decode with the argmax on the device.
    Greedy,
    /// Chain decode with Gumbel-max sampling on the device.
    Sampled,
    /// N-gram drafts verified in batches (greedy, or sampled when the
    /// temperature is above 0).
    Speculative,
    /// A grammar mask per token.
    Grammar,
}

impl GenerateOptions {
    /// The path the decode loop takes: a grammar wins, then speculation
    /// (greedy or sampled), then sampling (temperature > 0), else the greedy
    /// chain.
    pub fn decode_path(&self) -> DecodePath {
        if let Some(p) = self.force_path {
            p
        } else if self.constraint.is_some() {
            DecodePath::Grammar
        } else if self.speculative {
            DecodePath::Speculative
        } else if !self.sampling.is_greedy() {
            DecodePath::Sampled
        } else {
            DecodePath::Greedy
        }
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model produced an end-of-generation token.
    Eos,
    /// `max_tokens` tokens were generated.
    MaxTokens,
    /// The callback returned false.
    Cancelled,
    /// The KV cache is full.
    ContextFull,
    /// `max_tokens` was 0: only the prompt was evaluated.
    PromptOnly,
    /// The grammar is complete: it allows no token but end of generation.
    GrammarComplete,
}

/// What the grammar path spent on the host, per token.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GrammarStats {
    /// Masks computed (one per sampled or argmax token).
    pub masks: u32,
    /// Mask computation time (overlapped with the forward pass), microseconds.
    pub mask_us_mean: f64,
    pub mask_us_median: f64,
    pub mask_us_max: f64,
    /// Time the decode loop waited for a mask after its forward pass was
    /// done (the stall the overlap leaves), mean per mask, microseconds.
    pub stall_us_mean: f64,
    /// Host work between the token's choice and the next forward pass
    /// (advancing the matcher, finding forced tokens), mean per mask, µs.
    pub advance_us_mean: f64,
    /// Tokens the grammar forced (fed in batches, no mask or sampling).
    pub forced_tokens: u32,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Stats {
    pub prompt_tokens: u32,
    pub prefill_ms: f64,
    pub prefill_tok_s: f64,
    pub generated_tokens: u32,
    /// Time of the decode steps (every generated token after the first,
    /// which prefill produces).
    pub decode_ms: f64,
    pub decode_tok_s: f64,
    pub decode_steps: u32,
    pub stop_reason: StopReason,
    /// Position (tokens in the KV cache) after this call.
    pub position: u32,
    /// The decode path taken.
    pub path: DecodePath,
    /// The sampling seed (sampled path only): rerun with it to reproduce.
    pub seed: Option<u64>,
    /// Tokens the device computed past the end of generation (a stop inside
    /// a chain submission), where the backend reports it.
    pub computed_after_end: Option<u32>,
    /// Median and largest time from a token's production on the device to
    /// its callback, in microseconds, where the backend measures it.
    pub delivery_us: Option<(f32, f32)>,
    /// Speculative decode figures (speculative path only).
    pub speculative: Option<SpecStats>,
    /// Grammar path only: mask and matcher timings.
    pub grammar: Option<GrammarStats>,
}

impl Stats {
    /// The statistics of a `generate` call right after its prefill.
    pub(crate) fn after_prefill(
        prompt_tokens: u32,
        prefill_ms: f64,
        position: u32,
        path: DecodePath,
        seed: Option<u64>,
    ) -> Stats {
        Stats {
            prompt_tokens,
            prefill_ms,
            prefill_tok_s: rate(prompt_tokens, prefill_ms),
            generated_tokens: 0,
            decode_ms: 0.0,
            decode_tok_s: 0.0,
            decode_steps: 0,
            stop_reason: StopReason::PromptOnly,
            position,
            path,
            seed,
            computed_after_end: None,
            delivery_us: None,
            speculative: None,
            grammar: None,
        }
    }
}

/// What speculative decoding did in one `generate` call.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SpecStats {
    /// Tokens drafted by the n-gram predictor and sent for verification.
    pub drafted: u32,
    /// Drafted tokens the model confirmed.
    pub accepted: u32,
    /// `accepted / drafted` (0 when nothing was drafted).
    pub acceptance_rate: f64,
    /// Verification passes (one replay of `1 + draft` rows each).
    pub verify_passes: u32,
    /// Tokens emitted per verification pass (accepted drafts plus the
    /// model's own next token).
    pub tokens_per_pass: f64,
    /// Tokens emitted by verification passes.
    pub verified_tokens: u32,
    /// Tokens decoded by plain one-row steps (no draft, or speculation
    /// paused after misses).
    pub plain_steps: u32,
}

/// One model on one backend with its KV cache: the unit that generates.
pub struct Engine {
    pub model: Arc<Model>,
    pub(crate) backend: Box<dyn Backend>,
    table: DispatchTable,
    /// The greedy table plus the in-chain sampling command.
    sampled: DispatchTable,
    /// Index of the sampling command in `sampled`.
    sampler_cmd: usize,
    /// Speculative verification: the greedy and the sampled table with
    /// their logits, sampling and argmax on every row.
    verify: DispatchTable,
    verify_sampled: DispatchTable,
    verify_sampler_cmd: usize,
    /// Logits of every row of a verification step.
    verify_logits: BufferId,
    /// Most rows of a verification step (1 + the longest draft).
    verify_rows: u32,
    /// The grammar path's forward table and mask-applying tails.
    pub(crate) grammar: GrammarTables,
    /// The grammar mask: `ceil(n_vocab / 32)` u32 words.
    pub(crate) mask_buf: BufferId,
    /// Built on the first constrained generation, then reused.
    pub(crate) grammar_compiler: Option<Arc<GrammarCompiler>>,
    pub(crate) scratch: Scratch,
    pub(crate) capacity: u32,
    chunk: u32,
    pub(crate) prefill_chunk: u32,
    /// Tokens whose K and V are in the cache.
    pub(crate) pos: u32,
    /// Generated tokens emitted but not yet fed to the model (at most one,
    /// except after the grammar path forced several at the end).
    pub(crate) pending: Vec<u32>,
    /// Every token of the sequence so far (fed ones and the pending ones).
    pub(crate) history: Vec<u32>,
    /// Receives the logits behind every generated token (tests, tools).
    pub(crate) probe: Option<LogitsProbe>,
    /// Decode through `Backend::decode_chain` (true) or step by step with
    /// a read-back per token (profiling, tests).
    chain_decode: bool,
}

/// A callback given the logits from which each generated token was chosen.
pub type LogitsProbe = Box<dyn FnMut(&[f32]) + Send>;

impl Engine {
    pub fn new(
        model: Arc<Model>,
        mut backend: Box<dyn Backend>,
        opts: &EngineOptions,
    ) -> Result<Engine, EngineError> {
        let cfg = model.config.clone();
        if opts.chunk == 0 || opts.chunk > 4096 {
            return Err(EngineError::InvalidOption(format!(
                "chunk must be in 1..=4096, got {}",
                opts.chunk
            )));
        }
        if opts.prefill_chunk == 0 || opts.prefill_chunk > 8192 {
            return Err(EngineError::InvalidOption(format!(
                "prefill chunk must be in 1..=8192, got {}",
                opts.prefill_chunk
            )));
        }
        let kv_type = backend.kv_type();
        let kv_bytes_per_pos = 2 * cfg.n_layers as u64 * cfg.kv_dim() as u64 * kv_type.bytes();
        let capacity = match opts.ctx {
            Some(0) => return Err(EngineError::InvalidOption("ctx must be at least 1".into())),
            Some(c) => c,
            None => cfg
                .train_ctx
                .min((DEFAULT_KV_BUDGET_BYTES / kv_bytes_per_pos).max(256) as u32),
        };
        if capacity as u64 * kv_bytes_per_pos > 256 << 30 {
            return Err(EngineError::InvalidOption(format!(
                "ctx {capacity} needs {} GiB of KV cache",
                (capacity as u64 * kv_bytes_per_pos) >> 30
            )));
        }

        let mut weights = HashMap::new();
        for (name, _) in cfg.expected_tensors() {
            let t = model
                .file
                .tensor(&name)
                .ok_or_else(|| MissingWeight(name.clone()))?;
            let buf = backend.weight(&model.file, t)?;
            weights.insert(
                name,
                WeightBuf {
                    buf,
                    dtype: t.dtype,
                },
            );
        }

        let rows = opts.prefill_chunk as u64;
        let f = 4u64;
        // One slot per position a chain can reach, so that a chain never
        // wraps the conveyor (its sampler reads the chain's earlier tokens
        // from it), plus the slot the last step writes.
        let conveyor = (capacity.max(opts.chunk).max(opts.prefill_chunk) as u64 + 1) * 4;
        let scratch = Scratch {
            token_ids: backend.alloc(conveyor, "token ids")?,
            h: backend.alloc(rows * cfg.dim as u64 * f, "residual")?,
            xn: backend.alloc(rows * cfg.dim as u64 * f, "normed activations")?,
            qkv: backend.alloc(rows * cfg.qkv_dim() as u64 * f, "qkv")?,
            attn: backend.alloc(rows * cfg.q_dim() as u64 * f, "attention output")?,
            delta: backend.alloc(rows * cfg.dim as u64 * f, "projection output")?,
            gu: backend.alloc(rows * 2 * cfg.ffn_dim as u64 * f, "gate/up")?,
            logits: backend.alloc(cfg.n_vocab as u64 * f, "logits")?,
            recent: backend.alloc(RECENT_BYTES, "recent tokens")?,
        };
        let slab = capacity as u64 * cfg.kv_dim() as u64 * kv_type.bytes();
        let mut kv = KvBuffers {
            k: vec![],
            v: vec![],
            capacity,
            kv_type,
        };
        for l in 0..cfg.n_layers {
            kv.k.push(backend.alloc(slab, &format!("K cache layer {l}"))?);
            kv.v.push(backend.alloc(slab, &format!("V cache layer {l}"))?);
        }
        let inputs = BuildInputs {
            cfg: &cfg,
            weights: &weights,
            scratch,
            kv: &kv,
            max_rows: opts.prefill_chunk,
        };
        let table = build_dispatch_table(&inputs)?;
        let (sampled, sampler_cmd) = build_sampled_table(&inputs)?;
        let mask_buf = backend.alloc(cfg.n_vocab.div_ceil(32) as u64 * 4, "grammar mask")?;
        let grammar = build_grammar_tables(&inputs, mask_buf)?;
        backend.validate(&table)?;
        backend.validate(&sampled)?;
        let verify_rows = (MAX_DRAFT + 1).min(opts.prefill_chunk);
        let verify_logits = backend.alloc(
            verify_rows as u64 * cfg.n_vocab as u64 * f,
            "verification logits",
        )?;
        let (verify, _) = build_verify_table(&inputs, verify_logits, verify_rows, false)?;
        let (verify_sampled, verify_sampler_cmd) =
            build_verify_table(&inputs, verify_logits, verify_rows, true)?;
        let verify_sampler_cmd = verify_sampler_cmd.expect("the sampled table has a sampler");
        backend.validate(&verify)?;
        backend.validate(&verify_sampled)?;
        // Drafts only as long as the backend verifies exactly (every row as
        // a one-row step would compute it): that is what makes speculation
        // lossless. One row left means no drafting at all.
        let verify_rows = verify_rows
            .min(backend.exact_rows(&verify))
            .min(backend.exact_rows(&verify_sampled))
            .max(1);
        backend.validate(&grammar.forward)?;
        backend.validate(&grammar.greedy_tail)?;
        backend.validate(&grammar.sampled_tail)?;
        Ok(Engine {
            model,
            backend,
            table,
            sampled,
            sampler_cmd,
            verify,
            verify_sampled,
            verify_sampler_cmd,
            verify_logits,
            verify_rows,
            grammar,
            mask_buf,
            grammar_compiler: None,
            scratch,
            capacity,
            chunk: opts.chunk,
            prefill_chunk: opts.prefill_chunk,
            pos: 0,
            pending: Vec::new(),
            history: Vec::new(),
            probe: None,
            chain_decode: true,
        })
    }

    /// Installs (or removes) a callback that sees the logits of every
    /// generated token. It costs a logits read-back per token.
    pub fn set_logits_probe(&mut self, probe: Option<LogitsProbe>) {
        self.probe = probe;
    }

    /// Chain decode through the backend (the default), or step by step
    /// with a read-back after every token (what per-command profiling needs:
    /// device backends cannot time commands inside a captured chain).
    pub fn set_chain_decode(&mut self, on: bool) {
        self.chain_decode = on;
    }

    /// Turns the backend's per-command timing on or off; false if the
    /// backend cannot time commands.
    pub fn set_profiling(&mut self, on: bool) -> bool {
        self.backend.set_profiling(on)
    }

    /// Kernel launches per decode step of the greedy table.
    pub fn launches_per_token(&self) -> usize {
        self.backend.launches_per_step(&self.table)
    }

    /// Decode chains run so far as one kernel for the whole chain (the
    /// CUDA backend's persistent decode) rather than the table's commands.
    pub fn single_kernel_chains(&self) -> u64 {
        self.backend.single_kernel_chains()
    }

    /// The backend's measured memory bandwidth (bytes/s), if it measures one.
    pub fn measure_bandwidth(&mut self) -> Option<f64> {
        self.backend.measure_bandwidth()
    }

    pub fn table(&self) -> &DispatchTable {
        &self.table
    }

    /// Per-command times from a profiling backend (see `Backend::command_times`).
    pub fn command_times(&self) -> Option<Vec<(std::time::Duration, u64)>> {
        self.backend.command_times()
    }

    pub fn backend_description(&self) -> String {
        self.backend.describe()
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    pub fn chunk(&self) -> u32 {
        self.chunk
    }

    pub fn set_chunk(&mut self, chunk: u32) -> Result<(), EngineError> {
        let max = self.chunk.max(self.prefill_chunk);
        if chunk == 0 || chunk > max {
            return Err(EngineError::InvalidOption(format!(
                "chunk must be in 1..={max}"
            )));
        }
        self.chunk = chunk;
        Ok(())
    }

    /// Tokens in the KV cache.
    pub fn position(&self) -> u32 {
        self.pos
    }

    /// The whole sequence so far: prompts and generated tokens.
    pub fn history(&self) -> &[u32] {
        &self.history
    }

    /// Forgets the conversation (the cache is overwritten, not cleared).
    pub fn reset(&mut self) {
        self.pos = 0;
        self.pending.clear();
        self.history.clear();
    }

    /// Rolls the sequence back to its first `n` tokens. The K and V of the
    /// kept positions stay in the cache; positions past them are simply
    /// overwritten later (attention reads only `kv_len` entries). Kept
    /// tokens that were not fed yet stay pending.
    pub fn rewind(&mut self, n: usize) -> Result<(), EngineError> {
        if n > self.history.len() {
            return Err(EngineError::InvalidOption(format!(
                "cannot rewind to {n} tokens: the sequence has {}",
                self.history.len()
            )));
        }
        self.history.truncate(n);
        if n as u32 <= self.pos {
            self.pos = n as u32;
            self.pending.clear();
        } else {
            self.pending = self.history[self.pos as usize..].to_vec();
        }
        Ok(())
    }

    /// Prepares the engine for a request whose whole sequence is `tokens`:
    /// keeps the longest common prefix of the sequence so far and `tokens`
    /// (but at least one token of `tokens` left to feed, whose logits choose
    /// the next token) and returns how many tokens were kept; the caller
    /// then generates after `tokens[kept..]`.
    pub fn reuse_prefix(&mut self, tokens: &[u32]) -> usize {
        let common = self
            .history
            .iter()
            .zip(tokens)
            .take_while(|(a, b)| a == b)
            .count();
        let keep = common.min(tokens.len().saturating_sub(1));
        self.rewind(keep)
            .expect("the common prefix is within the sequence");
        keep
    }

    /// Feeds `tokens` (plus the pending generated token, if any) through the
    /// model in prefill steps; returns the argmax after the last one.
    pub(crate) fn prefill(
        &mut self,
        prompt: &[u32],
        sampled: bool,
    ) -> Result<Option<u32>, EngineError> {
        let n_vocab = self.model.config.n_vocab;
        if let Some(&id) = prompt.iter().find(|&&id| id >= n_vocab) {
            return Err(EngineError::BadToken { id, n_vocab });
        }
        let mut feed: Vec<u32> = self.pending.clone();
        feed.extend_from_slice(prompt);
        if feed.is_empty() {
            return Ok(None);
        }
        let needed = self.pos as u64 + feed.len() as u64;
        if needed > self.capacity as u64 {
            return Err(EngineError::ContextOverflow {
                needed,
                capacity: self.capacity,
                used: self.pos,
            });
        }
        let mut next = None;
        // The penalty window of the first sampled token covers the prompt:
        // the sequence so far is the history (pending token included) and
        // then the prompt.
        // (Built only for the sampled table; greedy prefill needs none.)
        let w = RECENT_CAPACITY as usize;
        let mut seq: Vec<u32> = Vec::new();
        if sampled {
            seq.extend_from_slice(&self.history[self.history.len().saturating_sub(w)..]);
            seq.extend_from_slice(prompt);
        }
        let before_prompt = seq.len() - if sampled { prompt.len() } else { 0 };
        let pend = self.pending.len();
        let mut fed = 0usize;
        for chunk in feed.chunks(self.prefill_chunk as usize) {
            let bytes: Vec<u8> = chunk.iter().flat_map(|t| t.to_le_bytes()).collect();
            self.backend.write(self.scratch.token_ids, 0, &bytes)?;
            fed += chunk.len();
            let step = StepInfo {
                pos: self.pos,
                tok: 0,
                rows: chunk.len() as u32,
            };
            if sampled {
                let end = before_prompt + fed - pend;
                self.write_recent(step.kv_len(), &seq[end.saturating_sub(w)..end])?;
            }
            let table = if sampled { &self.sampled } else { &self.table };
            self.backend.replay(table, step, 1, None)?;
            self.pos += chunk.len() as u32;
            next = Some(
                self.backend
                    .read_u32(self.scratch.token_ids, chunk.len() as u64)?,
            );
        }
        self.pending.clear();
        self.history.extend_from_slice(prompt);
        Ok(next)
    }

    /// Evaluates `prompt` (continuing the sequence) and returns the logits
    /// of its last position.
    pub fn eval_logits(&mut self, prompt: &[u32]) -> Result<Vec<f32>, EngineError> {
        if prompt.is_empty() && self.pending.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        self.prefill(prompt, false)?;
        Ok(self
            .backend
            .read_f32s(self.scratch.logits, 0, self.model.config.n_vocab as usize)?)
    }

    /// Generates after `prompt`, continuing from the previous call's state.
    /// `on_token(id, text)` receives every generated token with its text
    /// (UTF-8 complete characters only) and may return false to stop.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_token: &mut dyn FnMut(u32, &str) -> bool,
    ) -> Result<Stats, EngineError> {
        if prompt.is_empty() && self.pending.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let path = opts.decode_path();
        let sampled = match path {
            DecodePath::Greedy => false,
            DecodePath::Sampled => true,
            DecodePath::Speculative => {
                opts.spec.validate().map_err(EngineError::InvalidOption)?;
                !opts.sampling.is_greedy()
            }
            DecodePath::Grammar => return self.generate_grammar(prompt, opts, on_token),
        };
        if sampled {
            opts.sampling.validate()?;
            let p = sample_params(&opts.sampling, self.model.config.n_vocab);
            // The table is plain data: the new configuration is a rewrite of
            // one command's params (its `kv_len` is patched per step anyway).
            let bytes = bytemuck::bytes_of(&p);
            self.sampled.commands[self.sampler_cmd].params[..bytes.len()].copy_from_slice(bytes);
            self.verify_sampled.commands[self.verify_sampler_cmd].params[..bytes.len()]
                .copy_from_slice(bytes);
        }
        let model = self.model.clone();
        let tok = &model.tokenizer;
        let t0 = Instant::now();
        let first = self
            .prefill(prompt, sampled)?
            .expect("prefill of a non-empty feed yields a token");
        let prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
        let n_prompt = prompt.len() as u32;
        let mut stats = Stats::after_prefill(
            n_prompt,
            prefill_ms,
            self.pos,
            path,
            sampled.then_some(opts.sampling.seed),
        );
        if opts.max_tokens == 0 {
            return Ok(stats);
        }
        if let Some(probe) = self.probe.as_mut() {
            let l =
                self.backend
                    .read_f32s(self.scratch.logits, 0, model.config.n_vocab as usize)?;
            probe(&l);
        }

        let mut stream = tok.stream();
        let is_stop =
            |id: u32| (!opts.ignore_eos && tok.is_eog(id)) || opts.stop_tokens.contains(&id);
        // Emits one generated token; returns whether generation goes on.
        let mut emit =
            |id: u32, stats: &mut Stats, history: &mut Vec<u32>, pending: &mut Vec<u32>| -> bool {
                if is_stop(id) {
                    stats.stop_reason = StopReason::Eos;
                    return false;
                }
                stats.generated_tokens += 1;
                history.push(id);
                pending.clear();
                pending.push(id);
                let text = stream.push(id).unwrap_or_default();
                if !on_token(id, &text) {
                    stats.stop_reason = StopReason::Cancelled;
                    return false;
                }
                if stats.generated_tokens >= opts.max_tokens {
                    stats.stop_reason = StopReason::MaxTokens;
                    return false;
                }
                true
            };

        let mut going = emit(first, &mut stats, &mut self.history, &mut self.pending);
        let mut delivery: Vec<f32> = Vec::new();
        let mut spec = (path == DecodePath::Speculative)
            .then(|| SpecState::new(&opts.spec, &self.history, self.backend.slow_start_drafts()));
        if let Some(sp) = spec.as_mut()
            && self.verify_rows < 2
        {
            // The backend cannot verify a draft exactly: plain decode only.
            sp.pause_left = u32::MAX;
        }
        let t1 = Instant::now();
        while going {
            let Some(&input) = self.pending.last() else {
                break;
            };
            let room = self.capacity - self.pos;
            if room == 0 {
                stats.stop_reason = StopReason::ContextFull;
                break;
            }
            let want = opts.max_tokens - stats.generated_tokens;
            // Speculative: draft from the sequence so far and verify the
            // draft in one step of 1 + k rows, unless speculation is paused
            // or there is no draft; then plain one-row steps follow below.
            let mut plain_cap = None;
            if let Some(sp) = spec.as_mut() {
                sp.sync(&self.history);
                if sp.pause_left == 0 {
                    let k = sp
                        .k_cur
                        .min(want - 1)
                        .min(room - 1)
                        .min(self.verify_rows - 1);
                    sp.pred.propose(k as usize, &mut sp.draft);
                }
                if sp.pause_left > 0 {
                    plain_cap = Some(sp.pause_left);
                } else if sp.draft.is_empty() {
                    // Nothing to draft from: a short plain run, longer
                    // while drafts stay absent (each run is a submission
                    // with its own round trip, which a device notices).
                    plain_cap = Some(sp.idle_run);
                    sp.idle_run = (sp.idle_run * 2).min(self.backend.idle_run_max().max(1));
                } else {
                    let draft = std::mem::take(&mut sp.draft);
                    let k = draft.len() as u32;
                    let rows = k + 1;
                    let mut bytes = input.to_le_bytes().to_vec();
                    bytes.extend(draft.iter().flat_map(|t| t.to_le_bytes()));
                    self.backend.write(self.scratch.token_ids, 0, &bytes)?;
                    if sampled {
                        // Row r produces position pos + 1 + r with the window
                        // history + d1..dr (conveyor slots 1..=r), as the
                        // chain step at pos + r would.
                        let h = &self.history;
                        let from = h.len().saturating_sub(RECENT_CAPACITY as usize);
                        let window = h[from..].to_vec();
                        self.write_recent(self.pos + 1, &window)?;
                    }
                    let step = StepInfo {
                        pos: self.pos,
                        tok: 0,
                        rows,
                    };
                    let table = if sampled {
                        &self.verify_sampled
                    } else {
                        &self.verify
                    };
                    self.backend.verify_step(table, step)?;
                    let mut out = vec![0u8; rows as usize * 4];
                    self.backend.read(self.scratch.token_ids, 4, &mut out)?;
                    let outs: Vec<u32> = out
                        .chunks_exact(4)
                        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                        .collect();
                    // The longest prefix of the draft the model agrees with;
                    // the model's own token after it comes free.
                    let m = draft.iter().zip(&outs).take_while(|(d, o)| d == o).count();
                    sp.stats.verify_passes += 1;
                    sp.stats.drafted += k;
                    sp.stats.accepted += m as u32;
                    for (i, &id) in outs[..=m].iter().enumerate() {
                        if let Some(probe) = self.probe.as_mut() {
                            let nv = model.config.n_vocab as usize;
                            let l = self.backend.read_f32s(
                                self.verify_logits,
                                (i * nv * 4) as u64,
                                nv,
                            )?;
                            probe(&l);
                        }
                        // Row i fed the token at pos: its K and V stay.
                        self.pos += 1;
                        stats.decode_steps += 1;
                        sp.stats.verified_tokens += 1;
                        going = emit(id, &mut stats, &mut self.history, &mut self.pending);
                        if !going {
                            if stats.stop_reason == StopReason::Eos {
                                self.pending.clear();
                            }
                            break;
                        }
                    }
                    sp.adapt(k, m as u32, opts.spec.draft);
                    sp.draft = draft;
                    continue;
                }
            }
            // The chain path runs everything left in one call (the backend
            // splits it into chunks and keeps them in flight); the stepwise
            // path goes a chunk per call.
            let chained = self.probe.is_none() && self.chain_decode;
            let mut n = if chained {
                want.min(room)
            } else {
                self.chunk.min(want).min(room)
            };
            if let Some(c) = plain_cap {
                n = n.min(c);
            }
            let pos_before = self.pos;
            self.backend
                .write(self.scratch.token_ids, 0, &input.to_le_bytes())?;
            if sampled {
                // Step s of this chain produces the token at position
                // pos + 1 + s; the window so far is the history (which ends
                // with `input`).
                let h = &self.history;
                let from = h.len().saturating_sub(RECENT_CAPACITY as usize);
                let window = h[from..].to_vec();
                self.write_recent(self.pos + 1, &window)?;
            }
            let (conveyor, logits) = (self.scratch.token_ids, self.scratch.logits);
            let step = StepInfo {
                pos: self.pos,
                tok: 0,
                rows: 1,
            };
            let table = if sampled { &self.sampled } else { &self.table };
            if chained {
                // The fast path: the backend runs the whole chain, streaming
                // tokens to `emit` as they are produced.
                let mut stop_ids = if opts.ignore_eos {
                    Vec::new()
                } else {
                    tok.eog_ids()
                };
                stop_ids.extend_from_slice(&opts.stop_tokens);
                // A backend stops early on these at most; the sink decides.
                stop_ids.truncate(16);
                let req = ChainRequest {
                    conveyor,
                    stop_ids: &stop_ids,
                    steps: n,
                    chunk: self.chunk,
                    table_order: spec.is_some(),
                };
                let (history, pending) = (&mut self.history, &mut self.pending);
                let mut sink = |_s: u32, id: u32| -> bool {
                    going = emit(id, &mut stats, history, pending);
                    if !going && stats.stop_reason == StopReason::Eos {
                        // The EOS token is not part of the sequence.
                        pending.clear();
                    }
                    going
                };
                let report = self.backend.decode_chain(table, step, &req, &mut sink)?;
                self.pos += report.steps;
                if let Some(sp) = spec.as_mut() {
                    sp.plain_done(report.steps);
                }
                stats.decode_steps += report.steps;
                if let Some(w) = report.computed_after_end {
                    *stats.computed_after_end.get_or_insert(0) += w;
                }
                delivery.extend_from_slice(&report.delivery_us);
                if report.steps < n && going {
                    // The backend ended the chain early without the sink
                    // asking (a read-back failure): say so rather than loop.
                    return Err(EngineError::Backend(BackendError::Device(format!(
                        "chain stopped after {} of {n} steps",
                        report.steps
                    ))));
                }
                continue;
            }
            let (history, pending, probe) = (&mut self.history, &mut self.pending, &mut self.probe);
            let n_vocab = model.config.n_vocab as usize;
            let mut stepped = 0u32;
            let mut hook = |s: u32, bufs: &dyn BufferRead| -> bool {
                stepped = s + 1;
                if let Some(p) = probe.as_mut() {
                    match bufs.read_f32s(logits, 0, n_vocab) {
                        Ok(l) => p(&l),
                        Err(_) => return false,
                    }
                }
                match bufs.read_u32(conveyor, s as u64 + 1) {
                    Ok(id) => {
                        going = emit(id, &mut stats, history, pending);
                        if !going && stats.stop_reason == StopReason::Eos {
                            // The EOS token is not part of the sequence.
                            pending.clear();
                        }
                        going
                    }
                    Err(_) => {
                        going = false;
                        false
                    }
                }
            };
            let ran = self.backend.replay(table, step, n, Some(&mut hook))?;
            debug_assert_eq!(ran, stepped);
            self.pos += ran;
            stats.decode_steps += ran;
            if let Some(sp) = spec.as_mut() {
                sp.plain_done(ran);
            }
            debug_assert_eq!(self.pos, pos_before + ran);
        }
        if let Some(sp) = spec {
            stats.speculative = Some(sp.finish());
        }
        // Bytes of a character still incomplete when generation stopped are
        // dropped: they are not valid text on their own.
        drop(stream);
        stats.decode_ms = t1.elapsed().as_secs_f64() * 1e3;
        stats.decode_tok_s = rate(stats.decode_steps, stats.decode_ms);
        if !delivery.is_empty() {
            delivery.sort_by(f32::total_cmp);
            stats.delivery_us = Some((delivery[delivery.len() / 2], delivery[delivery.len() - 1]));
        }
        stats.position = self.pos;
        Ok(stats)
    }

    /// Writes the recent-token buffer: header, then the window's ids.
    pub(crate) fn write_recent(
        &mut self,
        chain_start: u32,
        window: &[u32],
    ) -> Result<(), EngineError> {
        let hdr = crate::ops::RecentHeader {
            chain_start,
            n: window.len() as u32,
        };
        let mut bytes = bytemuck::bytes_of(&hdr).to_vec();
        bytes.extend(window.iter().flat_map(|t| t.to_le_bytes()));
        self.backend.write(self.scratch.recent, 0, &bytes)?;
        Ok(())
    }

    /// The sampled dispatch table (the greedy one plus the sampler).
    pub fn sampled_table(&self) -> &DispatchTable {
        &self.sampled
    }

    /// Read access for tests and tools (e.g. the logits buffer).
    pub fn read_logits(&self) -> Result<Vec<f32>, EngineError> {
        Ok(self
            .backend
            .read_f32s(self.scratch.logits, 0, self.model.config.n_vocab as usize)?)
    }

    pub fn logits_buffer(&self) -> BufferId {
        self.scratch.logits
    }
}

pub(crate) fn rate(n: u32, ms: f64) -> f64 {
    if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 }
}

/// The state of speculative decode within one `generate` call.
struct SpecState {
    pred: NgramPredictor,
    draft: Vec<u32>,
    /// Current draft length (adapts between 1 and the configured one;
    /// starts at 1: a draft earns its length by being accepted).
    k_cur: u32,
    /// Verification passes in a row that accepted nothing.
    misses: u32,
    /// Plain steps left before drafting again.
    pause_left: u32,
    /// The next pause's length (doubles while drafts keep missing).
    pause_len: u32,
    /// Plain steps to run when the predictor has no draft (doubles, up to
    /// the backend's `idle_run_max`, while it keeps having none).
    idle_run: u32,
    stats: SpecStats,
}

/// Misses in a row that pause speculation.
const SPEC_MISSES: u32 = 2;
const SPEC_PAUSE_MIN: u32 = 4;
const SPEC_PAUSE_MAX: u32 = 128;

impl SpecStats {
    fn finish(mut self) -> Self {
        self.acceptance_rate = if self.drafted > 0 {
            self.accepted as f64 / self.drafted as f64
        } else {
            0.0
        };
        self
    }
}

impl SpecState {
    fn new(opts: &SpecOptions, history: &[u32], slow_start: bool) -> Self {
        SpecState {
            pred: NgramPredictor::with_tokens(opts, history),
            draft: Vec::with_capacity(MAX_DRAFT as usize),
            // Slow start where a verified row is not free (on the CPU an
            // extra row costs about 0.4 of a one-row step, bench/RESULTS.md):
            // the first draft is one token and full accepts double it.
            k_cur: if slow_start {
                1.min(opts.draft)
            } else {
                opts.draft
            },
            misses: 0,
            pause_left: 0,
            pause_len: SPEC_PAUSE_MIN,
            idle_run: 1,
            stats: SpecStats::default(),
        }
    }

    /// Feeds the predictor the tokens emitted since the last call.
    fn sync(&mut self, history: &[u32]) {
        for &t in &history[self.pred.len().min(history.len())..] {
            self.pred.push(t);
        }
    }

    /// After a pass that drafted `k` tokens and had `m` accepted: a full
    /// accept doubles the draft (from 1, see `new`), a partial one shrinks
    /// it to what was accepted plus one, and repeated misses pause drafting
    /// for a while (longer each time), so that text the n-grams cannot
    /// predict runs at the plain path's speed.
    fn adapt(&mut self, k: u32, m: u32, max: u32) {
        if m == k {
            self.k_cur = (self.k_cur * 2).clamp(1, max);
        } else {
            self.k_cur = (m + 1).clamp(1, max);
        }
        // Back to short plain runs (checking for drafts after every step)
        // only where drafts pay: after a pass that rejected everything the
        // runs keep their length, so that text the n-grams keep guessing
        // wrong does not cost a submission per token.
        if m > 0 {
            self.idle_run = 1;
        }
        if m == 0 {
            self.misses += 1;
            if self.misses >= SPEC_MISSES {
                self.misses = 0;
                self.pause_left = self.pause_len;
                self.pause_len = (self.pause_len * 2).min(SPEC_PAUSE_MAX);
            }
        } else {
            self.misses = 0;
            self.pause_len = SPEC_PAUSE_MIN;
        }
    }

    fn plain_done(&mut self, steps: u32) {
        self.stats.plain_steps += steps;
        self.pause_left = self.pause_left.saturating_sub(steps);
    }

    fn finish(self) -> SpecStats {
        let mut s = self.stats;
        s.tokens_per_pass = if s.verify_passes > 0 {
            s.verified_tokens as f64 / s.verify_passes as f64
        } else {
            0.0
        };
        s.finish()
    }
}
