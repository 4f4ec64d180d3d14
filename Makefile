# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch==2.13.0 comes from the machine's local CPU wheel; pinning it keeps CUDA packages away.
WHEELS ?= /opt/wheels
# make run emulates this network between the ranks when run as root (--link needs network namespaces)
LINK ?= 1gbit
PIP_FLAGS := $(if $(wildcard $(WHEELS)),--find-links $(WHEELS),)

.PHONY: run test test-fast lint test-torch-next proto docs bench clean

$(VENV)/.installed: requirements.txt setup.py pyproject.toml gradsync/tables/table_loops.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(PIP_FLAGS) -r requirements.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

run: $(VENV)/.installed
	$(PY) -m gradsync.cli compare --out gradsync-report --strategies allreduce,ps --servers 1 --modes sync,async \
		$(if $(filter 0,$(shell id -u)),--link $(LINK),) examples/digits.py

# two pytest workers, a test file each at a time: on 2 cores the suite is CPU-bound (each `gradsync run` job imports
# torch and torch._dynamo once, in its launcher, which forks the ranks' fork server); -n 3 gains too little for the
# load it adds to the tests that time out a rank on purpose, and the files run in alphabetical order (the longest
# first gains nothing). The suite's time: docs/architecture.md, under the test tiers
test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadfile

# every test that starts no process (-m "not job": settings, messages, layout, cost model, codecs, kernels on CPU,
# tables, plans), the tier to run after each change; tests/conftest.py fails a test not marked `job` that starts one
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 -m "not job"

# ruff's lint and format check and mypy over the package (pinned in requirements.txt, configured in pyproject.toml):
# seconds, and what .ci/run runs before the tests; `.venv/bin/ruff format gradsync` applies the format
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check gradsync
	$(VENV)/bin/ruff format --check gradsync
	$(VENV)/bin/mypy

# the suite on torch 2.14.1, the newest torch this machine's package index offers: a CUDA build from the index (several
# GB, with the triton it pairs with), so a venv of its own and never in CI
NEXT_VENV := .venv-torch-2.14
$(NEXT_VENV)/.installed: requirements.txt setup.py pyproject.toml
	test -x $(NEXT_VENV)/bin/python || $(PYTHON) -m venv $(NEXT_VENV)
	$(NEXT_VENV)/bin/python -m pip install -q torch==2.14.1
	grep -v -e '^torch==' -e '^triton==' requirements.txt > $(NEXT_VENV)/requirements.txt
	$(NEXT_VENV)/bin/python -m pip install -q -r $(NEXT_VENV)/requirements.txt
	$(NEXT_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

test-torch-next: $(NEXT_VENV)/.installed
	$(NEXT_VENV)/bin/python -m pytest -q -n 2 --dist loadfile

proto: $(VENV)/.installed
	$(PY) -m gradsync.proto.generate

docs: $(VENV)/.installed
	$(PY) -c "from gradsync.core.settings import rewrite; rewrite('docs/architecture.md')"

bench: $(VENV)/.installed
	$(PY) bench/overhead.py

clean:
	rm -rf $(VENV) build *.egg-info
