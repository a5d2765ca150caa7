//! GPU tests: the CUDA backend against the CPU backend (the reference, itself
//! checked against a NumPy forward pass in CI) on the same model files.
//!
//! They need an NVIDIA GPU, so they are `#[ignore]`d in ordinary test runs;
//! `scripts/gpu.sh` runs them on the GPU machine with `--ignored`. Models are
//! random-weight GGUFs written here (`akunu_core::synth`); with
//! `AKUNU_TEST_MODEL=PATH` the real default model is checked too.

use akunu_core::backend::Backend;
use akunu_core::decode::{Engine, EngineOptions, GenerateOptions};
use akunu_core::dtype::DType;
use akunu_core::model::Model;
use akunu_core::ops::KvType;
use akunu_core::sampling::SamplingConfig;
use akunu_core::synth::{Shape, SynthArch, SynthSpec, write_synthetic};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// The CUDA backend with an f32 KV cache: the comparisons with the CPU at
/// 1e-4 hold every kernel to f32 accuracy. With the default f16 cache a
/// K or V element within a rounding step's width of an f16 midpoint may
/// round differently on the two backends (their sums differ in the last
/// bits), which alone moves the logits by up to about 2e-4;
/// `f16_kv_cache_matches_cpu` and the persistent test take that cache.
fn cuda() -> Box<dyn Backend> {
    cuda_kv(KvType::F32)
}

/// The CPU reference, with an f32 KV cache as `cuda()`.
fn cpu() -> Box<dyn Backend> {
    cpu_kv(KvType::F32)
}

/// The CPU reference with a KV cache of `kv` (f16: K and V rounded to f16
/// when written, as the GPU rounds them).
fn cpu_kv(kv: KvType) -> Box<dyn Backend> {
    let mut be = akunu_cpu::CpuBackend::new(0);
    be.set_kv_type(kv);
    Box::new(be)
}

/// The CUDA backend with a KV cache of `kv`, its greedy chains on the
/// graph (the persistent decode, on by default on sm_90, has tests of its
/// own: `persistent_chain_matches_cpu`), so that these tests keep covering
/// the table's kernels.
fn cuda_kv(kv: KvType) -> Box<dyn Backend> {
    let mut be = akunu_cuda::CudaBackend::with_kv_type(0, kv, &mut |m| eprintln!("{m}"))
        .expect("CUDA backend");
    be.set_persistent(false);
    Box::new(be)
}

/// The default model's vocabulary (a vocab-only GGUF kept in the repo), for
/// synthetic models of real shapes.
fn vocab() -> PathBuf {
    vocab_file("smollm2")
}

/// The vocab-only GGUF `ggml-vocab-{name}.gguf` kept in the repo (llama.cpp's
/// tokenizer test files).
fn vocab_file(name: &str) -> PathBuf {
    let rel = format!("crates/akunu-core/tests/data/tokenizer/ggml-vocab-{name}.gguf");
    let candidates = [
        std::env::var("AKUNU_REPO")
            .map(|r| PathBuf::from(r).join(&rel))
            .unwrap_or_default(),
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(&rel),
        PathBuf::from(&rel),
    ];
    candidates
        .into_iter()
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("{rel} not found (set AKUNU_REPO to the repository root)"))
}

fn synth(shape: Shape, dtype: DType) -> Arc<Model> {
    synth_arch(SynthArch::Llama, shape, dtype)
}

fn synth_arch(arch: SynthArch, shape: Shape, dtype: DType) -> Arc<Model> {
    synth_vocab(arch, shape, dtype, shape.needs_tokenizer(), false)
}

/// A tiny shape with SmolLM2's 49,152-token vocabulary: its logits product
/// has enough row tiles for the bulk-copy gemv (`launch::tcb_plan`), which
/// the built-in vocabulary's 300-odd rows do not.
fn synth_big_vocab(shape: Shape, dtype: DType) -> Arc<Model> {
    synth_vocab(SynthArch::Llama, shape, dtype, true, false)
}

/// A synthetic model; `rope_freqs`: with Llama 3.1-style RoPE divisors.
fn synth_vocab(
    arch: SynthArch,
    shape: Shape,
    dtype: DType,
    big_vocab: bool,
    rope_freqs: bool,
) -> Arc<Model> {
    synth_loads(arch, shape, dtype, big_vocab.then(vocab), rope_freqs, 1).remove(0)
}

/// `loads` loads of one synthetic model's file (the tokenizer copied from
/// `tokenizer`, else the built-in one): the first as written, the others
/// with `config.rope_freqs` off (the same weights, RoPE without the file's
/// divisors: a control that shows whether a test sees them).
fn synth_loads(
    arch: SynthArch,
    shape: Shape,
    dtype: DType,
    tokenizer: Option<PathBuf>,
    rope_freqs: bool,
    loads: usize,
) -> Vec<Arc<Model>> {
    let path = std::env::temp_dir().join(format!(
        "akunu-gpu-test-{}-{arch}-{shape}-{}-{}{}.gguf",
        std::process::id(),
        dtype.name(),
        tokenizer
            .as_deref()
            .and_then(|t| t.file_stem())
            .map_or("builtin".into(), |s| s.to_string_lossy()),
        if rope_freqs { "-rope-freqs" } else { "" }
    ));
    let spec = SynthSpec {
        shape,
        arch,
        dtype,
        seed: 11,
        tokenizer_from: tokenizer,
        embedding: None,
        output: None,
        rope_freqs,
    };
    write_synthetic(&path, &spec, &mut |_, _| {}).expect("writing a synthetic model");
    let models = (0..loads)
        .map(|i| {
            let mut m = Model::load(&path).expect("loading it");
            if i > 0 {
                m.config.rope_freqs = false;
            }
            Arc::new(m)
        })
        .collect();
    let _ = std::fs::remove_file(&path);
    models
}

/// `base` with the tensors whose names end with one of `take` copied from
/// `other` (same shape, another type): a Q4_K_M-like mix, whose fused QKV
/// products have segments of different types.
fn mixed(base: &Model, other: &Model, take: &[&str], name: &str) -> Arc<Model> {
    let mut w = akunu_core::gguf_write::GgufWriter::new();
    for (k, v) in &base.file.metadata {
        if k != "general.alignment" {
            w.kv(k.clone(), v.clone()).expect("metadata");
        }
    }
    for t in &base.file.tensors {
        let (f, t) = if take.iter().any(|s| t.name.ends_with(s)) {
            (
                &other.file,
                other.file.tensor(&t.name).expect("same tensors"),
            )
        } else {
            (&base.file, t)
        };
        w.tensor(t.name.clone(), &t.dims, t.dtype, f.tensor_data(t).to_vec())
            .expect("tensor");
    }
    let path =
        std::env::temp_dir().join(format!("akunu-gpu-test-{}-{name}.gguf", std::process::id()));
    w.write(&path).expect("writing the mixed model");
    let m = Arc::new(Model::load(&path).expect("loading it"));
    let _ = std::fs::remove_file(&path);
    m
}

