//! The OpenAI request shapes: parsing and validation into what the engine
//! thread runs, and the error JSON.
//!
//! Fields are read one by one so that a wrong type names its parameter.
//! Unknown fields are ignored (clients send many optional ones); fields
//! whose meaning akunu cannot honour (`n` > 1, non-zero penalties, tools,
//! `logit_bias`, `echo`, `suffix`) are rejected rather than ignored.

use akunu_core::chat_template::ChatMessage;
use akunu_core::decode::Constraint;
use akunu_core::sampling::SamplingConfig;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    pub fn param(mut self, p: &str) -> Self {
        self.param = Some(p.to_string());
        self
    }

    pub fn code(mut self, c: &'static str) -> Self {
        self.code = Some(c);
        self
    }

    pub fn with_status(mut self, s: StatusCode, kind: &'static str) -> Self {
        self.status = s;
        self.kind = kind;
        self
    }

    pub fn server(message: impl Into<String>) -> Self {
        ApiError::bad_request(message)
            .with_status(StatusCode::INTERNAL_SERVER_ERROR, "server_error")
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }});
        (self.status, axum::Json(body)).into_response()
    }
}

/// Which endpoint a request came to.
#[derive(Copy, Clone, PartialEq, Debug)]
pub enum Endpoint {
    Chat,
    Completions,
}

/// What the prompt is before tokenization.
pub enum PromptInput {
    Messages(Vec<ChatMessage>),
    Text(String),
    Ids(Vec<u32>),
}

/// A validated request.
pub struct Request {
    pub model: String,
    pub prompt: PromptInput,
    /// None: as many as the context leaves (chat), 16 (completions).
    pub max_tokens: Option<u32>,
    pub sampling: SamplingConfig,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub logprobs: Option<usize>,
    pub constraint: Option<Constraint>,
    pub ignore_eos: bool,
}

type Obj = Map<String, Value>;

/// Reads an optional field; `null` counts as absent.
fn field<T: DeserializeOwned>(o: &Obj, name: &str) -> Result<Option<T>, ApiError> {
    match o.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => T::deserialize(v)
            .map(Some)
            .map_err(|e| ApiError::bad_request(format!("'{name}': {e}")).param(name)),
    }
}

fn check(ok: bool, name: &str, msg: &str) -> Result<(), ApiError> {
    if ok {
        Ok(())
    } else {
        Err(ApiError::bad_request(format!("'{name}' {msg}")).param(name))
    }
}

