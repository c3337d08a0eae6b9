#!/usr/bin/env bash
# Build the (patched) vendored llama.cpp of llama-cpp-python 0.3.36.
#
#   scripts/build_native.sh                 # CPU build of $TARGETS
#   GPU=cuda scripts/build_native.sh        # adds -DGGML_CUDA=ON
#   scripts/build_native.sh --key           # print the build key, CPU target and features; build nothing
#   PORTABLE=1 scripts/build_native.sh      # a build for other CPUs (wheels): llama.cpp's release recipe
#
# Inputs (all optional):
#   cpp_patch/patches/NNNN-*.patch   the patch series: `patch -p1` diffs against vendor/llama.cpp (paths like
#                            a/src/llama-arch.cpp), one concern each, applied first in name order, each after a
#                            --dry-run check on the tree the previous ones made (scripts/patch_series.py maintains
#                            them; docs/native.md, "Changing a patch").
#   cpp_patch/<dir>/...      every other sub-folder of cpp_patch/ mirrors vendor/llama.cpp/ and is copied over it
#                            after the patches (new files such as cpp_patch/src/models/clover.cpp).
#                            Top-level files of cpp_patch/ (SDIST_SHA256, notes) are not copied.
# Environment:
#   CLOVER_CACHE (~/.cache/clover)  sdist cache and build folders, outside the clone
#   GPU=cpu|cuda, TARGETS ("llama llama-quantize clover llama-clover" and llama.cpp's own tools, see below), JOBS (nproc), EXTRA_CMAKE_FLAGS (word-split),
#   KEEP_BUILDS (4; older build folders are deleted, 0 keeps all)
#   PORTABLE=1   GGML_NATIVE=OFF, GGML_BACKEND_DL=ON, GGML_CPU_ALL_VARIANTS=ON: one ggml-cpu module per x86 level,
#                the best one for the CPU chosen at run time (what `pip install .` builds; -march=native stays the
#                default for a developer's own build)
#   CMAKE_ARGS   extra CMake flags, as llama-cpp-python reads them (CMAKE_ARGS="-DGGML_CUDA=on" pip install .)
#   CLOVER_NATIVE_OUT (build/native)  where lib/, bin/ and BUILD_INFO are published
#   PYTHON (python3)  runs scripts/llama_sdist.py (setup.py passes its own interpreter)
#
# Each build lives in $CLOVER_CACHE/build/<key>/{src,build}; key = sha256 of every cpp_patch file, the
# CMake flags and what -march=native resolves to on this CPU, so an unchanged patch on the same CPU reuses its
# build (a no-op rebuild is a Ninja no-op). ccache is used when installed (this script never installs it:
# `apt-get install -y ccache`); CCACHE_BASEDIR makes hits work across keys, and CCACHE_EXTRAFILES keeps them
# within one CPU target. Results are linked into build/native/{lib,bin}; build/native/BUILD_INFO records the
# key, flags, CPU target and features, and timing.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${CLOVER_CACHE:-$HOME/.cache/clover}
PATCH_DIR=$ROOT/cpp_patch
SERIES_DIR=$PATCH_DIR/patches
OUT=${CLOVER_NATIVE_OUT:-$ROOT/build/native}
GPU=${GPU:-cpu}
# llama.cpp's own tools from the patched tree (docs/llama-cpp-tools.md says what each does with a clover
# GGUF) and the RPC server for multi-machine offload (docs/distributed.md; this tree names it ggml-rpc-server,
# publish() links it as rpc-server too, the name llama.cpp's docs use). llama-speculative-simple is the
# speculative framework's reference loop (docs/decoding.md, "draft-clover in llama.cpp").
TOOL_TARGETS="llama-server llama-cli llama-bench llama-perplexity ggml-rpc-server llama-speculative-simple"
TARGETS=${TARGETS:-llama llama-quantize clover llama-clover $TOOL_TARGETS}
JOBS=${JOBS:-$(nproc)}
KEEP_BUILDS=${KEEP_BUILDS:-4}

