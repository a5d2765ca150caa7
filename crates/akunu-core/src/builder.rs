//! Builds the dispatch table: one walk over the architecture at load time.
//!
//! Per layer the table holds eight commands:
//!
//! ```text
//! gemv(QKV, fused[, biases]) -> rope_kv_write([QK norm]) -> attention([window]) ->
//! gemv(O) -> residual_rmsnorm([post-attn norm], ffn_norm) -> gemv(gate|up, fused) ->
//! gemv(SwiGLU|GeGLU + down) ->
//! residual_rmsnorm([post-FFN norm], next layer's attn_norm, or output_norm after the last)
//! ```
//!
//! The bracketed parts are switched on by the architecture descriptor's
//! flags and the model's hyper-parameters (`arch::ModelConfig`): every
//! architecture has the same eight commands per layer, with different
//! parameters and bindings.
//!
//! framed by the embedding lookup and first RMSNorm before, and the logits
//! projection and argmax after. The same table serves decode (one row per
//! step) and prefill (a chunk of rows per step).

use crate::arch::ModelConfig;
use crate::dtype::DType;
use crate::ops::*;
use crate::table::{BufferId, CmdBuilder, DispatchTable, PatchType};
use std::collections::HashMap;
use std::mem::offset_of;

/// A weight tensor bound on the backend.
#[derive(Copy, Clone, Debug)]
pub struct WeightBuf {
    pub buf: BufferId,
    pub dtype: DType,
}

/// Backend buffers holding intermediate activations; each has room for
/// `max_rows` rows.
#[derive(Copy, Clone, Debug)]
pub struct Scratch {
    /// u32 token-id conveyor.
    pub token_ids: BufferId,
    /// Residual stream, `dim` wide.
    pub h: BufferId,
    /// Normed activations feeding the next projection, `dim` wide.
    pub xn: BufferId,
    /// Fused Q|K|V rows.
    pub qkv: BufferId,
    /// Attention output rows, `q_dim` wide.
    pub attn: BufferId,
    /// Output of the O and down projections, `dim` wide.
    pub delta: BufferId,
    /// Fused gate|up rows, `2 * ffn_dim` wide.
    pub gu: BufferId,
    /// Logits of the last row, `n_vocab` wide.
    pub logits: BufferId,
    /// Recent tokens for the repetition penalty: a `RecentHeader`, then up
    /// to `RECENT_CAPACITY` ids.
    pub recent: BufferId,
}

/// Most previous tokens the repetition penalty can look at.
pub const RECENT_CAPACITY: u32 = 1024;

/// Bytes of the recent-token buffer.
pub const RECENT_BYTES: u64 = 8 + RECENT_CAPACITY as u64 * 4;

/// Per-layer K and V caches: `[n_kv_heads][capacity][head_dim]` elements
/// of `kv_type` each.
#[derive(Clone, Debug)]
pub struct KvBuffers {
    pub k: Vec<BufferId>,
    pub v: Vec<BufferId>,
    pub capacity: u32,
    pub kv_type: KvType,
}

pub struct BuildInputs<'a> {
    pub cfg: &'a ModelConfig,
    pub weights: &'a HashMap<String, WeightBuf>,
    pub scratch: Scratch,
    pub kv: &'a KvBuffers,
    /// Rows the scratch buffers hold (the prefill chunk).
    pub max_rows: u32,
}

#[derive(Debug, thiserror::Error)]
#[error("table builder: weight '{0}' was not bound")]
pub struct MissingWeight(pub String);

