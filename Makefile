# Two commands for a newcomer: `make train` and `make test`. Both set up .venv first.
# VENV and TORCH pick another environment, e.g. `make setup VENV=.venv-2.11 TORCH=torch==2.11.0`.
# The editable install compiles distllm/_C*.so and _cuda*.so into this tree, so only one venv's
# build is in place at a time: setting up another venv here rebuilds them for its torch (and
# the first one rebuilds on its next `make`). `make test-torch211` builds in a copy instead.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
TORCH  ?= torch==2.14.1
STAMP   = $(VENV)/.distllm-installed
SRCS   := setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*.cu csrc/cuda/*.cpp csrc/cuda/*.h)
PYTEST_ARGS ?=
# pytest processes of `make test` (pytest-xdist, one test file to a process: a file's fixtures
# are built once). The distributed tests' ranks spend much of their time waiting on each other,
# so two processes fill cores that one leaves idle; 0 runs the tests in make's own pytest.
TEST_JOBS ?= 2
# which venv the in-tree extensions were last compiled for
EXT_OWNER := build/.extensions-venv
EXT_STALE  = $(if $(filter-out $(abspath $(VENV)),$(file <$(EXT_OWNER))),FORCE)

.PHONY: train test test-full lint bench clean setup setup-torch211 test-torch211 FORCE

setup: $(STAMP)

$(STAMP): $(SRCS) $(EXT_STALE)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)" setuptools wheel ninja pybind11 $(EXTRA_PKGS)
	$(PY) -m pip install --no-build-isolation -e ".[dev]"
	@mkdir -p $(dir $(EXT_OWNER)) && echo "$(abspath $(VENV))" > $(EXT_OWNER)
	@touch $@

train: $(STAMP)
	$(VENV)/bin/distllm info
	$(VENV)/bin/distllm train --nproc 4 --tp 2 --pp 2 --model tiny \
	  --out runs/tiny-$$(date +%Y%m%d-%H%M%S) --steps 300 --global-batch 16 --seq-len 64

# CPU tests; tests marked `gpu` run in bench/gpu_check.sh, `full` in `make test-full`.
test: $(STAMP)
	$(PY) -m pytest -m "not gpu and not full" -n $(TEST_JOBS) --dist loadfile --durations=25 \
	  $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

test-full: $(STAMP)
	$(PY) -m pytest -m "not gpu" $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check distllm kernels bench tests

bench: $(STAMP)
	$(VENV)/bin/distllm bench --quick --out runs/bench-$$(date +%Y%m%d-%H%M%S)

# The oldest supported torch (CI runs this after `make test`). The tree is copied to
# $(OLD_TREE) (tracked and unignored files; its compiled extensions are kept between
# runs) and set up there against $(OLD_VENV), so this tree's extensions stay .venv's.
OLD_TORCH ?= torch==2.11.0
# Triton 3.6 (torch 2.11's) cannot interpret kernels with numpy >= 2.4 (int() of a
# one-element array); the CPU tests run Triton through that interpreter.
OLD_EXTRA ?= "numpy<2.4"
OLD_VENV  ?= .venv-2.11
OLD_TREE  := build/torch-2.11

setup-torch211:
	@mkdir -p $(OLD_TREE)
	find $(OLD_TREE) -mindepth 1 -path $(OLD_TREE)/build -prune -o -type f ! -name '*.so' -print0 \
	  | xargs -0r rm -f
	git ls-files -z -co --exclude-standard \
	  | tar --null --ignore-failed-read -T - -cf - | tar -xf - -C $(OLD_TREE)
	$(MAKE) -C $(OLD_TREE) setup VENV=$(abspath $(OLD_VENV)) TORCH=$(OLD_TORCH) PYTHON=$(PYTHON) \
	  EXTRA_PKGS='$(OLD_EXTRA)'

test-torch211: setup-torch211
	$(MAKE) -C $(OLD_TREE) test VENV=$(abspath $(OLD_VENV)) TORCH=$(OLD_TORCH) PYTHON=$(PYTHON) \
	  PYTEST_ARGS='$(PYTEST_ARGS)' TEST_JOBS=$(TEST_JOBS)

clean:
	rm -rf build *.egg-info distllm/*.so  # build outputs only: runs/ holds the user's runs
