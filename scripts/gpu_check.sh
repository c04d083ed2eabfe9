#!/usr/bin/env bash
# The GPU checks of the kernels backend, in one go (issue 11), on a box with torch + triton + transformers and
# no Paddle (the borrowed H200): kernel correctness and timing (gpu_kernel_check.py), then the engine end to
# end through LLM on the benchmark-size checkpoint (gpu_engine_check.py). JSON lands in $OUT (default ./out).
#   scripts/gpu_check.sh               # GPU: under 8 minutes on an H200
#   scripts/gpu_check.sh --cpu-smoke   # the same scripts on tiny shapes in triton's CPU interpreter (CI)
# Wheels the box lacks (sentencepiece, llguidance, ml_dtypes, ...) come from .gpu_wheels/ when it is there
# (scripts/gpu_wheels.sh fills it here; carry it with the run).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$root/out}"
mkdir -p "$out"
py="${PYTHON:-python3}"
smoke=()
[ "${1:-}" = "--cpu-smoke" ] && smoke=(--cpu-smoke)
if [ -d "$root/.gpu_wheels" ] && [ ${#smoke[@]} -eq 0 ]; then
  site="$root/.gpu_site"
  "$py" -m pip install -q --no-index --no-deps --target "$site" "$root"/.gpu_wheels/*.whl \
    > "$out/gpu_wheels_install.log" 2>&1 || echo "warning: carried wheels did not all install (see $out/gpu_wheels_install.log)"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$root/backend:$root/kernels${PYTHONPATH:+:$PYTHONPATH}"
rc=0
timeout 150 "$py" "$root/scripts/gpu_kernel_check.py" --out "$out" "${smoke[@]}" || rc=$?
timeout 330 "$py" "$root/scripts/gpu_engine_check.py" --out "$out" --budget-s 270 "${smoke[@]}" || rc=$?
echo "gpu_check: exit $rc; results in $out"
exit $rc