fn engine(model: &Arc<Model>, be: Box<dyn Backend>, chunk: u32, prefill: u32) -> Engine {
    let opts = EngineOptions {
        ctx: Some(512),
        chunk,
        prefill_chunk: prefill,
    };
    Engine::new(model.clone(), be, &opts).expect("engine")
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        num += (*x as f64 - *y as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

fn top2_gap(l: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in l {
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
    }
    a - b
}

/// Where the GPU's greedy token `a` differs from the CPU's `b` at step `s`,
/// the CPU's logits `l` must show a near-tie (top-two gap under 1e-3 of
/// the largest magnitude); says so, so that the caller stops comparing.
fn assert_near_tie(what: &str, gpu: &str, s: usize, a: u32, b: u32, l: &[f32]) {
    let gap = top2_gap(l);
    assert!(
        gap < 1e-3 * l.iter().fold(1f32, |m, v| m.max(v.abs())),
        "{what}: step {s}: {gpu} chose {a}, CPU {b}, top-2 gap {gap}"
    );
    eprintln!("{what}: near-tie at step {s} (gap {gap}); stopping the comparison");
}

/// Tokens and per-step logits of a generation.
fn run(e: &mut Engine, prompt: &[u32], opts: &GenerateOptions) -> (Vec<u32>, Vec<Vec<f32>>) {
    let logits = Arc::new(Mutex::new(Vec::new()));
    let sink = logits.clone();
    e.set_logits_probe(Some(Box::new(move |l: &[f32]| {
        sink.lock().unwrap().push(l.to_vec())
    })));
    let mut ids = Vec::new();
    e.generate(prompt, opts, &mut |id, _| {
        ids.push(id);
        true
    })
    .expect("generate");
    e.set_logits_probe(None);
    let l = logits.lock().unwrap().clone();
    (ids, l)
}

fn prompt(n: u32, vocab: u32) -> Vec<u32> {
    (0..n).map(|i| (i * 7919 + 13) % vocab).collect()
}

/// Prefill (several chunks, the tiled product and prefill attention) and
/// decode logits within `tol` of the CPU's, greedy tokens equal except at
/// near-ties; returns the worst relative L2 error seen.
fn compare_with_cpu(model: &Arc<Model>, what: &str, tol: f64) -> f64 {
    compare_with_cpu_on(model, what, tol, 40, 16, cuda())
}

/// As `compare_with_cpu`, with a prompt of `n_prompt` tokens prefilled in
/// steps of up to `prefill` rows on the GPU backend `gpu`.
fn compare_with_cpu_on(
    model: &Arc<Model>,
    what: &str,
    tol: f64,
    n_prompt: u32,
    prefill: u32,
    gpu: Box<dyn Backend>,
) -> f64 {
    let n_vocab = model.config.n_vocab;
    let p = prompt(n_prompt, n_vocab);
    let mut c = engine(model, cpu_kv(gpu.kv_type()), 16, prefill);
    let mut g = engine(model, gpu, 16, prefill);
    let lc = c.eval_logits(&p).unwrap();
    let lg = g.eval_logits(&p).unwrap();
    let mut worst = rel_l2(&lg, &lc);
    eprintln!("{what}: prefill logits rel-L2 {worst:.2e}");
    assert!(worst < tol, "{what}: prefill logits differ by {worst:.2e}");
    let opts = GenerateOptions {
        max_tokens: 24,
        ignore_eos: true,
        ..Default::default()
    };
    // Continue the same sequence with one more prompt token.
    let more = [p[3]];
    let (tc, lcs) = run(&mut c, &more, &opts);
    let (tg, lgs) = run(&mut g, &more, &opts);
    for (s, (a, b)) in tg.iter().zip(&tc).enumerate() {
        let e = rel_l2(&lgs[s], &lcs[s]);
        worst = worst.max(e);
        assert!(e < tol, "{what}: decode step {s} logits differ by {e:.2e}");
        if a != b {
            assert_near_tie(what, "GPU", s, *a, *b, &lcs[s]);
            break;
        }
    }
    eprintln!(
        "{what}: worst rel-L2 {worst:.2e} over prefill and {} decode steps",
        tg.len()
    );
    worst
}

#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn logits_match_cpu_for_every_type() {
    for dt in [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
    ] {
        let m = synth(Shape::Tiny, dt);
        compare_with_cpu(&m, &format!("tiny {}", dt.name()), 1e-4);
    }
    // K-quants need rows of whole 256-element super-blocks (tiny's are 64
    // and 96 wide: they would fall back to Q5_0/Q5_1/Q8_0).
    for dt in [DType::Q4_K, DType::Q5_K, DType::Q6_K] {
        let m = synth(Shape::TinyK, dt);
        assert_eq!(m.file.tensor("blk.0.ffn_down.weight").unwrap().dtype, dt);
        compare_with_cpu(&m, &format!("tiny-k {}", dt.name()), 1e-4);
    }
    // Rows of 256 against a 49,152-row logits product: the bulk-copy gemv.
    for dt in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
        let m = synth_big_vocab(Shape::TinyK, dt);
        compare_with_cpu(&m, &format!("tiny-k, 49,152 vocab, {}", dt.name()), 1e-4);
    }
    // attn_v and ffn_down in Q6_K, the rest Q4_K (as in Q4_K_M files).
    let (q4k, q6k) = (
        synth(Shape::TinyK, DType::Q4_K),
        synth(Shape::TinyK, DType::Q6_K),
    );
    let m = mixed(&q4k, &q6k, &["attn_v.weight", "ffn_down.weight"], "q4_k_m");
    assert_eq!(
        m.file.tensor("blk.0.attn_v.weight").unwrap().dtype,
        DType::Q6_K
    );
    assert_eq!(
        m.file.tensor("blk.0.attn_q.weight").unwrap().dtype,
        DType::Q4_K
    );
    compare_with_cpu(&m, "tiny-k Q4_K + Q6_K mix", 1e-4);
}

/// Qwen2 (QKV biases), Qwen3 (QK norm, wide heads) and Gemma 3 (post-norms,
/// GeGLU, embedding scale, sliding windows with their own RoPE base,
/// soft-caps): the 40-token prompt runs well past Gemma's 8-position window,
/// in prefill chunks of 16 and then in decode.
#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn logits_match_cpu_for_every_architecture() {
    for arch in [SynthArch::Qwen2, SynthArch::Qwen3, SynthArch::Gemma3] {
        for dt in [DType::F32, DType::Q8_0, DType::Q4_1] {
            let m = synth_arch(arch, Shape::Tiny, dt);
            compare_with_cpu(&m, &format!("{arch} tiny {}", dt.name()), 1e-4);
        }
        // Real widths (576, 9 heads of 64; Gemma 3 with a 512 window).
        let m = synth_arch(arch, Shape::SmolLm2_135M, DType::Q8_0);
        compare_with_cpu(&m, &format!("{arch} smollm2-135m q8_0"), 1e-4);
    }
    // Llama with Llama 3.1-style RoPE divisors (`rope_freqs.weight`; the
    // CPU's against the NumPy reference: tools/arch_parity.py) on the graph;
    // the persistent kernels' (which take them too) in
    // `persistent_chain_matches_cpu` and `streaming_chain_matches_cpu`.
    for (shape, dt) in [
        (Shape::Tiny, DType::F32),
        (Shape::SmolLm2_135M, DType::Q4_1),
    ] {
        let m = synth_vocab(SynthArch::Llama, shape, dt, shape.needs_tokenizer(), true);
        assert!(m.config.rope_freqs);
        compare_with_cpu(
            &m,
            &format!("llama {shape} {} with rope_freqs", dt.name()),
            1e-4,
        );
    }
}

