#!/usr/bin/env bash
# The GPU check: one CUDA build (flash attention compiled in), then the measurements in priority order, each
# result written to $OUT as it comes, so that a run cut short still reports what it reached.
#
#   here:        make native && bash scripts/device_prepare.sh          (fills .devrun/, git-ignored)
#   GPU machine: bash scripts/device_check.sh                            (run tool: carry [".devrun"])
#   CPU dry run: DEVICE_CHECK_CPU=1 OUT=/tmp/dc bash scripts/device_check.sh   (same steps, no CUDA)
#   one step on this machine's build, in the project's venv (tests/native/test_device_check.py, in CI):
#                DEVICE_CHECK_CPU=1 DEVICE_CHECK_NATIVE=build/native DEVICE_CHECK_STEPS=draft-clover OUT=/tmp/dc \
#                bash scripts/device_check.sh
# DEVICE_CHECK_STEPS (default: all) names the steps to run: parity ops tests bench draft-clover.
#
# What it discriminates (docs/native.md, "CUDA parity"):
#  1. parity probe, GPU against the CPU backend of the same build (bench/cuda_parity.py), per environment:
#     default; GGML_CUDA_DISABLE_TF32=1 (our patch: no TF32 in cuBLAS and no F32 mmf tiles, which feed TF32
#     MMA whatever NVIDIA_TF32_OVERRIDE says); NVIDIA_TF32_OVERRIDE=0 + GGML_CUDA_CUBLAS_COMPUTE_TYPE=f32
#     (cuBLAS only); both; GGML_CUDA_PDL=0; flash attention on; the default again (hashes must repeat).
#     Models: tiny, the stock qwen35moe twin of tiny (the yardstick), the trained demo model (with engine
#     tokens), and mid.
#  2. test-backend-ops on CUDA0 for the ops of the recurrent layers.
#  3. the native parity tests under strict FP32 (tests/native/test_native_clover.py, tests/engine/test_engine.py).
#  4. the engine benchmark (block pass against AR step inside the engine's loops).
#  5. draft-clover in llama-server (bench/bench_spec_server.py --quick): each --spec-type and the engine side by side,
#     and a block pass in ar steps.
set -u
cd "$(dirname "$0")/.."
R=$PWD
OUT=${OUT:?set OUT}
CPU_ONLY=${DEVICE_CHECK_CPU:-0}
exec > >(tee "$OUT/run.log") 2>&1
export PATH=$PATH:/usr/local/cuda/bin
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { echo $(( ${TOTAL_LIMIT:-290} - ($(date +%s) - T0) )); }
NOT_DONE=()  # the steps asked for that failed or found no time: the last line names them, and the exit status is 1
record() { t "$1 rc=$2"; [[ $2 == 0 ]] || NOT_DONE+=("$1"); }
no_time() { t "skip $1 (time)"; NOT_DONE+=("$1 (no time)"); }
[[ $CPU_ONLY == 1 ]] || nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "cpus $(nproc)"

STEPS=" ${DEVICE_CHECK_STEPS:-parity ops tests bench draft-clover} "
step() { [[ $STEPS == *" $1 "* ]]; }
# seconds kept for the last step, draft-clover in llama-server, which steps 3 and 4 must not eat
reserve() { step draft-clover && echo 90 || echo 0; }
NATIVE=${DEVICE_CHECK_NATIVE:-}  # a published build (lib/, bin/; build/native): no build, the project's venv

if [[ -n $NATIVE ]]; then
    export CLOVER_NATIVE_LIB=$(cd "$NATIVE" && pwd)/lib PYTHONUNBUFFERED=1
    export PATH=$R/.venv/bin:$PATH
