//! Engine-level properties on a small random-weight model (written by
//! `akunu_core::synth`, so the tests need no download):
//! chain decode of N tokens per submission equals N one-token submissions,
//! multi-turn continuation equals one-shot generation, prefill equals
//! token-by-token decode, and context limits are errors, not overflows.

use akunu_core::decode::{
    Constraint, DecodePath, Engine, EngineError, EngineOptions, GenerateOptions, StopReason,
};
use akunu_core::dtype::DType;
use akunu_core::model::Model;
use akunu_core::sampling::SamplingConfig;
use akunu_core::synth::{Shape, SynthArch, SynthSpec, write_synthetic};
use akunu_cpu::CpuBackend;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

/// Synthetic models already written by this test process, by architecture
/// and type.
type ModelCache = Mutex<Vec<((SynthArch, DType), Arc<Model>)>>;

fn tiny_model(dtype: DType) -> Arc<Model> {
    tiny_arch_model(SynthArch::Llama, dtype)
}

fn tiny_arch_model(arch: SynthArch, dtype: DType) -> Arc<Model> {
    static MODELS: OnceLock<ModelCache> = OnceLock::new();
    let cache = MODELS.get_or_init(|| Mutex::new(Vec::new()));
    let mut c = cache.lock().unwrap();
    if let Some((_, m)) = c.iter().find(|(k, _)| *k == (arch, dtype)) {
        return m.clone();
    }
    let path: PathBuf = std::env::temp_dir().join(format!(
        "akunu-engine-test-{}-{arch}-{}.gguf",
        std::process::id(),
        dtype.name()
    ));
    let spec = SynthSpec {
        shape: Shape::Tiny,
        arch,
        dtype,
        seed: 7,
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
    c.push(((arch, dtype), m.clone()));
    m
}

fn engine(model: &Arc<Model>, chunk: u32, threads: usize) -> Engine {
    let opts = EngineOptions {
        ctx: Some(256),
        chunk,
        prefill_chunk: 64,
    };
    Engine::new(model.clone(), Box::new(CpuBackend::new(threads)), &opts).expect("engine")
}

/// Generates `n` tokens after `prompt`, recording every step's logits.
fn run(e: &mut Engine, prompt: &[u32], n: u32) -> (Vec<u32>, Vec<Vec<f32>>) {
    let logits = Arc::new(Mutex::new(Vec::new()));
    let sink = logits.clone();
    e.set_logits_probe(Some(Box::new(move |l: &[f32]| {
        sink.lock().unwrap().push(l.to_vec())
    })));
    let mut ids = Vec::new();
    let st = e.generate(
        prompt,
        &GenerateOptions {
            max_tokens: n,
            ignore_eos: true,
            ..Default::default()
        },
        &mut |id, _| {
            ids.push(id);
            true
        },
    );
    let st = st.expect("generate");
    assert_eq!(st.generated_tokens, n);
    e.set_logits_probe(None);
    let l = logits.lock().unwrap().clone();
    (ids, l)
}

fn prompt(m: &Model) -> Vec<u32> {
    m.tokenizer
        .encode(
            "<|im_start|>user\nthe theory of the tide<|im_end|>\n",
            true,
            true,
        )
        .unwrap()
}

#[test]
fn chain_of_n_equals_n_single_steps() {
    for dtype in [DType::F32, DType::Q4_1, DType::Q8_0] {
        let m = tiny_model(dtype);
        let p = prompt(&m);
        let (ref_ids, ref_logits) = run(&mut engine(&m, 1, 2), &p, 23);
        assert_eq!(
            ref_logits.len(),
            23,
            "one logits vector per generated token"
        );
        for chunk in [2, 5, 8, 16, 23, 64] {
            let (ids, logits) = run(&mut engine(&m, chunk, 2), &p, 23);
            assert_eq!(ids, ref_ids, "{dtype} chunk {chunk}: tokens differ");
            for (i, (a, b)) in logits.iter().zip(&ref_logits).enumerate() {
                let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(
                    same,
                    "{dtype} chunk {chunk}: logits of step {i} are not bit-identical"
                );
            }
        }
    }
}

/// The engine properties above on the other architectures: chains equal
/// single steps bit for bit, prefill equals token-by-token decode, and a
/// second turn equals one-shot generation, with prompts and generations
/// longer than Gemma 3's 8-position window.
#[test]
fn every_architecture_keeps_the_engine_properties() {
    for arch in [SynthArch::Qwen2, SynthArch::Qwen3, SynthArch::Gemma3] {
        let m = tiny_arch_model(arch, DType::Q8_0);
        let p = prompt(&m);
        assert!(p.len() > 8);
        let (ref_ids, ref_logits) = run(&mut engine(&m, 1, 2), &p, 20);
        for chunk in [5, 16] {
            let (ids, logits) = run(&mut engine(&m, chunk, 2), &p, 20);
            assert_eq!(ids, ref_ids, "{arch} chunk {chunk}: tokens differ");
            assert!(
                logits == ref_logits,
                "{arch} chunk {chunk}: logits not bit-identical"
            );
        }
        let batched = engine(&m, 1, 2).eval_logits(&p).unwrap();
        let mut e = engine(&m, 1, 2);
        let mut last = Vec::new();
        for &t in &p {
            last = e.eval_logits(&[t]).unwrap();
        }
        let num: f64 = batched
            .iter()
            .zip(&last)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        let den: f64 = last.iter().map(|&b| (b as f64).powi(2)).sum();
        let rel = (num / den).sqrt();
        assert!(rel < 1e-5, "{arch}: prefill vs stepwise relative L2 {rel}");
        let mut e = engine(&m, 4, 2);
        let (g1, _) = run(&mut e, &p, 6);
        let (g2, _) = run(&mut e, &p, 7);
        let mut whole = p.clone();
        whole.extend(&g1);
        whole.extend(&p);
        assert_eq!(run(&mut engine(&m, 4, 2), &whole, 7).0, g2, "{arch}: turns");
    }
}

#[test]
fn results_do_not_depend_on_thread_count() {
    let m = tiny_model(DType::Q4_0);
    let p = prompt(&m);
    let (a, la) = run(&mut engine(&m, 4, 1), &p, 12);
    let (b, lb) = run(&mut engine(&m, 4, 3), &p, 12);
    assert_eq!(a, b);
    assert_eq!(la, lb);
    // 8-bit activations, where Q4_0 decodes through the repacked copy: a
    // row runs the same kernel whatever the thread count.
    let q8 = |threads| {
        let mut be = CpuBackend::new(threads);
        be.set_q8_activations(true);
        let opts = EngineOptions {
            ctx: Some(256),
            chunk: 4,
            prefill_chunk: 64,
        };
        Engine::new(m.clone(), Box::new(be), &opts).expect("engine")
    };
    let (a, la) = run(&mut q8(1), &p, 12);
    let (b, lb) = run(&mut q8(3), &p, 12);
    assert_eq!(a, b);
    assert_eq!(la, lb);
}

#[test]
fn multi_turn_continuation_equals_one_shot() {
    let m = tiny_model(DType::F16);
    let p1 = prompt(&m);
    let p2 = m
        .tokenizer
        .encode("<|im_start|>user\nand then?<|im_end|>\n", true, true)
        .unwrap();
    let mut e = engine(&m, 4, 2);
    let (g1, _) = run(&mut e, &p1, 9);
    let (g2, _) = run(&mut e, &p2, 11);
    assert_eq!(
        e.position() as usize,
        p1.len() + 9 + p2.len() + 10,
        "the last token is pending, not yet in the cache"
    );

    let mut whole = p1.clone();
    whole.extend(&g1);
    whole.extend(&p2);
    let (g2_oneshot, _) = run(&mut engine(&m, 4, 2), &whole, 11);
    assert_eq!(g2, g2_oneshot);
    // The history is the concatenation too.
    let mut hist = whole.clone();
    hist.extend(&g2);
    assert_eq!(e.history(), &hist[..]);
}

/// Rewinding to n tokens and generating equals generating from scratch over
/// those n tokens plus the new prompt: kept positions are reused, later ones
/// are overwritten, greedy and sampled, rewinding into the fed part and to
/// the pending token.
#[test]
fn generation_after_rewind_equals_generation_from_scratch() {
    let m = tiny_model(DType::F16);
    let p1 = prompt(&m);
    let p2 = m
        .tokenizer
        .encode("<|im_start|>user\nand then?<|im_end|>\n", true, true)
        .unwrap();
    for opts in [
        GenerateOptions {
            max_tokens: 10,
            ignore_eos: true,
            ..Default::default()
        },
        sampled_opts(10, 99),
    ] {
        let mut e = engine(&m, 4, 2);
        let g1 = run_opts(&mut e, &p1, &opts);
        let total = p1.len() + g1.len();
        assert_eq!(e.history().len(), total);
        // Into the prompt (fed tokens), and to the full sequence (whose last
        // token is pending).
        for keep in [p1.len() - 3, total] {
            let mut e2 = engine(&m, 4, 2);
            run_opts(&mut e2, &p1, &opts);
            e2.rewind(keep).unwrap();
            assert_eq!(e2.history().len(), keep);
            assert!(e2.position() as usize <= keep);
            let after = run_opts(&mut e2, &p2, &opts);

            let mut whole = p1.clone();
            whole.extend(&g1);
            whole.truncate(keep);
            whole.extend(&p2);
            let scratch = run_opts(&mut engine(&m, 4, 2), &whole, &opts);
            assert_eq!(after, scratch, "keep {keep}: tokens differ after rewind");
        }
        assert!(
            e.rewind(total + 1).is_err(),
            "rewinding past the end is an error"
        );
    }
}

/// `reuse_prefix` keeps the common prefix but always leaves a token to feed,
/// and what follows equals generation from scratch.
#[test]
fn reuse_prefix_keeps_common_prefix() {
    let m = tiny_model(DType::F16);
    let p1 = prompt(&m);
    let opts = GenerateOptions {
        max_tokens: 6,
        ignore_eos: true,
        ..Default::default()
    };
    let mut e = engine(&m, 4, 2);
    let g1 = run_opts(&mut e, &p1, &opts);
    // A follow-up that resends the conversation and adds a turn.
    let mut next = p1.clone();
    next.extend(&g1);
    next.extend(m.tokenizer.encode("more", false, true).unwrap());
    let kept = e.reuse_prefix(&next);
    assert_eq!(kept, p1.len() + g1.len());
    let a = run_opts(&mut e, &next[kept..], &opts);
    let b = run_opts(&mut engine(&m, 4, 2), &next, &opts);
    assert_eq!(a, b);
    // The same request again: everything but its last token is kept.
    let mut e = engine(&m, 4, 2);
    run_opts(&mut e, &p1, &opts);
    assert_eq!(e.reuse_prefix(&p1), p1.len() - 1);
    let a = run_opts(&mut e, &p1[p1.len() - 1..], &opts);
    assert_eq!(a, g1);
    // A diverging prompt keeps only the shared part.
    let mut other = p1[..4].to_vec();
    other.extend(m.tokenizer.encode("elsewhere", false, true).unwrap());
    assert_eq!(e.reuse_prefix(&other), 4);
    let a = run_opts(&mut e, &other[4..], &opts);
    let b = run_opts(&mut engine(&m, 4, 2), &other, &opts);
    assert_eq!(a, b);
}

#[test]
fn prefill_matches_token_by_token_decode() {
    let m = tiny_model(DType::F32);
    let p = prompt(&m);
    // Batched prefill of the whole prompt ...
    let batched = engine(&m, 1, 2).eval_logits(&p).unwrap();
    // ... against feeding the prompt one token per prefill step.
    let mut e = engine(&m, 1, 2);
    let mut last = Vec::new();
    for &t in &p {
        last = e.eval_logits(&[t]).unwrap();
    }
    let (num, den) = batched
        .iter()
        .zip(&last)
        .fold((0f64, 0f64), |(n, d), (a, b)| {
            (n + ((a - b) as f64).powi(2), d + (*b as f64).powi(2))
        });
    let rel = (num / den).sqrt();
    assert!(rel < 1e-5, "prefill vs stepwise relative L2 {rel}");
}

/// An f16 KV cache: half the cache memory; prefill, a chain of steps and
/// step-by-step decode agree as with f32 (every path reads the same
/// rounded values back); the logits move from the f32 cache's by the
/// rounding alone (nonzero, under 1e-2).
#[test]
fn f16_kv_cache_keeps_the_engine_properties() {
    use akunu_core::ops::KvType;
    let m = tiny_model(DType::F32);
    let p = prompt(&m);
    let with = |kv: KvType, chunk: u32| {
        let mut be = CpuBackend::new(2);
        be.set_kv_type(kv);
        let opts = EngineOptions {
            ctx: Some(256),
            chunk,
            prefill_chunk: 64,
        };
        Engine::new(m.clone(), Box::new(be), &opts).expect("engine")
    };
    let rel = |a: &[f32], b: &[f32]| {
        let (n, d) = a.iter().zip(b).fold((0f64, 0f64), |(n, d), (x, y)| {
            (n + ((x - y) as f64).powi(2), d + (*y as f64).powi(2))
        });
        (n / d).sqrt()
    };
    let mut e16 = with(KvType::F16, 8);
    assert!(e16.backend_description().contains("f16 KV cache"));
    let l16 = e16.eval_logits(&p).unwrap();
    let l32 = with(KvType::F32, 8).eval_logits(&p).unwrap();
    let r = rel(&l16, &l32);
    eprintln!("f16 against f32 cache: prompt logits rel-L2 {r:.2e}");
    assert!(r > 0.0 && r < 1e-2, "f16 against f32 cache: rel-L2 {r}");

    let mut stepwise = with(KvType::F16, 1);
    let mut last = Vec::new();
    for &t in &p {
        last = stepwise.eval_logits(&[t]).unwrap();
    }
    let r = rel(&l16, &last);
    assert!(r < 1e-5, "f16 cache: prefill vs stepwise relative L2 {r}");

    // A chain of 12 against 12 one-step chains, after the same prompt.
    let (a, la) = run(&mut with(KvType::F16, 12), &p, 12);
    let (b, lb) = run(&mut with(KvType::F16, 1), &p, 12);
    assert_eq!(a, b);
    assert_eq!(la, lb);
}

#[test]
fn max_tokens_zero_evaluates_prompt_only() {
    let m = tiny_model(DType::F32);
    let p = prompt(&m);
    let mut e = engine(&m, 4, 1);
    let st = e
        .generate(
            &p,
            &GenerateOptions {
                max_tokens: 0,
                ignore_eos: false,
                ..Default::default()
            },
            &mut |_, _| panic!("no token expected"),
        )
        .unwrap();
    assert_eq!(st.stop_reason, StopReason::PromptOnly);
    assert_eq!(st.generated_tokens, 0);
    assert_eq!(e.position() as usize, p.len());
}

#[test]
fn callback_cancels() {
    let m = tiny_model(DType::F32);
    let p = prompt(&m);
    let mut e = engine(&m, 8, 1);
    let mut n = 0;
    let st = e
        .generate(
            &p,
            &GenerateOptions {
                max_tokens: 50,
                ignore_eos: true,
                ..Default::default()
            },
            &mut |_, _| {
                n += 1;
                n < 5
            },
        )
        .unwrap();
    assert_eq!(st.stop_reason, StopReason::Cancelled);
    assert_eq!(st.generated_tokens, 5);
    assert_eq!(n, 5);
}

#[test]
fn context_limits_are_errors_not_overflows() {
    let m = tiny_model(DType::F32);
    let opts = EngineOptions {
        ctx: Some(16),
        chunk: 8,
        prefill_chunk: 8,
    };
    let mut e = Engine::new(m.clone(), Box::new(CpuBackend::new(1)), &opts).unwrap();
    let long: Vec<u32> = (0..17).map(|i| 3 + i % 50).collect();
    match e.generate(
        &long,
        &GenerateOptions {
            max_tokens: 1,
            ignore_eos: true,
            ..Default::default()
        },
        &mut |_, _| true,
    ) {
        Err(EngineError::ContextOverflow {
            needed: 17,
            capacity: 16,
            ..
        }) => {}
        other => panic!("expected a context overflow error, got {other:?}"),
    }
    // Generation that reaches the end of the cache stops cleanly.
    let st = e
        .generate(
            &long[..10],
            &GenerateOptions {
                max_tokens: 100,
                ignore_eos: true,
                ..Default::default()
            },
            &mut |_, _| true,
        )
        .unwrap();
    assert_eq!(st.stop_reason, StopReason::ContextFull);
    assert_eq!(st.position, 16);
    assert_eq!(
        st.generated_tokens, 7,
        "10 prompt positions + 6 decode steps fill 16; the 7th token is produced but never fed"
    );
    // Token ids outside the vocabulary are rejected.
    e.reset();
    assert!(matches!(
        e.eval_logits(&[1_000_000]),
        Err(EngineError::BadToken { .. })
    ));
    assert!(matches!(e.eval_logits(&[]), Err(EngineError::EmptyPrompt)));
}

fn sampled_opts(n: u32, seed: u64) -> GenerateOptions {
    GenerateOptions {
        max_tokens: n,
        ignore_eos: true,
        sampling: SamplingConfig {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.02,
            repeat_penalty: 1.2,
            repeat_last_n: 16,
            seed,
        },
        ..Default::default()
    }
}

fn run_opts(e: &mut Engine, prompt: &[u32], opts: &GenerateOptions) -> Vec<u32> {
    let mut ids = Vec::new();
    let st = e
        .generate(prompt, opts, &mut |id, _| {
            ids.push(id);
            true
        })
        .unwrap();
    assert_eq!(st.generated_tokens, opts.max_tokens);
    ids
}

#[test]
fn sampled_tokens_do_not_depend_on_chunk_size() {
    let m = tiny_model(DType::Q8_0);
    let p = prompt(&m);
    let reference = run_opts(&mut engine(&m, 1, 2), &p, &sampled_opts(30, 42));
    for chunk in [2, 3, 8, 16, 64] {
        assert_eq!(
            run_opts(&mut engine(&m, chunk, 2), &p, &sampled_opts(30, 42)),
            reference,
            "chunk {chunk}"
        );
    }
    // Same seed, same tokens; another seed, other tokens.
    assert_eq!(
        run_opts(&mut engine(&m, 4, 1), &p, &sampled_opts(30, 42)),
        reference
    );
    assert_ne!(
        run_opts(&mut engine(&m, 4, 1), &p, &sampled_opts(30, 43)),
        reference
    );
    // A sampled multi-turn continuation equals one-shot sampling over the
    // concatenated tokens: the noise is keyed by position, not by call.
    let mut e = engine(&m, 4, 2);
    let g1 = run_opts(&mut e, &p, &sampled_opts(7, 5));
    let g2 = run_opts(&mut e, &p, &sampled_opts(9, 5));
    let mut whole = p.clone();
    whole.extend(&g1);
    whole.extend(&p);
    assert_eq!(
        run_opts(&mut engine(&m, 4, 2), &whole, &sampled_opts(9, 5)),
        g2
    );
}

#[test]
fn temperature_zero_through_the_sampled_table_is_greedy() {
    let m = tiny_model(DType::Q4_1);
    let p = prompt(&m);
    let greedy = run_opts(
        &mut engine(&m, 8, 2),
        &p,
        &GenerateOptions {
            max_tokens: 25,
            ignore_eos: true,
            ..Default::default()
        },
    );
    let mut opts = sampled_opts(25, 9);
    opts.sampling.temperature = 0.0;
    opts.sampling.repeat_penalty = 1.0;
    opts.force_path = Some(DecodePath::Sampled);
    assert_eq!(run_opts(&mut engine(&m, 8, 2), &p, &opts), greedy);
}

#[test]
fn decode_path_selection() {
    let mut o = GenerateOptions::default();
    assert_eq!(o.decode_path(), DecodePath::Greedy);
    o.speculative = true;
    assert_eq!(o.decode_path(), DecodePath::Speculative);
    o.sampling.temperature = 0.5;
    assert_eq!(
        o.decode_path(),
        DecodePath::Speculative,
        "speculation verifies sampled tokens too"
    );
    o.speculative = false;
    assert_eq!(o.decode_path(), DecodePath::Sampled);
    o.constraint = Some(Constraint::JsonObject);
    assert_eq!(
        o.decode_path(),
        DecodePath::Grammar,
        "a grammar wins over everything"
    );
    // The grammar path runs (crates/akunu-cpu/tests/grammar.rs tests it).
    let m = tiny_model(DType::F32);
    let p = prompt(&m);
    let st = engine(&m, 4, 1)
        .generate(&p, &o, &mut |_, _| true)
        .expect("grammar path");
    assert_eq!(st.path, DecodePath::Grammar);
    // The speculative path runs too (crates/akunu-cpu/tests/speculative.rs).
    let spec = GenerateOptions {
        speculative: true,
        max_tokens: 4,
        ..Default::default()
    };
    let st = engine(&m, 4, 1)
        .generate(&p, &spec, &mut |_, _| true)
        .expect("speculative path");
    assert_eq!(st.path, DecodePath::Speculative);
    // Invalid sampling values are errors before any work.
    let mut bad = sampled_opts(4, 1);
    bad.sampling.top_p = 1.5;
    let err = engine(&m, 4, 1)
        .generate(&p, &bad, &mut |_, _| true)
        .unwrap_err();
    assert!(err.to_string().contains("top_p"), "{err}");
}
