# vlcontrast: `make demo` runs the main job on the embedded dataset, `make test` runs the suite.
# Both work on a fresh machine: they create .venv and install the package with pinned versions.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# No DS_ACCELERATOR here: the package chooses DeepSpeed's accelerator and the torch device together
# (CUDA when there is a GPU, else CPU), so the demo and the tests use one device on every host.
export PYTHONUNBUFFERED := 1

DATA   ?= data/synthetic
GPU_CHECK_OUT ?= runs/gpu_check
GPU_CHECK_ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast gpu-check data bench study clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel
	$(BIN)/python -m pip install --quiet -c requirements.lock -e ".[dev]"
	touch $(STAMP)

# The synthetic world is written again when it is missing or differs from what is asked for
# (generator version, sizes, seed, training mix: `prep synthetic --skip-if-current`). The demo's
# training split is shape-heavy (80% one-object scenes, 30% of their captions the bare object
# phrase); validation and zero-shot sets do not depend on the mix (docs/data.md).
DEMO_MIX ?= --single-object 0.8 --bare 0.3
data: setup
	$(BIN)/vlcontrast prep synthetic --out $(DATA) --train 20000 --val 1000 --seed 0 $(DEMO_MIX) --skip-if-current

# The demo trains with one process on a CPU machine (a 2-core CPU runs one process of two threads
# faster than two processes) and one per GPU otherwise; verify gates on retrieval (R@1 >= 100x
# chance in both directions) and on zero-shot shape classification (top-1 >= 5x chance: the 50%
# the demo aims for; three seeds gave 64.8-67.8%, results/demo-tuning/demo.md, "Demo results").
# train.resume=latest: run again, it continues an interrupted demo or re-evaluates a finished one.
DEMO_NPROC ?= $(shell $(BIN)/python -c 'import torch; print(torch.cuda.device_count() or 1)' 2>/dev/null || echo 1)
demo: setup data
	$(BIN)/vlcontrast train --config configs/demo.yaml --nproc $(DEMO_NPROC) train.resume=latest
	$(BIN)/vlcontrast verify runs/demo --metrics retrieval/text_to_image_R@1:100,retrieval/image_to_text_R@1:100,zeroshot/top1:5

test: setup
	$(BIN)/python -m pytest -q -n 2 --durations=15 $(PYTEST_ARGS) tests

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS) tests

# The GPU check (bench/gpu_check, a repository tool, not in the wheel): groups syncs, losses, resume,
# matrix, throughput, memory, each <= 8 min on one H100 (all ~20 min); one group:
# make gpu-check GPU_CHECK_ARGS="--only matrix". Without CUDA it runs the reduced CPU variant (what
# tests/bench/test_gpu_check.py runs). On the device machine, without make: bench/device_run.sh.
# docs/training.md, "GPU check".
gpu-check: setup
	PYTHONPATH=$(CURDIR) $(BIN)/python -m bench.gpu_check --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

study: setup
	$(BIN)/vlcontrast study --config configs/study/default.yaml

# The CPU benchmarks behind docs/benchmarks.md, with the commands the page quotes (hours in all):
# make bench BENCH_ARGS=--list (commands and durations), BENCH_ARGS="--only retrieval".
bench: setup
	$(BIN)/python bench/run_all.py $(BENCH_ARGS)

clean:
	rm -rf runs data/synthetic .pytest_cache
