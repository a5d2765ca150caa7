//! `akunu serve`: an OpenAI-compatible HTTP server.
//!
//! axum handlers parse and validate a request, tokenize it (chat requests
//! through the model's chat template) and put it in a bounded queue; one
//! engine thread (`worker`) takes requests in turn and streams events back
//! through a per-request channel. The handler turns them into one JSON
//! response or a stream of server-sent events.

mod api;
mod stop;
mod worker;

use crate::load::{self, EngineArgs, ModelArgs};
use akunu_core::chat_template::ChatTemplate;
use akunu_core::decode::GenerateOptions;
use akunu_core::model::Model;
use anyhow::{Context, Result};
use api::{ApiError, Endpoint, PromptInput};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use clap::Args;
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};
use worker::{Event, Job, Metrics, TokenLogprob};

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// Address to listen on (127.0.0.1: this machine only).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port; the chosen one is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on /v1 requests.
    #[arg(long, env = "AKUNU_API_KEY", value_name = "KEY")]
    api_key: Option<String>,
    /// Requests that may wait while one generates; more get 503.
    #[arg(long, default_value_t = 16)]
    queue: usize,
    /// The model name clients use (default: the GGUF file's name without .gguf).
    #[arg(long)]
    model_name: Option<String>,
    /// Jinja chat template file, instead of the model's `tokenizer.chat_template`.
    #[arg(long, value_name = "FILE")]
    chat_template: Option<std::path::PathBuf>,
}

struct AppState {
    model: Arc<Model>,
    model_id: String,
    /// Err (the reason) when there is no usable template: chat requests then get a 400.
    template: Result<ChatTemplate, String>,
    capacity: u32,
    queue_capacity: usize,
    jobs: SyncSender<Job>,
    metrics: Arc<Metrics>,
    api_key: Option<String>,
    created: u64,
    next_id: AtomicU64,
}

pub fn run(a: ServeArgs) -> Result<()> {
    if a.queue == 0 {
        anyhow::bail!("--queue must be at least 1");
    }
    let path = load::model_path(&a.model)?;
    let model = load::model(&ModelArgs {
        model: Some(path.clone()),
    })?;
    let template = load::chat_template(&model, a.chat_template.as_deref());
    if let Err(e) = &template {
        if a.chat_template.is_some() {
            return Err(anyhow::anyhow!("{e:#}"));
        }
        eprintln!("akunu: {e:#}; /v1/chat/completions will answer 400");
    }
    let model_id = a.model_name.clone().unwrap_or_else(|| {
        path.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    });

    // The engine is built on its own thread (a GPU context belongs to the
    // thread that made it) and lives there.
    let metrics = Arc::new(Metrics::default());
    let (jobs, job_rx) = std::sync::mpsc::sync_channel::<Job>(a.queue);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(u32, String)>>();
    let engine_args = a.engine.clone();
    let (m2, metrics2) = (model.clone(), metrics.clone());
    std::thread::Builder::new()
        .name("akunu-engine".into())
        .spawn(move || match load::engine(m2, &engine_args) {
            Ok(engine) => {
                let _ = ready_tx.send(Ok((engine.capacity(), engine.backend_description())));
                worker::run(engine, job_rx, metrics2);
            }
            Err(e) => {
                let _ = ready_tx.send(Err(e));
            }
        })
        .context("starting the engine thread")?;
    let (capacity, backend) = ready_rx
        .recv()
        .context("the engine thread ended while starting")??;

    let state = Arc::new(AppState {
        model: model.clone(),
        model_id: model_id.clone(),
        template: template.map_err(|e| format!("{e:#}")),
        capacity,
        queue_capacity: a.queue,
        jobs,
        metrics,
        api_key: a.api_key.clone(),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        next_id: AtomicU64::new(1),
    });

    let v1 = Router::new()
        .route("/chat/completions", post(chat_completions))
        .route("/completions", post(completions))
        .route("/models", get(list_models))
        .route("/models/{id}", get(get_model))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    let app = Router::new()
        .nest("/v1", v1)
        .route("/health", get(health))
        .fallback(not_found)
        .with_state(state);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port))
            .await
            .with_context(|| format!("binding {}:{}", a.host, a.port))?;
        let addr = listener.local_addr()?;
        eprintln!(
            "akunu: serving {model_id} ({}) on {backend}, context {capacity}, queue {}",
            model.display_name(),
            a.queue
        );
        eprintln!("akunu: listening on http://{addr}");
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await
            .context("serving")
    })
}

