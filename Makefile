# The two commands of the README: `make demo` (set up, then run the embedded search demo)
# and `make test` (set up, then run the test suite). Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-fast lint typecheck demo bench clean

install: $(STAMP)

# Re-install only when the dependency files change. constraints.txt pins torch 2.14.1 /
# torchvision 0.29.1 and the Ray / MLflow / Optuna / decord versions CI runs.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

# The whole suite in TEST_WORKERS processes (pytest-xdist): the tests that use the session's Ray
# and smoke search in one of them (tests/conftest.py), everything else beside them; then the tests
# marked `alone`, one at a time. One process keeps the 2 cores of a CI machine ~69% busy: the CPU
# line at the end of each run says how busy they were.
TEST_WORKERS ?= 2
test: install
	PYTHONFAULTHANDLER=1 $(PY) -m pytest -m "not alone" -n $(TEST_WORKERS) --dist loadgroup
	PYTHONFAULTHANDLER=1 $(PY) -m pytest -m alone

# ruff (configured in pyproject.toml): pyflakes, pycodestyle, isort, pyupgrade, bugbear.
# .ci/run runs it before the tests.
lint: install
	$(VENV)/bin/ruff check .

# pyright (basedpyright, configured in pyproject.toml): every `import` resolves, as an IDE or a
# type checker sees the package. .ci/run runs it before the tests.
typecheck: install
	$(VENV)/bin/basedpyright --pythonpath $(PY)

# Unit tests only (no Ray session, no end-to-end search), in FAST_WORKERS processes (pytest-xdist):
# alone they keep about one core of two busy (the CPU line at the end of a run says so).
FAST_WORKERS ?= 2
test-fast: install
	PYTHONFAULTHANDLER=1 $(PY) -m pytest -m "not slow" -n $(FAST_WORKERS)

demo: install
	$(VENV)/bin/vidtune demo

# On a machine with one GPU (under 5 minutes): the precision table of bench/gpu_precision.py,
# then a 4-trial mvit_v2_s search on generated videos, checked in the MLflow store it wrote
# (see bench/gpu_check.py). Refuses with exit 2 where torch sees no GPU. Its flags go in
# GPU_CHECK_ARGS, e.g. make gpu-check GPU_CHECK_ARGS="--json gpu-check.json --keep /tmp/gpu-check".
GPU_CHECK_ARGS ?=
.PHONY: gpu-check
gpu-check: install
	$(PY) -m bench.gpu_check $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache

# The container image of deploy/Dockerfile (CUDA runtime, the pinned stack, a non-root user), for
# deploy/kuberay/ and cluster.yaml's `docker:` section; then `vidtune --help` inside it. Needs
# Docker; not run by the tests (tests/test_deploy_image.py checks the file itself).
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE ?= vidtune:$(VERSION)
.PHONY: image
image:
	docker build -f deploy/Dockerfile -t $(IMAGE) .
	docker run --rm $(IMAGE) vidtune --help

# An offline GPU node (docs/gpus.md, "A GPU node without internet"): everything vidtune and
# `make gpu-check` need but torch and torchvision, as wheels for the node's Python (3.11 or 3.12)
# in files of at most 60 MB, with the one command to run there (WHEELHOUSE/install.sh). Needs the
# package index; uses none of .venv (deploy/wheelhouse/build.py).
PYTHON_VERSION ?= 3.11
WHEELHOUSE ?= wheelhouse-py$(subst .,,$(PYTHON_VERSION))
.PHONY: wheelhouse
wheelhouse:
	$(PYTHON) -m deploy.wheelhouse.build --python-version $(PYTHON_VERSION) --out $(WHEELHOUSE)
