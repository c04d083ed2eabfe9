#!/usr/bin/env bash
# scripts/gpu_aot_check.py with triton 3.6, the version on the borrowed H200, beside the project's triton 3.2:
# a second virtual environment holding only that triton, which sees the project's .venv for everything else.
#   scripts/gpu_aot_check_triton36.sh [gpu_aot_check.py args]     (default JSON: out/gpu_aot_triton36.json)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv-triton36"
main_python="$root/.venv/bin/python"
[ -x "$main_python" ] || { echo "run scripts/setup.sh first (the project's .venv)" >&2; exit 1; }
if [ ! -x "$venv/bin/python" ]; then
  base="$("$main_python" -c "import sys, os; print(os.path.join(sys.base_prefix, 'bin', 'python3'))")"
  "$base" -m venv "$venv"
  "$venv/bin/pip" install -q --no-deps "triton==3.6.0"
  site="$("$main_python" -c "import site; print(site.getsitepackages()[0])")"
  own="$("$venv/bin/python" -c "import site; print(site.getsitepackages()[0])")"
  echo "$site" > "$own/zz_project_venv.pth"  # after the venv's own site-packages: its triton wins
fi
"$venv/bin/python" -c "import triton; assert triton.__version__.startswith('3.6'), triton.__version__"
args=("$@")
[[ " $* " == *" --json "* ]] || args+=(--json "$root/out/gpu_aot_triton36.json")
exec "$venv/bin/python" "$root/scripts/gpu_aot_check.py" "${args[@]}"