async fn require_key(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    req: axum::extract::Request,
    next: Next,
) -> Response {
    if let Some(key) = &st.api_key {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let err = match given {
            None => Some("missing API key: send 'Authorization: Bearer KEY'"),
            Some(g) if g.trim() != key => Some("incorrect API key"),
            Some(_) => None,
        };
        if let Some(msg) = err {
            return ApiError::bad_request(msg)
                .with_status(StatusCode::UNAUTHORIZED, "authentication_error")
                .code("invalid_api_key")
                .into_response();
        }
    }
    next.run(req).await
}

async fn not_found() -> Response {
    ApiError::bad_request("no such endpoint")
        .with_status(StatusCode::NOT_FOUND, "not_found_error")
        .into_response()
}

fn model_object(st: &AppState) -> Value {
    json!({"id": st.model_id, "object": "model", "created": st.created, "owned_by": "akunu"})
}

async fn list_models(State(st): State<Arc<AppState>>) -> Response {
    axum::Json(json!({"object": "list", "data": [model_object(&st)]})).into_response()
}

async fn get_model(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    if id == st.model_id {
        axum::Json(model_object(&st)).into_response()
    } else {
        unknown_model(&st, &id).into_response()
    }
}

fn unknown_model(st: &AppState, id: &str) -> ApiError {
    ApiError::bad_request(format!(
        "the model '{id}' does not exist; this server serves '{}'",
        st.model_id
    ))
    .with_status(StatusCode::NOT_FOUND, "invalid_request_error")
    .param("model")
    .code("model_not_found")
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    let m = &st.metrics;
    let last = m.last.lock().unwrap_or_else(|e| e.into_inner()).clone();
    axum::Json(json!({
        "status": "ok",
        "model": st.model_id,
        "context": st.capacity,
        "queue": {"waiting": m.queued.load(Ordering::SeqCst), "capacity": st.queue_capacity},
        "generating": m.generating.load(Ordering::SeqCst) > 0,
        "completed": m.completed.load(Ordering::SeqCst),
        "cancelled": m.cancelled.load(Ordering::SeqCst),
        "failed": m.failed.load(Ordering::SeqCst),
        "reused_prompt_tokens": m.reused_tokens.load(Ordering::SeqCst),
        "last": last,
    }))
    .into_response()
}

async fn chat_completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    handle(st, body, Endpoint::Chat)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    handle(st, body, Endpoint::Completions)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// Tokenizes the request's prompt.
fn tokenize(st: &AppState, prompt: &PromptInput) -> Result<Vec<u32>, ApiError> {
    let tok = &st.model.tokenizer;
    let encode = |text: &str, add_special: bool| {
        tok.encode(text, add_special, true)
            .map_err(|e| ApiError::bad_request(format!("cannot tokenize the prompt: {e}")))
    };
    let ids = match prompt {
        PromptInput::Messages(msgs) => {
            let t = st
                .template
                .as_ref()
                .map_err(|e| ApiError::bad_request(e.clone()))?;
            let text = t
                .render(msgs, true)
                .map_err(|e| ApiError::bad_request(e.to_string()).param("messages"))?;
            // Templates that write the BOS text themselves get no second one.
            let bos_text = tok.bos().map(|b| tok.decode(&[b]));
            let has_bos = bos_text.is_some_and(|b| !b.is_empty() && text.starts_with(&b));
            encode(&text, !has_bos)?
        }
        PromptInput::Text(text) => encode(text, true)?,
        PromptInput::Ids(ids) => {
            let n = st.model.config.n_vocab;
            if let Some(bad) = ids.iter().find(|&&i| i >= n) {
                return Err(ApiError::bad_request(format!(
                    "'prompt': token id {bad} is outside the vocabulary ({n} tokens)"
                ))
                .param("prompt"));
            }
            ids.clone()
        }
    };
    if ids.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty").param("prompt"));
    }
    Ok(ids)
}

