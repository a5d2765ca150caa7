#!/usr/bin/env bash
# GPU tests and benchmarks for the CUDA backend, in two halves:
#
#   scripts/gpu.sh build          (here, where Rust is) builds the release
#                                 binary and the GPU test binary with the
#                                 cuda feature and packs them into .gpu/
#                                 (git-ignored) for the device tool to carry.
#   scripts/gpu.sh build-base REV (here) packs the akunu binary of an
#                                 earlier commit into .gpu-base/ (ignored)
#                                 for base-ab.
#   scripts/gpu.sh split-model    (here) splits the default model into
#                                 .gpu-part{1,2,3}/: one call carries at most
#                                 64 MiB with the working tree, the model is
#                                 94 MiB, so three calls carry a third each
#                                 (the GPU machine keeps files while warm).
#   scripts/gpu.sh run WHAT...    (on the GPU machine, from the repository
#                                 root, with .gpu carried) runs, in order,
#                                 each WHAT of: tests, engine-tests (once,
#                                 no reruns), sampled, sampled-ab (SMB_AB),
#                                 persist, persist-model (needs the model),
#                                 model-sampled (needs the model),
#                                 persist-blocks, persist-timing,
#                                 persist-clock, pd-ab (PERSIST_AB),
#                                 base-ab (with .gpu-base), base-pp
#                                 (prefill against .gpu-base),
#                                 sanitize, sanitize-sampled,
#                                 sanitize-persist, bench, bench-ab,
#                                 peer-torch (PEER_SHAPES, PEER_MODES),
#                                 ab (AB_VAR, AB_VALUES, AB_ROUNDS), tcg-ab,
#                                 profile, profile-big, trace, features,
#                                 ncu-token, ncu-persist (the SmolLM2
#                                 kernel's stalls by SASS line; NCU_PD_MODE
#                                 sampled or greedy), ncu-stream (the
#                                 streaming kernel's; NCU_STREAM_SHAPES),
#                                 icache (the
#                                 instruction-cache probe, nvcc),
#                                 code-addr (whether a device function's
#                                 address can be read or prefetched as
#                                 data, nvcc),
#                                 model-part1, model-part2, model-part3,
#                                 model, sampler (needs the model), attn,
#                                 prefill, spec-ab (needs the model), pfattn,
#                                 probe (the gemv kernels alone, nvcc),
#                                 mega (a persistent decode kernel, nvcc),
#                                 stream (a streaming persistent kernel of
#                                 the large F16 shapes, nvcc; STREAM_RUNS),
#                                 stream-ab (akunu's streaming kernel
#                                 against its graph; STREAM_AB_SHAPES),
#                                 env-ab (bench over sets of environment
#                                 variables; ENV_SETS, ENV_MODES "greedy sampled"), stream-clock (the
#                                 streaming kernel's waits, SD_DIAG=4;
#                                 STREAM_CLOCK_SETS), stream-blocks (every
#                                 block's section ends in one layer,
#                                 SD_DIAG=64).
#                                 Logs go to $OUT (or ./gpu-out),
#                                 a summary to stdout. BENCH_SHAPES lists
#                                 SHAPE:TYPE[:rope-freqs][:llama3-vocab][:q6k-logits]
#                                 (each_shape); ENGINE_FILTER and
#                                 ENGINE_NOCAPTURE=1 narrow engine-tests.
#
# The binaries need no CUDA at build time (cudarc loads the driver, NVRTC
# and cuBLAS at run time); on the GPU machine the toolkit's lib64 is put on
# LD_LIBRARY_PATH so that NVRTC is found, and the directory of
# libcublas.so.13 (the toolkit's, else PyTorch's pip nvidia/cu13/lib) so that
# prefill runs on cuBLAS. AKUNU_CUDA_CUBLAS=0 turns cuBLAS off (A/B runs).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PACK=.gpu

build() {
    cargo build --release -p akunu
    local tmp
    tmp=$(mktemp -d)
    cp target/release/akunu "$tmp/akunu"
    # The GPU test binaries: tests/gpu.rs and tests/gpu_sampling_kernels.rs.
    cargo test --release -p akunu-cuda --tests --no-run --message-format=json 2>/dev/null |
        python3 -c 'import sys, json, shutil
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"].startswith("gpu"):
        shutil.copy(m["executable"], sys.argv[1] + "/" + m["target"]["name"].replace("_", "-") + "-tests")' "$tmp"
    mkdir -p "$PACK"
    strip "$tmp"/* 2>/dev/null || true
    tar -C "$tmp" -cJf "$PACK/bin.tar.xz" .
    rm -rf "$tmp"
    { git rev-parse --short HEAD; git status --porcelain | grep -q . && echo "(+ uncommitted changes)"; } \
        >"$PACK/commit" || true
    ls -la "$PACK"
}

# The akunu binary of an earlier commit REV (default HEAD) into .gpu-base,
# for `base-ab`: built in a worktree under target/, with its own target dir.
build_base() { # REV
    local rev=${1:-HEAD} wt=$ROOT/target/base-worktree
    rm -rf "$wt"
    git worktree prune
    git worktree add -f --detach "$wt" "$rev" >/dev/null
    (cd "$wt" && CARGO_TARGET_DIR=$ROOT/target/base-build cargo build --release -p akunu)
    mkdir -p .gpu-base
    cp target/base-build/release/akunu .gpu-base/akunu
    strip .gpu-base/akunu 2>/dev/null || true
    git rev-parse --short "$rev" >.gpu-base/commit
    git worktree remove --force "$wt"
    ls -la .gpu-base
}

split_model() {
    local m size part i
    m=$(target/release/akunu fetch)
    size=$(stat -c %s "$m")
    part=$(((size + 2) / 3))
    for i in 1 2 3; do
        mkdir -p .gpu-part$i
        dd if="$m" of=.gpu-part$i/model.part$i bs=1M iflag=skip_bytes,count_bytes \
            skip=$(((i - 1) * part)) count="$part" status=none
        sha256sum "$m" | cut -d' ' -f1 >.gpu-part$i/model.sha256
    done
    ls -la .gpu-part1 .gpu-part2 .gpu-part3
}

# ---- on the GPU machine ----

OUTDIR=${OUT:-$ROOT/gpu-out}
STORE=/root/akunu-gpu # survives between calls while the machine stays warm
BIN=$STORE/bin
MODEL=$STORE/SmolLM2-135M-Instruct.Q4_1.gguf

setup() {
    mkdir -p "$OUTDIR" "$BIN"
    if [ -f "$PACK/bin.tar.xz" ]; then
        tar -C "$BIN" -xJf "$PACK/bin.tar.xz"
        cp "$PACK/commit" "$BIN/commit" 2>/dev/null || true
    fi
    local nvrtc
    nvrtc=$(ls /usr/local/cuda/lib64/libnvrtc.so* /usr/local/cuda*/lib64/libnvrtc.so* 2>/dev/null | head -1 || true)
    if [ -n "$nvrtc" ]; then
        export LD_LIBRARY_PATH="$(dirname "$nvrtc")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
    local cublas
    cublas=$(ls /usr/local/cuda/lib64/libcublas.so.13 /usr/local/cuda*/lib64/libcublas.so.13 2>/dev/null | head -1 || true)
    if [ -z "$cublas" ]; then
        cublas=$(python3 -c 'import nvidia, os
for p in nvidia.__path__:
    f = os.path.join(p, "cu13", "lib", "libcublas.so.13")
    if os.path.exists(f):
        print(f)
        break' 2>/dev/null || true)
    fi
    if [ -n "$cublas" ]; then
        export LD_LIBRARY_PATH="$(dirname "$cublas"):$LD_LIBRARY_PATH"
        echo "cuBLAS: $cublas" | tee -a "$OUTDIR/gpu.txt"
    else
        echo "cuBLAS: libcublas.so.13 not found (prefill uses k_gemm_tc)" | tee -a "$OUTDIR/gpu.txt"
    fi
    export AKUNU_REPO=$ROOT AKUNU_CACHE=$STORE/cache
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader |
        tee "$OUTDIR/gpu.txt"
    echo "binaries from commit $(cat "$BIN/commit" 2>/dev/null | tr '\n' ' ')" | tee -a "$OUTDIR/gpu.txt"
}

# Writes the synthetic model FILE of SHAPE and TYPE (SmolLM2's tokenizer)
# unless it is already there; extra arguments go to `akunu synth`.
# SYNTH_TOKENIZER names another tokenizer file.
synth_file() { # SHAPE TYPE FILE [synth args]
    [ -f "$3" ] || "$BIN/akunu" synth --shape "$1" --type "$2" "${@:4}" --tokenizer-from \
        "${SYNTH_TOKENIZER:-crates/akunu-core/tests/data/tokenizer/ggml-vocab-smollm2.gguf}" "$3" 2>&1 | tail -1
}

# The synthetic SmolLM2 file the persistent decode steps bench, created on
# first use; its path on stdout. SMOL_EMB=q8_0: the default model's type mix
# (Q4_1 matrices, a Q8_0 embedding) instead of Q4_1 throughout.
smol_file() {
    local f=$STORE/smollm2-135m-q4_1${SMOL_EMB:+-emb-$SMOL_EMB}.gguf
    [ -f "$f" ] || "$BIN/akunu" synth --shape smollm2-135m --type q4_1 ${SMOL_EMB:+--embedding-type "$SMOL_EMB"} \
        --tokenizer-from crates/akunu-core/tests/data/tokenizer/ggml-vocab-smollm2.gguf "$f" 2>&1 | tail -1 >&2
    echo "$f"
}

tests() {
    echo "== GPU tests"
    # The second engine run lifts the launcher's preference for the register
    # gemv on big 4-bit products, so that the tests' tiny-k Q4_0/Q4_1 logits
    # products run on the bulk-copy form.
    { "$BIN/gpu-tests" --ignored --test-threads=1 --nocapture 2>&1
      echo "== AKUNU_CUDA_TCB=all: logits and verification on the 4-bit bulk-copy gemv"
      AKUNU_CUDA_TCB=all "$BIN/gpu-tests" --ignored --test-threads=1 --nocapture \
          logits_match_cpu_for_every_type speculative_verification_is_exact 2>&1
      echo "== AKUNU_CUDA_PF_ATTN_TC=0: prefill attention on the CUDA-core flash kernel"
      AKUNU_CUDA_PF_ATTN_TC=0 "$BIN/gpu-tests" --ignored --test-threads=1 --nocapture \
          prefill_attention_matches_cpu_on_every_head_width logits_match_cpu_for_every_architecture 2>&1
      echo "== AKUNU_CUDA_CUBLAS_CHUNK_MB=1: prefill with many dequantized chunks, slots reused"
      AKUNU_CUDA_CUBLAS_CHUNK_MB=1 "$BIN/gpu-tests" --ignored --test-threads=1 --nocapture \
          cublas_prefill_matches_cpu_with_and_without_cublas 2>&1
      echo "== AKUNU_CUDA_TCB=all: real shapes on the 4-bit bulk-copy gemv (raw staging of llama-1b's down product)"
      AKUNU_CUDA_TCB=all "$BIN/gpu-tests" --ignored --test-threads=1 --nocapture logits_match_cpu_on_real_shapes 2>&1
      "$BIN/gpu-sampling-kernels-tests" --ignored --test-threads=1 2>&1; } | tee "$OUTDIR/tests.log" |
        grep -E "^test |^== |rel-L2|near-tie|delivery|stop at|result|panicked|compiling" || true
}

