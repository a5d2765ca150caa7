//! Grammar-constrained decoding (llguidance).
//!
//! Mechanics on a random-weight model (written by `akunu_core::synth`): the
//! mask reaches the logits (every forbidden token is -inf, every allowed one
//! is not, and the chosen token is the argmax of what is left), end of
//! generation only where the grammar allows it, forced tokens fed in one
//! step, invalid constraints rejected before any generation.
//!
//! Output on the default model (SmolLM2-135M-Instruct, fetched on first
//! use): for JSON Schemas, a Lark grammar and a regular expression, 50
//! sampled generations each, every one parsed and checked against its
//! constraint by code written here, independent of llguidance.

use akunu_core::decode::{
    Constraint, DecodePath, Engine, EngineError, EngineOptions, GenerateOptions, Stats, StopReason,
};
use akunu_core::dtype::DType;
use akunu_core::model::Model;
use akunu_core::sampling::SamplingConfig;
use akunu_core::synth::{Shape, SynthArch, SynthSpec, write_synthetic};
use akunu_cpu::CpuBackend;
use regex::Regex;
use serde_json::Value;
use std::sync::{Arc, Mutex, OnceLock};

fn tiny_model() -> Arc<Model> {
    static M: OnceLock<Arc<Model>> = OnceLock::new();
    M.get_or_init(|| {
        let path =
            std::env::temp_dir().join(format!("akunu-grammar-test-{}.gguf", std::process::id()));
        let spec = SynthSpec {
            shape: Shape::Tiny,
            arch: SynthArch::Llama,
            dtype: DType::F32,
            seed: 11,
            tokenizer_from: None,
            embedding: None,
            output: None,
            rope_freqs: false,
        };
        write_synthetic(&path, &spec, &mut |_, _| {}).expect("writing the synthetic model");
        let m = Arc::new(Model::load(&path).expect("loading the synthetic model"));
        let _ = std::fs::remove_file(&path);
        m
    })
    .clone()
}

fn default_model() -> Arc<Model> {
    static M: OnceLock<Arc<Model>> = OnceLock::new();
    M.get_or_init(|| {
        let path = akunu_core::fetch::ensure_default_model(&mut |m| eprintln!("{m}"))
            .expect("fetching the default model");
        Arc::new(Model::load(&path).expect("loading the default model"))
    })
    .clone()
}

fn engine(model: &Arc<Model>, threads: usize) -> Engine {
    let opts = EngineOptions {
        ctx: Some(512),
        chunk: 16,
        prefill_chunk: 64,
    };
    Engine::new(model.clone(), Box::new(CpuBackend::new(threads)), &opts).expect("engine")
}

/// What a generation produced, in order: a probe of the logits the next
/// token was chosen from, or an emitted token.
#[derive(Clone, Debug)]
enum Event {
    Probe(Vec<f32>),
    Token(u32),
}

fn run_events(
    e: &mut Engine,
    prompt: &[u32],
    opts: &GenerateOptions,
) -> Result<(Vec<Event>, Stats), EngineError> {
    let events = Arc::new(Mutex::new(Vec::new()));
    let sink = events.clone();
    e.set_logits_probe(Some(Box::new(move |l: &[f32]| {
        sink.lock().unwrap().push(Event::Probe(l.to_vec()))
    })));
    let ev = events.clone();
    let r = e.generate(prompt, opts, &mut |id, _| {
        ev.lock().unwrap().push(Event::Token(id));
        true
    });
    e.set_logits_probe(None);
    let out = events.lock().unwrap().clone();
    r.map(|st| (out, st))
}

fn greedy(c: Constraint, max_tokens: u32) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        constraint: Some(c),
        ..Default::default()
    }
}

#[test]
fn grammar_is_the_chosen_path() {
    let o = greedy(Constraint::JsonObject, 4);
    assert_eq!(o.decode_path(), DecodePath::Grammar);
}