/// A persistent kernel's greedy tokens of a model with Llama 3.1-style RoPE
/// divisors after a prompt of `n_prompt` tokens against the CPU's (as
/// `persistent_against_cpu`); then, so that the check sees the divisors,
/// the logits of one more token, which attends to the keys the kernel
/// rotated: within 1e-3 of the CPU's over the same sequence, and at least
/// ten times closer to them than the CPU's without the divisors are.
/// (Tokens alone cannot show it on every shape: on the SmolLM2 one the
/// divisors change none of 64 greedy tokens, after 20 prompt tokens or 300.)
fn persistent_rope_freqs_against_cpu(
    shape: Shape,
    dt: DType,
    n_prompt: u32,
    opts: &GenerateOptions,
) {
    let ms = synth_loads(SynthArch::Llama, shape, dt, Some(vocab()), true, 2);
    assert!(ms[0].config.rope_freqs && !ms[1].config.rope_freqs);
    let what = format!("llama {shape} {} with rope_freqs, persistent", dt.name());
    let p = prompt(n_prompt, ms[0].config.n_vocab);
    let (tg, _) = persistent_against_cpu(&ms[0], &p, opts, &what);
    // A second persistent run, kept for the logits step (and as a check
    // that the kernel's tokens do not vary between launches).
    let (be, chains) = cuda_persistent();
    let mut g = engine(&ms[0], be, 64, 64);
    let mut again = Vec::new();
    g.generate(&p, opts, &mut |id, _| {
        again.push(id);
        true
    })
    .unwrap();
    assert!(chains.load(std::sync::atomic::Ordering::Relaxed) > 0);
    assert_eq!(again, tg, "{what}: a second run's tokens");
    let next = p[3];
    let lg = g.eval_logits(&[next]).unwrap();
    let seq: Vec<u32> = p.iter().chain(&tg).chain([&next]).copied().collect();
    let cpu_logits = |m: &Arc<Model>| {
        engine(m, cpu_kv(KvType::F16), 16, 64)
            .eval_logits(&seq)
            .unwrap()
    };
    let with = cpu_logits(&ms[0]);
    let err = rel_l2(&lg, &with);
    let effect = rel_l2(&cpu_logits(&ms[1]), &with);
    eprintln!(
        "{what}: logits after the chain rel-L2 {err:.2e}; the divisors move the CPU's by {effect:.2e}"
    );
    assert!(
        err < 1e-3,
        "{what}: logits after the chain differ by {err:.2e}"
    );
    assert!(
        err * 10.0 < effect,
        "{what}: logits after the chain {err:.2e} from the CPU's, the divisors' effect {effect:.2e}"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn logits_match_cpu_on_real_shapes() {
    // Q4_K: the 1536-wide ffn_down rows are Q4_K, the 576-wide rows fall
    // back to Q5_0 (as llama.cpp does).
    for dt in [DType::Q4_1, DType::F16, DType::Q4_K] {
        let m = synth(Shape::SmolLm2_135M, dt);
        compare_with_cpu(&m, &format!("smollm2-135m {}", dt.name()), 1e-4);
    }
    // Llama-1B: the FFN down product (k = 8,192) stages its plain input
    // raw (gemv_tc.cu `tcg_stage_raw`), on the unguarded register form
    // (Q4_0) and on the bulk-copy form (F16; Q4_0 too with
    // AKUNU_CUDA_TCB=all).
    for dt in [DType::Q4_0, DType::F16] {
        let m = synth(Shape::Llama1B, dt);
        compare_with_cpu(&m, &format!("llama-1b {}", dt.name()), 1e-4);
    }
    if let Ok(p) = std::env::var("AKUNU_TEST_MODEL") {
        let m = Arc::new(Model::load(std::path::Path::new(&p)).expect("AKUNU_TEST_MODEL"));
        compare_with_cpu(&m, "default model", 1e-4);
        // Long prefill steps: the cuBLAS products where cuBLAS loads.
        compare_with_cpu_on(
            &m,
            "default model, 300-token prefill",
            1e-4,
            300,
            256,
            cuda(),
        );
    }
}

/// The default f16 KV cache against the CPU's f16 cache, within 1e-3 (see
/// `cuda()`), on heads of 64 (SmolLM2, Llama-1B), 128 (Qwen3 on tiny-k)
/// and 256 (Gemma 3 on tiny-k: sliding windows), through prefill (300-token
/// prompts in steps of 256: the tensor-core and flash prefill attention),
/// decode, and the persistent decode's f32 instance against the CPU's f32
/// cache. And the f16 cache's logits stay within 1e-2 of the f32 cache's
/// (what the rounding costs).
#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn f16_kv_cache_matches_cpu() {
    let f16 = || cuda_kv(KvType::F16);
    let smol = synth(Shape::SmolLm2_135M, DType::Q4_1);
    compare_with_cpu_on(&smol, "smollm2 q4_1, f16 KV", 1e-3, 300, 256, f16());
    let l1b = synth(Shape::Llama1B, DType::F16);
    compare_with_cpu_on(&l1b, "llama-1b f16, f16 KV", 1e-3, 40, 16, f16());
    for arch in [SynthArch::Qwen3, SynthArch::Gemma3] {
        let m = synth_arch(arch, Shape::TinyK, DType::F16);
        compare_with_cpu_on(
            &m,
            &format!("{arch:?} tiny-k f16, f16 KV"),
            1e-3,
            300,
            256,
            f16(),
        );
    }
    let opts = GenerateOptions {
        max_tokens: 48,
        ignore_eos: true,
        ..Default::default()
    };
    let p = prompt(20, smol.config.n_vocab);
    persistent_against_cpu_kv(
        &smol,
        &p,
        &opts,
        "smollm2 q4_1, f32 KV, persistent",
        KvType::F32,
    );

    let p = prompt(300, smol.config.n_vocab);
    let mut a = engine(&smol, cuda_kv(KvType::F32), 16, 256);
    let mut b = engine(&smol, f16(), 16, 256);
    let e = rel_l2(&b.eval_logits(&p).unwrap(), &a.eval_logits(&p).unwrap());
    eprintln!("smollm2 q4_1: f16 against f32 KV cache, 300-token prefill logits rel-L2 {e:.2e}");
    assert!(e < 1e-2, "f16 KV cache moved the logits by {e:.2e}");
}

/// Prefill attention (`k_attn_tc_*` for heads up to 128, `k_attn_flash_*`
/// for wider ones or with `AKUNU_CUDA_PF_ATTN_TC=0`, `k_attn_prefill` with
/// `AKUNU_CUDA_PF_ATTN=0`) over many 64-row blocks: a 300-token prompt in
/// steps of 256 (4 row blocks, the last ragged, then 44 rows behind 256
/// cached positions) and of 100 (64 + 36 rows), on heads of 64 (SmolLM2,
/// 9 heads / 3 KV heads), 128 (Qwen3 on tiny-k) and 256 (Gemma 3 on
/// tiny-k: an 80-position window and soft-caps, so some rows see none of
/// the first key tiles).
#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn prefill_attention_matches_cpu_on_every_head_width() {
    let models = [
        (
            "smollm2-135m F32 (heads of 64)",
            synth(Shape::SmolLm2_135M, DType::F32),
        ),
        (
            "qwen3 tiny-k F32 (heads of 128)",
            synth_arch(SynthArch::Qwen3, Shape::TinyK, DType::F32),
        ),
        (
            "gemma3 tiny-k F32 (heads of 256, window 80)",
            synth_arch(SynthArch::Gemma3, Shape::TinyK, DType::F32),
        ),
    ];
    for (what, m) in &models {
        for step in [256, 100] {
            compare_with_cpu_on(
                m,
                &format!("{what}, prefill steps of {step}"),
                1e-4,
                300,
                step,
                cuda(),
            );
        }
    }
}

/// A CUDA backend (f32 KV cache, no persistent decode) with cuBLAS on or
/// off and a prefill weight cache policy; its counters of the commands run
/// on cuBLAS and of the bytes the cache holds.
fn cuda_cublas_cache(
    on: bool,
    cache: akunu_cuda::PrefillCache,
) -> (
    Box<dyn Backend>,
    Arc<std::sync::atomic::AtomicU64>,
    Arc<std::sync::atomic::AtomicU64>,
) {
    let mut be = akunu_cuda::CudaBackend::with_kv_type(0, KvType::F32, &mut |m| eprintln!("{m}"))
        .expect("CUDA backend");
    be.set_persistent(false);
    be.set_cublas(on);
    be.set_prefill_cache(cache);
    let n = be.cublas_commands();
    let bytes = be.prefill_cache_bytes();
    (Box::new(be), n, bytes)
}

