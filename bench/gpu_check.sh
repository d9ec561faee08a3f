#!/usr/bin/env bash
# Everything kvd checks and times on a GPU, in one call on the lent GPU machine:
#   1. the GPU tests (tests/gpu: VMM arena, kernels, GPU pool, GPU daemon + attach, same-GPU
#      handoff, GPU demo),
#   2. the reference PD demo with both daemons and engines on the GPU (outputs vs colocated);
#      demo2 / demo2-quick: the same split over GPUs 0 and 1 (needs a two-GPU machine),
#   3. bench/gpu.py (page moves, translation, finalize; ratios vs copy) and bench/gpu_transfer.py
#      (a 32k-token gemma-4-31b request and a mixed workload, same GPU and GPU 0 -> 1, vs raw copy).
#   mooncake: the Mooncake backend on CUDA arenas (Mooncake's CUDA build, carried trimmed in .whl/
#      by bench/mooncake_wheel.py): its GPU tests, then bench/gpu_transfer.py --backend mooncake
#      (the 32k request only, 3 passes: TCP moves ~1.6 GB/s); mooncake-probe: what each Mooncake
#      transport registers and moves on kvd's GPU memory (bench/mooncake_cuda_probe.py).
# Logs and the bench's JSON land in $OUT (the device tool brings them back).
#
#   bash bench/gpu_check.sh                  # tests, demo, bench (~6 min on an H200)
#   bash bench/gpu_check.sh tests bench      # any of: tests tests-handoff bench bench-quick transfer transfer01
#                                            #   targets nvlink wake demo demo-quick demo2 demo2-quick mooncake mooncake-probe vllm
#   targets: issue 16's targets in one run (bench/control_targets.py --quick --gpu: CPU control path + same-GPU transfer)
#
# Python packages the GPU image lacks travel as wheels in .whl/ (see docs/benchmarks.md, GPU);
# system libraries Mooncake needs and the host lacks come from its wheel (bench/mooncake_wheel.py libdir).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvd-gpu-check}
mkdir -p "$OUT"
STEPS=("$@")
[ ${#STEPS[@]} -gt 0 ] || STEPS=(tests demo bench)
# NVLink multicast stays off on the lent machines (it can wedge a shared host's GPUs).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  MCLIB=$(python3 bench/mooncake_wheel.py libdir /tmp/site) || exit 1
  [ -z "$MCLIB" ] || export LD_LIBRARY_PATH=$MCLIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
else
  export PYTHONPATH=$PWD
fi

{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  python3 -c "from kvd.backends.mooncake import build_info; print('mooncake:', build_info().describe())" 2>&1 | tail -1
  [ -z "${MCLIB:-}" ] || echo "system libraries from the mooncake wheel: $(ls "$MCLIB" | tr '\n' ' ')"
} 2>&1 | tee "$OUT/env.txt"

rc=0
step() {  # step NAME SECONDS CMD...: run, log to $OUT/NAME.log, remember a failure
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local r=${PIPESTATUS[0]}
  echo "=== $name: exit $r after $((SECONDS - t0)) s"
  [ "$r" -eq 0 ] || rc=1
}

# Tests in parallel (Triton compiles are CPU-bound; the tests are small next to the GPU).
# The timings come after them, alone on the GPU.
for what in "${STEPS[@]}"; do
  case $what in
    tests) step tests 180 python3 -m pytest -q -p no:cacheprovider -n 8 --timeout 150 tests/gpu ;;
    tests-handoff) step tests 120 python3 -m pytest -q -p no:cacheprovider -n 4 --timeout 90 tests/gpu/test_gpu_daemon.py tests/gpu/test_two_gpu_handoff.py ;;
    bench) step bench 240 python3 bench/gpu.py --json "$OUT/bench.json" ;;
    bench-quick) step bench 120 python3 bench/gpu.py --quick --json "$OUT/bench.json" ;;
    transfer) step transfer 180 python3 bench/gpu_transfer.py --both --json "$OUT/transfer.json" ;;
    transfer01) step transfer01 150 python3 bench/gpu_transfer.py --devices 0,1 --json "$OUT/transfer01.json" ;;
    targets) step targets 420 python3 bench/control_targets.py --quick --gpu --keep "$OUT/targets" ;;
    nvlink) step nvlink 60 python3 bench/nvlink_streams.py ;;
    wake) step wake 60 python3 bench/wake_probe.py ;;
    demo) step demo 200 python3 -m kvd.cli demo --device cuda --backend local --json "$OUT/demo.json" ;;
    demo-quick) step demo 120 python3 -m kvd.cli demo --device cuda --backend local --quick --json "$OUT/demo.json" ;;
    demo2) step demo2 200 python3 -m kvd.cli demo --device cuda --decode-device cuda:1 --backend local --json "$OUT/demo2.json" ;;
    demo2-quick) step demo2 120 python3 -m kvd.cli demo --device cuda --decode-device cuda:1 --backend local --quick --json "$OUT/demo2.json" ;;
    mooncake)
      # with the arena tests (chunks now RDMA-capable) and the local backend's handoff tests (shared fixture)
      step mooncake-tests 180 python3 -m pytest -q -p no:cacheprovider -n 4 --timeout 150 -rs tests/gpu/test_mooncake_gpu.py \
        tests/gpu/test_vmm_arena.py tests/gpu/test_gpu_daemon.py tests/gpu/test_two_gpu_handoff.py
      step transfer-mooncake 180 python3 bench/gpu_transfer.py --backend mooncake --both --json "$OUT/transfer-mooncake.json" ;;
    mooncake-probe) step mooncake-probe 180 python3 bench/mooncake_cuda_probe.py ;;
    vllm)  # the vLLM connector's GPU layouts (issue 15): round trip through two cuda daemons, then the copy bench
      step vllm-tests 240 python3 -m pytest -q -p no:cacheprovider --timeout 120 -rs tests/gpu/test_vllm_gpu_blocks.py tests/gpu/test_vllm_kernel.py tests/core/test_vllm_blocks.py
      step vllm-copy 180 python3 bench/vllm_gpu_copy.py ;;
    *) echo "unknown step $what (tests, tests-handoff, bench, bench-quick, transfer, transfer01, targets, nvlink, wake, demo, demo-quick, demo2, demo2-quick, mooncake, mooncake-probe, vllm)"; rc=2 ;;
  esac
done
exit $rc
