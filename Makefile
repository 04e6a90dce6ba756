# The two commands of the README: `make train` and `make test`. Each creates .venv on first use and
# re-installs only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: train test bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

train: $(STAMP)  ## train configs/tiny.yaml on the CPU (embedded corpus) and print samples
	$(BIN)/tpu-llm train --config configs/tiny.yaml

test: $(STAMP)  ## the CPU test suite
	$(BIN)/python -m pytest -q

bench: $(STAMP)  ## benchmarks (see README)
	$(BIN)/tpu-llm bench

clean:  ## remove the virtual environment (runs/ is kept)
	rm -rf $(VENV)