/// Prefill steps of many rows (300 tokens in steps of 128, 128 and 44: the
/// last below the cuBLAS threshold of 64, so both paths run) with the
/// products on cuBLAS and on `k_gemm_tc`, each against the CPU, for every
/// type cuBLAS takes: F16 in place, Q8_0/Q4_0/Q4_1 dequantized; a fused QKV
/// of F16 and Q8_0 segments; Qwen2's QKV biases. cuBLAS runs with the
/// quantized weights in the prefill weight cache and without it (dequantized
/// a chunk at a time). Fails where cuBLAS cannot be loaded
/// (`AKUNU_CUDA_CUBLAS=1` prints why at backend creation).
#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn cublas_prefill_matches_cpu_with_and_without_cublas() {
    {
        let be = akunu_cuda::CudaBackend::new(0, &mut |m| eprintln!("{m}")).expect("CUDA backend");
        match be.cublas_status() {
            Ok(v) => eprintln!("cuBLAS {v}"),
            Err(why) => panic!("cuBLAS is not available: {why}"),
        }
    }
    let mut models = Vec::new();
    for dt in [DType::F16, DType::Q8_0, DType::Q4_0, DType::Q4_1] {
        models.push((
            format!("smollm2-135m {}", dt.name()),
            synth(Shape::SmolLm2_135M, dt),
        ));
    }
    let (f16, q8) = (
        synth(Shape::SmolLm2_135M, DType::F16),
        synth(Shape::SmolLm2_135M, DType::Q8_0),
    );
    models.push((
        "smollm2-135m F16 + Q8_0 attn_v".into(),
        mixed(&f16, &q8, &["attn_v.weight"], "f16_q8_0"),
    ));
    models.push((
        "qwen2 tiny Q4_0".into(),
        synth_arch(SynthArch::Qwen2, Shape::Tiny, DType::Q4_0),
    ));
    use akunu_cuda::PrefillCache;
    use std::sync::atomic::Ordering::Relaxed;
    for (what, m) in &models {
        let quantized = !what.ends_with("F16");
        let mut worst = [0f64; 3];
        let runs = [
            (true, PrefillCache::On, "cuBLAS on, weights cached"),
            (true, PrefillCache::Off, "cuBLAS on, no weight cache"),
            (false, PrefillCache::On, "cuBLAS off"),
        ];
        for (i, (on, cache, how)) in runs.into_iter().enumerate() {
            let (be, n, bytes) = cuda_cublas_cache(on, cache);
            let label = format!("{what}, {how}");
            worst[i] = compare_with_cpu_on(m, &label, 1e-4, 300, 128, be);
            let ran = n.load(Relaxed);
            if on {
                assert!(ran > 0, "{label}: no product ran on cuBLAS");
            } else {
                assert_eq!(ran, 0, "{label}: products ran on cuBLAS");
            }
            let cached = bytes.load(Relaxed);
            if on && cache == PrefillCache::On && quantized {
                assert!(cached > 0, "{label}: no weights cached");
            } else if !quantized || cache == PrefillCache::Off || !on {
                assert_eq!(cached, 0, "{label}: {cached} bytes cached");
            }
            eprintln!("{label}: {ran} commands on cuBLAS, {cached} bytes cached");
        }
        eprintln!(
            "{what}: worst rel-L2 cuBLAS cached {:.2e}, uncached {:.2e}, k_gemm_tc {:.2e}",
            worst[0], worst[1], worst[2]
        );
    }
}