# llama-quantize lives in tools/ and links llama-common, hence COMMON=ON and TOOLS=ON.
# LLAMA_CURL is deprecated in this version (only a warning); LLAMA_OPENSSL replaces it.
# SERVER=ON adds llama-server and llama-cli (which is built on the server's code); the web UI is neither built
# (npm) nor downloaded (LLAMA_USE_PREBUILT_UI fetches it from the HF hub at build time), so the server answers
# the API only. GGML_RPC=ON adds the RPC backend (ggml-rpc) to libggml and the rpc-server tool. EXAMPLES=ON
# only defines the examples' targets: TARGETS says which are built.
CMAKE_FLAGS=(
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON
    -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_RPC=ON
)
if [[ ${PORTABLE:-0} == 1 ]]; then
    # RUNPATH $ORIGIN instead of the build folder's absolute path: the libraries and tools move into a wheel
    CMAKE_FLAGS+=(-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON)
fi
case $GPU in
    cpu) ;;
    cuda) CMAKE_FLAGS+=(-DGGML_CUDA=ON) ;;
    *) echo "error: GPU must be cpu or cuda, got '$GPU'" >&2; exit 2 ;;
esac
# shellcheck disable=SC2206  # word splitting is intended
CMAKE_FLAGS+=(${EXTRA_CMAKE_FLAGS:-} ${CMAKE_ARGS:-})

