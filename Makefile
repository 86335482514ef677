# speakerd: `make serve` serves, `make test` tests; both build the environment first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 50051
METRICS_PORT ?= 9100
CACHE ?= $(HOME)/.cache/speakerd
# the GPU extra is installed when an NVIDIA driver answers; CUDA 13 drivers get cupy-cuda13x
GPU_EXTRA := $(shell nvidia-smi >/dev/null 2>&1 && (nvidia-smi | grep -q 'CUDA Version: 1[3-9]' && echo ,gpu-cuda13 || echo ,gpu))

.PHONY: venv serve test lint pytest proto clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev$(GPU_EXTRA)]"
	touch $@

venv: $(BIN)/.installed

serve: venv
	$(BIN)/python -m server serve --port $(PORT) --metrics-port $(METRICS_PORT)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

pytest: venv
	$(BIN)/python -m pytest

test: lint pytest

proto: venv
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=proto --grpc_python_out=proto \
		--pyi_out=proto proto/speakerd/v1/speakerd.proto

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
