#!/usr/bin/env python3
"""Derive a re-typed copy of a GGUF model.

  python3 tools/derive.py IN.gguf OUT.gguf --type f16|q8_0|q4_0|f32

Every 2-D (or higher) weight matrix, token_embd included, is dequantized with
`gguf.quants.dequantize` and re-encoded with `gguf.quants.quantize` (a plain
cast for f16/f32).  1-D tensors (norms, biases) are written as F32.  All
metadata key/values are copied unchanged except `general.file_type`, which is
set to match the new type.  Tensors are converted and written one at a time,
so peak memory is about one tensor's worth of f32 data.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from gguf.quants import dequantize, quantize

TARGETS = {
    "f32": (QT.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (QT.F16, gguf.LlamaFileType.MOSTLY_F16),
    "q8_0": (QT.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (QT.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
}

# keys the writer produces itself
_SKIP_KEYS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture", "general.alignment"}


def _copy_field(w: gguf.GGUFWriter, field) -> None:
    """Copy one metadata key/value with its exact GGUF value type."""
    vtype = field.types[0]
    if vtype == VT.ARRAY:
        sub = field.types[-1]
        if len(field.types) > 2:
            raise NotImplementedError(f"nested array in {field.name}")
        if sub == VT.STRING:
            # keep raw bytes so that non-UTF-8 data survives untouched
            val = [bytes(field.parts[i]) for i in field.data]
        else:
            val = field.contents()
        w.add_key_value(field.name, val, VT.ARRAY, sub_type=sub)
    elif vtype == VT.STRING:
        w.add_key_value(field.name, bytes(field.parts[-1]), VT.STRING)
    else:
        w.add_key_value(field.name, field.contents(), vtype)


def _target_type(t, qtype: QT) -> QT:
    """Type of the output tensor: F32 for 1-D, otherwise qtype if the rows fit its blocks (else F16)."""
    if len(t.shape) < 2:
        return QT.F32
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if int(t.shape[0]) % block != 0:
        print(f"warning: {t.name} row size {int(t.shape[0])} not a multiple of {block}; using F16", file=sys.stderr)
        return QT.F16
    return qtype


def _convert(t, out_type: QT) -> np.ndarray:
    """Return the tensor's data in out_type (float arrays or uint8 byte rows)."""
    if t.tensor_type == out_type:
        return np.asarray(t.data).copy()  # already in the target type: bit-exact copy
    shape = tuple(int(x) for x in reversed(t.shape))  # numpy order
    f = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32, copy=False)
    return quantize(f, out_type)


def derive(src: str, dst: str, type_name: str, verbose: bool = True) -> None:
    qtype, ftype = TARGETS[type_name]
    t0 = time.time()
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    tmp = dst + ".tmp"
    w = gguf.GGUFWriter(tmp, arch)
    for name, field in r.fields.items():
        if name in _SKIP_KEYS:
            continue
        if name == "general.file_type":
            w.add_key_value(name, int(ftype), field.types[0])
            continue
        _copy_field(w, field)
    if "general.file_type" not in r.fields:
        w.add_file_type(int(ftype))

    # declare all tensors first (sizes are known up front), then stream the data
    plan = []
    for t in r.tensors:
        ot = _target_type(t, qtype)
        shape = [int(x) for x in reversed(t.shape)]  # numpy order
        block, tsize = gguf.GGML_QUANT_SIZES[ot]
        nbytes = int(np.prod(shape)) // block * tsize
        if ot in (QT.F32, QT.F16):
            w.add_tensor_info(t.name, shape, np.dtype(np.float32 if ot == QT.F32 else np.float16), nbytes)
        else:
            byte_shape = list(gguf.quant_shape_to_byte_shape(shape, ot))
            w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=ot)
        plan.append((t, ot, nbytes))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t, ot, nbytes in plan:
        data = _convert(t, ot)
        assert data.nbytes == nbytes, (t.name, data.nbytes, nbytes)
        w.write_tensor_data(data)
    w.close()
    os.replace(tmp, dst)
    if verbose:
        print(f"derived {dst} ({type_name}, {len(plan)} tensors, {os.path.getsize(dst) / 2**20:.1f} MiB) "
              f"in {time.time() - t0:.1f}s", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input")
    ap.add_argument("output")
    ap.add_argument("--type", required=True, choices=sorted(TARGETS))
    a = ap.parse_args()
    if os.path.abspath(a.input) == os.path.abspath(a.output):
        ap.error("output must differ from input")
    derive(a.input, a.output, a.type)
    return 0


if __name__ == "__main__":
    sys.exit(main())
