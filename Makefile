# Clover toolkit: `make setup`, `make test`, `make demo`, `make bench`, `make clean`.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-stamp
PYTEST_ARGS ?=

.PHONY: setup test test-fast lint demo clean native bench browser agents wllama

setup: $(STAMP) native browser agents wllama

# The agent CLIs the agent tests drive against `clover-cpp serve` (tests/native/test_agents.py), pinned, from npm
# into build/agents (node_modules/.bin/claude, codex); installed once, when missing or at another version.
AGENTS := @anthropic-ai/claude-code@2.1.328 @openai/codex@0.169.0
agents:
	@test "$$(cat build/agents/.pinned 2>/dev/null)" = "$(AGENTS)" || { \
		command -v npm >/dev/null || { echo "make agents: npm is missing (Debian: apt-get install npm)" >&2; exit 1; }; \
		mkdir -p build/agents && npm install --prefix build/agents --no-save --no-audit --no-fund --silent $(AGENTS) && \
		echo "$(AGENTS)" > build/agents/.pinned; }

# Upstream llama.cpp as wasm (the npm package @wllama/wllama, llama.cpp b12211) for the interop test
# (tests/native/test_upstream_wllama.py: our trunk files in upstream's build, in headless Chromium), pinned, from npm
# into build/wllama; installed once, when missing or at another version.
WLLAMA := @wllama/wllama@3.13.0
wllama:
	@test "$$(cat build/wllama/.pinned 2>/dev/null)" = "$(WLLAMA)" || { \
		command -v npm >/dev/null || { echo "make wllama: npm is missing (Debian: apt-get install npm)" >&2; exit 1; }; \
		mkdir -p build/wllama && npm install --prefix build/wllama --no-save --no-audit --no-fund --silent $(WLLAMA) && \
		echo "$(WLLAMA)" > build/wllama/.pinned; }

# The web chat's browser tests (tests/surfaces/test_webui.py) drive Debian's chromium and chromedriver through
# selenium (pyproject [test]); installed once when missing, with sudo unless we are root.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver; }

# The patched llama.cpp (cpp_patch/) built by scripts/build_native.sh (cache in $$CLOVER_CACHE, ccache when
# installed; GPU=cuda for CUDA), then llama-cpp-python 0.3.36 installed as pure Python (LLAMA_BUILD=OFF):
# clover_cpp.native points it at build/native/lib. The build script is a Ninja no-op when nothing changed.
# Without a bundled libllama a plain `import llama_cpp` would fail ("Shared library with base name 'llama' not
# found") outside clover_cpp, so install_lib_path.py puts a .pth in the venv that sets LLAMA_CPP_LIB_PATH to
# build/native/lib when it is unset (idempotent; see the script).
native: $(STAMP)
	scripts/build_native.sh
	@$(BIN)/python -c "import importlib.metadata as m, sys; sys.exit(m.version('llama_cpp_python') != '0.3.36')" 2>/dev/null || \
		CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" $(BIN)/python -m pip install $$(python3 scripts/llama_sdist.py unpack)
	$(BIN)/python scripts/install_lib_path.py $(VENV) $(CURDIR)/build/native/lib

# Rebuilt only when pyproject.toml changes. The base install has no torch; the [test] extra brings it through
# [reference] (docs/install.md). torch is pinned and installed first, so pip takes the CPU wheel already on disk
# instead of resolving a bare `torch`. The editable install skips setup.py's native build: `make native` builds
# for this CPU (-march=native) into build/native, while `pip install .` builds a portable one into its wheel; both
# use the same cache ($CLOVER_CACHE, ccache).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install torch==2.13.0
	$(BIN)/python -m pip install -e '.[test]'
	touch $@

test: setup lint
	CLOVER_REQUIRE_NATIVE=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

# ruff's rule set is in pyproject.toml ([tool.ruff]).
lint: $(STAMP)
	$(BIN)/ruff check .

# The pure-Python edit loop: no native build, the native and slow tests skipped.
test-fast: $(STAMP) lint
	CLOVER_SKIP_NATIVE=1 $(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

# The main job, on the shipped default model (models/clover-demo, see its README): convert it to an f16 GGUF,
# quantize that to Q4_K_M with clover-quantize, then continue a code prompt with the native engine in ar,
# diffusion and spec modes, with a stats table.
DEMO_MODEL := models/clover-demo
DEMO_F16 := build/demo/clover-demo-f16.gguf
DEMO_GGUF := build/demo/clover-demo-Q4_K_M.gguf

$(DEMO_F16): $(DEMO_MODEL)/model.safetensors $(DEMO_MODEL)/config.json | setup
	mkdir -p $(dir $@)
	$(BIN)/clover-convert $(DEMO_MODEL) $@ --outtype f16

$(DEMO_GGUF): $(DEMO_F16) | setup
	$(BIN)/clover-quantize $< $@ Q4_K_M

demo: setup $(DEMO_GGUF)
	$(BIN)/python scripts/demo.py $(DEMO_GGUF)

# Benchmarks, results in bench/results/: the native engine (bench_engine.py: tiny and mid at f32 and q8_0),
# decode speed of every mode with a user's defaults (bench_speed.py), and what the CPU's extra buffer types
# (AMX, repacked weights) bring (bench_cpu_bufts.py). bench/bench_convert.py is separate (it streams a 5 GB
# checkpoint).
bench: setup
	$(BIN)/python -m bench.bench_engine
	$(BIN)/python -m bench.bench_speed
	$(BIN)/python -m bench.bench_cpu_bufts

clean:
	rm -rf build
