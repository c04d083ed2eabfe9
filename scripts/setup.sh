#!/usr/bin/env bash
# Create .venv/ at the repo root with everything the project needs, and build the embedded tiny
# model. Idempotent: a second run with an unchanged pyproject.toml only checks and exits.
#   scripts/setup.sh            # runtime + Paddle's CPU build + tritonserver (nvidia-pytriton) + kernels + tests
#                               # + NIXL (the P/D KV transfer engine) + sglang-router (replicas)
# The tensor framework is an extra (pyproject.toml): `cpu` here; a GPU machine installs `gpu` (docs/gpu-images.md).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
venv="$root/.venv"
extras="cpu,server,kernels,test,nixl,router"
stamp="$venv/.ernie-setup"
want="$( (cat pyproject.toml; echo "$extras"; "$py" --version) | sha256sum | cut -d' ' -f1)"

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv"
  "$py" -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing the project and its dependencies ($extras) into .venv"
  # A host's pip config may list local indexes that do not exist; their warnings are noise.
  quiet() {
    set +e
    "$@" 2>&1 | grep -v "^WARNING: Location 'file:"
    local rc=${PIPESTATUS[0]}
    set -e
    return "$rc"
  }
  quiet "$venv/bin/pip" install -q --disable-pip-version-check --upgrade pip
  quiet "$venv/bin/pip" install -q --disable-pip-version-check -e ".[${extras}]"
  echo "$want" > "$stamp"
else
  echo "[setup] .venv is up to date"
fi
echo "[setup] building the embedded tiny model (skipped when already built)"
"$venv/bin/python" -W ignore -c "from ernie_serve.demo.tiny_model import ensure_tiny_model; print('[setup] tiny model:', ensure_tiny_model())"
