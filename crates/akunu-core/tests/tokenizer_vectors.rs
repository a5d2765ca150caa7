//! llama.cpp's tokenizer test vectors (tests/data/tokenizer, see its README):
//! each `.inp` text tokenized as llama.cpp's test-tokenizer-0 does
//! (add_special = false, parse_special = false) must give the `.out` ids,
//! and decoding must give the text back.

use akunu_core::gguf::GgufFile;
use akunu_core::tokenizer::{TokenType, Tokenizer};
use std::path::PathBuf;

fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer")
}

/// Splits a `.inp` file as test-tokenizer-0 does: on "\n__ggml_vocab_test__\n".
fn read_cases(name: &str) -> Vec<(String, Vec<u32>)> {
    let dir = data_dir();
    let inp = std::fs::read_to_string(dir.join(format!("ggml-vocab-{name}.gguf.inp"))).unwrap();
    let out = std::fs::read_to_string(dir.join(format!("ggml-vocab-{name}.gguf.out"))).unwrap();
    let sep = "\n__ggml_vocab_test__\n";
    let mut texts = Vec::new();
    let mut pos = 0;
    while pos < inp.len() {
        match inp[pos..].find(sep) {
            Some(i) => {
                texts.push(inp[pos..pos + i].to_string());
                pos += i + sep.len();
            }
            None => {
                texts.push(inp[pos..].to_string());
                break;
            }
        }
    }
    let ids: Vec<Vec<u32>> = out
        .lines()
        .map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect())
        .collect();
    assert_eq!(
        texts.len(),
        ids.len(),
        "{name}: .inp and .out disagree on the number of cases"
    );
    texts.into_iter().zip(ids).collect()
}

