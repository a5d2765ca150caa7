//! The GPU's layout for Q4_0, Q4_1 and Q8_0 weights.
//!
//! GGML stores these types as 18-, 20- and 34-byte blocks: a block's quants
//! sit behind its f16 scale(s), so they are only 2-byte aligned and a warp
//! reading a row in place needs many narrow loads. At upload the backend
//! rewrites such a tensor (same size) as all its blocks' quant bytes, then
//! all their scales:
//!
//! ```text
//! [block 0 quants][block 1 quants]...[block N-1 quants][block 0 scales]...[block N-1 scales]
//! ```
//!
//! Blocks are numbered row-major, so row r's quants start at
//! `r * blocks_per_row * quant_bytes`: 16-byte aligned, read with full-width
//! coalesced loads. Kernels find the scales from the tensor's row count,
//! which is why such tensors must be bound whole (`check_bindings`).
//! `weight_row` in `kernels/model.cu` is the device side of this layout.

use akunu_core::backend::BackendError;
use akunu_core::dtype::DType;
use akunu_core::ops::{EmbedParams, GemvParams, KernelId};
use akunu_core::table::{BufferId, DispatchCmd};

/// Where a GGML block keeps its parts.
#[derive(Copy, Clone, Debug, PartialEq)]
struct BlockLayout {
    /// Bytes of one block.
    block: usize,
    /// Bytes of scale (and min) at the block's start.
    scale: usize,
    /// Bytes of quants after them.
    quants: usize,
}

fn layout(dt: DType) -> Option<BlockLayout> {
    match dt {
        DType::Q4_0 => Some(BlockLayout {
            block: 18,
            scale: 2,
            quants: 16,
        }),
        DType::Q4_1 => Some(BlockLayout {
            block: 20,
            scale: 4,
            quants: 16,
        }),
        DType::Q8_0 => Some(BlockLayout {
            block: 34,
            scale: 2,
            quants: 32,
        }),
        _ => None,
    }
}

/// Whether tensors of this type are stored repacked on the GPU.
pub fn is_repacked(dt: DType) -> bool {
    layout(dt).is_some()
}

/// The repacked bytes of a tensor of type `dt`, or `None` for types stored
/// as they are.
pub fn repack_blocks(dt: DType, data: &[u8]) -> Result<Option<Vec<u8>>, String> {
    let Some(l) = layout(dt) else {
        return Ok(None);
    };
    if !data.len().is_multiple_of(l.block) {
        return Err(format!(
            "{} bytes is not a whole number of {}-byte {} blocks",
            data.len(),
            l.block,
            dt.name()
        ));
    }
    let n = data.len() / l.block;
    let mut out = vec![0u8; data.len()];
    let (quants, scales) = out.split_at_mut(n * l.quants);
    for (i, blk) in data.chunks_exact(l.block).enumerate() {
        scales[i * l.scale..(i + 1) * l.scale].copy_from_slice(&blk[..l.scale]);
        quants[i * l.quants..(i + 1) * l.quants].copy_from_slice(&blk[l.scale..]);
    }
    Ok(Some(out))
}

/// Bytes of a Q6_K super-block (256 elements: low nibbles, top bits,
/// sixteen int8 scales, the f16 scale).
const Q6K_BLOCK: usize = 210;