# The engine and sampling-kernel tests once, without the reruns under
# developer switches (a short check between full `tests` runs).
# ENGINE_FILTER (test-name substrings, separated by spaces) runs a subset of
# the engine tests, e.g. "sampl" for those of the sampler; the sampling-kernel
# tests always run.
# ENGINE_NOCAPTURE=1 shows what passing tests print (their figures).
engine_tests() {
    echo "== GPU tests (engine${ENGINE_FILTER:+ matching $ENGINE_FILTER} and sampling kernels, once)"
    # shellcheck disable=SC2086 # ENGINE_FILTER is a list of filters
    { "$BIN/gpu-tests" --ignored --test-threads=1 ${ENGINE_NOCAPTURE:+--nocapture} ${ENGINE_FILTER:-} 2>&1
      "$BIN/gpu-sampling-kernels-tests" --ignored --test-threads=1 2>&1; } | tee "$OUTDIR/engine-tests.log" |
        grep -E "^test |test result|panicked|rel-L2|tokens equal" || true
}

# Greedy against sampled decode (the default model's sampling settings) on
# the synthetic SmolLM2 shape, for when the default model is not at hand.
sampled() {
    echo "== greedy and sampled decode (synthetic smollm2-135m q4_1)"
    sampled_runs _
}

# The persistent greedy decode (persist.rs): its GPU test under each define
# set of PERSIST_TEST_SETS (default: those of PERSIST_AB), then greedy
# decode with it off and on (AKUNU_CUDA_PERSIST), two rounds, on the
# synthetic SmolLM2 file (Q4_1 throughout), from each position of
# PERSIST_DEPTHS (default "0 256": prompts of that many tokens), and block
# 0's phase cycles (-DPD_TIMING). PERSIST_AB: define sets for the kernel
# (as SMB_AB: sets by spaces, defines by commas, `_` for none). Defines
# named PD_* reach the persistent module only (compile.rs), so the graph
# runs ("persist=0") use the same main module under every set. PERSIST_KV:
# the KV cache types to bench (default "f16"; AKUNU_KV_TYPE). Each run
# has a time limit, so that a kernel variant that hangs costs one run.
# PERSIST_TEST_SETS=none skips the test.
persist() {
    echo "== persistent greedy decode: test, then tg128 off / on"
    local f=$STORE/smollm2-135m-q4_1.gguf r v p d k
    for d in ${PERSIST_TEST_SETS:-${PERSIST_AB:-_}}; do
        [ "$d" = none ] && continue
        d=$(smb_defines "$d")
        AKUNU_CUDA_DEFINES="$d" timeout 300 "$BIN/gpu-tests" --ignored --test-threads=1 --nocapture \
            persistent_chain 2>&1 | tee -a "$OUTDIR/persist-test.log" |
            grep -E "^test |test result|panicked|tokens equal|near-tie|cancelled|keeps the graph|speculative|past position" |
            sed "s/^/${d:-_} /" || echo "${d:-_} persistent test: timed out or failed (rc $?)"
    done
    synth_file smollm2-135m q4_1 "$f"
    for d in ${PERSIST_AB:-_}; do
        d=$(smb_defines "$d")
        for p in ${PERSIST_DEPTHS:-0 256}; do
            for r in 1 2; do
                for k in ${PERSIST_KV:-f16}; do
                    for v in 0 1; do
                        AKUNU_KV_TYPE=$k AKUNU_CUDA_DEFINES="$d" AKUNU_CUDA_PERSIST=$v timeout 120 "$BIN/akunu" \
                            bench -m "$f" --device cuda -p "$p" -n 128 -r 5 --no-bandwidth 2>&1 |
                            grep -E "tg[0-9]|error|keeps the graph" |
                            sed "s/^/persist=$v kv=$k p=$p ${d:-_} /" | sed 's/| akunu synthetic.*prefill//' || true
                    done
                done
            done
        done
        # Block 0's cycles per phase kind, one chain.
        for k in ${PERSIST_KV:-f16}; do
            AKUNU_KV_TYPE=$k AKUNU_CUDA_PERSIST=1 AKUNU_CUDA_DEFINES="$d -DPD_TIMING" timeout 120 "$BIN/akunu" \
                bench -m "$f" --device cuda -p 0 -n 128 -r 1 --no-bandwidth 2>&1 | grep -E "persist timing|error" |
                tail -1 | sed "s/^/kv=$k ${d:-_} /" || true
        done
    done
}

# Decode on the default path, this build against .gpu-base's binary
# (build-base), alternating, three rounds, on the synthetic SmolLM2 file
# from positions 0 and 256: greedy, the sampler's settings of the default
# model (top-k 40, top-p 0.95), and temperature alone (dense); BASE_AB_MODES
# picks among "greedy sampled dense", BASE_AB_DEPTHS among the positions.
# Run with carry [".gpu", ".gpu-base"].
base_ab() {
    echo "== this build against the base binary ($(cat .gpu-base/commit 2>/dev/null || echo missing))"
    [ -x .gpu-base/akunu ] || { echo "no .gpu-base/akunu: run scripts/gpu.sh build-base REV here"; return 0; }
    local f r p b s
    f=$(smol_file)
    for s in ${BASE_AB_MODES:-greedy sampled dense}; do
        local extra=""
        [ $s = sampled ] && extra="--temperature 0.8 --top-k 40 --top-p 0.95 --seed 1"
        [ $s = dense ] && extra="--temperature 0.8 --seed 1"
        for p in ${BASE_AB_DEPTHS:-0 256}; do
            for r in 1 2 3; do
                for b in .gpu-base/akunu "$BIN/akunu"; do
                    # shellcheck disable=SC2086
                    timeout 120 "$b" bench -m "$f" --device cuda -p "$p" -n 128 -r 5 --no-bandwidth $extra 2>&1 |
                        grep -E "tg[0-9]|error" | sed "s|^|$s p=$p $( [ "$b" = .gpu-base/akunu ] && echo base || echo this) |" |
                        sed 's/| akunu synthetic.*prefill//' || true
                done
            done
        done
    done
}

# Prefill (pp512, -r 5) of this build against the base binary (.gpu-base,
# `build-base REV`) on the synthetic shapes of BENCH_SHAPES, alternating
# binaries, BASE_PP_ROUNDS rounds (default 3).
base_pp_one() { # NAME FILE
    local r b
    for r in $(seq "${BASE_PP_ROUNDS:-3}"); do
        for b in .gpu-base/akunu "$BIN/akunu"; do
            timeout 200 "$b" bench -m "$2" --device cuda -p 512 -n 0 -r 5 --no-bandwidth 2>&1 |
                grep -E "pp[0-9]|error" | sed "s|^|$1 $([ "$b" = .gpu-base/akunu ] && echo base || echo this) |" |
                sed 's/| akunu synthetic.*prefill//' || true
        done
    done
}

base_pp() {
    echo "== prefill: this build against the base binary ($(cat .gpu-base/commit 2>/dev/null || echo missing))"
    [ -x .gpu-base/akunu ] || { echo "no .gpu-base/akunu: run scripts/gpu.sh build-base REV here"; return 0; }
    each_shape "${BENCH_SHAPES:-llama-8b:q4_0 llama-1b:f16}" base_pp_one
}

# Block 0's cycles per phase kind (-DPD_TIMING) of one chain, greedy and
# with each sampler mode of the kernel (dense, top-k with top-p), from each
# prompt length of PD_TIMING_DEPTHS (default "0"); PD_TIMING_MODES picks
# the modes by label (default all four).
persist_timing() {
    echo "== persistent decode: block 0's cycles a token, greedy and sampled"
    local f s label defs args p
    f=$(smol_file)
    for p in ${PD_TIMING_DEPTHS:-0}; do
        # label | extra defines | bench arguments
        for s in "greedy||" "greedy-on-the-sampler-build|-DPD_GREEDY_ONLY=0|" \
            "dense||--temperature 0.8 --seed 1" "topk||--temperature 0.8 --top-k 40 --top-p 0.95 --seed 1"; do
            IFS='|' read -r label defs args <<<"$s"
            case " ${PD_TIMING_MODES:-greedy greedy-on-the-sampler-build dense topk} " in
            *" $label "*) ;;
            *) continue ;;
            esac
            # shellcheck disable=SC2086
            AKUNU_CUDA_DEFINES="-DPD_TIMING $defs ${PERSIST_DEFINES:-}" timeout 120 "$BIN/akunu" bench -m "$f" \
                --device cuda -p "$p" -n 128 -r 1 --no-bandwidth $args 2>&1 |
                grep -E "persist timing|persist sampler|error" | tail -3 | sed "s/^/$label p=$p: /" || true
        done
    done
}

# The persistent decode kernel's compile-time variants on one binary:
# greedy and sampled (the default model's settings) tg128 from position 0
# for each define set of PERSIST_AB (as in persist), the sets alternating
# within each of PD_AB_ROUNDS rounds (default 2); each set's module is
# compiled by a short warm-up run first. PD_AB_DEPTHS: prompt lengths to
# start from (default "0"). PD_AB_MODES: the sampling settings to run
# (default "greedy sampled"; "penalised" adds --repeat-penalty 1.1 to sampled).
pd_ab() {
    echo "== persistent decode variants: greedy and sampled tg128, sets alternating"
    local f r d s extra
    f=$(smol_file)
    for d in ${PERSIST_AB:-_}; do
        AKUNU_CUDA_DEFINES="$(smb_defines "$d")" timeout 120 "$BIN/akunu" bench -m "$f" --device cuda -p 0 -n 16 \
            -r 1 --no-bandwidth >/dev/null 2>&1 || echo "$d: warm-up failed"
    done
    for r in $(seq "${PD_AB_ROUNDS:-2}"); do
        for p in ${PD_AB_DEPTHS:-0}; do
            for s in ${PD_AB_MODES:-greedy sampled}; do
                extra=""
                [ $s = sampled ] && extra="--temperature 0.8 --top-k 40 --top-p 0.95 --seed 1"
                [ $s = penalised ] && extra="--temperature 0.8 --top-k 40 --top-p 0.95 --repeat-penalty 1.1 --seed 1"
                for d in ${PERSIST_AB:-_}; do
                    # shellcheck disable=SC2086
                    AKUNU_CUDA_DEFINES="$(smb_defines "$d")" timeout 120 "$BIN/akunu" bench -m "$f" --device cuda \
                        -p "$p" -n 128 -r 5 --no-bandwidth $extra 2>&1 | grep -E "tg[0-9]|error" |
                        sed "s/^/$s p=$p $d /" | sed 's/| akunu synthetic.*prefill//' || true
                done
            done
        done
    done
}