fn load(name: &str) -> Tokenizer {
    let f = GgufFile::open(data_dir().join(format!("ggml-vocab-{name}.gguf"))).unwrap();
    Tokenizer::from_gguf(&f).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn check_vocab(name: &str) {
    let tok = load(name);
    let cases = read_cases(name);
    let mut failures = Vec::new();
    for (text, expected) in &cases {
        let got = tok.encode(text, false, false).unwrap();
        if &got != expected {
            failures.push(format!(
                "text {text:?}\n  expected {expected:?}\n  got      {got:?}"
            ));
            continue;
        }
        let back = tok.decode(&got);
        if &back != text {
            failures.push(format!("text {text:?} decodes back as {back:?}"));
        }
    }
    eprintln!(
        "{name}: {}/{} cases passed",
        cases.len() - failures.len(),
        cases.len()
    );
    assert!(
        failures.is_empty(),
        "{name}: {} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn tokenizer_vectors_gpt2() {
    check_vocab("gpt-2");
}

#[test]
fn tokenizer_vectors_starcoder() {
    check_vocab("starcoder");
}

#[test]
fn tokenizer_vectors_qwen2() {
    check_vocab("qwen2");
}

#[test]
fn tokenizer_vectors_deepseek_coder() {
    check_vocab("deepseek-coder");
}

#[test]
fn tokenizer_vectors_llama_bpe() {
    check_vocab("llama-bpe");
}

/// SentencePiece (`tokenizer.ggml.model = llama`, Llama 2's vocabulary):
/// score-ranked merges, byte fallback, the space prefix.
#[test]
fn tokenizer_vectors_llama_spm() {
    check_vocab("llama-spm");
}

#[test]
fn tokenizer_spm_specials_bos_and_byte_fallback() {
    let tok = load("llama-spm");
    // BOS 1 is added by default (add_bos_token true), EOS 2 ends generation.
    assert!(tok.add_bos());
    let hello = tok.encode("Hello", false, false).unwrap();
    assert_eq!(tok.encode("Hello", true, false).unwrap()[0], 1);
    assert_eq!(tok.encode("Hello", true, false).unwrap()[1..], hello[..]);
    assert!(tok.is_eog(2));
    // After a special token the text gets the space prefix again, as at the
    // start: "</s>Hello" is </s> then the tokens of "Hello".
    let ids = tok.encode("</s>Hello", false, true).unwrap();
    assert_eq!(ids[0], 2);
    assert_eq!(ids[1..], hello[..]);
    // The piece of "Hello" starts with the space marker; decoding drops the
    // prefix space of the first token only.
    assert_eq!(tok.token_piece(hello[0]), Some("\u{2581}Hello"));
    assert_eq!(tok.decode(&hello), "Hello");
    assert_eq!(tok.decode(&[hello[0], hello[0]]), "Hello Hello");
    // Continuation text (forced mid-generation) gets no space prefix.
    let cont = tok.encode_continuation("Hello").unwrap();
    assert_ne!(tok.token_piece(cont[0]), Some("\u{2581}Hello"));
    assert_eq!(tok.decode(&[hello[0]]), "Hello");
    let mut both = hello.clone();
    both.extend(&cont);
    assert_eq!(tok.decode(&both), "HelloHello");
    // Byte-level BPE vocabularies have no prefix: the same ids either way.
    let bpe = load("qwen2");
    assert_eq!(
        bpe.encode_continuation("Hello world").unwrap(),
        bpe.encode("Hello world", false, false).unwrap()
    );
    // A character without a token falls back to one byte token per UTF-8
    // byte; the stream decoder emits it whole once the last byte arrives.
    let ids = tok.encode("\u{1F999}", false, false).unwrap();
    let bytes: Vec<u32> = ids
        .iter()
        .copied()
        .filter(|&i| tok.token_type(i) == Some(TokenType::Byte))
        .collect();
    assert_eq!(bytes.len(), 4, "{ids:?}");
    let mut stream = tok.stream();
    let mut pieces = Vec::new();
    for &i in &ids {
        pieces.push(stream.push(i));
    }
    assert!(
        pieces[..ids.len() - 1]
            .iter()
            .all(|p| p.as_deref().unwrap_or(" ") == " ")
    );
    let text: String = pieces.into_iter().flatten().collect();
    assert_eq!(text, " \u{1F999}");
}

#[test]
fn tokenizer_special_tokens_starcoder() {
    let tok = load("starcoder");
    let text = "<fim_prefix>user";
    let fim = tok.special_token_id("<fim_prefix>").unwrap();
    assert_eq!(fim, 1);
    let with = tok.encode(text, false, true).unwrap();
    assert_eq!(with[0], fim);
    assert_eq!(with[1..], tok.encode("user", false, false).unwrap()[..]);
    let without = tok.encode(text, false, false).unwrap();
    assert!(!without.contains(&fim));
    assert!(without.len() > 2);
    // Both decode back to the same text.
    assert_eq!(tok.decode(&with), text);
    assert_eq!(tok.decode(&without), text);
    // Several specials, longest first, adjacent to text.
    let ids = tok
        .encode("a<|endoftext|><fim_middle>b<fim_pad>", false, true)
        .unwrap();
    assert!(ids.windows(2).any(|w| w == [0, 2]), "{ids:?}");
    assert!(ids.contains(&4));
    assert_eq!(tok.decode(&ids), "a<|endoftext|><fim_middle>b<fim_pad>");

    // EOS/BOS 0 from the metadata; gpt2-model vocabs add no BOS by default.
    assert_eq!(tok.bos(), Some(0));
    assert_eq!(tok.eos(), Some(0));
    assert!(!tok.add_bos());
    assert_eq!(
        tok.encode("hi", true, false).unwrap(),
        tok.encode("hi", false, false).unwrap()
    );
    assert!(tok.is_eog(0));
    assert!(!tok.is_eog(1));
    assert!(!tok.is_eog(tok.encode("hi", false, false).unwrap()[0]));
    assert_eq!(tok.n_vocab(), 49152);
    assert_eq!(tok.token_piece(0), Some("<|endoftext|>"));
}

#[test]
fn tokenizer_qwen2_chat_tokens() {
    let tok = load("qwen2");
    let start = tok.special_token_id("<|im_start|>").unwrap();
    let end = tok.special_token_id("<|im_end|>").unwrap();
    assert!(tok.is_eog(end));
    assert!(tok.is_eog(tok.special_token_id("<|endoftext|>").unwrap()));
    assert!(!tok.is_eog(start));
    let ids = tok
        .encode("<|im_start|>user\nhi<|im_end|>", false, true)
        .unwrap();
    assert_eq!(ids.first(), Some(&start));
    assert_eq!(ids.last(), Some(&end));
    let plain = tok
        .encode("<|im_start|>user\nhi<|im_end|>", false, false)
        .unwrap();
    assert!(!plain.contains(&start) && !plain.contains(&end));
}

#[test]
fn tokenizer_deepseek_adds_bos() {
    let tok = load("deepseek-coder");
    assert!(tok.add_bos());
    let bos = tok.bos().unwrap();
    let ids = tok.encode("int x;", true, false).unwrap();
    assert_eq!(ids[0], bos);
    assert_eq!(ids[1..], tok.encode("int x;", false, false).unwrap()[..]);
    // llama3 vocabs ask for BOS through their pre-tokenizer type.
    let tok = load("llama-bpe");
    assert!(tok.add_bos());
    assert_eq!(tok.encode("hi", true, false).unwrap()[0], 128000);
}

#[test]
fn tokenizer_stream_never_splits_characters() {
    for name in ["gpt-2", "starcoder", "qwen2"] {
        let tok = load(name);
        let text = "Hi 🦙🚀 llama! 我想在apple工作 нещо на Български 😶‍🌫️ ✅ កាន់តែ";
        let ids = tok.encode(text, false, false).unwrap();
        let mut s = tok.stream();
        let mut out = String::new();
        let mut partial_seen = false;
        for &id in &ids {
            match s.push(id) {
                Some(piece) => {
                    assert!(!piece.contains('\u{FFFD}'), "{name}: U+FFFD in {piece:?}");
                    out.push_str(&piece);
                }
                None => partial_seen = true,
            }
        }
        assert_eq!(s.flush(), None);
        assert_eq!(out, text, "{name}");
        assert!(
            partial_seen,
            "{name}: the text should split a character across tokens"
        );
    }
}

/// The default model's own vocabulary (a vocab-only GGUF made from it by
/// tools/vocab_only.py) against ids from tools/tokenize_ref.py, an
/// independent Python BPE, over varied text: prose, code, whitespace runs,
/// digits, CJK, Arabic, emoji sequences and ChatML special tokens.
#[test]
fn tokenizer_default_model_matches_independent_reference() {
    let tok = load("smollm2");
    assert_eq!(tok.bos(), Some(1));
    assert_eq!(tok.eos(), Some(2));
    assert!(!tok.add_bos());
    let expected = data_dir()
        .parent()
        .unwrap()
        .join("smollm2_tokenizer_expected.json");
    let report = akunu_core::tokenizer::check_expected(&tok, &expected, false, true).unwrap();
    assert!(report.total >= 40, "only {} cases", report.total);
    for m in &report.mismatches {
        eprintln!(
            "case {} {:?}: expected {:?}, got {:?}",
            m.index, m.text, m.expected, m.got
        );
    }
    assert!(
        report.passed(),
        "{} of {} cases differ",
        report.mismatches.len(),
        report.total
    );
}
