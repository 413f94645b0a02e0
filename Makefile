# Set-up and the two README commands. Re-running when set up costs seconds (the stamp is up to date).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mindspeed-proxy-installed
PYTEST_ARGS ?= --durations=15
# the test files to run, e.g. in reverse order: make test TESTS="$(find tests -name 'test_*.py' | sort -r | xargs)"
TESTS ?= tests
# pytest-xdist: one worker per core, whole files per worker (module fixtures build once; proxy checkpoints are
# shared between workers through a file lock, mindspeed_proxy/testing/shared.py). XDIST= runs in one process.
XDIST ?= -n auto --dist loadfile

.PHONY: setup demo rl-demo test test-all clean-venv

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

test: setup
	$(PY) -m pytest -q $(XDIST) -m "not slow" $(PYTEST_ARGS) $(TESTS)

test-all: setup
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS) $(TESTS)

clean-venv:
	rm -rf $(VENV)
