# Clover toolkit: `make setup`, `make test`, `make demo`, `make clean`.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-stamp
DEMO := build/demo-tiny
PROMPT := def fibonacci(n):
PYTEST_ARGS ?=

.PHONY: setup test demo clean

setup: $(STAMP)

# Rebuilt only when pyproject.toml changes. torch is pinned and installed first, so pip takes the
# CPU wheel already on disk instead of resolving a bare `torch`.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install torch==2.13.0
	$(BIN)/python -m pip install -e '.[test]'
	touch $@

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

$(DEMO)/config.json: | setup
	$(BIN)/clover-ref init $(DEMO) --preset tiny --seed 0

demo: setup $(DEMO)/config.json
	$(BIN)/clover-ref generate $(DEMO) -p "$(PROMPT)" --mode diffusion -n 32
	$(BIN)/clover-ref generate $(DEMO) -p "$(PROMPT)" --mode spec -n 32

clean:
	rm -rf build
