//! A loaded model: its GGUF file, hyper-parameters and tokenizer.

use crate::arch::{ConfigError, ModelConfig};
use crate::gguf::{GgufError, GgufFile};
use crate::tokenizer::{Tokenizer, TokenizerError};
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{path}")]
    Config { path: String, source: ConfigError },
    #[error("{path}: tokenizer")]
    Tokenizer {
        path: String,
        source: TokenizerError,
    },
}

pub struct Model {
    pub file: GgufFile,
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
}

impl Model {
    pub fn load(path: impl AsRef<Path>) -> Result<Model, LoadError> {
        let path = path.as_ref();
        let file = GgufFile::open(path)?;
        let shown = path.display().to_string();
        let config = ModelConfig::from_gguf(&file).map_err(|source| LoadError::Config {
            path: shown.clone(),
            source,
        })?;
        let tokenizer = Tokenizer::from_gguf(&file).map_err(|source| LoadError::Tokenizer {
            path: shown,
            source,
        })?;
        Ok(Model {
            file,
            config,
            tokenizer,
        })
    }

    /// A short name for messages: `general.name`, else the file name.
    pub fn display_name(&self) -> String {
        match self.file.get_str("general.name") {
            Some(n) if !n.is_empty() => n.to_string(),
            _ => self
                .file
                .path
                .file_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default(),
        }
    }
}
