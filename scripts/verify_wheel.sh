#!/usr/bin/env bash
# Install a wheel of this project into a fresh venv and run the base commands on the demo model, as a user
# would after `pip install .` (docs/install.md, "What was run here"). The steps of tests/surfaces/test_wheel.py, by hand,
# for a wheel built beforehand:
#
#   python3 -m pip wheel --no-deps -w /tmp/wheels .      # about 40 minutes cold on 2 cores
#   scripts/verify_wheel.sh /tmp/wheels/clover_toolkit-*.whl [WORKDIR]
#
# The last check compares with this checkout's engine, so run `make setup` first.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WHEEL=$(realpath "${1:?usage: scripts/verify_wheel.sh WHEEL [WORKDIR]}")
T=${2:-$(mktemp -d)}
PROMPT="def fibonacci(n):"
mkdir -p "$T" && cd "$T" && rm -rf venv
unset PYTHONPATH LLAMA_CPP_LIB_PATH CLOVER_NATIVE_LIB VIRTUAL_ENV

python3 -m venv venv
t0=$(date +%s)
venv/bin/python -m pip install -q "$WHEEL"
echo "install: $(($(date +%s) - t0)) s; venv $(du -sm venv | cut -f1) MB"
if venv/bin/python -c "import torch" 2>/dev/null; then echo "error: the base install pulled in torch" >&2; exit 1; fi

venv/bin/clover-convert "$ROOT/models/clover-demo" demo-f16.gguf --outtype f16 >/dev/null
venv/bin/clover-quantize demo-f16.gguf demo-q4.gguf Q4_K_M >/dev/null
venv/bin/clover-convert "$ROOT/models/clover-demo" demo-q4-onepass.gguf --outtype Q4_K_M >/dev/null
venv/bin/clover-cpp generate -m demo-f16.gguf -p "$PROMPT" --mode ar -n 12 --json > wheel.json
venv/bin/clover-cpp generate -m demo-q4-onepass.gguf -p "$PROMPT" --mode auto -n 24 >/dev/null

venv/bin/python - "$PROMPT" <<'PY'
import json, pathlib, sys
import llama_cpp
import clover_native.loader as loader
lib = pathlib.Path(llama_cpp.llama_cpp._base_path).resolve()
assert loader.lib_dir().resolve() == lib, (loader.lib_dir(), lib)
print("libraries:", lib)
print("cpu variants:", len(list(lib.glob("libggml-cpu-*.so"))))
llm = llama_cpp.Llama(model_path="demo-f16.gguf", n_ctx=256, verbose=False)
text = llm.create_completion(sys.argv[1], max_tokens=12, temperature=0.0)["choices"][0]["text"]
ours = json.load(open("wheel.json"))["text"]
print("llama_cpp.Llama == clover-cpp ar:", text == ours)
assert text == ours, (text, ours)
PY

"$ROOT/.venv/bin/python" - "$T" "$PROMPT" <<'PY'
import json, sys
from clover_cpp import Model
got = json.load(open(f"{sys.argv[1]}/wheel.json"))["tokens"]
with Model(f"{sys.argv[1]}/demo-f16.gguf", n_ctx=256) as m:
    want = m.run(m.tokenize(sys.argv[2]), mode="ar", max_tokens=12).tokens
print("wheel tokens == checkout engine:", got == want)
assert got == want, (got, want)
PY
