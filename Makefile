# vlcontrast: `make demo` runs the main job on the embedded dataset, `make test` runs the suite.
# Both work on a fresh machine: they create .venv and install the package with pinned versions.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export DS_ACCELERATOR ?= cpu
export PYTHONUNBUFFERED := 1

DATA   ?= data/synthetic
NPROC  ?= 2
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast data bench study clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel
	$(BIN)/python -m pip install --quiet -c requirements.lock -e ".[dev]"
	touch $(STAMP)

data: setup
	test -f $(DATA)/manifest.json || $(BIN)/vlcontrast prep synthetic --out $(DATA) --train 20000 --val 1000 --seed 0

demo: setup data
	$(BIN)/vlcontrast train --config configs/demo.yaml --nproc $(NPROC)
	$(BIN)/vlcontrast verify runs/demo --min-over-chance 3 --metrics retrieval/text_to_image_R@1,retrieval/image_to_text_R@1

test: setup
	$(BIN)/python -m pytest -q -n 2 --durations=15 $(PYTEST_ARGS) tests

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS) tests

study: setup
	$(BIN)/vlcontrast study --config configs/study/default.yaml

bench: setup
	$(BIN)/python bench/run_all.py

clean:
	rm -rf runs data/synthetic .pytest_cache