# -DGGML_NATIVE=ON compiles for the build machine's CPU (-march=native), but neither the CMake flags nor
# ccache's hash say which CPU that was (ccache issue 824), so a build folder or a ccache reused on another CPU
# could crash with SIGILL there. The build key, ccache's hash (CCACHE_EXTRAFILES) and BUILD_INFO therefore
# carry what the compiler resolves -march=native to on this machine.
native_build() {  # the last GGML_NATIVE setting wins, as in CMake; ggml's default is ON
    local f native=ON
    for f in "${CMAKE_FLAGS[@]}"; do
        [[ $f == -DGGML_NATIVE=* ]] && native=${f#-DGGML_NATIVE=}
    done
    [[ ${native^^} == ON || ${native^^} == 1 || ${native^^} == TRUE ]]
}

cpu_target() {  # the compiler's expansion of -march=native (ISA flags and tuning), or "portable"
    if ! native_build; then
        echo "portable (GGML_NATIVE off: the ISA comes from the CMake flags)"
        return
    fi
    local out
    out=$("${CC:-cc}" -march=native -E -v - </dev/null 2>&1)
    sed -n '/ -march=/{s/.* -march=/-march=/;s/ -dumpbase.*//;p;q}' <<<"$out"
}

# The ggml-relevant ISA extensions the native build compiles for, named as /proc/cpuinfo names them.
CPU_FEATURE_MACROS=(SSE4_2:sse4_2 AVX:avx AVX2:avx2 FMA:fma F16C:f16c BMI2:bmi2 AVXVNNI:avx_vnni
    AVX512F:avx512f AVX512BW:avx512bw AVX512VL:avx512vl AVX512DQ:avx512dq AVX512VBMI:avx512vbmi
    AVX512VNNI:avx512_vnni AVX512BF16:avx512_bf16 AMX_TILE:amx_tile AMX_INT8:amx_int8 AMX_BF16:amx_bf16)

cpu_features() {
    native_build || { echo "(set by the CMake flags)"; return; }
    local macros pair out=()
    macros=$(echo | "${CC:-cc}" -march=native -dM -E - 2>/dev/null)
    for pair in "${CPU_FEATURE_MACROS[@]}"; do
        grep -q "#define __${pair%%:*}__ " <<<"$macros" && out+=("${pair#*:}")
    done
    echo "${out[*]}"
}

build_key() {
    {
        (cd "$PATCH_DIR" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum)
        printf '%s\n' "${CMAKE_FLAGS[@]}"
        cpu_target
    } | sha256sum | cut -c1-16
}

# $1 = a patch of the series, $2 = the tree the previous patches made; --dry-run writes nothing, so a patch that
# does not apply leaves the tree as it was and is named with its rejected hunks
check_patch() {
    local log name=${1#"$ROOT"/}
    if ! log=$(patch -p1 --forward --fuzz=0 --dry-run -d "$2" -i "$1" 2>&1); then
        echo "$log" >&2
        echo "error: $name does not apply to the vendored tree with the patches before it; rejected hunks:" >&2
        echo "$log" | awk '/^checking file /{f=$3} /FAILED|Reversed|No file to patch|malformed/{print "  " f ": " $0}' >&2
        return 1
    fi
}

apply_series() {  # $1 = source tree: each patch in order, each checked first
    local p
    for p in "$SERIES_DIR"/*.patch; do
        [[ -f $p ]] || continue
        check_patch "$p" "$1" || return 1
        patch -p1 --forward --fuzz=0 --no-backup-if-mismatch --quiet -d "$1" -i "$p"
    done
}

overlay() {  # $1 = source tree
    local d
    for d in "$PATCH_DIR"/*/; do
        [[ -d $d && $d != "$SERIES_DIR/" ]] && cp -r "$d" "$1/"
    done
    return 0
}

prepare_source() {  # $1 = vendored tree, $2 = key dir
    [[ -f $2/.src-ready ]] && return 0
    rm -rf "$2/src" "$2/build"
    mkdir -p "$2"
    cp -a "$1" "$2/src"
    if ! apply_series "$2/src"; then
        rm -rf "$2/src"
        exit 1
    fi
    overlay "$2/src"
    touch "$2/.src-ready"
}

publish() {  # $1 = cmake build dir; links libs and tool binaries into build/native
    rm -rf "$OUT"
    mkdir -p "$OUT/lib" "$OUT/bin"
    find "$1/bin" -maxdepth 1 -name '*.so*' -exec ln -s {} "$OUT/lib/" \;
    find "$1/bin" -maxdepth 1 -type f -perm -u+x ! -name '*.so*' -exec ln -s {} "$OUT/bin/" \;
    if [[ -e $1/bin/ggml-rpc-server ]]; then
        ln -s "$1/bin/ggml-rpc-server" "$OUT/bin/rpc-server"
    fi
}

prune() {  # keep the $KEEP_BUILDS most recently used build folders
    [[ $KEEP_BUILDS -gt 0 ]] || return 0
    find "$CACHE/build" -mindepth 1 -maxdepth 1 -type d -printf '%T@ %p\n' | sort -rn |
        tail -n +$((KEEP_BUILDS + 1)) | cut -d' ' -f2- | xargs -r rm -rf
}

print_key() {
    printf 'key=%s\ncpu_target=%s\ncpu_features=%s\n' "$(build_key)" "$(cpu_target)" "$(cpu_features)"
}

main() {
    local sdist key keydir bld target features launcher=()
    if [[ ${1:-} == --key ]]; then
        print_key
        return
    fi
    sdist=$("${PYTHON:-python3}" "$ROOT/scripts/llama_sdist.py" unpack)
    key=$(build_key)
    keydir=$CACHE/build/$key
    bld=$keydir/build
    target=$(cpu_target)
    features=$(cpu_features)
    echo "build_native: key $key ($GPU), $keydir" >&2
    echo "build_native: CPU features the build uses: ${features:-none beyond x86-64}" >&2

    prepare_source "$sdist/vendor/llama.cpp" "$keydir"
    touch "$keydir"
    echo "$target" >"$keydir/cpu-target"
    if command -v ccache >/dev/null; then
        launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
        [[ $GPU == cuda ]] && launcher+=(-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
        export CCACHE_BASEDIR=$CACHE/build
        export CCACHE_EXTRAFILES=$keydir/cpu-target  # -march=native's meaning, which ccache does not hash
    fi
    [[ -f $bld/build.ninja ]] || cmake -S "$keydir/src" -B "$bld" -G Ninja "${CMAKE_FLAGS[@]}" "${launcher[@]}"
    # shellcheck disable=SC2086  # TARGETS is a space-separated list
    cmake --build "$bld" -j "$JOBS" --target $TARGETS

    publish "$bld"
    cat >"$OUT/BUILD_INFO" <<EOF
key=$key
gpu=$GPU
flags=${CMAKE_FLAGS[*]}
launcher=${launcher[*]}
targets=$TARGETS
cpu_target=$target
cpu_features=$features
build_dir=$bld
sdist=$sdist
seconds=$SECONDS
date=$(date -u +%FT%TZ)
EOF
    prune
    echo "build_native: done in ${SECONDS}s -> $OUT" >&2
}

main "$@"
