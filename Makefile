# refstream: `make demo` runs everything on embedded defaults; `make test` runs the test suite,
# `make test-fast` its fast tier.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python

.PHONY: venv demo test test-fast lint bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VPY) -m demo $(ARGS)

test: lint
	$(VPY) -m pytest -q

# Pure-logic tests only: no Spark, MariaDB or broker (tests/conftest.py marks the rest `integration`).
test-fast: lint
	$(VPY) -m pytest -q -m "not integration"

# ruff, then mypy over the four packages (configured in pyproject.toml).
lint: venv
	$(VPY) -m ruff check .
	$(VPY) -m mypy

bench: venv
	$(VPY) -m bench.run $(ARGS)

clean:
	rm -rf var .pytest_cache
