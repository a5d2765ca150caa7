//! akunu-core: everything about running a model that does not depend on the
//! device: the GGUF reader, the architecture description, the tokenizer, the
//! dispatch table and its builder, and the decode loop over a [`backend::Backend`].

pub mod arch;
pub mod backend;
pub mod builder;
pub mod chat_template;
pub mod decode;
pub mod dtype;
pub mod fetch;
pub mod gguf;
pub mod gguf_write;
pub mod grammar;
pub mod model;
pub mod ops;
pub mod quantize;
pub mod sampling;
pub mod speculative;
pub mod spm;
pub mod synth;
pub mod table;
pub mod tokenizer;
