#!/usr/bin/env bash
# Runs every test akunu has on this machine (no GPU needed):
#  1. the Rust unit and integration tests (optimized build: numeric kernels),
#     including the compilation of every CUDA kernel with NVRTC (from the
#     nvidia-cuda-nvrtc wheel: a compiler needs no GPU);
#  2. the reference parity check: the default model (fetched on first use)
#     and F16/Q8_0 files derived from it, against an independent NumPy
#     forward pass over gguf-dequantized weights (tools/reference.py);
#  3. the same reference on tiny random-weight models of every architecture
#     (llama, qwen2, qwen3, gemma3) in F32/F16/Q8_0 (tools/arch_parity.py).
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

echo "== architecture parity (NumPy) on tiny random-weight models"
"$venv/bin/python" tools/arch_parity.py --akunu target/release/akunu --workdir target/arch-parity
