#!/usr/bin/env bash
# Runs every test akunu has on this machine (no GPU needed):
#  1. the Rust unit and integration tests (optimized build: numeric kernels),
#     including the compilation of every CUDA kernel with NVRTC (from the
#     nvidia-cuda-nvrtc wheel: a compiler needs no GPU);
#  2. the dequantizers of the 5-bit and K-quant types against a fresh set
#     of the gguf package's dequantization vectors (tools/dequant_vectors.py);
#  3. the reference parity check: the default model (fetched on first use),
#     F16/Q8_0 files derived from it, and random-weight Q5_0/Q5_1/Q4_K/Q5_K/
#     Q6_K models (and a Q4_K/Q6_K mix), against an independent NumPy forward pass over
#     gguf-dequantized weights (tools/reference.py);
#  4. `akunu serve` and `akunu chat` end to end on the default model, driven by
#     the official openai Python package and raw HTTP (tools/test_server.py);
#  5. the same reference on tiny random-weight models of every architecture
#     (llama, llama with Llama 3.1-style RoPE divisors, qwen2, qwen3,
#     gemma3) in F32/F16/Q8_0 (tools/arch_parity.py).
# The GPU tests themselves run on a GPU machine: scripts/gpu.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== Python tools (NumPy reference, NVRTC)"
venv=target/tools-venv
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r tools/requirements.txt
nvrtc_dir=$(cd "$(ls -d "$venv"/lib/python3*/site-packages/nvidia/cu13/lib | head -1)" && pwd)
export LD_LIBRARY_PATH="$nvrtc_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export AKUNU_REQUIRE_NVRTC=1

echo "== cargo test (release profile)"
cargo test --release --workspace

echo "== reference parity (NumPy) on the default model"
cargo build --release -p akunu
model=$(./target/release/akunu fetch)
"$venv/bin/python" tools/parity.py --akunu target/release/akunu --model "$model" --workdir target/parity

echo "== dequantization vs the gguf package, fresh random blocks (seed 1)"
"$venv/bin/python" tools/dequant_vectors.py target/dequant-vectors --seed 1
AKUNU_DEQUANT_VECTORS="$(pwd)/target/dequant-vectors" \
    cargo test --release -p akunu-cpu --lib quant::tests::gguf_dequant_vectors

echo "== reference parity (NumPy) on random-weight models of the 5-bit and K-quant types"
mkdir -p target/parity-types
for spec in tiny:q5_0 tiny:q5_1 tiny-k:q4_k tiny-k:q5_k tiny-k:q6_k; do
    shape=${spec%%:*} type=${spec##*:}
    file=target/parity-types/$shape-$type.gguf
    ./target/release/akunu synth --shape "$shape" --type "$type" --seed 5 "$file"
    "$venv/bin/python" tools/parity.py --akunu target/release/akunu --model "$file" \
        --types "" -n 8 --workdir target/parity-types
done
# A Q4_K_M-like mix (attn_v and ffn_down Q6_K, the rest Q4_K): fused QKV
# products whose segments differ in type.
"$venv/bin/python" tools/mix_types.py target/parity-types/tiny-k-q4_k.gguf \
    target/parity-types/tiny-k-q6_k.gguf target/parity-types/tiny-k-q4_k_m.gguf \
    --take attn_v.weight,ffn_down.weight
"$venv/bin/python" tools/parity.py --akunu target/release/akunu \
    --model target/parity-types/tiny-k-q4_k_m.gguf --types "" -n 8 --workdir target/parity-types

echo "== server and chat end to end (openai client, raw HTTP)"
"$venv/bin/python" tools/test_server.py --akunu target/release/akunu --model "$model"

echo "== architecture parity (NumPy) on tiny random-weight models"
"$venv/bin/python" tools/arch_parity.py --akunu target/release/akunu --workdir target/arch-parity
