# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv and install the project with the pins in constraints.txt.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test proto clean

$(BIN)/.installed: pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (Python 3.11); set PYTHON=..."; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade "pip>=23.2"
	$(BIN)/pip install --quiet -c constraints.txt -e '.[client,dev]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/python bench/demo.py

test: $(BIN)/.installed
	$(BIN)/python -m pytest

proto: $(BIN)/.installed
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
