# decodebench: one venv, set up on first use; see README.md.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# GPU extra when an NVIDIA driver answers, CPU extra otherwise.
EXTRA := $(shell nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
# The CPU build installs at the versions its suite last passed with (constraints-cpu.txt,
# `make lock`); a GPU machine resolves the gpu extra's ranges against its own CUDA wheels.
LOCK := $(if $(filter cpu,$(EXTRA)),constraints-cpu.txt)
# This checkout installed editable. setuptools adds a notice to every editable install
# ("be careful with folders named like the package"); pip shows it as a warning. It is
# the point here (the service and its workers run this checkout), so that one is off.
EDITABLE := PYTHONWARNINGS='ignore:Editable installation' $(PIP) install --quiet $(if $(LOCK),-c $(LOCK)) -e

# The suite starts hundreds of Python processes (services, stub servers, the CLI): with
# PYTHONDONTWRITEBYTECODE set (some images set it) each compiles this checkout's modules
# again, and pytest rewrites every test module again in each worker. Bytecode is cached
# under __pycache__ (ignored by git) instead.
unexport PYTHONDONTWRITEBYTECODE

SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup setup-dev vllm-wheels browser compose-tool run test test-quick test-unit lint bench clean lock

setup: $(VENV)/.installed-$(EXTRA)

$(VENV)/.installed-$(EXTRA): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(EDITABLE) '.[$(EXTRA)]'
	@# vLLM CPU pulls these in; next to the CPU torch they break transformers.
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

setup-dev: setup $(VENV)/.installed-dev vllm-wheels

$(VENV)/.installed-dev: pyproject.toml $(LOCK)
	$(EDITABLE) '.[$(EXTRA),dev,ray]'
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

# The next vLLM release's published wheel (336 MB), read as source and never installed by
# tests/test_vllm_versions.py: fetched from the package index once, into .cache/vllm-wheels
# (git-ignored); tests/vllm_source.py names the release.
vllm-wheels: $(VENV)/.installed-dev
	$(PY) -m tests.vllm_source

# Debian's Chromium for the browser tests (a test tool's own browser download fails offline).
browser:
	@command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium; }

# What tests/test_compose.py checks docker/compose.yaml with, no Docker engine needed: the
# Compose Specification's JSON schema (the dev extra's check-jsonschema ships a copy) and a compose CLI for
# `config` (the `docker compose` plugin where there is one, else Debian's docker-compose).
compose-tool:
	@docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null 2>&1 || \
		{ $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q docker-compose; }

# Writes constraints-cpu.txt from this venv (after a release was tried and `make test`
# passed with it): its header kept, every installed package but this project and torch.
lock: setup-dev
	{ sed '/^#/!Q' constraints-cpu.txt; $(PIP) freeze --exclude-editable | grep -v '^torch=='; } > constraints-cpu.txt.new
	mv constraints-cpu.txt.new constraints-cpu.txt

run: setup
	$(VENV)/bin/decodebench serve

lint: setup-dev
	$(VENV)/bin/ruff check service connector tests benchmarks
	$(VENV)/bin/mypy

# Workers (pytest-xdist): the real vLLM tests run one after another on one worker, the Ray
# tests on another, every other file whole on the next free one (tests/conftest.py). On a
# 2-core machine 4 workers take about 21 to 26 minutes (1,434 tests).
TEST_WORKERS ?= 4
QUICK_WORKERS ?= 6

# One OpenBLAS thread per test process (numpy's and scipy's; vLLM's torch uses MKL): a
# second one spins between the small matrix products of the bootstraps for none of their
# wall time (test_stop_coverage with test_stats: 18.2-18.7 user-s with two threads,
# 11.7-11.8 with one, 12.0 s of wall either way), and on workers it spins on the cores the
# other workers need.
OPENBLAS_NUM_THREADS ?= 1
test test-quick test-unit: export OPENBLAS_NUM_THREADS := $(OPENBLAS_NUM_THREADS)

test: setup-dev browser compose-tool lint
	$(PY) -m pytest -x -q --durations=25 -n $(TEST_WORKERS)

# The edit-test loop: every test but those that start a real vLLM server (e2e), a Ray
# cluster or a browser, or fuzz for minutes (slow). No lint; `make test` is the whole suite.
test-quick: setup-dev compose-tool
	$(PY) -m pytest -x -q --durations=10 -m "not e2e and not slow" -n $(QUICK_WORKERS)

# The pure tests alone: the modules marked `unit` (capacity planner, intervals and other
# statistics, step model, placement, start failures, ...), through fakes: no server, no
# process, no Ray cluster, no browser; 45 s on 2 cores. Only those modules are
# collected (each says so in the line grepped for; tests/test_suite_tiers.py holds them to
# it), and no vLLM wheel is fetched.
UNIT_TESTS = $(shell grep -l '^pytestmark = pytest.mark.unit$$' tests/test_*.py)
UNIT_WORKERS ?= 2

test-unit: setup $(VENV)/.installed-dev
	$(PY) -m pytest -x -q --durations=5 -m unit -n $(UNIT_WORKERS) $(UNIT_TESTS)

# token_stub.py (the stub server) and harness.py (process helpers) are not benchmarks.
BENCHES := $(filter-out benchmarks/token_stub.py benchmarks/harness.py,$(wildcard benchmarks/*.py))

bench: setup
	@for script in $(BENCHES); do echo "== $$script"; $(PY) $$script || exit 1; done

clean:
	rm -rf $(VENV) var
