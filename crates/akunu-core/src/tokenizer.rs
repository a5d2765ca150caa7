//! Tokenizer: byte-level BPE vocabularies (GGUF `tokenizer.ggml.model =
//! "gpt2"`, and Hugging Face `tokenizer.json` BPE files) and
//! SentencePiece-style vocabularies (`tokenizer.ggml.model = "llama"`:
//! Llama 2, Gemma; see [`crate::spm`]), with llama.cpp's semantics for
//! special tokens, BOS/EOS and end-of-generation tokens.
//!
//! Encoding works in two stages, as llama.cpp's `llama_tokenize` does:
//!
//! 1. The text is partitioned on the text of special tokens (CONTROL,
//!    USER_DEFINED and UNKNOWN types), longest token first. USER_DEFINED
//!    tokens are always matched; CONTROL and UNKNOWN ones only with
//!    `parse_special`.
//! 2. Each remaining plain fragment goes through the pre-tokenizer regexes
//!    (applied in sequence, each splitting the pieces of the previous one and
//!    keeping all text) and byte-level BPE, both done by the `tokenizers`
//!    crate. Special tokens are deliberately not registered with that
//!    pipeline, so that `parse_special` is honoured.
//!
//! SentencePiece vocabularies replace stage 2 by the score-ranked merges of
//! [`crate::spm`], and, when `tokenizer.ggml.add_space_prefix` is true (the
//! default), put a space before a fragment that starts the text or follows
//! a special token, as llama.cpp does.
//!
//! Decoding maps each token's piece back to bytes (byte-level decoding, or
//! `▁` to a space and `<0xNN>` byte tokens to their byte); special tokens
//! are rendered as their text.

use crate::gguf::GgufFile;
use crate::spm::{self, SpmModel};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{ModelWrapper, PreTokenizerWrapper, SplitDelimiterBehavior};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("tokenizer metadata key '{0}' is missing")]
    MissingKey(String),
    #[error(
        "unsupported tokenizer model '{0}' (tokenizer.ggml.model): akunu supports \"gpt2\" (byte-level BPE) and \"llama\" (SentencePiece)"
    )]
    UnsupportedModel(String),
    #[error("unsupported pre-tokenizer type '{0}' (tokenizer.ggml.pre)")]
    UnsupportedPre(String),
    #[error("malformed tokenizer metadata '{key}': {msg}")]
    Malformed { key: String, msg: String },
    #[error("cannot read {}", .path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: invalid tokenizer file: {msg}", .path.display())]
    Json { path: PathBuf, msg: String },
    #[error("cannot build the BPE tokenizer: {0}")]
    Build(String),
    #[error("tokenization failed: {0}")]
    Encode(String),
}

fn malformed(key: &str, msg: impl Into<String>) -> TokenizerError {
    TokenizerError::Malformed {
        key: key.to_string(),
        msg: msg.into(),
    }
}

/// GGUF token types (`tokenizer.ggml.token_type`), as llama.cpp numbers them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenType {
    Undefined = 0,
    Normal = 1,
    Unknown = 2,
    Control = 3,
    UserDefined = 4,
    Unused = 5,
    Byte = 6,
}

impl TokenType {
    fn from_i64(v: i64) -> Option<TokenType> {
        Some(match v {
            0 => TokenType::Undefined,
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => return None,
        })
    }

    /// Whether the token takes part in the special-token partition.
    fn is_special(self) -> bool {
        matches!(
            self,
            TokenType::Control | TokenType::UserDefined | TokenType::Unknown
        )
    }
}

/// Texts that llama.cpp treats as end of generation (and forces to CONTROL).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

// Pre-tokenizer regexes (llama.cpp's llama-vocab.cpp). The GPT-2 expression
// carries llama.cpp's implicit trailing `\s+`: its hand-written GPT-2 splitter
// emits whitespace the expression leaves unmatched as a piece of its own.
const RE_GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const RE_LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How a `tokenizer.ggml.pre` value configures the BPE tokenizer.
struct PreConfig {
    regexes: &'static [&'static str],
    ignore_merges: bool,
    add_bos: bool,
}

fn pre_config(pre: &str) -> Option<PreConfig> {
    let cfg = |regexes: &'static [&'static str]| PreConfig {
        regexes,
        ignore_merges: false,
        add_bos: false,
    };
    Some(match pre {
        // llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT (also used when the key is absent).
        "default" => cfg(&[
            r"[\p{P}\$\+<=>\^~\|]+",
            RE_GPT2,
            r"\p{N}+",
            "[0-9][0-9][0-9]",
        ]),
        "gpt-2" | "phi-2" | "roberta-bpe" | "mpt" | "olmo" | "jais" | "exaone4" => cfg(&[RE_GPT2]),
        "starcoder" | "smollm" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva"
        | "minerva-7b" => cfg(&[r"\p{N}", RE_GPT2]),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" => PreConfig {
            regexes: &[RE_LLAMA3],
            ignore_merges: true,
            add_bos: true,
        },
        "dbrx" | "smaug-bpe" => cfg(&[RE_LLAMA3]),
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "megrez" => cfg(&[RE_QWEN2]),
        "deepseek-coder" => cfg(&[
            "[\r\n]",
            r"\s?\p{L}+",
            r"\s?\p{P}+",
            "[一-龥ࠀ-一가-퟿]+",
            r"\p{N}",
        ]),
        _ => return None,
    })
}

