//! Chat templates: the model's `tokenizer.chat_template` (a Jinja template,
//! as Hugging Face writes them) rendered with minijinja into the prompt text
//! of a conversation.
//!
//! Hugging Face templates are written against Python's Jinja, so the
//! environment adds what they commonly rely on: Python string and dict
//! methods (`.strip()`, `.items()`, ... through minijinja-contrib's
//! pycompat), `tojson`, `raise_exception(msg)`, loop controls, and the
//! variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`.

use crate::gguf::GgufFile;
use crate::tokenizer::Tokenizer;
use serde::{Deserialize, Serialize};

/// The GGUF metadata key that holds the template.
pub const TEMPLATE_KEY: &str = "tokenizer.chat_template";

#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error(
        "the model has no chat template (no `{TEMPLATE_KEY}` metadata); give one with --chat-template FILE"
    )]
    Missing,
    #[error("the chat template does not parse: {0}")]
    Parse(String),
    #[error("the chat template cannot render this conversation: {0}")]
    Render(String),
}

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
}

/// A parsed chat template with the special-token texts it may refer to.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
}

const NAME: &str = "chat";

impl ChatTemplate {
    /// Parses `source`; `bos_token`/`eos_token` are the texts the template
    /// sees under those names.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, ChatTemplateError> {
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        // Python's Jinja keeps a template's trailing newline only when told
        // to; HF renders with trim_blocks and lstrip_blocks.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| ChatTemplateError::Parse(describe(&e)))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// The template of a model: `override_source` when given, else the
    /// GGUF's `tokenizer.chat_template`.
    pub fn for_model(
        file: &GgufFile,
        tokenizer: &Tokenizer,
        override_source: Option<&str>,
    ) -> Result<Self, ChatTemplateError> {
        let source = match override_source {
            Some(s) => s,
            None => file
                .get_str(TEMPLATE_KEY)
                .ok_or(ChatTemplateError::Missing)?,
        };
        let text = |id: Option<u32>| id.map(|i| tokenizer.decode(&[i])).unwrap_or_default();
        ChatTemplate::new(source, &text(tokenizer.bos()), &text(tokenizer.eos()))
    }

    /// The prompt text of `messages`; with `add_generation_prompt` it ends
    /// with the opening of an assistant turn.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| ChatTemplateError::Parse(describe(&e)))?;
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| ChatTemplateError::Render(describe(&e)))
    }
}

fn raise_exception(msg: String) -> Result<minijinja::Value, minijinja::Error> {
    Err(minijinja::Error::new(
        minijinja::ErrorKind::InvalidOperation,
        format!("the template raised an exception: {msg}"),
    ))
}

/// The error with its line, when minijinja knows it.
fn describe(e: &minijinja::Error) -> String {
    let mut s = match e.detail() {
        Some(d) => format!("{}: {d}", e.kind()),
        None => e.to_string(),
    };
    if let Some(line) = e.line() {
        s.push_str(&format!(" (line {line})"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn chatml_renders_turns_and_generation_prompt() {
        let t = ChatTemplate::new(CHATML, "", "<|im_end|>").unwrap();
        let msgs = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Hi"),
        ];
        let s = t.render(&msgs, true).unwrap();
        assert_eq!(
            s,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let s = t.render(&msgs[1..], false).unwrap();
        assert_eq!(s, "<|im_start|>user\nHi<|im_end|>\n");
    }

    #[test]
    fn python_methods_tojson_and_special_tokens() {
        let src = "{{ bos_token }}{% for m in messages %}{{ m.content.strip() | upper }}|{{ m | tojson }}{% endfor %}{{ eos_token }}";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        let s = t
            .render(&[ChatMessage::new("user", "  hi  ")], false)
            .unwrap();
        // Message keys in their order, as HF's tojson (no key sorting) writes them.
        assert_eq!(s, r#"<s>HI|{"role":"user","content":"  hi  "}</s>"#);
    }

    #[test]
    fn raise_exception_is_a_render_error() {
        let src = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok";
        let t = ChatTemplate::new(src, "", "").unwrap();
        assert_eq!(
            t.render(&[ChatMessage::new("user", "x")], false).unwrap(),
            "ok"
        );
        let e = t
            .render(&[ChatMessage::new("assistant", "x")], false)
            .unwrap_err();
        assert!(matches!(e, ChatTemplateError::Render(_)), "{e}");
        assert!(e.to_string().contains("first must be user"), "{e}");
    }

    #[test]
    fn unparsable_template_is_a_parse_error() {
        let e = ChatTemplate::new("{% for m in messages %}{{ m.content }}", "", "")
            .err()
            .unwrap();
        assert!(matches!(e, ChatTemplateError::Parse(_)), "{e}");
    }
}
