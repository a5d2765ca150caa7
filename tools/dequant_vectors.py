#!/usr/bin/env python3
"""Test vectors for akunu's dequantizers, produced by the `gguf` package.

  python3 tools/dequant_vectors.py OUT_DIR [--seed N]

For each of Q5_0, Q5_1, Q4_K, Q5_K and Q6_K writes
  OUT_DIR/<TYPE>.blocks   random blocks (raw GGML bytes): random quants,
                          scales and mins; the f16 fields (d, m, dmin) are
                          finite values of mixed magnitudes (normal, tiny,
                          subnormal, zero, either sign)
  OUT_DIR/<TYPE>.f32      gguf.quants.dequantize of those blocks,
                          little-endian float32
The Rust test `gguf_dequant_vectors` (crates/akunu-cpu/src/quant/mod.rs)
requires akunu's dequantizers to reproduce the floats bit for bit at every
SIMD level, and its GEMV to match their f32 dot products. The copy in
crates/akunu-cpu/tests/data/gguf_dequant/ was written with seed 0 and
gguf==0.19.0; scripts/test.sh writes a fresh set with another seed and
points the test at it (AKUNU_DEQUANT_VECTORS).
"""
from __future__ import annotations

import argparse
import os

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

# name -> (type, elements per block, bytes per block, offsets of f16 fields, blocks written)
TYPES = {
    "Q5_0": (Q.Q5_0, 32, 22, [0], 128),
    "Q5_1": (Q.Q5_1, 32, 24, [0, 2], 128),
    "Q4_K": (Q.Q4_K, 256, 144, [0, 2], 16),
    "Q5_K": (Q.Q5_K, 256, 176, [0, 2], 16),
    "Q6_K": (Q.Q6_K, 256, 210, [208], 16),
}


def random_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite f16 values: mostly O(1), some tiny (subnormal range) or zero."""
    kind = rng.integers(0, 8, n)
    v = rng.normal(0.0, 1.0, n)
    v = np.where(kind == 0, v * 1e-6, v)  # f16 subnormals
    v = np.where(kind == 1, v * 3e-3, v)
    v = np.where(kind == 2, 0.0, v)
    v = np.where(kind == 3, -0.0, v)
    return v.astype(np.float16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    for name, (qtype, elems, nbytes, f16_offsets, n_blocks) in TYPES.items():
        raw = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
        for off in f16_offsets:
            raw[:, off : off + 2] = random_f16(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
        out = np.asarray(dequantize(raw.reshape(-1), qtype), dtype=np.float32).reshape(-1)
        assert out.size == n_blocks * elems and np.all(np.isfinite(out)), name
        raw.tofile(os.path.join(a.out_dir, f"{name}.blocks"))
        out.astype("<f4").tofile(os.path.join(a.out_dir, f"{name}.f32"))
        print(f"{name}: {n_blocks} blocks -> {out.size} floats")


if __name__ == "__main__":
    main()
