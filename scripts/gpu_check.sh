#!/usr/bin/env bash
# The GPU checks of the kernels backend, in one go. First, where Paddle with CUDA is installed (the production
# image), the production path: Paddle GPU tensors into the kernels (gpu_paddle_check.py: launch stream, logits
# against the reference backend, graphs, memory, decode rates, data-parallel replicas on two GPUs). Then, with torch
# (the borrowed GPU boxes have torch + triton + transformers and no Paddle): kernel correctness and timing
# (gpu_kernel_check.py) and the engine end to end against HF transformers (gpu_engine_check.py).
# JSON lands in $OUT (default ./out).
#   scripts/gpu_check.sh               # GPU: under 8 minutes on an H200 (torch only)
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
paddle_gpu='import paddle, sys; sys.exit(0 if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() else 1)'
if { [ ${#smoke[@]} -gt 0 ] && "$py" -c "import paddle" 2>/dev/null; } || "$py" -c "$paddle_gpu" 2>/dev/null; then
  timeout 240 "$py" "$root/scripts/gpu_paddle_check.py" --out "$out" "${smoke[@]}" || rc=$?
else
  echo "gpu_check: no Paddle with CUDA here: the production path (Paddle GPU tensors) is not checked on this box"
fi
timeout 150 "$py" "$root/scripts/gpu_kernel_check.py" --out "$out" "${smoke[@]}" || rc=$?
timeout 330 "$py" "$root/scripts/gpu_engine_check.py" --out "$out" --budget-s 270 "${smoke[@]}" || rc=$?
echo "gpu_check: exit $rc; results in $out"
exit $rc
