# One entry point for setting up, testing and benchmarking kvd.
#   make venv   -> .venv with torch (CPU pin on these machines), kvd and its dev/test extras
#   make test   -> the whole CPU test suite (what CI runs)
PY        ?= python3
VENV      ?= .venv
BIN        = $(VENV)/bin
# The CPU build of torch that lies on these machines' disk; any other version pulls a CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: venv test bench clean proto

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[dev,mooncake]"
	touch $@

venv: $(BIN)/.installed

test: venv
	$(BIN)/python -m pytest -q

bench: venv
	$(BIN)/python bench/pool.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# Regenerate the committed gRPC stubs (python, grpc, typed .pyi) from proto/.
# tests/daemon/test_proto_stubs.py fails when the committed stubs differ from what this produces.
proto: venv
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. \
		--mypy_out=. --mypy_grpc_out=. proto/kvd/v1/kvd.proto