async fn handle(st: Arc<AppState>, body: Bytes, endpoint: Endpoint) -> Result<Response, ApiError> {
    let req = api::parse(&body, endpoint)?;
    if req.model != st.model_id {
        return Err(unknown_model(&st, &req.model));
    }
    let prompt = tokenize(&st, &req.prompt)?;
    let n_prompt = prompt.len() as u32;
    let room = st.capacity.saturating_sub(n_prompt);
    let max_tokens = match (req.max_tokens, endpoint) {
        (Some(n), _) => n,
        (None, Endpoint::Chat) => room,
        (None, Endpoint::Completions) => 16.min(room),
    };
    if n_prompt as u64 + max_tokens as u64 > st.capacity as u64 || room == 0 {
        return Err(ApiError::bad_request(format!(
            "this model's context holds {} tokens, but the request needs {} ({} in the prompt + {} max_tokens); shorten the prompt or lower max_tokens",
            st.capacity,
            n_prompt as u64 + max_tokens.max(1) as u64,
            n_prompt,
            max_tokens.max(1)
        ))
        .code("context_length_exceeded"));
    }
    let (tx, mut rx) = unbounded_channel();
    let job = Job {
        prompt,
        opts: GenerateOptions {
            max_tokens,
            ignore_eos: req.ignore_eos,
            sampling: req.sampling.clone(),
            constraint: req.constraint.clone(),
            ..Default::default()
        },
        stop: req.stop.clone(),
        logprobs: req.logprobs,
        events: tx,
    };
    st.metrics.queued.fetch_add(1, Ordering::SeqCst);
    if let Err(e) = st.jobs.try_send(job) {
        st.metrics.queued.fetch_sub(1, Ordering::SeqCst);
        return Err(match e {
            TrySendError::Full(_) => ApiError::bad_request(format!(
                "the server is busy: {} requests are already waiting; retry later",
                st.queue_capacity
            ))
            .with_status(StatusCode::SERVICE_UNAVAILABLE, "server_error")
            .code("queue_full"),
            TrySendError::Disconnected(_) => ApiError::server("the engine thread has stopped"),
        });
    }
    // Nothing is sent before the first event, so that an error found
    // before generation (e.g. an invalid schema) is a proper error response.
    let first = rx
        .recv()
        .await
        .ok_or_else(|| ApiError::server("the engine thread has stopped"))?;
    if let Event::Error {
        message,
        bad_request,
    } = first
    {
        return Err(if bad_request {
            ApiError::bad_request(message)
        } else {
            ApiError::server(message)
        });
    }
    let n = st.next_id.fetch_add(1, Ordering::Relaxed);
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Completions => "cmpl",
    };
    let fmt = Formatter {
        endpoint,
        id: format!("{prefix}-akunu-{}-{n}", st.created),
        model: st.model_id.clone(),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        logprobs: req.logprobs.is_some(),
        include_usage: req.include_usage,
        text_offset: 0,
    };
    if req.stream {
        Ok(stream_response(fmt, first, rx))
    } else {
        whole_response(fmt, first, rx).await
    }
}

/// Builds the response objects of both endpoints.
struct Formatter {
    endpoint: Endpoint,
    id: String,
    model: String,
    created: u64,
    logprobs: bool,
    include_usage: bool,
    /// Completions' logprobs give each token's offset in the text.
    text_offset: usize,
}

