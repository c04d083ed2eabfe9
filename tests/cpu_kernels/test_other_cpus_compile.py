"""The C kernels compile for x86 CPUs other than this one: they have AMX, AVX-512 (with and without VNNI), AVX2
and scalar paths, chosen by the compiler's target. The tiers this CPU has are built and run by the `isa` fixture
(conftest.py); one above it would otherwise not even be compiled before a user's machine does."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ernie_serve.cpu_kernels import build

CC = build.compiler()
TARGETS = ["x86-64", "x86-64-v3", "skylake-avx512", "cascadelake", "sapphirerapids"]


@pytest.mark.skipif(CC is None, reason="no C compiler")
@pytest.mark.parametrize("march", TARGETS)
def test_every_kernel_source_compiles_for(march, tmp_path: Path):
    for src in build._SOURCES:
        done = subprocess.run([CC, "-O2", f"-march={march}", "-fopenmp", "-c", str(src), "-o",
                               str(tmp_path / f"{src.stem}.o")], capture_output=True, text=True)
        assert done.returncode == 0, f"{src.name} for -march={march}:\n{done.stderr[-3000:]}"