# Whether the persistent greedy decode's two speeds (runs of about 2,42x or
# 2,51x tok/s on the H100, session 21) follow the SM clock or block 0's SM:
# CLOCK_RUNS processes (default 10) of tg128, each printing its median and,
# per launch (-DPD_CLOCK), the ns a token, the SM clock rate and block 0's SM;
# every block's SM per launch goes to $OUTDIR/persist-clock.log.
persist_clock() {
    echo "== persistent decode: speed against SM clock and placement, one line a process"
    local f i
    f=$(smol_file)
    for i in $(seq "${CLOCK_RUNS:-10}"); do
        AKUNU_CUDA_DEFINES="-DPD_CLOCK ${PERSIST_DEFINES:-}" timeout 120 "$BIN/akunu" bench -m "$f" --device cuda \
            -p 0 -n 128 -r 3 --no-bandwidth 2>&1 | tee -a "$OUTDIR/persist-clock.log" | python3 -c '
import re, sys, statistics as st
tg, ns, mhz, sm = None, [], [], []
for l in sys.stdin:
    m = re.search(r"(\d+) tokens, ([\d.]+) ns a token, ([\d.]+) MHz, block 0 on SM (\d+)", l)
    if m and int(m.group(1)) > 8:
        ns.append(float(m.group(2))); mhz.append(float(m.group(3))); sm.append(int(m.group(4)))
    elif "tg" in l and "|" in l:
        tg = l.strip()
if not ns:
    print("no clock lines:", tg); sys.exit()
print(f"launches {len(ns)}  ns/token median {st.median(ns):.0f} (min {min(ns):.0f} max {max(ns):.0f})  "
      f"MHz median {st.median(mhz):.0f} (min {min(mhz):.0f} max {max(mhz):.0f})  "
      "us/token@block-0 SM: " + " ".join(f"{n / 1e3:.1f}@{s}" for n, s in zip(ns, sm)))
' || true
    done
}