/// Every probed logits vector is -inf exactly on the tokens the regular
/// expression cannot continue with, and the chosen token is its argmax.
#[test]
fn mask_reaches_the_logits() {
    let model = tiny_model();
    let tok = &model.tokenizer;
    let mut e = engine(&model, 2);
    // Tokens made only of the letters a and b (the grammar is [ab]{1,24}).
    let ab = |id: u32| {
        let b = tok.token_bytes(id);
        !b.is_empty() && b.iter().all(|&c| c == b'a' || c == b'b')
    };
    let prompt = tok.encode("hello", false, false).unwrap();
    let (events, st) = run_events(
        &mut e,
        &prompt,
        &greedy(Constraint::Regex("[ab]{1,24}".into()), 30),
    )
    .expect("generate");
    assert!(st.generated_tokens > 0);
    let mut text = Vec::new();
    let mut probes = 0;
    for (i, ev) in events.iter().enumerate() {
        match ev {
            Event::Probe(l) => {
                probes += 1;
                let room = 24 - text.len();
                let chosen = match events.get(i + 1) {
                    Some(Event::Token(t)) => Some(*t),
                    _ => None,
                };
                for (id, &v) in l.iter().enumerate() {
                    let id = id as u32;
                    let b = tok.token_bytes(id);
                    let allowed =
                        (ab(id) && b.len() <= room) || (tok.is_eog(id) && !text.is_empty());
                    assert_eq!(
                        v.is_finite(),
                        allowed,
                        "token {id} ({:?}) after {:?}: logit {v}",
                        String::from_utf8_lossy(&b),
                        String::from_utf8_lossy(&text)
                    );
                }
                let best = l
                    .iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .map(|(i, _)| i as u32)
                    .unwrap();
                if let Some(c) = chosen {
                    assert_eq!(c, best, "the chosen token is the masked argmax");
                } else {
                    // Nothing emitted after the last probe: it chose the end.
                    assert!(tok.is_eog(best));
                }
            }
            Event::Token(t) => text.extend(tok.token_bytes(*t)),
        }
    }
    assert!(probes > 0);
    assert!(text.len() <= 24 && text.iter().all(|&c| c == b'a' || c == b'b'));
    assert!(matches!(
        st.stop_reason,
        StopReason::Eos | StopReason::GrammarComplete
    ));
    let g = st.grammar.expect("grammar stats");
    assert!(g.masks > 0 && g.mask_us_mean > 0.0);
}

/// End of generation is allowed only once the grammar can end: sampled
/// runs of `a{3,6}` never end early, and always end by the sixth `a`.
#[test]
fn eos_only_where_the_grammar_allows() {
    let model = tiny_model();
    let tok = &model.tokenizer;
    let mut e = engine(&model, 2);
    let prompt = tok.encode("x", false, false).unwrap();
    let mut ends = std::collections::HashSet::new();
    for seed in 0..12 {
        e.reset();
        let opts = GenerateOptions {
            max_tokens: 20,
            constraint: Some(Constraint::Regex("a{3,6}".into())),
            sampling: SamplingConfig {
                temperature: 1.5,
                seed,
                ..Default::default()
            },
            ..Default::default()
        };
        let (events, st) = run_events(&mut e, &prompt, &opts).expect("generate");
        let mut text = String::new();
        for ev in &events {
            match ev {
                Event::Probe(l) => {
                    for &eos in &tok.eog_ids() {
                        if l[eos as usize].is_finite() {
                            assert!(text.len() >= 3, "EOS allowed after {text:?}");
                        }
                    }
                }
                Event::Token(t) => text.push_str(&tok.decode(&[*t])),
            }
        }
        assert!(
            (3..=6).contains(&text.len()) && text.chars().all(|c| c == 'a'),
            "{text:?}"
        );
        assert!(
            matches!(
                st.stop_reason,
                StopReason::Eos | StopReason::GrammarComplete
            ),
            "{:?}",
            st.stop_reason
        );
        if text.len() == 6 {
            assert_eq!(st.stop_reason, StopReason::GrammarComplete);
        }
        ends.insert(text.len());
    }
    eprintln!("lengths seen: {ends:?}");
}

/// A long literal is forced by the grammar: its tokens are emitted without
/// masks and fed in one batched step.
#[test]
fn forced_tokens_go_in_one_step() {
    let model = tiny_model();
    let tok = &model.tokenizer;
    let mut e = engine(&model, 2);
    let prompt = tok.encode("x", false, false).unwrap();
    let lit = "the quick brown fox jumps over the lazy dog";
    let re = format!("(a|b){lit}!(c|d)");
    let mut text = String::new();
    let st = e
        .generate(&prompt, &greedy(Constraint::Regex(re), 64), &mut |_, s| {
            text.push_str(s);
            true
        })
        .expect("generate");
    assert!(
        Regex::new(&format!("^(a|b){lit}!(c|d)$"))
            .unwrap()
            .is_match(&text),
        "{text:?}"
    );
    let g = st.grammar.clone().expect("grammar stats");
    assert!(g.forced_tokens >= 5, "{g:?}");
    // One mask for the first letter, one after the literal; the literal's
    // tokens cost at most a couple of forward steps.
    assert!(st.decode_steps <= 3, "{st:?}");
    assert!(g.masks <= 4, "{g:?}");
    // Continuing after a constrained turn works like any other turn.
    let more = tok.encode(" and then", false, false).unwrap();
    let mut second = String::new();
    e.generate(
        &more,
        &greedy(Constraint::Regex("[xy]{2}".into()), 4),
        &mut |_, s| {
            second.push_str(s);
            true
        },
    )
    .expect("a second constrained turn");
    assert!(
        Regex::new("^[xy]{2}$").unwrap().is_match(&second),
        "{second:?}"
    );
}