/// `--prefill-products f16`: the cuBLAS products on f16-rounded operands
/// (one product per range) stay close to the CPU's f32 logits, but not as
/// close as the exact form (which the test above holds to 1e-4 and
/// measures near 1e-6): so the rounded form did run.
#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn f16_prefill_products_stay_close_to_cpu() {
    for dt in [DType::F16, DType::Q4_0, DType::Q8_0] {
        let m = synth(Shape::SmolLm2_135M, dt);
        let mut be =
            akunu_cuda::CudaBackend::new(0, &mut |m| eprintln!("{m}")).expect("CUDA backend");
        be.set_prefill_products(akunu_cuda::PrefillProducts::F16);
        assert!(be.describe().contains("f16 products"), "{}", be.describe());
        let n = be.cublas_commands();
        let label = format!("smollm2-135m {}, f16 prefill products", dt.name());
        let worst = compare_with_cpu_on(&m, &label, 1e-2, 300, 128, Box::new(be));
        assert!(
            n.load(std::sync::atomic::Ordering::Relaxed) > 0,
            "{label}: no cuBLAS product"
        );
        assert!(
            worst > 1e-5,
            "{label}: rel-L2 {worst:.2e}, as close as the exact form"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn chain_equals_single_steps() {
    let m = synth(Shape::SmolLm2_135M, DType::Q4_1);
    let p = prompt(20, m.config.n_vocab);
    let opts = GenerateOptions {
        max_tokens: 100,
        ignore_eos: true,
        ..Default::default()
    };
    let gen_ids = |e: &mut Engine| {
        let mut ids = Vec::new();
        e.generate(&p, &opts, &mut |id, _| {
            ids.push(id);
            true
        })
        .unwrap();
        ids
    };
    let mut single = engine(&m, cuda(), 1, 64);
    single.set_chain_decode(false);
    let want = gen_ids(&mut single);
    for chunk in [1, 7, 16, 64] {
        let mut e = engine(&m, cuda(), chunk, 64);
        assert_eq!(gen_ids(&mut e), want, "chain of {chunk} vs single steps");
        // A second generation continues the sequence through a fresh chain.
        e.reset();
        assert_eq!(gen_ids(&mut e), want, "chain of {chunk}, second run");
    }
}

/// A CUDA backend with the persistent greedy decode on, and its counter of
/// persistent chains.
fn cuda_persistent() -> (Box<dyn Backend>, Arc<std::sync::atomic::AtomicU64>) {
    cuda_persistent_kv(KvType::F16)
}

fn cuda_persistent_kv(kv: KvType) -> (Box<dyn Backend>, Arc<std::sync::atomic::AtomicU64>) {
    let mut be = akunu_cuda::CudaBackend::with_kv_type(0, kv, &mut |m| eprintln!("{m}"))
        .expect("CUDA backend");
    be.set_persistent(true);
    let n = be.persistent_chains();
    (Box::new(be), n)
}

/// Greedy tokens of `m` from `p` on the GPU with the persistent switch on,
/// checked against the CPU's (equal but after a near-tie; at least 8
/// compared); returns them and how many were compared.
fn persistent_against_cpu(
    m: &Arc<Model>,
    p: &[u32],
    opts: &GenerateOptions,
    what: &str,
) -> (Vec<u32>, usize) {
    persistent_against_cpu_kv(m, p, opts, what, KvType::F16)
}

/// As `persistent_against_cpu`, with both backends' KV caches of `kv`.
fn persistent_against_cpu_kv(
    m: &Arc<Model>,
    p: &[u32],
    opts: &GenerateOptions,
    what: &str,
    kv: KvType,
) -> (Vec<u32>, usize) {
    use std::sync::atomic::Ordering;
    let mut c = engine(m, cpu_kv(kv), 16, 64);
    let (tc, lcs) = run(&mut c, p, opts);
    let (be, chains) = cuda_persistent_kv(kv);
    let mut g = engine(m, be, 64, 64);
    let mut tg = Vec::new();
    g.generate(p, opts, &mut |id, _| {
        tg.push(id);
        true
    })
    .unwrap();
    assert!(
        chains.load(Ordering::Relaxed) > 0,
        "{what}: no chain ran persistent"
    );
    assert_eq!(tg.len(), tc.len(), "{what}: tokens generated");
    let mut same = tg.len();
    for (s, (a, b)) in tg.iter().zip(&tc).enumerate() {
        if a != b {
            assert_near_tie(what, "persistent", s, *a, *b, &lcs[s]);
            same = s;
            break;
        }
    }
    eprintln!("{what}: {same} of {} tokens equal to the CPU's", tg.len());
    assert!(same >= 8, "{what}: only {same} tokens compared");
    (tg, same)
}

/// On a fresh engine with the persistent switch on, for greedy tokens `tg`
/// of `m` from `p` (checked against the CPU's): the token `tg[stop_at]` as
/// a stop token ends the chain on the device, with nothing computed after
/// it; the sink ending the chain after `cancel_after` tokens stops the
/// kernel within `max_after` more; the engine then goes on from there.
#[allow(clippy::too_many_arguments)]
fn stop_and_cancel_inside_a_chain(
    m: &Arc<Model>,
    p: &[u32],
    opts: &GenerateOptions,
    tg: &[u32],
    stop_at: usize,
    cancel_after: usize,
    max_after: u32,
    what: &str,
) {
    let mut g = engine(m, cuda_persistent().0, 64, 64);
    let stop = tg[stop_at];
    let first = tg.iter().position(|&t| t == stop).unwrap();
    let mut got = Vec::new();
    let st = g
        .generate(
            p,
            &GenerateOptions {
                stop_tokens: vec![stop],
                ..opts.clone()
            },
            &mut |id, _| {
                got.push(id);
                true
            },
        )
        .unwrap();
    assert_eq!(got, tg[..first], "{what}: tokens before the stop token");
    assert_eq!(st.stop_reason, akunu_core::decode::StopReason::Eos);
    assert_eq!(
        st.computed_after_end,
        Some(0),
        "{what}: work after the stop"
    );
    // The kernel reads the raised `done` within a token or so and stops.
    g.reset();
    let mut got = Vec::new();
    let st = g
        .generate(p, opts, &mut |id, _| {
            got.push(id);
            got.len() < cancel_after
        })
        .unwrap();
    assert_eq!(
        got,
        tg[..cancel_after],
        "{what}: tokens before the cancellation"
    );
    eprintln!(
        "{what}: cancelled after {cancel_after} tokens, computed after the end {:?}",
        st.computed_after_end
    );
    assert!(
        st.computed_after_end.is_some_and(|n| n < max_after),
        "{what}: the kernel ran on after the cancellation: {:?}",
        st.computed_after_end
    );
    // The engine goes on from where the cancelled chain left it.
    let mut more = Vec::new();
    g.generate(
        &[],
        &GenerateOptions {
            max_tokens: 5,
            ..opts.clone()
        },
        &mut |id, _| {
            more.push(id);
            true
        },
    )
    .unwrap();
    assert_eq!(more.len(), 5, "{what}: a generation after the cancellation");
}

/// The streaming kernel (`stream.rs`, which the persistent switch gives
/// models too large for persist.cu) on the llama-1b F16 shape: greedy tokens
/// against the CPU's (equal but after a near-tie); a stop token inside the
/// chain (its producer warp must stop streaming and let its last copies
/// land); a cancellation by the sink; the engine going on after it; a
/// model with Llama 3.1-style RoPE divisors.
#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn streaming_chain_matches_cpu() {
    let m = synth(Shape::Llama1B, DType::F16);
    let what = "llama-1b f16 streaming";
    let opts = GenerateOptions {
        max_tokens: 32,
        ignore_eos: true,
        ..Default::default()
    };
    let p = prompt(20, m.config.n_vocab);
    let (tg, same) = persistent_against_cpu(&m, &p, &opts, what);
    stop_and_cancel_inside_a_chain(&m, &p, &opts, &tg, same.min(12) - 1, 5, 20, what);
    drop(m);
    // Llama 3.2-1B's files carry RoPE divisors (`rope_freqs.weight`).
    persistent_rope_freqs_against_cpu(Shape::Llama1B, DType::F16, 20, &opts);
}

/// The streaming kernel's in-kernel sampler (a sampled table's module) on
/// the llama-1b F16 shape: each sampler mode against the CPU, as
/// `persistent_sampled_chain_matches_cpu` checks the SmolLM2 kernel's.
#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn streaming_sampled_chain_matches_cpu() {
    let m = synth(Shape::Llama1B, DType::F16);
    let p = prompt(20, m.config.n_vocab);
    sampled_chains_against_cpu(&m, &p, 24, "llama-1b f16 streaming, ");
}

/// A twin of Llama-3.2-1B on the streaming kernel: its shape, RoPE divisors
/// and Llama 3's 128,256-token vocabulary (the shapes take
/// SmolLM2's 49,152, so this logits product and the in-kernel sampler's
/// slices are 2.6 times theirs), random F16 weights. Greedy tokens and each
/// sampler mode against the CPU's.
#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn streaming_llama_3_2_twin_matches_cpu() {
    let m = synth_loads(
        SynthArch::Llama,
        Shape::Llama1B,
        DType::F16,
        Some(vocab_file("llama-bpe")),
        true,
        1,
    )
    .remove(0);
    assert_eq!(m.config.n_vocab, 128_256);
    let opts = GenerateOptions {
        max_tokens: 32,
        ignore_eos: true,
        ..Default::default()
    };
    let p = prompt(20, m.config.n_vocab);
    persistent_against_cpu(&m, &p, &opts, "llama-3.2-1b twin f16 streaming");
    sampled_chains_against_cpu(&m, &p, 24, "llama-3.2-1b twin f16 streaming, ");
}

/// The streaming kernel's Q4_0 form (16-row tiles over column slices,
/// tensor-core consumers): greedy tokens against the CPU's on the llama-1b
/// shape (one slice of 2,048 columns, four of the down product) and the
/// llama-8b one (two slices, down in four of 28 groups each, which the
/// warps share unevenly; heads of 128), with the stop and cancellation
/// checks on the first; then each sampler mode on llama-1b; llama-8b with
/// RoPE divisors.
#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn streaming_q4_0_chain_matches_cpu() {
    let opts = GenerateOptions {
        max_tokens: 32,
        ignore_eos: true,
        ..Default::default()
    };
    let m = synth(Shape::Llama1B, DType::Q4_0);
    let what = "llama-1b q4_0 streaming";
    let p = prompt(20, m.config.n_vocab);
    let (tg, same) = persistent_against_cpu(&m, &p, &opts, what);
    stop_and_cancel_inside_a_chain(&m, &p, &opts, &tg, same.min(12) - 1, 5, 20, what);
    sampled_chains_against_cpu(&m, &p, 24, "llama-1b q4_0 streaming, ");
    drop(m);
    let m = synth(Shape::Llama8B, DType::Q4_0);
    let p = prompt(20, m.config.n_vocab);
    persistent_against_cpu(&m, &p, &opts, "llama-8b q4_0 streaming");
    drop(m);
    // Llama 3.1-8B's divisors: a table of 64 for heads of 128.
    persistent_rope_freqs_against_cpu(Shape::Llama8B, DType::Q4_0, 20, &opts);
}

