//! Bad input through the real binary: each case must exit non-zero with a
//! message naming the problem, and never panic.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::OnceLock;

fn akunu() -> Command {
    Command::new(env!("CARGO_BIN_EXE_akunu"))
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("akunu-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// A valid tiny model written by `akunu synth`, shared by the cases.
fn base_model() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| {
        let p = tmp("base.gguf");
        let out = akunu()
            .args(["synth", "--shape", "tiny", "--type", "q4_1", "--seed", "3"])
            .arg(&p)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "synth failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::read(&p).unwrap()
    })
}

fn run_on(bytes: &[u8], name: &str, extra: &[&str]) -> Output {
    let p = tmp(name);
    std::fs::write(&p, bytes).unwrap();
    let mut c = akunu();
    c.args(["generate", "-n", "4", "-p", "hello", "--model"])
        .arg(&p)
        .args(extra);
    c.output().unwrap()
}

fn assert_clean_error(out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "expected failure, got success; stderr: {err}"
    );
    assert!(!err.contains("panicked"), "panicked: {err}");
    assert!(err.contains("akunu: error:"), "no error line: {err}");
    assert!(
        err.to_lowercase().contains(&needle.to_lowercase()),
        "expected '{needle}' in: {err}"
    );
}

/// Byte offset just past the first occurrence of `pat`.
fn after(bytes: &[u8], pat: &[u8]) -> usize {
    bytes
        .windows(pat.len())
        .position(|w| w == pat)
        .expect("pattern present")
        + pat.len()
}

