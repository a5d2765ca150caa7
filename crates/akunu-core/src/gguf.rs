//! GGUF (versions 2 and 3) reader: metadata, tensor directory and
//! memory-mapped tensor data.
//!
//! Every length and offset read from the file is checked against the file's
//! size before it is used, so a truncated or hostile file yields an error
//! naming the problem, never a panic or an out-of-bounds read.

use crate::dtype::{DType, ggml_type_name};
use memmap2::Mmap;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const GGUF_MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Upper bound on dimensions a tensor may have (GGML's GGML_MAX_DIMS).
const MAX_DIMS: u32 = 4;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot open model file {}", .path.display())]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not a GGUF file (magic bytes {found:?}, expected \"GGUF\")", .path.display())]
    BadMagic { path: PathBuf, found: [u8; 4] },
    #[error("{}: unsupported GGUF version {version} (akunu reads versions 2 and 3)", .path.display())]
    Version { path: PathBuf, version: u32 },
    #[error("{}: file is truncated or corrupt: {what} at byte {offset} runs past the end of the file ({size} bytes)", .path.display())]
    Truncated {
        path: PathBuf,
        what: String,
        offset: u64,
        size: u64,
    },
    #[error("{}: corrupt GGUF: {msg}", .path.display())]
    Corrupt { path: PathBuf, msg: String },
    #[error("{}: tensor '{name}' has data type {type_name}, which akunu does not support (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)", .path.display())]
    UnsupportedType {
        path: PathBuf,
        name: String,
        type_name: String,
    },
    #[error("{}: tensor '{name}' data (bytes {start}..{end}) lies outside the file ({size} bytes)", .path.display())]
    DataOutOfBounds {
        path: PathBuf,
        name: String,
        start: u64,
        end: u64,
        size: u64,
    },
}