/// llama.cpp's default Q4_0 mix on the streaming kernel: Q4_0 layers and
/// Q6_K logits (the output matrix; a tied shape's embedding), which the
/// kernel reads in its own Q6 form (repack.rs `q6k_stream_form`). Greedy
/// tokens and each sampler mode against the CPU's on the llama-1b shape
/// (tied: the embedding rows come from the Q6 form too), greedy on
/// llama-8b (untied: the output matrix alone, two slices a tile). Before
/// the form these models kept the graph, where `persistent_against_cpu`
/// fails (no chain ran persistent).
#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn streaming_q4_0_with_q6_k_logits_matches_cpu() {
    let opts = GenerateOptions {
        max_tokens: 32,
        ignore_eos: true,
        ..Default::default()
    };
    for shape in [Shape::Llama1B, Shape::Llama8B] {
        let tied = shape.params().tied;
        let spec = SynthSpec {
            shape,
            arch: SynthArch::Llama,
            dtype: DType::Q4_0,
            seed: 11,
            tokenizer_from: Some(vocab()),
            embedding: tied.then_some(DType::Q6_K),
            output: (!tied).then_some(DType::Q6_K),
            rope_freqs: false,
        };
        let path = std::env::temp_dir().join(format!(
            "akunu-gpu-test-{}-{shape}-q4_0-q6_k.gguf",
            std::process::id()
        ));
        write_synthetic(&path, &spec, &mut |_, _| {}).expect("writing a synthetic model");
        let m = Arc::new(Model::load(&path).expect("loading it"));
        let _ = std::fs::remove_file(&path);
        let logits = if tied {
            "token_embd.weight"
        } else {
            "output.weight"
        };
        assert_eq!(m.file.tensor(logits).unwrap().dtype, DType::Q6_K);
        assert_eq!(
            m.file.tensor("blk.0.ffn_down.weight").unwrap().dtype,
            DType::Q4_0
        );
        let what = format!("{shape} q4_0, q6_k logits, streaming");
        let p = prompt(20, m.config.n_vocab);
        persistent_against_cpu(&m, &p, &opts, &what);
        if tied {
            sampled_chains_against_cpu(&m, &p, 24, &format!("{what}, "));
        }
    }
}

/// The persistent kernel's greedy tokens against the CPU's (equal but after
/// a near-tie), on the SmolLM2 shape with a Q4_1 and with a Q8_0 embedding
/// (the default file's types); then a stop token and a cancellation by the
/// sink, both inside one persistent chain; a chain that runs past the
/// kernel's last position (persistent, then the graph); speculative
/// decoding, which keeps the graph; a Q4_1 model with RoPE divisors.
#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn persistent_chain_matches_cpu() {
    let q41 = synth(Shape::SmolLm2_135M, DType::Q4_1);
    let q80 = synth(Shape::SmolLm2_135M, DType::Q8_0);
    let emb8 = mixed(&q41, &q80, &["token_embd.weight"], "q4_1-emb-q8_0");
    assert_eq!(
        emb8.file.tensor("token_embd.weight").unwrap().dtype,
        DType::Q8_0
    );
    let opts = GenerateOptions {
        max_tokens: 64,
        ignore_eos: true,
        ..Default::default()
    };
    for (m, what) in [
        (&q41, "smollm2 q4_1"),
        (&emb8, "smollm2 q4_1, q8_0 embedding"),
    ] {
        let p = prompt(20, m.config.n_vocab);
        let (tg, same) = persistent_against_cpu(m, &p, &opts, what);
        stop_and_cancel_inside_a_chain(m, &p, &opts, &tg, 20.min(same - 1), 10, 40, what);
    }
    persistent_rope_freqs_against_cpu(Shape::SmolLm2_135M, DType::Q4_1, 100, &opts);
    // A chain past the kernel's last position (persist::MAX_POS, 384, in a
    // context of 512): its first 24 steps run persistent, the next 24 on
    // the graph; the tokens still follow the CPU's. Which path computes a
    // position depends on the position alone, so a shorter generation
    // (persistent throughout) gives the same first tokens bit for bit.
    let long = prompt(360, q41.config.n_vocab);
    let (cross, _) = persistent_against_cpu(
        &q41,
        &long,
        &GenerateOptions {
            max_tokens: 48,
            ..opts.clone()
        },
        "smollm2 q4_1 from position 360",
    );
    let (be, _) = cuda_persistent();
    let mut g = engine(&q41, be, 64, 64);
    let mut short = Vec::new();
    g.generate(
        &long,
        &GenerateOptions {
            max_tokens: 20,
            ..opts.clone()
        },
        &mut |id, _| {
            short.push(id);
            true
        },
    )
    .unwrap();
    assert_eq!(
        short,
        cross[..20],
        "the first 20 tokens of 48 and of 20 from position 360"
    );
    eprintln!(
        "past position 384: 48 tokens, persistent then the graph, the first 20 as a 20-token run's"
    );
    // Speculative decoding asks for the table's order: with the switch on,
    // its plain runs keep the graph, and its tokens are the graph's.
    let unit = prompt(7, q41.config.n_vocab);
    let p: Vec<u32> = unit.iter().cycle().take(31).copied().collect();
    let spec = GenerateOptions {
        speculative: true,
        spec: akunu_core::speculative::SpecOptions {
            ngram_min: 1,
            ngram_max: 3,
            draft: 8,
        },
        ..opts.clone()
    };
    let with = keeps_the_graph(&q41, &p, &spec, 16, "speculative decoding");
    eprintln!(
        "speculative with the switch on: {} tokens, graph path only",
        with.len()
    );
}

/// Generates with the persistent switch on, checks that no chain took the
/// kernel and that the tokens are those with the switch off; returns them.
fn keeps_the_graph(
    m: &Arc<Model>,
    p: &[u32],
    opts: &GenerateOptions,
    chunk: u32,
    what: &str,
) -> Vec<u32> {
    use std::sync::atomic::Ordering;
    let generate = |be: Box<dyn Backend>| {
        let mut e = engine(m, be, chunk, 64);
        let mut ids = Vec::new();
        e.generate(p, opts, &mut |id, _| {
            ids.push(id);
            true
        })
        .unwrap();
        ids
    };
    let (be, chains) = cuda_persistent();
    let with = generate(be);
    assert_eq!(
        chains.load(Ordering::Relaxed),
        0,
        "{what}: a chain took the persistent kernel"
    );
    assert_eq!(
        with,
        generate(cuda()),
        "{what}: tokens with the switch on and off"
    );
    with
}

