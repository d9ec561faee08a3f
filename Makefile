# One entry point for setting up, testing and benchmarking kvd.
#   make venv   -> .venv with torch (CPU pin on these machines), kvd and its dev/test extras
#   make test   -> the whole CPU test suite (what CI runs)
PY        ?= python3
VENV      ?= .venv
BIN        = $(VENV)/bin
# The CPU build of torch that lies on these machines' disk; any other version pulls a CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: venv serve test bench clean proto

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[dev,mooncake]"
	touch $@

venv: $(BIN)/.installed

# kvd's main job on the embedded default: a daemon over a CPU shared-memory arena on
# unix:/tmp/kvd.sock (tiny-hybrid layout; see `kvd serve --help`). Ctrl-C / SIGTERM drains and stops.
serve: venv
	$(BIN)/kvd serve

test: venv
	$(BIN)/python -m pytest -q

bench: venv
	$(BIN)/python bench/pool.py
	$(BIN)/python bench/control_plane.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# Regenerate the committed gRPC stubs (python, grpc, typed .pyi) from proto/.
# tests/daemon/test_proto_stubs.py fails when the committed stubs differ from what this produces.
proto: venv
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. \
		--mypy_out=. --mypy_grpc_out=. proto/kvd/v1/kvd.proto