impl Formatter {
    fn logprobs_json(&mut self, lps: &[TokenLogprob]) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        match self.endpoint {
            Endpoint::Chat => json!({"content": lps.iter().map(|t| json!({
                "token": t.token,
                "logprob": t.logprob,
                "bytes": t.bytes,
                "top_logprobs": t.top.iter().map(|(tok, lp, b)| json!({
                    "token": tok, "logprob": lp, "bytes": b,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>()}),
            Endpoint::Completions => {
                let mut offsets = Vec::new();
                for t in lps {
                    offsets.push(self.text_offset);
                    self.text_offset += t.token.len();
                }
                json!({
                    "tokens": lps.iter().map(|t| &t.token).collect::<Vec<_>>(),
                    "token_logprobs": lps.iter().map(|t| t.logprob).collect::<Vec<_>>(),
                    "top_logprobs": lps.iter().map(|t| t.top.iter()
                        .map(|(tok, lp, _)| (tok.clone(), json!(lp)))
                        .collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
                    "text_offset": offsets,
                })
            }
        }
    }

    fn usage(prompt: u32, completion: u32) -> Value {
        json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
    }

    fn envelope(&self, object: &str, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "akunu",
            "choices": choices,
        })
    }

    /// One streamed chunk with `text` (and its logprobs) and a finish reason.
    fn chunk(&mut self, text: Option<&str>, lps: &[TokenLogprob], finish: Option<&str>) -> Value {
        let logprobs = if text.is_some() {
            self.logprobs_json(lps)
        } else {
            Value::Null
        };
        match self.endpoint {
            Endpoint::Chat => {
                let delta = match text {
                    Some(t) => json!({"content": t}),
                    None => json!({}),
                };
                self.envelope(
                    "chat.completion.chunk",
                    json!([{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]),
                )
            }
            Endpoint::Completions => self.envelope(
                "text_completion",
                json!([{"index": 0, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish}]),
            ),
        }
    }

    /// The SSE data for one engine event.
    fn stream_event(&mut self, ev: Event, out: &mut VecDeque<String>) {
        match ev {
            Event::Text { text, logprobs } => {
                out.push_back(self.chunk(Some(&text), &logprobs, None).to_string());
            }
            Event::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
            } => {
                out.push_back(self.chunk(None, &[], Some(finish_reason)).to_string());
                if self.include_usage {
                    let object = match self.endpoint {
                        Endpoint::Chat => "chat.completion.chunk",
                        Endpoint::Completions => "text_completion",
                    };
                    let mut u = self.envelope(object, json!([]));
                    u["usage"] = Formatter::usage(prompt_tokens, completion_tokens);
                    out.push_back(u.to_string());
                }
                out.push_back("[DONE]".into());
            }
            Event::Error { message, .. } => {
                // Headers are sent: the error goes in the stream.
                out.push_back(
                    json!({"error": {"message": message, "type": "server_error", "param": null, "code": null}})
                        .to_string(),
                );
                out.push_back("[DONE]".into());
            }
        }
    }
}

fn stream_response(mut fmt: Formatter, first: Event, rx: UnboundedReceiver<Event>) -> Response {
    let mut ready = VecDeque::new();
    if fmt.endpoint == Endpoint::Chat {
        // The first chat chunk carries the role.
        let c = fmt.envelope(
            "chat.completion.chunk",
            json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
        );
        ready.push_back(c.to_string());
    }
    fmt.stream_event(first, &mut ready);
    // Dropping this stream (the client went away) drops `rx`, which the
    // engine thread sees at its next token.
    let stream = futures_util::stream::unfold(
        (fmt, ready, rx, false),
        |(mut fmt, mut ready, mut rx, mut ended)| async move {
            loop {
                if let Some(data) = ready.pop_front() {
                    if data == "[DONE]" {
                        ended = true;
                    }
                    let ev = SseEvent::default().data(data);
                    return Some((Ok::<_, Infallible>(ev), (fmt, ready, rx, ended)));
                }
                if ended {
                    return None;
                }
                match rx.recv().await {
                    Some(ev) => fmt.stream_event(ev, &mut ready),
                    None => return None,
                }
            }
        },
    );
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

async fn whole_response(
    mut fmt: Formatter,
    first: Event,
    mut rx: UnboundedReceiver<Event>,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut lps = Vec::new();
    let mut next = Some(first);
    while let Some(ev) = next {
        match ev {
            Event::Text { text: t, logprobs } => {
                text.push_str(&t);
                lps.extend(logprobs);
            }
            Event::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
            } => {
                let logprobs = fmt.logprobs_json(&lps);
                let (object, choice) = match fmt.endpoint {
                    Endpoint::Chat => (
                        "chat.completion",
                        json!({"index": 0, "message": {"role": "assistant", "content": text},
                               "logprobs": logprobs, "finish_reason": finish_reason}),
                    ),
                    Endpoint::Completions => (
                        "text_completion",
                        json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}),
                    ),
                };
                let mut body = fmt.envelope(object, json!([choice]));
                body["usage"] = Formatter::usage(prompt_tokens, completion_tokens);
                return Ok(axum::Json(body).into_response());
            }
            Event::Error {
                message,
                bad_request,
            } => {
                return Err(if bad_request {
                    ApiError::bad_request(message)
                } else {
                    ApiError::server(message)
                });
            }
        }
        next = rx.recv().await;
    }
    Err(ApiError::server("the generation ended without a result"))
}
