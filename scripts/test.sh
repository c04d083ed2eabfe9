#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: unit, parity with HF transformers, engine,
# kernels under the triton interpreter, and end-to-end tests against a real tritonserver.
#   scripts/test.sh [pytest args]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest "$@"