/// Parses a request body for `endpoint`.
pub fn parse(body: &[u8], endpoint: Endpoint) -> Result<Request, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
    let Value::Object(o) = v else {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    };
    let model: String = field(&o, "model")?
        .ok_or_else(|| ApiError::bad_request("'model' is required").param("model"))?;

    let prompt = match endpoint {
        Endpoint::Chat => PromptInput::Messages(messages(&o)?),
        Endpoint::Completions => completion_prompt(&o)?,
    };

    let max_tokens: Option<u32> = match field(&o, "max_completion_tokens")? {
        Some(n) => Some(n),
        None => field(&o, "max_tokens")?,
    };

    // Sampling: OpenAI's defaults (temperature 1, top_p 1); top_k, min_p,
    // repeat_penalty and repeat_last_n are akunu extensions.
    let temperature: f32 = field(&o, "temperature")?.unwrap_or(1.0);
    check(
        (0.0..=2.0).contains(&temperature),
        "temperature",
        "must be between 0 and 2",
    )?;
    let top_p: f32 = field(&o, "top_p")?.unwrap_or(1.0);
    check(top_p > 0.0 && top_p <= 1.0, "top_p", "must be in (0, 1]")?;
    let min_p: f32 = field(&o, "min_p")?.unwrap_or(0.0);
    check((0.0..=1.0).contains(&min_p), "min_p", "must be in [0, 1]")?;
    let repeat_penalty: f32 = field(&o, "repeat_penalty")?.unwrap_or(1.0);
    check(repeat_penalty > 0.0, "repeat_penalty", "must be positive")?;
    let repeat_last_n: u32 = field(&o, "repeat_last_n")?.unwrap_or(64);
    check(
        repeat_last_n <= akunu_core::builder::RECENT_CAPACITY,
        "repeat_last_n",
        &format!("must be at most {}", akunu_core::builder::RECENT_CAPACITY),
    )?;
    let seed: Option<u64> = field(&o, "seed")?;
    let sampling = SamplingConfig {
        temperature,
        top_k: field(&o, "top_k")?.unwrap_or(0),
        top_p,
        min_p,
        repeat_penalty,
        repeat_last_n,
        seed: seed.unwrap_or_else(akunu_core::sampling::random_seed),
    };
    sampling
        .validate()
        .map_err(|e| ApiError::bad_request(format!("invalid sampling parameters: {e}")))?;

    for name in ["frequency_penalty", "presence_penalty"] {
        let p: f32 = field(&o, name)?.unwrap_or(0.0);
        check(
            p == 0.0,
            name,
            "is not supported (only 0); use the 'repeat_penalty' extension instead",
        )?;
    }
    let n: u32 = field(&o, "n")?.unwrap_or(1);
    check(n == 1, "n", "must be 1: one choice per request")?;
    if endpoint == Endpoint::Completions {
        let best_of: u32 = field(&o, "best_of")?.unwrap_or(1);
        check(best_of == 1, "best_of", "must be 1")?;
        let echo: bool = field(&o, "echo")?.unwrap_or(false);
        check(!echo, "echo", "is not supported")?;
        let suffix: String = field(&o, "suffix")?.unwrap_or_default();
        check(suffix.is_empty(), "suffix", "is not supported")?;
    }
    for name in ["tools", "functions"] {
        let t: Vec<Value> = field(&o, name)?.unwrap_or_default();
        check(t.is_empty(), name, "(tool calling) is not supported")?;
    }
    let bias: Map<String, Value> = field(&o, "logit_bias")?.unwrap_or_default();
    check(bias.is_empty(), "logit_bias", "is not supported")?;

    let stop = match field::<Value>(&o, "stop")? {
        None => vec![],
        Some(Value::String(s)) => vec![s],
        Some(v) => {
            let list: Vec<String> = Vec::deserialize(&v).map_err(|_| {
                ApiError::bad_request("'stop' must be a string or an array of strings")
                    .param("stop")
            })?;
            check(list.len() <= 4, "stop", "takes at most 4 sequences")?;
            list
        }
    };
    let stream: bool = field(&o, "stream")?.unwrap_or(false);
    let include_usage = match field::<Obj>(&o, "stream_options")? {
        Some(so) => field::<bool>(&so, "include_usage")?.unwrap_or(false),
        None => false,
    };

    let logprobs = match endpoint {
        Endpoint::Chat => {
            let on: bool = field(&o, "logprobs")?.unwrap_or(false);
            let top: Option<u32> = field(&o, "top_logprobs")?;
            if let Some(k) = top {
                check(k <= 20, "top_logprobs", "must be between 0 and 20")?;
                check(on, "top_logprobs", "needs 'logprobs': true")?;
            }
            on.then_some(top.unwrap_or(0) as usize)
        }
        Endpoint::Completions => {
            let k: Option<u32> = field(&o, "logprobs")?;
            if let Some(k) = k {
                check(k <= 5, "logprobs", "must be between 0 and 5")?;
            }
            k.map(|k| k as usize)
        }
    };

    Ok(Request {
        model,
        prompt,
        max_tokens,
        sampling,
        stop,
        stream,
        include_usage,
        logprobs,
        constraint: response_format(&o)?,
        ignore_eos: field(&o, "ignore_eos")?.unwrap_or(false),
    })
}

fn messages(o: &Obj) -> Result<Vec<ChatMessage>, ApiError> {
    let list: Vec<Obj> = field(o, "messages")?
        .ok_or_else(|| ApiError::bad_request("'messages' is required").param("messages"))?;
    check(!list.is_empty(), "messages", "must not be empty")?;
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let at = |what: &str| format!("messages[{i}].{what}");
            let role: String = field(m, "role")
                .map_err(|e| e.param(&at("role")))?
                .ok_or_else(|| {
                    ApiError::bad_request(format!("'{}' is required", at("role")))
                        .param(&at("role"))
                })?;
            let content = match m.get("content") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    // Content parts: only text is understood.
                    let mut s = String::new();
                    for p in parts {
                        match (p.get("type").and_then(Value::as_str), p.get("text")) {
                            (Some("text"), Some(Value::String(t))) => s.push_str(t),
                            _ => {
                                return Err(ApiError::bad_request(format!(
                                    "'{}': only text content parts are supported",
                                    at("content")
                                ))
                                .param(&at("content")));
                            }
                        }
                    }
                    s
                }
                Some(_) => {
                    return Err(ApiError::bad_request(format!(
                        "'{}' must be a string or an array of content parts",
                        at("content")
                    ))
                    .param(&at("content")));
                }
            };
            Ok(ChatMessage { role, content })
        })
        .collect()
}

fn completion_prompt(o: &Obj) -> Result<PromptInput, ApiError> {
    let bad = || {
        ApiError::bad_request(
            "'prompt' must be a string, an array of one string, or an array of token ids",
        )
        .param("prompt")
    };
    match o.get("prompt") {
        None | Some(Value::Null) => {
            Err(ApiError::bad_request("'prompt' is required").param("prompt"))
        }
        Some(Value::String(s)) => Ok(PromptInput::Text(s.clone())),
        Some(Value::Array(a)) => match a.as_slice() {
            [Value::String(s)] => Ok(PromptInput::Text(s.clone())),
            [Value::Array(_)] => Vec::<u32>::deserialize(&a[0])
                .map(PromptInput::Ids)
                .map_err(|_| bad()),
            _ if a.len() > 1 && a.iter().all(Value::is_string) => Err(ApiError::bad_request(
                "'prompt': one prompt per request (n = 1)",
            )
            .param("prompt")),
            _ => Vec::<u32>::deserialize(&o["prompt"])
                .map(PromptInput::Ids)
                .map_err(|_| bad()),
        },
        Some(_) => Err(bad()),
    }
}

