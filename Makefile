# Two commands set up a fresh machine: `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m gradcomp.demo

test: $(STAMP)
	$(PY) -m ruff format --check gradcomp tests
	$(PY) -m ruff check gradcomp tests
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) -m gradcomp.bench compress

clean:
	rm -rf $(VENV) bench_out .pytest_cache
