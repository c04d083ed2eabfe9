#!/usr/bin/env bash
# Serve ERNIE-4.5 from the Triton model repository: sets up .venv if needed, renders the FastDeploy-named
# flags into a copy of model_repository/, starts tritonserver and waits for Ctrl-C.
#   scripts/serve.sh                          # embedded tiny model, HTTP 8000 / gRPC 8001 / metrics 8002
#   scripts/serve.sh --model /ckpt --max-model-len 8192 --reasoning-parser ernie-x1 --openai-port 9000
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ ! -x "$root/.venv/bin/python" ] || ! "$root/.venv/bin/python" -c "import ernie_serve, tritonclient" 2>/dev/null; then
  "$root/scripts/setup.sh"
fi
exec "$root/.venv/bin/python" -m ernie_serve.cli.serve "$@"
