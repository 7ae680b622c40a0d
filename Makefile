# Two commands set up a fresh machine: `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The exact versions the tests passed with; `make CONSTRAINTS= test` installs
# the newest versions pyproject.toml allows instead (e.g. to try another JAX).
CONSTRAINTS ?= constraints.txt
# Two pytest workers: XLA compiles on one thread, so two nearly halve the suite.
PYTEST_WORKERS ?= 2

.PHONY: run demo test docs lock bench clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]' $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	touch $(STAMP)

# Regenerates constraints.txt: the newest versions pyproject.toml allows,
# resolved in a fresh environment. Run `make test` after it and commit both.
lock:
	rm -rf .lock-venv
	python3 -m venv .lock-venv
	.lock-venv/bin/pip install --quiet --upgrade pip
	.lock-venv/bin/pip install --quiet -e '.[dev]'
	{ echo "# Exact versions the test suite passed with. Regenerate: make lock"; \
	  .lock-venv/bin/pip freeze --all --exclude-editable | grep -v "^pip=="; } > constraints.txt
	rm -rf .lock-venv

WORKDIR ?= workdirs/default
LINTED := gradcomp bench tests train configs conftest.py docs/conf.py docs/intersphinx

# The default training job (configs/default.py); re-running resumes from WORKDIR.
run: $(STAMP)
	$(PY) -m train --config configs/default.py --workdir $(WORKDIR)

demo: $(STAMP)
	$(PY) -m bench.error_demo

# ruff, the import contract, then one pytest run: the tests, every docstring
# example (--doctest-modules), every page example (Sybil, conftest.py) and the
# site's build with warnings as errors (tests/test_docs.py).
# The 25 slowest tests close the log: where the suite's 10-minute budget goes.
test: $(STAMP)
	$(PY) -m ruff format --check $(LINTED)
	$(PY) -m ruff check $(LINTED)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --durations=25 --doctest-modules tests gradcomp bench train configs docs

# The documentation site, with warnings as errors: open docs/_build/html/index.html.
docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html

# Benchmarks run on the allocator a user's process has (glibc): the
# compressors write into donated buffers rather than fresh 100 MB temporaries
# (BUILD_NOTES.md, issue 18), so no preloaded allocator is needed.
bench: $(STAMP)
	$(PY) -m bench compress
	$(PY) -m bench sketch

clean:
	rm -rf $(VENV) .lock-venv bench_out workdirs .pytest_cache .jax_cache docs/_build docs/api/_autosummary