/// `response_format`: text, json_object, or json_schema (grammar decoding).
fn response_format(o: &Obj) -> Result<Option<Constraint>, ApiError> {
    let Some(rf) = field::<Obj>(o, "response_format")? else {
        return Ok(None);
    };
    let kind: String = field(&rf, "type")?.ok_or_else(|| {
        ApiError::bad_request("'response_format.type' is required").param("response_format")
    })?;
    match kind.as_str() {
        "text" => Ok(None),
        "json_object" => Ok(Some(Constraint::JsonObject)),
        "json_schema" => {
            let js: Obj = field(&rf, "json_schema")?.ok_or_else(|| {
                ApiError::bad_request(
                    "'response_format.json_schema' is required for type json_schema",
                )
                .param("response_format")
            })?;
            let schema: Value = field(&js, "schema")?.unwrap_or_else(|| json!({}));
            Ok(Some(Constraint::JsonSchema(schema.to_string())))
        }
        other => Err(ApiError::bad_request(format!(
            "'response_format.type' must be text, json_object or json_schema, not '{other}'"
        ))
        .param("response_format")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: &str, ep: Endpoint) -> ApiError {
        match parse(body.as_bytes(), ep) {
            Ok(_) => panic!("{body} was accepted"),
            Err(e) => e,
        }
    }

    #[test]
    fn parses_a_full_chat_request() {
        let r = parse(
            br#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],
                "max_tokens":5,"temperature":0,"seed":3,"stop":"x","stream":true,
                "stream_options":{"include_usage":true},"logprobs":true,"top_logprobs":2,
                "response_format":{"type":"json_schema","json_schema":{"name":"n","schema":{"type":"object"}}}}"#,
            Endpoint::Chat,
        )
        .unwrap();
        let PromptInput::Messages(m) = &r.prompt else {
            panic!()
        };
        assert_eq!(m[1], ChatMessage::new("assistant", "ab"));
        assert_eq!(r.max_tokens, Some(5));
        assert_eq!(r.sampling.seed, 3);
        assert!(r.sampling.is_greedy());
        assert_eq!(r.stop, vec!["x"]);
        assert!(r.stream && r.include_usage);
        assert_eq!(r.logprobs, Some(2));
        assert_eq!(
            r.constraint,
            Some(Constraint::JsonSchema(r#"{"type":"object"}"#.into()))
        );
    }

    #[test]
    fn completion_prompts() {
        let ids = parse(br#"{"model":"m","prompt":[1,2,3]}"#, Endpoint::Completions).unwrap();
        assert!(matches!(ids.prompt, PromptInput::Ids(v) if v == [1, 2, 3]));
        let one = parse(
            br#"{"model":"m","prompt":["a"],"logprobs":2}"#,
            Endpoint::Completions,
        )
        .unwrap();
        assert!(matches!(one.prompt, PromptInput::Text(s) if s == "a"));
        assert_eq!(one.logprobs, Some(2));
        err(r#"{"model":"m","prompt":["a","b"]}"#, Endpoint::Completions);
        err(r#"{"model":"m","prompt":{"x":1}}"#, Endpoint::Completions);
    }

    #[test]
    fn bad_requests_name_their_parameter() {
        let e = err(
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":"ten"}"#,
            Endpoint::Chat,
        );
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(e.message.contains("max_tokens"), "{}", e.message);
        let e = err(
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":3}"#,
            Endpoint::Chat,
        );
        assert_eq!(e.param.as_deref(), Some("temperature"));
        let e = err(
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":2}"#,
            Endpoint::Chat,
        );
        assert_eq!(e.param.as_deref(), Some("n"));
        let e = err(
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"presence_penalty":0.5}"#,
            Endpoint::Chat,
        );
        assert_eq!(e.param.as_deref(), Some("presence_penalty"));
        let e = err(
            r#"{"model":"m","messages":[{"role":7,"content":"x"}]}"#,
            Endpoint::Chat,
        );
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = err(r#"{"messages":[]}"#, Endpoint::Chat);
        assert_eq!(e.param.as_deref(), Some("model"));
        let e = err(r#"{"model":"m","messages":[]}"#, Endpoint::Chat);
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = err("{not json", Endpoint::Chat);
        assert!(e.message.contains("not valid JSON"));
        let e = err("[1]", Endpoint::Chat);
        assert!(e.message.contains("JSON object"));
        let e = err(
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"response_format":{"type":"xml"}}"#,
            Endpoint::Chat,
        );
        assert_eq!(e.param.as_deref(), Some("response_format"));
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
    }
}
