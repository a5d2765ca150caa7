//! Speculative decode is lossless: on random-weight models (written by
//! `akunu_core::synth`), its tokens, stop reasons and positions equal the
//! plain path's, greedy and sampled, over prompts that repeat (so drafts are
//! accepted, which the tests check) and prompts that never do, with stops
//! (EOS, max_tokens, cancellation, a full context) falling inside drafts.

use akunu_core::decode::{DecodePath, Engine, EngineOptions, GenerateOptions, Stats, StopReason};
use akunu_core::dtype::DType;
use akunu_core::model::Model;
use akunu_core::sampling::SamplingConfig;
use akunu_core::speculative::SpecOptions;
use akunu_core::synth::{Shape, SynthArch, SynthSpec, write_synthetic};
use akunu_cpu::CpuBackend;
use std::sync::{Arc, Mutex, OnceLock};

type ModelCache = Mutex<Vec<(DType, Arc<Model>)>>;

fn tiny_model(dtype: DType) -> Arc<Model> {
    static MODELS: OnceLock<ModelCache> = OnceLock::new();
    let cache = MODELS.get_or_init(|| Mutex::new(Vec::new()));
    let mut c = cache.lock().unwrap();
    if let Some((_, m)) = c.iter().find(|(d, _)| *d == dtype) {
        return m.clone();
    }
    let path = std::env::temp_dir().join(format!(
        "akunu-spec-test-{}-{}.gguf",
        std::process::id(),
        dtype.name()
    ));
    let spec = SynthSpec {
        shape: Shape::Tiny,
        arch: SynthArch::Llama,
        dtype,
        seed: 11,
        tokenizer_from: None,
        embedding: None,
        output: None,
        rope_freqs: false,
    };
    write_synthetic(&path, &spec, &mut |_, _| {}).expect("writing the synthetic model");
    let m = Arc::new(Model::load(&path).expect("loading the synthetic model"));
    // The file is memory-mapped: unlinking it keeps the data for the
    // model's lifetime and leaves nothing behind in the temp directory.
    let _ = std::fs::remove_file(&path);
    c.push((dtype, m.clone()));
    m
}

fn engine(m: &Arc<Model>, ctx: u32) -> Engine {
    engine_with(m, ctx, false)
}

/// An engine whose backend uses 8-bit activations when `q8` (Q4_0 weights
/// then decode through their row-interleaved copies).
fn engine_with(m: &Arc<Model>, ctx: u32, q8: bool) -> Engine {
    let opts = EngineOptions {
        ctx: Some(ctx),
        chunk: 8,
        prefill_chunk: 64,
    };
    let mut be = CpuBackend::new(2);
    be.set_q8_activations(q8);
    Engine::new(m.clone(), Box::new(be), &opts).expect("engine")
}

/// A pseudo-random id sequence (xorshift), distinct-ish, below `n_vocab`.
fn ids(n: usize, seed: u64, n_vocab: u32) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            3 + (x % (n_vocab as u64 - 3)) as u32
        })
        .collect()
}

/// Prompts: heavily repeating ones, and ones that never repeat.
fn prompts(m: &Model) -> Vec<(&'static str, Vec<u32>)> {
    let nv = m.config.n_vocab;
    let mut out = Vec::new();
    for (i, period) in [5usize, 12, 23].into_iter().enumerate() {
        let unit = ids(period, 100 + i as u64, nv);
        let p: Vec<u32> = unit.iter().cycle().take(period * 4 + 3).copied().collect();
        out.push(("repeating", p));
    }
    // Ascending ids with a stride: no n-gram occurs twice.
    out.push(("fresh", (0..40u32).map(|i| (5 + i * 7) % nv).collect()));
    out.push(("random", ids(30, 999, nv)));
    out
}

fn sampling_configs() -> Vec<SamplingConfig> {
    let base = SamplingConfig {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.02,
        repeat_penalty: 1.2,
        repeat_last_n: 16,
        seed: 5,
    };
    vec![
        SamplingConfig::default(),
        base.clone(),
        SamplingConfig {
            temperature: 0.3,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            seed: 77,
            ..base.clone()
        },
        SamplingConfig {
            temperature: 1.4,
            top_k: 8,
            repeat_penalty: 1.5,
            repeat_last_n: 64,
            seed: 123_456_789_012,
            ..base.clone()
        },
    ]
}

fn spec_opts(ngram_min: u32, ngram_max: u32, draft: u32) -> SpecOptions {
    SpecOptions {
        ngram_min,
        ngram_max,
        draft,
    }
}