pub fn build_dispatch_table(inp: &BuildInputs) -> Result<DispatchTable, MissingWeight> {
    let cfg = inp.cfg;
    let s = inp.scratch;
    let w = |name: &str| {
        inp.weights
            .get(name)
            .copied()
            .ok_or_else(|| MissingWeight(name.to_string()))
    };
    let mut t = DispatchTable {
        max_rows: inp.max_rows,
        ..Default::default()
    };
    let (dim, qkv_dim, q_dim, kv_dim, ffn) = (
        cfg.dim,
        cfg.qkv_dim(),
        cfg.q_dim(),
        cfg.kv_dim(),
        cfg.ffn_dim,
    );
    let norm = NormParams {
        dim,
        eps: cfg.rms_eps,
        post_norm: 0,
        _pad: 0,
    };

    // 1. Embedding lookup from the conveyor.
    let embd = w("token_embd.weight")?;
    let scale = if cfg.arch.embed_scale_sqrt_dim {
        (dim as f32).sqrt()
    } else {
        1.0
    };
    CmdBuilder::new(&mut t, KernelId::Embedding, 1)
        .buf(s.token_ids, 0)
        .buf(embd.buf, 0)
        .buf(s.h, 0)
        .params(&EmbedParams {
            dim,
            dtype: embd.dtype as u32,
            n_vocab: cfg.n_vocab,
            scale,
        })
        .patch(PatchType::TokenOffset, 0, 0)
        .label("embedding")
        .emit();

    // 2. First attention norm.
    CmdBuilder::new(&mut t, KernelId::RmsNorm, 1)
        .buf(s.h, 0)
        .buf(w("blk.0.attn_norm.weight")?.buf, 0)
        .buf(s.xn, 0)
        .params(&norm)
        .label("layer.0.attn_norm")
        .emit();

    for l in 0..cfg.n_layers {
        let b = |n: &str| format!("blk.{l}.{n}");
        // 3a. Fused QKV projection.
        let (wq, wk, wv) = (
            w(&b("attn_q.weight"))?,
            w(&b("attn_k.weight"))?,
            w(&b("attn_v.weight"))?,
        );
        let mut qkv = CmdBuilder::new(&mut t, KernelId::Gemv, qkv_dim)
            .buf(s.xn, 0)
            .buf(s.qkv, 0)
            .buf(wq.buf, 0)
            .buf(wk.buf, 0)
            .buf(wv.buf, 0);
        if cfg.arch.qkv_bias {
            qkv = qkv
                .buf(w(&b("attn_q.bias"))?.buf, 0)
                .buf(w(&b("attn_k.bias"))?.buf, 0)
                .buf(w(&b("attn_v.bias"))?.buf, 0);
        }
        qkv.params(&GemvParams {
            k: dim,
            x_stride: dim,
            out_stride: qkv_dim,
            n_seg: 3,
            n: [q_dim, kv_dim, kv_dim],
            dtype: [wq.dtype as u32, wk.dtype as u32, wv.dtype as u32],
            input_act: ACT_NONE,
            accumulate: 0,
            bias: cfg.arch.qkv_bias as u32,
            softcap: 0.0,
        })
        .label(format!("layer.{l}.qkv"))
        .emit();

        // 3b. (Per-head QK norm,) RoPE on Q and K, K and V written to the
        // cache. Sliding-window layers have their own RoPE base.
        let (theta, freq_scale) = cfg.layer_rope(l);
        let rope = RopeParams {
            pos: 0,
            n_heads: cfg.n_heads,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
            rope_dim: cfg.rope_dim,
            theta,
            freq_scale,
            style: cfg.arch.rope_style,
            qkv_stride: qkv_dim,
            capacity: inp.kv.capacity,
            freq_factors: cfg.rope_freqs as u32,
            qk_norm: cfg.arch.qk_norm as u32,
            norm_eps: cfg.rms_eps,
            kv_type: inp.kv.kv_type as u32,
        };
        let mut rope_cmd =
            CmdBuilder::new(&mut t, KernelId::RopeKvWrite, cfg.n_heads + cfg.n_kv_heads)
                .buf(s.qkv, 0)
                .buf(inp.kv.k[l as usize], 0)
                .buf(inp.kv.v[l as usize], 0);
        if cfg.rope_freqs {
            rope_cmd = rope_cmd.buf(w(crate::arch::ROPE_FREQS)?.buf, 0);
        }
        if cfg.arch.qk_norm {
            rope_cmd = rope_cmd
                .buf(w(&b("attn_q_norm.weight"))?.buf, 0)
                .buf(w(&b("attn_k_norm.weight"))?.buf, 0);
        }
        rope_cmd
            .params(&rope)
            .patch(PatchType::Position, offset_of!(RopeParams, pos), 0)
            .label(format!("layer.{l}.rope_kv_write"))
            .emit();

        // 3c. Attention over the cache (over the last `sliding_window`
        // positions only on local layers: the kernel derives each row's
        // position from kv_len, so the KV_SEQ_LEN patch suffices).
        let window = if cfg.layer_is_local(l) {
            cfg.sliding_window
        } else {
            0
        };
        let attn = AttnParams {
            pos: 0,
            kv_len: 0,
            n_heads: cfg.n_heads,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
            capacity: inp.kv.capacity,
            scale: cfg.attn_scale,
            window,
            qkv_stride: qkv_dim,
            out_stride: q_dim,
            softcap: cfg.attn_softcap,
            kv_type: inp.kv.kv_type as u32,
        };
        CmdBuilder::new(&mut t, KernelId::Attention, cfg.n_heads)
            .buf(s.qkv, 0)
            .buf(inp.kv.k[l as usize], 0)
            .buf(inp.kv.v[l as usize], 0)
            .buf(s.attn, 0)
            .params(&attn)
            .patch(PatchType::KvSeqLen, offset_of!(AttnParams, kv_len), 0)
            .label(if window > 0 {
                format!("layer.{l}.attention.window{window}")
            } else {
                format!("layer.{l}.attention")
            })
            .emit();

        // 3d. Output projection.
        let wo = w(&b("attn_output.weight"))?;
        gemv1(
            &mut t,
            s.attn,
            s.delta,
            wo,
            q_dim,
            q_dim,
            dim,
            dim,
            ACT_NONE,
            format!("layer.{l}.attn_output"),
        );

        // 3e. (Post-attention norm,) residual add, FFN norm.
        residual_norm(
            &mut t,
            s,
            w(&b("ffn_norm.weight"))?,
            cfg.arch
                .post_attn_norm
                .then(|| w(&b("post_attention_norm.weight")))
                .transpose()?,
            norm,
            format!("layer.{l}.residual_ffn_norm"),
        );

        // 3f. Fused gate|up projection.
        let (wg, wu) = (w(&b("ffn_gate.weight"))?, w(&b("ffn_up.weight"))?);
        CmdBuilder::new(&mut t, KernelId::Gemv, 2 * ffn)
            .buf(s.xn, 0)
            .buf(s.gu, 0)
            .buf(wg.buf, 0)
            .buf(wu.buf, 0)
            .params(&GemvParams {
                k: dim,
                x_stride: dim,
                out_stride: 2 * ffn,
                n_seg: 2,
                n: [ffn, ffn, 0],
                dtype: [wg.dtype as u32, wu.dtype as u32, 0],
                input_act: ACT_NONE,
                accumulate: 0,
                bias: 0,
                softcap: 0.0,
            })
            .label(format!("layer.{l}.gate_up"))
            .emit();

        // 3g. Gated activation fused into the down projection.
        let wd = w(&b("ffn_down.weight"))?;
        gemv1(
            &mut t,
            s.gu,
            s.delta,
            wd,
            ffn,
            2 * ffn,
            dim,
            dim,
            cfg.arch.ffn_act,
            format!("layer.{l}.act_down"),
        );

        // 3h. Residual add + the next norm (next layer's attention norm, or
        // the output norm after the last layer).
        let (next_norm, label) = if l + 1 < cfg.n_layers {
            (
                format!("blk.{}.attn_norm.weight", l + 1),
                format!("layer.{l}.residual_next_norm"),
            )
        } else {
            ("output_norm.weight".to_string(), "output_norm".to_string())
        };
        residual_norm(
            &mut t,
            s,
            w(&next_norm)?,
            cfg.arch
                .post_ffn_norm
                .then(|| w(&b("post_ffw_norm.weight")))
                .transpose()?,
            norm,
            label,
        );
    }

    // 5. Logits of the last row.
    let out_w = if cfg.tied_output {
        w("token_embd.weight")?
    } else {
        w("output.weight")?
    };
    CmdBuilder::new(&mut t, KernelId::Gemv, cfg.n_vocab)
        .buf(s.xn, 0)
        .buf(s.logits, 0)
        .buf(out_w.buf, 0)
        .params(&GemvParams {
            k: dim,
            x_stride: dim,
            out_stride: cfg.n_vocab,
            n_seg: 1,
            n: [cfg.n_vocab, 0, 0],
            dtype: [out_w.dtype as u32, 0, 0],
            input_act: ACT_NONE,
            accumulate: 0,
            bias: 0,
            softcap: cfg.final_softcap,
        })
        .last_row()
        .label("logits")
        .emit();

    // 6. Argmax into the next conveyor slot.
    CmdBuilder::new(&mut t, KernelId::Argmax, 1)
        .buf(s.logits, 0)
        .buf(s.token_ids, 0)
        .params(&ArgmaxParams {
            n: cfg.n_vocab,
            _pad: [0; 3],
        })
        .patch(PatchType::ArgmaxOutput, 0, 0)
        .last_row()
        .label("argmax")
        .emit();
    Ok(t)
}