impl GgufError {
    fn corrupt(path: &Path, msg: impl Into<String>) -> Self {
        GgufError::Corrupt {
            path: path.to_path_buf(),
            msg: msg.into(),
        }
    }
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// Integer value of any integer type (and bool), if it fits in i64.
    pub fn as_i64(&self) -> Option<i64> {
        Some(match *self {
            Value::U8(v) => v as i64,
            Value::I8(v) => v as i64,
            Value::U16(v) => v as i64,
            Value::I16(v) => v as i64,
            Value::U32(v) => v as i64,
            Value::I32(v) => v as i64,
            Value::U64(v) => i64::try_from(v).ok()?,
            Value::I64(v) => v,
            Value::Bool(v) => v as i64,
            _ => return None,
        })
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F32(_) => "f32",
            Value::F64(_) => "f64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }

    /// Short rendering for `inspect` (arrays are summarised).
    pub fn summary(&self) -> String {
        match self {
            Value::String(s) => {
                let s: String = s.chars().take(80).collect();
                format!("{s:?}")
            }
            Value::Array(a) => {
                let head: Vec<String> = a.iter().take(4).map(|v| v.summary()).collect();
                let more = if a.len() > 4 { ", ..." } else { "" };
                format!("[{}{}] ({} items)", head.join(", "), more, a.len())
            }
            Value::F32(v) => format!("{v}"),
            Value::F64(v) => format!("{v}"),
            Value::Bool(v) => format!("{v}"),
            _ => format!("{}", self.as_i64().unwrap_or_default()),
        }
    }
}

/// One entry of the tensor directory.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions in GGML order: `dims[0]` is the contiguous (row) length.
    pub dims: Vec<u64>,
    pub dtype: DType,
    /// Absolute byte offset of the data in the file.
    pub offset: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A parsed, memory-mapped GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: Vec<(String, Value)>,
    index: HashMap<String, usize>,
    pub tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    pub data_offset: u64,
    pub file_size: u64,
    mmap: Arc<Mmap>,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        let end = (self.pos as u64)
            .checked_add(n)
            .filter(|&e| e <= self.buf.len() as u64);
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end as usize];
                self.pos = end as usize;
                Ok(s)
            }
            None => Err(GgufError::Truncated {
                path: self.path.to_path_buf(),
                what: what.to_string(),
                offset: self.pos as u64,
                size: self.buf.len() as u64,
            }),
        }
    }
    fn u8(&mut self, what: &str) -> Result<u8, GgufError> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, GgufError> {
        Ok(u16::from_le_bytes(self.take(2, what)?.try_into().unwrap()))
    }
    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }
    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let n = self.u64(what)?;
        let bytes = self.take(n, what)?;
        // Vocabularies occasionally hold invalid UTF-8 pieces; keep them
        // readable rather than rejecting the whole file.
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<Value, GgufError> {
        let what = format!("value of metadata key '{key}'");
        Ok(match ty {
            0 => Value::U8(self.u8(&what)?),
            1 => Value::I8(self.u8(&what)? as i8),
            2 => Value::U16(self.u16(&what)?),
            3 => Value::I16(self.u16(&what)? as i16),
            4 => Value::U32(self.u32(&what)?),
            5 => Value::I32(self.u32(&what)? as i32),
            6 => Value::F32(f32::from_bits(self.u32(&what)?)),
            7 => Value::Bool(self.u8(&what)? != 0),
            8 => Value::String(self.string(&what)?),
            9 => {
                if depth > 2 {
                    return Err(GgufError::corrupt(
                        self.path,
                        format!("metadata key '{key}': arrays nested too deeply"),
                    ));
                }
                let ety = self.u32(&what)?;
                let n = self.u64(&what)?;
                // Each element takes at least one byte: a count beyond the
                // remaining bytes is corrupt (and would be a huge allocation).
                let remaining = (self.buf.len() - self.pos) as u64;
                if n > remaining {
                    return Err(GgufError::Truncated {
                        path: self.path.to_path_buf(),
                        what: format!("array of {n} items for metadata key '{key}'"),
                        offset: self.pos as u64,
                        size: self.buf.len() as u64,
                    });
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(ety, key, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64(&what)?),
            11 => Value::I64(self.u64(&what)? as i64),
            12 => Value::F64(f64::from_bits(self.u64(&what)?)),
            other => {
                return Err(GgufError::corrupt(
                    self.path,
                    format!("metadata key '{key}' has unknown value type {other}"),
                ));
            }
        })
    }
}

impl GgufFile {
    /// Opens and parses `path`. The tensor data stays memory-mapped.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|source| GgufError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        // SAFETY: the map is read-only and private to this process. A file
        // truncated or rewritten by another process while mapped would be
        // undefined behaviour; model files are treated as immutable inputs,
        // as every mmap-based loader (llama.cpp included) does.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|source| GgufError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(path, Arc::new(mmap))
    }

    fn parse(path: &Path, mmap: Arc<Mmap>) -> Result<GgufFile, GgufError> {
        let buf: &[u8] = &mmap;
        let file_size = buf.len() as u64;
        let mut c = Cursor { buf, pos: 0, path };
        if buf.len() < 4 {
            return Err(GgufError::Truncated {
                path: path.to_path_buf(),
                what: "magic".into(),
                offset: 0,
                size: file_size,
            });
        }
        let magic: [u8; 4] = buf[..4].try_into().unwrap();
        if &magic != GGUF_MAGIC {
            return Err(GgufError::BadMagic {
                path: path.to_path_buf(),
                found: magic,
            });
        }
        c.pos = 4;
        let version = c.u32("version")?;
        if version != 2 && version != 3 {
            return Err(GgufError::Version {
                path: path.to_path_buf(),
                version,
            });
        }
        let n_tensors = c.u64("tensor count")?;
        let n_kv = c.u64("metadata count")?;
        // Each tensor info and key/value pair is at least 8+ bytes.
        if n_tensors > file_size / 8 || n_kv > file_size / 8 {
            return Err(GgufError::corrupt(
                path,
                format!(
                    "absurd header counts: {n_tensors} tensors, {n_kv} metadata entries in a {file_size}-byte file"
                ),
            ));
        }

        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut index = HashMap::new();
        for _ in 0..n_kv {
            let key = c.string("metadata key")?;
            let ty = c.u32("metadata value type")?;
            let v = c.value(ty, &key, 0)?;
            index.insert(key.clone(), metadata.len());
            metadata.push((key, v));
        }

        let alignment = match index.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_i64() {
                Some(a) if a > 0 && (a as u64).is_power_of_two() => a as u64,
                _ => {
                    return Err(GgufError::corrupt(
                        path,
                        format!(
                            "general.alignment must be a power of two, got {}",
                            v.summary()
                        ),
                    ));
                }
            },
        };

        struct RawTensor {
            name: String,
            dims: Vec<u64>,
            ty: u32,
            rel_offset: u64,
        }
        let mut raw = Vec::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = c.string("tensor name")?;
            let nd = c.u32("tensor dimension count")?;
            if nd == 0 || nd > MAX_DIMS {
                return Err(GgufError::corrupt(
                    path,
                    format!("tensor '{name}' has {nd} dimensions (1 to {MAX_DIMS} allowed)"),
                ));
            }
            let mut dims = Vec::with_capacity(nd as usize);
            for _ in 0..nd {
                dims.push(c.u64("tensor dimension")?);
            }
            let ty = c.u32("tensor type")?;
            let rel_offset = c.u64("tensor offset")?;
            raw.push(RawTensor {
                name,
                dims,
                ty,
                rel_offset,
            });
        }
        let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;

        let mut tensors = Vec::with_capacity(raw.len());
        let mut tensor_index = HashMap::new();
        for t in raw {
            let n_el = t.dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
            let n_el = match n_el {
                Some(n) if n > 0 && n < (1u64 << 40) => n,
                _ => {
                    return Err(GgufError::corrupt(
                        path,
                        format!("tensor '{}' has absurd dimensions {:?}", t.name, t.dims),
                    ));
                }
            };
            let dtype = DType::from_ggml(t.ty).ok_or_else(|| GgufError::UnsupportedType {
                path: path.to_path_buf(),
                name: t.name.clone(),
                type_name: ggml_type_name(t.ty),
            })?;
            if t.dims[0] % dtype.block_elems() as u64 != 0 {
                return Err(GgufError::corrupt(
                    path,
                    format!(
                        "tensor '{}': row length {} is not a multiple of the {} block size {}",
                        t.name,
                        t.dims[0],
                        dtype,
                        dtype.block_elems()
                    ),
                ));
            }
            let n_bytes = dtype.bytes_for(n_el).ok_or_else(|| {
                GgufError::corrupt(path, format!("tensor '{}' size overflows", t.name))
            })?;
            let start = data_offset.checked_add(t.rel_offset);
            let end = start.and_then(|s| s.checked_add(n_bytes));
            match (start, end) {
                (Some(s), Some(e)) if e <= file_size => {
                    if tensor_index.insert(t.name.clone(), tensors.len()).is_some() {
                        return Err(GgufError::corrupt(
                            path,
                            format!("tensor '{}' appears twice", t.name),
                        ));
                    }
                    tensors.push(TensorInfo {
                        name: t.name,
                        dims: t.dims,
                        dtype,
                        offset: s,
                        n_bytes,
                    });
                }
                _ => {
                    return Err(GgufError::DataOutOfBounds {
                        path: path.to_path_buf(),
                        name: t.name,
                        start: start.unwrap_or(u64::MAX),
                        end: end.unwrap_or(u64::MAX),
                        size: file_size,
                    });
                }
            }
        }

        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            index,
            tensors,
            tensor_index,
            data_offset,
            file_size,
            mmap,
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.metadata[i].1)
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(|v| v.as_str())
    }

    pub fn get_i64(&self, key: &str) -> Option<i64> {
        self.get(key).and_then(|v| v.as_i64())
    }

    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key).and_then(|v| v.as_f64())
    }

    pub fn get_bool(&self, key: &str) -> Option<bool> {
        match self.get(key) {
            Some(Value::Bool(b)) => Some(*b),
            Some(v) => v.as_i64().map(|i| i != 0),
            None => None,
        }
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of a tensor (bounds were checked at open).
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        &self.mmap[t.offset as usize..(t.offset + t.n_bytes) as usize]
    }

    /// The whole mapping, for backends that bind weights without copying.
    pub fn mmap(&self) -> &Arc<Mmap> {
        &self.mmap
    }

    /// Total bytes of tensor data.
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.n_bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put_str(v: &mut Vec<u8>, s: &str) {
        v.extend((s.len() as u64).to_le_bytes());
        v.extend(s.as_bytes());
    }

    /// A minimal valid GGUF: one u32 key and one 32-element F32 tensor.
    fn tiny(version: u32) -> Vec<u8> {
        let mut v = b"GGUF".to_vec();
        v.extend(version.to_le_bytes());
        v.extend(1u64.to_le_bytes());
        v.extend(1u64.to_le_bytes());
        put_str(&mut v, "general.architecture");
        v.extend(8u32.to_le_bytes());
        put_str(&mut v, "llama");
        put_str(&mut v, "t");
        v.extend(1u32.to_le_bytes());
        v.extend(32u64.to_le_bytes());
        v.extend(0u32.to_le_bytes());
        v.extend(0u64.to_le_bytes());
        while !v.len().is_multiple_of(32) {
            v.push(0);
        }
        for i in 0..32 {
            v.extend((i as f32).to_le_bytes());
        }
        v
    }

    fn parse_bytes(b: Vec<u8>) -> Result<GgufFile, GgufError> {
        let dir = std::env::temp_dir().join(format!(
            "akunu-gguf-test-{}-{}",
            std::process::id(),
            rand_suffix()
        ));
        std::fs::write(&dir, &b).unwrap();
        let r = GgufFile::open(&dir);
        let _ = std::fs::remove_file(&dir);
        r
    }

    fn rand_suffix() -> u64 {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        N.fetch_add(1, Ordering::Relaxed)
    }

    #[test]
    fn reads_v2_and_v3() {
        for ver in [2, 3] {
            let f = parse_bytes(tiny(ver)).unwrap();
            assert_eq!(f.version, ver);
            assert_eq!(f.get_str("general.architecture"), Some("llama"));
            let t = f.tensor("t").unwrap();
            let d = f.tensor_data(t);
            assert_eq!(d.len(), 128);
            assert_eq!(f32::from_le_bytes(d[124..128].try_into().unwrap()), 31.0);
        }
    }

    #[test]
    fn rejects_bad_magic_version_truncation() {
        let mut b = tiny(3);
        b[0] = b'X';
        assert!(matches!(parse_bytes(b), Err(GgufError::BadMagic { .. })));
        assert!(matches!(
            parse_bytes(tiny(1)),
            Err(GgufError::Version { version: 1, .. })
        ));
        let b = tiny(3);
        for cut in [2, 10, 30, 60, 90] {
            let e = parse_bytes(b[..cut].to_vec())
                .err()
                .expect("truncated header must fail");
            assert!(matches!(e, GgufError::Truncated { .. }), "cut {cut}: {e}");
        }
        // Header intact, data cut short: the tensor lies outside the file.
        let e = parse_bytes(b[..b.len() - 4].to_vec()).err().unwrap();
        assert!(matches!(e, GgufError::DataOutOfBounds { .. }), "{e}");
    }

    #[test]
    fn rejects_unsupported_type_and_absurd_dims() {
        let mut b = tiny(3);
        // tensor type field: find "t" name then dims; patch type to 10 (Q2_K).
        let pos = b
            .windows(9)
            .position(|w| w == [1, 0, 0, 0, 0, 0, 0, 0, b't'])
            .unwrap()
            + 9;
        let ty_pos = pos + 4 + 8;
        b[ty_pos..ty_pos + 4].copy_from_slice(&10u32.to_le_bytes());
        let e = parse_bytes(b.clone()).err().unwrap();
        assert!(matches!(e, GgufError::UnsupportedType { .. }), "{e}");
        assert!(e.to_string().contains("Q2_K"), "{e}");
        // Q4_K is supported, but a 32-element row is not a whole super-block.
        b[ty_pos..ty_pos + 4].copy_from_slice(&12u32.to_le_bytes());
        let e = parse_bytes(b).err().unwrap();
        assert!(
            e.to_string()
                .contains("row length 32 is not a multiple of the Q4_K block size 256"),
            "{e}"
        );

        let mut b = tiny(3);
        b[pos + 4..pos + 12].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = parse_bytes(b).err().unwrap();
        assert!(e.to_string().contains("absurd"), "{e}");
    }
}