#[test]
fn invalid_constraints_fail_before_generation() {
    let model = tiny_model();
    let mut e = engine(&model, 2);
    let prompt = model.tokenizer.encode("x", false, false).unwrap();
    let cases = [
        (Constraint::JsonSchema("{\"type\": ".into()), "JSON schema"),
        (
            Constraint::JsonSchema(r#"{"type": "objekt"}"#.into()),
            "JSON schema",
        ),
        (
            Constraint::Lark("start: missing_rule".into()),
            "Lark grammar",
        ),
        (Constraint::Lark("start: (\"a\"".into()), "Lark grammar"),
        (Constraint::Regex("(abc".into()), "regular expression"),
        (Constraint::Regex("[z-a]".into()), "regular expression"),
    ];
    for (c, want) in cases {
        let mut called = false;
        let r = e.generate(&prompt, &greedy(c.clone(), 8), &mut |_, _| {
            called = true;
            true
        });
        match r {
            Err(EngineError::InvalidConstraint { kind, message }) => {
                assert_eq!(kind, want, "{c:?}");
                assert!(!message.is_empty());
                let shown = EngineError::InvalidConstraint { kind, message }.to_string();
                assert!(shown.starts_with(&format!("invalid {want}")), "{shown}");
            }
            other => panic!("{c:?}: expected an invalid-constraint error, got {other:?}"),
        }
        assert!(!called, "{c:?}: a token was generated");
        assert_eq!(e.position(), 0, "{c:?}: the prompt was evaluated");
    }
}

// ---- the default model -------------------------------------------------

fn chat(model: &Model, ask: &str) -> Vec<u32> {
    let text = format!("<|im_start|>user\n{ask}<|im_end|>\n<|im_start|>assistant\n");
    model.tokenizer.encode(&text, true, true).unwrap()
}

/// 50 sampled generations under `c`, each checked by `check`; all must
/// finish (grammar complete or EOS where allowed) within `max_tokens`.
fn fifty(c: Constraint, ask: &str, max_tokens: u32, check: &dyn Fn(&str) -> Result<(), String>) {
    fifty_at(c, ask, max_tokens, 0.7, check)
}

fn fifty_at(
    c: Constraint,
    ask: &str,
    max_tokens: u32,
    temperature: f32,
    check: &dyn Fn(&str) -> Result<(), String>,
) {
    let model = default_model();
    let mut e = engine(&model, 1);
    let prompt = chat(&model, ask);
    let mut mask_us = Vec::new();
    for seed in 0..50u64 {
        e.reset();
        let opts = GenerateOptions {
            max_tokens,
            constraint: Some(c.clone()),
            sampling: SamplingConfig {
                temperature,
                top_k: 40,
                repeat_penalty: 1.1,
                seed: 1000 + seed,
                ..Default::default()
            },
            ..Default::default()
        };
        let mut text = String::new();
        let st = e
            .generate(&prompt, &opts, &mut |_, s| {
                text.push_str(s);
                true
            })
            .expect("generate");
        assert!(
            matches!(
                st.stop_reason,
                StopReason::GrammarComplete | StopReason::Eos
            ),
            "seed {seed}: stopped by {:?} after {text:?}",
            st.stop_reason
        );
        if let Err(why) = check(&text) {
            panic!("seed {seed}: {why}: {text:?}");
        }
        mask_us.push(st.grammar.unwrap().mask_us_median);
    }
    mask_us.sort_by(f64::total_cmp);
    eprintln!("{c:?}: median mask time {:.0} us", mask_us[25]);
}

fn json(text: &str) -> Result<serde_json::Map<String, Value>, String> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(v) => Err(format!("not an object: {v}")),
        Err(e) => Err(format!("not JSON: {e}")),
    }
}

