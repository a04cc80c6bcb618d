# `make run` and `make test` work on a fresh machine: both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; a bare `torch` would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0
SPEC ?= jobs/digits-group-topk.yaml

.PHONY: setup system-deps run test test-unit docs bench clean

setup: $(VENV)/.installed

# Prometheus and a C compiler: installed with apt-get where we may, else named.
system-deps:
	@bash tools/system-deps.sh

$(VENV)/.installed: pyproject.toml setup.py rayzip/checkpoint/_kernels.c rayzip/codecs/_kernels.c
	$(PYTHON) -m venv $(VENV)
	@# torch through pip, which reads this machine's pip configuration (where the CPU build
	@# comes from); the rest through uv, which installs the same versions in a fraction of
	@# pip's time, and through pip where uv cannot be installed.
	$(BIN)/python -m pip install -q "$(TORCH)"
	if $(BIN)/python -m pip install -q uv; then \
		$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -e '.[dev]'; \
	else \
		$(BIN)/python -m pip install -q -e '.[dev]'; \
	fi
	@# Bytecode for the editable sources too (pip compiles only what it copies): where
	@# PYTHONDONTWRITEBYTECODE is set, every Ray worker would otherwise compile rayzip again.
	$(BIN)/python -m compileall -q rayzip tests examples
	touch $@

# Embedded local Ray unless RAY_ADDRESS is set.
run: setup
	$(BIN)/rayzip run $(SPEC) --summary-json out/summary.json

# Every lane: tests/unit, tests/integration (gloo ranks), tests/system (Ray, Prometheus, namespaces).
# -X faulthandler: a crash after pytest's own handler is gone (at interpreter exit) still
# prints every thread's Python stack.
test: system-deps setup
	$(BIN)/python -X faulthandler -m pytest -q

# Pure functions and codecs only: the lane for daily work.
test-unit: setup
	$(BIN)/python -m pytest -q tests/unit

# The documentation site, into out/site (strict: a warning or a broken link fails).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

bench: setup
	$(BIN)/rayzip bench codecs --json out/bench-codecs.json

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
