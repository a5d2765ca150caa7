#!/usr/bin/env python3
"""Write a vocabulary-only GGUF (tokenizer.* metadata, no tensors) from a model.

Like llama.cpp's models/ggml-vocab-*.gguf: small enough to keep in the
repository so the tokenizer tests need no model download.

    python3 tools/vocab_only.py MODEL.gguf OUT.gguf
"""
import sys

import gguf


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, dst = sys.argv[1], sys.argv[2]
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if not (name.startswith("tokenizer.") or name == "general.name"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