else
# -- python environment: the project's packages (the repository's top-level folders) plus the wheels in .devrun
python3 -m pip install -q --no-index --no-deps --target /tmp/site .devrun/*.whl || exit 2
mkdir -p /tmp/pkgs
ln -sfn "$R/.devrun/llama_cpp" /tmp/pkgs/llama_cpp
export PYTHONPATH=/tmp/site:/tmp/pkgs:$R PYTHONUNBUFFERED=1
PY3=$(python3 -c "import sys; print(sys.executable)")
mkdir -p .venv/bin && rm -f .venv/bin/python && printf '#!/bin/sh\nexec %s "$@"\n' "$PY3" > .venv/bin/python && chmod +x .venv/bin/python

# -- 0. build: libllama, libclover, llama-clover, llama-quantize (the benchmark quantizes), llama-server
#       (draft-clover), test-backend-ops
B=/tmp/b
if [[ ! -e $B/bin/libclover.so ]]; then
    mkdir -p /tmp/src && tar -xJf .devrun/src.tar.xz -C /tmp/src
    GPU_FLAGS=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=ON)
    [[ $CPU_ONLY == 1 ]] && GPU_FLAGS=()
    cmake -S /tmp/src -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON \
        -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF "${GPU_FLAGS[@]}" \
        > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 4; }
    t configured
    timeout "${BUILD_LIMIT:-200}" cmake --build $B -j "$(nproc)" --target llama clover llama-clover llama-quantize llama-server test-backend-ops \
        > "$OUT/build.log" 2>&1
    rc=$?; t "build rc=$rc"; [[ $rc == 0 ]] || { tail -20 "$OUT/build.log"; exit 5; }
fi
mkdir -p /tmp/nat/lib /tmp/nat/bin
ln -sf $B/bin/*.so* /tmp/nat/lib/; ln -sf $B/bin/llama-clover $B/bin/llama-quantize $B/bin/llama-server /tmp/nat/bin/
export CLOVER_NATIVE_LIB=/tmp/nat/lib
fi
export CLOVER_REQUIRE_NATIVE=1 CLOVER_NATIVE_QUIET=1

# -- models: the shipped small ones, mid made here (too large to carry)
M=/tmp/models; mkdir -p $M
if step parity; then
cp .devrun/*.gguf $M/
python3 - <<'PY' || exit 6
import subprocess, sys
from pathlib import Path
from clover_ref.factory import init_checkpoint
if not Path("/tmp/models/mid-f32.gguf").exists():
    init_checkpoint(Path("/tmp/models/mid"), "mid", seed=0)
    subprocess.run([sys.executable, "-m", "clover_convert", "/tmp/models/mid", "/tmp/models/mid-f32.gguf",
                    "--outtype", "f32"], check=True, stdout=subprocess.DEVNULL)
PY
t "models ready"
fi

# -- 1. parity probe, in priority order
NGL=99; [[ $CPU_ONLY == 1 ]] && NGL=0
P=$OUT/parity; mkdir -p $P
probe() {  # probe LABEL GGUF [ENV=V ...] [-- extra args]
    step parity || return 0
    local label=$1 gguf=$2; shift 2
    local envs=() extra=()
    while [[ $# -gt 0 && $1 != -- ]]; do envs+=("$1"); shift; done
    [[ ${1:-} == -- ]] && { shift; extra=("$@"); }
    (( $(left) > 20 )) || { t "skip $label $gguf (time)"; return; }
    env "${envs[@]}" timeout 120 python3 -m bench.cuda_parity "$M/$gguf" --label "$label" --out "$P" \
        --n-gpu-layers $NGL "${extra[@]}" || t "probe $label $gguf rc=$?"
}
STRICT=(GGML_CUDA_DISABLE_TF32=1 GGML_CUDA_CUBLAS_COMPUTE_TYPE=f32)
probe default tiny-f32.gguf
probe strict tiny-f32.gguf "${STRICT[@]}"
probe default stock-tiny-f32.gguf
probe strict stock-tiny-f32.gguf "${STRICT[@]}"
probe default demo-f32.gguf -- --engine
probe strict demo-f32.gguf "${STRICT[@]}" -- --engine
probe default mid-f32.gguf
probe strict mid-f32.gguf "${STRICT[@]}"
probe no-tf32 tiny-f32.gguf GGML_CUDA_DISABLE_TF32=1
probe cublas-f32 tiny-f32.gguf NVIDIA_TF32_OVERRIDE=0 GGML_CUDA_CUBLAS_COMPUTE_TYPE=f32
probe pdl0 tiny-f32.gguf GGML_CUDA_PDL=0
probe fa-on tiny-f32.gguf -- --flash-attn on
probe strict-fa-on mid-f32.gguf "${STRICT[@]}" -- --flash-attn on
probe default-again tiny-f32.gguf
step parity && t "parity probe done"

# -- 2. backend ops
if step ops && (( $(left) > 30 )) && [[ $CPU_ONLY != 1 ]]; then
    for op in GATED_DELTA_NET SSM_CONV RMS_NORM L2_NORM CONCAT GET_ROWS CPY; do
        timeout 30 $B/bin/test-backend-ops -o $op -b CUDA0 > "$OUT/backend-ops-$op.log" 2>&1
        rc=$?
        echo "test-backend-ops $op rc=$rc $(grep -E '[0-9]+/[0-9]+ tests passed' "$OUT/backend-ops-$op.log" | tail -1)"
        [[ $rc == 0 ]] || NOT_DONE+=("ops $op")
    done
elif step ops && [[ $CPU_ONLY != 1 ]]; then
    no_time ops
fi

# -- 3. native parity tests under strict FP32, then as shipped
if step tests && (( $(left) - $(reserve) > 60 )); then
    env "${STRICT[@]}" CLOVER_N_GPU_LAYERS=$NGL timeout $(( $(left) - $(reserve) - 45 )) python3 -m pytest -q -p no:cacheprovider \
        -o addopts="" tests/native/test_native_clover.py tests/engine/test_engine.py -k "not stock_qwen35moe and not mid" -W ignore \
        > "$OUT/tests-strict.log" 2>&1
    record "tests (strict)" $?; tail -25 "$OUT/tests-strict.log"
elif step tests; then
    no_time tests
fi

# -- 4. engine benchmark
if step bench && (( $(left) - $(reserve) > 30 )); then
    timeout $(( $(left) - $(reserve) - 5 )) python3 -m bench.bench_engine --n-gpu-layers $NGL --skip-stock --skip-reference \
        --threads "$(nproc)" --name bench_engine_cuda --workdir /tmp/be > "$OUT/bench.log" 2>&1
    record bench $?; tail -30 "$OUT/bench.log"
    cp bench/results/bench_engine_cuda.* "$OUT/" 2>/dev/null
elif step bench; then
    no_time bench
fi
# -- 5. draft-clover in llama-server: every --spec-type and the engine, and a block pass in ar steps
if step draft-clover && (( $(left) > 30 )); then
    timeout $(( $(left) - 5 )) python3 -m bench.bench_spec_server --quick --n-gpu-layers $NGL \
        --stem bench_spec_server_device --workdir "${DEVICE_CHECK_WORK:-/tmp/bs}" --results "$OUT" > "$OUT/spec.log" 2>&1
    record draft-clover $?; tail -30 "$OUT/spec.log"
elif step draft-clover; then
    no_time draft-clover
fi
if (( ${#NOT_DONE[@]} )); then
    t "done; not done: ${NOT_DONE[*]}"
    exit 1
fi
t done
