# Set-up and the two README commands. Re-running when set up costs seconds (the stamp is up to date).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mindspeed-proxy-installed
PYTEST_ARGS ?= --durations=15 --cpu-durations=15
# the test files to run, e.g. in reverse order: make test TESTS="$(find tests -name 'test_*.py' | sort -r | xargs)"
TESTS ?= tests
# pytest-xdist: one worker per core, whole files per worker (module fixtures build once; proxy checkpoints are
# shared between workers through a file lock, mindspeed_proxy/testing/shared.py), the most expensive files first
# (tests/conftest.py EXPENSIVE_FILES; --no-loadscope-reorder keeps that order). XDIST= runs in one process.
XDIST ?= -n auto --dist loadfile --no-loadscope-reorder

# The current megatron-core line (0.17+ needs Python >= 3.12) in its own venv; never part of `make test` / CI:
# on Python 3.12 `pip install torch==2.13.0` fetches the CUDA build (runs on CPU, large download).
PYTHON_LATEST ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python) python3.12)
MCORE_LATEST ?= 0.19.2
VENV_LATEST ?= .venv-latest
PY_LATEST := $(VENV_LATEST)/bin/python
STAMP_LATEST := $(VENV_LATEST)/.mindspeed-proxy-installed
# launcher and version gate, monitor families, converter read/write and load-back (Megatron-LM's own
# pretrain_gpt.py too, where MEGATRON_LM_PATH names a core_v0.19 checkout)
LATEST_TESTS ?= tests/test_versions.py tests/test_patches.py tests/test_platform.py tests/monitor tests/proxy \
	tests/test_megatron_lm.py

.PHONY: setup demo rl-demo test test-all test-latest clean-venv

$(STAMP): setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# the CPU build of torch 2.13.0 lies on local disk; megatron-core 0.16.1 is the newest for Python 3.11
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check megatron-core==0.16.1
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,report,proxy,hf]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	OMP_NUM_THREADS=1 $(PY) examples/demo.py

rl-demo: setup
	OMP_NUM_THREADS=1 $(PY) examples/rl_demo.py

# lint-imports: the import contracts of .importlinter (proxy layers, no cycles, the library never imports
# mindspeed_proxy.testing), docs/architecture.md. PYTHONDONTWRITEBYTECODE is cleared for the suite: it starts
# hundreds of processes (ranks, commands), and where the environment sets it each of them compiles our sources
# again and each pytest worker rewrites every test module again (__pycache__ is git-ignored).
test: setup
	$(VENV)/bin/lint-imports
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q $(XDIST) -m "not slow" $(PYTEST_ARGS) $(TESTS)

$(STAMP_LATEST): setup.py Makefile
	test -x $(PY_LATEST) || $(PYTHON_LATEST) -m venv $(VENV_LATEST)
	$(PY_LATEST) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY_LATEST) -m pip install -q --disable-pip-version-check megatron-core==$(MCORE_LATEST)
	$(PY_LATEST) -m pip install -q --disable-pip-version-check -e '.[test,proxy,hf]' pybind11
	touch $(STAMP_LATEST)

test-latest: $(STAMP_LATEST)
	$(PY_LATEST) -m pytest -q $(XDIST) -m "not slow" -rs $(PYTEST_ARGS) $(LATEST_TESTS)

test-all: setup
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS) $(TESTS)

clean-venv:
	rm -rf $(VENV) $(VENV_LATEST)
