# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch==2.13.0 comes from the machine's local CPU wheel; pinning it keeps CUDA packages away.
WHEELS ?= /opt/wheels
# make run emulates this network between the ranks when run as root (--link needs network namespaces)
LINK ?= 1gbit
PIP_FLAGS := $(if $(wildcard $(WHEELS)),--find-links $(WHEELS),)

.PHONY: run test proto docs bench clean

$(VENV)/.installed: requirements.txt setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(PIP_FLAGS) -r requirements.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

run: $(VENV)/.installed
	$(PY) -m gradsync.cli compare --out gradsync-report --strategies allreduce,ps --servers 1 --modes sync,async \
		$(if $(filter 0,$(shell id -u)),--link $(LINK),) examples/digits.py

# two pytest workers, a test file each at a time: on 2 cores the suite is CPU-bound (each `gradsync run` job's
# launcher imports torch, its fork server torch and torch._dynamo, ~8 CPU-s a job); -n 3: 9:29 against 9:58 (one run
# each, both cores 95% busy), too little for the load it adds to the tests that time out a rank on purpose. The
# same code runs 10:13 to 11:23 from fresh clones on this machine; the longest files first (11:24, 11:33) showed
# no gain within that spread, so the files run in alphabetical order
test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadfile

proto: $(VENV)/.installed
	$(PY) -m gradsync.proto.generate

docs: $(VENV)/.installed
	$(PY) -c "from gradsync.core.settings import rewrite; rewrite('docs/architecture.md')"

bench: $(VENV)/.installed
	$(PY) bench/overhead.py

clean:
	rm -rf $(VENV) build *.egg-info