fn only_keys(m: &serde_json::Map<String, Value>, keys: &[&str]) -> Result<(), String> {
    match m.keys().find(|k| !keys.contains(&k.as_str())) {
        Some(k) => Err(format!("unexpected key {k}")),
        None => Ok(()),
    }
}

fn string<'a>(m: &'a serde_json::Map<String, Value>, k: &str) -> Result<&'a str, String> {
    m.get(k)
        .and_then(Value::as_str)
        .ok_or_else(|| format!("{k} is not a string"))
}

fn int_in(v: Option<&Value>, k: &str, lo: i64, hi: i64) -> Result<i64, String> {
    let i = v
        .and_then(Value::as_i64)
        .ok_or_else(|| format!("{k} is not an integer"))?;
    if (lo..=hi).contains(&i) {
        Ok(i)
    } else {
        Err(format!("{k} = {i} outside {lo}..={hi}"))
    }
}

fn matches(re: &str, s: &str, what: &str) -> Result<(), String> {
    if Regex::new(re).unwrap().is_match(s) {
        Ok(())
    } else {
        Err(format!("{what} = {s:?} does not match {re}"))
    }
}

#[test]
fn schema_nested_objects() {
    let schema = r#"{"type":"object","additionalProperties":false,
      "required":["name","address"],
      "properties":{
        "name":{"type":"string","maxLength":16},
        "address":{"type":"object","additionalProperties":false,
          "required":["city","zip"],
          "properties":{
            "city":{"type":"string","maxLength":16},
            "zip":{"type":"string","pattern":"^[0-9]{5}$"}}}}}"#;
    fifty(
        Constraint::JsonSchema(schema.into()),
        "Give a person with a name and an address (city, zip code) as JSON.",
        96,
        &|t| {
            let m = json(t)?;
            only_keys(&m, &["name", "address"])?;
            if string(&m, "name")?.chars().count() > 16 {
                return Err("name too long".into());
            }
            let a = m
                .get("address")
                .and_then(Value::as_object)
                .ok_or("address is not an object")?;
            only_keys(a, &["city", "zip"])?;
            if string(a, "city")?.chars().count() > 16 {
                return Err("city too long".into());
            }
            matches("^[0-9]{5}$", string(a, "zip")?, "zip")
        },
    );
}

#[test]
fn schema_arrays() {
    let schema = r#"{"type":"object","additionalProperties":false,"required":["scores","words"],
      "properties":{
        "scores":{"type":"array","items":{"type":"integer","minimum":1,"maximum":9},"minItems":1,"maxItems":5},
        "words":{"type":"array","items":{"type":"string","maxLength":10},"maxItems":3}}}"#;
    fifty(
        Constraint::JsonSchema(schema.into()),
        "List a few scores from 1 to 9 and some words, as JSON.",
        96,
        &|t| {
            let m = json(t)?;
            only_keys(&m, &["scores", "words"])?;
            let s = m
                .get("scores")
                .and_then(Value::as_array)
                .ok_or("scores is not an array")?;
            if !(1..=5).contains(&s.len()) {
                return Err(format!("{} scores", s.len()));
            }
            for v in s {
                int_in(Some(v), "score", 1, 9)?;
            }
            let w = m
                .get("words")
                .and_then(Value::as_array)
                .ok_or("words is not an array")?;
            if w.len() > 3 {
                return Err(format!("{} words", w.len()));
            }
            for v in w {
                let s = v.as_str().ok_or("a word is not a string")?;
                if s.chars().count() > 10 {
                    return Err(format!("word {s:?} too long"));
                }
            }
            Ok(())
        },
    );
}

#[test]
fn schema_enums() {
    let schema = r#"{"type":"object","additionalProperties":false,"required":["color","size","count"],
      "properties":{
        "color":{"enum":["red","green","blue"]},
        "size":{"type":"string","enum":["S","M","L","XL"]},
        "count":{"enum":[1,2,3]}}}"#;
    fifty(
        Constraint::JsonSchema(schema.into()),
        "Describe a t-shirt order (color, size, count) as JSON.",
        48,
        &|t| {
            let m = json(t)?;
            only_keys(&m, &["color", "size", "count"])?;
            let c = string(&m, "color")?;
            if !["red", "green", "blue"].contains(&c) {
                return Err(format!("color {c}"));
            }
            let s = string(&m, "size")?;
            if !["S", "M", "L", "XL"].contains(&s) {
                return Err(format!("size {s}"));
            }
            int_in(m.get("count"), "count", 1, 3).map(|_| ())
        },
    );
}

