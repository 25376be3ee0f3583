# refstream: `make demo` runs everything on embedded defaults; `make test` runs the test suite.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python

.PHONY: venv demo test lint bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VPY) -m demo $(ARGS)

test: venv
	$(VPY) -m ruff check .
	$(VPY) -m pytest -q

lint: venv
	$(VPY) -m ruff check .

bench: venv
	$(VPY) -m bench.run $(ARGS)

clean:
	rm -rf var .pytest_cache