/// Generates and returns the ids, the stats and the engine's position.
fn gen_with(
    e: &mut Engine,
    prompt: &[u32],
    opts: &GenerateOptions,
    cancel_at: Option<usize>,
) -> (Vec<u32>, Stats) {
    let mut out = Vec::new();
    let st = e
        .generate(prompt, opts, &mut |id, _| {
            out.push(id);
            cancel_at != Some(out.len())
        })
        .expect("generate");
    (out, st)
}

/// Runs the plain and the speculative path on fresh engines and checks
/// that they agree; returns the speculative stats.
fn check(
    m: &Arc<Model>,
    ctx: u32,
    prompt: &[u32],
    base: &GenerateOptions,
    spec: SpecOptions,
    cancel_at: Option<usize>,
    what: &str,
) -> Stats {
    let (mut a, mut b) = (engine(m, ctx), engine(m, ctx));
    let plain = GenerateOptions {
        speculative: false,
        ..base.clone()
    };
    let sp = GenerateOptions {
        speculative: true,
        spec,
        ..base.clone()
    };
    let (ia, sa) = gen_with(&mut a, prompt, &plain, cancel_at);
    let (ib, sb) = gen_with(&mut b, prompt, &sp, cancel_at);
    assert_eq!(sb.path, DecodePath::Speculative);
    assert_eq!(ia, ib, "{what}: tokens differ");
    assert_eq!(
        sa.stop_reason, sb.stop_reason,
        "{what}: stop reasons differ"
    );
    assert_eq!(sa.generated_tokens, sb.generated_tokens, "{what}");
    assert_eq!(a.position(), b.position(), "{what}: positions differ");
    assert_eq!(a.history(), b.history(), "{what}: histories differ");
    // The next turn continues from the same state (the cache beyond the
    // accepted positions is never read).
    if a.position() + 8 < ctx {
        let more = GenerateOptions {
            max_tokens: 6,
            ..plain.clone()
        };
        let (ca, _) = gen_with(&mut a, &prompt[..2], &more, None);
        let (cb, _) = gen_with(
            &mut b,
            &prompt[..2],
            &GenerateOptions {
                speculative: true,
                spec,
                ..more
            },
            None,
        );
        assert_eq!(ca, cb, "{what}: continuation differs");
    }
    let s = sb.speculative.clone().expect("speculative stats");
    assert_eq!(s.verified_tokens + s.plain_steps, sb.decode_steps, "{what}");
    assert!(s.accepted <= s.drafted);
    sb
}

#[test]
fn speculative_equals_plain_greedy_and_sampled() {
    let mut accepted_sampled = 0;
    for dtype in [DType::F32, DType::Q4_1] {
        let m = tiny_model(dtype);
        for (ci, cfg) in sampling_configs().into_iter().enumerate() {
            let mut accepted_repeating = 0;
            for (name, p) in prompts(&m) {
                for spec in [spec_opts(2, 4, 8), spec_opts(1, 2, 3)] {
                    let base = GenerateOptions {
                        max_tokens: 48,
                        ignore_eos: true,
                        sampling: cfg.clone(),
                        ..Default::default()
                    };
                    let what = format!("{dtype:?} config {ci} {name} {spec:?}");
                    let st = check(&m, 256, &p, &base, spec, None, &what);
                    let s = st.speculative.unwrap();
                    if name == "repeating" {
                        accepted_repeating += s.accepted;
                    }
                    if ci > 0 {
                        accepted_sampled += s.accepted;
                    }
                }
            }
            // Greedy and low-temperature decoding of a repeating prompt
            // must accept drafts, or the test proves nothing.
            if ci == 0 || ci == 2 {
                assert!(
                    accepted_repeating > 0,
                    "{dtype:?} config {ci}: no draft was accepted"
                );
            }
        }
    }
    // Sampled verification accepted drafts too (exactly when the plain
    // path drew the same token, as the equality above shows).
    assert!(accepted_sampled > 0, "no sampled draft was accepted");
}