/// `h += [post_norm](delta)`, then `xn = rmsnorm(h) * norm_w`.
fn residual_norm(
    t: &mut DispatchTable,
    s: Scratch,
    norm_w: WeightBuf,
    post: Option<WeightBuf>,
    norm: NormParams,
    label: String,
) {
    let mut c = CmdBuilder::new(t, KernelId::ResidualRmsNorm, 1)
        .buf(s.h, 0)
        .buf(s.delta, 0)
        .buf(norm_w.buf, 0)
        .buf(s.xn, 0);
    if let Some(pw) = post {
        c = c.buf(pw.buf, 0);
    }
    c.params(&NormParams {
        post_norm: post.is_some() as u32,
        ..norm
    })
    .label(label)
    .emit();
}

/// A single-segment projection.
#[allow(clippy::too_many_arguments)]
fn gemv1(
    t: &mut DispatchTable,
    x: BufferId,
    out: BufferId,
    wt: WeightBuf,
    k: u32,
    x_stride: u32,
    n: u32,
    out_stride: u32,
    act: u32,
    label: String,
) {
    CmdBuilder::new(t, KernelId::Gemv, n)
        .buf(x, 0)
        .buf(out, 0)
        .buf(wt.buf, 0)
        .params(&GemvParams {
            k,
            x_stride,
            out_stride,
            n_seg: 1,
            n: [n, 0, 0],
            dtype: [wt.dtype as u32, 0, 0],
            input_act: act,
            accumulate: 0,
            bias: 0,
            softcap: 0.0,
        })
        .label(label)
        .emit();
}