/// The streaming kernel's form of a Q6_K matrix (stream.cu `SD_OUT_Q6`:
/// llama.cpp's quantizer writes the output matrix of a Q4_0 model as
/// Q6_K). `rows` rows of `k` elements become four row-major arrays, so
/// that a tile of rows over a slice of columns is four rectangular copies:
///
/// - the low nibbles, 16 bytes a 32-element block in Q4_0's order (byte
///   `i` holds element `i` in its low half and `i + 16` in its high half);
/// - the top two bits, 8 bytes a block: element `e` (`j = (e % 16) / 4`,
///   `b = e % 4`, `s = e / 16`) at bit `4 (j % 2) + 2 s` of byte
///   `4 (j / 2) + b`, so that a kernel ORs them onto the nibbles of quant
///   word `j` with two shifts and masks;
/// - the int8 scale of each 16 elements, as Q6_K has them;
/// - the scale of each 256 elements, f32 (Q6_K's f16, which a 4-byte word
///   keeps the rows' pitch a multiple of 16 bytes wherever `k` is a
///   multiple of 1024).
///
/// Element `e` of a row is then `d * sc * ((nibble | top << 4) - 32)`, as
/// GGML's Q6_K decoding has it (and exactly: d * sc has 19 significant
/// bits), in `rows * k * 53 / 64` bytes (6.625 bits an element; Q6_K's
/// 210-byte blocks take 6.5625). Converted on `threads` threads.
pub fn q6k_stream_form(
    data: &[u8],
    rows: usize,
    k: usize,
    threads: usize,
) -> Result<Vec<u8>, String> {
    if k == 0 || !k.is_multiple_of(256) {
        return Err(format!(
            "Q6_K rows of {k} elements are not whole 256-element blocks"
        ));
    }
    let blocks = rows * (k / 256);
    if data.len() != blocks * Q6K_BLOCK {
        return Err(format!(
            "{} bytes is not {rows} rows of {k} Q6_K elements ({} bytes)",
            data.len(),
            blocks * Q6K_BLOCK
        ));
    }
    let mut out = vec![0u8; blocks * Q6_FORM_BLOCK];
    let [_, highs_at, scales_at, supers_at] =
        q6_form_arrays((blocks * 256) as u64).map(|a| a as usize);
    let (quants, rest) = out.split_at_mut(highs_at);
    let (highs, rest) = rest.split_at_mut(scales_at - highs_at);
    let (scales, supers) = rest.split_at_mut(supers_at - scales_at);
    // Super-block b (elements 256 b..) owns 128 nibble, 64 top-bit, 16
    // scale and 4 super-scale bytes: split all four by whole super-blocks
    // over the threads.
    let per = blocks.div_ceil(threads.max(1)).max(1);
    std::thread::scope(|sc| {
        let parts = data
            .chunks(per * Q6K_BLOCK)
            .zip(quants.chunks_mut(per * 128))
            .zip(highs.chunks_mut(per * 64))
            .zip(scales.chunks_mut(per * 16))
            .zip(supers.chunks_mut(per * 4));
        for ((((src, q), h), s), d) in parts {
            sc.spawn(move || q6k_blocks(src, q, h, s, d));
        }
    });
    Ok(out)
}

/// Bytes of [`q6k_stream_form`] a super-block.
const Q6_FORM_BLOCK: usize = 128 + 64 + 16 + 4;

/// Where the four arrays of a [`q6k_stream_form`] of `n` elements start
/// (nibbles, top bits, int8 scales, super-block scales), in bytes.
pub fn q6_form_arrays(n: u64) -> [u64; 4] {
    [0, n / 2, n / 2 + n / 4, n / 2 + n / 4 + n / 16]
}

/// [`q6k_stream_form`] of whole super-blocks.
fn q6k_blocks(
    src: &[u8],
    quants: &mut [u8],
    highs: &mut [u8],
    scales: &mut [u8],
    supers: &mut [u8],
) {
    for (b, blk) in src.chunks_exact(Q6K_BLOCK).enumerate() {
        let (ql, rest) = blk.split_at(128);
        let (qh, rest) = rest.split_at(64);
        let (sc, d) = rest.split_at(16);
        let d = half::f16::from_bits(u16::from_le_bytes([d[0], d[1]])).to_f32();
        let (q, h) = (&mut quants[128 * b..][..128], &mut highs[64 * b..][..64]);
        // GGML's order: element 128 g + 32 t + l (g < 2, t < 4, l < 32)
        // has its nibble in ql[64 g + 32 (t % 2) + l] (the high half for
        // t >= 2) and its top bits at bit 2 t of qh[32 g + l].
        for i in 0..256 {
            let (g, t, l) = (i / 128, (i / 32) % 4, i % 32);
            let nib = (ql[64 * g + 32 * (t % 2) + l] >> (4 * (t / 2))) & 15;
            let top = (qh[32 * g + l] >> (2 * t)) & 3;
            let (blk32, e) = (i / 32, i % 32);
            q[16 * blk32 + e % 16] |= nib << (4 * (e / 16));
            let j = (e % 16) / 4;
            h[8 * blk32 + 4 * (j / 2) + e % 4] |= top << (4 * (j % 2) + 2 * (e / 16));
        }
        scales[16 * b..][..16].copy_from_slice(sc);
        supers[4 * b..][..4].copy_from_slice(&d.to_le_bytes());
    }
}