/// Sampled chains of `m` from `p` on the persistent switch (the SmolLM2
/// kernel or the streaming one, whichever takes the model), each sampler
/// mode's configuration against the CPU's tokens; `label` prefixes the
/// messages.
fn sampled_chains_against_cpu(m: &Arc<Model>, p: &[u32], max_tokens: u32, label: &str) {
    use akunu_core::decode::DecodePath;
    use std::sync::atomic::Ordering;
    // The logits' scale, for the tolerance of the perturbed values.
    let greedy = GenerateOptions {
        max_tokens: 1,
        ignore_eos: true,
        ..Default::default()
    };
    let (_, raw) = run(&mut engine(m, cpu_kv(KvType::F16), 16, 64), p, &greedy);
    let scale = raw[0].iter().fold(1f32, |a, v| a.max(v.abs()));
    let configs = [
        (0.8, 40, 0.95, 0.0, 1.0),
        (1.2, 50, 0.95, 0.05, 1.1),
        // A low temperature, at which top-p is meant to cut inside the
        // top-k even on a synthetic model's logits.
        (0.1, 40, 0.9, 0.0, 1.0),
        (1.0, 64, 1.0, 0.0, 1.0),
        (0.7, 1, 1.0, 0.0, 1.0),
        (0.8, 0, 1.0, 0.0, 1.0),
        (0.9, 0, 1.0, 0.0, 1.3),
        (0.0, 0, 1.0, 0.0, 1.3),
    ];
    for (i, &(t, k, tp, mp, rp)) in configs.iter().enumerate() {
        let what = format!(
            "{label}sampled config {i} (T {t}, top-k {k}, top-p {tp}, min-p {mp}, penalty {rp})"
        );
        let opts = GenerateOptions {
            max_tokens,
            ignore_eos: true,
            force_path: Some(DecodePath::Sampled),
            sampling: SamplingConfig {
                temperature: t,
                top_k: k,
                top_p: tp,
                min_p: mp,
                repeat_penalty: rp,
                repeat_last_n: 64,
                seed: 77 + i as u64,
            },
            ..Default::default()
        };
        // The CPU's perturbed logits (its sampled table rewrites them).
        let (tc, lcs) = run(&mut engine(m, cpu_kv(KvType::F16), 16, 64), p, &opts);
        let (be, chains) = cuda_persistent();
        let mut g = engine(m, be, 64, 64);
        let mut tg = Vec::new();
        g.generate(p, &opts, &mut |id, _| {
            tg.push(id);
            true
        })
        .unwrap();
        assert!(
            chains.load(Ordering::Relaxed) > 0,
            "{what}: no chain ran persistent"
        );
        assert_eq!(tg.len(), tc.len(), "{what}: tokens generated");
        // A logit error e moves a perturbed value by e / T.
        let tol = 1e-3 * scale / if t > 0.0 { t } else { 1.0 };
        let mut same = tg.len();
        for (s, (a, b)) in tg.iter().zip(&tc).enumerate() {
            if a != b {
                let gap = top2_gap(&lcs[s]);
                assert!(
                    gap < tol,
                    "{what}: step {s}: persistent chose {a}, CPU {b}, perturbed top-2 gap {gap} (tolerance {tol})"
                );
                eprintln!("{what}: near-tie at step {s} (gap {gap}); stopping the comparison");
                same = s;
                break;
            }
        }
        eprintln!("{what}: {same} of {} tokens equal to the CPU's", tg.len());
        assert!(same >= 8, "{what}: only {same} tokens compared");
    }
}

/// The persistent kernel's sampled tokens against the CPU's sampled ones
/// (the same Gumbel noise: equal but after a near-tie of the perturbed
/// values), for each mode of its sampler: top-k with top-p, min-p and the
/// repetition penalty, top-p cutting inside the top-k (a low temperature),
/// the largest top-k, dense Gumbel-max with and without
/// the penalty, and the penalty alone at temperature 0. A configuration the
/// sampler does not take (top-p without top-k) keeps the graph, whose tokens
/// it then gives.
#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn persistent_sampled_chain_matches_cpu() {
    let m = synth(Shape::SmolLm2_135M, DType::Q4_1);
    let p = prompt(16, m.config.n_vocab);
    sampled_chains_against_cpu(&m, &p, 64, "");
    // Top-p without top-k: the graph (the counter stays), its tokens.
    let opts = GenerateOptions {
        max_tokens: 32,
        ignore_eos: true,
        sampling: SamplingConfig {
            temperature: 0.7,
            top_p: 0.9,
            seed: 5,
            ..Default::default()
        },
        ..Default::default()
    };
    keeps_the_graph(&m, &p, &opts, 64, "top-p without top-k");
    eprintln!("top-p without top-k keeps the graph");
}

#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn sampled_tokens_match_cpu() {
    let m = synth(Shape::SmolLm2_135M, DType::F16);
    let p = prompt(12, m.config.n_vocab);
    let configs = [
        (0.8, 0, 1.0, 0.0, 1.0),
        (1.0, 40, 1.0, 0.0, 1.0),
        (0.7, 0, 0.9, 0.0, 1.0),
        (1.2, 50, 0.95, 0.05, 1.1),
        (0.9, 0, 1.0, 0.1, 1.3),
    ];
    for (i, &(t, k, tp, mp, rp)) in configs.iter().enumerate() {
        let opts = GenerateOptions {
            max_tokens: 48,
            ignore_eos: true,
            sampling: SamplingConfig {
                temperature: t,
                top_k: k,
                top_p: tp,
                min_p: mp,
                repeat_penalty: rp,
                repeat_last_n: 64,
                seed: 1234 + i as u64,
            },
            ..Default::default()
        };
        let mut c = engine(&m, cpu(), 16, 64);
        let mut g = engine(&m, cuda(), 16, 64);
        let (tc, _) = run(&mut c, &p, &opts);
        // The chain path (no probe) must agree with the probed path too.
        let mut ids = Vec::new();
        g.generate(&p, &opts, &mut |id, _| {
            ids.push(id);
            true
        })
        .unwrap();
        assert_eq!(ids, tc, "config {i}: GPU chain vs CPU sampled tokens");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn stop_token_ends_the_chain_on_the_device() {
    let m = synth(Shape::SmolLm2_135M, DType::Q4_1);
    let p = prompt(8, m.config.n_vocab);
    let free = GenerateOptions {
        max_tokens: 60,
        ignore_eos: true,
        ..Default::default()
    };
    let mut e = engine(&m, cuda(), 64, 64);
    let mut ids = Vec::new();
    e.generate(&p, &free, &mut |id, _| {
        ids.push(id);
        true
    })
    .unwrap();
    // Stop on the token generated at step 20 (its first occurrence).
    let stop = ids[20];
    let first = ids.iter().position(|&t| t == stop).unwrap();
    e.reset();
    let opts = GenerateOptions {
        stop_tokens: vec![stop],
        ..free
    };
    let mut got = Vec::new();
    let st = e
        .generate(&p, &opts, &mut |id, _| {
            got.push(id);
            true
        })
        .unwrap();
    assert_eq!(got, ids[..first]);
    assert_eq!(st.stop_reason, akunu_core::decode::StopReason::Eos);
    eprintln!(
        "stop at step {first} of a 64-step chunk: computed after the end {:?}, delivery {:?} us",
        st.computed_after_end, st.delivery_us
    );
    assert_eq!(st.computed_after_end, Some(0));
}

#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn tokens_stream_before_their_chunk_ends() {
    let m = synth(Shape::SmolLm2_135M, DType::Q4_1);
    let mut e = engine(&m, cuda(), 64, 64);
    let opts = GenerateOptions {
        max_tokens: 257,
        ignore_eos: true,
        ..Default::default()
    };
    let p = prompt(8, m.config.n_vocab);
    e.generate(&p, &opts, &mut |_, _| true).unwrap();
    let st = e.generate(&p, &opts, &mut |_, _| true).unwrap();
    let per_token_us = st.decode_ms * 1e3 / st.decode_steps as f64;
    let (median, max) = st.delivery_us.expect("the CUDA chain measures delivery");
    eprintln!(
        "decode {:.0} tok/s ({per_token_us:.1} us/token); delivery median {median:.1} us, max {max:.1} us; a 64-token chunk takes {:.0} us",
        st.decode_tok_s,
        64.0 * per_token_us
    );
    // Batch delivery at chunk end would make the median about half a chunk.
    assert!(
        (median as f64) < 8.0 * per_token_us,
        "tokens are delivered {median} us after production"
    );
}

