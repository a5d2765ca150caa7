//! `akunu inspect`: metadata, hyper-parameters and the dispatch table.

use crate::load::{self, EngineArgs, ModelArgs};
use anyhow::Result;
use clap::Args;

#[derive(Args)]
pub struct InspectArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Only print metadata and tensors, not the table.
    #[arg(long)]
    no_table: bool,
}

pub fn run(a: InspectArgs) -> Result<()> {
    let model = load::model(&a.model)?;
    let f = &model.file;
    println!(
        "file: {} (GGUF v{}, {} bytes, {} tensors, {} metadata keys)",
        f.path.display(),
        f.version,
        f.file_size,
        f.tensors.len(),
        f.metadata.len()
    );
    println!("\n# metadata");
    for (k, v) in &f.metadata {
        println!("{k:<48} {:<7} {}", v.type_name(), v.summary());
    }
    println!("\n# tensors by type");
    let mut by_type: Vec<(String, usize, u64)> = Vec::new();
    for t in &f.tensors {
        let name = t.dtype.name().to_string();
        match by_type.iter_mut().find(|(n, _, _)| *n == name) {
            Some(e) => {
                e.1 += 1;
                e.2 += t.n_bytes;
            }
            None => by_type.push((name, 1, t.n_bytes)),
        }
    }
    for (n, c, b) in by_type {
        println!(
            "{n:<6} {c:>5} tensors {:>10.2} MiB",
            b as f64 / (1u64 << 20) as f64
        );
    }
    let c = &model.config;
    println!("\n# hyper-parameters");
    println!(
        "arch {} | layers {} | dim {} | heads {} (kv {}) x {} | ffn {} | vocab {} | ctx {} | rope base {} dim {} scale {} | rms eps {} | output {}",
        c.arch.name,
        c.n_layers,
        c.dim,
        c.n_heads,
        c.n_kv_heads,
        c.head_dim,
        c.ffn_dim,
        c.n_vocab,
        c.train_ctx,
        c.rope_theta,
        c.rope_dim,
        c.rope_freq_scale,
        c.rms_eps,
        if c.tied_output {
            "tied to token_embd"
        } else {
            "output.weight"
        }
    );
    let d = &c.arch;
    let act = if d.ffn_act == akunu_core::ops::ACT_GEGLU {
        "GeGLU (tanh)"
    } else {
        "SwiGLU"
    };
    let rope = if d.rope_style == akunu_core::ops::ROPE_NEOX {
        "neox"
    } else {
        "normal"
    };
    let mut parts = vec![format!("rope {rope}"), format!("ffn {act}")];
    for (on, what) in [
        (d.qkv_bias, "QKV bias"),
        (d.qk_norm, "per-head QK norm"),
        (d.post_attn_norm, "post-attention norm"),
        (d.post_ffn_norm, "post-FFN norm"),
        (d.embed_scale_sqrt_dim, "embedding x sqrt(dim)"),
    ] {
        if on {
            parts.push(what.into());
        }
    }
    parts.push(format!("attention scale {}", c.attn_scale));
    if c.sliding_window > 0 {
        let local = (0..c.n_layers).filter(|&l| c.layer_is_local(l)).count();
        parts.push(format!(
            "sliding window {} on {local} of {} layers (rope base {})",
            c.sliding_window, c.n_layers, c.swa_rope_theta
        ));
    }
    if c.attn_softcap > 0.0 {
        parts.push(format!("attention soft-cap {}", c.attn_softcap));
    }
    if c.final_softcap > 0.0 {
        parts.push(format!("logit soft-cap {}", c.final_softcap));
    }
    println!("block: {}", parts.join(" | "));
    println!(
        "weight bytes read per token: {:.2} MiB",
        c.weight_bytes_per_token(f) as f64 / (1u64 << 20) as f64
    );
    if a.no_table {
        return Ok(());
    }
    // The table is built against a small CPU engine; its commands are the
    // same on every backend.
    let engine = load::engine(
        model.clone(),
        &EngineArgs {
            device: "cpu".into(),
            gpu: 0,
            threads: 1,
            ctx: Some(64),
            chunk: Some(1),
            prefill_chunk: 1,
            activations: "f32".into(),
            prefill_products: "exact".into(),
            prefill_cache: "auto".into(),
            kv_type: "auto".into(),
        },
    )?;
    let t = engine.table();
    println!("\n# dispatch table ({} commands per token)", t.len());
    println!(
        "{:>4}  {:<28} {:<17} {:<14} {:>7}  bindings",
        "#", "label", "kernel", "patch", "grid"
    );
    for (i, cmd) in t.commands.iter().enumerate() {
        let rows = if cmd.rows == akunu_core::table::RowMode::LastRow {
            " last-row"
        } else {
            ""
        };
        println!(
            "{i:>4}  {:<28} {:<17} {:<14} {:>7}  {}{rows}",
            t.label(i),
            cmd.kernel.name(),
            cmd.patch.name(),
            cmd.grid,
            cmd.n_buffers
        );
    }
    println!("\n# commands per token by kernel");
    for (k, n) in t.kernel_histogram() {
        println!("{:<17} {n}", k.name());
    }
    println!("total             {}", t.len());
    Ok(())
}
