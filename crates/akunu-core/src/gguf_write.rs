//! GGUF version 3 writer: metadata, tensor directory and tensor data.
//!
//! Tensor data may be given as bytes or as a producer that streams the bytes
//! when the file is written, so a file far larger than memory (an 8B-parameter
//! F16 model) can be written tensor by tensor: the directory needs only each
//! tensor's shape and type, from which its size follows.
//!
//! Layout written (little-endian throughout): header, metadata, tensor
//! directory, zero padding to the alignment, then each tensor's data padded
//! to the alignment. The alignment is 32 (GGUF's default) unless
//! `general.alignment` is set, in which case that key is written too.
//!
//! The file is written to `<path>.partial` and renamed into place once
//! complete, so an interrupted write never leaves a truncated model behind.

use crate::dtype::DType;
use crate::gguf::Value;
use std::collections::HashSet;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

const DEFAULT_ALIGNMENT: u64 = 32;
const MAX_DIMS: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("cannot write {}", .path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error(
        "metadata key '{key}': array elements must all have one type, but element {index} is {found} and element 0 is {first}"
    )]
    MixedArray {
        key: String,
        index: usize,
        found: &'static str,
        first: &'static str,
    },
    #[error("metadata key '{key}': {why}")]
    BadValue { key: String, why: String },
    #[error("tensor '{0}' is added twice")]
    DuplicateTensor(String),
    #[error("tensor '{name}' has invalid dimensions {dims:?}: {why}")]
    BadDims {
        name: String,
        dims: Vec<u64>,
        why: String,
    },
    #[error("tensor '{name}' ({dtype} {dims:?}) needs {want} bytes of data, but {got} were given")]
    DataSize {
        name: String,
        dtype: DType,
        dims: Vec<u64>,
        want: u64,
        got: u64,
    },
    #[error("producing the data of tensor '{name}' failed")]
    Produce { name: String, source: io::Error },
}

/// Streams one tensor's bytes into the file. It must write exactly the
/// tensor's size ([`DType::bytes_for`] of its element count).
pub type Producer<'a> = Box<dyn FnOnce(&mut dyn Write) -> io::Result<()> + 'a>;

enum Data<'a> {
    Bytes(Vec<u8>),
    Stream(Producer<'a>),
}

struct PendingTensor<'a> {
    name: String,
    dims: Vec<u64>,
    dtype: DType,
    n_bytes: u64,
    data: Data<'a>,
}

/// Builder for a GGUF v3 file. Keys keep the order they were first set in;
/// setting a key again replaces its value.
#[derive(Default)]
pub struct GgufWriter<'a> {
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor<'a>>,
    names: HashSet<String>,
}

/// GGUF value type id of a value.
fn type_id(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

/// Checks that every array (nested ones too) is homogeneous.
fn check_value(key: &str, v: &Value, depth: u32) -> Result<(), WriteError> {
    if let Value::Array(items) = v {
        if depth > 2 {
            return Err(WriteError::BadValue {
                key: key.to_string(),
                why: "arrays nested more than 3 deep (GGUF readers reject them)".into(),
            });
        }
        if let Some(first) = items.first() {
            let t = type_id(first);
            for (i, e) in items.iter().enumerate() {
                if type_id(e) != t {
                    return Err(WriteError::MixedArray {
                        key: key.to_string(),
                        index: i,
                        found: e.type_name(),
                        first: first.type_name(),
                    });
                }
                check_value(key, e, depth + 1)?;
            }
        }
    }
    Ok(())
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Appends a value's payload (without its type id).
fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => put_str(out, s),
        Value::Array(items) => {
            // An empty array has no element to take the type from; it is
            // written as an array of u8 (readers see an empty array either way).
            let ety = items.first().map_or(0, type_id);
            out.extend_from_slice(&ety.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for e in items {
                put_value(out, e);
            }
        }
    }
}

/// Counts the bytes that pass through, reporting progress.
struct Counting<'w, W: Write> {
    inner: &'w mut W,
    written: u64,
    done_before: u64,
    total: u64,
    progress: &'w mut dyn FnMut(u64, u64),
}

