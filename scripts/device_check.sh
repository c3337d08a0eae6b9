#!/usr/bin/env bash
# GPU device check (used on an H200, 2026-11-29; results in bench/results/cuda_tests.md and bench_engine_cuda.md).
# Prepare .devrun/ in the repo root (git-ignored) first: src.tar.xz = the patched source tree of the current
# build key (~/.cache/clover/build/<key>/src without docs/models/benches/tests/examples), the gguf and diskcache
# wheels, and a copy of llama-cpp-python's llama_cpp/ package; then run `bash scripts/device_check.sh` there with
# $OUT set. It builds with CUDA (FA kernels off to fit the time), runs the native parity tests with every layer
# offloaded, and the engine benchmark.
set -u
cd "$(dirname "$0")/.."
R=$PWD
exec > >(tee "$OUT/run.log") 2>&1
export PATH=$PATH:/usr/local/cuda/bin
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; python3 -c "import torch; print('torch', torch.__version__)"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .devrun/*.whl || exit 2
mkdir -p /tmp/pkgs
ln -sfn "$R/reference" /tmp/pkgs/clover_ref; ln -sfn "$R/convert" /tmp/pkgs/clover_convert
ln -sfn "$R/quantize" /tmp/pkgs/clover_quantize; ln -sfn "$R/clover_cpp" /tmp/pkgs/clover_cpp
ln -sfn "$R/.devrun/llama_cpp" /tmp/pkgs/llama_cpp
export PYTHONPATH=/tmp/site:/tmp/pkgs
PY3=$(python3 -c "import sys; print(sys.executable)")
mkdir -p .venv/bin && rm -f .venv/bin/python && printf '#!/bin/sh\nexec %s "$@"\n' "$PY3" > .venv/bin/python && chmod +x .venv/bin/python
if [[ ! -e /tmp/b/bin/libclover.so ]]; then
mkdir -p /tmp/src && tar -xJf .devrun/src.tar.xz -C /tmp/src
cmake -S /tmp/src -B /tmp/b -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON \
  -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
  -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 4; }
t configured
timeout "${BUILD_LIMIT:-300}" cmake --build /tmp/b -j "$(nproc)" --target llama clover llama-clover llama-quantize > "$OUT/build.log" 2>&1
rc=$?; t "build rc=$rc"; [[ $rc == 0 ]] || { tail -20 "$OUT/build.log"; exit 5; }
fi
mkdir -p /tmp/nat/lib /tmp/nat/bin
ln -sf /tmp/b/bin/*.so* /tmp/nat/lib/; ln -sf /tmp/b/bin/llama-quantize /tmp/b/bin/llama-clover /tmp/nat/bin/
export CLOVER_NATIVE_LIB=/tmp/nat/lib CLOVER_REQUIRE_NATIVE=1 CLOVER_N_GPU_LAYERS=99 CLOVER_NATIVE_QUIET=1 PYTHONUNBUFFERED=1
python3 - <<'PY'
import re, subprocess, sys
from pathlib import Path
from clover_cpp import native, engine
print("native", native.native_available(), "engine", engine.available())
from clover_ref.factory import init_checkpoint
init_checkpoint(Path("/tmp/tiny"), "tiny", seed=0)
subprocess.run([sys.executable, "-m", "clover_convert", "/tmp/tiny", "/tmp/tiny.gguf", "--outtype", "f32"], check=True)
lines = []
with native.log_listener(lambda lvl, txt: lines.append(txt)):
    from clover_cpp import Model
    with Model("/tmp/tiny.gguf", n_ctx=256) as m:
        r = m.run(m.tokenize("def f(x):"), mode="diffusion", max_tokens=16)
print("\n".join(l for l in lines if re.search(r"offload|CUDA0|using device", l))[:1500])
print("diffusion on GPU:", r.tokens, r.stats.to_dict())
PY
timeout "${TEST_LIMIT:-170}" python3 -m pytest -q -p no:cacheprovider tests/test_native_clover.py tests/test_engine.py \
  -k "not stock_qwen35moe and not reference_parity_mid and not prefix_consistency_mid" --durations=8 -W ignore \
  > "$OUT/tests.log" 2>&1
t "tests rc=$?"; tail -45 "$OUT/tests.log"
cp build/native-parity.json "$OUT/native-parity-cuda.json" 2>/dev/null
grep -h "offloaded\|CUDA0 model buffer" "$OUT/tests.log" | head -3
timeout "${BENCH_LIMIT:-120}" python3 bench/bench_engine.py --n-gpu-layers 99 --skip-stock --skip-reference \
  --threads 16 --name bench_engine_cuda --workdir /tmp/be > "$OUT/bench.log" 2>&1
t "bench rc=$?"; tail -30 "$OUT/bench.log"
cp bench/results/bench_engine_cuda.* "$OUT/" 2>/dev/null
t done