/// GPT-2's byte <-> printable character table (`bytes_to_unicode`).
const fn byte_to_char_table() -> [u16; 256] {
    let mut t = [0u16; 256];
    let mut n = 0u16;
    let mut b = 0usize;
    while b < 256 {
        let printable =
            (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
        if printable {
            t[b] = b as u16;
        } else {
            t[b] = 256 + n;
            n += 1;
        }
        b += 1;
    }
    t
}

const BYTE_TO_CHAR: [u16; 256] = byte_to_char_table();

const fn char_to_byte_table() -> [i16; 324] {
    let mut t = [-1i16; 324];
    let mut b = 0usize;
    while b < 256 {
        t[BYTE_TO_CHAR[b] as usize] = b as i16;
        b += 1;
    }
    t
}

const CHAR_TO_BYTE: [i16; 324] = char_to_byte_table();

/// Appends the bytes a byte-level BPE piece stands for. Characters outside
/// the byte alphabet (never present in well-formed vocabularies) are kept as
/// their UTF-8.
fn byte_level_decode(piece: &str, out: &mut Vec<u8>) {
    for c in piece.chars() {
        match CHAR_TO_BYTE.get(c as usize) {
            Some(&b) if b >= 0 => out.push(b as u8),
            _ => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
}

/// A tokenizer (see the module documentation). `Send + Sync`.
pub struct Tokenizer {
    pieces: Vec<String>,
    types: Vec<TokenType>,
    /// Special tokens (CONTROL / USER_DEFINED / UNKNOWN, non-empty text),
    /// longest text first: the order of llama.cpp's partition.
    specials: Vec<u32>,
    special_by_text: HashMap<String, u32>,
    pipeline: Pipeline,
    bos: Option<u32>,
    eos: Option<u32>,
    eog: HashSet<u32>,
    add_bos: bool,
    add_eos: bool,
}

/// What turns a fragment of plain text into ids.
enum Pipeline {
    /// Byte-level BPE through the `tokenizers` crate.
    Bpe(Box<tokenizers::Tokenizer>),
    /// SentencePiece-style merges.
    Spm {
        model: SpmModel,
        /// Whether a space goes before a fragment at the start of the text
        /// or after a special token (`tokenizer.ggml.add_space_prefix`).
        add_space_prefix: bool,
    },
}

enum Fragment {
    Token(u32),
    Raw(usize, usize),
}

fn check_id(v: Option<i64>, n: usize) -> Option<u32> {
    v.filter(|&id| id >= 0 && (id as u64) < n as u64)
        .map(|id| id as u32)
}

fn string_array<'a>(f: &'a GgufFile, key: &str) -> Result<Option<Vec<&'a str>>, TokenizerError> {
    let Some(v) = f.get(key) else { return Ok(None) };
    let arr = v.as_array().ok_or_else(|| {
        malformed(
            key,
            format!("expected an array of strings, found {}", v.type_name()),
        )
    })?;
    arr.iter()
        .enumerate()
        .map(|(i, e)| {
            e.as_str().ok_or_else(|| {
                malformed(
                    key,
                    format!("element {i} is {}, expected string", e.type_name()),
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` keys.
    pub fn from_gguf(f: &GgufFile) -> Result<Self, TokenizerError> {
        const K_MODEL: &str = "tokenizer.ggml.model";
        const K_TOKENS: &str = "tokenizer.ggml.tokens";
        const K_TYPES: &str = "tokenizer.ggml.token_type";
        const K_MERGES: &str = "tokenizer.ggml.merges";
        const K_PRE: &str = "tokenizer.ggml.pre";

        let model = match f.get(K_MODEL) {
            None => return Err(TokenizerError::MissingKey(K_MODEL.into())),
            Some(v) => v.as_str().ok_or_else(|| {
                malformed(
                    K_MODEL,
                    format!("expected a string, found {}", v.type_name()),
                )
            })?,
        };
        let spm = match model {
            "gpt2" => false,
            "llama" => true,
            _ => return Err(TokenizerError::UnsupportedModel(model.to_string())),
        };
        let pre = match f.get(K_PRE) {
            None => "default",
            Some(v) => v.as_str().ok_or_else(|| {
                malformed(K_PRE, format!("expected a string, found {}", v.type_name()))
            })?,
        };
        // SentencePiece vocabularies have no pre-tokenizer: the key, if any,
        // is ignored (llama.cpp's converter writes "default").
        let cfg = if spm {
            PreConfig {
                regexes: &[],
                ignore_merges: false,
                add_bos: true,
            }
        } else {
            pre_config(pre).ok_or_else(|| TokenizerError::UnsupportedPre(pre.to_string()))?
        };

        let pieces: Vec<String> = string_array(f, K_TOKENS)?
            .ok_or_else(|| TokenizerError::MissingKey(K_TOKENS.into()))?
            .into_iter()
            .map(str::to_owned)
            .collect();
        if pieces.is_empty() {
            return Err(malformed(K_TOKENS, "the vocabulary is empty"));
        }
        if pieces.len() > u32::MAX as usize {
            return Err(malformed(K_TOKENS, "too many tokens"));
        }
        let n = pieces.len();
        let types = match f.get(K_TYPES) {
            None => vec![TokenType::Normal; n],
            Some(v) => {
                let arr = v.as_array().ok_or_else(|| {
                    malformed(
                        K_TYPES,
                        format!("expected an array of integers, found {}", v.type_name()),
                    )
                })?;
                if arr.len() != n {
                    return Err(malformed(
                        K_TYPES,
                        format!("{} entries for {} tokens", arr.len(), n),
                    ));
                }
                arr.iter()
                    .enumerate()
                    .map(|(i, e)| {
                        e.as_i64().and_then(TokenType::from_i64).ok_or_else(|| {
                            malformed(
                                K_TYPES,
                                format!("element {i} ({}) is not a token type 0..=6", e.summary()),
                            )
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
        };
        let id = |key: &str| check_id(f.get_i64(key), n);
        let bos = id("tokenizer.ggml.bos_token_id");
        let eos = id("tokenizer.ggml.eos_token_id");
        let extra_eog: Vec<u32> = [
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
            "tokenizer.ggml.fim_pad_token_id",
            "tokenizer.ggml.fim_rep_token_id",
            "tokenizer.ggml.fim_sep_token_id",
        ]
        .iter()
        .filter_map(|k| id(k))
        .collect();
        let add_bos = f
            .get_bool("tokenizer.ggml.add_bos_token")
            .unwrap_or(cfg.add_bos);
        let add_eos = f.get_bool("tokenizer.ggml.add_eos_token").unwrap_or(false);

        let pipeline = if spm {
            Pipeline::Spm {
                model: SpmModel::new(
                    &pieces,
                    spm_scores(f, n)?,
                    id("tokenizer.ggml.unknown_token_id"),
                ),
                add_space_prefix: f
                    .get_bool("tokenizer.ggml.add_space_prefix")
                    .unwrap_or(true),
            }
        } else {
            let merges = string_array(f, K_MERGES)?
                .ok_or_else(|| TokenizerError::MissingKey(K_MERGES.into()))?;
            let merges: Vec<(String, String)> = merges
                .iter()
                .filter_map(|m| {
                    // As llama.cpp: split at the first space after the first byte.
                    let pos = m.as_bytes().iter().skip(1).position(|&b| b == b' ')? + 1;
                    Some((m[..pos].to_string(), m[pos + 1..].to_string()))
                })
                .collect();
            Pipeline::Bpe(Box::new(build_pipeline(
                &pieces,
                merges,
                cfg.regexes,
                cfg.ignore_merges,
            )?))
        };
        Ok(Self::assemble(
            pieces, types, pipeline, bos, eos, extra_eog, add_bos, add_eos,
        ))
    }

    /// Builds a tokenizer from a Hugging Face `tokenizer.json` whose model is
    /// byte-level BPE. Added tokens marked `special` are CONTROL tokens, the
    /// others USER_DEFINED. BOS/EOS and whether to add them come from a
    /// `tokenizer_config.json` beside the file when there is one, else from
    /// the post-processor's template; failing both, EOS is looked up by its
    /// usual texts.
    pub fn from_json_file(path: &Path) -> Result<Self, TokenizerError> {
        let jerr = |msg: String| TokenizerError::Json {
            path: path.to_path_buf(),
            msg,
        };
        let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| jerr(e.to_string()))?;
        let full =
            tokenizers::Tokenizer::from_bytes(text.as_bytes()).map_err(|e| jerr(e.to_string()))?;

        let model_type = json
            .pointer("/model/type")
            .and_then(|v| v.as_str())
            .unwrap_or("BPE");
        let ModelWrapper::BPE(bpe) = full.get_model() else {
            return Err(TokenizerError::UnsupportedModel(format!(
                "{model_type} (tokenizer.json)"
            )));
        };
        let byte_level = [json.get("pre_tokenizer"), json.get("decoder")]
            .iter()
            .any(|v| v.is_some_and(|v| v.to_string().contains("\"ByteLevel\"")));
        if !byte_level {
            return Err(TokenizerError::UnsupportedModel(
                "BPE without ByteLevel pre-tokenizer/decoder (tokenizer.json)".into(),
            ));
        }

        let mut by_id: HashMap<u32, (String, TokenType)> = bpe
            .get_vocab()
            .into_iter()
            .map(|(s, i)| (i, (s, TokenType::Normal)))
            .collect();
        for (i, t) in full.get_added_tokens_decoder() {
            let ty = if t.special {
                TokenType::Control
            } else {
                TokenType::UserDefined
            };
            by_id.insert(i, (t.content, ty));
        }
        let n = by_id.keys().max().map_or(0, |&m| m as usize + 1);
        if n == 0 {
            return Err(jerr("empty vocabulary".into()));
        }
        let mut pieces = vec![String::new(); n];
        let mut types = vec![TokenType::Unused; n];
        for (i, (s, ty)) in by_id {
            pieces[i as usize] = s;
            types[i as usize] = ty;
        }
        let find = |s: &str| by_id_text(&pieces, s);

        // BOS / EOS.
        let (mut bos, mut eos, mut add_bos, mut add_eos) = (None, None, false, false);
        if let Some(tp) = find_template(json.get("post_processor")) {
            let ids_of = |tok: &serde_json::Value| -> Option<u32> {
                let name = tok.pointer("/SpecialToken/id")?.as_str()?;
                tp.pointer(&format!(
                    "/special_tokens/{}/ids/0",
                    name.replace('~', "~0").replace('/', "~1")
                ))
                .and_then(|v| v.as_u64())
                .map(|v| v as u32)
                .or_else(|| find(name))
            };
            if let Some(single) = tp.get("single").and_then(|v| v.as_array()) {
                if let Some(b) = single.first().and_then(ids_of) {
                    bos = Some(b);
                    add_bos = true;
                }
                if let Some(e) = single.last().filter(|_| single.len() > 1).and_then(ids_of) {
                    eos = Some(e);
                    add_eos = true;
                }
            }
        }
        let cfg_path = path.with_file_name("tokenizer_config.json");
        if let Ok(cfg_text) = std::fs::read_to_string(&cfg_path) {
            let cfg: serde_json::Value =
                serde_json::from_str(&cfg_text).map_err(|e| TokenizerError::Json {
                    path: cfg_path.clone(),
                    msg: e.to_string(),
                })?;
            let tok_text = |key: &str| -> Option<String> {
                let v = cfg.get(key)?;
                v.as_str()
                    .or_else(|| v.get("content").and_then(|c| c.as_str()))
                    .map(str::to_owned)
            };
            if let Some(b) = tok_text("bos_token").and_then(|t| find(&t)) {
                bos = Some(b);
            }
            if let Some(e) = tok_text("eos_token").and_then(|t| find(&t)) {
                eos = Some(e);
            }
            if let Some(v) = cfg.get("add_bos_token").and_then(|v| v.as_bool()) {
                add_bos = v;
            }
            if let Some(v) = cfg.get("add_eos_token").and_then(|v| v.as_bool()) {
                add_eos = v;
            }
        }
        if eos.is_none() {
            eos = ["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"]
                .iter()
                .find_map(|t| find(t));
        }
        add_bos &= bos.is_some();
        add_eos &= eos.is_some();

        let mut pipeline = tokenizers::Tokenizer::new(bpe.clone());
        pipeline
            .with_normalizer(full.get_normalizer().cloned())
            .map_err(|e| TokenizerError::Build(e.to_string()))?;
        pipeline.with_pre_tokenizer(full.get_pre_tokenizer().cloned());
        Ok(Self::assemble(
            pieces,
            types,
            Pipeline::Bpe(Box::new(pipeline)),
            bos,
            eos,
            Vec::new(),
            add_bos,
            add_eos,
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        pieces: Vec<String>,
        mut types: Vec<TokenType>,
        pipeline: Pipeline,
        bos: Option<u32>,
        eos: Option<u32>,
        extra_eog: Vec<u32>,
        add_bos: bool,
        add_eos: bool,
    ) -> Self {
        let mut eog: HashSet<u32> = extra_eog.into_iter().chain(eos).collect();
        for (i, p) in pieces.iter().enumerate() {
            if EOG_TEXTS.contains(&p.as_str()) {
                // As llama.cpp: these texts end generation, and a token with
                // one of them that is not typed CONTROL is made CONTROL.
                eog.insert(i as u32);
                types[i] = TokenType::Control;
            }
        }
        let mut specials: Vec<u32> = (0..pieces.len() as u32)
            .filter(|&i| types[i as usize].is_special() && !pieces[i as usize].is_empty())
            .collect();
        specials.sort_by(|&a, &b| {
            pieces[b as usize]
                .len()
                .cmp(&pieces[a as usize].len())
                .then(a.cmp(&b))
        });
        let mut special_by_text = HashMap::new();
        for &i in &specials {
            special_by_text
                .entry(pieces[i as usize].clone())
                .or_insert(i);
        }
        Tokenizer {
            pieces,
            types,
            specials,
            special_by_text,
            pipeline,
            bos,
            eos,
            eog,
            add_bos: add_bos && bos.is_some(),
            add_eos: add_eos && eos.is_some(),
        }
    }

    /// Tokenizes `text`. `add_special` prepends BOS / appends EOS when the
    /// model asks for them; `parse_special` lets the text of CONTROL tokens
    /// stand for those tokens (USER_DEFINED tokens are always matched).
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        self.encode_inner(text, add_special, parse_special, true)
    }

    /// Tokenizes text that continues a sequence (text a grammar forces in
    /// the middle of a generation): no BOS/EOS, special-token text not
    /// parsed, and no SentencePiece space prefix, which only text that
    /// starts a sequence (or follows a special token) gets.
    pub fn encode_continuation(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode_inner(text, false, false, false)
    }

    fn encode_inner(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
        starts_sequence: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::new();
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        // SentencePiece: a space before text at the start or after a special.
        let mut after_special = starts_sequence;
        for frag in self.partition(text, parse_special) {
            match frag {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Raw(s, e) => {
                    match &self.pipeline {
                        Pipeline::Bpe(bpe) => {
                            let enc = bpe
                                .encode_fast(&text[s..e], false)
                                .map_err(|err| TokenizerError::Encode(err.to_string()))?;
                            out.extend_from_slice(enc.get_ids());
                        }
                        Pipeline::Spm {
                            model,
                            add_space_prefix,
                        } => {
                            if *add_space_prefix && after_special {
                                model.encode(&format!(" {}", &text[s..e]), &mut out);
                            } else {
                                model.encode(&text[s..e], &mut out);
                            }
                        }
                    }
                    after_special = false;
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        Ok(out)
    }

    /// llama.cpp's `tokenizer_st_partition`: for each special token, longest
    /// first, split every remaining plain fragment on its occurrences.
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut frags = vec![Fragment::Raw(0, text.len())];
        for &id in &self.specials {
            if !parse_special && self.types[id as usize] != TokenType::UserDefined {
                continue;
            }
            let pat = self.pieces[id as usize].as_str();
            if !text.contains(pat) {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                match f {
                    Fragment::Raw(s, e) => {
                        let mut pos = s;
                        while let Some(i) = text[pos..e].find(pat) {
                            let at = pos + i;
                            if at > pos {
                                next.push(Fragment::Raw(pos, at));
                            }
                            next.push(Fragment::Token(id));
                            pos = at + pat.len();
                        }
                        if pos < e {
                            next.push(Fragment::Raw(pos, e));
                        }
                    }
                    tok => next.push(tok),
                }
            }
            frags = next;
        }
        frags
    }

    /// Appends the bytes token `id` renders to (nothing for an unknown id or
    /// for UNUSED tokens; BYTE tokens only in SentencePiece vocabularies, as
    /// llama.cpp's `token_to_piece`).
    fn append_bytes(&self, id: u32, out: &mut Vec<u8>) {
        let Some(piece) = self.pieces.get(id as usize) else {
            return;
        };
        let spm = matches!(self.pipeline, Pipeline::Spm { .. });
        match self.types[id as usize] {
            TokenType::Control | TokenType::UserDefined | TokenType::Unknown => {
                out.extend_from_slice(piece.as_bytes())
            }
            TokenType::Normal | TokenType::Undefined if spm => {
                out.extend_from_slice(piece.replace(spm::SPACE, " ").as_bytes())
            }
            TokenType::Normal | TokenType::Undefined => byte_level_decode(piece, out),
            TokenType::Byte if spm => out.extend(SpmModel::byte_of_piece(piece)),
            TokenType::Unused | TokenType::Byte => {}
        }
    }

    /// The bytes token `id` stands for.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let mut v = Vec::new();
        self.append_bytes(id, &mut v);
        v
    }

    /// Decodes ids to text; special tokens are rendered as their text.
    /// Invalid UTF-8 (e.g. a character cut off at the end) becomes U+FFFD.
    /// With a SentencePiece space prefix, the first token's leading space
    /// (the one encoding added) is dropped, as llama.cpp's detokenizer does.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            let at = bytes.len();
            self.append_bytes(id, &mut bytes);
            let prefixed = matches!(
                self.pipeline,
                Pipeline::Spm {
                    add_space_prefix: true,
                    ..
                }
            );
            if i == 0 && prefixed && bytes.get(at) == Some(&b' ') {
                bytes.remove(at);
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// An incremental decoder that only ever emits whole characters.
    pub fn stream(&self) -> StreamDecoder<'_> {
        StreamDecoder {
            tok: self,
            buf: Vec::new(),
        }
    }

    /// The raw vocabulary string of a token.
    pub fn token_piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }

    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    pub fn n_vocab(&self) -> usize {
        self.pieces.len()
    }

    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// End of generation: EOS, EOT/EOM (and FIM pad/rep/sep) ids from the
    /// metadata, and the tokens llama.cpp recognises by text.
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// Every end-of-generation id, ascending.
    pub fn eog_ids(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.eog.iter().copied().collect();
        v.sort_unstable();
        v
    }

    /// Whether `encode(.., add_special = true, ..)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether `encode(.., add_special = true, ..)` appends EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// The id of the special (CONTROL / USER_DEFINED / UNKNOWN) token with
    /// exactly this text.
    pub fn special_token_id(&self, text: &str) -> Option<u32> {
        self.special_by_text.get(text).copied()
    }
}

/// `tokenizer.ggml.scores` (all 0 when absent): the merge priorities of a
/// SentencePiece vocabulary.
fn spm_scores(f: &GgufFile, n: usize) -> Result<Vec<f32>, TokenizerError> {
    const K: &str = "tokenizer.ggml.scores";
    let Some(v) = f.get(K) else {
        return Ok(vec![0.0; n]);
    };
    let arr = v
        .as_array()
        .ok_or_else(|| malformed(K, format!("expected an array, found {}", v.type_name())))?;
    if arr.len() != n {
        return Err(malformed(K, format!("{} scores for {n} tokens", arr.len())));
    }
    arr.iter()
        .enumerate()
        .map(|(i, e)| {
            e.as_f64()
                .map(|x| x as f32)
                .ok_or_else(|| malformed(K, format!("element {i} is not a number")))
        })
        .collect()
}

fn by_id_text(pieces: &[String], s: &str) -> Option<u32> {
    pieces.iter().position(|p| p == s).map(|i| i as u32)
}

/// Finds a TemplateProcessing post-processor, possibly inside a Sequence.
fn find_template(v: Option<&serde_json::Value>) -> Option<&serde_json::Value> {
    let v = v?;
    match v.get("type").and_then(|t| t.as_str()) {
        Some("TemplateProcessing") => Some(v),
        Some("Sequence") => v
            .get("processors")?
            .as_array()?
            .iter()
            .find_map(|p| find_template(Some(p))),
        _ => None,
    }
}

fn build_pipeline(
    pieces: &[String],
    merges: Vec<(String, String)>,
    regexes: &[&str],
    ignore_merges: bool,
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let mut vocab = Vocab::default();
    for (i, p) in pieces.iter().enumerate() {
        // Later duplicates win, as in llama.cpp's token_to_id.
        vocab.insert(p.clone(), i as u32);
    }
    // The tokenizers crate rejects merges whose parts or result are not in
    // the vocabulary; llama.cpp could apply such a merge but never emit its
    // result as one token, so dropping them only matters for broken vocabs.
    // Duplicates keep their first (best) rank, as llama.cpp's emplace does.
    let mut seen = HashSet::new();
    let merges: Vec<(String, String)> = merges
        .into_iter()
        .filter(|(a, b)| {
            vocab.contains_key(a) && vocab.contains_key(b) && vocab.contains_key(&format!("{a}{b}"))
        })
        .filter(|m| seen.insert(m.clone()))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| TokenizerError::Build(e.to_string()))?;

    let mut steps = Vec::with_capacity(regexes.len() + 1);
    for re in regexes {
        let split = Split::new(
            SplitPattern::Regex((*re).to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| TokenizerError::Build(format!("pre-tokenizer regex {re:?}: {e}")))?;
        steps.push(PreTokenizerWrapper::Split(split));
    }
    steps.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
        false, false, false,
    )));

    let mut pipeline = tokenizers::Tokenizer::new(bpe);
    pipeline.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(Sequence::new(steps))));
    Ok(pipeline)
}

/// Incremental UTF-8-safe decoder (see [`Tokenizer::stream`]).
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    buf: Vec<u8>,
}

