#!/usr/bin/env bash
# Download here the wheels the borrowed GPU box (python 3.12, torch, triton, transformers; no network) lacks
# for the engine, into .gpu_wheels/ (git-ignored; carry it with the device run, under 64 MiB).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rm -rf "$root/.gpu_wheels"
"$root/.venv/bin/pip" download -q --only-binary=:all: --no-deps --python-version 3.12 \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 \
  -d "$root/.gpu_wheels" sentencepiece "llguidance==1.9.1" ml_dtypes jinja2 markupsafe tqdm
du -sh "$root/.gpu_wheels"
