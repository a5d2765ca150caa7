#!/usr/bin/env python3
"""Mix the tensor types of two GGUF files of the same model, as llama.cpp's
"_M" files do (e.g. Q4_K_M: most matrices Q4_K, `attn_v` and `ffn_down` Q6_K).

  python3 tools/mix_types.py BASE.gguf OTHER.gguf OUT.gguf --take attn_v.weight,ffn_down.weight

OUT is BASE with every tensor whose name ends with one of the --take suffixes
copied (raw bytes, its own type) from OTHER, which must hold the same tensor
names and shapes (e.g. two `akunu synth` files of one shape and seed: the
random values are drawn before quantization, so they agree). Metadata comes
from BASE. Used by scripts/test.sh to check fused commands whose segments
have different types (a Q4_K/Q4_K/Q6_K QKV product) against the reference.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import gguf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from derive import _SKIP_KEYS, _copy_field  # noqa: E402


def mix(base: str, other: str, out: str, take: list[str]) -> int:
    rb, ro = gguf.GGUFReader(base), gguf.GGUFReader(other)
    others = {t.name: t for t in ro.tensors}
    w = gguf.GGUFWriter(out + ".tmp", rb.fields["general.architecture"].contents())
    for name, field in rb.fields.items():
        if name not in _SKIP_KEYS:
            _copy_field(w, field)
    plan, n_taken = [], 0
    for t in rb.tensors:
        src = t
        if any(t.name.endswith(s) for s in take):
            src = others[t.name]
            if list(src.shape) != list(t.shape):
                raise ValueError(f"{t.name}: shapes differ ({list(src.shape)} vs {list(t.shape)})")
            n_taken += 1
        shape = [int(x) for x in reversed(src.shape)]  # numpy order
        data = np.asarray(src.data).copy()
        if src.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor_info(t.name, shape, data.dtype, data.nbytes)
        else:
            byte_shape = list(gguf.quant_shape_to_byte_shape(shape, src.tensor_type))
            w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), data.nbytes, raw_dtype=src.tensor_type)
        plan.append(data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for data in plan:
        w.write_tensor_data(data)
    w.close()
    os.replace(out + ".tmp", out)
    return n_taken


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base")
    ap.add_argument("other")
    ap.add_argument("out")
    ap.add_argument("--take", required=True, help="comma-separated tensor name suffixes to take from OTHER")
    a = ap.parse_args()
    n = mix(a.base, a.other, a.out, [s for s in a.take.split(",") if s])
    if n == 0:
        print("error: no tensor matched --take", file=sys.stderr)
        return 1
    print(f"wrote {a.out}: {n} tensors from {a.other}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