impl<W: Write> Write for Counting<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        (self.progress)(self.done_before + self.written, self.total);
        Ok(n)
    }
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.inner.write_all(buf)?;
        self.written += buf.len() as u64;
        (self.progress)(self.done_before + self.written, self.total);
        Ok(())
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl<'a> GgufWriter<'a> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets a metadata key (replacing an earlier value of the same key).
    /// Arrays must be homogeneous; arrays of arrays are allowed.
    pub fn kv(&mut self, key: impl Into<String>, value: Value) -> Result<&mut Self, WriteError> {
        let key = key.into();
        check_value(&key, &value, 0)?;
        if key == "general.alignment" {
            match value.as_i64() {
                Some(a) if a > 0 && (a as u64).is_power_of_two() && a <= u32::MAX as i64 => {}
                _ => {
                    return Err(WriteError::BadValue {
                        key,
                        why: format!("must be a power of two, got {}", value.summary()),
                    });
                }
            }
        }
        match self.metadata.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = value,
            None => self.metadata.push((key, value)),
        }
        Ok(self)
    }

    /// Sets `general.alignment` (a power of two); without it, data is
    /// aligned to 32 bytes and the key is not written.
    pub fn alignment(&mut self, align: u32) -> Result<&mut Self, WriteError> {
        self.kv("general.alignment", Value::U32(align))
    }

    fn current_alignment(&self) -> u64 {
        self.metadata
            .iter()
            .find(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| v.as_i64())
            .map_or(DEFAULT_ALIGNMENT, |a| a as u64)
    }

    fn check_tensor(&self, name: &str, dims: &[u64], dtype: DType) -> Result<u64, WriteError> {
        let bad = |why: String| WriteError::BadDims {
            name: name.to_string(),
            dims: dims.to_vec(),
            why,
        };
        if self.names.contains(name) {
            return Err(WriteError::DuplicateTensor(name.to_string()));
        }
        if dims.is_empty() || dims.len() > MAX_DIMS {
            return Err(bad(format!("1 to {MAX_DIMS} dimensions are allowed")));
        }
        if dims.contains(&0) {
            return Err(bad("a dimension is zero".into()));
        }
        if !dims[0].is_multiple_of(dtype.block_elems() as u64) {
            return Err(bad(format!(
                "the row length {} is not a multiple of the {dtype} block size {}",
                dims[0],
                dtype.block_elems()
            )));
        }
        dims.iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .and_then(|n| dtype.bytes_for(n))
            .ok_or_else(|| bad("the size overflows".into()))
    }

    /// Adds a tensor whose bytes are given. `dims` are in GGML order
    /// (`dims[0]` is the contiguous row length).
    pub fn tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        dtype: DType,
        data: Vec<u8>,
    ) -> Result<&mut Self, WriteError> {
        let name = name.into();
        let n_bytes = self.check_tensor(&name, dims, dtype)?;
        if data.len() as u64 != n_bytes {
            return Err(WriteError::DataSize {
                name,
                dtype,
                dims: dims.to_vec(),
                want: n_bytes,
                got: data.len() as u64,
            });
        }
        self.push(name, dims, dtype, n_bytes, Data::Bytes(data));
        Ok(self)
    }

    /// Adds a tensor whose bytes `produce` writes when the file is written
    /// (in the order tensors were added). It must write exactly the tensor's
    /// size; the writer checks.
    pub fn tensor_stream(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        dtype: DType,
        produce: impl FnOnce(&mut dyn Write) -> io::Result<()> + 'a,
    ) -> Result<&mut Self, WriteError> {
        let name = name.into();
        let n_bytes = self.check_tensor(&name, dims, dtype)?;
        self.push(name, dims, dtype, n_bytes, Data::Stream(Box::new(produce)));
        Ok(self)
    }

    fn push(&mut self, name: String, dims: &[u64], dtype: DType, n_bytes: u64, data: Data<'a>) {
        self.names.insert(name.clone());
        self.tensors.push(PendingTensor {
            name,
            dims: dims.to_vec(),
            dtype,
            n_bytes,
            data,
        });
    }

    /// Total size of the file [`write`](Self::write) will produce.
    pub fn file_size(&self) -> u64 {
        let (header, data) = self.layout();
        header.len() as u64 + data
    }

    /// Header + metadata + directory (padded), and the size of the data
    /// section.
    fn layout(&self) -> (Vec<u8>, u64) {
        let align = self.current_alignment();
        let mut h = Vec::new();
        h.extend_from_slice(b"GGUF");
        h.extend_from_slice(&3u32.to_le_bytes());
        h.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        h.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut h, k);
            h.extend_from_slice(&type_id(v).to_le_bytes());
            put_value(&mut h, v);
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            put_str(&mut h, &t.name);
            h.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                h.extend_from_slice(&d.to_le_bytes());
            }
            h.extend_from_slice(&(t.dtype as u32).to_le_bytes());
            h.extend_from_slice(&offset.to_le_bytes());
            offset += t.n_bytes.div_ceil(align) * align;
        }
        h.resize(
            (h.len() as u64).div_ceil(align) as usize * align as usize,
            0,
        );
        (h, offset)
    }

    /// Writes the file.
    pub fn write(self, path: impl AsRef<Path>) -> Result<(), WriteError> {
        self.write_with_progress(path, &mut |_, _| {})
    }

    /// Writes the file, calling `progress(bytes_written, file_size)` as it
    /// goes.
    pub fn write_with_progress(
        self,
        path: impl AsRef<Path>,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<(), WriteError> {
        let path = path.as_ref();
        let mut part = path.as_os_str().to_owned();
        part.push(".partial");
        let part = PathBuf::from(part);
        let r = self.write_to(&part, progress).and_then(|()| {
            std::fs::rename(&part, path).map_err(|source| WriteError::Io {
                path: path.to_path_buf(),
                source,
            })
        });
        if r.is_err() {
            let _ = std::fs::remove_file(&part);
        }
        r
    }

    fn write_to(self, path: &Path, progress: &mut dyn FnMut(u64, u64)) -> Result<(), WriteError> {
        let io_err = |source| WriteError::Io {
            path: path.to_path_buf(),
            source,
        };
        let align = self.current_alignment();
        let (header, data_size) = self.layout();
        let total = header.len() as u64 + data_size;
        let file = File::create(path).map_err(io_err)?;
        let mut w = BufWriter::with_capacity(8 << 20, file);
        w.write_all(&header).map_err(io_err)?;
        let mut done = header.len() as u64;
        progress(done, total);
        let zeros = [0u8; 4096];
        for t in self.tensors {
            let mut c = Counting {
                inner: &mut w,
                written: 0,
                done_before: done,
                total,
                progress,
            };
            match t.data {
                Data::Bytes(b) => c.write_all(&b).map_err(io_err)?,
                Data::Stream(produce) => produce(&mut c).map_err(|source| WriteError::Produce {
                    name: t.name.clone(),
                    source,
                })?,
            }
            if c.written != t.n_bytes {
                return Err(WriteError::DataSize {
                    name: t.name,
                    dtype: t.dtype,
                    dims: t.dims,
                    want: t.n_bytes,
                    got: c.written,
                });
            }
            let pad = (t.n_bytes.div_ceil(align) * align - t.n_bytes) as usize;
            w.write_all(&zeros[..pad]).map_err(io_err)?;
            done += t.n_bytes + pad as u64;
        }
        w.flush().map_err(io_err)?;
        let file = w.into_inner().map_err(|e| io_err(e.into_error()))?;
        file.sync_all().map_err(io_err)?;
        progress(total, total);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;

    fn temp(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!(
            "akunu-gguf-write-{}-{name}.gguf",
            std::process::id()
        ))
    }

    fn all_values() -> Vec<(&'static str, Value)> {
        vec![
            ("general.architecture", Value::String("llama".into())),
            ("t.u8", Value::U8(200)),
            ("t.i8", Value::I8(-100)),
            ("t.u16", Value::U16(60000)),
            ("t.i16", Value::I16(-30000)),
            ("t.u32", Value::U32(4_000_000_000)),
            ("t.i32", Value::I32(-2_000_000_000)),
            ("t.u64", Value::U64(u64::MAX - 1)),
            ("t.i64", Value::I64(i64::MIN + 1)),
            ("t.f32", Value::F32(1.5e-5)),
            ("t.f64", Value::F64(-2.25e100)),
            ("t.bool", Value::Bool(true)),
            ("t.str", Value::String("héllo ✓".into())),
            ("t.empty_str", Value::String(String::new())),
            (
                "t.strs",
                Value::Array(vec![
                    Value::String("a b".into()),
                    Value::String("Ġt".into()),
                ]),
            ),
            ("t.ints", Value::Array(vec![Value::I32(1), Value::I32(-3)])),
            (
                "t.floats",
                Value::Array(vec![Value::F32(0.5), Value::F32(-1.0)]),
            ),
            ("t.empty", Value::Array(vec![])),
            (
                "t.nested",
                Value::Array(vec![
                    Value::Array(vec![Value::U8(1)]),
                    Value::Array(vec![Value::U8(2), Value::U8(3)]),
                ]),
            ),
        ]
    }

    #[test]
    fn round_trip() {
        let path = temp("rt");
        let mut w = GgufWriter::new();
        for (k, v) in all_values() {
            w.kv(k, v).unwrap();
        }
        let a: Vec<u8> = (0..32 * 3 * 4).map(|i| i as u8).collect();
        let q: Vec<u8> = (0..18 * 2 * 5).map(|i| (i * 7) as u8).collect();
        w.tensor("a", &[32, 3], DType::F32, a.clone()).unwrap();
        w.tensor_stream("q", &[64, 5], DType::Q4_0, {
            let q = q.clone();
            move |out: &mut dyn Write| {
                for c in q.chunks(7) {
                    out.write_all(c)?;
                }
                Ok(())
            }
        })
        .unwrap();
        w.tensor("h", &[3], DType::F16, vec![1, 2, 3, 4, 5, 6])
            .unwrap();
        let expect_size = w.file_size();
        let mut last = (0, 0);
        w.write_with_progress(&path, &mut |d, t| last = (d, t))
            .unwrap();
        assert_eq!(last, (expect_size, expect_size));

        let f = GgufFile::open(&path).unwrap();
        assert_eq!(f.version, 3);
        assert_eq!(f.file_size, expect_size);
        let vals = all_values();
        assert_eq!(f.metadata.len(), vals.len());
        for ((k, v), (fk, fv)) in vals.iter().zip(&f.metadata) {
            assert_eq!(k, fk);
            assert_eq!(v, fv, "{k}");
        }
        assert!(f.get("general.alignment").is_none());
        assert_eq!(f.data_offset % 32, 0);
        let names: Vec<&str> = f.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "q", "h"]);
        for t in &f.tensors {
            assert_eq!(t.offset % 32, 0, "{}", t.name);
        }
        assert_eq!(f.tensor("a").unwrap().dims, [32, 3]);
        assert_eq!(f.tensor_data(f.tensor("a").unwrap()), &a[..]);
        let tq = f.tensor("q").unwrap();
        assert_eq!(
            (tq.dtype, tq.dims.as_slice()),
            (DType::Q4_0, &[64u64, 5][..])
        );
        assert_eq!(f.tensor_data(tq), &q[..]);
        assert_eq!(f.tensor_data(f.tensor("h").unwrap()), &[1, 2, 3, 4, 5, 6]);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn custom_alignment() {
        let path = temp("align");
        let mut w = GgufWriter::new();
        w.alignment(256).unwrap();
        w.tensor("x", &[4], DType::F32, vec![9; 16]).unwrap();
        w.tensor("y", &[2], DType::F32, vec![7; 8]).unwrap();
        w.write(&path).unwrap();
        let f = GgufFile::open(&path).unwrap();
        assert_eq!(f.get_i64("general.alignment"), Some(256));
        assert_eq!(f.data_offset % 256, 0);
        assert_eq!(f.tensor("y").unwrap().offset % 256, 0);
        assert_eq!(f.tensor_data(f.tensor("y").unwrap()), &[7; 8]);
        let _ = std::fs::remove_file(&path);
        assert!(GgufWriter::new().alignment(48).is_err());
    }

    #[test]
    fn rejects_bad_input() {
        let mut w = GgufWriter::new();
        let e = w
            .kv("k", Value::Array(vec![Value::U8(1), Value::I32(2)]))
            .err()
            .unwrap();
        assert!(matches!(e, WriteError::MixedArray { index: 1, .. }), "{e}");
        w.tensor("t", &[32], DType::F32, vec![0; 128]).unwrap();
        assert!(matches!(
            w.tensor("t", &[32], DType::F32, vec![0; 128]),
            Err(WriteError::DuplicateTensor(_))
        ));
        assert!(matches!(
            w.tensor("u", &[33], DType::Q8_0, vec![]),
            Err(WriteError::BadDims { .. })
        ));
        assert!(matches!(
            w.tensor("u", &[32], DType::Q8_0, vec![0; 33]),
            Err(WriteError::DataSize {
                want: 34,
                got: 33,
                ..
            })
        ));
        // A producer that writes too little fails the write and leaves no file.
        let path = temp("short");
        w.tensor_stream("s", &[32], DType::F16, |o: &mut dyn Write| {
            o.write_all(&[0; 10])
        })
        .unwrap();
        let e = w.write(&path).unwrap_err();
        assert!(
            matches!(
                e,
                WriteError::DataSize {
                    want: 64,
                    got: 10,
                    ..
                }
            ),
            "{e}"
        );
        assert!(!path.exists());
    }
}
