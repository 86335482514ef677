# speakerd: `make serve` serves, `make test` tests; both build the environment first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The server reads SPEAKERD_PORT / SPEAKERD_METRICS_PORT itself; `make serve` passes them as
# flags, so it takes them from the environment too (else the server's defaults).
PORT ?= $(or $(SPEAKERD_PORT),50051)
METRICS_PORT ?= $(or $(SPEAKERD_METRICS_PORT),9100)
# Where the default (synthetic) model is made on first use; speakerd/model/store.py reads it.
SPEAKERD_CACHE ?= $(HOME)/.cache/speakerd
# requires-python in pyproject.toml
MIN_PYTHON := 3.11
# `make test` runs the test files on 2 pytest-xdist workers, each file whole on one worker
# (its module's server started once), the slow files first (tests/conftest.py orders them):
# on CI's 2 cores much of the suite waits on one core (process start-ups, imports, the test's
# own Python), and the other runs the next file meanwhile. PYTEST_WORKERS=0 runs them in
# one process; PYTEST_FLAGS adds flags (.ci/run: --durations=25).
PYTEST_WORKERS ?= 2
PYTEST_FLAGS ?=
# the GPU extra is installed when an NVIDIA driver answers; CUDA 13 drivers get cupy-cuda13x
GPU_EXTRA := $(shell nvidia-smi >/dev/null 2>&1 && (nvidia-smi | grep -q 'CUDA Version: 1[3-9]' && echo ,gpu-cuda13 || echo ,gpu))

.PHONY: venv serve test lint pytest proto clean

$(BIN)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; need = tuple(map(int, "$(MIN_PYTHON)".split("."))); \
		sys.exit(None if sys.version_info >= need else \
		f"speakerd needs Python >= $(MIN_PYTHON), $(PYTHON) is {sys.version.split()[0]}: make PYTHON=python3.12 ...")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev$(GPU_EXTRA)]"
	touch $@

venv: $(BIN)/.installed

serve: venv
	@echo "speakerd: gRPC on 127.0.0.1:$(PORT), Prometheus metrics on http://127.0.0.1:$(METRICS_PORT)/metrics"
	@echo "  Start-up: health is NOT_SERVING until the log says 'SERVING ... after N s of start-up'"
	@echo "  (N is this machine's figure): the engine is built and passes its parity self-check; a GPU"
	@echo "  start also times kernels and captures graphs (docs/gpu.md); the first start also makes"
	@echo "  the default models in $(SPEAKERD_CACHE), counted in N."
	@echo "  The console scripts are in $(BIN) only (not on PATH): $(BIN)/speakerd and"
	@echo "  $(BIN)/speakerd-client (the same as $(BIN)/python -m speakerd / -m speakerd.client)."
	@echo "  From another shell in this directory:"
	@echo "    $(BIN)/speakerd-client health --wait 600 --target 127.0.0.1:$(PORT)"
	@echo "    $(BIN)/speakerd-client info --target 127.0.0.1:$(PORT)"
	@echo "    curl -s http://127.0.0.1:$(METRICS_PORT)/metrics | grep '^speakerd_'"
	@echo "  Ctrl-C (SIGINT) or SIGTERM drains the calls in progress (up to --drain-seconds), then stops."
	SPEAKERD_CACHE="$(SPEAKERD_CACHE)" $(BIN)/python -m speakerd serve --port $(PORT) --metrics-port $(METRICS_PORT)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports  # the package's layers (pyproject.toml [tool.importlinter])

pytest: venv
	$(BIN)/python -m pytest $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_FLAGS)

test: lint pytest

proto: venv
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. \
		--pyi_out=. speakerd/v1/speakerd.proto

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