#[test]
fn schema_numbers_with_bounds() {
    let schema = r#"{"type":"object","additionalProperties":false,"required":["celsius","humidity","stations"],
      "properties":{
        "celsius":{"type":"number","minimum":-40,"maximum":50},
        "humidity":{"type":"number","exclusiveMinimum":0,"maximum":1},
        "stations":{"type":"integer","minimum":1,"maximum":200}}}"#;
    fifty(
        Constraint::JsonSchema(schema.into()),
        "Give today's weather (celsius, humidity as a fraction, number of stations) as JSON.",
        // Numbers may carry many digits: room for two long fractions.
        112,
        &|t| {
            let m = json(t)?;
            only_keys(&m, &["celsius", "humidity", "stations"])?;
            let c = m
                .get("celsius")
                .and_then(Value::as_f64)
                .ok_or("celsius is not a number")?;
            if !(-40.0..=50.0).contains(&c) {
                return Err(format!("celsius {c}"));
            }
            let h = m
                .get("humidity")
                .and_then(Value::as_f64)
                .ok_or("humidity is not a number")?;
            if !(h > 0.0 && h <= 1.0) {
                return Err(format!("humidity {h}"));
            }
            int_in(m.get("stations"), "stations", 1, 200).map(|_| ())
        },
    );
}

#[test]
fn schema_string_patterns() {
    let schema = r#"{"type":"object","additionalProperties":false,"required":["id","email"],
      "properties":{
        "id":{"type":"string","pattern":"^[A-Z]{2}-[0-9]{3}$"},
        "email":{"type":"string","pattern":"^[a-z]{1,10}@[a-z]{1,10}\\.com$"}}}"#;
    fifty(
        Constraint::JsonSchema(schema.into()),
        "Make up a user with an id like AB-123 and an email address, as JSON.",
        64,
        &|t| {
            let m = json(t)?;
            only_keys(&m, &["id", "email"])?;
            matches("^[A-Z]{2}-[0-9]{3}$", string(&m, "id")?, "id")?;
            matches(
                "^[a-z]{1,10}@[a-z]{1,10}\\.com$",
                string(&m, "email")?,
                "email",
            )
        },
    );
}

#[test]
fn schema_optional_fields() {
    let schema = r#"{"type":"object","additionalProperties":false,"required":["name"],
      "properties":{
        "name":{"type":"string","maxLength":12},
        "nickname":{"type":"string","maxLength":12},
        "age":{"type":"integer","minimum":0,"maximum":120},
        "member":{"type":"boolean"}}}"#;
    fifty(
        Constraint::JsonSchema(schema.into()),
        "Describe a club member as JSON; the nickname, age and membership are optional.",
        80,
        &|t| {
            let m = json(t)?;
            only_keys(&m, &["name", "nickname", "age", "member"])?;
            if string(&m, "name")?.chars().count() > 12 {
                return Err("name too long".into());
            }
            if m.contains_key("nickname") && string(&m, "nickname")?.chars().count() > 12 {
                return Err("nickname too long".into());
            }
            if m.contains_key("age") {
                int_in(m.get("age"), "age", 0, 120)?;
            }
            if let Some(v) = m.get("member")
                && !v.is_boolean()
            {
                return Err("member is not a boolean".into());
            }
            Ok(())
        },
    );
}

#[test]
fn any_json_object() {
    // Nothing bounds an object of any shape but the model itself: a cooler
    // temperature keeps the 135M model from rambling past the budget.
    fifty_at(
        Constraint::JsonObject,
        "Describe a cat as a JSON object with two keys: name and color.",
        192,
        0.3,
        &|t| json(t).map(|_| ()),
    );
}

#[test]
fn lark_grammar() {
    let g = r#"
start: answer " because " reason "."
answer: "yes" | "no"
reason: /[a-z ]{1,40}/
"#;
    fifty(
        Constraint::Lark(g.into()),
        "Is the sky blue? Answer yes or no and say why.",
        40,
        &|t| matches(r"^(yes|no) because [a-z ]{1,40}\.$", t, "answer"),
    );
}

#[test]
fn regular_expression() {
    let re = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])";
    fifty(
        Constraint::Regex(re.into()),
        "When did the first person walk on the moon? Give the date.",
        16,
        &|t| matches(&format!("^{re}$"), t, "date"),
    );
}
