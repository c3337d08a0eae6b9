#!/usr/bin/env bash
# Prepares .devrun/ (git-ignored) for scripts/device_check.sh, on this machine, after `make native`:
#   src.tar.xz           the patched llama.cpp tree of the current build key (without docs, models, media)
#   *.whl                gguf and diskcache, the pure-Python dependencies the GPU machine lacks
#   llama_cpp/           llama-cpp-python's package (the ctypes bindings; the libraries come from the build)
#   tiny-f32.gguf, demo-f32.gguf, stock-tiny-f32.gguf
#                        the parity probe's small models, made here (the stock twin needs the vendored converter)
# Then run the device check with `carry: [".devrun"]`.
set -euo pipefail
cd "$(dirname "$0")/.."
R=$PWD
PY=$R/.venv/bin/python
KEY=$(scripts/build_native.sh --key | sed -n 's/^key=//p')
SRC=$HOME/.cache/clover/build/$KEY/src
[[ -d $SRC ]] || { echo "error: no patched tree for build key $KEY (run make native)" >&2; exit 2; }
rm -rf .devrun && mkdir -p .devrun
tar -C "$SRC" --exclude=./docs --exclude=./models --exclude=./media --exclude=./benches --exclude=./examples \
    --exclude=./.git -cJf .devrun/src.tar.xz .
"$PY" -m pip download -q --no-deps -d .devrun "gguf==$("$PY" -c 'import importlib.metadata as m; print(m.version("gguf"))')" \
    "diskcache==$("$PY" -c 'import importlib.metadata as m; print(m.version("diskcache"))')"
cp -r "$("$PY" -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("llama_cpp").origin))')" .devrun/llama_cpp
rm -rf .devrun/llama_cpp/lib .devrun/llama_cpp/__pycache__
"$PY" - <<'PY'
from pathlib import Path

from clover_ref.factory import init_checkpoint
from clover_dev.convert import clover_convert, make_qwen_twin, vendored_convert

work = Path("build/devrun-models")
if not (work / "tiny" / "config.json").exists():
    init_checkpoint(work / "tiny", "tiny", seed=0)  # the test fixture's checkpoint (tests/conftest.py)
out = Path(".devrun")
clover_convert(work / "tiny", out / "tiny-f32.gguf", "f32")
clover_convert(Path("models/clover-demo"), out / "demo-f32.gguf", "f32")
twin = work / "stock-tiny"
if not twin.exists():
    make_qwen_twin(work / "tiny", twin)
vendored_convert(twin, out / "stock-tiny-f32.gguf", "f32")
PY
du -sh .devrun; ls -la .devrun
