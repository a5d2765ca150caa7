//! Tensor element types understood by akunu, with their GGML block layouts.

use std::fmt;

/// A tensor storage type. The numeric values are GGML's `ggml_type` ids, as
/// they appear in a GGUF tensor directory.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
#[allow(non_camel_case_types)] // GGML's names (Q4_K, ...)
pub enum DType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    BF16 = 30,
}

impl DType {
    /// Maps a GGML type id to a supported type, or `None` for types akunu
    /// cannot compute with (the caller names the type in its error).
    pub fn from_ggml(id: u32) -> Option<DType> {
        Some(match id {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::Q4_0,
            3 => DType::Q4_1,
            6 => DType::Q5_0,
            7 => DType::Q5_1,
            8 => DType::Q8_0,
            12 => DType::Q4_K,
            13 => DType::Q5_K,
            14 => DType::Q6_K,
            30 => DType::BF16,
            _ => return None,
        })
    }

    /// Number of elements in one storage block.
    pub const fn block_elems(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 => 32,
            // K-quants: a 256-element super-block of 8 or 16 sub-blocks
            DType::Q4_K | DType::Q5_K | DType::Q6_K => 256,
        }
    }

    /// Bytes of one storage block.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            // f16 scale + 16 bytes of nibbles
            DType::Q4_0 => 18,
            // f16 scale + f16 min + 16 bytes of nibbles
            DType::Q4_1 => 20,
            // f16 scale + u32 of fifth bits + 16 bytes of nibbles
            DType::Q5_0 => 22,
            // f16 scale + f16 min + u32 of fifth bits + 16 bytes of nibbles
            DType::Q5_1 => 24,
            // f16 scale + 32 signed bytes
            DType::Q8_0 => 34,
            // f16 d + f16 dmin + 12 bytes of packed 6-bit (scale, min)
            // pairs + 128 bytes of nibbles
            DType::Q4_K => 144,
            // as Q4_K + 32 bytes of fifth bits
            DType::Q5_K => 176,
            // 128 bytes of low nibbles + 64 bytes of 2-bit highs + 16 i8
            // scales + f16 d
            DType::Q6_K => 210,
        }
    }

    /// Bytes needed to store `n` elements (`n` must be a multiple of the
    /// block size; `None` otherwise).
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let be = self.block_elems() as u64;
        if !n.is_multiple_of(be) {
            return None;
        }
        (n / be).checked_mul(self.block_bytes() as u64)
    }

    /// Every supported type, in GGML id order.
    pub const ALL: [DType; 11] = [
        DType::F32,
        DType::F16,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::BF16,
    ];

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
            DType::Q5_0 => "Q5_0",
            DType::Q5_1 => "Q5_1",
            DType::Q8_0 => "Q8_0",
            DType::Q4_K => "Q4_K",
            DType::Q5_K => "Q5_K",
            DType::Q6_K => "Q6_K",
        }
    }
}

/// Human-readable name of any GGML type id, including ones akunu does not
/// support (for error messages).
pub fn ggml_type_name(id: u32) -> String {
    let known = [
        (0, "F32"),
        (1, "F16"),
        (2, "Q4_0"),
        (3, "Q4_1"),
        (6, "Q5_0"),
        (7, "Q5_1"),
        (8, "Q8_0"),
        (9, "Q8_1"),
        (10, "Q2_K"),
        (11, "Q3_K"),
        (12, "Q4_K"),
        (13, "Q5_K"),
        (14, "Q6_K"),
        (15, "Q8_K"),
        (16, "IQ2_XXS"),
        (17, "IQ2_XS"),
        (18, "IQ3_XXS"),
        (19, "IQ1_S"),
        (20, "IQ4_NL"),
        (21, "IQ3_S"),
        (22, "IQ2_S"),
        (23, "IQ4_XS"),
        (24, "I8"),
        (25, "I16"),
        (26, "I32"),
        (27, "I64"),
        (28, "F64"),
        (29, "IQ1_M"),
        (30, "BF16"),
        (34, "TQ1_0"),
        (35, "TQ2_0"),
        (39, "MXFP4"),
    ];
    known
        .iter()
        .find(|(k, _)| *k == id)
        .map(|(_, n)| n.to_string())
        .unwrap_or_else(|| format!("type #{id}"))
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