/// The sampled table: the greedy table plus one `GumbelSample` command
/// right before the argmax, its position patched per step so that a chain
/// of sampled tokens needs no host round trip. Returns the table and the
/// index of the sampling command (whose params the engine rewrites when the
/// sampling configuration changes).
pub fn build_sampled_table(inp: &BuildInputs) -> Result<(DispatchTable, usize), MissingWeight> {
    let greedy = build_dispatch_table(inp)?;
    let cfg = inp.cfg;
    let mut tail = DispatchTable {
        max_rows: greedy.max_rows,
        ..Default::default()
    };
    CmdBuilder::new(&mut tail, KernelId::GumbelSample, 1)
        .buf(inp.scratch.logits, 0)
        .buf(inp.scratch.recent, 0)
        .buf(inp.scratch.token_ids, 0)
        .params(&sample_params(
            &crate::sampling::SamplingConfig::default(),
            cfg.n_vocab,
        ))
        .patch(PatchType::KvSeqLen, offset_of!(SampleParams, kv_len), 0)
        .last_row()
        .label("gumbel_sample")
        .emit();
    let at = greedy.len() - 1;
    let mut t = greedy;
    t.commands.insert(at, tail.commands[0]);
    t.labels.insert(at, tail.labels[0].clone());
    Ok((t, at))
}

/// The `GumbelSample` params for a sampling configuration.
pub fn sample_params(s: &crate::sampling::SamplingConfig, n_vocab: u32) -> SampleParams {
    SampleParams {
        kv_len: 0,
        n_vocab,
        temperature: s.temperature,
        top_k: s.top_k,
        top_p: s.top_p,
        min_p: s.min_p,
        repeat_penalty: s.repeat_penalty,
        repeat_last_n: s.repeat_last_n.min(RECENT_CAPACITY),
        seed_lo: s.seed as u32,
        seed_hi: (s.seed >> 32) as u32,
        recent_capacity: RECENT_CAPACITY,
        _pad: 0,
    }
}