#[test]
fn valid_model_generates() {
    let out = run_on(base_model(), "ok.gguf", &["--ignore-eos"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn truncated_file() {
    let b = base_model();
    for (i, cut) in [3usize, 20, 200, 3000].into_iter().enumerate() {
        let out = run_on(&b[..cut], &format!("trunc{i}.gguf"), &[]);
        assert_clean_error(&out, "truncated");
    }
}

#[test]
fn wrong_magic() {
    let mut b = base_model().to_vec();
    b[..4].copy_from_slice(b"GGML");
    assert_clean_error(&run_on(&b, "magic.gguf", &[]), "not a GGUF file");
}

#[test]
fn unknown_version() {
    let mut b = base_model().to_vec();
    b[4..8].copy_from_slice(&7u32.to_le_bytes());
    assert_clean_error(
        &run_on(&b, "version.gguf", &[]),
        "unsupported GGUF version 7",
    );
}

#[test]
fn unsupported_tensor_type() {
    let mut b = base_model().to_vec();
    // Tensor info: name, n_dims (u32 = 2), dims (2 x u64), type (u32).
    let at = after(&b, b"blk.0.attn_q.weight") + 4 + 16;
    b[at..at + 4].copy_from_slice(&10u32.to_le_bytes()); // Q2_K
    assert_clean_error(
        &run_on(&b, "qtype.gguf", &[]),
        "has data type Q2_K, which akunu does not support",
    );
}

#[test]
fn k_quant_rows_must_be_whole_super_blocks() {
    let mut b = base_model().to_vec();
    // A supported type whose 256-element blocks do not tile the test
    // model's 64-element rows.
    let at = after(&b, b"blk.0.attn_q.weight") + 4 + 16;
    b[at..at + 4].copy_from_slice(&12u32.to_le_bytes()); // Q4_K
    assert_clean_error(
        &run_on(&b, "qtype-rows.gguf", &[]),
        "row length 64 is not a multiple of the Q4_K block size 256",
    );
}

#[test]
fn unsupported_architecture() {
    let mut b = base_model().to_vec();
    // general.architecture: key, value type (u32 = 8), length (u64 = 5), "llama".
    let at = after(&b, b"general.architecture") + 4 + 8;
    b[at..at + 5].copy_from_slice(b"mamba");
    assert_clean_error(
        &run_on(&b, "arch.gguf", &[]),
        "unsupported architecture 'mamba'",
    );
}

#[test]
fn tensor_data_outside_file() {
    let mut b = base_model().to_vec();
    let at = after(&b, b"blk.1.ffn_down.weight") + 4 + 16 + 4;
    b[at..at + 8].copy_from_slice(&(1u64 << 32).to_le_bytes());
    assert_clean_error(&run_on(&b, "offset.gguf", &[]), "outside the file");
}

#[test]
fn absurd_dimensions() {
    let mut b = base_model().to_vec();
    let at = after(&b, b"blk.0.ffn_up.weight") + 4;
    b[at..at + 8].copy_from_slice(&(1u64 << 50).to_le_bytes());
    assert_clean_error(&run_on(&b, "dims.gguf", &[]), "absurd dimensions");
}

#[test]
fn prompt_longer_than_context() {
    let p = tmp("ctx.gguf");
    std::fs::write(&p, base_model()).unwrap();
    let prompt = tmp("long.txt");
    std::fs::write(&prompt, "hello world ".repeat(20)).unwrap();
    let out = akunu()
        .args(["generate", "-n", "4", "--ctx", "8", "--model"])
        .arg(&p)
        .arg("--prompt-file")
        .arg(&prompt)
        .output()
        .unwrap();
    assert_clean_error(&out, "the context holds 8");
}

#[test]
fn missing_model_path() {
    let out = akunu()
        .args(["generate", "-p", "hi", "--model", "/nonexistent/model.gguf"])
        .output()
        .unwrap();
    assert_clean_error(&out, "does not exist");
}

#[test]
fn invalid_prompt_ids_and_options() {
    let p = tmp("opts.gguf");
    std::fs::write(&p, base_model()).unwrap();
    let out = akunu()
        .args(["generate", "--prompt-ids", "1,x,3", "--model"])
        .arg(&p)
        .output()
        .unwrap();
    assert_clean_error(&out, "'x' is not a token id");
    let out = akunu()
        .args(["generate", "--prompt-ids", "1,99999999", "--model"])
        .arg(&p)
        .output()
        .unwrap();
    assert_clean_error(&out, "outside the vocabulary");
    let out = akunu()
        .args(["generate", "-p", "hi", "--chunk", "0", "--model"])
        .arg(&p)
        .output()
        .unwrap();
    assert_clean_error(&out, "chunk must be");
    let out = akunu()
        .args(["generate", "-p", "", "--model"])
        .arg(&p)
        .output()
        .unwrap();
    assert_clean_error(&out, "prompt is empty");
}

#[test]
fn invalid_sampling_values() {
    let p = tmp("sampling.gguf");
    std::fs::write(&p, base_model()).unwrap();
    for (flags, needle) in [
        (&["--temperature=-1"][..], "temperature"),
        (&["--temperature", "NaN"][..], "temperature"),
        (&["--temperature", "0.7", "--top-p", "0"][..], "top_p"),
        (&["--temperature", "0.7", "--top-p", "1.5"][..], "top_p"),
        (&["--temperature", "0.7", "--min-p", "1"][..], "min_p"),
        (
            &["--temperature", "0.7", "--repeat-penalty", "0"][..],
            "repeat_penalty",
        ),
        (
            &["--temperature", "0.7", "--repeat-last-n", "5000"][..],
            "repeat-last-n",
        ),
    ] {
        let out = akunu()
            .args(["generate", "-p", "hi", "-n", "2", "--model"])
            .arg(&p)
            .args(flags)
            .output()
            .unwrap();
        assert_clean_error(&out, needle);
    }
}

#[test]
fn sampled_generation_reports_and_reuses_its_seed() {
    let p = tmp("seed.gguf");
    std::fs::write(&p, base_model()).unwrap();
    let run = |seed: &str| {
        let out = akunu()
            .args([
                "generate",
                "-p",
                "hello",
                "-n",
                "12",
                "--ignore-eos",
                "--json",
                "--temperature",
                "1.0",
                "--seed",
                seed,
                "--model",
            ])
            .arg(&p)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["stats"]["seed"].as_u64(), Some(seed.parse().unwrap()));
        assert_eq!(v["stats"]["path"], "sampled");
        v["generated_ids"].clone()
    };
    assert_eq!(run("11"), run("11"));
    assert_ne!(run("11"), run("12"));
}

#[test]
fn chat_template_problems() {
    let base = base_model();
    let out = run_on(
        base,
        "tmpl1.gguf",
        &["--chat-template", "/nonexistent/template.jinja"],
    );
    assert_clean_error(&out, "reading chat template");
    let bad = tmp("unclosed.jinja");
    std::fs::write(&bad, "{% for m in messages %}{{ m.content }}").unwrap();
    let out = run_on(
        base,
        "tmpl2.gguf",
        &["--chat-template", bad.to_str().unwrap()],
    );
    assert_clean_error(&out, "does not parse");
    let raising = tmp("raising.jinja");
    std::fs::write(&raising, "{{ raise_exception('system messages only') }}").unwrap();
    let out = run_on(
        base,
        "tmpl3.gguf",
        &["--chat-template", raising.to_str().unwrap()],
    );
    assert_clean_error(&out, "system messages only");
}

/// `--chat-template FILE` renders the prompt through the file: the prompt ids
/// are the tokenization of the text the template writes.
#[test]
fn chat_template_file_renders_the_prompt() {
    let model = tmp("tmpl-ok.gguf");
    std::fs::write(&model, base_model()).unwrap();
    let t = tmp("simple.jinja");
    std::fs::write(
        &t,
        "{% for m in messages %}[{{ m.role }}] {{ m.content | upper }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}",
    )
    .unwrap();
    let out = akunu()
        .args([
            "generate",
            "-n",
            "1",
            "--json",
            "-p",
            "hello",
            "--chat-template",
        ])
        .arg(&t)
        .arg("--model")
        .arg(&model)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let expected = akunu()
        .args(["tokenize", "--json", "[user] HELLO\n[assistant]", "--model"])
        .arg(&model)
        .output()
        .unwrap();
    let want: serde_json::Value = serde_json::from_slice(&expected.stdout).unwrap();
    assert_eq!(v["prompt_ids"], want);
}