impl StreamDecoder<'_> {
    /// Adds a token; returns the text completed so far, if any. A character
    /// split across tokens is returned whole once its last byte arrives.
    /// Bytes that can never form a character are returned as U+FFFD.
    pub fn push(&mut self, id: u32) -> Option<String> {
        self.tok.append_bytes(id, &mut self.buf);
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.buf[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.buf.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix up to `valid` was just validated.
                    out.push_str(
                        std::str::from_utf8(&self.buf[start..start + valid]).unwrap_or_default(),
                    );
                    match e.error_len() {
                        // Incomplete character at the end: wait for more.
                        None => {
                            start += valid;
                            break;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start += valid + bad;
                        }
                    }
                }
            }
        }
        self.buf.drain(..start);
        if out.is_empty() { None } else { Some(out) }
    }

    /// Returns whatever is left (an incomplete character becomes U+FFFD).
    pub fn flush(&mut self) -> Option<String> {
        if self.buf.is_empty() {
            return None;
        }
        let s = String::from_utf8_lossy(&self.buf).into_owned();
        self.buf.clear();
        Some(s)
    }
}

/// One disagreement found by [`check_expected`].
#[derive(Debug, Clone)]
pub struct ExpectedMismatch {
    pub index: usize,
    pub text: String,
    pub expected: Vec<u32>,
    pub got: Vec<u32>,
}