/// Checks that every repacked buffer `cmd` binds is read by a kernel that
/// understands the layout, bound whole, with the row count the kernel will
/// assume; and that no kernel reads GGML-layout blocks of a repacked type.
/// `buffer(id)` gives a buffer's length and whether it is repacked.
pub fn check_bindings(
    cmd: &DispatchCmd,
    buffer: &dyn Fn(BufferId) -> Result<(u64, bool), BackendError>,
) -> Result<(), String> {
    let b = cmd.bindings();
    // (binding slot, dtype id, rows, row length) of each quantized operand.
    let mut operands: Vec<(usize, u32, u64, u32)> = Vec::new();
    match cmd.kernel {
        KernelId::Gemv => {
            let p: GemvParams = cmd.params();
            for s in 0..(p.n_seg as usize).min(3) {
                operands.push((2 + s, p.dtype[s], p.n[s] as u64, p.k));
            }
        }
        KernelId::Embedding => {
            let p: EmbedParams = cmd.params();
            operands.push((1, p.dtype, p.n_vocab as u64, p.dim));
        }
        _ => {}
    }
    for (slot, binding) in b.iter().enumerate() {
        let (len, repacked) = buffer(binding.buffer).map_err(|e| e.to_string())?;
        let operand = operands.iter().find(|o| o.0 == slot);
        let dt = operand.and_then(|o| DType::from_ggml(o.1));
        let wants = dt.is_some_and(is_repacked);
        if repacked != wants {
            return Err(if repacked {
                format!(
                    "binding {slot} holds repacked quantized weights, which this kernel does not read"
                )
            } else {
                format!(
                    "binding {slot} holds {} blocks in GGML's layout; the CUDA kernels read them only as uploaded weights (repacked)",
                    dt.map(|d| d.name()).unwrap_or("quantized")
                )
            });
        }
        if let (true, Some(&(_, _, rows, k)), Some(dt)) = (repacked, operand, dt) {
            let whole = dt.bytes_for(rows * k as u64);
            if binding.offset != 0 || whole != Some(len) {
                return Err(format!(
                    "binding {slot}: a repacked {} tensor must be bound whole ({rows} rows of {k}, {len} bytes, offset {})",
                    dt.name(),
                    binding.offset
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Element `e` of row `r` (rows of `k`), read the way the GPU reads the
    /// repacked layout (model.cu `load_elem`), as raw (scale bytes, quant
    /// byte) so the test needs no float decoding.
    fn repacked_parts(
        dt: DType,
        data: &[u8],
        n_rows: usize,
        k: usize,
        r: usize,
        e: usize,
    ) -> (Vec<u8>, u8) {
        let l = layout(dt).unwrap();
        let nb = k / 32;
        let blk = r * nb + e / 32;
        let j = e % 32;
        let qi = if l.quants == 16 { j % 16 } else { j };
        let sc_base = n_rows * nb * l.quants;
        (
            data[sc_base + blk * l.scale..sc_base + (blk + 1) * l.scale].to_vec(),
            data[blk * l.quants + qi],
        )
    }

    #[test]
    fn repacked_blocks_keep_every_scale_and_quant() {
        let mut seed = 0x9e3779b97f4a7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 24) as u8
        };
        for dt in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
            let l = layout(dt).unwrap();
            let (rows, k) = (3, 96);
            let data: Vec<u8> = (0..rows * (k / 32) * l.block).map(|_| next()).collect();
            let packed = repack_blocks(dt, &data).unwrap().unwrap();
            assert_eq!(packed.len(), data.len());
            for r in 0..rows {
                for e in 0..k {
                    let blk = &data[(r * (k / 32) + e / 32) * l.block..][..l.block];
                    let j = e % 32;
                    let qi = if l.quants == 16 { j % 16 } else { j };
                    let (sc, q) = repacked_parts(dt, &packed, rows, k, r, e);
                    assert_eq!(sc, &blk[..l.scale], "{dt:?} row {r} elem {e} scale");
                    assert_eq!(q, blk[l.scale + qi], "{dt:?} row {r} elem {e} quant");
                }
            }
        }
    }

    /// Element `e` of row `r` of a [`q6k_stream_form`], decoded as
    /// stream.cu's `sd_emb` reads it.
    fn q6_form_elem(form: &[u8], rows: usize, k: usize, r: usize, e: usize) -> f32 {
        let (at, n) = (r * k + e, rows * k);
        let (x, w) = (at / 32, e % 32);
        let nib = (form[16 * x + w % 16] >> (4 * (w / 16))) & 15;
        let j = (w % 16) / 4;
        let hb = form[n / 2 + 8 * x + 4 * (j / 2) + w % 4];
        let top = (hb >> (4 * (j % 2) + 2 * (w / 16))) & 3;
        let sc = form[n * 3 / 4 + at / 16] as i8;
        let d0 = n * 13 / 16 + 4 * (at / 256);
        let d = f32::from_le_bytes(form[d0..d0 + 4].try_into().unwrap());
        d * sc as f32 * ((nib | top << 4) as i32 - 32) as f32
    }

    #[test]
    fn q6k_stream_form_decodes_to_the_cpu_values() {
        // Random Q6_K blocks (every bit pattern of quants and scales), but
        // a finite f16 scale: rows of 512, over 1 and 3 threads.
        let (rows, k) = (5, 512);
        let mut seed = 0x2545f4914f6cdd1du64;
        let mut data: Vec<u8> = (0..rows * (k / 256) * Q6K_BLOCK)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed >> 32) as u8
            })
            .collect();
        for blk in data.chunks_exact_mut(Q6K_BLOCK) {
            blk[208..].copy_from_slice(&half::f16::from_f32(0.0123).to_bits().to_le_bytes());
        }
        for threads in [1, 3] {
            let form = q6k_stream_form(&data, rows, k, threads).unwrap();
            assert_eq!(form.len(), rows * k * 53 / 64);
            for r in 0..rows {
                let mut want = vec![0f32; k];
                let row = &data[r * (k / 256) * Q6K_BLOCK..][..(k / 256) * Q6K_BLOCK];
                akunu_cpu::quant::dequant_row(DType::Q6_K, row, k, &mut want);
                for (e, &w) in want.iter().enumerate() {
                    let got = q6_form_elem(&form, rows, k, r, e);
                    assert_eq!(got.to_bits(), w.to_bits(), "row {r} elem {e}: {got} vs {w}");
                }
            }
        }
        let e = q6k_stream_form(&data[..400], rows, k, 1).unwrap_err();
        assert!(e.contains("5 rows of 512 Q6_K elements"), "{e}");
        let e = q6k_stream_form(&data, rows, 576, 1).unwrap_err();
        assert!(e.contains("whole 256-element blocks"), "{e}");
    }

    #[test]
    fn plain_types_are_not_repacked_and_partial_blocks_are_errors() {
        assert_eq!(repack_blocks(DType::F16, &[1, 2, 3, 4]).unwrap(), None);
        let e = repack_blocks(DType::Q4_0, &[0u8; 19]).unwrap_err();
        assert!(e.contains("18-byte Q4_0 blocks"), "{e}");
    }
}
