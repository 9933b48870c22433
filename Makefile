# The two commands of the quick start: `make run` and `make test`. Both create .venv/ first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: run test develop test-rust test-stub test-python bench lint clean

$(VENV)/.installed: requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

# Builds the extension (release, abi3) into the virtual environment as an editable install.
develop: $(VENV)/.installed
	$(PY) -m maturin develop --release -q

# Until the model runner lands, the main job is the Rust embedding example: the engine core
# driven end to end by a deterministic runner, synchronously and from concurrent tokio tasks.
run: develop
	cargo run --release -q -p ferrollm-core --example embed

test: develop test-rust test-stub test-python

test-rust:
	cargo test --workspace -q

# The checked-in stub is the boundary's contract: it must match the built module.
test-stub:
	$(PY) -m mypy.stubtest ferrollm._core --mypy-config-file pyproject.toml

test-python:
	$(PY) -m pytest -q

bench:
	cargo bench -p ferrollm-core

lint:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -q -- -D warnings

clean:
	rm -rf $(VENV) target