/// Result of [`check_expected`].
#[derive(Debug, Clone)]
pub struct ExpectedReport {
    pub total: usize,
    pub mismatches: Vec<ExpectedMismatch>,
}

impl ExpectedReport {
    pub fn passed(&self) -> bool {
        self.mismatches.is_empty()
    }
}

/// Compares `tok` with reference tokenizations stored as a JSON list of
/// `{"text": ..., "ids": [...]}` (e.g. produced by the Hugging Face
/// tokenizer). Each text is encoded with the given flags; for a Hugging Face
/// reference made with `tokenizer.encode(text)` on a byte-level vocabulary
/// use `add_special = false, parse_special = true`.
pub fn check_expected(
    tok: &Tokenizer,
    path: &Path,
    add_special: bool,
    parse_special: bool,
) -> Result<ExpectedReport, TokenizerError> {
    #[derive(serde::Deserialize)]
    struct Case {
        text: String,
        ids: Vec<u32>,
    }
    let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let cases: Vec<Case> = serde_json::from_str(&text).map_err(|e| TokenizerError::Json {
        path: path.to_path_buf(),
        msg: e.to_string(),
    })?;
    let mut mismatches = Vec::new();
    for (index, c) in cases.iter().enumerate() {
        let got = tok.encode(&c.text, add_special, parse_special)?;
        if got != c.ids {
            mismatches.push(ExpectedMismatch {
                index,
                text: c.text.clone(),
                expected: c.ids.clone(),
                got,
            });
        }
    }
    Ok(ExpectedReport {
        total: cases.len(),
        mismatches,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const _: fn() = || {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Tokenizer>();
    };

    #[test]
    fn byte_table_is_gpt2s() {
        assert_eq!(BYTE_TO_CHAR[b' ' as usize], 'Ġ' as u16);
        assert_eq!(BYTE_TO_CHAR[b'\n' as usize], 'Ċ' as u16);
        assert_eq!(BYTE_TO_CHAR[b'A' as usize], 'A' as u16);
        let mut v = Vec::new();
        byte_level_decode("ĠhelloĊ", &mut v);
        assert_eq!(v, b" hello\n");
        for b in 0..=255u8 {
            assert_eq!(CHAR_TO_BYTE[BYTE_TO_CHAR[b as usize] as usize], b as i16);
        }
    }

    // --- tiny GGUF writer for error tests ---
    fn put_str(v: &mut Vec<u8>, s: &str) {
        v.extend((s.len() as u64).to_le_bytes());
        v.extend(s.as_bytes());
    }

    enum Kv<'a> {
        Str(&'a str),
        StrArr(&'a [&'a str]),
    }

    fn gguf_bytes(kvs: &[(&str, Kv)]) -> Vec<u8> {
        let mut v = b"GGUF".to_vec();
        v.extend(3u32.to_le_bytes());
        v.extend(0u64.to_le_bytes());
        v.extend((kvs.len() as u64).to_le_bytes());
        for (k, val) in kvs {
            put_str(&mut v, k);
            match val {
                Kv::Str(s) => {
                    v.extend(8u32.to_le_bytes());
                    put_str(&mut v, s);
                }
                Kv::StrArr(a) => {
                    v.extend(9u32.to_le_bytes());
                    v.extend(8u32.to_le_bytes());
                    v.extend((a.len() as u64).to_le_bytes());
                    for s in *a {
                        put_str(&mut v, s);
                    }
                }
            }
        }
        v
    }

    fn load(kvs: &[(&str, Kv)], name: &str) -> Result<Tokenizer, TokenizerError> {
        let path =
            std::env::temp_dir().join(format!("akunu-tok-test-{}-{name}.gguf", std::process::id()));
        std::fs::write(&path, gguf_bytes(kvs)).unwrap();
        let f = GgufFile::open(&path).unwrap();
        let r = Tokenizer::from_gguf(&f);
        drop(f);
        let _ = std::fs::remove_file(&path);
        r
    }

    const TOKS: &[&str] = &["a", "b", "ab", "Ġ", "<|im_end|>"];
    const MERGES: &[&str] = &["a b"];

    #[test]
    fn tiny_vocab_works() {
        let t = load(
            &[
                ("tokenizer.ggml.model", Kv::Str("gpt2")),
                ("tokenizer.ggml.pre", Kv::Str("gpt-2")),
                ("tokenizer.ggml.tokens", Kv::StrArr(TOKS)),
                ("tokenizer.ggml.merges", Kv::StrArr(MERGES)),
            ],
            "ok",
        )
        .unwrap();
        assert_eq!(t.encode("ab ba", false, false).unwrap(), vec![2, 3, 1, 0]);
        // No token_type array: "<|im_end|>" is still made CONTROL and EOG.
        assert!(t.is_eog(4));
        assert_eq!(t.special_token_id("<|im_end|>"), Some(4));
        assert_eq!(t.encode("ab<|im_end|>", false, true).unwrap(), vec![2, 4]);
        assert_eq!(t.decode(&[2, 3, 4]), "ab <|im_end|>");
        assert!(!t.add_bos());
    }

    #[test]
    fn errors_are_clear() {
        let e = load(
            &[
                ("tokenizer.ggml.model", Kv::Str("gpt2")),
                ("tokenizer.ggml.merges", Kv::StrArr(MERGES)),
            ],
            "notok",
        )
        .err()
        .unwrap();
        assert!(
            matches!(&e, TokenizerError::MissingKey(k) if k == "tokenizer.ggml.tokens"),
            "{e}"
        );
        assert!(e.to_string().contains("tokenizer.ggml.tokens"), "{e}");

        let e = load(
            &[
                ("tokenizer.ggml.model", Kv::Str("t5")),
                ("tokenizer.ggml.tokens", Kv::StrArr(TOKS)),
            ],
            "badmodel",
        )
        .err()
        .unwrap();
        assert!(
            matches!(&e, TokenizerError::UnsupportedModel(m) if m == "t5"),
            "{e}"
        );
        assert!(e.to_string().contains("'t5'"), "{e}");

        let e = load(&[("tokenizer.ggml.tokens", Kv::StrArr(TOKS))], "nomodel")
            .err()
            .unwrap();
        assert!(
            matches!(&e, TokenizerError::MissingKey(k) if k == "tokenizer.ggml.model"),
            "{e}"
        );

        let e = load(
            &[
                ("tokenizer.ggml.model", Kv::Str("gpt2")),
                ("tokenizer.ggml.pre", Kv::Str("martian")),
                ("tokenizer.ggml.tokens", Kv::StrArr(TOKS)),
                ("tokenizer.ggml.merges", Kv::StrArr(MERGES)),
            ],
            "badpre",
        )
        .err()
        .unwrap();
        assert!(
            matches!(&e, TokenizerError::UnsupportedPre(p) if p == "martian"),
            "{e}"
        );

        let e = load(
            &[
                ("tokenizer.ggml.model", Kv::Str("gpt2")),
                ("tokenizer.ggml.tokens", Kv::Str("a")),
                ("tokenizer.ggml.merges", Kv::StrArr(MERGES)),
            ],
            "malformed",
        )
        .err()
        .unwrap();
        assert!(
            matches!(&e, TokenizerError::Malformed { key, .. } if key == "tokenizer.ggml.tokens"),
            "{e}"
        );
    }

    #[test]
    fn from_json_file_reads_hf_bpe() {
        let dir = std::env::temp_dir().join(format!("akunu-tok-json-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let json = r#"{"version":"1.0","truncation":null,"padding":null,
            "added_tokens":[{"id":4,"content":"<|im_end|>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true},
                            {"id":5,"content":"<tool>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":false}],
            "normalizer":null,
            "pre_tokenizer":{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true},
            "post_processor":null,
            "decoder":{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true},
            "model":{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,"end_of_word_suffix":null,
                     "fuse_unk":false,"byte_fallback":false,"ignore_merges":false,
                     "vocab":{"a":0,"b":1,"ab":2,"Ġ":3,"<|im_end|>":4,"<tool>":5},"merges":["a b"]}}"#;
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, json).unwrap();
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"eos_token":"<|im_end|>","add_bos_token":false}"#,
        )
        .unwrap();
        let t = Tokenizer::from_json_file(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(t.n_vocab(), 6);
        assert_eq!(t.eos(), Some(4));
        assert_eq!(t.bos(), None);
        assert!(t.is_eog(4));
        assert_eq!(
            t.encode("ab ba<|im_end|>", true, true).unwrap(),
            vec![2, 3, 1, 0, 4]
        );
        // USER_DEFINED tokens match without parse_special; CONTROL ones do not.
        assert_eq!(t.encode("a<tool>b", false, false).unwrap(), vec![0, 5, 1]);
        assert!(!t.encode("<|im_end|>", false, false).unwrap().contains(&4));
        assert_eq!(t.decode(&[2, 3, 5, 4]), "ab <tool><|im_end|>");
    }

    #[test]
    fn stream_decoder_handles_split_and_invalid_bytes() {
        let t = load(
            &[
                ("tokenizer.ggml.model", Kv::Str("gpt2")),
                (
                    "tokenizer.ggml.tokens",
                    Kv::StrArr(&["ð", "Ł", "¦", "Ļ", "A", "ÿ"]),
                ),
                ("tokenizer.ggml.merges", Kv::StrArr(&[])),
            ],
            "stream",
        )
        .unwrap();
        // 🦙 = F0 9F A6 99: one byte per token.
        let mut s = t.stream();
        assert_eq!(s.push(0), None);
        assert_eq!(s.push(1), None);
        assert_eq!(s.push(2), None);
        assert_eq!(s.push(3).as_deref(), Some("🦙"));
        assert_eq!(s.push(4).as_deref(), Some("A"));
        // 0xFF can never start a character: emitted as U+FFFD, not held.
        assert_eq!(s.push(5).as_deref(), Some("\u{FFFD}"));
        assert_eq!(s.push(0), None);
        assert_eq!(s.flush().as_deref(), Some("\u{FFFD}"));
        assert_eq!(s.flush(), None);
    }
}
