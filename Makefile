# Two commands for a newcomer: `make train` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.14.1
STAMP  := $(VENV)/.distllm-installed
SRCS   := setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*.cu csrc/cuda/*.cpp csrc/cuda/*.h)
PYTEST_ARGS ?=

.PHONY: train test test-full lint bench clean setup

setup: $(STAMP)

$(STAMP): $(SRCS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)" setuptools wheel ninja pybind11
	$(PY) -m pip install --no-build-isolation -e ".[dev]"
	@touch $@

train: $(STAMP)
	$(VENV)/bin/distllm info
	$(VENV)/bin/distllm train --nproc 4 --tp 2 --pp 2 --model tiny --out runs/tiny \
	  --steps 300 --global-batch 16 --seq-len 64

# CPU tests; tests marked `gpu` run in bench/gpu_check.sh, `full` in `make test-full`.
test: $(STAMP)
	$(PY) -m pytest -m "not gpu and not full" $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

test-full: $(STAMP)
	$(PY) -m pytest -m "not gpu" $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check distllm kernels bench tests

bench: $(STAMP)
	$(VENV)/bin/distllm bench --quick --out runs/bench

clean:
	rm -rf build *.egg-info distllm/*.so runs