#[test]
fn stops_inside_drafts_match_the_plain_path() {
    // Greedy, this tiny model echoes its last token (every draft is
    // accepted, so max_tokens, cancellation and a full context fall inside
    // accepted drafts); sampled, drafts are partly accepted and stop tokens
    // land anywhere in a verification pass.
    let m = tiny_model(DType::F32);
    let (_, p) = prompts(&m).into_iter().next().unwrap();
    let cfgs = sampling_configs();
    let mut accepted = 0;
    let mut stops = 0;
    for cfg in [cfgs[0].clone(), cfgs[1].clone(), cfgs[3].clone()] {
        let base = GenerateOptions {
            max_tokens: 40,
            ignore_eos: true,
            sampling: cfg.clone(),
            ..Default::default()
        };
        let (reference, _) = gen_with(&mut engine(&m, 256), &p, &base, None);
        // A stop token (like EOS) at every place where one first appears.
        for j in 1..reference.len() {
            if reference[..j].contains(&reference[j]) {
                continue;
            }
            let o = GenerateOptions {
                stop_tokens: vec![reference[j]],
                ..base.clone()
            };
            let st = check(&m, 256, &p, &o, spec_opts(1, 3, 8), None, "stop token");
            assert_eq!(st.stop_reason, StopReason::Eos);
            assert_eq!(st.generated_tokens as usize, j);
            let s = st.speculative.unwrap();
            accepted += s.accepted;
            stops += 1;
        }
        // max_tokens at every length, and cancellation at every token.
        for n in 1..=24 {
            let o = GenerateOptions {
                max_tokens: n,
                ..base.clone()
            };
            let st = check(&m, 256, &p, &o, spec_opts(1, 3, 8), None, "max_tokens");
            assert_eq!(st.stop_reason, StopReason::MaxTokens);
            accepted += st.speculative.unwrap().accepted;
            let st = check(
                &m,
                256,
                &p,
                &base,
                spec_opts(1, 3, 8),
                Some(n as usize),
                "cancel",
            );
            assert_eq!(st.stop_reason, StopReason::Cancelled);
        }
        // A context that fills up inside a draft, at every room left.
        for ctx in p.len() as u32 + 1..p.len() as u32 + 20 {
            let st = check(&m, ctx, &p, &base, spec_opts(1, 3, 8), None, "context full");
            assert_eq!(st.stop_reason, StopReason::ContextFull);
            accepted += st.speculative.unwrap().accepted;
        }
    }
    assert!(stops > 20, "only {stops} stop-token cases");
    assert!(accepted > 0, "no draft accepted");
}

#[test]
fn verified_logits_equal_plain_logits_bit_for_bit() {
    // 8-bit activations: Q4_0 through the repacked kernels (where the CPU
    // has them), Q4_1 through the plain ones.
    for (dtype, q8) in [
        (DType::F32, false),
        (DType::Q8_0, false),
        (DType::Q4_0, true),
        (DType::Q4_1, true),
    ] {
        let m = tiny_model(dtype);
        let (_, p) = prompts(&m).into_iter().next().unwrap();
        let mut logits = Vec::new();
        let mut accepted = 0;
        for speculative in [false, true] {
            let mut e = engine_with(&m, 256, q8);
            if dtype == DType::Q4_0 && akunu_cpu::quant::q4x8::enabled() {
                let d = e.backend_description();
                assert!(d.contains("repacked"), "{d}");
            }
            let sink = Arc::new(Mutex::new(Vec::new()));
            let s2 = sink.clone();
            e.set_logits_probe(Some(Box::new(move |l: &[f32]| {
                s2.lock().unwrap().push(l.to_vec())
            })));
            let o = GenerateOptions {
                max_tokens: 40,
                ignore_eos: true,
                speculative,
                spec: spec_opts(1, 3, 8),
                ..Default::default()
            };
            let (_, st) = gen_with(&mut e, &p, &o, None);
            if let Some(s) = st.speculative {
                accepted += s.accepted;
            }
            logits.push(sink.lock().unwrap().clone());
        }
        assert!(accepted > 0);
        assert_eq!(logits[0].len(), logits[1].len());
        for (i, (a, b)) in logits[0].iter().zip(&logits[1]).enumerate() {
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{dtype:?} q8 {q8}: logits of token {i} differ");
        }
    }
}

#[test]
fn bad_speculative_options_are_errors() {
    let m = tiny_model(DType::F32);
    let (_, p) = prompts(&m).into_iter().next().unwrap();
    for spec in [
        spec_opts(0, 2, 4),
        spec_opts(3, 2, 4),
        spec_opts(1, 2, 0),
        spec_opts(1, 2, 99),
    ] {
        let o = GenerateOptions {
            max_tokens: 4,
            speculative: true,
            spec,
            ..Default::default()
        };
        let err = engine(&m, 64)
            .generate(&p, &o, &mut |_, _| true)
            .unwrap_err();
        assert!(err.to_string().contains("invalid option"), "{err}");
    }
}