# Runs CMD ARGS... (a function or a command) once for each set of
# environment variables in SETS: sets by spaces, a set's VAR=VALUE pairs by
# commas, `_` for none; "-- NAME SET" before each.
each_env_set() { # SETS NAME CMD ARGS...
    local sets=$1 name=$2 set
    shift 2
    local -a vars
    for set in $sets; do
        vars=()
        if [ "$set" != _ ]; then IFS=, read -ra vars <<<"$set"; fi
        # `+` in a value stands for a space (several -D words in one set).
        if [ ${#vars[@]} -gt 0 ]; then vars=("${vars[@]//+/ }"); fi
        echo "-- $name $set"
        (
            if [ ${#vars[@]} -gt 0 ]; then export "${vars[@]}"; fi
            "$@"
        )
    done
}

# Where the streaming kernel's time goes (-DSD_DIAG=4, stream.cu): over
# every block and launch of a decode bench, the share of its cycles the
# producer waited for a free stage (the consumers behind) and the first
# consumer thread waited for a full stage (the stream behind) or for other
# blocks' tagged words, its cycles from a full stage to its arrival (its
# work on a stage), and the shares of its sections of a token.
# STREAM_CLOCK_SETS: environment sets as ENV_SETS (AKUNU_CUDA_DEFINES=
# -DSD_DIAG=5 adds SD_DIAG's bit 1); STREAM_CLOCK_ARGS: more bench
# arguments (the sampler's, for instance).
stream_clock_one() { # NAME FILE
    each_env_set "${STREAM_CLOCK_SETS:-_}" "$1" stream_clock_run "$2"
}

stream_clock_run() { # FILE
    # shellcheck disable=SC2086 # STREAM_CLOCK_ARGS is a list of arguments
    AKUNU_CUDA_DEFINES=${AKUNU_CUDA_DEFINES:--DSD_DIAG=4} timeout 300 "$BIN/akunu" bench -m "$1" --device cuda \
        -p 512 -n 128 -r 1 --no-bandwidth ${STREAM_CLOCK_ARGS:-} >"$OUTDIR/stream-clock.log" 2>&1 || echo "run failed"
    grep -E "tg[0-9]" "$OUTDIR/stream-clock.log" || true
    python3 - "$OUTDIR/stream-clock.log" <<'PY'
import sys
p, c, n, toks, work, stages = [0, 0], [0, 0, 0], 0, 0, 0, 0
for l in open(sys.argv[1]):
    w = l.split()
    if len(w) < 5 or w[0] != "sd_clk":
        continue
    if w[1] == "P":
        p[0] += int(w[3]); p[1] += int(w[4])
    elif len(w) >= 9:
        c[0] += int(w[3]); c[1] += int(w[4]); c[2] += int(w[5]); toks += int(w[6]); n += 1
        work += int(w[7]); stages += int(w[8])
if not p[1] or not c[2]:
    sys.exit("no sd_clk lines")
print(f"producer waited for a free stage {100 * p[0] / p[1]:.1f}% of its cycles; consumer 0 waited for a full "
      f"stage {100 * c[0] / c[2]:.1f}%, for tagged words {100 * c[1] / c[2]:.1f}% ({n} block launches, "
      f"{c[2] / toks:.0f} cycles a token)")
print(f"consumer 0 worked on its stages (full to arrival) {100 * work / c[2]:.1f}% of its cycles, "
          f"{work / stages:.0f} cycles a stage, {c[2] / stages:.0f} cycles of the launch a stage")
# Consumer 0's sections of a token (stream.cu SD_MARK), as shares of its
# cycles: blocks that attend (the first 128 on the issue's shapes) and the rest.
# In the Q4_0 form a product's section is only its final barrier's wait;
# its loop is in the sd_loop line (qkv, o, gu, down, logits loops).
names = ["norm>qkv", "qkv", "rope+kv", "attend", "merge>o", "o", "o sums", "norm>gu", "gu", "gu sums",
         "act>down", "down", "down sums", "logits", "token", "qkv loop", "o loop", "gu loop", "down loop",
         "logits loop"]
att = 128
for label, pick in (("attending blocks", lambda b: b < att), ("other blocks", lambda b: b >= att)):
    tot = [0] * 20
    for l in open(sys.argv[1]):
        w = l.split()
        if len(w) == 17 and w[0] == "sd_sec" and pick(int(w[1])):
            tot[:15] = [a + int(b) for a, b in zip(tot[:15], w[2:])]
        if len(w) == 7 and w[0] == "sd_loop" and pick(int(w[1])):
            tot[15:] = [a + int(b) for a, b in zip(tot[15:], w[2:])]
    if sum(tot):
        print(f"  {label}: " + ", ".join(f"{n} {100 * v / sum(tot):.1f}%" for n, v in zip(names, tot) if v))
PY
}

stream_clock() {
    echo "== streaming kernel: where the cycles go (SD_DIAG=4)"
    each_shape "${BENCH_SHAPES:-llama-8b:q4_0}" stream_clock_one
}

# The streaming kernel's block times (SD_DIAG=64): every block's section
# ends in one layer (SD_BT_LAYER, default 5) of one chain token
# (SD_BT_TOKEN, default 2) of each launch; per section, the median over
# launches of the earliest, median and latest block (ns after the layer's
# first start), and the blocks most often among the latest five.
# STREAM_BLOCKS_DEFINES: extra defines.
stream_blocks() {
    echo "== streaming kernel: every block's section ends (SD_DIAG=64)"
    each_shape "${BENCH_SHAPES:-llama-8b:q4_0}" stream_blocks_one
}

stream_blocks_one() { # NAME FILE
    AKUNU_CUDA_DEFINES="-DSD_DIAG=64 ${STREAM_BLOCKS_DEFINES:-}" timeout 300 "$BIN/akunu" bench -m "$2" \
        --device cuda -p 512 -n 128 -r 1 --no-bandwidth >"$OUTDIR/stream-blocks-$1.log" 2>&1 || echo "run failed"
    grep -E "tg[0-9]" "$OUTDIR/stream-blocks-$1.log" || true
    python3 - "$OUTDIR/stream-blocks-$1.log" <<'PY'
import sys, statistics as st, collections
launches, cur = [], {}
for l in open(sys.argv[1]):
    w = l.split()
    if len(w) != 16 or w[0] != "sd_bt":
        continue
    b, v = int(w[1]), list(map(int, w[2:]))
    if b in cur:
        launches.append(cur); cur = {}
    cur[b] = v
if cur:
    launches.append(cur)
launches = [g for g in launches if len(g) > 1 and all(min(v) > 0 for v in g.values())]
if not launches:
    sys.exit("no sd_bt lines (did a chain reach the token?)")
names = ["layer start", "norm>qkv", "qkv", "rope+kv", "attend", "merge>o", "o", "o sums", "norm>gu", "gu",
         "gu sums", "act>down", "down", "down sums"]
print(f"{len(launches)} launches of {len(launches[0])} blocks; ns after the layer's first start, "
      "medians over launches")
# "after" is the median block's end less the previous section's latest
# block's end: how long a section takes once every block could start it
# (for a staging, from the last writer's mark).
late = collections.defaultdict(collections.Counter)
prev = None
for i, n in enumerate(names):
    e, m, x = [], [], []
    for g in launches:
        t0 = min(v[0] for v in g.values())
        ts = sorted((v[i] - t0, b) for b, v in g.items())
        e.append(ts[0][0]); m.append(ts[len(ts) // 2][0]); x.append(ts[-1][0])
        for _, b in ts[-5:]:
            late[n][b] += 1
    often = ", ".join(f"{b}:{c}" for b, c in late[n].most_common(4))
    after = f"{st.median([a - b for a, b in zip(m, prev)]):7.0f}" if prev else "       "
    print(f"  {n:11s} earliest {st.median(e):8.0f}  median {st.median(m):8.0f}  latest {st.median(x):8.0f}  "
          f"spread {st.median([a - b for a, b in zip(x, e)]):7.0f}  after {after}  often latest {often}")
    prev = x
PY
}

# Every block's phase ends in one layer of one token of the persistent
# decode (-DPD_BLOCK_TIMES, persist.cu): for each mark, the earliest,
# median and latest block (ns after the layer's first start) and the three
# latest blocks. PERSIST_BT: extra defines (e.g. "-DPD_BT_LAYER=3");
# PD_BLOCKS_ARGS: extra bench arguments (e.g. the sampler's settings).
persist_blocks() {
    echo "== persistent decode: every block's phase ends (one layer, one token)"
    local f=$STORE/smollm2-135m-q4_1.gguf
    synth_file smollm2-135m q4_1 "$f"
    # shellcheck disable=SC2086
    AKUNU_CUDA_PERSIST=1 AKUNU_CUDA_DEFINES="-DPD_BLOCK_TIMES ${PERSIST_BT:-}" timeout 120 "$BIN/akunu" bench \
        -m "$f" --device cuda -p 0 -n 128 -r 1 --no-bandwidth ${PD_BLOCKS_ARGS:-} \
        >"$OUTDIR/persist-blocks.log" 2>&1 || true
    python3 - "$OUTDIR/persist-blocks.log" <<'PY'
import sys
rows = [l.split()[1:] for l in open(sys.argv[1]) if l.startswith("bt ")]
rows = [list(map(int, r)) for r in rows][-132:]
if not rows:
    print("no block times (did the chain reach the token?)"); sys.exit()
names = ["start", "qkv rows", "qkv h", "qkv norm", "qkv end", "attn end", "o end",
         "gu h", "gu norm", "gu end", "down end", "lg dots", "lg part", "lg flags", "token",
         "part 1", "pick 1"]
# Blocks without q|k|v rows wait on nothing in the layer and run ahead:
# they are left out (a mark a block did not reach reads 0).
act = [r for r in rows if r[3]]
t0 = min(r[1] for r in act)
print(f"{len(act)} of {len(rows)} blocks with q|k|v rows; ns after the first one's layer start")
for i, n in enumerate(names):
    v = sorted((r[1 + i] - t0, r[0]) for r in act if r[1 + i])
    if not v:
        continue
    q = lambda f: v[min(len(v) - 1, int(f * len(v)))][0]
    late = ", ".join(f"{b}:{t}" for t, b in v[-3:][::-1])
    print(f"  {n:9s} n {len(v):3d}  min {v[0][0]:6d}  p10 {q(0.1):6d}  median {q(0.5):6d}  "
          f"p90 {q(0.9):6d}  max {v[-1][0]:6d}  latest {late}")
PY
}

# Greedy against sampled decode (the default model's sampling settings) on
# the default model file (after model-part1..3), alternating, MODEL_ROUNDS
# rounds (default 4), from position 0 and after a 256-token prompt.
model_sampled() {
    assemble_model || return 0
    echo "== default model: greedy and sampled tg128, alternating"
    local r p s extra
    for r in $(seq "${MODEL_ROUNDS:-4}"); do
        for p in 0 256; do
            for s in greedy sampled; do
                extra=""
                [ $s = sampled ] && extra="--temperature 0.8 --top-k 40 --top-p 0.95 --seed 1"
                # shellcheck disable=SC2086
                timeout 120 "$BIN/akunu" bench -m "$MODEL" --device cuda -p "$p" -n 128 -r 5 --no-bandwidth \
                    $extra 2>&1 | grep -E "tg[0-9]|error" | sed "s/^/$s p=$p /" |
                    sed 's/| SmolLM2.*prefill//' || true
            done
        done
    done
}

# Greedy decode of the default model file (after model-part1..3) with the
# persistent kernel off and on, two rounds, from position 0 and after a
# 256-token prompt.
persist_model() {
    assemble_model || return 0
    echo "== default model: greedy tg128, persistent decode off / on"
    local r v p
    for p in 0 256; do
        for r in 1 2; do
            for v in 0 1; do
                AKUNU_CUDA_PERSIST=$v "$BIN/akunu" bench -m "$MODEL" --device cuda -p "$p" -n 128 -r 5 \
                    --no-bandwidth 2>&1 | grep -E "tg[0-9]|error|keeps the graph" |
                    sed "s/^/persist=$v p=$p /" || true
            done
        done
    done
}

# One define set of SMB_AB as AKUNU_CUDA_DEFINES takes it: `_` is none,
# commas separate defines.
smb_defines() {
    local d=$1 w out=()
    [ "$d" = _ ] && d=
    # A define without its -D (PERSIST_AB="PD_X=1") gets one: the backend
    # ignores words of AKUNU_CUDA_DEFINES that do not start with -D, so the
    # set would silently run the default build.
    for w in ${d//,/ }; do
        case $w in
        -D*) out+=("$w") ;;
        *) out+=("-D$w") ;;
        esac
    done
    printf '%s\n' "${out[*]}"
}

# Sampled decode with the select kernel's compile-time variants against
# greedy, on one binary, then the select kernel's phases for each. SMB_AB:
# define sets separated by spaces, the defines of a set by commas, `_` for
# none (default: "-DSMB_RANK=0 -DSMB_RANK=1").
sampled_ab() {
    echo "== greedy and sampled decode by select-kernel variant (synthetic smollm2-135m q4_1)"
    local d sets=${SMB_AB:--DSMB_RANK=0 -DSMB_RANK=1}
    # shellcheck disable=SC2086 # a list of define sets
    sampled_runs $sets
    for d in $sets; do
        smb_timing "$STORE/smollm2-135m-q4_1.gguf" "$(smb_defines "$d")"
    done
}

# Two rounds of greedy, then sampled decode under each define set given (as
# in SMB_AB), on the synthetic SmolLM2 file.
sampled_runs() {
    local f=$STORE/smollm2-135m-q4_1.gguf r d
    synth_file smollm2-135m q4_1 "$f"
    for r in 1 2; do
        # Greedy on the graph (the path sampled decode takes), then on the
        # default path (the persistent kernel on sm_90).
        AKUNU_CUDA_PERSIST=0 "$BIN/akunu" bench -m "$f" --device cuda -p 0 -n 128 -r 5 --no-bandwidth 2>&1 |
            grep -E "tg[0-9]|error" | sed "s/^/greedy (graph) /" | sed 's/| akunu synthetic.*prefill//' || true
        "$BIN/akunu" bench -m "$f" --device cuda -p 0 -n 128 -r 5 --no-bandwidth 2>&1 |
            grep -E "tg[0-9]|error" | sed "s/^/greedy /" | sed 's/| akunu synthetic.*prefill//' || true
        for d in "$@"; do
            d=$(smb_defines "$d")
            # The default path (the persistent kernel's sampler on sm_90),
            # then the graph's sampler.
            AKUNU_CUDA_DEFINES="$d" "$BIN/akunu" bench -m "$f" --device cuda -p 0 -n 128 -r 5 \
                --no-bandwidth --temperature 0.8 --top-k 40 --top-p 0.95 --seed 1 2>&1 |
                grep -E "tg[0-9]|error|persistent" | sed "s/^/sampled ${d:-_} /" | sed 's/| akunu synthetic.*prefill//' || true
            AKUNU_CUDA_PERSIST=0 AKUNU_CUDA_DEFINES="$d" "$BIN/akunu" bench -m "$f" --device cuda -p 0 -n 128 -r 5 \
                --no-bandwidth --temperature 0.8 --top-k 40 --top-p 0.95 --seed 1 2>&1 |
                grep -E "tg[0-9]|error" | sed "s/^/sampled (graph) ${d:-_} /" | sed 's/| akunu synthetic.*prefill//' || true
        done
        # Dense Gumbel-max (temperature alone) on the default path.
        "$BIN/akunu" bench -m "$f" --device cuda -p 0 -n 128 -r 5 --no-bandwidth --temperature 0.8 --seed 1 2>&1 |
            grep -E "tg[0-9]|error" | sed "s/^/sampled dense /" | sed 's/| akunu synthetic.*prefill//' || true
    done
}

sanitize() {
    echo "== compute-sanitizer (memcheck, racecheck) on short generations"
    local m=$STORE/tiny-q4_1.gguf tool
    "$BIN/akunu" synth --shape tiny --type q4_1 "$m" >/dev/null 2>&1
    # tiny-k Q8_0 with SmolLM2's vocabulary runs its logits product on the
    # bulk-copy gemv, whose copies land in shared memory asynchronously.
    local mk=$STORE/tiny-k-q8_0.gguf f
    "$BIN/akunu" synth --shape tiny-k --type q8_0 \
        --tokenizer-from crates/akunu-core/tests/data/tokenizer/ggml-vocab-smollm2.gguf "$mk" >/dev/null 2>&1
    for f in "$m" "$mk"; do
        for tool in memcheck racecheck synccheck; do
            local log=$OUTDIR/sanitize-$tool-$(basename "$f" .gguf).log
            if compute-sanitizer --tool "$tool" --error-exitcode 3 \
                "$BIN/akunu" generate -m "$f" --device cuda --prompt-ids 1,2,3,4,5,6,7,8,9,10 \
                -n 40 --ignore-eos --chunk 8 --prefill-chunk 4 >"$log" 2>&1; then
                echo "$tool $(basename "$f"): $(grep -hE '(ERROR|RACECHECK) SUMMARY' "$log" | tail -1)"
            else
                echo "$tool $(basename "$f"): FAILED"
                tail -30 "$log"
            fi
        done
    done
    # A 200-token prefill on cuBLAS: the quarter-block dequantization, its
    # slots, and the side stream (tiny-k products leave SMs idle); the
    # tensor-core prefill attention (racecheck: its shared-memory tiles);
    # the f16 products (hi-only dequantization).
    local v products
    for v in memcheck:exact racecheck:exact memcheck:f16 racecheck:f16; do
        tool=${v%%:*}
        products=${v##*:}
        log=$OUTDIR/sanitize-cublas-$tool-$products.log
        if AKUNU_CUDA_CUBLAS_CHUNK_MB=1 compute-sanitizer --tool "$tool" --error-exitcode 3 \
            "$BIN/akunu" generate -m "$mk" --device cuda --prompt-ids "$(seq -s, 1 200)" -n 4 \
            --ignore-eos --prefill-products "$products" >"$log" 2>&1; then
            echo "$tool, cuBLAS prefill ($products products): $(grep -hE '(ERROR|RACECHECK) SUMMARY' "$log" | tail -1)"
        else
            echo "$tool, cuBLAS prefill ($products products): FAILED"
            tail -30 "$log"
        fi
    done
    # Llama-1B's FFN down product (k = 8,192) stages its input raw with
    # asynchronous copies and converts it in place (gemv_tc.cu
    # `tcg_stage_raw`): on the register form (Q4_0) and the bulk-copy
    # form (F16). A short decode; racecheck sees the in-place conversion.
    local t f1
    for t in q4_0 f16; do
        f1=$STORE/llama-1b-$t.gguf
        synth_file llama-1b "$t" "$f1"
        for tool in memcheck racecheck; do
            log=$OUTDIR/sanitize-raw-$tool-$t.log
            if compute-sanitizer --tool "$tool" --error-exitcode 3 \
                "$BIN/akunu" generate -m "$f1" --device cuda --prompt-ids 1,2,3,4 -n 3 --ignore-eos \
                --chunk 2 >"$log" 2>&1; then
                echo "$tool, llama-1b $t (raw staging): $(grep -hE '(ERROR|RACECHECK) SUMMARY' "$log" | tail -1)"
            else
                echo "$tool, llama-1b $t (raw staging): FAILED"
                tail -30 "$log"
            fi
        done
    done
    # The persistent greedy decode (the default on sm_90) of the SmolLM2
    # shape: one cooperative kernel per chain, an f16 KV cache.
    local ms=$STORE/smollm2-135m-q4_1.gguf
    synth_file smollm2-135m q4_1 "$ms"
    if timeout 300 compute-sanitizer --tool memcheck --error-exitcode 3 \
        "$BIN/akunu" generate -m "$ms" --device cuda --prompt-ids 1,2,3,4,5 -n 6 --ignore-eos --chunk 6 \
        >"$OUTDIR/sanitize-persist.log" 2>&1; then
        echo "memcheck, persistent decode: $(grep -h 'ERROR SUMMARY' "$OUTDIR/sanitize-persist.log" | tail -1)"
    else
        echo "memcheck, persistent decode: FAILED or timed out"
        tail -30 "$OUTDIR/sanitize-persist.log"
    fi
    # Its sampler: top-k with top-p and the repetition penalty, then dense.
    local sp
    for sp in "--top-k 40 --top-p 0.95 --repeat-penalty 1.1" ""; do
        # shellcheck disable=SC2086
        if timeout 300 compute-sanitizer --tool memcheck --error-exitcode 3 \
            "$BIN/akunu" generate -m "$ms" --device cuda --prompt-ids 1,2,3,4,5 -n 6 --ignore-eos --chunk 6 \
            --temperature 0.8 --seed 3 $sp >"$OUTDIR/sanitize-persist-sampled.log" 2>&1; then
            echo "memcheck, persistent sampled decode (${sp:-dense}): $(grep -h 'ERROR SUMMARY' "$OUTDIR/sanitize-persist-sampled.log" | tail -1)"
        else
            echo "memcheck, persistent sampled decode (${sp:-dense}): FAILED or timed out"
            tail -30 "$OUTDIR/sanitize-persist-sampled.log"
        fi
    done
    # A token limit inside a chunk: the chunk's remaining kernels return
    # early, the bulk-copy gemv after waiting for the copies it started.
    if compute-sanitizer --tool memcheck --error-exitcode 3 \
        "$BIN/akunu" generate -m "$mk" --device cuda --prompt-ids 1,2,3 -n 13 --ignore-eos --chunk 8 \
        >"$OUTDIR/sanitize-limit.log" 2>&1; then
        echo "memcheck, limit inside a chunk: $(grep -h 'ERROR SUMMARY' "$OUTDIR/sanitize-limit.log" | tail -1)"
    else
        echo "memcheck, limit inside a chunk: FAILED"
        tail -30 "$OUTDIR/sanitize-limit.log"
    fi
    sanitize_sampled
}

# The persistent decode alone under compute-sanitizer, on both synthetic
# SmolLM2 files (Q4_1 throughout: every logits row resident in shared
# memory; a Q8_0 embedding: part resident, part streamed): memcheck greedy
# and sampled (top-k with top-p and the penalty), racecheck and synccheck
# sampled (the sampler's shared selection fields and barriers).
sanitize_persist() {
    echo "== compute-sanitizer on the persistent decode"
    local e f v tool samp log
    for e in "" q8_0; do
        f=$(SMOL_EMB=$e smol_file)
        for v in memcheck:greedy memcheck:sampled racecheck:sampled synccheck:sampled; do
            tool=${v%%:*}
            samp=""
            [ "${v#*:}" = sampled ] && samp="--temperature 0.8 --top-k 40 --top-p 0.95 --repeat-penalty 1.1 --seed 3"
            log=$OUTDIR/sanitize-persist-$tool-${v#*:}${e:+-emb-$e}.log
            # shellcheck disable=SC2086 # a list of arguments
            if timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 3 \
                "$BIN/akunu" generate -m "$f" --device cuda --prompt-ids 1,2,3,4,5 -n 6 --ignore-eos --chunk 6 \
                $samp >"$log" 2>&1; then
                echo "$tool, persistent ${v#*:}${e:+ (embedding $e)}: $(grep -hE '(ERROR|RACECHECK) SUMMARY' "$log" | tail -1)"
            else
                echo "$tool, persistent ${v#*:}${e:+ (embedding $e)}: FAILED or timed out"
                tail -20 "$log"
            fi
        done
    done
}

# Sampled decode: the multi-block sampler (48 blocks on SmolLM2's
# vocabulary; racecheck and synccheck: its shared-memory candidate lists
# and ranks), with a penalty on the tiny vocabulary.
sanitize_sampled() {
    local m=$STORE/tiny-q4_1.gguf mk=$STORE/tiny-k-q8_0.gguf samp v tool f log
    [ -f "$m" ] || "$BIN/akunu" synth --shape tiny --type q4_1 "$m" >/dev/null 2>&1
    [ -f "$mk" ] || "$BIN/akunu" synth --shape tiny-k --type q8_0 \
        --tokenizer-from crates/akunu-core/tests/data/tokenizer/ggml-vocab-smollm2.gguf "$mk" >/dev/null 2>&1
    for v in memcheck:"$m" memcheck:"$mk" racecheck:"$mk" synccheck:"$mk"; do
        tool=${v%%:*}
        f=${v#*:}
        samp="--temperature 0.8 --top-k 40 --top-p 0.95 --seed 1"
        [ "$f" = "$m" ] && samp="--temperature 0.9 --top-k 20 --top-p 0.9 --repeat-penalty 1.1 --seed 3"
        log=$OUTDIR/sanitize-sampled-$tool-$(basename "$f" .gguf).log
        # shellcheck disable=SC2086 # a list of arguments
        if compute-sanitizer --tool "$tool" --error-exitcode 3 \
            "$BIN/akunu" generate -m "$f" --device cuda --prompt-ids 1,2,3,4,5 -n 20 --ignore-eos \
            $samp >"$log" 2>&1; then
            echo "$tool, sampled $(basename "$f"): $(grep -hE '(ERROR|RACECHECK) SUMMARY' "$log" | tail -1)"
        else
            echo "$tool, sampled $(basename "$f"): FAILED"
            tail -30 "$log"
        fi
    done
}

bench_one() { # NAME FILE [extra args]
    local name=$1 file=$2
    shift 2
    "$BIN/akunu" bench -m "$file" --device cuda -p 512 -n 128 -r 5 "$@" 2>&1 |
        tee "$OUTDIR/bench-$name.log" | grep -E "^\||kernels|floor|error" || true
}

# For each SHAPE:TYPE of LIST, synthesises the model file (unless it is
# there) and runs FUNC NAME FILE; 8B files are deleted after use (disk).
# Flags after the type, each after a colon: `rope-freqs` writes Llama
# 3.1-style RoPE divisors (`akunu synth --rope-freqs`, as Llama 3.1/3.2
# files carry them); `llama3-vocab` takes Llama 3's tokenizer (128,256
# tokens, the real files' embedding and logits size) instead of SmolLM2's;
# `q6k-logits` writes the logits matrix as Q6_K, as llama.cpp's quantizer
# does for a Q4_0 model (the embedding too when tied).
# E.g. llama-1b:f16:rope-freqs:llama3-vocab, a Llama-3.2-1B twin;
# llama-8b:q4_0:rope-freqs:llama3-vocab:q6k-logits, a Llama-3.1-8B Q4_0's.
each_shape() { # LIST FUNC
    local spec shape type flags flag name f tok
    local -a extra
    for spec in $1; do
        IFS=: read -r shape type flags <<<"$spec"
        name=$shape-$type
        extra=()
        tok=crates/akunu-core/tests/data/tokenizer/ggml-vocab-smollm2.gguf
        for flag in ${flags//:/ }; do
            case $flag in
                rope-freqs) extra+=(--rope-freqs) ;;
                llama3-vocab) tok=crates/akunu-core/tests/data/tokenizer/ggml-vocab-llama-bpe.gguf ;;
                q6k-logits)
                    # The output matrix (the embedding of a tied shape).
                    if [ "$shape" = llama-8b ]; then extra+=(--output-type q6_k); else extra+=(--embedding-type q6_k); fi ;;
                *) echo "each_shape: unknown flag $flag in $spec" >&2; return 1 ;;
            esac
            name=$name-$flag
        done
        f=$STORE/$name.gguf
        SYNTH_TOKENIZER=$tok synth_file "$shape" "$type" "$f" "${extra[@]}"
        "$2" "$name" "$f"
        if [ "$shape" = llama-8b ]; then rm -f "$f"; fi
    done
}

bench() {
    echo "== benchmarks (synthetic shapes)"
    each_shape "${BENCH_SHAPES:-smollm2-135m:q4_1 llama-1b:f16 llama-8b:q4_0 llama-8b:f16}" bench_one
}

# The PyTorch peer (tools/peer_torch.py) on the issue's shapes, same prompt
# and token counts as `bench`: eager and torch.compile'd steps, each
# replayed as a CUDA graph. PEER_SHAPES lists SHAPE:DTYPE, PEER_MODES
# "eager compiled".
peer_torch() {
    echo "== PyTorch peer (tools/peer_torch.py, -p 512 -n 128 -r 5)"
    local spec mode flag out
    export TORCHINDUCTOR_CACHE_DIR=$STORE/inductor
    for spec in ${PEER_SHAPES:-smollm2-135m:bf16 llama-1b:f16 llama-8b:f16}; do
        for mode in ${PEER_MODES:-eager compiled}; do
            flag=""
            [ "$mode" = compiled ] && flag=--compile
            out=$OUTDIR/peer-${spec%%:*}-${spec##*:}-$mode
            timeout "${PEER_TIMEOUT:-300}" python3 tools/peer_torch.py --shape "${spec%%:*}" --dtype "${spec##*:}" \
                $flag --json "$out.json" >"$out.log" 2>&1 ||
                { echo "peer $spec $mode failed (rc $?)"; tail -5 "$out.log"; }
            grep '^| pytorch' "$out.log" || true
        done
    done
}

# The streaming persistent kernel (stream.rs) against the graph decode, in
# the same call: each shape of STREAM_AB_SHAPES (default the issue's 1B and
# 8B F16) benched greedy with AKUNU_CUDA_STREAM=0, then =1, then sampled
# (temperature 0.8, top-k 40, top-p 0.95: the in-kernel sampler) with =1,
# then =0; each run under a time limit (a kernel that hangs costs one run).
stream_ab_one() { # NAME FILE
    local on mode args order
    for mode in greedy sampled; do
        args=()
        order="0 1"
        if [ "$mode" = sampled ]; then
            args=(--temperature 0.8 --top-k 40 --top-p 0.95 --seed 1)
            order="1 0"
        fi
        for on in $order; do
            echo "-- $1 $mode, AKUNU_CUDA_STREAM=$on"
            AKUNU_CUDA_STREAM=$on AKUNU_CUDA_PERSIST=1 timeout 300 "$BIN/akunu" bench -m "$2" --device cuda -p 512 \
                -n 128 -r 5 "${args[@]}" 2>&1 | tee "$OUTDIR/bench-$1-$mode-stream$on.log" |
                grep -E "^\||kernels|floor|error|akunu:" || echo "run failed"
        done
    done
}

# Decode over sets of environment variables, one bench each, in one call:
# ENV_SETS lists the sets by spaces, a set's VAR=VALUE pairs by commas (`_`
# for none; `+` in a value for a space: AKUNU_CUDA_DEFINES=-DA=0+-DB=1); ENV_BENCH the bench arguments (default -p 512 -n 128 -r 3;
# the pp and tg rows are printed, so -n 0 times prefill alone);
# BENCH_SHAPES the shapes (default the 8B Q4_0 one).
env_ab_one() { # NAME FILE
    each_env_set "${ENV_SETS:-_}" "$1" env_ab_run "$2"
}

env_ab_run() { # FILE
    local mode extra
    for mode in ${ENV_MODES:-greedy}; do
        extra=""
        [ "$mode" = sampled ] && extra="--temperature 0.8 --top-k 40 --top-p 0.95 --seed 1"
        # shellcheck disable=SC2086 # ENV_BENCH is a list of arguments
        timeout 300 "$BIN/akunu" bench -m "$1" --device cuda ${ENV_BENCH:--p 512 -n 128 -r 3} $extra \
            --no-bandwidth 2>&1 | grep -E "pp[0-9]|tg[0-9]|error|akunu:" | grep -v compiling | sed "s/^/$mode /" ||
            echo "run failed"
    done
}

env_ab() {
    echo "== decode over environment sets: ${ENV_SETS:-_}"
    each_shape "${BENCH_SHAPES:-llama-8b:q4_0}" env_ab_one
}

stream_ab() {
    echo "== decode: graph, then the streaming kernel (AKUNU_CUDA_STREAM=1)"
    each_shape "${STREAM_AB_SHAPES:-llama-1b:f16 llama-8b:f16}" stream_ab_one
}

bench_ab_one() { # NAME FILE
    AKUNU_CUDA_CUBLAS=0 bench_one "$1-nocublas" "$2" --no-bandwidth
    AKUNU_CUDA_CUBLAS=1 bench_one "$1-cublas" "$2" --no-bandwidth
}

bench_ab() {
    echo "== prefill A/B: cuBLAS off (AKUNU_CUDA_CUBLAS=0), then on (synthetic shapes)"
    each_shape "${BENCH_SHAPES:-llama-1b:f16 llama-8b:q4_0 llama-8b:f16}" bench_ab_one
}

ncu_one() { # NAME FILE
    AKUNU_CUDA_PERSIST=0 timeout 240 ncu --clock-control none --kernel-name regex:'k_gemv' --launch-skip 200 \
        --launch-count "${NCU_COUNT:-8}" --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --metrics smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_barrier_per_warp_active.pct,smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_wait_per_warp_active.pct,smsp__warp_issue_stalled_lg_throttle_per_warp_active.pct,smsp__warp_issue_stalled_mio_throttle_per_warp_active.pct,smsp__warp_issue_stalled_math_pipe_throttle_per_warp_active.pct,smsp__warp_issue_stalled_no_instruction_per_warp_active.pct,smsp__warp_issue_stalled_membar_per_warp_active.pct,smsp__warp_issue_stalled_selected_per_warp_active.pct,smsp__warp_issue_stalled_sleeping_per_warp_active.pct,smsp__warp_issue_stalled_dispatch_stall_per_warp_active.pct,smsp__warp_issue_stalled_drain_per_warp_active.pct,smsp__warp_issue_stalled_imc_miss_per_warp_active.pct,smsp__warp_issue_stalled_misc_per_warp_active.pct,smsp__warp_issue_stalled_branch_resolving_per_warp_active.pct \
        --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats \
        "$BIN/akunu" generate -m "$2" --device cuda --prompt-ids 1,2,3 -n 80 --ignore-eos \
        --chunk 16 >"$OUTDIR/ncu-$1.txt" 2>&1 || echo "ncu failed (rc $?)"
    grep -E "k_gemv|stalled|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Theoretical Occupancy|Block Limit|Grid Size|One or More" \
        "$OUTDIR/ncu-$1.txt" | head -120
}

ncu_token_one() { # NAME FILE
    # One decode token's kernels, each timed alone (Nsight Compute
    # serializes them: no launch gaps, no overlap), summed by kernel.
    # The graph's kernels: the persistent decode (the default on sm_90) off.
    local per=$(( $(AKUNU_CUDA_PERSIST=0 "$BIN/akunu" bench -m "$2" --device cuda -p 0 -n 8 -r 1 2>&1 |
        sed -n 's/^kernels per token: \([0-9]*\).*/\1/p') ))
    AKUNU_CUDA_PERSIST=0 timeout 300 ncu --clock-control none --launch-skip "${NCU_SKIP:-3000}" \
        --launch-count "$per" --metrics gpu__time_duration.sum --csv \
        "$BIN/akunu" generate -m "$2" --device cuda --prompt-ids 1,2,3 -n 120 --ignore-eos \
        --chunk 16 >"$OUTDIR/ncu-token-$1.csv" 2>/dev/null || echo "ncu failed (rc $?)"
    ncu_sum "$OUTDIR/ncu-token-$1.csv" "$1" "$per"
}

# Sums an Nsight Compute CSV of gpu__time_duration by kernel name.
ncu_sum() { # CSV LABEL EXPECTED-COUNT
    python3 - "$1" "$2" "$3" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, rows = rows[0], rows[1:]
ki, vi = head.index("Kernel Name"), head.index("Metric Value")
unit = head.index("Metric Unit")
tot = collections.OrderedDict()
for r in rows:
    v = float(r[vi].replace(",", "")) * {"nsecond": 1e-3, "ns": 1e-3, "msecond": 1e3, "ms": 1e3}.get(r[unit], 1.0)
    n, s = tot.get(r[ki], (0, 0.0))
    tot[r[ki]] = (n + 1, s + v)
all_us = sum(s for _, s in tot.values())
print(f"{sys.argv[2]}: {len(rows)} kernels timed (expected {sys.argv[3]}), {all_us:.1f} us in kernels")
for k, (n, s) in sorted(tot.items(), key=lambda x: -x[1][1]):
    print(f"  {k:28s} {n:4d} x {s / n:7.2f} us = {s:8.1f} us ({100 * s / all_us:4.1f}%)")
PY
}

ncu_prefill_one() { # NAME FILE
    # One 512-token prefill's kernels (and the model upload's), each timed
    # alone, summed by kernel: where prefill time goes.
    timeout 500 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
        "$BIN/akunu" generate -m "$2" --device cuda --prompt-ids "$(seq -s, 1 512)" -n 1 \
        >"$OUTDIR/ncu-prefill-$1.csv" 2>/dev/null || echo "ncu failed (rc $?)"
    ncu_sum "$OUTDIR/ncu-prefill-$1.csv" "$1" "?" | head -16
}

# One prefill's kernel durations (Nsight Compute), per kernel.
ncu_prefill() {
    echo "== ncu: one 512-token prefill, kernel by kernel"
    each_shape "${NCU_SHAPES:-llama-8b:q4_0}" ncu_prefill_one
}

# One decode token's kernel durations (Nsight Compute), per kernel.
ncu_token() {
    echo "== ncu: one decode token, kernel by kernel"
    each_shape "${NCU_SHAPES:-llama-1b:f16 llama-8b:q4_0}" ncu_token_one
}

# Hardware counters of the decode gemv kernels (Nsight Compute; works on the
# Firecracker machines only): speed of light, memory, occupancy, warp stalls.
ncu_gemv() {
    echo "== ncu: decode gemv kernels (synthetic shapes)"
    each_shape "${NCU_SHAPES:-llama-8b:q4_0 llama-1b:f16}" ncu_one
}

ab_one() { # NAME FILE
    local v r
    for r in $(seq "${AB_ROUNDS:-1}"); do
        for v in ${AB_VALUES:-0 1}; do
            # shellcheck disable=SC2086 # AB_BENCH is a list of arguments
            env "$AB_VAR=$v" "$BIN/akunu" bench -m "$2" --device cuda ${AB_BENCH:--p 0 -n 128 -r 5} 2>&1 |
                tee "$OUTDIR/ab-$1-$AB_VAR-${v//[^A-Za-z0-9_.]/_}-$r.log" | grep -E "tg[0-9]|pp[0-9]|floor|kernels|error" |
                sed "s/^/$1 $AB_VAR=$v /" || true
            if [ -n "${AB_SAME:-}" ]; then
                env "$AB_VAR=$v" "$BIN/akunu" generate -m "$2" --device cuda --prompt-ids 1,2,3,4,5,6,7,8 \
                    -n 64 --ignore-eos --json 2>/dev/null |
                    python3 -c 'import json, sys; print(json.load(sys.stdin)["generated_ids"])' \
                        >"$OUTDIR/ids-$1-${v//[^A-Za-z0-9_.]/_}.txt" || echo "$1 $AB_VAR=$v: generate failed"
            fi
        done
    done
    if [ -n "${AB_SAME:-}" ]; then
        if [ "$(cat "$OUTDIR"/ids-"$1"-*.txt | sort -u | wc -l)" = 1 ]; then
            echo "$1: the same 64 greedy tokens for every value of $AB_VAR"
        else
            echo "$1: greedy tokens DIFFER between values of $AB_VAR"
        fi
    fi
}

# Decode A/B of a developer switch on the same binaries: AB_VAR takes each
# of AB_VALUES (default 0 1) in turn, AB_ROUNDS times (synthetic shapes);
# AB_BENCH replaces the bench arguments (default "-p 0 -n 128 -r 5"; e.g.
# "-p 512 -n 0 -r 5 --no-bandwidth" for prefill, "-p 0 -n 128 -d 512 -r 5"
# for decode after a 512-token prompt). AB_SAME=1 also generates 64 greedy
# tokens per value and says whether they are the same (switches that must
# not change results).
ab() {
    echo "== decode A/B of $AB_VAR over ${AB_VALUES:-0 1}"
    each_shape "${BENCH_SHAPES:-smollm2-135m:q4_1 llama-1b:f16 llama-8b:q4_0 llama-8b:f16}" ab_one
}

# Decode A/B of the tensor-core gemv: AKUNU_CUDA_TCG=0 (the f32 kernels),
# then on.
tcg_ab() {
    AB_VAR=AKUNU_CUDA_TCG ab
}

tcg_split_one() { # NAME FILE
    local v sp defs bin
    for v in ${SPLITS:-- 8}; do
        IFS=: read -r sp defs <<<"$v"
        bin=$BIN/akunu
        if [ "$sp" = alt ]; then
            bin=$ALT_BIN
            sp=-
        fi
        # shellcheck disable=SC2086 # TCG_BENCH is a list of arguments
        AKUNU_CUDA_DEFINES="${defs//,/ }" AKUNU_CUDA_TCG_SPLIT=$sp \
            "$bin" bench -m "$2" --device cuda ${TCG_BENCH:--p 0 -n 128 -r 3} --no-bandwidth 2>&1 |
            grep -E "tg[0-9]|error" | sed "s/^/$1 $v /" | sed 's/| akunu synthetic.*prefill//' || true
    done
}

# Decode with the tensor-core gemv's knobs forced: each of $SPLITS is
# SPLIT[:DEFINES] (AKUNU_CUDA_TCG_SPLIT, "-" = the launcher's choice;
# DEFINES: comma-separated -D options for AKUNU_CUDA_DEFINES, such as
# -DTCG_SV=1 or -DTCG_AHEAD_Q4=2). SPLIT "alt" runs the binary $ALT_BIN
# instead (one built at another commit and carried along, so that two
# commits compare on one machine). TCG_BENCH replaces the bench arguments
# (default "-p 0 -n 128 -r 3").
tcg_split() {
    echo "== decode: tensor-core gemv variants"
    each_shape "${BENCH_SHAPES:-llama-8b:q4_0 llama-8b:f16 llama-1b:f16 smollm2-135m:q4_1}" tcg_split_one
}

profile() {
    echo "== profile (synthetic smollm2-135m q4_1)"
    local f=$STORE/smollm2-135m-q4_1.gguf
    synth_file smollm2-135m q4_1 "$f"
    "$BIN/akunu" profile -m "$f" --device cuda -n 32 2>&1 | tee "$OUTDIR/profile-smollm2.log" | head -40
}

profile_big_one() { # NAME FILE
    "$BIN/akunu" profile -m "$2" --device cuda -n 16 2>&1 | tee "$OUTDIR/profile-$1.log" | head -24
}

profile_big() {
    echo "== profile (synthetic llama-1b f16, llama-8b q4_0)"
    each_shape "${PROFILE_SHAPES:-llama-1b:f16 llama-8b:q4_0}" profile_big_one
}

trace() {
    echo "== chain trace (synthetic smollm2-135m q4_1) with SM clocks"
    local f=$STORE/smollm2-135m-q4_1.gguf
    synth_file smollm2-135m q4_1 "$f"
    nvidia-smi dmon -s pc -d 1 >"$OUTDIR/dmon.log" 2>&1 &
    local dmon=$!
    AKUNU_CUDA_TRACE=1 "$BIN/akunu" generate -m "$f" --device cuda --prompt-ids 1,2,3,4 -n 300 \
        --ignore-eos --chunk 64 2>&1 >/dev/null | tee "$OUTDIR/trace.log" | cut -c1-400
    kill "$dmon" 2>/dev/null || true
    tail -5 "$OUTDIR/dmon.log"
}

features() {
    echo "== speculative and grammar-constrained decode on the default model"
    if [ ! -f "$MODEL" ]; then
        echo "default model missing: run model-part1..3 and model first"
        return 0
    fi
    local t
    for t in repeat-text repeat-code story; do
        "$BIN/akunu" bench -m "$MODEL" --device cuda --prompt-file "bench/prompts/$t.txt" --chat \
            -p 0 -n 128 -r 5 --no-bandwidth --speculative 2>&1 | tee "$OUTDIR/spec-$t.log" |
            grep -E "tg128|speculative|error" | cut -c1-300 || true
    done
    "$BIN/akunu" bench -m "$MODEL" --device cuda -p 0 -n 64 -r 5 --no-bandwidth \
        --json-schema bench/person.schema.json 2>&1 | tee "$OUTDIR/grammar.log" |
        grep -E "tg64|constrained|error" | cut -c1-300 || true
    "$BIN/akunu" generate -m "$MODEL" --device cuda --chat -p "Describe a cat as a JSON object." \
        --json-schema bench/person.schema.json -n 96 2>&1 | tail -3
}

sampler() {
    echo "== sampled against greedy decode on the default model, by select-kernel variant (SMB_AB)"
    assemble_model || return 0
    local r d
    local samp=(--temperature 0.8 --top-k 40 --top-p 0.95 --seed 1)
    # SMB_AB as in sampled_ab; e.g. "_ -DSMB_NO_TOP64" for the block sort.
    # AKUNU_CUDA_SAMPLE_PICK=0 (from the caller) keeps the Argmax launch.
    for r in 1 2; do
        bench_one "greedy-$r" "$MODEL" | grep tg128 || true
        for d in ${SMB_AB:-_}; do
            d=$(smb_defines "$d")
            AKUNU_CUDA_DEFINES="$d" bench_one "sampled-$r$(echo "$d" | tr -c 'A-Za-z0-9_\n' _)" "$MODEL" "${samp[@]}" |
                sed "s/^/sampled ${d:-_} /" | grep tg128 || true
        done
    done
    "$BIN/akunu" profile -m "$MODEL" --device cuda -n 64 "${samp[@]}" 2>&1 |
        tee "$OUTDIR/profile-sampled.log" | grep -E "sample|argmax|logits|total|per token" || true
    smb_timing "$MODEL" ""
}

# Phase lengths inside k_sample_select (SM cycles), from its developer timer:
# smb_timing MODEL EXTRA_DEFINES.
smb_timing() {
    local log
    log=$OUTDIR/smb-timing$(echo "$2" | tr -c 'A-Za-z0-9_\n' _).log
    echo "-- k_sample_select phases, defines: ${2:-none}"
    AKUNU_CUDA_DEFINES="-DSMB_TIMING $2" "$BIN/akunu" generate -m "$1" --device cuda \
        --prompt-ids 1,2,3,4 -n 700 --ignore-eos --temperature 0.8 --top-k 40 --top-p 0.95 --seed 1 \
        2>/dev/null | grep '^smb' >"$log" || true
    python3 - "$log" <<'PY'
import sys, statistics
rows = {}
for line in open(sys.argv[1]):
    head, _, nums = line.partition(": ")
    who = head.split(" kv ")[0]
    for q, v in enumerate(nums.split(), 1):
        if int(v) or who.startswith("smbc"):
            rows.setdefault((who, q), []).append(int(v))
for (who, q), v in sorted(rows.items()):
    if who.startswith("smbc"):
        what = ("slice", "merge")[q - 1]
        print(f"{who[5:]:16} {what} candidates: median {statistics.median(v):.0f}, max {max(v)} over {len(v)}")
    else:
        print(f"{who[4:]:16} phase {q - 1}-{q}: median {statistics.median(v):8.0f} cycles over {len(v)}")
PY
}

# Decode attention's split layout: keys per split (launch.rs, the split
# count is capacity / keys, at most 32) and the fewest keys a split takes
# (model.cu DEC_MIN_KEYS), each pair at a short and a long cache.
attn() {
    echo "== decode attention split layout (synthetic smollm2-135m q4_1)"
    local f=$STORE/smollm2-135m-q4_1.gguf combo keys mk ctx
    synth_file smollm2-135m q4_1 "$f"
    for combo in ${ATTN_COMBOS:-256:64 32:32 64:32 16:16}; do
        keys=${combo%%:*}
        mk=${combo##*:}
        for ctx in 648 8192; do
            AKUNU_CUDA_ATTN_KEYS=$keys AKUNU_CUDA_DEFINES=-DDEC_MIN_KEYS=$mk "$BIN/akunu" bench -m "$f" \
                --device cuda -p 512 -n 128 -r 5 --ctx "$ctx" --no-bandwidth 2>&1 |
                tee "$OUTDIR/attn-$keys-$mk-$ctx.log" | grep -E "tg128|error" | sed "s/^/keys=$keys min=$mk ctx=$ctx /" || true
        done
    done
}

# Prefill at several prompt lengths (what grows faster than the prompt is
# attention) and the cuBLAS dequantization chunk of quantized products.
prefill() {
    echo "== prefill scaling (synthetic llama-1b f16) and cuBLAS chunk (llama-8b q4_0)"
    local f=$STORE/llama-1b-f16.gguf n mb
    synth_file llama-1b f16 "$f"
    for n in 256 512 1024 2048; do
        "$BIN/akunu" bench -m "$f" --device cuda -p "$n" -n 1 -r 3 --no-bandwidth 2>&1 |
            tee "$OUTDIR/prefill-1b-$n.log" | grep -E "pp$n|error" || true
    done
    f=$STORE/llama-8b-q4_0.gguf
    synth_file llama-8b q4_0 "$f"
    for mb in 64 256 1024; do
        AKUNU_CUDA_CUBLAS_CHUNK_MB=$mb "$BIN/akunu" bench -m "$f" --device cuda -p 512 -n 1 -r 3 \
            --no-bandwidth 2>&1 | tee "$OUTDIR/prefill-8b-chunk$mb.log" | grep -E "pp512|error" |
            sed "s/^/chunk=${mb}MB /" || true
    done
    rm -f "$f"
}

# Speculative decode with several idle-run caps (plain steps a submission
# takes while the n-grams have no draft).
spec_ab() {
    echo "== speculative decode: idle-run cap A/B on the default model"
    assemble_model || return 0
    local t m
    for m in ${SPEC_IDLE:-16}; do
        for t in story repeat-text; do
            AKUNU_CUDA_SPEC_IDLE_MAX=$m "$BIN/akunu" bench -m "$MODEL" --device cuda \
                --prompt-file "bench/prompts/$t.txt" --chat -p 0 -n 128 -r 5 --no-bandwidth \
                --speculative --json 2>/dev/null | tee "$OUTDIR/spec-$t-idle$m.json" | python3 -c '
import json, sys
d = json.load(sys.stdin)
tg = [round(f["median_tok_s"], 1) for f in d["figures"] if f["test"].startswith("tg")]
print(sys.argv[1], sys.argv[2], tg, json.dumps(d["speculative"]))' "$t" "idle=$m" || true
        done
    done
}

# One launch of KERNEL (a regex) in the command after the first three
# arguments, sampled by SASS line: the report $STORE/TAG.ncu-rep, the
# command's output in $OUTDIR/ncu-TAG.txt, the source page gzipped to
# $OUTDIR/TAG-source.csv.gz and summarised by scripts/ncu_source_summary.py.
ncu_sass_stalls() { # KERNEL TAG LIMIT COMMAND...
    local kernel=$1 tag=$2 limit=$3
    shift 3
    rm -f "$STORE/$tag.ncu-rep"
    timeout "$limit" ncu --clock-control none --kernel-name "regex:$kernel" --launch-skip 1 --launch-count 1 \
        --section SourceCounters --section WarpStateStats -o "$STORE/$tag" "$@" \
        >"$OUTDIR/ncu-$tag.txt" 2>&1 || echo "ncu failed (rc $?)"
    ncu --import "$STORE/$tag.ncu-rep" --page source --csv --print-source sass 2>/dev/null |
        gzip >"$OUTDIR/$tag-source.csv.gz"
    python3 scripts/ncu_source_summary.py "$OUTDIR/$tag-source.csv.gz" 8 | cut -c1-220
}
# The persistent decode kernel's warp stalls by SASS line (Nsight Compute's
# source page, sampled warp states) over one 128-token chain on the
# synthetic SmolLM2 file: the whole page gzipped to $OUTDIR, and a summary
# of the body and each called function (the sampler's part and pick) by
# scripts/ncu_source_summary.py. NCU_PD_MODE: sampled (default) or greedy.
ncu_persist() {
    local mode=${NCU_PD_MODE:-sampled} f extra=""
    echo "== ncu: the persistent decode kernel's stalls by SASS line ($mode)"
    f=$(smol_file)
    [ "$mode" = sampled ] && extra="--temperature 0.8 --top-k 40 --top-p 0.95 --seed 1"
    # shellcheck disable=SC2086 # extra is a list of arguments
    ncu_sass_stalls k_persist_decode "pd-$mode" 240 \
        "$BIN/akunu" bench -m "$f" --device cuda -p 0 -n 128 -r 1 --no-bandwidth $extra
}

# The streaming decode kernel's stalls by SASS line (as ncu-persist; its
# called functions, such as the Q4_0 form's norm, apart from the body):
# one launch of a 64-token chain, greedy, on each of NCU_STREAM_SHAPES
# (default llama-8b:q4_0).
ncu_stream_one() { # NAME FILE
    ncu_sass_stalls k_stream_decode "sd-$1" 400 \
        "$BIN/akunu" bench -m "$2" --device cuda -p 0 -n 64 -r 1 --no-bandwidth
}
ncu_stream() {
    echo "== ncu: the streaming decode kernel's stalls by SASS line"
    each_shape "${NCU_STREAM_SHAPES:-llama-8b:q4_0}" ncu_stream_one
}

# How the SM's instruction caches treat straight-line code of growing size
# (bench/cuda/icache_probe.cu, nvcc): cycles of each of five passes.
icache() {
    echo "== instruction-cache probe (nvcc)"
    rm -f "$STORE/icache-probe"
    nvcc -O3 -arch=sm_90 -o "$STORE/icache-probe" bench/cuda/icache_probe.cu 2>&1 | grep -i error || true
    if [ -x "$STORE/icache-probe" ]; then
        "$STORE/icache-probe" | tee "$OUTDIR/icache.txt"
    else
        echo "icache probe: the build failed"
    fi
}

# Whether a device function's address reads as data (bench/cuda/
# code_addr_probe.cu, nvcc): the pointer, then a load from it and an L2
# prefetch of it, each in a process of its own (a fault ends the process).
code_addr() {
    echo "== code-address probe (nvcc)"
    rm -f "$STORE/code-addr-probe"
    nvcc -O3 -arch=sm_90 -o "$STORE/code-addr-probe" bench/cuda/code_addr_probe.cu 2>&1 | grep -i error || true
    if [ -x "$STORE/code-addr-probe" ]; then
        local m
        for m in pointer read prefetch; do
            "$STORE/code-addr-probe" "$m" 2>&1 | sed "s/^/$m: /" | tee -a "$OUTDIR/code-addr.txt" || true
        done
    else
        echo "code-address probe: the build failed"
    fi
}

# The decode gemv kernels alone (bench/cuda/gemv_probe.cu, built here with
# nvcc; no .gpu needed): for each of $PROBE_DEFINES (space-separated, each a
# comma-separated list of -D options, "-" for none) the register form on
# every shape of $PROBE_TYPE (Q4_0 or F16; default Q4_0), then the 8B FFN
# down shape with its activation staged. PROBE_S=1|2|4|8 forces the split;
# PROBE_NO_TCB=0 adds the bulk-copy form. E.g. PROBE_DEFINES="- -DTCG_L2PF=0".
probe() {
    echo "== gemv probe (nvcc, ${PROBE_TYPE:-Q4_0})"
    local d defs bin tag
    for d in ${PROBE_DEFINES:--}; do
        defs=""
        [ "$d" = "-" ] || defs=${d//,/ }
        tag=${d//[^A-Za-z0-9_]/_}
        bin=$STORE/gemv-probe-$tag
        # A failed build must not leave an earlier build of the same tag to run.
        rm -f "$bin"
        # shellcheck disable=SC2086 # defs is a list of -D options
        nvcc -O3 -std=c++17 -arch=sm_90 --expt-relaxed-constexpr $defs -o "$bin" bench/cuda/gemv_probe.cu 2>&1 |
            grep -i error || true
        echo "-- $d"
        if [ ! -x "$bin" ]; then
            echo "probe build failed for $d"
            continue
        fi
        PROBE_NO_TCB=${PROBE_NO_TCB:-1} "$bin" 1 "" "${PROBE_TYPE:-Q4_0}" | tee "$OUTDIR/probe-$tag.log" |
            grep -E "^(Q4_0|F16) |grid|MISMATCH" || true
        PROBE_ACT=1 PROBE_NO_TCB=${PROBE_NO_TCB:-1} "$bin" 1 "8b down" "${PROBE_TYPE:-Q4_0}" |
            grep -E "grid|MISMATCH" | sed 's/^/act-down /' || true
    done
}

# The persistent decode kernel of the SmolLM2 shape (bench/cuda/mega_probe.cu,
# built here with nvcc; no .gpu needed). MEGA_RUNS: space-separated runs,
# each WARPS:BLOCKS:TOKENS:POS:DEFINES:SOURCE ("-" or nothing for a default:
# 8 warps, every SM (0), 128 tokens, position 0, no defines, the probe's
# source; DEFINES are comma-separated, such as LL=1,ATT_L1=1; SOURCE is
# another version of the file, for A/B runs in one call).
mega() {
    echo "== persistent decode probe (nvcc)"
    local r w b t p d src bin tag built=" "
    for r in ${MEGA_RUNS:--}; do
        IFS=: read -r w b t p d src <<<"$r"
        [ "${w:--}" = "-" ] && w=8
        [ "${b:--}" = "-" ] && b=0
        [ "${t:--}" = "-" ] && t=128
        [ "${p:--}" = "-" ] && p=0
        [ "${d:--}" = "-" ] && d=""
        [ "${src:--}" = "-" ] && src=bench/cuda/mega_probe.cu
        tag=w$w${d:+-${d//[^A-Za-z0-9_]/_}}
        [ "$src" = bench/cuda/mega_probe.cu ] || tag=$tag-${src//[^A-Za-z0-9_]/_}
        bin=$STORE/mega-probe-$tag
        # Built once a call (a warm machine keeps an older source's binary).
        if [ "${built#* $tag }" = "$built" ]; then
            built="$built$tag "
            rm -f "$bin"
            local defs=(-DWARPS="$w") x
            for x in ${d//,/ }; do defs+=("-D$x"); done
            nvcc -O3 -std=c++17 -arch=sm_90 "${defs[@]}" -o "$bin" "$src" 2>&1 |
                grep -iE "error|warning" || true
        fi
        echo "-- warps $w, blocks $b (0: every SM), tokens $t, position $p, defines ${d:-none}, $src"
        if [ ! -x "$bin" ]; then
            echo "mega probe build failed ($tag)"
            continue
        fi
        "$bin" "$b" "$t" "$p" 2>&1 | tee "$OUTDIR/mega-$tag-b$b-t$t-p$p.log" || true
    done
}

# The streaming persistent decode kernel of the large F16 shapes
# (bench/cuda/stream_probe.cu, built here with nvcc; no .gpu needed).
# STREAM_RUNS: space-separated runs, each SHAPE:TOKENS:POS:DEFINES ("-" or
# nothing for a default: shape 1 (llama-1b f16; 8 for llama-8b f16), 128
# tokens, position 512, no defines; DEFINES are comma-separated, such as
# NST=4,ATT_S=2).
stream() {
    echo "== streaming persistent decode probe (nvcc)"
    local r sh t p d bin tag built=" "
    for r in ${STREAM_RUNS:--}; do
        IFS=: read -r sh t p d <<<"$r"
        [ "${sh:--}" = "-" ] && sh=1
        [ "${t:--}" = "-" ] && t=128
        [ "${p:--}" = "-" ] && p=512
        [ "${d:--}" = "-" ] && d=""
        tag=s$sh${d:+-${d//[^A-Za-z0-9_]/_}}
        bin=$STORE/stream-probe-$tag
        if [ "${built#* $tag }" = "$built" ]; then
            built="$built$tag "
            rm -f "$bin"
            local defs=(-DSHAPE="$sh") x
            for x in ${d//,/ }; do defs+=("-D$x"); done
            nvcc -O3 -std=c++17 -arch=sm_90 -Xcompiler -fopenmp -lgomp "${defs[@]}" -o "$bin" \
                bench/cuda/stream_probe.cu 2>&1 | grep -iE "error|warning" || true
        fi
        echo "-- shape $sh, tokens $t, position $p, defines ${d:-none}"
        if [ ! -x "$bin" ]; then
            echo "stream probe build failed ($tag)"
            continue
        fi
        OMP_NUM_THREADS=${OMP_NUM_THREADS:-16} timeout "${STREAM_TIMEOUT:-240}" "$bin" "$t" "$p" 2>&1 | tee "$OUTDIR/stream-$tag-t$t-p$p.log" || true
    done
}

pfattn() {
    echo "== prefill attention A/B: k_attn_prefill (AKUNU_CUDA_PF_ATTN=0), then k_attn_flash (synthetic llama-1b f16)"
    local f=$STORE/llama-1b-f16.gguf n v
    synth_file llama-1b f16 "$f"
    for n in 256 512 1024 2048; do
        for v in 0 1; do
            AKUNU_CUDA_PF_ATTN=$v "$BIN/akunu" bench -m "$f" --device cuda -p "$n" -n 1 -r 3 \
                --no-bandwidth 2>&1 | tee "$OUTDIR/pfattn-$v-1b-$n.log" | grep -E "pp$n|error" |
                sed "s/^/PF_ATTN=$v /" || true
        done
    done
    "$BIN/gpu-tests" --ignored --test-threads=1 --nocapture \
        prefill_attention_matches_cpu_on_every_head_width 2>&1 | tee "$OUTDIR/pfattn-tests.log" |
        grep -E "rel-L2|test result|panicked" || true
}

model_part() { # N
    cp ".gpu-part$1/model.part$1" "$STORE/model.part$1"
    cp ".gpu-part$1/model.sha256" "$STORE/model.sha256"
    echo "stored model part $1"
}

# Joins the carried parts into $MODEL once; fails when they are missing.
assemble_model() {
    if [ ! -f "$MODEL" ]; then
        if [ -f "$STORE/model.part1" ] && [ -f "$STORE/model.part2" ] && [ -f "$STORE/model.part3" ]; then
            cat "$STORE/model.part1" "$STORE/model.part2" "$STORE/model.part3" >"$MODEL"
        else
            echo "default model: parts missing (the machine was replaced between calls?)"
            return 1
        fi
    fi
    if [ "$(sha256sum "$MODEL" | cut -d' ' -f1)" != "$(cat "$STORE/model.sha256")" ]; then
        echo "default model: sha256 mismatch"
        rm -f "$MODEL"
        return 1
    fi
}

model() {
    assemble_model || return 0
    echo "== default model"
    AKUNU_TEST_MODEL=$MODEL "$BIN/gpu-tests" --ignored --test-threads=1 --nocapture logits_match_cpu_on_real_shapes 2>&1 |
        tee "$OUTDIR/tests-model.log" | grep -E "^test |rel-L2|result|panicked" || true
    bench_one default "$MODEL"
    bench_one default-sampled "$MODEL" --temperature 0.8 --top-k 40 --top-p 0.95 --seed 1
    if "$BIN/akunu" generate -m "$MODEL" --device cuda --chat -p "Write a haiku about the sea." -n 64 --json \
        >"$OUTDIR/generate.json" 2>"$OUTDIR/generate.err"; then
        python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
print("generate:", repr(d["text"][:200]))
s = d["stats"]
print("stats:", {k: s.get(k) for k in ("generated_tokens", "decode_tok_s", "stop_reason", "computed_after_end", "delivery_us")})' "$OUTDIR/generate.json"
    else
        tail -5 "$OUTDIR/generate.err"
    fi
    "$BIN/akunu" profile -m "$MODEL" --device cuda -n 64 2>&1 | tee "$OUTDIR/profile-default.log" | head -30
    echo "== default model, --prefill-products f16"
    bench_one default-f16 "$MODEL" --prefill-products f16
    # Greedy text after a long prompt (README.md's first 3,000 bytes: 600-odd
    # tokens, prefilled in cuBLAS steps) with exact and f16 prefill products.
    local mode
    head -c 3000 README.md >"$OUTDIR/prompt.txt"
    for mode in exact f16; do
        "$BIN/akunu" generate -m "$MODEL" --device cuda --prompt-file "$OUTDIR/prompt.txt" -n 96 --ignore-eos --json \
            --prefill-products $mode >"$OUTDIR/generate-$mode.json" 2>"$OUTDIR/generate-$mode.err" ||
            tail -3 "$OUTDIR/generate-$mode.err"
    done
    python3 -c '
import json, sys
d = [json.load(open(f)) for f in sys.argv[1:3]]
a, b = (x["generated_ids"] for x in d)
n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
np = len(d[0]["prompt_ids"])
print(f"prompt {np} tokens; prefill products exact vs f16: " + ("the same 96 greedy tokens" if a == b else f"greedy tokens differ from token {n} of {len(a)}"))
print("exact:", repr(d[0]["text"][:160]))
print("f16:  ", repr(d[1]["text"][:160]))' "$OUTDIR/generate-exact.json" "$OUTDIR/generate-f16.json" || true
}

case "${1:-}" in
build) build ;;
build-base) build_base "${2:-HEAD}" ;;
split-model) split_model ;;
run)
    shift
    setup
    for what in "$@"; do
        case $what in
        tests) tests ;;
        sanitize) sanitize ;;
        sanitize-sampled) sanitize_sampled ;;
        sanitize-persist) sanitize_persist ;;
        bench) bench ;;
        bench-ab) bench_ab ;;
        stream-ab) stream_ab ;;
        env-ab) env_ab ;;
        peer-torch) peer_torch ;;
        ncu) ncu_gemv ;;
        ncu-token) ncu_token ;;
        ncu-prefill) ncu_prefill ;;
        ab) ab ;;
        tcg-ab) tcg_ab ;;
        tcg-split) tcg_split ;;
        engine-tests) engine_tests ;;
        sampled) sampled ;;
        sampled-ab) sampled_ab ;;
        persist) persist ;;
        persist-model) persist_model ;;
        model-sampled) model_sampled ;;
        persist-blocks) persist_blocks ;;
        base-ab) base_ab ;;
        base-pp) base_pp ;;
        persist-timing) persist_timing ;;
        persist-clock) persist_clock ;;
        pd-ab) pd_ab ;;
        profile) profile ;;
        profile-big) profile_big ;;
        trace) trace ;;
        features) features ;;
        model-part[123]) model_part "${what#model-part}" ;;
        model) model ;;
        sampler) sampler ;;
        attn) attn ;;
        prefill) prefill ;;
        spec-ab) spec_ab ;;
        pfattn) pfattn ;;
        probe) probe ;;
        icache) icache ;;
        code-addr) code_addr ;;
        ncu-persist) ncu_persist ;;
        ncu-stream) ncu_stream ;;
        mega) mega ;;
        stream) stream ;;
        stream-clock) stream_clock ;;
        stream-blocks) stream_blocks ;;
        *)
            echo "unknown step $what" >&2
            exit 2
            ;;
        esac
    done
    ;;
*)
    sed -n '2,/a summary to stdout/p' "$0"
    exit 2
    ;;
esac
