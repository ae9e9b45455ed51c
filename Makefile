# Set-up is idempotent: the virtual environment is created once and re-used.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test typecheck bench bench-docs docs asv-check clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test]"
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m bench.demo

test: $(STAMP)
	$(BIN)/python -m pytest

typecheck: $(VENV)/.extra-typecheck
	$(BIN)/mypy

# Optional extras (docs, bench) are installed on top of the set-up when a target needs them.
$(VENV)/.extra-%: $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[$*]"
	@touch $@

# make bench BENCH_ARGS="--plot bench.png --json bench.json" for the full run (see also bench-docs).
BENCH_ARGS ?= --quick
bench: $(VENV)/.extra-bench
	$(BIN)/python -m bench.bench $(BENCH_ARGS)

# The table, plot and raw figures of docs/benchmarks.md (a few minutes; run on a quiet machine).
bench-docs: $(VENV)/.extra-bench
	$(BIN)/python -m bench.bench --plot docs/img/bench.png --json docs/data/bench.json > docs/data/bench-table.md

docs: $(VENV)/.extra-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The asv suites cannot rot: every suite is imported and checked, and a quick subset (the
# smallest B of suites 1 and 2) is run once. The whole quick suite: make asv-check ASV_BENCH=.
ASV := $(BIN)/asv --config asv_benchmarks/asv.conf.json
ASV_BENCH ?= _jacobian\((2|100),
asv-check: $(VENV)/.extra-bench
	$(ASV) machine --yes >/dev/null
	$(ASV) check --python=same
	$(ASV) run --python=same --quick --show-stderr --bench '$(ASV_BENCH)'

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
