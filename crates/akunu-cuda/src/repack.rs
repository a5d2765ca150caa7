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

    #[test]
    fn plain_types_are_not_repacked_and_partial_blocks_are_errors() {
        assert_eq!(repack_blocks(DType::F16, &[1, 2, 3, 4]).unwrap(), None);
        let e = repack_blocks(DType::Q4_0, &[0u8; 19]).unwrap_err();
        assert!(e.contains("18-byte Q4_0 blocks"), "{e}");
    }
}