/// Prefix reuse on the GPU: after a generation, rewinding into the prompt
/// (and to the full sequence, whose last token is pending) and generating
/// gives the logits and tokens of a generation from scratch over the same
/// tokens (up to the rounding of other kernel paths: the kept positions were
/// computed partly by decode steps, the scratch run prefills them).
#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn generation_after_rewind_equals_generation_from_scratch() {
    let m = synth(Shape::SmolLm2_135M, DType::Q4_1);
    let n_vocab = m.config.n_vocab;
    let p1 = prompt(40, n_vocab);
    let p2: Vec<u32> = prompt(9, n_vocab)
        .iter()
        .map(|t| (t + 101) % n_vocab)
        .collect();
    let opts = GenerateOptions {
        max_tokens: 24,
        ignore_eos: true,
        ..Default::default()
    };
    let mut e = engine(&m, cuda(), 16, 64);
    let (g1, _) = run(&mut e, &p1, &opts);
    let total = p1.len() + g1.len();
    for keep in [25, total] {
        e.reset();
        assert_eq!(run(&mut e, &p1, &opts).0, g1, "reset and regenerate");
        e.rewind(keep).unwrap();
        let (after, la) = run(&mut e, &p2, &opts);
        let mut whole = p1.clone();
        whole.extend(&g1);
        whole.truncate(keep);
        whole.extend(&p2);
        let (scratch, ls) = run(&mut engine(&m, cuda(), 16, 64), &whole, &opts);
        for (s, (a, b)) in after.iter().zip(&scratch).enumerate() {
            let err = rel_l2(&la[s], &ls[s]);
            assert!(
                err < 1e-3,
                "keep {keep}: step {s} logits differ by {err:.2e}"
            );
            if a != b {
                let gap = top2_gap(&ls[s]);
                assert!(
                    gap < 1e-3 * ls[s].iter().fold(1f32, |m, v| m.max(v.abs())),
                    "keep {keep}: step {s}: after rewind {a}, from scratch {b}, top-2 gap {gap}"
                );
                break;
            }
        }
    }
}

/// Tokens, per-step logits (with `probe`) and statistics of a generation.
fn gen_stats(
    e: &mut Engine,
    prompt: &[u32],
    opts: &GenerateOptions,
    probe: bool,
) -> (Vec<u32>, Vec<Vec<f32>>, akunu_core::decode::Stats) {
    let logits = Arc::new(Mutex::new(Vec::new()));
    if probe {
        let sink = logits.clone();
        e.set_logits_probe(Some(Box::new(move |l: &[f32]| {
            sink.lock().unwrap().push(l.to_vec())
        })));
    }
    let mut ids = Vec::new();
    let st = e
        .generate(prompt, opts, &mut |id, _| {
            ids.push(id);
            true
        })
        .expect("generate");
    e.set_logits_probe(None);
    let l = logits.lock().unwrap().clone();
    (ids, l, st)
}

/// Speculative decode on the GPU is lossless: every verified row is
/// computed as a one-row step would compute it (the decode kernels, row by
/// row: `launch::decode_rows`), so its logits equal plain decode's bit for
/// bit, and the tokens (greedy and sampled) equal the plain chain's.
#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn speculative_verification_is_exact() {
    use akunu_core::speculative::SpecOptions;
    let configs = [
        SamplingConfig::default(),
        SamplingConfig {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.02,
            repeat_penalty: 1.2,
            repeat_last_n: 16,
            seed: 5,
        },
    ];
    let mut accepted = 0;
    for (shape, dtype) in [
        (Shape::Tiny, DType::F32),
        (Shape::Tiny, DType::Q8_0),
        (Shape::SmolLm2_135M, DType::Q4_1),
        (Shape::SmolLm2_135M, DType::Q4_0),
        (Shape::SmolLm2_135M, DType::F16),
        // The logits product of rows of 256 on the bulk-copy gemv.
        (Shape::TinyK, DType::Q4_0),
        (Shape::TinyK, DType::Q4_1),
        (Shape::TinyK, DType::Q8_0),
    ] {
        let m = if shape == Shape::TinyK {
            synth_big_vocab(shape, dtype)
        } else {
            synth(shape, dtype)
        };
        let unit = prompt(7, m.config.n_vocab);
        let p: Vec<u32> = unit.iter().cycle().take(31).copied().collect();
        for (ci, cfg) in configs.iter().enumerate() {
            let what = format!("{shape} {dtype:?} config {ci}");
            let base = GenerateOptions {
                max_tokens: 64,
                ignore_eos: true,
                sampling: cfg.clone(),
                ..Default::default()
            };
            let spec = GenerateOptions {
                speculative: true,
                spec: SpecOptions {
                    ngram_min: 1,
                    ngram_max: 3,
                    draft: 8,
                },
                ..base.clone()
            };
            // Probed: plain one-row steps against verification graphs.
            let (tp, lp, _) = gen_stats(&mut engine(&m, cuda(), 16, 64), &p, &base, true);
            let (ts, ls, st) = gen_stats(&mut engine(&m, cuda(), 16, 64), &p, &spec, true);
            assert_eq!(ts, tp, "{what}: speculative vs plain tokens (probed)");
            assert_eq!(ls.len(), lp.len(), "{what}: probed steps");
            for (i, (a, b)) in ls.iter().zip(&lp).enumerate() {
                let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{what}: logits of token {i} differ");
            }
            let s = st.speculative.expect("speculative stats");
            accepted += s.accepted;
            // Unprobed: the plain chain graphs against verification graphs.
            let (tc, _, _) = gen_stats(&mut engine(&m, cuda(), 16, 64), &p, &base, false);
            let (tsc, _, _) = gen_stats(&mut engine(&m, cuda(), 16, 64), &p, &spec, false);
            assert_eq!(tc, tp, "{what}: plain chain vs plain steps");
            assert_eq!(tsc, tc, "{what}: speculative vs plain chain");
            eprintln!(
                "{what}: {} drafted, {} accepted, {} passes",
                s.drafted, s.accepted, s.verify_passes
            );
        }
    }
    assert!(
        accepted > 0,
        "no draft was accepted: the test proves nothing"
    );
}

/// The multi-block sampler against the single-block kernel through the
/// engine: sampled chains (PDL, graphs, the `done` early exit at the token
/// limit) and sampled speculative verification (the all-rows path, one
/// prep + select pair per row sharing the scratch) give the same tokens.
#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn multi_block_sampler_equals_single_block_in_chains_and_verification() {
    let m = synth(Shape::SmolLm2_135M, DType::Q4_1);
    // A repetitive prompt, so that the n-gram drafter has drafts to verify.
    let p: Vec<u32> = prompt(6, m.config.n_vocab)
        .into_iter()
        .cycle()
        .take(36)
        .collect();
    let configs = [
        (0.8, 40, 0.95, 0.0, 1.1),
        (1.0, 1, 1.0, 0.0, 1.0),
        (1.2, 200, 0.9, 0.05, 1.1),
        (1.0, 0, 1.0, 0.0, 1.1),
        (0.0, 0, 1.0, 0.0, 1.3),
        (0.7, 0, 0.9, 0.0, 1.0),
    ];
    for (i, &(t, k, tp, mp, rp)) in configs.iter().enumerate() {
        for speculative in [false, true] {
            let opts = GenerateOptions {
                max_tokens: 70,
                ignore_eos: true,
                speculative,
                sampling: SamplingConfig {
                    temperature: t,
                    top_k: k,
                    top_p: tp,
                    min_p: mp,
                    repeat_penalty: rp,
                    repeat_last_n: 64,
                    seed: 99 + i as u64,
                },
                ..Default::default()
            };
            let gen_ids = |multi: bool| {
                let mut be =
                    akunu_cuda::CudaBackend::new(0, &mut |m| eprintln!("{m}")).expect("CUDA");
                be.set_multi_block_sampling(multi);
                let mut e = engine(&m, Box::new(be), 16, 64);
                let mut ids = Vec::new();
                e.generate(&p, &opts, &mut |id, _| {
                    ids.push(id);
                    true
                })
                .unwrap();
                // A second generation reuses the captured graphs and scratch.
                e.reset();
                e.generate(&p, &opts, &mut |id, _| {
                    ids.push(id);
                    true
                })
                .unwrap();
                ids
            };
            let want = gen_ids(false);
            assert_eq!(want.len(), 140, "config {i}");
            assert_eq!(
                gen_ids(true),
                want,
                "config {i}, speculative {speculative}: multi-block vs single-block sampler"
            );
        }
    }
}