/// The verification table of speculative decode: the greedy table (or, with
/// `sampled`, the sampled one) whose logits, sampling and argmax commands
/// run on every row of the step instead of the last one. A step of
/// `1 + k` rows at position `pos` (conveyor `[current, d1, .., dk]` from slot
/// 0) writes the model's choice after each row `r` into conveyor slot
/// `r + 1`, in one pass over the weights. The logits of all rows go to
/// `logits` (`max_rows * n_vocab` f32), a buffer of their own, so that the
/// other tables keep their one-row logits buffer. `max_rows` is the most rows
/// a verification may have. Returns the table and, when sampled, the index
/// of its sampling command.
pub fn build_verify_table(
    inp: &BuildInputs,
    logits: crate::table::BufferId,
    max_rows: u32,
    sampled: bool,
) -> Result<(DispatchTable, Option<usize>), MissingWeight> {
    let (mut t, sampler) = if sampled {
        let (t, at) = build_sampled_table(inp)?;
        (t, Some(at))
    } else {
        (build_dispatch_table(inp)?, None)
    };
    t.max_rows = max_rows.min(inp.max_rows);
    let n = t.commands.len();
    // The tail: logits gemv, [gumbel_sample], argmax.
    let tail = if sampled { 3 } else { 2 };
    for (i, c) in t.commands[n - tail..].iter_mut().enumerate() {
        c.rows = crate::table::RowMode::AllRows;
        // The gemv writes the logits (binding 1); the others read them
        // (binding 0).
        let slot = if i == 0 { 1 } else { 0 };
        debug_assert_eq!(c.buffers[slot].buffer, inp.scratch.logits);
        c.buffers[slot].buffer = logits;
    }
    for l in &mut t.labels[n - tail..] {
        l.push_str(".all_rows");
    }
    Ok((t, sampler))
}

/// The tables of grammar-constrained decode. The forward pass ends at the
/// logits (the greedy table without its argmax), so that the host can
/// compute the grammar mask while it runs; the tails then apply the mask
/// and choose the token.
#[derive(Clone, Debug)]
pub struct GrammarTables {
    /// Embedding to logits: one step feeds any number of rows (the pending
    /// token plus the tokens the grammar forces).
    pub forward: DispatchTable,
    /// `GrammarBitmask -> Argmax`.
    pub greedy_tail: DispatchTable,
    /// `GrammarBitmask -> GumbelSample -> Argmax`.
    pub sampled_tail: DispatchTable,
    /// Index of the `GumbelSample` command in `sampled_tail`.
    pub sampler_cmd: usize,
}

/// Builds the grammar tables; `mask` is a buffer of `ceil(n_vocab / 32)`
/// u32 words (bit `i % 32` of word `i / 32` allows token `i`).
pub fn build_grammar_tables(
    inp: &BuildInputs,
    mask: BufferId,
) -> Result<GrammarTables, MissingWeight> {
    let mut forward = build_dispatch_table(inp)?;
    let argmax_cmd = forward.commands.pop().expect("the table ends with argmax");
    let argmax_label = forward.labels.pop().unwrap_or_default();
    debug_assert_eq!(argmax_cmd.kernel, KernelId::Argmax);
    let (sampled, at) = build_sampled_table(inp)?;
    let gumbel_cmd = sampled.commands[at];
    let n_vocab = inp.cfg.n_vocab;
    let tail = |with_sampler: bool| {
        let mut t = DispatchTable {
            max_rows: inp.max_rows,
            ..Default::default()
        };
        CmdBuilder::new(&mut t, KernelId::GrammarBitmask, 1)
            .buf(inp.scratch.logits, 0)
            .buf(mask, 0)
            .params(&BitmaskParams {
                n_vocab,
                _pad: [0; 3],
            })
            .last_row()
            .label("grammar_bitmask")
            .emit();
        if with_sampler {
            t.commands.push(gumbel_cmd);
            t.labels.push("gumbel_sample".into());
        }
        t.commands.push(argmax_cmd);
        t.labels.push(argmax_label.clone());
        t
    };
    Ok(GrammarTables {
        forward,
        greedy_tail: tail(false),
        sampled_tail: tail(true),
        sampler_cmd: 1,
    })
}
