# Two commands set up a fresh machine: `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

WORKDIR ?= workdirs/default

# The default training job (configs/default.py); re-running resumes from WORKDIR.
run: $(STAMP)
	$(PY) -m train --config configs/default.py --workdir $(WORKDIR)

demo: $(STAMP)
	$(PY) -m gradcomp.demo

test: $(STAMP)
	$(PY) -m ruff format --check gradcomp tests train configs
	$(PY) -m ruff check gradcomp tests train configs
	$(PY) -m pytest -q tests

# Benchmarks use jemalloc when the system has it (apt-get install libjemalloc2):
# glibc returns every 100 MB buffer to the OS, and re-faulting its pages costs
# tens of ms per call on CPU (BUILD_NOTES.md, "allocator").
, := ,
JEMALLOC := $(firstword $(wildcard /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 /usr/lib/aarch64-linux-gnu/libjemalloc.so.2))
BENCH_ENV := $(if $(JEMALLOC),LD_PRELOAD=$(JEMALLOC) MALLOC_CONF=dirty_decay_ms:-1$(,)muzzy_decay_ms:-1$(,)retain:true)

bench: $(STAMP)
	$(BENCH_ENV) $(PY) -m gradcomp.bench compress
	$(BENCH_ENV) $(PY) -m gradcomp.bench sketch

clean:
	rm -rf $(VENV) bench_out workdirs .pytest_cache
