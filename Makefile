# Set-up is idempotent: the virtual environment is created once and re-used.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench docs asv-check clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test]"
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m jacmode demo

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python -m jacmode bench --quick

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
